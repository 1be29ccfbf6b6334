// The `avx512_vnni` variant: AVX-512 (F, BW, VL, DQ) with VNNI; AVX512-BF16 dot products in
// the attention and the dense bf16 matmul where the CPU has them (checked at run time, those
// functions carry their own target attribute). Built with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq -mavx512vnni -mfma -mf16c; loaded only on CPUs that run it.
// The scalar variant (isa/scalar.cpp) is the oracle these kernels are tested against; the
// plain PyTorch twins are named at each kernel.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

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

// ---- 16-lane helpers ------------------------------------------------------------------------
// Loads and stores of fp32 and bf16 (stores round to nearest even, as PyTorch's conversion).
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const BF16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline __m512 round_bf16(__m512 v) {  // float -> nearest-even bfloat16 -> float
  __m512i i = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  i = _mm512_add_epi32(i, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(i, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store16(BF16* p, __m512 v, __mmask16 m) {
  __m512i i = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(i));
}
// Round to the storage dtype, as a PyTorch op producing a T tensor would.
template <typename T> inline __m512 to_dtype(__m512 v) { return v; }
template <> inline __m512 to_dtype<BF16>(__m512 v) { return round_bf16(v); }

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

bool is_amd_cpu() {
  static const bool is_amd = __builtin_cpu_is("amd");
  return is_amd;
}

bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// ---- weight-only matmul -------------------------------------------------------------------
// Layout: fastdraft/kernels/x86.py::repack. Decode math: see kernel_table.h::woq_tiles; a
// constant zero point (symmetric INT4, INT6, INT8) is an integer, so its term joins each
// block's integer dot (dot_b - z * qsum_b starts the block's accumulator).

constexpr int kTile = 16;   // output rows per tile (one zmm of int32 lanes)
constexpr int kMaxRows = 8; // activation rows sharing one pass over a weight tile
// Software prefetch ahead of the weight stream, per call size and CPU (tile_rows_of):
// * kL2: 32 KB ahead into L2. The hardware prefetcher alone leaves bandwidth unused on Intel
//   (whole decode steps 0.74x without it on Sapphire Rapids); prefetching into L1 alone falls
//   behind when memory latency rises under load.
// * kL2L1: kL2 plus 4 KB ahead into L1, for calls of up to kFewRows rows on Intel, which
//   consume each line fastest: whole decode steps ~1.05x faster on Sapphire Rapids; with 3+
//   rows it gains nothing, so those keep kL2.
// * kNone on AMD Zen 4 for calls of up to kFewRows rows: an L1 prefetch serializes compute and
//   memory there, and a cold INT4 GEMV reads 1.1-1.2x faster with no software prefetch. From 3
//   rows, where each line takes longer to consume, the L2 prefetch pays off (0.7-0.9x without).
enum class Prefetch { kNone, kL2, kL2L1 };
constexpr int kL2PrefetchBytes = 32768;
constexpr int kL1PrefetchBytes = 4096;
constexpr int kFewRows = 2;

// acc += u8 x s8 dot products (vpdpbusd), accumulated in place. The asm ties input and output
// to one register; with the intrinsic gcc copies accumulators to other registers and back
// around each vpdpbusd (INT8 at 3-5 rows 1.1-1.6x faster with the asm). INT4 at 3+ rows gains
// nothing from the asm, so it keeps the intrinsic.
template <int BITS, int ROWS>
inline void dpbusd(__m512i& acc, __m512i u8, __m512i s8) {
  if constexpr (BITS == 8 || ROWS <= 2)
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  else
    acc = _mm512_dpbusd_epi32(acc, u8, s8);
}

// Asymmetric zero points of one weight: uint8 integers or fp16 fractions (one is set).
struct Zeros {
  const uint8_t* u8 = nullptr;
  const uint16_t* f16 = nullptr;

  bool is_set() const { return u8 || f16; }
  Zeros offset(int64_t i) const { return Zeros{u8 ? u8 + i : nullptr, f16 ? f16 + i : nullptr}; }
  __m512 load16(int64_t i) const {  // zeros i..i+15 as floats
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f16 + i)));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u8 + i))));
  }
  float at(int64_t i) const { return f16 ? fastdraft::half::fp16_to_float(f16[i]) : static_cast<float>(u8[i]); }
};

// Unset (symmetric, or INT8) when ``zeros`` is undefined or empty.

// Blocks [b0, b1) of row m (b0 starts a group).
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t block, int64_t blocks_per_group, const Activations8& a, int64_t m,
                  int64_t b0, int64_t b1) {
  int8_t* q = a.q + m * a.k_pad;
  float* scale = a.scale + m * a.num_blocks;
  float* corr = a.corr + m * a.num_groups;
  const int64_t vecs = block / 16;
  __m512 v[8];  // block <= 128
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t k0 = b * block;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < vecs; ++i) {
      v[i] = load16(x + k0 + 16 * i, tail_mask(k - k0 - 16 * i));
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
    }
    const float d = _mm512_reduce_max_ps(amax) / 127.0f;
    const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = 0; i < vecs; ++i) {
      __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));  // round half to even
      sum = _mm512_add_epi32(sum, qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16 * i), _mm512_cvtsepi32_epi8(qi));
    }
    scale[b] = d;
    const int64_t g = b / blocks_per_group;
    const int32_t qsum = _mm512_reduce_add_epi32(sum);
    a.qsum[m * a.num_blocks + b] = qsum;
    if (b % blocks_per_group == 0) corr[g] = 0.0f;
    corr[g] += d * static_cast<float>(qsum);
  }
}

constexpr int kUnroll = 2;  // chunks per step of tile_kernel's inner loop

