// What the 4-bit and 8-bit block kernels share (lowbit_matmul.cpp: fp32 activations,
// lowbit_int8.cpp: int8 activations): the constants of the panel layout, the view of a
// matrix's units, and the small loads and stores around the lanes' arithmetic. The layout
// itself is described in lowbit_matmul.cpp.

#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ZS_LOWBIT_AVX512 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPanel = 16;  // output features per panel (one vector)
constexpr int64_t kTile = 8;  // rows of x per pass, at most
// Panels per chunk of work (chunks.h): small enough that a thread held up by the OS leaves
// little for the others to wait on, a multiple of both panel groups.
constexpr int64_t kChunkPanels = 4;
// Blocks ahead of the current one that each panel's units are prefetched for a single row
// (bound by reading them): without, the hardware prefetchers leave it about a tenth slower.
// Tiles of rows (bound by the arithmetic) measured faster without.
constexpr int64_t kPrefetchBlocks = 2;

// A matrix's units as a kernel sees them: each (panel, block) is kValueBytes of weights,
// then kScaleRuns runs of 16 scale-like values of type S: uint16_t (fp16 bits) or float.
template <typename S, int64_t kValueBytes, int64_t kScaleRuns>
struct Units {
  using Scale = S;
  static constexpr bool kFourBit = kScaleRuns == 2;  // q4: scales and offsets
  static constexpr int64_t kUnit = kValueBytes + kScaleRuns * kPanel * sizeof(S);
  const uint8_t* data;  // [panels, blocks, kUnit]
  int64_t blocks;
  const uint8_t* unit(int64_t panel, int64_t b) const { return data + (panel * blocks + b) * kUnit; }
};

template <typename S>
using Q4 = Units<S, 256, 2>;  // nibbles, scales, offsets
template <typename S>
using Q8 = Units<S, kBlock * kPanel, 1>;  // int8 values, scales

#if ZS_LOWBIT_AVX512

template <typename T>
inline void prefetch(const T* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// 16 scales (or offsets) at p as fp32.
template <typename S>
inline __m512 load16(const uint8_t* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_loadu_ps(p);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
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

#else

// Feature f's scale (or offset) of the run at p, as fp32 (exact from fp16).
template <typename S>
inline float scale_at(const uint8_t* p, int64_t f) {
  S v;
  std::memcpy(&v, p + f * sizeof(S), sizeof v);
  if constexpr (std::is_same_v<S, float>) {
    return v;
  } else {
    return c10::detail::fp16_ieee_to_fp32_value(v);
  }
}

#endif

}  // namespace
