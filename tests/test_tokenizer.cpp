// Tokenizer unit tests: known Qwen3 ids, encode modes, the byte-level table, UTF-8 policy,
// added-token flags on a hand-made tokenizer.json, streaming detokenizer, long inputs, and the
// errors for bad tokenizer files.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "tests/tokenizer_test_util.h"
#include "tokenizer/unicode.h"

namespace {

using nlohmann::json;
using Ids = std::vector<int32_t>;

std::string cp_utf8(char32_t cp) {
  std::string s;
  fn::unicode::append_utf8(s, cp);
  return s;
}

// Byte-level spelling of a byte string (GPT-2 table).
std::string bl(std::string_view bytes) {
  std::string s;
  for (unsigned char b : bytes) s += cp_utf8(fn::unicode::byte_to_unicode()[b]);
  return s;
}

// A small byte-level BPE tokenizer.json: ids 0..255 are the bytes, then the merges' results.
json tiny_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges,
                    json added = json::array()) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[bl(std::string(1, static_cast<char>(b)))] = b;
  json m = json::array();
  int next = 256;
  for (const auto& [a, c] : merges) {
    if (!vocab.contains(bl(a + c))) vocab[bl(a + c)] = next++;
    m.push_back(json::array({bl(a), bl(c)}));
  }
  return json{
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array(
             {{{"type", "Split"},
               {"pattern", {{"Regex", fn::test::kQwen38Regex}}},
               {"behavior", "Isolated"},
               {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", m},
        {"ignore_merges", false},
        {"byte_fallback", false}}}};
}

std::unique_ptr<fn::Tokenizer> load(const json& j) {
  return fn::load_tokenizer_json_text(j.dump(), "tiny.json");
}

json added(const std::string& content, int id, bool special, bool lstrip = false,
           bool rstrip = false, bool single_word = false, bool normalized = false) {
  return {{"id", id},          {"content", content}, {"single_word", single_word},
          {"lstrip", lstrip},  {"rstrip", rstrip},   {"normalized", normalized},
          {"special", special}};
}

}  // namespace

TEST_CASE("tokenizer: Qwen3 encodes known strings to the published ids") {
  const auto& t = fn::test::qwen3();
  CHECK(t.encode("Hello world") == Ids{9707, 1879});
  CHECK(t.encode("<|im_start|>user\n") == Ids{151644, 872, 198});
  CHECK(t.vocab_size() == 151669);
  CHECK(t.id_to_token(9707) == "Hello");
  CHECK(t.id_to_token(1879) == "Ġworld");
  CHECK(t.token_to_id("<|im_end|>") == 151645);
  CHECK(t.token_to_id("no such token") == std::nullopt);
  CHECK(t.is_special(151645));
  CHECK_FALSE(t.is_special(151667));  // <think> is an added token but not special in Qwen3
  CHECK_FALSE(t.is_special(9707));
  CHECK(t.decode(Ids{9707, 1879}) == "Hello world");
}

TEST_CASE("tokenizer: plain mode treats special-token strings as text, raw mode as tokens") {
  const auto& t = fn::test::qwen3();
  const std::string s = "a<|im_start|>b";
  const Ids raw = t.encode(s, fn::EncodeMode::Raw);
  const Ids plain = t.encode(s, fn::EncodeMode::Plain);
  CHECK(raw.size() == 3);
  CHECK(raw[1] == 151644);
  CHECK(std::find(plain.begin(), plain.end(), 151644) == plain.end());
  CHECK(t.decode(plain) == s);
  CHECK(t.decode(raw) == s);
}

TEST_CASE(
    "tokenizer: the GPT-2 byte table maps printable bytes to themselves and the rest from U+0100") {
  const auto& tab = fn::unicode::byte_to_unicode();
  CHECK(tab['A'] == U'A');
  CHECK(tab[0] == 0x100);
  CHECK(tab[' '] == 0x120);   // 'Ġ'
  CHECK(tab['\n'] == 0x10A);  // 'Ċ'
  CHECK(tab[0x7F] == 0x121);
  CHECK(tab[0xA0] == 0x142);
  CHECK(tab[0xAD] == 0x143);
  CHECK(tab[0xFF] == 0xFF);
}

