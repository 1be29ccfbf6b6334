// Weight-only INT4/INT6/INT8 matmuls: the driver side. Activations are quantized to int8 per
// block, the weight's tiles are split between threads, and every tile runs the variant's
// kernel (kernel_table.h::woq_tiles; layout: fastdraft/kernels/x86.py::repack). Each output
// row follows the same sequence of operations whatever the number of rows in the call, so
// results are row-invariant. Plain PyTorch twin: fastdraft/kernels/x86.py::reference_woq_matmul.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using fastdraft::Activations;
using fastdraft::Isa;

// Dense bf16 rows the dense kernel serves outside batch-invariant mode: past them oneDNN wins.
constexpr int64_t kDenseMaxRows = 8;

}  // namespace

bool fastdraft::dense_bf16_supports(const Isa& isa, const torch::Tensor& x, const torch::Tensor& w,
                                    const torch::Tensor& bias) {
  return isa.table->dense_bf16_rows != nullptr && isa.table->has_bf16_dot() && x.scalar_type() == at::kBFloat16 &&
         w.scalar_type() == at::kBFloat16 && x.dim() == 2 && w.dim() == 2 && x.size(0) >= 1 && x.size(1) % 32 == 0 &&
         w.size(1) == x.size(1) && w.is_contiguous() && !x.is_cuda() && !w.is_cuda() &&
         (!bias.defined() || (bias.scalar_type() == at::kBFloat16 && bias.numel() == w.size(0)));
}

bool fastdraft::dense_bf16_applies(const Isa& isa, const torch::Tensor& x, const torch::Tensor& w,
                                   const torch::Tensor& bias) {
  return dense_bf16_supports(isa, x, w, bias) && x.size(0) <= kDenseMaxRows;
}

// Up to kDenseMaxRows rows: blocks of weight rows split between threads. More rows
// (batch-invariant mode): x is taken in blocks of rows that stay in L2, each weight block meets
// them 6 at a time while it is in L1, and every output is computed exactly as at M <= 8.
torch::Tensor fastdraft::dense_bf16_linear(const Isa& isa, const torch::Tensor& x_in, const torch::Tensor& w,
                                           const torch::Tensor& bias) {
  TORCH_CHECK(dense_bf16_supports(isa, x_in, w, bias), "dense_bf16_linear: x [M, K % 32 == 0], W [N, K] and bias "
                                                      "[N], all bf16, W contiguous, on a CPU with AVX512-BF16");
  const auto x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  torch::Tensor bias_f;
  if (bias.defined()) bias_f = bias.to(at::kFloat).contiguous();
  auto out = torch::empty({m, n}, x.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto rows_kernel = isa.table->dense_bf16_rows;
  if (m <= kDenseMaxRows) {
    at::parallel_for(0, (n + 7) / 8, 8, [&](int64_t b0, int64_t b1) {
      rows_kernel(wp, k, xp, m, bp, op, n, b0 * 8, std::min(n, b1 * 8));
    });
    return out;
  }
  constexpr int64_t kRowBlock = 4, kXRows = 6, kXBlockBytes = 384 * 1024;
  const int64_t m_block = std::max<int64_t>(kXRows, kXBlockBytes / (2 * k) / kXRows * kXRows);
  for (int64_t mb = 0; mb < m; mb += m_block) {
    const int64_t mb_end = std::min(m, mb + m_block);
    at::parallel_for(0, (n + kRowBlock - 1) / kRowBlock, 4, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t m0 = mb; m0 < mb_end; m0 += kXRows)
          rows_kernel(wp, k, xp + m0 * k, std::min(kXRows, mb_end - m0), bp, op + m0 * n, n, b * kRowBlock,
                      std::min(n, (b + 1) * kRowBlock));
    });
  }
  return out;
}

