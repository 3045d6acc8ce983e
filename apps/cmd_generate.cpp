// `fngen generate`: the main job (docs/design.md "The main job, end to end"), launched as
// `mpirun -np N fngen generate -m DIR -p "..."`. TP size = world size; the model is loaded by
// apps/backend.h (--backend cpu|cuda|auto), the CPU one with MpiCollectives over MPI_COMM_WORLD.
// Rank 0 reads the tokenizer and the prompt(s) and broadcasts the token ids; every rank runs the
// generation loop (core/generate.h); rank 0 streams the text and prints the summary (stderr) or
// JSON (--json, stdout). Batch mode (-i in.jsonl [-o out.jsonl] [--resume]) is
// apps/batch_generate.h: one output record per input record and sample, in order, per-record
// sampling fields and seeds, --tp T below the world size for data-parallel groups; a bad record
// gets an "error" and the run goes on.
//
// Sampling defaults: generation_config.json's temperature, top_k, top_p, min_p,
// repetition_penalty and presence_penalty when present (do_sample false means greedy), as HF and
// vLLM do; without a value the neutral setting (temperature 1, no top-k/top-p/min-p cut, no
// penalty). Flags override both. Context: -c/--ctx-size, default min(max_position_embeddings,
// 4096) (llama.cpp's default size).
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>

#include "apps/app_util.h"
#include "apps/backend.h"
#include "apps/batch_generate.h"
#include "apps/command.h"
#include "apps/real_number.h"
#include "apps/whole_number.h"
#include "comm/mpi_collectives.h"
#include "comm/mpi_context.h"
#include "core/config.h"
#include "core/error.h"
#include "core/eval.h"
#include "core/generate.h"
#include "core/log.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace fn {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

struct GenerateCli {
  std::string model, prompt, file, prompt_ids, input, output, system_prompt;
  // --random-weights --config FILE [--tokenizer DIR] [--weights-seed S]: the full geometry on
  // random device weights (cuda), to time generation without a checkpoint, as bench and eval.
  RandomWeightsCli rw;
  std::string chat_template;
  BackendFlags backend;
  BatchFlags batch;                          // -i only
  int64_t max_new_tokens = 0, ctx_size = 0;  // max_new_tokens 0: the default (kDefaultNewTokens)
  double temp = 1.0, top_p = 1.0, min_p = 0.0, repeat_penalty = 1.0, presence = 0.0,
         frequency = 0.0;
  int64_t top_k = 0, repeat_last_n = 64;
  std::string seed = "-1";  // -1 or a uint64 (the printed random seeds reach 2^64 - 1)
  std::vector<std::string> stop;
  bool ignore_eos = false, chat = false, think = false, no_think = false, json_out = false;
  bool host_sampling = false, resume = false;
  int64_t logprobs = -1;  // --logprobs K; -1: not given
  // Set when the flag was given (CLI11 count), so that it overrides generation_config.json.
  CLI::Option *o_temp = nullptr, *o_top_k = nullptr, *o_top_p = nullptr, *o_min_p = nullptr,
              *o_repeat_penalty = nullptr, *o_presence = nullptr, *o_prompt = nullptr,
              *o_prompt_ids = nullptr, *o_model = nullptr;
};

// Rank 0's view of the model directory's text side.
struct TextSide {
  fs::path dir;
  std::unique_ptr<Tokenizer> tokenizer;  // null when the directory has none
  ChatOptions chat;
  std::string system_prompt;

  void require_tokenizer(const char* what) const {
    FN_REQUIRE(tokenizer != nullptr, Usage,
               "{} is text, but {} has no tokenizer (tokenizer.json or tokenizer.model); give "
               "token ids instead (--prompt-ids, or \"prompt_ids\" in JSONL)",
               what, tokenizer_source(dir));
  }

