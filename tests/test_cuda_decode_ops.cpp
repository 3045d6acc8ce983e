// GPU tests of the small decode-step kernels (cuda/kernels/decode_ops.h) against the CPU oracle
// (core/cpu_ops.h: hc_inject, route_top_k, silu, sigmoid; core/codecs.h for BF16) and FP64
// evaluations of docs/model.md §C.1, §C.3, §C.7, §C.8, on the real shapes (D 2560, E 512, k 10,
// shared I 640 / 320 at TP=2, V 248320 split over TP=2) and the tiny fixtures' (D 64, E 8, k 3, I
// 32 / 16 / 64, V 512 / 384); also the SwiGLU and combine row kernels (cuda/kernels/prefill_ops.h),
// whose expressions the fused shared-expert launch of the decode step shares. Error bounds come
// from the kernels' rounding steps.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "core/cpu_ops.h"
#include "core/error.h"
#include "cuda/common/pdl.h"
#include "cuda/kernels/decode_ops.h"
#include "cuda/kernels/prefill_ops.h"
#include "tests/cuda_test_util.h"
#include "tests/router_topk_reference.h"

namespace {

using fn::test::DeviceArray;
using fn::test::kBf16Unit;
using fn::test::kFp32Unit;
using fn::test::normal_floats;
using fn::test::random_bf16_bits;

template <typename T>
T download1(const DeviceArray<T>& a) {
  return a.download().at(0);
}

// Exact FP64 logistic function (the reference of sigmoid and silu).
double sigmoid_exact(double x) {
  return x >= 0 ? 1.0 / (1.0 + std::exp(-x)) : std::exp(x) / (1.0 + std::exp(x));
}

}  // namespace

// ---- embedding ---------------------------------------------------------------------------------

TEST_CASE("cuda decode ops: embedding copies the widened BF16 row to every HC stream") {
  struct Case {
    int64_t vocab, hidden;
    int hc;
    std::vector<int32_t> tokens;
  };
  // Real shape: the full 248320 x 2560 table (1.27 GB) on the device, rows uploaded where read,
  // so the int64 offsets of the last rows are exercised. Tiny: the fixtures' vocab 512, D 64.
  for (const Case& c : {Case{248320, 2560, 4, {0, 248319, 131072, 9707}},
                        Case{512, 64, 4, {0, 511, 7}}, Case{384, 64, 1, {383}}}) {
    const int64_t D = c.hidden;
    DeviceArray<uint16_t> table(static_cast<size_t>(c.vocab * D));
    DeviceArray<float> H(static_cast<size_t>(c.hc * D));
    DeviceArray<int32_t> token(1), flag(std::vector<int32_t>{0});
    for (int32_t t : c.tokens) {
      const auto row = random_bf16_bits(static_cast<size_t>(D), 1.5f, uint64_t(t) * 31 + 5);
      FN_CUDA_CHECK(
          cudaMemcpy(table.ptr + int64_t(t) * D, row.data(), D * 2, cudaMemcpyHostToDevice));
      token.upload({t});
      FN_CUDA_CHECK(cudaMemset(H.ptr, 0xff, H.n * sizeof(float)));  // NaN garbage before
      fn::EmbedParams p;
      p.table = table.ptr;
      p.vocab = c.vocab;
      p.hidden = D;
      p.token = token.ptr;
      p.H = H.ptr;
      p.hc_count = c.hc;
      p.error_flag = flag.ptr;
      fn::launch_embed(p, nullptr);
      FN_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = H.download();
      int64_t wrong = 0;
      for (int s = 0; s < c.hc; ++s)
        for (int64_t i = 0; i < D; ++i) {
          // docs/model.md §C.1: exact widening (the CPU model's read_row of the FP32 table).
          const float want = fn::bf16_to_float(row[static_cast<size_t>(i)]);
          if (std::memcmp(&got[static_cast<size_t>(s * D + i)], &want, 4) != 0) ++wrong;
        }
      CHECK_MESSAGE(wrong == 0, "vocab ", c.vocab, " token ", t, ": ", wrong, " wrong");
      CHECK(download1(flag) == 0);
    }
  }
}

