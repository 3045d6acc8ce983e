// `fngen bench`: latency lanes in llama-bench style (DESIGN.md "Same engine, other front ends"),
// launched as `mpirun -np N fngen bench -m DIR -p 8192 -n 512` (TP = world size; the model is
// loaded by apps/backend.h exactly as `fngen generate` does). A lane is one (n_prompt, n_gen)
// pair of the product of the -p and -n lists: reset, prefill n_prompt synthetic token ids
// (deterministic from --seed, uniform over the vocabulary, never a stop id), then n_gen greedy
// tokens through the generation loop of core/generate.h (host argmax, stop ids ignored): the
// first token's latency is the TTFT, the n_gen - 1 gaps after it are the inter-token latencies
// (ITL). Each lane runs --warmup discarded repetitions, then -r/--repetitions measured ones, on
// every rank; rank 0 prints the report (--format md|csv|json|jsonl, stdout or -o FILE) and the
// per-token record (--per-token FILE). The roofline columns come from the shard plan
// (core/shard_plan.h bytes_per_token at the lane's mean decode depth, the largest over ranks)
// and the reference bandwidth --bandwidth-gbs. Logs go to stderr.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "apps/app_util.h"
#include "apps/backend.h"
#include "apps/command.h"
#include "comm/mpi_collectives.h"
#include "comm/mpi_context.h"
#include "core/config.h"
#include "core/error.h"
#include "core/generate.h"
#include "core/log.h"
#include "core/shard_plan.h"

#ifdef FN_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

#ifndef FN_GIT_COMMIT
#define FN_GIT_COMMIT "unknown"
#endif

