// `fngen eval`: scripted quality evaluation (docs/design.md "Same engine, other front ends";
// docs/cli.md "eval"), launched like generate: `mpirun -np N fngen
// eval <ppl|dump-logits|kld|score> -m DIR ...`, TP = world size, rank 0 reads every input and
// broadcasts the token ids, every rank runs the backend, rank 0 prints. The math and the
// reference-logits file format live in core/eval.h; this file is wiring only.
//   ppl          llama-perplexity: -f TEXT (or --ids-file) -c N [--chunks K] [--save-logits F]
//   dump-logits  teacher-forced logits of every position of prompt ++ --continuation-ids -> -o F
//   kld          --base F: llama.cpp's three statistic blocks of KL(base ‖ this model)
//   loglik       -i items.jsonl: multiple-choice log-likelihood (lm-evaluation-harness form), acc
//                and acc_norm per task, JSONL per record
//   score        -i tasks.jsonl: greedy generation per task, <think> stripped, exact or regex
//                answer match, per-task and total accuracy, JSONL records
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "apps/answer_pattern.h"
#include "apps/app_util.h"
#include "apps/backend.h"
#include "apps/batch_generate.h"
#include "apps/batch_records.h"
#include "apps/command.h"
#include "apps/real_number.h"
#include "apps/whole_number.h"
#include "comm/mpi_collectives.h"
#include "comm/mpi_context.h"
#include "core/batch_engine.h"
#include "core/config.h"
#include "core/error.h"
#include "core/eval.h"
#include "core/generate.h"
#include "core/log.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace fn {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// eval loglik's --prefill-chunk on cuda when not given: a pass holds many items' contexts or
// choices, and its buffers (~0.4 MB per row at the real TP=1 geometry) leave the free memory to
// the slots (the default 8,192 rows would take ~3 GiB of an 80 GB GPU's last few).
constexpr int64_t kLoglikPrefillChunk = 2048;

// Options every eval subcommand has. The model is -m DIR, or --random-weights --config FILE
// (the full geometry on random device weights, to time the goals without a checkpoint) with its
// text read through --tokenizer DIR.
struct CommonCli : RandomWeightsCli {
  std::string model;
  BackendFlags backend;
  bool json_out = false;
  // Where config.json (or the --config file) is read.
  fs::path config_source() const { return random_weights ? fs::path(config) : fs::path(model); }
  // Where tokenizer.json is read: the model directory, or --tokenizer (empty: none).
  fs::path tokenizer_dir() const { return random_weights ? fs::path(tokenizer) : fs::path(model); }
  // "the model directory DIR" or "--tokenizer DIR", for messages.
  std::string tokenizer_source() const {
    if (!random_weights) return "the model directory " + model;
    return tokenizer.empty() ? std::string("--random-weights without --tokenizer")
                             : "--tokenizer " + tokenizer;
  }
  // The name a report gives the model.
  std::string model_name() const { return random_weights ? "random:" + config : model; }
};

struct EvalCli {
  CommonCli ppl_c, dump_c, kld_c, score_c, loglik_c;
  // ppl
  std::string ppl_file, ppl_ids_file, save_logits, save_dtype = "float32";
  int64_t ctx = 512, chunks = -1, save_top_k = 0;
  // dump-logits
  std::string prompt, file, prompt_ids, ids_file, continuation_ids, output, dtype = "float32",
                                                                            values;
  int64_t top_k = 0;
  CLI::Option* o_prompt = nullptr;
  // kld
  std::string base;
  // loglik
  std::string ll_input, ll_output;
  int64_t ll_ctx = 0;
  int64_t ll_max_batch = -1;  // --max-batch: the choices scored side by side (BackendFlags)
  // score
  std::string input, score_output, system_prompt;
  int64_t max_new_tokens = 256, score_ctx = 0;
  double temp = 0.0;
  std::string score_seed = "-1";  // -1 (random, printed) or a uint64
  BatchFlags batch;
  bool chat = false, think = false, no_think = false, ignore_eos = false;
  CLI::App *ppl = nullptr, *dump = nullptr, *kld = nullptr, *score = nullptr, *loglik = nullptr;
};

// Token ids a tokenizer produced must index the model's logits (a tokenizer of another model may
// not); fn::Error(Format) naming the first offending id.
void check_ids_in_vocab(const std::vector<int32_t>& ids, int64_t vocab, const std::string& what) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    FN_REQUIRE(ids[i] < vocab, Format,
               "{}: the tokenizer gave id {} (token {}), outside the model's vocabulary [0, {}): "
               "tokenizer and model do not belong together",
               what, ids[i], i, vocab);
  }
}

// The tokenizer of the model's text (-m DIR's, or --tokenizer DIR with --random-weights), checked
// against the model's vocab_size rows (load_model_tokenizer: fn::Error(Format) when its ids reach
// past them); fn::Error(Usage) naming `what` when there is none.
std::unique_ptr<Tokenizer> require_tokenizer(const CommonCli& c, const char* what,
                                             int64_t vocab_size) {
  const fs::path dir = c.tokenizer_dir();
  FN_REQUIRE(!dir.empty() && has_tokenizer(dir), Usage,
             "{} is text, but {} has no tokenizer (tokenizer.json or tokenizer.model); give "
             "token ids instead{}",
             what, c.tokenizer_source(),
             c.random_weights ? ", or --tokenizer DIR (e.g. third_party/qwen3-tokenizer)" : "");
  return load_model_tokenizer(dir, vocab_size);
}

// The tokenizer identity of the model's text (core/eval.h tokenizer_id); "ids-only" without one.
std::string model_tokenizer_id(const CommonCli& c) {
  const fs::path dir = c.tokenizer_dir();
  return dir.empty() ? std::string("ids-only") : tokenizer_id(dir);
}

// Refuses an output path that would overwrite the model's files (-m DIR) or the --config and
// --tokenizer inputs.
void require_output_outside_inputs(const std::string& path, const CommonCli& c, const char* flag) {
  if (!c.random_weights) {
    require_outside_model(path, c.model, flag);
    return;
  }
  require_not_input(path, flag, c.config, "--config");
  if (!c.tokenizer.empty()) require_outside_model(path, c.tokenizer, flag, "tokenizer directory");
}

// The collectives and this rank's model (TP = world size, apps/backend.h), as eval sees it.
struct Loaded {
  std::unique_ptr<MpiCollectives> coll;
  std::unique_ptr<Backend> backend;
};

// Checks --backend/--tp and the model's source before any input is read (whether CUDA is usable
// is decided at load).
void check_common(const CommonCli& c, MpiContext& mpi) {
  check_backend_and_tp(c.backend.backend, c.backend.tp, mpi.world_size());
  check_model_source_options(c.model, c);
  if (!c.random_weights) require_model_dir(c.model);
}

// Collective: loads the backend with room for `ctx_size` tokens per sequence (sizes the cuda
// caches; the cpu backend takes no size): -m DIR, or the --config geometry on random weights.
void load_model(Loaded& l, const CommonCli& c, const MpiContext& mpi, int64_t ctx_size) {
  l.backend = c.random_weights
                  ? load_backend_random(c.backend, c.config, static_cast<uint64_t>(c.seed), mpi,
                                        *l.coll, ctx_size, "eval")
                  : load_backend(c.backend, c.model, mpi, *l.coll, ctx_size, "eval");
}

std::vector<int32_t> broadcast_ids(Collectives& coll, std::vector<int32_t> ids) {
  int64_t n = static_cast<int64_t>(ids.size());
  coll.broadcast(&n, sizeof(n), 0);
  ids.resize(static_cast<std::size_t>(n));
  if (n > 0) coll.broadcast(ids.data(), ids.size() * sizeof(int32_t), 0);
  return ids;
}

LogitsDtype parse_dtype(const std::string& s) {
  return s == "float16" ? LogitsDtype::Float16 : LogitsDtype::Float32;
}

// ---------------------------------------------------------------- ppl

