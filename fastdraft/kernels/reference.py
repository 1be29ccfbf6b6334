"""Reference kernel: dequantize with the canonical formula, then a dense matmul.

Slow in memory traffic (it keeps a dense copy), but exact and available everywhere; it is
the twin every fast kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdraft.kernels.base import KernelCapabilities, WeightOnlyKernel
from fastdraft.quant.format import QuantizedWeight, dequantize


class ReferenceKernel(WeightOnlyKernel):
    name = "reference"
    capabilities = KernelCapabilities(bits=(4, 6, 8), is_asym_supported=True, group_sizes=None,
                                      activation_dtypes=(torch.float32, torch.bfloat16, torch.float16),
                                      device_types=("cpu", "cuda"), priority=0)

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        self.weight = dequantize(qw, dtype).to(device)  # [N, K]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
