#!/usr/bin/python3
"""Summarises a decode-step timeline (`cuda_model_bench --trace FILE.csv`, cuda/common/step_trace.h).

Usage: /usr/bin/python3 scripts/step_timeline.py TRACE.csv --steps N [--step K] [--top 25]

Each record is one CTA's pass through dev::pdl_wait(): when thread 0 arrived at the wait and
when the wait released it (ns). Per launch (one %gridid): the first arrival, the first release
(the predecessor's completion as this launch saw it), and how many CTAs arrived only after that
release (they were not resident when the predecessor finished). A launch's critical-path cost is
the next launch's first release minus its own: its run after release, its completion and the
wait's latency. The launches of the N traced steps are told apart by time (a graph replays its
nodes under the same %gridid, so the records of one id are split by time). Prints step K
(default: the middle one) launch by launch, then the cost per launch shape (grid x threads)
summed over the step and averaged over the steps. Bad input (a file that is not such a CSV, a
value that cannot come from the bench, options out of range, a trace that does not split into
N steps) exits non-zero with a one-line message.
Standard library only.
"""

import argparse
import collections
import csv
import signal
import statistics
import sys


COLUMNS = ("grid_id", "block", "grid", "threads", "sm", "arrive_ns", "release_ns")
GAP_NS = 1_000_000  # a release-time jump that starts a new instance of one grid id


def fail(message):
    """Exits with status 1 and the one-line `step_timeline: message`."""
    sys.exit(f"step_timeline: {message}")


def is_int(text):
    """Whether a CSV field is an integer."""
    try:
        int(text)
        return True
    except ValueError:
        return False


