"""KV caches: a contiguous one with one row ("slot") per sequence, and a paged one of blocks.

Buffers are allocated once, sized from the model config and a maximum length, and never
reallocated per token. Each slot holds one sequence; its length can be rolled back with
:meth:`KVCache.truncate`, which is all speculative decoding needs to discard rejected tokens
(stale entries past the length are simply overwritten later).

Every forward pass over the contiguous cache receives an :class:`AttentionMetadata` that says,
for each sequence of the batch, which slot it lives in and the absolute position of each of its
new tokens. Sequences in one batch may therefore sit at different positions.

The serving engine's :class:`PagedKVCache` is a pool of fixed-size blocks shared through
per-sequence block tables; its passes carry a flat :class:`PagedAttentionMetadata`.
"""

from __future__ import annotations

import torch

from fastdraft.config import ModelConfig
from fastdraft.kernels.memory import huge_page_zeros


class AttentionMetadata:
    """Where the tokens of one forward pass go in the cache, and what they may attend to.

    * ``positions`` [batch, num_tokens]: absolute positions of the new tokens.
    * ``slot_ids`` [batch]: the cache slot of each sequence.
    * ``context_len``: the number of key positions to attend over (max last position + 1).
    * ``contiguous_start``: set when batch == 1 and the positions are start..start+num_tokens-1,
      which enables slice writes; ``slot`` is then that sequence's slot as an int.
    * ``attn_mask`` [batch, 1, num_tokens, context_len] bool, True = may attend; None when every
      new token may see the whole context (single-token decode) or when ``is_prefill``.
    * ``is_prefill``: contiguous tokens starting at position 0 (plain causal attention).

    A contiguous pass (:meth:`contiguous`) builds its tensors only when they are read: the
    fused decode step needs none of them, and with the weights streaming through the caches
    each small tensor costs 15-30 us, about 0.3% of a 1.5B INT4 step for the three.
    """

    def __init__(self, positions: torch.Tensor, slot_ids: torch.Tensor, context_len: int,
                 contiguous_start: int | None = None, attn_mask: torch.Tensor | None = None,
                 is_prefill: bool = False) -> None:
        batch_size, num_tokens = positions.shape
        slot = int(slot_ids[0]) if contiguous_start is not None else None
        self._set_fields(positions, slot_ids, attn_mask, batch_size, num_tokens, context_len, contiguous_start,
                         is_prefill, slot, positions.device, is_mask_pending=False)

    def _set_fields(self, positions: torch.Tensor | None, slot_ids: torch.Tensor | None,
                    attn_mask: torch.Tensor | None, batch_size: int, num_tokens: int, context_len: int,
                    contiguous_start: int | None, is_prefill: bool, slot: int | None, device: torch.device,
                    is_mask_pending: bool) -> None:
        # The one place every field is set: __init__ and contiguous() both come through here.
        self._positions, self._slot_ids, self._attn_mask = positions, slot_ids, attn_mask
        self.batch_size, self.num_tokens = batch_size, num_tokens
        self.context_len = context_len
        self.contiguous_start = contiguous_start
        self.is_prefill = is_prefill
        self.slot = slot
        self.device = device
        self._is_mask_pending = is_mask_pending

    @classmethod
    def contiguous(cls, start: int, num_tokens: int, slot: int = 0,
                   device: torch.device | str = "cpu") -> "AttentionMetadata":
        """One sequence in ``slot`` appending ``num_tokens`` tokens after ``start`` cached ones."""
        meta = cls.__new__(cls)  # no tensors yet: they are built on first read
        is_prefill = start == 0 and num_tokens > 1
        meta._set_fields(None, None, None, 1, num_tokens, start + num_tokens, start, is_prefill, slot,
                         torch.device(device), is_mask_pending=num_tokens > 1 and not is_prefill)
        return meta

    @classmethod
    def batched(cls, positions: torch.Tensor, slot_ids: torch.Tensor) -> "AttentionMetadata":
        """General case: ``positions`` [batch, num_tokens], one cache slot per row."""
        if positions.dim() != 2 or slot_ids.dim() != 1 or positions.shape[0] != slot_ids.shape[0]:
            raise ValueError("positions must be [batch, num_tokens] and slot_ids [batch]")
        context_len = int(positions.max()) + 1
        key_pos = torch.arange(context_len, device=positions.device)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [batch, num_tokens, context_len]
        return cls(positions=positions, slot_ids=slot_ids, context_len=context_len,
                   attn_mask=mask.unsqueeze(1))

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            self._positions = torch.arange(self.contiguous_start, self.context_len, device=self.device).unsqueeze(0)
        return self._positions

    @property
    def slot_ids(self) -> torch.Tensor:
        if self._slot_ids is None:
            self._slot_ids = torch.tensor([self.slot], device=self.device)
        return self._slot_ids

    @property
    def attn_mask(self) -> torch.Tensor | None:
        if self._is_mask_pending:
            key_pos = torch.arange(self.context_len, device=self.device)
            mask = key_pos[None, :] <= self.positions[0, :, None]  # [num_tokens, context_len]
            self._attn_mask = mask.view(1, 1, self.num_tokens, self.context_len)
            self._is_mask_pending = False
        return self._attn_mask


