#!/usr/bin/env bash
# Soak of the CUDA backend (issue 6): 1,000 prompts of mixed lengths (1..200 random ids) from one
# JSONL batch through one `fngen generate` process at TP=2 on the tp4 fixture, then checks that
# every record was answered and that rank 0's host RSS, the device memory in use and the number
# of captured CUDA graphs after the last record equal those after the first. Needs a build with
# CUDA in $FN_BUILD_DIR (default build-gpu) and 2 GPUs. Usage: bash scripts/gpu/soak.sh [N]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/soak-out}
mkdir -p "$out"
b=${FN_BUILD_DIR:-build-gpu}
n=${1:-1000}
/usr/bin/python3 - "$n" >"$out/soak.jsonl" <<'PY'
import json, random, sys
random.seed(5)
for i in range(int(sys.argv[1])):
    ids = [random.randrange(384) for _ in range(random.randint(1, 200))]
    print(json.dumps({"id": i, "prompt_ids": ids}))
PY
mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 "$b/fngen" generate \
  --backend cuda -m tests/data/fixtures/tp4 -i "$out/soak.jsonl" -o "$out/soak_out.jsonl" \
  -n 16 -c 256 --temp 0.8 --seed 3 2>"$out/soak.err"
/usr/bin/python3 - "$n" "$out/soak_out.jsonl" <<'PY'
import json, sys
n = int(sys.argv[1])
recs = [json.loads(l) for l in open(sys.argv[2])]
ok = len(recs) == n and all("error" not in r for r in recs)
first, last = recs[0], recs[-1]
for key in ("host_rss_mib", "device_used_mib", "graph_captures"):
    print(f"{key}: after the first record {first.get(key)}, after the last {last.get(key)}")
    ok &= first.get(key) == last.get(key)
print(f"records answered: {len(recs)} of {n}; " + ("PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
PY
