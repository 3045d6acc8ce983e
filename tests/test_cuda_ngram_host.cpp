// The n-gram table in pinned host memory (`--ngram-table host`, CudaModelOptions::ngram_table)
// against the device-resident table: on every reference fixture the logits of the decode step
// (graph replay and eager), of the batched prefill and the device greedy decode are bitwise the
// same with either placement — the gather reads the same bytes and computes the same FP32 values,
// only from another memory — at TP=1 and at TP = world size (each rank reads its own rows);
// random weights (CudaModel::random) give the same logits with either placement, on the tiny
// geometry and on a 4-layer slice of the real one (the real n-gram table: 47.7 GiB of pinned
// host memory, which the GPU machine's host has); a random fill in pieces equals one fill (how the
// host table is generated); auto's decision follows the utilization knob.
// Run with mpirun -np 2 on the GPU machine (label gpu).
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "comm/custom_all_reduce.h"
#include "comm/device_all_reduce.h"
#include "comm/gpu_comm.h"
#include "core/config.h"
#include "core/error.h"
#include "core/memory_plan.h"
#include "cuda/common/cuda_check.h"
#include "cuda/kernels/weight_fill.h"
#include "cuda/model/cuda_model.h"
#include "cuda_model_check.h"
#include "test_cpu_fixture.h"

namespace {

const char* const kFixtures[] = {"g3_tiny", "tp4", "ple2_long"};

fn::CudaModelOptions options(fn::NgramTable table, bool graph, int rank = 0, int size = 1,
                             fn::DeviceAllReduce* ar = nullptr) {
  fn::CudaModelOptions o;
  o.ctx_size = 256;
  o.use_graph = graph;
  o.tp_rank = rank;
  o.tp_size = size;
  o.all_reduce = ar;
  o.ngram_table = table;
  return o;
}

// Bitwise equality of two float arrays; the first differing index in `where`.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b, std::size_t* where) {
  if (a.size() != b.size()) {
    *where = std::min(a.size(), b.size());
    return false;
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    uint32_t x = 0, y = 0;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    if (x != y) {
      *where = i;
      return false;
    }
  }
  return true;
}

void check_same(const std::vector<float>& dev, const std::vector<float>& host, const char* what) {
  std::size_t at = 0;
  const bool same = same_bits(dev, host, &at);
  CAPTURE(what);
  CAPTURE(at);
  CHECK(same);
  CHECK(!dev.empty());
}

std::vector<float> prefill_all(fn::CudaModel& m, const std::vector<int32_t>& tokens) {
  m.reset();
  const auto l =
      m.prefill(std::span<const int32_t>(tokens.data(), tokens.size()), fn::PrefillLogits::All);
  return {l.begin(), l.end()};
}

std::vector<int32_t> greedy(fn::CudaModel& m, int32_t first, int64_t steps) {
  m.reset();
  fn::SamplingParams greedy_params;
  greedy_params.temperature = 0;
  return m.decode(first, steps, greedy_params, 1, [](int32_t) { return true; });
}

// A host-resident model's facts.
void check_host_facts(const fn::CudaModel& m) {
  CHECK(m.load_stats().ngram_host_bytes > 0);
  CHECK(m.load_stats().ngram_placement == "--ngram-table host");
}

}  // namespace

TEST_CASE("cuda ngram table: host and device placements give bitwise the same logits at TP=1") {
  fn::test::use_gpu_of_rank();
  for (const std::string name : kFixtures) {
    CAPTURE(name);
    const fn::test::RefFixture f = fn::test::load_ref_fixture(name);
    for (bool graph : {true, false}) {
      CAPTURE(graph);
      auto dev = fn::CudaModel::load(f.dir, options(fn::NgramTable::Device, graph));
      auto host = fn::CudaModel::load(f.dir, options(fn::NgramTable::Host, graph));
      CHECK(dev->load_stats().ngram_host_bytes == 0);
      check_host_facts(*host);
      // The table left the device: the device weights shrink by exactly its bytes.
      CHECK(dev->load_stats().weight_bytes - host->load_stats().weight_bytes ==
            host->load_stats().ngram_host_bytes);
      check_same(fn::test::run_rows(*dev, f), fn::test::run_rows(*host, f), "decode steps");
      if (graph) {
        check_same(prefill_all(*dev, f.tokens), prefill_all(*host, f.tokens), "prefill");
        // The decode step forks the host gather off its start; a long greedy chain replays it.
        const std::vector<int32_t> a = greedy(*dev, f.tokens.front(), 40);
        const std::vector<int32_t> b = greedy(*host, f.tokens.front(), 40);
        CHECK(a == b);
        CHECK(host->graph_captures() == dev->graph_captures());
      }
    }
  }
}

