"""Fused decoder-layer ops: C++ (``csrc/fused.cpp``, ``csrc/attention.cpp``) with PyTorch twins.

Each public function runs the C++ op when the tensors qualify (CPU, float32/bfloat16, the
extension built) and otherwise its ``reference_*`` twin, which defines the semantics: the same
intermediate roundings to the storage dtype as the unfused PyTorch code.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.kernels.mode import is_batch_invariant
from fastdraft.kernels.reference import apply_rotary

_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _extension_for(*tensors: torch.Tensor):
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _FUSED_DTYPES:
        return None
    if any(t.dtype != first.dtype for t in tensors):
        return None
    return load_cpu_kernels()


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(input_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 (as HF does), scaled by ``weight``."""
    ext = _extension_for(x, weight)
    if ext is None or not weight.is_contiguous():
        return reference_rms_norm(x, weight, eps)
    return ext.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)


def reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x = [gate | up]`` along the last dim -> ``silu(gate) * up``."""
    ext = _extension_for(x)
    if ext is None:
        return reference_silu_and_mul(x)
    out = ext.silu_and_mul(x.reshape(-1, x.shape[-1]).contiguous())
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, tokens, heads, head_dim], cos/sin [batch, tokens, head_dim] (rotate-half convention)."""
    return apply_rotary(x.transpose(1, 2), cos, sin).transpose(1, 2)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [batch, tokens, heads, head_dim] by cos/sin [batch, tokens, head_dim].

    ``x`` may be a column slice of a wider row (e.g. the q part of a fused qkv projection)."""
    ext = _extension_for(x, cos, sin)
    batch, tokens, heads, head_dim = x.shape
    if ext is None or head_dim % 2:
        return reference_rotary(x, cos, sin)
    rows = x.reshape(batch * tokens, heads * head_dim)
    if rows.stride(1) != 1:
        return reference_rotary(x, cos, sin)
    cos2, sin2 = cos.reshape(batch * tokens, head_dim), sin.reshape(batch * tokens, head_dim)
    out = ext.rotary(rows, cos2.contiguous(), sin2.contiguous(), heads, head_dim)
    return out.view(batch, tokens, heads, head_dim)


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


def reference_paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                               block_tables: torch.Tensor, query_start_loc: list[int], context_lens: list[int],
                               scale: float) -> torch.Tensor:
    """paged_attention's PyTorch twin: each sequence's keys gathered from its blocks, then each
    of its new tokens attends over its own prefix in a call of its own (:func:`per_token_attention`)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_blocks.shape[1], k_blocks.shape[2]
    group = num_heads // num_kv_heads
    outs = []
    for i, context_len in enumerate(context_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        num_new = end - start
        table = block_tables[i, :(context_len + block_size - 1) // block_size]
        # [blocks, kv_heads, block_size, dim] -> [1, kv_heads, context_len, dim]
        k = k_blocks[table].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[None, :, :context_len]
        v = v_blocks[table].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[None, :, :context_len]
        # Grouped query heads folded into rows, token-major: [1, kv_heads, num_new * group, dim].
        q_rows = q[start:end].reshape(num_new, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
        q_rows = q_rows.reshape(1, num_kv_heads, num_new * group, head_dim)
        out = per_token_attention(q_rows, k, v, scale, num_new)
        outs.append(out.view(num_kv_heads, num_new, group, head_dim).permute(1, 0, 2, 3).reshape(num_new, num_heads,
                                                                                              head_dim))
    return torch.cat(outs)


def is_paged_block_size(block_size: int) -> bool:
    """Whether the C++ paged attention takes blocks of this many tokens: a power of two, so a
    key's block and offset are a shift and a mask."""
    return block_size >= 2 and block_size & (block_size - 1) == 0


def paged_attention_kernel_applies(q: torch.Tensor, k_blocks: torch.Tensor) -> bool:
    """Whether paged_attention runs fastdraft's C++ kernel for these tensors (else its twin)."""
    head_dim = q.shape[-1]
    return (_extension_for(q, k_blocks) is not None and head_dim % 16 == 0 and head_dim <= 256
            and is_paged_block_size(k_blocks.shape[2]) and k_blocks.is_contiguous())


def paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: list[int] | torch.Tensor, context_lens: list[int] | torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention of a flat batch q [num_tokens, num_heads, head_dim] over a paged pool
    k/v_blocks [num_blocks, num_kv_heads, block_size, head_dim] -> [num_tokens, num_heads, head_dim].

    Sequence ``i``'s new tokens are ``q[query_start_loc[i]:query_start_loc[i + 1]]``, the last
    of its ``context_lens[i]`` keys, which lie in the blocks of ``block_tables[i]``; each token
    sees the keys up to its own. Every query row is computed as a one-token step over the same
    keys would compute it (split over fixed 256-key chunks, whatever the thread count), so a
    row's result does not depend on the other rows, the other sequences, or how many tokens of
    its sequence the step holds."""
    if not paged_attention_kernel_applies(q, k_blocks):
        return reference_paged_attention(q, k_blocks, v_blocks, block_tables, [int(i) for i in query_start_loc],
                                         [int(n) for n in context_lens], scale)
    qsl = torch.as_tensor(query_start_loc, dtype=torch.long)
    lens = torch.as_tensor(context_lens, dtype=torch.long)
    return load_cpu_kernels().paged_attention(q, k_blocks, v_blocks, block_tables.contiguous(), qsl, lens, scale)


def reference_dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dense bf16 kernel's math in plain PyTorch: fp32 products and sums (in another
    order than the kernel's), the bias added in fp32, one rounding to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; for up to 8 bf16 rows on a CPU with AVX512-BF16, fastdraft's
    dot-product kernel (``csrc/woq.cpp``), which reads the weight faster than oneDNN at one
    row (it prefetches the short row streams that the hardware prefetcher falls behind on) and
    computes each row the same way whatever the number of rows. In
    :func:`~fastdraft.kernels.mode.batch_invariant` mode, that kernel runs at every row count."""
    is_autograd = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    ext = None if is_autograd or x.dtype != torch.bfloat16 else _extension_for(x, weight)
    if ext is not None:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        if ext.dense_bf16_applies(rows, weight, bias) or (is_batch_invariant()
                                                         and ext.dense_bf16_supports(rows, weight, bias)):
            return ext.dense_bf16_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
