// apps/batch_records: per-record seeds, per-record sampling fields, raw ids, the --resume scan,
// the ordered writer and the progress text. Expected seeds are computed independently (Python
// integers, mod 2^64) and the splitmix64 output for 0 is the published first output of
// SplitMix64 seeded with 0 (0xe220a8397b1dcdaf).
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "apps/batch_records.h"
#include "core/error.h"

namespace fn {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::Format);
    return e.what();
  }
  return "(no error)";
}

RecordSettings defaults() {
  RecordSettings d;
  d.sampling.temperature = 0.7;
  d.sampling.top_k = 20;
  d.sampling.top_p = 0.9;
  d.max_new_tokens = 16;
  d.stop = {"END"};
  return d;
}

TEST_CASE("batch records: seeds are splitmix64 of the base seed xor the line number") {
  CHECK(splitmix64(0) == 0xe220a8397b1dcdafULL);
  CHECK(record_seed(5, 3) == 13647215125184110592ULL);  // splitmix64(5 ^ 3 = 6)
  CHECK(record_seed(12345, 1) == 18133564086679993456ULL);
  CHECK(record_seed(12345, 2) == 5886303152054975053ULL);
  CHECK(record_seed(12345, 1) != record_seed(12345, 2));
  CHECK(sample_seed(99, 0) == 99);
  CHECK(sample_seed(7, 2) == 7134611160154358618ULL);  // splitmix64(7 ^ 2 = 5)
}

TEST_CASE("batch records: every sampling field overrides its default") {
  const json rec = json::parse(
      R"({"seed": 18446744073709551615, "temperature": 0, "top_k": 3, "top_p": 0.5,
          "min_p": 0.25, "repeat_penalty": 1.5, "presence_penalty": -0.5,
          "frequency_penalty": 2, "max_tokens": 7, "stop": ["a", "bc"], "n": 4, "logprobs": 20})");
  const RecordSettings s = record_settings(rec, defaults());
  CHECK(s.seed_given);
  CHECK(s.sampling.seed == 18446744073709551615ULL);
  CHECK(s.sampling.temperature == 0.0);
  CHECK(s.sampling.top_k == 3);
  CHECK(s.sampling.top_p == 0.5);
  CHECK(s.sampling.min_p == 0.25);
  CHECK(s.sampling.repetition_penalty == 1.5);
  CHECK(s.sampling.presence_penalty == -0.5);
  CHECK(s.sampling.frequency_penalty == 2.0);
  CHECK(s.max_new_tokens == 7);
  CHECK(s.stop == std::vector<std::string>{"a", "bc"});
  CHECK(s.n == 4);
  CHECK(s.top_logprobs == 20);
}

TEST_CASE("batch records: absent or null fields keep the defaults; stop may be one string") {
  const RecordSettings a = record_settings(json::parse(R"({"prompt": "x"})"), defaults());
  CHECK_FALSE(a.seed_given);
  CHECK(a.sampling.temperature == 0.7);
  CHECK(a.sampling.top_k == 20);
  CHECK(a.max_new_tokens == 16);
  CHECK(a.stop == std::vector<std::string>{"END"});
  CHECK(a.n == 1);
  const RecordSettings b = record_settings(
      json::parse(R"({"temperature": null, "stop": "xy", "max_tokens": -1})"), defaults());
  CHECK(b.sampling.temperature == 0.7);
  CHECK(b.stop == std::vector<std::string>{"xy"});
  CHECK(b.max_new_tokens == -1);
}

