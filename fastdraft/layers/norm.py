"""RMSNorm, computed in fp32 like the HF reference so bf16 models match it."""

from __future__ import annotations

import torch
from torch import nn

from fastdraft.kernels.fused import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
