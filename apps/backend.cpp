#include "apps/backend.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "apps/app_util.h"
#include "apps/whole_number.h"
#include "comm/mpi_collectives.h"
#include "comm/mpi_context.h"
#include "core/choice_check.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "core/log.h"

#ifdef FN_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "comm/custom_all_reduce.h"
#include "comm/device_all_reduce.h"
#include "comm/gpu_comm.h"
#include "cuda/common/cuda_check.h"
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

// --check-choices: every forward() is followed by the cross-rank compare of the step's choices
// (`hash` reads them from the model). Device decoding is switched off, so every step goes
// through forward() and is checked; the step count restarts at reset().
void check_choices_each_step(LoadedBackend& b, Collectives& coll, std::function<uint64_t()> hash) {
  FN_LOG_INFO(
      "--check-choices: after every step the {} rank(s) compare a hash of their expert ids and "
      "indexer blocks; sampling on the host",
      coll.size());
  auto step = std::make_shared<int64_t>(0);
  b.forward = [inner = b.forward, hash = std::move(hash), &coll, step](int32_t t) {
    auto logits = inner(t);
    require_same_choices(coll, hash(), (*step)++);
    return logits;
  };
  b.reset = [inner = b.reset, step] {
    inner();
    *step = 0;
  };
  b.device_decode = nullptr;
  b.prefill = nullptr;
}

LoadedBackend load_cpu(const std::filesystem::path& dir, Collectives& coll) {
  LoadedBackend b;
  b.name = "cpu";
  b.all_reduce_name = coll.size() > 1 ? "mpi" : "";
  b.tp_size = coll.size();
  const auto t0 = std::chrono::steady_clock::now();
  // The shard load does not communicate; a rank-local failure (its slice of a file) is agreed
  // on, so rank 0 reports it.
  std::shared_ptr<CpuModel> model;
  agree_on_error(coll, [&] {
    model = with_tp_hint(dir, coll.size(), [&] { return CpuModel::load(dir, coll); });
  });
  b.load_ms = ms_since(t0);
  CpuModel* m = model.get();
  b.forward = [m](int32_t t) { return m->forward(t); };
  b.reset = [m] { m->reset(); };
  b.vocab_size = m->config().vocab_size;
  b.weight_mib = static_cast<double>(m->weight_bytes()) / (1 << 20);
  b.keep_alive = std::move(model);
  return b;
}

#ifdef FN_HAVE_CUDA
// The CUDA objects of one rank. Members are destroyed in reverse order: model, then the
// all-reduce (it uses the communicator), then the GpuComm.
struct CudaHold {
  std::unique_ptr<GpuComm> gpu;
  std::unique_ptr<DeviceAllReduce> all_reduce;
  std::unique_ptr<CudaModel> model;
};

