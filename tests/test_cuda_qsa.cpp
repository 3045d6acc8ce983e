// GPU tests of the QSA decode kernels (cuda/kernels/qsa.h) against the CPU ops that
// CpuModel::qsa_step chains (core/cpu_ops.h: rms_norm_1p, rope_neox, indexer_block_key,
// indexer_scores, qsa_selected_tokens, gqa_attention, sigmoid_gate_mul), on the tiny fixture shapes
// at TP=1/2/4 over positions 0..40 and on the real shapes (docs/model.md §A.3) with caches
// prefilled up to 39999; error bounds derived from the rounding steps of both sides; graph replay
// bitwise equal to eager; launcher checks; the seven-launch path with the overlapped projection
// bitwise equal to one projection GEMV followed by the four launches (proj, outputs, caches, every
// workspace intermediate); the decode step's block select (select_top_blocks_cg) equal to the
// prefill's four-pass radix select and to cpu::top_k on adversarial scores (ties, zeros of both
// signs, infinities, NaN, subnormals, B past the on-chip keys); a bench at t = 8191 of both paths
// and of the two selects (FN_BENCH=1).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "core/cpu_ops.h"
#include "core/error.h"
#include "cuda/kernels/gemv_bf16.h"
#include "cuda/kernels/qsa.h"
#include "tests/cuda_test_util.h"
#include "tests/qsa_select_probe.h"

namespace {

using fn::test::DeviceArray;
using fn::test::gamma_fp32;
using fn::test::kBf16Unit;
using fn::test::kFp32Unit;

constexpr double kTheta = 1e7;
constexpr float kEps = 1e-6f;

struct Shape {
  const char* name;
  int hd, rot, hq, hkv, q_first, q_per_kv, kv_first, ni, ihd, ratio, topk;
  int64_t ctx;
};

// Tiny fixtures (tests/data/fixtures/*/config.json): g3_tiny head_dim 32, 4 q / 2 kv heads,
// partial_rotary_factor 0.25 (rotary 8), indexer 2 x 16, budget 8 / ratio 4 -> block_topk 2;
// tp4 head_dim 16, 8 q / 2 kv heads, factor 0.5 (rotary 8), same indexer.
const Shape kG3Tp1{"g3_tiny TP=1", 32, 8, 4, 2, 0, 2, 0, 2, 16, 4, 2, 45};
const Shape kG3Tp2r1{"g3_tiny TP=2 rank 1", 32, 8, 2, 1, 2, 2, 1, 2, 16, 4, 2, 45};
const Shape kTp4Tp2r0{"tp4 TP=2 rank 0", 16, 8, 4, 1, 0, 4, 0, 2, 16, 4, 2, 45};
const Shape kTp4Tp4r3{"tp4 TP=4 rank 3", 16, 8, 2, 1, 6, 4, 1, 2, 16, 4, 2, 45};
// Real (docs/model.md §A.2/§A.3): 24 q / 2 kv heads of 256, rotary 64, indexer 4 x 128, ratio 4,
// block_topk 2048 / 4 = 512. TP=2: 12 q heads and 1 kv head per rank.
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

std::vector<uint16_t> random_bf16(size_t n, float sigma, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = fn::float_to_bf16(d(rng));
  return v;
}

// Device state of one QSA layer plus the launch parameters.
struct Gpu {
  Shape s;
  std::vector<float> qn, kn, iqn, ikn;  // host copies of the norm weights
  std::unique_ptr<DeviceArray<float>> proj, dqn, dkn, diqn, dikn, raw, bk;
  std::unique_ptr<DeviceArray<int64_t>> pos;
  std::unique_ptr<DeviceArray<uint16_t>> kc, vc, out;
  std::unique_ptr<DeviceArray<uint8_t>> ws;
  fn::QsaDecodeParams p;
  fn::QsaWorkspaceLayout layout;

  explicit Gpu(const Shape& shape, uint64_t seed) : s(shape) {
    std::mt19937_64 rng(seed);
    qn = random_floats(s.hd, 0.5f, rng);
    kn = random_floats(s.hd, 0.5f, rng);
    iqn = random_floats(s.ihd, 0.5f, rng);
    ikn = random_floats(s.ihd, 0.5f, rng);
    proj = std::make_unique<DeviceArray<float>>(proj_size(s));
    dqn = std::make_unique<DeviceArray<float>>(qn);
    dkn = std::make_unique<DeviceArray<float>>(kn);
    diqn = std::make_unique<DeviceArray<float>>(iqn);
    dikn = std::make_unique<DeviceArray<float>>(ikn);
    const size_t kv = size_t(s.ctx) * s.hkv * s.hd;
    kc = std::make_unique<DeviceArray<uint16_t>>(kv);
    vc = std::make_unique<DeviceArray<uint16_t>>(kv);
    raw = std::make_unique<DeviceArray<float>>(size_t(s.ctx) * s.ihd);
    bk = std::make_unique<DeviceArray<float>>(size_t(s.ctx / s.ratio) * s.ihd);
    out = std::make_unique<DeviceArray<uint16_t>>(size_t(s.hq) * s.hd);
    pos = std::make_unique<DeviceArray<int64_t>>(1);
    // Unwritten rows hold NaN: a kernel that reads one poisons its output.
    FN_CUDA_CHECK(cudaMemset(kc->ptr, 0xff, kv * 2));
    FN_CUDA_CHECK(cudaMemset(vc->ptr, 0xff, kv * 2));
    FN_CUDA_CHECK(cudaMemset(raw->ptr, 0xff, raw->n * 4));
    FN_CUDA_CHECK(cudaMemset(bk->ptr, 0xff, bk->n * 4));
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    p.proj = proj->ptr;
    p.q_norm = dqn->ptr;
    p.k_norm = dkn->ptr;
    p.iq_norm = diqn->ptr;
    p.ik_norm = dikn->ptr;
    p.position = pos->ptr;
    p.k_cache = kc->ptr;
    p.v_cache = vc->ptr;
    p.raw_keys = raw->ptr;
    p.block_keys = bk->ptr;
    p.out = out->ptr;
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
    layout = fn::qsa_workspace_layout(p);
    REQUIRE(fn::qsa_decode_workspace_bytes(p) == layout.total);
    ws = std::make_unique<DeviceArray<uint8_t>>(layout.total);
    // A workspace starting as garbage (the scores mailbox included) must not matter.
    FN_CUDA_CHECK(cudaMemset(ws->ptr, 0xff, layout.total));
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    p.workspace = ws->ptr;
  }
  void set_position(int64_t t) { pos->upload({t}); }
};

// Host copies of the caches.
struct Caches {
  std::vector<uint16_t> k, v;
  std::vector<float> raw, bk;
  static Caches download(const Gpu& g) {
    return Caches{g.kc->download(), g.vc->download(), g.raw->download(), g.bk->download()};
  }
};

template <typename T>
bool same_bits(const T* a, const T* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(T)) == 0;
}

