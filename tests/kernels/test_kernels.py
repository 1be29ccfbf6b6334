"""Every weight-only kernel against the plain PyTorch reference."""

import pytest
import torch

from fastdraft.formats import PER_CHANNEL, dequantize, quantize
from fastdraft.kernels import KERNELS, select_kernel

INT4_KERNELS = [name for name, k in KERNELS.items() if 4 in k.capabilities.bits and k.is_available()]
INT8_KERNELS = [name for name, k in KERNELS.items() if 8 in k.capabilities.bits and k.is_available()]
SHAPES = [(96, 256), (200, 512), (64, 1024), (48, 3072)]  # (out_features, in_features), incl. odd N


def _check(kernel_name, qw, m, dtype):
    torch.manual_seed(m)
    x = torch.randn(m, qw.in_features, dtype=dtype)
    kernel = select_kernel(qw, dtype, "cpu", name=kernel_name)
    out = kernel(x)
    expected = x.float() @ dequantize(qw).t()
    assert out.shape == (m, qw.out_features) and out.dtype == dtype
    # fp32: exact up to summation order; bf16: activations/scales rounded to 8 mantissa bits.
    # Kernels with dynamically quantized int8 activations are exact against their own twin
    # (tests/kernels/test_x86.py) and within int8 rounding of the dense product.
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if KERNELS[kernel_name].capabilities.is_activation_quantized:
        tol = 2e-2
    scale = expected.abs().max().item()
    assert (out.float() - expected).abs().max().item() <= tol * scale


@pytest.mark.parametrize("kernel_name", INT4_KERNELS)
@pytest.mark.parametrize("group_size", [16, 32, 64, 128, 256, 512, 1024, PER_CHANNEL])
@pytest.mark.parametrize("scheme", ["sym", "asym", "asymf"])
@pytest.mark.parametrize("shape", SHAPES)
def test_int4_kernels_match_reference(kernel_name, group_size, scheme, shape):
    n, k = shape
    if group_size != PER_CHANNEL and k % group_size:
        pytest.skip("group size does not divide in_features")
    qw = quantize(torch.randn(n, k), 4, group_size, sym=scheme == "sym", float_zeros=scheme == "asymf")
    if not KERNELS[kernel_name].supports(qw, torch.float32, torch.device("cpu")):
        pytest.skip(f"{kernel_name} does not support this weight")
    for m in (1, 2, 7, 64):
        _check(kernel_name, qw, m, torch.float32)
    _check(kernel_name, qw, 3, torch.bfloat16)


@pytest.mark.parametrize("kernel_name", INT8_KERNELS)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_kernels_match_reference(kernel_name, shape):
    qw = quantize(torch.randn(*shape), 8, PER_CHANNEL, sym=True)
    for m in (1, 5, 33):
        _check(kernel_name, qw, m, torch.float32)
    _check(kernel_name, qw, 4, torch.bfloat16)


def test_aten_int8_takes_a_weight_at_any_address():
    # A weight mapped from a safetensors file need not be aligned; PyTorch's int8 kernel crashes
    # on one that is not 16-byte aligned unless the kernel copies it first.
    qw = quantize(torch.randn(320, 64), 8, PER_CHANNEL, sym=True)
    buffer = torch.empty(qw.qweight.numel() + 8, dtype=torch.int8)
    misaligned = buffer[8:].view(qw.qweight.shape)
    misaligned.copy_(qw.qweight)
    assert misaligned.data_ptr() % 16
    shifted = type(qw)(misaligned, qw.scales, qw.zeros, qw.bits, qw.group_size, qw.in_features)
    x = torch.randn(63, 64, dtype=torch.bfloat16)
    got = select_kernel(shifted, torch.bfloat16, "cpu", name="aten-int8")(x)
    assert torch.equal(got, select_kernel(qw, torch.bfloat16, "cpu", name="aten-int8")(x))


def test_selection_prefers_fast_kernels_and_falls_back():
    qw4 = quantize(torch.randn(64, 512), 4, 128, sym=False)
    assert select_kernel(qw4, torch.float32, "cpu").name != "reference"
    qw8_grouped = quantize(torch.randn(64, 512), 8, 128, sym=True)
    # fp16 activations: only the reference takes grouped INT8 (aten's is per-channel, ours f32/bf16)
    assert select_kernel(qw8_grouped, torch.float16, "cpu").name == "reference"
    with pytest.raises(ValueError, match="unknown kernel"):
        select_kernel(qw4, torch.float32, "cpu", name="nope")


def test_leading_dims_are_preserved():
    qw = quantize(torch.randn(32, 256), 4, 64, sym=True)
    kernel = select_kernel(qw, torch.float32, "cpu")
    x = torch.randn(2, 3, 256)
    assert kernel(x).shape == (2, 3, 32)

