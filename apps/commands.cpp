// The list of fngen subcommands. Each register_<name> lives in apps/cmd_<name>.cpp.
#include "apps/command.h"

namespace fn {

const CLI::Validator& non_empty_path() {
  static const CLI::Validator check(
      [](std::string& value) {
        return value.empty() ? std::string("an empty path; give a file name") : std::string();
      },
      "");
  return check;
}

CLI::Option* add_stdout_option(CLI::App* sub, const std::string& names, std::string& path,
                               const std::string& help) {
  std::string* target = &path;
  sub->parse_complete_callback([target] {
    if (*target == "-") target->clear();
  });
  return sub->add_option(names, path, help + " (default, or '-': standard output)")
      ->check(non_empty_path());
}

void register_commands(CLI::App& app, CommandList& commands) {
  register_inspect(app, commands);
  register_synth(app, commands);
  register_generate(app, commands);
  register_tokenize(app, commands);
  register_eval(app, commands);
  register_bench(app, commands);
}

}  // namespace fn
