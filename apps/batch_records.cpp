// The record side of batch generation (see batch_records.h).
#include "apps/batch_records.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "core/row_stats.h"
#include "tokenizer/unicode.h"

namespace fn {

using nlohmann::json;

uint64_t record_seed(uint64_t base, uint64_t line) noexcept {
  return splitmix64(base ^ line);
}

uint64_t sample_seed(uint64_t seed, int64_t sample_index) noexcept {
  return sample_index == 0 ? seed : splitmix64(seed ^ static_cast<uint64_t>(sample_index));
}

namespace {

bool reads(const std::set<std::string>* fields, const char* name) {
  return fields == nullptr || fields->count(name) > 0;
}

// The member `name` when present and not null.
const json* field(const json& rec, const char* name) {
  const auto it = rec.find(name);
  return it == rec.end() || it->is_null() ? nullptr : &*it;
}

double real_field(const json& v, const char* name, const char* rule) {
  FN_REQUIRE(v.is_number(), Format, "\"{}\" must be a number {}, got {}", name, rule, v.dump());
  return v.get<double>();
}

int64_t whole_field(const json& v, const char* name, const char* rule) {
  FN_REQUIRE(v.is_number_integer() &&
                 !(v.is_number_unsigned() &&
                   v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())),
             Format, "\"{}\" must be an integer {}, got {}", name, rule, v.dump());
  return v.get<int64_t>();
}

}  // namespace

bool is_generate_record_field(std::string_view name) noexcept {
  for (const std::string_view f : kGenerateRecordFields)
    if (f == name) return true;
  return false;
}

