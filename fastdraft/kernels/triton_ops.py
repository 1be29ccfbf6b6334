"""The small ops of a decoder layer on a GPU, in Triton: RMSNorm (with the residual add before
it), rotary embedding by position, and SiLU-and-multiply, one launch each over a flat batch.

In eager PyTorch each of these is several launches (RMSNorm alone is seven), and a decode step
of a small model is bound by launches, not bytes. Each kernel rounds to the storage dtype where
its PyTorch twin in :mod:`fastdraft.kernels.ops` and :mod:`fastdraft.kernels.fused` do, so results agree with the module path
up to the order of one reduction (RMSNorm's sum of squares). The tests compare the two on a GPU
and, without one, through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from fastdraft.kernels.triton_attention import is_available, next_power_of_two, tl, triton

__all__ = ["is_available", "rotary_", "triton_rms_norm", "triton_silu_and_mul"]


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, num_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        """One row: (residual += x, then) out = weight * rms_normalized(residual or x)."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < num_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            # The sum rounded to the storage dtype, as ``hidden + residual`` is in PyTorch.
            r = tl.load(residual_ptr + row * stride_r + offs, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
            tl.store(residual_ptr + row * stride_r + offs, x, mask=ok)
        xf = x.to(tl.float32)
        mean_square = tl.sum(xf * xf, 0) / num_cols
        normed = (xf * tl.math.rsqrt(mean_square + eps)).to(x.dtype)
        w = tl.load(weight_ptr + offs, mask=ok, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, num_cols, BLOCK: tl.constexpr):
        """One row's block of columns: silu(gate) * up, x = [gate | up]."""
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < num_cols
        gate = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * stride_x + num_cols + offs, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        out = silu.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotary_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_table,
                       NUM_HEADS: tl.constexpr, NUM_HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                       HALF_PAD: tl.constexpr):
        """One token's heads rotated in place by its position's cos/sin rows (rotate-half)."""
        token = tl.program_id(0)
        position = tl.load(positions_ptr + token)
        offs_h = tl.arange(0, NUM_HEADS_PAD)
        offs_d = tl.arange(0, HALF_PAD)
        ok = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
        first = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
        x1 = tl.load(first, mask=ok, other=0.0)  # [heads, half]
        x2 = tl.load(first + HALF, mask=ok, other=0.0)
        table = position * stride_table + offs_d
        cos1 = tl.load(cos_ptr + table, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        cos2 = tl.load(cos_ptr + table + HALF, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        sin1 = tl.load(sin_ptr + table, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        sin2 = tl.load(sin_ptr + table + HALF, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        dtype = x1.dtype
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded as PyTorch's bf16 ops round it.
        out1 = (a1 * cos1).to(dtype).to(tl.float32) + (-a2 * sin1).to(dtype).to(tl.float32)
        out2 = (a2 * cos2).to(dtype).to(tl.float32) + (a1 * sin2).to(dtype).to(tl.float32)
        tl.store(first, out1.to(dtype), mask=ok)
        tl.store(first + HALF, out2.to(dtype), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("expected rows [num_rows, num_cols] with contiguous columns")
    return x


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of rows x [num_rows, hidden] scaled by ``weight``; with ``residual`` (same shape),
    first ``residual += x`` in place and normalize the sum (the decoder's add + norm)."""
    _rows(x)
    out = torch.empty_like(x) if out is None else out
    num_rows, num_cols = x.shape
    if num_rows:
        r = x if residual is None else _rows(residual)
        _rms_norm_kernel[(num_rows,)](x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), num_cols, eps,
                                      HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_two(num_cols))
    return out


def triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x = [gate | up]`` [num_rows, 2 * n] -> ``silu(gate) * up`` [num_rows, n]."""
    _rows(x)
    num_rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows:
        block = min(1024, next_power_of_two(n))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] in place (rotate-half layout) by the rows
    ``positions`` [num_tokens] of the tables cos/sin [table_len, head_dim]. ``x`` may be a
    column slice of wider rows (the q and k heads of a fused qkv projection)."""
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(2) != 1 or head_dim % 2 or cos.stride(1) != 1 or cos.stride(0) != sin.stride(0):
        raise ValueError("rotary needs an even head_dim and contiguous head and table rows")
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                                      NUM_HEADS=num_heads, NUM_HEADS_PAD=next_power_of_two(num_heads), HALF=half,
                                      HALF_PAD=next_power_of_two(half))
    return x
