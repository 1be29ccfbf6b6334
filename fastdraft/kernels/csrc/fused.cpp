// Fused elementwise ops of the decoder layer: the driver side. At batch 1 each PyTorch op pays
// a fixed dispatch cost whatever its size, and a layer runs dozens of them; these
// replace RMSNorm (6 ops), SiLU-and-mul (2) and rotary embedding of q and k (~12) with one call
// each, every row run by the variant's kernel (kernel_table.h).
// Reference twins: fastdraft/kernels/fused.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "kernels.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using fastdraft::elem_type;

void check_cpu_2d(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
}

// Element i of a float32 or bfloat16 tensor's data, as raw bytes.
inline char* at_elem(const torch::Tensor& x, int64_t i) {
  return static_cast<char*>(x.data_ptr()) + i * x.element_size();
}

}  // namespace

// x [M, H] -> RMSNorm of each row by `norm` (either kind) [M, H]
torch::Tensor rms_norm_of(const fastdraft::IsaPtr& isa, const torch::Tensor& x, const fastdraft::NormWeight& norm) {
  check_cpu_2d(x, "x");
  const auto& w = norm.weight;
  TORCH_CHECK(w.is_contiguous() && w.dim() == 1 && w.numel() == x.size(1) &&
                  w.scalar_type() == (norm.is_offset ? at::kFloat : x.scalar_type()),
              norm.is_offset ? "w1 must be fp32 [H]" : "weight must match x's dtype and last dim");
  auto out = torch::empty_like(x);
  const int64_t rows = x.size(0), h = x.size(1);
  const int32_t type = elem_type(x);
  const float eps = static_cast<float>(norm.eps);
  auto run = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (norm.is_offset)
        isa->table->rms_norm_offset_row(type, at_elem(x, r * h), nullptr, w.data_ptr<float>(), nullptr,
                                        at_elem(out, r * h), h, eps, 0, h);
      else
        isa->table->rms_norm_row(type, at_elem(x, r * h), nullptr, w.data_ptr(), nullptr, at_elem(out, r * h), h, eps,
                                 0, h);
    }
  };
  if (rows >= 64) at::parallel_for(0, rows, 16, run); else run(0, rows);
  return out;
}

// x [M, H], weight [H] (same dtype) -> w * x̂ [M, H]
torch::Tensor rms_norm(const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor weight, double eps) {
  return rms_norm_of(isa, x, fastdraft::NormWeight{weight, false, eps});
}

// x [M, H], w1 [H] fp32 (Gemma's 1 + weight) -> x̂ w1 [M, H], fp32 throughout, rounded once
torch::Tensor rms_norm_offset(const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor w1, double eps) {
  return rms_norm_of(isa, x, fastdraft::NormWeight{w1, true, eps});
}

// x [M, 2N] = [gate | up] -> act(gate) * up [M, N]
torch::Tensor gated_activation(const fastdraft::IsaPtr& isa, const torch::Tensor& x, fastdraft::Activation act) {
  check_cpu_2d(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dim must be even");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  auto out = torch::empty({rows, n}, x.options());
  auto run = [&](int64_t r0, int64_t r1) {
    fastdraft::gated_activation_columns(*isa, act, x.narrow(0, r0, r1 - r0), out.narrow(0, r0, r1 - r0), 0, n);
  };
  if (rows >= 8) at::parallel_for(0, rows, 4, run); else run(0, rows);
  return out;
}

torch::Tensor silu_and_mul(const fastdraft::IsaPtr& isa, torch::Tensor x) {
  return gated_activation(isa, x, fastdraft::Activation::kSilu);
}

torch::Tensor gelu_tanh_and_mul(const fastdraft::IsaPtr& isa, torch::Tensor x) {
  return gated_activation(isa, x, fastdraft::Activation::kGeluTanh);
}

// x [T, heads * head_dim] rows (any row stride), cos/sin [T, head_dim] -> rotated [T, heads * head_dim]
torch::Tensor rotary(const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                     int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == heads * head_dim, "x must be [T, heads * head_dim]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  check_cpu_2d(cos, "cos");
  check_cpu_2d(sin, "sin");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  cos.size(0) == x.size(0) && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
              "cos/sin must be [T, head_dim] in x's dtype");
  const int64_t rows = x.size(0), ld = x.stride(0);
  auto out = torch::empty({rows, heads * head_dim}, x.options());
  const int32_t type = elem_type(x);
  auto run = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      isa->table->rotary_row(type, at_elem(x, r * ld), at_elem(cos, r * head_dim), at_elem(sin, r * head_dim),
                             at_elem(out, r * heads * head_dim), heads, head_dim);
  };
  if (rows >= 64) at::parallel_for(0, rows, 16, run); else run(0, rows);
  return out;
}

void fastdraft::add_bias(const Isa& isa, const torch::Tensor& x, int64_t col0, const torch::Tensor& bias, int64_t b0,
                         int64_t b1) {
  if (b1 < 0) b1 = bias.numel();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && bias.dim() == 1 && bias.is_contiguous() &&
                  bias.scalar_type() == x.scalar_type() && col0 + bias.numel() <= x.size(1) && 0 <= b0 &&
                  b0 <= b1 && b1 <= bias.numel(),
              "bias must be [N] in x's dtype, within x's columns");
  const int32_t type = elem_type(x);
  for (int64_t r = 0; r < x.size(0); ++r) {
    char* xr = at_elem(x, r * x.stride(0) + col0 + b0);
    isa.table->add(type, xr, at_elem(bias, b0), xr, b1 - b0);
  }
}

