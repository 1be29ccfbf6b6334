// Token selection on fp32 rows, for the sampler and the speculative verifier: argmax as
// torch.argmax gives it, inverse-CDF draws, and the rejection sampler's accept / recover rule,
// each one C++ call instead of several PyTorch ops per step. Reference twins:
// fastdraft/layers/sampler.py (torch.argmax in greedy_ids, reference_sample_from_probs) and
// fastdraft/spec/rejection_sampler.py (verify_sampled).
#include <torch/extension.h>
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

// The index of each row's largest value, as torch.argmax gives it: the first on ties, and the
// first NaN if a row has one. x [rows, n] fp32 -> [rows] int64.
torch::Tensor argmax_rows(const fastdraft::IsaPtr& isa, const torch::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat && x.size(-1) >= 1, "argmax_rows takes fp32 rows");
  const auto xc = x.contiguous();
  const int64_t n = xc.size(-1), rows = xc.numel() / n;
  auto sizes = xc.sizes().vec();
  sizes.pop_back();
  auto out = torch::empty(sizes, xc.options().dtype(torch::kLong));
  int64_t* result = out.data_ptr<int64_t>();
  const float* x_data = xc.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) result[r] = isa->table->argmax(x_data + r * n, n);
  return out;
}

// Inverse-CDF draws, the rule of layers.sampler.reference_sample_from_probs: from a row [n] of
// probabilities (not necessarily normalized) and u in [0, 1), the first token whose float64
// running sum exceeds u * (row total), never a zero-probability token. Blocks of 128 tokens:
// only block sums (8 float64 lanes wide) and one block's running sum are accumulated.
constexpr int64_t kCdfBlock = 128;

// Fills block_cdf with the row's running block sums; returns the row total.
double block_cdf_of(const fastdraft::Isa& isa, const float* row, int64_t n, std::vector<double>& block_cdf) {
  block_cdf.resize((n + kCdfBlock - 1) / kCdfBlock);
  return isa.table->block_cdf(row, n, kCdfBlock, block_cdf.data());
}

// The draw for u from a row whose block_cdf_of gave block_cdf and total (> 0).
int64_t search_cdf(const float* row, int64_t n, double u, double total, const std::vector<double>& block_cdf) {
  TORCH_CHECK(total > 0.0, "a row of probabilities sums to ", total);
  const int64_t num_blocks = static_cast<int64_t>(block_cdf.size());
  const double point = u * total;
  // The first block whose CDF passes the point; a zero-mass block repeats its predecessor's
  // entry, so it is never the first. Past the end only by rounding: the last block with mass.
  int64_t b = std::upper_bound(block_cdf.begin(), block_cdf.end(), point) - block_cdf.begin();
  if (b == num_blocks) {
    b = num_blocks - 1;
    while (b > 0 && block_cdf[b] == block_cdf[b - 1]) --b;
  }
  const double rest = point - (b > 0 ? block_cdf[b - 1] : 0.0);
  const float* p = row + b * kCdfBlock;
  const int64_t len = std::min(kCdfBlock, n - b * kCdfBlock);
  int64_t chosen = -1, last_nonzero = -1;
  double running = 0.0;
  for (int64_t j = 0; j < len; ++j) {
    if (p[j] > 0.0f) last_nonzero = j;
    running += p[j];
    if (chosen < 0 && running > rest) chosen = j;
  }
  // The block's sequential sum may round below its block sum: never step past its last
  // token of nonzero probability.
  if (chosen < 0 || chosen > last_nonzero) chosen = last_nonzero;
  return b * kCdfBlock + chosen;
}

int64_t sample_row(const fastdraft::Isa& isa, const float* row, int64_t n, double u, std::vector<double>& block_cdf) {
  const double total = block_cdf_of(isa, row, n, block_cdf);
  return search_cdf(row, n, u, total, block_cdf);
}

// One draw per row of probs [rows, n] fp32 with uniform [rows] float64 (sample_row).
torch::Tensor sample_rows(const fastdraft::IsaPtr& isa, const torch::Tensor& probs, const torch::Tensor& uniform) {
  TORCH_CHECK(probs.dim() >= 1 && probs.scalar_type() == torch::kFloat && probs.size(-1) >= 1,
              "sample_rows takes fp32 probabilities");
  const auto pc = probs.contiguous();
  const int64_t n = pc.size(-1), rows = pc.numel() / n;
  const auto uc = uniform.contiguous();
  TORCH_CHECK(uc.scalar_type() == torch::kDouble && uc.numel() == rows, "one float64 uniform per row");
  auto sizes = pc.sizes().vec();
  sizes.pop_back();
  auto out = torch::empty(sizes, pc.options().dtype(torch::kLong));
  int64_t* result = out.data_ptr<int64_t>();
  const float* p = pc.data_ptr<float>();
  const double* u = uc.data_ptr<double>();
  std::vector<double> block_cdf;
  for (int64_t r = 0; r < rows; ++r) result[r] = sample_row(*isa, p + r * n, n, u[r], block_cdf);
  return out;
}

