"""Sampling configuration of one request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus sampling
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
