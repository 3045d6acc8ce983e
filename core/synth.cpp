#include "core/synth.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>
#include <vector>

#include "core/codecs.h"
#include "core/config.h"
#include "core/error.h"
#include "core/log.h"
#include "core/model_tensors.h"
#include "core/ngram.h"
#include "core/paths.h"
#include "core/safetensors_writer.h"

namespace fn {
namespace {

using nlohmann::json;

// RMS of the 8 E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} drawn uniformly: sqrt(68.5 / 8).
constexpr double kE2m1CodeRms = 2.9261749776799064;
// Values are drawn per chunk of this many elements, each chunk from its own seeded stream, so
// the result does not depend on the number of threads.
constexpr int64_t kChunkElements = int64_t{1} << 20;

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

// splitmix64 as a stream generator: fast and good enough for random weights.
struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float symmetric() {
    return static_cast<float>(static_cast<double>(next() >> 40) * 0x1p-23 - 1.0);
  }
};

// How one tensor's values are drawn.
struct Draw {
  enum class Kind { Uniform, ALog, Bytes, E4m3BlockScale, Fp8Table, Constant, I64 } kind;
  double center = 0;  // Uniform: values in center ± half_width
  double half_width = 0;
  std::vector<int64_t> i64;  // I64: the values
};

Draw uniform_sigma(double sigma) {
  return {Draw::Kind::Uniform, 0.0, std::sqrt(3.0) * sigma, {}};
}
Draw uniform_around(double center, double half_width) {
  return {Draw::Kind::Uniform, center, half_width, {}};
}
Draw constant(double value) {
  return {Draw::Kind::Constant, value, 0.0, {}};
}

double last_dim(const ExpectedTensor& t) {
  return t.shape.empty() ? 1.0 : static_cast<double>(t.shape.back());
}

Draw draw_for(const ExpectedTensor& t, const ModelConfig& cfg) {
  switch (t.role) {
    case TensorRole::Embedding:
      return uniform_sigma(1.0);
    case TensorRole::LmHead:
      return uniform_sigma(4.0 / std::sqrt(last_dim(t)));
    case TensorRole::HcNorm:
    case TensorRole::PleNormKey:
    case TensorRole::PleNormQuery:
    case TensorRole::PleNormConv:
    case TensorRole::QsaQNorm:
    case TensorRole::QsaKNorm:
    case TensorRole::IndexerQNorm:
    case TensorRole::IndexerKNorm:
      return uniform_around(0.0, 0.1);  // (1 + w) norms
    case TensorRole::GdnNorm:
      return uniform_around(1.0, 0.1);  // plain weight
    case TensorRole::GdnALog:
      return {Draw::Kind::ALog, 0, 0, {}};
    case TensorRole::GdnDtBias:
      return uniform_around(0.0, 0.5);
    case TensorRole::GdnConv:
    case TensorRole::PleConv:
      return uniform_sigma(1.0 / std::sqrt(last_dim(t)));
    case TensorRole::ExpertWeight:
      return {Draw::Kind::Bytes, 0, 0, {}};
    case TensorRole::ExpertBlockScale:
      return {Draw::Kind::E4m3BlockScale, 0, 0, {}};
    case TensorRole::ExpertGlobalScale: {
      // K = 2 codes per packed byte of the matching weight: gate/up read hidden_size inputs,
      // down reads moe_intermediate_size.
      const double k = t.projection == "down_proj" ? static_cast<double>(cfg.moe_intermediate_size)
                                                   : static_cast<double>(cfg.hidden_size);
      return constant(1.0 / (kE2m1CodeRms * std::sqrt(k)));
    }
    case TensorRole::ExpertInputScale:
      return constant(1.0 / 448.0);
    case TensorRole::PleNgramShard:
      if (t.dtype == DType::F8_E4M3) return {Draw::Kind::Fp8Table, 0, 0, {}};
      return uniform_sigma(1.0);
    case TensorRole::PleNgramScale:
      return constant(std::sqrt(3.0) / 448.0);
    case TensorRole::PleMultipliers:
    case TensorRole::PleHeadSizes:
    case TensorRole::PleHeadOffsets: {
      const NgramConstants k = ngram_constants(cfg, cfg.ple_rank(t.layer));
      const auto& v = t.role == TensorRole::PleMultipliers ? k.multipliers
                      : t.role == TensorRole::PleHeadSizes ? k.head_sizes
                                                           : k.head_offsets;
      return {Draw::Kind::I64, 0, 0, v};
    }
    default:
      // Every linear (HC down/up/inject, router, shared expert and its gate, GDN and QSA
      // projections, indexer, PLE key/value, fused BF16 experts): σ = 1/sqrt(fan-in).
      return uniform_sigma(1.0 / std::sqrt(last_dim(t)));
  }
}

void store(std::byte* dst, DType dtype, double value) {
  switch (dtype) {
    case DType::BF16: {
      const uint16_t b = float_to_bf16(static_cast<float>(value));
      std::memcpy(dst, &b, 2);
      return;
    }
    case DType::F16: {
      const uint16_t b = float_to_fp16(static_cast<float>(value));
      std::memcpy(dst, &b, 2);
      return;
    }
    case DType::F32: {
      const float f = static_cast<float>(value);
      std::memcpy(dst, &f, 4);
      return;
    }
    case DType::F8_E4M3:
      *dst = static_cast<std::byte>(float_to_e4m3(static_cast<float>(value)));
      return;
    default:
      FN_THROW(Internal, "synth: no float encoder for dtype {}", dtype_name(dtype));
  }
}

// Fills elements [begin, end) of a tensor from the chunk's own stream.
void fill_chunk(const Draw& d, DType dtype, std::byte* data, int64_t begin, int64_t end, Rng rng,
                const std::array<uint8_t, 256>& fp8_lut) {
  const std::size_t es = dtype_size(dtype);
  for (int64_t i = begin; i < end; ++i) {
    std::byte* p = data + static_cast<std::size_t>(i) * es;
    switch (d.kind) {
      case Draw::Kind::Uniform:
        store(p, dtype, d.center + d.half_width * rng.symmetric());
        break;
      case Draw::Kind::ALog:
        store(p, dtype, std::log(8.5 + 7.5 * rng.symmetric()));  // log(U[1, 16])
        break;
      case Draw::Kind::Bytes:
        *p = static_cast<std::byte>(rng.next() >> 56);
        break;
      case Draw::Kind::E4m3BlockScale:
        // E4M3 codes 0x36..0x39 = 0.875, 0.9375, 1.0, 1.125.
        *p = static_cast<std::byte>(0x36 + (rng.next() >> 62));
        break;
      case Draw::Kind::Fp8Table:
        *p = static_cast<std::byte>(fp8_lut[rng.next() >> 56]);
        break;
      case Draw::Kind::Constant:
        store(p, dtype, d.center);
        break;
      case Draw::Kind::I64: {
        const int64_t v = d.i64.at(static_cast<std::size_t>(i));
        std::memcpy(p, &v, 8);
        break;
      }
    }
  }
}

// E4M3 codes of 256 values evenly spread over [-448, 448]: a random byte picks one.
std::array<uint8_t, 256> make_fp8_lut() {
  std::array<uint8_t, 256> lut{};
  for (int i = 0; i < 256; ++i)
    lut[i] = float_to_e4m3(static_cast<float>(-448.0 + (i + 0.5) * 3.5));
  return lut;
}

SafetensorsWriter::Fill make_fill(const ExpectedTensor& t, const ModelConfig& cfg, uint64_t seed) {
  Draw draw = draw_for(t, cfg);
  const DType dtype = t.dtype;
  const uint64_t tensor_seed = seed ^ fnv1a(t.name);
  return [draw = std::move(draw), dtype, tensor_seed](std::span<std::byte> out) {
    static const std::array<uint8_t, 256> lut = make_fp8_lut();
    const int64_t n = static_cast<int64_t>(out.size() / dtype_size(dtype));
    const int64_t chunks = (n + kChunkElements - 1) / kChunkElements;
    const int threads = static_cast<int>(
        std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, std::max<int64_t>(chunks, 1)));
    auto work = [&](int tid) {
      for (int64_t c = tid; c < chunks; c += threads) {
        Rng rng{tensor_seed + 0x632BE59BD9B4E019ull * static_cast<uint64_t>(c + 1)};
        fill_chunk(draw, dtype, out.data(), c * kChunkElements,
                   std::min(n, (c + 1) * kChunkElements), rng, lut);
      }
    };
    if (threads <= 1) {
      work(0);
      return;
    }
    std::vector<std::thread> pool;
    for (int tid = 1; tid < threads; ++tid) pool.emplace_back(work, tid);
    work(0);
    for (auto& th : pool) th.join();
  };
}

