// Weight-only INT4/INT6/INT8 matmuls for x86-64 with AVX-512 + VNNI.
//
// Layout (built once by fastdraft/kernels/x86.py::repack, see there for the exact spec):
//   weights  uint8 [num_tiles, num_chunks, 16, 4]: 16 output rows per tile; each row holds
//            4 bytes per chunk, so one 64-byte load feeds one vpdpbusd across 16 rows.
//            INT4 chunk = 8 input channels: byte j holds k = 8c + j (low nibble) and
//            k = 8c + 4 + j (high nibble). INT8 chunk = 4 channels, stored as q + 128.
//            INT6 chunk = INT4's 64 bytes of low nibbles, then 32 bytes of their bits 4-5.
//   scales   fp16 [num_tiles, num_groups, 16]; zeros [num_tiles, num_groups, 16] (asym), uint8
//            integers or fp16 fractional zero points ("float zeros").
//
// Decode math: activations are quantized per block of `block` channels to int8 (scale =
// absmax / 127), so each block is an exact int32 dot product (u8 weights x s8 activations)
//     y[n] = sum_g  s[n,g] * (sum_{b in g} d_b * dot_b[n])  -  s[n,g] * z[n,g] * corr_g
// with corr_g = sum_{b in g} d_b * sum(xq_b). A constant zero point (symmetric INT4, INT8) is
// an integer, so its term joins each block's integer dot instead: dot_b[n] - z * sum(xq_b)
// starts the block's accumulator, and no correction is left per group. Every output row
// follows the same sequence of operations whatever the number of rows in the call, so results
// are row-invariant.
// The plain PyTorch twin of this math is fastdraft/kernels/x86.py::reference_woq_matmul.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd_x86.h"
#include "x86_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

using namespace fastdraft::simd;

namespace {

using fastdraft::Activations;

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
  const at::Half* f16 = nullptr;

  bool is_set() const { return u8 || f16; }
  Zeros offset(int64_t i) const { return Zeros{u8 ? u8 + i : nullptr, f16 ? f16 + i : nullptr}; }
  __m512 load16(int64_t i) const {  // zeros i..i+15 as floats
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f16 + i)));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u8 + i))));
  }
  float at(int64_t i) const { return f16 ? static_cast<float>(f16[i]) : static_cast<float>(u8[i]); }
};

// Unset (symmetric, or INT8) when ``zeros`` is undefined or empty.
Zeros zeros_of(const torch::Tensor& zeros) {
  if (!zeros.defined() || zeros.numel() == 0) return Zeros{};
  if (zeros.scalar_type() == at::kHalf) return Zeros{nullptr, zeros.data_ptr<at::Half>()};
  return Zeros{zeros.data_ptr<uint8_t>(), nullptr};
}

// Blocks [b0, b1) of row m (b0 starts a group).
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t block, int64_t blocks_per_group, Activations& a, int64_t m,
                  int64_t b0, int64_t b1) {
  int8_t* q = a.q.data() + m * a.k_pad;
  float* scale = a.scale.data() + m * a.num_blocks;
  float* corr = a.corr.data() + m * a.num_groups;
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
template <int BITS, int ROWS, bool ASYM, Prefetch PREFETCH, int CHAINS, typename T>
void tile_kernel(const uint8_t* w, const at::Half* scales, Zeros zeros, float zero_const,
                 const Activations& a, int64_t m0, int64_t block, int64_t blocks_per_group,
                 T* out, int64_t ldo, __mmask16 out_mask) {
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
    xq[r] = a.q.data() + (m0 + r) * a.k_pad;
    xs[r] = a.scale.data() + (m0 + r) * a.num_blocks;
    xc[r] = a.corr.data() + (m0 + r) * a.num_groups;
    xsum[r] = a.qsum.data() + (m0 + r) * a.num_blocks;
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
        gacc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(xs[r][b]), gacc[r]);
      }
    }
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
  for (int r = 0; r < ROWS; ++r) store16(out + (m0 + r) * ldo, acc[r], out_mask);
}

