// On-device greedy choice and sampling (see sample.h).
//
// Filtered sampling: keys = order-preserving bits of each logit (NaN -> 0, sorted last), a stable
// descending CUB radix sort of (key, id) gives the host sampler's order (logit desc, id asc);
// then chunk sums of exp(l - max) (FP64, fixed order) locate the top-p cut, a 256-ary search the
// min-p cut, and a Gumbel-max draw over the kept prefix picks the token. Every reduction is in a
// fixed order or over integers (argmax keys), so the result is bitwise reproducible.
//
// Penalties: the row is copied into the workspace (the counts cleared on the way), each window
// position adds 1 to its id's count (integer atomics: order-independent), then each window
// position claims its id's count with an atomic exchange to 0 (exactly one position per distinct
// id gets the full count) and penalises that id once. The counts end all zero.
#include "cuda/kernels/sample.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cub/device/device_radix_sort.cuh>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/pdl.cuh"

namespace fn {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 8;
constexpr int kChunk = kThreads * kPerThread;  // elements per block in the grid kernels

struct SampleState {
  int32_t n_nan;   // NaN logits (atomicAdd of integers: order-independent)
  int32_t n_keep;  // kept prefix length after top-k / top-p / min-p
};

struct Layout {
  size_t keys_in = 0, keys_out = 0, vals_in = 0, vals_out = 0, chunk_sum = 0, part_key = 0,
         part_idx = 0, state = 0, cub_temp = 0, cub_bytes = 0, pen_logits = 0, pen_counts = 0,
         total = 0;
};

// Blocks of the window kernels: enough for a 64-id window per thread block of kThreads, at most
// kMaxWindowBlocks (a window of the whole context is strided over them). The window length is
// read on the device, so the grid is fixed when the launch is encoded (graph replay).
constexpr int64_t kMaxWindowBlocks = 64;

size_t align256(size_t x) {
  return (x + 255) & ~static_cast<size_t>(255);
}

int64_t num_chunks(int64_t vocab) {
  return (vocab + kChunk - 1) / kChunk;
}

bool is_greedy(const DeviceSamplingParams& s) {
  return s.temperature <= 0.0f;
}

bool has_filter(const DeviceSamplingParams& s) {
  return s.top_k > 0 || s.top_p < 1.0f || s.min_p > 0.0f;
}

// Sizes the penalty buffers too whenever the sort buffers are sized, so that the filtered
// settings' workspace allows every setting (sample.h).
bool needs_penalty_buffers(const DeviceSamplingParams& s) {
  return penalties_active(s) || (!is_greedy(s) && has_filter(s));
}

size_t cub_sort_bytes(int64_t vocab) {
  size_t bytes = 0;
  FN_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(vocab),
      0, 32, static_cast<cudaStream_t>(nullptr)));
  return bytes;
}

Layout make_layout(int64_t vocab, const DeviceSamplingParams& s) {
  Layout L;
  const size_t V = static_cast<size_t>(vocab), nb = static_cast<size_t>(num_chunks(vocab));
  size_t off = 0;
  auto take = [&off](size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  };
  L.part_key = take(nb * sizeof(unsigned long long));
  L.part_idx = take(nb * sizeof(int32_t));
  L.state = take(sizeof(SampleState));
  if (!is_greedy(s) && has_filter(s)) {
    L.keys_in = take(V * sizeof(uint32_t));
    L.keys_out = take(V * sizeof(uint32_t));
    L.vals_in = take(V * sizeof(int32_t));
    L.vals_out = take(V * sizeof(int32_t));
    L.chunk_sum = take(nb * sizeof(double));
    L.cub_bytes = cub_sort_bytes(vocab);
    L.cub_temp = take(L.cub_bytes);
  }
  if (needs_penalty_buffers(s)) {
    L.pen_logits = take(V * sizeof(float));
    L.pen_counts = take(V * sizeof(int32_t));
  }
  L.total = off;
  return L;
}

// ---- keys and reductions
// -------------------------------------------------------------------------

using dev::key_value;
using dev::order_key;

