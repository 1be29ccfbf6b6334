// A whole Llama-style decoder for a flat batch of sequences over a paged KV pool (the
// serving engine's step: prefill, chunked prefill, decode and speculative verification alike),
// run as one C++ call per forward pass: embedding rows, rotary rows, every layer, the final
// norm and a weight-only LM head.
//
// At batch 1 the per-layer work is a handful of weight-bound matmuls plus small elementwise
// ops; driving ~15 ops per layer from Python costs more than the elementwise work itself
// (every call pays interpreter and dispatch overhead that its small tensors cannot amortize).
// This file strings together the same kernels the Python path calls (rms_norm, woq_linear,
// rotary, paged_attention, silu_and_mul), in the same order and dtypes, so both paths give
// bit-identical results.
// The twin is the PyTorch module path in fastdraft/models/causal_lm.py.
//
// Two drivers: layer_forward_paged calls the public ops one by one (each its own fork/join),
// and serves stacks with dense (bf16/fp32) projections, whose oneDNN GEMMs need their own
// threads. Weight-only stacks run decoder_forward_region: every layer inside one parallel
// region, with work stealing between the threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"
#include "projection.h"

namespace {

// One layer of a decoder plan (fastdraft/models/plan.py::LayerPlan): h += post_attention(attn(
// pre_attention(h))), then h += post_mlp(mlp(pre_mlp(h))); a post norm left undefined is not there.
struct DecoderLayer {
  fastdraft::NormWeight pre_attention_norm, pre_mlp_norm, post_attention_norm, post_mlp_norm;  // [hidden]
  fastdraft::NormWeight q_norm, k_norm;  // [head_dim], over each head before rotary; may be undefined
  std::shared_ptr<Linear> qkv, o_proj, gate_up, down;  // qkv: [q | k | v], gate_up: [gate | up]
  int64_t num_heads, num_kv_heads, head_dim;
  double scale;
  int64_t window;   // a token sees its last `window` keys; 0: every key
  int64_t rotary;   // which of the step's rotary tables this layer's positions index
  fastdraft::Activation activation;
};

// All layers, every projection weight-only, inside one OpenMP parallel region. Every step is
// shared by all threads with a barrier between steps: each projection's tiles, the attention's
// (head, key split) items, and the elementwise work between them, which each thread runs on
// its own columns (the ones it then quantizes) or its own heads, so no step needs a second
// barrier. Thread 0 also binds each projection object to its next layer while no thread uses
// it. The arithmetic is the ops' own, in the same order: results are bit-identical to
// layer_forward_paged and to the module path.
// At the end of each elementwise step every thread prefetches this much of its next weights:
// 256 KB costs more on the critical path than it saves (issuing 4096 prefetches stalls the
// thread).
constexpr int64_t kSectionPrefetchBytes = 64 * 1024;

// Where a forward pass's keys and values go and how its attention runs, for the region below:
// a flat batch of sequences over a paged pool. replan runs on one thread while no thread uses
// the plan; rope on each thread's kv heads; items from any thread; finish on each thread's heads.
struct PagedAttention {
  std::vector<torch::Tensor> k_blocks, v_blocks;  // per layer [num_blocks, kv_heads, block_size, head_dim]
  torch::Tensor slot_mapping, block_tables, query_start_loc, context_lens;
  fastdraft::PagedAttentionPlan plan;

  fastdraft::IsaPtr isa;

