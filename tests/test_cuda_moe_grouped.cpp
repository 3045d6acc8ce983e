// GPU tests of the grouped routed experts (cuda/kernels/moe_grouped.h) against an FP64 host
// reference on the weights decoded by core/codecs.h (dequant_nvfp4_row): h within the bound of the
// tensor-core summation plus one BF16 rounding, y (computed from the kernel's own h) within the
// FP32 accumulation bound; small shapes, the real shapes at TP=1 and 2, routing edge cases
// (invalid ids, one expert taken by every token, duplicates, one token, zero tokens), each token's
// bits independent of the other tokens of the launch, run-to-run and graph-replay bitwise equality
// and the launcher's rejections. FN_BENCH=1 adds real-shape timings against the per-route kernels.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "core/error.h"
#include "cuda/kernels/moe_grouped.h"
#include "cuda/kernels/moe_nvfp4.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;

// One projection of the experts: [E, rows, cols] NVFP4 in the checkpoint's layout on the host,
// the decode layout on the device. Codes uniformly random (all 16), block scales mostly 2^-3..2^3
// with one in 64 an E4M3 subnormal, global scales 2^-8 .. 2^-7.
struct Projection {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> packed, scales;
  std::vector<float> gscale;
  DeviceArray<uint8_t> d_packed, d_scales;
  DeviceArray<float> d_gscale;

  static std::vector<uint8_t> random_bytes(size_t n, std::mt19937_64& rng) {
    std::vector<uint8_t> v(n);
    for (size_t i = 0; i < n; i += 8) {
      const uint64_t r = rng();
      std::memcpy(v.data() + i, &r, std::min<size_t>(8, n - i));
    }
    return v;
  }
  static std::vector<uint8_t> random_scales(size_t n, std::mt19937_64& rng) {
    std::vector<uint8_t> v(n);
    for (auto& s : v) {
      const uint64_t r = rng();
      s = (r & 63) == 0 ? uint8_t(1 + (r >> 8) % 7) : uint8_t(0x20 + (r >> 8) % 0x30);
    }
    return v;
  }
  static std::vector<float> random_gscales(size_t n, std::mt19937_64& rng) {
    std::vector<float> v(n);
    for (auto& g : v) g = std::ldexp(1.0f + float(rng() % 1000) / 1000.0f, -8);
    return v;
  }
  Projection(int experts, int64_t r, int64_t c, int per_expert, std::mt19937_64& rng)
      : rows(r),
        cols(c),
        packed(random_bytes(size_t(experts) * r * c / 2, rng)),
        scales(random_scales(size_t(experts) * r * c / 16, rng)),
        gscale(random_gscales(size_t(experts) * per_expert, rng)),
        d_packed(packed),
        d_scales(scales),
        d_gscale(gscale) {
    fn::test::to_decode_layout(d_packed);
  }
  fn::Nvfp4Experts view(int experts) const {
    fn::Nvfp4Experts v;
    v.packed = d_packed.ptr;
    v.scales = d_scales.ptr;
    v.global_scale = d_gscale.ptr;
    v.num_experts = experts;
    v.rows = rows;
    v.cols = cols;
    return v;
  }
  // Row r of expert e as exact FP32 values code * block scale (no global scale).
  void row(int e, int64_t r, std::vector<float>& out) const {
    out.resize(size_t(cols));
    const size_t at = size_t(e) * rows + size_t(r);
    fn::dequant_nvfp4_row(packed.data() + at * cols / 2, scales.data() + at * cols / 16, 1.0f, cols,
                          out.data());
  }
};

struct Experts {
  int num_experts;
  int64_t hidden, inter;
  Projection gate_up, down;
  Experts(int e, int64_t d, int64_t i, uint64_t seed) : Experts(e, d, i, std::mt19937_64(seed)) {}

 private:
  Experts(int e, int64_t d, int64_t i, std::mt19937_64&& rng)
      : num_experts(e), hidden(d), inter(i), gate_up(e, 2 * i, d, 2, rng), down(e, d, i, 1, rng) {}
};

