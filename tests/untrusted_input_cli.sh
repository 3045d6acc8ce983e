#!/usr/bin/env bash
# Hostile inputs on the CPU backend (CTest untrusted_input_cli, label mpi): every case ends every
# rank within seconds with one clear message and a non-zero exit, and never leaves an output file
# that another run wrote. Covered: checkpoint JSON files that are devices or FIFOs, standard input
# without end, empty output paths, concurrent writers of one logits file, impossible quantisation
# scales and non-finite weights, a tokenizer larger than the model's vocabulary, and a rank that
# stops answering the collectives.
# Usage: untrusted_input_cli.sh FNGEN MPIEXEC SOURCE_DIR
set -u
fngen=$1
mpiexec=$2
src=$3
source "$src/tests/cli_lib.sh"
fx=$src/tests/data/fixtures

quick() {  # quick SECONDS command...: the command must end within SECONDS (killed otherwise)
  local s=$1
  shift
  timeout -s KILL "$s" "$@"
}

mpiq() {  # mpiq SECONDS NP fngen-args...: fngen under mpirun, to end within SECONDS
  local s=$1 np=$2
  shift 2
  timeout -s KILL "$s" "$mpiexec" -np "$np" --oversubscribe --allow-run-as-root --bind-to none \
    "$fngen" "$@"
}

