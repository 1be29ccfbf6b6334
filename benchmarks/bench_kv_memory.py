"""KV-cache memory of one long sequence on a model with sliding-window layers: the bytes the
pool holds in memory after a ``--tokens``-token sequence, against the least any cache could
hold (every global layer's keys and values for every token, each local layer's for its window
only) and against a cache that keeps every layer's.

    python benchmarks/bench_kv_memory.py --model gemma-3-270m --tokens 32768
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
from fastdraft.engine.loader import load_model
from fastdraft.kernels.build import cpu_model
from fastdraft.kernels.memory import resident_bytes
from fastdraft.models.registry import KNOWN_MODELS
from fastdraft.sampling_params import SamplingParams

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m", choices=sorted(KNOWN_MODELS))
    parser.add_argument("--tokens", type=int, default=32768, help="prompt tokens plus one generated token")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype="bf16", keep_gguf_quant=True)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=1, max_model_len=args.tokens, max_num_batched_tokens=2048,
                                            enable_prefix_caching=False))
    cache = engine.kv_cache
    vocab = loaded.config.vocab_size
    prompt = torch.randint(1000, vocab, (args.tokens - 1,), generator=torch.Generator().manual_seed(0)).tolist()
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    held = 0
    while engine.has_unfinished_requests:
        engine.step()
        held = max(held, sum(resident_bytes(t) for t in (cache.k, cache.v)))  # at each step's end
    elapsed = time.perf_counter() - start
    plan = loaded.model.plan
    per_token = 2 * cache.k.shape[2] * cache.k.shape[4] * cache.k.element_size()  # one layer's k and v
    windows = [layer.attention.sliding_window for layer in plan.layers]
    num_tokens = seq.num_tokens
    least = sum(per_token * (num_tokens if w is None else min(w, num_tokens)) for w in windows)
    every_layer = per_token * num_tokens * len(windows)
    print(f"CPU: {cpu_model()}; {args.model}, one sequence of {num_tokens} tokens "
          f"({elapsed:.0f} s to prefill and decode)")
    print(f"layers: {windows.count(None)} global, {len(windows) - windows.count(None)} local "
          f"(window {max(w or 0 for w in windows)})")
    print(f"KV pool held in memory (peak over steps): {held / MIB:.1f} MiB")
    print(f"global layers' full cache + local layers' windows: {least / MIB:.1f} MiB "
          f"-> ratio {held / least:.3f}")
    print(f"every layer's full cache: {every_layer / MIB:.1f} MiB -> {held / every_layer:.3f} of it")


if __name__ == "__main__":
    main()