RecordSettings record_settings(const json& rec, const RecordSettings& defaults,
                               const std::set<std::string>* fields) {
  RecordSettings s = defaults;
  if (!rec.is_object()) return s;
  SamplingParams& p = s.sampling;
  if (const json* v = field(rec, "seed"); v && reads(fields, "seed")) {
    FN_REQUIRE(v->is_number_unsigned() || (v->is_number_integer() && v->get<int64_t>() >= 0),
               Format, "\"seed\" must be an integer in [0, 18446744073709551615], got {}",
               v->dump());
    p.seed = v->get<uint64_t>();
    s.seed_given = true;
  }
  if (const json* v = field(rec, "temperature"); v && reads(fields, "temperature")) {
    p.temperature = real_field(*v, "temperature", ">= 0 (0 = greedy)");
    FN_REQUIRE(std::isfinite(p.temperature) && p.temperature >= 0, Format,
               "\"temperature\" must be a number >= 0 (0 = greedy), got {}", v->dump());
  }
  if (const json* v = field(rec, "top_k"); v && reads(fields, "top_k")) {
    p.top_k = whole_field(*v, "top_k", ">= 0 (0 = off)");
    FN_REQUIRE(p.top_k >= 0, Format, "\"top_k\" must be an integer >= 0 (0 = off), got {}",
               v->dump());
  }
  if (const json* v = field(rec, "top_p"); v && reads(fields, "top_p")) {
    p.top_p = real_field(*v, "top_p", "in (0, 1]");
    FN_REQUIRE(p.top_p > 0 && p.top_p <= 1, Format, "\"top_p\" must be a number in (0, 1], got {}",
               v->dump());
  }
  if (const json* v = field(rec, "min_p"); v && reads(fields, "min_p")) {
    p.min_p = real_field(*v, "min_p", "in [0, 1]");
    FN_REQUIRE(p.min_p >= 0 && p.min_p <= 1, Format, "\"min_p\" must be a number in [0, 1], got {}",
               v->dump());
  }
  if (const json* v = field(rec, "repeat_penalty"); v && reads(fields, "repeat_penalty")) {
    p.repetition_penalty = real_field(*v, "repeat_penalty", "> 0 (1 = off)");
    FN_REQUIRE(std::isfinite(p.repetition_penalty) && p.repetition_penalty > 0, Format,
               "\"repeat_penalty\" must be a number > 0 (1 = off), got {}", v->dump());
  }
  if (const json* v = field(rec, "presence_penalty"); v && reads(fields, "presence_penalty")) {
    p.presence_penalty = real_field(*v, "presence_penalty", "(finite)");
    FN_REQUIRE(std::isfinite(p.presence_penalty), Format,
               "\"presence_penalty\" must be a finite number, got {}", v->dump());
  }
  if (const json* v = field(rec, "frequency_penalty"); v && reads(fields, "frequency_penalty")) {
    p.frequency_penalty = real_field(*v, "frequency_penalty", "(finite)");
    FN_REQUIRE(std::isfinite(p.frequency_penalty), Format,
               "\"frequency_penalty\" must be a finite number, got {}", v->dump());
  }
  if (const json* v = field(rec, "max_tokens"); v && reads(fields, "max_tokens")) {
    s.max_new_tokens = whole_field(*v, "max_tokens", ">= 1, or -1 (until the context is full)");
    FN_REQUIRE(s.max_new_tokens >= 1 || s.max_new_tokens == -1, Format,
               "\"max_tokens\" must be an integer >= 1, or -1 (until the context is full), got {}",
               v->dump());
  }
  if (const json* v = field(rec, "stop"); v && reads(fields, "stop")) {
    FN_REQUIRE(v->is_string() || v->is_array(), Format,
               "\"stop\" must be a string or a list of strings, got {}", v->dump());
    s.stop.clear();
    const json list = v->is_string() ? json::array({*v}) : *v;
    for (std::size_t i = 0; i < list.size(); ++i) {
      FN_REQUIRE(list[i].is_string(), Format, "\"stop\"[{}] must be a string, got {}", i,
                 list[i].dump());
      std::string text = list[i].get<std::string>();
      FN_REQUIRE(!text.empty(), Format, "\"stop\": an empty stop string would stop at once");
      const std::size_t bad = unicode::find_invalid_utf8(text);
      FN_REQUIRE(bad == std::string::npos, Format,
                 "\"stop\": invalid UTF-8 at byte offset {}; the generated text it is matched "
                 "against is valid UTF-8, so it could never match",
                 bad);
      s.stop.push_back(std::move(text));
    }
  }
  if (const json* v = field(rec, "logprobs"); v && reads(fields, "logprobs")) {
    static_assert(kMaxTopLogprobs == 20, "the rule below names the range");
    s.top_logprobs = whole_field(*v, "logprobs", "in [0, 20]");
    FN_REQUIRE(s.top_logprobs >= 0 && s.top_logprobs <= kMaxTopLogprobs, Format,
               "\"logprobs\" must be an integer in [0, {}], got {}", kMaxTopLogprobs, v->dump());
  }
  if (const json* v = field(rec, "n"); v && reads(fields, "n")) {
    s.n = whole_field(*v, "n", fmt::format("in [1, {}]", kMaxSamplesPerRecord).c_str());
    FN_REQUIRE(s.n >= 1 && s.n <= kMaxSamplesPerRecord, Format,
               "\"n\" must be an integer in [1, {}], got {}", kMaxSamplesPerRecord, v->dump());
  }
  validate_sampling_params(p);  // the flags' own rules; each was checked above with its name
  return s;
}

namespace {

// JSON text scanning over one valid object (member_text): positions only, no validation.
std::size_t skip_ws(std::string_view s, std::size_t i) {
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
  return i;
}

std::size_t skip_string(std::string_view s, std::size_t i) {  // s[i] == '"'
  for (++i; i < s.size() && s[i] != '"'; ++i)
    if (s[i] == '\\') ++i;
  return i + 1;
}

std::size_t skip_value(std::string_view s, std::size_t i) {
  if (i >= s.size()) return i;
  if (s[i] == '"') return skip_string(s, i);
  if (s[i] == '{' || s[i] == '[') {
    int depth = 0;
    while (i < s.size()) {
      const char c = s[i];
      if (c == '"') {
        i = skip_string(s, i);
        continue;
      }
      if (c == '{' || c == '[') ++depth;
      if (c == '}' || c == ']') {
        if (--depth == 0) return i + 1;
      }
      ++i;
    }
    return i;
  }
  while (i < s.size() && s[i] != ',' && s[i] != '}' && s[i] != ']' && s[i] != ' ' && s[i] != '\t' &&
         s[i] != '\n' && s[i] != '\r')
    ++i;
  return i;
}

}  // namespace

