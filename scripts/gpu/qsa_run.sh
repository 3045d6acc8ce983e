#!/usr/bin/env bash
# One GPU-machine call for an A/B of the QSA attention kernel (session 9, issue 8): builds a base
# tree (a `git archive` of the base commit in .carry/base) and the working tree side by side,
# runs the QSA tests on the new build (the four-launch path memcmp-equal to the five-launch path
# on the real shapes, the attention bench; prefill rows bitwise equal to decode steps; the model
# fixtures against transformers at np 1), cuda_model_bench TP=1 (depth 8192, 64 tokens) of both
# builds alternating base/new twice, then compute-sanitizer memcheck and racecheck of a real TP=2
# shape (60 s each at most). Usage: `rm -rf .carry/base && mkdir -p .carry/base && git archive BASE | tar -x
# -C .carry/base`, then `run` with carry [".deps", ".carry/base"]: bash scripts/gpu/qsa_run.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/qsa-out}
mkdir -p "$out"
export FN_DEPS_DIR=${FN_DEPS_DIR:-$(pwd)/.deps}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
t0=$SECONDS
(cd .carry/base && FN_BUILD_DIR=$(pwd)/../../build-base FN_JOBS=6 timeout 300 \
  bash scripts/gpu/build.sh cuda_model_bench >"$out/build_base.log" 2>&1) &
if ! FN_BUILD_DIR=build-new timeout 300 bash scripts/gpu/build.sh cuda_model_bench test_cuda_qsa \
  test_cuda_qsa_prefill test_cuda_model >"$out/build_new.log" 2>&1; then
  grep -E "error|Error" "$out/build_new.log" | head -20
  exit 1
fi
wait
echo "== builds done ($((SECONDS - t0)) s)"
n=build-new
for tst in test_cuda_qsa test_cuda_qsa_prefill; do
  timeout 150 $n/tests/$tst >"$out/$tst.log" 2>&1
  echo "$tst rc=$? $(grep -E 'test cases' "$out/$tst.log" | tr -s ' ')"
  grep -E "ERROR|FAILED" "$out/$tst.log" | head -4 | cut -c1-300
done
FN_BENCH=1 timeout 120 $n/tests/test_cuda_qsa -tc="*bench*" >"$out/qsa_bench.log" 2>&1
echo "qsa bench rc=$?"
grep -iE "us|alone" "$out/qsa_bench.log" | grep -vE "^\s*$" | head -24 | cut -c1-160
for b in build-base $n build-base $n; do
  echo "cuda_model_bench TP=1 $b $(timeout 100 $mpi -np 1 $b/cuda/cuda_model_bench \
    --config configs/qwen3.8-flash-next.json --depth 8192 --tokens 64 2>&1 | grep -E "^\| [0-9]" | cut -c1-80)"
done
timeout 200 $mpi -np 1 $n/tests/test_cuda_model >"$out/model.log" 2>&1
echo "test_cuda_model np 1 rc=$? $(grep -E 'test cases' "$out/model.log" | tr -s ' ')"
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 $n/tests/test_cuda_qsa \
  -tc="*graph replay*" >"$out/memcheck.log" 2>&1
echo "memcheck rc=$? $(grep 'ERROR SUMMARY' "$out/memcheck.log")"
timeout 60 compute-sanitizer --tool racecheck --error-exitcode 9 $n/tests/test_cuda_qsa \
  -tc="*graph replay*" >"$out/racecheck.log" 2>&1
echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$out/racecheck.log")"
echo "== tests done ($((SECONDS - t0)) s)"
echo "== total $((SECONDS - t0)) s"
