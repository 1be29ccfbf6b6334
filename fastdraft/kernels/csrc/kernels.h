// The driver's pieces that the fused decoder (decoder.cpp) drives from inside its own parallel
// region: each op is split into a serial setup, work that any thread may run on any sub-range,
// and (for attention) a finish. The public ops (woq_linear, paged_attention) are these pieces
// run under at::parallel_for. The driver is built with no ISA flags: every leaf kernel is
// called through the KernelTable of the variant in use (isa/kernel_table.h, isa.cpp).
// Last, the ops the Python module binds (bindings.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "isa/kernel_table.h"

namespace fastdraft {

// One loaded instruction-set variant (isa.cpp::load_isa): its kernel table, valid for the
// life of the process (variant libraries are never unloaded), and the tuning the driver passes
// with each call to it.
struct Isa {
  const KernelTable* table = nullptr;
  Tuning tuning{};
  std::string path;
};
using IsaPtr = std::shared_ptr<Isa>;

// The element type of a float32 or bfloat16 tensor, as the kernel table takes it.
inline int32_t elem_type(const torch::Tensor& x) {
  return x.scalar_type() == at::kFloat ? kElemFloat32 : kElemBFloat16;
}

// Activations of one weight-only matmul, quantized to int8 per block (woq.cpp).
struct Activations {
  std::vector<int8_t> q;     // [M, k_pad]
  std::vector<float> scale;  // [M, num_blocks]
  std::vector<float> corr;   // [M, num_groups]: sum over the group's blocks of d_b * sum(xq_b)
  std::vector<int32_t> qsum; // [M, num_blocks]: sum(xq_b)
  int64_t rows = 0, k_pad = 0, block = 0, group = 0, num_blocks = 0, num_groups = 0;

  bool matches(int64_t k_pad_, int64_t block_, int64_t group_) const {
    return k_pad == k_pad_ && block == block_ && group == group_;
  }
  Activations8 view() const {
    return Activations8{const_cast<int8_t*>(q.data()), const_cast<float*>(scale.data()),
                        const_cast<float*>(corr.data()), const_cast<int32_t*>(qsum.data()),
                        rows, k_pad, block, group, num_blocks, num_groups};
  }
};

// One repacked INT4/INT6/INT8 weight in its variant's layout (fastdraft/kernels/x86.py::repack
// with the variant's tile_rows), and the variant whose kernels run it.
struct WoqWeight {
  torch::Tensor packed, scales, zeros;  // zeros undefined or empty: constant zero point
  int64_t bits = 0, out_features = 0, k_pad = 0, block = 0, group = 0;
  double zero_const = 0.0;
  IsaPtr isa;

