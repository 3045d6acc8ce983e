// Batch generation over data-parallel groups (see batch_generate.h).
//
// Protocol (G = W / T groups; group g holds world ranks g*T .. g*T+T-1, its leader is g*T):
//  - world rank 0 leads group 0 and dispatches: it plans the output records (line, sample),
//    prepares each one when it is handed out (parse, tokenize, check; a bad record becomes an
//    error record at once) and writes the results in order (OrderedWriter);
//  - each group runs its records in a BatchEngine (core/batch_engine.h) over the backend's
//    sequence slots (--max-batch): every iteration the leader broadcasts the records to admit
//    into free slots and whether more may come ({"works": [...], "more": b}, group
//    collectives), every rank admits them and runs one engine step; the leader detokenizes and
//    builds the output lines of the records that finished;
//  - a leader g >= 1 asks rank 0 for as many records as it has free slots (kTagAsk, answered
//    with kTagWork: the records and whether the input is exhausted) and keeps stepping its
//    running records while the answer is on its way; it sends each step's finished records
//    (kTagResult) and, once done, a final kTagResult. These are JSON texts on a duplicate of the
//    world communicator, so they never meet the collectives;
//  - rank 0 serves the other leaders before each of its own steps and after every token it
//    decides (the token hook), so a waiting group waits at most about one step;
//  - an error in a group (a non-finite logit, a failed write on rank 0) stops the dispatch; every
//    rank leaves its loop, and the error is agreed on over the world (rank 0 prints it once).
#include "apps/batch_generate.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <random>
#include <set>

#include "apps/app_util.h"
#include "comm/mpi_check.h"
#include "comm/mpi_collectives.h"
#include "comm/mpi_context.h"
#include "core/batch_engine.h"
#include "core/error.h"
#include "core/log.h"
#include "tokenizer/tokenizer.h"

