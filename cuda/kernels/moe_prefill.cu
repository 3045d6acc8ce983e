// Batched routed experts (see moe_prefill.h).
//
// Router rows: launch_router_topk_rows (decode_ops.h) runs decode's router kernel once per row;
// tests/test_cuda_moe_prefill.cpp checks bitwise equality with launch_router_topk row by row.
//
// Per-row path (up to kMoePrefillPerRowMaxTokens tokens): the decode kernels (FP32 instances)
// for all rows in one launch each, the token in the grid's y dimension.
//
// Fused path (above that; see the section comment further down): no BF16 weight copy in global
// memory; NVFP4 is decoded into shared-memory tiles feeding wmma.
#include "cuda/kernels/moe_prefill.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/nvfp4_bits.h"
#include "cuda/common/nvfp4_mma.cuh"

namespace fn {
namespace {

constexpr int kThreads = 256;
constexpr size_t kAlign = 256;

size_t align_up(size_t v) {
  return (v + kAlign - 1) / kAlign * kAlign;
}

// E4M3 byte -> float (exact; NaN codes give NaN), through the FP16 pattern of nvfp4_bits.h.
__device__ __forceinline__ float e4m3_value(uint32_t s) {
  if (nvfp4::e4m3_is_nan(s)) return __int_as_float(0x7fc00000);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(nvfp4::e4m3_fp16_bits(s)))) *
         256.0f;
}

// The 8 codes of a word in the decode layout (Nvfp4Experts::packed) as their exact FP32 values,
// in element order: nvfp4_mma::decode_layout_f32 (code * 2^-126), then * 2^126 (exact). Cheaper
// than going back to the checkpoint's layout and decoding byte by byte, and the same values.
__device__ __forceinline__ void decode_word(uint32_t d, float (&v)[8]) {
  nvfp4_mma::decode_layout_f32(d, v);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] *= 0x1p126f;
}

bool use_per_row(const MoePrefillParams& p) {
  const bool fits = p.gate_up.cols * 4 <= 48 * 1024 && p.down.cols * p.top_k * 4 <= 48 * 1024;
  if (p.path == MoePrefillPath::PerRow) return true;
  if (p.path == MoePrefillPath::Fused) return false;
  return fits && p.tokens <= kMoePrefillPerRowMaxTokens;
}

void check_shapes(const MoePrefillParams& p, const char* op) {
  FN_LAUNCH_REQUIRE(p.tokens >= 0 && p.top_k >= 1, op);
  FN_LAUNCH_REQUIRE(p.gate_up.num_experts >= 1 && p.gate_up.num_experts == p.down.num_experts, op);
  FN_LAUNCH_REQUIRE(p.gate_up.rows == 2 * p.down.cols && p.gate_up.cols == p.down.rows, op);
  FN_LAUNCH_REQUIRE(p.gate_up.cols >= 16 && p.gate_up.cols % 16 == 0, op);
  FN_LAUNCH_REQUIRE(p.down.cols >= 16 && p.down.cols % 16 == 0, op);
  FN_LAUNCH_REQUIRE(p.gate_up.cols <= INT32_MAX && p.gate_up.rows <= INT32_MAX, op);
  FN_LAUNCH_REQUIRE(p.tokens * p.top_k <= INT32_MAX / 2, op);
  FN_LAUNCH_REQUIRE(p.chunk_tokens >= 0, op);
}

using detail::aligned;

void run_per_row(const MoePrefillParams& p, cudaStream_t stream) {
  uint16_t* h = static_cast<uint16_t*>(p.workspace);  // [tokens, top_k, I]
  const int64_t inter = p.down.cols;
  MoeGateUpParams gu;
  gu.experts = p.gate_up;
  gu.expert_ids = p.ids;
  gu.top_k = p.top_k;
  gu.x = p.x;
  gu.h = h;
  gu.tokens = p.tokens;
  gu.bulk = p.gate_up_bulk;
  launch_moe_gate_up_nvfp4(gu, stream);
  if (p.h_out != nullptr)
    FN_CUDA_CHECK(cudaMemcpyAsync(p.h_out, h, static_cast<size_t>(p.tokens * p.top_k * inter) * 2,
                                  cudaMemcpyDeviceToDevice, stream));
  MoeDownParams dn;
  dn.experts = p.down;
  dn.expert_ids = p.ids;
  dn.routing_weights = p.weights;
  dn.top_k = p.top_k;
  dn.h = h;
  dn.y = p.y;
  dn.tokens = p.tokens;
  dn.fixed_shape = p.down_fixed;
  launch_moe_down_nvfp4(dn, stream);
}

