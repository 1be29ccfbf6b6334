"""Dense linears, several linears that read the same input (q/k/v, gate/up) run as one matmul,
and the C++ op of a linear for the C++ step.

:class:`Linear` is ``nn.Linear`` with fastdraft's dense kernel; :func:`is_dense_linear` tells
it (or ``nn.Linear``) from the quantized ``QuantLinear``. :func:`fused_linear` builds one matmul
over the concatenated weights of linears that share an input: at batch 1 a decode step is
bound by reading weights, and every extra kernel call adds fixed overhead, so one call reads
the same bytes in fewer, longer streams. The fused matmul is derived state that its caller owns
(the C++ decoder); the modules keep HF's parameter names and run their projections one by one.
Dense linears are re-pointed at row slices of the fused weight, and weight-only ones at row
views of the fused kernel (:func:`share_rows`), so no memory is duplicated.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdraft.formats import QuantizedWeight
from fastdraft.kernels import kernel_class
from fastdraft.kernels.fused import dense_linear
from fastdraft.kernels.ops.attention_ops import MAX_CAUSAL_DECODE_TOKENS
from fastdraft.kernels.x86 import X86WoqKernel
from fastdraft.layers.quant_linear import QuantLinear


# The projections of a decoder layer that read one input and run as one matmul, by owner module.
PROJECTION_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def _concat_bias(linears: list[nn.Module]) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    ref = next(b for b in biases if b is not None)
    return torch.cat([b.detach() if b is not None else ref.new_zeros(lin.out_features)
                      for b, lin in zip(biases, linears)])


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state dict and hooks) whose matmul is
    :func:`fastdraft.kernels.fused.dense_linear`: fastdraft's kernel for a few bf16 rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)


def is_dense_linear(module: object) -> bool:
    """Whether ``module`` is a plain dense linear (``nn.Linear`` or :class:`Linear`), not a
    quantized one or a subclass with other behaviour."""
    return type(module) in (nn.Linear, Linear)


class FusedLinear:
    """The fused matmul: a dense ``weight`` [sum N, K] or a weight-only ``kernel``, plus ``bias``."""

    def __init__(self, weight: torch.Tensor | None = None, kernel=None, bias: torch.Tensor | None = None) -> None:
        self.weight, self.kernel, self.bias = weight, kernel, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return dense_linear(x, self.weight, self.bias)
        y = self.kernel(x)
        return y if self.bias is None else y + self.bias


def _build_dense(linears: list[nn.Linear]) -> FusedLinear | None:
    weights = [lin.weight for lin in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    fused = torch.cat([w.detach() for w in weights])  # [sum N, K]
    offset = 0
    for lin in linears:  # share storage with the fused weight instead of keeping two copies
        rows = lin.weight.shape[0]
        lin.weight.data = fused[offset:offset + rows]
        offset += rows
    return FusedLinear(weight=fused, bias=_concat_bias(linears))


def _build_quant(linears: list[QuantLinear], dtype: torch.dtype, device: torch.device) -> FusedLinear | None:
    first = linears[0]
    signature = {(lin.bits, lin.group_size, lin.in_features, hasattr(lin, "qzeros"), lin.kernel_name)
                 for lin in linears}
    if len(signature) != 1 or first.kernel_name is not None:
        return None
    bias = _concat_bias(linears)
    bias = None if bias is None else bias.to(dtype)
    whole = X86WoqKernel.joined([lin.built_kernel(dtype, device) for lin in linears])
    if whole is not None:  # the linears already run rows of one fused kernel
        return FusedLinear(kernel=whole, bias=bias)
    parts = [lin.quantized_weight for lin in linears]
    qw = QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                         None if parts[0].zeros is None else torch.cat([p.zeros for p in parts]),
                         first.bits, first.group_size, first.in_features)
    cls = kernel_class(qw, dtype, device)
    if cls.capabilities.priority <= 0:  # only the dense reference: fusing would copy weights
        return None
    kernel = cls(qw, dtype, device)
    share_rows(kernel, linears, dtype, device)
    return FusedLinear(kernel=kernel, bias=bias)


def row_kernels(kernel, linears: list[QuantLinear]) -> list | None:
    """Each of ``linears``' rows of ``kernel`` (their fused weight, in order) as a kernel that
    shares its memory; None where the kernel's layout cannot split there."""
    if not isinstance(kernel, X86WoqKernel):
        return None
    views, start = [], 0
    for lin in linears:
        views.append(kernel.rows(start, start + lin.out_features))
        start += lin.out_features
    return None if any(view is None for view in views) else views