namespace fn {

using nlohmann::json;

int64_t new_tokens_for(int64_t n_prompt, int64_t max_new_tokens, int64_t ctx) {
  if (max_new_tokens > 0) return max_new_tokens;
  const int64_t room = std::max<int64_t>(ctx - n_prompt, 1);
  return max_new_tokens == 0 ? std::min(kDefaultNewTokens, room) : room;
}

void check_room(int64_t n_prompt, int64_t max_new_tokens, int64_t ctx) {
  FN_REQUIRE(n_prompt > 0, Usage, "the prompt is empty (0 tokens): give at least one token");
  if (max_new_tokens == 0) {  // the default: room for one token (check_context's own message)
    check_context(n_prompt, 1, ctx);
    return;
  }
  if (max_new_tokens < 0) {
    FN_REQUIRE(n_prompt < ctx, Format,
               "the prompt ({} token{}) {} the context size -c/--ctx-size {}: "
               "-n/--max-new-tokens -1 (until the context is full) leaves no room for a token",
               n_prompt, n_prompt == 1 ? "" : "s", n_prompt > ctx ? "exceeds" : "fills", ctx);
    max_new_tokens = ctx - n_prompt;
  }
  check_context(n_prompt, max_new_tokens, ctx);
}

json sampling_json(const SamplingParams& s) {
  return {{"temperature", s.temperature},
          {"top_k", s.top_k},
          {"top_p", s.top_p},
          {"min_p", s.min_p},
          {"repetition_penalty", s.repetition_penalty},
          {"repeat_last_n", s.repeat_last_n},
          {"presence_penalty", s.presence_penalty},
          {"frequency_penalty", s.frequency_penalty},
          {"seed", s.seed}};
}

std::string sampling_text(const SamplingParams& s) {
  if (s.temperature <= 0.0) {
    return fmt::format("greedy (temp 0), repeat-penalty {} over {}, presence {}, frequency {}",
                       s.repetition_penalty, s.repeat_last_n, s.presence_penalty,
                       s.frequency_penalty);
  }
  return fmt::format(
      "temp {}, top-k {}, top-p {}, min-p {}, repeat-penalty {} over {}, presence {}, "
      "frequency {}, seed {}",
      s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty, s.repeat_last_n,
      s.presence_penalty, s.frequency_penalty, s.seed);
}

namespace {
// No inter-token gap (a single generated token): null statistics, not zeros.
json tpot_json(const LatencyStats& s) {
  auto v = [&](double x) { return s.count > 0 ? json(x) : json(nullptr); };
  return {{"mean", v(s.mean)}, {"p50", v(s.p50)}, {"p90", v(s.p90)},
          {"p99", v(s.p99)},   {"max", v(s.max)}, {"count", s.count}};
}
}  // namespace

RecordPrompt record_prompt(const json& rec, const RecordPromptOptions& o) {
  FN_REQUIRE(rec.is_object(), Format, "a record must be a JSON object, got {}", rec.type_name());
  const int given = static_cast<int>(rec.contains("prompt")) +
                    static_cast<int>(rec.contains("prompt_ids")) +
                    static_cast<int>(rec.contains("messages"));
  FN_REQUIRE(given == 1, Format,
             "a record needs exactly one of \"prompt\", \"prompt_ids\" or \"messages\" (got {})",
             given);
  RecordPrompt out;
  if (rec.contains("prompt_ids")) {
    const json& a = rec["prompt_ids"];
    FN_REQUIRE(a.is_array(), Format, "\"prompt_ids\" must be a list of integers, got {}",
               a.type_name());
    for (std::size_t i = 0; i < a.size(); ++i) {
      FN_REQUIRE(a[i].is_number_integer(), Format, "\"prompt_ids\"[{}] is not an integer: {}", i,
                 a[i].dump());
      // An unsigned past int64 is outside the vocabulary too (read as such, not wrapped).
      const bool huge =
          a[i].is_number_unsigned() && a[i].get<uint64_t>() > static_cast<uint64_t>(o.vocab_size);
      const int64_t v = huge ? o.vocab_size : a[i].get<int64_t>();
      FN_REQUIRE(v >= 0 && v < o.vocab_size, Format,
                 "\"prompt_ids\"[{}] = {} is outside the vocabulary [0, {})", i, a[i].dump(),
                 o.vocab_size);
      out.ids.push_back(static_cast<int32_t>(v));
    }
    return out;
  }
  const auto require_tokenizer = [&o](const char* what) {
    FN_REQUIRE(o.tokenizer != nullptr, Usage,
               "{} is text, but {} has no tokenizer (tokenizer.json or tokenizer.model); give "
               "token ids instead (--prompt-ids, or \"prompt_ids\" in JSONL)",
               what, tokenizer_source(o.model_dir));
  };
  if (rec.contains("prompt")) {
    FN_REQUIRE(rec["prompt"].is_string(), Format, "\"prompt\" must be a string, got {}",
               rec["prompt"].type_name());
    require_tokenizer("\"prompt\"");
    const std::string text = rec["prompt"].get<std::string>();
    out.chat = o.chat;
    out.ids = with_text_source("\"prompt\"", [&] {
      if (!o.chat) return o.tokenizer->encode(text, EncodeMode::Raw);
      std::vector<ChatMessage> msgs;
      if (!o.system_prompt.empty()) msgs.push_back({"system", o.system_prompt, std::nullopt});
      msgs.push_back({"user", text, std::nullopt});
      return encode_chat(*o.tokenizer, msgs, o.chat_options);
    });
    return out;
  }
  // The messages are checked first: a malformed list is named as such, tokenizer or not.
  std::vector<ChatMessage> msgs = chat_messages_from_json(rec["messages"]);
  require_tokenizer("\"messages\"");
  if (!o.system_prompt.empty() && msgs.front().role != "system")
    msgs.insert(msgs.begin(), ChatMessage{"system", o.system_prompt, std::nullopt});
  out.chat = true;
  out.ids = encode_chat(*o.tokenizer, msgs, o.chat_options);
  return out;
}

namespace {
// One {"id", "token", "bytes", "logprob"} entry of result_json's "logprobs".
json logprob_entry(int32_t id, double logprob, const Tokenizer* tokenizer) {
  json e = {{"id", id}};
  // An id past the tokenizer's vocabulary (a padded row of the model's) has no text.
  if (tokenizer && id < tokenizer->vocab_size()) {
    const std::string raw = tokenizer->token_bytes(id, false);
    e["token"] = tokenizer->decode(std::span<const int32_t>(&id, 1));
    std::vector<int> bytes;
    for (const char c : raw) bytes.push_back(static_cast<unsigned char>(c));
    e["bytes"] = bytes;
  }
  e["logprob"] = logprob;
  return e;
}
}  // namespace

json result_json(const GenerationResult& r, bool chat, const Tokenizer* tokenizer) {
  json j = {{"n_prompt_tokens", r.n_prompt_tokens},
            {"n_gen_tokens", r.token_ids.size()},
            {"text", r.text},
            {"token_ids", r.token_ids},
            {"finish_reason", finish_reason_name(r.finish)},
            {"ttft_ms", r.ttft_ms},
            {"prefill_ms", r.prefill_ms},
            {"per_token_ms", r.itl_ms},
            {"tpot_ms", tpot_json(r.tpot)},
            {"e2e_ms", r.e2e_ms},
            {"decode_tokens_per_s", r.itl_ms.empty() ? json(nullptr) : json(r.decode_tokens_per_s)},
            {"prefill_tokens_per_s", r.prefill_tokens_per_s}};
  if (chat) {
    const ReasoningSplit split = split_reasoning(r.text);
    j["content"] = split.content;
    if (split.has_reasoning) j["reasoning"] = split.reasoning;
  }
  if (!r.logprobs.empty()) {
    json lp = json::array();
    for (std::size_t i = 0; i < r.logprobs.size(); ++i) {
      const TokenLogprobs& t = r.logprobs[i];
      json e = logprob_entry(r.token_ids[i], t.logprob, tokenizer);
      json top = json::array();
      for (std::size_t k = 0; k < t.top_ids.size(); ++k)
        top.push_back(logprob_entry(t.top_ids[k], t.top_logprobs[k], tokenizer));
      e["top_logprobs"] = std::move(top);
      lp.push_back(std::move(e));
    }
    j["logprobs"] = std::move(lp);
  }
  return j;
}

std::string memory_text(const std::vector<double>& mib) {
  std::string s;
  for (std::size_t r = 0; r < mib.size(); ++r) s += fmt::format("  r{} {:.1f}", r, mib[r]);
  return s;
}

uint64_t batch_base_seed(std::optional<uint64_t> seed, Collectives& coll, const char* who) {
  if (seed) return *seed;
  const bool root = coll.rank() == 0;
  uint64_t base = 0;
  if (root) base = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  coll.broadcast(&base, sizeof(base), 0);
  if (root)
    FN_LOG_INFO(
        "{}: no -s/--seed given: the records' seeds derive from the random seed {} (rerun with "
        "--seed {} to reproduce every record)",
        who, base, base);
  return base;
}

void check_batch_tp(int64_t tp, int world_size) {
  FN_REQUIRE(tp == 0 || (tp >= 1 && tp <= world_size && world_size % tp == 0), Usage,
             "--tp {} must divide the number of MPI ranks ({}): the ranks form (ranks / --tp) "
             "data-parallel groups of --tp ranks each",
             tp, world_size);
}

namespace {

constexpr int kTagAsk = 71;     // leader -> rank 0: {"want": k}, answered with kTagWork
constexpr int kTagWork = 72;    // rank 0 -> leader: {"works": [up to k items], "end": b}
constexpr int kTagResult = 73;  // leader -> rank 0: {"results": [...], "final": b, "failed": b}

std::string broadcast_text(Collectives& coll, std::string text) {
  int64_t n = static_cast<int64_t>(text.size());
  coll.broadcast(&n, sizeof(n), 0);
  text.resize(static_cast<std::size_t>(n));
  if (n > 0) coll.broadcast(text.data(), text.size(), 0);
  return text;
}

void send_text(const std::string& text, int dest, int tag, MPI_Comm comm) {
  FN_CHECK(text.size() <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
           "a dispatch message of {} bytes exceeds an MPI int count", text.size());
  FN_MPI_CHECK(MPI_Send(text.data(), static_cast<int>(text.size()), MPI_CHAR, dest, tag, comm));
}

std::string recv_text(int source, int tag, MPI_Comm comm, int* from = nullptr) {
  MPI_Status st;
  FN_MPI_CHECK(MPI_Probe(source, tag, comm, &st));
  int n = 0;
  FN_MPI_CHECK(MPI_Get_count(&st, MPI_CHAR, &n));
  std::string text(static_cast<std::size_t>(n), '\0');
  FN_MPI_CHECK(MPI_Recv(text.data(), n, MPI_CHAR, st.MPI_SOURCE, tag, comm, MPI_STATUS_IGNORE));
  if (from) *from = st.MPI_SOURCE;
  return text;
}

// One output record to run: the prompt, its settings and where its line goes.
struct Work {
  int64_t seq = 0;
  std::string id_text;
  int64_t sample = 0;
  std::vector<int32_t> ids;
  bool chat = false;
  // The record's max_tokens (as -n: 0 default, -1, N), stop strings, sampling (the seed is this
  // sample's) and top_logprobs; its "n" is spent in the sample index.
  RecordSettings settings;

