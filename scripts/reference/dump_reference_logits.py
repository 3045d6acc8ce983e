#!/usr/bin/env python3
"""Reference logits from transformers' `qwen4_exp`, written as a fngen reference-logits file (`fngen eval kld --base`).

The file format is the one core/eval.h documents (8-byte little-endian header length, JSON header padded with spaces
to a multiple of 64 bytes, raw little-endian arrays); this script and the C++ reader/writer are checked against each
other by CTest `eval_cli` (tests/eval_cli.sh).

Two halves:
  * the file half (numpy only; runs anywhere, /usr/bin/python3): `write_logits_file`, `read_logits_file`,
    `tokenizer_id` (64-bit FNV-1a of tokenizer.json, as fngen computes it), and `--from-fixture DIR`, which converts a
    reference fixture's logits.bin (tests/data/fixtures/README.md) into a base file: one sequence = prompt ++ the
    first `decode_steps` greedy ids, every position recorded, next_token = the last greedy id.
  * the transformers half (the GPU machine, where torch and transformers are): `--model DIR` loads the checkpoint the
    way fngen does (model.language_model.* text tensors; NVFP4 experts dequantised as (e2m1 * e4m3) * weight_scale_2
    in FP32; FP8 n-gram shards concatenated and multiplied by their BF16 scale; BF16 widened to FP32; visual/MTP
    tensors skipped) into `Qwen4ExpForCausalLM` in FP32 (eager attention and experts), runs each sequence once
    without a cache and records the rows. Inputs as fngen eval: --prompt-ids [--continuation-ids] (dump-logits: one
    sequence, every position) or --ids-file/--text with --ctx N [--chunks K] (ppl windows: the second half of each).

Examples:
    /usr/bin/python3 scripts/reference/dump_reference_logits.py --from-fixture tests/data/fixtures/tp4 --out tp4.fnlogits
    python3 scripts/reference/dump_reference_logits.py --model DIR --text wiki.test.raw --ctx 512 --chunks 20 \
        --dtype float16 --out wiki.fnlogits          # then: mpirun -np 4 fngen eval kld -m DIR --base wiki.fnlogits
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np

MAGIC = "fngen.reference_logits"
VERSION = 1


# ------------------------------------------------------------------------------------------------ the file half
def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def tokenizer_id(model_dir):
    """"fnv1a64:<file>:<16 hex>" of tokenizer.json (else tokenizer.model), or "ids-only" (fngen's tokenizer_id)."""
    for name in ("tokenizer.json", "tokenizer.model"):
        p = os.path.join(model_dir, name)
        if os.path.exists(p):
            with open(p, "rb") as f:
                return f"fnv1a64:{name}:{fnv1a64(f.read()):016x}"
    return "ids-only"


def log_softmax64(rows):
    x = np.asarray(rows, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def target_of(seq, p):
    toks = seq["tokens"]
    return toks[p + 1] if p + 1 < len(toks) else seq["next_token"]


def write_logits_file(path, sequences, rows, vocab_size, tokenizer="ids-only", dtype="float32", top_k=0,
                      values=None, source=None):
    """sequences: [{"tokens", "first", "n_rows", "next_token"}]; rows: float32 [n_positions, vocab] raw logits in the
    sequences' order. dtype float32|float16; top_k 0 = full rows; values logits|logprobs (default: logits for full
    float32, logprobs otherwise; topk always stores log-probs)."""
    rows = np.asarray(rows, dtype=np.float32)
    n = sum(int(s["n_rows"]) for s in sequences)
    assert rows.shape == (n, vocab_size), (rows.shape, n, vocab_size)
    assert dtype in ("float32", "float16")
    mode = "topk" if top_k > 0 else "full"
    if values is None:
        values = "logits" if (mode == "full" and dtype == "float32") else "logprobs"
    assert not (mode == "topk" and values != "logprobs")
    np_dt = np.dtype("<f4") if dtype == "float32" else np.dtype("<f2")
    lp = log_softmax64(rows)
    arrays = []  # (name, dtype name, shape, bytes)
    if mode == "full":
        v = rows if values == "logits" else lp.astype(np.float32)
        arrays.append(("values", dtype, [n, vocab_size], v.astype(np_dt).tobytes()))
    else:
        ids = np.argsort(-lp, axis=1, kind="stable")[:, :top_k].astype("<i4")
        top = np.take_along_axis(lp, ids.astype(np.int64), axis=1)
        residual = np.maximum(0.0, 1.0 - np.exp(top).sum(axis=1)).astype("<f4")
        targets = []
        for s in sequences:
            for p in range(int(s["first"]), int(s["first"]) + int(s["n_rows"])):
                targets.append(target_of(s, p))
        tl = np.array([lp[i, t] if t >= 0 else np.nan for i, t in enumerate(targets)], dtype="<f4")
        arrays += [("topk_ids", "int32", [n, top_k], ids.tobytes()),
                   ("topk_logprobs", dtype, [n, top_k], top.astype(np.float32).astype(np_dt).tobytes()),
                   ("residual_mass", "float32", [n], residual.tobytes()),
                   ("target_logprob", "float32", [n], tl.tobytes())]
    header = {"magic": MAGIC, "version": VERSION, "vocab_size": int(vocab_size), "tokenizer": tokenizer,
              "dtype": dtype, "mode": mode, "values": values, "n_positions": n,
              "sequences": [{"tokens": [int(t) for t in s["tokens"]], "first": int(s["first"]),
                             "n_rows": int(s["n_rows"]), "next_token": int(s["next_token"])} for s in sequences]}
    if mode == "topk":
        header["top_k"] = int(top_k)
    if source:
        header["source"] = source
    off, desc = 0, {}
    for name, dt, shape, raw in arrays:
        desc[name] = {"dtype": dt, "shape": shape, "offset": off}
        off += len(raw)
    header["arrays"] = desc
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((-(8 + len(text))) % 64)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, raw in arrays:
            f.write(raw)


def read_logits_file(path):
    """-> (header dict, {array name: numpy array}). Checks the size the header implies, like the C++ reader."""
    with open(path, "rb") as f:
        blob = f.read()
    assert len(blob) >= 8, f"{path}: truncated"
    (hlen,) = struct.unpack("<Q", blob[:8])
    assert hlen <= len(blob) - 8, f"{path}: header length past the end"
    h = json.loads(blob[8:8 + hlen].decode("utf-8"))
    assert h["magic"] == MAGIC and h["version"] == VERSION, f"{path}: not a version-{VERSION} fngen logits file"
    dts = {"float32": "<f4", "float16": "<f2", "int32": "<i4"}
    out, end = {}, 0
    for name, e in h["arrays"].items():
        count = int(np.prod(e["shape"]))
        dt = np.dtype(dts[e["dtype"]])
        a = 8 + hlen + e["offset"]
        out[name] = np.frombuffer(blob[a:a + count * dt.itemsize], dtype=dt).reshape(e["shape"])
        end = max(end, e["offset"] + count * dt.itemsize)
    assert 8 + hlen + end == len(blob), f"{path}: {len(blob)} bytes, header implies {8 + hlen + end}"
    return h, out


def from_fixture(fx_dir):
    """A fixture's logits.bin as (sequences, rows, vocab_size, source)."""
    with open(os.path.join(fx_dir, "expected.json")) as f:
        e = json.load(f)
    steps = int(e["decode_steps"])
    tokens = list(e["prompt_ids"]) + list(e["generated_ids"][:steps])
    shape = e["logits"]["shape"]
    assert e["logits"]["dtype"] == "float32" and shape[0] == len(tokens)
    rows = np.fromfile(os.path.join(fx_dir, e["logits"]["file"]), dtype="<f4").reshape(shape)
    seq = {"tokens": tokens, "first": 0, "n_rows": len(tokens), "next_token": int(e["generated_ids"][steps])}
    src = {"producer": "dump_reference_logits.py --from-fixture", "fixture": e["name"], "reference": e["reference"],
           "transformers_version": e["transformers_version"], "torch_version": e["torch_version"]}
    return [seq], rows, int(shape[1]), src


# ------------------------------------------------------------------------------------------------ the transformers half
def load_checkpoint_state(model_dir, text_cfg):
    """The FP32 state_dict of Qwen4ExpForCausalLM from a fngen-layout checkpoint (docs/model.md §B.2, §B.4, §B.5)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import nvfp4_np as nq  # noqa: E402
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    np_of = {"BF16": "<u2", "F32": "<f4", "I64": "<i8", "U8": "u1", "F8_E4M3": "u1"}
    raw = {}  # name -> numpy array (BF16 as float32; U8 / F8_E4M3 as uint8 codes)
    for fn in files:
        with open(os.path.join(model_dir, fn), "rb") as f:
            blob = f.read()
        (hlen,) = struct.unpack("<Q", blob[:8])
        for name, e in json.loads(blob[8:8 + hlen]).items():
            if name == "__metadata__":
                continue
            a, b = e["data_offsets"]
            arr = np.frombuffer(blob[8 + hlen + a:8 + hlen + b], dtype=np_of[e["dtype"]]).reshape(e["shape"])
            raw[name] = nq.bf16_to_f32(arr) if e["dtype"] == "BF16" else arr

    def f32(a):
        return np.asarray(a, dtype=np.float32)

    sd, experts, ngram = {}, {}, {}
    for name, a in raw.items():
        if name.startswith("model.visual.") or name.startswith("mtp."):
            continue
        internal = name.replace("model.language_model.", "model.", 1)
        if ".mlp.experts." in internal and internal.split(".mlp.experts.")[1].split(".")[0].isdigit():
            experts[internal] = a
            continue
        if ".ngram_embedding." in internal:
            ngram[internal] = a
            continue
        sd[internal] = a if a.dtype == np.int64 else f32(a)
    # n-gram tables: shards in order times the BF16 scale (exact in FP32)
    bases = sorted({k.split(".shard_")[0] for k in ngram if ".shard_" in k})
    for b in bases:
        shards = sorted((k for k in ngram if k.startswith(b + ".shard_")), key=lambda k: int(k.split(".shard_")[1].split(".")[0]))
        scale = float(f32(ngram[b + ".weight_scale"]).reshape(-1)[0])
        table = np.concatenate([nq.e4m3_decode(ngram[k].view(np.uint8)) for k in shards], axis=0).astype(np.float32)
        sd[b + ".weight"] = (table * np.float32(scale)).astype(np.float32)
    # experts: NVFP4 per expert and projection -> fused gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    E, L_n = int(text_cfg["num_experts"]), int(text_cfg["num_hidden_layers"])
    for L in range(L_n):
        gu, dn = [], []
        for e in range(E):
            pre = f"model.layers.{L}.mlp.experts.{e}"
            deq = {}
            for proj in ("gate_proj", "up_proj", "down_proj"):
                deq[proj] = nq.nvfp4_dequantize(experts[f"{pre}.{proj}.weight"].view(np.uint8),
                                                experts[f"{pre}.{proj}.weight_scale"].view(np.uint8),
                                                float(np.asarray(experts[f"{pre}.{proj}.weight_scale_2"]).reshape(-1)[0]))
            gu.append(np.concatenate([deq["gate_proj"], deq["up_proj"]], axis=0))
            dn.append(deq["down_proj"])
        sd[f"model.layers.{L}.mlp.experts.gate_up_proj"] = np.stack(gu).astype(np.float32)
        sd[f"model.layers.{L}.mlp.experts.down_proj"] = np.stack(dn).astype(np.float32)
    return sd


def transformers_rows(model_dir, sequences):
    import torch
    from transformers.models.qwen4_exp import configuration_qwen4_exp as C
    from transformers.models.qwen4_exp import modeling_qwen4_exp as M
    with open(os.path.join(model_dir, "config.json")) as f:
        cj = json.load(f)
    tc = cj.get("text_config", cj)
    args = {k: v for k, v in tc.items() if k not in ("model_type", "architectures", "transformers_version")}
    cfg = C.Qwen4ExpTextConfig(**args)
    try:  # as make_fixtures.build_model: eager attention, the eager expert loop
        cfg._attn_implementation = "eager"
    except Exception:  # noqa: BLE001
        pass
    model = M.Qwen4ExpForCausalLM(cfg).eval().float()
    if getattr(model.config, "_attn_implementation", None) != "eager" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    try:
        model.set_experts_implementation("eager")
    except Exception:  # noqa: BLE001
        pass
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in load_checkpoint_state(model_dir, tc).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    rows = []
    with torch.no_grad():
        for s in sequences:
            end = s["first"] + s["n_rows"]
            out = model(input_ids=torch.tensor([s["tokens"][:end]]), use_cache=False).logits[0].float()
            rows.append(out[s["first"]:end].numpy().astype(np.float32))
    return np.concatenate(rows, axis=0), int(tc["vocab_size"]), {
        "producer": "dump_reference_logits.py", "model": os.path.abspath(model_dir),
        "reference": "transformers Qwen4ExpForCausalLM, float32, eager, no cache",
        "transformers_version": __import__("transformers").__version__, "torch_version": torch.__version__}


def check_load(fx_dir):
    """The transformers half's checkpoint decoding, checked here without torch: the state dict it would load equals,
    bit for bit, the rows the fixture's reference held (expected.json nvfp4_check / ngram_check / bf16_check)."""
    with open(os.path.join(fx_dir, "expected.json")) as f:
        e = json.load(f)
    with open(os.path.join(fx_dir, "config.json")) as f:
        tc = json.load(f)["text_config"]
    sd = load_checkpoint_state(fx_dir, tc)
    inter = int(tc["moe_intermediate_size"])
    for it in e["nvfp4_check"]:
        parts = it["tensor"].replace("model.language_model.", "model.", 1).split(".")
        L, ex, proj = int(parts[2]), int(parts[5]), parts[6]
        if proj == "down_proj":
            w = sd[f"model.layers.{L}.mlp.experts.down_proj"][ex]
        else:
            gu = sd[f"model.layers.{L}.mlp.experts.gate_up_proj"][ex]
            w = gu[:inter] if proj == "gate_proj" else gu[inter:]
        assert np.array_equal(w[it["rows"]], np.array(it["values"], dtype=np.float32)), it["tensor"]
    nc = e["ngram_check"]
    table = sd[nc["tensor_prefix"].replace("model.language_model.", "model.", 1) + ".weight"]
    assert np.array_equal(table[nc["rows"]], np.array(nc["values"], dtype=np.float32)), "n-gram rows"
    bc = e["bf16_check"]
    assert np.array_equal(sd[bc["tensor"]][bc["rows"]], np.array(bc["values"], dtype=np.float32)), "bf16 rows"
    assert not any(k.startswith(("model.visual", "mtp.", "model.language_model")) for k in sd)
    # names and shapes: exactly the reference's state_dict (make_fixtures.expected_shapes, which the GPU run checked
    # against Qwen4ExpForCausalLM's own state_dict: shape_mismatch_vs_model_md is empty)
    import make_fixtures as mf  # noqa: E402  (numpy-only at import)
    want = mf.expected_shapes(e["text_config_args"])
    got = {k: tuple(v.shape) for k, v in sd.items()}
    assert got == {k: tuple(v) for k, v in want.items()}, (sorted(set(got) ^ set(want)),
                                                           [k for k in got if k in want and got[k] != tuple(want[k])])
    print(f"{fx_dir}: checkpoint decoding matches the reference's rows and state_dict ({len(sd)} tensors)",
          file=sys.stderr)


def parse_ids(text):
    return [int(t) for t in text.replace(",", " ").split()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="reference-logits file to write")
    ap.add_argument("--check-load", metavar="FIXTURE", nargs="+",
                    help="check the checkpoint decoding against fixtures, exit")
    ap.add_argument("--from-fixture", help="convert a fixture's logits.bin (no transformers needed)")
    ap.add_argument("--model", help="checkpoint directory (transformers half)")
    ap.add_argument("--prompt-ids")
    ap.add_argument("--continuation-ids", default="")
    ap.add_argument("--ids-file")
    ap.add_argument("--text", help="raw text file, tokenized with the model directory's tokenizer.json")
    ap.add_argument("--ctx", type=int, default=0, help="ppl windows of this many tokens (--ids-file/--text)")
    ap.add_argument("--chunks", type=int, default=-1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--values", choices=["logits", "logprobs"])
    a = ap.parse_args()
    if a.check_load:
        for fx in a.check_load:
            check_load(fx)
        return
    assert a.out, "--out is required"
    if a.from_fixture:
        seqs, rows, vocab, src = from_fixture(a.from_fixture)
        write_logits_file(a.out, seqs, rows, vocab, "ids-only", a.dtype, a.top_k, a.values, src)
        print(f"{a.out}: {rows.shape[0]} rows of {vocab} from {a.from_fixture}", file=sys.stderr)
        return
    assert a.model, "--model or --from-fixture is required"
    tok = "ids-only"
    if a.prompt_ids:
        ids = parse_ids(a.prompt_ids) + parse_ids(a.continuation_ids)
        seqs = [{"tokens": ids, "first": 0, "n_rows": len(ids), "next_token": -1}]
    else:
        if a.text:
            from tokenizers import Tokenizer  # noqa: E402
            t = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
            with open(a.text, encoding="utf-8") as f:
                ids = t.encode(f.read(), add_special_tokens=False).ids
            tok = tokenizer_id(a.model)
        else:
            with open(a.ids_file) as f:
                ids = parse_ids(f.read())
        assert a.ctx >= 4 and len(ids) >= a.ctx, f"need --ctx >= 4 and at least --ctx tokens ({len(ids)})"
        n = len(ids) // a.ctx if a.chunks <= 0 else min(a.chunks, len(ids) // a.ctx)
        first = a.ctx // 2
        seqs = [{"tokens": ids[c * a.ctx:(c + 1) * a.ctx], "first": first, "n_rows": a.ctx - 1 - first,
                 "next_token": -1} for c in range(n)]
    rows, vocab, src = transformers_rows(a.model, seqs)
    write_logits_file(a.out, seqs, rows, vocab, tok, a.dtype, a.top_k, a.values, src)
    print(f"{a.out}: {rows.shape[0]} rows of {vocab}", file=sys.stderr)


if __name__ == "__main__":
    main()
