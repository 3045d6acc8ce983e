// GPU tests of comm/ (label gpu; the GPU machine runs them with mpirun -np 2, one GPU per rank;
// they also run with one rank, e.g. under compute-sanitizer). Every rank knows every rank's
// data (tests/comm_test_kernels.h pattern), so each rank checks its result against the
// fixed-order sum itself; results are also compared across ranks.
#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/custom_all_reduce.h"
#include "comm/gpu_comm.h"
#include "comm/mpi_check.h"
#include "cuda/common/cuda_check.h"
#include "tests/comm_test_kernels.h"

namespace {

fn::GpuComm& gpu() {
  // Never destroyed: NCCL teardown must not run after MPI_Finalize and the CUDA runtime's exit.
  static fn::GpuComm* comm = new fn::GpuComm(fn::gpu_group_of_world());
  return *comm;
}

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(std::size_t bytes) { FN_CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { FN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
};

// Host reference: sum over ranks 0..world-1 in this order in FP32 (BF16: then RNE).
std::vector<unsigned char> expected_sum(std::size_t count, bool bf16, int world, uint32_t salt) {
  std::vector<unsigned char> out(count * (bf16 ? 2 : 4));
  for (std::size_t i = 0; i < count; ++i) {
    float acc = 0;
    for (int r = 0; r < world; ++r) {
      uint32_t bits = fn::test::pattern_f32_bits(i, r, salt);
      if (bf16) bits &= 0xffff0000u;
      float v = 0;
      std::memcpy(&v, &bits, 4);
      acc = r == 0 ? v : acc + v;
    }
    if (bf16) {
      const uint16_t h = fn::test::bf16_from_float(acc);
      std::memcpy(&out[2 * i], &h, 2);
    } else {
      std::memcpy(&out[4 * i], &acc, 4);
    }
  }
  return out;
}

uint64_t fnv1a(const std::vector<unsigned char>& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char b : bytes) h = (h ^ b) * 1099511628211ull;
  return h;
}

// True when every rank passed the same value.
bool same_on_all_ranks(uint64_t value) {
  uint64_t lo = 0, hi = 0;
  FN_MPI_CHECK(MPI_Allreduce(&value, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD));
  FN_MPI_CHECK(MPI_Allreduce(&value, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD));
  return lo == hi;
}

// Runs one eager all-reduce of the pattern and returns the number of wrong elements; also
// checks that every rank holds bitwise the same bytes.
long long run_and_count_wrong(fn::CustomAllReduce& ar, cudaStream_t stream, std::size_t count,
                              bool bf16, fn::AllReduceAlgo algo, uint32_t salt, bool in_place,
                              bool* same) {
  const std::size_t esize = bf16 ? 2 : 4;
  DeviceBuffer in(count * esize), out(count * esize);
  fn::test::launch_fill_pattern(in.ptr, count, bf16, gpu().rank(), nullptr, salt, stream);
  void* dst = in_place ? in.ptr : out.ptr;
  if (!in_place) FN_CUDA_CHECK(cudaMemsetAsync(out.ptr, 0xff, count * esize, stream));
  ar.all_reduce_sum(in.ptr, dst, count, bf16 ? fn::DType::BF16 : fn::DType::F32, stream, algo);
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));
  ar.check_health();
  std::vector<unsigned char> got(count * esize);
  FN_CUDA_CHECK(cudaMemcpy(got.data(), dst, got.size(), cudaMemcpyDeviceToHost));
  const auto want = expected_sum(count, bf16, gpu().size(), salt);
  long long wrong = 0;
  for (std::size_t i = 0; i < count; ++i) {
    wrong += std::memcmp(&got[i * esize], &want[i * esize], esize) != 0;
  }
  *same = same_on_all_ranks(fnv1a(got));
  return wrong;
}

