#!/usr/bin/python3
"""Summarises a decode-step timeline (`cuda_model_bench --trace FILE.csv`, cuda/step_trace.h).

Usage: /usr/bin/python3 scripts/step_timeline.py TRACE.csv --steps N [--step K] [--top 25]

Each record is one CTA's pass through dev::pdl_wait(): when thread 0 arrived at the wait and
when the wait released it (ns). Per launch (one %gridid): the first arrival, the first release
(the predecessor's completion as this launch saw it), and how many CTAs arrived only after that
release (they were not resident when the predecessor finished). A launch's critical-path cost is
the next launch's first release minus its own: its run after release, its completion and the
wait's latency. The launches of the N traced steps are told apart by time (a graph replays its nodes under the same %gridid, so the records of
one id are split by time). Prints step K (default: the middle one) launch by launch, then the
cost per launch shape (grid x threads) summed over the step and averaged over the steps.
Standard library only.
"""

import argparse
import collections
import csv
import statistics
import sys


def load(path, steps):
    """The launches of every step, each a list ordered by first release.

    A CUDA graph replays its nodes under the same %gridid, so one id holds one launch per step:
    its records are split where the release time jumps by more than a millisecond (a step takes
    ~5 ms, a launch's CTAs are released within microseconds), and instance s goes to step s.
    """
    by_grid = collections.defaultdict(list)  # grid_id -> [(arrive, release, block, grid, threads)]
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            by_grid[int(row["grid_id"])].append(
                (int(row["arrive_ns"]), int(row["release_ns"]), int(row["block"]),
                 int(row["grid"]), int(row["threads"])))
    per_step = [[] for _ in range(steps)]
    skipped = 0
    for gid, recs in by_grid.items():
        recs.sort(key=lambda r: r[1])
        instances, cur = [], [recs[0]]
        for r in recs[1:]:
            if r[1] - cur[-1][1] > 1_000_000:
                instances.append(cur)
                cur = []
            cur.append(r)
        instances.append(cur)
        if len(instances) != steps:  # a launch outside the replayed graph
            skipped += 1
            continue
        for s, inst in enumerate(instances):
            first = {}  # block -> its first pass
            for r in inst:
                if r[2] not in first or r[0] < first[r[2]][0]:
                    first[r[2]] = r
            cta = list(first.values())
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
    return per_step, skipped


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, required=True, help="the --trace-steps of the run")
    ap.add_argument("--step", type=int, default=-1, help="the step printed launch by launch")
    ap.add_argument("--top", type=int, default=25, help="rows of the per-shape table")
    args = ap.parse_args()
    if args.steps < 1:
        sys.exit("step_timeline: --steps must be >= 1")
    steps, skipped = load(args.trace, args.steps)
    per = len(steps[0])
    if per == 0 or any(len(s) != per for s in steps):
        sys.exit(f"step_timeline: launches per step differ: {[len(s) for s in steps]}")
    k = args.step if args.step >= 0 else args.steps // 2
    if k >= args.steps:
        sys.exit(f"step_timeline: --step {k} past the {args.steps} steps")

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
    for i, cost in enumerate(costs(step)):
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
