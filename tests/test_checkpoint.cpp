// Checkpoint directories: sharded (index), single-file and glob layouts; every index/shard
// inconsistency rejected with an error naming the files and tensor; reads by name.
#include <doctest/doctest.h>

#include <cstring>

#include "checkpoint_test_util.h"
#include "core/checkpoint.h"
#include "core/safetensors_writer.h"

using fn::Checkpoint;
using fn::DType;
using fn::ErrorKind;
using fn::SafetensorsWriter;
using fn::testing::check_error;
using fn::testing::TempDir;
using fn::testing::write_file;

namespace {

SafetensorsWriter::Fill pattern(int salt) {
  return [salt](std::span<std::byte> b) {
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::byte>((i * 5 + salt) & 0xFF);
  };
}

// Writes a shard holding the given (name, rows) U8 [rows, 4] tensors.
void write_shard(const std::filesystem::path& path,
                 const std::vector<std::pair<std::string, int64_t>>& tensors) {
  SafetensorsWriter w;
  int salt = 0;
  for (const auto& [name, rows] : tensors) w.add(name, DType::U8, {rows, 4}, pattern(++salt));
  w.write(path);
}

// Two shards and an index: a.weight, b.weight in shard 1; c.weight in shard 2.
void write_sharded(const TempDir& dir) {
  write_shard(dir / "model-00001-of-00002.safetensors", {{"a.weight", 2}, {"b.weight", 3}});
  write_shard(dir / "model-00002-of-00002.safetensors", {{"c.weight", 5}});
  write_file(dir / "model.safetensors.index.json",
             R"({"metadata": {"total_size": 40}, "weight_map": {)"
             R"("a.weight": "model-00001-of-00002.safetensors",)"
             R"("b.weight": "model-00001-of-00002.safetensors",)"
             R"("c.weight": "model-00002-of-00002.safetensors"}})");
}

void write_index(const TempDir& dir, const std::string& json) {
  write_file(dir / "model.safetensors.index.json", json);
}

}  // namespace

TEST_CASE("checkpoint: a sharded checkpoint opens through its index") {
  TempDir dir;
  write_sharded(dir);
  const auto ck = Checkpoint::open(dir.path());
  CHECK(ck.file_count() == 2);
  CHECK(ck.tensor_names() == std::vector<std::string>{"a.weight", "b.weight", "c.weight"});
  CHECK(ck.total_bytes() == (2 + 3 + 5) * 4);
  CHECK(ck.file_of("c.weight").path().filename() == "model-00002-of-00002.safetensors");
  CHECK(ck.file_of("a.weight").path().filename() == "model-00001-of-00002.safetensors");
  REQUIRE(ck.find("b.weight") != nullptr);
  CHECK(ck.find("b.weight")->shape == std::vector<int64_t>{3, 4});
  CHECK(ck.find("nope") == nullptr);
  CHECK(ck.index_metadata_json() == R"({"total_size":40})");

  // Reads by name equal the bytes the writer produced.
  std::vector<std::byte> all(20), rows(8), block(5 * 2), one(4);
  ck.read_all("c.weight", all.data());
  for (std::size_t i = 0; i < all.size(); ++i) {
    CHECK(std::to_integer<int>(all[i]) == int((i * 5 + 1) & 0xFF));
  }
  ck.read_rows("c.weight", 3, 2, rows.data());
  CHECK(std::memcmp(rows.data(), all.data() + 12, 8) == 0);
  ck.read_block("c.weight", 0, 5, 1, 2, block.data());
  for (int r = 0; r < 5; ++r)
    CHECK(std::memcmp(block.data() + 2 * r, all.data() + 4 * r + 1, 2) == 0);
  ck.read_index0("c.weight", 4, one.data());
  CHECK(std::memcmp(one.data(), all.data() + 16, 4) == 0);
}

TEST_CASE("checkpoint: a single model.safetensors opens without an index") {
  TempDir dir;
  write_shard(dir / "model.safetensors", {{"x", 1}, {"y", 2}});
  write_shard(dir / "ignored.safetensors", {{"x", 1}});  // not consulted in this layout
  const auto ck = Checkpoint::open(dir.path());
  CHECK(ck.file_count() == 1);
  CHECK(ck.tensor_names() == std::vector<std::string>{"x", "y"});
  CHECK(ck.index_metadata_json() == "{}");
}

TEST_CASE("checkpoint: without index or model.safetensors every *.safetensors file is read") {
  TempDir dir;
  write_shard(dir / "b.safetensors", {{"t2", 1}});
  write_shard(dir / "a.safetensors", {{"t1", 1}});
  write_file(dir / "notes.txt", "not a shard");
  const auto ck = Checkpoint::open(dir.path());
  CHECK(ck.file_count() == 2);
  CHECK(ck.files()[0].path().filename() == "a.safetensors");
  CHECK(ck.tensor_names() == std::vector<std::string>{"t1", "t2"});
}

TEST_CASE("checkpoint: the same tensor in two shards is rejected naming both files") {
  TempDir dir;
  write_shard(dir / "a.safetensors", {{"dup", 1}});
  write_shard(dir / "b.safetensors", {{"dup", 1}, {"other", 1}});
  check_error([&] { Checkpoint::open(dir.path()); }, ErrorKind::Format,
              {"'dup'", "a.safetensors", "b.safetensors"});
  // Also when an index is present (it can only name one of them).
  write_index(dir, R"({"weight_map": {"dup": "a.safetensors", "other": "b.safetensors"}})");
  check_error([&] { Checkpoint::open(dir.path()); }, ErrorKind::Format,
              {"'dup'", "a.safetensors", "b.safetensors"});
}

