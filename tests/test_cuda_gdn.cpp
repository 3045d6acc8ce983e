// GPU tests of the Gated DeltaNet decode kernels (cuda/kernels/gdn.h): every step is checked
// against the CPU ops chained as CpuModel::gdn_step does (cpu::causal_conv_step, cpu::gdn_gates,
// cpu::gdn_recurrent_step, cpu::gated_rms_norm; docs/model.md §C.5 steps 2-7) fed the GPU's
// previous states, with error bounds propagated in FP64 from the rounding steps of both
// implementations; states are carried on the GPU over several steps. Also launcher checks, graph
// replay == eager bitwise, and a timed loop on the real shapes (bench: prints, asserts nothing
// about time).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "core/codecs.h"
#include "core/cpu_ops.h"
#include "core/error.h"
#include "cuda/kernels/gdn.h"
#include "cuda/kernels/gemv_bf16.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;
using fn::test::gamma_fp32;
using fn::test::kBf16Unit;
using fn::test::kFp32Unit;

inline size_t sz(int64_t n) {
  return static_cast<size_t>(n);
}

struct Shape {
  int Hk, Hv, dk, dv;
  int K = 4;
  int64_t conv_dim() const { return 2 * int64_t{Hk} * dk + int64_t{Hv} * dv; }
  int64_t proj_len() const { return conv_dim() + int64_t{Hv} * dv + 2 * int64_t{Hv}; }
  int64_t state_len() const { return int64_t{Hv} * dk * dv; }
};