TEST_CASE("tokenizer: invalid UTF-8 in a prompt is rejected with the byte offset") {
  const auto& t = fn::test::qwen3();
  CHECK_THROWS_WITH_AS(t.encode("abc\xFFxyz"),
                       "invalid UTF-8 in text to encode at byte offset 3 (byte 0xFF)", fn::Error);
  CHECK_THROWS_WITH_AS(t.encode("\xC3"), doctest::Contains("byte offset 0"),
                       fn::Error);  // truncated
  CHECK_THROWS_WITH_AS(t.encode("ok \xED\xA0\x80"), doctest::Contains("byte offset 3"),
                       fn::Error);  // surrogate
  CHECK_THROWS_WITH_AS(t.encode("\xC0\xAF"), doctest::Contains("byte offset 0"),
                       fn::Error);  // overlong
  CHECK_THROWS_WITH_AS(t.encode("\xF4\x90\x80\x80"), doctest::Contains("byte offset 0"),
                       fn::Error);  // > U+10FFFF
  try {
    t.encode("x\x80");
    FAIL("no throw");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Format);
  }
  CHECK(t.encode(std::string("a\0b", 3)).size() == 3);  // NUL is valid UTF-8
}

TEST_CASE(
    "tokenizer: lossy decoding replaces each maximal invalid subpart with one U+FFFD, as Rust "
    "does") {
  const std::string r = "\xEF\xBF\xBD";
  CHECK(fn::unicode::utf8_lossy("a\xF0\x9F\x98") == "a" + r);
  CHECK(fn::unicode::utf8_lossy("\xE0\x80\x80") == r + r + r);
  CHECK(fn::unicode::utf8_lossy("\xED\xA0\x80z") == r + r + r + "z");
  CHECK(fn::unicode::utf8_lossy("\xF0\x9F\x98\x80") == "\xF0\x9F\x98\x80");
  CHECK(fn::unicode::utf8_lossy("\xE2\x82x") == r + "x");
  CHECK(fn::unicode::incomplete_utf8_tail("ab\xF0\x9F\x98") == 3);
  CHECK(fn::unicode::incomplete_utf8_tail("ab\xF0\x9F\x98\x80") == 0);
  CHECK(fn::unicode::incomplete_utf8_tail("ab\x80") == 0);
}

TEST_CASE("tokenizer: NFC follows HF for marks newer than Unicode 11 and utf8proc otherwise") {
  // U+0301 then U+0323 reorders (both Unicode 1.1) and composes.
  CHECK(fn::unicode::nfc("x\xCC\x81\xCC\xA3") == "x\xCC\xA3\xCC\x81");
  CHECK(fn::unicode::nfc("e\xCC\x81") == "\xC3\xA9");
  // U+1AC5 (Unicode 14, ccc 230) after U+0358 (ccc 232): utf8proc reorders, HF does not.
  const std::string s = "a\xCD\x98\xE1\xAB\x85";
  CHECK(fn::unicode::nfc_utf8proc(s) == "a\xE1\xAB\x85\xCD\x98");
  CHECK(fn::unicode::nfc(s) == s);
}

TEST_CASE("tokenizer: an emoji split over three tokens streams out once, never as U+FFFD") {
  const auto& t = fn::test::qwen3();
  const std::string emoji = "\xF0\x9F\xAB\xA0";  // U+1FAE0 melting face: 3 byte-level tokens
  const Ids ids = t.encode(emoji);
  REQUIRE(ids == Ids{9284, 104, 254});
  fn::StreamingDetokenizer s(t);
  CHECK(s.feed(ids[0]).empty());
  CHECK(s.feed(ids[1]).empty());
  CHECK(s.feed(ids[2]) == emoji);
  CHECK(s.finish().empty());
}

