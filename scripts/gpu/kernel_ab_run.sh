#!/usr/bin/env bash
# One GPU-machine call for an A/B of a decode-kernel change on one GPU (session 9, issue 8):
# builds a base tree (a `git archive` of the base commit in .carry/base) and the working tree side
# by side; runs the GPU tests FN_AB_TESTS on the new build, the bench case FN_AB_BENCH
# ("TEST:doctest-filter", run with FN_BENCH=1, its "bench:" lines printed) and the model fixtures
# against transformers at np 1; then cuda_model_bench TP=1 (depth 8192, 64 tokens) of both builds,
# alternating base/new twice; last compute-sanitizer memcheck and racecheck of FN_AB_SANITIZE
# ("TEST:doctest-filter", 60 s each at most; several entries |-separated). Logs to $OUT.
# Session 9's calls:
#   QSA: FN_AB_TESTS="test_cuda_qsa test_cuda_qsa_prefill" FN_AB_BENCH="test_cuda_qsa:*bench*"
#        FN_AB_SANITIZE="test_cuda_qsa:*graph replay*" bash scripts/gpu/kernel_ab_run.sh
#   GDN: FN_AB_TESTS="test_cuda_gdn test_cuda_gdn_prefill test_cuda_pdl"
#        FN_AB_BENCH="test_cuda_gdn:*bench*" FN_AB_SANITIZE="test_cuda_gdn:*tiny*"
#        bash scripts/gpu/kernel_ab_run.sh
# Usage: `rm -rf .carry/base && mkdir -p .carry/base && git archive BASE | tar -x -C .carry/base`,
# then `run` with carry [".deps", ".carry/base"] and the variables above in front of the command.
# Session 15: FN_AB_VARIANTS=".carry/v1 .carry/v2" adds trees (each a `git archive` of another
# commit, carried too), built beside the two and benched in the same alternation (base, new,
# variants..., twice); FN_AB_TESTS and test_cuda_model run on every variant too, the sanitizer on
# the working tree only. FN_AB_NEW_FLAGS="--moe-bulk-down 0|--moe-bulk-down 1" benches the
# working tree once per flag set (|-separated) in each round. Session 23: FN_AB_BENCH_ARGS
# (|-separated argument sets, default "--depth 8192 --tokens 64") benches every tree once per set
# in each round, e.g. "--depth 8300 --tokens 48 --ctx 8704|--depth 8460 --tokens 48 --ctx 8704".
set -u
cd "$(dirname "$0")/../.."
fn_out_default=/tmp/kernel-ab-out
source scripts/gpu/common.sh
n=$b
tests=${FN_AB_TESTS:-test_cuda_qsa test_cuda_qsa_prefill}
# Each tree unpacks the carried .deps into a root of its own (concurrent dpkg -x into one root
# failed with "File exists"). build-base is kept on a warm machine only for the same base tree.
fresh_build_dir build-base .carry/base
(cd .carry/base && FN_DEPS_ROOT=$FN_DEPS_DIR/root-base FN_BUILD_DIR=$(pwd)/../../build-base \
  FN_JOBS=6 timeout 300 \
  bash scripts/gpu/build.sh cuda_model_bench >"$out/build_base.log" 2>&1) &
variants=${FN_AB_VARIANTS:-}
for v in $variants; do
  (cd "$v" && FN_DEPS_ROOT=$FN_DEPS_DIR/root-$(basename "$v") FN_BUILD_DIR=$(pwd)/build-v \
    FN_JOBS=4 timeout 300 \
    bash scripts/gpu/build.sh cuda_model_bench test_cuda_model $tests \
    >"$out/build_$(basename "$v").log" 2>&1) &
done
# shellcheck disable=SC2086
if ! FN_BUILD_DIR=$n timeout 300 bash scripts/gpu/build.sh cuda_model_bench test_cuda_model \
  $tests >"$out/build_new.log" 2>&1; then
  grep -E "error|Error" "$out/build_new.log" | head -20
  exit 1
fi
wait
echo "== builds done ($((SECONDS - t0)) s)"
for tst in $tests; do
  timeout 150 "$n/tests/$tst" >"$out/$tst.log" 2>&1
  echo "$tst rc=$? $(grep -E 'test cases' "$out/$tst.log" | tr -s ' ')"
  grep -E "ERROR|FAILED" "$out/$tst.log" | head -4 | cut -c1-300
done
if [ -n "${FN_AB_BENCH:-}" ]; then
  FN_BENCH=1 timeout 120 "$n/tests/${FN_AB_BENCH%%:*}" -tc="${FN_AB_BENCH#*:}" >"$out/bench.log" 2>&1
  echo "bench ${FN_AB_BENCH} rc=$?"
  grep -E "bench:" "$out/bench.log" | head -40 | cut -c1-160
fi
timeout 200 $mpi -np 1 "$n/tests/test_cuda_model" >"$out/model.log" 2>&1
echo "test_cuda_model np 1 rc=$? $(grep -E 'test cases' "$out/model.log" | tr -s ' ')"
trees="build-base $n"
for v in $variants; do
  vb=$v/build-v
  for tst in $tests; do
    timeout 150 "$vb/tests/$tst" >"$out/${tst}_$(basename "$v").log" 2>&1
    echo "$tst $v rc=$? $(grep -E 'test cases' "$out/${tst}_$(basename "$v").log" | tr -s ' ')"
  done
  timeout 200 $mpi -np 1 "$vb/tests/test_cuda_model" >"$out/model_$(basename "$v").log" 2>&1
  echo "test_cuda_model np 1 $v rc=$? $(grep -E 'test cases' "$out/model_$(basename "$v").log" | tr -s ' ')"
  trees="$trees $vb"
done
IFS='|' read -r -a new_flags <<<"${FN_AB_NEW_FLAGS:-}"
[ ${#new_flags[@]} -eq 0 ] && new_flags=("")
IFS='|' read -r -a bench_args <<<"${FN_AB_BENCH_ARGS:---depth 8192 --tokens 64}"
for b in $trees $trees; do
  flag_sets=("")
  [ "$b" = "$n" ] && flag_sets=("${new_flags[@]}")
  for args in "${bench_args[@]}"; do
    for f in "${flag_sets[@]}"; do
      # shellcheck disable=SC2086
      echo "cuda_model_bench TP=1 $b $args $f $(timeout 100 $mpi -np 1 "$b/cuda/cuda_model_bench" \
        --config configs/qwen3.8-flash-next.json $args $f 2>&1 |
        grep -E "^\| [0-9]" | cut -c1-80)"
    done
  done
done
# FN_AB_SANITIZE may name several "TEST:filter" entries, |-separated (session 17).
IFS='|' read -r -a sanitize <<<"${FN_AB_SANITIZE:-}"
for entry in "${sanitize[@]}"; do
  for tool in memcheck racecheck; do
    log="$out/${tool}_${entry%%:*}.log"
    timeout 60 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$n/tests/${entry%%:*}" -tc="${entry#*:}" >"$log" 2>&1
    echo "$tool ${entry%%:*} rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
  done
done
echo "== total $((SECONDS - t0)) s"