// Independent int32 accumulator chains per row hide vpdpbusd latency when rows are few;
// with many rows the rows themselves are independent and registers are scarce. Two chains
// up to 6 rows (5-row verification 1.2x faster than with one, in cache); at 7-8 rows the
// extra accumulators spill. Integer sums are exact, so the chain count never changes
// results.
template <int BITS, int ROWS>
constexpr int default_chains() {
  constexpr int steps = (BITS == 8 ? 1 : 2) * kUnroll;  // vpdpbusd per row per unrolled step
  return ROWS <= 2 ? steps : (ROWS <= 6 ? 2 : 1);
}
// On AMD Zen 4, from 5 rows the independent rows alone cover vpdpbusd's latency, and merging
// a second chain costs a vpaddd per row and block: 5-row verification passes 1.02-1.05x faster
// with one chain. 3-4 rows gain nothing from it and keep two.
constexpr int kAmdOneChainMinRows = 5;

// One weight tile (16 output rows) against ROWS activation rows, CHAINS accumulators per row.
// With T = int32_t it stores the exact block sums instead, at out [rows, num_blocks, 16]
// (the test entry woq_block_sums): the same integer code as every matmul runs.
template <int BITS, int ROWS, bool ASYM, Prefetch PREFETCH, int CHAINS, typename T>
void tile_kernel(const uint8_t* w, const uint16_t* scales, Zeros zeros, float zero_const,
                 const Activations8& a, int64_t m0, int64_t block, int64_t blocks_per_group,
                 T* out, int64_t ldo, __mmask16 out_mask) {
  constexpr bool kIsSums = std::is_same_v<T, int32_t>;
  constexpr int kChains = CHAINS;
  constexpr int64_t chunk_k = BITS == 8 ? 4 : 8;
  constexpr int64_t chunk_bytes = BITS == 6 ? 96 : 64;  // INT6: 64 nibble bytes + 32 of high bits
  const int64_t chunks_per_block = block / chunk_k;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i high_nibble = _mm512_set1_epi8(static_cast<char>(0xf0));
  const __m512i high_bits = _mm512_set1_epi8(0x30);
  // INT4 with the high nibbles on their own chains (odd ones): they are fed in place, as
  // 16 * hi, one AND instead of a shift and an AND, and their chains' sum is shifted back by 4
  // once per block (exact: every product is a multiple of 16). Decode steps ~1.03x faster on
  // Zen 4 when the vector ops, not the memory stream, set the pace.
  constexpr bool kHighInPlace = BITS == 4 && kChains % 2 == 0;
  const int32_t neg_zero = -static_cast<int32_t>(zero_const);  // an integer whenever !ASYM
  const int8_t* xq[ROWS];
  const float* xs[ROWS];
  const float* xc[ROWS];
  const int32_t* xsum[ROWS];
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    xq[r] = a.q + (m0 + r) * a.k_pad;
    xs[r] = a.scale + (m0 + r) * a.num_blocks;
    xc[r] = a.corr + (m0 + r) * a.num_groups;
    xsum[r] = a.qsum + (m0 + r) * a.num_blocks;
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < a.num_groups; ++g) {
    __m512 gacc[ROWS];
    for (int r = 0; r < ROWS; ++r) gacc[r] = _mm512_setzero_ps();
    for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
      const int64_t b = g * blocks_per_group + bb;
      __m512i dot[ROWS][kChains];
      // Symmetric: the block starts at -z * sum(xq_b), exact in int32 (|.| <= 128 * 128 * 127),
      // which saves a multiply-add per row and group over subtracting z * corr_g in float:
      // 5-row INT4 g32 verification is bound by vector ops on Zen 4, not by memory.
      for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < kChains; ++c)
          dot[r][c] = (!ASYM && c == 0) ? _mm512_set1_epi32(neg_zero * xsum[r][b]) : _mm512_setzero_si512();
      for (int64_t c = 0; c < chunks_per_block; c += kUnroll) {
        for (int u = 0; u < kUnroll; ++u) {
          if constexpr (PREFETCH != Prefetch::kNone)
            _mm_prefetch(reinterpret_cast<const char*>(w) + kL2PrefetchBytes, _MM_HINT_T1);
          if constexpr (PREFETCH == Prefetch::kL2L1)
            _mm_prefetch(reinterpret_cast<const char*>(w) + kL1PrefetchBytes, _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(w);
          const int64_t k0 = b * block + (c + u) * chunk_k;
          if constexpr (BITS != 8) {
            __m512i lo = _mm512_and_si512(v, nibble);
            __m512i hi = kHighInPlace ? _mm512_and_si512(v, high_nibble)
                                      : _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            if constexpr (BITS == 6) {
              // Byte i of the 32 high-bit bytes holds bits 4-5 of lo and hi at byte i (its low
              // nibble) and at byte i + 32 (its high nibble): spread to 64 bytes, each byte's
              // pair shifted into bits 4-5 and merged (ternary logic 0xF8: a | (b & c)).
              const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64));
              const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 4), 1);
              lo = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi16(hb, 4), high_bits, 0xF8);
              hi = _mm512_ternarylogic_epi32(hi, _mm512_slli_epi16(hb, 2), high_bits, 0xF8);
            }
            for (int r = 0; r < ROWS; ++r) {
              int32_t x_lo, x_hi;
              std::memcpy(&x_lo, xq[r] + k0, 4);
              std::memcpy(&x_hi, xq[r] + k0 + 4, 4);
              dpbusd<BITS, ROWS>(dot[r][(2 * u) % kChains], lo, _mm512_set1_epi32(x_lo));
              dpbusd<BITS, ROWS>(dot[r][(2 * u + 1) % kChains], hi, _mm512_set1_epi32(x_hi));
            }
          } else {
            for (int r = 0; r < ROWS; ++r) {
              int32_t xv;
              std::memcpy(&xv, xq[r] + k0, 4);
              dpbusd<BITS, ROWS>(dot[r][u % kChains], v, _mm512_set1_epi32(xv));
            }
          }
          w += chunk_bytes;  // after the INT6 branch, which reads its high bits at w + 64
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        __m512i total = dot[r][0];
        if constexpr (kHighInPlace) {
          __m512i high = dot[r][1];
          for (int c = 2; c < kChains; c += 2) {
            total = _mm512_add_epi32(total, dot[r][c]);
            high = _mm512_add_epi32(high, dot[r][c + 1]);
          }
          total = _mm512_add_epi32(total, _mm512_srai_epi32(high, 4));
        } else {
          for (int c = 1; c < kChains; ++c) total = _mm512_add_epi32(total, dot[r][c]);
        }
        if constexpr (kIsSums)
          _mm512_storeu_si512(out + ((m0 + r) * a.num_blocks + b) * kTile, total);
        else
          gacc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(xs[r][b]), gacc[r]);
      }
    }
    if constexpr (kIsSums) continue;
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * kTile)));
    if constexpr (ASYM) {
      const __m512 zw = _mm512_mul_ps(ws, zeros.load16(g * kTile));
      for (int r = 0; r < ROWS; ++r) {
        acc[r] = _mm512_fmadd_ps(ws, gacc[r], acc[r]);
        acc[r] = _mm512_fnmadd_ps(zw, _mm512_set1_ps(xc[r][g]), acc[r]);
      }
    } else {
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(ws, gacc[r], acc[r]);
    }
  }
  if constexpr (!kIsSums)
    for (int r = 0; r < ROWS; ++r) store16(out + (m0 + r) * ldo, acc[r], out_mask);
}

