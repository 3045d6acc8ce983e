// GPU tests of on-device greedy choice and sampling (cuda/kernels/sample.h) against the host
// sampler (core/sampler.h): greedy = fn::argmax_lowest on the real vocabulary (248320) with planted
// ties; the kept candidate set after top-k/top-p/min-p equal to fn::Sampler's; sampled frequencies
// against the host sampler's filtered probabilities (chi-square at a fixed significance);
// top_k = 1 equal to greedy; determinism in (seed, step); CUDA graph replay equal to eager.
// Penalties: the host's penalised values bit for bit (greedy ties planted one ulp either side),
// greedy ids equal to fn::Sampler's and draws equal to the device's draw on the host-penalised row
// over many steps with the window kept on the device (shorter than, equal to, longer than
// repeat_last_n, -1, 0), several rows with their own settings sharing one workspace, graph replay.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/sampler.h"
#include "cuda/kernels/sample.h"
#include "tests/cuda_test_util.h"

namespace {

using fn::test::DeviceArray;
using fn::test::normal_floats;

constexpr int64_t kRealVocab = 248320;

fn::SamplingParams host_params(const fn::DeviceSamplingParams& s) {
  fn::SamplingParams h;
  h.temperature = static_cast<double>(s.temperature);
  h.top_k = s.top_k;
  h.top_p = static_cast<double>(s.top_p);  // the float value exactly: same cut on both sides
  h.min_p = static_cast<double>(s.min_p);
  h.seed = s.seed;
  return h;
}

std::string describe(const fn::DeviceSamplingParams& s) {
  return "T " + std::to_string(s.temperature) + " top_k " + std::to_string(s.top_k) + " top_p " +
         std::to_string(s.top_p) + " min_p " + std::to_string(s.min_p);
}

// The host sampler's candidates after its steps 3-5, with their final probabilities.
std::vector<fn::Sampler::Candidate> host_distribution(const std::vector<float>& logits,
                                                      const fn::DeviceSamplingParams& s) {
  fn::Sampler sampler(host_params(s));
  sampler.sample(logits);
  return sampler.last_distribution();
}

// Smallest distance of a top-p / min-p decision of the host chain to its threshold. The device
// forms the same FP64 terms (exp within 1 ulp of the host's) but sums them in another order and
// compares sum >= top_p * total instead of sum(term / total) >= top_p: the two cumulative
// fractions differ by at most ~2 n FP64 roundings, so the cut is reproducible when the margin
// exceeds cut_tolerance(n).
double cut_tolerance(size_t n) {
  return 4.0 * static_cast<double>(n) * 0x1.0p-53;
}
double decision_margin(const std::vector<float>& l, const fn::DeviceSamplingParams& s) {
  std::vector<int32_t> order;
  for (int32_t i = 0; i < static_cast<int32_t>(l.size()); ++i)
    if (!std::isnan(l[i])) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  size_t n = order.size();
  if (s.top_k > 0 && static_cast<size_t>(s.top_k) < n) n = static_cast<size_t>(s.top_k);
  const double mx = l[order[0]];
  double margin = std::numeric_limits<double>::infinity();
  if (s.top_p < 1.0f && n > 1) {
    double total = 0;
    for (size_t j = 0; j < n; ++j) total += std::exp(double(l[order[j]]) - mx);
    double cum = 0;
    for (size_t j = 0; j < n; ++j) {
      cum += std::exp(double(l[order[j]]) - mx) / total;
      margin = std::min(margin, std::fabs(cum - double(s.top_p)));
      if (cum >= double(s.top_p)) {
        n = j + 1;
        break;
      }
    }
  }
  if (s.min_p > 0.0f && n > 1) {
    const double thr = mx + std::log(double(s.min_p));
    for (size_t j = 0; j < n; ++j) margin = std::min(margin, std::fabs(double(l[order[j]]) - thr));
  }
  return margin;
}

// Device side of the tests: logits, a step array (step i at steps[i]), outputs, workspace.
struct DeviceSampler {
  int64_t vocab;
  int64_t max_steps;
  DeviceArray<float> logits;
  DeviceArray<int64_t> steps;
  DeviceArray<int32_t> token{1}, flag{1}, kept{1}, history;
  size_t ws_bytes;
  DeviceArray<unsigned char> workspace;

  static std::vector<int64_t> iota_steps(int64_t n) {
    std::vector<int64_t> v(static_cast<size_t>(n));
    std::iota(v.begin(), v.end(), int64_t{0});
    return v;
  }
  static size_t ws_for(int64_t vocab) {
    fn::DeviceSamplingParams filtered;
    filtered.top_p = 0.5f;  // the largest workspace (sort buffers)
    return fn::sample_workspace_bytes(vocab, filtered);
  }

  DeviceSampler(const std::vector<float>& l, int64_t n_steps)
      : vocab(static_cast<int64_t>(l.size())),
        max_steps(n_steps),
        logits(l),
        steps(iota_steps(n_steps)),
        history(static_cast<size_t>(n_steps)),
        ws_bytes(ws_for(static_cast<int64_t>(l.size()))),
        workspace(ws_bytes) {
    flag.upload({0});
  }

