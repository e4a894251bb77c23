// Matrix products with 4-bit and 8-bit block-quantized weights and fp32 activations, for the
// CPU's decode rows.
//
// A decode step with few rows is bound by reading the weights: a dense fp32 matrix-vector
// product streams 4 bytes per weight, the file's Q4 blocks 0.56 to 0.63. These kernels read
// the file's blocks (values and scales as it stores them) and never build a dense copy:
//
//   q4: w[n, k] = q * scale[n, b] + offset[n, b], q in 0..15, b = k / 32.
//   q8: w[n, k] = q * scale[n, b], q an int8 (GGUF's Q8_0).
//
// Both are stored in panels of 16 output features (worker/model/quant.py's BlockQ4 and
// BlockQ8 pack them; a last partial panel is padded with zero weights), each panel's blocks
// one after another, and each (panel, block) one unit of bytes that the kernel reads in order:
//
//   q4: 256 bytes: for l in 0..15, 16 bytes (one per feature) with q[k = 32b + l] in the low
//       nibble and q[32b + 16 + l] in the high one; then the 16 features' scales, then their
//       offsets.
//   q8: 512 bytes: for each of the block's 32 inputs, 16 int8 (one per feature); then the 16
//       features' scales.
//
// Scales and offsets are fp16 where every one of a matrix's is exactly an fp16 (Q4_0, Q4_1
// and Q8_0 store them so), else fp32 (Q4_K's products of two scales): the unit is 320 or 384
// bytes for q4, 544 or 576 for q8, and the kernel tells which from its size. Either way the
// kernel computes with the same fp32 values; fp16 only reads fewer bytes.
//
// A vector holds 16 features: for each input k the panel's 16 weights become one vector of
// floats (q * scale + offset, or q * scale: one rounding, the dense copy's value) that every
// row of the tile multiplies by its broadcast x[k]. The expansion is paid once per tile of
// rows, and no lane sums are needed at the end. Each (row, feature) lane sums its products
// one at a time, k ascending (q4: 32b + l, then 32b + 16 + l, for each b, then l).
//
// Batch independence: every (row of x, output) pair is computed by the same sequence of
// operations whatever the number of rows, their tiling or the threads, so a row's result
// never depends on what shares its call (docs/architecture.md, "Batch independence"): tiles
// of rows and groups of panels only share loads. Chunks of panels are shared between torch's
// intra-op threads (chunks.h).
//
// Built at run time by worker/cpu_kernels.py with -O3 -march=native: the AVX-512 path where
// the CPU has it, portable loops (the same operations, lane by lane) elsewhere.

// ATen's Tensor and the two ops used (not torch/extension.h: all of libtorch's C++ API):
// this file compiles in a fraction of the time. module.cpp holds the Python bindings.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include "block_units.h"
#include "chunks.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>

namespace {

// Panels per pass: 4 for a single row (four independent sums per lane hide the multiply-add
// latency), 2 for tiles of 2..8 rows (16 accumulators). Which, never changes a lane's
// operations.
constexpr int64_t kPanelsOneRow = 4;
constexpr int64_t kPanels = 2;

#if ZS_LOWBIT_AVX512

// out[r * out_stride + 16 p + f] = sum_k w[16 p + f, k] x[r, k] for P panels (from `panel`)
// and R rows of x, writing only the first `width` features.
template <typename S, int64_t P, int64_t R>
inline void q4_panels(const Q4<S>& w, int64_t panel, const float* x, int64_t cols, float* out,
                      int64_t out_stride, int64_t width) {
  constexpr int64_t kUnit = Q4<S>::kUnit;
  __m512 acc[P][R] = {};
  // float(q) for q in 0..15 by a lane permute, which reads only an index's low 4 bits: the
  // low nibble needs no mask, and the permute takes the other port than a conversion would.
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512 s[P], o[P];
    const uint8_t* nib[P];
    for (int64_t p = 0; p < P; ++p) {
      nib[p] = w.unit(panel + p, b);
      s[p] = load16<S>(nib[p] + 256);
      o[p] = load16<S>(nib[p] + 256 + kPanel * sizeof(S));
      if constexpr (R == 1) {
        // Past the end of the matrix a prefetch never faults.
        const uint8_t* ahead = nib[p] + kPrefetchBlocks * kUnit;
        for (int64_t c = 0; c < kUnit; c += 64) prefetch(ahead + c);
      }
    }
    const float* xb = x + b * kBlock;
    for (int64_t l = 0; l < 16; ++l) {
      __m512 w_lo[P], w_hi[P];
      for (int64_t p = 0; p < P; ++p) {
        const __m512i q = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(nib[p] + l * 16)));
        w_lo[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, values), s[p], o[p]);
        w_hi[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values), s[p],
                                  o[p]);
      }
      for (int64_t r = 0; r < R; ++r) {
        const __m512 x_lo = _mm512_set1_ps(xb[r * cols + l]);
        const __m512 x_hi = _mm512_set1_ps(xb[r * cols + 16 + l]);
        for (int64_t p = 0; p < P; ++p) {
          acc[p][r] = _mm512_fmadd_ps(w_lo[p], x_lo, acc[p][r]);
          acc[p][r] = _mm512_fmadd_ps(w_hi[p], x_hi, acc[p][r]);
        }
      }
    }
  }
  store_panels<P, R>(acc, out, out_stride, width);
}

