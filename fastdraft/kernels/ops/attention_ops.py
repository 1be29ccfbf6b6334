"""Paged attention of a flat batch: its metadata, the reference, the C++ kernel (CPU) and the
Triton kernel (GPU).

Every query row is computed as a one-token step over the same keys would compute it: prefill,
chunked prefill, decode and speculative verification agree bit for bit on each kernel. Sliding
windows and logit soft-caps run in the reference; the kernels take neither yet.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastdraft.kernels import triton_attention
from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.kernels.fused import cpu_extension_for

# Most tokens appended to a cached prefix that attend one token per call (speculative
# verification, as a one-token step does); more take the masked SDPA path.
MAX_CAUSAL_DECODE_TOKENS = 8


class DeviceMetadata(NamedTuple):
    """A step's metadata as int32 tensors on its device, for GPU kernels (built once a step)."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs]
    query_start_loc: torch.Tensor  # [num_seqs + 1]


class PagedAttentionMetadata:
    """A flat batch: the new tokens of many sequences back to back, each sequence at its own
    position, its keys and values in blocks of a :class:`PagedKVCache`.

    * ``positions`` [num_tokens]: the absolute position of each token in its sequence.
    * ``slot_mapping`` [num_tokens]: the cache slot each token's key and value go to
      (block id * block_size + offset in the block).
    * ``query_start_loc`` [num_seqs + 1]: sequence ``i``'s tokens are
      ``query_start_loc[i]:query_start_loc[i + 1]``.
    * ``context_lens`` [num_seqs]: the keys sequence ``i`` attends over after this step (its
      cached tokens plus its new ones, which are the last).
    * ``block_tables`` [num_seqs, max_blocks]: the blocks holding each sequence's positions.

    The model sees the batch as one matrix of rows, which is what keeps the linears at one
    matmul per layer for every sequence of the step.
    """

    def __init__(self, positions: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc: list[int],
                 context_lens: list[int], block_tables: torch.Tensor) -> None:
        if positions.dim() != 1 or slot_mapping.shape != positions.shape:
            raise ValueError("positions and slot_mapping must both be [num_tokens]")
        if len(query_start_loc) != len(context_lens) + 1 or query_start_loc[-1] != positions.shape[0]:
            raise ValueError("query_start_loc must be [num_seqs + 1] and end at num_tokens")
        self.positions = positions
        self.slot_mapping = slot_mapping
        self.query_start_loc = query_start_loc
        self.context_lens = context_lens
        # The same two as int64 host tensors, built once per step for the C++ attention.
        self.query_start_loc_tensor = torch.tensor(query_start_loc, dtype=torch.long)
        self.context_lens_tensor = torch.tensor(context_lens, dtype=torch.long)
        self.block_tables = block_tables
        self.num_tokens = positions.shape[0]
        self.num_seqs = len(context_lens)
        self.max_context_len = max(context_lens, default=0)
        self.device = positions.device
        self._int32: DeviceMetadata | None = None

    def int32_tensors(self) -> DeviceMetadata:
        """Block tables, context lengths and query offsets as int32 on the batch's device, made
        on first use and shared by every layer of the pass."""
        if self._int32 is None:
            lengths = torch.tensor([self.query_start_loc, [*self.context_lens, 0]], dtype=torch.int32)
            lengths = lengths.to(self.device, non_blocking=True)  # one copy for both
            self._int32 = DeviceMetadata(self.block_tables.to(torch.int32), lengths[1, :-1], lengths[0])
        return self._int32


# cuDNN's attention builds an execution plan for every new shape, and decoding changes the key
# length at every step: host time per call that would dominate a small model's decode step.
# The other CUDA backends need no per-shape setup.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         scale: float | None = None, is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, kept off the cuDNN backend on CUDA."""
    backends = sdpa_kernel(_CUDA_SDPA_BACKENDS) if q.device.type == "cuda" else contextlib.nullcontext()
    with backends:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal,
                                              enable_gqa=enable_gqa)


def per_token_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        num_tokens: int = 1) -> torch.Tensor:
    """Attention of a few new tokens' query rows q [B, H, R, D] over k/v [B, H, L, D] (same H:
    grouped queries are folded into R, token-major, ``R / num_tokens`` rows a token), the last
    token being key ``L - 1``; each token sees the keys up to its own.

    Each token attends in a call of its own, the very call a one-token step makes: one masked
    call would run a different SDPA kernel, whose roundings differ, and greedy speculative
    decoding would then no longer reproduce plain greedy decoding exactly."""
    if num_tokens < 1 or q.shape[2] % num_tokens or num_tokens > k.shape[2]:
        raise ValueError(f"{q.shape[2]} query rows cannot be {num_tokens} tokens over {k.shape[2]} keys")
    if num_tokens == 1:
        return sdpa(q, k, v, scale=scale)
    rows = q.shape[2] // num_tokens
    num_keys = k.shape[2]
    outs = []
    for t in range(num_tokens):
        visible = num_keys - num_tokens + t + 1
        q_t = q[:, :, t * rows:(t + 1) * rows].contiguous()  # laid out as a one-token step's q
        outs.append(sdpa(q_t, k[:, :, :visible], v[:, :, :visible], scale=scale))
    return torch.cat(outs, dim=2)


