// GPU tests of the PLE kernels (cuda/kernels/ple.h): the n-gram gather against fn::ngram_ids plus
// the table rows (real constants and the tiny fixtures', rows held and not held, EOS contexts), the
// context shift, and ple_apply against fn::cpu::ple_apply and an FP64 evaluation of docs/model.md
// §C.4 steps 2-8 over consecutive steps (dilated conv state carried) with error bounds derived from
// the kernel's rounding steps; CUDA graph replay bitwise equal to eager launches.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "core/config.h"
#include "core/cpu_ops.h"
#include "core/error.h"
#include "core/ngram.h"
#include "cuda/kernels/ple.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;
using fn::test::kFp32Unit;

fn::ModelConfig load(const std::string& rel) {
  return fn::load_model_config(std::string(FN_SOURCE_DIR) + "/" + rel);
}

// The gather's constant part from NgramConstants (the engine fills it the same way).
fn::NgramGatherParams gather_params(const fn::NgramConstants& k, int head_dim) {
  fn::NgramGatherParams p;
  p.ngram_size = int(k.multipliers.size());
  p.num_multipliers = int(k.multipliers.size());
  for (size_t i = 0; i < k.multipliers.size(); ++i) p.multipliers[i] = k.multipliers[i];
  p.num_heads = int(k.head_sizes.size());
  for (size_t h = 0; h < k.head_sizes.size(); ++h) {
    p.head_sizes[h] = k.head_sizes[h];
    p.head_offsets[h] = k.head_offsets[h];
  }
  p.heads_per_ngram = int(k.heads_per_ngram);
  p.head_dim = head_dim;
  p.eos = k.eos;
  return p;
}

// A window of table rows [first_row, first_row + rows.size()/row_bytes) in host memory.
struct Window {
  int64_t first_row = 0, row_count = 0;
  bool fp8 = true;
  std::vector<uint8_t> bytes;
};

Window random_window(int64_t first_row, int64_t row_count, int head_dim, bool fp8, uint64_t seed) {
  Window w{first_row, row_count, fp8, {}};
  w.bytes.resize(size_t(row_count) * head_dim * (fp8 ? 1 : 2));
  std::mt19937_64 rng(seed);
  if (fp8) {
    for (auto& b : w.bytes) b = uint8_t(rng());  // every code, NaN codes included
  } else {
    std::normal_distribution<float> d(0.0f, 0.05f);
    for (size_t i = 0; i < w.bytes.size(); i += 2) {
      const uint16_t b = fn::float_to_bf16(d(rng));
      std::memcpy(&w.bytes[i], &b, 2);
    }
  }
  return w;
}

// CpuModel::ple_step's step 1 on one window: value * scale in FP32 for held ids, else 0.
std::vector<float> gather_reference(const std::vector<int64_t>& ids, const Window& w, int head_dim,
                                    float scale) {
  std::vector<float> out(ids.size() * head_dim, 0.0f);
  for (size_t h = 0; h < ids.size(); ++h) {
    const int64_t r = ids[h] - w.first_row;
    if (r < 0 || r >= w.row_count) continue;
    for (int j = 0; j < head_dim; ++j) {
      const size_t k = size_t(r) * head_dim + j;
      float v;
      if (w.fp8) {
        v = fn::e4m3_to_float(w.bytes[k]);
      } else {
        uint16_t b;
        std::memcpy(&b, &w.bytes[2 * k], 2);
        v = fn::bf16_to_float(b);
      }
      out[h * head_dim + j] = v * scale;
    }
  }
  return out;
}

std::vector<float> run_gather(fn::NgramGatherParams p, const Window& w, float scale,
                              const std::vector<int64_t>& context, int32_t token) {
  DeviceArray<uint8_t> rows(w.bytes);
  DeviceArray<int64_t> ctx(context);
  DeviceArray<int32_t> tok(std::vector<int32_t>{token});
  DeviceArray<float> out(size_t(p.num_heads) * p.head_dim);
  FN_CUDA_CHECK(cudaMemset(out.ptr, 0xff, out.n * 4));
  p.token = tok.ptr;
  p.context = ctx.ptr;
  p.rows = rows.ptr;
  p.first_row = w.first_row;
  p.row_count = w.row_count;
  p.fp8 = w.fp8;
  p.scale = scale;
  p.out = out.ptr;
  fn::launch_ngram_gather(p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  return out.download();
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Kernel vs host reference: every value bitwise equal, except that a NaN (the E4M3 NaN codes
// 0x7f/0xff of the random tables) only has to be a NaN: its payload is not specified (the GPU's
// NaN * scale gives the canonical NaN).
bool same_values(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i]) ? !std::isnan(got[i])
                            : std::memcmp(&got[i], &want[i], sizeof(float)) != 0)
      return false;
  }
  return true;
}

