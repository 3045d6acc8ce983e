// FP32 reference operations of docs/model.md §C; see cpu_ops.h for the contract of each.
#include "core/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/error.h"

namespace fn::cpu {

float round_to_bf16(float x) noexcept {
  if (std::isnan(x)) return x;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t lsb = (bits >> 16) & 1u;
  bits += 0x7FFFu + lsb;  // round to nearest, ties to even
  bits &= 0xFFFF0000u;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

float silu(float x) noexcept {
  return x * sigmoid(x);
}

float sigmoid(float x) noexcept {
  // Two branches so exp never overflows: for x >= 0 exp(-x) <= 1, for x < 0 exp(x) < 1.
  if (x >= 0.0f) return 1.0f / (1.0f + std::exp(-x));
  const float e = std::exp(x);
  return e / (1.0f + e);
}

float softplus(float x) noexcept {
  return x > 20.0f ? x : std::log1p(std::exp(x));
}

// ---------------------------------------------------------------------------------------------

void DenseMatrix::read_row(int64_t r, float* out) const {
  std::memcpy(out, data_ + r * ld_, sizeof(float) * static_cast<size_t>(cols_));
}

float dot(const float* a, const float* b, int64_t n) noexcept {
  // Four independent FP64 chains (elements i mod 4), summed at the end: the same fixed order on
  // every rank and every run, and four times the throughput of one dependent chain.
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    acc[0] += static_cast<double>(a[i]) * b[i];
    acc[1] += static_cast<double>(a[i + 1]) * b[i + 1];
    acc[2] += static_cast<double>(a[i + 2]) * b[i + 2];
    acc[3] += static_cast<double>(a[i + 3]) * b[i + 3];
  }
  for (; i < n; ++i) acc[0] += static_cast<double>(a[i]) * b[i];
  return static_cast<float>((acc[0] + acc[1]) + (acc[2] + acc[3]));
}

void gemv(const float* W, int64_t rows, int64_t cols, int64_t ld, const float* x, float* y) {
  for (int64_t r = 0; r < rows; ++r) y[r] = dot(W + r * ld, x, cols);
}

void gemv(const RowMatrix& W, const float* x, float* y) {
  gemv_range(W, 0, W.rows(), 0, W.cols(), x, y);
}

void gemv_range(const RowMatrix& W, int64_t row_begin, int64_t row_end, int64_t col_begin,
                int64_t col_end, const float* x, float* y) {
  FN_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= W.rows() && 0 <= col_begin &&
               col_begin <= col_end && col_end <= W.cols(),
           "gemv_range: rows [{}, {}) cols [{}, {}) outside a [{}, {}] matrix", row_begin, row_end,
           col_begin, col_end, W.rows(), W.cols());
  std::vector<float> row(static_cast<size_t>(W.cols()));
  for (int64_t r = row_begin; r < row_end; ++r) {
    W.read_row(r, row.data());
    y[r - row_begin] = dot(row.data() + col_begin, x, col_end - col_begin);
  }
}

// ---------------------------------------------------------------------------------------------

namespace {
// rsqrt(mean(x^2) + eps) with the statistic accumulated in FP64.
float inv_rms(const float* x, int64_t n, float eps) noexcept {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>(ss / static_cast<double>(n));
  return 1.0f / std::sqrt(mean + eps);
}
}  // namespace

void rms_norm_1p(const float* x, const float* w, int64_t n, float eps, float* out) noexcept {
  const float s = inv_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * s * (1.0f + w[i]);
}

void group_rms_norm_1p(const float* x, const float* w, int64_t n, int64_t group, float eps,
                       float* out) {
  FN_CHECK(group > 0 && n % group == 0, "group_rms_norm_1p: n={} not a multiple of group={}", n,
           group);
  for (int64_t g0 = 0; g0 < n; g0 += group) rms_norm_1p(x + g0, w + g0, group, eps, out + g0);
}

void gated_rms_norm(const float* o, const float* w, const float* z, int64_t n, float eps,
                    float* out) noexcept {
  const float s = inv_rms(o, n, eps);
  for (int64_t i = 0; i < n; ++i) out[i] = o[i] * s * w[i] * sigmoid(z[i]);
}