const char* algo_name(fn::AllReduceAlgo a) {
  return a == fn::AllReduceAlgo::OneShot   ? "one-shot"
         : a == fn::AllReduceAlgo::TwoShot ? "two-shot"
                                           : "auto";
}

}  // namespace

TEST_CASE("gpu comm: every rank drives its own GPU and NCCL sums integer data exactly") {
  fn::GpuComm& g = gpu();
  int device = -1;
  FN_CUDA_CHECK(cudaGetDevice(&device));
  CHECK(device == g.device());
  REQUIRE(g.selection().uuids.size() == static_cast<std::size_t>(g.size()));
  for (int a = 0; a < g.size(); ++a) {
    for (int b = a + 1; b < g.size(); ++b) CHECK(g.selection().uuids[a] != g.selection().uuids[b]);
  }
  fn::NcclAllReduce nccl(g);
  Stream stream;
  const std::size_t count = 1001;
  std::vector<float> host(count);
  for (std::size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i % 13) + g.rank();
  DeviceBuffer buf(count * 4);
  // Stream-ordered: a pageable cudaMemcpy may return before its DMA lands, and a non-blocking
  // stream does not wait for the legacy stream.
  FN_CUDA_CHECK(cudaMemcpyAsync(buf.ptr, host.data(), count * 4, cudaMemcpyHostToDevice, stream.s));
  nccl.all_reduce_sum(buf.ptr, buf.ptr, count, fn::DType::F32, stream.s);
  FN_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  FN_CUDA_CHECK(cudaMemcpy(host.data(), buf.ptr, count * 4, cudaMemcpyDeviceToHost));
  const int n = g.size();
  long long wrong = 0;
  for (std::size_t i = 0; i < count; ++i) {
    wrong += host[i] != static_cast<float>(n * static_cast<int>(i % 13) + n * (n - 1) / 2);
  }
  CHECK(wrong == 0);
}

TEST_CASE("gpu comm: two ranks on one GPU are refused on every rank") {
  fn::GpuComm& g = gpu();
  if (g.size() < 2) return;  // needs two ranks
  bool refused = false;
  std::string message;
  try {
    fn::select_gpu(fn::gpu_group_of_world(), 0);
  } catch (const fn::Error& e) {
    refused = e.kind() == fn::ErrorKind::Usage;
    message = e.what();
  }
  FN_CUDA_CHECK(cudaSetDevice(g.device()));
  CHECK(refused);
  CHECK(message.find("both use GPU") != std::string::npos);
}

TEST_CASE(
    "custom all-reduce: one-shot, two-shot and auto give the fixed-order sum, bitwise "
    "equal on every rank (F32 and BF16, 1 to 4M elements)") {
  fn::CustomAllReduceOptions options;
  options.twoshot_max_bytes = std::size_t{4} << 20;  // 4M F32 takes 4 two-shot launches
  options.oneshot_max_bytes = std::size_t{256} << 10;
  fn::CustomAllReduce ar(gpu(), options);
  Stream stream;
  const std::size_t counts[] = {1,     2,     3,      5,      8,       13,          255,
                                256,   1000,  1280,   2560,   4097,    10007,       65536,
                                65537, 99999, 262147, 524288, 1048581, 4194304 - 3, 4194304};
  uint32_t salt = 1;
  for (bool bf16 : {false, true}) {
    for (fn::AllReduceAlgo algo :
         {fn::AllReduceAlgo::Auto, fn::AllReduceAlgo::OneShot, fn::AllReduceAlgo::TwoShot}) {
      for (std::size_t count : counts) {
        bool same = false;
        const long long wrong =
            run_and_count_wrong(ar, stream.s, count, bf16, algo, ++salt, false, &same);
        INFO(std::string(algo_name(algo))
             << " " << std::string(bf16 ? "BF16" : "F32") << " count " << count);
        CHECK(wrong == 0);
        CHECK(same);
      }
    }
  }
  // In place (out == in), both algorithms.
  for (std::size_t count : {std::size_t{2560}, std::size_t{77777}, std::size_t{1} << 20}) {
    for (fn::AllReduceAlgo algo : {fn::AllReduceAlgo::OneShot, fn::AllReduceAlgo::TwoShot}) {
      bool same = false;
      INFO("in place " << std::string(algo_name(algo)) << " count " << count);
      CHECK(run_and_count_wrong(ar, stream.s, count, false, algo, ++salt, true, &same) == 0);
      CHECK(same);
    }
  }
}

