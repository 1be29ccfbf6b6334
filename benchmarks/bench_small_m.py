"""The small-M INT4 GEMM (4-32 rows: verification and batched decode) against the CPU's
integer multiply-add peak, per kernel variant.

For every variant this CPU runs (``--isas``), one thread multiplies M activation rows by an
INT4 weight that stays in L2 (``--n`` x ``--k``, symmetric, ``--group-size``), so the kernel,
not memory, sets the pace, and reports giga multiply-adds per second (M x N x K over the median
call time) beside the same thread's peak for that variant's dot-product instruction, measured
in the same run by a loop of independent instructions compiled on the spot:

* ``avx2``: ``vpmaddubsw`` (32 u8 x s8 products per instruction; the kernel also spends a
  ``vpaddw`` on each and a ``vpmaddwd`` per four chunks);
* ``avx2_vnni``: the VEX ``vpdpbusd`` on ymm (32 products);
* ``avx512_vnni``: ``vpdpbusd`` on zmm (64 products).

    python benchmarks/bench_small_m.py --rows 1,4,8,16,32
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fastdraft.formats import quantize
from fastdraft.kernels.build import cpu_model, load_cpu_kernels, runnable_isas
from fastdraft.kernels.x86 import X86WoqKernel

# Twelve independent accumulators: enough to cover the instruction's latency on any core.
_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#define ACC 12
// Unrolled, so that the accumulators live in registers (a run-time index would put them on the stack).
#define LOOP(body) for (long i = 0; i < iters; ++i) { _Pragma("GCC unroll 12") for (int j = 0; j < ACC; ++j) { body; } }
extern "C" long peak_avx2(long iters) {
  __m256i a[ACC], u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(-2);
  for (int j = 0; j < ACC; ++j) a[j] = _mm256_set1_epi16(j);
  LOOP(asm volatile("vpmaddubsw %1, %2, %0" : "=x"(a[j]) : "x"(s), "x"(u), "0"(a[j])));
  long r = 0; for (int j = 0; j < ACC; ++j) r += _mm256_extract_epi16(a[j], 0); return r;
}
extern "C" long peak_avx2_vnni(long iters) {
  __m256i a[ACC], u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(-2);
  for (int j = 0; j < ACC; ++j) a[j] = _mm256_set1_epi32(j);
  LOOP(asm volatile("%{vex%} vpdpbusd %1, %2, %0" : "+x"(a[j]) : "x"(s), "x"(u)));
  long r = 0; for (int j = 0; j < ACC; ++j) r += _mm256_extract_epi32(a[j], 0); return r;
}
extern "C" long peak_avx512_vnni(long iters) {
  __m512i a[ACC], u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
  for (int j = 0; j < ACC; ++j) a[j] = _mm512_set1_epi32(j);
  LOOP(asm volatile("vpdpbusd %1, %2, %0" : "+v"(a[j]) : "v"(s), "v"(u)));
  long r = 0; for (int j = 0; j < ACC; ++j) r += _mm_cvtsi128_si32(_mm512_castsi512_si128(a[j])); return r;
}
"""
_PRODUCTS = {"avx2": 32, "avx2_vnni": 32, "avx512_vnni": 64}
_FLAGS = {"avx2": ["-mavx2"], "avx2_vnni": ["-mavx2", "-mavxvnni"],
          "avx512_vnni": ["-mavx2", "-mavx512f", "-mavx512bw", "-mavx512vnni"]}


def peak_gmacs(isa: str, folder: Path, iters: int = 20_000_000) -> float:
    """Giga multiply-adds per second of ``isa``'s dot-product instruction on one thread."""
    src = folder / "peak.cpp"
    src.write_text(_PEAK_SOURCE)
    lib = folder / f"peak_{isa}.so"
    flags = sorted({f for flags in _FLAGS.values() for f in flags})
    subprocess.run(["c++", "-O3", "-shared", "-fPIC", *flags, str(src), "-o", str(lib)], check=True)
    fn = getattr(ctypes.CDLL(str(lib)), f"peak_{isa}")
    fn.argtypes, fn.restype = [ctypes.c_long], ctypes.c_long
    fn(iters // 20)  # warm-up: clocks up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn(iters)
        times.append(time.perf_counter() - start)
    return iters * 12 * _PRODUCTS[isa] / min(times) / 1e9


def kernel_gmacs(isa: str, n: int, k: int, group: int, m: int, repeats: int) -> float:
    torch.manual_seed(0)
    qw = quantize(torch.randn(n, k), 4, group, sym=True)
    kernel = X86WoqKernel(qw, torch.float32, torch.device("cpu"), large_m=None, kernels=load_cpu_kernels(isa))
    x = torch.randn(m, k)
    for _ in range(5):
        kernel(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernel(x)
        times.append(time.perf_counter() - start)
    return m * n * k / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isas", default=None, help="comma-separated variants (default: every SIMD one this CPU runs)")
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    isas = args.isas.split(",") if args.isas else [i for i in runnable_isas() if i in _PRODUCTS]
    rows = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}; one thread; INT4 sym g{args.group_size} weight {args.n} x {args.k} "
          f"({args.n * args.k // 2 / 2**20:.1f} MiB, in L2)\n")
    print("| variant | peak GMAC/s | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---:|" + "---:|" * len(rows))
    with tempfile.TemporaryDirectory() as tmp:
        for isa in isas:
            peak = peak_gmacs(isa, Path(tmp))
            cells = []
            for m in rows:
                g = kernel_gmacs(isa, args.n, args.k, args.group_size, m, args.repeats)
                cells.append(f"{g:.0f} ({g / peak:.0%})")
            print(f"| {isa} | {peak:.0f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
