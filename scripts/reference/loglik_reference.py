#!/usr/bin/env python3
"""Reference log-likelihoods for `fngen eval loglik` from transformers' `qwen4_exp`.

For every item of a loglik JSONL file with token ids ({"id", "context_ids", "choices": [[ids]...], "answer", "task"}),
the summed natural-log probability of each choice's tokens given the context (lm-evaluation-harness' loglikelihood
request: log p(c_0 | context) + log p(c_1 | context, c_0) + ...), its token count, and whether every token was the
argmax of its row (greedy match), computed in float64 from FP32 logits. Written as one JSON object:
    {"source": {...}, "items": [{"id", "choices": [{"logprob", "n_tokens", "greedy"}], "pred", "pred_norm"}]}
(pred/pred_norm: the choice with the largest summed log-prob, resp. log-prob per token; ids-only items normalise by
token count, as fngen does without a tokenizer.) The CPU test test_eval_loglik checks fngen's numbers against it.

Two sources of logits:
  * `--model DIR` (the GPU machine, where torch and transformers with qwen4_exp are): the checkpoint loaded as
    dump_reference_logits.py loads it (Qwen4ExpForCausalLM in FP32, eager attention and experts), each context ++
    choice run once without a cache.
  * `--from-fixture DIR` (numpy only; runs anywhere): the rows of a reference fixture's logits.bin
    (tests/data/fixtures/README.md), which transformers wrote for the fixture's one token sequence; `--make-items`
    then writes items whose contexts are prefixes of that sequence and whose choices are continuations of it of
    different lengths (the only continuations the stored rows score), so no model needs to run.

Examples:
    /usr/bin/python3 scripts/reference/loglik_reference.py --from-fixture tests/data/fixtures/tp4 \
        --make-items tests/data/eval/loglik_tp4.jsonl --out tests/data/eval/loglik_tp4.expected.json
    python3 scripts/reference/loglik_reference.py --model DIR --items tests/data/eval/loglik_tp4.jsonl --out ref.json
"""
import argparse
import json
import math
import os
import sys

import numpy as np


def log_softmax(row):
    r = row.astype(np.float64)
    m = r.max()
    return r - (m + math.log(np.exp(r - m).sum()))


def score(rows_fn, items):
    """rows_fn(tokens) -> [len(tokens), V] FP32 logits of the sequence run from a fresh state."""
    out = []
    for it in items:
        ctx = it["context_ids"]
        res = []
        for ch in it["choices"]:
            rows = rows_fn(ctx + ch)
            lp, greedy = 0.0, True
            for j, t in enumerate(ch):
                row = rows[len(ctx) - 1 + j]
                lp += float(log_softmax(row)[t])
                # argmax ties to the lowest id, as fngen's
                greedy = greedy and int(np.argmax(row)) == t
            res.append({"logprob": lp, "n_tokens": len(ch), "greedy": greedy})
        ll = [c["logprob"] for c in res]
        norm = [c["logprob"] / c["n_tokens"] for c in res]
        out.append({"id": it["id"], "choices": res, "pred": int(np.argmax(ll)), "pred_norm": int(np.argmax(norm))})
    return out


def fixture_rows(fx_dir):
    with open(os.path.join(fx_dir, "expected.json")) as f:
        e = json.load(f)
    steps = int(e["decode_steps"])
    tokens = list(e["prompt_ids"]) + list(e["generated_ids"][:steps])
    shape = e["logits"]["shape"]
    rows = np.fromfile(os.path.join(fx_dir, e["logits"]["file"]), dtype="<f4").reshape(shape)
    src = {"producer": "loglik_reference.py --from-fixture", "fixture": e["name"], "reference": e["reference"],
           "transformers_version": e["transformers_version"], "torch_version": e["torch_version"]}
    return tokens, rows, src


def fixture_items(tokens):
    """Contexts = prefixes of the fixture's sequence; choices = its continuations of 1, 3 and 6 tokens (the answer is
    the index given, the scores decide acc). The context lengths straddle the prompt/decode boundary and a QSA block
    boundary (indexer_compress_ratio 4) so that snapshot/restore is exercised at several states."""
    items = []
    for i, (k, answer) in enumerate([(1, 0), (5, 1), (13, 2), (24, 0), (38, 1), (41, 2), (57, 0)]):
        choices = [tokens[k:k + n] for n in (1, 3, 6)]
        items.append({"id": f"fx{i}", "task": "fixture" if i % 2 == 0 else "fixture_b", "context_ids": tokens[:k],
                      "choices": choices, "answer": answer})
    return items


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (transformers)")
    ap.add_argument("--from-fixture", help="a reference fixture's stored rows instead of a model")
    ap.add_argument("--items", help="loglik JSONL with context_ids and id choices")
    ap.add_argument("--make-items", help="with --from-fixture: write the fixture's items here and score them")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.from_fixture:
        tokens, rows, src = fixture_rows(a.from_fixture)
        if a.make_items:
            items = fixture_items(tokens)
            with open(a.make_items, "w") as f:
                for it in items:
                    f.write(json.dumps(it) + "\n")
        else:
            with open(a.items) as f:
                items = [json.loads(l) for l in f if l.strip()]

        def rows_fn(seq):
            assert seq == tokens[:len(seq)], "a fixture scores only continuations of its own sequence"
            return rows[:len(seq)]
    else:
        assert a.model and a.items, "--model with --items, or --from-fixture"
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import dump_reference_logits as drl  # noqa: E402  (the checkpoint loading of the reference)
        with open(a.items) as f:
            items = [json.loads(l) for l in f if l.strip()]
        seqs = [{"tokens": it["context_ids"] + ch, "first": 0, "n_rows": len(it["context_ids"]) + len(ch)}
                for it in items for ch in it["choices"]]
        all_rows, _, src = drl.transformers_rows(a.model, seqs)
        src["producer"] = "loglik_reference.py"
        cache, at = {}, 0
        for s in seqs:
            cache[tuple(s["tokens"])] = all_rows[at:at + s["n_rows"]]
            at += s["n_rows"]

        def rows_fn(seq):
            return cache[tuple(seq)]
    with open(a.out, "w") as f:
        json.dump({"source": src, "items": score(rows_fn, items)}, f, indent=1)
        f.write("\n")
    print(f"{a.out}: {len(items)} items", file=sys.stderr)


if __name__ == "__main__":
    main()
