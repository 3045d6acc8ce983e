// The bulk-copy routed gate+up kernel (MoeGateUpParams::bulk; moe_nvfp4_bulk.h), sm_90+.
//
// Why (measured: docs/perf-history.md): the round-based kernels of moe_nvfp4.cu hold a lane's
// weights in registers, so a lane waits a full DRAM round trip per round and a block's loads end
// with the block (1.5 waves at TP=1); the FP32 kernel is besides issue bound (~8.5 instructions per
// code). Here one CTA per SM owns a contiguous, equal share of the top_k * I row pairs; a producer
// warp streams the share's rows into a ring of shared-memory stages with cp.async.bulk (per chunk
// four copies: its gate rows' codes, its up rows' codes, and the scales of each), each stage
// completing on an mbarrier; ten consumer warps run the tensor cores from shared memory while the
// next stages are in flight.
//
// Work split: a chunk is up to 8 consecutive row pairs of one expert (the share cut at expert
// boundaries); its 16 rows (8 gate, 8 up) are the A operand of mma.sync m16n8k16 (rows g and
// g + 8 of lane (g, t) = gate and up row g of the chunk). Lane (g, t) of consumer warp w takes
// the units (32 codes, 16 bytes) u = 4 ug' + t of the column groups ug' = group_of(ug, g) for
// ug = w, w + 10 (a group = 128 columns, the 4 lanes of a row read 64 contiguous bytes); an
// 8-code word of a unit gives two MMAs: codes (q, q + 4) as one BF16x2 register
// (nvfp4::decode_layout_pair: code * 2^-126) times the block scale as BF16x2 (E4M3 * 2^100) =
// code * scale * 2^-26 exactly, q = 0, 1 for the first MMA, 2, 3 for the second. Column n of B
// is the activation x in the column order of A's row n (lane (n, t) loads it with the same
// group_of as its A rows, once, into registers, before the first chunk), so D[g][g] is row g's
// dot product: lane (g, g / 2) reads gate row g in d[g % 2], up row g in d[2 + g % 2].
//
// Why the rows take their groups in different orders: a stage holds the rows K / 2 bytes apart
// (one copy per 8 rows), a multiple of 128, so the same group of every row sits on the same
// banks; group_of puts rows g and g + 1 (one 128-bit load phase) in opposite 64-byte halves and
// rows g and g + 4 (same banks for the scale bytes, rows K / 16 bytes apart) in different
// groups, and the loads are free of bank conflicts.
//
// Summation (fixed, so bitwise reproducible; not the order of the other kernels): per chunk, warp
// and column group (of the row: group_of) one MMA accumulator chain from 0 over the group's 8 MMAs
// (the products exact, the tensor core's sum of 16 products + C per MMA; two independent chains per
// warp for latency), the warp's groups added in increasing order, then the 10 warps' partials in
// increasing warp order in FP32, then * 2^26 and * the global scale. Range: exact products for
// 2^-90 <= |x| < 2^100 (and 0).
#include "cuda/kernels/moe_nvfp4_bulk.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/nvfp4_bits.h"
#include "cuda/common/nvfp4_mma.cuh"
#include "cuda/common/pdl.cuh"

