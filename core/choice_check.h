// The debug check that every tensor-parallel rank made the same discrete choices in a decode
// step (the router's expert ids and the QSA indexer's block ids are equal on
// every rank). Each rank hashes its step's choices; the hashes are gathered and compared. Called
// by `fngen generate --check-choices` (apps/cmd_generate.cpp) and the multi-rank model tests.
#pragma once

#include <cstdint>
#include <vector>

#include "core/collectives.h"

namespace fn {

/// FNV-1a (64-bit) over the ids of every list in order, each list preceded by its length, so
/// moving an id from one layer's list to the next changes the hash. hash_choices({}, {}) hashes
/// the two list counts. router: per decoder layer, the top-k expert ids; indexer: per QSA layer,
/// the selected block ids (docs/model.md §C.3 and §C.5).
uint64_t hash_choices(const std::vector<std::vector<int32_t>>& router,
                      const std::vector<std::vector<int32_t>>& indexer) noexcept;

/// Gathers every rank's `hash` over `coll` (a collective: every rank must call it) and throws
/// fn::Error(Internal) on every rank when they differ, naming `step` (decode step, 0-based) and
/// each rank's hash. A single rank always passes.
void require_same_choices(Collectives& coll, uint64_t hash, int64_t step);

}  // namespace fn
