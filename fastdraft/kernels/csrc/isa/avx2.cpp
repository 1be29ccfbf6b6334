// The `avx2` variant: AVX2 + FMA + F16C only (no AVX-512, no AVX-VNNI), for AMD Zen 1-3 and
// Intel Haswell..Alder Lake. Built with -mavx2 -mfma -mf16c; loaded only on CPUs that run it.
// The scalar variant (isa/scalar.cpp, generic.h) is the oracle these kernels are tested
// against; the AVX-512 kernels (isa/avx512_vnni.cpp) are the designs they follow, 8 lanes at a
// time instead of 16. Kernels not specialized here (dequant_tile, merge_splits, block_cdf) are
// generic.h's. Bit for bit the oracle's: quantize_row, woq_tiles, woq_block_sums, rms_norm_row,
// rotary_row, add, scale_to_float, argmax; silu_mul and attend_split differ in the last bits
// (vector exp, 8-lane sums).
//
// Compiler settings for this file:
// * No floating-point contraction: gcc otherwise fuses a separate multiply and add (even of
//   intrinsics, which it lowers to vector arithmetic) into an FMA, and every kernel here must
//   round where the contract in kernel_table.h does. Explicit _mm256_fmadd_ps stays fused.
// * gcc: no temporary expression replacement. With it, gcc emits every product of an unrolled
//   INT4 step before the int16 sums that consume them, and the 16 ymm registers spill: 48
//   stack accesses per 32 maddubs at 4 rows, prefill ~1.5x slower.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#else
#pragma GCC optimize("fp-contract=off", "no-tree-ter")
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "generic.h"
#include "half.h"
#include "kernel_table.h"

namespace {

using fastdraft::Activations8;
using fastdraft::AttendArgs;
using fastdraft::WoqView;

// A bf16 value's bits: a type of its own so that loads and stores overload on it.
struct BF16 {
  uint16_t bits;
};

// ---- 8-lane helpers -------------------------------------------------------------------------
// fp32 <-> bf16 exactly as half.h (round to nearest even, NaN kept a quiet NaN), 8 lanes.
inline __m256 widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
// 8 bf16 bit patterns, one in the low half of each 32-bit lane.
inline __m256i bf16_bits32(__m256 v) {
  const __m256i i = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(i, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m128i to_bf16(__m256 v) {  // -> 8 packed bf16
  const __m256i b = bf16_bits32(v);
  return _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}
inline __m256 round_bf16(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits32(v), 16)); }

// Loads of 8 values (n of them: the rest read as 0, nothing past p + n is touched) and
// stores of 8 (n: only the first n written; bf16 stores round to nearest even).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BF16* p) { return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
template <typename T>
inline __m256 load8(const T* p, int64_t n) {
  if (n >= 8) return load8(p);
  T buf[8] = {};
  if (n > 0) std::memcpy(buf, p, n * sizeof(T));
  return load8(buf);
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(BF16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(v)); }
template <typename T>
inline void store8(T* p, __m256 v, int64_t n) {
  if (n >= 8) return store8(p, v);
  if (n <= 0) return;
  T buf[8];
  store8(buf, v);
  std::memcpy(p, buf, n * sizeof(T));
}
// Round to the storage type, as a PyTorch op producing a T tensor would.
template <typename T> inline __m256 to_type(__m256 v) { return v; }
template <> inline __m256 to_type<BF16>(__m256 v) { return round_bf16(v); }

// All-ones in lanes [0, n), zero in the others.
inline __m256 lanes_below(int64_t n) {
  const __m256i limit = _mm256_set1_epi32(static_cast<int>(std::min<int64_t>(std::max<int64_t>(n, 0), 8)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// Horizontal sum and max of 8 lanes, in a fixed order.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// exp(x), ~2 ulp: the AVX-512 exp16 (Cephes' polynomial on the reduced argument) on 8 lanes.
// Without vscalefps, 2^n is built in the exponent bits, as 2^(n/2) * 2^(n - n/2) so that both
// factors stay normal for every n in [-149, 128] the clamp allows: p * 2^a is exact and the
// second product rounds once, as vscalefps does (subnormal results included).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-103.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);  // exact: n is an integer
  const __m256i a = _mm256_srai_epi32(ni, 1), b = _mm256_sub_epi32(ni, a);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 pa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, bias), 23));
  const __m256 pb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, pa), pb);
}

// ---- activation quantization ----------------------------------------------------------------
// Blocks [b0, b1) of row m, as kernel_table.h's Activations8 defines them; bit for bit the
// scalar and AVX-512 values (the same fp32 ops; amax and the integer sums are exact in any order).
template <typename T>
void quantize_row_of(const T* x, int64_t k, const Activations8& a, int64_t m, int64_t b0, int64_t b1) {
  const int64_t block = a.block, bpg = a.group / a.block;
  int8_t* q = a.q + m * a.k_pad;
  float* scale = a.scale + m * a.num_blocks;
  float* corr = a.corr + m * a.num_groups;
  int32_t* qsum = a.qsum + m * a.num_blocks;
  const int64_t vecs = block / 8;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[16];  // block <= 128
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t k0 = b * block;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < vecs; ++i) {
      v[i] = load8(x + k0 + 8 * i, k - k0 - 8 * i);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
    }
    const float d = hmax8(amax) / 127.0f;
    const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < vecs; ++i) {
      const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round half to even
      sum = _mm256_add_epi32(sum, qi);
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k0 + 8 * i), _mm_packs_epi16(w16, w16));  // saturating
    }
    scale[b] = d;
    const int32_t s = hsum8_epi32(sum);
    qsum[b] = s;
    const int64_t g = b / bpg;
    if (b % bpg == 0) corr[g] = 0.0f;
    corr[g] = std::fma(d, static_cast<float>(s), corr[g]);  // fused, as the AVX-512 build and the oracle do
  }
}