// tile_kernel with or without software prefetch, and with its chains, as chosen for ROWS
// rows and the CPU. The choices are template arguments: a run-time branch in the inner loop
// makes gcc copy accumulators between registers on every chunk.
template <int BITS, int ROWS, bool ASYM, typename T>
void tile_rows_of(const uint8_t* w, const uint16_t* s, Zeros z, float zc, const Activations8& a, int64_t m0,
                  int64_t block, int64_t bpg, T* out, int64_t ldo, __mmask16 mask) {
  constexpr int kChains = default_chains<BITS, ROWS>();
  if constexpr (ROWS <= kFewRows) {
    if (is_amd_cpu())
      return tile_kernel<BITS, ROWS, ASYM, Prefetch::kNone, kChains>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask);
    return tile_kernel<BITS, ROWS, ASYM, Prefetch::kL2L1, kChains>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask);
  }
  if constexpr (ROWS >= kAmdOneChainMinRows && kChains > 1) {
    if (is_amd_cpu())
      return tile_kernel<BITS, ROWS, ASYM, Prefetch::kL2, 1>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask);
  }
  tile_kernel<BITS, ROWS, ASYM, Prefetch::kL2, kChains>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask);
}

template <int BITS, bool ASYM, typename T>
void tile_rows(int rows, const uint8_t* w, const uint16_t* s, Zeros z, float zc, const Activations8& a,
               int64_t m0, int64_t block, int64_t bpg, T* out, int64_t ldo, __mmask16 mask) {
  switch (rows) {
    case 1: tile_rows_of<BITS, 1, ASYM>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask); break;
    case 2: tile_rows_of<BITS, 2, ASYM>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask); break;
    case 3: tile_rows_of<BITS, 3, ASYM>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask); break;
    case 4: tile_rows_of<BITS, 4, ASYM>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask); break;
    case 5: tile_rows_of<BITS, 5, ASYM>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask); break;
    case 6: tile_rows_of<BITS, 6, ASYM>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask); break;
    case 7: tile_rows_of<BITS, 7, ASYM>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask); break;
    default: tile_rows_of<BITS, 8, ASYM>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask); break;
  }
}

// Tiles [t0, t1) of out [M, ldo] = x W^T (N = n output columns). Never inlined: inlined into
// its caller, the 1-row INT4 loop compiles worse (whole decode steps ~0.95x).
template <int BITS, bool ASYM, typename T>
__attribute__((noinline)) void gemm_tiles(const Activations8& a, const uint8_t* w, const uint16_t* s, Zeros z, float zc,
                                          int64_t n, T* out, int64_t ldo, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = a.k_pad * BITS / 8 * kTile;
  const int64_t bpg = a.group / a.block;
  for (int64_t t = t0; t < t1; ++t) {
    const __mmask16 mask = tail_mask(n - t * kTile);
    const Zeros zt = z.offset(t * a.num_groups * kTile);
    for (int64_t m0 = 0; m0 < a.rows; m0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, a.rows - m0));
      tile_rows<BITS, ASYM>(rows, w + t * tile_bytes, s + t * a.num_groups * kTile, zt, zc, a, m0, a.block, bpg,
                            out + t * kTile, ldo, mask);
    }
  }
}

// ---- Dense bf16 weights, few rows: out = x W^T with AVX512-BF16 dot products -----------------
// Without AMX, oneDNN's bf16 GEMM reads decode weights well below memory bandwidth at M <= 8;
// this kernel reads them 1.5-1.95x faster at M = 1 (Zen 4, a 1.5B model's shapes). W stays in
// its [N, K] row-major layout (tied embeddings share it): R output rows at a time, each a
// stream of 64-byte lines; every line feeds one vdpbf16ps per x row.
// Output (m, n) is always the same 16-lane fp32 accumulation over k in 32-wide steps, reduced
// and rounded once to bf16 (+ bias in fp32 before the rounding), whatever M: row-invariant, so
// a verification pass reproduces one-token decoding bit for bit without padding to min_rows.
// Each step also prefetches, into L2, the same line of the next block's rows: the R short row
// streams leave the hardware prefetcher behind (whole bf16 decode steps up to 1.6x faster).
// Plain PyTorch twin: fastdraft/kernels/fused.py::reference_dense_linear.
constexpr int kDenseMaxRows = 8;

template <int M, int R>
__attribute__((target("avx512bf16"))) void dense_rows(const BF16* w, int64_t k, const BF16* x,
                                                     const float* bias, BF16* out, int64_t n, int64_t n0) {
  __m512 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 32) {
    __m512i xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(x + m * k + c);
    for (int i = 0; i < R; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + R + i) * k + c), _MM_HINT_T1);
      const __m512i wv = _mm512_loadu_si512(w + (n0 + i) * k + c);
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_dpbf16_ps(acc[i][m], (__m512bh)wv, (__m512bh)xv[m]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) {
      const float y = _mm512_reduce_add_ps(acc[i][m]) + (bias ? bias[n0 + i] : 0.0f);
      out[m * n + n0 + i] = BF16{fastdraft::half::float_to_bf16(y)};  // round to nearest even
    }
}



