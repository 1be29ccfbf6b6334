"""Grouped-query attention of a flat batch over the paged KV cache."""

from __future__ import annotations

import torch

from fastdraft.kernels import triton_attention
from fastdraft.kernels.fused import paged_attention_kernel_applies, per_token_attention, sdpa
from fastdraft.kernels.fused import paged_attention as paged_attention_kernel
from fastdraft.layers.kv_cache import PagedAttentionMetadata

# Most tokens appended to a cached prefix that attend one token per call (speculative
# verification, as a one-token step does); more take the masked SDPA path.
MAX_CAUSAL_DECODE_TOKENS = 8


def paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, meta: PagedAttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention of a flat batch over a paged cache.

    q: [num_tokens, num_heads, head_dim]; k_blocks, v_blocks: [num_blocks, num_kv_heads,
    block_size, head_dim]. Returns [num_tokens, num_heads, head_dim].

    On CPUs with fastdraft's kernels, one C++ call reads every sequence's keys and values
    straight from its blocks and computes each query row as a one-token decode step would,
    whatever else the step holds: prefill, chunked prefill, decode and verification agree bit
    for bit. On a GPU with Triton, one Triton launch does the same for the whole step
    (``kernels/triton_attention.py``). Elsewhere, :func:`reference_paged_attention`, the twin
    both are tested against."""
    if paged_attention_kernel_applies(q, k_blocks):
        return paged_attention_kernel(q, k_blocks, v_blocks, meta.block_tables, meta.query_start_loc_tensor,
                                      meta.context_lens_tensor, scale)
    if triton_attention.applies(q, k_blocks):
        device_meta = meta.int32_tensors()
        return triton_attention.paged_attention(q, k_blocks, v_blocks, device_meta.block_tables,
                                                device_meta.seq_lens, device_meta.query_start_loc,
                                                meta.max_context_len, scale)
    return reference_paged_attention(q, k_blocks, v_blocks, meta, scale)


def reference_paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                              meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """:func:`paged_attention` in plain PyTorch: each sequence's keys are gathered and its new
    tokens attend: a whole prompt causally, a few tokens after cached ones each over its own
    prefix (as a one-token step does), a longer chunk through a mask."""
    num_heads, num_kv_heads, head_dim = q.shape[1], k_blocks.shape[1], k_blocks.shape[3]
    group = num_heads // num_kv_heads
    num_seqs = meta.block_tables.shape[0]
    # One gather per layer for every sequence: [num_seqs, max_blocks, kv_heads, block_size, dim]
    # -> [num_seqs, kv_heads, max_blocks * block_size, dim]; each sequence then reads a view.
    k_all = k_blocks[meta.block_tables].transpose(1, 2).reshape(num_seqs, num_kv_heads, -1, head_dim)
    v_all = v_blocks[meta.block_tables].transpose(1, 2).reshape(num_seqs, num_kv_heads, -1, head_dim)
    outs = []
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        num_new, context_len = end - start, meta.context_lens[i]
        k = k_all[i, :, :context_len].unsqueeze(0)  # [1, kv_heads, context_len, dim]
        v = v_all[i, :, :context_len].unsqueeze(0)
        q_seq = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, num_new, dim]
        if num_new == context_len and num_new > 1:
            out = sdpa(q_seq, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        elif num_new <= MAX_CAUSAL_DECODE_TOKENS:
            out = _per_token_grouped(q_seq, k, v, scale)
        else:
            key_pos = torch.arange(context_len, device=q.device)
            query_pos = key_pos[context_len - num_new:]
            mask = (key_pos[None, :] <= query_pos[:, None]).view(1, 1, num_new, context_len)
            out = sdpa(q_seq, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        outs.append(out[0].transpose(0, 1))  # [num_new, heads, dim]
    return torch.cat(outs)


def _per_token_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, heads, num_tokens, dim], the last num_tokens keys being the new tokens' own; each
    token attends over its own prefix as a one-token step does."""
    batch, num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # Fold each query group into the row axis, token-major, so every query row meets its own
    # kv head without repeating K/V.
    q_rows = q.reshape(batch, num_kv_heads, group, num_tokens, head_dim).transpose(2, 3)
    q_rows = q_rows.reshape(batch, num_kv_heads, num_tokens * group, head_dim)
    out = per_token_attention(q_rows, k, v, scale, num_tokens)
    out = out.view(batch, num_kv_heads, num_tokens, group, head_dim).transpose(2, 3)
    return out.reshape(batch, num_heads, num_tokens, head_dim)
