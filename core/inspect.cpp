#include "core/inspect.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>

#include "core/checkpoint.h"
#include "core/error.h"
#include "core/log.h"
#include "core/ngram.h"
#include "core/paths.h"
#include "core/weight_checks.h"

namespace fn {
namespace {

std::string human_bytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.3f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.2f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", bytes);
}

// Unquantised tensors up to this size are checked whole for non-finite values; larger ones in
// evenly spaced windows of kSampleWindowBytes (the first and the last included): kSampleWindows
// windows, kSampleWindowsVocab for the embedding and lm_head (an all-NaN or half-NaN table is
// found at once, and inspect reads at most ~4 MiB of each, whatever the checkpoint's size).
constexpr std::size_t kWholeTensorBytes = std::size_t{1} << 20;
constexpr std::size_t kSampleWindowBytes = std::size_t{16} << 10;
constexpr std::size_t kSampleWindows = 16;
constexpr std::size_t kSampleWindowsVocab = 256;

// The value checks of every tensor present with its expected dtype (the others are reported by
// validate_tensors): scale tensors whole through scale_problem (core/weight_checks.h, the check
// every load makes), unquantised float tensors for non-finite values (sampled, above).
void check_weight_values(const Checkpoint& ckpt, const std::vector<ExpectedTensor>& expected,
                         const std::string& dir, ValidationReport& v) {
  std::vector<std::byte> buf;  // a scale tensor, read whole with one pread (the mapping is
                               // advised MADV_RANDOM: page by page it would fault ~25 times)
  for (const ExpectedTensor& t : expected) {
    const TensorInfo* info = ckpt.find(t.name);
    if (info == nullptr || info->dtype != t.dtype) continue;
    if (is_scale_role(t.role)) {
      buf.resize(info->nbytes());
      ckpt.read_all(t.name, buf.data());
      const std::span<const std::byte> bytes(buf);
      std::string problem = scale_problem(t.role, t.name, info->dtype, bytes);
      if (!problem.empty()) {
        v.problems.push_back(std::move(problem));
      } else if (t.role == TensorRole::ExpertGlobalScale && t.name.ends_with("_2")) {
        const std::string blocks = t.name.substr(0, t.name.size() - 2);
        const TensorInfo* b = ckpt.find(blocks);
        float g = 0;
        std::memcpy(&g, bytes.data(), sizeof g);
        if (g == 0.0f && b != nullptr && b->dtype == DType::F8_E4M3 &&
            zero_global_scale_of_nonzero_tensor(g, ckpt.file_of(blocks).bytes(*b))) {
          FN_LOG_WARN(
              "{}: tensor '{}' is 0 while the block scales of '{}' are not: that tensor "
              "dequantizes to all zeros",
              dir, t.name, blocks);
        }
      }
      continue;
    }
    if (t.role == TensorRole::ExpertWeight) continue;  // E2M1 codes: every value is finite
    const std::span<const std::byte> bytes = ckpt.file_of(t.name).bytes(*info);
    const std::size_t es = dtype_size(info->dtype);
    if (bytes.size() <= kWholeTensorBytes) {
      std::string problem = nonfinite_problem(t.name, info->dtype, bytes);
      if (!problem.empty()) v.problems.push_back(std::move(problem));
      continue;
    }
    const std::size_t windows = t.role == TensorRole::Embedding || t.role == TensorRole::LmHead
                                    ? kSampleWindowsVocab
                                    : kSampleWindows;
    const std::size_t n = bytes.size() / es, w = kSampleWindowBytes / es;
    for (std::size_t i = 0; i < windows; ++i) {
      const std::size_t first = (n - w) * i / (windows - 1);
      std::string problem =
          nonfinite_problem(t.name, info->dtype, bytes.subspan(first * es, w * es), first);
      if (!problem.empty()) {
        v.problems.push_back(std::move(problem));
        break;
      }
    }
  }
}

// The PLE I64 buffers must hold what the config implies (docs/model.md §B.2: catches config drift).
void check_ple_buffers(const Checkpoint& ckpt, const ModelConfig& cfg,
                       const std::vector<ExpectedTensor>& expected, ValidationReport& report) {
  for (const auto& t : expected) {
    if (t.role != TensorRole::PleMultipliers && t.role != TensorRole::PleHeadSizes &&
        t.role != TensorRole::PleHeadOffsets) {
      continue;
    }
    const TensorInfo* info = ckpt.find(t.name);
    if (info == nullptr || info->dtype != DType::I64 || info->numel() != t.numel()) continue;
    std::vector<int64_t> stored(static_cast<std::size_t>(t.numel()));
    ckpt.read_all(t.name, stored.data());
    const NgramConstants k = ngram_constants(cfg, cfg.ple_rank(t.layer));
    const auto& want = t.role == TensorRole::PleMultipliers ? k.multipliers
                       : t.role == TensorRole::PleHeadSizes ? k.head_sizes
                                                            : k.head_offsets;
    if (stored != want) {
      report.problems.push_back(
          fmt::format("{}: stored values [{}] differ from those computed from config.json [{}]",
                      t.name, fmt::join(stored, ", "), fmt::join(want, ", ")));
    }
  }
}

void add_rank_figures(InspectReport& r, const QuantConfig& quant, int tp_size, int64_t ctx_size) {
  const ShardPlan plan = ShardPlan::build(r.config, quant, tp_size);
  r.tp_size = tp_size;
  r.ctx_size = ctx_size;
  for (int rank = 0; rank < tp_size; ++rank) {
    r.weight_bytes_per_rank.push_back(plan.weight_bytes(rank));
    r.weight_bytes_by_family.push_back(plan.weight_bytes_by_family(rank));
    r.token_bytes.push_back(bytes_per_token(plan, r.config, rank, ctx_size));
  }
  // Device memory of the CUDA backend at the requested context and the three reference sizes.
  r.memory_ctx_sizes = {ctx_size};
  for (int64_t t : {int64_t{8192}, int64_t{65536}, int64_t{262144}})
    if (t <= r.config.max_position_embeddings) r.memory_ctx_sizes.push_back(t);
  std::sort(r.memory_ctx_sizes.begin(), r.memory_ctx_sizes.end());
  r.memory_ctx_sizes.erase(std::unique(r.memory_ctx_sizes.begin(), r.memory_ctx_sizes.end()),
                           r.memory_ctx_sizes.end());
  for (int64_t t : r.memory_ctx_sizes) {
    std::vector<MemoryPlan> ranks, host;
    for (int rank = 0; rank < tp_size; ++rank) {
      ranks.push_back(plan_device_memory(r.config, plan, rank, t));
      if (r.config.has_ple()) host.push_back(plan_device_memory(r.config, plan, rank, t, true));
    }
    r.device_memory.push_back(std::move(ranks));
    if (!host.empty()) r.device_memory_host_ngram.push_back(std::move(host));
  }
}

// True when two ranks' plans hold the same figures.
bool same_figures(const MemoryPlan& a, const MemoryPlan& b) {
  return a.weights == b.weights && a.kv_cache == b.kv_cache && a.indexer_cache == b.indexer_cache &&
         a.gdn_state == b.gdn_state && a.gdn_conv_state == b.gdn_conv_state &&
         a.ple_conv_state == b.ple_conv_state && a.workspace == b.workspace &&
         a.reserve == b.reserve;
}

// A config file alone: the figures of the checkpoint it describes, nothing validated.
InspectReport plan_only_report(InspectReport r, const std::filesystem::path& config_file,
                               int tp_size, int64_t ctx_size) {
  using nlohmann::json;
  QuantConfig quant;
  const json j = json::parse(read_regular_file(config_file, kMaxCheckpointJsonBytes, ""), nullptr,
                             /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("quantization_config")) {
    quant = parse_quantization_config(j["quantization_config"], config_file.string());
  }
  r.quant_algo = quant.quantized() ? quant.quant_algo : "none";
  r.plan_only = true;
  for (const auto& t : expected_tensors(r.config, quant)) {
    auto& g = r.groups[fmt::format("{}/{}", tensor_family(t.role), dtype_name(t.dtype))];
    g.tensors += 1;
    g.bytes += t.nbytes();
    r.checkpoint_bytes += t.nbytes();
  }
  add_rank_figures(r, quant, tp_size, ctx_size);
  return r;
}

}  // namespace

