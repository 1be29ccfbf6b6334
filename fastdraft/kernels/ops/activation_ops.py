"""Activations of an MLP, gated (``act(gate) * up`` over rows ``[gate | up]``) or not: SiLU
(Llama, Qwen), with its reference, the C++ kernel (CPU) and the Triton kernel (GPU), and GELU's
tanh approximation (Gemma), with its reference and the C++ kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdraft.kernels import triton_ops
from fastdraft.kernels.fused import cpu_extension_for

ACTIVATIONS = ("silu", "gelu_tanh")


def reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x = [gate | up]`` along the last dim -> ``silu(gate) * up``."""
    if x.is_cuda and triton_ops.is_available():
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return triton_ops.triton_silu_and_mul(rows).view(*x.shape[:-1], x.shape[-1] // 2)
    ext = cpu_extension_for(x)
    if ext is None:
        return reference_silu_and_mul(x)
    out = ext.silu_and_mul(x.reshape(-1, x.shape[-1]).contiguous())
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def reference_gated_activation(x: torch.Tensor, name: str) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return activation(gate, name) * up


def gated_activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """``name(gate) * up`` of ``x = [gate | up]``, ``name`` one of :data:`ACTIVATIONS`: SiLU on
    its kernels; GELU-tanh on the C++ kernel on a CPU (the C++ step's, so the two paths agree
    bit for bit) and in PyTorch elsewhere."""
    if name == "silu":
        return silu_and_mul(x)
    ext = cpu_extension_for(x) if name == "gelu_tanh" else None
    if ext is None:
        return reference_gated_activation(x, name)
    out = ext.gelu_tanh_and_mul(x.reshape(-1, x.shape[-1]).contiguous())
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """The ungated activation ``name`` of x (an MLP without a gate)."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}; known: {ACTIVATIONS}")
