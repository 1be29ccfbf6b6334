"""The small interface every weight-only matmul kernel implements.

A kernel is built once per linear layer from a canonical :class:`QuantizedWeight` (it may
repack the weight into its own layout) and then maps activations ``[..., K]`` to ``[..., N]``.
Capability flags let :func:`fastdraft.kernels.select_kernel` pick the fastest kernel that
supports a given weight, activation dtype and device, falling back to the reference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from fastdraft.formats import QuantizedWeight


@dataclass(frozen=True)
class KernelCapabilities:
    bits: tuple[int, ...]
    is_asym_supported: bool
    group_sizes: tuple[int, ...] | None  # None: any group size, per-channel included
    activation_dtypes: tuple[torch.dtype, ...]
    device_types: tuple[str, ...]
    priority: int  # higher wins among kernels that support a weight
    # Each output row is bit-identical whatever the number of rows (up to 8) in the call:
    # needed so that speculative verification reproduces one-token decoding exactly.
    is_row_invariant: bool = False
    # Activations are quantized to int8 on the fly (VNNI): results differ from the dense
    # product by that rounding, and match the kernel's own reference twin exactly.
    is_activation_quantized: bool = False


class WeightOnlyKernel(ABC):
    """``y = x @ dequantize(weight).T (+ bias)`` for one layer's quantized weight."""

    name: str = "abstract"
    capabilities: KernelCapabilities

    @classmethod
    def is_available(cls) -> bool:
        """Whether the kernel can run here at all (instruction set, build, device)."""
        return True

    @classmethod
    def supports(cls, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
        caps = cls.capabilities
        return (qw.bits in caps.bits
                and (qw.is_sym or caps.is_asym_supported)
                and (caps.group_sizes is None or qw.group_size in caps.group_sizes
                     or cls.effective_group_size(qw) is not None)
                and dtype in caps.activation_dtypes
                and device.type in caps.device_types
                and cls.is_available())

    @classmethod
    def effective_group_size(cls, qw: QuantizedWeight) -> int | None:
        """A supported group size that evenly splits ``qw``'s groups (scales are repeated), if any."""
        sizes = cls.capabilities.group_sizes
        if sizes is None:
            return qw.group_size
        for g in sorted(sizes, reverse=True):
            if qw.group_size % g == 0 and qw.in_features % g == 0:
                return g
        return None

    @abstractmethod
    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None: ...

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] in x's dtype."""
