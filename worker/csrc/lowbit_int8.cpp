// Matrix products of 4-bit and 8-bit block weights with int8 activations, for the CPU's
// decode rows when the worker runs with --int8-activations (llama.cpp's Q4_1 x Q8_1 and
// Q8_0 x Q8_0 dot products).
//
// The weights are lowbit_matmul.cpp's units, read in place (no second copy): see the top of
// that file for the layout. Each row of x is quantized per block of 32 inputs, as llama.cpp's
// Q8_1 does:
//
//   d = max|x_k| / 127,  xq_k = round_half_even(x_k / d) in -127..127 (x_k * (1 / d)),
//   S = sum_k xq_k (an integer),  sx = d * S (fp32).
//
// Then for each (row, output feature, block) the integer dot product of the block's weights
// and xq is exact in int32 (at most 32 * 255 * 127), and the fp32 part runs in one fixed
// order, block after block:
//
//   q4 (w = q * s + o, q in 0..15):  acc = fma(float(sum q xq), s * d, acc);
//                                    acc = fma(o, sx, acc)
//   q8 (w = q * s, q in -128..127):   acc = fma(float(sum q xq), s * d, acc)
//
// On AVX512_VNNI the integer sums are _mm512_dpbusd_epi32: u8 weights times s8 activations,
// 4 consecutive inputs per 32-bit lane, 16 output features per vector. The units hold each
// input's 16 features side by side, so each 64-byte load (4 inputs x 16 features) is
// transposed in registers to 16 features x 4 inputs (one byte permute with AVX512_VBMI, a
// dword permute and a byte shuffle without). Q8 weights are signed: they enter as q + 128
// (q xor 0x80) and 128 * S is taken off the integer sum. AVX-512 without VNNI computes the
// same integer sums with maddubs (u8 x s8 pairs in int16; see q4_dot and q8_lanes) and a madd
// with ones into int32; AVX2 (the avx2 class) the same with 8 features per vector; the
// portable loops (no AVX2) with scalar integers. Integer sums are exact and every fp32
// operation is the same, so all the classes give the same bits.
//
// Batch independence: quantization is per row and every (row, feature) lane runs the same
// operations whatever shares the call (tiles of rows and groups of panels only share loads),
// as in lowbit_matmul.cpp.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include "block_units.h"
#include "chunks.h"
#include "kernels.h"

#if !ZS_LOWBIT_AVX512 && defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Rows of x quantized per block of 32: xq [rows, cols] int8, then per (row, block) its scale
// d, d * S and S.
struct QuantRows {
  const int8_t* xq;
  const float* d;
  const float* sx;
  const int32_t* sum;
  int64_t cols;
  int64_t blocks;
  QuantRows offset(int64_t rows) const {
    return {xq + rows * cols, d + rows * blocks, sx + rows * blocks, sum + rows * blocks, cols,
            blocks};
  }
};

// One block of 32 inputs of a row -> xq[0..31], returns S; *d_out its scale.
inline int32_t quantize_block(const float* x, int8_t* xq, float* d_out) {
#if ZS_LOWBIT_AVX512
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
#elif defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_and_ps(_mm256_loadu_ps(x), magnitude);
  for (int64_t k = 8; k < kBlock; k += 8) {
    m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
  float amax = 0.0f;
  for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(x[k]));
#endif
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  *d_out = d;
#if ZS_LOWBIT_AVX512
  // Round half to even (the default rounding mode), as std::nearbyint below.
  const __m512 lim = _mm512_set1_ps(127.0f), neg = _mm512_set1_ps(-127.0f);
  const __m512i q_lo = _mm512_cvtps_epi32(
      _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(lo, _mm512_set1_ps(id)), neg), lim));
  const __m512i q_hi = _mm512_cvtps_epi32(
      _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(hi, _mm512_set1_ps(id)), neg), lim));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(xq), _mm512_cvtepi32_epi8(q_lo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 16), _mm512_cvtepi32_epi8(q_hi));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
#elif defined(__AVX2__)
  const __m256 lim = _mm256_set1_ps(127.0f), neg = _mm256_set1_ps(-127.0f);
  int32_t q[kBlock];
  for (int64_t k = 0; k < kBlock; k += 8) {  // rounding half to even, as AVX-512's
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(id));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k),
                        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, neg), lim)));
  }
  int32_t sum = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    xq[k] = static_cast<int8_t>(q[k]);
    sum += q[k];
  }
  return sum;
