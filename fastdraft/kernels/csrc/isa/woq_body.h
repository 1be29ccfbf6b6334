// Weight-only matmul kernels (INT4/INT6/INT8 weights x int8 activations), written once against
// the SIMD layer (simd_<isa>.h, included first) and compiled per variant. The contract is
// kernel_table.h's; the scalar oracle generic.h's.
//
// Layout: fastdraft/kernels/x86.py::repack with 16-row tiles: a 64-byte chunk holds 4 bytes
// for each of 16 output rows, kTileVecs vectors of an int32 lane per row. INT4: byte j of a
// row holds k = 8c + j (low nibble) and 8c + 4 + j (high nibble); INT8: k = 4c + j; INT6:
// 96-byte chunks, INT4's 64 nibble bytes then 32 bytes of bits 4-5 (byte i: those of nibble
// byte i in its low nibble, of byte i + 32 in its high nibble, each as lo's two bits then hi's).
//
// Integer block sums are exact, the oracle's int32 values. The layer's partial_add sums u8 x s8
// products into partial lanes (int32 with VNNI, int16 with vpmaddubsw): a unit of chunks small
// enough that no partial lane overflows is summed there, then widened into the block's int32
// sum. A constant zero point z joins each block's sum as (offset - z) * qsum_b (block_starts);
// per-group zero points are left to the float epilogue (corr_g). Float epilogue, per output
// row, fixed whatever the rows of the call (row-invariant):
//   per block  gacc = fma(float(dot_b), d_b, gacc)
//   per group  acc = fma(s, gacc, acc); asym: acc = fnmadd(s * z, corr_g, acc)
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "generic.h"
#include "half.h"
#include "kernel_table.h"

namespace {

using fastdraft::Activations8;
using fastdraft::WoqView;
using simd::BF16;
using simd::Vf;
using simd::Vi;

constexpr int kTile = 16;                         // output rows per tile
constexpr int kTileVecs = kTile / simd::kLanes;   // vectors per tile row of int32 lanes
constexpr int kVecBytes = 4 * simd::kLanes;
constexpr int kMaxRows = simd::kWoqMaxRows;       // activation rows sharing a pass over a tile
constexpr int kUnroll = 2;                        // chunks per step of the inner loop
// The layer's partial lanes are int32 (vpdpbusd): nothing overflows within a block, so a block
// is one unit, and chains, not widening, set the shape.
constexpr bool kInt32Partials = simd::kPartialLimit > 32767;
// Software prefetch of the weight stream, once per 64-byte line:
// * kL2: 32 KB ahead into L2. The hardware prefetcher alone leaves bandwidth unused on Intel,
//   so decode steps wait on memory.
// * kL2L1: kL2 plus 4 KB ahead into L1, for calls of up to simd::kFewRows rows, which consume
//   each line fastest and would otherwise wait on L2.
// * kNone for those few-row calls where the driver's tuning asks for no software prefetch
//   (Tuning::woq_few_rows_prefetch).
enum class Prefetch { kNone, kL2, kL2L1 };
constexpr int64_t kL2PrefetchBytes = 32768;
constexpr int64_t kL1PrefetchBytes = 4096;
// Many rows (prefill) are taken kRowBlock at a time through all the call's tiles: their
// activations stay in L2 while the weights stream, and each row's outputs are written in
// order (tiles outside, all rows inside would scatter the writes over an output that has
// outgrown L2).
constexpr int64_t kRowBlock = 32;
// Rows from which the driver's tuning may ask for one accumulator chain
// (Tuning::woq_one_chain_many_rows): the independent rows alone may cover vpdpbusd's latency.
constexpr int kOneChainMinRows = 5;

// ---- activation quantization -----------------------------------------------------------------
// Blocks [b0, b1) of row m, as Activations8 defines them; bit for bit the oracle's values (the
// same fp32 ops; amax and the integer sums are exact in any order).
template <typename T>
void quantize_row_of(const T* x, int64_t k, const Activations8& a, int64_t m, int64_t b0, int64_t b1) {
  constexpr int L = simd::kLanes;
  const int64_t block = a.block, bpg = a.group / a.block, vecs = block / L;
  int8_t* q = a.q + m * a.k_pad;
  Vf v[128 / L];  // block <= 128
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t k0 = b * block;
    Vf amax = simd::zero();
    for (int64_t i = 0; i < vecs; ++i) {
      v[i] = simd::load(x + k0 + L * i, k - k0 - L * i);
      amax = simd::max(amax, simd::abs(v[i]));
    }
    const float d = simd::hmax(amax) / 127.0f;
    const Vf inv = simd::set1(d > 0.0f ? 1.0f / d : 0.0f);
    Vi sum = simd::zero_i();
    for (int64_t i = 0; i < vecs; ++i) {
      const Vi qi = simd::to_int(simd::mul(v[i], inv));  // round half to even
      sum = simd::add_i32(sum, qi);
      simd::store_i8(q + k0 + L * i, qi);  // saturating
    }
    const int32_t s = simd::hsum_i32(sum);
    a.scale[m * a.num_blocks + b] = d;
    a.qsum[m * a.num_blocks + b] = s;
    float& corr = a.corr[m * a.num_groups + b / bpg];
    if (b % bpg == 0) corr = 0.0f;
    corr = std::fma(d, static_cast<float>(s), corr);
  }
}