  void replan(const DecoderLayer& layer, int i) {
    fastdraft::paged_attention_replan(plan, isa, k_blocks[i].scalar_type(), layer.num_heads, k_blocks[i], v_blocks[i],
                                      block_tables, query_start_loc, context_lens, layer.scale, layer.window);
  }
  int64_t num_items() const { return plan.num_items(); }
  void rope(const DecoderLayer& layer, const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
            int64_t kv0, int64_t kv1) {
    fastdraft::rope_to_paged_cache_heads(qkv, cos, sin, slot_mapping, plan, kv0, kv1, layer.q_norm, layer.k_norm);
    fastdraft::paged_attention_scale_q(plan, kv0, kv1);
  }
  void items(int64_t begin, int64_t end) { fastdraft::paged_attention_items(plan, begin, end); }
  void finish(const torch::Tensor& out, int64_t j0, int64_t j1) const {
    fastdraft::paged_attention_finish_heads(plan, out, j0, j1);
  }
};

// One layer of a flat batch over a paged pool with dense (or mixed) projections, whose oneDNN
// GEMMs need their own threads: the ops one by one, as the module path runs them, with the
// region's paged attention steps in between, so the results are the module path's bit for bit.
torch::Tensor layer_forward_paged(const DecoderLayer& layer, int i, const torch::Tensor& h, const torch::Tensor& cos,
                                  const torch::Tensor& sin, PagedAttention& attention, bool is_batch_invariant) {
  const int64_t num_tokens = h.size(0);
  const auto& isa = attention.isa;
  auto qkv = (*layer.qkv)(rms_norm_of(isa, h, layer.pre_attention_norm), is_batch_invariant).contiguous();
  attention.replan(layer, i);
  at::parallel_for(0, layer.num_kv_heads, 1,
                   [&](int64_t g0, int64_t g1) { attention.rope(layer, qkv, cos, sin, g0, g1); });
  at::parallel_for(0, attention.num_items(), 1, [&](int64_t i0, int64_t i1) { attention.items(i0, i1); });
  auto attn = torch::empty({num_tokens, layer.num_heads * layer.head_dim}, h.options());  // [T, q_size]
  at::parallel_for(0, layer.num_heads, 1,
                   [&](int64_t j0, int64_t j1) { attention.finish(attn, j0, j1); });
  auto out = (*layer.o_proj)(attn, is_batch_invariant);
  auto hidden = h + (layer.post_attention_norm.defined() ? rms_norm_of(isa, out, layer.post_attention_norm) : out);
  auto gate_up = (*layer.gate_up)(rms_norm_of(isa, hidden, layer.pre_mlp_norm), is_batch_invariant);
  out = (*layer.down)(gated_activation(isa, gate_up, layer.activation), is_batch_invariant);
  return hidden + (layer.post_mlp_norm.defined() ? rms_norm_of(isa, out, layer.post_mlp_norm) : out);
}

// With final_norm defined, returns the normed hidden states; with a weight-only head too, the
// head's output for the rows logit_rows [n] names, the head run inside the region like a projection.
// cos/sin: each rotary table's rows [T, head_dim], indexed by DecoderLayer::rotary.
torch::Tensor decoder_forward_region(const std::vector<std::shared_ptr<DecoderLayer>>& layers, const torch::Tensor& h,
                                     const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                                     PagedAttention& attention, const fastdraft::NormWeight& final_norm,
                                     const Linear* head, const torch::Tensor& logit_rows) {
  const int64_t num_tokens = h.size(0), hidden_size = h.size(1);
  const int num_layers = static_cast<int>(layers.size()), nth = at::get_num_threads();
  const DecoderLayer& first = *layers[0];
  for (const auto& layer : layers)
    TORCH_CHECK(layer->num_heads == first.num_heads && layer->num_kv_heads == first.num_kv_heads &&
                    layer->head_dim == first.head_dim &&
                    layer->gate_up->out_features() == first.gate_up->out_features(),
                "the fused decoder needs every layer of one shape");
  const int64_t d = first.head_dim, num_heads = first.num_heads, num_kv_heads = first.num_kv_heads;
  const int64_t intermediate = first.gate_up->out_features() / 2;
  const auto options = h.options();
  const fastdraft::Isa& isa = *attention.isa;
  // The residual stream alternates between resid (into a layer) and mid (after attention).
  auto resid = h.clone(), mid = torch::empty_like(h), normed = torch::empty_like(h);  // [T, hidden]
  // A post norm's output (Gemma's), which the residual then adds: each thread writes its columns,
  // and a barrier later every thread reads whole rows.
  bool has_post_norms = false;
  for (const auto& layer : layers) has_post_norms |= layer->post_attention_norm.defined() || layer->post_mlp_norm.defined();
  auto post_out = has_post_norms ? torch::empty_like(h) : torch::Tensor();
  auto attn_out = torch::empty({num_tokens, num_heads * d}, options);
  auto mlp_act = torch::empty({num_tokens, intermediate}, options);
  Projection qkv, o_proj, gate_up, down;
  qkv.bind(*first.qkv, num_tokens, options, nth);
  o_proj.bind(*first.o_proj, num_tokens, options, nth);
  gate_up.bind(*first.gate_up, num_tokens, options, nth);
  down.bind(*first.down, num_tokens, options, nth);
  Projection lm_head;
  // The head's input rows, those logit_rows names: copied from the normed rows column by
  // column, as each thread finishes its columns.
  torch::Tensor head_rows;
  if (head) {
    lm_head.bind(*head, logit_rows.size(0), options, nth);
    head_rows = torch::empty({logit_rows.size(0), hidden_size}, options);
  }
  WorkSplit attention_split;
  std::vector<int64_t> attention_shares(nth + 1);
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  // Any thread; an exception stops every thread at the next barrier, to be rethrown.
  auto guarded = [&](auto&& fn) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      fn();
    } catch (...) {
#pragma omp critical(fastdraft_decoder_error)
      if (!error) error = std::current_exception();
      failed = true;
    }
  };
  const torch::Tensor none;
