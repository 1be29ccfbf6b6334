// The SIMD layer for AVX-512 (F, BW, VL, DQ) with VNNI: 16 fp32 / int32 lanes per vector,
// masked tails, vpdpbusd. Where the CPU has AVX512-BF16 (checked at run time: the functions
// using it carry FASTDRAFT_BF16_TARGET), bf16 dot products for attention and dense matmuls.
// The kernel bodies (*_body.h) are written against the names below; simd_avx2.h gives the
// same names for 8 lanes.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define FASTDRAFT_SIMD_BF16 1
#define FASTDRAFT_BF16_TARGET __attribute__((target("avx512bf16")))

namespace {
namespace simd {

constexpr int kLanes = 16;
using Vf = __m512;
using Vi = __m512i;

// Tuning: activation rows sharing one pass over a weight tile (32 registers hold 8 rows'
// accumulators); rows of P V per pass (6 rows x 4 vectors of accumulators); calls of up to
// kFewRows rows take the few-row prefetch (kernel_table.h::Tuning::woq_few_rows_prefetch).
constexpr int kWoqMaxRows = 8;
constexpr int kPvRows = 6;
constexpr int kAccumulatorRegs = 16;  // int32 accumulators a tile pass may keep: half the 32 registers
constexpr int kFewRows = 2;
// The weight tile kernel inlined into its row dispatch: as its own function it pays a call and
// setup per 16-row tile, which shows on whole decode steps.
#define FASTDRAFT_TILE_KERNEL_ATTR


// A bf16 value's bits: a type of its own so that loads and stores overload on it.
struct BF16 {
  uint16_t bits;
};

// ---- float lanes ------------------------------------------------------------------------
inline Vf zero() { return _mm512_setzero_ps(); }
inline Vf set1(float x) { return _mm512_set1_ps(x); }
inline Vf add(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline Vf sub(Vf a, Vf b) { return _mm512_sub_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
inline Vf div(Vf a, Vf b) { return _mm512_div_ps(a, b); }
inline Vf max(Vf a, Vf b) { return _mm512_max_ps(a, b); }
inline Vf min(Vf a, Vf b) { return _mm512_min_ps(a, b); }
inline Vf fmadd(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c, one rounding
inline Vf fnmadd(Vf a, Vf b, Vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b, one rounding
inline Vf abs(Vf a) { return _mm512_abs_ps(a); }
inline Vf round_even(Vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vi to_int(Vf a) { return _mm512_cvtps_epi32(a); }  // nearest, ties to even
inline Vf to_float(Vi a) { return _mm512_cvtepi32_ps(a); }
inline Vf scale_pow2(Vf p, Vf n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n integral, one rounding
inline float hsum(Vf v) { return _mm512_reduce_add_ps(v); }  // halves, quarters, then pairs
inline float hmax(Vf v) { return _mm512_reduce_max_ps(v); }

inline __mmask16 below(int64_t n) {  // lanes [0, n)
  return n >= 16 ? 0xffff : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}
inline Vf keep_below(Vf v, int64_t n) { return _mm512_maskz_mov_ps(below(n), v); }  // 0 from lane n on
inline Vf blend_below(Vf a, Vf b, int64_t n) { return _mm512_mask_mov_ps(a, below(n), b); }  // b in [0, n)
inline unsigned nan_lanes(Vf v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline unsigned equal_lanes(Vf a, Vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }

// Lane j of the result: the total of v[j]'s lanes, the same order of additions for every j.
inline Vf hsum_lanes(const Vf v[16]) {
  // Each level sums neighbouring lanes of two vectors into one, keeping the vectors in order:
  // 16 vectors of 16 lanes -> 8 of 2 x 8 -> 4 of 4 x 4 -> 2 of 8 x 2 -> 1 of 16 x 1.
  const Vi even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const Vi odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  Vf w[16];
  for (int i = 0; i < 16; ++i) w[i] = v[i];
  for (int n = 16; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i)
      w[i] = _mm512_add_ps(_mm512_permutex2var_ps(w[2 * i], even, w[2 * i + 1]),
                           _mm512_permutex2var_ps(w[2 * i], odd, w[2 * i + 1]));
  return w[0];
}

// ---- loads and stores: n lanes (the rest read as 0, nothing past p + n touched) ---------
inline Vf load(const float* p) { return _mm512_loadu_ps(p); }
inline Vf load(const BF16* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)); }
inline Vf load(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(below(n), p); }
inline Vf load(const BF16* p, int64_t n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(below(n), p)), 16));
}
// bf16 bits of v, round to nearest even, NaN kept a quiet NaN (as half.h), one per int32 lane.
inline Vi bf16_bits(Vf v) {
  const Vi i = _mm512_castps_si512(v);
  const Vi lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  const Vi rounded = _mm512_srli_epi32(_mm512_add_epi32(i, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const Vi quiet = _mm512_or_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(0x40));
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
}
inline Vf round_bf16(Vf v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
inline void store(float* p, Vf v) { _mm512_storeu_ps(p, v); }
inline void store(BF16* p, Vf v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v))); }
inline void store(float* p, Vf v, int64_t n) { _mm512_mask_storeu_ps(p, below(n), v); }
inline void store(BF16* p, Vf v, int64_t n) { _mm256_mask_storeu_epi16(p, below(n), _mm512_cvtepi32_epi16(bf16_bits(v))); }
// Values already bf16 (round_bf16's output): their top halves, no second rounding.
inline void store_bf16_exact(uint16_t* p, Vf v, int64_t n) {
  _mm256_mask_storeu_epi16(p, below(n), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
inline Vf load_fp16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vf load_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }

inline void prefetch_l1(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// ---- integer lanes ----------------------------------------------------------------------
inline Vi load_i(const void* p) { return _mm512_loadu_si512(p); }
inline void store_i(void* p, Vi v) { _mm512_storeu_si512(p, v); }
inline Vi zero_i() { return _mm512_setzero_si512(); }
inline Vi set1_i32(int32_t x) { return _mm512_set1_epi32(x); }
inline Vi set1_i8(int8_t x) { return _mm512_set1_epi8(x); }
inline Vi broadcast4(const int8_t* p) {  // the 4 bytes at p in every int32 lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline Vi add_i32(Vi a, Vi b) { return _mm512_add_epi32(a, b); }
inline Vi and_i(Vi a, Vi b) { return _mm512_and_si512(a, b); }
inline Vi or_and(Vi a, Vi b, Vi m) { return _mm512_ternarylogic_epi32(a, b, m, 0xF8); }  // a | (b & m)
template <int N> inline Vi srl16(Vi a) { return _mm512_srli_epi16(a, N); }
template <int N> inline Vi sll16(Vi a) { return _mm512_slli_epi16(a, N); }
template <int N> inline Vi sra32(Vi a) { return _mm512_srai_epi32(a, N); }
inline int32_t hsum_i32(Vi v) { return _mm512_reduce_add_epi32(v); }
inline void store_i8(int8_t* p, Vi v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(v)); }
// The lanes of row-vector h of an INT6 chunk's 32 high-bit bytes at p: each byte's 2-bit
// fields in its bits 0-3 (which byte of the weight tile they belong to: see woq_body.h).
inline Vi int6_high(const uint8_t* p, int) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 4), 1);
}
// kLanes dwords at p, p + stride, p + 2 stride, ... (stride in dwords).
inline Vi load_strided_i32(const int32_t* p, int64_t stride) {
  const Vi index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_epi32(static_cast<int>(stride)));
  return _mm512_i32gather_epi32(index, p, 4);
}
// The dwords of a and b interleaved (a0 b0 a1 b1 ...): lanes 0-15 into lo, 16-31 into hi.
inline void interleave_i32(Vi a, Vi b, Vi& lo, Vi& hi) {
  const Vi x = _mm512_unpacklo_epi32(a, b), y = _mm512_unpackhi_epi32(a, b);  // per 128-bit lane
  lo = _mm512_permutex2var_epi64(x, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), y);
  hi = _mm512_permutex2var_epi64(x, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), y);
}

