#include "apps/backend.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "apps/app_util.h"
#include "apps/real_number.h"
#include "apps/whole_number.h"
#include "comm/mpi_collectives.h"
#include "comm/mpi_context.h"
#include "core/choice_check.h"
#include "core/cpu_backend.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "core/log.h"
#include "core/paths.h"

#ifdef FN_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "comm/custom_all_reduce.h"
#include "comm/device_all_reduce.h"
#include "comm/gpu_comm.h"
#include "cuda/common/cuda_check.h"
#include "cuda/model/cuda_backend.h"
#include "cuda/model/cuda_model.h"
#endif

namespace fn {
namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// This rank's CUDA device count, or 0 with the runtime's reason in `why`. Only called when CUDA
// is asked for (or probed by auto): the first runtime call loads the driver, which may be absent.
int cuda_device_count(std::string* why) {
#ifdef FN_HAVE_CUDA
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    *why = fmt::format("cudaGetDeviceCount: {}: {}", cudaGetErrorName(rc), cudaGetErrorString(rc));
    // The runtime reports a missing driver (no libcuda.so.1) as an insufficient one.
    if (rc == cudaErrorInsufficientDriver)
      *why += "; no CUDA driver is installed, or it is too old";
    cudaGetLastError();  // clear the runtime's last error
    return 0;
  }
  if (n < 1) *why = "cudaGetDeviceCount reports 0 devices";
  return n;
#else
  *why = "this fngen was built without CUDA";
  return 0;
#endif
}

// --check-choices: a Backend whose every forward() is followed by the cross-rank compare of the
// step's choices (`hash` reads them from the wrapped model). It has no device decode and runs
// its prefill token by token through forward(), so every step is checked; the step count
// restarts at reset(). The other probes are the wrapped backend's.
class ChoiceCheckedBackend final : public Backend {
 public:
  ChoiceCheckedBackend(std::unique_ptr<Backend> inner, Collectives& coll,
                       std::function<uint64_t()> hash)
      : Backend(inner->info()), inner_(std::move(inner)), coll_(coll), hash_(std::move(hash)) {
    FN_LOG_INFO(
        "--check-choices: after every step the {} rank(s) compare a hash of their expert ids and "
        "indexer blocks; sampling on the host",
        coll_.size());
  }

  BackendCapabilities capabilities() const noexcept override {
    BackendCapabilities c = inner_->capabilities();
    c.device_decode = false;
    c.batch_sampling = false;
    return c;
  }
  void reset() override {
    inner_->reset();
    step_ = 0;
  }
  int64_t position() const noexcept override { return inner_->position(); }
  std::span<const float> forward(int32_t token) override {
    const std::span<const float> logits = inner_->forward(token);
    require_same_choices(coll_, hash_(), step_++);
    return logits;
  }
  std::span<const float> prefill(std::span<const int32_t> tokens, PrefillOutput output) override {
    FN_REQUIRE(!tokens.empty(), Usage, "prefill: the prompt has no tokens");
    std::span<const float> logits;
    for (int32_t t : tokens) logits = forward(t);
    return output == PrefillOutput::Last ? logits : std::span<const float>();
  }
  // Token by token through forward() (the base class's), so every step is checked.
  RowResults prefill_rows(std::span<const int32_t> tokens, const RowQuery& q) override {
    return Backend::prefill_rows(tokens, q);
  }
  void snapshot() override { inner_->snapshot(); }
  void restore() override { inner_->restore(); }
  int64_t slot_count() const noexcept override { return inner_->slot_count(); }
  int64_t selected_slot() const noexcept override { return inner_->selected_slot(); }
  void select_slot(int64_t slot) override { inner_->select_slot(slot); }
  double device_used_mib() const override { return inner_->device_used_mib(); }
  int64_t graph_captures() const override { return inner_->graph_captures(); }
  void set_position_for_benchmark(int64_t position) override {
    inner_->set_position_for_benchmark(position);
  }
  StepBreakdown profile_steps(int32_t first, int64_t steps, bool in_graph) override {
    return inner_->profile_steps(first, steps, in_graph);
  }