std::vector<int64_t> cpu_ids(const fn::NgramConstants& k, const std::vector<int64_t>& context,
                             int64_t token) {
  std::vector<int64_t> ids(k.head_sizes.size());
  fn::ngram_ids(k, context, token, ids);
  return ids;
}

// The table's BF16 weight_scale (docs/model.md §B.5: about 2e-4) as float.
const float kScale = fn::bf16_to_float(fn::float_to_bf16(2.1e-4f));

}  // namespace

TEST_CASE(
    "cuda ple: the gather of the real constants fetches each head's row (docs/model.md C.4)") {
  const fn::ModelConfig cfg = load("configs/qwen3.8-flash-next.json");
  const fn::NgramConstants k = fn::ngram_constants(cfg, 0);
  const int hd = int(cfg.ngram_head_dim());
  REQUIRE(hd == 160);
  REQUIRE(k.head_sizes.size() == 16);
  const int64_t eos = k.eos;
  // The two test vectors of docs/model.md C.4 pin the CPU ids this test uses as its reference.
  CHECK(cpu_ids(k, {eos, eos}, 9707) ==
        std::vector<int64_t>{16410909, 39682429, 55103279, 60931720, 87006904, 116506179, 131512017,
                             152932897, 169641436, 182022480, 209277433, 237891023, 256841529,
                             277007269, 290665954, 300984276});
  CHECK(cpu_ids(k, {11, eos}, 1234)[15] == 311989426);
  const fn::NgramGatherParams base = gather_params(k, hd);
  struct Ctx {
    int64_t c0, c1;
    int32_t token;
  };
  // EOS contexts, EOS behind the first token only, the EOS token itself, the largest ids.
  const Ctx cases[] = {{eos, eos, 9707},         {11, eos, 1234},      {eos, 5, 77},
                       {248319, 248318, 248317}, {3, 4, int32_t(eos)}, {0, 0, 0}};
  uint64_t seed = 100;
  for (const Ctx& c : cases) {
    const auto ids = cpu_ids(k, {c.c0, c.c1}, c.token);
    for (int h = 0; h < 16; ++h) {
      // A 700-row window somewhere around head h's id: no other head's id falls inside (the
      // heads' ranges are 20M rows apart), so exactly head h is gathered, the rest are zero.
      std::mt19937_64 rng(seed);
      const int64_t before = int64_t(rng() % 700);
      const bool fp8 = (h % 3) != 2;
      const Window w = random_window(ids[h] - before, 700, hd, fp8, seed++);
      const float scale = fp8 ? kScale : 1.0f;
      const auto got = run_gather(base, w, scale, {c.c0, c.c1}, c.token);
      const auto want = gather_reference(ids, w, hd, scale);
      CHECK_MESSAGE(same_values(got, want), "ctx (", c.c0, ", ", c.c1, ") token ", c.token,
                    " head ", h);
      for (int g = 0; g < 16; ++g)
        if (g != h) CHECK(got[size_t(g) * hd] == 0.0f);
    }
    // Window edges: the id as the first row, as the last row, just before and just after.
    const int64_t id = ids[9];
    const int64_t firsts[] = {id, id - 9, id + 1, id - 10};
    for (int64_t f : firsts) {
      const Window w = random_window(f, 10, hd, true, seed++);
      const auto got = run_gather(base, w, kScale, {c.c0, c.c1}, c.token);
      CHECK(same_values(got, gather_reference(ids, w, hd, kScale)));
      const bool held = id >= f && id < f + 10;
      bool any = false;
      for (int j = 0; j < hd; ++j) any = any || got[size_t(9) * hd + j] != 0.0f;
      CHECK(any == held);
    }
  }
}

