#!/usr/bin/env bash
# One GPU-machine call for the L2 prefetch A/B (session 9, issue 8) on the 2-GPU machine: builds
# the working tree, runs the GPU tests of the decode kernels and the model
# tests at np 1 and 2 (fixtures against transformers; prefetch on and off give the same bits),
# compute-sanitizer memcheck of the routed-expert test, two bad-input cases of `fngen generate
# --backend cuda` under mpirun -np 2 (one message from rank 0, every rank exits non-zero), then
# cuda_model_bench (depth 8192, 64 tokens) with CudaModelOptions::l2_prefetch off/on alternated in
# one process tree: TP=1 0/1/0/1/0/1, TP=2 0/1/0/1 (FN_AB_TP1 / FN_AB_TP2 replace the lists;
# FN_SKIP_TESTS=1 skips the tests and the bad-input cases). Logs to $OUT.
# Usage: `run` with carry [".deps"]: bash scripts/gpu/prefetch_run.sh
set -u
cd "$(dirname "$0")/../.."
fn_out_default=/tmp/prefetch-out
source scripts/gpu/common.sh
nvidia-smi --query-gpu=index,name,memory.used,clocks.sm --format=csv,noheader
if ! FN_BUILD_DIR=$b timeout 330 bash scripts/gpu/build.sh fngen cuda_model_bench test_cuda_model \
  test_cuda_moe_nvfp4 test_cuda_gdn test_cuda_qsa >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -30
  echo "== build failed ($((SECONDS - t0)) s)"
  exit 1
fi
echo "== build ok ($((SECONDS - t0)) s)"

if [ "${FN_SKIP_TESTS:-0}" != 1 ]; then
for tst in test_cuda_moe_nvfp4 test_cuda_gdn test_cuda_qsa; do
  timeout 150 "$b/tests/$tst" >"$out/$tst.log" 2>&1
  echo "$tst rc=$? $(grep -E 'test cases' "$out/$tst.log" | tr -s ' ')"
done
for np in 1 2; do
  timeout 200 $mpi -np $np "$b/tests/test_cuda_model" >"$out/model_np$np.log" 2>&1
  echo "test_cuda_model np $np rc=$? $(grep -E 'test cases' "$out/model_np$np.log" | head -1 | tr -s ' ')"
  grep -E "ERROR|FAILED" "$out/model_np$np.log" | head -5 | cut -c1-300
done
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$b/tests/test_cuda_moe_nvfp4" \
  >"$out/memcheck_moe.log" 2>&1
echo "memcheck test_cuda_moe_nvfp4 rc=$? $(grep 'ERROR SUMMARY' "$out/memcheck_moe.log")"
echo "== tests done ($((SECONDS - t0)) s)"

# Bad input on the CUDA backend: a truncated checkpoint, and a context above the model's
# max_position_embeddings.
rm -rf /tmp/bad && cp -r tests/data/fixtures/tp4 /tmp/bad
st=$(ls /tmp/bad/*.safetensors | head -1)
truncate -s $(($(stat -c %s "$st") / 2)) "$st"
timeout 60 $mpi -np 2 "$b/fngen" generate -m /tmp/bad --backend cuda --prompt-ids 1,2 -n 2 \
  >"$out/bad1.out" 2>"$out/bad1.err"
echo "bad checkpoint rc=$? ($(wc -l <"$out/bad1.err") stderr lines)"
grep -vE "^\s*$" "$out/bad1.err" | head -8 | cut -c1-300
timeout 60 $mpi -np 2 "$b/fngen" generate -m tests/data/fixtures/tp4 --backend cuda \
  --prompt-ids 1,2 -n 2 -c 2000000000 >"$out/bad2.out" 2>"$out/bad2.err"
echo "huge context rc=$? ($(wc -l <"$out/bad2.err") stderr lines)"
grep -vE "^\s*$" "$out/bad2.err" | head -8 | cut -c1-300
echo "== bad input done ($((SECONDS - t0)) s)"
fi

bench() {  # np l2_prefetch
  timeout 100 $mpi -np "$1" "$b/cuda/cuda_model_bench" --config configs/qwen3.8-flash-next.json \
    --depth 8192 --tokens 64 --l2-prefetch "$2" 2>&1 | grep -E "^\| [0-9]" | cut -c1-90
}
for m in ${FN_AB_TP1:-0 1 0 1 0 1}; do
  echo "TP=1 l2_prefetch=$m $(bench 1 $m)"
done
for m in ${FN_AB_TP2:-0 1 0 1}; do
  echo "TP=2 l2_prefetch=$m $(bench 2 $m)"
done
echo "== total $((SECONDS - t0)) s"