#pragma omp parallel num_threads(nth)
  {
    const int tid = omp_get_thread_num();
    const int64_t kv0 = num_kv_heads * tid / nth, kv1 = num_kv_heads * (tid + 1) / nth;  // this thread's kv heads
    // A projection whose output every thread then reads in whole rows gets its biases (each
    // thread its share of columns) and a barrier first.
    auto add_bias_before_whole_rows = [&](const Projection& proj) {
      if (!proj.has_bias()) return;
      guarded([&] {
        const auto [c0, c1] = unit_share(tid, nth, proj.out().size(1), 16);
        proj.add_bias(c0, c1);
      });
#pragma omp barrier
    };
    // What the residual adds after a projection: its output, or its post norm's (this
    // thread's columns, then a barrier) where the plan has one.
    auto post_normed = [&](const Projection& proj, const fastdraft::NormWeight& norm) -> const torch::Tensor& {
      if (!norm.defined()) return proj.out();
      guarded([&] {
        const auto [c0, c1] = unit_share(tid, nth, hidden_size, 16);
        fastdraft::residual_rms_norm_columns(isa, proj.out(), none, norm, none, post_out, c0, c1);
      });
#pragma omp barrier
      return post_out;
    };
    const torch::Tensor* down_added = nullptr;  // the previous layer's MLP output, as the residual adds it
    for (int i = 0; i < num_layers; ++i) {
      const DecoderLayer& layer = *layers[i];
      // The previous layer's residual (its MLP output into resid), input norm, qkv activations.
      guarded([&] {
        const auto [c0, c1] = unit_share(tid, nth, qkv.k_pad(), qkv.unit());
        const bool is_first = i == 0;  // the input itself is the residual stream
        fastdraft::residual_rms_norm_columns(isa, is_first ? resid : mid, is_first ? none : *down_added,
                                             layer.pre_attention_norm, is_first ? none : resid, normed,
                                             std::min(c0, hidden_size), std::min(c1, hidden_size));
        qkv.quantize(normed, c0, c1);
        if (tid == 0) {
          attention.replan(layer, i);
          for (int t = 0; t <= nth; ++t) attention_shares[t] = attention.num_items() * t / nth;
          attention_split.reset(attention_shares, 1);
          gate_up.bind(*layer.gate_up, num_tokens, options, nth);
        }
        qkv.prefetch_share(tid, kSectionPrefetchBytes);
      });
#pragma omp barrier
      if (failed) break;
      qkv.run(tid);
#pragma omp barrier
      // Biases, rotary, cache writes and q for this thread's kv heads.
      guarded([&] {
        const int64_t group = num_heads / num_kv_heads, q_size = num_heads * d, kv_size = num_kv_heads * d;
        if (qkv.has_bias() && kv0 < kv1) {
          qkv.add_bias(kv0 * group * d, kv1 * group * d);
          qkv.add_bias(q_size + kv0 * d, q_size + kv1 * d);
          qkv.add_bias(q_size + kv_size + kv0 * d, q_size + kv_size + kv1 * d);
        }
        attention.rope(layer, qkv.out(), cos[layer.rotary], sin[layer.rotary], kv0, kv1);
        if (tid == 0) down.bind(*layer.down, num_tokens, options, nth);
        o_proj.prefetch_share(tid, kSectionPrefetchBytes);
      });
#pragma omp barrier
      if (failed) break;
      attention_split.run(tid, [&](int64_t begin, int64_t end) { attention.items(begin, end); });
#pragma omp barrier
      // This thread's query heads of the attention output, and their o_proj activations.
      guarded([&] {
        const int64_t heads_per_unit = std::lcm(o_proj.unit(), d) / d;
        const auto [j0, j1] = unit_share(tid, nth, num_heads, heads_per_unit);
        attention.finish(attn_out, j0, j1);
        if (j0 < j1) o_proj.quantize(attn_out, j0 * d, j1 == num_heads ? o_proj.k_pad() : j1 * d);
        if (tid == 0 && i + 1 < num_layers) qkv.bind(*layers[i + 1]->qkv, num_tokens, options, nth);
      });
#pragma omp barrier
      if (failed) break;
      o_proj.run(tid);
#pragma omp barrier
      add_bias_before_whole_rows(o_proj);
      // (A failure inside is seen at the next check, after gate_up's barrier.)
      const torch::Tensor& attention_added = post_normed(o_proj, layer.post_attention_norm);
      // The attention residual into mid, pre-MLP norm, gate_up activations.
      guarded([&] {
        const auto [c0, c1] = unit_share(tid, nth, gate_up.k_pad(), gate_up.unit());
        fastdraft::residual_rms_norm_columns(isa, resid, attention_added, layer.pre_mlp_norm, mid, normed,
                                             std::min(c0, hidden_size), std::min(c1, hidden_size));
        gate_up.quantize(normed, c0, c1);
        gate_up.prefetch_share(tid, kSectionPrefetchBytes);
      });
#pragma omp barrier
      if (failed) break;
      gate_up.run(tid);
#pragma omp barrier
      // Biases, silu(gate) * up and down's activations of this thread's columns.
      guarded([&] {
        const auto [c0, c1] = unit_share(tid, nth, down.k_pad(), down.unit());
        const int64_t e0 = std::min(c0, intermediate), e1 = std::min(c1, intermediate);
        if (gate_up.has_bias()) {
          gate_up.add_bias(e0, e1);
          gate_up.add_bias(intermediate + e0, intermediate + e1);
        }
        fastdraft::gated_activation_columns(isa, layer.activation, gate_up.out(), mlp_act, e0, e1);
        down.quantize(mlp_act, c0, c1);
        if (tid == 0 && i + 1 < num_layers) o_proj.bind(*layers[i + 1]->o_proj, num_tokens, options, nth);
        down.prefetch_share(tid, kSectionPrefetchBytes);
      });
#pragma omp barrier
      if (failed) break;
      down.run(tid);
#pragma omp barrier
      add_bias_before_whole_rows(down);
      down_added = &post_normed(down, layer.post_mlp_norm);
    }
    // The last layer's residual, then the final norm and the head's activations.
    guarded([&] {
      if (!final_norm.defined()) {
        const auto [c0, c1] = unit_share(tid, nth, hidden_size, 16);
        fastdraft::add_columns(isa, mid, *down_added, resid, c0, c1);
        return;
      }
      if (head) lm_head.prefetch_share(tid, kSectionPrefetchBytes);
      const auto [c0, c1] = head ? unit_share(tid, nth, lm_head.k_pad(), lm_head.unit())
                                 : unit_share(tid, nth, hidden_size, 16);
      fastdraft::residual_rms_norm_columns(isa, mid, *down_added, final_norm, none, normed,  // resid is not returned
                                           std::min(c0, hidden_size), std::min(c1, hidden_size));
      if (head) {
        const int64_t h0 = std::min(c0, hidden_size), h1 = std::min(c1, hidden_size);
        const int64_t* rows = logit_rows.data_ptr<int64_t>();
        for (int64_t r = 0; r < head_rows.size(0); ++r)
          std::memcpy(static_cast<char*>(head_rows.data_ptr()) + (r * hidden_size + h0) * normed.element_size(),
                      static_cast<const char*>(normed.data_ptr()) + (rows[r] * hidden_size + h0) * normed.element_size(),
                      (h1 - h0) * normed.element_size());
      }
      if (head) lm_head.quantize(head_rows, c0, c1);
    });
    if (head) {
#pragma omp barrier
      if (!failed) {  // the same for every thread after the barrier
        lm_head.run(tid);
        if (lm_head.has_bias()) {
#pragma omp barrier
          guarded([&] {
            const auto [c0, c1] = unit_share(tid, nth, lm_head.out().size(1), 16);
            lm_head.add_bias(c0, c1);
          });
        }
      }
    }
  }
  if (error) std::rethrow_exception(error);
  if (head) return lm_head.out();
  return final_norm.defined() ? normed : resid;
}

