#!/usr/bin/env bash
# One GPU-machine call for the throughput work (docs/performance.md "Batched decode" and "Eval at
# scale"), TP=1, the full geometry on random weights, the n-gram table in host memory unless said:
#   tests      the batched step against the decode graph (test_cuda_batch), the rows-by-slot
#              launches of the GDN and QSA decode kernels, score_items; compute-sanitizer memcheck
#              on the rows-by-slot cases (FN_MEMCHECK=0 skips it)
#   placement  `bench -p 8192 -n 256 --skip-prefill` with the table on the device and in host
#              memory, alternated twice (an H200: the 80 GB H100 cannot hold the device table)
#   batches    `bench --batch $FN_BATCHES` (default 1,8,32,64 on an H200, 1,8 on an H100), then the
#              largest batch once more with FN_PREFILL_PROFILE=1 (eager: where its step goes)
#   loglik     `eval loglik` on 1,000 items x 4 choices of 8 ids after 200-id contexts, -c 256,
#              every other flag at its default
# Usage on the GPU machine: bash scripts/gpu/throughput_run.sh; FN_RUNS picks the parts (default
# "tests placement batches loglik"; placement is skipped on a GPU under 100 GB). Logs to $OUT.
set -u
cd "$(dirname "$0")/../.."
fn_out_default=/tmp/throughput-out
source scripts/gpu/common.sh
b=${FN_BUILD_DIR:-build-gpu}
cfg=configs/qwen3.8-flash-next.json
runs=" ${FN_RUNS:-tests placement batches loglik} "
el() { echo "$((SECONDS - t0)) s"; }
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
big=0
[ "${gpu_mib:-0}" -gt 100000 ] && big=1
if ! FN_BUILD_DIR=$b timeout 300 bash scripts/gpu/build.sh fngen test_cuda_batch \
  test_cuda_logit_stats test_cuda_gdn test_cuda_qsa >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -30
  exit 1
fi
echo "== build ok ($(el))"
source scripts/gpu/setup.sh 2>/dev/null  # the carried libraries' LD_LIBRARY_PATH for the runs
if [[ $runs == *" tests "* ]]; then
  t() {  # t NAME BINARY [doctest args]: the test's log to $OUT/NAME.log, its failures printed
    local name=$1
    shift
    timeout 200 "$@" >"$out/$name.log" 2>&1
    echo "== $name rc=$? ($(el)): $(grep -E "assertions:" "$out/$name.log" | tail -n1)"
    grep -E "ERROR|values:|CHECK|TEST CASE" "$out/$name.log" | head -20
  }
  t gdn_rows "$b/tests/test_cuda_gdn" -tc='*rows by slot*,*rejects*'
  t qsa_rows "$b/tests/test_cuda_qsa" -tc='*rows by slot*'
  t batch "$b/tests/test_cuda_batch"
  t score_items "$b/tests/test_cuda_logit_stats" -tc='*score_items*'
  if [ "${FN_MEMCHECK:-1}" != 0 ]; then
    t memcheck_gdn_rows compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$b/tests/test_cuda_gdn" -tc='*rows by slot*'
    t memcheck_qsa_rows compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$b/tests/test_cuda_qsa" -tc='*rows by slot*'
  fi
fi
bench() {  # bench NAME PLACEMENT [bench args]: the report to $OUT/NAME.md
  local name=$1 place=$2
  shift 2
  timeout 200 "$b/fngen" bench --random-weights --config $cfg --ngram-table "$place" -p 8192 \
    --skip-prefill --prefill-chunk 64 -r 1 --warmup 1 "$@" -o "$out/$name.md" >"$out/$name.log" 2>&1
  echo "== $name rc=$? ($(el))"
  grep -E "^\| [0-9]" "$out/$name.md" 2>/dev/null
  grep -E "\[E\]" "$out/$name.log" | head -3
}
if [[ $runs == *" placement "* ]] && [ $big = 1 ]; then
  for round in 1 2; do
    for place in device host; do bench "placement_${place}_$round" $place -n 256; done
  done
fi
if [[ $runs == *" batches "* ]]; then
  batches=${FN_BATCHES:-$([ $big = 1 ] && echo 1,8,32,64 || echo 1,8)}
  bench batches host -n 24 --batch "$batches"
  FN_PREFILL_PROFILE=1 timeout 200 "$b/fngen" bench --random-weights --config $cfg \
    --ngram-table host -p 8192 -n 4 -r 1 --warmup 0 --skip-prefill --prefill-chunk 64 \
    --batch "${batches##*,}" 2>&1 | grep -E "batched step" | tail -n2
fi
if [[ $runs == *" loglik "* ]]; then
  python3 - "$out" <<'PY'
import json, random, sys
rng = random.Random(1)
with open(f"{sys.argv[1]}/loglik_1000x4.jsonl", "w") as f:
    for i in range(1000):
        f.write(json.dumps({"id": i, "context_ids": [rng.randrange(151936) for _ in range(200)],
                            "choices": [[rng.randrange(151936) for _ in range(8)] for _ in range(4)],
                            "answer": i % 4}) + "\n")
PY
  timeout 300 "$b/fngen" eval loglik --random-weights --config $cfg --backend cuda -c 256 \
    -i "$out/loglik_1000x4.jsonl" -o "$out/loglik.jsonl" --json >"$out/loglik.json" \
    2>"$out/loglik.log"
  echo "== loglik rc=$? ($(el)): $(tail -c 240 "$out/loglik.json")"
  grep -E "slots|pass buffers|choices in" "$out/loglik.log"
fi
echo "== done ($(el))"