void quantize_row(int32_t type, const void* x_row, int64_t k, const Activations8* a, int64_t m, int64_t b0,
                  int64_t b1) {
  if (type == fastdraft::kElemFloat32) quantize_row_of(static_cast<const float*>(x_row), k, *a, m, b0, b1);
  else quantize_row_of(static_cast<const BF16*>(x_row), k, *a, m, b0, b1);
}

// ---- weight-only matmul ---------------------------------------------------------------------
// Layout: fastdraft/kernels/x86.py::repack with 16-row tiles, as the AVX-512 kernel: a 64-byte
// chunk holds 4 bytes for each of 16 output rows, which here is two 32-byte halves of 8 rows
// (an int32 lane per row). INT4: byte j of a row holds k = 8c + j (low nibble) and 8c + 4 + j
// (high nibble); INT8: k = 4c + j as q + 128; INT6: 96-byte chunks, INT4's 64 nibble bytes then
// 32 bytes of bits 4-5 (byte i: those of nibble byte i in its low nibble, of byte i + 32 in its
// high nibble, each as lo's two bits then hi's).
//
// Integer block dots (exact, the same int32 values as the scalar oracle's):
// * INT4: vpmaddubsw (u8 codes x s8 activations, two products per int16 lane, |.| <= 2 * 15 *
//   128 = 3840) summed in int16 over UNIT chunks (2 maddubs per chunk: lo and hi nibbles), so at
//   most 8 * 3840 = 30720 < 32767 at UNIT 4; then vpmaddwd with ones widens pairs to int32.
// * INT6: codes to 63: lo + hi maddubs of one chunk reach 2 * 2 * 63 * 128 = 32256, so each
//   chunk is widened at once.
// * INT8: u8 codes to 255 would overflow vpmaddubsw's int16 (2 * 255 * 127), so the codes become
//   signed q = code ^ 0x80 and, as ggml does, maddubs(|q|, sign(x, q)) gives q * x pairs
//   (|.| <= 2 * 128 * 127 = 32512); sum((code - z) x) = sum(q x) + (128 - z) qsum.
// A constant zero point z joins each block's integer sum: -z * qsum_b (INT8: (128 - z) qsum_b),
// computed once per call for every row and block (block_starts); per-group zero points are
// left to the float epilogue (corr_g).
//
// Float epilogue, per output row (fixed whatever the rows of the call: row-invariant):
//   per block  gacc = fma(float(dot_b), d_b, gacc)
//   per group  acc = fma(s, gacc, acc); asym: acc = fnmadd(s * z, corr_g, acc)
constexpr int kTile = 16;  // output rows per tile
constexpr int kHalfRows = 8;
// Activation rows sharing one pass over a weight tile. INT4 at 4 rows: the 8 int16 partials (4
// rows x 2 halves), the 4 unpacked weight vectors and the broadcast activations all but fill
// the 16 ymm registers (one partial spills at block 32); the float accumulators, touched once
// per block, live in L1. 3 and 5 rows measured within noise of 4. INT6 and INT8 keep 8 int32
// sums live through every chunk and spill some, yet still run 1.1-1.3x faster at 4 rows than at
// 2 or 3, or than with a pass per half tile.
constexpr int kMaxRows = 4;
// Software prefetch of the weight stream, once per 64-byte chunk (as the AVX-512 kernel):
// * kL2: 32 KB ahead into L2. The hardware prefetcher alone leaves bandwidth unused on Intel: a
//   cold 1-row INT4 GEMV streams 8 GB/s without, 14 GB/s with it (Sapphire Rapids, 1 thread).
// * kL2L1: kL2 plus 4 KB ahead into L1, for 1-row calls on Intel, which consume each line
//   fastest: 14.0 -> 15.2 GB/s (+7-10% on the three decode shapes measured).
// * kNone for 1-row calls on AMD: the AVX-512 kernel measured a cold INT4 GEMV 1.1-1.2x faster
//   with no software prefetch on Zen 4 (an L1 prefetch serializes compute and memory there);
//   not measured on Zen 3 here.
enum class Prefetch { kNone, kL2, kL2L1 };
constexpr int64_t kL2PrefetchBytes = 32768;
constexpr int64_t kL1PrefetchBytes = 4096;
// Many rows (prefill) are taken kRowBlock at a time through all the call's tiles: their
// activations stay in L2 while the weights stream, and each row's outputs are written in
// order. Tiles outside and all rows inside write 16 scattered columns of every row per tile,
// which miss the cache once the output outgrows L2 (N = 4864, 256 rows: 1.5x slower).
constexpr int64_t kRowBlock = 32;

