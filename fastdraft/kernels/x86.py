"""fastdraft's own INT4/INT6/INT8 weight-only kernels for x86-64, C++ in ``csrc/``.

Repacked layout (built once per layer by :func:`repack`)
--------------------------------------------------------
``K`` is zero-padded to ``k_pad``, a multiple of 128, and ``N`` to a multiple of 16.

* ``packed`` uint8 ``[num_tiles, num_chunks, tile, 4]``: tile ``t`` holds output rows
  ``tile*t .. tile*t + tile-1``, where ``tile`` is the instruction-set variant's choice
  (``CpuKernels.tile_rows``; 16 for every variant today). One chunk holds 4 bytes per row, so
  with 16 rows a single ``vpdpbusd`` (AVX-512) or two ``vpmaddubsw`` (AVX2) multiply every row
  at once by 4 broadcast activation bytes.
  INT4: a chunk covers 8 input channels, byte ``j`` of row ``n`` holds ``q[n, 8c+j]`` in its
  low nibble and ``q[n, 8c+4+j]`` in its high nibble. INT8: 4 channels, stored as ``q + 128``.
  INT6 (values 0..63): a chunk is 96 bytes, INT4's 64 bytes of low nibbles, then 32 bytes of
  the values' bits 4-5: byte ``i`` holds, from bit 0, those of the low and the high nibble of
  nibble byte ``i``, then of nibble byte ``i + 32`` (the kernel spreads them with two shifts).
* ``scales`` float16 ``[num_tiles, num_groups, tile]``, ``zeros`` uint8 likewise (asymmetric INT4).

Math
----
Activations are quantized on the fly per block of ``block = min(group, 128)`` channels to int8
(``d = absmax / 127``, round half to even), so every block is an exact integer dot product; see
:func:`reference_woq_matmul`, the plain PyTorch twin the C++ is tested against. Each output row
is computed by the same sequence of operations whatever the number of rows, so the kernel is
row-invariant: verifying k drafted tokens reproduces one-token decoding bit for bit.

On CPUs with AMX-BF16, calls with at least ``large_m`` rows (prefill; :data:`AMX_LARGE_M`)
instead dequantize the weight (in C++) and run oneDNN's bf16 GEMM on the AMX tiles. Without
AMX the VNNI kernel is the faster one at every M (its int8 dot products do twice as many
multiply-adds an instruction as bf16 ones, and it needs no dequantized copy), so it serves
prefill too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdraft.formats import QuantizedWeight, sym_zero_point, unpack_int4, unpack_int6
from fastdraft.kernels.base import KernelCapabilities, WeightOnlyKernel
from fastdraft.kernels.build import CpuKernels, cpu_features, load_cpu_kernels
from fastdraft.kernels.memory import huge_page_copy, huge_page_zeros
from fastdraft.kernels.mode import is_batch_invariant

TILE = 16
K_ALIGN = 128
# Bump when :func:`repack`'s output changes for the same weight: saved layouts name it.
PACKED_LAYOUT_VERSION = 1
# Rows from which dequantize + AMX GEMM takes over, on AMX CPUs. Dequantizing costs a pass over
# the whole weight per call, so VNNI wins at small M; AMX's tiles repay that pass only over
# enough rows. The crossover was timed on Sapphire Rapids.
AMX_LARGE_M = 160


def default_large_m(isa: str = "avx512_vnni") -> int | None:
    """Rows from which to use the dequantize + oneDNN path; None: never. Only AMX CPUs running
    the ``avx512_vnni`` variant take it: the crossover was measured against that variant's
    kernel, and a forced smaller variant stands for a CPU without AMX."""
    features = cpu_features()
    return AMX_LARGE_M if isa == "avx512_vnni" and features.get("amx_bf16") and features.get("amx_tile") else None


@dataclass
class PackedWeight:
    """A weight in the kernel's layout, with the geometry the C++ needs."""

    packed: torch.Tensor  # uint8 [num_tiles, num_chunks, 16, 4] ([num_tiles, num_chunks, 96] for INT6)
    scales: torch.Tensor  # float16 [num_tiles, num_groups, 16]
    zeros: torch.Tensor  # uint8 [num_tiles, num_groups, 16]; empty when the zero point is constant
    bits: int
    out_features: int
    in_features: int
    k_pad: int
    block: int  # activation quantization block, divides group
    group: int  # group size in the padded layout (k_pad when per-channel)
    zero_const: float  # zero point when ``zeros`` is empty: 8 (symmetric INT4), 32 (INT6) or 128 (INT8)

    @property
    def tile(self) -> int:
        return self.scales.shape[-1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layout as named tensors (for a safetensors file): :meth:`from_tensors` inverts it."""
        geometry = torch.tensor([self.bits, self.out_features, self.in_features, self.k_pad, self.block, self.group])
        return {"packed": self.packed, "scales": self.scales, "zeros": self.zeros, "geometry": geometry}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "PackedWeight":
        """The layout :meth:`tensors` gave; ``ValueError`` where the shapes do not fit its geometry."""
        bits, n, k, k_pad, block, group = (int(v) for v in tensors["geometry"].tolist())
        packed, scales, zeros = tensors["packed"], tensors["scales"], tensors["zeros"]
        num_tiles = scales.shape[0] if scales.dim() == 3 else -1
        is_valid = (bits in (4, 6, 8) and scales.dtype == torch.float16 and packed.dtype == torch.uint8
                    and num_tiles * scales.shape[-1] >= n > (num_tiles - 1) * scales.shape[-1]
                    and packed.shape[0] == num_tiles and packed.numel() == num_tiles * k_pad * scales.shape[-1] * bits // 8
                    and scales.shape[1] == k_pad // group and zeros.numel() in (0, scales.numel()))
        if not is_valid:
            raise ValueError(f"a packed weight's tensors do not fit its geometry {[bits, n, k, k_pad, block, group]}")
        return cls(packed, scales, zeros, bits, n, k, k_pad, block, group, float(sym_zero_point(bits)))

    def rows(self, start: int, stop: int) -> "PackedWeight | None":
        """Output rows ``start:stop`` as views of this layout (no copy), or None where they do not
        begin on a tile (and end on one, or at the last row)."""
        tile = self.tile
        if start % tile or (stop % tile and stop != self.out_features) or not 0 <= start < stop <= self.out_features:
            return None
        tiles = slice(start // tile, -(-stop // tile))
        zeros = self.zeros[tiles] if self.zeros.numel() else self.zeros
        return PackedWeight(self.packed[tiles], self.scales[tiles], zeros, self.bits, stop - start,
                            self.in_features, self.k_pad, self.block, self.group, self.zero_const)


def _tile_rows(t: torch.Tensor, n_pad: int, tile: int) -> torch.Tensor:
    """[N, X] -> [num_tiles, X, tile] with zero rows appended up to n_pad."""
    t = F.pad(t, (0, 0, 0, n_pad - t.shape[0]))
    return t.reshape(n_pad // tile, tile, -1).transpose(1, 2).contiguous()


def _int6_chunks(q: torch.Tensor) -> torch.Tensor:
    """INT6 values [tiles, 16, chunks, 2, 4] (k = 8c + 4h + j) -> [tiles, chunks, 96] bytes."""
    q = q.permute(0, 2, 1, 3, 4)  # [tiles, chunks, 16 rows, h, j]
    lo = q[..., 0, :].flatten(-2)  # [tiles, chunks, 64]: nibble byte p = 4 * row + j
    hi = q[..., 1, :].flatten(-2)
    nibbles = (lo & 15) | ((hi & 15) << 4)
    fields = (lo >> 4) | ((hi >> 4) << 2)  # [tiles, chunks, 64], 4 bits each
    high_bytes = fields[..., :32] | (fields[..., 32:] << 4)  # [tiles, chunks, 32]
    return torch.cat((nibbles, high_bytes), dim=-1).contiguous()


def _reference_codes(qw: QuantizedWeight, tile: int, k_pad: int, n_pad: int, pad_value: int) -> torch.Tensor:
    """The codes in the tile layout, in PyTorch: the twin of the C++ ``repack_codes``."""
    if qw.bits == 4:
        q = unpack_int4(qw.qweight)  # [N, K] 0..15
    elif qw.bits == 6:
        q = unpack_int6(qw.qweight)  # [N, K] 0..63
    else:
        q = (qw.qweight.to(torch.int16) + sym_zero_point(8)).to(torch.uint8)  # [N, K] 1..255
    q = F.pad(q, (0, k_pad - qw.in_features, 0, n_pad - qw.out_features), value=pad_value)
    q = q.reshape(n_pad // tile, tile, -1, 4)  # [tiles, tile, k_pad / 4, 4]
    if qw.bits == 6:
        return _int6_chunks(q.reshape(n_pad // tile, tile, k_pad // 8, 2, 4))
    if qw.bits == 4:
        q = q.reshape(n_pad // tile, tile, k_pad // 8, 2, 4)  # k = 8c + 4h + j
        q = q[..., 0, :] | (q[..., 1, :] << 4)  # [tiles, 16, chunks, 4]
    return q.transpose(1, 2).contiguous()  # [tiles, chunks, 16, 4]


def repack(qw: QuantizedWeight, tile: int = TILE, kernels: CpuKernels | None = None) -> PackedWeight:
    """Canonical :class:`QuantizedWeight` -> the kernel layout documented above, in tiles of
    ``tile`` output rows (the variant's ``tile_rows``): the codes laid out by ``kernels``' C++
    ``repack_codes`` where given, else by its PyTorch twin."""
    if tile != TILE and qw.bits == 6:
        raise ValueError(f"the INT6 layout is defined for tiles of {TILE} rows, not {tile}")
    n, k, g = qw.out_features, qw.in_features, qw.group_size
    k_pad = -(-k // K_ALIGN) * K_ALIGN
    n_pad = -(-n // tile) * tile
    is_per_channel = g == k
    group = k_pad if is_per_channel else g
    block = min(group, K_ALIGN)
    if group % block or k_pad % group:
        raise ValueError(f"group size {g} cannot be laid out for in_features {k}")
    num_groups = k_pad // group
    pad_value = sym_zero_point(qw.bits) if qw.bits != 4 or qw.is_sym else 0
    # Decode streams ``packed`` once per token: keep it on huge pages (see kernels.memory).
    if kernels is not None:
        chunk_shape = (k_pad // 8, 96) if qw.bits == 6 else (k_pad * qw.bits // 32, tile, 4)
        packed = huge_page_zeros((n_pad // tile, *chunk_shape), torch.uint8)
        kernels.repack_codes(qw.qweight, qw.bits, n, k, k_pad, tile, pad_value, packed)
    else:
        packed = huge_page_copy(_reference_codes(qw, tile, k_pad, n_pad, pad_value))

    def per_group(t: torch.Tensor, fill: float) -> torch.Tensor:
        t = F.pad(t, (0, num_groups - t.shape[1]), value=fill)  # padded groups of zeros (K tail)
        return _tile_rows(t, n_pad, tile)

    scales = per_group(qw.scales.to(torch.float16), 0.0)
    zeros = per_group(qw.zeros, 0) if qw.zeros is not None else torch.empty(0, dtype=torch.uint8)
    zero_const = float(sym_zero_point(qw.bits))
    return PackedWeight(packed, scales, zeros, qw.bits, n, k, k_pad, block, group, zero_const)


def reference_woq_matmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The kernel's math in plain PyTorch (float64): dynamic per-block int8 activations times
    the integer weights, with the group scales and zero points applied as in the C++."""
    pw = repack(qw)
    k, k_pad, block = qw.in_features, pw.k_pad, pw.block
    xf = F.pad(x.reshape(-1, k).float(), (0, k_pad - k))  # [M, k_pad]
    xb = xf.reshape(xf.shape[0], -1, block)  # [M, num_blocks, block]
    d = xb.abs().amax(dim=-1) / 127.0  # float32, as in C++
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    xq = torch.round(xb * inv.unsqueeze(-1))  # [M, num_blocks, block], half to even
    if qw.bits in (4, 6):
        wq = (unpack_int4 if qw.bits == 4 else unpack_int6)(qw.qweight).double()
        zero = (torch.full_like(qw.scales, sym_zero_point(qw.bits), dtype=torch.float64) if qw.zeros is None
                else qw.zeros.double())
    else:
        wq, zero = qw.qweight.double(), torch.zeros_like(qw.scales, dtype=torch.float64)
    w = F.pad(wq, (0, k_pad - k)).reshape(qw.out_features, -1, block)  # [N, num_blocks, block]
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), w)  # exact integer dot per block
    sums = xq.double().sum(-1)  # [M, num_blocks]
    num_groups = k_pad // pw.group
    blocks_per_group = pw.group // block
    gacc = (dots * d.double().unsqueeze(1)).reshape(*dots.shape[:2], num_groups, blocks_per_group).sum(-1)
    corr = (sums * d.double()).reshape(-1, num_groups, blocks_per_group).sum(-1)  # [M, G]
    scales = F.pad(qw.scales.double(), (0, num_groups - qw.scales.shape[1]))  # [N, G]
    zero = F.pad(zero, (0, num_groups - zero.shape[1]))
    y = (scales * gacc).sum(-1) - (corr.unsqueeze(1) * (scales * zero)).sum(-1)  # [M, N]
    return y.reshape(*x.shape[:-1], qw.out_features)