  int64_t tile_rows() const { return isa->table->tile_rows; }
  int64_t num_tiles() const { return (out_features + tile_rows() - 1) / tile_rows(); }
  int64_t num_groups() const { return k_pad / group; }
  int64_t tile_bytes() const { return k_pad * bits / 8 * tile_rows(); }
  const uint8_t* tile(int64_t t) const { return packed.data_ptr<uint8_t>() + t * tile_bytes(); }
};

// Dense bf16 weights (woq.cpp), where the variant has the kernel: whether it takes x [M, K],
// W [N, K] and bias (may be undefined) at any M (supports) and at the few rows where it is the
// fastest kernel (applies); and x W^T (+ bias, added in fp32) as bf16 [M, N], each row computed
// the same way whatever M.
bool dense_bf16_supports(const Isa& isa, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias);
bool dense_bf16_applies(const Isa& isa, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias);
torch::Tensor dense_bf16_linear(const Isa& isa, const torch::Tensor& x, const torch::Tensor& w,
                                const torch::Tensor& bias);

// TORCH_CHECKs the weight's dtypes, layout and sizes.
void check_woq_weight(const WoqWeight& w);
// x [M, K <= k_pad] (float32 or bfloat16, contiguous) -> a.
void quantize_activations(const Isa& isa, const torch::Tensor& x, int64_t k_pad, int64_t block, int64_t group,
                          Activations& a);
// The same in pieces, for threads that each quantize their own columns: size a for M rows,
// then fill columns [c0, c1) of x (multiples of the group; c1 may be k_pad, past K).
void size_activations(int64_t m, int64_t k_pad, int64_t block, int64_t group, Activations& a);
void quantize_activation_columns(const Isa& isa, const torch::Tensor& x, int64_t c0, int64_t c1, Activations& a);
// A weight and the output columns it writes, as the kernel table takes them, resolved once
// (woq_tiles_args): resolving them from the tensors on every claimed chunk would repeat the
// same tensor lookups many times a step.
struct WoqTilesArgs {
  WoqView view{};
  const KernelTable* table = nullptr;
};
// w writing out [M, ldo] (x's dtype) from column col0 on.
WoqTilesArgs woq_tiles_args(const WoqWeight& w, const torch::Tensor& out, int64_t col0);
// Output tiles [t0, t1) (tile_rows columns each) of y = x W^T. Every tile's arithmetic is the
// same whichever thread runs it.
void woq_tiles(const WoqTilesArgs& args, const Activations& a, int64_t t0, int64_t t1);

// x[:, col0 + b0 : col0 + b1] += bias[b0 : b1] in place (b1 < 0: to the end), rounded to
// x's dtype as torch's add is.
void add_bias(const Isa& isa, const torch::Tensor& x, int64_t col0, const torch::Tensor& bias, int64_t b0 = 0,
              int64_t b1 = -1);

// An RMSNorm's weight and kind: weight [h] in the activations' dtype (Llama's w * x̂), or with
// is_offset, fp32 1 + w (Gemma's x̂ (1 + w), in fp32 with one rounding). Undefined: no norm.
struct NormWeight {
  torch::Tensor weight;
  bool is_offset = false;
  double eps = 1e-6;
  bool defined() const { return weight.defined(); }
};
// The MLP's gated activation: act(gate) * up.
enum class Activation : int32_t { kSilu = 0, kGeluTanh = 1 };

// Column-range versions of the decoder's elementwise ops, so that every thread of the fused
// decoder's region can run its own share of columns: each gives, on its columns, exactly the
// values the whole op gives. All tensors are contiguous [M, N] of one dtype (float32/bfloat16).
// out[:, c0:c1] = a + b.
void add_columns(const Isa& isa, const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out, int64_t c0, int64_t c1);
// out[:, c0:c1] = rms_norm(s)[:, c0:c1] with s = a + b rounded (b undefined: s = a); the sum
// of squares is taken over whole rows, so any split gives rms_norm(a + b). When sum_out is
// defined, sum_out[:, c0:c1] = s (the residual stream).
void residual_rms_norm_columns(const Isa& isa, const torch::Tensor& a, const torch::Tensor& b, const NormWeight& norm,
                               const torch::Tensor& sum_out, const torch::Tensor& out, int64_t c0, int64_t c1);
// out [M, N] columns [c0, c1) of act(gate) * up, x [M, 2N] = [gate | up].
void gated_activation_columns(const Isa& isa, Activation act, const torch::Tensor& x, const torch::Tensor& out,
                              int64_t c0, int64_t c1);

// Paged attention (attention.cpp::paged_attention) as plan -> q -> items -> finish, for a
// flat batch of sequences over one layer's blocks [num_blocks, kv_heads, block_size, D].
struct PagedItem {
  int64_t seq, kv_head, split, row0, rows, partial;  // rows from row0 on; partials at `partial`
};
struct PagedAttentionPlan {
  IsaPtr isa;
  torch::Tensor k_blocks, v_blocks, block_tables, query_start_loc, context_lens;
  torch::Tensor q_rows;  // [T * heads * D] in q's dtype: each (sequence, kv head)'s rows, token-major
  torch::Tensor qf;      // the same, fp32 and scaled, where bf16 dot products do not apply
  float scale = 1.0f;
  int64_t window = 0;  // a token sees only its last `window` keys (its own included); 0: all of them
  bool is_bf16_dot = false;
  int64_t num_tokens = 0, num_seqs = 0, heads = 0, kv_heads = 0, head_dim = 0, block_size = 0, shift = 0;
  std::vector<int64_t> token_seq, seq_item;  // each token's sequence; each sequence's first item
  std::vector<PagedItem> items;
  std::vector<float> pmax, psum, pacc;
  int64_t num_items() const { return static_cast<int64_t>(items.size()); }
  // Offset in q_rows/qf of token t's rows of kv head g (rows j = 0..group-1 follow).
  int64_t q_offset(int64_t t, int64_t g) const;
};
// Checks the inputs and lays out the items; q_rows is (re)sized for dtype.
void paged_attention_replan(PagedAttentionPlan& p, const IsaPtr& isa, at::ScalarType dtype, int64_t heads, const torch::Tensor& k_blocks,
                            const torch::Tensor& v_blocks, const torch::Tensor& block_tables,
                            const torch::Tensor& query_start_loc, const torch::Tensor& context_lens, double scale,
                            int64_t window = 0);
// Once kv heads [g0, g1)'s q rows are in q_rows: their fp32 scaled copy (fp32 path only).
void paged_attention_scale_q(PagedAttentionPlan& p, int64_t g0, int64_t g1);
void paged_attention_items(PagedAttentionPlan& p, int64_t i0, int64_t i1);  // any thread
// Query heads [j0, j1) of every token into out [T, heads * D].
void paged_attention_finish_heads(const PagedAttentionPlan& p, const torch::Tensor& out, int64_t j0, int64_t j1);
// The attention inputs of kv heads [g0, g1) from a flat batch's qkv projection [T, (heads +
// 2 kv_heads) * d]: q rotated into p.q_rows, k rotated and v into one layer's blocks at each
// token's slot (slot_mapping [T]). The same rotary arithmetic as rotary(); q_norm and k_norm,
// where defined, first normalize each head as rms_norm does.
void rope_to_paged_cache_heads(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                               const torch::Tensor& slot_mapping, PagedAttentionPlan& p, int64_t g0, int64_t g1,
                               const NormWeight& q_norm = {}, const NormWeight& k_norm = {});

}  // namespace fastdraft