// One tile's work, resolved once per tile.
struct TileJob {
  const uint8_t* w;        // the tile's packed bytes
  const uint16_t* scales;  // fp16 [num_groups, 16]
  const uint8_t* zu8;      // [num_groups, 16] or null
  const uint16_t* zf16;    // [num_groups, 16] or null
  const int32_t* starts;   // [rows, num_blocks]: each block's int32 sum starts there (constant zero point)
  int64_t bpg, num_groups;
  void* out;               // output (m, row n of the tile) at out + m * ldo + n
  int64_t ldo;
  int32_t out_type;
  int valid;               // output rows of the tile that exist
  int32_t* sums;           // woq_block_sums: [rows, num_blocks, 16], instead of out
};

inline __m256 zeros8(const TileJob& j, int64_t i) {  // zero points i..i+7 as fp32
  if (j.zf16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(j.zf16 + i)));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(j.zu8 + i))));
}

bool is_amd_cpu() {
  static const bool is_amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd");
  }();
  return is_amd;
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Half tiles [0, NH) (8 output rows each) of one tile against R activation rows from m0, for
// blocks of CPB chunks. INT4 sums UNIT chunks in int16 before widening (see above); PF: the
// weights' software prefetch. With j.sums set it stores the exact int32 block sums instead of
// the float epilogue (woq_block_sums), so the test entry runs this very code.
// The block size is a template argument: at block 32 the per-block work (start, widening, the
// float epilogue) is a third of the integer work, and with a compile-time chunk count it runs
// without loop overhead and with the int32 dots out of the hot registers.
template <int BITS, bool ASYM, int R, int NH, int CPB, int UNIT, Prefetch PF>
__attribute__((noinline)) void tile_kernel(const TileJob& j, const Activations8& a, int64_t m0) {
  static_assert(NH <= 2 && CPB % UNIT == 0 && (BITS == 4 || UNIT == 1), "bad tile kernel shape");
  constexpr int64_t chunk_k = BITS == 8 ? 4 : 8;
  constexpr int64_t chunk_bytes = BITS == 6 ? 96 : 64;  // INT6: 64 nibble bytes + 32 of high bits
  constexpr int64_t block = CPB * chunk_k;
  constexpr int units = CPB / UNIT;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i high_bits = _mm256_set1_epi8(0x30);
  const __m256i sign_bit = _mm256_set1_epi8(static_cast<char>(0x80));
  const bool is_sums = j.sums != nullptr;
  const int8_t* xq[R];
  const float* xs[R];
  const float* xc[R];
  const int32_t* xstart[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = a.q + (m0 + r) * a.k_pad;
    xs[r] = a.scale + (m0 + r) * a.num_blocks;
    xc[r] = a.corr + (m0 + r) * a.num_groups;
    xstart[r] = ASYM ? nullptr : j.starts + (m0 + r) * a.num_blocks;
  }
  const uint8_t* w = j.w;
  __m256 acc[R][NH];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < NH; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < j.num_groups; ++g) {
    __m256 gacc[R][NH];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int h = 0; h < NH; ++h) gacc[r][h] = _mm256_setzero_ps();
    for (int64_t bb = 0; bb < j.bpg; ++bb) {
      const int64_t b = g * j.bpg + bb;
      const int8_t* xb[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xb[r] = xq[r] + b * block;
      __m256i dot[R][NH] = {};  // the block's int32 sums (each first set by its first chunk)
      for (int u = 0; u < units; ++u) {
        __m256i part[R][NH];  // INT4: int16 sums over the unit's chunks
#pragma GCC unroll 4
        for (int c = 0; c < UNIT; ++c) {
          const char* wc = reinterpret_cast<const char*>(w);
          if constexpr (PF != Prefetch::kNone) {  // INT6 chunks are 1.5 lines
            _mm_prefetch(wc + kL2PrefetchBytes, _MM_HINT_T1);
            if constexpr (BITS == 6) _mm_prefetch(wc + kL2PrefetchBytes + 64, _MM_HINT_T1);
          }
          if constexpr (PF == Prefetch::kL2L1) {
            _mm_prefetch(wc + kL1PrefetchBytes, _MM_HINT_T0);
            if constexpr (BITS == 6) _mm_prefetch(wc + kL1PrefetchBytes + 64, _MM_HINT_T0);
          }
          const int64_t k0 = (u * UNIT + c) * chunk_k;
          const bool is_first = u == 0 && c == 0;
          if constexpr (BITS == 8) {
            __m256i wq[NH], wabs[NH];  // signed q and |q| (as u8: -128 reads 128)
#pragma GCC unroll 2
            for (int h = 0; h < NH; ++h) {
              wq[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h)), sign_bit);
              wabs[h] = _mm256_abs_epi8(wq[h]);
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const __m256i xv = _mm256_set1_epi32(load_i32(xb[r] + k0));
#pragma GCC unroll 2
              for (int h = 0; h < NH; ++h) {
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[h], _mm256_sign_epi8(xv, wq[h])), ones);
                dot[r][h] = is_first ? p : _mm256_add_epi32(dot[r][h], p);
              }
            }
          } else {
            __m256i lo[NH], hi[NH];  // codes of k = 8c + j and 8c + 4 + j, one byte each
#pragma GCC unroll 2
            for (int h = 0; h < NH; ++h) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
              lo[h] = _mm256_and_si256(v, nibble);
              hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
              if constexpr (BITS == 6) {
                // Bits 4-5 of the codes: half 0 keeps them in the high-bit bytes' low nibbles,
                // half 1 in their high nibbles (16-bit shifts: the 0x30 mask drops what crosses
                // between bytes).
                const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64));
                if (h == 0) {
                  lo[h] = _mm256_or_si256(lo[h], _mm256_and_si256(_mm256_slli_epi16(hb, 4), high_bits));
                  hi[h] = _mm256_or_si256(hi[h], _mm256_and_si256(_mm256_slli_epi16(hb, 2), high_bits));
                } else {
                  lo[h] = _mm256_or_si256(lo[h], _mm256_and_si256(hb, high_bits));
                  hi[h] = _mm256_or_si256(hi[h], _mm256_and_si256(_mm256_srli_epi16(hb, 2), high_bits));
                }
              }
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const __m256i x_lo = _mm256_set1_epi32(load_i32(xb[r] + k0));
              const __m256i x_hi = _mm256_set1_epi32(load_i32(xb[r] + k0 + 4));
