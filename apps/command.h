// The fngen subcommand registry: each apps/cmd_<name>.cpp adds one CLI11 subcommand and the
// function that runs it. main() parses, then runs the chosen command inside the error funnel.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace fn {

class MpiContext;

/// One subcommand: its CLI11 node and what runs when it is chosen; each returns the exit code.
/// Exactly one of run and run_alone is set.
struct Command {
  CLI::App* app = nullptr;
  /// Runs on every rank after MPI_Init (single-rank work checks world_rank() itself).
  std::function<int(MpiContext&)> run;
  /// A single-process tool: runs without MPI on launcher rank 0 (OMPI_COMM_WORLD_RANK etc.);
  /// the other ranks of an mpirun job return 0 at once. Its errors exit without MPI_Abort.
  std::function<int()> run_alone{};
};

using CommandList = std::vector<Command>;

/// The check of every output-path option (->check(non_empty_path())): an empty value (`-o ""`)
/// is a usage error at parse time, "<option>: an empty path; give a file name", before any model
/// is loaded.
const CLI::Validator& non_empty_path();

/// Adds the option `names` (e.g. "-o,--output") to `sub` for an output file whose default is
/// standard output (`path` empty): "-" then names standard output too, as in most command-line
/// tools (the value is cleared once the subcommand is parsed); an empty value is refused
/// (non_empty_path). One per subcommand: it takes the subcommand's parse-complete callback.
/// Returns the option for further checks.
CLI::Option* add_stdout_option(CLI::App* sub, const std::string& names, std::string& path,
                               const std::string& help);

/// Adds every subcommand (apps/commands.cpp lists them).
void register_commands(CLI::App& app, CommandList& commands);

// One per apps/cmd_<name>.cpp: adds the subcommand to `app` and its entry to `commands`.
void register_inspect(CLI::App& app, CommandList& commands);
void register_synth(CLI::App& app, CommandList& commands);
void register_generate(CLI::App& app, CommandList& commands);
void register_tokenize(CLI::App& app, CommandList& commands);
void register_eval(CLI::App& app, CommandList& commands);
void register_bench(CLI::App& app, CommandList& commands);

}  // namespace fn
