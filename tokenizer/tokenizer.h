// fn::Tokenizer: text <-> token ids for fngen's prompt and output paths (apps/, eval).
// Two implementations behind one interface: tokenizer.json byte-level BPE (identical to HF
// `tokenizers` encode with add_special_tokens=False; docs/model.md A.5) and SentencePiece
// tokenizer.model. Invalid UTF-8 input is rejected (fn::Error Format naming the byte offset);
// decode never fails on valid ids and replaces broken UTF-8 with U+FFFD like HF.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/paths.h"

namespace fn {

/// How encode() treats added-token strings in the text.
enum class EncodeMode {
  Raw,    ///< every added token (special or not) is recognised, as HF `encode` does
  Plain,  ///< special-token strings are ordinary text (HF encode_special_tokens=True); used for
          ///< chat content so user text cannot forge <|im_start|>. Non-special added tokens
          ///< (e.g. Qwen3's <think>) are still recognised, as in HF.
};

/// A loaded tokenizer. Thread-safe for concurrent const calls.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  /// Encodes UTF-8 text to ids (no BOS/EOS added). Throws fn::Error(Format) naming the byte
  /// offset of the first invalid UTF-8 sequence (policy: reject, never guess).
  virtual std::vector<int32_t> encode(std::string_view text,
                                      EncodeMode mode = EncodeMode::Raw) const = 0;

  /// Decodes ids to UTF-8 text, special tokens included; invalid byte sequences become U+FFFD
  /// (HF's from_utf8_lossy). Throws fn::Error(Format) for an id outside [0, vocab_size()).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;

  /// The raw bytes one token contributes to the decoded text (first: it opens the text, which
  /// matters for SentencePiece's dummy prefix). Concatenating token_bytes of a sequence and
  /// replacing broken UTF-8 gives decode(). Throws fn::Error(Format) for an unknown id.
  virtual std::string token_bytes(int32_t id, bool first) const = 0;

  /// Id of a token given in the model's own spelling (byte-level "Ġthe", added-token content,
  /// SentencePiece piece); nullopt when absent.
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;

  /// The model's own spelling of an id. Throws fn::Error(Format) when out of range.
  virtual std::string id_to_token(int32_t id) const = 0;

  /// Number of ids (largest id + 1, added tokens included).
  virtual int32_t vocab_size() const = 0;

  /// True for ids of special added tokens (<|im_end|> ...) and SentencePiece control pieces.
  virtual bool is_special(int32_t id) const = 0;
};

/// The id limit of a token (real vocabularies: under 2^20). The largest tokenizer file read is
/// kMaxTokenizerFileBytes (core/paths.h).
inline constexpr int32_t kMaxTokenId = int32_t{1} << 24;

/// Loads <model_dir>/tokenizer.json (preferred) or <model_dir>/tokenizer.model. Throws
/// fn::Error(Io) when neither exists, fn::Error(Format) for a malformed or unsupported file.
std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& model_dir);

/// Loads a tokenizer.json (byte-level BPE; other components are rejected by name). The file is
/// read by read_regular_file (core/paths.h): fn::Error(Io) "tokenizer file <path>: ..." when it
/// is missing, a directory, a device, a FIFO or a socket, or over kMaxTokenizerFileBytes;
/// fn::Error(Format) for malformed content.
std::unique_ptr<Tokenizer> load_tokenizer_json(const std::filesystem::path& file);

/// Loads a tokenizer.json from memory; `name` is used in error messages.
std::unique_ptr<Tokenizer> load_tokenizer_json_text(std::string_view json, const std::string& name);

/// Checks that every id of `tokenizer` (vocabulary and added tokens: [0, vocab_size())) names a
/// row of the model's embedding and lm_head, which have `vocab_size` rows (config.json; the
/// model's count may be padded past the tokenizer's, never short of it). `name` names the
/// tokenizer in the message. Throws fn::Error(Format) "<name>: the tokenizer has ids up to N,
/// past the model's vocab_size M: tokenizer and model do not belong together".
void require_tokenizer_fits_model(const Tokenizer& tokenizer, int64_t vocab_size,
                                  const std::string& name);

/// The tokenizer of a model directory for a model of `vocab_size` rows: load_tokenizer(model_dir)
/// checked by require_tokenizer_fits_model, so that a tokenizer of another model is a checkpoint
/// error at load (fn::Error(Format), exit 3), not a failure of whichever prompt first encodes to
/// an id past the model. Throws what those two throw.
std::unique_ptr<Tokenizer> load_model_tokenizer(const std::filesystem::path& model_dir,
                                                int64_t vocab_size);

/// Loads a SentencePiece tokenizer.model through libsentencepiece, the bytes read as
/// load_tokenizer_json reads its file (the same fn::Error(Io) cases); fn::Error(Format) when they
/// are not a SentencePiece model.
std::unique_ptr<Tokenizer> load_sentencepiece(const std::filesystem::path& file);

/// Loads a tokenizer file by kind: *.json -> BPE, anything else -> SentencePiece; a directory
/// is read as load_tokenizer does. Throws as those loaders do (fn::Error(Io) for a missing file,
/// fn::Error(Format) for a malformed one).
std::unique_ptr<Tokenizer> load_tokenizer_file(const std::filesystem::path& file);

/// Incremental decode for generation output: feed ids one at a time, get back only complete
/// UTF-8 (an emoji split over three tokens comes out once, never as U+FFFD). The concatenation
/// of all feed() results and finish() equals tokenizer.decode(all ids). An id the tokenizer does
/// not have (a model's vocab_size is padded past the tokenizer: Qwen3 151,936 vs 151,669 entries,
/// and sampling can pick such a row) decodes to empty text, as HF tokenizers' decode() does; the
/// first one of the process is logged as a warning (once, however many streams) and
/// unknown_ids() counts them.
class StreamingDetokenizer {
 public:
  explicit StreamingDetokenizer(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  /// Adds one id; returns the text that became complete (possibly empty).
  std::string feed(int32_t id);
  /// Ends the stream: returns what is held back (an incomplete sequence becomes U+FFFD).
  std::string finish();
  /// Ids fed so far that the tokenizer does not have (they produced no text).
  int64_t unknown_ids() const noexcept { return unknown_ids_; }

 private:
  const Tokenizer& tokenizer_;
  std::string pending_;
  bool first_ = true;
  int64_t unknown_ids_ = 0;
};

}  // namespace fn