TEST_CASE(
    "custom all-reduce: integer-valued data gives exactly NCCL's result and the self-test "
    "passes") {
  fn::CustomAllReduce ar(gpu(), fn::CustomAllReduceOptions{});
  fn::NcclAllReduce nccl(gpu());
  Stream stream;
  std::string report;
  CHECK(ar.self_test(nccl, stream.s, &report));
  INFO(report);
  for (std::size_t count : {std::size_t{7}, std::size_t{2560}, std::size_t{300001}}) {
    std::vector<uint16_t> host(count);
    for (std::size_t i = 0; i < count; ++i) {
      const float v = static_cast<float>((i + 3 * gpu().rank()) % 9) - 4.0f;
      host[i] = fn::test::bf16_from_float(v);
    }
    DeviceBuffer in(count * 2), a(count * 2), b(count * 2);
    FN_CUDA_CHECK(
        cudaMemcpyAsync(in.ptr, host.data(), count * 2, cudaMemcpyHostToDevice, stream.s));
    ar.all_reduce_sum(in.ptr, a.ptr, count, fn::DType::BF16, stream.s);
    nccl.all_reduce_sum(in.ptr, b.ptr, count, fn::DType::BF16, stream.s);
    FN_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    std::vector<uint16_t> ha(count), hb(count);
    FN_CUDA_CHECK(cudaMemcpy(ha.data(), a.ptr, count * 2, cudaMemcpyDeviceToHost));
    FN_CUDA_CHECK(cudaMemcpy(hb.data(), b.ptr, count * 2, cudaMemcpyDeviceToHost));
    INFO("count " << count);
    CHECK(ha == hb);
  }
}

// 1000 x (fill with changing data, all-reduce, independent check, bump salt) in one graph,
// replayed `replays` times: the epoch must advance on replay, every result must be right.
static void graph_loop(std::size_t count, bool bf16, fn::AllReduceAlgo algo, int replays) {
  fn::CustomAllReduce ar(gpu(), fn::CustomAllReduceOptions{});
  Stream stream;
  const std::size_t esize = bf16 ? 2 : 4;
  DeviceBuffer in(count * esize), out(count * esize), counters(64);
  FN_CUDA_CHECK(cudaMemsetAsync(counters.ptr, 0, 64, stream.s));
  auto* salt = counters.as<uint32_t>();
  auto* wrong = reinterpret_cast<unsigned long long*>(counters.as<char>() + 16);
  auto* checks = reinterpret_cast<unsigned long long*>(counters.as<char>() + 24);
  const fn::DType dtype = bf16 ? fn::DType::BF16 : fn::DType::F32;
  ar.all_reduce_sum(in.ptr, out.ptr, count, dtype, stream.s, algo);  // eager first (warm-up)
  FN_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  constexpr int kPerGraph = 1000;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  FN_CUDA_CHECK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal));
  for (int k = 0; k < kPerGraph; ++k) {
    fn::test::launch_fill_pattern(in.ptr, count, bf16, gpu().rank(), salt, 0, stream.s);
    ar.all_reduce_sum(in.ptr, out.ptr, count, dtype, stream.s, algo);
    fn::test::launch_check_sum(out.ptr, count, bf16, gpu().size(), salt, 0, wrong, checks,
                               stream.s);
    fn::test::launch_bump(salt, stream.s);
  }
  FN_CUDA_CHECK(cudaStreamEndCapture(stream.s, &graph));
  FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < replays; ++r) FN_CUDA_CHECK(cudaGraphLaunch(exec, stream.s));
  FN_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  ar.check_health();
  FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FN_CUDA_CHECK(cudaGraphDestroy(graph));
  uint32_t host_salt = 0;
  unsigned long long host_wrong = 0, host_checks = 0;
  FN_CUDA_CHECK(cudaMemcpy(&host_salt, salt, 4, cudaMemcpyDeviceToHost));
  FN_CUDA_CHECK(cudaMemcpy(&host_wrong, wrong, 8, cudaMemcpyDeviceToHost));
  FN_CUDA_CHECK(cudaMemcpy(&host_checks, checks, 8, cudaMemcpyDeviceToHost));
  const unsigned long long total = static_cast<unsigned long long>(kPerGraph) * replays;
  MESSAGE("graph: " << total << " all-reduces of " << count << std::string(bf16 ? " BF16" : " F32")
                    << " (" << std::string(algo_name(algo)) << "), wrong elements: " << host_wrong);
  CHECK(host_salt == total);
  CHECK(host_checks == total);
  CHECK(host_wrong == 0);
}

