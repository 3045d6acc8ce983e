// GPU tests of the batched-prefill PLE kernels (cuda/kernels/ple.h *_rows): for M tokens the row
// gather, the context shift and ple_apply_rows against M successive decode launches
// (launch_ngram_gather + launch_ngram_context_advance, launch_ple_apply) on an identical copy of
// the state, from the reset state and from a populated one, at the tiny fixture's and the real
// shapes; the gather's ids also against fn::ngram_ids over [context] + tokens (docs/model.md §C.4,
// §D). FN_BENCH=1 adds timings at the real shapes with M = 8192.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "core/config.h"
#include "core/error.h"
#include "core/ngram.h"
#include "cuda/kernels/ple.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;
using fn::test::kFp32Unit;

const int64_t kMs[] = {1, 2, 3, 4, 9, 10, 17, 64};

fn::ModelConfig load(const std::string& rel) {
  return fn::load_model_config(std::string(FN_SOURCE_DIR) + "/" + rel);
}

bool bench_enabled() {
  const char* e = std::getenv("FN_BENCH");
  return e != nullptr && std::string(e) == "1";
}

// The gather's constant part from NgramConstants (as the engine and test_cuda_ple fill it).
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

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// M tokens below vocab with EOS at the start, doubled and in the middle (variant picks where).
std::vector<int32_t> make_tokens(int64_t M, int64_t vocab, int64_t eos, int variant,
                                 uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(M));
  for (auto& v : t) {
    v = int32_t(rng() % uint64_t(vocab));
    if (v == eos) v = int32_t((eos + 1) % vocab);
  }
  const auto put = [&](int64_t i) {
    if (i >= 0 && i < M) t[size_t(i)] = int32_t(eos);
  };
  if (variant == 1) {
    put(M / 2);  // in the middle
    put(M - 1);  // the last token (affects only the context left behind)
  } else if (variant == 2) {
    put(0);  // the first token, then two in a row
    put(M / 3);
    put(M / 3 + 1);
  }
  return t;
}

// A gather table: the whole table (BF16, every row distinct enough to tell ids apart) or FP8.
struct Table {
  int64_t first_row = 0, row_count = 0;
  bool fp8 = true;
  float scale = 1.0f;
  std::vector<uint8_t> bytes;
};

Table make_table(int64_t rows, int head_dim, bool fp8, uint64_t seed) {
  Table t{0, rows, fp8, fp8 ? 2.1e-4f : 1.0f, {}};
  t.bytes.resize(size_t(rows) * head_dim * (fp8 ? 1 : 2));
  std::mt19937_64 rng(seed);
  if (fp8) {
    for (auto& b : t.bytes) b = uint8_t(rng() & 0x77);  // finite codes only (no NaN payloads)
  } else {
    for (size_t i = 0; i < t.bytes.size(); i += 2) {
      const uint16_t b = uint16_t(0x3c00u | (rng() & 0x3ffu));  // finite BF16 in [2^-7, 2^-6)
      std::memcpy(&t.bytes[i], &b, 2);
    }
  }
  return t;
}

