// fngen entry point: CLI11 parsing, MPI start-up and the one error funnel of the process
// (docs/design.md "Decisions", errors): an fn::Error is logged once with the rank prefix and every
// rank ends with the exit code of its kind (MPI_Abort when several ranks run).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <new>
#include <regex>
#include <string>
#include <thread>

#include "apps/app_util.h"
#include "apps/command.h"
#include "apps/real_number.h"
#include "comm/mpi_context.h"
#include "core/collectives.h"
#include "core/error.h"
#include "core/log.h"

namespace {

// The launcher's rank before MPI_Init (so that only rank 0 prints usage errors).
int launcher_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}) {
    if (const char* v = std::getenv(var)) return std::atoi(v);
  }
  return 0;
}

// The launcher's number of ranks (1 without one).
int launcher_size() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const char* v = std::getenv(var)) return std::max(1, std::atoi(v));
  }
  return 1;
}

}  // namespace

namespace {
// Most bad input fails on every rank alike. Ranks other than 0 give rank 0 a moment to print the
// message and abort the job (which ends them here, silently); only an error that rank 0 did not
// hit is then printed by the rank that did. One message instead of one per rank, and no
// simultaneous MPI_Abort calls (Open MPI garbles its own help output when they race). An error
// every rank is known to share (Error::on_every_rank(), after agree_on_error) does not come here:
// rank 0 prints it and every rank ends normally with its exit code.
// Before MPI_Init (mpi null: a usage error of the command line, which every rank hits alike)
// the launcher's rank and size decide: a quiet rank that exited at once could make mpirun end the
// job before rank 0 had printed its message.
void wait_for_rank0_abort(const fn::MpiContext* mpi) {
  const int rank = mpi ? mpi->world_rank() : launcher_rank();
  const int size = mpi ? mpi->world_size() : launcher_size();
  if (rank != 0 && size > 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fngen: tensor-parallel NVFP4 decode for Qwen3.8-Flash-Next (qwen4_exp).\n"
      "Run multi-rank commands as: mpirun -np N fngen <command> ..."};
  // At most one subcommand; "none given" is checked after parsing so that an unknown flag is
  // reported by name first.
  app.require_subcommand(0, 1);
  app.set_version_flag("--version", "fngen 0.1.0");
  std::string log_level;  // empty: $FN_LOG_LEVEL, else info
  bool log_all_ranks = false;
  app.add_option("--log-level", log_level,
                 "error|warn|info|debug|trace (default: env FN_LOG_LEVEL, else info)")
      ->check(CLI::IsMember({"error", "warn", "info", "debug", "trace"}));
  app.add_flag("--log-all-ranks", log_all_ranks, "print INFO messages of every rank");
  double stall_timeout = fn::kDefaultStallTimeoutSeconds;
  fn::add_real_option(&app, "--stall-timeout", stall_timeout,
                      "seconds a rank waits for a silent peer in a collective before every rank "
                      "ends (exit 5) naming it (default 300, at most 1e6; 0: wait forever)")
      ->check(CLI::Validator(
          [](std::string& s) {
            const double v = std::strtod(s.c_str(), nullptr);
            return v >= 0 && v <= fn::kMaxStallTimeoutSeconds
                       ? std::string()
                       : "a number of seconds in [0, 1e6] (0: no bound), not " + s;
          },
          "SECONDS"));
  // Parse errors in the form of the other usage errors ("fngen: usage error: ..."), and CLI11's
  // "OPT: 1 required TEXT missing" (an option given without its value) and "OPT: At Most 1
  // required but received N" (a single-value option given N times) said plainly.
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    std::string msg = e.what();
    static const std::regex missing(R"(^(\S+): \d+ required \S+ missing$)");
    static const std::regex repeated(R"(^(\S+): At Most 1 required but received (\d+)$)");
    std::smatch m;
    if (std::regex_match(msg, m, missing)) msg = m[1].str() + ": needs a value";
    if (std::regex_match(msg, m, repeated))
      msg = m[1].str() + ": given " + m[2].str() + " times; give it once";
    // The arguments are quoted as typed: escaped, so that they cannot put control bytes on stderr.
    return "fngen: usage error: " + fn::escape_for_log(msg) +
           "\nRun with --help for more information.\n";
  });

  fn::CommandList commands;
  fn::register_commands(app, commands);

  // CLI11 reports an unknown subcommand as "arguments were not expected" listing the rest of the
  // line; say what it is instead.
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--log-level" || a == "--stall-timeout") {
      ++i;
      continue;
    }
    if (a.empty() || a[0] == '-') continue;
    CLI::App* known = nullptr;
    for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
      if (sub->get_name() == a) known = sub;
    std::string unknown = known ? "" : a;
    // A command with its own subcommands (eval ppl|kld|...): check the word right after it.
    const std::vector<CLI::App*> nested =
        known ? known->get_subcommands([](CLI::App*) { return true; }) : std::vector<CLI::App*>{};
    if (!nested.empty() && i + 1 < argc && argv[i + 1][0] != '-' && argv[i + 1][0] != '\0') {
      const std::string b = argv[i + 1];
      bool found = false;
      for (const CLI::App* sub : nested) found = found || sub->get_name() == b;
      if (!found) unknown = a + " " + b;
    }
    if (!unknown.empty()) {
      if (launcher_rank() == 0)
        std::cerr << "fngen: unknown subcommand '" << unknown << "' (see fngen "
                  << (known ? a + " " : std::string()) << "--help)\n";
      wait_for_rank0_abort(nullptr);
      return fn::exit_code(fn::ErrorKind::Usage);
    }
    break;
  }

  try {
    app.parse(argc, argv);
    if (app.get_subcommands().empty()) {
      throw CLI::RequiredError("A subcommand (inspect, synth, ...; see --help)");
    }
  } catch (const CLI::ParseError& e) {
    const bool quiet = launcher_rank() != 0;
    if (e.get_exit_code() == 0) {
      if (!quiet) app.exit(e);
      return 0;
    }
    if (!quiet) app.exit(e, std::cout, std::cerr);
    wait_for_rank0_abort(nullptr);
    return fn::exit_code(fn::ErrorKind::Usage);
  }
  if (log_level.empty()) {
    const char* env = std::getenv("FN_LOG_LEVEL");
    log_level = env != nullptr && env[0] != '\0' ? env : "info";
    try {
      fn::parse_log_level(log_level);
    } catch (const fn::Error& e) {
      if (launcher_rank() == 0) std::cerr << "fngen: FN_LOG_LEVEL: " << e.what() << "\n";
      wait_for_rank0_abort(nullptr);
      return fn::exit_code(fn::ErrorKind::Usage);
    }
  }

  int code = 0;
  // Not destroyed on the error path: MPI_Finalize on one failing rank could wait for the others.
  std::unique_ptr<fn::MpiContext> mpi;
  try {
    fn::set_log_level(fn::parse_log_level(log_level));
    fn::set_log_all_ranks(log_all_ranks);
    fn::set_stall_timeout(stall_timeout);
    const fn::Command* chosen = nullptr;
    for (const auto& cmd : commands) {
      if (cmd.app->parsed()) chosen = &cmd;
    }
    if (chosen->run_alone) {
      fn::set_log_rank(launcher_rank(), launcher_size());  // no MPI_Init to set it
      code = launcher_rank() == 0 ? chosen->run_alone() : 0;
    } else {
      mpi = std::make_unique<fn::MpiContext>(&argc, &argv);
      code = chosen->run(*mpi);
    }
    // Results that did not reach stdout (a full disk, `> /dev/full`) are a failed run.
    fn::check_stdout();
    mpi.reset();
    return code;
  } catch (const fn::Error& e) {
    code = fn::exit_code(e.kind());
    if (e.on_every_rank() && mpi) {
      // Every rank stands at the same point with the same error: rank 0 prints it and all leave
      // MPI normally (no MPI_Abort, whose help text Open MPI garbles when it races the exit).
      if (mpi->world_rank() == 0) {
        FN_LOG_ERROR("{} error: {}", fn::error_kind_name(e.kind()), e.what());
        FN_LOG_DEBUG("raised at {}", e.where());
      }
      mpi.reset();
      return code;
    }
    wait_for_rank0_abort(mpi.get());
    FN_LOG_ERROR("{} error: {}", fn::error_kind_name(e.kind()), e.what());
    FN_LOG_DEBUG("raised at {}", e.where());
  } catch (const std::bad_alloc&) {
    wait_for_rank0_abort(mpi.get());
    FN_LOG_ERROR(
        "out of host memory (std::bad_alloc): a size in the input (config.json, a tensor shape, "
        "a flag) may be more than this machine can hold");
    code = 1;
  } catch (const std::filesystem::filesystem_error& e) {
    // A path the file system refuses where no check of ours looked first (a symlink loop as
    // `inspect DIR` or `synth --out`): input, not an internal error. e.what() names the path.
    wait_for_rank0_abort(mpi.get());
    FN_LOG_ERROR("io error: {}", e.what());
    code = fn::exit_code(fn::ErrorKind::Io);
  } catch (const std::exception& e) {
    wait_for_rank0_abort(mpi.get());
    FN_LOG_ERROR("internal error: {}", e.what());
    code = 1;
  }
  mpi.release();  // abort_all ends the process; MPI_Finalize must not run first
  fn::MpiContext::abort_all(code);
}