 private:
  std::unique_ptr<Backend> inner_;
  Collectives& coll_;
  std::function<uint64_t()> hash_;
  int64_t step_ = 0;
};

std::unique_ptr<CpuBackend> load_cpu(const std::filesystem::path& dir, Collectives& coll,
                                     int64_t slots) {
  const auto t0 = std::chrono::steady_clock::now();
  // The shard load does not communicate; a rank-local failure (its slice of a file) is agreed
  // on, so rank 0 reports it.
  std::unique_ptr<CpuModel> model;
  agree_on_error(coll, [&] {
    model = with_tp_hint(dir, coll.size(), [&] { return CpuModel::load(dir, coll); });
  });
  return std::make_unique<CpuBackend>(std::move(model), ms_since(t0), slots);
}

#ifdef FN_HAVE_CUDA
// Sets up this rank's GPU and all-reduce, then builds the model with `make` (a load or random
// weights) and wraps it.
// `tp_comm` (not null): the group of a data-parallel split; its GPU is still the one of the
// node-local world rank (load_backend checked over the world that every rank has its own).
std::unique_ptr<CudaBackend> load_cuda(
    const BackendFlags& flags, const MpiContext& mpi, Collectives& coll, int64_t ctx_size,
    bool random_weights,
    const std::function<std::unique_ptr<CudaModel>(const CudaModelOptions&, int tp)>& make,
    MPI_Comm tp_comm = MPI_COMM_NULL) {
  const auto t0 = std::chrono::steady_clock::now();
  auto gpu = tp_comm == MPI_COMM_NULL
                 ? std::make_unique<GpuComm>(mpi)
                 : std::make_unique<GpuComm>(
                       GpuGroup{tp_comm, coll.rank(), coll.size(), coll.rank(), coll.size()},
                       mpi.local_rank());
  std::unique_ptr<DeviceAllReduce> all_reduce;
  if (gpu->size() > 1) {
    all_reduce = make_device_all_reduce(parse_all_reduce_strategy(flags.allreduce), *gpu,
                                        CustomAllReduceOptions{});
  }
  CudaModelOptions opt;
  opt.ctx_size = ctx_size;
  opt.use_graph = !flags.no_graph;
  opt.tp_rank = gpu->rank();
  opt.tp_size = gpu->size();
  opt.all_reduce = all_reduce.get();
  opt.record_choices = flags.check_choices;
  opt.prefill_chunk = flags.prefill_chunk;
  opt.ngram_table = parse_ngram_table(flags.ngram_table);
  opt.gpu_memory_utilization = flags.gpu_memory_utilization;
  opt.slots =
      flags.max_batch < 0 ? flags.cuda_default_slots : flags.max_batch;  // 0: as many as fit
  // Building the model does not communicate; a failure on some ranks only (their shard's bytes,
  // their GPU's free memory) is agreed on, so rank 0 reports it.
  std::unique_ptr<CudaModel> model;
  agree_on_error(coll, [&] { model = make(opt, opt.tp_size); });
  if (opt.slots == 0 && coll.size() > 1) {
    // As many slots as fit is each GPU's own count: the ranks run the same sequences, so the
    // group uses the fewest any rank fit (whole numbers below 2^24 are exact in a float).
    const auto mine = static_cast<float>(model->slot_count());
    std::vector<float> all(static_cast<std::size_t>(coll.size()));
    coll.all_gather(&mine, 1, all.data());
    const auto fewest = static_cast<int64_t>(*std::min_element(all.begin(), all.end()));
    if (fewest < model->slot_count()) {
      if (coll.rank() == 0)
        FN_LOG_INFO("cuda: {} sequence slots on every rank (the fewest a rank's GPU fits)", fewest);
      model->limit_slots(fewest);
    }
  }
  const int tp = gpu->size();
  return std::make_unique<CudaBackend>(std::move(gpu), std::move(all_reduce), std::move(model), tp,
                                       ms_since(t0), random_weights);
}

// " + X MiB n-gram table in pinned host memory" when the table is host-resident, else "".
std::string host_table_note(const CudaLoadStats& st) {
  if (st.ngram_host_bytes == 0) return {};
  return fmt::format(" + {:.1f} MiB n-gram table in pinned host memory",
                     static_cast<double>(st.ngram_host_bytes) / (1 << 20));
}

