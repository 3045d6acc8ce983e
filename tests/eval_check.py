#!/usr/bin/env python3
"""Independent checks for tests/eval_cli.sh (numpy only): recomputes from the reference fixtures' logits.bin and from
the reference-logits files what `fngen eval` must report, and compares with its --json output. Each check prints one
"ok:" line or raises. Usage: eval_check.py CHECK ARGS... (see the functions below)."""
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "reference"))
import dump_reference_logits as drl  # noqa: E402  (the file half: reader/writer)


def fixture(fx):
    with open(os.path.join(fx, "expected.json")) as f:
        e = json.load(f)
    steps = e["decode_steps"]
    tokens = e["prompt_ids"] + e["generated_ids"][:steps]
    rows = np.fromfile(os.path.join(fx, "logits.bin"), dtype="<f4").reshape(e["logits"]["shape"])
    return e, tokens, rows


def logsoftmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def rel(a, b):
    return abs(a - b) / abs(b)


def kld_fixture(fx, out_json, label):
    """kld --base <fixture converted>: KL mean <= 1e-5, same top-1 100 %, PPL(Q) = exp(mean NLL of the reference)."""
    e, tokens, rows = fixture(fx)
    targets = tokens[1:] + [e["generated_ids"][e["decode_steps"]]]
    lp = logsoftmax(rows)
    ref_ppl = math.exp(-np.mean([lp[p, t] for p, t in enumerate(targets)]))
    j = json.load(open(out_json))
    assert j["count"] == len(tokens) and j["count_nll"] == len(tokens), (j["count"], len(tokens))
    assert j["kld"]["mean"] <= 1e-5, j["kld"]
    assert j["same_top1"] == 1.0, j["same_top1"]
    assert rel(j["ppl_q"]["value"], ref_ppl) <= 1e-4, (j["ppl_q"], ref_ppl)
    assert rel(j["ppl_base"]["value"], ref_ppl) <= 1e-12, (j["ppl_base"], ref_ppl)
    print(f"ok: {label}: KLD mean {j['kld']['mean']:.3e} (max {j['kld']['max']:.3e}), same top-1 100 %, "
          f"PPL(Q) {j['ppl_q']['value']:.6f} vs exp(mean NLL of the reference) {ref_ppl:.6f} "
          f"(rel {rel(j['ppl_q']['value'], ref_ppl):.1e})")


def ppl_fixture(fx, out_json, ctx, label):
    """eval ppl --ids-file <fixture tokens> -c ctx (one window starting at 0): PPL = exp(mean NLL) of the reference rows
    ctx/2 .. ctx-2 with targets tokens[p+1]."""
    e, tokens, rows = fixture(fx)
    ctx = int(ctx)
    first = ctx // 2
    lp = logsoftmax(rows)
    nll = [-lp[p, tokens[p + 1]] for p in range(first, ctx - 1)]
    ref = math.exp(np.mean(nll))
    n = len(nll)
    sd = math.sqrt(max(0.0, np.mean(np.square(nll)) - np.mean(nll) ** 2) / (n - 1))
    j = json.load(open(out_json))
    assert j["n_chunks"] == 1 and j["n_scored"] == n, j
    assert rel(j["ppl"], ref) <= 1e-4, (j["ppl"], ref)
    assert rel(j["ppl_err"], ref * sd) <= 1e-3, (j["ppl_err"], ref * sd)
    print(f"ok: {label}: PPL {j['ppl']:.6f} ± {j['ppl_err']:.5f} vs exp(mean NLL) of the reference {ref:.6f} "
          f"(rel {rel(j['ppl'], ref):.1e}, {n} tokens)")


def dump_fixture(fx, path, label):
    """dump-logits of prompt ++ continuation: every row within the CPU backend's tolerance of the reference
    (1e-4 * max |logit|, test_cpu_model's), and the header the C++ writer wrote reads here."""
    e, tokens, rows = fixture(fx)
    h, arrays = drl.read_logits_file(path)
    assert h["tokenizer"] == "ids-only" and h["n_positions"] == len(tokens) and h["values"] == "logits"
    assert h["sequences"] == [{"tokens": tokens, "first": 0, "n_rows": len(tokens), "next_token": -1}]
    got = arrays["values"].astype(np.float64)
    diff = np.abs(got - rows).max()
    assert diff <= 1e-4 * np.abs(rows).max(), diff
    assert (got.argmax(1) == rows.argmax(1)).all()
    print(f"ok: {label}: {len(tokens)} rows, max |fngen - reference| {diff:.2e}")