namespace fn {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// The measured H200 device-to-device copy bandwidth (background/performance-anchors.md §2.3).
constexpr double kH200CopyGbs = 4300.0;

struct BenchCli {
  std::string model, n_prompt = "512", n_gen = "128", format = "md", output, per_token;
  int64_t repetitions = 5, warmup = 1, ctx_size = 0, seed = 0;
  double bandwidth_gbs = kH200CopyGbs;
  BackendFlags backend;
  CLI::Option* o_bandwidth = nullptr;
};

// "512,8192" -> {512, 8192}. Every entry must be a positive integer; fn::Error(Usage) naming
// `flag` otherwise.
std::vector<int64_t> parse_lengths(const std::string& text, const char* flag) {
  std::vector<int64_t> out;
  std::size_t pos = 0;
  for (;;) {
    const std::size_t comma = text.find(',', pos);
    const std::string item =
        text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int64_t v = 0;
    const char* end = item.data() + item.size();
    const auto [p, ec] = std::from_chars(item.data(), end, v);
    FN_REQUIRE(!item.empty() && ec == std::errc() && p == end && v > 0, Usage,
               "{}: \"{}\" is not a positive token count (give a comma-separated list of lengths "
               "> 0, e.g. 512,8192; got \"{}\")",
               flag, item, text);
    out.push_back(v);
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

// One lane's measurements and roofline figures.
struct LaneResult {
  int64_t n_prompt = 0, n_gen = 0;
  std::vector<double> ttft_ms, prefill_ms, tpot_ms;  // one per measured repetition
  std::vector<std::vector<double>> itl_ms;           // per repetition, n_gen - 1 each
  int64_t decode_depth = 0;                          // visible tokens at the mean decode step
  std::vector<uint64_t> bytes_by_rank;               // bytes_per_token at decode_depth
  uint64_t weight_bytes = 0, state_bytes = 0;        // of the rank with the most bytes
};

// Everything rank 0 reports.
struct Report {
  std::string model, backend, all_reduce;
  int tp_size = 1;
  int64_t ctx_size = 0, repetitions = 0, warmup = 0, vocab_size = 0;
  uint64_t seed = 0;
  double bandwidth_gbs = kH200CopyGbs, load_ms = 0;
  std::string bandwidth_source;
  Environment env;
  std::vector<LaneResult> lanes;
};

// The per-lane fields shared by every format (names = csv columns = json keys).
json lane_json(const LaneResult& l, double bandwidth_gbs) {
  const auto [ttft, ttft_std] = mean_std(l.ttft_ms);
  const double prefill = mean_std(l.prefill_ms).first;
  const auto [tpot, tpot_std] = mean_std(l.tpot_ms);
  std::vector<double> all;
  for (const auto& r : l.itl_ms) all.insert(all.end(), r.begin(), r.end());
  const LatencyStats itl = latency_stats(all);
  const uint64_t bytes = *std::max_element(l.bytes_by_rank.begin(), l.bytes_by_rank.end());
  const double gbs = tpot > 0 ? static_cast<double>(bytes) / (tpot * 1e-3) / 1e9 : 0.0;
  return {{"n_prompt", l.n_prompt},
          {"n_gen", l.n_gen},
          {"ttft_ms", ttft},
          {"ttft_ms_std", ttft_std},
          {"prefill_ms", prefill},
          {"tpot_ms", tpot},
          {"tpot_ms_std", tpot_std},
          {"itl_p50_ms", itl.p50},
          {"itl_p90_ms", itl.p90},
          {"itl_p99_ms", itl.p99},
          {"itl_max_ms", itl.max},
          {"itl_count", itl.count},
          {"decode_tokens_per_s", tpot > 0 ? 1e3 / tpot : 0.0},
          {"prefill_tokens_per_s",
           prefill > 0 ? static_cast<double>(l.n_prompt) / (prefill * 1e-3) : 0.0},
          {"decode_depth", l.decode_depth},
          {"bytes_per_token", bytes},
          {"weight_bytes_per_token", l.weight_bytes},
          {"state_bytes_per_token", l.state_bytes},
          {"bytes_per_token_by_rank", l.bytes_by_rank},
          {"floor_ms", static_cast<double>(bytes) / (bandwidth_gbs * 1e9) * 1e3},
          {"achieved_gbs", gbs},
          {"pct_of_bandwidth", 100.0 * gbs / bandwidth_gbs}};
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
          {"vocab_size", r.vocab_size},
          {"load_ms", r.load_ms},
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
                                                "n_prompt",
                                                "n_gen",
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
                                                "decode_depth",
                                                "bytes_per_token",
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
      "fngen bench: model {}, backend {}, TP {}{}, ctx {}, {} repetitions after {} warmup, seed "
      "{}\n",
      r.model, r.backend, r.tp_size,
      r.all_reduce.empty() ? "" : fmt::format(" (all-reduce {})", r.all_reduce), r.ctx_size,
      r.repetitions, r.warmup, r.seed);
  out += fmt::format("GPU: {}, driver: {}, CUDA runtime: {}, NCCL: {}\n", r.env.gpu, r.env.driver,
                     r.env.cuda_runtime, r.env.nccl);
  out += fmt::format("reference bandwidth: {} GB/s = {}\n", r.bandwidth_gbs, r.bandwidth_source);
  out +=
      "TTFT and TPOT: mean ± std over the repetitions; ITL percentiles over every gap of every "
      "repetition; MB/token/rank: bytes read per decoded token by the busiest rank (shard plan, "
      "at the mean decode depth n_prompt + n_gen/2); floor = MB / reference bandwidth\n\n";
  out +=
      "| n_prompt | n_gen | TTFT ms | TPOT ms | ITL p50 ms | ITL p90 ms | ITL p99 ms | decode t/s "
      "| prefill t/s | MB/token/rank | floor ms | GB/s | % of ref |\n";
  out += "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& l : r.lanes) {
    const json j = lane_json(l, r.bandwidth_gbs);
    auto d = [&j](const char* k) { return j.at(k).get<double>(); };
    out += fmt::format(
        "| {} | {} | {:.3f} ± {:.3f} | {:.4f} ± {:.4f} | {:.4f} | {:.4f} | {:.4f} | {:.2f} | "
        "{:.2f} | {:.4f} | {:.4g} | {:.2f} | {:.3f} |\n",
        l.n_prompt, l.n_gen, d("ttft_ms"), d("ttft_ms_std"), d("tpot_ms"), d("tpot_ms_std"),
        d("itl_p50_ms"), d("itl_p90_ms"), d("itl_p99_ms"), d("decode_tokens_per_s"),
        d("prefill_tokens_per_s"), d("bytes_per_token") / 1e6, d("floor_ms"), d("achieved_gbs"),
        d("pct_of_bandwidth"));
  }
  out += fmt::format("\nbuild: {}\n", r.env.commit);
  return out;
}

// Opens `path` for writing on rank 0 (fails fast, before the model load).
std::FILE* open_output(const std::string& path, const char* flag) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  FN_REQUIRE(f != nullptr, Io, "{} {}: cannot open for writing", flag, path);
  return f;
}

