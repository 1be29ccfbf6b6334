"""The pre-allocated KV cache: no reallocation, rollback by truncate, bounds, sizing."""

from __future__ import annotations

import pytest
import torch

from fastdraft.config import ModelConfig
from fastdraft.engine.generate import check_request, decode_one_token, generate_token_ids, prefill
from fastdraft.layers.kv_cache import AttentionMetadata, KVCache
from fastdraft.sampling_params import SamplingParams


def _ids(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_buffers_are_never_reallocated(tiny_loaded):
    model, config = tiny_loaded.model, tiny_loaded.config
    kv = KVCache.from_config(config, 128, dtype=torch.float32)
    k_ptr, v_ptr, shape = kv.k.data_ptr(), kv.v.data_ptr(), kv.k.shape
    ids = _ids(config.vocab_size, 100, 0)
    prefill(model, ids[:, :10], kv)
    for pos in range(10, 100):
        decode_one_token(model, ids[:, pos:pos + 1], kv)
        assert kv.k.data_ptr() == k_ptr and kv.v.data_ptr() == v_ptr
    assert kv.k.shape == shape and kv.seq_lens == [100]
    # Something was actually written: the live prefix is non-zero, the tail still zero.
    assert kv.k[:, 0, :, :100].abs().sum(dim=-1).min() > 0
    assert kv.k[:, 0, :, 100:].abs().max() == 0


@torch.inference_mode()
def test_truncate_then_refeed_same_tokens_reproduces_logits(tiny_loaded):
    model, config = tiny_loaded.model, tiny_loaded.config
    kv = KVCache.from_config(config, 64, dtype=torch.float32)
    ids = _ids(config.vocab_size, 20, 1)
    prefill(model, ids[:, :10], kv)
    original = [decode_one_token(model, ids[:, p:p + 1], kv) for p in range(10, 20)]
    kv.truncate(14)
    assert kv.seq_lens[0] == 14
    for p in range(14, 20):
        again = decode_one_token(model, ids[:, p:p + 1], kv)
        torch.testing.assert_close(again, original[p - 10], atol=1e-6, rtol=0)


@torch.inference_mode()
def test_truncate_then_feed_different_tokens_equals_fresh_run(tiny_loaded):
    model, config = tiny_loaded.model, tiny_loaded.config
    kv = KVCache.from_config(config, 64, dtype=torch.float32)
    ids = _ids(config.vocab_size, 20, 2)
    prefill(model, ids[:, :12], kv)
    for p in range(12, 20):
        decode_one_token(model, ids[:, p:p + 1], kv)
    kv.truncate(15)
    other = _ids(config.vocab_size, 5, 3)
    assert not torch.equal(other, ids[:, 15:20])
    new_seq = torch.cat([ids[:, :15], other], dim=1)
    # Verification shape after rollback: all five new tokens in one pass.
    meta = kv.append(5)
    got = model.compute_logits(model(other, kv, meta))
    fresh = KVCache.from_config(config, 64, dtype=torch.float32)
    ref = model.compute_logits(model(new_seq, fresh, fresh.append(20)))
    torch.testing.assert_close(got, ref[:, 15:], atol=1e-5, rtol=0)
    # And the stale tokens really influenced the old logits (the check above is not vacuous).
    kv2 = KVCache.from_config(config, 64, dtype=torch.float32)
    old = model.compute_logits(model(ids, kv2, kv2.append(20)))
    assert (old[:, 15:] - ref[:, 15:]).abs().max() > 1e-3


def test_bad_truncate_raises():
    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=8, dtype=torch.float32)
    kv.append(5)
    with pytest.raises(ValueError):
        kv.truncate(6)
    with pytest.raises(ValueError):
        kv.truncate(-1)
    assert kv.seq_lens == [5]
    kv.truncate(5)
    kv.truncate(0)
    assert kv.seq_lens == [0]


def test_overflow_beyond_max_seq_len_raises_and_leaves_length():
    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=8, dtype=torch.float32)
    kv.append(6)
    with pytest.raises(ValueError, match="max_seq_len"):
        kv.append(3)
    assert kv.seq_lens == [6]
    kv.append(2)  # exactly full is fine
    with pytest.raises(ValueError):
        kv.append(1)


def test_invalid_sizes_raise():
    with pytest.raises(ValueError):
        KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=0)
    with pytest.raises(ValueError):
        KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=4, max_batch_size=0)


def test_slots_are_independent_and_reset():
    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=8, max_batch_size=3)
    kv.append(4, slot=1)
    kv.append(2, slot=2)
    assert kv.seq_lens == [0, 4, 2]
    meta = kv.append(3, slot=1)
    assert meta.positions.tolist() == [[4, 5, 6]] and meta.slot_ids.tolist() == [1]
    assert meta.context_len == 7 and not meta.is_prefill
    kv.reset(slot=1)
    assert kv.seq_lens == [0, 0, 2]
    kv.reset()
    assert kv.seq_lens == [0, 0, 0]


def test_from_config_sizing():
    config = ModelConfig(model_type="qwen2", vocab_size=100, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    kv = KVCache.from_config(config, 100, max_batch_size=2, dtype=torch.bfloat16)
    assert kv.k.shape == kv.v.shape == (3, 2, 2, 100, 16)
    assert kv.k.dtype == torch.bfloat16 and kv.max_seq_len == 100 and kv.max_batch_size == 2
    assert kv.num_bytes == 2 * 3 * 2 * 2 * 100 * 16 * 2
    # Capped at the model's context length.
    assert KVCache.from_config(config, 10_000).max_seq_len == 512
    # An explicit head_dim (not hidden // heads) is honoured.
    config.head_dim = 32
    assert KVCache.from_config(config, 8, dtype=torch.float32).k.shape == (3, 1, 2, 8, 32)


def test_contiguous_metadata():
    prefill_meta = AttentionMetadata.contiguous(0, 5)
    assert prefill_meta.is_prefill and prefill_meta.attn_mask is None
    decode_meta = AttentionMetadata.contiguous(7, 1)
    assert not decode_meta.is_prefill and decode_meta.attn_mask is None
    assert decode_meta.context_len == 8
    verify = AttentionMetadata.contiguous(4, 3)
    assert verify.attn_mask.shape == (1, 1, 3, 7)
    # Token at position 5 sees keys 0..5 only.
    assert verify.attn_mask[0, 0, 1].tolist() == [True] * 6 + [False]
    # A single token at position 0 is not a prefill of several tokens but sees only itself.
    first = AttentionMetadata.contiguous(0, 1)
    assert first.context_len == 1


def test_request_that_does_not_fit_is_rejected_before_work(tiny_loaded):
    kv = KVCache.from_config(tiny_loaded.config, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="exceeds"):
        check_request(10, SamplingParams(max_new_tokens=7), kv.max_seq_len)
    check_request(10, SamplingParams(max_new_tokens=6), kv.max_seq_len)
    with pytest.raises(ValueError, match="empty"):
        check_request(0, SamplingParams(), kv.max_seq_len)
    gen = generate_token_ids(tiny_loaded.model, list(range(3, 13)), SamplingParams(max_new_tokens=7), kv, [])
    with pytest.raises(ValueError):
        next(gen)
    assert kv.seq_lens == [0]
