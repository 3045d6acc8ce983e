// fngen eval: perplexity windows, KL-divergence statistics, reference-logits file (core/eval.h).
#include "core/eval.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/codecs.h"
#include "core/collectives.h"
#include "core/error.h"
#include "core/log.h"
#include "core/paths.h"

namespace fn {

using nlohmann::json;
namespace fs = std::filesystem;

uint64_t fnv1a64(std::string_view bytes) noexcept {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : bytes) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string tokenizer_id(const fs::path& model_dir) {
  for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
    const fs::path p = model_dir / name;
    if (!fs::exists(p)) continue;
    const std::string bytes = read_regular_file(p, kMaxTokenizerFileBytes, "tokenizer file");
    return fmt::format("fnv1a64:{}:{:016x}", name, fnv1a64(bytes));
  }
  return "ids-only";
}

std::vector<int32_t> parse_token_ids(std::string_view text, int64_t vocab_size,
                                     const std::string& what, ErrorKind kind) {
  // The error of `kind` (called only on a bad item: the message is formatted then).
  const auto fail = [&](std::string message) {
    detail::throw_error(kind, __FILE__, __LINE__, std::move(message));
  };
  std::vector<int32_t> ids;
  const auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  std::size_t i = 0;
  bool need_item = false;  // after a comma: an empty item ("1,,2", "1,") is an error
  for (;;) {
    while (i < text.size() && is_space(text[i])) ++i;
    if (i >= text.size() || text[i] == ',') {
      if (need_item || (i < text.size() && ids.empty()))
        fail(fmt::format("{}: empty item {} (ids are separated by one comma or by whitespace)",
                         what, ids.size() + 1));
      if (i >= text.size()) break;
      ++i;  // the comma
      need_item = true;
      continue;
    }
    std::size_t j = i;
    while (j < text.size() && !is_space(text[j]) && text[j] != ',') ++j;
    const std::string_view item = text.substr(i, j - i);
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    const bool whole = end == item.data() + item.size();
    const bool too_long = whole && ec == std::errc::result_out_of_range;
    if (!whole || (ec != std::errc() && !too_long))
      fail(fmt::format("{}: item {} \"{}\" is not an integer", what, ids.size() + 1, item));
    if (too_long ? item.front() == '-' : v < 0)
      fail(fmt::format("{}: item {} = {} is negative (token ids are 0 or more)", what,
                       ids.size() + 1, item));
    const bool syntax_only = vocab_size == 0;
    if (!syntax_only && (too_long || v >= vocab_size))
      fail(fmt::format("{}: item {} = {} is outside the vocabulary [0, {})", what, ids.size() + 1,
                       item, vocab_size));
    ids.push_back(syntax_only && (too_long || v > std::numeric_limits<int32_t>::max())
                      ? 0
                      : static_cast<int32_t>(v));
    need_item = false;
    i = j;
  }
  return ids;
}

// ---------------------------------------------------------------- per-row math

