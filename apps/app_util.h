// Small helpers the fngen subcommands share: whole-file reads with a flag-naming error, unbuffered
// result output on stdout, and whether a model directory carries a tokenizer.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace fn {

/// The whole file as bytes. Throws fn::Error(Io) "<flag> <path>: cannot open the file".
std::string read_file(const std::string& path, const char* flag);

/// Writes `s` to stdout and flushes (results only: text, tables, JSON).
void write_stdout(std::string_view s);

/// One JSONL record. Throws fn::Error(Format) "not valid JSON (<parser message>)"; callers put it
/// into that record's "error" field.
nlohmann::json parse_json_line(const std::string& line);

/// The backend/TP flags every model-running subcommand shares: --backend must be cpu, cuda or
/// auto, and --tp (0 = unset) must equal the MPI world size; fn::Error(Usage) naming the flag
/// otherwise. Whether CUDA is usable is decided by resolve_backend (apps/backend.h).
void check_backend_and_tp(const std::string& backend, int64_t tp, int world_size);

/// True when `dir` holds tokenizer.json or tokenizer.model.
bool has_tokenizer(const std::filesystem::path& dir);

}  // namespace fn
