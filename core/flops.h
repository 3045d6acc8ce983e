// The floating-point work of a prefill pass, by op family (docs/model.md §C), for the TFLOP/s
// that FN_PREFILL_PROFILE and `fngen bench` print beside each family's time. Two operations per
// multiply-add of the model's math (the matrix products, the attention and indexer scores, the
// delta-rule recurrence); element-wise work (norms, activations, RoPE, convolutions, softmax) is
// not counted. The count is the whole model's, whatever the TP size, and it is the math's, not
// a kernel's (the prefill's hi + lo BF16 split runs the dense products twice; not counted).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"

namespace fn {

/// FLOPs per op family, in the order and with the names of the CUDA step families
/// ("hc", "gdn", "qsa", "router", "moe_routed", "shared_expert", "lm_head", "ple").
struct PrefillFlops {
  std::vector<std::pair<std::string, double>> families;
  /// The FLOPs of `family` (0 for a name not listed).
  double of(const std::string& family) const noexcept;
  /// The sum over the families.
  double total() const noexcept;
};

/// The FLOPs of running `tokens` prompt tokens at positions first_position ..
/// first_position + tokens - 1 through `c`, with the final mixer and lm_head on `logit_rows` of
/// them (1 for a prompt's TTFT, `tokens` for eval's every-row passes). Per token and layer:
///  - hc: each of the two hyper-connection reads 2·W·r (down) + 2·r·W (up) + 2·hc·W (inject),
///    W = hc_count · hidden, r = hc_lowrank (§C.3); the final mixer's read, without inject, per
///    logit row;
///  - gdn (linear-attention layers): 2·D·(2·Hk·dk + 2·Hv·dv + 2·Hv) for the input projections,
///    2·Hv·dv·D for out_proj, and 7·Hv·dk·dv for the recurrence (decay, S^T k, the rank-1
///    update, S^T q) (§C.5);
///  - qsa (full-attention layers): 2·D·(2·Hq·hd + 2·Hkv·hd + Hi·di + di) for the projections,
///    2·Hq·hd·D for o_proj, 4·Hq·hd per attended token (scores and values; every visible token
///    while the complete blocks fit the budget, else the selected blocks' tokens and the tail),
///    2·Hi·di per complete block for the indexer scores (§C.6);
///  - router 2·D·E; moe_routed top_k · 6·D·I; shared_expert 6·D·Is + 2·D (§C.7);
///  - ple (PLE layers): 2·P·W (key) + 2·P·D (value) (§C.4);
///  - lm_head 2·D·V per logit row (§C.8).
/// Throws fn::Error(Internal) for negative arguments or logit_rows > tokens.
PrefillFlops prefill_flops(const ModelConfig& c, int64_t first_position, int64_t tokens,
                           int64_t logit_rows);

}  // namespace fn