  json to_json() const {
    return {{"seq", seq},
            {"id", id_text},
            {"sample", sample},
            {"ids", ids},
            {"chat", chat},
            {"max_new", settings.max_new_tokens},
            {"stop_strings", settings.stop},
            {"sampling", sampling_json(settings.sampling)},
            {"top_logprobs", settings.top_logprobs}};
  }
  static Work from_json(const json& j) {
    Work w;
    w.seq = j.at("seq").get<int64_t>();
    w.id_text = j.at("id").get<std::string>();
    w.sample = j.at("sample").get<int64_t>();
    w.ids = j.at("ids").get<std::vector<int32_t>>();
    w.chat = j.at("chat").get<bool>();
    w.settings.max_new_tokens = j.at("max_new").get<int64_t>();
    w.settings.stop = j.at("stop_strings").get<std::vector<std::string>>();
    w.settings.top_logprobs = j.at("top_logprobs").get<int64_t>();
    const json& s = j.at("sampling");
    SamplingParams& p = w.settings.sampling;
    p.temperature = s.at("temperature").get<double>();
    p.top_k = s.at("top_k").get<int64_t>();
    p.top_p = s.at("top_p").get<double>();
    p.min_p = s.at("min_p").get<double>();
    p.repetition_penalty = s.at("repetition_penalty").get<double>();
    p.repeat_last_n = s.at("repeat_last_n").get<int64_t>();
    p.presence_penalty = s.at("presence_penalty").get<double>();
    p.frequency_penalty = s.at("frequency_penalty").get<double>();
    p.seed = s.at("seed").get<uint64_t>();
    return w;
  }
};

// What a group sends back for one record.
struct Done {
  int64_t seq = 0;
  std::string line;
  int64_t tokens = 0;
  double ttft_ms = 0;
  std::vector<double> itl_ms;

  json to_json() const {
    return {{"seq", seq}, {"line", line}, {"tokens", tokens}, {"ttft", ttft_ms}, {"itl", itl_ms}};
  }
  static Done from_json(const json& j) {
    Done d;
    d.seq = j.at("seq").get<int64_t>();
    d.line = j.at("line").get<std::string>();
    d.tokens = j.at("tokens").get<int64_t>();
    d.ttft_ms = j.at("ttft").get<double>();
    d.itl_ms = j.at("itl").get<std::vector<double>>();
    return d;
  }
};

// A group's side: the model, the tokenizer (leader), and its records in the batch engine.
struct GroupRunner {
  const BatchOptions& o;
  Backend& model;
  Collectives& group;
  const Tokenizer* tokenizer;      // leader only (null without one)
  std::function<void()> on_token;  // world rank 0: serve the other leaders
  BatchEngine engine;
  // The records in the engine, by seq: the work and (leader) its detokenizer.
  struct Running {
    Work work;
    std::unique_ptr<StreamingDetokenizer> detok;
  };
  std::map<int64_t, Running> running;

