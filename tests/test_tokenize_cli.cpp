// `fngen tokenize` end to end: text -> ids, --ids -> text, --chat --json, JSONL batches with bad
// records (an "error" field, the run goes on), and the exit codes of bad invocations.
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/tokenizer_test_util.h"
#include "tokenizer/chat.h"

namespace {

struct Run {
  int code;
  std::string out;
};

// `fngen tokenize ARGS` with stderr dropped; env: VAR=value assignments put before it.
Run fngen(const std::string& args, const std::string& env = "") {
  const std::string cmd =
      env + " " + std::string(FN_BINARY_DIR) + "/fngen tokenize " + args + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

const std::string kModel = std::string("-m ") + FN_TOKENIZER_DIR;

}  // namespace

TEST_CASE("tokenize cli: text to ids and ids back to text") {
  fn::test::qwen3();  // fails clearly when the tokenizer files are absent
  auto r = fngen(kModel + " -p 'Hello world'");
  CHECK(r.code == 0);
  CHECK(r.out == "9707 1879\n");
  r = fngen(kModel + " -p '' </dev/null");  // empty text: no ids (not stdin)
  CHECK(r.code == 0);
  CHECK(r.out == "\n");
  r = fngen(kModel + " --ids '9707, 1879'");
  CHECK(r.code == 0);
  CHECK(r.out == "Hello world");
  r = fngen("--tokenizer " + fn::test::qwen3_json_path() + " --json --ids '[9707,1879]'");
  CHECK(nlohmann::json::parse(r.out)["text"] == "Hello world");
  r = fngen(std::string("--tokenizer ") + FN_TOKENIZER_DIR + " --ids '9707 1879'");  // a directory
  CHECK(r.code == 0);
  CHECK(r.out == "Hello world");
  // Under mpirun only rank 0 tokenizes (without MPI); the other ranks print nothing, even for
  // input that rank 0 refuses.
  r = fngen(kModel + " -p 'Hello world'", "OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2");
  CHECK(r.code == 0);
  CHECK(r.out == "9707 1879\n");
  r = fngen("-m /nonexistent -p x", "OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2");
  CHECK(r.code == 0);
  CHECK(r.out.empty());
}

TEST_CASE("tokenize cli: --chat --json gives the chat ids, the rendered text and the tokens") {
  const auto r = fngen(
      kModel + " --chat --chat-mode qwen3 --no-think --system-prompt 'Be brief.' --json -p 'Hi!'");
  REQUIRE(r.code == 0);
  const auto j = nlohmann::json::parse(r.out);
  const std::vector<fn::ChatMessage> msgs = {{"system", "Be brief.", std::nullopt},
                                             {"user", "Hi!", std::nullopt}};
  fn::ChatOptions o;
  o.mode = fn::ChatMode::Qwen3;
  o.enable_thinking = false;
  CHECK(j["ids"].get<std::vector<int32_t>>() == fn::encode_chat(fn::test::qwen3(), msgs, o));
  CHECK(j["text"] == fn::render_chat(msgs, o));
  CHECK(j["n_tokens"] == j["ids"].size());
  CHECK(j["tokens"][0] == "<|im_start|>");
}

TEST_CASE("tokenize cli: a JSONL batch keeps order and marks bad records with an error field") {
  const std::string in = std::string(FN_BINARY_DIR) + "/test_tokenize_cli_in.jsonl";
  const std::string out = std::string(FN_BINARY_DIR) + "/test_tokenize_cli_out.jsonl";
  {
    std::ofstream f(in, std::ios::binary);
    f << R"({"text": "Hello world"})"
      << "\n"
      << "not json\n"
      << R"({"prompt": "wrong field"})"
      << "\n"
      << "{\"text\": \"bad \xFF utf8\"}\n"
      << "  \n"  // blank: no record, as in generate -i
      << R"({"text": "<|im_end|>", "id": "eot"})"
      << "\n"
      << R"({"messages": [{"role": "user", "content": "x"}]})"
      << "\n"
      << R"({"messages": [{"role": "robot", "content": "x"}]})"
      << "\n"
      << R"({"text": "a", "messages": [{"role": "user", "content": "x"}]})"
      << "\n"
      // An "id" nested 128 levels deep is echoed; 100,000 levels (writing it back overflowed the
      // stack: exit 139) is refused as the record's error.
      << R"({"text": "a", "id": )" << std::string(127, '[') << std::string(127, ']') << "}\n"
      << R"({"text": "a", "id": )" << std::string(100000, '[') << std::string(100000, ']')
      << "}\n"
      // A key given twice (the parser alone keeps the last value), also inside "messages".
      << R"({"text": "a", "id": 1, "text": "b"})"
      << "\n"
      << R"({"messages": [{"role": "user", "content": "x", "content": "y"}]})"
      << "\n";
  }
  // --system-prompt goes before the messages of a record (as in generate -i), not into "text".
  const auto r = fngen(kModel + " --chat-mode qwen3 --system-prompt S -i " + in + " -o " + out);
  CHECK(r.code == 0);
  std::ifstream f(out);
  std::vector<nlohmann::json> recs;
  for (std::string l; std::getline(f, l);) recs.push_back(nlohmann::json::parse(l));
  REQUIRE(recs.size() == 12);
  CHECK(recs[0]["ids"] == std::vector<int32_t>{9707, 1879});
  CHECK(recs[0]["id"] == 1);  // the line number, without an "id" of the record's own
  CHECK(recs[1]["error"].get<std::string>().find("line 2: not valid JSON") == 0);
  CHECK(recs[2]["error"] == "line 3: the record needs exactly one of \"text\" or \"messages\"");
  CHECK(recs[3]["error"].get<std::string>().find("line 4: not valid JSON") == 0);
  CHECK(recs[4]["ids"] == std::vector<int32_t>{151645});
  CHECK(recs[4]["id"] == "eot");
  fn::ChatOptions o;
  o.mode = fn::ChatMode::Qwen3;
  const std::vector<fn::ChatMessage> msgs = {{"system", "S", std::nullopt},
                                             {"user", "x", std::nullopt}};
  CHECK(recs[5]["ids"].get<std::vector<int32_t>>() == fn::encode_chat(fn::test::qwen3(), msgs, o));
  CHECK(recs[5]["id"] == 7);
  CHECK(recs[6]["error"] ==
        "line 8: \"messages\"[0].role \"robot\" is not one of system, user, assistant, tool");
  CHECK(recs[7]["error"] == "line 9: the record needs exactly one of \"text\" or \"messages\"");
  CHECK(recs[8]["ids"] == std::vector<int32_t>{64});
  CHECK(recs[8]["id"].dump() == std::string(127, '[') + std::string(127, ']'));
  CHECK(recs[9]["error"] == "line 11: a value nested deeper than 128 levels");
  CHECK(recs[9]["id"] == 11);
  CHECK(recs[10]["error"] ==
        "line 12: duplicate key \"text\" (each key may appear once in an object)");
  CHECK(recs[10]["id"] == 12);
  CHECK(recs[11]["error"] ==
        "line 13: duplicate key \"content\" (each key may appear once in an object)");

  // -o - is standard output (not a file named "-"): the same records.
  std::filesystem::remove("-");
  const auto d = fngen(kModel + " --chat-mode qwen3 --system-prompt S -i " + in + " -o -");
  CHECK(d.code == 0);
  std::ifstream again(out);
  CHECK(d.out == std::string(std::istreambuf_iterator<char>(again), {}));
  CHECK(!std::filesystem::exists("-"));
}

TEST_CASE("tokenize cli: bad invocations exit with the usage and input codes") {
  CHECK(fngen("-m /nonexistent -p x").code == 3);
  CHECK(fngen(kModel + " --tokenizer " + fn::test::qwen3_json_path() + " -p x").code == 2);
  CHECK(fngen(kModel + " --ids '1 x'").code == 2);
  CHECK(fngen(kModel + " --ids '1 999999999'").code == 2);  // outside the vocabulary, as generate
  CHECK(fngen(kModel + " --ids '151668'").code == 0);       // the last id of the vocabulary
  CHECK(fngen(kModel + " --ids '1,,2'").code == 2);         // parse_token_ids' rules, as generate
  CHECK(fngen(kModel + " --ids '+5'").code == 2);
  CHECK(fngen(kModel + " --ids '' </dev/null").code == 2);  // no ids: not stdin encoded
  CHECK(fngen(kModel + " --ids ' , ' </dev/null").code == 2);
  CHECK(fngen(kModel + " --ids 9707 -i /dev/null").code == 2);  // --ids with a batch
  CHECK(fngen(kModel + " -i /dev/null -p x").code == 2);        // texts from both
  CHECK(fngen(kModel + " -i /dev/null -p ''").code == 2);       // even an empty -p
  // A batch that is a directory or has no record fails before the tokenizer loads (exit 3).
  CHECK(fngen(kModel + " -i " + FN_BINARY_DIR).code == 3);
  CHECK(fngen(kModel + " -i /dev/null").code == 3);
  const std::string unused = std::string(FN_BINARY_DIR) + "/test_tokenize_cli_unused.jsonl";
  CHECK(fngen(kModel + " -p x -o " + unused).code == 2);  // -o without -i: not silently ignored
  CHECK(!std::ifstream(unused).good());
  // --tokenizer DIR guards its files as -m DIR does: -o inside it is refused before it is opened.
  const std::string inside = std::string(FN_TOKENIZER_DIR) + "/never.jsonl";
  CHECK(fngen(std::string("--tokenizer ") + FN_TOKENIZER_DIR + " -i /dev/null -o " + inside).code ==
        2);
  CHECK(!std::ifstream(inside).good());
  // --tokenizer FILE reads that file alone: -o may not be it (the other files beside it are not
  // read, so a tokenizer file in the working directory does not block outputs there).
  CHECK(fngen("--tokenizer " + fn::test::qwen3_json_path() + " -i /dev/null -o " +
              fn::test::qwen3_json_path())
            .code == 2);
  // Checked while parsing or before the tokenizer loads, so -o is never truncated by them: a
  // bad --chat-template value, an -o in a missing directory, paths given as ''.
  const std::string kept = std::string(FN_BINARY_DIR) + "/test_tokenize_cli_kept.jsonl";
  std::ofstream(kept) << "precious\n";
  CHECK(fngen(kModel + " -i /dev/null -o " + kept + " --chat-template qwen4").code == 2);
  CHECK(fngen(kModel + " -i " + kept + "x -o " + kept + " --chat-mode qwen4").code == 2);
  std::string text;
  std::getline(std::ifstream(kept), text);
  CHECK(text == "precious");
  CHECK(fngen(kModel + " -i " + kept + " -o /nonexistent-dir/out.jsonl").code == 3);
  CHECK(fngen(kModel + " -i '' </dev/null").code == 2);
  CHECK(fngen(kModel + " -f '' </dev/null").code == 2);
  CHECK(fngen("--tokenizer '' -p x").code == 2);
  CHECK(fngen(kModel + " -p \"$(printf 'bad\\377')\"").code == 3);  // invalid UTF-8
  CHECK(fngen(kModel + " -p x --think --no-think").code == 2);
  // Combinations that would do nothing or contradict each other are usage errors found before
  // the tokenizer loads: with a missing model directory they still exit 2 (the load's error is 3).
  const std::string missing = "-m /nonexistent";
  CHECK(fngen(missing + " -p x").code == 3);  // the load's error: the checks below come first
  CHECK(fngen(missing + " -p x -f y").code == 2);
  CHECK(fngen(missing + " --ids '' </dev/null").code == 2);
  CHECK(fngen(missing + " --ids '[ , ]' </dev/null").code == 2);
  CHECK(fngen(missing + " --ids 9707 --plain").code == 2);  // --plain encodes; --ids decodes
  CHECK(fngen(missing + " --bench").code == 2);             // --bench needs -f prose
  CHECK(fngen(missing + " --bench -f y --chat").code == 2);
  CHECK(fngen(missing + " --bench -f y --plain").code == 2);
  CHECK(fngen(missing + " --bench -f y -p x").code == 2);
  CHECK(fngen(missing + " -i y --json").code == 2);                // a batch always writes JSONL
  CHECK(fngen(missing + " --chat --plain -p x").code == 2);        // chat content is always plain
  CHECK(fngen(missing + " --ids 1 --system-prompt S").code == 2);  // no chat options with --ids
  CHECK(fngen(missing + " --ids abc").code == 2);  // the list's syntax, before the load
  CHECK(fngen(missing + " --ids '1,,2'").code == 2);
  CHECK(fngen(missing + " --ids=-1").code == 2);
  CHECK(fngen(kModel + " --bench -f /dev/null").code == 3);  // no prose to time (was exit 0)
  // -m names the model directory: a file there is a usage error (as generate), not "missing".
  CHECK(fngen("-m " + fn::test::qwen3_json_path() + " -p x").code == 2);
  // Chat options without a chat prompt would do nothing: refused, as in generate.
  CHECK(fngen(kModel + " -p x --system-prompt S").code == 2);
  CHECK(fngen(kModel + " -p x --no-think").code == 2);
  CHECK(fngen(kModel + " -p x --chat-mode qwen3").code == 2);
}

TEST_CASE(
    "tokenize cli: a damaged config.json beside the tokenizer is named when it picks the "
    "template") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(FN_BINARY_DIR) / "test_tokenize_cli_damaged";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(fn::test::qwen3_json_path(), dir / "tokenizer.json");
  const std::string tk = "--tokenizer " + dir.string();
  for (const char* cfg : {"{\"model_type\": 5}", "{\"model_type\": \"qwen3\"", "[1]"}) {
    CAPTURE(cfg);
    std::ofstream(dir / "config.json") << cfg;
    CHECK(fngen(tk + " --chat -p hi").code == 3);  // was: exit 1, or qwen3.8 without a word
    CHECK(fngen(tk + " --chat --chat-template qwen3 -p hi").code == 0);  // not read then
    CHECK(fngen(tk + " -p hi").code == 0);                               // no template needed
  }
  std::ofstream(dir / "config.json") << "{\"model_type\": \"qwen3\"}";
  const Run r = fngen(tk + " --chat --no-think -p hi");
  CHECK(r.code == 0);
  CHECK(r.out == fngen(kModel + " --chat --no-think --chat-template qwen3 -p hi").out);
  fs::remove_all(dir);
}
