#!/usr/bin/env bash
# One GPU-machine call for an A/B of a decode change on one GPU (session 7): builds a base tree
# (a `git archive` of the base commit in .carry/base) and the working tree side by side, runs the
# routed-expert tests on the new build (plain, compute-sanitizer memcheck, the MoE prefill tests
# that compare with the decode kernels, the fixture model test at np 1), then cuda_kernel_bench
# --nvfp4-only and cuda_model_bench TP=1 (depth 8192, 64 tokens) of both builds, alternating
# base/new twice. Usage: `rm -rf .carry/base && mkdir -p .carry/base && git archive BASE | tar -x
# -C .carry/base`, then `run` with carry [".deps", ".carry/base"]: bash scripts/gpu/ab_run.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/ab-out}
mkdir -p "$out"
export FN_DEPS_DIR=${FN_DEPS_DIR:-$(pwd)/.deps}
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
(cd .carry/base && FN_BUILD_DIR=$(pwd)/../../build-base timeout 300 bash scripts/gpu/build.sh \
  cuda_model_bench cuda_kernel_bench >"$out/build_base.log" 2>&1) &
if ! FN_BUILD_DIR=build-new timeout 300 bash scripts/gpu/build.sh test_cuda_moe_nvfp4 \
  test_cuda_moe_prefill test_cuda_model cuda_model_bench cuda_kernel_bench >"$out/build_new.log" 2>&1; then
  grep error "$out/build_new.log" | head
  exit 1
fi
wait
n=build-new
base=build-base
timeout 120 $n/tests/test_cuda_moe_nvfp4 >"$out/moe.log" 2>&1
echo "test_cuda_moe_nvfp4 rc=$?"
grep -E "test cases|assertions" "$out/moe.log"
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $n/tests/test_cuda_moe_nvfp4 \
  >"$out/moe_memcheck.log" 2>&1
echo "memcheck rc=$?"
tail -1 "$out/moe_memcheck.log"
timeout 200 $n/tests/test_cuda_moe_prefill >"$out/moe_prefill.log" 2>&1
echo "test_cuda_moe_prefill rc=$?"
grep -E "test cases" "$out/moe_prefill.log"
timeout 200 $mpi -np 1 $n/tests/test_cuda_model >"$out/model.log" 2>&1
echo "test_cuda_model np 1 rc=$?"
grep -E "test cases" "$out/model.log"
for b in $base $n; do
  echo "== cuda_kernel_bench $b"
  $b/cuda/cuda_kernel_bench --nvfp4-only 2>&1 | grep -E "fp32" | grep -v sweep | cut -c1-100
done
for b in $base $n $base $n; do
  echo "== cuda_model_bench TP=1 $b"
  timeout 100 $mpi -np 1 $b/cuda/cuda_model_bench --config configs/qwen3.8-flash-next.json \
    --depth 8192 --tokens 64 2>&1 | grep -E "^\| [0-9]" | cut -c1-80
done