// --check-choices on a model built by load_cuda (CudaModelOptions::record_choices set).
std::unique_ptr<Backend> check_cuda_choices(std::unique_ptr<CudaBackend> b, Collectives& coll) {
  const CudaModel* m = &b->model();
  return std::make_unique<ChoiceCheckedBackend>(std::move(b), coll, [m] {
    const StepChoices c = m->last_choices();
    return hash_choices(c.router, c.indexer);
  });
}
#endif

}  // namespace

void add_batch_flags(CLI::App* sub, BatchFlags& flags) {
  flags.o_max_batch = add_whole_option(
      sub, "--max-batch", flags.max_batch,
      fmt::format("records decoded side by side, each in a sequence slot of its own (continuous "
                  "batching: a record enters as soon as a slot frees); default: {} on cpu, 1 on "
                  "cuda; 0: as many as fit the GPU's free memory (cuda)",
                  kDefaultCpuSlots),
      WholeRange(0, kMaxBatchSlots));
  flags.o_prefill_budget = add_whole_option(
      sub, "--prefill-budget", flags.prefill_budget,
      "prompt tokens prefilled between two decode steps of the running records (a longer prompt "
      "enters in chunks; default 2048)",
      WholeRange(1, kMaxTokenCount));
}

CLI::Option* add_model_source_options(CLI::App* sub, std::string& model, RandomWeightsCli& rw,
                                      const char* text_inputs) {
  CLI::Option* m =
      sub->add_option("-m,--model", model, "model directory (or --random-weights --config FILE)");
  sub->add_flag("--random-weights", rw.random_weights,
                "cuda: the full geometry of --config with random weights generated on the GPU "
                "(no checkpoint, for timing; routing close to uniform)");
  sub->add_option("--config", rw.config,
                  "with --random-weights: a config.json with its quantization_config (e.g. "
                  "configs/qwen3.8-flash-next.json)");
  if (text_inputs == nullptr) return m;
  sub->add_option("--tokenizer", rw.tokenizer,
                  fmt::format("with --random-weights: the directory of tokenizer.json for {} (e.g. "
                              "third_party/qwen3-tokenizer); without it they must be token ids",
                              text_inputs));
  add_whole_option(sub, "--weights-seed", rw.seed,
                   "with --random-weights: the seed of the random weights (default 0)",
                   WholeRange(0));
  return m;
}

void check_model_source_options(const std::string& model, const RandomWeightsCli& rw) {
  check_model_source(model, rw.random_weights, rw.config);
  FN_REQUIRE(rw.tokenizer.empty() || rw.random_weights, Usage,
             "--tokenizer applies to --random-weights only (-m/--model reads DIR's tokenizer)");
  FN_REQUIRE(rw.seed == 0 || rw.random_weights, Usage,
             "--weights-seed applies to --random-weights only (-m/--model reads DIR's weights)");
  if (rw.tokenizer.empty()) return;
  std::error_code ec;
  FN_REQUIRE(std::filesystem::is_directory(rw.tokenizer, ec) && has_tokenizer(rw.tokenizer), Usage,
             "--tokenizer {}: no directory holding tokenizer.json or tokenizer.model (e.g. "
             "third_party/qwen3-tokenizer)",
             rw.tokenizer);
}

