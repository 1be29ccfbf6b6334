// The `scalar` variant: every kernel in plain C++ (generic.h), built with no instruction-set
// flags, so it runs on any CPU. The oracle the SIMD variants are tested against, and the
// fallback where none of them runs. No bf16 dot products, so no dense_bf16_rows.
#include "kernel_table.h"
#include "generic.h"

namespace {

namespace g = fastdraft::generic;

constexpr fastdraft::KernelTable make_table() {
  fastdraft::KernelTable t{};
  t.version = fastdraft::kKernelTableVersion;
  t.size = sizeof(fastdraft::KernelTable);
  t.name = "scalar";
  t.tile_rows = g::kTileRows;
  t.quantize_row = g::quantize_row;
  t.woq_tiles = g::woq_tiles<g::kTileRows>;
  t.woq_block_sums = g::woq_block_sums<g::kTileRows>;
  t.dequant_tile = g::dequant_tile<g::kTileRows>;
  t.rms_norm_row = g::rms_norm_row;
  t.silu_mul = g::silu_mul;
  t.rotary_row = g::rotary_row;
  t.add = g::add;
  t.scale_to_float = g::scale_to_float;
  t.has_bf16_dot = g::has_bf16_dot;
  t.attend_split = g::attend_split;
  t.merge_splits = g::merge_splits;
  t.dense_bf16_rows = nullptr;  // has_bf16_dot() is 0
  t.argmax = g::argmax;
  t.block_cdf = g::block_cdf;
  t.rms_norm_offset_row = g::rms_norm_offset_row;
  t.gelu_tanh_mul = g::gelu_tanh_mul;
  return t;
}

// Constant-initialized: no guard, nothing runs at load time.
constexpr fastdraft::KernelTable kTable = make_table();

}  // namespace

extern "C" __attribute__((visibility("default"))) const fastdraft::KernelTable* fastdraft_kernel_table(void) {
  return &kTable;
}
