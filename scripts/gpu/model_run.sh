#!/usr/bin/env bash
# One GPU-machine call for the CUDA model: builds test_cuda_model and cuda_model_bench,
# runs the fixture test (mpirun -np 2 via ctest), then the full-geometry decode benchmark on
# random in-memory weights at TP=1 and TP=2 (8,192-token depth). Logs and JSON go to $OUT.
# Usage on the 2-GPU machine: bash scripts/gpu/model_run.sh [bench tokens, default 64]
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/model-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
tokens=${1:-64}
t=$SECONDS
if ! FN_BUILD_DIR=$b timeout 300 bash scripts/gpu/build.sh test_cuda_model cuda_model_bench fngen \
  >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -30
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"
if [ "${FN_SKIP_TEST:-0}" != 1 ]; then
  t=$SECONDS
  (cd "$b" && timeout 300 ctest -R '^test_cuda_model$' --output-on-failure) >"$out/test.log" 2>&1
  echo "== test_cuda_model rc=$? ($((SECONDS - t)) s)"
  grep -E "MESSAGE|ERROR|values:|test cases|assertions|THREW" "$out/test.log" | sort -u |
    cut -c1-400 | head -40
fi
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
for np in ${FN_BENCH_TP:-2 1}; do
  t=$SECONDS
  timeout 240 $mpi -np "$np" "$b/bench/cuda_model_bench" --config configs/qwen3.8-flash-next.json \
    --depth 8192 --tokens "$tokens" --json "$out/bench_tp$np.json" >"$out/bench_tp$np.txt" 2>&1
  echo "== bench TP=$np rc=$? ($((SECONDS - t)) s)"
  grep -vE "^\[r[1-9]" "$out/bench_tp$np.txt" | tail -6 | cut -c1-300
done
