"""AWQ (Lin et al., 2023): activation-aware weight quantization.

Input channels that see large activations matter most. For each group of linears that share
an input, search a per-channel scale ``s = mean|x|^alpha / mean|w|^(1 - alpha)`` (normalized;
AutoAWQ's "duo" scaling, with ``mean|w|`` over the group-normalized weight magnitudes) that
minimizes the output error of ``Q(W * s) @ (x / s)``; fold ``1 / s`` into the op that produces
``x`` (an RMSNorm weight or the previous linear's rows) so the model computes the same
function. Optionally (``QuantConfig.awq_clip``) search a per-group clipping range of the scaled
weights. Finally RTN-quantize. ``alpha = 0`` with ``mean|w| = 1`` is plain RTN, so on the
calibration rows the result is never worse than RTN.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdraft.formats import dequantize, quantize, resolve_group_size

_NUM_GRID = 20


def even_rows(x: torch.Tensor, max_rows: int) -> torch.Tensor:
    """At most ``max_rows`` evenly spaced rows of ``x``: deterministic and representative."""
    if x.shape[0] <= max_rows:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, max_rows).long()]


def _fake_quant(w: torch.Tensor, group_size: int, sym: bool, float_zeros: bool = False) -> torch.Tensor:
    return dequantize(quantize(w, 4, group_size, sym, float_zeros))


@torch.no_grad()
def search_scales(x: torch.Tensor, weights: list[torch.Tensor], group_size: int, sym: bool,
                  float_zeros: bool = False) -> torch.Tensor:
    """Best per-input-channel scale [K] for linears ``weights`` ([N_i, K]) fed by ``x`` [rows, K]."""
    x = x.float()
    x_mean = x.abs().mean(dim=0)  # [K]
    w_cat = torch.cat([w.float() for w in weights], dim=0)  # [sum N_i, K]
    n, k = w_cat.shape
    g = resolve_group_size(group_size, k)
    w_groups = w_cat.abs().view(n, k // g, g)
    w_mean = (w_groups / w_groups.amax(dim=-1, keepdim=True).clamp(min=1e-8)).view(n, k).mean(dim=0)  # [K]
    reference = x @ w_cat.t()
    # alpha = 0 with no weight term: plain RTN, the baseline every candidate must beat.
    best_scales = torch.ones_like(x_mean)
    best_err = (x @ _fake_quant(w_cat, group_size, sym, float_zeros).t() - reference).pow(2).mean().item()
    for step in range(1, _NUM_GRID):
        alpha = step / _NUM_GRID
        scales = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        w_q = _fake_quant(w_cat * scales, group_size, sym, float_zeros) / scales
        err = (x @ w_q.t() - reference).pow(2).mean().item()
        if err < best_err:
            best_err, best_scales = err, scales
    return best_scales


@torch.no_grad()
def search_clip(x: torch.Tensor, weight: torch.Tensor, group_size: int, sym: bool, float_zeros: bool = False,
                max_shrink: float = 0.5, num_rows: int = 512) -> torch.Tensor:
    """Clip each weight group to the range that minimizes its output error; returns the clipped weight."""
    w = weight.float()
    n, k = w.shape
    g = resolve_group_size(group_size, k)
    x = even_rows(x.float(), num_rows)
    xg = x.view(x.shape[0], k // g, g)  # [rows, groups, G]
    wg = w.view(n, k // g, g)  # [N, groups, G]
    reference = torch.einsum("rgi,ngi->ngr", xg, wg)  # per-group partial outputs
    w_max, w_min = wg.amax(dim=-1, keepdim=True), wg.amin(dim=-1, keepdim=True)
    if sym:
        w_max = torch.maximum(w_max.abs(), w_min.abs())
        w_min = -w_max
    best = wg.clone()
    best_err = torch.full((n, k // g), float("inf"))
    for step in range(int(max_shrink * _NUM_GRID)):
        ratio = 1 - step / _NUM_GRID
        clipped = torch.maximum(torch.minimum(wg, w_max * ratio), w_min * ratio)
        q = _fake_quant(clipped.reshape(n, k), group_size, sym, float_zeros).view(n, k // g, g)
        err = (torch.einsum("rgi,ngi->ngr", xg, q) - reference).pow(2).mean(dim=-1)  # [N, groups]
        is_better = err < best_err
        best_err = torch.where(is_better, err, best_err)
        best = torch.where(is_better.unsqueeze(-1), clipped, best)
    return best.reshape(n, k).to(weight.dtype)


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: list[nn.Linear], scales: torch.Tensor) -> None:
    """Divide ``prev``'s output channels by ``scales`` and multiply the linears' inputs by it.

    The folded weights are new tensors, never written in place: a model built by
    ``build_model`` shares storage with the state dict it came from, and the auto flow builds
    every candidate from one state dict, so an in-place fold would rescale the candidates after it."""
    s = scales.to(torch.float32)

    def rebind(module: nn.Module, name: str, value: torch.Tensor) -> None:
        old = getattr(module, name)
        setattr(module, name, nn.Parameter(value.to(old.dtype), requires_grad=False))

    if isinstance(prev, nn.Linear):
        rebind(prev, "weight", prev.weight.float() / s.unsqueeze(1))
        if prev.bias is not None:
            rebind(prev, "bias", prev.bias.float() / s)
    else:  # RMSNorm: y = weight * normalized(x)
        rebind(prev, "weight", prev.weight.float() / s)
    for linear in linears:
        rebind(linear, "weight", linear.weight.float() * s.unsqueeze(0))
