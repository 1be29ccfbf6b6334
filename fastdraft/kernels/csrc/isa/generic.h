// Every kernel of the KernelTable (kernel_table.h) in plain, portable C++17: the `scalar`
// variant's kernels (isa/scalar.cpp), the oracle the SIMD variants are tested against, and the
// fallback those variants take for the kernels they do not specialize. No intrinsics, no
// threads; each function has the signature of its table field and the field's name.
//
// Rounding points are those of the AVX-512 kernels these were split from, so that most
// kernels give those kernels' bits:
// * Where that code fuses a multiply and an add (an explicit fmadd, or GCC contracting a scalar
//   `c += a * b` under -mfma, which it does by default), std::fma does here; every other
//   product and sum is rounded on its own.
// * Long fp32/fp64 sums keep 16 lanes (element i in lane i % 16) reduced as
//   AVX-512's reduce-add does (reduce_add16); an AVX2 kernel gets the same order with two
//   8-lane accumulators.
// Bit-identical to the AVX-512 code: quantize_row, woq_tiles, woq_block_sums, dequant_tile,
// rms_norm_row, rms_norm_offset_row, add, scale_to_float, merge_splits, argmax, block_cdf, and rotary_row on bf16.
// Not: silu_mul, gelu_tanh_mul and attend_split use std::exp, not the AVX-512 code's polynomial, and the
// attention's dot products and sums run in key order. NaN and infinite inputs are not mirrored.
// The plain `a * b + c` expressions here must stay two roundings: a variant built with an FMA
// unit enabled includes this file under -ffp-contract=off, or GCC fuses them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "half.h"
#include "kernel_table.h"

namespace fastdraft::generic {

// Output rows per weight tile of the layout x86.py::repack writes (the scalar variant's
// tile_rows). The woq kernels take the tile height as a template argument (kRows), for a
// variant whose tiles have another height: chunks of kRows rows x 4 bytes (INT4, INT8), and
// INT6's high-bit bytes cover nibble bytes i and i + 2 * kRows.
constexpr int kTileRows = 16;
// Activation rows sharing one pass over a weight tile (accumulators on the stack).
constexpr int kMaxRows = 8;

// ---- element types ---------------------------------------------------------------------------
// Loads widen to fp32; stores round fp32 to the element type (bf16: nearest even); round() is
// the value a store then a load gives, as a PyTorch op producing a tensor of that type rounds.
struct F32 {
  static float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  static void store(void* p, int64_t i, float v) { static_cast<float*>(p)[i] = v; }
  static float round(float v) { return v; }
  static constexpr int64_t kBytes = 4;
};
struct BF16 {
  static float load(const void* p, int64_t i) { return half::bf16_to_float(static_cast<const uint16_t*>(p)[i]); }
  static void store(void* p, int64_t i, float v) { static_cast<uint16_t*>(p)[i] = half::float_to_bf16(v); }
  static float round(float v) { return half::round_bf16(v); }
  static constexpr int64_t kBytes = 2;
};

// fn(F32{}) or fn(BF16{}) for an ElementType.
template <typename Fn>
inline void with_type(int32_t type, Fn&& fn) {
  if (type == kElemBFloat16) fn(BF16{});
  else fn(F32{});
}

// Sum of 16 lanes in AVX-512's reduce-add order: halves, then quarters, then pairs.
template <typename F>
inline F reduce_add16(const F (&lanes)[16]) {
  F h8[8], h4[4];
  for (int i = 0; i < 8; ++i) h8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) h4[i] = h8[i] + h8[i + 4];
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// x to int32 as cvtps2dq does under the default rounding mode: nearest, ties to even; NaN and
// values out of range give INT32_MIN (the "integer indefinite").
inline int32_t round_to_int32(float x) {
  if (!(x >= -2147483648.0f && x < 2147483648.0f)) return std::numeric_limits<int32_t>::min();
  return static_cast<int32_t>(std::lrint(x));
}

// int64 to int32 modulo 2^32, as the vector code's int32 adds wrap.
inline int32_t wrap_int32(int64_t v) { return static_cast<int32_t>(static_cast<uint32_t>(v)); }

// ---- weight-only matmul ----------------------------------------------------------------------

// Blocks [b0, b1) of activation row m (see Activations8): q = round-half-even(x * (1 / d)),
// d = absmax / 127, saturated to int8 as vpmovsdb does; qsum is taken before saturating, as
// the AVX-512 code sums its int32 lanes. x_row [k] fp32 or bf16; columns k..k_pad-1 are 0.
inline void quantize_row(int32_t type, const void* x_row, int64_t k, const Activations8* a, int64_t m, int64_t b0,
                         int64_t b1) {
  with_type(type, [&](auto e) {
    using E = decltype(e);
    const int64_t block = a->block, blocks_per_group = a->group / a->block;
    int8_t* q = a->q + m * a->k_pad;
    float* scale = a->scale + m * a->num_blocks;
    int32_t* qsum = a->qsum + m * a->num_blocks;
    float* corr = a->corr + m * a->num_groups;
    auto x = [&](int64_t i) { return i < k ? E::load(x_row, i) : 0.0f; };
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t k0 = b * block;
      float amax = 0.0f;  // exact: any order gives the same max
      for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(x(k0 + i)));
      const float d = amax / 127.0f;
      const float inv = d > 0.0f ? 1.0f / d : 0.0f;
      int64_t sum = 0;
      for (int64_t i = 0; i < block; ++i) {
        const int32_t qi = round_to_int32(x(k0 + i) * inv);
        sum += qi;
        q[k0 + i] = static_cast<int8_t>(std::clamp<int32_t>(qi, -128, 127));
      }
      scale[b] = d;
      qsum[b] = wrap_int32(sum);
      const int64_t g = b / blocks_per_group;
      if (b % blocks_per_group == 0) corr[g] = 0.0f;
      corr[g] = std::fma(d, static_cast<float>(qsum[b]), corr[g]);  // fused, as the AVX-512 build does
    }
  });
}

