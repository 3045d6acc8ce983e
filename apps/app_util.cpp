#include "apps/app_util.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <system_error>
#include <vector>

#include "core/error.h"

namespace fn {

std::string read_file(const std::string& path, const char* flag) {
  std::error_code ec;
  FN_REQUIRE(!std::filesystem::is_directory(path, ec), Io, "{} {}: is a directory, not a file",
             flag, path);
  std::ifstream in(path, std::ios::binary);
  FN_REQUIRE(in.good(), Io, "{} {}: cannot open the file", flag, path);
  std::string out;
  std::vector<char> buf(std::size_t{1} << 20);
  while (in.read(buf.data(), static_cast<std::streamsize>(buf.size())) || in.gcount() > 0) {
    out.append(buf.data(), static_cast<std::size_t>(in.gcount()));
    FN_REQUIRE(out.size() <= kMaxInputFileBytes, Io,
               "{} {}: larger than {} GiB (input files are read whole; is it the right file?)",
               flag, path, kMaxInputFileBytes >> 30);
  }
  return out;
}

void require_model_dir(const std::string& path) {
  std::error_code ec;
  FN_REQUIRE(std::filesystem::exists(path, ec), Io, "-m/--model {}: no such directory", path);
  FN_REQUIRE(std::filesystem::is_directory(path, ec), Usage,
             "-m/--model {}: is a file; give the model directory (the one holding config.json and "
             "the safetensors files)",
             path);
}

void require_outside_model(const std::string& path, const std::string& model_dir,
                           const char* flag) {
  if (path.empty()) return;
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::weakly_canonical(model_dir, ec);
  const std::filesystem::path parent =
      std::filesystem::weakly_canonical(std::filesystem::absolute(path, ec).parent_path(), ec);
  FN_REQUIRE(ec || parent != dir, Usage,
             "{} {}: inside the model directory {}; write it elsewhere (it could replace the "
             "checkpoint's own files)",
             flag, path, model_dir);
}

std::vector<std::string> read_jsonl_lines(const std::string& path, const char* flag) {
  std::istringstream in(read_file(path, flag));
  std::vector<std::string> lines;
  bool any = false;
  for (std::string line; std::getline(in, line);) {
    any = any || line.find_first_not_of(" \t\r") != std::string::npos;
    lines.push_back(std::move(line));
  }
  FN_REQUIRE(any, Format, "{} {}: no records (the file has no non-blank line)", flag, path);
  return lines;
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
