#!/usr/bin/env bash
# `fngen eval` end to end (CTest eval_cli, label mpi). Acceptance on the CPU backend:
# every reference fixture converted to a base file by scripts/reference/dump_reference_logits.py,
# `eval kld` at -np 1 and 2 (and 4 for tp4): KL(ref ‖ fngen) mean <= 1e-5, same top-1 100 %,
# PPL(Q) = exp(mean NLL) of the reference logits within 1e-4 (recomputed in tests/eval_check.py);
# `eval ppl` on the fixture tokens against the same recomputation; dump-logits read by the python
# reader; float16 and top-K base files written by python, every statistic recomputed; ppl
# --save-logits read back by kld; score on the tp4 greedy ids; and the bad-input cases: a base for
# another vocabulary size or tokenizer, a truncated base, an empty text file, unknown flags.
# Usage: eval_cli.sh FNGEN MPIEXEC SOURCE_DIR
set -u
fngen=$1
mpiexec=$2
src=$3
source "$src/tests/cli_lib.sh"
fx=$src/tests/data/fixtures
drl=$src/scripts/reference/dump_reference_logits.py
chk=$src/tests/eval_check.py
mpi() {  # mpi NP args...
  local np=$1
  shift
  mpi_fngen "$np" eval "$@"
}

check() {  # check CHECK-NAME ARGS... (tests/eval_check.py)
  $py "$chk" "$@" || fail "eval_check.py $*"
}

ids_of() {  # ids_of FIXTURE KEY [SLICE] -> comma-separated ids
  local slice=${3:-}
  $py -c "import json;e=json.load(open('$fx/$1/expected.json'));print(','.join(map(str,e['$2']$slice)))"
}

# ---- acceptance: KLD against the transformers reference on every fixture ----
for f in g3_tiny tp4 ple2_long; do
  $py "$drl" --from-fixture "$fx/$f" --out "$tmp/$f.fnl" 2>/dev/null || fail "convert $f"
  nps="1 2"
  [ "$f" = tp4 ] && nps="1 2 4"
  for np in $nps; do
    if mpi "$np" kld -m "$fx/$f" --base "$tmp/$f.fnl" --json >"$tmp/kld_${f}_$np.json" 2>"$tmp/err"; then
      check kld-fixture "$fx/$f" "$tmp/kld_${f}_$np.json" "kld $f at -np $np"
    else
      fail "kld $f at -np $np exited non-zero: $(tail -n 3 "$tmp/err")"
    fi
  done
  # The human output: llama.cpp's three blocks.
  mpi 1 kld -m "$fx/$f" --base "$tmp/$f.fnl" >"$tmp/kld_$f.txt" 2>/dev/null || fail "kld $f text"
  for line in "====== Perplexity statistics ======" "Mean PPL(Q)" "Cor(ln(PPL(Q)), ln(PPL(base)))" \
    "====== KL divergence statistics ======" "Mean    KLD:" "99.9%   KLD:" "Median  KLD:" \
    "Minimum KLD:" "====== Token probability statistics ======" "RMS Δp    :" \
    "Same top p: 100.000"; do
    grep -qF -- "$line" "$tmp/kld_$f.txt" || fail "kld $f text output lacks '$line'"
  done
done

# ---- ppl on the fixture tokens: one window from position 0, against the reference rows ----
for f in g3_tiny tp4 ple2_long; do
  ids_of $f prompt_ids >"$tmp/$f.ids"
  ids_of $f generated_ids "[:32]" >>"$tmp/$f.ids"
  ctx=$(tr ',\n' '  ' <"$tmp/$f.ids" | wc -w)
  np=1
  [ "$f" = tp4 ] && np=2
  if mpi $np ppl -m "$fx/$f" --ids-file "$tmp/$f.ids" -c "$ctx" --json >"$tmp/ppl_$f.json" 2>"$tmp/err"; then
    check ppl-fixture "$fx/$f" "$tmp/ppl_$f.json" "$ctx" "ppl $f -c $ctx at -np $np"
  else
    fail "ppl $f exited non-zero: $(tail -n 3 "$tmp/err")"
  fi