unsigned grid_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

// ---- fused W4A16 path ------------------------------------------------------------------------
//
// Pairs of one chunk of tokens are bucketed by expert (ascending pair inside an expert) into
// sorted rows; each expert's rows are cut into tiles of at most kFBm rows. One CTA computes a
// tile of kFBm rows x kFBn weight rows with wmma BF16 tensor cores (FP32 accumulation), the
// weights decoded from NVFP4 (E2M1 x E4M3, exact in BF16, global scale applied after the GEMM)
// straight into shared memory, so no BF16 weight copy is written to global memory:
//   gate_up  A = x rows gathered by token, B = 64 gate rows + the same 64 up rows of the expert;
//            epilogue h = bf16(silu(g * gs_gate) * (u * gs_up)) into h[sorted row]
//   down     A = h[sorted rows], B = 128 rows of W_down; epilogue yd[pair, :] (FP32)
//   reduce   y[t, d] = sum over slots j in order of fmaf(weights[t, j] * gs_down[e], yd, acc)
// Deterministic: every output element is written by one thread, the k loop runs in order.

constexpr int kFBm = 64;         // token rows per tile
constexpr int kFBn = 128;        // weight rows (output features) per tile
constexpr int kFBk = 64;         // k per pipeline stage
constexpr int kFLd = kFBk + 8;   // BF16 row stride of the staged tiles (conflict-free ldmatrix)
constexpr int kFLdc = kFBn + 4;  // FP32 row stride of the epilogue tile
constexpr int kFThreads = 256;   // 8 warps: 2 (rows) x 4 (features), 32 x 32 each
constexpr int kFStage = (kFBm + kFBn) * kFLd;  // BF16 elements per stage
constexpr size_t kFSmemBytes = std::max<size_t>(2 * kFStage * 2, size_t(kFBm) * kFLdc * 4);

struct FusedArgs {
  const uint16_t* a = nullptr;  // gate_up: x [tokens, K]; down: h [sorted rows, K]
  const uint8_t* packed = nullptr;
  const uint8_t* scales = nullptr;
  const float* gscale = nullptr;
  int64_t wrows = 0;                  // weight rows per expert
  int64_t K = 0;                      // input length (multiple of 16)
  int64_t feats = 0;                  // gate_up: I; down: hidden
  int ftiles = 0;                     // feature tiles per row tile
  const int32_t* row_pair = nullptr;  // chunk-local pair of each sorted row
  const int32_t* tiles = nullptr;     // [tiles, 3]: expert, first sorted row, rows
  int top_k = 0;
  uint16_t* h = nullptr;      // [sorted rows, I] BF16
  uint16_t* h_out = nullptr;  // optional [chunk pairs, I]
  float* yd = nullptr;        // [chunk pairs, hidden] FP32
};

// 16 NVFP4 codes (8 bytes) with their E4M3 block scale -> 16 BF16 (exact products, so the
// truncating conversion is exact; a NaN scale gives NaN).
__device__ __forceinline__ void decode16_bf16(uint2 q, uint32_t scale_code, uint4& o0, uint4& o1) {
  const float sc = e4m3_value(scale_code);
  uint32_t out[8];
  const uint32_t words[2] = {q.x, q.y};
#pragma unroll
  for (int wi = 0; wi < 2; ++wi) {
    float v[8];
    decode_word(words[wi], v);
#pragma unroll
    for (int c = 0; c < 4; ++c)
      out[wi * 4 + c] = (__float_as_uint(v[2 * c] * sc) >> 16) |
                        (__float_as_uint(v[2 * c + 1] * sc) & 0xffff0000u);
  }
  o0 = make_uint4(out[0], out[1], out[2], out[3]);
  o1 = make_uint4(out[4], out[5], out[6], out[7]);
}

