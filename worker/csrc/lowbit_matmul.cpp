// Matrix products with 4-bit and 8-bit block-quantized weights and fp32 activations, for the
// CPU's decode rows.
//
// A decode step with few rows is bound by reading the weights: a dense fp32 matrix-vector
// product streams 4 bytes per weight, the file's Q4 blocks 0.56 to 0.63. These kernels read
// the blocks as the GGUF file stores them and never build a dense copy:
//
//   q4: w[n, k] = q * scale[n, b] + offset[n, b], q in 0..15, b = k / 32; each row of
//       `nibbles` holds a block's 16 bytes, elements 0..15 in the low nibbles, 16..31 in the
//       high ones (GGUF's Q4_0/Q4_1 order; worker/model/quant.py's BlockQ4 packs any 4-bit
//       blocks, Q4_K's included, this way).
//   q8: w[n, k] = q * scale[n, b], q an int8 (GGUF's Q8_0).
//
// Each block is expanded to 32 floats in registers (one fused multiply-add per weight, the
// same values as the dense copy up to the last bit) and multiplied with every row of x in
// the tile before the next block is read: the expansion is paid once per tile of rows, and
// each load of x serves a group of output features.
//
// Batch independence: every (row of x, output) pair is computed by the same sequence of
// operations whatever the number of rows, their tiling or the threads, so a row's result
// never depends on what shares its call (docs/architecture.md, "Batch independence"): tiles
// of rows and groups of features only share loads. Output features are split between
// torch's intra-op threads.
//
// Built at run time by worker/cpu_kernels.py with -O3 -march=native: the AVX-512 path where
// the CPU has it, portable loops (the same order of operations) elsewhere.

// ATen's Tensor and the two ops used (not torch/extension.h: all of libtorch's C++ API):
// this file compiles in a fraction of the time. module.cpp holds the Python bindings.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ZS_LOWBIT_AVX512 1
#endif

namespace {

constexpr int64_t kBlock = 32;
// One pass takes a group of output features (weight rows) and a tile of rows of x. A single
// row of x takes 4 features at a time (four independent sums hide the multiply-add latency);
// more rows take 2 features by up to 8 rows (each expanded block serves 8 rows; 16
// accumulators). Which, never changes a (row, feature) pair's operations.
constexpr int64_t kTile = 8;  // rows of x per pass, at most
constexpr int64_t kGroupOneRow = 4;  // features per pass for a single row of x
constexpr int64_t kGroup = 2;  // features per pass for more rows

#if ZS_LOWBIT_AVX512

// The 32 weights of one block as two vectors of 16 floats (elements 0..15 and 16..31):
// q * scale + offset, one rounding each, as the dense copy's values. The 16 possible values
// are computed once (one multiply-add over 0..15) and each weight picks its own with a
// permute, which uses only the low 4 bits of each index: no masking, and the work moves
// off the multiply-add port that the products need.
inline void q4_block(const uint8_t* bytes, float scale, float offset, __m512& lo, __m512& hi) {
  const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 table = _mm512_fmadd_ps(levels, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(packed), table);
  hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(packed, 4)), table);
}

inline void q8_block(const int8_t* values, float scale, __m512& lo, __m512& hi) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
  const __m512 s = _mm512_set1_ps(scale);
  lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(packed))), s);
  hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(packed, 1))), s);
}

// A tile of F output features by R rows of x: `load_block(f, b, lo, hi)` gives block b of
// feature f. Each block's weights are expanded once for the R rows, and each row's block
// of x is loaded once for the F features. One accumulator per (feature, row): per block
// acc += lo * x[0..15], then acc += hi * x[16..31]; at the end the 16 lanes are summed.
template <int64_t F, int64_t R, typename LoadBlock>
inline void micro(const float* x, int64_t cols, int64_t blocks, float* out, int64_t out_stride,
                  LoadBlock load_block) {
  __m512 acc[F][R];
  for (int64_t f = 0; f < F; ++f) {
    for (int64_t r = 0; r < R; ++r) acc[f][r] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 lo[F], hi[F];
    for (int64_t f = 0; f < F; ++f) load_block(f, b, lo[f], hi[f]);
    for (int64_t r = 0; r < R; ++r) {
      const float* xb = x + r * cols + b * kBlock;
      const __m512 x_lo = _mm512_loadu_ps(xb);
      const __m512 x_hi = _mm512_loadu_ps(xb + 16);
      for (int64_t f = 0; f < F; ++f) {
        acc[f][r] = _mm512_fmadd_ps(lo[f], x_lo, acc[f][r]);
        acc[f][r] = _mm512_fmadd_ps(hi[f], x_hi, acc[f][r]);
      }
    }
  }
  for (int64_t f = 0; f < F; ++f) {
    for (int64_t r = 0; r < R; ++r) out[r * out_stride + f] = _mm512_reduce_add_ps(acc[f][r]);
  }
}

