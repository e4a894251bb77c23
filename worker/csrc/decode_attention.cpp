// Decode attention straight from the paged KV pool, for the CPU.
//
// One query token per sequence attends to its whole context, read in place from the pool
// `[num_blocks, block_size, kv_heads, head_dim]` through the sequence's block table: no
// gathered copy of K/V, no padding to the batch's longest context, and no zero blocks (the
// torch path folds grouped-query heads into a block-diagonal matmul that triples the FLOPs).
//
// Work items are (sequence, KV head) pairs; each computes the `group` query heads that share
// that KV head, so every K/V row is read once per item. Scores and sums are fp32 whatever
// the storage dtype; a bf16 pool under fp32 q (--kv-cache-dtype bfloat16) is widened to fp32
// as it is read (exact), then takes the fp32 path's arithmetic, so its result is the fp32
// kernel's over the widened pool, bit for bit, on every CPU class. Items are dealt
// round-robin to torch's intra-op threads: rows arrive sorted by context length, so
// contiguous ranges would give one thread all the long ones.
//
// Built at run time by worker/cpu_kernels.py with -O3 -march=native. Where the CPU has
// AVX-512 BF16 and the head size is 64 or 128, bf16 items use the intrinsics path
// (one_item_bf16), and fp32 items with AVX-512 one_head_f32 per query head; everything else
// runs the portable loops (one_item), written for the compiler to vectorize (`omp simd` on
// the reductions, a polynomial exp).

// ATen's Tensor and the two ops used (not torch/extension.h: all of libtorch's C++ API):
// this file compiles in a fraction of the time. module.cpp holds the Python bindings.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <ATen/Parallel.h>

#include "chunks.h"
#include "fast_exp.h"
#include "kernels.h"

#include <cmath>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }

inline float to_float(at::BFloat16 x) {
  uint16_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// T: q's and out's dtype; KV: the pool's (T, or bf16 under fp32 q: --kv-cache-dtype).
template <typename T, typename KV = T>
struct Problem {
  const T* q;  // [n, heads, d] with rows q_stride apart
  int64_t q_stride;
  const KV* k_cache;  // [num_blocks, block_size, kv_heads, d]
  const KV* v_cache;
  const int32_t* tables;  // [n, table_stride]
  int64_t table_stride;
  const int32_t* context_lens;  // [n]
  T* out;  // [n, heads * d]
  int64_t n, heads, kv_heads, d, block_size;
  float scale;
};

// Scratch reused across the items of one thread.
struct Scratch {
  std::vector<float> q, acc, scores, inv_sums, row;
};

// A pool row as one_item reads it: itself where the pool has q's dtype, or (a bf16 pool
// under fp32 q) widened into `buffer` (exact), so that the loops over it are the fp32
// path's own, in the same order.
template <typename T, typename KV>
inline auto pool_row(const KV* row, int64_t d, float* buffer) {
  if constexpr (std::is_same_v<T, float> && !std::is_same_v<KV, float>) {
    for (int64_t j = 0; j < d; ++j) buffer[j] = to_float(row[j]);
    return static_cast<const float*>(buffer);
  } else {
    return row;
  }
}

// In place: each of `rows` rows of `len` scores -> exp(score - row max); inv_sums[r] gets
// 1 / (sum of row r), applied to the output at the end.
inline void softmax_rows(float* scores, int64_t rows, int64_t len, float* inv_sums) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * len;
    float peak = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : peak)
    for (int64_t l = 0; l < len; ++l) peak = sr[l] > peak ? sr[l] : peak;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < len; ++l) {
      sr[l] = exp_nonpositive(sr[l] - peak);
      sum += sr[l];
    }
    inv_sums[r] = 1.0f / sum;
  }
}

// Calls fn(l, pointer to row l of `cache` for this KV head) for l = 0 .. len-1, walking the
// block table block by block (no division per position).
template <typename P, typename KV, typename Fn>
inline void for_each_row(const P& p, const int32_t* table, int64_t len,
                         const KV* cache, int64_t kv_head, Fn&& fn) {
  const int64_t slot_stride = p.kv_heads * p.d;  // elements between neighbouring pool slots
  for (int64_t start = 0, b = 0; start < len; start += p.block_size, ++b) {
    const KV* row = cache + static_cast<int64_t>(table[b]) * p.block_size * slot_stride +
                   kv_head * p.d;
    const int64_t stop = std::min(len, start + p.block_size);
    for (int64_t l = start; l < stop; ++l, row += slot_stride) fn(l, row);
  }
}