TEST_CASE("cuda decode ops: an embedding token outside the vocabulary sets the flag and H = 0") {
  const int64_t V = 512, D = 64;
  DeviceArray<uint16_t> table(random_bf16_bits(V * D, 1.0f, 3));
  DeviceArray<float> H(4 * D);
  for (int32_t bad : {-1, 512, INT32_MAX, INT32_MIN}) {
    DeviceArray<int32_t> token(std::vector<int32_t>{bad}), flag(std::vector<int32_t>{0});
    FN_CUDA_CHECK(cudaMemset(H.ptr, 0xff, H.n * sizeof(float)));
    fn::EmbedParams p;
    p.table = table.ptr;
    p.vocab = V;
    p.hidden = D;
    p.token = token.ptr;
    p.H = H.ptr;
    p.hc_count = 4;
    p.error_flag = flag.ptr;
    fn::launch_embed(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_MESSAGE(download1(flag) == 1, "token ", bad);
    const auto got = H.download();
    CHECK_MESSAGE(std::all_of(got.begin(), got.end(), [](float v) { return v == 0.0f; }), "token ",
                  bad);
  }
}

// ---- HC inject
// -----------------------------------------------------------------------------------

TEST_CASE("cuda decode ops: HC inject equals the CPU op's mul-then-add rounding bitwise") {
  for (int64_t D : {int64_t{2560}, int64_t{64}, int64_t{37}}) {
    const int hc = 4;
    auto H = normal_floats(static_cast<size_t>(hc * D), 2.0f, uint64_t(D));
    const auto y = normal_floats(static_cast<size_t>(D), 0.5f, uint64_t(D) + 1);
    const std::vector<float> iota{0.3f, 1.7f, 1.0f, 0.01f};  // 2 * sigmoid(.) lies in (0, 2)
    DeviceArray<float> dH(H), dy(y), diota(iota);
    fn::HcInjectParams p;
    p.H = dH.ptr;
    p.iota = diota.ptr;
    p.y = dy.ptr;
    p.hc_count = hc;
    p.hidden = D;
    fn::launch_hc_inject(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = dH.download();
    // Reference: fl(H + fl(iota * y)) computed exactly: the FP64 product of two floats is exact and
    // FP64 -> FP32 rounding of a sum or product of floats is innocuous (53 >= 2*24 + 2), so this
    // is the correctly rounded mul-then-add whatever the host compiler contracts.
    std::vector<float> cpu = H;
    fn::cpu::hc_inject(cpu.data(), hc, D, iota.data(), y.data());
    int64_t wrong = 0, cpu_far = 0;
    for (int s = 0; s < hc; ++s)
      for (int64_t i = 0; i < D; ++i) {
        const size_t k = static_cast<size_t>(s * D + i);
        const float prod = static_cast<float>(double(iota[s]) * double(y[i]));
        const float want = static_cast<float>(double(H[k]) + double(prod));
        if (std::memcmp(&got[k], &want, 4) != 0) ++wrong;
        // The CPU oracle may fuse the two roundings into one (FMA): within one rounding of each.
        const double b = kFp32Unit * (std::fabs(double(prod)) + std::fabs(double(want)));
        if (std::fabs(double(cpu[k]) - double(want)) > b) ++cpu_far;
      }
    CHECK_MESSAGE(wrong == 0, "D ", D);
    CHECK_MESSAGE(cpu_far == 0, "D ", D);
  }
}

// ---- SwiGLU
// --------------------------------------------------------------------------------------

TEST_CASE("cuda prefill ops: SwiGLU rows give bf16(silu(g) * u) within the FP32 + BF16 bound") {
  // Shared expert I = 640 (real) and 320 (TP=2); 512 / 256 as powers of two; tiny fixtures 32,
  // 16 (TP=2), 64 (tp4 fixture); 1.
  for (int64_t I : {640, 320, 512, 256, 32, 16, 64, 1}) {
    auto gu = normal_floats(static_cast<size_t>(2 * I), 3.0f, uint64_t(I) * 7);
    if (I >= 4) {  // extremes: saturated sigmoid both ways (results stay FP32-normal), zero
      gu[0] = 100.0f;
      gu[1] = -80.0f;
      gu[2] = -30.0f;
      gu[3] = 0.0f;
    }
    DeviceArray<float> dgu(gu);
    DeviceArray<uint16_t> dh(static_cast<size_t>(I));
    fn::launch_swiglu_rows(dgu.ptr, I, 1, dh.ptr, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto hb = dh.download();
    std::vector<float> got(static_cast<size_t>(I));
    std::vector<double> want(static_cast<size_t>(I)), bound(static_cast<size_t>(I));
    for (int64_t i = 0; i < I; ++i) {
      got[i] = fn::bf16_to_float(hb[i]);
      const double g = gu[i], u = gu[I + i];
      want[i] = g * sigmoid_exact(g) * u;
      // Before the BF16 store: expf (2 ulp), 1 + e, the division, the product with u: <= 5u
      // relative. Then one BF16 rounding of that value. The CPU op (fn::cpu::silu) agrees within
      // the same bound (checked below).
      const double pre = 5 * kFp32Unit * std::fabs(want[i]);
      bound[i] = pre + kBf16Unit * (std::fabs(want[i]) + pre);
    }
    const auto cmp = fn::test::compare_bounded(got, want, bound);
    CHECK_MESSAGE(cmp.wrong == 0, "I ", I, ": ", cmp.describe());
    std::vector<float> cpu(static_cast<size_t>(I));
    for (int64_t i = 0; i < I; ++i)
      cpu[i] = fn::cpu::round_to_bf16(fn::cpu::silu(gu[i]) * gu[I + i]);
    const auto cmp_cpu = fn::test::compare_bounded(cpu, want, bound);
    CHECK_MESSAGE(cmp_cpu.wrong == 0, "CPU silu, I ", I, ": ", cmp_cpu.describe());
  }
}

// ---- router
// --------------------------------------------------------------------------------------

namespace {

struct RouterOut {
  std::vector<int32_t> ids;
  std::vector<float> weights;
  int32_t flag;
};

RouterOut run_router(const std::vector<float>& logits, int k, bool norm) {
  const int E = static_cast<int>(logits.size());
  DeviceArray<float> dl(logits), dw(static_cast<size_t>(k));
  DeviceArray<int32_t> di(static_cast<size_t>(k)), flag(std::vector<int32_t>{0});
  fn::RouterParams p;
  p.logits = dl.ptr;
  p.num_experts = E;
  p.top_k = k;
  p.norm_topk_prob = norm;
  p.ids = di.ptr;
  p.weights = dw.ptr;
  p.error_flag = flag.ptr;
  fn::launch_router_topk(p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  return {di.download(), dw.download(), download1(flag)};
}

// FP64 reference weights and their bounds for the selected ids (docs/model.md §C.7 step 1).
// Relative error of the kernel's p_e: the FP32 subtraction l - max errs <= u |d| (amplified by exp
// into a relative error of the same size), expf <= 2 ulp, the FP32 store of the term 1u; the FP64
// sum averages the term errors (weighted by the terms); the division and the FP32 store 1u each.
void check_router_weights(const std::vector<float>& l, const RouterOut& got, int k, bool norm,
                          const char* what) {
  const size_t E = l.size();
  const double mx = *std::max_element(l.begin(), l.end());
  std::vector<double> term(E), rel(E);
  double sum = 0, sum_err = 0;
  for (size_t e = 0; e < E; ++e) {
    const double d = double(l[e]) - mx;
    term[e] = std::exp(d);
    rel[e] = (std::fabs(d) + 3) * kFp32Unit;
    sum += term[e];
    sum_err += term[e] * rel[e];
  }
  const double rel_sum = sum_err / sum + 1e-15;
  double sel = 0, sel_err = 0;
  std::vector<double> relp(static_cast<size_t>(k));
  for (int r = 0; r < k; ++r) {
    const size_t e = static_cast<size_t>(got.ids[r]);
    relp[r] = rel[e] + rel_sum + 2 * kFp32Unit;
    sel += term[e] / sum;
    sel_err += term[e] / sum * relp[r];
  }
  std::vector<float> w(got.weights);
  std::vector<double> want(static_cast<size_t>(k)), bound(static_cast<size_t>(k));
  for (int r = 0; r < k; ++r) {
    const double p = term[static_cast<size_t>(got.ids[r])] / sum;
    want[r] = norm ? p / sel : p;
    const double rw = norm ? relp[r] + sel_err / sel + 2 * kFp32Unit : relp[r];
    bound[r] = rw * want[r];
  }
  const auto cmp = fn::test::compare_bounded(w, want, bound);
  CHECK_MESSAGE(cmp.wrong == 0, what, ": ", cmp.describe());
}

}  // namespace

TEST_CASE(
    "cuda decode ops: router top-k equals fn::cpu::route_top_k (ids exact, weights bounded)") {
  struct Case {
    int E, k;
    float sigma;
  };
  for (Case c : {Case{512, 10, 2.0f}, Case{512, 10, 0.3f}, Case{8, 3, 1.0f}, Case{300, 7, 4.0f},
                 Case{1024, 64, 1.0f}, Case{1, 1, 1.0f}}) {
    for (bool norm : {true, false}) {
      const auto l = normal_floats(static_cast<size_t>(c.E), c.sigma, uint64_t(c.E * 100 + c.k));
      std::vector<int32_t> ids(static_cast<size_t>(c.k));
      std::vector<float> w(static_cast<size_t>(c.k));
      fn::cpu::route_top_k(l.data(), c.E, c.k, norm, ids.data(), w.data());
      // The ids are a discrete choice: equal as long as the k-th and (k+1)-th logits are further
      // apart than the rounding of p (precondition on the random data, so the check can fail).
      std::vector<float> sorted(l);
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      if (c.k < c.E) REQUIRE(double(sorted[c.k - 1]) - sorted[c.k] > 1e-5);
      const RouterOut got = run_router(l, c.k, norm);
      CHECK_MESSAGE(got.ids == ids, "E ", c.E, " k ", c.k);
      CHECK(got.flag == 0);
      check_router_weights(l, got, c.k, norm, "random");
    }
  }
}

TEST_CASE("cuda decode ops: router ties go to the lower expert id, best first, as on the CPU") {
  const int E = 512, k = 10;
  auto l = normal_floats(E, 1.0f, 77);
  for (auto& v : l) v = std::min(v, 3.0f);
  // Three experts tie for the top, and the boundary between the 10th and 11th is a 5-way tie.
  for (int e : {400, 17, 260}) l[e] = 6.0f;
  for (int e : {511, 3, 100, 255, 256}) l[e] = 4.5f;
  for (int e : {9, 90, 480}) l[e] = 5.0f;
  // Ranks: 17, 260, 400 (6.0); 9, 90, 480 (5.0); 3, 100, 255, 256 of the five 4.5's.
  const std::vector<int32_t> expect{17, 260, 400, 9, 90, 480, 3, 100, 255, 256};
  for (bool norm : {true, false}) {
    std::vector<int32_t> ids(k);
    std::vector<float> w(k);
    fn::cpu::route_top_k(l.data(), E, k, norm, ids.data(), w.data());
    REQUIRE(ids == expect);
    const RouterOut got = run_router(l, k, norm);
    CHECK(got.ids == expect);
    // Tied logits give bitwise equal weights.
    CHECK(got.weights[0] == got.weights[1]);
    CHECK(got.weights[1] == got.weights[2]);
    CHECK(got.weights[6] == got.weights[9]);
    check_router_weights(l, got, k, norm, "ties");
  }
  // All equal (tiny fixture shape): ids 0..k-1, weights 1/k.
  const std::vector<float> flat(8, 0.25f);
  const RouterOut got = run_router(flat, 3, true);
  CHECK(got.ids == std::vector<int32_t>{0, 1, 2});
  for (float v : got.weights) CHECK(std::fabs(double(v) - 1.0 / 3) <= 4 * kFp32Unit / 3);
}

TEST_CASE(
    "cuda decode ops: router ids follow (logit desc, id asc) on heavily tied logits of every "
    "shape") {
  // Logits from a few levels half a unit apart: equal logits give bitwise equal p, distinct ones
  // distinct p in the same order, so the expected ids are the host's stable sort by logit
  // (independent of the kernel's per-warp sort and merge). Shapes: the fixtures' E 8 / 16,
  // E not a multiple of 32 or 64, the real E 512 k 10, the limits E 1024 k 64 and k = E.
  struct Case {
    int E, k, levels;
  };
  const Case cases[] = {{8, 2, 3},     {8, 3, 2},     {8, 4, 4},      {8, 8, 3},    {16, 2, 5},
                        {16, 3, 2},    {16, 4, 16},   {1, 1, 1},      {13, 4, 3},   {33, 5, 4},
                        {63, 10, 3},   {64, 64, 5},   {65, 10, 2},    {100, 7, 6},  {300, 10, 8},
                        {511, 10, 12}, {512, 10, 4},  {512, 10, 200}, {512, 64, 9}, {777, 33, 5},
                        {1000, 64, 3}, {1024, 10, 7}, {1024, 64, 30}, {1024, 1, 2}, {129, 64, 2}};
  int n_cases = 0;
  for (const Case& c : cases) {
    for (uint64_t seed : {1u, 2u, 3u}) {
      std::mt19937_64 rng(seed * 7919 + uint64_t(c.E) * 131 + uint64_t(c.k));
      std::uniform_int_distribution<int> level(0, c.levels - 1);
      std::vector<float> l(static_cast<size_t>(c.E));
      for (auto& v : l) v = 0.5f * static_cast<float>(level(rng)) - 1.0f;
      if (seed == 3 && c.E >= 64) {
        // All the top levels in one 64-wide list of the kernel (experts 64 j .. 64 j + 63).
        const int j = (c.E / 64) - 1;
        for (int e = 64 * j; e < 64 * j + 64 && e < c.E; ++e) l[e] += 20.0f;
      }
      std::vector<int32_t> order(static_cast<size_t>(c.E));
      for (int e = 0; e < c.E; ++e) order[e] = e;
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return l[a] > l[b]; });
      const std::vector<int32_t> expect(order.begin(), order.begin() + c.k);
      for (bool norm : {true, false}) {
        std::vector<int32_t> ids(static_cast<size_t>(c.k));
        std::vector<float> w(static_cast<size_t>(c.k));
        fn::cpu::route_top_k(l.data(), c.E, c.k, norm, ids.data(), w.data());
        REQUIRE(ids == expect);  // the oracle agrees with the host sort
        const RouterOut got = run_router(l, c.k, norm);
        CHECK_MESSAGE(got.ids == expect, "E ", c.E, " k ", c.k, " levels ", c.levels, " seed ",
                      seed);
        CHECK(got.flag == 0);
        for (int r = 1; r < c.k; ++r) {
          // Equal logits, bitwise equal weights; lower logits, weights not larger.
          if (l[expect[r]] == l[expect[r - 1]]) CHECK(got.weights[r] == got.weights[r - 1]);
          CHECK(got.weights[r] <= got.weights[r - 1]);
        }
        check_router_weights(l, got, c.k, norm, "levels");
        ++n_cases;
      }
    }
  }
  CHECK(n_cases == 2 * 3 * static_cast<int>(std::size(cases)));
}

TEST_CASE("cuda decode ops: router -Inf logits are valid zero probabilities, ranked by id") {
  // E 16, k 4: two finite experts, then the lowest ids among the 14 with p = 0 (flag stays 0).
  std::vector<float> l(16, -INFINITY);
  l[11] = 1.0f;
  l[5] = 2.0f;
  const RouterOut got = run_router(l, 4, true);
  CHECK(got.ids == std::vector<int32_t>{5, 11, 0, 1});
  CHECK(got.flag == 0);
  CHECK(got.weights[2] == 0.0f);
  CHECK(got.weights[3] == 0.0f);
  const double e1 = std::exp(-1.0);
  CHECK(std::fabs(double(got.weights[0]) - 1.0 / (1.0 + e1)) <= 8 * kFp32Unit);
  CHECK(std::fabs(double(got.weights[1]) - e1 / (1.0 + e1)) <= 8 * kFp32Unit);
}

TEST_CASE("cuda decode ops: router NaN or +Inf logits set the flag and keep ids distinct") {
  for (float bad : {NAN, INFINITY}) {
    auto l = normal_floats(512, 1.0f, 5);
    l[200] = bad;
    const RouterOut got = run_router(l, 10, true);
    CHECK(got.flag == 4);
    // NaN logit: the FP64 sum is NaN, so every p is NaN; +Inf: the max is +Inf, the other terms
    // are 0 and the sum NaN again. Every p ranks as -Inf: the ties go to ids 0..9 in order.
    CHECK(got.ids == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
    std::vector<int32_t> ids = got.ids;
    std::sort(ids.begin(), ids.end());
    CHECK(std::adjacent_find(ids.begin(), ids.end()) == ids.end());
    CHECK(ids.front() >= 0);
    CHECK(ids.back() < 512);
  }
}

// ---- MoE combine
// ---------------------------------------------------------------------------------

TEST_CASE("cuda prefill ops: MoE combine rows add sigmoid(gate) * shared within the FP32 bound") {
  for (int64_t D : {int64_t{2560}, int64_t{64}}) {
    for (float gate : {0.3f, -5.0f, 20.0f, -80.0f}) {
      const auto y = normal_floats(static_cast<size_t>(D), 1.0f, uint64_t(D) + 3);
      const auto ys = normal_floats(static_cast<size_t>(D), 2.0f, uint64_t(D) + 4);
      DeviceArray<float> dy(y), dys(ys), dg(std::vector<float>{gate});
      fn::launch_moe_combine_rows(dy.ptr, dys.ptr, dg.ptr, 1, D, 1, nullptr);
      FN_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = dy.download();
      const double g = sigmoid_exact(gate);
      std::vector<double> want(static_cast<size_t>(D)), bound(static_cast<size_t>(D));
      for (int64_t i = 0; i < D; ++i) {
        want[i] = double(y[i]) + g * ys[i];
        // sigmoid in FP32: expf 2 ulp, the add, the division: <= 4u relative; one FMA rounding.
        bound[i] = 4 * kFp32Unit * std::fabs(g * ys[i]) + kFp32Unit * std::fabs(want[i]);
      }
      const auto cmp = fn::test::compare_bounded(got, want, bound);
      CHECK_MESSAGE(cmp.wrong == 0, "D ", D, " gate ", gate, ": ", cmp.describe());
      // The CPU oracle's gamma (fn::cpu::sigmoid) lies within the same 4u of the exact value.
      CHECK(std::fabs(double(fn::cpu::sigmoid(gate)) - g) <= 4 * kFp32Unit * g);
    }
  }
}

// ---- logits scatter
// ------------------------------------------------------------------------------

TEST_CASE("cuda decode ops: scattered rank logits summed over the ranks are the all-gather") {
  struct Case {
    int64_t V;
    int tp;
  };
  // Real vocabulary at TP=2 (124160 rows each), TP=1; the fixtures' 512 at TP=2, 384 at TP=4.
  for (Case c : {Case{248320, 2}, Case{248320, 1}, Case{512, 2}, Case{384, 4}}) {
    const auto logits = normal_floats(static_cast<size_t>(c.V), 3.0f, uint64_t(c.V) + c.tp);
    const int64_t Vl = c.V / c.tp;
    REQUIRE(Vl * c.tp == c.V);
    std::vector<double> sum(static_cast<size_t>(c.V), 0.0);
    for (int r = 0; r < c.tp; ++r) {
      std::vector<float> local(logits.begin() + r * Vl, logits.begin() + (r + 1) * Vl);
      DeviceArray<float> dl(local), full(static_cast<size_t>(c.V));
      FN_CUDA_CHECK(cudaMemset(full.ptr, 0xff, full.n * sizeof(float)));
      fn::ScatterLogitsParams p;
      p.local = dl.ptr;
      p.full = full.ptr;
      p.v_local = Vl;
      p.v_first = r * Vl;
      p.vocab = c.V;
      fn::launch_scatter_logits(p, nullptr);
      FN_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = full.download();
      int64_t wrong = 0;
      for (int64_t i = 0; i < c.V; ++i) {
        const bool mine = i >= r * Vl && i < (r + 1) * Vl;
        const float want = mine ? logits[i] : 0.0f;
        if (std::memcmp(&got[i], &want, 4) != 0) ++wrong;
        sum[i] += got[i];
      }
      CHECK_MESSAGE(wrong == 0, "V ", c.V, " rank ", r, "/", c.tp);
    }
    int64_t wrong = 0;
    for (int64_t i = 0; i < c.V; ++i) wrong += sum[i] == double(logits[i]) ? 0 : 1;
    CHECK_MESSAGE(wrong == 0, "V ", c.V, " tp ", c.tp);
  }
}

// ---- launcher checks
// -----------------------------------------------------------------------------

TEST_CASE("cuda decode ops: launchers reject null pointers and sizes out of range") {
  DeviceArray<float> f(64);
  DeviceArray<int32_t> i(64);
  DeviceArray<uint16_t> b(64);
  fn::EmbedParams e{b.ptr, 8, 8, i.ptr, f.ptr, 4, nullptr};
  CHECK_THROWS_AS(fn::launch_embed(e, nullptr), fn::Error);
  fn::HcInjectParams h{f.ptr, nullptr, f.ptr, 4, 8};
  CHECK_THROWS_AS(fn::launch_hc_inject(h, nullptr), fn::Error);
  CHECK_THROWS_AS(fn::launch_swiglu_rows(f.ptr, 0, 1, b.ptr, nullptr), fn::Error);
  fn::RouterParams r{f.ptr, 8, 9, true, i.ptr, f.ptr, nullptr};
  CHECK_THROWS_AS(fn::launch_router_topk(r, nullptr), fn::Error);
  r.top_k = 3;
  r.num_experts = 2048;
  CHECK_THROWS_AS(fn::launch_router_topk(r, nullptr), fn::Error);
  CHECK_THROWS_AS(fn::launch_moe_combine_rows(f.ptr, f.ptr, nullptr, 1, 8, 1, nullptr), fn::Error);
  fn::ScatterLogitsParams sc{f.ptr, f.ptr + 32, 16, 20, 32};
  CHECK_THROWS_AS(fn::launch_scatter_logits(sc, nullptr), fn::Error);
}

// ---- CUDA graph capture + timing
// -----------------------------------------------------------------

namespace {

// Captures `reps` launches of `launch` into one graph, replays it once to warm up and once timed;
// returns µs per launch (printed by the caller: a measurement, not a check).
template <typename F>
double graph_us_per_launch(F&& launch, int reps) {
  cudaStream_t stream;
  FN_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < reps; ++i) launch(stream);
  FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  FN_CUDA_CHECK(cudaEventCreate(&a));
  FN_CUDA_CHECK(cudaEventCreate(&b));
  FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  FN_CUDA_CHECK(cudaEventRecord(a, stream));
  FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  FN_CUDA_CHECK(cudaEventRecord(b, stream));
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));
  float ms = 0;
  FN_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  FN_CUDA_CHECK(cudaEventDestroy(a));
  FN_CUDA_CHECK(cudaEventDestroy(b));
  FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FN_CUDA_CHECK(cudaGraphDestroy(graph));
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
  return 1000.0 * ms / reps;
}

}  // namespace

