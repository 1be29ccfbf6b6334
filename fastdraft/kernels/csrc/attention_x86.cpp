// Paged attention (AVX-512, AVX512-BF16 where the CPU has it): the new query tokens of a flat
// batch of sequences over their cached keys and values in a block pool, split into (sequence,
// kv head, key block) items that any thread may run, and a finish that merges the blocks'
// partial softmaxes (flash-decoding).
// Reference twin: fastdraft/kernels/fused.py::reference_paged_attention.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd_x86.h"
#include "x86_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

using namespace fastdraft::simd;

namespace {

constexpr int64_t kKeysPerSplit = 256;  // fixed (not per thread count): results are deterministic
// Software prefetch this many keys ahead in q K^T and P V, through the block table. A head's
// keys are one run per block, the blocks scattered through the pool, and the hardware
// prefetchers stop at every 4 KiB boundary and every jump between blocks, so without it each
// 16 keys (D=128) start with a DRAM round trip. Into L1 on Intel; into L2 on AMD Zen 4,
// where L1 prefetches stall on the few L1 miss buffers. One layer over ~1K cold keys runs
// 1.3-1.5x faster with it; 32 keys ahead beats 16 and 64.
constexpr int64_t kKeysAhead = 32;

// Prefetch `count` bf16 values from p into L1 (L2_PREFETCH: into L2). The choice is a template
// argument down the attention's call chain: a run-time branch here makes the attention 10-20%
// slower.
template <bool L2_PREFETCH>
inline void prefetch_row(const at::BFloat16* p, int64_t count) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < 2 * count; b += 64) _mm_prefetch(c + b, L2_PREFETCH ? _MM_HINT_T1 : _MM_HINT_T0);
}

// Where key (or value) row l of a sequence lies: in the blocks of a paged pool, found through
// its block table.
template <typename T>
struct BlockRows {
  const T* base;         // this layer's pool at this kv head: block b's row i is base + b * block_stride + i * d
  const int64_t* table;  // the sequence's block ids
  int64_t block_stride, row_stride, shift, mask;  // block_size = 1 << shift, mask = block_size - 1
  const T* operator()(int64_t l) const { return base + table[l >> shift] * block_stride + (l & mask) * row_stride; }
};

// Scores of `rows` query rows against keys l0..l0+n-1, fp32 math: scores [rows, n].
template <typename T, typename Rows>
void qk_scores(const float* q, const Rows& k, int64_t rows, int64_t d, int64_t l0, int64_t n, float* scores) {
  const int64_t vecs = d / 16;
  for (int64_t l = 0; l < n; ++l) {
    const T* kr = k(l0 + l);
    __m512 kv[16];
    for (int64_t i = 0; i < vecs; ++i) kv[i] = load16(kr + 16 * i, 0xffff);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * d;
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
      for (int64_t i = 1; i < vecs; ++i) s = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * i), kv[i], s);
      scores[r * n + l] = _mm512_reduce_add_ps(s);
    }
  }
}

// In-register transpose of a 16x16 matrix of 32-bit elements (r[i] lane j -> r[j] lane i).
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + m]: rows 4i..4i+3, column 4L + m of each 128-bit lane L
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i v = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88), w = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xDD);
    r[m] = _mm512_shuffle_i32x4(v, v2, 0x88);
    r[8 + m] = _mm512_shuffle_i32x4(v, v2, 0xDD);
    r[4 + m] = _mm512_shuffle_i32x4(w, w2, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(w, w2, 0xDD);
  }
}

