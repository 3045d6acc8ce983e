// Small helpers the fngen subcommands share: whole-file reads with a flag-naming error, unbuffered
// result output on stdout, and whether a model directory carries a tokenizer.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/collectives.h"
#include "core/error.h"
#include "core/paths.h"  // resolve_output_path

namespace fn {

class Tokenizer;

/// Largest input file read_file accepts (prompts, JSONL batches, token-id and task files).
inline constexpr std::size_t kMaxInputFileBytes = std::size_t{1} << 30;

/// The whole file as bytes. Throws fn::Error(Io) "<flag> <path>: cannot open the file (reason)",
/// for a directory, and for a file (or device such as /dev/zero) longer than kMaxInputFileBytes.
std::string read_file(const std::string& path, const char* flag);

/// All of standard input as bytes, read as read_file reads a file: fn::Error(Io) "standard
/// input: larger than 1 GiB ..." once more than kMaxInputFileBytes arrive (`< /dev/zero` stops
/// there instead of filling memory), "standard input: read failed (reason)" on a read error.
std::string read_stdin();

/// Checks that `path` (the value of -m/--model) is a directory, so that a config.json given in
/// its place is named as such instead of failing later on "<file>/config.json". Throws
/// fn::Error(Io) when it does not exist, fn::Error(Usage) when it is a file.
void require_model_dir(const std::string& path);

/// True when `a` and `b` name one file: the same text, the same resolve_output_path (symlinks,
/// "..", a dangling link to the other), or two existing names of one file (a hard link:
/// std::filesystem::equivalent). An empty path is never the same file.
bool same_file(const std::string& a, const std::string& b);

/// Refuses an output file (`flag` PATH) that would land in the model directory `model_dir` or
/// below it (after resolve_output_path, so a symlink into it counts), or that is a hard link of
/// one of its files: writing it could overwrite the checkpoint's own files (config.json, a
/// shard). Throws fn::Error(Usage) naming both, the directory as `what` ("model directory",
/// "tokenizer directory"). An empty `path` passes.
void require_outside_model(const std::string& path, const std::string& model_dir, const char* flag,
                           const char* what = "model directory");

/// The chat options a command was given, to refuse those that would do nothing.
struct ChatFlagsGiven {
  bool system_prompt = false, think = false, no_think = false, chat_template = false;
};

/// Refuses chat options without a chat prompt: --system-prompt, --think, --no-think and
/// --chat-template apply only with --chat or to a -i batch (whose "messages" records are chats);
/// `chat_prompt` says whether either is given. Throws fn::Error(Usage) naming the first flag.
void require_chat_prompt(const ChatFlagsGiven& given, bool chat_prompt);

/// Refuses a --system-prompt that is not valid UTF-8, naming that flag (the encode would blame
/// the prompt): fn::Error(Format) "invalid UTF-8 in --system-prompt at byte offset N", exit 3
/// as for a prompt. The empty string passes.
void require_utf8_system_prompt(const std::string& system_prompt);

/// Refuses an output file (`out_flag` OUT) that is the input file (`in_flag` IN) under another
/// name (same_file): writing the results would destroy the input before it is read. Throws
/// fn::Error(Usage) naming both. Empty paths pass.
void require_not_input(const std::string& out, const char* out_flag, const std::string& in,
                       const char* in_flag);

/// Checks, without truncating anything, that the output file `path` can be written: it is not a
/// directory, the directory it lands in exists, and the file (when it exists) or the directory is
/// writable; a file that does not exist yet is created and removed again (a file that existed is
/// never removed), so that a name the file system refuses (/proc/x) fails here. Run before a
/// model load so that a bad path fails fast; the file itself is opened only when results are
/// ready. With `staged_writer` (LogitsWriter) the writer writes a staging file beside the file
/// and renames it onto the file (where the file is regular or not there yet; a device is written
/// in place): then the file must be seekable (a pipe, socket or terminal is fn::Error(Usage)),
/// and a staging file is created and removed through the writer's own create_staging_file
/// (core/paths.h), so that a directory refusing it, even where the file exists, or a staging name
/// past NAME_MAX, fails here. Throws fn::Error(Io) "<flag> <path>: ...".
void check_output_path(const std::string& path, const char* flag, bool staged_writer = false);

/// The lines of a JSONL input file (read_file, split at '\n'; blank lines kept so that line
/// numbers in messages match the file). Throws what read_file throws, and fn::Error(Format)
/// "<flag> <path>: no records" when no line holds anything but white space.
std::vector<std::string> read_jsonl_lines(const std::string& path, const char* flag);

/// Writes `s` to stdout and flushes (results only: text, tables, JSON). Throws fn::Error(Io)
/// "cannot write to standard output" when the write or the flush fails (a full disk, /dev/full,
/// a closed pipe with SIGPIPE ignored).
void write_stdout(std::string_view s);

/// Writes the JSONL line `make()` (one complete JSON text and its newline, e.g. batch_records.h
/// record_line: a record whose "id" is echoed as written) to `out` on rank 0 of `coll` and
/// flushes it (a batch's output file, or stdout), agreed on (agree_on_error,
/// core/collectives.h): every rank calls it for every record, and a write that fails on rank 0
/// (-o /dev/full, a full disk) ends every rank with rank 0's error instead of MPI_Abort. `make`
/// runs on rank 0 only. Throws fn::Error(Io) "cannot write to standard output (<reason>)" or
/// "-o/--output <path>: cannot write (<reason>)" on every rank when the write or the flush fails.
void write_jsonl_line_agreed(Collectives& coll, std::FILE* out,
                             const std::function<std::string()>& make, const std::string& path);

/// Flushes stdout (C stdio and std::cout) and throws fn::Error(Io) "cannot write to standard
/// output" when any earlier write to it failed. main() runs it after every command.
void check_stdout();

/// Runs `f` (tokenizing text from one source) and returns its result; a Format error it throws
/// (the tokenizer's "invalid UTF-8 in text to encode at byte offset N") is restated as
/// fn::Error(Format) "<source>: <message>", e.g. "-f/--file notes.txt: invalid UTF-8 ...".
template <class F>
auto with_text_source(const std::string& source, F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Format) throw;
    FN_THROW(Format, "{}: {}", source, e.what());
  }
}