TEST_CASE("cuda ple: the gather of the tiny fixtures' constants matches over split tables") {
  struct Fixture {
    const char* config;
    int ple_rank;
  };
  for (Fixture fx : {Fixture{"tests/data/fixtures/g3_tiny/config.json", 0},
                     Fixture{"tests/data/fixtures/ple2_long/config.json", 1},
                     Fixture{"tests/data/fixtures/tp4/config.json", 0}}) {
    const fn::ModelConfig cfg = load(fx.config);
    const fn::NgramConstants k = fn::ngram_constants(cfg, fx.ple_rank);
    const int hd = int(cfg.ngram_head_dim());
    const int64_t rows = k.table_rows, eos = k.eos;
    const fn::NgramGatherParams base = gather_params(k, hd);
    // TP=2-like halves of the table and the whole table; FP8 and BF16.
    for (bool fp8 : {true, false}) {
      const float scale = fp8 ? kScale : 1.0f;
      const Window whole = random_window(0, rows, hd, fp8, 7 + fp8);
      Window lo = whole, hi = whole;
      lo.row_count = rows / 2;
      lo.bytes.resize(size_t(lo.row_count) * hd * (fp8 ? 1 : 2));
      hi.first_row = rows / 2;
      hi.row_count = rows - rows / 2;
      hi.bytes.assign(whole.bytes.begin() + lo.bytes.size(), whole.bytes.end());
      std::mt19937_64 rng(cfg.vocab_size + fx.ple_rank);
      for (int t = 0; t < 24; ++t) {
        std::vector<int64_t> ctx = {int64_t(rng() % cfg.vocab_size),
                                    int64_t(rng() % cfg.vocab_size)};
        if (t % 4 == 1) ctx[1] = eos;
        if (t % 4 == 2) ctx[0] = eos;
        if (t % 6 == 3) ctx = {eos, eos};
        const int32_t token = t % 5 == 4 ? int32_t(eos) : int32_t(rng() % cfg.vocab_size);
        const auto ids = cpu_ids(k, ctx, token);
        const auto g_whole = run_gather(base, whole, scale, ctx, token);
        const auto g_lo = run_gather(base, lo, scale, ctx, token);
        const auto g_hi = run_gather(base, hi, scale, ctx, token);
        CHECK_MESSAGE(same_values(g_whole, gather_reference(ids, whole, hd, scale)),
                      std::string(fx.config), " fp8 ", fp8, " t ", t);
        CHECK(same_values(g_lo, gather_reference(ids, lo, hd, scale)));
        CHECK(same_values(g_hi, gather_reference(ids, hi, hd, scale)));
        // The halves partition the whole: their sum (one of them 0) is the whole gather.
        for (size_t i = 0; i < g_whole.size(); ++i)
          if (!std::isnan(g_whole[i])) CHECK(g_lo[i] + g_hi[i] == g_whole[i]);
      }
    }
  }
}

