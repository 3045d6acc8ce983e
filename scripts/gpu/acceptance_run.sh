#!/usr/bin/env bash
# One GPU-machine call for the CUDA backend's acceptance on the 2-GPU machine:
# builds fngen + test_cuda_model, runs the fixture test (mpirun -np 2), compute-sanitizer memcheck
# and racecheck on a tiny model (test_cuda_model's bad-input case: load, graph capture, steps),
# `fngen generate --backend cuda` at TP=1 and TP=2, and `fngen eval kld --backend cuda` against
# every transformers-written base file. Logs to $OUT. Usage: bash scripts/gpu/acceptance_run.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/acceptance-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
t=$SECONDS
if ! FN_BUILD_DIR=$b timeout 300 bash scripts/gpu/build.sh fngen test_cuda_model \
  >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -30
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
if [ "${FN_SKIP_TEST:-0}" != 1 ]; then
  t=$SECONDS
  timeout 300 $mpi -np 2 "$b/tests/test_cuda_model" >"$out/test.log" 2>&1
  echo "== test_cuda_model (np 2) rc=$? ($((SECONDS - t)) s)"
  grep -E "MESSAGE|ERROR|values:|test cases|assertions|THREW" "$out/test.log" |
    grep -v "per row\|per-row\|H_cuda" | sort -u | cut -c1-330 | head -40
fi
for tool in memcheck racecheck; do
  t=$SECONDS
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 "$b/tests/test_cuda_model" \
    -tc="cuda model: bad input*" >"$out/$tool.log" 2>&1
  echo "== $tool rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid|test cases" "$out/$tool.log" | head -5
done
ids=1,2,3,4,5,6,7,8
for np in 1 2; do
  timeout 120 $mpi -np $np "$b/fngen" generate --backend cuda -m tests/data/fixtures/tp4 \
    --prompt-ids $ids -n 24 --temp 0 --ignore-eos >"$out/gen_np$np.txt" 2>"$out/gen_np$np.err"
  echo "== generate --backend cuda np=$np rc=$?"
  cat "$out/gen_np$np.txt" | head -20
  grep -E "\[r0" "$out/gen_np$np.err" | tail -4 | cut -c1-250
done
for pair in g3_tiny:g3_tf tp4:tp4_tf tp4:tp4_tf_ppl; do
  m=${pair%%:*}
  base=${pair#*:}
  for np in 1 2; do
    timeout 120 $mpi -np $np "$b/fngen" eval kld --backend cuda -m "tests/data/fixtures/$m" \
      --base "tests/data/eval/$base.fnlogits" >"$out/kld_${base}_np$np.txt" \
      2>"$out/kld_${base}_np$np.err"
    echo "== eval kld $base np=$np rc=$?"
    grep -iE "mean|same top|KL|PPL" "$out/kld_${base}_np$np.txt" | head -8
  done
done
