"""Weight-only matmul kernels, one shape at a time: fastdraft's x86 kernels vs PyTorch's own.

For every linear shape of the chosen model (decode reads each weight once, so the figure of
merit is weight bytes / time), and for several row counts M, we time:

* ``fastdraft``: :class:`fastdraft.kernels.x86.X86WoqKernel` (AVX-512 VNNI; dequantize +
  oneDNN GEMM from ``large_m`` rows on);
* ``aten-int4``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (INT4 shapes);
* ``aten-int8``: ``torch.ops.aten._weight_int8pack_mm`` (INT8 per-channel shapes);
* ``bf16``: a dense bf16 ``F.linear`` (oneDNN), the unquantized baseline.

Each kernel cycles through enough copies of the weight to exceed the last-level cache, so
weights come from DRAM as they do in a real decode step. The memory read bandwidth is
measured in the same run (see ``bench_latency.measure_bandwidth``) and every GB/s figure is
also given as a fraction of it. Medians over ``--repeats`` timed calls.

    python benchmarks/bench_kernels.py --model qwen2.5-coder-1.5b-instruct --group-size 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_latency import measure_bandwidth  # noqa: E402

from fastdraft.model_config import ModelConfig  # noqa: E402
from fastdraft.formats import PER_CHANNEL, quantize  # noqa: E402
from fastdraft.kernels.aten import AtenInt4Kernel, AtenInt8Kernel  # noqa: E402
from fastdraft.kernels.x86 import X86WoqKernel  # noqa: E402
from fastdraft.models.files import resolve_model_dir  # noqa: E402
from fastdraft.process import configure_process  # noqa: E402

CACHE_BYTES = 256 * 2**20  # cycle through this many weight bytes so nothing stays in cache


def model_shapes(name: str) -> list[tuple[str, int, int, int]]:
    """(label, N, K, bits) of every distinct linear in one decoder layer, plus the INT8 LM head."""
    cfg = ModelConfig.from_file(resolve_model_dir(name) / "config.json")
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * cfg.head_dim
    return [("q_proj/o_proj", h, h, 4), ("k_proj/v_proj", kv, h, 4), ("gate/up_proj", i, h, 4),
            ("down_proj", h, i, 4), ("lm_head (int8)", cfg.vocab_size, h, 8)]


def time_calls(fns: list[Callable[[], torch.Tensor]], repeats: int) -> float:
    """Median seconds per call, cycling through ``fns`` (one per weight copy)."""
    for fn in fns[:2]:
        fn()
    times = []
    for r in range(repeats):
        fn = fns[r % len(fns)]
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_shape(n: int, k: int, bits: int, group_size: int, rows: list[int], repeats: int) -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    qw = quantize(w, bits, group_size if bits == 4 else PER_CHANNEL, sym=True)
    copies = max(2, min(64, CACHE_BYTES // qw.num_bytes))
    dtype, cpu = torch.bfloat16, torch.device("cpu")
    systems: dict[str, list] = {"fastdraft": [X86WoqKernel(qw, dtype, cpu) for _ in range(copies)]}
    aten = AtenInt4Kernel if bits == 4 else AtenInt8Kernel
    if aten.supports(qw, dtype, cpu):
        systems[aten.name] = [aten(qw, dtype, cpu) for _ in range(copies)]
    dense_copies = max(2, min(16, CACHE_BYTES // (n * k * 2)))
    dense = [w.to(dtype) for _ in range(dense_copies)]
    results = []
    for m in rows:
        x = torch.randn(m, k, dtype=dtype)
        row = {"n": n, "k": k, "bits": bits, "m": m}
        for label, kernels in systems.items():
            row[label] = time_calls([lambda kern=kern: kern(x) for kern in kernels], repeats)
        row["bf16"] = time_calls([lambda d=d: F.linear(x, d) for d in dense], repeats)
        row["quant_bytes"] = qw.num_bytes
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--rows", default="1,4,8,16,64,1024", help="comma-separated M values")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    configure_process(num_threads=args.threads)
    rows = [int(m) for m in args.rows.split(",")]
    bandwidth = measure_bandwidth()
    print(f"# kernels on {args.model} shapes, INT4 g{args.group_size} sym, bf16 activations, "
          f"{args.threads} threads; measured read bandwidth {bandwidth / 1e9:.1f} GB/s\n")
    print("| shape | N x K | M | fastdraft us | weight GB/s | % of BW | aten us | fastdraft vs aten "
          "| bf16 us | fastdraft vs bf16 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, n, k, bits in model_shapes(args.model):
        for r in bench_shape(n, k, bits, args.group_size, rows, args.repeats):
            ours = r["fastdraft"]
            aten_name = "aten-int4" if bits == 4 else "aten-int8"
            aten = r.get(aten_name)
            gbs = r["quant_bytes"] / ours / 1e9
            aten_cols = (f"{aten * 1e6:.0f} | {aten / ours:.2f}x" if aten else "n/a | n/a")
            print(f"| {label} | {n} x {k} | {r['m']} | {ours * 1e6:.0f} | {gbs:.1f} | "
                  f"{100 * gbs * 1e9 / bandwidth:.0f}% | {aten_cols} | {r['bf16'] * 1e6:.0f} | "
                  f"{r['bf16'] / ours:.2f}x |")
    print(f"\nmeasured read bandwidth {bandwidth / 1e9:.1f} GB/s (torch fp32 sum / uint8 amax over 1 GiB)")


if __name__ == "__main__":
    main()