__device__ __forceinline__ unsigned long long order_key64(double d) {
  if (isnan(d)) return 0ull;
  if (d == 0.0) d = 0.0;
  const unsigned long long u = static_cast<unsigned long long>(__double_as_longlong(d));
  return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
}

// (key, idx) pairs: the larger key wins, equal keys -> the lower idx. A total order, so any
// reduction tree gives the same winner.
struct Best {
  unsigned long long key;
  int32_t idx;
};

__device__ __forceinline__ Best better(Best a, Best b) {
  return (b.key > a.key || (b.key == a.key && b.idx < a.idx)) ? b : a;
}

// Block-wide best; the result is valid in thread 0.
__device__ __forceinline__ Best block_best(Best v) {
  __shared__ Best warp_best[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) {
    Best o;
    o.key = __shfl_xor_sync(0xffffffffu, v.key, off);
    o.idx = __shfl_xor_sync(0xffffffffu, v.idx, off);
    v = better(v, o);
  }
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) v = better(v, warp_best[w]);
  }
  return v;
}

constexpr int32_t kNoIdx = 0x7fffffff;

// ---- penalties
// -----------------------------------------------------------------------------------

// pen = logits, counts = 0 (the counts of the last launch are already 0; cleared anyway, so
// that the workspace needs no set-up).
__global__ void __launch_bounds__(kThreads)
    penalty_copy_kernel(const float* logits, int64_t V, float* pen, int32_t* counts) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  for (int r = 0; r < kPerThread; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    if (i >= V) break;
    pen[i] = logits[i];
    counts[i] = 0;
  }
}

// The window's accepted-id positions [first, end) (fn::Sampler keeps the last repeat_last_n
// accepted ids; -1 keeps all of them).
struct WindowRange {
  int64_t first, end;
  bool clipped;  // longer than the ring holds: the last `capacity` ids are read
};

__device__ __forceinline__ WindowRange window_range(const DevicePenaltyWindow& w,
                                                    int64_t repeat_last_n) {
  const int64_t count = *w.count;
  int64_t n = repeat_last_n < 0 || repeat_last_n > count ? count : repeat_last_n;
  const bool clipped = n > w.capacity;
  if (clipped) n = w.capacity;
  return WindowRange{count - n, count, clipped};
}

// counts[t] += 1 for every window position holding id t in [0, V) (other ids are skipped, as the
// host sampler skips them).
__global__ void __launch_bounds__(kThreads)
    penalty_count_kernel(DevicePenaltyWindow w, int64_t repeat_last_n, int64_t V, int32_t* counts,
                         int32_t* flag) {
  const WindowRange r = window_range(w, repeat_last_n);
  if (r.clipped && blockIdx.x == 0 && threadIdx.x == 0) *flag = 3;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t k = r.first + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; k < r.end;
       k += stride) {
    const int32_t t = w.tokens[k % w.capacity];
    if (t >= 0 && t < V) atomicAdd(&counts[t], 1);
  }
}

// Each distinct id of the window, once, with its count c (claimed by the first position that
// exchanges it to 0): fn::Sampler::apply_penalties' arithmetic, each FP64 operation rounded on
// its own (the _rn intrinsics are never contracted into an FMA, which the host's separate
// multiply and add would not match).
__global__ void __launch_bounds__(kThreads)
    penalty_apply_kernel(DevicePenaltyWindow w, int64_t repeat_last_n, int64_t V,
                         double repetition_penalty, double presence_penalty,
                         double frequency_penalty, int32_t* counts, float* pen) {
  const WindowRange r = window_range(w, repeat_last_n);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t k = r.first + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; k < r.end;
       k += stride) {
    const int32_t t = w.tokens[k % w.capacity];
    if (t < 0 || t >= V) continue;
    const int32_t c = atomicExch(&counts[t], 0);
    if (c == 0) continue;  // another position of the same id has it
    double l = static_cast<double>(pen[t]);
    l = l <= 0.0 ? __dmul_rn(l, repetition_penalty) : __ddiv_rn(l, repetition_penalty);
    l = __dsub_rn(
        l, __dadd_rn(__dmul_rn(static_cast<double>(c), frequency_penalty), presence_penalty));
    pen[t] = __double2float_rn(l);  // an overflow to Inf is flagged by the choice's kernels
  }
}

