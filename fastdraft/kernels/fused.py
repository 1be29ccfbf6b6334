"""Rotary embedding and the dense bf16 matmul: C++ (``csrc/fused.cpp``, ``csrc/woq.cpp``) with
PyTorch twins. The norm, activation and attention families live in :mod:`fastdraft.kernels.ops`.

Each public function runs the C++ op when the tensors qualify (CPU, float32/bfloat16, the
extension built) and otherwise its ``reference_*`` twin, which defines the semantics: the same
intermediate roundings to the storage dtype as the unfused PyTorch code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.kernels.mode import is_batch_invariant
from fastdraft.kernels.reference import apply_rotary

_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def cpu_extension_for(*tensors: torch.Tensor):
    """The C++ kernels where every tensor is on the CPU in one dtype they take, else None."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _FUSED_DTYPES:
        return None
    if any(t.dtype != first.dtype for t in tensors):
        return None
    return load_cpu_kernels()


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, tokens, heads, head_dim], cos/sin [batch, tokens, head_dim] (rotate-half convention)."""
    return apply_rotary(x.transpose(1, 2), cos, sin).transpose(1, 2)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [batch, tokens, heads, head_dim] by cos/sin [batch, tokens, head_dim].

    ``x`` may be a column slice of a wider row (e.g. the q part of a fused qkv projection)."""
    ext = cpu_extension_for(x, cos, sin)
    batch, tokens, heads, head_dim = x.shape
    if ext is None or head_dim % 2:
        return reference_rotary(x, cos, sin)
    rows = x.reshape(batch * tokens, heads * head_dim)
    if rows.stride(1) != 1:
        return reference_rotary(x, cos, sin)
    cos2, sin2 = cos.reshape(batch * tokens, head_dim), sin.reshape(batch * tokens, head_dim)
    out = ext.rotary(rows, cos2.contiguous(), sin2.contiguous(), heads, head_dim)
    return out.view(batch, tokens, heads, head_dim)


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
    ext = None if is_autograd or x.dtype != torch.bfloat16 else cpu_extension_for(x, weight)
    if ext is not None:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        if ext.dense_bf16_applies(rows, weight, bias) or (is_batch_invariant()
                                                         and ext.dense_bf16_supports(rows, weight, bias)):
            return ext.dense_bf16_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
