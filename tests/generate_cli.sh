#!/usr/bin/env bash
# `mpirun -np N fngen generate` end to end (CTest generate_cli, label mpi): greedy ids of the tp4
# reference fixture at -np 1, 2 and 4 (--ignore-eos, and the stop at the first EOS without it),
# text prompts, chat and --stop on a synthesized Qwen3-vocab model, and the bad-input cases:
# prompt over the context, empty prompt, unknown flag, --random-weights misuse, bad JSONL
# records (the run goes on), a text prompt without a tokenizer, a world size that does not divide
# the heads, --backend cuda, and a rank killed with SIGKILL mid-generation (mpirun must end
# non-zero within 10 s).
# Usage: generate_cli.sh FNGEN MPIEXEC SOURCE_DIR
set -u
fngen=$1
mpiexec=$2
src=$3
source "$src/tests/cli_lib.sh"
fx=$src/tests/data/fixtures
mpi() {  # mpi NP args...
  local np=$1
  shift
  mpi_fngen "$np" generate "$@"
}

# ---- acceptance: greedy ids of the tp4 fixture at -np 1, 2, 4 ----
ids=$($py -c "import json;print(','.join(map(str,json.load(open('$fx/tp4/expected.json'))['prompt_ids'])))")
want=$($py -c "import json;print(json.load(open('$fx/tp4/expected.json'))['generated_ids'][:32])")
for np in 1 2 4; do
  if mpi $np -m "$fx/tp4" --prompt-ids "$ids" --temp 0 --ignore-eos -n 32 --json \
    >"$tmp/tp4_$np.json" 2>"$tmp/err"; then
    check_json "$tmp/tp4_$np.json" "j['token_ids'] == $want and j['finish_reason'] == 'length' \
      and j['n_prompt_tokens'] == 40 and j['tp_size'] == $np and len(j['per_token_ms']) == 31 \
      and len(j['peak_rss_mib']) == $np and j['ttft_ms'] > 0" \
      "tp4 at -np $np: the reference's 32 greedy ids"
  else
    fail "tp4 at -np $np exited non-zero: $(tail -n 5 "$tmp/err")"
  fi
done
# Without --ignore-eos: stop at the first stop id (8 = generation_config's <|im_end|> stand-in).
mpi 4 -m "$fx/tp4" --prompt-ids "$ids" --temp 0 -n 32 --json >"$tmp/eos.json" 2>"$tmp/err" ||
  fail "tp4 eos run exited non-zero"
check_json "$tmp/eos.json" "j['finish_reason'] == 'eos' and j['token_ids'] == \
  ($want)[:($want).index(8) + 1]" "tp4 stops at the first stop id without --ignore-eos"
# Seeded sampling is reproducible and identical across TP sizes' decisions (same seed, TP 1 vs 4
# logits differ only in rounding, so compare two runs at the same TP).
mpi 2 -m "$fx/tp4" --prompt-ids "$ids" --seed 5 -n 16 --ignore-eos --json >"$tmp/s1.json" 2>/dev/null
mpi 2 -m "$fx/tp4" --prompt-ids "$ids" --seed 5 -n 16 --ignore-eos --json >"$tmp/s2.json" 2>/dev/null
$py -c "import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); \
  sys.exit(0 if a['token_ids']==b['token_ids'] and a['sampling']['top_k']==20 \
  and a['sampling']['seed']==5 else 1)" "$tmp/s1.json" "$tmp/s2.json" &&
  echo "ok: --seed 5 reproduces; top_k 20 came from generation_config.json" ||
  fail "seeded runs differ or generation_config defaults not applied"
# Seeds above 2^63 (half of the printed random seeds) are taken whole, so a run can be repeated.
big=12798617088344830066
mpi 1 -m "$fx/tp4" --prompt-ids "$ids" --seed $big -n 8 --ignore-eos --json >"$tmp/b1.json" 2>/dev/null
mpi 1 -m "$fx/tp4" --prompt-ids "$ids" --seed $big -n 8 --ignore-eos --json >"$tmp/b2.json" 2>/dev/null
$py -c "import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); \
  sys.exit(0 if a['token_ids']==b['token_ids'] and a['sampling']['seed']==$big else 1)" \
  "$tmp/b1.json" "$tmp/b2.json" && echo "ok: --seed $big (> 2^63) reproduces and is echoed whole" ||
  fail "a seed above 2^63 was not kept"
expect 2 "seed: '18446744073709551616' is out of range (allowed -1, or 0 to 18446744073709551615)" -- \
  mpi 1 -m "$fx/tp4" --prompt-ids "$ids" --seed 18446744073709551616
expect 2 "seed: '-2' is out of range (allowed -1, or 0 to 18446744073709551615)" -- \
  mpi 1 -m "$fx/tp4" --prompt-ids "$ids" --seed -2

