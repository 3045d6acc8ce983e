#include "apps/app_util.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace fn {

std::string read_file(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  FN_REQUIRE(in.good(), Io, "{} {}: cannot open the file", flag, path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_stdout(std::string_view s) {
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

nlohmann::json parse_json_line(const std::string& line) {
  try {
    return nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    FN_THROW(Format, "not valid JSON ({})", e.what());
  }
}

void check_backend_and_tp(const std::string& backend, int64_t tp, int world_size) {
  FN_REQUIRE(backend == "cpu" || backend == "cuda" || backend == "auto", Usage,
             "--backend {}: not one of cpu, cuda, auto", backend);
  FN_REQUIRE(tp == 0 || tp == world_size, Usage,
             "--tp {} must equal the number of MPI ranks ({}): the TP size is the world size", tp,
             world_size);
}

bool has_tokenizer(const std::filesystem::path& dir) {
  return std::filesystem::exists(dir / "tokenizer.json") ||
         std::filesystem::exists(dir / "tokenizer.model");
}

}  // namespace fn
