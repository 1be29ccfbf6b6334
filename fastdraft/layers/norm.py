"""RMSNorm, computed in fp32 like the HF reference so bf16 models match it."""

from __future__ import annotations

import torch
from torch import nn

from fastdraft.kernels.ops.norm_ops import rms_norm


class RMSNorm(nn.Module):
    """``weight * normalized(x)``, or with ``is_offset`` Gemma's ``normalized(x) * (1 + weight)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, is_offset: bool = False) -> None:
        super().__init__()
        # Gemma stores the offset from one, so its neutral weight is zero.
        self.weight = nn.Parameter(torch.zeros(hidden_size) if is_offset else torch.ones(hidden_size))
        self.eps = eps
        self.is_offset = is_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.is_offset)