// Codes (0 .. 2^bits - 1) of chunk c of a kRows-row tile: codes[n][j] is row n's code for input
// channel 8c + j (INT4, INT6) or 4c + j (INT8). Layout (x86.py::repack): 4 bytes per row per
// chunk, byte j of row n at 4n + j. INT4: low nibble k = 8c + j, high nibble k = 8c + 4 + j.
// INT8: the byte is the code of k = 4c + j. INT6: those nibble bytes as INT4 (4 * kRows bytes),
// then 2 * kRows bytes of bits 4-5: nibble byte p's 4-bit field is the low nibble of high byte p
// (p < 2 * kRows) or the high nibble of high byte p - 2 * kRows; the field's bits 0-1 are bits 4-5
// of the low-nibble code, bits 2-3 those of the high-nibble code.
template <int kRows>
inline void decode_chunk(const uint8_t* tile, int64_t bits, int64_t c, uint8_t (&codes)[kRows][8]) {
  if (bits == 8) {
    const uint8_t* p = tile + c * 4 * kRows;
    for (int n = 0; n < kRows; ++n)
      for (int j = 0; j < 4; ++j) codes[n][j] = p[4 * n + j];
    return;
  }
  const uint8_t* p = tile + c * (bits == 6 ? 6 : 4) * kRows;
  for (int n = 0; n < kRows; ++n)
    for (int j = 0; j < 4; ++j) {
      const int nib = 4 * n + j;
      uint8_t lo = p[nib] & 15, hi = p[nib] >> 4;
      if (bits == 6) {
        const int field = (p[4 * kRows + nib % (2 * kRows)] >> (nib < 2 * kRows ? 0 : 4)) & 15;
        lo = static_cast<uint8_t>(lo | (field & 3) << 4);
        hi = static_cast<uint8_t>(hi | (field >> 2) << 4);
      }
      codes[n][j] = lo;
      codes[n][4 + j] = hi;
    }
}