std::optional<std::string> member_text(std::string_view line, std::string_view key) {
  std::optional<std::string> found;
  // A UTF-8 byte-order mark before the object, which the JSON parser skips too (an editor on
  // Windows writes one at the start of a file; concatenated files carry it mid-file).
  const std::size_t bom = line.rfind("\xEF\xBB\xBF", 0) == 0 ? 3 : 0;
  std::size_t i = skip_ws(line, bom);
  if (i >= line.size() || line[i] != '{') return found;
  i = skip_ws(line, i + 1);
  while (i < line.size() && line[i] == '"') {
    const std::size_t k0 = i;
    i = skip_string(line, i);
    const std::string_view raw_key = line.substr(k0, i - k0);
    bool match = raw_key.size() == key.size() + 2 && raw_key.substr(1, key.size()) == key;
    if (!match && raw_key.find('\\') != std::string_view::npos) {
      try {
        match = json::parse(raw_key).get<std::string>() == key;
      } catch (const json::exception&) {
        match = false;
      }
    }
    i = skip_ws(line, i);
    if (i >= line.size() || line[i] != ':') break;
    i = skip_ws(line, i + 1);
    const std::size_t v0 = i;
    i = skip_value(line, i);
    if (match) found = std::string(line.substr(v0, i - v0));
    i = skip_ws(line, i);
    if (i >= line.size() || line[i] != ',') break;
    i = skip_ws(line, i + 1);
  }
  return found;
}

std::string record_id_text(std::string_view line, int64_t line_number) {
  std::optional<std::string> t = member_text(line, "id");
  return t ? *t : std::to_string(line_number);
}

std::string record_line(const std::string& id_text, const json& body) {
  const std::string rest = body.dump(-1, ' ', false, json::error_handler_t::replace);
  // rest is "{}" or "{...}": the id goes first.
  std::string s = "{\"id\":" + id_text;
  if (rest.size() > 2) s += ",";
  s.append(rest, 1, std::string::npos);
  s += "\n";
  return s;
}

std::string sample_key(const std::string& id_text, int64_t sample_index) {
  return id_text + "\t" + std::to_string(sample_index);
}