// rms_norm_1p + rope_neox of one head (the CPU ops) and a bound on |GPU - CPU| per element.
// Both sides run the same FP32 operation sequence; they may differ only where (a) the FP64 sum
// of squares, summed in another order, rounds to a different FP32 mean (1 ulp: the scale and so
// every normed value err <= 4u relative) and (b) cos/sin of the same FP32 angle differ by 1 ulp
// (GPU: FP64 sincos rounded once; CPU: cosf/sinf). A rotated element a*c - b*s then differs by
// <= 4u(|a|+|b|) + 2u(|a|+|b|) + 3 roundings of differing values (3u(|a|+|b|)) <= 12u(|a|+|b|).
void cpu_norm_rope(const float* x, const float* w, int n, int rot, int64_t pos, float* y,
                   double* dy) {
  std::vector<float> pre(n);
  fn::cpu::rms_norm_1p(x, w, n, kEps, pre.data());
  std::copy(pre.begin(), pre.end(), y);
  fn::cpu::rope_neox(y, rot, kTheta, pos);
  const int half = rot / 2;
  for (int e = 0; e < n; ++e) {
    if (e < rot) {
      const int partner = e < half ? e + half : e - half;
      dy[e] = 12 * kFp32Unit * (std::fabs(pre[e]) + std::fabs(pre[partner]));
    } else {
      dy[e] = 4 * kFp32Unit * std::fabs(pre[e]);
    }
  }
}

std::vector<float> widen(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = fn::bf16_to_float(b[i]);
  return f;
}

struct StepStats {
  int near_tie_swaps = 0;  // CPU-score selection differing from the GPU's only by a near tie
  int dropped_blocks = 0;  // B - selected blocks
  double k_ratio = 0, score_ratio = 0, out_ratio = 0;  // worst |error| / bound of each check
};