void log_softmax(std::span<const float> logits, std::vector<double>& out) {
  FN_CHECK(!logits.empty(), "log_softmax of an empty row");
  double mx = logits[0];
  for (const float v : logits) mx = std::max(mx, static_cast<double>(v));
  double sum = 0.0;
  for (const float v : logits) sum += std::exp(static_cast<double>(v) - mx);
  const double lse = mx + std::log(sum);
  out.resize(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
}

double token_nll(std::span<const float> logits, int32_t target) {
  FN_CHECK(target >= 0 && static_cast<std::size_t>(target) < logits.size(),
           "target {} outside the row of {}", target, logits.size());
  double mx = logits[0];
  for (const float v : logits) mx = std::max(mx, static_cast<double>(v));
  double sum = 0.0;
  for (const float v : logits) sum += std::exp(static_cast<double>(v) - mx);
  return mx + std::log(sum) - static_cast<double>(logits[static_cast<std::size_t>(target)]);
}

int64_t argmax(std::span<const float> values) noexcept {
  int64_t best = 0;
  for (std::size_t i = 1; i < values.size(); ++i)
    if (values[i] > values[static_cast<std::size_t>(best)]) best = static_cast<int64_t>(i);
  return best;
}

MeanErr mean_and_uncertainty(double sum, double sum2, int64_t count) noexcept {
  if (count < 1) return {};
  const double n = static_cast<double>(count);
  const double f = sum / n;
  double df = sum2 / n - f * f;
  df = (df > 0 && count > 10) ? std::sqrt(df / (n - 1)) : 0.0;
  return {f, df};
}

double percentile(std::span<const double> sorted, double q) {
  FN_CHECK(!sorted.empty(), "percentile of no values");
  if (q <= 0) return sorted.front();
  if (q >= 1) return sorted.back();
  const double h = q * static_cast<double>(sorted.size() - 1);
  const std::size_t i = static_cast<std::size_t>(h);
  const double frac = h - static_cast<double>(i);
  const std::size_t j = std::min(i + 1, sorted.size() - 1);
  return sorted[i] + frac * (sorted[j] - sorted[i]);
}

// ---------------------------------------------------------------- perplexity

double PerplexityResult::ppl() const {
  return count > 0 ? std::exp(sum_nll / static_cast<double>(count)) : 0.0;
}

double PerplexityResult::ppl_err() const {
  if (count < 2) return 0.0;
  const double n = static_cast<double>(count);
  const double mean = sum_nll / n;
  const double var = sum_nll2 / n - mean * mean;
  return var > 0 ? ppl() * std::sqrt(var / (n - 1)) : 0.0;
}

namespace {

int64_t chunk_count(std::size_t n_tokens, int64_t n_ctx, int64_t max_chunks) {
  FN_REQUIRE(n_ctx >= 4, Usage, "-c/--ctx-size must be >= 4 for perplexity windows, got {}", n_ctx);
  FN_REQUIRE(static_cast<int64_t>(n_tokens) >= n_ctx, Usage,
             "the text has {} token{}, fewer than one window of -c/--ctx-size {}; use a smaller "
             "-c or a longer text",
             n_tokens, n_tokens == 1 ? "" : "s", n_ctx);
  const int64_t max_possible = static_cast<int64_t>(n_tokens) / n_ctx;
  return max_chunks > 0 ? std::min(max_chunks, max_possible) : max_possible;
}

}  // namespace

std::vector<LogitsSequence> perplexity_sequences(std::span<const int32_t> tokens, int64_t n_ctx,
                                                 int64_t max_chunks) {
  const int64_t n_chunks = chunk_count(tokens.size(), n_ctx, max_chunks);
  std::vector<LogitsSequence> seqs;
  for (int64_t c = 0; c < n_chunks; ++c) {
    LogitsSequence s;
    s.tokens.assign(tokens.begin() + c * n_ctx, tokens.begin() + (c + 1) * n_ctx);
    s.first = n_ctx / 2;
    s.n_rows = n_ctx - 1 - s.first;
    seqs.push_back(std::move(s));
  }
  return seqs;
}

namespace {

// Rows per prefill_rows call when full rows come back (bounds the host copy to about 127 MB at
// the real vocabulary); without full rows a sequence is one call.
constexpr int64_t kKeptRowsPerCall = 128;

}  // namespace

void sequence_rows(Backend& backend, const LogitsSequence& s, std::span<const int32_t> gather,
                   int64_t gather_k, bool keep_logits,
                   const std::function<void(const RowResults&, int64_t)>& on_rows) {
  const int64_t end = s.first + s.n_rows;
  FN_CHECK(s.first >= 0 && s.n_rows >= 1 && end <= static_cast<int64_t>(s.tokens.size()),
           "sequence rows {}..{} outside its {} tokens", s.first, end - 1, s.tokens.size());
  FN_CHECK(static_cast<int64_t>(gather.size()) == s.n_rows * gather_k,
           "{} gathered ids for {} rows of {}", gather.size(), s.n_rows, gather_k);
  std::vector<int32_t> targets;
  backend.reset();
  const int64_t step = keep_logits ? kKeptRowsPerCall : s.n_rows;
  int64_t fed = 0;  // tokens fed so far
  for (int64_t r0 = 0; r0 < s.n_rows; r0 += step) {
    const int64_t rows = std::min(step, s.n_rows - r0);
    const int64_t p_end = s.first + r0 + rows;  // feed tokens [fed, p_end)
    targets.resize(static_cast<std::size_t>(rows));
    for (int64_t r = 0; r < rows; ++r)
      targets[static_cast<std::size_t>(r)] = s.target(s.first + r0 + r);
    RowQuery q;
    q.first = s.first + r0 - fed;
    q.targets = targets;
    q.gather = gather.subspan(static_cast<std::size_t>(r0 * gather_k),
                              static_cast<std::size_t>(rows * gather_k));
    q.gather_k = gather_k;
    q.keep_logits = keep_logits;
    const RowResults res = backend.prefill_rows(
        std::span<const int32_t>(s.tokens).subspan(static_cast<std::size_t>(fed),
                                                   static_cast<std::size_t>(p_end - fed)),
        q);
    fed = p_end;
    on_rows(res, r0);
  }
}

PerplexityResult perplexity(Backend& backend, std::span<const int32_t> tokens, int64_t n_ctx,
                            int64_t max_chunks,
                            const std::function<void(int64_t, const PerplexityResult&)>& on_chunk,
                            LogitsWriter* save, bool keep_rows) {
  const std::vector<LogitsSequence> seqs = perplexity_sequences(tokens, n_ctx, max_chunks);
  PerplexityResult r;
  r.n_ctx = n_ctx;
  r.n_chunks = static_cast<int64_t>(seqs.size());
  r.n_tokens = static_cast<int64_t>(tokens.size());
  // Every rank keeps full rows when rank 0 saves them (the same prefill calls on every rank).
  const bool keep = keep_rows || save != nullptr;
  const int64_t V = backend.info().vocab_size;
  for (std::size_t c = 0; c < seqs.size(); ++c) {
    sequence_rows(backend, seqs[c], {}, 0, keep, [&](const RowResults& res, int64_t) {
      for (int64_t i = 0; i < res.rows; ++i) {
        const double nll = -res.target_logprob[static_cast<std::size_t>(i)];
        r.sum_nll += nll;
        r.sum_nll2 += nll * nll;
        ++r.count;
        if (save)
          save->append(std::span<const float>(res.logits)
                           .subspan(static_cast<std::size_t>(i * V), static_cast<std::size_t>(V)));
      }
    });
    r.running_ppl.push_back(r.ppl());
    if (on_chunk) on_chunk(static_cast<int64_t>(c), r);
  }
  return r;
}

// ---------------------------------------------------------------- file format

int64_t LogitsHeader::n_positions() const {
  int64_t n = 0;
  for (const auto& s : sequences) n += s.n_rows;
  return n;
}

namespace {

const char* dtype_name(LogitsDtype d) {
  return d == LogitsDtype::Float32 ? "float32" : "float16";
}
std::size_t dtype_size(LogitsDtype d) {
  return d == LogitsDtype::Float32 ? 4 : 2;
}

struct ArraySpec {
  std::string name, dtype;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
};

// The arrays a header implies, in file order.
std::vector<ArraySpec> array_specs(const LogitsHeader& h) {
  const int64_t n = h.n_positions();
  const std::size_t es = dtype_size(h.dtype);
  std::vector<ArraySpec> a;
  if (h.mode == LogitsMode::Full) {
    a.push_back({"values",
                 dtype_name(h.dtype),
                 {n, h.vocab_size},
                 static_cast<uint64_t>(n) * static_cast<uint64_t>(h.vocab_size) * es});
  } else {
    const uint64_t nk = static_cast<uint64_t>(n) * static_cast<uint64_t>(h.top_k);
    a.push_back({"topk_ids", "int32", {n, h.top_k}, nk * 4});
    a.push_back({"topk_logprobs", dtype_name(h.dtype), {n, h.top_k}, nk * es});
    a.push_back({"residual_mass", "float32", {n}, static_cast<uint64_t>(n) * 4});
    a.push_back({"target_logprob", "float32", {n}, static_cast<uint64_t>(n) * 4});
  }
  return a;
}

// Header checks shared by the writer (Usage) and the reader (Format, naming the file).
void validate_header(const LogitsHeader& h, ErrorKind kind, const std::string& where) {
  const auto fail = [&](const std::string& msg) {
    throw Error(kind, fmt::format("{}: {}", where, msg), __FILE__, __LINE__);
  };
  // Token ids are 32-bit everywhere; a larger vocab_size also overflowed the array sizes.
  if (h.vocab_size <= 0 || h.vocab_size > std::numeric_limits<int32_t>::max())
    fail(fmt::format("vocab_size must be in [1, 2^31 - 1], got {}", h.vocab_size));
  if (h.mode == LogitsMode::TopK && (h.top_k < 1 || h.top_k > h.vocab_size))
    fail(fmt::format("top_k {} is outside [1, vocab_size {}]", h.top_k, h.vocab_size));
  if (h.mode == LogitsMode::TopK && !h.values_are_logprobs)
    fail("mode topk stores log-probs (\"values\": \"logprobs\")");
  if (h.sequences.empty()) fail("no sequences");
  for (std::size_t i = 0; i < h.sequences.size(); ++i) {
    const LogitsSequence& s = h.sequences[i];
    const int64_t len = static_cast<int64_t>(s.tokens.size());
    if (len == 0) fail(fmt::format("sequences[{}] has no tokens", i));
    if (s.n_rows < 1) fail(fmt::format("sequences[{}]: n_rows must be >= 1, got {}", i, s.n_rows));
    if (s.first < 0 || s.first > len - s.n_rows)
      fail(fmt::format("sequences[{}]: rows first {} + n_rows {} do not fit its {} tokens", i,
                       s.first, s.n_rows, len));
    for (std::size_t t = 0; t < s.tokens.size(); ++t)
      if (s.tokens[t] < 0 || s.tokens[t] >= h.vocab_size)
        fail(fmt::format("sequences[{}].tokens[{}] = {} is outside the vocabulary [0, {})", i, t,
                         s.tokens[t], h.vocab_size));
    if (s.next_token < -1 || s.next_token >= h.vocab_size)
      fail(fmt::format("sequences[{}].next_token = {} is outside [-1, {})", i, s.next_token,
                       h.vocab_size));
  }
}

}  // namespace

json header_to_json(const LogitsHeader& h) {
  json j;
  j["magic"] = kLogitsMagic;
  j["version"] = kLogitsVersion;
  j["vocab_size"] = h.vocab_size;
  j["tokenizer"] = h.tokenizer;
  j["dtype"] = dtype_name(h.dtype);
  j["mode"] = h.mode == LogitsMode::Full ? "full" : "topk";
  if (h.mode == LogitsMode::TopK) j["top_k"] = h.top_k;
  j["values"] = h.values_are_logprobs ? "logprobs" : "logits";
  j["n_positions"] = h.n_positions();
  json seqs = json::array();
  for (const auto& s : h.sequences) {
    seqs.push_back({{"tokens", s.tokens},
                    {"first", s.first},
                    {"n_rows", s.n_rows},
                    {"next_token", s.next_token}});
  }
  j["sequences"] = std::move(seqs);
  if (!h.source.is_null() && !h.source.empty()) j["source"] = h.source;
  return j;
}

LogitsWriter::LogitsWriter(const fs::path& path, LogitsHeader header, const std::string& what)
    : header_(std::move(header)), name_(what.empty() ? path.string() : what + " " + path.string()) {
  validate_header(header_, ErrorKind::Usage, path.string());
  json j = header_to_json(header_);
  const std::vector<ArraySpec> specs = array_specs(header_);
  json arrays = json::object();
  uint64_t off = 0;
  for (const auto& a : specs) {
    arrays[a.name] = {{"dtype", a.dtype}, {"shape", a.shape}, {"offset", off}};
    offsets_.push_back(off);
    off += a.bytes;
  }
  j["arrays"] = std::move(arrays);
  std::string text = j.dump();
  while ((8 + text.size()) % 64 != 0) text.push_back(' ');
  // A symlink at `path` is followed (as fopen "wb" would), so that the rename replaces the file
  // it names, not the link; a path that stays a link is a loop (fopen's ELOOP).
  std::error_code ec;
  final_ = fs::is_symlink(fs::symlink_status(path, ec)) ? resolve_output_path(path.string()) : path;
  FN_REQUIRE(!fs::is_symlink(fs::symlink_status(final_, ec)), Io,
             "{}: cannot create the logits file ({})", name_, std::strerror(ELOOP));
  const fs::file_status st = fs::status(final_, ec);
  if (fs::exists(st) && !fs::is_regular_file(st)) {
    // A device or a FIFO (/dev/null, /dev/full): no rename can replace it; written in place (a
    // directory fails here, EISDIR).
    file_ = std::fopen(final_.c_str(), "wb");
    FN_REQUIRE(file_ != nullptr, Io, "{}: cannot create the logits file ({})", name_,
               std::strerror(errno));
  } else {
    // A name of our own (pid and random bits, O_EXCL): a second writer of the same path, in
    // this process or another, stages elsewhere, so the file renamed into place is always the
    // data of the run whose close() succeeded last.
    StagingFile created;
    try {
      created = create_staging_file(final_);
    } catch (const Error& e) {
      FN_THROW(Io, "{}: {}", name_, e.what());
    }
    const int fd = created.fd;
    staging_ = std::move(created.path);
    at_ = " of " + staging_.string();
    // The file the rename replaces keeps its permission bits (as the truncation in place did).
    if (fs::is_regular_file(st)) {
      (void)::fchmod(fd, static_cast<mode_t>(st.permissions() & fs::perms::all));
    }
    file_ = ::fdopen(fd, "wb");
    if (file_ == nullptr) {
      const int err = errno;
      ::close(fd);
      const std::string staging = staging_.string();
      discard();
      FN_THROW(Io, "{}: cannot open the staging file {} ({})", name_, staging, std::strerror(err));
    }
  }
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  if (std::fwrite(len, 1, 8, file_) != 8 ||
      std::fwrite(text.data(), 1, text.size(), file_) != text.size()) {
    const int err = errno;
    discard();
    FN_THROW(Io, "{}: write failed{} ({})", name_, at_, std::strerror(err));
  }
  data_start_ = 8 + text.size();
  seq_ = 0;
  pos_ = header_.sequences.empty() ? 0 : header_.sequences[0].first;
}

LogitsWriter::~LogitsWriter() {
  // close() ran: the file was renamed into place, or close() threw and removed the staging file.
  if (closing_) return;
  // Reached without close() only when the run failed (an exception unwinding): nothing lands at
  // the final path; say so.
  if (!staging_.empty()) {
    FN_LOG_WARN("{}: not written ({} of {} rows, never closed); removed the staging file {}", name_,
                n_written_, header_.n_positions(), staging_.string());
  } else if (n_written_ < header_.n_positions()) {
    FN_LOG_WARN("{}: incomplete, {} of {} rows written", name_, n_written_, header_.n_positions());
  }
  discard();
}

void LogitsWriter::discard() noexcept {
  if (file_) std::fclose(file_);
  file_ = nullptr;
  if (staging_.empty()) return;
  std::error_code ec;
  fs::remove(staging_, ec);
  staging_.clear();
}

namespace {

// `at` is " of <staging file>" (empty when the file is written in place).
void write_at(std::FILE* f, uint64_t offset, const void* data, std::size_t bytes,
              const std::string& name, const std::string& at) {
  FN_REQUIRE(fseeko(f, static_cast<off_t>(offset), SEEK_SET) == 0 &&
                 std::fwrite(data, 1, bytes, f) == bytes,
             Io, "{}: write failed at byte {}{} ({})", name, offset, at, std::strerror(errno));
}

}  // namespace

void LogitsWriter::check() const {
  FN_REQUIRE(write_error_.empty(), Io, "{}", write_error_);
}

void LogitsWriter::append(std::span<const float> logits) {
  const int64_t n = header_.n_positions();
  FN_CHECK(n_written_ < n, "{}: more rows than the header's {}", name_, n);
  FN_CHECK(static_cast<int64_t>(logits.size()) == header_.vocab_size, "row of {} values, vocab {}",
           logits.size(), header_.vocab_size);
  if (write_error_.empty()) {
    try {
      write_row(logits);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Io) throw;
      write_error_ = e.what();
    }
  }
  ++n_written_;
  ++pos_;
  const LogitsSequence& s = header_.sequences[static_cast<std::size_t>(seq_)];
  if (pos_ >= s.first + s.n_rows && seq_ + 1 < static_cast<int64_t>(header_.sequences.size())) {
    ++seq_;
    pos_ = header_.sequences[static_cast<std::size_t>(seq_)].first;
  }
}