void write_all(std::FILE* f, const std::string& s, const std::string& path, const char* flag) {
  FN_REQUIRE(std::fwrite(s.data(), 1, s.size(), f) == s.size() && std::fflush(f) == 0, Io,
             "{} {}: write failed", flag, path);
}

int run_bench(BenchCli& o, MpiContext& mpi) {
  const bool root = mpi.world_rank() == 0;
  check_backend_and_tp(o.backend.backend, o.backend.tp, mpi.world_size());
  const std::vector<int64_t> prompts = parse_lengths(o.n_prompt, "-p/--n-prompt");
  const std::vector<int64_t> gens = parse_lengths(o.n_gen, "-n/--n-gen");
  for (int64_t n : gens) {
    FN_REQUIRE(n >= 2, Usage,
               "-n/--n-gen {}: a lane needs >= 2 generated tokens (the first one's latency is the "
               "TTFT; TPOT and ITL time the gaps after it)",
               n);
  }
  FN_REQUIRE(o.repetitions >= 1, Usage, "-r/--repetitions must be >= 1, got {}", o.repetitions);
  FN_REQUIRE(o.warmup >= 0, Usage, "--warmup must be >= 0, got {}", o.warmup);
  FN_REQUIRE(o.ctx_size >= 0, Usage, "-c/--ctx-size must be > 0 (0 = default), got {}", o.ctx_size);
  FN_REQUIRE(o.seed >= 0, Usage, "--seed must be >= 0, got {}", o.seed);
  FN_REQUIRE(o.bandwidth_gbs > 0 && std::isfinite(o.bandwidth_gbs), Usage,
             "--bandwidth-gbs must be a positive number of GB/s, got {}", o.bandwidth_gbs);

  const fs::path dir = o.model;
  const ModelConfig cfg = load_model_config(dir);
  const GenerationConfig gen = load_generation_config(dir);
  int64_t longest = 0, longest_p = 0, longest_n = 0;
  for (int64_t p : prompts) {
    for (int64_t n : gens) {
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
  const int64_t ctx = o.ctx_size > 0 ? o.ctx_size : longest;
  FN_REQUIRE(longest <= ctx, Usage,
             "the lane -p/--n-prompt {} -n/--n-gen {} needs {} tokens, more than -c/--ctx-size {}",
             longest_p, longest_n, longest, ctx);
  // The roofline side: the shard plan of this TP size (Usage when the model cannot split).
  const ShardPlan plan = ShardPlan::build(cfg, load_quant_config(dir), mpi.world_size());

  std::FILE* out = stdout;
  std::FILE* per_token = nullptr;
  if (root && !o.output.empty()) out = open_output(o.output, "-o/--output");
  if (root && !o.per_token.empty()) per_token = open_output(o.per_token, "--per-token");
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> out_guard(out == stdout ? nullptr : out,
                                                                  &std::fclose);
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> per_token_guard(per_token, &std::fclose);

  MpiCollectives coll(mpi.world());
  const LoadedBackend model = load_backend(o.backend, dir, mpi, coll, ctx, "bench");

  Report rep;
  rep.model = dir.string();
  rep.backend = model.name;
  rep.all_reduce = model.all_reduce_name;
  rep.tp_size = model.tp_size;
  rep.ctx_size = ctx;
  rep.repetitions = o.repetitions;
  rep.warmup = o.warmup;
  rep.seed = static_cast<uint64_t>(o.seed);
  rep.vocab_size = model.vocab_size;
  rep.load_ms = model.load_ms;
  rep.bandwidth_gbs = o.bandwidth_gbs;
  rep.bandwidth_source = o.o_bandwidth->count() > 0
                             ? "given with --bandwidth-gbs"
                             : "the measured H200 device copy bandwidth (default of "
                               "--bandwidth-gbs; performance-anchors.md §2.3)";
  rep.env = query_environment(model.name);

  GenerateOptions go;
  go.sampling.temperature = 0.0;  // greedy: host argmax, ties to the lowest id
  go.ctx_size = ctx;
  go.ignore_eos = true;
  const std::vector<int64_t> stops = stop_token_ids(cfg, gen);

  const std::size_t n_lanes = prompts.size() * gens.size();
  for (int64_t p : prompts) {
    const std::vector<int32_t> prompt = synthetic_prompt(rep.seed, p, model.vocab_size, stops);
    for (int64_t n : gens) {
      LaneResult lane;
      lane.n_prompt = p;
      lane.n_gen = n;
      go.max_new_tokens = n;
      for (int64_t k = -o.warmup; k < o.repetitions; ++k) {
        model.reset();
        const GenerationResult r = generate(model.forward, coll, prompt, go);
        FN_CHECK(static_cast<int64_t>(r.itl_ms.size()) == n - 1, "lane -p {} -n {}: {} gaps", p, n,
                 r.itl_ms.size());
        if (k < 0) continue;
        lane.ttft_ms.push_back(r.ttft_ms);
        lane.prefill_ms.push_back(r.prefill_ms);
        lane.tpot_ms.push_back(r.tpot.mean);
        lane.itl_ms.push_back(r.itl_ms);
        if (per_token != nullptr) {
          const json j = {
              {"lane", rep.lanes.size()}, {"n_prompt", p},        {"n_gen", n},
              {"repetition", k},          {"ttft_ms", r.ttft_ms}, {"prefill_ms", r.prefill_ms},
              {"itl_ms", r.itl_ms}};
          write_all(per_token, j.dump() + "\n", o.per_token, "--per-token");
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
      if (root) {
        const json j = lane_json(lane, rep.bandwidth_gbs);
        FN_LOG_INFO(
            "bench: lane {}/{} (-p {} -n {}): TTFT {:.3f} ms, TPOT {:.4f} ms, {:.1f} tokens/s, "
            "{:.2f} GB/s ({:.3f}% of {} GB/s)",
            rep.lanes.size() + 1, n_lanes, p, n, j["ttft_ms"].get<double>(),
            j["tpot_ms"].get<double>(), j["decode_tokens_per_s"].get<double>(),
            j["achieved_gbs"].get<double>(), j["pct_of_bandwidth"].get<double>(),
            rep.bandwidth_gbs);
      }
      rep.lanes.push_back(std::move(lane));
    }
  }

  if (root) {
    std::string text;
    if (o.format == "md") {
      text = format_md(rep);
    } else if (o.format == "csv") {
      text = format_csv(rep);
    } else {
      text = format_json(rep, o.format == "jsonl");
    }
    if (out == stdout) {
      write_stdout(text);
    } else {
      write_all(out, text, o.output, "-o/--output");
    }
  }
  return 0;
}

}  // namespace

void register_bench(CLI::App& app, CommandList& commands) {
  auto o = std::make_shared<BenchCli>();
  CLI::App* sub = app.add_subcommand(
      "bench",
      "latency lanes in llama-bench style (mpirun -np N: tensor-parallel over N ranks): per lane "
      "(n_prompt, n_gen) TTFT, TPOT, ITL percentiles, tokens/s and the bandwidth roofline");
  sub->add_option("-m,--model", o->model, "model directory")->required();
  sub->add_option("-p,--n-prompt", o->n_prompt,
                  "prompt lengths, comma-separated (default 512); lanes = every -p with every -n");
  sub->add_option("-n,--n-gen", o->n_gen,
                  "generated token counts, comma-separated, each >= 2 (default 128)");
  sub->add_option("-r,--repetitions", o->repetitions, "measured repetitions per lane (default 5)");
  sub->add_option("--warmup", o->warmup,
                  "discarded repetitions per lane before the measured ones (default 1)");
  sub->add_option("--format", o->format, "report format: md | csv | json | jsonl (default md)")
      ->check(CLI::IsMember({"md", "csv", "json", "jsonl"}));
  sub->add_option("-o,--output", o->output, "write the report to FILE instead of stdout");
  sub->add_option("--per-token", o->per_token,
                  "JSONL: one record per lane and measured repetition with its TTFT and every "
                  "inter-token latency (n_gen - 1 gaps)");
  sub->add_option("-c,--ctx-size", o->ctx_size,
                  "context size in tokens (default: the longest lane, max of n_prompt + n_gen)");
  sub->add_option("-s,--seed", o->seed, "seed of the synthetic prompt ids (default 0)");
  o->o_bandwidth = sub->add_option(
      "--bandwidth-gbs", o->bandwidth_gbs,
      "reference memory bandwidth in GB/s for the roofline (default 4300: the measured H200 "
      "device copy bandwidth)");
  add_backend_flags(sub, o->backend);
  commands.push_back({sub, [o](MpiContext& mpi) { return run_bench(*o, mpi); }});
}

}  // namespace fn
