// Fused elementwise ops of the decoder layer (AVX-512). At batch 1 each PyTorch op costs a few
// microseconds of dispatch whatever its size, and a layer runs dozens of them; these replace
// RMSNorm (6 ops), SiLU-and-mul (2) and rotary embedding of q and k (~12) with one call each.
// Reference twins: fastdraft/kernels/fused.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline __m512 round_bf16(__m512 v) {  // float -> nearest-even bfloat16 -> float
  __m512i i = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  i = _mm512_add_epi32(i, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(i, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
  __m512i i = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(i));
}
// Round to the storage dtype, as a PyTorch op producing a T tensor would.
template <typename T> inline __m512 to_dtype(__m512 v) { return v; }
template <> inline __m512 to_dtype<at::BFloat16>(__m512 v) { return round_bf16(v); }

// exp(x), ~2 ulp: Cephes' polynomial on the reduced argument, scaled by 2^n with vscalefps.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-103.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 mask_for(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << remaining) - 1);
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * h;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
      __m512 v = load16(xr + i, mask_for(h - i));
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(h) + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < h; i += 16) {
      const __mmask16 m = mask_for(h - i);
      __m512 y = to_dtype<T>(_mm512_mul_ps(load16(xr + i, m), vinv));
      store16(out + r * h + i, _mm512_mul_ps(load16(w + i, m), y), m);
    }
  }
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * n;
    const T* up = gate + n;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = mask_for(n - i);
      const __m512 g = load16(gate + i, m);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 s = to_dtype<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
      store16(out + r * n + i, _mm512_mul_ps(s, load16(up + i, m)), m);
    }
  }
}

// x row: heads x head_dim; out = x * cos + rotate_half(x) * sin, each product rounded to T.
template <typename T>
void rotary_row(const T* x, const T* cos, const T* sin, T* out, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    const T* xh = x + hd * d;
    T* oh = out + hd * d;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = mask_for(half - i);
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

constexpr int64_t kKeysPerSplit = 256;  // fixed (not per thread count): results are deterministic

struct Partial {
  std::vector<float> max, sum, acc;  // [R], [R], [R, D]
};

template <typename T>
void attend_split(const float* q, const T* k, const T* v, int64_t k_stride, int64_t v_stride, int64_t rows,
                  int64_t d, int64_t l0, int64_t l1, float* max_out, float* sum_out, float* acc_out) {
  const int64_t n = l1 - l0;
  std::vector<float> scores(rows * n);
  const int64_t vecs = d / 16;
  for (int64_t l = 0; l < n; ++l) {
    const T* kr = k + (l0 + l) * k_stride;
    __m512 kv[16];
    for (int64_t i = 0; i < vecs; ++i) kv[i] = load16(kr + 16 * i, 0xffff);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * d;
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
      for (int64_t i = 1; i < vecs; ++i) s = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * i), kv[i], s);
      scores[r * n + l] = _mm512_reduce_add_ps(s);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores.data() + r * n;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t l = 0; l < n; l += 16) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, mask_for(n - l), sr + l));
    const float m = _mm512_reduce_max_ps(vmax);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; l += 16) {
      const __mmask16 mk = mask_for(n - l);
      const __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sr + l), _mm512_set1_ps(m))));
      _mm512_mask_storeu_ps(sr + l, mk, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    const float total = _mm512_reduce_add_ps(vsum);
    max_out[r] = m;
    sum_out[r] = total;
  }
  // out = P V: each V row is converted once and feeds up to 6 query rows, 64 dims at a time
  // (6 x 4 accumulators fit the 32 vector registers).
  constexpr int kRows = 6, kVecs = 4;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min<int64_t>(kRows, rows - r0);
    for (int64_t i0 = 0; i0 < vecs; i0 += kVecs) {
      const int64_t nv = std::min<int64_t>(kVecs, vecs - i0);
      __m512 acc[kRows][kVecs];
      for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < kVecs; ++i) acc[r][i] = _mm512_setzero_ps();
      for (int64_t l = 0; l < n; ++l) {
        const T* vr = v + (l0 + l) * v_stride + 16 * i0;
        __m512 vv[kVecs];
        for (int i = 0; i < kVecs; ++i) vv[i] = i < nv ? load16(vr + 16 * i, 0xffff) : _mm512_setzero_ps();
        for (int r = 0; r < kRows; ++r) {
          if (r >= nr) break;
          const __m512 p = _mm512_set1_ps(scores[(r0 + r) * n + l]);
          for (int i = 0; i < kVecs; ++i) acc[r][i] = _mm512_fmadd_ps(p, vv[i], acc[r][i]);
        }
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(acc_out + (r0 + r) * d + 16 * (i0 + i), acc[r][i]);
    }
  }
}

}  // namespace

