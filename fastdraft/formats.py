"""The canonical weight-only formats, and their plain PyTorch reference quantizer.

Every fast path (kernels, GPTQ, AWQ, checkpoint import) produces or consumes exactly these
tensors, and every kernel is tested against :func:`dequantize` below.

INT4 (``bits=4``)
-----------------
A linear weight ``W`` of shape ``[N, K]`` (out_features, in_features) is cut along ``K`` into
``num_groups = K // G`` groups of ``G`` consecutive input channels; ``G = K`` is per-channel.

* ``qweight``: uint8 ``[N, K // 2]``. Byte ``b`` of row ``n`` holds ``q[n, 2b]`` in its low
  nibble (bits 0-3) and ``q[n, 2b + 1]`` in its high nibble (bits 4-7). ``q`` is in 0..15.
* ``scales``: float16 ``[N, num_groups]``.
* ``zeros``: for asymmetric groups, ``[N, num_groups]``, either uint8 integer zero points in
  0..15 (as GPTQ/AWQ checkpoints store them) or float16 fractional ones ("float zeros", as
  llama.cpp's Q4_1/Q4_K and ipex-llm's ``asym_int4`` store a group minimum); absent for
  symmetric groups, where the zero point is the constant 8.

Dequantization, for every ``n, k`` with ``g = k // G``::

    W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]

Symmetric groups map the value of largest magnitude ``m`` (with its sign) to ``q = 0``:
``scale = m / -8`` and ``q = clamp(round(w / scale) + 8, 0, 15)`` (llama.cpp's Q4_0 rule,
which uses all 16 levels). Asymmetric groups use the min/max: ``scale = (max - min) / 15``,
``zero = clamp(round(-min / scale), 0, 15)``, ``q = clamp(round(w / scale) + zero, 0, 15)``.
With float zeros the zero point is not rounded: ``zero = fp16(-min / scale)`` and
``q = clamp(round(w / scale + zero), 0, 15)``, so the group's min lands on a level; the scale
is ``(max - min) / L`` for the ``L`` in 9..15 with the least squared error, so a group already
on a 4-bit min/scale grid (a Q4_K sub-block) is kept exactly.

INT6 (``bits=6``)
-----------------
Symmetric only, for LM heads (as llama.cpp keeps a Q4_K_M model's output at Q6_K): the INT4
groups and rule with 64 levels. ``qweight`` is uint8 ``[N, 3K / 4]``: each 3 bytes hold 4
consecutive values, ``q[4i] | q[4i+1] << 6 | q[4i+2] << 12 | q[4i+3] << 18`` as a little-endian
24-bit integer; ``q`` is in 0..63 and the zero point the constant 32. ``scale = m / -32`` for
the signed value of largest magnitude ``m``, ``q = clamp(round(w / scale) + 32, 0, 63)``,
``W = (q - 32) * scale``.

INT8 (``bits=8``)
-----------------
Symmetric only: ``qweight`` is int8 ``[N, K]``, ``scales`` float16 ``[N, num_groups]``,
``scale = absmax / 127``, ``q = clamp(round(w / scale), -127, 127)``, ``W = q * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

SUPPORTED_GROUP_SIZES = (16, 32, 64, 128, 256, 512, 1024)
PER_CHANNEL = -1  # group_size value meaning one group spanning all of K
SCALE_DTYPE = torch.float16
_MIN_SCALE = 1e-8  # a group of zeros still needs a non-zero scale


class WeightFormat(NamedTuple):
    """How one weight is quantized: ``bits``, ``group_size`` (-1: per channel), symmetric or
    not, and for asymmetric INT4 whether zero points are float16 rather than integers."""

    bits: int
    group_size: int
    sym: bool
    float_zeros: bool = False

    def num_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of the canonical tensors of an ``[out_features, in_features]`` weight: codes,
        float16 scales and, when asymmetric, zero points (uint8, or float16 when fractional)."""
        num_groups = in_features // resolve_group_size(self.group_size, in_features)
        zero_bytes = 0 if self.sym else (2 if self.float_zeros else 1)
        return out_features * (in_features * self.bits // 8 + num_groups * (2 + zero_bytes))


def resolve_group_size(group_size: int, in_features: int) -> int:
    """The effective group size for a layer, with a clear error when it does not fit."""
    if group_size == PER_CHANNEL:
        return in_features
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES} or -1 (per channel), got {group_size}")
    if in_features % group_size != 0:
        raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
    return group_size


