// The floating-point work of a prefill pass (core/flops.h).
#include "core/flops.h"

#include <algorithm>

#include "core/error.h"

namespace fn {

double PrefillFlops::of(const std::string& family) const noexcept {
  for (const auto& [name, flops] : families)
    if (name == family) return flops;
  return 0;
}

double PrefillFlops::total() const noexcept {
  double sum = 0;
  for (const auto& f : families) sum += f.second;
  return sum;
}

PrefillFlops prefill_flops(const ModelConfig& c, int64_t first_position, int64_t tokens,
                           int64_t logit_rows) {
  FN_CHECK(first_position >= 0 && tokens >= 0 && logit_rows >= 0 && logit_rows <= tokens,
           "prefill_flops: position {}, {} tokens, {} logit rows", first_position, tokens,
           logit_rows);
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  const double D = d(c.hidden_size), W = d(c.hc_count * c.hidden_size), T = d(tokens);
  const double R = d(logit_rows);
  int64_t n_qsa = 0, n_gdn = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) (c.is_qsa(l) ? n_qsa : n_gdn) += 1;
  const double L = d(c.num_hidden_layers);

  const double hc_read = 2 * W * d(c.hc_lowrank) * 2;
  const double hc = L * T * 2 * (hc_read + 2 * d(c.hc_count) * W) + R * hc_read;

  const double hk = d(c.linear_num_key_heads), hv = d(c.linear_num_value_heads);
  const double dk = d(c.linear_key_head_dim), dv = d(c.linear_value_head_dim);
  const double gdn_token =
      2 * D * (2 * hk * dk + 2 * hv * dv + 2 * hv) + 2 * hv * dv * D + 7 * hv * dk * dv;
  const double gdn = d(n_gdn) * T * gdn_token;

  double qsa = 0;
  if (n_qsa > 0) {
    const double hq = d(c.num_attention_heads), hkv = d(c.num_key_value_heads);
    const double hd = d(c.head_dim), hi = d(c.indexer_n_heads), di = d(c.indexer_head_dim);
    const int64_t ratio = std::max<int64_t>(c.indexer_compress_ratio, 1);
    const int64_t top_blocks = c.indexer_budget / ratio;
    double attended = 0, blocks = 0;  // summed over the tokens
    for (int64_t t = first_position; t < first_position + tokens; ++t) {
      const int64_t n = t + 1, b = n / ratio;
      attended += d(b <= top_blocks ? n : top_blocks * ratio + n % ratio);
      blocks += d(b);
    }
    const double proj = 2 * D * (2 * hq * hd + 2 * hkv * hd + hi * di + di) + 2 * hq * hd * D;
    qsa = d(n_qsa) * (T * proj + 4 * hq * hd * attended + 2 * hi * di * blocks);
  }

  const double E = d(c.num_experts), k = d(c.num_experts_per_tok);
  const double router = L * T * 2 * D * E;
  const double routed = L * T * k * 6 * D * d(c.moe_intermediate_size);
  const double shared = L * T * (6 * D * d(c.shared_expert_intermediate_size) + 2 * D);
  const double P = d(c.ple_embed_dim > 0 ? c.ple_embed_dim : c.hidden_size);
  const double ple = d(static_cast<int64_t>(c.ple_layer_ids.size())) * T * (2 * P * W + 2 * P * D);
  const double lm_head = R * 2 * D * d(c.vocab_size);

  PrefillFlops out;
  out.families = {{"hc", hc},
                  {"gdn", gdn},
                  {"qsa", qsa},
                  {"router", router},
                  {"moe_routed", routed},
                  {"shared_expert", shared},
                  {"lm_head", lm_head},
                  {"ple", ple}};
  return out;
}

}  // namespace fn
