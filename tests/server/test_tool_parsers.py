"""Tool-call parsers on recorded replies of each format: whole-text parsing, and streaming split
at every position reassembling to the same content and calls."""

from __future__ import annotations

import json

import pytest

from fastdraft.engine.tool_parsers import (HermesToolParser, Llama3JsonToolParser, MistralToolParser, ParsedOutput,
                                           ToolParser, tool_parser_for)

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"timezone": "Europe/Paris"}

# (parser, reply, expected content, expected [(name, arguments)])
CASES = [
    (HermesToolParser(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                         '</tool_call>', None, [("get_weather", WEATHER)]),
    (HermesToolParser(), 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
                         '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                         '"arguments": {"timezone": "Europe/Paris"}}\n</tool_call>',
     "Let me check both.\n\n", [("get_weather", WEATHER), ("get_time", TIME)]),
    (HermesToolParser(), "No tool is needed: 2 + 2 = 4.", "No tool is needed: 2 + 2 = 4.", []),
    (HermesToolParser(), "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (Llama3JsonToolParser(), '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", WEATHER)]),
    (Llama3JsonToolParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                             '"celsius"}}; {"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}', None,
     [("get_weather", WEATHER), ("get_time", TIME)]),
    (Llama3JsonToolParser(), "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    (Llama3JsonToolParser(), '{"answer": 4}', '{"answer": 4}', []),
    (MistralToolParser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                          '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]', None,
     [("get_weather", WEATHER), ("get_time", TIME)]),
    (MistralToolParser(), 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "Checking.",
     [("get_weather", WEATHER)]),
    (MistralToolParser(), "Just text [TOOL_CALLS] broken", "Just text [TOOL_CALLS] broken", []),
]
IDS = [f"{case[0].NAME}-{i}" for i, case in enumerate(CASES)]


def _check(parsed: ParsedOutput, content, calls) -> None:
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed.tool_calls)


@pytest.mark.parametrize("parser,reply,content,calls", CASES, ids=IDS)
def test_whole_replies_parse(parser: ToolParser, reply, content, calls):
    _check(parser.parse(reply), content, calls)


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    stream = parser.stream()
    content, by_index = "", {}
    for piece in [*pieces, None]:
        text, deltas = stream.feed(piece) if piece is not None else stream.finish()
        content += text
        for delta in deltas:
            name, arguments = by_index.get(delta.index, (None, ""))
            if delta.name is not None:
                assert name is None and delta.id.startswith("call_")  # the first piece names the call
                name = delta.name
            else:
                assert name is not None  # arguments follow the name
            by_index[delta.index] = (name, arguments + delta.arguments)
    assert sorted(by_index) == list(range(len(by_index)))
    return content, [by_index[i] for i in range(len(by_index))]


@pytest.mark.parametrize("parser,reply,content,calls", CASES, ids=IDS)
def test_streams_split_at_every_position_reassemble(parser: ToolParser, reply, content, calls):
    for cut in range(len(reply) + 1):
        got_content, got_calls = _streamed(parser, [reply[:cut], reply[cut:]])
        assert (got_content or None) == content, cut
        assert [(n, json.loads(a)) for n, a in got_calls] == calls, cut
    # One character at a time too.
    got_content, got_calls = _streamed(parser, list(reply))
    assert (got_content or None) == content and [(n, json.loads(a)) for n, a in got_calls] == calls


def test_parser_chosen_from_the_template_or_by_name():
    assert isinstance(tool_parser_for("{% if tools %}<tool_call>{% endif %}"), HermesToolParser)
    assert isinstance(tool_parser_for("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]"), MistralToolParser)
    assert isinstance(tool_parser_for("{{ '<|python_tag|>' }}"), Llama3JsonToolParser)
    assert tool_parser_for("{{ messages }}") is None
    assert isinstance(tool_parser_for(None, "mistral"), MistralToolParser)
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'; known: hermes"):
        tool_parser_for(None, "xml")


def test_rendered_calls_parse_back():
    for parser in (HermesToolParser(), Llama3JsonToolParser(), MistralToolParser()):
        parsed = parser.parse(parser.render_call("get_weather", json.dumps(WEATHER)))
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", WEATHER)]


def test_hermes_takes_a_reply_of_untagged_calls():
    # Qwen2.5-Coder-0.5B writes its call without the tags; ordinary JSON stays content.
    parser = HermesToolParser()
    reply = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    _check(parser.parse(reply), None, [("get_weather", WEATHER)])
    assert _streamed(parser, list(reply))[1][0][0] == "get_weather"
    _check(parser.parse('{"name": "Ada", "age": 36}'), '{"name": "Ada", "age": 36}', [])
    fenced = f"```json\n{reply}\n```"
    _check(parser.parse(fenced), None, [("get_weather", WEATHER)])
    assert _streamed(parser, list(fenced))[1][0][0] == "get_weather"
    assert _streamed(parser, list("```python\nprint(1)\n```")) == ("```python\nprint(1)\n```", [])
    # Llama 3: a reply that began as text stays text, whatever JSON follows.
    text = 'Here it is: {"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert _streamed(Llama3JsonToolParser(), list(text)) == (text, [])
    assert _streamed(parser, list('{"answer": 4}')) == ('{"answer": 4}', [])
