// GPU tests of the QSA prefill (cuda/kernels/qsa_prefill.h) against M successive QSA decode steps
// (cuda/kernels/qsa.h, itself checked against the CPU ops in test_cuda_qsa.cpp) on an identical
// copy of the caches: tiny shapes at TP=1/2/4 from position 0 and from a cache populated by 13
// decode steps, M in {1, 2, 3, 4, 5, 17, 63, 64, 65}, with automatic and forced small row groups;
// the real head sizes (hd 256, ihd 128) over 300 tokens with block_topk 8; the real head count
// per KV head (12, tensor-core sub-groups of 10 rows) and 16 across the dense -> sparse boundary
// with row groups of 1, 3, 7 rows and lengths that are no multiple of the sub-group; launcher
// checks; a bench at the real shapes (FN_BENCH=1). Every case also compares the prefill's choice
// log (selected_log, counters_log) row by row with decode's workspace after the step at that
// position.
//
// Every case runs all three attention variants. Caches and choice logs: bitwise equal to decode's
// in all. Outputs: kDecodeChunks runs decode's device code (cuda/kernels/qsa_device.cuh) and
// decode's attention operation sequence with decode's chunking, so every output row must be
// bitwise what the decode steps wrote. kFusedCudaCores computes the same softmax(q.k) v in another
// FP32 summation order (online softmax over 64-token tiles, the dot products summed in four
// quarters); kFused (tensor cores) too, in a third order (16-term MMA sums, tiles of the
// sub-group's union), with p carried as p_hi + p_lo to 2^-16 relative (q exactly in three BF16
// pieces). Their FP32 outputs differ from decode's by a few units of 2^-20 relative of the output's
// scale (docs/numerics.md "The batched prefill" derives it), far below one BF16 step (2^-8), so a
// BF16 output either equals decode's or is its neighbour: each element must lie within 2^-7 |want|
// (one BF16 rounding step, the worst case at a binade edge) + 1e-5 max|want of the row| (elements
// near zero, whose BF16 step is below the FP32 deviation; 1e-5 is about 4 standard deviations of
// that deviation relative to the row's largest output), and at most 5% of the elements may differ
// at all (a flip needs the FP32 deviation to straddle a rounding boundary: expected about 1%). A
// wrong selection, token or mask changes outputs far beyond that (random data), and the choice
// logs are compared exactly.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "core/error.h"
#include "cuda/kernels/qsa.h"
#include "cuda/kernels/qsa_prefill.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;

constexpr double kTheta = 1e7;
constexpr float kEps = 1e-6f;

struct Shape {
  const char* name;
  int hd, rot, hq, hkv, q_first, q_per_kv, kv_first, ni, ihd, ratio, topk;
  int64_t ctx;
};

// Tiny fixtures as in test_cuda_qsa.cpp (g3_tiny: hd 32, 4 q / 2 kv heads, rotary 8, indexer
// 2 x 16, block_topk 2; tp4: hd 16, 8 q / 2 kv heads), at TP=1/2/4, plus block_topk 3.
const Shape kG3Tp1{"g3_tiny TP=1", 32, 8, 4, 2, 0, 2, 0, 2, 16, 4, 2, 96};
const Shape kG3Tp2r1{"g3_tiny TP=2 rank 1", 32, 8, 2, 1, 2, 2, 1, 2, 16, 4, 2, 96};
const Shape kTp4Tp2r0{"tp4 TP=2 rank 0 topk 3", 16, 8, 4, 1, 0, 4, 0, 2, 16, 4, 3, 96};
const Shape kTp4Tp4r3{"tp4 TP=4 rank 3", 16, 8, 2, 1, 6, 4, 1, 2, 16, 4, 2, 96};
// Real head sizes (hd 256, rotary 64, indexer heads of 128, ratio 4) with few heads and
// block_topk 8 so that selection starts at t = 35.
const Shape kRealHeads{
    "hd 256 / ihd 128, 4 q / 2 kv heads, topk 8", 256, 64, 4, 2, 0, 2, 0, 2, 128, 4, 8, 320};