void add_backend_flags(CLI::App* sub, BackendFlags& flags, std::string_view tp_use) {
  sub->add_option("--backend", flags.backend,
                  "cpu | cuda | auto (default auto: cuda when this build has CUDA and every rank "
                  "sees a GPU, else cpu)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  add_whole_option(sub, "--tp", flags.tp,
                   fmt::format("tensor-parallel size; must equal the number of MPI ranks "
                               "(default: that number){}{}",
                               tp_use.empty() ? "" : "; ", tp_use),
                   WholeRange(1, std::numeric_limits<int>::max()));
  sub->add_option("--allreduce", flags.allreduce,
                  "cuda, TP > 1: auto | custom | nccl (default auto: the IPC custom all-reduce "
                  "where peer access allows, else NCCL)")
      ->check(CLI::IsMember({"auto", "custom", "nccl"}));
  sub->add_flag("--no-graph", flags.no_graph,
                "cuda: run each decode step eagerly instead of replaying a CUDA graph");
  sub->add_flag("--check-choices", flags.check_choices,
                "debug: after every step, check that all TP ranks chose the same experts and "
                "indexer blocks (a hash compared across ranks); samples on the host");
  flags.o_prefill_chunk =
      add_whole_option(sub, "--prefill-chunk", flags.prefill_chunk,
                       "cuda: tokens per batched prefill pass (prompts, eval's sequences, batched "
                       "steps); a longer prompt runs in several passes, each continuing from the "
                       "states the last one left (the cpu backend runs the prompt token by token)",
                       WholeRange(1))
          ->capture_default_str();
  sub->add_option("--ngram-table", flags.ngram_table,
                  "cuda: where the PLE n-gram table lives: device | host (pinned host memory "
                  "that the GPU reads over PCIe / C2C inside the decode graph, freeing its bytes "
                  "of device memory) | auto (default: host when the weights, the table and the "
                  "context exceed --gpu-memory-utilization of the free device memory, else "
                  "device); the same logits either way; the cpu backend ignores it")
      ->check(CLI::IsMember({"device", "host", "auto"}));
  add_real_option(sub, "--gpu-memory-utilization", flags.gpu_memory_utilization,
                  "cuda, --ngram-table auto: the fraction of the GPU's free memory at load the "
                  "model may fill with the table on the device, in (0, 1]; the rest is headroom "
                  "for the CUDA context, cuBLAS, NCCL, graphs and prefill buffers")
      ->capture_default_str();
}

