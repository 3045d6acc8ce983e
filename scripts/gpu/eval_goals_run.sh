#!/usr/bin/env bash
# One GPU-machine call for eval's time goals (docs/performance.md "Eval at scale"), TP=1, the full
# geometry on random weights (`--random-weights --config configs/qwen3.8-flash-next.json`), inputs
# of random token ids made here:
#   ppl     300,000 ids, -c 2048 (146 windows)                         goal <= 60 s
#   kld     a top-32 base of 299,739 rows (ppl --save-logits over 600,000 ids, -c 2048, not
#           timed), then kld against it                                 goal <= 90 s
#   loglik  1,000 items x 4 choices of 8 ids after 200-id contexts      goal <= 60 s
# Each time is the command's own "seconds" (the load excluded). The kld run compares the model
# with itself (same weights and seed): KLD mean ~0 and same top-1 ~100 % is a sanity check.
# Usage on the GPU machine: bash scripts/gpu/eval_goals_run.sh
# Environment: FN_BUILD_DIR (build-gpu).
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/eval-goals-out}
mkdir -p "$out"
b=${FN_BUILD_DIR:-build-gpu}
cfg=configs/qwen3.8-flash-next.json
rw="--random-weights --config $cfg --backend cuda"
py=/usr/bin/python3
[ -x "$b/fngen" ] || bash scripts/gpu/build.sh >"$out/build.log" 2>&1 || { tail -n 30 "$out/build.log"; exit 1; }
vocab=$($py -c "import json;c=json.load(open('$cfg'));print(c.get('text_config',c)['vocab_size'])")
$py - "$out" "$vocab" <<'PY'
import json, random, sys
out, vocab = sys.argv[1], int(sys.argv[2])
rng = random.Random(1)
for n, name in ((300000, "ids_300k.txt"), (600000, "ids_600k.txt")):
    with open(f"{out}/{name}", "w") as f:
        f.write(" ".join(str(rng.randrange(vocab)) for _ in range(n)))
with open(f"{out}/loglik_1000x4.jsonl", "w") as f:
    for i in range(1000):
        ctx = [rng.randrange(vocab) for _ in range(200)]
        ch = [[rng.randrange(vocab) for _ in range(8)] for _ in range(4)]
        f.write(json.dumps({"id": i, "task": "t%d" % (i % 4), "context_ids": ctx, "choices": ch,
                            "answer": i % 4}) + "\n")
PY
t() {  # t NAME fngen-args...: the run's JSON to $out/NAME.json, its log to $out/NAME.log
  local name=$1
  shift
  "$b/fngen" "$@" --json >"$out/$name.json" 2>"$out/$name.log"
  echo "== $name: rc=$? $(tail -c 400 "$out/$name.json")"
}
t ppl eval ppl $rw --ids-file "$out/ids_300k.txt" -c 2048
t base eval ppl $rw --ids-file "$out/ids_600k.txt" -c 2048 --save-logits "$out/base.fnl" --save-top-k 32
t kld eval kld $rw --base "$out/base.fnl"
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
print(f"loglik 1000 x 4:            {secs('loglik', 1)} s (goal <= 60)")
PY