// Many attended tokens (several 64-token tiles of the fused attention: block_topk 20-40) and
// every query-head count per KV head the fused kernel pads to (12 -> 12 as the real model, 6 -> 8
// with padding heads, 16 -> 16), including a TP=2 rank-1 head mapping.
const Shape kWide{"hd 32, 24 q / 2 kv heads, topk 24", 32, 8, 24, 2, 0, 12, 0, 2, 16, 4, 24, 192};
const Shape kSixPerKv{
    "hd 32, 6 q / 1 kv head (TP=2 rank 1), topk 20", 32, 8, 6, 1, 6, 6, 1, 2, 16, 4, 20, 160};
const Shape kSixteenPerKv{
    "hd 32, 16 q / 1 kv head, topk 20", 32, 8, 16, 1, 0, 16, 0, 2, 16, 4, 20, 128};
const Shape kRealHeadsWide{
    "hd 256 / ihd 128, 4 q / 2 kv heads, topk 40", 256, 64, 4, 2, 0, 2, 0, 2, 128, 4, 40, 256};
// The real head mapping (12 q heads per KV head: tensor-core sub-groups of 128 / 12 = 10 rows) and
// 16 per KV head (8 rows) at the real head sizes with block_topk 8: selection from t = 35 on, so
// sub-groups cross the dense -> sparse boundary and neighbouring rows select different blocks.
const Shape kRealMapping{
    "hd 256 / ihd 128, 24 q / 2 kv heads, topk 8", 256, 64, 24, 2, 0, 12, 0, 2, 128, 4, 8, 320};
const Shape kRealSixteen{
    "hd 256 / ihd 128, 16 q / 1 kv head, topk 8", 256, 64, 16, 1, 0, 16, 0, 2, 128, 4, 8, 192};
// Real (docs/model.md §A.2/§A.3): TP=1 24 q / 2 kv heads, TP=2 12 q / 1 kv head per rank.
Shape real_tp1(int64_t ctx) {
  return Shape{"real TP=1", 256, 64, 24, 2, 0, 12, 0, 4, 128, 4, 512, ctx};
}
Shape real_tp2r1(int64_t ctx) {
  return Shape{"real TP=2 rank 1", 256, 64, 12, 1, 12, 12, 1, 4, 128, 4, 512, ctx};
}

int64_t proj_size(const Shape& s) {
  return int64_t{s.hq} * 2 * s.hd + 2 * int64_t{s.hkv} * s.hd + int64_t{s.ni + 1} * s.ihd;
}

