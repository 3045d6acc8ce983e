#!/usr/bin/env bash
# One GPU-machine call for session 7's stream-K routed gate+up (issue 8), on 1x H200: builds,
# runs test_cuda_moe_nvfp4 (plain and under compute-sanitizer memcheck), cuda_kernel_bench
# --nvfp4-only, test_cuda_model at np 1, and cuda_model_bench TP=1 (depth 8192) with the
# stream-K kernel off and on, in alternating order (A/B inside one call). Logs and JSON in $OUT.
# Usage from a `git archive` copy: FN_BUILD_DIR=../../build-X bash scripts/gpu/moe7_run.sh
# (FN_TOKENS: bench tokens, 64; FN_SKIP_TEST=1: benches only; FN_AB: the --moe-stream-k values
# in order, default "0 1 0 1"; FN_BENCH_ARGS: extra cuda_model_bench arguments; FN_DEPTHS: the
# FN_STREAM_DEPTH values of the kernel bench; FN_SASS: an object of cuda/ to disassemble)
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/moe7-out}
mkdir -p "$out"
b=${FN_BUILD_DIR:-build-gpu}
tokens=${FN_TOKENS:-64}
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
t=$SECONDS
if ! timeout 400 bash scripts/gpu/build.sh test_cuda_moe_nvfp4 test_cuda_model cuda_model_bench \
  cuda_kernel_bench >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -30
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"
if [ "${FN_SKIP_TEST:-0}" != 1 ]; then
  t=$SECONDS
  timeout 120 "$b/tests/test_cuda_moe_nvfp4" >"$out/moe.log" 2>&1
  echo "== test_cuda_moe_nvfp4 rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR|test cases|assertions|THREW|stream-K I" "$out/moe.log" | sort -u | cut -c1-300 | head -20
  t=$SECONDS
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$b/tests/test_cuda_moe_nvfp4" \
    -tc="*stream-K*" >"$out/moe.memcheck.log" 2>&1
  echo "== memcheck rc=$? ($((SECONDS - t)) s)"
  tail -n 3 "$out/moe.memcheck.log" | cut -c1-200
  t=$SECONDS
  timeout 200 $mpi -np 1 "$b/tests/test_cuda_model" >"$out/model_np1.log" 2>&1
  echo "== test_cuda_model np 1 rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR|test cases|assertions|THREW" "$out/model_np1.log" | sort -u | cut -c1-300 | head -12
fi
for d in ${FN_DEPTHS:-4}; do
  t=$SECONDS
  timeout 120 "$b/cuda/cuda_kernel_bench" --nvfp4-only \
    --json "$out/kernels_d$d.json" >"$out/kernels_d$d.txt" 2>&1
  echo "== cuda_kernel_bench rc=$? ($((SECONDS - t)) s)"
  grep -E "moe_" "$out/kernels_d$d.txt" | grep -v sweep | cut -c1-120
done
if [ -n "${FN_SASS:-}" ]; then  # SASS of one object, e.g. FN_SASS=moe_nvfp4
  cuobjdump -sass "$b/cuda/CMakeFiles/fngen_cuda.dir/$FN_SASS.cu.o" >"$out/sass_$FN_SASS.txt" 2>&1
  echo "== sass rc=$? $(wc -l <"$out/sass_$FN_SASS.txt") lines"
fi
n=0
for sk in ${FN_AB:-0 1 0 1}; do
  n=$((n + 1))
  t=$SECONDS
  # shellcheck disable=SC2086
  timeout 150 $mpi -np 1 "$b/cuda/cuda_model_bench" --config configs/qwen3.8-flash-next.json --depth 8192 \
    --tokens "$tokens" --moe-persistent "$sk" ${FN_BENCH_ARGS:-} --json "$out/bench_${n}_sk${sk}.json" \
    >"$out/bench_${n}_sk$sk.txt" 2>&1
  echo "== bench TP=1 persistent $sk rc=$? ($((SECONDS - t)) s)"
  grep -E "^\| [0-9]" "$out/bench_${n}_sk$sk.txt" | cut -c1-300
done
