// Unit tests of core/cpu_ops.h: every expected value is computed by hand (the derivation is in the
// comment next to it) or by an independent, straightforward formula written in the test.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/cpu_ops.h"
#include "core/error.h"

using namespace fn::cpu;
using doctest::Approx;

namespace {
void check_close(const std::vector<float>& got, const std::vector<double>& want,
                 double eps = 1e-6) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == Approx(want[i]).epsilon(eps));
  }
}
const double kSqrt2 = std::sqrt(2.0);
}  // namespace

TEST_CASE("cpu ops: scalar activations match their closed forms, softplus is x above 20") {
  CHECK(sigmoid(0.0f) == 0.5f);
  CHECK(sigmoid(std::log(3.0f)) == Approx(0.75));
  CHECK(sigmoid(-100.0f) >= 0.0f);
  CHECK(sigmoid(-100.0f) < 1e-40f);
  CHECK(sigmoid(100.0f) == 1.0f);
  CHECK(silu(1.0f) == Approx(1.0 / (1.0 + std::exp(-1.0))));
  CHECK(silu(-1.0f) == Approx(-1.0 / (1.0 + std::exp(1.0))));
  CHECK(softplus(0.0f) == Approx(std::log(2.0)));
  CHECK(softplus(21.0f) == 21.0f);
  CHECK(softplus(20.5f) == 20.5f);
  CHECK(softplus(-30.0f) == Approx(std::exp(-30.0)).epsilon(1e-6));
  CHECK(softplus(2.0f) == Approx(std::log1p(std::exp(2.0))));
}

TEST_CASE("cpu ops: bf16 rounding is round-to-nearest-even on the upper 16 bits") {
  CHECK(round_to_bf16(1.0f) == 1.0f);
  CHECK(round_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 1.0f);  // halfway, even is 1.0
  CHECK(round_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) ==
        1.0f + std::ldexp(1.0f, -6));  // halfway between mantissa 1 and 2: even is 2
  CHECK(round_to_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)) ==
        1.0f + std::ldexp(1.0f, -7));  // just above halfway rounds up
  CHECK(std::isnan(round_to_bf16(NAN)));
}

TEST_CASE("cpu ops: gemv and its row/column range variant compute W x on the chosen block") {
  // W = [[1,2,3,4],[5,6,7,8],[9,10,11,12]], x = [1,0,-1,2]
  const std::vector<float> W = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::vector<float> x = {1, 0, -1, 2};
  std::vector<float> y(3);
  gemv(W.data(), 3, 4, 4, x.data(), y.data());
  check_close(y, {1 - 3 + 8, 5 - 7 + 16, 9 - 11 + 24});
  DenseMatrix M(W.data(), 3, 4);
  std::fill(y.begin(), y.end(), 0.0f);
  gemv(M, x.data(), y.data());
  check_close(y, {6, 14, 22});
  // rows [1,3), cols [2,4) applied to x' = [-1, 2]: [7*-1 + 8*2, 11*-1 + 12*2]
  std::vector<float> y2(2);
  gemv_range(M, 1, 3, 2, 4, x.data() + 2, y2.data());
  check_close(y2, {9, 13});
  // The pointer form with a leading dimension does the same block.
  gemv(W.data() + 1 * 4 + 2, 2, 2, 4, x.data() + 2, y2.data());
  check_close(y2, {9, 13});
  CHECK_THROWS_AS(gemv_range(M, 0, 4, 0, 4, x.data(), y.data()), fn::Error);
}

TEST_CASE("cpu ops: RMSNorm1p scales by (1 + w) after normalising by the root mean square") {
  // x = [2,2,2,2]: rms 2, normalised 1; (1 + w) = [1, 2, 0, 1.5]
  const std::vector<float> x = {2, 2, 2, 2}, w = {0, 1, -1, 0.5f};
  std::vector<float> y(4);
  rms_norm_1p(x.data(), w.data(), 4, 0.0f, y.data());
  check_close(y, {1, 2, 0, 1.5});
  // eps enters inside the rsqrt of the mean: x = [3, 4], mean 12.5
  const std::vector<float> x2 = {3, 4}, w2 = {0, 0};
  std::vector<float> y2(2);
  rms_norm_1p(x2.data(), w2.data(), 2, 0.5f, y2.data());
  check_close(y2, {3 / std::sqrt(13.0), 4 / std::sqrt(13.0)});
}