template <typename S, int64_t P, int64_t R>
inline void q8_panels(const Q8<S>& w, int64_t panel, const float* x, int64_t cols, float* out,
                      int64_t out_stride, int64_t width) {
  __m512 acc[P][R] = {};
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512 s[P];
    const int8_t* val[P];
    for (int64_t p = 0; p < P; ++p) {
      const uint8_t* unit = w.unit(panel + p, b);
      val[p] = reinterpret_cast<const int8_t*>(unit);
      s[p] = load16<S>(unit + kBlock * kPanel);
      if constexpr (R == 1) {
        const uint8_t* ahead = unit + kPrefetchBlocks * Q8<S>::kUnit;
        for (int64_t c = 0; c < Q8<S>::kUnit; c += 64) prefetch(ahead + c);
      }
    }
    const float* xb = x + b * kBlock;
    for (int64_t l = 0; l < kBlock; ++l) {
      __m512 wl[P];
      for (int64_t p = 0; p < P; ++p) {
        const __m512i q = _mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(val[p] + l * kPanel)));
        wl[p] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), s[p]);
      }
      for (int64_t r = 0; r < R; ++r) {
        const __m512 xl = _mm512_set1_ps(xb[r * cols + l]);
        for (int64_t p = 0; p < P; ++p) acc[p][r] = _mm512_fmadd_ps(wl[p], xl, acc[p][r]);
      }
    }
  }
  store_panels<P, R>(acc, out, out_stride, width);
}

#else  // portable loops: the same operations, lane by lane

template <typename S, int64_t P, int64_t R>
inline void q4_panels(const Q4<S>& w, int64_t panel, const float* x, int64_t cols, float* out,
                      int64_t out_stride, int64_t width) {
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t r = 0; r < R; ++r) {
      float acc[kPanel] = {0};
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* unit = w.unit(panel + p, b);
        const float* xb = x + r * cols + b * kBlock;
        for (int64_t l = 0; l < 16; ++l) {
          const uint8_t* q = unit + l * 16;
          for (int64_t f = 0; f < kPanel; ++f) {
            const float s = scale_at<S>(unit + 256, f);
            const float o = scale_at<S>(unit + 256 + kPanel * sizeof(S), f);
            const float w_lo = __builtin_fmaf(static_cast<float>(q[f] & 0x0F), s, o);
            const float w_hi = __builtin_fmaf(static_cast<float>(q[f] >> 4), s, o);
            acc[f] = __builtin_fmaf(w_lo, xb[l], acc[f]);
            acc[f] = __builtin_fmaf(w_hi, xb[16 + l], acc[f]);
          }
        }
      }
      const int64_t n = std::min<int64_t>(kPanel, width - kPanel * p);
      for (int64_t f = 0; f < n; ++f) out[r * out_stride + kPanel * p + f] = acc[f];
    }
  }
}

template <typename S, int64_t P, int64_t R>
inline void q8_panels(const Q8<S>& w, int64_t panel, const float* x, int64_t cols, float* out,
                      int64_t out_stride, int64_t width) {
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t r = 0; r < R; ++r) {
      float acc[kPanel] = {0};
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* unit = w.unit(panel + p, b);
        const float* xb = x + r * cols + b * kBlock;
        for (int64_t l = 0; l < kBlock; ++l) {
          const int8_t* q = reinterpret_cast<const int8_t*>(unit) + l * kPanel;
          for (int64_t f = 0; f < kPanel; ++f) {
            const float s = scale_at<S>(unit + kBlock * kPanel, f);
            acc[f] = __builtin_fmaf(static_cast<float>(q[f]) * s, xb[l], acc[f]);
          }
        }
      }
      const int64_t n = std::min<int64_t>(kPanel, width - kPanel * p);
      for (int64_t f = 0; f < n; ++f) out[r * out_stride + kPanel * p + f] = acc[f];
    }
  }
}

#endif

// panels<W, P, R>(weights, panel, x, cols, out, stride, width) for P panels and R rows, the
// counts fixed at compile time so the accumulators stay in registers.
template <typename W, int64_t P, int64_t R>
inline void panels(const W& w, int64_t panel, const float* x, int64_t cols, float* out,
                   int64_t out_stride, int64_t width) {
  if constexpr (W::kFourBit) {
    q4_panels<typename W::Scale, P, R>(w, panel, x, cols, out, out_stride, width);
  } else {
    q8_panels<typename W::Scale, P, R>(w, panel, x, cols, out, out_stride, width);
  }
}

