#!/usr/bin/env bash
# One GPU-machine call for an A/B of the GDN decode kernel (session 9, issue 8): builds a base
# tree (a `git archive` of the base commit in .carry/base) and the working tree side by side,
# runs the GDN tests on the new build (the kernels against the CPU ops, the launch modes bitwise,
# the per-layer bench of every mode; prefill against decode steps; the PDL chain; the model
# fixtures against transformers at np 1), compute-sanitizer memcheck and racecheck on the small
# shapes, then cuda_model_bench TP=1 (depth 8192, 64 tokens) of both builds, alternating
# base/new twice. Usage: `rm -rf .carry/base && mkdir -p .carry/base && git archive BASE | tar -x
# -C .carry/base`, then `run` with carry [".deps", ".carry/base"]: bash scripts/gpu/gdn_run.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/gdn-out}
mkdir -p "$out"
export FN_DEPS_DIR=${FN_DEPS_DIR:-$(pwd)/.deps}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
t0=$SECONDS
(cd .carry/base && FN_BUILD_DIR=$(pwd)/../../build-base FN_JOBS=6 timeout 300 \
  bash scripts/gpu/build.sh cuda_model_bench >"$out/build_base.log" 2>&1) &
if ! FN_BUILD_DIR=build-new timeout 300 bash scripts/gpu/build.sh cuda_model_bench test_cuda_gdn \
  test_cuda_gdn_prefill test_cuda_pdl test_cuda_model >"$out/build_new.log" 2>&1; then
  grep -E "error|Error" "$out/build_new.log" | head -20
  exit 1
fi
wait
echo "== builds done ($((SECONDS - t0)) s)"
n=build-new
for tst in test_cuda_gdn test_cuda_gdn_prefill test_cuda_pdl; do
  timeout 150 $n/tests/$tst >"$out/$tst.log" 2>&1
  echo "$tst rc=$? $(grep -E 'test cases' "$out/$tst.log" | tr -s ' ')"
  grep -E "ERROR|FAILED" "$out/$tst.log" | head -4 | cut -c1-300
done
grep -E "gdn_decode bench" "$out/test_cuda_gdn.log" | cut -c1-150
timeout 200 $mpi -np 1 $n/tests/test_cuda_model >"$out/model.log" 2>&1
echo "test_cuda_model np 1 rc=$? $(grep -E 'test cases' "$out/model.log" | tr -s ' ')"
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $n/tests/test_cuda_gdn \
  -tc="*tiny*,*unequal*,*two-launch*" >"$out/memcheck.log" 2>&1
echo "memcheck rc=$? $(grep 'ERROR SUMMARY' "$out/memcheck.log")"
timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 $n/tests/test_cuda_gdn \
  -tc="*tiny*" >"$out/racecheck.log" 2>&1
echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$out/racecheck.log")"
echo "== tests done ($((SECONDS - t0)) s)"
for b in build-base $n build-base $n; do
  echo "cuda_model_bench TP=1 $b $(timeout 100 $mpi -np 1 $b/cuda/cuda_model_bench \
    --config configs/qwen3.8-flash-next.json --depth 8192 --tokens 64 2>&1 | grep -E "^\| [0-9]" | cut -c1-80)"
done
echo "== total $((SECONDS - t0)) s"