// tile_kernel with or without software prefetch, and with its chains, as chosen for ROWS
// rows and the CPU. The choices are template arguments: a run-time branch in the inner loop
// makes gcc copy accumulators between registers on every chunk.
template <int BITS, int ROWS, bool ASYM, typename T>
void tile_rows_of(const uint8_t* w, const at::Half* s, Zeros z, float zc, const Activations& a, int64_t m0,
                  int64_t block, int64_t bpg, T* out, int64_t ldo, __mmask16 mask) {
  constexpr int kChains = default_chains<BITS, ROWS>();
  if constexpr (ROWS <= kFewRows) {
    if (fastdraft::is_amd_cpu())
      return tile_kernel<BITS, ROWS, ASYM, Prefetch::kNone, kChains>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask);
    return tile_kernel<BITS, ROWS, ASYM, Prefetch::kL2L1, kChains>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask);
  }
  if constexpr (ROWS >= kAmdOneChainMinRows && kChains > 1) {
    if (fastdraft::is_amd_cpu())
      return tile_kernel<BITS, ROWS, ASYM, Prefetch::kL2, 1>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask);
  }
  tile_kernel<BITS, ROWS, ASYM, Prefetch::kL2, kChains>(w, s, z, zc, a, m0, block, bpg, out, ldo, mask);
}

template <int BITS, bool ASYM, typename T>
void tile_rows(int rows, const uint8_t* w, const at::Half* s, Zeros z, float zc, const Activations& a,
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
__attribute__((noinline)) void gemm_tiles(const Activations& a, const uint8_t* w, const at::Half* s, Zeros z, float zc,
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

}  // namespace

namespace {

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
__attribute__((target("avx512bf16"))) void dense_rows(const at::BFloat16* w, int64_t k, const at::BFloat16* x,
                                                     const float* bias, at::BFloat16* out, int64_t n, int64_t n0) {
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
      out[m * n + n0 + i] = static_cast<at::BFloat16>(y);  // round to nearest even
    }
}

template <int M>
void dense_m(const at::BFloat16* w, int64_t n, int64_t k, const at::BFloat16* x, const float* bias,
             at::BFloat16* out) {
  constexpr int R = M <= 2 ? 8 : 4;  // R x M accumulators, M x rows of x, one weight line
  const int64_t num_blocks = n / R;
  at::parallel_for(0, num_blocks + (n % R ? 1 : 0), 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (b < num_blocks) {
        dense_rows<M, R>(w, k, x, bias, out, n, b * R);
      } else {
        for (int64_t r = num_blocks * R; r < n; ++r) dense_rows<M, 1>(w, k, x, bias, out, n, r);
      }
    }
  });
}

// More than kDenseMaxRows rows (batch-invariant mode): each block of R weight rows meets the
// rows of x 8 at a time while it is in cache, and every output is computed exactly as at M <= 8.
void dense_tiled(const at::BFloat16* w, int64_t n, int64_t k, const at::BFloat16* x, int64_t m, const float* bias,
                 at::BFloat16* out) {
  constexpr int R = 4, MT = 6;  // 4 x 6 accumulators, 6 x rows and a weight line fit the 32 registers
  // Every block of weight rows meets all the rows of x: x is taken in blocks of rows that stay
  // in L2 (each weight block then reads them from there), and the weights stream once per block.
  constexpr int64_t kXBlockBytes = 384 * 1024;
  const int64_t m_block = std::max<int64_t>(MT, kXBlockBytes / (2 * k) / MT * MT);
  const int64_t num_blocks = n / R;
  for (int64_t mb = 0; mb < m; mb += m_block) {
    const int64_t mb_end = std::min(m, mb + m_block);
    at::parallel_for(0, num_blocks + (n % R ? 1 : 0), 4, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t m0 = mb; m0 < mb_end; m0 += MT) {
          const at::BFloat16* xt = x + m0 * k;
          at::BFloat16* ot = out + m0 * n;
          const auto rows = [&](auto tag) {
            constexpr int T = decltype(tag)::value;
            if (b < num_blocks) {
              dense_rows<T, R>(w, k, xt, bias, ot, n, b * R);
            } else {
              for (int64_t r = num_blocks * R; r < n; ++r) dense_rows<T, 1>(w, k, xt, bias, ot, n, r);
            }
          };
          switch (std::min<int64_t>(MT, mb_end - m0)) {
            case 1: rows(std::integral_constant<int, 1>{}); break;
            case 2: rows(std::integral_constant<int, 2>{}); break;
            case 3: rows(std::integral_constant<int, 3>{}); break;
            case 4: rows(std::integral_constant<int, 4>{}); break;
            case 5: rows(std::integral_constant<int, 5>{}); break;
            default: rows(std::integral_constant<int, MT>{}); break;
          }
        }
    });
  }
}

}  // namespace