// Exact int32 sums of block b against activation rows m0 .. m0 + mr - 1 (mr <= kMaxRows):
// dot[r][n] = sum over the block of (code - zero_const) * q with a constant zero point (taken,
// as the AVX-512 code does, as sum(code * q) - zero_const * qsum_b), or of code * q with
// per-group zero points. tile: the tile's packed bytes; kChunkK: channels per chunk (8 for
// INT4/INT6, 4 for INT8), a constant so that the inner loop unrolls.
template <int kRows, int kChunkK>
inline void block_dots_of(const WoqView& w, const Activations8& a, const uint8_t* tile, int64_t b, int64_t m0,
                          int64_t mr, int32_t (&dot)[kMaxRows][kRows]) {
  const bool has_zeros = w.zeros_u8 || w.zeros_f16;
  const int64_t zero = static_cast<int64_t>(w.zero_const);  // an integer where it is used
  int64_t sum[kMaxRows][kRows];
  for (int64_t r = 0; r < mr; ++r)
    for (int n = 0; n < kRows; ++n) sum[r][n] = has_zeros ? 0 : -zero * a.qsum[(m0 + r) * a.num_blocks + b];
  uint8_t codes[kRows][8];
  for (int64_t k0 = b * a.block; k0 < (b + 1) * a.block; k0 += kChunkK) {
    decode_chunk<kRows>(tile, w.bits, k0 / kChunkK, codes);
    for (int64_t r = 0; r < mr; ++r) {
      const int8_t* xq = a.q + (m0 + r) * a.k_pad + k0;
      for (int n = 0; n < kRows; ++n) {
        int32_t s = 0;  // <= 8 * 255 * 128
        for (int j = 0; j < kChunkK; ++j) s += codes[n][j] * xq[j];
        sum[r][n] += s;
      }
    }
  }
  for (int64_t r = 0; r < mr; ++r)
    for (int n = 0; n < kRows; ++n) dot[r][n] = wrap_int32(sum[r][n]);
}

template <int kRows>
inline void block_dots(const WoqView& w, const Activations8& a, const uint8_t* tile, int64_t b, int64_t m0,
                       int64_t mr, int32_t (&dot)[kMaxRows][kRows]) {
  if (w.bits == 8) block_dots_of<kRows, 4>(w, a, tile, b, m0, mr, dot);
  else block_dots_of<kRows, 8>(w, a, tile, b, m0, mr, dot);
}

// Zero point of scale index i (per-group zeros), as float.
inline float zero_at(const WoqView& w, int64_t i) {
  return w.zeros_f16 ? half::fp16_to_float(w.zeros_f16[i]) : static_cast<float>(w.zeros_u8[i]);
}

// Output tiles [t0, t1) of out = x W^T for every activation row. Per output (m, n), in this
// order: gacc = fma(dot_b, d_b, gacc) over the group's blocks from 0; acc = fma(s, gacc, acc);
// with per-group zeros then acc = fma(-(s * z), corr_g, acc). Written as fp32 or bf16.
template <int kRows = kTileRows>
inline void woq_tiles(const WoqView* w, const Activations8* a, int64_t t0, int64_t t1) {
  const bool has_zeros = w->zeros_u8 || w->zeros_f16;
  const int64_t blocks_per_group = a->group / a->block;
  const int64_t tile_bytes = w->k_pad * w->bits / 8 * kRows;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w->packed + t * tile_bytes;
    const int64_t sz0 = t * a->num_groups * kRows;  // the tile's first scale/zero: [num_groups, kRows]
    const int64_t rows_out = std::min<int64_t>(kRows, w->out_features - t * kRows);
    for (int64_t m0 = 0; m0 < a->rows; m0 += kMaxRows) {
      const int64_t mr = std::min<int64_t>(kMaxRows, a->rows - m0);
      float acc[kMaxRows][kRows] = {};
      for (int64_t g = 0; g < a->num_groups; ++g) {
        float gacc[kMaxRows][kRows] = {};
        for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
          int32_t dot[kMaxRows][kRows];
          block_dots<kRows>(*w, *a, tile, b, m0, mr, dot);
          for (int64_t r = 0; r < mr; ++r) {
            const float d = a->scale[(m0 + r) * a->num_blocks + b];
            for (int n = 0; n < kRows; ++n) gacc[r][n] = std::fma(static_cast<float>(dot[r][n]), d, gacc[r][n]);
          }
        }
        for (int n = 0; n < kRows; ++n) {
          const int64_t i = sz0 + g * kRows + n;
          const float s = half::fp16_to_float(w->scales[i]);
          const float zs = has_zeros ? s * zero_at(*w, i) : 0.0f;
          for (int64_t r = 0; r < mr; ++r) {
            acc[r][n] = std::fma(s, gacc[r][n], acc[r][n]);
            if (has_zeros) acc[r][n] = std::fma(-zs, a->corr[(m0 + r) * a->num_groups + g], acc[r][n]);
          }
        }
      }
      with_type(w->out_type, [&](auto e) {
        using E = decltype(e);
        for (int64_t r = 0; r < mr; ++r)
          for (int64_t n = 0; n < rows_out; ++n) E::store(w->out, (m0 + r) * w->ldo + t * kRows + n, acc[r][n]);
      });
    }
  }
}