// ---- tiles -----------------------------------------------------------------------------------
struct TileJob {            // one tile's work, resolved once per tile
  const uint8_t* w;         // the tile's packed bytes
  const uint16_t* scales;   // fp16 [num_groups, 16]
  const uint8_t* zu8;       // [num_groups, 16] or null
  const uint16_t* zf16;     // [num_groups, 16] or null
  const int32_t* starts;    // [rows, num_blocks]: each block's int32 sum starts there (constant zero point)
  int64_t bpg, num_groups;
  void* out;                // output (m, row n of the tile) at out + m * ldo + n
  int64_t ldo;
  int32_t out_type;
  int valid;                // output rows of the tile that exist
  int32_t* sums;            // woq_block_sums: [rows, num_blocks, 16], instead of out
  fastdraft::Tuning tuning;
};

template <int BITS> constexpr int64_t kChunkK = BITS == 8 ? 4 : 8;
template <int BITS> constexpr int64_t kChunkBytes = BITS == 6 ? 96 : 64;  // INT6: + 32 bytes of high bits

// Chunks summed in the partial lanes before widening: the most, a power of two up to CPB,
// whose products (codes to 2^BITS - 1, INT8's signed to 128, times activations to 127; two
// partial_adds per INT4/INT6 chunk, one per INT8) stay within the lanes. vpmaddubsw: INT4 4
// chunks, INT6 and INT8 1; vpdpbusd: the whole block.
template <int BITS, int CPB>
constexpr int unit_chunks() {
  const int64_t code_max = BITS == 8 ? 128 : (1 << BITS) - 1;
  const int64_t adds = simd::kPartialLimit / (simd::kProductsPerLane * code_max * 127);
  const int64_t chunks = adds / (BITS == 8 ? 1 : 2);
  int unit = 1;
  while (2 * unit <= chunks && 2 * unit <= CPB) unit *= 2;
  return unit;
}

// Independent accumulator chains per row hide vpdpbusd's latency when rows are few; with many
// rows the rows themselves are independent and registers are scarce. Two chains up to 6 rows
// (with one, a 5-row verification on AVX-512 still waits on that latency); at 7-8 rows they
// spill. vpmaddubsw partials add in one cycle: one chain. Integer sums are exact, so chains
// never change results.
// Chains never take more than the layer's accumulator registers (R x kTileVecs x chains).
template <int BITS, int R>
constexpr int default_chains() {
  if (!kInt32Partials) return 1;
  const int steps = (BITS == 8 ? 1 : 2) * kUnroll;  // partial_adds per row per step
  const int chains = R <= 2 ? steps : (R <= 6 ? 2 : 1);
  const int fit = simd::kAccumulatorRegs / (R * kTileVecs);
  return chains <= fit ? chains : (fit >= 2 ? 2 : 1);
}

