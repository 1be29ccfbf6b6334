"""Every front door refuses a bad request with the engine's own message: the rules live in
``fastdraft.engine.request.check_request`` and nowhere else."""

from __future__ import annotations

import functools
import time

import pytest
from fastapi.testclient import TestClient

from fastdraft.cli import main
from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
from fastdraft.engine.loader import load_model
from fastdraft.generator import TextGenerator
from fastdraft.llm import LLM
from fastdraft.sampling_params import SamplingParams
from fastdraft.server.app import ServerConfig, build_fastapi_app

MAX_MODEL_LEN = 64

# (prompt, max_tokens): each breaks one rule.
BAD_REQUESTS = {
    "empty": ("", 4),
    "too long": ("def add(a, b):", 100),
}


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(load_model(model_dir, dtype="fp32"), EngineConfig(num_blocks=64, block_size=4,
                                                                       max_model_len=MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models.dir("qwen2")


def _message(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def _http_message(client: TestClient, prompt: str, max_tokens: int) -> str:
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens})
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


def _cli_message(capsys, model_dir, prompt: str, max_tokens: int) -> str:
    code = main(["generate", "--model", str(model_dir), "--dtype", "fp32", "--prompt", prompt,
                 "--max-tokens", str(max_tokens), "--max-seq-len", str(MAX_MODEL_LEN)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, (out, err)
    return err.removeprefix("fastdraft: error: ").rstrip("\n")


def test_every_front_door_refuses_alike(model_dir, capsys):
    engine = _engine(model_dir)
    llm = LLM(str(model_dir), dtype="fp32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=0.01)
    generator = TextGenerator(engine.loaded, max_seq_len=MAX_MODEL_LEN)
    app = build_fastapi_app(functools.partial(_engine, model_dir), ServerConfig(served_model_name="tiny"))
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not load"
            time.sleep(0.1)
        for name, (prompt, max_tokens) in BAD_REQUESTS.items():
            params = SamplingParams(max_new_tokens=max_tokens)
            messages = {
                "engine": _message(lambda: engine.add_request(prompt, params)),
                "LLM": _message(lambda: llm.generate(prompt, params, use_tqdm=False)),
                "TextGenerator": _message(lambda: generator.stream(prompt, params)),
                "HTTP": _http_message(client, prompt, max_tokens),
                "CLI": _cli_message(capsys, model_dir, prompt, max_tokens),
            }
            assert len(set(messages.values())) == 1, (name, messages)
    # Refused requests leave nothing behind.
    for e in (engine, llm.engine, generator.engine):
        assert not e.has_unfinished_requests and e.block_manager.usage == 0


def test_token_ids_and_logit_bias_are_checked_against_the_vocabulary(model_dir):
    engine = _engine(model_dir)
    vocab_size = engine.vocab_size
    generator = TextGenerator(engine.loaded, max_seq_len=MAX_MODEL_LEN)
    bad_ids = [[1, vocab_size], SamplingParams(max_new_tokens=2)]
    bad_bias = [[1, 2], SamplingParams(max_new_tokens=2, logit_bias={vocab_size: 1.0})]
    for prompt, params in (bad_ids, bad_bias):
        expected = _message(lambda: engine.add_request(prompt, params))
        assert "vocabulary" in expected
        assert _message(lambda: generator.stream(prompt, params)) == expected
