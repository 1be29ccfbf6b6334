"""The server on Ray Serve: engine replicas behind one ingress, on a local cluster shared by
the whole test run, driven by the official ``openai`` client on 127.0.0.1."""

from __future__ import annotations

import functools
import json
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.engine.loader import load_model
from fastdraft.sampling_params import SamplingParams
from tests.helpers import free_port, wait_healthy

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
from ray import cloudpickle, serve  # noqa: E402

from fastdraft.server.app import ServerConfig  # noqa: E402
from fastdraft.server.ray_app import RayServeConfig, application, build_ray_app, serving_engine  # noqa: E402
from fastdraft.server.standin import StandInEngine  # noqa: E402

pytestmark = pytest.mark.ray

MODEL = "tiny"
MAX_MODEL_LEN = 128
APP = "fastdraft-test"
STREAM_INTERVAL = 3  # the replicas send a request's tokens on every 3 steps


METRICS_PORT = free_port()  # where the cluster's node exports its metrics


@pytest.fixture(scope="session")
def ray_serve():
    """One local cluster for the whole run (a start costs seconds): 4 CPUs, a small object
    store, Serve's HTTP proxy on a free loopback port, metrics exported every second."""
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=80 * 2**20, configure_logging=False,
             _metrics_export_port=METRICS_PORT, _system_config={"metrics_report_interval_ms": 1000})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _engine_config() -> EngineConfig:
    return EngineConfig(num_blocks=256, block_size=4, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)


@pytest.fixture(scope="module")
def served(ray_serve, tiny_models):
    load_engine = functools.partial(serving_engine, str(tiny_models.dir("qwen2")), "fp32", _engine_config())
    serve.run(application(load_engine, ServerConfig(served_model_name=MODEL, max_queue=16),
                          RayServeConfig(num_replicas=2, max_ongoing_requests=8, graceful_shutdown_timeout_s=30,
                                         stream_interval=STREAM_INTERVAL)), name=APP, route_prefix="/")
    wait_healthy(ray_serve, 120)
    yield ray_serve
    serve.delete(APP)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _offline(tiny_models, prompts: list[str], params: SamplingParams) -> list[str]:
    engine = LLMEngine(load_model(tiny_models.dir("qwen2"), dtype="fp32"), _engine_config())
    return [o.outputs[0].text for o in run_to_completion(engine, prompts, [params] * len(prompts))]


def test_completions_and_chat_match_the_engine(served, tiny_models):
    client = _client(served)
    prompts = ["def add(a, b):", "import os\n"]
    sampled = dict(temperature=1.0, seed=5)  # seeded draws: the same tokens wherever they run
    expected = _offline(tiny_models, prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, **sampled))
    assert all(expected)
    for prompt, text in zip(prompts, expected):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **sampled,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == text and out.usage.completion_tokens == 12
        chunks = [c for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **sampled,
                                                       stream=True, extra_body={"ignore_eos": True}) if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == text
        # The first token alone, then the other 11 in sends of 3 (the last send: what is left).
        assert len(chunks) <= 1 + -(-11 // STREAM_INTERVAL)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          n=2, temperature=1.0, seed=3)
    assert len(chat.choices) == 2 and all(c.message.role == "assistant" for c in chat.choices)
    prompt, text = max(zip(prompts, expected), key=lambda pair: len(pair[1]))
    assert len(text) >= 3
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **sampled, stop=[text[1:3]],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[:text.index(text[1:3])]


def test_response_format_through_the_replicas(served):
    schema = {"type": "object", "properties": {"pick": {"enum": ["left", "right"]}}, "required": ["pick"],
              "additionalProperties": False}
    out = _client(served).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "which way?"}], max_tokens=20, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "way", "schema": schema}})
    assert json.loads(out.choices[0].message.content)["pick"] in {"left", "right"}


