#!/usr/bin/env bash
# One GPU-machine call for the kernel side of issue 8's first performance pass (router top-k,
# programmatic dependent launch): builds the kernel tests, test_cuda_model and cuda_model_bench,
# then runs, each only while time is left: the engine fixture test at TP=2 (graph == eager
# bitwise, ranks equal), the first kernel tests and the timings they print, the full-geometry
# bench (random weights, depth 8192) at TP=2 and TP=1 with PDL on and off (FN_PDL=0),
# cuda_kernel_bench (PDL off), the other kernel tests, and compute-sanitizer memcheck on the
# router, PDL-chain, NVFP4 and GEMV cases.
# Usage on the 2-GPU machine: bash scripts/gpu/perf_kernels_run.sh [all|tests|bench]
# Env: FN_BUILD_DIR (default build-gpu), FN_TESTS (kernel test targets), FN_TOKENS (default 32),
# FN_MEMCHECK=0 skips the sanitizer, FN_BUDGET_S (default 330: no new item past it minus the
# item's need). Logs under $OUT (or /tmp/perf-out); a summary on stdout.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/perf-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
mode=${1:-all}
tokens=${FN_TOKENS:-32}
budget=${FN_BUDGET_S:-330}
tests=${FN_TESTS:-test_cuda_moe_nvfp4 test_cuda_pdl test_cuda_decode_ops test_cuda_gdn \
test_cuda_gemv test_cuda_hc test_cuda_qsa test_cuda_ple test_cuda_sample}
first="test_cuda_moe_nvfp4 test_cuda_pdl test_cuda_decode_ops"  # run before the benches
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
# time_for NEED: true when NEED seconds are left in the budget (else says what is skipped).
time_for() {
  if [ $((SECONDS + $1)) -gt "$budget" ]; then
    echo "== skipped (time): $2"
    return 1
  fi
}
run_test() {
  local tst=$1 t=$SECONDS
  time_for 25 "ctest $tst" || return 0
  (cd "$b" && timeout 120 ctest -R "^$tst\$" --output-on-failure) >"$out/ctest_$tst.log" 2>&1
  echo "== ctest $tst rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR|MESSAGE|us per launch|PDL|FAILED|THREW|test cases" "$out/ctest_$tst.log" |
    cut -c1-300 | head -24
}
run_bench() {
  local np=$1 pdl=$2 t=$SECONDS f="$out/bench_tp$1_pdl$2"
  time_for 40 "bench TP=$np PDL=$pdl" || return 0
  FN_PDL=$pdl timeout 120 $mpi -x FN_PDL -np "$np" "$b/cuda/cuda_model_bench" \
    --config configs/qwen3.8-flash-next.json --depth 8192 --tokens "$tokens" --json "$f.json" \
    >"$f.txt" 2>&1
  echo "== bench TP=$np PDL=$pdl rc=$? ($((SECONDS - t)) s)"
  grep -E "^\| [0-9]" "$f.txt" | cut -c1-300
  grep -iE "error|what\(\)" "$f.txt" | head -3 | cut -c1-300
}

t=$SECONDS
targets="cuda_model_bench cuda_kernel_bench"
[ "$mode" != bench ] && targets="$targets test_cuda_model $tests"
# shellcheck disable=SC2086
if ! FN_BUILD_DIR=$b timeout 280 bash scripts/gpu/build.sh $targets >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -30
  tail -5 "$out/build.log"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"

if [ "$mode" != bench ]; then
  t=$SECONDS
  if time_for 40 "test_cuda_model"; then
    timeout 120 $mpi -np 2 "$b/tests/test_cuda_model" >"$out/test_cuda_model.log" 2>&1
    echo "== test_cuda_model -np 2 rc=$? ($((SECONDS - t)) s)"
    grep -E "ERROR|FAILED|THREW|test cases|assertions" "$out/test_cuda_model.log" | sort -u |
      cut -c1-300 | head -12
  fi
  for tst in $tests; do
    case " $first " in *" $tst "*) run_test "$tst" ;; esac
  done
  # The measurements the tests print (ctest shows output only on failure).
  if time_for 30 "timing cases"; then
    timeout 60 "$b/tests/test_cuda_decode_ops" -tc="*graph*" >"$out/timing_decode_ops.log" 2>&1
    timeout 60 "$b/tests/test_cuda_pdl" -tc="*chain*" >"$out/timing_pdl.log" 2>&1
    grep -hE "us per launch|PDL off" "$out/timing_decode_ops.log" "$out/timing_pdl.log" |
      cut -c1-200
  fi
fi
if [ "$mode" != tests ]; then
  for np in 2 1; do
    for pdl in 1 0; do run_bench $np $pdl; done
  done
fi
if [ "$mode" != tests ] && time_for 60 "cuda_kernel_bench"; then
  t=$SECONDS
  FN_PDL=0 timeout 90 "$b/cuda/cuda_kernel_bench" --json "$out/kernel_bench.json" \
    >"$out/kernel_bench.txt" 2>&1
  echo "== cuda_kernel_bench (PDL off) rc=$? ($((SECONDS - t)) s)"
  grep -E "moe|router|hc_mix" "$out/kernel_bench.txt" | cut -c1-200 | head -12
fi
if [ "$mode" != bench ]; then
  for tst in $tests; do
    case " $first " in *" $tst "*) ;; *) run_test "$tst" ;; esac
  done
  if [ "${FN_MEMCHECK:-1}" != 0 ]; then
    for spec in "test_cuda_decode_ops:*router*" "test_cuda_pdl:*" "test_cuda_moe_nvfp4:*real shapes*" \
      "test_cuda_gemv:*every variant*"; do
      tst=${spec%%:*}
      t=$SECONDS
      time_for 40 "memcheck $tst" || continue
      timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 "$b/tests/$tst" \
        -tc="${spec#*:}" >"$out/memcheck_$tst.log" 2>&1
      echo "== memcheck $tst (${spec#*:}) rc=$? ($((SECONDS - t)) s)"
      grep -E "ERROR SUMMARY|Invalid|test cases" "$out/memcheck_$tst.log" | head -6
    done
  fi
fi
echo "== done ($SECONDS s)"