  // `what` names the text's origin ("-p/--prompt", "-f/--file PATH"); a Format error of the
  // tokenizer (invalid UTF-8 at byte N) is restated with it. ctx > 0: a text many times the
  // context is refused from its prefix first (refuse_long_text; Format, exit 3, as check_room's
  // prompt the context cannot hold).
  std::vector<int32_t> encode_text(const std::string& text, bool as_chat, const std::string& what,
                                   int64_t ctx = 0) const {
    require_tokenizer(what.c_str());
    if (ctx > 0)
      refuse_long_text(*tokenizer, text, ctx, what,
                       fmt::format("the context size -c/--ctx-size {}", ctx));
    return with_text_source(what, [&] {
      if (!as_chat) return tokenizer->encode(text, EncodeMode::Raw);
      std::vector<ChatMessage> msgs;
      if (!system_prompt.empty()) msgs.push_back({"system", system_prompt, std::nullopt});
      msgs.push_back({"user", text, std::nullopt});
      return encode_chat(*tokenizer, msgs, chat);
    });
  }
};

// Human summary of one generation on stderr (llama.cpp-style lines that scripts can grep).
void print_summary(const GenerationResult& r, const std::vector<double>& mem,
                   const std::string& backend, double load_ms, int tp, int64_t ctx,
                   const SamplingParams& s) {
  std::string out;
  out += fmt::format("\n--- fngen generate: backend {}, TP {}, ctx {}, {}\n", backend, tp, ctx,
                     sampling_text(s));
  out += fmt::format("load time        = {:10.2f} ms\n", load_ms);
  out += fmt::format(
      "prompt eval time = {:10.2f} ms / {:5} tokens ({:8.2f} ms per token, {:8.2f} tokens per "
      "second)\n",
      r.prefill_ms, r.n_prompt_tokens,
      r.n_prompt_tokens > 0 ? r.prefill_ms / static_cast<double>(r.n_prompt_tokens) : 0.0,
      r.prefill_tokens_per_s);
  out += fmt::format("TTFT             = {:10.2f} ms\n", r.ttft_ms);
  if (r.itl_ms.empty()) {  // one token generated: no inter-token gap, so no decode rate
    out += "eval time        = n/a (one token generated: no inter-token gap)\n";
    out += "TPOT ms          = n/a\n";
  } else {
    out += fmt::format(
        "eval time        = {:10.2f} ms / {:5} tokens ({:8.2f} ms per token, {:8.2f} tokens per "
        "second)\n",
        r.e2e_ms - r.ttft_ms, r.itl_ms.size(), r.tpot.mean, r.decode_tokens_per_s);
    out += fmt::format(
        "TPOT ms          = mean {:.3f}  p50 {:.3f}  p90 {:.3f}  p99 {:.3f}  max {:.3f}\n",
        r.tpot.mean, r.tpot.p50, r.tpot.p90, r.tpot.p99, r.tpot.max);
  }
  std::string per;
  const std::size_t shown = std::min<std::size_t>(r.itl_ms.size(), 64);
  for (std::size_t i = 0; i < shown; ++i) per += fmt::format(" {:.2f}", r.itl_ms[i]);
  if (shown < r.itl_ms.size()) per += fmt::format(" ... ({} more)", r.itl_ms.size() - shown);
  out += fmt::format("per-token ms     ={}\n", per);
  out += fmt::format("total time       = {:10.2f} ms / {:5} tokens generated (finish: {})\n",
                     r.e2e_ms, r.token_ids.size(), finish_reason_name(r.finish));
  out += fmt::format("peak host memory (MiB, per rank):{}\n", memory_text(mem));
  std::fwrite(out.data(), 1, out.size(), stderr);
  std::fflush(stderr);
}

// Broadcasts a vector of ids from rank 0 (size first).
std::vector<int32_t> broadcast_ids(Collectives& coll, std::vector<int32_t> ids) {
  int64_t n = static_cast<int64_t>(ids.size());
  coll.broadcast(&n, sizeof(n), 0);
  ids.resize(static_cast<std::size_t>(n));
  if (n > 0) coll.broadcast(ids.data(), ids.size() * sizeof(int32_t), 0);
  return ids;
}

