#!/usr/bin/env python3
"""Reference fixtures for fngen's CPU and CUDA backends, made with transformers' qwen4_exp (the reference model).

For every tiny config in CONFIGS this script (1) builds `Qwen4ExpForCausalLM` (text model + lm_head), (2) gives every
weight a seeded random value (numpy, per tensor name), (3) quantises the routed experts to NVFP4 exactly as a ModelOpt
export stores them and the n-gram table(s) to FP8 E4M3 with one BF16 scale, rounds everything else to BF16, and loads
the values an engine decodes from the file back into the FP32 reference, (4) writes the checkpoint in the real
multimodal NVFP4 layout, (5) runs the reference in FP32 with eager attention on a prompt with EOS inside it (prefill
with cache, then 32 greedy decode steps), (6) captures every router and indexer top-k the reference takes and rejects
the seed unless each boundary is >= 1e-5 away from a tie (and the greedy margins are clear), trying the next seed.

Runs on the GPU machine (torch 2.11, transformers 5.17 with qwen4_exp), CPU only; seeds are tried in parallel.
    python3 scripts/reference/make_fixtures.py --out DIR [--configs g3_tiny,tp4,ple2_long] [--jobs 30]
    python3 scripts/reference/make_fixtures.py --self-test      # numpy-only checks of the packing (no torch)
Format of what it writes: tests/data/fixtures/README.md.
"""
import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nvfp4_np as nq  # noqa: E402

# ---------------------------------------------------------------------------------------------------------- configs
# Constructor fields of Qwen4ExpTextConfig (layer_types is left to the interval default, which gives
# [linear, linear, linear, qsa] for 4 layers; config.json spells it with "full_attention" like the real file).

G3 = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
          head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
          linear_num_value_heads=6, linear_conv_kernel_dim=4, moe_intermediate_size=32,
          shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=3, hc_count=4, hc_lowrank=16,
          ple_layer_ids=[2], ple_embed_dim=64, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=4,
          ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, seed=1234,
          indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
          output_gate_type="sigmoid", eos_token_id=7, bos_token_id=7, rms_norm_eps=1e-6, tie_word_embeddings=False,
          max_position_embeddings=1024,
          rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                               mrope_section=[2, 1, 1], mrope_interleaved=True))

# TP=4-friendly: 8 query heads, 2 KV heads (replicated at TP=4), GDN 4 key / 12 value heads, 8 experts, expert and
# shared widths 64 (64/4 = 16 = one NVFP4 block per rank), vocab 384, 8 n-gram shards, n-gram head dim 8 (2 per rank).
# hidden 64 (a multiple of 16) and 8 experts rather than 128 / 16 keep the committed checkpoint under 1 MB.
TP4 = dict(G3, vocab_size=384, hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
           linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4, linear_num_value_heads=12,
           moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=3,
           hc_lowrank=8, ple_layer_ids=[2], ple_embed_dim=64, heads_per_ngram=4, ngram_vocab_size_base=1000,
           make_ngram_vocab_size_divisible_by=64, split_ngram_parts=8, indexer_n_heads=2, indexer_head_dim=16,
           rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.5,
                                mrope_section=[2, 1, 1], mrope_interleaved=True))
TP4.pop("seed")  # omitted, as in the real config.json: the class default 1234 applies

# Two PLE layers (one-indexed 2 and 3 = decoder layers 1 and 2, both GDN) and a prompt of 48 > 3 x budget(8) tokens.
PLE2 = dict(G3, ple_layer_ids=[2, 3], hc_lowrank=8)  # hc_lowrank 8 keeps the checkpoint under 1 MB
PLE2.pop("seed")

CONFIGS = {
    "g3_tiny": dict(spec=G3, prompt_len=44, eos_positions=[0, 5, 6, 17, 31, 40], prompt_seed=11, seed_base=1000,
                    description="docs/model.md §G.3 exactly; 44-token prompt with EOS at 0, 5, 6, 17, 31, 40"),
    "tp4": dict(spec=TP4, prompt_len=40, eos_positions=[0, 9, 10, 23, 33], prompt_seed=12, seed_base=2000,
                description="TP=4-friendly: heads, GDN heads, experts, widths/16, vocab, n-gram shards divide by 4"),
    "ple2_long": dict(spec=PLE2, prompt_len=48, eos_positions=[0, 4, 5, 6, 19, 30, 44], prompt_seed=13,
                      seed_base=3000, description="two PLE layers (ple_layer_ids [2, 3]); 48-token prompt, > 3x the "
                                                  "QSA budget of 8"),
}

DECODE_STEPS = 32
TIE_MIN = 1e-5           # every router / indexer top-k boundary must be at least this far from a tie
MARGIN_MIN = 5e-3        # top-1 minus top-2 logit at every row that picks a greedy token
TARGET_MAX_LOGIT = 16.0  # lm_head is scaled so that max |logit| over the prompt is this
GEN_EOS = 8              # generation_config eos list is [GEN_EOS, eos_token_id] (8 plays <|im_end|>)

EXCLUDE = ["model.embed_tokens", "mtp.*", "model.mtp.*", "*.self_attn.*", "*.linear_attn.*", "*.mlp.gate*",
           "*.mlp.shared_expert.*", "*.mlp.shared_expert_gate*", "*hyper_connection*", "*.ple.*", "model.visual.*",
           "model.language_model.embed_tokens", "lm_head"]


