// GPU tests of the grouped RMSNorm and the HC mix (cuda/hc.h): the norm against
// fn::cpu::group_rms_norm_1p, the mix against an FP64 evaluation of MODEL.md §C.3 steps 2-5 fed
// the same inputs, with error bounds derived from the kernels' rounding steps; launcher checks.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/codecs.h"
#include "core/cpu_ops.h"
#include "core/error.h"
#include "cuda/hc.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;
using fn::test::kBf16Unit;
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

TEST_CASE("cuda hc: grouped (1 + w) RMSNorm matches the CPU op per stream, rounded to BF16") {
  struct Case {
    int groups;
    int64_t size;
  };
  for (Case c : {Case{4, 2560}, Case{1, 4}, Case{3, 1028}, Case{4, 10240}}) {
    const int64_t n = c.groups * c.size;
    std::mt19937_64 rng{uint64_t(n)};
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> x(n);
    // Each stream on its own scale: the mean square must be taken per group (MODEL.md §C.2).
    for (int64_t i = 0; i < n; ++i) x[i] = d(rng) * std::ldexp(1.0f, int(i / c.size) * 3 - 4);
    const auto wb = random_bf16_bits(n, 0.0f, 0.7f, uint64_t(n) + 1);  // far from 0 and 1
    const auto w = widen(wb);
    std::vector<float> ref(n);
    fn::cpu::group_rms_norm_1p(x.data(), w.data(), n, c.size, 1e-6f, ref.data());

    DeviceArray<float> dx(x);
    DeviceArray<uint16_t> dw(wb), dout(n);
    fn::GroupRmsNormParams p;
    p.x = dx.ptr;
    p.weight = dw.ptr;
    p.out = dout.ptr;
    p.num_groups = c.groups;
    p.group_size = c.size;
    fn::launch_group_rms_norm_1p(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = widen(dout.download());
    // Before the BF16 store the kernel's value errs by at most ~24u relative: the FP32 sum of
    // squares (the lane's FMAs, 5 butterfly levels, 7 warp adds; halved by the square root), the
    // mean and eps (2), rsqrtf (2 ulp), the three products (3); the CPU op's own FP32 output adds 4
    // (inv_rms, two products, 1 + w). Then one BF16 rounding.
    std::vector<double> want(n), bound(n);
    const int64_t chain = ((c.size / 4 + 255) / 256) * 4 + 5 + 7;  // lane, butterfly, warps
    for (int64_t i = 0; i < n; ++i) {
      want[i] = ref[i];
      const double pre = (double(chain) / 2 + 2 + 2 + 3 + 4) * kFp32Unit * std::fabs(ref[i]);
      bound[i] = pre + kBf16Unit * (std::fabs(ref[i]) + pre);
    }
    const auto cmp = fn::test::compare_bounded(got, want, bound);
    CHECK_MESSAGE(cmp.wrong == 0, c.groups, "x", c.size, ": ", cmp.describe());
  }
}

TEST_CASE("cuda hc: the mix gives m and iota of MODEL.md §C.3 within the FP32 bound") {
  struct Case {
    int64_t hidden, rank;
    bool with_iota;
  };
  // Rank 2048 at D 2560: more vectors per lane than the kernel loads before its PDL wait.
  for (Case c :
       {Case{2560, 320, true}, Case{37, 8, true}, Case{300, 40, false}, Case{2560, 2048, true}}) {
    const int64_t D = c.hidden, r = c.rank;
    const auto w_up = random_bf16_bits(4 * D * r, 0.0f, 0.05f, uint64_t(D * r));
    const auto nb = random_bf16_bits(4 * D, 0.0f, 1.0f, uint64_t(D) + 7);
    std::vector<float> t(r + 4);
    std::mt19937_64 rng{uint64_t(r)};
    std::normal_distribution<float> d(0.0f, 3.0f);
    for (auto& v : t) v = d(rng);

    DeviceArray<uint16_t> dw(w_up), dn(nb), dm(D);
    DeviceArray<float> dt(t), diota(4);
    FN_CUDA_CHECK(cudaMemset(dm.ptr, 0xff, D * 2));
    FN_CUDA_CHECK(cudaMemset(diota.ptr, 0xff, 16));
    fn::HcMixParams p;
    p.w_up = dw.ptr;
    p.t = dt.ptr;
    p.n = dn.ptr;
    p.m = dm.ptr;
    p.iota = c.with_iota ? diota.ptr : nullptr;
    p.hidden = D;
    p.rank = r;
    fn::launch_hc_mix(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto m = widen(dm.download());
    const auto iota = diota.download();

    // FP64 reference and bound. u: silu in FP32 errs <= 4u relative (expf 2 ulp, add, divide).
    std::vector<double> u(r);
    for (int64_t j = 0; j < r; ++j) {
      const double a = double(t[j]) / 4;
      u[j] = a / (1 + std::exp(-a));
    }
    const int64_t nvec = r / 8;
    int team = 8;
    while (team < 256 && team * 16 < nvec) team *= 2;
    // Widening only happens when nvec >= 32; the bound below uses the narrowest team's chain,
    // which is the longest (a wider team only shortens it).
    const int h = int((nvec + team - 1) / team) * 8 + 8 + 1;
    const double gz = fn::test::gamma_fp32(h) + 4 * kFp32Unit;
    std::vector<double> want(D), bound(D);
    for (int64_t i = 0; i < D; ++i) {
      double mm = 0, err = 0;
      for (int s = 0; s < 4; ++s) {
        double z = 0, za = 0;
        for (int64_t j = 0; j < r; ++j) {
          const double w = fn::bf16_to_float(w_up[(i + s * D) * r + j]);
          z += w * u[j];
          za += std::fabs(w * u[j]);
        }
        const double g = 1 / (1 + std::exp(-z));
        const double eg = 0.25 * gz * za + 4 * kFp32Unit * g;  // sigmoid' <= 1/4
        const double nv = fn::bf16_to_float(nb[i + s * D]);
        mm += g * nv;
        err += (eg + 4 * kFp32Unit * g) * std::fabs(nv);  // the FMA chain over 4 streams
      }
      want[i] = mm / 4;
      const double pre = err / 4;
      bound[i] = pre + kBf16Unit * (std::fabs(want[i]) + pre);
    }
    const auto cmp = fn::test::compare_bounded(m, want, bound);
    CHECK_MESSAGE(cmp.wrong == 0, "D ", D, " r ", r, ": ", cmp.describe());
    if (c.with_iota) {
      std::vector<double> wi(4), bi(4);
      for (int s = 0; s < 4; ++s) {
        wi[s] = 2 / (1 + std::exp(-double(t[r + s]) / 4));
        bi[s] = 4 * kFp32Unit * wi[s];
      }
      const auto ci = fn::test::compare_bounded(iota, wi, bi);
      CHECK_MESSAGE(ci.wrong == 0, "iota: ", ci.describe());
    } else {
      for (float v : iota) CHECK(std::isnan(v));  // untouched (0xff fill)
    }
  }
}

TEST_CASE("cuda hc: the launchers reject bad sizes, stream counts and alignment") {
  DeviceArray<float> x(64), t(64);
  DeviceArray<uint16_t> w(64 * 64), out(64);
  fn::GroupRmsNormParams n;
  n.x = x.ptr;
  n.weight = w.ptr;
  n.out = out.ptr;
  n.num_groups = 4;
  n.group_size = 6;  // not a multiple of 4
  CHECK_THROWS_AS(fn::launch_group_rms_norm_1p(n, nullptr), fn::Error);
  n.group_size = 8;
  n.x = x.ptr + 1;  // 4-byte aligned only
  CHECK_THROWS_AS(fn::launch_group_rms_norm_1p(n, nullptr), fn::Error);
  fn::HcMixParams m;
  m.w_up = w.ptr;
  m.t = t.ptr;
  m.n = out.ptr;
  m.m = out.ptr;
  m.hidden = 8;
  m.rank = 8;
  m.hc_count = 2;  // the kernel is written for 4 streams
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
  m.hc_count = 4;
  m.rank = 12;
  CHECK_THROWS_AS(fn::launch_hc_mix(m, nullptr), fn::Error);
}
