// cuda_model_bench: decode latency of the whole CUDA model: ms/token of the full real geometry
// with in-memory random weights (e.g. at TP=1 and TP=2 and an 8,192-token context).
// Every rank builds CudaModel::random(config) on its GPU, moves the position to --depth (caches
// hold zeros: the step reads exactly the bytes it reads at that depth), then decodes --tokens
// greedy tokens on the device (one graph replay each) after --warmup tokens, and rank 0 prints
// ms/token (mean, p50, p90, p99) next to the bytes-per-token floor of the shard plan at the
// measured 4.3 TB/s copy bandwidth. Usage:
//   mpirun -np N cuda_model_bench --config configs/qwen3.8-flash-next.json [--depth 8192]
//     [--tokens 128] [--warmup 16] [--ctx N] [--allreduce auto|custom|nccl] [--no-graph]
//     [--json FILE] [--trace FILE.csv [--trace-steps 4]]
//     (--trace: after the timed tokens, --trace-steps more with the step timeline of
//     cuda/common/step_trace.h recorded (a build with -DFN_STEP_TRACE=ON only), rank 0's records
//     written as CSV for scripts/step_timeline.py). The kernel variants are the model's own
//     plan for the device (cuda/model/kernel_plan.h), logged at debug level (FN_LOG_LEVEL=debug).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/custom_all_reduce.h"
#include "comm/device_all_reduce.h"
#include "comm/gpu_comm.h"
#include "comm/mpi_context.h"
#include "core/config.h"
#include "core/error.h"
#include "core/generate.h"
#include "core/log.h"
#include "core/shard_plan.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/step_trace.h"
#include "cuda/model/cuda_model.h"

