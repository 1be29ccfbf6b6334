"""ModelConfig: reading HF config.json files (old and transformers-5 layouts) and validation."""

from __future__ import annotations

import json

import pytest

from fastdraft.model_config import ModelConfig

BASE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_defaults_and_derived_fields():
    c = ModelConfig(**BASE)
    assert c.head_dim == 16 and c.rope_theta == 10000.0 and c.eos_token_ids == []
    assert ModelConfig(**BASE, eos_token_id=5).eos_token_ids == [5]
    assert ModelConfig(**BASE, eos_token_id=[5, 6]).eos_token_ids == [5, 6]


def test_kv_bytes_per_token_matches_the_cache_it_sizes():
    import torch

    from fastdraft.layers.kv_cache import PagedKVCache

    c = ModelConfig(**BASE)
    # Three blocks of 8 tokens: 24 cached tokens' worth of keys and values.
    cache = PagedKVCache.from_config(c, num_blocks=3, block_size=8, dtype=torch.bfloat16)
    assert c.kv_bytes_per_token(2) * 24 == cache.num_bytes
    assert c.kv_bytes_per_token(2) * 8 == PagedKVCache.bytes_per_block(c, 8, torch.bfloat16)


def test_qwen2_implies_attention_bias():
    assert ModelConfig.from_dict(dict(BASE, model_type="qwen2")).attention_bias
    assert not ModelConfig.from_dict(dict(BASE, model_type="qwen2", attention_bias=False)).attention_bias
    assert not ModelConfig.from_dict(BASE).attention_bias


def test_old_style_rope_fields():
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    c = ModelConfig.from_dict(dict(BASE, rope_theta=500000.0, rope_scaling=scaling))
    assert c.rope_theta == 500000.0 and c.rope_scaling == scaling


def test_transformers5_rope_parameters():
    """transformers >= 5 saves rope_theta and the scaling under rope_parameters."""
    c = ModelConfig.from_dict(dict(BASE, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}))
    assert c.rope_theta == 1e6 and c.rope_scaling is None
    params = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    c = ModelConfig.from_dict(dict(BASE, rope_parameters=params))
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == {k: v for k, v in params.items() if k != "rope_theta"}
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig.from_dict(dict(BASE, rope_parameters={"rope_theta": 1.0, "rope_type": "yarn", "factor": 4.0}))


def test_transformers5_config_file_round_trip(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(**{k: v for k, v in BASE.items() if k != "model_type"}, rope_theta=1e6,
                max_position_embeddings=1024).save_pretrained(tmp_path)
    c = ModelConfig.from_file(tmp_path / "config.json")
    assert (c.model_type, c.rope_theta, c.max_position_embeddings, c.attention_bias) == ("qwen2", 1e6, 1024, True)
    assert c.torch_dtype in ("float32", "bfloat16")


def test_unknown_keys_kept_in_extra():
    c = ModelConfig.from_dict(dict(BASE, pretraining_tp=1, use_cache=True))
    assert c.extra == {"pretraining_tp": 1, "use_cache": True}
    d = c.to_hf_dict()
    assert d["pretraining_tp"] == 1 and d["architectures"] == ["LlamaForCausalLM"]
    assert "sliding_window" not in d  # an architecture's optional field, unset, is left out


@pytest.mark.parametrize("overrides,match", [
    ({"model_type": "gemma3"}, "unsupported model_type"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"hidden_size": 66}, "divisible"),
    ({"hidden_size": 36, "num_attention_heads": 4, "num_key_value_heads": 4}, "even"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
])
def test_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(dict(BASE, **overrides))


def test_from_file_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        ModelConfig.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        ModelConfig.from_file(tmp_path / "bad.json")
    (tmp_path / "none.json").write_text(json.dumps({"vocab_size": 3}))
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_file(tmp_path / "none.json")
