"""The OpenAI API's request bodies, checked, and how they become ``SamplingParams``.

Parameters fall in three groups:

* supported: they change the output as OpenAI (or vLLM, for its extras) documents;
* accepted and ignored, because they cannot change the output (``IGNORED``: ``user``,
  ``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls``, ``stream_options`` without
  ``stream``);
* refused with a 400 that names them, because honouring them would change the output and
  fastdraft does not (``REFUSED``): tools and functions, ``suffix``, ``best_of`` above ``n``,
  audio, predicted outputs.

Structured output comes from one of ``response_format`` (OpenAI's ``json_object`` and
``json_schema``), ``structured_outputs`` (vLLM's object: ``json``, ``regex``, ``choice``,
``grammar``, ``json_object``) or vLLM's older ``guided_json``, ``guided_regex``,
``guided_choice`` and ``guided_grammar``; an invalid schema, regex or grammar is a 400 that
names the problem. A field the API does not have at
  all is refused too, so a typo never passes silently.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from fastdraft.engine.structured import check_constraint
from fastdraft.sampling_params import Constraint, SamplingParams

MAX_N = 16
MAX_LOGPROBS = 20

IGNORED = frozenset({"user", "metadata", "store", "service_tier"})
REFUSED = frozenset({"functions", "function_call", "suffix", "audio", "modalities",
                     "prediction", "reasoning_effort", "web_search_options"})

_ROLES = ("system", "user", "assistant", "developer", "tool")


class RequestError(ValueError):
    """A request the server refuses: ``param`` names the field, ``status`` the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Request(BaseModel):
    """Fields common to both endpoints. Unknown fields are collected and checked by ``check``."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int = Field(default=0, ge=-1)
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted and ignored
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values lie in [-100, 100], got {bias}")
        return value

    _constraint: Constraint | None = PrivateAttr(default=None)

    def check_extra(self) -> None:
        for name in (self.model_extra or {}):
            if name in REFUSED:
                raise RequestError(f"'{name}' is not supported by this server", param=name)
            raise RequestError(f"unknown parameter '{name}'", param=name)
        self._constraint = self._checked_constraint()

    def _checked_constraint(self) -> Constraint | None:
        """The output's constraint, from whichever field gives one; checked (a bad schema,
        regex or grammar is a ``RequestError`` naming it)."""
        sources: list[tuple[str, dict[str, Any]]] = []
        form = self.response_format
        if form is not None and form.type == "json_object":
            sources.append(("response_format", {"json_object": True}))
        elif form is not None and form.type == "json_schema":
            schema = (form.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise RequestError("response_format json_schema needs its schema: {\"json_schema\": {\"name\": ..., "
                                   "\"schema\": {...}}}", param="response_format")
            sources.append(("response_format", {"json": schema}))
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_dump(exclude_none=True)
            sources.append(("structured_outputs", {"json" if k == "json_schema" else k: v for k, v in given.items()}))
        for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                sources.append((field, {key: getattr(self, field)}))
        if not sources:
            return None
        if len(sources) > 1:
            raise RequestError(f"give one output constraint, not {', '.join(name for name, _ in sources)}",
                               param=sources[1][0])
        param, kwargs = sources[0]
        try:
            constraint = Constraint.of(**kwargs)
            check_constraint(constraint)
        except ValueError as e:
            raise RequestError(str(e), param=param) from None
        return constraint

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
        """The engine's parameters for choice ``index`` of ``n`` (a seeded request's choices
        take consecutive seeds, so they differ but stay reproducible)."""
        bias = {int(token): value for token, value in (self.logit_bias or {}).items()}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                max_new_tokens=max_tokens, temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p,
                seed=None if self.seed is None else (self.seed + index) % (2**63 - 1), stop=stop,
                ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                min_tokens=min(self.min_tokens, max_tokens), logprobs=logprobs, logit_bias=bias,
                structured_outputs=self._constraint)
        except ValueError as e:
            raise RequestError(str(e)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list) -> str | list:
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("prompt must not be empty")
        return value

    def check_extra(self) -> None:
        super().check_extra()
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of other than n is not supported", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return [p if isinstance(p, str) else list(p) for p in self.prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError("only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # The chat template's own variables (Qwen3's enable_thinking), as vLLM takes them.
    chat_template_kwargs: dict[str, Any] | None = None
    # Function tools (engine/tool_calls.py checks them against the model's call format).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must not be empty")
        for message in value:
            if message.role not in _ROLES:
                raise ValueError(f"unknown role {message.role!r}; roles are {', '.join(_ROLES)}")
        return value

    def check_extra(self) -> None:
        super().check_extra()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")



def error_body(message: str, kind: str, param: str | None = None, code: str | int | None = None) -> dict:
    """The OpenAI API's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