// Tile t's exact block sums (block_dots) into sums [rows, num_blocks, kRows], padding rows
// included.
template <int kRows = kTileRows>
inline void woq_block_sums(const WoqView* w, const Activations8* a, int64_t t, int32_t* sums) {
  const uint8_t* tile = w->packed + t * (w->k_pad * w->bits / 8 * kRows);
  for (int64_t m0 = 0; m0 < a->rows; m0 += kMaxRows) {
    const int64_t mr = std::min<int64_t>(kMaxRows, a->rows - m0);
    for (int64_t b = 0; b < a->num_blocks; ++b) {
      int32_t dot[kMaxRows][kRows];
      block_dots<kRows>(*w, *a, tile, b, m0, mr, dot);
      for (int64_t r = 0; r < mr; ++r)
        for (int n = 0; n < kRows; ++n) sums[((m0 + r) * a->num_blocks + b) * kRows + n] = dot[r][n];
    }
  }
}

// Tile t's rows as (code - zero) * scale (one fp32 subtraction and product) into out
// [min(kRows, out_features - t * kRows), k] of `type`: zero is the row's per-group zero point
// or zero_const.
template <int kRows = kTileRows>
inline void dequant_tile(const WoqView* w, int64_t t, int64_t k, int32_t type, void* out) {
  const uint8_t* tile = w->packed + t * (w->k_pad * w->bits / 8 * kRows);
  const int64_t num_groups = w->k_pad / w->group, sz0 = t * num_groups * kRows;
  const int64_t rows = std::min<int64_t>(kRows, w->out_features - t * kRows);
  const int64_t chunk_k = w->bits == 8 ? 4 : 8;
  const bool has_zeros = w->zeros_u8 || w->zeros_f16;
  with_type(type, [&](auto e) {
    using E = decltype(e);
    uint8_t codes[kRows][8];
    for (int64_t k0 = 0; k0 < k; k0 += chunk_k) {
      decode_chunk<kRows>(tile, w->bits, k0 / chunk_k, codes);
      const int64_t i = sz0 + k0 / w->group * kRows;  // scale index of row 0 (chunks never straddle groups)
      for (int64_t n = 0; n < rows; ++n) {
        const float s = half::fp16_to_float(w->scales[i + n]);
        const float z = has_zeros ? zero_at(*w, i + n) : w->zero_const;
        for (int64_t j = 0; j < chunk_k && k0 + j < k; ++j)
          E::store(out, n * k + k0 + j, (static_cast<float>(codes[n][j]) - z) * s);
      }
    }
  });
}

// ---- elementwise -----------------------------------------------------------------------------

// Columns [c0, c1) of one row of RMSNorm over s = round(a + b) (b null: s = a):
// out = round(w * round(s * inv)), inv = 1 / sqrt(sum(s^2) / h + eps) over all h columns (16
// fused lanes, reduce_add16); or with is_offset (w1 fp32) out = round(w1 * (s * inv)), one
// rounding; sum[c0:c1] = s where sum is not null. Every column's value is read before it is
// written, so out may alias a or b.
inline void rms_norm_row_kind(int32_t type, const void* a, const void* b, const void* weight, bool is_offset,
                              void* sum, void* out, int64_t h, float eps, int64_t c0, int64_t c1) {
  with_type(type, [&](auto e) {
    using E = decltype(e);
    auto value = [&](int64_t i) { return b ? E::round(E::load(a, i) + E::load(b, i)) : E::load(a, i); };
    float lanes[16] = {};
    for (int64_t i = 0; i < h; ++i) {
      const float v = value(i);
      lanes[i % 16] = std::fma(v, v, lanes[i % 16]);
    }
    const float inv = 1.0f / std::sqrt(reduce_add16(lanes) / static_cast<float>(h) + eps);
    for (int64_t i = c0; i < c1; ++i) {
      const float v = value(i);
      if (sum) E::store(sum, i, v);
      if (is_offset) E::store(out, i, static_cast<const float*>(weight)[i] * (v * inv));
      else E::store(out, i, E::load(weight, i) * E::round(v * inv));
    }
  });
}

