#!/usr/bin/env bash
# One GPU-machine call for the fused MoE shared-expert launches (cuda/kernels/moe_shared.h, issue 8):
# build, the gpu tests of the fused kernels and of the kernels whose device code they share
# (gemv, decode ops), compute-sanitizer memcheck and racecheck on test_cuda_moe_shared, and
# cuda_kernel_bench --moe-shared-only (fused vs unfused, µs). Logs go to $OUT (or /tmp/ms-out).
# Usage on the GPU machine: FN_BUILD_DIR=... bash scripts/gpu/moe_shared_run.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/ms-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
nvidia-smi >"$out/machine.log" 2>&1
grep -E "H200|Driver" "$out/machine.log" | head -3

t=$SECONDS
if ! FN_BUILD_DIR=$b timeout 170 bash scripts/gpu/build.sh test_cuda_moe_shared test_cuda_gemv \
  test_cuda_decode_ops cuda_kernel_bench >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"

for tst in test_cuda_moe_shared test_cuda_gemv test_cuda_decode_ops; do
  t=$SECONDS
  timeout 40 "$b/tests/$tst" >"$out/$tst.log" 2>&1
  echo "== $tst rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR|FAILED|test cases|assertions|differ|wrong" "$out/$tst.log" | cut -c1-300 | head -20
done

for tool in memcheck racecheck; do
  t=$SECONDS
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 "$b/tests/test_cuda_moe_shared" \
    >"$out/${tool}_moe_shared.log" 2>&1
  echo "== $tool test_cuda_moe_shared rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race|test cases" "$out/${tool}_moe_shared.log" |
    head -8
done

t=$SECONDS
timeout 60 "$b/cuda/cuda_kernel_bench" --moe-shared-only --json "$out/bench.json" \
  >"$out/bench.txt" 2>&1
echo "== bench rc=$? ($((SECONDS - t)) s)"
cat "$out/bench.txt" | head -40