// NR query rows (bf16 pairs, one dword per two dims) against a transposed key tile
// kt [pairs][16 keys]: 16 scores per row, two accumulator chains per row (fixed, so a row's
// result does not depend on how many rows share the call).
template <int NR>
__attribute__((target("avx512bf16"))) void qk_tile_bf16(const uint32_t* qp, int64_t pairs, const uint32_t* kt,
                                                         float scale, float* scores, int64_t n, int64_t lt,
                                                         __mmask16 mask) {
  // Fully unrolled over rows, so the accumulators live in registers (not stack arrays).
  __m512 acc0[NR], acc1[NR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    acc0[r] = _mm512_setzero_ps();
    acc1[r] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; p += 2) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + 16 * p);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + 16 * (p + 1));
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      acc0[r] = _mm512_dpbf16_ps(acc0[r], k0, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * pairs + p])));
      acc1[r] = _mm512_dpbf16_ps(acc1[r], k1, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * pairs + p + 1])));
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
    _mm512_mask_storeu_ps(scores + r * n + lt, mask, _mm512_mul_ps(_mm512_add_ps(acc0[r], acc1[r]), vscale));
}

// bf16 scores with AVX512-BF16 dot products: each 16-key tile is transposed once (to 16 keys
// per vector) and shared by every query row, so no row pays a horizontal reduction per key.
template <bool L2_PREFETCH, typename Rows>
void qk_scores_bf16(const uint32_t* qp, float scale, const Rows& k, int64_t rows, int64_t d, int64_t l0, int64_t n,
                    float* scores) {
  const int64_t pairs = d / 2;
  alignas(64) uint32_t kt[128 * 16];  // [pairs][16 keys], d <= 256
  for (int64_t lt = 0; lt < n; lt += 16) {
    const int64_t nk = std::min<int64_t>(16, n - lt);
    for (int64_t j = lt + kKeysAhead; j < std::min<int64_t>(n, lt + kKeysAhead + 16); ++j)
      prefetch_row<L2_PREFETCH>(k(l0 + j), d);
    for (int64_t c = 0; c < pairs / 16; ++c) {
      __m512i tile[16];
      for (int j = 0; j < 16; ++j)
        tile[j] = j < nk ? _mm512_loadu_si512(k(l0 + lt + j) + 32 * c) : _mm512_setzero_si512();
      transpose16x16(tile);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(kt + 16 * (16 * c + p), tile[p]);
    }
    const __mmask16 mask = tail_mask(nk);
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      const uint32_t* qr = qp + r0 * pairs;
      float* sr = scores + r0 * n;
      switch (std::min<int64_t>(8, rows - r0)) {
        case 1: qk_tile_bf16<1>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 2: qk_tile_bf16<2>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 3: qk_tile_bf16<3>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 4: qk_tile_bf16<4>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 5: qk_tile_bf16<5>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 6: qk_tile_bf16<6>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        case 7: qk_tile_bf16<7>(qr, pairs, kt, scale, sr, n, lt, mask); break;
        default: qk_tile_bf16<8>(qr, pairs, kt, scale, sr, n, lt, mask); break;
      }
    }
  }
}

// One block of NR query rows x NV * 16 dims of P V (bf16 dot products over key pairs). The
// sizes are compile-time so the NR x NV accumulators stay in registers. p_pairs [NR rows of
// num_pairs]; a row stops at its own last key pair (row_pairs), every row sees pairs_all.
template <int NR, int NV, bool L2_PREFETCH, typename Rows>
__attribute__((target("avx512bf16"))) void pv_block(const uint32_t* p_pairs, int64_t num_pairs,
                                                    const int64_t* row_pairs, int64_t pairs_all, int64_t pairs_any,
                                                    const Rows& v, int64_t l0, int64_t c0, int64_t n,
                                                    float* acc_out, int64_t d) {
  const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                          39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  __m512 acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs_any; ++j) {
    const at::BFloat16* va = v(l0 + 2 * j) + c0;
    if (2 * j + kKeysAhead + 1 < n)  // this block's dims of the two rows kKeysAhead keys on
      for (int64_t r = kKeysAhead; r <= kKeysAhead + 1; ++r) prefetch_row<L2_PREFETCH>(v(l0 + 2 * j + r) + c0, 16 * NV);
    const bool has_b = 2 * j + 1 < n;
    // Keys 2j and 2j + 1 are never in different blocks: blocks hold an even number of rows.
    const at::BFloat16* vb = has_b ? v(l0 + 2 * j + 1) + c0 : va;
    __m512i vv[NV];  // dims 16i..16i+15 of keys 2j and 2j+1, interleaved
    for (int h = 0; h < NV / 2; ++h) {
      const __m512i a = _mm512_loadu_si512(va + 32 * h);
      const __m512i b = has_b ? _mm512_loadu_si512(vb + 32 * h) : _mm512_setzero_si512();
      vv[2 * h] = _mm512_permutex2var_epi16(a, idx_lo, b);
      vv[2 * h + 1] = _mm512_permutex2var_epi16(a, idx_hi, b);
    }
    const bool is_shared = j < pairs_all;
    for (int r = 0; r < NR; ++r) {
      if (!is_shared && j >= row_pairs[r]) continue;
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(p_pairs[r * num_pairs + j]));
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)vv[i], p);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc_out + r * d + 16 * i, acc[r][i]);
}