@dataclass
class QuantizedWeight:
    """A quantized ``[out_features, in_features]`` weight in the canonical layout above."""

    qweight: torch.Tensor
    scales: torch.Tensor  # [N, num_groups] float16
    zeros: torch.Tensor | None  # [N, num_groups] uint8 or float16, asymmetric INT4 only
    bits: int
    group_size: int  # effective group size (in_features when per-channel)
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def is_sym(self) -> bool:
        return self.zeros is None

    @property
    def has_float_zeros(self) -> bool:
        return self.zeros is not None and self.zeros.is_floating_point()

    @property
    def num_bytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 ``[N, K]`` -> packed uint8 ``[N, K // 2]`` (even k in the low nibble)."""
    if q.shape[-1] % 2:
        raise ValueError("INT4 packing needs an even number of input features")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 ``[N, K // 2]`` -> uint8 values ``[N, K]``."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_int6(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..63 ``[N, K]`` -> packed uint8 ``[N, 3K / 4]`` (4 values in 3 bytes)."""
    if q.shape[-1] % 4:
        raise ValueError("INT6 packing needs in_features divisible by 4")
    q = q.to(torch.int32).reshape(*q.shape[:-1], -1, 4)  # [N, K / 4, 4]
    word = q[..., 0] | (q[..., 1] << 6) | (q[..., 2] << 12) | (q[..., 3] << 18)  # 24 bits
    packed = torch.stack((word & 0xFF, (word >> 8) & 0xFF, word >> 16), dim=-1)  # [N, K / 4, 3]
    return packed.to(torch.uint8).flatten(-2)


def unpack_int6(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 ``[N, 3K / 4]`` -> uint8 values ``[N, K]``."""
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 3)  # [N, K / 4, 3]
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    q = torch.stack([(word >> (6 * i)) & 63 for i in range(4)], dim=-1)  # [N, K / 4, 4]
    return q.to(torch.uint8).flatten(-2)


def sym_zero_point(bits: int) -> int:
    """The constant zero point of symmetric ``bits``-bit codes, the middle of their range:
    8 (INT4), 32 (INT6), 128 (INT8 stored unsigned, as the x86 kernels do)."""
    if bits not in (4, 6, 8):
        raise ValueError(f"no symmetric zero point for bits={bits}")
    return 2 ** (bits - 1)


def group_params(w: torch.Tensor, sym: bool, float_zeros: bool = False,
                 bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each row of ``w`` [..., G] (fp32) -> ([...], [...]) fp32, for
    INT4 (symmetric or not) or symmetric INT6. Float zeros come back rounded to their stored
    float16 (the scale is rounded by callers)."""
    if bits not in (4, 6):
        raise ValueError(f"group_params covers INT4 and INT6, got bits={bits}")
    if bits == 6 and not sym:
        raise ValueError("INT6 weight-only quantization is symmetric only")
    if sym:
        half = float(sym_zero_point(bits))
        idx = w.abs().argmax(dim=-1, keepdim=True)
        signed_max = w.gather(-1, idx).squeeze(-1)
        scale = signed_max / -half
        scale = torch.where(scale.abs() < _MIN_SCALE, torch.full_like(scale, _MIN_SCALE), scale)
        return scale, torch.full_like(scale, half)
    w_min, w_max = w.amin(dim=-1), w.amax(dim=-1)
    if float_zeros:
        return _float_zero_params(w, w_min, w_max)
    scale = ((w_max - w_min) / 15.0).clamp(min=_MIN_SCALE)
    zero = torch.round(-w_min / scale).clamp(0, 15)
    return scale, zero


# Float zeros try a group's range over this many levels and keep the least squared error: a
# group already on a 4-bit grid whose codes span fewer than 16 levels (common in Q4_K files)
# is then recovered exactly, as llama.cpp's k-quant search would find it.
_FLOAT_ZERO_LEVELS = (15, 14, 13, 12, 11, 10, 9)


def _float_zero_params(w: torch.Tensor, w_min: torch.Tensor, w_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    best_scale = best_zero = best_err = None
    for levels in _FLOAT_ZERO_LEVELS:
        scale = ((w_max - w_min) / levels).clamp(min=_MIN_SCALE)
        stored = scale.to(SCALE_DTYPE).float()  # may underflow to 0 for an all-zero group
        # The zero against the stored scale, so min lands on level 0 of what dequantizes.
        zero = torch.where(stored > 0, -w_min / stored, torch.zeros_like(w_min)).clamp(0, 15)
        zero = zero.to(SCALE_DTYPE).float()
        q = quantize_group_values(w, stored, zero, float_zeros=True)
        err = ((q - zero.unsqueeze(-1)) * stored.unsqueeze(-1) - w).pow(2).sum(-1)
        if best_err is None:
            best_scale, best_zero, best_err = scale, zero, err
        else:
            is_better = err < best_err
            best_scale = torch.where(is_better, scale, best_scale)
            best_zero = torch.where(is_better, zero, best_zero)
            best_err = torch.where(is_better, err, best_err)
    return best_scale, best_zero


def quantize_group_values(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                          float_zeros: bool = False, max_level: int = 15) -> torch.Tensor:
    """q = clamp(round(w / scale) + zero, 0, max_level) (float zeros: round(w / scale + zero)),
    with scale/zero broadcast over the last dim. ``max_level``: 15 (INT4) or 63 (INT6)."""
    if float_zeros:
        return torch.clamp(torch.round(w / scale.unsqueeze(-1) + zero.unsqueeze(-1)), 0, max_level)
    return torch.clamp(torch.round(w / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, max_level)


def quantize(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
             float_zeros: bool = False) -> QuantizedWeight:
    """Round-to-nearest reference quantizer for a ``[N, K]`` weight."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    if bits not in (4, 6, 8):
        raise ValueError(f"bits must be 4, 6 or 8, got {bits}")
    if float_zeros and (sym or bits != 4):
        raise ValueError("float zero points apply to asymmetric INT4 only")
    n, k = weight.shape
    g = resolve_group_size(group_size, k)
    w = weight.detach().float().reshape(n, k // g, g)  # [N, num_groups, G]
    if bits == 6:
        scale, zero = group_params(w, sym, bits=6)  # raises for asymmetric INT6
        scale = scale.to(SCALE_DTYPE)
        q = quantize_group_values(w, scale.float(), zero, max_level=63)
        return QuantizedWeight(pack_int6(q.to(torch.uint8).reshape(n, k)), scale, None, 6, g, k)
    if bits == 8:
        if not sym:
            raise ValueError("INT8 weight-only quantization is symmetric only")
        scale = (w.abs().amax(dim=-1) / 127.0).clamp(min=_MIN_SCALE).to(SCALE_DTYPE)
        q = torch.clamp(torch.round(w / scale.float().unsqueeze(-1)), -127, 127).to(torch.int8)
        return QuantizedWeight(q.reshape(n, k), scale, None, 8, g, k)
    scale, zero = group_params(w, sym, float_zeros)
    # Round the scale to its stored precision first, so q is computed against the real scale.
    scale = scale.to(SCALE_DTYPE)
    q = quantize_group_values(w, scale.float(), zero, float_zeros).to(torch.uint8).reshape(n, k)
    zeros = None if sym else zero.to(SCALE_DTYPE if float_zeros else torch.uint8)
    return QuantizedWeight(pack_int4(q), scale, zeros, 4, g, k)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference dequantization to a dense ``[N, K]`` weight."""
    n, k, g = qw.out_features, qw.in_features, qw.group_size
    scale = qw.scales.float().unsqueeze(-1)  # [N, num_groups, 1]
    if qw.bits == 8:
        w = qw.qweight.float().reshape(n, k // g, g) * scale
    else:
        q = (unpack_int6 if qw.bits == 6 else unpack_int4)(qw.qweight).float().reshape(n, k // g, g)
        zero = torch.full_like(scale, sym_zero_point(qw.bits)) if qw.zeros is None else qw.zeros.float().unsqueeze(-1)
        w = (q - zero) * scale
    return w.reshape(n, k).to(dtype)