// D is the head size when known at compile time (the common 64 and 128, so that the inner
// loops unroll into a few vector instructions), or 0 to read it from the problem.
template <int64_t D, typename T, typename KV>
void one_item(const Problem<T, KV>& p, int64_t seq, int64_t kv_head, Scratch& s) {
  const int64_t d = D > 0 ? D : p.d;
  const int64_t group = p.heads / p.kv_heads;
  const int64_t len = p.context_lens[seq];
  const int32_t* table = p.tables + seq * p.table_stride;
  s.q.resize(group * d);
  s.acc.assign(group * d, 0.0f);
  s.scores.resize(group * len);
  s.inv_sums.resize(group);
  s.row.resize(d);
  float* q = s.q.data();
  float* acc = s.acc.data();
  float* scores = s.scores.data();

  const T* q_in = p.q + seq * p.q_stride + kv_head * group * d;
  for (int64_t i = 0; i < group * d; ++i) q[i] = to_float(q_in[i]) * p.scale;

  // scores[g, l] = q_g . k_l
  for_each_row(p, table, len, p.k_cache, kv_head, [&](int64_t l, const KV* k_row) {
    const auto* k = pool_row<T>(k_row, d, s.row.data());
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < d; ++j) dot += qg[j] * to_float(k[j]);
      scores[g * len + l] = dot;
    }
  });

  softmax_rows(scores, group, len, s.inv_sums.data());

  // acc[g] = sum_l p[g, l] v_l
  for_each_row(p, table, len, p.v_cache, kv_head, [&](int64_t l, const KV* v_row) {
    const auto* v = pool_row<T>(v_row, d, s.row.data());
    for (int64_t g = 0; g < group; ++g) {
      const float weight = scores[g * len + l];
      float* ag = acc + g * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) ag[j] += weight * to_float(v[j]);
    }
  });

  T* out = p.out + seq * p.heads * d + kv_head * group * d;
  for (int64_t g = 0; g < group; ++g) {
    const float inv_sum = s.inv_sums[g];
    for (int64_t j = 0; j < d; ++j) out[g * d + j] = static_cast<T>(acc[g * d + j] * inv_sum);
  }
}

#if defined(__AVX512F__)
#define ZS_HAVE_AVX512 1