json read_json_file(const std::filesystem::path& path) {
  std::error_code ec;
  FN_REQUIRE(!std::filesystem::is_directory(path, ec), Usage,
             "synth: --config '{}' is a directory; give the config file itself (e.g. '{}')",
             path.string(), (path / "config.json").string());
  const std::string text = read_regular_file(path, kMaxCheckpointJsonBytes, "synth: config");
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    FN_THROW(Format, "synth: '{}' is not valid JSON: {}", path.string(), e.what());
  }
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  FN_REQUIRE(out.good(), Io, "synth: cannot write '{}'", path.string());
}

// Applies --layers and --ngram-vocab-base to the config JSON (text_config or bare form).
void adjust_config(json& j, const SynthOptions& options, const std::string& source) {
  json& text = j.contains("text_config") ? j["text_config"] : j;
  if (options.layers > 0) {
    FN_REQUIRE(text.contains("num_hidden_layers") && text["num_hidden_layers"].is_number_integer(),
               Format, "{}: num_hidden_layers missing or not an integer", source);
    const int64_t total = text["num_hidden_layers"].get<int64_t>();
    FN_REQUIRE(options.layers <= total, Usage,
               "--layers {} is more than the config's num_hidden_layers ({})", options.layers,
               total);
    text["num_hidden_layers"] = options.layers;
    if (text.contains("layer_types") && text["layer_types"].is_array() &&
        static_cast<int64_t>(text["layer_types"].size()) >= options.layers) {
      json kept = json::array();
      for (int64_t i = 0; i < options.layers; ++i) kept.push_back(text["layer_types"][i]);
      text["layer_types"] = kept;
    }
    if (text.contains("ple_layer_ids") && text["ple_layer_ids"].is_array()) {
      json kept = json::array();
      for (const auto& id : text["ple_layer_ids"]) {
        if (id.is_number_integer() && id.get<int64_t>() <= options.layers) kept.push_back(id);
      }
      text["ple_layer_ids"] = kept;
    }
  }
  if (options.ngram_vocab_base > 0) text["ngram_vocab_size_base"] = options.ngram_vocab_base;
}

