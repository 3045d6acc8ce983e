// GPU tests of the HC read (cuda/kernels/hc.h): the split-K down pass (partial dots against H * (1
// + w) and partial sums of H^2 per group-aligned chunk), the mix (the group norm scales from the
// partial squares, t, m FP32 and its BF16 copy, iota), and the two chained against an FP64
// evaluation of docs/model.md §C.2 and §C.3, with error bounds derived from the kernels' FP32
// rounding steps (N and m are FP32: no BF16 rounding in the bounds); the compile-time-shape
// instances give the same bits as the runtime-shape ones; the register mix (ranks whose rows do not
// fit the 48 KB stage) against the same reference; launches over several tokens give every token
// the bits of its own one-token launches; launcher checks.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/codecs.h"
#include "core/cpu_ops.h"
#include "core/error.h"
#include "cuda/kernels/decode_ops.h"
#include "cuda/kernels/hc.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;
using fn::test::kFp32Unit;

std::vector<uint16_t> random_bf16_bits(size_t n, float mean, float sigma, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(mean, sigma);
  std::vector<uint16_t> v(n);
  for (auto& b : v) b = fn::float_to_bf16(d(rng));
  return v;
}

std::vector<float> widen(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = fn::bf16_to_float(b[i]);
  return f;
}

constexpr int64_t kChunk = 1280;  // columns per chunk of the down pass (cuda/kernels/hc.h)

// The columns [first, last) of chunk p for groups of `hidden` columns.
void chunk_cols(int64_t p, int64_t hidden, int64_t* first, int64_t* last) {
  const int64_t cpg = (hidden + kChunk - 1) / kChunk, g = p / cpg, c = p % cpg;
  *first = g * hidden + c * kChunk;
  *last = g * hidden + std::min((c + 1) * kChunk, hidden);
}

// Relative error bound of the kernel's FP32 norm scale rsqrtf(sum / D + eps) when its sum of
// positive terms carries `sum_roundings` roundings: the argument errs by gamma(sum_roundings + 2)
// (the division and the add), halved by the square root, then rsqrtf's 2 ulp (4 u).
double scale_rel(int sum_roundings) {
  const double ga = fn::test::gamma_fp32(sum_roundings + 2);
  return 0.5 * ga * (1 + ga) + 4 * kFp32Unit * (1 + ga);
}

// The inputs of the mix in FP64 with their error bounds: u = silu(t / 4) for t[0:r], the
// normed residual N, and t[r:r+4] for iota.
struct MixRef {
  std::vector<double> u, eu, N, eN, t_iota, et_iota;
};

// u and its bound from t and t's error bound: |silu'| < 1.1, so u errs by 1.1 / 4 of t's error
// plus 4 u relative (expf 2 ulp, add, divide).
void set_u(MixRef* ref, int64_t j, double t, double et) {
  const double x = t / 4;
  ref->u[j] = x / (1 + std::exp(-x));
  ref->eu[j] = 1.1 * et / 4 + 4 * kFp32Unit * std::fabs(ref->u[j]);
}

// m of docs/model.md §C.3 steps 3-5 in FP64 and the bound of the kernel's FP32 evaluation: the
// team's FMA chain over W_up . u (the narrowest team's chain, the longest), the sigmoid, and the
// FMA chain over the 4 streams with N's own error.
void want_m(const std::vector<uint16_t>& w_up, int64_t D, int64_t r, const MixRef& ref,
            std::vector<double>* want, std::vector<double>* bound) {
  const int64_t nvec = r / 8;
  int team = 8;
  while (team < 256 && team * 16 < nvec) team *= 2;
  const int h = int((nvec + team - 1) / team) * 8 + 8;
  const double gz = fn::test::gamma_fp32(h), g4 = fn::test::gamma_fp32(4);
  want->assign(D, 0);
  bound->assign(D, 0);
  for (int64_t i = 0; i < D; ++i) {
    double mm = 0, err = 0;
    for (int s = 0; s < 4; ++s) {
      double z = 0, za = 0, ez = 0;
      for (int64_t j = 0; j < r; ++j) {
        const double w = fn::bf16_to_float(w_up[(i + s * D) * r + j]);
        z += w * ref.u[j];
        za += std::fabs(w * ref.u[j]);
        ez += std::fabs(w) * ref.eu[j];
      }
      const double g = 1 / (1 + std::exp(-z));
      const double eg = 0.25 * (gz * za + ez) + 4 * kFp32Unit * g;  // sigmoid' <= 1/4
      const double nv = ref.N[i + s * D], en = ref.eN[i + s * D];
      mm += g * nv;
      // The gate's and N's errors, then the FMA chain over the 4 streams (gamma_4 on the
      // magnitudes of the computed products).
      err += eg * (std::fabs(nv) + en) + g * en + g4 * (g + eg) * (std::fabs(nv) + en);
    }
    (*want)[i] = mm / 4;
    (*bound)[i] = err / 4;  // m is stored in FP32: no further rounding (x 1/4 is exact)
  }
}

