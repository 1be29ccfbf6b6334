"""The paged KV cache outside the engine (SequenceCache): what a pass writes into its pool,
rollback by truncate, bounds, sizing, and the metadata each append describes."""

from __future__ import annotations

import pytest
import torch

from fastdraft.model_config import ModelConfig
from fastdraft.layers.kv_cache import PagedKVCache, SequenceCache
from tests.helpers import append_pass


def _ids(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))  # [n]


def _by_position(pool: torch.Tensor) -> torch.Tensor:
    """A SequenceCache's pool [layers, blocks, kv_heads, block_size, dim] as [layers, kv_heads,
    positions, dim]: its positions lie in blocks 0, 1, 2, ... in order."""
    layers, blocks, kv_heads, block_size, dim = pool.shape
    return pool.transpose(1, 2).reshape(layers, kv_heads, blocks * block_size, dim)


@pytest.mark.parametrize("path", ["module", "fused"])
@torch.inference_mode()
def test_passes_write_every_appended_position_and_nothing_past_the_sequence(tiny_loaded, path):
    # The C++ step writes the pool itself, the module path through PagedKVCache.update: either
    # way every layer's keys and values of positions 0..99 land in the pool, and the 28 slots
    # past the sequence stay zero.
    model, config = tiny_loaded.model, tiny_loaded.config
    decoder = model.fused_decoder() if path == "fused" else None
    if path == "fused" and decoder is None:
        pytest.skip("no C++ step without fastdraft's CPU kernels")
    cache = SequenceCache.from_config(config, 128, dtype=torch.float32)
    pool = cache.kv_cache
    ids = _ids(config.vocab_size, 100, 0)
    append_pass(model, cache, ids[:10], decoder)
    for pos in range(10, 100):
        append_pass(model, cache, ids[pos:pos + 1], decoder)
    assert cache.num_tokens == 100
    for buffer in (pool.k, pool.v):
        keys = _by_position(buffer)
        assert keys[:, :, :100].abs().sum(dim=-1).min() > 0
        assert keys[:, :, 100:].abs().max() == 0


@torch.inference_mode()
def test_truncate_then_refeed_same_tokens_reproduces_logits(tiny_loaded):
    model, config = tiny_loaded.model, tiny_loaded.config
    cache = SequenceCache.from_config(config, 64, dtype=torch.float32)
    ids = _ids(config.vocab_size, 20, 1)
    append_pass(model, cache, ids[:10])
    original = [append_pass(model, cache, ids[p:p + 1], logit_rows=[0]) for p in range(10, 20)]
    cache.truncate(14)
    assert cache.num_tokens == 14
    for p in range(14, 20):
        # The same token over the same keys in the same shape: the same bits.
        assert torch.equal(append_pass(model, cache, ids[p:p + 1], logit_rows=[0]), original[p - 10])


@torch.inference_mode()
def test_truncate_then_feed_different_tokens_equals_fresh_run(tiny_loaded):
    model, config = tiny_loaded.model, tiny_loaded.config

    def fresh() -> SequenceCache:
        return SequenceCache.from_config(config, 64, dtype=torch.float32)

    cache = fresh()
    ids = _ids(config.vocab_size, 20, 2)
    append_pass(model, cache, ids[:12])
    for p in range(12, 20):
        append_pass(model, cache, ids[p:p + 1])
    cache.truncate(15)
    other = _ids(config.vocab_size, 5, 3)
    assert not torch.equal(other, ids[15:20])
    new_seq = torch.cat([ids[:15], other])
    # Verification shape after rollback: all five new tokens in one pass, over stale keys at 15..19.
    got = model.compute_logits(append_pass(model, cache, other))  # [5, vocab]
    ref = model.compute_logits(append_pass(model, fresh(), new_seq))  # [20, vocab]
    torch.testing.assert_close(got, ref[15:], atol=1e-5, rtol=0)
    # And the stale tokens really influenced the old logits (the check above is not vacuous).
    old = model.compute_logits(append_pass(model, fresh(), ids))
    assert (old[15:] - ref[15:]).abs().max() > 1e-3


