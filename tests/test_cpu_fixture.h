// Reader of the reference fixtures in tests/data/fixtures/<name>/ (written by
// scripts/reference/make_fixtures.py; format in expected.json's "logits" entry): prompt ids, the
// 33 greedy ids and the FP32 reference logits of every position. Used by test_cpu_model*.cpp.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"

namespace fn::test {

/// One fixture: the token sequence the reference ran and its logits, row p = logits after
/// position p of tokens (tokens = prompt_ids ++ generated_ids[0:decode_steps]).
struct RefFixture {
  std::string name;
  std::string dir;
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> generated_ids;  ///< decode_steps + 1; generated_ids[i] = argmax(row P-1+i)
  std::vector<int32_t> tokens;         ///< the rows' input tokens
  int64_t vocab = 0;
  std::vector<float> logits;  ///< [tokens.size(), vocab]
  const float* row(std::size_t p) const {
    return logits.data() + p * static_cast<std::size_t>(vocab);
  }
};

inline RefFixture load_ref_fixture(const std::string& name) {
  RefFixture f;
  f.name = name;
  f.dir = std::string(FN_TEST_DATA_DIR) + "/fixtures/" + name;
  std::ifstream js(f.dir + "/expected.json");
  FN_REQUIRE(js.good(), Io, "cannot open {}/expected.json", f.dir);
  const nlohmann::json e = nlohmann::json::parse(js);
  f.prompt_ids = e.at("prompt_ids").get<std::vector<int32_t>>();
  f.generated_ids = e.at("generated_ids").get<std::vector<int32_t>>();
  const int64_t steps = e.at("decode_steps").get<int64_t>();
  const auto shape = e.at("logits").at("shape").get<std::vector<int64_t>>();
  FN_REQUIRE(e.at("logits").at("dtype") == "float32" && shape.size() == 2, Format,
             "{}: unexpected logits description", f.dir);
  f.tokens = f.prompt_ids;
  f.tokens.insert(f.tokens.end(), f.generated_ids.begin(), f.generated_ids.begin() + steps);
  FN_REQUIRE(shape[0] == static_cast<int64_t>(f.tokens.size()), Format,
             "{}: {} logit rows for {} tokens", f.dir, shape[0], f.tokens.size());
  f.vocab = shape[1];
  f.logits.resize(static_cast<std::size_t>(shape[0] * shape[1]));
  std::ifstream lb(f.dir + "/" + e.at("logits").at("file").get<std::string>(), std::ios::binary);
  lb.read(reinterpret_cast<char*>(f.logits.data()),
          static_cast<std::streamsize>(f.logits.size() * sizeof(float)));
  FN_REQUIRE(lb.gcount() == static_cast<std::streamsize>(f.logits.size() * sizeof(float)), Io,
             "{}: logits file too short", f.dir);
  return f;
}

/// One item of tests/data/eval/loglik_tp4.jsonl (written with its expected values by
/// scripts/reference/loglik_reference.py from transformers' rows on the tp4 fixture).
struct LoglikItem {
  nlohmann::json id;
  std::vector<int32_t> context;
  std::vector<std::vector<int32_t>> choices;
  nlohmann::json want;  ///< loglik_tp4.expected.json's entry: per choice logprob, n_tokens, ...
};

/// The items of loglik_tp4.jsonl, each with its expected entry (matched by position, the ids
/// required equal). Throws fn::Error(Io) for a missing file, fn::Error(Format) when the two
/// files disagree on the items.
inline std::vector<LoglikItem> load_loglik_tp4() {
  const std::string dir = std::string(FN_TEST_DATA_DIR) + "/eval/";
  std::ifstream items(dir + "loglik_tp4.jsonl");
  std::ifstream ex(dir + "loglik_tp4.expected.json");
  FN_REQUIRE(items.good() && ex.good(), Io, "cannot open {}loglik_tp4.*", dir);
  const nlohmann::json expected = nlohmann::json::parse(ex);
  std::vector<LoglikItem> out;
  for (std::string line; std::getline(items, line);) {
    const nlohmann::json it = nlohmann::json::parse(line);
    LoglikItem item;
    item.id = it.at("id");
    item.context = it.at("context_ids").get<std::vector<int32_t>>();
    item.choices = it.at("choices").get<std::vector<std::vector<int32_t>>>();
    item.want = expected.at("items").at(out.size());
    FN_REQUIRE(item.want.at("id") == item.id, Format, "loglik_tp4: item {} has expected id {}",
               item.id.dump(), item.want.at("id").dump());
    out.push_back(std::move(item));
  }
  FN_REQUIRE(out.size() == expected.at("items").size(), Format, "loglik_tp4: {} items, {} expected",
             out.size(), expected.at("items").size());
  return out;
}

/// max |a - b| over n values.
inline double max_abs_diff(const float* a, const float* b, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

/// max |a| over n values.
inline double max_abs(const float* a, int64_t n) {
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::abs(static_cast<double>(a[i])));
  return m;
}

/// Index of the largest value, ties to the lowest index.
inline int32_t argmax(const float* a, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (a[i] > a[best]) best = i;
  return static_cast<int32_t>(best);
}

}  // namespace fn::test