namespace {

constexpr double kCopyBandwidth = 4.3e12;  // measured D2D copy on H200 (docs/performance.md)

// --trace: decodes `steps` more tokens with every CTA's PDL wait recorded
// (cuda/common/step_trace.h) and writes rank 0's records as CSV, times in ns from the first
// arrival.
void write_step_trace(fn::CudaModel& model, const std::string& path, int64_t steps, int rank) {
  // 256 Ki records (10 MiB) per step: a TP=1 step at the real shape has ~155 K CTAs.
  const auto capacity = static_cast<uint32_t>(steps) << 18;
  fn::StepTraceRecord* records = nullptr;
  uint32_t* count = nullptr;
  FN_CUDA_CHECK(cudaMalloc(&records, sizeof(fn::StepTraceRecord) * capacity));
  FN_CUDA_CHECK(cudaMalloc(&count, sizeof(uint32_t)));
  FN_CUDA_CHECK(cudaMemset(count, 0, sizeof(uint32_t)));
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  fn::step_trace_attach(records, count, capacity);
  fn::SamplingParams greedy;
  greedy.temperature = 0;
  model.decode(1, steps, greedy, 0, [](int32_t) { return true; });
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  fn::step_trace_attach(nullptr, nullptr, 0);
  uint32_t n = 0;
  FN_CUDA_CHECK(cudaMemcpy(&n, count, sizeof n, cudaMemcpyDeviceToHost));
  FN_REQUIRE(n <= capacity, Internal, "--trace: {} records, more than the {} the buffer holds", n,
             capacity);
  std::vector<fn::StepTraceRecord> host(n);
  FN_CUDA_CHECK(
      cudaMemcpy(host.data(), records, sizeof(fn::StepTraceRecord) * n, cudaMemcpyDeviceToHost));
  FN_CUDA_CHECK(cudaFree(records));
  FN_CUDA_CHECK(cudaFree(count));
  if (rank != 0) return;
  FN_REQUIRE(n > 0, Internal, "--trace: no record (did the kernels run through dev::pdl_wait?)");
  uint64_t t0 = host[0].t_arrive;
  for (const auto& r : host) t0 = std::min(t0, r.t_arrive);
  std::ofstream out(path);
  FN_REQUIRE(out.good(), Io, "--trace: cannot write {}", path);
  out << "grid_id,block,grid,threads,sm,arrive_ns,release_ns\n";
  for (const auto& r : host)
    out << r.grid_id << ',' << r.block << ',' << r.grid << ',' << r.threads << ',' << r.sm << ','
        << (r.t_arrive - t0) << ',' << (r.t_release - t0) << '\n';
  FN_LOG_INFO("--trace: {} records of {} steps written to {}", n, steps, path);
}

int run(int argc, char** argv, fn::MpiContext& mpi) {
  std::string config = "configs/qwen3.8-flash-next.json", json_path, allreduce = "auto";
  std::string trace_path;
  int64_t depth = 8192, tokens = 128, warmup = 16, trace_steps = 4, ctx = 0;
  bool graph = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      FN_REQUIRE(i + 1 < argc, Usage, "{} needs a value", a);
      return argv[++i];
    };
    if (a == "--config")
      config = next();
    else if (a == "--depth")
      depth = std::stoll(next());
    else if (a == "--ctx")  // context size (0: the least the run needs); it sizes some grids
      ctx = std::stoll(next());
    else if (a == "--tokens")
      tokens = std::stoll(next());
    else if (a == "--warmup")
      warmup = std::stoll(next());
    else if (a == "--allreduce")
      allreduce = next();
    else if (a == "--json")
      json_path = next();
    else if (a == "--no-graph")
      graph = false;
    else if (a == "--trace")
      trace_path = next();
    else if (a == "--trace-steps")
      trace_steps = std::stoll(next());
    else
      FN_THROW(Usage, "unknown argument {}", a);
  }
  FN_REQUIRE(trace_path.empty() || fn::step_trace_compiled(), Usage,
             "--trace needs a build configured with -DFN_STEP_TRACE=ON");
  FN_REQUIRE(trace_steps >= 1 && trace_steps <= 64, Usage, "--trace-steps must be in [1, 64]");
  const fn::ModelConfig cfg = fn::load_model_config(config);
  std::ifstream cf(config);
  const nlohmann::json cj = nlohmann::json::parse(cf);
  FN_REQUIRE(cj.contains("quantization_config"), Format,
             "{}: no quantization_config (the NVFP4 layout of the experts)", config);
  const fn::QuantConfig quant = fn::parse_quantization_config(cj["quantization_config"], config);
  const int rank = mpi.world_rank(), tp = mpi.world_size();
  fn::GpuComm gpu(mpi);
  std::unique_ptr<fn::DeviceAllReduce> ar;
  if (tp > 1)
    ar = fn::make_device_all_reduce(fn::parse_all_reduce_strategy(allreduce), gpu,
                                    fn::CustomAllReduceOptions{});
  fn::CudaModelOptions o;
  const int64_t ctx_needed = depth + warmup + tokens + (trace_path.empty() ? 0 : trace_steps) + 1;
  FN_REQUIRE(ctx == 0 || ctx >= ctx_needed, Usage, "--ctx {} is below the {} tokens the run needs",
             ctx, ctx_needed);
  o.ctx_size = ctx == 0 ? ctx_needed : ctx;
  o.use_graph = graph;
  o.tp_rank = rank;
  o.tp_size = tp;
  o.all_reduce = ar.get();
  auto model = fn::CudaModel::random(cfg, quant, 1234, o);
  size_t free_b = 0, total_b = 0;
  FN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (rank == 0)
    FN_LOG_INFO("random weights: {:.2f} GB generated in {:.1f} s; device memory used {:.1f} GiB",
                model->load_stats().bytes / 1e9, model->load_stats().seconds,
                (total_b - free_b) / 1073741824.0);
  model->set_position_for_benchmark(depth);
  fn::SamplingParams greedy;
  greedy.temperature = 0;
  using Clock = std::chrono::steady_clock;
  std::vector<double> itl;
  auto t_prev = Clock::now();
  int64_t seen = 0;
  model->decode(1, warmup + tokens, greedy, 0, [&](int32_t) {
    const auto now = Clock::now();
    if (seen++ >= warmup)
      itl.push_back(std::chrono::duration<double, std::milli>(now - t_prev).count());
    t_prev = now;
    return true;
  });
  if (!trace_path.empty()) write_step_trace(*model, trace_path, trace_steps, rank);
  const fn::LatencyStats st = fn::latency_stats(itl);
  const fn::ShardPlan plan = fn::ShardPlan::build(cfg, quant, tp);
  const double bytes = static_cast<double>(fn::bytes_per_token(plan, cfg, rank, depth + 1).total());
  const double floor_ms = bytes / kCopyBandwidth * 1e3;
  if (rank == 0) {
    std::printf(
        "| TP | graph | depth | tokens | ms/token mean | p50 | p90 | p99 | bytes/token/rank "
        "| floor ms | %% of floor |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| %d | %s | %lld | %lld | %.3f | %.3f | %.3f | %.3f | %.3f GB | %.3f | %.1f |\n",
        tp, graph ? "yes" : "no", static_cast<long long>(depth), static_cast<long long>(tokens),
        st.mean, st.p50, st.p90, st.p99, bytes / 1e9, floor_ms, 100.0 * floor_ms / st.mean);
    if (!json_path.empty()) {
      nlohmann::json j = {{"tp", tp},
                          {"graph", graph},
                          {"depth", depth},
                          {"tokens", tokens},
                          {"ms_mean", st.mean},
                          {"ms_p50", st.p50},
                          {"ms_p90", st.p90},
                          {"ms_p99", st.p99},
                          {"bytes_per_token", bytes},
                          {"floor_ms", floor_ms},
                          {"allreduce", ar ? ar->name() : "none"}};
      std::ofstream(json_path) << j.dump(2) << "\n";
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fn::MpiContext mpi(&argc, &argv);
  try {
    return run(argc, argv, mpi);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_model_bench: %s\n", e.what());
    mpi.abort_all(1);
  }
  return 1;
}
