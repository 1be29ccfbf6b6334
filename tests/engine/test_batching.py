"""Flat batches over a shared paged cache: sequences at different positions, in blocks laid
out in any order, give the same logits as each sequence run alone in a cache of its own."""

from __future__ import annotations

import pytest
import torch

from fastdraft.layers.kv_cache import PagedAttentionMetadata, PagedKVCache, SequenceCache, Span, flat_batch
from tests.helpers import append_pass

ATOL = 1e-5
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_and_config(qwen2_loaded):
    return qwen2_loaded.model, qwen2_loaded.config


def _seqs(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def _tables(lengths: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Block tables for sequences of ``lengths`` tokens, their blocks drawn from a shuffled pool
    of ``num_blocks`` (not in sequence order, some left unused)."""
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lengths]


def _step(model, cache: PagedKVCache, spans: list[Span]) -> torch.Tensor:
    """One flat pass through the module path: the logits of every new token, [num_tokens, vocab]."""
    ids, meta = flat_batch(spans, BLOCK_SIZE, "cpu")
    return model.compute_logits(model(ids, meta.positions, cache, meta))


def _alone(model, config, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Logits of positions prompt_len-1 .. end for one sequence run alone (prefill + decode)."""
    cache = SequenceCache.from_config(config, 64, dtype=torch.float32, block_size=BLOCK_SIZE)
    out = [append_pass(model, cache, ids[:prompt_len], logit_rows=[prompt_len - 1])]
    for pos in range(prompt_len, len(ids)):
        out.append(append_pass(model, cache, ids[pos:pos + 1], logit_rows=[0]))
    return torch.cat(out)  # [steps, vocab]


@torch.inference_mode()
def test_batched_decode_at_different_positions(model_and_config):
    model, config = model_and_config
    prompt_lens = [3, 9, 6]
    steps = 5
    seqs = _seqs(config.vocab_size, [n + steps for n in prompt_lens])
    tables = _tables([len(s) for s in seqs], 12, seed=0)
    cache = PagedKVCache.from_config(config, 12, BLOCK_SIZE, dtype=torch.float32)
    first = [_step(model, cache, [Span(ids[:n], 0, table)])[-1] for ids, n, table in zip(seqs, prompt_lens, tables)]
    batched = [torch.stack(first)]  # [batch, vocab]
    for step in range(steps):
        spans = [Span(ids[n + step:n + step + 1], n + step, table) for ids, n, table in zip(seqs, prompt_lens, tables)]
        _, meta = flat_batch(spans, BLOCK_SIZE, "cpu")
        assert meta.context_lens == [n + step + 1 for n in prompt_lens]
        batched.append(_step(model, cache, spans))  # [batch, vocab]: one token a sequence
    batched = torch.stack(batched, dim=1)  # [batch, steps + 1, vocab]
    for b, (ids, n) in enumerate(zip(seqs, prompt_lens)):
        torch.testing.assert_close(batched[b], _alone(model, config, ids, n), atol=ATOL, rtol=0,
                                   msg=f"sequence {b}")


@torch.inference_mode()
def test_batched_multi_token_append_ignores_stale_cache_entries(model_and_config):
    """Several new tokens per sequence (verification shape) at different starts; the shorter
    sequence's blocks hold stale keys from an earlier, longer sequence that must stay masked."""
    model, config = model_and_config
    cache = PagedKVCache.from_config(config, 16, BLOCK_SIZE, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    # 20 junk tokens fill blocks 8..12; b then reuses them, as a block freed by a finished
    # sequence is reused: the junk stays in the buffer past b's length.
    junk = torch.randint(3, config.vocab_size, (20,), generator=g).tolist()
    _step(model, cache, [Span(junk, 0, [8, 9, 10, 11, 12])])
    a, b = _seqs(config.vocab_size, [14, 7], seed=6)
    table_a, table_b = [3, 0, 5, 1], [10, 8]
    _step(model, cache, [Span(a[:10], 0, table_a)])
    _step(model, cache, [Span(b[:3], 0, table_b)])
    n_new = 4
    logits = _step(model, cache, [Span(a[10:14], 10, table_a), Span(b[3:7], 3, table_b)])  # [2 * n_new, vocab]

    for row, (ids, start) in enumerate(((a, 10), (b, 3))):
        alone = SequenceCache.from_config(config, 64, dtype=torch.float32, block_size=BLOCK_SIZE)
        ref = model.compute_logits(append_pass(model, alone, ids[:start + n_new]))  # [start + n_new, vocab]
        torch.testing.assert_close(logits[row * n_new:(row + 1) * n_new], ref[start:], atol=ATOL, rtol=0,
                                   msg=f"sequence {row}")


@torch.inference_mode()
def test_batched_prefill_matches_single(model_and_config):
    """Two prompts of different lengths prefilled together in one flat pass."""
    model, config = model_and_config
    a, b = _seqs(config.vocab_size, [8, 5], seed=7)
    cache = PagedKVCache.from_config(config, 8, BLOCK_SIZE, dtype=torch.float32)
    tables = [[6, 1], [0, 4]]
    logits = _step(model, cache, [Span(a, 0, tables[0]), Span(b, 0, tables[1])])  # [13, vocab]
    rows = [slice(0, 8), slice(8, 13)]
    for ids, table, row in zip((a, b), tables, rows):
        alone = SequenceCache.from_config(config, 32, dtype=torch.float32, block_size=BLOCK_SIZE)
        ref = model.compute_logits(append_pass(model, alone, ids))
        torch.testing.assert_close(logits[row], ref, atol=ATOL, rtol=0)
        # Each sequence's keys landed in its own blocks, in order: [layers, kv_heads, positions, dim].
        for got, want in ((cache.k, alone.kv_cache.k), (cache.v, alone.kv_cache.v)):
            got = got[:, table].transpose(1, 2).flatten(2, 3)[:, :, :len(ids)]
            want = want[:, :len(table)].transpose(1, 2).flatten(2, 3)[:, :, :len(ids)]
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_flat_batch_lays_sequences_back_to_back():
    # A decode step, a verification across a block boundary and a prompt, each in its own blocks.
    spans = [Span([11], 6, [2, 5]), Span([12, 13, 14], 3, [7, 0]), Span([15, 16], 0, [4])]
    ids, meta = flat_batch(spans, BLOCK_SIZE, "cpu")
    assert ids.tolist() == [11, 12, 13, 14, 15, 16]
    assert meta.positions.tolist() == [6, 3, 4, 5, 0, 1]
    # block id * block_size + offset: position 6 in block 5, position 3 in block 7, 4 and 5 in block 0.
    assert meta.slot_mapping.tolist() == [5 * 4 + 2, 7 * 4 + 3, 0, 1, 4 * 4, 4 * 4 + 1]
    assert meta.query_start_loc == [0, 1, 4, 6] and meta.context_lens == [7, 6, 2]
    assert meta.query_start_loc_tensor.tolist() == [0, 1, 4, 6] and meta.context_lens_tensor.tolist() == [7, 6, 2]
    assert meta.block_tables.tolist() == [[2, 5], [7, 0], [4, 0]]  # shorter tables padded
    assert meta.num_tokens == 6 and meta.num_seqs == 3


def test_paged_metadata_validation():
    positions, slots = torch.arange(3), torch.arange(3)
    tables = torch.zeros(1, 1, dtype=torch.long)
    # [1, T] positions are refused: a flat batch is one row per token, its sequences delimited
    # by query_start_loc, so a leading batch dim could only be a caller's mistake.
    with pytest.raises(ValueError, match="num_tokens"):
        PagedAttentionMetadata(positions.view(1, 3), slots.view(1, 3), [0, 3], [3], tables)
    with pytest.raises(ValueError, match="num_tokens"):
        PagedAttentionMetadata(positions, slots[:2], [0, 3], [3], tables)
    with pytest.raises(ValueError, match="query_start_loc"):  # one sequence, two starts too many
        PagedAttentionMetadata(positions, slots, [0, 1, 2, 3], [3], tables)
    with pytest.raises(ValueError, match="query_start_loc"):  # ends short of the 3 tokens
        PagedAttentionMetadata(positions, slots, [0, 2], [3], tables)
    meta = PagedAttentionMetadata(positions, slots, [0, 3], [3], tables)
    assert meta.num_tokens == 3 and meta.num_seqs == 1 and meta.device == torch.device("cpu")