template <bool kGateUp>
__global__ void __launch_bounds__(kFThreads, 2) fused_expert_kernel(const FusedArgs args) {
  using namespace nvcuda;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint16_t* sbuf = reinterpret_cast<uint16_t*>(smem_raw);
  const int ftile = static_cast<int>(blockIdx.x % static_cast<unsigned>(args.ftiles));
  const int64_t tile = blockIdx.x / static_cast<unsigned>(args.ftiles);
  const int32_t* tp = args.tiles + 3 * tile;
  const int64_t e = tp[0];
  const int row0 = tp[1], nrows = tp[2];
  const int tid = threadIdx.x, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;
  const int64_t K = args.K;
  const int nk = static_cast<int>((K + kFBk - 1) / kFBk);

  // This thread's two A units (row, 8-element vector) and two B units (weight row, 16 codes).
  const uint16_t* asrc[2];
  int ar[2], av[2];
  const uint8_t* bpk[2];
  const uint8_t* bsc[2];
  int bn[2], bb[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int u = tid + kFThreads * q;
    ar[q] = u >> 3;
    av[q] = u & 7;
    asrc[q] = nullptr;
    if (ar[q] < nrows) {
      if (kGateUp) {
        const int64_t token = args.row_pair[row0 + ar[q]] / args.top_k;
        asrc[q] = args.a + token * K;
      } else {
        asrc[q] = args.a + static_cast<int64_t>(row0 + ar[q]) * K;
      }
    }
    bn[q] = u >> 2;
    bb[q] = u & 3;
    int64_t f;
    bool ok;
    if (kGateUp) {
      const int64_t c = static_cast<int64_t>(ftile) * (kFBn / 2) + (bn[q] & (kFBn / 2 - 1));
      ok = c < args.feats;
      f = (bn[q] < kFBn / 2 ? 0 : args.feats) + c;
    } else {
      f = static_cast<int64_t>(ftile) * kFBn + bn[q];
      ok = f < args.feats;
    }
    const int64_t wrow = e * args.wrows + f;
    bpk[q] = ok ? args.packed + wrow * (K / 2) : nullptr;
    bsc[q] = ok ? args.scales + wrow * (K / 16) : nullptr;
  }

  uint4 ra[2];
  uint2 rb[2];
  uint32_t rs[2];
  auto load = [&](int kt) {
    const int64_t k0 = static_cast<int64_t>(kt) * kFBk;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int64_t kc = k0 + av[q] * 8;
      ra[q] = make_uint4(0, 0, 0, 0);
      if (asrc[q] != nullptr && kc < K) ra[q] = __ldg(reinterpret_cast<const uint4*>(asrc[q] + kc));
      const int64_t kb = k0 + bb[q] * 16;
      rb[q] = make_uint2(0, 0);
      rs[q] = 0;
      if (bpk[q] != nullptr && kb < K) {
        rb[q] = __ldg(reinterpret_cast<const uint2*>(bpk[q] + kb / 2));
        rs[q] = __ldg(bsc[q] + kb / 16);
      }
    }
  };
  auto store = [&](int buf) {
    uint16_t* as = sbuf + buf * kFStage;
    uint16_t* bs = as + kFBm * kFLd;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      *reinterpret_cast<uint4*>(as + ar[q] * kFLd + av[q] * 8) = ra[q];
      uint4 o0, o1;
      decode16_bf16(rb[q], rs[q], o0, o1);
      uint4* dst = reinterpret_cast<uint4*>(bs + bn[q] * kFLd + bb[q] * 16);
      dst[0] = o0;
      dst[1] = o1;
    }
  };

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
#else
  // Below sm_80 (no BF16 wmma): the warp's 32 x 32 block by FP32 FMA, k ascending; lane l holds
  // column wn * 32 + l of rows wm * 32 + r (the products are exact, as on the tensor cores).
  float accf[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) accf[r] = 0.0f;
  const int lane = tid & 31;
#endif
  // Row fragments wholly past the tile's rows are skipped (warp-uniform).
  const bool mrow[2] = {wm * 32 < nrows, wm * 32 + 16 < nrows};

  load(0);
  store(0);
  __syncthreads();
  for (int kt = 0; kt < nk; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < nk) load(kt + 1);
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    const __nv_bfloat16* as = reinterpret_cast<const __nv_bfloat16*>(sbuf + buf * kFStage);
    const __nv_bfloat16* bs = as + kFBm * kFLd;
    if (mrow[0]) {
#pragma unroll
      for (int kk = 0; kk < kFBk / 16; ++kk) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];