bool is_all_weight_only(const std::vector<std::shared_ptr<DecoderLayer>>& layers) {
  for (const auto& layer : layers)
    for (const auto* lin : {layer->qkv.get(), layer->o_proj.get(), layer->gate_up.get(), layer->down.get()})
      if (!lin->is_weight_only()) return false;
  return true;
}

// Rows ids [T] of table [rows, width]: plain copies, as an embedding lookup is (index_select's
// dispatch alone costs more than copying the few rows). `what` names an id in the error for one
// out of range.
torch::Tensor table_rows(const torch::Tensor& table, const torch::Tensor& ids, const char* what) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous(), "a table must be 2-D and contiguous");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, what, "s must be a 1-D int64 tensor");
  const auto ids_c = ids.contiguous();
  const int64_t num_ids = ids_c.size(0), num_rows = table.size(0);
  auto out = torch::empty({num_ids, table.size(1)}, table.options());
  const size_t row_bytes = table.size(1) * table.element_size();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_ids; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_rows, what, " ", id[i], " is outside [0, ", num_rows, ")");
    std::memcpy(static_cast<char*>(out.data_ptr()) + i * row_bytes,
                static_cast<const char*>(table.data_ptr()) + id[i] * row_bytes, row_bytes);
  }
  return out;
}

