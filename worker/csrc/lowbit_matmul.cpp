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
// BlockQ8 pack them; a last partial panel is padded with zero weights):
//
//   q4: for panel p, block b and l in 0..15, 16 bytes (one per feature) hold q[k = 32b + l]
//       in the low nibble and q[32b + 16 + l] in the high one.
//   q8: for panel p and input k, 16 int8 (one per feature).
//   scales (and offsets) as [panel, block, 16 features].
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
// of rows and groups of panels only share loads. Panels are split between torch's intra-op
// threads.
//
// Built at run time by worker/cpu_kernels.py with -O3 -march=native: the AVX-512 path where
// the CPU has it, portable loops (the same operations, lane by lane) elsewhere.

// ATen's Tensor and the two ops used (not torch/extension.h: all of libtorch's C++ API):
// this file compiles in a fraction of the time. module.cpp holds the Python bindings.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ZS_LOWBIT_AVX512 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPanel = 16;  // output features per panel (one vector)
constexpr int64_t kTile = 8;  // rows of x per pass, at most
// Panels per pass: 4 for a single row (four independent sums per lane hide the multiply-add
// latency), 2 for tiles of 2..8 rows (16 accumulators). Which, never changes a lane's
// operations.
constexpr int64_t kPanelsOneRow = 4;
constexpr int64_t kPanels = 2;
// Blocks ahead of the current one that each panel's q4 weights are prefetched for a single
// row (bound by reading them): without, the hardware prefetchers leave it about a tenth
// slower. Tiles of rows (bound by the arithmetic) and q8 measured faster without.
constexpr int64_t kPrefetchBlocks = 2;

// One panel's weights for the current block, as a kernel sees them.
struct Q4 {
  const uint8_t* nibbles;  // [panels, blocks * 256]
  const float* scales;  // [panels, blocks * 16]
  const float* offsets;
  int64_t blocks;
};

struct Q8 {
  const int8_t* values;  // [panels, blocks * 512]
  const float* scales;  // [panels, blocks * 16]
  int64_t blocks;
};

#if ZS_LOWBIT_AVX512

template <typename T>
inline void prefetch(const T* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// acc[p][r] (panel p's 16 features for row r) to out[r * out_stride + 16 p ..], only the
// first `width` features of the call.
template <int64_t P, int64_t R>
inline void store_panels(const __m512 (&acc)[P][R], float* out, int64_t out_stride,
                         int64_t width) {
  for (int64_t p = 0; p < P; ++p) {
    const int64_t n = std::min<int64_t>(kPanel, width - kPanel * p);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t r = 0; r < R; ++r) {
      _mm512_mask_storeu_ps(out + r * out_stride + kPanel * p, mask, acc[p][r]);
    }
  }
}

// out[r * out_stride + 16 p + f] = sum_k w[16 p + f, k] x[r, k] for P panels (from `panel`)
// and R rows of x, writing only the first `width` features.
template <int64_t P, int64_t R>
inline void q4_panels(const Q4& w, int64_t panel, const float* x, int64_t cols, float* out,
                      int64_t out_stride, int64_t width) {
  __m512 acc[P][R] = {};
  const __m512i low = _mm512_set1_epi32(0x0F);
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512 s[P], o[P];
    const uint8_t* nib[P];
    for (int64_t p = 0; p < P; ++p) {
      const int64_t at = (panel + p) * w.blocks + b;
      s[p] = _mm512_loadu_ps(w.scales + at * kPanel);
      o[p] = _mm512_loadu_ps(w.offsets + at * kPanel);
      nib[p] = w.nibbles + at * 256;
      if constexpr (R == 1) {
        const int64_t ahead = at + kPrefetchBlocks;  // past the end: a prefetch never faults
        for (int64_t c = 0; c < 256; c += 64) prefetch(w.nibbles + ahead * 256 + c);
        prefetch(w.scales + ahead * kPanel);
        prefetch(w.offsets + ahead * kPanel);
      }
    }
    const float* xb = x + b * kBlock;
    for (int64_t l = 0; l < 16; ++l) {
      __m512 w_lo[P], w_hi[P];
      for (int64_t p = 0; p < P; ++p) {
        const __m512i q = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(nib[p] + l * 16)));
        w_lo[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), s[p], o[p]);
        w_hi[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), s[p], o[p]);
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