#pragma unroll
        for (int j = 0; j < 2; ++j)
          wmma::load_matrix_sync(fb[j], bs + (wn * 32 + j * 16) * kFLd + kk * 16, kFLd);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          if (!mrow[i]) continue;
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
          wmma::load_matrix_sync(fa, as + (wm * 32 + i * 16) * kFLd + kk * 16, kFLd);
#pragma unroll
          for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa, fb[j], acc[i][j]);
        }
      }
    }
#else
    if (mrow[0]) {
      const uint16_t* as = sbuf + buf * kFStage + (wm * 32) * kFLd;
      const uint16_t* bs = sbuf + buf * kFStage + kFBm * kFLd + (wn * 32 + lane) * kFLd;
#pragma unroll 4
      for (int k = 0; k < kFBk; ++k) {
        const float b = __uint_as_float(static_cast<uint32_t>(bs[k]) << 16);
#pragma unroll
        for (int r = 0; r < 32; ++r)
          accf[r] =
              fmaf(__uint_as_float(static_cast<uint32_t>(as[r * kFLd + k]) << 16), b, accf[r]);
      }
    }
#endif
    if (kt + 1 < nk) store(buf ^ 1);
    __syncthreads();
  }

  float* cs = reinterpret_cast<float*>(smem_raw);
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(cs + (wm * 32 + i * 16) * kFLdc + wn * 32 + j * 16, acc[i][j], kFLdc,
                              wmma::mem_row_major);
#else
#pragma unroll
  for (int r = 0; r < 32; ++r) cs[(wm * 32 + r) * kFLdc + wn * 32 + lane] = accf[r];
#endif
  __syncthreads();
  if (kGateUp) {
    const int64_t inter = args.feats;
    const float gsg = __ldg(args.gscale + 2 * e), gsu = __ldg(args.gscale + 2 * e + 1);
    for (int idx = tid; idx < kFBm * (kFBn / 2); idx += kFThreads) {
      const int r = idx / (kFBn / 2), c = idx % (kFBn / 2);
      if (r >= nrows) break;
      const int64_t f = static_cast<int64_t>(ftile) * (kFBn / 2) + c;
      if (f >= inter) continue;
      // As moe_gate_up_nvfp4_kernel: global scale, silu, one rounding.
      const float g = cs[r * kFLdc + c] * gsg;
      const float u = cs[r * kFLdc + kFBn / 2 + c] * gsu;
      const uint16_t hv = dev::float_to_bf16_bits(dev::silu(g) * u);
      args.h[static_cast<int64_t>(row0 + r) * inter + f] = hv;
      if (args.h_out != nullptr)
        args.h_out[static_cast<int64_t>(args.row_pair[row0 + r]) * inter + f] = hv;
    }
  } else {
    const int64_t hidden = args.feats;
    for (int idx = tid; idx < kFBm * (kFBn / 4); idx += kFThreads) {
      const int r = idx / (kFBn / 4), c4 = (idx % (kFBn / 4)) * 4;
      if (r >= nrows) break;
      const int64_t d = static_cast<int64_t>(ftile) * kFBn + c4;
      if (d >= hidden) continue;  // hidden % 16 == 0: a vector is wholly in or out
      const float4 v = *reinterpret_cast<const float4*>(cs + r * kFLdc + c4);
      *reinterpret_cast<float4*>(args.yd + static_cast<int64_t>(args.row_pair[row0 + r]) * hidden +
                                 d) = v;
    }
  }
}

// y[t, d] = sum over slots j (in order) with a valid id of fmaf(weights * gs_down[e], yd, acc).
__global__ void __launch_bounds__(kThreads)
    fused_reduce_kernel(const float* yd, int64_t hidden, const int32_t* ids, const float* weights,
                        const float* gs_down, int num_experts, int top_k, int64_t tokens,
                        float* y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= tokens * hidden) return;
  const int64_t t = i / hidden, d = i - t * hidden;
  float acc = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    const int64_t q = t * top_k + j;
    const int32_t e = __ldg(ids + q);
    if (e < 0 || e >= num_experts) continue;
    const float f = __ldg(weights + q) * __ldg(gs_down + e);
    acc = fmaf(f, yd[q * hidden + d], acc);
  }
  y[i] = acc;
}

int64_t fused_chunk(const MoePrefillParams& p) {
  const int64_t c = p.chunk_tokens > 0 ? p.chunk_tokens : kMoePrefillChunkTokens;
  return std::max<int64_t>(1, std::min<int64_t>(c, p.tokens));
}

