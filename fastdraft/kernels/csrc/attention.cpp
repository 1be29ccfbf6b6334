// Paged attention, the driver side: the new query tokens of a flat batch of sequences over
// their cached keys and values in a block pool, split into (sequence, kv head, key split) items
// that any thread may run through the variant's attend_split, and a finish that merges the
// splits' partial softmaxes (flash-decoding) with its merge_splits (kernel_table.h).
// Reference twin: fastdraft/kernels/fused.py::reference_paged_attention.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using fastdraft::elem_type;

constexpr int64_t kKeysPerSplit = 256;  // fixed (not per thread count): results are deterministic

}  // namespace

int64_t fastdraft::PagedAttentionPlan::q_offset(int64_t t, int64_t g) const {
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t s = token_seq[t], group = heads / kv_heads, num_new = qsl[s + 1] - qsl[s];
  return (qsl[s] * heads + g * num_new * group + (t - qsl[s]) * group) * head_dim;
}

void fastdraft::paged_attention_replan(PagedAttentionPlan& p, const IsaPtr& isa, at::ScalarType dtype, int64_t heads,
                                       const torch::Tensor& k_blocks, const torch::Tensor& v_blocks,
                                       const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                                       const torch::Tensor& context_lens, double scale, int64_t window) {
  TORCH_CHECK(k_blocks.dim() == 4 && v_blocks.sizes() == k_blocks.sizes() && k_blocks.is_contiguous() &&
                  v_blocks.is_contiguous(), "k/v blocks must be contiguous [num_blocks, kv_heads, block_size, D]");
  TORCH_CHECK(k_blocks.scalar_type() == dtype && v_blocks.scalar_type() == dtype &&
                  (dtype == at::kFloat || dtype == at::kBFloat16), "q, k, v: one dtype, f32 or bf16");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  query_start_loc.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous() && context_lens.is_contiguous(),
              "block tables, query_start_loc and context_lens must be contiguous int64");
  const int64_t d = k_blocks.size(3), kv_heads = k_blocks.size(1), block_size = k_blocks.size(2);
  const int64_t num_blocks = k_blocks.size(0), num_seqs = context_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(d % 16 == 0 && d <= 256, "head_dim must be a multiple of 16 up to 256");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(window >= 0, "the window must be a count of keys, or 0 for none");
  TORCH_CHECK(block_size >= 2 && (block_size & (block_size - 1)) == 0, "block_size must be a power of two");
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "query_start_loc must be [num_seqs + 1] and block_tables [num_seqs, max_blocks]");
  const int64_t group = heads / kv_heads;
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t num_tokens = qsl[num_seqs];
  TORCH_CHECK(qsl[0] == 0 && num_tokens >= 1, "query_start_loc must run from 0 to T");
  p.isa = isa;
  p.k_blocks = k_blocks, p.v_blocks = v_blocks, p.block_tables = block_tables;
  p.query_start_loc = query_start_loc, p.context_lens = context_lens;
  p.scale = static_cast<float>(scale);
  p.window = window;
  p.num_tokens = num_tokens, p.num_seqs = num_seqs, p.heads = heads, p.kv_heads = kv_heads, p.head_dim = d;
  p.block_size = block_size, p.shift = __builtin_ctzll(static_cast<unsigned long long>(block_size));
  p.token_seq.resize(num_tokens);
  p.seq_item.assign(num_seqs + 1, 0);
  p.items.clear();
  int64_t num_partial = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t num_new = qsl[s + 1] - qsl[s], len = ctx[s];
    TORCH_CHECK(num_new >= 1 && num_new <= len && len <= max_blocks * block_size,
                "each sequence needs 1..context_len new tokens within its block table");
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < num_blocks, "block id out of range");
    for (int64_t t = qsl[s]; t < qsl[s + 1]; ++t) p.token_seq[t] = s;
    const int64_t splits = (len + kKeysPerSplit - 1) / kKeysPerSplit, cached = len - num_new;
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t sp = 0; sp < splits; ++sp) {
        // Token t sees keys 0..cached + t: the split's first key l0 needs t >= l0 - cached.
        const int64_t first = std::max<int64_t>(0, sp * kKeysPerSplit - cached);
        const int64_t rows = (num_new - first) * group;
        p.items.push_back({s, g, sp, first * group, rows, num_partial});
        num_partial += rows;
      }
    p.seq_item[s + 1] = p.num_items();
  }
  p.is_bf16_dot = dtype == at::kBFloat16 && d % 32 == 0 && isa->table->has_bf16_dot();
  const int64_t q_numel = num_tokens * heads * d;
  if (!p.q_rows.defined() || p.q_rows.numel() < q_numel || p.q_rows.scalar_type() != dtype)
    p.q_rows = torch::empty({q_numel}, k_blocks.options());
  if (!p.is_bf16_dot && (!p.qf.defined() || p.qf.numel() < q_numel))
    p.qf = torch::empty({q_numel}, k_blocks.options().dtype(at::kFloat));
  p.pmax.resize(num_partial);
  p.psum.resize(num_partial);
  p.pacc.resize(num_partial * d);
}

