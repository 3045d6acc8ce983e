#!/usr/bin/env bash
# One GPU-machine call (2 H200s, <= 290 s) for the tensor-core NVFP4 expert kernels (issue 8,
# session 5, helper m5). Builds only the targets it runs, then, each only while time is left
# (FN_BUDGET_S, default 280):
#   phase 1 (correctness, concurrently): test_cuda_moe_nvfp4 + test_cuda_nvfp4_bits +
#           test_cuda_pdl on GPU 0, compute-sanitizer memcheck of test_cuda_moe_nvfp4 on GPU 1;
#   phase 2 (timing): GPU 0 cuda_kernel_bench --nvfp4-only (both kernels, TP=1/2/4 shapes, the
#           tensor-core team sweep) with FN_PDL=0 then FN_PDL=1; GPU 1 cuda_model_bench at TP=1;
#   phase 3: mpirun -np 2 test_cuda_model, then cuda_model_bench at TP=2.
# Usage: FN_BUILD_DIR=../../build-m5 bash scripts/gpu/moe5_run.sh. Logs under $OUT (or
# /tmp/moe5-out); a compact summary on stdout.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/moe5-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
budget=${FN_BUDGET_S:-280}
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
bench_args="--config configs/qwen3.8-flash-next.json --depth 8192 --tokens ${FN_TOKENS:-32}"
until_s() {
  local s=$(($1 - SECONDS))
  [ "$s" -lt 5 ] && s=5
  echo "$s"
}
summary() { grep -E "$2" "$1" 2>/dev/null | sort -u | cut -c1-220 | head -"${3:-8}"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | head -2

t=$SECONDS
if ! FN_BUILD_DIR=$b timeout $((budget - 60)) bash scripts/gpu/build.sh test_cuda_moe_nvfp4 \
  test_cuda_nvfp4_bits test_cuda_pdl test_cuda_model cuda_model_bench cuda_kernel_bench \
  >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -30
  tail -5 "$out/build.log"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"
rest=$((budget - SECONDS))
end1=$((SECONDS + rest * 4 / 10))
end2=$((SECONDS + rest * 7 / 10))

t=$SECONDS
(
  CUDA_VISIBLE_DEVICES=1 timeout "$(until_s $end1)" compute-sanitizer --tool memcheck \
    --error-exitcode 9 "$b/tests/test_cuda_moe_nvfp4" >"$out/memcheck_moe.log" 2>&1
  echo "rc=$?" >>"$out/memcheck_moe.log"
) &
p_mem=$!
for tst in test_cuda_moe_nvfp4 test_cuda_nvfp4_bits test_cuda_pdl; do
  CUDA_VISIBLE_DEVICES=0 timeout "$(until_s $end1)" "$b/tests/$tst" >"$out/$tst.log" 2>&1
  echo "== $tst rc=$? ($((SECONDS - t)) s)"
  summary "$out/$tst.log" "ERROR|FAILED|THREW|test cases|chain step|worst" 40
done
wait "$p_mem"
echo "== memcheck test_cuda_moe_nvfp4 ($((SECONDS - t)) s)"
summary "$out/memcheck_moe.log" "ERROR SUMMARY|Invalid|test cases|^rc=" 8

t=$SECONDS
(
  CUDA_VISIBLE_DEVICES=1 timeout "$(until_s $end2)" $mpi -x CUDA_VISIBLE_DEVICES -np 1 \
    "$b/cuda/cuda_model_bench" $bench_args --json "$out/model_tp1.json" >"$out/model_tp1.txt" 2>&1
  echo "rc=$?" >>"$out/model_tp1.txt"
) &
p_tp1=$!
for pdl in 0 1; do
  CUDA_VISIBLE_DEVICES=0 FN_PDL=$pdl timeout "$(until_s $((end2 - 5)))" \
    "$b/cuda/cuda_kernel_bench" --nvfp4-only --json "$out/kernel_bench_pdl$pdl.json" \
    >"$out/kernel_bench_pdl$pdl.txt" 2>&1
  echo "== cuda_kernel_bench --nvfp4-only FN_PDL=$pdl rc=$? ($((SECONDS - t)) s)"
  grep -E "^device|moe" "$out/kernel_bench_pdl$pdl.txt" | cut -c1-150
done
wait "$p_tp1"
echo "== cuda_model_bench TP=1 (GPU 1) ($((SECONDS - t)) s)"
summary "$out/model_tp1.txt" "^\| [0-9]|ms/token|^rc=|rror|what\(\)" 6

t=$SECONDS
timeout "$(until_s $((budget - 45)))" $mpi -np 2 "$b/tests/test_cuda_model" \
  >"$out/test_cuda_model.log" 2>&1
echo "== test_cuda_model -np 2 rc=$? ($((SECONDS - t)) s)"
summary "$out/test_cuda_model.log" "ERROR|FAILED|THREW|test cases|assertions"
t=$SECONDS
timeout "$(until_s $budget)" $mpi -np 2 "$b/cuda/cuda_model_bench" $bench_args \
  --json "$out/model_tp2.json" >"$out/model_tp2.txt" 2>&1
echo "== cuda_model_bench TP=2 rc=$? ($((SECONDS - t)) s)"
summary "$out/model_tp2.txt" "^\| [0-9]|ms/token|rror|what\(\)" 6
echo "== done ($SECONDS s)"
