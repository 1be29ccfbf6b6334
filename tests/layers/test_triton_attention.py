"""The Triton paged attention and KV write against their PyTorch twins: on a GPU when there is
one, else through Triton's interpreter on the CPU (fp32, tiny shapes)."""

from __future__ import annotations

import math

import pytest
import torch

from fastdraft.kernels import triton_attention
from fastdraft.kernels.ops.attention_ops import reference_paged_attention
from fastdraft.layers.kv_cache import PagedAttentionMetadata

pytestmark = pytest.mark.skipif(not triton_attention.is_available(), reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    pytestmark = [pytestmark, pytest.mark.skipif(
        __import__("os").environ.get("TRITON_INTERPRET") != "1",
        reason="Triton runs on the CPU only through its interpreter (TRITON_INTERPRET=1, set by conftest)")]

BLOCK_SIZE = 16


def _sequences(spans: list[tuple[int, int]], num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
               seed: int = 0):
    """A pool of random keys and values, and sequences given as (new tokens, context length),
    each with random query rows and its blocks scattered through the pool."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-ctx // BLOCK_SIZE) for _, ctx in spans) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_blocks = torch.randn(num_blocks, num_kv_heads, BLOCK_SIZE, head_dim, generator=gen).to(dtype)
    v_blocks = torch.randn(num_blocks, num_kv_heads, BLOCK_SIZE, head_dim, generator=gen).to(dtype)
    seqs = []
    for num_new, ctx in spans:
        q = torch.randn(num_new, num_kv_heads * group, head_dim, generator=gen).to(dtype)
        seqs.append((q, [order.pop() for _ in range(-(-ctx // BLOCK_SIZE))], ctx))
    return k_blocks, v_blocks, seqs


def _flat(seqs) -> tuple[torch.Tensor, PagedAttentionMetadata]:
    """The flat batch of ``seqs`` (from :func:`_sequences`), in that order: queries and metadata."""
    tables = torch.zeros(len(seqs), max(len(blocks) for _, blocks, _ in seqs), dtype=torch.long)
    query_start_loc, positions, slots = [0], [], []
    for i, (q, blocks, ctx) in enumerate(seqs):
        tables[i, :len(blocks)] = torch.tensor(blocks)
        query_start_loc.append(query_start_loc[-1] + q.shape[0])
        for position in range(ctx - q.shape[0], ctx):
            positions.append(position)
            slots.append(blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
    meta = PagedAttentionMetadata(torch.tensor(positions), torch.tensor(slots), query_start_loc,
                                  [ctx for _, _, ctx in seqs], tables)
    return torch.cat([q for q, _, _ in seqs]), meta


def _batch(spans, num_kv_heads, group, head_dim, dtype, seed=0):
    k_blocks, v_blocks, seqs = _sequences(spans, num_kv_heads, group, head_dim, dtype, seed)
    q, meta = _flat(seqs)
    return q, k_blocks, v_blocks, meta


def _triton(q, k_blocks, v_blocks, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    move = (lambda t: t.to(DEVICE))
    out = triton_attention.triton_paged_attention(
        move(q), move(k_blocks), move(v_blocks), move(meta.block_tables.to(torch.int32)),
        move(torch.tensor(meta.context_lens, dtype=torch.int32)),
        move(torch.tensor(meta.query_start_loc, dtype=torch.int32)), max(meta.context_lens), scale)
    return out.cpu()


# (new tokens, context length) per sequence: decode rows, a whole prompt, a chunk on cached
# blocks, speculative verification; lengths off the block and tile boundaries.
MIXED = [(1, 37), (20, 20), (5, 40), (3, 17), (1, 1), (9, 64)]


@pytest.mark.parametrize("group", [1, 2, 7])
def test_mixed_batch_matches_the_twin(group):
    q, k_blocks, v_blocks, meta = _batch(MIXED, num_kv_heads=2, group=group, head_dim=16, dtype=torch.float32)
    scale = 1 / math.sqrt(16)
    expected = reference_paged_attention(q, k_blocks, v_blocks, meta, scale)
    torch.testing.assert_close(_triton(q, k_blocks, v_blocks, meta, scale), expected, rtol=1e-5, atol=1e-5)


def test_split_keys_for_short_batches_match_the_twin(monkeypatch):
    monkeypatch.setattr(triton_attention, "SPLIT_CHUNK_KEYS", 32)  # chunks of 32 keys for one sequence
    spans = [(1, 150), (4, 90)]  # two sequences: chunks of 64 keys
    assert triton_attention.split_chunk_keys(len(spans)) == 64
    q, k_blocks, v_blocks, meta = _batch(spans, num_kv_heads=2, group=3, head_dim=24, dtype=torch.float32, seed=1)
    expected = reference_paged_attention(q, k_blocks, v_blocks, meta, 0.3)
    torch.testing.assert_close(_triton(q, k_blocks, v_blocks, meta, 0.3), expected, rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_its_batch_mates(monkeypatch):
    """In batches of the same size bucket, a sequence's rows are bit for bit the same whoever
    shares the step and wherever it sits in it, split into chunks or not."""
    for chunk_keys in (32, 4096):  # its 70 keys split into chunks, and whole
        monkeypatch.setattr(triton_attention, "SPLIT_CHUNK_KEYS", chunk_keys)
        k_blocks, v_blocks, seqs = _sequences([(2, 70), (6, 30), (1, 50), (4, 33), (3, 9)], 2, 2, 16, torch.float32,
                                              seed=3)
        first_q, first_meta = _flat([seqs[0], seqs[1], seqs[2]])  # 3 sequences: bucket 4
        second_q, second_meta = _flat([seqs[3], seqs[0], seqs[1], seqs[4]])  # 4 sequences: bucket 4
        first = _triton(first_q, k_blocks, v_blocks, first_meta, 0.25)
        second = _triton(second_q, k_blocks, v_blocks, second_meta, 0.25)
        assert torch.equal(first[:2], second[4:6])
        torch.testing.assert_close(first, reference_paged_attention(first_q, k_blocks, v_blocks, first_meta, 0.25),
                                   rtol=1e-5, atol=1e-5)


def test_kv_write_matches_the_twin():
    q, k_blocks, v_blocks, meta = _batch(MIXED, num_kv_heads=3, group=1, head_dim=16, dtype=torch.float32, seed=2)
    num_tokens = q.shape[0]
    k_new, v_new = torch.randn(num_tokens, 3, 16), torch.randn(num_tokens, 3, 16)
    slots = meta.slot_mapping.clone()
    slots[2] = -1  # skipped
    k_expected, v_expected = k_blocks.clone(), v_blocks.clone()
    keep = slots >= 0
    k_expected[slots[keep] // BLOCK_SIZE, :, slots[keep] % BLOCK_SIZE] = k_new[keep]
    v_expected[slots[keep] // BLOCK_SIZE, :, slots[keep] % BLOCK_SIZE] = v_new[keep]
    k_out, v_out = k_blocks.to(DEVICE), v_blocks.to(DEVICE)
    triton_attention.write_kv(k_new.to(DEVICE), v_new.to(DEVICE), k_out, v_out, slots.to(DEVICE))
    assert torch.equal(k_out.cpu(), k_expected) and torch.equal(v_out.cpu(), v_expected)


def test_split_chunks_follow_the_batch_bucket_only():
    assert triton_attention.split_chunk_keys(1) == triton_attention.SPLIT_CHUNK_KEYS
    assert triton_attention.split_chunk_keys(3) == triton_attention.split_chunk_keys(4)
    assert triton_attention.split_chunk_keys(triton_attention.MAX_SPLIT_BATCH + 1) == 0
