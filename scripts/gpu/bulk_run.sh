#!/usr/bin/env bash
# One GPU-machine call for the bulk-copy routed-expert kernels (session 10, issue 8): builds the
# working tree, runs the routed-expert tests, the kernel bench rows (--nvfp4-only), the model test
# at np 1, cuda_model_bench TP=1 (depth 8192, 64 tokens) with --moe-bulk 0 and 1 alternated
# twice (and FN_BULK_EXTRA, extra cuda_model_bench flags for a third pair), then
# compute-sanitizer memcheck, racecheck and synccheck of the bulk test cases. Logs to $OUT.
# Usage: `run` with carry [".deps"] and `bash scripts/gpu/bulk_run.sh`.
set -u
cd "$(dirname "$0")/../.."
fn_out_default=/tmp/bulk-out
source scripts/gpu/common.sh
if ! FN_BUILD_DIR=$b timeout 300 bash scripts/gpu/build.sh cuda_model_bench cuda_kernel_bench \
  test_cuda_model test_cuda_moe_nvfp4 test_cuda_moe_prefill >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -20
  exit 1
fi
echo "== build done ($((SECONDS - t0)) s)"
for tst in test_cuda_moe_nvfp4 test_cuda_moe_prefill; do
  timeout 150 "$b/tests/$tst" >"$out/$tst.log" 2>&1
  echo "$tst rc=$? $(grep -E 'test cases' "$out/$tst.log" | tr -s ' ')"
  grep -E "ERROR|FAILED|bulk I|worst" "$out/$tst.log" | head -12 | cut -c1-300
done
timeout 120 "$b/cuda/cuda_kernel_bench" --nvfp4-only >"$out/kernel_bench.log" 2>&1
echo "cuda_kernel_bench rc=$?"
grep -E "moe_" "$out/kernel_bench.log" | head -20 | cut -c1-150
timeout 200 $mpi -np 1 "$b/tests/test_cuda_model" >"$out/model.log" 2>&1
echo "test_cuda_model np 1 rc=$? $(grep -E 'test cases' "$out/model.log" | tr -s ' ')"
grep -E "ERROR|FAILED" "$out/model.log" | head -6 | cut -c1-300
for flags in "--moe-bulk 0" "--moe-bulk 1" "--moe-bulk 0" "--moe-bulk 1" ${FN_BULK_EXTRA:+"$FN_BULK_EXTRA"}; do
  # shellcheck disable=SC2086
  echo "cuda_model_bench TP=1 $flags $(timeout 100 $mpi -np 1 "$b/cuda/cuda_model_bench" \
    --config configs/qwen3.8-flash-next.json --depth 8192 --tokens 64 $flags 2>&1 |
    grep -E "^\| [0-9]" | cut -c1-80)"
done
for tool in memcheck racecheck synccheck; do
  timeout 90 compute-sanitizer --tool "$tool" --error-exitcode 9 \
    "$b/tests/test_cuda_moe_nvfp4" -tc="*bulk*" >"$out/$tool.log" 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log" | tail -1)"
done
echo "== total $((SECONDS - t0)) s"
