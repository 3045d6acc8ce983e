#!/usr/bin/env bash
# One GPU-machine call for eval's time goals (docs/performance.md "Eval at scale"), TP=1, the full
# geometry on random weights (`--random-weights --config configs/qwen3.8-flash-next.json`), inputs
# of random token ids made here:
#   ppl     300,000 ids, -c 2048 (146 windows)                         goal <= 60 s
#   kld     a top-32 base of 147 sequences x 2,048 rows (301,056 rows, every position recorded,
#           random distinct ids and log-probs written here), then kld   goal <= 90 s
#           (a llama.cpp-style base, `ppl --save-logits --save-top-k 32`, records only the second
#           half of each window: 300K rows then cost 600K tokens; kld_ppl_style times that too)
#   loglik  1,000 items x 4 choices of 8 ids after 200-id contexts      goal <= 60 s
# Each time is the command's own "seconds" (the load excluded). kld_ppl_style compares the model
# with itself (same weights and seed): KLD mean ~0 and same top-1 ~100 % is a sanity check.
# Usage on the GPU machine: bash scripts/gpu/eval_goals_run.sh
# Environment: FN_BUILD_DIR (build-gpu), FN_PYTHON (a python3 with numpy), FN_EVAL_GOALS (the runs to make, default
# "ppl kld base kld_ppl_style loglik"; each loads the model, about 30 s on an H200).
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/eval-goals-out}
mkdir -p "$out"
b=${FN_BUILD_DIR:-build-gpu}
cfg=configs/qwen3.8-flash-next.json
rw="--random-weights --config $cfg --backend cuda"
py=${FN_PYTHON:-/usr/bin/python3}  # needs numpy
[ -x "$b/fngen" ] || bash scripts/gpu/build.sh >"$out/build.log" 2>&1 || { tail -n 30 "$out/build.log"; exit 1; }
vocab=$($py -c "import json;c=json.load(open('$cfg'));print(c.get('text_config',c)['vocab_size'])")
$py - "$out" "$vocab" <<'PY'
import json, random, sys
out, vocab = sys.argv[1], int(sys.argv[2])
rng = random.Random(1)
for n, name in ((300000, "ids_300k.txt"), (600000, "ids_600k.txt")):
    with open(f"{out}/{name}", "w") as f:
        f.write(" ".join(str(rng.randrange(vocab)) for _ in range(n)))
# The top-32 base: 147 sequences of 2,048 random ids, every row recorded (core/eval.h format).
import struct
import numpy as np
nseq, L, K = 147, 2048, 32
seqs = [{"tokens": [rng.randrange(vocab) for _ in range(L)], "first": 0, "n_rows": L, "next_token": -1}
        for _ in range(nseq)]
n = nseq * L
g = np.random.default_rng(1)
# Distinct per row: a random start and a stride with K * stride < vocab.
ids = ((g.integers(0, vocab, size=(n, 1)) + np.arange(K) * (vocab // K - 1)) % vocab).astype("<i4")
lp = np.sort(np.log(g.dirichlet(np.ones(K + 1), size=n))[:, :K], axis=1)[:, ::-1].astype("<f4")
residual = np.maximum(0.0, 1.0 - np.exp(lp.astype(np.float64)).sum(axis=1)).astype("<f4")
target = np.full(n, np.nan, dtype="<f4")
for si, s in enumerate(seqs):
    target[si * L:si * L + L - 1] = np.log(1.0 / vocab)
arrays = [("topk_ids", "int32", [n, K], ids.tobytes()), ("topk_logprobs", "float32", [n, K], lp.tobytes()),
          ("residual_mass", "float32", [n], residual.tobytes()), ("target_logprob", "float32", [n], target.tobytes())]
header = {"magic": "fngen.reference_logits", "version": 1, "vocab_size": vocab, "tokenizer": "ids-only",
          "dtype": "float32", "mode": "topk", "top_k": K, "values": "logprobs", "n_positions": n,
          "sequences": seqs, "source": {"producer": "scripts/gpu/eval_goals_run.sh (random)"}}
off, desc = 0, {}
for name, dt, shape, raw in arrays:
    desc[name] = {"dtype": dt, "shape": shape, "offset": off}
    off += len(raw)
header["arrays"] = desc
text = json.dumps(header, separators=(",", ":")).encode("utf-8")
text += b" " * ((-(8 + len(text))) % 64)
with open(f"{out}/base_300k_top32.fnl", "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for _, _, _, raw in arrays:
        f.write(raw)
with open(f"{out}/loglik_1000x4.jsonl", "w") as f:
    for i in range(1000):
        ctx = [rng.randrange(vocab) for _ in range(200)]
        ch = [[rng.randrange(vocab) for _ in range(8)] for _ in range(4)]
        f.write(json.dumps({"id": i, "task": "t%d" % (i % 4), "context_ids": ctx, "choices": ch,
                            "answer": i % 4}) + "\n")
PY
goals=" ${FN_EVAL_GOALS:-ppl kld base kld_ppl_style loglik} "
t() {  # t NAME fngen-args...: the run's JSON to $out/NAME.json, its log to $out/NAME.log
  local name=$1
  shift
  [[ $goals == *" $name "* ]] || return 0
  "$b/fngen" "$@" --json >"$out/$name.json" 2>"$out/$name.log"
  echo "== $name: rc=$? $(tail -c 400 "$out/$name.json")"
}
t ppl eval ppl $rw --ids-file "$out/ids_300k.txt" -c 2048
t kld eval kld $rw --base "$out/base_300k_top32.fnl"
t base eval ppl $rw --ids-file "$out/ids_600k.txt" -c 2048 --save-logits "$out/base.fnl" --save-top-k 32
t kld_ppl_style eval kld $rw --base "$out/base.fnl"
t loglik eval loglik $rw -i "$out/loglik_1000x4.jsonl" -c 256 -o "$out/loglik.jsonl"
$py - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def secs(name, key=None):
    try:
        j = json.load(open(f"{out}/{name}.json"))
        return j["summary"]["seconds"] if key else j["seconds"]
    except Exception as e:  # noqa: BLE001
        return f"n/a ({e})"
print(f"ppl    300K tokens -c 2048: {secs('ppl')} s (goal <= 60)")
print(f"kld    300K rows top-32:    {secs('kld')} s (goal <= 90)")
print(f"kld    llama.cpp-style base (600K tokens fed): {secs('kld_ppl_style')} s")
print(f"loglik 1000 x 4:            {secs('loglik', 1)} s (goal <= 60)")
PY