done
mpi 1 ppl -m "$fx/tp4" --ids-file "$tmp/tp4.ids" -c 18 >"$tmp/ppl.txt" 2>/dev/null
if grep -q '^\[1\][0-9.]*,\[2\][0-9.]*,\[3\][0-9.]*,\[4\][0-9.]*,$' "$tmp/ppl.txt" &&
  grep -q '^Final estimate: PPL = [0-9.]* +/- [0-9.]*$' "$tmp/ppl.txt"; then
  echo "ok: ppl -c 18 prints [1]..[4] running values and the final estimate"
else
  fail "ppl text output: $(cat "$tmp/ppl.txt")"
fi
# ppl --save-logits writes a base that kld reads back: KLD 0, same top-1 100 %. The file is
# staged under a name of its own (ppl.fnl.partial.<pid>.<random>) and renamed: another run's
# staging file is left alone, and none of this run's is left beside the file.
printf 'stale' >"$tmp/ppl.fnl.partial"
printf 'stale' >"$tmp/ppl.fnl.partial.1.0123456789abcdef"
mpi 1 ppl -m "$fx/tp4" --ids-file "$tmp/tp4.ids" -c 18 --save-logits "$tmp/ppl.fnl" >/dev/null 2>&1 ||
  fail "ppl --save-logits"
[ -f "$tmp/ppl.fnl" ] && [ "$(ls "$tmp"/ppl.fnl* | wc -l)" = 3 ] &&
  [ "$(cat "$tmp/ppl.fnl.partial" "$tmp/ppl.fnl.partial.1.0123456789abcdef")" = stalestale ] &&
  pass "ppl --save-logits left no staging file and another run's alone" ||
  fail "ppl --save-logits: $(ls "$tmp"/ppl.fnl*)"
rm -f "$tmp/ppl.fnl.partial" "$tmp/ppl.fnl.partial.1.0123456789abcdef"
mpi 2 kld -m "$fx/tp4" --base "$tmp/ppl.fnl" --json >"$tmp/self.json" 2>/dev/null || fail "kld of ppl windows"
$py -c "import json,sys; j=json.load(open(sys.argv[1])); \
  sys.exit(0 if j['kld']['max'] < 1e-9 and j['same_top1'] == 1 and j['count'] == 4 * 8 else 1)" \
  "$tmp/self.json" && echo "ok: kld over ppl --save-logits windows (TP 1 file, TP 2 run): KLD 0, 32 rows" ||
  fail "kld over ppl windows: $(cat "$tmp/self.json")"

# ---- dump-logits: the C++ writer read by the python reader, rows vs the reference ----
printf 'an older file' >"$tmp/dump.fnl"  # replaced whole by the rename
mpi 2 dump-logits -m "$fx/tp4" --prompt-ids "$(ids_of tp4 prompt_ids)" \
  --continuation-ids "$(ids_of tp4 generated_ids '[:32]')" -o "$tmp/dump.fnl" >/dev/null 2>&1 ||
  fail "dump-logits"
check dump-fixture "$fx/tp4" "$tmp/dump.fnl" "dump-logits tp4 at -np 2"
[ "$(ls "$tmp"/dump.fnl*)" = "$tmp/dump.fnl" ] && pass "dump-logits left no staging file" ||
  fail "dump-logits left $(ls "$tmp"/dump.fnl*)"

# ---- float16 and top-K bases written by python: every statistic recomputed independently ----
for mode in "--dtype float16" "--top-k 16" "--top-k 16 --dtype float16" "--dtype float16 --values logits"; do
  # shellcheck disable=SC2086
  $py "$drl" --from-fixture "$fx/tp4" --out "$tmp/mode.fnl" $mode 2>/dev/null || fail "convert $mode"
  # At the dump's TP size (2): the same logits bit for bit, so the recomputation is exact.
  mpi 2 kld -m "$fx/tp4" --base "$tmp/mode.fnl" --json >"$tmp/mode.json" 2>/dev/null || fail "kld $mode"
  check kld-mode "$tmp/mode.fnl" "$tmp/dump.fnl" "$tmp/mode.json" "kld tp4 base $mode"
done