  GroupRunner(const BatchOptions& opts, Backend& m, Collectives& g, const Tokenizer* tok)
      : o(opts),
        model(m),
        group(g),
        tokenizer(tok),
        engine(m, g, {.max_batch = m.slot_count(), .prefill_budget = opts.prefill_budget}) {}

  // Puts `w` into the engine (every rank alike).
  void admit(Work w) {
    BatchRequest req;
    req.key = w.seq;
    req.prompt = w.ids;
    GenerateOptions& go = req.options;
    go.sampling = w.settings.sampling;
    go.ctx_size = o.ctx;
    go.max_new_tokens =
        new_tokens_for(static_cast<int64_t>(w.ids.size()), w.settings.max_new_tokens, o.ctx);
    go.stop_token_ids = o.stop_token_ids;
    go.stop_strings = w.settings.stop;
    go.ignore_eos = o.ignore_eos;
    go.host_sampling = o.host_sampling;
    go.top_logprobs = w.settings.top_logprobs;
    Running run{std::move(w), nullptr};
    if (group.rank() == 0 && (tokenizer || on_token)) {
      if (tokenizer) run.detok = std::make_unique<StreamingDetokenizer>(*tokenizer);
      StreamingDetokenizer* detok = run.detok.get();
      req.hooks.feed = [this, detok](int32_t id) {
        if (on_token) on_token();
        return detok ? detok->feed(id) : std::string();
      };
      if (detok) req.hooks.finish = [detok] { return detok->finish(); };
    }
    const int64_t seq = run.work.seq;
    running.emplace(seq, std::move(run));
    try {
      engine.admit(std::move(req));
    } catch (...) {
      running.erase(seq);
      throw;
    }
  }

  // One engine step; the records it finished, with their output lines on the leader.
  std::vector<Done> step() {
    std::vector<Done> done;
    for (BatchOutput& out : engine.step()) {
      const auto it = running.find(out.key);
      FN_CHECK(it != running.end(), "the batch engine returned an unknown record {}", out.key);
      const Work& w = it->second.work;
      const GenerationResult& r = out.result;
      Done d;
      d.seq = w.seq;
      d.tokens = static_cast<int64_t>(r.token_ids.size());
      d.ttft_ms = r.ttft_ms;
      d.itl_ms = r.itl_ms;
      if (group.rank() == 0) {
        json j = result_json(r, w.chat, tokenizer);
        j["sampling"] = sampling_json(w.settings.sampling);
        j["sample_index"] = w.sample;
        // The leader's memory after this record (a soak compares the first and the last record).
        j["host_rss_mib"] = current_rss_mib();
        const BackendCapabilities caps = model.capabilities();
        if (caps.device_memory) j["device_used_mib"] = model.device_used_mib();
        if (caps.graph_captures) j["graph_captures"] = model.graph_captures();
        d.line = record_line(w.id_text, j);
      }
      running.erase(it);
      done.push_back(std::move(d));
    }
    return done;
  }
};

// One planned output record: input line (0-based) and sample index.
struct Unit {
  int64_t line = 0;
  int64_t sample = 0;
};

// What one input line of `generate -i` produces: its id text (record_id_text; the line number for
// a line that is not a JSON object) and how many output records it asks for (its valid "n", else
// 1; a bad line gives one error record).
struct LinePlan {
  std::string id;
  int64_t samples = 1;
};

LinePlan plan_line(const std::string& line, int64_t line_number) {
  LinePlan p{std::to_string(line_number), 1};
  try {
    const nlohmann::json rec = parse_json_line(line);
    if (!rec.is_object()) return p;
    p.id = record_id_text(line, line_number);
    const auto it = rec.find("n");
    if (it != rec.end() && it->is_number_integer() && it->get<int64_t>() >= 1 &&
        it->get<int64_t>() <= kMaxSamplesPerRecord)
      p.samples = it->get<int64_t>();
  } catch (const Error&) {
    // a bad line: one error record, keyed by its line number
  }
  return p;
}

/// --resume's check that `scan` (of `output`) was written for the non-blank `lines` of `input`:
/// throws fn::Error(Format) naming both lines when two records share an id (resume matches by
/// id), and naming the record when `output` holds an id or sample the input does not have (the
/// file belongs to another input). Records without ids are matched by line number, so a file
/// written for another input of the same length passes: give records ids.
void check_resume_input(const std::vector<std::string>& lines, const ResumeScan& scan,
                        const std::string& input, const std::string& output) {
  std::map<std::string, int64_t> line_of;  // id text -> its 1-based line
  std::set<std::string> keys;              // sample_key of every record the input asks for
  for (std::size_t li = 0; li < lines.size(); ++li) {
    if (lines[li].find_first_not_of(" \t\r") == std::string::npos) continue;
    const int64_t line_number = static_cast<int64_t>(li + 1);
    const LinePlan p = plan_line(lines[li], line_number);
    const auto [it, fresh] = line_of.emplace(p.id, line_number);
    FN_REQUIRE(fresh, Format,
               "-i/--input {}: lines {} and {} have the same id {}; --resume matches records by "
               "id, so ids must be unique",
               input, it->second, line_number, p.id);
    for (int64_t s = 0; s < p.samples; ++s) keys.insert(sample_key(p.id, s));
  }
  for (const std::string& key : scan.done) {
    const std::size_t tab = key.rfind('\t');
    FN_REQUIRE(keys.count(key) > 0 || scan.error_ids.count(key.substr(0, tab)) > 0, Format,
               "-o/--output {} holds a record (id {}, sample {}) that -i/--input {} does not ask "
               "for: it was written for another input; give another -o or drop --resume",
               output, key.substr(0, tab), key.substr(tab + 1), input);
  }
  for (const std::string& id : scan.error_ids)
    FN_REQUIRE(line_of.count(id) > 0, Format,
               "-o/--output {} holds an error record (id {}) that -i/--input {} does not have: "
               "it was written for another input; give another -o or drop --resume",
               output, id, input);
}

// World rank 0: the records, their preparation, the ordered writer and the counts.
class Dispatcher {
 public:
  Dispatcher(const BatchOptions& o, const std::vector<std::string>& lines,
             const Tokenizer* tokenizer, uint64_t base_seed, const ResumeScan& scan, std::FILE* out)
      : o_(o),
        lines_(lines),
        tok_(tokenizer),
        base_seed_(base_seed),
        out_(out),
        writer_(
            [this](const std::string& line) { write_line(out_, line, o_.output, "-o/--output"); }) {
    plan(scan);
  }