// Inputs of one launch: ids and weights [tokens, top_k], x [tokens, hidden] BF16 bits.
struct Batch {
  int top_k = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<uint16_t> x;
  int64_t tokens() const { return int64_t(ids.size()) / top_k; }
};

// Each token picks top_k distinct experts at random (and `forced`, when >= 0, in a random slot),
// positive weights summing to ~1, x ~ N(0, 1) in BF16.
Batch random_batch(int num_experts, int64_t hidden, int top_k, int64_t tokens, int forced,
                   uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch b;
  b.top_k = top_k;
  std::vector<int32_t> all(static_cast<size_t>(num_experts));
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> pick(all.begin(), all.begin() + top_k);
    if (forced >= 0 && std::find(pick.begin(), pick.end(), forced) == pick.end())
      pick[size_t(rng() % size_t(top_k))] = forced;
    b.ids.insert(b.ids.end(), pick.begin(), pick.end());
    float sum = 0;
    std::vector<float> w(static_cast<size_t>(top_k));
    for (auto& v : w) sum += v = 0.05f + float(rng() % 1000) / 1000.0f;
    for (auto& v : w) b.weights.push_back(v / sum);
  }
  b.x = fn::test::random_bf16_bits(size_t(tokens * hidden), 1.0f, seed + 1);
  return b;
}

// The rows of tokens `order` (in that order) of b.
Batch subset(const Batch& b, const std::vector<int64_t>& order, int64_t hidden) {
  Batch s;
  s.top_k = b.top_k;
  for (int64_t t : order) {
    s.ids.insert(s.ids.end(), b.ids.begin() + t * b.top_k, b.ids.begin() + (t + 1) * b.top_k);
    s.weights.insert(s.weights.end(), b.weights.begin() + t * b.top_k,
                     b.weights.begin() + (t + 1) * b.top_k);
    s.x.insert(s.x.end(), b.x.begin() + t * hidden, b.x.begin() + (t + 1) * hidden);
  }
  return s;
}

struct Result {
  std::vector<float> y;     // [tokens, hidden]
  std::vector<uint16_t> h;  // [tokens, top_k, inter]
};

// The launch shape of b on m (no pointers).
fn::MoeGroupedParams shape_of(const Experts& m, const Batch& b) {
  fn::MoeGroupedParams p;
  p.gate_up = m.gate_up.view(m.num_experts);
  p.down = m.down.view(m.num_experts);
  p.tokens = b.tokens();
  p.top_k = b.top_k;
  return p;
}

// b on the device with its outputs (y, h_out) and workspace; `params` launches on them.
struct DeviceBatch {
  DeviceArray<int32_t> ids;
  DeviceArray<float> w;
  DeviceArray<uint16_t> x;
  DeviceArray<float> y;
  DeviceArray<uint16_t> h;
  DeviceArray<uint8_t> ws;
  fn::MoeGroupedParams params;
  DeviceBatch(const Experts& m, const Batch& b)
      : ids(b.ids),
        w(b.weights),
        x(b.x),
        y(size_t(b.tokens() * m.hidden)),
        h(size_t(b.tokens() * b.top_k * m.inter)),
        ws(fn::moe_grouped_workspace_bytes(shape_of(m, b))),
        params(shape_of(m, b)) {
    params.ids = ids.ptr;
    params.weights = w.ptr;
    params.x = x.ptr;
    params.y = y.ptr;
    params.h_out = h.ptr;
    params.workspace = ws.ptr;
  }
};

// launch_moe_grouped on b (y and h poisoned first: both must be written), on `stream`.
Result run_grouped(const Experts& m, const Batch& b, cudaStream_t stream = nullptr) {
  DeviceBatch d(m, b);
  FN_CUDA_CHECK(cudaMemset(d.y.ptr, 0x7f, d.y.n * 4));
  FN_CUDA_CHECK(cudaMemset(d.h.ptr, 0x7f, d.h.n * 2));
  fn::launch_moe_grouped(d.params, stream);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  return Result{d.y.download(), d.h.download()};
}

