// `fngen bench`: latency lanes in llama-bench style (docs/design.md "Same engine, other front
// ends"), launched as `mpirun -np N fngen bench -m DIR -p 8192 -n 512` (TP = world size; the model
// is loaded by apps/backend.h exactly as `fngen generate` does). A lane is one (n_prompt, n_gen)
// pair of the product of the -p and -n lists: reset, prefill n_prompt synthetic token ids
// (deterministic from --seed, uniform over the vocabulary, never a stop id), then n_gen greedy
// tokens through the generation loop of core/generate.h, generate(), stop ids ignored (cpu: host
// argmax; cuda: the on-device decode loop, Backend::decode over CudaModel::decode, the step graph
// replayed per token and timed when each id reaches the host): the first token's
// latency is the TTFT, the n_gen - 1 gaps after it are the inter-token latencies (ITL).
// --random-weights --config FILE runs the full geometry on random device weights (cuda);
// --skip-prefill (implied there) moves the position to n_prompt - 1 instead of running the
// prompt (the caches hold zeros; TTFT is not measured). --breakdown times each op family of the
// decode step after each lane (CudaModel::profile_steps) and, unless the prefill is skipped, of
// one more prefill of the lane's prompt (TFLOP/s per family, CudaModel::set_prefill_profile).
// Each lane runs --warmup discarded repetitions, then -r/--repetitions measured ones, on every
// rank; rank 0 prints the report (--format md|csv|json|jsonl, stdout or -o FILE) and the
// per-token record (--per-token FILE), both files written only once every lane has run (a failed
// run leaves them as they were), never into the model directory nor onto each other
// (apps/app_util.h). The roofline columns come from the shard plan (core/shard_plan.h
// bytes_per_token at the lane's mean decode depth, the largest over ranks) and the reference
// bandwidth --bandwidth-gbs. Logs go to stderr.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

#include "apps/app_util.h"
#include "apps/backend.h"
#include "apps/command.h"
#include "apps/real_number.h"
#include "apps/whole_number.h"
#include "comm/mpi_collectives.h"
#include "comm/mpi_context.h"
#include "core/config.h"
#include "core/error.h"
#include "core/flops.h"
#include "core/generate.h"
#include "core/log.h"
#include "core/row_stats.h"
#include "core/shard_plan.h"

#ifdef FN_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

// FN_GIT_COMMIT: the commit of the sources, written at every build (apps/CMakeLists.txt).
#if __has_include("fn_git_commit.h")
#include "fn_git_commit.h"
#endif
#ifndef FN_GIT_COMMIT
#define FN_GIT_COMMIT "unknown"
#endif

