"""Rotary embeddings: frequencies (default and llama3) against transformers, table growth."""

from __future__ import annotations

import math

import pytest
import torch

from fastdraft.kernels.reference import apply_rotary
from fastdraft.layers.rotary import RotaryEmbedding

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_default_inv_freq():
    rope = RotaryEmbedding(head_dim=64, theta=10000.0)
    expected = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    torch.testing.assert_close(rope.inv_freq(torch.device("cpu")), expected)


@pytest.mark.parametrize("head_dim,theta", [(64, 500000.0), (128, 500000.0), (16, 100.0)])
def test_llama3_inv_freq_matches_transformers(head_dim, theta):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(LLAMA3, original_max_position_embeddings=8192 if head_dim > 16 else 32)
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_theta=theta,
                      rope_scaling=scaling, max_position_embeddings=131072)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    ours = RotaryEmbedding(head_dim, theta, scaling).inv_freq(torch.device("cpu"))
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    plain = RotaryEmbedding(head_dim, theta).inv_freq(torch.device("cpu"))
    assert not torch.allclose(ours, plain)  # the scaling did something


def test_cos_sin_values_and_table_growth():
    rope = RotaryEmbedding(head_dim=8, theta=10000.0)
    positions = torch.tensor([[0, 1, 5000]])  # beyond the initial 4096-row table
    cos, sin = rope(positions, torch.float32)
    assert cos.shape == sin.shape == (1, 3, 8)
    inv = rope.inv_freq(torch.device("cpu"))
    for i, pos in enumerate((0, 1, 5000)):
        angles = torch.cat([pos * inv, pos * inv])
        torch.testing.assert_close(cos[0, i], angles.cos(), atol=1e-4, rtol=0)
        torch.testing.assert_close(sin[0, i], angles.sin(), atol=1e-4, rtol=0)
    assert rope._cos.shape[0] >= 5001
    cos16, _ = rope(positions, torch.bfloat16)
    assert cos16.dtype == torch.bfloat16


def test_apply_rotary_is_a_rotation():
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim=16, theta=10000.0)
    x = torch.randn(2, 3, 5, 16)
    positions = torch.arange(5).repeat(2, 1)
    cos, sin = rope(positions, torch.float32)
    y = apply_rotary(x, cos, sin)
    # Norm preserved; position 0 untouched; relative: <R(m)q, R(n)k> depends only on m - n.
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])
    q, k = torch.randn(16), torch.randn(16)

    def rot(v, pos):
        c, s = rope(torch.tensor([[pos]]), torch.float32)
        return apply_rotary(v.view(1, 1, 1, 16), c, s).flatten()

    assert math.isclose(float(rot(q, 7) @ rot(k, 3)), float(rot(q, 14) @ rot(k, 10)), rel_tol=1e-4)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
], ids=["linear", "dynamic", "yarn-qwen2.5", "yarn-reduced"])
def test_scaled_tables_match_transformers_past_the_original_context(scaling):
    """cos/sin at positions past the original context, as transformers' rotary embedding gives
    them (for dynamic NTK, a forward pass whose longest position is the last one asked for)."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    head_dim, theta, max_pos = 128, 1e6, 32768
    cfg = Qwen2Config(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=4, rope_theta=theta,
                      rope_scaling=dict(scaling), max_position_embeddings=max_pos)
    positions = torch.tensor([[0, 1, 4095, 32767, 40000, 131071]])
    hf_cos, hf_sin = Qwen2RotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions)
    ours = dict(scaling)
    if scaling["rope_type"] == "dynamic":
        ours["max_position_embeddings"] = max_pos
    cos, sin = RotaryEmbedding(head_dim, theta, ours)(positions, torch.float32)
    torch.testing.assert_close(cos, hf_cos, atol=2e-5, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=2e-5, rtol=0)
    plain_cos, _ = RotaryEmbedding(head_dim, theta)(positions, torch.float32)
    assert not torch.allclose(cos, plain_cos)  # the scaling did something


def test_unknown_or_incomplete_scalings_are_refused():
    from fastdraft.model_config import ModelConfig

    base = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'longrope'"):
        ModelConfig(**base, rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="needs original_max_position_embeddings"):
        ModelConfig(**base, rope_scaling={"rope_type": "yarn", "factor": 4.0})