// Sets up this rank's GPU and all-reduce, then builds the model with `make` (a load or random
// weights) and wraps it.
// `tp_comm` (not null): the group of a data-parallel split; its GPU is still the one of the
// node-local world rank (the group's ranks share one node, checked by the caller).
LoadedBackend load_cuda(
    const BackendFlags& flags, const MpiContext& mpi, Collectives& coll, int64_t ctx_size,
    const std::function<std::unique_ptr<CudaModel>(const CudaModelOptions&, int tp)>& make,
    MPI_Comm tp_comm = MPI_COMM_NULL) {
  LoadedBackend b;
  b.name = "cuda";
  auto hold = std::make_shared<CudaHold>();
  const auto t0 = std::chrono::steady_clock::now();
  if (tp_comm == MPI_COMM_NULL) {
    hold->gpu = std::make_unique<GpuComm>(mpi);
  } else {
    const GpuGroup group{tp_comm, coll.rank(), coll.size(), coll.rank(), coll.size()};
    hold->gpu = std::make_unique<GpuComm>(group, mpi.local_rank());
  }
  GpuComm& gpu = *hold->gpu;
  if (gpu.size() > 1) {
    hold->all_reduce = make_device_all_reduce(parse_all_reduce_strategy(flags.allreduce), gpu,
                                              CustomAllReduceOptions{});
    b.all_reduce_name = hold->all_reduce->name();
  }
  CudaModelOptions opt;
  opt.ctx_size = ctx_size;
  opt.use_graph = !flags.no_graph;
  opt.tp_rank = gpu.rank();
  opt.tp_size = gpu.size();
  opt.all_reduce = hold->all_reduce.get();
  opt.record_choices = flags.check_choices;
  opt.prefill_chunk = flags.prefill_chunk;
  // Building the model does not communicate; a failure on some ranks only (their shard's bytes,
  // their GPU's free memory) is agreed on, so rank 0 reports it.
  agree_on_error(coll, [&] { hold->model = make(opt, gpu.size()); });
  b.load_ms = ms_since(t0);
  CudaModel* m = hold->model.get();
  b.forward = [m](int32_t t) { return m->forward(t); };
  b.reset = [m] { m->reset(); };
  b.prefill = [m](std::span<const int32_t> tokens, bool want_logits) {
    return m->prefill(tokens, want_logits ? PrefillLogits::Last : PrefillLogits::None);
  };
  b.device_decode = [m](int32_t first, int64_t count, const SamplingParams& sp, uint64_t seed,
                        const std::function<bool(int32_t)>& on_token) {
    return m->decode(first, count, sp, seed, on_token);
  };
  b.device_used_mib = [] {
    std::size_t free_b = 0, total_b = 0;
    FN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return static_cast<double>(total_b - free_b) / (1 << 20);
  };
  b.graph_captures = [m] { return m->graph_captures(); };
  b.set_position = [m](int64_t p) { m->set_position_for_benchmark(p); };
  b.profile = [m](int32_t first, int64_t steps, bool in_graph) {
    const StepProfile p = m->profile_steps(first, steps, in_graph);
    StepBreakdown out;
    for (int f = 0; f < kStepFamilyCount; ++f) {
      out.families.emplace_back(step_family_name(static_cast<StepFamily>(f)));
      out.ms.push_back(p.ms[static_cast<std::size_t>(f)]);
      out.segments.push_back(p.segments[static_cast<std::size_t>(f)]);
    }
    out.step_ms = p.step_ms;
    out.steps = p.steps;
    out.in_graph = p.in_graph;
    out.events = p.events;
    return out;
  };
  b.vocab_size = m->config().vocab_size;
  b.tp_size = gpu.size();
  b.weight_mib = static_cast<double>(m->load_stats().weight_bytes) / (1 << 20);
  b.keep_alive = std::move(hold);
  return b;
}

// --check-choices on a model built by load_cuda (CudaModelOptions::record_choices set).
void check_cuda_choices(LoadedBackend& b, Collectives& coll) {
  const CudaModel* m = static_cast<const CudaHold*>(b.keep_alive.get())->model.get();
  check_choices_each_step(b, coll, [m] {
    const StepChoices c = m->last_choices();
    return hash_choices(c.router, c.indexer);
  });
}
#endif

}  // namespace

