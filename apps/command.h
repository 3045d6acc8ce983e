// The fngen subcommand registry: each apps/cmd_<name>.cpp adds one CLI11 subcommand and the
// function that runs it. main() parses, then runs the chosen command inside the error funnel.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace fn {

class MpiContext;

/// One subcommand: its CLI11 node and what runs when it is chosen. run returns the exit code.
struct Command {
  CLI::App* app = nullptr;
  std::function<int(MpiContext&)> run;
};

using CommandList = std::vector<Command>;

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
