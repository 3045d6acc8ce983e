#!/usr/bin/env bash
# One short GPU-machine call for the HC read (issue 8): builds only the needed targets, then, in
# order of use while time is left: test_cuda_hc, the HC rows of cuda_kernel_bench (--hc-only),
# the full-geometry bench (depth 8192) at TP=1 and TP=2, test_cuda_pdl, the engine fixture test
# at TP=2, compute-sanitizer memcheck on test_cuda_hc.
# Usage on the 2-GPU machine: bash scripts/gpu/hc_run.sh
# Env: FN_BUILD_DIR (default build-gpu), FN_BUDGET_S (default 110: no new item past it minus
# the item's need). Logs under /tmp/hc-logs, copied to $OUT (or /tmp/hc-out) at the end; a
# compact summary on stdout.
set -u
cd "$(dirname "$0")/../.."
final=${OUT:-/tmp/hc-out}
out=/tmp/hc-logs
mkdir -p "$final" "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
budget=${FN_BUDGET_S:-110}
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
# time_for NEED WHAT: true when NEED seconds are left in the budget (else says what is skipped).
time_for() {
  if [ $((SECONDS + $1)) -gt "$budget" ]; then
    echo "== skipped (time): $2"
    return 1
  fi
}
run_test() {  # run_test TARGET NEED
  local tst=$1 t=$SECONDS
  time_for "$2" "$tst" || return 0
  timeout $((budget - SECONDS)) "$b/tests/$tst" >"$out/$tst.log" 2>&1
  echo "== $tst rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR|MESSAGE|FAILED|THREW|test cases|assertions:" "$out/$tst.log" | cut -c1-240 |
    head -12
}
bench() {  # bench NP
  local np=$1 f="$out/bench_tp$1" t=$SECONDS
  time_for 25 "bench np $np" || return 0
  timeout 40 $mpi -np "$np" "$b/cuda/cuda_model_bench" --config configs/qwen3.8-flash-next.json \
    --depth 8192 --tokens 32 --json "$f.json" >"$f.txt" 2>&1
  echo "== bench TP=$np rc=$? ($((SECONDS - t)) s)"
  grep -E "^\| [0-9]|ms/token" "$f.txt" | cut -c1-240 | head -4
  grep -iE "error|what\(\)" "$f.txt" | head -3 | cut -c1-240
}

t=$SECONDS
if ! FN_BUILD_DIR=$b timeout 75 bash scripts/gpu/build.sh test_cuda_hc test_cuda_pdl \
  test_cuda_model cuda_model_bench cuda_kernel_bench >"$out/build.log" 2>&1; then
  grep -E "error|FAILED" "$out/build.log" | head -20
  tail -4 "$out/build.log"
  cp "$out/build.log" "$final/"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"

run_test test_cuda_hc 10
if time_for 8 "cuda_kernel_bench --hc-only"; then
  timeout 20 "$b/cuda/cuda_kernel_bench" --hc-only >"$out/kernel_bench.txt" 2>&1
  echo "== cuda_kernel_bench --hc-only rc=$?"
  grep -E "hc_|error" "$out/kernel_bench.txt" | cut -c1-200 | head -6
fi
bench 1
bench 2
run_test test_cuda_pdl 8
if time_for 20 "test_cuda_model np 2"; then
  t=$SECONDS
  timeout $((budget - SECONDS)) $mpi -np 2 "$b/tests/test_cuda_model" >"$out/test_cuda_model.log" 2>&1
  echo "== test_cuda_model (np 2) rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR|THREW|test cases|assertions:" "$out/test_cuda_model.log" | sort -u | cut -c1-240 |
    head -12
fi
if time_for 12 "memcheck test_cuda_hc"; then
  t=$SECONDS
  timeout $((budget - SECONDS)) compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$b/tests/test_cuda_hc" >"$out/memcheck_hc.log" 2>&1
  echo "== memcheck test_cuda_hc rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR SUMMARY|Invalid|test cases" "$out/memcheck_hc.log" | head -4
fi
for f in build.log test_cuda_hc.log test_cuda_pdl.log test_cuda_model.log bench_tp1.txt \
  bench_tp2.txt kernel_bench.txt memcheck_hc.log; do
  [ -f "$out/$f" ] && cp "$out/$f" "$final/"
done
echo "== done ($SECONDS s)"
