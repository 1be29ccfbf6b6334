// Elementwise kernels and argmax, written once against the SIMD layer (simd_<isa>.h). Values
// round to the element type after each op, as PyTorch's ops do, at the oracle's points
// (generic.h): bit for bit its results, but for silu_mul's exp (a polynomial here).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

using simd::BF16;
using simd::Vf;

// Rounded to the storage type, as a PyTorch op producing a T tensor would.
template <typename T> inline Vf to_type(Vf v) { return v; }
template <> inline Vf to_type<BF16>(Vf v) { return simd::round_bf16(v); }

// exp(x), ~2 ulp: Cephes' polynomial on the reduced argument, scaled by 2^n.
inline Vf exp_approx(Vf x) {
  x = simd::max(simd::min(x, simd::set1(88.3762626647949f)), simd::set1(-103.0f));
  const Vf n = simd::round_even(simd::mul(x, simd::set1(1.44269504088896341f)));
  Vf f = simd::fnmadd(n, simd::set1(0.693359375f), x);
  f = simd::fnmadd(n, simd::set1(-2.12194440e-4f), f);
  Vf p = simd::set1(1.9875691500e-4f);
  p = simd::fmadd(p, f, simd::set1(1.3981999507e-3f));
  p = simd::fmadd(p, f, simd::set1(8.3334519073e-3f));
  p = simd::fmadd(p, f, simd::set1(4.1665795894e-2f));
  p = simd::fmadd(p, f, simd::set1(1.6666665459e-1f));
  p = simd::fmadd(p, f, simd::set1(5.0000001201e-1f));
  p = simd::fmadd(p, simd::mul(f, f), simd::add(f, simd::set1(1.0f)));
  return simd::scale_pow2(p, n);
}

// Columns [c0, c1) of one RMSNorm row over s = round(a + b) (b null: s = a): out = w *
// round(s * inv_rms(s)), or with kOffset (Gemma's kind, w fp32 1 + weight) out = round(w * (s *
// inv_rms(s))), one rounding at the end; sum = s where sum is not null. The sum of squares covers
// the whole row in 16 fused lanes, column i in lane i % 16, reduced in AVX-512's reduce-add
// order (as the oracle): any column split gives the whole op's values.
template <typename T, bool kOffset, typename W>
void rms_norm_row_kind(const T* a, const T* b, const W* w, T* sum, T* out, int64_t h, float eps, int64_t c0,
                       int64_t c1) {
  constexpr int L = simd::kLanes, kVecs16 = 16 / L;
  auto value = [&](int64_t i, int64_t n) {
    const Vf v = simd::load(a + i, n);
    return b ? to_type<T>(simd::add(v, simd::load(b + i, n))) : v;
  };
  Vf ss[kVecs16];
  for (int v = 0; v < kVecs16; ++v) ss[v] = simd::zero();
  for (int64_t i = 0; i < h; i += 16)
    for (int v = 0; v < kVecs16; ++v) {
      const Vf x = value(i + L * v, h - i - L * v);  // zeros past h
      ss[v] = simd::fmadd(x, x, ss[v]);
    }
  for (int v = 1; v < kVecs16; ++v) ss[0] = simd::add(ss[0], ss[v]);  // the reduction's first step
  const Vf inv = simd::set1(1.0f / std::sqrt(simd::hsum(ss[0]) / static_cast<float>(h) + eps));
  for (int64_t c = c0; c < c1; c += L) {
    const int64_t n = c1 - c;
    const Vf v = value(c, n);
    if (sum) simd::store(sum + c, v, n);
    const Vf normed = simd::mul(v, inv);
    simd::store(out + c, simd::mul(simd::load(w + c, n), kOffset ? normed : to_type<T>(normed)), n);
  }
}

template <typename T>
void rms_norm_row_of(const T* a, const T* b, const T* w, T* sum, T* out, int64_t h, float eps, int64_t c0,
                     int64_t c1) {
  rms_norm_row_kind<T, false>(a, b, w, sum, out, h, eps, c0, c1);
}

template <typename T>
void rms_norm_offset_row_of(const T* a, const T* b, const float* w1, T* sum, T* out, int64_t h, float eps, int64_t c0,
                            int64_t c1) {
  rms_norm_row_kind<T, true>(a, b, w1, sum, out, h, eps, c0, c1);
}

// out = round(gelu_tanh(gate)) * up, L values (n of them): g / (1 + exp(-2u)), as generic.h.
template <typename T>
inline void gelu_tanh_mul_vec(const T* gate, const T* up, T* out, int64_t n) {
  const Vf g = simd::load(gate, n);
  const Vf cube = simd::mul(simd::mul(g, g), g);
  const Vf inner = simd::add(g, simd::mul(simd::set1(0.044715f), cube));
  const Vf e = exp_approx(simd::mul(simd::set1(-1.5957691216057308f), inner));
  const Vf s = to_type<T>(simd::div(g, simd::add(simd::set1(1.0f), e)));
  simd::store(out, simd::mul(s, simd::load(up, n)), n);
}