// What run_generate settles before the prompts and the load: the model's config, the context
// size, the sampling parameters (generation_config.json, then flags) and the seed.
struct GenerateSetup {
  ModelConfig cfg;
  GenerationConfig gen;
  int64_t ctx = 0;
  SamplingParams sampling;
  bool random_seed = false;
  uint64_t seed = 0;  // when !random_seed
};

// run_generate's checks of the flags, the model directory's config files and -o (on rank 0
// only), with no communication. Throws fn::Error: Usage for the flags, Io/Format for the files.
GenerateSetup setup_generate(const GenerateCli& o, int world_size, bool root) {
  GenerateSetup st;
  if (o.input.empty()) {
    check_backend_and_tp(o.backend.backend, o.backend.tp, world_size);
  } else {  // a batch: --tp may split the ranks into data-parallel groups
    check_backend_and_tp(o.backend.backend, 0, world_size);
    check_batch_tp(o.backend.tp, world_size);
  }
  const int sources =
      static_cast<int>(o.o_prompt->count() > 0) + static_cast<int>(!o.file.empty()) +
      static_cast<int>(o.o_prompt_ids->count() > 0) + static_cast<int>(!o.input.empty());
  FN_REQUIRE(sources == 1, Usage,
             "give exactly one of -p/--prompt, -f/--file, --prompt-ids or -i/--input (got {})",
             sources);
  FN_REQUIRE(o.output.empty() || !o.input.empty(), Usage,
             "-o/--output needs -i/--input (batch mode)");
  FN_REQUIRE(!o.resume || !o.output.empty(), Usage,
             "--resume needs -o/--output (the file of an earlier run to append to)");
  FN_REQUIRE(!(o.think && o.no_think), Usage, "--think and --no-think exclude each other");
  FN_REQUIRE(!(o.chat && o.o_prompt_ids->count() > 0), Usage,
             "--chat renders a text prompt with the chat template; --prompt-ids are fed as given "
             "(drop --chat, or give the text with -p/--prompt)");
  for (const std::string& stop : o.stop) {
    FN_REQUIRE(!stop.empty(), Usage, "--stop: an empty stop string would stop at once");
    // The text a stop string is matched against is decoded lossily (valid UTF-8), so an invalid
    // one could never match: refused instead of ignored.
    const size_t bad = unicode::find_invalid_utf8(stop);
    FN_REQUIRE(bad == std::string::npos, Usage,
               "--stop: invalid UTF-8 at byte offset {} (byte 0x{:02X}); the generated text it "
               "is matched against is valid UTF-8, so it could never match",
               bad, bad == std::string::npos ? 0 : static_cast<unsigned char>(stop[bad]));
  }
  require_chat_prompt({.system_prompt = !o.system_prompt.empty(),
                       .think = o.think,
                       .no_think = o.no_think,
                       .chat_template = !o.chat_template.empty()},
                      o.chat || !o.input.empty());
  require_utf8_system_prompt(o.system_prompt);

  check_model_source_options(o.model, o.rw);
  if (!o.rw.random_weights) require_model_dir(o.model);
  if (root) {
    // -o: never a checkpoint file nor the -i file (nor --config / --tokenizer's), and writable
    // before the model loads; the file is opened (truncated) after the load, when the first
    // record is ready.
    if (o.rw.random_weights) {
      require_not_input(o.output, "-o/--output", o.rw.config, "--config");
      if (!o.rw.tokenizer.empty())
        require_outside_model(o.output, o.rw.tokenizer, "-o/--output", "tokenizer directory");
    } else {
      require_outside_model(o.output, o.model, "-o/--output");
    }
    require_not_input(o.output, "-o/--output", o.input, "-i/--input");
    check_output_path(o.output, "-o/--output");
  }
  // Random weights: the --config file's geometry and no generation_config.json (the flags and
  // the built-in defaults alone).
  const fs::path dir = o.rw.random_weights ? fs::path(o.rw.config) : fs::path(o.model);
  st.cfg = load_model_config(dir);
  const ModelConfig& cfg = st.cfg;
  st.gen = o.rw.random_weights ? GenerationConfig{} : load_generation_config(dir, cfg.vocab_size);
  const GenerationConfig& gen = st.gen;
  st.ctx = o.ctx_size > 0 ? o.ctx_size : std::min<int64_t>(cfg.max_position_embeddings, 4096);
  FN_REQUIRE(o.ctx_size >= 0, Usage, "-c/--ctx-size must be >= 0 (0 = the default), got {}",
             o.ctx_size);
  FN_REQUIRE(st.ctx <= cfg.max_position_embeddings, Usage,
             "-c/--ctx-size {} exceeds the model's max_position_embeddings {}", st.ctx,
             cfg.max_position_embeddings);
  FN_REQUIRE(o.max_new_tokens >= 0 || o.max_new_tokens == -1, Usage,
             "-n/--max-new-tokens must be > 0 or -1 (until the context is full), got {}",
             o.max_new_tokens);

  // Sampling: generation_config.json, then flags.
  SamplingParams& sp = st.sampling;
  if (gen.temperature) sp.temperature = *gen.temperature;
  if (gen.do_sample && !*gen.do_sample) sp.temperature = 0.0;
  if (gen.top_k) sp.top_k = *gen.top_k;
  if (gen.top_p) sp.top_p = *gen.top_p;
  if (gen.min_p) sp.min_p = *gen.min_p;
  if (gen.repetition_penalty) sp.repetition_penalty = *gen.repetition_penalty;
  if (gen.presence_penalty) sp.presence_penalty = *gen.presence_penalty;
  if (o.o_temp->count()) sp.temperature = o.temp;
  if (o.o_top_k->count()) sp.top_k = o.top_k;
  if (o.o_top_p->count()) sp.top_p = o.top_p;
  if (o.o_min_p->count()) sp.min_p = o.min_p;
  if (o.o_repeat_penalty->count()) sp.repetition_penalty = o.repeat_penalty;
  if (o.o_presence->count()) sp.presence_penalty = o.presence;
  sp.frequency_penalty = o.frequency;
  sp.repeat_last_n = o.repeat_last_n;
  st.random_seed = o.seed == "-1";
  if (!st.random_seed) {
    const char* end = o.seed.data() + o.seed.size();
    const auto [ptr, ec] = std::from_chars(o.seed.data(), end, st.seed);
    FN_REQUIRE(!o.seed.empty() && ec == std::errc() && ptr == end, Usage,
               "-s/--seed must be -1 (random) or an integer in [0, 18446744073709551615], got "
               "'{}'",
               o.seed);
  }
  validate_sampling_params(sp);
  check_top_logprobs(o.logprobs);
  FN_REQUIRE(o.logprobs < 0 || o.json_out || !o.input.empty(), Usage,
             "--logprobs reports in the JSON outputs: add --json (or give -i/--input records)");
  FN_REQUIRE(!o.input.empty() ||
                 (o.batch.o_max_batch->count() == 0 && o.batch.o_prefill_budget->count() == 0),
             Usage,
             "--max-batch and --prefill-budget apply to -i/--input (batch generation); one prompt "
             "runs alone");

  return st;
}

