#!/usr/bin/env bash
# One GPU-machine call for the HC read rework (issues 8 and 9): N and m in FP32 for every BF16
# GEMV (the routed experts keep a BF16 copy of m), the HC read as two launches (fused norm +
# split-K down pass, mix). Builds only the needed targets, then runs while time is left: the
# three kernel tests (test_cuda_hc, test_cuda_pdl, test_cuda_gemv), `fngen eval kld --backend
# cuda` on the three transformers pairs (TP=1), the full-geometry bench (depth 8192) at TP=1 and
# TP=2, the engine fixture test at TP=2, compute-sanitizer memcheck on test_cuda_hc, the HC
# rows of cuda_kernel_bench and `fngen bench --breakdown` at TP=1 (the hc family).
# Usage on the 2-GPU machine: bash scripts/gpu/hc_run.sh
# Env: FN_BUILD_DIR (default build-gpu), FN_BUDGET_S (default 190: no new item past it minus
# the item's need). Logs under /tmp/hc-logs, the 8 most useful copied to $OUT (or /tmp/hc-out)
# at the end; a compact summary on stdout.
set -u
cd "$(dirname "$0")/../.."
final=${OUT:-/tmp/hc-out}
out=/tmp/hc-logs
mkdir -p "$final" "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
budget=${FN_BUDGET_S:-190}
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
# time_for NEED WHAT: true when NEED seconds are left in the budget (else says what is skipped).
time_for() {
  if [ $((SECONDS + $1)) -gt "$budget" ]; then
    echo "== skipped (time): $2"
    return 1
  fi
}
run_test() {  # run_test TARGET NEED
  local tst=$1 t=$SECONDS
  time_for "$2" "$tst" || return 0
  timeout $((budget - SECONDS)) "$b/tests/$tst" >"$out/$tst.log" 2>&1
  echo "== $tst rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR|MESSAGE|FAILED|THREW|test cases|assertions:" "$out/$tst.log" | cut -c1-240 |
    head -12
}

t=$SECONDS
if ! FN_BUILD_DIR=$b timeout 150 bash scripts/gpu/build.sh fngen test_cuda_hc test_cuda_gemv \
  test_cuda_pdl test_cuda_model cuda_model_bench cuda_kernel_bench >"$out/build.log" 2>&1; then
  grep -E "error|FAILED" "$out/build.log" | head -20
  tail -4 "$out/build.log"
  cp "$out/build.log" "$final/"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"

run_test test_cuda_hc 15
run_test test_cuda_pdl 15
for pair in g3_tiny:g3_tf tp4:tp4_tf tp4:tp4_tf_ppl; do
  m=${pair%%:*}
  base=${pair#*:}
  time_for 10 "kld $base" || continue
  timeout 60 "$b/fngen" eval kld --backend cuda -m "tests/data/fixtures/$m" \
    --base "tests/data/eval/$base.fnlogits" >"$out/kld_$base.txt" 2>"$out/kld_$base.err"
  echo "== eval kld $base (np 1) rc=$?"
  grep -E "Mean +KLD|Same top p" "$out/kld_$base.txt" | head -3
  grep -iE "error" "$out/kld_$base.err" | head -2 | cut -c1-200
done
for np in 1 2; do
  time_for 35 "bench np $np" || continue
  f="$out/bench_tp$np"
  t=$SECONDS
  timeout 90 $mpi -np "$np" "$b/cuda/cuda_model_bench" --config configs/qwen3.8-flash-next.json \
    --depth 8192 --tokens 32 --json "$f.json" >"$f.txt" 2>&1
  echo "== bench TP=$np rc=$? ($((SECONDS - t)) s)"
  grep -E "^\| [0-9]|ms/token" "$f.txt" | cut -c1-240 | head -4
  grep -iE "error|what\(\)" "$f.txt" | head -3 | cut -c1-240
done
if time_for 40 "test_cuda_model np 2"; then
  t=$SECONDS
  timeout $((budget - SECONDS)) $mpi -np 2 "$b/tests/test_cuda_model" >"$out/test_cuda_model.log" 2>&1
  echo "== test_cuda_model (np 2) rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR|THREW|test cases|assertions:" "$out/test_cuda_model.log" | sort -u | cut -c1-240 |
    head -12
fi
run_test test_cuda_gemv 15
if time_for 30 "memcheck test_cuda_hc"; then
  t=$SECONDS
  timeout $((budget - SECONDS)) compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$b/tests/test_cuda_hc" >"$out/memcheck_hc.log" 2>&1
  echo "== memcheck test_cuda_hc rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR SUMMARY|Invalid|test cases" "$out/memcheck_hc.log" | head -4
fi
if time_for 20 "cuda_kernel_bench"; then
  timeout $((budget - SECONDS)) "$b/cuda/cuda_kernel_bench" >"$out/kernel_bench.txt" 2>&1
  echo "== cuda_kernel_bench rc=$?"
  grep -E "hc_|router" "$out/kernel_bench.txt" | cut -c1-200 | head -6
fi
if time_for 35 "fngen bench --breakdown np 1"; then
  t=$SECONDS
  timeout $((budget - SECONDS)) "$b/fngen" bench --random-weights \
    --config configs/qwen3.8-flash-next.json --backend cuda -p 8192 -n 32 -r 1 --warmup 1 \
    --breakdown --format json -o "$out/breakdown_tp1.json" >"$out/breakdown_tp1.log" 2>&1
  echo "== fngen bench --breakdown TP=1 rc=$? ($((SECONDS - t)) s)"
  python3 - "$out/breakdown_tp1.json" <<'PY' 2>&1 | head -12
import json, sys
lane = json.load(open(sys.argv[1]))["lanes"][0]
print(f"TPOT {lane['tpot_ms']:.4f} ms")
for r in lane.get("breakdown", []):
    g = r["ms_graph"]
    print(f"  {r['family']}: {r['bytes'] / 1e6:.1f} MB floor {r['floor_ms']:.4f} ms graph "
          f"{'n/a' if g is None else f'{g:.4f}'} ms eager {r['ms_eager']:.4f} ms")
PY
fi
cat "$out"/kld_*.txt >"$final/kld_all.txt" 2>/dev/null
for f in test_cuda_hc.log test_cuda_pdl.log test_cuda_model.log bench_tp1.txt bench_tp2.txt \
  kernel_bench.txt breakdown_tp1.json; do
  [ -f "$out/$f" ] && cp "$out/$f" "$final/"
done
echo "== done ($SECONDS s)"
