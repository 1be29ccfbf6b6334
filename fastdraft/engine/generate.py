"""One request at a time: a streaming text generator over the serving engine.

:class:`TextGenerator` is what the CLI and the HF-style API run: prompt in (text, chat
messages or token ids), text pieces out, with the user-visible metrics (TTFT, TPOT, tokens/s,
and acceptance with speculation). It runs every request through a serving engine
(:class:`~fastdraft.engine.llm_engine.LLMEngine`) of one sequence, speculative or not.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
from fastdraft.engine.metrics import GenerationMetrics
from fastdraft.engine.speculation import Speculation
from fastdraft.models.loader import LoadedModel
from fastdraft.sampling_params import SamplingParams
from fastdraft.tokenizer import Tokenizer


class GenerationStream:
    """Iterator of text pieces; ``token_ids``, ``text`` and ``metrics`` are complete once exhausted."""

    def __init__(self) -> None:
        self._pieces: Iterator[str] = iter(())
        self.metrics = GenerationMetrics()
        self.prompt_ids: list[int] = []
        self.token_ids: list[int] = []
        self.text = ""

    def __iter__(self) -> Iterator[str]:
        for piece in self._pieces:
            self.text += piece
            yield piece

    def consume(self) -> "GenerationStream":
        for _ in self:
            pass
        return self


class TextGenerator:
    """Prompt in, streamed text out, one request at a time.

    Requests run through a serving engine of one sequence (``engine_config``, by default one
    sequence of up to ``max_seq_len`` tokens with prefix caching: a prompt that repeats an
    earlier one's blocks skips their prefill). With ``speculative`` (a
    :class:`~fastdraft.spec.config.SpeculativeConfig`) the engine drafts and verifies tokens
    (same outputs for greedy, same distribution for sampling) and ``metrics.spec`` reports
    acceptance; ``draft``: an already loaded draft model for it.
    """

    def __init__(self, loaded: LoadedModel, max_seq_len: int = 4096,
                 speculative: Speculation | None = None, draft: LoadedModel | None = None,
                 engine_config: EngineConfig | None = None) -> None:
        self.model = loaded.model
        if self.model.device.type == "cpu":
            # Build (first use, about a minute) or load the CPU kernels now, so that a one-time
            # compile is not counted in the first request's TTFT.
            load_cpu_kernels()
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.config.eos_token_ids
        self.speculative = speculative
        config = engine_config or EngineConfig(max_num_seqs=1, max_model_len=max_seq_len)
        self.engine = LLMEngine(loaded, config, speculation=speculative, draft=draft)
        self.max_seq_len = self.engine.max_model_len

    def encode_prompt(self, prompt: str | list[dict[str, str]], chat: bool = False) -> list[int]:
        """Token ids of a raw prompt, or of chat messages rendered with the chat template."""
        if isinstance(prompt, list):
            text = self.tokenizer.apply_chat_template(prompt)
        elif chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        else:
            text = prompt
        return self.tokenizer.encode(text, add_special_tokens=not (chat or isinstance(prompt, list)))

    def stream(self, prompt: str | list[dict[str, str]] | list[int], params: SamplingParams | None = None,
               chat: bool = False) -> GenerationStream:
        """Start generating; iterate the result for text pieces. Validation errors raise here.

        ``prompt`` is text, chat messages, or token ids. A stream left unfinished is aborted
        when the next request starts."""
        params = params or SamplingParams()
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty (no token ids or chat messages)")
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        if is_ids:
            prompt_ids = list(prompt)
        elif isinstance(prompt, (str, list)):
            prompt_ids = self.encode_prompt(prompt, chat)
        else:
            raise ValueError(f"a prompt is text, chat messages or token ids, got {type(prompt).__name__}")
        stream = GenerationStream()
        stream.prompt_ids = prompt_ids
        stream.metrics.num_prompt_tokens = len(prompt_ids)
        request_id = self.engine.add_request(prompt_ids, params)  # checked first: a refused one aborts nothing
        self.engine.abort_all(except_request_id=request_id)  # one at a time: an abandoned stream gives way
        stream._pieces = self._pieces(request_id, stream)
        return stream

    def generate(self, prompt: str | list[dict[str, str]], params: SamplingParams | None = None,
                 chat: bool = False) -> GenerationStream:
        """Generate to completion; the returned stream holds ``text``, ``token_ids`` and ``metrics``."""
        return self.stream(prompt, params, chat).consume()

    def _pieces(self, request_id: str, stream: GenerationStream) -> Iterator[str]:
        for out in self.engine.outputs(request_id):
            stream.token_ids = out.token_ids
            stream.metrics = out.metrics
            if out.new_text:
                yield out.new_text
