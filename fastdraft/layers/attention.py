"""Grouped-query attention over the pre-allocated KV cache."""

from __future__ import annotations

import torch

from fastdraft.kernels.fused import decode_attention, paged_attention_kernel_applies, sdpa
from fastdraft.kernels.fused import paged_attention as paged_attention_kernel
from fastdraft.kernels.mode import is_batch_invariant
from fastdraft.layers.kv_cache import AttentionMetadata, PagedAttentionMetadata

# Most tokens appended to a cached prefix that attend through decode_attention's causal
# multi-token call (speculative verification); more take the masked SDPA path.
MAX_CAUSAL_DECODE_TOKENS = 8


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """Attention of new queries over cached keys/values.

    q: [batch, num_heads, num_tokens, head_dim]; k, v: [batch, num_kv_heads, context_len, head_dim].
    Returns [batch, num_heads, num_tokens, head_dim].
    """
    if isinstance(meta, PagedAttentionMetadata):
        return paged_attention(q, k, v, meta, scale)
    batch, num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    is_invariant = is_batch_invariant()
    if meta.is_prefill and not is_invariant:
        return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
    if meta.contiguous_start is not None and 1 < num_tokens and (num_tokens <= MAX_CAUSAL_DECODE_TOKENS
                                                                 or is_invariant):
        # A few tokens appended to a cached prefix (speculative verification), or in
        # batch-invariant mode any number: each token attends over exactly its visible prefix
        # with the arithmetic of a one-token decode step, as the paged attention computes every
        # row, so all of them give bit-identical outputs.
        keys = meta.contiguous_start + num_tokens
        return _grouped_attention(q, k[:, :, :keys], v[:, :, :keys], None, scale)
    if meta.is_prefill:
        return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
    return _grouped_attention(q, k, v, meta.attn_mask, scale)


def paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, meta: PagedAttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention of a flat batch over a paged cache.

    q: [1, num_heads, num_tokens, head_dim]; k_blocks, v_blocks: [num_blocks, num_kv_heads,
    block_size, head_dim]. Returns [1, num_heads, num_tokens, head_dim].

    On CPUs with fastdraft's kernels, one C++ call reads every sequence's keys and values
    straight from its blocks and computes each query row as a one-token decode step would,
    whatever else the step holds: prefill, chunked prefill, decode and verification agree bit
    for bit. Elsewhere (CUDA), each sequence's keys are gathered and its new tokens attend as
    they would in a contiguous cache: a whole prompt causally, a few tokens after cached ones
    each over its own prefix, a longer chunk through a mask."""
    if paged_attention_kernel_applies(q, k_blocks):
        q_flat = q[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
        out = paged_attention_kernel(q_flat, k_blocks, v_blocks, meta.block_tables, meta.query_start_loc_tensor,
                                     meta.context_lens_tensor, scale)
        return out.transpose(0, 1).unsqueeze(0)
    num_kv_heads, head_dim = k_blocks.shape[1], k_blocks.shape[3]
    num_seqs = meta.block_tables.shape[0]
    # One gather per layer for every sequence: [num_seqs, max_blocks, kv_heads, block_size, dim]
    # -> [num_seqs, kv_heads, max_blocks * block_size, dim]; each sequence then reads a view.
    k_all = k_blocks[meta.block_tables].transpose(1, 2).reshape(num_seqs, num_kv_heads, -1, head_dim)
    v_all = v_blocks[meta.block_tables].transpose(1, 2).reshape(num_seqs, num_kv_heads, -1, head_dim)
    outs = []
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        num_new, context_len = end - start, meta.context_lens[i]
        k, v = k_all[i, :, :context_len], v_all[i, :, :context_len]  # [kv_heads, context_len, dim]
        q_seq = q[:, :, start:end]
        if num_new == context_len and num_new > 1:
            group = q.shape[1] // num_kv_heads
            outs.append(sdpa(q_seq, k[None], v[None], is_causal=True, scale=scale, enable_gqa=group > 1))
        elif num_new <= MAX_CAUSAL_DECODE_TOKENS:
            outs.append(_grouped_attention(q_seq, k[None], v[None], None, scale))
        else:
            key_pos = torch.arange(context_len, device=q.device)
            query_pos = key_pos[context_len - num_new:]
            mask = (key_pos[None, :] <= query_pos[:, None]).view(1, 1, num_new, context_len)
            outs.append(_grouped_attention(q_seq, k[None], v[None], mask, scale))
    return torch.cat(outs, dim=2)


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """Without a mask, the new tokens are the last keys and attend causally."""
    batch, num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    if mask is None:
        # Fold each query group into the row axis, token-major, so every query row meets its
        # own kv head without repeating K/V: on CPU this is ~10x faster than enable_gqa.
        q_rows = q.reshape(batch, num_kv_heads, group, num_tokens, head_dim).transpose(2, 3)
        q_rows = q_rows.reshape(batch, num_kv_heads, num_tokens * group, head_dim)
        out = decode_attention(q_rows, k, v, scale, num_tokens)
        out = out.view(batch, num_kv_heads, num_tokens, group, head_dim).transpose(2, 3)
        return out.reshape(batch, num_heads, num_tokens, head_dim)
    q_grouped = q.reshape(batch, num_kv_heads, group * num_tokens, head_dim)
    if group > 1:
        mask = mask.repeat(1, 1, group, 1)  # [batch, 1, group * num_tokens, context_len]
    out = sdpa(q_grouped, k, v, attn_mask=mask, scale=scale)
    # reshape, not view: CUDA's attention kernels may return a non-contiguous layout.
    return out.reshape(batch, num_heads, num_tokens, head_dim)