# ---- --logprobs K: the chosen id's log-prob and K alternatives, the same at -np 1 and 2 ----
for np in 1 2; do
  mpi $np -m "$fx/tp4" --prompt-ids "$ids" --temp 0 --ignore-eos -n 8 --logprobs 3 --json \
    >"$tmp/lp_$np.json" 2>"$tmp/err" || fail "--logprobs 3 at -np $np exited non-zero: $(tail -n 3 "$tmp/err")"
  # Greedy: the chosen id is the first alternative; log-probs <= 0, descending, and the three
  # alternatives hold less than all the mass.
  check_json "$tmp/lp_$np.json" "len(j['logprobs']) == 8 and all( \
    e['id'] == t and len(e['top_logprobs']) == 3 and e['top_logprobs'][0]['id'] == t \
    and e['logprob'] == e['top_logprobs'][0]['logprob'] and e['logprob'] <= 0 \
    and [x['logprob'] for x in e['top_logprobs']] == sorted([x['logprob'] for x in e['top_logprobs']], reverse=True) \
    and sum(__import__('math').exp(x['logprob']) for x in e['top_logprobs']) < 1 \
    and 'token' not in e for e, t in zip(j['logprobs'], j['token_ids']))" \
    "--logprobs 3 at -np $np: the greedy id first among 3 alternatives (no tokenizer: no text)"
done
$py -c "import json,sys; a=json.load(open(sys.argv[1]))['logprobs']; b=json.load(open(sys.argv[2]))['logprobs']; \
sys.exit(0 if [[x['id'] for x in e['top_logprobs']] for e in a] == [[x['id'] for x in e['top_logprobs']] for e in b] \
  and max(abs(x['logprob'] - y['logprob']) for e, f in zip(a, b) for x, y in zip(e['top_logprobs'], f['top_logprobs'])) < 1e-4 else 1)" \
  "$tmp/lp_1.json" "$tmp/lp_2.json" && pass "--logprobs: -np 1 and -np 2 agree (ids; values to 1e-4)" ||
  fail "--logprobs differs between -np 1 and -np 2"
# Without the option there is no "logprobs" field.
check_json "$tmp/tp4_1.json" "'logprobs' not in j" "no --logprobs: no logprobs field"
printf '{"id": "a", "prompt_ids": [1, 2, 3], "max_tokens": 4}\n' >"$tmp/lp_in.jsonl"
mpi 2 -m "$fx/tp4" -i "$tmp/lp_in.jsonl" -o "$tmp/lp_out.jsonl" --logprobs 0 --ignore-eos --seed 3 \
  2>"$tmp/err" || fail "-i with --logprobs 0 exited non-zero: $(tail -n 3 "$tmp/err")"
check_jsonl "$tmp/lp_out.jsonl" "len(r) == 1 and len(r[0]['logprobs']) == 4 \
  and all(e['top_logprobs'] == [] and e['logprob'] <= 0 for e in r[0]['logprobs'])" \
  "-i with --logprobs 0: the sampled ids' log-probs, no alternatives"
# A record's "logprobs" overrides the flag (here: none given); out of range: an error record.
printf '%s\n' '{"id": "k2", "prompt_ids": [1, 2, 3], "max_tokens": 3, "logprobs": 2}' \
  '{"id": "none", "prompt_ids": [1, 2, 3], "max_tokens": 3}' \
  '{"id": "bad", "prompt_ids": [1, 2, 3], "logprobs": 30}' >"$tmp/lp_rec.jsonl"
mpi 2 -m "$fx/tp4" -i "$tmp/lp_rec.jsonl" -o "$tmp/lp_rec_out.jsonl" --ignore-eos --seed 3 \
  2>"$tmp/err" || fail "-i with per-record logprobs exited non-zero: $(tail -n 3 "$tmp/err")"
check_jsonl "$tmp/lp_rec_out.jsonl" "[x['id'] for x in r] == ['k2', 'none', 'bad'] \
  and all(len(e['top_logprobs']) == 2 for e in r[0]['logprobs']) and len(r[0]['logprobs']) == 3 \
  and 'logprobs' not in r[1] and r[2]['finish_reason'] == 'error' \
  and 'must be an integer in [0, 20], got 30' in r[2]['error']" \
  "a record's \"logprobs\" overrides the flag; 30 makes an error record"
expect 2 "--logprobs reports in the JSON outputs: add --json" -- mpi 1 -m "$fx/tp4" --prompt-ids 1,2 \
  --logprobs 2
expect 2 "--logprobs: '21' is out of range (allowed 0 to 20)" -- mpi 1 -m "$fx/tp4" --prompt-ids 1,2 \
  --logprobs 21 --json

# ---- bad input: CLI ----
expect 2 "bogus" -- mpi 2 -m "$fx/tp4" --prompt-ids 1,2 --bogus
# --random-weights (cuda timing without a checkpoint): the source flags, then the backend.
expect 2 "give either -m/--model DIR or --random-weights --config FILE (not both)" -- mpi 1 \
  -m "$fx/tp4" --random-weights --config "$src/configs/tiny.json" --prompt-ids 1,2
expect 2 "--random-weights needs --config FILE" -- mpi 1 --random-weights --prompt-ids 1,2
expect 2 "--config applies to --random-weights only" -- mpi 1 -m "$fx/tp4" \
  --config "$src/configs/tiny.json" --prompt-ids 1,2
expect 2 "--config applies to --random-weights only" -- mpi 1 --config "$src/configs/tiny.json" \
  --prompt-ids 1,2
expect 2 "--weights-seed applies to --random-weights only" -- mpi 1 -m "$fx/tp4" --weights-seed 3 \
  --prompt-ids 1,2
expect 2 "--tokenizer applies to --random-weights only" -- mpi 1 -m "$fx/tp4" --tokenizer "$tmp" \
  --prompt-ids 1,2
expect 2 "--tokenizer $tmp: no directory holding tokenizer.json or tokenizer.model" -- mpi 1 \
  --random-weights --config "$src/configs/tiny.json" --tokenizer "$tmp" --prompt-ids 1,2
