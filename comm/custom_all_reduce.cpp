#include "comm/custom_all_reduce.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "comm/gpu_comm.h"
#include "comm/mpi_check.h"
#include "comm/nccl_check.h"
#include "core/log.h"
#include "cuda/common/cuda_check.h"

namespace fn {

namespace {

constexpr int64_t kDefaultTimeoutMs = 5000;  // a stuck peer is reported within ~6 s
constexpr int kOneshotBlocksCap = 128;       // LL: one packet per thread up to 32K packets
constexpr int kTwoshotBlocksCap = 32;        // vLLM found ~36 CTAs enough to fill NVLink

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  FN_REQUIRE(end != nullptr && *end == '\0' && x > 0, Usage,
             "environment variable {}={} is not a positive integer", name, v);
  return x;
}

std::size_t element_size(DType dtype) {
  FN_CHECK(dtype == DType::F32 || dtype == DType::BF16,
           "all-reduce supports F32 and BF16 payloads, not {}", dtype_name(dtype));
  return dtype == DType::F32 ? 4 : 2;
}

}  // namespace

CustomAllReduce::CustomAllReduce(GpuComm& gpu, const CustomAllReduceOptions& options)
    : gpu_(gpu), options_(options) {
  const int world = gpu.size();
  const int rank = gpu.rank();
  FN_REQUIRE(world <= detail::kArMaxRanks, Usage,
             "the custom all-reduce serves at most {} ranks on one node, not {} (use "
             "--allreduce nccl)",
             detail::kArMaxRanks, world);
  options_.oneshot_max_bytes = static_cast<std::size_t>(
      env_int("FN_ALLREDUCE_ONESHOT_MAX_BYTES", static_cast<int64_t>(options_.oneshot_max_bytes)));
  FN_REQUIRE(options_.oneshot_max_bytes >= 16 && options_.twoshot_max_bytes >= 16, Usage,
             "custom all-reduce buffer sizes must be at least 16 bytes");
  timeout_ms_ = options_.timeout_ms > 0 ? options_.timeout_ms
                                        : env_int("FN_ALLREDUCE_TIMEOUT_MS", kDefaultTimeoutMs);
  timeout_ns_ = static_cast<uint64_t>(timeout_ms_) * 1000000ull;

  // Every rank must size buffers and grids alike: compare the knobs and take the smallest SM
  // count (a grid never exceeds what every GPU can hold at once).
  cudaDeviceProp prop{};
  FN_CUDA_CHECK(cudaGetDeviceProperties(&prop, gpu.device()));
  uint64_t mine[5] = {options_.oneshot_max_bytes, options_.twoshot_max_bytes,
                      options_.initial_epoch, static_cast<uint64_t>(timeout_ms_),
                      static_cast<uint64_t>(prop.multiProcessorCount)};
  uint64_t lo[5], hi[5];
  FN_MPI_CHECK(MPI_Allreduce(mine, lo, 5, MPI_UINT64_T, MPI_MIN, gpu.mpi_comm()));
  FN_MPI_CHECK(MPI_Allreduce(mine, hi, 5, MPI_UINT64_T, MPI_MAX, gpu.mpi_comm()));
  FN_REQUIRE(std::equal(lo, lo + 4, hi), Usage,
             "custom all-reduce options differ between ranks (one-shot max, two-shot max, "
             "initial epoch, timeout): check FN_ALLREDUCE_* environment variables on rank {}",
             rank);
  const int sm_min = static_cast<int>(lo[4]);
  oneshot_blocks_max_ = std::max(1, std::min(kOneshotBlocksCap, sm_min));
  twoshot_blocks_max_ = std::max(1, std::min({kTwoshotBlocksCap, detail::kArMaxBlocks, sm_min}));

  // Allocate and initialise the region, then exchange handles (never reset after the exchange:
  // a fast peer may already have written; TVM PR #16797).
  layout_ = detail::make_ar_layout(world, options_.oneshot_max_bytes, options_.twoshot_max_bytes);
  FN_CUDA_CHECK(cudaMalloc(&region_, layout_.total_bytes));
  FN_CUDA_CHECK(cudaMalloc(&state_, sizeof(detail::ArState)));
  const detail::ArState init{options_.initial_epoch, 0, 0, 0};
  FN_CUDA_CHECK(cudaMemcpy(state_, &init, sizeof(init), cudaMemcpyHostToDevice));
  FN_CUDA_CHECK(cudaHostAlloc(&error_host_, sizeof(detail::ArError), cudaHostAllocMapped));
  std::memset(error_host_, 0, sizeof(detail::ArError));
  FN_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev_), error_host_, 0));
  detail::launch_ar_init(region_, layout_, world, options_.initial_epoch, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());

  cudaIpcMemHandle_t handle{};
  FN_CUDA_CHECK(cudaIpcGetMemHandle(&handle, region_));
  std::vector<cudaIpcMemHandle_t> handles(static_cast<std::size_t>(world));
  FN_MPI_CHECK(MPI_Allgather(&handle, sizeof(handle), MPI_BYTE, handles.data(), sizeof(handle),
                             MPI_BYTE, gpu.mpi_comm()));
  peers_.assign(static_cast<std::size_t>(world), nullptr);
  for (int r = 0; r < world; ++r) {
    if (r == rank) {
      peers_[r] = region_;
      continue;
    }
    void* ptr = nullptr;
    FN_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handles[r], cudaIpcMemLazyEnablePeerAccess));
    peers_[r] = static_cast<char*>(ptr);
  }
  FN_MPI_CHECK(MPI_Barrier(gpu.mpi_comm()));
  FN_LOG_DEBUG(
      "custom all-reduce: {} ranks, region {} MiB, one-shot <= {} B ({} CTAs max), "
      "two-shot launches <= {} B ({} CTAs max), timeout {} ms",
      world, layout_.total_bytes >> 20, options_.oneshot_max_bytes, oneshot_blocks_max_,
      options_.twoshot_max_bytes, twoshot_blocks_max_, timeout_ms_);
}

