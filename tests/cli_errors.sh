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
expect 2 "unknown subcommand 'frobnicate'" -- "$fngen" frobnicate -m x
expect 2 "unknown subcommand 'eval frobnicate'" -- "$fngen" eval frobnicate -m x
expect 2 "bogus" -- "$fngen" inspect "$tmp" --bogus
expect 2 "tp" -- "$fngen" inspect "$tmp" --tp notanumber
expect 3 "$tmp/nonexistent" -- "$fngen" inspect "$tmp/nonexistent"
expect 2 "got 3" -- "$fngen" inspect "$src/configs/tiny.json" --tp 3
expect 2 "ctx-size" -- "$fngen" inspect "$src/configs/tiny.json" --ctx-size -5
expect 2 "max_position_embeddings (4096)" -- "$fngen" inspect "$src/configs/tiny.json" --ctx-size 99999999
# -m takes the model directory: a config file or a missing path is named as such.
expect 2 "is a file; give the model directory" -- "$fngen" generate -m "$src/configs/tiny.json" --prompt-ids 1
expect 2 "is a file; give the model directory" -- "$fngen" eval ppl -m "$src/configs/tiny.json" --ids-file x
expect 3 "no such directory" -- "$fngen" generate -m "$tmp/no-model" --prompt-ids 1
printf 'not json' >"$tmp/bad.json"
expect 3 "bad.json" -- "$fngen" synth --config "$tmp/bad.json" --out "$tmp/o1"
[ -e "$tmp/o1" ] && { echo "FAIL: partial output left in $tmp/o1"; failures=$((failures + 1)); }
expect 2 "layers" -- "$fngen" synth --config "$src/configs/tiny.json" --out "$tmp/o2" --layers 9
expect 2 "--seed: must be >= 0, got -1" -- "$fngen" synth --config "$src/configs/tiny.json" \
  --out "$tmp/o3" --seed -1
[ -e "$tmp/o2" ] && { echo "FAIL: partial output left in $tmp/o2"; failures=$((failures + 1)); }
# A truncated shard: inspect must name the file.
"$fngen" synth --config "$src/configs/tiny.json" --out "$tmp/ck" 2>/dev/null || failures=$((failures + 1))
truncate -s 100 "$tmp/ck/model-bf16-00002.safetensors"
expect 3 "model-bf16-00002.safetensors" -- "$fngen" inspect "$tmp/ck"
[ -s "$tmp/out" ] && { echo "FAIL: inspect printed results for a bad checkpoint"; failures=$((failures + 1)); }

echo "cli_errors: $failures failure(s)"
[ "$failures" = 0 ]
