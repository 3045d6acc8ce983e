// Where the CUDA backend keeps the PLE n-gram table (`--ngram-table`, core/memory_plan.h): auto's
// decision as a pure function on hand-built plans, the device plan of the real geometry with the
// table in host memory against sizes written out here from docs/model.md (§A.3, §B.2, §E.2), the
// sequences of a context that fit an 80 GB card with either placement, the host-memory check
// (MemAvailable) and `fngen inspect`'s tables of both placements.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <string>

#include "core/config.h"
#include "core/error.h"
#include "core/inspect.h"
#include "core/memory_plan.h"
#include "core/shard_plan.h"

namespace {

using nlohmann::json;
const char* kReal = FN_SOURCE_DIR "/configs/qwen3.8-flash-next.json";
constexpr uint64_t kGiB = uint64_t{1} << 30;

// A plan of 10 GiB of embedding, 5 GiB of n-gram table, 1 GiB of KV cache: 16 GiB in all.
fn::MemoryPlan toy_plan() {
  fn::MemoryPlan p;
  p.ctx_size = 4096;
  p.weights["embed"] = 10 * kGiB;
  p.weights["ple.ngram"] = 5 * kGiB;
  p.kv_cache = 1 * kGiB;
  return p;
}

const fn::ShardPlan& real_plan() {
  static const fn::ShardPlan plan = [] {
    std::ifstream in(kReal);
    const json j = json::parse(in);
    return fn::ShardPlan::build(fn::parse_model_config(j, kReal),
                                fn::parse_quantization_config(j["quantization_config"], kReal), 1);
  }();
  return plan;
}

const fn::ModelConfig& real_config() {
  static const fn::ModelConfig c = fn::load_model_config(kReal);
  return c;
}

// The n-gram table of the real geometry at TP=1: 320,001,536 rows of 160 FP8 bytes (docs/model.md
// §A.3: 16 heads of 20,000,096 rows; ple_embed_dim 2560 / 16 heads = 160 bytes per row).
constexpr uint64_t kTableBytes = 320001536ull * 160;

}  // namespace

TEST_CASE("ngram placement: auto keeps the table on the device while the total fits the budget") {
  const fn::MemoryPlan p = toy_plan();
  REQUIRE(p.total() == 16 * kGiB);
  // 0.9 x 20 GiB = 18 GiB >= 16 GiB.
  fn::NgramPlacement d = fn::place_ngram_table(fn::NgramTable::Auto, p, 20 * kGiB, 0.9);
  CHECK_FALSE(d.host);
  CHECK(d.reason.find("fits") != std::string::npos);
  // The boundary: 1.0 x 16 GiB = 16 GiB, equal to the need, still fits.
  CHECK_FALSE(fn::place_ngram_table(fn::NgramTable::Auto, p, 16 * kGiB, 1.0).host);
  // One byte less does not.
  CHECK(fn::place_ngram_table(fn::NgramTable::Auto, p, 16 * kGiB - 1, 1.0).host);
}

TEST_CASE(
    "ngram placement: auto moves the table to host memory when the total exceeds the budget") {
  const fn::MemoryPlan p = toy_plan();
  // 0.9 x 17 GiB = 15.3 GiB < 16 GiB.
  const fn::NgramPlacement h = fn::place_ngram_table(fn::NgramTable::Auto, p, 17 * kGiB, 0.9);
  CHECK(h.host);
  CHECK(h.reason.find("16.000 GiB") != std::string::npos);  // the need
  CHECK(h.reason.find("15.300 GiB") != std::string::npos);  // the budget
  CHECK(h.reason.find("5.000 GiB goes to pinned host memory") != std::string::npos);
  // A tiny utilization forces it on any card (how the CLI test makes a fixture host-resident).
  CHECK(fn::place_ngram_table(fn::NgramTable::Auto, p, 80 * kGiB, 0.01).host);
}

TEST_CASE("ngram placement: device and host are taken as asked; no table means device") {
  const fn::MemoryPlan p = toy_plan();
  CHECK_FALSE(fn::place_ngram_table(fn::NgramTable::Device, p, 1 * kGiB, 0.9).host);
  CHECK(fn::place_ngram_table(fn::NgramTable::Host, p, 100 * kGiB, 0.9).host);
  fn::MemoryPlan none = p;
  none.weights.erase("ple.ngram");
  const fn::NgramPlacement n = fn::place_ngram_table(fn::NgramTable::Host, none, 1 * kGiB, 0.9);
  CHECK_FALSE(n.host);
  CHECK(n.reason == "no n-gram table on this rank");
  CHECK_FALSE(fn::place_ngram_table(fn::NgramTable::Auto, none, 1, 0.9).host);
}