void fastdraft::check_woq_weight(const WoqWeight& w) {
  const torch::Tensor &packed = w.packed, &scales = w.scales, &zeros = w.zeros;
  const int64_t bits = w.bits, k_pad = w.k_pad, block = w.block, group = w.group;
  TORCH_CHECK(w.isa && w.isa->table, "a weight needs the kernels it runs on");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
  TORCH_CHECK(block == 16 || block == 32 || block == 64 || block == 128, "block must be 16, 32, 64 or 128");
  TORCH_CHECK(group % block == 0 && k_pad % group == 0, "group must be a multiple of block dividing k_pad");
  TORCH_CHECK(packed.dtype() == at::kByte && packed.is_contiguous() && packed.numel() == w.num_tiles() * w.tile_bytes(),
              "packed weight has the wrong dtype, layout or size for ", w.isa->table->name, "'s tiles of ",
              w.tile_rows(), " rows");
  TORCH_CHECK(scales.dtype() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == w.num_tiles() * w.num_groups() * w.tile_rows(),
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

void fastdraft::quantize_activation_columns(const Isa& isa, const torch::Tensor& x, int64_t c0, int64_t c1,
                                            Activations& a) {
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t b0 = c0 / a.block, b1 = std::min(c1, a.k_pad) / a.block;
  const Activations8 view = a.view();
  const int32_t type = elem_type(x);
  const char* base = static_cast<const char*>(x.data_ptr());
  for (int64_t r = 0; r < m; ++r) isa.table->quantize_row(type, base + r * k * x.element_size(), k, &view, r, b0, b1);
}

void fastdraft::quantize_activations(const Isa& isa, const torch::Tensor& x, int64_t k_pad, int64_t block,
                                     int64_t group, Activations& a) {
  const int64_t m = x.size(0), k = x.size(1);
  size_activations(m, k_pad, block, group, a);
  const Activations8 view = a.view();
  const int32_t type = elem_type(x);
  const char* base = static_cast<const char*>(x.data_ptr());
  auto run = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      isa.table->quantize_row(type, base + r * k * x.element_size(), k, &view, r, 0, a.num_blocks);
  };
  if (m >= 16) at::parallel_for(0, m, 4, run); else run(0, m);
}

fastdraft::WoqTilesArgs fastdraft::woq_tiles_args(const WoqWeight& w, const torch::Tensor& out, int64_t col0) {
  WoqTilesArgs args;
  WoqView& v = args.view;
  v.packed = w.packed.data_ptr<uint8_t>();
  v.scales = reinterpret_cast<const uint16_t*>(w.scales.data_ptr<at::Half>());
  if (w.zeros.defined() && w.zeros.numel() > 0) {
    if (w.zeros.scalar_type() == at::kHalf) v.zeros_f16 = reinterpret_cast<const uint16_t*>(w.zeros.data_ptr<at::Half>());
    else v.zeros_u8 = w.zeros.data_ptr<uint8_t>();
  }
  v.zero_const = static_cast<float>(w.zero_const);
  v.bits = w.bits, v.out_features = w.out_features, v.k_pad = w.k_pad, v.block = w.block, v.group = w.group;
  if (out.defined()) {
    v.ldo = out.size(1);
    v.out_type = elem_type(out);
    v.out = static_cast<char*>(out.data_ptr()) + col0 * out.element_size();
  }
  v.tuning = w.isa->tuning;
  args.table = w.isa->table;
  return args;
}

void fastdraft::woq_tiles(const WoqTilesArgs& args, const Activations& a, int64_t t0, int64_t t1) {
  const Activations8 view = a.view();
  args.table->woq_tiles(&args.view, &view, t0, t1);
}

namespace {

fastdraft::WoqWeight woq_weight(const fastdraft::IsaPtr& isa, torch::Tensor packed, torch::Tensor scales,
                                torch::Tensor zeros, int64_t bits, int64_t n, int64_t k_pad, int64_t block,
                                int64_t group, double zero_const) {
  fastdraft::WoqWeight w{packed, scales, zeros, bits, n, k_pad, block, group, zero_const, isa};
  fastdraft::check_woq_weight(w);
  return w;
}

void check_activations(const torch::Tensor& x, int64_t k_pad) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= k_pad, "x must be [M, K] with K <= k_pad");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
}

}  // namespace

