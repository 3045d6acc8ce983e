// The bulk-copy gate+up kernel (MoeGateUpParams::bulk; moe_nvfp4_bulk.h), sm_90+.
//
// Why (issue 8, cuda/bench/RESULTS.md sessions 5, 7, 10): the round-based kernels of
// moe_nvfp4.cu hold a lane's weights in registers, so a lane waits a full DRAM round trip per
// round and a block's loads end with the block (1.5 waves at TP=1); the FP32 kernel is besides
// issue bound (~8.5 instructions per code). Here one CTA per SM owns a contiguous, equal share of
// the top_k * I row pairs; a producer warp streams the share's rows into a ring of shared-memory
// stages with cp.async.bulk (one copy per row of codes, so that rows land 64 bytes apart around
// the bank cycle, and one per 8 rows of scales), each stage completing on an mbarrier; ten
// consumer warps run the tensor cores from shared memory while the next stages are in flight.
//
// Work split: a chunk is up to 8 consecutive row pairs of one expert (the share cut at expert
// boundaries); its 16 rows (8 gate, 8 up) are the A operand of mma.sync m16n8k16 (rows g and
// g + 8 of lane (g, t) = gate and up row g of the chunk). Lane (g, t) of consumer warp w takes
// the units (32 codes, 16 bytes) u = 4 ug + t of the column groups ug = w, w + 10 (a group = 128
// columns, the 4 lanes of a row read 64 contiguous bytes); an 8-code word of a unit gives two
// MMAs: codes (q, q + 4) as one BF16x2 register (nvfp4::e2m1_bf16_pair: code * 2^-126) times
// the block scale as BF16x2 (E4M3 * 2^100) = code * scale * 2^-26 exactly, q = 0, 1 for the first
// MMA, 2, 3 for the second. B is the activation x in the same column permutation in every one of
// its 8 columns (so D's columns are equal; lane (g, 0) reads gate row g in d[0], up in d[2]); a
// lane loads its x words once, into registers, before the first chunk.
//
// Summation (fixed, so bitwise reproducible; not the order of the other kernels): per chunk and
// warp one MMA accumulator chain from 0 over the warp's groups in increasing order (the products
// exact, the tensor core's sum of 16 products + C per MMA), then the 10 warps' partials summed in
// increasing warp order in FP32, then * 2^26 and * the global scale. Range: exact products for
// 2^-90 <= |x| < 2^100 (and 0), as the round-based tensor-core kernel.
#include "cuda/moe_nvfp4_bulk.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "comm/cuda_check.h"
#include "cuda/device_util.cuh"
#include "cuda/launch_check.h"
#include "cuda/nvfp4_bits.h"
#include "cuda/nvfp4_mma.cuh"
#include "cuda/pdl.cuh"

