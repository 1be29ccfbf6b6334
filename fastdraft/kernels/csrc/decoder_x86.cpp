// A whole Llama-style decoder stack for decode and speculative verification (a few tokens of
// one sequence appended to its cached prefix), run as one C++ call per forward pass.
//
// At batch 1 the per-layer work is a handful of weight-bound matmuls plus small elementwise
// ops; driving ~15 ops per layer from Python costs more than the elementwise work itself
// (measured here: ~5 ms of a ~25 ms 1.5B INT4 step). This file strings together the same
// kernels the Python path calls (rms_norm, woq_linear, rotary, decode_attention,
// silu_and_mul), in the same order and dtypes, so both paths give bit-identical results.
// The twin is the PyTorch module path in fastdraft/models/llama.py.
#include <torch/extension.h>

#include <memory>
#include <vector>

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t num_tokens);
torch::Tensor woq_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros,
                         int64_t bits, int64_t n, int64_t k_pad, int64_t block, int64_t group, double zero_const);

namespace {

// One projection: a dense weight (oneDNN GEMM, padded to min_rows like the Python path), a
// repacked INT4/INT8 weight (woq_linear), or projections of different formats run one by one
// with their outputs concatenated (e.g. an INT8 v_proj beside INT4 q/k). The bias is in the
// activation dtype.
struct Linear {
  torch::Tensor weight;  // dense [N, K], undefined for weight-only
  torch::Tensor packed, scales, zeros, bias;
  int64_t bits = 0, out_features = 0, k_pad = 0, block = 0, group = 0, min_rows = 1;
  double zero_const = 0.0;
  std::vector<std::shared_ptr<Linear>> parts;  // non-empty: the concatenation of these

  torch::Tensor operator()(const torch::Tensor& x) const {  // x [M, K]
    if (!parts.empty()) {
      std::vector<torch::Tensor> outs;
      for (const auto& part : parts) outs.push_back((*part)(x));
      return at::cat(outs, 1);
    }
    if (weight.defined()) {
      const int64_t m = x.size(0);
      if (m >= min_rows) return at::linear(x, weight, bias);
      auto padded = at::constant_pad_nd(x, {0, 0, 0, min_rows - m});
      return at::linear(padded, weight, bias).narrow(0, 0, m);
    }
    auto y = woq_linear(x, packed, scales, zeros, bits, out_features, k_pad, block, group, zero_const);
    return bias.defined() ? y + bias : y;
  }
};

std::shared_ptr<Linear> dense_linear(torch::Tensor weight, c10::optional<torch::Tensor> bias, int64_t min_rows) {
  auto lin = std::make_shared<Linear>();
  lin->weight = weight;
  if (bias) lin->bias = *bias;
  lin->min_rows = min_rows;
  return lin;
}

std::shared_ptr<Linear> woq_linear_op(torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros, int64_t bits,
                                      int64_t out_features, int64_t k_pad, int64_t block, int64_t group,
                                      double zero_const, c10::optional<torch::Tensor> bias) {
  auto lin = std::make_shared<Linear>();
  lin->packed = packed;
  lin->scales = scales;
  lin->zeros = zeros;
  lin->bits = bits;
  lin->out_features = out_features;
  lin->k_pad = k_pad;
  lin->block = block;
  lin->group = group;
  lin->zero_const = zero_const;
  if (bias) lin->bias = *bias;
  return lin;
}

struct DecoderLayer {
  torch::Tensor input_norm, post_attention_norm;  // [hidden]
  double eps;
  std::shared_ptr<Linear> qkv, o_proj, gate_up, down;  // qkv: [q | k | v], gate_up: [gate | up]
  int64_t num_heads, num_kv_heads, head_dim;
  double scale;
};

// h [T, hidden] -> h after the layer; writes the T new keys/values at start..start+T-1.
torch::Tensor layer_forward(const DecoderLayer& layer, const torch::Tensor& h, const torch::Tensor& cos,
                            const torch::Tensor& sin, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            int64_t start) {
  const int64_t num_tokens = h.size(0), d = layer.head_dim;
  const int64_t q_size = layer.num_heads * d, kv_size = layer.num_kv_heads * d;
  const int64_t group = layer.num_heads / layer.num_kv_heads;
  auto qkv = (*layer.qkv)(rms_norm(h, layer.input_norm, layer.eps));  // [T, q_size + 2 * kv_size]
  auto q = rotary(qkv.narrow(1, 0, q_size), cos, sin, layer.num_heads, d);  // [T, q_size]
  auto k = rotary(qkv.narrow(1, q_size, kv_size), cos, sin, layer.num_kv_heads, d);
  auto v = qkv.narrow(1, q_size + kv_size, kv_size);
  // Cache [kv_heads, max_seq_len, head_dim] <- [T, kv_heads, head_dim]
  k_cache.narrow(1, start, num_tokens).copy_(k.view({num_tokens, layer.num_kv_heads, d}).transpose(0, 1));
  v_cache.narrow(1, start, num_tokens).copy_(v.view({num_tokens, layer.num_kv_heads, d}).transpose(0, 1));
  // Token t sees exactly its prefix (causal over the new tokens); grouped query heads fold
  // into the row axis, token-major: [1, kv_heads, T * group, head_dim].
  auto q_rows = q.view({num_tokens, layer.num_kv_heads, group, d}).permute({1, 0, 2, 3})
                    .reshape({1, layer.num_kv_heads, num_tokens * group, d});
  auto keys = k_cache.narrow(1, 0, start + num_tokens).unsqueeze(0);  // [1, kv_heads, L, head_dim]
  auto values = v_cache.narrow(1, 0, start + num_tokens).unsqueeze(0);
  auto attn = decode_attention(q_rows, keys, values, layer.scale, num_tokens)
                  .view({layer.num_kv_heads, num_tokens, group, d}).permute({1, 0, 2, 3})
                  .reshape({num_tokens, q_size});  // [T, q_size]
  auto hidden = h + (*layer.o_proj)(attn);
  auto gate_up = (*layer.gate_up)(rms_norm(hidden, layer.post_attention_norm, layer.eps));
  return hidden + (*layer.down)(silu_and_mul(gate_up));
}

}  // namespace

