// The decoder's projections (the C++ twin of fastdraft/layers/linear.py's ops): one Linear op,
// dense or weight-only or parts concatenated, and a weight-only projection whose tiles the
// threads of a parallel region share with work stealing. Included by decoder.cpp only.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "kernels.h"

namespace {
// One projection: a dense weight (dense_bf16_linear for up to 8 bf16 rows, else oneDNN padded
// to min_rows, like the Python path), a repacked INT4/INT6/INT8 weight (woq_linear), or
// projections of different formats run one by one with their outputs concatenated (e.g. an
// INT8 v_proj beside INT4 q/k). The bias is in the activation dtype.
struct Linear {
  torch::Tensor weight;  // dense [N, K], undefined for weight-only
  fastdraft::WoqWeight woq;  // used when weight is undefined and parts empty
  torch::Tensor bias;
  fastdraft::IsaPtr isa;  // the kernels that run it
  int64_t min_rows = 1;
  std::vector<std::shared_ptr<Linear>> parts;  // non-empty: the concatenation of these

  int64_t out_features() const {
    if (parts.empty()) return weight.defined() ? weight.size(0) : woq.out_features;
    int64_t n = 0;
    for (const auto& part : parts) n += part->out_features();
    return n;
  }
  // Every leaf weight-only (no dense GEMM, which must not run inside the decoder's own region).
  bool is_weight_only() const {
    if (parts.empty()) return !weight.defined();
    for (const auto& part : parts) if (!part->is_weight_only()) return false;
    return true;
  }

  // x [M, K]. is_batch_invariant: as fastdraft.kernels.mode.batch_invariant, the dense
  // row-invariant kernel at every row count.
  torch::Tensor operator()(const torch::Tensor& x, bool is_batch_invariant = false) const {
    if (!parts.empty()) {
      std::vector<torch::Tensor> outs;
      for (const auto& part : parts) outs.push_back((*part)(x, is_batch_invariant));
      return at::cat(outs, 1);
    }
    if (weight.defined()) {
      // As fastdraft.kernels.fused.dense_linear: the row-invariant kernel needs no padding.
      if (fastdraft::dense_bf16_applies(*isa, x, weight, bias) ||
          (is_batch_invariant && fastdraft::dense_bf16_supports(*isa, x, weight, bias)))
        return fastdraft::dense_bf16_linear(*isa, x, weight, bias);
      const int64_t m = x.size(0);
      if (m >= min_rows) return at::linear(x, weight, bias);
      auto padded = at::constant_pad_nd(x, {0, 0, 0, min_rows - m});
      return at::linear(padded, weight, bias).narrow(0, 0, m);
    }
    auto y = woq_linear(isa, x, woq.packed, woq.scales, woq.zeros, woq.bits, woq.out_features, woq.k_pad, woq.block,
                        woq.group, woq.zero_const);
    return bias.defined() ? y + bias : y;
  }
};

std::shared_ptr<Linear> dense_linear(const fastdraft::IsaPtr& isa, torch::Tensor weight,
                                     c10::optional<torch::Tensor> bias, int64_t min_rows) {
  auto lin = std::make_shared<Linear>();
  lin->isa = isa;
  lin->weight = weight;
  if (bias) lin->bias = *bias;
  lin->min_rows = min_rows;
  return lin;
}

std::shared_ptr<Linear> woq_linear_op(const fastdraft::IsaPtr& isa, torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros, int64_t bits,
                                      int64_t out_features, int64_t k_pad, int64_t block, int64_t group,
                                      double zero_const, c10::optional<torch::Tensor> bias) {
  auto lin = std::make_shared<Linear>();
  lin->isa = isa;
  lin->woq = fastdraft::WoqWeight{packed, scales, zeros, bits, out_features, k_pad, block, group, zero_const, isa};
  fastdraft::check_woq_weight(lin->woq);
  if (bias) lin->bias = *bias;
  return lin;
}

// Items [0, n) shared by the threads of a region: each thread starts with a contiguous share
// and takes chunks from its front; a thread that runs out takes chunks from the back of
// another's share. Threads often run at different speeds for a while (a neighbour's load on a
// shared host): with fixed shares the faster one would idle at every barrier, and a step has
// several per layer, so work moves to whoever is free. Each thread's own chunks stay in order,
// which keeps its weight reads one sequential stream.
class WorkSplit {
 public:
  // Serial. shares[t] .. shares[t + 1] is thread t's initial share; chunk: items per claim.
  void reset(const std::vector<int64_t>& shares, int64_t chunk) {
    const size_t num_threads = shares.size() - 1;
    if (num_threads_ != num_threads) {
      ranges_ = std::make_unique<Range[]>(num_threads);
      num_threads_ = num_threads;
    }
    for (size_t t = 0; t < num_threads; ++t) ranges_[t].bounds.store(pack(shares[t], shares[t + 1]));
    chunk_ = std::max<int64_t>(chunk, 1);
  }