void LogitsWriter::write_row(std::span<const float> logits) {
  const LogitsSequence& s = header_.sequences[static_cast<std::size_t>(seq_)];
  const int32_t target = s.target(pos_);
  const uint64_t V = static_cast<uint64_t>(header_.vocab_size);
  const std::size_t es = dtype_size(header_.dtype);
  const uint64_t row = static_cast<uint64_t>(n_written_);
  std::vector<double> lp;
  if (header_.values_are_logprobs) log_softmax(logits, lp);
  const auto value = [&](std::size_t i) {
    return header_.values_are_logprobs ? static_cast<float>(lp[i]) : logits[i];
  };
  const auto encode = [&](std::span<const std::size_t> idx, std::vector<char>& out) {
    out.resize(idx.size() * es);
    for (std::size_t k = 0; k < idx.size(); ++k) {
      const float v = value(idx[k]);
      if (header_.dtype == LogitsDtype::Float32) {
        std::memcpy(out.data() + 4 * k, &v, 4);
      } else {
        const uint16_t h = float_to_fp16(v);
        std::memcpy(out.data() + 2 * k, &h, 2);
      }
    }
  };
  std::vector<char> bytes;
  if (header_.mode == LogitsMode::Full) {
    std::vector<std::size_t> idx(V);
    for (std::size_t i = 0; i < V; ++i) idx[i] = i;
    encode(idx, bytes);
    write_at(file_, data_start_ + offsets_[0] + row * V * es, bytes.data(), bytes.size(), name_,
             at_);
  } else {
    const std::size_t K = static_cast<std::size_t>(header_.top_k);
    std::vector<std::size_t> idx(V);
    for (std::size_t i = 0; i < V; ++i) idx[i] = i;
    std::partial_sort(
        idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(K), idx.end(),
        [&](std::size_t a, std::size_t b) { return lp[a] > lp[b] || (lp[a] == lp[b] && a < b); });
    idx.resize(K);
    std::vector<int32_t> ids(K);
    double mass = 0.0;
    for (std::size_t k = 0; k < K; ++k) {
      ids[k] = static_cast<int32_t>(idx[k]);
      mass += std::exp(lp[idx[k]]);
    }
    const float residual = static_cast<float>(std::max(0.0, 1.0 - mass));
    const float tl = target >= 0 ? static_cast<float>(lp[static_cast<std::size_t>(target)])
                                 : std::numeric_limits<float>::quiet_NaN();
    write_at(file_, data_start_ + offsets_[0] + row * K * 4, ids.data(), K * 4, name_, at_);
    encode(idx, bytes);
    write_at(file_, data_start_ + offsets_[1] + row * K * es, bytes.data(), bytes.size(), name_,
             at_);
    write_at(file_, data_start_ + offsets_[2] + row * 4, &residual, 4, name_, at_);
    write_at(file_, data_start_ + offsets_[3] + row * 4, &tl, 4, name_, at_);
  }
}

