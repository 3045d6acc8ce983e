// GPU tests of the batched routed experts (cuda/kernels/moe_prefill.h) against the decode kernels
// run once per row (cuda/kernels/decode_ops.h launch_router_topk, cuda/kernels/moe_nvfp4.h gate+up
// and down): router rows bitwise; h bitwise or one BF16 step apart (only where FP32 summation order
// moves a value across a rounding boundary); y against decode's down kernel fed the same h, within
// FP32 accumulation-order error; the per-row path bitwise. FN_BENCH=1 adds the real-shape timings.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "core/error.h"
#include "cuda/kernels/decode_ops.h"
#include "cuda/kernels/moe_nvfp4.h"
#include "cuda/kernels/moe_prefill.h"
#include "cuda/kernels/weight_fill.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;

// A stack of experts in host memory (the device layout of Nvfp4Experts), random codes (all 16),
// mostly normal block scales 2^-3..2^3 with a few subnormal ones, global scales ~2^-8.
struct HostExperts {
  int num_experts;
  int64_t rows, cols;
  std::vector<uint8_t> packed, scales;
  std::vector<float> gscale;
};

HostExperts make_experts(int num_experts, int64_t rows, int64_t cols, int per_expert,
                         uint64_t seed) {
  HostExperts h{num_experts, rows, cols, {}, {}, {}};
  std::mt19937_64 rng(seed);
  h.packed.resize(size_t(num_experts) * rows * cols / 2);
  h.scales.resize(size_t(num_experts) * rows * cols / 16);
  h.gscale.resize(size_t(num_experts) * per_expert);
  for (auto& b : h.packed) b = uint8_t(rng());
  for (auto& s : h.scales) {
    const unsigned r = rng() % 64;
    s = r == 0 ? uint8_t(1 + rng() % 7) : uint8_t(0x20 + rng() % 0x30);
  }
  for (auto& g : h.gscale) g = std::ldexp(1.0f + float(rng() % 1000) / 1000.0f, -8);
  return h;
}

struct DeviceExperts {
  DeviceArray<uint8_t> packed, scales;
  DeviceArray<float> gscale;
  fn::Nvfp4Experts view;
  explicit DeviceExperts(const HostExperts& h)
      : packed(h.packed), scales(h.scales), gscale(h.gscale) {
    fn::test::to_decode_layout(packed);  // the host copy h keeps the checkpoint's layout
    view.packed = packed.ptr;
    view.scales = scales.ptr;
    view.global_scale = gscale.ptr;
    view.num_experts = h.num_experts;
    view.rows = h.rows;
    view.cols = h.cols;
  }
};

struct CaseSpec {
  int experts, hidden, inter, top_k;
  int64_t tokens;
  fn::MoePrefillPath path;
  uint64_t seed;
  int64_t chunk_tokens = 0;
  /// When set ([tokens * top_k], any values, out-of-range ids included): the routes instead of the
  /// router's (random positive weights summing to 1 per token).
  std::vector<int32_t> forced_ids = {};
};