// Tile rows [0, NH * kLanes) of one tile against R activation rows from m0, for blocks of CPB
// chunks, CH chains; PF: the weights' software prefetch. With j.sums set it stores the exact
// int32 block sums instead of the float epilogue (woq_block_sums), so the test entry runs this
// very code. Inlined or not as the layer says (FASTDRAFT_TILE_KERNEL_ATTR). The shape is all
// template arguments: with a compile-time chunk count the block
// loop runs without overhead, and a run-time branch inside it makes gcc copy accumulators
// between registers on every chunk.
template <int BITS, bool ASYM, int R, int NH, int CPB, int CH, Prefetch PF>
FASTDRAFT_TILE_KERNEL_ATTR void tile_kernel(const TileJob& j, const Activations8& a, int64_t m0) {
  constexpr int64_t chunk_k = kChunkK<BITS>, block = CPB * chunk_k;
  constexpr int UNIT = unit_chunks<BITS, CPB>(), STEP = std::min(UNIT, kUnroll);
  // INT4 with vpdpbusd and an even number of chains: the high nibbles go on the odd chains
  // in place, as 16 * hi (an AND instead of a shift and an AND), and those chains' sum is
  // shifted back by 4 once per block (exact: every product is a multiple of 16). The saved shift
  // shows on decode steps when the vector ops, not the memory stream, set the pace (Zen 4).
  constexpr bool kHighInPlace = BITS == 4 && CH % 2 == 0 && kInt32Partials;
  // With int32 partials the block's one unit folds straight into its sums: no second set of
  // registers (8 rows' partials and sums together spill on AVX-512).
  static_assert(!kInt32Partials || UNIT == CPB, "int32 partials: one unit per block");
  constexpr bool kTied = R <= 2;  // INT4/INT6 from 3 rows: the intrinsic (see simd_avx512.h)
  static_assert(NH <= kTileVecs && CPB % UNIT == 0 && UNIT % STEP == 0, "bad tile kernel shape");
  static_assert(CH == 1 || ((BITS == 8 ? 1 : 2) * STEP) % CH == 0, "chains must cycle within a step");
  const Vi nibble = simd::set1_i8(0x0f), high_nibble = simd::set1_i8(static_cast<int8_t>(0xf0));
  const Vi high_bits = simd::set1_i8(0x30);
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
  Vf acc[R][NH];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < NH; ++h) acc[r][h] = simd::zero();
  for (int64_t g = 0; g < j.num_groups; ++g) {
    Vf gacc[R][NH];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int h = 0; h < NH; ++h) gacc[r][h] = simd::zero();
    for (int64_t bb = 0; bb < j.bpg; ++bb) {
      const int64_t b = g * j.bpg + bb;
      const int8_t* xb[R];
      Vi dot[R][NH];  // the block's int32 sums; with int32 partials (one unit) the start goes in chain 0
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        xb[r] = xq[r] + b * block;
#pragma GCC unroll 2
        for (int h = 0; h < NH; ++h) dot[r][h] = ASYM || kInt32Partials ? simd::zero_i() : simd::set1_i32(xstart[r][b]);
      }
      for (int u0 = 0; u0 < CPB; u0 += UNIT) {
        Vi part[R][NH][CH];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
          for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
            for (int c = 0; c < CH; ++c)
              part[r][h][c] = !ASYM && kInt32Partials && c == 0 ? simd::set1_i32(xstart[r][b]) : simd::zero_i();
#pragma GCC unroll 4
        for (int c0 = 0; c0 < UNIT; c0 += STEP) {
#pragma GCC unroll 2
          for (int u = 0; u < STEP; ++u) {  // unrolled: the chains are compile-time indices
            if constexpr (PF != Prefetch::kNone) {
              simd::prefetch_l2(w + kL2PrefetchBytes);
              if constexpr (BITS == 6) simd::prefetch_l2(w + kL2PrefetchBytes + 64);  // 1.5 lines
            }
            if constexpr (PF == Prefetch::kL2L1) {
              simd::prefetch_l1(w + kL1PrefetchBytes);
              if constexpr (BITS == 6) simd::prefetch_l1(w + kL1PrefetchBytes + 64);
            }
            const int64_t k0 = (u0 + c0 + u) * chunk_k;
            if constexpr (BITS == 8) {
              simd::Codes8 codes[NH];
#pragma GCC unroll 2
              for (int h = 0; h < NH; ++h) codes[h] = simd::prepare_codes8(simd::load_i(w + kVecBytes * h));
#pragma GCC unroll 8
              for (int r = 0; r < R; ++r) {
                const Vi x = simd::broadcast4(xb[r] + k0);
#pragma GCC unroll 2
                for (int h = 0; h < NH; ++h) part[r][h][u % CH] = simd::partial_add8(part[r][h][u % CH], codes[h], x);
              }
            } else {
              Vi lo[NH], hi[NH];  // codes of k = 8c + j and 8c + 4 + j, a byte each
#pragma GCC unroll 2
              for (int h = 0; h < NH; ++h) {
                const Vi v = simd::load_i(w + kVecBytes * h);
                lo[h] = simd::and_i(v, nibble);
                hi[h] = kHighInPlace ? simd::and_i(v, high_nibble) : simd::and_i(simd::srl16<4>(v), nibble);
                if constexpr (BITS == 6) {  // bits 4-5 of the codes (16-bit shifts: the mask drops what crosses bytes)
                  const Vi hb = simd::int6_high(w + 64, h);
                  lo[h] = simd::or_and(lo[h], simd::sll16<4>(hb), high_bits);
                  hi[h] = simd::or_and(hi[h], simd::sll16<2>(hb), high_bits);
                }
              }
#pragma GCC unroll 8
              for (int r = 0; r < R; ++r) {
                const Vi x_lo = simd::broadcast4(xb[r] + k0), x_hi = simd::broadcast4(xb[r] + k0 + 4);
#pragma GCC unroll 2
                for (int h = 0; h < NH; ++h) {
                  Vi& p_lo = part[r][h][(2 * u) % CH];
                  p_lo = simd::partial_add<kTied>(p_lo, lo[h], x_lo);
                  Vi& p_hi = part[r][h][(2 * u + 1) % CH];
                  p_hi = simd::partial_add<kTied>(p_hi, hi[h], x_hi);
                }
              }
            }
            w += kChunkBytes<BITS>;  // after the INT6 branch, which reads its high bits at w + 64
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
          for (int h = 0; h < NH; ++h) {
            if constexpr (kHighInPlace) {
              Vi low = simd::partial_widen(part[r][h][0]), high = simd::partial_widen(part[r][h][1]);
              for (int c = 2; c < CH; c += 2) {
                low = simd::add_i32(low, simd::partial_widen(part[r][h][c]));
                high = simd::add_i32(high, simd::partial_widen(part[r][h][c + 1]));
              }
              dot[r][h] = simd::add_i32(low, simd::sra32<4>(high));  // int32 partials: the only unit
            } else {
              Vi t = simd::partial_widen(part[r][h][0]);
              for (int c = 1; c < CH; ++c) t = simd::add_i32(t, simd::partial_widen(part[r][h][c]));
              dot[r][h] = kInt32Partials ? t : simd::add_i32(dot[r][h], t);
            }
          }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if (is_sums) {
          int32_t* s = j.sums + ((m0 + r) * a.num_blocks + b) * kTile;
#pragma GCC unroll 2
          for (int h = 0; h < NH; ++h) simd::store_i(s + simd::kLanes * h, dot[r][h]);
        } else {
          const Vf d = simd::set1(xs[r][b]);
#pragma GCC unroll 2
          for (int h = 0; h < NH; ++h) gacc[r][h] = simd::fmadd(simd::to_float(dot[r][h]), d, gacc[r][h]);
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < NH; ++h) {
      const int64_t i = g * kTile + simd::kLanes * h;
      const Vf s = simd::load_fp16(j.scales + i);
      if constexpr (ASYM) {
        const Vf sz = simd::mul(s, j.zf16 ? simd::load_fp16(j.zf16 + i) : simd::load_u8(j.zu8 + i));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[r][h] = simd::fmadd(s, gacc[r][h], acc[r][h]);
          acc[r][h] = simd::fnmadd(sz, simd::set1(xc[r][g]), acc[r][h]);
        }
      } else {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][h] = simd::fmadd(s, gacc[r][h], acc[r][h]);
      }
    }
  }
  if (is_sums) return;
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < NH; ++h) {
      const int64_t n0 = simd::kLanes * h, count = j.valid - n0;
      if (j.out_type == fastdraft::kElemFloat32)
        simd::store(static_cast<float*>(j.out) + (m0 + r) * j.ldo + n0, acc[r][h], count);
      else
        simd::store(static_cast<BF16*>(j.out) + (m0 + r) * j.ldo + n0, acc[r][h], count);
    }
}

