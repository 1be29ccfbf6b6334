// The Python module. Ops are defined next to their kernels and declared in kernels.h; the files
// with classes or many ops of their own add them through their bind_* function.
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_isa(m);
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim", py::arg("isa"), py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("rms_norm_offset", &rms_norm_offset, "Gemma's RMSNorm x̂ (1 + w) over the last dim, w1 = 1 + w in fp32",
        py::arg("isa"), py::arg("x"), py::arg("w1"), py::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a [M, 2N] = [gate | up] tensor", py::arg("isa"),
        py::arg("x"));
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up of a [M, 2N] = [gate | up] tensor",
        py::arg("isa"), py::arg("x"));
  m.def("paged_attention", &paged_attention, "attention of a flat batch of sequences over a paged KV pool",
        py::arg("isa"), py::arg("q"), py::arg("k_blocks"), py::arg("v_blocks"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0);
  m.def("rotary", &rotary, "rotary embedding (rotate-half convention) of [T, heads * head_dim] rows", py::arg("isa"),
        py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("heads"), py::arg("head_dim"));
  m.def("dense_bf16_applies", [](const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor w,
                                 c10::optional<torch::Tensor> bias) {
    return fastdraft::dense_bf16_applies(*isa, x, w, bias ? *bias : torch::Tensor());
  }, "whether dense_bf16_linear takes these x, W and bias", py::arg("isa"), py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none());
  m.def("dense_bf16_supports", [](const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor w,
                                  c10::optional<torch::Tensor> bias) {
    return fastdraft::dense_bf16_supports(*isa, x, w, bias ? *bias : torch::Tensor());
  }, "whether dense_bf16_linear takes these x, W and bias at any row count", py::arg("isa"), py::arg("x"),
        py::arg("weight"), py::arg("bias") = py::none());
  m.def("dense_bf16_linear", [](const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor w,
                                c10::optional<torch::Tensor> bias) {
    return fastdraft::dense_bf16_linear(*isa, x, w, bias ? *bias : torch::Tensor());
  }, "x [M, K] W^T (+ bias), dense bf16, AVX512-BF16 dot products, row-invariant at every M", py::arg("isa"),
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("woq_linear", &woq_linear, "INT4/INT6/INT8 weight-only linear");
  m.def("woq_block_sums", &woq_block_sums, "exact int32 block sums of a weight-only matmul (tests)");
  m.def("woq_dequantize", &woq_dequantize, "dense weight of a repacked INT4/INT6/INT8 weight");
  m.def("repack_codes", &repack_codes, "a canonical weight's codes in the kernels' tile layout", py::arg("qweight"),
        py::arg("bits"), py::arg("n"), py::arg("k"), py::arg("k_pad"), py::arg("tile"), py::arg("pad"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  bind_decoder(m);
  bind_sampling(m);
}
