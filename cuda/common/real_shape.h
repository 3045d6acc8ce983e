// The real Qwen3.8-Flash-Next text model's sizes (docs/model.md §A.2;
// configs/qwen3.8-flash-next.json) that the decode kernels' compile-time-shape instances are built
// for (cuda/kernels/hc.cu, gdn.cu, moe_nvfp4.cu, moe_shared.cu, qsa.cu). One place, so that every
// fixed instance targets the same model; a launcher runs its fixed instance only when the launch's
// runtime sizes equal these, and the runtime-shape instance otherwise. Constants only; usable from
// host and device code.
#pragma once

namespace fn::real_shape {

constexpr int kHidden = 2560;      ///< hidden_size (D)
constexpr int kHcRank = 320;       ///< hc_lowrank (r)
constexpr int kGdnHeadDim = 128;   ///< linear_key_head_dim = linear_value_head_dim
constexpr int kGdnConvKernel = 4;  ///< linear_conv_kernel_dim
constexpr int kNumExperts = 512;   ///< num_experts (E)
constexpr int kTopK = 10;          ///< num_experts_per_tok
constexpr int kMoeInter = 640;     ///< moe_intermediate_size at TP=1
constexpr int kQsaQPerKv = 12;     ///< num_attention_heads / num_key_value_heads (24 / 2)
constexpr int kQsaHeadDim = 256;   ///< head_dim

}  // namespace fn::real_shape
