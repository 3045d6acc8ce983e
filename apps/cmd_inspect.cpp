// `fngen inspect DIR [--tp N] [--ctx-size T] [--json]`: checkpoint validation and summary, with
// the CUDA backend's device memory per GPU.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "apps/app_util.h"
#include "apps/command.h"
#include "apps/real_number.h"
#include "apps/whole_number.h"
#include "comm/mpi_context.h"
#include "core/error.h"
#include "core/inspect.h"
#include "tokenizer/tokenizer.h"

namespace fn {

void register_inspect(CLI::App& app, CommandList& commands) {
  struct Options {
    std::string dir;
    int tp = 1;
    int64_t ctx_size = 0;
    bool json = false;
    double gpu_gib = static_cast<double>(kInspectDefaultGpuBytes) / (1024.0 * 1024 * 1024);
  };
  auto opt = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "inspect",
      "validate a checkpoint against its config and print its summary, weights per "
      "TP rank, bytes read per decoded token and the CUDA backend's device memory per GPU at "
      "--ctx-size, 8192, 65536 and 262144 tokens, with the n-gram table on the device and in "
      "host memory (--ngram-table), and how many sequences fit --gpu-memory");
  // One option under two names, given exactly once: not ->required(), which --help would print
  // as REQUIRED next to both `dir` and -m/--model although either one suffices. The final
  // callback raises the error ->required() would ("--model is required"); a second value is
  // CLI11's "received 2" ("--model: given 2 times", apps/main.cpp).
  CLI::Option* model =
      sub->add_option("dir,-m,--model", opt->dir,
                      "checkpoint directory, or a config.json alone (its geometry's tables); "
                      "required, once: as the positional argument or with -m/--model");
  sub->callback([model] {
    if (model->count() == 0) throw CLI::RequiredError(model->get_name());
  });
  add_whole_option(sub, "--tp", opt->tp,
                   "tensor-parallel size for the per-rank figures (1, 2, 4, 8)", WholeRange(1, 8));
  add_whole_option(sub, "-c,--ctx-size", opt->ctx_size,
                   "context length (tokens) for bytes per token and a column of the device-memory "
                   "table (default, or 0: min(8192, max_position_embeddings))",
                   WholeRange(0, kMaxTokenCount));
  add_real_option(sub, "--gpu-memory", opt->gpu_gib,
                  "GiB of device memory per GPU for the table of how many sequences of each "
                  "context fit, with the n-gram table on the device and in host memory "
                  "(--ngram-table); > 0 (default: an H100 80 GB's total, rounded down)")
      ->capture_default_str();
  sub->add_flag("--json", opt->json, "print JSON instead of tables");
  commands.push_back({sub, [opt](MpiContext& mpi) {
                        FN_REQUIRE(opt->gpu_gib > 0 && opt->gpu_gib < 1e9, Usage,
                                   "--gpu-memory must be in (0, 1e9) GiB, got {}", opt->gpu_gib);
                        InspectReport report = inspect_checkpoint(opt->dir, opt->tp, opt->ctx_size);
                        report.gpu_bytes =
                            static_cast<uint64_t>(opt->gpu_gib * 1024.0 * 1024 * 1024);
                        // The tokenizer is part of the checkpoint: one with ids past the
                        // model's rows fails validation (fn::Error(Format)).
                        std::error_code ec;
                        if (std::filesystem::is_directory(opt->dir, ec) && has_tokenizer(opt->dir))
                          (void)load_model_tokenizer(opt->dir, report.config.vocab_size);
                        if (mpi.world_rank() == 0) {
                          const std::string text = opt->json ? inspect_json(report).dump(2) + "\n"
                                                             : format_inspect_text(report);
                          std::fwrite(text.data(), 1, text.size(), stdout);
                        }
                        return 0;
                      }});
}

}  // namespace fn
