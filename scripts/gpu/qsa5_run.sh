#!/usr/bin/env bash
# One GPU-machine call for the QSA decode launches (cuda/kernels/qsa.h, issue 8): build, test_cuda_qsa
# (the four-launch path against the CPU ops and bitwise against the five-launch path) and
# test_cuda_qsa_prefill (prefill rows bitwise equal to decode steps), the FN_BENCH=1 bench (us per
# step of both paths and of each kernel alone at t = 8191, real shapes), compute-sanitizer
# memcheck on the path comparisons (tiny and real shapes), the graph replay and launcher cases,
# racecheck on the small sanitizer case (g3_tiny, both paths, t = 0..45). Logs go to $OUT (or /tmp/q5-out).
# Usage on the GPU machine: FN_BUILD_DIR=... bash scripts/gpu/qsa5_run.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/q5-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
nvidia-smi >"$out/machine.log" 2>&1
grep -E "H200|Driver" "$out/machine.log" | head -3
start=$SECONDS

t=$SECONDS
if ! FN_BUILD_DIR=$b timeout 170 bash scripts/gpu/build.sh test_cuda_qsa test_cuda_qsa_prefill \
  >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"

t=$SECONDS
FN_BENCH=1 timeout 30 "$b/tests/test_cuda_qsa" -tc="*bench*" >"$out/bench.log" 2>&1
echo "== bench rc=$? ($((SECONDS - t)) s)"
grep -E "qsa bench|ERROR|FAILED|test cases" "$out/bench.log" | cut -c1-200

for tst in test_cuda_qsa test_cuda_qsa_prefill; do
  t=$SECONDS
  timeout 45 "$b/tests/$tst" >"$out/$tst.log" 2>&1
  echo "== $tst rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR|FAILED|test cases|assertions|CHECK|worst" "$out/$tst.log" | cut -c1-240 | head -24
done

left=$((290 - (SECONDS - start)))
t=$SECONDS
timeout $((left > 20 ? left / 2 : 10)) compute-sanitizer --tool memcheck --error-exitcode 9 \
  "$b/tests/test_cuda_qsa" -tc="*five-launch path bitwise*,*graph replay*,*launcher*" \
  >"$out/memcheck_qsa.log" 2>&1
echo "== memcheck test_cuda_qsa rc=$? ($((SECONDS - t)) s)"
grep -E "ERROR SUMMARY|Invalid|test cases|assertions" "$out/memcheck_qsa.log" | head -8

left=$((290 - (SECONDS - start)))
t=$SECONDS
timeout $((left > 10 ? left : 5)) compute-sanitizer --tool racecheck --error-exitcode 9 \
  "$b/tests/test_cuda_qsa" -tc="*sanitizer case*" >"$out/racecheck_qsa.log" 2>&1
echo "== racecheck test_cuda_qsa rc=$? ($((SECONDS - t)) s)"
grep -E "RACECHECK SUMMARY|ERROR SUMMARY|Race|hazard|test cases" "$out/racecheck_qsa.log" | head -8
echo "== total $((SECONDS - start)) s"