bool built_with_cuda() noexcept {
#ifdef FN_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

namespace {
// resolve_backend's checks: the same on every rank up to its one collective (the device count).
std::string resolve_backend_checks(const BackendFlags& flags, Collectives& coll) {
  check_backend_and_tp(flags.backend, flags.tp, coll.size());
  FN_REQUIRE(flags.prefill_chunk >= 1, Usage, "--prefill-chunk must be >= 1 token, got {}",
             flags.prefill_chunk);
  FN_REQUIRE(flags.gpu_memory_utilization > 0.0 && flags.gpu_memory_utilization <= 1.0, Usage,
             "--gpu-memory-utilization must be in (0, 1], got {}", flags.gpu_memory_utilization);
  (void)parse_ngram_table(flags.ngram_table);
  if (flags.backend == "cpu") return "cpu";
  FN_REQUIRE(flags.backend != "cuda" || built_with_cuda(), Usage,
             "--backend cuda: the CUDA backend is not available: this fngen was built without "
             "CUDA (no nvcc at configure time, or -DFN_ENABLE_CUDA=OFF); use --backend cpu");
  if (!built_with_cuda()) return "cpu";  // auto
  // Collective: every rank counts its devices; the sum of "has none" decides for all alike.
  std::string why;
  const bool has_device = cuda_device_count(&why) >= 1;
  std::vector<float> lacking(static_cast<std::size_t>(coll.size()), 0.0F);
  lacking[static_cast<std::size_t>(coll.rank())] = has_device ? 0.0F : 1.0F;
  coll.all_reduce_sum(lacking.data(), lacking.size());
  std::string ranks;
  for (std::size_t r = 0; r < lacking.size(); ++r) {
    if (lacking[r] > 0.5F) ranks += fmt::format("{}{}", ranks.empty() ? "" : ", ", r);
  }
  if (ranks.empty()) return "cuda";
  if (flags.backend == "auto") {
    FN_LOG_INFO("--backend auto: no usable CUDA device on rank(s) {} ({}): using the cpu backend",
                ranks, has_device ? "see that rank" : why);
    return "cpu";
  }
  FN_THROW(Usage,
           "--backend cuda: the CUDA backend is not available: no usable CUDA device on rank(s) {} "
           "({}); run on a GPU machine, or use --backend cpu",
           ranks, has_device ? "reported by that rank" : why);
}
}  // namespace

std::string resolve_backend(const BackendFlags& flags, Collectives& coll) {
  std::string name;
  agree_on_error(coll, [&] { name = resolve_backend_checks(flags, coll); });
  return name;
}

namespace {

// The backend every rank of a load runs (resolve_backend): over `coll`, or with data-parallel
// groups (tp_comm set) over the world, where cuda also needs a GPU of every rank's own.
std::string resolve_load_backend(const BackendFlags& flags, const MpiContext& mpi,
                                 Collectives& coll, MPI_Comm tp_comm) {
  std::string name;
  if (tp_comm == MPI_COMM_NULL) {
    name = resolve_backend(flags, coll);
  } else {
    // Data-parallel groups: one decision over the world; the group size was checked by the
    // caller (check_batch_tp), so the world check sees no --tp.
    MpiCollectives world(mpi.world());
    BackendFlags world_flags = flags;
    world_flags.tp = 0;
    name = resolve_backend(world_flags, world);
    // Every rank needs a GPU of its own (the node-local rank picks it): refused over the world,
    // by the rank that lacks one, before a group builds its communicator.
    if (name == "cuda") {
      agree_on_error(world, [&] {
        std::string why;
        const int count = cuda_device_count(&why);
        const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
        FN_REQUIRE(mpi.local_rank() < count, Cuda,
                   "rank {} (node-local rank {} of {}) needs GPU {} but only {} GPU(s) are "
                   "visible (CUDA_VISIBLE_DEVICES={}): run at most one rank per GPU",
                   mpi.world_rank(), mpi.local_rank(), mpi.local_size(), mpi.local_rank(), count,
                   visible ? visible : "unset");
      });
    }
  }
  return name;
}

}  // namespace

std::unique_ptr<Backend> load_backend(const BackendFlags& flags, const std::filesystem::path& dir,
                                      const MpiContext& mpi, Collectives& coll, int64_t ctx_size,
                                      const char* who, MPI_Comm tp_comm) {
  const std::string name = resolve_load_backend(flags, mpi, coll, tp_comm);
  if (name == "cpu") {
    if (flags.ngram_table != "auto")
      FN_LOG_INFO("{}: --ngram-table applies to the cuda backend only; ignored on cpu", who);
    if (flags.no_graph || flags.allreduce != "auto") {
      const char* given = flags.no_graph && flags.allreduce != "auto" ? "--no-graph and --allreduce"
                          : flags.no_graph                            ? "--no-graph"
                                                                      : "--allreduce";
      FN_LOG_INFO("{}: {} {} to the cuda backend only; ignored on cpu", who, given,
                  flags.no_graph && flags.allreduce != "auto" ? "apply" : "applies");
    }
    const int64_t slots = flags.max_batch > 0 ? flags.max_batch : kDefaultCpuSlots;
    std::unique_ptr<CpuBackend> cpu = load_cpu(dir, coll, slots);
    const BackendInfo info = cpu->info();
    std::unique_ptr<Backend> b = std::move(cpu);
    if (flags.check_choices) {
      const CpuModel* m = &static_cast<const CpuBackend&>(*b).model();
      b = std::make_unique<ChoiceCheckedBackend>(std::move(b), coll, [m] {
        const CpuModel::Choices& c = m->last_choices();
        return hash_choices(c.router, c.indexer);
      });
    }
    FN_LOG_INFO(
        "{}: backend cpu, TP {}, model loaded in {:.0f} ms ({:.1f} MiB of weights per rank){}", who,
        info.tp_size, info.load_ms, info.weight_mib,
        slots > 1 ? fmt::format(", {} sequence slots", slots) : std::string());
    return b;
  }
#ifdef FN_HAVE_CUDA
  std::unique_ptr<CudaBackend> cuda = load_cuda(
      flags, mpi, coll, ctx_size, false,
      [&](const CudaModelOptions& opt, int tp) {
        return with_tp_hint(dir, tp, [&] { return CudaModel::load(dir, opt); });
      },
      tp_comm);
  const BackendInfo info = cuda->info();
  const CudaLoadStats st = cuda->model().load_stats();
  std::unique_ptr<Backend> b =
      flags.check_choices ? check_cuda_choices(std::move(cuda), coll) : std::move(cuda);
  const double gb = static_cast<double>(st.bytes) / 1e9;
  FN_LOG_INFO(
      "{}: backend cuda, TP {}, all-reduce {}, graph {}, ctx {}: loaded {:.2f} GB in {:.2f} s "
      "({:.2f} GB/s; {:.1f} MiB weights + {:.1f} MiB state per GPU{}; total {:.0f} ms with "
      "setup)",
      who, info.tp_size, info.all_reduce_name.empty() ? "none" : info.all_reduce_name,
      flags.no_graph ? "off" : "on", ctx_size, gb, st.seconds,
      st.seconds > 0 ? gb / st.seconds : 0.0, static_cast<double>(st.weight_bytes) / (1 << 20),
      static_cast<double>(st.state_bytes) / (1 << 20), host_table_note(st), info.load_ms);
  return b;
#else
  (void)mpi;
  (void)ctx_size;
  (void)tp_comm;
  FN_THROW(Internal, "backend {} resolved in a build without CUDA", name);
#endif
}

QuantConfig load_quant_config_file(const std::filesystem::path& config_file) {
  const std::string text = read_regular_file(config_file, kMaxCheckpointJsonBytes, "");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    FN_THROW(Format, "{}: not valid JSON: {}", config_file.string(), e.what());
  }
  FN_REQUIRE(j.is_object(), Format, "{}: the top level must be a JSON object",
             config_file.string());
  const auto it = j.find("quantization_config");
  if (it == j.end() || it->is_null()) return QuantConfig{};
  return parse_quantization_config(*it, config_file.string());
}

