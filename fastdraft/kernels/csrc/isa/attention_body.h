// Paged attention over one split of keys (kernel_table.h::attend_split) and, where the layer
// has bf16 dot products (FASTDRAFT_SIMD_BF16), the dense bf16 matmul; written once against the
// SIMD layer. fp32 math; the oracle (generic.h) sums in key order, these kernels in lanes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "elementwise_body.h"  // exp_approx
#include "half.h"
#include "kernel_table.h"

namespace {

using fastdraft::AttendArgs;
using simd::BF16;
using simd::Vf;
using simd::Vi;

constexpr int64_t kMaxHeadDim = 256;
// Software prefetch this many keys ahead, through the block table: a head's keys are one run
// per block, the blocks scattered through the pool, and the hardware prefetchers stop at every
// jump between blocks, so without it each run starts with a DRAM round trip (32 keys ahead
// timed better than 16 and 64). Into L1 or L2 as the driver's tuning says
// (Tuning::attention_prefetch_l2).
constexpr int64_t kKeysAhead = 32;

template <typename T>
struct KeyRows {  // where key (or value) row l of the sequence lies in the pool
  const T* base;
  const int64_t* table;
  int64_t block_stride, shift, mask, d;
  const T* operator()(int64_t l) const { return base + table[l >> shift] * block_stride + (l & mask) * d; }
};

// The choice of cache level is a template argument down the call chain: a run-time branch here
// would be taken on every prefetched line, in the attention's innermost loop.
template <bool L2, typename T>
inline void prefetch_row(const T* p, int64_t count) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < count * static_cast<int64_t>(sizeof(T)); b += 64) {
    if constexpr (L2) simd::prefetch_l2(c + b);
    else simd::prefetch_l1(c + b);
  }
}

