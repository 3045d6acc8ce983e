// BF16 GEMV kernels (see gemv_bf16.h). One kernel template, instantiated for rows per team
// {1, 2, 4} x input {BF16, FP32} x output {FP32, BF16}: 12 variants, chosen at launch from the
// params (the plan is fixed per shape, so a decode step always runs the same variant).
#include "cuda/kernels/gemv_bf16.h"

#include <cuda_runtime.h>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/kernels/gemv_bf16.cuh"

namespace fn {
namespace {

constexpr int kBlockThreads = 256;  // 8 warps: enough resident warps per SM at 2+ blocks/SM
// The overlapped launch stages x (FP32) in shared memory: at most 32 KiB, inside the 48 KiB a
// block may take without the opt-in attribute beside team_reduce's static shared memory.
constexpr int64_t kOverlapMaxCols = 8192;

struct GemvArgs {
  const uint16_t* weight;
  int64_t rows;
  int64_t ld;
  int nvec;  // cols / 8: 16-byte vectors per row
  int team_log2;
  const void* x;
  void* y;
  int64_t skip_at, skip;  // GemvBf16Params::skip_at / skip
  unsigned* done_word;    // GemvBf16Params::done_word
};

// x FP32 staged in shared memory by the whole block through L2 (__ldcg: it was written by a kernel
// several launches back, so no L1 line of it may be trusted without a programmatic wait), then
// read eight values at a time: the floats of dev::GemvXGlobal<true>, so the same row sums.
struct GemvXStagedF32 {
  const float* x;
  float* s;   // shared memory, [4 * nvec4]
  int nvec4;  // cols / 4
  __device__ __forceinline__ void prepare() const {
    for (int i = threadIdx.x; i < nvec4; i += kBlockThreads)
      reinterpret_cast<float4*>(s)[i] = __ldcg(reinterpret_cast<const float4*>(x) + i);
    __syncthreads();
  }
  __device__ __forceinline__ void load8(int v, float (&xf)[8]) const {
    const float4* s4 = reinterpret_cast<const float4*>(s);
    dev::unpack8(s4[2 * v], s4[2 * v + 1], xf);
  }
};

// The launch that overlaps its predecessor (GemvBf16Params::no_pdl_wait): it lets its successor
// launch at once and computes and stores without a programmatic wait. x FP32 (staged in shared
// memory), y FP32; the rows of gemv_bf16_kernel<kRows, true, false> bit for bit.
template <int kRows>
__global__ void __launch_bounds__(kBlockThreads) gemv_bf16_overlap_kernel(GemvArgs a) {
  extern __shared__ __align__(16) float x_smem[];
  dev::pdl_launch_dependents();
  float acc[kRows];
  int lane = 0;
  const dev::GemvRows g{a.weight, a.rows, a.ld, a.nvec, a.team_log2, a.skip_at, a.skip};
  const GemvXStagedF32 xs{static_cast<const float*>(a.x), x_smem, 2 * a.nvec};
  const int64_t row0 = dev::gemv_bf16_team_rows<kRows, kBlockThreads, GemvXStagedF32, true>(
      g, blockIdx.x, xs, acc, &lane);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (row0 + r < a.rows) static_cast<float*>(a.y)[dev::gemv_row(g, row0 + r)] = acc[r];
  }
  if (a.done_word != nullptr) {  // the block's rows are out: one signal (dev::join_signal)
    __syncthreads();
    if (threadIdx.x == 0) dev::join_signal(a.done_word);
  }
}

// One team of (1 << team_log2) lanes computes kRows consecutive rows (dev::gemv_bf16_team_rows,
// cuda/kernels/gemv_bf16.cuh: the weight preload before the programmatic-dependent wait, the dot,
// the fixed-order team reduction); the team's lane 0 stores them.
template <int kRows, bool kXF32, bool kYBf16>
__global__ void __launch_bounds__(kBlockThreads) gemv_bf16_kernel(GemvArgs a) {
  float acc[kRows];
  int lane = 0;
  const dev::GemvRows g{a.weight, a.rows, a.ld, a.nvec, a.team_log2, a.skip_at, a.skip};
  const int64_t row0 = dev::gemv_bf16_team_rows<kRows, kBlockThreads>(
      g, blockIdx.x, dev::GemvXGlobal<kXF32>{a.x}, acc, &lane);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < a.rows) {
        const int64_t row = dev::gemv_row(g, row0 + r);
        if constexpr (kYBf16)
          static_cast<uint16_t*>(a.y)[row] = dev::float_to_bf16_bits(acc[r]);
        else
          static_cast<float*>(a.y)[row] = acc[r];
      }
    }
  }
  if (a.done_word != nullptr) {  // the block's rows are out: one signal (dev::join_signal)
    __syncthreads();
    if (threadIdx.x == 0) dev::join_signal(a.done_word);
  }
}

template <int kRows>
void dispatch_dtypes(const GemvArgs& a, bool x_f32, bool y_bf16, bool overlap, int64_t blocks,
                     cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(blocks)), block(kBlockThreads);
  constexpr const char* kName = "gemv_bf16_kernel";
  if (overlap) {  // x and y FP32 (checked by the launcher)
    launch_pdl("gemv_bf16_overlap_kernel", gemv_bf16_overlap_kernel<kRows>, grid, block,
               static_cast<size_t>(a.nvec) * 8 * sizeof(float), stream, a);
  } else if (x_f32) {
    if (y_bf16)
      launch_pdl(kName, gemv_bf16_kernel<kRows, true, true>, grid, block, 0, stream, a);
    else
      launch_pdl(kName, gemv_bf16_kernel<kRows, true, false>, grid, block, 0, stream, a);
  } else {
    if (y_bf16)
      launch_pdl(kName, gemv_bf16_kernel<kRows, false, true>, grid, block, 0, stream, a);
    else
      launch_pdl(kName, gemv_bf16_kernel<kRows, false, false>, grid, block, 0, stream, a);
  }
}

