// exp(x) for x <= 0, shared by the kernels that need a vectorizable exp (decode_attention.cpp's
// softmax, row_ops.cpp's SwiGLU): 2^(x log2 e) split into an integer power, set in the
// exponent bits, and a degree-6 polynomial on [-0.5, 0.5] (relative error ~2e-7). Inline and
// branch-free so that `omp simd` loops over it vectorize; std::exp does not. Internal to each
// file that includes it (each may build it with its own floating-point contraction).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// The polynomial's coefficients, highest power first (decode_attention.cpp's 16-lane
// version uses them too).
constexpr float kExpLowest = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kExpPoly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f,
                               9.618437357674640e-3f, 5.550332471162809e-2f,
                               2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

#pragma omp declare simd notinbranch
inline float exp_nonpositive(float x) {
  x = x < kExpLowest ? kExpLowest : x;
  const float t = x * kLog2e;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = kExpPoly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExpPoly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace
