// core/eval: per-row math, llama-perplexity windows, llama.cpp KLD statistics and the
// reference-logits file, against hand-computed values (label cpu).
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <regex>
#include <string>

#include "core/backend.h"
#include "core/collectives.h"
#include "core/error.h"
#include "core/eval.h"

namespace fs = std::filesystem;
using fn::ErrorKind;

namespace {

// A backend whose logits are always [0, ln 3] (p = [1/4, 3/4]); counts resets and forwards.
class FixedBackend final : public fn::Backend {
 public:
  FixedBackend() : fn::Backend(info_of()) {}
  std::vector<float> row{0.0f, static_cast<float>(std::log(3.0))};
  int resets = 0, forwards = 0;

  void reset() override { ++resets; }
  int64_t position() const noexcept override { return forwards; }
  std::span<const float> forward(int32_t) override {
    ++forwards;
    return row;
  }
  std::span<const float> prefill(std::span<const int32_t> tokens,
                                 fn::PrefillOutput output) override {
    for (std::size_t i = 0; i < tokens.size(); ++i) forward(tokens[i]);
    return output == fn::PrefillOutput::Last ? std::span<const float>(row)
                                             : std::span<const float>();
  }

 private:
  static fn::BackendInfo info_of() {
    fn::BackendInfo i;
    i.name = "fixed";
    i.vocab_size = 2;
    return i;
  }
};

fs::path tmp_path(const std::string& name) {
  return fs::temp_directory_path() / ("fn_test_eval_" + std::to_string(::getpid()) + "_" + name);
}

ErrorKind kind_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const fn::Error& e) {
    return e.kind();
  }
  return ErrorKind::Internal;  // "did not throw" is reported as a mismatch by the caller
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const fn::Error& e) {
    return e.what();
  }
  return "(no error)";
}

fn::LogitsHeader one_sequence_header(int64_t vocab, std::vector<int32_t> tokens, int32_t next) {
  fn::LogitsHeader h;
  h.vocab_size = vocab;
  fn::LogitsSequence s;
  s.tokens = std::move(tokens);
  s.first = 0;
  s.n_rows = static_cast<int64_t>(s.tokens.size());
  s.next_token = next;
  h.sequences.push_back(s);
  return h;
}

}  // namespace

TEST_CASE("eval: token_nll and log_softmax give the hand-computed values") {
  const std::vector<float> l = {0.0f, static_cast<float>(std::log(3.0))};
  CHECK(fn::token_nll(l, 0) == doctest::Approx(std::log(4.0)).epsilon(1e-7));
  CHECK(fn::token_nll(l, 1) == doctest::Approx(std::log(4.0 / 3.0)).epsilon(1e-7));
  std::vector<double> lp;
  fn::log_softmax(l, lp);
  CHECK(std::exp(lp[0]) == doctest::Approx(0.25).epsilon(1e-7));
  CHECK(std::exp(lp[1]) == doctest::Approx(0.75).epsilon(1e-7));
  // Large logits do not overflow (max subtracted first).
  const std::vector<float> big = {1000.0f, 1000.0f};
  CHECK(fn::token_nll(big, 1) == doctest::Approx(std::log(2.0)));
}

TEST_CASE("eval: percentile interpolates between order statistics like numpy") {
  const std::vector<double> v = {1, 2, 3, 4};
  CHECK(fn::percentile(v, 0.5) == doctest::Approx(2.5));
  CHECK(fn::percentile(v, 0.999) == doctest::Approx(3.997));
  CHECK(fn::percentile(v, 0.1) == doctest::Approx(1.3));
  CHECK(fn::percentile(v, 0.0) == 1);
  CHECK(fn::percentile(v, 1.0) == 4);
}

TEST_CASE("eval: mean_and_uncertainty is llama.cpp's (no error below 11 samples)") {
  // 12 samples: six 1s and six 3s: mean 2, population variance 1, error sqrt(1/11).
  const fn::MeanErr a = fn::mean_and_uncertainty(24.0, 60.0, 12);
  CHECK(a.mean == doctest::Approx(2.0));
  CHECK(a.err == doctest::Approx(std::sqrt(1.0 / 11.0)));
  const fn::MeanErr b = fn::mean_and_uncertainty(20.0, 50.0, 10);
  CHECK(b.mean == doctest::Approx(2.0));
  CHECK(b.err == 0.0);
}