// Rejection sampling of k draft tokens, spec/rejection_sampler.py::verify_sampled's rule on the
// CPU in one call. draft_ids [k]; draft_probs [k, draft_vocab] fp32 over draft_vocab_ids
// [draft_vocab] (sorted; undefined: column i is token i); target_probs [k + 1, vocab] fp32;
// accept_uniform [k] fp32 and extra_uniform [1] float64, drawn by the caller as the twin draws
// them. Returns (number accepted, the recovered or bonus token).
std::pair<int64_t, int64_t> rejection_sample(const fastdraft::IsaPtr& isa, const torch::Tensor& draft_ids, const torch::Tensor& draft_probs,
                                             const c10::optional<torch::Tensor>& draft_vocab_ids,
                                             const torch::Tensor& target_probs, const torch::Tensor& accept_uniform,
                                             const torch::Tensor& extra_uniform) {
  const int64_t k = draft_ids.numel();
  TORCH_CHECK(target_probs.dim() == 2 && target_probs.size(0) == k + 1 &&
                  target_probs.scalar_type() == torch::kFloat, "target_probs must be fp32 [k + 1, vocab]");
  TORCH_CHECK(draft_probs.dim() == 2 && draft_probs.size(0) == k && draft_probs.scalar_type() == torch::kFloat,
              "draft_probs must be fp32 [k, draft_vocab]");
  TORCH_CHECK(draft_ids.scalar_type() == torch::kLong && accept_uniform.scalar_type() == torch::kFloat &&
                  accept_uniform.numel() == k && extra_uniform.scalar_type() == torch::kDouble &&
                  extra_uniform.numel() == 1, "draft_ids int64 [k], accept_uniform fp32 [k], extra_uniform float64 [1]");
  const auto target = target_probs.contiguous(), draft = draft_probs.contiguous();
  const auto ids = draft_ids.contiguous(), us = accept_uniform.contiguous();
  const int64_t vocab = target.size(1), draft_vocab = draft.size(1);
  const bool has_map = draft_vocab_ids.has_value() && draft_vocab_ids->defined();
  torch::Tensor map;
  if (has_map) {
    map = draft_vocab_ids->contiguous();
    TORCH_CHECK(map.scalar_type() == torch::kLong && map.numel() == draft_vocab, "draft_vocab_ids: int64 [draft_vocab]");
  } else {
    TORCH_CHECK(draft_vocab <= vocab, "the draft's vocabulary is larger than the target's");
  }
  const int64_t* vocab_ids = has_map ? map.data_ptr<int64_t>() : nullptr;
  const float* t = target.data_ptr<float>();
  const float* d = draft.data_ptr<float>();
  const int64_t* draft_tokens = ids.data_ptr<int64_t>();
  const float* u_accept = us.data_ptr<float>();
  int64_t num_accepted = 0;
  for (; num_accepted < k; ++num_accepted) {
    const int64_t i = num_accepted, token = draft_tokens[i];
    TORCH_CHECK(token >= 0 && token < vocab, "draft token ", token, " is outside the vocabulary");
    int64_t col = token;
    if (has_map) {
      col = std::lower_bound(vocab_ids, vocab_ids + draft_vocab, token) - vocab_ids;
      TORCH_CHECK(col < draft_vocab && vocab_ids[col] == token, "draft token ", token, " is not in the draft's vocabulary");
    } else {
      TORCH_CHECK(col < draft_vocab, "draft token ", token, " is outside the draft's vocabulary");
    }
    // accept iff u < target / draft, written without dividing by a zero draft probability
    if (!(u_accept[i] * d[i * draft_vocab + col] < t[i * vocab + token])) break;
  }
  std::vector<double> block_cdf;
  const double u = extra_uniform.data_ptr<double>()[0];
  const float* target_row = t + num_accepted * vocab;
  if (num_accepted == k) return {num_accepted, sample_row(*isa, target_row, vocab, u, block_cdf)};
  // The recovered token: from max(0, target - draft), unnormalized (the draw scales by its sum).
  std::vector<float> residual(target_row, target_row + vocab);
  const float* draft_row = d + num_accepted * draft_vocab;
  for (int64_t j = 0; j < draft_vocab; ++j) {
    const int64_t token = has_map ? vocab_ids[j] : j;
    residual[token] = std::max(residual[token] - draft_row[j], 0.0f);
  }
  // No mass left only if the distributions are equal, where rejection has probability 0.
  const double residual_total = block_cdf_of(*isa, residual.data(), vocab, block_cdf);
  if (!(residual_total > 0.0)) return {num_accepted, sample_row(*isa, target_row, vocab, u, block_cdf)};
  return {num_accepted, search_cdf(residual.data(), vocab, u, residual_total, block_cdf)};
}

}  // namespace

void bind_sampling(pybind11::module& m) {
  namespace py = pybind11;
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (or NaN), as torch.argmax",
        py::arg("isa"), py::arg("x"));
  m.def("sample_rows", &sample_rows, "one inverse-CDF draw per row of probabilities", py::arg("isa"), py::arg("probs"),
        py::arg("uniform"));
  m.def("rejection_sample", &rejection_sample, "(number of draft tokens accepted, recovered or bonus token)",
        py::arg("isa"), py::arg("draft_ids"), py::arg("draft_probs"), py::arg("draft_vocab_ids"), py::arg("target_probs"),
        py::arg("accept_uniform"), py::arg("extra_uniform"));
}
