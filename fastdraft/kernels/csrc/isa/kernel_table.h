// The seam between fastdraft's kernel driver and its instruction-set variants.
//
// The driver (csrc/*.cpp: work splitting, projections, the decoder step, the Python bindings)
// is built with no ISA flags. Each variant (isa/scalar.cpp, isa/avx2.cpp, isa/avx512_vnni.cpp)
// is its own small shared library, built with its own flags, that exports one function,
// fastdraft_kernel_table(), returning a table of its leaf kernels. The driver loads the variant
// the CPU runs (chosen by fastdraft/kernels/build.py) and calls its kernels only through the
// table, so no instruction of a variant the CPU lacks can run.
//
// Plain C types only: no torch headers on this side of the seam. bf16 and fp16 values travel
// as their uint16_t bits. Every kernel is single-threaded; the driver parallelizes. Where a
// comment below writes fma, the product and sum round once. Integer results are exact and the
// same in every variant; float results may differ in the last bits between variants.
#pragma once

#include <cstdint>

namespace fastdraft {

// Bumped whenever a struct or a function's meaning below changes: the driver refuses a
// variant library built against another version.
constexpr uint32_t kKernelTableVersion = 3;

// Element type of activations, caches and outputs.
enum ElementType : int32_t { kElemFloat32 = 0, kElemBFloat16 = 1 };

// Speed choices that depend on the CPU's microarchitecture rather than its instruction sets.
// The driver makes them (isa.cpp::cpu_tuning) and passes them with each call, so that no
// variant probes the CPU's vendor. They never change a result. Nonzero: true.
struct Tuning {
  int32_t woq_few_rows_prefetch;    // calls of up to the layer's kFewRows rows prefetch the weights
                                    //   into L2 and L1 (0: no software prefetch at all)
  int32_t woq_one_chain_many_rows;  // calls of 5 rows or more (woq_body.h::kOneChainMinRows) keep
                                    //   one accumulator chain per row
  int32_t attention_prefetch_l2;    // keys and values are prefetched into L2 (0: into L1)
};

// Activations of one weight-only matmul, quantized to int8 per block of `block` columns:
// d_b = absmax_b / 127 (fp32), q = round-half-even(x * (1 / d_b)) (0 where d_b == 0).
struct Activations8 {
  int8_t* q;       // [rows, k_pad]
  float* scale;    // [rows, num_blocks]: d_b
  float* corr;     // [rows, num_groups]: corr = fma(d_b, qsum_b, corr) over the group's blocks, in order
  int32_t* qsum;   // [rows, num_blocks]: sum of the block's q
  int64_t rows, k_pad, block, group, num_blocks, num_groups;
};

// A repacked INT4/INT6/INT8 weight in the variant's layout (fastdraft/kernels/x86.py::repack
// with this table's tile_rows), and the output it writes.
struct WoqView {
  const uint8_t* packed;      // [num_tiles, tile bytes]: tile bytes = k_pad * bits / 8 * tile_rows
  const uint16_t* scales;     // fp16 [num_tiles, num_groups, tile_rows]
  const uint8_t* zeros_u8;    // uint8 zero points, same shape as scales; or null
  const uint16_t* zeros_f16;  // fp16 (fractional) zero points; or null. Both null: zero_const
  float zero_const;           // the constant zero point: 8 (INT4), 32 (INT6), 128 (INT8)
  int64_t bits, out_features, k_pad, block, group;  // k_pad, block, group: as the activations'
  void* out;                  // output column 0 of this weight in an [rows, ldo] matrix
  int64_t ldo;
  int32_t out_type;           // ElementType of out
  Tuning tuning;              // the driver's, for this CPU
};

// One split of keys [l0, l1) of one (sequence, kv head) for `rows` query rows; row r sees only
// its first num_keys[r] keys of the split (0: none).
struct AttendArgs {
  int32_t type;               // ElementType of the keys and values (and of q_bf16)
  const float* qf;            // [rows, head_dim] fp32 queries, already scaled; null on the bf16-dot path
  const uint16_t* q_bf16;     // [rows, head_dim] bf16 queries, unscaled (bf16-dot path only)
  float scale;                // applied to the scores on the bf16-dot path
  const void* k_base;         // this layer's pool at this kv head: key row l lies at
  const void* v_base;         //   base + table[l >> block_shift] * block_stride + (l & (block_size - 1)) * head_dim
  const int64_t* block_table; // the sequence's block ids
  int64_t block_stride, block_shift, head_dim;  // block_stride in elements, block_size = 1 << block_shift
  int64_t rows, l0, l1;
  const int64_t* num_keys;    // [rows]
  float* max_out;             // [rows]: the row's largest score in the split
  float* sum_out;             // [rows]: sum of exp(score - max)
  float* acc_out;             // [rows, head_dim]: unnormalised sum of exp(score - max) * v
  Tuning tuning;              // the driver's, for this CPU
};

struct KernelTable {
  uint32_t version;  // kKernelTableVersion
  uint32_t size;     // sizeof(KernelTable)
  const char* name;  // "scalar", "avx2", "avx512_vnni"
  int64_t tile_rows; // output rows per weight tile of the repacked layout

