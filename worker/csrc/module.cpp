// The Python module of the native CPU kernels (worker/cpu_kernels.py builds every source of
// this folder into it).

#include <torch/extension.h>

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor q4_matmul(const torch::Tensor& x, const torch::Tensor& nibbles,
                        const torch::Tensor& scales, const torch::Tensor& offsets);
torch::Tensor q8_matmul(const torch::Tensor& x, const torch::Tensor& values,
                        const torch::Tensor& scales);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& delta,
                                                      const torch::Tensor& weight, double eps);
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& k,
              const torch::Tensor& v, const torch::Tensor& slots);
torch::Tensor silu_mul(const torch::Tensor& gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "Decode attention over a paged KV pool (one query token per sequence)");
  m.def("q4_matmul", &q4_matmul,
        "x [M, K] fp32 times 4-bit block weights (nibbles [N, K/2], scales, offsets [N, K/32])");
  m.def("q8_matmul", &q8_matmul,
        "x [M, K] fp32 times 8-bit block weights (values [N, K] int8, scales [N, K/32])");
  m.def("rms_norm", &rms_norm, "RMSNorm of each fp32 row");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm of x + delta), fp32 rows");
  m.def("write_kv", &write_kv, "Store new tokens' K/V in their slots of the paged pool");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of fp32 [rows, 2 * width] rows");
  m.def("rotary", &rotary, "Rotary embedding (rotate-half layout) of fp32 [rows, heads, d]");
}

// The block products as torch operators too (torch.ops.zeroserve.q4_matmul / q8_matmul), so
// that a compiled decode step (worker/model/compiled.py) traces them as opaque calls; their
// shape functions are registered from Python (worker/model/quant.py). Eager code calls the
// functions above directly, without the dispatcher.
TORCH_LIBRARY(zeroserve, m) {
  m.def("q4_matmul(Tensor x, Tensor nibbles, Tensor scales, Tensor offsets) -> Tensor");
  m.def("q8_matmul(Tensor x, Tensor values, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(zeroserve, CPU, m) {
  m.impl("q4_matmul", &q4_matmul);
  m.impl("q8_matmul", &q8_matmul);
}