std::vector<float> normal(size_t n, float mean, float sigma, std::mt19937_64& rng) {
  std::normal_distribution<float> d(mean, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// The layer's fixed weights on the host and the device.
struct Weights {
  std::vector<float> conv_w, A_log, dt_bias, norm_w;
  Weights(const Shape& s, std::mt19937_64& rng) {
    conv_w = normal(sz(s.conv_dim() * s.K), 0.0f, 0.5f, rng);
    std::uniform_real_distribution<float> al(-4.0f, 0.5f);  // decays from ~0.3 to ~1
    A_log.resize(sz(s.Hv));
    for (auto& x : A_log) x = al(rng);
    dt_bias = normal(sz(s.Hv), 0.0f, 1.0f, rng);
    norm_w = normal(sz(s.dv), 1.0f, 0.3f, rng);
  }
};

// Device buffers of one layer plus the scratch.
struct DeviceLayer {
  DeviceArray<float> proj, conv_w, A_log, dt_bias, norm_w, conv_state, state, o_scratch;
  DeviceArray<uint16_t> out;
  DeviceArray<unsigned int> counters;
  DeviceLayer(const Shape& s, const Weights& w)
      : proj(sz(s.proj_len())),
        conv_w(w.conv_w),
        A_log(w.A_log),
        dt_bias(w.dt_bias),
        norm_w(w.norm_w),
        conv_state(sz(s.conv_dim() * (s.K - 1))),
        state(sz(s.state_len())),
        o_scratch(sz(s.Hv) * s.dv),
        out(sz(s.Hv) * s.dv),
        counters(sz(s.Hv + s.Hk)) {
    FN_CUDA_CHECK(cudaMemset(counters.ptr, 0, counters.n * sizeof(unsigned int)));
  }
  fn::GdnDecodeParams params(const Shape& s) const {
    fn::GdnDecodeParams p;
    p.proj = proj.ptr;
    p.conv_weight = conv_w.ptr;
    p.A_log = A_log.ptr;
    p.dt_bias = dt_bias.ptr;
    p.norm_weight = norm_w.ptr;
    p.conv_state = conv_state.ptr;
    p.state = state.ptr;
    p.out = out.ptr;
    p.num_k_heads = s.Hk;
    p.num_v_heads = s.Hv;
    p.k_head_dim = s.dk;
    p.v_head_dim = s.dv;
    p.conv_kernel = s.K;
    p.eps = 1e-6f;
    p.o_scratch = o_scratch.ptr;
    p.head_counters = counters.ptr;
    return p;
  }
};

// One step of the CPU ops as CpuModel::gdn_step chains them (steps 2-7). conv_state and state are
// updated in place; y receives the gated norm output [Hv*dv].
void cpu_step(const Shape& s, const Weights& w, const std::vector<float>& proj,
              std::vector<float>& conv_state, std::vector<float>& state, std::vector<float>& y) {
  const int64_t C = s.conv_dim(), key = int64_t{s.Hk} * s.dk, vd = int64_t{s.Hv} * s.dv;
  std::vector<float> x(sz(C)), g(sz(s.Hv)), beta(sz(s.Hv));
  fn::cpu::causal_conv_step(proj.data(), conv_state.data(), w.conv_w.data(), C, s.K, 1, x.data());
  const float* a = proj.data() + C + vd;
  fn::cpu::gdn_gates(a, a + s.Hv, w.A_log.data(), w.dt_bias.data(), s.Hv, g.data(), beta.data());
  std::vector<float> o(sz(vd));
  fn::cpu::gdn_recurrent_step(x.data(), x.data() + key, x.data() + 2 * key, g.data(), beta.data(),
                              s.Hk, s.Hv, s.dk, s.dv, state.data(), o.data());
  y.resize(sz(vd));
  for (int h = 0; h < s.Hv; ++h)
    fn::cpu::gated_rms_norm(o.data() + int64_t{h} * s.dv, w.norm_w.data(),
                            proj.data() + C + int64_t{h} * s.dv, s.dv, 1e-6f,
                            y.data() + int64_t{h} * s.dv);
}

// First-order bounds on |GPU - CPU| for one step from the same inputs (proj, weights, the previous
// conv state cs and state S0), propagated in FP64. u = 2^-24; 1 ulp <= 2u relative. Rounding
// counts per element, GPU + CPU:
//   conv: GPU FMA chain of K terms (gamma_K), CPU FP64 sum rounded once (u); |silu'| <= 1.1;
//         silu itself GPU x/(1+expf(-x)) (expf 2 ulp, add, div: 6u) + CPU x*sigmoid(x) (5u).
//   sums of squares (L2 norm, gated norm): GPU depth ceil(n/256) FMAs + 5 butterfly + 7 warp adds,
//         CPU FP64 rounded once; rsqrt as 1/sqrtf(. + eps): add, sqrt, div = 3u per side.
//   gates: exp(A_log) GPU 2 ulp + CPU 1 ulp (6u); softplus log1pf(expf) GPU 4u + 2u, CPU 2u + 2u
//         (10u; d log softplus / d log e <= 1); the product u per side: g 18u relative; decay
//         exp(g) adds 6u; beta: sigmoid 6u GPU + 4u CPU.
//   r = S^T k and o = S^T q: GPU depth <= 4 rows per thread + 5 butterfly + 7 warp adds
//         (gamma_16), CPU FP64 rounded once (u).
//   delta = beta (v - r): sub and mul, 2u per side; S += k delta: GPU FMA (u), CPU mul + add (2u).
//   output: three products per side (6u), sigmoid 10u, then the GPU's BF16 rounding.
struct Bounds {
  std::vector<double> state, out, out_want;
};

Bounds step_bounds(const Shape& s, const Weights& w, const std::vector<float>& proj,
                   const std::vector<float>& cs, const std::vector<float>& S0) {
  const double u = kFp32Unit;
  const int64_t C = s.conv_dim(), L = s.K - 1, key = int64_t{s.Hk} * s.dk;
  const int64_t vd = int64_t{s.Hv} * s.dv;
  std::vector<double> y(sz(C)), ey(sz(C));
  for (int64_t c = 0; c < C; ++c) {
    const float* wc = w.conv_w.data() + c * s.K;
    double val = double(wc[s.K - 1]) * proj[sz(c)];
    double mag = std::fabs(val);
    for (int64_t j = 0; j < L; ++j) {
      const double t = double(wc[j]) * cs[sz(c * L + j)];
      val += t;
      mag += std::fabs(t);
    }
    y[sz(c)] = val / (1.0 + std::exp(-val));
    ey[sz(c)] = 1.1 * (gamma_fp32(s.K) + u) * mag + 11 * u * std::fabs(y[sz(c)]);
  }
  auto sumsq_depth = [](int n) { return (n + 255) / 256 + 12; };
  const double q_scale = double(1.0f / std::sqrt(float(s.dk)));
  // Normalised q and k per key head with their error bounds.
  std::vector<double> qh(sz(key)), eq(sz(key)), kh(sz(key)), ek(sz(key));
  for (int i = 0; i < s.Hk; ++i) {
    for (int which = 0; which < 2; ++which) {
      const int64_t base = which * key + int64_t{i} * s.dk;
      double ss = 0, ess = 0;
      for (int d = 0; d < s.dk; ++d) {
        const double v = y[sz(base + d)];
        ss += v * v;
        ess += 2 * std::fabs(v) * ey[sz(base + d)];
      }
      ess += (gamma_fp32(sumsq_depth(s.dk)) + u) * ss;
      const double D = ss + 1e-6, r = 1 / std::sqrt(D);
      const double rel_r = 0.5 * ess / D + 6 * u;
      const double sc = which == 0 ? q_scale : 1.0;
      const int muls = which == 0 ? 4 : 2;
      for (int d = 0; d < s.dk; ++d) {
        const int64_t e = int64_t{i} * s.dk + d;
        const double v = y[sz(base + d)] * r * sc;
        const double err = ey[sz(base + d)] * r * sc + std::fabs(v) * (rel_r + muls * u);
        (which == 0 ? qh : kh)[sz(e)] = v;
        (which == 0 ? eq : ek)[sz(e)] = err;
      }
    }
  }
  Bounds b;
  b.state.resize(sz(s.state_len()));
  b.out.resize(sz(vd));
  b.out_want.resize(sz(vd));
  const float* ab = proj.data() + C + vd;
  const double g16 = gamma_fp32(16) + u;
  std::vector<double> S1(sz(s.dk) * s.dv), eS1(S1.size()), S2(S1.size()), eS2(S1.size());
  std::vector<double> delta(sz(s.dv)), edelta(sz(s.dv)), o(sz(s.dv)), eo(sz(s.dv));
  for (int h = 0; h < s.Hv; ++h) {
    const int i = h / (s.Hv / s.Hk);
    const double x = double(float(ab[h] + w.dt_bias[sz(h)]));  // the same FP32 add both sides
    const double sp = x > 20 ? x : std::log1p(std::exp(x));
    const double g = -std::exp(double(w.A_log[sz(h)])) * sp;
    const double decay = std::exp(g), e_decay = decay * (18 * u * std::fabs(g) + 6 * u);
    const double bb = ab[s.Hv + h], beta = 1 / (1 + std::exp(-bb)), e_beta = 10 * u * beta;
    const float* S0h = S0.data() + int64_t{h} * s.dk * s.dv;
    for (size_t e = 0; e < S1.size(); ++e) {
      S1[e] = decay * S0h[e];
      eS1[e] = std::fabs(S0h[e]) * e_decay + 2 * u * std::fabs(S1[e]);
    }
    for (int nu = 0; nu < s.dv; ++nu) {
      double r = 0, er = 0, mag = 0;
      for (int kk = 0; kk < s.dk; ++kk) {
        const size_t e = sz(kk) * s.dv + nu, ki = sz(i) * s.dk + kk;
        r += S1[e] * kh[ki];
        mag += std::fabs(S1[e] * kh[ki]);
        er += eS1[e] * std::fabs(kh[ki]) + std::fabs(S1[e]) * ek[ki];
      }
      er += g16 * mag;
      const size_t vi = sz(2 * key + int64_t{h} * s.dv + nu);
      delta[sz(nu)] = beta * (y[vi] - r);
      edelta[sz(nu)] =
          e_beta * std::fabs(y[vi] - r) + beta * (ey[vi] + er) + 4 * u * std::fabs(delta[sz(nu)]);
    }
    for (int kk = 0; kk < s.dk; ++kk) {
      const size_t ki = sz(i) * s.dk + kk;
      for (int nu = 0; nu < s.dv; ++nu) {
        const size_t e = sz(kk) * s.dv + nu;
        const double kd = kh[ki] * delta[sz(nu)];
        S2[e] = S1[e] + kd;
        eS2[e] = eS1[e] + ek[ki] * std::fabs(delta[sz(nu)]) + std::fabs(kh[ki]) * edelta[sz(nu)] +
                 3 * u * (std::fabs(S1[e]) + std::fabs(kd));
        b.state[sz(int64_t{h} * s.dk * s.dv) + e] = eS2[e];
      }
    }
    double ss = 0, ess = 0;
    for (int nu = 0; nu < s.dv; ++nu) {
      double acc = 0, err = 0, mag = 0;
      for (int kk = 0; kk < s.dk; ++kk) {
        const size_t e = sz(kk) * s.dv + nu, ki = sz(i) * s.dk + kk;
        acc += S2[e] * qh[ki];
        mag += std::fabs(S2[e] * qh[ki]);
        err += eS2[e] * std::fabs(qh[ki]) + std::fabs(S2[e]) * eq[ki];
      }
      o[sz(nu)] = acc;
      eo[sz(nu)] = err + g16 * mag;
      ss += acc * acc;
      ess += 2 * std::fabs(acc) * eo[sz(nu)];
    }
    ess += (gamma_fp32(sumsq_depth(s.dv)) + u) * ss;
    const double mean = ss / s.dv, rs = 1 / std::sqrt(mean + 1e-6);
    const double rel_rs = 0.5 * (ess / s.dv + 2 * u * mean) / (mean + 1e-6) + 6 * u;
    for (int nu = 0; nu < s.dv; ++nu) {
      const size_t oi = sz(int64_t{h} * s.dv + nu);
      const double z = proj[sz(C) + oi], sig = 1 / (1 + std::exp(-z));
      const double wn = w.norm_w[sz(nu)];
      const double yv = o[sz(nu)] * rs * wn * sig;
      const double e = eo[sz(nu)] * rs * std::fabs(wn) * sig + std::fabs(yv) * (rel_rs + 16 * u);
      b.out_want[oi] = yv;
      b.out[oi] = e + kBf16Unit * (std::fabs(yv) + e);
    }
  }
  return b;
}

std::vector<float> widen(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = fn::bf16_to_float(b[i]);
  return f;
}

using Tweak = std::function<void(fn::GdnDecodeParams&)>;

void run_steps(const Shape& s, int steps, bool zero_start, uint64_t seed, const Tweak& tweak = {}) {
  std::mt19937_64 rng(seed);
  const Weights w(s, rng);
  DeviceLayer d(s, w);
  std::vector<float> cs(sz(s.conv_dim() * (s.K - 1)), 0.0f), S(sz(s.state_len()), 0.0f);
  if (!zero_start) {
    cs = normal(cs.size(), 0.0f, 1.0f, rng);
    S = normal(S.size(), 0.0f, 0.3f, rng);
  }
  d.conv_state.upload(cs);
  d.state.upload(S);
  fn::GdnDecodeParams p = d.params(s);
  if (tweak) tweak(p);
  INFO("Hk ", s.Hk, " Hv ", s.Hv, " dk ", s.dk, " dv ", s.dv, " slice ",
       fn::plan_gdn_decode_slice(p));
  for (int step = 0; step < steps; ++step) {
    INFO("step ", step);
    std::vector<float> proj = normal(sz(s.proj_len()), 0.0f, 1.0f, rng);
    d.proj.upload(proj);
    fn::launch_gdn_decode(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got_cs = d.conv_state.download();
    const auto got_S = d.state.download();
    const auto got_y = widen(d.out.download());
    const Bounds b = step_bounds(s, w, proj, cs, S);
    std::vector<float> ref_y;
    cpu_step(s, w, proj, cs, S, ref_y);  // cs and S become the CPU's next states
    CHECK(std::memcmp(got_cs.data(), cs.data(), cs.size() * sizeof(float)) == 0);
    const std::vector<double> want_S(S.begin(), S.end()), want_y(ref_y.begin(), ref_y.end());
    const auto cS = fn::test::compare_bounded(got_S, want_S, b.state);
    CHECK_MESSAGE(cS.wrong == 0, "state: ", cS.describe());
    const auto cy = fn::test::compare_bounded(got_y, want_y, b.out);
    CHECK_MESSAGE(cy.wrong == 0, "out: ", cy.describe());
    // The CPU oracle itself agrees with the FP64 evaluation the bounds come from (so the bounds
    // describe the math the kernels are compared on); its own error is part of the bound.
    const auto cr = fn::test::compare_bounded(ref_y, b.out_want, b.out);
    CHECK_MESSAGE(cr.wrong == 0, "cpu vs fp64: ", cr.describe());
    // Carry the GPU's states into the next step (the reference restarts from them each step).
    cs = got_cs;
    S = got_S;
  }
}

}  // namespace

TEST_CASE("cuda gdn: real TP=1 heads (16 key, 48 value, 128 dims) match the CPU ops over 6 steps") {
  run_steps(Shape{16, 48, 128, 128}, 6, true, 1);
}

TEST_CASE("cuda gdn: real TP=2 heads (8 key, 24 value, 128 dims) match the CPU ops over 6 steps") {
  run_steps(Shape{8, 24, 128, 128}, 6, false, 2);
}

TEST_CASE(
    "cuda gdn: every slice width (4, 8, 16, 32 dv columns per CTA) matches at the real shape") {
  for (int slice : {4, 8, 16, 32})
    run_steps(Shape{8, 24, 128, 128}, 3, false, uint64_t(30 + slice),
              [slice](fn::GdnDecodeParams& p) { p.slice_columns = slice; });
}

TEST_CASE("cuda gdn: tiny fixture heads and their TP slices match the CPU ops over 6 steps") {
  run_steps(Shape{2, 6, 16, 16}, 6, true, 3);   // g3_tiny / ple2_long, TP=1
  run_steps(Shape{1, 3, 16, 16}, 6, false, 4);  // their TP=2 slice
  run_steps(Shape{4, 12, 8, 8}, 6, false, 5);   // tp4 fixture, TP=1
  run_steps(Shape{1, 3, 8, 8}, 6, false, 6);    // tp4 fixture, TP=4 slice
  run_steps(Shape{2, 6, 32, 32}, 6, false, 7);  // head dim 32
}

TEST_CASE("cuda gdn: unequal and wide head dims, one value head per key head, conv kernel 2") {
  run_steps(Shape{2, 4, 32, 64}, 5, false, 8);
  run_steps(Shape{1, 2, 256, 64}, 5, false, 9);     // dk 256: narrower slices
  run_steps(Shape{3, 3, 64, 4}, 5, false, 10);      // dv = 4: one float4 column group
  run_steps(Shape{2, 2, 1024, 8}, 5, false, 11);    // dk at the limit
  run_steps(Shape{2, 6, 16, 16, 2}, 5, false, 12);  // conv_kernel 2
}

TEST_CASE("cuda gdn: the launcher rejects null pointers, bad head counts and dims, misalignment") {
  const Shape s{2, 6, 16, 16};
  std::mt19937_64 rng(13);
  const Weights w(s, rng);
  DeviceLayer d(s, w);
  const fn::GdnDecodeParams good = d.params(s);
  CHECK_NOTHROW(fn::launch_gdn_decode(good, nullptr));
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  auto rejects = [&](auto mutate) {
    fn::GdnDecodeParams p = good;
    mutate(p);
    CHECK_THROWS_AS(fn::launch_gdn_decode(p, nullptr), fn::Error);
  };
  rejects([](fn::GdnDecodeParams& p) { p.proj = nullptr; });
  rejects([](fn::GdnDecodeParams& p) { p.conv_weight = nullptr; });
  rejects([](fn::GdnDecodeParams& p) { p.A_log = nullptr; });
  rejects([](fn::GdnDecodeParams& p) { p.dt_bias = nullptr; });
  rejects([](fn::GdnDecodeParams& p) { p.norm_weight = nullptr; });
  rejects([](fn::GdnDecodeParams& p) { p.conv_state = nullptr; });
  rejects([](fn::GdnDecodeParams& p) { p.state = nullptr; });
  rejects([](fn::GdnDecodeParams& p) { p.out = nullptr; });
  rejects([](fn::GdnDecodeParams& p) { p.o_scratch = nullptr; });
  rejects([](fn::GdnDecodeParams& p) { p.head_counters = nullptr; });
  rejects([](fn::GdnDecodeParams& p) { p.num_k_heads = 0; });
  rejects([](fn::GdnDecodeParams& p) { p.num_v_heads = 5; });  // not a multiple of Hk = 2
  rejects([](fn::GdnDecodeParams& p) { p.num_v_heads = 1; });  // fewer value than key heads
  rejects([](fn::GdnDecodeParams& p) { p.k_head_dim = 6; });
  rejects([](fn::GdnDecodeParams& p) { p.k_head_dim = 2048; });
  rejects([](fn::GdnDecodeParams& p) { p.v_head_dim = 0; });
  rejects([](fn::GdnDecodeParams& p) { p.v_head_dim = 18; });
  rejects([](fn::GdnDecodeParams& p) { p.conv_kernel = 1; });
  rejects([](fn::GdnDecodeParams& p) { p.conv_kernel = 9; });
  rejects([](fn::GdnDecodeParams& p) { p.state = p.state + 1; });  // 4-byte aligned only
  rejects([](fn::GdnDecodeParams& p) { p.eps = -1.0f; });
  rejects([](fn::GdnDecodeParams& p) { p.slice_columns = 12; });
  rejects([](fn::GdnDecodeParams& p) { p.slice_columns = 32; });  // does not divide dv = 16
  // Several rows: the slot tables and strides are required, the overlapped projection is not
  // taken (the pointers only need to be non-null: the launcher throws before any launch).
  float* dummy[1] = {nullptr};
  const int32_t slot0[1] = {0};
  auto rows = [&](fn::GdnDecodeParams& p) {
    p.rows = 2;
    p.row_slot = slot0;
    p.slot_state = dummy;
    p.slot_conv = dummy;
    p.proj_stride = s.proj_len();
    p.out_stride = int64_t{s.Hv} * s.dv;
  };
  rejects([](fn::GdnDecodeParams& p) { p.rows = 0; });
  rejects([&](fn::GdnDecodeParams& p) { rows(p), p.row_slot = nullptr; });
  rejects([&](fn::GdnDecodeParams& p) { rows(p), p.slot_state = nullptr; });
  rejects([&](fn::GdnDecodeParams& p) { rows(p), p.slot_conv = nullptr; });
  rejects([&](fn::GdnDecodeParams& p) { rows(p), p.proj_stride = s.proj_len() - 1; });
  rejects([&](fn::GdnDecodeParams& p) { rows(p), p.out_stride = int64_t{s.Hv} * s.dv - 1; });
  rejects([&](fn::GdnDecodeParams& p) { rows(p), p.in_proj = reinterpret_cast<uint16_t*>(dummy); });
}

TEST_CASE(
    "cuda gdn: graph replay, the runtime-shape kernel and the arrival counters give the eager "
    "steps bitwise") {
  const Shape s{8, 24, 128, 128};
  std::mt19937_64 rng(14);
  const Weights w(s, rng);
  DeviceLayer d(s, w);
  const auto cs0 = normal(sz(s.conv_dim() * (s.K - 1)), 0.0f, 1.0f, rng);
  const auto S0 = normal(sz(s.state_len()), 0.0f, 0.3f, rng);
  std::vector<std::vector<float>> projs;
  for (int i = 0; i < 4; ++i) projs.push_back(normal(sz(s.proj_len()), 0.0f, 1.0f, rng));
  const fn::GdnDecodeParams p = d.params(s);
  cudaStream_t stream;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Snapshot {
    std::vector<float> cs, S;
    std::vector<uint16_t> y;
  };
  auto run = [&](auto&& step) {
    d.conv_state.upload(cs0);
    d.state.upload(S0);
    std::vector<Snapshot> snaps;
    for (const auto& pr : projs) {
      d.proj.upload(pr);
      FN_CUDA_CHECK(cudaDeviceSynchronize());  // the legacy-stream copies before `stream` reads
      step();
      FN_CUDA_CHECK(cudaStreamSynchronize(stream));
      snaps.push_back({d.conv_state.download(), d.state.download(), d.out.download()});
    }
    return snaps;
  };
  auto same = [&](const std::vector<Snapshot>& a, const std::vector<Snapshot>& b) {
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("step ", i);
      CHECK(a[i].cs == b[i].cs);
      CHECK(std::memcmp(a[i].S.data(), b[i].S.data(), a[i].S.size() * 4) == 0);
      CHECK(a[i].y == b[i].y);
    }
  };
  // The runtime-shape instance (at dk = dv = 128, 32-column slices and conv kernel
  // 4, p runs the compile-time-shape one).
  fn::GdnDecodeParams p_runtime = p;
  p_runtime.fixed_shape = false;
  // The compile-time-shape instance on the arrival counters (p runs it in clusters on sm_90+).
  fn::GdnDecodeParams p_arrival = p;
  p_arrival.cluster = false;
  REQUIRE(fn::plan_gdn_decode_slice(p) == 32);
  const auto eager = run([&] { fn::launch_gdn_decode(p, stream); });
  // The states did move (the comparisons are not between untouched buffers).
  CHECK(std::memcmp(eager.back().S.data(), S0.data(), S0.size() * 4) != 0);
  CHECK(eager.back().cs != cs0);
  for (const fn::GdnDecodeParams* q : {&p, static_cast<const fn::GdnDecodeParams*>(&p_runtime),
                                       static_cast<const fn::GdnDecodeParams*>(&p_arrival)}) {
    INFO("fixed shape ", q->fixed_shape, " cluster ", q->cluster);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    fn::launch_gdn_decode(*q, stream);
    FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    same(eager, run([&] { FN_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }));
    FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
    FN_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  same(eager, run([&] { fn::launch_gdn_decode(p_runtime, stream); }));
  same(eager, run([&] { fn::launch_gdn_decode(p_arrival, stream); }));
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE(
    "cuda gdn: rows by slot in one launch (row_slot, each row on its slot's states) give each "
    "row's one-row launch bitwise, for the cluster, arrival and runtime-shape kernels") {
  // One row on slot 3 (row_slot set: not the parameters' own state), and three rows.
  for (const auto& [s, row_slot] :
       {std::pair{Shape{8, 24, 128, 128}, std::vector<int32_t>{2, 0, 3}},
        std::pair{Shape{2, 4, 16, 8}, std::vector<int32_t>{2, 0, 3}},
        std::pair{Shape{8, 24, 128, 128}, std::vector<int32_t>{3}}}) {
    INFO("Hk ", s.Hk, " Hv ", s.Hv, " dk ", s.dk, " dv ", s.dv, " rows ", row_slot.size());
    std::mt19937_64 rng(21);
    const Weights w(s, rng);
    DeviceLayer d(s, w);  // the one-row launches
    constexpr int kSlots = 4;
    const int kRows = static_cast<int>(row_slot.size());  // slot 1 is in no row: left untouched
    const int64_t proj_ld = s.proj_len() + 5, out_ld = int64_t{s.Hv} * s.dv + 3;
    std::vector<std::vector<float>> cs0, S0;
    for (int k = 0; k < kSlots; ++k) {
      cs0.push_back(normal(sz(s.conv_dim() * (s.K - 1)), 0.0f, 1.0f, rng));
      S0.push_back(normal(sz(s.state_len()), 0.0f, 0.3f, rng));
    }
    const std::vector<float> proj = normal(sz(proj_ld * kRows), 0.0f, 1.0f, rng);
    // The batched launch's buffers.
    std::vector<std::unique_ptr<DeviceArray<float>>> st, cv;
    std::vector<float*> st_ptr, cv_ptr;
    for (int k = 0; k < kSlots; ++k) {
      st.push_back(std::make_unique<DeviceArray<float>>(S0[sz(k)]));
      cv.push_back(std::make_unique<DeviceArray<float>>(cs0[sz(k)]));
      st_ptr.push_back(st.back()->ptr);
      cv_ptr.push_back(cv.back()->ptr);
    }
    DeviceArray<float*> slot_state(st_ptr), slot_conv(cv_ptr);
    DeviceArray<int32_t> rows_dev(row_slot);
    DeviceArray<float> proj_dev(proj), o_rows(sz(kRows) * s.Hv * s.dv);
    DeviceArray<uint16_t> out_rows(sz(out_ld * kRows));
    DeviceArray<unsigned int> counters(sz(kRows) * (s.Hv + s.Hk));
    FN_CUDA_CHECK(cudaMemset(counters.ptr, 0, counters.n * sizeof(unsigned int)));
    FN_CUDA_CHECK(cudaMemset(out_rows.ptr, 0xff, out_rows.n * sizeof(uint16_t)));
    fn::GdnDecodeParams base = d.params(s);
    for (int variant = 0; variant < 3; ++variant) {
      INFO("variant ", variant, " (0 default, 1 arrival counters, 2 runtime shape)");
      fn::GdnDecodeParams one = base;
      one.cluster = variant != 1;
      one.fixed_shape = variant != 2;
      for (int k = 0; k < kSlots; ++k) {
        st[sz(k)]->upload(S0[sz(k)]);
        cv[sz(k)]->upload(cs0[sz(k)]);
      }
      fn::GdnDecodeParams many = one;
      many.rows = kRows;
      many.row_slot = rows_dev.ptr;
      many.slot_state = slot_state.ptr;
      many.slot_conv = slot_conv.ptr;
      many.proj = proj_dev.ptr;
      many.proj_stride = proj_ld;
      many.out = out_rows.ptr;
      many.out_stride = out_ld;
      many.o_scratch = o_rows.ptr;
      many.head_counters = counters.ptr;
      fn::launch_gdn_decode(many, nullptr);
      FN_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<uint16_t> got_out = out_rows.download();
      for (int r = 0; r < kRows; ++r) {
        INFO("row ", r, " slot ", row_slot[sz(r)]);
        const auto k = sz(row_slot[sz(r)]);
        d.state.upload(S0[k]);
        d.conv_state.upload(cs0[k]);
        d.proj.upload(std::vector<float>(proj.begin() + r * proj_ld,
                                         proj.begin() + r * proj_ld + s.proj_len()));
        fn::launch_gdn_decode(one, nullptr);
        FN_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<uint16_t> want_out = d.out.download();
        CHECK(std::equal(want_out.begin(), want_out.end(), got_out.begin() + r * out_ld));
        const std::vector<float> want_S = d.state.download(), got_S = st[k]->download();
        CHECK(std::memcmp(want_S.data(), got_S.data(), want_S.size() * 4) == 0);
        CHECK(d.conv_state.download() == cv[k]->download());
        CHECK(std::memcmp(want_S.data(), S0[k].data(), want_S.size() * 4) != 0);  // it moved
      }
      CHECK(st[1]->download() == S0[1]);
      CHECK(cv[1]->download() == cs0[1]);
      // The padding between output rows is never written.
      for (int r = 0; r < kRows; ++r)
        for (int64_t j = int64_t{s.Hv} * s.dv; j < out_ld; ++j)
          CHECK(got_out[sz(r * out_ld + j)] == 0xffff);
      CHECK(counters.download() == std::vector<unsigned int>(counters.n, 0u));
    }
  }
}

TEST_CASE(
    "cuda gdn: on sm_90+ the real shape runs in key-head clusters (no o scratch, no counters) and "
    "alternates with the arrival path step by step") {
  int device = 0, major = 0;
  FN_CUDA_CHECK(cudaGetDevice(&device));
  FN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  for (const Shape s : {Shape{16, 48, 128, 128}, Shape{8, 24, 128, 128}, Shape{4, 12, 128, 128}}) {
    INFO("Hk ", s.Hk, " Hv ", s.Hv);
    std::mt19937_64 rng(uint64_t(70 + s.Hk));
    const Weights w(s, rng);
    DeviceLayer d(s, w), e(s, w);  // d: clusters and arrivals alternating; e: arrivals only
    const auto cs0 = normal(sz(s.conv_dim() * (s.K - 1)), 0.0f, 1.0f, rng);
    const auto S0 = normal(sz(s.state_len()), 0.0f, 0.3f, rng);
    for (DeviceLayer* l : {&d, &e}) {
      l->conv_state.upload(cs0);
      l->state.upload(S0);
    }
    // A sentinel in d's o scratch: the cluster path never writes it.
    const std::vector<float> sentinel(sz(s.Hv) * s.dv, -7.25f);
    d.o_scratch.upload(sentinel);
    fn::GdnDecodeParams pc = d.params(s), pa = d.params(s), pe = e.params(s);
    pa.cluster = false;
    pe.cluster = false;
    for (int step = 0; step < 5; ++step) {
      INFO("step ", step);
      const auto proj = normal(sz(s.proj_len()), 0.0f, 1.0f, rng);
      d.proj.upload(proj);
      e.proj.upload(proj);
      const bool clustered = step % 2 == 0;  // steps 0, 2, 4 in clusters; 1, 3 on arrivals
      fn::launch_gdn_decode(clustered ? pc : pa, nullptr);
      fn::launch_gdn_decode(pe, nullptr);
      FN_CUDA_CHECK(cudaDeviceSynchronize());
      CHECK(d.conv_state.download() == e.conv_state.download());
      const auto Sd = d.state.download(), Se = e.state.download();
      CHECK(std::memcmp(Sd.data(), Se.data(), Sd.size() * 4) == 0);
      CHECK(d.out.download() == e.out.download());
      // The counters are left zero by both paths (the arrival path relies on it).
      const auto counters = d.counters.download();
      CHECK(std::all_of(counters.begin(), counters.end(), [](unsigned c) { return c == 0u; }));
      if (step == 0 && major >= 9) {
        const auto o = d.o_scratch.download();
        CHECK(std::memcmp(o.data(), sentinel.data(), o.size() * 4) == 0);
      }
    }
  }
}

// The overlapped projection (GdnDecodeParams::in_proj): the rows but z, the recurrence, the z rows
// beside it and out_proj after both, against launch_gemv_bf16 over all rows, the recurrence and
// launch_gemv_bf16 of out_proj in a row: proj, both states, the gated norm output and y bitwise,
// step by step, in clusters, on the arrival counters and replayed from a graph; the join words
// left zero. Then the launcher's checks of the overlapped mode.
TEST_CASE(
    "cuda gdn: the overlapped projection (z beside the recurrence, out_proj joined) equals the "
    "three launches bitwise") {
  for (const Shape s : {Shape{16, 48, 128, 128}, Shape{8, 24, 128, 128}, Shape{2, 4, 16, 16}}) {
    for (int mode = 0; mode < 3; ++mode) {  // 0 eager, 1 arrivals (eager), 2 graph replay
      INFO("Hk ", s.Hk, " Hv ", s.Hv, " mode ", mode);
      const int64_t hidden = s.dk == 128 ? 2560 : 64, vd = int64_t{s.Hv} * s.dv;
      std::mt19937_64 rng(uint64_t(90 + s.Hk + mode));
      const Weights w(s, rng);
      DeviceLayer d(s, w), e(s, w);
      std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(hidden)));
      std::vector<uint16_t> win(sz(s.proj_len() * hidden)), wout(sz(hidden * vd));
      for (auto& b : win) b = fn::float_to_bf16(nd(rng));
      for (auto& b : wout) b = fn::float_to_bf16(nd(rng) * 0.2f);
      DeviceArray<uint16_t> d_win(win), d_wout(wout);
      DeviceArray<float> x(sz(hidden)), yd(sz(hidden)), ye(sz(hidden));
      DeviceArray<unsigned int> join(2);
      FN_CUDA_CHECK(cudaMemset(join.ptr, 0, 2 * sizeof(unsigned int)));
      const auto cs0 = normal(sz(s.conv_dim() * (s.K - 1)), 0.0f, 1.0f, rng);
      const auto S0 = normal(sz(s.state_len()), 0.0f, 0.3f, rng);
      for (DeviceLayer* l : {&d, &e}) {
        l->conv_state.upload(cs0);
        l->state.upload(S0);
      }
      FN_CUDA_CHECK(cudaMemset(d.proj.ptr, 0xff, d.proj.n * 4));  // every row must be written
      fn::GdnDecodeParams pd = d.params(s), pe = e.params(s);
      pd.cluster = pe.cluster = mode != 1;
      pd.in_proj = d_win.ptr;
      pd.x = x.ptr;
      pd.hidden = hidden;
      pd.out_weight = d_wout.ptr;
      pd.y = yd.ptr;
      pd.join = join.ptr;
      cudaStream_t stream;
      FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      cudaGraphExec_t exec = nullptr;
      if (mode == 2) {
        cudaGraph_t graph;
        FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        fn::launch_gdn_decode(pd, stream);
        FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        FN_CUDA_CHECK(cudaGraphDestroy(graph));
      }
      for (int step = 0; step < 4; ++step) {
        INFO("step ", step);
        x.upload(normal(sz(hidden), 0.0f, 1.0f, rng));
        FN_CUDA_CHECK(cudaDeviceSynchronize());
        fn::launch_gemv_bf16(d_win.ptr, s.proj_len(), hidden, x.ptr, fn::DType::F32, e.proj.ptr,
                             fn::DType::F32, stream);
        fn::launch_gdn_decode(pe, stream);
        fn::launch_gemv_bf16(d_wout.ptr, hidden, vd, e.out.ptr, fn::DType::BF16, ye.ptr,
                             fn::DType::F32, stream);
        if (exec != nullptr)
          FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        else
          fn::launch_gdn_decode(pd, stream);
        FN_CUDA_CHECK(cudaStreamSynchronize(stream));
        const auto pjd = d.proj.download(), pje = e.proj.download();
        CHECK(std::memcmp(pjd.data(), pje.data(), pjd.size() * 4) == 0);
        CHECK(d.conv_state.download() == e.conv_state.download());
        const auto Sd = d.state.download(), Se = e.state.download();
        CHECK(std::memcmp(Sd.data(), Se.data(), Sd.size() * 4) == 0);
        CHECK(d.out.download() == e.out.download());
        const auto y1 = yd.download(), y2 = ye.download();
        CHECK(std::memcmp(y1.data(), y2.data(), y1.size() * 4) == 0);
        const auto jw = join.download();
        CHECK(jw[0] == 0u);
        CHECK(jw[1] == 0u);
      }
      // The states did move (the comparisons are not between untouched buffers).
      CHECK(std::memcmp(d.state.download().data(), S0.data(), S0.size() * 4) != 0);
      if (exec != nullptr) FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
      FN_CUDA_CHECK(cudaStreamDestroy(stream));
      if (mode != 0 || s.dk != 16) continue;
      auto rejects = [&](auto mutate) {
        fn::GdnDecodeParams q = pd;
        mutate(q);
        CHECK_THROWS_AS(fn::launch_gdn_decode(q, nullptr), fn::Error);
      };
      rejects([](fn::GdnDecodeParams& q) { q.x = nullptr; });
      rejects([](fn::GdnDecodeParams& q) { q.out_weight = nullptr; });
      rejects([](fn::GdnDecodeParams& q) { q.y = nullptr; });
      rejects([](fn::GdnDecodeParams& q) { q.join = nullptr; });
      rejects([](fn::GdnDecodeParams& q) { q.hidden = 60; });
      rejects([](fn::GdnDecodeParams& q) { q.hidden = 8200; });
      rejects([&](fn::GdnDecodeParams& q) { q.in_proj = d_win.ptr + 1; });
    }
  }
}

// Bench (no assertion on time): one graph of `layers` decode steps, each on its own layer's
// states and weights so the working set (> 100 MiB) exceeds the L2 as the 36 GDN layers do.
// Bytes = state read + write, conv state read + write, conv weights, proj, out.
TEST_CASE("cuda gdn bench: us and GB/s per layer step at the real TP=1 and TP=2 shapes") {
  for (const Shape s : {Shape{16, 48, 128, 128}, Shape{8, 24, 128, 128}}) {
    const int layers = s.Hv == 48 ? 36 : 72;
    std::mt19937_64 rng(15);
    const Weights w(s, rng);
    std::vector<std::unique_ptr<DeviceLayer>> L;
    for (int l = 0; l < layers; ++l) {
      L.push_back(std::make_unique<DeviceLayer>(s, w));
      FN_CUDA_CHECK(cudaMemset(L.back()->state.ptr, 0, L.back()->state.n * 4));
      FN_CUDA_CHECK(cudaMemset(L.back()->conv_state.ptr, 0, L.back()->conv_state.n * 4));
      L.back()->proj.upload(normal(sz(s.proj_len()), 0.0f, 1.0f, rng));
    }
    FN_CUDA_CHECK(cudaDeviceSynchronize());  // the legacy-stream copies before `stream` reads
    cudaStream_t stream;
    FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // Microseconds per layer of a graph holding `layers` captured steps, over 20 replays.
    auto time_graph = [&](auto&& capture) {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      capture();
      FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm-up
      cudaEvent_t e0, e1;
      FN_CUDA_CHECK(cudaEventCreate(&e0));
      FN_CUDA_CHECK(cudaEventCreate(&e1));
      const int reps = 20;
      FN_CUDA_CHECK(cudaEventRecord(e0, stream));
      for (int r = 0; r < reps; ++r) FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      FN_CUDA_CHECK(cudaEventRecord(e1, stream));
      FN_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      FN_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      FN_CUDA_CHECK(cudaEventDestroy(e0));
      FN_CUDA_CHECK(cudaEventDestroy(e1));
      FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
      FN_CUDA_CHECK(cudaGraphDestroy(graph));
      return 1e3 * ms / (reps * layers);
    };
    const double bytes = 2.0 * s.state_len() * 4 + 2.0 * s.conv_dim() * (s.K - 1) * 4 +
                         double(s.conv_dim()) * s.K * 4 + double(s.proj_len()) * 4 +
                         double(s.Hv) * s.dv * 2;
    struct Mode {
      const char* name;
      bool cluster;
      int slice;  // 0: the planned width
    };
    for (const Mode m :
         {Mode{"planned slice", true, 0}, Mode{"slice", true, 8}, Mode{"slice", true, 16},
          Mode{"slice", true, 32}, Mode{"arrival counters, planned slice", false, 0}}) {
      auto tweak = [&](fn::GdnDecodeParams p) {
        p.cluster = m.cluster;
        p.slice_columns = m.slice;
        return p;
      };
      const double us = time_graph([&] {
        for (auto& l : L) fn::launch_gdn_decode(tweak(l->params(s)), stream);
      });
      const double gbs = bytes / (us * 1e-6) / 1e9;
      std::printf(
          "gdn_decode bench: Hk=%d Hv=%d dk=%d dv=%d %s (slice %d): %.2f us/layer, %.2f MB "
          "moved, %.0f GB/s (%.0f%% of 4300 GB/s)\n",
          s.Hk, s.Hv, s.dk, s.dv, m.name, fn::plan_gdn_decode_slice(tweak(L[0]->params(s))), us,
          bytes / 1e6, gbs, 100.0 * gbs / 4300.0);
    }
    // Reference: a device-to-device copy of one layer's state per layer (reads + writes the same
    // state bytes as the recurrence), in the same graph form.
    const double us_copy = time_graph([&] {
      for (int l = 0; l < layers; ++l)
        FN_CUDA_CHECK(cudaMemcpyAsync(L[sz((l + 1) % layers)]->state.ptr, L[sz(l)]->state.ptr,
                                      sz(s.state_len()) * 4, cudaMemcpyDeviceToDevice, stream));
    });
    std::printf("gdn_decode bench: Hv=%d state-sized D2D copy: %.2f us/layer, %.0f GB/s\n", s.Hv,
                us_copy, 2.0 * s.state_len() * 4 / (us_copy * 1e-6) / 1e9);
    FN_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}
