// KernelPlan (see kernel_plan.h): the device and shape queries, made once per model load.
#include "cuda/model/kernel_plan.h"

#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "core/shard_plan.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/pdl.h"
#include "cuda/common/real_shape.h"
#include "cuda/kernels/moe_grouped.h"
#include "cuda/kernels/moe_nvfp4.h"

namespace fn {

KernelPlan plan_kernels(const ModelConfig& c, int tp_size) {
  namespace rs = real_shape;
  KernelPlan p;
  int device = 0, major = 0, minor = 0;
  FN_CUDA_CHECK(cudaGetDevice(&device));
  FN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  p.compute_capability = major * 10 + minor;
  const bool sm90 = major >= 9;
  p.pdl = sm90 && pdl_enabled();
  const RankDims rd = rank_dims(c, tp_size, 0);  // the same shapes on every rank
  const int64_t D = c.hidden_size, k = c.num_experts_per_tok;
  p.moe_gate_up_bulk = moe_gate_up_bulk_supported(static_cast<int>(k), rd.moe_inter, D);
  p.moe_grouped = moe_grouped_supported(D, rd.moe_inter, static_cast<int>(k));
  p.hc_down_fixed = c.hc_count == 4 && D == rs::kHidden;
  p.hc_mix_fixed = c.hc_lowrank == rs::kHcRank && D == rs::kHidden;
  p.gdn_fixed = c.linear_key_head_dim == rs::kGdnHeadDim &&
                c.linear_value_head_dim == rs::kGdnHeadDim &&
                c.linear_conv_kernel_dim == rs::kGdnConvKernel;
  p.moe_down_fixed = k == rs::kTopK && rd.moe_inter == rs::kMoeInter;
  p.router_fixed = c.num_experts == rs::kNumExperts && k == rs::kTopK;
  p.gdn_cluster = sm90 && p.gdn_fixed;
  p.fold_hc_inject = tp_size > 1;
  return p;
}

std::string describe_kernel_plan(const KernelPlan& p) {
  std::string fixed;
  const std::pair<bool, const char*> kinds[] = {{p.hc_down_fixed, "hc_down"},
                                                {p.hc_mix_fixed, "hc_mix"},
                                                {p.gdn_fixed, "gdn"},
                                                {p.moe_down_fixed, "moe_down"},
                                                {p.router_fixed, "router"}};
  for (const auto& [on, name] : kinds) {
    if (!on) continue;
    if (!fixed.empty()) fixed += ' ';
    fixed += name;
  }
  return fmt::format(
      "sm_{}, PDL {}, MoE gate+up {}, batched MoE {}, GDN {}, real-shape instances: {}, HC "
      "inject {}",
      p.compute_capability, p.pdl ? "on" : "off",
      p.moe_gate_up_bulk ? "bulk (+ down prefetch)" : "FP32",
      p.moe_grouped ? "grouped from 16 rows" : "per row", p.gdn_cluster ? "clusters" : "counters",
      fixed.empty() ? "none" : fixed, p.fold_hc_inject ? "folded into the HC read" : "separate");
}

}  // namespace fn