// ---------------------------------------------------------------------------------------------

void rope_neox(float* x, int64_t rotary_dim, double theta, int64_t position) {
  FN_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "rope_neox: rotary_dim {} must be even",
           rotary_dim);
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    // The reference: inv_freq = 1 / theta^(2i/rotary_dim) as FP32, angle = FP32 product.
    const float inv_freq = static_cast<float>(
        1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim)));
    const float phi = static_cast<float>(position) * inv_freq;
    const float c = std::cos(phi), s = std::sin(phi);
    const float a = x[i], b = x[i + half];
    x[i] = a * c - b * s;
    x[i + half] = b * c + a * s;
  }
}

// ---------------------------------------------------------------------------------------------

void hc_read(const float* H, int64_t hc_count, int64_t D, const float* w_norm,
             const RowMatrix& W_dn, const RowMatrix& W_up, const RowMatrix* W_inj, float eps,
             float* m, float* iota) {
  const int64_t W = hc_count * D;
  FN_CHECK(W_dn.cols() == W && W_up.rows() == W && W_up.cols() == W_dn.rows(),
           "hc_read: W_dn [{}, {}] / W_up [{}, {}] do not fit width {}", W_dn.rows(), W_dn.cols(),
           W_up.rows(), W_up.cols(), W);
  const float inv_s = 1.0f / static_cast<float>(hc_count);
  // 1. N = GroupRMSNorm1p(H; w_norm), per stream of D.
  std::vector<float> N(static_cast<size_t>(W));
  group_rms_norm_1p(H, w_norm, W, D, eps, N.data());
  // 2. u = silu((W_dn N) / hc_count): the division comes before the SiLU.
  std::vector<float> u(static_cast<size_t>(W_dn.rows()));
  gemv(W_dn, N.data(), u.data());
  for (float& v : u) v = silu(v * inv_s);
  // 3. G = sigmoid(W_up u).
  std::vector<float> G(static_cast<size_t>(W));
  gemv(W_up, u.data(), G.data());
  // 4. m = mean over streams of G_s * N_s.
  for (int64_t i = 0; i < D; ++i) {
    double acc = 0.0;
    for (int64_t s = 0; s < hc_count; ++s) acc += sigmoid(G[s * D + i]) * N[s * D + i];
    m[i] = static_cast<float>(acc) * inv_s;
  }
  // 5. iota = 2 * sigmoid((W_inj N) / hc_count), from the pre-block normalized N.
  if (W_inj != nullptr) {
    FN_CHECK(W_inj->rows() == hc_count && W_inj->cols() == W, "hc_read: W_inj is [{}, {}]",
             W_inj->rows(), W_inj->cols());
    gemv(*W_inj, N.data(), iota);
    for (int64_t s = 0; s < hc_count; ++s) iota[s] = 2.0f * sigmoid(iota[s] * inv_s);
  }
}

void hc_inject(float* H, int64_t hc_count, int64_t D, const float* iota, const float* y) noexcept {
  for (int64_t s = 0; s < hc_count; ++s)
    for (int64_t i = 0; i < D; ++i) H[s * D + i] += iota[s] * y[i];
}

// ---------------------------------------------------------------------------------------------

void causal_conv_step(const float* x, float* state, const float* w, int64_t C, int64_t K,
                      int64_t dilation, float* out) {
  FN_CHECK(K >= 1 && dilation >= 1, "causal_conv_step: K={} dilation={}", K, dilation);
  const int64_t L = (K - 1) * dilation;
  for (int64_t c = 0; c < C; ++c) {
    float* hist = state + c * L;  // hist[i] = input at t - L + i
    const float* wc = w + c * K;
    const float xc = x[c];
    double acc = static_cast<double>(wc[K - 1]) * xc;
    for (int64_t j = 0; j + 1 < K; ++j)
      acc += static_cast<double>(wc[j]) * hist[L - dilation * (K - 1 - j)];
    // Shift: drop the oldest, append the current input.
    if (L > 0) {
      std::memmove(hist, hist + 1, sizeof(float) * static_cast<size_t>(L - 1));
      hist[L - 1] = xc;
    }
    out[c] = silu(static_cast<float>(acc));
  }
}