expect 2 "-p/--prompt is text, but --random-weights without --tokenizer DIR has no tokenizer" -- \
  mpi 1 --random-weights --config "$src/configs/tiny.json" -p hello
expect 2 "--random-weights needs the cuda backend" -- mpi 1 --backend cpu --random-weights \
  --config "$src/configs/tiny.json" --prompt-ids 1,2
expect 2 "--config $src/configs is a directory; give the config.json file itself" -- mpi 1 \
  --random-weights --config "$src/configs" --prompt-ids 1,2
$py -c "import json; c = json.load(open('$src/configs/tiny.json')); c.pop('quantization_config', None); \
  json.dump(c, open('$tmp/noquant.json', 'w'))"
expect 2 "has no quantization_config: --random-weights builds the NVFP4 layout" -- mpi 1 \
  --backend cpu --random-weights --config "$tmp/noquant.json" --prompt-ids 1,2
printf '{"prompt_ids": [1, 2]}\n' >"$tmp/rw.jsonl"
expect 2 "--random-weights needs the cuda backend" -- mpi 2 --backend cpu --tp 1 --random-weights \
  --config "$src/configs/tiny.json" -i "$tmp/rw.jsonl"
expect 2 "and --config $src/configs/tiny.json name the same file" -- mpi 1 --random-weights \
  --config "$src/configs/tiny.json" -i "$tmp/rw.jsonl" -o "$src/configs/tiny.json"
expect 2 "--prefill-chunk: '0' is out of range (allowed 1 to" -- mpi 1 -m "$fx/tp4" --prompt-ids 1,2 \
  --prefill-chunk 0
expect 2 "--prefill-chunk: 'x' is not a decimal whole number" -- mpi 1 -m "$fx/tp4" --prompt-ids 1,2 \
  --prefill-chunk x
expect 2 "--system-prompt applies to chat prompts: add --chat" -- mpi 1 -m "$fx/tp4" \
  --prompt-ids 1,2 --system-prompt "be brief"
# The other chat-only flags are refused without --chat too (they were ignored silently).
expect 2 "--think applies to chat prompts: add --chat" -- mpi 1 -m "$fx/tp4" --prompt-ids 1,2 --think
expect 2 "--no-think applies to chat prompts: add --chat" -- mpi 1 -m "$fx/tp4" --prompt-ids 1,2 --no-think
expect 2 "--chat-template applies to chat prompts: add --chat" -- mpi 1 -m "$fx/tp4" \
  --prompt-ids 1,2 --chat-template qwen3
expect 2 "-c/--ctx-size: '-3' is out of range (allowed 0 to" -- mpi 1 -m "$fx/tp4" \
  --prompt-ids 1,2 -c -3
expect 2 "ctx-size 50" -- mpi 2 -m "$fx/tp4" --prompt-ids "$ids" -n 32 -c 50
grep -q "40 tokens" "$tmp/err" || fail "the context error does not name the prompt length"
expect 2 "max_position_embeddings 1024" -- mpi 2 -m "$fx/tp4" --prompt-ids 1,2 -c 5000
expect 2 "empty" -- mpi 2 -m "$fx/g3_tiny" --prompt-ids ","
# An empty prompt is bad input (3), from --prompt-ids as from -p and -f (below).
expect 3 "format error: --prompt-ids: the prompt is empty" -- mpi 2 -m "$fx/g3_tiny" --prompt-ids ""
# Refused before the load on rank 0 and agreed on: one message, every rank ends without MPI_Abort.
no_abort "--prompt-ids ''" "the prompt is empty"
# Without -n, the default 256 new tokens stop where a smaller context ends (-n as given must fit).
mpi 2 -m "$fx/g3_tiny" --prompt-ids 1,2,3 -c 8 --ignore-eos --json >"$tmp/small_ctx.json" 2>/dev/null ||
  fail "generate -c 8 without -n failed"
check_json "$tmp/small_ctx.json" "len(j['token_ids']) == 5" "-c 8 without -n: 5 new tokens after 3"
expect 2 "the prompt (3 tokens) plus -n/--max-new-tokens (6) is 9 tokens" -- \
  mpi 2 -m "$fx/g3_tiny" --prompt-ids 1,2,3 -c 8 -n 6
expect 2 "item 2 = 512 is outside the vocabulary" -- mpi 2 -m "$fx/g3_tiny" --prompt-ids 1,512
expect 2 "no tokenizer" -- mpi 2 -m "$fx/g3_tiny" -p "hello"
expect 2 "exactly one of" -- mpi 2 -m "$fx/g3_tiny"
expect 2 "not available" -- mpi 2 -m "$fx/g3_tiny" --prompt-ids 1 --backend cuda
expect 2 "must divide linear_num_key_heads" -- mpi 4 -m "$fx/g3_tiny" --prompt-ids 1,2
grep -q "mpirun -np 4" "$tmp/err" || fail "the TP error does not name the world size"
expect 2 "got 3" -- mpi 3 -m "$fx/tp4" --prompt-ids 1,2
# Load errors are agreed on across ranks (agree_on_error): rank 0 alone prints them, and every
# rank ends normally with the exit code (no MPI_Abort, whose help text Open MPI can garble).
[ "$(grep -c "got 3" "$tmp/err")" = 1 ] && grep -q "^\[r0/3\].*got 3" "$tmp/err" &&
  ! grep -q "ORTE_ERROR_LOG\|MPI_ABORT was invoked" "$tmp/err" &&
  echo "ok: the TP split error is printed once, by rank 0, and the ranks end without MPI_Abort" ||
  fail "the TP split error was printed $(grep -c "got 3" "$tmp/err") times: $(cat "$tmp/err")"