void LogitsWriter::close() {
  if (closing_) return;
  closing_ = true;
  const int64_t n = header_.n_positions();
  try {  // every failure below removes the staging file (the catch): nothing at the final path
    check();
    FN_REQUIRE(std::fflush(file_) == 0, Io, "{}: write failed at the end{} ({})", name_, at_,
               std::strerror(errno));
    // On the disk before the rename, so that a crash cannot leave the new name on missing data
    // (a device written in place has nothing to sync).
    FN_REQUIRE(staging_.empty() || ::fsync(::fileno(file_)) == 0, Io,
               "{}: syncing the staging file {} failed ({})", name_, staging_.string(),
               std::strerror(errno));
    std::FILE* f = file_;
    file_ = nullptr;
    FN_REQUIRE(std::fclose(f) == 0, Io, "{}: closing{} failed ({})", name_, at_,
               std::strerror(errno));
    FN_REQUIRE(n_written_ == n, Internal, "{}: {} of {} rows written", name_, n_written_, n);
    if (!staging_.empty()) {
      std::error_code ec;
      fs::rename(staging_, final_, ec);
      FN_REQUIRE(!ec, Io, "{}: cannot rename the staging file {} onto {} ({})", name_,
                 staging_.string(), final_.string(), ec.message());
      staging_.clear();  // renamed: the destructor has nothing to remove
    }
  } catch (...) {
    discard();
    throw;
  }
}

// ---------------------------------------------------------------- reader

namespace {

template <typename T>
T field(const json& j, const char* key, const std::string& where) {
  FN_REQUIRE(j.contains(key), Format, "{}: header field \"{}\" is missing", where, key);
  try {
    return j.at(key).get<T>();
  } catch (const json::exception&) {
    FN_THROW(Format, "{}: header field \"{}\" has the wrong type ({})", where, key,
             j.at(key).dump().substr(0, 80));
  }
}

}  // namespace

LogitsReader::LogitsReader(const fs::path& path) : path_(path) {
  const std::string where = path.string();
  std::error_code dir_ec;
  FN_REQUIRE(!fs::is_directory(path, dir_ec), Io, "{}: is a directory, not a logits file", where);
  file_ = std::fopen(path.c_str(), "rb");
  FN_REQUIRE(file_ != nullptr, Io, "{}: cannot open the logits file ({})", where,
             std::strerror(errno));
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  FN_REQUIRE(!ec, Io, "{}: cannot read the file size", where);
  FN_REQUIRE(size >= 8, Format, "{}: truncated: {} bytes, not even the 8-byte header length", where,
             size);
  uint8_t len[8];
  FN_REQUIRE(std::fread(len, 1, 8, file_) == 8, Io, "{}: read failed", where);
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= static_cast<uint64_t>(len[i]) << (8 * i);
  FN_REQUIRE(hlen <= size - 8, Format,
             "{}: truncated or not a logits file: header length {} but only {} bytes follow", where,
             hlen, size - 8);
  std::string text(hlen, '\0');
  FN_REQUIRE(std::fread(text.data(), 1, hlen, file_) == hlen, Io, "{}: read failed", where);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    FN_THROW(Format, "{}: the header is not valid JSON (not a fngen logits file?): {}", where,
             e.what());
  }
  FN_REQUIRE(j.is_object(), Format, "{}: the header is not a JSON object", where);
  const std::string magic =
      j.contains("magic") && j["magic"].is_string() ? j["magic"].get<std::string>() : "";
  FN_REQUIRE(magic == kLogitsMagic, Format, "{}: magic is \"{}\", expected \"{}\"", where, magic,
             kLogitsMagic);
  const int version = field<int>(j, "version", where);
  FN_REQUIRE(version == kLogitsVersion, Format, "{}: version {} (this build reads version {})",
             where, version, kLogitsVersion);
  LogitsHeader& h = header_;
  h.vocab_size = field<int64_t>(j, "vocab_size", where);
  h.tokenizer = field<std::string>(j, "tokenizer", where);
  const std::string dtype = field<std::string>(j, "dtype", where);
  FN_REQUIRE(dtype == "float32" || dtype == "float16", Format,
             "{}: dtype \"{}\" is not float32 or float16", where, dtype);
  h.dtype = dtype == "float32" ? LogitsDtype::Float32 : LogitsDtype::Float16;
  const std::string mode = field<std::string>(j, "mode", where);
  FN_REQUIRE(mode == "full" || mode == "topk", Format, "{}: mode \"{}\" is not full or topk", where,
             mode);
  h.mode = mode == "full" ? LogitsMode::Full : LogitsMode::TopK;
  if (h.mode == LogitsMode::TopK) h.top_k = field<int64_t>(j, "top_k", where);
  const std::string values = field<std::string>(j, "values", where);
  FN_REQUIRE(values == "logits" || values == "logprobs", Format,
             "{}: values \"{}\" is not logits or logprobs", where, values);
  h.values_are_logprobs = values == "logprobs";
  const json seqs = field<json>(j, "sequences", where);
  FN_REQUIRE(seqs.is_array(), Format, "{}: \"sequences\" is not a list", where);
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const std::string w = fmt::format("{}: sequences[{}]", where, i);
    FN_REQUIRE(seqs[i].is_object(), Format, "{} is not an object", w);
    LogitsSequence s;
    s.tokens = field<std::vector<int32_t>>(seqs[i], "tokens", w);
    s.first = field<int64_t>(seqs[i], "first", w);
    s.n_rows = field<int64_t>(seqs[i], "n_rows", w);
    s.next_token = field<int32_t>(seqs[i], "next_token", w);
    h.sequences.push_back(std::move(s));
  }
  if (j.contains("source")) h.source = j["source"];
  validate_header(h, ErrorKind::Format, where);
  const int64_t n_pos = field<int64_t>(j, "n_positions", where);
  FN_REQUIRE(n_pos == h.n_positions(), Format,
             "{}: n_positions {} but the sequences record {} rows", where, n_pos, h.n_positions());
  // Arrays: names, dtypes, shapes and offsets exactly as this header implies.
  const json arrays = field<json>(j, "arrays", where);
  FN_REQUIRE(arrays.is_object(), Format, "{}: \"arrays\" is not an object", where);
  uint64_t off = 0;
  for (const ArraySpec& a : array_specs(h)) {
    FN_REQUIRE(arrays.contains(a.name), Format, "{}: array \"{}\" is missing for mode {}", where,
               a.name, mode);
    const json& e = arrays[a.name];
    const std::string w = fmt::format("{}: arrays.{}", where, a.name);
    const std::string adt = field<std::string>(e, "dtype", w);
    const auto shape = field<std::vector<int64_t>>(e, "shape", w);
    const uint64_t aoff = field<uint64_t>(e, "offset", w);
    FN_REQUIRE(adt == a.dtype && shape == a.shape && aoff == off, Format,
               "{}: dtype {} shape {} offset {} disagree with the header (expected {} {} at {})", w,
               adt, json(shape).dump(), aoff, a.dtype, json(a.shape).dump(), off);
    offsets_.push_back(off);
    off += a.bytes;
  }
  data_start_ = 8 + hlen;
  const uint64_t want = data_start_ + off;
  FN_REQUIRE(
      size >= want, Format,
      "{}: truncated: the header describes {} bytes of arrays ({} bytes in all) but the file "
      "has {} bytes",
      where, off, want, size);
  FN_REQUIRE(size == want, Format, "{}: {} bytes after the last array (file {} bytes, expected {})",
             where, size - want, size, want);
}