// Assigns every tensor to a shard file named as the RadixArk export names them.
std::map<std::string, std::vector<const ExpectedTensor*>> assign_files(
    const std::vector<ExpectedTensor>& tensors, const ModelConfig& cfg) {
  std::map<std::string, std::vector<const ExpectedTensor*>> files;
  const int64_t groups = cfg.num_experts % 4 == 0 ? 4 : 1;
  const int64_t per_group = cfg.num_experts / groups;
  std::vector<const ExpectedTensor*> ple;
  for (const auto& t : tensors) {
    if (t.expert >= 0) {
      const int64_t g = t.expert / per_group;
      files[fmt::format("layer-{:05}-experts-{:04}-{:04}.safetensors", t.layer, g * per_group,
                        (g + 1) * per_group - 1)]
          .push_back(&t);
    } else if (t.role == TensorRole::PleNgramShard || t.role == TensorRole::PleNgramScale) {
      ple.push_back(&t);
    } else if (t.layer < 0) {
      files["model-bf16-00001.safetensors"].push_back(&t);  // embedding, mixer, lm_head
    } else {
      // Decoder-layer dense tensors: 8 layers per file.
      files[fmt::format("model-bf16-{:05}.safetensors", 2 + t.layer / 8)].push_back(&t);
    }
  }
  // The n-gram table: 13 tensors per file (docs/model.md §B.1).
  for (std::size_t i = 0; i < ple.size(); ++i) {
    files[fmt::format("model-plefp8-{:05}.safetensors", i / 13)].push_back(ple[i]);
  }
  return files;
}

}  // namespace

