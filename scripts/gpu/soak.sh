#!/usr/bin/env bash
# Soak of the CUDA backend: 1,000 prompts of mixed lengths (1..200 random ids) from one
# JSONL batch through one `fngen generate` process at TP=2 on the tp4 fixture, then checks that
# every record was answered, that the device memory in use and the number of captured CUDA graphs
# after the last record equal those after the first, and that rank 0's host RSS grew by no more
# than the batch summary's stored latencies (see below). Needs a build with
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
import json, math, sys
n = int(sys.argv[1])
recs = [json.loads(l) for l in open(sys.argv[2])]
ok = len(recs) == n and all("error" not in r for r in recs)
first, last = recs[0], recs[-1]
for key in ("device_used_mib", "graph_captures"):
    print(f"{key}: after the first record {first.get(key)}, after the last {last.get(key)}")
    ok &= first.get(key) == last.get(key)
# Host memory: the batch summary keeps every TTFT and inter-token latency (doubles in two
# std::vectors) for its exact percentiles, so rank 0's RSS may grow by what those vectors hold:
# each grows by doubling and the freed smaller blocks stay in the heap, so at most twice the
# final power-of-two capacity, plus one page. Everything else must not grow.
pow2 = lambda k: 1 << max(0, math.ceil(math.log2(max(k, 1))))
itls = sum(len(r.get("per_token_ms", [])) for r in recs)
bound = 2 * 8 * (pow2(itls) + pow2(len(recs))) + 4096
growth = (last["host_rss_mib"] - first["host_rss_mib"]) * 2**20
print(f"host_rss_mib: after the first record {first['host_rss_mib']}, after the last "
      f"{last['host_rss_mib']}: growth {growth:.0f} B; the summary's latency samples may take "
      f"up to {bound} B ({len(recs)} TTFTs + {itls} ITLs)")
ok &= 0 <= growth <= bound
print(f"records answered: {len(recs)} of {n}; " + ("PASS" if ok else "FAIL"))
sys.exit(0 if ok else 1)
PY