#else
  int32_t sum = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    const float v = std::min(std::max(x[k] * id, -127.0f), 127.0f);
    xq[k] = static_cast<int8_t>(std::nearbyint(v));
    sum += xq[k];
  }
  return sum;
#endif
}

#if ZS_LOWBIT_AVX512

// 64 bytes at p, byte 16 i + f (input i of 4, feature f of 16) -> byte 4 f + i: each 32-bit
// lane then holds one feature's 4 inputs, as dpbusd takes them.
inline __m512i load_transposed(const uint8_t* p) {
  const __m512i v = _mm512_loadu_si512(p);
#if defined(__AVX512VBMI__)
  // index[t] = 16 (t % 4) + t / 4
  const __m512i index = _mm512_set_epi8(
      63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12,
      59, 43, 27, 11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8,
      55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,
      51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
  return _mm512_permutexvar_epi8(index, v);
#else
  // Dwords: lane c, dword i <- dword 4 i + c (features 4c..4c+3 of input i); then in each
  // 128-bit lane byte 4 m + i <- byte 4 i + m.
  const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i bytes = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(dwords, v), bytes);
#endif
}

// The integer sums of a block, per 32-bit lane (one feature): with VNNI, dpbusd adds the 4
// products u8(u) * s8(s) of each lane to an int32 sum. Without, q4's sums go through 16-bit
// lanes, as llama.cpp's AVX2 kernels do: maddubs gives each pair's u * s (q4: at most
// 2 * 15 * 127 = 3810 in magnitude, so never saturates), the block's 8 of them are added in
// int16 (at most 30480, no overflow) and one madd with ones at the block's end sums each
// lane's two halves into int32. Both are the exact integer sum, so the classes agree.
#if defined(__AVX512VNNI__)
inline __m512i q4_dot(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline __m512i q4_block_sum(__m512i acc) { return acc; }
#else
inline __m512i q4_dot(__m512i acc, __m512i u, __m512i s) {
  return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, s));
}
inline __m512i q4_block_sum(__m512i acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
#endif

// q8's signed weights (4 inputs x 16 features, transposed) as one dot product takes them.
// With VNNI: q + 128 (q xor 0x80) as u8, and 128 * S is taken off the block's sum
// (kQ8Shift). Without: |q| as u8 (128 for -128) and the sign of q moved onto x, so maddubs
// multiplies |q| by +-x (each pair at most 2 * 128 * 127 = 32512: never saturates) and a
// madd with ones widens the pairs to int32.
struct Q8Lanes {
  __m512i u;
#if !defined(__AVX512VNNI__)
  __mmask64 negative;
#endif
};

#if defined(__AVX512VNNI__)
constexpr int32_t kQ8Shift = 128;
inline Q8Lanes q8_lanes(__m512i q) { return {_mm512_xor_si512(q, _mm512_set1_epi8(-128))}; }
inline __m512i q8_dot(__m512i acc, const Q8Lanes& w, __m512i s) {
  return _mm512_dpbusd_epi32(acc, w.u, s);
}
#else
constexpr int32_t kQ8Shift = 0;
inline Q8Lanes q8_lanes(__m512i q) { return {_mm512_abs_epi8(q), _mm512_movepi8_mask(q)}; }
inline __m512i q8_dot(__m512i acc, const Q8Lanes& w, __m512i s) {
  const __m512i signed_s = _mm512_mask_sub_epi8(s, w.negative, _mm512_setzero_si512(), s);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w.u, signed_s),
                                                 _mm512_set1_epi16(1)));
}
#endif

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

