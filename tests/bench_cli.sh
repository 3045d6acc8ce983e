#!/usr/bin/env bash
# `fngen bench` end to end on the tp4 fixture with --backend cpu (CTest bench_cli, label cpu, and
# bench_cli_mpi, label mpi). Mode "cpu" (one process): the md table has one row per lane with the
# llama-bench-style columns; json, jsonl and csv parse and hold the same deterministic numbers
# (lanes, decode depth, bytes per token = `fngen inspect`'s token_bytes at that depth, ITL
# counts) and each format's derived columns follow from its own timings (tokens/s = 1000/TPOT,
# GB/s = bytes/TPOT, % = GB/s / 4300, floor = bytes / 4300 GB/s); one run's --per-token record
# (every inter-token latency: the n_gen - 1 gaps after the first token, per measured repetition,
# warm-up excluded) reproduces that run's TPOT mean ± std, TTFT and the ITL p50/p90/p99 computed
# independently with numpy; -o FILE leaves stdout empty; every bad input is a usage error (exit 2)
# naming the flag. Mode "mpi": mpirun -np 2 prints the report once (rank 0), TP 2 over MPI, and
# per-rank bytes equal to inspect --tp 2.
# Usage: bench_cli.sh FNGEN MPIEXEC SOURCE_DIR cpu|mpi
set -u
fngen=$1
mpiexec=$2
src=$3
mode=$4
source "$src/tests/cli_lib.sh"
fx=$src/tests/data/fixtures/tp4

bench() {  # bench fngen-bench-args... (one process)
  timeout 300 "$fngen" bench -m "$fx" --backend cpu "$@"
}
mpi() {  # mpi NP args...
  local np=$1
  shift
  mpi_fngen "$np" bench -m "$fx" --backend cpu "$@"
}

# pycheck DESCRIPTION PYTHON-SCRIPT ARGS...: the script exits non-zero (printing why) on failure.
pycheck() {
  local what=$1 script=$2
  shift 2
  if $py -c "$script" "$@" >"$tmp/py" 2>&1; then
    pass "$what"
  else
    fail "$what: $(tail -n 5 "$tmp/py")"
  fi
}

# Shared by the checks: the lane fields of one record and their relations.
common='
import csv, json, math, subprocess, sys
def close(a, b, rel=1e-9):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)
def need(cond, msg):
    if not cond:
        print(msg); sys.exit(1)
def inspect_bytes(fngen, fx, tp, ctx):
    out = subprocess.run([fngen, "inspect", fx, "--tp", str(tp), "-c", str(ctx), "--json"],
                         capture_output=True, check=True).stdout
    return [r["token_bytes"]["total"] for r in json.loads(out)["ranks"]]
