"""Rotary position embeddings (NeoX / HF "rotate_half" layout)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


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


class RotaryEmbedding(nn.Module):
    """Looks up cos/sin for absolute positions from a table grown on demand.

    Holds no parameters or buffers: the table is derived state, built on the device of the
    positions it is asked for (so models built on the meta device need no fix-up).
    """

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.rope_scaling = rope_scaling
        self._cos: torch.Tensor | None = None  # [table_len, head_dim], model dtype
        self._sin: torch.Tensor | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        return inv_freq

    def _build(self, length: int, dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(length, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, self.inv_freq(device))  # [length, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [length, head_dim]
        self._cos, self._sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def tables(self, length: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos, sin tables ``[>= length, head_dim]`` (row i: position i): the same tensors
        from call to call until a longer table is needed."""
        if self._cos is None or self._cos.shape[0] < length or self._cos.dtype != dtype \
                or self._cos.device != device:
            # Grow geometrically so a long generation rebuilds the table only a few times.
            size = max(length, 2 * (self._cos.shape[0] if self._cos is not None else 2048))
            self._build(size, dtype, device)
        return self._cos, self._sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[*positions.shape, head_dim]``."""
        cos, sin = self.tables(int(positions.max()) + 1, dtype, positions.device)
        return cos[positions], sin[positions]