TEST_CASE("tokenizer: streaming pieces are valid UTF-8 and add up to decode() on mixed text") {
  const auto& t = fn::test::qwen3();
  const std::string text =
      "Zürich 中文 👨‍👩‍👧‍👦 🇯🇵 e\xCC\x81 <|im_end|> ok\n";
  const Ids ids = t.encode(text);
  fn::StreamingDetokenizer s(t);
  std::string all;
  for (int32_t id : ids) {
    const std::string piece = s.feed(id);
    CHECK(fn::unicode::find_invalid_utf8(piece) == std::string_view::npos);
    CHECK(piece.find("\xEF\xBF\xBD") == std::string::npos);
    all += piece;
  }
  all += s.finish();
  CHECK(all == t.decode(ids));
  CHECK(all == fn::unicode::nfc_utf8proc(text));
  // A stream cut inside a character: finish() yields the replacement character, as decode() does.
  fn::StreamingDetokenizer cut(t);
  const Ids crab = t.encode("\xF0\x9F\xAB\xA0");
  CHECK(cut.feed(crab[0]).empty());
  CHECK(cut.finish() == t.decode(std::span<const int32_t>(crab.data(), 1)));
  CHECK(t.decode(std::span<const int32_t>(crab.data(), 1)) == "\xEF\xBF\xBD");
}

TEST_CASE("tokenizer: an id past the tokenizer (a padded model row) streams as no text") {
  const auto& t = fn::test::qwen3();
  REQUIRE(t.vocab_size() == 151669);
  const Ids hello = t.encode("Hello");
  fn::StreamingDetokenizer s(t);
  std::string all;
  all += s.feed(hello[0]);
  CHECK(s.feed(151669).empty());  // Qwen3 models have vocab_size 151936
  CHECK(s.feed(151935).empty());
  for (std::size_t i = 1; i < hello.size(); ++i) all += s.feed(hello[i]);
  all += s.finish();
  CHECK(all == "Hello");
  CHECK(s.unknown_ids() == 2);
  // decode() itself still refuses the id: only the generation stream is lenient.
  CHECK_THROWS_AS(t.decode(Ids{151669}), fn::Error);
}

TEST_CASE("tokenizer: 1 MB without whitespace and 1 MB of one character round-trip") {
  const auto& t = fn::test::qwen3();
  std::string nows;
  uint32_t x = 12345;
  const char* alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:-_";
  while (nows.size() < (1 << 20)) {
    x = x * 1664525u + 1013904223u;
    nows += alphabet[(x >> 16) % 68];
  }
  CHECK(t.decode(t.encode(nows)) == nows);
  const std::string same(1 << 20, 'a');
  const Ids ids = t.encode(same);
  CHECK(t.decode(ids) == same);
  CHECK(ids.size() < same.size() / 4);  // merged, not left as bytes
}

TEST_CASE("tokenizer: BPE merges follow rank order, not text order") {
  // Ranks: "b c" (0) before "a b" (1): "abc" -> a + bc; adding "a bc" (2) then gives abc.
  auto t = load(tiny_tokenizer({{"b", "c"}, {"a", "b"}}));
  const int32_t bc = *t->token_to_id(bl("bc")), ab = *t->token_to_id(bl("ab"));
  CHECK(t->encode("abc") == Ids{'a', bc});
  CHECK(t->encode("abab") == Ids{ab, ab});
  auto t2 = load(tiny_tokenizer({{"b", "c"}, {"a", "b"}, {"a", "bc"}}));
  CHECK(t2->encode("abc") == Ids{*t2->token_to_id(bl("abc"))});
  CHECK(t2->encode("ab c") == Ids{*t2->token_to_id(bl("ab")), ' ', 'c'});
}

TEST_CASE("tokenizer: ignore_merges takes a whole pre-token from the vocabulary") {
  json j = tiny_tokenizer({{"a", "b"}});
  j["model"]["vocab"][bl("abc")] = 300;
  CHECK(load(j)->encode("abc") == Ids{*load(j)->token_to_id(bl("ab")), 'c'});
  j["model"]["ignore_merges"] = true;
  CHECK(load(j)->encode("abc") == Ids{300});
}

