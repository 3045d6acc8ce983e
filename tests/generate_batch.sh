#!/usr/bin/env bash
# `mpirun -np N fngen generate -i` end to end (CTest generate_batch, label mpi), on the tiny
# fixtures: per-record seeds (identical records differ, --seed and a record "seed" reproduce),
# every per-record field has its effect, unknown and mistyped fields, data-parallel groups
# (-np 4 at --tp 1, 2 and 4 give the greedy output of one group, in input order), --resume after
# a kill (no record lost or written twice), an id past 64 bits echoed as written, eval score's
# per-record seeds and fields, and continuous batching (--max-batch, --prefill-budget: the same
# records side by side as one at a time, also over groups).
# Usage: generate_batch.sh FNGEN MPIEXEC SOURCE_DIR
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
ids="1,2,3,4,5"
p='[1, 2, 3, 4, 5]'

# ---- per-record seeds ----
for i in 1 2 3 4; do echo "{\"prompt_ids\": $p}"; done >"$tmp/same.jsonl"
mpi 1 -m "$fx/tp4" -i "$tmp/same.jsonl" -o "$tmp/same1.jsonl" --seed 11 -n 12 --ignore-eos \
  2>"$tmp/err" || fail "sampled batch: $(tail -n 3 "$tmp/err")"
check_jsonl "$tmp/same1.jsonl" "len(r) == 4 and len({tuple(x['token_ids']) for x in r}) > 1 \
  and len({x['sampling']['seed'] for x in r}) == 4" \
  "identical sampled records sample differently (each its own seed)"
# The seeds are splitmix64(--seed ^ line number), as documented.
check_jsonl "$tmp/same1.jsonl" "[x['sampling']['seed'] for x in r] == [(lambda z: (lambda z: \
  (lambda z: z ^ (z >> 31))(((z ^ (z >> 27)) * 0x94d049bb133111eb) % 2**64))(((z ^ (z >> 30)) \
  * 0xbf58476d1ce4e5b9) % 2**64))((( 11 ^ n) + 0x9e3779b97f4a7c15) % 2**64) for n in (1, 2, 3, 4)]" \
  "record seeds are splitmix64(--seed ^ line)"
mpi 2 -m "$fx/tp4" -i "$tmp/same.jsonl" -o "$tmp/same2.jsonl" --seed 11 -n 12 --ignore-eos \
  --tp 1 2>/dev/null || fail "sampled batch, second run"
$py -c "import json,sys; a=[json.loads(l) for l in open(sys.argv[1])]; b=[json.loads(l) for l in open(sys.argv[2])]; \
  sys.exit(0 if [x['token_ids'] for x in a]==[x['token_ids'] for x in b] else 1)" \
  "$tmp/same1.jsonl" "$tmp/same2.jsonl" && pass "--seed 11 reproduces the whole file (also over 2 groups)" ||
  fail "--seed 11 did not reproduce the file"
# Without --seed: a random base seed is printed, and rerunning with it reproduces every record.
mpi 1 -m "$fx/tp4" -i "$tmp/same.jsonl" -o "$tmp/rand1.jsonl" -n 12 --ignore-eos 2>"$tmp/err" ||
  fail "random-seed batch"
seed=$(grep -o "rerun with --seed [0-9]*" "$tmp/err" | grep -o "[0-9]*$")
if [ -n "$seed" ]; then
  mpi 1 -m "$fx/tp4" -i "$tmp/same.jsonl" -o "$tmp/rand2.jsonl" -n 12 --ignore-eos --seed "$seed" \
    2>/dev/null
  $py -c "import json,sys; a=[json.loads(l)['token_ids'] for l in open(sys.argv[1])]; \
    b=[json.loads(l)['token_ids'] for l in open(sys.argv[2])]; sys.exit(0 if a==b else 1)" \
    "$tmp/rand1.jsonl" "$tmp/rand2.jsonl" && pass "the printed random seed $seed reproduces the file" ||
    fail "the printed seed $seed did not reproduce the file"