// r[i] = sum of the 16 lanes of v[i]: a transpose-and-add tree, 45 instructions for 16 sums
// instead of a horizontal reduction each.
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [v2i, v2i+1, v2i, v2i+1] partials
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [v4i .. v4i+3] partials
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {  // fold the four 128-bit lanes pairwise
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                       _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// 16 bf16 values -> 16 floats (a bf16 is the high half of a float: exact).
inline __m512 load_bf16x16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 pool values as floats: fp32 rows as they are, bf16 rows (--kv-cache-dtype bfloat16)
// widened, so a bf16 pool gives the fp32 path's exact arithmetic on the widened values.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) { return load_bf16x16(p); }

// exp_nonpositive (fast_exp.h) on 16 lanes: the same power-of-two split and polynomial.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpLowest));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpPoly[i]));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// softmax_rows for one row, 16 lanes at a time (the loops there do not vectorize: the max
// and the exp ran scalar, most of a short context's time).
inline float softmax_row16(float* scores, int64_t len) {
  __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t l = 0;
  for (; l + 16 <= len; l += 16) peak = _mm512_max_ps(peak, _mm512_loadu_ps(scores + l));
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - l)) - 1);
  if (len > l) peak = _mm512_mask_max_ps(peak, tail, peak, _mm512_maskz_loadu_ps(tail, scores + l));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
  __m512 sum = _mm512_setzero_ps();
  for (l = 0; l + 16 <= len; l += 16) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(scores + l), top));
    _mm512_storeu_ps(scores + l, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (len > l) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + l), top));
    _mm512_mask_storeu_ps(scores + l, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// One query head g of an item in fp32 with AVX-512 (head size D, a multiple of 16): the same
// sums in the same order whichever other heads share the item, so that splitting an item
// by query head (run(), for batches too small to keep the threads busy) changes nothing.
// q.k as 16-row tiles of lane sums reduced together (sum16), softmax_row16,
// then the weighted V rows summed in registers, kWays interleaved accumulator sets.
template <int64_t D, typename KV>
void one_head_f32(const Problem<float, KV>& p, int64_t seq, int64_t kv_head, int64_t g,
                  Scratch& s) {
  constexpr int64_t kVecs = D / 16;
  const int64_t group = p.heads / p.kv_heads;
  const int64_t len = p.context_lens[seq];
  const int32_t* table = p.tables + seq * p.table_stride;
  s.scores.resize(len);
  float* scores = s.scores.data();
  const float* q_in = p.q + seq * p.q_stride + (kv_head * group + g) * D;
  const __m512 scale = _mm512_set1_ps(p.scale);
  __m512 q[kVecs];
  for (int64_t c = 0; c < kVecs; ++c) q[c] = _mm512_mul_ps(_mm512_loadu_ps(q_in + 16 * c), scale);

  __m512 tile[16];
  int64_t num_filled = 0;
  for_each_row(p, table, len, p.k_cache, kv_head, [&](int64_t l, const KV* k) {
    __m512 dot = _mm512_mul_ps(q[0], load16(k));
    for (int64_t c = 1; c < kVecs; ++c) dot = _mm512_fmadd_ps(q[c], load16(k + 16 * c), dot);
    tile[num_filled++] = dot;
    if (num_filled == 16) {
      _mm512_storeu_ps(scores + l - 15, sum16(tile));
      num_filled = 0;
    }
  });
  if (num_filled > 0) {
    for (int64_t i = num_filled; i < 16; ++i) tile[i] = _mm512_setzero_ps();
    const __mmask16 valid = static_cast<__mmask16>((1u << num_filled) - 1);
    _mm512_mask_storeu_ps(scores + len - num_filled, valid, sum16(tile));
  }
  const float inv_sum = softmax_row16(scores, len);

  constexpr int64_t kWays = kVecs >= 16 ? 1 : 16 / kVecs;
  __m512 acc[kWays][kVecs];
  for (int64_t w = 0; w < kWays; ++w) {
    for (int64_t c = 0; c < kVecs; ++c) acc[w][c] = _mm512_setzero_ps();
  }
  // Row l of each pool block goes to accumulator set l % kWays (counted within the block),
  // unrolled so that the sets stay in registers.
  const int64_t slot_stride = p.kv_heads * D;
  for (int64_t start = 0, b = 0; start < len; start += p.block_size, ++b) {
    const KV* row = p.v_cache + static_cast<int64_t>(table[b]) * p.block_size * slot_stride +
                    kv_head * D;
    const int64_t stop = std::min(len, start + p.block_size);
    int64_t l = start;
    for (; l + kWays <= stop; l += kWays, row += kWays * slot_stride) {
      for (int64_t w = 0; w < kWays; ++w) {
        const __m512 weight = _mm512_set1_ps(scores[l + w]);
        for (int64_t c = 0; c < kVecs; ++c) {
          acc[w][c] = _mm512_fmadd_ps(weight, load16(row + w * slot_stride + 16 * c),
                                      acc[w][c]);
        }
      }
    }
    for (int64_t w = 0; w < kWays; ++w) {
      if (l + w < stop) {
        const __m512 weight = _mm512_set1_ps(scores[l + w]);
        for (int64_t c = 0; c < kVecs; ++c) {
          acc[w][c] = _mm512_fmadd_ps(weight, load16(row + w * slot_stride + 16 * c),
                                      acc[w][c]);
        }
      }
    }
  }
  for (int64_t w = 1; w < kWays; ++w) {
    for (int64_t c = 0; c < kVecs; ++c) acc[0][c] = _mm512_add_ps(acc[0][c], acc[w][c]);
  }
  const __m512 inv = _mm512_set1_ps(inv_sum);
  float* out = p.out + seq * p.heads * D + (kv_head * group + g) * D;
  for (int64_t c = 0; c < kVecs; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[0][c], inv));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define ZS_HAVE_AVX512_BF16 1

// The same item as one_item, with AVX-512 BF16 instructions for a head size D (a multiple
// of 32): q.k as bf16 pair dot products accumulated in fp32 (exact products, no conversion
// of K), V converted once per row into a small fp32 scratch, then each query head sums its
// weighted V rows with its accumulators in registers.
template <int64_t D>
void one_item_bf16(const Problem<at::BFloat16>& p, int64_t seq, int64_t kv_head, Scratch& s) {
  constexpr int64_t kChunks = D / 32;  // __m512bh per row
  constexpr int64_t kVecs = D / 16;  // __m512 per row
  const int64_t group = p.heads / p.kv_heads;
  const int64_t len = p.context_lens[seq];
  const int32_t* table = p.tables + seq * p.table_stride;
  s.scores.resize(group * len);
  s.acc.resize(len * D);  // V rows in fp32
  s.inv_sums.resize(group);
  float* scores = s.scores.data();
  float* v_rows = s.acc.data();
  const at::BFloat16* q_in = p.q + seq * p.q_stride + kv_head * group * D;
  const __m512 scale = _mm512_set1_ps(p.scale);

  for (int64_t g = 0; g < group; ++g) {
    __m512bh q[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) {
      q[c] = (__m512bh)_mm512_loadu_si512(q_in + g * D + 32 * c);
    }
    float* sg = scores + g * len;
    // Lane sums of 16 rows at a time, so the horizontal adds are shared (sum16).
    __m512 tile[16];
    int64_t num_filled = 0;
    for_each_row(p, table, len, p.k_cache, kv_head, [&](int64_t l, const at::BFloat16* k) {
      __m512 dot = _mm512_setzero_ps();
      for (int64_t c = 0; c < kChunks; ++c) {
        dot = _mm512_dpbf16_ps(dot, q[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
      }
      tile[num_filled++] = dot;
      if (num_filled == 16) {
        _mm512_storeu_ps(sg + l - 15, _mm512_mul_ps(sum16(tile), scale));
        num_filled = 0;
      }
    });
    if (num_filled > 0) {
      for (int64_t i = num_filled; i < 16; ++i) tile[i] = _mm512_setzero_ps();
      const __mmask16 valid = static_cast<__mmask16>((1u << num_filled) - 1);
      _mm512_mask_storeu_ps(sg + len - num_filled, valid, _mm512_mul_ps(sum16(tile), scale));
    }
  }
  softmax_rows(scores, group, len, s.inv_sums.data());

  for_each_row(p, table, len, p.v_cache, kv_head, [&](int64_t l, const at::BFloat16* v) {
    for (int64_t c = 0; c < kVecs; ++c) _mm512_storeu_ps(v_rows + l * D + 16 * c, load_bf16x16(v + 16 * c));
  });
  at::BFloat16* out = p.out + seq * p.heads * D + kv_head * group * D;
  // kWays independent accumulator sets over interleaved rows hide the FMA latency.
  constexpr int64_t kWays = kVecs >= 16 ? 1 : 16 / kVecs;
  for (int64_t g = 0; g < group; ++g) {
    __m512 acc[kWays][kVecs];
    for (int64_t w = 0; w < kWays; ++w) {
      for (int64_t c = 0; c < kVecs; ++c) acc[w][c] = _mm512_setzero_ps();
    }
    const float* sg = scores + g * len;
    int64_t l = 0;
    for (; l + kWays <= len; l += kWays) {
      for (int64_t w = 0; w < kWays; ++w) {
        const __m512 weight = _mm512_set1_ps(sg[l + w]);
        const float* v = v_rows + (l + w) * D;
        for (int64_t c = 0; c < kVecs; ++c) {
          acc[w][c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + 16 * c), acc[w][c]);
        }
      }
    }
    for (; l < len; ++l) {
      const __m512 weight = _mm512_set1_ps(sg[l]);
      for (int64_t c = 0; c < kVecs; ++c) {
        acc[0][c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v_rows + l * D + 16 * c), acc[0][c]);
      }
    }
    for (int64_t w = 1; w < kWays; ++w) {
      for (int64_t c = 0; c < kVecs; ++c) acc[0][c] = _mm512_add_ps(acc[0][c], acc[w][c]);
    }
    const __m512 inv_sum = _mm512_set1_ps(s.inv_sums[g]);
    for (int64_t c = 0; c < kVecs; ++c) {
      // fp32 -> bf16 with round-to-nearest-even, as torch converts
      const __m256bh packed = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[0][c], inv_sum));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * D + 16 * c), (__m256i)packed);
    }
  }
}
#endif

