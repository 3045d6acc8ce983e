// GPU tests of the Gated DeltaNet prefill kernels (cuda/kernels/gdn_prefill.h) against their
// definition: M successive launch_gdn_decode calls (cuda/kernels/gdn.h, itself checked against the
// CPU ops in test_cuda_gdn.cpp) on copies of the same inputs, from a non-zero initial state and
// conv state. Compared: the conv state (bitwise: pure data movement), the FP32 state (within 1e-5
// of its largest magnitude), the BF16 outputs (one BF16 ulp of the element plus 1e-5 of the largest
// output); the derivation is above check_same. Lengths around the chunked scan's 64-token chunks,
// gates at their extremes (no decay, decay to zero, beta 0 and 1). Also prefill(a) +
// prefill(M - a) against prefill(M) (bitwise where a is a multiple of 64), every scan slice width
// bitwise, runs of several slots in one launch bitwise each run alone, launcher checks, and a
// bench (FN_BENCH=1) at the real shapes with M = 8192.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/codecs.h"
#include "core/error.h"
#include "cuda/kernels/gdn.h"
#include "cuda/kernels/gdn_prefill.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;

inline size_t sz(int64_t n) {
  return static_cast<size_t>(n);
}

struct Shape {
  int Hk, Hv, dk, dv;
  int K = 4;
  int64_t conv_dim() const { return 2 * int64_t{Hk} * dk + int64_t{Hv} * dv; }
  int64_t proj_len() const { return conv_dim() + int64_t{Hv} * dv + 2 * int64_t{Hv}; }
  int64_t state_len() const { return int64_t{Hv} * dk * dv; }
  int64_t out_len() const { return int64_t{Hv} * dv; }
  int64_t conv_state_len() const { return conv_dim() * (K - 1); }
};