// The bound model of the kernel's sums (as the bulk kernel's tests, test_cuda_moe_nvfp4.cpp): one
// m16n8k16 MMA adds 16 exact products to its FP32 accumulator and errs by at most 36 FP32 units
// times the sum of the magnitudes of its terms and C (alignment and truncation inside the tensor
// core), a chain of 8 MMAs per 128-column group, then at most 2 group adds, at most 10 warp adds,
// the * 2^26 (exact) and * global scale roundings: 36 * 8 + 2 + 10 + 2 rounding levels.
constexpr int kSumDepth = 36 * 8 + 2 + 10 + 2;

bool valid(int e, int num_experts) {
  return e >= 0 && e < num_experts;
}

// Checks r against the FP64 reference on every `stride`-th element (offset by route or token):
//   h: |h - hv| <= e32 + 2^-8 (|hv| + e32), hv = silu(g) u from the exact dots g and u, e32 the
//      propagation of the sums' bound gamma(kSumDepth) sum|terms| * gs through silu (|silu'| <=
//      1.1) and the product, plus 8 FP32 roundings of silu and the product; the BF16 rounding
//      errs by at most 2^-8 relative (cuda_test_util.h kBf16Unit).
//   y: the exact sum_j w_j gs_j (W_down h_j) of the kernel's own h, within gamma(kSumDepth +
//      top_k + 2) times sum_j |w_j gs_j| sum_i |W_down[d, i] h_j[i]| (the down dot's levels, the
//      yd product, the slot chain of fmaf).
void check_reference(const Experts& m, const Batch& b, const Result& r, int64_t stride) {
  const int64_t T = b.tokens(), D = m.hidden, I = m.inter;
  const int k = b.top_k;
  std::vector<float> x(b.x.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = fn::bf16_to_float(b.x[i]);
  const double gamma = fn::test::gamma_fp32(kSumDepth);
  // h, expert by expert (each weight row decoded once for all its routes).
  std::vector<float> row_g, row_u;
  int64_t checked = 0, wrong = 0;
  for (int e = 0; e < m.num_experts; ++e) {
    std::vector<int64_t> routes;
    for (int64_t q = 0; q < T * k; ++q)
      if (b.ids[size_t(q)] == e) routes.push_back(q);
    if (routes.empty()) continue;
    for (int64_t i = 0; i < I; ++i) {
      bool any = false;
      for (int64_t q : routes) any = any || (i + q) % stride == 0;
      if (!any) continue;
      m.gate_up.row(e, i, row_g);
      m.gate_up.row(e, I + i, row_u);
      const double gsg = m.gate_up.gscale[size_t(2 * e)], gsu = m.gate_up.gscale[size_t(2 * e + 1)];
      for (int64_t q : routes) {
        if ((i + q) % stride != 0) continue;
        const float* xt = x.data() + (q / k) * D;
        double sg = 0, ag = 0, su = 0, au = 0;
        for (int64_t c = 0; c < D; ++c) {
          sg += double(row_g[size_t(c)]) * xt[c];
          ag += std::fabs(double(row_g[size_t(c)]) * xt[c]);
          su += double(row_u[size_t(c)]) * xt[c];
          au += std::fabs(double(row_u[size_t(c)]) * xt[c]);
        }
        const double g = sg * gsg, u = su * gsu, eg = gamma * ag * gsg, eu = gamma * au * gsu;
        const double silu = g / (1.0 + std::exp(-g)), hv = silu * u;
        const double e32 = 1.1 * eg * std::fabs(u) + (std::fabs(silu) + 1.1 * eg) * eu +
                           8 * fn::test::kFp32Unit * std::fabs(hv);
        const double bound = e32 + fn::test::kBf16Unit * (std::fabs(hv) + e32);
        const double got = fn::bf16_to_float(r.h[size_t(q * I + i)]);
        ++checked;
        if (!(std::fabs(got - hv) <= bound)) {
          if (++wrong <= 5)
            MESSAGE("h at route " << q << " i " << i << ": " << got << " vs " << hv << " bound "
                                  << bound);
        }
      }
    }
  }
  // Invalid routes: h = 0.
  for (int64_t q = 0; q < T * k; ++q)
    if (!valid(b.ids[size_t(q)], m.num_experts))
      for (int64_t i = 0; i < I; ++i) wrong += r.h[size_t(q * I + i)] != 0;
  CHECK_MESSAGE(wrong == 0, "h: ", wrong, " of ", checked, " wrong");
  // y from the kernel's own h.
  std::vector<float> row_d;
  const double gamma_y = fn::test::gamma_fp32(kSumDepth + k + 2);
  std::vector<float> got, want_f;
  std::vector<double> want, bound;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      if ((d + t) % stride != 0) continue;
      double s = 0, a = 0;
      for (int j = 0; j < k; ++j) {
        const int e = b.ids[size_t(t * k + j)];
        if (!valid(e, m.num_experts)) continue;
        m.down.row(e, d, row_d);
        const double f = double(b.weights[size_t(t * k + j)]) * m.down.gscale[size_t(e)];
        const uint16_t* hj = r.h.data() + (t * k + j) * I;
        double dot = 0, mag = 0;
        for (int64_t i = 0; i < I; ++i) {
          const double p = double(row_d[size_t(i)]) * fn::bf16_to_float(hj[i]);
          dot += p;
          mag += std::fabs(p);
        }
        s += f * dot;
        a += std::fabs(f) * mag;
      }
      got.push_back(r.y[size_t(t * D + d)]);
      want.push_back(s);
      bound.push_back(gamma_y * a);
    }
  const auto c = fn::test::compare_bounded(got, want, bound);
  CHECK_MESSAGE(c.wrong == 0, "y: ", c.describe());
}