// Rows gather + rows context shift vs M decode gathers + shifts, on copies of `context`.
void check_gather_rows(const fn::NgramConstants& k, int head_dim, const Table& table,
                       const DeviceArray<uint8_t>& rows_dev, const std::vector<int64_t>& context,
                       const std::vector<int32_t>& tokens, const std::string& what) {
  const int64_t M = int64_t(tokens.size());
  const int nh = int(k.head_sizes.size());
  const size_t width = size_t(nh) * head_dim;
  fn::NgramGatherParams base = gather_params(k, head_dim);
  base.rows = rows_dev.ptr;
  base.first_row = table.first_row;
  base.row_count = table.row_count;
  base.fp8 = table.fp8;
  base.scale = table.scale;
  DeviceArray<int32_t> tok(tokens);
  DeviceArray<int64_t> ctx_rows(context), ctx_dec(context);
  DeviceArray<float> out_rows(size_t(M) * width), out_dec(size_t(M) * width);
  FN_CUDA_CHECK(cudaMemset(out_rows.ptr, 0xff, out_rows.n * 4));
  FN_CUDA_CHECK(cudaMemset(out_dec.ptr, 0xfe, out_dec.n * 4));

  fn::NgramGatherRowsParams gr;
  gr.base = base;
  gr.base.context = ctx_rows.ptr;
  gr.tokens = tok.ptr;
  gr.rows = M;
  gr.out = out_rows.ptr;
  fn::launch_ngram_gather_rows(gr, nullptr);
  fn::launch_ngram_context_advance_rows({ctx_rows.ptr, base.ngram_size, tok.ptr, M}, nullptr);

  for (int64_t p = 0; p < M; ++p) {
    fn::NgramGatherParams g = base;
    g.context = ctx_dec.ptr;
    g.token = tok.ptr + p;
    g.out = out_dec.ptr + p * int64_t(width);
    fn::launch_ngram_gather(g, nullptr);
    fn::launch_ngram_context_advance({ctx_dec.ptr, base.ngram_size, tok.ptr + p}, nullptr);
  }
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = out_rows.download(), want = out_dec.download();
  CHECK_MESSAGE(bitwise_equal(got, want), what, " M ", M);
  const auto ctx_got = ctx_rows.download();
  CHECK_MESSAGE(ctx_got == ctx_dec.download(), what, " M ", M);

  // Independent of the decode kernels: the ids of fn::ngram_ids over the running host context,
  // and the context (docs/model.md §D item 3: the last raw ids of [context] + tokens).
  std::vector<int64_t> hctx = context, ids(static_cast<size_t>(nh));
  int64_t wrong_rows = 0;
  for (int64_t p = 0; p < M; ++p) {
    fn::ngram_ids(k, hctx, tokens[size_t(p)], ids);
    for (int h = 0; h < nh; ++h) {
      const int64_t r = ids[size_t(h)] - table.first_row;
      for (int j = 0; j < head_dim; ++j) {
        float v = 0.0f;
        if (r >= 0 && r < table.row_count) {
          const size_t b = size_t(r) * head_dim + j;
          if (table.fp8) {
            v = fn::e4m3_to_float(table.bytes[b]) * table.scale;
          } else {
            uint16_t bits;
            std::memcpy(&bits, &table.bytes[2 * b], 2);
            v = fn::bf16_to_float(bits) * table.scale;
          }
        }
        const float g = got[size_t(p) * width + size_t(h) * head_dim + j];
        if (std::memcmp(&g, &v, 4) != 0) {
          ++wrong_rows;
          break;
        }
      }
    }
    hctx.erase(hctx.begin());
    hctx.push_back(tokens[size_t(p)]);
  }
  CHECK_MESSAGE(wrong_rows == 0, what, " M ", M, ": rows unlike fn::ngram_ids");
  CHECK_MESSAGE(ctx_got == hctx, what, " M ", M);
}

}  // namespace