class X86WoqKernel(WeightOnlyKernel):
    """INT4/INT6/INT8 GEMV and small-M GEMM on the instruction-set variant this CPU runs
    (AVX-512 VNNI, AVX2 or plain C++); dequantize + oneDNN GEMM for large M on AMX CPUs."""

    name = "x86"
    capabilities = KernelCapabilities(bits=(4, 6, 8), is_asym_supported=True, group_sizes=None,
                                      activation_dtypes=(torch.float32, torch.bfloat16),
                                      device_types=("cpu",), priority=20, is_row_invariant=True,
                                      is_activation_quantized=True)

    @classmethod
    def is_available(cls) -> bool:
        return load_cpu_kernels() is not None

    @classmethod
    def supports(cls, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
        if qw.bits in (6, 8) and not qw.is_sym:
            return False
        return super().supports(qw, dtype, device)

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, device: torch.device,
                 large_m: int | None = -1, kernels: CpuKernels | None = None) -> None:
        ext = kernels if kernels is not None else load_cpu_kernels()
        if ext is None:
            raise ValueError("the x86 kernels are not available on this system")
        self._setup(ext, dtype, large_m, repack(qw, ext.tile_rows, ext))

    @classmethod
    def from_packed(cls, packed: PackedWeight, dtype: torch.dtype, large_m: int | None = -1,
                    kernels: CpuKernels | None = None) -> "X86WoqKernel":
        """The kernel of a weight already in this variant's layout (a saved one, mapped), used as is."""
        ext = kernels if kernels is not None else load_cpu_kernels()
        if ext is None:
            raise ValueError("the x86 kernels are not available on this system")
        if packed.tile != ext.tile_rows or (packed.bits == 6 and packed.tile != TILE):
            raise ValueError(f"a layout of {packed.tile}-row tiles does not fit the {ext.name} kernels")
        kernel = cls.__new__(cls)
        kernel._setup(ext, dtype, large_m, packed)
        return kernel

    def _setup(self, ext: CpuKernels, dtype: torch.dtype, large_m: int | None, pw: PackedWeight) -> None:
        self.ext, self.dtype = ext, dtype
        # -1: decide from the CPU; None: VNNI at every M.
        large_m = default_large_m(ext.name) if large_m == -1 else large_m
        self.large_m = large_m if large_m is not None else 2**62
        self._use(pw)
        # (kernel, first row) when this kernel is rows of another's weight (:meth:`rows`).
        self.parent: tuple[X86WoqKernel, int] | None = None

    def _use(self, pw: PackedWeight) -> None:
        self.weight = pw
        self._args = (pw.packed, pw.scales, pw.zeros, pw.bits, pw.out_features)
        self._geometry = (pw.k_pad, pw.block, pw.group, pw.zero_const)

    def rows(self, start: int, stop: int) -> "X86WoqKernel | None":
        """The kernel of output rows ``start:stop``, sharing this one's weight (no copy); None
        where they do not fall on tiles (:meth:`PackedWeight.rows`)."""
        pw = self.weight.rows(start, stop)
        if pw is None:
            return None
        view = X86WoqKernel.__new__(X86WoqKernel)
        view._setup(self.ext, self.dtype, self.large_m, pw)
        view.parent = (self, start)
        return view

    @staticmethod
    def joined(kernels: list) -> "X86WoqKernel | None":
        """The kernel whose rows ``kernels`` are, in order and all of them; None if they are not."""
        parents = [k.parent if isinstance(k, X86WoqKernel) else None for k in kernels]
        if any(p is None for p in parents) or len({id(p[0]) for p in parents}) != 1:
            return None
        whole, start = parents[0][0], 0
        for kernel, (_, first) in zip(kernels, parents):
            if first != start:
                return None
            start += kernel.weight.out_features
        return whole if start == whole.weight.out_features else None

    @property
    def op_args(self) -> tuple:
        """The repacked weight as the C++ ops take it, after the activations: (packed, scales,
        zeros, bits, out_features, k_pad, block, group, zero_const)."""
        return self._args + self._geometry

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized ``[N, K]`` weight, computed by the C++ kernel."""
        pw = self.weight
        return self.ext.woq_dequantize(*self._args, pw.in_features, *self._geometry, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] >= self.large_m and not is_batch_invariant():
            y = F.linear(x2, self.dense_weight(x.dtype))
        else:
            y = self.ext.woq_linear(x2, *self._args, *self._geometry)
        return y.view(*lead, self.weight.out_features)
