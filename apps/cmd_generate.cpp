// `fngen generate`: the main job (docs/design.md "The main job, end to end"), launched as
// `mpirun -np N fngen generate -m DIR -p "..."`. TP size = world size; the model is loaded by
// apps/backend.h (--backend cpu|cuda|auto), the CPU one with MpiCollectives over MPI_COMM_WORLD.
// Rank 0 reads the tokenizer and the prompt(s) and broadcasts the token ids; every rank runs the
// generation loop (core/generate.h); rank 0 streams the text and prints the summary (stderr) or
// JSON (--json, stdout). Batch mode
// (-i in.jsonl [-o out.jsonl]): one output record per input record, in order; a bad record gets
// an "error" and the run goes on.
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

// -n/--max-new-tokens when not given: 256, or fewer when the context ends first (0 stands for it).
constexpr int64_t kDefaultNewTokens = 256;

// The tokens to generate after a prompt of n_prompt tokens: -n as given, the default capped at
// the context's end, or (-1) up to the context's end. At least 1 (check_room ran before).
int64_t new_tokens_for(int64_t n_prompt, int64_t max_new_tokens, int64_t ctx) {
  if (max_new_tokens > 0) return max_new_tokens;
  const int64_t room = std::max<int64_t>(ctx - n_prompt, 1);
  return max_new_tokens == 0 ? std::min(kDefaultNewTokens, room) : room;
}

// The prompt plus -n must fit the context; the default -n and -n -1 (until the context is full)
// need room for one token; an empty prompt is refused here, before the load (whatever -n is).
// A prompt that leaves no room for a generated token (n_prompt >= ctx) is bad input,
// fn::Error(Format), exit 3, as the same prompt is a bad record in a batch (README "Exit codes");
// a prompt with room that -n/--max-new-tokens overruns is fn::Error(Usage), exit 2. The message
// names the flag as the user gave it.
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

struct GenerateCli {
  std::string model, prompt, file, prompt_ids, input, output, system_prompt;
  std::string chat_template;
  BackendFlags backend;
  int64_t max_new_tokens = 0, ctx_size = 0;  // max_new_tokens 0: the default (kDefaultNewTokens)
  double temp = 1.0, top_p = 1.0, min_p = 0.0, repeat_penalty = 1.0, presence = 0.0,
         frequency = 0.0;
  int64_t top_k = 0, repeat_last_n = 64;
  std::string seed = "-1";  // -1 or a uint64 (the printed random seeds reach 2^64 - 1)
  std::vector<std::string> stop;
  bool ignore_eos = false, chat = false, think = false, no_think = false, json_out = false;
  bool host_sampling = false;
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
               "{} is text, but the model directory {} has no tokenizer (tokenizer.json or "
               "tokenizer.model); give token ids instead (--prompt-ids, or \"prompt_ids\" in "
               "JSONL)",
               what, dir.string());
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