template <int NV, bool L2_PREFETCH, typename Rows>
void pv_rows(int64_t nr, const uint32_t* pp, int64_t num_pairs, const int64_t* row_pairs, int64_t pairs_all,
             int64_t pairs_any, const Rows& v, int64_t l0, int64_t c0, int64_t n, float* out, int64_t d) {
  switch (nr) {
    case 1: pv_block<1, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
    case 2: pv_block<2, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
    case 3: pv_block<3, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
    case 4: pv_block<4, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
    case 5: pv_block<5, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
    default:
      pv_block<6, NV, L2_PREFETCH>(pp, num_pairs, row_pairs, pairs_all, pairs_any, v, l0, c0, n, out, d);
      break;
  }
}

// P V with AVX512-BF16 dot products over pairs of keys: bf16 probabilities p_pairs [rows,
// num_pairs] (dword j = keys 2j, 2j+1; zero past a row's last key) -> acc_out [rows, d] fp32.
// Two V rows are interleaved once (16 dims x 2 keys per vector) and feed up to 6 query rows,
// 64 dims at a time. A row stops at its own last key pair; an odd last key is paired with a
// zero row.
template <bool L2_PREFETCH, typename Rows>
void pv_bf16(const uint32_t* p_pairs, int64_t num_pairs, const Rows& v, int64_t rows, int64_t d, int64_t l0, int64_t n,
             const int64_t* num_keys, float* acc_out) {
  std::vector<int64_t> row_pairs(rows);
  for (int64_t r = 0; r < rows; ++r) row_pairs[r] = (num_keys[r] + 1) / 2;
  constexpr int kRows = 6;  // 6 rows x 4 vectors of accumulators fit the 32 vector registers
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min<int64_t>(kRows, rows - r0);
    int64_t pairs_all = num_pairs, pairs_any = 0;
    for (int64_t r = 0; r < nr; ++r) {
      pairs_all = std::min(pairs_all, row_pairs[r0 + r]);
      pairs_any = std::max(pairs_any, row_pairs[r0 + r]);
    }
    const uint32_t* pp = p_pairs + r0 * num_pairs;
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      float* out = acc_out + r0 * d + c0;
      if (d - c0 >= 64)
        pv_rows<4, L2_PREFETCH>(nr, pp, num_pairs, row_pairs.data() + r0, pairs_all, pairs_any, v, l0, c0, n, out, d);
      else  // d % 32 == 0 on this path: a last 32 dims
        pv_rows<2, L2_PREFETCH>(nr, pp, num_pairs, row_pairs.data() + r0, pairs_all, pairs_any, v, l0, c0, n, out, d);
    }
  }
}