TEST_CASE("eval: perplexity scores positions n_ctx/2 .. n_ctx-2 of each fresh window") {
  FixedBackend fb;
  // 20 tokens, n_ctx 8: 2 windows ([0,8), [8,16)); each scores positions 4, 5, 6 -> targets
  // tokens[5..7] and tokens[13..15]. Target 0 costs ln 4, target 1 costs ln(4/3).
  const std::vector<int32_t> t = {1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0};
  std::vector<double> seen;
  const fn::PerplexityResult r =
      fn::perplexity(fb, t, 8, -1, [&](int64_t i, const fn::PerplexityResult& p) {
        CHECK(i == static_cast<int64_t>(seen.size()));
        seen.push_back(p.ppl());
      });
  // The row holds float(ln 3) = a: p0 = 1/(1+e^a), p1 = e^a/(1+e^a).
  const double a = static_cast<double>(static_cast<float>(std::log(3.0)));
  const double l4 = std::log1p(std::exp(a)), l43 = std::log1p(std::exp(a)) - a;
  const double c1 = l4 + l43 + l43;  // targets 0, 1, 1
  const double c2 = l4 + l4 + l43;   // targets 0, 0, 1
  CHECK(r.n_chunks == 2);
  CHECK(r.count == 6);
  CHECK(fb.resets == 2);
  CHECK(fb.forwards == 2 * 7);  // positions 0..6 of each window
  REQUIRE(r.running_ppl.size() == 2);
  CHECK(r.running_ppl[0] == doctest::Approx(std::exp(c1 / 3)).epsilon(1e-12));
  CHECK(r.ppl() == doctest::Approx(std::exp((c1 + c2) / 6)).epsilon(1e-12));
  CHECK(seen == r.running_ppl);
  // Uncertainty: PPL * sqrt(var/(n-1)), var over the six NLLs.
  const std::vector<double> x = {l4, l43, l43, l4, l4, l43};
  const double mean = (c1 + c2) / 6;
  double var = 0;
  for (double v : x) var += v * v / 6;
  var -= mean * mean;
  CHECK(r.ppl_err() == doctest::Approx(r.ppl() * std::sqrt(var / 5)).epsilon(1e-9));
  // --chunks 1 keeps the first window only.
  FixedBackend fb1;
  CHECK(fn::perplexity(fb1, t, 8, 1, {}).count == 3);
}

TEST_CASE("eval: perplexity rejects a text shorter than one window, naming -c/--ctx-size") {
  FixedBackend fb;
  const std::vector<int32_t> t(7, 1);
  CHECK(kind_of([&] { fn::perplexity(fb, t, 8, -1, {}); }) == ErrorKind::Usage);
  CHECK(message_of([&] { fn::perplexity(fb, t, 8, -1, {}); }).find("-c/--ctx-size 8") !=
        std::string::npos);
  CHECK(fb.forwards == 0);
}

TEST_CASE("eval: parse_token_ids accepts commas, spaces and newlines and rejects bad items") {
  CHECK(fn::parse_token_ids("1, 2,3\n4\t5\r\n", 10, "--ids-file x") ==
        std::vector<int32_t>{1, 2, 3, 4, 5});
  CHECK(fn::parse_token_ids("  \n", 10, "x").empty());
  CHECK(kind_of([] { fn::parse_token_ids("1,x", 10, "--prompt-ids"); }) == ErrorKind::Usage);
  // A file's content: a format error (exit 3), every kind of bad item.
  for (const char* bad : {"1,x", "1,,2", "-1", "1 10"})
    CHECK(kind_of([&] { fn::parse_token_ids(bad, 10, "--ids-file f", ErrorKind::Format); }) ==
          ErrorKind::Format);
  CHECK(message_of([] {
          fn::parse_token_ids("1 10", 10, "--ids-file f");
        }).find("--ids-file f: item 2 = 10 is outside the vocabulary [0, 10)") !=
        std::string::npos);
  // Past int64: still a number, so "outside the vocabulary"; trailing junk: not an integer.
  CHECK(message_of([] {
          fn::parse_token_ids("1 99999999999999999999", 10, "x");
        }).find("x: item 2 = 99999999999999999999 is outside the vocabulary") != std::string::npos);
  CHECK(message_of([] {
          fn::parse_token_ids("99999999999999999999x", 10, "x");
        }).find("x: item 1 \"99999999999999999999x\" is not an integer") != std::string::npos);
  // A negative id is named as such, whatever the vocabulary (also past int64).
  CHECK(message_of([] {
          fn::parse_token_ids("3 -1", 10, "--ids");
        }).find("--ids: item 2 = -1 is negative (token ids are 0 or more)") != std::string::npos);
  CHECK(message_of([] {
          fn::parse_token_ids("-99999999999999999999", 10, "x");
        }).find("x: item 1 = -99999999999999999999 is negative") != std::string::npos);
  // vocab_size 0: the syntax alone (before the vocabulary is known); ids past int32 come back 0.
  CHECK(fn::parse_token_ids("5 99999999999999999999 3000000000", 0, "x") ==
        std::vector<int32_t>{5, 0, 0});
  CHECK(message_of([] { fn::parse_token_ids("5 -2", 0, "x"); }).find("is negative") !=
        std::string::npos);
  CHECK(message_of([] { fn::parse_token_ids("5 z", 0, "x"); }).find("is not an integer") !=
        std::string::npos);
  // An empty item between commas, or a comma at either end, is a mistake, not a separator.
  CHECK(fn::parse_token_ids("1 , 2 ,3", 10, "x") == std::vector<int32_t>{1, 2, 3});
  for (const char* bad : {"1,,2", ",1,2", "1,2,", ",", "1, ,2"}) {
    CAPTURE(bad);
    CHECK(message_of([bad] {
            fn::parse_token_ids(bad, 10, "--prompt-ids");
          }).find("--prompt-ids: empty item") != std::string::npos);
  }
  // Items are counted from 1 in the messages: the empty one between "1," and ",2" is the second.
  CHECK(message_of([] { fn::parse_token_ids("1,,2", 10, "x"); }).find("x: empty item 2 (") !=
        std::string::npos);
}