else
  fail "no random seed printed: $(head -n 3 "$tmp/err")"
fi
# A record "seed" reproduces the single run with that --seed, wherever the record stands.
mpi 1 -m "$fx/tp4" --prompt-ids "$ids" --seed 42 -n 12 --ignore-eos --json >"$tmp/s42.json" 2>/dev/null
printf '{"prompt_ids": %s, "seed": 42}\n{"prompt_ids": %s}\n{"prompt_ids": %s, "seed": 42}\n' \
  "$p" "$p" "$p" >"$tmp/seed.jsonl"
mpi 1 -m "$fx/tp4" -i "$tmp/seed.jsonl" -o "$tmp/seed.out" --seed 3 -n 12 --ignore-eos 2>/dev/null
$py -c "import json,sys; s=json.load(open(sys.argv[1])); r=[json.loads(l) for l in open(sys.argv[2])]; \
  sys.exit(0 if r[0]['token_ids']==s['token_ids']==r[2]['token_ids'] and r[0]['sampling']['seed']==42 \
  and r[1]['sampling']['seed']!=42 else 1)" "$tmp/s42.json" "$tmp/seed.out" &&
  pass "a record \"seed\": 42 equals the single run with --seed 42" || fail "record seed: $(cat "$tmp/seed.out" | cut -c1-300)"

# ---- every per-record field has its effect ----
single() {  # single NAME flags...: the single run's token ids as JSON
  mpi 1 -m "$fx/tp4" --prompt-ids "$ids" -n 12 --ignore-eos --json "$@" >"$tmp/single.json" 2>/dev/null
  $py -c "import json; print(json.load(open('$tmp/single.json'))['token_ids'])"
}
greedy=$(single --temp 0)
pen=$(single --temp 0 --repeat-penalty 5)
pres=$(single --temp 0 --presence-penalty 5)
freq=$(single --temp 0 --frequency-penalty 5)
cat >"$tmp/fields.jsonl" <<EOF
{"id": "t0", "prompt_ids": $p, "temperature": 0}
{"id": "k1", "prompt_ids": $p, "top_k": 1}
{"id": "p0", "prompt_ids": $p, "top_p": 1e-9}
{"id": "m1", "prompt_ids": $p, "min_p": 1}
{"id": "rp", "prompt_ids": $p, "temperature": 0, "repeat_penalty": 5}
{"id": "pp", "prompt_ids": $p, "temperature": 0, "presence_penalty": 5}
{"id": "fp", "prompt_ids": $p, "temperature": 0, "frequency_penalty": 5}
{"id": "mx", "prompt_ids": $p, "temperature": 0, "max_tokens": 3}
{"id": "n3", "prompt_ids": $p, "n": 3, "seed": 9}
{"id": "bad", "prompt_ids": $p, "temperature": "hot", "bogus": 1}
{"id": "oov", "prompt_ids": [1, 384]}
{"id": "st", "prompt_ids": $p, "stop": "x"}
{"id": "b2", "prompt_ids": $p, "temperature": 0, "bogus": 2, "other": 3}
{"id": "big", "prompt_ids": $p, "max_tokens": 5000}
EOF
if mpi 1 -m "$fx/tp4" -i "$tmp/fields.jsonl" -o "$tmp/fields.out" --seed 1 -n 12 --ignore-eos \
  2>"$tmp/err"; then
  $py - "$tmp/fields.out" "$greedy" "$pen" "$pres" "$freq" <<'EOF' && pass "every per-record field has its effect" || fail "per-record fields: $(cut -c1-200 "$tmp/fields.out")"
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
greedy, pen, pres, freq = (json.loads(a) for a in sys.argv[2:6])
by = {}
for x in r:
    by.setdefault(x["id"], []).append(x)