/// Nesting depth of a JSONL record's values above which parse_json_line refuses the record.
inline constexpr int kMaxJsonDepth = 128;

/// One JSONL record. Throws fn::Error(Format) "not valid JSON (<parser message>)", with invalid
/// UTF-8 in the message replaced by U+FFFD, "a value nested deeper than 128 levels"
/// (kMaxJsonDepth; such a value could not be written back), "duplicate key \"<key>\" (...)" for
/// a key given twice in one object, at any depth (the parser alone keeps the last value), or "a
/// JSON value fngen cannot read (...)" for valid JSON past the parser's types (a number beyond a
/// double, 1e400); callers put it into that record's "error" field, after its line number.
nlohmann::json parse_json_line(const std::string& line);

/// Warns (rank-local FN_LOG_WARN, once per field name: `warned` keeps the names said) about the
/// fields of JSONL record `rec` (an object) that `command` ignores: its own keys for which
/// `reads(key)` is false, "<input>: line <line>: field \"<key>\" is not one fngen <command>
/// reads; ...", and the fields of its "messages" entries that chat_messages_from_json does not
/// read (unknown_chat_message_fields, tokenizer/chat.h), "... field \"<key>\" of
/// \"messages\"[<i>] is not one ...". `line` is 1-based. Throws nothing of its own.
void warn_unknown_record_fields(const nlohmann::json& rec,
                                const std::function<bool(const std::string&)>& reads,
                                std::set<std::string>& warned, const std::string& input,
                                std::size_t line, std::string_view command);

/// The backend/TP flags every model-running subcommand shares: --backend must be cpu, cuda or
/// auto, and --tp (0 = unset) must equal the MPI world size; fn::Error(Usage) naming the flag
/// otherwise. Whether CUDA is usable is decided by resolve_backend (apps/backend.h).
void check_backend_and_tp(const std::string& backend, int64_t tp, int world_size);

/// The model's source of a command that also runs on random weights (bench, eval, generate):
/// exactly one of -m/--model (`model`) and --random-weights (`random_weights`), the latter with
/// --config (`config`, a file, not a directory), which nothing else takes. Throws
/// fn::Error(Usage) naming the flags.
void check_model_source(const std::string& model, bool random_weights, const std::string& config);

/// True when `dir` holds tokenizer.json or tokenizer.model.
bool has_tokenizer(const std::filesystem::path& dir);

/// Where a command's tokenizer comes from, for messages: "the model directory DIR", or
/// "--random-weights without --tokenizer DIR" when `dir` is empty (no tokenizer directory given).
std::string tokenizer_source(const std::filesystem::path& dir);

/// A prompt text many times a token limit is refused from a prefix before all of it is encoded (a
/// 300 MB file took minutes and GBs to encode before the length check). The prefix is the first
/// 32 * limit bytes cut after a whitespace byte in its second half, so that only the pre-tokens
/// at the cut can encode differently from the whole text (16 tokens of slack cover them); a text
/// of any other shape returns, for the caller to encode whole and check. Throws
/// fn::Error(Format) "<what>: the prompt (B bytes) exceeds <limit_name>: its first C bytes alone
/// encode to N tokens, more than <limit>" when the prefix encodes to more than limit + 16 tokens
/// (a prompt the context cannot hold is bad input, exit 3); a Format error of the tokenizer
/// (invalid UTF-8 in the prefix) is restated with `what` (with_text_source), so callers call it
/// outside their own with_text_source.
void refuse_long_text(const Tokenizer& tok, std::string_view text, int64_t limit,
                      const std::string& what, const std::string& limit_name);

}  // namespace fn