// ---- greedy
// --------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    argmax_partial_kernel(const float* logits, int64_t V, unsigned long long* part_key,
                          int32_t* part_idx, int32_t* flag) {
  dev::pdl_begin();  // logits (and the step) come from the previous kernels (cuda/common/pdl.cuh)
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  Best b{0ull, kNoIdx};
  bool bad = false;
  for (int r = 0; r < kPerThread; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    if (i >= V) break;
    const float l = logits[i];
    bad |= !isfinite(l);
    b = better(b, Best{order_key(l), static_cast<int32_t>(i)});
  }
  if (bad) *flag = 2;
  b = block_best(b);
  if (threadIdx.x == 0) {
    part_key[blockIdx.x] = b.key;
    part_idx[blockIdx.x] = b.idx;
  }
}

// ---- RNG
// -----------------------------------------------------------------------------------------

__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t v) {
  v += 0x9E3779B97F4A7C15ull;
  v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull;
  v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
  return v ^ (v >> 31);
}

// Gumbel(0, 1) variate of token `id` in the stream `stream` (= f(seed, step)):
// U = (52 random bits + 0.5) * 2^-52 in (0, 1) exactly, G = -ln(-ln U) in FP64.
__device__ __forceinline__ double gumbel(uint64_t stream, int32_t id) {
  const uint64_t h = splitmix64(
      stream ^ (static_cast<uint64_t>(static_cast<uint32_t>(id)) * 0xD1B54A32D192ED03ull));
  const double u = (static_cast<double>(h >> 12) + 0.5) * 0x1.0p-52;
  return -log(-log(u));
}

__device__ __forceinline__ uint64_t rng_stream(uint64_t seed, const int64_t* step) {
  return splitmix64(splitmix64(seed) ^ static_cast<uint64_t>(*step));
}

// Unfiltered draw: every non-NaN logit is a candidate; score = l / T + G (max-shift not needed).
__global__ void __launch_bounds__(kThreads)
    gumbel_raw_kernel(const float* logits, int64_t V, double inv_t, uint64_t seed,
                      const int64_t* step, unsigned long long* part_key, int32_t* part_idx,
                      int32_t* flag) {
  dev::pdl_begin();  // logits (and the step) come from the previous kernels (cuda/common/pdl.cuh)
  const uint64_t stream = rng_stream(seed, step);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  Best b{0ull, kNoIdx};
  bool bad = false;
  for (int r = 0; r < kPerThread; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    if (i >= V) break;
    const float l = logits[i];
    bad |= !isfinite(l);
    const int32_t id = static_cast<int32_t>(i);
    // NaN logits get key 0 (never chosen unless all are NaN).
    const unsigned long long key =
        isnan(l) ? 0ull : order_key64(static_cast<double>(l) * inv_t + gumbel(stream, id));
    b = better(b, Best{key, id});
  }
  if (bad) *flag = 2;
  b = block_best(b);
  if (threadIdx.x == 0) {
    part_key[blockIdx.x] = b.key;
    part_idx[blockIdx.x] = b.idx;
  }
}