  int64_t total() const { return static_cast<int64_t>(units_.size()); }
  int64_t skipped() const { return skipped_; }
  bool failed() const { return failed_; }

  // The next work item, or none when every record is handed out (or the run failed). Error
  // records found on the way are written (in order) and counted.
  std::optional<Work> next(BatchProgress& progress) {
    while (!failed_ && next_unit_ < total()) {
      const int64_t seq = next_unit_++;
      const Unit u = units_[static_cast<std::size_t>(seq)];
      prepare(u.line);
      if (!prep_error_.empty()) {
        // One error record per line: at its first planned unit; the others write nothing.
        std::string line;
        if (prep_error_line_written_ != u.line) {
          prep_error_line_written_ = u.line;
          progress.clear();
          FN_LOG_WARN("{}", prep_error_);
          line = record_line(prep_id_, json{{"finish_reason", "error"}, {"error", prep_error_}});
          ++records_;
          ++errors_;
          progress.add(0);
        }
        put(seq, std::move(line));
        continue;
      }
      Work w;
      w.seq = seq;
      w.id_text = prep_id_;
      w.sample = u.sample;
      w.ids = prep_ids_;
      w.chat = prep_chat_;
      w.settings = prep_;
      w.settings.sampling.seed = sample_seed(prep_seed_, u.sample);
      return w;
    }
    return std::nullopt;
  }

  // A finished record (from any group).
  void done(const Done& d, BatchProgress& progress) {
    ++records_;
    tokens_ += d.tokens;
    ttfts_.push_back(d.ttft_ms);
    itls_.insert(itls_.end(), d.itl_ms.begin(), d.itl_ms.end());
    progress.add(d.tokens);
    put(d.seq, d.line);
  }

  // Stops handing out work; `e` is rank 0's own error to report (null for another group's).
  void fail(std::exception_ptr e) {
    failed_ = true;
    if (e && !error_) error_ = e;
  }
  std::exception_ptr error() const { return error_; }

  int64_t records() const { return records_; }
  int64_t errors() const { return errors_; }
  int64_t tokens() const { return tokens_; }
  const std::vector<double>& ttfts() const { return ttfts_; }
  const std::vector<double>& itls() const { return itls_; }

 private:
  void put(int64_t seq, std::string line) {
    if (failed_ && error_) return;  // rank 0's own write failed: write nothing more
    try {
      writer_.put(seq, std::move(line));
    } catch (...) {
      fail(std::current_exception());
    }
  }

  // The output records to produce: every sample of every non-blank line, less those -o already
  // holds (--resume).
  void plan(const ResumeScan& scan) {
    for (std::size_t li = 0; li < lines_.size(); ++li) {
      const std::string& line = lines_[li];
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const LinePlan p = plan_line(line, static_cast<int64_t>(li + 1));
      const std::string& id = p.id;
      const int64_t n = p.samples;
      for (int64_t s = 0; s < n; ++s) {
        if (scan.error_ids.count(id) || scan.done.count(sample_key(id, s))) {
          ++skipped_;
          continue;
        }
        units_.push_back({static_cast<int64_t>(li), s});
      }
    }
  }

