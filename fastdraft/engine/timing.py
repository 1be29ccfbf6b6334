"""Timing the serving engine's batch-1 decode step, for choosing between configurations by
measured speed."""

from __future__ import annotations

import statistics

from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.llm_engine import EngineConfig
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.layers.kv_cache import PagedKVCache
from fastdraft.models.causal_lm import CausalLM


class DecodeStepTimer:
    """Times the step a user's one-sequence decoding runs: the engine's model runner (its C++
    step where the CPU kernels apply, the LM head inside) over one token after
    ``context_len`` cached ones, ``num_steps`` times after a warm-up. What the automatic
    quantization search ranks candidates by."""

    def __init__(self, num_steps: int, context_len: int = 16, block_size: int = EngineConfig.block_size) -> None:
        if num_steps < 1 or context_len < 0 or block_size < 1:
            raise ValueError("the timer needs num_steps >= 1, context_len >= 0 and block_size >= 1")
        self.num_steps = num_steps
        self.context_len = context_len
        self.block_size = block_size

    def time(self, model: CausalLM) -> float:
        """Median decode step of ``model`` in milliseconds."""
        num_blocks = self.context_len // self.block_size + 1
        kv_cache = PagedKVCache.from_config(model.config, num_blocks, self.block_size, model.dtype, model.device)
        runner = ModelRunner(model, kv_cache, BlockManager(num_blocks, self.block_size, enable_prefix_caching=False))
        return runner.time_pass(1, self.context_len, repeats=self.num_steps) * 1e3

    def time_interleaved(self, models: list[CausalLM], num_rounds: int) -> list[float]:
        """Each model's median step (ms) over ``num_rounds`` rounds in which the models take
        turns, so that a slow or fast spell of a shared machine falls on all of them alike."""
        times: list[list[float]] = [[] for _ in models]
        for _ in range(num_rounds):
            for model_times, model in zip(times, models):
                model_times.append(self.time(model))
        return [statistics.median(t) for t in times]