TEST_CASE("eval: fnv1a64 gives the published FNV-1a test vectors") {
  CHECK(fn::fnv1a64("") == 0xcbf29ce484222325ull);
  CHECK(fn::fnv1a64("a") == 0xaf63dc4c8601ec8cull);
  CHECK(fn::fnv1a64("foobar") == 0x85944171f73967e8ull);
}

TEST_CASE("eval: KLD, NLL, Δp and top-1 of one row equal the hand-computed values") {
  // base p = [1/4, 3/4], Q q = [1/2, 1/2]: KL = 1/4 ln(1/2) + 3/4 ln(3/2).
  fn::RefRow ref;
  ref.logprobs = {std::log(0.25), std::log(0.75)};
  ref.top1 = 1;
  ref.target_logprob = std::log(0.75);
  const std::vector<float> q = {0.0f, 0.0f};
  fn::KldStats s;
  s.add(q, ref, 1);
  const double kl = 0.25 * std::log(0.5) + 0.75 * std::log(1.5);
  const nlohmann::json j = s.to_json();
  CHECK(j["kld"]["mean"].get<double>() == doctest::Approx(kl).epsilon(1e-7));
  CHECK(j["same_top1"].get<double>() == 0.0);  // argmax q = 0 (tie, lowest index), base = 1
  CHECK(j["delta_p"]["mean"].get<double>() == doctest::Approx(0.5 - 0.75).epsilon(1e-7));
  CHECK(s.ppl_q() == doctest::Approx(2.0).epsilon(1e-7));
  CHECK(s.ppl_base() == doctest::Approx(4.0 / 3.0).epsilon(1e-7));
  // A row without target counts for KLD and top-1 only.
  s.add(std::vector<float>{0.0f, 1.0f}, ref, -1);
  CHECK(s.count() == 2);
  CHECK(s.count_nll() == 1);
  CHECK(s.same_top1() == 0.5);
  const std::string rep = s.report();
  for (const char* line :
       {"====== Perplexity statistics ======", "Mean PPL(Q)                   :",
        "====== KL divergence statistics ======", "Mean    KLD:", "Maximum KLD:", "99.9%   KLD:",
        "99.0%   KLD:", "95.0%   KLD:", "90.0%   KLD:", "Median  KLD:", "Minimum KLD:",
        "====== Token probability statistics ======", "Mean    Δp:", "RMS Δp    :",
        "Same top p: 50.000"}) {
    CHECK_MESSAGE(rep.find(line) != std::string::npos, std::string(line));
  }
}

TEST_CASE("eval: top-K KLD with the residual mass equals the hand-computed approximation") {
  // base p = [0.5, 0.3, 0.2], K = 1: ids {0}, residual 0.5. Q q = [0.25, 0.25, 0.5]:
  // KL ≈ 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75).
  fn::RefRow ref;
  ref.topk_ids = {0};
  ref.topk_logprobs = {std::log(0.5)};
  ref.residual_mass = 0.5;
  ref.target_logprob = std::log(0.2);
  ref.top1 = 0;
  const std::vector<float> q = {static_cast<float>(std::log(0.25)),
                                static_cast<float>(std::log(0.25)),
                                static_cast<float>(std::log(0.5))};
  fn::KldStats s;
  s.add(q, ref, 2);
  CHECK(s.mean_kld() ==
        doctest::Approx(0.5 * std::log(2.0) + 0.5 * std::log(0.5 / 0.75)).epsilon(1e-6));
  CHECK(s.same_top1() == 0.0);
  CHECK(s.ppl_base() == doctest::Approx(5.0).epsilon(1e-6));
  // K = V (no residual) gives the full KL.
  fn::RefRow full;
  full.topk_ids = {0, 1, 2};
  full.topk_logprobs = {std::log(0.5), std::log(0.3), std::log(0.2)};
  full.residual_mass = 0;
  full.target_logprob = std::log(0.2);
  fn::KldStats s2;
  s2.add(q, full, 2);
  const double kl = 0.5 * std::log(2.0) + 0.3 * std::log(0.3 / 0.25) + 0.2 * std::log(0.2 / 0.5);
  CHECK(s2.mean_kld() == doctest::Approx(kl).epsilon(1e-6));
}