// x as fp32: bf16 widened exactly (its bits are fp32's upper half), in one pass with no
// dispatch (Tensor::to adds the dispatcher and a generic copy loop to every step's logits);
// fp32 as it is.
torch::Tensor to_float(const fastdraft::Isa& isa, const torch::Tensor& x) {
  if (x.scalar_type() == torch::kFloat) return x;
  if (x.scalar_type() != torch::kBFloat16 || !x.is_contiguous()) return x.to(torch::kFloat);
  auto out = torch::empty(x.sizes(), x.options().dtype(torch::kFloat));
  isa.table->scale_to_float(fastdraft::kElemBFloat16, x.data_ptr(), 1.0f, out.data_ptr<float>(), x.numel());
  return out;
}

// A model's step over a flat batch of sequences and a paged KV pool: token ids (or hidden
// states, for an embedding the C++ side does not take) to the final norm's output, or with a
// weight-only head, to the fp32 logits of the rows asked for. The embedding rows, the rotary
// rows and the logits' conversion to fp32 are taken here rather than by separate Python
// calls: with the weights streaming through the caches each such call meets cold caches and
// costs far more than the few rows it moves. Built once by its owner and run one step at a
// time (a mutex makes concurrent calls wait): the per-layer views of the last pool it ran on
// and the attention plan's buffers are kept from step to step, so they hold that pool until the
// next call or the step's end (the owner, the engine's runner, owns that pool for as long anyway).
class PagedDecoder {
 public:
  PagedDecoder(fastdraft::IsaPtr isa, std::vector<std::shared_ptr<DecoderLayer>> layers,
               c10::optional<torch::Tensor> embed, fastdraft::NormWeight final_norm, std::shared_ptr<Linear> head)
      : isa_(std::move(isa)), layers_(std::move(layers)), is_weight_only_(is_all_weight_only(layers_)),
        embed_(embed.value_or(torch::Tensor())), final_norm_(std::move(final_norm)), head_(std::move(head)) {
    TORCH_CHECK(isa_ && !layers_.empty(), "a decoder needs its kernels and layers");
    attention_.isa = isa_;
    TORCH_CHECK(!embed_.defined() || (embed_.dim() == 2 && embed_.is_contiguous()),
                "embed must be a contiguous [vocab, hidden] table");
    TORCH_CHECK(!head_ || (final_norm_.defined() && head_->is_weight_only() && is_weight_only_),
                "the head runs inside the step only after the final norm, with weight-only weights throughout");
  }

