#!/usr/bin/env bash
# Backend selection of `fngen generate` and `fngen eval` (apps/backend.h; CTest backend_cli,
# label cpu). Every case runs with CUDA_VISIBLE_DEVICES=-1, so that "no usable GPU" holds on
# every machine (also on the GPU machine): bad --backend / --allreduce values are usage errors
# naming the flag; --backend cuda fails with exit 2 and a message saying there is no CUDA device
# (or no CUDA in the build) on every rank, never a crash; --backend auto runs the cpu backend
# (summaries, JSON and the logits file say "cpu") with the same tokens and numbers as --backend
# cpu; --no-graph and --allreduce are accepted (and ignored) on cpu; --check-choices passes.
# Usage: backend_cli.sh FNGEN MPIEXEC SOURCE_DIR HAVE_CUDA(ON|OFF)
set -u
fngen=$1
mpiexec=$2
src=$3
have_cuda=$4
source "$src/tests/cli_lib.sh"
fx=$src/tests/data/fixtures
export CUDA_VISIBLE_DEVICES=-1
mpi() { mpi_fngen "$@"; }  # mpi NP fngen-args...

ids=$($py -c "import json;print(','.join(map(str,json.load(open('$fx/tp4/expected.json'))['prompt_ids'])))")
want=$($py -c "import json;print(json.load(open('$fx/tp4/expected.json'))['generated_ids'][:8])")

# ---- bad values: usage errors naming the flag (CLI11 checks them before MPI starts) ----
expect 2 "--backend: bogus not in {cpu,cuda,auto}" -- "$fngen" generate -m "$fx/tp4" --prompt-ids 1 --backend bogus
expect 2 "--backend: bogus not in {cpu,cuda,auto}" -- "$fngen" eval ppl -m "$fx/tp4" --ids-file x --backend bogus
expect 2 "--allreduce: bogus not in {auto,custom,nccl}" -- "$fngen" generate -m "$fx/tp4" --prompt-ids 1 --allreduce bogus
expect 2 "--allreduce: bogus not in {auto,custom,nccl}" -- "$fngen" eval score -m "$fx/tp4" -i x --allreduce bogus
expect 2 "--ngram-table: bogus not in {device,host,auto}" -- "$fngen" generate -m "$fx/tp4" --prompt-ids 1 --ngram-table bogus
expect 2 "--gpu-memory-utilization must be in (0, 1], got 0" -- "$fngen" generate -m "$fx/tp4" --prompt-ids 1 --gpu-memory-utilization 0
expect 2 "--gpu-memory-utilization must be in (0, 1], got 1.5" -- "$fngen" bench -m "$fx/tp4" -p 4 -n 2 --gpu-memory-utilization 1.5
[ -s "$tmp/out" ] && fail "a usage error printed results on stdout"

# ---- --backend cuda without a usable GPU: exit 2, one message saying why ----
if [ "$have_cuda" = ON ]; then
  why="no usable CUDA device on rank(s) 0 ("
  why2="no usable CUDA device on rank(s) 0, 1 ("
else
  why="this fngen was built without CUDA"
  why2=$why
fi
expect 2 "usage error: --backend cuda: the CUDA backend is not available: $why" -- \
  "$fngen" generate -m "$fx/tp4" --prompt-ids "$ids" -n 4 --backend cuda
[ -s "$tmp/out" ] && fail "--backend cuda without a GPU printed results: $(head -c 200 "$tmp/out")"
expect 2 "usage error: --backend cuda: the CUDA backend is not available: $why" -- \
  "$fngen" eval dump-logits -m "$fx/tp4" --prompt-ids 1,2,3 -o "$tmp/never.fnlogits" --backend cuda
[ -e "$tmp/never.fnlogits" ] && fail "--backend cuda without a GPU left a logits file"
expect 2 "$why2" -- mpi 2 generate -m "$fx/tp4" --prompt-ids "$ids" -n 4 --backend cuda --allreduce nccl
# The message names both ranks; rank 0 prints it once and aborts the job (apps/main.cpp: the
# other ranks wait for that instead of printing the same error again).
[ "$(grep -c "the CUDA backend is not available" "$tmp/err")" = 1 ] &&
  grep -q "^\[r0/2\].*the CUDA backend is not available" "$tmp/err" &&
  echo "ok: rank 0 reports the missing GPU of both ranks, once" ||
  fail "want one report from rank 0: $(cat "$tmp/err")"

# ---- --backend auto without a GPU: the cpu backend, same results as --backend cpu ----
for np in 1 2; do
  mpi $np generate -m "$fx/tp4" --prompt-ids "$ids" --temp 0 --ignore-eos -n 8 --json \
    --backend cpu >"$tmp/cpu_$np.json" 2>"$tmp/err" || fail "--backend cpu at -np $np: $(tail -n 3 "$tmp/err")"
  mpi $np generate -m "$fx/tp4" --prompt-ids "$ids" --temp 0 --ignore-eos -n 8 --json \
    >"$tmp/auto_$np.json" 2>"$tmp/err" || fail "--backend auto at -np $np: $(tail -n 3 "$tmp/err")"
  check_json "$tmp/cpu_$np.json" "j['backend'] == 'cpu' and j['token_ids'] == $want" \
    "--backend cpu at -np $np: JSON backend cpu, the reference's 8 greedy ids"
  check_json "$tmp/auto_$np.json" "j['backend'] == 'cpu' and j['token_ids'] == $want and \
    j['tp_size'] == $np" "--backend auto at -np $np without a GPU: JSON backend cpu, same ids"
  grep -q "backend cpu, TP $np" "$tmp/err" && echo "ok: auto logs the cpu backend at -np $np" ||
    fail "auto at -np $np did not log 'backend cpu, TP $np': $(cat "$tmp/err")"