TEST_CASE("eval: a full float32 logits file round-trips bit for bit and reads as log-probs") {
  const fs::path p = tmp_path("full.fnl");
  fn::LogitsHeader h = one_sequence_header(3, {0, 2}, 1);
  h.source = {{"producer", "test"}};
  const std::vector<float> r0 = {1.0f, 2.0f, 3.0f}, r1 = {-1.5f, 0.25f, 7.0f};
  {
    fn::LogitsWriter w(p, h);
    w.append(r0);
    w.append(r1);
    w.close();
  }
  CHECK((fs::file_size(p) - 2 * 3 * 4) % 64 == 0);
  fn::LogitsReader rd(p);
  CHECK(rd.header().vocab_size == 3);
  CHECK(rd.header().n_positions() == 2);
  CHECK(rd.header().sequences[0].tokens == std::vector<int32_t>{0, 2});
  CHECK(rd.header().sequences[0].target(0) == 2);
  CHECK(rd.header().sequences[0].target(1) == 1);
  CHECK(rd.header().source["producer"] == "test");
  fn::RefRow row;
  rd.read_row(1, 1, row);
  std::vector<double> lp;
  fn::log_softmax(r1, lp);
  for (int i = 0; i < 3; ++i)
    CHECK(row.logprobs[static_cast<std::size_t>(i)] ==
          doctest::Approx(lp[static_cast<std::size_t>(i)]).epsilon(1e-12));
  CHECK(row.top1 == 2);
  CHECK(row.target_logprob == doctest::Approx(lp[1]).epsilon(1e-12));
  // The raw bytes hold the logits exactly.
  std::ifstream in(p, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(fs::file_size(p) - 12));
  float back[3];
  in.read(reinterpret_cast<char*>(back), 12);
  CHECK(std::vector<float>(back, back + 3) == r1);
  fs::remove(p);
}

TEST_CASE("eval: a reference row holding NaN or Inf is a format error naming the row") {
  for (const float bad : {NAN, INFINITY}) {
    const fs::path p = tmp_path("nonfinite.fnl");
    {
      fn::LogitsWriter w(p, one_sequence_header(3, {0, 2}, 1));
      w.append(std::vector<float>{1.0f, 2.0f, 3.0f});
      w.append(std::vector<float>{0.5f, bad, 1.0f});
      w.close();
    }
    fn::LogitsReader rd(p);
    fn::RefRow row;
    rd.read_row(0, 2, row);
    try {
      rd.read_row(1, 1, row);
      FAIL("read a non-finite row");
    } catch (const fn::Error& e) {
      CHECK(e.kind() == fn::ErrorKind::Format);
      CHECK(std::string(e.what()).find("row 1") != std::string::npos);
      CHECK(std::string(e.what()).find("not finite") != std::string::npos);
    }
    fs::remove(p);
  }
}

TEST_CASE("eval: float16 log-probs and top-K rows read back within FP16 rounding") {
  const std::vector<float> r0 = {0.0f, 1.0f, 2.0f, 3.0f};
  std::vector<double> lp;
  fn::log_softmax(r0, lp);
  {
    const fs::path p = tmp_path("f16.fnl");
    fn::LogitsHeader h = one_sequence_header(4, {3}, -1);
    h.dtype = fn::LogitsDtype::Float16;
    h.values_are_logprobs = true;
    {
      fn::LogitsWriter w(p, h);
      w.append(r0);
      w.close();
    }
    fn::LogitsReader rd(p);
    fn::RefRow row;
    rd.read_row(0, -1, row);
    // FP16 rounding moves each value by at most |lp_i|·2^-11 and the re-normalisation shifts all
    // by at most the largest such move.
    const double max_move = std::abs(lp[0]) * std::ldexp(1.0, -11);
    for (std::size_t i = 0; i < 4; ++i) {
      CHECK(std::abs(row.logprobs[i] - lp[i]) <= std::abs(lp[i]) * std::ldexp(1.0, -11) + max_move);
    }
    double mass = 0;
    for (double v : row.logprobs) mass += std::exp(v);
    CHECK(mass == doctest::Approx(1.0).epsilon(1e-14));
    CHECK(std::isnan(row.target_logprob));
    // KL against the unrounded row is >= 0 (Gibbs), never the negative value Σp != 1 would give.
    fn::KldStats ks;
    ks.add(r0, row, -1);
    CHECK(ks.mean_kld() >= 0.0);
    CHECK(ks.mean_kld() < 1e-6);
    fs::remove(p);
  }
  {
    const fs::path p = tmp_path("topk.fnl");
    fn::LogitsHeader h = one_sequence_header(4, {3, 1}, 0);
    h.mode = fn::LogitsMode::TopK;
    h.top_k = 2;
    h.values_are_logprobs = true;
    {
      fn::LogitsWriter w(p, h);
      w.append(r0);
      w.append(r0);
      w.close();
    }
    fn::LogitsReader rd(p);
    fn::RefRow row;
    rd.read_row(0, 1, row);
    CHECK(row.topk_ids == std::vector<int32_t>{3, 2});
    CHECK(row.topk_logprobs[0] == doctest::Approx(lp[3]).epsilon(1e-6));
    CHECK(row.residual_mass == doctest::Approx(std::exp(lp[0]) + std::exp(lp[1])).epsilon(1e-6));
    CHECK(row.target_logprob == doctest::Approx(lp[1]).epsilon(1e-6));
    CHECK(row.top1 == 3);
    rd.read_row(1, 0, row);
    CHECK(row.target_logprob == doctest::Approx(lp[0]).epsilon(1e-6));  // next_token 0
    fs::remove(p);
  }
}