// One split (keys l0..l1-1) for `rows` query rows; row r sees only its first num_keys[r]
// keys of the split (0: none). Writes each row's max, exp-sum and unnormalised P V.
template <typename T, bool L2_PREFETCH, typename Rows>
void attend_split(const float* q, const uint32_t* q_pairs, float scale, const Rows& k, const Rows& v, int64_t rows,
                  int64_t d, int64_t l0, int64_t l1, const int64_t* num_keys, float* max_out, float* sum_out,
                  float* acc_out) {
  const int64_t n = l1 - l0;
  std::vector<float> scores(rows * n);
  const int64_t vecs = d / 16;
  const bool is_bf16 = q_pairs != nullptr;  // AVX512-BF16 dot products for q K^T and P V
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (is_bf16) qk_scores_bf16<L2_PREFETCH>(q_pairs, scale, k, rows, d, l0, n, scores.data());
  }
  if (!is_bf16) qk_scores<T>(q, k, rows, d, l0, n, scores.data());
  // bf16 path: probabilities rounded to bf16 and packed in key pairs for pv_bf16, zero past
  // each row's last key (an odd last key pairs with zero).
  const int64_t num_pairs = (n + 1) / 2;
  std::vector<uint16_t> probs_bf16(is_bf16 ? rows * 2 * num_pairs : 0);
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores.data() + r * n;
    const int64_t nr = num_keys[r];
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t l = 0; l < nr; l += 16) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(nr - l), sr + l));
    const float m = _mm512_reduce_max_ps(vmax);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t l = 0; l < nr; l += 16) {
      const __mmask16 mk = tail_mask(nr - l);
      __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sr + l), _mm512_set1_ps(m))));
      if (is_bf16) {
        e = round_bf16(e);  // P V multiplies bf16 probabilities; normalise by the same values
        // e is already bf16-valued: store its top halves (store16 would round a second time,
        // ~1.1x slower for a 5-token verification).
        _mm256_mask_storeu_epi16(probs_bf16.data() + r * 2 * num_pairs + l, mk,
                                 _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(e), 16)));
      } else {
        _mm512_mask_storeu_ps(sr + l, mk, e);
      }
      vsum = _mm512_add_ps(vsum, e);
    }
    max_out[r] = m;
    sum_out[r] = _mm512_reduce_add_ps(vsum);
  }
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (is_bf16) {
      pv_bf16<L2_PREFETCH>(reinterpret_cast<const uint32_t*>(probs_bf16.data()), num_pairs, v, rows, d, l0, n,
                           num_keys, acc_out);
      return;
    }
  }
  // out = P V: each V row is converted once and feeds up to 6 query rows, 64 dims at a time
  // (6 x 4 accumulators fit the 32 vector registers). A row stops at its own last key.
  constexpr int kRows = 6, kVecs = 4;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min<int64_t>(kRows, rows - r0);
    int64_t n_all = n, n_any = 0;  // keys every row of the block sees / any row sees
    for (int64_t r = 0; r < nr; ++r) {
      n_all = std::min(n_all, num_keys[r0 + r]);
      n_any = std::max(n_any, num_keys[r0 + r]);
    }
    for (int64_t i0 = 0; i0 < vecs; i0 += kVecs) {
      const int64_t nv = std::min<int64_t>(kVecs, vecs - i0);
      __m512 acc[kRows][kVecs];
      for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < kVecs; ++i) acc[r][i] = _mm512_setzero_ps();
      for (int64_t l = 0; l < n_any; ++l) {
        const T* vr = v(l0 + l) + 16 * i0;
        __m512 vv[kVecs];
        for (int i = 0; i < kVecs; ++i) vv[i] = i < nv ? load16(vr + 16 * i, 0xffff) : _mm512_setzero_ps();
        const bool is_shared = l < n_all;
        for (int r = 0; r < kRows; ++r) {
          if (r >= nr) break;
          if (!is_shared && l >= num_keys[r0 + r]) continue;
          const __m512 p = _mm512_set1_ps(scores[(r0 + r) * n + l]);
          for (int i = 0; i < kVecs; ++i) acc[r][i] = _mm512_fmadd_ps(p, vv[i], acc[r][i]);
        }
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(acc_out + (r0 + r) * d + 16 * (i0 + i), acc[r][i]);
    }
  }
}

}  // namespace