TEST_CASE("batch records: a field of the wrong type or out of range is a Format error naming it") {
  const auto err = [](const char* text) {
    return error_of([&] { record_settings(json::parse(text), defaults()); });
  };
  CHECK(err(R"({"temperature": "hot"})") ==
        R"("temperature" must be a number >= 0 (0 = greedy), got "hot")");
  CHECK(err(R"({"temperature": -1})") ==
        R"("temperature" must be a number >= 0 (0 = greedy), got -1)");
  CHECK(err(R"({"top_p": 2})") == R"("top_p" must be a number in (0, 1], got 2)");
  CHECK(err(R"({"top_p": 0})") == R"("top_p" must be a number in (0, 1], got 0)");
  CHECK(err(R"({"min_p": 1.5})") == R"("min_p" must be a number in [0, 1], got 1.5)");
  CHECK(err(R"({"top_k": 2.5})") == R"("top_k" must be an integer >= 0 (0 = off), got 2.5)");
  CHECK(err(R"({"top_k": -1})") == R"("top_k" must be an integer >= 0 (0 = off), got -1)");
  CHECK(err(R"({"repeat_penalty": 0})") ==
        R"("repeat_penalty" must be a number > 0 (1 = off), got 0)");
  CHECK(err(R"({"presence_penalty": true})") ==
        R"("presence_penalty" must be a number (finite), got true)");
  CHECK(err(R"({"frequency_penalty": [1]})") ==
        R"("frequency_penalty" must be a number (finite), got [1])");
  CHECK(err(R"({"seed": -1})") ==
        R"("seed" must be an integer in [0, 18446744073709551615], got -1)");
  CHECK(err(R"({"seed": 1.5})") ==
        R"("seed" must be an integer in [0, 18446744073709551615], got 1.5)");
  CHECK(err(R"({"max_tokens": 0})") ==
        R"("max_tokens" must be an integer >= 1, or -1 (until the context is full), got 0)");
  CHECK(err(R"({"max_tokens": "5"})") ==
        R"("max_tokens" must be an integer >= 1, or -1 (until the context is full), got "5")");
  CHECK(err(R"({"stop": 3})") == R"("stop" must be a string or a list of strings, got 3)");
  CHECK(err(R"({"stop": ["a", 1]})") == R"("stop"[1] must be a string, got 1)");
  CHECK(err(R"({"stop": ""})") == R"("stop": an empty stop string would stop at once)");
  CHECK(err(R"({"n": 0})") == R"("n" must be an integer in [1, 1024], got 0)");
  CHECK(err(R"({"n": 1025})") == R"("n" must be an integer in [1, 1024], got 1025)");
  CHECK(err(R"({"logprobs": 21})") == R"("logprobs" must be an integer in [0, 20], got 21)");
  CHECK(err(R"({"logprobs": -1})") == R"("logprobs" must be an integer in [0, 20], got -1)");
  CHECK(err(R"({"logprobs": true})") == R"("logprobs" must be an integer in [0, 20], got true)");
}

TEST_CASE("batch records: a field set limits what is read") {
  const std::set<std::string> only{"seed"};
  const RecordSettings s =
      record_settings(json::parse(R"({"seed": 3, "n": "x", "temperature": 0})"), defaults(), &only);
  CHECK(s.seed_given);
  CHECK(s.sampling.seed == 3);
  CHECK(s.sampling.temperature == 0.7);
  CHECK(s.n == 1);
}

TEST_CASE("batch records: known fields") {
  for (const char* f :
       {"id", "prompt", "prompt_ids", "messages", "seed", "temperature", "top_k", "top_p", "min_p",
        "repeat_penalty", "presence_penalty", "frequency_penalty", "max_tokens", "stop", "n"})
    CHECK(is_generate_record_field(f));
  CHECK_FALSE(is_generate_record_field("temp"));
  CHECK_FALSE(is_generate_record_field("max_new_tokens"));
}

TEST_CASE("batch records: the id is the member's JSON text as written") {
  CHECK(member_text(R"({"id": 12345678901234567890123, "prompt": "x"})", "id") ==
        "12345678901234567890123");
  CHECK(member_text(R"({"prompt": "x", "id":"a\"b"})", "id") == R"("a\"b")");
  // A leading byte-order mark, which the parser skips as well.
  CHECK(member_text("\xEF\xBB\xBF{\"id\": \"b\"}", "id") == R"("b")");
  CHECK(member_text(R"( { "x" : {"id": 1, "s": "}"} , "id" : 1.50 } )", "id") == "1.50");
  CHECK(member_text(R"({"id": [1, {"a": "]"}], "y": 2})", "id") == R"([1, {"a": "]"}])");
  CHECK(member_text(R"({"id": 1, "id": 2})", "id") == "2");  // the last, as the parser keeps
  CHECK(member_text(R"({"\u0069d": -3e5})", "id") == "-3e5");
  CHECK_FALSE(member_text(R"({"ids": 1, "x": {"id": 2}})", "id").has_value());
  CHECK(record_id_text(R"({"prompt": "x"})", 7) == "7");
  CHECK(record_id_text(R"({"id": null})", 7) == "null");
}

