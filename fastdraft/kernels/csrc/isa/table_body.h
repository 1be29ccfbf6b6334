// A variant's kernel table: the bodies (woq_body.h, elementwise_body.h, attention_body.h)
// compiled against the SIMD layer the variant's .cpp included first, behind the C entry points
// of kernel_table.h. The variant names itself with FASTDRAFT_VARIANT_NAME.
#pragma once

#include <cstdint>

#include "attention_body.h"
#include "elementwise_body.h"
#include "generic.h"
#include "kernel_table.h"
#include "woq_body.h"

namespace {

// fn(T{}) with T the element type (float or BF16).
template <typename F>
inline void with_type(int32_t type, F&& fn) {
  if (type == fastdraft::kElemFloat32) fn(float{});
  else fn(BF16{});
}

void quantize_row(int32_t type, const void* x, int64_t k, const Activations8* a, int64_t m, int64_t b0, int64_t b1) {
  with_type(type, [&](auto e) { quantize_row_of(static_cast<const decltype(e)*>(x), k, *a, m, b0, b1); });
}

void woq_tiles(const WoqView* w, const Activations8* a, int64_t t0, int64_t t1) { woq_dispatch(w, a, t0, t1, nullptr); }

void woq_block_sums(const WoqView* w, const Activations8* a, int64_t t, int32_t* sums) {
  woq_dispatch(w, a, t, t + 1, sums);
}

void dequant_tile(const WoqView* w, int64_t t, int64_t k, int32_t type, void* out) {
  if (w->bits == 6) return fastdraft::generic::dequant_tile<kTile>(w, t, k, type, out);
  with_type(type, [&](auto e) { dequant_tile_of(*w, t, k, static_cast<decltype(e)*>(out)); });
}

void rms_norm_row(int32_t type, const void* a, const void* b, const void* weight, void* sum, void* out, int64_t h,
                  float eps, int64_t c0, int64_t c1) {
  with_type(type, [&](auto e) {
    using T = decltype(e);
    rms_norm_row_of(static_cast<const T*>(a), static_cast<const T*>(b), static_cast<const T*>(weight),
                    static_cast<T*>(sum), static_cast<T*>(out), h, eps, c0, c1);
  });
}

void silu_mul(int32_t type, const void* gate, const void* up, void* out, int64_t n) {
  with_type(type, [&](auto e) {
    using T = decltype(e);
    silu_mul_of(static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out), n);
  });
}

void rms_norm_offset_row(int32_t type, const void* a, const void* b, const float* w1, void* sum, void* out, int64_t h,
                         float eps, int64_t c0, int64_t c1) {
  with_type(type, [&](auto e) {
    using T = decltype(e);
    rms_norm_offset_row_of(static_cast<const T*>(a), static_cast<const T*>(b), w1, static_cast<T*>(sum),
                           static_cast<T*>(out), h, eps, c0, c1);
  });
}

void gelu_tanh_mul(int32_t type, const void* gate, const void* up, void* out, int64_t n) {
  with_type(type, [&](auto e) {
    using T = decltype(e);
    gelu_tanh_mul_of(static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out), n);
  });
}

void rotary_row(int32_t type, const void* x, const void* cos, const void* sin, void* out, int64_t heads,
                int64_t head_dim) {
  with_type(type, [&](auto e) {
    using T = decltype(e);
    rotary_row_of(static_cast<const T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin),
                  static_cast<T*>(out), heads, head_dim);
  });
}

void add(int32_t type, const void* a, const void* b, void* out, int64_t n) {
  with_type(type, [&](auto e) {
    using T = decltype(e);
    add_of(static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n);
  });
}

void scale_to_float(int32_t type, const void* x, float scale, float* out, int64_t n) {
  with_type(type, [&](auto e) { scale_to_float_of(static_cast<const decltype(e)*>(x), scale, out, n); });
}

int32_t has_bf16_dot_entry() { return has_bf16_dot() ? 1 : 0; }

void attend_split(const AttendArgs* args) {
  with_type(args->type, [&](auto e) {
    if (args->tuning.attention_prefetch_l2) attend_split_of<decltype(e), true>(*args);
    else attend_split_of<decltype(e), false>(*args);
  });
}

constexpr fastdraft::KernelTable make_table() {
  fastdraft::KernelTable t{};
  t.version = fastdraft::kKernelTableVersion;
  t.size = sizeof(fastdraft::KernelTable);
  t.name = FASTDRAFT_VARIANT_NAME;
  t.tile_rows = kTile;
  t.quantize_row = quantize_row;
  t.woq_tiles = woq_tiles;
  t.woq_block_sums = woq_block_sums;
  t.dequant_tile = dequant_tile;
  t.rms_norm_row = rms_norm_row;
  t.silu_mul = silu_mul;
  t.rotary_row = rotary_row;
  t.add = add;
  t.scale_to_float = scale_to_float;
  t.has_bf16_dot = has_bf16_dot_entry;
  t.attend_split = attend_split;
  t.merge_splits = fastdraft::generic::merge_splits;  // per query row and head: plain C++ suffices
#if FASTDRAFT_SIMD_BF16
  t.dense_bf16_rows = dense_bf16_rows;
#else
  t.dense_bf16_rows = nullptr;  // has_bf16_dot() is 0
#endif
  t.argmax = argmax;
  t.block_cdf = fastdraft::generic::block_cdf;  // its 16 fp64 lanes vectorize as plain C++
  t.rms_norm_offset_row = rms_norm_offset_row;
  t.gelu_tanh_mul = gelu_tanh_mul;
  return t;
}

// Constant-initialized: no guard, nothing runs at load time.
constexpr fastdraft::KernelTable kTable = make_table();

}  // namespace

extern "C" __attribute__((visibility("default"))) const fastdraft::KernelTable* fastdraft_kernel_table(void) {
  return &kTable;
}
