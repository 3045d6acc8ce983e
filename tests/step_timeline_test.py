#!/usr/bin/python3
"""scripts/step_timeline.py on a hand-made trace (the CSV of `cuda_model_bench --trace`).

Two steps of three launches, replayed under the same grid ids as a CUDA graph does, with known
release times: launch costs 5, 12 and 9 us, one CTA of the third launch arriving after the
first release. Checks the per-step span, the launch-by-launch table, the cost tables, and the
errors for a trace that does not split into the steps asked for.
"""

import os
import re
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts",
                      "step_timeline.py")


def write_trace(path, steps=2, extra_instance=False):
    rows = ["grid_id,block,grid,threads,sm,arrive_ns,release_ns"]
    launches = [(11, 4, 256, 5000), (12, 3, 352, 12000), (13, 5, 256, 9000)]
    t = 0
    for _ in range(steps):
        for gid, grid, threads, cost in launches:
            for b in range(grid):
                late = gid == 13 and b == 4  # one CTA of launch 13 arrives after the release
                arrive = t + 3000 if late else t - 2000
                release = t + 3500 if late else t + 10 * b  # released within 40 ns of each other
                rows.append(f"{gid},{b},{grid},{threads},{b},{arrive},{release}")
            t += cost
        t += 2_000_000  # the host's gap between two steps
    if extra_instance:  # launch 12 once more, 5 ms later: a third instance of one id
        rows.append(f"12,0,3,352,0,{t + 5_000_000},{t + 5_000_000}")
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")


def run(path, *args):
    return subprocess.run([sys.executable, SCRIPT, path, *args], capture_output=True, text=True)


def main():
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "trace.csv")
        write_trace(trace)
        r = run(trace, "--steps", "2")
        check(r.returncode == 0, f"exit {r.returncode}: {r.stderr}")
        out = r.stdout
        check("3 launches per step (0 launch ids outside the 2 replays left out)" in out,
              "launch count line")
        check("first-to-last release per step (us): 17.0, 17.0" in out, "step spans")
        # Launch-by-launch rows of step 1: shape, CTAs, late CTAs, arrive, release, last, cost.
        check("| 0 | 4x256 | 4 | 0 | -2.00 | 0.00 | 0.03 | 5.00 |" in out, "row 0")
        check("| 1 | 3x352 | 3 | 0 | 3.00 | 5.00 | 5.02 | 12.00 |" in out, "row 1")
        check("| 2 | 5x256 | 5 | 1 | 15.00 | 17.00 | 20.50 | - |" in out, "row 2 (late CTA)")
        check("| start -> 4x256 | 1 | 5.00 | 5.00 | 5.00 | 5.0 |" in out, "pair start")
        check("| 4x256 -> 3x352 | 1 | 12.00 | 12.00 | 12.00 | 12.0 |" in out, "pair 1")
        check(re.search(r"\| 3x352 \| 1 \| 12\.0 \| 12\.00 \| 0\.0 \|", out) is not None,
              "per-shape row")
        r = run(trace, "--steps", "2", "--step", "0")
        check(r.returncode == 0 and "step 0, launch by launch" in r.stdout, "--step 0")
        r = run(trace, "--steps", "2", "--step", "2")
        check(r.returncode != 0 and "past the 2 steps" in r.stderr, "--step past the end")
        r = run(trace, "--steps", "3")
        check(r.returncode != 0 and "launches per step differ" in r.stderr,
              f"wrong --steps: {r.returncode} {r.stderr}")
        write_trace(trace, extra_instance=True)
        r = run(trace, "--steps", "2")
        check(r.returncode == 0 and "2 launches per step (1 launch ids outside" in r.stdout,
              f"an id with a third instance is left out: {r.stdout[:200]} {r.stderr}")
    for f in failures:
        print(f"FAILED: {f}")
    print(f"step_timeline_test: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