assert [x["id"] for x in r] == ["t0", "k1", "p0", "m1", "rp", "pp", "fp", "mx", "n3", "n3", "n3",
                                "bad", "oov", "st", "b2", "big"], [x["id"] for x in r]
for k in ("t0", "k1", "p0", "m1", "b2"):  # greedy by temperature 0, top_k 1, top_p ~0, min_p 1
    assert by[k][0]["token_ids"] == greedy, (k, by[k][0]["token_ids"], greedy)
# The penalties: the flag's result, and not the plain greedy one.
assert by["rp"][0]["token_ids"] == pen != greedy, (pen, greedy)
assert by["pp"][0]["token_ids"] == pres != greedy, (pres, greedy)
assert by["fp"][0]["token_ids"] == freq != greedy, (freq, greedy)
assert by["rp"][0]["sampling"]["repetition_penalty"] == 5
assert by["mx"][0]["token_ids"] == greedy[:3] and by["mx"][0]["n_gen_tokens"] == 3
n3 = by["n3"]
assert [x["sample_index"] for x in n3] == [0, 1, 2]
assert n3[0]["sampling"]["seed"] == 9 and len({x["sampling"]["seed"] for x in n3}) == 3
assert len({tuple(x["token_ids"]) for x in n3}) > 1
assert by["bad"][0]["finish_reason"] == "error"
assert '"temperature" must be a number >= 0 (0 = greedy), got "hot"' in by["bad"][0]["error"]
assert "line 10" in by["bad"][0]["error"]
assert by["oov"][0]["finish_reason"] == "error"
assert '"prompt_ids"[1] = 384 is outside the vocabulary [0, 384)' in by["oov"][0]["error"]
assert by["st"][0]["finish_reason"] == "error" and '"stop" needs a tokenizer' in by["st"][0]["error"]
assert all(x["sample_index"] == 0 for k in ("t0", "mx", "b2") for x in by[k])
assert by["big"][0]["finish_reason"] == "error"
assert '"max_tokens": 5000 does not fit: the prompt (5 tokens) plus' in by["big"][0]["error"]
EOF
  [ "$(grep -c 'field "bogus" is not one fngen generate reads' "$tmp/err")" = 1 ] &&
    grep -q 'field "other" is not one' "$tmp/err" && pass "an unknown field warns once per name" ||
    fail "unknown field warnings: $(grep -c bogus "$tmp/err") for bogus: $(grep field "$tmp/err")"
  grep -q "records 16, errors 4, generated tokens" "$tmp/err" && grep -q "tok/s, wall" "$tmp/err" &&
    pass "the summary counts records, errors, tokens, tok/s, wall time" ||
    fail "summary: $(grep records "$tmp/err")"
else
  fail "per-record field batch exited non-zero: $(tail -n 3 "$tmp/err")"
fi

# ---- data-parallel groups: the greedy output of one group, in input order ----
$py - "$tmp/dp.jsonl" <<'EOF'
import json, random, sys
rnd = random.Random(3)
with open(sys.argv[1], "w") as f:
    for i in range(14):
        if i == 5:
            f.write("not json\n")
            continue
        n = rnd.randrange(1, 7)
        rec = {"id": f"r{i}", "prompt_ids": [rnd.randrange(1, 380) for _ in range(n)],
               "max_tokens": rnd.randrange(2, 12)}
        f.write(json.dumps(rec) + "\n")
    f.write('{"id": 12345678901234567890123, "prompt_ids": [7, 8, 9]}\n')
EOF
mpi 1 -m "$fx/tp4" -i "$tmp/dp.jsonl" -o "$tmp/dp_1.jsonl" --temp 0 --ignore-eos 2>/dev/null ||
  fail "dp reference run"
