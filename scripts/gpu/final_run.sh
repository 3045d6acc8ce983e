#!/usr/bin/env bash
# The one end-of-session GPU call on the 2-GPU machine (issues 6, 8, 9): the fixture acceptance
# with the choice-hash check (test_cuda_model, mpirun -np 2), `fngen generate --backend cuda` at
# TP=1/TP=2 and with --check-choices, eval kld against every transformers base at np 1 and 2, the
# 1,000-prompt soak, the full-geometry bench lanes with the breakdown and the PyTorch peer
# (bench_run.sh), compute-sanitizer memcheck and racecheck on a tiny model, and the load rate of
# a 4-layer real-width synth checkpoint at TP=2 (cold and warm page cache). Each stage after the
# build runs only while the time budget (FN_FINAL_BUDGET seconds, default 390) lasts; skipped
# stages are named. Everything printed is also in $OUT/summary.txt; the eval kld blocks are in
# $OUT/kld_all.txt; the bench JSON in $OUT/bench_tp{1,2}.json. Other logs stay in /tmp/final-logs.
# Usage (from a git archive copy in .carry/X with .carry/peer carried):
#   FN_BUILD_DIR=../../build-final bash scripts/gpu/final_run.sh
set -u
cd "$(dirname "$0")/../.."
final_out=${OUT:-/tmp/final-out}
mkdir -p "$final_out"
logs=/tmp/final-logs
rm -rf "$logs" && mkdir -p "$logs"
budget=${FN_FINAL_BUDGET:-390}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
exec > >(tee "$final_out/summary.txt") 2>&1
left() { [ $((budget - SECONDS)) -gt "$1" ]; }
skip() { echo "== SKIPPED $1 (time budget: $((budget - SECONDS)) s left)"; }

# Build + bench + peer (bench_run.sh starts the peer during the build).
t=$SECONDS
OUT=$logs/bench FN_BUILD_DIR=$b FN_BENCH_NCCL=0 FN_BENCH_N=${FN_BENCH_N:-256} FN_BENCH_R=2 \
  bash scripts/gpu/bench_run.sh | grep -vE "^\s*$" | tail -n 40
cp "$logs/bench/bench_tp1.json" "$logs/bench/bench_tp2.json" "$final_out/" 2>/dev/null
FN_BUILD_DIR=$b timeout 200 bash scripts/gpu/build.sh test_cuda_model >"$logs/build.log" 2>&1 ||
  { grep error "$logs/build.log" | head; exit 1; }
echo "== build + bench stage $((SECONDS - t)) s"

if left 60; then
  t=$SECONDS
  timeout 150 $mpi -np 2 "$b/tests/test_cuda_model" >"$logs/test.log" 2>&1
  echo "== test_cuda_model (np 2) rc=$? ($((SECONDS - t)) s)"
  grep -E "MESSAGE|ERROR|values:|test cases|assertions|THREW" "$logs/test.log" |
    grep -v "per row\|per-row\|H_cuda" | sort -u | cut -c1-250 | head -24
else skip test_cuda_model; fi

fx=tests/data/fixtures
if left 30; then
  for np in 1 2; do
    timeout 60 $mpi -np $np "$b/fngen" generate --backend cuda -m $fx/tp4 \
      --prompt-ids 1,2,3,4,5,6,7,8 -n 24 --temp 0 --ignore-eos >"$logs/gen_$np.txt" 2>"$logs/gen_$np.err"
    echo "== generate --backend cuda np=$np rc=$?: $(tr '\n' ' ' <"$logs/gen_$np.txt" | cut -c1-200)"
    grep -E "TPOT|backend cuda" "$logs/gen_$np.err" | grep "r0/" | tail -2 | cut -c1-220
  done
  timeout 60 $mpi -np 2 "$b/fngen" generate --backend cuda -m $fx/tp4 --check-choices \
    --prompt-ids 1,2,3,4,5,6,7,8 -n 24 --temp 0 --ignore-eos >"$logs/gen_cc.txt" 2>"$logs/gen_cc.err"
  echo "== generate --check-choices np=2 rc=$?: $(tr '\n' ' ' <"$logs/gen_cc.txt" | cut -c1-200)"
  cmp -s "$logs/gen_2.txt" "$logs/gen_cc.txt" && echo "   same ids as without --check-choices" ||
    echo "   DIFFERENT ids from the run without --check-choices"
else skip generate; fi

if left 40; then
  : >"$final_out/kld_all.txt"
  for pair in g3_tiny:g3_tf tp4:tp4_tf tp4:tp4_tf_ppl; do
    m=${pair%%:*}
    base=${pair#*:}
    for np in 1 2; do
      echo "=== $base (fixture $m), --backend cuda, mpirun -np $np" >>"$final_out/kld_all.txt"
      timeout 60 $mpi -np $np "$b/fngen" eval kld --backend cuda -m "$fx/$m" \
        --base "tests/data/eval/$base.fnlogits" >>"$final_out/kld_all.txt" 2>"$logs/kld.err"
      echo "== eval kld $base np=$np rc=$?: $(grep -E "Mean +KLD|Same top p" "$final_out/kld_all.txt" | tail -2 | tr '\n' ' ')"
    done
  done
else skip "eval kld"; fi

if left 50; then
  t=$SECONDS
  OUT=$logs/soak FN_BUILD_DIR=$b timeout 120 bash scripts/gpu/soak.sh 1000 | tail -n 5
  echo "== soak ($((SECONDS - t)) s)"
else skip soak; fi

for tool in memcheck racecheck; do
  if left 60; then
    t=$SECONDS
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 "$b/tests/test_cuda_model" \
      -tc="cuda model: bad input*" >"$logs/$tool.log" 2>&1
    echo "== $tool rc=$? ($((SECONDS - t)) s)"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid|test cases" "$logs/$tool.log" | head -4
  else skip $tool; fi
done

if left 70; then
  dir=/tmp/fngen-rw4-load
  t=$SECONDS
  [ -f $dir/config.json ] || "$b/fngen" synth --config configs/qwen3.8-flash-next.json --out $dir \
    --seed 7 --layers 4 --ngram-vocab-base 200000 >"$logs/synth.log" 2>&1
  echo "== synth 4-layer real width: $(du -sh $dir | cut -f1) ($((SECONDS - t)) s)"
  for cache in cold warm; do
    if [ $cache = cold ]; then
      sync
      /usr/bin/python3 -c "
import os, sys
for f in os.listdir('$dir'):
    fd = os.open(os.path.join('$dir', f), os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)"
    fi
    timeout 90 $mpi -np 2 "$b/fngen" generate --backend cuda -m $dir --prompt-ids 1,2,3 -n 2 \
      --temp 0 --ignore-eos >/dev/null 2>"$logs/load_$cache.err"
    echo "== load np=2 $cache rc=$?: $(grep -aE 'loaded' "$logs/load_$cache.err" | grep r0/ | tail -1 | cut -c1-260)"
  done
else skip "load rate"; fi
echo "== total $SECONDS s"