template <typename S, int64_t P, int64_t R>
inline void q4_panels(const Q4<S>& w, int64_t panel, const QuantRows& x, float* out,
                      int64_t out_stride, int64_t width) {
  constexpr int64_t kUnit = Q4<S>::kUnit;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[P][R] = {};
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* unit[P];
    for (int64_t p = 0; p < P; ++p) {
      unit[p] = w.unit(panel + p, b);
      if constexpr (R == 1) {
        const uint8_t* ahead = unit[p] + kPrefetchBlocks * kUnit;
        for (int64_t c = 0; c < kUnit; c += 64) prefetch(ahead + c);
      }
    }
    __m512i isum[P][R] = {};
    // Group j: l = 4j..4j+3, the inputs 32b + l (low nibbles) and 32b + 16 + l (high).
    for (int64_t j = 0; j < 4; ++j) {
      __m512i w_lo[P], w_hi[P];
      for (int64_t p = 0; p < P; ++p) {
        const __m512i v = load_transposed(unit[p] + 64 * j);
        w_lo[p] = _mm512_and_si512(v, low4);
        w_hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* xb = x.xq + r * x.cols + b * kBlock;
        const __m512i x_lo = broadcast4(xb + 4 * j);
        const __m512i x_hi = broadcast4(xb + 16 + 4 * j);
        for (int64_t p = 0; p < P; ++p) {
          isum[p][r] = q4_dot(isum[p][r], w_lo[p], x_lo);
          isum[p][r] = q4_dot(isum[p][r], w_hi[p], x_hi);
        }
      }
    }
    for (int64_t p = 0; p < P; ++p) {
      for (int64_t r = 0; r < R; ++r) isum[p][r] = q4_block_sum(isum[p][r]);
    }
    for (int64_t p = 0; p < P; ++p) {
      const __m512 s = load16<S>(unit[p] + 256);
      const __m512 o = load16<S>(unit[p] + 256 + kPanel * sizeof(S));
      for (int64_t r = 0; r < R; ++r) {
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(x.d[r * x.blocks + b]));
        acc[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[p][r]), sd, acc[p][r]);
        acc[p][r] = _mm512_fmadd_ps(o, _mm512_set1_ps(x.sx[r * x.blocks + b]), acc[p][r]);
      }
    }
  }
  store_panels<P, R>(acc, out, out_stride, width);
}

template <typename S, int64_t P, int64_t R>
inline void q8_panels(const Q8<S>& w, int64_t panel, const QuantRows& x, float* out,
                      int64_t out_stride, int64_t width) {
  constexpr int64_t kUnit = Q8<S>::kUnit;
  __m512 acc[P][R] = {};
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* unit[P];
    for (int64_t p = 0; p < P; ++p) {
      unit[p] = w.unit(panel + p, b);
      if constexpr (R == 1) {
        const uint8_t* ahead = unit[p] + kPrefetchBlocks * kUnit;
        for (int64_t c = 0; c < kUnit; c += 64) prefetch(ahead + c);
      }
    }
    __m512i isum[P][R] = {};
    for (int64_t j = 0; j < kBlock / 4; ++j) {  // inputs 32b + 4j .. 32b + 4j + 3
      Q8Lanes wj[P];
      for (int64_t p = 0; p < P; ++p) wj[p] = q8_lanes(load_transposed(unit[p] + 64 * j));
      for (int64_t r = 0; r < R; ++r) {
        const __m512i xj = broadcast4(x.xq + r * x.cols + b * kBlock + 4 * j);
        for (int64_t p = 0; p < P; ++p) isum[p][r] = q8_dot(isum[p][r], wj[p], xj);
      }
    }
    for (int64_t p = 0; p < P; ++p) {
      const __m512 s = load16<S>(unit[p] + kBlock * kPanel);
      for (int64_t r = 0; r < R; ++r) {
        __m512i sum = isum[p][r];
        if constexpr (kQ8Shift != 0) {
          sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(kQ8Shift * x.sum[r * x.blocks + b]));
        }
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(x.d[r * x.blocks + b]));
        acc[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), sd, acc[p][r]);
      }
    }
  }
  store_panels<P, R>(acc, out, out_stride, width);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (the avx2 class): 8 features per vector, each panel in two halves. The integer sums
// as AVX-512 without VNNI takes them (maddubs; _mm256_sign_epi8 moves q8's signs onto x),
// then per lane the same fp32 operations as every class.