// y [M, N] = x [M, K] @ W^T for a repacked INT4/INT6/INT8 weight; x is float32 or bfloat16.
torch::Tensor woq_linear(const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                         torch::Tensor zeros, int64_t bits, int64_t n, int64_t k_pad, int64_t block, int64_t group,
                         double zero_const) {
  const auto w = woq_weight(isa, packed, scales, zeros, bits, n, k_pad, block, group, zero_const);
  check_activations(x, k_pad);
  x = x.contiguous();
  const int64_t m = x.size(0);
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  Activations a;
  fastdraft::quantize_activations(*isa, x, k_pad, block, group, a);
  const fastdraft::WoqTilesArgs args = fastdraft::woq_tiles_args(w, out, 0);
  at::parallel_for(0, w.num_tiles(), 1, [&](int64_t t0, int64_t t1) { fastdraft::woq_tiles(args, a, t0, t1); });
  return out;
}

// The exact int32 block sums of x's int8 activations against the weight (kernel_table.h::
// woq_block_sums): [M, num_tiles * tile_rows, num_blocks]. A test entry point: the variants'
// integer arithmetic is compared bit for bit through it.
torch::Tensor woq_block_sums(const fastdraft::IsaPtr& isa, torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                             torch::Tensor zeros, int64_t bits, int64_t n, int64_t k_pad, int64_t block, int64_t group,
                             double zero_const) {
  const auto w = woq_weight(isa, packed, scales, zeros, bits, n, k_pad, block, group, zero_const);
  check_activations(x, k_pad);
  x = x.contiguous();
  Activations a;
  fastdraft::quantize_activations(*isa, x, k_pad, block, group, a);
  const fastdraft::WoqTilesArgs args = fastdraft::woq_tiles_args(w, torch::Tensor(), 0);
  const fastdraft::Activations8 view = a.view();
  const int64_t tile = w.tile_rows(), num_tiles = w.num_tiles(), m = x.size(0);
  auto sums = torch::empty({num_tiles, m, a.num_blocks, tile}, x.options().dtype(at::kInt));
  for (int64_t t = 0; t < num_tiles; ++t) isa->table->woq_block_sums(&args.view, &view, t, sums[t].data_ptr<int32_t>());
  return sums.permute({1, 0, 3, 2}).reshape({m, num_tiles * tile, a.num_blocks});
}

// The dense [N, K] weight (float32 or bfloat16) of a repacked INT4/INT6/INT8 weight: the large-M
// (prefill) path dequantizes once and runs a oneDNN GEMM (AMX-BF16 where the CPU has it).
torch::Tensor woq_dequantize(const fastdraft::IsaPtr& isa, torch::Tensor packed, torch::Tensor scales,
                             torch::Tensor zeros, int64_t bits, int64_t n, int64_t k, int64_t k_pad, int64_t block,
                             int64_t group, double zero_const, at::ScalarType dtype) {
  const auto w = woq_weight(isa, packed, scales, zeros, bits, n, k_pad, block, group, zero_const);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  TORCH_CHECK(k <= k_pad, "k must be <= k_pad");
  auto out = torch::empty({n, k}, packed.options().dtype(dtype));
  const fastdraft::WoqTilesArgs args = fastdraft::woq_tiles_args(w, torch::Tensor(), 0);
  const int64_t tile = w.tile_rows();
  const int32_t type = fastdraft::elem_type(out);
  at::parallel_for(0, w.num_tiles(), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      isa->table->dequant_tile(&args.view, t, k, type, static_cast<char*>(out.data_ptr()) + t * tile * k * out.element_size());
  });
  return out;
}

