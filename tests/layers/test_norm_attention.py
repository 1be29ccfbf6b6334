"""RMSNorm against transformers, and paged attention against a naive reference."""

from __future__ import annotations

import pytest
import torch

from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.kernels.ops.attention_ops import MAX_CAUSAL_DECODE_TOKENS, paged_attention, paged_attention_kernel_applies
from fastdraft.layers.kv_cache import Span, flat_batch
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
    """Reference: repeat K/V per group, explicit mask key_pos <= query_pos, softmax.

    q [heads, num_new, dim], k/v [kv_heads, context_len, dim], positions [num_new]."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = (q @ k.transpose(-1, -2)) * scale  # [heads, num_new, context_len]
    key_pos = torch.arange(k.shape[1])
    allowed = key_pos[None, :] <= positions[:, None]  # [num_new, context_len]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _paged_batch(seqs, block_size, num_kv_heads, head_dim, num_heads, seed=2):
    """A flat batch of ``seqs`` [(new tokens, context length)] over a random pool, every slot
    random (the unused ones and those past each context too: keys to be masked), blocks handed
    out in reverse so no sequence's are in pool order: (q, k_blocks, v_blocks, meta, spans)."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-length // block_size) for _, length in seqs) + 1
    free = list(range(num_blocks))
    spans = []
    for num_new, length in seqs:
        table = [free.pop() for _ in range(-(-length // block_size))]
        spans.append(Span([0] * num_new, length - num_new, table))
    _, meta = flat_batch(spans, block_size, "cpu")
    k_blocks = torch.randn(num_blocks, num_kv_heads, block_size, head_dim) * 2
    v_blocks = torch.randn(num_blocks, num_kv_heads, block_size, head_dim)
    q = torch.randn(meta.num_tokens, num_heads, head_dim) * 2
    return q, k_blocks, v_blocks, meta, spans


# Sequences of a flat batch as (new tokens, context length).
CASES = {
    "prefill": [(6, 6)],
    "decode": [(1, 10)],
    "append": [(3, 8), (3, 5)],  # verification of two sequences at different positions
    # A prompt, a decode step, and a chunk after a cached prefix too long for one-token calls
    # (the masked path).
    "mixed": [(6, 6), (1, 10), (MAX_CAUSAL_DECODE_TOKENS + 4, 20)],
}


@pytest.mark.parametrize("head_dim,block_size", [(8, 4), (16, 6), (16, 4)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_naive(num_heads, num_kv_heads, case, head_dim, block_size):
    # head_dim 8 and block size 6 are outside the C++ kernel's shapes: PyTorch's path runs;
    # head_dim 16 in blocks of 4 runs the C++ kernel where the CPU kernels are built.
    scale = head_dim ** -0.5
    seqs = CASES[case]
    q, k_blocks, v_blocks, meta, spans = _paged_batch(seqs, block_size, num_kv_heads, head_dim, num_heads, seed=1)
    out = paged_attention(q, k_blocks, v_blocks, meta, scale)
    assert out.shape == q.shape
    is_kernel = head_dim == 16 and block_size == 4 and load_cpu_kernels() is not None
    assert paged_attention_kernel_applies(q, k_blocks) == is_kernel
    for i, (num_new, length) in enumerate(seqs):
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
        table = torch.tensor(spans[i].block_table)
        # [blocks, kv_heads, block_size, dim] -> [kv_heads, context_len, dim]
        k = k_blocks[table].transpose(0, 1).flatten(1, 2)[:, :length]
        v = v_blocks[table].transpose(0, 1).flatten(1, 2)[:, :length]
        expected = _naive(q[rows].transpose(0, 1), k, v, meta.positions[rows], scale)  # [heads, num_new, dim]
        torch.testing.assert_close(out[rows], expected.transpose(0, 1), atol=1e-5, rtol=1e-5,
                                   msg=f"sequence {i}")


# (window, sequences): windows starting inside, before and past the 256-key splits of the C++
# kernel; prefill chunks whose tokens' windows start in different splits.
WINDOWED = {
    "decode": (300, [(1, 600), (1, 40), (1, 257)]),
    "chunk": (37, [(40, 540), (3, 300)]),
    "prefill": (100, [(520, 520)]),
    "split_sized": (256, [(6, 700), (1, 256)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(WINDOWED))
def test_windowed_paged_attention_matches_naive(case, dtype):
    window, seqs = WINDOWED[case]
    num_heads, num_kv_heads, head_dim, scale = 4, 2, 32, 32 ** -0.5
    q, k_blocks, v_blocks, meta, spans = _paged_batch(seqs, 16, num_kv_heads, head_dim, num_heads)
    q, k_blocks, v_blocks = q.to(dtype), k_blocks.to(dtype), v_blocks.to(dtype)
    out = paged_attention(q, k_blocks, v_blocks, meta, scale, sliding_window=window)
    for i, (num_new, length) in enumerate(seqs):
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
        table = torch.tensor(spans[i].block_table)
        k = k_blocks[table].transpose(0, 1).flatten(1, 2)[:, :length].float()
        v = v_blocks[table].transpose(0, 1).flatten(1, 2)[:, :length].float()
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        qs = q[rows].transpose(0, 1).float()  # [heads, num_new, dim]
        scores = (qs @ k.transpose(-1, -2)) * scale
        key_pos, positions = torch.arange(length), meta.positions[rows]
        visible = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] > positions[:, None] - window)
        expected = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1) @ v
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(out[rows].transpose(0, 1).float(), expected, atol=tol, rtol=tol)


@pytest.mark.skipif(load_cpu_kernels() is None, reason="needs fastdraft's CPU kernels")
@pytest.mark.parametrize("window", [5, 300])
def test_a_windowed_token_attends_alike_alone_and_among_others(window):
    # Verification (several tokens of a sequence in one call, beside another sequence) gives
    # each token the bits a one-token decode step gives it.
    together = [(4, 530), (2, 90)]
    q, k_blocks, v_blocks, meta, spans = _paged_batch(together, 16, 2, 32, 4)
    q, k_blocks, v_blocks = q.bfloat16(), k_blocks.bfloat16(), v_blocks.bfloat16()
    out = paged_attention(q, k_blocks, v_blocks, meta, 32 ** -0.5, sliding_window=window)
    for t in range(4):  # token t of the first sequence, alone over the same cache
        span = Span([0], 530 - 4 + t, spans[0].block_table)
        _, alone_meta = flat_batch([span], 16, "cpu")
        alone = paged_attention(q[t:t + 1], k_blocks, v_blocks, alone_meta, 32 ** -0.5, sliding_window=window)
        assert torch.equal(alone, out[t:t + 1]), t