// Row n of one tile, 16 chunks at a time, as 128 (INT4, INT6) or 64 (INT8) consecutive uint8 values.
template <typename T>
void dequant_tile(int64_t bits, const uint8_t* w, const uint16_t* s, Zeros z, float zc, int64_t k,
                  int64_t k_pad, int64_t group, int64_t rows, T* out) {
  const int64_t chunk_k = bits == 8 ? 4 : 8;
  const int64_t num_chunks = k_pad / chunk_k;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i even = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i odd = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  alignas(64) uint8_t vals[128];
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i index = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                              _mm512_set1_epi32(kTile)), _mm512_set1_epi32(static_cast<int>(r)));
    for (int64_t c0 = 0; c0 < num_chunks; c0 += 16) {
      int64_t count;
      if (bits == 6) {  // scalar: this path runs once per weight (large-M prefill, tests)
        for (int64_t i = 0; i < 16 && c0 + i < num_chunks; ++i) {
          const uint8_t* chunk = w + (c0 + i) * 96;
          for (int64_t j = 0; j < 4; ++j) {
            const int64_t p = 4 * r + j;
            const int high = chunk[64 + p % 32] >> (p < 32 ? 0 : 4);
            vals[8 * i + j] = static_cast<uint8_t>((chunk[p] & 15) | (high & 3) << 4);
            vals[8 * i + 4 + j] = static_cast<uint8_t>((chunk[p] >> 4) | (high >> 2 & 3) << 4);
          }
        }
        count = 128;
      } else if (bits == 4) {
        const __m512i v = _mm512_i32gather_epi32(index, w + c0 * 64, 4);  // dword i = chunk c0 + i of row r
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        const __m512i a = _mm512_unpacklo_epi32(lo, hi);  // chunks {0,1},{4,5},{8,9},{12,13}
        const __m512i b = _mm512_unpackhi_epi32(lo, hi);  // chunks {2,3},{6,7},{10,11},{14,15}
        _mm512_store_si512(vals, _mm512_permutex2var_epi64(a, even, b));
        _mm512_store_si512(vals + 64, _mm512_permutex2var_epi64(a, odd, b));
        count = 128;
      } else {
        _mm512_store_si512(vals, _mm512_i32gather_epi32(index, w + c0 * 64, 4));
        count = 64;
      }
      const int64_t k0 = c0 * chunk_k;
      for (int64_t p = 0; p < count; p += 16) {
        const int64_t kk = k0 + p;
        if (kk >= k) break;
        const int64_t g = kk / group;
        const float scale = fastdraft::half::fp16_to_float(s[g * kTile + r]);
        const float zero = z.is_set() ? z.at(g * kTile + r) : zc;
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(vals + p))));
        const __m512 wv = _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(zero)), _mm512_set1_ps(scale));
        store16(out + r * k + kk, wv, tail_mask(k - kk));
      }
    }
  }
}


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

// out[i] = a[i] + b[i] for i < n, rounded to T as torch's add is (out may alias a).
template <typename T>
void add_span(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    store16(out + i, _mm512_add_ps(load16(a + i, m), load16(b + i, m)), m);
  }
}


constexpr int64_t kKeysPerSplit = 256;  // fixed (not per thread count): results are deterministic
// Software prefetch this many keys ahead in q K^T and P V, through the block table. A head's
// keys are one run per block, the blocks scattered through the pool, and the hardware
// prefetchers stop at every 4 KiB boundary and every jump between blocks, so without it each
// 16 keys (D=128) start with a DRAM round trip. Into L1 on Intel; into L2 on AMD Zen 4,
// where L1 prefetches stall on the few L1 miss buffers. One layer over ~1K cold keys runs
// 1.3-1.5x faster with it; 32 keys ahead beats 16 and 64.
constexpr int64_t kKeysAhead = 32;

// Prefetch `count` bf16 values from p into L1 (L2_PREFETCH: into L2). The choice is a template
// argument down the attention's call chain: a run-time branch here makes the attention 10-20%
// slower.
template <bool L2_PREFETCH>
inline void prefetch_row(const BF16* p, int64_t count) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < 2 * count; b += 64) _mm_prefetch(c + b, L2_PREFETCH ? _MM_HINT_T1 : _MM_HINT_T0);
}

// Where key (or value) row l of a sequence lies: in the blocks of a paged pool, found through
// its block table.
template <typename T>
struct BlockRows {
  const T* base;         // this layer's pool at this kv head: block b's row i is base + b * block_stride + i * d
  const int64_t* table;  // the sequence's block ids
  int64_t block_stride, row_stride, shift, mask;  // block_size = 1 << shift, mask = block_size - 1
  const T* operator()(int64_t l) const { return base + table[l >> shift] * block_stride + (l & mask) * row_stride; }
};

// Scores of `rows` query rows against keys l0..l0+n-1, fp32 math: scores [rows, n].
template <typename T, typename Rows>
void qk_scores(const float* q, const Rows& k, int64_t rows, int64_t d, int64_t l0, int64_t n, float* scores) {
  const int64_t vecs = d / 16;
  for (int64_t l = 0; l < n; ++l) {
    const T* kr = k(l0 + l);
    __m512 kv[16];
    for (int64_t i = 0; i < vecs; ++i) kv[i] = load16(kr + 16 * i, 0xffff);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * d;
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
      for (int64_t i = 1; i < vecs; ++i) s = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * i), kv[i], s);
      scores[r * n + l] = _mm512_reduce_add_ps(s);
    }
  }
}

