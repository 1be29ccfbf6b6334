"""Tool calling as OpenAI's chat API defines it (``tools``, ``tool_choice`` and
``parallel_tool_calls``), for the server and ``LLM.chat``: the request's tools checked, the conversation's tool calls made
ready for the chat template, the grammar that makes a required call parse and validate, and
the reply's calls parsed, whole or streamed (``tool_parsers.py``).

``tool_choice`` ``none`` leaves the reply text; ``auto`` parses calls out of free text;
``required`` and a named function constrain the whole reply to calls (llguidance) whose
arguments follow each tool's JSON schema, one call unless ``parallel_tool_calls``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from fastdraft.engine.structured import check_constraint
from fastdraft.sampling_params import Constraint
from fastdraft.tokenizer import Tokenizer
from fastdraft.engine.tool_parsers import (HermesToolParser, Llama3JsonToolParser, MistralToolParser, ParsedOutput,
                                           ToolParser)

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolError(ValueError):
    """A request's tools, tool choice or tool messages are wrong: ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolUse:
    """How a request uses its tools: ``mode`` ``auto``, ``required`` or ``named`` (``function``
    the one named), the model's call format, and whether several calls may come at once."""

    tools: tuple[dict[str, Any], ...]
    mode: str
    parser: ToolParser
    function: str | None = None
    is_parallel: bool = True

    def constraint(self, tokenizer: Tokenizer | None = None) -> Constraint | None:
        """The grammar of a ``required`` or ``named`` reply (None for ``auto``): the parser's
        call format around a JSON object whose name is a tool's and whose arguments follow that
        tool's schema. A tag ``tokenizer``'s vocabulary holds as one token is asked for as that
        token, as the model writes it, not by its spelling."""
        if self.mode == "auto":
            return None

        def tag(text: str) -> str:
            ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
            return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)

        options = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key(self.parser)],
                    "properties": {"name": {"const": tool["function"]["name"]},
                                   arguments_key(self.parser): tool["function"].get("parameters") or _EMPTY_PARAMETERS}}
                   for tool in self.tools if self.mode == "required" or tool["function"]["name"] == self.function]
        call = f"%json {json.dumps({'anyOf': options})}"
        if isinstance(self.parser, HermesToolParser):
            one = f'{tag(HermesToolParser.TRIGGER)} "\\n" {call} "\\n" {tag(HermesToolParser.END)}'
            rules = f'start: call ("\\n" call)*\ncall: {one}' if self.is_parallel else f"start: {one}"
        elif isinstance(self.parser, MistralToolParser):
            opening = f'{tag(MistralToolParser.TRIGGER)} "["'
            rules = f'start: {opening} call ("," call)* "]"\ncall: {call}' if self.is_parallel else \
                f'start: {opening} {call} "]"'
        else:  # Llama 3's bare JSON, calls separated by "; "
            rules = f'start: call ("; " call)*\ncall: {call}' if self.is_parallel else f"start: {call}"
        return Constraint.of(grammar=rules + "\n")

    def parse(self, text: str) -> ParsedOutput:
        """The reply's content and calls (at most one without ``parallel_tool_calls``)."""
        parsed = self.parser.parse(text)
        if not self.is_parallel and len(parsed.tool_calls) > 1:
            parsed = ParsedOutput(parsed.content, parsed.tool_calls[:1])
        return parsed


def prompt_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools the chat template lists: none under ``tool_choice: none``."""
    return tools if tools and tool_choice != "none" else None


def arguments_key(parser: ToolParser) -> str:
    """The key a format writes a call's arguments under."""
    return "parameters" if isinstance(parser, Llama3JsonToolParser) else "arguments"


def check_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool,
                parser: ToolParser | None) -> ToolUse | None:
    """The request's tool use (None: no calls are parsed), or a ``ToolError`` naming the field
    that is wrong. ``parser``: the model's call format (None: its template has none)."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of function tools", param="tools")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                               param=f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'",
                               param=f"tools[{i}].function.name")
        if name in names:
            raise ToolError(f"two tools are named {name!r}", param=f"tools[{i}].function.name")
        names.append(name)
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
                raise ToolError(f"tools[{i}].function.parameters must be a JSON schema of an object",
                                   param=f"tools[{i}].function.parameters")
            try:
                check_constraint(Constraint.of(json=parameters))
            except ValueError as e:
                raise ToolError(f"tools[{i}].function.parameters: {e}", param=f"tools[{i}].function.parameters") \
                    from None
    mode, function = _choice(tool_choice, names)
    if mode == "none":
        return None
    if parser is None:
        raise ToolError("this model's chat template writes no tool calls (start the server with "
                           "--tool-call-parser NAME to name its format)", param="tools")
    # A named function is one call of it, as OpenAI's and vLLM's are.
    return ToolUse(tuple(tools), mode, parser, function, bool(parallel_tool_calls) and mode != "named")


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice in (None, "auto"):
        return "auto", None
    if tool_choice in ("none", "required"):
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                           "{\"name\": ...}}", param="tool_choice")
    if name not in names:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return "named", name


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat templates read it: an assistant's ``tool_calls`` with their
    arguments decoded (templates write them with ``tojson``), a tool result with its
    ``tool_call_id``. ``ToolError`` (``messages``) for a call that is not valid."""
    out = []
    for i, message in enumerate(messages):
        item = dict(message)
        if message.get("role") == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = [_template_call(call, f"messages[{i}].tool_calls[{j}]")
                                  for j, call in enumerate(_list(message["tool_calls"], f"messages[{i}].tool_calls"))]
            item["content"] = message.get("content") or ""
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise ToolError(f"messages[{i}]: a tool message needs its tool_call_id", param="messages")
        out.append(item)
    return out


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ToolError(f"{where} must be a list", param="messages")
    return value


def _template_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError(f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                           f"{{\"name\": ..., \"arguments\": \"{{...}}\"}}}}", param="messages")
    arguments = function.get("arguments", "{}")
    try:
        decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        decoded = None
    if not isinstance(decoded, dict):
        raise ToolError(f"{where}.function.arguments must be a JSON object (as text)", param="messages")
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": decoded}}


def message_calls(parsed: ParsedOutput) -> list[dict[str, Any]]:
    """A reply's calls as OpenAI's ``message.tool_calls``."""
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in parsed.tool_calls]
