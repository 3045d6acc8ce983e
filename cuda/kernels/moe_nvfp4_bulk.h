// The bulk-copy NVFP4 routed gate+up kernel (MoeGateUpParams::bulk, cuda/kernels/moe_nvfp4.h):
// sm_90+, the weights streamed into shared memory by cp.async.bulk (the TMA engine) through a ring
// of stages, the products on the tensor cores (mma.sync BF16, FP32 accumulate). Internal: called
// by launch_moe_gate_up_nvfp4 after its common parameter checks.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/kernels/moe_nvfp4.h"

namespace fn::detail {

/// Dynamic shared memory one CTA may use on sm_90 (227 KB).
inline constexpr size_t kMaxCtaSmem = 227 * 1024;

/// Consumer warps of the bulk gate+up kernel; each takes the same 128-column groups of every
/// chunk (groups w, w + kBulkGateUpWarps, ..., each row through its own involution of the group
/// numbers: group_of in moe_nvfp4_bulk.cu), at most kBulkGateUpGroups of them.
inline constexpr int kBulkGateUpWarps = 10;
inline constexpr int kBulkGateUpGroups = 2;

/// Whether the bulk gate+up kernel takes K = cols: a multiple of 256 (16-byte rows of codes and
/// of scales for the bulk copies) and at most kBulkGateUpWarps * kBulkGateUpGroups * 128 (2,560,
/// the real hidden_size). The device check (sm_90+) is the launcher's.
constexpr bool bulk_gate_up_cols_ok(int64_t cols) {
  return cols >= 256 && cols % 256 == 0 && cols <= kBulkGateUpWarps * kBulkGateUpGroups * 128;
}

/// Whether the bulk gate+up kernel takes top_k experts of [2 * inter, cols] on sm_count SMs:
/// bulk_gate_up_cols_ok(cols) and its shared memory (the ring and the partials of the largest
/// share) within the 227 KB a CTA may use. The device check (sm_90+) is the launcher's.
bool bulk_gate_up_shape_ok(int top_k, int64_t inter, int64_t cols, int sm_count);

/// Tokens one launch of the bulk gate+up kernel takes when `tokens` come side by side
/// (MoeGateUpParams::tokens; the one-token grid, each CTA taking its one-token share of every
/// token's routes, so each row is cut into chunks as alone): `tokens` halved (rounded up) until
/// the chunk lists and partials of a CTA's shares fit its shared memory with the ring, at least 1.
/// launch_moe_gate_up_bulk runs ceil(tokens / that) launches.
int64_t bulk_tokens_per_launch(int top_k, int64_t inter, int64_t cols, int sm_count,
                               int64_t tokens);

/// CTAs of the bulk gate+up grid for top_k * inter row pairs on sm_count SMs: one per SM, fewer
/// when there are fewer than 8 pairs per SM.
int bulk_gate_up_ctas(int top_k, int64_t inter, int sm_count);

/// Launches the bulk gate+up kernel (see moe_nvfp4_bulk.cu) for p.tokens tokens (their routes
/// back to back in each launch; bulk_tokens_per_launch tokens per launch). Throws
/// fn::Error(Internal) when the device is below sm_90, the shape fails bulk_gate_up_shape_ok for
/// one token, the weights are not 16-byte aligned or a down prefetch comes with tokens > 1;
/// fn::Error(Cuda) on a failed launch. Legal during stream capture.
void launch_moe_gate_up_bulk(const MoeGateUpParams& p, cudaStream_t stream);

}  // namespace fn::detail