namespace {

// Merges one query row's per-split partial softmaxes (flash-decoding) into out + off:
// split sp has max m_sp = max_of(sp), exp-sum sum_of(sp) and unnormalised P V acc_of(sp).
template <typename MaxOf, typename SumOf, typename AccOf>
void merge_splits(int64_t num_splits, const MaxOf& max_of, const SumOf& sum_of, const AccOf& acc_of, int64_t d,
                  const torch::Tensor& out, int64_t off) {
  float m = -INFINITY;
  for (int64_t sp = 0; sp < num_splits; ++sp) m = std::max(m, max_of(sp));
  float total = 0.0f;
  __m512 acc[16];
  for (int64_t i = 0; i < d / 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t sp = 0; sp < num_splits; ++sp) {
    const float w = std::exp(max_of(sp) - m);
    total += w * sum_of(sp);
    const __m512 wv = _mm512_set1_ps(w);
    const float* a = acc_of(sp);
    for (int64_t i = 0; i < d / 16; ++i) acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(a + 16 * i), acc[i]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  if (out.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>() + off;
    for (int64_t i = 0; i < d / 16; ++i) store16(o + 16 * i, _mm512_mul_ps(acc[i], inv), 0xffff);
  } else {
    at::BFloat16* o = out.data_ptr<at::BFloat16>() + off;
    for (int64_t i = 0; i < d / 16; ++i) store16(o + 16 * i, _mm512_mul_ps(acc[i], inv), 0xffff);
  }
}

}  // namespace

int64_t fastdraft::PagedAttentionPlan::q_offset(int64_t t, int64_t g) const {
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t s = token_seq[t], group = heads / kv_heads, num_new = qsl[s + 1] - qsl[s];
  return (qsl[s] * heads + g * num_new * group + (t - qsl[s]) * group) * head_dim;
}

void fastdraft::paged_attention_replan(PagedAttentionPlan& p, at::ScalarType dtype, int64_t heads,
                                       const torch::Tensor& k_blocks, const torch::Tensor& v_blocks,
                                       const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                                       const torch::Tensor& context_lens, double scale) {
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
  TORCH_CHECK(block_size >= 2 && (block_size & (block_size - 1)) == 0, "block_size must be a power of two");
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "query_start_loc must be [num_seqs + 1] and block_tables [num_seqs, max_blocks]");
  const int64_t group = heads / kv_heads;
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t num_tokens = qsl[num_seqs];
  TORCH_CHECK(qsl[0] == 0 && num_tokens >= 1, "query_start_loc must run from 0 to T");
  p.k_blocks = k_blocks, p.v_blocks = v_blocks, p.block_tables = block_tables;
  p.query_start_loc = query_start_loc, p.context_lens = context_lens;
  p.scale = static_cast<float>(scale);
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
  p.is_bf16_dot = dtype == at::kBFloat16 && d % 32 == 0 && fastdraft::cpu_has_avx512_bf16();
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
  const __m512 vscale = _mm512_set1_ps(p.scale);
  // As (q.to(float) * scale) would: one fp32 product per element.
  with_dtype(p.q_rows, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (int64_t t = 0; t < p.num_tokens; ++t)
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t off = p.q_offset(t, g);
        const T* in = p.q_rows.data_ptr<T>() + off;
        float* out = p.qf.data_ptr<float>() + off;
        for (int64_t i = 0; i < group_d; i += 16) store16(out + i, _mm512_mul_ps(load16(in + i, 0xffff), vscale), 0xffff);
      }
  });
}

