"""Logits parity of our Llama/Qwen2 decoder with HF transformers on tiny random models."""

from __future__ import annotations

import pytest
import torch

from fastdraft.model_config import ModelConfig
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.models.files import build_model, load_state_dict
from tests.helpers import append_pass

ATOL = 1e-4
PROMPT_LEN = 12


def _ours(model_dir):
    config = ModelConfig.from_file(model_dir / "config.json")
    return build_model(config, load_state_dict(model_dir), torch.float32), config


@pytest.fixture(scope="module")
def pair(tiny_models, variant):
    """(our model, its config, HF reference, token ids [1, 24]) for one variant."""
    ours, config = _ours(tiny_models.dir(variant))
    hf = tiny_models.hf(variant)
    ids = torch.randint(3, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits  # [1, 24, vocab]
    # Real signal, not near-zero logits that would make any tolerance meaningless.
    assert ref.abs().max() > 0.5
    return ours, config, ref, ids


def test_config_read_from_hf_folder(tiny_models, variant):
    config = ModelConfig.from_file(tiny_models.dir(variant) / "config.json")
    hf_cfg = tiny_models.hf(variant).config
    assert config.num_hidden_layers == hf_cfg.num_hidden_layers
    assert config.num_key_value_heads == hf_cfg.num_key_value_heads
    assert config.head_dim == 16
    assert config.tie_word_embeddings == (variant == "llama_tied")
    assert config.attention_bias == (variant == "qwen2")
    expected_theta = {"llama": 10000.0, "llama_tied": 500000.0, "llama3_rope": 100.0, "qwen2": 1e6}[variant]
    assert config.rope_theta == expected_theta
    if variant == "llama3_rope":
        assert config.rope_scaling["rope_type"] == "llama3"
        assert config.rope_scaling["original_max_position_embeddings"] == 32
    else:
        assert config.rope_scaling is None


def test_tied_embeddings_share_storage(tiny_models):
    ours, _ = _ours(tiny_models.dir("llama_tied"))
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    untied, _ = _ours(tiny_models.dir("llama"))
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def _decoder(model, path: str):
    """None for the module path; the model's C++ step for "fused" (skipped without the kernels)."""
    if path == "module":
        return None
    decoder = model.fused_decoder()
    if decoder is None:
        pytest.skip("no C++ decoder step without fastdraft's CPU kernels")
    return decoder


@torch.inference_mode()
def test_prefill_logits_all_positions(pair):
    ours, config, ref, ids = pair
    cache = SequenceCache.from_config(config, 64, dtype=torch.float32)
    input_ids, meta = cache.append(ids[0, :PROMPT_LEN])
    assert meta.positions.tolist() == list(range(PROMPT_LEN)) and meta.context_lens == [PROMPT_LEN]
    logits = ours.compute_logits(ours(input_ids, meta.positions, cache.kv_cache, meta))
    assert logits.shape == (PROMPT_LEN, config.vocab_size)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref[0, :PROMPT_LEN], atol=ATOL, rtol=0)


@pytest.mark.parametrize("path", ["module", "fused"])
@torch.inference_mode()
def test_incremental_decode_matches_full_sequence(pair, path):
    ours, config, ref, ids = pair
    decoder = _decoder(ours, path)
    cache = SequenceCache.from_config(config, 64, dtype=torch.float32)
    last = append_pass(ours, cache, ids[0, :PROMPT_LEN], decoder, [PROMPT_LEN - 1])  # [1, vocab_size]
    torch.testing.assert_close(last, ref[0, PROMPT_LEN - 1:PROMPT_LEN], atol=ATOL, rtol=0)
    for pos in range(PROMPT_LEN, ids.shape[1]):
        logits = append_pass(ours, cache, ids[0, pos:pos + 1], decoder, [0])  # [1, vocab_size]
        torch.testing.assert_close(logits, ref[0, pos:pos + 1], atol=ATOL, rtol=0, msg=f"position {pos}")
    assert cache.num_tokens == ids.shape[1]


@pytest.mark.parametrize("path", ["module", "fused"])
@torch.inference_mode()
def test_multi_token_append_on_nonempty_cache(pair, path):
    """The speculative-verification shape: start > 0 and several new tokens at once."""
    ours, config, ref, ids = pair
    decoder = _decoder(ours, path)
    cache = SequenceCache.from_config(config, 64, dtype=torch.float32)
    append_pass(ours, cache, ids[0, :8], decoder)
    for start, n in ((8, 5), (13, 1), (14, 4), (18, 6)):
        input_ids, meta = cache.append(ids[0, start:start + n])
        assert meta.positions.tolist() == list(range(start, start + n)) and meta.context_lens == [start + n]
        logits = ours.logits(input_ids, meta.positions, cache.kv_cache, meta, list(range(n)), decoder)
        torch.testing.assert_close(logits, ref[0, start:start + n], atol=ATOL, rtol=0,
                                   msg=f"append of {n} at {start}")


@torch.inference_mode()
def test_bf16_close_to_fp32(tiny_models):
    """bf16 weights run and stay near the fp32 reference (loose: bf16 has ~3 digits)."""
    model_dir = tiny_models.dir("qwen2")
    config = ModelConfig.from_file(model_dir / "config.json")
    ours = build_model(config, load_state_dict(model_dir), torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    ids = torch.randint(3, config.vocab_size, (10,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = tiny_models.hf("qwen2")(ids[None]).logits[0]  # [10, vocab_size]
    cache = SequenceCache.from_config(config, 32, dtype=torch.bfloat16)
    logits = ours.compute_logits(append_pass(ours, cache, ids))  # [10, vocab_size]
    assert logits.dtype == torch.float32
    scale = ref.abs().max()
    assert (logits - ref).abs().max() < 0.1 * scale