TEST_CASE("cpu ops: grouped RMSNorm1p takes statistics per group and a full-length weight") {
  // groups [2,2] (rms 2) and [3,-3] (rms 3); weights differ per element of the full length
  const std::vector<float> x = {2, 2, 3, -3}, w = {0, 1, 0, 1};
  std::vector<float> y(4);
  group_rms_norm_1p(x.data(), w.data(), 4, 2, 0.0f, y.data());
  check_close(y, {1, 2, 1, -2});
  CHECK_THROWS_AS(group_rms_norm_1p(x.data(), w.data(), 4, 3, 0.0f, y.data()), fn::Error);
}

TEST_CASE("cpu ops: the GDN gated norm uses the plain weight and a sigmoid gate") {
  // o = [2,2] -> normalised [1,1]; w = [0.5, 3]; gate sigmoid(0) = 0.5, sigmoid(ln 3) = 0.75
  const std::vector<float> o = {2, 2}, w = {0.5f, 3}, z = {0, std::log(3.0f)};
  std::vector<float> y(2);
  gated_rms_norm(o.data(), w.data(), z.data(), 2, 0.0f, y.data());
  check_close(y, {0.25, 2.25});
}

TEST_CASE("cpu ops: partial NeoX RoPE rotates pairs (i, i + rotary_dim/2) and passes the rest") {
  // rotary_dim 4, theta 1e4: inv_freq = [1, 1e4^(-1/2) = 0.01]; position 1 -> angles [1, 0.01]
  std::vector<float> x = {1, 2, 3, 4, 5};
  rope_neox(x.data(), 4, 1e4, 1);
  check_close(x,
              {1 * std::cos(1.0) - 3 * std::sin(1.0), 2 * std::cos(0.01) - 4 * std::sin(0.01),
               3 * std::cos(1.0) + 1 * std::sin(1.0), 4 * std::cos(0.01) + 2 * std::sin(0.01), 5},
              1e-5);
  // position 0 is the identity
  std::vector<float> y = {1, 2, 3, 4, 5};
  rope_neox(y.data(), 4, 1e4, 0);
  check_close(y, {1, 2, 3, 4, 5});
  // the real model's geometry: rotary 64 of 256, theta 1e7; frequency i = 31 at t = 1000
  std::vector<float> z(256, 0.0f);
  z[31] = 1.0f;
  rope_neox(z.data(), 64, 1e7, 1000);
  const double phi = 1000.0 * std::pow(1e7, -31.0 / 32.0);
  CHECK(z[31] == Approx(std::cos(phi)).epsilon(1e-6));
  CHECK(z[63] == Approx(std::sin(phi)).epsilon(1e-6));
  for (int i = 64; i < 256; ++i) CHECK(z[i] == 0.0f);
}

TEST_CASE("cpu ops: HC read divides by hc_count before SiLU, averages streams, and injects") {
  // hc_count 2, D 2, r 1. H = [2,2 | 3,-3], w_norm = 0 -> N = [1,1 | 1,-1].
  const std::vector<float> H = {2, 2, 3, -3}, wn = {0, 0, 0, 0};
  // W_dn = [1,1,1,1]: W_dn N = 2, / 2 = 1, u = silu(1).
  const std::vector<float> Wdn = {1, 1, 1, 1};
  // W_up = [a,0,0,0]^T with a*u = ln 3: G = [0.75, 0.5, 0.5, 0.5].
  const float a = std::log(3.0f) / silu(1.0f);
  const std::vector<float> Wup = {a, 0, 0, 0};
  // W_inj = [[1,1,1,1],[0,0,0,0]]: iota = [2 sigmoid(2/2), 2 sigmoid(0)] = [2 sigmoid(1), 1].
  const std::vector<float> Winj = {1, 1, 1, 1, 0, 0, 0, 0};
  DenseMatrix dn(Wdn.data(), 1, 4), up(Wup.data(), 4, 1), inj(Winj.data(), 2, 4);
  std::vector<float> m(2), iota(2);
  hc_read(H.data(), 2, 2, wn.data(), dn, up, &inj, 0.0f, m.data(), iota.data());
  // m_0 = (0.75*1 + 0.5*1)/2 = 0.625; m_1 = (0.5*1 + 0.5*-1)/2 = 0
  check_close(m, {0.625, 0.0});
  check_close(iota, {2.0 / (1.0 + std::exp(-1.0)), 1.0});
  // The final mixer form (no inject) leaves iota alone.
  std::vector<float> m2(2), iota2 = {-7, -7};
  hc_read(H.data(), 2, 2, wn.data(), dn, up, nullptr, 0.0f, m2.data(), iota2.data());
  check_close(m2, {0.625, 0.0});
  check_close(iota2, {-7, -7});
  // Inject: H[s] += iota_s * y.
  std::vector<float> H2 = H;
  const std::vector<float> io = {0.5f, 2}, y = {4, -1};
  hc_inject(H2.data(), 2, 2, io.data(), y.data());
  check_close(H2, {4, 1.5, 11, -5});
}

