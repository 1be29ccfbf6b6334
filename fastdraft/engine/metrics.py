"""What one request measured: time to first token, the gaps between tokens, acceptance."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class GenerationMetrics:
    """Latency figures of one request. Times are in seconds."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    ttft_s: float = 0.0  # request start -> first token
    token_latencies_s: list[float] = field(default_factory=list)  # gaps between later tokens
    finish_reason: str = ""  # "stop" (EOS or stop string) or "length"
    spec: "SpecMetrics | None" = None  # acceptance figures when decoding speculatively

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


@dataclass
class SpecMetrics:
    """Acceptance statistics of speculative decoding."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k_max] times position i was accepted
    proposed_per_position: list[int] = field(default_factory=list)
    steps_per_draft_length: list[int] = field(default_factory=list)  # [k_max + 1] steps that chose k

    @property
    def num_steps(self) -> int:
        """Steps with drafts (verification passes)."""
        return sum(self.steps_per_draft_length[1:])

    @property
    def num_plain_steps(self) -> int:
        """Steps decoded without speculation (k = 0)."""
        return self.steps_per_draft_length[0] if self.steps_per_draft_length else 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification pass (accepted + the recovered/bonus one)."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    def record(self, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        """One step of a request: ``num_draft`` tokens drafted (0: a plain step), of which
        ``num_accepted`` were accepted, and ``num_emitted`` tokens kept."""
        while len(self.steps_per_draft_length) <= num_draft:
            self.steps_per_draft_length.append(0)
        self.steps_per_draft_length[num_draft] += 1
        if not num_draft:
            return
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        self._cover_positions(num_draft)
        for i in range(num_draft):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    def _cover_positions(self, num_positions: int) -> None:
        """Grow the per-position counts to at least ``num_positions`` draft positions."""
        while len(self.proposed_per_position) < num_positions:
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)

    def merge(self, other: "SpecMetrics") -> None:
        """Add ``other``'s counts to these (e.g. totals over several requests)."""
        for name in ("num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        while len(self.steps_per_draft_length) < len(other.steps_per_draft_length):
            self.steps_per_draft_length.append(0)
        for k, count in enumerate(other.steps_per_draft_length):
            self.steps_per_draft_length[k] += count
        self._cover_positions(len(other.proposed_per_position))
        for i, (accepted, proposed) in enumerate(zip(other.accepted_per_position, other.proposed_per_position)):
            self.proposed_per_position[i] += proposed
            self.accepted_per_position[i] += accepted

    def summary(self) -> str:
        per_pos = " ".join(f"{a:.2f}" for a in self.per_position_acceptance)
        return (f"acceptance {self.acceptance_rate * 100:.1f}% | mean accepted length "
                f"{self.mean_accepted_length:.2f} tok/step | per position [{per_pos}] | "
                f"{self.num_plain_steps} plain steps")