bool device_ok() {
  if (fn::moe_grouped_supported(2560, 640, 10)) return true;
  MESSAGE("grouped routed experts: not on this device (sm_90+ only)");
  return false;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace

TEST_CASE("moe grouped: small shapes match the FP64 reference") {
  if (!device_ok()) return;
  struct Shape {
    int experts;
    int64_t hidden, inter;
    int top_k;
    int64_t tokens;
  };
  // inter 96 and 160: a last 128-column group half or three quarters full in the down.
  const Shape shapes[] = {{8, 256, 128, 2, 5},   {16, 512, 256, 4, 33}, {64, 256, 128, 10, 64},
                          {32, 512, 96, 3, 9},   {8, 256, 160, 8, 2},   {64, 512, 256, 6, 1},
                          {24, 256, 128, 5, 130}};
  uint64_t seed = 10;
  for (const Shape& s : shapes) {
    CAPTURE(s.experts);
    CAPTURE(s.hidden);
    CAPTURE(s.inter);
    CAPTURE(s.top_k);
    CAPTURE(s.tokens);
    const Experts m(s.experts, s.hidden, s.inter, seed++);
    const Batch b = random_batch(s.experts, s.hidden, s.top_k, s.tokens, -1, seed++);
    check_reference(m, b, run_grouped(m, b), 1);
  }
}

TEST_CASE("moe grouped: the real shapes (E 512, top_k 10, hidden 2560, I 640 and 320)") {
  if (!device_ok()) return;
  for (const int64_t inter : {int64_t{640}, int64_t{320}}) {
    CAPTURE(inter);
    const Experts m(512, 2560, inter, 20 + uint64_t(inter));
    for (const int64_t tokens : {1, 2, 3, 8, 64, 129}) {
      CAPTURE(tokens);
      // From 64 tokens on, expert 7 is in every token's list: > 8 routes on one expert.
      const Batch b = random_batch(512, 2560, 10, tokens, tokens >= 64 ? 7 : -1, 30 + tokens);
      check_reference(m, b, run_grouped(m, b), tokens >= 64 ? 7 : 1);
      if (inter == 320) break;  // TP=2: one token count (the shape's partial column group)
    }
  }
}

TEST_CASE("moe grouped: invalid ids, one expert for every token, duplicates, zero tokens") {
  if (!device_ok()) return;
  const int E = 16;
  const Experts m(E, 512, 128, 40);
  // Invalid ids (-1, E, large) mixed with valid ones; one token with no valid id (y = 0).
  {
    Batch b = random_batch(E, 512, 4, 6, -1, 41);
    b.ids[1] = -1;
    b.ids[6] = E;
    b.ids[11] = 1 << 30;
    for (int j = 0; j < 4; ++j) b.ids[size_t(3 * 4 + j)] = -7;
    const Result r = run_grouped(m, b);
    check_reference(m, b, r, 1);
    for (int64_t d = 0; d < 512; ++d) CHECK(r.y[size_t(3 * 512 + d)] == 0.0f);
  }
  // Every token chooses expert 5 (64 routes on one expert: eight batches of 8 columns).
  {
    Batch b = random_batch(E, 512, 2, 64, 5, 42);
    check_reference(m, b, run_grouped(m, b), 1);
    std::fill(b.ids.begin(), b.ids.end(), 5);  // and with both slots: 128 routes
    check_reference(m, b, run_grouped(m, b), 1);
  }
  // One token, and one token with the same expert in several slots (each slot a route).
  {
    Batch b = random_batch(E, 512, 6, 1, -1, 43);
    check_reference(m, b, run_grouped(m, b), 1);
    b.ids = {3, 3, 9, 3, 9, 0};
    const Result r = run_grouped(m, b);
    check_reference(m, b, r, 1);
    for (int64_t i = 0; i < 128; ++i) {
      CHECK(r.h[size_t(i)] == r.h[size_t(128 + i)]);  // the same expert and x: the same h
      CHECK(r.h[size_t(i)] == r.h[size_t(3 * 128 + i)]);
    }
  }
  // Every id invalid: y = 0, h = 0.
  {
    Batch b = random_batch(E, 512, 3, 4, -1, 44);
    std::fill(b.ids.begin(), b.ids.end(), -1);
    const Result r = run_grouped(m, b);
    for (float v : r.y) CHECK(v == 0.0f);
    for (uint16_t v : r.h) CHECK(v == 0);
  }
  // Zero tokens: nothing is launched, nothing is written (null pointers allowed).
  {
    DeviceArray<float> y(16);
    FN_CUDA_CHECK(cudaMemset(y.ptr, 0x7f, 64));
    fn::MoeGroupedParams p;
    p.gate_up = m.gate_up.view(E);
    p.down = m.down.view(E);
    p.top_k = 4;
    p.tokens = 0;
    p.y = y.ptr;
    CHECK(fn::moe_grouped_workspace_bytes(p) > 0);
    fn::launch_moe_grouped(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    for (float v : y.download()) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      CHECK(bits == 0x7f7f7f7fu);
    }
  }
}

TEST_CASE("moe grouped: each token's bits are those of the token alone and in reverse order") {
  if (!device_ok()) return;
  for (const int64_t inter : {int64_t{640}, int64_t{128}}) {
    CAPTURE(inter);
    const int E = 64, k = 8;
    const int64_t D = inter == 640 ? 2560 : 512, T = 40;
    const Experts m(E, D, inter, 50 + uint64_t(inter));
    const Batch b = random_batch(E, D, k, T, 3, 51);  // expert 3 shared by all: 5 batches
    const Result all = run_grouped(m, b);
    std::vector<int64_t> rev(static_cast<size_t>(T));
    std::iota(rev.rbegin(), rev.rend(), int64_t{0});
    const Result back = run_grouped(m, subset(b, rev, D));
    int64_t differ = 0;
    for (int64_t t = 0; t < T; ++t) {
      const Result alone = run_grouped(m, subset(b, {t}, D));
      const int64_t rt = T - 1 - t;  // t's row in the reversed launch
      differ += std::memcmp(alone.y.data(), all.y.data() + t * D, size_t(D) * 4) != 0;
      differ += std::memcmp(back.y.data() + rt * D, all.y.data() + t * D, size_t(D) * 4) != 0;
      differ +=
          std::memcmp(alone.h.data(), all.h.data() + t * k * inter, size_t(k * inter) * 2) != 0;
      differ += std::memcmp(back.h.data() + rt * k * inter, all.h.data() + t * k * inter,
                            size_t(k * inter) * 2) != 0;
    }
    CHECK(differ == 0);
  }
}

TEST_CASE("moe grouped: bitwise run to run and under CUDA graph replay, ids read on the device") {
  if (!device_ok()) return;
  const int E = 128, k = 10;
  const int64_t D = 2560, I = 640, T = 24;
  const Experts m(E, D, I, 60);
  const Batch b1 = random_batch(E, D, k, T, -1, 61);
  const Batch b2 = random_batch(E, D, k, T, 9, 62);  // other ids, other distinct count
  const Result ref1 = run_grouped(m, b1), ref2 = run_grouped(m, b2);
  const Result again = run_grouped(m, b1);
  CHECK(same_bits(again.y, ref1.y));
  CHECK(again.h == ref1.h);

  cudaStream_t stream;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceBatch d(m, b1);
  DeviceArray<int32_t>& ids = d.ids;
  DeviceArray<float>& w = d.w;
  DeviceArray<uint16_t>& x = d.x;
  DeviceArray<float>& y = d.y;
  DeviceArray<uint16_t>& h = d.h;
  const fn::MoeGroupedParams& p = d.params;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  fn::launch_moe_grouped(p, stream);
  FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) {
    FN_CUDA_CHECK(cudaMemsetAsync(y.ptr, 0x7f, y.n * 4, stream));
    FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    CHECK(same_bits(y.download(), ref1.y));
    CHECK(h.download() == ref1.h);
  }
  // New ids, weights and x in the same buffers: the replay follows them.
  ids.upload(b2.ids);
  w.upload(b2.weights);
  x.upload(b2.x);
  FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));
  CHECK(same_bits(y.download(), ref2.y));
  CHECK(h.download() == ref2.h);
  FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FN_CUDA_CHECK(cudaGraphDestroy(graph));
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("moe grouped: bad pointers, shapes and alignment are rejected") {
  CHECK(!fn::moe_grouped_supported(2560, 48, 10));   // inter not a multiple of 32
  CHECK(!fn::moe_grouped_supported(2576, 640, 10));  // hidden not a multiple of 256
  CHECK(!fn::moe_grouped_supported(5120, 640, 10));  // hidden > 2560
  CHECK(!fn::moe_grouped_supported(2560, 640, 0));   // top_k < 1
  if (!device_ok()) return;
  CHECK(fn::moe_grouped_supported(2560, 320, 10));
  const int E = 8;
  const Experts m(E, 256, 128, 70);
  const Experts other(E, 512, 128, 71);
  const Batch b = random_batch(E, 256, 2, 3, -1, 72);
  DeviceArray<int32_t> ids(b.ids);
  DeviceArray<float> w(b.weights);
  DeviceArray<uint16_t> x(b.x);
  DeviceArray<float> y(3 * 256);
  fn::MoeGroupedParams good;
  good.gate_up = m.gate_up.view(E);
  good.down = m.down.view(E);
  good.ids = ids.ptr;
  good.weights = w.ptr;
  good.tokens = 3;
  good.top_k = 2;
  good.x = x.ptr;
  good.y = y.ptr;
  DeviceArray<uint8_t> ws(fn::moe_grouped_workspace_bytes(good) + 256);
  good.workspace = ws.ptr;
  fn::launch_moe_grouped(good, nullptr);  // the baseline is accepted
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto rejects = [&](auto&& edit) {
    fn::MoeGroupedParams p = good;
    edit(p);
    CHECK_THROWS_AS(fn::launch_moe_grouped(p, nullptr), fn::Error);
  };
  rejects([](fn::MoeGroupedParams& p) { p.x = nullptr; });
  rejects([](fn::MoeGroupedParams& p) { p.y = nullptr; });
  rejects([](fn::MoeGroupedParams& p) { p.ids = nullptr; });
  rejects([](fn::MoeGroupedParams& p) { p.weights = nullptr; });
  rejects([](fn::MoeGroupedParams& p) { p.workspace = nullptr; });
  rejects([](fn::MoeGroupedParams& p) { p.down.packed = nullptr; });
  rejects([](fn::MoeGroupedParams& p) { p.gate_up.global_scale = nullptr; });
  rejects([](fn::MoeGroupedParams& p) { p.top_k = 0; });
  rejects([](fn::MoeGroupedParams& p) { p.tokens = -1; });
  rejects([&](fn::MoeGroupedParams& p) { p.down = other.down.view(E); });  // hidden 512 vs 256
  rejects([](fn::MoeGroupedParams& p) { p.down.num_experts = E - 1; });
  rejects([](fn::MoeGroupedParams& p) { p.gate_up.num_experts = p.down.num_experts = 5000; });
  rejects([](fn::MoeGroupedParams& p) { p.gate_up.rows = 2 * 96; });  // 2 * I != gate_up.rows
  rejects([](fn::MoeGroupedParams& p) { p.x += 1; });                 // misaligned
  rejects([](fn::MoeGroupedParams& p) { p.workspace = static_cast<uint8_t*>(p.workspace) + 16; });
  {  // hidden 384 (not a multiple of 256) and inter 48 (not a multiple of 32)
    const Experts bad_d(E, 384, 128, 73), bad_i(E, 256, 48, 74);
    rejects([&](fn::MoeGroupedParams& p) {
      p.gate_up = bad_d.gate_up.view(E);
      p.down = bad_d.down.view(E);
    });
    rejects([&](fn::MoeGroupedParams& p) {
      p.gate_up = bad_i.gate_up.view(E);
      p.down = bad_i.down.view(E);
    });
  }
  fn::MoeGroupedParams neg;
  neg.tokens = -1;
  neg.top_k = 1;
  CHECK_THROWS_AS(fn::moe_grouped_workspace_bytes(neg), fn::Error);
}

