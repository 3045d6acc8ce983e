#!/usr/bin/env bash
# CLI-level bad input: each case must exit with its documented code (2 usage, 3 input/format),
# print one clear message naming the culprit on stderr, and leave no partial output.
# Usage: cli_errors.sh FNGEN SOURCE_DIR
set -u
fngen=$1
src=$2
source "$src/tests/cli_lib.sh"

expect 2 "subcommand" -- "$fngen"
expect 2 "bogus" -- "$fngen" --bogus
# An argument quoted in a usage error is escaped: no raw control byte (here ESC) on stderr.
expect 2 'The following argument was not expected: --\\x1Bbogus' -- "$fngen" inspect "$tmp" $'--\x1bbogus'
expect 2 "unknown subcommand 'frobnicate'" -- "$fngen" frobnicate -m x
expect 2 "unknown subcommand 'eval frobnicate'" -- "$fngen" eval frobnicate -m x
expect 2 "bogus" -- "$fngen" inspect "$tmp" --bogus
expect 2 "tp" -- "$fngen" inspect "$tmp" --tp notanumber
expect 3 "$tmp/nonexistent" -- "$fngen" inspect "$tmp/nonexistent"
expect 2 "got 3" -- "$fngen" inspect "$src/configs/tiny.json" --tp 3
expect 2 "ctx-size" -- "$fngen" inspect "$src/configs/tiny.json" --ctx-size -5
expect 2 "max_position_embeddings (4096)" -- "$fngen" inspect "$src/configs/tiny.json" --ctx-size 99999999
# The checkpoint is one option under two names (the positional dir, -m/--model): --help marks
# neither REQUIRED (either one suffices), and it is still needed exactly once.
"$fngen" inspect --help >"$tmp/help" 2>&1
grep -E "^ +(dir|-m,--model) " "$tmp/help" | grep -q REQUIRED &&
  fail "inspect --help marks dir or -m/--model REQUIRED: $(grep -E "^ +(dir|-m,--model) " "$tmp/help")" ||
  pass "inspect --help: neither dir nor -m/--model is marked REQUIRED"
expect 2 "usage error: --model is required" -- "$fngen" inspect --tp 2
# --tp's help says what the TP size means for each command (bench and eval showed generate's -i
# data-parallel groups).
tp_rule="tensor-parallel size; must equal the number of MPI ranks (default: that number)"
for case in "bench:; every lane runs over all of them, and its bytes per token and floor are the largest rank's share at that size" \
  "generate:; -i: a divisor of it, the ranks forming (ranks / --tp) data-parallel groups" \
  "eval score:" "eval ppl:"; do
  cmd=${case%%:*}
  want="$tp_rule${case#*:}"
  got=$("$fngen" $cmd --help 2>&1 | sed -nE 's/^ +--tp INT +//p')
  [ "$got" = "$want" ] && pass "$cmd --help: --tp in its own words" ||
    fail "$cmd --help: --tp reads '$got' (want '$want')"
done
expect 2 "usage error: --model: given 2 times; give it once" -- \
  "$fngen" inspect "$src/configs/tiny.json" -m "$src/configs/tiny.json"
# -m takes the model directory: a config file or a missing path is named as such.
expect 2 "is a file; give the model directory" -- "$fngen" generate -m "$src/configs/tiny.json" --prompt-ids 1
expect 2 "is a file; give the model directory" -- "$fngen" eval ppl -m "$src/configs/tiny.json" --ids-file x
expect 3 "no such directory" -- "$fngen" generate -m "$tmp/no-model" --prompt-ids 1
# A model path that is a symlink loop is named as one, not as a missing directory.
ln -s "$tmp/loop_b" "$tmp/loop_a" && ln -s "$tmp/loop_a" "$tmp/loop_b"
expect 3 "-m/--model $tmp/loop_a: Too many levels of symbolic links" -- \
  "$fngen" generate -m "$tmp/loop_a" --prompt-ids 1
# Where no check of ours looks first, the file system's own error is still input (exit 3, "io
# error"), not an internal error (exit 1).
expect 3 "io error: filesystem error: .*Too many levels of symbolic links" -- \
  "$fngen" inspect "$tmp/loop_a"