TEST_CASE("custom all-reduce: 100,000 in-graph all-reduces with changing data are all right") {
  const char* replays_env = std::getenv("FN_TEST_GRAPH_REPLAYS");  // sanitizer runs use fewer
  const int replays = replays_env != nullptr ? std::atoi(replays_env) : 100;
  graph_loop(2560, false, fn::AllReduceAlgo::Auto, replays);  // 100 x 1000 = 100,000
  graph_loop(2560, true, fn::AllReduceAlgo::OneShot, replays / 10 > 0 ? replays / 10 : 1);
  graph_loop(300007, true, fn::AllReduceAlgo::TwoShot, replays / 10 > 0 ? replays / 10 : 1);
}

TEST_CASE("custom all-reduce: counters starting just below the 32-bit wrap stay correct") {
  fn::CustomAllReduceOptions options;
  options.initial_epoch = 0xFFFFFFFFu - 21u;  // wraps after 21 calls; sweeps at epochs 0 and 1
  options.oneshot_max_bytes = 64 << 10;
  fn::CustomAllReduce ar(gpu(), options);
  Stream stream;
  uint32_t salt = 1000;
  long long wrong = 0;
  bool all_same = true;
  for (int k = 0; k < 60; ++k) {
    const fn::AllReduceAlgo algo =
        k % 3 == 2 ? fn::AllReduceAlgo::TwoShot : fn::AllReduceAlgo::Auto;
    const std::size_t count = k % 2 == 0 ? 2560 : 40001;  // 40001 F32 > 64 KiB: chunked one-shot
    bool same = false;
    wrong += run_and_count_wrong(ar, stream.s, count, k % 4 == 1, algo, ++salt, false, &same);
    all_same = all_same && same;
  }
  CHECK(wrong == 0);
  CHECK(all_same);
}

