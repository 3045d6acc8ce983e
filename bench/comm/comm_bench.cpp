// comm_bench: in-graph latency of the device all-reduces (NCCL vs the custom one-shot /
// two-shot / auto) for payloads of 1 KB .. 8 MB, BF16 and F32, with a #wrong column
// (nccl-tests style: integer-valued data, so every rank knows the exact sum in any order).
// Run on the GPU machine: mpirun -np 2 comm_bench [--json FILE] [--ops N] [--replays N].
// Each case captures N all-reduces in one CUDA graph, replays it 3 times to warm up, then
// times `replays` replays with CUDA events; us/op = time / (replays * N). Prints a table to
// stdout (rank 0) and writes the same rows as JSON.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/custom_all_reduce.h"
#include "comm/gpu_comm.h"
#include "comm/mpi_check.h"
#include "comm/mpi_context.h"
#include "core/error.h"
#include "core/log.h"
#include "cuda/common/cuda_check.h"

namespace {

struct Case {
  std::size_t bytes;
  fn::DType dtype;
  std::string method;  // nccl | custom | oneshot | twoshot
};

// Rank r's value at i: small integers, so every partial sum is exact in BF16 and F32.
float value_at(std::size_t i, int rank) {
  return static_cast<float>(static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 13) % 17) -
                            8);
}