void fastdraft::add_columns(const Isa& isa, const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out,
                            int64_t c0, int64_t c1) {
  const int64_t n = a.size(1);
  const int32_t type = elem_type(a);
  for (int64_t r = 0; r < a.size(0); ++r)
    isa.table->add(type, at_elem(a, r * n + c0), at_elem(b, r * n + c0), at_elem(out, r * n + c0), c1 - c0);
}

void fastdraft::residual_rms_norm_columns(const Isa& isa, const torch::Tensor& a, const torch::Tensor& b,
                                          const NormWeight& norm, const torch::Tensor& sum_out,
                                          const torch::Tensor& out, int64_t c0, int64_t c1) {
  const int64_t h = a.size(1);
  const auto& w = norm.weight;
  TORCH_CHECK(w.scalar_type() == (norm.is_offset ? at::kFloat : a.scalar_type()) && w.is_contiguous() &&
                  w.numel() == h, "a norm's weight must be [H]: x's dtype, or fp32 for the offset kind");
  TORCH_CHECK(0 <= c0 && c0 <= c1 && c1 <= h, "columns out of range");
  const int32_t type = elem_type(a);
  const float eps = static_cast<float>(norm.eps);
  for (int64_t r = 0; r < a.size(0); ++r) {
    const void* br = b.defined() ? at_elem(b, r * h) : nullptr;
    void* sr = sum_out.defined() ? at_elem(sum_out, r * h) : nullptr;
    if (norm.is_offset)
      isa.table->rms_norm_offset_row(type, at_elem(a, r * h), br, w.data_ptr<float>(), sr, at_elem(out, r * h), h, eps,
                                     c0, c1);
    else
      isa.table->rms_norm_row(type, at_elem(a, r * h), br, w.data_ptr(), sr, at_elem(out, r * h), h, eps, c0, c1);
  }
}

void fastdraft::gated_activation_columns(const Isa& isa, Activation act, const torch::Tensor& x,
                                         const torch::Tensor& out, int64_t c0, int64_t c1) {
  const int64_t n = out.size(1);
  const int32_t type = elem_type(x);
  const auto kernel = act == Activation::kGeluTanh ? isa.table->gelu_tanh_mul : isa.table->silu_mul;
  for (int64_t r = 0; r < x.size(0); ++r)
    kernel(type, at_elem(x, r * 2 * n + c0), at_elem(x, r * 2 * n + n + c0), at_elem(out, r * n + c0), c1 - c0);
}

void fastdraft::rope_to_paged_cache_heads(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                          const torch::Tensor& slot_mapping, PagedAttentionPlan& p, int64_t g0,
                                          int64_t g1, const NormWeight& q_norm, const NormWeight& k_norm) {
  const int64_t t_count = qkv.size(0), d = p.head_dim, group = p.heads / p.kv_heads;
  const int64_t q_size = p.heads * d, kv_size = p.kv_heads * d;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == q_size + 2 * kv_size && t_count == p.num_tokens,
              "qkv must be [T, (heads + 2 kv_heads) * head_dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == t_count && cos.size(1) == d &&
                  sin.sizes() == cos.sizes() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type() && qkv.scalar_type() == p.q_rows.scalar_type(),
              "cos/sin must be [T, head_dim] in qkv's dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == t_count && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous(), "slot_mapping must be [T] int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = p.k_blocks.size(0) * p.block_size;
  const int32_t type = elem_type(qkv);
  const auto rotary_row = p.isa->table->rotary_row;
  const size_t row_bytes = d * qkv.element_size();
  for (const auto* norm : {&q_norm, &k_norm})
    TORCH_CHECK(!norm->defined() || (norm->weight.is_contiguous() && norm->weight.numel() == d &&
                                     norm->weight.scalar_type() == (norm->is_offset ? at::kFloat : qkv.scalar_type())),
                "a q/k norm's weight must be [head_dim]: qkv's dtype, or fp32 for the offset kind");
  // Heads normalized before rotary go through this thread's scratch rows (group q heads + k).
  std::vector<char> scratch((q_norm.defined() || k_norm.defined()) ? (group + 1) * row_bytes : 0);
  // The `heads` rows from src, normalized by `norm` into the scratch where it is defined.
  auto normed = [&](const char* src, const NormWeight& norm, int64_t heads, char* tmp) -> const char* {
    if (!norm.defined()) return src;
    for (int64_t j = 0; j < heads; ++j) {
      const char* x = src + j * row_bytes;
      char* o = tmp + j * row_bytes;
      if (norm.is_offset)
        p.isa->table->rms_norm_offset_row(type, x, nullptr, norm.weight.data_ptr<float>(), nullptr, o, d,
                                          static_cast<float>(norm.eps), 0, d);
      else
        p.isa->table->rms_norm_row(type, x, nullptr, norm.weight.data_ptr(), nullptr, o, d,
                                   static_cast<float>(norm.eps), 0, d);
    }
    return tmp;
  };
  for (int64_t t = 0; t < t_count; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
    const int64_t row = t * qkv.stride(0);
    const int64_t block = slots[t] >> p.shift, offset = slots[t] & (p.block_size - 1);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t kv_off = ((block * p.kv_heads + g) * p.block_size + offset) * d;
      const char* q = normed(at_elem(qkv, row + g * group * d), q_norm, group, scratch.data());
      const char* k = normed(at_elem(qkv, row + q_size + g * d), k_norm, 1, scratch.data() + group * row_bytes);
      rotary_row(type, q, at_elem(cos, t * d), at_elem(sin, t * d), at_elem(p.q_rows, p.q_offset(t, g)), group, d);
      rotary_row(type, k, at_elem(cos, t * d), at_elem(sin, t * d), at_elem(p.k_blocks, kv_off), 1, d);
      std::memcpy(at_elem(p.v_blocks, kv_off), at_elem(qkv, row + q_size + kv_size + g * d), row_bytes);
    }
  }
}
