// The small per-token kernels of the CUDA decode step (docs/model.md §C.1, §C.3, §C.7, §C.8): token
// embedding + widening, HC inject, router softmax + top-k (also per row for the prefill), and
// the scatter of a rank's logits for the gather.
// Called by the CUDA decode step. Every launcher is legal inside CUDA graph capture (per-token
// values such as the token id are read from device memory); deterministic, no float atomics.
// Every kernel here is a programmatic dependent launch when fn::pdl_enabled() (cuda/common/pdl.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fn {

/// Embedding and widening (docs/model.md §C.1): H[s*D + i] = float(table[token*D + i]) for every
/// stream s < hc_count. A token outside [0, vocab) writes H = 0 and sets *error_flag = 1 (the
/// flag is only ever set, never cleared: the engine zeroes it and checks it after the step).
struct EmbedParams {
  const uint16_t* table = nullptr;  ///< [vocab, hidden] BF16 bits (embed_tokens, replicated)
  int64_t vocab = 0;                ///< vocab_size (248320), rows of the table
  int64_t hidden = 0;               ///< hidden_size D (2560)
  const int32_t* token = nullptr;   ///< device scalar: the token id x_t
  float* H = nullptr;               ///< [hc_count * D] FP32 residual, stream-major
  int hc_count = 0;                 ///< hc_count (4), >= 1
  int32_t* error_flag = nullptr;    ///< device scalar; set to 1 on an out-of-range token
};

/// Launches one thread per element of the row. Throws fn::Error(Internal) on null pointers or
/// bad sizes; fn::Error(Cuda) on a failed launch.
void launch_embed(const EmbedParams& params, cudaStream_t stream);

/// HC inject (docs/model.md §C.3, after the block): H[s*D + i] += iota[s] * y[i], the product and
/// the sum each rounded once in FP32 (no FMA), exactly as fn::cpu::hc_inject.
struct HcInjectParams {
  float* H = nullptr;           ///< [hc_count * D] FP32 residual, updated in place
  const float* iota = nullptr;  ///< [hc_count] FP32 inject weights (from launch_hc_mix)
  const float* y = nullptr;     ///< [D] FP32 block output (after the all-reduce)
  int hc_count = 0;             ///< >= 1
  int64_t hidden = 0;           ///< D (2560)
};

/// Throws fn::Error(Internal) on null pointers or bad sizes; fn::Error(Cuda) on a failed launch.
void launch_hc_inject(const HcInjectParams& params, cudaStream_t stream);

/// Router (docs/model.md §C.7 step 1), the same function as fn::cpu::route_top_k: p =
/// softmax(logits) over all experts (FP32 values expf(l - max), FP64 sum), the top_k of p (higher p
/// first, equal p -> lower expert id first), w = p / sum(p_selected) (FP64 sum) when
/// norm_topk_prob, else p. A NaN in p (NaN or +Inf logits) ranks as -Inf, so ids stay distinct and
/// in range, and sets *error_flag = 4 when error_flag is given. Replicated: bitwise identical on
/// every rank.
struct RouterParams {
  const float* logits = nullptr;  ///< [E] FP32 router logits (W_r m')
  int num_experts = 0;            ///< E: 1..1024 (512 real, 8 tiny)
  int top_k = 0;                  ///< num_experts_per_tok: 1..min(E, 64) (10 real, 3 tiny)
  bool norm_topk_prob = true;     ///< renormalise the selected weights
  int32_t* ids = nullptr;         ///< [top_k] device: expert ids, best first
  float* weights = nullptr;       ///< [top_k] device: FP32 routing weights, same order
  int32_t* error_flag = nullptr;  ///< optional device scalar; set to 4 on NaN probabilities
};

/// One CTA of 512 threads (E <= 1024 in shared memory): the softmax, then each warp sorts 64
/// (p, id) keys (bitonic, in registers) and every candidate's rank is found by binary searches in
/// the other warps' lists (one thread per candidate and list, counts summed with integer atomics);
/// thread r < k writes place r. Measured on H200 (graph of 100 launches, E 512, k 10): 4.97 us per
/// launch (6.1 us with one thread per candidate searching every list and thread 0 writing the
/// weights; 17.6 us for the O(E^2 / threads) rank loop before that). A programmatic
/// dependent launch (cuda/common/pdl.h). Throws fn::Error(Internal) on null pointers or sizes out
/// of range; fn::Error(Cuda) on a failed launch.
void launch_router_topk(const RouterParams& params, cudaStream_t stream);

/// Router for `rows` rows (docs/model.md §C.7 step 1): row p is exactly launch_router_topk
/// (cuda/kernels/decode_ops.h) on logits + p * logits_stride, writing ids/weights + p * top_k (the
/// same kernel, the row taken from blockIdx.x: bitwise the same ids and weights). A NaN probability
/// in any row sets *error_flag = 4 when error_flag is given.
struct RouterRowsParams {
  const float* logits = nullptr;  ///< FP32 router logits; row p at logits + p * logits_stride
  int64_t logits_stride = 0;      ///< floats between rows, >= num_experts
  int64_t rows = 0;               ///< M, >= 0 (0 launches nothing)
  int num_experts = 0;            ///< E: 1..1024
  int top_k = 0;                  ///< 1..min(E, 64)
  bool norm_topk_prob = true;     ///< renormalise the selected weights
  int32_t* ids = nullptr;         ///< [rows, top_k] device: expert ids, best first
  float* weights = nullptr;       ///< [rows, top_k] device: FP32 routing weights, same order
  int32_t* error_flag = nullptr;  ///< optional device scalar; set to 4 on NaN probabilities
};

/// One CTA of 512 threads per row (grid.x = rows, up to 2^31 - 1). Throws fn::Error(Internal) on
/// null pointers or sizes out of range; fn::Error(Cuda) on a failed launch. Capturable.
void launch_router_topk_rows(const RouterRowsParams& params, cudaStream_t stream);

/// Logits scatter for the vocab-parallel lm_head (docs/model.md §C.8, §E.2): full[:] = 0, then
/// full[v_first + j] = local[j] for j < v_local, so that a SUM all-reduce of `full` over the
/// ranks is the all-gather of the rank slices (exact: every element has one non-zero term).
struct ScatterLogitsParams {
  const float* local = nullptr;  ///< [v_local] FP32 this rank's logits; must not alias full
  float* full = nullptr;         ///< [vocab] FP32
  int64_t v_local = 0;           ///< rows of this rank's lm_head slice, >= 0
  int64_t v_first = 0;           ///< first vocabulary id of the slice, >= 0
  int64_t vocab = 0;             ///< vocab_size, >= v_first + v_local, >= 1
};

/// Throws fn::Error(Internal) on null pointers or a slice outside the vocabulary;
/// fn::Error(Cuda) on a failed launch.
void launch_scatter_logits(const ScatterLogitsParams& params, cudaStream_t stream);

}  // namespace fn