def test_a_bad_request_gets_the_single_process_servers_answer(served):
    response = httpx.post(f"{served}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1000})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "maximum model length 128" in error["message"]
    assert httpx.post(f"{served}/v1/completions", json={"model": "other", "prompt": "x"}).status_code == 404


def test_each_replicas_engine_metrics_reach_rays_export(served):
    client = _client(served)
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: client.completions.create(model=MODEL, prompt=f"def f{i}():", max_tokens=4,
                                                          temperature=0, extra_body={"ignore_eos": True}), range(6)))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the node's agent exports what the replicas report, every second
        text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
        ttft = [line for line in text.splitlines()
                if line.startswith("ray_fastdraft_time_to_first_token_seconds_count{")]
        if ttft:
            break
        time.sleep(1)
    assert ttft, "no fastdraft metric in Ray's export"
    assert all('replica="' in line and f'model_name="{MODEL}"' in line and 'deployment="FastdraftEngine"' in line
               for line in ttft)
    assert sum(float(line.rsplit(" ", 1)[1]) for line in ttft) >= 1
    assert any(line.startswith("ray_fastdraft_generation_tokens") for line in text.splitlines())
    assert any(line.startswith("ray_fastdraft_kv_cache_usage_perc{") for line in text.splitlines())


def test_a_client_that_goes_away_frees_its_request(served):
    with httpx.stream("POST", f"{served}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "def f():", "max_tokens": 100, "stream": True,
                            "ignore_eos": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then the client leaves
    # The replicas keep serving: a later request completes in full.
    deadline = time.monotonic() + 60
    out = _client(served).completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8 and time.monotonic() < deadline


def _slow_engine(model_dir: str) -> LLMEngine:
    """The tiny model's engine with 20 ms steps, so that streams outlast a scale-down."""
    engine = serving_engine(model_dir, "fp32", _engine_config())
    step = engine.step

    def slow_step():
        time.sleep(0.02)
        return step()

    engine.step = slow_step
    return engine


def _stream_tokens(url: str, max_tokens: int) -> tuple[int, str | None]:
    """Stream one completion; (the tokens it streamed, the finish reason)."""
    num_tokens, finish = 0, None
    for chunk in _client(url).completions.create(model=MODEL, prompt="def f():", max_tokens=max_tokens,
                                                 temperature=1.0, seed=1, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}):
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            num_tokens = chunk.usage.completion_tokens
    return num_tokens, finish


def test_open_streams_finish_across_a_scale_down_and_a_delete(ray_serve, tiny_models):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import the tests
    load_engine = functools.partial(_slow_engine, str(tiny_models.dir("qwen2")))

    def deploy(replicas: int) -> None:
        serve.run(application(load_engine, ServerConfig(served_model_name=MODEL, max_queue=16),
                              RayServeConfig(num_replicas=replicas, max_ongoing_requests=8,
                                             graceful_shutdown_timeout_s=60)),
                  name="drain", route_prefix="/drain")

    deploy(2)
    url = f"{ray_serve}/drain"
    wait_healthy(url, 120)
    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(_stream_tokens, url, 60) for _ in range(6)]
        time.sleep(0.5)  # every stream has started
        deploy(1)  # one replica goes, with streams on it
        assert [s.result(timeout=120) for s in streams] == [(60, "length")] * 6
        streams = [pool.submit(_stream_tokens, url, 60) for _ in range(4)]
        time.sleep(0.5)
        serve.delete("drain")  # the whole application goes, its streams open
        assert [s.result(timeout=120) for s in streams] == [(60, "length")] * 4


@pytest.mark.real_model
def test_the_cli_serves_the_real_model_from_two_prefix_routed_replicas_and_drains(real_model_dir, real_model_fp32):
    # `fastdraft serve --backend ray` starts a cluster of its own (not the test run's), and
    # SIGTERM lets every open stream end whole before it exits 0.
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "fastdraft.cli", "serve", "--backend", "ray", "--replicas", "2",
                                "--router", "prefix", "--model", str(real_model_dir), "--dtype", "fp32",
                                "--served-model-name", MODEL, "--max-model-len", "512", "--max-num-seqs", "4",
                                "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 300)
        client = _client(url)
        prompt = "def fibonacci(n):\n"
        expected = run_to_completion(LLMEngine(real_model_fp32, EngineConfig(max_model_len=512)), [prompt],
                                     [SamplingParams(max_new_tokens=16, ignore_eos=True)])[0].outputs[0].text
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        chat = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0.7, seed=1,
            n=2, stream=True, stream_options={"include_usage": True}))
        assert {c.choices[0].index for c in chat if c.choices} == {0, 1} and chat[-1].usage.completion_tokens >= 2
        assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 600}
                          ).status_code == 400
        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(_stream_tokens, url, 32) for _ in range(3)]
            time.sleep(1.0)  # each stream is open
            process.send_signal(signal.SIGTERM)
            assert [s.result(timeout=120) for s in streams] == [(32, "length")] * 3
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def _cache_hit_rate(url: str, prompts: list[list[int]]) -> float:
    """Send ``prompts`` one after another; the share of their tokens the replicas' caches held."""
    num_cached = num_prompt = 0
    client = _client(url)
    for prompt in prompts:
        usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                          extra_body={"ignore_eos": True}).usage
        num_cached += usage.prompt_tokens_details.cached_tokens
        num_prompt += usage.prompt_tokens
    return num_cached / num_prompt


