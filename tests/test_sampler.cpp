// Sampler (core/sampler.h) against hand-computed distributions: greedy ties, top-k, the top-p and
// min-p boundaries, llama.cpp's order (cuts before temperature), penalties on known logits, the
// raw-bit uniform draw, and a frequency check of 40,000 draws with a fixed seed.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/sampler.h"

namespace {

std::vector<float> logs(std::initializer_list<double> p) {
  std::vector<float> l;
  for (double v : p) l.push_back(static_cast<float>(std::log(v)));
  return l;
}

fn::SamplingParams neutral(double temp = 1.0) {
  fn::SamplingParams p;
  p.temperature = temp;
  p.top_k = 0;
  p.top_p = 1.0;
  p.min_p = 0.0;
  p.seed = 7;
  return p;
}

// The last distribution as a dense vector over `n` ids (0 for cut tokens).
std::vector<double> dense(const fn::Sampler& s, std::size_t n) {
  std::vector<double> d(n, 0.0);
  for (const auto& c : s.last_distribution()) d[static_cast<std::size_t>(c.id)] = c.p;
  return d;
}

}  // namespace

TEST_CASE("sampler: greedy picks the largest logit, ties to the lowest id") {
  CHECK(fn::argmax_lowest(std::vector<float>{1, 3, 3, 2}) == 1);
  CHECK(fn::argmax_lowest(std::vector<float>{5, 5, 5}) == 0);
  CHECK(fn::argmax_lowest(std::vector<float>{-1, -0.5f, -0.5f}) == 1);
  CHECK(fn::argmax_lowest(std::vector<float>{NAN, 2, 4, 4}) == 2);
  fn::Sampler s(neutral(0.0));  // temperature 0 = greedy, no draw
  const std::vector<float> l = {0.5f, 2.0f, 2.0f, 1.0f};
  for (int i = 0; i < 5; ++i) CHECK(s.sample(l) == 1);
}

TEST_CASE("sampler: top-k 2 keeps the two largest with their renormalised softmax") {
  auto p = neutral();
  p.top_k = 2;
  fn::Sampler s(p);
  const auto l = logs({1, 2, 3, 4});  // softmax = 0.1, 0.2, 0.3, 0.4
  const int32_t t = s.sample(l);
  CHECK((t == 2 || t == 3));
  const auto d = dense(s, 4);
  CHECK(d[0] == 0.0);
  CHECK(d[1] == 0.0);
  CHECK(d[2] == doctest::Approx(3.0 / 7.0).epsilon(1e-6));
  CHECK(d[3] == doctest::Approx(4.0 / 7.0).epsilon(1e-6));
  // top-k 1 is greedy whatever the temperature.
  p.top_k = 1;
  p.temperature = 5.0;
  fn::Sampler g(p);
  for (int i = 0; i < 20; ++i) CHECK(g.sample(l) == 3);
}

TEST_CASE("sampler: top-p keeps the shortest prefix whose mass reaches p") {
  const auto l = logs({0.1, 0.2, 0.3, 0.4});
  auto p = neutral();
  // Sorted: 0.4, 0.3 (cum 0.7), 0.2 (cum 0.9), 0.1.
  p.top_p = 0.7 - 1e-6;
  fn::Sampler a(p);
  a.sample(l);
  auto d = dense(a, 4);
  CHECK(d[3] == doctest::Approx(4.0 / 7.0).epsilon(1e-6));
  CHECK(d[2] == doctest::Approx(3.0 / 7.0).epsilon(1e-6));
  CHECK(d[1] == 0.0);
  p.top_p = 0.7 + 1e-6;
  fn::Sampler b(p);
  b.sample(l);
  d = dense(b, 4);
  CHECK(d[1] == doctest::Approx(2.0 / 9.0).epsilon(1e-6));
  CHECK(d[0] == 0.0);
  // A tiny p keeps the top token only.
  p.top_p = 0.01;
  fn::Sampler c(p);
  for (int i = 0; i < 10; ++i) CHECK(c.sample(l) == 3);
}