  fn::SampleParams params(const fn::DeviceSamplingParams& s, int64_t step) const {
    fn::SampleParams p;
    p.logits = logits.ptr;
    p.vocab = vocab;
    p.sampling = s;
    p.step = steps.ptr + step;
    p.token_out = token.ptr;
    p.history = history.ptr;
    p.history_capacity = max_steps;
    p.workspace = workspace.ptr;
    p.workspace_bytes = ws_bytes;
    p.error_flag = flag.ptr;
    p.kept_count_out = kept.ptr;
    return p;
  }

  int32_t one(const fn::DeviceSamplingParams& s, int64_t step) {
    fn::launch_sample(params(s, step), nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    return token.download()[0];
  }

  // Draws at steps 0..n-1 (history[step] = id), one synchronisation at the end.
  std::vector<int32_t> draws(const fn::DeviceSamplingParams& s, int64_t n) {
    REQUIRE(n <= max_steps);
    for (int64_t i = 0; i < n; ++i) fn::launch_sample(params(s, i), nullptr);
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    auto h = history.download();
    h.resize(static_cast<size_t>(n));
    return h;
  }

  int32_t flag_value() const { return flag.download()[0]; }
  int32_t kept_value() const { return kept.download()[0]; }
};

// Inverse of the standard normal upper tail for the chi-square critical value (Wilson-Hilferty):
// z such that P(Z > z) = alpha, by bisection on erfc.
double normal_upper_quantile(double alpha) {
  double lo = 0, hi = 40;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    (0.5 * std::erfc(mid / std::sqrt(2.0)) > alpha ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

// Chi-square goodness of fit of the draws against the host distribution at significance alpha
// (Wilson-Hilferty critical value): bins of expected count >= 5, the rest merged (and folded into
// the smallest bin when still below 5). Draws outside the host's candidates must not occur.
void check_frequencies(const std::vector<int32_t>& draws,
                       const std::vector<fn::Sampler::Candidate>& dist, const std::string& what) {
  constexpr double kAlpha = 1e-6;
  const double N = static_cast<double>(draws.size());
  std::map<int32_t, int> bin_of;
  std::vector<double> expected;
  double rest_e = 0;
  std::vector<int32_t> rest_ids;
  for (const auto& c : dist) {
    if (N * c.p >= 5) {
      bin_of[c.id] = static_cast<int>(expected.size());
      expected.push_back(N * c.p);
    } else {
      rest_ids.push_back(c.id);
      rest_e += N * c.p;
    }
  }
  if (!rest_ids.empty()) {
    int rest_bin;
    if (rest_e >= 5 || expected.empty()) {
      rest_bin = static_cast<int>(expected.size());
      expected.push_back(rest_e);
    } else {
      rest_bin =
          static_cast<int>(std::min_element(expected.begin(), expected.end()) - expected.begin());
      expected[rest_bin] += rest_e;
    }
    for (int32_t id : rest_ids) bin_of[id] = rest_bin;
  }
  std::vector<double> observed(expected.size(), 0.0);
  int64_t outside = 0;
  for (int32_t t : draws) {
    const auto it = bin_of.find(t);
    if (it == bin_of.end()) {
      ++outside;
    } else {
      observed[static_cast<size_t>(it->second)] += 1;
    }
  }
  CHECK_MESSAGE(outside == 0, what, ": ", outside, " draws outside the host's candidate set");
  const int df = static_cast<int>(expected.size()) - 1;
  if (df < 1) return;  // one bin: every draw is in it (checked above)
  double x2 = 0;
  for (size_t b = 0; b < expected.size(); ++b)
    x2 += (observed[b] - expected[b]) * (observed[b] - expected[b]) / expected[b];
  const double z = normal_upper_quantile(kAlpha), h = 2.0 / (9.0 * df);
  const double crit = df * std::pow(1 - h + z * std::sqrt(h), 3);
  CHECK_MESSAGE(x2 <= crit, what, ": chi-square ", x2, " > critical ", crit, " (df ", df,
                ", alpha ", kAlpha, ")");
  MESSAGE(what, ": chi-square ", x2, " (critical ", crit, ", df ", df, ")");
}

fn::DeviceSamplingParams make(float t, int k, float p, float m, uint64_t seed = 42) {
  fn::DeviceSamplingParams s;
  s.temperature = t;
  s.top_k = k;
  s.top_p = p;
  s.min_p = m;
  s.seed = seed;
  return s;
}

// Real-vocabulary logits: N(0, 2) plus a handful of strong tokens (a peaked head, a long tail).
std::vector<float> real_logits(uint64_t seed) {
  auto l = normal_floats(kRealVocab, 2.0f, seed);
  std::mt19937_64 rng(seed + 1);
  for (int i = 0; i < 12; ++i) l[rng() % kRealVocab] = 9.0f + 0.25f * static_cast<float>(i);
  return l;
}

}  // namespace

TEST_CASE("cuda sample: greedy equals argmax_lowest on the real vocabulary with planted ties") {
  struct Case {
    std::string what;
    std::vector<float> logits;
  };
  std::vector<Case> cases;
  {
    auto l = normal_floats(kRealVocab, 3.0f, 1);
    for (int i : {200000, 5, 123456}) l[i] = 40.0f;  // tie at the top: 5 wins
    cases.push_back({"three-way tie", l});
    l[5] = 0.0f;
    l[248319] = 41.0f;  // the last id alone
    cases.push_back({"last id", l});
    l[248319] = 0.0f;
    for (int i : {131072, 131071, 200000}) l[i] = 50.0f;  // across a 2048-chunk boundary
    cases.push_back({"chunk boundary tie", l});
  }
  cases.push_back({"all equal", std::vector<float>(kRealVocab, 0.5f)});
  {
    std::vector<float> l(kRealVocab, -1.0f);
    l[10] = -0.0f;
    l[20] = 0.0f;  // -0 == +0: the lower id
    l[30] = -INFINITY;
    cases.push_back({"signed zeros", l});
    std::vector<float> m(kRealVocab, -INFINITY);
    m[77777] = -1e30f;
    cases.push_back({"minus infinities", m});
  }
  cases.push_back({"tiny vocab", normal_floats(512, 1.0f, 9)});
  cases.push_back({"one token", std::vector<float>{3.0f}});
  for (const auto& c : cases) {
    DeviceSampler d(c.logits, 1);
    const int32_t got = d.one(make(0.0f, 0, 1.0f, 0.0f), 0);
    CHECK_MESSAGE(got == fn::argmax_lowest(c.logits), c.what);
    // -Inf counts as non-finite (the CPU model rejects such logits): flag 2, same choice.
    const bool finite =
        std::all_of(c.logits.begin(), c.logits.end(), [](float v) { return std::isfinite(v); });
    CHECK_MESSAGE(d.flag_value() == (finite ? 0 : 2), c.what);
    CHECK(d.kept_value() == 1);
    CHECK(d.history.download()[0] == got);
  }
}

TEST_CASE("cuda sample: NaN or Inf logits set the flag; the token stays in range, never a NaN") {
  auto l = normal_floats(kRealVocab, 1.0f, 3);
  l[0] = NAN;
  l[1000] = NAN;
  {
    DeviceSampler d(l, 8);
    CHECK(d.one(make(0.0f, 0, 1.0f, 0.0f), 0) == fn::argmax_lowest(l));
    CHECK(d.flag_value() == 2);
    for (const auto& s : {make(1.0f, 0, 1.0f, 0.0f), make(1.0f, 0, 0.9f, 0.0f)}) {
      for (int32_t t : d.draws(s, 8)) {
        CHECK(t >= 0);
        CHECK(t < kRealVocab);
        CHECK(t != 0);
        CHECK(t != 1000);
      }
    }
  }
  l[0] = 1.0f;
  l[1000] = 1.0f;
  l[4242] = INFINITY;
  DeviceSampler d(l, 1);
  CHECK(d.one(make(0.0f, 0, 1.0f, 0.0f), 0) == 4242);
  CHECK(d.flag_value() == 2);
  const std::vector<float> all_nan(64, NAN);
  DeviceSampler n(all_nan, 1);
  CHECK(n.one(make(1.0f, 0, 0.5f, 0.0f), 0) == 0);  // the host sampler's answer too
  CHECK(n.flag_value() == 2);
}

TEST_CASE("cuda sample: top_k = 1 gives the greedy token whatever the other settings") {
  auto l = normal_floats(kRealVocab, 3.0f, 11);
  for (int i : {190000, 65536, 70000}) l[i] = 30.0f;
  const int32_t want = fn::argmax_lowest(l);
  REQUIRE(want == 65536);
  DeviceSampler d(l, 16);
  for (const auto& s :
       {make(1.3f, 1, 1.0f, 0.0f), make(0.5f, 1, 0.3f, 0.0f), make(2.0f, 1, 0.9f, 0.2f, 7)}) {
    for (int32_t t : d.draws(s, 16)) CHECK_MESSAGE(t == want, describe(s));
    CHECK(d.kept_value() == 1);
  }
}

TEST_CASE("cuda sample: the kept candidates equal the host sampler's on the real vocabulary") {
  const auto l = real_logits(21);
  DeviceSampler d(l, 64);
  for (const auto& s :
       {make(1.0f, 0, 0.9f, 0.0f), make(0.7f, 50, 1.0f, 0.0f), make(1.0f, 1000, 0.5f, 0.0f),
        make(1.0f, 0, 1.0f, 0.05f), make(1.5f, 0, 0.95f, 0.01f), make(1.0f, 300000, 0.99f, 0.0f),
        make(1.0f, 0, 0.999f, 0.0f)}) {
    REQUIRE_MESSAGE(decision_margin(l, s) > cut_tolerance(l.size()), describe(s));
    const auto dist = host_distribution(l, s);
    const auto draws = d.draws(s, 64);
    CHECK_MESSAGE(d.kept_value() == static_cast<int32_t>(dist.size()), describe(s));
    std::map<int32_t, double> kept;
    for (const auto& c : dist) kept[c.id] = c.p;
    for (int32_t t : draws) CHECK_MESSAGE(kept.count(t) == 1, describe(s), " drew ", t);
    CHECK(d.flag_value() == 0);
  }
}

TEST_CASE("cuda sample: sampled frequencies match the host sampler's filtered softmax") {
  // Small vocabulary: 64 logits with a tie straddling the top-20 boundary (only the lower id of
  // the pair is a candidate under top_k = 20).
  auto l = normal_floats(64, 1.5f, 5);
  {
    std::vector<int32_t> order(64);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
    l[order[20]] = l[order[19]];
  }
  constexpr int64_t kDraws = 4000;
  DeviceSampler d(l, kDraws);
  for (const auto& s :
       {make(1.0f, 0, 1.0f, 0.0f), make(0.5f, 0, 1.0f, 0.0f, 3), make(1.0f, 20, 1.0f, 0.0f),
        make(1.5f, 0, 0.8f, 0.0f), make(1.0f, 30, 0.95f, 0.05f), make(0.75f, 0, 0.6f, 0.2f, 9)}) {
    REQUIRE_MESSAGE(decision_margin(l, s) > cut_tolerance(l.size()), describe(s));
    const auto dist = host_distribution(l, s);
    const auto draws = d.draws(s, kDraws);
    CHECK_MESSAGE(d.kept_value() == static_cast<int32_t>(dist.size()), describe(s));
    check_frequencies(draws, dist, "V 64, " + describe(s));
  }
  // Real vocabulary, top-p cut inside the long tail.
  const auto r = real_logits(33);
  const auto s = make(1.0f, 0, 0.9f, 0.0f, 5);
  REQUIRE(decision_margin(r, s) > cut_tolerance(r.size()));
  constexpr int64_t kRealDraws = 1500;
  DeviceSampler dr(r, kRealDraws);
  check_frequencies(dr.draws(s, kRealDraws), host_distribution(r, s), "V 248320, " + describe(s));
}

TEST_CASE("cuda sample: the same seed and step give the same token; other seeds other sequences") {
  const auto l = real_logits(44);
  DeviceSampler d(l, 32);
  for (const auto& s : {make(1.5f, 0, 0.95f, 0.01f), make(1.0f, 0, 1.0f, 0.0f)}) {
    const auto a = d.draws(s, 32);
    const auto b = d.draws(s, 32);
    CHECK_MESSAGE(a == b, describe(s));
    CHECK_MESSAGE(d.one(s, 17) == a[17], describe(s));
    auto other = s;
    other.seed = s.seed + 1;
    CHECK_MESSAGE(d.draws(other, 32) != a, describe(s));
    // Each draw varies with the step: 32 draws from a spread distribution are not all equal.
    CHECK(std::adjacent_find(a.begin(), a.end(), std::not_equal_to<>()) != a.end());
  }
}

TEST_CASE("cuda sample: a captured CUDA graph replays the eager choice for every path") {
  const auto l = real_logits(55);
  DeviceSampler d(l, 1);
  DeviceArray<int64_t> step(std::vector<int64_t>{0});
  cudaStream_t stream;
  FN_CUDA_CHECK(cudaStreamCreate(&stream));
  for (const auto& s :
       {make(0.0f, 0, 1.0f, 0.0f), make(1.0f, 0, 1.0f, 0.0f), make(1.2f, 40, 0.9f, 0.02f)}) {
    fn::SampleParams p = d.params(s, 0);
    p.step = step.ptr;
    p.history = nullptr;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    fn::launch_sample(p, stream);
    FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int64_t t = 0; t < 6; ++t) {
      step.upload({t * 1000 + 3});
      FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      FN_CUDA_CHECK(cudaStreamSynchronize(stream));
      const int32_t replayed = d.token.download()[0];
      fn::launch_sample(p, stream);
      FN_CUDA_CHECK(cudaStreamSynchronize(stream));
      CHECK_MESSAGE(d.token.download()[0] == replayed, describe(s), " step ", t * 1000 + 3);
    }
    // Replay time (a measurement, printed): 50 replays between two events.
    cudaEvent_t a, b;
    FN_CUDA_CHECK(cudaEventCreate(&a));
    FN_CUDA_CHECK(cudaEventCreate(&b));
    FN_CUDA_CHECK(cudaEventRecord(a, stream));
    for (int r = 0; r < 50; ++r) FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FN_CUDA_CHECK(cudaEventRecord(b, stream));
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    float ms = 0;
    FN_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    MESSAGE("V 248320, ", describe(s), ": ", 1000.0 * ms / 50, " us per graph replay");
    FN_CUDA_CHECK(cudaEventDestroy(a));
    FN_CUDA_CHECK(cudaEventDestroy(b));
    FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
    FN_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda sample: history is written at the step; a step past the capacity sets flag 3") {
  const auto l = normal_floats(512, 1.0f, 66);
  DeviceSampler d(l, 4);
  const auto s = make(1.0f, 10, 1.0f, 0.0f);
  const auto h = d.draws(s, 4);
  for (int64_t i = 0; i < 4; ++i) CHECK(h[i] == d.one(s, i));
  CHECK(d.flag_value() == 0);
  DeviceArray<int64_t> far(std::vector<int64_t>{4});
  fn::SampleParams p = d.params(s, 0);
  p.step = far.ptr;
  fn::launch_sample(p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(d.flag_value() == 3);
  CHECK(d.history.download() == h);
}

TEST_CASE("cuda sample: the launcher rejects a short workspace and settings out of range") {
  const auto l = normal_floats(kRealVocab, 1.0f, 77);
  DeviceSampler d(l, 1);
  const auto greedy = make(0.0f, 0, 1.0f, 0.0f), filtered = make(1.0f, 0, 0.9f, 0.0f);
  CHECK(fn::sample_workspace_bytes(kRealVocab, greedy) <
        fn::sample_workspace_bytes(kRealVocab, filtered));
  fn::SampleParams p = d.params(filtered, 0);
  p.workspace_bytes = fn::sample_workspace_bytes(kRealVocab, filtered) - 1;
  CHECK_THROWS_AS(fn::launch_sample(p, nullptr), fn::Error);
  p = d.params(make(1.0f, -1, 1.0f, 0.0f), 0);
  CHECK_THROWS_AS(fn::launch_sample(p, nullptr), fn::Error);
  p = d.params(make(1.0f, 0, 0.0f, 0.0f), 0);
  CHECK_THROWS_AS(fn::launch_sample(p, nullptr), fn::Error);
  p = d.params(make(1.0f, 0, 1.0f, 1.5f), 0);
  CHECK_THROWS_AS(fn::launch_sample(p, nullptr), fn::Error);
  p = d.params(greedy, 0);
  p.logits = nullptr;
  CHECK_THROWS_AS(fn::launch_sample(p, nullptr), fn::Error);
  CHECK_THROWS_AS(fn::sample_workspace_bytes(0, greedy), fn::Error);
}

// ---- penalties -----------------------------------------------------------------------------

namespace {

fn::SamplingParams host_params_with_penalties(const fn::DeviceSamplingParams& s) {
  fn::SamplingParams h = host_params(s);
  h.repetition_penalty = s.repetition_penalty;
  h.presence_penalty = s.presence_penalty;
  h.frequency_penalty = s.frequency_penalty;
  h.repeat_last_n = s.repeat_last_n;
  return h;
}

fn::DeviceSamplingParams with_penalties(fn::DeviceSamplingParams s, double rep, double pres,
                                        double freq, int64_t last_n) {
  s.repetition_penalty = rep;
  s.presence_penalty = pres;
  s.frequency_penalty = freq;
  s.repeat_last_n = last_n;
  return s;
}

// A penalty window on the device: a ring of `capacity` ids (accepted id k at k % capacity) and
// its count, loaded with `ids`.
struct DeviceWindow {
  int64_t capacity;
  DeviceArray<int32_t> tokens;
  DeviceArray<int64_t> count{1};
  DeviceWindow(const std::vector<int32_t>& ids, int64_t cap)
      : capacity(cap), tokens(static_cast<size_t>(cap)) {
    std::vector<int32_t> ring(static_cast<size_t>(cap), -1);
    for (size_t k = 0; k < ids.size(); ++k) ring[k % static_cast<size_t>(cap)] = ids[k];
    tokens.upload(ring);
    count.upload({static_cast<int64_t>(ids.size())});
  }
  fn::DevicePenaltyWindow view() const {
    fn::DevicePenaltyWindow w;
    w.tokens = tokens.ptr;
    w.count = count.ptr;
    w.capacity = capacity;
    return w;
  }
  int64_t accepted() const { return count.download()[0]; }
  // The last min(count, capacity) accepted ids, oldest first.
  std::vector<int32_t> last_ids() const {
    const int64_t n = accepted();
    const auto ring = tokens.download();
    std::vector<int32_t> out;
    for (int64_t k = n - std::min(n, capacity); k < n; ++k)
      out.push_back(ring[static_cast<size_t>(k % capacity)]);
    return out;
  }
};

std::string describe_penalties(const fn::DeviceSamplingParams& s) {
  return describe(s) + " rep " + std::to_string(s.repetition_penalty) + " pres " +
         std::to_string(s.presence_penalty) + " freq " + std::to_string(s.frequency_penalty) +
         " last_n " + std::to_string(s.repeat_last_n);
}

// One sequence of the penalised comparisons: its logits row (fixed across the steps, so only the
// penalties move the choice), settings, prompt (the window's start) and ring capacity.
struct PenaltyCase {
  std::string what;
  std::vector<float> logits;
  fn::DeviceSamplingParams s;
  std::vector<int32_t> prompt;
  int64_t capacity;
};

// Runs the cases side by side for `steps` steps: each round launches every case's penalised
// choice on the default stream with ONE shared workspace (as the batched step samples its rows)
// and synchronises once; then checks each case's id against the host sampler: greedy ids equal
// fn::Sampler's; a draw equals the device's unpenalised draw (same seed and step) on the row
// fn::Sampler::apply_penalties gives, with the same kept count, inside the host's candidates.
// The host sampler accepts the device's id; at the end the device window holds prompt + ids.
void run_penalty_cases(const std::vector<PenaltyCase>& cases, int64_t steps) {
  struct Live {
    std::unique_ptr<DeviceSampler> dev, ref;
    std::unique_ptr<DeviceWindow> win;
    std::unique_ptr<fn::Sampler> host;
    std::vector<int32_t> ids;
  };
  int64_t vocab_max = 0;
  for (const auto& c : cases) vocab_max = std::max<int64_t>(vocab_max, c.logits.size());
  const size_t ws_bytes = DeviceSampler::ws_for(vocab_max);
  DeviceArray<unsigned char> shared(ws_bytes);
  std::vector<Live> live(cases.size());
  for (size_t r = 0; r < cases.size(); ++r) {
    live[r].dev = std::make_unique<DeviceSampler>(cases[r].logits, steps);
    live[r].ref = std::make_unique<DeviceSampler>(cases[r].logits, steps);
    live[r].win = std::make_unique<DeviceWindow>(cases[r].prompt, cases[r].capacity);
    live[r].host = std::make_unique<fn::Sampler>(host_params_with_penalties(cases[r].s));
    for (int32_t t : cases[r].prompt) live[r].host->accept(t);
  }
  for (int64_t i = 0; i < steps; ++i) {
    for (size_t r = 0; r < cases.size(); ++r) {
      fn::DeviceSamplingParams s = cases[r].s;
      s.window = live[r].win->view();
      fn::SampleParams p = live[r].dev->params(s, i);
      p.workspace = shared.ptr;
      p.workspace_bytes = ws_bytes;
      fn::launch_sample(p, nullptr);
    }
    FN_CUDA_CHECK(cudaDeviceSynchronize());
    for (size_t r = 0; r < cases.size(); ++r) {
      const PenaltyCase& c = cases[r];
      Live& L = live[r];
      const std::string what =
          c.what + " (" + describe_penalties(c.s) + ") step " + std::to_string(i);
      const int32_t got = L.dev->token.download()[0];
      CHECK_MESSAGE(L.dev->flag_value() == 0, what);
      std::vector<float> penalised = c.logits;
      L.host->apply_penalties(penalised);
      if (c.s.temperature <= 0.0f) {
        CHECK_MESSAGE(got == L.host->sample(c.logits), what);
      } else {
        fn::DeviceSamplingParams plain = c.s;
        plain.repetition_penalty = 1.0;
        plain.presence_penalty = 0.0;
        plain.frequency_penalty = 0.0;
        L.ref->logits.upload(penalised);
        const int32_t want = L.ref->one(plain, i);
        CHECK_MESSAGE(got == want, what);
        CHECK_MESSAGE(L.dev->kept_value() == L.ref->kept_value(), what);
        REQUIRE_MESSAGE(decision_margin(penalised, c.s) > cut_tolerance(penalised.size()), what);
        L.host->sample(c.logits);
        const auto& dist = L.host->last_distribution();
        CHECK_MESSAGE(L.dev->kept_value() == static_cast<int32_t>(dist.size()), what);
        CHECK_MESSAGE(std::any_of(dist.begin(), dist.end(),
                                  [got](const fn::Sampler::Candidate& d) { return d.id == got; }),
                      what);
      }
      L.host->accept(got);
      L.ids.push_back(got);
    }
  }
  for (size_t r = 0; r < cases.size(); ++r) {
    const PenaltyCase& c = cases[r];
    Live& L = live[r];
    std::vector<int32_t> all = c.prompt;
    all.insert(all.end(), L.ids.begin(), L.ids.end());
    CHECK_MESSAGE(L.win->accepted() == static_cast<int64_t>(all.size()), c.what);
    const auto tail = L.win->last_ids();
    CHECK_MESSAGE(std::equal(tail.begin(), tail.end(), all.end() - static_cast<long>(tail.size())),
                  c.what);
    // The penalties did something: the ids differ from the unpenalised choice somewhere (the
    // greedy one is fixed; a draw is compared with the device's own unpenalised draws).
    if (fn::DeviceSamplingParams off = c.s; fn::penalties_active(c.s)) {
      off.repetition_penalty = 1.0;
      off.presence_penalty = 0.0;
      off.frequency_penalty = 0.0;
      L.ref->logits.upload(c.logits);
      CHECK_MESSAGE(L.ref->draws(off, steps) != L.ids, c.what, ": the penalties changed nothing");
    }
  }
}

// Logits with a peaked head at `head` (the ids the prompts repeat) over a N(0, 1) tail.
std::vector<float> head_logits(int64_t vocab, uint64_t seed, const std::vector<int32_t>& head) {
  auto l = normal_floats(static_cast<size_t>(vocab), 1.0f, seed);
  for (size_t i = 0; i < head.size(); ++i)
    l[static_cast<size_t>(head[i])] = 6.0f - 0.125f * static_cast<float>(i);
  return l;
}

}  // namespace

TEST_CASE(
    "cuda sample: penalties are fn::Sampler's bit for bit: greedy ties planted at the host's "
    "penalised values, one ulp either side") {
  // Window ids with positive, negative, zero and huge logits, seen 1 to 4 times; an id past the
  // vocabulary and a negative one (skipped, as the host skips them).
  const std::vector<int32_t> window = {1000, 77, 1000, 5, 1000, 248000, 77, 1000, 300000, -3, 9};
  const std::vector<std::pair<int32_t, float>> targets = {
      {1000, 7.3f}, {77, -0.8125f}, {5, 0.0f}, {9, 3.0e38f}, {248000, -1.0e-38f}};
  for (const auto& sp : {with_penalties(make(0.0f, 0, 1.0f, 0.0f), 1.3, 0.4, 0.15, -1),
                         with_penalties(make(0.0f, 0, 1.0f, 0.0f), 0.7, -0.3, 0.1, 64),
                         with_penalties(make(0.0f, 0, 1.0f, 0.0f), 1.0, 0.0, 0.37, 11),
                         with_penalties(make(0.0f, 0, 1.0f, 0.0f), 1.1, 0.2, 0.0, 3)}) {
    for (const auto& [x, raw] : targets) {
      for (const int32_t y : {4, 200000}) {  // the planted rival below and above x
        for (const int nudge : {-1, 0, 1}) {
          auto l = normal_floats(kRealVocab, 0.01f, 5);
          for (float& v : l) v -= 1.0e30f * (v < 0 ? 1.0f : 0.5f);  // every other id far below
          l[static_cast<size_t>(x)] = raw;
          fn::Sampler host(host_params_with_penalties(sp));
          for (int32_t t : window) host.accept(t);
          std::vector<float> pen = l;
          host.apply_penalties(pen);
          float rival = pen[static_cast<size_t>(x)];
          if (nudge != 0) rival = std::nextafter(rival, nudge > 0 ? INFINITY : -INFINITY);
          l[static_cast<size_t>(y)] = rival;
          const int32_t want = host.sample(l);
          DeviceSampler d(l, 1);
          DeviceWindow w(window, 16);
          auto s = sp;
          s.window = w.view();
          const int32_t got = d.one(s, 0);
          const std::string what = describe_penalties(sp) + " x " + std::to_string(x) + " y " +
                                   std::to_string(y) + " nudge " + std::to_string(nudge);
          CHECK_MESSAGE(got == want, what);
          // The window only penalises x when it is inside it: the tie is decided by x's value.
          if (std::isfinite(pen[static_cast<size_t>(x)]))
            CHECK_MESSAGE((want == x || want == y), what);
          CHECK(w.accepted() == static_cast<int64_t>(window.size()) + 1);
          CHECK(w.last_ids().back() == got);
        }
      }
    }
  }
}

TEST_CASE(
    "cuda sample: penalised greedy and seeded draws equal the host sampler's over many steps, "
    "windows shorter than, equal to and longer than repeat_last_n, several rows per launch "
    "round") {
  const std::vector<int32_t> head = {11, 4242, 99999, 7, 150000, 31, 248319, 1024};
  // Prompts with repeated head ids.
  const std::vector<int32_t> short_prompt = {11, 11};
  const std::vector<int32_t> six = {11, 4242, 11, 7, 4242, 11};
  const std::vector<int32_t> long_prompt = {11, 4242, 99999, 11, 7, 4242, 11, 31, 11, 4242};
  const auto greedy = make(0.0f, 0, 1.0f, 0.0f);
  const auto filtered = make(0.9f, 40, 0.95f, 0.0f, 17);
  // No filter; a temperature low enough that the head ids, which the penalties move, carry most
  // of the mass (at 1 the 248K-id tail holds ~99 % of it and 24 draws rarely meet a head id, so
  // the penalties would change nothing to compare).
  const auto raw = make(0.3f, 0, 1.0f, 0.0f, 23);
  const auto minp = make(0.8f, 0, 1.0f, 0.02f, 31);
  std::vector<PenaltyCase> cases;
  int64_t seed = 100;
  for (const auto& base : {greedy, filtered, raw, minp}) {
    // Shorter than repeat_last_n (grows past it as the ids are accepted).
    cases.push_back({"window shorter than last_n", head_logits(kRealVocab, ++seed, head),
                     with_penalties(base, 1.4, 0.3, 0.2, 6), short_prompt, 6});
    // Equal to repeat_last_n from the start.
    cases.push_back({"window equal to last_n", head_logits(kRealVocab, ++seed, head),
                     with_penalties(base, 1.25, 0.0, 0.5, 6), six, 6});
    // Longer than repeat_last_n: only the last 4 count; the ring holds 5 (it wraps).
    cases.push_back({"window longer than last_n", head_logits(kRealVocab, ++seed, head),
                     with_penalties(base, 1.6, 0.5, 0.0, 4), long_prompt, 5});
    // Every accepted id (-1).
    cases.push_back({"whole window (-1)", head_logits(kRealVocab, ++seed, head),
                     with_penalties(base, 1.2, 0.25, 0.25, -1), long_prompt, 64});
    // repeat_last_n 0: no penalty however strong (the ids are still appended).
    cases.push_back({"repeat_last_n 0", head_logits(kRealVocab, ++seed, head),
                     with_penalties(base, 3.0, 2.0, 2.0, 0), long_prompt, 64});
  }
  // A small vocabulary, every id in the window at some point.
  cases.push_back({"V 64 filtered",
                   head_logits(64, 7, {3, 9, 27, 60}),
                   with_penalties(make(1.0f, 10, 0.9f, 0.0f, 5), 1.5, 0.2, 0.3, 16),
                   {3, 9, 3, 27, 3},
                   16});
  cases.push_back({"V 64 greedy",
                   head_logits(64, 8, {3, 9, 27, 60}),
                   with_penalties(greedy, 1.5, 0.2, 0.3, 16),
                   {3, 9, 3, 27, 3},
                   20});
  run_penalty_cases(cases, 24);
}

TEST_CASE(
    "cuda sample: a captured graph with penalties replays the eager choices as the window "
    "grows on the device") {
  const std::vector<int32_t> head = {11, 4242, 99999, 7};
  const auto l = head_logits(kRealVocab, 61, head);
  const std::vector<int32_t> prompt = {11, 4242, 11};
  for (const auto& base : {make(0.0f, 0, 1.0f, 0.0f), make(1.1f, 40, 0.9f, 0.02f, 3)}) {
    DeviceSampler graph_side(l, 1), eager_side(l, 8);
    DeviceWindow wg(prompt, 32), we(prompt, 32);
    DeviceArray<int64_t> step(std::vector<int64_t>{0});
    auto s = with_penalties(base, 1.5, 0.5, 0.25, 8);
    s.window = wg.view();
    fn::SampleParams p = graph_side.params(s, 0);
    p.step = step.ptr;
    p.history = nullptr;
    cudaStream_t stream;
    FN_CUDA_CHECK(cudaStreamCreate(&stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    fn::launch_sample(p, stream);
    FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<int32_t> replayed;
    for (int64_t t = 0; t < 8; ++t) {
      step.upload({t});
      FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      FN_CUDA_CHECK(cudaStreamSynchronize(stream));
      replayed.push_back(graph_side.token.download()[0]);
    }
    auto e = s;
    e.window = we.view();
    CHECK_MESSAGE(eager_side.draws(e, 8) == replayed, describe_penalties(s));
    CHECK(wg.last_ids() == we.last_ids());
    CHECK(wg.accepted() == static_cast<int64_t>(prompt.size()) + 8);
    FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
    FN_CUDA_CHECK(cudaGraphDestroy(graph));
    FN_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

TEST_CASE(
    "cuda sample: penalties without a window, out-of-range penalties and an overlong "
    "window are refused or flagged") {
  const auto l = normal_floats(4096, 1.0f, 91);
  DeviceSampler d(l, 1);
  const auto g = make(0.0f, 0, 1.0f, 0.0f);
  // The filtered settings' workspace allows penalties with any other setting.
  CHECK(fn::sample_workspace_bytes(kRealVocab, with_penalties(g, 1.2, 0, 0, 64)) <=
        DeviceSampler::ws_for(kRealVocab));
  CHECK(fn::sample_workspace_bytes(kRealVocab,
                                   with_penalties(make(1.0f, 0, 1.0f, 0.0f), 1.2, 0, 0, 64)) <=
        DeviceSampler::ws_for(kRealVocab));
  CHECK_FALSE(fn::penalties_active(with_penalties(g, 1.2, 0.5, 0.5, 0)));
  CHECK_FALSE(fn::penalties_active(with_penalties(g, 1.0, 0.0, 0.0, -1)));
  CHECK(fn::penalties_active(with_penalties(g, 1.0, 0.0, -0.5, 1)));
  CHECK_THROWS_AS(fn::launch_sample(d.params(with_penalties(g, 1.2, 0, 0, 64), 0), nullptr),
                  fn::Error);  // no window
  DeviceWindow w({1, 2, 3}, 4);
  for (const auto& bad : {with_penalties(g, 0.0, 0, 0, 64), with_penalties(g, NAN, 0, 0, 64),
                          with_penalties(g, 1.2, INFINITY, 0, 64),
                          with_penalties(g, 1.2, 0, NAN, 64), with_penalties(g, 1.2, 0, 0, -2)}) {
    auto s = bad;
    s.window = w.view();
    CHECK_THROWS_AS(fn::launch_sample(d.params(s, 0), nullptr), fn::Error);
  }
  auto zero_cap = with_penalties(g, 1.2, 0, 0, 64);
  zero_cap.window = w.view();
  zero_cap.window.capacity = 0;
  CHECK_THROWS_AS(fn::launch_sample(d.params(zero_cap, 0), nullptr), fn::Error);
  // -1 with more accepted ids than the ring holds: the last `capacity` count, flag 3.
  DeviceWindow over({1, 2, 3, 4, 5, 6}, 4);
  auto all = with_penalties(g, 1.2, 0, 0, -1);
  all.window = over.view();
  d.one(all, 0);
  CHECK(d.flag_value() == 3);
}