int64_t blocks_for(int64_t rows, int rows_per_team, int team_threads) {
  const int64_t rows_per_block =
      static_cast<int64_t>(rows_per_team) * (kBlockThreads / team_threads);
  return (rows + rows_per_block - 1) / rows_per_block;
}

using detail::aligned;

}  // namespace

GemvBf16Plan plan_gemv_bf16(int64_t rows, int64_t cols, int sm_count) {
  const int64_t nvec = cols / 8;
  const int64_t target = 2 * static_cast<int64_t>(sm_count > 0 ? sm_count : 1);
  GemvBf16Plan plan{};
  for (int rows_per_team : {4, 2, 1}) {
    // Narrowest team with at most 16 vectors per lane per row.
    int team = 8;
    while (team < kBlockThreads && static_cast<int64_t>(team) * 16 < nvec) team *= 2;
    // Widen while the grid is too small, keeping at least 2 vectors per lane.
    while (blocks_for(rows, rows_per_team, team) < target && team < kBlockThreads &&
           nvec >= 4 * static_cast<int64_t>(team))
      team *= 2;
    plan = {rows_per_team, team, blocks_for(rows, rows_per_team, team)};
    if (plan.blocks >= target) break;
  }
  return plan;
}

GemvBf16Plan plan_gemv_bf16_part(const GemvBf16Plan& whole, int64_t rows, int rows_per_team) {
  return {rows_per_team, whole.team_threads, blocks_for(rows, rows_per_team, whole.team_threads)};
}

void launch_gemv_bf16(const GemvBf16Params& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_gemv_bf16";
  FN_LAUNCH_REQUIRE(p.weight != nullptr && p.x != nullptr && p.y != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.rows >= 1 && p.cols >= 8 && p.cols % 8 == 0, kOp);
  FN_LAUNCH_REQUIRE(p.ld >= p.cols && p.ld % 8 == 0, kOp);
  FN_LAUNCH_REQUIRE(p.cols / 8 <= INT32_MAX, kOp);
  FN_LAUNCH_REQUIRE(aligned(p.weight, 16) && aligned(p.x, 16), kOp);
  FN_LAUNCH_REQUIRE(p.x_dtype == DType::BF16 || p.x_dtype == DType::F32, kOp);
  FN_LAUNCH_REQUIRE(p.y_dtype == DType::F32 || p.y_dtype == DType::BF16, kOp);
  FN_LAUNCH_REQUIRE(!p.no_pdl_wait || (p.x_dtype == DType::F32 && p.y_dtype == DType::F32 &&
                                       p.cols <= kOverlapMaxCols),
                    kOp);
  FN_LAUNCH_REQUIRE(p.skip_at >= 0 && p.skip >= 0, kOp);
  GemvBf16Plan plan = p.plan;
  if (plan.team_threads == 0) plan = plan_gemv_bf16(p.rows, p.cols, detail::current_sm_count());
  const int t = plan.team_threads;
  FN_LAUNCH_REQUIRE(t >= 8 && t <= kBlockThreads && (t & (t - 1)) == 0, kOp);
  FN_LAUNCH_REQUIRE(plan.rows_per_team == 1 || plan.rows_per_team == 2 || plan.rows_per_team == 4,
                    kOp);
  FN_LAUNCH_REQUIRE(plan.blocks == blocks_for(p.rows, plan.rows_per_team, t), kOp);
  FN_LAUNCH_REQUIRE(plan.blocks <= INT32_MAX, kOp);
  FN_LAUNCH_REQUIRE(p.done_word == nullptr || plan.blocks <= 0xffff, kOp);  // its signals

  GemvArgs a{};
  a.weight = p.weight;
  a.rows = p.rows;
  a.ld = p.ld;
  a.nvec = static_cast<int>(p.cols / 8);
  a.team_log2 = __builtin_ctz(static_cast<unsigned>(t));
  a.x = p.x;
  a.y = p.y;
  a.skip_at = p.skip_at;
  a.skip = p.skip;
  a.done_word = p.done_word;
  const bool x_f32 = p.x_dtype == DType::F32, y_bf16 = p.y_dtype == DType::BF16;
  switch (plan.rows_per_team) {
    case 4:
      dispatch_dtypes<4>(a, x_f32, y_bf16, p.no_pdl_wait, plan.blocks, stream);
      break;
    case 2:
      dispatch_dtypes<2>(a, x_f32, y_bf16, p.no_pdl_wait, plan.blocks, stream);
      break;
    default:
      dispatch_dtypes<1>(a, x_f32, y_bf16, p.no_pdl_wait, plan.blocks, stream);
      break;
  }
  FN_CUDA_LAUNCH_CHECK("gemv_bf16_kernel");
}

void launch_gemv_bf16(const uint16_t* weight, int64_t rows, int64_t cols, const void* x,
                      DType x_dtype, void* y, DType y_dtype, cudaStream_t stream) {
  GemvBf16Params g;
  g.weight = weight;
  g.rows = rows;
  g.cols = cols;
  g.ld = cols;
  g.x = x;
  g.x_dtype = x_dtype;
  g.y = y;
  g.y_dtype = y_dtype;
  launch_gemv_bf16(g, stream);
}

}  // namespace fn
