#!/usr/bin/env bash
# One GPU-machine call (2 H200s, <= 150 s) for the NVFP4 routed-expert streaming pass of issue 8.
# Builds only the targets it runs, then, each only while time is left (FN_BUDGET_S, default 145):
#   phase 1 (correctness, concurrently): mpirun -np 2 test_cuda_model (both GPUs),
#           test_cuda_moe_nvfp4 + test_cuda_nvfp4_bits on GPU 0, compute-sanitizer memcheck of
#           test_cuda_moe_nvfp4 on GPU 1;
#   phase 2 (timing, one process per GPU): GPU 0 cuda_kernel_bench (FN_PDL=0; the moe rows: µs and
#           GB/s at the TP=1/2/4 shapes) then test_cuda_decode_ops (prints the router's µs per
#           launch); GPU 1 cuda_model_bench at TP=1;
#   phase 3: cuda_model_bench at TP=2.
# Usage: FN_BUILD_DIR=../../build-h4 bash scripts/gpu/moe_run.sh. Logs under $OUT (or
# /tmp/moe-out); a compact summary on stdout.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/moe-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
budget=${FN_BUDGET_S:-145}
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
bench_args="--config configs/qwen3.8-flash-next.json --depth 8192 --tokens ${FN_TOKENS:-32}"
# until END: seconds from now to END (at least 5).
until_s() {
  local s=$(($1 - SECONDS))
  [ "$s" -lt 5 ] && s=5
  echo "$s"
}
summary() { grep -E "$2" "$1" 2>/dev/null | sort -u | cut -c1-200 | head -"${3:-8}"; }

t=$SECONDS
if ! FN_BUILD_DIR=$b timeout $((budget - 25)) bash scripts/gpu/build.sh test_cuda_moe_nvfp4 \
  test_cuda_nvfp4_bits test_cuda_decode_ops test_cuda_model cuda_model_bench cuda_kernel_bench \
  >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -30
  tail -5 "$out/build.log"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"
rest=$((budget - SECONDS))
# Phase ends: correctness gets 30% of what is left, timing 40%, the TP=2 bench the rest.
end1=$((SECONDS + rest * 3 / 10))
end2=$((SECONDS + rest * 7 / 10))

t=$SECONDS
timeout "$(until_s $end1)" $mpi -np 2 "$b/tests/test_cuda_model" >"$out/test_cuda_model.log" 2>&1 &
p_model=$!
(
  CUDA_VISIBLE_DEVICES=1 timeout "$(until_s $end1)" compute-sanitizer --tool memcheck \
    --error-exitcode 9 "$b/tests/test_cuda_moe_nvfp4" >"$out/memcheck_moe.log" 2>&1
  echo "rc=$?" >>"$out/memcheck_moe.log"
) &
p_mem=$!
for tst in test_cuda_moe_nvfp4 test_cuda_nvfp4_bits; do
  CUDA_VISIBLE_DEVICES=0 timeout "$(until_s $end1)" "$b/tests/$tst" >"$out/$tst.log" 2>&1
  echo "== $tst rc=$? ($((SECONDS - t)) s)"
  summary "$out/$tst.log" "ERROR|FAILED|THREW|test cases" 12
done
wait "$p_model"
echo "== test_cuda_model -np 2 rc=$? ($((SECONDS - t)) s)"
summary "$out/test_cuda_model.log" "ERROR|FAILED|THREW|test cases|assertions"
wait "$p_mem"
echo "== memcheck test_cuda_moe_nvfp4 ($((SECONDS - t)) s)"
summary "$out/memcheck_moe.log" "ERROR SUMMARY|Invalid|test cases|^rc="

t=$SECONDS
(
  CUDA_VISIBLE_DEVICES=1 timeout "$(until_s $end2)" $mpi -x CUDA_VISIBLE_DEVICES -np 1 \
    "$b/cuda/cuda_model_bench" $bench_args --json "$out/model_tp1.json" >"$out/model_tp1.txt" 2>&1
  echo "rc=$?" >>"$out/model_tp1.txt"
) &
p_tp1=$!
CUDA_VISIBLE_DEVICES=0 FN_PDL=0 timeout "$(until_s $((end2 - 6)))" "$b/cuda/cuda_kernel_bench" \
  --json "$out/kernel_bench.json" >"$out/kernel_bench.txt" 2>&1
echo "== cuda_kernel_bench (GPU 0, PDL off) rc=$? ($((SECONDS - t)) s)"
grep -E "^device|moe" "$out/kernel_bench.txt" | cut -c1-150
CUDA_VISIBLE_DEVICES=0 timeout "$(until_s $end2)" "$b/tests/test_cuda_decode_ops" \
  >"$out/test_cuda_decode_ops.log" 2>&1
echo "== test_cuda_decode_ops rc=$? ($((SECONDS - t)) s)"
summary "$out/test_cuda_decode_ops.log" "ERROR|FAILED|THREW|test cases|outer.*us per launch" 12
wait "$p_tp1"
echo "== cuda_model_bench TP=1 (GPU 1) ($((SECONDS - t)) s)"
summary "$out/model_tp1.txt" "^\| [0-9]|ms/token|^rc=|rror|what\(\)" 6

t=$SECONDS
timeout "$(until_s $budget)" $mpi -np 2 "$b/cuda/cuda_model_bench" $bench_args \
  --json "$out/model_tp2.json" >"$out/model_tp2.txt" 2>&1
echo "== cuda_model_bench TP=2 rc=$? ($((SECONDS - t)) s)"
summary "$out/model_tp2.txt" "^\| [0-9]|ms/token|rror|what\(\)" 6
echo "== done ($SECONDS s)"
