// PLE n-gram hashing constants and ids (docs/model.md §C.4): splitmix64 multipliers, prime head
// vocabulary sizes, offsets, padded table rows, and the 16 table row ids of one token.
// Called by the config validation, the expected-tensor table (I64 buffers), the loader (to check
// the stored buffers) and both backends. All arithmetic is exact 64-bit (wrap-around multiply,
// floor-mod), as the reference computes it in int64.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/config.h"

namespace fn {

/// splitmix64 finaliser of docs/model.md §C.4 (mod 2^64).
uint64_t splitmix64(uint64_t v) noexcept;

/// The ngram_size multipliers of the PLE layer of rank `ple_layer_rank` (its position in the
/// sorted ple_layer_ids): mult_i = 2·(splitmix64(base + G·(i+1)) mod half) + 1 with
/// base = seed + 10007·rank, half = ⌊⌊(2^63−1)/vocab_size⌋/2⌋ (at least 1). Odd, < 2^63/vocab.
std::vector<int64_t> ngram_multipliers(const ModelConfig& cfg, int ple_layer_rank);

/// The ngram_heads() head vocabulary sizes: head h gets the (rank·ngram_heads + h + 1)-th prime
/// ≥ ngram_vocab_size_base.
std::vector<int64_t> ngram_head_sizes(const ModelConfig& cfg, int ple_layer_rank);

/// Running sum of ngram_head_sizes (starting at 0): the first table row of each head.
std::vector<int64_t> ngram_head_offsets(const ModelConfig& cfg, int ple_layer_rank);

/// Σ head sizes rounded up to make_ngram_vocab_size_divisible_by (320,001,446 → 320,001,536).
int64_t ngram_padded_rows(const ModelConfig& cfg, int ple_layer_rank);

/// Everything the hash of one PLE layer needs, computed once.
struct NgramConstants {
  std::vector<int64_t> multipliers;   ///< [ngram_size]
  std::vector<int64_t> head_sizes;    ///< [ngram_heads]
  std::vector<int64_t> head_offsets;  ///< [ngram_heads]
  int64_t table_rows = 0;             ///< padded
  int64_t heads_per_ngram = 0;
  int64_t eos = 0;  ///< cfg.ple_eos()
};

/// Builds the constants of PLE layer rank `ple_layer_rank`. Throws Format when EOS is unset.
NgramConstants ngram_constants(const ModelConfig& cfg, int ple_layer_rank);

/// The table row ids of `token` given the previous ngram_size−1 raw token ids `context`,
/// oldest first (initially all EOS). EOS-aware shift: looking back, everything behind the first
/// EOS met is EOS; the current token being EOS does not matter. Order-k mix (k = 2..ngram_size)
/// = XOR_{j<k} s_j·mult_j (wrapping int64); head (k−2)·heads_per_ngram + i gets
/// floor_mod(mix_k, size) + offset. `ids` receives ngram_heads() values. Throws Internal on a
/// context of the wrong length or a too-short output.
void ngram_ids(const NgramConstants& k, std::span<const int64_t> context, int64_t token,
               std::span<int64_t> ids);

/// ngram_size == 3 convenience: context (c0, c1), oldest first; ids gets ngram_heads() values.
void ngram_ids(const NgramConstants& k, int64_t c0, int64_t c1, int64_t token, int64_t* ids);

}  // namespace fn
