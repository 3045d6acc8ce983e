// The kernel plan of one CudaModel: which variant of each decode-step op runs, decided once at
// load from the device (compute capability, programmatic dependent launch) and the model's shapes
// at this rank, logged once at debug level and read by the step encoding (cuda/model/step*.cpp).
// Only genuine hardware and shape fallbacks are choices here; every variant the measurements
// settled is the step's only code.
#pragma once

#include <string>

#include "core/config.h"

namespace fn {

/// The variant of each decode-step op for one model on one device.
struct KernelPlan {
  int compute_capability = 0;  ///< major * 10 + minor of the current device (90 = sm_90)
  /// Programmatic dependent launches on (fn::pdl_enabled(), cuda/common/pdl.h, and sm_90+): each
  /// launcher then overlaps its weight loads with the previous kernel's tail.
  bool pdl = false;
  /// The routed gate+up on the bulk-copy kernel (MoeGateUpParams::bulk: sm_90+, hidden a
  /// multiple of 256 up to 2,560, moe_gate_up_bulk_supported), which also prefetches the
  /// selected experts' down weights into L2 (MoeGateUpParams::down_prefetch); false: the FP32
  /// kernel without that prefetch (another summation order, so other bits).
  bool moe_gate_up_bulk = false;
  /// A batched step's routed experts grouped by expert (launch_moe_grouped, cuda/kernels/
  /// moe_grouped.h: sm_90+ and its shapes, moe_grouped_supported) from 16 rows on; false: the
  /// decode kernels per row at every batch size.
  bool moe_grouped = false;
  /// The GDN recurrence in thread-block clusters of one key head's CTAs (GdnDecodeParams::cluster:
  /// sm_90+ and the real head shape; the launcher also checks the cluster fits); false: the
  /// arrival counters. The same bits.
  bool gdn_cluster = false;
  /// The compile-time real-shape kernel instances (cuda/common/real_shape.h) where the model's
  /// sizes at this rank are the real ones (each launcher still checks its own launch shape);
  /// false: the runtime-shape instances. The same bits.
  bool hc_down_fixed = false;   ///< HcDownParams::fixed_shape: hc_count 4, hidden 2,560
  bool hc_mix_fixed = false;    ///< HcMixParams::fixed_shape: hc_lowrank 320, hidden 2,560
  bool gdn_fixed = false;       ///< GdnDecodeParams::fixed_shape: dk = dv = 128, conv kernel 4
  bool moe_down_fixed = false;  ///< MoeDownParams::fixed_shape: top-k 10, intermediate 640
  bool router_fixed = false;    ///< RouterSharedGateUpParams::fixed_shape: 512 experts, top-k 10
  /// The HC inject after each block folded into the next HC read's down pass (HcDownParams::
  /// inject_y), which writes the injected residual to the other residual buffer: at TP > 1 only,
  /// where an all-reduce sits between the block and the read. At TP = 1 the separate inject
  /// launch is faster (it is the window in which the down pass's blocks become resident).
  bool fold_hc_inject = false;
};

/// The plan for `config` at `tp_size` ranks on the current CUDA device (the shapes are the same
/// on every rank). Throws fn::Error(Cuda) when a device query fails.
KernelPlan plan_kernels(const ModelConfig& config, int tp_size);

/// One line naming each choice, e.g. "sm_90, PDL on, MoE gate+up bulk, GDN clusters, real-shape
/// instances: hc_down hc_mix gdn moe_down router, HC inject separate".
std::string describe_kernel_plan(const KernelPlan& plan);

}  // namespace fn