TEST_CASE("eval: a top-K row with a repeated id or probabilities above 1 is a format error") {
  // A one-row top-2 file of the logits {0, 1, 2, 3} (ids {3, 2}), then its bytes patched: the
  // first occurrence after the header of a known field value replaced by a bad one.
  const std::vector<float> r0 = {0.0f, 1.0f, 2.0f, 3.0f};
  std::vector<double> lp;
  fn::log_softmax(r0, lp);
  const float lp3 = static_cast<float>(lp[3]), lp2 = static_cast<float>(lp[2]);
  auto patched = [&](const void* from, const void* to, std::size_t n) {
    const fs::path p = tmp_path("topk_patch.fnl");
    fn::LogitsHeader h = one_sequence_header(4, {3}, 0);
    h.mode = fn::LogitsMode::TopK;
    h.top_k = 2;
    h.values_are_logprobs = true;
    {
      fn::LogitsWriter w(p, h);
      w.append(r0);
      w.close();
    }
    std::string bytes;
    {
      std::ifstream in(p, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    // The first occurrence: the JSON header before the arrays holds no such (non-text) bytes.
    const std::size_t at = bytes.find(std::string(static_cast<const char*>(from), n));
    REQUIRE(at != std::string::npos);
    bytes.replace(at, n, static_cast<const char*>(to), n);
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
    return p;
  };
  auto read_error = [](const fs::path& p) {
    fn::LogitsReader rd(p);
    fn::RefRow row;
    try {
      rd.read_row(0, 0, row);
    } catch (const fn::Error& e) {
      CHECK(e.kind() == fn::ErrorKind::Format);
      return std::string(e.what());
    }
    return std::string();
  };
  {  // ids {3, 2} -> {3, 3}
    const int32_t from[2] = {3, 2}, to[2] = {3, 3};
    const std::string e = read_error(patched(from, to, sizeof from));
    CHECK(e.find("row 0: token id 3 appears twice in topk_ids") != std::string::npos);
  }
  {  // log p of id 3 -> +0.5 (p > 1)
    const float to = 0.5f;
    const std::string e = read_error(patched(&lp3, &to, 4));
    CHECK(e.find("row 0: topk_logprobs[0] = 0.5 is above 0") != std::string::npos);
  }
  {  // log p of id 2 -> log 0.9: p(3) + p(2) = 0.64 + 0.9 > 1
    const float to = std::log(0.9f);
    const std::string e = read_error(patched(&lp2, &to, 4));
    CHECK(e.find("row 0: the top-2 probabilities and residual_mass add up to") !=
          std::string::npos);
  }
  {  // the unpatched row reads (the checks pass on a writer's own file)
    const float same = lp3;
    CHECK(read_error(patched(&lp3, &same, 4)).empty());
  }
  fs::remove(tmp_path("topk_patch.fnl"));
}

TEST_CASE("eval: a truncated, foreign or inconsistent logits file is rejected as a format error") {
  const fs::path p = tmp_path("bad.fnl");
  fn::LogitsHeader h = one_sequence_header(3, {0, 1}, -1);
  {
    fn::LogitsWriter w(p, h);
    w.append(std::vector<float>{1, 2, 3});
    w.append(std::vector<float>{1, 2, 3});
    w.close();
  }
  const uint64_t size = fs::file_size(p);
  SUBCASE("one byte missing") {
    fs::resize_file(p, size - 1);
    CHECK(kind_of([&] { fn::LogitsReader r(p); }) == ErrorKind::Format);
    CHECK(message_of([&] { fn::LogitsReader r(p); }).find("truncated") != std::string::npos);
  }
  SUBCASE("cut inside the header") {
    fs::resize_file(p, 20);
    CHECK(message_of([&] { fn::LogitsReader r(p); }).find("truncated") != std::string::npos);
  }
  SUBCASE("a trailing byte") {
    std::ofstream(p, std::ios::binary | std::ios::app).put('x');
    CHECK(kind_of([&] { fn::LogitsReader r(p); }) == ErrorKind::Format);
  }
  SUBCASE("not a logits file") {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << "hello world, this is text";
    CHECK(kind_of([&] { fn::LogitsReader r(p); }) == ErrorKind::Format);
  }
  SUBCASE("a missing file") {
    fs::remove(p);
    CHECK(kind_of([&] { fn::LogitsReader r(p); }) == ErrorKind::Io);
  }
  SUBCASE("a base file for another vocabulary size") {
    FixedBackend fb;  // vocab 2, the file's is 3
    fn::LocalCollectives coll;
    fn::LogitsReader r(p);
    CHECK(kind_of([&] { fn::kl_divergence(fb, coll, &r, {}); }) == ErrorKind::Format);
    CHECK(message_of([&] {
            fn::kl_divergence(fb, coll, &r, {});
          }).find("vocab_size 3 but the model has 2") != std::string::npos);
    CHECK(fb.forwards == 0);
  }
  fs::remove(p);
}

TEST_CASE("eval: the writer refuses headers it could not read back") {
  const fs::path p = tmp_path("w.fnl");
  fn::LogitsHeader h = one_sequence_header(3, {0, 5}, -1);  // 5 >= vocab 3
  CHECK(kind_of([&] { fn::LogitsWriter w(p, h); }) == ErrorKind::Usage);
  h = one_sequence_header(3, {0, 1}, -1);
  h.mode = fn::LogitsMode::TopK;
  h.top_k = 4;
  h.values_are_logprobs = true;
  CHECK(kind_of([&] { fn::LogitsWriter w(p, h); }) == ErrorKind::Usage);
  // n_rows 0 is named as such (it was reported as rows that "do not fit" the tokens); a
  // vocab_size past the 32-bit token ids (2^62 overflowed the array sizes) is refused.
  h = one_sequence_header(3, {0, 1}, -1);
  h.sequences[0].n_rows = 0;
  CHECK(message_of([&] {
          fn::LogitsWriter w(p, h);
        }).find("sequences[0]: n_rows must be >= 1, got 0") != std::string::npos);
  h = one_sequence_header(3, {0, 1}, -1);
  h.vocab_size = int64_t{1} << 62;
  CHECK(message_of([&] {
          fn::LogitsWriter w(p, h);
        }).find("vocab_size must be in [1, 2^31 - 1], got 4611686018427387904") !=
        std::string::npos);
  fs::remove(p);
}

TEST_CASE(
    "eval: kl_divergence over a file written from the same backend is zero with all top-1 equal") {
  const fs::path p = tmp_path("self.fnl");
  FixedBackend fb;
  fn::LogitsHeader h;
  h.vocab_size = 2;
  h.sequences = fn::perplexity_sequences(std::vector<int32_t>{1, 0, 1, 1, 0, 1, 0, 0, 1}, 4, -1);
  {
    fn::LogitsWriter w(p, h);
    fn::dump_logits(fb, h.sequences, &w);
    w.close();
  }
  fn::LogitsReader rd(p);
  fn::LocalCollectives coll;
  int64_t calls = 0;
  const fn::KldStats s =
      fn::kl_divergence(fb, coll, &rd, [&](int64_t, const fn::KldStats&) { ++calls; });
  CHECK(calls == 2);
  CHECK(s.count() == 2);  // windows of 4: position 2 of each
  CHECK(s.mean_kld() == doctest::Approx(0.0).epsilon(1e-15));
  CHECK(s.same_top1() == 1.0);
  CHECK(s.ppl_q() == doctest::Approx(s.ppl_base()).epsilon(1e-12));
  fs::remove(p);
}

// ---------------------------------------------------------------- the writer's staging file

namespace {

// A fresh empty directory of its own (its listing is what a writer left), removed on scope exit.
struct TmpDir {
  fs::path dir;
  explicit TmpDir(const std::string& name) : dir(tmp_path(name)) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~TmpDir() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }
};

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// True when `entry` is a staging file name of the output file `name`:
// "<name>.partial.<pid>.<16 hex digits>" (create_staging_file, core/paths.h).
bool is_staging_of(const std::string& entry, const std::string& name) {
  static const std::regex pattern("\\.partial\\.[0-9]+\\.[0-9a-f]{16}");
  return entry.size() > name.size() && entry.compare(0, name.size(), name) == 0 &&
         std::regex_match(entry.substr(name.size()), pattern);
}

// The staging files of `p` in its directory.
std::vector<fs::path> staging_files_of(const fs::path& p) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(p.parent_path()))
    if (is_staging_of(e.path().filename().string(), p.filename().string())) out.push_back(e.path());
  return out;
}

}  // namespace

