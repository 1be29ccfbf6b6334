"""Sampling configuration of one request."""

from __future__ import annotations

import functools
import json as _json  # the constraint's argument is named json, as vLLM names it
import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

# torch.Generator.manual_seed takes 64-bit values; a CPU draft beside a CUDA target seeds its own
# generator with seed + 1, so the signed range keeps both in bounds.
_SEED_RANGE = (-2**63, 2**63 - 2)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


# Output tokens when a request gives no limit.
DEFAULT_MAX_TOKENS = 256

_CONSTRAINT_KINDS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
                     "grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """What a request's output must follow: ``kind`` is ``json`` (``value``: a JSON schema),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (``value``: a JSON list of the
    strings) or ``grammar`` (GBNF, llama.cpp's syntax with ``root`` the start rule, or Lark as
    llguidance reads it, with ``start``).
    Hashable by content, so that each distinct constraint compiles once. Build one with
    :meth:`of`."""

    kind: str
    value: str = ""

    @classmethod
    def of(cls, json: Any = None, json_object: bool = False, regex: str | None = None,
           choice: list[str] | None = None, grammar: str | None = None) -> Constraint:
        """The constraint of exactly one of the arguments (vLLM's ``StructuredOutputsParams``
        fields); ``ValueError`` unless exactly one is given, or for a value of the wrong type."""
        given = [name for name, value in (("json", json), ("json_object", json_object or None), ("regex", regex),
                                          ("choice", choice), ("grammar", grammar)) if value is not None]
        if len(given) != 1:
            raise ValueError(f"a constraint is exactly one of json, json_object, regex, choice and grammar; got "
                             f"{given or 'none'}")
        if json is not None:
            if isinstance(json, str):
                try:
                    json = _json.loads(json)
                except ValueError as e:
                    raise ValueError(f"invalid JSON schema: {e}") from None
            if not isinstance(json, dict):
                raise ValueError("a JSON schema is an object")
            return cls("json", _json.dumps(json))  # property order as given: the output follows it
        if json_object:
            return cls("json_object")
        if regex is not None:
            if not isinstance(regex, str) or not regex:
                raise ValueError("a regex is a non-empty string")
            return cls("regex", regex)
        if choice is not None:
            if not isinstance(choice, list) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError("a choice is a non-empty list of non-empty strings")
            return cls("choice", _json.dumps(choice))
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError("a grammar is a non-empty string")
        return cls("grammar", grammar)

    @property
    def description(self) -> str:
        return _CONSTRAINT_KINDS[self.kind]


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy decoding.

    ``max_tokens`` (vLLM's name) and ``max_new_tokens`` (HF's) are one limit: give either (both
    only if equal); 256 when neither is given. ``structured_outputs``: a :class:`Constraint`
    the output must follow."""

    max_new_tokens: int | None = None
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
    structured_outputs: Constraint | None = None

    def uses_engine_extras(self) -> bool:
        """Whether any option only the serving engine honours is set."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0 or self.logprobs is not None or bool(self.logit_bias)
                or self.structured_outputs is not None)

    def __post_init__(self) -> None:
        if self.max_new_tokens is None:
            self.max_new_tokens = DEFAULT_MAX_TOKENS
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, Constraint):
            raise ValueError("structured_outputs must be a Constraint (Constraint.of(json=..., regex=..., ...))")
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


# vLLM's name for the limit: an argument of the constructor and a read-only alias, not a field of
# its own, so that dataclasses.replace(params, max_new_tokens=...) changes the one limit.
_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init(self: SamplingParams, *args: Any, max_tokens: int | None = None, **kwargs: Any) -> None:
    if max_tokens is not None:
        given = kwargs.get("max_new_tokens", args[0] if args else None)
        if given is not None and given != max_tokens:
            raise ValueError(f"max_tokens ({max_tokens!r}) and max_new_tokens ({given!r}) name one limit: "
                             "give one of them")
        if args:
            args = (max_tokens, *args[1:])
        else:
            kwargs["max_new_tokens"] = max_tokens
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init  # type: ignore[method-assign]
SamplingParams.max_tokens = property(lambda self: self.max_new_tokens,  # type: ignore[attr-defined]
                                     doc="The output token limit, by vLLM's name (max_new_tokens).")
