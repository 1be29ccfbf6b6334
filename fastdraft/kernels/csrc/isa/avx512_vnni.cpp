// The `avx512_vnni` variant: AVX-512 (F, BW, VL, DQ) with VNNI (Intel Ice Lake / Sapphire
// Rapids onward, AMD Zen 4 onward); bf16 dot products where the CPU has AVX512-BF16.
#include "simd_avx512.h"
#define FASTDRAFT_VARIANT_NAME "avx512_vnni"
#include "table_body.h"