TEST_CASE("checkpoint: an index naming a missing file is an Io error naming both") {
  TempDir dir;
  write_sharded(dir);
  std::filesystem::remove(dir / "model-00002-of-00002.safetensors");
  check_error(
      [&] { Checkpoint::open(dir.path()); }, ErrorKind::Io,
      {"model.safetensors.index.json", "model-00002-of-00002.safetensors", "does not exist"});
  // A directory where the shard should be is named as such, not as missing.
  std::filesystem::create_directory(dir / "model-00002-of-00002.safetensors");
  check_error([&] { Checkpoint::open(dir.path()); }, ErrorKind::Io,
              {"model-00002-of-00002.safetensors", "is not a regular file"});
}

TEST_CASE("checkpoint: a tensor of the index absent from its file is rejected") {
  TempDir dir;
  write_sharded(dir);
  write_index(dir, R"({"weight_map": {"a.weight": "model-00001-of-00002.safetensors",)"
                   R"("b.weight": "model-00001-of-00002.safetensors",)"
                   R"("c.weight": "model-00002-of-00002.safetensors",)"
                   R"("ghost.weight": "model-00002-of-00002.safetensors"}})");
  check_error([&] { Checkpoint::open(dir.path()); }, ErrorKind::Format,
              {"'ghost.weight'", "model-00002-of-00002.safetensors"});
}

TEST_CASE("checkpoint: a file tensor missing from the index is rejected") {
  TempDir dir;
  write_sharded(dir);
  write_index(dir, R"({"weight_map": {"a.weight": "model-00001-of-00002.safetensors",)"
                   R"("c.weight": "model-00002-of-00002.safetensors"}})");
  check_error([&] { Checkpoint::open(dir.path()); }, ErrorKind::Format,
              {"'b.weight'", "model-00001-of-00002.safetensors", "missing from the index"});
}

TEST_CASE("checkpoint: an index placing a tensor in the wrong file is rejected") {
  TempDir dir;
  write_sharded(dir);
  write_index(dir, R"({"weight_map": {"a.weight": "model-00001-of-00002.safetensors",)"
                   R"("b.weight": "model-00001-of-00002.safetensors",)"
                   R"("c.weight": "model-00001-of-00002.safetensors"}})");
  check_error([&] { Checkpoint::open(dir.path()); }, ErrorKind::Format,
              {"'c.weight'", "model-00001-of-00002.safetensors"});
}

TEST_CASE("checkpoint: an index that is not JSON is rejected") {
  TempDir dir;
  write_sharded(dir);
  write_index(dir, R"({"weight_map": {"a.weight": )");
  check_error([&] { Checkpoint::open(dir.path()); }, ErrorKind::Format,
              {"model.safetensors.index.json", "not valid JSON"});
}

TEST_CASE("checkpoint: an index with wrong types is rejected") {
  TempDir dir;
  write_sharded(dir);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"([1, 2])", "not an object"},
      {R"({"metadata": {}})", "no weight_map"},
      {R"({"weight_map": ["a.weight"]})", "weight_map is a JSON array"},
      {R"({"weight_map": {"a.weight": 3}})", "'a.weight'"},
      {R"({"metadata": "x", "weight_map": {}})", "metadata"},
      {R"({"weight_map": {"a.weight": "../model-00001-of-00002.safetensors"}})", "'a.weight'"},
  };
  for (const auto& [json, part] : cases) {
    INFO("index: " << json);
    write_index(dir, json);
    check_error([&] { Checkpoint::open(dir.path()); }, ErrorKind::Format,
                {"model.safetensors.index.json", part});
  }
}

TEST_CASE("checkpoint: a malformed shard is reported naming that shard") {
  TempDir dir;
  write_sharded(dir);
  write_file(dir / "model-00002-of-00002.safetensors", "abc");
  check_error([&] { Checkpoint::open(dir.path()); }, ErrorKind::Format,
              {"model-00002-of-00002.safetensors"});
}

TEST_CASE("checkpoint: a directory that is missing or holds no safetensors is an Io error") {
  TempDir dir;
  check_error([&] { Checkpoint::open(dir.path()); }, ErrorKind::Io, {dir.path().string()});
  check_error([&] { Checkpoint::open(dir / "missing"); }, ErrorKind::Io, {"missing"});
}

TEST_CASE("checkpoint: reading a tensor it does not hold is a Format error naming it") {
  TempDir dir;
  write_sharded(dir);
  const auto ck = Checkpoint::open(dir.path());
  std::vector<std::byte> buf(64);
  check_error([&] { ck.file_of("nope.weight"); }, ErrorKind::Format, {"'nope.weight'"});
  check_error([&] { ck.read_all("nope.weight", buf.data()); }, ErrorKind::Format,
              {"'nope.weight'"});
  check_error([&] { ck.read_rows("c.weight", 4, 2, buf.data()); }, ErrorKind::Usage,
              {"'c.weight'"});
}

TEST_CASE("checkpoint: a moved checkpoint still resolves names to its files") {
  TempDir dir;
  write_sharded(dir);
  auto a = Checkpoint::open(dir.path());
  Checkpoint b = std::move(a);
  std::vector<std::byte> buf(8);
  b.read_all("a.weight", buf.data());
  CHECK(std::to_integer<int>(buf[1]) == 6);
  CHECK(&b.file_of("a.weight") == &b.files()[0]);
}
