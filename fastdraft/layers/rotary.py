"""Rotary position embeddings (NeoX / HF "rotate_half" layout), with the rotary scalings of HF
``rope_scaling``: ``linear``, ``dynamic`` (NTK), ``yarn`` and ``llama3``, one implementation each
(as ``transformers.modeling_rope_utils`` computes them), for every plan and executor: they all
read the tables of :class:`RotaryEmbedding`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fastdraft.model_config import ROPE_TYPES


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The kind of an HF ``rope_scaling`` dict (``rope_type``, or the older ``type``)."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type")) or "default"


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency smoothing: long wavelengths are stretched by ``factor``."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies interpolated by ``factor`` below the rotation counts ``beta_slow`` ..
    ``beta_fast`` over the original context, kept above, ramped between; and the attention
    factor that scales cos and sin."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation = 1 - ramp  # [dim // 2]: 1 where a frequency is kept
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def scaled_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device,
                    seq_len: int = 0) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim // 2] and the factor cos and sin are scaled by, for
    ``scaling``'s kind; ``dynamic`` NTK grows the base once ``seq_len`` (the longest position
    + 1) passes ``max_position_embeddings``, as HF does for each forward pass."""
    scaling = scaling or {}
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, device)
    base = theta
    if kind == "dynamic":
        factor, max_len = scaling["factor"], scaling["max_position_embeddings"]
        seq_len = max(seq_len, max_len)
        base = theta * ((factor * seq_len / max_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Looks up cos/sin for absolute positions from a table grown on demand.

    Holds no parameters or buffers: the table is derived state, built on the device of the
    positions it is asked for (so models built on the meta device need no fix-up). With
    ``dynamic`` scaling past ``max_position_embeddings`` the frequencies depend on the
    longest position asked for, so the table is built again for each longer length.
    """

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.rope_scaling = rope_scaling
        self.is_dynamic = rope_type(rope_scaling) == "dynamic"
        scaled_inv_freq(head_dim, theta, rope_scaling, torch.device("cpu"))  # ValueError for a bad scaling
        self._cos: torch.Tensor | None = None  # [table_len, head_dim], model dtype
        self._sin: torch.Tensor | None = None
        self._seq_len = 0  # the length the dynamic frequencies were computed for

    def inv_freq(self, device: torch.device, seq_len: int = 0) -> torch.Tensor:
        return scaled_inv_freq(self.head_dim, self.theta, self.rope_scaling, device, seq_len)[0]

    def _build(self, length: int, seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq, attention_factor = scaled_inv_freq(self.head_dim, self.theta, self.rope_scaling, device, seq_len)
        positions = torch.arange(length, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [length, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [length, head_dim]
        self._cos = (emb.cos() * attention_factor).to(dtype)
        self._sin = (emb.sin() * attention_factor).to(dtype)
        self._seq_len = seq_len

    def tables(self, length: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos, sin tables ``[>= length, head_dim]`` (row i: position i): the same tensors
        from call to call until a longer table is needed."""
        if self.is_dynamic:
            seq_len = max(length, self.rope_scaling["max_position_embeddings"])
            if self._cos is None or self._seq_len != seq_len or self._cos.dtype != dtype or self._cos.device != device:
                self._build(max(length, 1), seq_len, dtype, device)
            return self._cos, self._sin
        if self._cos is None or self._cos.shape[0] < length or self._cos.dtype != dtype \
                or self._cos.device != device:
            # Grow geometrically so a long generation rebuilds the table only a few times.
            size = max(length, 2 * (self._cos.shape[0] if self._cos is not None else 2048))
            self._build(size, 0, dtype, device)
        return self._cos, self._sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[*positions.shape, head_dim]``."""
        cos, sin = self.tables(int(positions.max()) + 1, dtype, positions.device)
        return cos[positions], sin[positions]