void fastdraft::paged_attention_items(PagedAttentionPlan& p, int64_t i0, int64_t i1) {
  const int64_t d = p.head_dim, group = p.heads / p.kv_heads;
  const int64_t* qsl = p.query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = p.context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = p.block_tables.size(1);
  const bool is_l2 = fastdraft::is_amd_cpu();  // into L2 there, see kKeysAhead
  std::vector<int64_t> num_keys;
  for (int64_t it = i0; it < i1; ++it) {
    const PagedItem& item = p.items[it];
    const int64_t s = item.seq, len = ctx[s], num_new = qsl[s + 1] - qsl[s];
    const int64_t l0 = item.split * kKeysPerSplit, l1 = std::min(len, l0 + kKeysPerSplit);
    num_keys.resize(item.rows);
    for (int64_t r = 0; r < item.rows; ++r)
      num_keys[r] = std::clamp<int64_t>(len - num_new + 1 + (item.row0 + r) / group - l0, 0, l1 - l0);
    const int64_t q_off = p.q_offset(qsl[s], item.kv_head) + item.row0 * d;
    float* mo = p.pmax.data() + item.partial;
    float* so = p.psum.data() + item.partial;
    float* ao = p.pacc.data() + item.partial * d;
    const int64_t* table = p.block_tables.data_ptr<int64_t>() + s * max_blocks;
    const int64_t block_stride = p.kv_heads * p.block_size * d, head_off = item.kv_head * p.block_size * d;
    with_dtype(p.q_rows, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      const BlockRows<T> k_rows{p.k_blocks.data_ptr<T>() + head_off, table, block_stride, d, p.shift, p.block_size - 1};
      const BlockRows<T> v_rows{p.v_blocks.data_ptr<T>() + head_off, table, block_stride, d, p.shift, p.block_size - 1};
      const float* qf = p.is_bf16_dot ? nullptr : p.qf.data_ptr<float>() + q_off;
      const uint32_t* pairs = nullptr;
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (p.is_bf16_dot) pairs = reinterpret_cast<const uint32_t*>(p.q_rows.data_ptr<at::BFloat16>() + q_off);
      }
      const float sc = p.is_bf16_dot ? p.scale : 1.0f;
      if (is_l2)
        attend_split<T, true>(qf, pairs, sc, k_rows, v_rows, item.rows, d, l0, l1, num_keys.data(), mo, so, ao);
      else
        attend_split<T, false>(qf, pairs, sc, k_rows, v_rows, item.rows, d, l0, l1, num_keys.data(), mo, so, ao);
    });
  }
}

namespace {

// Query heads [j0, j1) of tokens [t0, t1) into out [T, heads * D].
void paged_finish(const fastdraft::PagedAttentionPlan& p, const torch::Tensor& out, int64_t t0, int64_t t1, int64_t j0,
                  int64_t j1) {
  const int64_t d = p.head_dim, group = p.heads / p.kv_heads;
  const int64_t* qsl = p.query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = p.context_lens.data_ptr<int64_t>();
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t s = p.token_seq[t], tl = t - qsl[s], len = ctx[s], num_new = qsl[s + 1] - qsl[s];
    const int64_t splits = (len + kKeysPerSplit - 1) / kKeysPerSplit;
    const int64_t row_splits = (len - num_new + 1 + tl + kKeysPerSplit - 1) / kKeysPerSplit;
    for (int64_t h = j0; h < j1; ++h) {
      const int64_t g = h / group, r = tl * group + h % group;
      const fastdraft::PagedItem* first = p.items.data() + p.seq_item[s] + g * splits;
      const auto row = [&](int64_t sp) { return first[sp].partial + r - first[sp].row0; };
      merge_splits(
          row_splits, [&](int64_t sp) { return p.pmax[row(sp)]; }, [&](int64_t sp) { return p.psum[row(sp)]; },
          [&](int64_t sp) { return p.pacc.data() + row(sp) * d; }, d, out, (t * p.heads + h) * d);
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
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_blocks, torch::Tensor v_blocks, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == k_blocks.scalar_type(), "q must be [T, H, D] in the blocks' dtype");
  const auto qc = q.contiguous();
  fastdraft::PagedAttentionPlan p;
  fastdraft::paged_attention_replan(p, qc.scalar_type(), qc.size(1), k_blocks, v_blocks, block_tables,
                                    query_start_loc, context_lens, scale);
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