TEST_CASE("cuda ngram table: at TP = world size each rank reads its own rows from host memory") {
  int rank = 0;
  const int n = fn::test::mpi_world(&rank);
  if (n < 2) {
    MESSAGE("TP > 1 needs mpirun -np 2 (one GPU per rank); this run has " << n << " rank(s)");
    return;
  }
  fn::GpuComm gpu(fn::gpu_group_of_world());
  cudaStream_t stream = nullptr;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto ar =
      fn::make_device_all_reduce(fn::AllReduceStrategy::Auto, gpu, fn::CustomAllReduceOptions{});
  const fn::test::RefFixture f = fn::test::load_ref_fixture("g3_tiny");
  auto od = options(fn::NgramTable::Device, true, rank, n, ar.get());
  auto oh = options(fn::NgramTable::Host, true, rank, n, ar.get());
  od.stream = stream;
  oh.stream = stream;
  {
    auto dev = fn::CudaModel::load(f.dir, od);
    const std::vector<float> a = fn::test::run_rows(*dev, f);
    const std::vector<float> pa = prefill_all(*dev, f.tokens);
    dev.reset();
    auto host = fn::CudaModel::load(f.dir, oh);
    check_host_facts(*host);
    check_same(a, fn::test::run_rows(*host, f), "decode steps, TP > 1");
    check_same(pa, prefill_all(*host, f.tokens), "prefill, TP > 1");
  }
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda ngram table: auto follows --gpu-memory-utilization") {
  fn::test::use_gpu_of_rank();
  const fn::test::RefFixture f = fn::test::load_ref_fixture("g3_tiny");
  auto o = options(fn::NgramTable::Auto, true);
  auto roomy = fn::CudaModel::load(f.dir, o);  // a tiny model on an empty card: the device
  CHECK(roomy->load_stats().ngram_host_bytes == 0);
  CHECK(roomy->load_stats().ngram_placement.find("auto: ") == 0);
  o.gpu_memory_utilization = 1e-9;  // a budget of a few hundred bytes: the host
  auto forced = fn::CudaModel::load(f.dir, o);
  CHECK(forced->load_stats().ngram_host_bytes > 0);
  CHECK(forced->load_stats().ngram_placement.find("pinned host memory") != std::string::npos);
  check_same(fn::test::run_rows(*roomy, f), fn::test::run_rows(*forced, f), "auto");
}