ResumeScan scan_resume_output(const std::string& path, const char* flag) {
  namespace fs = std::filesystem;
  ResumeScan scan;
  std::error_code ec;
  if (!fs::exists(path, ec)) return scan;
  std::ifstream in(path, std::ios::binary);
  FN_REQUIRE(in.good(), Io, "{} {}: cannot open the file to resume ({})", flag, path,
             std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const std::size_t end = text.rfind('\n');
  const std::size_t keep = end == std::string::npos ? 0 : end + 1;
  if (keep < text.size()) {
    scan.cut_bytes = text.size() - keep;
    if (fs::is_regular_file(path, ec)) {
      fs::resize_file(path, keep, ec);
      FN_REQUIRE(!ec, Io, "{} {}: cannot cut off its partial last line ({})", flag, path,
                 ec.message());
    }
  }
  std::size_t pos = 0;
  int64_t line_no = 0;
  while (pos < keep) {
    const std::size_t nl = text.find('\n', pos);
    const std::string_view line(text.data() + pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    json rec;
    try {
      rec = json::parse(line);
    } catch (const json::exception&) {
      FN_THROW(Format, "{} {}: line {} is not an output record of fngen generate (not JSON)", flag,
               path, line_no);
    }
    const std::optional<std::string> id = member_text(line, "id");
    FN_REQUIRE(rec.is_object() && id, Format,
               "{} {}: line {} is not an output record of fngen generate (no \"id\")", flag, path,
               line_no);
    ++scan.records;
    const auto fr = rec.find("finish_reason");
    if (fr != rec.end() && fr->is_string() && *fr == "error") {
      scan.error_ids.insert(*id);
      continue;
    }
    const auto si = rec.find("sample_index");
    const int64_t s = si != rec.end() && si->is_number_integer() ? si->get<int64_t>() : 0;
    scan.done.insert(sample_key(*id, s));
  }
  return scan;
}

OrderedWriter::OrderedWriter(std::function<void(const std::string&)> write)
    : write_(std::move(write)) {}

void OrderedWriter::put(int64_t seq, std::string line) {
  FN_CHECK(seq >= next_ && held_.count(seq) == 0, "OrderedWriter: sequence number {} put twice",
           seq);
  held_.emplace(seq, std::move(line));
  for (auto it = held_.begin(); it != held_.end() && it->first == next_; it = held_.begin()) {
    const std::string ready = std::move(it->second);
    held_.erase(it);
    ++next_;
    if (!ready.empty()) write_(ready);
  }
}

void write_line(std::FILE* out, const std::string& line, const std::string& path,
                const char* flag) {
  const bool ok =
      std::fwrite(line.data(), 1, line.size(), out) == line.size() && std::fflush(out) == 0;
  if (out == stdout) {
    FN_REQUIRE(ok, Io, "cannot write to standard output ({})", std::strerror(errno));
  }
  FN_REQUIRE(ok, Io, "{} {}: cannot write ({})", flag, path, std::strerror(errno));
}

std::string format_batch_progress(int64_t done, int64_t total, int64_t tokens, double seconds) {
  const double pct =
      total > 0 ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0;
  std::string s =
      fmt::format("records {} / {} ({:.0f} %), {} tokens", done, total, std::floor(pct), tokens);
  if (seconds > 0 && done > 0) {
    s += fmt::format(", {:.1f} tok/s", static_cast<double>(tokens) / seconds);
    if (done >= total) {
      s += ", done";
    } else {
      const double per_record = seconds / static_cast<double>(done);
      s += fmt::format(", ETA {:.0f} s", per_record * static_cast<double>(total - done));
    }
  }
  return s;
}

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

BatchProgress::BatchProgress(int64_t total, bool enabled, std::FILE* out)
    : total_(total), enabled_(enabled), out_(out ? out : stderr), start_(now_s()) {}

double BatchProgress::seconds() const {
  return now_s() - start_;
}

void BatchProgress::add(int64_t tokens) {
  ++done_;
  tokens_ += tokens;
  if (!enabled_) return;
  const double t = now_s();
  if (last_draw_ >= 0 && t - last_draw_ < 0.2 && done_ < total_) return;
  last_draw_ = t;
  const std::string text = format_batch_progress(done_, total_, tokens_, t - start_);
  std::fprintf(out_, "\r\033[K%s", text.c_str());
  std::fflush(out_);
  drawn_ = true;
}

void BatchProgress::clear() {
  if (!enabled_ || !drawn_) return;
  std::fprintf(out_, "\r\033[K");
  std::fflush(out_);
  drawn_ = false;
}

std::FILE* open_output_locked(const std::string& path, bool truncate, const char* flag) {
  // Locked for the run (flock, released at exit): a second run on the same file (a rerun while
  // ranks of a killed launcher still write) is refused before it truncates or appends.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  FN_REQUIRE(fd >= 0, Io, "{} {}: cannot open for writing ({})", flag, path, std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    FN_THROW(Io,
             "{} {}: another process is writing it ({}): a run still going, e.g. the ranks of a "
             "killed mpirun; let it end (or stop it) before rerunning, or give another {}",
             flag, path, std::strerror(err), flag);
  }
  // Truncated only when it is a regular file (a device such as /dev/null takes no truncation, as
  // fopen's "w" ignores it there).
  struct stat st {};
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  if (truncate && regular && ::ftruncate(fd, 0) != 0) {
    const int err = errno;
    ::close(fd);
    FN_THROW(Io, "{} {}: cannot truncate ({})", flag, path, std::strerror(err));
  }
  std::FILE* out = ::fdopen(fd, "ab");
  if (out == nullptr) {
    const int err = errno;
    ::close(fd);
    FN_THROW(Io, "{} {}: cannot open for writing ({})", flag, path, std::strerror(err));
  }
  return out;
}

}  // namespace fn
