// Matrix products with 4-bit and 8-bit block-quantized weights and fp32 activations, for the
// CPU's decode rows.
//
// A decode step with few rows is bound by reading the weights: a dense fp32 matrix-vector
// product streams 4 bytes per weight, the file's Q4 blocks 0.56 to 0.63. These kernels read
// the blocks as the GGUF file stores them and never build a dense copy:
//
//   q4: w[n, k] = q * scale[n, b] + offset[n, b], q in 0..15, b = k / 32; each row of
//       `nibbles` holds a block's 16 bytes, elements 0..15 in the low nibbles, 16..31 in the
//       high ones (GGUF's Q4_0/Q4_1 order; Q4_K is brought to it by worker/model/kquant.py).
//   q8: w[n, k] = q * scale[n, b], q an int8 (GGUF's Q8_0).
//
// Each block is expanded to 32 floats in registers (one fused multiply-add per weight, the
// same values as the dense copy up to the last bit) and multiplied with every row of x in
// the tile before the next block is read: the expansion is paid once per tile, not per row.
//
// Batch independence: every (row of x, output) pair is computed by the same sequence of
// operations whatever the number of rows, their tiling or the threads, so a row's result
// never depends on what shares its call (docs/architecture.md, "Batch independence"). Rows
// of x are taken in tiles that share each load and conversion of a block of weights; output
// features are split between torch's intra-op threads.
//
// Built at run time by worker/cpu_kernels.py with -O3 -march=native: the AVX-512 path where
// the CPU has it, portable loops (the same order of operations) elsewhere.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ZS_LOWBIT_AVX512 1
#endif


namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 8;  // rows of x per pass over a row of weights

#if ZS_LOWBIT_AVX512

// The 32 weights of one block as two vectors of 16 floats (elements 0..15 and 16..31):
// q * scale + offset, one rounding each, as the dense copy's values.
inline void q4_block(const uint8_t* bytes, float scale, float offset, __m512& lo, __m512& hi) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m512 s = _mm512_set1_ps(scale);
  const __m512 o = _mm512_set1_ps(offset);
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, mask))), s, o);
  hi = _mm512_fmadd_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), mask))), s, o);
}

inline void q8_block(const int8_t* values, float scale, __m512& lo, __m512& hi) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
  const __m512 s = _mm512_set1_ps(scale);
  lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(packed))), s);
  hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(packed, 1))), s);
}

// Rows [0, tile) of x against one output feature: `load_block(b, lo, hi)` gives block b's
// weights. Two accumulators per row (the block's first and second halves).
template <int64_t Tile, typename LoadBlock>
inline void dot_rows(const float* x, int64_t cols, int64_t blocks, int64_t tile, float* out,
                     int64_t out_stride, LoadBlock load_block) {
  __m512 acc_lo[Tile], acc_hi[Tile];
  for (int64_t r = 0; r < Tile; ++r) {
    acc_lo[r] = _mm512_setzero_ps();
    acc_hi[r] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 lo, hi;
    load_block(b, lo, hi);
    for (int64_t r = 0; r < Tile; ++r) {
      if (r >= tile) break;
      const float* xb = x + r * cols + b * kBlock;
      acc_lo[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc_lo[r]);
      acc_hi[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc_hi[r]);
    }
  }
  for (int64_t r = 0; r < Tile; ++r) {
    if (r >= tile) break;
    out[r * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r]));
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