  // Any thread: fn(begin, end) over the chunks it wins, its own share first.
  template <typename F>
  void run(int tid, F&& fn) {
    int64_t begin, end;
    while (claim(ranges_[tid], /*from_front=*/true, begin, end)) fn(begin, end);
    for (size_t i = 1; i < num_threads_; ++i) {
      Range& other = ranges_[(tid + i) % num_threads_];
      while (claim(other, /*from_front=*/false, begin, end)) fn(begin, end);
    }
  }

 private:
  struct alignas(64) Range {
    std::atomic<uint64_t> bounds{0};  // low 32 bits: next unclaimed; high: end
  };
  static uint64_t pack(int64_t lo, int64_t hi) { return (static_cast<uint64_t>(hi) << 32) | static_cast<uint64_t>(lo); }

  bool claim(Range& range, bool from_front, int64_t& begin, int64_t& end) const {
    uint64_t cur = range.bounds.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<uint32_t>(cur), hi = static_cast<uint32_t>(cur >> 32);
      if (lo >= hi) return false;
      begin = from_front ? lo : std::max(lo, hi - chunk_);
      end = from_front ? std::min(hi, lo + chunk_) : hi;
      const uint64_t next = from_front ? pack(end, hi) : pack(lo, begin);
      if (range.bounds.compare_exchange_weak(cur, next, std::memory_order_acq_rel)) return true;
    }
  }

  std::unique_ptr<Range[]> ranges_;
  size_t num_threads_ = 0;
  int64_t chunk_ = 1;
};

// A weight-only projection run by every thread of the decoder's parallel region: its leaf
// weights (several when formats differ, e.g. an INT8 v_proj beside INT4 q/k), their int8
// activations, its output, and each thread's share of the tiles, split by bytes so all threads
// stream about as much weight. One object serves one projection of every layer in turn:
// bind() points it at a layer's weights while no thread uses it, and its buffers are reused.
class Projection {
 public:
  // Serial: use lin for inputs of `rows` rows, with outputs in `options`' dtype.
  void bind(const Linear& lin, int64_t rows, const torch::TensorOptions& options, int num_threads) {
    leaves_.clear();
    collect(lin, 0, leaves_);
    num_acts_ = 0;
    unit_ = 1;
    k_pad_ = 0;
    for (auto& leaf : leaves_) {
      const auto& w = leaf.lin->woq;
      leaf.act = -1;
      for (int j = 0; j < num_acts_; ++j)  // leaves of one format share their activations
        if (acts_[j].matches(w.k_pad, w.block, w.group)) leaf.act = j;
      if (leaf.act >= 0) continue;
      if (static_cast<int>(acts_.size()) <= num_acts_) acts_.emplace_back();
      fastdraft::size_activations(rows, w.k_pad, w.block, w.group, acts_[num_acts_]);
      leaf.act = num_acts_++;
      unit_ = std::lcm(unit_, w.group);
      k_pad_ = std::max(k_pad_, w.k_pad);
    }
    const int64_t n = lin.out_features();
    if (!out_.defined() || out_.size(0) != rows || out_.size(1) != n || out_.scalar_type() != options.dtype())
      out_ = torch::empty({rows, n}, options);
    for (auto& leaf : leaves_) leaf.args = fastdraft::woq_tiles_args(leaf.lin->woq, out_, leaf.col0);
    has_bias_ = false;
    for (const auto& leaf : leaves_) has_bias_ = has_bias_ || leaf.lin->bias.defined();
    initial_shares(leaves_, num_threads, shares_);
    split_.reset(shares_, std::max<int64_t>(1, kChunkBytes / leaves_[0].lin->woq.tile_bytes()));
  }

  // Columns per quantization unit: every activation format's group divides it.
  int64_t unit() const { return unit_; }
  int64_t k_pad() const { return k_pad_; }
  const torch::Tensor& out() const { return out_; }
  bool has_bias() const { return has_bias_; }

  // Any thread: quantize columns [c0, c1) of x [T, K] (multiples of unit(); c1 may be
  // k_pad(), past K) for every activation format.
  void quantize(const torch::Tensor& x, int64_t c0, int64_t c1) {
    for (int j = 0; j < num_acts_; ++j)
      if (c0 < acts_[j].k_pad) fastdraft::quantize_activation_columns(*leaves_[0].lin->isa, x, c0, c1, acts_[j]);
  }