TEST_CASE("cpu ops: the causal conv step (K 4, dilation 1) matches the direct convolution") {
  const std::vector<float> w = {0.0001f, 0.001f, 0.01f, 0.1f};
  std::vector<float> state(3, 0.0f), out(1);
  // inputs 1,2,3,4: acc = 0.1 | 0.01+0.2 | 0.001+0.02+0.3 | 0.0001+0.002+0.03+0.4
  const double want[] = {0.1, 0.21, 0.321, 0.4321};
  for (int t = 0; t < 4; ++t) {
    const float x = static_cast<float>(t + 1);
    causal_conv_step(&x, state.data(), w.data(), 1, 4, 1, out.data());
    CHECK(out[0] == Approx(want[t] / (1.0 + std::exp(-want[t]))));
  }
  check_close(state, {2, 3, 4});  // the last 3 pre-conv inputs, oldest first
}

TEST_CASE(
    "cpu ops: the dilated PLE conv (K 4, dilation 3) taps t, t-3, t-6, t-9 with a 9-deep "
    "state") {
  const int C = 2, K = 4, d = 3, T = 14;
  const std::vector<float> w = {0.4f, 0.3f, 0.2f, 0.1f, -0.1f, 0.2f, -0.3f, 0.4f};
  std::vector<float> xs(C * T);
  for (int t = 0; t < T; ++t) {
    xs[t * C + 0] = 0.1f * static_cast<float>(t + 1);
    xs[t * C + 1] = std::sin(static_cast<float>(t));
  }
  std::vector<float> state(C * 9, 0.0f), out(C);
  for (int t = 0; t < T; ++t) {
    causal_conv_step(&xs[t * C], state.data(), w.data(), C, K, d, out.data());
    for (int c = 0; c < C; ++c) {
      // Direct formula over the whole input history; values before t = 0 are zero.
      double acc = 0.0;
      for (int j = 0; j < K; ++j) {
        const int tau = t - d * (K - 1 - j);
        if (tau >= 0) acc += static_cast<double>(w[c * K + j]) * xs[tau * C + c];
      }
      CAPTURE(t);
      CAPTURE(c);
      CHECK(out[c] == Approx(acc / (1.0 + std::exp(-acc))).epsilon(1e-6));
    }
  }
  for (int i = 0; i < 9; ++i) CHECK(state[0 * 9 + i] == xs[(T - 9 + i) * C + 0]);
}

TEST_CASE("cpu ops: GDN gates are sigmoid(b) and -exp(A_log) softplus(a + dt_bias)") {
  const std::vector<float> a = {0, 25}, b = {0, std::log(3.0f)}, A_log = {0, std::log(2.0f)},
                           dt = {0, 0};
  std::vector<float> g(2), beta(2);
  gdn_gates(a.data(), b.data(), A_log.data(), dt.data(), 2, g.data(), beta.data());
  check_close(g, {-std::log(2.0), -50.0});  // softplus(25) = 25 (identity above 20)
  check_close(beta, {0.5, 0.75});
}

