// `fngen synth --config FILE --out DIR [--seed S] [--layers N] [--ngram-vocab-base B]
//  [--tokenizer DIR]`: writes a random-weight checkpoint in the real NVFP4 export layout.
#include <algorithm>
#include <limits>
#include <memory>

#include "apps/command.h"
#include "apps/whole_number.h"
#include "comm/mpi_collectives.h"
#include "comm/mpi_context.h"
#include "core/error.h"
#include "core/log.h"
#include "core/synth.h"

namespace fn {

void register_synth(CLI::App& app, CommandList& commands) {
  struct Options {
    std::string config, out, tokenizer;
    uint64_t seed = 0;
    int64_t layers = 0;
    int64_t ngram_vocab_base = 0;
  };
  auto opt = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "synth", "write a random-weight checkpoint of a config's geometry in the real NVFP4 layout");
  sub->add_option("--config", opt->config, "config.json to synthesize (configs/*.json)")
      ->required();
  sub->add_option("-o,--out", opt->out, "output directory (absent or empty)")
      ->required()
      ->check(non_empty_path());
  add_whole_option(sub, "--seed", opt->seed, "random seed (default 0)",
                   WholeRange(0, std::numeric_limits<uint64_t>::max()));
  add_whole_option(sub, "--layers", opt->layers,
                   "keep only the first N decoder layers (real widths; 0 keeps all)", {});
  add_whole_option(sub, "--ngram-vocab-base", opt->ngram_vocab_base,
                   "override ngram_vocab_size_base (shrinks the n-gram table; 0 keeps the "
                   "config's)",
                   {});
  sub->add_option("--tokenizer", opt->tokenizer,
                  "directory whose tokenizer.json/tokenizer_config.json are copied in");
  commands.push_back({sub, [opt](MpiContext& mpi) {
                        // Every rank sees the same world size: agreed on, so rank 0 alone
                        // prints it and every rank ends normally.
                        MpiCollectives coll(mpi.world());
                        agree_on_error(coll, [&] {
                          FN_REQUIRE(mpi.world_size() == 1, Usage,
                                     "fngen synth runs as one process (got {} ranks)",
                                     mpi.world_size());
                        });
                        SynthOptions o;
                        o.config = opt->config;
                        o.out = opt->out;
                        o.seed = opt->seed;
                        o.layers = opt->layers;
                        o.ngram_vocab_base = opt->ngram_vocab_base;
                        if (!opt->tokenizer.empty()) o.tokenizer_dir = opt->tokenizer;
                        const SynthResult r = synth_checkpoint(o);
                        FN_LOG_INFO(
                            "synth: wrote {} tensors in {} files, {:.1f} MB in {:.2f} s "
                            "({:.0f} MB/s) to {}",
                            r.tensors, r.files, r.bytes / 1e6, r.seconds,
                            r.bytes / 1e6 / std::max(r.seconds, 1e-9), opt->out);
                        return 0;
                      }});
}

}  // namespace fn