def _grouped_per_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
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


def _windowed_softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         sliding_window: int | None, logit_softcap: float | None) -> torch.Tensor:
    """q [1, heads, num_new, dim] over k/v [1, kv_heads, context_len, dim] with a sliding window
    (a token sees the ``sliding_window`` keys up to its own) and/or scores soft-capped
    (``cap * tanh(s / cap)``), in fp32. A few tokens attend one by one, as a one-token step does."""
    num_heads, num_new, context_len = q.shape[1], q.shape[2], k.shape[2]
    group = num_heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [1, heads, context_len, dim]
    vf = v.float().repeat_interleave(group, dim=1)
    key_pos = torch.arange(context_len, device=q.device)
    pieces = [(t, t + 1) for t in range(num_new)] if num_new <= MAX_CAUSAL_DECODE_TOKENS else [(0, num_new)]
    outs = []
    for t0, t1 in pieces:
        query_pos = key_pos[context_len - num_new + t0:context_len - num_new + t1]
        scores = (q[:, :, t0:t1].float() @ kf.transpose(-1, -2)) * scale  # [1, heads, n, context_len]
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        visible = key_pos[None, :] <= query_pos[:, None]
        if sliding_window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ vf)
    return torch.cat(outs, dim=2).to(q.dtype)


def reference_paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                              meta: PagedAttentionMetadata, scale: float, sliding_window: int | None = None,
                              logit_softcap: float | None = None) -> torch.Tensor:
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
        if sliding_window is not None or logit_softcap is not None:
            out = _windowed_softcapped(q_seq, k, v, scale, sliding_window, logit_softcap)
        elif num_new == context_len and num_new > 1:
            out = sdpa(q_seq, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        elif num_new <= MAX_CAUSAL_DECODE_TOKENS:
            out = _grouped_per_token(q_seq, k, v, scale)
        else:
            key_pos = torch.arange(context_len, device=q.device)
            query_pos = key_pos[context_len - num_new:]
            mask = (key_pos[None, :] <= query_pos[:, None]).view(1, 1, num_new, context_len)
            out = sdpa(q_seq, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        outs.append(out[0].transpose(0, 1))  # [num_new, heads, dim]
    return torch.cat(outs)


def is_paged_block_size(block_size: int) -> bool:
    """Whether the C++ paged attention takes blocks of this many tokens: a power of two, so a
    key's block and offset are a shift and a mask."""
    return block_size >= 2 and block_size & (block_size - 1) == 0


def paged_attention_kernel_applies(q: torch.Tensor, k_blocks: torch.Tensor) -> bool:
    """Whether :func:`paged_attention` runs fastdraft's C++ kernel for these tensors (else another entry)."""
    head_dim = q.shape[-1]
    return (cpu_extension_for(q, k_blocks) is not None and head_dim % 16 == 0 and head_dim <= 256
            and is_paged_block_size(k_blocks.shape[2]) and k_blocks.is_contiguous())


def paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, meta: PagedAttentionMetadata,
                    scale: float, sliding_window: int | None = None,
                    logit_softcap: float | None = None) -> torch.Tensor:
    """Attention of a flat batch q [num_tokens, num_heads, head_dim] over a paged pool
    k/v_blocks [num_blocks, num_kv_heads, block_size, head_dim] -> [num_tokens, num_heads, head_dim].

    Sequence ``i``'s new tokens are the last of its ``meta.context_lens[i]`` keys, which lie in
    the blocks of ``meta.block_tables[i]``; each token sees the keys up to its own (the last
    ``sliding_window`` of them with a window). On a CPU with fastdraft's kernels one C++ call
    (which takes a window, not a soft-cap) reads every sequence's keys straight from its
    blocks, split over fixed 256-key chunks whatever the thread count, so a row's result does
    not depend on the rest of the batch; on a GPU one Triton launch does the same (no window
    or soft-cap); elsewhere, :func:`reference_paged_attention`."""
    is_plain = sliding_window is None and logit_softcap is None
    if logit_softcap is None and paged_attention_kernel_applies(q, k_blocks):
        return load_cpu_kernels().paged_attention(q, k_blocks, v_blocks, meta.block_tables.contiguous(),
                                                  meta.query_start_loc_tensor, meta.context_lens_tensor, scale,
                                                  sliding_window or 0)
    if is_plain and triton_attention.applies(q, k_blocks):
        device_meta = meta.int32_tensors()
        return triton_attention.triton_paged_attention(q, k_blocks, v_blocks, device_meta.block_tables,
                                                       device_meta.seq_lens, device_meta.query_start_loc,
                                                       meta.max_context_len, scale)
    return reference_paged_attention(q, k_blocks, v_blocks, meta, scale, sliding_window, logit_softcap)
