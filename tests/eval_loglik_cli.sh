#!/usr/bin/env bash
# `fngen eval loglik` end to end and eval's --random-weights flags (CTest eval_loglik_cli, label
# cpu): the tp4 loglik items at -np 1 on the cpu backend give transformers' log-probs
# (tests/data/eval/loglik_tp4.expected.json, per token within 2e-3) and the predictions, acc and
# acc_norm per task recomputed from them; bad records become error records and the run goes on;
# a file whose every record fails exits 3; the --random-weights/--config/--tokenizer mistakes
# exit 2 naming the flag.
# Usage: eval_loglik_cli.sh FNGEN MPIEXEC SOURCE_DIR
set -u
fngen=$1
mpiexec=$2
src=$3
source "$src/tests/cli_lib.sh"
fx=$src/tests/data/fixtures/tp4
items=$src/tests/data/eval/loglik_tp4.jsonl
want=$src/tests/data/eval/loglik_tp4.expected.json

# ---- the items against the reference ----
cp "$items" "$tmp/items.jsonl"
if mpi_fngen 1 eval loglik --backend cpu -m "$fx" -i "$tmp/items.jsonl" -o "$tmp/rec.jsonl" --json \
  >"$tmp/sum.json" 2>"$tmp/err"; then
  pass "loglik on the tp4 items"
else
  fail "loglik on the tp4 items: $(head -n 5 "$tmp/err")"
fi
check_jsonl "$tmp/rec.jsonl" "len(r) == 7 and all(
  abs(c['logprob'] - w['logprob']) <= 2e-3 * c['n_tokens'] and c['n_tokens'] == w['n_tokens']
  and c['greedy'] == w['greedy'] and c['n_bytes'] == c['n_tokens']
  for x, e in zip(r, json.load(open('$want'))['items']) for c, w in zip(x['choices'], e['choices']))
  and all(x['pred'] == e['pred'] and x['pred_norm'] == e['pred_norm']
  and x['correct'] == (x['pred'] == x['answer'])
  for x, e in zip(r, json.load(open('$want'))['items']))" "every choice's log-prob is transformers'"
check_json "$tmp/sum.json" "(lambda recs: all(
  abs(j['summary']['tasks'][t]['acc'] - sum(x['correct'] for x in recs if x['task'] == t) /
      sum(1 for x in recs if x['task'] == t)) < 1e-12 and
  abs(j['summary']['tasks'][t]['acc_norm'] - sum(x['correct_norm'] for x in recs if x['task'] == t) /
      sum(1 for x in recs if x['task'] == t)) < 1e-12 for t in ('fixture', 'fixture_b'))
  and j['summary']['total']['n'] == 7)([json.loads(l) for l in open('$tmp/rec.jsonl')])" \
  "acc and acc_norm per task are the records' fractions"

# ---- the items side by side in the slots: the records do not depend on --max-batch ----
# (cpu: bitwise; blank and bad lines between the items keep their places)
{
  cat "$items"
  echo
  echo 'not json'
  head -n 2 "$items"
} >"$tmp/mix.jsonl"
for mb in 1 3 64; do
  if ! mpi_fngen 2 eval loglik --backend cpu -m "$fx" -i "$tmp/mix.jsonl" -o "$tmp/mb$mb.jsonl" \
    --max-batch "$mb" >/dev/null 2>"$tmp/err"; then
    fail "loglik --max-batch $mb at -np 2: $(head -n 5 "$tmp/err")"
  fi
done
if cmp -s "$tmp/mb1.jsonl" "$tmp/mb3.jsonl" && cmp -s "$tmp/mb1.jsonl" "$tmp/mb64.jsonl"; then
  pass "--max-batch 1, 3 and 64 write the same records at TP=2"
else
  fail "--max-batch changes the records: $(diff "$tmp/mb1.jsonl" "$tmp/mb3.jsonl" | head -n 4)"
fi
check_jsonl "$tmp/mb3.jsonl" "len(r) == 10 and 'error' in r[7] and r[8]['id'] == r[0]['id']
  and r[8]['choices'] == r[0]['choices']" "the bad line keeps its place; a repeated item scores alike"

# Each record's "id" is echoed as written: an integer past 64 bits keeps its digits, a string its
# escapes (as generate -i does); an error record too. Unknown fields are warned about.
{
  echo '{"id": 123456789012345678901234, "context_ids": [7], "choices": [[1], [2]], "answer": 0, "taks": "x"}'
  echo '{"id": "\u0041b", "context_ids": [7], "choices": [[1]], "answer": 0, "taks": "y"}'
  echo '{"id": -0.50, "context_ids": [7], "choices": [[1]], "answer": 5}'
} >"$tmp/ids.jsonl"
if mpi_fngen 2 eval loglik --backend cpu -m "$fx" -i "$tmp/ids.jsonl" -o "$tmp/ids.out" \
  >/dev/null 2>"$tmp/err" &&
  [ "$(wc -l <"$tmp/ids.out")" = 3 ] && grep -qF '{"id":123456789012345678901234,' "$tmp/ids.out" &&
  grep -qF '{"id":"\u0041b",' "$tmp/ids.out" && grep -qF '{"id":-0.50,' "$tmp/ids.out"; then
  pass "ids are echoed as written"