// In-register transpose of a 16x16 matrix of 32-bit elements (r[i] lane j -> r[j] lane i).
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
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
    const __m512i v = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88), w = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xDD);
    r[m] = _mm512_shuffle_i32x4(v, v2, 0x88);
    r[8 + m] = _mm512_shuffle_i32x4(v, v2, 0xDD);
    r[4 + m] = _mm512_shuffle_i32x4(w, w2, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(w, w2, 0xDD);
  }
}

// NR query rows (bf16 pairs, one dword per two dims) against a transposed key tile
// kt [pairs][16 keys]: 16 scores per row, two accumulator chains per row (fixed, so a row's
// result does not depend on how many rows share the call).
template <int NR>
__attribute__((target("avx512bf16"))) void qk_tile_bf16(const uint32_t* qp, int64_t pairs, const uint32_t* kt,
                                                         float scale, float* scores, int64_t n, int64_t lt,
                                                         __mmask16 mask) {
  // Fully unrolled over rows, so the accumulators live in registers (not stack arrays).
  __m512 acc0[NR], acc1[NR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    acc0[r] = _mm512_setzero_ps();
    acc1[r] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; p += 2) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + 16 * p);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + 16 * (p + 1));
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      acc0[r] = _mm512_dpbf16_ps(acc0[r], k0, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * pairs + p])));
      acc1[r] = _mm512_dpbf16_ps(acc1[r], k1, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * pairs + p + 1])));
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
    _mm512_mask_storeu_ps(scores + r * n + lt, mask, _mm512_mul_ps(_mm512_add_ps(acc0[r], acc1[r]), vscale));
}

// bf16 scores with AVX512-BF16 dot products: each 16-key tile is transposed once (to 16 keys
// per vector) and shared by every query row, so no row pays a horizontal reduction per key.
template <bool L2_PREFETCH, typename Rows>
void qk_scores_bf16(const uint32_t* qp, float scale, const Rows& k, int64_t rows, int64_t d, int64_t l0, int64_t n,
                    float* scores) {
  const int64_t pairs = d / 2;
  alignas(64) uint32_t kt[128 * 16];  // [pairs][16 keys], d <= 256
  for (int64_t lt = 0; lt < n; lt += 16) {
    const int64_t nk = std::min<int64_t>(16, n - lt);
    for (int64_t j = lt + kKeysAhead; j < std::min<int64_t>(n, lt + kKeysAhead + 16); ++j)
      prefetch_row<L2_PREFETCH>(k(l0 + j), d);
    for (int64_t c = 0; c < pairs / 16; ++c) {
      __m512i tile[16];
      for (int j = 0; j < 16; ++j)
        tile[j] = j < nk ? _mm512_loadu_si512(k(l0 + lt + j) + 32 * c) : _mm512_setzero_si512();
      transpose16x16(tile);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(kt + 16 * (16 * c + p), tile[p]);
    }
    const __mmask16 mask = tail_mask(nk);
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      const uint32_t* qr = qp + r0 * pairs;
      float* sr = scores + r0 * n;
      switch (std::min<int64_t>(8, rows - r0)) {
        case 1: qk_tile_bf16<1>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 2: qk_tile_bf16<2>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 3: qk_tile_bf16<3>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 4: qk_tile_bf16<4>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 5: qk_tile_bf16<5>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 6: qk_tile_bf16<6>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 7: qk_tile_bf16<7>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        default: qk_tile_bf16<8>(qr, pairs, kt, scale, sr, n, lt, mask); break;
      }
    }
  }
}

// One block of NR query rows x NV * 16 dims of P V (bf16 dot products over key pairs). The
// sizes are compile-time so the NR x NV accumulators stay in registers. p_pairs [NR rows of
// num_pairs]; a row stops at its own last key pair (row_pairs), every row sees pairs_all.
template <int NR, int NV, bool L2_PREFETCH, typename Rows>
__attribute__((target("avx512bf16"))) void pv_block(const uint32_t* p_pairs, int64_t num_pairs,
                                                    const int64_t* row_pairs, int64_t pairs_all, int64_t pairs_any,
                                                    const Rows& v, int64_t l0, int64_t c0, int64_t n,
                                                    float* acc_out, int64_t d) {
  const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                          39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  __m512 acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs_any; ++j) {
    const BF16* va = v(l0 + 2 * j) + c0;
    if (2 * j + kKeysAhead + 1 < n)  // this block's dims of the two rows kKeysAhead keys on
      for (int64_t r = kKeysAhead; r <= kKeysAhead + 1; ++r) prefetch_row<L2_PREFETCH>(v(l0 + 2 * j + r) + c0, 16 * NV);
    const bool has_b = 2 * j + 1 < n;
    // Keys 2j and 2j + 1 are never in different blocks: blocks hold an even number of rows.
    const BF16* vb = has_b ? v(l0 + 2 * j + 1) + c0 : va;
    __m512i vv[NV];  // dims 16i..16i+15 of keys 2j and 2j+1, interleaved
    for (int h = 0; h < NV / 2; ++h) {
      const __m512i a = _mm512_loadu_si512(va + 32 * h);
      const __m512i b = has_b ? _mm512_loadu_si512(vb + 32 * h) : _mm512_setzero_si512();
      vv[2 * h] = _mm512_permutex2var_epi16(a, idx_lo, b);
      vv[2 * h + 1] = _mm512_permutex2var_epi16(a, idx_hi, b);
    }
    const bool is_shared = j < pairs_all;
    for (int r = 0; r < NR; ++r) {
      if (!is_shared && j >= row_pairs[r]) continue;
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(p_pairs[r * num_pairs + j]));
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)vv[i], p);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc_out + r * d + 16 * i, acc[r][i]);
}

template <int NV, bool L2_PREFETCH, typename Rows>
void pv_rows(int64_t nr, const uint32_t* pp, int64_t num_pairs, const int64_t* row_pairs, int64_t pairs_all,
             int64_t pairs_any, const Rows& v, int64_t l0, int64_t c0, int64_t n, float* out, int64_t d) {
  switch (nr) {
    case 1: pv_block<1, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
    case 2: pv_block<2, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
    case 3: pv_block<3, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
    case 4: pv_block<4, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
    case 5: pv_block<5, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
    default:
      pv_block<6, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
  }
}