TEST_CASE("eval: the writer's file appears at its path only when close() succeeds") {
  TmpDir d("stage_ok");
  const fs::path p = d.dir / "out.fnl";
  {
    fn::LogitsWriter w(p, one_sequence_header(3, {0, 2}, 1));
    w.append(std::vector<float>{1, 2, 3});
    // Mid-run: the rows go to a staging file beside the path; the path itself does not exist yet.
    REQUIRE(d.listing().size() == 1);
    CHECK(is_staging_of(d.listing()[0], "out.fnl"));
    w.append(std::vector<float>{4, 5, 6});
    CHECK(!fs::exists(p));
    w.close();
    CHECK(d.listing() == std::vector<std::string>{"out.fnl"});
    w.close();  // a second close does nothing
  }
  CHECK(d.listing() == std::vector<std::string>{"out.fnl"});  // the destructor keeps it
  fn::LogitsReader rd(p);
  CHECK(rd.header().n_positions() == 2);
}

TEST_CASE("eval: a writer destroyed without close() leaves neither the file nor its staging file") {
  TmpDir d("stage_abort");
  const fs::path p = d.dir / "out.fnl";
  SUBCASE("every row written, never closed") {
    fn::LogitsWriter w(p, one_sequence_header(3, {0, 2}, 1));
    w.append(std::vector<float>{1, 2, 3});
    w.append(std::vector<float>{4, 5, 6});
  }
  SUBCASE("an exception unwinding mid-run") {
    try {
      fn::LogitsWriter w(p, one_sequence_header(3, {0, 2}, 1));
      w.append(std::vector<float>{1, 2, 3});
      throw std::runtime_error("the run failed");
    } catch (const std::runtime_error&) {
    }
  }
  SUBCASE("close() refusing missing rows (Internal), then the destructor") {
    fn::LogitsWriter w(p, one_sequence_header(3, {0, 2}, 1));
    w.append(std::vector<float>{1, 2, 3});
    CHECK(kind_of([&] { w.close(); }) == ErrorKind::Internal);
    CHECK(d.listing().empty());  // close() removed it, before the destructor
  }
  SUBCASE("a killed run's staging files are not the writer's: left alone") {
    const std::vector<std::string> stale = {"out.fnl.partial",
                                            "out.fnl.partial.1.0123456789abcdef"};
    for (const auto& name : stale) std::ofstream(d.dir / name) << "stale";
    {
      fn::LogitsWriter w(p, one_sequence_header(3, {0, 2}, 1));
      w.append(std::vector<float>{1, 2, 3});
      CHECK(d.listing().size() == 3);
    }
    CHECK(d.listing() == stale);
    for (const auto& name : stale) CHECK(read_all(d.dir / name) == "stale");
    for (const auto& name : stale) fs::remove(d.dir / name);
  }
  CHECK(d.listing().empty());
}

