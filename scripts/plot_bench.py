#!/usr/bin/python3
"""Plots of a `fngen bench` run (docs/performance.md), written as PNG files.

Usage: /usr/bin/python3 scripts/plot_bench.py BENCH.json [--per-token PT.jsonl] [-o OUTDIR]

BENCH.json is `fngen bench --format json` (an object with "lanes"; `--format jsonl` works too).
Writes into OUTDIR (default: the directory of BENCH.json):
  tpot_vs_floor.png         per lane: TPOT mean (with its std and ITL p99) next to the byte floor
                            (bytes per token per rank / the reference bandwidth);
  itl_p<P>_n<N>.png         with --per-token: the inter-token latency of every generated token
                            (token 2 .. n_gen; token 1's latency is the TTFT), one thin line per
                            repetition, the per-token median in bold, the lane's floor dashed;
  breakdown[_p<P>_n<N>].png when the JSON has a "breakdown" array (top level or per lane) of
                            {"family", "ms", "bytes"} (`fngen bench --breakdown`): ms per op
                            family next to its byte floor, and the eager time ("ms_eager") when
                            the rows have it; skipped with a note when there is none.
Needs python3-matplotlib (Debian; scripts/setup.sh installs it).
"""

import argparse
import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_report(path):
    """The run fields and the lane list of a json or jsonl report."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        lanes = [json.loads(line) for line in text.splitlines() if line.strip()]
        if not lanes:
            sys.exit(f"{path}: no lanes")
        return lanes[0], lanes
    if isinstance(doc, list):  # a json array of lane records
        return (doc[0] if doc else {}), doc
    if "lanes" not in doc and "n_prompt" in doc:  # a one-lane jsonl report
        return doc, [doc]
    if "lanes" not in doc:
        sys.exit(f'{path}: not a fngen bench report (no "lanes")')
    return doc, doc["lanes"]


def load_per_token(path):
    """{(n_prompt, n_gen): [itl list per repetition]} of a --per-token JSONL file."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            for k in ("n_prompt", "n_gen", "itl_ms"):
                if k not in r:
                    sys.exit(f'{path}: line {i}: no "{k}"')
            out.setdefault((r["n_prompt"], r["n_gen"]), []).append(r["itl_ms"])
    return out


def title_of(run):
    parts = [f"backend {run.get('backend', '?')}", f"TP {run.get('tp_size', '?')}"]
    if run.get("gpu", "none") != "none":
        parts.append(run["gpu"])
    if run.get("commit"):
        parts.append(f"commit {run['commit']}")
    return ", ".join(parts)