void fastdraft::paged_attention_scale_q(PagedAttentionPlan& p, int64_t g0, int64_t g1) {
  if (p.is_bf16_dot) return;
  const int64_t group_d = p.heads / p.kv_heads * p.head_dim;
  const int32_t type = elem_type(p.q_rows);
  const char* q = static_cast<const char*>(p.q_rows.data_ptr());
  // As (q.to(float) * scale) would: one fp32 product per element.
  for (int64_t t = 0; t < p.num_tokens; ++t)
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t off = p.q_offset(t, g);
      p.isa->table->scale_to_float(type, q + off * p.q_rows.element_size(), p.scale, p.qf.data_ptr<float>() + off,
                                   group_d);
    }
}

void fastdraft::paged_attention_items(PagedAttentionPlan& p, int64_t i0, int64_t i1) {
  const int64_t d = p.head_dim, group = p.heads / p.kv_heads;
  const int64_t* qsl = p.query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = p.context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = p.block_tables.size(1);
  const int64_t elem = p.k_blocks.element_size();
  std::vector<int64_t> num_keys;
  AttendArgs args{};
  args.type = elem_type(p.k_blocks);
  args.scale = p.is_bf16_dot ? p.scale : 1.0f;
  args.block_stride = p.kv_heads * p.block_size * d;
  args.block_shift = p.shift;
  args.head_dim = d;
  args.tuning = p.isa->tuning;
  for (int64_t it = i0; it < i1; ++it) {
    const PagedItem& item = p.items[it];
    const int64_t s = item.seq, len = ctx[s], num_new = qsl[s + 1] - qsl[s];
    const int64_t l0 = item.split * kKeysPerSplit, l1 = std::min(len, l0 + kKeysPerSplit);
    const int64_t q_off = p.q_offset(qsl[s], item.kv_head) + item.row0 * d;
    const int64_t head_off = item.kv_head * p.block_size * d;
    args.k_base = static_cast<const char*>(p.k_blocks.data_ptr()) + head_off * elem;
    args.v_base = static_cast<const char*>(p.v_blocks.data_ptr()) + head_off * elem;
    args.block_table = p.block_tables.data_ptr<int64_t>() + s * max_blocks;
    args.l1 = l1;
    // Rows r0..r0+rows-1 over keys first..l1-1: row r sees keys up to its own position.
    auto attend = [&](int64_t r0, int64_t rows, int64_t first) {
      num_keys.resize(rows);
      for (int64_t r = 0; r < rows; ++r)
        num_keys[r] = std::clamp<int64_t>(len - num_new + 1 + (item.row0 + r0 + r) / group - first, 0, l1 - first);
      args.qf = p.is_bf16_dot ? nullptr : p.qf.data_ptr<float>() + q_off + r0 * d;
      args.q_bf16 = p.is_bf16_dot ? reinterpret_cast<const uint16_t*>(p.q_rows.data_ptr<at::BFloat16>()) + q_off + r0 * d
                                  : nullptr;
      args.rows = rows, args.l0 = first;
      args.num_keys = num_keys.data();
      args.max_out = p.pmax.data() + item.partial + r0;
      args.sum_out = p.psum.data() + item.partial + r0;
      args.acc_out = p.pacc.data() + (item.partial + r0) * d;
      p.isa->table->attend_split(&args);
    };
    if (p.window == 0) {
      attend(0, item.rows, l0);
      continue;
    }
    // With a window, a token's keys start at its position - window + 1. The tokens (group rows
    // each, in order) whose window starts at or before the split's first key run together as
    // without one; a token whose window starts inside the split runs over its own keys, as it
    // does alone in a decode step; a token whose window starts past the split sees none of it,
    // and paged_finish does not read its rows.
    const int64_t first_token = item.row0 / group, num_tokens = item.rows / group;
    const int64_t position0 = len - num_new + first_token;  // the item's first token's position
    int64_t whole = 0;
    while (whole < num_tokens && position0 + whole - p.window + 1 <= l0) ++whole;
    if (whole > 0) attend(0, whole * group, l0);
    for (int64_t t = whole; t < num_tokens; ++t) {
      const int64_t start = position0 + t - p.window + 1;
      if (start >= l1) break;
      attend(t * group, group, start);
    }
  }
}

