"""What the engine hands out: one :class:`RequestDelta` per request and step, holding only
what is new; a :class:`RequestCollector` on the consumer's side folds a request's deltas into
its :class:`RequestOutput`.

A delta's size does not grow with the request: a step costs the same to hand over (or to
pickle, from an engine process) at the first token and at the thousandth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastdraft.engine.metrics import GenerationMetrics, SpecMetrics

# Per generated token: (its log-probability, the top ones as [(token id, log-probability)]),
# from the model's distribution before any sampling option.
Logprob = tuple[float, list[tuple[int, float]]]


@dataclass
class RequestDelta:
    """What one request produced in one step.

    ``ttft_s`` is set on the request's first delta (seconds from its arrival); every other new
    token gets ``token_gap_s``, its share of the time since the request's previous delta
    (tokens verified together arrive together). With speculation on, ``num_draft_tokens`` is
    how many tokens the request drafted this step (0: it decoded plainly) and
    ``num_accepted_tokens`` how many of them verification kept; None: it could not speculate.
    ``num_cached_tokens``, on the first delta: the prompt tokens found in the prefix cache."""

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    new_logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # "stop" or "length" on the last delta
    ttft_s: float | None = None
    token_gap_s: float = 0.0
    num_draft_tokens: int | None = None
    num_accepted_tokens: int = 0
    num_cached_tokens: int | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One generated continuation of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Logprob] | None = None
    # With tools (LLM.chat): the calls parsed out of ``text``, each {"id", "type", "function":
    # {"name", "arguments"}} as OpenAI's message.tool_calls; None without tools.
    tool_calls: list[dict[str, Any]] | None = None


@dataclass
class RequestOutput:
    """A request's result so far: its prompt and its completion (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: GenerationMetrics = field(default_factory=GenerationMetrics, repr=False)


class RequestCollector:
    """Folds one request's deltas, in order, into its text, tokens, log-probabilities and
    metrics; :meth:`output` is the :class:`RequestOutput` they add up to."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], prompt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[Logprob] | None = None
        self.finish_reason: str | None = None
        self.metrics = GenerationMetrics(num_prompt_tokens=len(prompt_token_ids))

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestDelta) -> None:
        num_new = len(delta.new_token_ids)
        self.text += delta.new_text
        self.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.new_logprobs)
        metrics = self.metrics
        if delta.num_cached_tokens is not None:
            metrics.num_cached_tokens = delta.num_cached_tokens
        if delta.ttft_s is not None:
            metrics.ttft_s = delta.ttft_s
            metrics.token_latencies_s.extend([delta.token_gap_s] * (num_new - 1))
        else:
            metrics.token_latencies_s.extend([delta.token_gap_s] * num_new)
        metrics.num_generated_tokens += num_new
        if delta.num_draft_tokens is not None:
            if metrics.spec is None:
                metrics.spec = SpecMetrics()
            metrics.spec.record(delta.num_draft_tokens, delta.num_accepted_tokens, num_new)
        if delta.finish_reason is not None:
            self.finish_reason = metrics.finish_reason = delta.finish_reason

    def output(self) -> RequestOutput:
        completion = CompletionOutput(0, self.text, list(self.token_ids), self.finish_reason,
                                      None if self.logprobs is None else list(self.logprobs))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion], self.is_finished,
                             self.metrics)
