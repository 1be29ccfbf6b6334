"""RMSNorm against transformers, and cached attention against a naive reference."""

from __future__ import annotations

import pytest
import torch

from fastdraft.layers.attention import cached_attention
from fastdraft.layers.kv_cache import AttentionMetadata
from fastdraft.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    ours, ref = RMSNorm(32, eps=1e-5), LlamaRMSNorm(32, eps=1e-5)
    weight = torch.randn(32)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ref.weight.copy_(weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = (torch.randn(2, 5, 32) * 3).to(dtype)
    out = ours(x)
    assert out.dtype == dtype
    # fp32: the fused kernel sums squares in another order; bf16: the same roundings, exactly.
    tol = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(out, ref(x), atol=tol, rtol=tol)
    expected = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    torch.testing.assert_close(out.float(), expected, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def _naive(q, k, v, positions, scale):
    """Reference: repeat K/V per group, explicit mask key_pos <= query_pos, softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # [b, h, t, ctx]
    key_pos = torch.arange(k.shape[2])
    allowed = key_pos[None, None, :] <= positions[:, :, None]  # [b, t, ctx]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("case", ["prefill", "decode", "append"])
def test_cached_attention_matches_naive(num_heads, num_kv_heads, case):
    torch.manual_seed(1)
    head_dim, scale = 8, 8 ** -0.5
    if case == "prefill":
        meta = AttentionMetadata.contiguous(0, 6)
    elif case == "decode":
        meta = AttentionMetadata.contiguous(9, 1)
    else:
        meta = AttentionMetadata.batched(torch.tensor([[5, 6, 7], [2, 3, 4]]), torch.tensor([0, 1]))
    batch, num_tokens = meta.positions.shape
    ctx = meta.context_len
    q = torch.randn(batch, num_heads, num_tokens, head_dim) * 2
    k = torch.randn(batch, num_kv_heads, ctx, head_dim) * 2
    v = torch.randn(batch, num_kv_heads, ctx, head_dim)
    out = cached_attention(q, k, v, meta, scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out, _naive(q, k, v, meta.positions, scale), atol=1e-5, rtol=1e-5)