TEST_CASE("cpu ops: a 2-value-head GDN step on a 2x2 state matches the hand derivation") {
  // Hk 1, Hv 2, dk = dv = 2. q = [3,4] -> qh = [0.6, 0.8]/sqrt(2); k = [1,0] -> kh = [1, 0].
  const std::vector<float> q = {3, 4}, k = {1, 0};
  const std::vector<float> v = {1, 3, 2, -2};
  const std::vector<float> g = {std::log(0.5f), 0.0f}, beta = {0.5f, 1.0f};
  // head 0: S = [[1,2],[3,4]] (rows kappa); head 1: S = 0
  std::vector<float> S = {1, 2, 3, 4, 0, 0, 0, 0};
  std::vector<float> o(4);
  gdn_recurrent_step(q.data(), k.data(), v.data(), g.data(), beta.data(), 1, 2, 2, 2, S.data(),
                     o.data());
  // head 0: decay 0.5 -> [[0.5,1],[1.5,2]]; r = S^T kh = [0.5, 1]; delta = 0.5([1,3]-[0.5,1]) =
  // [0.25, 1]; S += kh delta^T -> [[0.75, 2],[1.5, 2]]; o = S^T qh = [(0.45+1.2), (1.2+1.6)]/sqrt2
  // head 1: delta = [2,-2]; S = [[2,-2],[0,0]]; o = [1.2, -1.2]/sqrt2
  check_close(S, {0.75, 2, 1.5, 2, 2, -2, 0, 0}, 1e-5);
  check_close(o, {1.65 / kSqrt2, 2.8 / kSqrt2, 1.2 / kSqrt2, -1.2 / kSqrt2}, 1e-5);
}

TEST_CASE("cpu ops: GDN value head h uses key head h / (Hv/Hk) (repeat-interleave, not tile)") {
  // Hk 2, Hv 4, dk = dv = 2, zero state, g = 0, beta = 1: S_h = kh_i v_h^T, o_h = v_h (kh_i .
  // qh_i). key 0: k = q = [1,0] -> kh.qh = 1/sqrt2; key 1: k = [0,1], q = [1,0] -> 0.
  const std::vector<float> q = {1, 0, 1, 0}, k = {1, 0, 0, 1};
  const std::vector<float> v = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<float> g(4, 0.0f), beta(4, 1.0f);
  std::vector<float> S(16, 0.0f), o(8);
  gdn_recurrent_step(q.data(), k.data(), v.data(), g.data(), beta.data(), 2, 4, 2, 2, S.data(),
                     o.data());
  check_close(o, {1 / kSqrt2, 2 / kSqrt2, 3 / kSqrt2, 4 / kSqrt2, 0, 0, 0, 0}, 1e-5);
}

TEST_CASE("cpu ops: top-k prefers the higher value, then the lower index") {
  const std::vector<float> v = {0, 1, 0, 1, 0, 0, 1, 0};
  CHECK(top_k(v.data(), 8, 2) == std::vector<int32_t>{1, 3});
  const std::vector<float> zeros(16, 0.0f);
  CHECK(top_k(zeros.data(), 16, 4) == std::vector<int32_t>{0, 1, 2, 3});
  const std::vector<float> w = {0.5f, 2, 2, -1};
  CHECK(top_k(w.data(), 4, 3) == std::vector<int32_t>{1, 2, 0});
  CHECK(top_k(w.data(), 4, 9) == std::vector<int32_t>{1, 2, 0, 3});
  const std::vector<float> bad = {0, NAN};
  CHECK_THROWS_AS(top_k(bad.data(), 2, 1), fn::Error);
}

TEST_CASE(
    "cpu ops: an indexer block key is the mean of raw keys, normed, then roped at the "
    "block start") {
  // rows average to [2, 0, 2, 2]: rms sqrt(3); w = 0; RoPE dims (0,1) at position 4, inv_freq 1.
  const std::vector<float> raw = {1, 0, 2, 2, 3, 0, 2, 2, 2, 1, 2, 2, 2, -1, 2, 2};
  const std::vector<float> w(4, 0.0f);
  std::vector<float> kb(4);
  indexer_block_key(raw.data(), 4, 4, w.data(), 0.0f, 2, 1e4, 4, kb.data());
  const double n = 2 / std::sqrt(3.0);
  check_close(kb, {n * std::cos(4.0), n * std::sin(4.0), n, n}, 1e-5);
}

TEST_CASE("cpu ops: indexer scores are the scaled sum of relu(q_h . k_b) over heads") {
  const std::vector<float> qi = {1, 0, 0, 1};           // 2 heads of 2
  const std::vector<float> kb = {2, -3, -1, -1, 1, 1};  // 3 block keys
  std::vector<float> s(3);
  indexer_scores(qi.data(), 2, kb.data(), 3, 2, s.data());
  check_close(s, {2 / kSqrt2, 0, 2 / kSqrt2});
}

