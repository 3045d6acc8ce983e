#!/usr/bin/env bash
# One GPU-machine call for comm/: build the comm targets with CUDA, run the GPU tests
# (mpirun -np 2), the dead-peer checks, comm_bench (latency table + JSON) and compute-sanitizer
# memcheck on a one-rank run. Logs go to $OUT (or /tmp/comm-out). Prints a short summary.
# Usage on the GPU machine: bash scripts/gpu/comm_run.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/comm-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
b=${FN_BUILD_DIR:-build-gpu}
mpi=(mpirun -np 2 --allow-run-as-root --bind-to none)
{ nvidia-smi; nvidia-smi topo -m; } >"$out/machine.log" 2>&1
grep -E "GPU0|H200" "$out/machine.log" | head -4

t=$SECONDS
if ! FN_BUILD_DIR=$b timeout 240 bash scripts/gpu/build.sh test_comm_gpu comm_dead_peer comm_bench \
  test_comm_cuda_check >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"

t=$SECONDS
timeout 240 "${mpi[@]}" "$b/tests/test_comm_gpu" >"$out/test_comm_gpu.log" 2>&1
echo "== test_comm_gpu rc=$? ($((SECONDS - t)) s)"
grep -E "MESSAGE|graph:|all-reduce:|self-test|unavailable|ERROR|FAILED|test cases|\[mpi\]" \
  "$out/test_comm_gpu.log" | grep -v "^\s*$" | cut -c1-220 | head -40

t=$SECONDS
for mode in stuck kill; do
  bash tests/comm_dead_peer.sh mpirun "$b/tests/comm_dead_peer" $mode 30 >>"$out/dead_peer.log" 2>&1
  echo "== dead peer ($mode) rc=$?"
done
grep -E "detected|waited more|comm_dead_peer.sh" "$out/dead_peer.log" | cut -c1-260

t=$SECONDS
timeout 150 "${mpi[@]}" "$b/bench/comm_bench" --json "$out/comm_bench.json" >"$out/comm_bench.log" 2>&1
echo "== comm_bench rc=$? ($((SECONDS - t)) s)"
grep -vE "^\[r" "$out/comm_bench.log"
grep -E "self-test" "$out/comm_bench.log" | head -2

t=$SECONDS
FN_TEST_GRAPH_REPLAYS=1 timeout 120 mpirun -np 1 --allow-run-as-root --bind-to none \
  compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 "$b/tests/test_comm_gpu" \
  -tc="*wrap*,*in-graph*,*integer-valued*" >"$out/sanitizer.log" 2>&1
echo "== compute-sanitizer memcheck (1 rank) rc=$? ($((SECONDS - t)) s)"
grep -E "ERROR SUMMARY|test cases|Invalid" "$out/sanitizer.log" | head -5
