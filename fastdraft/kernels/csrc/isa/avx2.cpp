// The `avx2` variant: AVX2 + FMA + F16C (AMD Zen 1-3, Intel Haswell onward), built with
// -mavx2 -mfma -mf16c. gcc: no temporary expression replacement here, or it emits every
// product of an unrolled INT4 step before the sums that consume them and the 16 registers
// spill, slowing the compute-bound prefill most.
#if !defined(__clang__)
#pragma GCC optimize("no-tree-ter")
#endif
#include "simd_avx2.h"
#define FASTDRAFT_VARIANT_NAME "avx2"
#include "table_body.h"