LogitsReader::~LogitsReader() {
  if (file_) std::fclose(file_);
}

namespace {

void read_at(std::FILE* f, uint64_t offset, void* data, std::size_t bytes, const fs::path& path) {
  FN_REQUIRE(fseeko(f, static_cast<off_t>(offset), SEEK_SET) == 0 &&
                 std::fread(data, 1, bytes, f) == bytes,
             Io, "{}: read failed at byte {} ({} bytes)", path.string(), offset, bytes);
}

void decode_values(const char* src, std::size_t n, LogitsDtype dt, std::vector<double>& out) {
  out.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (dt == LogitsDtype::Float32) {
      float v;
      std::memcpy(&v, src + 4 * i, 4);
      out[i] = v;
    } else {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      out[i] = fp16_to_float(h);
    }
  }
}

}  // namespace

void LogitsReader::read_row(int64_t i, int32_t target, RefRow& row) {
  FN_CHECK(i >= 0 && i < header_.n_positions(), "row {} of {}", i, header_.n_positions());
  const std::size_t es = dtype_size(header_.dtype);
  const uint64_t r = static_cast<uint64_t>(i);
  if (header_.mode == LogitsMode::Full) {
    const std::size_t V = static_cast<std::size_t>(header_.vocab_size);
    buf_.resize(V * es);
    read_at(file_, data_start_ + offsets_[0] + r * V * es, buf_.data(), buf_.size(), path_);
    decode_values(buf_.data(), V, header_.dtype, row.logprobs);
    for (std::size_t k = 0; k < V; ++k) {
      FN_REQUIRE(std::isfinite(row.logprobs[k]), Format,
                 "{}: row {}: the value of token id {} is not finite ({}): a reference-logits "
                 "file must hold finite values",
                 path_.string(), i, k, row.logprobs[k]);
    }
    // Normalised in double whatever was stored: raw logits need it, and FP16-rounded log-probs no
    // longer sum to probability 1 (KL could then go negative); FP32 log-probs move by ~1e-7.
    {
      double mx = row.logprobs[0];
      for (const double v : row.logprobs) mx = std::max(mx, v);
      double sum = 0;
      for (const double v : row.logprobs) sum += std::exp(v - mx);
      const double lse = mx + std::log(sum);
      for (double& v : row.logprobs) v -= lse;
    }
    row.top1 = 0;
    for (std::size_t k = 1; k < V; ++k)
      if (row.logprobs[k] > row.logprobs[static_cast<std::size_t>(row.top1)])
        row.top1 = static_cast<int64_t>(k);
    row.target_logprob = target >= 0 ? row.logprobs[static_cast<std::size_t>(target)]
                                     : std::numeric_limits<double>::quiet_NaN();
    return;
  }
  const std::size_t K = static_cast<std::size_t>(header_.top_k);
  row.topk_ids.resize(K);
  read_at(file_, data_start_ + offsets_[0] + r * K * 4, row.topk_ids.data(), K * 4, path_);
  buf_.resize(K * es);
  read_at(file_, data_start_ + offsets_[1] + r * K * es, buf_.data(), buf_.size(), path_);
  decode_values(buf_.data(), K, header_.dtype, row.topk_logprobs);
  float residual = 0, tl = 0;
  read_at(file_, data_start_ + offsets_[2] + r * 4, &residual, 4, path_);
  read_at(file_, data_start_ + offsets_[3] + r * 4, &tl, 4, path_);
  for (std::size_t k = 0; k < K; ++k) {
    FN_REQUIRE(std::isfinite(row.topk_logprobs[k]), Format,
               "{}: row {}: topk_logprobs[{}] is not finite ({})", path_.string(), i, k,
               row.topk_logprobs[k]);
  }
  FN_REQUIRE(std::isfinite(residual) && residual >= 0.0f, Format,
             "{}: row {}: residual_mass {} is not a finite value >= 0", path_.string(), i,
             residual);
  for (std::size_t k = 0; k < K; ++k)
    FN_REQUIRE(row.topk_ids[k] >= 0 && row.topk_ids[k] < header_.vocab_size, Format,
               "{}: row {}: topk_ids[{}] = {} is outside the vocabulary", path_.string(), i, k,
               row.topk_ids[k]);
  // Log-probabilities of distinct tokens: each <= 0 (p <= 1; kLogprobSlack allows a producer's
  // rounding), and together with the residual at most probability 1 (the same slack).
  double mass = residual;
  for (std::size_t k = 0; k < K; ++k) {
    FN_REQUIRE(row.topk_logprobs[k] <= kLogprobSlack, Format,
               "{}: row {}: topk_logprobs[{}] = {} is above 0 (a probability above 1)",
               path_.string(), i, k, row.topk_logprobs[k]);
    mass += std::exp(row.topk_logprobs[k]);
  }
  FN_REQUIRE(mass <= 1.0 + kLogprobSlack, Format,
             "{}: row {}: the top-{} probabilities and residual_mass add up to {} (above 1)",
             path_.string(), i, K, mass);
  sorted_ids_.assign(row.topk_ids.begin(), row.topk_ids.end());
  std::sort(sorted_ids_.begin(), sorted_ids_.end());
  const auto dup = std::adjacent_find(sorted_ids_.begin(), sorted_ids_.end());
  FN_REQUIRE(dup == sorted_ids_.end(), Format, "{}: row {}: token id {} appears twice in topk_ids",
             path_.string(), i, dup == sorted_ids_.end() ? 0 : *dup);
  row.residual_mass = residual;
  row.target_logprob = tl;
  row.top1 = row.topk_ids[0];
}

// ---------------------------------------------------------------- KL divergence

void KldStats::add(std::span<const float> q_logits, const RefRow& ref, int32_t target) {
  log_softmax(q_logits, lq_);
  const std::size_t V = q_logits.size();
  double kld = 0.0;
  if (!ref.logprobs.empty()) {
    FN_CHECK(ref.logprobs.size() == V, "reference row of {} values, model vocab {}",
             ref.logprobs.size(), V);
    for (std::size_t i = 0; i < V; ++i) {
      const double lp = ref.logprobs[i];
      if (lp == -std::numeric_limits<double>::infinity()) continue;  // p = 0 contributes 0
      kld += std::exp(lp) * (lp - lq_[i]);
    }
  } else {
    gathered_.resize(ref.topk_ids.size());
    for (std::size_t k = 0; k < ref.topk_ids.size(); ++k)
      gathered_[k] = lq_[static_cast<std::size_t>(ref.topk_ids[k])];
    kld = topk_kld(gathered_, ref);
  }
  add_parts(kld, argmax(q_logits) == ref.top1, target,
            target >= 0 ? -lq_[static_cast<std::size_t>(target)] : 0.0, ref);
}

void KldStats::add_topk(std::span<const double> q_topk_logprobs, int32_t q_argmax,
                        double q_target_logprob, const RefRow& ref, int32_t target) {
  FN_CHECK(ref.logprobs.empty() && q_topk_logprobs.size() == ref.topk_ids.size(),
           "add_topk: {} gathered log-probs for a top-{} reference row", q_topk_logprobs.size(),
           ref.topk_ids.size());
  add_parts(topk_kld(q_topk_logprobs, ref), q_argmax == ref.top1, target, -q_target_logprob, ref);
}