template <int64_t Tile, typename LoadBlock>
inline void dot_rows(const float* x, int64_t cols, int64_t blocks, int64_t tile, float* out,
                     int64_t out_stride, LoadBlock load_block) {
  float acc_lo[Tile][16], acc_hi[Tile][16];
  for (int64_t r = 0; r < Tile; ++r) {
    for (int l = 0; l < 16; ++l) acc_lo[r][l] = acc_hi[r][l] = 0.0f;
  }
  float lo[16], hi[16];
  for (int64_t b = 0; b < blocks; ++b) {
    load_block(b, lo, hi);
    for (int64_t r = 0; r < tile; ++r) {
      const float* xb = x + r * cols + b * kBlock;
      for (int l = 0; l < 16; ++l) {
        acc_lo[r][l] = __builtin_fmaf(lo[l], xb[l], acc_lo[r][l]);
        acc_hi[r][l] = __builtin_fmaf(hi[l], xb[16 + l], acc_hi[r][l]);
      }
    }
  }
  for (int64_t r = 0; r < tile; ++r) {
    // The same pairwise tree as _mm512_reduce_add_ps: halves folded 16 -> 8 -> 4 -> 2 -> 1.
    float v[16];
    for (int l = 0; l < 16; ++l) v[l] = acc_lo[r][l] + acc_hi[r][l];
    for (int width = 8; width >= 1; width /= 2) {
      for (int l = 0; l < width; ++l) v[l] = v[l] + v[l + width];
    }
    out[r * out_stride] = v[0];
  }
}

#endif

void check_x(const torch::Tensor& x, int64_t cols) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns, the weights ", cols);
  TORCH_CHECK(cols % kBlock == 0, "the weights' columns must be a multiple of 32");
}

void check_scales(const torch::Tensor& t, int64_t rows, int64_t blocks, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 2 &&
                  t.size(0) == rows && t.size(1) == blocks && t.is_contiguous(),
              name, " must be a contiguous float32 [rows, cols / 32] tensor");
}

// Output features per task: enough work to pay for a task, few enough to share the rows.
constexpr int64_t kGrain = 16;

template <typename RowKernel>
torch::Tensor run(const torch::Tensor& x_in, int64_t rows_out, int64_t cols, RowKernel kernel) {
  const torch::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0);
  torch::Tensor out = torch::empty({rows, rows_out}, x.options());
  if (rows == 0 || rows_out == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows_out, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < rows; m += kTile) {
        const int64_t tile = std::min(kTile, rows - m);
        kernel(n, xp + m * cols, tile, op + m * rows_out + n, rows_out);
      }
    }
  });
  return out;
}

}  // namespace

// x [M, K] fp32, nibbles [N, K / 2] uint8, scales and offsets [N, K / 32] fp32 -> [M, N].
torch::Tensor q4_matmul(const torch::Tensor& x, const torch::Tensor& nibbles,
                        const torch::Tensor& scales, const torch::Tensor& offsets) {
  TORCH_CHECK(nibbles.device().is_cpu() && nibbles.scalar_type() == torch::kUInt8 &&
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
  return run(x, rows_out, cols, [&](int64_t n, const float* xr, int64_t tile, float* out,
                                    int64_t stride) {
    const uint8_t* row = q + n * (cols / 2);
    const float* scale = s + n * blocks;
    const float* offset = o + n * blocks;
    dot_rows<kTile>(xr, cols, blocks, tile, out, stride, [=](int64_t b, auto& lo, auto& hi) {
      q4_block(row + b * 16, scale[b], offset[b], lo, hi);
    });
  });
}

// x [M, K] fp32, values [N, K] int8, scales [N, K / 32] fp32 -> [M, N].
torch::Tensor q8_matmul(const torch::Tensor& x, const torch::Tensor& values,
                        const torch::Tensor& scales) {
  TORCH_CHECK(values.device().is_cpu() && values.scalar_type() == torch::kInt8 &&
                  values.dim() == 2 && values.is_contiguous(),
              "values must be a contiguous int8 [rows, cols] tensor");
  const int64_t rows_out = values.size(0);
  const int64_t cols = values.size(1);
  check_x(x, cols);
  const int64_t blocks = cols / kBlock;
  check_scales(scales, rows_out, blocks, "scales");
  const int8_t* q = values.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  return run(x, rows_out, cols, [&](int64_t n, const float* xr, int64_t tile, float* out,
                                    int64_t stride) {
    const int8_t* row = q + n * cols;
    const float* scale = s + n * blocks;
    dot_rows<kTile>(xr, cols, blocks, tile, out, stride, [=](int64_t b, auto& lo, auto& hi) {
      q8_block(row + b * kBlock, scale[b], lo, hi);
    });
  });
}