namespace fn::detail {
namespace {

using nvfp4_mma::bf16x2_mul;
using nvfp4_mma::e4m3_bf16x2_scaled;
using nvfp4_mma::kMmaUnscale;
using nvfp4_mma::mma_bf16;
using nvfp4_mma::word_of;

constexpr int kWarps = kBulkGateUpWarps;
constexpr int kThreads = 32 * (kWarps + 1);  // + the producer warp
constexpr int kStages = 4;                   // ring depth (4 x 24 KB at K = 2560)
constexpr int kPairs = 8;                    // row pairs per chunk: one m16 tile
constexpr int kRowPad = 64;                  // bytes between rows' slots past K / 2

struct BulkGateUpArgs {
  const uint8_t* packed;
  const uint8_t* scales;
  const float* global_scale;
  const int32_t* ids;
  int num_experts;
  int top_k;
  int inter;       // I
  int k;           // K (cols)
  int64_t pairs;   // top_k * I
  int row_stride;  // shared-memory bytes per row slot: K / 2 + kRowPad
  int stage_bytes;
  int max_chunks;  // chunks of any CTA's share (sizes the partials)
  const uint16_t* x;
  uint16_t* h;
  float* gate_up_out;
  L2Prefetch l2_prefetch;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The CTA's share [p0, p1) of the row pairs p = j * I + i.
__device__ __forceinline__ void share_of(const BulkGateUpArgs& a, int64_t& p0, int64_t& p1) {
  p0 = a.pairs * blockIdx.x / gridDim.x;
  p1 = a.pairs * (blockIdx.x + 1) / gridDim.x;
}

// The chunk starting at pair p (< p1): selected expert j, first row i, n rows.
__device__ __forceinline__ void chunk_at(const BulkGateUpArgs& a, int64_t p, int64_t p1, int& j,
                                         int& i, int& n) {
  j = static_cast<int>(p / a.inter);
  i = static_cast<int>(p - static_cast<int64_t>(j) * a.inter);
  const int64_t left = p1 - p;
  n = static_cast<int>(min(static_cast<int64_t>(min(kPairs, a.inter - i)), left));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (done == 0);
}

// bytes (a multiple of 16, both addresses 16-byte aligned) from global src to shared dst,
// completing as transaction bytes on bar.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
#endif

__global__ void __launch_bounds__(kThreads, 1) moe_gate_up_bulk_kernel(BulkGateUpArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* stages = smem;  // [kStages][stage_bytes], 128-byte aligned
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * a.stage_bytes);
  uint64_t* empty = full + kStages;
  uint32_t* lut = reinterpret_cast<uint32_t*>(empty + kStages);  // [256] E4M3 * 2^100, BF16x2
  int* meta = reinterpret_cast<int*>(lut + 256);                 // [max_chunks][3] j, i, n
  float* part = reinterpret_cast<float*>(meta + 3 * a.max_chunks);  // [chunk][warp][16]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kb = a.k / 16;  // scale bytes per row
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, 32 * kWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (threadIdx.x < 256) lut[threadIdx.x] = e4m3_bf16x2_scaled(threadIdx.x);
  __syncthreads();
  // Every weight address depends on the router's expert ids, and x is the previous kernel's
  // output: nothing is read before the programmatic-dependent wait (cuda/pdl.cuh).
  dev::pdl_begin();
  int64_t p0, p1;
  share_of(a, p0, p1);