# ---- score: greedy generation on the tp4 prompt (ids-only model: text = the ids) ----
g4=$($py -c "import json;print(' '.join(map(str,json.load(open('$fx/tp4/expected.json'))['generated_ids'][:4])))")
pids=$(ids_of tp4 prompt_ids)
cat >"$tmp/tasks.jsonl" <<EOF
{"id": "regex-right", "task": "ids", "prompt_ids": [$pids], "answer": "${g4%% *}", "regex": "^(\\\\d+)"}
{"id": "exact-right", "task": "ids", "prompt_ids": [$pids], "answer": "$g4"}
{"id": "wrong", "task": "ids", "prompt_ids": [$pids], "answer": "1 2 3 4"}

{"id": "no-answer", "task": "broken", "prompt_ids": [$pids]}
EOF
if mpi 2 score -m "$fx/tp4" -i "$tmp/tasks.jsonl" -o "$tmp/score.jsonl" -n 4 --json \
  >"$tmp/summary.json" 2>"$tmp/err"; then
  check score "$tmp/score.jsonl" "$tmp/summary.json"
  grep -q "^TOTAL  *4  *2  *1  *50.00%" "$tmp/err" && echo "ok: score prints the accuracy table" ||
    fail "score table: $(cat "$tmp/err")"
  grep -q "TP 2, greedy\$" "$tmp/err" && echo "ok: score's header names greedy decoding" ||
    fail "score header: $(grep -- '--- fngen eval score' "$tmp/err")"
else
  fail "score exited non-zero: $(tail -n 3 "$tmp/err")"
fi
# A record with a temperature of its own: the header says the run was not all greedy.
sed '1s/"task": "ids",/"task": "ids", "temperature": 0.8,/' "$tmp/tasks.jsonl" >"$tmp/tasks_t.jsonl"
mpi 2 score -m "$fx/tp4" -i "$tmp/tasks_t.jsonl" -o "$tmp/score_t.jsonl" -n 4 2>"$tmp/err" >/dev/null
grep -q "TP 2, greedy (1 records with a temperature of their own)" "$tmp/err" &&
  echo "ok: score's header counts the records with their own temperature" ||
  fail "score header with a record temperature: $(grep -- '--- fngen eval score' "$tmp/err")"