bool fastdraft::dense_bf16_supports(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias) {
  return cpu_has_avx512_bf16() && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
         x.dim() == 2 && w.dim() == 2 && x.size(0) >= 1 && x.size(1) % 32 == 0 &&
         w.size(1) == x.size(1) && w.is_contiguous() && !x.is_cuda() && !w.is_cuda() &&
         (!bias.defined() || (bias.scalar_type() == at::kBFloat16 && bias.numel() == w.size(0)));
}

bool fastdraft::dense_bf16_applies(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias) {
  return dense_bf16_supports(x, w, bias) && x.size(0) <= kDenseMaxRows;
}

torch::Tensor fastdraft::dense_bf16_linear(const torch::Tensor& x_in, const torch::Tensor& w,
                                           const torch::Tensor& bias) {
  TORCH_CHECK(dense_bf16_supports(x_in, w, bias), "dense_bf16_linear: x [M, K % 32 == 0], W [N, K] and bias "
                                                 "[N], all bf16, W contiguous, on a CPU with AVX512-BF16");
  const auto x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  torch::Tensor bias_f;
  if (bias.defined()) bias_f = bias.to(at::kFloat).contiguous();
  auto out = torch::empty({m, n}, x.options());
  const auto* wp = w.data_ptr<at::BFloat16>();
  const auto* xp = x.data_ptr<at::BFloat16>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* op = out.data_ptr<at::BFloat16>();
  switch (m) {
    case 1: dense_m<1>(wp, n, k, xp, bp, op); break;
    case 2: dense_m<2>(wp, n, k, xp, bp, op); break;
    case 3: dense_m<3>(wp, n, k, xp, bp, op); break;
    case 4: dense_m<4>(wp, n, k, xp, bp, op); break;
    case 5: dense_m<5>(wp, n, k, xp, bp, op); break;
    case 6: dense_m<6>(wp, n, k, xp, bp, op); break;
    case 7: dense_m<7>(wp, n, k, xp, bp, op); break;
    case 8: dense_m<8>(wp, n, k, xp, bp, op); break;
    default: dense_tiled(wp, n, k, xp, m, bp, op); break;
  }
  return out;
}

void fastdraft::check_woq_weight(const WoqWeight& w) {
  const torch::Tensor &packed = w.packed, &scales = w.scales, &zeros = w.zeros;
  const int64_t bits = w.bits, k_pad = w.k_pad, block = w.block, group = w.group;
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
  TORCH_CHECK(block == 16 || block == 32 || block == 64 || block == 128, "block must be 16, 32, 64 or 128");
  TORCH_CHECK(group % block == 0 && k_pad % group == 0, "group must be a multiple of block dividing k_pad");
  TORCH_CHECK(packed.dtype() == at::kByte && packed.is_contiguous() && packed.numel() == w.num_tiles() * w.tile_bytes(),
              "packed weight has the wrong dtype, layout or size");
  TORCH_CHECK(scales.dtype() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == w.num_tiles() * w.num_groups() * kTile,
              "scales have the wrong dtype, layout or size");
  TORCH_CHECK(!zeros.defined() || zeros.numel() == 0 ||
                  ((zeros.dtype() == at::kByte || zeros.dtype() == at::kHalf) && zeros.is_contiguous() &&
                   zeros.numel() == scales.numel()),
              "zeros have the wrong dtype, layout or size");
}

void fastdraft::size_activations(int64_t m, int64_t k_pad, int64_t block, int64_t group, Activations& a) {
  a.rows = m;
  a.k_pad = k_pad;
  a.block = block;
  a.group = group;
  a.num_blocks = k_pad / block;
  a.num_groups = k_pad / group;
  a.q.resize(m * k_pad);
  a.scale.resize(m * a.num_blocks);
  a.corr.resize(m * a.num_groups);
  a.qsum.resize(m * a.num_blocks);
}