expect 2 "--tp 2 must equal the number of MPI ranks" -- mpi 4 -m "$fx/tp4" --prompt-ids 1 --tp 2
# NaN weights (one BF16 NaN in lm_head row 0, rank 0's vocab slice): the non-finite logit is raised
# on every rank alike (the logits are all-gathered), so rank 0 alone prints it and every rank ends
# with exit 3 (it once went through MPI_Abort, whose notice Open MPI garbled in about 1 run
# in 3).
cp -r "$fx/tp4" "$tmp/nan_lm"
$py - "$tmp/nan_lm/model-bf16-00002.safetensors" <<'PY'
import json, struct, sys
with open(sys.argv[1], "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    f.seek(8 + n + json.loads(f.read(n))["lm_head.weight"]["data_offsets"][0])
    f.write(struct.pack("<H", 0x7FC0))
PY
for np in 1 4; do
  expect 3 "non-finite logit (nan for token 0) at position" -- \
    mpi $np -m "$tmp/nan_lm" --backend cpu --prompt-ids "$ids" --temp 0 -n 4
  [ "$(grep -c "non-finite logit" "$tmp/err")" = 1 ] && grep -q "^\[r0/$np\].*non-finite" "$tmp/err" &&
    ! grep -q "ORTE_ERROR_LOG\|MPI_ABORT was invoked" "$tmp/err" &&
    echo "ok: -np $np NaN logit: one message, by rank 0, no MPI_Abort" ||
    fail "-np $np NaN logit: $(grep -v '^$' "$tmp/err" | head -n 8)"
done
# -n -1 (until the context is full) with a prompt that already fills it: the message says so.
# A prompt the context cannot hold is bad input (exit 3, README "Exit codes"), whatever -n is,
# as the same prompt is a bad record in a batch; -n past the room a prompt leaves stays a usage
# error (2, above).
expect 3 "format error: the prompt (4 tokens) fills the context size -c/--ctx-size 4: -n/--max-new-tokens -1" -- \
  mpi 2 -m "$fx/g3_tiny" --prompt-ids 1,2,3,4 -c 4 -n -1
expect 3 "format error: the prompt (5 tokens) exceeds the context size -c/--ctx-size 4: it leaves no room" -- \
  mpi 2 -m "$fx/g3_tiny" --prompt-ids 1,2,3,4,5 -c 4
expect 3 "format error: the prompt (5 tokens) exceeds the context size -c/--ctx-size 4: it leaves no room for a generated token" -- \
  mpi 2 -m "$fx/g3_tiny" --prompt-ids 1,2,3,4,5 -c 4 -n 2
no_abort "a prompt over the context" "format error"
# The same prompt as the only record of a batch: the same message in its error record, exit 3.
echo '{"prompt_ids": [1, 2, 3, 4, 5]}' >"$tmp/long.jsonl"
expect 3 "long.jsonl: line 1: the prompt (5 tokens) exceeds the context size -c/--ctx-size 4: it leaves no room" -- \
  mpi 2 -m "$fx/g3_tiny" -i "$tmp/long.jsonl" -c 4
# An -n that no record can fit (-n >= -c) is refused once, before the load, as a usage error.
echo '{"prompt_ids": [1]}' >"$tmp/one.jsonl"
expect 2 "-n/--max-new-tokens 4 leaves no room for a prompt token in the context size -c/--ctx-size 4" -- \
  mpi 2 -m "$fx/g3_tiny" -i "$tmp/one.jsonl" -c 4 -n 4
expect 2 "--chat renders a text prompt" -- mpi 2 -m "$fx/g3_tiny" --prompt-ids 1,2 --chat
expect 2 "--stop: an empty stop string" -- mpi 2 -m "$fx/g3_tiny" --prompt-ids 1,2 --stop ""
expect 2 "--stop: invalid UTF-8 at byte offset 1 (byte 0xFF)" -- \
  mpi 2 -m "$fx/g3_tiny" --prompt-ids 1,2 --stop "ok" --stop $'a\xff'
# Input files: a directory, an empty JSONL batch.
expect 3 "is a directory, not a file" -- mpi 2 -m "$fx/g3_tiny" -f "$tmp"
: >"$tmp/empty.jsonl"
expect 3 "empty.jsonl: no records" -- mpi 2 -m "$fx/g3_tiny" -i "$tmp/empty.jsonl"
# Log levels: FN_LOG_LEVEL is honoured (no INFO lines at "error"), --log-level wins over it, a
# bad value is one usage error printed once (by rank 0), from the flag or the environment.
FN_LOG_LEVEL=error mpi_fngen 2 generate -m "$fx/g3_tiny" --prompt-ids 1,2 -n 2 >/dev/null \
  2>"$tmp/err" && ! grep -q "\[I\]" "$tmp/err" && echo "ok: FN_LOG_LEVEL=error hides INFO lines" ||
  fail "FN_LOG_LEVEL=error: $(head -n 3 "$tmp/err")"
FN_LOG_LEVEL=error mpi_fngen 2 --log-level info generate -m "$fx/g3_tiny" --prompt-ids 1,2 -n 2 \
  >/dev/null 2>"$tmp/err" && grep -q "\[I\]" "$tmp/err" && echo "ok: --log-level beats FN_LOG_LEVEL" ||
  fail "--log-level info under FN_LOG_LEVEL=error: $(head -n 3 "$tmp/err")"
expect 2 "--log-level: bogus not in" -- mpi_fngen 2 --log-level bogus generate -m "$fx/g3_tiny" --prompt-ids 1
[ "$(grep -c "bogus" "$tmp/err")" = 1 ] && echo "ok: a bad --log-level is reported once" ||
  fail "a bad --log-level was reported $(grep -c "bogus" "$tmp/err") times: $(cat "$tmp/err")"
FN_LOG_LEVEL=bogus expect 2 "FN_LOG_LEVEL: unknown log level 'bogus'" -- \
  mpi_fngen 2 generate -m "$fx/g3_tiny" --prompt-ids 1
# Id prompts work on the tokenizer-less fixture (and print the ids).
mpi 2 -m "$fx/g3_tiny" --prompt-ids 1,2,3 --temp 0 -n 4 >"$tmp/out" 2>"$tmp/err" &&
  grep -qE '^[0-9]+ [0-9]+ [0-9]+ [0-9]+ $' "$tmp/out" && echo "ok: id prompt without tokenizer" ||
  fail "id prompt on g3_tiny: $(cat "$tmp/out") $(tail -n 3 "$tmp/err")"

# ---- bad input: JSONL records (each gets an error naming the field, the run goes on) ----
cat >"$tmp/in.jsonl" <<'EOF'
{"id": "a", "prompt_ids": [1, 2, 3]}
this is not json
{"messages": {"role": "user", "content": "hi"}}
{"messages": [{"role": "robot", "content": "hi"}]}
{"prompt_ids": [1, "x", 3]}
{"prompt_ids": [1, 512]}
{"prompt": "hello"}

{"prompt_ids": []}
{"id": 10, "prompt_ids": [5, 6]}
{"id": "dup", "prompt_ids": [1, 2], "prompt_ids": [3]}
{"messages": [{"role": "user", "content": "a", "content": "b"}]}
EOF
if mpi 2 -m "$fx/g3_tiny" -i "$tmp/in.jsonl" -o "$tmp/out.jsonl" --temp 0 -n 4 \
  >/dev/null 2>"$tmp/err"; then
  $py - "$tmp/out.jsonl" <<'EOF' && echo "ok: JSONL errors per record, valid records ran" || fail "JSONL batch: $(cat "$tmp/out.jsonl")"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
assert len(recs) == 11, len(recs)
# A key given twice is refused, naming the line and the key (the parser kept the last value).
dup = 'duplicate key "{}" (each key may appear once in an object)'
want = {1: "not valid JSON", 2: '"messages" must be a list', 3: 'role "robot"',
        4: '"prompt_ids"[1] is not an integer', 5: '"prompt_ids"[1] = 512 is outside',
        6: "no tokenizer", 7: "empty", 9: "line 11: " + dup.format("prompt_ids"),
        10: "line 12: " + dup.format("content")}
for i, r in enumerate(recs):
    if i in want:
        assert r["finish_reason"] == "error" and want[i] in r["error"], (i, r)
        assert "line" in r["error"], r
    else:
        assert "error" not in r and len(r["token_ids"]) == 4 and r["finish_reason"] == "length", r
        assert len(r["per_token_ms"]) == 3 and set(r["tpot_ms"]) >= {"mean", "p50", "p90", "p99"}
assert recs[0]["id"] == "a" and recs[8]["id"] == 10 and recs[1]["id"] == 2
# A line that does not parse is keyed by its line number, as one that is not JSON.
assert recs[9]["id"] == 11 and recs[10]["id"] == 12, (recs[9]["id"], recs[10]["id"])
EOF
  grep -q "errors 9" "$tmp/err" || fail "batch summary does not count 9 errors: $(tail -n 5 "$tmp/err")"
  # The batch record equals the single-prompt run (the model is reset between records).
  mpi 2 -m "$fx/g3_tiny" --prompt-ids 1,2,3 --temp 0 -n 4 --json >"$tmp/single.json" 2>/dev/null
  $py -c "import json,sys; a=json.loads(open(sys.argv[1]).readline()); \
    b=json.load(open(sys.argv[2])); sys.exit(0 if a['token_ids']==b['token_ids'] else 1)" \
    "$tmp/out.jsonl" "$tmp/single.json" && echo "ok: batch record == single run" ||
    fail "batch record differs from the single run"
else
  fail "JSONL batch exited non-zero: $(tail -n 5 "$tmp/err")"
fi

# ---- output files: never the input nor a checkpoint file, also through links ----
cp -r "$fx/g3_tiny" "$tmp/g3"
printf '{"prompt_ids": [1, 2]}\n' >"$tmp/b.jsonl"
ln -s b.jsonl "$tmp/b_link.jsonl"
ln "$tmp/b.jsonl" "$tmp/b_hard.jsonl"
for o in "$tmp/b.jsonl" "$tmp/./b.jsonl" "$tmp/b_link.jsonl" "$tmp/b_hard.jsonl"; do
  expect 2 "-o/--output $o and -i/--input $tmp/b.jsonl name the same file" -- \
    mpi 2 -m "$tmp/g3" -i "$tmp/b.jsonl" -o "$o" -n 2
done
[ "$(cat "$tmp/b.jsonl")" = '{"prompt_ids": [1, 2]}' ] && echo "ok: -i = -o: the input is intact" ||
  fail "-i = -o changed the input: $(cat "$tmp/b.jsonl")"
ln -s "$tmp/g3/config.json" "$tmp/to_config.json"
ln -s "$tmp/g3/new.jsonl" "$tmp/to_new.jsonl"
ln "$tmp/g3/generation_config.json" "$tmp/hard_gen.json"
inside="inside the model directory $tmp/g3"
expect 2 "-o/--output $tmp/g3/config.json: $inside; write it elsewhere" -- \
  mpi 2 -m "$tmp/g3" -i "$tmp/b.jsonl" -o "$tmp/g3/config.json" -n 2
expect 2 "-o/--output $tmp/to_config.json: $inside (it resolves to .*/g3/config.json)" -- \
  mpi 2 -m "$tmp/g3" -i "$tmp/b.jsonl" -o "$tmp/to_config.json" -n 2
expect 2 "-o/--output $tmp/to_new.jsonl: $inside (it resolves to .*/g3/new.jsonl)" -- \
  mpi 2 -m "$tmp/g3" -i "$tmp/b.jsonl" -o "$tmp/to_new.jsonl" -n 2
expect 2 "-o/--output $tmp/hard_gen.json: the same file as generation_config.json in the model directory" -- \
  mpi 2 -m "$tmp/g3" -i "$tmp/b.jsonl" -o "$tmp/hard_gen.json" -n 2
if diff -r "$fx/g3_tiny" "$tmp/g3" >/dev/null; then
  echo "ok: -o into the model directory (as typed, symlinked, hard-linked): the checkpoint is unchanged"
else
  fail "-o into the model directory changed it: $(diff -rq "$fx/g3_tiny" "$tmp/g3")"
fi
# A generation_config.json eos id outside the vocabulary is refused like config.json's, by every
# rank alike (exit 3, rank 0's message, no MPI_Abort).
cp -r "$fx/g3_tiny" "$tmp/g3_eos"
printf '{"eos_token_id": [8, 99999999]}\n' >"$tmp/g3_eos/generation_config.json"
expect 3 "generation_config.json: eos_token_id must be in \[0, vocab_size = [0-9]*), got 99999999" -- \
  mpi 2 -m "$tmp/g3_eos" --prompt-ids 1,2 -n 2
no_abort "generation_config eos outside the vocabulary" "format error"
# An -o that cannot be written fails before the model load; an existing one is kept until then.
expect 3 "-o/--output $tmp/no-dir/o.jsonl: cannot open for writing (no such directory" -- \
  mpi 2 -m "$tmp/g3" -i "$tmp/b.jsonl" -o "$tmp/no-dir/o.jsonl" -n 2
# A record with raw invalid UTF-8 is an error record (the parser's message quotes the bytes,
# written as U+FFFD), not an internal error: the batch goes on and exits 0.
printf '{"id":"ok","prompt_ids":[1,2]}\n{"id":"x","prompt":"a\xff\xfe"}\n' >"$tmp/utf8.jsonl"
if mpi 2 -m "$tmp/g3" -i "$tmp/utf8.jsonl" -o "$tmp/utf8.out" -n 2 --ignore-eos 2>"$tmp/err"; then
  check_jsonl "$tmp/utf8.out" "len(r) == 2 and r[0]['id'] == 'ok'
    and r[0]['finish_reason'] == 'length' and r[1]['finish_reason'] == 'error'
    and 'not valid JSON' in r[1]['error'] and '\ufffd' in r[1]['error']" \
    "a record with invalid UTF-8 becomes a valid JSON error record"
else
  fail "a record with invalid UTF-8 ended the batch: $(tail -n 3 "$tmp/err" | cat -v)"
fi
# One generated token has no inter-token gap: the summary says n/a and the JSON has null
# TPOT statistics and decode rate, not zeros.
mpi 1 -m "$fx/g3_tiny" --prompt-ids 1,2 --temp 0 -n 1 --json >"$tmp/one.json" 2>"$tmp/err" ||
  fail "-n 1 exited non-zero: $(tail -n 3 "$tmp/err")"
check_json "$tmp/one.json" "j['n_gen_tokens'] == 1 and j['per_token_ms'] == [] \
  and j['tpot_ms']['count'] == 0 and j['tpot_ms']['mean'] is None \
  and j['decode_tokens_per_s'] is None and j['ttft_ms'] > 0" \
  "-n 1: null TPOT statistics and decode rate in the JSON"
mpi 1 -m "$fx/g3_tiny" --prompt-ids 1,2 --temp 0 -n 1 >/dev/null 2>"$tmp/err" ||
  fail "-n 1 (summary) exited non-zero: $(tail -n 3 "$tmp/err")"
if grep -q "TPOT ms          = n/a" "$tmp/err" && ! grep -q "mean 0.000" "$tmp/err"; then
  pass "-n 1: the summary says TPOT n/a"
else
  fail "-n 1 summary: $(grep -E "eval time|TPOT" "$tmp/err")"
fi
# A batch whose every record failed exits 3 on every rank (the records are still written).
printf 'not json\n{"prompt_ids": []}\n' >"$tmp/allbad.jsonl"
expect 3 "-i/--input $tmp/allbad.jsonl: every record failed (2 of 2" -- \
  mpi 2 -m "$tmp/g3" -i "$tmp/allbad.jsonl" -o "$tmp/allbad.out" -n 2
# ... and its summary prints no latency numbers (there are none), not zeros.
if grep -q "TTFT ms: n/a (no record succeeded)" "$tmp/err" &&
  grep -q "TPOT ms: n/a (no record generated a second token)" "$tmp/err" &&
  ! grep -q "p50 0.00" "$tmp/err"; then
  pass "the all-failed batch's summary says n/a"
else
  fail "all-failed batch summary: $(grep -E "TTFT|TPOT" "$tmp/err")"
fi
[ "$(grep -c '"finish_reason":"error"' "$tmp/allbad.out")" = 2 ] &&
  echo "ok: the failed records are still written" || fail "all-failed batch: $(cat "$tmp/allbad.out")"
# -o on /dev/full: the first record's write fails on rank 0; agreed on, every rank exits 3 with
# rank 0's one message (no MPI_Abort).
expect 3 "-o/--output /dev/full: cannot write (No space left on device)" -- \
  mpi 2 -m "$tmp/g3" -i "$tmp/b.jsonl" -o /dev/full -n 2
if [ "$(grep -c "cannot write" "$tmp/err")" = 1 ] && ! grep -qE "MPI_ABORT|ORTE_ERROR_LOG" "$tmp/err"; then
  echo "ok: -np 2 -o /dev/full: one message, no MPI_Abort"
else
  fail "-np 2 -o /dev/full: $(grep -v '^$' "$tmp/err" | head -n 8)"
fi
# stdout on /dev/full: exit 3, not 0. One process: under mpirun, rank 0 writes to mpirun's pipe
# and mpirun's own failed writes are not reported to it.
for args in "--prompt-ids 1,2" "--prompt-ids 1,2 --json" "-i $tmp/b.jsonl"; do
  expect_full 3 "cannot write to standard output" -- "$fngen" generate -m "$tmp/g3" $args -n 2
done

# ---- text, chat and --stop on a Qwen3-vocab model with a tokenizer ----
tok=$src/third_party/qwen3-tokenizer
if [ -f "$tok/tokenizer.json" ]; then
  "$fngen" synth --config "$src/configs/demo.json" --out "$tmp/demo" --seed 1 --tokenizer "$tok" \
    >/dev/null 2>&1 || fail "synth of the demo model"
  mpi 4 -m "$tmp/demo" -p "The capital of France is" --temp 0 -n 8 --json >"$tmp/t.json" \
    2>"$tmp/err" || fail "demo text prompt: $(tail -n 3 "$tmp/err")"
  check_json "$tmp/t.json" "len(j['token_ids']) == 8 and len(j['text']) > 0 and \
    j['n_prompt_tokens'] == 5" "demo: text prompt gives text"
  # --logprobs with a tokenizer: each entry's text and raw bytes; the ids and the text as without.
  mpi 2 -m "$tmp/demo" -p "The capital of France is" --temp 0 -n 8 --logprobs 2 --json \
    >"$tmp/tlp.json" 2>"$tmp/err" || fail "demo --logprobs: $(tail -n 3 "$tmp/err")"
  $py -c "import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); \
    es=[e for x in b['logprobs'] for e in [x] + x['top_logprobs']]; \
    sys.exit(0 if b['token_ids']==a['token_ids'] and b['text']==a['text'] and all( \
    isinstance(e['token'], str) and all(0 <= v < 256 for v in e['bytes']) for e in es) and \
    bytes(v for x in b['logprobs'] for v in x['bytes']).decode('utf-8', 'replace')==b['text'] else 1)" \
    "$tmp/t.json" "$tmp/tlp.json" && pass "demo --logprobs: token text and bytes (the bytes spell the text)" ||
    fail "demo --logprobs: $(head -c 600 "$tmp/tlp.json")"
  stop=$($py -c "import json,sys; t=json.load(open(sys.argv[1]))['text']; print(t[2:5])" "$tmp/t.json")
  mpi 4 -m "$tmp/demo" -p "The capital of France is" --temp 0 -n 8 --stop "$stop" --stop "zzzz" \
    --json >"$tmp/s.json" 2>/dev/null
  $py -c "import json,sys; t=json.load(open(sys.argv[1]))['text']; s=json.load(open(sys.argv[2])); \
    sys.exit(0 if s['finish_reason']=='stop' and s['text']==t[:t.find(sys.argv[3])] else 1)" \
    "$tmp/t.json" "$tmp/s.json" "$stop" && echo "ok: --stop cuts the text before the stop string" ||
    fail "--stop: $(cat "$tmp/s.json")"
  # A stop string that is not valid UTF-8 could never match the (lossily decoded) text: a usage
  # error before the load, not a run that ignores it.
  expect 2 "--stop: invalid UTF-8 at byte offset 0 (byte 0xC3)" -- \
    mpi 1 -m "$tmp/demo" --prompt-ids 1,2 -n 2 --stop $'\xc3('
  ! grep -q "model loaded" "$tmp/err" && pass "--stop with invalid UTF-8: refused before the load" ||
    fail "--stop with invalid UTF-8: refused only after the model load"
  mpi 4 -m "$tmp/demo" -p "Hi" --chat --no-think --system-prompt "Be brief." --temp 0 -n 3 \
    --json >"$tmp/c.json" 2>/dev/null
  # system turn + user turn + generation prompt with the empty think block:
  # <|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n
  check_json "$tmp/c.json" "j['n_prompt_tokens'] > 15 and 'content' in j" "demo: --chat prompt"
  # -f/--file: the same prompt from a file (one final newline dropped, as llama.cpp does).
  printf 'The capital of France is\n' >"$tmp/prompt.txt"
  mpi 4 -m "$tmp/demo" -f "$tmp/prompt.txt" --temp 0 -n 8 --json >"$tmp/f.json" 2>/dev/null
  $py -c "import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); \
    sys.exit(0 if a['token_ids']==b['token_ids'] and b['n_prompt_tokens']==5 else 1)" \
    "$tmp/t.json" "$tmp/f.json" && echo "ok: -f gives the -p result" ||
    fail "-f: $(head -c 300 "$tmp/f.json")"
  expect 3 "nonexistent.txt" -- mpi 2 -m "$tmp/demo" -f "$tmp/nonexistent.txt"
  # An empty prompt is bad input (3), from -p as from a file: one message, from rank 0.
  : >"$tmp/empty.txt"
  expect 3 "format error: -f/--file $tmp/empty.txt: the prompt is empty" -- \
    mpi 2 -m "$tmp/demo" -f "$tmp/empty.txt"
  no_abort "-f empty.txt" "the prompt is empty"
  printf '\n' >"$tmp/newline.txt"
  expect 3 "-f/--file $tmp/newline.txt: the prompt is empty" -- mpi 2 -m "$tmp/demo" -f "$tmp/newline.txt"
  expect 3 "format error: -p/--prompt: the prompt is empty" -- mpi 2 -m "$tmp/demo" -p ""
  no_abort "-p ''" "the prompt is empty"
  # With --chat an empty file is an empty user turn, as -p "" is: the template's tokens run.
  mpi 2 -m "$tmp/demo" -f "$tmp/empty.txt" --chat --temp 0 -n 2 --json >"$tmp/ce.json" 2>/dev/null
  check_json "$tmp/ce.json" "j['n_prompt_tokens'] > 5" "demo: --chat with an empty -f/--file"
  # A prompt file many times the context is refused from its prefix (not encoded whole first).
  $py -c "import sys; open(sys.argv[1], 'w').write('hello world ' * 400000)" "$tmp/big.txt"
  # Bad input (3), as a prompt over the context is; the message names the file once.
  expect 3 "format error: -f/--file $tmp/big.txt: the prompt (4800000 bytes) exceeds the context size -c/--ctx-size 64: its first 2046 bytes alone encode to 342 tokens, more than 64" -- \
    mpi 2 -m "$tmp/demo" -f "$tmp/big.txt" -c 64
  # A text prompt over the context, encoded whole (-p, -f): bad input (3) too.
  expect 3 "format error: the prompt (5 tokens) exceeds the context size -c/--ctx-size 4" -- \
    mpi 2 -m "$tmp/demo" -p "The capital of France is" -c 4
  expect 3 "format error: the prompt (5 tokens) exceeds the context size -c/--ctx-size 4" -- \
    mpi 2 -m "$tmp/demo" -f "$tmp/prompt.txt" -c 4
  printf 'ab\xffc\n' >"$tmp/bad_utf8.txt"
  expect 3 "-f/--file $tmp/bad_utf8.txt: invalid UTF-8 in text to encode at byte offset 2 (byte 0xFF)" -- \
    mpi 2 -m "$tmp/demo" -f "$tmp/bad_utf8.txt"

  # ---- a rank killed with SIGKILL mid-generation ----
  "$mpiexec" -np 4 --oversubscribe --allow-run-as-root --bind-to none "$fngen" generate \
    -m "$tmp/demo" -p "x" -n 4000 --ignore-eos >"$tmp/k.out" 2>"$tmp/k.err" &
  mpipid=$!
  for _ in $(seq 1 600); do  # wait (up to 60 s) for the first streamed text
    [ -s "$tmp/k.out" ] && break
    sleep 0.1
  done
  victim=$(pgrep -P "$mpipid" -f "generate" | tail -n 1)
  if [ -z "$victim" ] || ! [ -s "$tmp/k.out" ]; then
    fail "kill test: no rank pid or no output (victim '$victim')"
    kill -9 "$mpipid" 2>/dev/null
  else
    start=$(date +%s%N)
    kill -9 "$victim"
    rc=124
    for _ in $(seq 1 300); do  # up to 30 s
      if ! kill -0 "$mpipid" 2>/dev/null; then
        wait "$mpipid"
        rc=$?
        break
      fi
      sleep 0.05
    done
    elapsed_ms=$((($(date +%s%N) - start) / 1000000))
    if [ "$rc" = 124 ]; then
      fail "kill test: mpirun still running 30 s after SIGKILL of rank pid $victim"
      kill -9 "$mpipid" 2>/dev/null
    elif [ "$rc" = 0 ] || [ "$elapsed_ms" -ge 10000 ]; then
      fail "kill test: mpirun exited $rc after $elapsed_ms ms"
    elif ! grep -qiE "signal 9|killed" "$tmp/k.err"; then
      fail "kill test: no message about the killed rank: $(tail -n 5 "$tmp/k.err")"
    else
      echo "ok: SIGKILL of rank pid $victim -> mpirun exit $rc after $elapsed_ms ms: $(grep -m1 -iE 'signal 9|killed' "$tmp/k.err")"
    fi
    # No rank may survive.
    sleep 0.5
    left=$(pgrep -f "$tmp/demo" || true)
    [ -z "$left" ] || { fail "processes left after the kill: $left"; kill -9 $left 2>/dev/null; }
  fi
else
  fail "no tokenizer at $tok (run scripts/setup.sh)"
fi

echo "generate_cli: $failures failure(s)"
[ "$failures" = 0 ]
