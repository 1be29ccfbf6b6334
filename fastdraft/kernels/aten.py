"""PyTorch's own weight-only matmuls (``aten._weight_int4pack_mm_for_cpu`` on the CPU,
``aten._weight_int4pack_mm`` on CUDA, ``aten._weight_int8pack_mm``).

INT4: the op computes ``(q - 8) * scale + offset`` per group; our asymmetric zero point maps
to ``offset = (8 - zero) * scale``. It accepts group sizes 32..256 only, so larger groups are
expressed exactly as several 256-wide groups with repeated scales. Its scales live in the
activation dtype, so with bf16 activations they lose precision versus the fp16 originals.
INT8: per-channel only (one scale per output row).
"""

from __future__ import annotations

import torch

from fastdraft.formats import QuantizedWeight, unpack_int4
from fastdraft.kernels.base import KernelCapabilities, WeightOnlyKernel


class AtenInt4Kernel(WeightOnlyKernel):
    name = "aten-int4"
    capabilities = KernelCapabilities(bits=(4,), is_asym_supported=True, group_sizes=(32, 64, 128, 256),
                                      activation_dtypes=(torch.float32, torch.bfloat16),
                                      device_types=("cpu",), priority=10, is_row_invariant=True)

    @classmethod
    def is_available(cls) -> bool:
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

    @classmethod
    def supports(cls, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
        # The op's packing tiles output rows by 16.
        return qw.out_features % 16 == 0 and super().supports(qw, dtype, device)

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        group = self.effective_group_size(qw)
        if group is None:
            raise ValueError(f"{self.name} cannot express group size {qw.group_size}")
        repeat = qw.group_size // group
        q = unpack_int4(qw.qweight).to(torch.int32)  # [N, K]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scale_and_zero = _scale_and_zero(qw, repeat, dtype)  # [K / group, N, 2]
        self.group_size = group
        self.out_features = qw.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), self.packed,
                                                       self.group_size, self.scale_and_zero)
        return y.view(*lead, self.out_features)


def _scale_and_zero(qw: QuantizedWeight, repeat: int, dtype: torch.dtype) -> torch.Tensor:
    """The ops' per-group (scale, offset) pairs [K / group, N, 2] for ``(q - 8) * scale + offset``."""
    scales = qw.scales.float()  # [N, num_groups]
    zeros = torch.full_like(scales, 8.0) if qw.zeros is None else qw.zeros.float()
    offsets = (8.0 - zeros) * scales
    scale_and_zero = torch.stack((scales, offsets), dim=-1).repeat_interleave(repeat, dim=1)
    return scale_and_zero.transpose(0, 1).contiguous().to(dtype)


class AtenInt4CudaKernel(WeightOnlyKernel):
    """INT4 on CUDA (compute capability 8.0 and up): PyTorch's tensor-core int4 matmul over its
    own tiled layout. bf16 activations only; the weight's K must split into the layout's tiles."""

    name = "aten-int4-cuda"
    capabilities = KernelCapabilities(bits=(4,), is_asym_supported=True, group_sizes=(32, 64, 128, 256),
                                      activation_dtypes=(torch.bfloat16,), device_types=("cuda",), priority=10)

    @classmethod
    def is_available(cls) -> bool:
        return (hasattr(torch.ops.aten, "_weight_int4pack_mm") and torch.cuda.is_available()
                and torch.cuda.get_device_capability()[0] >= 8)

    @staticmethod
    def inner_k_tiles(in_features: int) -> int | None:
        """The layout's K tiles per 16-wide step that split ``in_features`` (most first)."""
        return next((tiles for tiles in (8, 4, 2) if in_features % (tiles * 16) == 0), None)

    @classmethod
    def supports(cls, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
        return (qw.out_features % 8 == 0 and cls.inner_k_tiles(qw.in_features) is not None
                and super().supports(qw, dtype, device))

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        group = self.effective_group_size(qw)
        tiles = self.inner_k_tiles(qw.in_features)
        if group is None or tiles is None:
            raise ValueError(f"{self.name} cannot take group size {qw.group_size} over {qw.in_features} features")
        q = unpack_int4(qw.qweight).to(torch.int32)  # [N, K]
        # The op reads two values a byte, the even k in the high nibble (ours is in the low one).
        packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)  # [N, K / 2]
        self.packed = torch.ops.aten._convert_weight_to_int4pack(packed, tiles)
        self.scale_and_zero = _scale_and_zero(qw, qw.group_size // group, dtype).to(device)
        self.group_size = group
        self.out_features = qw.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, x.shape[-1]), self.packed, self.group_size,
                                               self.scale_and_zero)
        return y.view(*lead, self.out_features)


class AtenInt8Kernel(WeightOnlyKernel):
    name = "aten-int8"
    capabilities = KernelCapabilities(bits=(8,), is_asym_supported=False, group_sizes=None,
                                      activation_dtypes=(torch.float32, torch.bfloat16, torch.float16),
                                      device_types=("cpu", "cuda"), priority=10, is_row_invariant=True)

    @classmethod
    def supports(cls, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
        per_channel = qw.group_size == qw.in_features
        return per_channel and super().supports(qw, dtype, device)

    @classmethod
    def is_available(cls) -> bool:
        return hasattr(torch.ops.aten, "_weight_int8pack_mm")

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        qweight = qw.qweight.to(device)  # [N, K] int8
        # PyTorch's CPU kernel reads the weight with aligned vector loads and crashes on a
        # pointer that is not 16-byte aligned, which a tensor mapped from a safetensors file can be.
        self.qweight = qweight.clone() if qweight.data_ptr() % 64 else qweight
        self.scales = qw.scales[:, 0].to(device=device, dtype=dtype).contiguous()  # [N]
        self.out_features = qw.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.qweight, self.scales)
        return y.view(*lead, self.out_features)
