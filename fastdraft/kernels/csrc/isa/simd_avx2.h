// The SIMD layer for AVX2 + FMA + F16C: 8 fp32 / int32 lanes per vector; tails through a
// small buffer (no masked loads of bytes or 16-bit values). u8 x s8 dot products with
// vpmaddubsw + vpmaddwd, or, built with -mavxvnni (__AVXVNNI__), with the VEX vpdpbusd of
// Intel Alder Lake / Sapphire Rapids onward and AMD Zen 5. Same names as simd_avx512.h.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {
namespace simd {

constexpr int kLanes = 8;
using Vf = __m256;
using Vi = __m256i;

// Tuning (see simd_avx512.h), for 16 registers: at 4 rows the INT4 partials (4 rows x 2
// vectors), the unpacked weights and the broadcast activations all but fill them; 3 and 5
// rows measured within noise of 4. P V: 3 rows x 4 vectors of accumulators.
constexpr int kWoqMaxRows = 4;
constexpr int kPvRows = 3;
constexpr int kAccumulatorRegs = 8;  // int32 accumulators a tile pass may keep: half the 16 registers
constexpr int kFewRows = 1;
// The weight tile kernel as its own function: with 16 registers its many shapes allocate
// better apart than inlined into the row dispatch (inlined, prefill timed slower).
#define FASTDRAFT_TILE_KERNEL_ATTR __attribute__((noinline))


struct BF16 {
  uint16_t bits;
};

// ---- float lanes ------------------------------------------------------------------------
inline Vf zero() { return _mm256_setzero_ps(); }
inline Vf set1(float x) { return _mm256_set1_ps(x); }
inline Vf add(Vf a, Vf b) { return _mm256_add_ps(a, b); }
inline Vf sub(Vf a, Vf b) { return _mm256_sub_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm256_mul_ps(a, b); }
inline Vf div(Vf a, Vf b) { return _mm256_div_ps(a, b); }
inline Vf max(Vf a, Vf b) { return _mm256_max_ps(a, b); }
inline Vf min(Vf a, Vf b) { return _mm256_min_ps(a, b); }
inline Vf fmadd(Vf a, Vf b, Vf c) { return _mm256_fmadd_ps(a, b, c); }
inline Vf fnmadd(Vf a, Vf b, Vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vf abs(Vf a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
inline Vf round_even(Vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vi to_int(Vf a) { return _mm256_cvtps_epi32(a); }
inline Vf to_float(Vi a) { return _mm256_cvtepi32_ps(a); }
// p 2^n with one rounding, as vscalefps (subnormal results included) for n in [-149, 128]:
// 2^n is built in the exponent bits as 2^(n/2) 2^(n - n/2), both factors normal, so p 2^(n/2)
// is exact and only the second product rounds.
inline Vf scale_pow2(Vf p, Vf n) {
  const Vi ni = _mm256_cvtps_epi32(n);
  const Vi a = _mm256_srai_epi32(ni, 1), b = _mm256_sub_epi32(ni, a), bias = _mm256_set1_epi32(127);
  const Vf pa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, bias), 23));
  const Vf pb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, pa), pb);
}
inline float hsum(Vf v) {  // halves, quarters, then pairs: the order of AVX-512's reduce-add's last steps
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax(Vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline Vf below(int64_t n) {  // all-ones in lanes [0, n)
  const Vi limit = _mm256_set1_epi32(static_cast<int>(std::min<int64_t>(std::max<int64_t>(n, 0), 8)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline Vf keep_below(Vf v, int64_t n) { return _mm256_and_ps(v, below(n)); }
inline Vf blend_below(Vf a, Vf b, int64_t n) { return _mm256_blendv_ps(a, b, below(n)); }
inline unsigned nan_lanes(Vf v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
inline unsigned equal_lanes(Vf a, Vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }

// Lane j of the result: the total of v[j]'s lanes, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
// (l6 + l7)) for every j.
inline Vf hsum_lanes(const Vf v[8]) {
  const Vf t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const Vf t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const Vf u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [v0..v3 low | v0..v3 high] ...
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// ---- loads and stores: n lanes (the rest read as 0, nothing past p + n touched) ---------
inline Vf load(const float* p) { return _mm256_loadu_ps(p); }
inline Vf load(const BF16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
template <typename T>
inline Vf load(const T* p, int64_t n) {
  if (n >= 8) return load(p);
  T buf[8] = {};
  if (n > 0) std::memcpy(buf, p, n * sizeof(T));
  return load(buf);
}
// bf16 bits of v, round to nearest even, NaN kept a quiet NaN (as half.h), one per int32 lane.
inline Vi bf16_bits(Vf v) {
  const Vi i = _mm256_castps_si256(v);
  const Vi lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  const Vi rounded = _mm256_srli_epi32(_mm256_add_epi32(i, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const Vi quiet = _mm256_or_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline Vf round_bf16(Vf v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
inline void store(float* p, Vf v) { _mm256_storeu_ps(p, v); }
inline void store(BF16* p, Vf v) {
  const Vi b = bf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
template <typename T>
inline void store(T* p, Vf v, int64_t n) {
  if (n >= 8) return store(p, v);
  if (n <= 0) return;
  T buf[8];
  store(buf, v);
  std::memcpy(p, buf, n * sizeof(T));
}
inline Vf load_fp16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vf load_u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }

inline void prefetch_l1(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// ---- integer lanes ----------------------------------------------------------------------
inline Vi load_i(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline void store_i(void* p, Vi v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
inline Vi zero_i() { return _mm256_setzero_si256(); }
inline Vi set1_i32(int32_t x) { return _mm256_set1_epi32(x); }
inline Vi set1_i8(int8_t x) { return _mm256_set1_epi8(x); }
inline Vi broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline Vi add_i32(Vi a, Vi b) { return _mm256_add_epi32(a, b); }
inline Vi and_i(Vi a, Vi b) { return _mm256_and_si256(a, b); }
inline Vi or_and(Vi a, Vi b, Vi m) { return _mm256_or_si256(a, _mm256_and_si256(b, m)); }
template <int N> inline Vi srl16(Vi a) { return _mm256_srli_epi16(a, N); }
template <int N> inline Vi sll16(Vi a) { return _mm256_slli_epi16(a, N); }
template <int N> inline Vi sra32(Vi a) { return _mm256_srai_epi32(a, N); }
inline int32_t hsum_i32(Vi v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}
inline void store_i8(int8_t* p, Vi v) {  // saturating
  const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w16, w16));
}
// Row-vector h (0 or 1) of an INT6 chunk's 32 high-bit bytes at p (see simd_avx512.h): vector
// 0 reads the bytes' low nibbles, vector 1 their high nibbles, shifted down.
inline Vi int6_high(const uint8_t* p, int h) {
  const Vi hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return h == 0 ? hb : _mm256_srli_epi16(hb, 4);
}
inline Vi load_strided_i32(const int32_t* p, int64_t stride) {
  const Vi index = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(stride)));
  return _mm256_i32gather_epi32(reinterpret_cast<const int*>(p), index, 4);
}
inline void interleave_i32(Vi a, Vi b, Vi& lo, Vi& hi) {
  const Vi x = _mm256_unpacklo_epi32(a, b), y = _mm256_unpackhi_epi32(a, b);  // per 128-bit lane
  lo = _mm256_permute2x128_si256(x, y, 0x20);
  hi = _mm256_permute2x128_si256(x, y, 0x31);
}

// ---- u8 x s8 dot products (see simd_avx512.h) ----------------------------------------------
#if defined(__AVXVNNI__)
constexpr int kProductsPerLane = 4;
constexpr int64_t kPartialLimit = 2147483647;
template <bool TIED = true>
inline Vi partial_add(Vi acc, Vi u8, Vi s8) {
  if constexpr (!TIED) return _mm256_dpbusd_avx_epi32(acc, u8, s8);
  // {vex}: without it the assembler may pick the EVEX (AVX512-VNNI) form, which AVX2 CPUs lack.
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u8), "x"(s8));
  return acc;
}
inline Vi partial_widen(Vi p) { return p; }
constexpr int32_t kCode8Offset = 0;
struct Codes8 {
  Vi codes;
};
inline Codes8 prepare_codes8(Vi codes) { return {codes}; }
inline Vi partial_add8(Vi acc, const Codes8& w, Vi x) { return partial_add(acc, w.codes, x); }
#else
// vpmaddubsw: u8 x s8 products summed in pairs into int16 lanes (saturating past 32767, which
// the kernels' partial sums never reach), widened by vpmaddwd with ones.
constexpr int kProductsPerLane = 2;
constexpr int64_t kPartialLimit = 32767;
template <bool TIED = true>  // no asm here: the same code either way
inline Vi partial_add(Vi acc, Vi u8, Vi s8) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u8, s8)); }
inline Vi partial_widen(Vi p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
// INT8 codes to 255 would overflow vpmaddubsw's pairs (2 x 255 x 127), so they become signed
// q = code - 128 and, as ggml does, |q| x sign(x, q) gives q x (|.| <= 2 x 128 x 127 = 32512).
constexpr int32_t kCode8Offset = 128;
struct Codes8 {
  Vi magnitude, sign;  // |q| (as u8: -128 reads 128), q
};
inline Codes8 prepare_codes8(Vi codes) {
  const Vi q = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));
  return {_mm256_abs_epi8(q), q};
}
inline Vi partial_add8(Vi acc, const Codes8& w, Vi x) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w.magnitude, _mm256_sign_epi8(x, w.sign)));
}
#endif

}  // namespace simd
}  // namespace
