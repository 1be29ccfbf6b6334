"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, prefix caching.

The cache is a pool of ``num_blocks`` blocks of ``block_size`` token positions. A sequence holds
a block table; a block may be shared by several sequences (a common prompt prefix) and is
returned to the pool when its last holder lets go.

Prefix caching: once a block is full, it is keyed by a hash of its tokens chained with the hash
of the block before it, so the key names the whole prefix up to the block's end. A new sequence
whose prompt starts with the same full blocks takes them from the cache instead of computing
them. A freed block keeps its key and contents until the pool needs the block for something
else; free blocks are handed out least recently freed first, so the most recently used
prefixes survive longest.

Sliding windows (a model with local-attention layers, ``window``): a block that every holder's
window has moved past is no longer read by those layers, and ``on_window_passed`` is told so
(the KV cache then releases those layers' part of it). A cached prefix is reused only as far
as the blocks its window needs still hold their local layers' part.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fastdraft.engine.sequence import Sequence

_NO_HASH = b""


def block_hash(prev_hash: bytes, token_ids: list[int]) -> bytes:
    """The key of a full block: its tokens chained with the key of the block before it."""
    digest = hashlib.blake2b(prev_hash, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return digest.digest()


def prefix_block_hashes(token_ids: list[int], block_size: int) -> Iterator[bytes]:
    """The keys of the leading full blocks of ``token_ids``, in order (computed as they are
    taken, so that a caller may stop at the first one it does not find)."""
    prev = _NO_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = block_hash(prev, token_ids[start:start + block_size])
        yield prev


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes = _NO_HASH  # set once the block is full and committed
    window_holders: int = 0  # holders whose sliding window still covers the block
    is_window_released: bool = False  # the windowed layers' part is gone (until reused)


class BlockManager:
    """Allocates cache blocks to sequences; ``ValueError`` for a request that could never fit."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, on_window_passed: Callable[[list[int]], object] | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        if window is not None and window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.block_size = block_size
        self.window, self.on_window_passed = window, on_window_passed
        self.num_window_released = 0  # blocks whose windowed part was released, in all
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self._cached: dict[bytes, int] = {}  # full-block key -> block id
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """The share of blocks some sequence holds."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation -----------------------------------------------------------------------

    def _take_free_block(self) -> Block:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash and self._cached.get(block.hash) == block_id:
            del self._cached[block.hash]  # evicted: its contents are about to be overwritten
        block.hash = _NO_HASH
        block.ref_count = block.window_holders = 1
        block.is_window_released = False
        return block

    def _hold(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1
        block.window_holders += 1

    def _num_window_passed(self, num_computed_tokens: int) -> int:
        """Leading blocks that no token from ``num_computed_tokens`` on sees through the window
        (the next token sees keys from ``num_computed_tokens - window + 1`` on)."""
        if self.window is None:
            return 0
        return max(num_computed_tokens - self.window + 1, 0) // self.block_size

    def _slide_window(self, seq: Sequence) -> None:
        """Let go of the window of ``seq``'s blocks that its window has moved past; a block no
        holder's window covers any more is reported to ``on_window_passed``."""
        num_passed = min(self._num_window_passed(seq.num_computed_tokens), len(seq.block_table))
        passed = []
        for index in range(seq.num_window_passed_blocks, num_passed):
            block = self.blocks[seq.block_table[index]]
            block.window_holders -= 1
            if block.window_holders == 0 and not block.is_window_released:
                block.is_window_released = True
                passed.append(block.block_id)
        seq.num_window_passed_blocks = max(seq.num_window_passed_blocks, num_passed)
        if passed:
            self.num_window_released += len(passed)
            if self.on_window_passed is not None:
                self.on_window_passed(passed)

    def cached_prefix_blocks(self, seq: Sequence) -> list[Block]:
        """The cached blocks that hold ``seq``'s leading full blocks, in order (a preempted
        sequence finds its generated tokens too). The block of the last token is never taken
        from the cache: that token is computed again for its logits, and its key and value go
        to a block this sequence owns, not into one other sequences are reading."""
        if not self.enable_prefix_caching:
            return []
        found = []
        num_full = (seq.num_tokens - 1) // self.block_size
        for key in prefix_block_hashes(seq.token_ids[:num_full * self.block_size], self.block_size):
            block_id = self._cached.get(key)
            if block_id is None:
                break
            found.append(self.blocks[block_id])
        # The blocks the window of the first uncached token reaches must still be whole.
        while found and any(b.is_window_released
                            for b in found[self._num_window_passed(len(found) * self.block_size):]):
            found.pop()
        return found

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[Block] | None = None) -> bool:
        """Whether ``allocate(seq, num_new_tokens)`` would succeed now. ``cached``: the
        sequence's ``cached_prefix_blocks``, when the caller has already looked them up."""
        cached = self.cached_prefix_blocks(seq) if cached is None else cached
        num_reused_free = sum(b.ref_count == 0 for b in cached)
        needed = self.num_blocks_for(len(cached) * self.block_size + num_new_tokens) - len(cached)
        return max(needed, 0) + num_reused_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[Block] | None = None) -> None:
        """Give a waiting ``seq`` its blocks: cached prefix blocks first (counted as computed),
        then fresh ones for ``num_new_tokens`` more tokens. Call ``can_allocate`` first, and
        pass the same ``cached`` blocks, if any, with no allocation between."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.request_id} already holds blocks")
        cached = self.cached_prefix_blocks(seq) if cached is None else cached
        seq.num_computed_tokens = len(cached) * self.block_size
        if self.enable_prefix_caching:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += seq.num_computed_tokens
        for block in cached:
            self._hold(block)
        seq.block_table = [b.block_id for b in cached]
        seq.num_hashed_blocks = len(cached)
        seq.num_cached_tokens = seq.num_computed_tokens
        if not self.append_slots(seq, num_new_tokens):
            self.free(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            raise ValueError("not enough free blocks; call can_allocate first")
        self._slide_window(seq)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` past its computed ones;
        False, changing nothing, when the pool has too few free blocks."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take_free_block().block_id for _ in range(max(needed, 0)))
        return True

    def trim(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks past those its computed tokens and its next token need
        (after rejected draft tokens)."""
        self._release_from(seq, self.num_blocks_for(seq.num_computed_tokens + 1))

    def commit(self, seq: Sequence) -> None:
        """Key ``seq``'s newly filled, computed blocks for prefix caching (after a forward
        pass); the blocks keyed before keep their keys, so a step hashes only what it filled.
        Blocks its sliding window has moved past are let go of for the windowed layers."""
        self._slide_window(seq)
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_hashed_blocks
        if num_full <= start:
            return
        tokens = seq.token_ids
        prev = self.blocks[seq.block_table[start - 1]].hash if start else _NO_HASH
        for index in range(start, num_full):
            block = self.blocks[seq.block_table[index]]
            prev = block_hash(prev, tokens[index * self.block_size:(index + 1) * self.block_size])
            block.hash = prev
            # Another sequence may have computed the same prefix meanwhile: keep the first copy
            # findable, and let this one be evicted with its key when it is freed.
            self._cached.setdefault(prev, block.block_id)
        seq.num_hashed_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks. Its last blocks go to the pool first, so they are evicted
        before the prefix blocks that other requests are likelier to share."""
        self._release_from(seq, 0)

    def _release_from(self, seq: Sequence, num_kept: int) -> None:
        """Let go of ``seq``'s blocks after its first ``num_kept``, last first."""
        for index in range(len(seq.block_table) - 1, num_kept - 1, -1):
            block = self.blocks[seq.block_table[index]]
            block.ref_count -= 1
            if index >= seq.num_window_passed_blocks:
                block.window_holders -= 1  # a freed block keeps its data for the prefix cache
            if block.ref_count == 0:
                self._free[block.block_id] = None
        del seq.block_table[num_kept:]
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, num_kept)
        seq.num_window_passed_blocks = min(seq.num_window_passed_blocks, num_kept)