double KldStats::topk_kld(std::span<const double> lq, const RefRow& ref) {
  double kld = 0.0, q_mass = 0.0;
  for (std::size_t k = 0; k < ref.topk_ids.size(); ++k) {
    const double lp = ref.topk_logprobs[k];
    kld += std::exp(lp) * (lp - lq[k]);
    q_mass += std::exp(lq[k]);
  }
  const double rp = ref.residual_mass;
  if (rp > 0) {
    const double rq = std::max(1.0 - q_mass, std::numeric_limits<double>::min());
    kld += rp * (std::log(rp) - std::log(rq));
  }
  return kld;
}

void KldStats::add_parts(double kld, bool same_top, int32_t target, double nll, const RefRow& ref) {
  kld_.push_back(kld);
  sum_kld_ += kld;
  sum_kld2_ += kld * kld;
  if (same_top) ++same_top_;
  if (target >= 0) {
    const double nll_base = -ref.target_logprob;
    sum_nll_ += nll;
    sum_nll2_ += nll * nll;
    sum_nll_base_ += nll_base;
    sum_nll_base2_ += nll_base * nll_base;
    sum_nll_nll_base_ += nll * nll_base;
    ++count_nll_;
    const double dp = std::exp(-nll) - std::exp(-nll_base);
    dp_.push_back(dp);
    sum_dp_ += dp;
    sum_dp2_ += dp * dp;
    sum_dp4_ += dp * dp * dp * dp;
  }
}

double KldStats::mean_kld() const {
  return count() > 0 ? sum_kld_ / static_cast<double>(count()) : 0.0;
}
double KldStats::same_top1() const {
  return count() > 0 ? static_cast<double>(same_top_) / static_cast<double>(count()) : 0.0;
}
double KldStats::ppl_q() const {
  return count_nll_ > 0 ? std::exp(sum_nll_ / static_cast<double>(count_nll_)) : 0.0;
}
double KldStats::ppl_base() const {
  return count_nll_ > 0 ? std::exp(sum_nll_base_ / static_cast<double>(count_nll_)) : 0.0;
}

namespace {

// Covariance of the two means (llama.cpp's covariance(): 0 below 10 samples).
double covariance(double sum1, double sum2, double sum12, int64_t count) {
  if (count < 10) return 0.0;
  const double n = static_cast<double>(count);
  return (sum12 / n - (sum1 / n) * (sum2 / n)) / (n - 1);
}

struct PplBlock {
  MeanErr lq, lb;
  double ppl_q = 0, ppl_q_err = 0, ppl_b = 0, ppl_b_err = 0, cov = 0, cor = 0;
  double lratio = 0, lratio_err = 0, ratio = 0, ratio_err = 0, diff = 0, diff_err = 0;
};

PplBlock ppl_block(double s_nll, double s_nll2, double s_b, double s_b2, double s_nb, int64_t n) {
  PplBlock b;
  b.lq = mean_and_uncertainty(s_nll, s_nll2, n);
  b.lb = mean_and_uncertainty(s_b, s_b2, n);
  b.ppl_q = std::exp(b.lq.mean);
  b.ppl_q_err = b.ppl_q * b.lq.err;
  b.ppl_b = std::exp(b.lb.mean);
  b.ppl_b_err = b.ppl_b * b.lb.err;
  b.cov = covariance(s_nll, s_b, s_nb, n);
  b.cor = b.cov / (b.lq.err * b.lb.err);
  b.lratio = b.lq.mean - b.lb.mean;
  b.lratio_err = std::sqrt(std::max(0.0, b.lq.err * b.lq.err + b.lb.err * b.lb.err - 2.0 * b.cov));
  b.ratio = std::exp(b.lratio);
  b.ratio_err = b.ratio * b.lratio_err;
  b.diff = b.ppl_q - b.ppl_b;
  b.diff_err = std::sqrt(std::max(0.0, b.ppl_q_err * b.ppl_q_err + b.ppl_b_err * b.ppl_b_err -
                                           2.0 * b.ppl_q * b.ppl_b * b.cov));
  return b;
}

std::vector<double> sorted_copy(const std::vector<double>& v) {
  std::vector<double> s = v;
  std::sort(s.begin(), s.end());
  return s;
}

}  // namespace

std::string KldStats::chunk_header() {
  return "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence       "
         "       Δp RMS            Same top p\n";
}

std::string KldStats::chunk_line(int64_t chunk) const {
  const PplBlock b =
      ppl_block(sum_nll_, sum_nll2_, sum_nll_base_, sum_nll_base2_, sum_nll_nll_base_, count_nll_);
  const MeanErr k = mean_and_uncertainty(sum_kld_, sum_kld2_, count());
  const MeanErr dp2 = mean_and_uncertainty(sum_dp2_, sum_dp4_, count_nll_);
  const double rms = std::sqrt(dp2.mean);
  const double rms_err = rms > 0 ? 0.5 / rms * dp2.err : 0.0;
  const double st = same_top1();
  const double n = static_cast<double>(count());
  const double st_err = count() > 1 ? std::sqrt(st * (1.0 - st) / (n - 1)) : 0.0;
  return fmt::format(
      "{:4d}  {:10.4f} ± {:10.4f}  {:10.5f} ± {:10.5f}  {:10.5f} ± {:10.5f}  {:6.3f} ± {:6.3f} %  "
      "{:6.3f} ± {:6.3f} %\n",
      chunk + 1, b.ppl_q, b.ppl_q_err, b.lratio, b.lratio_err, k.mean, k.err, 100.0 * rms,
      100.0 * rms_err, 100.0 * st, 100.0 * st_err);
}