std::unique_ptr<Backend> load_backend_random(const BackendFlags& flags,
                                             const std::filesystem::path& config_file,
                                             uint64_t seed, const MpiContext& mpi,
                                             Collectives& coll, int64_t ctx_size, const char* who,
                                             MPI_Comm tp_comm) {
  const ModelConfig cfg = load_model_config(config_file);
  const QuantConfig quant = load_quant_config_file(config_file);
  FN_REQUIRE(quant.quantized(), Usage,
             "--config {} has no quantization_config: --random-weights builds the NVFP4 layout it "
             "describes (e.g. configs/qwen3.8-flash-next.json)",
             config_file.string());
  const std::string name = resolve_load_backend(flags, mpi, coll, tp_comm);
  agree_on_error(coll, [&] {  // every rank resolved the same backend: one message, from rank 0
    FN_REQUIRE(name == "cuda", Usage,
               "--random-weights needs the cuda backend (the weights are generated on the GPU); "
               "this run uses the cpu backend (--backend {})",
               flags.backend);
  });
#ifdef FN_HAVE_CUDA
  std::unique_ptr<CudaBackend> cuda = load_cuda(
      flags, mpi, coll, ctx_size, true,
      [&](const CudaModelOptions& opt, int tp) {
        return with_tp_hint(config_file, tp,
                            [&] { return CudaModel::random(cfg, quant, seed, opt); });
      },
      tp_comm);
  const BackendInfo info = cuda->info();
  const CudaLoadStats st = cuda->model().load_stats();
  std::unique_ptr<Backend> b =
      flags.check_choices ? check_cuda_choices(std::move(cuda), coll) : std::move(cuda);
  FN_LOG_INFO(
      "{}: backend cuda, TP {}, all-reduce {}, graph {}, ctx {}: random weights of {} (seed {}): "
      "{:.2f} GB generated in {:.2f} s ({:.1f} MiB weights + {:.1f} MiB state per GPU{})",
      who, info.tp_size, info.all_reduce_name.empty() ? "none" : info.all_reduce_name,
      flags.no_graph ? "off" : "on", ctx_size, config_file.string(), seed,
      static_cast<double>(st.bytes) / 1e9, st.seconds,
      static_cast<double>(st.weight_bytes) / (1 << 20),
      static_cast<double>(st.state_bytes) / (1 << 20), host_table_note(st));
  return b;
#else
  (void)cfg;
  (void)quant;
  (void)seed;
  (void)mpi;
  (void)ctx_size;
  (void)who;
  (void)tp_comm;
  FN_THROW(Internal, "backend {} resolved in a build without CUDA", name);
#endif
}

}  // namespace fn