CustomAllReduce::~CustomAllReduce() {
  // cudaFree waits for the device; peers' pushes into our region ended before our last call
  // completed (we consumed them), so no MPI barrier is needed (none may run during unwinding).
  for (std::size_t r = 0; r < peers_.size(); ++r) {
    if (peers_[r] != nullptr && peers_[r] != region_) cudaIpcCloseMemHandle(peers_[r]);
  }
  if (region_ != nullptr) cudaFree(region_);
  if (state_ != nullptr) cudaFree(state_);
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
}

AllReduceAlgo CustomAllReduce::auto_algo(std::size_t bytes) const noexcept {
  return bytes <= options_.oneshot_max_bytes ? AllReduceAlgo::OneShot : AllReduceAlgo::TwoShot;
}

void CustomAllReduce::all_reduce_sum(const void* in, void* out, std::size_t count, DType dtype,
                                     cudaStream_t stream) {
  all_reduce_sum(in, out, count, dtype, stream, AllReduceAlgo::Auto);
}

void CustomAllReduce::all_reduce_sum(const void* in, void* out, std::size_t count, DType dtype,
                                     cudaStream_t stream, AllReduceAlgo algo) {
  const std::size_t esize = element_size(dtype);
  FN_CHECK(reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0,
           "custom all-reduce needs 16-byte aligned buffers (in {}, out {})", in, out);
  // One stream per communicator: two streams in flight deadlock the protocol (SGLang #31117).
  if (!stream_bound_) {
    stream_ = stream;
    stream_bound_ = true;
  }
  FN_CHECK(stream == stream_,
           "custom all-reduce: one instance serves one stream (first used {}, now {})",
           static_cast<void*>(stream_), static_cast<void*>(stream));
  if (count == 0) return;
  if (algo == AllReduceAlgo::Auto) algo = auto_algo(count * esize);
  const std::size_t max_bytes =
      algo == AllReduceAlgo::OneShot ? options_.oneshot_max_bytes : options_.twoshot_max_bytes;
  // Chunks are whole 16-byte vectors so that every chunk start stays 16-byte aligned.
  const std::size_t chunk = std::max<std::size_t>(16, max_bytes / 16 * 16) / esize;
  const auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  for (std::size_t off = 0; off < count; off += chunk) {
    const std::size_t n = std::min(chunk, count - off);
    launch(src + off * esize, dst + off * esize, n, dtype == DType::BF16, stream, algo);
  }
}

void CustomAllReduce::launch(const void* in, void* out, std::size_t count, bool bf16,
                             cudaStream_t stream, AllReduceAlgo algo) {
  detail::ArParams p;
  p.in = in;
  p.out = out;
  p.count = count;
  p.rank = gpu_.rank();
  p.world = gpu_.size();
  for (int r = 0; r < p.world; ++r) p.bases[r] = peers_[r];
  p.layout = layout_;
  p.state = state_;
  p.error = error_dev_;
  p.timeout_ns = timeout_ns_;
  const std::size_t bytes = count * (bf16 ? 2 : 4);
  if (algo == AllReduceAlgo::OneShot) {
    const std::size_t packets = (bytes + 7) / 8;
    const std::size_t threads = static_cast<std::size_t>(detail::ar_oneshot_threads());
    p.blocks = static_cast<int>(
        std::min<std::size_t>(oneshot_blocks_max_, (packets + threads - 1) / threads));
    detail::launch_ar_oneshot(p, bf16, stream);
  } else {
    // Enough CTAs that each thread moves ~4 vectors of its shard, at most twoshot_blocks_max_.
    const std::size_t shard_vectors = ((bytes + 15) / 16 + p.world - 1) / p.world;
    const std::size_t per_cta = static_cast<std::size_t>(detail::ar_twoshot_threads()) * 4;
    p.blocks = static_cast<int>(
        std::clamp<std::size_t>((shard_vectors + per_cta - 1) / per_cta, 1, twoshot_blocks_max_));
    detail::launch_ar_twoshot(p, bf16, stream);
  }
}