int run_ppl(EvalCli& o, MpiContext& mpi) {
  const CommonCli& c = o.ppl_c;
  const bool root = mpi.world_rank() == 0;
  const fs::path dir = c.config_source();
  Loaded l;
  l.coll = std::make_unique<MpiCollectives>(mpi.world());
  ModelConfig cfg;
  std::vector<int32_t> tokens;
  std::string tok_id = "ids-only";
  // The checks of the flags and files (rank 0's inputs too), agreed on: bad input ends every
  // rank normally with rank 0's message.
  agree_on_error(*l.coll, [&] {
    check_common(c, mpi);
    FN_REQUIRE(o.ppl_file.empty() != o.ppl_ids_file.empty(), Usage,
               "give exactly one of -f/--file (text) or --ids-file (token ids)");
    FN_REQUIRE(o.save_top_k >= 0, Usage, "--save-top-k must be >= 0, got {}", o.save_top_k);
    FN_REQUIRE(o.chunks == -1 || o.chunks >= 1, Usage,
               "--chunks must be >= 1 (or -1, the default: every window), got {}", o.chunks);
    require_output_outside_inputs(o.save_logits, c, "--save-logits");
    require_not_input(o.save_logits, "--save-logits", o.ppl_file, "-f/--file");
    require_not_input(o.save_logits, "--save-logits", o.ppl_ids_file, "--ids-file");
    cfg = load_model_config(c.config_source());
    FN_REQUIRE(o.ctx <= cfg.max_position_embeddings, Usage,
               "-c/--ctx-size {} exceeds the model's max_position_embeddings {}", o.ctx,
               cfg.max_position_embeddings);
    FN_REQUIRE(o.save_top_k <= cfg.vocab_size, Usage, "--save-top-k {} exceeds vocab_size {}",
               o.save_top_k, cfg.vocab_size);
    if (!root) return;
    // Before the load, not after it; the writer stages the file beside the path.
    check_output_path(o.save_logits, "--save-logits", /*staged_writer=*/true);
    if (!o.ppl_file.empty()) {
      const std::string text = read_file(o.ppl_file, "-f/--file");
      FN_REQUIRE(!text.empty(), Format, "-f/--file {}: the file is empty", o.ppl_file);
      const auto tok = require_tokenizer(c, "-f/--file", cfg.vocab_size);
      tokens = with_text_source("-f/--file " + o.ppl_file,
                                [&] { return tok->encode(text, EncodeMode::Raw); });
      check_ids_in_vocab(tokens, cfg.vocab_size, "-f/--file " + o.ppl_file);
      tok_id = model_tokenizer_id(c);
    } else {
      const std::string text = read_file(o.ppl_ids_file, "--ids-file");
      tokens =
          parse_token_ids(text, cfg.vocab_size, "--ids-file " + o.ppl_ids_file, ErrorKind::Format);
      FN_REQUIRE(!tokens.empty(), Format, "--ids-file {}: the file holds no token ids",
                 o.ppl_ids_file);
    }
    perplexity_sequences(tokens, o.ctx, o.chunks);  // checks the window sizes before loading
  });
  load_model(l, c, mpi, o.ctx);  // every window runs from a fresh state
  tokens = broadcast_ids(*l.coll, std::move(tokens));

  // Rank 0's file: created (staged beside <path>), and closed after the run (LogitsWriter::close
  // reports a write that failed during it, else renames the file into place), each agreed on, so
  // that every rank ends with rank 0's error (no MPI_Abort).
  std::unique_ptr<LogitsWriter> writer;
  agree_on_error(*l.coll, [&] {
    if (!root || o.save_logits.empty()) return;
    LogitsHeader h;
    h.vocab_size = cfg.vocab_size;
    h.tokenizer = tok_id;
    h.dtype = parse_dtype(o.save_dtype);
    h.mode = o.save_top_k > 0 ? LogitsMode::TopK : LogitsMode::Full;
    h.top_k = o.save_top_k;
    h.values_are_logprobs = h.mode == LogitsMode::TopK || h.dtype == LogitsDtype::Float16;
    h.sequences = perplexity_sequences(tokens, o.ctx, o.chunks);
    h.source = {{"producer", "fngen eval ppl"},
                {"model", c.model_name()},
                {"backend", l.backend->info().name},
                {"tp_size", l.coll->size()},
                {"n_ctx", o.ctx}};
    writer = std::make_unique<LogitsWriter>(o.save_logits, std::move(h), "--save-logits");
  });
  if (root) {
    FN_LOG_INFO("perplexity: {} {} tokens; calculating perplexity over {} chunks, n_ctx={}",
                o.ppl_file.empty() ? "read" : "tokenized", tokens.size(),
                perplexity_sequences(tokens, o.ctx, o.chunks).size(), o.ctx);
  }
  // The running "[i]PPL," line on stdout ends with a newline however the run ends (an error
  // after the first chunk would otherwise leave it open before the shell's prompt).
  struct ProgressLine {
    bool open = false;
    ~ProgressLine() {
      if (open && std::fputc('\n', stdout) != EOF) std::fflush(stdout);  // never throws
    }
  } progress;
  const auto t0 = std::chrono::steady_clock::now();
  const PerplexityResult r = perplexity(
      *l.backend, tokens, o.ctx, o.chunks,
      [&](int64_t i, const PerplexityResult& p) {
        agree_on_error(*l.coll, [&] {  // a failed write ends the run here, not at its end
          if (writer) writer->check();
        });
        if (root && !c.json_out) {
          write_stdout(fmt::format("[{}]{:.4f},", i + 1, p.running_ppl.back()));
          progress.open = true;
        }
      },
      writer.get(), !o.save_logits.empty());
  agree_on_error(*l.coll, [&] {
    if (writer) writer->close();
  });
  progress.open = false;  // the summary below starts with the newline
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (root) {
    if (c.json_out) {
      const json j = {{"model", c.model_name()},
                      {"backend", l.backend->info().name},
                      {"tp_size", l.coll->size()},
                      {"tokenizer", tok_id},
                      {"n_tokens", r.n_tokens},
                      {"n_ctx", r.n_ctx},
                      {"n_chunks", r.n_chunks},
                      {"n_scored", r.count},
                      {"mean_nll", r.sum_nll / static_cast<double>(r.count)},
                      {"ppl", r.ppl()},
                      {"ppl_err", r.ppl_err()},
                      {"running_ppl", r.running_ppl},
                      {"seconds", secs}};
      write_stdout(j.dump() + "\n");
    } else {
      write_stdout(
          fmt::format("\nFinal estimate: PPL = {:.4f} +/- {:.5f}\n", r.ppl(), r.ppl_err()));
      FN_LOG_INFO("perplexity: {} scored tokens in {} chunks, {:.2f} s", r.count, r.n_chunks, secs);
    }
  }
  return 0;
}

// ---------------------------------------------------------------- dump-logits