std::vector<float> random_floats(size_t n, float sigma, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Projections of `tokens` tokens (rows of proj_size), with per-16-value scales so that the
// norms' statistic matters.
std::vector<float> random_projs(const Shape& s, int64_t tokens, std::mt19937_64& rng) {
  auto v = random_floats(size_t(tokens * proj_size(s)), 1.0f, rng);
  std::uniform_real_distribution<float> sc(0.1f, 4.0f);
  for (size_t h = 0; h + 16 <= v.size(); h += 16) {
    const float f = sc(rng);
    for (int e = 0; e < 16; ++e) v[h + e] *= f;
  }
  return v;
}

// One QSA layer's device caches and norm weights, with decode parameters.
struct Layer {
  Shape s;
  std::unique_ptr<DeviceArray<float>> qn, kn, iqn, ikn, raw, bk;
  std::unique_ptr<DeviceArray<uint16_t>> kc, vc;
  fn::QsaDecodeParams p;

  Layer(const Shape& shape, uint64_t seed) : s(shape) {
    std::mt19937_64 rng(seed);
    qn = std::make_unique<DeviceArray<float>>(random_floats(s.hd, 0.5f, rng));
    kn = std::make_unique<DeviceArray<float>>(random_floats(s.hd, 0.5f, rng));
    iqn = std::make_unique<DeviceArray<float>>(random_floats(s.ihd, 0.5f, rng));
    ikn = std::make_unique<DeviceArray<float>>(random_floats(s.ihd, 0.5f, rng));
    const size_t kv = size_t(s.ctx) * s.hkv * s.hd;
    kc = std::make_unique<DeviceArray<uint16_t>>(kv);
    vc = std::make_unique<DeviceArray<uint16_t>>(kv);
    raw = std::make_unique<DeviceArray<float>>(size_t(s.ctx) * s.ihd);
    bk = std::make_unique<DeviceArray<float>>(size_t(s.ctx / s.ratio) * s.ihd);
    // Unwritten rows hold NaN: a kernel that reads one poisons its output.
    FN_CUDA_CHECK(cudaMemset(kc->ptr, 0xff, kv * 2));
    FN_CUDA_CHECK(cudaMemset(vc->ptr, 0xff, kv * 2));
    FN_CUDA_CHECK(cudaMemset(raw->ptr, 0xff, raw->n * 4));
    FN_CUDA_CHECK(cudaMemset(bk->ptr, 0xff, bk->n * 4));
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    p.q_norm = qn->ptr;
    p.k_norm = kn->ptr;
    p.iq_norm = iqn->ptr;
    p.ik_norm = ikn->ptr;
    p.k_cache = kc->ptr;
    p.v_cache = vc->ptr;
    p.raw_keys = raw->ptr;
    p.block_keys = bk->ptr;
    p.ctx_size = s.ctx;
    p.num_q_heads = s.hq;
    p.num_kv_heads = s.hkv;
    p.q_head_first = s.q_first;
    p.q_per_kv = s.q_per_kv;
    p.kv_head_first = s.kv_first;
    p.head_dim = s.hd;
    p.rotary_dim = s.rot;
    p.rope_theta = kTheta;
    p.indexer_heads = s.ni;
    p.indexer_head_dim = s.ihd;
    p.ratio = s.ratio;
    p.block_topk = s.topk;
    p.eps = kEps;
  }
  // Copies the other layer's caches (same shape) into this one.
  void copy_caches_from(const Layer& o) {
    FN_CUDA_CHECK(cudaMemcpy(kc->ptr, o.kc->ptr, kc->n * 2, cudaMemcpyDeviceToDevice));
    FN_CUDA_CHECK(cudaMemcpy(vc->ptr, o.vc->ptr, vc->n * 2, cudaMemcpyDeviceToDevice));
    FN_CUDA_CHECK(cudaMemcpy(raw->ptr, o.raw->ptr, raw->n * 4, cudaMemcpyDeviceToDevice));
    FN_CUDA_CHECK(cudaMemcpy(bk->ptr, o.bk->ptr, bk->n * 4, cudaMemcpyDeviceToDevice));
  }
};

// Decode's choices after each step, read from its workspace as the engine's --check-choices log
// does: the first sel selected entries ([n, sel], sel = min(block_topk, ctx/ratio)) and the four
// counters ([n, 4]).
struct Choices {
  int64_t sel = 0;
  std::vector<int32_t> selected, counters;
};

// Runs decode steps at positions first.. first+n-1 with the rows of `projs` starting at row
// `row0`; returns the outputs [n, hq*hd] (and each step's choices into *choices when given).
std::vector<uint16_t> decode_steps(Layer& L, const std::vector<float>& projs, int64_t row0,
                                   int64_t first, int64_t n, Choices* choices = nullptr) {
  const Shape& s = L.s;
  const int64_t ps = proj_size(s), od = int64_t{s.hq} * s.hd;
  DeviceArray<float> proj(ps);
  DeviceArray<int64_t> pos(1);
  DeviceArray<uint16_t> out(od);
  DeviceArray<uint8_t> ws(fn::qsa_decode_workspace_bytes(L.p));
  fn::QsaDecodeParams p = L.p;
  p.proj = proj.ptr;
  p.position = pos.ptr;
  p.out = out.ptr;
  p.workspace = ws.ptr;
  std::vector<uint16_t> outs(size_t(n * od));
  const fn::QsaWorkspaceLayout wl = fn::qsa_workspace_layout(L.p);
  const int64_t sel = std::min<int64_t>(s.topk, s.ctx / s.ratio);
  if (choices != nullptr) {
    choices->sel = sel;
    choices->selected.assign(size_t(n * sel), 0);
    choices->counters.assign(size_t(n * 4), 0);
  }
  for (int64_t i = 0; i < n; ++i) {
    FN_CUDA_CHECK(
        cudaMemcpy(proj.ptr, projs.data() + (row0 + i) * ps, ps * 4, cudaMemcpyHostToDevice));
    const int64_t t = first + i;
    FN_CUDA_CHECK(cudaMemcpy(pos.ptr, &t, 8, cudaMemcpyHostToDevice));
    fn::launch_qsa_decode(p, nullptr);
    FN_CUDA_CHECK(cudaMemcpy(outs.data() + i * od, out.ptr, od * 2, cudaMemcpyDeviceToHost));
    if (choices != nullptr) {
      const uint8_t* w8 = ws.ptr;
      FN_CUDA_CHECK(cudaMemcpy(choices->selected.data() + i * sel, w8 + wl.selected, sel * 4,
                               cudaMemcpyDeviceToHost));
      FN_CUDA_CHECK(cudaMemcpy(choices->counters.data() + i * 4, w8 + wl.counters, 16,
                               cudaMemcpyDeviceToHost));
    }
  }
  return outs;
}

// Launches the prefill of rows row0..row0+n-1 of `projs` at positions first.. on L (the proj rows
// laid out with a stride 5 floats longer than a row, to exercise proj_stride); returns out. With
// `choices`, also fills the choice logs (selected_log [n, sel_max], counters_log [n, 4]).
std::vector<uint16_t> prefill(Layer& L, const std::vector<float>& projs, int64_t row0,
                              int64_t first, int64_t n, int64_t max_group_rows,
                              fn::QsaPrefillAttention attention, int64_t* group_rows = nullptr,
                              Choices* choices = nullptr) {
  const Shape& s = L.s;
  const int64_t ps = proj_size(s), stride = ps + 5, od = int64_t{s.hq} * s.hd;
  std::vector<float> strided(size_t(n * stride), 1e30f);
  for (int64_t i = 0; i < n; ++i)
    std::copy_n(projs.data() + (row0 + i) * ps, ps, strided.data() + i * stride);
  DeviceArray<float> proj(strided);
  DeviceArray<uint16_t> out(size_t(n * od));
  fn::QsaPrefillParams p;
  p.shape = L.p;
  p.proj = proj.ptr;
  p.proj_stride = stride;
  p.tokens = n;
  p.first_position = first;
  p.out = out.ptr;
  p.max_group_rows = max_group_rows;
  p.attention = attention;
  const fn::QsaPrefillLayout layout = fn::qsa_prefill_layout(p);
  REQUIRE(fn::qsa_prefill_workspace_bytes(p) == layout.total);
  // A fused kernel runs when asked for and hd % 32 == 0 (hd 16 shapes run decode's chunks); the
  // test shapes' contexts are small enough for kFused's union bitmap.
  CHECK(layout.fused == (attention != fn::QsaPrefillAttention::kDecodeChunks && s.hd % 32 == 0));
  CHECK(layout.tensor_cores == (attention == fn::QsaPrefillAttention::kFused && s.hd % 32 == 0));
  if (layout.tensor_cores) {
    int gmax = 0;  // the most local q heads of one local KV head
    for (int j = 0; j < s.hkv; ++j) {
      int g = 0;
      for (int i = 0; i < s.hq; ++i) g += (s.q_first + i) / s.q_per_kv - s.kv_first == j;
      gmax = std::max(gmax, g);
    }
    CHECK(layout.tc_rows == 128 / gmax);
  }
  if (group_rows != nullptr) *group_rows = layout.group_rows;
  DeviceArray<uint8_t> ws(layout.total);
  p.workspace = ws.ptr;
  // Poisoned logs: a row the launcher does not copy shows up as -1 counters.
  DeviceArray<int32_t> sel_log(std::vector<int32_t>(size_t(n * layout.sel_max), -1));
  DeviceArray<int32_t> cnt_log(std::vector<int32_t>(size_t(n * 4), -1));
  if (choices != nullptr) {
    p.selected_log = sel_log.ptr;
    p.counters_log = cnt_log.ptr;
  }
  fn::launch_qsa_prefill(p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  if (choices != nullptr) {
    choices->sel = layout.sel_max;
    choices->selected = sel_log.download();
    choices->counters = cnt_log.download();
  }
  return out.download();
}

// Output comparison of the fused variant (see the file comment).
struct OutCheck {
  int64_t bad = 0;     // elements outside the bound
  int64_t differ = 0;  // elements not bitwise equal
  double worst = 0;    // largest |got - want| / bound
};
OutCheck compare_outputs(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want,
                         int64_t rows, int64_t od) {
  OutCheck c;
  for (int64_t r = 0; r < rows; ++r) {
    double mx = 0;
    for (int64_t e = 0; e < od; ++e)
      mx = std::max(mx, std::fabs(double(fn::bf16_to_float(want[size_t(r * od + e)]))));
    for (int64_t e = 0; e < od; ++e) {
      const size_t i = size_t(r * od + e);
      if (got[i] == want[i]) continue;
      ++c.differ;
      const double w = fn::bf16_to_float(want[i]), g = fn::bf16_to_float(got[i]);
      const double bound = std::ldexp(std::fabs(w), -7) + 1e-5 * mx;
      const double ratio = std::fabs(g - w) / bound;  // NaN (a NaN output) counts as bad
      if (!(ratio <= 1.0)) ++c.bad;
      if (!(ratio <= c.worst)) c.worst = ratio;
    }
  }
  return c;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

const char* variant_name(fn::QsaPrefillAttention v) {
  switch (v) {
    case fn::QsaPrefillAttention::kFused:
      return "fused (tensor cores)";
    case fn::QsaPrefillAttention::kFusedCudaCores:
      return "fused (CUDA cores)";
    case fn::QsaPrefillAttention::kDecodeChunks:
      return "decode chunks";
  }
  return "?";
}

// What a case covered: rows whose selection dropped blocks, and rows whose selected blocks differ
// from the previous row's (both dropping blocks).
struct CaseStats {
  int64_t selecting = 0;
  int64_t changed = 0;
};

// History of p0 decode steps on `dec`, copied into `pre`; then M decode steps on `dec` and a
// prefill of the same M rows on `pre`. All four caches and the choice logs must be bitwise equal,
// the outputs bitwise (kDecodeChunks) or within the fused bound (see the file comment).
CaseStats check_case(const Shape& s, int64_t p0, int64_t M, int64_t max_group_rows, uint64_t seed,
                     fn::QsaPrefillAttention attention) {
  const bool fused = attention != fn::QsaPrefillAttention::kDecodeChunks;
  INFO(s.name, " p0=", p0, " M=", M, " max_group_rows=", max_group_rows, " ",
       variant_name(attention));
  std::mt19937_64 rng(seed);
  const auto projs = random_projs(s, p0 + M, rng);
  Layer dec(s, seed + 1), pre(s, seed + 1);
  if (p0 > 0) (void)decode_steps(dec, projs, 0, 0, p0);
  pre.copy_caches_from(dec);
  Choices want_ch, got_ch;
  const auto want = decode_steps(dec, projs, p0, p0, M, &want_ch);
  int64_t group_rows = 0;
  const auto got = prefill(pre, projs, p0, p0, M, max_group_rows, attention, &group_rows, &got_ch);
  const int64_t od = int64_t{s.hq} * s.hd;
  REQUIRE(got_ch.sel >= want_ch.sel);
  int64_t bad_out = 0, bad_choice = 0;
  for (int64_t r = 0; r < M; ++r) {
    INFO("row ", r, " (position ", p0 + r, ")");
    const bool out_ok =
        fused || std::memcmp(got.data() + r * od, want.data() + r * od, od * 2) == 0;
    // The choice log: counters as decode's, then the first count selected blocks.
    const int32_t* gc = got_ch.counters.data() + r * 4;
    const int32_t* wc = want_ch.counters.data() + r * 4;
    bool ch_ok = std::equal(gc, gc + 4, wc) && wc[0] >= 0 && wc[0] <= want_ch.sel;
    if (ch_ok) {
      ch_ok = std::equal(got_ch.selected.data() + r * got_ch.sel,
                         got_ch.selected.data() + r * got_ch.sel + wc[0],
                         want_ch.selected.data() + r * want_ch.sel);
    }
    if (!out_ok && bad_out++ < 3) CHECK(out_ok);
    if (!ch_ok && bad_choice++ < 3) CHECK(ch_ok);
  }
  CHECK(bad_out == 0);
  CHECK(bad_choice == 0);
  if (fused) {
    const OutCheck c = compare_outputs(got, want, M, od);
    INFO(variant_name(attention), ": ", c.differ, " of ", M * od, " elements differ, worst ",
         c.worst, " of the bound");
    if (M * od >= 100000) {  // the larger cases report how close they come
      MESSAGE(s.name, " p0=", p0, " M=", M, " max_group_rows=", max_group_rows, " ",
              variant_name(attention), ": ", c.differ, " of ", M * od, " elements differ, worst ",
              c.worst, " of the bound");
    }
    CHECK(c.bad == 0);
    CHECK(c.differ * 20 <= M * od);
  }
  CHECK(same_bits(pre.kc->download(), dec.kc->download()));
  CHECK(same_bits(pre.vc->download(), dec.vc->download()));
  CHECK(same_bits(pre.raw->download(), dec.raw->download()));
  CHECK(same_bits(pre.bk->download(), dec.bk->download()));
  if (max_group_rows > 0) CHECK(group_rows == std::min(M, max_group_rows));
  CaseStats st;
  for (int64_t r = 0; r < M; ++r) {
    const int64_t t = p0 + r;
    if ((t + 1) / s.ratio <= s.topk) continue;
    ++st.selecting;
    if (r == 0 || t / s.ratio <= s.topk) continue;  // the previous row dense or not in the case
    const int32_t* a = want_ch.selected.data() + r * want_ch.sel;
    if (!std::equal(a, a + s.topk, a - want_ch.sel)) ++st.changed;
  }
  return st;
}

const std::vector<int64_t> kMs = {1, 2, 3, 4, 5, 17, 63, 64, 65};
constexpr fn::QsaPrefillAttention kVariants[] = {fn::QsaPrefillAttention::kFused,
                                                 fn::QsaPrefillAttention::kFusedCudaCores,
                                                 fn::QsaPrefillAttention::kDecodeChunks};

}  // namespace

TEST_CASE("qsa prefill: tiny shapes from position 0 equal M decode steps") {
  for (const auto v : kVariants) {
    for (const Shape& s : {kG3Tp1, kG3Tp2r1, kTp4Tp2r0, kTp4Tp4r3}) {
      int64_t selecting = 0;
      for (int64_t M : kMs) selecting += check_case(s, 0, M, 0, 100 + M, v).selecting;
      CHECK(selecting > 0);  // block_topk 2-3: rows from t = 11 (15) on drop blocks
    }
  }
}

TEST_CASE("qsa prefill: tiny shapes continuing a cache of 13 decode steps equal decode") {
  for (const auto v : kVariants) {
    for (const Shape& s : {kG3Tp1, kG3Tp2r1, kTp4Tp2r0, kTp4Tp4r3}) {
      int64_t selecting = 0;
      for (int64_t M : kMs) selecting += check_case(s, 13, M, 0, 200 + M, v).selecting;
      CHECK(selecting > 0);
    }
  }
}

TEST_CASE("qsa prefill: rows split into small groups (1, 3, 7 rows) still equal decode") {
  for (const auto v : kVariants) {
    for (int64_t g : {1, 3, 7}) {
      CHECK(check_case(kG3Tp1, 0, 65, g, 300 + g, v).selecting > 0);
      CHECK(check_case(kTp4Tp2r0, 13, 17, g, 400 + g, v).selecting > 0);
    }
  }
}

TEST_CASE("qsa prefill: real head sizes over 300 tokens with block_topk 8 equal decode") {
  for (const auto v : kVariants) {
    CHECK(check_case(kRealHeads, 0, 300, 0, 500, v).selecting == 300 - 35);
    // From a populated cache, in groups of 50 rows (block hand-off between groups).
    CHECK(check_case(kRealHeads, 37, 263, 50, 600, v).selecting == 263);
  }
}

TEST_CASE("qsa prefill: many attended tokens and 6, 12, 16 q heads per KV head equal decode") {
  for (const auto v : kVariants) {
    CHECK(check_case(kWide, 0, 180, 0, 700, v).selecting == 180 - 99);  // dense rows up to t = 98
    CHECK(check_case(kSixPerKv, 0, 150, 40, 710, v).selecting == 150 - 83);
    CHECK(check_case(kSixteenPerKv, 5, 115, 0, 720, v).selecting == 120 - 83);
    CHECK(check_case(kRealHeadsWide, 9, 240, 0, 730, v).selecting == 249 - 163);
  }
}

TEST_CASE(
    "qsa prefill: 12 and 16 q heads per KV head at hd 256 across the dense -> sparse boundary "
    "equal decode") {
  for (const auto v : kVariants) {
    // From position 0 (rows 0..34 dense, 35.. selecting), automatic groups: 203 rows = 20
    // sub-groups of 10 and one of 3; sub-group 3 (rows 30..39) crosses the boundary.
    const CaseStats a = check_case(kRealMapping, 0, 203, 0, 800, v);
    CHECK(a.selecting == 203 - 35);
    CHECK(a.changed > 0);
    // From a populated cache at p0 = 29 in groups of 1, 3 and 7 rows (sub-groups of at most that
    // many rows, the boundary inside a group) and 47 rows (4 sub-groups of 10 and one of 7).
    for (int64_t g : {1, 3, 7, 47}) {
      const CaseStats b = check_case(kRealMapping, 29, 96, g, 810 + g, v);
      CHECK(b.selecting == 96 - 6);
      CHECK(b.changed > 0);
    }
    // 16 q heads per KV head: sub-groups of 8 rows; 141 rows from p0 = 30 (not a multiple of 8).
    const CaseStats c = check_case(kRealSixteen, 30, 141, 0, 820, v);
    CHECK(c.selecting == 141 - 5);
    CHECK(c.changed > 0);
  }
}

TEST_CASE("qsa prefill: the launcher rejects bad parameters") {
  Layer L(kG3Tp1, 3);
  DeviceArray<float> proj(size_t(4 * proj_size(kG3Tp1)));
  DeviceArray<uint16_t> out(size_t(4 * kG3Tp1.hq * kG3Tp1.hd));
  fn::QsaPrefillParams base;
  base.shape = L.p;
  base.proj = proj.ptr;
  base.proj_stride = proj_size(kG3Tp1);
  base.tokens = 4;
  base.first_position = 0;
  base.out = out.ptr;
  DeviceArray<uint8_t> ws(fn::qsa_prefill_workspace_bytes(base));
  base.workspace = ws.ptr;
  auto bad = [&](auto mutate) {
    fn::QsaPrefillParams p = base;
    mutate(p);
    CHECK_THROWS_AS(fn::launch_qsa_prefill(p, nullptr), fn::Error);
  };
  bad([](fn::QsaPrefillParams& p) { p.proj = nullptr; });
  bad([](fn::QsaPrefillParams& p) { p.out = nullptr; });
  bad([](fn::QsaPrefillParams& p) { p.workspace = nullptr; });
  bad([](fn::QsaPrefillParams& p) { p.workspace = static_cast<char*>(p.workspace) + 16; });
  bad([](fn::QsaPrefillParams& p) { p.shape.k_cache = nullptr; });
  bad([](fn::QsaPrefillParams& p) { p.shape.block_keys = nullptr; });
  bad([](fn::QsaPrefillParams& p) { p.tokens = 0; });
  bad([](fn::QsaPrefillParams& p) { p.first_position = -1; });
  bad([](fn::QsaPrefillParams& p) { p.first_position = p.shape.ctx_size - 3; });  // 4 > 3 rows
  bad([](fn::QsaPrefillParams& p) { p.proj_stride -= 1; });
  bad([](fn::QsaPrefillParams& p) { p.shape.head_dim = 31; });
  bad([](fn::QsaPrefillParams& p) { p.shape.q_per_kv = 1; });
  bad([](fn::QsaPrefillParams& p) { p.max_group_rows = -1; });
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  // The workspace stays bounded as the token count grows (rows are processed in groups).
  fn::QsaPrefillParams big = base;
  big.shape.ctx_size = 1 << 20;
  big.tokens = 1 << 20;
  CHECK(fn::qsa_prefill_workspace_bytes(big) <= fn::kQsaPrefillWorkspaceBudget + (1 << 20));
}

TEST_CASE("qsa prefill bench: ms per layer at the real shapes (FN_BENCH=1)") {
  const char* env = std::getenv("FN_BENCH");
  if (env == nullptr || std::string(env) != "1") return;
  struct Run {
    Shape s;
    int64_t M;
  };
  using fn::QsaPrefillAttention;
  for (const Run& r : {Run{real_tp1(8192), 8192}, Run{real_tp2r1(8192), 8192},
                       Run{real_tp1(8192), 2048}, Run{real_tp2r1(8192), 2048}}) {
    const Shape& s = r.s;
    Layer L(s, 41);
    std::mt19937_64 rng(3);
    const auto projs = random_projs(s, r.M, rng);
    DeviceArray<float> proj(projs);
    DeviceArray<uint16_t> out(size_t(r.M * s.hq * s.hd));
    cudaStream_t stream;
    FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    FN_CUDA_CHECK(cudaEventCreate(&e0));
    FN_CUDA_CHECK(cudaEventCreate(&e1));
    // One configuration: warm-up, kReps timed launches, then one launch with per-kernel timing.
    // Every launch rewrites the same cache rows with the same values.
    auto bench = [&](QsaPrefillAttention variant, int64_t groups) -> std::vector<uint16_t> {
      fn::QsaPrefillParams p;
      p.shape = L.p;
      p.proj = proj.ptr;
      p.proj_stride = proj_size(s);
      p.tokens = r.M;
      p.first_position = 0;
      p.out = out.ptr;
      p.max_group_rows = groups;
      p.attention = variant;
      const auto layout = fn::qsa_prefill_layout(p);
      DeviceArray<uint8_t> ws(layout.total);
      p.workspace = ws.ptr;
      fn::launch_qsa_prefill(p, stream);
      FN_CUDA_CHECK(cudaStreamSynchronize(stream));
      constexpr int kReps = 3;
      FN_CUDA_CHECK(cudaEventRecord(e0, stream));
      for (int i = 0; i < kReps; ++i) fn::launch_qsa_prefill(p, stream);
      FN_CUDA_CHECK(cudaEventRecord(e1, stream));
      FN_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      FN_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      ms /= kReps;
      fn::QsaPrefillTiming t;
      p.timing = &t;
      fn::launch_qsa_prefill(p, stream);
      std::printf(
          "qsa prefill bench: %s M=%lld %s groups of %lld rows (max_group_rows=%lld, %lld "
          "groups, workspace %.1f MiB): %.3f ms per layer | per kernel (event-bracketed run): "
          "prep %.3f, block keys %.3f, scores %.3f, select %.3f, attention %.3f, combine %.3f "
          "ms\n",
          s.name, static_cast<long long>(r.M), variant_name(variant),
          static_cast<long long>(layout.group_rows), static_cast<long long>(groups),
          static_cast<long long>(t.groups), layout.total / 1048576.0, ms, t.prep_ms,
          t.block_keys_ms, t.scores_ms, t.select_ms, t.attention_ms, t.combine_ms);
      MESSAGE(std::string(s.name), " M=", r.M, " ", variant_name(variant), " group rows ",
              layout.group_rows, ": ", ms, " ms per layer, attention ", t.attention_ms, " ms");
      const auto o = out.download();
      // A NaN output would mean an unwritten cache row was read.
      int64_t nan = 0;
      for (uint16_t x : o) nan += (x & 0x7fff) > 0x7f80;
      CHECK(nan == 0);
      return o;
    };
    const auto ref = bench(QsaPrefillAttention::kDecodeChunks, 0);  // bitwise decode (tests)
    auto check_against_ref = [&](const std::vector<uint16_t>& o, QsaPrefillAttention variant,
                                 int64_t groups) {
      const OutCheck c = compare_outputs(o, ref, r.M, int64_t{s.hq} * s.hd);
      std::printf(
          "qsa prefill bench: %s M=%lld %s (max_group_rows=%lld) vs decode-chunks: %lld of %lld "
          "elements differ, %lld outside the bound, worst %.3f of the bound\n",
          s.name, static_cast<long long>(r.M), variant_name(variant),
          static_cast<long long>(groups), static_cast<long long>(c.differ),
          static_cast<long long>(o.size()), static_cast<long long>(c.bad), c.worst);
      CHECK(c.bad == 0);
      CHECK(c.differ * 20 <= static_cast<int64_t>(o.size()));
    };
    // Automatic groups, then forced group sizes. kFusedCudaCores: a row's output depends on its
    // own tokens only, so it must not depend on the grouping. kFused: a row's tiles are those of
    // its sub-group's union (the FP32 order changes with the grouping), each grouping is checked
    // against decode.
    for (const QsaPrefillAttention variant :
         {QsaPrefillAttention::kFused, QsaPrefillAttention::kFusedCudaCores}) {
      std::vector<uint16_t> first;
      for (int64_t groups : {0, 64, 256, 1024}) {
        const auto o = bench(variant, groups);
        if (variant == QsaPrefillAttention::kFused || first.empty()) {
          check_against_ref(o, variant, groups);
          if (first.empty()) first = o;
        } else {
          CHECK(same_bits(o, first));
        }
      }
    }
    FN_CUDA_CHECK(cudaEventDestroy(e0));
    FN_CUDA_CHECK(cudaEventDestroy(e1));
    FN_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}