def _small_cache(max_seq_len: int = 8, block_size: int = 4) -> SequenceCache:
    num_blocks = -(-max_seq_len // block_size)
    return SequenceCache(PagedKVCache(1, num_blocks, 1, block_size, 4, dtype=torch.float32), max_seq_len)


def test_bad_truncate_raises():
    cache = _small_cache()
    cache.append([1] * 5)
    with pytest.raises(ValueError):
        cache.truncate(6)
    with pytest.raises(ValueError):
        cache.truncate(-1)
    assert cache.num_tokens == 5
    cache.truncate(5)
    cache.truncate(0)
    assert cache.num_tokens == 0


def test_overflow_beyond_max_seq_len_raises_and_leaves_length():
    cache = _small_cache()
    cache.append([1] * 6)
    with pytest.raises(ValueError, match="cannot append 3 tokens after 6"):
        cache.append([1] * 3)
    assert cache.num_tokens == 6
    with pytest.raises(ValueError):
        cache.append([])  # nothing to append is refused too
    assert cache.num_tokens == 6
    cache.append([1, 2])  # exactly full is fine
    with pytest.raises(ValueError):
        cache.append([1])
    assert cache.num_tokens == 8


def test_invalid_sizes_raise():
    with pytest.raises(ValueError):
        _small_cache(max_seq_len=0)
    with pytest.raises(ValueError, match="max_seq_len"):  # more than the pool's 2 blocks of 4 hold
        SequenceCache(PagedKVCache(1, 2, 1, 4, 4), 9)
    for dims in ((0, 2, 1, 4, 4), (1, 0, 1, 4, 4), (1, 2, 1, 0, 4)):
        with pytest.raises(ValueError, match="positive"):
            PagedKVCache(*dims)


def test_append_metadata_crosses_blocks_and_reset_starts_over():
    cache = _small_cache(max_seq_len=12)  # blocks 0, 1, 2 of 4 tokens
    ids, meta = cache.append(torch.tensor([[7, 8, 9]]))  # a [1, T] tensor is flattened
    assert ids.tolist() == [7, 8, 9] and ids.dtype == torch.int64
    assert meta.positions.tolist() == [0, 1, 2] and meta.slot_mapping.tolist() == [0, 1, 2]
    assert meta.query_start_loc == [0, 3] and meta.context_lens == [3] and meta.block_tables.tolist() == [[0]]
    # Three tokens after three cached ones: the last two in block 1, which joins the table.
    ids, meta = cache.append([4, 5, 6])
    assert meta.positions.tolist() == [3, 4, 5] and meta.slot_mapping.tolist() == [3, 4, 5]
    assert meta.num_tokens == 3 and meta.num_seqs == 1
    assert meta.context_lens == [6] and meta.block_tables.tolist() == [[0, 1]]
    assert cache.num_tokens == 6
    cache.reset()
    assert cache.num_tokens == 0
    _, meta = cache.append([1, 2])
    assert meta.positions.tolist() == [0, 1] and meta.context_lens == [2]


def test_from_config_sizing():
    config = ModelConfig(model_type="qwen2", vocab_size=100, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    cache = SequenceCache.from_config(config, 100, dtype=torch.bfloat16)
    pool = cache.kv_cache
    # 100 tokens in blocks of 16: 7 blocks, [layers, blocks, kv_heads, block_size, head_dim].
    assert pool.k.shape == pool.v.shape == (3, 7, 2, 16, 16)
    assert pool.k.dtype == torch.bfloat16 and cache.max_seq_len == 100 and cache.num_tokens == 0
    assert pool.num_bytes == 2 * 3 * 7 * 2 * 16 * 16 * 2
    assert SequenceCache.from_config(config, 100, block_size=32).kv_cache.k.shape == (3, 4, 2, 32, 16)
    # Capped at the model's context length.
    assert SequenceCache.from_config(config, 10_000).max_seq_len == 512
    # An explicit head_dim (not hidden // heads) is honoured.
    config.head_dim = 32
    assert SequenceCache.from_config(config, 8, dtype=torch.float32).kv_cache.k.shape == (3, 1, 2, 16, 32)


def test_a_pool_is_resident_only_where_written():
    # The server's default pool (a quarter of the memory) must not show up in RSS unused.
    def rss_mib() -> float:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024

    before = rss_mib()
    cache = PagedKVCache(8, 4096, 2, 16, 64, dtype=torch.bfloat16)  # k and v: 128 MiB each
    assert cache.k.numel() * 2 * 2 == 256 << 20
    assert rss_mib() - before < 32
    cache.k[:, :64].fill_(1.0)  # 64 of 4096 blocks in each layer
    assert rss_mib() - before < 64