InspectReport inspect_checkpoint(const std::filesystem::path& dir, int tp_size, int64_t ctx_size) {
  FN_REQUIRE(ctx_size >= 0, Usage, "-c/--ctx-size must be >= 0 (0 = the default), got {}",
             ctx_size);
  InspectReport r;
  r.dir = dir.string();
  r.config = load_model_config(dir);
  const int64_t max_ctx = r.config.max_position_embeddings;
  if (ctx_size == 0) ctx_size = std::min<int64_t>(8192, max_ctx);
  FN_REQUIRE(ctx_size <= max_ctx, Usage,
             "--ctx-size {} is more than the model's max_position_embeddings ({})", ctx_size,
             max_ctx);
  if (!std::filesystem::is_directory(dir))
    return plan_only_report(std::move(r), dir, tp_size, ctx_size);
  const QuantConfig quant = load_quant_config(dir);
  // generation_config.json too: generate reads it, so a damaged one fails validation here.
  (void)load_generation_config(dir, r.config.vocab_size);
  r.quant_algo = quant.quantized() ? quant.quant_algo : "none";
  const Checkpoint ckpt = Checkpoint::open(dir);
  r.files = ckpt.file_count();
  r.checkpoint_bytes = ckpt.total_bytes();

  const std::vector<ExpectedTensor> expected = expected_tensors(r.config, quant);
  const std::vector<std::string> names = ckpt.tensor_names();
  std::vector<FoundTensor> found;
  found.reserve(names.size());
  for (const auto& name : names) {
    const TensorInfo& info = ckpt.info(name);
    found.push_back({info.name, info.dtype, info.shape});
  }
  r.validation = validate_tensors(expected, found);
  check_ple_buffers(ckpt, r.config, expected, r.validation);
  check_weight_values(ckpt, expected, r.dir, r.validation);
  // Every problem on its own line only when require_valid's message cannot list them all (it
  // shows the first kValidationProblemsShown): one wrong tensor was reported twice.
  if (r.validation.problems.size() > kValidationProblemsShown) {
    for (const auto& p : r.validation.problems) FN_LOG_ERROR("{}: {}", r.dir, p);
  }
  require_valid(r.validation, r.dir);

  std::unordered_map<std::string_view, const ExpectedTensor*> by_name;
  for (const auto& t : expected) by_name.emplace(t.name, &t);
  for (const auto& name : names) {
    const TensorInfo& info = ckpt.info(name);
    std::string family;
    switch (skipped_tensor(name)) {
      case SkipReason::Vision:
        family = "skipped.vision";
        break;
      case SkipReason::Mtp:
        family = "skipped.mtp";
        break;
      case SkipReason::None:
        family = std::string(tensor_family(by_name.at(name)->role));
        break;
    }
    auto& g = r.groups[fmt::format("{}/{}", family, dtype_name(info.dtype))];
    g.tensors += 1;
    g.bytes += info.nbytes();
  }

  add_rank_figures(r, quant, tp_size, ctx_size);
  return r;
}