# ---- a model directory with a tokenizer (tp4 + the Qwen3 tokenizer.json cut to tp4's 384 ids) ----
mkdir -p "$tmp/tok_model"
for x in "$fx"/tp4/*; do ln -s "$x" "$tmp/tok_model/"; done
# The Qwen3 byte-level BPE restricted to ids < 384: the vocabulary below it, the merges whose
# parts and result it holds, no added tokens (theirs are 151643 and up).
$py - "$src/third_party/qwen3-tokenizer/tokenizer.json" "$tmp/tok_model/tokenizer.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1], encoding="utf-8"))
m = t["model"]
m["vocab"] = {k: v for k, v in m["vocab"].items() if v < 384}
m["merges"] = [p for p in m["merges"] if p[0] in m["vocab"] and p[1] in m["vocab"] and p[0] + p[1] in m["vocab"]]
t["added_tokens"] = []
json.dump(t, open(sys.argv[2], "w", encoding="utf-8"), ensure_ascii=False)
PY
# The whole Qwen3 tokenizer (151669 ids) with tp4's 384-row model: a checkpoint error at load.
mkdir -p "$tmp/tok_big"
for x in "$fx"/tp4/*; do ln -s "$x" "$tmp/tok_big/"; done
ln -s "$src/third_party/qwen3-tokenizer/tokenizer.json" "$tmp/tok_big/tokenizer.json"
printf 'x' >"$tmp/one.txt"
# Qwen3 ids 64 "a", 264 " a", 304 " in": all inside tp4's vocabulary of 384.
printf 'a a a in a a in in a a a in a a a a in a' >"$tmp/small.txt"
# Invalid UTF-8 in the text is named with the file.
printf 'ab\xffc' >"$tmp/bad_utf8.txt"
expect 3 "-f/--file $tmp/bad_utf8.txt: invalid UTF-8 in text to encode at byte offset 2" -- \
  mpi 1 ppl -m "$tmp/tok_model" -f "$tmp/bad_utf8.txt" -c 8
# The tokenizer identity fngen records equals the python writer's.
mpi 1 ppl -m "$tmp/tok_model" -f "$tmp/small.txt" -c 8 --save-logits "$tmp/tok.fnl" \
  >/dev/null 2>"$tmp/err" || fail "ppl on text: $(tail -n 3 "$tmp/err")"
check tokenizer-id "$tmp/tok_model" "$tmp/tok.fnl"

# ---- bad input: clear errors, exit codes per docs/design.md "Errors" ----
expect 3 "vocab_size 384 but the model" -- mpi 1 kld -m "$fx/g3_tiny" --base "$tmp/tp4.fnl"
check write-foreign "$fx/tp4" "$tmp/foreign.fnl"
expect 3 "made with tokenizer fnv1a64:tokenizer.json:0123456789abcdef" -- \
  mpi 1 kld -m "$tmp/tok_model" --base "$tmp/foreign.fnl"
head -c -1 "$tmp/tp4.fnl" >"$tmp/trunc.fnl"
expect 3 "truncated" -- mpi 2 kld -m "$fx/tp4" --base "$tmp/trunc.fnl"
head -c 100 "$tmp/tp4.fnl" >"$tmp/trunc2.fnl"
expect 3 "truncated" -- mpi 1 kld -m "$fx/tp4" --base "$tmp/trunc2.fnl"
expect 3 "not a fngen logits file\|not valid JSON\|truncated" -- mpi 1 kld -m "$fx/tp4" --base "$src/README.md"
expect 3 "$tmp: is a directory, not a logits file" -- mpi 2 kld -m "$fx/tp4" --base "$tmp"
expect 3 "cannot open" -- mpi 1 kld -m "$fx/tp4" --base "$tmp/missing.fnl"
# A NaN in the base's last row (found by rank 0 mid-run): at -np 2 every rank exits 3 with rank
# 0's one message (agreed on per row), not through MPI_Abort.
cp "$tmp/tp4.fnl" "$tmp/nan.fnl"
printf '\x00\x00\xc0\x7f' | dd of="$tmp/nan.fnl" bs=1 seek=$(($(stat -c %s "$tmp/nan.fnl") - 4)) \
  conv=notrunc status=none
expect 3 "the value of token id 383 is not finite (nan)" -- mpi 2 kld -m "$fx/tp4" --base "$tmp/nan.fnl"
no_abort "kld with a NaN row at -np 2" "format error"
: >"$tmp/empty.txt"
expect 3 "the file is empty" -- mpi 1 ppl -m "$tmp/tok_model" -f "$tmp/empty.txt"
expect 3 "the file is empty" -- mpi 2 ppl -m "$tmp/tok_model" -f "$tmp/empty.txt"
expect 2 "fewer than one window of -c/--ctx-size 512" -- mpi 1 ppl -m "$tmp/tok_model" -f "$tmp/one.txt"
expect 3 "tokenizer.json: the tokenizer has ids up to 151668, past the model's vocab_size 384: tokenizer and model do not belong together" -- \
  mpi 1 ppl -m "$tmp/tok_big" -f "$src/README.md" -c 8
expect 3 "tokenizer and model do not belong together" -- \
  mpi 2 dump-logits -m "$tmp/tok_big" -p hello -o "$tmp/big_tok.fnl"
printf '{"prompt": "hello", "answer": "x"}\n' >"$tmp/one_task.jsonl"
expect 3 "tokenizer and model do not belong together" -- \
  mpi 2 score -m "$tmp/tok_big" -i "$tmp/one_task.jsonl"
expect 2 "has no tokenizer" -- mpi 1 ppl -m "$fx/tp4" -f "$src/README.md"
expect 2 "The following argument was not expected: --bogus" -- mpi 1 kld -m "$fx/tp4" --base x --bogus
expect 2 "base is required" -- mpi 1 kld -m "$fx/tp4"
expect 2 "the reference-logits file is binary" -- mpi 1 dump-logits -m "$fx/tp4" --prompt-ids 1,2 -o -
expect 3 "-p/--prompt: the prompt is empty" -- mpi 1 dump-logits -m "$tmp/tok_model" -p '' -o "$tmp/e.fnl"
: >"$tmp/empty_prompt.txt"
expect 3 "-f/--file $tmp/empty_prompt.txt: the prompt is empty" -- \
  mpi 1 dump-logits -m "$tmp/tok_model" -f "$tmp/empty_prompt.txt" -o "$tmp/e.fnl"
# A prompt file many times the model's position limit is refused from its prefix (not encoded
# whole first), as generate refuses one over its context.
$py -c "import sys; open(sys.argv[1], 'w').write('hello world ' * 400000)" "$tmp/big.txt"
expect 3 "-f/--file $tmp/big.txt: the prompt (4800000 bytes) exceeds the model's max_position_embeddings 1024: its first" -- \
  mpi 1 dump-logits -m "$tmp/tok_model" -f "$tmp/big.txt" -o "$tmp/big.fnl"
expect 2 "A subcommand" -- "$fngen" eval
expect 2 "exactly one of -f/--file" -- mpi 1 ppl -m "$fx/tp4"
expect 2 "--chunks: '-3' is out of range (allowed -1, or 1 to" -- mpi 1 ppl -m "$fx/tp4" --ids-file "$tmp/tp4.ids" -c 18 --chunks -3
expect 2 "--chunks: '0' is out of range (allowed -1, or 1 to" -- mpi 1 ppl -m "$fx/tp4" --ids-file "$tmp/tp4.ids" -c 18 --chunks 0
expect 3 "is a directory, not a file" -- mpi 1 ppl -m "$tmp/tok_model" -f "$tmp"
# A bad id inside an ids file is the file's fault (exit 3), as bad content of every other input.
printf '1 2 x 4\n' >"$tmp/bad.ids"
expect 3 "--ids-file $tmp/bad.ids: item 3 \"x\" is not an integer" -- \
  mpi 1 ppl -m "$fx/tp4" --ids-file "$tmp/bad.ids" -c 18
expect 3 "--ids-file $tmp/bad.ids: item 3 \"x\" is not an integer" -- \
  mpi 1 dump-logits -m "$fx/tp4" --ids-file "$tmp/bad.ids" -o "$tmp/bad.fnl"
# The output path was checked by creating its staging file before the ids were read: removed
# again.
[ -z "$(ls "$tmp"/bad.fnl* 2>/dev/null)" ] &&
  pass "a failed dump-logits leaves no -o file (nor a staging file) behind" ||
  fail "dump-logits left $(ls "$tmp"/bad.fnl*) behind"
# Outputs never land in the model directory (they could replace config.json or a shard).
expect 2 "inside the model directory" -- mpi 1 dump-logits -m "$fx/tp4" --prompt-ids 1,2 -o "$fx/tp4/config.json"
expect 2 "inside the model directory" -- mpi 1 ppl -m "$fx/tp4" --ids-file "$tmp/tp4.ids" -c 18 --save-logits "$fx/tp4/x.fnl"
: >"$tmp/no_tasks.jsonl"
expect 3 "no_tasks.jsonl: no records" -- mpi 2 score -m "$fx/tp4" -i "$tmp/no_tasks.jsonl"
# Output files that cannot be created or written, at -np 2: every rank exits 3 with rank 0's one
# message (agreed on), never through MPI_Abort.
expect 3 "-o/--output /dev/full: write failed" -- mpi 2 dump-logits -m "$fx/tp4" --prompt-ids 1,2,3 -o /dev/full
no_abort "dump-logits -o /dev/full"
expect 3 "-o/--output $tmp: is a directory, not a file" -- mpi 2 dump-logits -m "$fx/tp4" --prompt-ids 1,2,3 -o "$tmp"
no_abort "dump-logits -o DIR"
# Output paths and --save-top-k are checked before the model loads (a real model takes minutes).
before_load() {  # the last command failed before any rank loaded the model
  grep -q "model loaded" "$tmp/err" && fail "$1: refused only after the model load" || echo "ok: $1 before the load"
}
before_load "dump-logits -o DIR"
expect 3 "--save-logits $tmp/no-dir/x.fnl: cannot open for writing (no such directory" -- \
  mpi 2 ppl -m "$fx/tp4" --ids-file "$tmp/tp4.ids" -c 18 --save-logits "$tmp/no-dir/x.fnl"
before_load "ppl --save-logits in a missing directory"
# A directory that exists but refuses the file (/proc; a name over NAME_MAX anywhere): found by
# creating the file (and removing it) before the load, not when the results are written.
expect 3 "--save-logits /proc/x.fnl: cannot" -- \
  mpi 2 ppl -m "$fx/tp4" --ids-file "$tmp/tp4.ids" -c 18 --save-logits /proc/x.fnl
before_load "ppl --save-logits /proc/x.fnl"
no_abort "ppl --save-logits /proc/x.fnl"
long=$tmp/$(printf 'x%.0s' $(seq 300)).fnl
expect 3 "-o/--output $long: cannot create the staging file $long.partial.[0-9]*.[0-9a-f]* (File name too long)" -- \
  mpi 2 dump-logits -m "$fx/tp4" --prompt-ids 1,2,3 -o "$long"
before_load "dump-logits -o with a file name too long"
# A name that fits NAME_MAX (255) while its staging name (+ ".partial.<pid>.<random>") does not:
# refused before the load, not when the results are written.
long=$tmp/$(printf 'x%.0s' $(seq 247)).fnl
expect 3 "-o/--output $long: cannot create the staging file $long.partial.[0-9]*.[0-9a-f]* (File name too long)" -- \
  mpi 2 dump-logits -m "$fx/tp4" --prompt-ids 1,2,3 -o "$long"
before_load "dump-logits -o whose staging name is too long"
[ ! -e "$long" ] && pass "no file left for the name too long" || fail "left $long"
# A failed write (here /dev/full, written in place) ends the run within 64 rows, agreed on by
# every rank, not after the last row.
ids150=$($py -c "print(','.join(str(i % 300 + 1) for i in range(150)))")
expect 3 "-o/--output /dev/full: write failed at byte" -- \
  mpi 2 dump-logits -m "$fx/tp4" --prompt-ids "$ids150" -o /dev/full
grep -q "incomplete, 64 of 150 rows written" "$tmp/err" && pass "a failed write stops the run at row 64" ||
  fail "dump-logits -o /dev/full: $(grep -v '^$' "$tmp/err" | head -n 4)"
# The logits file is written at offsets: a pipe is refused before the load (a usage error, as
# -o - is), not after it with "Illegal seek".
mkfifo "$tmp/pipe.fnl"
expect 2 "-o/--output $tmp/pipe.fnl: is a pipe, socket or terminal, and the file is written at offsets" -- \
  mpi 2 dump-logits -m "$fx/tp4" --prompt-ids 1,2,3 -o "$tmp/pipe.fnl"
before_load "dump-logits -o FIFO"
# /dev/stdout on a pipe (the kernel's /proc link, not a path name): the same refusal.
"$fngen" eval dump-logits -m "$fx/tp4" --backend cpu --prompt-ids 1,2,3 -o /dev/stdout \
  2>"$tmp/err" | cat >/dev/null
grep -q "usage error: -o/--output /dev/stdout: is a pipe, socket or terminal" "$tmp/err" &&
  pass "dump-logits -o /dev/stdout on a pipe: refused" || fail "-o /dev/stdout | cat: $(head -n 3 "$tmp/err")"
# A symlink loop: refused before the load.
ln -s "$tmp/loop-b.fnl" "$tmp/loop-a.fnl" && ln -s "$tmp/loop-a.fnl" "$tmp/loop-b.fnl"
expect 3 "--save-logits $tmp/loop-a.fnl: cannot open for writing (a symlink loop" -- \
  mpi 2 ppl -m "$fx/tp4" --ids-file "$tmp/tp4.ids" -c 18 --save-logits "$tmp/loop-a.fnl"
before_load "ppl --save-logits on a symlink loop"
# Something else at "<file>.partial" (here a directory) is not in the way of a run, which stages
# under a name of its own, and is left alone.
mkdir -p "$tmp/busy.fnl.partial/x"
mpi 2 dump-logits -m "$fx/tp4" --prompt-ids 1,2,3 -o "$tmp/busy.fnl" >/dev/null 2>"$tmp/err" &&
  [ -f "$tmp/busy.fnl" ] && [ -d "$tmp/busy.fnl.partial/x" ] && [ "$(ls -d "$tmp"/busy.fnl* | wc -l)" = 2 ] &&
  pass "a directory at <file>.partial is left alone" || fail "busy.fnl: $(ls -la "$tmp"/busy.fnl*; cat "$tmp/err")"
expect 2 "--save-top-k 999999 exceeds vocab_size" -- \
  mpi 2 ppl -m "$fx/tp4" --ids-file "$tmp/tp4.ids" -c 18 --save-logits "$tmp/k.fnl" --save-top-k 999999
before_load "ppl --save-top-k past the vocabulary"
expect 3 "--save-logits /dev/full: write failed" -- \
  mpi 2 ppl -m "$fx/tp4" --ids-file "$tmp/tp4.ids" -c 18 --save-logits /dev/full
no_abort "ppl --save-logits /dev/full"
expect 3 "-o/--output /dev/full: cannot write" -- mpi 2 score -m "$fx/tp4" -i "$tmp/tasks.jsonl" -o /dev/full -n 4
no_abort "score -o /dev/full"
expect 3 "-o/--output $tmp/no-dir/s.jsonl: cannot open for writing" -- \
  mpi 2 score -m "$fx/tp4" -i "$tmp/tasks.jsonl" -o "$tmp/no-dir/s.jsonl" -n 4
no_abort "score -o in a missing directory"
# Answer patterns are PCRE2 under match limits: a catastrophically backtracking pattern on 600
# generated ids (nested repeats, then a character the text lacks) gives an error record (std::regex used to crash on long texts), a pattern that
# does not compile another; the good record still scores, and the run exits 0.
cat >"$tmp/rx.jsonl" <<EOF
{"id": "blowup", "task": "rx", "prompt_ids": [$pids], "answer": "x", "regex": "^((\\\\d+ ?)+)+[^\\\\d ]"}
{"id": "last", "task": "rx", "prompt_ids": [$pids], "answer": "x", "regex": "(\\\\d+) *$"}
{"id": "broken", "task": "rx", "prompt_ids": [$pids], "answer": "x", "regex": "(unclosed"}
EOF
if mpi 2 score -m "$fx/tp4" -i "$tmp/rx.jsonl" -o "$tmp/rx.out" -n 600 --ignore-eos 2>"$tmp/err"; then
  check_jsonl "$tmp/rx.out" "len(r) == 3 and 'PCRE2 gave up on the' in r[0]['error']
    and r[0]['correct'] is False and len(r[0]['content']) > 1200 and 'error' not in r[1]
    and r[1]['extracted'] == r[1]['content'].split()[-1]
    and 'is not a valid PCRE2 pattern (offset 9: missing closing parenthesis)' in r[2]['error']" \
    "score: a runaway pattern and a bad pattern become error records"
else
  fail "score with runaway patterns exited non-zero: $(tail -n 3 "$tmp/err")"
fi
# Every record failed: exit 3, as generate -i.
printf '{"id": 1}\nnot json\n' >"$tmp/allbad_tasks.jsonl"
expect 3 "allbad_tasks.jsonl: every record failed (2 of 2" -- \
  mpi 2 score -m "$fx/tp4" -i "$tmp/allbad_tasks.jsonl" -o "$tmp/allbad_tasks.out"
# A key given twice is the record's error, naming its line and the key (the parser alone kept the
# last value).
printf '{"prompt_ids": [1, 2], "answer": "x", "answer": "y"}\n' >"$tmp/dup_tasks.jsonl"
expect 3 "dup_tasks.jsonl: every record failed (1 of 1" -- \
  mpi 2 score -m "$fx/tp4" -i "$tmp/dup_tasks.jsonl" -o "$tmp/dup_tasks.out"
check_jsonl "$tmp/dup_tasks.out" "r[0]['error'].endswith( \
  '/dup_tasks.jsonl: line 1: duplicate key \"answer\" (each key may appear once in an object)')" \
  "score: a duplicate key is the record's error"
expect 2 "--backend cuda" -- mpi 1 ppl -m "$fx/tp4" --ids-file "$tmp/tp4.ids" -c 18 --backend cuda
expect 2 "item 2 \"x\" is not an integer" -- mpi 1 dump-logits -m "$fx/tp4" --prompt-ids "1,x" -o "$tmp/x.fnl"

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all eval_cli checks passed"