  bool has_embedding() const { return embed_.defined(); }

  // ids [T] int64 (or hidden [T, hidden] without an embedding table) at positions [T];
  // cos/sin tables: one [> max position, head_dim] pair per rotary the layers index; k/v_blocks [>= num_layers, num_blocks,
  // kv_heads, block_size, head_dim]; slot_mapping [T]; block_tables, query_start_loc and
  // context_lens as paged_attention takes them. -> the final norm's output [T, hidden] (the
  // last layer's without a norm), or with logit_rows [n], the head's fp32 logits [n, vocab].
  // is_batch_invariant: dense layers' kernels as fastdraft.kernels.mode.batch_invariant says.
  torch::Tensor forward(const torch::Tensor& ids, const c10::optional<torch::Tensor>& hidden,
                        const torch::Tensor& positions, const std::vector<torch::Tensor>& cos_tables,
                        const std::vector<torch::Tensor>& sin_tables,
                        const torch::Tensor& k_blocks, const torch::Tensor& v_blocks, const torch::Tensor& slot_mapping,
                        const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                        const torch::Tensor& context_lens, const c10::optional<torch::Tensor>& logit_rows,
                        bool is_batch_invariant) {
    const std::lock_guard<std::mutex> lock(mutex_);
    torch::NoGradGuard no_grad;
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) >= 1, "positions must be [num_tokens]");
    const int64_t num_tokens = positions.size(0);
    torch::Tensor h;  // [T, hidden]
    if (embed_.defined()) {
      TORCH_CHECK(ids.dim() == 1 && ids.size(0) == num_tokens, "ids must be [num_tokens]");
      h = table_rows(embed_, ids, "token id");
    } else {
      TORCH_CHECK(hidden.has_value() && hidden->dim() == 2 && hidden->size(0) == num_tokens,
                  "without an embedding table the step takes hidden states [num_tokens, hidden]");
      h = hidden->contiguous();
    }
    TORCH_CHECK(sin_tables.size() == cos_tables.size(), "one sin table per cos table");
    std::vector<torch::Tensor> cos, sin;  // each rotary's rows [T, head_dim]
    for (size_t j = 0; j < cos_tables.size(); ++j) {
      const auto &cos_table = cos_tables[j], &sin_table = sin_tables[j];
      TORCH_CHECK(cos_table.dim() == 2 && sin_table.sizes() == cos_table.sizes() &&
                      cos_table.scalar_type() == h.scalar_type() && sin_table.scalar_type() == h.scalar_type(),
                  "cos/sin tables must be [positions, head_dim] in the activations' dtype");
      cos.push_back(table_rows(cos_table, positions, "position"));
      sin.push_back(table_rows(sin_table, positions, "position"));
    }
    for (const auto& layer : layers_)
      TORCH_CHECK(layer->rotary >= 0 && layer->rotary < static_cast<int64_t>(cos.size()), "a layer's rotary table is missing");
    bind_pool(k_blocks, v_blocks);
    attention_.slot_mapping = slot_mapping.contiguous();
    attention_.block_tables = block_tables.contiguous();
    attention_.query_start_loc = query_start_loc.contiguous();
    attention_.context_lens = context_lens.contiguous();
    if (!is_weight_only_) {
      TORCH_CHECK(!logit_rows.has_value(), "the head runs inside the step only with weight-only layers");
      for (size_t i = 0; i < layers_.size(); ++i)
        h = layer_forward_paged(*layers_[i], static_cast<int>(i), h, cos[layers_[i]->rotary], sin[layers_[i]->rotary],
                                attention_, is_batch_invariant);
      return final_norm_.defined() ? rms_norm_of(isa_, h, final_norm_) : h;
    }
    if (!logit_rows.has_value())
      return decoder_forward_region(layers_, h, cos, sin, attention_, final_norm_, nullptr, torch::Tensor());
    TORCH_CHECK(head_, "this step has no head inside");
    const auto rows = logit_rows->contiguous();
    TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kLong && rows.size(0) >= 1, "logit_rows: [n] int64");
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.size(0); ++i) TORCH_CHECK(r[i] >= 0 && r[i] < num_tokens, "logit row out of range");
    return to_float(*isa_, decoder_forward_region(layers_, h, cos, sin, attention_, final_norm_, head_.get(), rows));
  }

 private:
  // Each layer's view of the pool, made again only when the pool changes: with the weights
  // streaming through the caches, making 2 views per layer afresh every step would run tensor
  // bookkeeping on cold caches for views that rarely change.
  void bind_pool(const torch::Tensor& k_blocks, const torch::Tensor& v_blocks) {
    TORCH_CHECK(k_blocks.dim() == 5 && v_blocks.sizes() == k_blocks.sizes() &&
                    k_blocks.size(0) >= static_cast<int64_t>(layers_.size()),
                "k/v blocks must be [>= num_layers, num_blocks, kv_heads, block_size, head_dim]");
    if (k_blocks.unsafeGetTensorImpl() == pool_k_.unsafeGetTensorImpl() &&
        v_blocks.unsafeGetTensorImpl() == pool_v_.unsafeGetTensorImpl() && k_blocks.data_ptr() == pool_k_ptr_ &&
        v_blocks.data_ptr() == pool_v_ptr_ && k_blocks.sizes() == pool_sizes_)
      return;
    attention_.k_blocks.clear();
    attention_.v_blocks.clear();
    for (size_t i = 0; i < layers_.size(); ++i) {
      attention_.k_blocks.push_back(k_blocks[i]);
      attention_.v_blocks.push_back(v_blocks[i]);
    }
    pool_k_ = k_blocks, pool_v_ = v_blocks;
    pool_k_ptr_ = k_blocks.data_ptr(), pool_v_ptr_ = v_blocks.data_ptr();
    pool_sizes_ = k_blocks.sizes().vec();
  }

  fastdraft::IsaPtr isa_;
  std::vector<std::shared_ptr<DecoderLayer>> layers_;
  bool is_weight_only_;
  torch::Tensor embed_;  // [vocab, hidden]; may be undefined
  fastdraft::NormWeight final_norm_;  // may be undefined
  std::shared_ptr<Linear> head_;
  torch::Tensor pool_k_, pool_v_;
  const void* pool_k_ptr_ = nullptr;
  const void* pool_v_ptr_ = nullptr;
  std::vector<int64_t> pool_sizes_;
  PagedAttention attention_;
  std::mutex mutex_;
};

}  // namespace