// out = round(silu(gate)) * up, L values (n of them).
template <typename T>
inline void silu_mul_vec(const T* gate, const T* up, T* out, int64_t n) {
  const Vf g = simd::load(gate, n);
  const Vf e = exp_approx(simd::sub(simd::zero(), g));
  const Vf s = to_type<T>(simd::div(g, simd::add(simd::set1(1.0f), e)));
  simd::store(out, simd::mul(s, simd::load(up, n)), n);
}

// n values of a gated activation, ``vec`` (silu_mul_vec, gelu_tanh_mul_vec) a vector at a time.
template <typename T, typename Vec>
void gated_of(const T* gate, const T* up, T* out, int64_t n, Vec vec) {
  constexpr int L = simd::kLanes;
  int64_t i = 0;
  // Four independent vectors per step: one alone waits on the exp polynomial and the division.
  for (; i + 4 * L <= n; i += 4 * L)
    for (int v = 0; v < 4; ++v) vec(gate + i + L * v, up + i + L * v, out + i + L * v, L);
  for (; i < n; i += L) vec(gate + i, up + i, out + i, n - i);
}

template <typename T>
void silu_mul_of(const T* gate, const T* up, T* out, int64_t n) {
  // A lambda, not a function pointer: its own type, so the vector body is inlined.
  gated_of(gate, up, out, n, [](const T* g, const T* u, T* o, int64_t m) { silu_mul_vec(g, u, o, m); });
}

template <typename T>
void gelu_tanh_mul_of(const T* gate, const T* up, T* out, int64_t n) {
  gated_of(gate, up, out, n, [](const T* g, const T* u, T* o, int64_t m) { gelu_tanh_mul_vec(g, u, o, m); });
}

// heads x d values: first half x1 c1 - x2 s1, second half x2 c2 + x1 s2, each product rounded.
template <typename T>
void rotary_row_of(const T* x, const T* cos, const T* sin, T* out, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    const T* xh = x + hd * d;
    T* oh = out + hd * d;
    for (int64_t i = 0; i < half; i += simd::kLanes) {
      const int64_t n = half - i;
      const Vf x1 = simd::load(xh + i, n), x2 = simd::load(xh + half + i, n);
      const Vf a1 = to_type<T>(simd::mul(x1, simd::load(cos + i, n)));
      const Vf b1 = to_type<T>(simd::mul(simd::sub(simd::zero(), x2), simd::load(sin + i, n)));
      const Vf a2 = to_type<T>(simd::mul(x2, simd::load(cos + half + i, n)));
      const Vf b2 = to_type<T>(simd::mul(x1, simd::load(sin + half + i, n)));
      simd::store(oh + i, simd::add(a1, b1), n);
      simd::store(oh + half + i, simd::add(a2, b2), n);
    }
  }
}

template <typename T>
void add_of(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = 0; i < n; i += simd::kLanes)
    simd::store(out + i, simd::add(simd::load(a + i, n - i), simd::load(b + i, n - i)), n - i);
}

template <typename T>
void scale_to_float_of(const T* x, float scale, float* out, int64_t n) {
  const Vf s = simd::set1(scale);
  for (int64_t i = 0; i < n; i += simd::kLanes) simd::store(out + i, simd::mul(simd::load(x + i, n - i), s), n - i);
}

// torch.argmax: the first index of the largest value, or of the first NaN. One pass while no
// NaN shows up, then a second over the (cached) row for the first index holding the maximum.
inline int64_t argmax(const float* row, int64_t n) {
  constexpr int L = simd::kLanes;
  int64_t found = -1, i = 0;
  Vf vmax = simd::set1(-std::numeric_limits<float>::infinity());
  for (; i + L <= n && found < 0; i += L) {
    const Vf v = simd::load(row + i);
    if (const unsigned is_nan = simd::nan_lanes(v)) found = i + __builtin_ctz(is_nan);
    vmax = simd::max(vmax, v);
  }
  float best = simd::hmax(vmax);
  for (; i < n && found < 0; ++i) {
    if (std::isnan(row[i])) found = i;
    else best = std::max(best, row[i]);
  }
  if (found < 0) {
    const Vf vbest = simd::set1(best);
    for (i = 0; i + L <= n && found < 0; i += L)
      if (const unsigned is_best = simd::equal_lanes(simd::load(row + i), vbest)) found = i + __builtin_ctz(is_best);
    for (; i < n && found < 0; ++i)
      if (row[i] == best) found = i;
  }
  return found;
}

}  // namespace
