#!/usr/bin/env bash
# One GPU-machine call for the bulk-copy routed-expert kernels (sessions 10-11, issue 8): builds
# the working tree, runs the routed-expert tests, the kernel bench rows (--nvfp4-only), the model
# test at np 1 (and test_cuda_model_realwidth at np 1: part "realwidth"),
# cuda_model_bench TP=1 (depth 8192, 64 tokens) with the flags $FN_AB_A and $FN_AB_B alternated
# twice (default --moe-bulk 0 / 1; FN_BULK_EXTRA: extra flags for a fifth run; FN_AB_LIST: a
# '|'-separated list of flag sets to run instead, in order), then
# compute-sanitizer memcheck, racecheck and synccheck of the test cases matching $FN_SAN_TC
# (default *bulk*). FN_BULK_PARTS (default "tests bench model ab san") picks the parts after the
# build, so that one warm machine can take the work in two calls. Logs to $OUT.
# Usage: `run` with carry [".deps"] and `bash scripts/gpu/bulk_run.sh`.
set -u
cd "$(dirname "$0")/../.."
fn_out_default=/tmp/bulk-out
source scripts/gpu/common.sh
if ! FN_BUILD_DIR=$b timeout 300 bash scripts/gpu/build.sh cuda_model_bench cuda_kernel_bench \
  test_cuda_model test_cuda_moe_nvfp4 test_cuda_moe_prefill test_cuda_moe_shared \
  test_cuda_model_realwidth \
  >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -20
  exit 1
fi
echo "== build done ($((SECONDS - t0)) s)"
parts=" ${FN_BULK_PARTS:-tests bench model ab san} "
part() { [[ "$parts" == *" $1 "* ]]; }
part tests && for tst in test_cuda_moe_nvfp4 test_cuda_moe_prefill test_cuda_moe_shared; do
  timeout 150 "$b/tests/$tst" >"$out/$tst.log" 2>&1
  echo "$tst rc=$? $(grep -E 'test cases' "$out/$tst.log" | tr -s ' ')"
  grep -E "ERROR|FAILED|bulk I|worst" "$out/$tst.log" | head -12 | cut -c1-300
done
if part bench; then
  timeout 120 "$b/cuda/cuda_kernel_bench" --nvfp4-only >"$out/kernel_bench.log" 2>&1
  echo "cuda_kernel_bench rc=$?"
  grep -E "moe_" "$out/kernel_bench.log" | head -24 | cut -c1-150
fi
if part model; then
  timeout 200 $mpi -np 1 "$b/tests/test_cuda_model" >"$out/model.log" 2>&1
  echo "test_cuda_model np 1 rc=$? $(grep -E 'test cases' "$out/model.log" | tr -s ' ')"
  grep -E "ERROR|FAILED" "$out/model.log" | head -6 | cut -c1-300
fi
if part realwidth; then
  timeout 300 $mpi -np 1 "$b/tests/test_cuda_model_realwidth" >"$out/realwidth.log" 2>&1
  echo "test_cuda_model_realwidth np 1 rc=$? $(grep -E 'test cases' "$out/realwidth.log" | tr -s ' ')"
  grep -E "worst|ERROR|FAILED" "$out/realwidth.log" | sort -u | head -8 | cut -c1-300
fi
ab_a=${FN_AB_A:---moe-bulk 0} ab_b=${FN_AB_B:---moe-bulk 1}
ab=("$ab_a" "$ab_b" "$ab_a" "$ab_b" ${FN_BULK_EXTRA:+"$FN_BULK_EXTRA"})
[ -n "${FN_AB_LIST:-}" ] && IFS='|' read -r -a ab <<<"$FN_AB_LIST"
part ab && for flags in "${ab[@]}"; do
  # shellcheck disable=SC2086
  echo "cuda_model_bench TP=1 $flags $(timeout 100 $mpi -np 1 "$b/cuda/cuda_model_bench" \
    --config configs/qwen3.8-flash-next.json --depth 8192 --tokens 64 $flags 2>&1 |
    grep -E "^\| [0-9]" | cut -c1-80)"
done
part san && for tool in memcheck racecheck synccheck; do
  timeout 90 compute-sanitizer --tool "$tool" --error-exitcode 9 \
    "$b/tests/test_cuda_moe_nvfp4" -tc="${FN_SAN_TC:-*bulk*}" >"$out/$tool.log" 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log" | tail -1)"
done
echo "== total $((SECONDS - t0)) s"
