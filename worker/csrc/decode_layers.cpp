// A decode step's layers in one native call (worker/model/llama.py's LlamaModel, for a step
// whose rows are all decodes): for each layer, the calls LlamaLayer.decode_native makes, in
// the same order with the same kernels and the same inputs, so the result is bit for bit
// the same. At one row a step is ~300 kernel calls of a few microseconds each; from Python
// each call also pays its binding and the interpreter between calls, here none. The Python
// binding releases the GIL for the call, so the worker's other threads (the token sender)
// run beside the step.

#include <ATen/ops/add.h>

#include "kernels.h"

#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kTensorsPerLayer = 6;  // input_norm, qkv, o_proj, post_norm, gate_up, down
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o_proj, gate_up, down

// A block matrix times x: `bits` 4 (BlockQ4) or 8 (BlockQ8); with x quantized to int8
// (lowbit_int8.cpp) where `int8` (BlockQ4.decode_mm).
at::Tensor product(const at::Tensor& x, const at::Tensor& blocks, int64_t bits,
                   int64_t out_features, bool int8) {
  if (int8) {
    return bits == 4 ? q4_matmul_i8(x, blocks, out_features)
                     : q8_matmul_i8(x, blocks, out_features);
  }
  return bits == 4 ? q4_matmul(x, blocks, out_features) : q8_matmul(x, blocks, out_features);
}

}  // namespace

// x [n, hidden] fp32 (the embeddings), cos/sin the rotary tables of the rows' positions;
// per layer, `weights` holds its input_norm, qkv, o_proj, post_norm, gate_up and down blocks,
// `bits` and `out_features` its four products' (qkv, o_proj, gate_up, down), `kv_caches` its
// K and V pools; slots, block_tables and context_lens as the kernels take them;
// `int8_activations`: the products take int8 activations. -> the hidden states after the
// last layer (before the final norm).
at::Tensor decode_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                         const std::vector<at::Tensor>& weights,
                         const std::vector<int64_t>& bits,
                         const std::vector<int64_t>& out_features,
                         const std::vector<at::Tensor>& kv_caches, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                         double scale, bool int8_activations) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / kTensorsPerLayer;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kTensorsPerLayer &&
                  static_cast<int64_t>(bits.size()) == layers * kLinearsPerLayer &&
                  static_cast<int64_t>(out_features.size()) == layers * kLinearsPerLayer &&
                  static_cast<int64_t>(kv_caches.size()) == layers * 2,
              "decode_layers: per layer 6 weights, 4 bits and out_features, 2 KV pools");
  for (int64_t b : bits) TORCH_CHECK(b == 4 || b == 8, "bits must be 4 or 8");
  const int64_t n = x.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t qk_size = q_size + kv_size;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kTensorsPerLayer;
    const int64_t* b = bits.data() + i * kLinearsPerLayer;
    const int64_t* f = out_features.data() + i * kLinearsPerLayer;
    const at::Tensor& k_cache = kv_caches[2 * i];
    const at::Tensor& v_cache = kv_caches[2 * i + 1];
    at::Tensor h = rms_norm(x, w[0], eps);
    const bool i8 = int8_activations;
    at::Tensor qkv = product(h, w[1], b[0], f[0], i8);
    at::Tensor qk = rotary(qkv.narrow(1, 0, qk_size).view({n, -1, head_dim}), cos, sin);
    write_kv(k_cache, v_cache, qk.narrow(1, num_heads, num_kv_heads),
             qkv.narrow(1, qk_size, kv_size).view({n, num_kv_heads, head_dim}), slots);
    at::Tensor attn = decode_attention(qk.narrow(1, 0, num_heads), k_cache, v_cache,
                                       block_tables, context_lens, scale);
    std::tie(x, h) = add_rms_norm(x, product(attn, w[2], b[1], f[1], i8), w[3], eps);
    x = at::add(x, product(silu_mul(product(h, w[4], b[2], f[2], i8)), w[5], b[3], f[3], i8));
  }
  return x;
}