TEST_CASE("tokenizer: added tokens honour lstrip, rstrip, single_word and normalized") {
  json add = json::array({added("<L>", 400, true, /*lstrip=*/true),
                          added("<R>", 401, true, false, /*rstrip=*/true),
                          added("<W>", 402, false, false, false, /*single_word=*/true),
                          added("\xC3\xA9", 403, false, false, false, false, /*normalized=*/true),
                          added("<LONG>", 404, true), added("<LO", 405, true)});
  auto t = load(tiny_tokenizer({}, add));
  CHECK(t->encode("a  <L>b") == Ids{'a', 400, 'b'});  // spaces before <L> absorbed
  CHECK(t->encode("a<R>  b") == Ids{'a', 401, 'b'});  // spaces after <R> absorbed
  CHECK(t->encode("x <W> y") == Ids{'x', ' ', 402, ' ', 'y'});
  CHECK(t->encode("x<W>y").size() == 5);      // inside a word: not matched
  CHECK(t->encode("e\xCC\x81") == Ids{403});  // NFD input matches after NFC
  CHECK(t->encode("<LONG>") == Ids{404});     // longest match wins
  CHECK(t->encode("<LOX") == Ids{405, 'X'});
  CHECK(t->encode("<LONG>", fn::EncodeMode::Plain).size() == 6);
}