// ---- filtered sampling
// ---------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    prep_keys_kernel(const float* logits, int64_t V, uint32_t* keys, int32_t* vals,
                     SampleState* state, int32_t* flag) {
  __shared__ int warp_nan[kThreads / 32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  int nan_count = 0;
  bool bad = false;
  for (int r = 0; r < kPerThread; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    if (i >= V) break;
    const float l = logits[i];
    bad |= !isfinite(l);
    nan_count += isnan(l) ? 1 : 0;
    keys[i] = order_key(l);
    vals[i] = static_cast<int32_t>(i);
  }
  if (bad) *flag = 2;
  for (int off = 16; off > 0; off >>= 1) nan_count += __shfl_xor_sync(0xffffffffu, nan_count, off);
  if ((threadIdx.x & 31) == 0) warp_nan[threadIdx.x >> 5] = nan_count;
  __syncthreads();
  if (threadIdx.x == 0) {
    int total = 0;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_nan[w];
    if (total > 0) atomicAdd(&state->n_nan, total);  // integer: order-independent
  }
}

// Candidates after top-k (at least 1, so an all-NaN row still yields token 0).
__device__ __forceinline__ int64_t top_k_count(int64_t V, const SampleState* state, int top_k) {
  int64_t n = V - state->n_nan;
  if (top_k > 0 && top_k < n) n = top_k;
  return n < 1 ? 1 : n;
}

// Top-p mass term of sorted position j: exp(l_j - max) in FP64 (the host sampler's term).
__device__ __forceinline__ double mass_term(const uint32_t* keys, int64_t j, double mx) {
  return exp(static_cast<double>(key_value(keys[j])) - mx);
}

// Per-thread sums of kPerThread CONTIGUOUS sorted positions of chunk c (restricted to j < n),
// written to sums[threadIdx.x]. chunk_mass and cut_kernel share it so their sums agree bitwise.
__device__ __forceinline__ void thread_chunk_sums(const uint32_t* keys, int64_t c, int64_t n,
                                                  double mx, double* sums) {
  const int64_t first = c * kChunk + static_cast<int64_t>(threadIdx.x) * kPerThread;
  double s = 0.0;
  for (int r = 0; r < kPerThread; ++r) {
    const int64_t j = first + r;
    if (j < n) s += mass_term(keys, j, mx);
  }
  sums[threadIdx.x] = s;
}

__global__ void __launch_bounds__(kThreads)
    chunk_mass_kernel(const uint32_t* keys, int64_t V, const SampleState* state, int top_k,
                      double* chunk_sum) {
  __shared__ double sums[kThreads];
  const int64_t n = top_k_count(V, state, top_k);
  const double mx = static_cast<double>(key_value(keys[0]));
  if (static_cast<int64_t>(blockIdx.x) * kChunk >= n) {
    if (threadIdx.x == 0) chunk_sum[blockIdx.x] = 0.0;
    return;
  }
  thread_chunk_sums(keys, blockIdx.x, n, mx, sums);
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0.0;
    for (int t = 0; t < kThreads; ++t) s += sums[t];
    chunk_sum[blockIdx.x] = s;
  }
}

// One block: the kept prefix length n_keep after top-k, top-p, min-p (sample.h).
__global__ void __launch_bounds__(kThreads)
    cut_kernel(const uint32_t* keys, int64_t V, int64_t num_chunks, const double* chunk_sum,
               int top_k, float top_p, float min_p, SampleState* state, int32_t* kept_out) {
  __shared__ double sums[kThreads];
  __shared__ long long s_chunk;
  __shared__ double s_target, s_before;
  __shared__ long long s_found;
  __shared__ long long s_lo;
  const int64_t n1 = top_k_count(V, state, top_k);
  const double mx = static_cast<double>(key_value(keys[0]));
  int64_t n = n1;

  // Top-p: the shortest prefix whose mass reaches top_p * total (cum/total >= top_p).
  if (top_p < 1.0f && n1 > 1) {
    if (threadIdx.x == 0) {
      double total = 0.0;
      for (int64_t c = 0; c < num_chunks; ++c) total += chunk_sum[c];
      const double target = static_cast<double>(top_p) * total;
      double cum = 0.0;
      long long found = -1;
      for (int64_t c = 0; c < num_chunks; ++c) {
        if (cum + chunk_sum[c] >= target) {
          found = c;
          break;
        }
        cum += chunk_sum[c];
      }
      s_chunk = found;
      s_target = target;
      s_before = cum;
      s_found = 0x7fffffffffffffffll;
    }
    __syncthreads();
    const long long c = s_chunk;
    if (c >= 0) {
      thread_chunk_sums(keys, c, n1, mx, sums);
      __syncthreads();
      if (threadIdx.x == 0) {  // exclusive prefix over the threads, in thread order
        double run = s_before;
        for (int t = 0; t < kThreads; ++t) {
          const double v = sums[t];
          sums[t] = run;
          run += v;
        }
      }
      __syncthreads();
      double cum = sums[threadIdx.x];
      const int64_t first = c * kChunk + static_cast<int64_t>(threadIdx.x) * kPerThread;
      for (int r = 0; r < kPerThread; ++r) {
        const int64_t j = first + r;
        if (j >= n1) break;
        cum += mass_term(keys, j, mx);
        if (cum >= s_target) {
          atomicMin(reinterpret_cast<unsigned long long*>(&s_found),
                    static_cast<unsigned long long>(j));
          break;
        }
      }
      __syncthreads();
      // Not found in the chunk only through rounding between the two summation orders: keep the
      // whole chunk then.
      int64_t keep = s_found != 0x7fffffffffffffffll ? s_found + 1 : (c + 1) * kChunk;
      if (keep > n1) keep = n1;
      n = keep;
    }
  }

  // Min-p: keep the prefix with l >= max + ln(min_p) (logits are non-increasing along the sorted
  // order). A 256-ary search: lo is a position known to pass (0 always does).
  if (min_p > 0.0f && n > 1) {
    const double threshold = mx + log(static_cast<double>(min_p));
    int64_t lo = 0, hi = n;  // pass at lo, everything at >= hi unknown/fails
    while (hi - lo > 1) {
      const int64_t stride = (hi - lo + kThreads - 1) / kThreads;
      __syncthreads();
      if (threadIdx.x == 0) s_lo = lo;
      __syncthreads();
      const int64_t probe = lo + static_cast<int64_t>(threadIdx.x) * stride;
      if (threadIdx.x > 0 && probe < hi &&
          static_cast<double>(key_value(keys[probe])) >= threshold) {
        atomicMax(reinterpret_cast<unsigned long long*>(&s_lo),
                  static_cast<unsigned long long>(probe));
      }
      __syncthreads();
      const int64_t new_lo = s_lo;
      hi = new_lo + stride < hi ? new_lo + stride : hi;
      lo = new_lo;
    }
    n = lo + 1;
  }
  if (threadIdx.x == 0) {
    state->n_keep = static_cast<int32_t>(n);
    if (kept_out != nullptr) *kept_out = static_cast<int32_t>(n);
  }
}

