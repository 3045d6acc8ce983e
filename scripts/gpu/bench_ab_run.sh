#!/usr/bin/env bash
# One GPU-machine call that measures a change against its base with the `fngen bench` lane of
# docs/performance.md: builds fngen in the base tree (FN_AB_BASE_DIR, e.g. an extraction of
# `git archive BASE`) and in this tree side by side, then runs `fngen bench --random-weights
# --config configs/qwen3.8-flash-next.json --backend cuda -p 8192 -n 512 -r 3 --warmup 1` at TP=1
# on each, alternating base and new FN_AB_ROUNDS times (default 2), and prints each run's TPOT
# line. Machines differ by more than most changes, so only these same-call differences count.
# Logs and JSON go to $OUT.
# Usage on the GPU machine: rm -rf base && mkdir base && git archive BASE | tar -x -C base, then
#   FN_AB_BASE_DIR=base FN_AB_BASE_COMMIT=<BASE> FN_AB_NEW_COMMIT=<this commit> \
#     bash scripts/gpu/bench_ab_run.sh
# (the two commit variables name the trees in the reports when they carry no git history).
set -u
cd "$(dirname "$0")/../.."
fn_out_default=/tmp/bench-ab-out
source scripts/gpu/common.sh
n=$b
base=${FN_AB_BASE_DIR:?FN_AB_BASE_DIR must name the base tree}
base=$(cd "$base" && pwd)
root=$(pwd)
fresh_build_dir build-base "$base"  # kept on a warm machine only for the same base tree
(cd "$base" && FN_GIT_COMMIT=${FN_AB_BASE_COMMIT:-} FN_DEPS_ROOT=$FN_DEPS_DIR/root-base FN_BUILD_DIR=$root/build-base \
  FN_JOBS=6 timeout 300 bash scripts/gpu/build.sh fngen >"$out/build_base.log" 2>&1) &
if ! FN_GIT_COMMIT=${FN_AB_NEW_COMMIT:-} FN_BUILD_DIR=$n timeout 300 bash scripts/gpu/build.sh fngen >"$out/build_new.log" 2>&1; then
  grep -E "error|Error" "$out/build_new.log" | head -20
  exit 1
fi
wait
[ -x build-base/fngen ] || { grep -E "error|Error" "$out/build_base.log" | head -20; exit 1; }
echo "== builds done ($((SECONDS - t0)) s)"
for round in $(seq 1 "${FN_AB_ROUNDS:-2}"); do
  for tree in build-base "$n"; do
    json="$out/bench_$(basename "$tree")_$round.json"
    timeout 150 $mpi -np 1 "$tree/fngen" bench --random-weights \
      --config configs/qwen3.8-flash-next.json --backend cuda -p 8192 -n 512 -r 3 --warmup 1 \
      --format json -o "$json" >"$out/bench_$(basename "$tree")_$round.log" 2>&1
    echo "round $round $tree rc=$? $(grep -E "lane 1/1" "$out/bench_$(basename "$tree")_$round.log" |
      sed 's/.*(-p/(-p/' | cut -c1-160)"
  done
done
echo "== total $((SECONDS - t0)) s"
