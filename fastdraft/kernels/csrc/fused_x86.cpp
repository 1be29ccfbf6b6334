// Fused elementwise ops of the decoder layer (AVX-512). At batch 1 each PyTorch op costs a few
// microseconds of dispatch whatever its size, and a layer runs dozens of them; these replace
// RMSNorm (6 ops), SiLU-and-mul (2) and rotary embedding of q and k (~12) with one call each.
// Reference twins: fastdraft/kernels/fused.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd_x86.h"
#include "x86_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

using namespace fastdraft::simd;

namespace {

// One row of RMSNorm over s = a + b rounded to T (b null: s = a), written for columns
// [c0, c1) only: out = w * to_T(s * inv_rms(s)), and sum = s where sum is not null. The sum of
// squares always covers the whole row, so any column split gives the whole op's values.
template <typename T>
void rms_norm_row(const T* a, const T* b, const T* w, T* sum, T* out, int64_t h, float eps, int64_t c0,
                  int64_t c1) {
  auto value = [&](int64_t i, __mmask16 m) {
    const __m512 v = load16(a + i, m);
    return b ? to_dtype<T>(_mm512_add_ps(v, load16(b + i, m))) : v;
  };
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += 16) {
    const __m512 v = value(i, tail_mask(h - i));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 vinv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(h) + eps));
  for (int64_t i = c0; i < c1; i += 16) {
    const __mmask16 m = tail_mask(c1 - i);
    const __m512 v = value(i, m);
    if (sum) store16(sum + i, v, m);
    const __m512 y = to_dtype<T>(_mm512_mul_ps(v, vinv));
    store16(out + i, _mm512_mul_ps(load16(w + i, m), y), m);
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  for (int64_t r = 0; r < rows; ++r) rms_norm_row<T>(x + r * h, nullptr, w, nullptr, out + r * h, h, eps, 0, h);
}

// out[i] = silu(gate[i]) * up[i] for i < n, the silu rounded to T first.
template <typename T>
inline void silu_mul_16(const T* gate, const T* up, T* out, __mmask16 m) {
  const __m512 g = load16(gate, m);
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 s = to_dtype<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
  store16(out, _mm512_mul_ps(s, load16(up, m)), m);
}

template <typename T>
void silu_mul_span(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
  // Four independent vectors per iteration: one alone is bound by the exp polynomial's and
  // the division's latency.
  for (; i + 64 <= n; i += 64) {
    silu_mul_16(gate + i, up + i, out + i, 0xffff);
    silu_mul_16(gate + i + 16, up + i + 16, out + i + 16, 0xffff);
    silu_mul_16(gate + i + 32, up + i + 32, out + i + 32, 0xffff);
    silu_mul_16(gate + i + 48, up + i + 48, out + i + 48, 0xffff);
  }
  for (; i < n; i += 16) silu_mul_16(gate + i, up + i, out + i, tail_mask(n - i));
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) silu_mul_span(x + r * 2 * n, x + r * 2 * n + n, out + r * n, n);
}

// x row: heads x head_dim; out = x * cos + rotate_half(x) * sin, each product rounded to T.
template <typename T>
void rotary_row(const T* x, const T* cos, const T* sin, T* out, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    const T* xh = x + hd * d;
    T* oh = out + hd * d;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = tail_mask(half - i);
      const __m512 x1 = load16(xh + i, m), x2 = load16(xh + half + i, m);
      const __m512 c1 = load16(cos + i, m), c2 = load16(cos + half + i, m);
      const __m512 s1 = load16(sin + i, m), s2 = load16(sin + half + i, m);
      // first half: x1 * c1 - x2 * s1; second half: x2 * c2 + x1 * s2
      const __m512 a1 = to_dtype<T>(_mm512_mul_ps(x1, c1));
      const __m512 b1 = to_dtype<T>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1));
      const __m512 a2 = to_dtype<T>(_mm512_mul_ps(x2, c2));
      const __m512 b2 = to_dtype<T>(_mm512_mul_ps(x1, s2));
      store16(oh + i, _mm512_add_ps(a1, b1), m);
      store16(oh + half + i, _mm512_add_ps(a2, b2), m);
    }
  }
}

void check_cpu_2d(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
}

}  // namespace

// x [M, H], weight [H] (same dtype) -> [M, H]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_cpu_2d(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must match x's dtype and last dim");
  auto out = torch::empty_like(x);
  const int64_t rows = x.size(0), h = x.size(1);
  auto run = [&](int64_t r0, int64_t r1) {
    if (x.scalar_type() == at::kFloat)
      rms_norm_rows(x.data_ptr<float>() + r0 * h, weight.data_ptr<float>(), out.data_ptr<float>() + r0 * h, r1 - r0, h,
                    static_cast<float>(eps));
    else
      rms_norm_rows(x.data_ptr<at::BFloat16>() + r0 * h, weight.data_ptr<at::BFloat16>(),
                    out.data_ptr<at::BFloat16>() + r0 * h, r1 - r0, h, static_cast<float>(eps));
  };
  if (rows >= 64) at::parallel_for(0, rows, 16, run); else run(0, rows);
  return out;
}

// x [M, 2N] = [gate | up] -> silu(gate) * up [M, N]
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_cpu_2d(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dim must be even");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  auto out = torch::empty({rows, n}, x.options());
  auto run = [&](int64_t r0, int64_t r1) {
    if (x.scalar_type() == at::kFloat)
      silu_mul_rows(x.data_ptr<float>() + r0 * 2 * n, out.data_ptr<float>() + r0 * n, r1 - r0, n);
    else
      silu_mul_rows(x.data_ptr<at::BFloat16>() + r0 * 2 * n, out.data_ptr<at::BFloat16>() + r0 * n, r1 - r0, n);
  };
  if (rows >= 8) at::parallel_for(0, rows, 4, run); else run(0, rows);
  return out;
}

