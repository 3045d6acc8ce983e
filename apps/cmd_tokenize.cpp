// `fngen tokenize`: text -> ids, ids -> text (--ids), ChatML prompts (--chat), JSON output
// (--json), JSONL batches (-i in.jsonl -o out.jsonl, one {"text"} or {"messages"} per line in,
// one {"ids"} or {"error"} per line out, in order) and a throughput benchmark (--bench).
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "apps/app_util.h"
#include "apps/command.h"
#include "core/error.h"
#include "core/eval.h"
#include "core/log.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace fn {
namespace {

using nlohmann::json;

struct TokenizeOptions {
  std::string model, tokenizer_file, prompt, file, ids, input, output, system_prompt, chat_mode;
  bool chat = false, think = false, no_think = false, json_out = false, plain = false,
       bench = false;
  bool ids_given = false;     ///< --ids was on the command line (perhaps with an empty list)
  bool prompt_given = false;  ///< -p was on the command line (perhaps with empty text)
};

ChatMode default_chat_mode(const TokenizeOptions& o) {
  if (!o.chat_mode.empty()) return parse_chat_mode(o.chat_mode);
  // -m DIR or --tokenizer DIR: a plain Qwen3 directory says so in its config.json.
  const std::string dir = !o.model.empty() ? o.model : o.tokenizer_file;
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec)) {
    const std::filesystem::path path = std::filesystem::path(dir) / "config.json";
    if (std::filesystem::exists(path, ec)) {
      // A damaged config.json would silently give the wrong template (qwen3.8 for a Qwen3
      // directory): an error naming it instead, as every other reader of config.json does.
      const json cfg = json::parse(read_regular_file(path, kMaxCheckpointJsonBytes, ""), nullptr,
                                   /*allow_exceptions=*/false);
      FN_REQUIRE(cfg.is_object() && (!cfg.contains("model_type") || cfg["model_type"].is_string()),
                 Format,
                 "{}: not a JSON object with a string model_type (it picks the default chat "
                 "template; fix it or give --chat-template)",
                 path.string());
      const std::string type = cfg.value("model_type", "");
      if (type.rfind("qwen3", 0) == 0) return ChatMode::Qwen3;
    }
  }
  return ChatMode::Qwen38;  // docs/design.md: the default for qwen4_exp models
}

ChatOptions chat_options(const TokenizeOptions& o) {
  ChatOptions c;
  c.mode = default_chat_mode(o);
  c.add_generation_prompt = true;
  if (o.think) c.enable_thinking = true;
  if (o.no_think) c.enable_thinking = false;
  return c;
}

std::vector<ChatMessage> prompt_messages(const TokenizeOptions& o, const std::string& text) {
  std::vector<ChatMessage> m;
  if (!o.system_prompt.empty()) m.push_back({"system", o.system_prompt, std::nullopt});
  m.push_back({"user", text, std::nullopt});
  return m;
}

std::string ids_line(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ' ';
    s += std::to_string(ids[i]);
  }
  return s + "\n";
}

// The -i batch's lines, read before the tokenizer loads (an empty file or a directory fails
// fast), after checking -o: it is truncated when the results are written, so it is never the
// input nor a file fngen reads (the tokenizer file, a file of the model or tokenizer directory).
std::vector<std::string> read_batch(const TokenizeOptions& o) {
  require_not_input(o.output, "-o/--output", o.input, "-i/--input");
  require_not_input(o.output, "-o/--output", o.tokenizer_file, "--tokenizer");
  if (!o.model.empty()) require_outside_model(o.output, o.model, "-o/--output");
  // --tokenizer DIR is guarded as -m DIR (its tokenizer_config.json, config.json are read);
  // --tokenizer FILE reads that file alone, guarded above.
  std::error_code ec;
  if (std::filesystem::is_directory(o.tokenizer_file, ec))
    require_outside_model(o.output, o.tokenizer_file, "-o/--output", "tokenizer directory");
  check_output_path(o.output, "-o/--output");  // a missing directory before the load
  return read_jsonl_lines(o.input, "-i/--input");
}

