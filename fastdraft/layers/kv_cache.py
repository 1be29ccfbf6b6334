"""The paged KV cache: a pool of fixed-size blocks shared by sequences through their block
tables, and the flat metadata of one forward pass over it.

Every forward pass, in the serving engine or outside it, is a flat batch: the new tokens of
one or more sequences back to back, described by :class:`PagedAttentionMetadata`.
:func:`flat_batch` lays a batch out from each sequence's :class:`Span`; :class:`SequenceCache`
holds one sequence in a cache of its own, for passes outside the engine (evaluation,
calibration, tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastdraft.model_config import ModelConfig
from fastdraft.kernels import triton_attention
from fastdraft.kernels.memory import huge_page_zeros, release_pages, small_pages
from fastdraft.kernels.ops.attention_ops import PagedAttentionMetadata


class Span(NamedTuple):
    """A sequence's part of a flat batch: ``token_ids`` at positions ``start`` onwards, its
    keys and values going to the blocks of ``block_table``."""

    token_ids: list[int]
    start: int
    block_table: list[int]


def flat_batch(spans: list[Span], block_size: int, device: torch.device | str) -> tuple[torch.Tensor,
                                                                                        PagedAttentionMetadata]:
    """Input ids [num_tokens] and the paged metadata of ``spans`` laid out back to back."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    context_lens: list[int] = []
    for token_ids, start, block_table in spans:
        input_ids.extend(token_ids)
        for position in range(start, start + len(token_ids)):
            positions.append(position)
            slots.append(block_table[position // block_size] * block_size + position % block_size)
        query_start_loc.append(query_start_loc[-1] + len(token_ids))
        context_lens.append(start + len(token_ids))
    max_blocks = max(len(span.block_table) for span in spans)
    tables = torch.zeros(len(spans), max_blocks, dtype=torch.long)
    for i, span in enumerate(spans):
        tables[i, :len(span.block_table)] = torch.tensor(span.block_table, dtype=torch.long)
    meta = PagedAttentionMetadata(torch.tensor(positions, device=device), torch.tensor(slots, device=device),
                                  query_start_loc, context_lens, tables.to(device))
    return torch.tensor(input_ids, dtype=torch.long, device=device), meta


class PagedKVCache:
    """Key/value blocks ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``,
    shared by all sequences through their block tables (``engine/block_manager.py``).

    ``windowed_layers``: the layers whose attention sees a sliding window. Where every holder
    of a block has moved past it by more than the window, those layers' part of the block is
    returned to the OS (:meth:`release_window_blocks`; on a CPU), while the block id stays held
    for the other layers: a long sequence then keeps the full cache of its global layers and
    only the windows of its local ones."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 windowed_layers: tuple[int, ...] = ()) -> None:
        if min(num_layers, num_blocks, num_kv_heads, block_size, head_dim) <= 0:
            raise ValueError("every dimension of the KV cache must be positive")
        if any(not 0 <= i < num_layers for i in windowed_layers):
            raise ValueError(f"windowed layers {windowed_layers} outside 0..{num_layers - 1}")
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = huge_page_zeros(shape, dtype, device)
        self.v = huge_page_zeros(shape, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.windowed_layers = tuple(windowed_layers)
        for layer in self.windowed_layers:  # released a block at a time: no 2 MiB pages there,
            for pool in (self.k[layer], self.v[layer]):  # nor any brought in already by a
                small_pages(pool)  # neighbour's huge page (they read as zeros, as they were)
                release_pages(pool)

    def release_window_blocks(self, block_ids: list[int]) -> int:
        """Return the windowed layers' part of ``block_ids`` to the OS (the pages wholly inside
        each run of consecutive ids); they read as zeros until written. Returns the bytes released."""
        released = 0
        ids = sorted(block_ids)
        runs, start = [], 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                runs.append((ids[start], ids[i - 1] + 1))
                start = i
        for layer in self.windowed_layers:
            for first, end in runs:
                released += release_pages(self.k[layer, first:end]) + release_pages(self.v[layer, first:end])
        return released

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * block_size * config.head_dim * element

    @classmethod
    def from_config(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu", windowed_layers: tuple[int, ...] = ()) -> "PagedKVCache":
        return cls(config.num_hidden_layers, num_blocks, config.num_key_value_heads, block_size, config.head_dim,
                   dtype, device, windowed_layers)

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               meta: PagedAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values ``[num_tokens, num_kv_heads, head_dim]`` to their slots;
        return this layer's blocks ``[num_blocks, num_kv_heads, block_size, head_dim]``."""
        k_layer, v_layer = self.k[layer_idx], self.v[layer_idx]
        if triton_attention.applies(k, k_layer):  # one launch on a GPU
            triton_attention.write_kv(k, v, k_layer, v_layer, meta.slot_mapping)
            return k_layer, v_layer
        blocks = meta.slot_mapping // self.block_size
        offsets = meta.slot_mapping % self.block_size
        # Advanced indices around a slice put the indexed dims first: [num_tokens, heads, dim].
        k_layer[blocks, :, offsets] = k
        v_layer[blocks, :, offsets] = v
        return k_layer, v_layer


class SequenceCache:
    """One sequence in a paged cache of its own, its positions in blocks 0, 1, 2, ... in order:
    for forward passes outside the serving engine (evaluation, calibration, tests), which need
    every row's logits rather than the engine's sampled tokens.

    ``append`` reserves the next positions and returns their metadata; ``truncate`` rolls the
    sequence back (stale keys past its length are overwritten later)."""

    DEFAULT_BLOCK_SIZE = 16

    def __init__(self, kv_cache: PagedKVCache, max_seq_len: int) -> None:
        if max_seq_len <= 0 or max_seq_len > kv_cache.num_blocks * kv_cache.block_size:
            raise ValueError(f"max_seq_len must be in 1..{kv_cache.num_blocks * kv_cache.block_size}, "
                             f"got {max_seq_len}")
        self.kv_cache = kv_cache
        self.max_seq_len = max_seq_len
        self.num_tokens = 0
        self.block_table = list(range(kv_cache.num_blocks))

    @classmethod
    def from_config(cls, config: ModelConfig, max_seq_len: int, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu", block_size: int = DEFAULT_BLOCK_SIZE) -> "SequenceCache":
        max_seq_len = min(max_seq_len, config.max_position_embeddings)
        num_blocks = (max_seq_len + block_size - 1) // block_size
        return cls(PagedKVCache.from_config(config, num_blocks, block_size, dtype, device), max_seq_len)

    def append(self, token_ids: list[int] | torch.Tensor) -> tuple[torch.Tensor, PagedAttentionMetadata]:
        """Input ids [num_tokens] and metadata of ``token_ids`` ([num_tokens], or [1, num_tokens])
        appended after the cached ones. The sequence counts them from here on: a pass that then
        fails leaves them counted, for the caller to ``truncate``."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() > 2 or (token_ids.dim() == 2 and token_ids.shape[0] != 1):
                raise ValueError(f"a SequenceCache holds one sequence: ids must be [num_tokens] or [1, num_tokens], "
                                 f"got {list(token_ids.shape)}")
            token_ids = token_ids.reshape(-1).tolist()
        token_ids = list(token_ids)
        start, end = self.num_tokens, self.num_tokens + len(token_ids)
        if not token_ids or end > self.max_seq_len:
            raise ValueError(f"cannot append {len(token_ids)} tokens after {start}: the cache holds "
                             f"1..{self.max_seq_len} tokens")
        self.num_tokens = end
        num_blocks = (end + self.kv_cache.block_size - 1) // self.kv_cache.block_size
        return flat_batch([Span(token_ids, start, self.block_table[:num_blocks])], self.kv_cache.block_size,
                          self.kv_cache.k.device)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (e.g. after rejected draft tokens)."""
        if not 0 <= length <= self.num_tokens:
            raise ValueError(f"cannot truncate a sequence of {self.num_tokens} tokens to {length}")
        self.num_tokens = length

    def reset(self) -> None:
        self.num_tokens = 0