namespace fn::detail {
namespace {

using nvfp4_mma::e4m3_bf16x2_scaled;
using nvfp4_mma::mma_unit;

constexpr int kWarps = kBulkGateUpWarps;
constexpr int kThreads = 32 * (kWarps + 1);  // + the producer warp
// Ring depth: stages of 24 KB at K = 2560. At TP=1 a share is 7 or 8 chunks; with 5 or 6 stages
// the step measured 5.175 / 5.178 ms/token, with 2, 3 or 4 stages 5.33-5.36 (FP32 kernel 5.25;
// cuda_model_bench, one call, docs/perf-history.md): the share's loads must go out at once, ahead
// of the down kernel's pre-wait loads. A share with fewer chunks gets as many stages as chunks.
constexpr int kMaxStages = 6;
constexpr int kPairs = 8;  // row pairs per chunk: one m16 tile

struct BulkGateUpArgs {
  const uint8_t* packed;
  const uint8_t* scales;
  const float* global_scale;
  const int32_t* ids;
  int num_experts;
  // Routes of the launch: tokens * the experts each token selects (route j = token j / tok_k's
  // expert j % tok_k; ids and h are [routes] and [routes, I], the tokens' lists back to back).
  int top_k;
  int tok_k;       // experts per token (MoeGateUpParams::top_k)
  int tokens;      // top_k / tok_k
  int inter;       // I
  int k;           // K (cols)
  int64_t pairs;   // tok_k * I: one token's row pairs (each CTA takes its share of every token's)
  int row_stride;  // shared-memory bytes per row slot: K / 2
  int stage_bytes;
  int max_chunks;     // chunks of any CTA's share (sizes the partials)
  const uint16_t* x;  // [tokens, k]: token b's activation at x + b * k
  uint16_t* h;
  float* gate_up_out;
  L2Prefetch l2_prefetch;
  // MoeGateUpParams::down_prefetch: the selected experts' down codes and scales, per expert
  // code_bytes and scale_bytes apart (down_packed nullptr: none).
  const uint8_t* down_packed;
  const uint8_t* down_scales;
  int64_t down_code_bytes;
  int64_t down_scale_bytes;
  int stages;  // ring depth, <= kMaxStages
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
using bulk::bulk_copy;
using bulk::mbar_arrive;
using bulk::mbar_arrive_expect_tx;
using bulk::mbar_wait;
// The chunks of the CTA's share [p0, p1) of each token's row pairs p = j * I + i (pairs <=
// INT32_MAX: bulk_gate_up_shape_ok), token after token (b; route j + b * tok_k), walked in order:
// chunk c covers rows [i, i + n) of selected expert j and sits in ring stage c % stages, filled
// for the (c / stages + 1)-th time (parity = (c / stages) & 1). A token's share and its cuts into
// chunks are a one-token launch's (the same grid), so each row's place in its chunk, which sets
// its summation order (group_of), is too: the same bits. One division per token; each step only
// adds (a 64-bit division per chunk, and two 32-bit ones for the stage, were subroutines in every
// thread's loop).
struct ChunkWalk {
  int p, p1, j, i, n;
  int b = 0;  // the token
  int stage = 0;
  uint32_t parity = 0;
  int p0, p1_0, tokens, tok_k;  // the share of every token; the tokens
  __device__ __forceinline__ explicit ChunkWalk(const BulkGateUpArgs& a) {
    p0 = static_cast<int>(a.pairs * blockIdx.x / gridDim.x);
    p1_0 = static_cast<int>(a.pairs * (blockIdx.x + 1) / gridDim.x);
    tokens = a.tokens;
    tok_k = a.tok_k;
    start(a.inter);
  }
  __device__ __forceinline__ void start(int inter) {
    p = p0;
    p1 = p1_0;
    j = p / inter;
    i = p - j * inter;
    j += b * tok_k;
    n = 0;
  }
  // Whether a chunk is left; if so b, j, i and n describe it (call next() after it).
  __device__ __forceinline__ bool more(int inter) {
    if (p >= p1 && b + 1 < tokens) {  // the next token's share
      ++b;
      start(inter);
    }
    n = min(min(kPairs, inter - i), p1 - p);
    return p < p1;
  }
  __device__ __forceinline__ void next(int inter, int stages) {
    p += n;
    i += n;
    if (i == inter) {
      ++j;
      i = 0;
    }
    bulk::next_stage(stage, parity, stages);
  }
};

// The column group that row (and B column) g of a chunk reads in place of group ug: ug XOR m, m =
// (g & 1) | (g & 4) >> 1, or ug itself where the partner is past the last group (an involution on
// [0, ngroups), so every row still reads every group once).
__device__ __forceinline__ int group_of(int ug, int g, int ngroups) {
  const int p = ug ^ ((g & 1) | ((g & 4) >> 1));
  return p < ngroups ? p : ug;
}

// Part blockIdx.x of gridDim.x of the selected experts' down weights (ranges: expert j's codes,
// then its scales, j ascending; cut into kL2PrefetchChunk-byte chunks numbered across the ranges,
// chunk c to CTA c % gridDim.x) as bulk L2 prefetches. A hint: changes no value. Invalid ids are
// skipped.
__device__ __forceinline__ void prefetch_down_share(const BulkGateUpArgs& a) {
  const int64_t code_chunks = (a.down_code_bytes + kL2PrefetchChunk - 1) / kL2PrefetchChunk;
  const int64_t scale_chunks = (a.down_scale_bytes + kL2PrefetchChunk - 1) / kL2PrefetchChunk;
  const int64_t per_expert = code_chunks + scale_chunks;
  for (int64_t c = blockIdx.x; c < per_expert * a.top_k; c += gridDim.x) {
    const int j = static_cast<int>(c / per_expert);
    const int64_t r = c - j * per_expert;
    const int e = __ldg(a.ids + j);
    if (e < 0 || e >= a.num_experts) continue;
    const bool code = r < code_chunks;
    const int64_t off = (code ? r : r - code_chunks) * kL2PrefetchChunk;
    const int64_t total = code ? a.down_code_bytes : a.down_scale_bytes;
    const uint8_t* base =
        code ? a.down_packed + e * a.down_code_bytes : a.down_scales + e * a.down_scale_bytes;
    const int64_t left = total - off;
    const uint32_t bytes = left < kL2PrefetchChunk ? static_cast<uint32_t>(left) : kL2PrefetchChunk;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + off), "r"(bytes)
                 : "memory");
  }
}

#endif  // the device code of sm_90+; the kernels below are empty elsewhere

__global__ void __launch_bounds__(kThreads, 1) moe_gate_up_bulk_kernel(BulkGateUpArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int nst = a.stages;  // ring depth
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;  // [nst][stage_bytes], 128-byte aligned
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + nst * a.stage_bytes);
  uint64_t* empty = full + nst;
  uint32_t* lut = reinterpret_cast<uint32_t*>(empty + nst);         // [256] E4M3 * 2^100, BF16x2
  int* meta = reinterpret_cast<int*>(lut + 256);                    // [max_chunks][3] j, i, n
  float* part = reinterpret_cast<float*>(meta + 3 * a.max_chunks);  // [chunk][warp][16]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kb = a.k / 16;  // scale bytes per row
  bulk::init_ring(full, empty, nst, 32 * kWarps);
  if (threadIdx.x < 256) lut[threadIdx.x] = e4m3_bf16x2_scaled(threadIdx.x);
  __syncthreads();
  // Every weight address depends on the router's expert ids, and x is the previous kernel's
  // output: nothing is read before the programmatic-dependent wait (cuda/common/pdl.cuh).
  dev::pdl_begin();
  ChunkWalk walk(a);
  int c = 0;             // chunks of the share (every thread walks them all)
  if (warp == kWarps) {  // the producer
    int last_stage = 0;
    uint32_t last_parity = 0;
    for (; walk.more(a.inter); walk.next(a.inter, nst), ++c) {
      const int j = walk.j, i = walk.i, n = walk.n;
      const int s = walk.stage;
      last_stage = s;
      last_parity = walk.parity;
      if (c >= nst) mbar_wait(empty + s, walk.parity ^ 1u);  // the consumers' last round
      const int e = __ldg(a.ids + j);
      const bool live = e >= 0 && e < a.num_experts;
      if (lane == 0) {
        meta[3 * c] = j;
        meta[3 * c + 1] = i;
        meta[3 * c + 2] = n;
        mbar_arrive_expect_tx(full + s, live ? static_cast<uint32_t>(n) * (a.k + 2 * kb) : 0u);
      }
      __syncwarp();
      if (live && lane < 4) {  // gate codes, up codes, gate scales, up scales: n rows each
        uint8_t* st = ring + s * a.stage_bytes;
        const bool up = (lane & 1) != 0;
        const int64_t row = static_cast<int64_t>(e) * 2 * a.inter + i + (up ? a.inter : 0);
        if (lane < 2)  // gate rows at slots 0..n-1, up rows at 8..8+n-1
          bulk_copy(st + (up ? kPairs : 0) * a.row_stride, a.packed + row * (a.k / 2),
                    static_cast<uint32_t>(n * (a.k / 2)), full + s);
        else
          bulk_copy(st + kPairs * 2 * a.row_stride + (up ? kPairs * kb : 0), a.scales + row * kb,
                    static_cast<uint32_t>(n * kb), full + s);
      }
    }
    // The L2 prefetches once this CTA's last chunk has landed (its share's loads are done), so
    // that their traffic follows the gate+up's instead of competing with it (-0.025 ms/token for
    // the down weights against issuing them after the last copy; docs/perf-history.md).
    if (lane == 0 && (a.down_packed != nullptr || a.l2_prefetch.count > 0)) {
      if (c > 0) mbar_wait(full + last_stage, last_parity);
      if (a.down_packed != nullptr) prefetch_down_share(a);
      dev::l2_prefetch_part(a.l2_prefetch, blockIdx.x, gridDim.x);
    }
  } else {  // a consumer warp
    const int g = lane >> 2, t = lane & 3;
    const int ngroups = a.k / 128;
    // x of token b for this lane's units (B column g), permuted per 8 elements to (x0, x4)
    // (x1, x5) (x2, x6) (x3, x7): loaded at the first chunk of each token's share.
    uint4 xr[kBulkGateUpGroups][4];
    int xb = -1;  // the token xr holds
    const auto load_x = [&](int b) {
      const uint16_t* xt = a.x + static_cast<int64_t>(b) * a.k;
#pragma unroll
      for (int r = 0; r < kBulkGateUpGroups; ++r) {
        const int ug = warp + r * kWarps;
#pragma unroll
        for (int wi = 0; wi < 4; ++wi) {
          uint4 q = make_uint4(0, 0, 0, 0);
          if (ug < ngroups)
            q = __ldg(reinterpret_cast<const uint4*>(xt + 32 * (4 * group_of(ug, g, ngroups) + t) +
                                                     8 * wi));
          xr[r][wi] = nvfp4_mma::permute_word(q);
        }
      }
      xb = b;
    };
    for (; walk.more(a.inter); walk.next(a.inter, nst), ++c) {
      const int n = walk.n;
      const int s = walk.stage;
      if (walk.b != xb) load_x(walk.b);  // warp-uniform
      mbar_wait(full + s, walk.parity);
      const uint8_t* st = ring + s * a.stage_bytes;
      const bool row_ok = g < n;
      const uint8_t* cg = st + g * a.row_stride;
      const uint8_t* cu = st + (kPairs + g) * a.row_stride;
      const uint8_t* sg = st + kPairs * 2 * a.row_stride + g * kb;
      const uint8_t* su = sg + kPairs * kb;
      float d[kBulkGateUpGroups][4] = {};  // one MMA chain per column group (independent)
#pragma unroll
      for (int r = 0; r < kBulkGateUpGroups; ++r) {
        const int ug = warp + r * kWarps;
        if (ug >= ngroups) break;  // warp-uniform
        const int u = 4 * group_of(ug, g, ngroups) + t;
        uint4 wg = make_uint4(0, 0, 0, 0), wu = make_uint4(0, 0, 0, 0);
        uint32_t scg = 0, scu = 0;
        if (row_ok) {
          wg = *reinterpret_cast<const uint4*>(cg + 16 * u);
          wu = *reinterpret_cast<const uint4*>(cu + 16 * u);
          scg = *reinterpret_cast<const uint16_t*>(sg + 2 * u);
          scu = *reinterpret_cast<const uint16_t*>(su + 2 * u);
        }
        mma_unit(wg, scg, wu, scu, xr[r], lut, d[r]);
      }
      const int col = g & 1;  // D[g][g] = gate row g, D[g + 8][g] = up row g (lane t = g / 2)
      float sum_g = col ? d[0][1] : d[0][0], sum_u = col ? d[0][3] : d[0][2];
#pragma unroll
      for (int r = 1; r < kBulkGateUpGroups; ++r) {  // the groups' chains in order
        sum_g += col ? d[r][1] : d[r][0];
        sum_u += col ? d[r][3] : d[r][2];
      }
      mbar_arrive(empty + s);  // every consumer lane, after its last read of the stage
      if (t == g >> 1) {
        part[(c * kWarps + warp) * 16 + g] = sum_g;
        part[(c * kWarps + warp) * 16 + kPairs + g] = sum_u;
      }
    }
  }
  __syncthreads();
  // One thread per (chunk, row): the warps' partials in order, the scales, SwiGLU.
  for (int idx = threadIdx.x; idx < c * kPairs; idx += kThreads) {
    const int ci = idx / kPairs, r = idx % kPairs;
    const int j = meta[3 * ci], i = meta[3 * ci + 1] + r, n = meta[3 * ci + 2];
    if (r >= n) continue;
    const int e = __ldg(a.ids + j);
    const bool ok = e >= 0 && e < a.num_experts;
    float sum_g = 0.0f, sum_u = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      sum_g += part[(ci * kWarps + w) * 16 + r];
      sum_u += part[(ci * kWarps + w) * 16 + kPairs + r];
    }
    nvfp4_mma::store_gate_up(sum_g, sum_u, e, ok, a.global_scale, j, i, a.inter, a.h,
                             a.gate_up_out);
  }