template <int64_t P, int64_t R>
inline void q8_panels(const Q8& w, int64_t panel, const float* x, int64_t cols, float* out,
                      int64_t out_stride, int64_t width) {
  __m512 acc[P][R] = {};
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512 s[P];
    const int8_t* val[P];
    for (int64_t p = 0; p < P; ++p) {
      const int64_t at = (panel + p) * w.blocks + b;
      s[p] = _mm512_loadu_ps(w.scales + at * kPanel);
      val[p] = w.values + at * kBlock * kPanel;
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

template <int64_t P, int64_t R>
inline void q4_panels(const Q4& w, int64_t panel, const float* x, int64_t cols, float* out,
                      int64_t out_stride, int64_t width) {
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t r = 0; r < R; ++r) {
      float acc[kPanel] = {0};
      for (int64_t b = 0; b < w.blocks; ++b) {
        const int64_t at = (panel + p) * w.blocks + b;
        const float* s = w.scales + at * kPanel;
        const float* o = w.offsets + at * kPanel;
        const float* xb = x + r * cols + b * kBlock;
        for (int64_t l = 0; l < 16; ++l) {
          const uint8_t* q = w.nibbles + at * 256 + l * 16;
          for (int64_t f = 0; f < kPanel; ++f) {
            const float w_lo = __builtin_fmaf(static_cast<float>(q[f] & 0x0F), s[f], o[f]);
            const float w_hi = __builtin_fmaf(static_cast<float>(q[f] >> 4), s[f], o[f]);
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

template <int64_t P, int64_t R>
inline void q8_panels(const Q8& w, int64_t panel, const float* x, int64_t cols, float* out,
                      int64_t out_stride, int64_t width) {
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t r = 0; r < R; ++r) {
      float acc[kPanel] = {0};
      for (int64_t b = 0; b < w.blocks; ++b) {
        const int64_t at = (panel + p) * w.blocks + b;
        const float* s = w.scales + at * kPanel;
        const float* xb = x + r * cols + b * kBlock;
        for (int64_t l = 0; l < kBlock; ++l) {
          const int8_t* q = w.values + at * kBlock * kPanel + l * kPanel;
          for (int64_t f = 0; f < kPanel; ++f) {
            acc[f] = __builtin_fmaf(static_cast<float>(q[f]) * s[f], xb[l], acc[f]);
          }
        }
      }
      const int64_t n = std::min<int64_t>(kPanel, width - kPanel * p);
      for (int64_t f = 0; f < n; ++f) out[r * out_stride + kPanel * p + f] = acc[f];
    }
  }
}

#endif

// Kernel<P, R>::run(weights, panel, x, cols, out, stride, width) for P panels and a runtime
// count of 1..kTile rows, the counts fixed at compile time so the accumulators stay in
// registers.
template <typename W, int64_t P, int64_t R>
inline void panels(const W& w, int64_t panel, const float* x, int64_t cols, float* out,
                   int64_t out_stride, int64_t width) {
  if constexpr (std::is_same_v<W, Q4>) {
    q4_panels<P, R>(w, panel, x, cols, out, out_stride, width);
  } else {
    q8_panels<P, R>(w, panel, x, cols, out, out_stride, width);
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

// x [rows, cols] times all panels -> out [rows, out_features]. Each thread takes a range of
// panels and, per tile of up to 8 rows, runs them kPanels (one row: kPanelsOneRow) at a time.
template <typename W>
void run(const W& w, int64_t num_panels, const float* x, int64_t rows, int64_t cols,
         float* out, int64_t out_features) {
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < rows; m += kTile) {
      const int64_t len = std::min(kTile, rows - m);
      const int64_t group = rows == 1 ? kPanelsOneRow : kPanels;
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

void check_x(const at::Tensor& x, int64_t cols) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns, the weights ", cols);
}

void check_weights(const at::Tensor& t, at::ScalarType type, const char* type_name,
                   int64_t panels, int64_t per_block, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 2 &&
                  t.size(0) == panels && t.size(1) % per_block == 0 && t.is_contiguous(),
              name, " must be a contiguous ", type_name, " [panels, blocks * ", per_block,
              "] tensor");
}

void check_panels(int64_t panels, int64_t out_features) {
  TORCH_CHECK(out_features > kPanel * (panels - 1) && out_features <= kPanel * panels,
              "out_features ", out_features, " does not fit ", panels, " panels of 16");
}

}  // namespace

// x [M, K] fp32; nibbles [P, K / 32 * 256] uint8, scales and offsets [P, K / 32 * 16] fp32
// (P = ceil(N / 16) panels, see the top of this file) -> [M, N = out_features].
at::Tensor q4_matmul(const at::Tensor& x_in, const at::Tensor& nibbles,
                     const at::Tensor& scales, const at::Tensor& offsets, int64_t out_features) {
  TORCH_CHECK(nibbles.dim() == 2, "nibbles must be 2-D [panels, blocks * 256]");
  const int64_t panels = nibbles.size(0);
  check_weights(nibbles, at::kByte, "uint8", panels, 256, "nibbles");
  const int64_t blocks = nibbles.size(1) / 256;
  check_weights(scales, at::kFloat, "float32", panels, kPanel, "scales");
  check_weights(offsets, at::kFloat, "float32", panels, kPanel, "offsets");
  TORCH_CHECK(scales.size(1) == blocks * kPanel && offsets.size(1) == blocks * kPanel,
              "scales and offsets must have one entry per feature and block");
  check_panels(panels, out_features);
  check_x(x_in, blocks * kBlock);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  const Q4 w{nibbles.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(),
             blocks};
  run(w, panels, x.data_ptr<float>(), x.size(0), blocks * kBlock, out.data_ptr<float>(),
      out_features);
  return out;
}

// x [M, K] fp32; values [P, K * 16] int8, scales [P, K / 32 * 16] fp32 -> [M, out_features].
at::Tensor q8_matmul(const at::Tensor& x_in, const at::Tensor& values,
                     const at::Tensor& scales, int64_t out_features) {
  TORCH_CHECK(values.dim() == 2, "values must be 2-D [panels, blocks * 512]");
  const int64_t panels = values.size(0);
  check_weights(values, at::kChar, "int8", panels, kBlock * kPanel, "values");
  const int64_t blocks = values.size(1) / (kBlock * kPanel);
  check_weights(scales, at::kFloat, "float32", panels, kPanel, "scales");
  TORCH_CHECK(scales.size(1) == blocks * kPanel,
              "scales must have one entry per feature and block");
  check_panels(panels, out_features);
  check_x(x_in, blocks * kBlock);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  const Q8 w{values.data_ptr<int8_t>(), scales.data_ptr<float>(), blocks};
  run(w, panels, x.data_ptr<float>(), x.size(0), blocks * kBlock, out.data_ptr<float>(),
      out_features);
  return out;
}