template <typename W, int64_t P>
inline void panel_rows(int64_t rows, const W& w, int64_t panel, const float* x, int64_t cols,
                       float* out, int64_t out_stride, int64_t width) {
  switch (rows) {
    case 1: return panels<W, P, 1>(w, panel, x, cols, out, out_stride, width);
    case 2: return panels<W, P, 2>(w, panel, x, cols, out, out_stride, width);
    case 3: return panels<W, P, 3>(w, panel, x, cols, out, out_stride, width);
    case 4: return panels<W, P, 4>(w, panel, x, cols, out, out_stride, width);
    case 5: return panels<W, P, 5>(w, panel, x, cols, out, out_stride, width);
    case 6: return panels<W, P, 6>(w, panel, x, cols, out, out_stride, width);
    case 7: return panels<W, P, 7>(w, panel, x, cols, out, out_stride, width);
    default: return panels<W, P, kTile>(w, panel, x, cols, out, out_stride, width);
  }
}

// x [rows, cols] times all panels -> out [rows, out_features], in chunks of kChunkPanels
// panels that the threads take in turn (chunks.h). Per chunk, each tile of up to 8 rows runs
// its panels kPanels (one row: kPanelsOneRow) at a time: the chunk's weights are read from
// memory once and stay in cache for the next tiles.
template <typename W>
void run(const W& w, int64_t num_panels, const float* x, int64_t rows, int64_t cols,
         float* out, int64_t out_features) {
  const int64_t group = rows == 1 ? kPanelsOneRow : kPanels;
  for_each_chunk((num_panels + kChunkPanels - 1) / kChunkPanels, [&](int64_t chunk) {
    const int64_t begin = chunk * kChunkPanels;
    const int64_t end = std::min(begin + kChunkPanels, num_panels);
    for (int64_t m = 0; m < rows; m += kTile) {
      const int64_t len = std::min(kTile, rows - m);
      const float* xr = x + m * cols;
      for (int64_t p = begin; p < end;) {
        const int64_t count = end - p >= group ? group : 1;
        float* dst = out + m * out_features + kPanel * p;
        const int64_t width = out_features - kPanel * p;
        if (count == kPanelsOneRow && len == 1) {
          panels<W, kPanelsOneRow, 1>(w, p, xr, cols, dst, out_features, width);
        } else if (count == kPanels) {
          panel_rows<W, kPanels>(len, w, p, xr, cols, dst, out_features, width);
        } else {
          panel_rows<W, 1>(len, w, p, xr, cols, dst, out_features, width);
        }
        p += count;
      }
    }
  });
}

// Checks x [rows, cols] and a [panels, cols / 32, unit] uint8 tensor of units; whether its
// scales are fp16 (unit `half_unit`) or fp32 (`float_unit`).
bool check_units(const at::Tensor& x, const at::Tensor& data, int64_t out_features,
                 int64_t half_unit, int64_t float_unit, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 3 &&
                  data.is_contiguous() &&
                  (data.size(2) == half_unit || data.size(2) == float_unit),
              what, " must be a contiguous uint8 [panels, blocks, ", half_unit, " or ",
              float_unit, "] tensor");
  const int64_t panels = data.size(0);
  TORCH_CHECK(out_features > kPanel * (panels - 1) && out_features <= kPanel * panels,
              "out_features ", out_features, " does not fit ", panels, " panels of 16");
  TORCH_CHECK(x.size(1) == data.size(1) * kBlock, "x has ", x.size(1), " columns, the weights ",
              data.size(1) * kBlock);
  return data.size(2) == half_unit;
}

template <template <typename> class W>
at::Tensor matmul(const at::Tensor& x_in, const at::Tensor& data, int64_t out_features,
                  const char* what) {
  const bool half = check_units(x_in, data, out_features, W<uint16_t>::kUnit, W<float>::kUnit,
                                what);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  const int64_t panels = data.size(0), blocks = data.size(1);
  if (half) {
    run(W<uint16_t>{data.data_ptr<uint8_t>(), blocks}, panels, x.data_ptr<float>(), x.size(0),
        x.size(1), out.data_ptr<float>(), out_features);
  } else {
    run(W<float>{data.data_ptr<uint8_t>(), blocks}, panels, x.data_ptr<float>(), x.size(0),
        x.size(1), out.data_ptr<float>(), out_features);
  }
  return out;
}

}  // namespace

// x [M, K] fp32; blocks [P, K / 32, unit] uint8 (P = ceil(N / 16) panels of q4 units, see
// the top of this file) -> [M, N = out_features].
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features) {
  return matmul<Q4>(x, blocks, out_features, "q4 blocks");
}

// x [M, K] fp32; blocks [P, K / 32, unit] uint8 of q8 units -> [M, out_features].
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features) {
  return matmul<Q8>(x, blocks, out_features, "q8 blocks");
}