// Rows [m0, m0 + rows) of one tile, rows <= kMaxRows, with the prefetch and chains chosen for
// the row count and the driver's tuning. Every vector of the tile row in one pass, so the
// weights stream once, in order (a pass per vector would re-read the tile row from memory); a
// pass of fewer vectors for a last tile that needs fewer.
template <int BITS, bool ASYM, int CPB>
void tile_rows(const TileJob& j, const Activations8& a, int64_t m0, int rows) {
  const int num_vecs = j.sums ? kTileVecs : (j.valid + simd::kLanes - 1) / simd::kLanes;
  auto run = [&](auto r_tag) {
    constexpr int R = decltype(r_tag)::value;
    constexpr int CH = default_chains<BITS, R>();
    auto shaped = [&](auto nh_tag) {
      constexpr int NH = decltype(nh_tag)::value;
      if constexpr (R <= simd::kFewRows) {
        if (!j.tuning.woq_few_rows_prefetch) return tile_kernel<BITS, ASYM, R, NH, CPB, CH, Prefetch::kNone>(j, a, m0);
        return tile_kernel<BITS, ASYM, R, NH, CPB, CH, Prefetch::kL2L1>(j, a, m0);
      }
      if constexpr (R >= kOneChainMinRows && CH > 1) {
        if (j.tuning.woq_one_chain_many_rows) return tile_kernel<BITS, ASYM, R, NH, CPB, 1, Prefetch::kL2>(j, a, m0);
      }
      tile_kernel<BITS, ASYM, R, NH, CPB, CH, Prefetch::kL2>(j, a, m0);
    };
    if (kTileVecs == 1 || num_vecs == kTileVecs) shaped(std::integral_constant<int, kTileVecs>{});
    else shaped(std::integral_constant<int, 1>{});
  };
  // A switch, not with_count: this runs once per 16-row tile, where a jump table beats
  // with_count's chain of comparisons, enough to show on whole decode passes.
  switch (rows) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, std::min(2, kMaxRows)>{}); break;
    case 3: run(std::integral_constant<int, std::min(3, kMaxRows)>{}); break;
    case 4: run(std::integral_constant<int, std::min(4, kMaxRows)>{}); break;
    case 5: run(std::integral_constant<int, std::min(5, kMaxRows)>{}); break;
    case 6: run(std::integral_constant<int, std::min(6, kMaxRows)>{}); break;
    case 7: run(std::integral_constant<int, std::min(7, kMaxRows)>{}); break;
    default: run(std::integral_constant<int, kMaxRows>{}); break;
  }
}

