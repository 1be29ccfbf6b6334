"""``fastdraft serve`` on a tiny INT4 model, live on a loopback port, driven by the official
``openai`` client (and raw HTTP where a client would hide what is tested)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pydantic
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from fastdraft.cli import build_parser
from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.engine.loader import describe_weights, load_model
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.quantizer import quantize_model
from fastdraft.sampling_params import SamplingParams
from tests.helpers import LiveServer, free_port, wait_healthy

MODEL = "tiny"
MAX_MODEL_LEN = 256
PROMPTS = [f"def function_{i}(x):\n    return x" for i in range(32)]


def tiny_int4(tiny_models):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="bf16")
    quantize_model(loaded.model, QuantConfig(method="rtn", group_size=32), show_progress=False)
    return loaded


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return tiny_int4(tiny_models)


@pytest.fixture(scope="module")
def live(loaded):
    server = LiveServer(loaded, EngineConfig(num_blocks=512, block_size=4, max_model_len=MAX_MODEL_LEN,
                                             max_num_seqs=32, max_num_batched_tokens=256), MODEL)
    yield server
    server.stop()


def offline(loaded, prompts, params, block_size: int = 4):
    engine = LLMEngine(loaded, EngineConfig(num_blocks=512, block_size=block_size, max_model_len=MAX_MODEL_LEN))
    return [o.outputs[0].text for o in run_to_completion(engine, prompts, params)]


# --- the OpenAI client ------------------------------------------------------------------------

def test_models_health_and_metrics(live, loaded):
    assert [m.id for m in live.client().models.list().data] == [MODEL]
    # The card names the weights that run (here the tiny model's RTN INT4).
    card = httpx.get(f"{live.url}/v1/models").json()["data"][0]
    assert card["weights"] == describe_weights(loaded.model) and card["weights"].startswith("rtn-int4")
    live.client().completions.create(model=MODEL, prompt="x = 1", max_tokens=3, temperature=0)
    text = httpx.get(f"{live.url}/metrics").text
    for name in ("fastdraft:time_to_first_token_seconds", "fastdraft:time_per_output_token_seconds",
                 "fastdraft:e2e_request_latency_seconds", "fastdraft:prompt_tokens_total",
                 "fastdraft:generation_tokens_total", "fastdraft:num_requests_running",
                 "fastdraft:num_requests_waiting", "fastdraft:kv_cache_usage_perc",
                 "fastdraft:prefix_cache_queries_total", "fastdraft:prefix_cache_hits_total",
                 "fastdraft:num_preemptions_total", "fastdraft:request_success_total"):
        assert name in text, name


def test_speculative_server_streams_plain_greedy_output_and_exports_acceptance(loaded):
    from fastdraft.speculative.speculative_config import SpeculativeConfig
    from fastdraft.speculative.factory import speculator_factory

    speculation = speculator_factory(SpeculativeConfig(draft="self", is_adaptive=False, min_confidence=0.0))
    server = LiveServer(loaded, EngineConfig(num_blocks=512, block_size=4, max_model_len=MAX_MODEL_LEN, max_num_seqs=8),
                        MODEL, speculation=speculation)
    try:
        client = server.client()
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        expected = offline(loaded, PROMPTS[:6], [params] * 6)

        def complete(prompt: str) -> str:
            stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            return "".join(chunk.choices[0].text for chunk in stream)

        with ThreadPoolExecutor(6) as pool:  # batched: the six share the engine's steps
            assert list(pool.map(complete, PROMPTS[:6])) == expected
        server.wait_idle()
        text = httpx.get(f"{server.url}/metrics").text
        drafted = float(re.search(r'fastdraft:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)', text).group(1))
        accepted = float(re.search(r'fastdraft:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)', text).group(1))
        assert drafted > 0 and 0 < accepted <= drafted
        assert 'fastdraft:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text
        assert 'draft_length="4"' in text
        assert server.engine.block_manager.num_free_blocks == server.engine.block_manager.num_blocks
    finally:
        server.stop()


def test_completion_matches_offline_and_counts_usage(live, loaded):
    client = live.client()
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    expected = offline(loaded, [PROMPTS[0]], [SamplingParams(max_new_tokens=12, ignore_eos=True)])[0]
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(loaded.tokenizer.encode(PROMPTS[0]))
    # The default max_tokens of a completion is 16, as OpenAI's.
    default = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16


def test_token_id_prompts_lists_echo_and_n(live, loaded):
    client = live.client()
    ids = loaded.tokenizer.encode(PROMPTS[1])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == by_text.choices[0].text
    listed = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=4, temperature=0, n=2,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in listed.choices] == list(range(6))
    assert listed.choices[0].text == listed.choices[1].text  # greedy: every choice alike
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPTS[1] + by_text.choices[0].text


def test_seeds_stop_strings_and_logprobs(live):
    client = live.client()
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert first.choices[0].text == again.choices[0].text
    sampled = client.completions.create(**{**kwargs, "n": 3})
    assert len({c.text for c in sampled.choices}) > 1  # each choice its own seed
    text = first.choices[0].text
    if len(text) > 3:
        stop = text[2:4]
        stopped = client.completions.create(**{**kwargs, "stop": [stop]})
        assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
        assert text.startswith(stopped.choices[0].text)
    logprobs = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=5, temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    assert all(lp <= 0.0 for lp in logprobs.token_logprobs)
    # Greedy: each chosen token is the most likely one.
    assert all(abs(max(top.values()) - lp) < 1e-4 for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))


def test_chat_streaming_and_not_with_usage_and_top_logprobs(live):
    client = live.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 8 and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # Chat's default max_tokens is the rest of the context, as vLLM's.
    rest = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert rest.usage.prompt_tokens + rest.usage.completion_tokens == MAX_MODEL_LEN


def test_chat_template_kwargs_are_passed_and_checked(live):
    client = live.client()
    messages = [{"role": "user", "content": "Say hi."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    with_kwargs = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert with_kwargs.choices[0].message.content == plain.choices[0].message.content  # a variable it ignores
    bad = httpx.post(f"{live.url}/v1/chat/completions",
                     json={"model": MODEL, "messages": messages, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_32_concurrent_streams_equal_offline_generate(live, loaded):
    client = live.client()

    def stream(prompt: str) -> str:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(stream, PROMPTS))
    assert texts == offline(loaded, PROMPTS, [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 32)


def test_disconnects_abort_and_free_every_block(live, loaded):
    expected = offline(loaded, PROMPTS, [SamplingParams(max_new_tokens=40, ignore_eos=True)] * 32)
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}

    def run(i: int) -> str | None:
        with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "prompt": PROMPTS[i]},
                          timeout=60) as response:
            text = ""
            for n, line in enumerate(response.iter_lines()):
                if i % 2 and n >= 2 + i % 7 * 4:  # odd clients leave at different points
                    return None
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
            return text

    with ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(run, range(32)))
    for i, text in enumerate(texts):
        if i % 2 == 0:
            assert text == expected[i]
    live.wait_idle()
    blocks = live.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    assert not live.engine._requests


# --- bad requests ---------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 400}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools[0]"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_shaped_errors(live, path, body, status, param):
    response = httpx.post(f"{live.url}{path}", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_malformed_json_is_a_400(live):
    response = httpx.post(f"{live.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        live.client().completions.create(model="missing", prompt="x")


def test_an_engine_failure_is_a_500_and_the_server_keeps_serving(live, monkeypatch):
    runner = live.engine.runner
    original = runner.execute

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(runner, "execute", original)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(runner, "execute", fail_once)
    response = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3},
                          timeout=30)
    assert response.status_code == 500 and "injected failure" in response.json()["error"]["message"]
    assert live.client().completions.create(model=MODEL, prompt="x", max_tokens=3).choices[0].text is not None
    live.wait_idle()
    assert live.engine.block_manager.num_free_blocks == live.engine.block_manager.num_blocks


def test_schemathesis_finds_no_server_error(live):
    # Requests generated from the server's own OpenAPI schema, bounded in examples per route.
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def fuzz(case):
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.path, case.body, response.text)

        fuzz()
    live.wait_idle()


# --- limits and shutdown --------------------------------------------------------------------

def test_api_key_is_enforced(loaded):
    server = LiveServer(loaded, EngineConfig(num_blocks=128, block_size=4, max_model_len=MAX_MODEL_LEN), MODEL,
                        api_key="secret")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").models.list()
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert [m.id for m in server.client("secret").models.list().data] == [MODEL]
        assert httpx.get(f"{server.url}/health").status_code == 200  # not under /v1
    finally:
        server.stop()


def test_a_full_queue_gets_429_with_retry_after(loaded):
    server = LiveServer(loaded, EngineConfig(num_blocks=128, block_size=4, max_model_len=MAX_MODEL_LEN,
                                             max_num_seqs=1), MODEL, max_queue=2)
    body = {"model": MODEL, "prompt": "x = 1", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(10) as pool:
            responses = list(pool.map(lambda _: httpx.post(f"{server.url}/v1/completions", json=body, timeout=60),
                                      range(10)))
        refused = [r for r in responses if r.status_code == 429]
        assert refused and all(r.headers["retry-after"] for r in refused)
        assert refused[0].json()["error"]["type"] == "rate_limit_error"
        assert all(r.status_code == 200 for r in responses if r.status_code != 429)
    finally:
        server.stop()


def _assert_sigterm_drains(process: subprocess.Popen, url: str, body: dict) -> None:
    """SIGTERM sent mid-stream: the stream still ends whole (``max_tokens`` 200), then exit 0."""
    pieces = []
    body = {**body, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not pieces and line.startswith("data: "):
                process.send_signal(signal.SIGTERM)  # mid-stream
            if line:
                pieces.append(line)
    assert pieces[-1] == "data: [DONE]"
    chunks = [json.loads(p[6:]) for p in pieces[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 200
    assert process.wait(60) == 0


def test_sigterm_lets_running_requests_finish_then_exits_0(tiny_models):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "fastdraft.cli", "serve", "--model",
                                str(tiny_models.dir("qwen2")), "--port", str(port), "--dtype", "bf16",
                                "--load-in-low-bit", "sym_int4", "--served-model-name", MODEL,
                                "--kv-cache-memory", "0.05"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120)
        body = {"model": MODEL, "prompt": "x = 1", "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}
        _assert_sigterm_drains(process, url, body)
    finally:
        if process.poll() is None:
            process.kill()


def test_serve_rejects_bad_options_in_one_line(tiny_models):
    result = subprocess.run([sys.executable, "-m", "fastdraft.cli", "serve", "--port", "70000"], capture_output=True,
                            text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "65535" in result.stderr


def test_binds_to_loopback_by_default():
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


@pytest.mark.real_model
def test_real_model_serves_the_openai_client(real_model_dir):
    loaded = load_model(real_model_dir, dtype="bf16", load_in_low_bit="sym_int4")
    server = LiveServer(loaded, EngineConfig(num_blocks=1024, block_size=16, max_model_len=1024, max_num_seqs=32),
                        MODEL)
    try:
        client = server.client()
        prompts = [f"def function_number_{i}(values):\n    " for i in range(32)]

        def stream(prompt: str) -> str:
            chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks)

        with ThreadPoolExecutor(32) as pool:
            texts = list(pool.map(stream, prompts))
        assert texts == offline(loaded, prompts, [SamplingParams(max_new_tokens=16, ignore_eos=True)] * 32,
                                block_size=16)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
            max_tokens=48, temperature=0.7, seed=3, n=2, logprobs=True, top_logprobs=3)
        assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)
        assert all(len(c.logprobs.content) >= 1 and len(c.logprobs.content[0].top_logprobs) == 3 for c in chat.choices)
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0,
            stream=True, stream_options={"include_usage": True}, stop=["\n\n"]))
        assert chunks[-1].usage.completion_tokens >= 1
        text = client.completions.create(model=MODEL, prompt="# add two numbers\n", max_tokens=24,
                                         temperature=0).choices[0].text
        assert text and text == offline(loaded, ["# add two numbers\n"], [SamplingParams(max_new_tokens=24)],
                                        block_size=16)[0]
    finally:
        server.stop()


def test_engine_process_serves_streams_aborts_and_drains(tiny_models):
    # The engine's step loop in a child process: the same outputs as offline generation, a
    # disconnect frees its blocks, SIGTERM lets a running stream finish and exits 0.
    model_dir = str(tiny_models.dir("qwen2"))
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "fastdraft.cli", "serve", "--model", model_dir, "--port",
                                str(port), "--dtype", "bf16", "--load-in-low-bit", "sym_int4", "--served-model-name",
                                MODEL, "--kv-cache-memory", "0.05", "--max-model-len", str(MAX_MODEL_LEN),
                                "--engine-process"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        prompts = PROMPTS[:8]

        def stream(prompt: str) -> str:
            chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
            return "".join(chunk.choices[0].text for chunk in chunks)

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(stream, prompts))
        offline = LLMEngine(load_model(model_dir, dtype="bf16", load_in_low_bit="sym_int4"),
                            EngineConfig(num_blocks=256, block_size=16, max_model_len=MAX_MODEL_LEN))
        expected = run_to_completion(offline, prompts, [SamplingParams(max_new_tokens=12)] * len(prompts))
        assert texts == [out.outputs[0].text for out in expected]

        body = {"model": MODEL, "prompt": "x = 1", "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # disconnect mid-stream
        # The pool's usage is reported after each step: a short request's last step shows it
        # once the dropped one is gone, and the child still serves after the abort.
        deadline = time.monotonic() + 20
        while True:
            client.completions.create(model=MODEL, prompt="y = 2", max_tokens=3, temperature=0)
            metrics = httpx.get(f"{url}/metrics").text
            usage = re.search(r"^fastdraft:kv_cache_usage_perc(?:\{.*\})? (\S+)$", metrics, re.M)
            if float(usage.group(1)) == 0.0 or time.monotonic() > deadline:
                break
        assert float(usage.group(1)) == 0.0

        _assert_sigterm_drains(process, url, body)
    finally:
        if process.poll() is None:
            process.kill()


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(live):
    client = live.client()
    prompt = "# a shared preamble that spans several blocks\n" * 3
    first = client.completions.create(model=MODEL, prompt=prompt + "a", max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt + "b", max_tokens=2, temperature=0)
    num_prompt = again.usage.prompt_tokens
    # Block size 4: every full block but the one with the last token comes from the cache.
    assert first.usage.prompt_tokens_details.cached_tokens < num_prompt // 2
    assert again.usage.prompt_tokens_details.cached_tokens >= (num_prompt - 2) // 4 * 4 - 4


class _Pick(pydantic.BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


PICK_SCHEMA = _Pick.model_json_schema()


def test_response_format_json_schema_and_json_object(live):
    client = live.client()
    form = {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK_SCHEMA, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pick"}], max_tokens=40,
                                         temperature=0.8, seed=2, response_format=form)
    assert _Pick.model_validate_json(out.choices[0].message.content) and out.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pick"}],
                                                 max_tokens=40, temperature=0, response_format=form, stream=True))
    assert _Pick.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    text = client.completions.create(model=MODEL, prompt="{", max_tokens=60, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert text.text.startswith("{") and (text.finish_reason == "length" or isinstance(json.loads(text.text), dict))


def test_parse_with_a_pydantic_model(live):
    parsed = live.client().chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "pick"}],
                                                  max_tokens=40, temperature=0, response_format=_Pick)
    assert isinstance(parsed.choices[0].message.parsed, _Pick)


def test_vllm_structured_outputs_and_its_older_names(live):
    client = live.client()

    def complete(**extra) -> str:
        return client.completions.create(model=MODEL, prompt="x", max_tokens=40, temperature=0,
                                         extra_body=extra).choices[0].text

    assert complete(structured_outputs={"choice": ["alpha", "beta"]}) in {"alpha", "beta"}
    assert complete(guided_choice=["alpha", "beta"]) in {"alpha", "beta"}
    assert re.fullmatch(r"\d{3}-[a-z]{2}", complete(structured_outputs={"regex": r"\d{3}-[a-z]{2}"}))
    assert re.fullmatch(r"\d{3}-[a-z]{2}", complete(guided_regex=r"\d{3}-[a-z]{2}"))
    assert complete(guided_grammar='root ::= "on" | "off"') in {"on", "off"}
    assert _Pick.model_validate_json(complete(structured_outputs={"json": PICK_SCHEMA}))


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format", "invalid JSON schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid regex"),
    ({"guided_grammar": "root ::= nowhere"}, "guided_grammar", "invalid grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
])
def test_a_bad_constraint_is_a_400_naming_it(live, extra, param, message):
    response = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