TEST_CASE("eval: a file already at the writer's path is untouched until close() replaces it") {
  TmpDir d("stage_keep");
  const fs::path p = d.dir / "out.fnl";
  std::ofstream(p) << "the previous reference";
  fs::permissions(p, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  {  // aborted: the old bytes stay, nothing beside them
    fn::LogitsWriter w(p, one_sequence_header(3, {0, 2}, 1));
    w.append(std::vector<float>{1, 2, 3});
    CHECK(read_all(p) == "the previous reference");
  }
  CHECK(read_all(p) == "the previous reference");
  CHECK(d.listing() == std::vector<std::string>{"out.fnl"});
  {  // closed: replaced whole, with the old file's permission bits
    fn::LogitsWriter w(p, one_sequence_header(3, {0, 2}, 1));
    w.append(std::vector<float>{1, 2, 3});
    w.append(std::vector<float>{4, 5, 6});
    CHECK(read_all(p) == "the previous reference");
    w.close();
  }
  CHECK(d.listing() == std::vector<std::string>{"out.fnl"});
  CHECK(fn::LogitsReader(p).header().n_positions() == 2);
  CHECK((fs::status(p).permissions() & fs::perms::all) ==
        (fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read));
}

TEST_CASE(
    "eval: a write that fails mid-run is an io error from close() that removes the .partial") {
  // The file-size limit stands in for a full disk: with SIGXFSZ ignored, write() past it fails
  // (EFBIG) as one on a full disk does (ENOSPC). Restored on scope exit, whatever happens.
  struct FileSizeLimit {
    rlimit old{};
    void (*old_handler)(int) = SIG_DFL;
    explicit FileSizeLimit(rlim_t bytes) {
      REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
      rlimit small = old;
      small.rlim_cur = bytes;
      old_handler = std::signal(SIGXFSZ, SIG_IGN);
      REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    }
    ~FileSizeLimit() {
      ::setrlimit(RLIMIT_FSIZE, &old);
      std::signal(SIGXFSZ, old_handler);
    }
  };
  TmpDir d("stage_efbig");
  const fs::path p = d.dir / "out.fnl";
  std::ofstream(p) << "the previous reference";
  ErrorKind kind = ErrorKind::Internal;
  std::string msg = "(no error)";
  {
    fn::LogitsWriter w(p, one_sequence_header(1024, {0, 1, 2, 3}, -1));  // 4 KiB rows
    {
      FileSizeLimit limit(4096);  // the header and less than one row
      const std::vector<float> row(1024, 0.5f);
      w.check();                                  // nothing failed yet: no throw
      for (int i = 0; i < 4; ++i) w.append(row);  // no throw: check() and close() report it
      try {
        w.check();
        FAIL("check() did not report the failed write");
      } catch (const fn::Error& e) {
        CHECK(e.kind() == ErrorKind::Io);
        CHECK(std::string(e.what()).find("(File too large)") != std::string::npos);
      }
      try {
        w.close();
      } catch (const fn::Error& e) {
        kind = e.kind();
        msg = e.what();
      }
    }
    CHECK(d.listing() == std::vector<std::string>{"out.fnl"});  // before the destructor
  }
  CHECK(kind == ErrorKind::Io);
  CHECK(msg.find(p.string() + ": write failed at ") != std::string::npos);
  CHECK(msg.find("of " + p.string() + ".partial.") != std::string::npos);
  CHECK(msg.find(" (File too large)") != std::string::npos);
  CHECK(read_all(p) == "the previous reference");
  CHECK(d.listing() == std::vector<std::string>{"out.fnl"});
}

TEST_CASE("eval: a writer through a symlink replaces the file it names, staged beside that file") {
  TmpDir d("stage_link");
  fs::create_directories(d.dir / "real");
  const fs::path target = d.dir / "real" / "out.fnl";
  const fs::path link = d.dir / "link.fnl";
  fs::create_symlink("real/out.fnl", link);  // dangling until the close
  {
    fn::LogitsWriter w(link, one_sequence_header(3, {0}, -1));
    w.append(std::vector<float>{1, 2, 3});
    CHECK(staging_files_of(target).size() == 1);
    CHECK(staging_files_of(link).empty());
    w.close();
  }
  CHECK(fs::is_symlink(link));
  CHECK(fn::LogitsReader(link).header().n_positions() == 1);
  CHECK(staging_files_of(target).empty());
}

TEST_CASE("eval: a writer to a device (/dev/null) writes in place: no staging file, no rename") {
  REQUIRE(fs::is_character_file("/dev/null"));
  {
    fn::LogitsWriter w("/dev/null", one_sequence_header(3, {0}, -1));
    w.append(std::vector<float>{1, 2, 3});
    CHECK(staging_files_of("/dev/null").empty());
    w.close();
  }
  CHECK(fs::is_character_file("/dev/null"));
  CHECK(staging_files_of("/dev/null").empty());
}

TEST_CASE(
    "eval: two writers of one path never share a staging file: the file is the last closer's") {
  // Two runs with the same -o, interleaved: each stages to a file of its own, so each close()
  // puts that writer's complete rows at the path, and both succeed.
  TmpDir d("stage_two");
  const fs::path p = d.dir / "out.fnl";
  const auto tokens_at_path = [&] { return fn::LogitsReader(p).header().sequences.at(0).tokens; };
  fn::LogitsWriter a(p, one_sequence_header(3, {0, 1}, -1));
  fn::LogitsWriter b(p, one_sequence_header(3, {0, 2}, -1));
  REQUIRE(staging_files_of(p).size() == 2);
  a.append(std::vector<float>{1, 2, 3});
  b.append(std::vector<float>{4, 5, 6});
  a.append(std::vector<float>{1, 2, 3});
  a.close();
  CHECK(tokens_at_path() == std::vector<int32_t>{0, 1});  // a's file, complete
  CHECK(staging_files_of(p).size() == 1);                 // b's, still being written
  b.append(std::vector<float>{4, 5, 6});
  b.close();
  CHECK(tokens_at_path() == std::vector<int32_t>{0, 2});
  CHECK(d.listing() == std::vector<std::string>{"out.fnl"});
}