// Runs router rows (or takes c.forced_ids) + launch_moe_prefill and the decode kernels row by row;
// checks as the header.
void check_case(const CaseSpec& c) {
  CAPTURE(c.experts);
  CAPTURE(c.hidden);
  CAPTURE(c.inter);
  CAPTURE(c.top_k);
  CAPTURE(c.tokens);
  CAPTURE(static_cast<int>(c.path));
  CAPTURE(c.chunk_tokens);
  const int E = c.experts, k = c.top_k;
  const int64_t H = c.hidden, I = c.inter, M = c.tokens;
  const HostExperts hgu = make_experts(E, 2 * I, H, 2, c.seed);
  const HostExperts hdn = make_experts(E, H, I, 1, c.seed + 1);
  DeviceExperts gu(hgu), dn(hdn);

  // Logits: expert 1 far ahead (every token selects it), expert E - 1 far behind (none does).
  std::mt19937_64 rng(c.seed + 2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t stride = E + 3;
  std::vector<float> logits(size_t(M) * stride, 0.0f);
  for (int64_t p = 0; p < M; ++p)
    for (int e = 0; e < E; ++e)
      logits[size_t(p) * stride + e] = e == 1 ? 20.0f : e == E - 1 ? -30.0f : normal(rng);
  std::vector<uint16_t> x(size_t(M) * H);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (auto& v : x) v = fn::float_to_bf16(uni(rng));
  DeviceArray<float> d_logits(logits);
  DeviceArray<uint16_t> d_x(x);
  DeviceArray<int32_t> d_ids(size_t(M) * k);
  DeviceArray<float> d_w(size_t(M) * k);

  fn::RouterRowsParams rp;
  rp.logits = d_logits.ptr;
  rp.logits_stride = stride;
  rp.rows = M;
  rp.num_experts = E;
  rp.top_k = k;
  rp.ids = d_ids.ptr;
  rp.weights = d_w.ptr;
  const bool forced = !c.forced_ids.empty();
  if (forced) {
    REQUIRE(c.forced_ids.size() == size_t(M) * k);
    d_ids.upload(c.forced_ids);
    std::vector<float> w(size_t(M) * k);
    for (int64_t p = 0; p < M; ++p) {
      float sum = 0;
      for (int j = 0; j < k; ++j) sum += (w[size_t(p * k + j)] = 0.1f + std::fabs(uni(rng)));
      for (int j = 0; j < k; ++j) w[size_t(p * k + j)] /= sum;
    }
    d_w.upload(w);
  } else {
    fn::launch_router_topk_rows(rp, nullptr);
  }
  const auto ids = d_ids.download();
  const auto wts = d_w.download();
  for (int64_t p = 0; p < M && !forced; ++p) {  // the test data's premise
    const auto* row = ids.data() + p * k;
    REQUIRE(std::find(row, row + k, 1) != row + k);
    REQUIRE(std::find(row, row + k, E - 1) == row + k);
  }

  fn::MoePrefillParams mp;
  mp.gate_up = gu.view;
  mp.down = dn.view;
  mp.ids = d_ids.ptr;
  mp.weights = d_w.ptr;
  mp.tokens = M;
  mp.top_k = k;
  mp.x = d_x.ptr;
  mp.path = c.path;
  mp.chunk_tokens = c.chunk_tokens;
  DeviceArray<float> d_y(size_t(M) * H);
  DeviceArray<uint16_t> d_h(size_t(M) * k * I);
  DeviceArray<uint8_t> ws(fn::moe_prefill_workspace_bytes(mp));
  mp.y = d_y.ptr;
  mp.h_out = d_h.ptr;
  mp.workspace = ws.ptr;
  // Poison y: it must be overwritten.
  FN_CUDA_CHECK(cudaMemset(d_y.ptr, 0x7f, d_y.n * 4));
  fn::launch_moe_prefill(mp, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto y = d_y.download();
  const auto h = d_h.download();

  // Decode, row by row: the router, gate+up (h_ref), down (y_ref), and down fed prefill's h
  // (y_mix).
  DeviceArray<int32_t> r_ids(size_t(M) * k);
  DeviceArray<float> r_w(size_t(M) * k);
  DeviceArray<uint16_t> r_h(size_t(M) * k * I);
  DeviceArray<float> r_y(size_t(M) * H), m_y(size_t(M) * H);
  for (int64_t p = 0; p < M; ++p) {
    fn::RouterParams r;
    r.logits = d_logits.ptr + p * stride;
    r.num_experts = E;
    r.top_k = k;
    r.ids = r_ids.ptr + p * k;
    r.weights = r_w.ptr + p * k;
    if (!forced) fn::launch_router_topk(r, nullptr);
    fn::MoeGateUpParams g;
    g.experts = gu.view;
    g.expert_ids = d_ids.ptr + p * k;
    g.top_k = k;
    g.x = d_x.ptr + p * H;
    g.h = r_h.ptr + p * k * I;
    fn::launch_moe_gate_up_nvfp4(g, nullptr);
    fn::MoeDownParams d;
    d.experts = dn.view;
    d.expert_ids = d_ids.ptr + p * k;
    d.routing_weights = d_w.ptr + p * k;
    d.top_k = k;
    d.h = r_h.ptr + p * k * I;
    d.y = r_y.ptr + p * H;
    fn::launch_moe_down_nvfp4(d, nullptr);
    d.h = d_h.ptr + p * k * I;
    d.y = m_y.ptr + p * H;
    fn::launch_moe_down_nvfp4(d, nullptr);
  }
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  if (!forced) {
    CHECK(r_ids.download() == ids);
    const auto rw = r_w.download();
    CHECK(std::memcmp(rw.data(), wts.data(), wts.size() * 4) == 0);
  }
  const auto h_ref = r_h.download();
  const auto y_ref = r_y.download();
  const auto y_mix = m_y.download();

  const bool per_row = c.path == fn::MoePrefillPath::PerRow ||
                       (c.path == fn::MoePrefillPath::Auto && M <= fn::kMoePrefillPerRowMaxTokens);
  // h: bitwise equal on the per-row path. On the fused path g and u differ from decode's only
  // by FP32 summation order: decode errs by at most gamma_{H+8} * sum|w x| * gs (H exact products,
  // the block-scale and global-scale multiplies), the tensor cores by at most twice that
  // (tensor-core accumulation may truncate instead of rounding), so the two differ by at most 3x,
  // taken as 4x (eg, eu; large relative to g or u only where the dot product cancels). Through
  // silu(g) * u (|silu'| <= 1.1 everywhere bounds the change from g; silu at the exact g, widened
  // by 1.1 eg, multiplies eu) and a few FP32 roundings of silu and the product on each side,
  // then each side's BF16 rounding (half a step each): |h - h_ref| <= dh + one BF16 step.
  std::vector<float> wrow(static_cast<size_t>(H));
  const double gamma = fn::test::gamma_fp32(int(H) + 8);
  int64_t differ = 0, wrong = 0;
  std::vector<char> row_differs(size_t(M), 0);
  for (int64_t p = 0; p < M; ++p) {
    for (int j = 0; j < k; ++j) {
      const int e = ids[size_t(p * k + j)];
      const bool valid = e >= 0 && e < E;
      for (int64_t i = 0; i < I; ++i) {
        const size_t hi = size_t((p * k + j) * I + i);
        if (h[hi] == h_ref[hi]) continue;
        ++differ;
        row_differs[size_t(p)] = 1;
        if (per_row || !valid) {  // an invalid id's h is 0 on both paths
          ++wrong;
          continue;
        }
        double gu2[2], acc2[2];
        for (int half = 0; half < 2; ++half) {
          const size_t row = size_t(e) * 2 * I + size_t(half * I + i);
          fn::dequant_nvfp4_row(hgu.packed.data() + row * H / 2, hgu.scales.data() + row * H / 16,
                                1.0f, H, wrow.data());
          double dot = 0, mag = 0;
          for (int64_t c2 = 0; c2 < H; ++c2) {
            const double t = double(wrow[c2]) * fn::bf16_to_float(x[size_t(p * H + c2)]);
            dot += t;
            mag += std::fabs(t);
          }
          const double gs = hgu.gscale[size_t(e) * 2 + half];
          gu2[half] = dot * gs;
          acc2[half] = 4 * gamma * mag * gs;
        }
        const double g = gu2[0], u = gu2[1], eg = acc2[0], eu = acc2[1];
        const double sg = 1.0 / (1.0 + std::exp(-g));
        const double silu = g * sg;
        const double dh = 1.1 * eg * std::fabs(u) + (std::fabs(silu) + 1.1 * eg) * eu +
                          2 * 8 * fn::test::kFp32Unit * std::fabs(silu * u);
        const double hp = fn::bf16_to_float(h[hi]), hr = fn::bf16_to_float(h_ref[hi]);
        const double big = std::max(std::fabs(hp), std::fabs(hr));
        const double step = big > 0 ? std::ldexp(1.0, std::ilogb(big) - 7) : 0.0;
        if (!(std::fabs(hp - hr) <= dh + step)) {
          ++wrong;
          MESSAGE("h differs beyond its bound at token " << p << " slot " << j << " i " << i << ": "
                                                         << hp << " vs " << hr << ", bound "
                                                         << dh + step);
        }
      }
    }
  }
  CHECK(wrong == 0);
  // Differences need FP32 order effects (a few 2^-24 relative, more where g or u cancels) to
  // straddle a BF16 rounding midpoint (steps 2^-8 relative): observed 0 to 1.6e-4 of the elements.
  CHECK(differ <= std::max<int64_t>(2, int64_t(h.size()) / 1000));
  MESSAGE("h elements " << h.size() << ", BF16 differences " << differ);

  // y: with the same h the only difference from decode is the FP32 summation order of at most
  // top_k * I + top_k terms (each product exact: BF16 h x E2M1 * E4M3 weight); per row, the error
  // is far below 1e-5 * max|y_row| (gamma_{k*I} * sum|terms| with sum|terms| ~ sqrt(k I) |y|).
  int64_t y_wrong = 0, y_vs_decode_wrong = 0, bitwise_diff = 0;
  for (int64_t p = 0; p < M; ++p) {
    double mx = 0;
    for (int64_t d = 0; d < H; ++d) mx = std::max(mx, std::fabs(double(y_mix[p * H + d])));
    const double tol = 1e-5 * mx;
    for (int64_t d = 0; d < H; ++d) {
      const size_t i = size_t(p * H + d);
      if (!(std::fabs(double(y[i]) - y_mix[i]) <= tol)) ++y_wrong;
      if (!row_differs[size_t(p)] && !(std::fabs(double(y[i]) - y_ref[i]) <= tol))
        ++y_vs_decode_wrong;
      if (std::memcmp(&y[i], &y_ref[i], 4) != 0) ++bitwise_diff;
    }
  }
  CHECK(y_wrong == 0);
  CHECK(y_vs_decode_wrong == 0);
  if (per_row) CHECK(bitwise_diff == 0);
}

void run_all(int E, int H, int I, int k, const std::vector<int64_t>& ms, uint64_t seed) {
  for (const int64_t m : ms) {
    check_case({E, H, I, k, m, fn::MoePrefillPath::Auto, seed + uint64_t(m)});
    check_case({E, H, I, k, m, fn::MoePrefillPath::Fused, seed + 11 * uint64_t(m)});
  }
}

TEST_CASE("moe prefill: the router rows are bitwise the decode router's, row by row") {
  for (const int E : {8, 512}) {
    const int k = E == 8 ? 3 : 10;
    const int64_t M = 300, stride = E + 5;
    std::mt19937_64 rng(41 + E);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<float> logits(size_t(M) * stride);
    for (auto& v : logits) v = normal(rng);
    // Ties: row 3 all equal (lower id first), row 4 two equal leaders.
    for (int e = 0; e < E; ++e) logits[3 * stride + e] = 0.5f;
    logits[4 * stride + 2] = logits[4 * stride + 5] = 9.0f;
    DeviceArray<float> d_logits(logits);
    DeviceArray<int32_t> ids(size_t(M) * k), r_ids(size_t(M) * k);
    DeviceArray<float> w(size_t(M) * k), r_w(size_t(M) * k);
    for (const bool norm : {true, false}) {
      fn::RouterRowsParams rp;
      rp.logits = d_logits.ptr;
      rp.logits_stride = stride;
      rp.rows = M;
      rp.num_experts = E;
      rp.top_k = k;
      rp.norm_topk_prob = norm;
      rp.ids = ids.ptr;
      rp.weights = w.ptr;
      fn::launch_router_topk_rows(rp, nullptr);
      for (int64_t p = 0; p < M; ++p) {
        fn::RouterParams r;
        r.logits = d_logits.ptr + p * stride;
        r.num_experts = E;
        r.top_k = k;
        r.norm_topk_prob = norm;
        r.ids = r_ids.ptr + p * k;
        r.weights = r_w.ptr + p * k;
        fn::launch_router_topk(r, nullptr);
      }
      FN_CUDA_CHECK(cudaDeviceSynchronize());
      CHECK(ids.download() == r_ids.download());
      const auto a = w.download(), b = r_w.download();
      CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
      const auto got = ids.download();
      CHECK(got[3 * k] == 0);  // all equal: the lowest id first
      CHECK(got[4 * k] == 2);
      CHECK(got[4 * k + 1] == 5);
    }
  }
}

TEST_CASE("moe prefill: routed experts match the decode kernels run per row (I = 32)") {
  run_all(8, 64, 32, 3, {1, 2, 5, 17, 64, 300}, 100);
}

TEST_CASE("moe prefill: the 16-code path of I = 16 matches the decode kernels per row") {
  run_all(8, 64, 16, 3, {1, 5, 64}, 200);
}

TEST_CASE("moe prefill: an expert with many row tiles and many experts match decode") {
  // The 1100 rows of expert 1 (every token selects it) are 18 row tiles (17 of 64 rows, one of
  // 12); 20 experts of 4 per token.
  check_case({8, 64, 32, 3, 1100, fn::MoePrefillPath::Fused, 304});
  check_case({20, 64, 32, 4, 300, fn::MoePrefillPath::Fused, 305});
}

TEST_CASE(
    "moe prefill: the fused path's partial k stages and feature tiles and its chunks match "
    "decode") {
  // hidden 272 = 4 stages of 64 + one of 16 (gate+up k) and 3 down feature tiles of 128 (the
  // last 16 wide); I = 80: two gate+up feature tiles of 64 (the second 16 wide) and down k = 64 +
  // 16. Rows per expert ~75: a full tile of 64 and a partial one.
  check_case({8, 272, 80, 3, 200, fn::MoePrefillPath::Fused, 600});
  // Chunks of 64 tokens: 4 chunks, the last of 8 tokens.
  check_case({8, 272, 80, 3, 200, fn::MoePrefillPath::Fused, 602, 64});
  // 16-code down k (I = 16) with chunks of 1 token.
  check_case({8, 64, 16, 3, 23, fn::MoePrefillPath::Fused, 603, 1});
}

// Routes with the given rows per expert (expert e gets rows[e] of the M * k slots; the rest of the
// slots get ids outside [0, E): -1, E, 1000 in turn), shuffled over tokens and slots.
std::vector<int32_t> routes_with_counts(int E, int64_t M, int k, const std::vector<int>& rows,
                                        uint64_t seed) {
  std::vector<int32_t> ids;
  for (int e = 0; e < E && e < int(rows.size()); ++e) ids.insert(ids.end(), size_t(rows[e]), e);
  REQUIRE(ids.size() <= size_t(M) * k);
  const int32_t bad[3] = {-1, E, 1000};
  for (int i = 0; ids.size() < size_t(M) * k; ++i) ids.push_back(bad[i % 3]);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

TEST_CASE(
    "moe prefill: the fused row tiles of experts with 0, 1, 127, 128, 129 and 300 rows match "
    "decode") {
  // M = 437 tokens x 3 slots = 1311 slots: experts 0..5 take 0, 1, 127, 128, 129, 300 rows,
  // experts 6 and 7 200 each, the other 226 slots invalid ids. 300 rows are two tiles of the
  // 256-row capacity (160 + 140); 129 one tile rounded to 160 computed rows; the 64-row capacity
  // cuts every expert but 0 and 1 in several tiles.
  const std::vector<int> rows = {0, 1, 127, 128, 129, 300, 200, 200};
  CaseSpec c{8, 64, 32, 3, 437, fn::MoePrefillPath::Fused, 700};
  c.forced_ids = routes_with_counts(8, 437, 3, rows, 701);
  check_case(c);
  // The same counts through partial k stages (hidden 272, I = 80) and two feature tiles.
  CaseSpec c2{8, 272, 80, 3, 437, fn::MoePrefillPath::Fused, 702};
  c2.forced_ids = routes_with_counts(8, 437, 3, rows, 703);
  check_case(c2);
  // Chunks of 100 tokens split the counts unevenly.
  CaseSpec c3{8, 64, 32, 3, 437, fn::MoePrefillPath::Fused, 704, 100};
  c3.forced_ids = routes_with_counts(8, 437, 3, rows, 705);
  check_case(c3);
}

TEST_CASE("moe prefill: every token routed to one expert matches decode") {
  // 1037 rows on expert 5 (5 tiles of 208 at the 256-row capacity), the second slot invalid.
  const int64_t M = 1037;
  std::vector<int32_t> ids(size_t(M) * 2);
  for (int64_t p = 0; p < M; ++p) {
    ids[size_t(2 * p)] = 5;
    ids[size_t(2 * p + 1)] = p % 2 == 0 ? -3 : 8;
  }
  CaseSpec c{8, 64, 32, 2, M, fn::MoePrefillPath::Fused, 710};
  c.forced_ids = ids;
  check_case(c);
  // top_k 1, every token on expert 0, 16-code rows (I = 16), M prime.
  CaseSpec c2{4, 96, 16, 1, 263, fn::MoePrefillPath::Fused, 711};
  c2.forced_ids = std::vector<int32_t>(263, 0);
  check_case(c2);
}

TEST_CASE("moe prefill: every id outside the expert range gives y = 0 on the fused path") {
  const int64_t M = 77;
  std::vector<int32_t> ids(size_t(M) * 3);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = i % 2 == 0 ? -1 : 8 + int32_t(i);
  CaseSpec c{8, 64, 32, 3, M, fn::MoePrefillPath::Fused, 720};
  c.forced_ids = ids;
  check_case(c);  // h_ref and y_ref are 0 too: decode skips invalid ids
}

TEST_CASE("moe prefill: invalid expert ids contribute zero and zero tokens do nothing") {
  const HostExperts hgu = make_experts(8, 64, 64, 2, 5), hdn = make_experts(8, 64, 32, 1, 6);
  DeviceExperts gu(hgu), dn(hdn);
  // Token 0 all invalid; token 1: one valid id (3) and invalid ones; both paths.
  const std::vector<int32_t> ids = {-1, 8, 100, 3, -5, 8};
  const std::vector<float> w = {0.5f, 0.25f, 0.25f, 0.75f, 0.125f, 0.125f};
  std::vector<uint16_t> x(2 * 64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = fn::float_to_bf16(float(int(i % 7) - 3) / 4.0f);
  DeviceArray<int32_t> d_ids(ids);
  DeviceArray<float> d_w(w);
  DeviceArray<uint16_t> d_x(x);
  for (const auto path : {fn::MoePrefillPath::PerRow, fn::MoePrefillPath::Fused}) {
    fn::MoePrefillParams mp;
    mp.gate_up = gu.view;
    mp.down = dn.view;
    mp.ids = d_ids.ptr;
    mp.weights = d_w.ptr;
    mp.tokens = 2;
    mp.top_k = 3;
    mp.x = d_x.ptr;
    mp.path = path;
    DeviceArray<float> y(2 * 64);
    DeviceArray<uint8_t> ws(fn::moe_prefill_workspace_bytes(mp));
    mp.y = y.ptr;
    mp.workspace = ws.ptr;
    FN_CUDA_CHECK(cudaMemset(y.ptr, 0x7f, y.n * 4));
    fn::launch_moe_prefill(mp, nullptr);
    // Reference: decode on token 1 with only id 3.
    DeviceArray<int32_t> one_id(std::vector<int32_t>{3});
    DeviceArray<float> one_w(std::vector<float>{0.75f});
    DeviceArray<uint16_t> hh(32);
    DeviceArray<float> yr(64);
    fn::MoeGateUpParams g;
    g.experts = gu.view;
    g.expert_ids = one_id.ptr;
    g.top_k = 1;
    g.x = d_x.ptr + 64;
    g.h = hh.ptr;
    fn::launch_moe_gate_up_nvfp4(g, nullptr);
    fn::MoeDownParams d;
    d.experts = dn.view;
    d.expert_ids = one_id.ptr;
    d.routing_weights = one_w.ptr;
    d.top_k = 1;
    d.h = hh.ptr;
    d.y = yr.ptr;
    fn::launch_moe_down_nvfp4(d, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = y.download(), ref = yr.download();
    double mx = 0;
    for (const float v : ref) mx = std::max(mx, std::fabs(double(v)));
    CHECK(mx > 0);
    for (int i = 0; i < 64; ++i) {
      CHECK(got[i] == 0.0f);
      CHECK(std::fabs(double(got[64 + i]) - ref[i]) <= 1e-5 * mx);
    }
    mp.tokens = 0;
    fn::launch_moe_prefill(mp, nullptr);  // nothing to do, nothing thrown
  }
}

TEST_CASE("moe prefill: inconsistent expert shapes are rejected") {
  fn::MoePrefillParams mp;
  mp.gate_up.num_experts = mp.down.num_experts = 8;
  mp.gate_up.rows = 64;
  mp.gate_up.cols = 64;
  mp.down.rows = 64;
  mp.down.cols = 16;  // gate_up rows must be 2 * down cols
  mp.tokens = 4;
  mp.top_k = 2;
  CHECK_THROWS_AS(fn::moe_prefill_workspace_bytes(mp), fn::Error);
}

// ---- benchmark (FN_BENCH=1) -----------------------------------------------------------------

void fill(void* dst, int64_t count, fn::DType dt, fn::RandomFill kind, float lo, float hi,
          uint64_t stream) {
  fn::RandomFillParams f;
  f.dst = dst;
  f.count = count;
  f.dtype = dt;
  f.kind = kind;
  f.lo = lo;
  f.hi = hi;
  f.seed = 7;
  f.stream = stream;
  fn::launch_random_fill(f, nullptr);
}

void spot_check(fn::MoePrefillParams mp, fn::MoePrefillPath path, const int32_t* d_ids,
                const float* d_w, float* y_ptr, int64_t M, int k, int64_t H, int64_t inter);

void bench(int64_t inter, int64_t M, const std::vector<int64_t>& chunk_options) {
  const int E = 512, k = 10;
  const int64_t H = 2560;
  DeviceArray<uint8_t> gp(size_t(E) * 2 * inter * H / 2), gs(size_t(E) * 2 * inter * H / 16);
  DeviceArray<uint8_t> dp(size_t(E) * H * inter / 2), ds(size_t(E) * H * inter / 16);
  DeviceArray<float> gg(size_t(E) * 2), dg(static_cast<size_t>(E));
  fill(gp.ptr, int64_t(gp.n), fn::DType::U8, fn::RandomFill::E2M1Codes, 0, 0, 1);
  fill(dp.ptr, int64_t(dp.n), fn::DType::U8, fn::RandomFill::E2M1Codes, 0, 0, 2);
  fill(gs.ptr, int64_t(gs.n), fn::DType::F8_E4M3, fn::RandomFill::E4M3NearOne, 0, 0, 3);
  fill(ds.ptr, int64_t(ds.n), fn::DType::F8_E4M3, fn::RandomFill::E4M3NearOne, 0, 0, 4);
  fill(gg.ptr, int64_t(gg.n), fn::DType::F32, fn::RandomFill::Uniform, 0.002f, 0.004f, 5);
  fill(dg.ptr, int64_t(dg.n), fn::DType::F32, fn::RandomFill::Uniform, 0.002f, 0.004f, 6);
  DeviceArray<uint16_t> x(size_t(M) * H);
  fill(x.ptr, int64_t(x.n), fn::DType::BF16, fn::RandomFill::Uniform, -1.0f, 1.0f, 8);
  // Uniformly random routing: k distinct experts per token, weights normalised.
  std::mt19937_64 rng(99);
  std::vector<int32_t> ids(size_t(M) * k);
  std::vector<float> w(size_t(M) * k);
  std::vector<int32_t> perm(E);
  for (int e = 0; e < E; ++e) perm[e] = e;
  for (int64_t p = 0; p < M; ++p) {
    for (int j = 0; j < k; ++j) std::swap(perm[j], perm[j + rng() % (E - j)]);
    float s = 0;
    for (int j = 0; j < k; ++j) {
      ids[p * k + j] = perm[j];
      w[p * k + j] = 0.1f + float(rng() % 1000) / 1000.0f;
      s += w[p * k + j];
    }
    for (int j = 0; j < k; ++j) w[p * k + j] /= s;
  }
  DeviceArray<int32_t> d_ids(ids);
  DeviceArray<float> d_w(w);
  DeviceArray<float> y(size_t(M) * H);
  fn::MoePrefillParams mp;
  mp.gate_up = {gp.ptr, gs.ptr, gg.ptr, E, 2 * inter, H};
  mp.down = {dp.ptr, ds.ptr, dg.ptr, E, H, inter};
  mp.ids = d_ids.ptr;
  mp.weights = d_w.ptr;
  mp.tokens = M;
  mp.top_k = k;
  mp.x = x.ptr;
  mp.y = y.ptr;
  // Runs: the Fused path per chunk size.
  for (const int64_t chunk : chunk_options) {
    {
      mp.path = fn::MoePrefillPath::Fused;
      mp.chunk_tokens = chunk;
      const size_t wsb = fn::moe_prefill_workspace_bytes(mp);
      DeviceArray<uint8_t> ws(wsb);
      mp.workspace = ws.ptr;
      fn::launch_moe_prefill(mp, nullptr);  // warm-up
      cudaEvent_t a, b;
      FN_CUDA_CHECK(cudaEventCreate(&a));
      FN_CUDA_CHECK(cudaEventCreate(&b));
      const int reps = 5;
      FN_CUDA_CHECK(cudaDeviceSynchronize());
      FN_CUDA_CHECK(cudaEventRecord(a, nullptr));
      for (int r = 0; r < reps; ++r) fn::launch_moe_prefill(mp, nullptr);
      FN_CUDA_CHECK(cudaEventRecord(b, nullptr));
      FN_CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      FN_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      ms /= reps;
      const double flops = 2.0 * M * k * (2 * inter * H + H * inter);
      MESSAGE("moe prefill E 512 top_k 10 hidden 2560 I "
              << inter << " M " << M << " FUSED chunk_tokens " << chunk << ": " << ms
              << " ms/layer, " << flops / ms / 1e9 << " TFLOP/s, workspace "
              << double(wsb) / (1 << 20) << " MiB");
      FN_CUDA_CHECK(cudaEventDestroy(a));
      FN_CUDA_CHECK(cudaEventDestroy(b));
    }
  }
  spot_check(mp, fn::MoePrefillPath::Fused, d_ids.ptr, d_w.ptr, y.ptr, M, k, H, inter);
}

// Rows 0, 1 and M - 1 of the real shape: y against decode's down fed prefill's own h (h_out),
// and h against decode's gate+up (equal but for rare one-step BF16 differences).
void spot_check(fn::MoePrefillParams mp, fn::MoePrefillPath path, const int32_t* d_ids,
                const float* d_w, float* y_ptr, int64_t M, int k, int64_t H, int64_t inter) {
  CAPTURE(static_cast<int>(path));
  mp.path = path;
  mp.chunk_tokens = 0;
  DeviceArray<uint8_t> ws(fn::moe_prefill_workspace_bytes(mp));
  mp.workspace = ws.ptr;
  // Spot check at the real shape: rows 0, 1 and M - 1 against decode's down fed prefill's h is
  // done through h_out (the whole h, 2 bytes per (pair, i)).
  DeviceArray<uint16_t> h(size_t(M) * k * inter);
  mp.h_out = h.ptr;
  fn::launch_moe_prefill(mp, nullptr);
  DeviceArray<float> yr(static_cast<size_t>(H));
  DeviceArray<uint16_t> hr(size_t(k) * inter);
  int64_t h_far = 0, h_diff = 0;
  for (const int64_t p : {int64_t(0), int64_t(1), M - 1}) {
    fn::MoeGateUpParams g;
    g.experts = mp.gate_up;
    g.expert_ids = d_ids + p * k;
    g.top_k = k;
    g.x = mp.x + p * H;
    g.h = hr.ptr;
    fn::launch_moe_gate_up_nvfp4(g, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto href = hr.download();
    std::vector<uint16_t> hgot(size_t(k) * inter);
    FN_CUDA_CHECK(
        cudaMemcpy(hgot.data(), h.ptr + p * k * inter, hgot.size() * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < hgot.size(); ++i) {
      if (hgot[i] == href[i]) continue;
      ++h_diff;
      const double a = fn::bf16_to_float(hgot[i]), b = fn::bf16_to_float(href[i]);
      const double big = std::max(std::fabs(a), std::fabs(b));
      if (!(std::fabs(a - b) <= std::ldexp(1.0, std::ilogb(big) - 7))) ++h_far;
    }
    fn::MoeDownParams d;
    d.experts = mp.down;
    d.expert_ids = d_ids + p * k;
    d.routing_weights = d_w + p * k;
    d.top_k = k;
    d.h = h.ptr + p * k * inter;
    d.y = yr.ptr;
    fn::launch_moe_down_nvfp4(d, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto ref = yr.download();
    std::vector<float> got(static_cast<size_t>(H));
    FN_CUDA_CHECK(cudaMemcpy(got.data(), y_ptr + p * H, H * 4, cudaMemcpyDeviceToHost));
    double mx = 0, err = 0;
    for (int64_t d2 = 0; d2 < H; ++d2) {
      mx = std::max(mx, std::fabs(double(ref[d2])));
      err = std::max(err, std::fabs(double(got[d2]) - ref[d2]));
    }
    CHECK(mx > 0);
    CHECK(err <= 1e-5 * mx);
  }
  // Summation order alone (K = 2560 products, exact each) moves h across a BF16 rounding
  // boundary rarely and by one step; more than one step would need heavy cancellation.
  MESSAGE("spot check h: " << h_diff << " of " << 3 * k * inter << " differ, " << h_far
                           << " by more than one BF16 step");
  CHECK(h_diff <= 3 * k * inter / 100);
}

TEST_CASE("moe prefill: real-shape timings (FN_BENCH=1)") {
  const char* env = std::getenv("FN_BENCH");
  if (env == nullptr || std::string(env) != "1") return;
  {  // router rows at M = 8192, E = 512, top_k 10
    const int64_t M = 8192;
    DeviceArray<float> logits(size_t(M) * 512);
    fill(logits.ptr, int64_t(logits.n), fn::DType::F32, fn::RandomFill::Uniform, -4.0f, 4.0f, 9);
    DeviceArray<int32_t> ids(size_t(M) * 10);
    DeviceArray<float> w(size_t(M) * 10);
    fn::RouterRowsParams rp;
    rp.logits = logits.ptr;
    rp.logits_stride = 512;
    rp.rows = M;
    rp.num_experts = 512;
    rp.top_k = 10;
    rp.ids = ids.ptr;
    rp.weights = w.ptr;
    fn::launch_router_topk_rows(rp, nullptr);
    cudaEvent_t a, b;
    FN_CUDA_CHECK(cudaEventCreate(&a));
    FN_CUDA_CHECK(cudaEventCreate(&b));
    FN_CUDA_CHECK(cudaEventRecord(a, nullptr));
    for (int r = 0; r < 10; ++r) fn::launch_router_topk_rows(rp, nullptr);
    FN_CUDA_CHECK(cudaEventRecord(b, nullptr));
    FN_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    FN_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    MESSAGE("router rows E 512 top_k 10 M 8192: " << ms / 10 << " ms");
    FN_CUDA_CHECK(cudaEventDestroy(a));
    FN_CUDA_CHECK(cudaEventDestroy(b));
  }
  bench(640, 8192, {8192, 4096});
  bench(320, 8192, {8192, 4096});
  bench(640, 512, {0});
  bench(320, 512, {0});
}

}  // namespace