TEST_CASE("sampler: top-p 1 cuts nothing, not even a token of probability 1e-9") {
  auto p = neutral();
  p.top_p = 1.0;
  fn::Sampler s(p);
  const auto l = logs({1e-9, 0.5, 0.5 - 1e-9});
  s.sample(l);
  REQUIRE(s.last_distribution().size() == 3);
  CHECK(dense(s, 3)[0] == doctest::Approx(1e-9).epsilon(1e-3));
}

TEST_CASE("sampler: min-p keeps tokens with p >= min_p * p_max") {
  const auto l = logs({0.5, 0.25, 0.15, 0.1});
  auto p = neutral();
  p.min_p = 0.29;  // threshold 0.145: 0.5, 0.25, 0.15 stay
  fn::Sampler a(p);
  a.sample(l);
  auto d = dense(a, 4);
  CHECK(d[0] == doctest::Approx(0.5 / 0.9).epsilon(1e-6));
  CHECK(d[2] == doctest::Approx(0.15 / 0.9).epsilon(1e-6));
  CHECK(d[3] == 0.0);
  p.min_p = 0.31;  // threshold 0.155: 0.15 goes
  fn::Sampler b(p);
  b.sample(l);
  d = dense(b, 4);
  CHECK(d[0] == doctest::Approx(0.5 / 0.75).epsilon(1e-6));
  CHECK(d[1] == doctest::Approx(0.25 / 0.75).epsilon(1e-6));
  CHECK(d[2] == 0.0);
}

TEST_CASE("sampler: temperature divides the logits; cuts happen before it (llama.cpp order)") {
  const auto l = logs({1, 2, 3, 4});
  auto p = neutral(0.5);  // p ∝ x^2: 1, 4, 9, 16 over 30
  fn::Sampler a(p);
  a.sample(l);
  auto d = dense(a, 4);
  CHECK(d[0] == doctest::Approx(1.0 / 30).epsilon(1e-6));
  CHECK(d[3] == doctest::Approx(16.0 / 30).epsilon(1e-6));
  // top-p 0.65 on the temperature-1 softmax keeps 0.4 and 0.3, then T = 0.5: 16/25, 9/25.
  p.top_p = 0.65;
  fn::Sampler b(p);
  b.sample(l);
  d = dense(b, 4);
  CHECK(d[3] == doctest::Approx(16.0 / 25).epsilon(1e-6));
  CHECK(d[2] == doctest::Approx(9.0 / 25).epsilon(1e-6));
  CHECK(d[1] == 0.0);
}

TEST_CASE("sampler: repetition, frequency and presence penalties on known logits") {
  const std::vector<float> l = {2.0f, -2.0f, 1.0f, 0.5f};
  auto p = neutral();
  p.repetition_penalty = 2.0;
  p.frequency_penalty = 0.5;
  p.presence_penalty = 0.25;
  p.repeat_last_n = 64;
  fn::Sampler s(p);
  s.accept(0);
  s.accept(1);
  s.accept(1);
  s.sample(l);
  // id 0 (seen once): 2 / 2 - (0.5 + 0.25) = 0.25; id 1 (twice): -2 * 2 - (1 + 0.25) = -5.25.
  const double e[4] = {std::exp(0.25), std::exp(-5.25), std::exp(1.0), std::exp(0.5)};
  const double z = e[0] + e[1] + e[2] + e[3];
  const auto d = dense(s, 4);
  for (int i = 0; i < 4; ++i)
    CHECK(d[static_cast<std::size_t>(i)] == doctest::Approx(e[i] / z).epsilon(1e-6));
  // Greedy sees the penalised logits: id 2 (1.0) beats id 0 (0.25).
  p.temperature = 0.0;
  fn::Sampler g(p);
  g.accept(0);
  CHECK(g.sample(l) == 2);
}