  // Parses and checks line `li` once for all its samples: prep_ids_/prep_ or prep_error_.
  void prepare(int64_t li) {
    if (li == prep_line_) return;
    prep_line_ = li;
    prep_error_.clear();
    prep_ids_.clear();
    const std::string& line = lines_[static_cast<std::size_t>(li)];
    prep_id_ = std::to_string(li + 1);
    prep_chat_ = o_.chat;
    try {
      const json rec = parse_json_line(line);
      if (rec.is_object()) {
        prep_id_ = record_id_text(line, li + 1);
        if (rec.contains("messages")) prep_chat_ = true;
        warn_unknown_record_fields(rec, is_generate_record_field, warned_, o_.input, li + 1,
                                   "generate");
      }
      prep_ = record_settings(rec, o_.defaults);
      prep_seed_ = prep_.seed_given ? prep_.sampling.seed
                                    : record_seed(base_seed_, static_cast<uint64_t>(li + 1));
      FN_REQUIRE(prep_.stop.empty() || tok_ != nullptr, Format,
                 "\"stop\" needs a tokenizer to match text, and {} has none",
                 tokenizer_source(o_.model_dir));
      prep_ids_ = record_prompt(rec, {.tokenizer = tok_,
                                      .vocab_size = o_.vocab_size,
                                      .chat = o_.chat,
                                      .system_prompt = o_.system_prompt,
                                      .chat_options = o_.chat_options,
                                      .model_dir = o_.model_dir})
                      .ids;
      try {
        check_room(static_cast<int64_t>(prep_ids_.size()), prep_.max_new_tokens, o_.ctx);
      } catch (const Error& e) {
        // The record's own "max_tokens" is named when it is the one that does not fit (not for
        // an empty prompt, or one the context cannot hold alone).
        const json* given =
            rec.is_object() && rec.contains("max_tokens") ? &rec["max_tokens"] : nullptr;
        const auto n_prompt = static_cast<int64_t>(prep_ids_.size());
        if (given == nullptr || given->is_null() || n_prompt == 0 || n_prompt >= o_.ctx) throw;
        FN_THROW(Format, "\"max_tokens\": {} does not fit: {}", given->dump(), e.what());
      }
    } catch (const Error& e) {
      prep_error_ = fmt::format("{}: line {}: {}", o_.input, li + 1, e.what());
    }
  }