int run_dump(EvalCli& o, MpiContext& mpi) {
  const CommonCli& c = o.dump_c;
  const bool root = mpi.world_rank() == 0;
  const fs::path dir = c.config_source();
  Loaded l;
  l.coll = std::make_unique<MpiCollectives>(mpi.world());
  ModelConfig cfg;
  LogitsHeader h;
  // The checks of the flags and files (rank 0's inputs too), agreed on: bad input ends every
  // rank normally with rank 0's message.
  agree_on_error(*l.coll, [&] {
    check_common(c, mpi);
    const int sources =
        static_cast<int>(o.o_prompt->count() > 0) + static_cast<int>(!o.file.empty()) +
        static_cast<int>(!o.prompt_ids.empty()) + static_cast<int>(!o.ids_file.empty());
    FN_REQUIRE(sources == 1, Usage,
               "give exactly one of -p/--prompt, -f/--file, --prompt-ids or --ids-file (got {})",
               sources);
    FN_REQUIRE(o.top_k >= 0, Usage, "--top-k must be >= 0 (0 = full rows), got {}", o.top_k);
    FN_REQUIRE(!(o.top_k > 0 && o.values == "logits"), Usage,
               "--values logits needs full rows: --top-k stores log-probs");
    require_output_outside_inputs(o.output, c, "-o/--output");
    require_not_input(o.output, "-o/--output", o.file, "-f/--file");
    require_not_input(o.output, "-o/--output", o.ids_file, "--ids-file");
    cfg = load_model_config(c.config_source());
    FN_REQUIRE(o.top_k <= cfg.vocab_size, Usage, "--top-k {} exceeds vocab_size {}", o.top_k,
               cfg.vocab_size);
    if (!root) return;
    // Before the load, not after it; the writer stages the file beside the path.
    check_output_path(o.output, "-o/--output", /*staged_writer=*/true);
    std::vector<int32_t> ids;
    h.tokenizer = "ids-only";
    if (!o.prompt_ids.empty()) {
      ids = parse_token_ids(o.prompt_ids, cfg.vocab_size, "--prompt-ids");
    } else if (!o.ids_file.empty()) {
      ids = parse_token_ids(read_file(o.ids_file, "--ids-file"), cfg.vocab_size,
                            "--ids-file " + o.ids_file, ErrorKind::Format);
    } else {
      std::string text = o.o_prompt->count() ? o.prompt : read_file(o.file, "-f/--file");
      // An empty prompt is bad input (exit 3) from -p as from -f, as generate's.
      const std::string what = o.o_prompt->count() ? "-p/--prompt" : "-f/--file " + o.file;
      FN_REQUIRE(!text.empty(), Format, "{}: the prompt is empty", what);
      const auto tok = require_tokenizer(c, "the prompt", cfg.vocab_size);
      refuse_long_text(
          *tok, text, cfg.max_position_embeddings, what,
          fmt::format("the model's max_position_embeddings {}", cfg.max_position_embeddings));
      ids = with_text_source(what, [&] { return tok->encode(text, EncodeMode::Raw); });
      check_ids_in_vocab(ids, cfg.vocab_size, "the prompt");
      h.tokenizer = model_tokenizer_id(c);
    }
    FN_REQUIRE(!ids.empty(), Format, "the prompt has no tokens");
    const std::vector<int32_t> cont =
        parse_token_ids(o.continuation_ids, cfg.vocab_size, "--continuation-ids");
    const int64_t prompt_len = static_cast<int64_t>(ids.size());
    ids.insert(ids.end(), cont.begin(), cont.end());
    // Bad input (exit 3), as generate's prompt that its context cannot hold.
    FN_REQUIRE(static_cast<int64_t>(ids.size()) <= cfg.max_position_embeddings, Format,
               "{} tokens exceed the model's max_position_embeddings {}", ids.size(),
               cfg.max_position_embeddings);
    LogitsSequence s;
    s.tokens = std::move(ids);
    s.first = 0;
    s.n_rows = static_cast<int64_t>(s.tokens.size());
    h.sequences.push_back(std::move(s));
    h.vocab_size = cfg.vocab_size;
    h.dtype = parse_dtype(o.dtype);
    h.mode = o.top_k > 0 ? LogitsMode::TopK : LogitsMode::Full;
    h.top_k = o.top_k;
    h.values_are_logprobs = o.values.empty()
                                ? (h.mode == LogitsMode::TopK || h.dtype == LogitsDtype::Float16)
                                : o.values == "logprobs";
    h.source = {{"producer", "fngen eval dump-logits"},
                {"model", c.model_name()},
                {"tp_size", mpi.world_size()},
                {"prompt_len", prompt_len}};
  });
  LogitsSequence seq;
  if (root) seq = h.sequences[0];
  seq.tokens = broadcast_ids(*l.coll, seq.tokens);
  seq.first = 0;
  seq.n_rows = static_cast<int64_t>(seq.tokens.size());
  load_model(l, c, mpi, seq.n_rows);  // one sequence of seq.n_rows tokens
  h.source["backend"] = l.backend->info().name;
  // Rank 0's file: created (staged beside <path>) and closed (a write that failed during the run;
  // else renamed into place) on every rank's agreement, so that every rank ends with rank 0's
  // error (no MPI_Abort).
  std::unique_ptr<LogitsWriter> writer;
  agree_on_error(*l.coll, [&] {
    if (root) writer = std::make_unique<LogitsWriter>(o.output, h, "-o/--output");
  });
  // A failed write ends the run within 64 rows (agreed on), not after the last one.
  dump_logits(*l.backend, {seq}, writer.get(), [&](int64_t rows) {
    if (rows % 64 == 0)
      agree_on_error(*l.coll, [&] {
        if (writer) writer->check();
      });
  });
  agree_on_error(*l.coll, [&] {
    if (writer) writer->close();
  });
  if (root) {
    const json j = {{"output", o.output},
                    {"n_positions", seq.n_rows},
                    {"vocab_size", cfg.vocab_size},
                    {"tokenizer", h.tokenizer},
                    {"dtype", o.dtype},
                    {"mode", o.top_k > 0 ? "topk" : "full"},
                    {"top_k", o.top_k},
                    {"values", h.values_are_logprobs ? "logprobs" : "logits"}};
    if (c.json_out) {
      write_stdout(j.dump() + "\n");
    } else {
      FN_LOG_INFO("dump-logits: wrote {} rows of {} to {}", seq.n_rows, cfg.vocab_size, o.output);
    }
  }
  return 0;
}

// ---------------------------------------------------------------- kld

int run_kld(EvalCli& o, MpiContext& mpi) {
  const CommonCli& c = o.kld_c;
  const bool root = mpi.world_rank() == 0;
  const fs::path dir = c.config_source();
  Loaded l;
  l.coll = std::make_unique<MpiCollectives>(mpi.world());
  ModelConfig cfg;
  std::unique_ptr<LogitsReader> reader;
  // The checks of the flags and files (rank 0's inputs too), agreed on: bad input ends every
  // rank normally with rank 0's message.
  agree_on_error(*l.coll, [&] {
    check_common(c, mpi);
    cfg = load_model_config(c.config_source());
    if (!root) return;
    reader = std::make_unique<LogitsReader>(o.base);
    const LogitsHeader& h = reader->header();
    FN_REQUIRE(h.vocab_size == cfg.vocab_size, Format,
               "--base {}: vocab_size {} but the model {} has vocab_size {}: the file was made "
               "for another model",
               o.base, h.vocab_size, dir.string(), cfg.vocab_size);
    const std::string model_tok = model_tokenizer_id(c);
    if (h.tokenizer != "ids-only" && model_tok != "ids-only") {
      FN_REQUIRE(h.tokenizer == model_tok, Format,
                 "--base {}: made with tokenizer {} but the model {} has tokenizer {}: token ids "
                 "are not comparable",
                 o.base, h.tokenizer, dir.string(), model_tok);
    } else if (h.tokenizer != model_tok) {
      FN_LOG_WARN("--base {}: tokenizer {} vs model {}: comparing token ids as they are", o.base,
                  h.tokenizer, model_tok);
    }
    for (const auto& s : h.sequences) {
      FN_REQUIRE(s.first + s.n_rows <= cfg.max_position_embeddings, Format,
                 "--base {}: a sequence of {} positions exceeds max_position_embeddings {}", o.base,
                 s.first + s.n_rows, cfg.max_position_embeddings);
    }
    FN_LOG_INFO("kld: {} sequences, {} positions, mode {}, {} ({})", h.sequences.size(),
                h.n_positions(), h.mode == LogitsMode::Full ? "full" : "topk",
                h.dtype == LogitsDtype::Float32 ? "float32" : "float16", h.tokenizer);
  });
  int64_t kld_ctx = 1;  // the longest sequence fed (rank 0 read the header)
  if (root) {
    for (const auto& s : reader->header().sequences)
      kld_ctx = std::max(kld_ctx, s.first + s.n_rows);
  }
  l.coll->broadcast(&kld_ctx, sizeof(kld_ctx), 0);
  load_model(l, c, mpi, kld_ctx);
  if (root && !c.json_out) write_stdout(KldStats::chunk_header());
  const auto t0 = std::chrono::steady_clock::now();
  const KldStats st =
      kl_divergence(*l.backend, *l.coll, reader.get(), [&](int64_t i, const KldStats& s) {
        if (!c.json_out) write_stdout(s.chunk_line(i));
      });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (root) {
    if (c.json_out) {
      json j = st.to_json();
      j["model"] = c.model_name();
      j["base"] = o.base;
      j["backend"] = l.backend->info().name;
      j["tp_size"] = l.coll->size();
      j["seconds"] = secs;
      write_stdout(j.dump() + "\n");
    } else {
      write_stdout("\n" + st.report());
      FN_LOG_INFO("kld: {} rows in {:.2f} s", st.count(), secs);
    }
  }
  return 0;
}

// ---------------------------------------------------------------- score