TEST_CASE("cuda ngram table: a random fill in pieces (RandomFillParams::first) equals one fill") {
  fn::test::use_gpu_of_rank();
  // An odd length and piece size, so pieces straddle every launch's grid-stride boundary.
  constexpr int64_t kCount = 3'000'017, kPiece = 700'001;
  uint8_t *whole = nullptr, *pieces = nullptr;
  FN_CUDA_CHECK(cudaMalloc(&whole, kCount));
  FN_CUDA_CHECK(cudaMalloc(&pieces, kCount));
  fn::RandomFillParams p;
  p.count = kCount;
  p.dtype = fn::DType::F8_E4M3;
  p.kind = fn::RandomFill::E4M3Uniform;
  p.seed = 11;
  p.stream = 1234;
  p.dst = whole;
  fn::launch_random_fill(p, nullptr);
  for (int64_t first = 0; first < kCount; first += kPiece) {
    fn::RandomFillParams q = p;
    q.dst = pieces + first;
    q.first = first;
    q.count = std::min(kPiece, kCount - first);
    fn::launch_random_fill(q, nullptr);
  }
  std::vector<uint8_t> a(kCount), b(kCount);
  FN_CUDA_CHECK(cudaMemcpy(a.data(), whole, kCount, cudaMemcpyDeviceToHost));
  FN_CUDA_CHECK(cudaMemcpy(b.data(), pieces, kCount, cudaMemcpyDeviceToHost));
  FN_CUDA_CHECK(cudaFree(whole));
  FN_CUDA_CHECK(cudaFree(pieces));
  CHECK(a == b);
  // Not a constant fill: the codes spread over the byte values.
  int64_t distinct = 0;
  std::vector<bool> seen(256, false);
  for (uint8_t v : a) {
    if (!seen[v]) ++distinct;
    seen[v] = true;
  }
  CHECK(distinct > 200);
  // A negative first index is refused.
  fn::RandomFillParams bad = p;
  bad.first = -1;
  CHECK_THROWS_AS(fn::launch_random_fill(bad, nullptr), fn::Error);
}

namespace {

// config.json of `path` with num_hidden_layers set to `layers` (and its quantization), parsed.
struct Geometry {
  fn::ModelConfig cfg;
  fn::QuantConfig quant;
};
Geometry geometry(const std::string& path, int64_t layers) {
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in);
  nlohmann::json& text = j.contains("text_config") ? j["text_config"] : j;
  if (layers > 0) {
    text["num_hidden_layers"] = layers;
    if (text.contains("layer_types")) {
      nlohmann::json types = nlohmann::json::array();
      for (int64_t i = 0; i < layers; ++i) types.push_back(text["layer_types"][i]);
      text["layer_types"] = types;
    }
  }
  fn::QuantConfig q;
  if (j.contains("quantization_config") && !j["quantization_config"].is_null())
    q = fn::parse_quantization_config(j["quantization_config"], path);
  return {fn::parse_model_config(j, path), q};
}

void check_random_alike(const Geometry& g, int64_t ctx) {
  fn::CudaModelOptions o = options(fn::NgramTable::Device, true);
  o.ctx_size = ctx;
  // Ids spread over the vocabulary (the top of the real one, 248044, folded into a small one).
  std::vector<int32_t> tokens = {1, 17, 248044, 5, 99, 1234, 7, 7, 7, 42, 0, 3};
  for (int32_t& t : tokens) t = static_cast<int32_t>(t % g.cfg.vocab_size);
  std::vector<float> a, pa;
  {
    auto dev = fn::CudaModel::random(g.cfg, g.quant, 7, o);
    for (int32_t t : tokens) {
      const auto l = dev->forward(t);
      a.insert(a.end(), l.begin(), l.end());
    }
    pa = prefill_all(*dev, tokens);
  }
  o.ngram_table = fn::NgramTable::Host;
  auto host = fn::CudaModel::random(g.cfg, g.quant, 7, o);
  check_host_facts(*host);
  std::vector<float> b;
  for (int32_t t : tokens) {
    const auto l = host->forward(t);
    b.insert(b.end(), l.begin(), l.end());
  }
  check_same(a, b, "random weights, decode steps");
  check_same(pa, prefill_all(*host, tokens), "random weights, prefill");
}

}  // namespace

TEST_CASE("cuda ngram table: random weights fill the host table with the device table's bytes") {
  fn::test::use_gpu_of_rank();
  check_random_alike(geometry(FN_SOURCE_DIR "/configs/tiny.json", 0), 256);
}

TEST_CASE(
    "cuda ngram table: a 4-layer slice of the real geometry, its 47.7 GiB table in host "
    "memory") {
  int rank = 0;
  fn::test::mpi_world(&rank);
  if (rank != 0) return;  // one rank: the slice's device weights and the host table are large
  fn::test::use_gpu_of_rank();
  const Geometry g = geometry(FN_SOURCE_DIR "/configs/qwen3.8-flash-next.json", 4);
  REQUIRE(g.cfg.has_ple());
  check_random_alike(g, 1024);
}
