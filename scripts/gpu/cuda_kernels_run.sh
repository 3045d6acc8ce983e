#!/usr/bin/env bash
# One GPU-machine call for the cuda/ decode kernels: build the kernel tests and
# cuda_kernel_bench, run the gpu-labelled kernel tests, compute-sanitizer memcheck on two test
# binaries, and the benchmark (table + JSON, with --sweep over the launch plans). Logs go to
# $OUT (or /tmp/cuda-out). Usage on the GPU machine: bash scripts/gpu/cuda_kernels_run.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/cuda-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
nvidia-smi >"$out/machine.log" 2>&1
grep -E "H200|Driver" "$out/machine.log" | head -3

t=$SECONDS
if ! FN_BUILD_DIR=$b timeout 200 bash scripts/gpu/build.sh test_cuda_gemv test_cuda_moe_nvfp4 \
  test_cuda_hc cuda_kernel_bench >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"

t=$SECONDS
(cd "$b" && timeout 150 ctest -L gpu -R "test_cuda_" --output-on-failure) >"$out/ctest.log" 2>&1
echo "== ctest rc=$? ($((SECONDS - t)) s)"
grep -E "Test +#|tests passed|ERROR|MESSAGE|FAILED|wrong|test cases|assertions" "$out/ctest.log" |
  cut -c1-300 | head -60

for tst in test_cuda_hc test_cuda_moe_nvfp4; do
  t=$SECONDS
  timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 "$b/tests/$tst" \
    >"$out/memcheck_$tst.log" 2>&1
  echo "== memcheck $tst rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR SUMMARY|Invalid|test cases" "$out/memcheck_$tst.log" | head -8
done

t=$SECONDS
timeout 120 "$b/bench/cuda_kernel_bench" --sweep --json "$out/bench.json" >"$out/bench.txt" 2>&1
echo "== bench rc=$? ($((SECONDS - t)) s)"
grep -v " sweep " "$out/bench.txt" | head -40