// Runs one eager step at t with `proj` and checks everything it wrote against the CPU ops.
StepStats run_and_check_step(Gpu& g, const std::vector<float>& proj, int64_t t) {
  const Shape& s = g.s;
  INFO(s.name, " t=", t);
  const Caches before = Caches::download(g);
  g.proj->upload(proj);
  g.set_position(t);
  fn::launch_qsa_decode(g.p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  const Caches after = Caches::download(g);
  const auto out = g.out->download();
  const auto wsb = g.ws->download();
  const int64_t hd = s.hd, row = int64_t{s.hkv} * hd, qkv = int64_t{s.hq} * 2 * hd;
  StepStats st;
  const int64_t idx_off = qkv + 2 * row;

  // Steps 2-3 on the CPU: q, k, indexer q with their bounds.
  std::vector<float> q(s.hq * hd), k(row), qi(s.ni * s.ihd);
  std::vector<double> dq(q.size()), dk(k.size()), dqi(qi.size());
  for (int i = 0; i < s.hq; ++i)
    cpu_norm_rope(proj.data() + i * 2 * hd, g.qn.data(), s.hd, s.rot, t, q.data() + i * hd,
                  dq.data() + i * hd);
  for (int j = 0; j < s.hkv; ++j)
    cpu_norm_rope(proj.data() + qkv + j * hd, g.kn.data(), s.hd, s.rot, t, k.data() + j * hd,
                  dk.data() + j * hd);
  for (int h = 0; h < s.ni; ++h)
    cpu_norm_rope(proj.data() + idx_off + h * s.ihd, g.iqn.data(), s.ihd, s.rot, t,
                  qi.data() + h * s.ihd, dqi.data() + h * s.ihd);

  // Step 4: row t of K (bounded: FP32 difference then one BF16 rounding), V (bitwise), raw key
  // (bitwise); every other row untouched.
  {
    std::vector<float> got(row);
    std::vector<double> want(row), bound(row);
    for (int64_t e = 0; e < row; ++e) {
      got[e] = fn::bf16_to_float(after.k[t * row + e]);
      want[e] = k[e];
      bound[e] = dk[e] + kBf16Unit * (std::fabs(k[e]) + dk[e]);
      CHECK(after.v[t * row + e] == fn::float_to_bf16(proj[qkv + row + e]));
    }
    const auto c = fn::test::compare_bounded(got, want, bound);
    CHECK_MESSAGE(c.wrong == 0, "K row: ", c.describe());
    st.k_ratio = c.worst_ratio;
    CHECK(same_bits(after.raw.data() + t * s.ihd, proj.data() + idx_off + s.ni * s.ihd,
                    size_t(s.ihd)));
    for (int64_t r = 0; r < s.ctx; ++r) {
      if (r == t) continue;
      CHECK(same_bits(after.k.data() + r * row, before.k.data() + r * row, size_t(row)));
      CHECK(same_bits(after.v.data() + r * row, before.v.data() + r * row, size_t(row)));
      CHECK(same_bits(after.raw.data() + r * s.ihd, before.raw.data() + r * s.ihd, size_t(s.ihd)));
    }
  }
  // Block key: written exactly when block (t+1)/ratio - 1 completes; compared with
  // indexer_block_key on the raw rows (the FP64 mean is the same operation sequence on both
  // sides, so only the norm/RoPE differences of cpu_norm_rope remain).
  const int64_t B = (t + 1) / s.ratio;
  const int64_t new_block = (t + 1) % s.ratio == 0 ? B - 1 : -1;
  for (int64_t b = 0; b < s.ctx / s.ratio; ++b) {
    if (b != new_block) {
      CHECK(same_bits(after.bk.data() + b * s.ihd, before.bk.data() + b * s.ihd, size_t(s.ihd)));
      continue;
    }
    std::vector<float> kb(s.ihd), mean(s.ihd), got(s.ihd);
    fn::cpu::indexer_block_key(after.raw.data() + b * s.ratio * s.ihd, s.ratio, s.ihd, g.ikn.data(),
                               kEps, s.rot, kTheta, b * s.ratio, kb.data());
    for (int d = 0; d < s.ihd; ++d) {
      double acc = 0;
      for (int i = 0; i < s.ratio; ++i) acc += after.raw[(b * s.ratio + i) * s.ihd + d];
      mean[d] = float(acc / s.ratio);
    }
    std::vector<float> kb2(s.ihd);
    std::vector<double> dkb(s.ihd), want(s.ihd);
    cpu_norm_rope(mean.data(), g.ikn.data(), s.ihd, s.rot, b * s.ratio, kb2.data(), dkb.data());
    for (int d = 0; d < s.ihd; ++d) {
      REQUIRE(kb2[d] == kb[d]);  // the bound's decomposition is the op itself
      got[d] = after.bk[b * s.ihd + d];
      want[d] = kb[d];
    }
    const auto c = fn::test::compare_bounded(got, want, dkb);
    CHECK_MESSAGE(c.wrong == 0, "block key ", b, ": ", c.describe());
  }

  // Step 5: scores of the B complete blocks against indexer_scores (CPU indexer q, the GPU's
  // block keys). Both take FP64 dot products: the difference comes from the indexer q
  // (sum_d dqi|kb|), one FP32 rounding of each head's dot on each side (2u|dot|, relu is
  // 1-Lipschitz) and the final FP32 rounding on each side (2u|score|).
  const auto& L = g.layout;
  std::vector<float> gscores(B), cscores(B);
  std::memcpy(gscores.data(), wsb.data() + L.scores, B * 4);
  int counters[4];
  std::memcpy(counters, wsb.data() + L.counters, 16);
  if (B > 0) {
    fn::cpu::indexer_scores(qi.data(), s.ni, after.bk.data(), B, s.ihd, cscores.data());
    std::vector<double> want(B), bound(B);
    const double scale = 1.0 / std::sqrt(double(s.ihd));
    for (int64_t b = 0; b < B; ++b) {
      double e = 0;
      for (int h = 0; h < s.ni; ++h) {
        double dot = 0, dd = 0;
        for (int d = 0; d < s.ihd; ++d) {
          const double kv = after.bk[b * s.ihd + d];
          dot += double(qi[h * s.ihd + d]) * kv;
          dd += dqi[h * s.ihd + d] * std::fabs(kv);
        }
        e += dd + 2 * kFp32Unit * std::fabs(dot) + 1e-15;
      }
      want[b] = cscores[b];
      bound[b] = e * scale + 2 * kFp32Unit * std::fabs(cscores[b]);
    }
    const auto c = fn::test::compare_bounded(gscores, want, bound);
    CHECK_MESSAGE(c.wrong == 0, "scores: ", c.describe());
    st.score_ratio = c.worst_ratio;

    // The selection: exactly qsa_selected_tokens (top_k's tie rule) on the GPU's own scores.
    const int64_t k_sel = std::min<int64_t>(s.topk, B);
    REQUIRE(counters[0] == k_sel);
    REQUIRE(counters[1] == B);
    std::vector<int> sel(k_sel);
    std::memcpy(sel.data(), wsb.data() + L.selected, k_sel * 4);
    const auto want_tokens = fn::cpu::qsa_selected_tokens(gscores.data(), t, s.ratio, s.topk);
    std::vector<int64_t> got_tokens;
    for (int b : sel)
      for (int i = 0; i < s.ratio; ++i) got_tokens.push_back(int64_t{b} * s.ratio + i);
    for (int64_t tau = B * s.ratio; tau <= t; ++tau) got_tokens.push_back(tau);
    REQUIRE(got_tokens == want_tokens);
    // With the CPU's scores the same blocks win, except where a block's CPU score lies within
    // the score bound of the k-th CPU score (a near tie the bounded differences may flip).
    const auto cpu_sel = fn::cpu::top_k(cscores.data(), B, k_sel);
    const std::set<int> a(sel.begin(), sel.end()), bset(cpu_sel.begin(), cpu_sel.end());
    const double kth = cscores[cpu_sel.back()];
    double bmax = 0;
    for (double x : bound) bmax = std::max(bmax, x);
    for (int64_t b = 0; b < B; ++b) {
      if (a.count(int(b)) != bset.count(int(b))) {
        ++st.near_tie_swaps;
        CHECK_MESSAGE(std::fabs(cscores[b] - kth) <= bound[b] + bmax, "block ", b,
                      " selection differs from the CPU's beyond a near tie");
      }
    }
    st.dropped_blocks = int(B - k_sel);
  } else {
    REQUIRE(counters[0] == 0);
  }
  const int64_t tail = t + 1 - B * s.ratio;
  REQUIRE(counters[2] == counters[0] * s.ratio + tail);

  // Steps 6-7: gqa_attention over the selected tokens with the caches as stored (BF16 K/V,
  // widened), then sigmoid_gate_mul.
  const auto tokens = fn::cpu::qsa_selected_tokens(gscores.data(), t, s.ratio, s.topk);
  const auto Kf = widen(after.k), Vf = widen(after.v);
  std::vector<int32_t> kv_of_q(s.hq);
  for (int i = 0; i < s.hq; ++i) kv_of_q[i] = (s.q_first + i) / s.q_per_kv - s.kv_first;
  std::vector<float> att(s.hq * hd), want_f(s.hq * hd), gate(s.hq * hd);
  const float scale_f = 1.0f / std::sqrt(float(hd));
  fn::cpu::gqa_attention(q.data(), s.hq, kv_of_q.data(), Kf.data(), Vf.data(), row, hd,
                         tokens.data(), int64_t(tokens.size()), scale_f, att.data());
  for (int i = 0; i < s.hq; ++i)
    std::copy_n(proj.data() + i * 2 * hd + hd, hd, gate.data() + i * hd);
  fn::cpu::sigmoid_gate_mul(att.data(), gate.data(), s.hq * hd, want_f.data());
  // Bound. Score of token n: the GPU's FP32 FMA chain (<= 8 per lane, 5 butterfly adds, the
  // scale: gamma_15 + 2u for a non-power-of-two 1/sqrt(hd)) and the CPU's (FP64 dot rounded,
  // scaled: 4u) relative to A_n = scale sum|q||k|, plus the q difference scale sum dq|k|: delta_n.
  // Weights exp(s_n - M): GPU two expf (2 ulp = 4u each) and a product, CPU one expf (2u); each
  // side rounds the subtractions (u (M - s_n) each): eta_n = 12u + 2u (M - s_n). Every weight then
  // moves by a factor within 1 +- rho, rho = max_n e^{delta_n}(1 + eta_n) - 1, so the normalised
  // weights by <= 2 rho / (1 - rho) relative. FP32 sums of the GPU: chunk FMAs + the combine over
  // nc chunks (gamma_{chunk+nc+2}), the denominator (gamma_{chunk/32+nc+7}), the division (u);
  // the CPU's FP64 sums round once (u). All times sum_n p_n |v_n|. The gate: sigmoid 6u on each
  // side, the product u on each side (14u |want|). Then one BF16 rounding.
  const int nc = int((tokens.size() + L.chunk - 1) / L.chunk);
  const double acc_rel =
      gamma_fp32(L.chunk + nc + 2) + gamma_fp32(L.chunk / 32 + nc + 7) + 2 * kFp32Unit;
  std::vector<double> want(s.hq * hd), bound(s.hq * hd);
  std::vector<float> got(s.hq * hd);
  for (int i = 0; i < s.hq; ++i) {
    const int j = kv_of_q[i];
    const size_t n_tok = tokens.size();
    std::vector<double> sc(n_tok), delta(n_tok);
    double M = -INFINITY;
    for (size_t n = 0; n < n_tok; ++n) {
      const float* kr = Kf.data() + tokens[n] * row + j * hd;
      double dot = 0, a_abs = 0, dd = 0;
      for (int e = 0; e < hd; ++e) {
        dot += double(q[i * hd + e]) * kr[e];
        a_abs += std::fabs(double(q[i * hd + e]) * kr[e]);
        dd += dq[i * hd + e] * std::fabs(kr[e]);
      }
      sc[n] = dot * scale_f;
      delta[n] = (gamma_fp32(15) + 6 * kFp32Unit) * (a_abs + dd) * scale_f + dd * scale_f;
      M = std::max(M, sc[n]);
    }
    double rho = 0, z = 0;
    std::vector<double> pn(n_tok);
    for (size_t n = 0; n < n_tok; ++n) {
      const double eta = 12 * kFp32Unit + 2 * kFp32Unit * (M - sc[n] + delta[n]);
      rho = std::max(rho, std::exp(delta[n]) * (1 + eta) - 1);
      pn[n] = std::exp(sc[n] - M);
      z += pn[n];
    }
    const double rel = 2 * rho / (1 - rho) + acc_rel;
    for (int d = 0; d < hd; ++d) {
      double vabs = 0;
      for (size_t n = 0; n < n_tok; ++n)
        vabs += pn[n] / z * std::fabs(Vf[tokens[n] * row + j * hd + d]);
      const double gt = gate[i * hd + d];
      const double sg = 1 / (1 + std::exp(-gt));
      const double w = want_f[i * hd + d];
      const double pre = rel * vabs * sg + 14 * kFp32Unit * std::fabs(w);
      want[i * hd + d] = w;
      bound[i * hd + d] = pre + kBf16Unit * (std::fabs(w) + pre);
      got[i * hd + d] = fn::bf16_to_float(out[i * hd + d]);
    }
  }
  const auto c = fn::test::compare_bounded(got, want, bound);
  CHECK_MESSAGE(c.wrong == 0, "out: ", c.describe());
  st.out_ratio = c.worst_ratio;
  return st;
}

std::vector<float> random_proj(const Shape& s, std::mt19937_64& rng) {
  auto v = random_floats(proj_size(s), 1.0f, rng);
  // Per-head scales so the norms' statistic matters.
  std::uniform_real_distribution<float> sc(0.1f, 4.0f);
  const int64_t hd = s.hd;
  for (int64_t h = 0; h < proj_size(s) / 16; ++h) {
    const float f = sc(rng);
    for (int e = 0; e < 16; ++e) v[h * 16 + e] *= f;
  }
  (void)hd;
  return v;
}

// Prefills every cache row with random data (K/V BF16, raw keys, block keys); block keys of
// blocks >= period repeat block b % period so that equal scores (exact ties) occur.
void prefill(Gpu& g, std::mt19937_64& rng, int64_t period) {
  const Shape& s = g.s;
  const size_t kv = size_t(s.ctx) * s.hkv * s.hd;
  g.kc->upload(random_bf16(kv, 1.0f, rng));
  g.vc->upload(random_bf16(kv, 1.0f, rng));
  g.raw->upload(random_floats(size_t(s.ctx) * s.ihd, 1.0f, rng));
  auto bk = random_floats(size_t(s.ctx / s.ratio) * s.ihd, 1.0f, rng);
  for (int64_t b = period; b < s.ctx / s.ratio; ++b)
    std::copy_n(bk.data() + (b % period) * s.ihd, s.ihd, bk.data() + b * s.ihd);
  g.bk->upload(bk);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace

TEST_CASE("cuda qsa: tiny fixture shapes at TP=1/2/4 match the CPU ops over positions 0..40") {
  for (const Shape& s : {kG3Tp1, kG3Tp2r1, kTp4Tp2r0, kTp4Tp4r3}) {
    Gpu g(s, 11);
    std::mt19937_64 rng(5);
    int dropped = 0;
    double kr = 0, sr = 0, orr = 0;
    for (int64_t t = 0; t <= 40; ++t) {
      const auto st = run_and_check_step(g, random_proj(s, rng), t);
      dropped += st.dropped_blocks;
      kr = std::max(kr, st.k_ratio);
      sr = std::max(sr, st.score_ratio);
      orr = std::max(orr, st.out_ratio);
    }
    CHECK(dropped > 0);  // block_topk 2: from t = 11 on, blocks are dropped
    MESSAGE(std::string(s.name), ": worst error/bound K ", kr, " scores ", sr, " out ", orr);
  }
}

TEST_CASE("cuda qsa: real shapes with caches prefilled to t = 2047..39999 match the CPU ops") {
  struct Run {
    Shape s;
    std::vector<int64_t> ts;
  };
  for (const Run& r : {Run{real_tp1(8192), {2047, 2048, 2049, 2051, 2055, 8191}},
                       Run{real_tp2r1(4100), {2050, 2051, 4095, 4099}},
                       // B = 10000 blocks: past the 8192 keys the select CTA keeps on chip.
                       Run{real_tp2r1(40000), {39999}}}) {
    Gpu g(r.s, 21);
    std::mt19937_64 rng(7);
    prefill(g, rng, 700);
    for (int64_t t : r.ts) {
      const auto st = run_and_check_step(g, random_proj(r.s, rng), t);
      const int64_t B = (t + 1) / 4;
      CHECK(st.dropped_blocks == std::max<int64_t>(0, B - 512));
      MESSAGE(std::string(r.s.name), " t=", t, ": dropped ", st.dropped_blocks,
              " blocks, near-tie swaps ", st.near_tie_swaps, "; worst error/bound K ", st.k_ratio,
              " scores ", st.score_ratio, " out ", st.out_ratio);
    }
  }
}

TEST_CASE("cuda qsa: graph replay with the position advanced in device memory equals eager") {
  const Shape s = real_tp2r1(4096);
  const std::vector<int64_t> ts = {2044, 2045, 2046, 2047, 2048, 2049, 2050, 2051, 2052, 2055};
  std::mt19937_64 rng(9);
  std::vector<std::vector<float>> projs;
  for (size_t i = 0; i < ts.size(); ++i) projs.push_back(random_proj(s, rng));
  auto run = [&](bool graph) {
    Gpu g(s, 31);
    std::mt19937_64 prng(13);
    prefill(g, prng, 300);
    std::vector<std::vector<uint16_t>> outs;
    cudaStream_t stream;
    FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraphExec_t exec = nullptr;
    cudaGraph_t graph_h = nullptr;
    if (graph) {
      FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      fn::launch_qsa_decode(g.p, stream);
      FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_h));
      FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph_h, 0));
    }
    for (size_t i = 0; i < ts.size(); ++i) {
      FN_CUDA_CHECK(cudaMemcpyAsync(g.pos->ptr, &ts[i], 8, cudaMemcpyHostToDevice, stream));
      FN_CUDA_CHECK(cudaMemcpyAsync(g.proj->ptr, projs[i].data(), projs[i].size() * 4,
                                    cudaMemcpyHostToDevice, stream));
      if (graph)
        FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      else
        fn::launch_qsa_decode(g.p, stream);
      FN_CUDA_CHECK(cudaStreamSynchronize(stream));
      outs.push_back(g.out->download());
    }
    if (graph) {
      FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
      FN_CUDA_CHECK(cudaGraphDestroy(graph_h));
    }
    FN_CUDA_CHECK(cudaStreamDestroy(stream));
    return std::make_pair(outs, Caches::download(g));
  };
  const auto eager = run(false);
  const auto replay = run(true);
  for (size_t i = 0; i < ts.size(); ++i) {
    INFO("t=", ts[i]);
    CHECK(eager.first[i] == replay.first[i]);
  }
  CHECK(eager.second.k == replay.second.k);
  CHECK(eager.second.v == replay.second.v);
  CHECK(same_bits(eager.second.raw.data(), replay.second.raw.data(), eager.second.raw.size()));
  CHECK(same_bits(eager.second.bk.data(), replay.second.bk.data(), eager.second.bk.size()));
  // A second eager run reproduces the first bitwise (fixed reduction order, no atomics on floats).
  const auto again = run(false);
  for (size_t i = 0; i < ts.size(); ++i) CHECK(eager.first[i] == again.first[i]);
}

