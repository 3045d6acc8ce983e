// Golden ids from HF tokenizers 0.23 (scripts/tokenizer/hf_goldens.py on the GPU machine) for
// the 3,149-string corpus of scripts/tokenizer/make_goldens.py: exact equality, both tokenizers.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "tests/tokenizer_test_util.h"
#include "tokenizer/unicode.h"

namespace {

using fn::test::read_gz_lines;
using nlohmann::json;

struct Corpus {
  std::vector<std::string> text, cat;
};

const Corpus& corpus() {
  static Corpus c = [] {
    Corpus out;
    for (const auto& line :
         read_gz_lines(std::string(FN_TEST_DATA_DIR) + "/tokenizer/corpus.jsonl.gz")) {
      auto j = json::parse(line);
      out.text.push_back(j["text"].get<std::string>());
      out.cat.push_back(j["cat"].get<std::string>());
    }
    return out;
  }();
  return c;
}

std::string show(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < 40; ++i) s += std::to_string(v[i]) + " ";
  return s;
}

void check_goldens(const fn::Tokenizer& tok, const std::string& file) {
  const auto& c = corpus();
  const auto lines = read_gz_lines(std::string(FN_TEST_DATA_DIR) + "/tokenizer/" + file);
  REQUIRE(lines.size() == c.text.size());
  size_t wrong = 0, tokens = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto expect = json::parse(lines[i]).get<std::vector<int32_t>>();
    const auto got = tok.encode(c.text[i], fn::EncodeMode::Raw);
    tokens += expect.size();
    if (got != expect) {
      ++wrong;
      if (wrong <= 10) {
        size_t k = 0;
        while (k < got.size() && k < expect.size() && got[k] == expect[k]) ++k;
        MESSAGE("string "
                << i << " (" << c.cat[i] << ") differs at token " << k << ": got "
                << show(std::vector<int32_t>(got.begin() + static_cast<long>(k), got.end()))
                << " expected "
                << show(std::vector<int32_t>(expect.begin() + static_cast<long>(k), expect.end())));
      }
    }
  }
  MESSAGE(file << ": " << lines.size() << " strings, " << tokens << " tokens, " << wrong
               << " wrong");
  CHECK(wrong == 0);
  CHECK(lines.size() >= 3000);
}

}  // namespace

TEST_CASE("tokenizer golden: Qwen3 tokenizer.json ids equal HF tokenizers on every corpus string") {
  check_goldens(fn::test::qwen3(), "goldens_qwen3.jsonl.gz");
}

TEST_CASE(
    "tokenizer golden: the Qwen3.8-style regex variant ids equal HF tokenizers on every corpus "
    "string") {
  check_goldens(fn::test::qwen38(), "goldens_qwen38.jsonl.gz");
}

TEST_CASE(
    "tokenizer golden: plain mode equals HF encode_special_tokens=True on the special-token "
    "strings") {
  const auto& c = corpus();
  const auto lines =
      read_gz_lines(std::string(FN_TEST_DATA_DIR) + "/tokenizer/goldens_qwen3_plain.jsonl.gz");
  REQUIRE(lines.size() >= 150);
  size_t wrong = 0, differs_from_raw = 0;
  for (const auto& line : lines) {
    const auto j = json::parse(line);
    const auto i = j["i"].get<size_t>();
    const auto expect = j["ids"].get<std::vector<int32_t>>();
    const auto got = fn::test::qwen3().encode(c.text[i], fn::EncodeMode::Plain);
    if (got != expect) {
      ++wrong;
      MESSAGE("string " << i << " got " << show(got) << " expected " << show(expect));
    }
    differs_from_raw += got != fn::test::qwen3().encode(c.text[i], fn::EncodeMode::Raw);
  }
  CHECK(wrong == 0);
  CHECK(differs_from_raw > 50);  // 73: the rest hold only non-special tokens (<think>, <tool_call>)
}

TEST_CASE(
    "tokenizer golden: decode(encode(s)) is NFC(s) for strings without added-token text, HF's "
    "decode otherwise") {
  const auto& c = corpus();
  // HF's decode where it differs from Python's NFC (only strings with marks newer than Unicode 11).
  std::map<std::pair<std::string, size_t>, std::string> hf_dec;
  for (const auto& line :
       read_gz_lines(std::string(FN_TEST_DATA_DIR) + "/tokenizer/goldens_decode.jsonl.gz")) {
    if (line.empty()) continue;
    const auto j = json::parse(line);
    hf_dec[{j["tok"].get<std::string>(), j["i"].get<size_t>()}] = j["dec"].get<std::string>();
  }
  for (const auto& [name, tok] :
       {std::pair<std::string, const fn::Tokenizer*>{"qwen3", &fn::test::qwen3()},
        {"qwen38", &fn::test::qwen38()}}) {
    size_t nfc_equal = 0, hf_equal = 0, wrong = 0;
    for (size_t i = 0; i < c.text.size(); ++i) {
      const std::string dec = tok->decode(tok->encode(c.text[i]));
      if (auto it = hf_dec.find({name, i}); it != hf_dec.end()) {
        hf_equal += dec == it->second;
        wrong += dec != it->second;
      } else {
        // No added-token text has to be normalised here: Qwen's added tokens are ASCII.
        nfc_equal += dec == fn::unicode::nfc_utf8proc(c.text[i]);
        wrong += dec != fn::unicode::nfc_utf8proc(c.text[i]);
      }
    }
    MESSAGE(name << ": " << nfc_equal << " decode to NFC(s), " << hf_equal
                 << " to HF's older-Unicode NFC");
    CHECK(wrong == 0);
    CHECK(hf_equal == 33);
  }
}