// Every block's integer start, mul * qsum_b, for all rows: one multiply per row and block and
// call instead of one per row, block and tile. Per thread (the driver calls from many).
inline const int32_t* block_starts(const Activations8& a, int32_t mul) {
  static thread_local std::vector<int32_t> starts;
  const int64_t count = a.rows * a.num_blocks;
  if (static_cast<int64_t>(starts.size()) < count) starts.resize(count);
  for (int64_t i = 0; i < count; ++i) starts[i] = mul * a.qsum[i];
  return starts.data();
}

// Tiles [t0, t1) for every activation row (woq_block_sums: sums set, t1 = t0 + 1).
template <int BITS, bool ASYM, int CPB>
__attribute__((noinline)) void woq_tiles_of(const WoqView& wv, const Activations8& a, int64_t t0, int64_t t1,
                                            int32_t* sums) {
  const int64_t tile_bytes = wv.k_pad * BITS / 8 * kTile;
  const int64_t group_stride = a.num_groups * kTile;  // scales / zeros per tile
  TileJob j;
  j.bpg = a.group / a.block;
  j.num_groups = a.num_groups;
  const int32_t offset = BITS == 8 ? simd::kCode8Offset : 0;
  j.starts = ASYM ? nullptr : block_starts(a, offset - static_cast<int32_t>(wv.zero_const));
  j.ldo = wv.ldo;
  j.out_type = wv.out_type;
  j.sums = sums;
  j.tuning = wv.tuning;
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
        tile_rows<BITS, ASYM, CPB>(j, a, m0, static_cast<int>(std::min<int64_t>(kMaxRows, mb_end - m0)));
    }
  }
}

