// GPU tests of the HC read (cuda/hc.h): the fused norm + split-K down pass (N and the partial dots
// of t) and the mix (m FP32 and its BF16 copy, iota) against FP64 evaluations of MODEL.md §C.2 and
// §C.3 fed the same inputs, with error bounds derived from the kernels' FP32 rounding steps (N
// and m are FP32 since issue 9's KL finding: no BF16 rounding in the bounds); launcher checks.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/codecs.h"
#include "core/cpu_ops.h"
#include "core/error.h"
#include "cuda/hc.h"
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

}  // namespace

TEST_CASE(
    "cuda hc: the down pass gives N = GroupRMSNorm1p(H) in FP32 and partial dots that sum to "
    "W N") {
  struct Case {
    int groups;
    int64_t hidden, rows;
  };
  // The real read (324 rows, 10 chunks of 1024 columns) and the final mixer's (320); the tiny
  // fixtures' width 4 x 8; a chunk that straddles groups (3 x 400) and short last chunks.
  for (Case c : {Case{4, 2560, 324}, Case{4, 2560, 320}, Case{4, 8, 20}, Case{3, 400, 37},
                 Case{2, 1000, 70}}) {
    const int64_t D = c.hidden, W = c.groups * D, R = c.rows;
    std::mt19937_64 rng{uint64_t(W * R)};
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> H(W);
    // Each stream on its own scale: the mean square must be taken per group (MODEL.md §C.2).
    for (int64_t i = 0; i < W; ++i) H[i] = d(rng) * std::ldexp(1.0f, int(i / D) * 3 - 4);
    const auto nb = random_bf16_bits(W, 0.0f, 0.7f, uint64_t(W) + 1);  // far from 0 and 1
    const auto wb = random_bf16_bits(R * W, 0.0f, 0.02f, uint64_t(W) + 2);
    const int64_t splits = fn::hc_down_splits(W);
    CHECK(splits == (W + 1023) / 1024);

    DeviceArray<float> dH(H), dn(W), dt(splits * R);
    DeviceArray<uint16_t> dnorm(nb), dw(wb);
    FN_CUDA_CHECK(cudaMemset(dn.ptr, 0xff, W * 4));
    fn::HcDownParams p;
    p.H = dH.ptr;
    p.norm = dnorm.ptr;
    p.weight = dw.ptr;
    p.rows = R;
    p.hc_count = c.groups;
    p.hidden = D;
    p.eps = 1e-6f;
    p.n = dn.ptr;
    p.t_partial = dt.ptr;
    fn::launch_hc_down(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto n = dn.download();
    const auto tp = dt.download();

    // N in FP64. The kernel's FP32 value errs by at most (chain/2 + 2 + 4 + 3) u relative: the sum
    // of squares (positive terms: the lane's FMAs, 5 butterfly levels, 7 warp adds; halved by the
    // square root), the mean and eps (2), rsqrtf (2 ulp = 4 u), the three products (3).
    const int64_t chain = ((D / 4 + 255) / 256) * 4 + 5 + 7;
    const double rel_n = (double(chain) / 2 + 2 + 4 + 3) * kFp32Unit;
    std::vector<double> want_n(W), bound_n(W);
    for (int g = 0; g < c.groups; ++g) {
      double ss = 0;
      for (int64_t i = 0; i < D; ++i) ss += double(H[g * D + i]) * H[g * D + i];
      const double inv = 1 / std::sqrt(ss / double(D) + 1e-6);
      for (int64_t i = g * D; i < (g + 1) * D; ++i) {
        want_n[i] = H[i] * inv * (1 + double(fn::bf16_to_float(nb[i])));
        bound_n[i] = rel_n * std::fabs(want_n[i]);
      }
    }
    const auto cn = fn::test::compare_bounded(n, want_n, bound_n);
    CHECK_MESSAGE(cn.wrong == 0, "N ", c.groups, "x", D, ": ", cn.describe());
    // The CPU op (core/cpu_ops.h) agrees with the FP64 N within its own 4 roundings as well.
    const auto wf = widen(nb);
    std::vector<float> cpu_n(W);
    fn::cpu::group_rms_norm_1p(H.data(), wf.data(), W, D, 1e-6f, cpu_n.data());
    for (int64_t i = 0; i < W; ++i) bound_n[i] = 6 * kFp32Unit * std::fabs(want_n[i]);
    CHECK(fn::test::compare_bounded(cpu_n, want_n, bound_n).wrong == 0);

    // t = W N in FP64 from the exact N; the sum of the partials (FP64, ascending) errs by the
    // FP32 dot (per lane 4 vectors = 32 FMAs, then 5 butterfly levels) plus N's own error.
    const double gz = fn::test::gamma_fp32(32 + 5);
    std::vector<float> got_t(R);
    std::vector<double> want_t(R), bound_t(R);
    for (int64_t r = 0; r < R; ++r) {
      double s = 0, sa = 0, sp = 0;
      for (int64_t col = 0; col < W; ++col) {
        const double w = fn::bf16_to_float(wb[r * W + col]);
        s += w * want_n[col];
        sa += std::fabs(w * want_n[col]);
      }
      for (int64_t k = 0; k < splits; ++k) sp += tp[k * R + r];
      got_t[r] = static_cast<float>(sp);
      want_t[r] = s;
      // + the FP32 rounding of the FP64 sum of the partials into got_t.
      bound_t[r] = (gz + rel_n * (1 + gz)) * sa + kFp32Unit * std::fabs(sp);
    }
    const auto ct = fn::test::compare_bounded(got_t, want_t, bound_t);
    CHECK_MESSAGE(ct.wrong == 0, "t ", c.groups, "x", D, " rows ", R, ": ", ct.describe());

    // Deterministic: a second launch gives the same bits.
    fn::launch_hc_down(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(std::memcmp(dn.download().data(), n.data(), W * 4) == 0);
    CHECK(std::memcmp(dt.download().data(), tp.data(), splits * R * 4) == 0);
  }
}

TEST_CASE("cuda hc: the mix gives m (FP32 and its BF16 copy) and iota of MODEL.md §C.3") {
  struct Case {
    int64_t hidden, rank, splits;
    bool with_iota, with_bf16;
  };
  // Rank 2048 at D 2560: more vectors per lane than the kernel loads before its PDL wait.
  // 10 partials: the real width's chunks; 16: the most the kernel takes.
  for (Case c :
       {Case{2560, 320, 10, true, true}, Case{37, 8, 1, true, false}, Case{300, 40, 3, false, true},
        Case{2560, 2048, 1, true, false}, Case{2560, 320, 16, false, false}}) {
    const int64_t D = c.hidden, r = c.rank, stride = r + 4 + 3;  // a wider stride than needed
    const auto w_up = random_bf16_bits(4 * D * r, 0.0f, 0.05f, uint64_t(D * r));
    std::vector<float> N(4 * D), tp(c.splits * stride);
    std::mt19937_64 rng{uint64_t(r * c.splits)};
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto& v : N) v = d(rng);
    const float sp = 3.0f / std::sqrt(float(c.splits));
    for (auto& v : tp) v = sp * d(rng);

    DeviceArray<uint16_t> dw(w_up), dmb(D);
    DeviceArray<float> dn(N), dt(tp), dm(D), diota(4);
    FN_CUDA_CHECK(cudaMemset(dm.ptr, 0xff, D * 4));
    FN_CUDA_CHECK(cudaMemset(dmb.ptr, 0xff, D * 2));
    FN_CUDA_CHECK(cudaMemset(diota.ptr, 0xff, 16));
    fn::HcMixParams p;
    p.w_up = dw.ptr;
    p.t = dt.ptr;
    p.t_splits = c.splits;
    p.t_stride = stride;
    p.n = dn.ptr;
    p.m = dm.ptr;
    p.m_bf16 = c.with_bf16 ? dmb.ptr : nullptr;
    p.iota = c.with_iota ? diota.ptr : nullptr;
    p.hidden = D;
    p.rank = r;
    fn::launch_hc_mix(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto m = dm.download();
    const auto mb = dmb.download();
    const auto iota = diota.download();

    // FP64 reference. t[j] = sum of the partials; the kernel's FP32 sum errs by gamma_splits times
    // the sum of their magnitudes. u = silu(t / 4): |silu'| < 1.1, so u errs by 1.1 / 4 of t's
    // error plus 4 u relative (expf 2 ulp, add, divide).
    auto t_of = [&](int64_t j, double* abs_sum) {
      double s = 0, a = 0;
      for (int64_t k = 0; k < c.splits; ++k) {
        s += tp[k * stride + j];
        a += std::fabs(tp[k * stride + j]);
      }
      *abs_sum = a;
      return s;
    };
    const double gs = fn::test::gamma_fp32(int(c.splits));
    std::vector<double> u(r), eu(r);
    for (int64_t j = 0; j < r; ++j) {
      double a;
      const double x = t_of(j, &a) / 4;
      u[j] = x / (1 + std::exp(-x));
      eu[j] = 1.1 * gs * a / 4 + 4 * kFp32Unit * std::fabs(u[j]);
    }
    const int64_t nvec = r / 8;
    int team = 8;
    while (team < 256 && team * 16 < nvec) team *= 2;
    // Widening only happens when nvec >= 16; the bound below uses the narrowest team's chain,
    // which is the longest (a wider team only shortens it).
    const int h = int((nvec + team - 1) / team) * 8 + 8;
    const double gz = fn::test::gamma_fp32(h);
    std::vector<double> want(D), bound(D);
    for (int64_t i = 0; i < D; ++i) {
      double mm = 0, err = 0;
      for (int s = 0; s < 4; ++s) {
        double z = 0, za = 0, ez = 0;
        for (int64_t j = 0; j < r; ++j) {
          const double w = fn::bf16_to_float(w_up[(i + s * D) * r + j]);
          z += w * u[j];
          za += std::fabs(w * u[j]);
          ez += std::fabs(w) * eu[j];
        }
        const double g = 1 / (1 + std::exp(-z));
        const double eg = 0.25 * (gz * za + ez) + 4 * kFp32Unit * g;  // sigmoid' <= 1/4
        const double nv = N[i + s * D];
        mm += g * nv;
        err += (eg + 4 * kFp32Unit * g) * std::fabs(nv);  // the FMA chain over 4 streams
      }
      want[i] = mm / 4;
      bound[i] = err / 4;  // m is stored in FP32: no further rounding (x 1/4 is exact)
    }
    const auto cmp = fn::test::compare_bounded(m, want, bound);
    CHECK_MESSAGE(cmp.wrong == 0, "D ", D, " r ", r, " splits ", c.splits, ": ", cmp.describe());
    if (c.with_bf16) {
      int64_t diff = 0;
      for (int64_t i = 0; i < D; ++i) diff += mb[i] != fn::float_to_bf16(m[i]) ? 1 : 0;
      CHECK_MESSAGE(diff == 0, diff, " BF16 copies are not m rounded to nearest even");
    } else {
      for (uint16_t v : mb) CHECK(v == 0xffff);  // untouched
    }
    if (c.with_iota) {
      std::vector<double> wi(4), bi(4);
      for (int s = 0; s < 4; ++s) {
        double a;
        const double x = t_of(r + s, &a) / 4;
        wi[s] = 2 / (1 + std::exp(-x));
        bi[s] = 0.5 * gs * a / 4 + 4 * kFp32Unit * wi[s];  // (2 sigmoid)' <= 1/2
      }
      const auto ci = fn::test::compare_bounded(iota, wi, bi);
      CHECK_MESSAGE(ci.wrong == 0, "iota: ", ci.describe());
    } else {
      for (float v : iota) CHECK(std::isnan(v));  // untouched (0xff fill)
    }
  }
}

TEST_CASE("cuda hc: the launchers reject bad sizes, stream counts, strides and alignment") {
  DeviceArray<float> x(256), t(256), n(256);
  DeviceArray<uint16_t> w(64 * 64), nw(256);
  fn::HcDownParams d;
  d.H = x.ptr;
  d.norm = nw.ptr;
  d.weight = w.ptr;
  d.rows = 4;
  d.hc_count = 4;
  d.hidden = 12;  // not a multiple of 8
  d.n = n.ptr;
  d.t_partial = t.ptr;
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  d.hidden = 16;
  d.H = x.ptr + 1;  // 4-byte aligned only
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  d.H = x.ptr;
  d.rows = 0;
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  d.rows = 4;
  d.t_partial = nullptr;
  CHECK_THROWS_AS(fn::launch_hc_down(d, nullptr), fn::Error);
  fn::HcMixParams m;
  m.w_up = w.ptr;
  m.t = t.ptr;
  m.t_stride = 12;
  m.n = n.ptr;
  m.m = n.ptr + 64;
  m.hidden = 8;
  m.rank = 8;
  m.hc_count = 2;  // the kernel is written for 4 streams
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.hc_count = 4;
  m.rank = 12;
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.rank = 8;
  m.t_splits = 0;
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.t_splits = 17;  // more partials than the kernel keeps in flight
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.t_splits = 1;
  m.iota = x.ptr;
  m.t_stride = 8;  // the iota rows do not fit
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
}