// One item with the best path for this head size D (0: any) and storage type: query heads
// [g_begin, g_end) of KV head `kv_head` (only the fp32 AVX-512 path takes part of a group;
// the others always get the whole group).
template <int64_t D, typename T, typename KV>
inline void item_for(const Problem<T, KV>& p, int64_t seq, int64_t kv_head, int64_t g_begin,
                     int64_t g_end, Scratch& scratch) {
#ifdef ZS_HAVE_AVX512
  if constexpr (D > 0 && std::is_same_v<T, float>) {
    for (int64_t g = g_begin; g < g_end; ++g) one_head_f32<D, KV>(p, seq, kv_head, g, scratch);
    return;
  }
#endif
#ifdef ZS_HAVE_AVX512_BF16
  if constexpr (D > 0 && std::is_same_v<T, at::BFloat16> && std::is_same_v<KV, T>) {
    one_item_bf16<D>(p, seq, kv_head, scratch);
    return;
  }
#endif
  one_item<D>(p, seq, kv_head, scratch);
}

template <typename T, typename KV>
void run(const Problem<T, KV>& p) {
  // Items are (sequence, KV head) pairs, or (sequence, query head) where there are too few
  // pairs to share between the threads (a batch of one: 3 pairs on 2 threads leaves one
  // thread a third idle) and the path computes heads on their own (fp32, AVX-512).
  const int64_t threads = at::get_num_threads();
  const int64_t group = p.heads / p.kv_heads;
  bool per_head = false;
#ifdef ZS_HAVE_AVX512
  per_head = std::is_same_v<T, float> && (p.d == 64 || p.d == 128) && group > 1 &&
             p.n * p.kv_heads < 4 * threads;
#endif
  const int64_t per_item = per_head ? 1 : group;  // query heads per item
  const int64_t num_items = p.n * p.heads / per_item;
  // The threads take items in turn (chunks.h), each with its own scratch.
  thread_local Scratch scratch;
  for_each_chunk(num_items, [&](int64_t item) {
    const int64_t head = item * per_item;  // first query head, counted over the batch
    const int64_t seq = head / p.heads, kv_head = (head % p.heads) / group;
    const int64_t g = head % group;
    if (p.d == 64) {
      item_for<64>(p, seq, kv_head, g, g + per_item, scratch);
    } else if (p.d == 128) {
      item_for<128>(p, seq, kv_head, g, g + per_item, scratch);
    } else {
      item_for<0>(p, seq, kv_head, g, g + per_item, scratch);
    }
  });
}

