// Fused MoE shared-expert kernels of the decode step (see moe_shared.h). The GEMV rows are
// dev::gemv_bf16_team_rows (cuda/kernels/gemv_bf16.cuh), the top-k dev::router_topk_block, the
// SwiGLU element and the gate's sigmoid come from cuda/kernels/moe_device.cuh: the separate
// launches (launch_gemv_bf16, launch_router_topk, the prefill's launch_swiglu_rows and
// launch_moe_combine_rows) run the same device code, hence the same bits.
#include "cuda/kernels/moe_shared.h"

#include <cuda_runtime.h>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/common/real_shape.h"
#include "cuda/kernels/gemv_bf16.cuh"
#include "cuda/kernels/gemv_bf16.h"
#include "cuda/kernels/moe_device.cuh"

namespace fn {
namespace {

// ---- router + shared gate/up + top-k -----------------------------------------------------------

// 512 threads: the top-k block code needs exactly dev::kRouterThreads; a GEMV row's bits depend
// only on its team width (cuda/kernels/gemv_bf16.cuh), not on the block size.
constexpr int kRouterBlockThreads = dev::kRouterThreads;

struct RouterGateUpArgs {
  dev::GemvRows seg[2];    // 0: router (+ shared-expert gate) rows, 1: shared gate/up rows
  int rows_per_team[2];    // 1, 2 or 4
  unsigned router_blocks;  // blocks [0, router_blocks) hold segment 0, the rest segment 1
  const float* x;
  float* y[2];  // logits, gate_up
  int num_experts;
  int top_k;
  bool norm;
  int32_t* ids;
  float* weights;
  int32_t* flag;
  float* mailbox;  // [num_experts]: dev::mail_post / router_mail_take
};

// The team's rows of segment g into y; rows below `mail_rows` (the router's experts; 0 for the
// shared gate/up) are also posted to the mailbox.
template <int kRows>
__device__ __forceinline__ void store_rows(const dev::GemvRows& g, int64_t block, const float* x,
                                           float* y, float* mail, int64_t mail_rows) {
  float acc[kRows];
  int lane = 0;
  const int64_t row0 = dev::gemv_bf16_team_rows<kRows, kRouterBlockThreads>(
      g, block, dev::GemvXGlobal<true>{x}, acc, &lane);
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r;
    if (row < g.rows) y[row] = acc[r];
    if (row < mail_rows) dev::mail_post(mail + row, acc[r], dev::kRouterNanPost);
  }
}

// The instance <kFixedExperts, kFixedTopK> runs the real router (E 512, k 10) with the top-k's
// sizes as constants; <0, 0> any other; the same operations, the same bits.
constexpr int kFixedExperts = real_shape::kNumExperts;
constexpr int kFixedTopK = real_shape::kTopK;

template <int kE = 0, int kK = 0>
__global__ void __launch_bounds__(kRouterBlockThreads)
    router_shared_gate_up_kernel(RouterGateUpArgs a) {
  const bool router = blockIdx.x < a.router_blocks;
  const int s = router ? 0 : 1;
  const int64_t block = router ? blockIdx.x : blockIdx.x - a.router_blocks;
  const int E = kE > 0 ? kE : a.num_experts;
  const int64_t mail_rows = router ? E : 0;
  // Block-uniform branch (rows per team is fixed per segment); the PDL wait is inside.
  switch (a.rows_per_team[s]) {
    case 4:
      store_rows<4>(a.seg[s], block, a.x, a.y[s], a.mailbox, mail_rows);
      break;
    case 2:
      store_rows<2>(a.seg[s], block, a.x, a.y[s], a.mailbox, mail_rows);
      break;
    default:
      store_rows<1>(a.seg[s], block, a.x, a.y[s], a.mailbox, mail_rows);
      break;
  }
  // The last router block, after its own rows, takes every router logit from the mailbox as it
  // is posted (no arrival ticket: no fence or atomic in any block) and runs the top-k. Every
  // other block is done.
  if (blockIdx.x + 1u != a.router_blocks) return;
  float l0, l1;
  dev::router_mail_take(a.mailbox, E, l0, l1);
  dev::router_topk_values(l0, l1, E, kK > 0 ? kK : a.top_k, a.norm, a.ids, a.weights, a.flag);
}

// ---- SwiGLU + shared down + combine ------------------------------------------------------------

constexpr int kDownBlockThreads = 256;   // launch_gemv_bf16's block size (any would do)
constexpr int64_t kMaxDownInter = 8192;  // h in shared memory: 32 KB of FP32

// x of the down GEMV: h = bf16(silu(g) * u) computed once per block into shared memory (as the
// exact floats of the BF16 values that launch_swiglu_rows stores and launch_gemv_bf16 widens). g
// and u come from the router + shared gate/up launch, three launches back in the step (the routed
// experts' two sit in between): read through L2 before the PDL wait (cuda/common/pdl.cuh).
struct SwigluXShared {
  const float* gate_up;
  int inter;
  float* h;  // shared memory, [inter]
  __device__ __forceinline__ void prepare() const {
    for (int i = threadIdx.x; i < inter; i += kDownBlockThreads)
      h[i] = __uint_as_float(static_cast<uint32_t>(dev::swiglu_bf16_bits(
                                 __ldcg(gate_up + i), __ldcg(gate_up + inter + i)))
                             << 16);
    __syncthreads();
  }
  __device__ __forceinline__ void load8(int v, float (&xf)[8]) const {
    const float4* h4 = reinterpret_cast<const float4*>(h);
    dev::unpack8(h4[2 * v], h4[2 * v + 1], xf);
  }
};

template <int kRows>
__global__ void __launch_bounds__(kDownBlockThreads)
    shared_down_combine_kernel(dev::GemvRows g, const float* gate_up, const float* gate_logit,
                               float* y, L2Prefetch prefetch) {
  extern __shared__ float4 h_smem[];
  float acc[kRows];
  int lane = 0;
  const SwigluXShared xs{gate_up, g.nvec * 8, reinterpret_cast<float*>(h_smem)};
  const int64_t row0 = dev::gemv_bf16_team_rows<kRows, kDownBlockThreads, SwigluXShared, true>(
      g, blockIdx.x, xs, acc, &lane);
  // The block's rows are done (its loads landed): its share of the prefetch, then the wait.
  if (threadIdx.x == 0) dev::l2_prefetch_part(prefetch, blockIdx.x, gridDim.x);
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  // After the wait: y is the routed experts' output.
  if (lane != 0) return;
  const float gamma = dev::sigmoid_2branch(*gate_logit);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r;
    if (row < g.rows) y[row] = fmaf(gamma, acc[r], y[row]);
  }
}