def read(path):
    """The records of a trace by grid id: {grid_id: [(arrive, release, block, grid, threads)]}.

    Exits with a one-line message where the file is not the CSV `cuda_model_bench --trace` writes:
    unreadable, binary or gzipped, no header or a column missing, a row with another number of
    fields, a value that is not an integer or a negative id, block, grid, threads or sm (the
    times are offsets: any sign), a release before its arrival, a block index past its grid, or
    no record at all.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    if magic == b"\x1f\x8b":
        fail(f"{path} is gzip-compressed (scripts/gpu/trace_run.sh writes trace.csv.gz):"
             " gunzip it first")
    by_grid = collections.defaultdict(list)
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader, [])]
            if not header:
                fail(f"{path} is empty (expected the header {','.join(COLUMNS)})")
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                fail(f"{path}: the header lacks {', '.join(missing)}"
                     f" (expected {','.join(COLUMNS)})")
            idx = [header.index(c) for c in COLUMNS]
            for row in reader:
                if not row:
                    continue  # a blank line
                where = f"{path} line {reader.line_num}"
                if len(row) != len(header):
                    fail(f"{where}: {len(row)} fields, the header has {len(header)}")
                try:
                    v = [int(row[i]) for i in idx]
                except ValueError:
                    c, i = next((c, i) for c, i in zip(COLUMNS, idx) if not is_int(row[i]))
                    fail(f"{where}: {c} is {row[i][:40]!r}, not an integer")
                gid, block, grid, threads, sm, arrive, release = v
                if min(gid, block, grid, threads, sm) < 0:  # the times are offsets, any sign
                    c, x = next((c, x) for c, x in zip(COLUMNS, v) if x < 0)
                    fail(f"{where}: {c} is {x}, negative")
                if release < arrive:
                    fail(f"{where}: release_ns {release} before arrive_ns {arrive}")
                if block >= grid:
                    fail(f"{where}: block {block} not below grid {grid}")
                by_grid[gid].append((arrive, release, block, grid, threads))
        except UnicodeDecodeError:
            fail(f"{path} is not UTF-8 text (a binary file?)")
        except csv.Error as e:
            fail(f"{path} line {reader.line_num}: {e}")
    if not by_grid:
        fail(f"{path} has no records, only the header")
    return by_grid


def load(path, steps):
    """The launches of every step, each a list ordered by first release, and how many grid ids
    were left out.

    A CUDA graph replays its nodes under the same %gridid, so one id holds one launch per step:
    its records are split where the release time jumps by more than a millisecond (a step takes
    ~5 ms, a launch's CTAs are released within microseconds), and instance s goes to step s.
    Exits with a one-line message when no id splits into `steps` instances or a launch's records
    disagree on its shape.
    """
    split = {}  # grid_id -> its instances, each a list of records ordered by release
    for gid, recs in read(path).items():
        recs.sort(key=lambda r: r[1])
        instances, cur = [], [recs[0]]
        for r in recs[1:]:
            if r[1] - cur[-1][1] > GAP_NS:
                instances.append(cur)
                cur = []
            cur.append(r)
        instances.append(cur)
        split[gid] = instances
    kept = {gid: inst for gid, inst in split.items() if len(inst) == steps}
    if not kept:  # a launch outside the replayed graph has another count; all of them cannot
        counts = collections.Counter(len(inst) for inst in split.values())
        seen = ", ".join(f"{n} in {counts[n]} ids" for n in sorted(counts)[:8])
        fail(f"no launch id splits into {steps} steps at release gaps > 1 ms (instances per id:"
             f" {seen}); is --steps the run's --trace-steps?")
    per_step = [[] for _ in range(steps)]
    for gid, instances in kept.items():
        for s, inst in enumerate(instances):
            first = {}  # block -> its first pass
            for r in inst:
                if r[2] not in first or r[0] < first[r[2]][0]:
                    first[r[2]] = r
            cta = list(first.values())
            shapes = {(r[3], r[4]) for r in cta}
            if len(shapes) > 1:
                seen = ", ".join(f"{g}x{t}" for g, t in sorted(shapes)[:4])
                fail(f"grid_id {gid}: its records disagree on the launch shape (grid x threads):"
                     f" {seen}")
            release = min(r[1] for r in cta)
            per_step[s].append({
                "grid_id": gid,
                "shape": f"{cta[0][3]}x{cta[0][4]}",
                "ctas": len(cta),
                "arrive": min(r[0] for r in cta),
                "release": release,
                "last_release": max(r[1] for r in cta),
                "late": sum(1 for r in cta if r[0] > release),
            })
    for step in per_step:
        step.sort(key=lambda l: (l["release"], l["grid_id"]))
    return per_step, len(split) - len(kept)


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the output, not a traceback
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, required=True, help="the --trace-steps of the run")
    ap.add_argument("--step", type=int, default=-1, help="the step printed launch by launch")
    ap.add_argument("--top", type=int, default=25, help="rows of the per-shape table")
    args = ap.parse_args()
    if args.steps < 1:
        fail("--steps must be >= 1")
    if args.step < -1:
        fail(f"--step {args.step}: must be >= 0, or -1 for the middle step")
    if args.step >= args.steps:
        fail(f"--step {args.step} past the {args.steps} steps")
    if args.top < 1:
        fail(f"--top {args.top}: must be >= 1")
    steps, skipped = load(args.trace, args.steps)
    per = len(steps[0])  # every kept id adds one launch to each step
    k = args.step if args.step >= 0 else args.steps // 2

    def costs(step):
        return [step[i + 1]["release"] - step[i]["release"] for i in range(len(step) - 1)]

    spans = [(s[-1]["release"] - s[0]["release"]) / 1e3 for s in steps]
    print(f"{per} launches per step ({skipped} launch ids outside the {args.steps} replays left"
          " out); first-to-last release per step (us): "
          + ", ".join(f"{x:.1f}" for x in spans))
    step = steps[k]
    c = costs(step)
    t0 = step[0]["release"]
    print(f"\nstep {k}, launch by launch (us from the step's first release; cost = next release"
          " - this release):")
    print("| # | shape | CTAs | late CTAs | arrive | release | last release | cost |")
    print("|---|---|---|---|---|---|---|---|")
    for i, l in enumerate(step):
        cost = f"{c[i] / 1e3:.2f}" if i < len(c) else "-"
        print(f"| {i} | {l['shape']} | {l['ctas']} | {l['late']} | {(l['arrive'] - t0) / 1e3:.2f}"
              f" | {(l['release'] - t0) / 1e3:.2f} | {(l['last_release'] - t0) / 1e3:.2f} |"
              f" {cost} |")

    by_shape = collections.defaultdict(list)  # shape -> per-step summed cost (us)
    count = collections.Counter()
    late = collections.Counter()
    for s in steps:
        acc = collections.Counter()
        for i, cost in enumerate(costs(s)):
            acc[s[i]["shape"]] += cost / 1e3
        for shape, v in acc.items():
            by_shape[shape].append(v)
    for l in step:
        count[l["shape"]] += 1
        late[l["shape"]] += l["late"]
    # The same cost keyed by (previous launch's shape -> this shape): launches of one shape with
    # different roles (an HC mix, an out GEMV and the routed down can all be 320 x 256) mostly
    # follow different launches.
    by_pair = collections.defaultdict(list)
    for i, cost in enumerate(c):
        prev = step[i - 1]["shape"] if i > 0 else "start"
        by_pair[f"{prev} -> {step[i]['shape']}"].append(cost / 1e3)
    print(f"\nstep {k}, cost by (previous shape -> shape), us:")
    print("| launch | launches | us per launch (mean) | min | max | us in the step |")
    print("|---|---|---|---|---|---|")
    for key, v in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
        print(f"| {key} | {len(v)} | {statistics.mean(v):.2f} | {min(v):.2f} | {max(v):.2f} |"
              f" {sum(v):.1f} |")
    rows = sorted(by_shape.items(), key=lambda kv: -statistics.mean(kv[1]))
    print(f"\ncost per launch shape, summed over a step (mean over {args.steps} steps), us:")
    print("| shape | launches per step | us per step | us per launch | late CTAs per launch |")
    print("|---|---|---|---|---|")
    for shape, v in rows[:args.top]:
        m = statistics.mean(v)
        n = count[shape] or 1
        print(f"| {shape} | {count[shape]} | {m:.1f} | {m / n:.2f} | {late[shape] / n:.1f} |")


if __name__ == "__main__":
    main()