  if (warp == kWarps) {  // the producer
    int c = 0;
    for (int64_t p = p0; p < p1; ++c) {
      int j, i, n;
      chunk_at(a, p, p1, j, i, n);
      p += n;
      const int s = c % kStages;
      if (c >= kStages) mbar_wait(empty + s, static_cast<uint32_t>((c / kStages - 1) & 1));
      const int e = __ldg(a.ids + j);
      const bool live = e >= 0 && e < a.num_experts;
      if (lane == 0) {
        meta[3 * c] = j;
        meta[3 * c + 1] = i;
        meta[3 * c + 2] = n;
        mbar_arrive_expect_tx(full + s, live ? static_cast<uint32_t>(n) * (a.k + 2 * kb) : 0u);
      }
      __syncwarp();
      if (live) {
        uint8_t* st = stages + s * a.stage_bytes;
        const int64_t row0 = static_cast<int64_t>(e) * 2 * a.inter + i;  // gate row i
        if (lane < 2 * n) {  // row of codes: gate rows at slots 0..n-1, up rows at 8..8+n-1
          const int r = lane < n ? lane : lane - n;
          const int64_t row = row0 + r + (lane < n ? 0 : a.inter);
          bulk_copy(st + (lane < n ? r : kPairs + r) * a.row_stride, a.packed + row * (a.k / 2),
                    static_cast<uint32_t>(a.k / 2), full + s);
        } else if (lane == 2 * n || lane == 2 * n + 1) {  // the n rows' scales, gate or up
          const bool up = lane == 2 * n + 1;
          const int64_t row = row0 + (up ? a.inter : 0);
          bulk_copy(st + kPairs * 2 * a.row_stride + (up ? kPairs * kb : 0), a.scales + row * kb,
                    static_cast<uint32_t>(n * kb), full + s);
        }
      }
    }
    if (lane == 0) dev::l2_prefetch_part(a.l2_prefetch, blockIdx.x, gridDim.x);
  } else {  // a consumer warp
    const int g = lane >> 2, t = lane & 3;
    const int ngroups = a.k / 128;
    // x for this lane's units, permuted per 8 elements to (x0, x4) (x1, x5) (x2, x6) (x3, x7).
    uint4 xr[kBulkGateUpGroups][4];
#pragma unroll
    for (int r = 0; r < kBulkGateUpGroups; ++r) {
      const int ug = warp + r * kWarps;
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        uint4 q = make_uint4(0, 0, 0, 0);
        if (ug < ngroups)
          q = __ldg(reinterpret_cast<const uint4*>(a.x + 32 * (4 * ug + t) + 8 * wi));
        xr[r][wi] = make_uint4(__byte_perm(q.x, q.z, 0x5410), __byte_perm(q.x, q.z, 0x7632),
                               __byte_perm(q.y, q.w, 0x5410), __byte_perm(q.y, q.w, 0x7632));
      }
    }
    int c = 0;
    for (int64_t p = p0; p < p1; ++c) {
      int j, i, n;
      chunk_at(a, p, p1, j, i, n);
      p += n;
      const int s = c % kStages;
      mbar_wait(full + s, static_cast<uint32_t>((c / kStages) & 1));
      const uint8_t* st = stages + s * a.stage_bytes;
      const bool row_ok = g < n;
      const uint8_t* cg = st + g * a.row_stride;
      const uint8_t* cu = st + (kPairs + g) * a.row_stride;
      const uint8_t* sg = st + kPairs * 2 * a.row_stride + g * kb;
      const uint8_t* su = sg + kPairs * kb;
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < kBulkGateUpGroups; ++r) {
        const int ug = warp + r * kWarps;
        if (ug >= ngroups) break;  // warp-uniform
        const int u = 4 * ug + t;
        uint4 wg = make_uint4(0, 0, 0, 0), wu = make_uint4(0, 0, 0, 0);
        uint32_t scg = 0, scu = 0;
        if (row_ok) {
          wg = *reinterpret_cast<const uint4*>(cg + 16 * u);
          wu = *reinterpret_cast<const uint4*>(cu + 16 * u);
          scg = *reinterpret_cast<const uint16_t*>(sg + 2 * u);
          scu = *reinterpret_cast<const uint16_t*>(su + 2 * u);
        }
#pragma unroll
        for (int wi = 0; wi < 4; ++wi) {
          const uint32_t fg = lut[(scg >> (8 * (wi / 2))) & 0xffu];
          const uint32_t fu = lut[(scu >> (8 * (wi / 2))) & 0xffu];
          const uint32_t gw = word_of(wg, wi), uw = word_of(wu, wi);
          const uint4& xw = xr[r][wi];
          mma_bf16(d, bf16x2_mul(nvfp4::e2m1_bf16_pair(gw, 0), fg),
                   bf16x2_mul(nvfp4::e2m1_bf16_pair(uw, 0), fu),
                   bf16x2_mul(nvfp4::e2m1_bf16_pair(gw, 1), fg),
                   bf16x2_mul(nvfp4::e2m1_bf16_pair(uw, 1), fu), xw.x, xw.y);
          mma_bf16(d, bf16x2_mul(nvfp4::e2m1_bf16_pair(gw, 2), fg),
                   bf16x2_mul(nvfp4::e2m1_bf16_pair(uw, 2), fu),
                   bf16x2_mul(nvfp4::e2m1_bf16_pair(gw, 3), fg),
                   bf16x2_mul(nvfp4::e2m1_bf16_pair(uw, 3), fu), xw.z, xw.w);
        }
      }
      mbar_arrive(empty + s);  // every consumer lane, after its last read of the stage
      if (t == 0) {  // D[g][0] = gate row g, D[g + 8][0] = up row g
        part[(c * kWarps + warp) * 16 + g] = d[0];
        part[(c * kWarps + warp) * 16 + kPairs + g] = d[2];
      }
    }
  }
  __syncthreads();
  // One thread per (chunk, row): the warps' partials in order, the scales, SwiGLU.
  int nchunks = 0;
  for (int64_t p = p0; p < p1; ++nchunks) {
    int j, i, n;
    chunk_at(a, p, p1, j, i, n);
    p += n;
  }
  for (int idx = threadIdx.x; idx < nchunks * kPairs; idx += kThreads) {
    const int c = idx / kPairs, r = idx % kPairs;
    const int j = meta[3 * c], i = meta[3 * c + 1] + r, n = meta[3 * c + 2];
    if (r >= n) continue;
    const int e = __ldg(a.ids + j);
    const bool ok = e >= 0 && e < a.num_experts;
    float sum_g = 0.0f, sum_u = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      sum_g += part[(c * kWarps + w) * 16 + r];
      sum_u += part[(c * kWarps + w) * 16 + kPairs + r];
    }
    float gv = 0.0f, uv = 0.0f;
    if (ok) {
      gv = sum_g * kMmaUnscale * __ldg(a.global_scale + 2 * e);
      uv = sum_u * kMmaUnscale * __ldg(a.global_scale + 2 * e + 1);
    }
    const float hv = ok ? dev::silu(gv) * uv : 0.0f;
    a.h[static_cast<int64_t>(j) * a.inter + i] = dev::float_to_bf16_bits(hv);
    if (a.gate_up_out != nullptr) {
      a.gate_up_out[static_cast<int64_t>(j) * 2 * a.inter + i] = gv;
      a.gate_up_out[static_cast<int64_t>(j) * 2 * a.inter + a.inter + i] = uv;
    }
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

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace

int bulk_gate_up_ctas(int top_k, int64_t inter, int sm_count) {
  const int64_t pairs = static_cast<int64_t>(top_k) * inter;
  const int64_t by_work = (pairs + kPairs - 1) / kPairs;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(sm_count, by_work)));
}