void fastdraft::quantize_activation_columns(const torch::Tensor& x, int64_t c0, int64_t c1, Activations& a) {
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t blocks_per_group = a.group / a.block;
  const int64_t b0 = c0 / a.block, b1 = std::min(c1, a.k_pad) / a.block;
  for (int64_t r = 0; r < m; ++r) {
    if (x.scalar_type() == at::kFloat)
      quantize_row(x.data_ptr<float>() + r * k, k, a.block, blocks_per_group, a, r, b0, b1);
    else
      quantize_row(x.data_ptr<at::BFloat16>() + r * k, k, a.block, blocks_per_group, a, r, b0, b1);
  }
}

void fastdraft::quantize_activations(const torch::Tensor& x, int64_t k_pad, int64_t block, int64_t group,
                                     Activations& a) {
  const int64_t m = x.size(0), k = x.size(1);
  size_activations(m, k_pad, block, group, a);
  const int64_t blocks_per_group = group / block;
  auto run = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (x.scalar_type() == at::kFloat)
        quantize_row(x.data_ptr<float>() + r * k, k, block, blocks_per_group, a, r, 0, a.num_blocks);
      else
        quantize_row(x.data_ptr<at::BFloat16>() + r * k, k, block, blocks_per_group, a, r, 0, a.num_blocks);
    }
  };
  if (m >= 16) at::parallel_for(0, m, 4, run); else run(0, m);
}

fastdraft::WoqTilesArgs fastdraft::woq_tiles_args(const WoqWeight& w, const torch::Tensor& out, int64_t col0) {
  WoqTilesArgs args;
  args.packed = w.packed.data_ptr<uint8_t>();
  args.scales = w.scales.data_ptr<at::Half>();
  const Zeros z = zeros_of(w.zeros);
  args.zeros_u8 = z.u8;
  args.zeros_f16 = z.f16;
  args.zero_const = static_cast<float>(w.zero_const);
  args.bits = w.bits;
  args.out_features = w.out_features;
  args.ldo = out.size(1);
  args.is_float_out = out.scalar_type() == at::kFloat;
  args.out = args.is_float_out ? static_cast<void*>(out.data_ptr<float>() + col0)
                               : static_cast<void*>(out.data_ptr<at::BFloat16>() + col0);
  return args;
}

void fastdraft::woq_tiles(const WoqTilesArgs& args, const Activations& a, int64_t t0, int64_t t1) {
  const Zeros z{args.zeros_u8, args.zeros_f16};
  auto run = [&](auto* o) {
    if (args.bits == 4) {
      if (z.is_set()) gemm_tiles<4, true>(a, args.packed, args.scales, z, args.zero_const, args.out_features, o,
                                          args.ldo, t0, t1);
      else gemm_tiles<4, false>(a, args.packed, args.scales, z, args.zero_const, args.out_features, o, args.ldo,
                                t0, t1);
    } else if (args.bits == 6) {
      gemm_tiles<6, false>(a, args.packed, args.scales, z, args.zero_const, args.out_features, o, args.ldo, t0, t1);
    } else {
      gemm_tiles<8, false>(a, args.packed, args.scales, z, args.zero_const, args.out_features, o, args.ldo, t0, t1);
    }
  };
  if (args.is_float_out) run(static_cast<float*>(args.out));
  else run(static_cast<at::BFloat16*>(args.out));
}

// y [M, N] = x [M, K] @ W^T for a repacked INT4/INT6/INT8 weight; x is float32 or bfloat16.
torch::Tensor woq_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros,
                         int64_t bits, int64_t n, int64_t k_pad, int64_t block, int64_t group, double zero_const) {
  const fastdraft::WoqWeight w{packed, scales, zeros, bits, n, k_pad, block, group, zero_const};
  fastdraft::check_woq_weight(w);
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= k_pad, "x must be [M, K] with K <= k_pad");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  x = x.contiguous();
  const int64_t m = x.size(0);
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  Activations a;
  fastdraft::quantize_activations(x, k_pad, block, group, a);
  const fastdraft::WoqTilesArgs args = fastdraft::woq_tiles_args(w, out, 0);
  at::parallel_for(0, w.num_tiles(), 1, [&](int64_t t0, int64_t t1) { fastdraft::woq_tiles(args, a, t0, t1); });
  return out;
}

