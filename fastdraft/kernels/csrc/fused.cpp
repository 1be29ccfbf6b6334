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

// x [M, H], weight [H] (same dtype) -> [M, H]
torch::Tensor rms_norm(const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor weight, double eps) {
  check_cpu_2d(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must match x's dtype and last dim");
  auto out = torch::empty_like(x);
  const int64_t rows = x.size(0), h = x.size(1);
  const int32_t type = elem_type(x);
  auto run = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      isa->table->rms_norm_row(type, at_elem(x, r * h), nullptr, weight.data_ptr(), nullptr, at_elem(out, r * h), h,
                               static_cast<float>(eps), 0, h);
  };
  if (rows >= 64) at::parallel_for(0, rows, 16, run); else run(0, rows);
  return out;
}

// x [M, 2N] = [gate | up] -> silu(gate) * up [M, N]
torch::Tensor silu_and_mul(const fastdraft::IsaPtr& isa, torch::Tensor x) {
  check_cpu_2d(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dim must be even");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  auto out = torch::empty({rows, n}, x.options());
  const int32_t type = elem_type(x);
  auto run = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      isa->table->silu_mul(type, at_elem(x, r * 2 * n), at_elem(x, r * 2 * n + n), at_elem(out, r * n), n);
  };
  if (rows >= 8) at::parallel_for(0, rows, 4, run); else run(0, rows);
  return out;
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
                                          const torch::Tensor& weight, double eps, const torch::Tensor& sum_out,
                                          const torch::Tensor& out, int64_t c0, int64_t c1) {
  const int64_t h = a.size(1);
  TORCH_CHECK(weight.scalar_type() == a.scalar_type() && weight.is_contiguous() && weight.numel() == h,
              "weight must match x's dtype and last dim");
  TORCH_CHECK(0 <= c0 && c0 <= c1 && c1 <= h, "columns out of range");
  const int32_t type = elem_type(a);
  for (int64_t r = 0; r < a.size(0); ++r)
    isa.table->rms_norm_row(type, at_elem(a, r * h), b.defined() ? at_elem(b, r * h) : nullptr, weight.data_ptr(),
                            sum_out.defined() ? at_elem(sum_out, r * h) : nullptr, at_elem(out, r * h), h,
                            static_cast<float>(eps), c0, c1);
}

void fastdraft::silu_and_mul_columns(const Isa& isa, const torch::Tensor& x, const torch::Tensor& out, int64_t c0,
                                     int64_t c1) {
  const int64_t n = out.size(1);
  const int32_t type = elem_type(x);
  for (int64_t r = 0; r < x.size(0); ++r)
    isa.table->silu_mul(type, at_elem(x, r * 2 * n + c0), at_elem(x, r * 2 * n + n + c0), at_elem(out, r * n + c0),
                        c1 - c0);
}

void fastdraft::rope_to_paged_cache_heads(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                          const torch::Tensor& slot_mapping, PagedAttentionPlan& p, int64_t g0,
                                          int64_t g1) {
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
  for (int64_t t = 0; t < t_count; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
    const int64_t row = t * qkv.stride(0);
    const int64_t block = slots[t] >> p.shift, offset = slots[t] & (p.block_size - 1);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t kv_off = ((block * p.kv_heads + g) * p.block_size + offset) * d;
      rotary_row(type, at_elem(qkv, row + g * group * d), at_elem(cos, t * d), at_elem(sin, t * d),
                 at_elem(p.q_rows, p.q_offset(t, g)), group, d);
      rotary_row(type, at_elem(qkv, row + q_size + g * d), at_elem(cos, t * d), at_elem(sin, t * d),
                 at_elem(p.k_blocks, kv_off), 1, d);
      std::memcpy(at_elem(p.v_blocks, kv_off), at_elem(qkv, row + q_size + kv_size + g * d), row_bytes);
    }
  }
}
