"""Timing greedy decoding of one sequence over a contiguous cache, for choosing between
configurations by measured speed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from fastdraft.engine.generate import decode_one_token, prefill
from fastdraft.layers.kv_cache import KVCache
from fastdraft.models.llama import LlamaForCausalLM
from fastdraft.tokenizer import Tokenizer


@torch.inference_mode()
def time_decode(model: LlamaForCausalLM, num_tokens: int, prompt_ids: list[int]) -> float:
    """Median greedy next-token latency in milliseconds."""
    cache = KVCache.from_config(model.config, len(prompt_ids) + num_tokens + 1, dtype=model.dtype, device=model.device)
    logits = prefill(model, torch.tensor([prompt_ids], device=model.device), cache)
    decoder = model.fused_decoder()
    times = []
    for _ in range(num_tokens):
        start = time.perf_counter()
        logits = decode_one_token(model, logits.argmax(-1).view(1, 1), cache, decoder=decoder)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:] if len(times) > 4 else times) * 1e3


class GreedyDecodeTimer:
    """Times ``num_tokens`` greedy decode steps after a short prompt; what the automatic
    quantization search ranks candidates by."""

    def __init__(self, prompt_ids: list[int], num_tokens: int,
                 time_one: Callable[[LlamaForCausalLM, int, list[int]], float] = time_decode) -> None:
        if not prompt_ids or num_tokens < 1:
            raise ValueError("the timer needs a non-empty prompt and num_tokens >= 1")
        self.prompt_ids = prompt_ids
        self.num_tokens = num_tokens
        self._time_one = time_one

    @classmethod
    def for_code(cls, tokenizer: Tokenizer, num_tokens: int) -> "GreedyDecodeTimer":
        return cls(tokenizer.encode("def main():\n    "), num_tokens)

    def time(self, model: LlamaForCausalLM) -> float:
        """Median per-token decode latency in milliseconds."""
        return self._time_one(model, self.num_tokens, self.prompt_ids)

    def time_interleaved(self, models: list[LlamaForCausalLM], num_rounds: int) -> list[float]:
        """Each model's median latency (ms) over ``num_rounds`` rounds in which the models take
        turns, so that a slow or fast spell of a shared machine falls on all of them alike."""
        times: list[list[float]] = [[] for _ in models]
        for _ in range(num_rounds):
            for model_times, model in zip(times, models):
                model_times.append(self.time(model))
        return [statistics.median(t) for t in times]
