"""Plain PyTorch twins: the reference weight-only kernel and the rotary rotation.

The reference kernel dequantizes with the canonical formula, then runs a dense matmul: slow in
memory traffic (it keeps a dense copy), but exact and available everywhere; it is the twin
every fast weight-only kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdraft.formats import QuantizedWeight, dequantize
from fastdraft.kernels.base import KernelCapabilities, WeightOnlyKernel


class ReferenceKernel(WeightOnlyKernel):
    name = "reference"
    capabilities = KernelCapabilities(bits=(4, 6, 8), is_asym_supported=True, group_sizes=None,
                                      activation_dtypes=(torch.float32, torch.bfloat16, torch.float16),
                                      device_types=("cpu", "cuda"), priority=0)

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        self.weight = dequantize(qw, dtype).to(device)  # [N, K]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [batch, heads, tokens, head_dim] by cos/sin [batch, tokens, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin
