// The kernels' pieces that the fused decoder (decoder_x86.cpp) drives from inside its own
// parallel region: each op is split into a serial setup, work that any thread may run on any
// sub-range, and (for attention) a serial finish. The public ops (woq_linear,
// decode_attention) are these pieces run under at::parallel_for.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace fastdraft {

// Activations of one weight-only matmul, quantized to int8 per block (woq_x86.cpp).
struct Activations {
  std::vector<int8_t> q;     // [M, k_pad]
  std::vector<float> scale;  // [M, num_blocks]
  std::vector<float> corr;   // [M, num_groups]
  int64_t rows = 0, k_pad = 0, block = 0, group = 0, num_blocks = 0, num_groups = 0;

  bool matches(int64_t k_pad_, int64_t block_, int64_t group_) const {
    return k_pad == k_pad_ && block == block_ && group == group_;
  }
};

// One repacked INT4/INT8 weight (layout: fastdraft/kernels/x86.py::repack).
struct WoqWeight {
  torch::Tensor packed, scales, zeros;  // zeros undefined or empty: constant zero point
  int64_t bits = 0, out_features = 0, k_pad = 0, block = 0, group = 0;
  double zero_const = 0.0;

  int64_t num_tiles() const { return (out_features + 15) / 16; }
  int64_t num_groups() const { return k_pad / group; }
  int64_t tile_bytes() const { return k_pad * bits / 8 * 16; }
  const uint8_t* tile(int64_t t) const { return packed.data_ptr<uint8_t>() + t * tile_bytes(); }
};

// TORCH_CHECKs the weight's dtypes, layout and sizes.
void check_woq_weight(const WoqWeight& w);
// x [M, K <= k_pad] (float32 or bfloat16, contiguous) -> a.
void quantize_activations(const torch::Tensor& x, int64_t k_pad, int64_t block, int64_t group, Activations& a);
// Output tiles [t0, t1) (16 columns each) of y = x W^T, written to out [M, ldo] (x's dtype) at
// column col0 + 16 t. Every tile's arithmetic is the same whichever thread runs it.
void woq_tiles(const WoqWeight& w, const Activations& a, const torch::Tensor& out, int64_t col0, int64_t t0,
               int64_t t1);

// x[:, col0 : col0 + N] += bias [N] in place, rounded to x's dtype as torch's add is.
void add_bias(const torch::Tensor& x, int64_t col0, const torch::Tensor& bias);
// a + b for contiguous [M, N] tensors of one dtype, rounded as torch's add is.
torch::Tensor add(const torch::Tensor& a, const torch::Tensor& b);

// The attention inputs of one layer from its qkv projection [T, (heads + 2 kv_heads) * d]:
// returns q rotated and laid out as attention's rows [1, kv_heads, T * group, d], and writes
// k rotated and v into k_cache/v_cache [kv_heads, max_seq_len, d] at positions start..start+T-1.
// The same rotary arithmetic as rotary(), without its intermediate tensors.
torch::Tensor rope_to_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, int64_t start);

// Decode attention (fused_x86.cpp::decode_attention) as plan -> items -> finish.
struct AttentionPlan {
  torch::Tensor q, k, v, q_pairs, qf;
  float scale = 1.0f;
  bool is_bf16_dot = false;
  int64_t batch = 0, heads = 0, rows = 0, head_dim = 0, len = 0, splits = 0, num_items = 0;
  std::vector<int64_t> row_len;         // keys each row sees
  std::vector<float> pmax, psum, pacc;  // per item and row: max, exp-sum, unnormalised P V
};

// k/v [B, H, >= len, D]: the first len keys are attended (len < 0: all of them).
AttentionPlan attention_plan(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale,
                             int64_t num_tokens, int64_t len = -1);
void attention_items(AttentionPlan& plan, int64_t i0, int64_t i1);  // items [i0, i1), any thread
torch::Tensor attention_finish(const AttentionPlan& plan);             // -> [B, H, R, D]
// B == 1, the R rows being num_tokens token-major groups -> [num_tokens, H * R / num_tokens * D],
// token-major: the layout the output projection takes.
torch::Tensor attention_finish_tokens(const AttentionPlan& plan, int64_t num_tokens);

}  // namespace fastdraft