else
  fail "ids are not echoed as written: $(head -c 600 "$tmp/ids.out") $(head -n 3 "$tmp/err")"
fi
# An unknown field (a typo of "task") is warned about once per name, on rank 0 only.
if [ "$(grep -c 'field "taks" is not one fngen eval loglik reads' "$tmp/err")" = 1 ]; then
  pass "an unknown field is warned about once"
else
  fail "the unknown-field warning: $(grep -i taks "$tmp/err" | head -n 3)"
fi

# An -o another process is writing (its lock held) is refused before it is touched.
expect_locked_output "$tmp/locked.jsonl" -- \
  mpi_fngen 1 eval loglik --backend cpu -m "$fx" -i "$items" -o "$tmp/locked.jsonl"

# ---- bad records are error records; the run goes on ----
{
  head -n 1 "$items"
  echo '{"id": "noans", "context_ids": [7], "choices": [[1]]}'
  echo '{"id": "badidx", "context_ids": [7], "choices": [[1], [2]], "answer": 2}'
  echo '{"id": "hugeidx", "context_ids": [7], "choices": [[1], [2]], "answer": 18446744073709551615}'
  echo '{"id": "badid", "context_ids": [7, 384], "choices": [[1]], "answer": 0}'
  echo '{"id": "empty", "context_ids": [], "choices": [[1]], "answer": 0}'
  echo '{"id": "emptych", "context_ids": [7], "choices": [[]], "answer": 0}'
  echo '{"id": "text", "context": "hello", "choices": ["a"], "answer": 0}'
  echo 'not json'
} >"$tmp/bad.jsonl"
expect 0 "line 2" -- mpi_fngen 1 eval loglik --backend cpu -m "$fx" -i "$tmp/bad.jsonl"
check_jsonl "$tmp/out" "len(r) == 9 and 'error' not in r[0] and all('error' in x for x in r[1:])
  and 'answer' in r[1]['error'] and 'not an index' in r[2]['error']
  and '18446744073709551615 is not an index' in r[3]['error'] and '384' in r[4]['error']
  and 'no tokens' in r[5]['error'] and 'no tokens' in r[6]['error'] and 'tokenizer' in r[7]['error']" \
  "each bad record is an error record naming its fault"
tail -n +2 "$tmp/bad.jsonl" >"$tmp/allbad.jsonl"
expect 3 "every record failed" -- mpi_fngen 1 eval loglik --backend cpu -m "$fx" -i "$tmp/allbad.jsonl"
# A choice that does not fit -c is an error record, not a failed run.
expect 3 "ctx-size 4" -- mpi_fngen 1 eval loglik --backend cpu -m "$fx" -c 4 -i "$items"

# ---- --random-weights and its flags ----
cfg=$src/configs/qwen3.8-flash-next.json
expect 2 "either -m/--model DIR or --random-weights" -- \
  mpi_fngen 1 eval ppl --ids-file "$items" -c 8
expect 2 "needs --config" -- mpi_fngen 1 eval ppl --random-weights --ids-file "$items" -c 8
expect 2 "not both" -- mpi_fngen 1 eval ppl --random-weights --config "$cfg" -m "$fx" --ids-file "$items"
expect 2 "applies to --random-weights only" -- \
  mpi_fngen 1 eval loglik -m "$fx" --tokenizer "$src/third_party/qwen3-tokenizer" -i "$items"
expect 2 "--tokenizer $src/configs: no directory holding tokenizer.json or tokenizer.model" -- \
  mpi_fngen 1 eval loglik --random-weights --config "$cfg" --tokenizer "$src/configs" -i "$items"
expect 2 "--weights-seed applies to --random-weights only" -- \
  mpi_fngen 1 eval loglik -m "$fx" --weights-seed 2 -i "$items"
expect 2 "give token ids instead, or --tokenizer DIR" -- \
  mpi_fngen 1 eval ppl --random-weights --config "$cfg" -f "$items" -c 8
expect 2 "needs the cuda backend" -- \
  mpi_fngen 1 eval loglik --backend cpu --random-weights --config "$cfg" -i "$items"

echo "$failures failure(s)"
[ "$failures" = 0 ]
