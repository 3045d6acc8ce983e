#include "core/memory_plan.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <iterator>
#include <sstream>

#include "core/device_layout.h"
#include "core/error.h"
#include "core/model_tensors.h"

namespace fn {
namespace {

constexpr uint64_t kAlign = 256;

uint64_t align256(uint64_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

/// One piece of an aligned block: max(count, 1) elements of `size` bytes, rounded to 256 B (the
/// align256 of cuda/kernels/qsa.cu).
uint64_t piece(int64_t count, uint64_t size) {
  return align256(static_cast<uint64_t>(std::max<int64_t>(count, 1)) * size);
}

/// Device bytes per element of tensor role `role` in the CUDA backend, or 0 when the backend
/// does not keep it on the device. As the CUDA model's load (cuda/model/load.cpp) holds them:
/// Builder::vec / upload_f32 widen the 1-D
/// norm, conv, A_log and dt_bias weights to FP32; the NVFP4 global scales are an FP32 array;
/// input_scale (W4A4 only, docs/model.md §B.4), the PLE I64 buffers (checked on the host) and the
/// n-gram weight_scale (a host scalar) are not allocated.
uint64_t device_element_bytes(const ExpectedTensor& t) {
  switch (t.role) {
    case TensorRole::GdnALog:
    case TensorRole::GdnDtBias:
    case TensorRole::GdnConv:
    case TensorRole::GdnNorm:
    case TensorRole::QsaQNorm:
    case TensorRole::QsaKNorm:
    case TensorRole::IndexerQNorm:
    case TensorRole::IndexerKNorm:
    case TensorRole::PleNormKey:
    case TensorRole::PleNormQuery:
    case TensorRole::PleNormConv:
    case TensorRole::PleConv:
    case TensorRole::ExpertGlobalScale:
      return 4;
    case TensorRole::ExpertInputScale:
    case TensorRole::PleMultipliers:
    case TensorRole::PleHeadSizes:
    case TensorRole::PleHeadOffsets:
    case TensorRole::PleNgramScale:
      return 0;
    default:
      return dtype_size(t.dtype);
  }
}

std::string human(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.3f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.2f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", bytes);
}

double gib(uint64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024 * 1024);
}

}  // namespace

// The layout of qsa_workspace_layout (cuda/kernels/qsa.cu), recomputed without CUDA;
// tests/test_memory_plan_cuda.cpp compares the two where CUDA is built.
uint64_t qsa_workspace_estimate(const ModelConfig& c, int tp, int64_t ctx) {
  FN_REQUIRE(ctx >= 1, Usage, "-c/--ctx-size must be >= 1, got {}", ctx);
  const RankDims rd = rank_dims(c, tp, 0);  // the same on every rank
  const int64_t Hq_l = rd.q_heads, hd = c.head_dim, Hkv_l = rd.kv_heads;
  const int64_t q_per_kv = rd.q_per_kv;
  const int64_t ratio = c.indexer_compress_ratio;
  const int64_t block_topk = c.indexer_budget / ratio;
  const int64_t max_blocks = ctx / ratio;
  const int64_t sel_max = std::min(block_topk, max_blocks);
  const int64_t max_tokens = std::min(ctx, ratio * sel_max + ratio - 1);
  const int64_t gmax = std::min(Hq_l, q_per_kv);  // query heads per local KV head
  auto smem = [&](int64_t chunk) {
    return gmax * hd * 4 + gmax * chunk * 4 + chunk * 4 + 2 * chunk * hd * 2;
  };
  const int64_t per = (max_tokens * Hkv_l + 255) / 256;
  int64_t chunk = std::clamp<int64_t>((per + 15) / 16 * 16, 16, 64);
  while (chunk > 16 && smem(chunk) > 48 * 1024) chunk -= 16;
  const int64_t max_chunks = (max_tokens + chunk - 1) / chunk;
  return piece(Hq_l * hd, 4) + piece(c.indexer_n_heads * c.indexer_head_dim, 4) +
         piece(max_blocks, 4) + piece(sel_max, 4) + piece(4, 4) + piece(Hq_l * max_chunks * hd, 4) +
         2 * piece(Hq_l * max_chunks, 4);
}

uint64_t MemoryPlan::weight_total() const {
  uint64_t n = 0;
  for (const auto& [family, bytes] : weights) n += bytes;
  return n;
}

uint64_t MemoryPlan::state_total() const {
  return kv_cache + indexer_cache + gdn_state + gdn_conv_state + ple_conv_state;
}

uint64_t MemoryPlan::total() const {
  return weight_total() + state_total() + workspace + reserve;
}

MemoryPlan plan_device_memory(const ModelConfig& c, const ShardPlan& plan, int tp_rank,
                              int64_t ctx_size, bool ngram_on_host) {
  FN_REQUIRE(ctx_size >= 1, Usage, "-c/--ctx-size must be >= 1, got {}", ctx_size);
  const int tp = plan.tp_size();
  FN_CHECK(tp_rank >= 0 && tp_rank < tp, "tp_rank {} of tp_size {}", tp_rank, tp);
  MemoryPlan m;
  m.tp_size = tp;
  m.tp_rank = tp_rank;
  m.ctx_size = ctx_size;

  // Weights (docs/model.md §B.2 shapes, §E.2 splits), as the CUDA model holds them.
  for (std::size_t i = 0; i < plan.tensors().size(); ++i) {
    const ExpectedTensor& t = plan.tensors()[i];
    const uint64_t per = device_element_bytes(t);
    if (per == 0) continue;
    m.weights[std::string(tensor_family(t.role))] +=
        static_cast<uint64_t>(plan.shard_elements(i, tp_rank)) * per;
  }
  if (ngram_on_host) {
    const auto it = m.weights.find("ple.ngram");
    if (it != m.weights.end()) {
      m.ngram_host = it->second;
      m.weights.erase(it);
    }
  }

  // States and scratch: the buffers the CUDA model's arena build allocates (core/device_layout.h).
  const DeviceLayout l = device_layout(c, tp, tp_rank, ctx_size);
  m.kv_cache = l.kv_cache_total();
  m.indexer_cache = l.indexer_cache_total();
  m.gdn_state = l.gdn_state_total();
  m.gdn_conv_state = l.gdn_conv_state_total();
  m.ple_conv_state = l.ple_conv_state_total();
  m.workspace = l.scratch_total();
  return m;
}

int64_t sequences_fit(const MemoryPlan& p, uint64_t gpu_bytes) {
  const uint64_t fixed = p.weight_total() + p.workspace + p.reserve;
  if (fixed >= gpu_bytes || p.state_total() == 0) return 0;
  return static_cast<int64_t>((gpu_bytes - fixed) / p.state_total());
}

const char* ngram_table_name(NgramTable t) noexcept {
  switch (t) {
    case NgramTable::Device:
      return "device";
    case NgramTable::Host:
      return "host";
    case NgramTable::Auto:
      return "auto";
  }
  return "?";
}

NgramTable parse_ngram_table(std::string_view name) {
  for (NgramTable t : {NgramTable::Device, NgramTable::Host, NgramTable::Auto})
    if (name == ngram_table_name(t)) return t;
  FN_THROW(Usage, "--ngram-table: '{}' is not one of device, host, auto", name);
}

NgramPlacement place_ngram_table(NgramTable requested, const MemoryPlan& device_plan,
                                 uint64_t free_bytes, double utilization) {
  FN_REQUIRE(utilization > 0.0 && utilization <= 1.0, Usage,
             "--gpu-memory-utilization must be in (0, 1], got {}", utilization);
  const auto it = device_plan.weights.find("ple.ngram");
  const uint64_t table = it == device_plan.weights.end() ? 0 : it->second;
  if (table == 0) return {false, "no n-gram table on this rank"};
  if (requested == NgramTable::Device) return {false, "--ngram-table device"};
  if (requested == NgramTable::Host) return {true, "--ngram-table host"};
  const uint64_t budget =
      static_cast<uint64_t>(utilization * static_cast<double>(free_bytes));  // floor
  const uint64_t need = device_plan.total();
  if (need <= budget)
    return {false, fmt::format("auto: {} with the table on the device fits {} ({} x {} free)",
                               human(need), human(budget), utilization, human(free_bytes))};
  return {true,
          fmt::format("auto: {} with the table on the device exceeds {} ({} x {} free); the "
                      "table's {} goes to pinned host memory",
                      human(need), human(budget), utilization, human(free_bytes), human(table))};
}

uint64_t parse_mem_available(std::string_view meminfo) {
  constexpr std::string_view kKey = "MemAvailable:";
  std::size_t at = meminfo.find(kKey);
  while (at != std::string_view::npos && at > 0 && meminfo[at - 1] != '\n')
    at = meminfo.find(kKey, at + 1);
  FN_REQUIRE(at != std::string_view::npos, Format, "/proc/meminfo has no MemAvailable line");
  std::size_t i = at + kKey.size();
  while (i < meminfo.size() && meminfo[i] == ' ') ++i;
  uint64_t kb = 0;
  const auto [end, ec] = std::from_chars(meminfo.data() + i, meminfo.data() + meminfo.size(), kb);
  FN_REQUIRE(ec == std::errc() && end != meminfo.data() + i && kb < (uint64_t{1} << 53), Format,
             "/proc/meminfo: MemAvailable is not a number of kB");
  return kb * 1024;
}

uint64_t host_mem_available() {
  std::ifstream in("/proc/meminfo");
  FN_REQUIRE(in.good(), Io, "/proc/meminfo: cannot open (MemAvailable for --ngram-table host)");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_mem_available(ss.str());
}

void require_host_fits(uint64_t need, uint64_t available, const std::string& what) {
  FN_REQUIRE(need <= available, Usage,
             "{}: the n-gram table in host memory (--ngram-table host) needs {} of pinned host "
             "memory, {} available (MemAvailable, /proc/meminfo): use --ngram-table device or "
             "more GPUs (--tp)",
             what, human(need), human(available));
}

std::string format_memory_table(const std::vector<MemoryPlan>& plans) {
  if (plans.empty()) return {};
  bool mixed = false;
  for (const MemoryPlan& p : plans)
    mixed = mixed || p.tp_size != plans[0].tp_size || p.tp_rank != plans[0].tp_rank;
  std::vector<std::string> families;
  for (const MemoryPlan& p : plans)
    for (const auto& [f, b] : p.weights)
      if (std::find(families.begin(), families.end(), f) == families.end()) families.push_back(f);
  std::sort(families.begin(), families.end());
  bool any_reserve = false;
  for (const MemoryPlan& p : plans) any_reserve = any_reserve || p.reserve > 0;

  std::string s;
  auto out = std::back_inserter(s);
  constexpr int kLabel = 22, kCol = 16;
  fmt::format_to(out, "{:<{}}", "", kLabel);
  for (const MemoryPlan& p : plans) {
    const std::string head = mixed ? fmt::format("{}@TP{}r{}", p.ctx_size, p.tp_size, p.tp_rank)
                                   : fmt::format("ctx {}", p.ctx_size);
    fmt::format_to(out, " {:>{}}", head, kCol);
  }
  fmt::format_to(out, "\n");
  auto row = [&](const std::string& label, auto get) {
    fmt::format_to(out, "{:<{}}", label, kLabel);
    for (const MemoryPlan& p : plans) fmt::format_to(out, " {:>{}}", human(get(p)), kCol);
    fmt::format_to(out, "\n");
  };
  for (const std::string& f : families) {
    row("  " + f, [&](const MemoryPlan& p) {
      auto it = p.weights.find(f);
      return it == p.weights.end() ? uint64_t{0} : it->second;
    });
  }
  row("weights", [](const MemoryPlan& p) { return p.weight_total(); });
  row("KV cache (BF16)", [](const MemoryPlan& p) { return p.kv_cache; });
  row("indexer keys (FP32)", [](const MemoryPlan& p) { return p.indexer_cache; });
  row("GDN state (FP32)", [](const MemoryPlan& p) { return p.gdn_state; });
  row("GDN conv state (FP32)", [](const MemoryPlan& p) { return p.gdn_conv_state; });
  row("PLE conv state (FP32)", [](const MemoryPlan& p) { return p.ple_conv_state; });
  row("workspace (estimate)", [](const MemoryPlan& p) { return p.workspace; });
  if (any_reserve) row("reserve", [](const MemoryPlan& p) { return p.reserve; });
  row("total", [](const MemoryPlan& p) { return p.total(); });
  bool any_host = false;
  for (const MemoryPlan& p : plans) any_host = any_host || p.ngram_host > 0;
  if (any_host) row("n-gram table (host)", [](const MemoryPlan& p) { return p.ngram_host; });
  return s;
}

nlohmann::json memory_plan_json(const MemoryPlan& p) {
  return {{"tp_size", p.tp_size},
          {"tp_rank", p.tp_rank},
          {"ctx_size", p.ctx_size},
          {"weights", p.weights},
          {"weight_total", p.weight_total()},
          {"kv_cache", p.kv_cache},
          {"indexer_cache", p.indexer_cache},
          {"gdn_state", p.gdn_state},
          {"gdn_conv_state", p.gdn_conv_state},
          {"ple_conv_state", p.ple_conv_state},
          {"workspace_estimate", p.workspace},
          {"reserve", p.reserve},
          {"total", p.total()},
          {"ngram_host", p.ngram_host}};
}

void require_fits(const MemoryPlan& p, uint64_t free_bytes, const std::string& what) {
  if (p.total() <= free_bytes) return;
  std::string parts = fmt::format("weights {}, KV cache {}, indexer keys {}, GDN states {}",
                                  human(p.weight_total()), human(p.kv_cache),
                                  human(p.indexer_cache), human(p.gdn_state + p.gdn_conv_state));
  if (p.ple_conv_state > 0) parts += fmt::format(", PLE conv {}", human(p.ple_conv_state));
  parts += fmt::format(", workspace ~{}", human(p.workspace));
  if (p.reserve > 0) parts += fmt::format(", reserve {}", human(p.reserve));
  const auto table = p.weights.find("ple.ngram");
  const bool table_on_device = table != p.weights.end() && table->second > 0;
  FN_THROW(Usage,
           "{}: a {}-token context at TP={} needs {:.2f} GiB per GPU ({}), {:.2f} GiB free ({} "
           "short): lower -c/--ctx-size or use more GPUs (--tp){}",
           what, p.ctx_size, p.tp_size, gib(p.total()), parts, gib(free_bytes),
           human(p.total() - free_bytes),
           table_on_device ? ", or keep the n-gram table in host memory (--ngram-table host)" : "");
}

}  // namespace fn
