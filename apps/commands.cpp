// The list of fngen subcommands. Each register_<name> lives in apps/cmd_<name>.cpp.
#include "apps/command.h"

namespace fn {

void register_commands(CLI::App& app, CommandList& commands) {
  register_inspect(app, commands);
  register_synth(app, commands);
  register_generate(app, commands);
  register_tokenize(app, commands);
  register_eval(app, commands);
  register_bench(app, commands);
}

}  // namespace fn
