#!/usr/bin/env bash
# Issue 7 (batched prefill) on the 2-GPU machine in one call. Stages, each named in FN_STEPS
# (default "test ttft"):
#   test   build + test_cuda_prefill (mpirun -np 2): the length x chunk table against token by token
#   ttft   fngen bench on the full real geometry (random in-memory weights), -p 8192 -n 64, at
#          TP=1 and TP=2: TTFT and prefill tokens/s (JSON in $OUT/ttft_tp{1,2}.json)
#   long   TP=2 full geometry, -p 262080 -n 64 (prompt + generated = 262,144 tokens, the model's
#          max_position_embeddings): TTFT and
#          decode ms/token at that depth; then one token more than the context is refused
#   rw64k  fngen bench on the 4-layer real-width config, -p 65536 -n 16, TP=2
#   gen    fngen generate --backend cuda on the tp4 fixture at np 1 and 2 with the batched prefill
#          (one pass, passes of 3) and with --check-choices (token-by-token prefill): the ids
#   memcheck  compute-sanitizer memcheck of the fixture/bad-input test cases (TP=1)
#   regress   the decode acceptance (test_cuda_model, mpirun -np 2) and the kernel tests the
#          prefill work touched (decode ops/router, QSA, GDN, PLE, MoE prefill, HC)
# Everything printed is also in $OUT/summary.txt. Usage (from a git archive copy in .carry/X):
#   FN_BUILD_DIR=../../build-X FN_STEPS="test ttft" bash scripts/gpu/prefill_run.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/prefill-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
steps=" ${FN_STEPS:-test ttft} "
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
exec > >(tee "$out/summary.txt") 2>&1
has() { [[ "$steps" == *" $1 "* ]]; }
cfg=configs/qwen3.8-flash-next.json

t=$SECONDS
targets="fngen"
has test && targets="$targets test_cuda_prefill"
has memcheck && targets="$targets test_cuda_prefill"
regress_tests="test_cuda_decode_ops test_cuda_qsa test_cuda_qsa_prefill test_cuda_gdn test_cuda_gdn_prefill test_cuda_ple test_cuda_ple_rows test_cuda_moe_prefill test_cuda_hc"
has regress && targets="$targets test_cuda_model $regress_tests"
if ! FN_BUILD_DIR=$b timeout 400 bash scripts/gpu/build.sh $targets >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -30
  tail -20 "$out/build.log"
  exit 1
fi
echo "== build $((SECONDS - t)) s"

if has test; then
  t=$SECONDS
  timeout ${FN_TEST_TIMEOUT:-300} $mpi -np 2 "$b/tests/test_cuda_prefill" >"$out/test_prefill.log" 2>&1
  echo "== test_cuda_prefill (np 2) rc=$? ($((SECONDS - t)) s)"
  grep -E "MESSAGE|ERROR|\||values:|test cases|assertions|THREW|first row" "$out/test_prefill.log" |
    cut -c1-250 | head -80
fi

bench() {  # name np args...
  local name=$1 np=$2
  shift 2
  local t=$SECONDS
  timeout ${FN_BENCH_TIMEOUT:-240} $mpi -np "$np" "$b/fngen" bench --backend cuda "$@" \
    --format json -o "$out/$name.json" 2>"$out/$name.err"
  echo "== bench $name np=$np rc=$? ($((SECONDS - t)) s): $*"
  grep -E "ttft|TTFT|TPOT|error|Error|prefill profile" "$out/$name.err" | grep -v "^\s*$" | tail -8 |
    cut -c1-250
  [ -f "$out/$name.json" ] && /usr/bin/python3 - "$out/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for lane in r.get("lanes", []):
    print("   lane p={} n={}: ttft_ms={} prefill_ms={} tpot_ms={}".format(
        lane.get("n_prompt"), lane.get("n_gen"), lane.get("ttft_ms_mean", lane.get("ttft_ms")),
        lane.get("prefill_ms_mean", lane.get("prefill_ms")), lane.get("tpot_ms_mean", lane.get("tpot_ms"))))
PY
}

if has ttft; then
  export FN_PREFILL_PROFILE=1
  bench ttft_tp1 1 --random-weights --config $cfg -p 8192 -n 64 -r 2 --warmup 1
  bench ttft_tp2 2 --random-weights --config $cfg -p 8192 -n 64 -r 2 --warmup 1
fi
if has rw64k; then
  /usr/bin/python3 - "$cfg" "$out/rw4.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
t = c["text_config"]
t["num_hidden_layers"] = 4
t["layer_types"] = t["layer_types"][:4]
t["ngram_vocab_size_base"] = 200000
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
  bench rw64k_tp2 2 --random-weights --config "$out/rw4.json" -p 65536 -n 16 -r 1 --warmup 0
fi
if has long; then
  FN_BENCH_TIMEOUT=${FN_LONG_TIMEOUT:-400} bench long_tp2 2 --random-weights --config $cfg -p 262080 -n 64 -r 1 --warmup 0 \
    --prefill-chunk 16384
  t=$SECONDS
  timeout 120 $mpi -np 2 "$b/fngen" bench --backend cuda --random-weights --config $cfg \
    -p 262081 -n 64 -r 1 --warmup 0 >"$out/over.txt" 2>"$out/over.err"
  echo "== one token past the context: rc=$? ($((SECONDS - t)) s)"
  grep -iE "error|context|max_position" "$out/over.err" | head -3 | cut -c1-250
fi
if has regress; then
  t=$SECONDS
  timeout 200 $mpi -np 2 "$b/tests/test_cuda_model" >"$out/test_model.log" 2>&1
  echo "== test_cuda_model (np 2) rc=$? ($((SECONDS - t)) s)"
  grep -E "test cases|assertions" "$out/test_model.log" | tail -2
  for tst in $regress_tests; do
    t=$SECONDS
    timeout 120 "$b/tests/$tst" >"$out/$tst.log" 2>&1
    echo "== $tst rc=$? ($((SECONDS - t)) s): $(grep -E "test cases" "$out/$tst.log" | tail -1)"
  done
fi
if has gen; then
  ids=$(seq -s, 1 40)
  for np in 1 2; do
    for mode in "" "--prefill-chunk 3" "--check-choices"; do
      timeout 60 $mpi -np $np "$b/fngen" generate --backend cuda -m tests/data/fixtures/tp4 \
        --prompt-ids "$ids" -n 24 --temp 0 --ignore-eos $mode >"$out/gen.txt" 2>"$out/gen.err"
      echo "== generate np=$np ${mode:-(batched prefill)} rc=$?: $(tr '\n' ' ' <"$out/gen.txt" | cut -c1-160)"
    done
  done
fi
if has memcheck; then
  t=$SECONDS
  timeout ${FN_MEMCHECK_TIMEOUT:-300} compute-sanitizer --tool memcheck --error-exitcode 9 "$b/tests/test_cuda_prefill" \
    -tc="*fixtures*,*usage errors*" >"$out/memcheck.log" 2>&1
  echo "== memcheck rc=$? ($((SECONDS - t)) s)"
  grep -E "ERROR SUMMARY|Invalid|test cases" "$out/memcheck.log" | head -6
fi