expect 3 "io error: filesystem error: .*Too many levels of symbolic links" -- \
  "$fngen" synth --config "$src/configs/tiny.json" --out "$tmp/loop_a"
expect 3 "invalid UTF-8 in --system-prompt at byte offset 0" -- \
  "$fngen" generate -m "$tmp/no-model" -p hi --chat --system-prompt $'\xff'
printf 'not json' >"$tmp/bad.json"
expect 3 "bad.json" -- "$fngen" synth --config "$tmp/bad.json" --out "$tmp/o1"
[ -e "$tmp/o1" ] && { echo "FAIL: partial output left in $tmp/o1"; failures=$((failures + 1)); }
expect 2 "layers" -- "$fngen" synth --config "$src/configs/tiny.json" --out "$tmp/o2" --layers 9
# A config whose checkpoint would not fit on the disk is refused before anything is written.
sed 's/"hidden_size": 64,/"hidden_size": 1048576,/' "$src/configs/demo.json" >"$tmp/huge.json"
expect 3 "more than the .* GB free in" -- "$fngen" synth --config "$tmp/huge.json" --out "$tmp/o_huge"
[ -z "$(ls -d "$tmp"/o_huge* 2>/dev/null)" ] &&
  pass "synth of a checkpoint too big for the disk wrote nothing" ||
  fail "synth of a too-big checkpoint left $(ls -d "$tmp"/o_huge* 2>/dev/null)"
# A place where no directory can be made (/proc takes none, even for root) is named as such, not
# as a lack of free space (0 GB free in /proc).
expect 3 "--out '/proc/fn_synth_out': cannot create the staging directory" -- \
  "$fngen" synth --config "$src/configs/tiny.json" --out /proc/fn_synth_out
# A directory as --config: a usage error naming the file to give (it was a C++ stream exception).
expect 2 "synth: --config '$src/configs' is a directory; give the config file itself (e.g. '$src/configs/config.json')" -- \
  "$fngen" synth --config "$src/configs" --out "$tmp/o5"
expect 2 "--seed: '-1' is out of range (allowed 0 to 18446744073709551615)" -- \
  "$fngen" synth --config "$src/configs/tiny.json" --out "$tmp/o3" --seed -1
[ -e "$tmp/o3" ] && { echo "FAIL: partial output left in $tmp/o3"; failures=$((failures + 1)); }
[ -e "$tmp/o2" ] && { echo "FAIL: partial output left in $tmp/o2"; failures=$((failures + 1)); }
# Whole-number options of every subcommand (apps/whole_number.h): decimal digits only (CLI11
# alone reads "010" as octal and "0x3" as hex), a sign only where a negative value is allowed,
# and no clamping: each refusal names the option, quotes the text as typed, and an out-of-range
# one gives the allowed range. Checked while parsing, before the model directory is looked at.
nan="is not a decimal whole number (digits 0-9 only"
i64=9223372036854775807
i32=2147483647
gen() { "$fngen" generate -m "$tmp/no-model" --prompt-ids 1 "$@"; }
expect 2 "-n/--max-new-tokens: '0x3' $nan, with an optional leading '-' or '+'" -- gen -n 0x3
expect 2 "-n/--max-new-tokens: '1e3' $nan" -- gen -n 1e3
expect 2 "-n/--max-new-tokens: '' $nan" -- gen -n ""
expect 2 "-n/--max-new-tokens: '-2' is out of range (allowed -1, or 1 to $i32)" -- gen -n -2
expect 2 "-n/--max-new-tokens: '0' is out of range (allowed -1, or 1 to $i32)" -- gen -n 0
expect 2 "-c/--ctx-size: '9999999999999999999999' is out of range (allowed 0 to $i32)" -- \
  gen -c 9999999999999999999999
expect 2 "-c/--ctx-size: '-3' is out of range (allowed 0 to $i32)" -- gen -c -3
# A single-value option given twice: said plainly (CLI11's "At Most 1 required but received 2").
expect 2 "usage error: --max-new-tokens: given 2 times; give it once" -- gen -n 2 -n 3
expect 2 "--prefill-chunk: '99999999999999999999' is out of range (allowed 1 to $i64)" -- \
  gen --prefill-chunk 99999999999999999999