bool CustomAllReduce::failed() const noexcept {
  return reinterpret_cast<volatile detail::ArError*>(error_host_)->code != 0;
}

void CustomAllReduce::check_health() {
  if (!failed()) return;
  detail::ArError copy{};
  std::memcpy(&copy, const_cast<const detail::ArError*>(error_host_), sizeof(copy));
  const detail::ArError* err = &copy;
  static const char* const kPhase[] = {"one-shot", "two-shot reduce-scatter",
                                       "two-shot all-gather"};
  FN_THROW(Mpi,
           "custom all-reduce: rank {} waited more than {} ms for rank {} ({} phase, epoch {}, "
           "CTA {}): the peer rank died or stopped calling the all-reduce (timeout: "
           "FN_ALLREDUCE_TIMEOUT_MS)",
           gpu_.rank(), timeout_ms_, err->peer, kPhase[std::min<uint32_t>(err->phase, 2)],
           err->epoch, err->block);
}

bool CustomAllReduce::self_test(DeviceAllReduce& reference, cudaStream_t stream,
                                std::string* report) {
  const int rank = gpu_.rank();
  // The test runs on its own stream and ends synchronised, so the stream binding is restored.
  const bool was_bound = stream_bound_;
  const cudaStream_t was_stream = stream_;
  stream_bound_ = false;
  // Sizes: tiny, ragged, the decode payload (2560), and both sides of the one-shot limit.
  const std::size_t big = options_.oneshot_max_bytes / 4 + 37;  // two-shot for F32 under Auto
  const std::size_t counts[] = {1, 3, 2560, 4099, big};
  std::size_t max_count = 0;
  for (std::size_t c : counts) max_count = std::max(max_count, c);
  void* in = nullptr;
  void* out_custom = nullptr;
  void* out_ref = nullptr;
  FN_CUDA_CHECK(cudaMalloc(&in, max_count * 4));
  FN_CUDA_CHECK(cudaMalloc(&out_custom, max_count * 4));
  FN_CUDA_CHECK(cudaMalloc(&out_ref, max_count * 4));
  std::string problem;
  std::vector<uint32_t> host_in(max_count), host_a(max_count), host_b(max_count);
  for (DType dtype : {DType::F32, DType::BF16}) {
    const std::size_t esize = dtype == DType::F32 ? 4 : 2;
    for (std::size_t count : counts) {
      // Small integers: every partial sum is exact in BF16 and F32, so any order agrees.
      auto* bytes = reinterpret_cast<unsigned char*>(host_in.data());
      for (std::size_t i = 0; i < count; ++i) {
        const float v = static_cast<float>(static_cast<int>((i * 7 + rank * 13) % 17) - 8);
        uint32_t u = 0;
        std::memcpy(&u, &v, 4);
        if (esize == 4) {
          std::memcpy(bytes + 4 * i, &u, 4);
        } else {
          const uint16_t h = static_cast<uint16_t>(u >> 16);  // exact: small integer
          std::memcpy(bytes + 2 * i, &h, 2);
        }
      }
      // Stream-ordered copies: a pageable cudaMemcpy or a cudaMemset on the legacy stream may
      // still be in flight when work on a non-blocking stream starts.
      FN_CUDA_CHECK(
          cudaMemcpyAsync(in, host_in.data(), count * esize, cudaMemcpyHostToDevice, stream));
      FN_CUDA_CHECK(cudaMemsetAsync(out_custom, 0xff, count * esize, stream));
      FN_CUDA_CHECK(cudaMemsetAsync(out_ref, 0xee, count * esize, stream));
      all_reduce_sum(in, out_custom, count, dtype, stream);
      reference.all_reduce_sum(in, out_ref, count, dtype, stream);
      FN_CUDA_CHECK(cudaMemcpyAsync(host_a.data(), out_custom, count * esize,
                                    cudaMemcpyDeviceToHost, stream));
      FN_CUDA_CHECK(
          cudaMemcpyAsync(host_b.data(), out_ref, count * esize, cudaMemcpyDeviceToHost, stream));
      FN_CUDA_CHECK(cudaStreamSynchronize(stream));
      // Every rank runs every case whatever it saw (leaving early on one rank would leave the
      // others waiting in NCCL); the first problem is kept.
      if (!problem.empty()) continue;
      if (failed()) {
        problem =
            fmt::format("rank {}: a wait timed out ({} x {})", rank, count, dtype_name(dtype));
        continue;
      }
      if (options_.corrupt_self_test && rank == 0) host_a[0] ^= 1u;
      if (std::memcmp(host_a.data(), host_b.data(), count * esize) != 0) {
        std::size_t bad = 0;
        const auto* a = reinterpret_cast<const unsigned char*>(host_a.data());
        const auto* b = reinterpret_cast<const unsigned char*>(host_b.data());
        while (bad < count * esize && a[bad] == b[bad]) ++bad;
        problem = fmt::format("rank {}: {} x {} differs from NCCL at element {}", rank, count,
                              dtype_name(dtype), bad / esize);
      }
    }
  }
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));
  stream_bound_ = was_bound;
  stream_ = was_stream;
  cudaFree(in);
  cudaFree(out_custom);
  cudaFree(out_ref);
  int ok = problem.empty() ? 1 : 0;
  int all_ok = 0;
  FN_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, gpu_.mpi_comm()));
  if (report != nullptr) {
    *report = all_ok ? fmt::format("{} sizes x F32/BF16 equal to NCCL", std::size(counts))
                     : (ok ? std::string("another rank saw a mismatch (see its log)") : problem);
  }
  if (!ok) FN_LOG_WARN("custom all-reduce self-test: {}", problem);
  return all_ok != 0;
}