std::string KldStats::report() const {
  FN_CHECK(count() > 0, "KLD report without rows");
  const PplBlock b =
      ppl_block(sum_nll_, sum_nll2_, sum_nll_base_, sum_nll_base2_, sum_nll_nll_base_, count_nll_);
  std::string o;
  o += "====== Perplexity statistics ======\n";
  if (count_nll_ > 0) {
    o += fmt::format("Mean PPL(Q)                   : {:10.6f} ± {:10.6f}\n", b.ppl_q, b.ppl_q_err);
    o += fmt::format("Mean PPL(base)                : {:10.6f} ± {:10.6f}\n", b.ppl_b, b.ppl_b_err);
    o += fmt::format("Cor(ln(PPL(Q)), ln(PPL(base))): {:6.2f}%\n", 100.0 * b.cor);
    o += fmt::format("Mean ln(PPL(Q)/PPL(base))     : {:10.6f} ± {:10.6f}\n", b.lratio,
                     b.lratio_err);
    o += fmt::format("Mean PPL(Q)/PPL(base)         : {:10.6f} ± {:10.6f}\n", b.ratio, b.ratio_err);
    o += fmt::format("Mean PPL(Q)-PPL(base)         : {:10.6f} ± {:10.6f}\n", b.diff, b.diff_err);
  } else {
    o += "(no row has a target token: no perplexity)\n";
  }
  o += "\n====== KL divergence statistics ======\n";
  const MeanErr k = mean_and_uncertainty(sum_kld_, sum_kld2_, count());
  const std::vector<double> ks = sorted_copy(kld_);
  o += fmt::format("Mean    KLD: {:10.6f} ± {:10.6f}\n", k.mean, k.err);
  o += fmt::format("Maximum KLD: {:10.6f}\n", ks.back());
  o += fmt::format("99.9%   KLD: {:10.6f}\n", percentile(ks, 0.999));
  o += fmt::format("99.0%   KLD: {:10.6f}\n", percentile(ks, 0.990));
  o += fmt::format("95.0%   KLD: {:10.6f}\n", percentile(ks, 0.950));
  o += fmt::format("90.0%   KLD: {:10.6f}\n", percentile(ks, 0.900));
  o += fmt::format("Median  KLD: {:10.6f}\n", percentile(ks, 0.5));
  o += fmt::format("10.0%   KLD: {:10.6f}\n", percentile(ks, 0.100));
  o += fmt::format(" 5.0%   KLD: {:10.6f}\n", percentile(ks, 0.050));
  o += fmt::format(" 1.0%   KLD: {:10.6f}\n", percentile(ks, 0.010));
  o += fmt::format(" 0.1%   KLD: {:10.6f}\n", percentile(ks, 0.001));
  o += fmt::format("Minimum KLD: {:10.6f}\n", ks.front());
  o += "\n====== Token probability statistics ======\n";
  if (count_nll_ > 0) {
    const MeanErr dp = mean_and_uncertainty(sum_dp_, sum_dp2_, count_nll_);
    const std::vector<double> ds = sorted_copy(dp_);
    o += fmt::format("Mean    Δp: {:6.3f} ± {:5.3f} %\n", 100.0 * dp.mean, 100.0 * dp.err);
    o += fmt::format("Maximum Δp: {:6.3f}%\n", 100.0 * ds.back());
    for (const auto& [label, q] :
         std::initializer_list<std::pair<const char*, double>>{{"99.9%", 0.999},
                                                               {"99.0%", 0.99},
                                                               {"95.0%", 0.95},
                                                               {"90.0%", 0.90},
                                                               {"75.0%", 0.75},
                                                               {"Median", 0.5},
                                                               {"25.0%", 0.25},
                                                               {"10.0%", 0.10},
                                                               {" 5.0%", 0.05},
                                                               {" 1.0%", 0.01},
                                                               {" 0.1%", 0.001}}) {
      o += fmt::format("{:<7} Δp: {:6.3f}%\n", label, 100.0 * percentile(ds, q));
    }
    o += fmt::format("Minimum Δp: {:6.3f}%\n", 100.0 * ds.front());
    const MeanErr mse = mean_and_uncertainty(sum_dp2_, sum_dp4_, count_nll_);
    const double rms = std::sqrt(mse.mean);
    const double rms_err = rms > 0 ? 0.5 / rms * mse.err : 0.0;
    o += fmt::format("RMS Δp    : {:6.3f} ± {:5.3f} %\n", 100.0 * rms, 100.0 * rms_err);
  }
  const double st = same_top1();
  const double n = static_cast<double>(count());
  const double st_err = count() > 1 ? std::sqrt(st * (1.0 - st) / (n - 1)) : 0.0;
  o += fmt::format("Same top p: {:6.3f} ± {:5.3f} %\n", 100.0 * st, 100.0 * st_err);
  return o;
}

json KldStats::to_json() const {
  FN_CHECK(count() > 0, "KLD statistics without rows");
  json j;
  j["count"] = count();
  j["count_nll"] = count_nll_;
  if (count_nll_ > 0) {
    const PplBlock b = ppl_block(sum_nll_, sum_nll2_, sum_nll_base_, sum_nll_base2_,
                                 sum_nll_nll_base_, count_nll_);
    j["ppl_q"] = {{"value", b.ppl_q}, {"err", b.ppl_q_err}};
    j["ppl_base"] = {{"value", b.ppl_b}, {"err", b.ppl_b_err}};
    j["mean_nll_q"] = b.lq.mean;
    j["mean_nll_base"] = b.lb.mean;
    j["cor_ln_ppl"] = b.cor;
    j["ln_ppl_ratio"] = {{"value", b.lratio}, {"err", b.lratio_err}};
    j["ppl_ratio"] = {{"value", b.ratio}, {"err", b.ratio_err}};
    j["ppl_diff"] = {{"value", b.diff}, {"err", b.diff_err}};
    const MeanErr dp = mean_and_uncertainty(sum_dp_, sum_dp2_, count_nll_);
    const std::vector<double> ds = sorted_copy(dp_);
    const MeanErr mse = mean_and_uncertainty(sum_dp2_, sum_dp4_, count_nll_);
    j["delta_p"] = {{"mean", dp.mean},   {"err", dp.err},
                    {"max", ds.back()},  {"median", percentile(ds, 0.5)},
                    {"min", ds.front()}, {"rms", std::sqrt(mse.mean)}};
  }
  const MeanErr k = mean_and_uncertainty(sum_kld_, sum_kld2_, count());
  const std::vector<double> ks = sorted_copy(kld_);
  j["kld"] = {{"mean", k.mean},
              {"err", k.err},
              {"max", ks.back()},
              {"p99_9", percentile(ks, 0.999)},
              {"p99", percentile(ks, 0.99)},
              {"p95", percentile(ks, 0.95)},
              {"p90", percentile(ks, 0.90)},
              {"median", percentile(ks, 0.5)},
              {"p10", percentile(ks, 0.10)},
              {"p5", percentile(ks, 0.05)},
              {"p1", percentile(ks, 0.01)},
              {"p0_1", percentile(ks, 0.001)},
              {"min", ks.front()}};
  j["same_top1"] = same_top1();
  return j;
}

// ---------------------------------------------------------------- drivers

namespace {

// Rank 0's sequences to every rank (count, then per sequence: first, n_rows, next, tokens).
std::vector<LogitsSequence> broadcast_sequences(Collectives& coll,
                                                const std::vector<LogitsSequence>* root_seqs) {
  std::vector<LogitsSequence> seqs;
  if (root_seqs) seqs = *root_seqs;
  int64_t n = static_cast<int64_t>(seqs.size());
  coll.broadcast(&n, sizeof(n), 0);
  seqs.resize(static_cast<std::size_t>(n));
  for (auto& s : seqs) {
    int64_t meta[4] = {s.first, s.n_rows, s.next_token, static_cast<int64_t>(s.tokens.size())};
    coll.broadcast(meta, sizeof(meta), 0);
    s.first = meta[0];
    s.n_rows = meta[1];
    s.next_token = static_cast<int32_t>(meta[2]);
    s.tokens.resize(static_cast<std::size_t>(meta[3]));
    if (!s.tokens.empty()) coll.broadcast(s.tokens.data(), s.tokens.size() * sizeof(int32_t), 0);
  }
  return seqs;
}

}  // namespace

KldStats kl_divergence(Backend& backend, Collectives& coll, LogitsReader* reader,
                       const std::function<void(int64_t, const KldStats&)>& on_sequence) {
  if (reader) {
    FN_REQUIRE(reader->header().vocab_size == backend.info().vocab_size, Format,
               "the base file has vocab_size {} but the model has {}: it was made for another "
               "model",
               reader->header().vocab_size, backend.info().vocab_size);
  }
  const std::vector<LogitsSequence> seqs =
      broadcast_sequences(coll, reader ? &reader->header().sequences : nullptr);
  // Top-K bases: the device gathers the model's log-probs at the reference's ids (K per row);
  // full bases need the model's full rows on the host.
  int64_t top_k = reader && reader->header().mode == LogitsMode::TopK ? reader->header().top_k : 0;
  coll.broadcast(&top_k, sizeof(top_k), 0);
  const int64_t V = backend.info().vocab_size;
  KldStats stats;
  std::vector<RefRow> refs;
  std::vector<int32_t> gather;
  int64_t row = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const LogitsSequence& s = seqs[i];
    const auto n_rows = static_cast<std::size_t>(s.n_rows);
    // Rank 0 reads and checks the sequence's reference rows; a bad row is then every rank's
    // error (agreed on), so that all ranks stop together instead of rank 0 aborting the job.
    if (reader) refs.resize(n_rows);
    agree_on_error(coll, [&] {
      if (!reader) return;
      for (std::size_t r = 0; r < n_rows; ++r)
        reader->read_row(row + static_cast<int64_t>(r), s.target(s.first + static_cast<int64_t>(r)),
                         refs[r]);
    });
    row += s.n_rows;
    gather.assign(n_rows * static_cast<std::size_t>(top_k), -1);
    if (reader && top_k > 0) {
      for (std::size_t r = 0; r < n_rows; ++r)
        std::copy(
            refs[r].topk_ids.begin(), refs[r].topk_ids.end(),
            gather.begin() + static_cast<std::ptrdiff_t>(r * static_cast<std::size_t>(top_k)));
    }
    if (!gather.empty()) coll.broadcast(gather.data(), gather.size() * sizeof(int32_t), 0);
    sequence_rows(backend, s, gather, top_k, top_k == 0, [&](const RowResults& res, int64_t r0) {
      if (!reader) return;
      for (int64_t j = 0; j < res.rows; ++j) {
        const auto r = static_cast<std::size_t>(r0 + j);
        const int32_t target = s.target(s.first + r0 + j);
        const auto ju = static_cast<std::size_t>(j);
        if (top_k > 0) {
          stats.add_topk(
              std::span<const double>(res.gather_logprob)
                  .subspan(ju * static_cast<std::size_t>(top_k), static_cast<std::size_t>(top_k)),
              res.argmax[ju], res.target_logprob[ju], refs[r], target);
        } else {
          stats.add(std::span<const float>(res.logits)
                        .subspan(ju * static_cast<std::size_t>(V), static_cast<std::size_t>(V)),
                    refs[r], target);
        }
      }
    });
    if (reader && on_sequence) on_sequence(static_cast<int64_t>(i), stats);
  }
  return stats;
}