  // Any thread: fetch into L2 the first max_bytes of its initial share of the weights, so that
  // its stream is under way when the projection starts.
  void prefetch_share(int tid, int64_t max_bytes) const {
    const int64_t first = shares_[tid];
    for (const auto& leaf : leaves_) {
      const auto& w = leaf.lin->woq;
      const int64_t n = w.num_tiles();
      if (first >= leaf.first_tile + n) continue;
      const char* p = reinterpret_cast<const char*>(w.tile(first - leaf.first_tile));
      const int64_t bytes = std::min(max_bytes, (leaf.first_tile + n - first) * w.tile_bytes());
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);  // into L2
      return;
    }
  }

  // Any thread: tiles until none is left.
  void run(int tid) {
    split_.run(tid, [&](int64_t begin, int64_t end) {
      for (const auto& leaf : leaves_) {
        const int64_t n = leaf.lin->woq.num_tiles();
        const int64_t t0 = std::clamp<int64_t>(begin - leaf.first_tile, 0, n);
        const int64_t t1 = std::clamp<int64_t>(end - leaf.first_tile, 0, n);
        if (t0 < t1) fastdraft::woq_tiles(leaf.args, acts_[leaf.act], t0, t1);
      }
    });
  }

  // Any thread: add the biases to output columns [c0, c1).
  void add_bias(int64_t c0, int64_t c1) const {
    for (const auto& leaf : leaves_) {
      if (!leaf.lin->bias.defined()) continue;
      const int64_t b0 = std::max<int64_t>(c0 - leaf.col0, 0);
      const int64_t b1 = std::min<int64_t>(c1 - leaf.col0, leaf.lin->woq.out_features);
      if (b0 < b1) fastdraft::add_bias(*leaf.lin->isa, out_, leaf.col0, leaf.lin->bias, b0, b1);
    }
  }

 private:
  static constexpr int64_t kChunkBytes = 32 * 1024;  // per claim: a few tiles, one stream

  struct Leaf {
    const Linear* lin;
    int64_t col0;
    int act;  // index of its activations in acts_
    int64_t first_tile = 0;  // in the numbering across leaves
    fastdraft::WoqTilesArgs args;  // its weight and output columns
  };

  // The leaves of lin, their columns and their tiles numbered across leaves.
  static int64_t collect(const Linear& lin, int64_t col0, std::vector<Leaf>& leaves) {
    if (lin.parts.empty()) {
      const int64_t first_tile = leaves.empty() ? 0 : leaves.back().first_tile + leaves.back().lin->woq.num_tiles();
      leaves.push_back({&lin, col0, 0, first_tile});
      return col0 + lin.woq.out_features;
    }
    for (const auto& part : lin.parts) col0 = collect(*part, col0, leaves);
    return col0;
  }

  // shares[t]: the first tile of thread t's initial share; the shares hold equal bytes.
  static void initial_shares(const std::vector<Leaf>& leaves, int num_threads, std::vector<int64_t>& shares) {
    int64_t total_bytes = 0;
    for (const auto& leaf : leaves) total_bytes += leaf.lin->woq.num_tiles() * leaf.lin->woq.tile_bytes();
    shares.assign(num_threads + 1, leaves.back().first_tile + leaves.back().lin->woq.num_tiles());
    shares[0] = 0;
    for (int t = 1; t < num_threads; ++t) {
      const int64_t target = total_bytes * t / num_threads;
      int64_t bytes = 0;
      for (const auto& leaf : leaves) {
        const int64_t tb = leaf.lin->woq.tile_bytes(), n = leaf.lin->woq.num_tiles();
        if (bytes + n * tb >= target) {
          shares[t] = leaf.first_tile + (target - bytes + tb - 1) / tb;
          break;
        }
        bytes += n * tb;
      }
    }
  }

  std::vector<Leaf> leaves_;
  std::vector<fastdraft::Activations> acts_;  // the first num_acts_ are in use
  int num_acts_ = 0;
  int64_t unit_ = 1, k_pad_ = 0;
  bool has_bias_ = false;
  torch::Tensor out_;  // [T, N]
  std::vector<int64_t> shares_;
  WorkSplit split_;
};

// Thread tid's share [begin, end) of n items handed out in whole units of `unit` (the last
// one may be short): contiguous, in thread order.
std::pair<int64_t, int64_t> unit_share(int tid, int num_threads, int64_t n, int64_t unit) {
  const int64_t units = (n + unit - 1) / unit;
  return {std::min(n, units * tid / num_threads * unit), std::min(n, units * (tid + 1) / num_threads * unit)};
}
}  // namespace