#else
  (void)a;  // never launched below sm_90 (launch_moe_gate_up_bulk refuses)
#endif
}

// Chunks of the largest share: ceil(len / 8) plus one per expert boundary inside it.
int max_chunks_of(int64_t pairs, int64_t inter, int ctas) {
  const int64_t len = (pairs + ctas - 1) / ctas;
  return static_cast<int>((len + kPairs - 1) / kPairs + (len + inter - 1) / inter + 1);
}

}  // namespace

namespace {

struct GateUpPlan {
  int ctas, max_chunks, stages, row_stride, stage_bytes;
  size_t smem;
};

// `tokens` tokens of top_k routes each: the one-token grid, each CTA its share of every token.
GateUpPlan plan_gate_up(int top_k, int64_t inter, int64_t cols, int sm_count, int64_t tokens = 1) {
  GateUpPlan g{};
  g.ctas = bulk_gate_up_ctas(top_k, inter, sm_count);
  g.max_chunks =
      static_cast<int>(tokens * max_chunks_of(static_cast<int64_t>(top_k) * inter, inter, g.ctas));
  g.stages = std::min(kMaxStages, g.max_chunks);
  g.row_stride = static_cast<int>(cols / 2);
  g.stage_bytes = static_cast<int>(2 * kPairs * g.row_stride + 2 * kPairs * (cols / 16));
  g.smem = static_cast<size_t>(g.stages) * g.stage_bytes + 2 * g.stages * 8 + 256 * 4 +
           static_cast<size_t>(g.max_chunks) * (3 * 4 + kWarps * 16 * 4);
  return g;
}

}  // namespace