namespace fn {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// The measured H200 device-to-device copy bandwidth (docs/performance.md "Bytes per token and the
// floor").
constexpr double kH200CopyGbs = 4300.0;

// Steps of each --breakdown measurement before the timed ones (graph capture, caches warm).
constexpr int64_t kBreakdownWarmup = 4;

struct BenchCli {
  std::string model, n_prompt = "512", n_gen = "128", format = "md", output, per_token;
  std::string batch = "1";  // --batch: sequences per decode step, comma-separated
  RandomWeightsCli rw;      // --random-weights --config FILE
  bool skip_prefill = false, breakdown = false;
  int64_t breakdown_steps = 32;
  int64_t repetitions = 5, warmup = 1, ctx_size = 0, seed = 0;
  int64_t logprobs = -1;  // --logprobs K; -1: not given
  double bandwidth_gbs = kH200CopyGbs;
  BackendFlags backend;
  CLI::Option* o_bandwidth = nullptr;
};

// The allowed entries of -p/--n-prompt and of -n/--n-gen.
const WholeRange kPromptRange(1, kMaxTokenCount);
const WholeRange kGenRange = WholeRange(2, kMaxTokenCount)
                                 .because(
                                     "a lane needs >= 2 generated tokens: the first one's latency "
                                     "is the TTFT, TPOT and ITL time the gaps after it");

// The most -r/--repetitions and --warmup take: each one reruns the whole lane (its prefill,
// unless skipped, and every decode step), so a larger count is a slip, not a measurement.
constexpr int64_t kMaxRepetitions = 1000;
const WholeRange kRepetitionsRange =
    WholeRange(1, kMaxRepetitions).because("each repetition runs the whole lane again");
const WholeRange kWarmupRange =
    WholeRange(0, kMaxRepetitions).because("each warm-up repetition runs the whole lane again");

// "512,8192" (or "512, 8192": whitespace around an entry is dropped, as --prompt-ids does) ->
// {512, 8192}. Every entry is read by parse_whole_number against `range`, so an empty one
// ("8,,16", "8, ,16") is refused; fn::Error(Usage) naming `flag`, the entry and (for a list of
// several) the whole list otherwise.
std::vector<int64_t> parse_lengths(const std::string& text, const char* flag,
                                   const WholeRange& range) {
  std::vector<int64_t> out;
  const bool list = text.find(',') != std::string::npos;
  constexpr const char* kSpace = " \t\n\r";
  std::size_t pos = 0;
  for (;;) {
    const std::size_t comma = text.find(',', pos);
    std::string item =
        text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    item.erase(0, std::min(item.size(), item.find_first_not_of(kSpace)));
    item.erase(item.find_last_not_of(kSpace) + 1);
    try {
      out.push_back(parse_whole_number(item, flag, range));
    } catch (const Error& e) {
      if (!list) throw;
      FN_THROW(Usage, "{} (entry {} of the list '{}')", e.what(), out.size() + 1, text);
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// The synthetic prompt of a lane: n ids drawn from mt19937_64(seed), uniform over [0, vocab)
// (rejection sampling, no modulo bias), redrawing stop ids. Depends on (seed, n) only, so lanes
// with the same n_prompt share their prompt, and it is the same on every rank (the engine is
// fully specified by the C++ standard).
std::vector<int32_t> synthetic_prompt(uint64_t seed, int64_t n, int64_t vocab,
                                      const std::vector<int64_t>& stops) {
  FN_REQUIRE(vocab > static_cast<int64_t>(stops.size()), Format,
             "vocab_size {} leaves no id outside the stop ids", vocab);
  std::mt19937_64 rng(seed);
  const auto v = static_cast<uint64_t>(vocab);
  const uint64_t limit = UINT64_MAX - UINT64_MAX % v;  // accept x < limit: limit % v == 0
  std::vector<int32_t> ids;
  ids.reserve(static_cast<std::size_t>(n));
  while (static_cast<int64_t>(ids.size()) < n) {
    const uint64_t x = rng();
    if (x >= limit) continue;
    const auto id = static_cast<int64_t>(x % v);
    if (std::find(stops.begin(), stops.end(), id) != stops.end()) continue;
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

// Mean and sample standard deviation (n - 1; 0 for fewer than 2 values).
std::pair<double, double> mean_std(const std::vector<double>& x) {
  if (x.empty()) return {0.0, 0.0};
  double s = 0;
  for (double v : x) s += v;
  const double m = s / static_cast<double>(x.size());
  if (x.size() < 2) return {m, 0.0};
  double q = 0;
  for (double v : x) q += (v - m) * (v - m);
  return {m, std::sqrt(q / static_cast<double>(x.size() - 1))};
}

// What the report says about the machine and the build.
struct Environment {
  std::string gpu = "none", driver = "none", cuda_runtime = "none", nccl = "none";
  std::string commit = FN_GIT_COMMIT;
};

// GPU, driver and NCCL of this rank's device; "none" unless the backend is cuda.
Environment query_environment(const std::string& backend) {
  Environment env;
#ifdef FN_HAVE_CUDA
  if (backend != "cuda") return env;
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess) {
    env.gpu = prop.name;
  }
  int v = 0;
  // The CUDA version the driver supports (the runtime API has no driver build number).
  if (cudaDriverGetVersion(&v) == cudaSuccess) {
    env.driver = fmt::format("CUDA {}.{}", v / 1000, (v % 1000) / 10);
  }
  if (cudaRuntimeGetVersion(&v) == cudaSuccess) {
    env.cuda_runtime = fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
  }
  cudaGetLastError();
  if (ncclGetVersion(&v) == ncclSuccess) {
    // NCCL >= 2.9 encodes major*10000 + minor*100 + patch, older major*1000 + minor*100 + patch.
    env.nccl = v >= 10000 ? fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
                          : fmt::format("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100);
  }
#else
  (void)backend;
#endif
  return env;
}

// One op family of a --breakdown: its bytes per token (rank 0) and its time per step.
struct FamilyRow {
  std::string family;
  uint64_t bytes = 0;
  double ms_graph = -1;  // < 0: the graph-mode measurement is unavailable
  double ms_eager = 0;
  int64_t segments = 0;  // event-delimited segments per step (graph mode)
};

// A lane's --breakdown.
struct Breakdown {
  std::vector<FamilyRow> rows;
  int64_t steps = 0, depth = 0;
  double eager_step_ms = 0, graph_step_ms = -1;
  int64_t events = 0;       // event record nodes per step (graph mode)
  std::string graph_error;  // why ms_graph is missing
  // The cost of one event record node, estimated from the graph with events against the plain
  // replay (the lane's TPOT): (graph_step_ms - tpot) / (events - 1); 0 when not measured.
  double event_cost_ms(double tpot_ms) const {
    if (graph_step_ms < 0 || events < 2) return 0;
    return std::max(0.0, graph_step_ms - tpot_ms) / static_cast<double>(events - 1);
  }
  // A family's graph time less its segments' event cost (an estimate of its time in the plain
  // replay); < 0 when the graph time is missing.
  double adjusted_ms(const FamilyRow& f, double tpot_ms) const {
    if (f.ms_graph < 0) return -1;
    return std::max(0.0, f.ms_graph - static_cast<double>(f.segments) * event_cost_ms(tpot_ms));
  }
};

// Bytes read per token by each StepBreakdown family, from the shard plan's TokenBytes of one
// rank: weights by tensor family; the GDN state and its conv ring to gdn, the KV and indexer
// caches to qsa, the PLE conv ring and n-gram rows to ple, the embedding row to other; the
// shared expert's gate/up rows to router (the fused decode step reads them in the router's launch,
// cuda/kernels/moe_shared.h), its down rows and gate row to shared_expert. Activations and
// collectives count 0 (all_reduce).
uint64_t family_bytes(const std::string& family, const TokenBytes& tb, const ModelConfig& cfg,
                      int tp) {
  auto w = [&tb](const char* k) {
    const auto it = tb.weights.find(k);
    return it == tb.weights.end() ? uint64_t{0} : it->second;
  };
  const uint64_t gdn_conv =
      cfg.num_gdn_layers() > 0
          ? static_cast<uint64_t>(cfg.num_gdn_layers() * (cfg.gdn_conv_dim() / tp) *
                                  cfg.linear_conv_kernel_dim * 2)
          : 0;
  if (family == "hc") return w("hc");
  if (family == "gdn") return w("gdn") + tb.gdn_state + gdn_conv;
  if (family == "qsa") return w("qsa") + tb.kv_cache + tb.indexer_cache;
  // BF16 gate + up rows of the rank's shared-expert slice, every layer.
  const uint64_t shared_gate_up =
      std::min(w("moe.shared"), static_cast<uint64_t>(cfg.num_hidden_layers * 2 *
                                                      (cfg.shared_expert_intermediate_size / tp) *
                                                      cfg.hidden_size * 2));
  if (family == "router") return w("moe.router") + shared_gate_up;
  if (family == "moe_routed") return w("moe.experts");
  if (family == "shared_expert") return w("moe.shared") - shared_gate_up;
  if (family == "lm_head") return w("lm_head");
  if (family == "ple") return w("ple") + w("ple.ngram") + (tb.conv_state - gdn_conv);
  if (family == "other") return w("embed");
  return 0;  // all_reduce
}

// One lane's measurements and roofline figures.
struct LaneResult {
  int64_t n_prompt = 0, n_gen = 0;
  // Sequences per decode step (--batch). With batch > 1 the TPOT is the step time (every
  // sequence gets one token per step), TTFT the time to prefill every prompt plus the first
  // step, and the bytes are a step's (bytes_per_step).
  int64_t batch = 1;
  uint64_t step_bytes = 0;      // the busiest rank's bytes per step
  double distinct_experts = 0;  // expected distinct routed experts per layer and step
  std::vector<double> ttft_ms, prefill_ms, tpot_ms;  // one per measured repetition
  std::vector<std::vector<double>> itl_ms;           // per repetition, n_gen - 1 each
  int64_t decode_depth = 0;                          // visible tokens at the mean decode step
  std::vector<uint64_t> bytes_by_rank;               // bytes_per_token at decode_depth
  uint64_t weight_bytes = 0, state_bytes = 0;        // of the rank with the most bytes
  double prompt_flops = 0;  // the model's FLOPs of the prompt and the first token's logits
  std::optional<Breakdown> breakdown;
  // --breakdown with the prefill run: one more prefill of the lane's prompt, timed per family.
  std::optional<PrefillBreakdown> prefill_breakdown;
};

// Everything rank 0 reports.
struct Report {
  std::string model, backend, all_reduce;
  int tp_size = 1;
  int64_t ctx_size = 0, repetitions = 0, warmup = 0, vocab_size = 0;
  int64_t logprobs = -1;  // --logprobs K of every decoded token; -1: none
  uint64_t seed = 0;
  double bandwidth_gbs = kH200CopyGbs, load_ms = 0;
  std::string bandwidth_source;
  bool random_weights = false, prefill_skipped = false;
  Environment env;
  std::vector<LaneResult> lanes;
};

// A lane's prefill per family: ms, the family's FLOPs and its rate (families without time
// left out).
json prefill_breakdown_json(const PrefillBreakdown& b) {
  json rows = json::array();
  for (std::size_t i = 0; i < b.families.size(); ++i) {
    if (b.ms[i] <= 0) continue;
    rows.push_back({{"family", b.families[i]},
                    {"ms", b.ms[i]},
                    {"tflop", b.flops[i] * 1e-12},
                    {"tflops_per_s", b.flops[i] > 0 ? json(b.flops[i] / (b.ms[i] * 1e-3) * 1e-12)
                                                    : json(nullptr)}});
  }
  return {{"tokens", b.tokens}, {"passes", b.passes}, {"families", rows}};
}

// The per-lane fields shared by every format (names = csv columns = json keys).
json breakdown_json(const Breakdown& b, double tpot_ms, double bandwidth_gbs) {
  json rows = json::array();
  for (const FamilyRow& r : b.rows) {
    const double ms = r.ms_graph >= 0 ? r.ms_graph : r.ms_eager;
    rows.push_back(
        {{"family", r.family},
         {"ms", ms},
         {"ms_graph", r.ms_graph >= 0 ? json(r.ms_graph) : json(nullptr)},
         {"ms_eager", r.ms_eager},
         {"ms_adjusted", r.ms_graph >= 0 ? json(b.adjusted_ms(r, tpot_ms)) : json(nullptr)},
         {"segments", r.segments},
         {"bytes", r.bytes},
         {"floor_ms", static_cast<double>(r.bytes) / (bandwidth_gbs * 1e9) * 1e3},
         {"gbs", ms > 0 ? static_cast<double>(r.bytes) / (ms * 1e-3) / 1e9 : 0.0}});
  }
  return rows;
}

json breakdown_info_json(const Breakdown& b, double tpot_ms) {
  return {{"steps", b.steps},
          {"warmup_steps", kBreakdownWarmup},
          {"depth", b.depth},
          {"timing", b.graph_step_ms >= 0 ? "graph" : "eager"},
          {"graph_step_ms", b.graph_step_ms >= 0 ? json(b.graph_step_ms) : json(nullptr)},
          {"eager_step_ms", b.eager_step_ms},
          {"graph_replay_tpot_ms", tpot_ms},
          {"events_per_step", b.events},
          {"event_cost_ms", b.event_cost_ms(tpot_ms)},
          {"graph_error", b.graph_error},
          {"rank", 0}};
}

json lane_json(const LaneResult& l, double bandwidth_gbs) {
  const auto [ttft, ttft_std] = mean_std(l.ttft_ms);
  const double prefill = mean_std(l.prefill_ms).first;
  const auto [tpot, tpot_std] = mean_std(l.tpot_ms);
  std::vector<double> all;
  for (const auto& r : l.itl_ms) all.insert(all.end(), r.begin(), r.end());
  const LatencyStats itl = latency_stats(all);
  const uint64_t bytes = *std::max_element(l.bytes_by_rank.begin(), l.bytes_by_rank.end());
  // A batched step reads step_bytes for `batch` tokens (bytes_by_rank: each rank's share of
  // one token); the floor and the bandwidth are the step's.
  const uint64_t step = l.batch > 1 ? l.step_bytes : bytes;
  const double gbs = tpot > 0 ? static_cast<double>(step) / (tpot * 1e-3) / 1e9 : 0.0;
  const bool no_ttft = l.ttft_ms.empty();  // prefill skipped: TTFT not measured
  json j = {{"n_prompt", l.n_prompt},
            {"n_gen", l.n_gen},
            {"batch", l.batch},
            {"ttft_ms", no_ttft ? json(nullptr) : json(ttft)},
            {"ttft_ms_std", no_ttft || l.ttft_ms.size() < 2 ? json(nullptr) : json(ttft_std)},
            {"prefill_ms", no_ttft ? json(nullptr) : json(prefill)},
            {"tpot_ms", tpot},
            {"tpot_ms_std", l.tpot_ms.size() < 2 ? json(nullptr) : json(tpot_std)},
            {"itl_p50_ms", itl.p50},
            {"itl_p90_ms", itl.p90},
            {"itl_p99_ms", itl.p99},
            {"itl_max_ms", itl.max},
            {"itl_count", itl.count},
            {"decode_tokens_per_s", tpot > 0 ? 1e3 * static_cast<double>(l.batch) / tpot : 0.0},
            {"prefill_tokens_per_s", no_ttft ? json(nullptr)
                                     : prefill > 0
                                         ? json(static_cast<double>(l.n_prompt) / (prefill * 1e-3))
                                         : json(0.0)},
            {"prompt_tflop", l.prompt_flops * 1e-12},
            {"ttft_tflops_per_s",
             no_ttft || ttft <= 0 ? json(nullptr) : json(l.prompt_flops / (ttft * 1e-3) * 1e-12)},
            {"decode_depth", l.decode_depth},
            {"bytes_per_token", bytes},
            {"bytes_per_step", step},
            {"distinct_experts", l.distinct_experts},
            {"weight_bytes_per_token", l.weight_bytes},
            {"state_bytes_per_token", l.state_bytes},
            {"bytes_per_token_by_rank", l.bytes_by_rank},
            {"floor_ms", static_cast<double>(step) / (bandwidth_gbs * 1e9) * 1e3},
            {"achieved_gbs", gbs},
            {"pct_of_bandwidth", 100.0 * gbs / bandwidth_gbs}};
  if (l.breakdown) {
    j["breakdown"] = breakdown_json(*l.breakdown, tpot, bandwidth_gbs);
    j["breakdown_info"] = breakdown_info_json(*l.breakdown, tpot);
  }
  if (l.prefill_breakdown) j["prefill_breakdown"] = prefill_breakdown_json(*l.prefill_breakdown);
  return j;
}

// The run-wide fields (jsonl repeats them on every line, csv in every row).
json run_json(const Report& r) {
  return {{"model", r.model},
          {"backend", r.backend},
          {"tp_size", r.tp_size},
          {"all_reduce", r.all_reduce.empty() ? "none" : r.all_reduce},
          {"ctx_size", r.ctx_size},
          {"repetitions", r.repetitions},
          {"warmup", r.warmup},
          {"seed", r.seed},
          {"logprobs", r.logprobs},
          {"vocab_size", r.vocab_size},
          {"load_ms", r.load_ms},
          {"weights", r.random_weights ? "random" : "checkpoint"},
          {"prefill", r.prefill_skipped ? "skipped" : "run"},
          {"bandwidth_gbs", r.bandwidth_gbs},
          {"bandwidth_source", r.bandwidth_source},
          {"gpu", r.env.gpu},
          {"driver", r.env.driver},
          {"cuda_runtime", r.env.cuda_runtime},
          {"nccl", r.env.nccl},
          {"commit", r.env.commit}};
}

// The csv columns, in order (bytes_per_token_by_rank is ';'-joined).
const std::vector<std::string>& csv_columns() {
  static const std::vector<std::string> cols = {"model",
                                                "backend",
                                                "tp_size",
                                                "all_reduce",
                                                "ctx_size",
                                                "repetitions",
                                                "warmup",
                                                "seed",
                                                "logprobs",
                                                "weights",
                                                "prefill",
                                                "n_prompt",
                                                "n_gen",
                                                "batch",
                                                "ttft_ms",
                                                "ttft_ms_std",
                                                "prefill_ms",
                                                "tpot_ms",
                                                "tpot_ms_std",
                                                "itl_p50_ms",
                                                "itl_p90_ms",
                                                "itl_p99_ms",
                                                "itl_max_ms",
                                                "itl_count",
                                                "decode_tokens_per_s",
                                                "prefill_tokens_per_s",
                                                "prompt_tflop",
                                                "ttft_tflops_per_s",
                                                "decode_depth",
                                                "bytes_per_token",
                                                "bytes_per_step",
                                                "distinct_experts",
                                                "weight_bytes_per_token",
                                                "state_bytes_per_token",
                                                "bytes_per_token_by_rank",
                                                "floor_ms",
                                                "achieved_gbs",
                                                "bandwidth_gbs",
                                                "pct_of_bandwidth",
                                                "bandwidth_source",
                                                "gpu",
                                                "driver",
                                                "cuda_runtime",
                                                "nccl",
                                                "commit"};
  return cols;
}

std::string csv_cell(const json& v) {
  std::string s;
  if (v.is_null()) return s;  // not measured
  if (v.is_string()) {
    s = v.get<std::string>();
  } else if (v.is_array()) {
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i > 0) s += ';';
      s += v[i].dump();
    }
  } else {
    s = v.dump();
  }
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

std::string format_csv(const Report& r) {
  std::string out;
  const auto& cols = csv_columns();
  for (std::size_t i = 0; i < cols.size(); ++i) {
    if (i > 0) out += ',';
    out += cols[i];
  }
  out += "\n";
  const json run = run_json(r);
  for (const auto& l : r.lanes) {
    const json lane = lane_json(l, r.bandwidth_gbs);
    for (std::size_t i = 0; i < cols.size(); ++i) {
      const json& v = lane.contains(cols[i]) ? lane[cols[i]] : run.at(cols[i]);
      if (i > 0) out += ',';
      out += csv_cell(v);
    }
    out += "\n";
  }
  return out;
}

std::string format_json(const Report& r, bool lines) {
  const json run = run_json(r);
  if (lines) {
    std::string out;
    for (const auto& l : r.lanes) {
      json j = run;
      j.update(lane_json(l, r.bandwidth_gbs));
      out += j.dump() + "\n";
    }
    return out;
  }
  json j = run;
  j["lanes"] = json::array();
  for (const auto& l : r.lanes) j["lanes"].push_back(lane_json(l, r.bandwidth_gbs));
  return j.dump(2) + "\n";
}

std::string format_md(const Report& r) {
  std::string out = fmt::format(
      "fngen bench: model {}, backend {}, TP {}{}, ctx {}, {} repetition{} after {} warmup, seed "
      "{}\n",
      r.model, r.backend, r.tp_size,
      r.all_reduce.empty() ? "" : fmt::format(" (all-reduce {})", r.all_reduce), r.ctx_size,
      r.repetitions, r.repetitions == 1 ? "" : "s", r.warmup, r.seed);
  out += fmt::format("GPU: {}, driver: {}, CUDA runtime: {}, NCCL: {}\n", r.env.gpu, r.env.driver,
                     r.env.cuda_runtime, r.env.nccl);
  out += fmt::format("reference bandwidth: {} GB/s = {}\n", r.bandwidth_gbs, r.bandwidth_source);
  if (r.random_weights) {
    out +=
        "weights: random (generated on the GPU, full geometry); random routing is close to "
        "uniform over the experts (each step reads num_experts_per_tok fresh experts, little L2 "
        "reuse across steps; real text routes more unevenly)\n";
  }
  if (r.prefill_skipped) {
    out +=
        "prefill skipped: position set to depth; caches hold zeros (each step reads the bytes "
        "of that depth); TTFT not measured\n";
  }
  // The one-sequence table only when some lane runs batch 1 (--batch without 1: the batched
  // table alone, no empty table before it).
  const bool single =
      std::any_of(r.lanes.begin(), r.lanes.end(), [](const auto& l) { return l.batch <= 1; });
  if (single) {
    out +=
        "TTFT and TPOT: mean ± std over the repetitions; ITL percentiles over every gap of every "
        "repetition; MB/token/rank: bytes read per decoded token by the busiest rank (shard "
        "plan, at the mean decode depth n_prompt + n_gen/2); floor = MB / reference "
        "bandwidth\n\n";
    out +=
        "| n_prompt | n_gen | TTFT ms | TPOT ms | ITL p50 ms | ITL p90 ms | ITL p99 ms | decode "
        "t/s | prefill t/s | MB/token/rank | floor ms | GB/s | % of ref |\n";
    out += "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  }
  for (const auto& l : r.lanes) {
    if (l.batch > 1) continue;  // the batched table below
    const json j = lane_json(l, r.bandwidth_gbs);
    auto d = [&j](const char* k) { return j.at(k).get<double>(); };
    const bool no_ttft = j.at("ttft_ms").is_null();
    // One repetition has no spread: "± n/a" (JSON null), not a standard deviation of 0.
    auto spread = [&j](const char* k, int digits) {
      return j.at(k).is_null() ? std::string("n/a")
                               : fmt::format("{:.{}f}", j.at(k).get<double>(), digits);
    };
    const std::string ttft =
        no_ttft ? "n/a" : fmt::format("{:.3f} ± {}", d("ttft_ms"), spread("ttft_ms_std", 3));
    const std::string prefill_rate =
        no_ttft ? "n/a" : fmt::format("{:.2f}", d("prefill_tokens_per_s"));
    out += fmt::format(
        "| {} | {} | {} | {:.4f} ± {} | {:.4f} | {:.4f} | {:.4f} | {:.2f} | "
        "{} | {:.4f} | {:.4g} | {:.2f} | {:.3f} |\n",
        l.n_prompt, l.n_gen, ttft, d("tpot_ms"), spread("tpot_ms_std", 4), d("itl_p50_ms"),
        d("itl_p90_ms"), d("itl_p99_ms"), d("decode_tokens_per_s"), prefill_rate,
        d("bytes_per_token") / 1e6, d("floor_ms"), d("achieved_gbs"), d("pct_of_bandwidth"));
  }
  bool batched = false;
  for (const auto& l : r.lanes) {
    if (l.batch <= 1) continue;
    if (!batched) {
      batched = true;
      out += single ? "\n" : "";
      out +=
          "batched lanes (--batch): B sequences decoded side by side, one token each per step; "
          "step ms = each sequence's TPOT; output t/s = B / step; TTFT = every prompt prefilled "
          "(one after another) + the first step; MB/step/rank: the busiest rank's bytes of one "
          "step (shard plan: the weights once, the expected distinct routed experts under uniform "
          "routing, each sequence's rows and states at the mean depth); floor = MB / reference "
          "bandwidth\n\n"
          "| batch | n_prompt | n_gen | TTFT ms | step ms | output t/s | MB/step/rank | "
          "experts/layer "
          "| floor ms | GB/s | % of ref |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    }
    const json j = lane_json(l, r.bandwidth_gbs);
    auto d = [&j](const char* k) { return j.at(k).get<double>(); };
    out += fmt::format(
        "| {} | {} | {} | {} | {:.4f} | {:.1f} | {:.3f} | {:.1f} | {:.4g} | {:.2f} | {:.3f} |\n",
        l.batch, l.n_prompt, l.n_gen,
        j.at("ttft_ms").is_null() ? std::string("n/a") : fmt::format("{:.3f}", d("ttft_ms")),
        d("tpot_ms"), d("decode_tokens_per_s"), d("bytes_per_step") / 1e6, d("distinct_experts"),
        d("floor_ms"), d("achieved_gbs"), d("pct_of_bandwidth"));
  }
  for (const auto& l : r.lanes) {
    if (!l.breakdown) continue;
    const Breakdown& b = *l.breakdown;
    const double tpot = mean_std(l.tpot_ms).first;
    const bool graph = b.graph_step_ms >= 0;
    out += fmt::format(
        "\nper-op breakdown, lane -p {} -n {}: {} greedy steps from position {} after {} warm-up "
        "steps, a CUDA event at every family boundary; rank 0's time and bytes (shard plan)\n\n",
        l.n_prompt, l.n_gen, b.steps, b.depth, kBreakdownWarmup);
    out +=
        "| family | MB/token | floor ms | ms/token (graph) | GB/s | % of floor | ms/token (eager) "
        "| segments | ms (graph − events) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    uint64_t bytes = 0;
    double sum_g = 0, sum_e = 0, sum_a = 0;
    int64_t segments = 0;
    for (const FamilyRow& f : b.rows) {
      const double ms = graph ? f.ms_graph : f.ms_eager;
      const double floor = static_cast<double>(f.bytes) / (r.bandwidth_gbs * 1e9) * 1e3;
      bytes += f.bytes;
      sum_g += graph ? f.ms_graph : 0;
      sum_e += f.ms_eager;
      sum_a += graph ? b.adjusted_ms(f, tpot) : 0;
      segments += f.segments;
      out += fmt::format(
          "| {} | {:.3f} | {:.4f} | {} | {:.0f} | {} | {:.4f} | {} | {} |\n", f.family,
          static_cast<double>(f.bytes) / 1e6, floor,
          graph ? fmt::format("{:.4f}", f.ms_graph) : std::string("n/a"),
          ms > 0 ? static_cast<double>(f.bytes) / (ms * 1e-3) / 1e9 : 0.0,
          ms > 0 && f.bytes > 0 ? fmt::format("{:.1f}", 100.0 * floor / ms) : std::string("-"),
          f.ms_eager, f.segments,
          graph ? fmt::format("{:.4f}", b.adjusted_ms(f, tpot)) : std::string("n/a"));
    }
    const double floor = static_cast<double>(bytes) / (r.bandwidth_gbs * 1e9) * 1e3;
    out += fmt::format("| **sum** | {:.3f} | {:.4f} | {} | {:.0f} | {} | {:.4f} | {} | {} |\n",
                       static_cast<double>(bytes) / 1e6, floor,
                       graph ? fmt::format("{:.4f}", sum_g) : std::string("n/a"),
                       static_cast<double>(bytes) / ((graph ? sum_g : sum_e) * 1e-3) / 1e9,
                       fmt::format("{:.1f}", 100.0 * floor / (graph ? sum_g : sum_e)), sum_e,
                       segments, graph ? fmt::format("{:.4f}", sum_a) : std::string("n/a"));
    out += fmt::format(
        "\nstep: graph replay (the lane's TPOT, no events) {:.4f} ms/token; graph with {} event "
        "nodes {} (≈ {:.2f} µs per event node; \"graph − events\" subtracts that per segment, "
        "an estimate); eager {:.4f} ms (host launch gaps included: eager − replay = {:.4f} "
        "ms)\n",
        tpot, b.events,
        graph ? fmt::format("{:.4f} ms", b.graph_step_ms) : "n/a (" + b.graph_error + ")",
        b.event_cost_ms(tpot) * 1e3, b.eager_step_ms, b.eager_step_ms - tpot);
  }
  for (const auto& l : r.lanes) {
    if (!l.prefill_breakdown) continue;
    const PrefillBreakdown& b = *l.prefill_breakdown;
    out += fmt::format(
        "\nprefill per family, lane -p {}: one more prefill of the lane's prompt ({} tokens, {} "
        "passes), a CUDA event at every family boundary; rank 0's time, the model's FLOPs "
        "(core/flops.h)\n\n| family | ms | TFLOP | TFLOP/s |\n|---|---:|---:|---:|\n",
        l.n_prompt, b.tokens, b.passes);
    const json rows = prefill_breakdown_json(b);  // the json's rows and rates, as printed
    double ms = 0, tflop = 0;
    for (const json& f : rows.at("families")) {
      ms += f.at("ms").get<double>();
      tflop += f.at("tflop").get<double>();
      const json& rate = f.at("tflops_per_s");
      out += fmt::format(
          "| {} | {:.1f} | {:.2f} | {} |\n", f.at("family").get<std::string>(),
          f.at("ms").get<double>(), f.at("tflop").get<double>(),
          rate.is_null() ? std::string("-") : fmt::format("{:.1f}", rate.get<double>()));
    }
    out += fmt::format("| **sum** | {:.1f} | {:.2f} | {:.1f} |\n", ms, tflop,
                       ms > 0 ? tflop / (ms * 1e-3) : 0.0);
  }
  out += fmt::format("\nbuild: {}\n", r.env.commit);
  return out;
}

// Opens `path` for writing on rank 0, once the results are ready (check_output_path ran before
// the model load), so that a failed run leaves an existing file as it was.
std::FILE* open_output(const std::string& path, const char* flag) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  FN_REQUIRE(f != nullptr, Io, "{} {}: cannot open for writing", flag, path);
  return f;
}

// Writes `s` to the file `path` (opened and truncated only now) and closes it.
void write_file(const std::string& path, const std::string& s, const char* flag) {
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(open_output(path, flag), &std::fclose);
  const bool ok =
      std::fwrite(s.data(), 1, s.size(), f.get()) == s.size() && std::fflush(f.get()) == 0;
  FN_REQUIRE(ok, Io, "{} {}: write failed ({})", flag, path, std::strerror(errno));
}

// --breakdown of one lane: kBreakdownWarmup + `steps` eager steps, then as many in a graph with
// event nodes (a failure there is reported, not fatal), from the current position `depth`.
Breakdown run_breakdown(Backend& model, const ModelConfig& cfg, const ShardPlan& plan,
                        int64_t steps, int32_t first, int64_t depth, bool root) {
  Breakdown b;
  b.steps = steps;
  b.depth = depth;
  model.profile_steps(first, kBreakdownWarmup, false);
  const StepBreakdown eager = model.profile_steps(first, steps, false);
  b.eager_step_ms = eager.step_ms;
  std::optional<StepBreakdown> graph;
  try {
    model.profile_steps(first, kBreakdownWarmup, true);
    graph = model.profile_steps(first, steps, true);
    b.graph_step_ms = graph->step_ms;
    b.events = graph->events;
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Cuda) throw;
    b.graph_error = e.what();
    if (root)
      FN_LOG_WARN("bench: --breakdown inside a CUDA graph failed ({}); eager only", e.what());
  }
  // Bytes at the middle of the profiled steps (rank 0, whose time is reported).
  const TokenBytes tb = bytes_per_token(plan, cfg, 0, depth + kBreakdownWarmup + steps);
  for (std::size_t i = 0; i < eager.families.size(); ++i) {
    FamilyRow f;
    f.family = eager.families[i];
    f.bytes = family_bytes(f.family, tb, cfg, plan.tp_size());
    f.ms_eager = eager.ms[i];
    if (graph) {
      f.ms_graph = graph->ms[i];
      f.segments = graph->segments[i];
    } else {
      f.segments = eager.segments[i];
    }
    b.rows.push_back(f);
  }
  return b;
}

// What run_bench settles before the load: the lanes, the model's config and the shard plan.
struct BenchSetup {
  std::vector<int64_t> prompts, gens, batches;
  bool skip_prefill = false;
  fs::path dir;  // the model directory or the --config file
  ModelConfig cfg;
  GenerationConfig gen;
  int64_t ctx = 0;
  std::optional<ShardPlan> plan;
};

// run_bench's checks of the flags, the model's config and the output paths (those on rank 0
// only), with no communication. Throws fn::Error: Usage for the flags, Io/Format for the files.
BenchSetup setup_bench(const BenchCli& o, int world_size, bool root) {
  BenchSetup st;
  check_backend_and_tp(o.backend.backend, o.backend.tp, world_size);
  st.prompts = parse_lengths(o.n_prompt, "-p/--n-prompt", kPromptRange);
  st.gens = parse_lengths(o.n_gen, "-n/--n-gen", kGenRange);
  st.batches = parse_lengths(o.batch, "--batch", WholeRange(1, kMaxBatchSlots));
  FN_REQUIRE(o.repetitions >= 1, Usage, "-r/--repetitions must be >= 1, got {}", o.repetitions);
  FN_REQUIRE(o.warmup >= 0, Usage, "--warmup must be >= 0, got {}", o.warmup);
  FN_REQUIRE(o.ctx_size >= 0, Usage, "-c/--ctx-size must be >= 0 (0 = the default), got {}",
             o.ctx_size);
  FN_REQUIRE(o.seed >= 0, Usage, "--seed must be >= 0, got {}", o.seed);
  FN_REQUIRE(o.bandwidth_gbs > 0 && std::isfinite(o.bandwidth_gbs), Usage,
             "--bandwidth-gbs must be a positive number of GB/s, got {}", o.bandwidth_gbs);
  check_model_source(o.model, o.rw.random_weights, o.rw.config);
  FN_REQUIRE(o.breakdown_steps >= 1, Usage, "--breakdown-steps must be >= 1, got {}",
             o.breakdown_steps);
  FN_REQUIRE(!same_file(o.output, o.per_token), Usage,
             "-o/--output {} and --per-token {} name the same file (the report and the per-token "
             "records would overwrite each other); give two different paths",
             o.output, o.per_token);
  st.skip_prefill = o.skip_prefill;

  if (!o.rw.random_weights) require_model_dir(o.model);
  // The output files: never a checkpoint file (or the --config file), and writable; opened
  // (truncated) only when the results are ready, so a run that fails leaves them as they were.
  if (root) {
    for (const auto& [path, flag] :
         {std::pair{o.output, "-o/--output"}, std::pair{o.per_token, "--per-token"}}) {
      if (o.rw.random_weights)
        require_not_input(path, flag, o.rw.config, "--config");
      else
        require_outside_model(path, o.model, flag);
      check_output_path(path, flag);
    }
  }
  st.dir = o.rw.random_weights ? fs::path(o.rw.config) : fs::path(o.model);
  const fs::path& dir = st.dir;
  st.cfg = load_model_config(dir);
  const ModelConfig& cfg = st.cfg;
  st.gen = o.rw.random_weights ? GenerationConfig{} : load_generation_config(dir, cfg.vocab_size);
  int64_t longest = 0, longest_p = 0, longest_n = 0;
  for (int64_t p : st.prompts) {
    for (int64_t n : st.gens) {
      if (p + n > longest) std::tie(longest, longest_p, longest_n) = std::tuple(p + n, p, n);
    }
  }
  FN_REQUIRE(o.ctx_size <= cfg.max_position_embeddings, Usage,
             "-c/--ctx-size {} exceeds the model's max_position_embeddings {} ({})", o.ctx_size,
             cfg.max_position_embeddings, dir.string());
  FN_REQUIRE(longest <= cfg.max_position_embeddings, Usage,
             "the lane -p/--n-prompt {} -n/--n-gen {} needs {} tokens, more than the model's "
             "max_position_embeddings {} ({})",
             longest_p, longest_n, longest, cfg.max_position_embeddings, dir.string());
  // --breakdown profiles after the lane's last repetition: eager then graph, each with warm-up.
  const int64_t extra = o.breakdown ? 2 * (kBreakdownWarmup + o.breakdown_steps) : 0;
  st.ctx = o.ctx_size > 0 ? o.ctx_size : longest + extra;
  const int64_t ctx = st.ctx;
  FN_REQUIRE(longest + extra <= ctx, Usage,
             "the lane -p/--n-prompt {} -n/--n-gen {} needs {} tokens{}, more than -c/--ctx-size "
             "{}",
             longest_p, longest_n, longest + extra,
             extra > 0 ? fmt::format(" ({} for --breakdown)", extra) : std::string(), ctx);
  FN_REQUIRE(ctx <= cfg.max_position_embeddings, Usage,
             "the lanes with --breakdown need a context of {} tokens, more than the model's "
             "max_position_embeddings {} ({})",
             ctx, cfg.max_position_embeddings, dir.string());
  // The roofline side: the shard plan of this TP size (Usage when the model cannot split).
  const QuantConfig quant =
      o.rw.random_weights ? load_quant_config_file(dir) : load_quant_config(dir);
  st.plan = with_tp_hint(dir, world_size, [&] { return ShardPlan::build(cfg, quant, world_size); });

  return st;
}

int run_bench(BenchCli& o, MpiContext& mpi) {
  const bool root = mpi.world_rank() == 0;
  MpiCollectives coll(mpi.world());
  // Agreed on (collective): bad flags or files end every rank normally, with rank 0's message.
  BenchSetup st;
  agree_on_error(coll, [&] { st = setup_bench(o, mpi.world_size(), root); });
  // --skip-prefill and --breakdown need the cuda backend: refused before the load, agreed on
  // like the checks above (with --random-weights the loader names the backend it needs).
  if (!o.rw.random_weights && (st.skip_prefill || o.breakdown)) {
    const std::string backend = resolve_backend(o.backend, coll);
    agree_on_error(coll, [&] {
      FN_REQUIRE(backend == "cuda", Usage, "{} needs the cuda backend (this run uses {})",
                 st.skip_prefill ? "--skip-prefill" : "--breakdown", backend);
    });
  }
  const std::vector<int64_t>& prompts = st.prompts;
  const std::vector<int64_t>& gens = st.gens;
  const bool skip_prefill = st.skip_prefill;
  const fs::path& dir = st.dir;
  const ModelConfig& cfg = st.cfg;
  const GenerationConfig& gen = st.gen;
  const int64_t ctx = st.ctx;
  const ShardPlan& plan = *st.plan;

  std::string per_token_text;  // --per-token records, written with the report
  BackendFlags flags = o.backend;
  flags.max_batch = *std::max_element(st.batches.begin(), st.batches.end());
  const std::unique_ptr<Backend> backend =
      o.rw.random_weights
          ? load_backend_random(flags, dir, static_cast<uint64_t>(o.seed), mpi, coll, ctx, "bench")
          : load_backend(flags, dir, mpi, coll, ctx, "bench");
  Backend& model = *backend;
  const BackendInfo& info = model.info();
  // Refused above for any other backend: the cuda backend provides both.
  FN_CHECK(!skip_prefill || model.capabilities().set_position, "backend {} has no set_position",
           info.name);
  FN_CHECK(!o.breakdown || model.capabilities().profile, "backend {} has no profile", info.name);
  if (root && skip_prefill) {
    FN_LOG_INFO(
        "bench: prefill skipped: position set to depth (n_prompt - 1) before each repetition; "
        "caches hold zeros; TTFT not measured");
  }

  Report rep;
  rep.model = o.rw.random_weights ? "random:" + dir.string() : dir.string();
  rep.random_weights = o.rw.random_weights;
  rep.prefill_skipped = skip_prefill;
  rep.backend = info.name;
  rep.all_reduce = info.all_reduce_name;
  rep.tp_size = info.tp_size;
  rep.ctx_size = ctx;
  rep.repetitions = o.repetitions;
  rep.warmup = o.warmup;
  rep.seed = static_cast<uint64_t>(o.seed);
  rep.logprobs = o.logprobs;
  rep.vocab_size = info.vocab_size;
  rep.load_ms = info.load_ms;
  rep.bandwidth_gbs = o.bandwidth_gbs;
  // The default is an H200 figure: on the cpu backend the source says it is not this machine's
  // (the % of ref is then against an H200, not the CPU's memory bandwidth).
  rep.bandwidth_source = o.o_bandwidth->count() > 0
                             ? "given with --bandwidth-gbs"
                             : "the measured H200 device copy bandwidth (default of "
                               "--bandwidth-gbs; docs/performance.md)";
  if (o.o_bandwidth->count() == 0 && info.name == "cpu")
    rep.bandwidth_source +=
        ": an H200 figure, not this CPU's (give --bandwidth-gbs for a CPU roofline)";
  if (root)
    FN_LOG_INFO("bench: reference bandwidth {} GB/s = {}", rep.bandwidth_gbs, rep.bandwidth_source);
  rep.env = query_environment(info.name);

  GenerateOptions go;
  go.sampling.temperature = 0.0;  // greedy, ties to the lowest id (host argmax or on the device)
  go.ctx_size = ctx;
  go.ignore_eos = true;
  go.top_logprobs = o.logprobs;
  const std::vector<int64_t> stops = stop_token_ids(cfg, gen);

  const std::size_t n_lanes = prompts.size() * gens.size() * st.batches.size();
  // A batched lane: B slots, each its own synthetic prompt (seed + slot: distinct tokens, so the
  // sequences route to different experts), prefilled one after another (all but the last token,
  // or the position set to n_prompt - 1 with --skip-prefill), then n_gen greedy steps of all B
  // sequences at once (sampled on the device where the backend can, else host argmax).
  using Clock = std::chrono::steady_clock;
  const auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  const auto run_batched = [&](int64_t p, int64_t n, int64_t B, LaneResult& lane) {
    FN_REQUIRE(model.slot_count() >= B, Usage, "--batch {}: the backend holds {} sequence slots", B,
               model.slot_count());
    std::vector<std::vector<int32_t>> prompts_b;
    for (int64_t b = 0; b < B; ++b)
      prompts_b.push_back(
          synthetic_prompt(rep.seed + static_cast<uint64_t>(b), p, info.vocab_size, stops));
    std::vector<int64_t> slots(static_cast<std::size_t>(B));
    for (int64_t b = 0; b < B; ++b) slots[static_cast<std::size_t>(b)] = b;
    const bool on_device = model.capabilities().batch_sampling;
    std::vector<SlotSampling> greedy(static_cast<std::size_t>(B));
    for (SlotSampling& g : greedy) g.sampling.temperature = 0.0;
    const auto V = static_cast<std::size_t>(info.vocab_size);
    for (int64_t k = -o.warmup; k < o.repetitions; ++k) {
      const auto t0 = Clock::now();
      std::vector<int32_t> feed(static_cast<std::size_t>(B));
      for (int64_t b = 0; b < B; ++b) {
        const std::vector<int32_t>& pr = prompts_b[static_cast<std::size_t>(b)];
        model.select_slot(b);
        model.reset();
        if (skip_prefill) {
          model.set_position_for_benchmark(p - 1);
        } else if (p > 1) {
          model.prefill(std::span<const int32_t>(pr).first(static_cast<std::size_t>(p - 1)),
                        PrefillOutput::None);
        }
        feed[static_cast<std::size_t>(b)] = pr.back();
      }
      model.select_slot(0);
      const double prefill = ms_since(t0);
      std::vector<double> steps;
      for (int64_t i = 0; i < n; ++i) {
        const auto ts = Clock::now();
        if (on_device) {
          for (SlotSampling& g : greedy) g.step = i;
          feed = model.sample_batch(slots, feed, greedy);
        } else {
          const std::span<const float> rows = model.forward_batch(slots, feed);
          for (std::size_t b = 0; b < feed.size(); ++b)
            feed[b] = argmax_lowest(rows.subspan(b * V, V));
        }
        steps.push_back(ms_since(ts));
      }
      if (k < 0) continue;
      if (!skip_prefill) {
        lane.ttft_ms.push_back(prefill + steps.front());
        lane.prefill_ms.push_back(prefill);
      }
      const std::vector<double> gaps(steps.begin() + 1, steps.end());
      lane.tpot_ms.push_back(latency_stats(gaps).mean);
      lane.itl_ms.push_back(gaps);
    }
    lane.decode_depth = p + n / 2;
    for (int rank = 0; rank < plan.tp_size(); ++rank) {
      const StepBytes sb = bytes_per_step(plan, cfg, rank, lane.decode_depth, B);
      lane.bytes_by_rank.push_back(sb.total() / static_cast<uint64_t>(B));
      if (rank == 0 || sb.total() > lane.step_bytes) {
        lane.step_bytes = sb.total();
        lane.distinct_experts = sb.distinct_experts;
        lane.weight_bytes = (sb.shared_weights + sb.experts) / static_cast<uint64_t>(B);
        lane.state_bytes = sb.total() / static_cast<uint64_t>(B) - lane.weight_bytes;
      }
    }
  };
  for (int64_t p : prompts) {
    const std::vector<int32_t> prompt = synthetic_prompt(rep.seed, p, info.vocab_size, stops);
    for (int64_t n : gens) {
      for (const int64_t B : st.batches) {
        LaneResult lane;
        lane.batch = B;
        lane.distinct_experts = static_cast<double>(cfg.num_experts_per_tok);
        if (B > 1) {
          lane.n_prompt = p;
          lane.n_gen = n;
          lane.prompt_flops = static_cast<double>(B) * prefill_flops(cfg, 0, p, 1).total();
          run_batched(p, n, B, lane);
          if (root) {
            const json j = lane_json(lane, rep.bandwidth_gbs);
            FN_LOG_INFO(
                "bench: lane {}/{} (--batch {} -p {} -n {}): step {:.4f} ms, {:.1f} output "
                "tokens/s, "
                "{:.2f} GB/s ({:.3f}% of the {} GB/s reference)",
                rep.lanes.size() + 1, n_lanes, B, p, n, j["tpot_ms"].get<double>(),
                j["decode_tokens_per_s"].get<double>(), j["achieved_gbs"].get<double>(),
                j["pct_of_bandwidth"].get<double>(), rep.bandwidth_gbs);
          }
          rep.lanes.push_back(std::move(lane));
          continue;
        }
        lane.n_prompt = p;
        lane.prompt_flops = prefill_flops(cfg, 0, p, 1).total();
        lane.n_gen = n;
        go.max_new_tokens = n;
        int32_t last_id = prompt.back();
        for (int64_t k = -o.warmup; k < o.repetitions; ++k) {
          model.reset();
          // Prefill skipped: the last prompt token runs at its own position, n_prompt - 1.
          if (skip_prefill) model.set_position_for_benchmark(p - 1);
          const std::span<const int32_t> fed = skip_prefill
                                                   ? std::span<const int32_t>(prompt).last(1)
                                                   : std::span<const int32_t>(prompt);
          const GenerationResult r = generate(model, coll, fed, go);
          last_id = r.token_ids.back();
          FN_CHECK(static_cast<int64_t>(r.itl_ms.size()) == n - 1, "lane -p {} -n {}: {} gaps", p,
                   n, r.itl_ms.size());
          if (k < 0) continue;
          if (!skip_prefill) {
            lane.ttft_ms.push_back(r.ttft_ms);
            lane.prefill_ms.push_back(r.prefill_ms);
          }
          lane.tpot_ms.push_back(r.tpot.mean);
          lane.itl_ms.push_back(r.itl_ms);
          if (root && !o.per_token.empty()) {
            const json j = {{"lane", rep.lanes.size()},
                            {"n_prompt", p},
                            {"n_gen", n},
                            {"repetition", k},
                            {"ttft_ms", skip_prefill ? json(nullptr) : json(r.ttft_ms)},
                            {"prefill_ms", skip_prefill ? json(nullptr) : json(r.prefill_ms)},
                            {"itl_ms", r.itl_ms}};
            per_token_text += j.dump() + "\n";
          }
        }
        // The timed decode steps see n_prompt + 1 ... n_prompt + n_gen - 1 tokens: mean
        // n_prompt + n_gen / 2.
        lane.decode_depth = p + n / 2;
        uint64_t most = 0;
        for (int rank = 0; rank < plan.tp_size(); ++rank) {
          const TokenBytes tb = bytes_per_token(plan, cfg, rank, lane.decode_depth);
          lane.bytes_by_rank.push_back(tb.total());
          if (rank == 0 || tb.total() > most) {
            most = tb.total();
            lane.weight_bytes = tb.weight_total();
            lane.state_bytes = tb.state_total();
          }
        }
        if (o.breakdown)
          lane.breakdown =
              run_breakdown(model, cfg, plan, o.breakdown_steps, last_id, p - 1 + n, root);
        if (o.breakdown && !skip_prefill) {  // one more prefill, timed per family
          model.reset();
          model.set_prefill_profile(true);
          model.prefill(prompt, PrefillOutput::None);
          model.set_prefill_profile(false);
          lane.prefill_breakdown = model.last_prefill_profile();
        }
        if (root) {
          const json j = lane_json(lane, rep.bandwidth_gbs);
          FN_LOG_INFO(
              "bench: lane {}/{} (-p {} -n {}): TTFT {} ms, TPOT {:.4f} ms, {:.1f} tokens/s, "
              "{:.2f} GB/s ({:.3f}% of the {} GB/s reference)",
              rep.lanes.size() + 1, n_lanes, p, n,
              j["ttft_ms"].is_null() ? std::string("n/a")
                                     : fmt::format("{:.3f}", j["ttft_ms"].get<double>()),
              j["tpot_ms"].get<double>(), j["decode_tokens_per_s"].get<double>(),
              j["achieved_gbs"].get<double>(), j["pct_of_bandwidth"].get<double>(),
              rep.bandwidth_gbs);
        }
        rep.lanes.push_back(std::move(lane));
      }
    }
  }

  // Rank 0 writes; a write that fails (-o /dev/full, a full disk) is agreed on, so every rank
  // ends with rank 0's one message and the io exit code, not through MPI_Abort.
  agree_on_error(coll, [&] {
    if (!root) return;
    std::string text;
    if (o.format == "md") {
      text = format_md(rep);
    } else if (o.format == "csv") {
      text = format_csv(rep);
    } else {
      text = format_json(rep, o.format == "jsonl");
    }
    if (!o.per_token.empty()) write_file(o.per_token, per_token_text, "--per-token");
    if (o.output.empty()) {
      write_stdout(text);
    } else {
      write_file(o.output, text, "-o/--output");
    }
  });
  return 0;
}

}  // namespace

void register_bench(CLI::App& app, CommandList& commands) {
  auto o = std::make_shared<BenchCli>();
  CLI::App* sub = app.add_subcommand(
      "bench",
      "latency lanes in llama-bench style (mpirun -np N: tensor-parallel over N ranks): per lane "
      "(n_prompt, n_gen) TTFT, TPOT, ITL percentiles, tokens/s and the bandwidth roofline");
  add_model_source_options(sub, o->model, o->rw, nullptr);
  sub->add_flag("--skip-prefill", o->skip_prefill,
                "cuda: move the position to n_prompt - 1 instead of running the prompt (caches "
                "hold zeros; TTFT is not measured)");
  sub->add_flag("--breakdown", o->breakdown,
                "cuda: after each lane, time every op family of the decode step (eager and in a "
                "graph, a CUDA event at each family boundary) next to its bytes per token, and "
                "(prefill not skipped) of one more prefill next to its FLOPs");
  add_whole_option(sub, "--breakdown-steps", o->breakdown_steps,
                   "steps averaged by --breakdown, each mode (default 32; 4 warm-up steps first)",
                   WholeRange(1, kMaxTokenCount));
  sub->add_option("-p,--n-prompt", o->n_prompt,
                  "prompt lengths, comma-separated (default 512); lanes = every -p with every -n");
  sub->add_option("-n,--n-gen", o->n_gen,
                  "generated token counts, comma-separated, each >= 2 (default 128)");
  add_whole_option(sub, "-r,--repetitions", o->repetitions,
                   "measured repetitions per lane, 1 to 1000 (default 5)", kRepetitionsRange);
  add_whole_option(sub, "--warmup", o->warmup,
                   "discarded repetitions per lane before the measured ones, 0 to 1000 (default 1)",
                   kWarmupRange);
  sub->add_option("--format", o->format, "report format: md | csv | json | jsonl (default md)")
      ->check(CLI::IsMember({"md", "csv", "json", "jsonl"}));
  add_stdout_option(sub, "-o,--output", o->output, "write the report to FILE");
  sub->add_option("--per-token", o->per_token,
                  "JSONL: one record per lane and measured repetition with its TTFT and every "
                  "inter-token latency (n_gen - 1 gaps)")
      ->check(non_empty_path());
  add_whole_option(
      sub, "-c,--ctx-size", o->ctx_size,
      "context size in tokens (default, or 0: the longest lane, max of n_prompt + n_gen)",
      WholeRange(0, kMaxTokenCount));
  add_whole_option(sub, "-s,--seed", o->seed, "seed of the synthetic prompt ids (default 0)", {});
  sub->add_option("--batch", o->batch,
                  "sequences decoded side by side per step, comma-separated (default 1); every "
                  "lane runs at every batch: B > 1 gives throughput lanes (output tokens/s, the "
                  "step time, the bytes of a step)");
  add_whole_option(sub, "--logprobs", o->logprobs,
                   "also compute each decoded token's log-prob and its K most likely alternatives "
                   "(as generate --logprobs K; the cost of that reduction in the TPOT)",
                   WholeRange(0, kMaxTopLogprobs));
  o->o_bandwidth = add_real_option(
      sub, "--bandwidth-gbs", o->bandwidth_gbs,
      "reference memory bandwidth in GB/s for the roofline (default 4300: the measured H200 "
      "device copy bandwidth)");
  add_backend_flags(sub, o->backend,
                    "every lane runs over all of them, and its bytes per token and floor are the "
                    "largest rank's share at that size");
  commands.push_back({sub, [o](MpiContext& mpi) { return run_bench(*o, mpi); }});
}

}  // namespace fn