#pragma GCC unroll 2
              for (int h = 0; h < NH; ++h) {
                const __m256i p =
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], x_lo), _mm256_maddubs_epi16(hi[h], x_hi));
                if constexpr (BITS == 6) {
                  const __m256i p32 = _mm256_madd_epi16(p, ones);
                  dot[r][h] = is_first ? p32 : _mm256_add_epi32(dot[r][h], p32);
                } else {
                  part[r][h] = c == 0 ? p : _mm256_add_epi16(part[r][h], p);
                }
              }
            }
          }
          w += chunk_bytes;  // after the INT6 branch, which reads its high bits at w + 64
        }
        if constexpr (BITS == 4) {
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
            for (int h = 0; h < NH; ++h) {
              const __m256i p32 = _mm256_madd_epi16(part[r][h], ones);
              dot[r][h] = u == 0 ? p32 : _mm256_add_epi32(dot[r][h], p32);
            }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if constexpr (!ASYM) {
          const __m256i start = _mm256_set1_epi32(xstart[r][b]);
#pragma GCC unroll 2
          for (int h = 0; h < NH; ++h) dot[r][h] = _mm256_add_epi32(dot[r][h], start);
        }
        if (is_sums) {
          int32_t* s = j.sums + ((m0 + r) * a.num_blocks + b) * kTile;
#pragma GCC unroll 2
          for (int h = 0; h < NH; ++h)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(s + kHalfRows * h), dot[r][h]);
        } else {
          const __m256 d = _mm256_set1_ps(xs[r][b]);
#pragma GCC unroll 2
          for (int h = 0; h < NH; ++h) gacc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), d, gacc[r][h]);
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < NH; ++h) {
      const int64_t i = g * kTile + kHalfRows * h;
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(j.scales + i)));
      if constexpr (ASYM) {
        const __m256 sz = _mm256_mul_ps(s, zeros8(j, i));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[r][h] = _mm256_fmadd_ps(s, gacc[r][h], acc[r][h]);
          acc[r][h] = _mm256_fnmadd_ps(sz, _mm256_set1_ps(xc[r][g]), acc[r][h]);
        }
      } else {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][h] = _mm256_fmadd_ps(s, gacc[r][h], acc[r][h]);
      }
    }
  }
  if (is_sums) return;
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < NH; ++h) {
      const int64_t n0 = kHalfRows * h, count = j.valid - n0;
      if (j.out_type == fastdraft::kElemFloat32)
        store8(static_cast<float*>(j.out) + (m0 + r) * j.ldo + n0, acc[r][h], count);
      else
        store8(static_cast<BF16*>(j.out) + (m0 + r) * j.ldo + n0, acc[r][h], count);
    }
}

// Rows [m0, m0 + rows) of one tile, rows <= kMaxRows: both halves in one pass, so the weights
// stream once, in order (at 2-8 rows, cold, 1.3-1.7x faster than a pass per half with 4 rows
// sharing it); the last tile's lone half when it has at most 8 rows.
template <int BITS, bool ASYM, int CPB, int UNIT>
void tile_rows(const TileJob& j, const Activations8& a, int64_t m0, int rows) {
  const bool both_halves = j.sums || j.valid > kHalfRows;  // the block sums cover every row of the tile
  auto run = [&](auto r_tag, auto pf_tag) {
    constexpr int R = decltype(r_tag)::value;
    constexpr Prefetch PF = decltype(pf_tag)::value;
    if (both_halves) tile_kernel<BITS, ASYM, R, 2, CPB, UNIT, PF>(j, a, m0);
    else tile_kernel<BITS, ASYM, R, 1, CPB, UNIT, PF>(j, a, m0);
  };
  using L2 = std::integral_constant<Prefetch, Prefetch::kL2>;
  switch (rows) {
    case 1:
      if (is_amd_cpu()) run(std::integral_constant<int, 1>{}, std::integral_constant<Prefetch, Prefetch::kNone>{});
      else run(std::integral_constant<int, 1>{}, std::integral_constant<Prefetch, Prefetch::kL2L1>{});
      break;
    case 2: run(std::integral_constant<int, std::min(2, kMaxRows)>{}, L2{}); break;
    case 3: run(std::integral_constant<int, std::min(3, kMaxRows)>{}, L2{}); break;
    case 4: run(std::integral_constant<int, std::min(4, kMaxRows)>{}, L2{}); break;
    default: run(std::integral_constant<int, kMaxRows>{}, L2{}); break;
  }
}

