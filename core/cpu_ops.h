// The FP32 operations of the CPU reference backend (docs/model.md §C), one function per op, on raw
// pointers with explicit sizes. Called by CpuModel (core/cpu_model.h) and by the unit tests; the
// CUDA kernels are checked against the model built from these. Invariants: every op is plain FP32
// storage with FP64 accumulation in dot products and norm statistics (more exact than the FP32
// reference, never less); no op rounds to BF16 (numerics contract below); every op is deterministic
// (fixed summation order); scratch is plain std::vector (clarity over speed); outputs may not alias
// inputs unless documented.
#pragma once

#include <cstdint>
#include <vector>

namespace fn::cpu {

// Numerics contract of the oracle. docs/design.md says "FP32 math; activations BF16 between
// kernels" for the production path. The oracle's acceptance is max |logit - ref| <= 1e-4 * max
// |ref| against a transformers FP32 run, so the oracle rounds nowhere: every activation, cache
// entry and state is FP32. round_to_bf16() below exists for tests that emulate a BF16 path and is
// not called by CpuModel.

/// float -> nearest bfloat16 value (round to nearest even), returned as float. NaN stays NaN.
float round_to_bf16(float x) noexcept;

// ---------------------------------------------------------------------------------------------
// Scalar activations (docs/model.md §C.3, §C.5, §C.6, §C.7).

/// x * sigmoid(x).
float silu(float x) noexcept;
/// 1 / (1 + exp(-x)), stable for large |x|.
float sigmoid(float x) noexcept;
/// log(1 + exp(x)), and exactly x for x > 20 (torch's default threshold; docs/model.md §C.5 step
/// 4).
float softplus(float x) noexcept;

// ---------------------------------------------------------------------------------------------
// Matrices and GEMV.

/// A row-major matrix [rows, cols] whose rows can be produced in FP32 on demand. The CPU model
/// stores weights in their checkpoint dtypes (BF16, NVFP4) and dequantises one row at a time
/// through read_row(); tests use DenseMatrix. `rows()` and `cols()` are the stored (local) shape.
class RowMatrix {
 public:
  virtual ~RowMatrix() = default;
  virtual int64_t rows() const noexcept = 0;
  virtual int64_t cols() const noexcept = 0;
  /// Writes row r (0 <= r < rows()) as cols() floats to out.
  virtual void read_row(int64_t r, float* out) const = 0;
};

/// A non-owning FP32 view: row r starts at data + r * ld (ld >= cols).
class DenseMatrix final : public RowMatrix {
 public:
  DenseMatrix(const float* data, int64_t rows, int64_t cols, int64_t ld = -1) noexcept
      : data_(data), rows_(rows), cols_(cols), ld_(ld < 0 ? cols : ld) {}
  int64_t rows() const noexcept override { return rows_; }
  int64_t cols() const noexcept override { return cols_; }
  void read_row(int64_t r, float* out) const override;