TEST_CASE("cuda ple rows: the batched gather and context shift equal M decode steps, EOS inside") {
  struct Fixture {
    const char* config;
    int head_dim;  // 0: the config's ngram_head_dim
    bool fp8;
  };
  // Real constants: the whole 320,001,536-row table with 1-wide BF16 rows (every head's id is
  // held, all 16 heads checked); the tiny fixture's table at its own width, FP8 and BF16.
  for (Fixture fx : {Fixture{"tests/data/fixtures/g3_tiny/config.json", 0, true},
                     Fixture{"tests/data/fixtures/g3_tiny/config.json", 0, false},
                     Fixture{"configs/qwen3.8-flash-next.json", 1, false}}) {
    const fn::ModelConfig cfg = load(fx.config);
    const fn::NgramConstants k = fn::ngram_constants(cfg, 0);
    const int hd = fx.head_dim > 0 ? fx.head_dim : int(cfg.ngram_head_dim());
    const Table table = make_table(k.table_rows, hd, fx.fp8, 17 + hd + fx.fp8);
    DeviceArray<uint8_t> rows_dev(table.bytes);
    const int64_t eos = k.eos, V = cfg.vocab_size;
    const std::vector<std::vector<int64_t>> contexts = {
        {eos, eos}, {V - 1, V / 3}, {V / 5, eos}, {eos, V / 7}};
    int variant = 0;
    for (int64_t M : kMs) {
      for (size_t ci = 0; ci < contexts.size(); ++ci) {
        const auto tokens = make_tokens(M, V, eos, variant++ % 3, uint64_t(M * 31 + ci));
        check_gather_rows(k, hd, table, rows_dev, contexts[ci], tokens,
                          std::string(fx.config) + (fx.fp8 ? " fp8" : " bf16") + " context " +
                              std::to_string(ci));
      }
    }
    // A hand case (tiny constants): context (EOS, EOS), tokens [a, EOS, b, c]. Row 2 (b) looks
    // back at EOS then stops (s2 = EOS); row 3 (c) sees (b, EOS); the context ends (b, c).
    if (hd == int(cfg.ngram_head_dim())) {
      const std::vector<int32_t> toks = {11, int32_t(eos), 12, 13};
      check_gather_rows(k, hd, table, rows_dev, {eos, eos}, toks, "hand case");
      std::vector<int64_t> ids_rows(k.head_sizes.size()), ids_ref(k.head_sizes.size());
      fn::ngram_ids(k, std::vector<int64_t>{11, eos}, 12,
                    ids_rows);  // what row 2 must NOT use for the trigram
      fn::ngram_ids(k, std::vector<int64_t>{eos, eos}, 12, ids_ref);  // what it must use
      CHECK(ids_rows[0] == ids_ref[0]);          // bigram heads see only s1 = EOS: same
      CHECK(ids_rows.back() == ids_ref.back());  // trigram: EOS-aware shift makes s2 = EOS
    }
  }
}