std::string format_inspect_text(const InspectReport& r) {
  const ModelConfig& c = r.config;
  std::string s;
  auto it_out = std::back_inserter(s);
  fmt::format_to(it_out, "checkpoint  {}\n", r.dir);
  fmt::format_to(it_out, "files       {} safetensors, {} of tensors, quantization {}\n", r.files,
                 human_bytes(r.checkpoint_bytes), r.quant_algo);
  std::vector<int64_t> ple;
  for (int64_t l : c.ple_layer_indices()) ple.push_back(l);
  fmt::format_to(it_out, "layers      {} ({} Gated DeltaNet, {} QSA; PLE at layer index {})\n",
                 c.num_hidden_layers, c.num_gdn_layers(), c.num_qsa_layers(),
                 ple.empty() ? "none" : fmt::format("{}", fmt::join(ple, ", ")));
  fmt::format_to(it_out,
                 "geometry    hidden_size {}, vocab_size {}, experts {} (top-{}), hc_count {}, "
                 "ngram table rows {}\n",
                 c.hidden_size, c.vocab_size, c.num_experts, c.num_experts_per_tok, c.hc_count,
                 c.has_ple() ? c.ngram_table_rows() : 0);
  const auto& v = r.validation;
  if (r.plan_only) {
    fmt::format_to(
        it_out,
        "validation  none: a config file alone (figures of the checkpoint it describes)\n\n");
  } else {
    fmt::format_to(
        it_out, "validation  ok: {} text tensors matched, {} vision and {} MTP tensors skipped\n\n",
        v.matched, v.skipped_vision, v.skipped_mtp);
  }

  fmt::format_to(it_out, "{:<24} {:>9} {:>14}\n", "family/dtype", "tensors", "bytes");
  for (const auto& [key, g] : r.groups)
    fmt::format_to(it_out, "{:<24} {:>9} {:>14}\n", key, g.tensors, human_bytes(g.bytes));

  fmt::format_to(it_out, "\nweights per rank at TP={}\n", r.tp_size);
  std::vector<std::string> families;
  for (const auto& [f, b] : r.weight_bytes_by_family.at(0)) families.push_back(f);
  fmt::format_to(it_out, "{:<14}", "family");
  for (int rank = 0; rank < r.tp_size; ++rank)
    fmt::format_to(it_out, " {:>14}", fmt::format("rank {}", rank));
  fmt::format_to(it_out, "\n");
  for (const auto& f : families) {
    fmt::format_to(it_out, "{:<14}", f);
    for (int rank = 0; rank < r.tp_size; ++rank) {
      const auto& m = r.weight_bytes_by_family[rank];
      auto it = m.find(f);
      fmt::format_to(it_out, " {:>14}", human_bytes(it == m.end() ? 0 : it->second));
    }
    fmt::format_to(it_out, "\n");
  }
  fmt::format_to(it_out, "{:<14}", "total");
  for (int rank = 0; rank < r.tp_size; ++rank)
    fmt::format_to(it_out, " {:>14}", human_bytes(r.weight_bytes_per_rank[rank]));

  fmt::format_to(it_out,
                 "\n\nbytes read per decoded token per rank at ctx-size {} (TP={}, batch 1)\n",
                 r.ctx_size, r.tp_size);
  std::vector<std::string> token_families;
  for (const auto& [f, b] : r.token_bytes.at(0).weights) token_families.push_back(f);
  auto row = [&](const std::string& name, auto get) {
    fmt::format_to(it_out, "{:<14}", name);
    for (int rank = 0; rank < r.tp_size; ++rank)
      fmt::format_to(it_out, " {:>14}", human_bytes(get(r.token_bytes[rank])));
    fmt::format_to(it_out, "\n");
  };
  for (const auto& f : token_families) {
    row(f, [&](const TokenBytes& t) {
      auto it = t.weights.find(f);
      return it == t.weights.end() ? uint64_t{0} : it->second;
    });
  }
  row("kv_cache", [](const TokenBytes& t) { return t.kv_cache; });
  row("indexer_cache", [](const TokenBytes& t) { return t.indexer_cache; });
  row("gdn_state", [](const TokenBytes& t) { return t.gdn_state; });
  row("conv_state", [](const TokenBytes& t) { return t.conv_state; });
  row("total", [](const TokenBytes& t) { return t.total(); });

  bool alike = true;
  for (const auto& ranks : r.device_memory)
    for (const MemoryPlan& m : ranks) alike = alike && same_figures(m, ranks.front());
  const int shown = alike ? 1 : r.tp_size;
  for (int rank = 0; rank < shown; ++rank) {
    fmt::format_to(it_out,
                   "\ndevice memory per GPU, CUDA backend (TP={}, {}; workspace is an estimate)\n",
                   r.tp_size, alike ? "every rank alike" : fmt::format("rank {}", rank));
    std::vector<MemoryPlan> cols;
    for (const auto& ranks : r.device_memory) cols.push_back(ranks[rank]);
    s += format_memory_table(cols);
    std::vector<MemoryPlan> host_cols;
    for (const auto& ranks : r.device_memory_host_ngram) host_cols.push_back(ranks[rank]);
    if (!host_cols.empty()) {
      fmt::format_to(it_out,
                     "\nwith --ngram-table host (the n-gram table in pinned host memory, read by "
                     "the gather kernels; not in the device total)\n");
      s += format_memory_table(host_cols);
    }
    // Sequences of each context whose states fit beside one copy of the weights.
    fmt::format_to(it_out, "\nsequences that fit {:.1f} GiB per GPU (--gpu-memory)\n",
                   static_cast<double>(r.gpu_bytes) / (1024.0 * 1024 * 1024));
    constexpr int kLabel = 22, kCol = 16;
    fmt::format_to(it_out, "{:<{}}", "", kLabel);
    for (const MemoryPlan& p : cols)
      fmt::format_to(it_out, " {:>{}}", fmt::format("ctx {}", p.ctx_size), kCol);
    fmt::format_to(it_out, "\n{:<{}}", host_cols.empty() ? "sequences" : "n-gram table on device",
                   kLabel);
    for (const MemoryPlan& p : cols)
      fmt::format_to(it_out, " {:>{}}", sequences_fit(p, r.gpu_bytes), kCol);
    fmt::format_to(it_out, "\n");
    if (!host_cols.empty()) {
      fmt::format_to(it_out, "{:<{}}", "n-gram table in host", kLabel);
      for (const MemoryPlan& p : host_cols)
        fmt::format_to(it_out, " {:>{}}", sequences_fit(p, r.gpu_bytes), kCol);
      fmt::format_to(it_out, "\n");
    }
  }
  return s;
}

