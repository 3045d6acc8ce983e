// tokenizer.json byte-level BPE, matching HF `tokenizers` (encode with add_special_tokens=False):
// added tokens -> NFC -> Split(regex, Isolated) / ByteLevel pre-tokenizer -> BPE merges with a
// rank-ordered heap (HF's merge_all) -> ids. Unsupported components are rejected by name.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace fn {
namespace {

using nlohmann::json;

// GPT-2's split regex, used by ByteLevel when use_regex is true.
constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Transparent (lookups by string_view). Deliberately not noexcept: libstdc++ then stores each
// node's hash code, and a lookup no longer rehashes the strings of its bucket's chain (which
// was a quarter of a tokenizer.json load).
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// A compiled PCRE2 pattern (UTF + UCP, JIT when available).
class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& where) {
    int err = 0;
    PCRE2_SIZE off = 0;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0u);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts, &err,
                          &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      FN_THROW(Format, "{}: regex does not compile at offset {}: {}", where, off,
               reinterpret_cast<char*>(msg));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// Calls on_match(begin, end) for every non-overlapping non-empty match in s (valid UTF-8), in
  /// order.
  template <class F>
  void for_each_match(std::string_view s, F&& on_match) const {
    struct Scratch {
      pcre2_match_data* md = nullptr;
      pcre2_match_context* mc = nullptr;
      pcre2_jit_stack* js = nullptr;
      ~Scratch() {
        pcre2_match_data_free(md);
        pcre2_match_context_free(mc);
        pcre2_jit_stack_free(js);
      }
    };
    thread_local Scratch scratch;
    if (!scratch.md) {
      scratch.md = pcre2_match_data_create(8, nullptr);
      scratch.mc = pcre2_match_context_create(nullptr);
      scratch.js = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
      pcre2_jit_stack_assign(scratch.mc, nullptr, scratch.js);
    }
    size_t pos = 0;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    while (pos <= s.size()) {
      const int rc = jit_ ? pcre2_jit_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK,
                                            scratch.md, scratch.mc)
                          : pcre2_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK,
                                        scratch.md, scratch.mc);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      FN_CHECK(rc > 0, "PCRE2 match failed with code {}", rc);
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(scratch.md);
      const size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: no piece; step over one code point
        if (b >= s.size()) break;
        pos = b + 1;
        while (pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80) ++pos;
        continue;
      }
      on_match(b, e);
      pos = e;
    }
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// (left id, right id) -> (rank, merged id): open addressing, linear probing, load <= 1/2.
class MergeTable {
 public:
  struct Value {
    int32_t rank, new_id;
  };
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    slots_.assign(cap, Slot{kEmpty, {0, 0}});
    shift_ = 64 - static_cast<int>(std::countr_zero(cap));
  }
  void insert_or_assign(uint64_t key, Value v) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    Slot& s = probe(key);
    if (s.key == kEmpty) ++size_;
    s = Slot{key, v};
  }
  const Value* find(uint64_t key) const {
    if (slots_.empty()) return nullptr;
    size_t i = index(key);
    const size_t mask = slots_.size() - 1;
    while (true) {
      const Slot& s = slots_[i];
      if (s.key == key) return &s.value;
      if (s.key == kEmpty) return nullptr;
      i = (i + 1) & mask;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  struct Slot {
    uint64_t key;
    Value value;
  };
  size_t index(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  Slot& probe(uint64_t key) {
    size_t i = index(key);
    const size_t mask = slots_.size() - 1;
    while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & mask;
    return slots_[i];
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    reserve(std::max<size_t>(16, old.size()));
    size_ = 0;
    for (const Slot& s : old)
      if (s.key != kEmpty) insert_or_assign(s.key, s.value);
  }
  std::vector<Slot> slots_;
  int shift_ = 60;
  size_t size_ = 0;
};

struct AddedToken {
  std::string content;  // as matched (NFC-normalised when normalized is true)
  int32_t id = 0;
  bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = false;
};

// One pre-tokenizer step; all steps are Isolated splits (ByteLevel's own regex included).
struct SplitStep {
  std::unique_ptr<Regex> regex;  // null: no split (ByteLevel with use_regex false)
  bool add_prefix_space = false;
};

// Rust char::is_whitespace (Unicode White_Space).
bool is_white_space(char32_t c) {
  return (c >= 9 && c <= 13) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

char32_t decode_at(std::string_view s, size_t i, size_t* len) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  int n = b0 < 0x80 ? 1 : b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  char32_t cp = n == 1 ? b0 : (b0 & (0x7F >> n));
  for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  *len = static_cast<size_t>(n);
  return cp;
}

// Last code point of a non-empty valid UTF-8 string.
char32_t last_cp(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  size_t len = 0;
  return decode_at(s, i, &len);
}

bool is_word_char(char32_t c) {
  if (c == '_') return true;
  if (c < 0x80) return std::isalnum(static_cast<int>(c)) != 0;
  return !is_white_space(c) && c != 0xFFFD &&
         (c >= 0xC0);  // approximation: non-ASCII letters/digits
}

class BpeTokenizer final : public Tokenizer {
 public:
  BpeTokenizer(const json& j, const std::string& name) : name_(name) {
    load_model(j);
    load_added_tokens(j);
    load_normalizer(j);
    for (const auto& a : added_)
      first_byte_[a.normalized ? 1 : 0][static_cast<unsigned char>(a.content[0])] = true;
    load_pre_tokenizer(j);
    load_decoder(j);
  }

  std::vector<int32_t> encode(std::string_view text, EncodeMode mode) const override {
    unicode::require_valid_utf8(text, "text to encode");
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 4);
    // 1. Added tokens matched on the raw text (normalized == false).
    split_added(text, /*normalized=*/false, mode, [&](std::string_view piece, int32_t id) {
      if (id >= 0) {
        ids.push_back(id);
        return;
      }
      // 2. Normalise, then added tokens matched on the normalised text.
      const std::string norm = nfc_ ? unicode::nfc(piece) : std::string(piece);
      split_added(norm, /*normalized=*/true, mode, [&](std::string_view p2, int32_t id2) {
        if (id2 >= 0) {
          ids.push_back(id2);
        } else {
          pre_tokenize_and_encode(p2, ids);
        }
      });
    });
    return ids;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string bytes;
    for (int32_t id : ids) bytes += id_bytes(id);
    return unicode::utf8_lossy(bytes);
  }

  std::string token_bytes(int32_t id, bool) const override { return id_bytes(id); }

  std::optional<int32_t> token_to_id(std::string_view token) const override {
    if (auto it = added_by_content_.find(token); it != added_by_content_.end()) return it->second;
    if (auto it = vocab_.find(token); it != vocab_.end()) return it->second;
    return std::nullopt;
  }

  std::string id_to_token(int32_t id) const override {
    check_id(id);
    return id_to_token_[static_cast<size_t>(id)];
  }

  int32_t vocab_size() const override { return static_cast<int32_t>(id_to_token_.size()); }

  bool is_special(int32_t id) const override {
    return id >= 0 && id < vocab_size() && special_[static_cast<size_t>(id)] != 0;
  }

 private:
  void check_id(int32_t id) const {
    FN_REQUIRE(id >= 0 && id < vocab_size() && present_[static_cast<size_t>(id)], Format,
               "token id {} is not in the vocabulary of {} (size {})", id, name_, vocab_size());
  }
  const std::string& id_bytes(int32_t id) const {
    check_id(id);
    return id_bytes_[static_cast<size_t>(id)];
  }

  void set_id(int32_t id, const std::string& spelling) {
    FN_REQUIRE(id >= 0 && id < kMaxTokenId, Format, "{}: token '{}' has invalid id {}", name_,
               spelling, id);
    const auto n = static_cast<size_t>(id) + 1;
    if (id_to_token_.size() < n) {
      id_to_token_.resize(n);
      id_bytes_.resize(n);
      special_.resize(n, 0);
      present_.resize(n, 0);
    }
    id_to_token_[static_cast<size_t>(id)] = spelling;
    id_bytes_[static_cast<size_t>(id)] = byte_level_bytes(spelling);
    present_[static_cast<size_t>(id)] = 1;
  }

  // HF ByteLevel decoder: every char through the inverse GPT-2 table, or the token's own UTF-8
  // bytes when some char is not in the table.
  static std::string byte_level_bytes(std::string_view spelling) {
    static const std::vector<int> inverse = [] {
      std::vector<int> inv(512, -1);
      const auto& t = unicode::byte_to_unicode();
      for (int b = 0; b < 256; ++b) inv[t[b]] = b;
      return inv;
    }();
    std::string out;
    for (size_t i = 0; i < spelling.size();) {
      size_t len = 0;
      const char32_t cp = decode_at(spelling, i, &len);
      if (cp >= inverse.size() || inverse[cp] < 0) return std::string(spelling);
      out += static_cast<char>(inverse[cp]);
      i += len;
    }
    return out;
  }

  void load_model(const json& j) {
    FN_REQUIRE(j.contains("model") && j["model"].is_object(), Format,
               "{}: not a Hugging Face tokenizer.json (no \"model\" object)", name_);
    const json& m = j["model"];
    const std::string type = m.value("type", std::string("BPE"));
    FN_REQUIRE(type == "BPE", Format, "{}: model type '{}' is not supported (only BPE)", name_,
               type);
    FN_REQUIRE(m.contains("vocab") && m["vocab"].is_object(), Format,
               "{}: model.vocab is not an object", name_);
    FN_REQUIRE(m.contains("merges") && m["merges"].is_array(), Format,
               "{}: model.merges is not an array", name_);
    if (m.contains("dropout") && !m["dropout"].is_null()) {
      FN_REQUIRE(m["dropout"].is_number() && m["dropout"].get<double>() == 0.0, Format,
                 "{}: model.dropout is not supported", name_);
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      FN_REQUIRE(!m.contains(key) || m[key].is_null() || m[key].get<std::string>().empty(), Format,
                 "{}: model.{} is not supported", name_, key);
    }
    ignore_merges_ = m.value("ignore_merges", false);
    byte_fallback_ = m.value("byte_fallback", false);
    vocab_.reserve(m["vocab"].size());
    bytes_to_id_.reserve(m["vocab"].size());
    for (const auto& [tok, idj] : m["vocab"].items()) {
      FN_REQUIRE(idj.is_number_integer(), Format, "{}: model.vocab['{}'] is not an integer", name_,
                 tok);
      const auto id = idj.get<int32_t>();
      // Two spellings of one id: decode would give one of them for both (added_tokens may reuse
      // a vocabulary id for the same token; model.vocab itself may not).
      FN_REQUIRE(id < 0 || static_cast<size_t>(id) >= present_.size() ||
                     present_[static_cast<size_t>(id)] == 0,
                 Format, "{}: model.vocab gives id {} to both '{}' and '{}'", name_, id,
                 id_to_token_[static_cast<size_t>(id)], tok);
      vocab_[tok] = id;
      set_id(id, tok);
    }
    for (const auto& [tok, id] : vocab_) {
      const std::string& b = id_bytes_[static_cast<size_t>(id)];
      bytes_to_id_[b] = id;
    }
    byte_id_.fill(-1);
    const auto& table = unicode::byte_to_unicode();
    for (int b = 0; b < 256; ++b) {
      std::string s;
      unicode::append_utf8(s, table[b]);
      if (auto it = vocab_.find(s); it != vocab_.end()) byte_id_[b] = it->second;
      if (byte_fallback_) {
        if (auto it = vocab_.find(fmt::format("<0x{:02X}>", b)); it != vocab_.end())
          fallback_id_[b] = it->second;
      }
    }
    const json& merges = m["merges"];
    merges_.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const json& e = merges[rank];
      std::string a, b;
      if (e.is_string()) {
        const auto& s = e.get_ref<const std::string&>();
        const size_t sp = s.find(' ');
        FN_REQUIRE(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos, Format,
                   "{}: merge {} '{}' is not two tokens separated by one space", name_, rank, s);
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        FN_REQUIRE(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(), Format,
                   "{}: merge {} is neither \"a b\" nor [a, b]", name_, rank);
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      }
      const auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
      FN_REQUIRE(ia != vocab_.end(), Format, "{}: merge {} ('{}', '{}') names unknown token '{}'",
                 name_, rank, a, b, a);
      FN_REQUIRE(ib != vocab_.end(), Format, "{}: merge {} ('{}', '{}') names unknown token '{}'",
                 name_, rank, a, b, b);
      FN_REQUIRE(iab != vocab_.end(), Format,
                 "{}: merge {} ('{}', '{}') makes '{}', which is not in the vocabulary", name_,
                 rank, a, b, a + b);
      merges_.insert_or_assign(pair_key(ia->second, ib->second),
                               {static_cast<int32_t>(rank), iab->second});
    }
  }

  void load_added_tokens(const json& j) {
    if (!j.contains("added_tokens") || j["added_tokens"].is_null()) return;
    FN_REQUIRE(j["added_tokens"].is_array(), Format, "{}: added_tokens is not an array", name_);
    for (const json& t : j["added_tokens"]) {
      FN_REQUIRE(t.contains("id") && t.contains("content") && t["content"].is_string(), Format,
                 "{}: an added token lacks id or content", name_);
      AddedToken a;
      a.content = t["content"].get<std::string>();
      a.id = t["id"].get<int32_t>();
      a.special = t.value("special", false);
      a.lstrip = t.value("lstrip", false);
      a.rstrip = t.value("rstrip", false);
      a.single_word = t.value("single_word", false);
      a.normalized = t.value("normalized", !a.special);
      unicode::require_valid_utf8(a.content, fmt::format("{} added token {}", name_, a.id));
      FN_REQUIRE(!a.content.empty(), Format, "{}: added token {} is empty", name_, a.id);
      // Added tokens keep their model-vocab id when present; their spelling is the content.
      set_id(a.id, a.content);
      special_[static_cast<size_t>(a.id)] = a.special ? 1 : 0;
      added_by_content_[a.content] = a.id;
      added_.push_back(a);
    }
  }

  void load_normalizer(const json& j) {
    if (!j.contains("normalizer") || j["normalizer"].is_null()) return;
    std::vector<const json*> steps;
    const json& n = j["normalizer"];
    if (n.value("type", "") == "Sequence") {
      for (const json& s : n["normalizers"]) steps.push_back(&s);
    } else {
      steps.push_back(&n);
    }
    for (const json* s : steps) {
      const std::string type = s->value("type", "");
      FN_REQUIRE(type == "NFC", Format,
                 "{}: normalizer '{}' is not supported (only NFC and Sequence)", name_, type);
      nfc_ = true;
    }
    // Added tokens with normalized == true are matched on normalised text: normalise them too.
    for (auto& a : added_)
      if (a.normalized && nfc_) a.content = unicode::nfc(a.content);
  }

  void load_pre_tokenizer(const json& j) {
    FN_REQUIRE(j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null(), Format,
               "{}: no pre_tokenizer (byte-level BPE needs a ByteLevel step)", name_);
    std::vector<const json*> steps;
    const json& p = j["pre_tokenizer"];
    if (p.value("type", "") == "Sequence") {
      for (const json& s : p["pretokenizers"]) steps.push_back(&s);
    } else {
      steps.push_back(&p);
    }
    bool byte_level = false;
    for (const json* s : steps) {
      const std::string type = s->value("type", "");
      if (type == "Split") {
        const std::string behavior = s->value("behavior", "");
        FN_REQUIRE(behavior == "Isolated", Format,
                   "{}: Split behavior '{}' is not supported (only Isolated)", name_, behavior);
        FN_REQUIRE(!s->value("invert", false), Format,
                   "{}: Split with invert true is not supported", name_);
        const json& pat = (*s)["pattern"];
        SplitStep step;
        if (pat.contains("Regex")) {
          step.regex = std::make_unique<Regex>(pat["Regex"].get<std::string>(), false,
                                               name_ + " pre_tokenizer Split");
        } else if (pat.contains("String")) {
          step.regex = std::make_unique<Regex>(pat["String"].get<std::string>(), true,
                                               name_ + " pre_tokenizer Split");
        } else {
          FN_THROW(Format, "{}: Split pattern is neither Regex nor String", name_);
        }
        steps_.push_back(std::move(step));
      } else if (type == "ByteLevel") {
        FN_REQUIRE(!byte_level, Format, "{}: two ByteLevel pre-tokenizers", name_);
        byte_level = true;
        SplitStep step;
        step.add_prefix_space = s->value("add_prefix_space", true);
        if (s->value("use_regex", true))
          step.regex = std::make_unique<Regex>(kGpt2Regex, false, "GPT-2 regex");
        steps_.push_back(std::move(step));
      } else {
        FN_THROW(Format,
                 "{}: pre_tokenizer '{}' is not supported (only Sequence, Split, ByteLevel)", name_,
                 type);
      }
    }
    FN_REQUIRE(byte_level, Format,
               "{}: pre_tokenizer has no ByteLevel step (only byte-level BPE is supported)", name_);
  }

  void load_decoder(const json& j) {
    FN_REQUIRE(j.contains("decoder") && !j["decoder"].is_null(), Format,
               "{}: no decoder (expected ByteLevel)", name_);
    const std::string type = j["decoder"].value("type", "");
    FN_REQUIRE(type == "ByteLevel", Format, "{}: decoder '{}' is not supported (only ByteLevel)",
               name_, type);
    if (j.contains("post_processor") && !j["post_processor"].is_null()) {
      const std::string pp = j["post_processor"].value("type", "");
      FN_REQUIRE(pp == "ByteLevel", Format,
                 "{}: post_processor '{}' is not supported (only ByteLevel)", name_, pp);
    }
  }

  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  // HF AddedVocabulary::find_matches: leftmost-longest, non-overlapping matches over all added
  // tokens of this normalisation class; special ones are skipped (left as text) in Plain mode.
  template <class Emit>
  void split_added(std::string_view s, bool normalized, EncodeMode mode, Emit&& emit) const {
    size_t text_start = 0;  // start of the pending text piece
    size_t pos = 0;
    size_t start_offset = 0;
    bool any = false;
    for (const auto& a : added_) any |= a.normalized == normalized;
    if (!any) {
      if (!s.empty()) emit(s, -1);
      return;
    }
    const auto& first = first_byte_[normalized ? 1 : 0];
    while (pos < s.size()) {
      if (!first[static_cast<unsigned char>(s[pos])]) {
        ++pos;
        continue;
      }
      const AddedToken* best = nullptr;
      for (const auto& a : added_) {
        if (a.normalized != normalized || a.content.size() > s.size() - pos) continue;
        if (s.compare(pos, a.content.size(), a.content) != 0) continue;
        if (!best || a.content.size() > best->content.size()) best = &a;
      }
      if (!best) {
        ++pos;
        continue;
      }
      size_t start = pos, stop = pos + best->content.size();
      pos = stop;
      if (mode == EncodeMode::Plain && best->special) continue;
      if (best->single_word) {
        const bool start_space = start == 0 || !is_word_char(last_cp(s.substr(0, start)));
        size_t len = 0;
        const bool stop_space = stop == s.size() || !is_word_char(decode_at(s, stop, &len));
        if (!start_space || !stop_space) continue;
      }
      if (best->lstrip) {
        size_t ns = start;
        while (ns > 0) {
          size_t i = ns - 1;
          while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
          size_t len = 0;
          if (!is_white_space(decode_at(s, i, &len))) break;
          ns = i;
        }
        start = std::max(ns, start_offset);
      }
      if (best->rstrip) {
        while (stop < s.size()) {
          size_t len = 0;
          if (!is_white_space(decode_at(s, stop, &len))) break;
          stop += len;
        }
        pos = stop;
      }
      if (start > text_start) emit(s.substr(text_start, start - text_start), -1);
      emit(s.substr(start, stop - start), best->id);
      text_start = stop;
      start_offset = stop;
    }
    if (text_start < s.size()) emit(s.substr(text_start), -1);
  }

  void pre_tokenize_and_encode(std::string_view text, std::vector<int32_t>& ids) const {
    if (!text.empty()) pre_tokenize(text, 0, ids);
  }

  // Applies pre-tokenizer steps [step, end) to one piece (Isolated: matches and the gaps between
  // them become pieces), then BPE-encodes the final pieces; no piece is copied unless a
  // ByteLevel step has to prepend its prefix space.
  void pre_tokenize(std::string_view piece, size_t step, std::vector<int32_t>& ids) const {
    if (step == steps_.size()) {
      encode_word(piece, ids);
      return;
    }
    const SplitStep& st = steps_[step];
    std::string with_space;
    if (st.add_prefix_space && (piece.empty() || piece[0] != ' ')) {
      with_space.reserve(piece.size() + 1);  // (not " " + string: GCC 12 -Wrestrict noise)
      with_space.push_back(' ');
      with_space.append(piece);
      piece = with_space;
    }
    if (!st.regex) {
      pre_tokenize(piece, step + 1, ids);
      return;
    }
    size_t last = 0;
    st.regex->for_each_match(piece, [&](size_t b, size_t e) {
      if (b > last) pre_tokenize(piece.substr(last, b - last), step + 1, ids);
      pre_tokenize(piece.substr(b, e - b), step + 1, ids);
      last = e;
    });
    if (last < piece.size()) pre_tokenize(piece.substr(last), step + 1, ids);
  }

  void encode_word(std::string_view w, std::vector<int32_t>& ids) const {
    if (w.empty()) return;
    if (ignore_merges_) {
      if (auto it = bytes_to_id_.find(w); it != bytes_to_id_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    constexpr size_t kCacheMaxLen = 256;
    if (w.size() <= kCacheMaxLen) {
      std::lock_guard<std::mutex> lock(cache_mu_);
      if (auto it = cache_.find(w); it != cache_.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const size_t first = ids.size();
    merge_word(w, ids);
    if (w.size() <= kCacheMaxLen) {
      std::lock_guard<std::mutex> lock(cache_mu_);
      if (cache_.size() > 200000) cache_.clear();
      cache_.emplace(std::string(w),
                     std::vector<int32_t>(ids.begin() + static_cast<ptrdiff_t>(first), ids.end()));
    }
  }

  // HF BPE word merge (models/bpe/word.rs merge_all): a min-heap of (rank, position) over a
  // doubly linked list of symbols; stale entries are skipped when popped. O(n log n).
  void merge_word(std::string_view w, std::vector<int32_t>& ids) const {
    struct Sym {
      int32_t id;
      int32_t prev, next;
      uint32_t len;
    };
    std::vector<Sym> syms;
    syms.reserve(w.size());
    for (unsigned char c : w) {
      int32_t id = byte_id_[c];
      if (id < 0 && byte_fallback_) id = fallback_id_[c];
      if (id < 0) continue;  // no unk token: HF drops the byte
      const auto n = static_cast<int32_t>(syms.size());
      syms.push_back({id, n - 1, n + 1, 1});
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    struct Merge {
      int32_t rank, pos, new_id;
    };
    auto cmp = [](const Merge& a, const Merge& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    std::vector<Merge> heap;
    heap.reserve(syms.size());
    for (size_t i = 0; i + 1 < syms.size(); ++i) {
      if (const auto* m = merges_.find(pair_key(syms[i].id, syms[i + 1].id)))
        heap.push_back({m->rank, static_cast<int32_t>(i), m->new_id});
    }
    std::make_heap(heap.begin(), heap.end(), cmp);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), cmp);
      const Merge top = heap.back();
      heap.pop_back();
      Sym& cur = syms[static_cast<size_t>(top.pos)];
      if (cur.len == 0 || cur.next < 0) continue;
      Sym& right = syms[static_cast<size_t>(cur.next)];
      const auto* check = merges_.find(pair_key(cur.id, right.id));
      if (!check || check->new_id != top.new_id) continue;
      cur.id = top.new_id;
      cur.len += right.len;
      right.len = 0;
      cur.next = right.next;
      if (cur.next >= 0) syms[static_cast<size_t>(cur.next)].prev = top.pos;
      if (cur.prev >= 0) {
        if (const auto* m =
                merges_.find(pair_key(syms[static_cast<size_t>(cur.prev)].id, cur.id))) {
          heap.push_back({m->rank, cur.prev, m->new_id});
          std::push_heap(heap.begin(), heap.end(), cmp);
        }
      }
      if (cur.next >= 0) {
        if (const auto* m =
                merges_.find(pair_key(cur.id, syms[static_cast<size_t>(cur.next)].id))) {
          heap.push_back({m->rank, top.pos, m->new_id});
          std::push_heap(heap.begin(), heap.end(), cmp);
        }
      }
    }
    for (int32_t i = 0; i >= 0; i = syms[static_cast<size_t>(i)].next)
      ids.push_back(syms[static_cast<size_t>(i)].id);
  }

  std::string name_;
  StringMap<int32_t> vocab_;             // model spelling -> id
  StringMap<int32_t> bytes_to_id_;       // decoded bytes -> model id (ignore_merges)
  StringMap<int32_t> added_by_content_;  // added-token content -> id
  std::vector<std::string> id_to_token_;
  std::vector<std::string> id_bytes_;
  std::vector<uint8_t> special_, present_;
  MergeTable merges_;  // (a, b) -> (rank, merged id)
  std::array<int32_t, 256> byte_id_{};
  std::array<int32_t, 256> fallback_id_ = [] {
    std::array<int32_t, 256> a{};
    a.fill(-1);
    return a;
  }();
  bool ignore_merges_ = false, byte_fallback_ = false, nfc_ = false;
  std::vector<AddedToken> added_;
  std::array<std::array<bool, 256>, 2>
      first_byte_{};  // [normalized][byte]: an added token starts with it
  std::vector<SplitStep> steps_;
  mutable std::mutex cache_mu_;
  mutable StringMap<std::vector<int32_t>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer_json_text(std::string_view text,
                                                    const std::string& name) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    FN_THROW(Format, "{}: not valid JSON: {}", name, e.what());
  }
  FN_REQUIRE(j.is_object(), Format,
             "{}: not a Hugging Face tokenizer.json (the top level is not a JSON object)", name);
  try {
    return std::make_unique<BpeTokenizer>(j, name);
  } catch (const json::exception& e) {
    FN_THROW(Format, "{}: unexpected JSON content: {}", name, e.what());
  }
}

std::unique_ptr<Tokenizer> load_tokenizer_json(const std::filesystem::path& file) {
  return load_tokenizer_json_text(read_regular_file(file, kMaxTokenizerFileBytes, "tokenizer file"),
                                  file.string());
}

}  // namespace fn