TEST_CASE("cuda ple: the context shift keeps the last raw ids, EOS included") {
  DeviceArray<int64_t> ctx(std::vector<int64_t>{41, 42});
  DeviceArray<int32_t> tok(std::vector<int32_t>{7});
  fn::NgramContextAdvanceParams p{ctx.ptr, 3, tok.ptr};
  fn::launch_ngram_context_advance(p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(ctx.download() == std::vector<int64_t>{42, 7});
  DeviceArray<int64_t> ctx4(std::vector<int64_t>{1, 2, 3});
  DeviceArray<int32_t> big(std::vector<int32_t>{248319});
  fn::launch_ngram_context_advance({ctx4.ptr, 4, big.ptr}, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(ctx4.download() == std::vector<int64_t>{2, 3, 248319});
  CHECK_THROWS_AS(fn::launch_ngram_context_advance({ctx.ptr, 1, tok.ptr}, nullptr), fn::Error);
  CHECK_THROWS_AS(fn::launch_ngram_context_advance({nullptr, 3, tok.ptr}, nullptr), fn::Error);
}

TEST_CASE("cuda ple: a captured gather + shift graph follows a token sequence like the CPU model") {
  const fn::ModelConfig cfg = load("tests/data/fixtures/g3_tiny/config.json");
  const fn::NgramConstants k = fn::ngram_constants(cfg, 0);
  const int hd = int(cfg.ngram_head_dim());
  const Window w = random_window(0, k.table_rows, hd, true, 99);
  DeviceArray<uint8_t> rows(w.bytes);
  DeviceArray<int64_t> ctx(std::vector<int64_t>{k.eos, k.eos});
  DeviceArray<int32_t> tok(1);
  DeviceArray<float> out(k.head_sizes.size() * hd);
  fn::NgramGatherParams p = gather_params(k, hd);
  p.token = tok.ptr;
  p.context = ctx.ptr;
  p.rows = rows.ptr;
  p.row_count = w.row_count;
  p.scale = kScale;
  p.out = out.ptr;
  const fn::NgramContextAdvanceParams a{ctx.ptr, 3, tok.ptr};
  cudaStream_t stream;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  fn::launch_ngram_gather(p, stream);
  fn::launch_ngram_context_advance(a, stream);
  FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // A sequence with EOS at the start, doubled and in the middle (as the fixtures' prompts).
  const std::vector<int32_t> seq = {7, 100, 7, 7, 311, 5, 480, 7, 12, 13, 14, 7, 500, 1, 2};
  std::vector<int64_t> cpu_ctx = {k.eos, k.eos};
  std::vector<std::vector<float>> graph_outs;
  for (int32_t t : seq) {
    tok.upload({t});
    FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    graph_outs.push_back(out.download());
    const auto want = gather_reference(cpu_ids(k, cpu_ctx, t), w, hd, kScale);
    CHECK_MESSAGE(same_values(graph_outs.back(), want), "token ", t);
    cpu_ctx.erase(cpu_ctx.begin());  // CpuModel::ple_step's shift
    cpu_ctx.push_back(t);
    CHECK(ctx.download() == cpu_ctx);
  }
  // The same sequence eagerly from the initial context: bitwise the graph's outputs.
  ctx.upload({k.eos, k.eos});
  for (size_t i = 0; i < seq.size(); ++i) {
    tok.upload({seq[i]});
    fn::launch_ngram_gather(p, stream);
    fn::launch_ngram_context_advance(a, stream);
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    CHECK(bitwise_equal(out.download(), graph_outs[i]));
  }
  FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FN_CUDA_CHECK(cudaGraphDestroy(graph));
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda ple: the gather launcher rejects inconsistent constants") {
  const fn::NgramConstants k = fn::ngram_constants(load("configs/tiny.json"), 0);
  DeviceArray<int64_t> ctx(2);
  DeviceArray<int32_t> tok(1);
  DeviceArray<float> out(64);
  DeviceArray<uint8_t> rows(64);
  fn::NgramGatherParams p = gather_params(k, 8);
  p.token = tok.ptr;
  p.context = ctx.ptr;
  p.out = out.ptr;
  p.rows = rows.ptr;
  p.row_count = 8;
  auto bad = p;
  bad.num_heads = 7;  // not (ngram_size - 1) * heads_per_ngram
  CHECK_THROWS_AS(fn::launch_ngram_gather(bad, nullptr), fn::Error);
  bad = p;
  bad.num_multipliers = 2;
  CHECK_THROWS_AS(fn::launch_ngram_gather(bad, nullptr), fn::Error);
  bad = p;
  bad.eos = -1;  // unset
  CHECK_THROWS_AS(fn::launch_ngram_gather(bad, nullptr), fn::Error);
  bad = p;
  bad.head_sizes[3] = 0;
  CHECK_THROWS_AS(fn::launch_ngram_gather(bad, nullptr), fn::Error);
  bad = p;
  bad.rows = nullptr;
  CHECK_THROWS_AS(fn::launch_ngram_gather(bad, nullptr), fn::Error);
  bad = p;
  bad.fp8 = false;
  bad.rows = rows.ptr + 1;  // BF16 rows must be 2-byte aligned
  CHECK_THROWS_AS(fn::launch_ngram_gather(bad, nullptr), fn::Error);
}

// ---------------------------------------------------------------------------------------------
// ple_apply.

namespace {

constexpr int kApplyThreads = 1024;  // cuda/kernels/ple.cu's block size (sets the summation depth)

double gamma_h(int h) {
  return fn::test::gamma_fp32(h);
}

// sign(x) * sqrt(max(|x|, 1e-6)): monotone non-decreasing (docs/model.md §C.4 step 4).
double ssqrt(double x) {
  const double s = x > 0 ? 1.0 : (x < 0 ? -1.0 : 0.0);
  return s * std::sqrt(std::max(std::fabs(x), 1e-6));
}

// Random PLE weights and per-step inputs of one shape.
struct PleCase {
  int S = 0;
  int64_t P = 0;
  int K = 4, dil = 3;
  std::vector<float> key, value;              // [S*P, P], [P, P]
  std::vector<float> w_nk, w_nq, w_nc, conv;  // [S*P] x3, [S*P, K]
};

PleCase make_case(int S, int64_t P, uint64_t seed) {
  PleCase c;
  c.S = S;
  c.P = P;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  const float ws = 1.0f / std::sqrt(float(P));
  c.key.resize(size_t(S) * P * P);
  c.value.resize(size_t(P) * P);
  for (auto& v : c.key) v = n01(rng) * ws;
  for (auto& v : c.value) v = n01(rng) * ws;
  for (auto* w : {&c.w_nk, &c.w_nq, &c.w_nc}) {
    w->resize(size_t(S) * P);
    for (auto& v : *w) v = 0.3f * n01(rng);
  }
  c.conv.resize(size_t(S) * P * c.K);
  for (auto& v : c.conv) v = 0.5f * n01(rng);
  return c;
}

// FP64 evaluation of steps 2-8 for one step plus the bound of the kernel's deviation from it
// (first-order propagation of every FP32 rounding of cuda/kernels/ple.cu; the CPU op rounds no more
// often). state/state_bound: [S*P, L] the exact Nc history and the bound of the kernel's copy.
struct ExactPle {
  std::vector<double> state, state_bound;
  std::vector<double> H, H_bound;  // the step's output and bound
};

void exact_step(const PleCase& c, const std::vector<float>& kv, const std::vector<float>& Hin,
                ExactPle& x) {
  const int S = c.S, K = c.K, d = c.dil, L = (K - 1) * d;
  const int64_t P = c.P;
  const double u = kFp32Unit;
  const int h_sum = int((P + kApplyThreads - 1) / kApplyThreads) + 5 + kApplyThreads / 32 - 1;
  const double g_sum = gamma_h(h_sum);
  x.H.assign(size_t(S) * P, 0.0);
  x.H_bound.assign(size_t(S) * P, 0.0);
  const double* V = nullptr;
  std::vector<double> Vd(kv.begin() + int64_t(S) * P, kv.end());
  V = Vd.data();
  for (int s = 0; s < S; ++s) {
    const int64_t o = int64_t(s) * P;
    auto inv_rms = [&](double ss, double err_ss, double* rel) {
      const double m = ss / double(P) + 1e-6;
      const double dm = (err_ss / double(P)) / m + 2 * u;
      *rel = dm / 2 + 2 * u;
      return 1.0 / std::sqrt(m);
    };
    double ssk = 0, ssh = 0;
    for (int64_t i = 0; i < P; ++i) {
      ssk += double(kv[o + i]) * kv[o + i];
      ssh += double(Hin[o + i]) * Hin[o + i];
    }
    double rel_sk, rel_sq;
    const double sk = inv_rms(ssk, g_sum * ssk, &rel_sk);
    const double sq = inv_rms(ssh, g_sum * ssh, &rel_sq);
    double D = 0, A = 0;
    for (int64_t i = 0; i < P; ++i) {
      const double kk = kv[o + i] * sk * (1.0 + c.w_nk[o + i]);
      const double qq = Hin[o + i] * sq * (1.0 + c.w_nq[o + i]);
      D += kk * qq;
      A += std::fabs(kk * qq);
    }
    const double err_D = A * ((rel_sk + 3 * u) + (rel_sq + 3 * u) + g_sum);
    const double gam = D / std::sqrt(double(P));
    const double err_gam = err_D / std::sqrt(double(P)) + 2 * u * std::fabs(gam);
    const double gt = ssqrt(gam);
    const double err_gt = std::max(ssqrt(gam + err_gam) - gt, gt - ssqrt(gam - err_gam)) +
                          u * std::sqrt(std::max(std::fabs(gam) + err_gam, 1e-6));
    const double g = 1.0 / (1.0 + std::exp(-gt));
    const double err_g = err_gt / 4 + 6 * u * g;
    std::vector<double> Gv(P), eGv(P);
    double ssg = 0, err_ssg = 0;
    for (int64_t i = 0; i < P; ++i) {
      Gv[i] = g * V[i];
      eGv[i] = err_g * std::fabs(V[i]) + u * std::fabs(Gv[i]);
      ssg += Gv[i] * Gv[i];
      err_ssg += (2 * std::fabs(Gv[i]) + eGv[i]) * eGv[i];
    }
    err_ssg += g_sum * (ssg + err_ssg);
    double rel_sc;
    const double sc = inv_rms(ssg, err_ssg, &rel_sc);
    for (int64_t i = 0; i < P; ++i) {
      const int64_t ch = o + i;
      const double f = sc * (1.0 + c.w_nc[ch]);
      const double nc = Gv[i] * f;
      const double e_nc =
          std::fabs(f) * eGv[i] * (1 + rel_sc + 3 * u) + std::fabs(nc) * (rel_sc + 3 * u);
      double* st = &x.state[size_t(ch) * L];
      double* sb = &x.state_bound[size_t(ch) * L];
      const float* w = &c.conv[size_t(ch) * K];
      double acc = double(w[K - 1]) * nc, mag = std::fabs(w[K - 1] * nc);
      double e_acc = std::fabs(w[K - 1]) * e_nc;
      for (int j = 0; j + 1 < K; ++j) {
        const int idx = L - d * (K - 1 - j);
        acc += double(w[j]) * st[idx];
        mag += std::fabs(w[j] * st[idx]);
        e_acc += std::fabs(w[j]) * sb[idx];
      }
      e_acc += gamma_h(K) * (mag + e_acc);
      for (int m = 0; m + 1 < L; ++m) {
        st[m] = st[m + 1];
        sb[m] = sb[m + 1];
      }
      if (L > 0) {
        st[L - 1] = nc;
        sb[L - 1] = e_nc;
      }
      const double conv = acc / (1.0 + std::exp(-acc));
      const double e_conv = 1.1 * e_acc + 6 * u * std::fabs(conv);  // |silu'| <= 1.0998
      const double y = double(Hin[ch]) + (Gv[i] + conv);
      x.H[ch] = y;
      x.H_bound[ch] =
          eGv[i] + e_conv + u * std::fabs(Gv[i] + conv) + u * std::fabs(y) + u * (eGv[i] + e_conv);
    }
  }
}

struct StepInputs {
  std::vector<float> E, H;
};

StepInputs make_inputs(const PleCase& c, int step, uint64_t seed) {
  std::mt19937_64 rng(seed * 1000 + step);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  StepInputs in;
  in.E.resize(c.P);
  for (auto& v : in.E) v = n01(rng);
  in.H.resize(size_t(c.S) * c.P);
  // Each stream on its own scale (the query norm is per stream).
  for (size_t i = 0; i < in.H.size(); ++i)
    in.H[i] = n01(rng) * std::ldexp(1.0f, int(i / c.P) * 2 - 3);
  return in;
}

fn::PleApplyParams apply_params(const PleCase& c, const DeviceArray<float>& kv,
                                DeviceArray<float>& H, const DeviceArray<float>& nk,
                                const DeviceArray<float>& nq, const DeviceArray<float>& nc,
                                const DeviceArray<float>& conv, DeviceArray<float>& state) {
  fn::PleApplyParams p;
  p.kv = kv.ptr;
  p.H = H.ptr;
  p.norm_key = nk.ptr;
  p.norm_query = nq.ptr;
  p.norm_conv = nc.ptr;
  p.conv = conv.ptr;
  p.conv_state = state.ptr;
  p.hc_count = c.S;
  p.dim = c.P;
  p.conv_kernel = c.K;
  p.dilation = c.dil;
  p.eps = 1e-6f;
  return p;
}

}  // namespace

TEST_CASE("cuda ple: ple_apply follows cpu::ple_apply over 14 steps within the derived bound") {
  struct Shape {
    int S;
    int64_t P;
  };
  for (Shape sh : {Shape{4, 2560}, Shape{4, 64}, Shape{2, 1000}}) {
    const PleCase c = make_case(sh.S, sh.P, uint64_t(sh.P) + sh.S);
    const int64_t W = int64_t(c.S) * c.P, L = (c.K - 1) * c.dil;
    const fn::cpu::DenseMatrix key(c.key.data(), W, c.P), value(c.value.data(), c.P, c.P);
    const fn::cpu::PleWeights pw{&key,          &value,        c.w_nk.data(), c.w_nq.data(),
                                 c.w_nc.data(), c.conv.data(), c.K,           c.dil};
    DeviceArray<float> kv{size_t(W + c.P)}, H{size_t(W)}, nk(c.w_nk), nq(c.w_nq), nc(c.w_nc),
        conv(c.conv), state{size_t(W * L)};
    FN_CUDA_CHECK(cudaMemset(state.ptr, 0, state.n * 4));
    const fn::PleApplyParams p = apply_params(c, kv, H, nk, nq, nc, conv, state);
    std::vector<float> cpu_state(size_t(W * L), 0.0f);
    ExactPle x{
        std::vector<double>(size_t(W * L), 0.0), std::vector<double>(size_t(W * L), 0.0), {}, {}};
    for (int step = 0; step < 14; ++step) {
      const StepInputs in = make_inputs(c, step, uint64_t(sh.P));
      // kv exactly as cpu::ple_apply computes it internally (same gemv).
      std::vector<float> kvh(size_t(W + c.P));
      fn::cpu::gemv(key, in.E.data(), kvh.data());
      fn::cpu::gemv(value, in.E.data(), kvh.data() + W);
      kv.upload(kvh);
      H.upload(in.H);
      fn::launch_ple_apply(p, nullptr);
      FN_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = H.download();
      std::vector<float> cpu_H = in.H;
      fn::cpu::ple_apply(in.E.data(), pw, c.S, c.P, 1e-6f, cpu_state.data(), cpu_H.data());
      exact_step(c, kvh, in.H, x);
      // The kernel and the CPU op each within the bound of the FP64 value, so within twice it of
      // each other.
      const auto ck = fn::test::compare_bounded(got, x.H, x.H_bound);
      CHECK_MESSAGE(ck.wrong == 0, "S ", c.S, " P ", c.P, " step ", step,
                    " kernel: ", ck.describe());
      const auto cc = fn::test::compare_bounded(cpu_H, x.H, x.H_bound);
      CHECK_MESSAGE(cc.wrong == 0, "S ", c.S, " P ", c.P, " step ", step, " cpu: ", cc.describe());
      std::vector<double> cpu_d(cpu_H.begin(), cpu_H.end()), twice(x.H_bound);
      for (auto& b : twice) b *= 2;
      const auto cg = fn::test::compare_bounded(got, cpu_d, twice);
      CHECK_MESSAGE(cg.wrong == 0, "S ", c.S, " P ", c.P, " step ", step,
                    " vs cpu: ", cg.describe());
      // The carried dilated state: the kernel's within its bound of the exact history.
      const auto st = state.download();
      const auto cs = fn::test::compare_bounded(st, x.state, x.state_bound);
      CHECK_MESSAGE(cs.wrong == 0, "S ", c.S, " P ", c.P, " step ", step,
                    " state: ", cs.describe());
      // The PLE contribution is not negligible against the bound (the test can fail).
      double contrib = 0, bound = 0;
      for (int64_t i = 0; i < W; ++i) {
        contrib = std::max(contrib, std::fabs(x.H[i] - in.H[i]));
        bound = std::max(bound, x.H_bound[i]);
      }
      CHECK(contrib > 100 * bound);
    }
  }
}

TEST_CASE("cuda ple: ple_apply replayed from a graph is bitwise the eager result, step by step") {
  const PleCase c = make_case(4, 2560, 5);
  const int64_t W = int64_t(c.S) * c.P, L = (c.K - 1) * c.dil;
  DeviceArray<float> kv{size_t(W + c.P)}, H{size_t(W)}, nk(c.w_nk), nq(c.w_nq), nc(c.w_nc),
      conv(c.conv), state{size_t(W * L)};
  const fn::PleApplyParams p = apply_params(c, kv, H, nk, nq, nc, conv, state);
  std::mt19937_64 rng(6);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  const int steps = 13;
  std::vector<std::vector<float>> kvs(steps), Hs(steps);
  for (int s = 0; s < steps; ++s) {
    kvs[s].resize(size_t(W + c.P));
    Hs[s].resize(size_t(W));
    for (auto& v : kvs[s]) v = n01(rng);
    for (auto& v : Hs[s]) v = n01(rng);
  }
  cudaStream_t stream;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<std::vector<float>> eager_H, eager_state;
  FN_CUDA_CHECK(cudaMemset(state.ptr, 0, state.n * 4));
  for (int s = 0; s < steps; ++s) {
    kv.upload(kvs[s]);
    H.upload(Hs[s]);
    fn::launch_ple_apply(p, stream);
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    eager_H.push_back(H.download());
    eager_state.push_back(state.download());
  }
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  fn::launch_ple_apply(p, stream);
  FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  FN_CUDA_CHECK(cudaMemset(state.ptr, 0, state.n * 4));
  for (int s = 0; s < steps; ++s) {
    kv.upload(kvs[s]);
    H.upload(Hs[s]);
    FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    CHECK_MESSAGE(bitwise_equal(H.download(), eager_H[s]), "step ", s);
    CHECK_MESSAGE(bitwise_equal(state.download(), eager_state[s]), "step ", s);
  }
  // The state moved: after 13 steps it is not all zero and differs between steps.
  CHECK_FALSE(bitwise_equal(eager_state[11], eager_state[12]));
  FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FN_CUDA_CHECK(cudaGraphDestroy(graph));
  // Informational: device time per launch from a graph of 50 back-to-back launches (no check).
  FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 50; ++i) fn::launch_ple_apply(p, stream);
  FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t t0, t1;
  FN_CUDA_CHECK(cudaEventCreate(&t0));
  FN_CUDA_CHECK(cudaEventCreate(&t1));
  FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm-up
  FN_CUDA_CHECK(cudaEventRecord(t0, stream));
  for (int r = 0; r < 4; ++r) FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  FN_CUDA_CHECK(cudaEventRecord(t1, stream));
  FN_CUDA_CHECK(cudaEventSynchronize(t1));
  float ms = 0;
  FN_CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
  MESSAGE("PLE_TIMING ple_apply S=4 P=2560: ", ms * 1000.0f / 200.0f, " us per launch");
  FN_CUDA_CHECK(cudaEventDestroy(t0));
  FN_CUDA_CHECK(cudaEventDestroy(t1));
  FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FN_CUDA_CHECK(cudaGraphDestroy(graph));
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda ple: the ple_apply launcher rejects null pointers and bad sizes") {
  const PleCase c = make_case(4, 64, 8);
  const int64_t W = 256, L = 9;
  DeviceArray<float> kv{size_t(W + 64)}, H{size_t(W)}, nk(c.w_nk), nq(c.w_nq), nc(c.w_nc),
      conv(c.conv), state{size_t(W * L)};
  const fn::PleApplyParams p = apply_params(c, kv, H, nk, nq, nc, conv, state);
  auto bad = p;
  bad.conv_state = nullptr;
  CHECK_THROWS_AS(fn::launch_ple_apply(bad, nullptr), fn::Error);
  bad = p;
  bad.dim = 0;
  CHECK_THROWS_AS(fn::launch_ple_apply(bad, nullptr), fn::Error);
  bad = p;
  bad.hc_count = 0;
  CHECK_THROWS_AS(fn::launch_ple_apply(bad, nullptr), fn::Error);
  bad = p;
  bad.dilation = 0;
  CHECK_THROWS_AS(fn::launch_ple_apply(bad, nullptr), fn::Error);
  bad = p;
  bad.kv = nullptr;
  CHECK_THROWS_AS(fn::launch_ple_apply(bad, nullptr), fn::Error);
}
