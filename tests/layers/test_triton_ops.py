"""The GPU's small kernels against their PyTorch twins: the Triton RMSNorm, rotary and
SiLU-and-multiply (on a GPU when there is one, else through Triton's interpreter on the CPU),
and PyTorch's CUDA int4 matmul (on a GPU only)."""

from __future__ import annotations

import os

import pytest
import torch

from fastdraft.formats import dequantize, quantize
from fastdraft.kernels import KERNELS, select_kernel, triton_ops
from fastdraft.kernels.fused import reference_rotary
from fastdraft.kernels.ops.activation_ops import reference_silu_and_mul
from fastdraft.kernels.ops.norm_ops import reference_rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not triton_ops.is_available() or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton, on a GPU or through its interpreter (TRITON_INTERPRET=1, set by conftest)")
# The interpreter emulates bf16 roundings imprecisely: on the CPU only fp32 is compared.
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # one bf16 rounding apart at most (RMSNorm's sum of squares is reduced in another order)
        ulp = 2.0 ** -7 * float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), atol=ulp, rtol=2 ** -7)


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_twin(dtype):
    x, weight = _randn(7, 40, dtype=dtype), _randn(40, dtype=dtype, seed=1)
    out = torch.full_like(x, float("nan"))
    triton_ops.triton_rms_norm(x, weight, 1e-6, out=out)
    _close(out, reference_rms_norm(x, weight, 1e-6))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_the_residual_first(dtype):
    x, residual, weight = _randn(5, 40, dtype=dtype), _randn(5, 40, dtype=dtype, seed=2), _randn(40, dtype=dtype,
                                                                                                  seed=1)
    total = x + residual  # rounded to the dtype, as the module path's residual add
    out = triton_ops.triton_rms_norm(x, weight, 1e-5, residual=residual)
    assert torch.equal(residual, total)  # updated in place, exactly
    _close(out, reference_rms_norm(total, weight, 1e-5))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_twin(dtype):
    x = _randn(3, 2 * 1100, dtype=dtype)  # more columns than one block
    _close(triton_ops.triton_silu_and_mul(x), reference_silu_and_mul(x))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_slices_of_wider_rows_in_place(dtype):
    heads, kv_heads, head_dim, num_tokens = 3, 1, 16, 4
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    cos, sin = _randn(50, head_dim, dtype=dtype, seed=3), _randn(50, head_dim, dtype=dtype, seed=4)
    positions = torch.tensor([3, 7, 0, 49], device=DEVICE)
    before = qkv.clone()
    q_and_k = qkv[:, :(heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
    triton_ops.rotary_(q_and_k, positions, cos, sin)
    want = reference_rotary(before[:, :(heads + kv_heads) * head_dim].reshape(1, num_tokens, heads + kv_heads,
                                                                             head_dim),
                            cos[positions][None], sin[positions][None])[0]
    _close(q_and_k, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], before[:, (heads + kv_heads) * head_dim:])  # v untouched


@needs_triton
def test_shapes_are_checked():
    with pytest.raises(ValueError, match="contiguous columns"):
        triton_ops.triton_rms_norm(_randn(4, 6, dtype=torch.float32).t(), _randn(4, dtype=torch.float32), 1e-6)
    with pytest.raises(ValueError, match="even head_dim"):
        x = _randn(2, 1, 5, dtype=torch.float32)
        triton_ops.rotary_(x, torch.zeros(2, dtype=torch.long, device=DEVICE), _randn(4, 5, dtype=torch.float32),
                           _randn(4, 5, dtype=torch.float32))


@pytest.mark.skipif(not KERNELS["aten-int4-cuda"].is_available(), reason="needs a CUDA GPU of compute capability 8+")
@pytest.mark.parametrize("group_size", [32, 128, 512])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_int4_on_cuda_matches_reference(group_size, sym, m):
    """PyTorch's CUDA int4 matmul over its packed layout: the dense product of the dequantized
    weight, within bf16 rounding (its scales and offsets are bf16)."""
    torch.manual_seed(group_size + m)
    qw = quantize(torch.randn(192, 1024) * 0.02, 4, group_size, sym=sym)
    kernel = select_kernel(qw, torch.bfloat16, "cuda")
    assert kernel.name == "aten-int4-cuda"  # chosen over the reference on a GPU
    x = torch.randn(m, qw.in_features, dtype=torch.bfloat16, device="cuda")
    out = kernel(x).float().cpu()
    expected = x.float().cpu() @ dequantize(qw).t()
    assert out.shape == (m, 192)
    assert ((out - expected).norm() / expected.norm()).item() < 1e-2
