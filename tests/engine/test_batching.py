"""Batched forward passes: sequences at different positions in different cache slots give the
same logits as each sequence run alone."""

from __future__ import annotations

import pytest
import torch

from fastdraft.layers.kv_cache import AttentionMetadata, KVCache

ATOL = 1e-5


@pytest.fixture(scope="module")
def model_and_config(qwen2_loaded):
    return qwen2_loaded.model, qwen2_loaded.config


def _seqs(vocab_size: int, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (1, n), generator=g) for n in lengths]


@torch.inference_mode()
def _alone(model, config, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits of positions prompt_len-1 .. end for one sequence run alone (prefill + decode)."""
    kv = KVCache.from_config(config, 64, dtype=torch.float32)
    out = [model.compute_logits(model(ids[:, :prompt_len], kv, kv.append(prompt_len)))[:, -1]]
    for pos in range(prompt_len, ids.shape[1]):
        out.append(model.compute_logits(model(ids[:, pos:pos + 1], kv, kv.append(1)))[:, -1])
    return torch.cat(out)  # [steps, vocab]


@torch.inference_mode()
def test_batched_decode_at_different_positions(model_and_config):
    model, config = model_and_config
    prompt_lens = [3, 9, 6]
    steps = 5
    seqs = _seqs(config.vocab_size, [n + steps for n in prompt_lens])
    # Slots deliberately not in batch order, and one slot left unused.
    slots = [3, 0, 2]
    kv = KVCache.from_config(config, 64, max_batch_size=4, dtype=torch.float32)
    first = []
    for ids, n, slot in zip(seqs, prompt_lens, slots):
        first.append(model.compute_logits(model(ids[:, :n], kv, kv.append(n, slot)))[:, -1])
    batched = [torch.cat(first)]  # [batch, vocab]
    for step in range(steps):
        positions = torch.tensor([[n + step] for n in prompt_lens])
        meta = AttentionMetadata.batched(positions, torch.tensor(slots))
        assert meta.context_len == max(prompt_lens) + step + 1
        tokens = torch.cat([ids[:, n + step:n + step + 1] for ids, n in zip(seqs, prompt_lens)])
        hidden = model(tokens, kv, meta)
        batched.append(model.compute_logits(hidden[:, -1]))
        for slot in slots:
            kv.seq_lens[slot] += 1
    batched = torch.stack(batched, dim=1)  # [batch, steps + 1, vocab]
    for b, (ids, n) in enumerate(zip(seqs, prompt_lens)):
        torch.testing.assert_close(batched[b], _alone(model, config, ids, n), atol=ATOL, rtol=0,
                                   msg=f"sequence {b}")


@torch.inference_mode()
def test_batched_multi_token_append_ignores_stale_cache_entries(model_and_config):
    """Several new tokens per sequence (verification shape) at different starts; the shorter
    sequence's slot holds stale keys from an earlier, longer sequence that must stay masked."""
    model, config = model_and_config
    kv = KVCache.from_config(config, 64, max_batch_size=2, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    # Fill slot 1 with 20 junk tokens, then roll it back: the junk stays in the buffer.
    junk = torch.randint(3, config.vocab_size, (1, 20), generator=g)
    model(junk, kv, kv.append(20, slot=1))
    kv.reset(slot=1)
    a, b = _seqs(config.vocab_size, [14, 7], seed=6)
    model(a[:, :10], kv, kv.append(10, slot=0))
    model(b[:, :3], kv, kv.append(3, slot=1))
    n_new = 4
    positions = torch.tensor([list(range(10, 14)), list(range(3, 7))])
    meta = AttentionMetadata.batched(positions, torch.tensor([0, 1]))
    tokens = torch.cat([a[:, 10:14], b[:, 3:7]])
    logits = model.compute_logits(model(tokens, kv, meta))  # [2, 4, vocab]

    for row, (ids, start) in enumerate(((a, 10), (b, 3))):
        alone = KVCache.from_config(config, 64, dtype=torch.float32)
        ref = model.compute_logits(model(ids[:, :start + n_new], alone, alone.append(start + n_new)))
        torch.testing.assert_close(logits[row], ref[0, start:], atol=ATOL, rtol=0, msg=f"row {row}")


@torch.inference_mode()
def test_batched_prefill_of_equal_lengths_matches_single(model_and_config):
    """Two prompts prefilled together through the general (batched) path."""
    model, config = model_and_config
    a, b = _seqs(config.vocab_size, [8, 8], seed=7)
    kv = KVCache.from_config(config, 32, max_batch_size=2, dtype=torch.float32)
    positions = torch.arange(8).repeat(2, 1)
    meta = AttentionMetadata.batched(positions, torch.tensor([1, 0]))
    logits = model.compute_logits(model(torch.cat([a, b]), kv, meta))
    for row, ids in enumerate((a, b)):
        alone = KVCache.from_config(config, 32, dtype=torch.float32)
        ref = model.compute_logits(model(ids, alone, alone.append(8)))
        torch.testing.assert_close(logits[row], ref[0], atol=ATOL, rtol=0)
    # Each sequence's keys landed in its own slot: slot 1 holds a's keys, slot 0 b's.
    alone = KVCache.from_config(config, 32, dtype=torch.float32)
    model(a, alone, alone.append(8))
    torch.testing.assert_close(kv.k[:, 1, :, :8], alone.k[:, 0, :, :8], atol=ATOL, rtol=0)


def test_batched_metadata_validation():
    with pytest.raises(ValueError):
        AttentionMetadata.batched(torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError):
        AttentionMetadata.batched(torch.zeros(2, 1, dtype=torch.long), torch.tensor([0, 1, 2]))
    meta = AttentionMetadata.batched(torch.tensor([[4, 5], [0, 1]]), torch.tensor([0, 1]))
    assert meta.context_len == 6 and meta.attn_mask.shape == (2, 1, 2, 6)
    assert meta.attn_mask[1, 0, 0].tolist() == [True, False, False, False, False, False]
    assert meta.attn_mask[0, 0, 1].all()