int run_generate(GenerateCli& o, MpiContext& mpi) {
  const bool root = mpi.world_rank() == 0;
  MpiCollectives coll(mpi.world());
  // Agreed on (collective): bad flags or files end every rank normally, with rank 0's message.
  GenerateSetup su;
  agree_on_error(coll, [&] { su = setup_generate(o, mpi.world_size(), root); });
  // Where config.json was read, and where the tokenizer is (none: --random-weights without
  // --tokenizer; prompts must then be ids).
  const fs::path dir = o.rw.random_weights ? fs::path(o.rw.config) : fs::path(o.model);
  const fs::path tok_dir = o.rw.random_weights ? fs::path(o.rw.tokenizer) : dir;
  const std::string model_name = o.rw.random_weights ? "random:" + o.rw.config : o.model;
  const ModelConfig& cfg = su.cfg;
  const GenerationConfig& gen = su.gen;
  const int64_t ctx = su.ctx;
  SamplingParams sp = su.sampling;
  const bool random_seed = su.random_seed;
  const bool batch = !o.input.empty();
  uint64_t seed = su.seed;
  if (random_seed && !batch) {  // a batch draws (and prints) its own
    if (root) seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    coll.broadcast(&seed, sizeof(seed), 0);
  }
  sp.seed = seed;

  GenerateOptions go;
  go.sampling = sp;
  go.ctx_size = ctx;
  go.stop_token_ids = stop_token_ids(cfg, gen);
  go.stop_strings = o.stop;
  go.ignore_eos = o.ignore_eos;
  go.host_sampling = o.host_sampling;
  go.top_logprobs = o.logprobs;

  // Rank 0: tokenizer and prompts (before the model load, so that bad input fails fast).
  TextSide ts;
  ts.dir = tok_dir;
  ts.system_prompt = o.system_prompt;
  ts.chat.mode = o.chat_template.empty() ? ChatMode::Qwen38 : parse_chat_mode(o.chat_template);
  if (o.think) ts.chat.enable_thinking = true;
  if (o.no_think) ts.chat.enable_thinking = false;
  std::vector<int32_t> single_ids;
  std::vector<std::string> lines;
  // Agreed on (collective): a bad prompt ends every rank normally, with rank 0's message.
  agree_on_error(coll, [&] {
    if (!root) return;
    // A tokenizer with ids past the model's rows is the checkpoint's fault, found here once
    // (not by whichever record first encodes to such an id).
    if (!tok_dir.empty() && has_tokenizer(tok_dir))
      ts.tokenizer = load_model_tokenizer(tok_dir, cfg.vocab_size);
    FN_REQUIRE(o.stop.empty() || ts.tokenizer, Usage,
               "--stop needs a tokenizer to match text, and {} has none",
               tokenizer_source(tok_dir));
    if (batch) {
      // -n past the context fails every record whatever its prompt: a flag mistake, said once.
      FN_REQUIRE(o.max_new_tokens < ctx, Usage,
                 "-n/--max-new-tokens {} leaves no room for a prompt token in the context size "
                 "-c/--ctx-size {} (every record of -i/--input needs at least one)",
                 o.max_new_tokens, ctx);
      lines = read_jsonl_lines(o.input, "-i/--input");
    } else {
      // An empty prompt is bad input (3) from any source, as an empty one is a bad record in a
      // batch. A chat prompt is never empty (the template's tokens), so --chat takes an empty
      // text.
      if (o.o_prompt_ids->count() > 0) {
        single_ids = parse_token_ids(o.prompt_ids, cfg.vocab_size, "--prompt-ids");
        FN_REQUIRE(!single_ids.empty(), Format, "--prompt-ids: the prompt is empty");
      } else {
        std::string text = o.o_prompt->count() ? o.prompt : read_file(o.file, "-f/--file");
        if (!o.file.empty() && !text.empty() && text.back() == '\n') text.pop_back();
        const std::string what =
            o.o_prompt->count() ? std::string("-p/--prompt") : "-f/--file " + o.file;
        FN_REQUIRE(!text.empty() || o.chat, Format, "{}: the prompt is empty", what);
        single_ids = ts.encode_text(text, o.chat, what, ctx);
      }
      check_room(static_cast<int64_t>(single_ids.size()), o.max_new_tokens, ctx);
    }
  });

  if (batch) {
    BatchOptions bo;
    bo.input = o.input;
    bo.output = o.output;
    bo.resume = o.resume;
    bo.model_dir = tok_dir;
    if (o.rw.random_weights) {
      bo.random_config = o.rw.config;
      bo.weights_seed = static_cast<uint64_t>(o.rw.seed);
    }
    bo.backend = o.backend;
    bo.backend.max_batch = o.batch.max_batch;
    bo.prefill_budget = o.batch.prefill_budget;
    bo.ctx = ctx;
    bo.defaults.sampling = sp;
    bo.defaults.max_new_tokens = o.max_new_tokens;
    bo.defaults.stop = o.stop;
    if (!random_seed) bo.seed = seed;
    bo.stop_token_ids = go.stop_token_ids;
    bo.ignore_eos = o.ignore_eos;
    bo.chat = o.chat;
    bo.chat_options = ts.chat;
    bo.system_prompt = o.system_prompt;
    bo.host_sampling = o.host_sampling;
    bo.defaults.top_logprobs = o.logprobs;
    bo.vocab_size = cfg.vocab_size;
    return run_batch_generate(bo, lines, ts.tokenizer.get(), mpi, coll);
  }

  // cuda samples on the device inside the decode graph (the host only copies ids out; penalties
  // and stop strings included) unless --host-sampling asks for the host sampler; cpu always uses
  // it.
  const std::unique_ptr<Backend> model =
      o.rw.random_weights ? load_backend_random(o.backend, dir, static_cast<uint64_t>(o.rw.seed),
                                                mpi, coll, ctx, "generate")
                          : load_backend(o.backend, dir, mpi, coll, ctx, "generate");
  const BackendInfo& info = model->info();
  const double load_ms = info.load_ms;
  if (model->capabilities().device_decode)
    FN_LOG_INFO("generate: sampling on the {}",
                samples_on_device(*model, go) ? "GPU (in the decode graph)" : "host");
  else if (o.host_sampling)
    FN_LOG_INFO(
        "generate: --host-sampling applies to the cuda backend only; the {} backend "
        "always samples on the host",
        info.name);

  const std::vector<int32_t> ids = broadcast_ids(coll, single_ids);
  go.max_new_tokens = new_tokens_for(static_cast<int64_t>(ids.size()), o.max_new_tokens, ctx);
  std::optional<StreamingDetokenizer> detok;
  TextHooks hooks;
  if (root && ts.tokenizer) {
    detok.emplace(*ts.tokenizer);
    hooks.feed = [&detok](int32_t id) { return detok->feed(id); };
    hooks.finish = [&detok] { return detok->finish(); };
  }
  if (root && !o.json_out) {
    if (ts.tokenizer) {
      hooks.emit = [](std::string_view s) { write_stdout(s); };
    } else {
      // No tokenizer: stream the ids (stop strings are refused above).
      hooks.feed = [](int32_t id) { return std::to_string(id) + " "; };
      hooks.emit = [](std::string_view s) { write_stdout(s); };
    }
  }
  GenerationResult r = generate(*model, coll, ids, go, hooks);
  const std::vector<double> mem = gather_peak_rss_mib(coll);
  if (root) {
    if (o.json_out) {
      if (!ts.tokenizer) r.text.clear();
      json j = result_json(r, o.chat, ts.tokenizer.get());
      j["model"] = model_name;
      j["backend"] = info.name;
      j["tp_size"] = coll.size();
      j["ctx_size"] = ctx;
      j["load_ms"] = load_ms;
      j["sampling"] = sampling_json(sp);
      j["peak_rss_mib"] = mem;
      write_stdout(j.dump() + "\n");
    } else {
      write_stdout("\n");
      print_summary(r, mem, info.name, load_ms, coll.size(), ctx, sp);
    }
  }
  return 0;
}

}  // namespace

