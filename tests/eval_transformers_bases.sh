#!/usr/bin/env bash
# fngen eval kld against base files written by transformers itself (tests/data/eval/README.md):
# KL(ref || fngen) mean <= 1e-5 and same top-1 100 % on the CPU backend.
# Usage: eval_transformers_bases.sh FNGEN SOURCE_DIR
set -u
fngen=$1
src=$2
failures=0
for pair in tp4:tp4_tf tp4:tp4_tf_ppl g3_tiny:g3_tf; do
  model=${pair%%:*}
  base=${pair#*:}
  json=$("$fngen" eval kld -m "$src/tests/data/fixtures/$model" \
    --base "$src/tests/data/eval/$base.fnlogits" --json 2>/dev/null)
  if ! printf '%s' "$json" | /usr/bin/python3 -c '
import json, sys
d = json.load(sys.stdin)
mean = d["kld"]["mean"]
top = d["same_top1"]
rows = d["count"]
print(f"kld mean {mean:.3e}, same top-1 {100 * top:.1f} %, rows {rows}")
sys.exit(0 if mean <= 1e-5 and top == 1.0 and rows > 30 else 1)'; then
    echo "FAIL: $base"
    failures=$((failures + 1))
  fi
done
[ "$failures" = 0 ]