def share_rows(kernel, linears: list[QuantLinear], dtype: torch.dtype, device: torch.device) -> bool:
    """Make each of ``linears`` run its rows of ``kernel`` (their fused weight) instead of a
    copy of its own, where the kernel's layout allows it; whether it did."""
    views = row_kernels(kernel, linears)
    for lin, view in zip(linears, views or []):
        lin.adopt_kernel(view, dtype, device)
    return views is not None


def has_hooks(module: nn.Module) -> bool:
    """Whether someone observes ``module``'s calls (e.g. GPTQ/AWQ calibration): fused paths
    that skip its ``forward`` must then step aside."""
    return bool(module._forward_pre_hooks or module._forward_hooks)


def fused_linear(linears: list[nn.Module], dtype: torch.dtype, device: torch.device) -> FusedLinear | None:
    """The fused matmul of ``linears`` (sharing one input) for activations of ``dtype`` on
    ``device``, or ``None`` when they cannot be fused (mixed formats). The caller owns it."""
    if all(is_dense_linear(lin) for lin in linears):
        return _build_dense(linears)
    if all(isinstance(lin, QuantLinear) for lin in linears):
        return _build_quant(linears, dtype, device)
    return None


# The most tokens of one sequence that a decode or verification pass holds. A weight-only
# kernel that switched to its large-M GEMM at or below it would make the module path and the
# C++ step (always its int8 tiles) differ in the very passes that speculation compares, so such
# a kernel keeps its layer on the module path.
MAX_FUSED_TOKENS = MAX_CAUSAL_DECODE_TOKENS


def cpu_linear_op(ext, linear: FusedLinear | nn.Module | None, dtype: torch.dtype, device: torch.device,
               min_rows: int):
    """The C++ ``Linear`` for a fused or single projection, or ``None`` if it cannot run there."""
    if linear is None:
        return None
    if is_dense_linear(linear):
        linear = FusedLinear(weight=linear.weight.detach(),
                             bias=None if linear.bias is None else linear.bias.detach())
    elif isinstance(linear, QuantLinear):
        bias = None if linear.bias is None else linear.bias.detach()
        linear = FusedLinear(kernel=linear.kernel_for(dtype, device), bias=bias)
    elif not isinstance(linear, FusedLinear):
        return None
    if linear.bias is not None and linear.bias.dtype != dtype:
        return None
    if linear.kernel is None:
        if linear.weight.dtype != dtype:
            return None
        return ext.dense_linear(linear.weight, linear.bias, min_rows)
    kernel = linear.kernel
    if not isinstance(kernel, X86WoqKernel) or kernel.large_m <= MAX_FUSED_TOKENS:
        return None
    return ext.woq_linear_op(*kernel.op_args, linear.bias)


def cpu_projections_op(ext, owner: nn.Module, names: tuple[str, ...], dtype: torch.dtype, device: torch.device,
                    min_rows: int):
    """One C++ op for projections sharing an input (q/k/v, gate/up): their fused matmul, or,
    when their formats differ (e.g. an INT8 v_proj beside INT4 q/k), each run in turn and
    concatenated, as the module path does."""
    fused = fused_linear([getattr(owner, name) for name in names], dtype, device)
    if fused is not None:
        return cpu_linear_op(ext, fused, dtype, device, min_rows)
    parts = [cpu_linear_op(ext, getattr(owner, name), dtype, device, min_rows) for name in names]
    return None if any(part is None for part in parts) else ext.concat_linear(parts)
