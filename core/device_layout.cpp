// DeviceLayout (see device_layout.h): the sizes of the CUDA model's non-weight buffers.
#include "core/device_layout.h"

#include <algorithm>

#include "core/error.h"
#include "core/memory_plan.h"
#include "core/shard_plan.h"

namespace fn {
namespace {

constexpr uint64_t kAlign = 256;

uint64_t align256(uint64_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

// The activation pieces, in carve order, with their element counts and sizes.
void lay_out_activations(DeviceLayout& l, const ModelConfig& c, const RankDims& rd) {
  const int64_t D = c.hidden_size, W = c.hc_width(), R = c.hc_lowrank, S = c.hc_count;
  const int64_t k = c.num_experts_per_tok;
  const int64_t splits = hc_down_partials(S, D);
  const bool ple = c.has_ple();
  struct Spec {
    Activation id;
    const char* name;
    int64_t count;
    int64_t element_bytes;
  };
  const Spec specs[kActivationCount] = {
      {Activation::H, "H", W, 4},
      {Activation::HAlt, "H_alt", W, 4},
      {Activation::HcPartials, "hc_partials", splits * (R + S), 4},
      {Activation::HcSumSq, "hc_sumsq", splits, 4},
      {Activation::M, "m", D, 4},
      {Activation::MBf16, "m_bf16", D, 2},
      {Activation::Iota, "iota", S, 4},
      {Activation::Proj, "proj", l.max_in_rows, 4},
      {Activation::MixOut, "mix_out", l.max_mix, 2},
      {Activation::Y, "y", D, 4},
      {Activation::RouterLogits, "router_logits", c.num_experts + 1, 4},
      {Activation::ExpertIds, "expert_ids", k, 4},
      {Activation::RoutingWeights, "routing_weights", k, 4},
      {Activation::ExpertH, "expert_h", k * rd.moe_inter, 2},
      {Activation::SharedGateUp, "shared_gate_up", 2 * rd.shared_inter, 4},
      {Activation::PleEmbedding, "ple_embedding", ple ? c.ple_embed_dim : 1, 4},
      {Activation::PleKv, "ple_kv", ple ? S * c.ple_embed_dim + D : 1, 4},
      {Activation::LogitsLocal, "logits_local", c.vocab_size / l.tp_size, 4},
      {Activation::Logits, "logits", c.vocab_size, 4},
      {Activation::Token, "token", 1, 4},
      {Activation::Position, "position", 1, 8},
      {Activation::Context, "ngram_context", std::max<int64_t>(c.ngram_size - 1, 1), 8},
      {Activation::ErrorFlag, "error_flag", 1, 4},
      {Activation::SampleStep, "sample_step", 1, 8},
  };
  uint64_t offset = 0;
  for (int i = 0; i < kActivationCount; ++i) {
    const Spec& s = specs[i];
    FN_CHECK(static_cast<int>(s.id) == i, "activation {} out of order", s.name);
    ActivationPiece& p = l.activations[static_cast<std::size_t>(i)];
    p.name = s.name;
    p.count = std::max<int64_t>(s.count, 1);
    p.element_bytes = s.element_bytes;
    p.offset = offset;
    p.bytes = align256(static_cast<uint64_t>(p.count) * static_cast<uint64_t>(s.element_bytes));
    offset += p.bytes;
  }
  l.activation_bytes = offset;
}

}  // namespace

int64_t hc_down_partials(int64_t hc_count, int64_t hidden) {
  constexpr int64_t kChunkVectors = 160;  // 1280 columns of 8-element vectors
  return hc_count * ((hidden / 8 + kChunkVectors - 1) / kChunkVectors);
}

uint64_t DeviceLayout::kv_cache_total() const {
  return static_cast<uint64_t>(qsa_layers) * (k_cache + v_cache);
}
uint64_t DeviceLayout::indexer_cache_total() const {
  return static_cast<uint64_t>(qsa_layers) * (raw_keys + block_keys);
}
uint64_t DeviceLayout::gdn_state_total() const {
  return static_cast<uint64_t>(gdn_layers) * gdn_state;
}
uint64_t DeviceLayout::gdn_conv_state_total() const {
  return static_cast<uint64_t>(gdn_layers) * gdn_conv_state;
}
uint64_t DeviceLayout::ple_conv_state_total() const {
  return static_cast<uint64_t>(ple_layers) * ple_conv_state;
}
uint64_t DeviceLayout::scratch_total() const {
  return activation_bytes + static_cast<uint64_t>(qsa_layers) * qsa_workspace +
         static_cast<uint64_t>(gdn_layers) * (gdn_counters + gdn_output) + router_mailbox +
         history + sampling_estimate;
}

DeviceLayout device_layout(const ModelConfig& c, int tp_size, int tp_rank, int64_t ctx_size) {
  FN_REQUIRE(ctx_size >= 1, Usage, "-c/--ctx-size must be >= 1, got {}", ctx_size);
  FN_CHECK(tp_size >= 1 && tp_rank >= 0 && tp_rank < tp_size, "tp_rank {} of tp_size {}", tp_rank,
           tp_size);
  DeviceLayout l;
  l.tp_size = tp_size;
  l.tp_rank = tp_rank;
  l.ctx_size = ctx_size;
  l.qsa_layers = c.num_qsa_layers();
  l.gdn_layers = c.num_gdn_layers();
  l.ple_layers = static_cast<int64_t>(c.ple_layer_ids.size());
  const RankDims rd = rank_dims(c, tp_size, tp_rank);
  const auto u = [](int64_t n) { return static_cast<uint64_t>(n); };
  const int64_t T = ctx_size;
  if (l.qsa_layers > 0) {
    const int64_t kv_row = rd.kv_heads * c.head_dim;
    l.k_cache = u(T * kv_row) * 2;
    l.v_cache = u(T * kv_row) * 2;
    l.raw_keys = u(T * c.indexer_head_dim) * 4;
    l.block_keys = u(std::max<int64_t>(T / c.indexer_compress_ratio, 1) * c.indexer_head_dim) * 4;
    l.qsa_workspace = qsa_workspace_estimate(c, tp_size, T);
    l.max_in_rows = rd.q_heads * 2 * c.head_dim + 2 * kv_row + c.indexer_proj_rows();
    l.max_mix = rd.q_heads * c.head_dim;
  }
  if (l.gdn_layers > 0) {
    const int64_t Hv = rd.linear_v_heads, dv = c.linear_value_head_dim;
    l.gdn_conv_state = u(rd.gdn_conv_dim * (c.linear_conv_kernel_dim - 1)) * 4;
    l.gdn_state = u(Hv * c.linear_key_head_dim * dv) * 4;
    l.gdn_counters = u(Hv + rd.linear_k_heads + 2) * 4;
    l.gdn_output = u(Hv * dv) * 4;
    l.max_in_rows = std::max(l.max_in_rows, rd.gdn_conv_dim + Hv * dv + 2 * Hv);
    l.max_mix = std::max(l.max_mix, Hv * dv);
  }
  if (l.ple_layers > 0)
    l.ple_conv_state = u(c.hc_width() * (c.ple_conv_kernel_size - 1) * c.ple_conv_dilation()) * 4;
  l.router_mailbox = u(c.num_experts) * 4;
  lay_out_activations(l, c, rd);
  l.history = u(T + 1) * 4;
  l.sampling_estimate = u(24 * c.vocab_size) + (uint64_t{1} << 20);
  return l;
}

}  // namespace fn
