"""GPTQ (Frantar et al., 2022): quantize columns one at a time and push each column's
rounding error onto the not-yet-quantized columns, weighted by the inverse Hessian of the
layer's calibration inputs. Blocks of columns are updated lazily for speed.

The output is the canonical INT4 format: groups are contiguous in the original column
order. With ``act_order`` the columns are visited by decreasing Hessian diagonal, and the
group scales are fixed up front from the original weights ("static groups") so the result
needs no permutation index.
"""

from __future__ import annotations

import torch

from fastdraft.formats import (
    SCALE_DTYPE,
    QuantizedWeight,
    group_params,
    quantize_group_values,
    pack_int4,
    resolve_group_size,
)


class HessianAccumulator:
    """Running ``H = 2 / n * sum(x x^T)`` over calibration inputs of one linear layer."""

    def __init__(self, in_features: int) -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.num_rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [rows, K]
        rows = x.shape[0]
        self.hessian *= self.num_rows / (self.num_rows + rows)
        self.num_rows += rows
        x = x * (2.0 / self.num_rows) ** 0.5
        self.hessian.addmm_(x.t(), x)


def _group_params(w: torch.Tensor, sym: bool, float_zeros: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16-rounded scale and zero of ``w`` [N, G] -> ([N], [N]) as used by the canonical dequant."""
    scale, zero = group_params(w.unsqueeze(1), sym, float_zeros)
    return scale.squeeze(1).to(SCALE_DTYPE).float(), zero.squeeze(1)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int = 128, sym: bool = True,
                  act_order: bool = False, damp_percent: float = 0.01, float_zeros: bool = False,
                  block_size: int = 128) -> QuantizedWeight:
    """GPTQ-quantize ``weight`` [N, K] to INT4 given the input Hessian [K, K]; ``float_zeros``
    stores fractional float16 zero points (asymmetric only, see formats.py)."""
    if float_zeros and sym:
        raise ValueError("float zero points apply to asymmetric INT4 only")
    W = weight.detach().float().clone()  # [N, K]
    n, k = W.shape
    g = resolve_group_size(group_size, k)
    num_groups = k // g
    H = hessian.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    scales = torch.empty(n, num_groups)
    zeros = torch.empty(n, num_groups)
    if act_order:
        # Static groups: parameters from the original weights, in original column order.
        for gi in range(num_groups):
            scales[:, gi], zeros[:, gi] = _group_params(W[:, gi * g:(gi + 1) * g], sym, float_zeros)
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    else:
        perm = torch.arange(k)

    H += damp_percent * torch.mean(torch.diag(H)) * torch.eye(k)
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)  # [K, K] upper

    Q = torch.zeros(n, k)  # integer codes, permuted column order
    block_size = min(block_size, k)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            gi = col // g
            if not act_order and col % g == 0:
                # Group start: parameters from the error-updated weights of this group. Groups
                # never straddle a block boundary unless g > block_size, in which case they
                # start on one, where W[:, i1:] is already fully updated.
                group_w = W1[:, i:i + g] if i + g <= i2 - i1 else W[:, i1 + i:i1 + i + g]
                scales[:, gi], zeros[:, gi] = _group_params(group_w, sym, float_zeros)
            w = W1[:, i]
            scale, zero = scales[:, gi], zeros[:, gi]
            q = quantize_group_values(w.unsqueeze(-1), scale, zero, float_zeros).squeeze(-1)
            Q[:, i1 + i] = q
            err = (w - (q - zero) * scale) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    if act_order:
        Q = Q[:, torch.argsort(perm)]
    zeros_out = None if sym else zeros.to(SCALE_DTYPE if float_zeros else torch.uint8)
    return QuantizedWeight(pack_int4(Q.to(torch.uint8)), scales.to(SCALE_DTYPE), zeros_out, 4, g, k)