TEST_CASE("cpu ops: QSA selects top blocks plus the tail; a block-closing token can be dropped") {
  // t = 10: 11 visible tokens, 2 complete blocks, tail 8..10.
  const std::vector<float> s2 = {0.1f, 0.7f};
  CHECK(qsa_selected_tokens(s2.data(), 10, 4, 1) == std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10});
  CHECK(qsa_selected_tokens(s2.data(), 10, 4, 8) ==
        std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  // t = 11 closes block 2, which loses to block 1: the current token is not attended.
  const std::vector<float> s3 = {0.1f, 0.7f, 0.2f};
  CHECK(qsa_selected_tokens(s3.data(), 11, 4, 1) == std::vector<int64_t>{4, 5, 6, 7});
  // ties go to the lower block index; the output is ascending.
  const std::vector<float> tie = {0, 0, 0};
  CHECK(qsa_selected_tokens(tie.data(), 12, 4, 2) ==
        std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 12});
  // fewer than ratio tokens: tail only
  CHECK(qsa_selected_tokens(nullptr, 2, 4, 2) == std::vector<int64_t>{0, 1, 2});
}

TEST_CASE("cpu ops: GQA attention softmaxes over the selected tokens of the mapped KV head") {
  // hd 2, 2 KV heads, 3 cached tokens; kv_row = 4 floats (head 0 then head 1).
  // KV head 0: K = [0,0], [50,50] (token 1, never selected), [ln3, 0]; V = [4,0], [99,99], [0,8]
  // KV head 1: K = [0,0], [0,0], [0,0]; V = [2,2], [9,9], [4,-2]
  const float l3 = std::log(3.0f);
  const std::vector<float> K = {0, 0, 0, 0, 50, 50, 0, 0, l3, 0, 0, 0};
  const std::vector<float> V = {4, 0, 2, 2, 99, 99, 9, 9, 0, 8, 4, -2};
  const std::vector<float> q = {1, 0, 0, 1};
  const std::vector<int32_t> kv_of_q = {0, 1};
  const std::vector<int64_t> tokens = {0, 2};
  std::vector<float> o(4);
  gqa_attention(q.data(), 2, kv_of_q.data(), K.data(), V.data(), 4, 2, tokens.data(), 2, 1.0f,
                o.data());
  // head 0: scores [0, ln3] -> p = [1/4, 3/4] -> [1, 6]; head 1: p = [1/2, 1/2] -> [3, 0]
  check_close(o, {1, 6, 3, 0}, 1e-5);
  std::vector<float> gx = {2, 2}, gate = {0, std::log(3.0f)};
  sigmoid_gate_mul(gx.data(), gate.data(), 2, gx.data());
  check_close(gx, {1, 1.5});
}

TEST_CASE(
    "cpu ops: the router takes the softmax over all experts, then top-k, then "
    "renormalises") {
  // p = [1,2,3,4]/10
  const std::vector<float> logits = {0, std::log(2.0f), std::log(3.0f), std::log(4.0f)};
  std::vector<int32_t> ids(2);
  std::vector<float> w(2);
  route_top_k(logits.data(), 4, 2, true, ids.data(), w.data());
  CHECK(ids == std::vector<int32_t>{3, 2});
  check_close(w, {4.0 / 7.0, 3.0 / 7.0});
  route_top_k(logits.data(), 4, 2, false, ids.data(), w.data());
  check_close(w, {0.4, 0.3});  // not a softmax over the top-2 logits (which would be 4/7, 3/7)
  const std::vector<float> tied = {1, 1, 1, 0};
  route_top_k(tied.data(), 4, 2, true, ids.data(), w.data());
  CHECK(ids == std::vector<int32_t>{0, 1});
}

TEST_CASE("cpu ops: the SwiGLU FFN is W_down (silu(W_gate x) * W_up x)") {
  const std::vector<float> Wg = {1, 0, 0, 1}, Wu = {2, 0, 0, 3}, Wd = {1, 1, 1, -1};
  DenseMatrix G(Wg.data(), 2, 2), U(Wu.data(), 2, 2), Dn(Wd.data(), 2, 2);
  const std::vector<float> x = {1, -1};
  std::vector<float> y(2);
  swiglu_ffn(G, U, Dn, x.data(), y.data());
  // h = [silu(1) * 2, silu(-1) * -3]
  const double s1 = 1 / (1 + std::exp(-1.0)), sm1 = -1 / (1 + std::exp(1.0));
  const double h0 = s1 * 2, h1 = sm1 * -3;
  check_close(y, {h0 + h1, h0 - h1});
}

