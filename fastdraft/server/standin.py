"""An engine that sleeps instead of computing, to measure the serving layer (the Ray hop,
replicas, routing) without the model's compute: ``benchmarks/bench_ray.py`` and the Ray tests
run it behind the same deployment as the real engine.

It implements what :class:`~fastdraft.server.async_engine.AsyncEngine` uses of an
:class:`~fastdraft.engine.llm_engine.LLMEngine`: ``add_request``, ``abort_request``, ``step``,
``has_unfinished_requests`` and the scheduler's and block manager's counters.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from ray import serve
from ray.serve.exceptions import RayServeException

from fastdraft.engine.block_manager import prefix_block_hashes
from fastdraft.engine.output import RequestDelta

STANDIN_TTFT_S = 0.200
STANDIN_TPOT_S = 0.025
STANDIN_BATCH = 8
STANDIN_BLOCK_SIZE = 16


class _StandInSeq:
    def __init__(self, request_id: str, num_tokens: int, ttft_s: float, num_cached_tokens: int) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.ttft_s = ttft_s
        self.num_cached_tokens = num_cached_tokens
        self.num_sent = 0
        self.first_token_at = 0.0  # monotonic time of its first token, set on admission


class StandInEngine:
    """An engine that sleeps instead of computing: each step takes the TPOT, and a request's
    first token comes its TTFT after it is admitted, then one a step; up to ``STANDIN_BATCH``
    requests at once (the others wait).

    The TTFT is ``ttft_s``; or, with ``cache_blocks``, ``ttft_s + ttft_per_token_s`` times the
    prompt tokens its simulated prefix cache (``cache_blocks`` blocks, least recently used
    evicted, keyed as the paged KV cache keys blocks) does not hold. The first token's text
    names the replica, so that a client can count each replica's requests."""

    class _Stats:
        def __init__(self, num_blocks: int) -> None:
            self.running: list[_StandInSeq] = []
            self.waiting: list[_StandInSeq] = []
            self.num_preemptions = 0
            self.usage = 0.0
            self.num_prefix_queries = 0
            self.num_prefix_hits = 0
            self.num_blocks = self.num_free_blocks = num_blocks
            self.block_size = STANDIN_BLOCK_SIZE

    def __init__(self, ttft_s: float = STANDIN_TTFT_S, ttft_per_token_s: float = 0.0,
                 cache_blocks: int | None = None) -> None:
        self.tokenizer = None
        self.vocab_size = 1000
        self.max_model_len = 4096
        self.weights = "none (a stand-in engine: tokens without a model)"
        self.ttft_s, self.ttft_per_token_s = ttft_s, ttft_per_token_s
        self.cache_blocks = cache_blocks
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.scheduler = self.block_manager = self._Stats(cache_blocks or 4096)
        try:
            self.name = serve.get_replica_context().replica_id.unique_id
        except RayServeException:  # not on a replica
            self.name = "local"

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def _look_up(self, prompt: list[int]) -> int:
        """Prompt tokens the simulated cache holds; the prompt's blocks are then the most recent."""
        num_hit, is_hit = 0, True
        for block in prefix_block_hashes(prompt, STANDIN_BLOCK_SIZE):
            is_hit = is_hit and block in self.cache
            num_hit += is_hit
            self.cache[block] = None
            self.cache.move_to_end(block)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)
        self.block_manager.num_prefix_queries += len(prompt)
        self.block_manager.num_prefix_hits += num_hit * STANDIN_BLOCK_SIZE
        return num_hit * STANDIN_BLOCK_SIZE

    def add_request(self, prompt, params, request_id: str) -> str:
        num_cached = self._look_up(list(prompt)) if self.cache_blocks else 0
        ttft_s = self.ttft_s + self.ttft_per_token_s * (len(prompt) - num_cached)
        self.scheduler.waiting.append(_StandInSeq(request_id, params.max_new_tokens, ttft_s, num_cached))
        return request_id

    def abort_request(self, request_id: str) -> bool:
        for queue in (self.scheduler.running, self.scheduler.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    return True
        return False

    def step(self) -> list[RequestDelta]:
        running, waiting = self.scheduler.running, self.scheduler.waiting
        while waiting and len(running) < STANDIN_BATCH:
            seq = waiting.pop(0)
            seq.first_token_at = time.monotonic() + seq.ttft_s
            running.append(seq)
        time.sleep(STANDIN_TPOT_S)
        now = time.monotonic()
        deltas = []
        for seq in list(running):
            if now < seq.first_token_at:
                continue
            seq.num_sent += 1
            is_first = seq.num_sent == 1
            finish = "length" if seq.num_sent >= seq.num_tokens else None
            deltas.append(RequestDelta(seq.request_id, [1], f"[{self.name}]" if is_first else "x",
                                       finish_reason=finish, ttft_s=seq.ttft_s if is_first else None,
                                       token_gap_s=STANDIN_TPOT_S,
                                       num_cached_tokens=seq.num_cached_tokens if is_first else None))
            if finish:
                running.remove(seq)
        return deltas
