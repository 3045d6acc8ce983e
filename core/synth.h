// Random-weight checkpoints in the real RadixArk NVFP4 export layout (docs/model.md §B), for tests,
// the demo and benchmarks: `fngen synth`. Every tensor of expected_tensors() is written with the
// dtype and shape a real export has, spread over the same kinds of shard files, with an index,
// config.json, hf_quant_config.json and generation_config.json.
//
// How the weights are drawn, so that activations stay in a sane range through every layer:
// every value is uniform in [-a, a] with a = sqrt(3)·σ (variance σ²), and
//  - a BF16 linear [out, in] has σ = 1/sqrt(in), so a unit-RMS input gives unit-RMS outputs;
//    lm_head has σ = 4/sqrt(in), so logits spread over several units (max |logit| ≫ 1);
//  - (1+w) norm weights have w ∈ [-0.1, 0.1]; the GDN gated norm's plain weight is in
//    [0.9, 1.1]; every norm therefore rescales its input to ≈ unit RMS, and the multi-stream
//    residual (which only grows by ι·y with ι ∈ (0, 2)) is renormalized before every use;
//  - embeddings have σ = 1; convolution taps σ = 1/sqrt(kernel); A_log = log(U[1, 16]) and
//    dt_bias ∈ [-0.5, 0.5] (decays g = -exp(A_log)·softplus(·) in a trained-model range);
//  - NVFP4 experts: uniform random E2M1 codes (RMS of the code values 2.93), block scales E4M3
//    codes near 1 (0.875 .. 1.125), and weight_scale_2 = 1/(2.93·sqrt(K)), so a dequantized
//    expert matrix has σ ≈ 1/sqrt(K) like the BF16 linears; input_scale is a plausible 1/448;
//  - the FP8 n-gram table holds E4M3 codes of values uniform in [-448, 448] and weight_scale =
//    sqrt(3)/448, so dequantized rows have σ ≈ 1 like embeddings;
//  - the PLE I64 buffers hold the exact multipliers, head sizes and offsets of docs/model.md §C.4.
// Each tensor's values depend only on (seed, tensor name), not on the order they are written.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>

namespace fn {

/// What `fngen synth` writes.
struct SynthOptions {
  std::filesystem::path config;  ///< a config.json (top-level qwen4_exp or bare text config)
  std::filesystem::path out;     ///< output directory (created; must be empty or absent)
  uint64_t seed = 0;
  /// Keep only the first N decoder layers (real widths); 0 keeps all. ple_layer_ids beyond N
  /// are dropped.
  int64_t layers = 0;
  /// Overrides ngram_vocab_size_base (the real table is 51 GB); 0 keeps the config's.
  int64_t ngram_vocab_base = 0;
  /// Directory whose tokenizer.json / tokenizer_config.json / tokenizer.model are copied in.
  std::optional<std::filesystem::path> tokenizer_dir;
};

/// Summary of a synth run.
struct SynthResult {
  uint64_t bytes = 0;    ///< bytes of safetensors written (all shard files)
  uint64_t tensors = 0;  ///< tensors written (text + the few skipped vision/MTP ones)
  uint64_t files = 0;    ///< safetensors files
  double seconds = 0;    ///< wall time of the whole run
};

/// Writes the checkpoint. The config is validated first (parse_model_config rules) and the
/// written checkpoint is the one expected_tensors() describes for the adjusted config. Writes
/// every file into a staging directory of its own beside --out (create_staging_directory,
/// core/paths.h) renamed onto --out at the end, so a failure leaves no partial checkpoint and
/// two runs with one --out never write into each other's files.
/// Throws Usage (out directory not empty, bad --layers), Format (bad config), Io (write failed,
/// or the tensors' bytes exceed the free space where --out goes: checked before any write).
SynthResult synth_checkpoint(const SynthOptions& options);

}  // namespace fn