bool bulk_gate_up_shape_ok(int top_k, int64_t inter, int64_t cols, int sm_count) {
  if (top_k < 1 || inter < 1 || !bulk_gate_up_cols_ok(cols)) return false;
  if (static_cast<int64_t>(top_k) * inter > INT32_MAX) return false;
  return plan_gate_up(top_k, inter, cols, sm_count).smem <= kMaxCtaSmem;
}

int bulk_gate_up_ctas(int top_k, int64_t inter, int sm_count) {
  const int64_t pairs = static_cast<int64_t>(top_k) * inter;
  const int64_t by_work = (pairs + kPairs - 1) / kPairs;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(sm_count, by_work)));
}

int64_t bulk_tokens_per_launch(int top_k, int64_t inter, int64_t cols, int sm_count,
                               int64_t tokens) {
  int64_t n = tokens;
  while (n > 1 && plan_gate_up(top_k, inter, cols, sm_count, n).smem > kMaxCtaSmem) n = (n + 1) / 2;
  return n;
}

namespace {

// One launch of `tokens` tokens starting at token b0 of p (their routes back to back).
void launch_bulk_tokens(const MoeGateUpParams& p, int64_t b0, int64_t tokens, int sms,
                        cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_gate_up_nvfp4 (bulk)";
  const int64_t inter = p.experts.rows / 2;
  const int routes = static_cast<int>(tokens * p.top_k);
  const GateUpPlan g = plan_gate_up(p.top_k, inter, p.experts.cols, sms, tokens);
  BulkGateUpArgs a{};
  a.packed = p.experts.packed;
  a.scales = p.experts.scales;
  a.global_scale = p.experts.global_scale;
  a.ids = p.expert_ids + b0 * p.top_k;
  a.num_experts = p.experts.num_experts;
  a.top_k = routes;
  a.tok_k = p.top_k;
  a.tokens = static_cast<int>(tokens);
  a.inter = static_cast<int>(inter);
  a.k = static_cast<int>(p.experts.cols);
  a.pairs = static_cast<int64_t>(p.top_k) * inter;
  a.row_stride = g.row_stride;
  a.stage_bytes = g.stage_bytes;  // 9 K: a multiple of 128 (K % 256 == 0)
  a.x = p.x + b0 * p.experts.cols;
  a.h = p.h + b0 * p.top_k * inter;
  a.gate_up_out = p.gate_up_out != nullptr ? p.gate_up_out + b0 * p.top_k * 2 * inter : nullptr;
  a.l2_prefetch = b0 == 0 ? p.l2_prefetch : L2Prefetch{};
  if (p.down_prefetch.packed != nullptr) {
    const Nvfp4Experts& d = p.down_prefetch;
    FN_LAUNCH_REQUIRE(d.packed != nullptr && d.scales != nullptr && d.rows >= 1 && d.cols >= 32 &&
                          d.cols % 32 == 0 && d.num_experts == p.experts.num_experts,
                      kOp);
    FN_LAUNCH_REQUIRE(aligned(d.packed, 16) && aligned(d.scales, 16), kOp);
    a.down_packed = d.packed;
    a.down_scales = d.scales;
    a.down_code_bytes = d.rows * (d.cols / 2);    // a multiple of 16 (cols % 32 == 0)
    a.down_scale_bytes = d.rows * (d.cols / 16);  // a multiple of 2; the prefetch needs 16
    FN_LAUNCH_REQUIRE(a.down_scale_bytes % 16 == 0, kOp);
  }
  a.max_chunks = g.max_chunks;
  a.stages = g.stages;
  FN_CUDA_CHECK(cudaFuncSetAttribute(moe_gate_up_bulk_kernel,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(g.smem)));
  launch_pdl("moe_gate_up_bulk_kernel", moe_gate_up_bulk_kernel, static_cast<unsigned>(g.ctas),
             kThreads, g.smem, stream, a);
  FN_CUDA_LAUNCH_CHECK("moe_gate_up_bulk_kernel");
}

}  // namespace

void launch_moe_gate_up_bulk(const MoeGateUpParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_gate_up_nvfp4 (bulk)";
  FN_LAUNCH_REQUIRE(current_device_has_pdl(), kOp);  // sm_90+ device and device code
  const int64_t inter = p.experts.rows / 2;
  const int sms = current_sm_count();
  FN_LAUNCH_REQUIRE(bulk_gate_up_shape_ok(p.top_k, inter, p.experts.cols, sms), kOp);
  FN_LAUNCH_REQUIRE(aligned(p.experts.packed, 16) && aligned(p.experts.scales, 16), kOp);
  // The down prefetch names one token's experts (all tokens' would not stay in L2).
  FN_LAUNCH_REQUIRE(p.tokens == 1 || p.down_prefetch.packed == nullptr, kOp);
  const int64_t per = bulk_tokens_per_launch(p.top_k, inter, p.experts.cols, sms, p.tokens);
  for (int64_t b0 = 0; b0 < p.tokens; b0 += per)
    launch_bulk_tokens(p, b0, std::min(per, p.tokens - b0), sms, stream);
}

}  // namespace fn::detail