  const BatchOptions& o_;
  const std::vector<std::string>& lines_;
  const Tokenizer* tok_;
  uint64_t base_seed_;
  std::FILE* out_;
  OrderedWriter writer_;
  std::vector<Unit> units_;
  int64_t next_unit_ = 0, skipped_ = 0;
  std::set<std::string> warned_;
  // The prepared line.
  int64_t prep_line_ = -1, prep_error_line_written_ = -1;
  std::string prep_id_, prep_error_;
  std::vector<int32_t> prep_ids_;
  bool prep_chat_ = false;
  RecordSettings prep_;
  uint64_t prep_seed_ = 0;
  // Counts.
  int64_t records_ = 0, errors_ = 0, tokens_ = 0;
  std::vector<double> ttfts_, itls_;
  bool failed_ = false;
  std::exception_ptr error_;
};

// The communicators of a run: the group (a split of the world when there are several groups)
// and the dispatch channel (a duplicate of the world). Freed last.
struct Comms {
  MPI_Comm group = MPI_COMM_NULL;
  MPI_Comm dispatch = MPI_COMM_NULL;
  ~Comms() {
    if (group != MPI_COMM_NULL) MPI_Comm_free(&group);
    if (dispatch != MPI_COMM_NULL) MPI_Comm_free(&dispatch);
  }
};

}  // namespace

int run_batch_generate(const BatchOptions& o, const std::vector<std::string>& lines,
                       const Tokenizer* tokenizer, MpiContext& mpi, Collectives& world) {
  const int world_rank = mpi.world_rank();
  const bool root = world_rank == 0;
  const int tp = o.backend.tp > 0 ? static_cast<int>(o.backend.tp) : mpi.world_size();
  agree_on_error(world, [&] { check_batch_tp(tp, mpi.world_size()); });
  const int n_groups = mpi.world_size() / tp;
  const int group_id = world_rank / tp;

  const uint64_t base_seed = batch_base_seed(o.seed, world, "generate");

  // --resume: what -o already holds (rank 0; a partial last line is cut off before the load).
  ResumeScan scan;
  agree_on_error(world, [&] {
    if (!root || !o.resume) return;
    scan = scan_resume_output(o.output, "-o/--output");
    check_resume_input(lines, scan, o.input, o.output);
  });
  if (root && o.resume) {
    FN_LOG_INFO("generate: --resume: {} record(s) already in {}{}", scan.records, o.output,
                scan.cut_bytes > 0
                    ? fmt::format(" (a partial last line of {} bytes cut off)", scan.cut_bytes)
                    : std::string());
  }

  // The groups: consecutive world ranks, one node each.
  Comms comms;
  std::unique_ptr<MpiCollectives> group_coll_owned;
  Collectives* group = &world;
  if (n_groups > 1) {
    FN_MPI_CHECK(MPI_Comm_split(mpi.world(), group_id, world_rank, &comms.group));
    FN_MPI_CHECK(MPI_Comm_set_errhandler(comms.group, MPI_ERRORS_RETURN));
    FN_MPI_CHECK(MPI_Comm_dup(mpi.world(), &comms.dispatch));
    FN_MPI_CHECK(MPI_Comm_set_errhandler(comms.dispatch, MPI_ERRORS_RETURN));
    group_coll_owned = std::make_unique<MpiCollectives>(comms.group);
    group = group_coll_owned.get();
    MPI_Comm node = MPI_COMM_NULL;
    FN_MPI_CHECK(MPI_Comm_split_type(comms.group, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
    int on_node = 0;
    MPI_Comm_size(node, &on_node);
    MPI_Comm_free(&node);
    agree_on_error(world, [&] {
      FN_REQUIRE(on_node == tp, Usage,
                 "--tp {}: the ranks of group {} (world ranks {} to {}) span several nodes; place "
                 "each group's {} consecutive ranks on one node",
                 tp, group_id, group_id * tp, group_id * tp + tp - 1, tp);
    });
  }
  const bool leader = group->rank() == 0;

  // The model, once per group; a load error in any group ends every rank alike.
  std::unique_ptr<Backend> model;
  std::exception_ptr load_error;
  {
    BackendFlags flags = o.backend;
    flags.tp = tp;
    try {
      const MPI_Comm tp_comm = n_groups > 1 ? comms.group : MPI_COMM_NULL;
      model = o.random_config.empty()
                  ? load_backend(flags, o.model_dir, mpi, *group, o.ctx, "generate", tp_comm)
                  : load_backend_random(flags, o.random_config, o.weights_seed, mpi, *group, o.ctx,
                                        "generate", tp_comm);
    } catch (...) {
      load_error = std::current_exception();
    }
  }
  agree_on_error(world, [&] {
    if (load_error) std::rethrow_exception(load_error);
  });
  if (root && n_groups > 1) FN_LOG_INFO("generate: {} data-parallel groups of TP {}", n_groups, tp);

  // Leaders detokenize their own records.
  std::unique_ptr<Tokenizer> own_tokenizer;
  std::exception_ptr tok_error;
  if (leader && !root && !o.model_dir.empty() && has_tokenizer(o.model_dir)) {
    try {
      own_tokenizer = load_tokenizer(o.model_dir);
    } catch (...) {
      tok_error = std::current_exception();
    }
  }
  agree_on_error(world, [&] {
    if (tok_error) std::rethrow_exception(tok_error);
  });
  const Tokenizer* tok = root ? tokenizer : own_tokenizer.get();

  // -o: appended to with --resume, else truncated; opened by rank 0 after the load.
  std::FILE* out = stdout;
  agree_on_error(world, [&] {
    if (!root || o.output.empty()) return;
    out = open_output_locked(o.output, !o.resume, "-o/--output");
  });
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> out_guard(out == stdout ? nullptr : out,
                                                                  &std::fclose);

  GroupRunner runner(o, *model, *group, tok);
  std::exception_ptr run_error;  // this rank's own failure
  const auto t0 = std::chrono::steady_clock::now();
  if (root)
    FN_LOG_INFO(
        "generate: up to {} sequence(s) side by side per group{}", runner.engine.capacity(),
        runner.engine.capacity() > 1
            ? fmt::format(" (continuous batching, {} prompt tokens per step)", o.prefill_budget)
            : std::string());

  std::unique_ptr<Dispatcher> disp;
  std::unique_ptr<BatchProgress> progress;
  if (root) {
    disp = std::make_unique<Dispatcher>(o, lines, tokenizer, base_seed, scan, out);
    progress = std::make_unique<BatchProgress>(disp->total(), isatty(fileno(stderr)) != 0);
    if (disp->skipped() > 0)
      FN_LOG_INFO("generate: --resume: {} output record(s) skipped, {} to run", disp->skipped(),
                  disp->total());
  }

  // One iteration on every rank of a group: the leader's message {"works": [...], "more": b}
  // (broadcast; empty text on the other ranks), its works admitted, one engine step. False once
  // no work can come ("more" false) and none runs. Finished records go to `finished`.
  const auto group_iteration = [&](const std::string& leader_text, std::vector<Done>& finished) {
    const json m = json::parse(broadcast_text(*group, leader_text));
    for (const json& w : m.at("works")) runner.admit(Work::from_json(w));
    if (!m.at("more").get<bool>() && runner.engine.running() == 0) return false;
    for (Done& d : runner.step()) finished.push_back(std::move(d));
    return true;
  };
  const auto group_message = [](std::vector<Work>& works, bool more) {
    json m = {{"works", json::array()}, {"more", more}};
    for (const Work& w : works) m["works"].push_back(w.to_json());
    works.clear();
    return m.dump();
  };

  if (root) {
    // The other leaders not yet finished (their "final" message).
    int active = n_groups - 1;
    // One message of another leader: results (kTagResult, maybe its last or its failure) or an
    // ask for up to "want" records (kTagAsk, answered with as many as are left and whether the
    // input is exhausted).
    const auto serve = [&](int tag, const std::string& text, int from) {
      const json m = json::parse(text);
      if (tag == kTagResult) {
        for (const json& r : m.at("results")) disp->done(Done::from_json(r), *progress);
        if (m.at("failed").get<bool>()) disp->fail(nullptr);
        if (m.at("final").get<bool>()) --active;
        return;
      }
      json reply = {{"works", json::array()}, {"end", false}};
      const auto want = m.at("want").get<std::size_t>();
      while (reply["works"].size() < want) {
        std::optional<Work> w = disp->next(*progress);
        if (!w) {
          reply["end"] = true;
          break;
        }
        reply["works"].push_back(w->to_json());
      }
      send_text(reply.dump(), from, kTagWork, comms.dispatch);
    };
    // Serves every message waiting (with `block`, waits for one first).
    const auto poll = [&](bool block) {
      if (n_groups == 1) return;
      for (;;) {
        MPI_Status st;
        int flag = 0;
        if (block) {
          FN_MPI_CHECK(MPI_Probe(MPI_ANY_SOURCE, MPI_ANY_TAG, comms.dispatch, &st));
          flag = 1;
          block = false;
        } else {
          FN_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comms.dispatch, &flag, &st));
        }
        if (!flag) return;
        const std::string text = recv_text(st.MPI_SOURCE, st.MPI_TAG, comms.dispatch);
        serve(st.MPI_TAG, text, st.MPI_SOURCE);
      }
    };
    runner.on_token = [&poll] { poll(false); };
    bool more = true;
    for (;;) {
      poll(false);
      std::vector<Work> works;
      more = more && !disp->failed();
      while (more && runner.engine.free_slots() > static_cast<int64_t>(works.size())) {
        std::optional<Work> w = disp->next(*progress);
        if (!w) {
          more = false;
          break;
        }
        works.push_back(std::move(*w));
      }
      std::vector<Done> finished;
      bool go_on = false;
      try {
        go_on = group_iteration(group_message(works, more), finished);
      } catch (...) {
        disp->fail(std::current_exception());
      }
      for (const Done& d : finished) disp->done(d, *progress);
      if (!go_on) break;
    }
    while (active > 0) poll(true);
    progress->clear();
    run_error = disp->error();
  } else if (leader) {
    bool exhausted = false, asked = false;
    std::vector<Work> got;
    const auto send_results = [&](const std::vector<Done>& done, bool final) {
      json m = {{"results", json::array()}, {"final", final}, {"failed", run_error != nullptr}};
      for (const Done& d : done) m["results"].push_back(d.to_json());
      send_text(m.dump(), 0, kTagResult, comms.dispatch);
    };
    const auto take_reply = [&] {
      const json m = json::parse(recv_text(0, kTagWork, comms.dispatch));
      for (const json& w : m.at("works")) got.push_back(Work::from_json(w));
      exhausted = m.at("end").get<bool>();
      asked = false;
    };
    for (;;) {
      if (asked) {  // the answer to the ask: waited for when nothing runs
        int flag = 1;
        if (runner.engine.running() > 0 || !got.empty())
          FN_MPI_CHECK(MPI_Iprobe(0, kTagWork, comms.dispatch, &flag, MPI_STATUS_IGNORE));
        if (flag) take_reply();
      }
      const int64_t want = runner.engine.free_slots() - static_cast<int64_t>(got.size());
      if (!asked && !exhausted && want > 0) {
        send_text(json{{"want", want}}.dump(), 0, kTagAsk, comms.dispatch);
        asked = true;
        if (runner.engine.running() == 0 && got.empty()) take_reply();
      }
      std::vector<Done> finished;
      bool go_on = false;
      try {
        go_on = group_iteration(group_message(got, !exhausted || asked), finished);
      } catch (...) {
        run_error = std::current_exception();
      }
      if (!finished.empty()) send_results(finished, false);
      if (!go_on) break;
    }
    if (asked) take_reply();  // rank 0 answers every ask
    send_results({}, true);
  } else {
    for (;;) {
      std::vector<Done> finished;
      try {
        if (!group_iteration(std::string(), finished)) break;
      } catch (...) {
        run_error = std::current_exception();
        break;
      }
    }
  }

  // Every rank is out of its loop: the first error (by world rank) ends every rank alike.
  agree_on_error(world, [&] {
    if (run_error) std::rethrow_exception(run_error);
  });
  const std::vector<double> mem = gather_peak_rss_mib(world);
  int64_t n_records = 0, n_errors = 0;
  if (root) {
    n_records = disp->records();
    n_errors = disp->errors();
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const LatencyStats tt = latency_stats(disp->ttfts()), it = latency_stats(disp->itls());
    // No successful record (TTFT) or no record with a second token (TPOT): no number to print.
    const std::string ttft_line =
        disp->ttfts().empty()
            ? std::string("n/a (no record succeeded)")
            : fmt::format("p50 {:.2f}  p90 {:.2f}  p99 {:.2f}", tt.p50, tt.p90, tt.p99);
    const std::string tpot_line =
        disp->itls().empty()
            ? std::string("n/a (no record generated a second token)")
            : fmt::format("mean {:.3f}  p50 {:.3f}  p90 {:.3f}  p99 {:.3f}  max {:.3f}", it.mean,
                          it.p50, it.p90, it.p99, it.max);
    SamplingParams shown = o.defaults.sampling;
    shown.seed = base_seed;
    const std::string s = fmt::format(
        "\n--- fngen generate (batch): backend {}, TP {}, {} data-parallel group{}, ctx {}, {}\n"
        "records {}, errors {}, generated tokens {}, {:.1f} tok/s, wall {:.2f} s{}\n"
        "TTFT ms: {}\n"
        "TPOT ms: {}\n"
        "peak host memory (MiB, per rank):{}\n",
        model->info().name, tp, n_groups, n_groups == 1 ? "" : "s", o.ctx, sampling_text(shown),
        n_records, n_errors, disp->tokens(),
        wall > 0 ? static_cast<double>(disp->tokens()) / wall : 0.0, wall,
        disp->skipped() > 0 ? fmt::format(" ({} already in -o, skipped)", disp->skipped())
                            : std::string(),
        ttft_line, tpot_line, memory_text(mem));
    std::fwrite(s.data(), 1, s.size(), stderr);
    std::fflush(stderr);
  }
  // Every rank ends with the same verdict: rank 0 counted the records.
  agree_on_error(world, [&] {
    FN_REQUIRE(!root || n_records == 0 || n_errors < n_records, Format,
               "-i/--input {}: every record failed ({} of {}; see their \"error\" fields)", o.input,
               n_errors, n_records);
  });
  return 0;
}

}  // namespace fn