  // ---- weight-only matmul --------------------------------------------------------------
  // Blocks [b0, b1) of activation row m from x_row [k] (k <= a.k_pad; columns past k are 0;
  // b0 starts a group). Every variant gives the same int8 values, scales and sums.
  void (*quantize_row)(int32_t type, const void* x_row, int64_t k, const Activations8* a, int64_t m, int64_t b0,
                       int64_t b1);
  // Output tiles [t0, t1) (tile_rows columns each, the last one cut at out_features) of
  // out = x W^T for every activation row:
  //   y[n] = sum_g s[n,g] * (sum_{b in g} d_b * dot_b[n]) - s[n,g] * z[n,g] * corr_g
  // where dot_b is the exact integer block sum (woq_block_sums); with a constant zero point
  // z * qsum_b is taken inside dot_b and no correction is left. Each output row's arithmetic
  // is the same whatever the number of rows in the call.
  void (*woq_tiles)(const WoqView* w, const Activations8* a, int64_t t0, int64_t t1);
  // Test entry: tile t's exact int32 block sums, sums [rows, num_blocks, tile_rows]:
  //   sum over the block of (code - zero_const) * q   (constant zero point), or
  //   sum over the block of code * q                  (per-group zero points).
  void (*woq_block_sums)(const WoqView* w, const Activations8* a, int64_t t, int32_t* sums);
  // Tile t's dequantized rows (code - zero) * scale into out [rows of the tile, k] (type).
  void (*dequant_tile)(const WoqView* w, int64_t t, int64_t k, int32_t type, void* out);

  // ---- elementwise (values rounded to the element type after each op, as PyTorch's ops are) --
  // out[c0:c1] = w * round(s * rsqrt(mean(s^2) + eps)) with s = round(a + b) (b null: s = a),
  // the mean over all h columns; sum[c0:c1] = s where sum is not null. out may alias a or b.
  void (*rms_norm_row)(int32_t type, const void* a, const void* b, const void* weight, void* sum, void* out,
                       int64_t h, float eps, int64_t c0, int64_t c1);
  // out = round(silu(gate)) * up, n values.
  void (*silu_mul)(int32_t type, const void* gate, const void* up, void* out, int64_t n);
  // heads x head_dim values: out = round(x * cos) + round(rotate_half(x) * sin) per head
  // (first half: x1 c1 - x2 s1; second half: x2 c2 + x1 s2).
  void (*rotary_row)(int32_t type, const void* x, const void* cos, const void* sin, void* out, int64_t heads,
                     int64_t head_dim);
  // out = round(a + b), n values (out may alias a).
  void (*add)(int32_t type, const void* a, const void* b, void* out, int64_t n);
  // out = float(x) * scale, n values (scale 1: an exact widening).
  void (*scale_to_float)(int32_t type, const void* x, float scale, float* out, int64_t n);

  // ---- paged attention -------------------------------------------------------------------
  // Whether attend_split takes bf16 queries (q_bf16) for bf16 caches with head_dim % 32 == 0.
  int32_t (*has_bf16_dot)(void);
  void (*attend_split)(const AttendArgs* args);
  // Merges one query row's per-split partial softmaxes into out [head_dim] (type):
  // out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) sum_s, m = max_s m_s.
  void (*merge_splits)(int64_t num_splits, const float* maxes, const float* sums, const float* const* accs,
                       int64_t head_dim, int32_t type, void* out);

  // ---- dense bf16 matmul (null unless has_bf16_dot) ---------------------------------------
  // out[m, r] = bf16(sum_k x[m, k] w[r, k] + bias[r]) for m < num_x_rows (<= 8), r in [r0, r1);
  // w [n, k], x [num_x_rows, k] with k % 32 == 0, bias fp32 or null, out [num_x_rows, n]. Each
  // output's arithmetic is the same whatever num_x_rows and [r0, r1).
  void (*dense_bf16_rows)(const uint16_t* w, int64_t k, const uint16_t* x, int64_t num_x_rows, const float* bias,
                          uint16_t* out, int64_t n, int64_t r0, int64_t r1);

  // ---- sampling ---------------------------------------------------------------------------
  // The index of the row's largest value as torch.argmax gives it: the first on ties, the
  // first NaN if there is one.
  int64_t (*argmax)(const float* row, int64_t n);
  // block_cdf[i] = running float64 sum of the row up to the end of block i (blocks of `block`
  // values); returns the total.
  double (*block_cdf)(const float* row, int64_t n, int64_t block, double* block_cdf);

  // ---- Gemma's elementwise ops -----------------------------------------------------------
  // rms_norm_row's offset kind: out[c0:c1] = round(w1 * (s * inv)) all in fp32, one rounding
  // at the end, w1 [h] fp32 (Gemma's 1 + weight); s, inv and sum as in rms_norm_row.
  void (*rms_norm_offset_row)(int32_t type, const void* a, const void* b, const float* w1, void* sum, void* out,
                              int64_t h, float eps, int64_t c0, int64_t c1);
  // out = round(round(gelu_tanh(gate)) * up), n values; gelu_tanh(g) = g / (1 + exp(-2u)),
  // u = sqrt(2 / pi) (g + 0.044715 g^3): the tanh form's value, 0.5 g (1 + tanh(u)).
  void (*gelu_tanh_mul)(int32_t type, const void* gate, const void* up, void* out, int64_t n);
};

}  // namespace fastdraft

// The one symbol a variant library exports.
extern "C" const fastdraft::KernelTable* fastdraft_kernel_table(void);
