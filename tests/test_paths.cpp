// Unit tests of core/paths.h's guarded reads and staging files: a device, a FIFO or a directory
// is refused at once (never read, never waited on), a file past the cap is refused, and every
// staging file is new and of its own.
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "core/error.h"
#include "core/paths.h"

namespace fs = std::filesystem;

namespace {

struct Dir {
  fs::path path;
  explicit Dir(const char* tag)
      : path(fs::temp_directory_path() /
             ("fn_paths_" + std::string(tag) + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// The message of the fn::Error(Io) f throws ("" when it does not throw or throws another kind).
template <class F>
std::string io_error(F f) {
  try {
    f();
  } catch (const fn::Error& e) {
    return e.kind() == fn::ErrorKind::Io ? std::string(e.what()) : std::string();
  }
  return {};
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("paths: read_regular_file reads a file whole, within its cap") {
  Dir d("read");
  std::ofstream(d.path / "a.json") << "{\"x\": 1}";
  CHECK(fn::read_regular_file(d.path / "a.json", 8, "") == "{\"x\": 1}");
  CHECK(has(io_error([&] { fn::read_regular_file(d.path / "a.json", 7, "config"); }),
            "config " + (d.path / "a.json").string() +
                ": 8 bytes, more than the 7 bytes such a file may have"));
  CHECK(has(io_error([&] { fn::read_regular_file(d.path / "none.json", 64, ""); }),
            (d.path / "none.json").string() + ": cannot open file (No such file or directory)"));
}

TEST_CASE("paths: read_regular_file refuses devices, FIFOs and directories at once") {
  Dir d("special");
  fs::create_symlink("/dev/zero", d.path / "zero.json");
  fs::create_symlink("/dev/urandom", d.path / "random.json");
  REQUIRE(::mkfifo((d.path / "fifo.json").c_str(), 0600) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(has(io_error([&] { fn::read_regular_file(d.path / "zero.json", 1 << 20, ""); }),
            "zero.json: is not a regular file (a device)"));
  CHECK(has(io_error([&] { fn::read_regular_file(d.path / "random.json", 1 << 20, ""); }),
            "random.json: is not a regular file (a device)"));
  CHECK(has(io_error([&] { fn::read_regular_file(d.path / "fifo.json", 1 << 20, ""); }),
            "fifo.json: is not a regular file (a FIFO)"));
  CHECK(has(io_error([&] { fn::read_regular_file(d.path, 1 << 20, ""); }),
            ": is not a regular file (a directory)"));
  // No writer ever opens the FIFO: a blocking open or read would never return.
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
}

TEST_CASE("paths: create_staging_file makes a new file of its own beside the target each time") {
  Dir d("stage");
  const fs::path target = d.path / "out.fnl";
  std::set<std::string> names;
  for (int i = 0; i < 4; ++i) {
    const fn::StagingFile s = fn::create_staging_file(target);
    CHECK(s.fd >= 0);
    CHECK(s.path.parent_path() == d.path);
    const std::string name = s.path.filename().string();
    CHECK(name.rfind("out.fnl.partial." + std::to_string(::getpid()) + ".", 0) == 0);
    names.insert(name);
    ::close(s.fd);
  }
  CHECK(names.size() == 4);
  // A missing directory: an Io error naming the staging file.
  CHECK(
      has(io_error([&] { fn::create_staging_file(d.path / "no" / "out.fnl"); }),
          "cannot create the staging file " + (d.path / "no" / "out.fnl").string() + ".partial."));
}

TEST_CASE("paths: create_staging_directory makes a new directory of its own each time") {
  Dir d("stage_dir");
  const fs::path target = d.path / "ckpt";
  const fs::path a = fn::create_staging_directory(target);
  const fs::path b = fn::create_staging_directory(target);
  CHECK(a != b);
  for (const fs::path& p : {a, b}) {
    CHECK(fs::is_directory(p));
    CHECK(fs::is_empty(p));
    CHECK(p.filename().string().rfind("ckpt.partial." + std::to_string(::getpid()) + ".", 0) == 0);
  }
  CHECK(has(
      io_error([&] { fn::create_staging_directory(d.path / "no" / "ckpt"); }),
      "cannot create the staging directory " + (d.path / "no" / "ckpt").string() + ".partial."));
}