TEST_CASE("custom all-reduce: correct while another stream runs a busy kernel") {
  fn::CustomAllReduce ar(gpu(), fn::CustomAllReduceOptions{});
  Stream stream, busy;
  const std::size_t busy_n = std::size_t{64} << 20;
  DeviceBuffer busy_buf(busy_n * 4), in(2560 * 4), out(2560 * 4), counters(64);
  FN_CUDA_CHECK(cudaMemset(busy_buf.ptr, 0, busy_n * 4));
  FN_CUDA_CHECK(cudaMemset(counters.ptr, 0, 64));
  auto* salt = counters.as<uint32_t>();
  auto* wrong = reinterpret_cast<unsigned long long*>(counters.as<char>() + 16);
  auto* checks = reinterpret_cast<unsigned long long*>(counters.as<char>() + 24);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  FN_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
  fn::test::launch_busy(busy_buf.as<float>(), busy_n, 100, busy.s);  // ~50 GB: ~15 ms
  for (int k = 0; k < 500; ++k) {
    fn::test::launch_fill_pattern(in.ptr, 2560, false, gpu().rank(), salt, 0, stream.s);
    ar.all_reduce_sum(in.ptr, out.ptr, 2560, fn::DType::F32, stream.s);
    fn::test::launch_check_sum(out.ptr, 2560, false, gpu().size(), salt, 0, wrong, checks,
                               stream.s);
    fn::test::launch_bump(salt, stream.s);
  }
  // Large two-shot ones too, while the busy kernel may still run.
  DeviceBuffer big_in((1 << 20) * 4), big_out((1 << 20) * 4);
  for (int k = 0; k < 20; ++k) {
    fn::test::launch_fill_pattern(big_in.ptr, 1 << 20, false, gpu().rank(), salt, 0, stream.s);
    ar.all_reduce_sum(big_in.ptr, big_out.ptr, 1 << 20, fn::DType::F32, stream.s,
                      fn::AllReduceAlgo::TwoShot);
    fn::test::launch_check_sum(big_out.ptr, 1 << 20, false, gpu().size(), salt, 0, wrong, checks,
                               stream.s);
    fn::test::launch_bump(salt, stream.s);
  }
  FN_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  FN_CUDA_CHECK(cudaStreamSynchronize(busy.s));
  ar.check_health();
  unsigned long long host_wrong = 0, host_checks = 0;
  FN_CUDA_CHECK(cudaMemcpy(&host_wrong, wrong, 8, cudaMemcpyDeviceToHost));
  FN_CUDA_CHECK(cudaMemcpy(&host_checks, checks, 8, cudaMemcpyDeviceToHost));
  CHECK(host_checks == 520);
  CHECK(host_wrong == 0);
}

TEST_CASE(
    "all-reduce factory: nccl is taken when asked, custom when it passes its self-test, "
    "and a corrupted self-test falls back to NCCL") {
  fn::CustomAllReduceOptions options;
  CHECK(std::string(make_device_all_reduce(fn::AllReduceStrategy::Nccl, gpu(), options)->name()) ==
        "nccl");
  CHECK(std::string(make_device_all_reduce(fn::AllReduceStrategy::Auto, gpu(), options)->name()) ==
        "custom");
  CHECK(
      std::string(make_device_all_reduce(fn::AllReduceStrategy::Custom, gpu(), options)->name()) ==
      "custom");
  options.corrupt_self_test = true;
  CHECK(std::string(make_device_all_reduce(fn::AllReduceStrategy::Auto, gpu(), options)->name()) ==
        "nccl");
}

TEST_CASE("all-reduce factory: FN_DISABLE_P2P=1 makes auto fall back to NCCL and custom an error") {
  setenv("FN_DISABLE_P2P", "1", 1);
  std::unique_ptr<fn::GpuComm> comm;
  try {
    comm = std::make_unique<fn::GpuComm>(fn::gpu_group_of_world());
  } catch (...) {
    unsetenv("FN_DISABLE_P2P");
    throw;
  }
  unsetenv("FN_DISABLE_P2P");
  std::string why;
  CHECK_FALSE(comm->custom_all_reduce_possible(&why));
  CHECK(why.find("FN_DISABLE_P2P") != std::string::npos);
  fn::CustomAllReduceOptions options;
  CHECK(std::string(make_device_all_reduce(fn::AllReduceStrategy::Auto, *comm, options)->name()) ==
        "nccl");
  bool usage = false;
  try {
    make_device_all_reduce(fn::AllReduceStrategy::Custom, *comm, options);
  } catch (const fn::Error& e) {
    usage = e.kind() == fn::ErrorKind::Usage &&
            std::string(e.what()).find("--allreduce custom") != std::string::npos;
  }
  CHECK(usage);
}