inline void rms_norm_row(int32_t type, const void* a, const void* b, const void* weight, void* sum, void* out,
                         int64_t h, float eps, int64_t c0, int64_t c1) {
  rms_norm_row_kind(type, a, b, weight, false, sum, out, h, eps, c0, c1);
}

// The offset kind of rms_norm_row (Gemma's): out = round(w1 * (s * inv)) in fp32, w1 fp32.
inline void rms_norm_offset_row(int32_t type, const void* a, const void* b, const float* w1, void* sum, void* out,
                                int64_t h, float eps, int64_t c0, int64_t c1) {
  rms_norm_row_kind(type, a, b, w1, true, sum, out, h, eps, c0, c1);
}

// out = round(round(gelu_tanh(gate)) * up), n values; gelu_tanh(g) = g / (1 + exp(-2u)) with
// u = sqrt(2 / pi) (g + 0.044715 g^3), each product rounded on its own.
inline void gelu_tanh_mul(int32_t type, const void* gate, const void* up, void* out, int64_t n) {
  with_type(type, [&](auto e) {
    using E = decltype(e);
    for (int64_t i = 0; i < n; ++i) {
      const float g = E::load(gate, i);
      const float cube = (g * g) * g;
      const float u2 = -1.5957691216057308f * (g + 0.044715f * cube);  // -2u
      const float s = E::round(g / (1.0f + std::exp(u2)));
      E::store(out, i, s * E::load(up, i));
    }
  });
}

// out = round(round(silu(gate)) * up), n values; silu(g) = g / (1 + exp(-g)).
inline void silu_mul(int32_t type, const void* gate, const void* up, void* out, int64_t n) {
  with_type(type, [&](auto e) {
    using E = decltype(e);
    for (int64_t i = 0; i < n; ++i) {
      const float g = E::load(gate, i);
      const float s = E::round(g / (1.0f + std::exp(-g)));
      E::store(out, i, s * E::load(up, i));
    }
  });
}

// heads x head_dim values, cos/sin [head_dim] shared by the heads. With x1, x2 the halves of a
// head: out1 = round(round(x1 * c1) + round((0 - x2) * s1)), out2 = round(round(x2 * c2) +
// round(x1 * s2)). (0 - x2), not -x2, as the AVX-512 code negates: the same signed zeros.
inline void rotary_row(int32_t type, const void* x, const void* cos, const void* sin, void* out, int64_t heads,
                       int64_t head_dim) {
  with_type(type, [&](auto e) {
    using E = decltype(e);
    const int64_t half = head_dim / 2;
    for (int64_t hd = 0; hd < heads; ++hd) {
      const int64_t o = hd * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = E::load(x, o + i), x2 = E::load(x, o + half + i);
        const float c1 = E::load(cos, i), c2 = E::load(cos, half + i);
        const float s1 = E::load(sin, i), s2 = E::load(sin, half + i);
        const float a1 = E::round(x1 * c1), b1 = E::round((0.0f - x2) * s1);
        const float a2 = E::round(x2 * c2), b2 = E::round(x1 * s2);
        E::store(out, o + i, a1 + b1);
        E::store(out, o + half + i, a2 + b2);
      }
    }
  });
}

// out = round(a + b), n values (out may alias a or b).
inline void add(int32_t type, const void* a, const void* b, void* out, int64_t n) {
  with_type(type, [&](auto e) {
    using E = decltype(e);
    for (int64_t i = 0; i < n; ++i) E::store(out, i, E::load(a, i) + E::load(b, i));
  });
}

// out = float(x) * scale, n values.
inline void scale_to_float(int32_t type, const void* x, float scale, float* out, int64_t n) {
  with_type(type, [&](auto e) {
    using E = decltype(e);
    for (int64_t i = 0; i < n; ++i) out[i] = E::load(x, i) * scale;
  });
}

// ---- paged attention -------------------------------------------------------------------------

// No bf16 dot products here: attend_split always gets fp32 queries (qf).
inline int32_t has_bf16_dot() { return 0; }