// One JSONL record -> prompt ids; throws fn::Error naming the field on bad input.
std::vector<int32_t> record_ids(const json& rec, const TextSide& ts, bool chat, int64_t vocab) {
  FN_REQUIRE(rec.is_object(), Format, "a record must be a JSON object, got {}", rec.type_name());
  const int given = static_cast<int>(rec.contains("prompt")) +
                    static_cast<int>(rec.contains("prompt_ids")) +
                    static_cast<int>(rec.contains("messages"));
  FN_REQUIRE(given == 1, Format,
             "a record needs exactly one of \"prompt\", \"prompt_ids\" or \"messages\" (got {})",
             given);
  if (rec.contains("prompt_ids")) {
    const json& a = rec["prompt_ids"];
    FN_REQUIRE(a.is_array(), Format, "\"prompt_ids\" must be a list of integers, got {}",
               a.type_name());
    std::vector<int32_t> ids;
    for (std::size_t i = 0; i < a.size(); ++i) {
      FN_REQUIRE(a[i].is_number_integer(), Format, "\"prompt_ids\"[{}] is not an integer: {}", i,
                 a[i].dump());
      const int64_t v = a[i].get<int64_t>();
      FN_REQUIRE(v >= 0 && v < vocab, Format,
                 "\"prompt_ids\"[{}] = {} is outside the vocabulary [0, {})", i, v, vocab);
      ids.push_back(static_cast<int32_t>(v));
    }
    return ids;
  }
  if (rec.contains("prompt")) {
    FN_REQUIRE(rec["prompt"].is_string(), Format, "\"prompt\" must be a string, got {}",
               rec["prompt"].type_name());
    return ts.encode_text(rec["prompt"].get<std::string>(), chat, "\"prompt\"");
  }
  std::vector<ChatMessage> msgs = chat_messages_from_json(rec["messages"]);
  ts.require_tokenizer("\"messages\"");
  if (!ts.system_prompt.empty() && msgs.front().role != "system") {
    msgs.insert(msgs.begin(), ChatMessage{"system", ts.system_prompt, std::nullopt});
  }
  return encode_chat(*ts.tokenizer, msgs, ts.chat);
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

// No inter-token gap (a single generated token): null statistics, not zeros.
json tpot_json(const LatencyStats& s) {
  auto v = [&](double x) { return s.count > 0 ? json(x) : json(nullptr); };
  return {{"mean", v(s.mean)}, {"p50", v(s.p50)}, {"p90", v(s.p90)},
          {"p99", v(s.p99)},   {"max", v(s.max)}, {"count", s.count}};
}

// The result fields shared by --json and the JSONL records.
json result_json(const GenerationResult& r, bool chat) {
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
  return j;
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

std::string memory_text(const std::vector<double>& mib) {
  std::string s;
  for (std::size_t r = 0; r < mib.size(); ++r) s += fmt::format("  r{} {:.1f}", r, mib[r]);
  return s;
}

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
  check_backend_and_tp(o.backend.backend, o.backend.tp, world_size);
  const int sources =
      static_cast<int>(o.o_prompt->count() > 0) + static_cast<int>(!o.file.empty()) +
      static_cast<int>(o.o_prompt_ids->count() > 0) + static_cast<int>(!o.input.empty());
  FN_REQUIRE(sources == 1, Usage,
             "give exactly one of -p/--prompt, -f/--file, --prompt-ids or -i/--input (got {})",
             sources);
  FN_REQUIRE(o.output.empty() || !o.input.empty(), Usage,
             "-o/--output needs -i/--input (batch mode)");
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

  require_model_dir(o.model);
  if (root) {
    // -o: never a checkpoint file nor the -i file, and writable before the model loads; the
    // file is opened (truncated) after the load, when the first record is ready.
    require_outside_model(o.output, o.model, "-o/--output");
    require_not_input(o.output, "-o/--output", o.input, "-i/--input");
    check_output_path(o.output, "-o/--output");
  }
  const fs::path dir = o.model;
  st.cfg = load_model_config(dir);
  const ModelConfig& cfg = st.cfg;
  st.gen = load_generation_config(dir, cfg.vocab_size);
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

  return st;
}

int run_generate(GenerateCli& o, MpiContext& mpi) {
  const bool root = mpi.world_rank() == 0;
  MpiCollectives coll(mpi.world());
  // Agreed on (collective): bad flags or files end every rank normally, with rank 0's message.
  GenerateSetup su;
  agree_on_error(coll, [&] { su = setup_generate(o, mpi.world_size(), root); });
  const fs::path dir = o.model;
  const ModelConfig& cfg = su.cfg;
  const GenerationConfig& gen = su.gen;
  const int64_t ctx = su.ctx;
  SamplingParams sp = su.sampling;
  const bool random_seed = su.random_seed;
  uint64_t seed = su.seed;
  if (random_seed) {
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

  // Rank 0: tokenizer and prompts (before the model load, so that bad input fails fast).
  TextSide ts;
  ts.dir = dir;
  ts.system_prompt = o.system_prompt;
  ts.chat.mode = o.chat_template.empty() ? ChatMode::Qwen38 : parse_chat_mode(o.chat_template);
  if (o.think) ts.chat.enable_thinking = true;
  if (o.no_think) ts.chat.enable_thinking = false;
  const bool batch = !o.input.empty();
  std::vector<int32_t> single_ids;
  std::vector<std::string> lines;
  // Agreed on (collective): a bad prompt ends every rank normally, with rank 0's message.
  agree_on_error(coll, [&] {
    if (!root) return;
    // A tokenizer with ids past the model's rows is the checkpoint's fault, found here once
    // (not by whichever record first encodes to such an id).
    if (has_tokenizer(dir)) ts.tokenizer = load_model_tokenizer(dir, cfg.vocab_size);
    FN_REQUIRE(o.stop.empty() || ts.tokenizer, Usage,
               "--stop needs a tokenizer to match text, and {} has none", dir.string());
    if (batch) {
      // -n past the context fails every record whatever its prompt: a flag mistake, said once.
      FN_REQUIRE(o.max_new_tokens < ctx, Usage,
                 "-n/--max-new-tokens {} leaves no room for a prompt token in the context size "
                 "-c/--ctx-size {} (every record of -i/--input needs at least one)",
                 o.max_new_tokens, ctx);
      lines = read_jsonl_lines(o.input, "-i/--input");
    } else {
      if (o.o_prompt_ids->count() > 0) {
        single_ids = parse_token_ids(o.prompt_ids, cfg.vocab_size, "--prompt-ids");
      } else {
        std::string text = o.o_prompt->count() ? o.prompt : read_file(o.file, "-f/--file");
        if (!o.file.empty() && !text.empty() && text.back() == '\n') text.pop_back();
        // An empty file is bad input (3), as in eval; an empty -p stays a flag mistake (2). A
        // chat prompt is never empty (the template's tokens), so --chat takes either, as before.
        FN_REQUIRE(!text.empty() || o.o_prompt->count() > 0 || o.chat, Format,
                   "-f/--file {}: the prompt is empty", o.file);
        single_ids = ts.encode_text(
            text, o.chat, o.o_prompt->count() ? std::string("-p/--prompt") : "-f/--file " + o.file,
            ctx);
      }
      check_room(static_cast<int64_t>(single_ids.size()), o.max_new_tokens, ctx);
    }
  });

  // cuda samples on the device inside the decode graph (the host only copies ids out) unless
  // --host-sampling, a --stop string or a penalty needs the host sampler; cpu always uses it.
  const std::unique_ptr<Backend> model = load_backend(o.backend, dir, mpi, coll, ctx, "generate");
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
  const auto run = [&](std::span<const int32_t> ids, const TextHooks& hooks) {
    return generate(*model, coll, ids, go, hooks);
  };
  const auto max_new_for = [&](int64_t n_prompt) {
    return new_tokens_for(n_prompt, o.max_new_tokens, ctx);
  };

  if (!batch) {
    const std::vector<int32_t> ids = broadcast_ids(coll, single_ids);
    go.max_new_tokens = max_new_for(static_cast<int64_t>(ids.size()));
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
    GenerationResult r = run(ids, hooks);
    const std::vector<double> mem = gather_peak_rss_mib(coll);
    if (root) {
      if (o.json_out) {
        if (!ts.tokenizer) r.text.clear();
        json j = result_json(r, o.chat);
        j["model"] = dir.string();
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

  // Batch: rank 0 decides each record's ids (or its error), every rank runs the valid ones.
  std::FILE* out = stdout;
  if (root && !o.output.empty()) {
    out = std::fopen(o.output.c_str(), "wb");
    FN_REQUIRE(out != nullptr, Io, "-o/--output {}: cannot open for writing", o.output);
  }
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> out_guard(out == stdout ? nullptr : out,
                                                                  &std::fclose);
  // Rank 0 writes each record, on every rank's agreement (no MPI_Abort when a write fails).
  const auto write_record = [&](const std::function<json()>& make) {
    write_jsonl_record_agreed(coll, out, make, o.output);
  };
  int64_t n_lines = static_cast<int64_t>(lines.size());
  coll.broadcast(&n_lines, sizeof(n_lines), 0);
  int64_t n_records = 0, n_errors = 0, n_tokens = 0;
  std::vector<double> ttfts, itls;
  for (int64_t li = 0; li < n_lines; ++li) {
    int32_t status = 0;  // 0 skip (blank line), 1 run, 2 error
    json rec_id = li + 1;
    std::string error;
    std::vector<int32_t> ids;
    bool rec_chat = o.chat;
    if (root) {
      const std::string& line = lines[static_cast<std::size_t>(li)];
      if (line.find_first_not_of(" \t\r") != std::string::npos) {
        status = 1;
        try {
          const json rec = parse_json_line(line);
          if (rec.is_object() && rec.contains("id")) rec_id = rec["id"];
          if (rec.is_object() && rec.contains("messages")) rec_chat = true;
          ids = record_ids(rec, ts, o.chat, cfg.vocab_size);
          check_room(static_cast<int64_t>(ids.size()), o.max_new_tokens, ctx);
        } catch (const Error& e) {
          status = 2;
          error = fmt::format("{}: line {}: {}", o.input, li + 1, e.what());
        }
      }
    }
    coll.broadcast(&status, sizeof(status), 0);
    if (status == 0) continue;
    ++n_records;
    if (status == 2) {
      ++n_errors;
      if (root) FN_LOG_WARN("{}", error);
      write_record([&] {
        return json{{"id", rec_id}, {"finish_reason", "error"}, {"error", error}};
      });
      continue;
    }
    ids = broadcast_ids(coll, ids);
    go.max_new_tokens = max_new_for(static_cast<int64_t>(ids.size()));
    model->reset();
    std::optional<StreamingDetokenizer> detok;
    TextHooks hooks;
    if (root && ts.tokenizer) {
      detok.emplace(*ts.tokenizer);
      hooks.feed = [&detok](int32_t id) { return detok->feed(id); };
      hooks.finish = [&detok] { return detok->finish(); };
    }
    const GenerationResult r = run(ids, hooks);
    n_tokens += static_cast<int64_t>(r.token_ids.size());
    ttfts.push_back(r.ttft_ms);
    itls.insert(itls.end(), r.itl_ms.begin(), r.itl_ms.end());
    write_record([&] {
      json j = result_json(r, rec_chat);
      j["id"] = rec_id;
      j["sampling"] = sampling_json(sp);
      // Rank 0's memory after this record (a soak compares the first and the last record).
      j["host_rss_mib"] = current_rss_mib();
      const BackendCapabilities caps = model->capabilities();
      if (caps.device_memory) j["device_used_mib"] = model->device_used_mib();
      if (caps.graph_captures) j["graph_captures"] = model->graph_captures();
      return j;
    });
  }
  const std::vector<double> mem = gather_peak_rss_mib(coll);
  if (root) {
    const LatencyStats tt = latency_stats(ttfts), it = latency_stats(itls);
    // No successful record (TTFT) or no record with a second token (TPOT): no number to print.
    const std::string ttft_line =
        ttfts.empty() ? std::string("n/a (no record succeeded)")
                      : fmt::format("p50 {:.2f}  p90 {:.2f}  p99 {:.2f}", tt.p50, tt.p90, tt.p99);
    const std::string tpot_line =
        itls.empty() ? std::string("n/a (no record generated a second token)")
                     : fmt::format("mean {:.3f}  p50 {:.3f}  p90 {:.3f}  p99 {:.3f}  max {:.3f}",
                                   it.mean, it.p50, it.p90, it.p99, it.max);
    const std::string s = fmt::format(
        "\n--- fngen generate (batch): backend {}, TP {}, ctx {}, {}\n"
        "records {}, errors {}, generated tokens {}\n"
        "TTFT ms: {}\n"
        "TPOT ms: {}\n"
        "peak host memory (MiB, per rank):{}\n",
        info.name, coll.size(), ctx, sampling_text(sp), n_records, n_errors, n_tokens, ttft_line,
        tpot_line, memory_text(mem));
    std::fwrite(s.data(), 1, s.size(), stderr);
  }
  // Every rank knows the counts (the statuses are broadcast): all end with the same error,
  // agreed on so that rank 0 alone prints it and every rank ends normally.
  agree_on_error(coll, [&] {
    FN_REQUIRE(n_errors < n_records, Format,
               "-i/--input {}: every record failed ({} of {}; see their \"error\" fields)", o.input,
               n_errors, n_records);
  });
  return 0;
}

}  // namespace

void register_generate(CLI::App& app, CommandList& commands) {
  auto o = std::make_shared<GenerateCli>();
  CLI::App* sub = app.add_subcommand(
      "generate",
      "generate text from a prompt (mpirun -np N: tensor-parallel over N ranks); sampling "
      "defaults come from generation_config.json, flags override them");
  o->o_model = sub->add_option("-m,--model", o->model, "model directory")->required();
  o->o_prompt = sub->add_option("-p,--prompt", o->prompt, "prompt text");
  sub->add_option("-f,--file", o->file, "file holding the prompt text (one final newline dropped)");
  o->o_prompt_ids = sub->add_option("--prompt-ids", o->prompt_ids, "prompt as token ids: 1,2,3");
  sub->add_option("-i,--input", o->input,
                  "JSONL batch: one {\"prompt\"}, {\"prompt_ids\"} or {\"messages\"} per line "
                  "(optional \"id\")");
  add_stdout_option(sub, "-o,--output", o->output, "JSONL results of -i");
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
  add_whole_option(sub, "-s,--seed", o->seed, "RNG seed (-1 = random, printed in the summary)",
                   WholeRange(0, std::numeric_limits<uint64_t>::max()).or_value(-1));
  sub->add_option("--stop", o->stop, "stop string (repeatable; not printed)")
      ->allow_extra_args(false);
  sub->add_flag("--ignore-eos", o->ignore_eos, "do not stop on the EOS ids");
  sub->add_flag("--host-sampling", o->host_sampling,
                "cuda: copy the logits to the host and sample there every step (default: sample "
                "on the GPU inside the decode graph when no --stop string or penalty is set)");
  sub->add_flag("--chat", o->chat, "render text prompts as a user turn of the chat template");
  sub->add_option("--system-prompt", o->system_prompt, "system turn for chat prompts");
  sub->add_flag("--think", o->think, "chat: thinking on (the template's default)");
  sub->add_flag("--no-think", o->no_think, "chat: thinking off (empty think block)");
  sub->add_option("--chat-template", o->chat_template, "qwen3 | qwen3.8 (default qwen3.8)")
      ->check(CLI::IsMember({"qwen3", "qwen3.8"}));
  add_backend_flags(sub, o->backend);
  sub->add_flag("--json", o->json_out, "print the result as one JSON object on stdout");
  commands.push_back({sub, [o](MpiContext& mpi) { return run_generate(*o, mpi); }});
}

}  // namespace fn
