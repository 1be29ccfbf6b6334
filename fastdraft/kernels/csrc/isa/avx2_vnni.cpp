// The `avx2_vnni` variant: avx2 with the VEX-encoded vpdpbusd of AVX-VNNI (Intel Alder Lake
// and Sapphire Rapids onward, AMD Zen 5), built with -mavx2 -mfma -mf16c -mavxvnni.
#if !defined(__clang__)
#pragma GCC optimize("no-tree-ter")
#endif
#include "simd_avx2.h"
#define FASTDRAFT_VARIANT_NAME "avx2_vnni"
#include "table_body.h"