// Every block's integer start, init_mul * qsum_b, for all rows: one multiply per row and block
// and call instead of one per row, block and tile. Per thread (the driver calls from many).
const int32_t* block_starts(const Activations8& a, int32_t init_mul) {
  static thread_local std::vector<int32_t> starts;
  const int64_t count = a.rows * a.num_blocks;
  if (static_cast<int64_t>(starts.size()) < count) starts.resize(count);
  for (int64_t i = 0; i < count; ++i) starts[i] = init_mul * a.qsum[i];
  return starts.data();
}

template <int BITS, bool ASYM, int CPB, int UNIT>
__attribute__((noinline)) void woq_tiles_of(const WoqView& wv, const Activations8& a, int64_t t0, int64_t t1,
                                            int32_t* sums) {
  const int64_t tile_bytes = wv.k_pad * BITS / 8 * kTile;
  const int64_t group_stride = a.num_groups * kTile;  // scales / zeros per tile
  TileJob j;
  j.bpg = a.group / a.block;
  j.num_groups = a.num_groups;
  // (128 - z) for INT8's signed codes, -z for a constant zero point.
  j.starts = ASYM ? nullptr
                  : block_starts(a, (BITS == 8 ? 128 : 0) - static_cast<int32_t>(wv.zero_const));
  j.ldo = wv.ldo;
  j.out_type = wv.out_type;
  j.sums = sums;
  for (int64_t mb = 0; mb < a.rows; mb += kRowBlock) {
    const int64_t mb_end = std::min(a.rows, mb + kRowBlock);
    for (int64_t t = t0; t < t1; ++t) {
      j.w = wv.packed + t * tile_bytes;
      j.scales = wv.scales + t * group_stride;
      j.zu8 = wv.zeros_u8 ? wv.zeros_u8 + t * group_stride : nullptr;
      j.zf16 = wv.zeros_f16 ? wv.zeros_f16 + t * group_stride : nullptr;
      j.valid = static_cast<int>(std::min<int64_t>(kTile, wv.out_features - t * kTile));
      if (wv.out_type == fastdraft::kElemFloat32) j.out = static_cast<float*>(wv.out) + t * kTile;
      else j.out = static_cast<BF16*>(wv.out) + t * kTile;
      for (int64_t m0 = mb; m0 < mb_end; m0 += kMaxRows)
        tile_rows<BITS, ASYM, CPB, UNIT>(j, a, m0, static_cast<int>(std::min<int64_t>(kMaxRows, mb_end - m0)));
    }
  }
}

// The kernels for one bit width and zero point, by block size (16, 32, 64 or 128 columns).
template <int BITS, bool ASYM>
void woq_blocks(const WoqView& w, const Activations8& a, int64_t t0, int64_t t1, int32_t* sums) {
  constexpr int chunk_k = BITS == 8 ? 4 : 8;
  constexpr int unit = BITS == 4 ? 4 : 1;  // INT4: 4 chunks per int16 sum (2 at block 16)
  switch (a.block) {
    case 16: woq_tiles_of<BITS, ASYM, 16 / chunk_k, BITS == 4 ? 2 : 1>(w, a, t0, t1, sums); break;
    case 32: woq_tiles_of<BITS, ASYM, 32 / chunk_k, unit>(w, a, t0, t1, sums); break;
    case 64: woq_tiles_of<BITS, ASYM, 64 / chunk_k, unit>(w, a, t0, t1, sums); break;
    default: woq_tiles_of<BITS, ASYM, 128 / chunk_k, unit>(w, a, t0, t1, sums); break;
  }
}

void woq_dispatch(const WoqView* w, const Activations8* a, int64_t t0, int64_t t1, int32_t* sums) {
  const bool asym = w->zeros_u8 || w->zeros_f16;
  if (w->bits == 4) {
    if (asym) woq_blocks<4, true>(*w, *a, t0, t1, sums);
    else woq_blocks<4, false>(*w, *a, t0, t1, sums);
  } else if (w->bits == 6) {
    if (asym) woq_blocks<6, true>(*w, *a, t0, t1, sums);
    else woq_blocks<6, false>(*w, *a, t0, t1, sums);
  } else {
    if (asym) woq_blocks<8, true>(*w, *a, t0, t1, sums);
    else woq_blocks<8, false>(*w, *a, t0, t1, sums);
  }
}

void woq_tiles(const WoqView* w, const Activations8* a, int64_t t0, int64_t t1) {
  woq_dispatch(w, a, t0, t1, nullptr);
}

void woq_block_sums(const WoqView* w, const Activations8* a, int64_t t, int32_t* sums) {
  woq_dispatch(w, a, t, t + 1, sums);
}

