#!/usr/bin/env bash
# One GPU-machine call for issue 8's launch fusion (session 5): builds the decode tests and the
# model bench, runs the kernel tests named in FN_TESTS (default test_cuda_hc) with
# compute-sanitizer memcheck, the MPI tests in FN_MPI_TESTS (default test_comm_gpu) at np 2, the fixture model test at np 1 and np 2 (fused == unfused bitwise,
# graph == eager, ranks equal), then cuda_model_bench at TP=1 and TP=2 (depth 8192, random
# weights) with the fused step and with --unfused (A/B in the same call). Logs and JSON in $OUT.
# Usage on the 2-GPU machine from a `git archive` copy: FN_BUILD_DIR=../../build-X bash
# scripts/gpu/fuse_run.sh   (FN_TOKENS: bench tokens, 64; FN_SKIP_TEST=1: bench only;
# FN_KBENCH="--nvfp4-only": also cuda_kernel_bench with these flags; FN_EXTRA_AB=0: skip the
# session-5 A/B rows at the end; FN_MODES: the bench modes, default
# "fused unfused")
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/fuse-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
tests=${FN_TESTS:-test_cuda_hc}
mpi_tests=${FN_MPI_TESTS:-test_comm_gpu}
tokens=${FN_TOKENS:-64}
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
t=$SECONDS
# shellcheck disable=SC2086
if ! FN_BUILD_DIR=$b timeout 360 bash scripts/gpu/build.sh $tests $mpi_tests test_cuda_model cuda_model_bench \
  ${FN_KBENCH:+cuda_kernel_bench} >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -30
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"
if [ "${FN_SKIP_TEST:-0}" != 1 ]; then
  for x in $tests; do
    t=$SECONDS
    timeout 120 "$b/tests/$x" >"$out/$x.log" 2>&1
    echo "== $x rc=$? ($((SECONDS - t)) s)"
    grep -E "ERROR|test cases|assertions|THREW" "$out/$x.log" | sort -u | cut -c1-300 | head -12
    t=$SECONDS
    timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 "$b/tests/$x" \
      >"$out/$x.memcheck.log" 2>&1
    echo "== memcheck $x rc=$? ($((SECONDS - t)) s)"
    tail -n 3 "$out/$x.memcheck.log" | cut -c1-200
  done
  for x in $mpi_tests; do
    t=$SECONDS
    timeout 240 $mpi -np 2 "$b/tests/$x" >"$out/$x.log" 2>&1
    echo "== $x np 2 rc=$? ($((SECONDS - t)) s)"
    grep -E "ERROR|test cases|assertions|THREW" "$out/$x.log" | sort -u | cut -c1-300 | head -12
  done
  for np in 1 2; do
    t=$SECONDS
    timeout 240 $mpi -np "$np" "$b/tests/test_cuda_model" >"$out/model_np$np.log" 2>&1
    echo "== test_cuda_model np $np rc=$? ($((SECONDS - t)) s)"
    grep -E "ERROR|test cases|assertions|THREW" "$out/model_np$np.log" | sort -u | cut -c1-300 |
      head -12
  done
fi
if [ -n "${FN_KBENCH:-}" ]; then
  t=$SECONDS
  # shellcheck disable=SC2086
  timeout 200 "$b/cuda/cuda_kernel_bench" $FN_KBENCH --json "$out/kernels.json" \
    >"$out/kernels.txt" 2>&1
  echo "== cuda_kernel_bench $FN_KBENCH rc=$? ($((SECONDS - t)) s)"
  grep -E "moe_(experts|gate_up_nvfp4 fp32|down_nvfp4 fp32)" "$out/kernels.txt" | cut -c1-200
fi
for np in 1 2; do
  for mode in ${FN_MODES:-fused unfused}; do
    flag=
    [ "$mode" = unfused ] && flag=--unfused
    t=$SECONDS
    timeout 200 $mpi -np "$np" "$b/cuda/cuda_model_bench" --config configs/qwen3.8-flash-next.json \
      --depth 8192 --tokens "$tokens" $flag --json "$out/bench_tp${np}_$mode.json" \
      >"$out/bench_tp${np}_$mode.txt" 2>&1
    echo "== bench TP=$np $mode rc=$? ($((SECONDS - t)) s)"
    grep -E "^\| [0-9]" "$out/bench_tp${np}_$mode.txt" | cut -c1-300
  done
done
[ "${FN_EXTRA_AB:-1}" = 0 ] && exit 0
t=$SECONDS  # A/B: the custom all-reduce launched without PDL
FN_ALLREDUCE_PDL=0 timeout 200 $mpi -np 2 -x FN_ALLREDUCE_PDL "$b/cuda/cuda_model_bench" \
  --config configs/qwen3.8-flash-next.json --depth 8192 --tokens "$tokens" \
  >"$out/bench_tp2_ar_nopdl.txt" 2>&1
echo "== bench TP=2 fused, all-reduce without PDL rc=$? ($((SECONDS - t)) s)"
grep -E "^\| [0-9]" "$out/bench_tp2_ar_nopdl.txt" | cut -c1-300
t=$SECONDS  # A/B: the HC inject folded into the down pass at TP = 1 too
timeout 200 $mpi -np 1 "$b/cuda/cuda_model_bench" --config configs/qwen3.8-flash-next.json \
  --depth 8192 --tokens "$tokens" --fold-inject 1 >"$out/bench_tp1_fold.txt" 2>&1
echo "== bench TP=1 fused, inject folded rc=$? ($((SECONDS - t)) s)"
grep -E "^\| [0-9]" "$out/bench_tp1_fold.txt" | cut -c1-300