void launch_moe_gate_up_bulk(const MoeGateUpParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_gate_up_nvfp4 (bulk)";
  FN_LAUNCH_REQUIRE(current_device_has_pdl(), kOp);  // sm_90+ device and device code
  FN_LAUNCH_REQUIRE(bulk_gate_up_cols_ok(p.experts.cols), kOp);
  FN_LAUNCH_REQUIRE(aligned16(p.experts.packed) && aligned16(p.experts.scales), kOp);
  const int64_t inter = p.experts.rows / 2;
  BulkGateUpArgs a{};
  a.packed = p.experts.packed;
  a.scales = p.experts.scales;
  a.global_scale = p.experts.global_scale;
  a.ids = p.expert_ids;
  a.num_experts = p.experts.num_experts;
  a.top_k = p.top_k;
  a.inter = static_cast<int>(inter);
  a.k = static_cast<int>(p.experts.cols);
  a.pairs = static_cast<int64_t>(p.top_k) * inter;
  a.row_stride = a.k / 2 + kRowPad;
  a.stage_bytes = 2 * kPairs * a.row_stride + 2 * kPairs * (a.k / 16);  // a multiple of 128
  a.x = p.x;
  a.h = p.h;
  a.gate_up_out = p.gate_up_out;
  a.l2_prefetch = p.l2_prefetch;
  const int ctas = bulk_gate_up_ctas(p.top_k, inter, current_sm_count());
  a.max_chunks = max_chunks_of(a.pairs, inter, ctas);
  const size_t smem = static_cast<size_t>(kStages) * a.stage_bytes + 2 * kStages * 8 + 256 * 4 +
                      static_cast<size_t>(a.max_chunks) * (3 * 4 + kWarps * 16 * 4);
  FN_CUDA_CHECK(cudaFuncSetAttribute(moe_gate_up_bulk_kernel,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
  launch_pdl("moe_gate_up_bulk_kernel", moe_gate_up_bulk_kernel, static_cast<unsigned>(ctas),
             kThreads, smem, stream, a);
  FN_CUDA_LAUNCH_CHECK("moe_gate_up_bulk_kernel");
}

}  // namespace fn::detail