expect 2 "--prefill-chunk: 'x' $nan, no hex" -- gen --prefill-chunk x
expect 2 "--prefill-chunk: '0' is out of range (allowed 1 to $i64)" -- gen --prefill-chunk 0
expect 2 "--top-k: '1.5' $nan" -- gen --top-k 1.5
expect 2 "--top-k: '+3' $nan, no hex" -- gen --top-k +3
expect 2 "--repeat-last-n: '-2' is out of range (allowed -1, or 0 to $i64)" -- gen --repeat-last-n -2
expect 2 "--tp: '0x2' $nan" -- gen --tp 0x2
expect 2 "-s/--seed: '18446744073709551616' is out of range (allowed -1, or 0 to 18446744073709551615)" -- \
  gen -s 18446744073709551616
expect 2 "-s/--seed: '0x10' $nan" -- gen -s 0x10
expect 2 "-c/--ctx-size: '2' is out of range (allowed 4 to $i32; a perplexity window needs 4 tokens)" -- \
  "$fngen" eval ppl -m "$tmp/no-model" --ids-file x -c 2
expect 2 "--chunks: '-3' is out of range (allowed -1, or 1 to $i64)" -- \
  "$fngen" eval ppl -m "$tmp/no-model" --ids-file x --chunks -3
expect 2 "--save-top-k: '010x' $nan" -- "$fngen" eval ppl -m "$tmp/no-model" --ids-file x --save-top-k 010x
expect 2 "--top-k: '-1' is out of range (allowed 0 to $i64)" -- \
  "$fngen" eval dump-logits -m "$tmp/no-model" --prompt-ids 1 -o x --top-k -1
expect 2 "-n/--max-new-tokens: '08.0' $nan" -- "$fngen" eval score -m "$tmp/no-model" -i x -n 08.0
expect 2 "-c/--ctx-size: '99999999999' is out of range (allowed 0 to $i32)" -- \
  "$fngen" eval score -m "$tmp/no-model" -i x -c 99999999999
expect 2 "--tp: '16' is out of range (allowed 1 to 8)" -- "$fngen" inspect "$src/configs/tiny.json" --tp 16
expect 2 "-c/--ctx-size: '0x100' $nan" -- "$fngen" inspect "$src/configs/tiny.json" -c 0x100
expect 2 "--layers: '0b1' $nan" -- "$fngen" synth --config "$src/configs/tiny.json" --out "$tmp/o4" --layers 0b1
expect 2 "--ngram-vocab-base: '99999999999999999999' is out of range (allowed 0 to $i64)" -- \
  "$fngen" synth --config "$src/configs/tiny.json" --out "$tmp/o4" --ngram-vocab-base 99999999999999999999
[ -e "$tmp/o4" ] && { echo "FAIL: partial output left in $tmp/o4"; failures=$((failures + 1)); }
# Valid values keep working: leading zeros are decimal ("010" is ten; "08" was an error), '+'
# where a sign is allowed, -1 for "until the context is full".
fx=$src/tests/data/fixtures/tp4
ntok() {  # ntok generate-args...: the number of generated ids, or "error"
  "$fngen" generate -m "$fx" --prompt-ids 1,2 --backend cpu --ignore-eos --json "$@" 2>/dev/null |
    $py -c "import json,sys; print(len(json.load(sys.stdin)['token_ids']))" 2>/dev/null || echo error
}
for case in "-n 010:10" "-n 08:8" "-n +3:3" "-n -1 -c 6:4" "-n 3 -s 007 --temp 1:3"; do
  got=$(ntok ${case%%:*})
  [ "$got" = "${case##*:}" ] && pass "generate ${case%%:*}: $got tokens" ||
    fail "generate ${case%%:*}: $got tokens (want ${case##*:})"
done

