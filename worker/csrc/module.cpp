// The Python module of the native CPU kernels (worker/cpu_kernels.py builds every source of
// this folder into it).

// torch/python.h (pybind11 and its tensor conversions) and torch/library.h, not
// torch/extension.h: the whole C++ frontend API it adds would triple the build time.
#include <torch/library.h>
#include <torch/python.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "Decode attention over a paged KV pool (one query token per sequence)");
  m.def("q4_matmul", &q4_matmul,
        "x [M, K] fp32 times 4-bit block weights in panels of 16 features (one uint8 tensor; "
        "see lowbit_matmul.cpp) -> [M, out_features]");
  m.def("q8_matmul", &q8_matmul,
        "x [M, K] fp32 times 8-bit block weights in panels of 16 features (one uint8 tensor; "
        "see lowbit_matmul.cpp) -> [M, out_features]");
  m.def("q4_matmul_i8", &q4_matmul_i8,
        "q4_matmul with x quantized to int8 per block of 32 (lowbit_int8.cpp): integer dot "
        "products, for decode rows with --int8-activations");
  m.def("q8_matmul_i8", &q8_matmul_i8,
        "q8_matmul with x quantized to int8 per block of 32 (lowbit_int8.cpp)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each fp32 row");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm of x + delta), fp32 rows");
  m.def("write_kv", &write_kv, "Store new tokens' K/V in their slots of the paged pool");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of fp32 [rows, 2 * width] rows");
  m.def("decode_layers", &decode_layers,
        "A decode step's layers in one call (decode_layers.cpp), without the GIL",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rotary", &rotary, "Rotary embedding (rotate-half layout) of fp32 [rows, heads, d]");
}

// The block products as torch operators too (torch.ops.zeroserve.q4_matmul / q8_matmul), so
// that a compiled decode step (worker/model/compiled.py) traces them as opaque calls; their
// shape functions are registered from Python (worker/model/quant.py). Eager code calls the
// functions above directly, without the dispatcher.
TORCH_LIBRARY(zeroserve, m) {
  m.def("q4_matmul(Tensor x, Tensor blocks, int out_features) -> Tensor");
  m.def("q8_matmul(Tensor x, Tensor blocks, int out_features) -> Tensor");
  m.def("q4_matmul_i8(Tensor x, Tensor blocks, int out_features) -> Tensor");
  m.def("q8_matmul_i8(Tensor x, Tensor blocks, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(zeroserve, CPU, m) {
  m.impl("q4_matmul", &q4_matmul);
  m.impl("q8_matmul", &q8_matmul);
  m.impl("q4_matmul_i8", &q4_matmul_i8);
  m.impl("q8_matmul_i8", &q8_matmul_i8);
}
