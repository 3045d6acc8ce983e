#!/usr/bin/env python3
"""Independent check of a reference fixture (numpy only; shares no code with make_fixtures.py / nvfp4_np.py).

Reads the fixture's safetensors files with a hand-written parser, decodes NVFP4 / FP8 E4M3 / BF16 from the bit
patterns (docs/model.md §B.4, §B.5), and verifies that the values the reference model held (stored in expected.json by
make_fixtures.py) equal what an engine decodes from the file, bit for bit. Also checks the index, the tensor
inventory (names, dtypes, shapes), the logits file size and that the greedy ids are the argmax of the stored rows.
    /usr/bin/python3 scripts/reference/check_fixture.py tests/data/fixtures/g3_tiny [more fixture dirs]
Exits non-zero on the first failed check.
"""
import json
import os
import struct
import sys

import numpy as np

SIZES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I64": 8}


class SafeTensors:
    def __init__(self, path):
        with open(path, "rb") as f:
            self.blob = f.read()
        (n,) = struct.unpack("<Q", self.blob[:8])
        assert 8 + n <= len(self.blob), f"{path}: header length past the end"
        self.header = json.loads(self.blob[8:8 + n].decode("utf-8"))
        self.base = 8 + n
        self.path = path
        end = 0
        for name, e in self.tensors().items():
            a, b = e["data_offsets"]
            count = 1
            for s in e["shape"]:
                count *= s
            assert b - a == count * SIZES[e["dtype"]], f"{path}: {name} size mismatch"
            end = max(end, b)
        assert self.base + end == len(self.blob), f"{path}: trailing or missing bytes"

    def tensors(self):
        return {k: v for k, v in self.header.items() if k != "__metadata__"}

    def raw(self, name):
        e = self.header[name]
        a, b = e["data_offsets"]
        return self.blob[self.base + a:self.base + b], e["dtype"], e["shape"]


def decode_bf16(raw):
    u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return u.view(np.float32)


def decode_e4m3(codes):
    """E4M3 (fn) byte -> float32 from the bit fields: sign, 4-bit exponent (bias 7), 3-bit mantissa."""
    c = np.asarray(codes, dtype=np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = c & 7
    val = np.where(e == 0, m * 2.0 ** -9, (8 + m) * np.exp2(e - 10.0))
    assert not np.any((e == 15) & (m == 7)), "NaN code in an E4M3 tensor"
    return (sign * val).astype(np.float32)


def decode_e2m1(nibbles):
    n = np.asarray(nibbles, dtype=np.int64)
    mag = n & 7
    e, m = mag >> 1, mag & 1
    val = np.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * np.exp2(e - 1.0))
    return np.where(n & 8, -val, val).astype(np.float32)


def main(dirs):
    for d in dirs:
        check(d)
    return 0


