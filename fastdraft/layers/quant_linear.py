"""Modules that hold canonical quantized weights and run them through a kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdraft.formats import SCALE_DTYPE, QuantizedWeight, WeightFormat, dequantize, resolve_group_size
from fastdraft.kernels import WeightOnlyKernel, kernel_class, select_kernel


# Rows small matmuls are padded to when kernels are not row-invariant: one decode step and a
# verification of up to 5 tokens (4 drafts + 1) then run in the same shape.
EXACT_MIN_ROWS = 5


class QuantLinear(nn.Module):
    """A weight-only quantized ``nn.Linear``.

    The state dict holds the canonical tensors (``qweight``, ``scales``, ``qzeros`` for
    asymmetric INT4, ``bias``); the kernel's repacked copy is derived state, built on first
    use for the activation dtype and device it sees.
    """

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, kernel: str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = qw.in_features, qw.out_features
        self.bits, self.group_size = qw.bits, qw.group_size
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        if qw.zeros is not None:
            self.register_buffer("qzeros", qw.zeros)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernel_name = kernel
        self._kernel: WeightOnlyKernel | None = None
        self._kernel_key: tuple | None = None

    @classmethod
    def empty(cls, in_features: int, out_features: int, fmt: WeightFormat, has_bias: bool,
              device: torch.device | str = "meta") -> "QuantLinear":
        """A placeholder with the right tensor shapes, to be filled by ``load_state_dict``."""
        group_size = resolve_group_size(fmt.group_size, in_features)
        num_groups = in_features // group_size
        if fmt.bits == 4:
            qweight = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device)
        elif fmt.bits == 6:
            qweight = torch.empty(out_features, in_features * 3 // 4, dtype=torch.uint8, device=device)
        else:
            qweight = torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        scales = torch.empty(out_features, num_groups, dtype=SCALE_DTYPE, device=device)
        zero_dtype = SCALE_DTYPE if fmt.float_zeros else torch.uint8
        zeros = None if fmt.sym else torch.empty(out_features, num_groups, dtype=zero_dtype, device=device)
        bias = torch.empty(out_features, device=device) if has_bias else None
        return cls(QuantizedWeight(qweight, scales, zeros, fmt.bits, group_size, in_features), bias)

    @property
    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, getattr(self, "qzeros", None),
                               self.bits, self.group_size, self.in_features)

    def _key(self, dtype: torch.dtype, device: torch.device | str) -> tuple:
        # One key per physical device ("cuda" is "cuda:0" there): a kernel rebuilt for the same
        # device would free the weights a captured CUDA graph still reads.
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return dtype, device, self.kernel_name

    def kernel_for(self, dtype: torch.dtype, device: torch.device) -> WeightOnlyKernel:
        key = self._key(dtype, device)
        if self._kernel is None or self._kernel_key != key:
            self._kernel = select_kernel(self.quantized_weight, dtype, key[1], self.kernel_name)
            self._kernel_key = key
        return self._kernel

    def built_kernel(self, dtype: torch.dtype, device: torch.device) -> WeightOnlyKernel | None:
        """The kernel already built for ``dtype`` and ``device``, if any (none is built here)."""
        return self._kernel if self._kernel_key == self._key(dtype, device) else None

    def adopt_kernel(self, kernel: WeightOnlyKernel, dtype: torch.dtype, device: torch.device) -> None:
        """Run ``kernel`` (this weight, already laid out: a saved layout, rows of a fused
        kernel) for ``dtype`` and ``device`` instead of building one."""
        self._kernel, self._kernel_key = kernel, self._key(dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel_for(x.dtype, x.device)(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        kernel = self._kernel.name if self._kernel is not None else "unbuilt"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, sym={not hasattr(self, 'qzeros')}, kernel={kernel}")


def exact_min_rows(model: nn.Module) -> int:
    """The ``min_rows`` a model needs for verification to reproduce decoding bit for bit:
    1 when every linear runs on a row-invariant kernel, else ``EXACT_MIN_ROWS`` (padding)."""
    dtype, device = model.dtype, model.device
    for module in model.modules():
        if isinstance(module, nn.Linear):
            return EXACT_MIN_ROWS
        if isinstance(module, QuantLinear):
            kernel = kernel_class(module.quantized_weight, dtype, device, module.kernel_name)
            if not kernel.capabilities.is_row_invariant:
                return EXACT_MIN_ROWS
    return 1


class QuantEmbedding(nn.Module):
    """A quantized embedding table (any :class:`QuantizedWeight` format: INT8 per row, a GGUF
    file's blocks): only the looked-up rows are dequantized, to fp32; the model rounds them to
    its activations' dtype."""

    def __init__(self, qw: QuantizedWeight) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qw.out_features, qw.in_features
        self.bits, self.group_size = qw.bits, qw.group_size
        self.register_buffer("qweight", qw.qweight)  # [vocab, packed hidden]
        self.register_buffer("scales", qw.scales)  # [vocab, num_groups]
        if qw.zeros is not None:
            self.register_buffer("qzeros", qw.zeros)

    @classmethod
    def empty(cls, num_embeddings: int, dim: int, fmt: WeightFormat,
              device: torch.device | str = "meta") -> "QuantEmbedding":
        """A placeholder with the right tensor shapes for ``fmt``, to be filled by ``load_state_dict``."""
        return cls(QuantLinear.empty(dim, num_embeddings, fmt, False, device).quantized_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        zeros = getattr(self, "qzeros", None)
        rows = QuantizedWeight(F.embedding(input_ids, self.qweight), F.embedding(input_ids, self.scales),
                               None if zeros is None else F.embedding(input_ids, zeros),
                               self.bits, self.group_size, self.embedding_dim)
        return dequantize(rows, torch.float32)  # [num_tokens, hidden_size]
