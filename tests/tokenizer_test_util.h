// Helpers shared by the tokenizer tests: gzip'd JSONL fixtures, the Qwen3 tokenizer files
// (FN_TOKENIZER_DIR, fetched by scripts/setup.sh; a missing file fails the test, never skips)
// and the Qwen3.8-style variant built in-process like scripts/tokenizer/make_variant.py.
#pragma once

#include <doctest/doctest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace fn::test {

inline std::vector<std::string> read_gz_lines(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  REQUIRE_MESSAGE(f != nullptr, "cannot open fixture " << path);
  std::string all;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) all.append(buf, static_cast<size_t>(n));
  gzclose(f);
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < all.size()) {
    size_t nl = all.find('\n', start);
    if (nl == std::string::npos) nl = all.size();
    lines.push_back(all.substr(start, nl - start));
    start = nl + 1;
  }
  return lines;
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  REQUIRE_MESSAGE(
      in.good(),
      "cannot open " << p.string()
                     << " (the Qwen3 tokenizer files come from scripts/setup.sh: run it)");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string qwen3_json_path() {
  return std::string(FN_TOKENIZER_DIR) + "/tokenizer.json";
}

/// docs/model.md A.5's pre-tokenizer regex (Qwen3.8 family: \p{M} inside letter runs).
inline const char* kQwen38Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

/// The Qwen3 tokenizer (loaded once per test binary).
inline const Tokenizer& qwen3() {
  static std::unique_ptr<Tokenizer> tok = [] {
    read_file(qwen3_json_path());  // clear failure message when absent
    return load_tokenizer_json(qwen3_json_path());
  }();
  return *tok;
}

/// The Qwen3.8-style variant: Qwen3 vocabulary and merges, docs/model.md A.5 regex.
inline std::string qwen38_json_text() {
  auto j = nlohmann::json::parse(read_file(qwen3_json_path()));
  auto& split = j["pre_tokenizer"]["pretokenizers"][0];
  REQUIRE(split["type"] == "Split");
  split["pattern"]["Regex"] = kQwen38Regex;
  return j.dump();
}

inline const Tokenizer& qwen38() {
  static std::unique_ptr<Tokenizer> tok =
      load_tokenizer_json_text(qwen38_json_text(), "qwen3.8-variant tokenizer.json");
  return *tok;
}

}  // namespace fn::test