TEST_CASE("moe grouped: real-shape timings against the per-route kernels (FN_BENCH=1)") {
  const char* bench = std::getenv("FN_BENCH");
  if (bench == nullptr || std::string(bench) != "1" || !device_ok()) return;
  const int E = 512, k = 10;
  const int64_t D = 2560, I = 640;
  const Experts m(E, D, I, 80);
  cudaStream_t stream;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const int64_t T : {1, 8, 32, 64}) {
    const Batch b = random_batch(E, D, k, T, -1, 81 + uint64_t(T));
    DeviceBatch d(m, b);
    fn::MoeGroupedParams p = d.params;
    p.h_out = nullptr;  // production's launch
    const DeviceArray<int32_t>& ids = d.ids;
    const DeviceArray<float>& w = d.w;
    const DeviceArray<uint16_t>& x = d.x;
    const DeviceArray<float>& y = d.y;
    const DeviceArray<uint16_t>& h = d.h;
    const double grouped = fn::test::graph_us_per_call(
        stream, 1, 20, [&](cudaStream_t s) { fn::launch_moe_grouped(p, s); });
    // The per-route path: the bulk gate+up and the FP32 down, tokens side by side.
    fn::MoeGateUpParams g;
    g.experts = p.gate_up;
    g.expert_ids = ids.ptr;
    g.top_k = k;
    g.x = x.ptr;
    g.h = h.ptr;
    g.bulk = fn::moe_gate_up_bulk_supported(k, I, D);
    g.tokens = T;
    fn::MoeDownParams dn;
    dn.experts = p.down;
    dn.expert_ids = ids.ptr;
    dn.routing_weights = w.ptr;
    dn.top_k = k;
    dn.h = h.ptr;
    dn.y = y.ptr;
    dn.tokens = T;
    const double per_route = fn::test::graph_us_per_call(stream, 1, 20, [&](cudaStream_t s) {
      fn::launch_moe_gate_up_nvfp4(g, s);
      fn::launch_moe_down_nvfp4(dn, s);
    });
    std::vector<int32_t> sorted = b.ids;
    std::sort(sorted.begin(), sorted.end());
    const auto distinct = std::unique(sorted.begin(), sorted.end()) - sorted.begin();
    const double bytes = double(distinct) * 2 * (2.0 * I * D / 2 + 2.0 * I * D / 16);
    MESSAGE("tokens " << T << " (" << distinct << " experts): grouped " << grouped << " us ("
                      << bytes / grouped / 1e3 << " GB/s of weights), per-route " << per_route
                      << " us");
  }
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
}
