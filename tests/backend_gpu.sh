#!/usr/bin/env bash
# `fngen generate/eval --backend cuda` end to end on the GPU machine (CTest backend_gpu, label
# gpu; needs 2 GPUs for the -np 2 runs): the tp4 reference fixture, greedy, at -np 1 and 2 (both
# --allreduce values at -np 2) must report backend "cuda" and reproduce the transformers
# reference's generated ids up to the first step whose top-1 margin is below the BF16 tolerance
# 2e-2 · max |ref logit| (later steps may legitimately flip); --no-graph must
# print the same ids as the graph; --backend auto picks cuda there; eval ppl runs on cuda.
# Usage: backend_gpu.sh FNGEN MPIEXEC SOURCE_DIR
set -u
fngen=$1
mpiexec=$2
src=$3
source "$src/tests/cli_lib.sh"
fx=$src/tests/data/fixtures
mpi() { mpi_fngen "$@"; }  # mpi NP fngen-args...

ids=$($py -c "import json;print(','.join(map(str,json.load(open('$fx/tp4/expected.json'))['prompt_ids'])))")

# check_ids FILE DESCRIPTION: backend cuda and the reference's ids up to the first low margin.
check_ids() {
  if $py - "$1" "$fx/tp4/expected.json" <<'EOF'; then
import json, sys
j, ref = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
tol = 2e-2 * ref["max_abs_logit"]
n0 = ref["prompt_len"] - 1
want, margins = ref["generated_ids"], ref["top1_margins"]
firm = 0  # steps whose reference margin exceeds the tolerance, from the start
while firm < len(want) and margins[n0 + firm] > tol:
    firm += 1
assert j["backend"] == "cuda", j["backend"]
got = j["token_ids"]
assert len(got) == 32 and j["finish_reason"] == "length", (len(got), j["finish_reason"])
assert firm >= 1, "the fixture's first step is already a near tie"
assert got[:firm] == want[:firm], (got, want, firm)
print(f"  the {firm} steps before the first low-margin one equal the reference")
EOF
    echo "ok: $2"
  else
    fail "$2: $(head -c 400 "$1")"
  fi
}

run() {  # run NAME NP extra-args...
  local name=$1 np=$2
  shift 2
  if mpi "$np" generate -m "$fx/tp4" --prompt-ids "$ids" --temp 0 --ignore-eos -n 32 --json \
    "$@" >"$tmp/$name.json" 2>"$tmp/$name.err"; then
    check_ids "$tmp/$name.json" "$name: -np $np $*"
  else
    fail "$name: -np $np $* exited non-zero: $(tail -n 5 "$tmp/$name.err")"
  fi
}

run cuda1 1 --backend cuda
run auto1 1
run eager1 1 --backend cuda --no-graph
run cuda2_auto 2 --backend cuda --allreduce auto
run cuda2_nccl 2 --backend cuda --allreduce nccl
run eager2 2 --backend cuda --no-graph
grep -q "backend cuda, TP 2, all-reduce nccl" "$tmp/cuda2_nccl.err" &&
  echo "ok: the load line names backend, TP and all-reduce" ||
  fail "load line: $(cat "$tmp/cuda2_nccl.err")"
# Graph replay and the eager step run the same kernels: the same ids.
$py - "$tmp" <<'EOF' && echo "ok: --no-graph prints the graph's ids at -np 1 and 2" || fail "graph vs eager ids differ"
import json, sys
d = sys.argv[1]
ids = lambda n: json.load(open(f"{d}/{n}.json"))["token_ids"]
assert ids("cuda1") == ids("eager1") == ids("auto1"), (ids("cuda1"), ids("eager1"))
assert ids("cuda2_auto") == ids("eager2") == ids("cuda2_nccl"), (ids("cuda2_auto"), ids("eager2"))
EOF

# The n-gram table in pinned host memory (--ngram-table host, or auto under a budget too small for
# the table: --gpu-memory-utilization 1e-9): the same logits, so the same greedy ids as the
# device-resident table, at -np 1 and 2; the load logs the placement and its reason.
run host1 1 --backend cuda --ngram-table host
run autohost1 1 --backend cuda --gpu-memory-utilization 1e-9
run host2 2 --backend cuda --ngram-table host
run eagerhost2 2 --backend cuda --ngram-table host --no-graph
$py - "$tmp" <<'EOF' && echo "ok: a host-resident n-gram table gives the device table's ids" || fail "host vs device table ids differ"
import json, sys
d = sys.argv[1]
ids = lambda n: json.load(open(f"{d}/{n}.json"))["token_ids"]
assert ids("cuda1") == ids("host1") == ids("autohost1"), (ids("cuda1"), ids("host1"), ids("autohost1"))
assert ids("cuda2_auto") == ids("host2") == ids("eagerhost2"), (ids("cuda2_auto"), ids("host2"))
EOF
grep -q "n-gram table: pinned host memory (auto: .* exceeds .* goes to pinned host memory)" "$tmp/autohost1.err" &&
  grep -q "MiB n-gram table in pinned host memory" "$tmp/autohost1.err" &&
  echo "ok: auto under a small --gpu-memory-utilization logs the host placement and why" ||
  fail "auto placement log: $(cat "$tmp/autohost1.err")"
grep -q "n-gram table: device memory (auto: .* fits " "$tmp/cuda1.err" &&
  echo "ok: auto on a roomy card keeps the table on the device and says why" ||
  fail "auto device placement log: $(cat "$tmp/cuda1.err")"

# eval on cuda: ppl over the fixture's prompt + generated ids, backend cuda, finite.
$py -c "import json; j=json.load(open('$fx/tp4/expected.json')); \
print(','.join(map(str, j['prompt_ids'] + j['generated_ids'])))" >"$tmp/ids.txt"
if mpi 2 eval ppl -m "$fx/tp4" --ids-file "$tmp/ids.txt" -c 32 --json --backend cuda \
  >"$tmp/ppl.json" 2>"$tmp/err"; then
  $py -c "import json,math,sys; j=json.load(open(sys.argv[1])); \
sys.exit(0 if j['backend']=='cuda' and j['n_chunks']==2 and math.isfinite(j['ppl']) else 1)" \
    "$tmp/ppl.json" && echo "ok: eval ppl --backend cuda at -np 2" || fail "eval ppl: $(cat "$tmp/ppl.json")"
else
  fail "eval ppl --backend cuda exited non-zero: $(tail -n 5 "$tmp/err")"
fi

# eval with the table in host memory: the same perplexity as on the device (same logits).
for t in device host; do
  mpi 1 eval ppl -m "$fx/tp4" --ids-file "$tmp/ids.txt" -c 32 --json --backend cuda \
    --ngram-table $t >"$tmp/ppl_$t.json" 2>"$tmp/err" || fail "eval ppl --ngram-table $t: $(tail -n 5 "$tmp/err")"
done
$py -c "import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:]); sys.exit(0 if a['ppl']==b['ppl'] else 1)" \
  "$tmp/ppl_device.json" "$tmp/ppl_host.json" && echo "ok: eval ppl is the same with the table in host memory" ||
  fail "eval ppl differs: $(cat "$tmp/ppl_device.json" "$tmp/ppl_host.json")"

echo "backend_gpu: $failures failure(s)"
[ "$failures" = 0 ]
