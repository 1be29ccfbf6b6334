"""Tokenizer: HF ``tokenizer.json`` through ``tokenizers``, chat templates through jinja2,
and incremental detokenization for streaming."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


class Tokenizer:
    """Encode/decode plus the model's chat template, loaded from an HF model folder."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        self.path = path
        config_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self.bos_token = self._token_text(self.config.get("bos_token"))
        self.eos_token = self._token_text(self.config.get("eos_token"))

    @staticmethod
    def _token_text(value: Any) -> str | None:
        # tokenizer_config may store special tokens as {"content": ...} dicts.
        return value.get("content") if isinstance(value, dict) else value

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> HFTokenizer:
        """The ``tokenizers`` tokenizer itself (for libraries that read its vocabulary)."""
        return self._tok

    def get_vocab(self) -> dict[str, int]:
        """token -> id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            bos_id = self.token_to_id(self.bos_token)
            if bos_id is not None and (not ids or ids[0] != bos_id):
                ids = [bos_id, *ids]
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added (encoded in parallel)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def special_token_ids(self) -> list[int]:
        """Ids of the special added tokens (end of text, chat markers, ...)."""
        return sorted(i for i, token in self._tok.get_added_tokens_decoder().items() if token.special)

    def fingerprint(self) -> str:
        """sha256 of ``tokenizer.json``: equal fingerprints, equal tokenization."""
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self) -> Any:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # The same environment HF uses, so templates written for it render identically.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def set_chat_template(self, template: str) -> None:
        """Use ``template`` (Jinja, as in HF's tokenizer_config.json) instead of the model's own."""
        if not template.strip():
            raise ValueError("the chat template is empty")
        self.chat_template = template
        self.__dict__.pop("_template", None)  # the compiled template of the previous one

    def encode_chat(self, messages: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's token ids for chat ``messages``: rendered with the chat template, which
        writes the special tokens itself. ``ValueError`` for malformed messages or no template."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("the prompt is empty (no chat messages)")
        return self.encode(self.apply_chat_template(messages, chat_template_kwargs=chat_template_kwargs, tools=tools),
                           add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]; an assistant's may carry
        ``tool_calls`` instead of content) with the model's chat template, and ``tools``
        (OpenAI's function tools) as the template's ``tools``. ``chat_template_kwargs``: the
        template's own variables (Qwen3's ``enable_thinking``, say), as HF's
        ``apply_chat_template`` and vLLM take them."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or ("content" not in m and not m.get("tool_calls")):
                raise ValueError("each chat message must be a dict with 'role' and 'content'")
        variables = dict(chat_template_kwargs or {})
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"} & set(variables)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     tools=tools or None, **variables)


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    Only a short window of recent tokens is re-decoded per step (the prefix/read offset scheme
    of HF's TextStreamer and vLLM), so streaming stays linear in the output length.
    """

    tokenizer: Tokenizer
    token_ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.token_ids[self._prefix_offset:self._read_offset])
        full_text = self.tokenizer.decode(self.token_ids[self._prefix_offset:])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""  # an incomplete multi-byte character, or a token that decodes to nothing yet
        delta = full_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return delta


@dataclass
class StopStringMatcher:
    """Holds back streamed text that might be the start of a stop string."""

    stop: list[str]
    _pending: str = ""
    is_stopped: bool = False
    matched: str | None = None  # the stop string found, once stopped

    def feed(self, delta: str) -> str:
        """Return the part of ``delta`` that is safe to emit; sets ``is_stopped`` on a match."""
        if not self.stop:
            return delta
        text = self._pending + delta
        hits = [(text.find(s), s) for s in self.stop if s in text]
        if hits:
            index, self.matched = min(hits)
            self.is_stopped = True
            self._pending = ""
            return text[:index]
        # Keep the longest suffix of text that is a prefix of some stop string.
        keep = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self._pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """Text still held back when generation ends for another reason."""
        out, self._pending = self._pending, ""
        return out