for tp in 1 2 4; do
  if mpi 4 -m "$fx/tp4" -i "$tmp/dp.jsonl" -o "$tmp/dp_4_$tp.jsonl" --temp 0 --ignore-eos \
    --tp $tp 2>"$tmp/err"; then
    $py -c "import json,sys; a=[json.loads(l) for l in open(sys.argv[1])]; b=[json.loads(l) for l in open(sys.argv[2])]; \
      sys.exit(0 if len(a)==15 and [(x['id'], x.get('token_ids'), x['finish_reason']) for x in a] \
      == [(x['id'], x.get('token_ids'), x['finish_reason']) for x in b] else 1)" \
      "$tmp/dp_1.jsonl" "$tmp/dp_4_$tp.jsonl" &&
      pass "-np 4 --tp $tp ($((4 / tp)) group(s)): the one-group greedy records, in input order" ||
      fail "-np 4 --tp $tp differs from -np 1: $(cut -c1-120 "$tmp/dp_4_$tp.jsonl")"
  else
    fail "-np 4 --tp $tp exited non-zero: $(tail -n 3 "$tmp/err")"
  fi
done
grep -q "backend cpu, TP 4, 1 data-parallel group, ctx" "$tmp/err" ||
  fail "the summary does not name the groups: $(grep 'fngen generate (batch)' "$tmp/err")"
# The id past 64 bits is echoed as written (not 1.2345678901234568e+22).
grep -q '^{"id":12345678901234567890123,' "$tmp/dp_4_2.jsonl" &&
  pass "an id past 64 bits is echoed digit for digit" ||
  fail "huge id: $(tail -n 1 "$tmp/dp_4_2.jsonl" | cut -c1-80)"
expect 2 "--tp 3 must divide the number of MPI ranks (4)" -- \
  mpi 4 -m "$fx/tp4" -i "$tmp/dp.jsonl" --tp 3
expect 2 "--tp 2 must equal the number of MPI ranks" -- mpi 4 -m "$fx/tp4" --prompt-ids 1 --tp 2
expect 2 "--resume needs -o/--output" -- mpi 1 -m "$fx/tp4" -i "$tmp/dp.jsonl" --resume

# ---- --resume after a kill mid-file ----
$py -c "
import json
with open('$tmp/long.jsonl', 'w') as f:
    for i in range(40):
        f.write(json.dumps({'id': i, 'prompt_ids': [1 + i % 300, 2, 3], 'n': 2 if i % 7 == 0 else 1}) + '\n')"
mpi 1 -m "$fx/g3_tiny" -i "$tmp/long.jsonl" -o "$tmp/long_ref.jsonl" --seed 5 -n 200 --ignore-eos \
  2>/dev/null || fail "resume reference run"
"$mpiexec" -np 2 --oversubscribe --allow-run-as-root --bind-to none "$fngen" generate \
  -m "$fx/g3_tiny" -i "$tmp/long.jsonl" -o "$tmp/long.jsonl.out" --seed 5 -n 200 --ignore-eos \
  --tp 1 >/dev/null 2>&1 &
mpipid=$!
for _ in $(seq 1 600); do  # until some records are written (up to 60 s)
  [ -f "$tmp/long.jsonl.out" ] && [ "$(wc -l <"$tmp/long.jsonl.out")" -ge 4 ] && break
  sleep 0.1
done
kill -9 "$mpipid" 2>/dev/null
wait "$mpipid" 2>/dev/null
sleep 0.5
left=$(pgrep -f "$tmp/long.jsonl" || true)
[ -z "$left" ] || kill -9 $left 2>/dev/null
before=$(wc -l <"$tmp/long.jsonl.out")
# A write cut mid-line, as a kill during the write leaves it.
printf '{"id":39,"token_ids":[1,2' >>"$tmp/long.jsonl.out"
if [ "$before" -ge 45 ]; then
  fail "the kill came after the run ended ($before lines): cannot test --resume"