TEST_CASE("batch records: an output line puts the id text first, then the body") {
  CHECK(record_line("12345678901234567890123", json{{"a", 1}, {"b", "x"}}) ==
        "{\"id\":12345678901234567890123,\"a\":1,\"b\":\"x\"}\n");
  CHECK(record_line("\"s\"", json::object()) == "{\"id\":\"s\"}\n");
  const json back = json::parse(record_line("\"k\"", json{{"t", "\xff"}}));
  CHECK(back["id"] == "k");
  CHECK(back["t"] == "\xef\xbf\xbd");  // invalid UTF-8 written as U+FFFD
}

TEST_CASE("batch records: the resume scan keeps complete records and cuts a partial line") {
  const fs::path dir = fs::temp_directory_path() / fs::path("fn_batch_records_test");
  fs::create_directories(dir);
  const fs::path p = dir / "out.jsonl";
  const std::string complete =
      "{\"id\":12345678901234567890123,\"sample_index\":0,\"finish_reason\":\"length\"}\n"
      "{\"id\":\"a\",\"sample_index\":2,\"finish_reason\":\"stop\"}\n"
      "{\"id\":5,\"finish_reason\":\"error\",\"error\":\"x\"}\n";
  {
    std::ofstream f(p, std::ios::binary);
    f << complete << "{\"id\":6,\"sample_in";
  }
  const ResumeScan s = scan_resume_output(p.string(), "-o/--output");
  CHECK(s.records == 3);
  CHECK(s.cut_bytes == 18);
  CHECK(fs::file_size(p) == complete.size());
  CHECK(s.done ==
        std::set<std::string>{sample_key("12345678901234567890123", 0), sample_key("\"a\"", 2)});
  CHECK(s.error_ids == std::set<std::string>{"5"});

  {
    std::ofstream f(p, std::ios::binary);
    f << "{\"id\":1}\nnot json\n";
  }
  CHECK(error_of([&] { scan_resume_output(p.string(), "-o/--output"); }) ==
        "-o/--output " + p.string() +
            ": line 2 is not an output record of fngen generate (not JSON)");
  {
    std::ofstream f(p, std::ios::binary);
    f << "[1, 2]\n";
  }
  CHECK(error_of([&] { scan_resume_output(p.string(), "-o/--output"); }) ==
        "-o/--output " + p.string() +
            ": line 1 is not an output record of fngen generate (no \"id\")");
  const ResumeScan none = scan_resume_output((dir / "absent.jsonl").string(), "-o/--output");
  CHECK(none.records == 0);
  CHECK(none.done.empty());
  fs::remove_all(dir);
}

TEST_CASE("batch records: the ordered writer writes each line once every earlier one is in") {
  std::vector<std::string> written;
  OrderedWriter w([&](const std::string& s) { written.push_back(s); });
  w.put(2, "c");
  w.put(1, "b");
  CHECK(written.empty());
  CHECK(w.held() == 2);
  w.put(0, "a");
  CHECK(written == std::vector<std::string>{"a", "b", "c"});
  w.put(3, "");  // a sequence number that writes nothing
  w.put(4, "e");
  CHECK(written == std::vector<std::string>{"a", "b", "c", "e"});
  CHECK(w.next() == 5);
  CHECK_THROWS_AS(w.put(4, "again"), Error);
}

TEST_CASE("batch records: the progress text") {
  CHECK(format_batch_progress(0, 10, 0, 0.0) == "records 0 / 10 (0 %), 0 tokens");
  CHECK(format_batch_progress(5, 20, 1000, 2.0) ==
        "records 5 / 20 (25 %), 1000 tokens, 500.0 tok/s, ETA 6 s");
  CHECK(format_batch_progress(20, 20, 4000, 8.0) ==
        "records 20 / 20 (100 %), 4000 tokens, 500.0 tok/s, done");
}

}  // namespace
}  // namespace fn
