#!/usr/bin/env bash
# One GPU-machine call: builds cuda_model_bench, then profiles one launch of
# each latency-bound decode kernel inside the real TP=1 step (depth 8192, random weights) with
# ncu (hardware counters, clocks not locked): speed of light, occupancy, scheduler and warp-state
# statistics, instruction mix, shared-memory bank conflicts and the source-level stall sampling;
# and dumps the SASS of the kernels' object files. Reports and SASS go to $OUT.
# Usage on the GPU machine (the Debian packages in .deps, see setup.sh):
#   bash scripts/gpu/ncu_run.sh [KERNEL_REGEX ...]
set -u
cd "$(dirname "$0")/../.."
fn_out_default=/tmp/ncu-out
source scripts/gpu/common.sh
if ! FN_BUILD_DIR=$b timeout 300 bash scripts/gpu/build.sh cuda_model_bench >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -30
  exit 1
fi
echo "== build ok ($((SECONDS - t0)) s)"
for f in qsa gdn hc moe_nvfp4 moe_nvfp4_bulk moe_shared; do
  cuobjdump -sass "$b/cuda/CMakeFiles/fngen_cuda.dir/kernels/$f.cu.o" >"$out/$f.sass" 2>&1
done
kernels=("$@")
[ ${#kernels[@]} -eq 0 ] && kernels=(qsa_attn_split_kernel gdn_recurrent_kernel hc_mix_staged_kernel
  hc_down_staged_kernel router_shared_gate_up_kernel moe_down_nvfp4_kernel)
for k in "${kernels[@]}"; do
  t=$SECONDS
  timeout 150 ncu --clock-control none --kernel-name "regex:$k" --launch-skip 30 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis_Tables \
    --section SourceCounters \
    "$b/bench/cuda_model_bench" --config configs/qwen3.8-flash-next.json --depth 8192 --tokens 4 \
    --warmup 2 >"$out/ncu_$k.txt" 2>&1
  echo "== ncu $k rc=$? ($((SECONDS - t)) s)"
  grep -E "Duration|Registers Per|Achieved Occupancy|Issued Ipc|No Eligible|Executed Instructions  |Bank Conflicts|Stall" \
    "$out/ncu_$k.txt" | head -12 | cut -c1-160
done
echo "== total $((SECONDS - t0)) s"