def check_lane(l, reps, fngen, fx, tp):
    p, n = int(l["n_prompt"]), int(l["n_gen"])
    tpot, b = float(l["tpot_ms"]), int(l["bytes_per_token"])
    need(int(l["decode_depth"]) == p + n // 2, "decode_depth %s != %s" % (l["decode_depth"], p + n // 2))
    need(int(l["itl_count"]) == reps * (n - 1), "itl_count %s != %s" % (l["itl_count"], reps * (n - 1)))
    want = inspect_bytes(fngen, fx, tp, p + n // 2)
    by_rank = l["bytes_per_token_by_rank"]
    if isinstance(by_rank, str):
        by_rank = [int(x) for x in by_rank.split(";")]
    need(by_rank == want and b == max(want), f"bytes {b} {by_rank} != inspect {want}")
    need(tpot > 0 and float(l["ttft_ms"]) > 0 and float(l["prefill_ms"]) > 0, "timings must be > 0")
    need(float(l["itl_p50_ms"]) <= float(l["itl_p90_ms"]) <= float(l["itl_p99_ms"]) <= float(l["itl_max_ms"]),
         "ITL percentiles out of order")
    need(close(float(l["decode_tokens_per_s"]), 1000 / tpot), "decode t/s != 1000/TPOT")
    need(close(float(l["prefill_tokens_per_s"]), p / (float(l["prefill_ms"]) / 1000)),
         "prefill t/s != n_prompt/prefill")
    need(float(l["prompt_tflop"]) > 0 and close(float(l["ttft_tflops_per_s"]),
         float(l["prompt_tflop"]) / (float(l["ttft_ms"]) / 1000)), "TFLOP/s != prompt TFLOP / TTFT")
    gbs = b / (tpot / 1000) / 1e9
    need(close(float(l["achieved_gbs"]), gbs), "GB/s %s != %s" % (l["achieved_gbs"], gbs))
    need(close(float(l["pct_of_bandwidth"]), 100 * gbs / 4300), "% of 4300 GB/s wrong")
    need(close(float(l["floor_ms"]), b / 4300e9 * 1e3), "floor_ms != bytes / 4300 GB/s")
    need(int(l["weight_bytes_per_token"]) + int(l["state_bytes_per_token"]) == b,
         "weight + state bytes != bytes per token")
def check_run(r, tp):
    need(r["backend"] == "cpu" and int(r["tp_size"]) == tp, "backend/tp %s %s" % (r["backend"], r["tp_size"]))
    need(r["all_reduce"] == ("mpi" if tp > 1 else "none"), "all_reduce %s" % r["all_reduce"])
    need(float(r["bandwidth_gbs"]) == 4300 and "H200" in r["bandwidth_source"], "bandwidth reference")
    # The default is an H200 figure: on the cpu backend the source says so.
    need(r["bandwidth_source"].endswith(": an H200 figure, not this CPU\x27s (give --bandwidth-gbs for a CPU roofline)"),
         "the cpu run does not say its reference is an H200 figure: %s" % r["bandwidth_source"])
    need(r["gpu"] == "none" and r["driver"] == "none" and r["nccl"] == "none", "GPU fields on cpu")
    need(r["commit"] != "", "commit empty")
    need(r["weights"] == "checkpoint" and r["prefill"] == "run", "weights/prefill %s %s" % (r["weights"], r["prefill"]))
# The deterministic fields that every format must hold alike.
def key(l):
    by_rank = l["bytes_per_token_by_rank"]
    if isinstance(by_rank, str):
        by_rank = [int(x) for x in by_rank.split(";")]
    return (int(l["n_prompt"]), int(l["n_gen"]), int(l["decode_depth"]), int(l["bytes_per_token"]),
            int(l["itl_count"]), tuple(by_rank), round(float(l["floor_ms"]), 12))
'

if [ "$mode" = cpu ]; then
  # ---- md: one row per lane, the documented columns ----
  if bench -p 8,16 -n 4 -r 2 >"$tmp/md" 2>"$tmp/err"; then
    pycheck "md: -p 8,16 -n 4 gives 2 rows with 13 columns, header and reference named" "$common
md = open(sys.argv[1]).read().splitlines()
head = '| n_prompt | n_gen | TTFT ms | TPOT ms | ITL p50 ms | ITL p90 ms | ITL p99 ms | decode t/s | prefill t/s | MB/token/rank | floor ms | GB/s | % of ref |'
need(md.count(head) == 1, 'header row missing')
rows = [l for l in md if l.startswith('| ') and l[2].isdigit()]
need(len(rows) == 2, f'{len(rows)} rows')
cells = [[c.strip() for c in r.strip('|').split('|')] for r in rows]
need(all(len(c) == 13 for c in cells), 'a row does not have 13 cells')
need([(c[0], c[1]) for c in cells] == [('8', '4'), ('16', '4')], 'lanes')
need(all('±' in c[2] and '±' in c[3] for c in cells), 'TTFT/TPOT lack mean ± std')
want = [max(inspect_bytes(sys.argv[2], sys.argv[3], 1, d)) for d in (10, 18)]
need([c[9] for c in cells] == [f'{b / 1e6:.4f}' for b in want], f'MB/token {[c[9] for c in cells]} vs {want}')
for c in cells:
    tpot = float(c[3].split('±')[0])
    need(abs(float(c[7]) - 1000 / tpot) <= 0.01 * float(c[7]), 'decode t/s vs TPOT')
need(any('reference bandwidth: 4300 GB/s = the measured H200 device copy bandwidth' in l
         and l.endswith(\"an H200 figure, not this CPU's (give --bandwidth-gbs for a CPU roofline)\") for l in md),
     'the reference bandwidth is not named as an H200 figure on the cpu backend')
need(any(l.startswith('GPU: none, driver: none') for l in md), 'environment line')
" "$tmp/md" "$fngen" "$fx"
  else
    fail "md run exited non-zero: $(tail -n 3 "$tmp/err")"
  fi
  grep -q "bench: lane 2/2" "$tmp/err" && pass "progress logs go to stderr" ||
    fail "no lane log on stderr"
  # The lane log names the reference as such, and the run's source once (not a CPU figure).
  grep -q "% of the 4300 GB/s reference)" "$tmp/err" &&
    [ "$(grep -c "bench: reference bandwidth 4300 GB/s = .*an H200 figure, not this CPU's" "$tmp/err")" = 1 ] &&
    pass "stderr: % of the 4300 GB/s reference, named once as an H200 figure on the cpu backend" ||
    fail "the reference bandwidth on stderr: $(grep "GB/s" "$tmp/err" | head -n 3)"

  # ---- json, jsonl, csv: parse, same deterministic numbers, relations hold ----
  bench -p 8,16 -n 4 -r 2 --format json >"$tmp/j.json" 2>/dev/null || fail "json run"
  bench -p 8,16 -n 4 -r 2 --format jsonl >"$tmp/j.jsonl" 2>/dev/null || fail "jsonl run"
  bench -p 8,16 -n 4 -r 2 --format csv >"$tmp/j.csv" 2>/dev/null || fail "csv run"
  pycheck "json: 2 lanes, fields and derived columns consistent, bytes = inspect" "$common
j = json.load(open(sys.argv[1]))
check_run(j, 1)
need(j['repetitions'] == 2 and j['warmup'] == 1 and j['ctx_size'] == 20 and j['seed'] == 0, 'run fields')
need(len(j['lanes']) == 2, 'lanes')
for l in j['lanes']: check_lane(l, 2, sys.argv[2], sys.argv[3], 1)
" "$tmp/j.json" "$fngen" "$fx"
  pycheck "jsonl: one record per lane, each with the run fields" "$common
ls = [json.loads(x) for x in open(sys.argv[1])]
need(len(ls) == 2, f'{len(ls)} lines')
for l in ls: check_run(l, 1); check_lane(l, 2, sys.argv[2], sys.argv[3], 1)
" "$tmp/j.jsonl" "$fngen" "$fx"
  pycheck "csv: header + one row per lane, parses" "$common
rows = list(csv.DictReader(open(sys.argv[1])))
need(len(rows) == 2, f'{len(rows)} rows')
for r in rows: check_run(r, 1); check_lane(r, 2, sys.argv[2], sys.argv[3], 1)
" "$tmp/j.csv" "$fngen" "$fx"
  pycheck "json, jsonl and csv hold the same lanes and byte numbers" "$common
a = [key(l) for l in json.load(open(sys.argv[1]))['lanes']]
b = [key(json.loads(x)) for x in open(sys.argv[2])]
c = [key(r) for r in csv.DictReader(open(sys.argv[3]))]
need(a == b == c, f'{a} / {b} / {c}')
" "$tmp/j.json" "$tmp/j.jsonl" "$tmp/j.csv"

  # ---- one run: -o FILE and --per-token reproduce the report's statistics ----
  bench -p 8,16 -n 5 -r 3 --warmup 2 --format json -o "$tmp/o.json" --per-token "$tmp/pt.jsonl" \
    >"$tmp/stdout" 2>"$tmp/err" || fail "-o/--per-token run: $(tail -n 3 "$tmp/err")"
  [ -s "$tmp/stdout" ] && fail "-o FILE: stdout is not empty" || pass "-o FILE: stdout stays empty"
  pycheck "--per-token: 2 lanes x 3 repetitions, n_gen - 1 = 4 gaps each; stats match numpy" "$common
import numpy, statistics
j = json.load(open(sys.argv[1]))
recs = [json.loads(x) for x in open(sys.argv[2])]
need(len(recs) == 6, f'{len(recs)} records (want 2 lanes x 3 repetitions, warm-up excluded)')
need([(r['lane'], r['repetition']) for r in recs] == [(0,0),(0,1),(0,2),(1,0),(1,1),(1,2)], 'order')
need(all(len(r['itl_ms']) == 4 and min(r['itl_ms']) > 0 for r in recs), 'gap counts')
for i, l in enumerate(j['lanes']):
    rs = [r for r in recs if r['lane'] == i]
    need(all(r['n_prompt'] == l['n_prompt'] and r['n_gen'] == 5 for r in rs), 'lane fields')
    itl = [x for r in rs for x in r['itl_ms']]
    tpots = [statistics.fmean(r['itl_ms']) for r in rs]
    ttfts = [r['ttft_ms'] for r in rs]
    need(close(l['tpot_ms'], statistics.fmean(tpots)), 'TPOT mean')
    need(close(l['tpot_ms_std'], statistics.stdev(tpots)), 'TPOT std (sample, over repetitions)')
    need(close(l['ttft_ms'], statistics.fmean(ttfts)) and close(l['ttft_ms_std'], statistics.stdev(ttfts)), 'TTFT')
    for q in (50, 90, 99):
        need(close(l[f'itl_p{q}_ms'], float(numpy.percentile(itl, q))), f'ITL p{q}')
    need(close(l['itl_max_ms'], max(itl)) and l['itl_count'] == 12, 'ITL max/count')
    need(all(r['ttft_ms'] >= r['prefill_ms'] > 0 for r in rs), 'TTFT >= prefill')
" "$tmp/o.json" "$tmp/pt.jsonl"

  # ---- scripts/plot_bench.py on that run's JSON and per-token record ----
  plot=$src/scripts/plot_bench.py
  if $py "$plot" "$tmp/o.json" --per-token "$tmp/pt.jsonl" -o "$tmp/png" >"$tmp/plot.out" \
    2>"$tmp/plot.err"; then
    pycheck "plot_bench: tpot_vs_floor + one ITL plot per lane, PNGs; breakdown skipped with a note" "
import sys, matplotlib.image as im
d = sys.argv[1]
want = ['tpot_vs_floor.png', 'itl_p8_n5.png', 'itl_p16_n5.png']
got = [l.strip() for l in open(sys.argv[2])]
assert got == [d + '/' + w for w in want], got
for w in want:
    assert open(d + '/' + w, 'rb').read(8) == b'\x89PNG\r\n\x1a\n', w
    h, wd = im.imread(d + '/' + w).shape[:2]
    assert h >= 300 and wd >= 500, (w, h, wd)
assert 'per-op breakdown plot skipped' in open(sys.argv[3]).read()
" "$tmp/png" "$tmp/plot.out" "$tmp/plot.err"
  else
    fail "plot_bench exited non-zero: $(tail -n 3 "$tmp/plot.err")"
  fi
  $py -c "
import json, sys
j = json.load(open(sys.argv[1]))
j['breakdown'] = [{'family': 'moe', 'ms': 2.0, 'bytes': 4.3e9, 'ms_eager': 2.5}, {'family': 'lm_head', 'ms': 0.3, 'bytes': 1.27e9, 'ms_eager': 0.4}]
json.dump(j, open(sys.argv[2], 'w'))
del j['breakdown'][1]['bytes']
json.dump(j, open(sys.argv[3], 'w'))" "$tmp/o.json" "$tmp/bd.json" "$tmp/bad_bd.json"
  if $py "$plot" "$tmp/bd.json" -o "$tmp/png2" >"$tmp/plot.out" 2>/dev/null &&
    grep -qx "$tmp/png2/breakdown.png" "$tmp/plot.out" && [ -s "$tmp/png2/breakdown.png" ]; then
    pass "plot_bench: a \"breakdown\" array gives breakdown.png"
  else
    fail "plot_bench did not write breakdown.png: $(cat "$tmp/plot.out")"
  fi
  if $py "$plot" "$tmp/bad_bd.json" -o "$tmp/png3" >/dev/null 2>"$tmp/plot.err"; then
    fail "plot_bench accepted a breakdown row without bytes"
  else
    grep -q 'breakdown\[1\] has no "bytes"' "$tmp/plot.err" &&
      pass "plot_bench: a breakdown row without \"bytes\" is refused, naming it" ||
      fail "plot_bench message: $(cat "$tmp/plot.err")"
  fi

  # A one-lane jsonl report (one line: a JSON object) plots like a json one.
  head -n 1 "$tmp/j.jsonl" >"$tmp/one.jsonl"
  if $py "$plot" "$tmp/one.jsonl" -o "$tmp/png4" >"$tmp/plot.out" 2>"$tmp/plot.err" &&
    grep -qx "$tmp/png4/tpot_vs_floor.png" "$tmp/plot.out"; then
    pass "plot_bench: a one-lane jsonl report plots"
  else
    fail "plot_bench on a one-lane jsonl report: $(cat "$tmp/plot.err")"
  fi

  # ---- --batch: the batched table (and the one-sequence table only with a batch-1 lane) ----
  if bench -p 8 -n 3 -r 1 --warmup 0 --batch 2 >"$tmp/b2.md" 2>"$tmp/err" &&
    grep -q '^| batch | n_prompt' "$tmp/b2.md" && grep -qE '^\| 2 \| 8 \| 3 \|' "$tmp/b2.md" &&
    ! grep -q '^| n_prompt' "$tmp/b2.md"; then
    pass "--batch 2: the batched table alone"
  else
    fail "--batch 2: $(cat "$tmp/b2.md" "$tmp/err" | head -n 20)"
  fi
  if bench -p 8 -n 3 -r 1 --warmup 0 --batch 1,2 >"$tmp/b12.md" 2>"$tmp/err" &&
    grep -qE '^\| 8 \| 3 \|' "$tmp/b12.md" && grep -qE '^\| 2 \| 8 \| 3 \|' "$tmp/b12.md"; then
    pass "--batch 1,2: both tables, one row each"
  else
    fail "--batch 1,2: $(cat "$tmp/b12.md" "$tmp/err" | head -n 20)"
  fi

  # ---- bad input: usage errors (exit 2) naming the flag ----
  expect 2 "--format" -- bench --format xml
  # CLI11's parse errors read as the other usage errors; a flag without its value says so.
  expect 2 "fngen: usage error: --n-prompt: needs a value" -- bench -p
  expect 2 "fngen: usage error: The following argument was not expected: --bogus" -- bench --bogus
  # A world size the model cannot split: named with the launcher's flag, printed once (rank 0).
  expect 2 "the TP size is the number of MPI ranks (mpirun -np 3): tp_size must be 1, 2, 4 or 8" -- \
    mpi 3 -p 4 -n 2
  [ "$(grep -c "tp_size must be" "$tmp/err")" = 1 ] && pass "bench -np 3: one message" ||
    fail "bench -np 3 printed $(grep -c "tp_size must be" "$tmp/err") messages: $(cat "$tmp/err")"
  # Whole numbers (apps/whole_number.h): decimal digits only, each list entry alike; a value
  # outside the allowed range says so, with the range and the text as typed.
  range_p="is out of range (allowed 1 to 2147483647)"
  expect 2 "-p/--n-prompt: '0' $range_p" -- bench -p 0
  expect 2 "-p/--n-prompt: '-4' $range_p (entry 2 of the list '8,-4')" -- bench -p 8,-4
  expect 2 "-p/--n-prompt: '-4' $range_p" -- bench -p -4
  expect 2 "-p/--n-prompt: 'abc' is not a decimal whole number (digits 0-9 only, no hex" -- bench -p abc
  expect 2 "-p/--n-prompt: '' is not a decimal whole number .*(entry 2 of the list '8,,16')" -- bench -p 8,,16
  # Whitespace around an entry is dropped (as --prompt-ids does); an entry of whitespace alone is
  # still empty.
  expect 2 "-p/--n-prompt: '' is not a decimal whole number .*(entry 2 of the list '8, ,16')" -- bench -p "8, ,16"
  expect 2 "-n/--n-gen: '' is not a decimal whole number .*(entry 2 of the list '4, ')" -- bench -p 8 -n "4, "
  expect 2 "-p/--n-prompt: '8 16' is not a decimal whole number" -- bench -p "8 16"
  bench -p " 8, 16" -n "3 ,4 " -r 1 --warmup 0 --format json >"$tmp/spaces.json" 2>"$tmp/err" ||
    fail "bench -p ' 8, 16' -n '3 ,4 ': $(tail -n 2 "$tmp/err")"
  check_json "$tmp/spaces.json" "[(l['n_prompt'], l['n_gen']) for l in j['lanes']] == [(8, 3), (8, 4), (16, 3), (16, 4)]" \
    "-p ' 8, 16' -n '3 ,4 ': whitespace around the entries dropped, four lanes"
  expect 2 "-p/--n-prompt: '0x10' is not a decimal whole number" -- bench -p 8,0x10
  expect 2 "-p/--n-prompt: '+8' is not a decimal whole number" -- bench -p +8
  expect 2 "-p/--n-prompt: '99999999999999999999999' $range_p" -- bench -p 99999999999999999999999
  expect 2 "-p/--n-prompt: '2147483648' $range_p" -- bench -p 2147483648 -n 4
  expect 2 "-n/--n-gen: '0' is out of range (allowed 2 to 2147483647; a lane needs >= 2 generated tokens" -- bench -p 8 -n 0
  expect 2 "-n/--n-gen: '1' is out of range (allowed 2 to 2147483647; a lane needs >= 2 generated tokens" -- bench -p 8 -n 1
  expect 2 "-n/--n-gen: '1e3' is not a decimal whole number" -- bench -p 8 -n 1e3
  # Repetitions rerun the whole lane: bounded, so that a slip (-r 99999999999) is not a run that
  # never ends.
  reps="each repetition runs the whole lane again"
  expect 2 "-r/--repetitions: '0' is out of range (allowed 1 to 1000; $reps)" -- bench -p 8 -n 4 -r 0
  expect 2 "-r/--repetitions: '99999999999' is out of range (allowed 1 to 1000; $reps)" -- \
    bench -p 8 -n 4 -r 99999999999
  expect 2 "-r/--repetitions: '1001' is out of range (allowed 1 to 1000" -- bench -p 8 -n 4 -r 1001
  expect 2 "-r/--repetitions: '0x2' is not a decimal whole number" -- bench -p 8 -n 4 -r 0x2
  expect 2 "--warmup: '-1' is out of range (allowed 0 to 1000; each warm-up repetition runs the whole lane again)" -- \
    bench -p 8 -n 4 --warmup -1
  expect 2 "--warmup: '1001' is out of range (allowed 0 to 1000" -- bench -p 8 -n 4 --warmup 1001
  expect 2 "-c/--ctx-size: '99999999999999999999' is out of range (allowed 0 to 2147483647)" -- \
    bench -p 8 -n 4 -c 99999999999999999999
  expect 2 "-s/--seed: '-1' is out of range (allowed 0 to 9223372036854775807)" -- bench -p 8 -n 4 -s -1
  expect 2 "--prefill-chunk: '99999999999999999999' is out of range (allowed 1 to 9223372036854775807)" -- \
    bench -p 8 -n 4 --prefill-chunk 99999999999999999999
  expect 2 "--breakdown-steps: '08x' is not a decimal whole number" -- bench -p 8 -n 4 --breakdown-steps 08x
  expect 2 "--tp: '-2' is out of range (allowed 1 to 2147483647)" -- bench -p 8 -n 4 --tp -2
  expect 2 "--tp: '0' is out of range (allowed 1 to 2147483647)" -- bench -p 8 -n 4 --tp 0
  # Leading zeros are decimal ("010" is ten, not octal eight; "08" is eight, not an error).
  bench -p 010 -n 08 -r 1 --warmup 0 --format json >"$tmp/dec.json" 2>"$tmp/err" ||
    fail "bench -p 010 -n 08: $(tail -n 2 "$tmp/err")"
  check_json "$tmp/dec.json" "[(l['n_prompt'], l['n_gen']) for l in j['lanes']] == [(10, 8)] and j['repetitions'] == 1" \
    "-p 010 -n 08 read as decimal: one lane (10, 8)"
  # -o - is standard output (not a file named "-").
  (cd "$tmp" && rm -f ./- && timeout 300 "$fngen" bench -m "$fx" --backend cpu -p 8 -n 2 -r 1 \
    --warmup 0 --format json -o - >"$tmp/dash.json" 2>/dev/null) || fail "bench -o - run"
  [ -e "$tmp/-" ] && fail "bench -o -: wrote a file named '-'" || pass "bench -o -: no file '-'"
  check_json "$tmp/dash.json" "[(l['n_prompt'], l['n_gen']) for l in j['lanes']] == [(8, 2)]" \
    "bench -o -: the report on stdout"
  # One measured repetition is named in the singular.
  bench -p 8 -n 2 -r 1 --warmup 0 >"$tmp/r1.md" 2>/dev/null || fail "bench -r 1 md run"
  grep -q ", 1 repetition after 0 warmup," "$tmp/r1.md" && pass "md header: '1 repetition'" ||
    fail "md header with -r 1: $(head -n 1 "$tmp/r1.md")"
  # One repetition has no spread: the table says n/a, JSON null (not a standard deviation of 0).
  grep -Eq "^\| 8 \| 2 \| [0-9.]+ ± n/a \| [0-9.]+ ± n/a \|" "$tmp/r1.md" &&
    pass "md table with -r 1: TTFT and TPOT '± n/a'" ||
    fail "md table with -r 1: $(grep -E '^\| 8 ' "$tmp/r1.md")"
  check_json "$tmp/dec.json" "j['lanes'][0]['tpot_ms_std'] is None and j['lanes'][0]['ttft_ms_std'] is None" \
    "json with -r 1: tpot_ms_std and ttft_ms_std null"
  expect 2 "-p/--n-prompt 1000 -n/--n-gen 128 needs 1128 tokens, more than the model's max_position_embeddings 1024" -- bench -p 8,1000 -n 128
  expect 2 "-p/--n-prompt 16 -n/--n-gen 4 needs 20 tokens, more than -c/--ctx-size 12" -- bench -p 8,16 -n 4 -c 12
  expect 2 "-c/--ctx-size 2000 exceeds the model's max_position_embeddings 1024" -- bench -p 8 -n 4 -c 2000
  expect 2 "--bandwidth-gbs must be a positive" -- bench -p 8 -n 4 --bandwidth-gbs 0
  expect 3 "-o/--output /nonexistent-dir/x: cannot open" -- bench -p 8 -n 4 -o /nonexistent-dir/x
  # -o and --per-token naming one file (as typed, or after normalisation) would overwrite each
  # other: refused before either is opened, so an existing file keeps its bytes.
  echo keep >"$tmp/same.txt"
  mkdir -p "$tmp/sub"
  same="-o/--output $tmp/same.txt and --per-token"
  expect 2 "$same $tmp/same.txt name the same file" -- \
    bench -p 8 -n 4 -o "$tmp/same.txt" --per-token "$tmp/same.txt"
  expect 2 "$same $tmp/./sub/../same.txt name the same file" -- \
    bench -p 8 -n 4 -o "$tmp/same.txt" --per-token "$tmp/./sub/../same.txt"
  # ... or through a hard link, or a dangling symlink (opening it would create the other path).
  ln "$tmp/same.txt" "$tmp/same_hard.txt"
  expect 2 "$same $tmp/same_hard.txt name the same file" -- \
    bench -p 8 -n 4 -o "$tmp/same.txt" --per-token "$tmp/same_hard.txt"
  ln -s "$tmp/new_report.txt" "$tmp/dangling.txt"
  expect 2 "-o/--output $tmp/new_report.txt and --per-token $tmp/dangling.txt name the same file" -- \
    bench -p 8 -n 4 -o "$tmp/new_report.txt" --per-token "$tmp/dangling.txt"
  expect 2 "-o/--output $tmp/dangling.txt and --per-token $tmp/new_report.txt name the same file" -- \
    bench -p 8 -n 4 -o "$tmp/dangling.txt" --per-token "$tmp/new_report.txt"
  [ "$(cat "$tmp/same.txt")" = keep ] && pass "-o = --per-token: the file is left as it was" ||
    fail "-o = --per-token: $tmp/same.txt was written"
  [ -e "$tmp/new_report.txt" ] && fail "-o = --per-token (dangling link): $tmp/new_report.txt created" ||
    pass "-o = --per-token (dangling link): nothing created"
  # -o and --per-token never land in the model directory (a copy of the fixture): as typed, below
  # it, through a symlink (also a dangling one) or as a hard link of a checkpoint file; refused
  # before anything is opened, and the checkpoint stays byte for byte.
  cp -r "$fx" "$tmp/model"
  (cd "$tmp/model" && md5sum -- * >"$tmp/model.md5")
  ln -s "$tmp/model/config.json" "$tmp/to_config.json"
  ln -s "$tmp/model/new.jsonl" "$tmp/to_new.jsonl"
  ln "$tmp/model/model-bf16-00001.safetensors" "$tmp/hard_shard.bin"
  mbench() { timeout 300 "$fngen" bench -m "$tmp/model" --backend cpu -p 8 -n 4 -r 1 "$@"; }
  inside="inside the model directory $tmp/model"
  expect 2 "-o/--output $tmp/model/config.json: $inside; write it elsewhere" -- \
    mbench -o "$tmp/model/config.json"
  expect 2 "--per-token $tmp/model/model-bf16-00002.safetensors: $inside" -- \
    mbench --per-token "$tmp/model/model-bf16-00002.safetensors"
  expect 2 "-o/--output $tmp/model/sub/r.md: $inside" -- mbench -o "$tmp/model/sub/r.md"
  expect 2 "-o/--output $tmp/to_config.json: $inside (it resolves to .*/model/config.json)" -- \
    mbench -o "$tmp/to_config.json"
  expect 2 "--per-token $tmp/to_new.jsonl: $inside (it resolves to .*/model/new.jsonl)" -- \
    mbench --per-token "$tmp/to_new.jsonl"
  expect 2 "-o/--output $tmp/hard_shard.bin: the same file as model-bf16-00001.safetensors in the model directory" -- \
    mbench -o "$tmp/hard_shard.bin"
  if (cd "$tmp/model" && md5sum --quiet -c "$tmp/model.md5") && ! [ -e "$tmp/model/new.jsonl" ] &&
    ! [ -e "$tmp/model/sub" ]; then
    pass "-o/--per-token into the model directory: the checkpoint is unchanged"
  else
    fail "-o/--per-token into the model directory changed $tmp/model: $(ls "$tmp/model")"
  fi
  # A run that fails after the checks (a flag refused once the backend is known, a checkpoint
  # that does not load) leaves existing -o/--per-token files as they were: they are written only
  # when the results are ready.
  echo keep >"$tmp/keep.md"
  echo keep >"$tmp/keep_pt.jsonl"
  expect 2 "--skip-prefill needs the cuda backend (this run uses cpu)" -- \
    bench -p 8 -n 4 -o "$tmp/keep.md" --per-token "$tmp/keep_pt.jsonl" --skip-prefill
  cp -r "$fx" "$tmp/broken"
  truncate -s 100 "$tmp/broken/model-bf16-00002.safetensors"
  expect 3 "model-bf16-00002.safetensors" -- timeout 300 "$fngen" bench -m "$tmp/broken" \
    --backend cpu -p 8 -n 4 -o "$tmp/keep.md" --per-token "$tmp/keep_pt.jsonl"
  [ "$(cat "$tmp/keep.md" "$tmp/keep_pt.jsonl")" = "keep
keep" ] && pass "a failed bench leaves -o and --per-token as they were" ||
    fail "a failed bench changed -o/--per-token: $(head -c 200 "$tmp/keep.md")"
  # Results that cannot be written: exit 3, not 0. Real-number flags: no empty value as 0.
  expect_full 3 "cannot write to standard output" -- bench -p 8 -n 4 -r 1 --warmup 0
  expect 2 "--bandwidth-gbs: '' is not a decimal number" -- bench -p 8 -n 4 --bandwidth-gbs ""
  expect 2 "--bandwidth-gbs: '1e3x' is not a decimal number" -- bench -p 8 -n 4 --bandwidth-gbs 1e3x
  # The CUDA-only modes: refused on the cpu backend, and their flag combinations checked.
  expect 2 "give either -m/--model DIR or --random-weights --config FILE" -- \
    timeout 60 "$fngen" bench -p 8 -n 4 --backend cpu
  expect 2 "give either -m/--model DIR or --random-weights --config FILE (not both)" -- \
    bench -p 8 -n 4 --random-weights --config "$src/configs/tiny.json"
  expect 2 "--random-weights needs --config FILE" -- \
    timeout 60 "$fngen" bench -p 8 -n 4 --backend cpu --random-weights
  expect 2 "--config applies to --random-weights only" -- \
    bench -p 8 -n 4 --config "$src/configs/tiny.json"
  expect 2 "--random-weights needs the cuda backend" -- \
    timeout 60 "$fngen" bench -p 8 -n 4 --backend cpu --random-weights --config "$src/configs/tiny.json"
  expect 3 "/nonexistent.json" -- \
    timeout 60 "$fngen" bench -p 8 -n 4 --backend cpu --random-weights --config /nonexistent.json
  expect 2 "--skip-prefill needs the cuda backend (this run uses cpu)" -- bench -p 8 -n 4 --skip-prefill
  expect 2 "--breakdown needs the cuda backend (this run uses cpu)" -- bench -p 8 -n 4 --breakdown
  # Under mpirun the CUDA-only flags end every rank normally with rank 0's one message (they went
  # through MPI_Abort, whose banner Open MPI sometimes garbled), before any weights load.
  for flags in "--breakdown" "--skip-prefill" "--random-weights --config $src/configs/tiny.json"; do
    want="${flags%% *} needs the cuda backend"
    # shellcheck disable=SC2086
    if [ "${flags%% *}" = --random-weights ]; then
      expect 2 "$want" -- mpi_fngen 2 bench --backend cpu -p 8 -n 4 $flags
    else
      expect 2 "$want" -- mpi 2 -p 8 -n 4 $flags
    fi
    if [ "$(grep -c -- "$want" "$tmp/err")" = 1 ] && grep -q "^\[r0/2\]" "$tmp/err" &&
      ! grep -qE "MPI_ABORT|ORTE_ERROR_LOG|model loaded" "$tmp/err"; then
      pass "bench -np 2 $flags on cpu: one message from rank 0, no MPI_Abort, nothing loaded"
    else
      fail "bench -np 2 $flags on cpu: $(grep -v '^$' "$tmp/err" | head -n 8)"
    fi
  done
  expect 2 "--breakdown-steps: '0' is out of range (allowed 1 to 2147483647)" -- \
    bench -p 8 -n 4 --breakdown --breakdown-steps 0
  expect 2 "needs 84 tokens (72 for --breakdown), more than -c/--ctx-size 20" -- \
    bench -p 8 -n 4 --breakdown -c 20

  # --bandwidth-gbs: the reference changes and the output says where it came from.
  bench -p 8 -n 4 -r 1 --bandwidth-gbs 1000 --format json >"$tmp/bw.json" 2>/dev/null || fail "bw run"
  pycheck "--bandwidth-gbs 1000: % and floor against 1000 GB/s, source named" "$common
j = json.load(open(sys.argv[1])); l = j['lanes'][0]
need(j['bandwidth_gbs'] == 1000 and j['bandwidth_source'] == 'given with --bandwidth-gbs', 'source')
need(close(l['pct_of_bandwidth'], 100 * l['achieved_gbs'] / 1000), '%')
need(close(l['floor_ms'], l['bytes_per_token'] / 1e12 * 1e3), 'floor')
" "$tmp/bw.json"
else
  # ---- TP=2 through mpirun: rank 0 prints once ----
  if mpi 2 -p 8,16 -n 4 -r 2 --format jsonl >"$tmp/tp2.jsonl" 2>"$tmp/err"; then
    pycheck "mpirun -np 2: one jsonl record per lane (printed once), TP 2, bytes per rank = inspect --tp 2" "$common
ls = [json.loads(x) for x in open(sys.argv[1])]
need(len(ls) == 2, f'{len(ls)} lines (want 2: rank 0 only)')
for l in ls: check_run(l, 2); check_lane(l, 2, sys.argv[2], sys.argv[3], 2)
need(all(len(l['bytes_per_token_by_rank']) == 2 for l in ls), 'per-rank bytes')
" "$tmp/tp2.jsonl" "$fngen" "$fx"
  else
    fail "mpirun -np 2 bench exited non-zero: $(tail -n 3 "$tmp/err")"
  fi
  mpi 2 -p 8 -n 4 -r 1 >"$tmp/tp2.md" 2>"$tmp/err" || fail "mpirun -np 2 md run"
  n_head=$(grep -c "^| n_prompt" "$tmp/tp2.md")
  n_rows=$(grep -c "^| 8 | 4 |" "$tmp/tp2.md")
  if [ "$n_head" = 1 ] && [ "$n_rows" = 1 ] && grep -q "backend cpu, TP 2 (all-reduce mpi)" "$tmp/tp2.md"; then
    pass "mpirun -np 2: one md table, TP 2 over MPI"
  else
    fail "mpirun -np 2 md: $n_head headers, $n_rows rows: $(head -n 3 "$tmp/tp2.md")"
  fi
  expect 2 "-r/--repetitions: '0' is out of range (allowed 1 to" -- mpi 2 -p 8 -n 4 -r 0
  # Output guards at TP 2 (rank 0 checks, every rank ends non-zero), on a copy of the fixture.
  cp -r "$fx" "$tmp/model"
  ln -s "$tmp/model/config.json" "$tmp/to_config.json"
  expect 2 "-o/--output $tmp/to_config.json: inside the model directory $tmp/model" -- \
    mpi_fngen 2 bench -m "$tmp/model" --backend cpu -p 8 -n 4 -o "$tmp/to_config.json"
  cmp -s "$tmp/model/config.json" "$fx/config.json" && pass "np 2: config.json unchanged" ||
    fail "np 2: -o through a symlink changed config.json"
  echo keep >"$tmp/keep.md"
  expect 2 "--skip-prefill needs the cuda backend" -- mpi 2 -p 8 -n 4 -o "$tmp/keep.md" --skip-prefill
  [ "$(cat "$tmp/keep.md")" = keep ] && pass "np 2: a failed bench leaves -o as it was" ||
    fail "np 2: a failed bench changed -o: $(head -c 200 "$tmp/keep.md")"
  # A report that cannot be written (-o /dev/full, --per-token /dev/full): exit 3 on every rank,
  # rank 0's one message, no MPI_Abort.
  for flag in -o --per-token; do
    want="$flag"
    [ "$flag" = -o ] && want="-o/--output"
    expect 3 "$want /dev/full: write failed" -- mpi 2 -p 8 -n 4 -r 1 --warmup 0 "$flag" /dev/full
    if [ "$(grep -c -- "write failed" "$tmp/err")" = 1 ] && grep -q "^\[r0/2\]" "$tmp/err" &&
      ! grep -qE "MPI_ABORT|ORTE_ERROR_LOG" "$tmp/err"; then
      pass "bench -np 2 $flag /dev/full: one message from rank 0, no MPI_Abort"
    else
      fail "bench -np 2 $flag /dev/full: $(grep -v '^$' "$tmp/err" | head -n 8)"
    fi
  done
fi

if [ "$failures" -gt 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "all bench_cli ($mode) checks passed"