done
# The human summary names the backend used; --no-graph and --allreduce are accepted on cpu.
mpi 2 generate -m "$fx/tp4" --prompt-ids "$ids" --temp 0 --ignore-eos -n 8 --no-graph \
  --allreduce custom >"$tmp/out" 2>"$tmp/err" || fail "--no-graph on cpu: $(tail -n 3 "$tmp/err")"
grep -q -- "--- fngen generate: backend cpu, TP 2" "$tmp/err" &&
  echo "ok: summary says 'backend cpu, TP 2'" || fail "summary: $(cat "$tmp/err")"
grep -q "apply to the cuda backend only; ignored on cpu" "$tmp/err" &&
  echo "ok: cuda-only flags on cpu are reported as ignored" || fail "no note on ignored flags"
[ "$(tr -d ' \n' <"$tmp/out")" = "$($py -c "print(''.join(map(str,$want)))")" ] &&
  echo "ok: --no-graph on cpu prints the same ids" || fail "ids printed: $(cat "$tmp/out")"
# --ngram-table is a cuda placement: the cpu backend notes it and prints the same ids.
mpi 1 generate -m "$fx/tp4" --prompt-ids "$ids" --temp 0 --ignore-eos -n 8 --json --backend cpu \
  --ngram-table host >"$tmp/ng.json" 2>"$tmp/err" || fail "--ngram-table host on cpu: $(tail -n 3 "$tmp/err")"
check_json "$tmp/ng.json" "j['backend'] == 'cpu' and j['token_ids'] == $want" \
  "--ngram-table host on cpu: the same 8 greedy ids"
grep -q -- "--ngram-table applies to the cuda backend only; ignored on cpu" "$tmp/err" &&
  echo "ok: --ngram-table on cpu is reported as ignored" || fail "no note on --ngram-table: $(cat "$tmp/err")"
# --check-choices (the cross-rank hash of every step's expert ids and indexer blocks): the ranks
# agree, so the run succeeds with the same ids, at -np 2 and 4 (tp4 has QSA layers).
for np in 2 4; do
  mpi $np generate -m "$fx/tp4" --prompt-ids "$ids" --temp 0 --ignore-eos -n 8 --json \
    --backend cpu --check-choices >"$tmp/cc_$np.json" 2>"$tmp/err" ||
    fail "--check-choices at -np $np: $(tail -n 3 "$tmp/err")"
  check_json "$tmp/cc_$np.json" "j['token_ids'] == $want" \
    "--check-choices at -np $np: every step's choices agree, the reference's 8 greedy ids"
done
# Batch summary.
printf '{"prompt_ids": [1, 2, 3]}\n' >"$tmp/in.jsonl"
mpi 1 generate -m "$fx/tp4" -i "$tmp/in.jsonl" -n 2 --temp 0 >"$tmp/out" 2>"$tmp/err" &&
  grep -q -- "--- fngen generate (batch): backend cpu, TP 1" "$tmp/err" &&
  echo "ok: batch summary says backend cpu" || fail "batch summary: $(cat "$tmp/err")"

# ---- eval: auto = cpu; JSON, score summary and the logits file's source say so ----
$py -c "print(','.join(str((7 * i) % 300 + 1) for i in range(40)))" >"$tmp/ids.txt"
mpi 2 eval ppl -m "$fx/tp4" --ids-file "$tmp/ids.txt" -c 16 --json --backend cpu \
  >"$tmp/ppl_cpu.json" 2>"$tmp/err" || fail "eval ppl cpu: $(tail -n 3 "$tmp/err")"
mpi 2 eval ppl -m "$fx/tp4" --ids-file "$tmp/ids.txt" -c 16 --json --save-logits "$tmp/p.fnlogits" \
  >"$tmp/ppl_auto.json" 2>"$tmp/err" || fail "eval ppl auto: $(tail -n 3 "$tmp/err")"
$py - "$tmp/ppl_cpu.json" "$tmp/ppl_auto.json" "$tmp/p.fnlogits" <<'EOF' &&
import json, struct, sys
a, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
assert a["backend"] == "cpu" and b["backend"] == "cpu", (a["backend"], b["backend"])
assert a["ppl"] == b["ppl"] and a["n_scored"] == b["n_scored"] == 14, (a, b)
with open(sys.argv[3], "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    h = json.loads(f.read(n))
assert h["source"]["backend"] == "cpu" and h["source"]["tp_size"] == 2, h["source"]
EOF
  echo "ok: eval ppl auto = cpu (same PPL), logits file source backend cpu" ||
  fail "eval ppl: $(cat "$tmp/ppl_auto.json")"
printf '{"prompt_ids": %s, "answer": "x"}\n' "[$ids]" >"$tmp/tasks.jsonl"
mpi 1 eval score -m "$fx/tp4" -i "$tmp/tasks.jsonl" -n 2 --no-graph >"$tmp/out" 2>"$tmp/err" &&
  grep -q -- "--- fngen eval score: backend cpu, TP 1" "$tmp/err" &&
  echo "ok: eval score summary says backend cpu" || fail "eval score: $(cat "$tmp/err")"

echo "backend_cli: $failures failure(s)"
[ "$failures" = 0 ]