#else  // portable loops in the same order of operations

inline void q4_block(const uint8_t* bytes, float scale, float offset, float* lo, float* hi) {
  for (int l = 0; l < 16; ++l) {
    lo[l] = __builtin_fmaf(static_cast<float>(bytes[l] & 0x0F), scale, offset);
    hi[l] = __builtin_fmaf(static_cast<float>(bytes[l] >> 4), scale, offset);
  }
}

inline void q8_block(const int8_t* values, float scale, float* lo, float* hi) {
  for (int l = 0; l < 16; ++l) {
    lo[l] = static_cast<float>(values[l]) * scale;
    hi[l] = static_cast<float>(values[16 + l]) * scale;
  }
}

template <int64_t F, int64_t R, typename LoadBlock>
inline void micro(const float* x, int64_t cols, int64_t blocks, float* out, int64_t out_stride,
                  LoadBlock load_block) {
  float acc[F][R][16];
  for (int64_t f = 0; f < F; ++f) {
    for (int64_t r = 0; r < R; ++r) {
      for (int l = 0; l < 16; ++l) acc[f][r][l] = 0.0f;
    }
  }
  float lo[F][16], hi[F][16];
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t f = 0; f < F; ++f) load_block(f, b, lo[f], hi[f]);
    for (int64_t r = 0; r < R; ++r) {
      const float* xb = x + r * cols + b * kBlock;
      for (int64_t f = 0; f < F; ++f) {
        for (int l = 0; l < 16; ++l) acc[f][r][l] = __builtin_fmaf(lo[f][l], xb[l], acc[f][r][l]);
        for (int l = 0; l < 16; ++l) {
          acc[f][r][l] = __builtin_fmaf(hi[f][l], xb[16 + l], acc[f][r][l]);
        }
      }
    }
  }
  for (int64_t f = 0; f < F; ++f) {
    for (int64_t r = 0; r < R; ++r) {
      // The same pairwise tree as _mm512_reduce_add_ps: halves folded 16 -> 8 -> 4 -> 2 -> 1.
      float v[16];
      for (int l = 0; l < 16; ++l) v[l] = acc[f][r][l];
      for (int width = 8; width >= 1; width /= 2) {
        for (int l = 0; l < width; ++l) v[l] = v[l] + v[l + width];
      }
      out[r * out_stride + f] = v[0];
    }
  }
}

#endif

// micro() for F features and 1..kTile rows, the counts fixed at compile time so that the
// accumulators stay in registers.
template <int64_t F, typename LoadBlock>
inline void micro_rows(const float* x, int64_t cols, int64_t blocks, int64_t rows, float* out,
                       int64_t out_stride, LoadBlock load_block) {
  switch (rows) {
    case 1: return micro<F, 1>(x, cols, blocks, out, out_stride, load_block);
    case 2: return micro<F, 2>(x, cols, blocks, out, out_stride, load_block);
    case 3: return micro<F, 3>(x, cols, blocks, out, out_stride, load_block);
    case 4: return micro<F, 4>(x, cols, blocks, out, out_stride, load_block);
    case 5: return micro<F, 5>(x, cols, blocks, out, out_stride, load_block);
    case 6: return micro<F, 6>(x, cols, blocks, out, out_stride, load_block);
    case 7: return micro<F, 7>(x, cols, blocks, out, out_stride, load_block);
    default: return micro<F, kTile>(x, cols, blocks, out, out_stride, load_block);
  }
}

// Features [n, n + count) (count kGroupOneRow, kGroup or 1) for 1..kTile rows of x.
template <typename LoadBlock>
inline void features(int64_t count, const float* x, int64_t cols, int64_t blocks, int64_t rows,
                     float* out, int64_t out_stride, LoadBlock load_block) {
  if (count == kGroupOneRow && rows == 1) {
    micro<kGroupOneRow, 1>(x, cols, blocks, out, out_stride, load_block);
  } else if (count == kGroup) {
    micro_rows<kGroup>(x, cols, blocks, rows, out, out_stride, load_block);
  } else {
    micro_rows<1>(x, cols, blocks, rows, out, out_stride, load_block);
  }
}