// The 64 bytes at p (4 inputs x 16 features) as 2 vectors of 8 features x 4 inputs: each
// 32-bit lane holds one feature's 4 inputs, as maddubs and a madd with ones sum them.
inline void load_transposed(const uint8_t* p, __m256i (&half)[2]) {
  const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32));
  const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 48));
  const __m128i a = _mm_unpacklo_epi8(r0, r1), b = _mm_unpacklo_epi8(r2, r3);  // features 0..7
  const __m128i c = _mm_unpackhi_epi8(r0, r1), d = _mm_unpackhi_epi8(r2, r3);  // 8..15
  half[0] = _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
  half[1] = _mm256_set_m128i(_mm_unpackhi_epi16(c, d), _mm_unpacklo_epi16(c, d));
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// 8 scales (or offsets) at p as fp32.
template <typename S>
inline __m256 load8(const uint8_t* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// acc[p][r] (panel p's 16 features for row r, in two halves) to out, only the first `width`
// features of the call.
template <int64_t P, int64_t R>
inline void store_halves(const __m256 (&acc)[P][R][2], float* out, int64_t out_stride,
                         int64_t width) {
  for (int64_t p = 0; p < P; ++p) {
    const int64_t n = std::min<int64_t>(kPanel, width - kPanel * p);
    for (int64_t r = 0; r < R; ++r) {
      float lanes[kPanel];
      _mm256_storeu_ps(lanes, acc[p][r][0]);
      _mm256_storeu_ps(lanes + 8, acc[p][r][1]);
      std::memcpy(out + r * out_stride + kPanel * p, lanes, n * sizeof(float));
    }
  }
}

template <typename S, int64_t P, int64_t R>
inline void q4_panels(const Q4<S>& w, int64_t panel, const QuantRows& x, float* out,
                      int64_t out_stride, int64_t width) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[P][R][2] = {};
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* unit[P];
    for (int64_t p = 0; p < P; ++p) unit[p] = w.unit(panel + p, b);
    __m256i isum[P][R][2] = {};  // int16 pairs, as q4_dot's without VNNI
    for (int64_t j = 0; j < 4; ++j) {
      __m256i w_lo[P][2], w_hi[P][2];
      for (int64_t p = 0; p < P; ++p) {
        __m256i v[2];
        load_transposed(unit[p] + 64 * j, v);
        for (int64_t h = 0; h < 2; ++h) {
          w_lo[p][h] = _mm256_and_si256(v[h], low4);
          w_hi[p][h] = _mm256_and_si256(_mm256_srli_epi16(v[h], 4), low4);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* xb = x.xq + r * x.cols + b * kBlock;
        const __m256i x_lo = broadcast4(xb + 4 * j), x_hi = broadcast4(xb + 16 + 4 * j);
        for (int64_t p = 0; p < P; ++p) {
          for (int64_t h = 0; h < 2; ++h) {
            isum[p][r][h] = _mm256_add_epi16(isum[p][r][h], _mm256_maddubs_epi16(w_lo[p][h], x_lo));
            isum[p][r][h] = _mm256_add_epi16(isum[p][r][h], _mm256_maddubs_epi16(w_hi[p][h], x_hi));
          }
        }
      }
    }
    for (int64_t p = 0; p < P; ++p) {
      for (int64_t h = 0; h < 2; ++h) {
        const __m256 s = load8<S>(unit[p] + 256 + 8 * h * sizeof(S));
        const __m256 o = load8<S>(unit[p] + 256 + (kPanel + 8 * h) * sizeof(S));
        for (int64_t r = 0; r < R; ++r) {
          const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[p][r][h], ones));
          const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(x.d[r * x.blocks + b]));
          acc[p][r][h] = _mm256_fmadd_ps(sum, sd, acc[p][r][h]);
          acc[p][r][h] = _mm256_fmadd_ps(o, _mm256_set1_ps(x.sx[r * x.blocks + b]), acc[p][r][h]);
        }
      }
    }
  }
  store_halves<P, R>(acc, out, out_stride, width);
}

