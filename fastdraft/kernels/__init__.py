"""Weight-only matmul kernels behind one small interface, each with a reference twin.

``select_kernel`` returns the highest-priority kernel that supports a weight on this machine;
the reference kernel supports everything, so selection never fails.
"""

from __future__ import annotations

import logging

import torch

from fastdraft.kernels.aten import AtenInt4Kernel, AtenInt8Kernel
from fastdraft.kernels.base import KernelCapabilities, WeightOnlyKernel
from fastdraft.kernels.reference import ReferenceKernel
from fastdraft.kernels.x86 import X86WoqKernel
from fastdraft.quant.format import QuantizedWeight

logger = logging.getLogger(__name__)

KERNELS: dict[str, type[WeightOnlyKernel]] = {
    k.name: k for k in (ReferenceKernel, AtenInt4Kernel, AtenInt8Kernel, X86WoqKernel)
}


def select_kernel(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device | str,
                  name: str | None = None) -> WeightOnlyKernel:
    """Build the kernel named ``name``, or the best available one for this weight."""
    device = torch.device(device)
    if name is not None:
        if name not in KERNELS:
            raise ValueError(f"unknown kernel {name!r}; available: {', '.join(KERNELS)}")
        kernel_cls = KERNELS[name]
        if not kernel_cls.supports(qw, dtype, device):
            raise ValueError(f"kernel {name!r} does not support this weight/dtype/device")
        return kernel_cls(qw, dtype, device)
    candidates = [k for k in KERNELS.values() if k.supports(qw, dtype, device)]
    best = max(candidates, key=lambda k: k.capabilities.priority)
    return best(qw, dtype, device)


__all__ = ["KERNELS", "KernelCapabilities", "WeightOnlyKernel", "select_kernel"]