def check(d):
    meta = json.load(open(os.path.join(d, "expected.json")))
    cfg = json.load(open(os.path.join(d, "config.json")))
    tc = cfg["text_config"]
    idx = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    files = {f: SafeTensors(os.path.join(d, f)) for f in sorted(set(idx["weight_map"].values()))}
    assert len(files) >= 2
    total = 0
    where = {}
    for f, st in files.items():
        for name, e in st.tensors().items():
            assert idx["weight_map"].get(name) == f, f"{name} is in {f} but the index says {idx['weight_map'].get(name)}"
            where[name] = (st, e)
            total += e["data_offsets"][1] - e["data_offsets"][0]
    assert set(where) == set(idx["weight_map"]), "index names a tensor that no file holds"
    assert total == idx["metadata"]["total_size"], (total, idx["metadata"]["total_size"])
    for name in where:
        assert name.startswith(("model.language_model.", "lm_head.", "model.visual.", "mtp.")), name
    assert any(n.startswith("model.visual.") for n in where) and any(n.startswith("mtp.") for n in where)

    # routed experts: four tensors per projection, NVFP4 shapes
    E, I, D = tc["num_experts"], tc["moe_intermediate_size"], tc["hidden_size"]
    for L in range(tc["num_hidden_layers"]):
        for e in range(E):
            for proj, (n, k) in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
                p = f"model.language_model.layers.{L}.mlp.experts.{e}.{proj}"
                assert where[p + ".weight"][1]["dtype"] == "U8" and where[p + ".weight"][1]["shape"] == [n, k // 2]
                assert where[p + ".weight_scale"][1]["dtype"] == "F8_E4M3"
                assert where[p + ".weight_scale"][1]["shape"] == [n, k // 16]
                for s in ("weight_scale_2", "input_scale"):
                    assert where[p + "." + s][1]["dtype"] == "F32" and where[p + "." + s][1]["shape"] == [], p + s
                assert "layer-%05d-experts-" % L in idx["weight_map"][p + ".weight"]

    def nvfp4(prefix):
        st = where[prefix + ".weight"][0]
        packed = np.frombuffer(st.raw(prefix + ".weight")[0], dtype=np.uint8).reshape(where[prefix + ".weight"][1]["shape"])
        sc_st = where[prefix + ".weight_scale"][0]
        sc = np.frombuffer(sc_st.raw(prefix + ".weight_scale")[0], dtype=np.uint8)
        sc = sc.reshape(where[prefix + ".weight_scale"][1]["shape"])
        g_st = where[prefix + ".weight_scale_2"][0]
        g = np.frombuffer(g_st.raw(prefix + ".weight_scale_2")[0], dtype="<f4")[0]
        n, kh = packed.shape
        vals = np.empty((n, kh * 2), dtype=np.float32)
        vals[:, 0::2] = decode_e2m1(packed & 0xF)   # low nibble = even element
        vals[:, 1::2] = decode_e2m1(packed >> 4)
        block = np.repeat(decode_e4m3(sc), 16, axis=1)  # linear [N, K/16], one scale per 16 along K
        return (vals * block).astype(np.float32) * np.float32(g), g

    worst = 0.0
    for item in meta["nvfp4_check"]:
        w, g = nvfp4(item["tensor"])
        want = np.array(item["values"], dtype=np.float32)
        got = w[item["rows"]]
        assert np.array_equal(got, want), f"{item['tensor']}: dequantised rows differ, max {np.abs(got - want).max()}"
        ratio = float(np.abs(w).max() / (6.0 * 448.0 * g))
        assert 0.9 < ratio <= 1.0 + 1e-6, f"{item['tensor']}: weight_scale_2 is not amax/(6*448) (ratio {ratio})"
        worst = max(worst, float(np.abs(got - want).max()))
    # the n-gram table: FP8 rows times the one BF16 scale
    nc = meta["ngram_check"]
    pre = nc["tensor_prefix"]
    parts = tc["split_ngram_parts"]
    shards = [where[f"{pre}.shard_{k}.weight"] for k in range(parts)]
    assert f"{pre}.shard_{parts}.weight" not in where
    rows_per = shards[0][1]["shape"][0]
    assert all(s[1]["shape"][0] == rows_per and s[1]["dtype"] == "F8_E4M3" for s in shards)
    sc_raw, sc_dt, sc_shape = where[pre + ".weight_scale"][0].raw(pre + ".weight_scale")
    assert sc_dt == "BF16" and sc_shape == [1]
    scale = decode_bf16(sc_raw)[0]
    for r, want in zip(nc["rows"], nc["values"]):
        st, e = shards[r // rows_per]
        cols = e["shape"][1]
        raw = st.raw(f"{pre}.shard_{r // rows_per}.weight")[0]
        row = np.frombuffer(raw, dtype=np.uint8)[(r % rows_per) * cols:(r % rows_per + 1) * cols]
        got = decode_e4m3(row) * scale
        assert np.array_equal(got, np.array(want, dtype=np.float32)), f"n-gram row {r} differs"
    # the n-gram hash buffers of decoder layer 1 against docs/model.md §G.3 (same vocab 512 and seed 1234)
    if tc["vocab_size"] == 512 and tc.get("seed", 1234) == 1234 and 2 in tc["ple_layer_ids"]:
        name = "model.language_model.layers.1.ple.ple_embedding.layer_multipliers"
        st, e = where[name]
        assert e["dtype"] == "I64" and e["shape"] == [3]
        mult = np.frombuffer(st.raw(name)[0], dtype="<i8").tolist()
        assert mult == [4295158889763781, 17440218147737327, 1270917961434445], mult
        name = "model.language_model.layers.1.ple.ple_embedding.ngram_heads_vocab_sizes"
        sizes = np.frombuffer(where[name][0].raw(name)[0], dtype="<i8").tolist()
        assert sizes == [1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049], sizes
    # a BF16 tensor
    bc = meta["bf16_check"]
    st, e = where[bc["tensor"]]
    lm = decode_bf16(st.raw(bc["tensor"])[0]).reshape(e["shape"])
    assert np.array_equal(lm[bc["rows"]], np.array(bc["values"], dtype=np.float32)), "lm_head rows differ"
    # logits
    lg = meta["logits"]
    arr = np.fromfile(os.path.join(d, lg["file"]), dtype="<f4")
    assert arr.size == lg["shape"][0] * lg["shape"][1], "logits.bin size"
    arr = arr.reshape(lg["shape"])
    T = meta["prompt_len"]
    assert [int(x) for x in arr[T - 1:].argmax(1)] == meta["generated_ids"], "greedy ids are not the argmax of the rows"
    s = np.sort(arr.astype(np.float64), axis=1)
    assert np.allclose(s[:, -1] - s[:, -2], meta["top1_margins"], rtol=0, atol=1e-9)
    assert meta["eos_token_id"] in meta["prompt_ids"]
    print(f"{d}: {len(files)} files, {len(where)} tensors, NVFP4 rows of {len(meta['nvfp4_check'])} projections, "
          f"n-gram rows {nc['rows']} and lm_head rows match the reference bit for bit; logits {lg['shape']} ok")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
