// Small AVX-512 helpers shared by the kernel files: 16-lane loads and stores of float32 and
// bfloat16 (stores round to nearest even, as torch's float -> bfloat16 conversion does), tail
// masks, a vector exp, and a dtype dispatch. Kept in one place so every kernel rounds the same way.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>

namespace fastdraft::simd {

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
// Lanes [0, remaining) of a 16-lane vector (none when remaining <= 0).
inline __mmask16 tail_mask(int64_t remaining) {
  if (remaining >= 16) return 0xffff;
  if (remaining <= 0) return 0;
  return static_cast<__mmask16>((1u << remaining) - 1);
}

// Calls fn(T* tag) with T the (float32 or bfloat16) dtype of x.
template <typename F>
void with_dtype(const torch::Tensor& x, F&& fn) {
  if (x.scalar_type() == at::kFloat) fn(static_cast<float*>(nullptr));
  else fn(static_cast<at::BFloat16*>(nullptr));
}

}  // namespace fastdraft::simd