namespace {

// Query heads [j0, j1) of tokens [t0, t1) into out [T, heads * D].
void paged_finish(const fastdraft::PagedAttentionPlan& p, const torch::Tensor& out, int64_t t0, int64_t t1, int64_t j0,
                  int64_t j1) {
  const int64_t d = p.head_dim, group = p.heads / p.kv_heads;
  const int64_t* qsl = p.query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = p.context_lens.data_ptr<int64_t>();
  const auto merge = p.isa->table->merge_splits;
  const int32_t type = elem_type(out);
  std::vector<float> maxes, sums;
  std::vector<const float*> accs;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t s = p.token_seq[t], tl = t - qsl[s], len = ctx[s], num_new = qsl[s + 1] - qsl[s];
    const int64_t splits = (len + kKeysPerSplit - 1) / kKeysPerSplit;
    const int64_t row_splits = (len - num_new + 1 + tl + kKeysPerSplit - 1) / kKeysPerSplit;
    // The splits before the one holding the token's first key (its window's start) add nothing.
    const int64_t first_split =
        p.window == 0 ? 0 : std::max<int64_t>(0, len - num_new + tl - p.window + 1) / kKeysPerSplit;
    maxes.resize(row_splits), sums.resize(row_splits), accs.resize(row_splits);
    for (int64_t h = j0; h < j1; ++h) {
      const int64_t g = h / group, r = tl * group + h % group;
      const fastdraft::PagedItem* first = p.items.data() + p.seq_item[s] + g * splits;
      for (int64_t sp = first_split; sp < row_splits; ++sp) {
        const int64_t row = first[sp].partial + r - first[sp].row0;
        maxes[sp - first_split] = p.pmax[row];
        sums[sp - first_split] = p.psum[row];
        accs[sp - first_split] = p.pacc.data() + row * d;
      }
      merge(row_splits - first_split, maxes.data(), sums.data(), accs.data(), d, type,
            static_cast<char*>(out.data_ptr()) + (t * p.heads + h) * d * out.element_size());
    }
  }
}

}  // namespace

void fastdraft::paged_attention_finish_heads(const PagedAttentionPlan& p, const torch::Tensor& out, int64_t j0,
                                             int64_t j1) {
  TORCH_CHECK(out.is_contiguous() && out.numel() == p.num_tokens * p.heads * p.head_dim &&
                  out.scalar_type() == p.q_rows.scalar_type(), "out must be [T, heads * head_dim] in q's dtype");
  paged_finish(p, out, 0, p.num_tokens, j0, j1);
}

// A flat batch of sequences over a paged KV pool: q [T, H, D] holds each sequence's new tokens
// back to back (sequence s: query_start_loc[s]..query_start_loc[s + 1]); k/v_blocks
// [num_blocks, kv_heads, block_size, D]; sequence s's keys are positions 0..context_lens[s] - 1
// in the blocks of block_tables[s], its new tokens the last ones, each seeing the keys up to
// its own. -> out [T, H, D]. Every query row is computed as a one-token step over the same keys
// computes it: the same fixed 256-key splits, the same per-row arithmetic, whatever the other
// rows, the other sequences or the number of new tokens, so prefill, chunked prefill, decode
// and verification give a row bit-identical results.
// bf16 inputs on CPUs with AVX512-BF16 use bf16 dot products with fp32 accumulation for q K^T
// (exact products, scaled in fp32) and P V (probabilities rounded to bf16), as flash attention
// does; the softmax itself is fp32.
torch::Tensor paged_attention(const fastdraft::IsaPtr& isa, torch::Tensor q, torch::Tensor k_blocks, torch::Tensor v_blocks, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == k_blocks.scalar_type(), "q must be [T, H, D] in the blocks' dtype");
  const auto qc = q.contiguous();
  fastdraft::PagedAttentionPlan p;
  fastdraft::paged_attention_replan(p, isa, qc.scalar_type(), qc.size(1), k_blocks, v_blocks, block_tables,
                                    query_start_loc, context_lens, scale, window);
  TORCH_CHECK(qc.size(0) == p.num_tokens && qc.size(2) == p.head_dim, "q must be [T, H, D] for the metadata's T");
  const int64_t group_d = p.heads / p.kv_heads * p.head_dim;
  at::parallel_for(0, p.num_tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < p.kv_heads; ++g)
        std::memcpy(static_cast<char*>(p.q_rows.data_ptr()) + p.q_offset(t, g) * qc.element_size(),
                    static_cast<const char*>(qc.data_ptr()) + (t * p.heads * p.head_dim + g * group_d) * qc.element_size(),
                    group_d * qc.element_size());
  });
  fastdraft::paged_attention_scale_q(p, 0, p.kv_heads);
  at::parallel_for(0, p.num_items(), 1, [&](int64_t i0, int64_t i1) { fastdraft::paged_attention_items(p, i0, i1); });
  auto out = torch::empty({p.num_tokens, p.heads, p.head_dim}, qc.options());
  at::parallel_for(0, p.num_tokens, 4, [&](int64_t t0, int64_t t1) { paged_finish(p, out, t0, t1, 0, p.heads); });
  return out;
}