// ---------------------------------------------------------------------------------------------

void gdn_gates(const float* a, const float* b, const float* A_log, const float* dt_bias, int64_t Hv,
               float* g, float* beta) noexcept {
  for (int64_t h = 0; h < Hv; ++h) {
    beta[h] = sigmoid(b[h]);
    g[h] = -std::exp(A_log[h]) * softplus(a[h] + dt_bias[h]);
  }
}

void gdn_recurrent_step(const float* q, const float* k, const float* v, const float* g,
                        const float* beta, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                        float* state, float* out) {
  FN_CHECK(Hk > 0 && Hv % Hk == 0, "gdn_recurrent_step: Hv={} not a multiple of Hk={}", Hv, Hk);
  const int64_t ratio = Hv / Hk;
  // Step 5: l2-normalise q and k per key head; eps inside the rsqrt of the sum.
  std::vector<float> qh(static_cast<size_t>(Hk * dk)), kh(static_cast<size_t>(Hk * dk));
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t i = 0; i < Hk; ++i) {
    const float* qi = q + i * dk;
    const float* ki = k + i * dk;
    const float rq = 1.0f / std::sqrt(dot(qi, qi, dk) + 1e-6f);
    const float rk = 1.0f / std::sqrt(dot(ki, ki, dk) + 1e-6f);
    for (int64_t d = 0; d < dk; ++d) {
      qh[i * dk + d] = qi[d] * rq * q_scale;
      kh[i * dk + d] = ki[d] * rk;
    }
  }
  // Step 6: the delta rule, per value head, state S[kappa, nu].
  std::vector<double> r(static_cast<size_t>(dv));
  for (int64_t h = 0; h < Hv; ++h) {
    const int64_t i = h / ratio;  // repeat-interleave: value heads 3i, 3i+1, 3i+2 share key i
    const float* kv = kh.data() + i * dk;
    const float* qv = qh.data() + i * dk;
    const float* vh = v + h * dv;
    float* S = state + h * dk * dv;
    const float decay = std::exp(g[h]);
    for (int64_t e = 0; e < dk * dv; ++e) S[e] *= decay;  // decay before reading the memory
    std::fill(r.begin(), r.end(), 0.0);
    for (int64_t kk = 0; kk < dk; ++kk)
      for (int64_t nu = 0; nu < dv; ++nu) r[nu] += static_cast<double>(S[kk * dv + nu]) * kv[kk];
    for (int64_t nu = 0; nu < dv; ++nu) r[nu] = beta[h] * (vh[nu] - static_cast<float>(r[nu]));
    for (int64_t kk = 0; kk < dk; ++kk)
      for (int64_t nu = 0; nu < dv; ++nu) S[kk * dv + nu] += kv[kk] * static_cast<float>(r[nu]);
    float* o = out + h * dv;
    std::fill(r.begin(), r.end(), 0.0);
    for (int64_t kk = 0; kk < dk; ++kk)
      for (int64_t nu = 0; nu < dv; ++nu) r[nu] += static_cast<double>(S[kk * dv + nu]) * qv[kk];
    for (int64_t nu = 0; nu < dv; ++nu) o[nu] = static_cast<float>(r[nu]);
  }
}

// ---------------------------------------------------------------------------------------------

std::vector<int32_t> top_k(const float* v, int64_t n, int64_t k) {
  // NaN scores come from NaN/Inf weights (they pass every dtype and shape check): report them as
  // bad input where they surface (router or indexer), not as an internal error.
  for (int64_t i = 0; i < n; ++i) {
    FN_REQUIRE(!std::isnan(v[i]), Format,
               "top-k selection (router or indexer) got a NaN score at index {}: the checkpoint's "
               "weights hold NaN/Inf or overflow",
               i);
  }
  k = std::clamp<int64_t>(k, 0, n);
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [v](int32_t a, int32_t b) {
    if (v[a] != v[b]) return v[a] > v[b];  // higher score first
    return a < b;                          // then lower index
  });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

