#!/usr/bin/env bash
# One GPU-machine call for a few CUDA test binaries: builds the named test targets, runs each
# under ctest, then compute-sanitizer memcheck on each. Logs go to $OUT (or /tmp/gpu-out).
# Usage on the GPU machine: bash scripts/gpu/run_tests.sh test_cuda_x [test_cuda_y ...]
# Env: FN_BUILD_DIR (default build-gpu), FN_MEMCHECK=0 to skip the sanitizer pass.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
t=$SECONDS
if ! FN_BUILD_DIR=$b timeout 300 bash scripts/gpu/build.sh "$@" >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40
  tail -20 "$out/build.log"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"
for tst in "$@"; do
  t=$SECONDS
  (cd "$b" && timeout 200 ctest -R "^$tst\$" --output-on-failure) >"$out/ctest_$tst.log" 2>&1
  echo "== ctest $tst rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR|MESSAGE|FAILED|CHECK|REQUIRE|test cases|assertions|Passed|Failed" \
    "$out/ctest_$tst.log" | cut -c1-400 | head -60
  if [ "${FN_MEMCHECK:-1}" != 0 ]; then
    t=$SECONDS
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$b/tests/$tst" \
      >"$out/memcheck_$tst.log" 2>&1
    echo "== memcheck $tst rc=$? ($((SECONDS - t)) s)"
    grep -E "ERROR SUMMARY|Invalid|test cases" "$out/memcheck_$tst.log" | head -8
  fi
done