// All layers for T tokens of one sequence. hidden [T, hidden]; cos/sin [T, head_dim];
// k_cache/v_cache [>= num_layers (a draft may share a deeper target's cache), kv_heads, max_seq_len, head_dim] (one slot of the KV cache).
torch::Tensor decoder_forward(const std::vector<std::shared_ptr<DecoderLayer>>& layers, torch::Tensor hidden,
                              torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                              int64_t start) {
  TORCH_CHECK(hidden.dim() == 2 && cos.dim() == 2 && sin.dim() == 2, "hidden, cos, sin must be 2-D");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(0) >= static_cast<int64_t>(layers.size()),
              "k/v cache must be [>= num_layers, kv_heads, max_seq_len, head_dim]");
  TORCH_CHECK(start >= 0 && start + hidden.size(0) <= k_cache.size(2), "tokens do not fit in the KV cache");
  torch::NoGradGuard no_grad;
  auto h = hidden.contiguous();
  auto c = cos.contiguous(), s = sin.contiguous();
  for (size_t i = 0; i < layers.size(); ++i)
    h = layer_forward(*layers[i], h, c, s, k_cache[i], v_cache[i], start);
  return h;
}

void bind_decoder(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Linear, std::shared_ptr<Linear>>(m, "Linear");
  m.def("dense_linear", &dense_linear, py::arg("weight"), py::arg("bias"), py::arg("min_rows"));
  m.def("woq_linear_op", &woq_linear_op, py::arg("packed"), py::arg("scales"), py::arg("zeros"), py::arg("bits"),
        py::arg("out_features"), py::arg("k_pad"), py::arg("block"), py::arg("group"), py::arg("zero_const"),
        py::arg("bias"));
  m.def("concat_linear", [](std::vector<std::shared_ptr<Linear>> parts) {
          TORCH_CHECK(!parts.empty(), "concat_linear needs at least one part");
          auto lin = std::make_shared<Linear>();
          lin->parts = std::move(parts);
          return lin;
        }, py::arg("parts"));
  py::class_<DecoderLayer, std::shared_ptr<DecoderLayer>>(m, "DecoderLayer")
      .def(py::init([](torch::Tensor input_norm, torch::Tensor post_attention_norm, double eps,
                       std::shared_ptr<Linear> qkv, std::shared_ptr<Linear> o_proj, std::shared_ptr<Linear> gate_up,
                       std::shared_ptr<Linear> down, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       double scale) {
             TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
             return std::make_shared<DecoderLayer>(DecoderLayer{input_norm, post_attention_norm, eps, qkv, o_proj, gate_up,
                                                                down, num_heads, num_kv_heads, head_dim, scale});
           }),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("eps"), py::arg("qkv"), py::arg("o_proj"),
           py::arg("gate_up"), py::arg("down"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("scale"));
  m.def("decoder_forward", &decoder_forward, "all decoder layers for a few tokens of one sequence");
}