def test_the_prefix_router_keeps_shared_prompts_where_they_are_cached(ray_serve):
    # Two stand-in replicas whose caches hold two of the four shared prefixes each: routed by
    # prefix, each prefix stays on one replica and hits; in turn, both replicas see all four,
    # and their caches thrash.
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 900) for _ in range(64)] for _ in range(4)]  # 4 blocks of 16 each
    prompts = [prefixes[rng.randrange(4)] + [rng.randrange(1, 900) for _ in range(8)] for _ in range(40)]
    load_engine = functools.partial(StandInEngine, ttft_s=0.0, cache_blocks=8)
    rates = {}
    for router in ("round-robin", "prefix"):
        serve.run(application(load_engine, ServerConfig(served_model_name=MODEL, max_queue=16),
                              RayServeConfig(num_replicas=2, router=router)),
                  name="routing", route_prefix="/routing")
        wait_healthy(f"{ray_serve}/routing", 120)
        rates[router] = _cache_hit_rate(f"{ray_serve}/routing", prompts)
        serve.delete("routing")
    assert rates["prefix"] > 0.6 and rates["prefix"] > rates["round-robin"] + 0.25, rates


def test_serve_run_builds_the_application_from_its_args(ray_serve, tiny_models):
    with pytest.raises(ValueError, match="router"):
        build_ray_app({"router": "nearest"})
    serve.run(build_ray_app({"model": str(tiny_models.dir("qwen2")), "dtype": "fp32", "served_model_name": MODEL,
                             "max_model_len": MAX_MODEL_LEN, "router": "prefix", "stream_interval": 2}),
              name="built", route_prefix="/built")
    try:
        url = f"{ray_serve}/built"
        wait_healthy(url, 120)
        chunks = list(_client(url).completions.create(model=MODEL, prompt="def f():", max_tokens=5, temperature=0,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == 5
    finally:
        serve.delete("built")


def _num_running_replicas(app: str) -> int:
    deployments = serve.status().applications[app].deployments
    return deployments["FastdraftEngine"].replica_states.get("RUNNING", 0)


def test_autoscaling_adds_a_replica_when_requests_wait_in_the_engine(ray_serve):
    # target_ongoing_requests is far above the load, so that Ray's default policy alone would keep
    # one replica: the second comes from the engine's waiting queue (16 of 24 requests wait for
    # the stand-in's batch of 8).
    autoscaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1000, "upscale_delay_s": 0,
                   "downscale_delay_s": 600, "look_back_period_s": 1}
    serve.run(application(functools.partial(StandInEngine, ttft_s=0.0), ServerConfig(served_model_name=MODEL),
                          RayServeConfig(autoscaling=autoscaling, max_ongoing_requests=64)),
              name="scaling", route_prefix="/scaling")
    url = f"{ray_serve}/scaling"
    wait_healthy(url, 120)
    assert _num_running_replicas("scaling") == 1
    stop = threading.Event()

    def hold_a_stream() -> None:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for _ in response.iter_lines():
                if stop.is_set():
                    return  # the client leaves; its request is aborted

    try:
        with ThreadPoolExecutor(24) as pool:
            streams = [pool.submit(hold_a_stream) for _ in range(24)]
            deadline = time.monotonic() + 60
            while _num_running_replicas("scaling") < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            num_replicas = _num_running_replicas("scaling")
            stop.set()
            for stream in streams:
                stream.result(timeout=60)
        assert num_replicas == 2
    finally:
        serve.delete("scaling")
