"""One request at a time: a streaming text generator over the serving engine.

:class:`TextGenerator` is what the CLI runs: prompt in (text, chat messages or token ids), text
pieces out, with the user-visible metrics (TTFT, TPOT, tokens/s, and acceptance with
speculation). It runs every request through a serving engine
(:class:`~fastdraft.engine.llm_engine.LLMEngine`) of one sequence, speculative or not.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
from fastdraft.engine.metrics import GenerationMetrics
from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.models.files import LoadedModel
from fastdraft.sampling_params import SamplingParams
from fastdraft.speculative.speculative_config import SpeculativeConfig
from fastdraft.speculative.factory import speculator_factory
from fastdraft.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class GenerationStream:
    """One request's text pieces, as an iterator; ``token_ids``, ``text`` and ``metrics`` are
    complete once it is exhausted.

    The request is queued when the stream is made, and its output is kept until read, however
    many other streams are read meanwhile. ``close()``, garbage collection, or leaving an
    iteration early abort this request only."""

    def __init__(self, engine: LLMEngine, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._collector = engine.collector(request_id)
        self._deltas = engine.outputs(request_id)

    @property
    def prompt_ids(self) -> list[int]:
        return self._collector.prompt_token_ids

    @property
    def token_ids(self) -> list[int]:
        return self._collector.token_ids

    @property
    def text(self) -> str:
        return self._collector.text

    @property
    def metrics(self) -> GenerationMetrics:
        return self._collector.metrics

    @property
    def is_finished(self) -> bool:
        return self._collector.is_finished

    def __iter__(self) -> Iterator[str]:
        try:
            for delta in self._deltas:
                self._collector.add(delta)
                if delta.new_text:
                    yield delta.new_text
        finally:
            self.close()  # a no-op once finished

    def consume(self) -> "GenerationStream":
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Abort the request unless it has finished; what it produced stays readable."""
        self._deltas.close()
        self._engine.abort_request(self.request_id)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the engine may be gone already
            pass


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict[str, str]] | list[int], chat: bool = False,
                  chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a raw prompt, of chat messages rendered with the chat template (or of
    a text prompt as one user message, with ``chat``; ``chat_template_kwargs``: the template's
    own variables), or token ids as given."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)  # an empty list too: the engine's check refuses it
    if isinstance(prompt, list):
        return tokenizer.encode_chat(prompt, chat_template_kwargs)
    if not isinstance(prompt, str):
        raise ValueError(f"a prompt is text, chat messages or token ids, got {type(prompt).__name__}")
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}], chat_template_kwargs)
    return tokenizer.encode(prompt)


class TextGenerator:
    """Prompt in, streamed text out.

    Requests run through a serving engine of one sequence (``engine_config``, by default one
    sequence of up to ``max_seq_len`` tokens with prefix caching: a prompt that repeats an
    earlier one's blocks skips their prefill); a stream made while another is unread waits
    for it. With ``speculative`` (a :class:`SpeculativeConfig`) the engine drafts and verifies
    tokens (same outputs for greedy, same distribution for sampling) and ``metrics.spec``
    reports acceptance; ``draft``: an already loaded draft model for it.
    """

    def __init__(self, loaded: LoadedModel, max_seq_len: int = 4096,
                 speculative: SpeculativeConfig | None = None, draft: LoadedModel | None = None,
                 engine_config: EngineConfig | None = None) -> None:
        self.model = loaded.model
        if self.model.device.type == "cpu":
            # Build (first use, about a minute) or load the CPU kernels now, so that a one-time
            # compile is not counted in the first request's TTFT.
            load_cpu_kernels()
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.speculative = speculative
        config = engine_config or EngineConfig(max_num_seqs=1, max_model_len=max_seq_len)
        factory = None if speculative is None else speculator_factory(speculative, draft)
        self.engine = LLMEngine(loaded, config, speculation=factory)
        self.max_seq_len = self.engine.max_model_len

    def encode_prompt(self, prompt: str | list[dict[str, str]] | list[int], chat: bool = False) -> list[int]:
        """Token ids of ``prompt``, as :func:`encode_prompt` makes them with this model's tokenizer."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def stream(self, prompt: str | list[dict[str, str]] | list[int], params: SamplingParams | None = None,
               chat: bool = False) -> GenerationStream:
        """Queue a request; iterate the result for its text pieces. A refused request raises
        ``ValueError`` here."""
        request_id = self.engine.add_request(self.encode_prompt(prompt, chat), params or SamplingParams())
        return GenerationStream(self.engine, request_id)

    def generate(self, prompt: str | list[dict[str, str]] | list[int], params: SamplingParams | None = None,
                 chat: bool = False) -> GenerationStream:
        """Generate to completion; the returned stream holds ``text``, ``token_ids`` and ``metrics``."""
        return self.stream(prompt, params, chat).consume()
