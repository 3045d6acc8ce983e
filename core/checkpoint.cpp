#include "core/checkpoint.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/paths.h"

namespace fn {
namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

}  // namespace

Checkpoint Checkpoint::open(const std::filesystem::path& dir) {
  Checkpoint ck;
  ck.dir_ = dir;
  std::error_code ec;
  FN_REQUIRE(std::filesystem::is_directory(dir, ec), Io, "checkpoint '{}' is not a directory",
             dir.string());

  const std::filesystem::path index_path = dir / kIndexName;
  std::vector<std::string> file_names;
  // tensor name -> file name, as the index states it
  std::map<std::string, std::string, std::less<>> weight_map;
  std::set<std::string> seen_files;
  const bool have_index = std::filesystem::exists(index_path, ec);
  if (have_index) {
    const std::string text =
        read_regular_file(index_path, kMaxCheckpointJsonBytes, "checkpoint index");
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      FN_THROW(Format, "checkpoint index '{}' is not valid JSON: {}", index_path.string(),
               e.what());
    }
    FN_REQUIRE(index.is_object(), Format, "checkpoint index '{}' is a JSON {}, not an object",
               index_path.string(), index.type_name());
    if (const auto md = index.find("metadata"); md != index.end() && !md->is_null()) {
      FN_REQUIRE(md->is_object(), Format,
                 "checkpoint index '{}': metadata is a JSON {}, not an object", index_path.string(),
                 md->type_name());
      ck.index_metadata_json_ = md->dump();
    }
    const auto wm = index.find("weight_map");
    FN_REQUIRE(wm != index.end(), Format, "checkpoint index '{}' has no weight_map",
               index_path.string());
    FN_REQUIRE(wm->is_object(), Format,
               "checkpoint index '{}': weight_map is a JSON {}, not an object", index_path.string(),
               wm->type_name());
    for (const auto& [name, file] : wm->items()) {
      FN_REQUIRE(file.is_string(), Format,
                 "checkpoint index '{}': weight_map entry '{}' is a JSON {}, not a file name",
                 index_path.string(), name, file.type_name());
      const std::string& fname = file.get_ref<const std::string&>();
      FN_REQUIRE(!fname.empty() && fname.find('/') == std::string::npos &&
                     fname.find('\0') == std::string::npos && fname != "." && fname != "..",
                 Format, "checkpoint index '{}': tensor '{}' names file '{}', not a file name",
                 index_path.string(), name, fname);
      if (seen_files.insert(fname).second) file_names.push_back(fname);
      weight_map.emplace(name, fname);
    }
    for (const std::string& fname : file_names) {
      // The message's exists() runs only on failure (FN_REQUIRE formats lazily).
      FN_REQUIRE(
          std::filesystem::is_regular_file(dir / fname, ec), Io,
          "checkpoint index '{}' names file '{}', which {} in '{}'", index_path.string(), fname,
          std::filesystem::exists(dir / fname, ec) ? "is not a regular file" : "does not exist",
          dir.string());
    }
  } else if (std::filesystem::exists(dir / kSingleName, ec)) {
    file_names.push_back(kSingleName);
  } else {
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().extension() == ".safetensors") {
        file_names.push_back(entry.path().filename().string());
      }
    }
    std::sort(file_names.begin(), file_names.end());
    FN_REQUIRE(!file_names.empty(), Io,
               "checkpoint '{}' has no {}, no {} and no *.safetensors file", dir.string(),
               kIndexName, kSingleName);
  }

  for (const std::string& fname : file_names) {
    ck.files_.push_back(SafetensorsFile::open(dir / fname));
  }
  for (std::size_t fi = 0; fi < ck.files_.size(); ++fi) {
    const SafetensorsFile& f = ck.files_[fi];
    for (const TensorInfo& t : f.tensors()) {
      const auto [it, inserted] = ck.tensors_.emplace(t.name, Location{fi, &t});
      FN_REQUIRE(inserted, Format, "checkpoint '{}': tensor '{}' is in two files, '{}' and '{}'",
                 dir.string(), t.name, ck.files_[it->second.file].path().filename().string(),
                 f.path().filename().string());
      ck.total_bytes_ += t.nbytes();
    }
  }
  if (have_index) {
    for (const auto& [name, loc] : ck.tensors_) {
      const std::string fname = ck.files_[loc.file].path().filename().string();
      const auto it = weight_map.find(name);
      FN_REQUIRE(it != weight_map.end(), Format,
                 "checkpoint '{}': tensor '{}' of file '{}' is missing from the index '{}'",
                 dir.string(), name, fname, index_path.string());
      FN_REQUIRE(it->second == fname, Format,
                 "checkpoint '{}': the index places tensor '{}' in '{}' but it is in '{}'",
                 dir.string(), name, it->second, fname);
    }
    for (const auto& [name, fname] : weight_map) {
      FN_REQUIRE(ck.tensors_.count(name), Format,
                 "checkpoint '{}': the index places tensor '{}' in '{}', which does not hold it",
                 dir.string(), name, fname);
    }
  }
  return ck;
}

const Checkpoint::Location& Checkpoint::locate(std::string_view name) const {
  const auto it = tensors_.find(name);
  FN_REQUIRE(it != tensors_.end(), Format, "checkpoint '{}' has no tensor '{}'", dir_.string(),
             name);
  return it->second;
}

const TensorInfo* Checkpoint::find(std::string_view name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second.info;
}

const SafetensorsFile& Checkpoint::file_of(std::string_view name) const {
  return files_[locate(name).file];
}

const TensorInfo& Checkpoint::info(std::string_view name) const {
  return *locate(name).info;
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, loc] : tensors_) names.push_back(name);
  return names;
}

void Checkpoint::read_rows(std::string_view name, int64_t row_begin, int64_t row_count,
                           void* dst) const {
  const Location& l = locate(name);
  files_[l.file].read_rows(*l.info, row_begin, row_count, dst);
}

void Checkpoint::read_block(std::string_view name, int64_t row_begin, int64_t row_count,
                            int64_t col_begin, int64_t col_count, void* dst) const {
  const Location& l = locate(name);
  files_[l.file].read_block(*l.info, row_begin, row_count, col_begin, col_count, dst);
}

void Checkpoint::read_index0(std::string_view name, int64_t i, void* dst) const {
  const Location& l = locate(name);
  files_[l.file].read_index0(*l.info, i, dst);
}

void Checkpoint::read_all(std::string_view name, void* dst) const {
  const Location& l = locate(name);
  files_[l.file].read_all(*l.info, dst);
}

}  // namespace fn