// Every read the kernel makes is within the pool: each row's context is at least one position
// and fits its table, and the table entries it uses (never the padding past it) name blocks
// of the pool. One pass over the used entries, before any thread starts.
void check_tables(const at::Tensor& block_tables, const at::Tensor& context_lens,
                  int64_t num_blocks, int64_t block_size) {
  const int64_t n = context_lens.numel(), width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = lens[i];
    TORCH_CHECK_VALUE(len >= 1, "row ", i, ": context length ", len, " (must be at least 1)");
    TORCH_CHECK_VALUE(len <= width * block_size, "row ", i, ": context length ", len,
                      " does not fit its table of ", width, " blocks of ", block_size);
    const int64_t used = (len + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t block = tables[i * width + b];
      TORCH_CHECK_INDEX(block >= 0 && block < num_blocks, "row ", i, ": block id ", block,
                        " at table entry ", b, " is outside the pool of ", num_blocks,
                        " blocks");
    }
  }
}

}  // namespace

// q [n, heads, d] (rows may be strided), k_cache/v_cache [num_blocks, block_size, kv_heads, d],
// block_tables [n, max_blocks] int32 (padding never read), context_lens [n] int32 (>= 1)
// -> [n, heads * d] in q's dtype. Inputs that would read outside q, the tables or the pool
// raise (ValueError for lengths, IndexError for block ids, RuntimeError for shapes).
at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor block_tables, at::Tensor context_lens,
                               double scale) {
  TORCH_CHECK(q.device().is_cpu(), "decode_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [n, heads, d] with contiguous heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, kv_heads, d]");
  // The pool shares q's dtype, or holds bf16 under fp32 q (--kv-cache-dtype bfloat16).
  const bool bf16_pool = q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == q.scalar_type() || bf16_pool),
              "q, k_cache and v_cache must share a dtype (or the pool be bfloat16 under "
              "float32 q)");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == q.size(0),
              "block_tables must be contiguous int32 [n, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0),
              "context_lens must be contiguous int32 [n]");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(kv_heads > 0 && k_cache.size(3) == d && heads % kv_heads == 0,
              "head shapes do not match");
  check_tables(block_tables, context_lens, k_cache.size(0), k_cache.size(1));
  auto out = at::empty({n, heads * d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (n == 0) return out;

  auto launch = [&](auto tag, auto kv_tag) {
    using T = decltype(tag);
    using KV = decltype(kv_tag);
    Problem<T, KV> p{q.data_ptr<T>(), q.stride(0), k_cache.data_ptr<KV>(), v_cache.data_ptr<KV>(),
                 block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                 context_lens.data_ptr<int32_t>(), out.data_ptr<T>(), n, heads, kv_heads, d,
                 k_cache.size(1), static_cast<float>(scale)};
    run(p);
  };
  if (q.scalar_type() == at::kBFloat16) {
    launch(at::BFloat16{}, at::BFloat16{});
  } else if (bf16_pool) {
    launch(float{}, at::BFloat16{});
  } else if (q.scalar_type() == at::kFloat) {
    launch(float{}, float{});
  } else {
    TORCH_CHECK(false, "decode_attention supports bfloat16 and float32, not ", q.scalar_type());
  }
  return out;
}