// The codes of a canonical weight (fastdraft/formats.py: INT4 two a byte, even k low; INT6 four
// in three bytes; INT8 signed) laid out for the kernels, into `out` (uint8, its shape as
// fastdraft/kernels/x86.py::repack documents): INT4 and INT8 [tiles, k_pad / (8 or 4), tile, 4],
// INT6 [tiles, k_pad / 8, 96]. Rows past n and columns past k hold `pad`. The twin is the
// PyTorch code of x86.py::repack, tested against this.
void repack_codes(torch::Tensor qweight, int64_t bits, int64_t n, int64_t k, int64_t k_pad, int64_t tile,
                  int64_t pad, torch::Tensor out) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "repack_codes: bits must be 4, 6 or 8");
  TORCH_CHECK(bits != 6 || tile == 16, "repack_codes: the INT6 layout has tiles of 16 rows");
  TORCH_CHECK(k_pad % 128 == 0 && k <= k_pad && tile > 0 && n > 0, "repack_codes: bad geometry");
  const auto q = qweight.contiguous();
  const int64_t row_bytes = bits == 4 ? k / 2 : bits == 6 ? k * 3 / 4 : k;
  TORCH_CHECK(q.dim() == 2 && q.size(0) == n && q.size(1) == row_bytes && q.element_size() == 1,
              "repack_codes: qweight must be [n, bytes per row] of 1-byte codes");
  const int64_t num_tiles = (n + tile - 1) / tile;
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == torch::kByte && out.numel() == num_tiles * tile * k_pad * bits / 8,
              "repack_codes: out must be a contiguous uint8 tensor of the packed size");
  const uint8_t* src = static_cast<const uint8_t*>(q.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> codes(tile * k_pad);  // this tile's codes, [tile, k_pad]
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < tile; ++i) {
        uint8_t* c = codes.data() + i * k_pad;
        const int64_t r = t * tile + i;
        std::fill(c, c + k_pad, static_cast<uint8_t>(pad));
        if (r >= n) continue;
        const uint8_t* s = src + r * row_bytes;
        if (bits == 4) {
          for (int64_t x = 0; x < k / 2; ++x) c[2 * x] = s[x] & 15, c[2 * x + 1] = s[x] >> 4;
        } else if (bits == 6) {
          for (int64_t g = 0; g < k / 4; ++g) {
            const uint32_t w = s[3 * g] | (s[3 * g + 1] << 8) | (s[3 * g + 2] << 16);
            for (int j = 0; j < 4; ++j) c[4 * g + j] = (w >> (6 * j)) & 63;
          }
        } else {
          for (int64_t x = 0; x < k; ++x) c[x] = static_cast<uint8_t>(static_cast<int8_t>(s[x]) + 128);
        }
      }
      if (bits == 8) {  // [chunks of 4 columns, tile, 4]
        uint8_t* o = dst + t * tile * k_pad;
        for (int64_t ch = 0; ch < k_pad / 4; ++ch)
          for (int64_t i = 0; i < tile; ++i)
            for (int j = 0; j < 4; ++j) *o++ = codes[i * k_pad + 4 * ch + j];
      } else if (bits == 4) {  // [chunks of 8 columns, tile, 4]: k = 8c + j low, 8c + 4 + j high
        uint8_t* o = dst + t * tile * k_pad / 2;
        for (int64_t ch = 0; ch < k_pad / 8; ++ch)
          for (int64_t i = 0; i < tile; ++i)
            for (int j = 0; j < 4; ++j)
              *o++ = codes[i * k_pad + 8 * ch + j] | (codes[i * k_pad + 8 * ch + 4 + j] << 4);
      } else {  // [chunks of 8 columns, 96 bytes]: 64 low-nibble bytes, then 32 bytes of top bits
        uint8_t* o = dst + t * tile * k_pad * 3 / 4;
        for (int64_t ch = 0; ch < k_pad / 8; ++ch, o += 96) {
          uint8_t fields[64];
          for (int64_t i = 0; i < 16; ++i)
            for (int j = 0; j < 4; ++j) {
              const uint8_t lo = codes[i * k_pad + 8 * ch + j], hi = codes[i * k_pad + 8 * ch + 4 + j];
              o[4 * i + j] = (lo & 15) | ((hi & 15) << 4);
              fields[4 * i + j] = (lo >> 4) | ((hi >> 4) << 2);
            }
          for (int p = 0; p < 32; ++p) o[64 + p] = fields[p] | (fields[p + 32] << 4);
        }
      }
    }
  });
}