TEST_CASE("sampler: the penalty window holds the last repeat_last_n tokens only") {
  const std::vector<float> l = {1.0f, 1.0f, 0.0f};
  auto p = neutral(0.0);
  p.repetition_penalty = 4.0;
  p.repeat_last_n = 1;
  fn::Sampler s(p);
  s.accept(1);
  s.accept(0);  // pushes 1 out: only 0 is penalised (0.25), so 1 wins
  CHECK(s.sample(l) == 1);
  p.repeat_last_n = 0;  // off: the tie goes to the lowest id
  fn::Sampler off(p);
  off.accept(0);
  CHECK(off.sample(l) == 0);
  p.repeat_last_n = 2;
  fn::Sampler two(p);
  two.accept(0);
  two.accept(1);
  two.accept(1);                                     // window {1, 1}: 0 left it
  const std::vector<float> l2 = {0.5f, 1.0f, 0.0f};  // 1 -> 0.25 < 0.5 (0 would be 0.125)
  CHECK(two.sample(l2) == 0);
  p.repeat_last_n = -1;  // the whole history
  fn::Sampler all(p);
  all.accept(1);
  for (int i = 0; i < 100; ++i) all.accept(2);
  CHECK(all.sample(l) == 0);  // 1 still penalised
}

TEST_CASE("sampler: the uniform draw is built from raw mt19937_64 bits") {
  // The standard fixes the 10000th output of a default-seeded (5489) mt19937_64.
  fn::SamplingParams p = neutral();
  p.seed = 5489;
  fn::Sampler s(p);
  for (int i = 0; i < 9999; ++i) s.next_uniform();
  const double want = static_cast<double>(9981545732273789042ULL >> 11) * 0x1.0p-53;
  CHECK(s.next_uniform() == want);
}

TEST_CASE("sampler: 40,000 draws with a fixed seed follow a 4-token distribution") {
  const auto l = logs({0.1, 0.2, 0.3, 0.4});
  auto p = neutral();
  p.seed = 1234;
  fn::Sampler s(p);
  std::vector<int> count(4, 0);
  const int n = 40000;
  std::vector<int32_t> first;
  for (int i = 0; i < n; ++i) {
    const int32_t t = s.sample(l);
    REQUIRE((t >= 0 && t < 4));
    ++count[static_cast<std::size_t>(t)];
    if (i < 50) first.push_back(t);
  }
  const double expect[4] = {0.1, 0.2, 0.3, 0.4};
  double chi2 = 0;
  for (int i = 0; i < 4; ++i) {
    const double e = expect[i] * n;
    chi2 += (count[static_cast<std::size_t>(i)] - e) * (count[static_cast<std::size_t>(i)] - e) / e;
  }
  MESSAGE("chi-square (3 dof) = " << chi2);
  CHECK(chi2 < 16.27);  // p = 0.001
  // Same seed, same stream; another seed, another stream.
  fn::Sampler again(p);
  std::vector<int32_t> first2;
  for (int i = 0; i < 50; ++i) first2.push_back(again.sample(l));
  CHECK(first == first2);
  p.seed = 1235;
  fn::Sampler other(p);
  std::vector<int32_t> first3;
  for (int i = 0; i < 50; ++i) first3.push_back(other.sample(l));
  CHECK(first != first3);
}

TEST_CASE("sampler: out-of-range settings are usage errors naming the flag") {
  auto bad = [](auto mutate, const char* flag) {
    fn::SamplingParams p;
    mutate(p);
    try {
      fn::Sampler s(p);
      FAIL("accepted a bad value for " << flag);
    } catch (const fn::Error& e) {
      CHECK(e.kind() == fn::ErrorKind::Usage);
      CHECK(std::string(e.what()).find(flag) != std::string::npos);
    }
  };
  bad([](fn::SamplingParams& p) { p.temperature = -0.1; }, "--temp");
  bad([](fn::SamplingParams& p) { p.top_k = -3; }, "--top-k");
  bad([](fn::SamplingParams& p) { p.top_p = 0.0; }, "--top-p");
  bad([](fn::SamplingParams& p) { p.top_p = 1.5; }, "--top-p");
  bad([](fn::SamplingParams& p) { p.min_p = -0.5; }, "--min-p");
  bad([](fn::SamplingParams& p) { p.repetition_penalty = 0.0; }, "--repeat-penalty");
  bad([](fn::SamplingParams& p) { p.repeat_last_n = -2; }, "--repeat-last-n");
  bad([](fn::SamplingParams& p) { p.presence_penalty = INFINITY; }, "--presence-penalty");
}
