#!/usr/bin/env bash
# One GPU-machine call for the decode lane of docs/performance.md: builds fngen, runs the
# full-geometry latency lane (`fngen bench --random-weights --config
# configs/qwen3.8-flash-next.json --backend cuda -p 8192 -n 512 -r 3 --warmup 1 --breakdown`: a
# real prefill of random ids, then greedy decode) at TP=1 and TP=2 (and TP=2 over NCCL instead of
# the custom all-reduce), and, when FN_PEER names it, the PyTorch peer script
# (`peer_torch.py bench 48 CTX N`, TP=1, kept outside this repository) on GPU 0 while fngen
# builds (its time comes from CUDA events, so the compile load on the CPU does not enter it).
# Prints ms/token of both and the ratio. JSON, per-token records and logs go to $OUT.
# Usage on the GPU machine: bash scripts/gpu/bench_run.sh
# Environment: FN_BUILD_DIR (build-gpu), FN_BENCH_P (prompt depth, 8192), FN_BENCH_N (generated
# tokens, 512), FN_BENCH_R (repetitions, 3), FN_BENCH_NCCL (1: also TP=2 over NCCL),
# FN_BENCH_LANES (the lanes, e.g. "1" on a one-GPU machine), FN_PEER (the peer script; none by
# default), FN_PEER_N (peer tokens, 64). In a tree without its git history, put
# FN_GIT_COMMIT=<hash> in front of the command, or the reports' "commit" is "unknown"
# (cmake/git_commit.cmake).
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/bench-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
b=${FN_BUILD_DIR:-build-gpu}
p=${FN_BENCH_P:-8192}
n=${FN_BENCH_N:-512}
r=${FN_BENCH_R:-3}
peer_n=${FN_PEER_N:-64}
peer=${FN_PEER:-}
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
t0=$SECONDS
nvidia-smi --query-gpu=index,name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv \
  >"$out/gpus.csv" 2>&1
cat "$out/gpus.csv"

peer_pid=
if [ -n "$peer" ] && [ -f "$peer" ]; then
  (CUDA_VISIBLE_DEVICES=0 timeout 200 python3 "$peer" bench 48 "$p" "$peer_n" >"$out/peer.txt" 2>&1
    echo "rc=$?" >>"$out/peer.txt") &
  peer_pid=$!
else
  echo "== peer: none (FN_PEER names no file)"
fi

t=$SECONDS
if ! FN_BUILD_DIR=$b timeout 250 bash scripts/gpu/build.sh fngen >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -30
  echo "== build failed ($((SECONDS - t)) s)"
  [ -n "$peer_pid" ] && wait "$peer_pid" && cat "$out/peer.txt"
  exit 1
fi
echo "== build ok ($((SECONDS - t)) s)"
if [ -n "$peer_pid" ]; then
  wait "$peer_pid"
  echo "== peer ($((SECONDS - t0)) s since start)"
  tail -n 4 "$out/peer.txt" | cut -c1-400
fi

lanes="1 2"
[ "${FN_BENCH_NCCL:-1}" = 1 ] && lanes="1 2 2nccl"
lanes=${FN_BENCH_LANES:-$lanes}  # e.g. "1" on a one-GPU machine
for lane in $lanes; do
  np=${lane%nccl}
  ar=auto
  [ "$lane" != "$np" ] && ar=nccl
  t=$SECONDS
  timeout 150 $mpi -np "$np" "$b/fngen" bench --random-weights \
    --config configs/qwen3.8-flash-next.json --backend cuda --allreduce "$ar" -p "$p" -n "$n" \
    -r "$r" --warmup 1 --breakdown --format json -o "$out/bench_tp$lane.json" \
    --per-token "$out/itl_tp$lane.jsonl" >"$out/bench_tp$lane.log" 2>&1
  echo "== fngen bench TP=$np all-reduce $ar rc=$? ($((SECONDS - t)) s)"
  grep -E "error|bench:" "$out/bench_tp$lane.log" | grep -vE "^\[r[1-9]" | tail -n 6 | cut -c1-400
done

python3 - "$out" "$p" "$n" <<'PY'
import json, os, re, sys
out, p, n = sys.argv[1], sys.argv[2], sys.argv[3]
res = {}
for tp in ("1", "2", "2nccl"):
    path = os.path.join(out, f"bench_tp{tp}.json")
    if not os.path.exists(path):
        print(f"TP={tp}: no report"); continue
    j = json.load(open(path))
    lane = j["lanes"][0]
    res[tp] = lane["tpot_ms"]
    tp = j["tp_size"]
    print(f"\nfngen TP={tp} ({j['gpu']}, all-reduce {j['all_reduce']}): -p {p} -n {n}: TPOT "
          f"{lane['tpot_ms']:.4f} ± {lane['tpot_ms_std']:.4f} ms, ITL p50/p90/p99 "
          f"{lane['itl_p50_ms']:.4f}/{lane['itl_p90_ms']:.4f}/{lane['itl_p99_ms']:.4f} ms, "
          f"floor {lane['floor_ms']:.4f} ms ({lane['bytes_per_token'] / 1e9:.3f} GB/token/rank), "
          f"{lane['pct_of_bandwidth']:.1f} % of {j['bandwidth_gbs']} GB/s")
    info = lane.get("breakdown_info", {})
    print(f"  breakdown ({info.get('timing')}): graph+events {info.get('graph_step_ms')} ms, "
          f"eager {info.get('eager_step_ms'):.4f} ms, replay {info.get('graph_replay_tpot_ms'):.4f} ms, "
          f"{info.get('events_per_step')} events at ~{1e3 * info.get('event_cost_ms', 0):.2f} us"
          f"{'; graph error: ' + info['graph_error'] if info.get('graph_error') else ''}")
    print("  | family | MB | floor ms | ms graph | ms eager | segments | ms graph-events | GB/s |")
    for r in lane.get("breakdown", []):
        g, a = r["ms_graph"], r["ms_adjusted"]
        g = "n/a" if g is None else f"{g:.4f}"
        a = "n/a" if a is None else f"{a:.4f}"
        print(f"  | {r['family']} | {r['bytes'] / 1e6:.2f} | {r['floor_ms']:.4f} | {g} | "
              f"{r['ms_eager']:.4f} | {r['segments']} | {a} | {r['gbs']:.0f} |")
peer_ms = None
try:
    m = re.search(r"layers 48 ctx \d+: ([0-9.]+) ms/token", open(os.path.join(out, "peer.txt")).read())
    peer_ms = float(m.group(1)) if m else None
except OSError:
    pass
print(f"\nside by side, TP=1, depth {p}: peer_torch {peer_ms} ms/token, fngen {res.get('1')} ms/token"
      + (f", ratio peer/fngen = {peer_ms / res['1']:.2f}x" if peer_ms and res.get("1") else ""))
PY
echo "== total $((SECONDS - t0)) s"
