#!/usr/bin/env bash
# The transformers reference itself, timed: qwen4_exp of the
# GPU machine's transformers, eager PyTorch in BF16, on a slice of the real geometry
# (configs/qwen3.8-flash-next.json's widths, the first LAYERS layers: 3 GDN + 1 QSA + the PLE
# layer for 4) with random weights and a small n-gram table (ngram_vocab_size_base 200000; the
# full table does not fit in host memory), on GPU 0. Prefills CTX random ids in one forward,
# then decodes N greedy tokens one forward each (synchronised, wall clock) and prints ms/token,
# ms/layer and the 48-layer extrapolation. A context that fails (memory, time) falls back to a
# shorter one. Log and JSON under $OUT.
# Usage on the GPU machine: bash scripts/gpu/hf_reference_run.sh [LAYERS 4] [CTX 8192] [N 16]
# (FN_HF_TIMEOUT: seconds, default 180).
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/bench-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
CUDA_VISIBLE_DEVICES=0 timeout "${FN_HF_TIMEOUT:-180}" python3 - "${1:-4}" "${2:-8192}" "${3:-16}" \
  "$out/hf_reference.json" <<'PY' 2>&1 | tee "$out/hf_reference.log" | grep -vE "Warning|warn" | tail -n 20
import json, sys, time, traceback
import torch
from transformers.models.qwen4_exp import configuration_qwen4_exp as C
from transformers.models.qwen4_exp import modeling_qwen4_exp as M

layers, ctx, n, out_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
real = json.load(open("configs/qwen3.8-flash-next.json"))["text_config"]
keys = ["vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "linear_conv_kernel_dim", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
        "hc_count", "hc_lowrank", "ple_layer_ids", "ple_embed_dim", "ple_conv_kernel_size",
        "ngram_size", "heads_per_ngram", "make_ngram_vocab_size_divisible_by",
        "split_ngram_parts", "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim",
        "indexer_budget", "indexer_compress_ratio", "output_gate_type", "eos_token_id",
        "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "full_attention_interval"]
spec = {k: real[k] for k in keys if k in real}
spec.update(num_hidden_layers=layers, ngram_vocab_size_base=200000,
            layer_types=real["layer_types"][:layers])
torch.manual_seed(0)
tcfg = C.Qwen4ExpTextConfig(**spec)
t = time.time()
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = M.Qwen4ExpForCausalLM(tcfg)
model = model.to(torch.bfloat16).eval()
torch.cuda.synchronize()
params = sum(p.numel() for p in model.parameters())
print(f"transformers qwen4_exp: {layers} layers {tcfg.layer_types}, {params / 1e9:.2f} B params "
      f"(BF16, random init) built in {time.time() - t:.1f} s", flush=True)

def run(ctx):
    ids = torch.randint(16, tcfg.vocab_size - 16, (1, ctx), device="cuda")
    with torch.inference_mode():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        except TypeError:
            out = model(input_ids=ids, use_cache=True)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        pkv = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        del out
        times = []
        for _ in range(n + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=pkv, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            pkv = out.past_key_values
        return prefill_s, times[3:]

result = None
for c in [ctx] + [x for x in (2048, 512) if x < ctx]:
    try:
        prefill_s, times = run(c)
        times.sort()
        mean = sum(times) / len(times)
        med = times[len(times) // 2]
        result = dict(layers=layers, ctx=c, n=len(times), ms_per_token_mean=mean,
                      ms_per_token_median=med, ms_per_layer=mean / layers,
                      extrapolated_48_layers_ms=mean / layers * 48, prefill_s=prefill_s,
                      ngram_vocab_size_base=200000,
                      peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30)
        print(f"transformers reference TP=1 layers {layers} ctx {c}: {mean:.3f} ms/token "
              f"(median {med:.3f}; {mean / layers:.3f} ms/layer; 48 layers extrapolated "
              f"{mean / layers * 48:.1f} ms/token); prefill of {c} tokens {prefill_s:.1f} s; peak "
              f"{result['peak_mem_gib']:.1f} GiB", flush=True)
        break
    except Exception as e:  # noqa: BLE001 - report and try a shorter context
        print(f"ctx {c} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        traceback.print_exc(limit=3)
        torch.cuda.empty_cache()
if result:
    json.dump(result, open(out_path, "w"), indent=2)
PY
echo "== hf reference rc=${PIPESTATUS[0]}"