uint16_t to_bf16(float f) {  // exact for the small integers above
  uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

std::vector<unsigned char> make_payload(std::size_t count, fn::DType dtype, int rank, int world,
                                        bool expected) {
  const std::size_t esize = dtype == fn::DType::F32 ? 4 : 2;
  std::vector<unsigned char> bytes(count * esize);
  for (std::size_t i = 0; i < count; ++i) {
    float v = 0;
    if (expected) {
      for (int r = 0; r < world; ++r) v += value_at(i, r);
    } else {
      v = value_at(i, rank);
    }
    if (esize == 4) {
      std::memcpy(&bytes[4 * i], &v, 4);
    } else {
      const uint16_t h = to_bf16(v);
      std::memcpy(&bytes[2 * i], &h, 2);
    }
  }
  return bytes;
}

int run(fn::MpiContext& mpi, int argc, char** argv) {
  std::string json_path;
  int ops = 200;
  int replays = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    FN_REQUIRE(i + 1 < argc, Usage, "comm_bench: {} needs a value", a);
    if (a == "--json") {
      json_path = argv[++i];
    } else if (a == "--ops") {
      ops = std::stoi(argv[++i]);
    } else if (a == "--replays") {
      replays = std::stoi(argv[++i]);
    } else {
      FN_THROW(Usage, "comm_bench: unknown argument {} (--json FILE --ops N --replays N)", a);
    }
  }
  fn::GpuComm gpu(mpi);
  fn::NcclAllReduce nccl(gpu);
  std::string why;
  FN_REQUIRE(gpu.custom_all_reduce_possible(&why), Usage,
             "comm_bench needs peer access between the GPUs: {}", why);
  fn::CustomAllReduce custom(gpu, fn::CustomAllReduceOptions{});
  cudaStream_t stream = nullptr;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    std::string report;
    const bool ok = custom.self_test(nccl, stream, &report);
    FN_LOG_INFO("self-test: {} ({})", ok ? "passed" : "FAILED", report);
  }

  const std::size_t sizes[] = {1024,  2048,   5120,    10240,   16384,
                               65536, 262144, 1 << 20, 2 << 20, 8 << 20};
  std::vector<Case> cases;
  for (std::size_t b : sizes) {
    for (fn::DType dt : {fn::DType::BF16, fn::DType::F32}) {
      for (const char* m : {"nccl", "custom", "oneshot", "twoshot"}) cases.push_back({b, dt, m});
    }
  }
  const std::size_t max_bytes = 8 << 20;
  void* in = nullptr;
  void* out = nullptr;
  FN_CUDA_CHECK(cudaMalloc(&in, max_bytes));
  FN_CUDA_CHECK(cudaMalloc(&out, max_bytes));
  cudaEvent_t t0, t1;
  FN_CUDA_CHECK(cudaEventCreate(&t0));
  FN_CUDA_CHECK(cudaEventCreate(&t1));

  nlohmann::json rows = nlohmann::json::array();
  const int rank = mpi.world_rank();
  const int world = mpi.world_size();
  if (rank == 0) {
    std::printf("%10s %5s %8s %10s %8s\n", "bytes", "dtype", "method", "us/op", "#wrong");
  }
  for (const Case& c : cases) {
    const std::size_t esize = c.dtype == fn::DType::F32 ? 4 : 2;
    const std::size_t count = c.bytes / esize;
    const auto payload = make_payload(count, c.dtype, rank, world, false);
    const auto expected = make_payload(count, c.dtype, rank, world, true);
    FN_CUDA_CHECK(cudaMemcpyAsync(in, payload.data(), c.bytes, cudaMemcpyHostToDevice, stream));
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    auto enqueue = [&] {
      if (c.method == "nccl") {
        nccl.all_reduce_sum(in, out, count, c.dtype, stream);
      } else {
        const fn::AllReduceAlgo algo = c.method == "oneshot"   ? fn::AllReduceAlgo::OneShot
                                       : c.method == "twoshot" ? fn::AllReduceAlgo::TwoShot
                                                               : fn::AllReduceAlgo::Auto;
        custom.all_reduce_sum(in, out, count, c.dtype, stream, algo);
      }
    };
    enqueue();  // eager warm-up (NCCL sets up its channels outside the capture)
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    FN_MPI_CHECK(MPI_Barrier(mpi.world()));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int k = 0; k < ops; ++k) enqueue();
    FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int k = 0; k < 3; ++k) FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    FN_MPI_CHECK(MPI_Barrier(mpi.world()));
    FN_CUDA_CHECK(cudaEventRecord(t0, stream));
    for (int k = 0; k < replays; ++k) FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FN_CUDA_CHECK(cudaEventRecord(t1, stream));
    FN_CUDA_CHECK(cudaEventSynchronize(t1));
    float ms = 0;
    FN_CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
    custom.check_health();
    // #wrong: poison the output, replay once more, compare with the exact sum.
    FN_CUDA_CHECK(cudaMemsetAsync(out, 0xff, c.bytes, stream));
    FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    custom.check_health();
    std::vector<unsigned char> got(c.bytes);
    FN_CUDA_CHECK(cudaMemcpy(got.data(), out, c.bytes, cudaMemcpyDeviceToHost));
    long long wrong = 0;
    for (std::size_t i = 0; i < count; ++i) {
      if (std::memcmp(&got[i * esize], &expected[i * esize], esize) != 0) ++wrong;
    }
    long long wrong_all = 0;
    FN_MPI_CHECK(MPI_Allreduce(&wrong, &wrong_all, 1, MPI_LONG_LONG, MPI_SUM, mpi.world()));
    double us_local = 1000.0 * ms / (static_cast<double>(replays) * ops);
    double us = 0;  // slowest rank
    FN_MPI_CHECK(MPI_Allreduce(&us_local, &us, 1, MPI_DOUBLE, MPI_MAX, mpi.world()));
    FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
    FN_CUDA_CHECK(cudaGraphDestroy(graph));
    std::string method = c.method;
    if (c.method == "custom") {
      method = custom.auto_algo(c.bytes) == fn::AllReduceAlgo::OneShot ? "auto(1s)" : "auto(2s)";
    }
    if (rank == 0) {
      std::printf("%10zu %5s %8s %10.2f %8lld\n", c.bytes,
                  std::string(fn::dtype_name(c.dtype)).c_str(), method.c_str(), us, wrong_all);
      std::fflush(stdout);
    }
    rows.push_back({{"bytes", c.bytes},
                    {"dtype", std::string(fn::dtype_name(c.dtype))},
                    {"method", c.method},
                    {"us_per_op", us},
                    {"wrong", wrong_all},
                    {"ops_per_graph", ops},
                    {"replays", replays}});
  }
  if (rank == 0 && !json_path.empty()) {
    cudaDeviceProp prop{};
    FN_CUDA_CHECK(cudaGetDeviceProperties(&prop, gpu.device()));
    nlohmann::json doc = {{"world", world},
                          {"gpu", prop.name},
                          {"oneshot_max_bytes", custom.options().oneshot_max_bytes},
                          {"results", rows}};
    std::ofstream f(json_path);
    FN_REQUIRE(f.good(), Io, "comm_bench: cannot write {}", json_path);
    f << doc.dump(1) << "\n";
  }
  cudaFree(in);
  cudaFree(out);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // As apps/main.cpp: on error, no MPI_Finalize (a failing rank must not wait for the others).
  std::unique_ptr<fn::MpiContext> mpi;
  try {
    mpi = std::make_unique<fn::MpiContext>(&argc, &argv);
    const int code = run(*mpi, argc, argv);
    mpi.reset();
    return code;
  } catch (const fn::Error& e) {
    FN_LOG_ERROR("{} error: {}", fn::error_kind_name(e.kind()), e.what());
    mpi.release();
    fn::MpiContext::abort_all(fn::exit_code(e.kind()));
  }
}
