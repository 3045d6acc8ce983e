#!/usr/bin/env bash
# One GPU-machine call for the decode step's timeline (cuda/common/step_trace.h):
# builds cuda_model_bench with -DFN_STEP_TRACE=ON into build-trace, records FN_TRACE_STEPS steps
# (default 3) at TP=1, depth 8192, after 64 timed tokens (the recording build is ~6 % slower), and
# writes scripts/step_timeline.py's summary ($OUT/timeline.md) and the gzipped records
# ($OUT/trace.csv.gz). Extra cuda_model_bench flags (an A/B variant): FN_TRACE_FLAGS.
# Usage on the GPU machine (the Debian packages in .deps, see setup.sh): bash scripts/gpu/trace_run.sh
set -u
cd "$(dirname "$0")/../.."
fn_out_default=/tmp/trace-out
source scripts/gpu/common.sh
steps=${FN_TRACE_STEPS:-3}
if ! FN_BUILD_DIR=build-trace FN_CMAKE_ARGS="-DFN_STEP_TRACE=ON" timeout 300 \
  bash scripts/gpu/build.sh cuda_model_bench >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -20
  exit 1
fi
echo "== build $((SECONDS - t0)) s"
# shellcheck disable=SC2086
timeout 200 $mpi -np 1 build-trace/bench/cuda_model_bench --config configs/qwen3.8-flash-next.json \
  --depth 8192 --tokens 64 --trace /tmp/trace.csv --trace-steps "$steps" ${FN_TRACE_FLAGS:-} 2>&1 |
  grep -vE "\[D\]" | tail -n 4
python3 scripts/step_timeline.py /tmp/trace.csv --steps "$steps" --top 30 >"$out/timeline.md"
echo "step_timeline rc=$?"
sed -n '1p;/cost by (previous/,$p' "$out/timeline.md"
gzip -c /tmp/trace.csv >"$out/trace.csv.gz"
echo "== total $((SECONDS - t0)) s"