// Scores [rows, n] of the query rows (fp32, scaled) against keys l0..l0+n-1: kLanes keys at a
// time, each row's kLanes dot products accumulated lane-wise over d and reduced together (one
// score per key whatever the rows of the call). bf16 keys are widened once per step, into kbuf.
template <bool L2, typename T>
void qk_scores(const float* q, const KeyRows<T>& k, int64_t rows, int64_t d, int64_t l0, int64_t n, float* scores) {
  constexpr int L = simd::kLanes;
  alignas(64) static thread_local float kbuf[L * kMaxHeadDim];
  alignas(64) static const float zero_row[kMaxHeadDim] = {};
  const int64_t vecs = d / L;
  for (int64_t lt = 0; lt < n; lt += L) {
    const int64_t nk = std::min<int64_t>(L, n - lt);
    for (int64_t l = lt + kKeysAhead; l < std::min(n, lt + kKeysAhead + L); ++l) prefetch_row<L2>(k(l0 + l), d);
    const float* kp[L];
    for (int64_t jk = 0; jk < L; ++jk) {
      if (jk >= nk) {
        kp[jk] = zero_row;
      } else if constexpr (std::is_same_v<T, float>) {
        kp[jk] = k(l0 + lt + jk);
      } else {
        const T* src = k(l0 + lt + jk);
        for (int64_t i = 0; i < vecs; ++i) simd::store(kbuf + jk * d + L * i, simd::load(src + L * i));
        kp[jk] = kbuf + jk * d;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * d;
      Vf acc[L];
      for (int jk = 0; jk < L; ++jk) acc[jk] = simd::zero();
      for (int64_t i = 0; i < vecs; ++i) {
        const Vf qv = simd::load(qr + L * i);
        for (int jk = 0; jk < L; ++jk) acc[jk] = simd::fmadd(qv, simd::load(kp[jk] + L * i), acc[jk]);
      }
      simd::store(scores + r * n + lt, simd::hsum_lanes(acc), nk);
    }
  }
}

// acc_out rows [0, NR), dims [c0, c0 + NV kLanes) = sum over each row's keys of p[r][l] v[l]:
// the NR x NV accumulators stay in registers while each V row is widened once for all NR rows.
template <int NR, int NV, bool L2, typename T>
void pv_block(const float* p, int64_t n, const KeyRows<T>& v, int64_t l0, int64_t c0, const int64_t* num_keys,
              int64_t n_all, int64_t n_any, float* acc_out, int64_t d) {
  constexpr int L = simd::kLanes;
  Vf acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = simd::zero();
  for (int64_t l = 0; l < n_any; ++l) {
    if (l + kKeysAhead < n_any) prefetch_row<L2>(v(l0 + l + kKeysAhead) + c0, L * NV);
    const T* vr = v(l0 + l) + c0;
    const bool is_shared = l < n_all;
    Vf pr[NR];
    for (int r = 0; r < NR; ++r) pr[r] = simd::set1(p[r * n + l]);
    for (int i = 0; i < NV; ++i) {
      const Vf vv = simd::load(vr + L * i);
      for (int r = 0; r < NR; ++r) {
        if (!is_shared && l >= num_keys[r]) continue;  // the row's own keys only
        acc[r][i] = simd::fmadd(pr[r], vv, acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) simd::store(acc_out + r * d + L * i, acc[r][i]);
}

// Calls fn(std::integral_constant<int, I>) for I = n, 1 <= n <= N.
template <int N, typename F>
inline void with_count(int64_t n, F&& fn) {
  if constexpr (N > 1) {
    if (n < N) return with_count<N - 1>(n, fn);
  }
  fn(std::integral_constant<int, N>{});
}

#if FASTDRAFT_SIMD_BF16
// ---- bf16 dot products: q K^T and P V on bf16 caches -----------------------------------------
// NR query rows (bf16 pairs, a dword per two dims) against a transposed key tile kt [pairs]
// [kLanes keys]: kLanes scores per row, two chains per row (fixed, so a row's result does not
// depend on how many rows share the call).
template <int NR>
FASTDRAFT_BF16_TARGET void qk_tile_bf16(const uint32_t* qp, int64_t pairs, const uint32_t* kt, float scale,
                                        float* scores, int64_t n, int64_t lt, int64_t nk) {
  constexpr int L = simd::kLanes;
  Vf acc0[NR], acc1[NR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) acc0[r] = acc1[r] = simd::zero();
  for (int64_t p = 0; p < pairs; p += 2) {
    const Vi k0 = simd::load_i(kt + L * p), k1 = simd::load_i(kt + L * (p + 1));
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      acc0[r] = simd::dot_bf16(acc0[r], k0, simd::set1_i32(static_cast<int32_t>(qp[r * pairs + p])));
      acc1[r] = simd::dot_bf16(acc1[r], k1, simd::set1_i32(static_cast<int32_t>(qp[r * pairs + p + 1])));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) simd::store(scores + r * n + lt, simd::mul(simd::add(acc0[r], acc1[r]), simd::set1(scale)), nk);
}

// Each tile of kLanes keys is transposed once (kLanes keys per vector) and shared by every
// query row, so no row pays a horizontal reduction per key.
template <bool L2>
void qk_scores_bf16(const uint32_t* qp, float scale, const KeyRows<BF16>& k, int64_t rows, int64_t d, int64_t l0,
                    int64_t n, float* scores) {
  constexpr int L = simd::kLanes;
  const int64_t pairs = d / 2;
  alignas(64) uint32_t kt[kMaxHeadDim / 2 * L];  // [pairs][L keys]
  for (int64_t lt = 0; lt < n; lt += L) {
    const int64_t nk = std::min<int64_t>(L, n - lt);
    for (int64_t l = lt + kKeysAhead; l < std::min<int64_t>(n, lt + kKeysAhead + L); ++l) prefetch_row<L2>(k(l0 + l), d);
    for (int64_t c = 0; c < pairs / L; ++c) {
      Vi tile[L];
      for (int jk = 0; jk < L; ++jk) tile[jk] = jk < nk ? simd::load_i(k(l0 + lt + jk) + 2 * L * c) : simd::zero_i();
      simd::transpose_i32(tile);
      for (int p = 0; p < L; ++p) simd::store_i(kt + L * (L * c + p), tile[p]);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 8)
      with_count<8>(std::min<int64_t>(8, rows - r0), [&](auto nr) {
        qk_tile_bf16<decltype(nr)::value>(qp + r0 * pairs, pairs, kt, scale, scores + r0 * n, n, lt, nk);
      });
  }
}

// NR query rows x NV kLanes dims of P V over key pairs: p_pairs [NR rows of num_pairs] bf16
// probabilities; a row stops at its own last pair (row_pairs), every row sees pairs_all.
template <int NR, int NV, bool L2>
FASTDRAFT_BF16_TARGET void pv_block_bf16(const uint32_t* p_pairs, int64_t num_pairs, const int64_t* row_pairs,
                                         int64_t pairs_all, int64_t pairs_any, const KeyRows<BF16>& v, int64_t l0,
                                         int64_t c0, int64_t n, float* acc_out, int64_t d) {
  constexpr int L = simd::kLanes;
  Vf acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = simd::zero();
  for (int64_t j = 0; j < pairs_any; ++j) {
    const BF16* va = v(l0 + 2 * j) + c0;
    if (2 * j + kKeysAhead + 1 < n)
      for (int64_t r = kKeysAhead; r <= kKeysAhead + 1; ++r) prefetch_row<L2>(v(l0 + 2 * j + r) + c0, L * NV);
    const bool has_b = 2 * j + 1 < n;
    // Keys 2j and 2j + 1 are never in different blocks: blocks hold an even number of rows.
    const BF16* vb = has_b ? v(l0 + 2 * j + 1) + c0 : va;
    Vi vv[NV];  // dims of keys 2j and 2j + 1, interleaved
    for (int h = 0; h < NV / 2; ++h)
      simd::interleave_i16(simd::load_i(va + 2 * L * h), has_b ? simd::load_i(vb + 2 * L * h) : simd::zero_i(),
                           vv[2 * h], vv[2 * h + 1]);
    const bool is_shared = j < pairs_all;
    for (int r = 0; r < NR; ++r) {
      if (!is_shared && j >= row_pairs[r]) continue;
      const Vi p = simd::set1_i32(static_cast<int32_t>(p_pairs[r * num_pairs + j]));
      for (int i = 0; i < NV; ++i) acc[r][i] = simd::dot_bf16(acc[r][i], vv[i], p);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) simd::store(acc_out + r * d + L * i, acc[r][i]);
}

// P V with bf16 dot products over pairs of keys: p_pairs [rows, num_pairs] (dword j = keys 2j,
// 2j + 1; zero past a row's last key) -> acc_out [rows, d] fp32; 4 kLanes dims per pass.
template <bool L2>
void pv_bf16(const uint32_t* p_pairs, int64_t num_pairs, const KeyRows<BF16>& v, int64_t rows, int64_t d, int64_t l0,
             int64_t n, const int64_t* num_keys, float* acc_out) {
  constexpr int L = simd::kLanes;
  std::vector<int64_t> row_pairs(rows);
  for (int64_t r = 0; r < rows; ++r) row_pairs[r] = (num_keys[r] + 1) / 2;
  for (int64_t r0 = 0; r0 < rows; r0 += simd::kPvRows) {
    const int64_t nr = std::min<int64_t>(simd::kPvRows, rows - r0);
    const auto [fewest, most] = std::minmax_element(row_pairs.begin() + r0, row_pairs.begin() + r0 + nr);
    const int64_t pairs_all = std::min(num_pairs, *fewest), pairs_any = *most;
    for (int64_t c0 = 0; c0 < d; c0 += 4 * L)
      with_count<simd::kPvRows>(nr, [&](auto nr_tag) {
        auto block = [&](auto nv_tag) {
          pv_block_bf16<decltype(nr_tag)::value, decltype(nv_tag)::value, L2>(
              p_pairs + r0 * num_pairs, num_pairs, row_pairs.data() + r0, pairs_all, pairs_any, v, l0, c0, n,
              acc_out + r0 * d + c0, d);
        };
        if (d - c0 >= 4 * L) block(std::integral_constant<int, 4>{});
        else block(std::integral_constant<int, 2>{});  // d % (2 kLanes) == 0 on this path
      });
  }
}

// out[m, r] = bf16(sum_k x[m, k] w[r, k] + bias[r]) for M rows of x and R rows of w from n0:
// R x M accumulators, one 64-byte weight line feeding M dot products. Output (m, n) is always
// the same accumulation over k in 2 kLanes steps, reduced and rounded once (+ bias in fp32):
// row-invariant whatever M. Each step prefetches the same line of the next R rows into L2: the
// R short row streams leave the hardware prefetcher behind, and decode would wait on DRAM.
// Plain PyTorch twin: fastdraft/kernels/fused.py::reference_dense_linear.
template <int M, int R>
FASTDRAFT_BF16_TARGET void dense_rows(const uint16_t* w, int64_t k, const uint16_t* x, const float* bias,
                                      uint16_t* out, int64_t n, int64_t n0) {
  constexpr int L = simd::kLanes;
  Vf acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = simd::zero();
  for (int64_t c = 0; c < k; c += 2 * L) {
    Vi xv[M];
    for (int m = 0; m < M; ++m) xv[m] = simd::load_i(x + m * k + c);
    for (int i = 0; i < R; ++i) {
      simd::prefetch_l2(w + (n0 + R + i) * k + c);
      const Vi wv = simd::load_i(w + (n0 + i) * k + c);
      for (int m = 0; m < M; ++m) acc[i][m] = simd::dot_bf16(acc[i][m], wv, xv[m]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m)
      out[m * n + n0 + i] = fastdraft::half::float_to_bf16(simd::hsum(acc[i][m]) + (bias ? bias[n0 + i] : 0.0f));
}

// Rows [r0, r1) of W for num_x_rows (<= 8) rows of x: R weight rows share each x line (more when
// x has few rows), the rest one by one; each output's arithmetic is the same either way.
inline void dense_bf16_rows(const uint16_t* w, int64_t k, const uint16_t* x, int64_t num_x_rows, const float* bias,
                            uint16_t* out, int64_t n, int64_t r0, int64_t r1) {
  with_count<8>(num_x_rows, [&](auto m_tag) {
    constexpr int M = decltype(m_tag)::value, R = M <= 2 ? 8 : 4;
    int64_t r = r0;
    for (; r + R <= r1; r += R) dense_rows<M, R>(w, k, x, bias, out, n, r);
    for (; r < r1; ++r) dense_rows<M, 1>(w, k, x, bias, out, n, r);
  });
}
#endif  // FASTDRAFT_SIMD_BF16

inline bool has_bf16_dot() {
#if FASTDRAFT_SIMD_BF16
  return simd::has_bf16_dot();
#else
  return false;
#endif
}

// One split (keys l0..l1-1) for `rows` query rows; row r sees only its first num_keys[r] keys.
// Writes each row's max, exp-sum and unnormalised P V.
template <typename T, bool L2>
void attend_split_of(const AttendArgs& A) {
  constexpr int L = simd::kLanes;
  const int64_t d = A.head_dim, rows = A.rows, l0 = A.l0, n = A.l1 - A.l0;
  const KeyRows<T> k{static_cast<const T*>(A.k_base), A.block_table, A.block_stride, A.block_shift,
                     (int64_t{1} << A.block_shift) - 1, d};
  const KeyRows<T> v{static_cast<const T*>(A.v_base), A.block_table, A.block_stride, A.block_shift,
                     (int64_t{1} << A.block_shift) - 1, d};
  static thread_local std::vector<float> scores_buf;
  if (static_cast<int64_t>(scores_buf.size()) < rows * n) scores_buf.resize(rows * n);
  float* scores = scores_buf.data();
  bool is_bf16 = false;  // bf16 dot products for q K^T and P V (the driver passes q_bf16 only where has_bf16_dot)
#if FASTDRAFT_SIMD_BF16
  static thread_local std::vector<uint16_t> probs_bf16;
  const int64_t num_pairs = (n + 1) / 2;
  if constexpr (std::is_same_v<T, BF16>) {
    is_bf16 = A.q_bf16 != nullptr;
    if (is_bf16) {
      qk_scores_bf16<L2>(reinterpret_cast<const uint32_t*>(A.q_bf16), A.scale, k, rows, d, l0, n, scores);
      probs_bf16.assign(rows * 2 * num_pairs, 0);  // zero past each row's last key (an odd one pairs with 0)
    }
  }
#endif
  if (!is_bf16) qk_scores<L2>(A.qf, k, rows, d, l0, n, scores);
  // Softmax numerators, each row over its own first num_keys[r] keys.
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * n;
    const int64_t nr = A.num_keys[r];
    Vf vmax = simd::set1(-INFINITY);
    for (int64_t l = 0; l < nr; l += L) vmax = simd::blend_below(vmax, simd::max(vmax, simd::load(sr + l, nr - l)), nr - l);
    const float m = simd::hmax(vmax);
    Vf vsum = simd::zero();
    for (int64_t l = 0; l < nr; l += L) {
      Vf e = simd::keep_below(exp_approx(simd::sub(simd::load(sr + l, nr - l), simd::set1(m))), nr - l);
#if FASTDRAFT_SIMD_BF16
      if (is_bf16) {  // P V multiplies bf16 probabilities: normalise by the same values
        e = simd::round_bf16(e);
        simd::store_bf16_exact(probs_bf16.data() + r * 2 * num_pairs + l, e, nr - l);
      }
#endif
      if (!is_bf16) simd::store(sr + l, e, nr - l);
      vsum = simd::add(vsum, e);
    }
    A.max_out[r] = m;
    A.sum_out[r] = simd::hsum(vsum);
  }
#if FASTDRAFT_SIMD_BF16
  if constexpr (std::is_same_v<T, BF16>) {
    if (is_bf16)
      return pv_bf16<L2>(reinterpret_cast<const uint32_t*>(probs_bf16.data()), num_pairs, v, rows, d, l0, n,
                         A.num_keys, A.acc_out);
  }
#endif
  // P V: up to kPvRows rows x 4 kLanes dims of accumulators per pass over the split's values.
  for (int64_t r0 = 0; r0 < rows; r0 += simd::kPvRows) {
    const int64_t nr = std::min<int64_t>(simd::kPvRows, rows - r0);
    // Keys every row of the block sees / any row sees.
    const auto [fewest, most] = std::minmax_element(A.num_keys + r0, A.num_keys + r0 + nr);
    const int64_t n_all = std::min(n, *fewest), n_any = *most;
    for (int64_t c0 = 0; c0 < d; c0 += 4 * L)
      with_count<simd::kPvRows>(nr, [&](auto nr_tag) {
        with_count<4>((d - c0) / L, [&](auto nv_tag) {  // d % kLanes == 0
          pv_block<decltype(nr_tag)::value, decltype(nv_tag)::value, L2>(scores + r0 * n, n, v, l0, c0,
                                                                          A.num_keys + r0, n_all, n_any,
                                                                          A.acc_out + r0 * d + c0, d);
        });
      });
  }
}

}  // namespace
