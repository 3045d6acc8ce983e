#!/usr/bin/env bash
# One GPU-machine call for the two-stream GDN layer (session 11, issue 8): builds the working
# tree, runs the GEMV, GDN and model tests (test_cuda_model and test_cuda_model_realwidth at np 1),
# compute-sanitizer memcheck and racecheck of the GDN deferred-norm case, then cuda_model_bench
# TP=1 (depth 8192, 64 tokens) over the '|'-separated flag sets of FN_AB_LIST (default
# --gdn-split 0 / 1 twice). FN_SPLIT_PARTS picks parts (default "tests san ab"). Logs to $OUT.
# Usage: `run` with carry [".deps"] and `bash scripts/gpu/split_run.sh`.
set -u
cd "$(dirname "$0")/../.."
fn_out_default=/tmp/split-out
source scripts/gpu/common.sh
if ! FN_BUILD_DIR=$b timeout 300 bash scripts/gpu/build.sh cuda_model_bench test_cuda_gemv \
  test_cuda_gdn test_cuda_model test_cuda_model_realwidth >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -20
  exit 1
fi
echo "== build done ($((SECONDS - t0)) s)"
parts=" ${FN_SPLIT_PARTS:-tests san ab} "
part() { [[ "$parts" == *" $1 "* ]]; }
if part tests; then
  for tst in test_cuda_gemv test_cuda_gdn; do
    timeout 150 "$b/tests/$tst" >"$out/$tst.log" 2>&1
    echo "$tst rc=$? $(grep -E 'test cases' "$out/$tst.log" | tr -s ' ')"
    grep -E "ERROR|FAILED" "$out/$tst.log" | head -8 | cut -c1-300
  done
  for tst in test_cuda_model test_cuda_model_realwidth; do
    timeout 300 $mpi -np 1 "$b/tests/$tst" >"$out/$tst.log" 2>&1
    echo "$tst np 1 rc=$? $(grep -E 'test cases' "$out/$tst.log" | tr -s ' ')"
    grep -E "ERROR|FAILED|worst" "$out/$tst.log" | sort -u | head -8 | cut -c1-300
  done
fi
part san && for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 9 "$b/tests/test_cuda_gdn" \
    -tc="*deferred*" >"$out/$tool.log" 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log" | tail -1)"
done
ab=("--gdn-split 0" "--gdn-split 1" "--gdn-split 0" "--gdn-split 1")
[ -n "${FN_AB_LIST:-}" ] && IFS='|' read -r -a ab <<<"$FN_AB_LIST"
part ab && for flags in "${ab[@]}"; do
  # shellcheck disable=SC2086
  echo "cuda_model_bench TP=1 $flags $(timeout 100 $mpi -np 1 "$b/cuda/cuda_model_bench" \
    --config configs/qwen3.8-flash-next.json --depth 8192 --tokens 64 $flags 2>&1 |
    grep -E "^\| [0-9]|rror" | cut -c1-100)"
done
echo "== total $((SECONDS - t0)) s"
