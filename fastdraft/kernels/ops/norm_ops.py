"""RMSNorm: its reference, the C++ kernel (CPU) and the Triton kernel (GPU).

Two kinds, as the decoder plan names them: Llama's ``weight * normalized(x)``, the normalized
row rounded to the storage dtype first, and Gemma's ``normalized(x) * (1 + weight)`` all in fp32
with one rounding at the end.
"""

from __future__ import annotations

import torch

from fastdraft.kernels import triton_ops
from fastdraft.kernels.fused import cpu_extension_for


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, is_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim in fp32 (as HF computes it); ``is_offset``: scaled by ``1 + weight``."""
    input_dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if is_offset:
        return (xf * (1.0 + weight.float())).to(input_dtype)
    return weight * xf.to(input_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, is_offset: bool = False) -> torch.Tensor:
    """RMSNorm of x [..., hidden] by ``weight`` [hidden]: the C++ kernel on a CPU, Triton on a
    GPU, the reference elsewhere. The offset kind's C++ kernel computes in fp32 with ``1 +
    weight`` in fp32, rounding once at the end, as Gemma computes it; it has no Triton kernel."""
    if is_offset:
        ext = cpu_extension_for(x)  # the weight goes in as fp32 1 + weight, whatever its dtype
        if ext is None or x.numel() == 0:
            return reference_rms_norm(x, weight, eps, is_offset)
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # [num_rows, hidden]
        return ext.rms_norm_offset(rows, 1.0 + weight.float(), eps).view(x.shape)
    if not weight.is_contiguous():
        return reference_rms_norm(x, weight, eps)
    if x.is_cuda and triton_ops.is_available() and x.dtype == weight.dtype:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return triton_ops.triton_rms_norm(rows, weight, eps).view(x.shape)
    ext = cpu_extension_for(x, weight)
    if ext is None:
        return reference_rms_norm(x, weight, eps)
    return ext.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)