// ---- u8 x s8 dot products -----------------------------------------------------------------
// partial_add accumulates u8 x s8 products kProductsPerLane to a lane in lanes that hold up to
// kPartialLimit; partial_widen turns those lanes into int32 sums. Here one vpdpbusd into int32
// lanes: no widening. TIED: through an asm that ties accumulator and result to one register,
// where gcc otherwise copies accumulators around the intrinsic (moves on the critical path of
// INT8 at 3-5 rows and of 1-2 row GEMVs); INT4 from 3 rows gains nothing from the asm and
// keeps the intrinsic, which gcc can schedule.
constexpr int kProductsPerLane = 4;
constexpr int64_t kPartialLimit = 2147483647;
template <bool TIED = true>
inline Vi partial_add(Vi acc, Vi u8, Vi s8) {
  if constexpr (!TIED) return _mm512_dpbusd_epi32(acc, u8, s8);
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}
inline Vi partial_widen(Vi p) { return p; }
// INT8 codes (0..255) as partial_add takes them, and the offset the products carry:
// sum(code x) - kCode8Offset * sum(x).
constexpr int32_t kCode8Offset = 0;
struct Codes8 {
  Vi codes;
};
inline Codes8 prepare_codes8(Vi codes) { return {codes}; }
inline Vi partial_add8(Vi acc, const Codes8& w, Vi x) { return partial_add(acc, w.codes, x); }

// ---- bf16 dot products (AVX512-BF16) ------------------------------------------------------
inline bool has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
// acc + the products of a's and b's bf16 pairs, each pair summed into its fp32 lane.
FASTDRAFT_BF16_TARGET inline Vf dot_bf16(Vf acc, Vi a, Vi b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
// The 16-bit values of a and b interleaved (a0 b0 a1 b1 ...): the first 32 into lo, the rest into hi.
inline void interleave_i16(Vi a, Vi b, Vi& lo, Vi& hi) {
  const Vi idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                  39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  lo = _mm512_permutex2var_epi16(a, idx, b);
  hi = _mm512_permutex2var_epi16(a, _mm512_add_epi16(idx, _mm512_set1_epi16(16)), b);
}
// In-register transpose of a 16x16 matrix of dwords (r[i] lane j -> r[j] lane i).
inline void transpose_i32(Vi r[16]) {
  Vi t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + m]: rows 4i..4i+3, column 4L + m of each 128-bit lane L
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const Vi v = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88), w = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xDD);
    const Vi v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88), w2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xDD);
    r[m] = _mm512_shuffle_i32x4(v, v2, 0x88);
    r[8 + m] = _mm512_shuffle_i32x4(v, v2, 0xDD);
    r[4 + m] = _mm512_shuffle_i32x4(w, w2, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(w, w2, 0xDD);
  }
}

}  // namespace simd
}  // namespace