void register_generate(CLI::App& app, CommandList& commands) {
  auto o = std::make_shared<GenerateCli>();
  CLI::App* sub = app.add_subcommand(
      "generate",
      "generate text from a prompt (mpirun -np N: tensor-parallel over N ranks); sampling "
      "defaults come from generation_config.json, flags override them");
  o->o_model = add_model_source_options(sub, o->model, o->rw, "text prompts");
  o->o_prompt = sub->add_option("-p,--prompt", o->prompt, "prompt text");
  sub->add_option("-f,--file", o->file, "file holding the prompt text (one final newline dropped)");
  o->o_prompt_ids = sub->add_option("--prompt-ids", o->prompt_ids, "prompt as token ids: 1,2,3");
  sub->add_option(
      "-i,--input", o->input,
      "JSONL batch: one {\"prompt\"}, {\"prompt_ids\"} or {\"messages\"} per line "
      "(optional \"id\", and per-record \"seed\", \"temperature\", \"top_k\", "
      "\"top_p\", \"min_p\", \"repeat_penalty\", \"presence_penalty\", "
      "\"frequency_penalty\", \"max_tokens\", \"stop\", \"n\", \"logprobs\"); with --tp T "
      "below the number of ranks W, W/T data-parallel groups share the records");
  add_stdout_option(sub, "-o,--output", o->output, "JSONL results of -i");
  sub->add_flag("--resume", o->resume,
                "-i with -o: keep the records -o already holds (a partial last line is cut off) "
                "and append the rest");
  add_whole_option(
      sub, "-n,--max-new-tokens,--n-predict", o->max_new_tokens,
      "tokens to generate (default 256, fewer when the context ends first; -1: until the "
      "context is full; an explicit N that does not fit in -c/--ctx-size is an error)",
      WholeRange(1, kMaxTokenCount).or_value(-1));
  add_whole_option(sub, "-c,--ctx-size", o->ctx_size,
                   "context size in tokens (default, or 0: min(max_position_embeddings, 4096))",
                   WholeRange(0, kMaxTokenCount));
  o->o_temp = add_real_option(sub, "--temp", o->temp, "temperature (0 = greedy)");
  o->o_top_k = add_whole_option(sub, "--top-k", o->top_k, "top-k (0 = off)", {});
  o->o_top_p = add_real_option(sub, "--top-p", o->top_p, "top-p (1 = off)");
  o->o_min_p = add_real_option(sub, "--min-p", o->min_p, "min-p (0 = off)");
  o->o_repeat_penalty =
      add_real_option(sub, "--repeat-penalty", o->repeat_penalty, "repetition penalty (1 = off)");
  add_whole_option(sub, "--repeat-last-n", o->repeat_last_n,
                   "tokens the penalties look back on (0 = off, -1 = all)",
                   WholeRange(0).or_value(-1));
  o->o_presence =
      add_real_option(sub, "--presence-penalty", o->presence, "presence penalty (0 = off)");
  add_real_option(sub, "--frequency-penalty", o->frequency, "frequency penalty (0 = off)");
  add_whole_option(sub, "-s,--seed", o->seed,
                   "RNG seed (-1 = random, printed in the summary); -i: each record's seed is "
                   "splitmix64(seed ^ line number) unless the record gives \"seed\"",
                   WholeRange(0, std::numeric_limits<uint64_t>::max()).or_value(-1));
  sub->add_option("--stop", o->stop, "stop string (repeatable; not printed)")
      ->allow_extra_args(false);
  sub->add_flag("--ignore-eos", o->ignore_eos, "do not stop on the EOS ids");
  add_whole_option(sub, "--logprobs", o->logprobs,
                   "each generated token's log-prob and its K most likely alternatives in the "
                   "--json / JSONL output (raw model log-softmax; on the GPU where it samples)",
                   WholeRange(0, kMaxTopLogprobs));
  sub->add_flag("--host-sampling", o->host_sampling,
                "cuda: copy the logits to the host and sample there every step (default: sample "
                "on the GPU inside the decode graph, penalties and --stop strings included)");
  sub->add_flag("--chat", o->chat, "render text prompts as a user turn of the chat template");
  sub->add_option("--system-prompt", o->system_prompt, "system turn for chat prompts");
  sub->add_flag("--think", o->think, "chat: thinking on (the template's default)");
  sub->add_flag("--no-think", o->no_think, "chat: thinking off (empty think block)");
  sub->add_option("--chat-template", o->chat_template, "qwen3 | qwen3.8 (default qwen3.8)")
      ->check(CLI::IsMember({"qwen3", "qwen3.8"}));
  add_backend_flags(sub, o->backend,
                    "-i: a divisor of it, the ranks forming (ranks / --tp) data-parallel groups");
  add_batch_flags(sub, o->batch);
  sub->add_flag("--json", o->json_out, "print the result as one JSON object on stdout");
  commands.push_back({sub, [o](MpiContext& mpi) { return run_generate(*o, mpi); }});
}

}  // namespace fn