// x [T, heads * head_dim] rows (any row stride), cos/sin [T, head_dim] -> rotated [T, heads * head_dim]
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == heads * head_dim, "x must be [T, heads * head_dim]");
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  check_cpu_2d(cos, "cos");
  check_cpu_2d(sin, "sin");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  cos.size(0) == x.size(0) && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
              "cos/sin must be [T, head_dim] in x's dtype");
  const int64_t rows = x.size(0), ld = x.stride(0);
  auto out = torch::empty({rows, heads * head_dim}, x.options());
  auto run = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (x.scalar_type() == at::kFloat)
        rotary_row(x.data_ptr<float>() + r * ld, cos.data_ptr<float>() + r * head_dim,
                   sin.data_ptr<float>() + r * head_dim, out.data_ptr<float>() + r * heads * head_dim, heads, head_dim);
      else
        rotary_row(x.data_ptr<at::BFloat16>() + r * ld, cos.data_ptr<at::BFloat16>() + r * head_dim,
                   sin.data_ptr<at::BFloat16>() + r * head_dim, out.data_ptr<at::BFloat16>() + r * heads * head_dim,
                   heads, head_dim);
    }
  };
  if (rows >= 64) at::parallel_for(0, rows, 16, run); else run(0, rows);
  return out;
}

namespace {

// out[i] = a[i] + b[i] for i < n, rounded to T as torch's add is (out may alias a).
template <typename T>
void add_span(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    store16(out + i, _mm512_add_ps(load16(a + i, m), load16(b + i, m)), m);
  }
}

}  // namespace

void fastdraft::add_bias(const torch::Tensor& x, int64_t col0, const torch::Tensor& bias, int64_t b0, int64_t b1) {
  if (b1 < 0) b1 = bias.numel();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && bias.dim() == 1 && bias.is_contiguous() &&
                  bias.scalar_type() == x.scalar_type() && col0 + bias.numel() <= x.size(1) && 0 <= b0 &&
                  b0 <= b1 && b1 <= bias.numel(),
              "bias must be [N] in x's dtype, within x's columns");
  for (int64_t r = 0; r < x.size(0); ++r) {
    if (x.scalar_type() == at::kFloat) {
      float* xr = x.data_ptr<float>() + r * x.stride(0) + col0 + b0;
      add_span(xr, bias.data_ptr<float>() + b0, xr, b1 - b0);
    } else {
      at::BFloat16* xr = x.data_ptr<at::BFloat16>() + r * x.stride(0) + col0 + b0;
      add_span(xr, bias.data_ptr<at::BFloat16>() + b0, xr, b1 - b0);
    }
  }
}

void fastdraft::add_columns(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out, int64_t c0,
                            int64_t c1) {
  const int64_t n = a.size(1);
  with_dtype(a, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (int64_t r = 0; r < a.size(0); ++r)
      add_span(a.data_ptr<T>() + r * n + c0, b.data_ptr<T>() + r * n + c0, out.data_ptr<T>() + r * n + c0, c1 - c0);
  });
}

void fastdraft::residual_rms_norm_columns(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& weight,
                                          double eps, const torch::Tensor& sum_out, const torch::Tensor& out,
                                          int64_t c0, int64_t c1) {
  const int64_t h = a.size(1);
  TORCH_CHECK(weight.scalar_type() == a.scalar_type() && weight.is_contiguous() && weight.numel() == h,
              "weight must match x's dtype and last dim");
  TORCH_CHECK(0 <= c0 && c0 <= c1 && c1 <= h, "columns out of range");
  with_dtype(a, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* sums = sum_out.defined() ? sum_out.data_ptr<T>() : nullptr;
    for (int64_t r = 0; r < a.size(0); ++r)
      rms_norm_row<T>(a.data_ptr<T>() + r * h, b.defined() ? b.data_ptr<T>() + r * h : nullptr, weight.data_ptr<T>(),
                      sums ? sums + r * h : nullptr, out.data_ptr<T>() + r * h, h, static_cast<float>(eps), c0, c1);
  });
}

void fastdraft::silu_and_mul_columns(const torch::Tensor& x, const torch::Tensor& out, int64_t c0, int64_t c1) {
  const int64_t n = out.size(1);
  with_dtype(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (int64_t r = 0; r < x.size(0); ++r) {
      const T* gate = x.data_ptr<T>() + r * 2 * n;
      silu_mul_span(gate + c0, gate + n + c0, out.data_ptr<T>() + r * n + c0, c1 - c0);
    }
  });
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
  with_dtype(qkv, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* src = qkv.data_ptr<T>();
    T* q_out = p.q_rows.data_ptr<T>();
    T* kc = p.k_blocks.data_ptr<T>();
    T* vc = p.v_blocks.data_ptr<T>();
    for (int64_t t = 0; t < t_count; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
      const T* row = src + t * qkv.stride(0);
      const T* c = cos.data_ptr<T>() + t * d;
      const T* s = sin.data_ptr<T>() + t * d;
      const int64_t block = slots[t] >> p.shift, offset = slots[t] & (p.block_size - 1);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t kv_off = ((block * p.kv_heads + g) * p.block_size + offset) * d;
        rotary_row(row + g * group * d, c, s, q_out + p.q_offset(t, g), group, d);
        rotary_row(row + q_size + g * d, c, s, kc + kv_off, 1, d);
        std::memcpy(vc + kv_off, row + q_size + kv_size + g * d, d * sizeof(T));
      }
    }
  });
}