def kld_mode(base, dump, out_json, label):
    """kld against a python-written base (float16 / top-K): recompute every statistic here from the file's values and
    fngen's own float32 logits (its dump-logits file of the same sequence) and compare."""
    h, a = drl.read_logits_file(base)
    _, d = drl.read_logits_file(dump)
    q = logsoftmax(d["values"])
    seq = h["sequences"][0]
    n = h["n_positions"]
    targets = [drl.target_of(seq, p) for p in range(n)]
    if h["mode"] == "full":
        v = a["values"].astype(np.float64)
        p = logsoftmax(v)  # fngen re-normalises every full row, log-probs included
        kl = (np.exp(p) * (p - q)).sum(1)
        top = p.argmax(1)
        base_t = np.array([p[i, t] for i, t in enumerate(targets)])
    else:
        ids = a["topk_ids"].astype(np.int64)
        p = a["topk_logprobs"].astype(np.float64)
        qk = np.take_along_axis(q, ids, 1)
        r = a["residual_mass"].astype(np.float64)
        rq = np.maximum(1.0 - np.exp(qk).sum(1), np.finfo(np.float64).tiny)
        kl = (np.exp(p) * (p - qk)).sum(1) + np.where(r > 0, r * (np.log(np.where(r > 0, r, 1)) - np.log(rq)), 0)
        top = ids[:, 0]
        base_t = a["target_logprob"].astype(np.float64)
    same = float((q.argmax(1) == top).mean())
    ppl_base = math.exp(-base_t.mean())
    j = json.load(open(out_json))
    assert abs(j["kld"]["mean"] - kl.mean()) <= 1e-9 + 1e-6 * abs(kl.mean()), (j["kld"]["mean"], kl.mean())
    assert abs(j["kld"]["max"] - kl.max()) <= 1e-9 + 1e-6 * abs(kl.max()), (j["kld"]["max"], kl.max())
    assert j["same_top1"] == same, (j["same_top1"], same)
    assert rel(j["ppl_base"]["value"], ppl_base) <= 1e-9, (j["ppl_base"], ppl_base)
    print(f"ok: {label}: KLD mean {kl.mean():.3e} max {kl.max():.3e}, same top-1 {100 * same:.1f} %, "
          f"PPL(base) {ppl_base:.4f}: fngen's numbers equal the recomputation")


def write_foreign(fx, out):
    """A valid base file whose tokenizer identity names some other tokenizer.json."""
    seqs, rows, vocab, src = drl.from_fixture(fx)
    drl.write_logits_file(out, seqs, rows, vocab, "fnv1a64:tokenizer.json:0123456789abcdef", source=src)


def tokenizer_id(model_dir, want_file):
    """The python FNV-1a id of a tokenizer equals the one fngen recorded (a ppl --save-logits header)."""
    h, _ = drl.read_logits_file(want_file)
    mine = drl.tokenizer_id(model_dir)
    assert h["tokenizer"] == mine, (h["tokenizer"], mine)
    print(f"ok: tokenizer identity {mine} is the same in fngen and in the python writer")


def score(out_jsonl, summary_json):
    recs = [json.loads(x) for x in open(out_jsonl) if x.strip()]
    s = json.load(open(summary_json))["summary"]
    by_id = {r["id"]: r for r in recs}
    assert by_id["regex-right"]["correct"] and by_id["exact-right"]["correct"], recs
    assert not by_id["wrong"]["correct"] and "error" in by_id["no-answer"], recs
    assert s["total"] == {"n": 4, "correct": 2, "errors": 1, "accuracy": 0.5}, s
    assert s["tasks"]["ids"]["n"] == 3 and s["tasks"]["ids"]["correct"] == 2, s
    print(f"ok: score: {len(recs)} records, total accuracy 0.5 with one error record")


if __name__ == "__main__":
    globals()[sys.argv[1].replace("-", "_")](*sys.argv[2:])
