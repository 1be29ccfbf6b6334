"""One request at a time: a streaming text generator over the serving engine, and the plain
single-sequence token functions.

:class:`TextGenerator` is what the CLI and the HF-style API run: prompt in (text, chat
messages or token ids), text pieces out, with the user-visible metrics (TTFT, TPOT, tokens/s,
and acceptance with speculation). It runs every request through a serving engine
(:class:`~fastdraft.engine.llm_engine.LLMEngine`) of one sequence, speculative or not.

``prefill``, ``decode_one_token`` and ``generate_token_ids`` decode one sequence over a
contiguous cache, as gpt-fast does: plain functions over a model and a pre-allocated cache,
which the speed timing of the quantization search and the tests' references use.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fastdraft.kernels.build import load_x86_extension
from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
from fastdraft.engine.metrics import GenerationMetrics
from fastdraft.engine.speculation import Speculation
from fastdraft.layers.kv_cache import KVCache
from fastdraft.layers.sampler import make_generator, sample
from fastdraft.models.fused_decoder import FusedDecoder
from fastdraft.models.llama import LlamaForCausalLM
from fastdraft.models.loader import LoadedModel
from fastdraft.sampling_params import SamplingParams
from fastdraft.tokenizer import Tokenizer


@torch.inference_mode()
def prefill(model: LlamaForCausalLM, input_ids: torch.Tensor, kv_cache: KVCache, slot: int = 0) -> torch.Tensor:
    """Run the prompt ``input_ids`` [1, num_tokens] into an empty slot; return last logits [1, vocab]."""
    kv_cache.reset(slot)
    meta = kv_cache.append(input_ids.shape[1], slot)
    hidden = model(input_ids, kv_cache, meta)  # [1, num_tokens, hidden]
    return model.compute_logits(hidden[:, -1])


@torch.inference_mode()
def decode_one_token(model: LlamaForCausalLM, token_id: torch.Tensor, kv_cache: KVCache, slot: int = 0,
                     decoder: FusedDecoder | None = None) -> torch.Tensor:
    """Append one token ``token_id`` [1, 1] to the slot; return its next-token logits [1, vocab]
    (through ``decoder``, the model's fused C++ decoder, when given)."""
    meta = kv_cache.append(1, slot)
    return model.decode_logits(token_id, kv_cache, meta, decoder=decoder)  # [1, vocab]


def check_request(num_prompt_tokens: int, params: SamplingParams, max_seq_len: int) -> None:
    """Reject a request that cannot run, before any work starts."""
    if num_prompt_tokens == 0:
        raise ValueError("the prompt is empty")
    if params.uses_engine_extras():
        raise ValueError("penalties, logit_bias, min_tokens and logprobs are served by the serving engine, not by "
                         "generate_token_ids")
    if num_prompt_tokens + params.max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
            f"maximum sequence length {max_seq_len}"
        )


def generate_token_ids(model: LlamaForCausalLM, prompt_ids: list[int], params: SamplingParams,
                       kv_cache: KVCache, eos_token_ids: list[int], slot: int = 0) -> Iterator[int]:
    """Yield new token ids one by one until EOS or ``max_new_tokens`` (the EOS id is yielded)."""
    check_request(len(prompt_ids), params, kv_cache.max_seq_len)
    generator = make_generator(params.seed, model.device)
    eos = set() if params.ignore_eos else set(eos_token_ids)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    logits = prefill(model, input_ids, kv_cache, slot)
    decoder = model.fused_decoder()
    for step in range(params.max_new_tokens):
        next_id = sample(logits, params, generator)  # [1]
        token = int(next_id)
        yield token
        if token in eos or step == params.max_new_tokens - 1:
            return
        logits = decode_one_token(model, next_id.view(1, 1), kv_cache, slot, decoder)


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
            load_x86_extension()
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
