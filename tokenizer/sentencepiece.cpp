// SentencePiece tokenizer.model behind fn::Tokenizer (libsentencepiece 0.1.97). SentencePiece
// has no added-token matching of its own beyond user-defined pieces, so Raw and Plain encode
// alike; control pieces (<s>, </s>) never come out of encode.
#include <sentencepiece_processor.h>
#include <atomic>

#include "core/error.h"
#include "core/log.h"
#include "core/paths.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace fn {
namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::filesystem::path& file) : name_(file.string()) {
    // One guarded read (a directory, device, FIFO or socket refused by name, the size bounded),
    // then SentencePiece parses the bytes.
    const std::string bytes = read_regular_file(file, kMaxTokenizerFileBytes, "tokenizer file");
    const auto status = sp_.LoadFromSerializedProto(bytes);
    // A file that is no ModelProto at all fails in protobuf's parser, which SentencePiece reports
    // as an internal error with its own source line: say what the file is not, instead.
    // An empty file parses as an empty ModelProto, which then lacks its unk piece.
    const bool unparsed =
        (status.code() == sentencepiece::util::StatusCode::kInternal &&
         std::string(status.message()).find("ParseFromArray") != std::string::npos) ||
        bytes.empty();
    FN_REQUIRE(
        status.ok(), Format,
        "{}: not a SentencePiece model{} (a tokenizer file is a Hugging Face tokenizer.json, "
        "named *.json, or a SentencePiece tokenizer.model)",
        name_, unparsed ? "" : ": " + status.ToString());
  }

  std::vector<int32_t> encode(std::string_view text, EncodeMode) const override {
    unicode::require_valid_utf8(text, "text to encode");
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    FN_REQUIRE(status.ok(), Format, "{}: encode failed: {}", name_, status.ToString());
    return {ids.begin(), ids.end()};
  }

  std::string decode(std::span<const int32_t> ids) const override {
    for (int32_t id : ids) check_id(id);
    std::string out;
    const auto status = sp_.Decode(std::vector<int>(ids.begin(), ids.end()), &out);
    FN_REQUIRE(status.ok(), Format, "{}: decode failed: {}", name_, status.ToString());
    return out;
  }

  // SentencePiece's decoder per piece: control pieces vanish, byte pieces <0xNN> are one byte,
  // U+2581 is a space, unknown pieces print " \u2047 ", and the first piece loses the dummy
  // prefix space.
  std::string token_bytes(int32_t id, bool first) const override {
    check_id(id);
    if (sp_.IsControl(id)) return {};
    if (sp_.IsUnknown(id)) return first ? "\xE2\x81\x87 " : " \xE2\x81\x87 ";
    std::string piece = sp_.IdToPiece(id);
    if (sp_.IsByte(id))
      return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
    std::string out;
    for (size_t i = 0; i < piece.size();) {
      if (piece.compare(i, 3, "\xE2\x96\x81") == 0) {
        out += ' ';
        i += 3;
      } else {
        out += piece[i++];
      }
    }
    if (first && !out.empty() && out[0] == ' ') out.erase(0, 1);
    return out;
  }

  std::optional<int32_t> token_to_id(std::string_view token) const override {
    const int id = sp_.PieceToId(token);
    if (id == sp_.unk_id() && sp_.IdToPiece(id) != token) return std::nullopt;
    return id;
  }

  std::string id_to_token(int32_t id) const override {
    check_id(id);
    return sp_.IdToPiece(id);
  }

  int32_t vocab_size() const override { return sp_.GetPieceSize(); }

  bool is_special(int32_t id) const override {
    return id >= 0 && id < vocab_size() && sp_.IsControl(id);
  }

 private:
  void check_id(int32_t id) const {
    FN_REQUIRE(id >= 0 && id < vocab_size(), Format,
               "token id {} is not in the vocabulary of {} (size {})", id, name_, vocab_size());
  }

  std::string name_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::filesystem::path& file) {
  return std::make_unique<SentencePieceTokenizer>(file);
}

std::unique_ptr<Tokenizer> load_tokenizer_file(const std::filesystem::path& file) {
  if (std::filesystem::is_directory(file)) return load_tokenizer(file);  // as synth --tokenizer
  if (file.extension() == ".json") return load_tokenizer_json(file);
  return load_sentencepiece(file);
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& model_dir) {
  FN_REQUIRE(std::filesystem::is_directory(model_dir), Io, "model directory {} does not exist",
             model_dir.string());
  const auto json_file = model_dir / "tokenizer.json";
  if (std::filesystem::exists(json_file)) return load_tokenizer_json(json_file);
  const auto spm_file = model_dir / "tokenizer.model";
  if (std::filesystem::exists(spm_file)) return load_sentencepiece(spm_file);
  FN_THROW(Io, "{} has neither tokenizer.json nor tokenizer.model", model_dir.string());
}

void require_tokenizer_fits_model(const Tokenizer& tokenizer, int64_t vocab_size,
                                  const std::string& name) {
  FN_REQUIRE(tokenizer.vocab_size() <= vocab_size, Format,
             "{}: the tokenizer has ids up to {}, past the model's vocab_size {}: tokenizer and "
             "model do not belong together",
             name, tokenizer.vocab_size() - 1, vocab_size);
}

std::unique_ptr<Tokenizer> load_model_tokenizer(const std::filesystem::path& model_dir,
                                                int64_t vocab_size) {
  auto tok = load_tokenizer(model_dir);
  const auto json_file = model_dir / "tokenizer.json";
  require_tokenizer_fits_model(
      *tok, vocab_size,
      (std::filesystem::exists(json_file) ? json_file : model_dir / "tokenizer.model").string());
  return tok;
}

std::string StreamingDetokenizer::feed(int32_t id) {
  std::string bytes;
  try {
    bytes = tokenizer_.token_bytes(id, first_);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Format) throw;
    // Said once per process: a batch streams each record through its own detokenizer.
    static std::atomic<bool> warned{false};
    ++unknown_ids_;
    if (!warned.exchange(true))
      FN_LOG_WARN(
          "token id {} is not in the tokenizer's vocabulary (size {}): it decodes to no "
          "text (a padded row of the model's vocabulary)",
          id, tokenizer_.vocab_size());
    return {};
  }
  pending_ += bytes;
  first_ = false;
  const size_t hold = unicode::incomplete_utf8_tail(pending_);
  std::string out =
      unicode::utf8_lossy(std::string_view(pending_).substr(0, pending_.size() - hold));
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StreamingDetokenizer::finish() {
  std::string out = unicode::utf8_lossy(pending_);
  pending_.clear();
  first_ = true;
  return out;
}

}  // namespace fn