TEST_CASE("ngram placement: a utilization outside (0, 1] and an unknown name are usage errors") {
  const fn::MemoryPlan p = toy_plan();
  for (double u : {0.0, -0.5, 1.0001}) {
    CAPTURE(u);
    try {
      fn::place_ngram_table(fn::NgramTable::Auto, p, kGiB, u);
      FAIL("accepted");
    } catch (const fn::Error& e) {
      CHECK(e.kind() == fn::ErrorKind::Usage);
      CHECK(std::string(e.what()).find("--gpu-memory-utilization") != std::string::npos);
    }
  }
  CHECK(fn::parse_ngram_table("device") == fn::NgramTable::Device);
  CHECK(fn::parse_ngram_table("host") == fn::NgramTable::Host);
  CHECK(fn::parse_ngram_table("auto") == fn::NgramTable::Auto);
  CHECK(std::string(fn::ngram_table_name(fn::NgramTable::Host)) == "host");
  try {
    fn::parse_ngram_table("gpu");
    FAIL("accepted");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Usage);
    CHECK(std::string(e.what()).find("--ngram-table") != std::string::npos);
  }
}

TEST_CASE("ngram placement: the real geometry at TP=1 moves 47.7 GiB of table off the device") {
  const fn::MemoryPlan dev = fn::plan_device_memory(real_config(), real_plan(), 0, 8192);
  const fn::MemoryPlan host = fn::plan_device_memory(real_config(), real_plan(), 0, 8192, true);
  CHECK(dev.weights.at("ple.ngram") == kTableBytes);
  CHECK(dev.ngram_host == 0);
  CHECK(host.weights.count("ple.ngram") == 0);
  CHECK(host.ngram_host == kTableBytes);
  CHECK(kTableBytes == 51200245760ull);  // 47.68 GiB
  CHECK(dev.weight_total() - host.weight_total() == kTableBytes);
  CHECK(dev.total() - host.total() == kTableBytes);
  CHECK(host.state_total() == dev.state_total());
  CHECK(host.workspace == dev.workspace);
  // The other families are untouched.
  fn::MemoryPlan rest = dev;
  rest.weights.erase("ple.ngram");
  CHECK(rest.weights == host.weights);
  // On an 80 GB card with 78 GB free: device placement needs ~120 GiB, so auto goes to host.
  const fn::NgramPlacement p =
      fn::place_ngram_table(fn::NgramTable::Auto, dev, 78'000'000'000ull, 0.9);
  CHECK(p.host);
}

TEST_CASE("ngram placement: sequences of a context that fit a card, by hand") {
  fn::MemoryPlan p;
  p.weights["embed"] = 60;
  p.workspace = 10;
  p.reserve = 5;
  p.kv_cache = 7;
  p.gdn_state = 3;                        // 10 bytes of state per sequence
  CHECK(fn::sequences_fit(p, 75) == 0);   // 75 = weights + workspace + reserve: no room
  CHECK(fn::sequences_fit(p, 84) == 0);   // 9 bytes left
  CHECK(fn::sequences_fit(p, 85) == 1);   // 10
  CHECK(fn::sequences_fit(p, 174) == 9);  // 99
  CHECK(fn::sequences_fit(p, 50) == 0);   // the weights do not fit

  // The real geometry at TP=1 and 8192 tokens on an 80 GB card: none with the table on the
  // device (120 GiB of weights); with it in host memory, (80e9 - weights - workspace) / state.
  const fn::MemoryPlan dev = fn::plan_device_memory(real_config(), real_plan(), 0, 8192);
  const fn::MemoryPlan host = fn::plan_device_memory(real_config(), real_plan(), 0, 8192, true);
  CHECK(fn::sequences_fit(dev, 80'000'000'000ull) == 0);
  // Per sequence at 8192 tokens (docs/model.md §C.0): KV 12 x 8192 x 2 heads x 256 x 2 B x 2 = 192
  // MiB, indexer 12 x (8192 + 2048) x 128 x 4 B = 60 MiB, GDN 36 x 48 x 128 x 128 x 4 B = 108 MiB,
  // GDN conv 36 x 10240 x 3 x 4 B, PLE conv 10240 x 3 x 3 x 4 B.
  const uint64_t state = 12ull * 8192 * 2 * 256 * 2 * 2 + 12ull * (8192 + 2048) * 128 * 4 +
                         36ull * 48 * 128 * 128 * 4 + 36ull * 10240 * 3 * 4 + 10240ull * 9 * 4;
  REQUIRE(host.state_total() == state);
  const uint64_t fixed = host.weight_total() + host.workspace;
  REQUIRE(fixed < 80'000'000'000ull);
  CHECK(fn::sequences_fit(host, 80'000'000'000ull) ==
        static_cast<int64_t>((80'000'000'000ull - fixed) / state));
  CHECK(fn::sequences_fit(host, 80'000'000'000ull) > 0);
}

TEST_CASE("ngram placement: MemAvailable is read from /proc/meminfo text in kB") {
  CHECK(fn::parse_mem_available("MemTotal:       131072 kB\nMemFree:          2048 kB\n"
                                "MemAvailable:   65536 kB\nBuffers: 1 kB\n") == 65536ull * 1024);
  // Only a line that starts with the key counts.
  CHECK(fn::parse_mem_available("XMemAvailable: 1 kB\nMemAvailable: 3 kB\n") == 3ull * 1024);
  for (const char* bad : {"MemTotal: 5 kB\n", "MemAvailable: kB\n", "XMemAvailable: 1 kB\n"}) {
    CAPTURE(bad);
    try {
      fn::parse_mem_available(bad);
      FAIL("accepted");
    } catch (const fn::Error& e) {
      CHECK(e.kind() == fn::ErrorKind::Format);
    }
  }
  // This host's value is readable and positive.
  CHECK(fn::host_mem_available() > 0);
}

TEST_CASE("ngram placement: a host without room for the table is refused naming both sizes") {
  fn::require_host_fits(kTableBytes, kTableBytes, "rank 0 (GPU 0)");  // exactly enough
  try {
    fn::require_host_fits(kTableBytes, 32 * kGiB, "rank 0 (GPU 0)");
    FAIL("accepted");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Usage);
    const std::string msg = e.what();
    CHECK(msg.find("rank 0 (GPU 0)") != std::string::npos);
    CHECK(msg.find("needs 47.684 GiB of pinned host memory") != std::string::npos);
    CHECK(msg.find("32.000 GiB available (MemAvailable") != std::string::npos);
    CHECK(msg.find("--ngram-table device") != std::string::npos);
  }
  // The device refusal names the host placement while the table is on the device.
  const fn::MemoryPlan dev = fn::plan_device_memory(real_config(), real_plan(), 0, 8192);
  try {
    fn::require_fits(dev, 78 * kGiB, "rank 0 (GPU 0)");
    FAIL("accepted");
  } catch (const fn::Error& e) {
    CHECK(std::string(e.what()).find("(--ngram-table host)") != std::string::npos);
  }
  const fn::MemoryPlan host = fn::plan_device_memory(real_config(), real_plan(), 0, 8192, true);
  try {
    fn::require_fits(host, 8 * kGiB, "rank 0 (GPU 0)");
    FAIL("accepted");
  } catch (const fn::Error& e) {
    CHECK(std::string(e.what()).find("--ngram-table host") == std::string::npos);
  }
}

TEST_CASE("ngram placement: fngen inspect shows both placements and the sequences that fit") {
  fn::InspectReport r = fn::inspect_checkpoint(kReal, 1, 8192);
  REQUIRE(r.device_memory.size() == r.memory_ctx_sizes.size());
  REQUIRE(r.device_memory_host_ngram.size() == r.memory_ctx_sizes.size());
  CHECK(r.gpu_bytes == 79 * kGiB);
  for (std::size_t i = 0; i < r.memory_ctx_sizes.size(); ++i) {
    const fn::MemoryPlan& d = r.device_memory[i].at(0);
    const fn::MemoryPlan& h = r.device_memory_host_ngram[i].at(0);
    CHECK(d.total() - h.total() == kTableBytes);
    CHECK(h.ngram_host == kTableBytes);
  }
  const std::string text = fn::format_inspect_text(r);
  CHECK(text.find("with --ngram-table host") != std::string::npos);
  CHECK(text.find("n-gram table (host)") != std::string::npos);
  CHECK(text.find("sequences that fit 79.0 GiB per GPU") != std::string::npos);
  CHECK(text.find("n-gram table in host") != std::string::npos);
  const json j = fn::inspect_json(r);
  CHECK(j["gpu_bytes"] == 79 * kGiB);
  const json& m0 = j["device_memory"][0];
  CHECK(m0["ctx_size"] == 8192);
  CHECK(m0["sequences_fit"][0] == 0);
  // 79 GiB - 72.50 GiB of weights - 28.6 MiB of workspace = 6.47 GiB: 18 sequences of the
  // 364.6 MiB of state one 8192-token sequence holds (the sum of the previous case).
  CHECK(m0["sequences_fit_ngram_host"][0] ==
        fn::sequences_fit(r.device_memory_host_ngram[0][0], 79 * kGiB));
  CHECK(m0["sequences_fit_ngram_host"][0] == 18);
  CHECK(m0["ranks_ngram_host"][0]["ngram_host"] == kTableBytes);
  // A 141 GB card (H200): the device placement fits sequences too.
  r.gpu_bytes = 141'000'000'000ull;
  CHECK(fn::inspect_json(r)["device_memory"][0]["sequences_fit"][0] ==
        fn::sequences_fit(r.device_memory[0][0], 141'000'000'000ull));
  CHECK(fn::sequences_fit(r.device_memory[0][0], 141'000'000'000ull) > 0);
}