// Checks m, its BF16 copy and iota against the FP64 reference.
void check_mix_outputs(const std::vector<float>& m, const std::vector<uint16_t>& mb,
                       const std::vector<float>& iota, const std::vector<uint16_t>& w_up, int64_t D,
                       int64_t r, const MixRef& ref, bool with_bf16, bool with_iota) {
  std::vector<double> want, bound;
  want_m(w_up, D, r, ref, &want, &bound);
  const auto cmp = fn::test::compare_bounded(m, want, bound);
  CHECK_MESSAGE(cmp.wrong == 0, "D ", D, " r ", r, ": ", cmp.describe());
  if (with_bf16) {
    int64_t diff = 0;
    for (int64_t i = 0; i < D; ++i) diff += mb[i] != fn::float_to_bf16(m[i]) ? 1 : 0;
    CHECK_MESSAGE(diff == 0, diff, " BF16 copies are not m rounded to nearest even");
  } else {
    for (uint16_t v : mb) CHECK(v == 0xffff);  // untouched
  }
  if (with_iota) {
    std::vector<double> wi(4), bi(4);
    for (int s = 0; s < 4; ++s) {
      wi[s] = 2 / (1 + std::exp(-ref.t_iota[s] / 4));
      bi[s] = 0.5 * ref.et_iota[s] / 4 + 4 * kFp32Unit * wi[s];  // (2 sigmoid)' <= 1/2
    }
    const auto ci = fn::test::compare_bounded(iota, wi, bi);
    CHECK_MESSAGE(ci.wrong == 0, "iota: ", ci.describe());
  } else {
    for (float v : iota) CHECK(std::isnan(v));  // untouched (0xff fill)
  }
}

}  // namespace

