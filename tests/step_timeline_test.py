#!/usr/bin/python3
"""scripts/step_timeline.py on a hand-made trace (the CSV of `cuda_model_bench --trace`).

Two steps of three launches, replayed under the same grid ids as a CUDA graph does, with known
release times: launch costs 5, 12 and 9 us, one CTA of the third launch arriving after the
first release. Checks the per-step span, the launch-by-launch table, the cost tables, the
errors for a trace that does not split into the steps asked for, and the one-line errors (exit
1, no traceback) for bad input: unreadable, empty, binary or gzipped files, a missing column, a
short row, values that are not integers or cannot come from the bench, and options out of range.
"""

import gzip
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


def bad_input(d, check):
    """Each bad input exits 1 with its one-line `step_timeline: ...` message, no traceback."""
    good = os.path.join(d, "good.csv")
    write_trace(good)
    with open(good) as f:
        header, *rows = f.read().splitlines()

    def fails(what, path, text, *args):
        r = run(path, *(args or ("--steps", "2")))
        err = r.stderr.strip()
        check(r.returncode == 1 and err.startswith("step_timeline: ") and text in err
              and "\n" not in err and "Traceback" not in r.stderr,
              f"{what}: exit {r.returncode}, stderr {r.stderr[-300:]!r}")

    def trace(name, lines):
        path = os.path.join(d, name)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def edit(row, column, value):  # one field of a row changed
        fields = row.split(",")
        fields[header.split(",").index(column)] = value
        return ",".join(fields)

    fails("missing file", os.path.join(d, "none.csv"), "cannot read")
    fails("directory", d, "Is a directory")
    fails("empty file", trace("empty.csv", []), "is empty (expected the header grid_id,")
    fails("header only", trace("header.csv", [header]), "has no records, only the header")
    no_sm = [",".join(f for i, f in enumerate(r.split(",")) if i != 4) for r in [header, *rows]]
    fails("missing column", trace("col.csv", no_sm), "the header lacks sm")
    fails("short row", trace("short.csv", [header, rows[0], "12,0,3"]),
          "line 3: 3 fields, the header has 7")
    fails("long row", trace("long.csv", [header, rows[0] + ",9"]),
          "line 2: 8 fields, the header has 7")
    fails("not a number", trace("abc.csv", [header, edit(rows[0], "block", "abc")]),
          "line 2: block is 'abc', not an integer")
    fails("sm not a number", trace("sm.csv", [header, edit(rows[0], "sm", "x")]),
          "sm is 'x', not an integer")
    fails("a float time", trace("float.csv", [header, edit(rows[0], "release_ns", "1.5")]),
          "release_ns is '1.5', not an integer")
    fails("negative grid", trace("neg.csv", [header, edit(rows[0], "grid", "-4")]),
          "grid is -4, negative")
    early = edit(rows[0], "release_ns", "-3000")  # its arrival is -2000
    fails("release before arrival", trace("swap.csv", [header, early]),
          "release_ns -3000 before arrive_ns -2000")
    fails("block past its grid", trace("block.csv", [header, edit(rows[0], "block", "4")]),
          "block 4 not below grid 4")
    fails("two shapes in a launch", trace("shape.csv", [header, rows[0],
                                                        edit(rows[1], "threads", "128")]
                                          + rows[2:]),
          "grid_id 11: its records disagree on the launch shape (grid x threads): 4x128, 4x256")
    fails("all ids in one instance", trace("one.csv", [header] + rows[:12]),
          "no launch id splits into 2 steps at release gaps > 1 ms (instances per id: 1 in 3")
    # (not 10**10: the script before this check allocated a list per step: 560 GB)
    fails("huge --steps", good, "no launch id splits into 1000000 steps", "--steps", "1000000")
    binary = os.path.join(d, "binary.bin")
    with open(binary, "wb") as f:
        f.write(bytes(range(128, 256)) * 8)
    fails("binary file", binary, "is not UTF-8 text")
    with open(good, "rb") as f, gzip.open(binary, "wb") as g:
        g.write(f.read())
    fails("gzipped file", binary, "is gzip-compressed")
    fails("--steps 0", good, "--steps must be >= 1", "--steps", "0")
    fails("--step -2", good, "--step -2: must be >= 0, or -1 for the middle step",
          "--steps", "2", "--step", "-2")
    fails("--top 0", good, "--top 0: must be >= 1", "--steps", "2", "--top", "0")
    fails("--top -1", good, "--top -1: must be >= 1", "--steps", "2", "--top", "-1")
    r = run(trace("bom.csv", ["\ufeff" + header.replace(",", ", ")] + rows), "--steps", "2")
    check(r.returncode == 0 and "3 launches per step" in r.stdout,
          f"a BOM and spaces in the header: {r.returncode} {r.stderr[-200:]}")


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
        check(r.returncode != 0 and "no launch id splits into 3 steps" in r.stderr
              and "(instances per id: 2 in 3 ids)" in r.stderr,
              f"wrong --steps: {r.returncode} {r.stderr}")
        write_trace(trace, extra_instance=True)
        r = run(trace, "--steps", "2")
        check(r.returncode == 0 and "2 launches per step (1 launch ids outside" in r.stdout,
              f"an id with a third instance is left out: {r.stdout[:200]} {r.stderr}")
        bad_input(d, check)
    for f in failures:
        print(f"FAILED: {f}")
    print(f"step_timeline_test: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