// The answer a generated content string gives: the last regex match (group 1 when the pattern
// has a group), else the whole content; surrounding whitespace trimmed.
std::string trim(std::string s) {
  const auto ws = [](unsigned char ch) { return std::isspace(ch) != 0; };
  while (!s.empty() && ws(static_cast<unsigned char>(s.back()))) s.pop_back();
  std::size_t i = 0;
  while (i < s.size() && ws(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

std::optional<std::string> extract_answer(const std::string& content,
                                          const AnswerPattern* pattern) {
  if (pattern == nullptr) return trim(content);
  std::optional<std::string> last = pattern->last_match(content);
  if (last) last = trim(*last);
  return last;
}

// One task record: prompt ids (rank 0), answers, pattern. Throws fn::Error naming the field.
struct Task {
  std::string id;  // the record's "id" as written (record_id_text)
  std::string task = "default";
  std::vector<int32_t> ids;
  std::vector<std::string> answers;
  std::string regex;
  std::shared_ptr<const AnswerPattern> pattern;  // null without "regex"
  bool chat = false;
  RecordSettings settings;  // the record's sampling (its seed resolved), max_tokens and stop
};

// The fields of a score record: the task's own and the per-record sampling ones (as generate's,
// less "n": one answer is scored per task, and "logprobs": a score record reports none).
const std::set<std::string>& score_fields() {
  static const std::set<std::string> fields = [] {
    std::set<std::string> f = {"task", "answer", "regex"};
    for (const std::string_view name : kGenerateRecordFields)
      if (name != "n" && name != "logprobs") f.emplace(name);
    return f;
  }();
  return fields;
}

Task parse_task(const json& rec, const Tokenizer* tok, const EvalCli& o, int64_t vocab) {
  FN_REQUIRE(rec.is_object(), Format, "a record must be a JSON object, got {}", rec.type_name());
  Task t;
  if (rec.contains("task")) {
    FN_REQUIRE(rec["task"].is_string(), Format, "\"task\" must be a string");
    t.task = rec["task"].get<std::string>();
  }
  FN_REQUIRE(rec.contains("answer"), Format, "the record has no \"answer\"");
  const json& a = rec["answer"];
  const auto as_text = [](const json& v) {
    return v.is_string() ? v.get<std::string>() : v.dump();
  };
  if (a.is_array()) {
    for (const json& v : a) t.answers.push_back(trim(as_text(v)));
  } else {
    t.answers.push_back(trim(as_text(a)));
  }
  FN_REQUIRE(!t.answers.empty(), Format, "\"answer\" is an empty list");
  if (rec.contains("regex")) {
    FN_REQUIRE(rec["regex"].is_string(), Format, "\"regex\" must be a string");
    t.regex = rec["regex"].get<std::string>();
    t.pattern = std::make_shared<const AnswerPattern>(t.regex);
  }
  ChatOptions co;
  if (o.think) co.enable_thinking = true;
  if (o.no_think) co.enable_thinking = false;
  RecordPrompt p = record_prompt(rec, {.tokenizer = tok,
                                       .vocab_size = vocab,
                                       .chat = o.chat,
                                       .system_prompt = o.system_prompt,
                                       .chat_options = co,
                                       .model_dir = o.score_c.tokenizer_dir()});
  t.ids = std::move(p.ids);
  t.chat = p.chat;
  return t;
}

// One line of a records file (eval score, eval loglik) on rank 0: 0 when blank; else 1 with
// `parse(rec)` run on its JSON, or 2 when parsing or `parse` threw fn::Error (*error: "INPUT:
// line N: why"). *id (default: the 1-based line number) and *task take the record's "id" (its
// JSON text as written: batch_records.h record_id_text, echoed by record_line) and string "task"
// first, so an error record names them too.
template <class Parse>
int32_t read_record_line(const std::string& line, int64_t li, const std::string& input,
                         std::string* id, std::string* task, std::string* error, Parse&& parse) {
  *id = std::to_string(li + 1);
  if (line.find_first_not_of(" \t\r") == std::string::npos) return 0;
  try {
    const json rec = parse_json_line(line);
    if (rec.is_object()) *id = record_id_text(line, li + 1);
    if (rec.is_object() && rec.contains("task") && rec["task"].is_string())
      *task = rec["task"].get<std::string>();
    parse(rec);
  } catch (const Error& e) {
    *error = fmt::format("{}: line {}: {}", input, li + 1, e.what());
    return 2;
  }
  return 1;
}

int run_score(EvalCli& o, MpiContext& mpi) {
  o.score_c.backend.max_batch = o.batch.max_batch;
  const CommonCli& c = o.score_c;
  const bool root = mpi.world_rank() == 0;
  const fs::path dir = c.config_source();
  Loaded l;
  l.coll = std::make_unique<MpiCollectives>(mpi.world());
  ModelConfig cfg;
  GenerationConfig gen;
  int64_t ctx = 0;
  std::unique_ptr<Tokenizer> tok;
  std::vector<std::string> lines;
  // The checks of the flags and files (rank 0's inputs too), agreed on: bad input ends every
  // rank normally with rank 0's message.
  agree_on_error(*l.coll, [&] {
    check_common(c, mpi);
    FN_REQUIRE(!(o.think && o.no_think), Usage, "--think and --no-think exclude each other");
    require_output_outside_inputs(o.score_output, c, "-o/--output");
    require_not_input(o.score_output, "-o/--output", o.input, "-i/--input");
    FN_REQUIRE(o.max_new_tokens > 0, Usage, "-n/--max-new-tokens must be > 0, got {}",
               o.max_new_tokens);
    FN_REQUIRE(o.temp >= 0, Usage, "--temp must be >= 0, got {}", o.temp);
    require_utf8_system_prompt(o.system_prompt);
    cfg = load_model_config(c.config_source());
    gen = c.random_weights ? GenerationConfig{} : load_generation_config(dir, cfg.vocab_size);
    ctx = o.score_ctx > 0 ? o.score_ctx : std::min<int64_t>(cfg.max_position_embeddings, 4096);
    FN_REQUIRE(ctx <= cfg.max_position_embeddings, Usage,
               "-c/--ctx-size {} exceeds the model's max_position_embeddings {}", ctx,
               cfg.max_position_embeddings);
    if (!root) return;
    const fs::path tok_dir = c.tokenizer_dir();
    if (!tok_dir.empty() && has_tokenizer(tok_dir))
      tok = load_model_tokenizer(tok_dir, cfg.vocab_size);
    lines = read_jsonl_lines(o.input, "-i/--input");
  });
  Collectives& coll = *l.coll;
  load_model(l, c, mpi, ctx);
  // Each record's seed: its "seed", else splitmix64(--seed ^ line number) (batch_records.h),
  // the base drawn at random (and printed) without --seed.
  std::optional<uint64_t> given_seed;
  agree_on_error(coll, [&] {
    if (o.score_seed == "-1") return;
    uint64_t v = 0;
    const char* end = o.score_seed.data() + o.score_seed.size();
    const auto [ptr, ec] = std::from_chars(o.score_seed.data(), end, v);
    FN_REQUIRE(!o.score_seed.empty() && ec == std::errc() && ptr == end, Usage,
               "-s/--seed must be -1 (random) or an integer in [0, 18446744073709551615], got "
               "'{}'",
               o.score_seed);
    given_seed = v;
  });
  const uint64_t base_seed = batch_base_seed(given_seed, coll, "eval score");
  RecordSettings defaults;
  defaults.sampling.temperature = o.temp;
  int64_t own_temperature = 0;  // rank 0: records whose "temperature" is not --temp's
  defaults.max_new_tokens = o.max_new_tokens;
  std::set<std::string> warned;
  GenerateOptions go;
  go.sampling.temperature = o.temp;
  go.max_new_tokens = o.max_new_tokens;
  go.ctx_size = ctx;
  go.stop_token_ids = stop_token_ids(cfg, gen);
  go.ignore_eos = o.ignore_eos;
  // As generate runs a record: the batched prefill, then sampling on the device where the backend
  // has it and the record's settings allow it (no stop string, no penalty); --check-choices
  // wraps the backend in one that prefills token by token and samples on the host.

  // Rank 0 opens and writes; a failure is agreed on (every rank ends with rank 0's error, no
  // MPI_Abort), once for the open and once per record.
  std::FILE* out = stdout;
  agree_on_error(coll, [&] {
    if (!root || o.score_output.empty()) return;
    out = open_output_locked(o.score_output, true, "-o/--output");
  });
  struct Tally {
    int64_t n = 0, correct = 0, errors = 0;
  };
  std::map<std::string, Tally> tally;
  Tally total;
  // The records run side by side in the batch engine (--max-batch); each is written in input
  // order once it and every earlier one are done. Which lines are done is known on every rank
  // (the statuses and the engine's outputs are), the records themselves on rank 0.
  BatchEngine engine(
      *l.backend, coll,
      {.max_batch = l.backend->slot_count(), .prefill_budget = o.batch.prefill_budget});
  struct Running {
    Task t;
    std::unique_ptr<StreamingDetokenizer> detok;  // rank 0, with a tokenizer
  };
  std::map<int64_t, Running> running;  // by line index
  // Finished records by line index: the id as written and (rank 0) the rest of the record.
  std::map<int64_t, std::pair<std::string, json>> ready;
  int64_t next_write = 0;
  const auto write_ready = [&] {
    for (auto it = ready.begin(); it != ready.end() && it->first == next_write;
         it = ready.erase(it), ++next_write) {
      const auto& [id, body] = it->second;
      if (body.is_null()) continue;  // a blank line: no record (the same on every rank)
      write_jsonl_line_agreed(
          coll, out, [&] { return record_line(id, body); }, o.score_output);
    }
  };
  // Rank 0's record of a finished task.
  const auto score_record = [&](const Task& t, const GenerationResult& r, int64_t li) {
    std::string text = r.text;
    if (!tok) {
      // ids-only model: the text is the generated ids without the stop id, space separated.
      text.clear();
      for (const int32_t id : r.token_ids) {
        if (r.finish == FinishReason::Eos && &id == &r.token_ids.back()) break;
        text += std::to_string(id) + " ";
      }
    }
    const ReasoningSplit split = split_reasoning(text);
    // A pattern PCRE2 gives up on (its match or heap limit) makes the record an error.
    std::optional<std::string> got;
    std::string match_error;
    try {
      got = extract_answer(split.content, t.pattern.get());
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Format) throw;
      match_error = fmt::format("{}: line {}: {}", o.input, li + 1, e.what());
      FN_LOG_WARN("{}", match_error);
    }
    const bool ok =
        got.has_value() && std::find(t.answers.begin(), t.answers.end(), *got) != t.answers.end();
    Tally& tt = tally[t.task];
    ++tt.n;
    ++total.n;
    tt.correct += ok;
    total.correct += ok;
    json j = {{"task", t.task},
              {"correct", ok},
              {"extracted", got ? json(*got) : json(nullptr)},
              {"answer", t.answers.size() == 1 ? json(t.answers[0]) : json(t.answers)},
              {"content", split.content},
              {"finish_reason", finish_reason_name(r.finish)},
              {"n_prompt_tokens", r.n_prompt_tokens},
              {"n_gen_tokens", r.token_ids.size()},
              {"seed", t.settings.sampling.seed},
              {"e2e_ms", r.e2e_ms}};
    if (split.has_reasoning) j["reasoning"] = split.reasoning;
    if (!t.regex.empty()) j["regex"] = t.regex;
    if (!match_error.empty()) {
      j["error"] = match_error;
      ++tt.errors;
      ++total.errors;
    }
    return j;
  };
  int64_t n_lines = static_cast<int64_t>(lines.size());
  coll.broadcast(&n_lines, sizeof(n_lines), 0);
  int64_t li = 0;
  while (li < n_lines || engine.running() > 0) {
    // Admit the next records while slots are free.
    for (; li < n_lines && engine.free_slots() > 0; ++li) {
      int32_t status = 0;  // 0 blank, 1 run, 2 error
      Task t;
      std::string error;
      if (root) {
        status = read_record_line(
            lines[static_cast<std::size_t>(li)], li, o.input, &t.id, &t.task, &error,
            [&](const json& rec) {
              if (rec.is_object()) {
                warn_unknown_record_fields(
                    rec, [](const std::string& key) { return score_fields().count(key) > 0; },
                    warned, o.input, li + 1, "eval score");
              }
              Task parsed = parse_task(rec, tok.get(), o, cfg.vocab_size);
              parsed.id = t.id;
              t = std::move(parsed);
              t.settings = record_settings(rec, defaults, &score_fields());
              if (t.settings.sampling.temperature != defaults.sampling.temperature)
                ++own_temperature;
              if (!t.settings.seed_given)
                t.settings.sampling.seed = record_seed(base_seed, static_cast<uint64_t>(li + 1));
              FN_REQUIRE(t.settings.stop.empty() || tok != nullptr, Format,
                         "\"stop\" needs a tokenizer to match text, and {} has none", dir.string());
              FN_REQUIRE(!t.ids.empty(), Format, "the prompt has no tokens");
              const auto n_prompt = static_cast<int64_t>(t.ids.size());
              if (t.settings.max_new_tokens == -1) {
                FN_REQUIRE(n_prompt < ctx, Format,
                           "the prompt ({} tokens) leaves no room in the context size "
                           "-c/--ctx-size {} for \"max_tokens\": -1",
                           n_prompt, ctx);
                t.settings.max_new_tokens = ctx - n_prompt;
              }
              check_context(n_prompt, t.settings.max_new_tokens, ctx);
            });
      }
      coll.broadcast(&status, sizeof(status), 0);
      if (status == 0) {
        ready.emplace(li, std::pair{std::string(), json()});
        continue;
      }
      if (status == 2) {
        json j;
        if (root) {
          FN_LOG_WARN("{}", error);
          ++tally[t.task].errors;
          ++tally[t.task].n;
          ++total.errors;
          ++total.n;
          j = {{"task", t.task}, {"correct", false}, {"error", error}};
        }
        ready.emplace(li, std::pair{t.id, root ? j : json::object()});
        continue;
      }
      t.ids = broadcast_ids(coll, t.ids);
      {  // this record's settings, from rank 0
        std::string text = root ? json{{"sampling",
                                        {t.settings.sampling.temperature, t.settings.sampling.top_k,
                                         t.settings.sampling.top_p, t.settings.sampling.min_p,
                                         t.settings.sampling.repetition_penalty,
                                         t.settings.sampling.presence_penalty,
                                         t.settings.sampling.frequency_penalty}},
                                       {"seed", t.settings.sampling.seed},
                                       {"max_new", t.settings.max_new_tokens},
                                       {"stop", t.settings.stop}}
                                      .dump()
                                : std::string();
        int64_t n = static_cast<int64_t>(text.size());
        coll.broadcast(&n, sizeof(n), 0);
        text.resize(static_cast<std::size_t>(n));
        coll.broadcast(text.data(), text.size(), 0);
        const json j = json::parse(text);
        const json& sp = j.at("sampling");
        SamplingParams& p = t.settings.sampling;
        p.temperature = sp.at(0).get<double>();
        p.top_k = sp.at(1).get<int64_t>();
        p.top_p = sp.at(2).get<double>();
        p.min_p = sp.at(3).get<double>();
        p.repetition_penalty = sp.at(4).get<double>();
        p.presence_penalty = sp.at(5).get<double>();
        p.frequency_penalty = sp.at(6).get<double>();
        p.seed = j.at("seed").get<uint64_t>();
        t.settings.max_new_tokens = j.at("max_new").get<int64_t>();
        t.settings.stop = j.at("stop").get<std::vector<std::string>>();
      }
      BatchRequest req;
      req.key = li;
      req.prompt = t.ids;
      req.options = go;
      req.options.sampling = t.settings.sampling;
      req.options.max_new_tokens = t.settings.max_new_tokens;
      req.options.stop_strings = t.settings.stop;
      Running run{std::move(t), nullptr};
      if (root && tok) {
        run.detok = std::make_unique<StreamingDetokenizer>(*tok);
        StreamingDetokenizer* d = run.detok.get();
        req.hooks.feed = [d](int32_t id) { return d->feed(id); };
        req.hooks.finish = [d] { return d->finish(); };
      } else if (root) {
        req.hooks.feed = [](int32_t id) { return std::to_string(id) + " "; };
      }
      running.emplace(li, std::move(run));
      engine.admit(std::move(req));
    }
    for (BatchOutput& done : engine.step()) {
      const auto it = running.find(done.key);
      FN_CHECK(it != running.end(), "the batch engine returned an unknown record {}", done.key);
      ready.emplace(done.key, std::pair{it->second.t.id,
                                        root ? score_record(it->second.t, done.result, done.key)
                                             : json::object()});
      running.erase(it);
    }
    write_ready();
  }
  if (root) {
    if (out != stdout) std::fclose(out);
    const auto acc = [](const Tally& x) {
      return x.n > 0 ? static_cast<double>(x.correct) / static_cast<double>(x.n) : 0.0;
    };
    std::string s = fmt::format(
        "\n--- fngen eval score: backend {}, TP {}, {}{}\n", l.backend->info().name, coll.size(),
        o.temp > 0 ? fmt::format("temp {}", o.temp) : "greedy",
        own_temperature > 0
            ? fmt::format(" ({} records with a temperature of their own)", own_temperature)
            : std::string());
    s += fmt::format("{:<24} {:>6} {:>8} {:>7} {:>9}\n", "task", "n", "correct", "errors",
                     "accuracy");
    json per = json::object();
    for (const auto& [name, x] : tally) {
      s += fmt::format("{:<24} {:>6} {:>8} {:>7} {:>8.2f}%\n", name, x.n, x.correct, x.errors,
                       100.0 * acc(x));
      per[name] = {{"n", x.n}, {"correct", x.correct}, {"errors", x.errors}, {"accuracy", acc(x)}};
    }
    s += fmt::format("{:<24} {:>6} {:>8} {:>7} {:>8.2f}%\n", "TOTAL", total.n, total.correct,
                     total.errors, 100.0 * acc(total));
    std::fwrite(s.data(), 1, s.size(), stderr);
    if (c.json_out) {
      const json j = {{"summary",
                       {{"tasks", per},
                        {"total",
                         {{"n", total.n},
                          {"correct", total.correct},
                          {"errors", total.errors},
                          {"accuracy", acc(total)}}}}}};
      write_stdout(j.dump() + "\n");
    }
  }
  // As generate -i: a batch whose every record failed is a failed run (rank 0 counted them).
  agree_on_error(coll, [&] {
    FN_REQUIRE(!root || total.n == 0 || total.errors < total.n, Format,
               "-i/--input {}: every record failed ({} of {}; see their \"error\" fields)", o.input,
               total.errors, total.n);
  });
  return 0;
}

// ---------------------------------------------------------------- loglik

// One multiple-choice record (rank 0): the context and choice ids, each choice's byte length
// (acc_norm's divisor) and the answer index. Throws fn::Error(Format) naming the field.
struct McItem {
  std::string id;  // the record's "id" as written (record_id_text)
  std::string task = "default";
  std::vector<int32_t> context;
  std::vector<std::vector<int32_t>> choices;
  std::vector<int64_t> choice_bytes;
  int64_t answer = 0;
};

std::vector<int32_t> json_ids(const json& v, int64_t vocab, const std::string& what) {
  FN_REQUIRE(v.is_array(), Format, "{} must be a list of token ids", what);
  std::vector<int32_t> ids;
  for (std::size_t i = 0; i < v.size(); ++i) {
    FN_REQUIRE(v[i].is_number_integer() && v[i].get<int64_t>() >= 0 && v[i].get<int64_t>() < vocab,
               Format, "{}[{}] = {} is not an id in [0, {})", what, i, v[i].dump(), vocab);
    ids.push_back(v[i].get<int32_t>());
  }
  return ids;
}

// lm-evaluation-harness' pair encoding: the context's trailing whitespace moves to the
// continuation, the continuation's ids are those of encode(context + continuation) past
// encode(context)'s (so a merge across the boundary is the tokenizer's own); when the context's
// ids are not a prefix of the whole's, the continuation is encoded alone.
std::vector<int32_t> continuation_ids(const Tokenizer& tok, const std::vector<int32_t>& ctx_ids,
                                      const std::string& context, const std::string& cont) {
  const std::vector<int32_t> whole = tok.encode(context + cont, EncodeMode::Raw);
  if (whole.size() > ctx_ids.size() && std::equal(ctx_ids.begin(), ctx_ids.end(), whole.begin()))
    return {whole.begin() + static_cast<std::ptrdiff_t>(ctx_ids.size()), whole.end()};
  return tok.encode(cont, EncodeMode::Raw);
}

McItem parse_mc(const json& rec, const Tokenizer* tok, int64_t vocab) {
  FN_REQUIRE(rec.is_object(), Format, "a record must be a JSON object, got {}", rec.type_name());
  McItem m;
  if (rec.contains("task")) {
    FN_REQUIRE(rec["task"].is_string(), Format, "\"task\" must be a string");
    m.task = rec["task"].get<std::string>();
  }
  FN_REQUIRE(rec.contains("context") != rec.contains("context_ids"), Format,
             "a record needs exactly one of \"context\" or \"context_ids\"");
  FN_REQUIRE(rec.contains("choices") && rec["choices"].is_array() && !rec["choices"].empty(),
             Format, "\"choices\" must be a non-empty list");
  const json& ch = rec["choices"];
  FN_REQUIRE(rec.contains("answer") && rec["answer"].is_number_integer(), Format,
             "\"answer\" must be the index of the right choice");
  const json& answer = rec["answer"];
  FN_REQUIRE(
      answer.is_number_unsigned() && answer.get<uint64_t>() < static_cast<uint64_t>(ch.size()),
      Format, "\"answer\" {} is not an index of the {} choices", answer.dump(), ch.size());
  m.answer = static_cast<int64_t>(answer.get<uint64_t>());
  std::string context;
  if (rec.contains("context_ids")) {
    m.context = json_ids(rec["context_ids"], vocab, "\"context_ids\"");
  } else {
    FN_REQUIRE(rec["context"].is_string(), Format, "\"context\" must be a string");
    FN_REQUIRE(tok != nullptr, Format,
               "the record is text but there is no tokenizer; use \"context_ids\"");
    context = rec["context"].get<std::string>();
  }
  // lm-eval: trailing whitespace of the context belongs to the continuation.
  std::string moved;
  while (!context.empty() && (context.back() == ' ' || context.back() == '\t')) {
    moved.insert(moved.begin(), context.back());
    context.pop_back();
  }
  if (rec.contains("context")) m.context = tok->encode(context, EncodeMode::Raw);
  FN_REQUIRE(!m.context.empty(), Format, "the context has no tokens");
  for (std::size_t i = 0; i < ch.size(); ++i) {
    const std::string what = fmt::format("\"choices\"[{}]", i);
    if (ch[i].is_array()) {
      m.choices.push_back(json_ids(ch[i], vocab, what));
      // Ids: the byte length of their text when a tokenizer can give it, else their count.
      m.choice_bytes.push_back(tok ? static_cast<int64_t>(tok->decode(m.choices.back()).size())
                                   : static_cast<int64_t>(m.choices.back().size()));
    } else {
      FN_REQUIRE(ch[i].is_string(), Format, "{} must be a string or a list of token ids", what);
      FN_REQUIRE(tok != nullptr, Format, "{} is text but there is no tokenizer", what);
      const std::string cont = moved + ch[i].get<std::string>();
      m.choices.push_back(rec.contains("context") ? continuation_ids(*tok, m.context, context, cont)
                                                  : tok->encode(cont, EncodeMode::Raw));
      m.choice_bytes.push_back(static_cast<int64_t>(ch[i].get<std::string>().size()));
    }
    FN_REQUIRE(!m.choices.back().empty(), Format, "{} has no tokens", what);
    check_ids_in_vocab(m.choices.back(), vocab, what);
  }
  check_ids_in_vocab(m.context, vocab, "the context");
  return m;
}

int run_loglik(EvalCli& o, MpiContext& mpi) {
  o.loglik_c.backend.max_batch = o.ll_max_batch;
  // Items are short and many: on cuda as many slots as fit, and passes of kLoglikPrefillChunk rows
  // (many items' tokens each, with pass buffers small enough to leave the room to the slots).
  o.loglik_c.backend.cuda_default_slots = 0;
  if (o.loglik_c.backend.o_prefill_chunk != nullptr &&
      o.loglik_c.backend.o_prefill_chunk->count() == 0)
    o.loglik_c.backend.prefill_chunk = kLoglikPrefillChunk;
  const CommonCli& c = o.loglik_c;
  const bool root = mpi.world_rank() == 0;
  const fs::path dir = c.config_source();
  Loaded l;
  l.coll = std::make_unique<MpiCollectives>(mpi.world());
  ModelConfig cfg;
  int64_t ctx = 0;
  std::unique_ptr<Tokenizer> tok;
  std::vector<std::string> lines;
  agree_on_error(*l.coll, [&] {
    check_common(c, mpi);
    require_output_outside_inputs(o.ll_output, c, "-o/--output");
    require_not_input(o.ll_output, "-o/--output", o.ll_input, "-i/--input");
    cfg = load_model_config(dir);
    ctx = o.ll_ctx > 0 ? o.ll_ctx : std::min<int64_t>(cfg.max_position_embeddings, 4096);
    FN_REQUIRE(ctx <= cfg.max_position_embeddings, Usage,
               "-c/--ctx-size {} exceeds the model's max_position_embeddings {}", ctx,
               cfg.max_position_embeddings);
    if (!root) return;
    check_output_path(o.ll_output, "-o/--output");
    const fs::path tok_dir = c.tokenizer_dir();
    if (!tok_dir.empty() && has_tokenizer(tok_dir))
      tok = load_model_tokenizer(tok_dir, cfg.vocab_size);
    lines = read_jsonl_lines(o.ll_input, "-i/--input");
  });
  Collectives& coll = *l.coll;
  load_model(l, c, mpi, ctx);
  std::FILE* out = stdout;
  agree_on_error(coll, [&] {
    if (!root || o.ll_output.empty()) return;
    out = open_output_locked(o.ll_output, true, "-o/--output");
  });
  struct Tally {
    int64_t n = 0, correct = 0, correct_norm = 0, errors = 0;
  };
  std::map<std::string, Tally> tally;
  Tally total;
  int64_t n_lines = static_cast<int64_t>(lines.size());
  coll.broadcast(&n_lines, sizeof(n_lines), 0);
  const auto t0 = std::chrono::steady_clock::now();
  int64_t n_choices = 0;
  // Lines run in windows: consecutive lines whose items' choices together fit the backend's
  // slots (score_items runs them side by side; an item with more choices than slots is a window
  // of its own), written in input order after each window.
  const int64_t slots = l.backend->slot_count();
  constexpr int64_t kWindowLines = 4096;
  struct Line {
    int32_t status = 0;  // 0 blank, 1 run, 2 error
    McItem m;
    std::string error;
  };
  std::set<std::string> warned;  // unknown field names already warned about
  const auto parse_line = [&](int64_t li) {
    Line x;
    x.status = read_record_line(
        lines[static_cast<std::size_t>(li)], li, o.ll_input, &x.m.id, &x.m.task, &x.error,
        [&](const json& rec) {
          static const std::set<std::string> known = {"id",          "task",    "context",
                                                      "context_ids", "choices", "answer"};
          if (rec.is_object()) {
            for (const auto& [key, value] : rec.items()) {
              if (known.count(key) || !warned.insert(key).second) continue;
              FN_LOG_WARN(
                  "{}: line {}: field \"{}\" is not one fngen eval loglik reads; ignored (said "
                  "once per field name)",
                  o.ll_input, li + 1, key);
            }
          }
          McItem parsed = parse_mc(rec, tok.get(), cfg.vocab_size);
          parsed.id = x.m.id;
          x.m = std::move(parsed);
          for (std::size_t i = 0; i < x.m.choices.size(); ++i) {
            const int64_t need =
                static_cast<int64_t>(x.m.context.size() + x.m.choices[i].size()) - 1;
            FN_REQUIRE(need <= ctx, Format,
                       "the context and choice {} need {} tokens, more than -c/--ctx-size {}", i,
                       need, ctx);
          }
        });
    return x;
  };
  for (int64_t li = 0; li < n_lines;) {
    std::vector<Line> window;
    if (root) {
      int64_t used = 0;
      // At most kWindowLines lines (blank and bad lines hold no slot but memory).
      for (int64_t at = li; at < n_lines && at - li < kWindowLines; ++at) {
        Line x = parse_line(at);
        if (x.status == 1) {
          const auto k = static_cast<int64_t>(x.m.choices.size());
          if (used > 0 && used + k > slots) break;
          used += k;
        }
        window.push_back(std::move(x));
      }
    }
    int64_t count = static_cast<int64_t>(window.size());
    coll.broadcast(&count, sizeof(count), 0);
    window.resize(static_cast<std::size_t>(count));
    std::vector<int32_t> status(window.size());
    for (std::size_t i = 0; i < window.size(); ++i) status[i] = window[i].status;
    coll.broadcast(status.data(), status.size() * sizeof(int32_t), 0);
    std::vector<ChoiceItem> batch;
    for (std::size_t i = 0; i < window.size(); ++i) {
      Line& x = window[i];
      x.status = status[i];
      if (x.status != 1) continue;
      x.m.context = broadcast_ids(coll, x.m.context);
      int64_t k = static_cast<int64_t>(x.m.choices.size());
      coll.broadcast(&k, sizeof(k), 0);
      x.m.choices.resize(static_cast<std::size_t>(k));
      for (auto& ch : x.m.choices) ch = broadcast_ids(coll, ch);
      n_choices += k;
      batch.push_back({x.m.context, x.m.choices});
    }
    const std::vector<std::vector<ChoiceScore>> scores = score_items(*l.backend, batch);
    std::size_t next_score = 0;
    for (Line& x : window) {
      McItem& m = x.m;
      if (x.status == 0) continue;
      if (x.status == 2) {
        if (root) {
          FN_LOG_WARN("{}", x.error);
          ++tally[m.task].errors;
          ++tally[m.task].n;
          ++total.errors;
          ++total.n;
        }
        write_jsonl_line_agreed(
            coll, out,
            [&] {
              return record_line(m.id, json{{"task", m.task}, {"error", x.error}});
            },
            o.ll_output);
        continue;
      }
      const std::vector<ChoiceScore>& sc = scores[next_score++];
      json j;
      if (root) {
        std::vector<double> ll, ll_norm;
        json per = json::array();
        for (std::size_t i = 0; i < sc.size(); ++i) {
          const double bytes = static_cast<double>(std::max<int64_t>(m.choice_bytes[i], 1));
          ll.push_back(sc[i].logprob);
          ll_norm.push_back(sc[i].logprob / bytes);
          per.push_back({{"logprob", sc[i].logprob},
                         {"n_tokens", sc[i].n_tokens},
                         {"n_bytes", m.choice_bytes[i]},
                         {"greedy", sc[i].greedy}});
        }
        const int64_t pred = best_choice(ll), pred_norm = best_choice(ll_norm);
        Tally& tt = tally[m.task];
        ++tt.n;
        ++total.n;
        tt.correct += pred == m.answer;
        total.correct += pred == m.answer;
        tt.correct_norm += pred_norm == m.answer;
        total.correct_norm += pred_norm == m.answer;
        j = {{"task", m.task},
             {"answer", m.answer},
             {"pred", pred},
             {"pred_norm", pred_norm},
             {"correct", pred == m.answer},
             {"correct_norm", pred_norm == m.answer},
             {"n_context_tokens", m.context.size()},
             {"choices", per}};
      }
      write_jsonl_line_agreed(
          coll, out, [&] { return record_line(m.id, j); }, o.ll_output);
    }
    li += count;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (root) {
    if (out != stdout) std::fclose(out);
    const auto frac = [](int64_t a, int64_t n) {
      return n > 0 ? static_cast<double>(a) / static_cast<double>(n) : 0.0;
    };
    std::string s =
        fmt::format("\n--- fngen eval loglik: backend {}, TP {}, {} choices in {:.2f} s\n",
                    l.backend->info().name, coll.size(), n_choices, secs);
    s += fmt::format("{:<24} {:>6} {:>7} {:>9} {:>9}\n", "task", "n", "errors", "acc", "acc_norm");
    json per = json::object();
    const auto line = [&](const std::string& name, const Tally& x) {
      s += fmt::format("{:<24} {:>6} {:>7} {:>8.2f}% {:>8.2f}%\n", name, x.n, x.errors,
                       100.0 * frac(x.correct, x.n), 100.0 * frac(x.correct_norm, x.n));
      return json{{"n", x.n},
                  {"errors", x.errors},
                  {"acc", frac(x.correct, x.n)},
                  {"acc_norm", frac(x.correct_norm, x.n)}};
    };
    for (const auto& [name, x] : tally) per[name] = line(name, x);
    const json tot = line("TOTAL", total);
    std::fwrite(s.data(), 1, s.size(), stderr);
    if (c.json_out)
      write_stdout(json{{"summary", {{"tasks", per}, {"total", tot}, {"seconds", secs}}}}.dump() +
                   "\n");
  }
  agree_on_error(coll, [&] {
    FN_REQUIRE(!root || total.n == 0 || total.errors < total.n, Format,
               "-i/--input {}: every record failed ({} of {}; see their \"error\" fields)",
               o.ll_input, total.errors, total.n);
  });
  return 0;
}

void add_common(CLI::App* sub, CommonCli& c) {
  add_model_source_options(sub, c.model, c, "text inputs");
  add_backend_flags(sub, c.backend);
  sub->add_flag("--json", c.json_out, "print the result as JSON on stdout");
}

}  // namespace

void register_eval(CLI::App& app, CommandList& commands) {
  auto o = std::make_shared<EvalCli>();
  CLI::App* ev = app.add_subcommand(
      "eval",
      "quality evaluation: ppl, dump-logits, kld --base FILE, loglik, score (mpirun -np N: TP N)");
  ev->require_subcommand(1);

  o->ppl = ev->add_subcommand("ppl",
                              "llama-perplexity: windows of -c tokens, the second half of "
                              "each scored; running PPL per chunk, final estimate ± error");
  add_common(o->ppl, o->ppl_c);
  o->ppl->add_option("-f,--file", o->ppl_file, "raw text file (tokenized whole, no BOS)");
  o->ppl->add_option("--ids-file", o->ppl_ids_file,
                     "token ids instead of text (comma/whitespace separated)");
  add_whole_option(o->ppl, "-c,--ctx-size", o->ctx, "window size in tokens (default 512)",
                   WholeRange(4, kMaxTokenCount).because("a perplexity window needs 4 tokens"));
  add_whole_option(o->ppl, "--chunks", o->chunks,
                   "score at most this many windows (default -1: all)", WholeRange(1).or_value(-1));
  o->ppl
      ->add_option("--save-logits", o->save_logits,
                   "also write the scored rows as a reference-logits file (a kld --base)")
      ->check(non_empty_path());
  o->ppl->add_option("--save-dtype", o->save_dtype, "float32 | float16 (default float32)")
      ->check(CLI::IsMember({"float32", "float16"}));
  add_whole_option(o->ppl, "--save-top-k", o->save_top_k,
                   "store only the top K log-probs + residual", {});

  o->dump = ev->add_subcommand(
      "dump-logits", "teacher-forced logits of every position of the prompt (+ continuation)");
  add_common(o->dump, o->dump_c);
  o->o_prompt = o->dump->add_option("-p,--prompt", o->prompt, "prompt text");
  o->dump->add_option("-f,--file", o->file, "file holding the prompt text");
  o->dump->add_option("--prompt-ids", o->prompt_ids, "prompt as token ids: 1,2,3");
  o->dump->add_option("--ids-file", o->ids_file, "file of prompt token ids");
  o->dump->add_option("--continuation-ids", o->continuation_ids,
                      "token ids fed after the prompt (teacher-forced)");
  o->dump->add_option("-o,--output", o->output, "reference-logits file to write")
      ->required()
      ->check(non_empty_path())
      ->check([](const std::string& s) {
        return s == "-" ? std::string("'-': the reference-logits file is binary, give a file path")
                        : std::string();
      });
  o->dump->add_option("--dtype", o->dtype, "float32 | float16 (default float32)")
      ->check(CLI::IsMember({"float32", "float16"}));
  add_whole_option(o->dump, "--top-k", o->top_k,
                   "store only the top K log-probs + residual (0 = all)", {});
  o->dump
      ->add_option("--values", o->values,
                   "logits | logprobs (default: logits for full float32, else logprobs)")
      ->check(CLI::IsMember({"logits", "logprobs"}));

  o->kld = ev->add_subcommand("kld", "KL divergence of this model against a reference-logits file");
  add_common(o->kld, o->kld_c);
  o->kld
      ->add_option("--base", o->base,
                   "reference-logits file (dump-logits, ppl --save-logits, "
                   "scripts/reference/dump_reference_logits.py)")
      ->required();

  o->score = ev->add_subcommand(
      "score",
      "generate per task (JSONL: prompt|prompt_ids|messages, answer, optional regex, "
      "task, id) and score the answer after stripping <think>...</think>");
  add_common(o->score, o->score_c);
  o->score->add_option("-i,--input", o->input, "tasks JSONL")->required();
  add_stdout_option(o->score, "-o,--output", o->score_output, "JSONL records");
  add_whole_option(o->score, "-n,--max-new-tokens,--n-predict", o->max_new_tokens,
                   "tokens to generate per task (default 256)", WholeRange(1, kMaxTokenCount));
  add_whole_option(o->score, "-c,--ctx-size", o->score_ctx,
                   "context size (default, or 0: min(max_position_embeddings, 4096))",
                   WholeRange(0, kMaxTokenCount));
  add_real_option(o->score, "--temp", o->temp, "temperature (default 0 = greedy)");
  add_whole_option(o->score, "-s,--seed", o->score_seed,
                   "RNG seed (-1 = random, printed): each task's seed is splitmix64(seed ^ line "
                   "number) unless the record gives \"seed\"; records may also set "
                   "\"temperature\", \"top_k\", \"top_p\", \"min_p\", \"repeat_penalty\", "
                   "\"presence_penalty\", \"frequency_penalty\", \"max_tokens\" and \"stop\"",
                   WholeRange(0, std::numeric_limits<uint64_t>::max()).or_value(-1));
  o->score->add_flag("--chat", o->chat, "render \"prompt\" as a user turn of the chat template");
  o->score->add_option("--system-prompt", o->system_prompt, "system turn for chat prompts");
  o->score->add_flag("--think", o->think, "chat: thinking on");
  o->score->add_flag("--no-think", o->no_think, "chat: thinking off");
  o->score->add_flag("--ignore-eos", o->ignore_eos, "do not stop on the EOS ids");
  add_batch_flags(o->score, o->batch);

  o->loglik = ev->add_subcommand(
      "loglik",
      "multiple-choice log-likelihood (JSONL: id, context|context_ids, choices, answer, task): "
      "acc and acc_norm per task, every choice's log-prob per record");
  add_common(o->loglik, o->loglik_c);
  // loglik's own default pass size (run_loglik applies it when the flag is not given).
  o->loglik_c.backend.o_prefill_chunk
      ->description(fmt::format("cuda: tokens per batched prefill pass (a pass holds several "
                                "items' contexts or choices; default {} for loglik)",
                                kLoglikPrefillChunk))
      ->default_str(std::to_string(kLoglikPrefillChunk));
  o->loglik->add_option("-i,--input", o->ll_input, "items JSONL")->required();
  add_stdout_option(o->loglik, "-o,--output", o->ll_output, "JSONL records");
  add_whole_option(o->loglik, "-c,--ctx-size", o->ll_ctx,
                   "context size (default, or 0: min(max_position_embeddings, 4096))",
                   WholeRange(0, kMaxTokenCount));
  add_whole_option(o->loglik, "--max-batch", o->ll_max_batch,
                   fmt::format("choices scored side by side, each on a sequence slot of its own "
                               "(the items whose choices fit run in shared prefill passes); "
                               "default (and 0): {} on cpu, as many as fit the GPU's free memory "
                               "on cuda (at most 64)",
                               kDefaultCpuSlots),
                   WholeRange(0, kMaxBatchSlots));

  commands.push_back({ev, [o](MpiContext& mpi) {
                        if (o->ppl->parsed()) return run_ppl(*o, mpi);
                        if (o->dump->parsed()) return run_dump(*o, mpi);
                        if (o->kld->parsed()) return run_kld(*o, mpi);
                        if (o->loglik->parsed()) return run_loglik(*o, mpi);
                        return run_score(*o, mpi);
                      }});
}

}  // namespace fn
