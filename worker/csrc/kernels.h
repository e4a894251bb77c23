// The kernels' entry points, one declaration each: defined in this folder's sources, bound
// to Python by module.cpp, and called from one another (decode_layers.cpp).

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <vector>

// decode_attention.cpp
at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor context_lens, double scale);

// lowbit_matmul.cpp
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features);
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features);

// lowbit_int8.cpp: the same blocks times x quantized to int8 per block of 32
at::Tensor q4_matmul_i8(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features);
at::Tensor q8_matmul_i8(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features);

// row_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k,
              const at::Tensor& v, const at::Tensor& slots);
at::Tensor silu_mul(const at::Tensor& gate_up);

// decode_layers.cpp
at::Tensor decode_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                         const std::vector<at::Tensor>& weights,
                         const std::vector<int64_t>& bits,
                         const std::vector<int64_t>& out_features,
                         const std::vector<at::Tensor>& kv_caches, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                         double scale, bool int8_activations);