// Workspace of the fused path: tables (all chunks), h and yd of one chunk.
struct FusedLayout {
  size_t meta, h, yd, total;
  int64_t meta_ints;
};

FusedLayout fused_layout(const MoePrefillParams& p) {
  const int64_t chunk = fused_chunk(p);
  const int64_t chunks = (p.tokens + chunk - 1) / chunk;
  const int64_t pairs = p.tokens * p.top_k, chunk_pairs = chunk * p.top_k;
  const int64_t hidden = p.gate_up.cols, inter = p.down.cols;
  FusedLayout l{};
  // Sorted rows' pairs (<= pairs) and tiles (<= pairs / kFBm + min(E, chunk pairs) per chunk).
  l.meta_ints =
      pairs +
      3 * (pairs / kFBm + chunks * (std::min<int64_t>(p.gate_up.num_experts, chunk_pairs) + 1)) +
      64;
  l.meta = 0;
  l.h = align_up(static_cast<size_t>(l.meta_ints) * 4);
  l.yd = l.h + align_up(static_cast<size_t>(chunk_pairs) * inter * 2);
  l.total = l.yd + align_up(static_cast<size_t>(chunk_pairs) * hidden * 4);
  return l;
}

void run_fused(const MoePrefillParams& p, cudaStream_t stream) {
  const FusedLayout lay = fused_layout(p);
  char* ws = static_cast<char*>(p.workspace);
  const int64_t hidden = p.gate_up.cols, inter = p.down.cols, k = p.top_k;
  const int E = p.gate_up.num_experts;
  const int64_t chunk = fused_chunk(p);
  const int64_t pairs = p.tokens * k;

  std::vector<int32_t> ids(static_cast<size_t>(pairs));
  FN_CUDA_CHECK(cudaMemcpyAsync(ids.data(), p.ids, ids.size() * 4, cudaMemcpyDeviceToHost, stream));
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));

  struct ChunkPlan {
    int64_t t0, tokens;
    size_t row_pair, tiles;  // offsets in ints
    int64_t num_tiles;
  };
  std::vector<ChunkPlan> plans;
  std::vector<int32_t> meta;
  meta.reserve(static_cast<size_t>(lay.meta_ints));
  std::vector<int32_t> count(static_cast<size_t>(E) + 1);
  for (int64_t t0 = 0; t0 < p.tokens; t0 += chunk) {
    ChunkPlan cp{};
    cp.t0 = t0;
    cp.tokens = std::min(chunk, p.tokens - t0);
    const int32_t* cid = ids.data() + t0 * k;
    const int32_t cpairs = static_cast<int32_t>(cp.tokens * k);
    std::fill(count.begin(), count.end(), 0);
    for (int32_t q = 0; q < cpairs; ++q)
      if (cid[q] >= 0 && cid[q] < E) ++count[static_cast<size_t>(cid[q]) + 1];
    for (int e = 0; e < E; ++e) count[e + 1] += count[e];
    cp.row_pair = meta.size();
    meta.resize(meta.size() + static_cast<size_t>(count[E]));
    {
      std::vector<int32_t> fill(count.begin(), count.end() - 1);
      for (int32_t q = 0; q < cpairs; ++q)
        if (cid[q] >= 0 && cid[q] < E) meta[cp.row_pair + static_cast<size_t>(fill[cid[q]]++)] = q;
    }
    cp.tiles = meta.size();
    for (int e = 0; e < E; ++e)
      for (int32_t r = count[e]; r < count[e + 1]; r += kFBm) {
        meta.push_back(e);
        meta.push_back(r);
        meta.push_back(std::min<int32_t>(kFBm, count[e + 1] - r));
      }
    cp.num_tiles = static_cast<int64_t>(meta.size() - cp.tiles) / 3;
    plans.push_back(cp);
  }
  FN_CHECK(static_cast<int64_t>(meta.size()) <= lay.meta_ints,
           "moe prefill: routing tables exceed the planned workspace");
  int32_t* meta_d = reinterpret_cast<int32_t*>(ws + lay.meta);
  if (!meta.empty())
    FN_CUDA_CHECK(
        cudaMemcpyAsync(meta_d, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, stream));
  if (p.h_out != nullptr)
    FN_CUDA_CHECK(cudaMemsetAsync(p.h_out, 0, static_cast<size_t>(pairs) * inter * 2, stream));
  uint16_t* h = reinterpret_cast<uint16_t*>(ws + lay.h);
  float* yd = reinterpret_cast<float*>(ws + lay.yd);
  FN_CUDA_CHECK(cudaFuncSetAttribute(fused_expert_kernel<true>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kFSmemBytes)));
  FN_CUDA_CHECK(cudaFuncSetAttribute(fused_expert_kernel<false>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kFSmemBytes)));
  for (const ChunkPlan& cp : plans) {
    if (cp.num_tiles > 0) {
      FusedArgs a;
      a.a = p.x + cp.t0 * hidden;  // row_pair holds chunk-local pairs: token = pair / top_k
      a.packed = p.gate_up.packed;
      a.scales = p.gate_up.scales;
      a.gscale = p.gate_up.global_scale;
      a.wrows = p.gate_up.rows;
      a.K = hidden;
      a.feats = inter;
      a.ftiles = static_cast<int>((inter + kFBn / 2 - 1) / (kFBn / 2));
      a.row_pair = meta_d + cp.row_pair;
      a.tiles = meta_d + cp.tiles;
      a.top_k = p.top_k;
      a.h = h;
      a.h_out = p.h_out != nullptr ? p.h_out + cp.t0 * k * inter : nullptr;
      const int64_t blocks_gu = cp.num_tiles * a.ftiles;
      FN_CHECK(blocks_gu <= INT32_MAX, "moe prefill: too many tiles");
      fused_expert_kernel<true>
          <<<static_cast<unsigned>(blocks_gu), kFThreads, kFSmemBytes, stream>>>(a);
      FN_CUDA_LAUNCH_CHECK("fused_expert_kernel<gate_up>");
      FusedArgs d;
      d.a = h;
      d.packed = p.down.packed;
      d.scales = p.down.scales;
      d.gscale = p.down.global_scale;
      d.wrows = p.down.rows;
      d.K = inter;
      d.feats = hidden;
      d.ftiles = static_cast<int>((hidden + kFBn - 1) / kFBn);
      d.row_pair = a.row_pair;
      d.tiles = a.tiles;
      d.top_k = p.top_k;
      d.yd = yd;
      const int64_t blocks_dn = cp.num_tiles * d.ftiles;
      FN_CHECK(blocks_dn <= INT32_MAX, "moe prefill: too many tiles");
      fused_expert_kernel<false>
          <<<static_cast<unsigned>(blocks_dn), kFThreads, kFSmemBytes, stream>>>(d);
      FN_CUDA_LAUNCH_CHECK("fused_expert_kernel<down>");
    }
    fused_reduce_kernel<<<grid_for(cp.tokens * hidden), kThreads, 0, stream>>>(
        yd, hidden, p.ids + cp.t0 * k, p.weights + cp.t0 * k, p.down.global_scale, E, p.top_k,
        cp.tokens, p.y + cp.t0 * hidden);
    FN_CUDA_LAUNCH_CHECK("fused_reduce_kernel");
  }
}

}  // namespace

size_t moe_prefill_workspace_bytes(const MoePrefillParams& p) {
  check_shapes(p, "moe_prefill_workspace_bytes");
  if (use_per_row(p))
    return align_up(static_cast<size_t>(std::max<int64_t>(p.tokens, 1) * p.top_k) * p.down.cols *
                    2);
  return fused_layout(p).total;
}

void launch_moe_prefill(const MoePrefillParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_prefill";
  check_shapes(p, kOp);
  if (p.tokens == 0) return;
  FN_LAUNCH_REQUIRE(p.ids != nullptr && p.weights != nullptr && p.x != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.y != nullptr && p.workspace != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.gate_up.packed != nullptr && p.gate_up.scales != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.down.packed != nullptr && p.down.scales != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.gate_up.global_scale != nullptr && p.down.global_scale != nullptr, kOp);
  FN_LAUNCH_REQUIRE(aligned(p.x, 16) && aligned(p.workspace, kAlign), kOp);
  FN_LAUNCH_REQUIRE(aligned(p.gate_up.packed, 16) && aligned(p.down.packed, 16), kOp);
  if (use_per_row(p))
    run_per_row(p, stream);
  else
    run_fused(p, stream);
}

}  // namespace fn