TEST_CASE(
    "cuda qsa: rows by slot in one launch (row_slot, each row on its slot's caches and position) "
    "give each row's one-row launch bitwise") {
  struct Case {
    Shape s;
    std::vector<int32_t> row_slot;
    std::vector<int64_t> t;
  };
  // Real TP=1 at 4096: t = 3001 selects 512 of 750 blocks, t = 1000 attends every block, t = 2047
  // completes a block; g3_tiny: positions around its budget.
  // One row on slot 2 (row_slot set: not the parameters' own caches) as well.
  for (const Case& c : {Case{real_tp1(4096), {2, 0, 3}, {3001, 1000, 2047}},
                        Case{kG3Tp1, {1, 3, 0, 2}, {44, 7, 11, 30}}, Case{kG3Tp1, {2}, {25}}}) {
    const Shape& s = c.s;
    INFO(s.name);
    constexpr int kSlots = 4;
    const int rows = static_cast<int>(c.row_slot.size());
    auto make = [&] {
      std::vector<std::unique_ptr<Gpu>> slots;
      for (int k = 0; k < kSlots; ++k) {
        slots.push_back(std::make_unique<Gpu>(s, 31));  // the same weights
        std::mt19937_64 prng(100 + static_cast<uint64_t>(k));
        prefill(*slots.back(), prng, 300);  // each slot its own caches
      }
      return slots;
    };
    auto batched = make(), single = make();
    std::mt19937_64 rng(17);
    const int64_t proj_ld = proj_size(s) + 3, out_ld = int64_t{s.hq} * s.hd + 5;
    std::vector<float> proj(size_t(proj_ld) * rows, 0.0f);
    for (int r = 0; r < rows; ++r) {
      const auto pr = random_proj(s, rng);
      std::copy(pr.begin(), pr.end(), proj.begin() + r * proj_ld);
    }
    std::vector<uint16_t*> k_ptr, v_ptr;
    std::vector<float*> raw_ptr, bk_ptr;
    for (const auto& g : batched) {
      k_ptr.push_back(g->kc->ptr);
      v_ptr.push_back(g->vc->ptr);
      raw_ptr.push_back(g->raw->ptr);
      bk_ptr.push_back(g->bk->ptr);
    }
    DeviceArray<uint16_t*> dk(k_ptr), dv(v_ptr);
    DeviceArray<float*> draw(raw_ptr), dbk(bk_ptr);
    DeviceArray<int32_t> drows(c.row_slot);
    DeviceArray<int64_t> dpos(c.t);
    DeviceArray<float> dproj(proj);
    DeviceArray<uint16_t> dout(size_t(out_ld) * rows);
    DeviceArray<uint8_t> dws(batched[0]->layout.total * rows);
    FN_CUDA_CHECK(cudaMemset(dout.ptr, 0xee, dout.n * 2));
    FN_CUDA_CHECK(cudaMemset(dws.ptr, 0xff, dws.n));
    fn::QsaDecodeParams p = batched[0]->p;
    p.rows = rows;
    p.row_slot = drows.ptr;
    p.slot_k_cache = dk.ptr;
    p.slot_v_cache = dv.ptr;
    p.slot_raw_keys = draw.ptr;
    p.slot_block_keys = dbk.ptr;
    p.position = dpos.ptr;
    p.proj = dproj.ptr;
    p.proj_stride = proj_ld;
    p.out = dout.ptr;
    p.out_stride = out_ld;
    p.workspace = dws.ptr;
    fn::launch_qsa_decode(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = dout.download();
    for (int r = 0; r < rows; ++r) {
      const auto k = size_t(c.row_slot[size_t(r)]);
      INFO("row ", r, " slot ", k, " t ", c.t[size_t(r)]);
      Gpu& g = *single[k];
      g.set_position(c.t[size_t(r)]);
      g.proj->upload(std::vector<float>(proj.begin() + r * proj_ld,
                                        proj.begin() + r * proj_ld + proj_size(s)));
      fn::launch_qsa_decode(g.p, nullptr);
      FN_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<uint16_t> want = g.out->download();
      CHECK(std::equal(want.begin(), want.end(), got.begin() + r * out_ld));
      CHECK(std::count(want.begin(), want.end(), uint16_t{0x7FC0}) == 0);  // no NaN row
      for (int64_t j = int64_t{s.hq} * s.hd; j < out_ld; ++j)
        CHECK(got[size_t(r * out_ld + j)] == 0xeeee);  // the padding is never written
    }
    for (int k = 0; k < kSlots; ++k) {  // every slot's caches as the one-row launches left them
      INFO("slot ", k);
      const Caches a = Caches::download(*batched[size_t(k)]),
                   b = Caches::download(*single[size_t(k)]);
      CHECK(a.k == b.k);
      CHECK(a.v == b.v);
      CHECK(same_bits(a.raw.data(), b.raw.data(), a.raw.size()));
      CHECK(same_bits(a.bk.data(), b.bk.data(), a.bk.size()));
    }
  }
}

TEST_CASE("cuda qsa: the launcher rejects bad parameters; a position past the cache writes NaN") {
  Gpu g(kG3Tp1, 3);
  auto bad = [&](auto mutate) {
    fn::QsaDecodeParams p = g.p;
    mutate(p);
    CHECK_THROWS_AS(fn::launch_qsa_decode(p, nullptr), fn::Error);
  };
  bad([](fn::QsaDecodeParams& p) { p.proj = nullptr; });
  bad([](fn::QsaDecodeParams& p) { p.position = nullptr; });
  bad([](fn::QsaDecodeParams& p) { p.block_keys = nullptr; });
  bad([](fn::QsaDecodeParams& p) { p.workspace = nullptr; });
  bad([](fn::QsaDecodeParams& p) { p.workspace = static_cast<char*>(p.workspace) + 16; });
  bad([](fn::QsaDecodeParams& p) { p.head_dim = 31; });
  bad([](fn::QsaDecodeParams& p) { p.head_dim = 512; });
  bad([](fn::QsaDecodeParams& p) { p.rotary_dim = 7; });
  bad([](fn::QsaDecodeParams& p) { p.rotary_dim = 34; });
  bad([](fn::QsaDecodeParams& p) { p.kv_head_first = 1; });  // q head 0 -> local kv -1
  bad([](fn::QsaDecodeParams& p) { p.q_per_kv = 1; });       // q head 3 -> kv 3 of 2
  bad([](fn::QsaDecodeParams& p) { p.ratio = 0; });
  bad([](fn::QsaDecodeParams& p) { p.block_topk = 0; });
  bad([](fn::QsaDecodeParams& p) { p.indexer_head_dim = 300; });
  bad([](fn::QsaDecodeParams& p) { p.ctx_size = 0; });
  // The overlapped projection: x missing, a bad input size, a misaligned matrix.
  DeviceArray<uint16_t> w(size_t(proj_size(g.s)) * 64);
  DeviceArray<float> x(64);
  const auto overlapped = [&](fn::QsaDecodeParams& p) {
    p.in_proj = w.ptr;
    p.x = x.ptr;
    p.hidden = 64;
  };
  bad([&](fn::QsaDecodeParams& p) { overlapped(p), p.x = nullptr; });
  bad([&](fn::QsaDecodeParams& p) { overlapped(p), p.hidden = 60; });
  bad([&](fn::QsaDecodeParams& p) { overlapped(p), p.hidden = 0; });
  bad([&](fn::QsaDecodeParams& p) { overlapped(p), p.hidden = 8200; });
  bad([&](fn::QsaDecodeParams& p) { overlapped(p), p.in_proj = w.ptr + 1; });
  fn::QsaDecodeParams shape = g.p;
  shape.num_q_heads = 0;
  CHECK_THROWS_AS((void)fn::qsa_decode_workspace_bytes(shape), fn::Error);

  // t = ctx_size: nothing is written, out is BF16 NaN.
  const Caches before = Caches::download(g);
  std::mt19937_64 rng(1);
  g.proj->upload(random_proj(g.s, rng));
  g.set_position(g.s.ctx);
  fn::launch_qsa_decode(g.p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  for (uint16_t o : g.out->download()) CHECK(o == 0x7FC0);
  const Caches after = Caches::download(g);
  CHECK(before.k == after.k);
  CHECK(before.v == after.v);
  CHECK(same_bits(before.raw.data(), after.raw.data(), before.raw.size()));
  CHECK(same_bits(before.bk.data(), after.bk.data(), before.bk.size()));
}

namespace {

// Bitwise comparison of the overlapped-projection path (f) with the plain path (l) after one step
// at t: out, the four caches and the workspace intermediates the kernels hand on.
void check_paths_equal(Gpu& f, Gpu& l, int64_t t) {
  const Shape& s = f.s;
  INFO(s.name, " t=", t);
  CHECK(f.out->download() == l.out->download());
  const Caches cf = Caches::download(f), cl = Caches::download(l);
  CHECK(cf.k == cl.k);
  CHECK(cf.v == cl.v);
  CHECK(same_bits(cf.raw.data(), cl.raw.data(), cf.raw.size()));
  CHECK(same_bits(cf.bk.data(), cl.bk.data(), cf.bk.size()));
  const auto wf = f.ws->download(), wl = l.ws->download();
  const auto& L = f.layout;
  int cnt[4];
  std::memcpy(cnt, wl.data() + L.counters, 16);
  CHECK(std::memcmp(wf.data() + L.counters, wl.data() + L.counters, 16) == 0);
  if (t < 0 || t >= s.ctx) {
    CHECK(cnt[0] == 0);
    return;
  }
  const int64_t B = (t + 1) / s.ratio;
  CHECK(cnt[1] == B);
  auto same = [&](size_t off, size_t bytes, const char* what) {
    CHECK_MESSAGE(std::memcmp(wf.data() + off, wl.data() + off, bytes) == 0, what);
  };
  same(L.q, size_t(s.hq) * s.hd * 4, "q");
  same(L.qi, size_t(s.ni) * s.ihd * 4, "qi");
  same(L.scores, size_t(B) * 4, "scores");
  same(L.selected, size_t(cnt[0]) * 4, "selected");
  const int nc = (cnt[2] + L.chunk - 1) / L.chunk;
  for (int i = 0; i < s.hq; ++i) {
    same(L.part_max + size_t(i) * L.max_chunks * 4, size_t(nc) * 4, "part_max");
    same(L.part_sum + size_t(i) * L.max_chunks * 4, size_t(nc) * 4, "part_sum");
    same(L.part_out + size_t(i) * L.max_chunks * s.hd * 4, size_t(nc) * s.hd * 4, "part_out");
  }
}

// Runs both paths step by step on identical state and compares them after every step: the
// overlapped path computes proj itself (QsaDecodeParams::in_proj: the projection of a random BF16
// [proj rows, hidden] matrix and FP32 input), the plain path gets it from one launch_gemv_bf16
// over all rows; proj is compared too.
void compare_paths(const Shape& s, const std::vector<int64_t>& ts, int64_t period, int64_t hidden,
                   bool forced = false) {
  INFO("projection input ", hidden);
  Gpu f(s, 51), l(s, 51);
  std::mt19937_64 wr(29);
  const DeviceArray<uint16_t> w(
      random_bf16(size_t(proj_size(s)) * hidden, 1.0f / std::sqrt(float(hidden)), wr));
  DeviceArray<float> x(static_cast<size_t>(hidden));
  f.p.in_proj = w.ptr;
  f.p.x = x.ptr;
  f.p.hidden = hidden;
  FN_CUDA_CHECK(cudaMemset(f.proj->ptr, 0xff, f.proj->n * 4));  // every row must be written
  std::mt19937_64 r1(17), r2(17);
  if (period > 0) {
    prefill(f, r1, period);
    prefill(l, r2, period);
  }
  std::unique_ptr<DeviceArray<int32_t>> fb;
  if (forced) {
    std::vector<int32_t> ids(s.topk);
    for (int i = 0; i < s.topk; ++i) ids[i] = 3 * i + 1;  // ascending, inside B at the ts used
    fb = std::make_unique<DeviceArray<int32_t>>(ids);
    f.p.forced_blocks = fb->ptr;
    l.p.forced_blocks = fb->ptr;
  }
  std::mt19937_64 rng(23);
  for (int64_t t : ts) {
    x.upload(random_floats(size_t(hidden), 1.0f, rng));
    fn::launch_gemv_bf16(w.ptr, proj_size(s), hidden, x.ptr, fn::DType::F32, l.proj->ptr,
                         fn::DType::F32, nullptr);
    for (Gpu* g : {&f, &l}) {
      g->set_position(t);
      fn::launch_qsa_decode(g->p, nullptr);
    }
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    check_paths_equal(f, l, t);
    const auto pf = f.proj->download(), pl = l.proj->download();
    CHECK_MESSAGE(same_bits(pf.data(), pl.data(), pf.size()), "proj, t=", t);
  }
}

}  // namespace

TEST_CASE(
    "cuda qsa: the overlapped projection equals the projection GEMV and the four launches "
    "bitwise, tiny shapes") {
  std::vector<int64_t> ts;
  for (int64_t t = 0; t <= 45; ++t) ts.push_back(t);  // 45 = ctx: out NaN, nothing written
  for (const Shape& s : {kG3Tp1, kG3Tp2r1, kTp4Tp2r0, kTp4Tp4r3}) {
    compare_paths(s, ts, 0, 64);
    compare_paths(s, ts, 0, 8);
  }
}

// Small enough for compute-sanitizer racecheck: every kernel of both paths, the radix select
// from t = 11 on (B > block_topk 2).
TEST_CASE("cuda qsa: sanitizer case: g3_tiny TP=1 paths equal over t = 0..45") {
  std::vector<int64_t> ts;
  for (int64_t t = 0; t <= 45; ++t) ts.push_back(t);
  compare_paths(kG3Tp1, ts, 0, 64);
}

TEST_CASE(
    "cuda qsa: the overlapped projection equals the projection GEMV and the four launches "
    "bitwise, real shapes") {
  // Dense (B <= 512), the first dropped blocks, a completing block, t = 8191, past the end; the
  // decode step's projection input (hidden 2560).
  compare_paths(real_tp1(8192), {0, 3, 2047, 2048, 2051, 4099, 8191, 8192}, 700, 2560);
  compare_paths(real_tp2r1(8192), {2050, 2051, 8190, 8191}, 1 << 20, 2560);
  // Exact ties everywhere (period 64) and B = 10000 past the select's on-chip keys.
  compare_paths(real_tp2r1(40000), {39999, 39998}, 64, 2560);
  // A reference's forced choice replayed.
  compare_paths(real_tp1(8192), {8191}, 700, 2560, true);
}

// Scores of one kind for the select test: kind 0 Gaussian, 1 uniform [0, 1), 2 sums of four
// ReLUs (zeros and a long tail), 3 all equal, 4 two values, 5 eight levels (ties at every
// threshold), 6 1000 + tiny noise (keys differ in the low bits only), 7 signed powers of two
// (every exponent), 8 +0 and -0 with a few positives, 9 +-inf among Gaussians, 10 subnormals,
// 11 NaN of both signs among Gaussians (cpu::top_k rejects NaN: select vs select only).
std::vector<float> select_scores(int kind, int B, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 7);
  std::vector<float> v(B);
  for (int i = 0; i < B; ++i) {
    float x = nd(rng);
    switch (kind) {
      case 1:
        x = ud(rng);
        break;
      case 2:
        x = std::max(x, 0.0f) + std::max(nd(rng), 0.0f) + std::max(nd(rng), 0.0f) +
            std::max(nd(rng), 0.0f);
        break;
      case 3:
        x = 0.75f;
        break;
      case 4:
        x = pick(rng) < 4 ? 1.0f : -2.0f;
        break;
      case 5:
        x = 0.25f * static_cast<float>(pick(rng));
        break;
      case 6:
        x = 1000.0f + 1e-4f * x;
        break;
      case 7:
        x = std::ldexp(x < 0 ? -1.0f : 1.0f, static_cast<int>(ud(rng) * 250.0f) - 125);
        break;
      case 8:
        x = pick(rng) == 0 ? ud(rng) : (pick(rng) < 4 ? 0.0f : -0.0f);
        break;
      case 9:
        if (pick(rng) == 0) x = pick(rng) < 4 ? INFINITY : -INFINITY;
        break;
      case 10:
        x = std::ldexp(ud(rng), -130);
        break;
      case 11:
        if (pick(rng) == 0) x = pick(rng) < 4 ? NAN : -NAN;
        break;
      default:
        break;
    }
    v[i] = x;
  }
  return v;
}

TEST_CASE("cuda qsa: the decode step's block select equals the radix select and cpu::top_k") {
  std::mt19937_64 rng(17);
  cudaStream_t stream = nullptr;
  int cases = 0;
  for (int B : {2, 3, 33, 1000, 2048, 4096, 8192, 8193, 10000})
    for (int kind = 0; kind <= 11; ++kind)
      for (int k : {1, B / 4, 512, B - 1}) {
        if (k < 1 || k >= B) continue;
        const std::vector<float> scores = select_scores(kind, B, rng);
        DeviceArray<float> d_scores(scores);
        DeviceArray<int32_t> d_ref(k), d_cg(k);
        fn::test::qsa_select_blocks(true, d_scores.ptr, B, k, d_ref.ptr, stream);
        fn::test::qsa_select_blocks(false, d_scores.ptr, B, k, d_cg.ptr, stream);
        const std::vector<int32_t> ref = d_ref.download(), cg = d_cg.download();
        INFO("B ", B, " k ", k, " kind ", kind);
        if (kind != 11) {
          std::vector<int32_t> want = fn::cpu::top_k(scores.data(), B, k);
          std::sort(want.begin(), want.end());
          REQUIRE(ref == want);
        }
        REQUIRE(cg == ref);
        ++cases;
      }
  MESSAGE(cases, " (B, k, kind) cases equal");

  const char* env = std::getenv("FN_BENCH");
  if (env == nullptr || std::string(env) != "1") return;
  // Microseconds per select (one CTA alone, launch included), graphs of 50 launches, best of 3;
  // B = 2048 (t = 8191), k = 512.
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int kind : {0, 2, 5}) {
    const std::vector<float> scores = select_scores(kind, 2048, rng);
    DeviceArray<float> d_scores(scores);
    DeviceArray<int32_t> d_sel(512);
    for (bool reference : {true, false}) {
      const double us = fn::test::graph_us_per_call(stream, 50, 1, [&](cudaStream_t st) {
        fn::test::qsa_select_blocks(reference, d_scores.ptr, 2048, 512, d_sel.ptr, st);
      });
      std::printf("qsa select bench: kind %d %s: %.3f us per select, launch included\n", kind,
                  reference ? "radix (reference)" : "decode step (cg)", us);
    }
  }
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda qsa bench: microseconds per decode step at t = 8191, real shapes (FN_BENCH=1)") {
  const char* env = std::getenv("FN_BENCH");
  if (env == nullptr || std::string(env) != "1") return;
  for (const Shape& s : {real_tp1(8192), real_tp2r1(8192)}) {
    Gpu g(s, 41);
    std::mt19937_64 rng(3);
    prefill(g, rng, 1 << 20);
    g.proj->upload(random_proj(s, rng));
    g.set_position(8191);
    cudaStream_t stream;
    FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // Microseconds per launch_qsa_decode over graphs of 20 back-to-back calls, replayed 25 times;
    // best of 3 timings: the four launches after the caller's projection, then the seven with
    // the overlapped projection (hidden 2560) minus one projection GEMV alone.
    const int64_t hidden = 2560;
    std::mt19937_64 wr(29);
    const DeviceArray<uint16_t> w(random_bf16(size_t(proj_size(s)) * hidden, 0.02f, wr));
    const DeviceArray<float> x(random_floats(size_t(hidden), 1.0f, rng));
    auto time_us = [&](const fn::QsaDecodeParams& p) {
      return fn::test::graph_us_per_call(stream, 20, 25,
                                         [&](cudaStream_t st) { fn::launch_qsa_decode(p, st); });
    };
    const double plain = time_us(g.p);
    std::printf("qsa bench: %s t=8191 chunk=%d max_chunks=%d four launches: %.2f us per step\n",
                s.name, g.layout.chunk, g.layout.max_chunks, plain);
    fn::QsaDecodeParams po = g.p;
    po.in_proj = w.ptr;
    po.x = x.ptr;
    po.hidden = hidden;
    const double overlapped = time_us(po);
    const double gemv = fn::test::graph_us_per_call(stream, 20, 25, [&](cudaStream_t st) {
      fn::launch_gemv_bf16(w.ptr, proj_size(s), hidden, x.ptr, fn::DType::F32, g.proj->ptr,
                           fn::DType::F32, st);
    });
    std::printf(
        "qsa bench: %s t=8191 overlapped projection: %.2f us per step (the projection GEMV alone "
        "%.2f us)\n",
        s.name, overlapped, gemv);
    MESSAGE(std::string(s.name), " t=8191: ", plain, " us per step, overlapped ", overlapped);
    CHECK(plain > 0);
    CHECK(overlapped > 0);
    FN_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}