 private:
  const float* data_;
  int64_t rows_, cols_, ld_;
};

/// Dot product of n floats in four interleaved FP64 partial sums (elements i mod 4, combined as
/// (s0 + s1) + (s2 + s3)), returned as float.
float dot(const float* a, const float* b, int64_t n) noexcept;

/// y = W x for a dense FP32 matrix: y[r] = sum_c W[r*ld + c] * x[c], r < rows, c < cols.
/// A row range is W + r0*ld with rows = r1-r0; a column range is W + c0 with x pointing at the
/// matching part of the input (ld stays the full row length). y must not alias x or W.
void gemv(const float* W, int64_t rows, int64_t cols, int64_t ld, const float* x, float* y);

/// y = W x for any RowMatrix (x: W.cols() floats, y: W.rows() floats), one row read at a time.
void gemv(const RowMatrix& W, const float* x, float* y);

/// y[r - row_begin] = sum_{c in [col_begin, col_end)} W[r, c] * x[c - col_begin] for
/// r in [row_begin, row_end): the sub-block of a RowMatrix applied to a sub-vector.
/// Throws fn::Error(Internal) when the ranges leave the matrix.
void gemv_range(const RowMatrix& W, int64_t row_begin, int64_t row_end, int64_t col_begin,
                int64_t col_end, const float* x, float* y);

// ---------------------------------------------------------------------------------------------
// Norms (docs/model.md §C.2).

/// RMSNorm1p: out = x * rsqrt(mean(x^2) + eps) * (1 + w), n elements; out may alias x.
void rms_norm_1p(const float* x, const float* w, int64_t n, float eps, float* out) noexcept;

/// GroupRMSNorm1p: rms_norm_1p applied to each consecutive `group` elements of x (n a multiple of
/// group) with the matching slice of the full-length weight w[n] (10240 distinct values for
/// 4 x 2560; docs/model.md §C.2, §F.1 item 3). out may alias x.
void group_rms_norm_1p(const float* x, const float* w, int64_t n, int64_t group, float eps,
                       float* out);

/// GDN gated output norm of one head (docs/model.md §C.5 step 7): out = o * rsqrt(mean(o^2) + eps)
/// * w
/// * sigmoid(z), n elements, plain weight w (not 1 + w), sigmoid gate (output_gate_type).
/// out may alias o.
void gated_rms_norm(const float* o, const float* w, const float* z, int64_t n, float eps,
                    float* out) noexcept;

// ---------------------------------------------------------------------------------------------
// RoPE (docs/model.md §C.9).

/// NeoX half-split partial RoPE in place on x[0..rotary_dim): for i < rotary_dim/2 the pair is
/// (x_i, x_{i+rotary_dim/2}) rotated by phi_i = position * theta^(-2i/rotary_dim) (inv_freq and
/// the angle in FP32 as the reference computes them). Elements from rotary_dim on are untouched.
/// rotary_dim must be even.
void rope_neox(float* x, int64_t rotary_dim, double theta, int64_t position);

// ---------------------------------------------------------------------------------------------
// Hyper-connections (docs/model.md §C.3).

/// HC read of one module: from the residual H [hc_count * D] (stream-major) compute
///   N = GroupRMSNorm1p(H; w_norm) (group D), u = silu((W_dn N) / hc_count),
///   G = sigmoid(W_up u), m = (1/hc_count) sum_s G_s * N_s          -> m [D]
///   iota = 2 * sigmoid((W_inj N) / hc_count)                      -> iota [hc_count]
/// W_dn: [r, hc_count*D], W_up: [hc_count*D, r], W_inj: [hc_count, hc_count*D] or nullptr (the
/// final mixer has no inject; iota is then not written and may be nullptr).
void hc_read(const float* H, int64_t hc_count, int64_t D, const float* w_norm,
             const RowMatrix& W_dn, const RowMatrix& W_up, const RowMatrix* W_inj, float eps,
             float* m, float* iota);

/// HC inject: H[s*D + i] += iota[s] * y[i] for every stream s (docs/model.md §C.3, after the
/// block).
void hc_inject(float* H, int64_t hc_count, int64_t D, const float* iota, const float* y) noexcept;

// ---------------------------------------------------------------------------------------------
// Causal depthwise convolutions (docs/model.md §C.5 step 2, §C.4 step 7).

/// One step of a causal depthwise conv with SiLU, dilation d, no bias, over C channels:
///   out[c] = silu( sum_{j<K-1} w[c*K + j] * hist_c(t - d*(K-1-j)) + w[c*K + K-1] * x[c] )
/// then x is shifted into the history. The state holds the last L = (K-1)*d inputs of each channel,
/// oldest first: state[c*L + i] is the input at t - L + i (zeros before the first token).
/// GDN: K = 4, d = 1 (L = 3, pre-conv qkv). PLE: K = 4, d = 3 (L = 9, the normed gated values).
/// x and out must not alias the state; out may alias x.
void causal_conv_step(const float* x, float* state, const float* w, int64_t C, int64_t K,
                      int64_t dilation, float* out);

// ---------------------------------------------------------------------------------------------
// Gated DeltaNet (docs/model.md §C.5).

/// Step 4: per value head h: beta[h] = sigmoid(b[h]); g[h] = -exp(A_log[h]) * softplus(a[h] +
/// dt_bias[h]). All arrays [Hv].
void gdn_gates(const float* a, const float* b, const float* A_log, const float* dt_bias, int64_t Hv,
               float* g, float* beta) noexcept;

/// Steps 5-6 for Hv value heads with Hk key heads (Hv a multiple of Hk; value head h uses key
/// head h / (Hv/Hk), repeat-interleave). q, k: [Hk, dk] (conv output), v: [Hv, dv],
/// g, beta: [Hv], state: [Hv, dk, dv] FP32 oriented [k, v] (updated in place), out: [Hv, dv].
///   qh = q_i * rsqrt(sum q_i^2 + 1e-6) / sqrt(dk);  kh = k_i * rsqrt(sum k_i^2 + 1e-6)
///   S *= exp(g_h); r = S^T kh; delta = beta_h * (v_h - r); S += kh delta^T; out_h = S^T qh.
void gdn_recurrent_step(const float* q, const float* k, const float* v, const float* g,
                        const float* beta, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                        float* state, float* out);

// ---------------------------------------------------------------------------------------------
// Top-k (docs/model.md §F.1 item 15).

/// Indices of the k largest of v[0..n), best first. Deterministic tie rule: the higher value wins,
/// and among equal values the LOWER index wins (so the result is identical on every rank and
/// every run; where a reference breaks an exact tie differently, exact-tie cases may legitimately
/// differ from it). k is clamped to n. Throws fn::Error(Format) on a NaN score (it comes from
/// NaN/Inf weights).
std::vector<int32_t> top_k(const float* v, int64_t n, int64_t k);

// ---------------------------------------------------------------------------------------------
// QSA (docs/model.md §C.6).

/// Indexer block key (step 5): kb = RoPE_{block_start}( RMSNorm1p( mean_{i<ratio} raw[i]; w_kln ) )
/// where raw is [ratio, ihd] (the raw indexer keys of the block, row stride ihd), mean in FP32
/// (FP64 accumulation), RoPE on dims [0, rotary_dim) at position block_start = 4b.
void indexer_block_key(const float* raw, int64_t ratio, int64_t ihd, const float* w_kln, float eps,
                       int64_t rotary_dim, double theta, int64_t block_start, float* out);

/// Indexer scores (step 5): score[b] = (1/sqrt(ihd)) * sum_h relu(qi_h . kb_b) for n_heads query
/// heads qi [n_heads, ihd] and B block keys kb [B, ihd].
void indexer_scores(const float* qi, int64_t n_heads, const float* kb, int64_t B, int64_t ihd,
                    float* scores);

/// The token positions query t attends to (step 5), ascending: with n = t + 1 visible tokens and
/// B = n / ratio complete blocks, every token of the top-min(block_topk, B) blocks by `scores`
/// (B values; top_k's tie rule) and the tail tokens ratio*B .. t.
std::vector<int64_t> qsa_selected_tokens(const float* scores, int64_t t, int64_t ratio,
                                         int64_t block_topk);

/// Attention of n_q query heads over the selected tokens (step 6), GQA: local query head i uses
/// local KV head kv_of_q[i]. q: [n_q, hd]; K, V: caches with row stride kv_row (floats per cached
/// token) where KV head j of token tau starts at tau*kv_row + j*hd. scores = q.k * scale (scale =
/// 1/sqrt(hd)), softmax in FP32 over the tokens, out_i = sum p_tau v_tau. out: [n_q, hd].
void gqa_attention(const float* q, int64_t n_q, const int32_t* kv_of_q, const float* K,
                   const float* V, int64_t kv_row, int64_t hd, const int64_t* tokens,
                   int64_t n_tokens, float scale, float* out);

/// out[i] = x[i] * sigmoid(gate[i]), n elements (QSA output gate, step 7). out may alias x.
void sigmoid_gate_mul(const float* x, const float* gate, int64_t n, float* out) noexcept;

// ---------------------------------------------------------------------------------------------
// MoE (docs/model.md §C.7).

/// Router (step 1): p = softmax(logits) over all n_experts, the top-k (top_k's tie rule), then
/// w = p_sel / sum p_sel when norm_topk_prob. ids and weights get k entries, best first.
void route_top_k(const float* logits, int64_t n_experts, int64_t k, bool norm_topk_prob,
                 int32_t* ids, float* weights);

/// SwiGLU FFN (step 2/3): y = W_down (silu(W_gate x) * (W_up x)). W_gate, W_up: [I, D],
/// W_down: [D_out, I]. Works on TP slices (I = the rank's rows; y is then a partial sum).
void swiglu_ffn(const RowMatrix& W_gate, const RowMatrix& W_up, const RowMatrix& W_down,
                const float* x, float* y);

// ---------------------------------------------------------------------------------------------
// PLE (docs/model.md §C.4).

/// Signed-square-root gate (steps 4-5): for each stream s < S of K, Q [S, P]:
/// gamma = <K_s, Q_s> / sqrt(P), gt = sign(gamma) * sqrt(max(|gamma|, 1e-6)) (sign(0) = 0),
/// Gv[s*P + i] = sigmoid(gt) * V[i].  Gv: [S, P].
/// gamma_out (optional, [S]) receives gamma of every stream (tests use it to find the
/// ill-conditioned cusp of sign(gamma)·sqrt|gamma| at 0).
void ple_gate(const float* K, const float* Q, const float* V, int64_t S, int64_t P, float* Gv,
              float* gamma_out = nullptr);

/// PLE weights of one layer as the math needs them (docs/model.md §B.2, layer 1).
struct PleWeights {
  const RowMatrix* key_proj;    ///< [S*P, P]
  const RowMatrix* value_proj;  ///< [D, P] (D == P)
  const float* norm_key;        ///< [S*P] (1 + w)
  const float* norm_query;      ///< [S*D] (1 + w)
  const float* norm_conv;       ///< [S*P] (1 + w)
  const float* conv;            ///< [S*P, K] dilated conv taps
  int64_t conv_kernel;          ///< K (ple_conv_kernel_size)
  int64_t dilation;             ///< ngram_size
};

/// PLE steps 2-8 given the gathered n-gram embedding E_ng [P] (step 1, already summed over ranks):
/// K = GroupRMSNorm1p(key_proj E_ng; norm_key), V = value_proj E_ng, Q = GroupRMSNorm1p(H;
/// norm_query), Gv = ple_gate(K, Q, V), Nc = GroupRMSNorm1p(Gv; norm_conv), conv = dilated conv
/// step of Nc (state [S*P, (K-1)*dilation], updated), then H += Gv + conv. H: [S*P] (P == D).
/// gamma_out: as ple_gate's (optional, [S]).
void ple_apply(const float* E_ng, const PleWeights& w, int64_t S, int64_t P, float eps,
               float* conv_state, float* H, float* gamma_out = nullptr);

}  // namespace fn::cpu
