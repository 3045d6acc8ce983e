#!/usr/bin/env bash
# One GPU-machine call for an A/B of the `fngen bench` lane itself (session 19, issue 8): builds
# fngen in a base tree (a `git archive` of the base commit in .carry/base) and in the working
# tree side by side, then runs `fngen bench --random-weights --config
# configs/qwen3.8-flash-next.json --backend cuda -p 8192 -n 512 -r 3 --warmup 1` at TP=1 on each,
# alternated FN_AB_ROUNDS times (default 2), and prints each run's TPOT line. Unlike
# kernel_ab_run.sh (cuda_model_bench: position set to the depth, caches of zeros, 64 tokens) this
# is the lane of the closing benches (a real prefill of random ids, 512 tokens), so a change whose
# effect the two lanes disagree on can be settled in one call. Logs and JSON to $OUT.
# Usage: `rm -rf .carry/base && mkdir -p .carry/base && git archive BASE | tar -x -C .carry/base`,
# then `run` with carry [".deps", ".carry/base"]: `FN_AB_BASE_COMMIT=<base short hash>
# FN_AB_NEW_COMMIT=<this checkout's short hash> bash scripts/gpu/bench_ab_run.sh` (the machine's
# copy carries a stale git history, so without them the reports' "commit" names the wrong one).
set -u
cd "$(dirname "$0")/../.."
fn_out_default=/tmp/bench-ab-out
source scripts/gpu/common.sh
n=$b
fresh_build_dir build-base .carry/base  # kept on a warm machine only for the same base tree
(cd .carry/base && FN_GIT_COMMIT=${FN_AB_BASE_COMMIT:-} FN_DEPS_ROOT=$FN_DEPS_DIR/root-base FN_BUILD_DIR=$(pwd)/../../build-base \
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