TEST_CASE(
    "cuda hc: the down pass gives per-chunk partial dots of W against H * (1 + w) and partial "
    "sums of H^2") {
  struct Case {
    int groups;
    int64_t hidden, rows;
  };
  // The real read (324 rows, 2 chunks per group of 2560) and the final mixer's (320); the tiny
  // fixtures' width 4 x 8; one short chunk per group (3 x 400, 2 x 1000); a short second chunk
  // (4 x 1400: 1280 + 120 columns).
  for (Case c : {Case{4, 2560, 324}, Case{4, 2560, 320}, Case{4, 8, 20}, Case{3, 400, 37},
                 Case{2, 1000, 70}, Case{4, 1400, 33}}) {
    const int64_t D = c.hidden, W = c.groups * D, R = c.rows;
    std::mt19937_64 rng{uint64_t(W * R)};
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> H(W);
    // Each stream on its own scale (docs/model.md §C.2 normalises per group).
    for (int64_t i = 0; i < W; ++i) H[i] = d(rng) * std::ldexp(1.0f, int(i / D) * 3 - 4);
    const auto nb = random_bf16_bits(W, 0.0f, 0.7f, uint64_t(W) + 1);  // far from 0 and 1
    const auto wb = random_bf16_bits(R * W, 0.0f, 0.02f, uint64_t(W) + 2);
    const int64_t splits = fn::hc_down_splits(c.groups, D);
    CHECK(fn::hc_down_chunks(D) == (D + kChunk - 1) / kChunk);
    CHECK(splits == c.groups * fn::hc_down_chunks(D));

    DeviceArray<float> dH(H), dt(splits * R), dss(splits);
    DeviceArray<uint16_t> dnorm(nb), dw(wb);
    fn::HcDownParams p;
    p.H = dH.ptr;
    p.norm = dnorm.ptr;
    p.weight = dw.ptr;
    p.rows = R;
    p.hc_count = c.groups;
    p.hidden = D;
    p.t_partial = dt.ptr;
    p.sumsq = dss.ptr;
    fn::launch_hc_down(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto tp = dt.download();
    const auto ss = dss.download();

    // Per lane at most 5 vectors = 40 FMAs, then 5 butterfly levels; x = H * (1 + w) adds two
    // roundings to each product of the dot.
    const double g_ss = fn::test::gamma_fp32(40 + 5), g_dot = fn::test::gamma_fp32(40 + 5 + 2);
    std::vector<double> want_ss(splits), bound_ss(splits);
    std::vector<double> want_t(splits * R), bound_t(splits * R);
    for (int64_t q = 0; q < splits; ++q) {
      int64_t c0, c1;
      chunk_cols(q, D, &c0, &c1);
      REQUIRE(c1 > c0);
      double s2 = 0;
      for (int64_t col = c0; col < c1; ++col) s2 += double(H[col]) * H[col];
      want_ss[q] = s2;
      bound_ss[q] = g_ss * s2;  // positive terms
      for (int64_t r = 0; r < R; ++r) {
        double s = 0, sa = 0;
        for (int64_t col = c0; col < c1; ++col) {
          const double x = double(H[col]) * (1 + double(fn::bf16_to_float(nb[col])));
          const double w = fn::bf16_to_float(wb[r * W + col]);
          s += w * x;
          sa += std::fabs(w * x);
        }
        want_t[q * R + r] = s;
        bound_t[q * R + r] = g_dot * sa;
      }
    }
    const auto cs = fn::test::compare_bounded(ss, want_ss, bound_ss);
    CHECK_MESSAGE(cs.wrong == 0, "sumsq ", c.groups, "x", D, ": ", cs.describe());
    const auto ct = fn::test::compare_bounded(tp, want_t, bound_t);
    CHECK_MESSAGE(ct.wrong == 0, "t ", c.groups, "x", D, " rows ", R, ": ", ct.describe());

    // Deterministic: a second launch gives the same bits.
    fn::launch_hc_down(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(std::memcmp(dt.download().data(), tp.data(), splits * R * 4) == 0);
    CHECK(std::memcmp(dss.download().data(), ss.data(), splits * 4) == 0);
    // The runtime-shape instance (fixed_shape = false; at 4 x 2560 the default launch above ran
    // the compile-time-shape one) does the same operations: the same bits.
    FN_CUDA_CHECK(cudaMemset(dt.ptr, 0xff, splits * R * 4));
    FN_CUDA_CHECK(cudaMemset(dss.ptr, 0xff, splits * 4));
    fn::HcDownParams q = p;
    q.fixed_shape = false;
    fn::launch_hc_down(q, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_MESSAGE(std::memcmp(dt.download().data(), tp.data(), splits * R * 4) == 0,
                  "runtime-shape kernel t ", c.groups, "x", D, " rows ", R);
    CHECK_MESSAGE(std::memcmp(dss.download().data(), ss.data(), splits * 4) == 0,
                  "runtime-shape kernel sumsq ", c.groups, "x", D);
  }
}

TEST_CASE(
    "cuda hc: the down pass with the HC inject folded in gives the bits of launch_hc_inject then "
    "launch_hc_down, and writes the injected residual to H_out") {
  struct Case {
    int groups;
    int64_t hidden, rows;
  };
  for (Case c : {Case{4, 2560, 324}, Case{4, 8, 20}, Case{3, 400, 37}, Case{4, 1400, 33}}) {
    const int64_t D = c.hidden, W = c.groups * D, R = c.rows;
    std::mt19937_64 rng{uint64_t(W * R + 7)};
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> H(W), y(D), iota(c.groups);
    for (auto& v : H) v = d(rng);
    for (auto& v : y) v = d(rng) * 0.3f;
    for (auto& v : iota) v = 2.0f / (1.0f + std::exp(-d(rng)));  // 2 sigmoid(.), as the mix
    const auto nb = random_bf16_bits(W, 0.0f, 0.7f, uint64_t(W) + 11);
    const auto wb = random_bf16_bits(R * W, 0.0f, 0.02f, uint64_t(W) + 12);
    const int64_t splits = fn::hc_down_splits(c.groups, D);
    // The injected residual, by hand: the product and the sum each rounded once (docs/model.md
    // §C.3).
    std::vector<float> want_H(W);
    for (int64_t i = 0; i < W; ++i) {
      volatile float prod = iota[i / D] * y[i % D];
      want_H[i] = H[i] + prod;
    }
    DeviceArray<uint16_t> dnorm(nb), dw(wb);
    DeviceArray<float> dy(y), diota(iota);
    // Reference: the inject kernel on a copy of H, then the down pass.
    DeviceArray<float> dHref(H), dtref(splits * R), dssref(splits);
    fn::HcInjectParams hi;
    hi.H = dHref.ptr;
    hi.iota = diota.ptr;
    hi.y = dy.ptr;
    hi.hc_count = c.groups;
    hi.hidden = D;
    fn::launch_hc_inject(hi, nullptr);
    fn::HcDownParams p;
    p.H = dHref.ptr;
    p.norm = dnorm.ptr;
    p.weight = dw.ptr;
    p.rows = R;
    p.hc_count = c.groups;
    p.hidden = D;
    p.t_partial = dtref.ptr;
    p.sumsq = dssref.ptr;
    fn::launch_hc_down(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto Href = dHref.download();
    CHECK_MESSAGE(std::memcmp(Href.data(), want_H.data(), W * 4) == 0, "inject ", c.groups, "x", D);
    const auto tref = dtref.download(), ssref = dssref.download();
    // The compile-time-shape instance (at 4 x 2560), then the runtime-shape one.
    for (int variant = 0; variant < 2; ++variant) {
      DeviceArray<float> dH(H), dHout(W), dt(splits * R), dss(splits);
      FN_CUDA_CHECK(cudaMemset(dHout.ptr, 0xff, W * 4));
      fn::HcDownParams f = p;
      f.H = dH.ptr;
      f.t_partial = dt.ptr;
      f.sumsq = dss.ptr;
      f.inject_iota = diota.ptr;
      f.inject_y = dy.ptr;
      f.H_out = dHout.ptr;
      f.fixed_shape = variant == 0;
      fn::launch_hc_down(f, nullptr);
      FN_CUDA_CHECK(cudaDeviceSynchronize());
      CHECK_MESSAGE(std::memcmp(dHout.download().data(), Href.data(), W * 4) == 0, "H_out ",
                    c.groups, "x", D, " variant ", variant);
      CHECK_MESSAGE(std::memcmp(dH.download().data(), H.data(), W * 4) == 0, "H untouched ",
                    c.groups, "x", D);
      CHECK_MESSAGE(std::memcmp(dt.download().data(), tref.data(), splits * R * 4) == 0, "t ",
                    c.groups, "x", D, " variant ", variant);
      CHECK_MESSAGE(std::memcmp(dss.download().data(), ssref.data(), splits * 4) == 0, "sumsq ",
                    c.groups, "x", D, " variant ", variant);
    }
    // Half-given inject operands and H_out aliasing H are refused.
    fn::HcDownParams bad = p;
    bad.inject_y = dy.ptr;
    CHECK_THROWS_AS(fn::launch_hc_down(bad, nullptr), fn::Error);
    bad.inject_iota = diota.ptr;
    bad.H_out = dHref.ptr;  // == H
    CHECK_THROWS_AS(fn::launch_hc_down(bad, nullptr), fn::Error);
  }
}

TEST_CASE(
    "cuda hc: the mix gives m (FP32 and its BF16 copy) and iota of docs/model.md §C.3 from the "
    "partials") {
  struct Case {
    int64_t hidden, rank, splits;
    bool with_iota, with_bf16;
  };
  // Rank 2048 at D 2560: more vectors per lane than the kernel loads before its PDL wait; rank
  // 600: more t values (604) than two per thread; 8 partials: the real read's 2 chunks per group.
  for (Case c : {Case{2560, 320, 8, true, true}, Case{37, 8, 4, true, false},
                 Case{300, 40, 4, false, true}, Case{2560, 2048, 8, true, false},
                 Case{2560, 320, 8, false, false}, Case{100, 600, 4, true, true}}) {
    const int64_t D = c.hidden, r = c.rank, S = c.splits, cpg = S / 4;
    const int64_t stride = r + 4 + 3;  // a wider stride than needed
    const auto w_up = random_bf16_bits(4 * D * r, 0.0f, 0.05f, uint64_t(D * r));
    const auto nb = random_bf16_bits(4 * D, 0.0f, 0.7f, uint64_t(D * r) + 1);
    std::vector<float> H(4 * D), tp(S * stride), ss(S);
    std::mt19937_64 rng{uint64_t(r * S)};
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto& v : H) v = d(rng);
    const float sp = 3.0f / std::sqrt(float(S));
    for (auto& v : tp) v = sp * d(rng);
    // Partial squares: positive, each group on its own scale.
    for (int64_t q = 0; q < S; ++q)
      ss[q] = float(D) / float(cpg) * std::ldexp(0.5f + std::fabs(d(rng)), int(q / cpg) * 2 - 3);

    DeviceArray<uint16_t> dw(w_up), dnorm(nb), dmb(D);
    DeviceArray<float> dH(H), dt(tp), dss(ss), dm(D), diota(4);
    FN_CUDA_CHECK(cudaMemset(dm.ptr, 0xff, D * 4));
    FN_CUDA_CHECK(cudaMemset(dmb.ptr, 0xff, D * 2));
    FN_CUDA_CHECK(cudaMemset(diota.ptr, 0xff, 16));
    fn::HcMixParams p;
    p.w_up = dw.ptr;
    p.t = dt.ptr;
    p.sumsq = dss.ptr;
    p.t_splits = S;
    p.t_stride = stride;
    p.H = dH.ptr;
    p.norm = dnorm.ptr;
    p.eps = 1e-6f;
    p.m = dm.ptr;
    p.m_bf16 = c.with_bf16 ? dmb.ptr : nullptr;
    p.iota = c.with_iota ? diota.ptr : nullptr;
    p.hidden = D;
    p.rank = r;
    fn::launch_hc_mix(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto m = dm.download();

    // FP64 reference: scale_g from the group's partial squares (cpg - 1 roundings in the kernel's
    // sum); t[j] = sum_p scale_g(p) * partial, whose FP32 fmaf chain errs by gamma_S on the sum of
    // magnitudes plus the scale's relative error.
    const double rel_s = scale_rel(int(cpg) - 1);
    std::vector<double> scale(4);
    for (int g = 0; g < 4; ++g) {
      double s = 0;
      for (int64_t q = g * cpg; q < (g + 1) * cpg; ++q) s += ss[q];
      scale[g] = 1 / std::sqrt(s / double(D) + double(1e-6f));
    }
    const double gs = fn::test::gamma_fp32(int(S));
    auto t_of = [&](int64_t j, double* et) {
      double s = 0, a = 0;
      for (int64_t q = 0; q < S; ++q) {
        s += scale[q / cpg] * tp[q * stride + j];
        a += scale[q / cpg] * std::fabs(tp[q * stride + j]);
      }
      *et = (rel_s + gs * (1 + rel_s)) * a;
      return s;
    };
    MixRef ref;
    ref.u.resize(r);
    ref.eu.resize(r);
    for (int64_t j = 0; j < r; ++j) {
      double et;
      const double t = t_of(j, &et);
      set_u(&ref, j, t, et);
    }
    ref.t_iota.resize(4);
    ref.et_iota.resize(4);
    for (int s = 0; s < 4; ++s) ref.t_iota[s] = t_of(r + s, &ref.et_iota[s]);
    // N = H * scale * (1 + w): three FP32 roundings plus the scale's error.
    ref.N.resize(4 * D);
    ref.eN.resize(4 * D);
    const double g3 = fn::test::gamma_fp32(3);
    for (int64_t i = 0; i < 4 * D; ++i) {
      ref.N[i] = H[i] * scale[i / D] * (1 + double(fn::bf16_to_float(nb[i])));
      ref.eN[i] = (rel_s + g3 * (1 + rel_s)) * std::fabs(ref.N[i]);
    }
    const auto mb = dmb.download();
    const auto iota = diota.download();
    check_mix_outputs(m, mb, iota, w_up, D, r, ref, c.with_bf16, c.with_iota);

    // Rank 2048 (4 x 8 rows x 4 KB) does not fit the 48 KB stage: the register kernel ran above.
    // The staged kernel's runtime-shape instance (fixed_shape = false; at D 2560, r 320 and 8
    // partials on a 132-SM GPU the first launch ran the compile-time-shape one): the same bits.
    CHECK(fn::hc_mix_uses_staging(p) == (r != 2048));
    auto same_bits = [&](const fn::HcMixParams& q, const char* what) {
      FN_CUDA_CHECK(cudaMemset(dm.ptr, 0xff, D * 4));
      FN_CUDA_CHECK(cudaMemset(dmb.ptr, 0xff, D * 2));
      FN_CUDA_CHECK(cudaMemset(diota.ptr, 0xff, 16));
      fn::launch_hc_mix(q, nullptr);
      FN_CUDA_CHECK(cudaDeviceSynchronize());
      CHECK_MESSAGE(std::memcmp(dm.download().data(), m.data(), D * 4) == 0, what, " m, D ", D,
                    " r ", r);
      CHECK(std::memcmp(dmb.download().data(), mb.data(), D * 2) == 0);
      CHECK(std::memcmp(diota.download().data(), iota.data(), 16) == 0);
    };
    fn::HcMixParams runtime = p;
    runtime.fixed_shape = false;
    if (fn::hc_mix_uses_staging(runtime)) same_bits(runtime, "runtime-shape kernel");
  }
}

TEST_CASE(
    "cuda hc: down and mix chained give the read of docs/model.md §C.2-§C.3 (N = "
    "GroupRMSNorm1p(H), "
    "t = W_dn N, m, iota) in FP32") {
  struct Case {
    int64_t hidden, rank;
  };
  // The real read (D 2560, r 320, 8 partials) and a fixture-sized one (one chunk per group).
  for (Case c : {Case{2560, 320}, Case{64, 16}}) {
    const int64_t D = c.hidden, r = c.rank, W = 4 * D, R = r + 4;
    std::mt19937_64 rng{uint64_t(D * r + 7)};
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> H(W);
    for (int64_t i = 0; i < W; ++i) H[i] = d(rng) * std::ldexp(1.0f, int(i / D) * 2 - 3);
    const auto nb = random_bf16_bits(W, 0.0f, 0.7f, uint64_t(D) + 11);
    const auto wdn = random_bf16_bits(R * W, 0.0f, 0.02f, uint64_t(D) + 12);
    const auto w_up = random_bf16_bits(W * r, 0.0f, 0.05f, uint64_t(D) + 13);
    const int64_t S = fn::hc_down_splits(4, D), cpg = S / 4;

    DeviceArray<float> dH(H), dt(S * R), dss(S), dm(D), diota(4);
    DeviceArray<uint16_t> dnorm(nb), dwdn(wdn), dwup(w_up), dmb(D);
    FN_CUDA_CHECK(cudaMemset(dmb.ptr, 0xff, D * 2));
    fn::HcDownParams dp;
    dp.H = dH.ptr;
    dp.norm = dnorm.ptr;
    dp.weight = dwdn.ptr;
    dp.rows = R;
    dp.hc_count = 4;
    dp.hidden = D;
    dp.t_partial = dt.ptr;
    dp.sumsq = dss.ptr;
    fn::HcMixParams mp;
    mp.w_up = dwup.ptr;
    mp.t = dt.ptr;
    mp.sumsq = dss.ptr;
    mp.t_splits = S;
    mp.t_stride = R;
    mp.H = dH.ptr;
    mp.norm = dnorm.ptr;
    mp.eps = 1e-6f;
    mp.m = dm.ptr;
    mp.m_bf16 = dmb.ptr;
    mp.iota = diota.ptr;
    mp.hidden = D;
    mp.rank = r;
    fn::launch_hc_down(dp, nullptr);
    fn::launch_hc_mix(mp, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto m = dm.download();

    // N in FP64 (docs/model.md §C.2). The kernel's scale sums positive squares with 40 FMAs + 5
    // butterfly levels per chunk and cpg - 1 adds over the chunks.
    const double rel_s = scale_rel(45 + int(cpg) - 1);
    MixRef ref;
    ref.N.resize(W);
    ref.eN.resize(W);
    const double g3 = fn::test::gamma_fp32(3);
    for (int g = 0; g < 4; ++g) {
      double s2 = 0;
      for (int64_t i = g * D; i < (g + 1) * D; ++i) s2 += double(H[i]) * H[i];
      const double inv = 1 / std::sqrt(s2 / double(D) + double(1e-6f));
      for (int64_t i = g * D; i < (g + 1) * D; ++i) {
        ref.N[i] = H[i] * inv * (1 + double(fn::bf16_to_float(nb[i])));
        ref.eN[i] = (rel_s + g3 * (1 + rel_s)) * std::fabs(ref.N[i]);
      }
    }
    // The CPU op (core/cpu_ops.h) agrees with the FP64 N within its own roundings.
    const auto wf = widen(nb);
    std::vector<float> cpu_n(W);
    fn::cpu::group_rms_norm_1p(H.data(), wf.data(), W, D, 1e-6f, cpu_n.data());
    std::vector<double> bound_cpu(W);
    for (int64_t i = 0; i < W; ++i) bound_cpu[i] = 6 * kFp32Unit * std::fabs(ref.N[i]);
    CHECK(fn::test::compare_bounded(cpu_n, ref.N, bound_cpu).wrong == 0);
    // t = W_dn N. The kernel's partial P_p errs by gamma(47) on its magnitudes (x = H * (1 + w)
    // and the dot), the fmaf chain over the S scaled partials by gamma_S, and the scale by rel_s:
    // |t^ - t| <= A (rel_s + (1 + rel_s) g47 + g_S (1 + rel_s)(1 + g47)), A = sum |W_dn N|.
    const double g47 = fn::test::gamma_fp32(47), gS = fn::test::gamma_fp32(int(S));
    const double k_t = rel_s + (1 + rel_s) * g47 + gS * (1 + rel_s) * (1 + g47);
    ref.u.resize(r);
    ref.eu.resize(r);
    ref.t_iota.resize(4);
    ref.et_iota.resize(4);
    for (int64_t j = 0; j < R; ++j) {
      double t = 0, a = 0;
      for (int64_t col = 0; col < W; ++col) {
        const double w = fn::bf16_to_float(wdn[j * W + col]);
        t += w * ref.N[col];
        a += std::fabs(w * ref.N[col]);
      }
      if (j < r) {
        set_u(&ref, j, t, k_t * a);
      } else {
        ref.t_iota[j - r] = t;
        ref.et_iota[j - r] = k_t * a;
      }
    }
    check_mix_outputs(m, dmb.download(), diota.download(), w_up, D, r, ref, true, true);

    // Deterministic: the chain again gives the same bits, and so does the chain of the
    // runtime-shape instances (fixed_shape = false).
    fn::launch_hc_down(dp, nullptr);
    fn::launch_hc_mix(mp, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(std::memcmp(dm.download().data(), m.data(), D * 4) == 0);
    CHECK(fn::hc_mix_uses_staging(mp));
    FN_CUDA_CHECK(cudaMemset(dm.ptr, 0xff, D * 4));
    dp.fixed_shape = false;
    mp.fixed_shape = false;
    fn::launch_hc_down(dp, nullptr);
    fn::launch_hc_mix(mp, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_MESSAGE(std::memcmp(dm.download().data(), m.data(), D * 4) == 0,
                  "runtime-shape kernels' m, D ", D);
  }
}

TEST_CASE("cuda hc: the launchers reject bad sizes, stream counts, splits, strides and alignment") {
  DeviceArray<float> x(256), t(256), n(256);
  DeviceArray<uint16_t> w(64 * 64), nw(256);
  fn::HcDownParams d;
  d.H = x.ptr;
  d.norm = nw.ptr;
  d.weight = w.ptr;
  d.rows = 4;
  d.hc_count = 4;
  d.hidden = 12;  // not a multiple of 8
  d.t_partial = t.ptr;
  d.sumsq = n.ptr;
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  d.hidden = 16;
  d.H = x.ptr + 1;  // 4-byte aligned only
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  d.H = x.ptr;
  d.rows = 0;
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  d.rows = 4;
  d.sumsq = nullptr;
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  d.sumsq = n.ptr;
  d.t_partial = nullptr;
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  fn::HcMixParams m;
  m.w_up = w.ptr;
  m.t = t.ptr;
  m.sumsq = x.ptr;
  m.t_splits = 4;
  m.t_stride = 12;
  m.H = x.ptr;
  m.norm = nw.ptr;
  m.m = n.ptr + 64;
  m.hidden = 8;
  m.rank = 8;
  m.hc_count = 2;  // the kernel is written for 4 streams
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.hc_count = 4;
  m.rank = 12;
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.rank = 8;
  m.t_splits = 6;  // not one count of chunks per group
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.t_splits = 12;  // more partials than the kernel keeps in flight
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.t_splits = 4;
  m.H = nullptr;
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.H = x.ptr;
  m.iota = n.ptr + 128;
  m.t_stride = 8;  // the iota rows do not fit
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  // The valid call the rejections started from runs.
  m.t_stride = 12;
  fn::launch_hc_mix(m, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
}

// The operands of one several-token HC read: B residuals, block outputs and inject weights, the
// down and up matrices, and every output buffer (filled with 0xff before each launch).
struct TokenRead {
  int64_t D, r, rows, W, splits;
  int B;
  std::vector<float> H, y, iota_in;
  std::vector<uint16_t> norm, wdn, wup;
};

TokenRead make_token_read(int64_t D, int64_t r, int B, uint64_t seed) {
  TokenRead t{D, r, r + 4, 4 * D, fn::hc_down_splits(4, D), B, {}, {}, {}, {}, {}, {}};
  t.norm = random_bf16_bits(t.W, 0.0f, 0.7f, seed);
  t.wdn = random_bf16_bits(t.rows * t.W, 0.0f, 0.05f, seed + 1);
  t.wup = random_bf16_bits(t.W * r, 0.0f, 0.05f, seed + 2);
  std::mt19937_64 rng{seed + 3};
  std::normal_distribution<float> d(0.0f, 1.0f);
  t.H.resize(B * t.W);
  t.y.resize(B * D);
  t.iota_in.resize(B * 4);
  for (auto& v : t.H) v = d(rng);
  for (auto& v : t.y) v = d(rng);
  for (auto& v : t.iota_in) v = 2.0f / (1.0f + std::exp(-d(rng)));
  return t;
}

template <typename T>
void poison(DeviceArray<T>& a) {
  FN_CUDA_CHECK(cudaMemset(a.ptr, 0xff, a.n * sizeof(T)));
}

// Whether elements [b * n, (b + 1) * n) of `many` have the bits of `one` ([n]).
template <typename T>
bool same_token_bits(const std::vector<T>& many, const std::vector<T>& one, int b) {
  const size_t n = one.size();
  return std::memcmp(many.data() + b * n, one.data(), n * sizeof(T)) == 0;
}

TEST_CASE(
    "cuda hc: a down and mix launch over several tokens gives every token the bits of its own "
    "one-token launches, with and without the folded inject, the BF16 pair and iota, for any "
    "tokens per block") {
  struct Shape {
    int64_t hidden, rank;
    bool fixed;
  };
  // The real read (hidden 2560, rank 320: the compile-time-shape instances), the same shape through
  // the runtime-shape instances, and a small runtime shape whose groups end inside a chunk.
  for (Shape sh : {Shape{2560, 320, true}, Shape{2560, 320, false}, Shape{264, 40, true}}) {
    const int kMax = 64;
    const TokenRead t = make_token_read(sh.hidden, sh.rank, kMax, uint64_t(sh.hidden + sh.rank));
    const int64_t D = t.D, W = t.W, rows = t.rows, splits = t.splits;
    DeviceArray<float> dH(t.H), dy(t.y), diota_in(t.iota_in);
    DeviceArray<uint16_t> dnorm(t.norm), dwdn(t.wdn), dwup(t.wup);
    // Several-token outputs, then one token's.
    DeviceArray<float> tp(kMax * splits * rows), ss(kMax * splits), Hout(kMax * W), m(kMax * D),
        iota(kMax * 4);
    DeviceArray<uint16_t> mhi(kMax * D), mlo(kMax * D);
    DeviceArray<float> tp1(splits * rows), ss1(splits), Hout1(W), m1(D), iota1(4);
    DeviceArray<uint16_t> mhi1(D), mlo1(D);
    for (int B : {2, 3, 8, 64}) {
      for (int variant = 0; variant < 4; ++variant) {
        const bool inject = (variant & 1) != 0, outs = (variant & 2) != 0;
        int tpb = 0;  // tokens per block of the several-token launch
        auto read = [&](int tokens, int b0, float* tp_o, float* ss_o, float* Hout_o, float* m_o,
                        uint16_t* mhi_o, uint16_t* mlo_o, float* iota_o) {
          fn::HcDownParams dp;
          dp.H = dH.ptr + b0 * W;
          dp.norm = dnorm.ptr;
          dp.weight = dwdn.ptr;
          dp.rows = rows;
          dp.hc_count = 4;
          dp.hidden = D;
          dp.t_partial = tp_o;
          dp.sumsq = ss_o;
          if (inject) {
            dp.inject_iota = diota_in.ptr + b0 * 4;
            dp.inject_y = dy.ptr + b0 * D;
            dp.H_out = Hout_o;
          }
          dp.fixed_shape = sh.fixed;
          dp.tokens = tokens;
          dp.tokens_per_block = tokens > 1 ? tpb : 0;
          fn::launch_hc_down(dp, nullptr);
          fn::HcMixParams mp;
          mp.w_up = dwup.ptr;
          mp.t = tp_o;
          mp.sumsq = ss_o;
          mp.t_splits = splits;
          mp.t_stride = rows;
          mp.H = inject ? Hout_o : dp.H;
          mp.norm = dnorm.ptr;
          mp.eps = 1e-6f;
          mp.m = m_o;
          mp.m_bf16 = outs ? mhi_o : nullptr;
          mp.m_lo = outs ? mlo_o : nullptr;
          mp.iota = outs ? iota_o : nullptr;
          mp.hidden = D;
          mp.rank = t.r;
          mp.fixed_shape = sh.fixed;
          mp.tokens = tokens;
          mp.tokens_per_block = tokens > 1 ? tpb : 0;
          fn::launch_hc_mix(mp, nullptr);
        };
        // All tokens in one block (0), one token per block, and 3 (a last block with fewer).
        for (int per_block : {0, 1, 3}) {
          tpb = per_block;
          for (auto* a : {&tp, &ss, &Hout, &m, &iota}) poison(*a);
          poison(mhi);
          poison(mlo);
          read(B, 0, tp.ptr, ss.ptr, Hout.ptr, m.ptr, mhi.ptr, mlo.ptr, iota.ptr);
          FN_CUDA_CHECK(cudaDeviceSynchronize());
          const auto tp_b = tp.download(), ss_b = ss.download(), Hout_b = Hout.download(),
                     m_b = m.download(), iota_b = iota.download();
          const auto mhi_b = mhi.download(), mlo_b = mlo.download();
          int wrong = 0;
          for (int b = 0; b < B; ++b) {
            for (auto* a : {&tp1, &ss1, &Hout1, &m1, &iota1}) poison(*a);
            poison(mhi1);
            poison(mlo1);
            read(1, b, tp1.ptr, ss1.ptr, Hout1.ptr, m1.ptr, mhi1.ptr, mlo1.ptr, iota1.ptr);
            FN_CUDA_CHECK(cudaDeviceSynchronize());
            bool ok = same_token_bits(tp_b, tp1.download(), b) &&
                      same_token_bits(ss_b, ss1.download(), b) &&
                      same_token_bits(m_b, m1.download(), b);
            if (inject) ok = ok && same_token_bits(Hout_b, Hout1.download(), b);
            if (outs) {
              const auto hi1 = mhi1.download(), lo1 = mlo1.download();
              ok = ok && same_token_bits(mhi_b, hi1, b) && same_token_bits(mlo_b, lo1, b) &&
                   same_token_bits(iota_b, iota1.download(), b);
              // The pair is launch_split_bf16's: hi = bf16(m) (the experts' W4A16 input), lo =
              // bf16(m - hi).
              const auto m1h = m1.download();
              for (int64_t i = 0; i < D; ++i) {
                const uint16_t hi = fn::float_to_bf16(m1h[i]);
                ok = ok && hi1[i] == hi &&
                     lo1[i] == fn::float_to_bf16(m1h[i] - fn::bf16_to_float(hi));
              }
            }
            wrong += ok ? 0 : 1;
          }
          CHECK_MESSAGE(wrong == 0, "hidden ", D, " rank ", t.r, " fixed ", sh.fixed, " tokens ", B,
                        " per block ", tpb, " inject ", inject, " bf16 pair + iota ", outs, ": ",
                        wrong, " tokens differ");
        }
      }
    }
  }
}

TEST_CASE(
    "cuda hc: the register mix over several tokens gives every token the bits of its own "
    "one-token launch") {
  // Rank 2048 at D 2560 does not fit the 48 KB stage: the register kernel, which reads its W_up
  // vectors past the first three per lane again for each token.
  const int B = 3;
  const TokenRead t = make_token_read(2560, 2048, B, 77);
  const int64_t D = t.D, W = t.W, rows = t.rows, splits = t.splits;
  DeviceArray<float> dH(t.H);
  DeviceArray<uint16_t> dnorm(t.norm), dwdn(t.wdn), dwup(t.wup);
  DeviceArray<float> tp(B * splits * rows), ss(B * splits), m(B * D), iota(B * 4), m1(D), iota1(4);
  DeviceArray<uint16_t> mhi(B * D), mhi1(D);
  fn::HcDownParams dp;
  dp.H = dH.ptr;
  dp.norm = dnorm.ptr;
  dp.weight = dwdn.ptr;
  dp.rows = rows;
  dp.hidden = D;
  dp.t_partial = tp.ptr;
  dp.sumsq = ss.ptr;
  dp.tokens = B;
  fn::launch_hc_down(dp, nullptr);
  fn::HcMixParams mp;
  mp.w_up = dwup.ptr;
  mp.t = tp.ptr;
  mp.sumsq = ss.ptr;
  mp.t_splits = splits;
  mp.t_stride = rows;
  mp.H = dH.ptr;
  mp.norm = dnorm.ptr;
  mp.m = m.ptr;
  mp.m_bf16 = mhi.ptr;
  mp.iota = iota.ptr;
  mp.hidden = D;
  mp.rank = t.r;
  mp.tokens = B;
  REQUIRE_FALSE(fn::hc_mix_uses_staging(mp));
  fn::launch_hc_mix(mp, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto m_b = m.download(), iota_b = iota.download();
  const auto mhi_b = mhi.download();
  for (int b = 0; b < B; ++b) {
    fn::HcMixParams one = mp;
    one.t = tp.ptr + b * splits * rows;
    one.sumsq = ss.ptr + b * splits;
    one.H = dH.ptr + b * W;
    one.m = m1.ptr;
    one.m_bf16 = mhi1.ptr;
    one.iota = iota1.ptr;
    one.tokens = 1;
    fn::launch_hc_mix(one, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_MESSAGE(same_token_bits(m_b, m1.download(), b), "m of token ", b);
    CHECK_MESSAGE(same_token_bits(mhi_b, mhi1.download(), b), "m_bf16 of token ", b);
    CHECK_MESSAGE(same_token_bits(iota_b, iota1.download(), b), "iota of token ", b);
  }
}

TEST_CASE(
    "cuda hc: the launchers reject token counts outside 1..4096, negative tokens per block and a "
    "misaligned m_lo") {
  DeviceArray<float> x(256), t(256), n(256);
  DeviceArray<uint16_t> w(64 * 64), nw(256), lo(64);
  fn::HcDownParams d;
  d.H = x.ptr;
  d.norm = nw.ptr;
  d.weight = w.ptr;
  d.rows = 4;
  d.hc_count = 4;
  d.hidden = 16;
  d.t_partial = t.ptr;
  d.sumsq = n.ptr;
  d.tokens = 0;
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  d.tokens = 4097;
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  d.tokens = -1;
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  d.tokens = 2;
  d.tokens_per_block = -1;
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  d.tokens_per_block = 0;
  fn::HcMixParams m;
  m.w_up = w.ptr;
  m.t = t.ptr;
  m.sumsq = x.ptr;
  m.t_splits = 4;
  m.t_stride = 12;
  m.H = x.ptr;
  m.norm = nw.ptr;
  m.m = n.ptr + 64;
  m.hidden = 8;
  m.rank = 8;
  m.tokens = 0;
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.tokens = 4097;
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.tokens = 1;
  m.tokens_per_block = -1;
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.tokens_per_block = 0;
  m.m_lo = reinterpret_cast<uint16_t*>(reinterpret_cast<char*>(lo.ptr) + 1);
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  // The valid calls the rejections started from run.
  m.m_lo = lo.ptr;
  fn::launch_hc_mix(m, nullptr);
  d.tokens = 1;
  fn::launch_hc_down(d, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
}