// ---- elementwise ----------------------------------------------------------------------------
// Same rounding points as the AVX-512 kernels and the scalar oracle (generic.h).
template <typename T>
void rms_norm_row_of(const T* a, const T* b, const T* w, T* sum, T* out, int64_t h, float eps, int64_t c0,
                     int64_t c1) {
  auto value = [&](int64_t i, int64_t n) {
    const __m256 v = load8(a + i, n);
    return b ? to_type<T>(_mm256_add_ps(v, load8(b + i, n))) : v;
  };
  // Sum of squares over the whole row (any column split sees the same) in 16 fused lanes, column
  // i in lane i % 16, as the AVX-512 kernel and the scalar oracle sum: ss0 holds lanes 0-7,
  // ss1 lanes 8-15, and hsum8(ss0 + ss1) is _mm512_reduce_add_ps's order.
  __m256 ss0 = _mm256_setzero_ps(), ss1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < h; i += 16) {
    const __m256 v0 = value(i, h - i), v1 = value(i + 8, h - i - 8);  // zeros past h
    ss0 = _mm256_fmadd_ps(v0, v0, ss0);
    ss1 = _mm256_fmadd_ps(v1, v1, ss1);
  }
  const float mean = hsum8(_mm256_add_ps(ss0, ss1)) / static_cast<float>(h);
  const __m256 vinv = _mm256_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t c = c0; c < c1; c += 8) {
    const int64_t n = c1 - c;
    const __m256 v = value(c, n);
    if (sum) store8(sum + c, v, n);
    const __m256 y = to_type<T>(_mm256_mul_ps(v, vinv));
    store8(out + c, _mm256_mul_ps(load8(w + c, n), y), n);
  }
}

void rms_norm_row(int32_t type, const void* a, const void* b, const void* weight, void* sum, void* out, int64_t h,
                  float eps, int64_t c0, int64_t c1) {
  if (type == fastdraft::kElemFloat32)
    rms_norm_row_of(static_cast<const float*>(a), static_cast<const float*>(b), static_cast<const float*>(weight),
                    static_cast<float*>(sum), static_cast<float*>(out), h, eps, c0, c1);
  else
    rms_norm_row_of(static_cast<const BF16*>(a), static_cast<const BF16*>(b), static_cast<const BF16*>(weight),
                    static_cast<BF16*>(sum), static_cast<BF16*>(out), h, eps, c0, c1);
}

template <typename T>
inline void silu_mul8(const T* gate, const T* up, T* out, int64_t n) {
  const __m256 g = load8(gate, n);
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  const __m256 s = to_type<T>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
  store8(out, _mm256_mul_ps(s, load8(up, n)), n);
}

template <typename T>
void silu_mul_of(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
  // Four independent vectors per step: one alone waits on the exp polynomial and the division.
  for (; i + 32 <= n; i += 32) {
    silu_mul8(gate + i, up + i, out + i, 8);
    silu_mul8(gate + i + 8, up + i + 8, out + i + 8, 8);
    silu_mul8(gate + i + 16, up + i + 16, out + i + 16, 8);
    silu_mul8(gate + i + 24, up + i + 24, out + i + 24, 8);
  }
  for (; i < n; i += 8) silu_mul8(gate + i, up + i, out + i, n - i);
}

void silu_mul(int32_t type, const void* gate, const void* up, void* out, int64_t n) {
  if (type == fastdraft::kElemFloat32)
    silu_mul_of(static_cast<const float*>(gate), static_cast<const float*>(up), static_cast<float*>(out), n);
  else
    silu_mul_of(static_cast<const BF16*>(gate), static_cast<const BF16*>(up), static_cast<BF16*>(out), n);
}

template <typename T>
void rotary_row_of(const T* x, const T* cos, const T* sin, T* out, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    const T* xh = x + hd * d;
    T* oh = out + hd * d;
    for (int64_t i = 0; i < half; i += 8) {
      const int64_t n = half - i;
      const __m256 x1 = load8(xh + i, n), x2 = load8(xh + half + i, n);
      const __m256 c1 = load8(cos + i, n), c2 = load8(cos + half + i, n);
      const __m256 s1 = load8(sin + i, n), s2 = load8(sin + half + i, n);
      // first half: x1 * c1 - x2 * s1; second half: x2 * c2 + x1 * s2, each product rounded
      const __m256 a1 = to_type<T>(_mm256_mul_ps(x1, c1));
      const __m256 b1 = to_type<T>(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), s1));
      const __m256 a2 = to_type<T>(_mm256_mul_ps(x2, c2));
      const __m256 b2 = to_type<T>(_mm256_mul_ps(x1, s2));
      store8(oh + i, _mm256_add_ps(a1, b1), n);
      store8(oh + half + i, _mm256_add_ps(a2, b2), n);
    }
  }
}

void rotary_row(int32_t type, const void* x, const void* cos, const void* sin, void* out, int64_t heads,
                int64_t head_dim) {
  if (type == fastdraft::kElemFloat32)
    rotary_row_of(static_cast<const float*>(x), static_cast<const float*>(cos), static_cast<const float*>(sin),
                  static_cast<float*>(out), heads, head_dim);
  else
    rotary_row_of(static_cast<const BF16*>(x), static_cast<const BF16*>(cos), static_cast<const BF16*>(sin),
                  static_cast<BF16*>(out), heads, head_dim);
}