// P V with AVX512-BF16 dot products over pairs of keys: bf16 probabilities p_pairs [rows,
// num_pairs] (dword j = keys 2j, 2j+1; zero past a row's last key) -> acc_out [rows, d] fp32.
// Two V rows are interleaved once (16 dims x 2 keys per vector) and feed up to 6 query rows,
// 64 dims at a time. A row stops at its own last key pair; an odd last key is paired with a
// zero row.
template <bool L2_PREFETCH, typename Rows>
void pv_bf16(const uint32_t* p_pairs, int64_t num_pairs, const Rows& v, int64_t rows, int64_t d, int64_t l0, int64_t n,
             const int64_t* num_keys, float* acc_out) {
  std::vector<int64_t> row_pairs(rows);
  for (int64_t r = 0; r < rows; ++r) row_pairs[r] = (num_keys[r] + 1) / 2;
  constexpr int kRows = 6;  // 6 rows x 4 vectors of accumulators fit the 32 vector registers
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min<int64_t>(kRows, rows - r0);
    int64_t pairs_all = num_pairs, pairs_any = 0;
    for (int64_t r = 0; r < nr; ++r) {
      pairs_all = std::min(pairs_all, row_pairs[r0 + r]);
      pairs_any = std::max(pairs_any, row_pairs[r0 + r]);
    }
    const uint32_t* pp = p_pairs + r0 * num_pairs;
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      float* out = acc_out + r0 * d + c0;
      if (d - c0 >= 64)
        pv_rows<4, L2_PREFETCH>(nr, pp, num_pairs, row_pairs.data() + r0, pairs_all, pairs_any, v, l0, c0, n, out, d);
      else  // d % 32 == 0 on this path: a last 32 dims
        pv_rows<2, L2_PREFETCH>(nr, pp, num_pairs, row_pairs.data() + r0, pairs_all, pairs_any, v, l0, c0, n, out, d);
    }
  }
}

// One split (keys l0..l1-1) for `rows` query rows; row r sees only its first num_keys[r]
// keys of the split (0: none). Writes each row's max, exp-sum and unnormalised P V.
template <typename T, bool L2_PREFETCH, typename Rows>
void attend_split(const float* q, const uint32_t* q_pairs, float scale, const Rows& k, const Rows& v, int64_t rows,
                  int64_t d, int64_t l0, int64_t l1, const int64_t* num_keys, float* max_out, float* sum_out,
                  float* acc_out) {
  const int64_t n = l1 - l0;
  std::vector<float> scores(rows * n);
  const int64_t vecs = d / 16;
  const bool is_bf16 = q_pairs != nullptr;  // AVX512-BF16 dot products for q K^T and P V
  if constexpr (std::is_same_v<T, BF16>) {
    if (is_bf16) qk_scores_bf16<L2_PREFETCH>(q_pairs, scale, k, rows, d, l0, n, scores.data());
  }
  if (!is_bf16) qk_scores<T>(q, k, rows, d, l0, n, scores.data());
  // bf16 path: probabilities rounded to bf16 and packed in key pairs for pv_bf16, zero past
  // each row's last key (an odd last key pairs with zero).
  const int64_t num_pairs = (n + 1) / 2;
  std::vector<uint16_t> probs_bf16(is_bf16 ? rows * 2 * num_pairs : 0);
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores.data() + r * n;
    const int64_t nr = num_keys[r];
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t l = 0; l < nr; l += 16) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(nr - l), sr + l));
    const float m = _mm512_reduce_max_ps(vmax);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t l = 0; l < nr; l += 16) {
      const __mmask16 mk = tail_mask(nr - l);
      __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sr + l), _mm512_set1_ps(m))));
      if (is_bf16) {
        e = round_bf16(e);  // P V multiplies bf16 probabilities; normalise by the same values
        // e is already bf16-valued: store its top halves (store16 would round a second time,
        // ~1.1x slower for a 5-token verification).
        _mm256_mask_storeu_epi16(probs_bf16.data() + r * 2 * num_pairs + l, mk,
                                 _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(e), 16)));
      } else {
        _mm512_mask_storeu_ps(sr + l, mk, e);
      }
      vsum = _mm512_add_ps(vsum, e);
    }
    max_out[r] = m;
    sum_out[r] = _mm512_reduce_add_ps(vsum);
  }
  if constexpr (std::is_same_v<T, BF16>) {
    if (is_bf16) {
      pv_bf16<L2_PREFETCH>(reinterpret_cast<const uint32_t*>(probs_bf16.data()), num_pairs, v, rows, d, l0, n,
                           num_keys, acc_out);
      return;
    }
  }
  // out = P V: each V row is converted once and feeds up to 6 query rows, 64 dims at a time
  // (6 x 4 accumulators fit the 32 vector registers). A row stops at its own last key.
  constexpr int kRows = 6, kVecs = 4;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min<int64_t>(kRows, rows - r0);
    int64_t n_all = n, n_any = 0;  // keys every row of the block sees / any row sees
    for (int64_t r = 0; r < nr; ++r) {
      n_all = std::min(n_all, num_keys[r0 + r]);
      n_any = std::max(n_any, num_keys[r0 + r]);
    }
    for (int64_t i0 = 0; i0 < vecs; i0 += kVecs) {
      const int64_t nv = std::min<int64_t>(kVecs, vecs - i0);
      __m512 acc[kRows][kVecs];
      for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < kVecs; ++i) acc[r][i] = _mm512_setzero_ps();
      for (int64_t l = 0; l < n_any; ++l) {
        const T* vr = v(l0 + l) + 16 * i0;
        __m512 vv[kVecs];
        for (int i = 0; i < kVecs; ++i) vv[i] = i < nv ? load16(vr + 16 * i, 0xffff) : _mm512_setzero_ps();
        const bool is_shared = l < n_all;
        for (int r = 0; r < kRows; ++r) {
          if (r >= nr) break;
          if (!is_shared && l >= num_keys[r0 + r]) continue;
          const __m512 p = _mm512_set1_ps(scores[(r0 + r) * n + l]);
          for (int i = 0; i < kVecs; ++i) acc[r][i] = _mm512_fmadd_ps(p, vv[i], acc[r][i]);
        }
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(acc_out + (r0 + r) * d + 16 * (i0 + i), acc[r][i]);
    }
  }
}