def plot_tpot_vs_floor(run, lanes, outdir):
    names = [f"p{l['n_prompt']}/n{l['n_gen']}" for l in lanes]
    x = range(len(lanes))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(lanes) + 3), 4.5))
    w = 0.27
    ax.bar([i - w for i in x], [l["tpot_ms"] for l in lanes], w,
           yerr=[l.get("tpot_ms_std") or 0 for l in lanes], capsize=3, label="TPOT mean ± std")
    ax.bar(list(x), [l["itl_p99_ms"] for l in lanes], w, label="ITL p99")
    ax.bar([i + w for i in x], [l["floor_ms"] for l in lanes], w,
           label=f"byte floor @ {run.get('bandwidth_gbs', '?')} GB/s")
    for i, l in enumerate(lanes):
        ax.annotate(f"{l['pct_of_bandwidth']:.3g}%", (i - w, l["tpot_ms"]), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_ylim(0, 1.15 * max(max(l["itl_p99_ms"], l["tpot_ms"] + (l.get("tpot_ms_std") or 0))
                              for l in lanes))
    ax.set_xticks(list(x))
    ax.set_xticklabels(names)
    ax.set_ylabel("ms per token")
    ax.set_title(f"fngen bench: time per output token vs the bandwidth floor\n{title_of(run)}",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(outdir, "tpot_vs_floor.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_itl(run, lane, reps, outdir):
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for k, itl in enumerate(reps):
        ax.plot(range(2, len(itl) + 2), itl, lw=0.6, alpha=0.45,
                label="each repetition" if k == 0 else None)
    n = min(len(r) for r in reps)
    med = [statistics.median(r[i] for r in reps) for i in range(n)]
    ax.plot(range(2, n + 2), med, lw=1.6, color="black", label="median over repetitions")
    if "floor_ms" in lane:
        ax.axhline(lane["floor_ms"], ls="--", color="tab:red",
                   label=f"byte floor {lane['floor_ms']:.4g} ms "
                         f"@ {run.get('bandwidth_gbs', '?')} GB/s")
    ax.set_xlabel("generated token (token 1's latency is the TTFT)")
    ax.set_ylabel("inter-token latency, ms")
    ax.set_ylim(bottom=0)
    ax.set_title(f"fngen bench: -p {lane['n_prompt']} -n {lane['n_gen']}, {len(reps)} "
                 f"repetitions; {title_of(run)}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(outdir, f"itl_p{lane['n_prompt']}_n{lane['n_gen']}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_breakdown(run, rows, suffix, outdir):
    bw = float(run.get("bandwidth_gbs", 4300))
    fams = [r["family"] for r in rows]
    ms = [float(r["ms"]) for r in rows]
    floor = [float(r["bytes"]) / (bw * 1e9) * 1e3 for r in rows]
    eager = [float(r["ms_eager"]) for r in rows] if all("ms_eager" in r for r in rows) else None
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 3), 4.5))
    w = 0.27 if eager else 0.4
    first = -w if eager else -w / 2
    ax.bar([i + first for i in x], ms, w, label="measured ms (in the graph)" if eager else
           "measured ms")
    if eager:
        ax.bar(list(x), eager, w, label="eager ms (host launch gaps included)", color="tab:gray")
    ax.bar([i + first + (2 if eager else 1) * w for i in x], floor, w,
           label=f"byte floor @ {bw:g} GB/s")
    for i, r in enumerate(rows):
        gbs = float(r["bytes"]) / (ms[i] * 1e-3) / 1e9 if ms[i] > 0 else 0.0
        ax.annotate(f"{gbs:.0f} GB/s\n{float(r['bytes']) / 1e6:.1f} MB", (i + first, ms[i]),
                    ha="center", va="bottom", fontsize=7, xytext=(0, 3),
                    textcoords="offset points")
    ax.set_ylim(0, 1.2 * max(ms + floor + (eager or [])))  # room for the labels
    ax.set_xticks(list(x))
    ax.set_xticklabels(fams, rotation=20, fontsize=8)
    ax.set_ylabel("ms per token")
    ax.set_title(f"fngen bench: per-op breakdown{suffix.replace('_', ' ')}; total "
                 f"{sum(ms):.3f} ms vs floor {sum(floor):.3f} ms\n{title_of(run)}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(outdir, f"breakdown{suffix}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def check_breakdown(rows, where):
    if not isinstance(rows, list) or not rows:
        sys.exit(f'{where}: "breakdown" must be a non-empty array')
    for i, r in enumerate(rows):
        for k in ("family", "ms", "bytes"):
            if k not in r:
                sys.exit(f'{where}: breakdown[{i}] has no "{k}"')


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report", help="fngen bench --format json (or jsonl) output")
    ap.add_argument("--per-token", help="fngen bench --per-token JSONL of the same run")
    ap.add_argument("-o", "--outdir", help="directory for the PNG files (default: the report's)")
    a = ap.parse_args()
    outdir = a.outdir or os.path.dirname(os.path.abspath(a.report))
    os.makedirs(outdir, exist_ok=True)
    run, lanes = load_report(a.report)
    written = [plot_tpot_vs_floor(run, lanes, outdir)]

    if a.per_token:
        per = load_per_token(a.per_token)
        for lane in lanes:
            reps = per.get((lane["n_prompt"], lane["n_gen"]))
            if reps:
                written.append(plot_itl(run, lane, reps, outdir))
            else:
                print(f"note: {a.per_token} has no record of lane -p {lane['n_prompt']} "
                      f"-n {lane['n_gen']}", file=sys.stderr)
    else:
        print("note: no --per-token file: inter-token latency plots skipped", file=sys.stderr)

    found = False
    if "breakdown" in run and run is not lanes[0]:
        check_breakdown(run["breakdown"], a.report)
        written.append(plot_breakdown(run, run["breakdown"], "", outdir))
        found = True
    for lane in lanes:
        if "breakdown" in lane:
            check_breakdown(lane["breakdown"], a.report)
            written.append(plot_breakdown(run, lane["breakdown"],
                                          f"_p{lane['n_prompt']}_n{lane['n_gen']}", outdir))
            found = True
    if not found:
        print('note: the report has no "breakdown" array: per-op breakdown plot skipped',
              file=sys.stderr)
    for p in written:
        print(p)


if __name__ == "__main__":
    main()
