"""Two familiar front doors.

* vLLM style: ``LLM(model=..., speculative_model=... | "self", num_speculative_tokens=...)``
  and ``llm.generate(prompts, SamplingParams(...))`` returning ``RequestOutput`` objects,
  batched through the serving engine.
* HF style: ``AutoModelForCausalLM.from_pretrained(path, load_in_low_bit=..., speculative=True)``
  and ``model.generate(input_ids, max_new_tokens=..., do_sample=...)`` returning token ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tqdm.auto import tqdm

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.engine.loader import load_model
from fastdraft.engine.output import RequestOutput
from fastdraft.engine.tool_calls import check_tools, message_calls, prompt_tools, template_messages
from fastdraft.engine.tool_parsers import tool_parser_for
from fastdraft.models.files import LoadedModel
from fastdraft.sampling_params import SamplingParams
from fastdraft.speculative.speculative_config import SpeculativeConfig
from fastdraft.speculative.factory import speculator_factory


def _is_prompt(prompt: object) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))


class LLM:
    """vLLM-style offline inference.

    Requests run through the serving engine (``engine/llm_engine.py``): ``generate`` queues
    every prompt and steps until all are done, batching them over the paged KV cache. With
    ``speculative_model`` (a model of the same tokenizer, ``"self"`` or ``"ngram"``) decoding
    requests draft and verify tokens inside those batched steps; ``speculative_config`` (a
    ``SpeculativeConfig`` or the dict of its fields) sets every speculation option instead.

    ``model`` is a name or path to load, or an already loaded model (a ``LoadedModel``: then
    ``dtype``, ``device`` and ``load_in_low_bit`` are its own)."""

    def __init__(self, model: str | LoadedModel, dtype: str = "bf16", device: str = "cpu", load_in_low_bit: str | None = None,
                 speculative_model: str | None = None, num_speculative_tokens: int = 4,
                 draft_device: str | None = None, max_model_len: int = 4096, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, kv_cache_memory: float | None = None, block_size: int = 16,
                 enable_prefix_caching: bool = True, batch_invariant: bool = True, enforce_eager: bool = False,
                 speculative_config: SpeculativeConfig | dict | None = None) -> None:
        if speculative_config is not None and speculative_model is not None:
            raise ValueError("give speculative_model or speculative_config, not both")
        if isinstance(speculative_config, dict):
            try:
                speculative_config = SpeculativeConfig(**speculative_config)
            except TypeError as e:
                raise ValueError(f"speculative_config: {e}") from None
        elif speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, "
                             f"got {type(speculative_config).__name__}")
        if isinstance(model, LoadedModel):
            if load_in_low_bit is not None:
                raise ValueError("an already loaded model cannot be quantized on load: quantize it first")
            loaded = model
        else:
            loaded = load_model(model, dtype=dtype, device=device, load_in_low_bit=load_in_low_bit)
        self.tokenizer = loaded.tokenizer
        spec = speculative_config
        if speculative_model is not None:
            spec = SpeculativeConfig(draft=speculative_model, num_speculative_tokens=num_speculative_tokens,
                                     draft_device=draft_device)
        self.engine = LLMEngine(loaded, EngineConfig(
            block_size=block_size, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, batch_invariant=batch_invariant,
            enforce_eager=enforce_eager),
            speculation=None if spec is None else speculator_factory(spec))

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids); ``sampling_params`` is one for all, or
        one per prompt."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not all(_is_prompt(p) for p in prompts):
            raise ValueError("prompts must be a string, a list of strings, or a list of token-id lists")
        params = sampling_params or SamplingParams()
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts) or not all(isinstance(p, SamplingParams) for p in per_prompt):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        with tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm) as progress:
            return run_to_completion(self.engine, list(prompts), per_prompt, progress)

    def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
             tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool = True) -> RequestOutput:
        """Complete a conversation ([{"role": ..., "content": ...}]) rendered with the chat
        template; ``chat_template_kwargs``: the template's own variables (``enable_thinking``).
        ``tools`` (OpenAI's function tools) and ``tool_choice`` as the server takes them: the
        output's ``tool_calls`` are then the calls parsed from its text (``text`` keeps the
        rest), constrained to parse and validate under ``required`` or a named function.
        ``ValueError`` for bad tools."""
        params = sampling_params or SamplingParams()
        use = check_tools(tools, tool_choice, parallel_tool_calls, tool_parser_for(self.tokenizer.chat_template))
        constraint = use.constraint(self.tokenizer) if use is not None else None
        if constraint is not None:
            if params.structured_outputs is not None:
                raise ValueError("a required tool call cannot also follow structured_outputs")
            params = dataclasses.replace(params, structured_outputs=constraint)
        prompt = self.tokenizer.encode_chat(template_messages(messages), chat_template_kwargs,
                                            prompt_tools(tools, tool_choice))
        output = run_to_completion(self.engine, [prompt], [params])[0]
        if use is not None:
            for completion in output.outputs:
                parsed = use.parse(completion.text)
                completion.text, completion.tool_calls = parsed.content or "", message_calls(parsed)
                if completion.tool_calls and completion.finish_reason == "stop":
                    completion.finish_reason = "tool_calls"
        return output


class PretrainedCausalLM:
    """What :meth:`AutoModelForCausalLM.from_pretrained` returns: HF-style ``generate``."""

    def __init__(self, loaded: LoadedModel, speculative: SpeculativeConfig | None,
                 assistant: LoadedModel | None, max_seq_len: int) -> None:
        self.loaded = loaded
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self._max_seq_len = max_seq_len
        self._speculative = speculative
        self._engines: dict[int, LLMEngine] = {}  # by draft (0: none); every row of a batch at once
        self._default_assistant = assistant

    @property
    def model(self):
        return self.loaded.model

    def _engine(self, assistant: "PretrainedCausalLM | None") -> LLMEngine:
        """The engine for ``assistant`` as draft (or the default draft, or none)."""
        draft = assistant.loaded if assistant is not None else self._default_assistant
        key = 0 if draft is None and self._speculative is None else id(draft)
        if key not in self._engines:
            spec = self._speculative
            if draft is not None:
                spec = SpeculativeConfig(draft="assistant", num_speculative_tokens=(
                    spec.num_speculative_tokens if spec else 4))
            self._engines[key] = LLMEngine(self.loaded, EngineConfig(max_model_len=self._max_seq_len),
                                           speculation=None if spec is None else speculator_factory(spec, draft))
        return self._engines[key]

    def generate(self, input_ids: torch.Tensor | list[int], max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 assistant_model: "PretrainedCausalLM | None" = None, ignore_eos: bool = False) -> torch.Tensor:
        """Continue each row of ``input_ids`` [batch, seq]; returns prompt + new ids, rows
        right-padded with the first EOS id when they end at different lengths."""
        ids = torch.as_tensor(input_ids)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError("input_ids must be [batch, seq_len] with seq_len > 0")
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature if do_sample else 0.0,
                                top_k=top_k, top_p=top_p, seed=seed, ignore_eos=ignore_eos)
        prompts = [row.tolist() for row in ids]
        engine = self._engine(assistant_model)
        new_ids = [out.outputs[0].token_ids for out in run_to_completion(engine, prompts, [params] * len(prompts))]
        rows = [prompt + new for prompt, new in zip(prompts, new_ids)]
        pad = (self.config.eos_token_ids or [0])[0]
        width = max(len(r) for r in rows)
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


class AutoModelForCausalLM:
    """HF-style loader. ``speculative=True`` makes the model its own INT4 draft."""

    @classmethod
    def from_pretrained(cls, model: str, load_in_low_bit: str = "bf16", speculative: bool = False,
                        assistant_model: PretrainedCausalLM | None = None, num_speculative_tokens: int = 4,
                        device: str = "cpu", draft_device: str | None = None, max_seq_len: int = 4096,
                        dtype: str = "bf16") -> PretrainedCausalLM:
        if not isinstance(speculative, bool):
            raise ValueError(f"speculative must be True or False, got {speculative!r}")
        if load_in_low_bit in ("bf16", "fp32"):
            dtype = load_in_low_bit
        loaded = load_model(model, dtype=dtype, device=device, load_in_low_bit=load_in_low_bit)
        spec = SpeculativeConfig(draft="self", num_speculative_tokens=num_speculative_tokens,
                                 draft_device=draft_device) if speculative else None
        assistant = assistant_model.loaded if assistant_model is not None else None
        return PretrainedCausalLM(loaded, spec, assistant, max_seq_len)
