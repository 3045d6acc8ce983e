#!/usr/bin/env bash
# Issue 6 acceptance on the 2-GPU machine, second half: builds fngen and
# test_cuda_model_realwidth, runs the 4-layer real-width CUDA-vs-CPU check at TP=1/TP=2 (it writes
# the synth checkpoint to $FN_REALWIDTH_DIR, default /tmp/fngen-rw4), then measures the load
# rate of that checkpoint with a cold page cache (each file is dropped from the cache with
# posix_fadvise(DONTNEED) after a sync) and with a warm one, at np 1 and np 2. Logs to $OUT.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/realwidth-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
b=${FN_BUILD_DIR:-build-gpu}
export FN_REALWIDTH_DIR=${FN_REALWIDTH_DIR:-/tmp/fngen-rw4}
t=$SECONDS
FN_BUILD_DIR=$b timeout 240 bash scripts/gpu/build.sh fngen test_cuda_model_realwidth \
  >"$out/rw_build.log" 2>&1 || { grep error "$out/rw_build.log" | head; exit 1; }
echo "== build ok ($((SECONDS - t)) s)"
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
t=$SECONDS
timeout ${FN_RW_TIMEOUT:-300} $mpi -np 2 "$b/tests/test_cuda_model_realwidth" >"$out/rw_test.log" 2>&1
echo "== test_cuda_model_realwidth rc=$? ($((SECONDS - t)) s)"
grep -E "synth:|worst|test cases|ERROR" "$out/rw_test.log" | cut -c1-300 | sort -u | head -12
du -sh "$FN_REALWIDTH_DIR"
drop_cache() {
  sync
  /usr/bin/python3 - "$FN_REALWIDTH_DIR" <<'PY'
import os, sys
for f in os.listdir(sys.argv[1]):
    fd = os.open(os.path.join(sys.argv[1], f), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
PY
}
for np in 1 2; do
  for cache in cold warm; do
    [ $cache = cold ] && drop_cache
    timeout 120 $mpi -np $np "$b/fngen" generate --backend cuda -m "$FN_REALWIDTH_DIR" \
      --prompt-ids 1,2,3 -n 4 --temp 0 --ignore-eos >"$out/load_${np}_$cache.txt" \
      2>"$out/load_${np}_$cache.err"
    echo "== load np=$np $cache cache rc=$?: $(grep -aE 'loaded|GB/s' "$out/load_${np}_$cache.err" | tail -2 | tr '\n' ' ' | cut -c1-300)"
  done
done