std::vector<float> normal(size_t n, float mean, float sigma, std::mt19937_64& rng) {
  std::normal_distribution<float> d(mean, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Fast uniform fill for the bench's large projections (variance 1, mean 0).
std::vector<float> uniform_fast(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& f : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    f = (static_cast<float>(x >> 40) / 16777216.0f - 0.5f) * 3.4641016f;
  }
  return v;
}

// The layer's fixed weights and M rows of projections (row stride > proj_len, to check the
// stride), on the device.
struct Layer {
  Shape s;
  int64_t M, stride;
  DeviceArray<float> proj, conv_w, A_log, dt_bias, norm_w;
  Layer(const Shape& shape, int64_t tokens, std::mt19937_64& rng, bool fast_proj = false)
      : s(shape),
        M(tokens),
        stride(shape.proj_len() + 4),
        proj(sz(tokens * (shape.proj_len() + 4))),
        conv_w(normal(sz(shape.conv_dim() * shape.K), 0.0f, 0.5f, rng)),
        A_log(sz(shape.Hv)),
        dt_bias(normal(sz(shape.Hv), 0.0f, 1.0f, rng)),
        norm_w(normal(sz(shape.dv), 1.0f, 0.3f, rng)) {
    std::uniform_real_distribution<float> al(-4.0f, 0.5f);  // decays from ~0.3 to ~1
    std::vector<float> a(sz(s.Hv));
    for (auto& x : a) x = al(rng);
    A_log.upload(a);
    proj.upload(fast_proj ? uniform_fast(proj.n, rng()) : normal(proj.n, 0.0f, 1.0f, rng));
  }
};

// States and outputs after some tokens.
struct Result {
  std::vector<float> cs, S;
  std::vector<uint16_t> out;  // [M, Hv*dv]
};

// M launch_gdn_decode steps from (cs0, S0): the reference.
Result run_decode(const Layer& L, const std::vector<float>& cs0, const std::vector<float>& S0) {
  const Shape& s = L.s;
  DeviceArray<float> cs(cs0), S(S0), o_scratch(sz(s.out_len()));
  DeviceArray<uint16_t> out(sz(L.M * s.out_len()));
  DeviceArray<unsigned int> counters(sz(s.Hv + s.Hk));
  FN_CUDA_CHECK(cudaMemset(counters.ptr, 0, counters.n * sizeof(unsigned int)));
  fn::GdnDecodeParams p;
  p.conv_weight = L.conv_w.ptr;
  p.A_log = L.A_log.ptr;
  p.dt_bias = L.dt_bias.ptr;
  p.norm_weight = L.norm_w.ptr;
  p.conv_state = cs.ptr;
  p.state = S.ptr;
  p.num_k_heads = s.Hk;
  p.num_v_heads = s.Hv;
  p.k_head_dim = s.dk;
  p.v_head_dim = s.dv;
  p.conv_kernel = s.K;
  p.eps = 1e-6f;
  p.o_scratch = o_scratch.ptr;
  p.head_counters = counters.ptr;
  for (int64_t t = 0; t < L.M; ++t) {
    p.proj = L.proj.ptr + t * L.stride;
    p.out = out.ptr + t * s.out_len();
    fn::launch_gdn_decode(p, nullptr);
  }
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  return {cs.download(), S.download(), out.download()};
}

fn::GdnPrefillParams prefill_params(const Layer& L, float* cs, float* S, uint16_t* out) {
  const Shape& s = L.s;
  fn::GdnPrefillParams p;
  p.proj = L.proj.ptr;
  p.proj_stride = L.stride;
  p.tokens = L.M;
  p.conv_weight = L.conv_w.ptr;
  p.A_log = L.A_log.ptr;
  p.dt_bias = L.dt_bias.ptr;
  p.norm_weight = L.norm_w.ptr;
  p.conv_state = cs;
  p.state = S;
  p.out = out;
  p.num_k_heads = s.Hk;
  p.num_v_heads = s.Hv;
  p.k_head_dim = s.dk;
  p.v_head_dim = s.dv;
  p.conv_kernel = s.K;
  p.eps = 1e-6f;
  return p;
}

// Prefill of the rows given by `pieces` (consecutive chunks covering 0..M-1, one launch each)
// from (cs0, S0); slice: the scan's slice_columns (0: planned).
Result run_prefill(const Layer& L, const std::vector<float>& cs0, const std::vector<float>& S0,
                   const std::vector<int64_t>& pieces, int slice = 0) {
  const Shape& s = L.s;
  DeviceArray<float> cs(cs0), S(S0);
  DeviceArray<uint16_t> out(sz(L.M * s.out_len()));
  FN_CUDA_CHECK(cudaMemset(out.ptr, 0xff, out.n * sizeof(uint16_t)));  // NaN: unwritten rows show
  int64_t first = 0;
  for (const int64_t n : pieces) {
    fn::GdnPrefillParams p = prefill_params(L, cs.ptr, S.ptr, out.ptr + first * s.out_len());
    p.proj = L.proj.ptr + first * L.stride;
    p.tokens = n;
    p.slice_columns = slice;
    DeviceArray<unsigned char> ws(fn::gdn_prefill_workspace_bytes(p));
    p.workspace = ws.ptr;
    fn::launch_gdn_prefill(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    first += n;
  }
  REQUIRE(first == L.M);
  return {cs.download(), S.download(), out.download()};
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (const float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

// One BF16 ulp at |x| (the spacing of BF16 values in x's binade; 8 significant bits).
double bf16_ulp(double x) {
  if (x == 0) return 0;
  int e;
  std::frexp(x, &e);  // |x| = f * 2^e, f in [0.5, 1)
  return std::ldexp(1.0, e - 8);
}

// Prefill against decode. The tolerances: the conv state is moved, never computed, so it must be
// bitwise equal. The FP32 state differs by rounding only. The sequential scan (dk > 128, or no
// tensor cores) does decode's operations in other summation orders: a few ulps of max|S|. The
// chunked scan regroups the recurrence per 64-token chunk (D = U - W S, S' = e^G S + K'^T D) and
// takes its products in 3xTF32: x = hi + lo with |x - hi - lo| <= 2^-24 |x| and the dropped
// lo*lo <= 2^-24 |a b|, so each product is within about 3 * 2^-24 relative, and the tensor core's
// FP32 sums (which may truncate) within 2^-23 per add. One element of D or S' sums at most
// 128 + 64 terms; the inputs are O(1) (|k^| = 1, so |k^_d| <= 1 and typically 0.1; beta <= 1;
// T = (I + A)^-1 diag(beta) is the chunk's sequence of non-expansive delta-rule steps, so its
// entries are O(1)), so one chunk adds at most about 192 * 0.1 * 2^-23 = 2.3e-6 of max|S|, and
// typically sqrt(192) * 0.1 * 2^-23 = 1.7e-7. Decay and the non-expansive updates keep the
// errors of earlier chunks from growing: without decay they add up, at most 16 chunks here
// (M <= 1000) or 128 in the bench, sqrt(16) * 1.7e-7 = 7e-7 and sqrt(128) * 1.7e-7 = 2e-6
// typical. 1e-5 of max|S| (about 170 FP32 ulps of the largest entry) is above all of that and far
// below any real error (a wrong token, gate, chunk boundary or head is O(max|S|)). The BF16
// output of two FP32 values that differ by rounding is equal or one BF16 ulp apart (a rounding
// boundary between them; the relative error above is far below the 2^-8 of one ulp); near-zero
// outputs (cancellation in S^T q) may differ by their FP32 error in absolute terms, hence 1e-5
// of max|out| added.
void check_same(const Shape& s, const Result& got, const Result& ref,
                const std::vector<float>& S0) {
  CHECK(std::memcmp(got.cs.data(), ref.cs.data(), got.cs.size() * sizeof(float)) == 0);
  const double smax = max_abs(ref.S);
  double sworst = 0, moved = 0;
  for (size_t e = 0; e < ref.S.size(); ++e) {
    sworst = std::max(sworst, double(std::fabs(got.S[e] - ref.S[e])));
    moved = std::max(moved, double(std::fabs(ref.S[e] - S0[e])));
  }
  CHECK_MESSAGE(sworst <= 1e-5 * smax, "state: max |diff| ", sworst, ", max |S| ", smax);
  CHECK(moved > 1e-3 * smax);  // the state did change (not a comparison of untouched buffers)
  double omax = 0;
  for (const uint16_t b : ref.out) omax = std::max(omax, double(std::fabs(fn::bf16_to_float(b))));
  int64_t wrong = 0, nan = 0;
  double worst = 0;
  int64_t worst_at = -1;
  for (size_t e = 0; e < ref.out.size(); ++e) {
    const double a = fn::bf16_to_float(got.out[e]), b = fn::bf16_to_float(ref.out[e]);
    if (std::isnan(a) || std::isnan(b)) {
      ++nan;
      continue;
    }
    const double bound = bf16_ulp(std::max(std::fabs(a), std::fabs(b))) + 1e-5 * omax;
    const double ratio = std::fabs(a - b) / bound;
    if (ratio > 1) ++wrong;
    if (ratio > worst) {
      worst = ratio;
      worst_at = static_cast<int64_t>(e);
    }
  }
  if (std::getenv("FN_BENCH") != nullptr)  // margins, for the record
    MESSAGE("margins: state max|diff|/max|S| ", sworst / smax, ", out worst ratio ", worst);
  CHECK(nan == 0);
  CHECK_MESSAGE(wrong == 0, "out: ", wrong, " of ", ref.out.size(), " outside, worst ratio ", worst,
                " at token ", worst_at / s.out_len(), " channel ", worst_at % s.out_len());
  CHECK(omax > 0.1);
}

// Gates at their extremes, per value head h (mode h % 6): 0 decay to zero (g about -200: exp(g)
// underflows to 0, G falls by 200 per token), 1 no decay (g about -3e-10: exp(g) rounds to 1),
// 2 beta = 0 (b = -200: sigmoid exactly 0), 3 beta = 1 (b = +200: exactly 1), 4 beta = 1 and no
// decay (pure delta rule: the largest T = (I + A)^-1), 5 g = -softplus(x) with x drawn per token
// from [-20, 50] (decays from e^-50 to 1 inside one chunk).
void extreme_gates(Layer& L, std::mt19937_64& rng) {
  const Shape& s = L.s;
  std::vector<float> proj = L.proj.download(), A_log = L.A_log.download();
  const int64_t a0 = s.conv_dim() + int64_t{s.Hv} * s.dv, b0 = a0 + s.Hv;
  std::vector<float> dt = L.dt_bias.download();
  std::uniform_real_distribution<float> wide(-20.0f, 50.0f);
  for (int h = 0; h < s.Hv; ++h) {
    const int mode = h % 6;
    if (mode == 0) A_log[sz(h)] = std::log(20.0f);  // -g = 20 * softplus(a + dt) with a + dt = 10
    if (mode == 1 || mode == 4) A_log[sz(h)] = -12.0f;  // 6e-6 * softplus(-10) = 3e-10
    if (mode == 5) A_log[sz(h)] = 0.0f;                 // g = -softplus(a + dt_bias)
    for (int64_t p = 0; p < L.M; ++p) {
      float* row = proj.data() + p * L.stride;
      if (mode == 0) row[a0 + h] = 10.0f - dt[sz(h)];
      if (mode == 1 || mode == 4) row[a0 + h] = -10.0f - dt[sz(h)];
      if (mode == 5) row[a0 + h] = wide(rng) - dt[sz(h)];
      if (mode == 2) row[b0 + h] = -200.0f;
      if (mode == 3 || mode == 4) row[b0 + h] = 200.0f;
    }
  }
  L.proj.upload(proj);
  L.A_log.upload(A_log);
}

void compare_with_decode(const Shape& s, const std::vector<int64_t>& Ms, uint64_t seed,
                         bool extreme = false) {
  for (const int64_t M : Ms) {
    INFO("Hk ", s.Hk, " Hv ", s.Hv, " dk ", s.dk, " dv ", s.dv, " K ", s.K, " M ", M,
         extreme ? " extreme gates" : "");
    std::mt19937_64 rng(seed + uint64_t(M));
    Layer L(s, M, rng);
    if (extreme) extreme_gates(L, rng);
    const auto cs0 = normal(sz(s.conv_state_len()), 0.0f, 1.0f, rng);
    const auto S0 = normal(sz(s.state_len()), 0.0f, 0.3f, rng);
    const Result ref = run_decode(L, cs0, S0);
    const Result got = run_prefill(L, cs0, S0, {M});
    check_same(s, got, ref, S0);
  }
}

bool bitwise_same(const Result& a, const Result& b) {
  return a.cs == b.cs && a.out == b.out &&
         std::memcmp(a.S.data(), b.S.data(), a.S.size() * sizeof(float)) == 0;
}

const std::vector<int64_t> kLengths = {1, 2, 3, 5, 17, 63, 64, 65, 127, 128, 129, 200};

}  // namespace

TEST_CASE("cuda gdn prefill: small heads (dk = dv = 8, 16) leave the state of M decode steps") {
  compare_with_decode(Shape{1, 3, 8, 8}, kLengths, 100);
  compare_with_decode(Shape{2, 6, 16, 16}, kLengths, 200);
}

TEST_CASE("cuda gdn prefill: 128-dim heads leave the state and outputs of M decode steps") {
  compare_with_decode(Shape{1, 2, 128, 128}, kLengths, 300);
  compare_with_decode(Shape{1, 2, 128, 128}, {1000}, 350);
  compare_with_decode(Shape{2, 4, 128, 128}, {3, 65, 200}, 400);
}

TEST_CASE("cuda gdn prefill: decay to zero, no decay, beta 0 and 1 leave the decode state") {
  compare_with_decode(Shape{2, 6, 128, 128}, {1, 63, 64, 65, 129, 1000}, 450, true);
  compare_with_decode(Shape{1, 6, 16, 16}, {1, 64, 200}, 460, true);
}

TEST_CASE("cuda gdn prefill: unequal head dims, conv kernel 2 and 3, dk not a power of two") {
  compare_with_decode(Shape{2, 4, 32, 64}, {1, 5, 65}, 500);
  compare_with_decode(Shape{2, 6, 16, 16, 2}, {1, 2, 17}, 600);
  compare_with_decode(Shape{2, 6, 16, 16, 3}, {1, 2, 3, 17}, 650);
  compare_with_decode(Shape{1, 1, 12, 20}, {1, 17, 65}, 700);
  compare_with_decode(Shape{1, 2, 256, 32}, {2, 33}, 800);
}

TEST_CASE("cuda gdn prefill: prefill(a) then prefill(M - a) is prefill(M), bitwise at chunks") {
  for (const Shape s : {Shape{2, 6, 16, 16}, Shape{1, 2, 128, 128}, Shape{1, 2, 256, 32}}) {
    std::mt19937_64 rng(900);
    const int64_t M = 200;
    const Layer L(s, M, rng);
    const auto cs0 = normal(sz(s.conv_state_len()), 0.0f, 1.0f, rng);
    const auto S0 = normal(sz(s.state_len()), 0.0f, 0.3f, rng);
    const Result whole = run_prefill(L, cs0, S0, {M});
    // Splits at multiples of 64 keep the chunked scan's chunks (and the sequential scan is
    // bitwise for every split): the same arithmetic, the state through memory in between.
    for (const int64_t a : {int64_t{64}, int64_t{128}}) {
      INFO("dk ", s.dk, " split ", a, " + ", M - a);
      CHECK(bitwise_same(run_prefill(L, cs0, S0, {a, M - a}), whole));
    }
    // Other splits move the chunk boundaries: the same function within check_same's rounding.
    for (const int64_t a :
         {int64_t{1}, int64_t{2}, int64_t{17}, int64_t{63}, int64_t{65}, int64_t{199}}) {
      INFO("dk ", s.dk, " split ", a, " + ", M - a);
      check_same(s, run_prefill(L, cs0, S0, {a, M - a}), whole, S0);
    }
    std::vector<int64_t> seventeens(M / 17, 17);
    seventeens.push_back(M % 17);
    check_same(s, run_prefill(L, cs0, S0, seventeens), whole, S0);
    std::vector<int64_t> ones(sz(M), 1);  // single-token prefills, history from the conv state
    check_same(s, run_prefill(L, cs0, S0, ones), whole, S0);
  }
}

// The slice widths this device's scan takes (32 and 64 for the chunked scan, 4..64 dividing dv
// for the sequential one): the others are rejected by the launcher.
std::vector<int> accepted_slices(const Layer& L) {
  std::vector<int> ok;
  for (const int slice : {4, 8, 16, 32, 64}) {
    DeviceArray<float> cs(sz(L.s.conv_state_len())), S(sz(L.s.state_len()));
    DeviceArray<uint16_t> out(sz(L.M * L.s.out_len()));
    fn::GdnPrefillParams p = prefill_params(L, cs.ptr, S.ptr, out.ptr);
    p.slice_columns = slice;
    DeviceArray<unsigned char> ws(fn::gdn_prefill_workspace_bytes(p));
    p.workspace = ws.ptr;
    try {
      if (fn::plan_gdn_prefill_slice(p) == slice) ok.push_back(slice);
    } catch (const fn::Error&) {
    }
  }
  return ok;
}

TEST_CASE("cuda gdn prefill: every scan slice width gives the same bits, the planned one too") {
  for (const Shape s : {Shape{1, 2, 128, 128}, Shape{1, 2, 128, 96}, Shape{1, 1, 12, 24}}) {
    INFO("dk ", s.dk, " dv ", s.dv);
    std::mt19937_64 rng(1000);
    const Layer L(s, 140, rng);
    const auto cs0 = normal(sz(s.conv_state_len()), 0.0f, 1.0f, rng);
    const auto S0 = normal(sz(s.state_len()), 0.0f, 0.3f, rng);
    const Result planned = run_prefill(L, cs0, S0, {140});
    const std::vector<int> slices = accepted_slices(L);
    CHECK(slices.size() >= 2);
    for (const int slice : slices) {
      INFO("slice ", slice);
      CHECK(bitwise_same(run_prefill(L, cs0, S0, {140}, slice), planned));
    }
  }
}

// Runs side by side (GdnPrefillParams::runs): `lengths` sequences of one launch on the slots
// `run_slot` of `slots` slots, each from its own random states, against each run launched alone
// on copies of its slot's states. Bitwise: a run's arithmetic is its lone launch's.
void compare_runs(const Shape& s, const std::vector<int64_t>& lengths,
                  const std::vector<int32_t>& run_slot, int slots, uint64_t seed) {
  INFO("Hk ", s.Hk, " Hv ", s.Hv, " dk ", s.dk, " dv ", s.dv, " K ", s.K, " runs ", lengths.size());
  REQUIRE(lengths.size() == run_slot.size());
  std::mt19937_64 rng(seed);
  std::vector<int32_t> start{0};
  for (const int64_t n : lengths) start.push_back(start.back() + static_cast<int32_t>(n));
  const int64_t M = start.back();
  const Layer L(s, M, rng);
  std::vector<std::vector<float>> cs0, S0;
  for (int i = 0; i < slots; ++i) {
    cs0.push_back(normal(sz(s.conv_state_len()), 0.0f, 1.0f, rng));
    S0.push_back(normal(sz(s.state_len()), 0.0f, 0.3f, rng));
  }
  // The reference: each run alone.
  std::vector<Result> alone;
  for (size_t r = 0; r < lengths.size(); ++r) {
    const int slot = run_slot[r];
    DeviceArray<float> cs(cs0[sz(slot)]), S(S0[sz(slot)]);
    DeviceArray<uint16_t> out(sz(lengths[r] * s.out_len()));
    fn::GdnPrefillParams p = prefill_params(L, cs.ptr, S.ptr, out.ptr);
    p.proj = L.proj.ptr + start[r] * L.stride;
    p.tokens = lengths[r];
    DeviceArray<unsigned char> ws(fn::gdn_prefill_workspace_bytes(p));
    p.workspace = ws.ptr;
    fn::launch_gdn_prefill(p, nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    alone.push_back({cs.download(), S.download(), out.download()});
  }
  // All runs in one launch, the states through the slot tables.
  std::vector<std::unique_ptr<DeviceArray<float>>> cs, S;
  std::vector<float*> cs_ptr, S_ptr;
  for (int i = 0; i < slots; ++i) {
    cs.push_back(std::make_unique<DeviceArray<float>>(cs0[sz(i)]));
    S.push_back(std::make_unique<DeviceArray<float>>(S0[sz(i)]));
    cs_ptr.push_back(cs.back()->ptr);
    S_ptr.push_back(S.back()->ptr);
  }
  DeviceArray<float*> cs_table(cs_ptr), S_table(S_ptr);
  DeviceArray<int32_t> start_d(start), slot_d(run_slot);
  DeviceArray<uint16_t> out(sz(M * s.out_len()));
  FN_CUDA_CHECK(cudaMemset(out.ptr, 0xff, out.n * sizeof(uint16_t)));
  fn::GdnPrefillParams p = prefill_params(L, nullptr, nullptr, out.ptr);
  p.runs = static_cast<int>(lengths.size());
  p.run_start = start_d.ptr;
  p.run_slot = slot_d.ptr;
  p.slot_state = S_table.ptr;
  p.slot_conv = cs_table.ptr;
  DeviceArray<unsigned char> ws(fn::gdn_prefill_workspace_bytes(p));
  p.workspace = ws.ptr;
  fn::launch_gdn_prefill(p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got_out = out.download();
  std::vector<bool> used(sz(slots), false);
  for (size_t r = 0; r < lengths.size(); ++r) {
    INFO("run ", r, " of ", lengths[r], " rows on slot ", run_slot[r]);
    const int slot = run_slot[r];
    used[sz(slot)] = true;
    const std::vector<uint16_t> rows(got_out.begin() + start[r] * s.out_len(),
                                     got_out.begin() + start[r + 1] * s.out_len());
    CHECK(rows == alone[r].out);
    CHECK(cs[sz(slot)]->download() == alone[r].cs);
    const std::vector<float> st = S[sz(slot)]->download();
    CHECK(std::memcmp(st.data(), alone[r].S.data(), st.size() * sizeof(float)) == 0);
    CHECK(alone[r].cs != cs0[sz(slot)]);  // the run did move its states
  }
  for (int i = 0; i < slots; ++i) {
    if (used[sz(i)]) continue;
    INFO("untouched slot ", i);
    CHECK(cs[sz(i)]->download() == cs0[sz(i)]);
    CHECK(S[sz(i)]->download() == S0[sz(i)]);
  }
}

TEST_CASE("cuda gdn prefill: runs side by side are bitwise each run launched alone") {
  // Lengths below, at and above the conv kernel's history and the scan's tile; slots not in run
  // order, some left out.
  compare_runs(Shape{2, 6, 16, 16}, {1, 3, 17, 2, 64, 5}, {4, 0, 6, 2, 5, 7}, 9, 1200);
  compare_runs(Shape{1, 2, 128, 128}, {8, 8, 8, 8, 199, 1}, {3, 1, 0, 2, 5, 4}, 7, 1300);
  // Lengths around the chunked scan's chunks, in one launch: every run's chunks start at its own
  // first row.
  compare_runs(Shape{1, 3, 128, 128}, {1, 63, 64, 65, 127, 128, 129, 200, 1000},
               {8, 0, 3, 1, 7, 2, 6, 4, 5}, 9, 1350);
  compare_runs(Shape{2, 6, 16, 16, 2}, {1, 1, 2}, {2, 0, 1}, 3, 1400);
  compare_runs(Shape{1, 1, 12, 20}, {7}, {1}, 2, 1500);  // one run on a slot other than 0
}

TEST_CASE(
    "cuda gdn prefill: the launcher rejects null pointers, bad sizes and a misaligned "
    "workspace") {
  const Shape s{2, 6, 16, 16};
  std::mt19937_64 rng(1100);
  const Layer L(s, 5, rng);
  DeviceArray<float> cs(sz(s.conv_state_len())), S(sz(s.state_len()));
  DeviceArray<uint16_t> out(sz(5 * s.out_len()));
  FN_CUDA_CHECK(cudaMemset(cs.ptr, 0, cs.n * 4));
  FN_CUDA_CHECK(cudaMemset(S.ptr, 0, S.n * 4));
  fn::GdnPrefillParams good = prefill_params(L, cs.ptr, S.ptr, out.ptr);
  const size_t bytes = fn::gdn_prefill_workspace_bytes(good);
  // Grows with the tokens: q^ k^ v/o and two gates per token at least.
  fn::GdnPrefillParams longer = good;
  longer.tokens = 500;
  CHECK(fn::gdn_prefill_workspace_bytes(longer) >=
        size_t(500) * 4 * sz(2 * s.Hk * s.dk + s.Hv * s.dv + 2 * s.Hv));
  CHECK(bytes >= size_t(5) * 4 * sz(2 * s.Hk * s.dk + s.Hv * s.dv + 2 * s.Hv));
  DeviceArray<unsigned char> ws(bytes + 256);
  good.workspace = ws.ptr;
  CHECK_NOTHROW(fn::launch_gdn_prefill(good, nullptr));
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  auto rejects = [&](auto mutate) {
    fn::GdnPrefillParams p = good;
    mutate(p);
    CHECK_THROWS_AS(fn::launch_gdn_prefill(p, nullptr), fn::Error);
  };
  rejects([](fn::GdnPrefillParams& p) { p.proj = nullptr; });
  rejects([](fn::GdnPrefillParams& p) { p.conv_weight = nullptr; });
  rejects([](fn::GdnPrefillParams& p) { p.A_log = nullptr; });
  rejects([](fn::GdnPrefillParams& p) { p.dt_bias = nullptr; });
  rejects([](fn::GdnPrefillParams& p) { p.norm_weight = nullptr; });
  rejects([](fn::GdnPrefillParams& p) { p.conv_state = nullptr; });
  rejects([](fn::GdnPrefillParams& p) { p.state = nullptr; });
  rejects([](fn::GdnPrefillParams& p) { p.out = nullptr; });
  rejects([](fn::GdnPrefillParams& p) { p.workspace = nullptr; });
  rejects([](fn::GdnPrefillParams& p) { p.workspace = static_cast<char*>(p.workspace) + 128; });
  rejects([](fn::GdnPrefillParams& p) { p.tokens = 0; });
  rejects([](fn::GdnPrefillParams& p) { p.proj_stride = 10; });
  rejects([](fn::GdnPrefillParams& p) { p.num_k_heads = 0; });
  rejects([](fn::GdnPrefillParams& p) { p.num_v_heads = 5; });  // not a multiple of Hk = 2
  rejects([](fn::GdnPrefillParams& p) { p.k_head_dim = 6; });
  rejects([](fn::GdnPrefillParams& p) { p.k_head_dim = 2048; });
  rejects([](fn::GdnPrefillParams& p) { p.v_head_dim = 18; });
  rejects([](fn::GdnPrefillParams& p) { p.conv_kernel = 1; });
  rejects([](fn::GdnPrefillParams& p) { p.conv_kernel = 9; });
  rejects([](fn::GdnPrefillParams& p) { p.eps = -1.0f; });
  rejects([](fn::GdnPrefillParams& p) { p.slice_columns = 12; });   // not a power of two
  rejects([](fn::GdnPrefillParams& p) { p.slice_columns = 256; });  // over 128 (either scan)
  // Runs: the tables, not state / conv_state; at most one run per row.
  DeviceArray<int32_t> run_start(std::vector<int32_t>{0, 2, 5}),
      run_slot(std::vector<int32_t>{0, 1});
  DeviceArray<float*> tables(std::vector<float*>{S.ptr, S.ptr});
  fn::GdnPrefillParams runs = good;
  runs.runs = 2;
  runs.run_start = run_start.ptr;
  runs.run_slot = run_slot.ptr;
  runs.slot_state = tables.ptr;
  runs.slot_conv = tables.ptr;
  runs.state = nullptr;
  runs.conv_state = nullptr;
  auto rejects_runs = [&](auto mutate) {
    fn::GdnPrefillParams p = runs;
    mutate(p);
    CHECK_THROWS_AS(fn::launch_gdn_prefill(p, nullptr), fn::Error);
  };
  rejects_runs([](fn::GdnPrefillParams& p) { p.run_start = nullptr; });
  rejects_runs([](fn::GdnPrefillParams& p) { p.run_slot = nullptr; });
  rejects_runs([](fn::GdnPrefillParams& p) { p.slot_state = nullptr; });
  rejects_runs([](fn::GdnPrefillParams& p) { p.slot_conv = nullptr; });
  rejects_runs([](fn::GdnPrefillParams& p) { p.runs = 6; });  // more runs than the 5 rows
  rejects_runs([](fn::GdnPrefillParams& p) { p.runs = -1; });
  fn::GdnPrefillParams no_tokens = good;
  no_tokens.tokens = 0;
  CHECK_THROWS_AS(fn::gdn_prefill_workspace_bytes(no_tokens), fn::Error);
}

// Bench (FN_BENCH=1; no assertion on time): ms per launch (conv, conv state, scan, norm) at the
// real shapes with M = 8192, the state carried from launch to launch, for every slice width the
// device's scan takes; first checked against 8192 decode steps.
TEST_CASE("cuda gdn prefill bench: ms per launch at the real TP=1 and TP=2 shapes, M = 8192") {
  const char* env = std::getenv("FN_BENCH");
  if (env == nullptr || std::string(env) != "1") return;
  const int64_t M = 8192;
  for (const Shape s : {Shape{16, 48, 128, 128}, Shape{8, 24, 128, 128}}) {
    std::mt19937_64 rng(1200);
    const Layer L(s, M, rng, true);
    const auto cs0 = normal(sz(s.conv_state_len()), 0.0f, 1.0f, rng);
    const auto S0 = normal(sz(s.state_len()), 0.0f, 0.3f, rng);
    {
      INFO("Hv ", s.Hv, " M ", M, " against decode");
      const Result ref = run_decode(L, cs0, S0);
      const Result got = run_prefill(L, cs0, S0, {M});
      check_same(s, got, ref, S0);
    }
    DeviceArray<float> cs(cs0), S(S0);
    DeviceArray<uint16_t> out(sz(M * s.out_len()));
    fn::GdnPrefillParams p = prefill_params(L, cs.ptr, S.ptr, out.ptr);
    DeviceArray<unsigned char> ws(fn::gdn_prefill_workspace_bytes(p));
    p.workspace = ws.ptr;
    cudaStream_t stream;
    FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // Milliseconds per launch, over 5 launches after a warm-up.
    auto time_ms = [&]() {
      fn::launch_gdn_prefill(p, stream);  // warm-up
      cudaEvent_t e0, e1;
      FN_CUDA_CHECK(cudaEventCreate(&e0));
      FN_CUDA_CHECK(cudaEventCreate(&e1));
      const int reps = 5;
      FN_CUDA_CHECK(cudaEventRecord(e0, stream));
      for (int r = 0; r < reps; ++r) fn::launch_gdn_prefill(p, stream);
      FN_CUDA_CHECK(cudaEventRecord(e1, stream));
      FN_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      FN_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      FN_CUDA_CHECK(cudaEventDestroy(e0));
      FN_CUDA_CHECK(cudaEventDestroy(e1));
      return double(ms) / reps;
    };
    // The chunked form's products, full 64 x 64 blocks, one pass (3xTF32 issues each 3 times):
    // per (64-token chunk, value head) k k^T, q k^T, T (K o e^G) (64^2 dk each), T V, P D
    // (64^2 dv each), W S, (Q o e^G) S, K'^T D (64 dk dv each), 2 FLOP per multiply-add.
    const double chunks = double((M + 63) / 64) * s.Hv;
    const double flop =
        2.0 * chunks *
        (3.0 * 64 * 64 * s.dk + 2.0 * 64 * 64 * s.dv + 3.0 * 64 * double(s.dk) * s.dv);
    for (const int slice : {0, 8, 16, 32, 64}) {
      p.slice_columns = slice;
      try {
        fn::plan_gdn_prefill_slice(p);
      } catch (const fn::Error&) {
        continue;  // not a width of this device's scan
      }
      const double per = time_ms();
      const std::string planned = slice == 0 ? " (planned)" : "";
      MESSAGE("gdn_prefill bench: Hk=", s.Hk, " Hv=", s.Hv, " dk=", s.dk, " dv=", s.dv, " M=", M,
              " slice ", fn::plan_gdn_prefill_slice(p), planned, ": ", per, " ms/launch, ",
              1e3 * per / double(M), " us/token, chunked-form ", flop / (per * 1e9),
              " TFLOP/s over the whole launch");
    }
    FN_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}