def prompt_ids(c):
    rng = np.random.default_rng(c["prompt_seed"])
    eos = c["spec"]["eos_token_id"]
    ids = []
    while len(ids) < c["prompt_len"]:
        t = int(rng.integers(0, c["spec"]["vocab_size"]))
        if t != eos:
            ids.append(t)
    for p in c["eos_positions"]:
        ids[p] = eos
    return ids


# ---------------------------------------------------------------------------------------------------------- n-gram constants
# Our own computation of the three I64 buffers (docs/model.md §C.4), compared with the reference's buffers on every run.

def _splitmix64(v):
    M = (1 << 64) - 1
    v = (v + 0x9E3779B97F4A7C15) & M
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & M
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & M
    return (v ^ (v >> 31)) & M


def ngram_constants(spec, ple_layer_index):
    vocab, n = spec["vocab_size"], spec["ngram_size"]
    seed = spec.get("seed", 1234)
    half = max(1, (((1 << 63) - 1) // max(vocab, 1)) // 2)
    base = seed + 10007 * ple_layer_index
    mult = [2 * (_splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 64) - 1)) % half) + 1 for i in range(n)]
    heads = (n - 1) * spec["heads_per_ngram"]

    def is_prime(x):
        if x < 2:
            return False
        if x % 2 == 0:
            return x == 2
        return all(x % d for d in range(3, math.isqrt(x) + 1, 2))

    sizes, p = [], spec["ngram_vocab_size_base"] - 1
    while len(sizes) < (ple_layer_index + 1) * heads:
        p += 1
        if is_prime(p):
            sizes.append(p)
    sizes = sizes[ple_layer_index * heads:]
    offsets = [int(x) for x in np.cumsum([0] + sizes[:-1])]
    div = spec["make_ngram_vocab_size_divisible_by"]
    rows = -(-sum(sizes) // div) * div
    return mult, sizes, offsets, rows


# ---------------------------------------------------------------------------------------------------------- shapes
def expected_shapes(spec):
    """Internal (transformers state_dict) names and shapes per docs/model.md §B.2, with fused experts and one n-gram table
    per PLE layer. On the GPU machine the model's own state_dict is authoritative; this is compared with it."""
    D, S, r = spec["hidden_size"], spec["hc_count"], spec["hc_lowrank"]
    W, V, E, I, Is = S * D, spec["vocab_size"], spec["num_experts"], spec["moe_intermediate_size"], \
        spec["shared_expert_intermediate_size"]
    sh = {"model.embed_tokens.weight": (V, D), "lm_head.weight": (V, D)}

    def hc(p, inject=True):
        sh[p + ".hc_norm.weight"] = (W,)
        sh[p + ".input_mix_weight_down.weight"] = (r, W)
        sh[p + ".input_mix_weight_up.weight"] = (W, r)
        if inject:
            sh[p + ".block_inject_weight.weight"] = (S, W)

    hc("model.hyper_connection_mixer", False)
    hk, hv, dk, dv = spec["linear_num_key_heads"], spec["linear_num_value_heads"], spec["linear_key_head_dim"], \
        spec["linear_value_head_dim"]
    hq, hkv, hd = spec["num_attention_heads"], spec["num_key_value_heads"], spec["head_dim"]
    ni, ihd = spec["indexer_n_heads"], spec["indexer_head_dim"]
    ple_ids = sorted(spec["ple_layer_ids"])
    for L in range(spec["num_hidden_layers"]):
        p = f"model.layers.{L}"
        hc(p + ".attn_hyper_connection")
        hc(p + ".mlp_hyper_connection")
        if (L + 1) % 4:
            a = p + ".linear_attn"
            conv = 2 * hk * dk + hv * dv
            sh.update({a + ".in_proj_qkv.weight": (conv, D), a + ".in_proj_z.weight": (hv * dv, D),
                       a + ".in_proj_a.weight": (hv, D), a + ".in_proj_b.weight": (hv, D),
                       a + ".out_proj.weight": (D, hv * dv), a + ".A_log": (hv,), a + ".dt_bias": (hv,),
                       a + ".conv1d.weight": (conv, 1, spec["linear_conv_kernel_dim"]), a + ".norm.weight": (dv,)})
        else:
            a = p + ".self_attn"
            sh.update({a + ".q_proj.weight": (hq * 2 * hd, D), a + ".k_proj.weight": (hkv * hd, D),
                       a + ".v_proj.weight": (hkv * hd, D), a + ".o_proj.weight": (D, hq * hd),
                       a + ".q_norm.weight": (hd,), a + ".k_norm.weight": (hd,),
                       a + ".indexer.index_qk_proj.weight": ((ni + 1) * ihd, D),
                       a + ".indexer.q_layernorm.weight": (ihd,), a + ".indexer.k_layernorm.weight": (ihd,)})
        m = p + ".mlp"
        sh.update({m + ".gate.weight": (E, D), m + ".experts.gate_up_proj": (E, 2 * I, D),
                   m + ".experts.down_proj": (E, D, I), m + ".shared_expert.gate_proj.weight": (Is, D),
                   m + ".shared_expert.up_proj.weight": (Is, D), m + ".shared_expert.down_proj.weight": (D, Is),
                   m + ".shared_expert_gate.weight": (1, D)})
        if L + 1 in ple_ids:
            q = p + ".ple"
            P = spec["ple_embed_dim"]
            heads = (spec["ngram_size"] - 1) * spec["heads_per_ngram"]
            _, _, _, rows = ngram_constants(spec, ple_ids.index(L + 1))
            sh.update({q + ".key_proj.weight": (W, P), q + ".value_proj.weight": (D, P), q + ".norm_key.weight": (W,),
                       q + ".norm_query.weight": (W,), q + ".norm_conv.weight": (W,),
                       q + ".conv1d.weight": (W, 1, spec["ple_conv_kernel_size"]),
                       q + ".ple_embedding.layer_multipliers": (spec["ngram_size"],),
                       q + ".ple_embedding.ngram_heads_vocab_sizes": (heads,),
                       q + ".ple_embedding.ngram_heads_offsets": (heads,),
                       q + ".ple_embedding.ngram_embedding.weight": (rows, P // heads)})
    return sh


INT_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


def is_int_buffer(name):
    return name.rsplit(".", 1)[-1] in INT_BUFFERS


# ---------------------------------------------------------------------------------------------------------- weights
def gen_values(shapes, seed, spec):
    """Seeded random float32 values for every float tensor, from (seed, tensor name) alone."""
    out = {}
    for name, shape in shapes.items():
        if is_int_buffer(name):
            continue
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        n = lambda std: (rng.standard_normal(shape) * std).astype(np.float32)  # noqa: E731
        fan_in = shape[-1] if len(shape) >= 2 else shape[0]
        if name.endswith(".A_log"):
            v = np.log(rng.uniform(0.5, 4.0, shape)).astype(np.float32)
        elif name.endswith(".dt_bias"):
            v = (1.0 + rng.standard_normal(shape) * 0.5).astype(np.float32)
        elif name.endswith("linear_attn.norm.weight"):  # the plain-weight gated norm
            v = (1.0 + rng.standard_normal(shape) * 0.2).astype(np.float32)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("_norm.weight"):
            v = n(0.2)  # (1 + w) norms
        elif name.endswith("conv1d.weight"):
            v = n(0.4)
        elif name.endswith("ngram_embedding.weight"):
            v = n(0.5)
        elif name == "model.embed_tokens.weight":
            v = n(1.0)
        elif name.endswith("mlp.gate.weight"):  # router: logits with a spread of about 1
            v = n(2.0 / math.sqrt(fan_in))
        else:
            v = n(1.0 / math.sqrt(fan_in))
        out[name] = v
    return out


def file_name_of(internal):
    return internal.replace("model.", "model.language_model.", 1) if internal.startswith("model.") else internal


def pack(spec, vals, int_bufs, lm_scale=1.0):
    """-> (loaded: internal name -> float32 values the reference must hold, files: file -> {tensor: (dt, shape, raw)},
    info). Experts -> NVFP4, n-gram tables -> FP8 + one BF16 scale, the rest -> BF16, I64 buffers as they are."""
    E, I = spec["num_experts"], spec["moe_intermediate_size"]
    L_n = spec["num_hidden_layers"]
    per_file = max(1, E // 2)
    loaded, files, info = {}, {}, {"nvfp4_scale_2": {}, "ngram_scale": {}}

    def put(fname, tname, dt, arr, shape=None):
        arr = np.asarray(arr)
        shape = tuple(arr.shape) if shape is None else shape
        files.setdefault(fname, {})[tname] = (dt, shape, nq.raw_of(dt, arr))

    def bf16_file(internal):
        if internal.startswith("model.layers."):
            L = int(internal.split(".")[2])
            return "model-bf16-00001.safetensors" if L < L_n // 2 else "model-bf16-00002.safetensors"
        if internal == "model.embed_tokens.weight":
            return "model-bf16-00001.safetensors"
        return "model-bf16-00002.safetensors"

    for name, v in vals.items():
        fn = file_name_of(name)
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            continue
        if name.endswith("ngram_embedding.weight"):
            codes, scale, deq = nq.fp8_table(v)
            parts = spec["split_ngram_parts"]
            rows = v.shape[0]
            assert rows % parts == 0, f"{name}: {rows} rows do not split into {parts} equal shards"
            per = rows // parts
            base = fn[: -len(".weight")]
            for k in range(parts):
                put("model-plefp8-00000.safetensors", f"{base}.shard_{k}.weight", "F8_E4M3", codes[k * per:(k + 1) * per])
            put("model-plefp8-00000.safetensors", f"{base}.weight_scale", "BF16", np.array([scale], np.float32))
            loaded[name] = deq
            info["ngram_scale"][fn] = float(scale)
            continue
        if name == "lm_head.weight":
            v = v * np.float32(lm_scale)
        r = nq.bf16_round(v)
        put(bf16_file(name), fn, "BF16", r)
        loaded[name] = r
    for name, b in int_bufs.items():
        put(bf16_file(name), file_name_of(name), "I64", b)
    # routed experts: NVFP4 per expert and projection, in their own files
    for L in range(L_n):
        gu = vals[f"model.layers.{L}.mlp.experts.gate_up_proj"]
        dn = vals[f"model.layers.{L}.mlp.experts.down_proj"]
        gu_l, dn_l = np.empty_like(gu), np.empty_like(dn)
        for e in range(E):
            a = (e // per_file) * per_file
            fname = f"layer-{L:05d}-experts-{a:04d}-{min(a + per_file, E) - 1:04d}.safetensors"
            for proj, w, dst in (("gate_proj", gu[e, :I], gu_l[e, :I]), ("up_proj", gu[e, I:], gu_l[e, I:]),
                                 ("down_proj", dn[e], dn_l[e])):
                q = nq.nvfp4_quantize(w)
                pre = f"model.language_model.layers.{L}.mlp.experts.{e}.{proj}"
                put(fname, pre + ".weight", "U8", q["weight"])
                put(fname, pre + ".weight_scale", "F8_E4M3", q["weight_scale"])
                put(fname, pre + ".weight_scale_2", "F32", np.float32(q["weight_scale_2"]), shape=())
                # input_scale: unused by W4A16; a plausible activation amax / (6 * 448), deterministic per tensor
                ins = np.float32((2.0 + (zlib.crc32(pre.encode()) % 1000) / 250.0) / (6.0 * 448.0))
                put(fname, pre + ".input_scale", "F32", ins, shape=())
                dst[...] = q["deq"]
                info["nvfp4_scale_2"][pre] = float(q["weight_scale_2"])
        loaded[f"model.layers.{L}.mlp.experts.gate_up_proj"] = gu_l
        loaded[f"model.layers.{L}.mlp.experts.down_proj"] = dn_l
    # tensors the loader must skip
    D, W = spec["hidden_size"], spec["hc_count"] * spec["hidden_size"]
    rng = np.random.default_rng(99)
    dummies = {"model.visual.patch_embed.proj.weight": (8, 3, 2, 2, 2), "model.visual.blocks.0.attn.qkv.weight": (24, 8),
               "model.visual.blocks.0.attn.qkv.bias": (24,), "model.visual.merger.linear_fc2.weight": (D, 32),
               "mtp.pre_fc_norm_embedding.weight": (D,), "mtp.pre_fc_norm_hidden.weight": (W,),
               "mtp.layers.0.mlp.experts.gate_up_proj": (2, 8, 16), "mtp.layers.0.mlp.experts.down_proj": (2, 16, 4),
               "mtp.layers.0.self_attn.q_norm.weight": (spec["head_dim"],)}
    for i, (tname, shape) in enumerate(dummies.items()):
        put("model-bf16-00001.safetensors" if tname.startswith("model.visual") else "model-bf16-00002.safetensors",
            tname, "BF16", (rng.standard_normal(shape) * 0.1).astype(np.float32))
    return loaded, files, info


def config_json(spec, transformers_version):
    t = dict(spec)
    t["model_type"] = "qwen4_exp_text"
    t["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(spec["num_hidden_layers"])]
    t["full_attention_interval"] = 4
    t["partial_rotary_factor"] = spec["rope_parameters"]["partial_rotary_factor"]
    t.update(hidden_act="silu", initializer_range=0.02, use_cache=True, attention_bias=False, attention_dropout=0.0,
             dtype="bfloat16", mamba_ssm_dtype="float32", norm_topk_prob=True, output_router_logits=False,
             router_aux_loss_coef=0.001, ple_embedding_dtype="float8_e4m3fn", pad_token_id=None,
             mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
             mtp=dict(hybrid=True, layer_types=["full_attention"], mtp_use_hidden_state_from_layer=None,
                      num_hidden_layers=1, rope_theta=spec["rope_parameters"]["rope_theta"]))
    group = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "tie_word_embeddings": False,
        "image_token_id": 248056, "video_token_id": 248057,
        "vision_start_token_id": 248053, "vision_end_token_id": 248054,
        "language_model_only": False,
        "transformers_version": transformers_version,
        "text_config": {k: t[k] for k in sorted(t)},
        "vision_config": {"depth": 1, "hidden_size": 8, "intermediate_size": 16, "num_heads": 2,
                          "out_hidden_size": spec["hidden_size"], "patch_size": 2, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "num_position_embeddings": 16, "in_channels": 3,
                          "hidden_act": "gelu_pytorch_tanh", "initializer_range": 0.02,
                          "deepstack_visual_indexes": [], "model_type": "qwen4_exp"},
        "quantization_config": {
            "quant_method": "modelopt", "quant_algo": "NVFP4",
            "producer": {"name": "modelopt", "version": "0.46.0"},
            "ignore": list(EXCLUDE),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(group),
                                          "input_activations": dict(group)}},
        },
    }


def hf_quant_config():
    return {"producer": {"name": "modelopt", "version": "0.46.0"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": list(EXCLUDE)}}


def generation_config(spec):
    eos = spec["eos_token_id"]
    return {"bos_token_id": eos, "do_sample": True, "eos_token_id": [GEN_EOS, eos], "pad_token_id": eos,
            "temperature": 1.0, "top_k": 20, "top_p": 0.95}


def write_checkpoint(d, spec, files, tv):
    os.makedirs(d, exist_ok=True)
    wm, total = {}, 0
    for fname in sorted(files):
        total += nq.write_safetensors(os.path.join(d, fname), files[fname])
        for t in files[fname]:
            wm[t] = fname
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:  # one entry a line, compact
        f.write('{"metadata": {"total_size": %d},\n"weight_map": {\n' % total)
        f.write(",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(wm.items())))
        f.write("\n}}\n")
    for fn, obj in (("config.json", config_json(spec, tv)), ("hf_quant_config.json", hf_quant_config()),
                    ("generation_config.json", generation_config(spec))):
        with open(os.path.join(d, fn), "w") as f:
            json.dump(obj, f, indent=2)
    return total


def checkpoint_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
               if f.endswith(".safetensors") or f.endswith(".json") and f != "expected.json")


# ---------------------------------------------------------------------------------------------------------- reference (torch)
class TopkRecorder:
    """Wraps torch.topk / Tensor.topk; while a router or indexer module runs, every top-k call records the gap
    between its k-th and (k+1)-th largest input (the boundary the reference decides on)."""

    def __init__(self, torch):
        self.torch = torch
        self.tag = None
        self.phase = None
        self.on = False
        self.rows = []  # dicts: kind, layer, phase, gap, kth, n, k, logit_gap
        o_fn, o_m = torch.topk, torch.Tensor.topk
        rec = self

        def f(input, k, *a, **kw):
            rec.note(input, k, a[0] if a else kw.get("dim", None))
            return o_fn(input, k, *a, **kw)

        def m(self_, k, *a, **kw):
            rec.note(self_, k, a[0] if a else kw.get("dim", None))
            return o_m(self_, k, *a, **kw)

        torch.topk = f
        torch.Tensor.topk = m

    def note(self, x, k, dim):
        if not self.on or self.tag is None:
            return
        kind, layer = self.tag
        d = -1 if dim is None else dim
        v = x.detach().double()
        s = v.sort(dim=d, descending=True).values
        n = s.shape[d]
        row = {"kind": kind, "layer": layer, "phase": self.phase, "n": int(n), "k": int(k)}
        if n > k:
            a, b = s.narrow(d, k - 1, 1), s.narrow(d, k, 1)
            g = a - b
            i = int(g.flatten().argmin())
            row.update(gap=float(g.flatten()[i]), kth=float(a.flatten()[i]), next=float(b.flatten()[i]),
                       rows=int(g.numel()))
            if kind == "router":  # the boundary in logit space (softmax is monotone: log-ratio of the probs)
                lg = (a.clamp_min(1e-300).log() - b.clamp_min(1e-300).log()).flatten()
                row["logit_gap"] = float(lg.min())
        self.rows.append(row)

    def hook(self, model):
        for name, mod in model.named_modules():
            cls = type(mod).__name__
            kind = ("router" if cls.endswith("Router") or name.endswith(".mlp.gate") else
                    "indexer" if "Indexer" in cls or name.endswith(".indexer") else None)
            if kind is None:
                continue
            layer = int(name.split("layers.")[1].split(".")[0])
            mod.register_forward_pre_hook(lambda m, a, kind=kind, layer=layer: setattr(self, "tag", (kind, layer)))
            mod.register_forward_hook(lambda m, a, o: setattr(self, "tag", None))


_REC = None


def build_model(spec):
    import torch
    from transformers.models.qwen4_exp import configuration_qwen4_exp as C
    from transformers.models.qwen4_exp import modeling_qwen4_exp as M
    cfg = C.Qwen4ExpTextConfig(**spec)
    try:
        cfg._attn_implementation = "eager"
    except Exception:  # noqa: BLE001
        pass
    model = M.Qwen4ExpForCausalLM(cfg).eval().float()
    if getattr(model.config, "_attn_implementation", None) != "eager" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    try:  # the eager expert loop (one expert at a time, FP32 index_add) rather than grouped_mm
        model.set_experts_implementation("eager")
    except Exception:  # noqa: BLE001
        pass
    return model, torch


def load_into(model, torch, loaded, int_bufs):
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in loaded.items()}
    sd.update({k: torch.from_numpy(v) for k, v in int_bufs.items()})
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)


def run_reference(model, torch, rec, prompt, steps):
    with torch.no_grad():
        rec.phase = "prefill"
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        rows = [out.logits[0].float()]
        past = out.past_key_values
        gen = [int(rows[0][-1].argmax())]
        for i in range(steps):
            rec.phase = f"decode{i}"
            out = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            r = out.logits[0, -1].float()
            rows.append(r[None])
            gen.append(int(r.argmax()))
        logits = torch.cat(rows, 0)
        rec.phase = "full"
        full = model(input_ids=torch.tensor([prompt + gen[:steps]]), use_cache=False).logits[0].float()
    return logits.numpy().astype(np.float32), gen, full.numpy().astype(np.float32)


def margins_of(logits):
    s = np.sort(logits.astype(np.float64), axis=1)
    return s[:, -1] - s[:, -2]


def attempt(name, seed, outroot, steps=DECODE_STEPS):
    """One seed of one config. Returns a summary; writes the fixture under outroot/name/seed_N when it passes."""
    t0 = time.time()
    c = CONFIGS[name]
    spec = c["spec"]
    res = {"config": name, "seed": seed, "ok": False, "reasons": []}
    try:
        import torch
        torch.set_num_threads(1)
        import transformers
        model, torch = build_model(spec)
        global _REC
        if _REC is None:  # patch torch.topk once per process
            _REC = TopkRecorder(torch)
        rec = _REC
        rec.rows, rec.tag, rec.on = [], None, False
        rec.hook(model)
        sd = model.state_dict()
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
        int_bufs = {k: v.numpy().astype(np.int64) for k, v in sd.items() if not v.is_floating_point()}
        exp = expected_shapes(spec)
        res["shape_mismatch"] = sorted(set(f"{k}:{shapes.get(k)} vs {exp.get(k)}" for k in set(shapes) | set(exp)
                                           if shapes.get(k) != exp.get(k)))
        ple_ids = sorted(spec["ple_layer_ids"])
        res["ngram_buffers_match"] = True
        for lid in ple_ids:
            mult, sizes, offs, rows = ngram_constants(spec, ple_ids.index(lid))
            p = f"model.layers.{lid - 1}.ple.ple_embedding"
            ok = (int_bufs[p + ".layer_multipliers"].tolist() == mult and
                  int_bufs[p + ".ngram_heads_vocab_sizes"].tolist() == sizes and
                  int_bufs[p + ".ngram_heads_offsets"].tolist() == offs and
                  shapes[p + ".ngram_embedding.weight"][0] == rows)
            res["ngram_buffers_match"] &= ok
        vals = gen_values({k: v for k, v in shapes.items()}, seed, spec)
        prompt = prompt_ids(c)
        # calibrate the lm_head scale on the prompt (recording off), then pack for real
        loaded, _, _ = pack(spec, vals, int_bufs)
        load_into(model, torch, loaded, int_bufs)
        with torch.no_grad():
            l0 = model(input_ids=torch.tensor([prompt])).logits[0].float()
        lm_scale = TARGET_MAX_LOGIT / float(l0.abs().max())
        loaded, files, info = pack(spec, vals, int_bufs, lm_scale=lm_scale)
        load_into(model, torch, loaded, int_bufs)
        # every float the reference holds must be exactly the file's decoded value
        sd2 = model.state_dict()
        for k, v in loaded.items():
            assert np.array_equal(sd2[k].numpy(), v), f"{k}: reference does not hold the loaded values"
        rec.on = True
        logits, gen, full = run_reference(model, torch, rec, prompt, steps)
        rec.on = False
        T = len(prompt)
        marg = margins_of(logits)
        # ---- criteria
        ties = {}
        for kind in ("router", "indexer"):
            rs = [r for r in rec.rows if r["kind"] == kind]
            bs = [r for r in rs if "gap" in r]
            ties[kind] = {"calls": len(rs), "boundary_calls": len(bs),
                          "boundary_rows": sum(r["rows"] for r in bs),
                          "min_gap": min((r["gap"] for r in bs), default=None)}
            if bs:
                worst = min(bs, key=lambda r: r["gap"])
                ties[kind]["worst"] = worst
                per = {}
                for r in bs:
                    per[r["layer"]] = min(per.get(r["layer"], math.inf), r["gap"])
                ties[kind]["min_gap_per_layer"] = {str(k): v for k, v in sorted(per.items())}
            if kind == "router" and bs:
                ties[kind]["min_logit_gap"] = min(r["logit_gap"] for r in bs)
            if kind == "indexer" and bs:
                ties[kind]["zero_kth_calls"] = sum(1 for r in bs if r["kth"] == 0.0)
            if not rs:
                res["reasons"].append(f"no {kind} top-k captured (hook failed?)")
            elif ties[kind]["min_gap"] is not None and ties[kind]["min_gap"] < TIE_MIN:
                res["reasons"].append(f"{kind} tie gap {ties[kind]['min_gap']:.3g} (layer {ties[kind]['worst']['layer']}, "
                                      f"{ties[kind]['worst']['phase']})")
        greedy_rows = marg[T - 1:]
        if greedy_rows.min() < MARGIN_MIN:
            res["reasons"].append(f"greedy margin {greedy_rows.min():.3g} at row {T - 1 + int(greedy_rows.argmin())}")
        maxlog = float(np.abs(logits).max())
        if maxlog < 10.0:
            res["reasons"].append(f"max |logit| {maxlog:.3g} < 10")
        gen_check = [int(x) for x in logits[T - 1:].argmax(1)]
        assert gen_check == gen, "greedy ids do not match the argmax of the stored rows"
        cache_vs_full = float(np.abs(full - logits).max())
        res.update(ties=ties, max_abs_logit=maxlog, min_margin_prompt=float(marg[:T].min()),
                   min_margin_greedy=float(greedy_rows.min()), cache_vs_full_max_abs_diff=cache_vs_full,
                   lm_scale=lm_scale, seconds=time.time() - t0)
        res["ok"] = not res["reasons"]
        if not res["ok"]:
            return res
        # ---- write the fixture
        d = os.path.join(outroot, name, f"seed_{seed}")
        if os.path.exists(d):
            shutil.rmtree(d)
        total = write_checkpoint(d, spec, files, transformers.__version__)
        logits.astype("<f4").tofile(os.path.join(d, "logits.bin"))
        nvfp4_check, ngram_check, bf16_check = check_values(spec, loaded)
        meta = {
            "name": name, "description": c["description"], "seed": seed,
            "transformers_version": transformers.__version__, "torch_version": torch.__version__,
            "reference": "transformers.models.qwen4_exp Qwen4ExpForCausalLM, float32, attn_implementation=eager, "
                         f"experts_implementation={getattr(model.config, '_experts_implementation', None)}, CPU",
            "command": " ".join(["python3", "scripts/reference/make_fixtures.py"] + sys.argv[1:]),
            "text_config_args": spec,
            "prompt_ids": prompt, "prompt_len": T, "eos_token_id": spec["eos_token_id"],
            "eos_positions_in_prompt": [i for i, x in enumerate(prompt) if x == spec["eos_token_id"]],
            "decode_steps": steps, "generated_ids": gen,
            "logits": {"file": "logits.bin", "dtype": "float32", "byte_order": "little",
                       "shape": [T + steps, spec["vocab_size"]],
                       "rows": "row p = logits after position p of prompt_ids ++ generated_ids[0:decode_steps]; rows "
                               "0..prompt_len-1 come from the cached prefill, rows prompt_len.. from cached decode "
                               "steps; generated_ids[i] = argmax(row prompt_len-1+i)"},
            "top1_margins": marg.tolist(), "max_abs_logit": maxlog,
            "min_margin_prompt": float(marg[:T].min()), "min_margin_greedy": float(greedy_rows.min()),
            "tie_gaps": ties, "tie_min_required": TIE_MIN, "margin_min_required": MARGIN_MIN,
            "cache_vs_full_max_abs_diff": cache_vs_full, "lm_head_scale": lm_scale,
            "shape_mismatch_vs_model_md": res["shape_mismatch"], "ngram_buffers_match": res["ngram_buffers_match"],
            "nvfp4_weight_scale_2": info["nvfp4_scale_2"], "ngram_weight_scale": info["ngram_scale"],
            "nvfp4_check": nvfp4_check, "ngram_check": ngram_check, "bf16_check": bf16_check,
            "checkpoint_tensor_bytes": total,
        }
        meta["checkpoint_file_bytes"] = checkpoint_bytes(d)
        meta["config_roundtrip"] = config_roundtrip(d, model)
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(meta, f, indent=1)
        res["dir"] = d
        res["checkpoint_file_bytes"] = meta["checkpoint_file_bytes"]
        res["config_roundtrip"] = meta["config_roundtrip"]
        return res
    except Exception:  # noqa: BLE001
        res["reasons"].append("exception: " + traceback.format_exc()[-3000:])
        return res


def check_values(spec, loaded):
    """A few rows of what the reference held, for the independent check (check_fixture.py): rows of expert 1 of
    layer 0 (gate, up, down), three n-gram table rows of the last PLE layer, two lm_head rows."""
    L0, e, I = 0, 1, spec["moe_intermediate_size"]
    ple_ids = sorted(spec["ple_layer_ids"])
    gu = loaded[f"model.layers.{L0}.mlp.experts.gate_up_proj"][e]
    dn = loaded[f"model.layers.{L0}.mlp.experts.down_proj"][e]
    pre = f"model.language_model.layers.{L0}.mlp.experts.{e}"
    nv_rows = [0, 1, I - 1]
    dn_rows = [0, 2, spec["hidden_size"] - 1]
    nvfp4_check = [{"tensor": pre + ".gate_proj", "rows": nv_rows, "values": gu[:I][nv_rows].tolist()},
                   {"tensor": pre + ".up_proj", "rows": nv_rows, "values": gu[I:][nv_rows].tolist()},
                   {"tensor": pre + ".down_proj", "rows": dn_rows, "values": dn[dn_rows].tolist()}]
    lid = ple_ids[-1] - 1
    tab = loaded[f"model.layers.{lid}.ple.ple_embedding.ngram_embedding.weight"]
    trows = [0, tab.shape[0] // spec["split_ngram_parts"] + 3, tab.shape[0] - 1]
    ngram_check = {"tensor_prefix": f"model.language_model.layers.{lid}.ple.ple_embedding.ngram_embedding",
                   "rows": trows, "values": tab[trows].tolist()}
    bf16_check = {"tensor": "lm_head.weight", "rows": [0, 5], "values": loaded["lm_head.weight"][[0, 5]].tolist()}
    return nvfp4_check, ngram_check, bf16_check


def config_roundtrip(d, model):
    """Parse the written config.json with transformers and compare the text config with the one the reference ran."""
    try:
        from transformers.models.qwen4_exp import configuration_qwen4_exp as C
        with open(os.path.join(d, "config.json")) as f:
            cj = json.load(f)
        cj.pop("quantization_config")
        cfg = C.Qwen4ExpConfig(**{k: v for k, v in cj.items() if k not in ("architectures", "model_type",
                                                                              "transformers_version")})
        a, b = cfg.text_config.to_dict(), model.config.to_dict()
        diff = sorted(k for k in b if a.get(k) != b.get(k) and not k.startswith("_")
                      and k not in ("architectures", "transformers_version", "dtype", "torch_dtype"))
        return {"ok": not diff, "differing_fields": {k: [a.get(k), b.get(k)] for k in diff},
                "fields_only_in_file": sorted(set(a) - set(b))}
    except Exception as ex:  # noqa: BLE001
        return {"ok": False, "error": repr(ex)[:500]}


# ---------------------------------------------------------------------------------------------------------- driver
def _work(args):
    return attempt(*args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fixtures-out")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-seeds", type=int, default=96)
    ap.add_argument("--time-budget", type=float, default=200.0)
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    import multiprocessing as mp
    names = a.configs.split(",")
    tmp = os.path.join(a.out, "_attempts")
    os.makedirs(tmp, exist_ok=True)
    tasks = [(n, CONFIGS[n]["seed_base"] + i, tmp) for i in range(a.max_seeds) for n in names]
    t0 = time.time()
    results = {n: {} for n in names}
    chosen = {}
    ctx = mp.get_context("fork")
    with ctx.Pool(a.jobs) as pool:
        it = pool.imap_unordered(_work, tasks)
        while True:
            try:
                r = it.next(timeout=max(1.0, a.time_budget - (time.time() - t0)))
            except (StopIteration, mp.TimeoutError):
                break
            results[r["config"]][r["seed"]] = r
            print(f"[{time.time() - t0:6.1f}s] {r['config']} seed {r['seed']}: "
                  f"{'PASS' if r['ok'] else 'fail: ' + '; '.join(x[:300] for x in r['reasons'])}", flush=True)
            for n in names:
                if n in chosen:
                    continue
                base = CONFIGS[n]["seed_base"]
                s = base
                while s in results[n] and not results[n][s]["ok"]:
                    s += 1
                if s in results[n] and results[n][s]["ok"]:
                    chosen[n] = results[n][s]
            if len(chosen) == len(names) or time.time() - t0 > a.time_budget:
                break
        pool.terminate()
    summary = {}
    for n in names:
        if n not in chosen:  # fall back to any passing seed
            ok = sorted(s for s, r in results[n].items() if r["ok"])
            if ok:
                chosen[n] = results[n][ok[0]]
        tried = sorted(results[n])
        if n in chosen:
            r = chosen[n]
            dst = os.path.join(a.out, n)
            if os.path.exists(dst):
                shutil.rmtree(dst)
            shutil.move(r["dir"], dst)
            meta_p = os.path.join(dst, "expected.json")
            with open(meta_p) as f:
                meta = json.load(f)
            meta["seeds_tried_before"] = {str(s): results[n][s]["reasons"] for s in tried if s < r["seed"]}
            with open(meta_p, "w") as f:
                json.dump(meta, f, indent=1)
        summary[n] = {"chosen": chosen.get(n, {}).get("seed"), "tried": len(tried),
                      "passed": sum(1 for s in tried if results[n][s]["ok"]),
                      "fail_reasons_sample": [results[n][s]["reasons"] for s in tried[:6] if not results[n][s]["ok"]],
                      "chosen_summary": {k: v for k, v in chosen.get(n, {}).items() if k not in ("dir",)}}
    shutil.rmtree(tmp, ignore_errors=True)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps(summary, indent=1, default=str)[:20000])
    return 0 if len(chosen) == len(names) else 1


# ---------------------------------------------------------------------------------------------------------- self-test
def self_test():
    """numpy-only: encoders, packing and sizes for every config (no torch needed)."""
    # E4M3 round trip of every finite code
    codes = np.array([c for c in range(256) if not np.isnan(nq.E4M3_VALUES[c])], np.uint8)
    back = nq.e4m3_encode(nq.E4M3_VALUES[codes])
    assert np.array_equal(back[codes != 0x80], codes[codes != 0x80])
    assert nq.e4m3_encode(np.array([448.0, 500.0, -1e9, 0.0]))[[0, 1]].tolist() == [126, 126]
    assert float(nq.e4m3_decode(nq.e4m3_encode(np.array([1.0625])))[0]) == 1.0  # tie to even
    assert nq.bf16_bits(np.array([1.0], np.float32))[0] == 0x3F80
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    q = nq.nvfp4_quantize(w)
    err = np.abs(q["deq"] - w).max() / np.abs(w).max()
    assert err <= 1.0 / 6.0 + 1e-3, err  # half a step of the 4..6 interval, relative to the block max
    assert q["weight"].shape == (8, 32) and q["weight_scale"].shape == (8, 4)
    assert np.array_equal(nq.nvfp4_dequantize(q["weight"], q["weight_scale"], q["weight_scale_2"]), q["deq"])
    print("encoders ok; nvfp4 rel err", err)
    for name, c in CONFIGS.items():
        spec = c["spec"]
        sh = expected_shapes(spec)
        int_bufs = {}
        for lid in sorted(spec["ple_layer_ids"]):
            mult, sizes, offs, rows = ngram_constants(spec, sorted(spec["ple_layer_ids"]).index(lid))
            p = f"model.layers.{lid - 1}.ple.ple_embedding"
            int_bufs.update({p + ".layer_multipliers": np.array(mult, np.int64),
                             p + ".ngram_heads_vocab_sizes": np.array(sizes, np.int64),
                             p + ".ngram_heads_offsets": np.array(offs, np.int64)})
            print(name, "ple layer", lid, "mult", mult, "sizes", sizes[:4], "... rows", rows)
        vals = gen_values(sh, c["seed_base"], spec)
        loaded, files, info = pack(spec, vals, int_bufs)
        d = os.path.join("/tmp", "fx_selftest", name)
        shutil.rmtree(d, ignore_errors=True)
        total = write_checkpoint(d, spec, files, "selftest")
        nbytes = checkpoint_bytes(d)
        T = c["prompt_len"]
        logit_bytes = (T + DECODE_STEPS) * spec["vocab_size"] * 4
        print(f"{name}: {len(files)} files, tensors {total} B, checkpoint {nbytes} B, logits {logit_bytes} B, "
              f"prompt {prompt_ids(c)[:12]}...")
        assert nbytes < 1_000_000, f"{name}: checkpoint {nbytes} B is not under 1 MB"
        # a fake expected.json + logits so that check_fixture.py can be exercised here
        nv, ng, bc = check_values(spec, loaded)
        fake = np.random.default_rng(1).standard_normal((T + DECODE_STEPS, spec["vocab_size"])).astype(np.float32)
        fake.astype("<f4").tofile(os.path.join(d, "logits.bin"))
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump({"nvfp4_check": nv, "ngram_check": ng, "bf16_check": bc, "prompt_len": T,
                       "prompt_ids": prompt_ids(c), "eos_token_id": spec["eos_token_id"],
                       "generated_ids": [int(x) for x in fake[T - 1:].argmax(1)],
                       "top1_margins": margins_of(fake).tolist(),
                       "logits": {"file": "logits.bin", "shape": list(fake.shape)}}, f)
    if spec_g3_check():
        print("G.3 multipliers match docs/model.md")
    return 0


def spec_g3_check():
    mult, sizes, offs, rows = ngram_constants(G3, 0)
    assert mult == [4295158889763781, 17440218147737327, 1270917961434445], mult
    assert sizes == [1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049], sizes
    assert rows == 8216, rows
    return True


if __name__ == "__main__":
    sys.exit(main())