// One output record per non-blank input line, in order: {"id", "ids"} or {"id", "error"}.
int run_batch(const Tokenizer& tok, const TokenizeOptions& o,
              const std::vector<std::string>& lines) {
  std::ofstream file_out;
  if (!o.output.empty()) {
    file_out.open(o.output, std::ios::binary);
    FN_REQUIRE(file_out.good(), Io, "cannot open -o/--output {}", o.output);
  }
  std::ostream& out = o.output.empty() ? std::cout : file_out;
  // The chat options only when a record needs them (their default template may read config.json).
  std::optional<ChatOptions> chat;
  const auto copt = [&]() -> const ChatOptions& {
    if (!chat) chat = chat_options(o);
    return *chat;
  };
  const EncodeMode mode = o.plain ? EncodeMode::Plain : EncodeMode::Raw;
  size_t n = 0, errors = 0, tokens = 0;
  for (size_t li = 0; li < lines.size(); ++li) {
    const std::string& line = lines[li];
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank: no record
    ++n;
    json rec = {{"id", li + 1}};  // the record's own "id" when it has one, as generate -i
    try {
      const json j = parse_json_line(line);
      FN_REQUIRE(j.is_object(), Format, "the record is not a JSON object");
      if (j.contains("id")) rec["id"] = j["id"];
      FN_REQUIRE(j.contains("text") != j.contains("messages"), Format,
                 "the record needs exactly one of \"text\" or \"messages\"");
      std::vector<int32_t> ids;
      if (j.contains("messages")) {
        auto msgs = chat_messages_from_json(j["messages"]);
        if (!o.system_prompt.empty() && msgs.front().role != "system")  // as generate -i
          msgs.insert(msgs.begin(), ChatMessage{"system", o.system_prompt, std::nullopt});
        ids = encode_chat(tok, msgs, copt());
      } else {
        FN_REQUIRE(j["text"].is_string(), Format, "\"text\" must be a string, got {}",
                   j["text"].type_name());
        const auto& text = j["text"].get_ref<const std::string&>();
        ids = o.chat ? encode_chat(tok, prompt_messages(o, text), copt()) : tok.encode(text, mode);
      }
      tokens += ids.size();
      rec["ids"] = std::move(ids);
    } catch (const json::exception& e) {
      ++errors;
      rec["error"] = fmt::format("line {}: not valid JSON: {}", li + 1, e.what());
    } catch (const Error& e) {
      ++errors;
      rec["error"] = fmt::format("line {}: {}", li + 1, e.what());
    }
    out << rec.dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
  }
  out.flush();
  if (o.output.empty()) check_stdout();
  FN_REQUIRE(out.good(), Io, "cannot write -o/--output {}", o.output);
  FN_LOG_INFO("tokenize: {} record{}, {} token{}, {} with errors", n, n == 1 ? "" : "s", tokens,
              tokens == 1 ? "" : "s", errors);
  if (errors)
    FN_LOG_WARN("tokenize: {} of {} records had errors (see their \"error\" fields)", errors, n);
  FN_REQUIRE(n == 0 || errors < n, Format,
             "-i/--input {}: every record failed ({} of {}; see their \"error\" fields)", o.input,
             errors, n);
  return 0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// CPU seconds of this thread (the benchmark also prints these: the dev machine is shared).
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Wall and CPU seconds of f().
template <class F>
std::pair<double, double> timed(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = thread_cpu_seconds();
  f();
  return {seconds_since(t0), thread_cpu_seconds() - c0};
}

int run_bench(const Tokenizer& tok, const TokenizeOptions& o, const std::string& prose) {
  const double mb = static_cast<double>(prose.size()) / 1e6;
  size_t n_tokens = 0;
  const auto cold = timed([&] { n_tokens = tok.encode(prose).size(); });
  const auto warm = timed([&] { n_tokens = tok.encode(prose).size(); });
  // Line by line (dataset-style records).
  std::vector<std::string> lines;
  {
    std::istringstream ss(prose);
    for (std::string l; std::getline(ss, l);) lines.push_back(l);
  }
  const auto per_line = timed([&] {
    for (const auto& l : lines) tok.encode(l);
  });
  // Adversarial inputs: 1 MiB without whitespace, 1 MiB of one character, 1 MiB of one CJK
  // character.
  std::string nows;
  uint32_t x = 12345;
  const char* alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:-_";
  while (nows.size() < (1u << 20)) {
    x = x * 1664525u + 1013904223u;
    nows += alphabet[(x >> 16) % 68];
  }
  const std::string same(1u << 20, 'a');
  std::string cjk;
  while (cjk.size() < (1u << 20)) cjk += "\xE4\xB8\xAD";
  size_t n_nows = 0, n_same = 0, n_cjk = 0;
  const auto t_nows = timed([&] { n_nows = tok.encode(nows).size(); });
  const auto t_same = timed([&] { n_same = tok.encode(same).size(); });
  const auto t_cjk = timed([&] { n_cjk = tok.encode(cjk).size(); });
  if (o.json_out) {
    write_stdout(json{{"prose_bytes", prose.size()},
                      {"prose_tokens", n_tokens},
                      {"prose_mb_per_s_first", mb / cold.first},
                      {"prose_mb_per_s_second", mb / warm.first},
                      {"prose_mb_per_s_per_line", mb / per_line.first},
                      {"prose_mb_per_cpu_s_first", mb / cold.second},
                      {"no_whitespace_1mib_s", t_nows.first},
                      {"repeated_char_1mib_s", t_same.first},
                      {"repeated_cjk_1mib_s", t_cjk.first},
                      {"no_whitespace_1mib_cpu_s", t_nows.second},
                      {"repeated_char_1mib_cpu_s", t_same.second},
                      {"repeated_cjk_1mib_cpu_s", t_cjk.second}}
                     .dump(2) +
                 "\n");
  } else {
    write_stdout(fmt::format("prose {} ({:.2f} MB, {} tokens)\n", o.file, mb, n_tokens));
    write_stdout(fmt::format("  whole text, first pass: {:.1f} MB/s ({:.1f} MB per CPU second)\n",
                             mb / cold.first, mb / cold.second));
    write_stdout(fmt::format("  whole text, second pass: {:.1f} MB/s ({:.1f} MB per CPU second)\n",
                             mb / warm.first, mb / warm.second));
    write_stdout(fmt::format("  line by line ({} lines): {:.1f} MB/s ({:.1f} MB per CPU second)\n",
                             lines.size(), mb / per_line.first, mb / per_line.second));
    write_stdout(fmt::format("1 MiB without whitespace: {:.3f} s wall, {:.3f} s CPU ({} tokens)\n",
                             t_nows.first, t_nows.second, n_nows));
    write_stdout(fmt::format("1 MiB of 'a': {:.3f} s wall, {:.3f} s CPU ({} tokens)\n",
                             t_same.first, t_same.second, n_same));
    write_stdout(fmt::format("1 MiB of U+4E2D: {:.3f} s wall, {:.3f} s CPU ({} tokens)\n",
                             t_cjk.first, t_cjk.second, n_cjk));
  }
  return 0;
}

// The --ids list for parse_token_ids (as generate --prompt-ids): one enclosing [ ] (a JSON
// array) dropped.
std::string_view ids_without_brackets(std::string_view list) {
  const size_t first = list.find_first_not_of(" \t\r\n"), last = list.find_last_not_of(" \t\r\n");
  if (first != std::string_view::npos && list[first] == '[' && last > first && list[last] == ']')
    list = list.substr(first + 1, last - first - 1);
  return list;
}

int run_tokenize(const TokenizeOptions& o) {
  FN_REQUIRE(o.model.empty() != o.tokenizer_file.empty(), Usage,
             "give exactly one of -m/--model DIR and --tokenizer FILE or DIR");
  FN_REQUIRE(!(o.think && o.no_think), Usage, "--think and --no-think exclude each other");
  // Every combination is checked here, before the tokenizer loads (~1 s), so that a mistyped
  // command fails at once and never after a load.
  const std::string_view id_list = ids_without_brackets(o.ids);
  if (o.ids_given) {
    FN_REQUIRE(o.input.empty() && !o.bench, Usage,
               "--ids decodes ids: it takes no -i/--input or --bench");
    FN_REQUIRE(!o.prompt_given && o.file.empty() && !o.chat && !o.plain, Usage,
               "--ids decodes ids: it takes no -p/-f/--chat/--plain");
    FN_REQUIRE(o.system_prompt.empty() && !o.think && !o.no_think && o.chat_mode.empty(), Usage,
               "--ids decodes ids: it takes no chat option (--system-prompt, --think, "
               "--no-think, --chat-template)");
    FN_REQUIRE(id_list.find_first_not_of(" \t\r\n,") != std::string_view::npos, Usage,
               "--ids: no token ids given");
  }
  FN_REQUIRE(o.output.empty() || !o.input.empty(), Usage,
             "-o/--output needs -i/--input (batch mode)");
  FN_REQUIRE(o.input.empty() || (!o.prompt_given && o.file.empty() && !o.bench), Usage,
             "-i/--input holds the texts: give no -p/--prompt, -f/--file or --bench with it");
  FN_REQUIRE(o.input.empty() || !o.json_out, Usage,
             "-i/--input writes JSONL records whatever is asked: --json has no effect there");
  if (o.bench) {
    FN_REQUIRE(!o.file.empty(), Usage,
               "--bench needs -f/--file with English prose (scripts/tokenizer/bench.sh)");
    FN_REQUIRE(!o.prompt_given && !o.chat && !o.plain, Usage,
               "--bench times the plain encoding of -f/--file: it takes no -p/--chat/--plain");
  }
  FN_REQUIRE(!o.prompt_given || o.file.empty(), Usage, "give -p/--prompt or -f/--file, not both");
  FN_REQUIRE(!(o.chat && o.plain), Usage,
             "--plain has no effect with --chat (chat content is always encoded as plain text)");
  if (o.ids_given) (void)parse_token_ids(id_list, 0, "--ids");  // its syntax, now
  if (!o.model.empty()) require_model_dir(o.model);
  require_chat_prompt({.system_prompt = !o.system_prompt.empty(),
                       .think = o.think,
                       .no_think = o.no_think,
                       .chat_template = !o.chat_mode.empty()},
                      o.chat || !o.input.empty());
  require_utf8_system_prompt(o.system_prompt);
  const std::vector<std::string> batch =
      o.input.empty() ? std::vector<std::string>{} : read_batch(o);
  // The text to encode (or the --bench prose), read before the load as the batch is.
  std::string text;
  if (o.input.empty() && !o.ids_given) {
    if (o.prompt_given) {
      text = o.prompt;
    } else if (!o.file.empty()) {
      text = read_file(o.file, "-f/--file");
    } else {
      text = read_stdin();
    }
  }
  FN_REQUIRE(!o.bench || !text.empty(), Format, "-f/--file {}: no text to time (--bench)", o.file);
  const auto t0 = std::chrono::steady_clock::now();
  const auto tok =
      o.model.empty() ? load_tokenizer_file(o.tokenizer_file) : load_tokenizer(o.model);
  FN_LOG_DEBUG("tokenizer loaded in {:.3f} s ({} ids)", seconds_since(t0), tok->vocab_size());
  if (o.bench)
    return with_text_source("-f/--file " + o.file, [&] { return run_bench(*tok, o, text); });
  if (!o.input.empty()) return run_batch(*tok, o, batch);
  if (o.ids_given) {
    // Not empty: the list's syntax passed before the load, with a non-separator in it.
    const auto ids = parse_token_ids(id_list, tok->vocab_size(), "--ids");
    const std::string decoded = tok->decode(ids);
    write_stdout(
        o.json_out
            ? json{{"text", decoded}}.dump(-1, ' ', false, json::error_handler_t::replace) + "\n"
            : decoded);
    return 0;
  }
  std::vector<int32_t> ids;
  std::string rendered;
  const std::string source = o.prompt_given    ? "-p/--prompt"
                             : !o.file.empty() ? "-f/--file " + o.file
                                               : std::string("standard input");
  const ChatOptions copt =
      o.chat ? chat_options(o) : ChatOptions{};  // its errors are not the text's
  with_text_source(source, [&] {
    if (o.chat) {
      const auto msgs = prompt_messages(o, text);
      rendered = render_chat(msgs, copt);
      ids = encode_chat(*tok, msgs, copt);
    } else {
      ids = tok->encode(text, o.plain ? EncodeMode::Plain : EncodeMode::Raw);
    }
    return 0;
  });
  if (o.json_out) {
    json j{{"ids", ids}, {"n_tokens", ids.size()}};
    if (o.chat) j["text"] = rendered;
    json toks = json::array();
    for (int32_t id : ids) toks.push_back(tok->id_to_token(id));
    j["tokens"] = std::move(toks);
    write_stdout(j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n");
  } else {
    write_stdout(ids_line(ids));
  }
  return 0;
}

}  // namespace

void register_tokenize(CLI::App& app, CommandList& commands) {
  auto o = std::make_shared<TokenizeOptions>();
  CLI::App* sub = app.add_subcommand(
      "tokenize", "text -> token ids (or ids -> text with --ids); JSONL batches");
  // A path given as '' would read as "not given" (stdin, no batch): refused while parsing.
  const auto path = [](const std::string& s) { return s.empty() ? "an empty path" : ""; };
  sub->add_option("-m,--model", o->model, "model directory (tokenizer.json, else tokenizer.model)")
      ->check(path);
  sub->add_option("--tokenizer", o->tokenizer_file,
                  "a tokenizer.json or SentencePiece .model file (or a directory holding one)")
      ->check(path);
  CLI::Option* prompt =
      sub->add_option("-p,--prompt", o->prompt, "text to encode (default: stdin)");
  sub->add_option("-f,--file", o->file, "file whose text to encode (with --bench: English prose)")
      ->check(path);
  CLI::Option* ids = sub->add_option(
      "--ids", o->ids, "decode these ids (\"1 2 3\", \"1,2,3\" or \"[1,2,3]\") to text");
  sub->add_flag("--chat", o->chat, "wrap the text as a user turn of the chat template");
  sub->add_option("--system-prompt", o->system_prompt, "system turn for --chat");
  sub->add_flag("--think", o->think, "chat: thinking on (the default)");
  sub->add_flag("--no-think", o->no_think, "chat: thinking off (empty think block)");
  sub->add_option("--chat-template,--chat-mode", o->chat_mode,
                  "qwen3 | qwen3.8 (default: qwen3 for a config.json of model_type qwen3*, else "
                  "qwen3.8); --chat-mode is an older name")
      ->check(CLI::IsMember({"qwen3", "qwen3.8"}));
  sub->add_flag("--plain", o->plain, "special-token strings in the text are ordinary text");
  sub->add_flag("--json", o->json_out,
                "print JSON ({\"ids\", \"n_tokens\", \"tokens\"} or {\"text\"})");
  sub->add_option("-i,--input", o->input, "JSONL input: one {\"text\"} or {\"messages\"} per line")
      ->check(path);
  add_stdout_option(sub, "-o,--output", o->output, "JSONL output for -i: {\"ids\"} or {\"error\"}")
      ->check(path);
  sub->add_flag("--bench", o->bench, "benchmark: MB/s on -f prose, 1 MiB adversarial inputs");
  // Tokenizing needs no other rank: it runs without MPI_Init (under mpirun, on rank 0 only).
  Command c;
  c.app = sub;
  c.run_alone = [o, ids, prompt] {
    o->ids_given = ids->count() > 0;
    o->prompt_given = prompt->count() > 0;
    return run_tokenize(*o);
  };
  commands.push_back(std::move(c));
}

}  // namespace fn