elif mpi 2 -m "$fx/g3_tiny" -i "$tmp/long.jsonl" -o "$tmp/long.jsonl.out" --seed 5 -n 200 \
  --ignore-eos --tp 1 --resume 2>"$tmp/err"; then
  $py - "$tmp/long_ref.jsonl" "$tmp/long.jsonl.out" <<'EOF' &&
import json, sys
ref = [json.loads(l) for l in open(sys.argv[1])]
got = [json.loads(l) for l in open(sys.argv[2])]
key = lambda x: (x["id"], x["sample_index"])
assert len(got) == len(ref) == 46, (len(got), len(ref))
assert len({key(x) for x in got}) == 46, "a record written twice"
r = {key(x): x["token_ids"] for x in ref}
assert all(r[key(x)] == x["token_ids"] for x in got), "a resumed record differs"
EOF
    pass "--resume after a kill at $before lines: every record once, equal to the uninterrupted run" ||
    fail "--resume: $(wc -l <"$tmp/long.jsonl.out") lines"
  grep -q "partial last line of [0-9]* bytes cut off" "$tmp/err" && grep -q "already in -o, skipped" "$tmp/err" &&
    pass "--resume reports the cut partial line and the skipped records" ||
    fail "--resume messages: $(grep -i resume "$tmp/err")"
else
  fail "--resume run exited non-zero: $(tail -n 3 "$tmp/err")"
fi
# Resuming a finished file runs nothing and writes nothing.
cp "$tmp/long.jsonl.out" "$tmp/done.jsonl"
mpi 1 -m "$fx/g3_tiny" -i "$tmp/long.jsonl" -o "$tmp/long.jsonl.out" --seed 5 -n 200 --ignore-eos \
  --resume 2>"$tmp/err" && cmp -s "$tmp/long.jsonl.out" "$tmp/done.jsonl" &&
  grep -q "records 0, errors 0" "$tmp/err" && pass "--resume of a finished file adds nothing" ||
  fail "--resume of a finished file: $(grep records "$tmp/err")"

# --resume refuses an -o written for another input, and an input whose ids repeat.
printf '{"id":"other","prompt_ids":[1,2]}\n' >"$tmp/other.jsonl"
expect 3 "holds a record (id \"other\", sample 0) that -i/--input" -- \
  mpi 1 -m "$fx/g3_tiny" -i "$tmp/long.jsonl" -o "$tmp/other.jsonl" --resume
printf '{"id":"dup","prompt_ids":[1,2]}\n{"id":"dup","prompt_ids":[3,4]}\n' >"$tmp/dup.jsonl"
printf '{"id":"dup","prompt_ids":[1,2],"token_ids":[5],"sample_index":0}\n' >"$tmp/dup.out"
expect 3 "lines 1 and 2 have the same id \"dup\"" -- \
  mpi 1 -m "$fx/g3_tiny" -i "$tmp/dup.jsonl" -o "$tmp/dup.out" --resume
expect 2 "stall-timeout" -- mpi_fngen 1 --stall-timeout 1e10 generate -m "$fx/tp4" --prompt-ids 1

# ---- eval score reads records the same way ----
cat >"$tmp/tasks.jsonl" <<EOF
{"id": 1, "prompt_ids": $p, "answer": "x"}
{"id": 2, "prompt_ids": $p, "answer": "x"}
{"id": 3, "prompt_ids": $p, "answer": "x", "seed": 42, "bogus": 1}
{"id": 4, "prompt_ids": $p, "answer": "x", "seed": 42, "bogus": 2}
{"id": 5, "prompt_ids": $p, "answer": "x", "temperature": 0, "max_tokens": 3}
{"id": 6, "prompt_ids": $p, "answer": "x", "top_p": 7}
EOF
score() {  # score OUT flags...
  local out=$1
  shift
  mpi_fngen 1 eval score -m "$fx/tp4" -i "$tmp/tasks.jsonl" -o "$out" -n 12 --ignore-eos --temp 1 "$@"
}
if score "$tmp/sc1.jsonl" --seed 8 2>"$tmp/err" && score "$tmp/sc2.jsonl" --seed 8 2>/dev/null; then
  $py - "$tmp/sc1.jsonl" "$tmp/sc2.jsonl" "$greedy" <<'PY' && pass "eval score: per-record seeds and fields" || fail "eval score records: $(cut -c1-200 "$tmp/sc1.jsonl")"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