template <typename T>
void add_of(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8(out + i, _mm256_add_ps(load8(a + i, n - i), load8(b + i, n - i)), n - i);
}

void add(int32_t type, const void* a, const void* b, void* out, int64_t n) {
  if (type == fastdraft::kElemFloat32)
    add_of(static_cast<const float*>(a), static_cast<const float*>(b), static_cast<float*>(out), n);
  else
    add_of(static_cast<const BF16*>(a), static_cast<const BF16*>(b), static_cast<BF16*>(out), n);
}

template <typename T>
void scale_to_float_of(const T* x, float scale, float* out, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 8) store8(out + i, _mm256_mul_ps(load8(x + i, n - i), s), n - i);
}

void scale_to_float(int32_t type, const void* x, float scale, float* out, int64_t n) {
  if (type == fastdraft::kElemFloat32) scale_to_float_of(static_cast<const float*>(x), scale, out, n);
  else scale_to_float_of(static_cast<const BF16*>(x), scale, out, n);
}

// ---- paged attention (fp32 math) ------------------------------------------------------------
// Software prefetch this many keys ahead, through the block table: the hardware prefetchers
// stop at every jump between the scattered blocks (see isa/avx512_vnni.cpp). Into L2: L1
// prefetches stall on the few L1 miss buffers of AMD cores.
constexpr int64_t kKeysAhead = 32;
constexpr int64_t kMaxHeadDim = 256;

template <typename T>
struct KeyRows {  // where key (or value) row l of the sequence lies in the pool
  const T* base;
  const int64_t* table;
  int64_t block_stride, shift, mask, d;
  const T* operator()(int64_t l) const { return base + table[l >> shift] * block_stride + (l & mask) * d; }
};

template <typename T>
inline void prefetch_row(const T* p, int64_t count) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < count * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}

// The 8 lanes of each of v[0..7] summed: lane j of the result is v[j]'s total, every one in the
// same order ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) whatever j.
inline __m256 hsum8x8(const __m256 v[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [v0..v3 low | v0..v3 high] ...
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores [rows, n] of the query rows against keys l0..l0+n-1: 8 keys at a time, each row's 8
// dot products accumulated lane-wise over head_dim and reduced together (one score per key
// whatever the rows of the call). bf16 keys are widened once per 8 keys, into kbuf.
template <typename T>
void qk_scores(const float* q, const KeyRows<T>& k, int64_t rows, int64_t d, int64_t l0, int64_t n, float* scores) {
  alignas(32) static thread_local float kbuf[8 * kMaxHeadDim];
  alignas(32) static const float zero_row[kMaxHeadDim] = {};
  const int64_t vecs = d / 8;
  for (int64_t lt = 0; lt < n; lt += 8) {
    const int64_t nk = std::min<int64_t>(8, n - lt);
    for (int64_t l = lt + kKeysAhead; l < std::min(n, lt + kKeysAhead + 8); ++l) prefetch_row(k(l0 + l), d);
    const float* kp[8];
    for (int64_t jk = 0; jk < 8; ++jk) {
      if constexpr (std::is_same_v<T, float>) {
        kp[jk] = jk < nk ? k(l0 + lt + jk) : zero_row;
      } else {
        float* dst = kbuf + jk * d;
        if (jk < nk) {
          const T* src = k(l0 + lt + jk);
          for (int64_t i = 0; i < vecs; ++i) _mm256_store_ps(dst + 8 * i, load8(src + 8 * i));
          kp[jk] = dst;
        } else {
          kp[jk] = zero_row;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * d;
      __m256 acc[8];
      for (int jk = 0; jk < 8; ++jk) acc[jk] = _mm256_setzero_ps();
      for (int64_t i = 0; i < vecs; ++i) {
        const __m256 qv = _mm256_loadu_ps(qr + 8 * i);
        for (int jk = 0; jk < 8; ++jk) acc[jk] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[jk] + 8 * i), acc[jk]);
      }
      store8(scores + r * n + lt, hsum8x8(acc), nk);
    }
  }
}

// acc_out rows [r0, r0 + NR), dims [c0, c0 + 8 NV) += p[r][l] v[l] over each row's keys: the
// NR x NV accumulators stay in registers while each V row is widened once for all NR rows.
template <int NR, int NV, typename T>
void pv_block(const float* p, int64_t n, const KeyRows<T>& v, int64_t l0, int64_t c0, const int64_t* num_keys,
              int64_t n_all, int64_t n_any, float* acc_out, int64_t d) {
  __m256 acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t l = 0; l < n_any; ++l) {
    if (l + kKeysAhead < n_any) prefetch_row(v(l0 + l + kKeysAhead) + c0, 8 * NV);
    const T* vr = v(l0 + l) + c0;
    const bool is_shared = l < n_all;
    __m256 pr[NR];
    for (int r = 0; r < NR; ++r) pr[r] = _mm256_set1_ps(p[r * n + l]);
    for (int i = 0; i < NV; ++i) {
      const __m256 vv = load8(vr + 8 * i);
      for (int r = 0; r < NR; ++r) {
        if (!is_shared && l >= num_keys[r]) continue;  // the row's own keys only
        acc[r][i] = _mm256_fmadd_ps(pr[r], vv, acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc_out + r * d + 8 * i, acc[r][i]);
}

template <int NV, typename T>
void pv_rows(int64_t nr, const float* p, int64_t n, const KeyRows<T>& v, int64_t l0, int64_t c0,
             const int64_t* num_keys, int64_t n_all, int64_t n_any, float* acc_out, int64_t d) {
  switch (nr) {
    case 1: pv_block<1, NV>(p, n, v, l0, c0, num_keys, n_all, n_any, acc_out, d); break;
    case 2: pv_block<2, NV>(p, n, v, l0, c0, num_keys, n_all, n_any, acc_out, d); break;
    default: pv_block<3, NV>(p, n, v, l0, c0, num_keys, n_all, n_any, acc_out, d); break;
  }
}

template <typename T>
void attend_split_of(const AttendArgs& A) {
  const int64_t d = A.head_dim, rows = A.rows, l0 = A.l0, n = A.l1 - A.l0;
  const KeyRows<T> k{static_cast<const T*>(A.k_base), A.block_table, A.block_stride, A.block_shift,
                     (int64_t{1} << A.block_shift) - 1, d};
  const KeyRows<T> v{static_cast<const T*>(A.v_base), A.block_table, A.block_stride, A.block_shift,
                     (int64_t{1} << A.block_shift) - 1, d};
  static thread_local std::vector<float> score_buf;
  if (static_cast<int64_t>(score_buf.size()) < rows * n) score_buf.resize(rows * n);
  float* scores = score_buf.data();
  qk_scores<T>(A.qf, k, rows, d, l0, n, scores);
  // Softmax numerators in place; each row over its own first num_keys[r] keys.
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * n;
    const int64_t nr = A.num_keys[r];
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t l = 0; l < nr; l += 8) {
      vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(vmax, load8(sr + l, nr - l), lanes_below(nr - l)));
    }
    const float m = hmax8(vmax);
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t l = 0; l < nr; l += 8) {
      __m256 e = exp8(_mm256_sub_ps(load8(sr + l, nr - l), vm));
      if (nr - l < 8) e = _mm256_and_ps(e, lanes_below(nr - l));  // lanes past the row's keys add nothing
      store8(sr + l, e, nr - l);
      vsum = _mm256_add_ps(vsum, e);
    }
    A.max_out[r] = m;
    A.sum_out[r] = hsum8(vsum);
  }
  // P V: up to 3 rows x 32 dims of accumulators (12 registers) per pass over the split's values.
  constexpr int kRows = 3;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min<int64_t>(kRows, rows - r0);
    int64_t n_all = n, n_any = 0;  // keys every row of the block sees / any row sees
    for (int64_t r = 0; r < nr; ++r) {
      n_all = std::min(n_all, A.num_keys[r0 + r]);
      n_any = std::max(n_any, A.num_keys[r0 + r]);
    }
    for (int64_t c0 = 0; c0 < d; c0 += 32) {
      float* out = A.acc_out + r0 * d + c0;
      const float* p = scores + r0 * n;
      if (d - c0 >= 32) pv_rows<4>(nr, p, n, v, l0, c0, A.num_keys + r0, n_all, n_any, out, d);
      else pv_rows<2>(nr, p, n, v, l0, c0, A.num_keys + r0, n_all, n_any, out, d);  // d % 16 == 0
    }
  }
}