// Gumbel-max over the kept sorted prefix: idx = the sorted position.
__global__ void __launch_bounds__(kThreads)
    gumbel_sorted_kernel(const uint32_t* keys, const int32_t* vals, const SampleState* state,
                         double inv_t, uint64_t seed, const int64_t* step,
                         unsigned long long* part_key, int32_t* part_idx) {
  const uint64_t stream = rng_stream(seed, step);
  const int64_t n = state->n_keep;
  const double mx = static_cast<double>(key_value(keys[0]));
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  Best b{0ull, kNoIdx};
  for (int r = 0; r < kPerThread; ++r) {
    const int64_t j = base + r * kThreads + threadIdx.x;
    if (j >= n) break;
    const double s =
        (static_cast<double>(key_value(keys[j])) - mx) * inv_t + gumbel(stream, vals[j]);
    // A NaN score (NaN or +-Inf logits, flagged) gets key 1: above "empty", below every number.
    const unsigned long long key = isnan(s) ? 1ull : order_key64(s);
    b = better(b, Best{key, static_cast<int32_t>(j)});
  }
  b = block_best(b);
  if (threadIdx.x == 0) {
    part_key[blockIdx.x] = b.key;
    part_idx[blockIdx.x] = b.idx;
  }
}

// One block: the best of the partials; the token is idx (greedy / raw) or vals[idx] (sorted).
__global__ void __launch_bounds__(kThreads)
    finish_kernel(const unsigned long long* part_key, const int32_t* part_idx, int64_t num_parts,
                  const int32_t* vals, int64_t V, const int64_t* step, int32_t* token_out,
                  int32_t* history, int64_t capacity, int32_t* flag, int32_t* kept_out,
                  int32_t kept_value, DevicePenaltyWindow window) {
  dev::pdl_begin();  // the partials come from the previous kernel (cuda/common/pdl.cuh)
  Best b{0ull, kNoIdx};
  for (int64_t i = threadIdx.x; i < num_parts; i += kThreads)
    b = better(b, Best{part_key[i], part_idx[i]});
  b = block_best(b);
  if (threadIdx.x == 0) {
    int64_t pos = b.idx == kNoIdx ? 0 : b.idx;
    if (pos >= V) pos = 0;
    const int32_t id = vals != nullptr ? vals[pos] : static_cast<int32_t>(pos);
    *token_out = id;
    if (history != nullptr) {
      const int64_t s = *step;
      if (s >= 0 && s < capacity) {
        history[s] = id;
      } else {
        *flag = 3;
      }
    }
    if (kept_out != nullptr && kept_value >= 0) *kept_out = kept_value;
    if (window.tokens != nullptr) {  // the id is accepted into the sequence's window
      const int64_t n = *window.count;
      window.tokens[n % window.capacity] = id;
      *window.count = n + 1;
    }
  }
}

}  // namespace