void add_backend_flags(CLI::App* sub, BackendFlags& flags) {
  sub->add_option("--backend", flags.backend,
                  "cpu | cuda | auto (default auto: cuda when this build has CUDA and every rank "
                  "sees a GPU, else cpu)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  add_whole_option(
      sub, "--tp", flags.tp,
      "tensor-parallel size; must equal the number of MPI ranks (default: that number); "
      "generate -i: a divisor of it, the ranks forming (ranks / --tp) data-parallel groups",
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
  add_whole_option(sub, "--prefill-chunk", flags.prefill_chunk,
                   "cuda, generate and bench: tokens per batched prefill pass; a longer prompt "
                   "runs in several passes, each continuing from the states the last one left "
                   "(the cpu backend, eval and --check-choices run the prompt token by token)",
                   WholeRange(1))
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

LoadedBackend load_backend(const BackendFlags& flags, const std::filesystem::path& dir,
                           const MpiContext& mpi, Collectives& coll, int64_t ctx_size,
                           const char* who, MPI_Comm tp_comm) {
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
  if (name == "cpu") {
    if (flags.no_graph || flags.allreduce != "auto") {
      const char* given = flags.no_graph && flags.allreduce != "auto" ? "--no-graph and --allreduce"
                          : flags.no_graph                            ? "--no-graph"
                                                                      : "--allreduce";
      FN_LOG_INFO("{}: {} {} to the cuda backend only; ignored on cpu", who, given,
                  flags.no_graph && flags.allreduce != "auto" ? "apply" : "applies");
    }
    LoadedBackend b = load_cpu(dir, coll);
    if (flags.check_choices) {
      const auto* m = static_cast<const CpuModel*>(b.keep_alive.get());
      check_choices_each_step(b, coll, [m] {
        const CpuModel::Choices& c = m->last_choices();
        return hash_choices(c.router, c.indexer);
      });
    }
    FN_LOG_INFO(
        "{}: backend cpu, TP {}, model loaded in {:.0f} ms ({:.1f} MiB of weights per rank)", who,
        b.tp_size, b.load_ms, b.weight_mib);
    return b;
  }
#ifdef FN_HAVE_CUDA
  LoadedBackend b = load_cuda(
      flags, mpi, coll, ctx_size,
      [&](const CudaModelOptions& opt, int tp) {
        return with_tp_hint(dir, tp, [&] { return CudaModel::load(dir, opt); });
      },
      tp_comm);
  const auto* hold = static_cast<const CudaHold*>(b.keep_alive.get());
  if (flags.check_choices) check_cuda_choices(b, coll);
  const CudaLoadStats& st = hold->model->load_stats();
  const double gb = static_cast<double>(st.bytes) / 1e9;
  FN_LOG_INFO(
      "{}: backend cuda, TP {}, all-reduce {}, graph {}, ctx {}: loaded {:.2f} GB in {:.2f} s "
      "({:.2f} GB/s; {:.1f} MiB weights + {:.1f} MiB state per GPU; total {:.0f} ms with setup)",
      who, b.tp_size, b.all_reduce_name.empty() ? "none" : b.all_reduce_name,
      flags.no_graph ? "off" : "on", ctx_size, gb, st.seconds,
      st.seconds > 0 ? gb / st.seconds : 0.0, static_cast<double>(st.weight_bytes) / (1 << 20),
      static_cast<double>(st.state_bytes) / (1 << 20), b.load_ms);
  return b;
#else
  (void)mpi;
  (void)ctx_size;
  (void)tp_comm;
  FN_THROW(Internal, "backend {} resolved in a build without CUDA", name);
#endif
}

QuantConfig load_quant_config_file(const std::filesystem::path& config_file) {
  std::ifstream in(config_file);
  FN_REQUIRE(in.good(), Io, "{}: cannot open the config file", config_file.string());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    FN_THROW(Format, "{}: not valid JSON: {}", config_file.string(), e.what());
  }
  FN_REQUIRE(j.is_object(), Format, "{}: the top level must be a JSON object",
             config_file.string());
  const auto it = j.find("quantization_config");
  if (it == j.end() || it->is_null()) return QuantConfig{};
  return parse_quantization_config(*it, config_file.string());
}

LoadedBackend load_backend_random(const BackendFlags& flags,
                                  const std::filesystem::path& config_file, uint64_t seed,
                                  const MpiContext& mpi, Collectives& coll, int64_t ctx_size,
                                  const char* who) {
  const ModelConfig cfg = load_model_config(config_file);
  const QuantConfig quant = load_quant_config_file(config_file);
  const std::string name = resolve_backend(flags, coll);
  agree_on_error(coll, [&] {  // every rank resolved the same backend: one message, from rank 0
    FN_REQUIRE(name == "cuda", Usage,
               "--random-weights needs the cuda backend (the weights are generated on the GPU); "
               "this run uses the cpu backend (--backend {})",
               flags.backend);
  });
#ifdef FN_HAVE_CUDA
  LoadedBackend b = load_cuda(flags, mpi, coll, ctx_size, [&](const CudaModelOptions& opt, int tp) {
    return with_tp_hint(config_file, tp, [&] { return CudaModel::random(cfg, quant, seed, opt); });
  });
  b.random_weights = true;
  const auto* hold = static_cast<const CudaHold*>(b.keep_alive.get());
  if (flags.check_choices) check_cuda_choices(b, coll);
  const CudaLoadStats& st = hold->model->load_stats();
  FN_LOG_INFO(
      "{}: backend cuda, TP {}, all-reduce {}, graph {}, ctx {}: random weights of {} (seed {}): "
      "{:.2f} GB generated in {:.2f} s ({:.1f} MiB weights + {:.1f} MiB state per GPU)",
      who, b.tp_size, b.all_reduce_name.empty() ? "none" : b.all_reduce_name,
      flags.no_graph ? "off" : "on", ctx_size, config_file.string(), seed,
      static_cast<double>(st.bytes) / 1e9, st.seconds,
      static_cast<double>(st.weight_bytes) / (1 << 20),
      static_cast<double>(st.state_bytes) / (1 << 20));
  return b;
#else
  (void)cfg;
  (void)quant;
  (void)seed;
  (void)mpi;
  (void)ctx_size;
  (void)who;
  FN_THROW(Internal, "backend {} resolved in a build without CUDA", name);
#endif
}

}  // namespace fn
