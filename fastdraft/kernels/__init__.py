"""Weight-only matmul kernels behind one small interface, each with a reference twin.

``select_kernel`` returns the highest-priority kernel that supports a weight on the running system;
the reference kernel supports everything, so selection never fails.
"""

from __future__ import annotations

import torch

from fastdraft.formats import QuantizedWeight
from fastdraft.kernels.aten import AtenInt4CudaKernel, AtenInt4Kernel, AtenInt8Kernel
from fastdraft.kernels.base import KernelCapabilities, WeightOnlyKernel
from fastdraft.kernels.reference import ReferenceKernel
from fastdraft.kernels.x86 import X86WoqKernel

KERNELS: dict[str, type[WeightOnlyKernel]] = {
    k.name: k for k in (ReferenceKernel, AtenInt4Kernel, AtenInt4CudaKernel, AtenInt8Kernel, X86WoqKernel)
}


def kernel_class(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device | str,
                 name: str | None = None) -> type[WeightOnlyKernel]:
    """The kernel named ``name``, or the highest-priority one supporting this weight here."""
    device = torch.device(device)
    if name is not None:
        if name not in KERNELS:
            raise ValueError(f"unknown kernel {name!r}; available: {', '.join(KERNELS)}")
        if not KERNELS[name].supports(qw, dtype, device):
            raise ValueError(f"kernel {name!r} does not support this weight/dtype/device")
        return KERNELS[name]
    candidates = [k for k in KERNELS.values() if k.supports(qw, dtype, device)]
    return max(candidates, key=lambda k: k.capabilities.priority)


def select_kernel(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device | str,
                  name: str | None = None) -> WeightOnlyKernel:
    """Build the kernel named ``name``, or the best available one for this weight."""
    return kernel_class(qw, dtype, device, name)(qw, dtype, torch.device(device))


__all__ = ["KERNELS", "KernelCapabilities", "WeightOnlyKernel", "kernel_class", "select_kernel"]