TEST_CASE("cuda ple rows: zero rows launch nothing and bad arguments are rejected") {
  const fn::NgramConstants k =
      fn::ngram_constants(load("tests/data/fixtures/g3_tiny/config.json"), 0);
  DeviceArray<int64_t> ctx(std::vector<int64_t>{5, 6});
  DeviceArray<int32_t> tok(4);
  DeviceArray<float> out(256);
  DeviceArray<uint8_t> rows(64);
  fn::NgramGatherRowsParams g;
  g.base = gather_params(k, 8);
  g.base.context = ctx.ptr;
  g.base.rows = rows.ptr;
  g.base.row_count = 8;
  g.tokens = tok.ptr;
  g.out = out.ptr;
  g.rows = 0;
  fn::launch_ngram_gather_rows(g, nullptr);
  fn::launch_ngram_context_advance_rows({ctx.ptr, 3, tok.ptr, 0}, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(ctx.download() == std::vector<int64_t>{5, 6});
  auto bad = g;
  bad.rows = -1;
  CHECK_THROWS_AS(fn::launch_ngram_gather_rows(bad, nullptr), fn::Error);
  bad = g;
  bad.tokens = nullptr;
  CHECK_THROWS_AS(fn::launch_ngram_gather_rows(bad, nullptr), fn::Error);
  bad = g;
  bad.base.num_heads = 7;
  CHECK_THROWS_AS(fn::launch_ngram_gather_rows(bad, nullptr), fn::Error);
  CHECK_THROWS_AS(fn::launch_ngram_context_advance_rows({ctx.ptr, 3, tok.ptr, -1}, nullptr),
                  fn::Error);
  CHECK_THROWS_AS(fn::launch_ngram_context_advance_rows({ctx.ptr, 3, nullptr, 2}, nullptr),
                  fn::Error);
  CHECK_THROWS_AS(fn::launch_ngram_context_advance_rows({ctx.ptr, 9, tok.ptr, 2}, nullptr),
                  fn::Error);
}

// ---------------------------------------------------------------------------------------------
// ple_apply_rows.

namespace {

struct ApplyShape {
  int S;
  int64_t P;
  int K, dil;
};

struct ApplyWeights {
  std::vector<float> w_nk, w_nq, w_nc, conv;  // [S*P] x3, [S*P, K]
};

ApplyWeights make_weights(const ApplyShape& sh, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  ApplyWeights w;
  for (auto* v : {&w.w_nk, &w.w_nq, &w.w_nc}) {
    v->resize(size_t(sh.S) * sh.P);
    for (auto& x : *v) x = 0.3f * n01(rng);
  }
  w.conv.resize(size_t(sh.S) * sh.P * sh.K);
  for (auto& x : w.conv) x = 0.5f * n01(rng);
  return w;
}

// Bound of a kernel value against the decode value: both run the same FP32 operations in the same
// order (shared device code), so they are expected bitwise equal; the bound admits a different
// FMA contraction of one product by the compiler in the separately compiled kernels, which moves
// the gate/scale by a few units of roundoff and every value after it (Gv, Nc, the conv sum over
// K <= 4 taps of O(1) normalized values, the residual sum) by at most a few roundings of its
// magnitude: 16 u (|value| + 1), with the +1 covering the O(1) terms summed into it.
std::vector<double> rounding_bound(const std::vector<float>& want) {
  std::vector<double> b(want.size());
  for (size_t i = 0; i < want.size(); ++i) b[i] = 16 * kFp32Unit * (std::fabs(want[i]) + 1.0);
  return b;
}

void check_apply_rows(const ApplyShape& sh, int64_t M, bool populated, uint64_t seed) {
  const int64_t W = int64_t(sh.S) * sh.P, L = int64_t(sh.K - 1) * sh.dil;
  const int64_t stride = W + sh.P + 3;  // padded rows: the stride is honoured
  const ApplyWeights wt = make_weights(sh, seed);
  std::mt19937_64 rng(seed * 7 + M);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> kv(size_t(M * stride)), H(size_t(M * W)), state(size_t(W * L), 0.0f);
  for (auto& v : kv) v = n01(rng);
  for (size_t i = 0; i < H.size(); ++i)
    H[i] = n01(rng) * std::ldexp(1.0f, int((i % W) / sh.P) * 2 - 3);  // per-stream scales
  if (populated)
    for (auto& v : state) v = n01(rng);
  DeviceArray<float> kv_d(kv), H_rows(H), H_dec(H), st_rows(state), st_dec(state), nk(wt.w_nk),
      nq(wt.w_nq), nc(wt.w_nc), conv(wt.conv);
  fn::PleApplyParams base;
  base.norm_key = nk.ptr;
  base.norm_query = nq.ptr;
  base.norm_conv = nc.ptr;
  base.conv = conv.ptr;
  base.hc_count = sh.S;
  base.dim = sh.P;
  base.conv_kernel = sh.K;
  base.dilation = sh.dil;
  base.eps = 1e-6f;

  fn::PleApplyRowsParams r;
  r.base = base;
  r.base.conv_state = st_rows.ptr;
  r.kv = kv_d.ptr;
  r.kv_stride = stride;
  r.H = H_rows.ptr;
  r.rows = M;
  const int64_t scratch_n = fn::ple_apply_rows_scratch_floats(r);
  CHECK(scratch_n == 2 * M * sh.S);
  DeviceArray<float> scratch(static_cast<size_t>(scratch_n));
  r.scratch = scratch.ptr;
  fn::launch_ple_apply_rows(r, nullptr);

  fn::PleApplyParams d = base;
  d.conv_state = st_dec.ptr;
  for (int64_t p = 0; p < M; ++p) {
    d.kv = kv_d.ptr + p * stride;
    d.H = H_dec.ptr + p * W;
    fn::launch_ple_apply(d, nullptr);
  }
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto h_got = H_rows.download(), h_want = H_dec.download();
  const auto s_got = st_rows.download(), s_want = st_dec.download();
  const std::string what = "S " + std::to_string(sh.S) + " P " + std::to_string(sh.P) + " K " +
                           std::to_string(sh.K) + " dil " + std::to_string(sh.dil) + " M " +
                           std::to_string(M) + (populated ? " populated" : " reset");
  const auto ch = fn::test::compare_bounded(
      h_got, std::vector<double>(h_want.begin(), h_want.end()), rounding_bound(h_want));
  CHECK_MESSAGE(ch.wrong == 0, what, " H: ", ch.describe());
  const auto cs = fn::test::compare_bounded(
      s_got, std::vector<double>(s_want.begin(), s_want.end()), rounding_bound(s_want));
  CHECK_MESSAGE(cs.wrong == 0, what, " state: ", cs.describe());
  if (!bitwise_equal(h_got, h_want) || !bitwise_equal(s_got, s_want))
    MESSAGE(what, ": within the rounding bound but not bitwise equal to decode");
  // The test can fail: the PLE contribution and the state change are far above the bound.
  double contrib = 0;
  for (size_t i = 0; i < H.size(); ++i)
    contrib = std::max(contrib, std::fabs(double(h_want[i]) - H[i]));
  CHECK(contrib > 1e4 * 16 * kFp32Unit * 2);
  CHECK_FALSE(bitwise_equal(s_want, state));
}

}  // namespace

TEST_CASE("cuda ple rows: ple_apply_rows leaves H and the conv state as M decode steps") {
  const fn::ModelConfig tiny = load("tests/data/fixtures/g3_tiny/config.json");
  const fn::ModelConfig real = load("configs/qwen3.8-flash-next.json");
  const auto shape_of = [](const fn::ModelConfig& c) {
    return ApplyShape{int(c.hc_count), c.ple_embed_dim, int(c.ple_conv_kernel_size),
                      int(c.ngram_size)};
  };
  const ApplyShape real_shape = shape_of(real);
  REQUIRE(real_shape.S == 4);
  REQUIRE(real_shape.P == 2560);
  REQUIRE(real_shape.K == 4);
  REQUIRE(real_shape.dil == 3);
  // The tiny fixture's, the real, and one with another history length (L = 4) and P not a
  // multiple of the block.
  for (const ApplyShape& sh : {shape_of(tiny), real_shape, ApplyShape{2, 1000, 3, 2}}) {
    for (int64_t M : kMs) {
      for (bool populated : {false, true}) check_apply_rows(sh, M, populated, uint64_t(sh.P + M));
    }
  }
}

TEST_CASE("cuda ple rows: two batches in a row continue like one (chunked prefill)") {
  // 17 rows as 9 + 8 (chunk boundary inside the 9-deep history) vs decode, from a populated state.
  const ApplyShape sh{4, 2560, 4, 3};
  const int64_t W = 4 * 2560, L = 9, stride = W + 2560, M = 17, M1 = 9;
  const ApplyWeights wt = make_weights(sh, 3);
  std::mt19937_64 rng(4);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> kv(size_t(M * stride)), H(size_t(M * W)), state(size_t(W * L));
  for (auto* v : {&kv, &H, &state})
    for (auto& x : *v) x = n01(rng);
  DeviceArray<float> kv_d(kv), H_rows(H), H_dec(H), st_rows(state), st_dec(state), nk(wt.w_nk),
      nq(wt.w_nq), nc(wt.w_nc), conv(wt.conv), scratch(size_t(2 * M * 4));
  fn::PleApplyParams base;
  base.norm_key = nk.ptr;
  base.norm_query = nq.ptr;
  base.norm_conv = nc.ptr;
  base.conv = conv.ptr;
  base.hc_count = 4;
  base.dim = 2560;
  fn::PleApplyRowsParams r;
  r.base = base;
  r.base.conv_state = st_rows.ptr;
  r.kv_stride = stride;
  r.scratch = scratch.ptr;
  r.kv = kv_d.ptr;
  r.H = H_rows.ptr;
  r.rows = M1;
  fn::launch_ple_apply_rows(r, nullptr);
  r.kv = kv_d.ptr + M1 * stride;
  r.H = H_rows.ptr + M1 * W;
  r.rows = M - M1;
  fn::launch_ple_apply_rows(r, nullptr);
  fn::PleApplyParams d = base;
  d.conv_state = st_dec.ptr;
  for (int64_t p = 0; p < M; ++p) {
    d.kv = kv_d.ptr + p * stride;
    d.H = H_dec.ptr + p * W;
    fn::launch_ple_apply(d, nullptr);
  }
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto h_want = H_dec.download(), s_want = st_dec.download();
  const auto ch = fn::test::compare_bounded(
      H_rows.download(), std::vector<double>(h_want.begin(), h_want.end()), rounding_bound(h_want));
  CHECK_MESSAGE(ch.wrong == 0, ch.describe());
  const auto cs = fn::test::compare_bounded(st_rows.download(),
                                            std::vector<double>(s_want.begin(), s_want.end()),
                                            rounding_bound(s_want));
  CHECK_MESSAGE(cs.wrong == 0, cs.describe());
}

TEST_CASE(
    "cuda ple rows: the ple_apply_rows launcher rejects bad arguments, zero rows is a no-op") {
  const ApplyShape sh{4, 64, 4, 3};
  const ApplyWeights wt = make_weights(sh, 9);
  DeviceArray<float> kv(320), H(256), nk(wt.w_nk), nq(wt.w_nq), nc(wt.w_nc), conv(wt.conv),
      state(256 * 9), scratch(8);
  fn::PleApplyRowsParams r;
  r.base.norm_key = nk.ptr;
  r.base.norm_query = nq.ptr;
  r.base.norm_conv = nc.ptr;
  r.base.conv = conv.ptr;
  r.base.conv_state = state.ptr;
  r.base.hc_count = 4;
  r.base.dim = 64;
  r.kv = kv.ptr;
  r.kv_stride = 320;
  r.H = H.ptr;
  r.rows = 1;
  r.scratch = scratch.ptr;
  r.rows = 0;
  FN_CUDA_CHECK(cudaMemset(H.ptr, 0, 256 * 4));
  fn::launch_ple_apply_rows(r, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(H.download() == std::vector<float>(256, 0.0f));
  r.rows = 1;
  auto bad = r;
  bad.kv_stride = 319;  // shorter than S*P + P
  CHECK_THROWS_AS(fn::launch_ple_apply_rows(bad, nullptr), fn::Error);
  bad = r;
  bad.scratch = nullptr;
  CHECK_THROWS_AS(fn::launch_ple_apply_rows(bad, nullptr), fn::Error);
  bad = r;
  bad.rows = -2;
  CHECK_THROWS_AS(fn::launch_ple_apply_rows(bad, nullptr), fn::Error);
  bad = r;
  bad.base.conv_state = nullptr;
  CHECK_THROWS_AS(fn::launch_ple_apply_rows(bad, nullptr), fn::Error);
  bad = r;
  bad.base.dilation = 0;
  CHECK_THROWS_AS(fn::launch_ple_apply_rows(bad, nullptr), fn::Error);
}

TEST_CASE("cuda ple rows: timings at the real shapes, M = 8192 (FN_BENCH=1)") {
  if (!bench_enabled()) return;
  const fn::ModelConfig cfg = load("configs/qwen3.8-flash-next.json");
  const fn::NgramConstants k = fn::ngram_constants(cfg, 0);
  const int64_t M = 8192, S = 4, P = 2560, W = S * P, stride = W + P, hd = 160;
  cudaEvent_t t0, t1;
  FN_CUDA_CHECK(cudaEventCreate(&t0));
  FN_CUDA_CHECK(cudaEventCreate(&t1));
  const auto time_ms = [&](auto&& fn_launch, int reps) {
    fn_launch();  // warm-up
    FN_CUDA_CHECK(cudaEventRecord(t0, nullptr));
    for (int i = 0; i < reps; ++i) fn_launch();
    FN_CUDA_CHECK(cudaEventRecord(t1, nullptr));
    FN_CUDA_CHECK(cudaEventSynchronize(t1));
    float ms = 0;
    FN_CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
    return ms / float(reps);
  };
  {
    // TP=2 rank 0's half of the FP8 table (contents irrelevant for timing).
    const int64_t held = k.table_rows / 2;
    DeviceArray<uint8_t> rows(size_t(held * hd));
    FN_CUDA_CHECK(cudaMemset(rows.ptr, 0x38, rows.n));
    const auto toks = make_tokens(M, cfg.vocab_size, k.eos, 1, 5);
    DeviceArray<int32_t> tok(toks);
    DeviceArray<int64_t> ctx(std::vector<int64_t>{k.eos, k.eos});
    DeviceArray<float> out(size_t(M * 16 * hd));
    fn::NgramGatherRowsParams g;
    g.base = gather_params(k, int(hd));
    g.base.context = ctx.ptr;
    g.base.rows = rows.ptr;
    g.base.row_count = held;
    g.base.scale = 2.1e-4f;
    g.tokens = tok.ptr;
    g.rows = M;
    g.out = out.ptr;
    const float ms = time_ms([&] { fn::launch_ngram_gather_rows(g, nullptr); }, 10);
    MESSAGE("PLE_ROWS_TIMING gather_rows M=8192 16x160 (half table held): ", ms * 1000, " us");
  }
  {
    const ApplyWeights wt = make_weights({4, 2560, 4, 3}, 1);
    DeviceArray<float> kv(size_t(M * stride)), H(size_t(M * W)), st(size_t(W * 9)), nk(wt.w_nk),
        nq(wt.w_nq), nc(wt.w_nc), conv(wt.conv), scratch(size_t(2 * M * S));
    FN_CUDA_CHECK(cudaMemset(kv.ptr, 0, kv.n * 4));
    FN_CUDA_CHECK(cudaMemset(H.ptr, 0, H.n * 4));
    FN_CUDA_CHECK(cudaMemset(st.ptr, 0, st.n * 4));
    fn::PleApplyRowsParams r;
    r.base.norm_key = nk.ptr;
    r.base.norm_query = nq.ptr;
    r.base.norm_conv = nc.ptr;
    r.base.conv = conv.ptr;
    r.base.conv_state = st.ptr;
    r.base.hc_count = 4;
    r.base.dim = 2560;
    r.kv = kv.ptr;
    r.kv_stride = stride;
    r.H = H.ptr;
    r.rows = M;
    r.scratch = scratch.ptr;
    const float ms = time_ms([&] { fn::launch_ple_apply_rows(r, nullptr); }, 10);
    const double bytes = double(M) * (stride + 2.0 * W) * 4;  // kv read once, H read + written
    MESSAGE("PLE_ROWS_TIMING ple_apply_rows M=8192 S=4 P=2560: ", ms * 1000, " us (",
            bytes / (ms * 1e-3) / 1e9, " GB/s of kv + H traffic)");
  }
  FN_CUDA_CHECK(cudaEventDestroy(t0));
  FN_CUDA_CHECK(cudaEventDestroy(t1));
}