// q [B, H, R, D] (scaled inside), k/v [B, H, L, D] with unit last stride -> out [B, H, R, D].
// Every query row attends to all L keys (no mask): one decode step, or one token of a
// verification whose keys are exactly its visible prefix.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16), "q, k, v: one dtype, f32 or bf16");
  const int64_t b = q.size(0), h = q.size(1), rows = q.size(2), d = q.size(3), len = k.size(2);
  TORCH_CHECK(k.size(0) == b && k.size(1) == h && k.size(3) == d && v.sizes() == k.sizes(), "k/v shape mismatch");
  TORCH_CHECK(d % 16 == 0 && d <= 256 && len > 0, "head_dim must be a multiple of 16 up to 256");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k/v rows must be contiguous");
  auto qf = (q.to(at::kFloat) * scale).contiguous();  // [B, H, R, D]
  const int64_t splits = (len + kKeysPerSplit - 1) / kKeysPerSplit;
  const int64_t items = b * h * splits;
  std::vector<float> pmax(items * rows), psum(items * rows), pacc(items * rows * d);
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t bh = it / splits, sp = it % splits;
      const int64_t bi = bh / h, hi = bh % h;
      const int64_t l0 = sp * kKeysPerSplit, l1 = std::min(len, l0 + kKeysPerSplit);
      const float* qp = qf.data_ptr<float>() + bh * rows * d;
      float* mo = pmax.data() + it * rows;
      float* so = psum.data() + it * rows;
      float* ao = pacc.data() + it * rows * d;
      if (q.scalar_type() == at::kFloat) {
        const float* kp = k.data_ptr<float>() + bi * k.stride(0) + hi * k.stride(1);
        const float* vp = v.data_ptr<float>() + bi * v.stride(0) + hi * v.stride(1);
        attend_split(qp, kp, vp, k.stride(2), v.stride(2), rows, d, l0, l1, mo, so, ao);
      } else {
        const at::BFloat16* kp = k.data_ptr<at::BFloat16>() + bi * k.stride(0) + hi * k.stride(1);
        const at::BFloat16* vp = v.data_ptr<at::BFloat16>() + bi * v.stride(0) + hi * v.stride(1);
        attend_split(qp, kp, vp, k.stride(2), v.stride(2), rows, d, l0, l1, mo, so, ao);
      }
    }
  });
  auto out = torch::empty({b, h, rows, d}, q.options());
  for (int64_t bh = 0; bh < b * h; ++bh) {
    for (int64_t r = 0; r < rows; ++r) {
      float m = -INFINITY;
      for (int64_t sp = 0; sp < splits; ++sp) m = std::max(m, pmax[(bh * splits + sp) * rows + r]);
      float total = 0.0f;
      __m512 acc[16];
      for (int64_t i = 0; i < d / 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t it = bh * splits + sp;
        const float w = std::exp(pmax[it * rows + r] - m);
        total += w * psum[it * rows + r];
        const __m512 wv = _mm512_set1_ps(w);
        for (int64_t i = 0; i < d / 16; ++i)
          acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(pacc.data() + (it * rows + r) * d + 16 * i), acc[i]);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / total);
      for (int64_t i = 0; i < d / 16; ++i) {
        const int64_t off = (bh * rows + r) * d + 16 * i;
        if (q.scalar_type() == at::kFloat) store16(out.data_ptr<float>() + off, _mm512_mul_ps(acc[i], inv), 0xffff);
        else store16(out.data_ptr<at::BFloat16>() + off, _mm512_mul_ps(acc[i], inv), 0xffff);
      }
    }
  }
  return out;
}