copy_model() {  # copy_model FIXTURE DEST: a private copy (symlinked shards) to damage
  mkdir -p "$2"
  for x in "$fx/$1"/*; do ln -s "$x" "$2/"; done
}

# ---- checkpoint JSON files that are devices or FIFOs: refused at once, on every rank ----
for name in config.json generation_config.json model.safetensors.index.json hf_quant_config.json; do
  for kind in /dev/zero /dev/urandom fifo; do
    d=$tmp/dev_$name.$(basename "$kind")
    copy_model g3_tiny "$d"
    rm "$d/$name"
    if [ "$kind" = fifo ]; then mkfifo "$d/$name"; else ln -s "$kind" "$d/$name"; fi
    expect 3 "$name: is not a regular file" -- quick 20 "$fngen" inspect "$d"
    expect 3 "$name: is not a regular file" -- \
      mpiq 30 2 generate -m "$d" --backend cpu --prompt-ids 1,2 -n 1
  done
done

# ---- impossible quantisation scales: refused at load and by inspect, naming the tensor ----
patch_tensor() {  # patch_tensor DIR TENSOR KIND: rewrites that tensor in a private copy of its file
  $py - "$@" <<'PY'
import json, os, struct, sys
d, name, kind = sys.argv[1:4]
f = os.path.join(d, json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"][name])
data = bytearray(open(f, "rb").read())
n = struct.unpack("<Q", data[:8])[0]
b, e = json.loads(data[8:8 + n])[name]["data_offsets"]
b, e = b + 8 + n, e + 8 + n
if kind == "neg_global":
    data[b:e] = struct.pack("<f", -0.5)
elif kind == "nan_global":
    data[b:e] = struct.pack("<f", float("nan"))
elif kind == "zero_global":
    data[b:e] = struct.pack("<f", 0.0)
elif kind == "signed_block":  # the last block scale of the tensor gets its sign bit
    data[e - 1] |= 0x80
elif kind == "zero_bf16":
    data[b:e] = bytes(e - b)
elif kind == "neg_bf16":
    data[b:e] = struct.pack("<H", 0xBF80) * ((e - b) // 2)  # -1.0
elif kind == "nan_bf16":
    data[b:e] = struct.pack("<H", 0x7FC0) * ((e - b) // 2)
else:
    sys.exit("unknown kind " + kind)
os.remove(f)  # the fixture's file stays as it is (the copy holds a symlink)
open(f, "wb").write(data)
PY
}
lp=model.language_model.layers
g2=$lp.0.mlp.experts.3.up_proj.weight_scale_2
bs=$lp.2.mlp.experts.5.down_proj.weight_scale
ple=$lp.1.ple.ple_embedding.ngram_embedding.weight_scale
n=0
for c in "$g2 neg_global the NVFP4 global scale (weight_scale_2) is negative" \
  "$g2 nan_global the NVFP4 global scale (weight_scale_2) is negative or not finite" \
  "$bs signed_block an NVFP4 block scale is negative or NaN" \
  "$ple zero_bf16 the FP8 n-gram table's weight_scale is not a finite number > 0" \
  "$ple neg_bf16 the FP8 n-gram table's weight_scale is not a finite number > 0"; do
  read -r name kind what <<<"$c"
  n=$((n + 1))
  d=$tmp/scale$n
  copy_model g3_tiny "$d"
  patch_tensor "$d" "$name" "$kind" || fail "patch $name $kind"
  expect 3 "tensor '$name': $what" -- quick 20 "$fngen" inspect "$d"
  expect 3 "tensor '$name': $what" -- \
    mpiq 60 2 generate -m "$d" --backend cpu --prompt-ids 1,2 -n 1
done
# A global scale of 0 over non-zero block scales is legal but a likely export bug: a warning.
d=$tmp/scale_zero
copy_model g3_tiny "$d"
patch_tensor "$d" "$g2" zero_global
expect 0 "tensor '$g2' is 0 while the block scales of '${g2%_2}' are not" -- quick 20 "$fngen" inspect "$d"
expect 0 "tensor '$g2' is 0 while the block scales" -- \
  mpiq 60 1 generate -m "$d" --backend cpu --prompt-ids 1,2 -n 1
# Non-finite unquantised weights: inspect's validation finds them (sampled on large tensors).
for name in lm_head.weight model.language_model.embed_tokens.weight; do
  d=$tmp/nan_${name%%.*}
  copy_model g3_tiny "$d"
  patch_tensor "$d" "$name" nan_bf16
  expect 3 "tensor '$name': non-finite value nan at element 0" -- quick 20 "$fngen" inspect "$d"
done

# ---- a tokenizer with more ids than the model has rows: a checkpoint error at load ----
d=$tmp/tok_big
copy_model tp4 "$d"
ln -s "$src/third_party/qwen3-tokenizer/tokenizer.json" "$d/tokenizer.json"
big="tokenizer.json: the tokenizer has ids up to 151668, past the model's vocab_size 384: tokenizer and model do not belong together"
expect 3 "$big" -- quick 30 "$fngen" inspect "$d"
expect 3 "$big" -- mpiq 60 2 generate -m "$d" --backend cpu --prompt-ids 1,2 -n 1
printf '{"prompt": "hello"}\n{"prompt": "more"}\n' >"$tmp/two.jsonl"
expect 3 "$big" -- mpiq 60 2 generate -m "$d" --backend cpu -i "$tmp/two.jsonl" -n 1
no_abort "generate -i with a tokenizer past the model" "format error"

# ---- standard input without end: tokenize stops at the 1 GiB input limit ----
tok=$src/third_party/qwen3-tokenizer/tokenizer.json
expect 3 "standard input: larger than 1 GiB" -- \
  quick 120 "$fngen" tokenize --tokenizer "$tok" </dev/zero

# ---- an empty output path: a usage error before anything is loaded ----
empty_path() {  # empty_path fngen-args...
  expect 2 "an empty path; give a file name" -- quick 30 "$fngen" "$@"
  grep -q "model loaded" "$tmp/err" && fail "$*: refused only after the model load"
}
empty_path eval dump-logits -m "$fx/tp4" --backend cpu --prompt-ids 1,2 -o ""
empty_path eval ppl -m "$fx/tp4" --backend cpu --ids-file "$tmp/x.ids" --save-logits ""
empty_path eval score -m "$fx/tp4" --backend cpu -i "$tmp/two.jsonl" -o ""
empty_path generate -m "$fx/tp4" --backend cpu --prompt-ids 1,2 -o ""
empty_path tokenize --tokenizer "$tok" -p hi -o ""
empty_path bench -m "$fx/tp4" --backend cpu -o ""
empty_path bench -m "$fx/tp4" --backend cpu --per-token ""
empty_path synth --config "$src/configs/tiny.json" -o ""

# ---- two dump-logits runs writing one file: the file is one run's complete output ----
ids_a=$($py -c "print(','.join(str(i % 300 + 1) for i in range(400)))")
ids_b=$($py -c "print(','.join(str(i % 200 + 7) for i in range(400)))")
for who in a b; do
  ids=ids_$who
  mpi_fngen 1 eval dump-logits -m "$fx/tp4" --backend cpu --prompt-ids "${!ids}" \
    -o "$tmp/alone_$who.fnl" >/dev/null 2>&1 || fail "dump-logits $who alone"
done
mpi_fngen 1 eval dump-logits -m "$fx/tp4" --backend cpu --prompt-ids "$ids_a" -o "$tmp/both.fnl" \
  >/dev/null 2>"$tmp/err_a" &
pid_a=$!
mpi_fngen 1 eval dump-logits -m "$fx/tp4" --backend cpu --prompt-ids "$ids_b" -o "$tmp/both.fnl" \
  >/dev/null 2>"$tmp/err_b"
rc_b=$?
wait $pid_a
rc_a=$?
[ "$rc_a" = 0 ] && [ "$rc_b" = 0 ] && { cmp -s "$tmp/both.fnl" "$tmp/alone_a.fnl" || cmp -s "$tmp/both.fnl" "$tmp/alone_b.fnl"; } &&
  [ "$(ls "$tmp"/both.fnl*)" = "$tmp/both.fnl" ] &&
  pass "two dump-logits runs to one file: both succeed, the file is one run's whole output" ||
  fail "concurrent dump-logits: exits $rc_a $rc_b, $(ls -l "$tmp"/both.fnl*; cat "$tmp/err_a" "$tmp/err_b")"

# ---- a rank that stops answering: every rank ends (exit 5) naming it, within the timeout ----
expect 2 "usage error: --stall-timeout: a number of seconds in \\[0, 1e6\\] (0: no bound), not -1" -- \
  "$fngen" --stall-timeout -1 inspect "$fx/tp4"
mark=fn_stall_$$_$RANDOM
exe=$(readlink -f "$fngen")
FN_TEST_MARK=$mark timeout -s KILL 120 "$mpiexec" -x FN_TEST_MARK -np 4 --oversubscribe \
  --allow-run-as-root --bind-to none "$fngen" --stall-timeout 3 bench -m "$fx/tp4" --backend cpu \
  -p 8 -n 512 -r 1000 >/dev/null 2>"$tmp/stall.err" &
job=$!
for _ in $(seq 1200); do
  grep -q "model loaded" "$tmp/stall.err" && break
  sleep 0.1
done
victim=
for p in /proc/[0-9]*; do
  [ "$(readlink "$p/exe" 2>/dev/null)" = "$exe" ] || continue
  env_of=$(tr '\0' '\n' <"$p/environ" 2>/dev/null)
  grep -qx "FN_TEST_MARK=$mark" <<<"$env_of" && grep -qx "OMPI_COMM_WORLD_RANK=3" <<<"$env_of" &&
    victim=${p#/proc/}
done
if [ -z "$victim" ]; then
  fail "stall: rank 3 of the job not found ($(head -c 400 "$tmp/stall.err"))"
  wait $job
else
  start=$(date +%s%N)
  kill -STOP "$victim"
  wait $job
  rc=$?
  elapsed_ms=$((($(date +%s%N) - start) / 1000000))
  kill -CONT "$victim" 2>/dev/null
  kill -KILL "$victim" 2>/dev/null
  # Rank 3 is named; a rank whose own part of the all-reduce waits on it may be named beside it
  # (seen: "ranks 2, 3 went silent"), which is also true from the waiting rank's side.
  if [ "$rc" = 5 ] && [ "$elapsed_ms" -lt 30000 ] &&
    grep -Eq "mpi error: ranks? ([012], )*3 went silent: rank [012] waited more than 3 s" "$tmp/stall.err"; then
    pass "a stopped rank 3 ends the job in $elapsed_ms ms with exit 5, named"
  else
    fail "stall: exit $rc after $elapsed_ms ms: $(grep -v '^$' "$tmp/stall.err" | tail -n 6)"
  fi
fi

echo "untrusted_input_cli: $failures failure(s)"
[ "$failures" = 0 ]
