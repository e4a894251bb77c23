// The small per-row operations of a decoder layer in fp32, one call each.
//
// At one decode row a layer's RMSNorm is six or more torch operations (pow, mean, add, rsqrt,
// mul, mul and their dtype copies), each a dispatch of a few microseconds for 576 numbers;
// rotary is a cat, two muls and an add. Together they took more of a batch-1 step on the
// CPU than the 4-bit projections. Here each is one pass over the row:
//
//   rms_norm:      out = (x * (1 / sqrt(mean(x * x) + eps))) * weight, per row
//   add_rms_norm:  x + delta, and rms_norm of that sum (the residual add before a norm)
//   rotary:        out = x * cos + rotate_half(x) * sin, per (row, head), sin signed
//   silu_mul:      SwiGLU's silu(gate) * up
//   write_kv:      the new tokens' K and V into their pool slots (two index_copy_ calls;
//                  fp32 K/V into a bf16 pool rounded to nearest even, as torch rounds)
//
// The operations and their order are HF's (multiply by the reciprocal square root, then by
// the weight; rotary's two products then their sum, never fused into a multiply-add: this
// file is built without contraction for that), so rotary matches torch bit for bit, the
// norms up to the order of the sum of squares, silu within ~1e-6 relative (fast_exp.h). Rows are independent: a row's result never
// depends on the other rows of the call.

#pragma GCC optimize("fp-contract=off")

// ATen's Tensor and the two ops used (not torch/extension.h: all of libtorch's C++ API):
// this file compiles in a fraction of the time. module.cpp holds the Python bindings.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <ATen/Parallel.h>

#include "fast_exp.h"
#include "kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Sum of squares in 16 lanes, folded pairwise: the same order on every call.
inline float sum_squares(const float* x, int64_t n) {
  float lanes[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) lanes[l] += x[i + l] * x[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) lanes[l] += x[i] * x[i];
  for (int width = 8; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] = lanes[l] + lanes[l + width];
  }
  return lanes[0];
}

inline void norm_row(const float* x, const float* weight, float eps, int64_t n, float* out) {
  const float variance = sum_squares(x, n) / static_cast<float>(n);
  const float scale = 1.0f / std::sqrt(variance + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * scale) * weight[i];
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be a contiguous float32 vector of x's width");
}

// Rows per task: a row is ~1 microsecond, so small calls stay on one thread.
constexpr int64_t kRowGrain = 32;

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * n, wp, static_cast<float>(eps), n, op + r * n);
  });
  return out;
}

// (x + delta, rms_norm(x + delta)).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                      const at::Tensor& delta,
                                                      const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == at::kFloat &&
                  delta.is_contiguous(),
              "delta must be a contiguous float32 tensor of x's shape");
  at::Tensor sum = at::empty_like(x);
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* s = sp + r * n;
      for (int64_t i = 0; i < n; ++i) s[i] = xp[r * n + i] + dp[r * n + i];
      norm_row(s, wp, static_cast<float>(eps), n, op + r * n);
    }
  });
  return {sum, out};
}

// x [rows, heads, d] (rows and heads may be strided, d contiguous), cos and sin [rows, 1, d]
// or [rows, d] contiguous -> contiguous [rows, heads, d].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 &&
                  x.stride(2) == 1,
              "x must be a float32 [rows, heads, head_dim] CPU tensor, head_dim contiguous");
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * d &&
                  sin.numel() == rows * d,
              "cos and sin must be contiguous float32 [rows, 1, head_dim]");
  at::Tensor out = at::empty({rows, heads, d}, x.options());
  const int64_t half = d / 2;
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * d;
      const float* s = sp + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        const float* in = xp + r * row_stride + h * head_stride;
        float* o = op + (r * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) o[i] = in[i] * c[i] + in[i + half] * s[i];
        for (int64_t i = half; i < d; ++i) o[i] = in[i] * c[i] + in[i - half] * s[i];
      }
    }
  });
  return out;
}

// Store new tokens' K and V in their pool slots: k_cache/v_cache [num_blocks, block_size,
// kv_heads, d] contiguous, k/v [n, kv_heads, d] (rows and heads may be strided, d contiguous),
// slots [n] int64 flat slot numbers. One copy per (token, head); a slot outside the pool
// raises IndexError before anything is written.
void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k,
              const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "the K and V pools must be alike contiguous [blocks, block_size, heads, d] CPU tensors");
  const int64_t n = slots.size(0), heads = k_cache.size(2), d = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == heads && t->size(2) == d &&
                    t->stride(2) == 1 && t->scalar_type() == k.scalar_type() &&
                    (t->scalar_type() == k_cache.scalar_type() ||
                     (t->scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)),
                "k and v must be [n, kv_heads, head_dim] in the pool's dtype (or float32 into a "
                "bfloat16 pool), head_dim contiguous");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots must be a contiguous int64 vector");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(sp[i] >= 0 && sp[i] < num_slots, "slot ", sp[i], " is outside the pool of ",
                      num_slots);
  }
  if (k.scalar_type() != k_cache.scalar_type()) {
    // fp32 K/V into a bf16 pool (--kv-cache-dtype bfloat16): rounded to nearest even, as
    // torch's .to(torch.bfloat16) rounds.
    auto narrow = [&](at::Tensor& cache, const at::Tensor& src) {
      at::BFloat16* base = cache.data_ptr<at::BFloat16>();
      const float* in = src.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t h = 0; h < heads; ++h) {
          at::BFloat16* dst = base + (sp[i] * heads + h) * d;
          const float* from = in + i * src.stride(0) + h * src.stride(1);
          for (int64_t j = 0; j < d; ++j) dst[j] = at::BFloat16(from[j]);
        }
      }
    };
    narrow(k_cache, k);
    narrow(v_cache, v);
    return;
  }
  const int64_t elem = k_cache.element_size();
  const int64_t row = heads * d * elem;
  auto store = [&](at::Tensor& cache, const at::Tensor& src) {
    char* base = static_cast<char*>(cache.data_ptr());
    const char* in = static_cast<const char*>(src.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(base + sp[i] * row + h * d * elem,
                    in + (i * src.stride(0) + h * src.stride(1)) * elem, d * elem);
      }
    }
  };
  store(k_cache, k);
  store(v_cache, v);
}

// SwiGLU's activation: gate_up [rows, 2 * width] (gate then up, as the fused projection
// gives them) -> silu(gate) * up [rows, width]. silu(g) = g * sigmoid(g), the sigmoid from
// e = exp(-|g|) <= 1 (1 / (1 + e) for g >= 0, e / (1 + e) below), which never overflows.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat &&
                  gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous float32 [rows, 2 * width] CPU tensor");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * 2 * width;
      const float* u = g + width;
      float* o = op + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float e = exp_nonpositive(-std::fabs(g[i]));
        const float sigmoid = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
        o[i] = (g[i] * sigmoid) * u[i];
      }
    }
  });
  return out;
}