// Merges one query row's per-split partial softmaxes (flash-decoding) into out [d].
template <typename T>
void merge_row(int64_t num_splits, const float* maxes, const float* sums, const float* const* accs, int64_t d,
               T* out) {
  float m = -INFINITY;
  for (int64_t sp = 0; sp < num_splits; ++sp) m = std::max(m, maxes[sp]);
  float total = 0.0f;
  __m512 acc[16];
  for (int64_t i = 0; i < d / 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t sp = 0; sp < num_splits; ++sp) {
    const float w = std::exp(maxes[sp] - m);
    total += w * sums[sp];
    const __m512 wv = _mm512_set1_ps(w);
    const float* a = accs[sp];
    for (int64_t i = 0; i < d / 16; ++i) acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(a + 16 * i), acc[i]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (int64_t i = 0; i < d / 16; ++i) store16(out + 16 * i, _mm512_mul_ps(acc[i], inv), 0xffff);
}

// ---- sampling -----------------------------------------------------------------------------
// torch.argmax's index: one pass while no NaN shows up, then a second over the (cached) row
// for the first index holding the maximum.
int64_t argmax_row(const float* row, int64_t n) {
  int64_t found = -1;
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n && found < 0; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (is_nan) found = i + __builtin_ctz(is_nan);
    vmax = _mm512_max_ps(vmax, v);
  }
  float best = _mm512_reduce_max_ps(vmax);
  for (; i < n && found < 0; ++i) {
    if (std::isnan(row[i])) found = i;
    else best = std::max(best, row[i]);
  }
  if (found < 0) {
    const __m512 vbest = _mm512_set1_ps(best);
    for (i = 0; i + 16 <= n && found < 0; i += 16) {
      const __mmask16 is_best = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), vbest, _CMP_EQ_OQ);
      if (is_best) found = i + __builtin_ctz(is_best);
    }
    for (; i < n && found < 0; ++i)
      if (row[i] == best) found = i;
  }
  return found;
}

// Running float64 block sums, 16 values (two 8-lane accumulators) at a time.
double block_cdf(const float* row, int64_t n, int64_t block, double* cdf) {
  const int64_t num_blocks = (n + block - 1) / block;
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* p = row + b * block;
    const int64_t len = std::min(block, n - b * block);
    int64_t j = 0;
    __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
    for (; j + 16 <= len; j += 16) {
      acc0 = _mm512_add_pd(acc0, _mm512_cvtps_pd(_mm256_loadu_ps(p + j)));
      acc1 = _mm512_add_pd(acc1, _mm512_cvtps_pd(_mm256_loadu_ps(p + j + 8)));
    }
    double sum = _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
    for (; j < len; ++j) sum += p[j];
    total += sum;
    cdf[b] = total;
  }
  return total;
}

// ---- the table's entry points: raw pointers in, the kernels above by element type ----------

// Calls fn(T* tag) with T the element type.
template <typename F>
void with_type(int32_t type, F&& fn) {
  if (type == fastdraft::kElemFloat32) fn(static_cast<float*>(nullptr));
  else fn(static_cast<BF16*>(nullptr));
}

void quantize_row_entry(int32_t type, const void* x, int64_t k, const Activations8* a, int64_t m, int64_t b0,
                        int64_t b1) {
  with_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    quantize_row(static_cast<const T*>(x), k, a->block, a->group / a->block, *a, m, b0, b1);
  });
}

Zeros zeros_of(const WoqView& w) { return Zeros{w.zeros_u8, w.zeros_f16}; }

void woq_tiles_entry(const WoqView* w, const Activations8* a, int64_t t0, int64_t t1) {
  const Zeros z = zeros_of(*w);
  auto run = [&](auto* o) {
    if (w->bits == 4) {
      if (z.is_set()) gemm_tiles<4, true>(*a, w->packed, w->scales, z, w->zero_const, w->out_features, o, w->ldo, t0, t1);
      else gemm_tiles<4, false>(*a, w->packed, w->scales, z, w->zero_const, w->out_features, o, w->ldo, t0, t1);
    } else if (w->bits == 6) {
      gemm_tiles<6, false>(*a, w->packed, w->scales, z, w->zero_const, w->out_features, o, w->ldo, t0, t1);
    } else {
      gemm_tiles<8, false>(*a, w->packed, w->scales, z, w->zero_const, w->out_features, o, w->ldo, t0, t1);
    }
  };
  if (w->out_type == fastdraft::kElemFloat32) run(static_cast<float*>(w->out));
  else run(static_cast<BF16*>(w->out));
}

void woq_block_sums_entry(const WoqView* w, const Activations8* a, int64_t t, int32_t* sums) {
  const Zeros z = zeros_of(*w).offset(t * a->num_groups * kTile);
  const uint8_t* tile = w->packed + t * (a->k_pad * w->bits / 8 * kTile);
  const uint16_t* s = w->scales + t * a->num_groups * kTile;
  const int64_t bpg = a->group / a->block;
  for (int64_t m0 = 0; m0 < a->rows; m0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, a->rows - m0));
    if (w->bits == 4 && z.is_set()) tile_rows<4, true>(rows, tile, s, z, w->zero_const, *a, m0, a->block, bpg, sums, 0, 0);
    else if (w->bits == 4) tile_rows<4, false>(rows, tile, s, z, w->zero_const, *a, m0, a->block, bpg, sums, 0, 0);
    else if (w->bits == 6) tile_rows<6, false>(rows, tile, s, z, w->zero_const, *a, m0, a->block, bpg, sums, 0, 0);
    else tile_rows<8, false>(rows, tile, s, z, w->zero_const, *a, m0, a->block, bpg, sums, 0, 0);
  }
}