// One split, fp32 math (args->qf, already scaled; q_bf16 and scale are not used). For query
// row r and its keys l < num_keys[r] of the split: score_l = q . key(l0 + l) (fp32, in
// dimension order), m = max score, e_l = exp(score_l - m); max_out = m, sum_out = sum of e_l,
// acc_out [head_dim] = sum of e_l * value(l0 + l), both in key order. A row with no keys gets
// -inf, 0 and zeros.
inline void attend_split(const AttendArgs* args) {
  with_type(args->type, [&](auto e) {
    using E = decltype(e);
    const int64_t d = args->head_dim, n = args->l1 - args->l0;
    const int64_t mask = (int64_t{1} << args->block_shift) - 1;
    // Key or value row l of the sequence in the paged pool: base + table[block] * stride + row * d.
    auto row_at = [&](const void* base, int64_t l) -> const void* {
      const int64_t offset = args->block_table[l >> args->block_shift] * args->block_stride + (l & mask) * d;
      return static_cast<const char*>(base) + offset * E::kBytes;
    };
    std::vector<float> scores(static_cast<size_t>(std::max<int64_t>(n, 0)));
    for (int64_t r = 0; r < args->rows; ++r) {
      const int64_t num_keys = args->num_keys[r];
      const float* q = args->qf + r * d;
      float* acc = args->acc_out + r * d;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < num_keys; ++l) {
        const void* key = row_at(args->k_base, args->l0 + l);
        float s = 0.0f;
        for (int64_t i = 0; i < d; ++i) s += q[i] * E::load(key, i);
        scores[l] = s;
        m = std::max(m, s);
      }
      float sum = 0.0f;
      std::fill(acc, acc + d, 0.0f);
      for (int64_t l = 0; l < num_keys; ++l) {
        const float p = std::exp(scores[l] - m);
        sum += p;
        const void* value = row_at(args->v_base, args->l0 + l);
        for (int64_t i = 0; i < d; ++i) acc[i] += p * E::load(value, i);
      }
      args->max_out[r] = m;
      args->sum_out[r] = sum;
    }
  });
}

// One query row's splits merged into out [head_dim] (type): m = max of the maxes; per split in
// order, w = exp(m_s - m), total = fma(w, sum_s, total), acc = fma(w, acc_s, acc); then
// out = round(acc * (1 / total)).
inline void merge_splits(int64_t num_splits, const float* maxes, const float* sums, const float* const* accs,
                         int64_t head_dim, int32_t type, void* out) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < num_splits; ++s) m = std::max(m, maxes[s]);
  std::vector<float> acc(static_cast<size_t>(head_dim), 0.0f);
  float total = 0.0f;
  for (int64_t s = 0; s < num_splits; ++s) {
    const float w = std::exp(maxes[s] - m);
    total = std::fma(w, sums[s], total);  // fused, as the AVX-512 build does
    for (int64_t i = 0; i < head_dim; ++i) acc[i] = std::fma(w, accs[s][i], acc[i]);
  }
  const float inv = 1.0f / total;
  with_type(type, [&](auto e) {
    using E = decltype(e);
    for (int64_t i = 0; i < head_dim; ++i) E::store(out, i, acc[i] * inv);
  });
}

// ---- sampling --------------------------------------------------------------------------------

// torch.argmax of one row: the first NaN if there is one, else the first largest value
// (-1 for an empty row).
inline int64_t argmax(const float* row, int64_t n) {
  if (n <= 0) return -1;
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(row[i])) return i;
    if (row[i] > row[best]) best = i;
  }
  return best;
}

// block_cdf[i] = float64 running sum of the row to the end of block i (blocks of `block`
// values); returns the total. Each block's sum: its whole 16-value steps in 16 fp64 lanes
// (reduce_add16), then the rest in order, as the AVX-512 code sums.
inline double block_cdf(const float* row, int64_t n, int64_t block, double* block_cdf) {
  double total = 0.0;
  for (int64_t b = 0; b * block < n; ++b) {
    const float* p = row + b * block;
    const int64_t len = std::min(block, n - b * block);
    double lanes[16] = {};
    int64_t j = 0;
    for (; j + 16 <= len; j += 16)
      for (int i = 0; i < 16; ++i) lanes[i] += p[j + i];
    double sum = reduce_add16(lanes);
    for (; j < len; ++j) sum += p[j];
    total += sum;
    block_cdf[b] = total;
  }
  return total;
}

}  // namespace fastdraft::generic
