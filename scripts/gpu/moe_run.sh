#!/usr/bin/env bash
# One GPU-machine call (2 H200s, <= 150 s) for the NVFP4 routed-expert streaming pass of issue 8:
# builds only the targets it runs, then, each only while time is left (FN_BUDGET_S, default 140):
#   GPU 0: cuda_kernel_bench (FN_PDL=0; the moe rows: µs, GB/s at TP=1/2/4 shapes), then the kernel
#          tests (test_cuda_moe_nvfp4, test_cuda_nvfp4_bits, test_cuda_decode_ops);
#   GPU 1: cuda_model_bench at TP=1, then compute-sanitizer memcheck on test_cuda_moe_nvfp4;
#   both:  mpirun -np 2 test_cuda_model, then cuda_model_bench at TP=2.
# Usage: FN_BUILD_DIR=../../build-h4 bash scripts/gpu/moe_run.sh. Logs under $OUT (or
# /tmp/moe-out); a compact summary on stdout.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/moe-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
budget=${FN_BUDGET_S:-140}
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
bench_args="--config configs/qwen3.8-flash-next.json --depth 8192 --tokens ${FN_TOKENS:-32}"
deadline=$budget  # the lanes below end 55 s earlier, leaving the two-GPU items their time
# time_for NEED WHAT: true when NEED seconds are left before the deadline (else says what is
# skipped); left: the seconds left.
time_for() {
  if [ $((SECONDS + $1)) -gt "$deadline" ]; then
    echo "== skipped (time): $2"
    return 1
  fi
}
left() { echo $((deadline - SECONDS)); }

t=$SECONDS
if ! FN_BUILD_DIR=$b timeout $((budget - 45)) bash scripts/gpu/build.sh test_cuda_moe_nvfp4 \
  test_cuda_nvfp4_bits test_cuda_decode_ops test_cuda_model cuda_model_bench cuda_kernel_bench \
  >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -30
  tail -5 "$out/build.log"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"

lane0() {
  local t=$SECONDS
  deadline=$((budget - 55))
  if time_for 30 "cuda_kernel_bench"; then
    CUDA_VISIBLE_DEVICES=0 FN_PDL=0 timeout $(($(left) - 20)) "$b/cuda/cuda_kernel_bench" \
      --json "$out/kernel_bench.json" >"$out/kernel_bench.txt" 2>&1
    echo "== cuda_kernel_bench (GPU 0, PDL off) rc=$? ($((SECONDS - t)) s)"
    grep -E "^device|moe" "$out/kernel_bench.txt" | cut -c1-150
  fi
  for tst in test_cuda_moe_nvfp4 test_cuda_nvfp4_bits test_cuda_decode_ops; do
    t=$SECONDS
    time_for 8 "$tst" || continue
    CUDA_VISIBLE_DEVICES=0 timeout $(($(left) - 3)) "$b/tests/$tst" >"$out/$tst.log" 2>&1
    echo "== $tst (GPU 0) rc=$? ($((SECONDS - t)) s)"
    grep -E "ERROR|FAILED|THREW|test cases|us per launch" "$out/$tst.log" | cut -c1-240 | head -12
  done
}
lane1() {
  local t=$SECONDS
  deadline=$((budget - 55))
  if time_for 30 "cuda_model_bench TP=1"; then
    CUDA_VISIBLE_DEVICES=1 timeout $(($(left) - 25)) $mpi -x CUDA_VISIBLE_DEVICES -np 1 "$b/cuda/cuda_model_bench" \
      $bench_args --json "$out/model_tp1.json" >"$out/model_tp1.txt" 2>&1
    echo "== cuda_model_bench TP=1 (GPU 1) rc=$? ($((SECONDS - t)) s)"
    grep -E "^\| [0-9]|ms/token" "$out/model_tp1.txt" | cut -c1-240 | head -6
    grep -iE "error|what\(\)" "$out/model_tp1.txt" | head -3 | cut -c1-240
  fi
  t=$SECONDS
  if time_for 20 "memcheck test_cuda_moe_nvfp4"; then
    CUDA_VISIBLE_DEVICES=1 timeout $(($(left) - 8)) compute-sanitizer --tool memcheck \
      --error-exitcode 9 "$b/tests/test_cuda_moe_nvfp4" >"$out/memcheck_moe.log" 2>&1
    echo "== memcheck test_cuda_moe_nvfp4 (GPU 1) rc=$? ($((SECONDS - t)) s)"
    grep -E "ERROR SUMMARY|Invalid|test cases" "$out/memcheck_moe.log" | head -6
  fi
}
# The two lanes write their summaries to files, printed in order once both end.
lane0 >"$out/lane0.sum" 2>&1 &
p0=$!
lane1 >"$out/lane1.sum" 2>&1 &
p1=$!
wait "$p0"
wait "$p1"
cat "$out/lane0.sum" "$out/lane1.sum"

t=$SECONDS
if time_for 25 "test_cuda_model -np 2"; then
  timeout $(($(left) - 15)) $mpi -np 2 "$b/tests/test_cuda_model" >"$out/test_cuda_model.log" 2>&1
  echo "== test_cuda_model -np 2 rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR|FAILED|THREW|test cases|assertions" "$out/test_cuda_model.log" | sort -u |
    cut -c1-240 | head -8
fi
t=$SECONDS
if time_for 15 "cuda_model_bench TP=2"; then
  timeout $(($(left) - 2)) $mpi -np 2 "$b/cuda/cuda_model_bench" $bench_args \
    --json "$out/model_tp2.json" >"$out/model_tp2.txt" 2>&1
  echo "== cuda_model_bench TP=2 rc=$? ($((SECONDS - t)) s)"
  grep -E "^\| [0-9]|ms/token" "$out/model_tp2.txt" | cut -c1-240 | head -6
  grep -iE "error|what\(\)" "$out/model_tp2.txt" | head -3 | cut -c1-240
fi
echo "== done ($SECONDS s)"
