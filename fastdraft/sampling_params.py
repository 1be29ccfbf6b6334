"""Sampling configuration of one request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

# torch.Generator.manual_seed takes 64-bit values; a CPU draft beside a CUDA target seeds its own
# generator with seed + 1, so the signed range keeps both in bounds.
_SEED_RANGE = (-2**63, 2**63 - 2)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


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
    # The serving engine's extras, as vLLM offers them (TextGenerator refuses them):
    presence_penalty: float = 0.0  # subtracted once from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive, multiplies negative logits of prompt and output tokens
    min_tokens: int = 0  # EOS cannot be sampled before this many tokens
    logprobs: int | None = None  # report the chosen token's log-probability and this many top ones
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    detokenize: bool = True  # False: tokens only, no text (as vLLM's option; no stop strings then)

    def uses_engine_extras(self) -> bool:
        """Whether any option only the serving engine honours is set."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0 or self.logprobs is not None or bool(self.logit_bias))

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**63 - 2], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be True or False, got {self.detokenize!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are found in the text: they need detokenize=True")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_new_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}")
        if not isinstance(self.logit_bias, dict) or not all(
                _is_int(t) and t >= 0 and _is_real(b) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
            raise ValueError("logit_bias must map token ids (integers >= 0) to numbers in [-100, 100]")
        # NumPy scalars pass the checks above; store plain Python numbers.
        self.max_new_tokens, self.top_k = int(self.max_new_tokens), int(self.top_k)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.seed = None if self.seed is None else int(self.seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