int64_t blocks_for(int64_t rows, int rows_per_team, int team_threads, int block_threads) {
  const int64_t rows_per_block =
      static_cast<int64_t>(rows_per_team) * (block_threads / team_threads);
  return (rows + rows_per_block - 1) / rows_per_block;
}

using detail::aligned;

}  // namespace

void launch_router_shared_gate_up(const RouterSharedGateUpParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_router_shared_gate_up";
  FN_LAUNCH_REQUIRE(p.x != nullptr && p.router_weight != nullptr && p.gate_up_weight != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(p.logits != nullptr && p.gate_up != nullptr && p.ids != nullptr &&
                        p.weights != nullptr && p.mailbox != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(p.hidden >= 8 && p.hidden % 8 == 0 && p.hidden / 8 <= INT32_MAX, kOp);
  FN_LAUNCH_REQUIRE(p.inter >= 1 && p.inter <= INT32_MAX / 2, kOp);
  FN_LAUNCH_REQUIRE(p.num_experts >= 1 && p.num_experts <= dev::kMaxExperts, kOp);
  FN_LAUNCH_REQUIRE(p.top_k >= 1 && p.top_k <= p.num_experts && p.top_k <= dev::kMaxTopK, kOp);
  FN_LAUNCH_REQUIRE(
      aligned(p.x, 16) && aligned(p.router_weight, 16) && aligned(p.gate_up_weight, 16), kOp);
  const int sm = detail::current_sm_count();
  const int64_t rows[2] = {p.num_experts + int64_t{1}, 2 * p.inter};
  const uint16_t* weight[2] = {p.router_weight, p.gate_up_weight};
  RouterGateUpArgs a{};
  int64_t blocks[2];
  for (int s = 0; s < 2; ++s) {
    // launch_gemv_bf16's plan for the segment alone: its team width fixes the bits.
    const GemvBf16Plan plan = plan_gemv_bf16(rows[s], p.hidden, sm);
    const int t = plan.team_threads;
    FN_LAUNCH_REQUIRE(t >= 8 && t <= 256 && (t & (t - 1)) == 0, kOp);
    a.seg[s] = {weight[s], rows[s], p.hidden, static_cast<int>(p.hidden / 8),
                __builtin_ctz(static_cast<unsigned>(t))};
    a.rows_per_team[s] = plan.rows_per_team;
    blocks[s] = blocks_for(rows[s], plan.rows_per_team, t, kRouterBlockThreads);
  }
  // Rows per team do not change a row's bits; raise them (the segment with fewer first) until
  // the grid fits 2 blocks per SM, so that every block is resident and has its weights in flight
  // before the wait (the real shapes: 289 blocks at the planned rows per team, 225 / 209 after).
  while (blocks[0] + blocks[1] > 2 * static_cast<int64_t>(sm) &&
         (a.rows_per_team[0] < 4 || a.rows_per_team[1] < 4)) {
    int s = a.rows_per_team[0] < a.rows_per_team[1] ? 0 : 1;
    if (a.rows_per_team[0] == a.rows_per_team[1]) s = blocks[0] >= blocks[1] ? 0 : 1;
    a.rows_per_team[s] *= 2;
    blocks[s] =
        blocks_for(rows[s], a.rows_per_team[s], 1 << a.seg[s].team_log2, kRouterBlockThreads);
  }
  FN_LAUNCH_REQUIRE(blocks[0] + blocks[1] <= INT32_MAX, kOp);
  a.router_blocks = static_cast<unsigned>(blocks[0]);
  a.x = p.x;
  a.y[0] = p.logits;
  a.y[1] = p.gate_up;
  a.num_experts = p.num_experts;
  a.top_k = p.top_k;
  a.norm = p.norm_topk_prob;
  a.ids = p.ids;
  a.weights = p.weights;
  a.flag = p.error_flag;
  a.mailbox = p.mailbox;
  const bool fixed = p.fixed_shape && p.num_experts == kFixedExperts && p.top_k == kFixedTopK;
  launch_pdl("router_shared_gate_up_kernel",
             fixed ? router_shared_gate_up_kernel<kFixedExperts, kFixedTopK>
                   : router_shared_gate_up_kernel<>,
             dim3(static_cast<unsigned>(blocks[0] + blocks[1])), dim3(kRouterBlockThreads), 0,
             stream, a);
  FN_CUDA_LAUNCH_CHECK("router_shared_gate_up_kernel");
}

void router_mailbox_init(float* mailbox, int num_experts, cudaStream_t stream) {
  FN_CUDA_CHECK(
      cudaMemsetAsync(mailbox, 0xff, sizeof(float) * static_cast<size_t>(num_experts), stream));
}

void launch_shared_down_combine(const SharedDownCombineParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_shared_down_combine";
  FN_LAUNCH_REQUIRE(
      p.weight != nullptr && p.gate_up != nullptr && p.gate_logit != nullptr && p.y != nullptr,
      kOp);
  FN_LAUNCH_REQUIRE(p.hidden >= 1 && p.inter >= 8 && p.inter % 8 == 0 && p.inter <= kMaxDownInter,
                    kOp);
  FN_LAUNCH_REQUIRE(aligned(p.weight, 16), kOp);
  const GemvBf16Plan plan = plan_gemv_bf16(p.hidden, p.inter, detail::current_sm_count());
  const int t = plan.team_threads;
  FN_LAUNCH_REQUIRE(t >= 8 && t <= kDownBlockThreads && (t & (t - 1)) == 0, kOp);
  const int64_t blocks = blocks_for(p.hidden, plan.rows_per_team, t, kDownBlockThreads);
  FN_LAUNCH_REQUIRE(blocks >= 1 && blocks <= INT32_MAX, kOp);
  const dev::GemvRows g{p.weight, p.hidden, p.inter, static_cast<int>(p.inter / 8),
                        __builtin_ctz(static_cast<unsigned>(t))};
  const size_t smem = sizeof(float) * static_cast<size_t>(p.inter);
  const dim3 grid(static_cast<unsigned>(blocks)), block(kDownBlockThreads);
  constexpr const char* kName = "shared_down_combine_kernel";
  switch (plan.rows_per_team) {
    case 4:
      launch_pdl(kName, shared_down_combine_kernel<4>, grid, block, smem, stream, g, p.gate_up,
                 p.gate_logit, p.y, p.l2_prefetch);
      break;
    case 2:
      launch_pdl(kName, shared_down_combine_kernel<2>, grid, block, smem, stream, g, p.gate_up,
                 p.gate_logit, p.y, p.l2_prefetch);
      break;
    default:
      launch_pdl(kName, shared_down_combine_kernel<1>, grid, block, smem, stream, g, p.gate_up,
                 p.gate_logit, p.y, p.l2_prefetch);
      break;
  }
  FN_CUDA_LAUNCH_CHECK("shared_down_combine_kernel");
}

}  // namespace fn