bool penalties_active(const DeviceSamplingParams& s) noexcept {
  return s.repeat_last_n != 0 &&
         (s.repetition_penalty != 1.0 || s.presence_penalty != 0.0 || s.frequency_penalty != 0.0);
}

size_t sample_workspace_bytes(int64_t vocab, const DeviceSamplingParams& sampling) {
  FN_LAUNCH_REQUIRE(vocab >= 1 && vocab <= INT32_MAX, "sample_workspace_bytes");
  return make_layout(vocab, sampling).total;
}

void launch_sample(const SampleParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_sample";
  const DeviceSamplingParams& s = p.sampling;
  FN_LAUNCH_REQUIRE(p.logits != nullptr && p.step != nullptr && p.token_out != nullptr &&
                        p.workspace != nullptr && p.error_flag != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(p.vocab >= 1 && p.vocab <= INT32_MAX, kOp);
  FN_LAUNCH_REQUIRE(p.history == nullptr || p.history_capacity >= 1, kOp);
  FN_LAUNCH_REQUIRE(std::isfinite(s.temperature) && s.top_k >= 0, kOp);
  FN_LAUNCH_REQUIRE(s.top_p > 0.0f && s.top_p <= 1.0f && s.min_p >= 0.0f && s.min_p <= 1.0f, kOp);
  FN_LAUNCH_REQUIRE(std::isfinite(s.repetition_penalty) && s.repetition_penalty > 0.0 &&
                        std::isfinite(s.presence_penalty) && std::isfinite(s.frequency_penalty) &&
                        s.repeat_last_n >= -1,
                    kOp);
  const DevicePenaltyWindow& w = s.window;
  FN_LAUNCH_REQUIRE(w.tokens == nullptr || (w.count != nullptr && w.capacity >= 1), kOp);
  const bool penalties = penalties_active(s);
  FN_LAUNCH_REQUIRE(!penalties || w.tokens != nullptr, kOp);
  FN_LAUNCH_REQUIRE(reinterpret_cast<uintptr_t>(p.workspace) % 256 == 0, kOp);
  const Layout L = make_layout(p.vocab, s);
  FN_LAUNCH_REQUIRE(p.workspace_bytes >= L.total, kOp);

  char* ws = static_cast<char*>(p.workspace);
  auto* part_key = reinterpret_cast<unsigned long long*>(ws + L.part_key);
  auto* part_idx = reinterpret_cast<int32_t*>(ws + L.part_idx);
  auto* state = reinterpret_cast<SampleState*>(ws + L.state);
  const int64_t nb = num_chunks(p.vocab);
  const unsigned grid = static_cast<unsigned>(nb);
  const int32_t vocab32 = static_cast<int32_t>(p.vocab);

  // The row the choice reads: the logits, or their penalised copy.
  const float* logits = p.logits;
  if (penalties) {
    auto* pen = reinterpret_cast<float*>(ws + L.pen_logits);
    auto* counts = reinterpret_cast<int32_t*>(ws + L.pen_counts);
    const int64_t most = s.repeat_last_n > 0 ? std::min(s.repeat_last_n, w.capacity) : w.capacity;
    const auto wgrid =
        static_cast<unsigned>(std::min((most + kThreads - 1) / kThreads, kMaxWindowBlocks));
    penalty_copy_kernel<<<grid, kThreads, 0, stream>>>(p.logits, p.vocab, pen, counts);
    FN_CUDA_LAUNCH_CHECK("penalty_copy_kernel");
    penalty_count_kernel<<<wgrid, kThreads, 0, stream>>>(w, s.repeat_last_n, p.vocab, counts,
                                                         p.error_flag);
    FN_CUDA_LAUNCH_CHECK("penalty_count_kernel");
    penalty_apply_kernel<<<wgrid, kThreads, 0, stream>>>(w, s.repeat_last_n, p.vocab,
                                                         s.repetition_penalty, s.presence_penalty,
                                                         s.frequency_penalty, counts, pen);
    FN_CUDA_LAUNCH_CHECK("penalty_apply_kernel");
    logits = pen;
  }

  if (is_greedy(s)) {
    launch_pdl("argmax_partial_kernel", argmax_partial_kernel, grid, kThreads, 0, stream, logits,
               p.vocab, part_key, part_idx, p.error_flag);
    FN_CUDA_LAUNCH_CHECK("argmax_partial_kernel");
    launch_pdl("finish_kernel", finish_kernel, 1, kThreads, 0, stream, part_key, part_idx, nb,
               static_cast<const int32_t*>(nullptr), p.vocab, p.step, p.token_out, p.history,
               p.history_capacity, p.error_flag, p.kept_count_out, 1, w);
    FN_CUDA_LAUNCH_CHECK("finish_kernel");
    return;
  }
  const double inv_t = 1.0 / static_cast<double>(s.temperature);
  if (!has_filter(s)) {
    launch_pdl("gumbel_raw_kernel", gumbel_raw_kernel, grid, kThreads, 0, stream, logits, p.vocab,
               inv_t, s.seed, p.step, part_key, part_idx, p.error_flag);
    FN_CUDA_LAUNCH_CHECK("gumbel_raw_kernel");
    launch_pdl("finish_kernel", finish_kernel, 1, kThreads, 0, stream, part_key, part_idx, nb,
               static_cast<const int32_t*>(nullptr), p.vocab, p.step, p.token_out, p.history,
               p.history_capacity, p.error_flag, p.kept_count_out, vocab32, w);
    FN_CUDA_LAUNCH_CHECK("finish_kernel");
    return;
  }

  auto* keys_in = reinterpret_cast<uint32_t*>(ws + L.keys_in);
  auto* keys_out = reinterpret_cast<uint32_t*>(ws + L.keys_out);
  auto* vals_in = reinterpret_cast<int32_t*>(ws + L.vals_in);
  auto* vals_out = reinterpret_cast<int32_t*>(ws + L.vals_out);
  auto* chunk_sum = reinterpret_cast<double*>(ws + L.chunk_sum);
  FN_CUDA_CHECK(cudaMemsetAsync(state, 0, sizeof(SampleState), stream));
  prep_keys_kernel<<<grid, kThreads, 0, stream>>>(logits, p.vocab, keys_in, vals_in, state,
                                                  p.error_flag);
  FN_CUDA_LAUNCH_CHECK("prep_keys_kernel");
  size_t cub_bytes = L.cub_bytes;
  FN_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(
      ws + L.cub_temp, cub_bytes, keys_in, keys_out, vals_in, vals_out, vocab32, 0, 32, stream));
  if (s.top_p < 1.0f) {
    chunk_mass_kernel<<<grid, kThreads, 0, stream>>>(keys_out, p.vocab, state, s.top_k, chunk_sum);
    FN_CUDA_LAUNCH_CHECK("chunk_mass_kernel");
  }
  cut_kernel<<<1, kThreads, 0, stream>>>(keys_out, p.vocab, nb, chunk_sum, s.top_k, s.top_p,
                                         s.min_p, state, p.kept_count_out);
  FN_CUDA_LAUNCH_CHECK("cut_kernel");
  gumbel_sorted_kernel<<<grid, kThreads, 0, stream>>>(keys_out, vals_out, state, inv_t, s.seed,
                                                      p.step, part_key, part_idx);
  FN_CUDA_LAUNCH_CHECK("gumbel_sorted_kernel");
  finish_kernel<<<1, kThreads, 0, stream>>>(part_key, part_idx, nb, vals_out, p.vocab, p.step,
                                            p.token_out, p.history, p.history_capacity,
                                            p.error_flag, nullptr, -1, w);
  FN_CUDA_LAUNCH_CHECK("finish_kernel");
}

}  // namespace fn