// By bit width, zero points and block size (16, 32, 64 or 128 columns). Per-group zero points
// come with INT4 only (asymmetric RTN, GGUF's Q4_K/Q4_1); any other such weight takes the
// scalar oracle's path.
inline void woq_dispatch(const WoqView* w, const Activations8* a, int64_t t0, int64_t t1, int32_t* sums) {
  const bool is_asym = w->zeros_u8 || w->zeros_f16;
  auto by_block = [&](auto bits_tag, auto asym_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
    constexpr bool ASYM = decltype(asym_tag)::value;
    constexpr int64_t ck = kChunkK<BITS>;
    switch (a->block) {
      case 16: return woq_tiles_of<BITS, ASYM, 16 / ck>(*w, *a, t0, t1, sums);
      case 32: return woq_tiles_of<BITS, ASYM, 32 / ck>(*w, *a, t0, t1, sums);
      case 64: return woq_tiles_of<BITS, ASYM, 64 / ck>(*w, *a, t0, t1, sums);
      default: return woq_tiles_of<BITS, ASYM, 128 / ck>(*w, *a, t0, t1, sums);
    }
  };
  using False = std::false_type;
  if (w->bits == 4 && is_asym) by_block(std::integral_constant<int, 4>{}, std::true_type{});
  else if (is_asym && sums) fastdraft::generic::woq_block_sums<kTile>(w, a, t0, sums);
  else if (is_asym) fastdraft::generic::woq_tiles<kTile>(w, a, t0, t1);
  else if (w->bits == 4) by_block(std::integral_constant<int, 4>{}, False{});
  else if (w->bits == 6) by_block(std::integral_constant<int, 6>{}, False{});
  else by_block(std::integral_constant<int, 8>{}, False{});
}

// ---- dequantization (the large-M path: once per weight per call) ------------------------------
// Tile t's rows as (code - zero) * scale into out [rows, k]: kLanes chunks of one row at a time,
// their dwords gathered and (INT4) split into nibbles in k order. INT6 takes the oracle's path.
template <typename T>
void dequant_tile_of(const WoqView& w, int64_t t, int64_t k, T* out) {
  constexpr int L = simd::kLanes;
  const int64_t num_groups = w.k_pad / w.group, chunk_k = w.bits == 8 ? 4 : 8;
  const int64_t rows = std::min<int64_t>(kTile, w.out_features - t * kTile);
  const auto* tile = reinterpret_cast<const int32_t*>(w.packed + t * (w.k_pad * w.bits / 8 * kTile));
  const int64_t group0 = t * num_groups * kTile;  // the tile's scales and zeros
  const Vi nibble = simd::set1_i8(0x0f);
  alignas(64) uint8_t codes[8 * L];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c0 = 0; c0 < w.k_pad / chunk_k; c0 += L) {  // k_pad % 128 == 0: whole steps
      const Vi v = simd::load_strided_i32(tile + c0 * kTile + r, kTile);  // row r's dword of L chunks
      if (w.bits == 4) {
        Vi first, second;
        simd::interleave_i32(simd::and_i(v, nibble), simd::and_i(simd::srl16<4>(v), nibble), first, second);
        simd::store_i(codes, first);
        simd::store_i(codes + 4 * L, second);
      } else {
        simd::store_i(codes, v);
      }
      for (int64_t p = 0; p < L * chunk_k; p += L) {
        const int64_t kk = c0 * chunk_k + p;
        if (kk >= k) break;
        const int64_t i = group0 + (kk / w.group) * kTile + r;  // groups hold >= 16 columns: one per step
        const float scale = fastdraft::half::fp16_to_float(w.scales[i]);
        const float zero = w.zeros_u8 || w.zeros_f16 ? fastdraft::generic::zero_at(w, i) : w.zero_const;
        const Vf q = simd::sub(simd::load_u8(codes + p), simd::set1(zero));
        simd::store(out + r * k + kk, simd::mul(q, simd::set1(scale)), k - kk);
      }
    }
  }
}

}  // namespace