nlohmann::json inspect_json(const InspectReport& r) {
  using nlohmann::json;
  const ModelConfig& c = r.config;
  json groups = json::object();
  for (const auto& [key, g] : r.groups) groups[key] = {{"tensors", g.tensors}, {"bytes", g.bytes}};
  json ranks = json::array();
  for (int rank = 0; rank < r.tp_size; ++rank) {
    const TokenBytes& t = r.token_bytes[rank];
    ranks.push_back({{"rank", rank},
                     {"weight_bytes", r.weight_bytes_per_rank[rank]},
                     {"weight_bytes_by_family", r.weight_bytes_by_family[rank]},
                     {"token_bytes",
                      {{"weights", t.weights},
                       {"kv_cache", t.kv_cache},
                       {"indexer_cache", t.indexer_cache},
                       {"gdn_state", t.gdn_state},
                       {"conv_state", t.conv_state},
                       {"total", t.total()}}}});
  }
  json memory = json::array();
  for (std::size_t i = 0; i < r.device_memory.size(); ++i) {
    json mranks = json::array(), fit = json::array();
    for (const MemoryPlan& m : r.device_memory[i]) {
      mranks.push_back(memory_plan_json(m));
      fit.push_back(sequences_fit(m, r.gpu_bytes));
    }
    json entry = {{"ctx_size", r.memory_ctx_sizes[i]}, {"ranks", mranks}, {"sequences_fit", fit}};
    if (i < r.device_memory_host_ngram.size()) {
      json hranks = json::array(), hfit = json::array();
      for (const MemoryPlan& m : r.device_memory_host_ngram[i]) {
        hranks.push_back(memory_plan_json(m));
        hfit.push_back(sequences_fit(m, r.gpu_bytes));
      }
      entry["ranks_ngram_host"] = hranks;
      entry["sequences_fit_ngram_host"] = hfit;
    }
    memory.push_back(entry);
  }
  const auto& v = r.validation;
  return {{"dir", r.dir},
          {"config",
           {{"num_hidden_layers", c.num_hidden_layers},
            {"gdn_layers", c.num_gdn_layers()},
            {"qsa_layers", c.num_qsa_layers()},
            {"ple_layer_indices", c.ple_layer_indices()},
            {"hidden_size", c.hidden_size},
            {"vocab_size", c.vocab_size},
            {"num_experts", c.num_experts},
            {"num_experts_per_tok", c.num_experts_per_tok},
            {"quant_algo", r.quant_algo}}},
          {"files", r.files},
          {"checkpoint_bytes", r.checkpoint_bytes},
          {"plan_only", r.plan_only},
          {"validation",
           {{"matched", v.matched},
            {"skipped_vision", v.skipped_vision},
            {"skipped_mtp", v.skipped_mtp}}},
          {"groups", groups},
          {"tp_size", r.tp_size},
          {"ctx_size", r.ctx_size},
          {"ranks", ranks},
          {"device_memory", memory},
          {"gpu_bytes", r.gpu_bytes}};
}

}  // namespace fn