void check_x(const at::Tensor& x, int64_t cols) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns, the weights ", cols);
  TORCH_CHECK(cols % kBlock == 0, "the weights' columns must be a multiple of 32");
}

void check_scales(const at::Tensor& t, int64_t rows, int64_t blocks, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                  t.size(0) == rows && t.size(1) == blocks && t.is_contiguous(),
              name, " must be a contiguous float32 [rows, cols / 32] tensor");
}

// Output features per task: enough work to pay for a task, few enough to share the rows.
constexpr int64_t kGrain = 16;
constexpr int64_t kTileBytes = 24 << 10;  // of x per row tile

// `tile(n, count, x, rows, out, stride)` computes features [n, n + count) for `rows`
// (1..kTile) rows of x.
template <typename Tile>
at::Tensor run(const at::Tensor& x_in, int64_t rows_out, int64_t cols, Tile tile) {
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, rows_out}, x.options());
  if (rows == 0 || rows_out == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Row tiles small enough for x to stay in L1 while a thread's features stream past (8 rows
  // of 576, 4 of 1536); each thread reads its weights once per tile (from L2 after the first).
  const int64_t tile_rows = std::clamp<int64_t>(kTileBytes / (cols * 4), 1, kTile);
  at::parallel_for(0, rows_out, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < rows; m += tile_rows) {
      const int64_t tile_len = std::min(tile_rows, rows - m);
      const int64_t group = rows == 1 ? kGroupOneRow : kGroup;
      for (int64_t n = begin; n < end;) {
        const int64_t count = end - n >= group ? group : 1;
        tile(n, count, xp + m * cols, tile_len, op + m * rows_out + n, rows_out);
        n += count;
      }
    }
  });
  return out;
}

}  // namespace

// x [M, K] fp32, nibbles [N, K / 2] uint8, scales and offsets [N, K / 32] fp32 -> [M, N].
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& nibbles,
                        const at::Tensor& scales, const at::Tensor& offsets) {
  TORCH_CHECK(nibbles.device().is_cpu() && nibbles.scalar_type() == at::kByte &&
                  nibbles.dim() == 2 && nibbles.is_contiguous(),
              "nibbles must be a contiguous uint8 [rows, cols / 2] tensor");
  const int64_t rows_out = nibbles.size(0);
  const int64_t cols = nibbles.size(1) * 2;
  check_x(x, cols);
  const int64_t blocks = cols / kBlock;
  check_scales(scales, rows_out, blocks, "scales");
  check_scales(offsets, rows_out, blocks, "offsets");
  const uint8_t* q = nibbles.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* o = offsets.data_ptr<float>();
  return run(x, rows_out, cols, [&](int64_t n, int64_t count, const float* xr, int64_t rows,
                                    float* out, int64_t stride) {
    const uint8_t* row = q + n * (cols / 2);
    const float* scale = s + n * blocks;
    const float* offset = o + n * blocks;
    auto load = [=](int64_t f, int64_t b, auto& lo, auto& hi) {
      q4_block(row + f * (cols / 2) + b * 16, scale[f * blocks + b], offset[f * blocks + b], lo, hi);
    };
    features(count, xr, cols, blocks, rows, out, stride, load);
  });
}

// x [M, K] fp32, values [N, K] int8, scales [N, K / 32] fp32 -> [M, N].
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& values,
                        const at::Tensor& scales) {
  TORCH_CHECK(values.device().is_cpu() && values.scalar_type() == at::kChar &&
                  values.dim() == 2 && values.is_contiguous(),
              "values must be a contiguous int8 [rows, cols] tensor");
  const int64_t rows_out = values.size(0);
  const int64_t cols = values.size(1);
  check_x(x, cols);
  const int64_t blocks = cols / kBlock;
  check_scales(scales, rows_out, blocks, "scales");
  const int8_t* q = values.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  return run(x, rows_out, cols, [&](int64_t n, int64_t count, const float* xr, int64_t rows,
                                    float* out, int64_t stride) {
    const int8_t* row = q + n * cols;
    const float* scale = s + n * blocks;
    auto load = [=](int64_t f, int64_t b, auto& lo, auto& hi) {
      q8_block(row + f * cols + b * kBlock, scale[f * blocks + b], lo, hi);
    };
    features(count, xr, cols, blocks, rows, out, stride, load);
  });
}
