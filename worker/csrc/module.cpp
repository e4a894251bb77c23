// The Python module of the native CPU kernels (worker/cpu_kernels.py builds every source of
// this folder into it).

#include <torch/extension.h>

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor q4_matmul(const torch::Tensor& x, const torch::Tensor& nibbles,
                        const torch::Tensor& scales, const torch::Tensor& offsets);
torch::Tensor q8_matmul(const torch::Tensor& x, const torch::Tensor& values,
                        const torch::Tensor& scales);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "Decode attention over a paged KV pool (one query token per sequence)");
  m.def("q4_matmul", &q4_matmul,
        "x [M, K] fp32 times 4-bit block weights (nibbles [N, K/2], scales, offsets [N, K/32])");
  m.def("q8_matmul", &q8_matmul,
        "x [M, K] fp32 times 8-bit block weights (values [N, K] int8, scales [N, K/32])");
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