SynthResult synth_checkpoint(const SynthOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  FN_REQUIRE(options.layers >= 0, Usage, "--layers must be >= 0, got {}", options.layers);
  FN_REQUIRE(options.ngram_vocab_base >= 0, Usage, "--ngram-vocab-base must be >= 0, got {}",
             options.ngram_vocab_base);
  const std::string source = options.config.string();
  json j = read_json_file(options.config);
  FN_REQUIRE(j.is_object(), Format, "synth: '{}' is not a JSON object", source);
  adjust_config(j, options, source);
  const ModelConfig cfg = parse_model_config(j, source);
  QuantConfig quant;
  if (j.contains("quantization_config")) {
    quant = parse_quantization_config(j["quantization_config"], source);
  }
  const std::vector<ExpectedTensor> tensors = expected_tensors(cfg, quant);

  namespace fs = std::filesystem;
  if (fs::exists(options.out)) {
    FN_REQUIRE(fs::is_directory(options.out), Usage,
               "--out '{}' exists and is not a directory (synth writes a model directory)",
               options.out.string());
    FN_REQUIRE(fs::is_empty(options.out), Usage,
               "--out '{}' is a directory that is not empty (synth never overwrites files)",
               options.out.string());
  }
  // The bytes the tensors need (in long double: an absurd config could overflow int64) against
  // the free space where they go, before anything is written: a config with hidden_size 10^6
  // would otherwise start writing some 600 GB.
  long double need = 0;
  for (const ExpectedTensor& t : tensors) {
    long double n = static_cast<long double>(dtype_size(t.dtype));
    for (int64_t d : t.shape) n *= static_cast<long double>(d);
    need += n;
  }
  // Everything goes to a staging directory of its own (create_staging_directory) renamed at the
  // end: a failure leaves no partial checkpoint behind, and two runs with one --out never write
  // into each other's. Created first, so that a place that takes no directory (/proc) is named
  // as such, and the free space is that of the file system the files go to.
  fs::path out;
  std::error_code ec;
  // --out may name a directory several levels below an existing one.
  if (const fs::path parent = fs::absolute(options.out, ec).parent_path(); !parent.empty())
    fs::create_directories(parent, ec);
  try {
    out = create_staging_directory(options.out);
  } catch (const Error& e) {
    FN_THROW(Io, "--out '{}': {}", options.out.string(), e.what());
  }
  SynthResult result;
  try {  // every failure below removes the staging directory (the catch)
    std::error_code space_ec;
    const fs::space_info space = fs::space(out, space_ec);
    FN_REQUIRE(
        space_ec || need <= static_cast<long double>(space.available), Io,
        "synth: the checkpoint of '{}' needs {:.1f} GB, more than the {:.1f} GB free in '{}'",
        source, static_cast<double>(need / 1e9), static_cast<double>(space.available) / 1e9,
        fs::absolute(options.out).parent_path().string());
    auto files = assign_files(tensors, cfg);
    // A few tensors a text-only loader must skip (docs/model.md §B.3).
    std::vector<ExpectedTensor> skipped = {
        {"mtp.pre_fc_norm_embedding.weight",
         TensorRole::HcNorm,
         -1,
         -1,
         -1,
         "",
         DType::BF16,
         {cfg.hidden_size}},
        {"model.visual.merger.ln_q.weight", TensorRole::HcNorm, -1, -1, -1, "", DType::BF16, {16}},
    };
    for (const auto& t : skipped) files["model-bf16-00001.safetensors"].push_back(&t);

    json weight_map = json::object();
    for (const auto& [file, list] : files) {
      SafetensorsWriter writer;
      writer.set_metadata("format", "pt");
      for (const ExpectedTensor* t : list) {
        writer.add(t->name, t->dtype, t->shape, make_fill(*t, cfg, options.seed));
        weight_map[t->name] = file;
      }
      result.bytes += writer.write(out / file);
      result.tensors += list.size();
      result.files += 1;
      FN_LOG_DEBUG("synth: wrote {} ({} tensors)", file, list.size());
    }

    json index = {{"metadata", {{"total_size", result.bytes}}}, {"weight_map", weight_map}};
    write_text(out / "model.safetensors.index.json", index.dump(2) + "\n");
    write_text(out / "config.json", j.dump(2) + "\n");
    if (quant.quantized()) {
      json q = {{"producer", {{"name", "modelopt"}, {"version", "0.46.0"}}},
                {"quantization",
                 {{"quant_algo", quant.quant_algo},
                  {"group_size", quant.group_size},
                  {"exclude_modules", quant.exclude_modules}}}};
      write_text(out / "hf_quant_config.json", q.dump(2) + "\n");
    }
    // generation_config.json: a sidecar "<config>.generation_config.json" when shipped, else the
    // model's eos ids.
    fs::path gen_sidecar = options.config;
    gen_sidecar.replace_extension(".generation_config.json");
    if (fs::exists(gen_sidecar)) {
      write_text(out / "generation_config.json", read_json_file(gen_sidecar).dump(2) + "\n");
    } else {
      json gen = {{"eos_token_id", cfg.eos_token_id}};
      write_text(out / "generation_config.json", gen.dump(2) + "\n");
    }
    if (options.tokenizer_dir) {
      int copied = 0;
      for (const char* name : {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}) {
        const fs::path src = *options.tokenizer_dir / name;
        if (!fs::exists(src)) continue;
        fs::copy_file(src, out / name, fs::copy_options::overwrite_existing, ec);
        FN_REQUIRE(!ec, Io, "cannot copy '{}': {}", src.string(), ec.message());
        ++copied;
      }
      FN_REQUIRE(copied > 0, Io, "--tokenizer '{}' holds no tokenizer.json or tokenizer.model",
                 options.tokenizer_dir->string());
    }
  } catch (...) {
    fs::remove_all(out, ec);
    throw;
  }
  fs::remove(options.out, ec);  // an empty directory, if it existed
  fs::rename(out, options.out, ec);
  FN_REQUIRE(!ec, Io, "cannot rename '{}' to '{}': {}", out.string(), options.out.string(),
             ec.message());
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace fn