TEST_CASE("cuda decode ops: every op captures into a CUDA graph and replays the eager result") {
  const int64_t D = 2560, V = 248320, E = 512;
  const int k = 10, reps = 100;
  DeviceArray<uint16_t> table(random_bf16_bits(4096 * D, 1.0f, 1));
  DeviceArray<int32_t> token(std::vector<int32_t>{4095}), flag(std::vector<int32_t>{0});
  DeviceArray<float> H(4 * D), y(normal_floats(D, 1.0f, 2)), iota(std::vector<float>(4, 0.5f));
  DeviceArray<float> rl(normal_floats(E, 2.0f, 4));
  DeviceArray<float> local(normal_floats(V / 2, 1.0f, 6)), full(V), w(k);
  DeviceArray<int32_t> ids(k);
  const fn::EmbedParams ep{table.ptr, 4096, D, token.ptr, H.ptr, 4, flag.ptr};
  const fn::HcInjectParams hp{H.ptr, iota.ptr, y.ptr, 4, D};
  const fn::RouterParams rp{rl.ptr, static_cast<int>(E), k, true, ids.ptr, w.ptr, flag.ptr};
  const fn::ScatterLogitsParams scp{local.ptr, full.ptr, V / 2, V / 2, V};

  // Idempotent ops: the graph's output equals the eager launch's bitwise.
  auto eager_then_graph = [&](auto launch, auto read, const char* name) {
    launch(nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto want = read();
    const double us = graph_us_per_launch(launch, reps);
    CHECK_MESSAGE(read() == want, name);
    MESSAGE(std::string(name), ": ", us, " us per launch in a graph");
  };
  eager_then_graph([&](cudaStream_t s) { fn::launch_embed(ep, s); }, [&] { return H.download(); },
                   "embed D 2560 x 4");
  eager_then_graph([&](cudaStream_t s) { fn::launch_router_topk(rp, s); },
                   [&] { return ids.download(); }, "router E 512 k 10");
  const bool pdl = fn::pdl_enabled();
  fn::set_pdl_enabled(false);
  eager_then_graph([&](cudaStream_t s) { fn::launch_router_topk(rp, s); },
                   [&] { return ids.download(); }, "router E 512 k 10, PDL off");
  fn::set_pdl_enabled(pdl);
  eager_then_graph([&](cudaStream_t s) { fn::launch_scatter_logits(scp, s); },
                   [&] { return full.download(); }, "scatter V 248320 TP 2");
  // In-place accumulating ops: captured and replayed (reps x 2 launches), timed.
  MESSAGE("hc_inject D 2560 x 4: ",
          graph_us_per_launch([&](cudaStream_t s) { fn::launch_hc_inject(hp, s); }, reps),
          " us per launch in a graph");
  CHECK(flag.download()[0] == 0);
}

// ---- router top-k block against the earlier version (bitwise)
// ----------------------------------------------------------

namespace {

constexpr int kRowKinds = 25;

// Logits of one row of kind `kind` (random or adversarial, see the cases), E experts.
std::vector<float> router_row(int kind, int E, int k, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, E - 1);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> l(static_cast<size_t>(E));
  auto fill_normal = [&](float sigma) {
    for (auto& v : l) v = sigma * normal(rng);
  };
  switch (kind) {
    case 0:  // the real case: continuous logits
      fill_normal(2.0f);
      break;
    case 1:
      fill_normal(0.3f);
      break;
    case 2:
      fill_normal(8.0f);
      break;
    case 3: {  // all equal: p ties everywhere, ids 0..k-1
      const float c = 4.0f * normal(rng);
      for (auto& v : l) v = c;
      break;
    }
    case 4:  // few levels: ties inside and across the kernel's warps
      for (auto& v : l) v = 0.5f * static_cast<float>(rng() % 4) - 1.0f;
      break;
    case 5: {  // logits a few ulps apart: distinct logits, p often equal after rounding
      const float c = 0.75f + unit(rng);
      for (auto& v : l) {
        v = c;
        for (uint64_t s = rng() % 5; s > 0; --s) v = std::nextafter(v, 10.0f);
      }
      break;
    }
    case 6:  // one NaN: every p NaN, flag 4
      fill_normal(1.0f);
      l[static_cast<size_t>(pick(rng))] = NAN;
      break;
    case 7:
      for (auto& v : l) v = NAN;
      break;
    case 8:  // about half -Inf: p = 0 ties (ranked by id)
      fill_normal(1.0f);
      for (auto& v : l)
        if (rng() % 2 == 0) v = -INFINITY;
      break;
    case 9:  // all -Inf: -Inf - -Inf is NaN
      for (auto& v : l) v = -INFINITY;
      break;
    case 10:  // one +Inf: its term NaN
      fill_normal(1.0f);
      l[static_cast<size_t>(pick(rng))] = INFINITY;
      break;
    case 11:  // huge magnitudes: l - max overflows to -Inf, terms 0
      for (auto& v : l) {
        const float m = unit(rng) < 0.2f ? 3.4e38f : 1e30f * (1.0f + unit(rng));
        v = rng() % 2 == 0 ? m : -m;
      }
      break;
    case 12:  // wide range: terms underflow to subnormals and 0
      for (auto& v : l) v = -200.0f * unit(rng);
      break;
    case 13: {  // fewer than k experts with p > 0: the rest tie at 0
      for (auto& v : l) v = -1000.0f;
      const int big = std::max(1, k / 2);
      for (int i = 0; i < big; ++i) l[static_cast<size_t>(pick(rng))] = 50.0f + normal(rng);
      break;
    }
    case 14: {  // the top logits all in one 32- or 64-wide block of ids
      fill_normal(1.0f);
      const int w = 32 << (rng() % 2);
      const int b = static_cast<int>(rng() % static_cast<uint64_t>((E + w - 1) / w));
      for (int e = b * w; e < b * w + w && e < E; ++e) l[static_cast<size_t>(e)] += 20.0f;
      break;
    }
    case 15:  // signed zeros and negatives: the max is +0 or -0
      for (auto& v : l) {
        const uint64_t s = rng() % 3;
        v = s == 0 ? 0.0f : (s == 1 ? -0.0f : -unit(rng));
      }
      break;
    case 16:  // only signed zeros
      for (auto& v : l) v = rng() % 2 == 0 ? 0.0f : -0.0f;
      break;
    case 17:  // subnormal logits: every term 1
      for (auto& v : l) v = 1e-40f * normal(rng);
      break;
    case 18:  // NaN and -Inf only
      for (auto& v : l) v = rng() % 2 == 0 ? NAN : -INFINITY;
      break;
    case 19:  // ascending by id
      for (int e = 0; e < E; ++e) l[static_cast<size_t>(e)] = 0.01f * static_cast<float>(e);
      break;
    case 20:  // descending by id
      for (int e = 0; e < E; ++e) l[static_cast<size_t>(e)] = -0.01f * static_cast<float>(e);
      break;
    case 21:  // BF16-rounded logits: occasional exact ties at the boundary
      fill_normal(1.5f);
      for (auto& v : l) v = fn::bf16_to_float(fn::float_to_bf16(v));
      break;
    case 22:  // one finite logit, the rest -Inf: sum 1
      for (auto& v : l) v = -INFINITY;
      l[static_cast<size_t>(pick(rng))] = normal(rng);
      break;
    case 23:  // +Inf and NaN mixed into random logits
      fill_normal(1.0f);
      l[static_cast<size_t>(pick(rng))] = INFINITY;
      l[static_cast<size_t>(pick(rng))] = NAN;
      break;
    default:  // a step: k / 2 high values tied, the rest tied lower
      for (auto& v : l) v = -1.0f;
      for (int i = 0; i < std::max(1, k / 2); ++i) l[static_cast<size_t>(pick(rng))] = 1.0f;
      break;
  }
  return l;
}

// Runs the current block and the reference on `rows` rows of E experts (kinds as given, a stride
// past E so rows start unaligned) for norm true and false; returns the rows that differ in any
// bit of ids, weights or flag, and describes the first.
int64_t router_rows_differ(int E, int k, const std::vector<int>& kinds, uint64_t seed,
                           std::string* first) {
  const int rows = static_cast<int>(kinds.size());
  const int64_t stride = E + static_cast<int64_t>(seed % 3);
  std::mt19937_64 rng(seed);
  std::vector<float> host(static_cast<size_t>(rows * stride), 0.0f);
  for (int r = 0; r < rows; ++r) {
    const auto l = router_row(kinds[static_cast<size_t>(r)], E, k, rng);
    std::copy(l.begin(), l.end(), host.begin() + r * stride);
  }
  DeviceArray<float> logits(host);
  int64_t differ = 0;
  for (bool norm : {true, false}) {
    const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(k);
    DeviceArray<int32_t> ids_a(n), ids_b(n), flags_a(std::vector<int32_t>(rows, 0)),
        flags_b(std::vector<int32_t>(rows, 0));
    DeviceArray<float> w_a(n), w_b(n);
    fn::test::router_topk_rows(true, logits.ptr, stride, rows, E, k, norm, ids_a.ptr, w_a.ptr,
                               flags_a.ptr, nullptr);
    fn::test::router_topk_rows(false, logits.ptr, stride, rows, E, k, norm, ids_b.ptr, w_b.ptr,
                               flags_b.ptr, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto ia = ids_a.download(), ib = ids_b.download();
    const auto wa = w_a.download(), wb = w_b.download();
    const auto fa = flags_a.download(), fb = flags_b.download();
    for (int r = 0; r < rows; ++r) {
      const size_t o = static_cast<size_t>(r) * k;
      const bool same = std::memcmp(&ia[o], &ib[o], 4 * static_cast<size_t>(k)) == 0 &&
                        std::memcmp(&wa[o], &wb[o], 4 * static_cast<size_t>(k)) == 0 &&
                        fa[static_cast<size_t>(r)] == fb[static_cast<size_t>(r)];
      if (same) continue;
      if (differ++ == 0) {
        std::ostringstream os;
        os << "E " << E << " k " << k << " norm " << norm << " row " << r << " kind "
           << kinds[static_cast<size_t>(r)] << ": flag " << fa[static_cast<size_t>(r)] << " vs "
           << fb[static_cast<size_t>(r)] << ", ids (reference/current)";
        for (int i = 0; i < k; ++i) os << " " << ia[o + i] << "/" << ib[o + i];
        *first = os.str();
      }
    }
  }
  return differ;
}

}  // namespace

TEST_CASE(
    "cuda decode ops: the router top-k block ranks many candidates block-wide with the reference's "
    "bits") {
  // All equal, few levels, p = 0 ties and one finite logit: more than 64 candidates, so the whole
  // block ranks them (the small case for the race and sync checkers).
  const std::vector<int> kinds{3, 4, 13, 22, 3, 4};
  for (int E : {100, 512, 1024}) {
    for (int k : {1, 10, 64}) {
      std::string first;
      const int64_t differ = router_rows_differ(E, k, kinds, uint64_t(E) + uint64_t(k), &first);
      CHECK_MESSAGE(differ == 0, differ, " rows differ; first: ", first);
    }
  }
}

TEST_CASE(
    "cuda decode ops: the router top-k block gives the bits of the earlier sorted-list version on "
    "random and adversarial rows of every shape") {
  // The real shape (E 512, k 10): 4000 rows of every kind, most of them continuous logits.
  {
    std::vector<int> kinds;
    for (int r = 0; r < 4000; ++r) kinds.push_back(r < 40 * kRowKinds ? r % kRowKinds : r % 3);
    std::string first;
    const int64_t differ = router_rows_differ(512, 10, kinds, 17, &first);
    CHECK_MESSAGE(differ == 0, differ, " rows differ; first: ", first);
  }
  // Every E class (1, below / at / above 32, 64, 512, up to 1024) with k from 1 to 64: two rows
  // of every kind each.
  std::vector<int> kinds;
  for (int r = 0; r < 2 * kRowKinds; ++r) kinds.push_back(r % kRowKinds);
  int shapes = 0;
  for (int E :
       {1,   2,   3,   5,   8,   13,  16,  31,  32,  33,  63,  64,  65,  100,  127,  128, 129,
        200, 255, 256, 257, 300, 384, 500, 511, 512, 513, 600, 640, 777, 1000, 1023, 1024}) {
    for (int k : {1, 2, 3, 4, 7, 8, 10, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64}) {
      if (k > E) continue;
      std::string first;
      const int64_t differ =
          router_rows_differ(E, k, kinds, uint64_t(E) * 1000 + uint64_t(k), &first);
      CHECK_MESSAGE(differ == 0, differ, " rows differ; first: ", first);
      ++shapes;
    }
  }
  CHECK(shapes > 400);
  // Time of one row (E 512, k 10, continuous logits) in a graph of 100 launches, plain launches
  // for both (no PDL): a measurement, printed, not a check.
  const auto l = normal_floats(512, 2.0f, 99);
  DeviceArray<float> dl(l), dw(10);
  DeviceArray<int32_t> di(10), flag(std::vector<int32_t>{0});
  for (bool reference : {true, false}) {
    const double us = graph_us_per_launch(
        [&](cudaStream_t s) {
          fn::test::router_topk_rows(reference, dl.ptr, 512, 1, 512, 10, true, di.ptr, dw.ptr,
                                     flag.ptr, s);
        },
        100);
    MESSAGE(std::string(reference ? "reference" : "current"),
            " router top-k block, E 512 k 10: ", us, " us per launch in a graph");
  }
}