// ---------------------------------------------------------------------------------------------

void indexer_block_key(const float* raw, int64_t ratio, int64_t ihd, const float* w_kln, float eps,
                       int64_t rotary_dim, double theta, int64_t block_start, float* out) {
  for (int64_t d = 0; d < ihd; ++d) {
    double acc = 0.0;
    for (int64_t i = 0; i < ratio; ++i) acc += raw[i * ihd + d];
    out[d] = static_cast<float>(acc / static_cast<double>(ratio));
  }
  rms_norm_1p(out, w_kln, ihd, eps, out);
  rope_neox(out, rotary_dim, theta, block_start);
}

void indexer_scores(const float* qi, int64_t n_heads, const float* kb, int64_t B, int64_t ihd,
                    float* scores) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(ihd));
  for (int64_t b = 0; b < B; ++b) {
    double acc = 0.0;
    for (int64_t h = 0; h < n_heads; ++h)
      acc += std::max(0.0f, dot(qi + h * ihd, kb + b * ihd, ihd));
    scores[b] = static_cast<float>(acc * scale);
  }
}

std::vector<int64_t> qsa_selected_tokens(const float* scores, int64_t t, int64_t ratio,
                                         int64_t block_topk) {
  const int64_t n = t + 1;
  const int64_t B = n / ratio;
  std::vector<int64_t> tokens;
  if (B > 0) {
    std::vector<int32_t> sel = top_k(scores, B, std::min(block_topk, B));
    std::sort(sel.begin(), sel.end());
    for (int32_t b : sel)
      for (int64_t i = 0; i < ratio; ++i) tokens.push_back(int64_t{b} * ratio + i);
  }
  for (int64_t tau = B * ratio; tau <= t; ++tau) tokens.push_back(tau);
  return tokens;
}

void gqa_attention(const float* q, int64_t n_q, const int32_t* kv_of_q, const float* K,
                   const float* V, int64_t kv_row, int64_t hd, const int64_t* tokens,
                   int64_t n_tokens, float scale, float* out) {
  FN_CHECK(n_tokens > 0, "gqa_attention: no token selected");
  std::vector<float> p(static_cast<size_t>(n_tokens));
  std::vector<double> acc(static_cast<size_t>(hd));
  for (int64_t h = 0; h < n_q; ++h) {
    const float* qh = q + h * hd;
    const int64_t j = kv_of_q[h];
    float mx = -INFINITY;
    for (int64_t n = 0; n < n_tokens; ++n) {
      p[n] = dot(qh, K + tokens[n] * kv_row + j * hd, hd) * scale;
      mx = std::max(mx, p[n]);
    }
    double sum = 0.0;
    for (int64_t n = 0; n < n_tokens; ++n) {
      p[n] = std::exp(p[n] - mx);
      sum += p[n];
    }
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t n = 0; n < n_tokens; ++n) {
      const float* vt = V + tokens[n] * kv_row + j * hd;
      const double pn = p[n] / sum;
      for (int64_t d = 0; d < hd; ++d) acc[d] += pn * vt[d];
    }
    for (int64_t d = 0; d < hd; ++d) out[h * hd + d] = static_cast<float>(acc[d]);
  }
}

void sigmoid_gate_mul(const float* x, const float* gate, int64_t n, float* out) noexcept {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * sigmoid(gate[i]);
}

// ---------------------------------------------------------------------------------------------

void route_top_k(const float* logits, int64_t n_experts, int64_t k, bool norm_topk_prob,
                 int32_t* ids, float* weights) {
  FN_CHECK(k > 0 && k <= n_experts, "route_top_k: k={} of {} experts", k, n_experts);
  // Softmax over all experts (docs/model.md §F.1 item 16), in FP32 values with an FP64 sum.
  std::vector<float> p(static_cast<size_t>(n_experts));
  const float mx = *std::max_element(logits, logits + n_experts);
  double sum = 0.0;
  for (int64_t e = 0; e < n_experts; ++e) {
    p[e] = std::exp(logits[e] - mx);
    sum += p[e];
  }
  for (float& v : p) v = static_cast<float>(v / sum);
  const std::vector<int32_t> sel = top_k(p.data(), n_experts, k);
  double sel_sum = 0.0;
  for (int64_t i = 0; i < k; ++i) sel_sum += p[sel[i]];
  for (int64_t i = 0; i < k; ++i) {
    ids[i] = sel[i];
    weights[i] = norm_topk_prob ? static_cast<float>(p[sel[i]] / sel_sum) : p[sel[i]];
  }
}