# Real-number options (apps/real_number.h): a finite decimal number only. CLI11 alone read an
# empty value as 0 (`--temp ''` meant greedy) and took hex, inf and nan.
notnum="is not a decimal number (digits with an optional sign, '.' fraction and e exponent"
expect 2 "--temp: '' $notnum" -- gen --temp ""
expect 2 "--temp: ' 1' $notnum" -- gen --temp " 1"
expect 2 "--temp: '0.7x' $notnum" -- gen --temp 0.7x
expect 2 "--top-p: 'abc' $notnum" -- gen --top-p abc
expect 2 "--min-p: 'nan' $notnum" -- gen --min-p nan
expect 2 "--repeat-penalty: 'inf' $notnum" -- gen --repeat-penalty inf
expect 2 "--presence-penalty: '0x1p3' $notnum" -- gen --presence-penalty 0x1p3
expect 2 "--frequency-penalty: '1e999' is out of range (beyond a double)" -- gen --frequency-penalty 1e999
expect 2 "--bandwidth-gbs: '' $notnum" -- "$fngen" bench -m "$tmp/no-model" --bandwidth-gbs ""
expect 2 "--temp: '-' $notnum" -- "$fngen" eval score -m "$tmp/no-model" -i x --temp -
temp_of() {  # temp_of VALUE: the temperature a generate run used, or "error"
  "$fngen" generate -m "$fx" --prompt-ids 1,2 --backend cpu -n 2 --json --temp "$1" 2>/dev/null |
    $py -c "import json,sys; print(json.load(sys.stdin)['sampling']['temperature'])" 2>/dev/null ||
    echo error
}
for v in 0.5 .5 5e-1 +0.5 0.50 5.E-1; do
  got=$(temp_of "$v")
  [ "$got" = 0.5 ] && pass "--temp $v is 0.5" || fail "--temp $v gave $got (want 0.5)"
done
# Prompt lengths are counted in the singular too.
expect 2 "the prompt (1 token) plus -n/--max-new-tokens (2000) is 2001 tokens" -- \
  "$fngen" generate -m "$fx" --prompt-ids 1 -n 2000 --backend cpu

# Results that cannot be written (stdout on /dev/full) are an io error (exit 3), never exit 0.
full="cannot write to standard output"
expect_full 3 "$full" -- "$fngen" inspect "$src/configs/tiny.json"
expect_full 3 "$full" -- "$fngen" inspect "$src/configs/tiny.json" --json
expect_full 3 "$full (No space left on device)" -- \
  "$fngen" generate -m "$fx" --prompt-ids 1,2 --backend cpu -n 2
expect_full 3 "$full" -- "$fngen" generate -m "$fx" --prompt-ids 1,2 --backend cpu -n 2 --json
expect_full 3 "$full" -- "$fngen" bench -m "$fx" --backend cpu -p 4 -n 2 -r 1 --warmup 0
tok=$src/third_party/qwen3-tokenizer/tokenizer.json
# fngen tokenize starts no MPI, so under ASan LeakSanitizer's fast unwind will do (3x faster on a
# tokenizer load; tests/CMakeLists.txt says why the other commands need the slow one).
lsan=${LSAN_OPTIONS:-}
tk=(env "LSAN_OPTIONS=${lsan//:fast_unwind_on_malloc=0/}" "$fngen" tokenize)
if [ -f "$tok" ]; then
  # A file that cannot be opened says why (errno), before the tokenizer loads.
  expect 3 "-i/--input $tmp/nonexistent.jsonl: cannot open the file (No such file or directory)" \
    -- "${tk[@]}" --tokenizer "$tok" -i "$tmp/nonexistent.jsonl"
  expect_full 3 "$full" -- "${tk[@]}" --tokenizer "$tok" -p hello
  expect_full 3 "$full" -- "${tk[@]}" --tokenizer "$tok" -p hello --json
  printf '{"text": "hi"}\n' >"$tmp/t.jsonl"
  expect_full 3 "$full" -- "${tk[@]}" --tokenizer "$tok" -i "$tmp/t.jsonl"
  # tokenize -i X -o X (as typed, or through a symlink or a hard link) would empty X before
  # reading it; a batch whose every record failed exits 3.
  ln -s t.jsonl "$tmp/t_link.jsonl"
  ln "$tmp/t.jsonl" "$tmp/t_hard.jsonl"
  for o in "$tmp/t.jsonl" "$tmp/t_link.jsonl" "$tmp/t_hard.jsonl"; do
    expect 2 "-o/--output $o and -i/--input $tmp/t.jsonl name the same file" -- \
      "${tk[@]}" --tokenizer "$tok" -i "$tmp/t.jsonl" -o "$o"
  done
  [ "$(cat "$tmp/t.jsonl")" = '{"text": "hi"}' ] && pass "tokenize -i = -o: the input is intact" ||
    fail "tokenize -i = -o changed the input: $(cat "$tmp/t.jsonl")"
  # --ids: a negative id is named as such before the load; one past int64 is checked against the
  # real vocabulary after it (not against the syntax pass's bound).
  expect 2 "--ids: item 2 = -1 is negative (token ids are 0 or more)" -- \
    "${tk[@]}" --tokenizer "$tok" --ids "5 -1"
  expect 2 "--ids: item 1 = 99999999999999999999 is outside the vocabulary \\[0, 151669)" -- \
    "${tk[@]}" --tokenizer "$tok" --ids 99999999999999999999
  # Invalid UTF-8 in --system-prompt is named as such (it used to be blamed on -p).
  expect 3 "invalid UTF-8 in --system-prompt at byte offset 1" -- \
    "${tk[@]}" --tokenizer "$tok" --chat --system-prompt $'a\xff' -p hi
  # Invalid UTF-8 is named with its source.
  printf 'ab\xffc' >"$tmp/bad_utf8.txt"
  expect 3 "-f/--file $tmp/bad_utf8.txt: invalid UTF-8 in text to encode at byte offset 2" -- \
    "${tk[@]}" --tokenizer "$tok" -f "$tmp/bad_utf8.txt"
  expect 3 "-p/--prompt: invalid UTF-8 in text to encode at byte offset 1" -- \
    "${tk[@]}" --tokenizer "$tok" -p "$(printf 'a\xffb')"
  printf 'not json\n{"text": 5}\n' >"$tmp/allbad.jsonl"
  expect 3 "-i/--input $tmp/allbad.jsonl: every record failed (2 of 2" -- \
    "${tk[@]}" --tokenizer "$tok" -i "$tmp/allbad.jsonl" -o "$tmp/allbad.out"
  [ "$(grep -c '"error"' "$tmp/allbad.out")" = 2 ] && pass "the failed records are still written" ||
    fail "tokenize all-failed output: $(cat "$tmp/allbad.out")"