namespace {

// Row n of one tile, 16 chunks at a time, as 128 (INT4, INT6) or 64 (INT8) consecutive uint8 values.
template <typename T>
void dequant_tile(int64_t bits, const uint8_t* w, const at::Half* s, Zeros z, float zc, int64_t k,
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
        const float scale = static_cast<float>(s[g * kTile + r]);
        const float zero = z.is_set() ? z.at(g * kTile + r) : zc;
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(vals + p))));
        const __m512 wv = _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(zero)), _mm512_set1_ps(scale));
        store16(out + r * k + kk, wv, tail_mask(k - kk));
      }
    }
  }
}

}  // namespace

// The dense [N, K] weight (float32 or bfloat16) of a repacked INT4/INT6/INT8 weight: the large-M
// (prefill) path dequantizes once and runs a oneDNN GEMM (AMX-BF16 where the CPU has it).
torch::Tensor woq_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros, int64_t bits, int64_t n,
                             int64_t k, int64_t k_pad, int64_t block, int64_t group, double zero_const,
                             at::ScalarType dtype) {
  const fastdraft::WoqWeight weight{packed, scales, zeros, bits, n, k_pad, block, group, zero_const};
  fastdraft::check_woq_weight(weight);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  TORCH_CHECK(k <= k_pad, "k must be <= k_pad");
  auto out = torch::empty({n, k}, packed.options().dtype(dtype));
  const int64_t group_stride = weight.num_groups() * kTile;  // scales/zeros per tile
  const Zeros all_zeros = zeros_of(zeros);
  at::parallel_for(0, weight.num_tiles(), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rows = std::min<int64_t>(kTile, n - t * kTile);
      const uint8_t* w = weight.tile(t);
      const at::Half* s = scales.data_ptr<at::Half>() + t * group_stride;
      const Zeros z = all_zeros.offset(t * group_stride);
      if (dtype == at::kFloat)
        dequant_tile(bits, w, s, z, static_cast<float>(zero_const), k, k_pad, group, rows,
                     out.data_ptr<float>() + t * kTile * k);
      else
        dequant_tile(bits, w, s, z, static_cast<float>(zero_const), k, k_pad, group, rows,
                     out.data_ptr<at::BFloat16>() + t * kTile * k);
    }
  });
  return out;
}

// fused_x86.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
// attention_x86.cpp
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_blocks, torch::Tensor v_blocks, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor context_lens, double scale);
// decoder_x86.cpp
void bind_decoder(pybind11::module& m);
// sampling_x86.cpp
void bind_sampling(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a [M, 2N] = [gate | up] tensor");
  m.def("paged_attention", &paged_attention, "attention of a flat batch of sequences over a paged KV pool",
        py::arg("q"), py::arg("k_blocks"), py::arg("v_blocks"), py::arg("block_tables"), py::arg("query_start_loc"),
        py::arg("context_lens"), py::arg("scale"));
  m.def("rotary", &rotary, "rotary embedding (rotate-half convention) of [T, heads * head_dim] rows");
  m.def("dense_bf16_applies", [](torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    return fastdraft::dense_bf16_applies(x, w, bias ? *bias : torch::Tensor());
  }, "whether dense_bf16_linear takes these x, W and bias", py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none());
  m.def("dense_bf16_supports", [](torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    return fastdraft::dense_bf16_supports(x, w, bias ? *bias : torch::Tensor());
  }, "whether dense_bf16_linear takes these x, W and bias at any row count", py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none());
  m.def("dense_bf16_linear", [](torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    return fastdraft::dense_bf16_linear(x, w, bias ? *bias : torch::Tensor());
  }, "x [M, K] W^T (+ bias), dense bf16, AVX512-BF16 dot products, row-invariant at every M",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("woq_linear", &woq_linear, "INT4/INT6/INT8 weight-only linear (AVX-512 VNNI)");
  m.def("woq_dequantize", &woq_dequantize, "dense weight of a repacked INT4/INT6/INT8 weight");
  bind_decoder(m);
  bind_sampling(m);
}