// ---- The module's ops and bind_* functions, for bindings.cpp --------------------------------
// fused.cpp
torch::Tensor rms_norm(const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor rms_norm_offset(const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor w1, double eps);
torch::Tensor rms_norm_of(const fastdraft::IsaPtr& isa, const torch::Tensor& x, const fastdraft::NormWeight& norm);
torch::Tensor silu_and_mul(const fastdraft::IsaPtr& isa, torch::Tensor x);
torch::Tensor gelu_tanh_and_mul(const fastdraft::IsaPtr& isa, torch::Tensor x);
torch::Tensor gated_activation(const fastdraft::IsaPtr& isa, const torch::Tensor& x, fastdraft::Activation act);
torch::Tensor rotary(const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                     int64_t heads, int64_t head_dim);
// attention.cpp
torch::Tensor paged_attention(const fastdraft::IsaPtr& isa, torch::Tensor q, torch::Tensor k_blocks,
                              torch::Tensor v_blocks, torch::Tensor block_tables, torch::Tensor query_start_loc,
                              torch::Tensor context_lens, double scale, int64_t window);
// woq.cpp
torch::Tensor woq_linear(const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                         torch::Tensor zeros, int64_t bits, int64_t n, int64_t k_pad, int64_t block, int64_t group,
                         double zero_const);
torch::Tensor woq_block_sums(const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                             torch::Tensor zeros, int64_t bits, int64_t n, int64_t k_pad, int64_t block, int64_t group,
                             double zero_const);
torch::Tensor woq_dequantize(const fastdraft::IsaPtr& isa, torch::Tensor packed, torch::Tensor scales,
                             torch::Tensor zeros, int64_t bits, int64_t n, int64_t k, int64_t k_pad, int64_t block,
                             int64_t group, double zero_const, at::ScalarType dtype);
void repack_codes(torch::Tensor qweight, int64_t bits, int64_t n, int64_t k, int64_t k_pad, int64_t tile,
                  int64_t pad, torch::Tensor out);
// Each adds its own file's ops and classes to the module: isa.cpp, decoder.cpp, sampling.cpp.
void bind_isa(pybind11::module& m);
void bind_decoder(pybind11::module& m);
void bind_sampling(pybind11::module& m);