greedy = json.loads(sys.argv[3])
assert [x.get("content") for x in a] == [x.get("content") for x in b]  # --seed reproduces
assert a[0]["content"] != a[1]["content"]  # identical tasks, their own seeds
assert a[2]["seed"] == a[3]["seed"] == 42 and a[2]["content"] == a[3]["content"]
assert a[4]["n_gen_tokens"] == 3 and a[4]["content"].split() == [str(t) for t in greedy[:3]]
assert "error" in a[5] and '"top_p" must be a number in (0, 1], got 7' in a[5]["error"]
PY
  [ "$(grep -c 'field "bogus" is not one fngen eval score reads' "$tmp/err")" = 1 ] &&
    pass "eval score: an unknown field warns once" || fail "eval score warnings: $(grep field "$tmp/err")"
else
  fail "eval score exited non-zero: $(tail -n 3 "$tmp/err")"
fi

# ---- unknown fields of a "messages" entry: warned once per name, as the record's own ----
# (tp4 has no tokenizer, so the messages records are errors; the warnings come first.)
cat >"$tmp/msg.jsonl" <<EOF
{"prompt_ids": $p, "answer": "x"}
{"messages": [{"role": "user", "content": "x", "foo": 1}], "answer": "x"}
{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x", "foo": 2, "name": "n"}], "answer": "x"}
EOF
for cmd in generate "eval score"; do
  mpi_fngen 1 $cmd -m "$fx/tp4" -i "$tmp/msg.jsonl" -o "$tmp/msg.out" -n 2 2>"$tmp/err" >/dev/null ||
    fail "$cmd with unknown messages fields exited non-zero: $(tail -n 3 "$tmp/err")"
  foo="msg.jsonl: line 2: field \"foo\" of \"messages\"\[0\] is not one fngen $cmd reads; ignored (said once per field name)"
  name="msg.jsonl: line 3: field \"name\" of \"messages\"\[1\] is not one fngen $cmd reads"
  [ "$(grep -c "field \"foo\"" "$tmp/err")" = 1 ] && grep -q "$foo" "$tmp/err" && grep -q "$name" "$tmp/err" &&
    pass "$cmd: an unknown field of a messages entry warns once per name" ||
    fail "$cmd: messages field warnings: $(grep field "$tmp/err")"
done

# ---- continuous batching: a record's output does not depend on its neighbours ----
# Mixed records (prompt lengths 1-24, greedy and sampled, penalties, lengths that end at
# different steps, log-probs, an error record between them) give the same records one at a time
# (--max-batch 1), side by side in chunks of 2 prompt tokens per step, and over 2 groups of
# TP 2 with 3 slots each.
$py - "$tmp/mix.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(14):
        r = {"id": f"m{i}", "prompt_ids": [(7 * i + 3 * k) % 200 + 1 for k in range(1 + (5 * i) % 24)],
             "max_tokens": 2 + (3 * i) % 11}
        if i % 3 == 1: r["temperature"] = 0
        if i % 4 == 2: r["repeat_penalty"] = 1.5
        if i % 5 == 3: r["logprobs"] = 2
        if i == 6: r["top_p"] = 7  # an error record
        f.write(json.dumps(r) + "\n")
PY
cmp_mix() {  # cmp_mix A B DESCRIPTION
  $py - "$1" "$2" <<'PY' && pass "$3" || fail "$3: $(head -c 300 "$2")"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
keys = ("id", "token_ids", "finish_reason", "logprobs", "error", "sampling")
assert len(a) == len(b) == 14, (len(a), len(b))
for x, y in zip(a, b):
    assert all(x.get(k) == y.get(k) for k in keys), (x["id"], [k for k in keys if x.get(k) != y.get(k)])
assert a[6]["finish_reason"] == "error" and len({len(x.get("token_ids", [])) for x in a}) > 3
PY
}
mpi 1 -m "$fx/tp4" -i "$tmp/mix.jsonl" -o "$tmp/mix1.jsonl" --seed 5 --ignore-eos --max-batch 1 \
  2>"$tmp/err" || fail "mixed records, --max-batch 1: $(tail -n 3 "$tmp/err")"
mpi 1 -m "$fx/tp4" -i "$tmp/mix.jsonl" -o "$tmp/mix5.jsonl" --seed 5 --ignore-eos --max-batch 5 \
  --prefill-budget 2 2>"$tmp/err" || fail "mixed records, --max-batch 5: $(tail -n 3 "$tmp/err")"
grep -q "up to 5 sequence(s) side by side per group (continuous batching, 2 prompt tokens per step)" \
  "$tmp/err" && pass "the run names its slots and prefill budget" || fail "no batching line: $(head -n 5 "$tmp/err")"
cmp_mix "$tmp/mix1.jsonl" "$tmp/mix5.jsonl" "--max-batch 5 --prefill-budget 2 equals one record at a time"
mpi 4 -m "$fx/tp4" -i "$tmp/mix.jsonl" -o "$tmp/mix_tp2.jsonl" --seed 5 --ignore-eos --tp 2 \
  --max-batch 3 2>"$tmp/err" || fail "mixed records, 2 groups: $(tail -n 3 "$tmp/err")"
mpi 2 -m "$fx/tp4" -i "$tmp/mix.jsonl" -o "$tmp/mix_tp2_1.jsonl" --seed 5 --ignore-eos --tp 2 \
  --max-batch 1 2>"$tmp/err" || fail "mixed records, TP 2 alone: $(tail -n 3 "$tmp/err")"
cmp_mix "$tmp/mix_tp2_1.jsonl" "$tmp/mix_tp2.jsonl" "2 groups of TP 2 with 3 slots equal TP 2 one at a time"
# eval score through the slots: the same tasks with 1 slot and with 4.
$py -c "import json,sys; [print(json.dumps(dict(json.loads(l), answer='x'))) for l in open(sys.argv[1])]" \
  "$tmp/mix.jsonl" >"$tmp/mix_tasks.jsonl"
for mb in 1 4; do
  mpi_fngen 1 eval score -m "$fx/tp4" -i "$tmp/mix_tasks.jsonl" -o "$tmp/score_mb$mb.jsonl" \
    --seed 5 --ignore-eos --temp 1 -n 6 --max-batch $mb 2>"$tmp/err" ||
    fail "eval score --max-batch $mb: $(tail -n 3 "$tmp/err")"
done
$py - "$tmp/score_mb1.jsonl" "$tmp/score_mb4.jsonl" <<'PY' && pass "eval score: --max-batch 4 equals --max-batch 1" ||
import json, sys
strip = lambda x: {k: v for k, v in x.items() if k != "e2e_ms"}
a = [strip(json.loads(l)) for l in open(sys.argv[1])]
b = [strip(json.loads(l)) for l in open(sys.argv[2])]
assert len(a) == 14 and a == b and "error" in a[6] and "error" not in a[0]
assert len({x.get("n_gen_tokens") for x in a}) > 2
PY
  fail "eval score batched: $(head -c 300 "$tmp/score_mb4.jsonl")"
# An -o another process is writing (its lock held) is refused before it is touched.
expect_locked_output "$tmp/locked.jsonl" -- \
  mpi 1 -m "$fx/tp4" -i "$tmp/mix.jsonl" -o "$tmp/locked.jsonl" --seed 5
# The batching flags are checked.
expect 2 "apply to -i/--input" -- mpi 1 -m "$fx/tp4" --prompt-ids 1,2 --max-batch 4
expect 2 "max-batch" -- mpi 1 -m "$fx/tp4" -i "$tmp/mix.jsonl" --max-batch -1
expect 2 "prefill-budget" -- mpi 1 -m "$fx/tp4" -i "$tmp/mix.jsonl" --prefill-budget 0

# ---- records JSON cannot hold, a byte-order mark, an empty prompt ----
# A number past a double (1e400) is valid JSON the parser cannot hold: an error record, and the
# records after it still run. A UTF-8 BOM before a record (the file's first, or a later one of
# concatenated files) is not part of its id.
printf '\xef\xbb\xbf{"id": "bom", "prompt_ids": [1, 2], "max_tokens": 2}\n{"id": "big", "prompt_ids": [1], "x": 1e400}\n{"id": "empty", "prompt_ids": [], "max_tokens": 2}\n\xef\xbb\xbf{"id": "after", "prompt_ids": [3], "max_tokens": 2}\n' \
  >"$tmp/odd.jsonl"
for tp in 2 1; do
  mpi 2 -m "$fx/tp4" -i "$tmp/odd.jsonl" -o "$tmp/odd_$tp.jsonl" --tp $tp --seed 1 --ignore-eos \
    2>"$tmp/err" || fail "odd records at --tp $tp exited non-zero: $(tail -n 3 "$tmp/err")"
  check_jsonl "$tmp/odd_$tp.jsonl" "[x['id'] for x in r] == ['bom', 2, 'empty', 'after'] \
    and len(r[0]['token_ids']) == 2 and len(r[3]['token_ids']) == 2 \
    and r[1]['finish_reason'] == 'error' and 'a JSON value fngen cannot read' in r[1]['error'] \
    and r[2]['finish_reason'] == 'error' and 'the prompt is empty' in r[2]['error'] \
    and 'max_tokens' not in r[2]['error']" \
    "--tp $tp: 1e400 and an empty prompt are error records, the BOM is not in the id, the rest run"
done

# ---- stop strings need text: the demo model with the Qwen3 tokenizer ----
tok=$src/third_party/qwen3-tokenizer
if [ -f "$tok/tokenizer.json" ]; then
  "$fngen" synth --config "$src/configs/demo.json" --out "$tmp/demo" --seed 1 --tokenizer "$tok" \
    >/dev/null 2>&1 || fail "synth of the demo model"
  printf '{"id": "full", "prompt": "The capital of France is"}\n' >"$tmp/t.jsonl"
  mpi 1 -m "$tmp/demo" -i "$tmp/t.jsonl" -o "$tmp/t.out" --temp 0 -n 8 --ignore-eos 2>/dev/null
  stop=$($py -c "import json,sys; print(json.loads(open(sys.argv[1]).readline())['text'][2:5])" "$tmp/t.out")
  $py -c "import json,sys; print(json.dumps({'id': 'cut', 'prompt': 'The capital of France is', 'stop': [sys.argv[1], 'zzzz']}))" \
    "$stop" >>"$tmp/t.jsonl"
  mpi 1 -m "$tmp/demo" -i "$tmp/t.jsonl" -o "$tmp/t.out" --temp 0 -n 8 --ignore-eos 2>/dev/null
  $py -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; t=r[0]['text']; \
    sys.exit(0 if r[1]['finish_reason']=='stop' and r[1]['text']==t[:t.find(sys.argv[2])] else 1)" \
    "$tmp/t.out" "$stop" && pass "a record \"stop\" cuts the text before the stop string" ||
    fail "record stop: $(cut -c1-300 "$tmp/t.out")"
else
  fail "no tokenizer at $tok (run scripts/setup.sh)"
fi

echo "generate_batch: $failures failure(s)"
[ "$failures" = 0 ]