void bind_decoder(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Linear, std::shared_ptr<Linear>>(m, "Linear");
  m.def("dense_linear", &dense_linear, py::arg("isa"), py::arg("weight"), py::arg("bias"), py::arg("min_rows"));
  m.def("woq_linear_op", &woq_linear_op, py::arg("isa"), py::arg("packed"), py::arg("scales"), py::arg("zeros"), py::arg("bits"),
        py::arg("out_features"), py::arg("k_pad"), py::arg("block"), py::arg("group"), py::arg("zero_const"),
        py::arg("bias"));
  m.def("concat_linear", [](std::vector<std::shared_ptr<Linear>> parts) {
          TORCH_CHECK(!parts.empty(), "concat_linear needs at least one part");
          auto lin = std::make_shared<Linear>();
          lin->parts = std::move(parts);
          return lin;
        }, py::arg("parts"));
  py::class_<fastdraft::NormWeight>(m, "NormWeight")
      .def(py::init([](torch::Tensor weight, bool is_offset, double eps) {
             TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous(), "a norm's weight must be 1-D and contiguous");
             TORCH_CHECK(!is_offset || weight.scalar_type() == torch::kFloat, "an offset norm takes fp32 1 + weight");
             return fastdraft::NormWeight{weight, is_offset, eps};
           }),
           py::arg("weight"), py::arg("is_offset"), py::arg("eps"));
  py::class_<DecoderLayer, std::shared_ptr<DecoderLayer>>(m, "DecoderLayer")
      .def(py::init([](fastdraft::NormWeight pre_attention_norm, fastdraft::NormWeight pre_mlp_norm,
                       c10::optional<fastdraft::NormWeight> post_attention_norm,
                       c10::optional<fastdraft::NormWeight> post_mlp_norm, c10::optional<fastdraft::NormWeight> q_norm,
                       c10::optional<fastdraft::NormWeight> k_norm, std::shared_ptr<Linear> qkv,
                       std::shared_ptr<Linear> o_proj, std::shared_ptr<Linear> gate_up, std::shared_ptr<Linear> down,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, int64_t window,
                       int64_t rotary, const std::string& activation) {
             TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
             TORCH_CHECK(window >= 0 && rotary >= 0, "window and rotary must be >= 0");
             TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "unknown activation ", activation);
             const auto act = activation == "silu" ? fastdraft::Activation::kSilu : fastdraft::Activation::kGeluTanh;
             return std::make_shared<DecoderLayer>(DecoderLayer{
                 pre_attention_norm, pre_mlp_norm, post_attention_norm.value_or(fastdraft::NormWeight{}),
                 post_mlp_norm.value_or(fastdraft::NormWeight{}), q_norm.value_or(fastdraft::NormWeight{}),
                 k_norm.value_or(fastdraft::NormWeight{}), qkv, o_proj, gate_up, down, num_heads, num_kv_heads,
                 head_dim, scale, window, rotary, act});
           }),
           py::arg("pre_attention_norm"), py::arg("pre_mlp_norm"), py::arg("post_attention_norm"),
           py::arg("post_mlp_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qkv"), py::arg("o_proj"),
           py::arg("gate_up"), py::arg("down"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("scale"), py::arg("window"), py::arg("rotary"), py::arg("activation"));
  m.def("decoder_is_weight_only", &is_all_weight_only, "whether every projection of these layers is weight-only",
        py::arg("layers"));
  py::class_<PagedDecoder, std::shared_ptr<PagedDecoder>>(m, "PagedDecoder")
      .def(py::init([](fastdraft::IsaPtr isa, std::vector<std::shared_ptr<DecoderLayer>> layers,
                       c10::optional<torch::Tensor> embed, c10::optional<fastdraft::NormWeight> final_norm,
                       std::shared_ptr<Linear> head) {
             return std::make_shared<PagedDecoder>(std::move(isa), std::move(layers), std::move(embed),
                                                   final_norm.value_or(fastdraft::NormWeight{}), std::move(head));
           }),
           py::arg("isa"), py::arg("layers"), py::arg("embed"), py::arg("final_norm"), py::arg("head"))
      .def_property_readonly("has_embedding", &PagedDecoder::has_embedding)
      .def("forward", &PagedDecoder::forward, "a flat batch over a paged KV pool, token ids to the final norm or logits",
           py::arg("ids"), py::arg("hidden"), py::arg("positions"), py::arg("cos_tables"), py::arg("sin_tables"),
           py::arg("k_blocks"), py::arg("v_blocks"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("query_start_loc"), py::arg("context_lens"), py::arg("logit_rows"), py::arg("is_batch_invariant"),
           py::call_guard<py::gil_scoped_release>());
}
