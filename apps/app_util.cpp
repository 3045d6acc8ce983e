#include "apps/app_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <system_error>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "core/paths.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace fn {

namespace {

// The whole stream, at most kMaxInputFileBytes; `name` ("-f/--file notes.txt", "standard input")
// names it in errors, `hint` follows the limit's message.
std::string read_capped(std::istream& in, const std::string& name, const char* hint) {
  std::string out;
  std::vector<char> buf(std::size_t{1} << 20);
  while (in.read(buf.data(), static_cast<std::streamsize>(buf.size())) || in.gcount() > 0) {
    // Checked before the append, so that a stream (/dev/zero) stops without growing `out` past
    // the limit.
    FN_REQUIRE(out.size() + static_cast<std::size_t>(in.gcount()) <= kMaxInputFileBytes, Io,
               "{}: larger than {} GiB ({})", name, kMaxInputFileBytes >> 30, hint);
    out.append(buf.data(), static_cast<std::size_t>(in.gcount()));
  }
  FN_REQUIRE(!in.bad(), Io, "{}: read failed ({})", name, std::strerror(errno));
  return out;
}

}  // namespace

std::string read_stdin() {
  return read_capped(std::cin, "standard input",
                     "standard input is read whole; is it the right input?");
}

std::string read_file(const std::string& path, const char* flag) {
  std::error_code ec;
  FN_REQUIRE(!std::filesystem::is_directory(path, ec), Io, "{} {}: is a directory, not a file",
             flag, path);
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  // std::ifstream sets errno from open(2) on glibc (not promised by the standard: then no reason).
  const int open_errno = errno;
  FN_REQUIRE(in.good(), Io, "{} {}: cannot open the file{}", flag, path,
             open_errno != 0 ? fmt::format(" ({})", std::strerror(open_errno)) : std::string());
  return read_capped(in, fmt::format("{} {}", flag, path),
                     "input files are read whole; is it the right file?");
}

void require_model_dir(const std::string& path) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(path, ec);
  // A symlink loop (ELOOP) or a path the process may not search, named as such.
  FN_REQUIRE(!ec, Io, "-m/--model {}: {}", path, ec.message());
  FN_REQUIRE(exists, Io, "-m/--model {}: no such directory", path);
  FN_REQUIRE(std::filesystem::is_directory(path, ec), Usage,
             "-m/--model {}: is a file; give the model directory (the one holding config.json and "
             "the safetensors files)",
             path);
}

namespace {

namespace fs = std::filesystem;

// True when `path` is `dir` or lies below it (both absolute and normalised).
bool is_within(const fs::path& path, const fs::path& dir) {
  const auto [d, p] = std::mismatch(dir.begin(), dir.end(), path.begin(), path.end());
  // A trailing separator of `dir` is an empty last element.
  return d == dir.end() || (std::next(d) == dir.end() && d->empty());
}

}  // namespace

bool same_file(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  if (a == b || resolve_output_path(a) == resolve_output_path(b)) return true;
  std::error_code ec;
  const bool eq = fs::equivalent(a, b, ec);  // both exist: one inode (a hard link)
  return !ec && eq;
}

void require_outside_model(const std::string& path, const std::string& model_dir, const char* flag,
                           const char* what) {
  if (path.empty()) return;
  std::error_code ec;
  const fs::path dir = fs::weakly_canonical(fs::absolute(model_dir, ec), ec);
  if (ec) return;  // require_model_dir names a missing directory
  const fs::path target = resolve_output_path(path);
  const std::string via = target.lexically_normal() == fs::absolute(path, ec).lexically_normal()
                              ? std::string()
                              : fmt::format(" (it resolves to {})", target.string());
  FN_REQUIRE(!is_within(target, dir), Usage,
             "{} {}: inside the {} {}{}; write it elsewhere (it could replace its own files)", flag,
             path, what, model_dir, via);
  // A hard link of a checkpoint file: another name of the same bytes.
  if (!fs::exists(target, ec)) return;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code eq_ec;
    const bool eq = fs::equivalent(it->path(), target, eq_ec);
    FN_REQUIRE(eq_ec || !eq, Usage,
               "{} {}: the same file as {} in the {} {} (a hard link); write it elsewhere (it "
               "would replace that file)",
               flag, path, it->path().filename().string(), what, model_dir);
  }
}

void require_chat_prompt(const ChatFlagsGiven& given, bool chat_prompt) {
  for (const auto& [on, flag] :
       {std::pair{given.system_prompt, "--system-prompt"}, std::pair{given.think, "--think"},
        std::pair{given.no_think, "--no-think"}, std::pair{given.chat_template, "--chat-template"}})
    FN_REQUIRE(!on || chat_prompt, Usage,
               "{} applies to chat prompts: add --chat (or give JSONL records with \"messages\" "
               "through -i/--input)",
               flag);
}

void require_utf8_system_prompt(const std::string& system_prompt) {
  unicode::require_valid_utf8(system_prompt, "--system-prompt");
}