void attend_split(const AttendArgs* args) {
  if (args->type == fastdraft::kElemFloat32) attend_split_of<float>(*args);
  else attend_split_of<BF16>(*args);
}

int32_t has_bf16_dot() { return 0; }

// ---- sampling -------------------------------------------------------------------------------
// torch.argmax: the first index of the largest value, or of the first NaN. One pass while no
// NaN shows up, then a second over the (cached) row for the first index holding the maximum.
int64_t argmax(const float* row, int64_t n) {
  int64_t found = -1;
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n && found < 0; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    const int is_nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    if (is_nan) found = i + __builtin_ctz(is_nan);
    vmax = _mm256_max_ps(vmax, v);
  }
  float best = hmax8(vmax);
  for (; i < n && found < 0; ++i) {
    if (std::isnan(row[i])) found = i;
    else best = std::max(best, row[i]);
  }
  if (found < 0) {
    const __m256 vbest = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n && found < 0; i += 8) {
      const int is_best = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), vbest, _CMP_EQ_OQ));
      if (is_best) found = i + __builtin_ctz(is_best);
    }
    for (; i < n && found < 0; ++i)
      if (row[i] == best) found = i;
  }
  return found;
}

const fastdraft::KernelTable kTable = {
    fastdraft::kKernelTableVersion,
    sizeof(fastdraft::KernelTable),
    "avx2",
    kTile,
    quantize_row,
    woq_tiles,
    woq_block_sums,
    fastdraft::generic::dequant_tile<kTile>,
    rms_norm_row,
    silu_mul,
    rotary_row,
    add,
    scale_to_float,
    has_bf16_dot,
    attend_split,
    fastdraft::generic::merge_splits,
    nullptr,  // dense_bf16_rows: no bf16 dot products without AVX512-BF16
    argmax,
    fastdraft::generic::block_cdf,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const fastdraft::KernelTable* fastdraft_kernel_table(void) {
  return &kTable;
}
