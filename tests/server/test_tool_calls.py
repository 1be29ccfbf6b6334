"""Tool calling through the server on the real Qwen2.5-Coder-0.5B (its template's Hermes
format), with the ``openai`` client: auto, required, a named function, none, streaming, and a
conversation that sends a tool's result back."""

from __future__ import annotations

import json

import httpx
import pytest

from fastdraft.engine.llm_engine import EngineConfig
from fastdraft.engine.loader import load_model
from tests.helpers import LiveServer

pytestmark = pytest.mark.real_model
MODEL = "qwen-tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
STOCK = {"type": "function", "function": {
    "name": "get_stock_price", "description": "The latest price of a stock ticker.",
    "parameters": {"type": "object", "properties": {"ticker": {"type": "string"}}, "required": ["ticker"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now? Use the tool."}]


@pytest.fixture(scope="module")
def live(real_model_dir):
    loaded = load_model(real_model_dir)  # the GGUF's own blocks, as `fastdraft serve` runs it
    server = LiveServer(loaded, EngineConfig(max_model_len=2048, max_num_seqs=4), MODEL)
    yield server
    server.stop()


def _validates(call, tool) -> dict:
    """The call's arguments, checked against the tool's schema (required keys, types, enums)."""
    arguments = json.loads(call.function.arguments)
    schema = tool["function"]["parameters"]
    assert set(schema.get("required", [])) <= set(arguments) <= set(schema["properties"])
    for key, value in arguments.items():
        spec = schema["properties"][key]
        assert isinstance(value, str) if spec["type"] == "string" else True
        assert value in spec.get("enum", [value])
    return arguments


def test_auto_calls_the_tool_the_prompt_asks_for(live):
    reply = live.client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, STOCK], temperature=0,
                                                  max_tokens=100)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert "paris" in _validates(call, WEATHER)["city"].lower()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_stock_price"}}])
def test_required_and_named_calls_always_validate(live, tool_choice):
    client = live.client()
    for prompt in ("Hello!", "Tell me about Apple's stock.", "What is the weather in Oslo?"):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               tools=[WEATHER, STOCK], tool_choice=tool_choice, temperature=0,
                                               max_tokens=120, parallel_tool_calls=False)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_stock_price"
        _validates(call, WEATHER if call.function.name == "get_weather" else STOCK)


def test_streamed_calls_reassemble_to_the_whole_reply(live):
    client = live.client()
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, STOCK], temperature=0, max_tokens=100)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls, finish = {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            if delta.function.name:
                assert delta.id.startswith("call_") and delta.type == "function"
                entry["name"] = delta.function.name
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_none_never_calls_and_a_tool_result_gets_an_answer(live):
    client = live.client()
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=40)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason != "tool_calls"
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "clear"})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=60)
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    assert "18" in final.choices[0].message.content


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "properties": {"x": {"type": 7}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                               "function": {"name": "f", "arguments": "[1"}}]}]},
     "messages"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(live, body, param):
    reply = httpx.post(f"{live.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    assert live.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices  # unharmed


def test_llm_chat_returns_the_same_parsed_calls(real_model_dir):
    from fastdraft.llm import LLM
    from fastdraft.sampling_params import SamplingParams

    llm = LLM(model=str(real_model_dir), max_model_len=2048)
    output = llm.chat(ASK, SamplingParams(max_new_tokens=100), tools=[WEATHER, STOCK],
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    completion = output.outputs[0]
    assert completion.finish_reason == "tool_calls" and len(completion.tool_calls) >= 1
    assert completion.tool_calls[0]["function"]["name"] == "get_weather"
    assert "city" in json.loads(completion.tool_calls[0]["function"]["arguments"])
    with pytest.raises(ValueError, match="tool_choice names 'nope'"):
        llm.chat(ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_langchain_agent_runs_a_two_tool_task(live):
    # An agent framework from PyPI as users point them at a local server: it calls a tool, gets
    # the result back as a tool message, and answers.
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return json.dumps({"city": city, "temperature_c": 18, "sky": "clear"})

    @tool
    def get_stock_price(ticker: str) -> str:
        """The latest price of a stock ticker."""
        return json.dumps({"ticker": ticker, "price": 123.4})

    tools = {t.name: t for t in (get_weather, get_stock_price)}
    model = ChatOpenAI(base_url=f"{live.url}/v1", api_key="none", model=MODEL, temperature=0, max_tokens=100,
                       max_retries=0)
    messages = [HumanMessage("What is the weather like in Paris right now? Use the tool.")]
    reply = model.bind_tools(list(tools.values()), tool_choice="required").invoke(messages)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    # The agent's loop, bounded as frameworks bound it: run the calls, send the results back,
    # and on the last turn ask for the answer (tool_choice none).
    for turn in range(3):
        messages += [reply, *(ToolMessage(tools[c["name"]].invoke(c["args"]), tool_call_id=c["id"])
                              for c in reply.tool_calls)]
        reply = model.bind_tools(list(tools.values()), tool_choice="none" if turn == 2 else "auto").invoke(messages)
        if not reply.tool_calls:
            break
    # The 0.5B model's final words vary (it may restate its call); the framework's round trip is
    # what is under test: a text answer after the tool results went back.
    assert not reply.tool_calls and reply.content.strip()
    assert [type(m).__name__ for m in messages[:3]] == ["HumanMessage", "AIMessage", "ToolMessage"]
