// Backend selection for the model-running subcommands (`fngen generate`, `fngen eval`, `fngen
// bench`): the shared flags (--backend cpu|cuda|auto, --tp, --allreduce auto|custom|nccl,
// --no-graph, --ngram-table device|host|auto, ...) and load_backend(), which builds the CPU
// reference model or the CUDA model of this rank and hands it back as a Backend (core/backend.h;
// load_backend_random: the CUDA model on random weights, for `fngen bench --random-weights`).
// Invariants: every rank resolves `auto` to the same backend (a collective decision); no CUDA
// runtime function is called unless CUDA is asked for or `auto` probes for a device, so the cpu
// backend starts on machines without a GPU driver.
#pragma once

#include <mpi.h>
#include <CLI/CLI.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/backend.h"
#include "core/batch_engine.h"
#include "core/collectives.h"
#include "core/config.h"
#include "core/error.h"
#include "core/memory_plan.h"

namespace fn {

class MpiContext;

/// The backend flags shared by generate and eval (docs/design.md "CLI names").
struct BackendFlags {
  std::string backend = "auto";  ///< cpu | cuda | auto
  /// --tp; 0 = unset, else must equal the MPI world size (generate -i: divide it)
  int64_t tp = 0;
  std::string allreduce = "auto";  ///< cuda, TP > 1: auto | custom | nccl
  bool no_graph = false;           ///< cuda: run the decode step eagerly instead of a CUDA graph
  /// --check-choices (debug): after every step, compare a hash of the router's expert ids and
  /// the indexer's block ids across the TP ranks (core/choice_check.h); a mismatch is an error.
  bool check_choices = false;
  /// --prefill-chunk: tokens per batched prefill pass (cuda; CudaModelOptions::prefill_chunk).
  /// The cpu backend prefills token by token and ignores it.
  int64_t prefill_chunk = 8192;
  /// --ngram-table device | host | auto (cuda; CudaModelOptions::ngram_table). The cpu backend
  /// ignores it.
  std::string ngram_table = "auto";
  /// --gpu-memory-utilization (cuda; CudaModelOptions::gpu_memory_utilization): the fraction of
  /// the free device memory `--ngram-table auto` lets the model use with the table on the device.
  double gpu_memory_utilization = kDefaultGpuMemoryUtilization;
  /// --max-batch (generate -i, eval score): sequences decoded side by side, each in a slot of
  /// its own (Backend::slot_count; cuda: CudaModelOptions::slots); -1: the backend's default
  /// (kDefaultCpuSlots on cpu, 1 on cuda); 0: as many as fit (cuda; kDefaultCpuSlots on cpu).
  /// Commands that run one sequence keep 1.
  int64_t max_batch = 1;
  /// cuda's slots when max_batch is -1 (not given): 1, or 0 (as many as fit) for commands whose
  /// sequences are short and many (eval loglik).
  int64_t cuda_default_slots = 1;
  /// The --prefill-chunk option (its count() tells whether the user gave it).
  CLI::Option* o_prefill_chunk = nullptr;
};

/// The largest --max-batch.
inline constexpr int64_t kMaxBatchSlots = 1024;

/// The cpu backend's sequence slots when --max-batch is 0 or not given: its caches grow in host
/// memory with each sequence, so the count is a scheduling choice, not a memory bound.
inline constexpr int64_t kDefaultCpuSlots = 8;

/// The batching flags of the commands that run many sequences (generate -i, eval score).
struct BatchFlags {
  int64_t max_batch = -1;  ///< --max-batch: BackendFlags::max_batch (-1: not given)
  int64_t prefill_budget =
      kDefaultPrefillBudget;  ///< --prefill-budget: BatchEngineOptions::prefill_budget
  CLI::Option* o_max_batch = nullptr;
  CLI::Option* o_prefill_budget = nullptr;
};

/// Registers --max-batch (0 to kMaxBatchSlots) and --prefill-budget (>= 1) on `sub`.
void add_batch_flags(CLI::App* sub, BatchFlags& flags);

/// Registers --backend, --tp, --allreduce, --no-graph, --check-choices, --prefill-chunk,
/// --ngram-table and --gpu-memory-utilization on `sub`
/// (values checked by CLI11, so a bad value is a usage error naming the flag). `tp_use`, when not
/// empty, ends --tp's help text (after "tensor-parallel size; must equal the number of MPI ranks
/// (default: that number); ") with what the size means for this command.
void add_backend_flags(CLI::App* sub, BackendFlags& flags, std::string_view tp_use = {});

/// The random-weights alternative to -m/--model (load_backend_random) of bench, eval and
/// generate: -m/--model DIR into `model`, --random-weights, --config FILE and, where the command
/// reads text (`text_inputs` names it, e.g. "text prompts"; null: not registered), --tokenizer
/// DIR and --weights-seed S. check_model_source (apps/app_util.h) checks the combination.
struct RandomWeightsCli {
  bool random_weights = false;
  std::string config, tokenizer;
  int64_t seed = 0;  ///< --weights-seed
};
CLI::Option* add_model_source_options(CLI::App* sub, std::string& model, RandomWeightsCli& rw,
                                      const char* text_inputs);

/// The model source of a command with add_model_source_options' text flags: check_model_source,
/// --tokenizer and a non-zero --weights-seed only with --random-weights, and --tokenizer a
/// directory holding tokenizer.json or tokenizer.model. Throws fn::Error(Usage) naming the flag.
void check_model_source_options(const std::string& model, const RandomWeightsCli& rw);

/// True when this binary was built with the CUDA backend (FN_HAVE_CUDA).
bool built_with_cuda() noexcept;

/// Runs `load` (a model load or a shard plan for TP = `size`) and returns its result; its Usage
/// error about the TP split is restated as fn::Error(Usage) "DIR: the TP size is the number of
/// MPI ranks (mpirun -np N): ..." naming `dir`. Other errors pass unchanged.
template <typename F>
auto with_tp_hint(const std::filesystem::path& dir, int size, F&& load) {
  try {
    return load();
  } catch (const Error& e) {
    // Only the shard plan's TP-split errors (they name tp_size) get the hint; a load's other
    // usage errors (memory, context) pass unchanged.
    if (e.kind() != ErrorKind::Usage ||
        std::string_view(e.what()).find("tp_size") == std::string_view::npos)
      throw;
    FN_THROW(Usage, "{}: the TP size is the number of MPI ranks (mpirun -np {}): {}", dir.string(),
             size, e.what());
  }
}

/// "cpu" or "cuda": what `flags.backend` means on this machine. Collective over `coll` (every
/// rank calls it): `auto` is cuda only when the build has CUDA and every rank's cudaGetDeviceCount
/// reports at least one device, else cpu. Throws fn::Error(Usage) on every rank for --backend
/// cuda when the build has no CUDA or some rank has no usable CUDA device (naming the ranks and
/// the CUDA runtime's reason), and for a --tp that differs from the world size; every such
/// error is agreed on (agree_on_error, core/collectives.h), so rank 0 alone prints it.
std::string resolve_backend(const BackendFlags& flags, Collectives& coll);

/// Resolves the backend (resolve_backend, collective) and loads `dir` for this rank with TP =
/// world size: cpu -> CpuModel over `coll` (must outlive the result); cuda -> GpuComm (selects
/// the GPU of the node-local rank), the --allreduce all-reduce when TP > 1, and CudaModel::load
/// with `ctx_size` tokens of cache and graphs unless --no-graph. Logs one line on rank 0
/// ("<who>: backend ..., TP, all-reduce, load time, GB and GB/s"). With --check-choices the
/// backend compares a hash of every step's router and indexer choices across the ranks after each
/// forward() (core/choice_check.h; a mismatch is an error), runs its prefill token by token
/// through that forward() and has no device decode. Throws fn::Error: Usage for
/// the flags (see resolve_backend) or a TP size the model cannot split (naming mpirun -np), and
/// whatever the loaders throw (Io/Format naming the file, Cuda/Nccl for the device). A loader
/// error only some ranks hit (a region of a file that only their shard reads, one GPU's free
/// memory) is agreed on (agree_on_error): every rank throws it, "rank r: ..." on rank 0.
/// `tp_comm`: the communicator of this rank's tensor-parallel group when the world is split into
/// data-parallel groups (generate -i with --tp below the world size; `coll` then runs over that
/// group and flags.tp is the group size), MPI_COMM_NULL when the group is the world. With a
/// group, the backend is resolved over the whole world (one decision for every group, `auto`
/// included), cuda checks over the world that every rank has a GPU of its own (the node-local
/// rank picks it, as without groups; the same message when there are more ranks than GPUs), and
/// NCCL and the all-reduce run over the group. Collective over the world in that case.
std::unique_ptr<Backend> load_backend(const BackendFlags& flags, const std::filesystem::path& dir,
                                      const MpiContext& mpi, Collectives& coll, int64_t ctx_size,
                                      const char* who, MPI_Comm tp_comm = MPI_COMM_NULL);

/// The full geometry of `config_file` (a config.json such as configs/qwen3.8-flash-next.json,
/// with its quantization_config) with random weights generated on each rank's GPU
/// (CudaModel::random, deterministic in `seed`), TP = the size of `coll`, set up as
/// load_backend's cuda path (BackendInfo::random_weights set), `tp_comm` as there (data-parallel
/// groups of generate -i). For timing without a checkpoint (bench, eval, generate). Collective.
/// Throws fn::Error: Usage for a config without quantization_config, when the backend resolves
/// to cpu ("--random-weights needs the cuda backend"), for the flags (resolve_backend) or a TP
/// size the model cannot split; Io/Format for the config file (naming it and the field); Cuda
/// when the weights do not fit.
std::unique_ptr<Backend> load_backend_random(const BackendFlags& flags,
                                             const std::filesystem::path& config_file,
                                             uint64_t seed, const MpiContext& mpi,
                                             Collectives& coll, int64_t ctx_size, const char* who,
                                             MPI_Comm tp_comm = MPI_COMM_NULL);

/// The quantization description of a config.json file (its quantization_config; none = BF16).
/// Throws fn::Error: Io when unreadable, Format when not JSON or invalid (naming the file).
QuantConfig load_quant_config_file(const std::filesystem::path& config_file);

}  // namespace fn
