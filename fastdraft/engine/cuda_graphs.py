"""Pure-decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model on a GPU is a few hundred short kernels; launched one by one
from Python, the host takes longer than the GPU. A CUDA graph records a step's launches once
and replays them in one call. Graphs fix addresses and shapes, so:

* one graph per bucket of sequences (1, 2, 4, 8, then every 16 up to ``max_num_seqs``), the
  step padded to its bucket; captured largest first, all in one memory pool;
* the inputs live in static buffers: ``input_ids``, ``positions``, ``slot_mapping``,
  ``seq_lens``, ``query_start_loc`` and ``block_tables`` are slices of one int32 device buffer,
  filled each step from one pinned host buffer with one non-blocking copy;
* padding rows write no cache slot (-1) and read one reserved dummy block;
* the attention's split grid is sized for ``max_model_len``, chunks past a sequence's keys
  doing nothing, so that it does not depend on the step's lengths.

Steps that carry any prefill or draft tokens, and batches above the largest bucket, run eagerly
with the same kernels. The graph's output is the fp32 logits of every row of the bucket;
sampling runs after it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np
import torch

from fastdraft.layers.kv_cache import PagedKVCache
from fastdraft.models.cuda_decoder import CudaDecoder

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 16, below ``max_num_seqs``, and
    ``max_num_seqs`` itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    buckets = [b for b in SMALL_BUCKETS if b < max_num_seqs]
    buckets += range(BUCKET_STEP, max_num_seqs, BUCKET_STEP)
    return buckets + [max_num_seqs]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences; None above the largest."""
    return next((b for b in buckets if b >= num_seqs), None)


class CudaGraph:
    """One captured CUDA graph in a memory pool shared with the graphs captured before it."""

    def __init__(self, pool=None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        self.pool = self.graph.pool()
        return out

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    """The decode graphs of one model and cache: ``run`` fills the static inputs of the
    smallest bucket that holds the step, replays its graph and returns the logits rows.

    ``graph_type`` makes a graph from the pool of the ones before it (``CudaGraph``; tests pass
    a stand-in that replays the captured function eagerly)."""

    def __init__(self, decoder: CudaDecoder, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 kv_cache: PagedKVCache, max_num_seqs: int, max_model_len: int, dummy_block: int,
                 graph_type: type = CudaGraph) -> None:
        if not 0 <= dummy_block < kv_cache.num_blocks:
            raise ValueError(f"the dummy block {dummy_block} is not in the cache's {kv_cache.num_blocks} blocks")
        self.decoder, self.compute_logits, self.kv_cache = decoder, compute_logits, kv_cache
        self.block_size = kv_cache.block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // self.block_size)
        self.dummy_block = dummy_block
        self.buckets = graph_buckets(max_num_seqs)
        size = self.buckets[-1]
        self.max_batch = size
        # One int32 layout for the largest bucket; a smaller bucket reads the prefix of each part.
        # The block tables come last, so that a step copies only up to its bucket's rows.
        parts = {"input_ids": size, "positions": size, "slot_mapping": size, "seq_lens": size,
                 "query_start_loc": size + 1, "block_tables": size * self.max_blocks}
        self._offsets, total = {}, 0
        for name, length in parts.items():
            self._offsets[name] = (total, length)
            total += length
        device = kv_cache.k.device
        self._staging = torch.zeros(total, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._host = self._staging.numpy()
        self._inputs = torch.zeros(total, dtype=torch.int32, device=device)
        self._graph_type = graph_type
        self._graphs: dict[int, object] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's logits [bucket, vocab_size]

    def _part(self, buffer, name: str):
        start, length = self._offsets[name]
        return buffer[start:start + length]

    def _fill(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], bucket: int) -> None:
        """The staging buffer for ``bucket`` rows: the sequences' rows, then padding rows (token
        0 at position 0, no slot, one key in the dummy block)."""
        num_seqs = len(token_ids)
        host = self._host
        ids, pos = self._part(host, "input_ids"), self._part(host, "positions")
        ids[:bucket] = 0
        ids[:num_seqs] = token_ids
        pos[:bucket] = 0
        pos[:num_seqs] = positions
        tables = self._part(host, "block_tables")[:bucket * self.max_blocks].reshape(bucket, self.max_blocks)
        tables.fill(self.dummy_block)
        for row, table in zip(tables, block_tables):
            row[:len(table)] = table
        position = np.asarray(positions, dtype=np.int64)
        slots = self._part(host, "slot_mapping")
        slots[:bucket] = -1
        slots[:num_seqs] = tables[np.arange(num_seqs), position // self.block_size] * self.block_size \
            + position % self.block_size
        lens = self._part(host, "seq_lens")
        lens[:bucket] = 1
        lens[:num_seqs] = position + 1
        self._part(host, "query_start_loc")[:bucket + 1] = np.arange(bucket + 1)

    def _forward(self, bucket: int) -> torch.Tensor:
        """The bucket's pass over the static inputs: fp32 logits [bucket, vocab_size]."""
        part = lambda name: self._part(self._inputs, name)  # noqa: E731
        hidden = self.decoder.run(
            part("input_ids")[:bucket], part("positions")[:bucket], part("slot_mapping")[:bucket],
            part("block_tables")[:bucket * self.max_blocks].view(bucket, self.max_blocks), part("seq_lens")[:bucket],
            part("query_start_loc")[:bucket + 1], self.max_model_len, self.kv_cache)
        return self.compute_logits(hidden[:bucket])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graph, largest first in one pool, each warmed up eagerly first
        so that Triton compiles outside the capture. Padding rows only: nothing is written."""
        self.decoder.reserve(self.max_model_len)
        pool = None
        for bucket in reversed(self.buckets):
            self._fill([], [], [], bucket)
            self._inputs.copy_(self._staging)
            self._forward(bucket)  # warm-up
            graph = self._graph_type(pool)
            self._outputs[bucket] = graph.capture(functools.partial(self._forward, bucket))
            pool = graph.pool
            self._graphs[bucket] = graph
        logger.info("captured decode graphs for batch sizes %s", ", ".join(map(str, self.buckets)))

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """A decode step of one token per sequence at ``positions``, each sequence's keys in
        ``block_tables``: fp32 logits [num_seqs, vocab_size] (a view of the graph's output,
        valid until the next run)."""
        num_seqs = len(token_ids)
        bucket = bucket_for(num_seqs, self.buckets)
        if bucket is None or not num_seqs:
            raise ValueError(f"a graph step takes 1..{self.max_batch} sequences, got {num_seqs}")
        if max(positions) >= self.max_model_len:
            raise ValueError(f"a graph step takes positions below max_model_len {self.max_model_len}")
        self._fill(token_ids, positions, block_tables, bucket)
        # One copy up to the bucket's last block-table row (the tables are the layout's last
        # part). The previous step's copy has finished: its tokens were read back before this step.
        end = self._offsets["block_tables"][0] + bucket * self.max_blocks
        self._inputs[:end].copy_(self._staging[:end], non_blocking=True)
        self._graphs[bucket].replay()
        return self._outputs[bucket][:num_seqs]
