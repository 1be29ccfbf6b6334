"""Tool calls in a model's output text: one parser per format, each whole-text and streaming.

A chat model asked to call a tool writes the call in its own format: Hermes / Qwen wrap a JSON
object in ``<tool_call>`` tags, Llama 3.x writes a bare JSON object (after ``<|python_tag|>``
for its built-in tools), Mistral writes ``[TOOL_CALLS]`` and then a JSON array (or, in newer
templates, ``name[ARGS]{...}`` per call). A parser splits the text into ``content`` (what is
not a call) and :class:`ParsedToolCall` s whose ``arguments`` are JSON text, as OpenAI's
``function.arguments`` are.

Streaming (:meth:`ToolParser.stream`): text that may begin a call is held back; a call's name
goes out in its first :class:`ToolCallDelta` once the call is complete, its arguments in the
next, each with the call's ``index``, as OpenAI streams ``delta.tool_calls``. What streams
reassembles to what :meth:`ToolParser.parse` gives for the whole text.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


def new_call_id() -> str:
    """An OpenAI-style call id: ``call_`` and 24 random letters and digits."""
    alphabet = string.ascii_letters + string.digits
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


@dataclass(frozen=True)
class ParsedToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class ParsedOutput:
    """A model's reply split into its free text (None when there is none) and its calls."""

    content: str | None
    tool_calls: tuple[ParsedToolCall, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one call in a stream: its first piece names it (``id``, ``name``), later ones
    carry ``arguments`` text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def _call(obj: Any, arguments_key: str) -> ParsedToolCall | None:
    """A call from a decoded JSON object ``{"name": ..., arguments_key: {...}}``, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """The JSON values written one after another in ``text`` (separated by whitespace, commas
    or semicolons), or None if anything else is there."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


class ToolParser(ABC):
    """A tool-call format. ``TRIGGER``: the text a call begins with (where a constrained call's
    grammar takes over); subclasses implement :meth:`parse`."""

    NAME: ClassVar[str]
    TRIGGER: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """``text`` (a whole reply) split into content and calls; text that looks like a call
        but does not parse stays content."""

    def stream(self) -> "ToolCallStream":
        """A streaming parse of one reply."""
        return ToolCallStream(self)

    def render_call(self, name: str, arguments: str) -> str:
        """The text of one call in this format (for grammars and tests)."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
    one block per call, text around them the content. Small models often drop the tags: a reply
    that is nothing but such objects counts as calls too."""

    NAME = "hermes"
    TRIGGER = "<tool_call>"
    END = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        calls, pieces, last = [], [], 0
        for match in self._BLOCK.finditer(text):
            values = _json_values(match.group(1))
            call = _call(values[0], "arguments") if values and len(values) == 1 else None
            if call is None:
                continue  # not a call: it stays in the content
            pieces.append(text[last:match.start()])
            last = match.end()
            calls.append(call)
        pieces.append(text[last:])
        if not calls:
            bare = _bare_calls(text)
            if bare:
                return ParsedOutput(None, tuple(bare))
        content = "".join(pieces) if calls else text
        return ParsedOutput(content if content.strip() else None, tuple(calls))

    def render_call(self, name: str, arguments: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


_FENCE = re.compile(r"^```(?:json)?\s*\n(.*?)\n?```$", re.DOTALL)
_FENCE_OPENING = re.compile(r"```(?:json)?[ \t]*\n\s*")


def _bare_calls(text: str) -> list[ParsedToolCall]:
    """The calls of a reply that is only ``{"name": ..., "arguments": {...}}`` objects, bare or
    in one Markdown code fence (none if it is anything else, or an object lacks either key)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    values = _json_values(body) if body.startswith("{") else None
    if not values or not all(isinstance(v, dict) and set(v) == {"name", "arguments"} for v in values):
        return []
    calls = [_call(v, "arguments") for v in values]
    return [] if any(c is None for c in calls) else calls


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x: a reply that is a JSON object ``{"name": ..., "parameters": {...}}`` (several
    separated by ``;``), optionally after ``<|python_tag|>``. Any other reply is content."""

    NAME = "llama3_json"
    TRIGGER = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        body = body.removeprefix(self.TRIGGER).strip()
        values = _json_values(body) if body.startswith("{") else None
        calls = [_call(v, "parameters") for v in values] if values else []
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text if text.strip() else None)
        return ParsedOutput(None, tuple(calls))

    def render_call(self, name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": {arguments}}}'


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects, or (newer
    templates) ``name[ARGS]{...}`` for each call; text before it is the content."""

    NAME = "mistral"
    TRIGGER = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.TRIGGER)
        if start < 0:
            return ParsedOutput(text if text.strip() else None)
        content, rest = text[:start], text[start + len(self.TRIGGER):]
        calls = self._calls(rest)
        if not calls:
            return ParsedOutput(text if text.strip() else None)
        return ParsedOutput(content if content.strip() else None, tuple(calls))

    def _calls(self, rest: str) -> list[ParsedToolCall]:
        if rest.lstrip().startswith("["):
            values = _json_values(rest)
            if not values or len(values) != 1 or not isinstance(values[0], list):
                return []
            calls = [_call(v, "arguments") for v in values[0]]
            return [] if any(c is None for c in calls) else calls
        calls, decoder, i = [], json.JSONDecoder(), 0
        while i < len(rest):
            match = self._NAMED.match(rest, i)
            if match is None:
                return calls if not rest[i:].strip() else []
            try:
                arguments, i = decoder.raw_decode(rest, match.end())
            except json.JSONDecodeError:
                return []
            call = _call({"name": match.group(1), "arguments": arguments}, "arguments")
            if call is None:
                return []
            calls.append(call)
            i = rest.find(self.TRIGGER, i) + len(self.TRIGGER) if self.TRIGGER in rest[i:] else i
        return calls

    def render_call(self, name: str, arguments: str) -> str:
        return f'[TOOL_CALLS][{{"name": {json.dumps(name)}, "arguments": {arguments}}}]'


class ToolCallStream:
    """One reply parsed as it streams: :meth:`feed` each text delta, then :meth:`finish`; each
    returns (content to send now, call deltas to send now). Content that may begin a call is
    held back until it cannot; once a call has begun, the rest of the reply is held and parsed
    when it ends (or, for a tagged format, at each closing tag)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._held = ""  # text not yet sent: a possible trigger, or a call being written
        self._in_call = False
        self._num_calls = 0
        self._started = False  # any non-space text seen (a bare JSON call must open the reply)
        self._is_whole_reply = False  # the reply is held to its end and parsed whole
        self._is_text = False  # the reply began as text

    def _deltas(self, calls: tuple[ParsedToolCall, ...]) -> list[ToolCallDelta]:
        out = []
        for call in calls:
            out.append(ToolCallDelta(self._num_calls, id=call.id, name=call.name))
            out.append(ToolCallDelta(self._num_calls, arguments=call.arguments))
            self._num_calls += 1
        return out

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._held += text
        parser = self.parser
        if isinstance(parser, Llama3JsonToolParser) or self._is_whole_reply:
            return self._feed_whole_reply()
        if isinstance(parser, HermesToolParser) and not self._started:
            stripped = self._held.lstrip()
            if not stripped:
                return "", []
            self._started = True
            if stripped.startswith(("{", "`")):  # a call without its tags, perhaps: held to the end
                self._is_whole_reply = True
                return self._feed_whole_reply()
        content, deltas = "", []
        while True:
            if not self._in_call:
                start = self._held.find(parser.TRIGGER)
                if start < 0:  # send all but a tail that may begin the trigger
                    keep = _partial_suffix(self._held, parser.TRIGGER)
                    content += self._held[:len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep:]
                    return content, deltas
                content += self._held[:start]
                self._held = self._held[start:]
                self._in_call = True
            if not isinstance(parser, HermesToolParser):
                return content, deltas  # untagged calls end with the reply
            end = self._held.find(HermesToolParser.END)
            if end < 0:
                return content, deltas
            block, self._held = self._held[:end + len(HermesToolParser.END)], self._held[end + len(HermesToolParser.END):]
            parsed = parser.parse(block)
            if parsed.tool_calls:
                deltas += self._deltas(parsed.tool_calls)
            else:
                content += block  # not a call after all
            self._in_call = False

    def _feed_whole_reply(self) -> tuple[str, list[ToolCallDelta]]:
        if self._is_text:  # the reply began as text: a call cannot follow (Llama 3's opens it)
            content, self._held = self._held, ""
            return content, []
        stripped = self._held.lstrip()
        if self._in_call:
            return "", []
        if not stripped:
            return "", []
        trigger = self.parser.TRIGGER
        if stripped.startswith("{") or stripped.startswith(trigger):
            self._in_call = True
            return "", []
        if trigger.startswith(stripped):
            return "", []  # may still become the trigger
        if isinstance(self.parser, HermesToolParser) and stripped.startswith("`"):
            fence = _FENCE_OPENING.match(stripped)  # a fenced call opens "```json" and "{"
            if fence is None:
                if any(opening.startswith(stripped) for opening in ("```json\n", "```\n")):
                    return "", []  # the fence's first line is not complete yet
            elif not stripped[fence.end():]:
                return "", []
            elif stripped[fence.end():].startswith("{"):
                self._in_call = True
                return "", []
        content, self._held = self._held, ""
        self._is_whole_reply = isinstance(self.parser, Llama3JsonToolParser)  # Hermes: tags may follow
        self._is_text = True
        return content, []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        held, self._held = self._held, ""
        if not held:
            return "", []
        if not self._in_call:
            return held, []
        parsed = self.parser.parse(held)
        return parsed.content or "", self._deltas(parsed.tool_calls)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0 if none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.NAME: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def tool_parser_for(chat_template: str | None, name: str | None = None) -> ToolParser | None:
    """The parser ``name`` names, or the one the chat template's own tool format implies (None:
    the template writes no tool calls). ``ValueError`` for an unknown name."""
    if name is not None:
        if name not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
        return TOOL_PARSERS[name]()
    template = chat_template or ""
    if "<tool_call>" in template:
        return HermesToolParser()
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return MistralToolParser()
    if "<|python_tag|>" in template or ("<|eom_id|>" in template and "parameters" in template):
        return Llama3JsonToolParser()
    return None