template <typename S, int64_t P, int64_t R>
inline void q8_panels(const Q8<S>& w, int64_t panel, const QuantRows& x, float* out,
                      int64_t out_stride, int64_t width) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[P][R][2] = {};
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* unit[P];
    for (int64_t p = 0; p < P; ++p) unit[p] = w.unit(panel + p, b);
    __m256i isum[P][R][2] = {};
    for (int64_t j = 0; j < kBlock / 4; ++j) {  // inputs 32b + 4j .. 32b + 4j + 3
      __m256i q[P][2], magnitude[P][2];
      for (int64_t p = 0; p < P; ++p) {
        load_transposed(unit[p] + 64 * j, q[p]);
        for (int64_t h = 0; h < 2; ++h) magnitude[p][h] = _mm256_abs_epi8(q[p][h]);
      }
      for (int64_t r = 0; r < R; ++r) {
        const __m256i xj = broadcast4(x.xq + r * x.cols + b * kBlock + 4 * j);
        for (int64_t p = 0; p < P; ++p) {
          for (int64_t h = 0; h < 2; ++h) {
            // |q| * (x with q's sign): each pair at most 2 * 128 * 127, no saturation
            const __m256i pairs =
                _mm256_maddubs_epi16(magnitude[p][h], _mm256_sign_epi8(xj, q[p][h]));
            isum[p][r][h] = _mm256_add_epi32(isum[p][r][h], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    }
    for (int64_t p = 0; p < P; ++p) {
      for (int64_t h = 0; h < 2; ++h) {
        const __m256 s = load8<S>(unit[p] + kBlock * kPanel + 8 * h * sizeof(S));
        for (int64_t r = 0; r < R; ++r) {
          const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(x.d[r * x.blocks + b]));
          acc[p][r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[p][r][h]), sd, acc[p][r][h]);
        }
      }
    }
  }
  store_halves<P, R>(acc, out, out_stride, width);
}

#else  // portable loops: the same integer sums and fp32 operations, lane by lane

template <typename S, int64_t P, int64_t R>
inline void q4_panels(const Q4<S>& w, int64_t panel, const QuantRows& x, float* out,
                      int64_t out_stride, int64_t width) {
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t r = 0; r < R; ++r) {
      float acc[kPanel] = {0};
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* unit = w.unit(panel + p, b);
        const int8_t* xb = x.xq + r * x.cols + b * kBlock;
        int32_t isum[kPanel] = {0};
        for (int64_t l = 0; l < 16; ++l) {
          for (int64_t f = 0; f < kPanel; ++f) {
            const uint8_t q = unit[l * 16 + f];
            isum[f] += (q & 0x0F) * xb[l] + (q >> 4) * xb[16 + l];
          }
        }
        const float d = x.d[r * x.blocks + b], sx = x.sx[r * x.blocks + b];
        for (int64_t f = 0; f < kPanel; ++f) {
          const float sd = scale_at<S>(unit + 256, f) * d;
          const float o = scale_at<S>(unit + 256 + kPanel * sizeof(S), f);
          acc[f] = __builtin_fmaf(static_cast<float>(isum[f]), sd, acc[f]);
          acc[f] = __builtin_fmaf(o, sx, acc[f]);
        }
      }
      const int64_t n = std::min<int64_t>(kPanel, width - kPanel * p);
      for (int64_t f = 0; f < n; ++f) out[r * out_stride + kPanel * p + f] = acc[f];
    }
  }
}

template <typename S, int64_t P, int64_t R>
inline void q8_panels(const Q8<S>& w, int64_t panel, const QuantRows& x, float* out,
                      int64_t out_stride, int64_t width) {
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t r = 0; r < R; ++r) {
      float acc[kPanel] = {0};
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* unit = w.unit(panel + p, b);
        const int8_t* xb = x.xq + r * x.cols + b * kBlock;
        int32_t isum[kPanel] = {0};
        for (int64_t k = 0; k < kBlock; ++k) {
          const int8_t* q = reinterpret_cast<const int8_t*>(unit) + k * kPanel;
          for (int64_t f = 0; f < kPanel; ++f) isum[f] += q[f] * xb[k];
        }
        const float d = x.d[r * x.blocks + b];
        for (int64_t f = 0; f < kPanel; ++f) {
          const float sd = scale_at<S>(unit + kBlock * kPanel, f) * d;
          acc[f] = __builtin_fmaf(static_cast<float>(isum[f]), sd, acc[f]);
        }
      }
      const int64_t n = std::min<int64_t>(kPanel, width - kPanel * p);
      for (int64_t f = 0; f < n; ++f) out[r * out_stride + kPanel * p + f] = acc[f];
    }
  }
}

#endif

template <typename W, int64_t P, int64_t R>
inline void panels(const W& w, int64_t panel, const QuantRows& x, float* out, int64_t stride,
                   int64_t width) {
  if constexpr (W::kFourBit) {
    q4_panels<typename W::Scale, P, R>(w, panel, x, out, stride, width);
  } else {
    q8_panels<typename W::Scale, P, R>(w, panel, x, out, stride, width);
  }
}