std::vector<ChoiceScore> score_choices(Backend& backend, std::span<const int32_t> context,
                                       const std::vector<std::vector<int32_t>>& choices) {
  FN_CHECK(!context.empty(), "score_choices: an empty context");
  FN_CHECK(backend.capabilities().snapshot, "the {} backend has no state snapshot",
           backend.info().name);
  backend.reset();
  if (context.size() > 1) backend.prefill(context.first(context.size() - 1), PrefillOutput::None);
  backend.snapshot();
  std::vector<ChoiceScore> out;
  std::vector<int32_t> fed;
  for (std::size_t c = 0; c < choices.size(); ++c) {
    const std::vector<int32_t>& choice = choices[c];
    FN_CHECK(!choice.empty(), "score_choices: choice {} has no tokens", c);
    if (c > 0) backend.restore();
    fed.assign(1, context.back());
    fed.insert(fed.end(), choice.begin(), choice.end() - 1);
    RowQuery q;
    q.targets = choice;
    const RowResults r = backend.prefill_rows(fed, q);
    ChoiceScore sc;
    sc.n_tokens = static_cast<int64_t>(choice.size());
    for (std::size_t j = 0; j < choice.size(); ++j) {
      sc.logprob += r.target_logprob[j];
      if (r.argmax[j] != choice[j]) sc.greedy = false;
    }
    out.push_back(sc);
  }
  return out;
}

std::vector<std::vector<ChoiceScore>> score_items(Backend& backend,
                                                  const std::vector<ChoiceItem>& items) {
  std::vector<std::vector<ChoiceScore>> out(items.size());
  const int64_t slots = backend.slot_count();
  const bool side_by_side = slots > 1 && backend.capabilities().copy_slot;
  backend.select_slot(0);
  std::size_t next = 0;
  while (next < items.size()) {
    // The group: items from `next` on while their choices fit the slots.
    std::size_t end = next;
    int64_t used = 0;
    while (end < items.size() && side_by_side) {
      const auto k = static_cast<int64_t>(items[end].choices.size());
      if (used + k > slots) break;
      used += k;
      ++end;
    }
    if (end == next) {  // one slot, or an item with more choices than slots
      out[next] = score_choices(backend, items[next].context, items[next].choices);
      backend.select_slot(0);
      ++next;
      continue;
    }
    // Each item's first choice slot holds its context; the contexts run in one call.
    std::vector<int64_t> first(end - next);
    std::vector<SlotTokens> contexts;
    int64_t slot = 0;
    for (std::size_t i = next; i < end; ++i) {
      const ChoiceItem& it = items[i];
      FN_CHECK(!it.context.empty(), "score_items: item {} has an empty context", i);
      first[i - next] = slot;
      // Fresh slots for the context, or for every choice of a one-token context; the other
      // choices' slots are overwritten by copies of the context below.
      const std::size_t fresh = it.context.size() > 1 ? 1 : it.choices.size();
      for (std::size_t c = 0; c < fresh; ++c) {
        backend.select_slot(slot + static_cast<int64_t>(c));
        backend.reset();
      }
      if (it.context.size() > 1)
        contexts.push_back(
            {slot, std::span<const int32_t>(it.context).first(it.context.size() - 1)});
      slot += static_cast<int64_t>(it.choices.size());
    }
    backend.select_slot(0);
    if (!contexts.empty()) backend.prefill_slots(contexts, nullptr);
    // Every choice on its own copy of its context, all in one call.
    std::vector<std::vector<int32_t>> fed;
    std::vector<int32_t> targets;
    std::vector<SlotTokens> pieces;
    fed.reserve(static_cast<std::size_t>(used));
    for (std::size_t i = next; i < end; ++i) {
      const ChoiceItem& it = items[i];
      for (std::size_t c = 0; c < it.choices.size(); ++c) {
        const std::vector<int32_t>& choice = it.choices[c];
        FN_CHECK(!choice.empty(), "score_items: choice {} of item {} has no tokens", c, i);
        const int64_t s = first[i - next] + static_cast<int64_t>(c);
        if (c > 0 && it.context.size() > 1) backend.copy_slot(first[i - next], s);
        std::vector<int32_t>& f = fed.emplace_back(1, it.context.back());
        f.insert(f.end(), choice.begin(), choice.end() - 1);
        targets.insert(targets.end(), choice.begin(), choice.end());
      }
    }
    std::size_t at = 0;
    for (std::size_t i = next; i < end; ++i)
      for (std::size_t c = 0; c < items[i].choices.size(); ++c, ++at)
        pieces.push_back({first[i - next] + static_cast<int64_t>(c), fed[at]});
    RowQuery q;
    q.targets = targets;
    const RowResults r = backend.prefill_slots(pieces, &q);
    std::size_t row = 0;
    for (std::size_t i = next; i < end; ++i) {
      for (const std::vector<int32_t>& choice : items[i].choices) {
        ChoiceScore sc;
        sc.n_tokens = static_cast<int64_t>(choice.size());
        for (std::size_t j = 0; j < choice.size(); ++j, ++row) {
          sc.logprob += r.target_logprob[row];
          if (r.argmax[row] != choice[j]) sc.greedy = false;
        }
        out[i].push_back(sc);
      }
    }
    next = end;
  }
  return out;
}

int64_t best_choice(std::span<const double> values) {
  FN_CHECK(!values.empty(), "best_choice of no values");
  int64_t best = 0;
  for (std::size_t i = 1; i < values.size(); ++i)
    if (values[i] > values[static_cast<std::size_t>(best)]) best = static_cast<int64_t>(i);
  return best;
}

void dump_logits(Backend& backend, const std::vector<LogitsSequence>& sequences,
                 LogitsWriter* writer, const std::function<void(int64_t)>& on_row) {
  int64_t rows = 0;
  const int64_t V = backend.info().vocab_size;
  for (const LogitsSequence& s : sequences) {
    sequence_rows(backend, s, {}, 0, true, [&](const RowResults& res, int64_t) {
      for (int64_t j = 0; j < res.rows; ++j) {
        if (writer)
          writer->append(
              std::span<const float>(res.logits)
                  .subspan(static_cast<std::size_t>(j * V), static_cast<std::size_t>(V)));
        if (on_row) on_row(++rows);
      }
    });
  }
}

}  // namespace fn