else
  fail "no tokenizer at $tok (run scripts/setup.sh)"
fi

# A truncated shard: inspect must name the file.
"$fngen" synth --config "$src/configs/tiny.json" --out "$tmp/ck" 2>/dev/null || failures=$((failures + 1))
truncate -s 100 "$tmp/ck/model-bf16-00002.safetensors"
expect 3 "model-bf16-00002.safetensors" -- "$fngen" inspect "$tmp/ck"
[ -s "$tmp/out" ] && { echo "FAIL: inspect printed results for a bad checkpoint"; failures=$((failures + 1)); }
# One tensor with a wrong shape (lm_head [384, 64] stored as [64, 384], the same bytes): named
# once, in the format error (it was also logged on a line of its own before it).
cp -r "$src/tests/data/fixtures/tp4" "$tmp/shape"
$py - "$tmp/shape/model-bf16-00002.safetensors" <<'PY'
import sys
p = sys.argv[1]
b = open(p, "rb").read()
assert b.count(b'"shape":[384,64]') == 1
open(p, "wb").write(b.replace(b'"shape":[384,64]', b'"shape":[64,384]'))
PY
expect 3 "1 tensor problem (0 missing, 0 unexpected, 0 wrong dtype, 1 wrong shape, 0 duplicated): tensor 'lm_head.weight' has shape \[64, 384\], expected \[384, 64\]" -- \
  "$fngen" inspect "$tmp/shape" --tp 4
[ "$(grep -c "has shape \[64, 384\]" "$tmp/err")" = 1 ] && pass "one wrong tensor is reported once" ||
  fail "the wrong shape was reported $(grep -c "has shape" "$tmp/err") times: $(cat "$tmp/err")"

# A config.json that is a directory: said so, not "not valid JSON".
mkdir -p "$tmp/cfgdir"
cp "$src/tests/data/fixtures/tp4/"*.safetensors "$tmp/cfgdir/" 2>/dev/null
mkdir -p "$tmp/cfgdir/config.json"
expect 3 "config.json: is a directory, not a JSON file" -- "$fngen" inspect "$tmp/cfgdir"

echo "cli_errors: $failures failure(s)"
[ "$failures" = 0 ]