class KVCache:
    """Key/value buffers ``[num_layers, max_batch_size, num_kv_heads, max_seq_len, head_dim]``."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 max_batch_size: int = 1, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        if max_seq_len <= 0 or max_batch_size <= 0:
            raise ValueError("max_seq_len and max_batch_size must be positive")
        shape = (num_layers, max_batch_size, num_kv_heads, max_seq_len, head_dim)
        # Decoding streams the whole cached prefix at every step, as it streams the weights:
        # on huge pages too (plain memory where those are unavailable).
        self.k = huge_page_zeros(shape, dtype, device)
        self.v = huge_page_zeros(shape, dtype, device)
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.seq_lens = [0] * max_batch_size  # host-side length of each slot

    @classmethod
    def from_config(cls, config: ModelConfig, max_seq_len: int, max_batch_size: int = 1,
                    dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> "KVCache":
        max_seq_len = min(max_seq_len, config.max_position_embeddings)
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                   max_seq_len, max_batch_size, dtype, device)

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def append(self, num_tokens: int, slot: int = 0) -> AttentionMetadata:
        """Reserve ``num_tokens`` positions after the slot's current length; return their metadata."""
        start = self.seq_lens[slot]
        if start + num_tokens > self.max_seq_len:
            raise ValueError(
                f"sequence would reach {start + num_tokens} tokens, beyond the KV cache's "
                f"max_seq_len of {self.max_seq_len}"
            )
        self.seq_lens[slot] = start + num_tokens
        return AttentionMetadata.contiguous(start, num_tokens, slot, device=self.k.device)

    def truncate(self, length: int, slot: int = 0) -> None:
        """Roll the slot back to its first ``length`` tokens (e.g. after rejected draft tokens)."""
        if not 0 <= length <= self.seq_lens[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.seq_lens[slot]} to {length}")
        self.seq_lens[slot] = length

    def reset(self, slot: int | None = None) -> None:
        if slot is None:
            self.seq_lens = [0] * self.max_batch_size
        else:
            self.seq_lens[slot] = 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values ``[batch, num_kv_heads, num_tokens, head_dim]`` and return
        all keys/values the batch attends to, ``[batch, num_kv_heads, context_len, head_dim]``."""
        k_layer, v_layer = self.k[layer_idx], self.v[layer_idx]
        if meta.contiguous_start is not None:
            slot = meta.slot
            start, end = meta.contiguous_start, meta.contiguous_start + meta.num_tokens
            k_layer[slot, :, start:end].copy_(k[0])
            v_layer[slot, :, start:end].copy_(v[0])
            # Views, not copies: decode reads exactly the live prefix of the slot.
            return (k_layer[slot, :, :meta.context_len].unsqueeze(0),
                    v_layer[slot, :, :meta.context_len].unsqueeze(0))
        slots = meta.slot_ids[:, None]  # [batch, 1]
        # Advanced indices around a slice put the indexed dims first: [batch, tokens, heads, dim].
        k_layer[slots, :, meta.positions] = k.transpose(1, 2)
        v_layer[slots, :, meta.positions] = v.transpose(1, 2)
        return k_layer[meta.slot_ids, :, :meta.context_len], v_layer[meta.slot_ids, :, :meta.context_len]


class PagedAttentionMetadata:
    """A flat batch: the new tokens of many sequences back to back, each sequence at its own
    position, its keys and values in blocks of a :class:`PagedKVCache`.

    * ``positions`` [num_tokens]: the absolute position of each token in its sequence.
    * ``slot_mapping`` [num_tokens]: the cache slot each token's key and value go to
      (block id * block_size + offset in the block).
    * ``query_start_loc`` [num_seqs + 1]: sequence ``i``'s tokens are
      ``query_start_loc[i]:query_start_loc[i + 1]``.
    * ``context_lens`` [num_seqs]: the keys sequence ``i`` attends over after this step (its
      cached tokens plus its new ones, which are the last).
    * ``block_tables`` [num_seqs, max_blocks]: the blocks holding each sequence's positions.

    The model sees the batch as one row (``batch_size`` 1), which is what keeps the linears at
    one matmul per layer for every sequence of the step.
    """

    batch_size = 1
    contiguous_start = None
    is_prefill = False
    attn_mask = None

    def __init__(self, positions: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc: list[int],
                 context_lens: list[int], block_tables: torch.Tensor) -> None:
        if positions.dim() != 1 or slot_mapping.shape != positions.shape:
            raise ValueError("positions and slot_mapping must both be [num_tokens]")
        if len(query_start_loc) != len(context_lens) + 1 or query_start_loc[-1] != positions.shape[0]:
            raise ValueError("query_start_loc must be [num_seqs + 1] and end at num_tokens")
        self._flat_positions = positions
        self.slot_mapping = slot_mapping
        self.query_start_loc = query_start_loc
        self.context_lens = context_lens
        # The same two as int64 host tensors, built once per step for the C++ attention.
        self.query_start_loc_tensor = torch.tensor(query_start_loc, dtype=torch.long)
        self.context_lens_tensor = torch.tensor(context_lens, dtype=torch.long)
        self.block_tables = block_tables
        self.num_tokens = positions.shape[0]
        self.num_seqs = len(context_lens)
        self.device = positions.device

    @property
    def positions(self) -> torch.Tensor:
        return self._flat_positions.unsqueeze(0)  # [1, num_tokens], as the model's rotary reads it


class PagedKVCache:
    """Key/value blocks ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``,
    shared by all sequences through their block tables (``engine/block_manager.py``)."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> None:
        if min(num_layers, num_blocks, num_kv_heads, block_size, head_dim) <= 0:
            raise ValueError("every dimension of the KV cache must be positive")
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = huge_page_zeros(shape, dtype, device)
        self.v = huge_page_zeros(shape, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * block_size * config.head_dim * element

    @classmethod
    def from_config(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu") -> "PagedKVCache":
        return cls(config.num_hidden_layers, num_blocks, config.num_key_value_heads, block_size, config.head_dim,
                   dtype, device)

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               meta: PagedAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values ``[1, num_kv_heads, num_tokens, head_dim]`` to their slots;
        return this layer's blocks ``[num_blocks, num_kv_heads, block_size, head_dim]``."""
        k_layer, v_layer = self.k[layer_idx], self.v[layer_idx]
        blocks = meta.slot_mapping // self.block_size
        offsets = meta.slot_mapping % self.block_size
        # Advanced indices around a slice put the indexed dim first: [num_tokens, heads, dim].
        k_layer[blocks, :, offsets] = k[0].transpose(0, 1)
        v_layer[blocks, :, offsets] = v[0].transpose(0, 1)
        return k_layer, v_layer
