"""A/B two builds of fastdraft's C++ CPU kernels on whole decode (or verification) steps.

Each build is compiled from a folder holding the kernels' sources (a copy of
``fastdraft/kernels/csrc``, changed or not): its driver and its ``--isa`` variant (default:
the one this CPU would run; ``--isa-b`` gives B another). The model is loaded and quantized once per
build, each with its own one-sequence paged KV cache holding a ``--context``-token prefix;
the builds then take turns for ``--rounds`` rounds, each timing the median of ``--steps``
passes of ``--tokens`` tokens through the model's C++ step (``model.logits`` with its fused
decoder, every new token's logits computed, as in a decode or verification step). The figure
is the median over rounds of the per-round speed ratio, which cancels the drift of memory
bandwidth that shared cloud VMs show.

Every model must run the build it was loaded with. Each model's fused decoder is built while
the loader still points at its own build, and the script checks which build each decoder
holds: without that check a mix-up would silently time one build against itself.

    python benchmarks/ab_kernels.py /tmp/a fastdraft/kernels/csrc --tokens 1,5
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from fastdraft.engine.loader import load_model
import fastdraft.kernels.build as build
import fastdraft.kernels.fused as fused
import fastdraft.kernels.x86 as x86
from fastdraft.layers.kv_cache import SequenceCache
import fastdraft.models.fused_decoder as fused_decoder
from fastdraft.quant.quant_config import LOW_BIT_NAMES, QuantConfig
from fastdraft.quant.quantizer import quantize_model

# Modules that bound ``load_cpu_kernels`` by name: pointed at one build at a time.
_LOADER_USERS = (x86, fused, fused_decoder)


def build_from(folder: Path, isa: str) -> build.CpuKernels:
    """The kernels compiled from ``folder``'s copies of the sources: its driver, its variant."""
    from fastdraft.models.registry import fastdraft_home

    key = build.source_key(folder)
    driver = build.compile_extension(f"fastdraft_ab_{key}", folder, fastdraft_home() / "kernels" / f"ab-{key}")
    return build.CpuKernels(driver, driver.load_isa(str(build.build_isa_library(isa, folder / "isa"))))


def load_with(ext: build.CpuKernels, args: argparse.Namespace):
    """The model quantized, with a fused decoder on ``ext``; -> (model, cache, decoder)."""
    for module in _LOADER_USERS:
        module.load_cpu_kernels = lambda ext=ext: ext
    # load_in_low_bit's quantization, with the group size asked for (load_in_low_bit's is 32).
    loaded = load_model(args.model, dtype="bf16" if args.quant is not None else args.low_bit, keep_gguf_quant=False)
    if args.quant is not None:
        quantize_model(loaded.model, args.quant, show_progress=False)
    model = loaded.model
    decoder = model.fused_decoder()
    if decoder is None or decoder.ext is not ext:
        raise SystemExit("the model's fused decoder does not hold the build it was loaded with")
    cache = SequenceCache.from_config(loaded.config, args.context + max(args.tokens) + 1, dtype=model.dtype)
    prefix = torch.randint(0, min(10000, loaded.config.vocab_size), (args.context,)).tolist()
    input_ids, meta = cache.append(prefix)
    model(input_ids, meta.positions, cache.kv_cache, meta, decoder)
    return model, cache, decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="folder with build A's sources (the baseline)")
    parser.add_argument("b", type=Path, help="folder with build B's sources")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--low-bit", default="sym_int4", choices=LOW_BIT_NAMES,
                        help="load_in_low_bit for both (default sym_int4)")
    parser.add_argument("--group-size", type=int, default=32, help="INT4 group size (default 32, as load_in_low_bit)")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens before each pass")
    parser.add_argument("--tokens", default="1,5", help="comma-separated tokens per pass (decode, verification)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--isa", choices=build.ISA_NAMES, default=None,
                        help="the instruction-set variant both builds run (default: this CPU's best)")
    parser.add_argument("--isa-b", choices=build.ISA_NAMES, default=None,
                        help="build B's variant when it differs from A's (e.g. avx2 against avx2_vnni)")
    parser.add_argument("--steps", type=int, default=15, help="passes timed per round (median)")
    args = parser.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    is_dense = args.low_bit in ("bf16", "fp32")
    args.quant = None if is_dense else QuantConfig.from_low_bit(args.low_bit, group_size=args.group_size)
    torch.set_grad_enabled(False)
    isa = args.isa or build.select_isa()
    isa_b = args.isa_b or isa
    print(f"CPU: {build.cpu_model()}; variant {isa}" + (f" (B: {isa_b})" if isa_b != isa else ""))
    systems = [load_with(build_from(folder, name), args) for folder, name in ((args.a, isa), (args.b, isa_b))]
    times: dict[tuple[int, int], list[float]] = {(i, n): [] for i in range(2) for n in args.tokens}
    for _ in range(args.rounds):
        for n in args.tokens:
            rows = list(range(n))
            for i, (model, cache, decoder) in enumerate(systems):
                samples = []
                for _ in range(args.steps):
                    cache.truncate(args.context)
                    start = time.perf_counter()
                    input_ids, meta = cache.append([0] * n)
                    model.logits(input_ids, meta.positions, cache.kv_cache, meta, rows, decoder)
                    samples.append(time.perf_counter() - start)
                times[(i, n)].append(statistics.median(samples))
    print(f"{args.model} ({args.low_bit}, groups of {args.group_size}), {args.context} cached tokens, {args.rounds} interleaved rounds")
    for n in args.tokens:
        a, b = times[(0, n)], times[(1, n)]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        print(f"  {n} token(s)/pass: A {statistics.median(a) * 1e3:.2f} ms, B {statistics.median(b) * 1e3:.2f} ms, "
              f"B is {ratio:.3f}x A's speed (median of per-round ratios)")
        # A's time shows each round's memory-bandwidth state (a change may help in one only).
        print("    by round (A ms: B's ratio): " + ", ".join(f"{x * 1e3:.1f}: {x / y:.3f}" for x, y in zip(a, b)))


if __name__ == "__main__":
    main()
