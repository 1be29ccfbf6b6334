"""What one request measured: time to first token, the gaps between tokens, acceptance."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationMetrics:
    """Latency figures of one request. Times are in seconds."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    ttft_s: float = 0.0  # request start -> first token
    token_latencies_s: list[float] = field(default_factory=list)  # gaps between later tokens
    finish_reason: str = ""  # "stop" (EOS or stop string) or "length"
    spec: Any = None  # acceptance figures (spec.decoding.SpecMetrics) when decoding speculatively

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first: the median gap, or with speculation (where
        tokens arrive in bursts) the mean."""
        if not self.token_latencies_s:
            return 0.0
        if self.spec is not None:
            return sum(self.token_latencies_s) / len(self.token_latencies_s)
        return statistics.median(self.token_latencies_s)

    @property
    def decode_tokens_per_s(self) -> float:
        total = sum(self.token_latencies_s)
        return len(self.token_latencies_s) / total if total > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    def summary(self) -> str:
        text = (f"prompt {self.num_prompt_tokens} tok | generated {self.num_generated_tokens} tok | "
                f"TTFT {self.ttft_s * 1e3:.0f} ms | TPOT {self.tpot_s * 1e3:.1f} ms | "
                f"decode {self.decode_tokens_per_s:.2f} tok/s | finish: {self.finish_reason}")
        return text if self.spec is None else f"{text}\n{self.spec.summary()}"