TEST_CASE("cpu ops: the PLE gate is sigmoid of the signed square root, clamped at 1e-6") {
  // S 3, P 4. Stream 0: <K,Q> = 4, /sqrt(4) = 2 -> sqrt 2. Stream 1: <K,Q> = -1e-7 -> -5e-8,
  // clamped to 1e-6 inside the sqrt -> -1e-3. Stream 2: 0 -> sign 0 -> sigmoid(0).
  const std::vector<float> K = {1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0};
  const std::vector<float> Q = {1, 1, 1, 1, -1e-7f, 5, 5, 5, 1, 1, 1, 1};
  const std::vector<float> V = {1, -2, 0.5f, 4};
  std::vector<float> Gv(12);
  ple_gate(K.data(), Q.data(), V.data(), 3, 4, Gv.data());
  const double g0 = 1 / (1 + std::exp(-std::sqrt(2.0))), g1 = 1 / (1 + std::exp(1e-3)), g2 = 0.5;
  check_close(Gv, {g0, -2 * g0, 0.5 * g0, 4 * g0, g1, -2 * g1, 0.5 * g1, 4 * g1, g2, -2 * g2,
                   0.5 * g2, 4 * g2});
}

TEST_CASE("cpu ops: PLE adds Gv plus the conv of the normed gated values to the residual") {
  // S 2, P 2. key_proj = 0 -> K = 0 -> gamma = 0 -> gate 1/2; value_proj = identity -> V = E.
  // E = [1, 2] -> Gv = [0.5, 1, 0.5, 1]; Nc = Gv / sqrt(0.625 + eps) (w = 0); conv taps [0,0,0,1]
  // -> conv = silu(Nc) on the first step (eps 1e-6 inside every rsqrt). H = 1 + Gv + conv.
  const std::vector<float> Wk(8, 0.0f), Wv = {1, 0, 0, 1};
  DenseMatrix key(Wk.data(), 4, 2), val(Wv.data(), 2, 2);
  const std::vector<float> zeros(4, 0.0f);
  const std::vector<float> conv = {0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1};
  PleWeights pw{&key, &val, zeros.data(), zeros.data(), zeros.data(), conv.data(), 4, 3};
  std::vector<float> state(4 * 9, 0.0f), H(4, 1.0f);
  const std::vector<float> E = {1, 2};
  ple_apply(E.data(), pw, 2, 2, 1e-6f, state.data(), H.data());  // eps keeps K = 0 finite
  std::vector<double> want(4);
  const double gv[4] = {0.5, 1, 0.5, 1};
  for (int i = 0; i < 4; ++i) {
    const double nc = gv[i] / std::sqrt(0.625 + 1e-6);
    want[i] = 1 + gv[i] + nc / (1 + std::exp(-nc));
  }
  check_close(H, want, 1e-5);
  CHECK(state[8] == Approx(0.5 / std::sqrt(0.625 + 1e-6)));  // the newest history entry is Nc
}

TEST_CASE("cpu ops: QSA with the real budget is exactly dense up to 2051 visible tokens") {
  // indexer_budget 2048, ratio 4: block_topk 512. Every complete block is selected while
  // B = n/4 <= 512, i.e. n <= 2051; from n = 2052 on, some block must drop out.
  for (int64_t n : {100, 1000, 2047, 2048, 2049, 2051, 2052, 2100}) {
    CAPTURE(n);
    const int64_t t = n - 1, B = n / 4;
    std::vector<float> scores(static_cast<std::size_t>(B));
    for (int64_t b = 0; b < B; ++b) scores[b] = std::sin(0.37f * static_cast<float>(b));
    const std::vector<int64_t> sel = qsa_selected_tokens(scores.data(), t, 4, 512);
    if (n <= 2051) {
      REQUIRE(sel.size() == static_cast<std::size_t>(n));
      for (int64_t i = 0; i < n; ++i) CHECK(sel[i] == i);
    } else {
      CHECK(sel.size() == static_cast<std::size_t>(512 * 4 + (n - 4 * B)));
      // the lowest-scoring block is the one left out
      int64_t worst = 0;
      for (int64_t b = 1; b < B; ++b)
        if (scores[b] < scores[worst]) worst = b;
      CHECK(std::find(sel.begin(), sel.end(), 4 * worst) == sel.end());
    }
  }
}