void dequant_tile_entry(const WoqView* w, int64_t t, int64_t k, int32_t type, void* out) {
  const int64_t num_groups = w->k_pad / w->group;
  const int64_t rows = std::min<int64_t>(kTile, w->out_features - t * kTile);
  const uint8_t* tile = w->packed + t * (w->k_pad * w->bits / 8 * kTile);
  const uint16_t* s = w->scales + t * num_groups * kTile;
  const Zeros z = zeros_of(*w).offset(t * num_groups * kTile);
  with_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dequant_tile(w->bits, tile, s, z, w->zero_const, k, w->k_pad, w->group, rows, static_cast<T*>(out));
  });
}

void rms_norm_row_entry(int32_t type, const void* a, const void* b, const void* weight, void* sum, void* out,
                        int64_t h, float eps, int64_t c0, int64_t c1) {
  with_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_row<T>(static_cast<const T*>(a), static_cast<const T*>(b), static_cast<const T*>(weight),
                    static_cast<T*>(sum), static_cast<T*>(out), h, eps, c0, c1);
  });
}

void silu_mul_entry(int32_t type, const void* gate, const void* up, void* out, int64_t n) {
  with_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_span<T>(static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out), n);
  });
}

void rotary_row_entry(int32_t type, const void* x, const void* cos, const void* sin, void* out, int64_t heads,
                      int64_t head_dim) {
  with_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rotary_row<T>(static_cast<const T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin),
                  static_cast<T*>(out), heads, head_dim);
  });
}

void add_entry(int32_t type, const void* a, const void* b, void* out, int64_t n) {
  with_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_span<T>(static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n);
  });
}

void scale_to_float_entry(int32_t type, const void* x, float scale, float* out, int64_t n) {
  const __m512 vscale = _mm512_set1_ps(scale);
  with_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* in = static_cast<const T*>(x);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      store16(out + i, _mm512_mul_ps(load16(in + i, m), vscale), m);
    }
  });
}

int32_t has_bf16_dot_entry() { return cpu_has_avx512_bf16() ? 1 : 0; }

void attend_split_entry(const AttendArgs* p) {
  const int64_t d = p->head_dim, block_size = int64_t{1} << p->block_shift;
  const bool is_l2 = is_amd_cpu();  // into L2 there, see kKeysAhead
  with_type(p->type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const BlockRows<T> k{static_cast<const T*>(p->k_base), p->block_table, p->block_stride, d, p->block_shift,
                         block_size - 1};
    const BlockRows<T> v{static_cast<const T*>(p->v_base), p->block_table, p->block_stride, d, p->block_shift,
                         block_size - 1};
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(p->q_bf16);
    if (is_l2)
      attend_split<T, true>(p->qf, pairs, p->scale, k, v, p->rows, d, p->l0, p->l1, p->num_keys, p->max_out,
                            p->sum_out, p->acc_out);
    else
      attend_split<T, false>(p->qf, pairs, p->scale, k, v, p->rows, d, p->l0, p->l1, p->num_keys, p->max_out,
                             p->sum_out, p->acc_out);
  });
}

void merge_splits_entry(int64_t num_splits, const float* maxes, const float* sums, const float* const* accs,
                        int64_t d, int32_t type, void* out) {
  with_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    merge_row(num_splits, maxes, sums, accs, d, static_cast<T*>(out));
  });
}

// Output rows [r0, r1) of W for num_x_rows rows of x: R weight rows share each x line (more
// when x has few rows), the rest one by one; each output's arithmetic is the same either way.
void dense_bf16_rows_entry(const uint16_t* w_bits, int64_t k, const uint16_t* x_bits, int64_t num_x_rows,
                           const float* bias, uint16_t* out_bits, int64_t n, int64_t r0, int64_t r1) {
  const BF16* w = reinterpret_cast<const BF16*>(w_bits);
  const BF16* x = reinterpret_cast<const BF16*>(x_bits);
  BF16* out = reinterpret_cast<BF16*>(out_bits);
  auto rows = [&](auto m_tag) {
    constexpr int M = decltype(m_tag)::value;
    constexpr int R = M <= 2 ? 8 : 4;  // R x M accumulators, M x rows of x, one weight line
    int64_t r = r0;
    for (; r + R <= r1; r += R) dense_rows<M, R>(w, k, x, bias, out, n, r);
    for (; r < r1; ++r) dense_rows<M, 1>(w, k, x, bias, out, n, r);
  };
  switch (num_x_rows) {
    case 1: rows(std::integral_constant<int, 1>{}); break;
    case 2: rows(std::integral_constant<int, 2>{}); break;
    case 3: rows(std::integral_constant<int, 3>{}); break;
    case 4: rows(std::integral_constant<int, 4>{}); break;
    case 5: rows(std::integral_constant<int, 5>{}); break;
    case 6: rows(std::integral_constant<int, 6>{}); break;
    case 7: rows(std::integral_constant<int, 7>{}); break;
    default: rows(std::integral_constant<int, 8>{}); break;
  }
}

const fastdraft::KernelTable kTable = {
    fastdraft::kKernelTableVersion,
    sizeof(fastdraft::KernelTable),
    "avx512_vnni",
    kTile,
    quantize_row_entry,
    woq_tiles_entry,
    woq_block_sums_entry,
    dequant_tile_entry,
    rms_norm_row_entry,
    silu_mul_entry,
    rotary_row_entry,
    add_entry,
    scale_to_float_entry,
    has_bf16_dot_entry,
    attend_split_entry,
    merge_splits_entry,
    dense_bf16_rows_entry,
    argmax_row,
    block_cdf,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const fastdraft::KernelTable* fastdraft_kernel_table(void) {
  return &kTable;
}