TEST_CASE("tokenizer: a missing or corrupt tokenizer file is a clear error") {
  CHECK_THROWS_WITH_AS(fn::load_tokenizer_json("/nonexistent/tokenizer.json"),
                       "tokenizer file /nonexistent/tokenizer.json: cannot open file (No such file "
                       "or directory)",
                       fn::Error);
  CHECK_THROWS_WITH_AS(fn::load_tokenizer("/nonexistent"), doctest::Contains("does not exist"),
                       fn::Error);
  CHECK_THROWS_WITH_AS(fn::load_tokenizer(FN_SOURCE_DIR "/tests"),
                       doctest::Contains("has neither tokenizer.json nor tokenizer.model"),
                       fn::Error);
  // Truncated copy of the real file.
  const std::string real = fn::test::read_file(fn::test::qwen3_json_path());
  CHECK_THROWS_WITH_AS(fn::load_tokenizer_json_text(real.substr(0, real.size() / 2), "cut.json"),
                       doctest::Contains("cut.json: not valid JSON"), fn::Error);
  CHECK_THROWS_WITH_AS(fn::load_tokenizer_json_text("[1,2]", "arr.json"),
                       doctest::Contains("not a JSON object"), fn::Error);
  CHECK_THROWS_WITH_AS(fn::load_tokenizer_json_text("{}", "empty.json"),
                       doctest::Contains("no \"model\""), fn::Error);
  // A device is never read (/dev/zero would fill memory), nor is a directory as a file.
  CHECK_THROWS_WITH_AS(fn::load_tokenizer_json("/dev/zero"),
                       "tokenizer file /dev/zero: is not a regular file (a device)", fn::Error);
  CHECK_THROWS_WITH_AS(fn::load_sentencepiece("/dev/zero"),
                       doctest::Contains("/dev/zero: is not a regular file (a device)"), fn::Error);
  // A FIFO is named as one and never opened for a blocking read (no writer: it would hang), and
  // a directory is named as one, for both kinds of tokenizer file.
  const std::filesystem::path odd =
      std::filesystem::temp_directory_path() / ("fngen-tok-odd-" + std::to_string(::getpid()));
  std::filesystem::remove_all(odd);
  std::filesystem::create_directories(odd / "dir.json");
  REQUIRE(::mkfifo((odd / "fifo.json").c_str(), 0600) == 0);
  REQUIRE(::mkfifo((odd / "fifo.model").c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(fn::load_tokenizer_file(odd / "fifo.json"),
                       doctest::Contains("fifo.json: is not a regular file (a FIFO)"), fn::Error);
  CHECK_THROWS_WITH_AS(fn::load_tokenizer_file(odd / "fifo.model"),
                       doctest::Contains("fifo.model: is not a regular file (a FIFO)"), fn::Error);
  CHECK_THROWS_WITH_AS(fn::load_tokenizer_json(odd / "dir.json"),
                       doctest::Contains("dir.json: is not a regular file (a directory)"),
                       fn::Error);
  std::filesystem::remove_all(odd);
  // An id far past any vocabulary is refused before its tables are sized (it was bad_alloc).
  json huge = tiny_tokenizer({});
  huge["model"]["vocab"]["zz"] = 1 << 24;
  CHECK_THROWS_WITH_AS(fn::load_tokenizer_json_text(huge.dump(), "huge.json"),
                       doctest::Contains("huge.json: token 'zz' has invalid id 16777216"),
                       fn::Error);
  // Two vocabulary entries with one id (decode could only give one of them back).
  json twice = tiny_tokenizer({});
  twice["model"]["vocab"]["zz"] = 97;  // the id of "a"
  CHECK_THROWS_WITH_AS(fn::load_tokenizer_json_text(twice.dump(), "twice.json"),
                       doctest::Contains("twice.json: model.vocab gives id 97 to both"), fn::Error);
}

TEST_CASE("tokenizer: merges naming unknown tokens are rejected with the merge and token") {
  json j = tiny_tokenizer({{"a", "b"}});
  j["model"]["merges"].push_back(json::array({"zz", "a"}));
  CHECK_THROWS_WITH_AS(load(j), "tiny.json: merge 1 ('zz', 'a') names unknown token 'zz'",
                       fn::Error);
  // A NUL inside a hostile token name stays in the message (what() would end at it).
  json z = tiny_tokenizer({{"a", "b"}});
  z["model"]["merges"].push_back(json::array({std::string("z\0z", 3), "a"}));
  CHECK_THROWS_WITH_AS(load(z), "tiny.json: merge 1 ('z\\x00z', 'a') names unknown token 'z\\x00z'",
                       fn::Error);
  json k = tiny_tokenizer({{"a", "b"}});
  k["model"]["merges"].push_back("a c");  // "ac" is not in the vocabulary
  CHECK_THROWS_WITH_AS(load(k),
                       "tiny.json: merge 1 ('a', 'c') makes 'ac', which is not in the vocabulary",
                       fn::Error);
}

TEST_CASE("tokenizer: unsupported components are rejected by name") {
  json j = tiny_tokenizer({});
  j["normalizer"] = {{"type", "NFKC"}};
  CHECK_THROWS_WITH_AS(load(j), doctest::Contains("normalizer 'NFKC' is not supported"), fn::Error);
  j = tiny_tokenizer({});
  j["pre_tokenizer"]["pretokenizers"][0]["type"] = "Whitespace";
  CHECK_THROWS_WITH_AS(load(j), doctest::Contains("pre_tokenizer 'Whitespace' is not supported"),
                       fn::Error);
  j = tiny_tokenizer({});
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed";
  CHECK_THROWS_WITH_AS(load(j), doctest::Contains("Split behavior 'Removed'"), fn::Error);
  j = tiny_tokenizer({});
  j["decoder"] = {{"type", "WordPiece"}};
  CHECK_THROWS_WITH_AS(load(j), doctest::Contains("decoder 'WordPiece' is not supported"),
                       fn::Error);
  j = tiny_tokenizer({});
  j["model"]["type"] = "Unigram";
  CHECK_THROWS_WITH_AS(load(j), doctest::Contains("model type 'Unigram' is not supported"),
                       fn::Error);
  j = tiny_tokenizer({});
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  CHECK_THROWS_WITH_AS(load(j), doctest::Contains("regex does not compile"), fn::Error);
}

TEST_CASE("tokenizer: decoding an id outside the vocabulary is a format error naming it") {
  const auto& t = fn::test::qwen3();
  CHECK_THROWS_WITH_AS(t.decode(Ids{9707, 151669}),
                       doctest::Contains("token id 151669 is not in the vocabulary"), fn::Error);
  CHECK_THROWS_AS(t.decode(Ids{-1}), fn::Error);
}

TEST_CASE("tokenizer: concurrent encodes from several threads give the single-threaded ids") {
  const auto& t = fn::test::qwen3();
  std::vector<std::string> texts;
  for (int i = 0; i < 400; ++i)
    texts.push_back("Sample " + std::to_string(i * 7919) +
                    " caf\xC3\xA9 \xE4\xB8\xAD\xE6\x96\x87 word" +
                    std::string(static_cast<size_t>(i % 13), 'x') + " <|im_end|>\n");
  std::vector<Ids> expect;
  for (const auto& s : texts) expect.push_back(t.encode(s));
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (size_t i = 0; i < texts.size(); ++i) {
        const size_t j = (i * 31 + static_cast<size_t>(k) * 97) % texts.size();
        wrong[static_cast<size_t>(k)] += t.encode(texts[j]) != expect[j];
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(wrong == std::vector<int>{0, 0, 0, 0});
}