void require_not_input(const std::string& out, const char* out_flag, const std::string& in,
                       const char* in_flag) {
  FN_REQUIRE(!same_file(out, in), Usage,
             "{} {} and {} {} name the same file: writing the results would destroy the input; "
             "give another output path",
             out_flag, out, in_flag, in);
}

void check_output_path(const std::string& path, const char* flag, bool staged_writer) {
  if (path.empty()) return;
  std::error_code ec;
  const fs::path target = resolve_output_path(path);
  // resolve_output_path stops on a loop (or a chain past kMaxLinkHops) at a link.
  FN_REQUIRE(!fs::is_symlink(fs::symlink_status(target, ec)), Io,
             "{} {}: cannot open for writing (a symlink loop at {})", flag, path, target.string());
  FN_REQUIRE(!fs::is_directory(target, ec), Io, "{} {}: is a directory, not a file", flag, path);
  const fs::path parent = target.parent_path();
  FN_REQUIRE(fs::is_directory(parent, ec), Io,
             "{} {}: cannot open for writing (no such directory {})", flag, path, parent.string());
  const fs::file_status st = fs::status(target, ec);
  const bool exists = fs::exists(st);
  const fs::path& what = exists ? target : parent;
  FN_REQUIRE(::access(what.c_str(), exists ? W_OK : W_OK | X_OK) == 0, Io,
             "{} {}: cannot open for writing ({}: {})", flag, path, what.string(),
             std::strerror(errno));
  // Staged: a regular file (or none yet) is replaced by a rename of the staging file beside it.
  // The staged writer (LogitsWriter) writes at offsets: a pipe, socket or terminal cannot take
  // that. Asked of `path` itself (the kernel follows /dev/stdout's /proc link to the pipe).
  if (staged_writer) {
    const fs::file_status own = fs::status(path, ec);
    bool seekable = !(fs::is_fifo(own) || fs::is_socket(own));
    if (seekable && fs::is_character_file(own)) {  // /dev/null seeks; a terminal does not
      const int dev = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
      seekable = dev < 0 || ::lseek(dev, 0, SEEK_CUR) >= 0;
      if (dev >= 0) ::close(dev);
    }
    FN_REQUIRE(seekable, Usage,
               "{} {}: is a pipe, socket or terminal, and the file is written at offsets: give "
               "a regular file",
               flag, path);
  }
  const bool staged = staged_writer && (!exists || fs::is_regular_file(st));
  if (staged) {
    // The writer's own routine creates a staging file beside the target (and it is removed
    // again): a directory that refuses it, or a name past NAME_MAX once the staging suffix is
    // added, fails here.
    StagingFile probe;
    try {
      probe = create_staging_file(target);
    } catch (const Error& e) {
      FN_THROW(Io, "{} {}: {}", flag, path, e.what());
    }
    ::close(probe.fd);
    ::unlink(probe.path.c_str());
    return;
  }
  if (exists) return;
  // A writable directory can still refuse the name (/proc, a file name too long, a read-only
  // mount that access() lets root pass): create the file and remove it again. O_EXCL: only a
  // file this call created is removed; one that appeared meanwhile is left alone.
  const int fd = ::open(target.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  const int err = errno;
  if (fd < 0 && err == EEXIST) return;
  FN_REQUIRE(fd >= 0, Io, "{} {}: cannot create the file ({}: {})", flag, path, target.string(),
             std::strerror(err));
  ::close(fd);
  ::unlink(target.c_str());
}

std::vector<std::string> read_jsonl_lines(const std::string& path, const char* flag) {
  std::istringstream in(read_file(path, flag));
  std::vector<std::string> lines;
  bool any = false;
  for (std::string line; std::getline(in, line);) {
    any = any || line.find_first_not_of(" \t\r") != std::string::npos;
    lines.push_back(std::move(line));
  }
  FN_REQUIRE(any, Format, "{} {}: no records (the file has no non-blank line)", flag, path);
  return lines;
}

void write_stdout(std::string_view s) {
  const bool ok =
      std::fwrite(s.data(), 1, s.size(), stdout) == s.size() && std::fflush(stdout) == 0;
  FN_REQUIRE(ok, Io, "cannot write to standard output ({})", std::strerror(errno));
}

void write_jsonl_line_agreed(Collectives& coll, std::FILE* out,
                             const std::function<std::string()>& make, const std::string& path) {
  agree_on_error(coll, [&] {
    if (coll.rank() != 0) return;
    const std::string s = make();
    if (out == stdout) return write_stdout(s);
    const bool ok = std::fwrite(s.data(), 1, s.size(), out) == s.size() && std::fflush(out) == 0;
    FN_REQUIRE(ok, Io, "-o/--output {}: cannot write ({})", path, std::strerror(errno));
  });
}

void check_stdout() {
  std::cout.flush();
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  FN_REQUIRE(flushed && std::ferror(stdout) == 0 && !std::cout.fail(), Io,
             "cannot write to standard output{}",
             flushed ? std::string() : fmt::format(" ({})", std::strerror(err)));
}

void warn_unknown_record_fields(const nlohmann::json& rec,
                                const std::function<bool(const std::string&)>& reads,
                                std::set<std::string>& warned, const std::string& input,
                                std::size_t line, std::string_view command) {
  for (const auto& [key, value] : rec.items()) {
    if (reads(key) || !warned.insert(key).second) continue;
    FN_LOG_WARN(
        "{}: line {}: field \"{}\" is not one fngen {} reads; ignored (said once per field name)",
        input, line, key, command);
  }
  if (!rec.contains("messages")) return;
  for (const auto& [key, i] : unknown_chat_message_fields(rec["messages"])) {
    if (!warned.insert("messages[]." + key).second) continue;
    FN_LOG_WARN(
        "{}: line {}: field \"{}\" of \"messages\"[{}] is not one fngen {} reads; ignored "
        "(said once per field name)",
        input, line, key, i, command);
  }
}

nlohmann::json parse_json_line(const std::string& line) {
  using Event = nlohmann::json::parse_event_t;
  // Refused while parsing (the parser keeps its own stack): writing a record's value back (an
  // "id" is echoed) recurses once per level, and 100,000 levels overflowed the stack. A key
  // given twice in one object is refused too (the parser would keep its last value silently):
  // `keys` holds the keys seen so far in each object open at this point, the innermost last.
  std::vector<std::unordered_set<std::string>> keys;
  const nlohmann::json::parser_callback_t guard = [&keys](int depth, Event event,
                                                          nlohmann::json& parsed) {
    FN_REQUIRE(depth <= kMaxJsonDepth, Format, "a value nested deeper than {} levels",
               kMaxJsonDepth);
    if (event == Event::object_start) {
      keys.emplace_back();
    } else if (event == Event::object_end) {
      keys.pop_back();
    } else if (event == Event::key) {
      FN_REQUIRE(keys.back().insert(parsed.get<std::string>()).second, Format,
                 "duplicate key {} (each key may appear once in an object)",
                 parsed.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    }
    return true;
  };
  try {
    return nlohmann::json::parse(line, guard);
  } catch (const nlohmann::json::parse_error& e) {
    // The parser quotes the bytes it read last, which may be invalid UTF-8 (then U+FFFD here).
    FN_THROW(Format, "not valid JSON ({})", unicode::utf8_lossy(e.what()));
  } catch (const nlohmann::json::exception& e) {
    // Valid JSON the parser cannot hold, e.g. a number past a double ("1e400").
    FN_THROW(Format, "a JSON value fngen cannot read ({})", unicode::utf8_lossy(e.what()));
  }
}

void check_backend_and_tp(const std::string& backend, int64_t tp, int world_size) {
  FN_REQUIRE(backend == "cpu" || backend == "cuda" || backend == "auto", Usage,
             "--backend {}: not one of cpu, cuda, auto", backend);
  FN_REQUIRE(tp == 0 || tp == world_size, Usage,
             "--tp {} must equal the number of MPI ranks ({}): the TP size is the world size", tp,
             world_size);
}

void check_model_source(const std::string& model, bool random_weights, const std::string& config) {
  FN_REQUIRE(config.empty() || random_weights, Usage,
             "--config applies to --random-weights only (-m/--model reads DIR/config.json)");
  FN_REQUIRE(model.empty() != !random_weights, Usage,
             "give either -m/--model DIR or --random-weights --config FILE{}",
             random_weights ? " (not both)" : "");
  FN_REQUIRE(!random_weights || !config.empty(), Usage,
             "--random-weights needs --config FILE (a config.json with its quantization_config, "
             "e.g. configs/qwen3.8-flash-next.json)");
  std::error_code ec;
  FN_REQUIRE(config.empty() || !std::filesystem::is_directory(config, ec), Usage,
             "--config {} is a directory; give the config.json file itself (e.g. "
             "configs/qwen3.8-flash-next.json)",
             config);
}

bool has_tokenizer(const std::filesystem::path& dir) {
  return std::filesystem::exists(dir / "tokenizer.json") ||
         std::filesystem::exists(dir / "tokenizer.model");
}

std::string tokenizer_source(const std::filesystem::path& dir) {
  return dir.empty() ? std::string("--random-weights without --tokenizer DIR")
                     : "the model directory " + dir.string();
}

namespace {
constexpr int64_t kPrefixBytesPerToken = 32;
constexpr int64_t kCutSlack = 16;
}  // namespace

void refuse_long_text(const Tokenizer& tok, std::string_view text, int64_t limit,
                      const std::string& what, const std::string& limit_name) {
  const auto bytes = static_cast<std::size_t>(kPrefixBytesPerToken * limit);
  if (text.size() <= bytes) return;
  std::size_t cut = bytes;
  while (cut > bytes / 2 && text[cut - 1] != ' ' && text[cut - 1] != '\n') --cut;
  if (cut <= bytes / 2) return;
  const std::size_t n = with_text_source(
      what, [&] { return tok.encode(text.substr(0, cut), EncodeMode::Raw).size(); });
  FN_REQUIRE(static_cast<int64_t>(n) <= limit + kCutSlack, Format,
             "{}: the prompt ({} bytes) exceeds {}: its first {} bytes alone encode to {} tokens, "
             "more than {}",
             what, text.size(), limit_name, cut, n, limit);
}

}  // namespace fn