// ---- NCCL and the factory --------------------------------------------------------------------

void NcclAllReduce::all_reduce_sum(const void* in, void* out, std::size_t count, DType dtype,
                                   cudaStream_t stream) {
  element_size(dtype);
  if (count == 0) return;
  FN_NCCL_CHECK(ncclAllReduce(in, out, count, dtype == DType::F32 ? ncclFloat32 : ncclBfloat16,
                              ncclSum, gpu_.nccl(), stream));
}

AllReduceStrategy parse_all_reduce_strategy(std::string_view text) {
  if (text == "auto") return AllReduceStrategy::Auto;
  if (text == "custom") return AllReduceStrategy::Custom;
  if (text == "nccl") return AllReduceStrategy::Nccl;
  FN_THROW(Usage, "--allreduce {}: expected auto, custom or nccl", text);
}

const char* all_reduce_strategy_name(AllReduceStrategy strategy) noexcept {
  switch (strategy) {
    case AllReduceStrategy::Auto:
      return "auto";
    case AllReduceStrategy::Custom:
      return "custom";
    case AllReduceStrategy::Nccl:
      return "nccl";
  }
  return "?";
}

std::unique_ptr<DeviceAllReduce> make_device_all_reduce(AllReduceStrategy strategy, GpuComm& gpu,
                                                        const CustomAllReduceOptions& options) {
  const char* flag = all_reduce_strategy_name(strategy);
  if (strategy == AllReduceStrategy::Nccl) {
    FN_LOG_INFO("all-reduce: nccl (--allreduce nccl)");
    return std::make_unique<NcclAllReduce>(gpu);
  }
  std::string why;
  if (!gpu.custom_all_reduce_possible(&why)) {
    FN_REQUIRE(strategy != AllReduceStrategy::Custom, Usage,
               "--allreduce custom needs peer access between all GPUs of one node: {}", why);
    FN_LOG_INFO("all-reduce: nccl (--allreduce auto: {})", why);
    return std::make_unique<NcclAllReduce>(gpu);
  }
  auto nccl = std::make_unique<NcclAllReduce>(gpu);
  auto custom = std::make_unique<CustomAllReduce>(gpu, options);
  cudaStream_t stream = nullptr;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::string report;
  bool ok = false;
  try {
    ok = custom->self_test(*nccl, stream, &report);
  } catch (...) {
    cudaStreamDestroy(stream);
    throw;
  }
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
  if (!ok) {
    if (strategy == AllReduceStrategy::Custom) {
      FN_LOG_ERROR("all-reduce: custom self-test against NCCL failed ({}); falling back to nccl",
                   report);
    } else {
      FN_LOG_WARN("all-reduce: custom self-test against NCCL failed ({}); falling back to nccl",
                  report);
    }
    custom.reset();
    return nccl;
  }
  FN_LOG_INFO(
      "all-reduce: custom (--allreduce {}; one-shot <= {} B, two-shot above; self-test: "
      "{})",
      flag, custom->options().oneshot_max_bytes, report);
  return custom;
}

}  // namespace fn
