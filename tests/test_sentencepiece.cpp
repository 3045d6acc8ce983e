// SentencePiece behind fn::Tokenizer: a tiny BPE model (byte fallback) is trained in the test
// setup with libsentencepiece's trainer (what spm_train runs), then our encode/decode are compared
// with the spm_encode / spm_decode command-line tools on the same model.
#include <doctest/doctest.h>
#include <sentencepiece_trainer.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "core/error.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int32_t>;

const char* kWords[] = {"the",          "model",
                        "token",        "piece",
                        "sentence",     "generator",
                        "tensor",       "parallel",
                        "rank",         "decode",
                        "prompt",       "caf\xC3\xA9",
                        "na\xC3\xAFve", "\xE4\xB8\xAD\xE6\x96\x87",
                        "42",           "3.14"};

fs::path model_dir() {
  static fs::path dir = [] {
    fs::path d = fs::path(FN_BINARY_DIR) / "test_sentencepiece";
    fs::create_directories(d);
    std::ofstream corpus(d / "train.txt");
    std::mt19937 rng(7);
    for (int line = 0; line < 3000; ++line) {
      const int n = 3 + static_cast<int>(rng() % 10);
      for (int w = 0; w < n; ++w) corpus << (w ? " " : "") << kWords[rng() % std::size(kWords)];
      corpus << ".\n";
    }
    corpus.close();
    const auto status = sentencepiece::SentencePieceTrainer::Train(
        "--input=" + (d / "train.txt").string() + " --model_prefix=" + (d / "tokenizer").string() +
        " --vocab_size=400 --model_type=bpe --byte_fallback=true --character_coverage=1.0"
        " --normalization_rule_name=identity --remove_extra_whitespaces=false --num_threads=1 "
        "--minloglevel=2");
    REQUIRE_MESSAGE(status.ok(), status.ToString());
    return d;
  }();
  return dir;
}

const std::vector<std::string>& samples() {
  static const std::vector<std::string> s = {
      "the model decodes the prompt.",
      "tensor parallel rank 42",
      "caf\xC3\xA9 na\xC3\xAFve \xE4\xB8\xAD\xE6\x96\x87",
      "unseen words like zebra and quokka",
      "emoji \xF0\x9F\xA6\x80 and \xF0\x9F\x87\xAF\xF0\x9F\x87\xB5 fall back to bytes",
      "  two leading spaces and   inner runs",
      "x",
  };
  return s;
}

std::vector<std::string> run_lines(const std::string& cmd, const std::vector<std::string>& input) {
  const fs::path in = model_dir() / "in.txt", out = model_dir() / "out.txt";
  {
    std::ofstream f(in);
    for (const auto& l : input) f << l << "\n";
  }
  const std::string full = cmd + " < " + in.string() + " > " + out.string();
  REQUIRE_MESSAGE(std::system(full.c_str()) == 0, "failed: " << full);
  std::ifstream f(out);
  std::vector<std::string> lines;
  for (std::string l; std::getline(f, l);) lines.push_back(l);
  return lines;
}

std::string join(const Ids& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) s += ' ';
    s += std::to_string(ids[i]);
  }
  return s;
}

}  // namespace

TEST_CASE(
    "sentencepiece: a model directory with only tokenizer.model loads through libsentencepiece") {
  const auto tok = fn::load_tokenizer(model_dir());  // tokenizer.model, no tokenizer.json
  CHECK(tok->vocab_size() == 400);
  CHECK(tok->id_to_token(0) == "<unk>");
  CHECK(tok->is_special(1));  // <s>
  CHECK(tok->token_to_id("<0x41>").has_value());
  CHECK(tok->token_to_id("no-such-piece") == std::nullopt);
}

TEST_CASE("sentencepiece: encode matches spm_encode and decode matches spm_decode") {
  const auto tok = fn::load_tokenizer(model_dir());
  const std::string model = (model_dir() / "tokenizer.model").string();
  const auto ref = run_lines("spm_encode --model=" + model + " --output_format=id", samples());
  REQUIRE(ref.size() == samples().size());
  std::vector<std::string> ours;
  for (size_t i = 0; i < samples().size(); ++i) {
    const Ids ids = tok->encode(samples()[i], fn::EncodeMode::Raw);
    CHECK(join(ids) == ref[i]);
    CHECK(tok->encode(samples()[i], fn::EncodeMode::Plain) == ids);
    ours.push_back(join(ids));
  }
  const auto dec = run_lines("spm_decode --model=" + model + " --input_format=id", ours);
  REQUIRE(dec.size() == samples().size());
  for (size_t i = 0; i < samples().size(); ++i) {
    const Ids ids = tok->encode(samples()[i]);
    CHECK(tok->decode(ids) == dec[i]);
    CHECK(tok->decode(ids) == samples()[i]);  // identity normalisation + byte fallback: lossless
  }
}

TEST_CASE("sentencepiece: the streaming detokenizer emits byte-fallback emoji whole") {
  const auto tok = fn::load_tokenizer(model_dir());
  for (const auto& s : samples()) {
    const Ids ids = tok->encode(s);
    fn::StreamingDetokenizer stream(*tok);
    std::string all;
    for (int32_t id : ids) {
      const std::string piece = stream.feed(id);
      CHECK(fn::unicode::find_invalid_utf8(piece) == std::string_view::npos);
      all += piece;
    }
    all += stream.finish();
    CHECK(all == tok->decode(ids));
  }
  const Ids crab = tok->encode("\xF0\x9F\xA6\x80");
  REQUIRE(crab.size() >= 4);  // the dummy-prefix piece and four byte pieces
  CHECK(tok->id_to_token(crab.back()) == "<0x80>");
}

TEST_CASE("sentencepiece: invalid UTF-8, unknown ids and a corrupt model file are errors") {
  const auto tok = fn::load_tokenizer(model_dir());
  CHECK_THROWS_WITH_AS(tok->encode("ab\xFE"), doctest::Contains("byte offset 2"), fn::Error);
  CHECK_THROWS_WITH_AS(tok->decode(Ids{400}),
                       doctest::Contains("token id 400 is not in the vocabulary"), fn::Error);
  const fs::path bad = model_dir() / "corrupt.model";
  std::ofstream(bad) << "this is not a protobuf";
  // Said plainly, without SentencePiece's internal "ParseFromArray" source-line message.
  const std::string plain = bad.string() +
                            ": not a SentencePiece model (a tokenizer file is a Hugging Face "
                            "tokenizer.json, named *.json, or a SentencePiece tokenizer.model)";
  CHECK_THROWS_WITH_AS(fn::load_sentencepiece(bad), plain.c_str(), fn::Error);
  CHECK_THROWS_WITH_AS(fn::load_sentencepiece(model_dir() / "missing.model"),
                       doctest::Contains("cannot open"), fn::Error);
}