// Panels per pass by rows in the tile, so that accumulators, integer sums and weights stay
// in registers: 4 for one row, 2 for 2..4, 1 for 5..8. Which never changes a lane's work.
template <typename W>
inline int64_t tile_panels(const W& w, int64_t rows, int64_t p, int64_t end,
                           const QuantRows& x, float* out, int64_t stride, int64_t width) {
  const int64_t left = end - p;
  switch (rows) {
    case 1:
      if (left >= 4) return panels<W, 4, 1>(w, p, x, out, stride, width), 4;
      return panels<W, 1, 1>(w, p, x, out, stride, width), 1;
    case 2:
      if (left >= 2) return panels<W, 2, 2>(w, p, x, out, stride, width), 2;
      return panels<W, 1, 2>(w, p, x, out, stride, width), 1;
    case 3:
      if (left >= 2) return panels<W, 2, 3>(w, p, x, out, stride, width), 2;
      return panels<W, 1, 3>(w, p, x, out, stride, width), 1;
    case 4:
      if (left >= 2) return panels<W, 2, 4>(w, p, x, out, stride, width), 2;
      return panels<W, 1, 4>(w, p, x, out, stride, width), 1;
    case 5: return panels<W, 1, 5>(w, p, x, out, stride, width), 1;
    case 6: return panels<W, 1, 6>(w, p, x, out, stride, width), 1;
    case 7: return panels<W, 1, 7>(w, p, x, out, stride, width), 1;
    default: return panels<W, 1, kTile>(w, p, x, out, stride, width), 1;
  }
}

template <typename W>
void run(const W& w, int64_t num_panels, const QuantRows& x, int64_t rows, float* out,
         int64_t out_features) {
  for_each_chunk((num_panels + kChunkPanels - 1) / kChunkPanels, [&](int64_t chunk) {
    const int64_t begin = chunk * kChunkPanels;
    const int64_t end = std::min(begin + kChunkPanels, num_panels);
    for (int64_t m = 0; m < rows; m += kTile) {
      const int64_t len = std::min(kTile, rows - m);
      const QuantRows xr = x.offset(m);
      for (int64_t p = begin; p < end;) {
        p += tile_panels(w, len, p, end, xr, out + m * out_features + kPanel * p,
                         out_features, out_features - kPanel * p);
      }
    }
  });
}

template <template <typename> class W>
at::Tensor matmul(const at::Tensor& x_in, const at::Tensor& data, int64_t out_features,
                  const char* what) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
  const int64_t half_unit = W<uint16_t>::kUnit, float_unit = W<float>::kUnit;
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 3 &&
                  data.is_contiguous() &&
                  (data.size(2) == half_unit || data.size(2) == float_unit),
              what, " must be a contiguous uint8 [panels, blocks, ", half_unit, " or ",
              float_unit, "] tensor");
  const int64_t num_panels = data.size(0), blocks = data.size(1);
  TORCH_CHECK(out_features > kPanel * (num_panels - 1) && out_features <= kPanel * num_panels,
              "out_features ", out_features, " does not fit ", num_panels, " panels of 16");
  TORCH_CHECK(x_in.size(1) == blocks * kBlock, "x has ", x_in.size(1),
              " columns, the weights ", blocks * kBlock);
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  std::vector<int8_t> xq(rows * cols);
  std::vector<float> d(rows * blocks), sx(rows * blocks);
  std::vector<int32_t> sum(rows * blocks);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < rows * blocks; ++i) {
    sum[i] = quantize_block(xp + i * kBlock, xq.data() + i * kBlock, &d[i]);
    sx[i] = d[i] * static_cast<float>(sum[i]);
  }
  const QuantRows q{xq.data(), d.data(), sx.data(), sum.data(), cols, blocks};
  if (data.size(2) == half_unit) {
    run(W<uint16_t>{data.data_ptr<uint8_t>(), blocks}, num_panels, q, rows,
        out.data_ptr<float>(), out_features);
  } else {
    run(W<float>{data.data_ptr<uint8_t>(), blocks}, num_panels, q, rows,
        out.data_ptr<float>(), out_features);
  }
  return out;
}

}  // namespace

at::Tensor q4_matmul_i8(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features) {
  return matmul<Q4>(x, blocks, out_features, "q4 blocks");
}

at::Tensor q8_matmul_i8(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features) {
  return matmul<Q8>(x, blocks, out_features, "q8 blocks");
}