void swiglu_ffn(const RowMatrix& W_gate, const RowMatrix& W_up, const RowMatrix& W_down,
                const float* x, float* y) {
  const int64_t I = W_gate.rows();
  FN_CHECK(W_up.rows() == I && W_down.cols() == I && W_up.cols() == W_gate.cols(),
           "swiglu_ffn: gate [{}, {}], up [{}, {}], down [{}, {}] do not fit", I, W_gate.cols(),
           W_up.rows(), W_up.cols(), W_down.rows(), W_down.cols());
  std::vector<float> g(static_cast<size_t>(I)), u(static_cast<size_t>(I));
  gemv(W_gate, x, g.data());
  gemv(W_up, x, u.data());
  for (int64_t i = 0; i < I; ++i) g[i] = silu(g[i]) * u[i];
  gemv(W_down, g.data(), y);
}

// ---------------------------------------------------------------------------------------------

void ple_gate(const float* K, const float* Q, const float* V, int64_t S, int64_t P, float* Gv,
              float* gamma_out) {
  const double inv_sqrt_p = 1.0 / std::sqrt(static_cast<double>(P));
  for (int64_t s = 0; s < S; ++s) {
    const float gamma = static_cast<float>(dot(K + s * P, Q + s * P, P) * inv_sqrt_p);
    if (gamma_out) gamma_out[s] = gamma;
    const float sign = gamma > 0.0f ? 1.0f : (gamma < 0.0f ? -1.0f : 0.0f);
    const float gt = sign * std::sqrt(std::max(std::fabs(gamma), 1e-6f));
    const float gate = sigmoid(gt);
    for (int64_t i = 0; i < P; ++i) Gv[s * P + i] = gate * V[i];
  }
}

void ple_apply(const float* E_ng, const PleWeights& w, int64_t S, int64_t P, float eps,
               float* conv_state, float* H, float* gamma_out) {
  const int64_t W = S * P;
  FN_CHECK(w.key_proj->rows() == W && w.key_proj->cols() == P && w.value_proj->rows() == P &&
               w.value_proj->cols() == P,
           "ple_apply: key_proj [{}, {}] / value_proj [{}, {}] do not fit S={} P={}",
           w.key_proj->rows(), w.key_proj->cols(), w.value_proj->rows(), w.value_proj->cols(), S,
           P);
  std::vector<float> K(static_cast<size_t>(W)), V(static_cast<size_t>(P)),
      Q(static_cast<size_t>(W)), Gv(static_cast<size_t>(W)), Nc(static_cast<size_t>(W)),
      conv(static_cast<size_t>(W));
  // 2. K and V from the n-gram embedding.
  gemv(*w.key_proj, E_ng, K.data());
  group_rms_norm_1p(K.data(), w.norm_key, W, P, eps, K.data());
  gemv(*w.value_proj, E_ng, V.data());
  // 3. Q from the residual before the addition.
  group_rms_norm_1p(H, w.norm_query, W, P, eps, Q.data());
  // 4-5. Signed-sqrt gate per stream.
  ple_gate(K.data(), Q.data(), V.data(), S, P, Gv.data(), gamma_out);
  // 6. Nc = GroupRMSNorm1p(Gv; norm_conv).
  group_rms_norm_1p(Gv.data(), w.norm_conv, W, P, eps, Nc.data());
  // 7. Dilated causal conv with SiLU over the history of Nc.
  causal_conv_step(Nc.data(), conv_state, w.conv, W, w.conv_kernel, w.dilation, conv.data());
  // 8. H += Gv + conv.
  for (int64_t i = 0; i < W; ++i) H[i] += Gv[i] + conv[i];
}

}  // namespace fn::cpu
