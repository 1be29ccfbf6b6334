"""Token-level generation and the streaming TextGenerator on a tiny random model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastdraft.generator import TextGenerator
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.sampling_params import SamplingParams
from tests.helpers import append_pass

PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def generator(tiny_loaded) -> TextGenerator:
    return TextGenerator(tiny_loaded, max_seq_len=128)


def _ids(generator: TextGenerator, params: SamplingParams, prompt: str = PROMPT) -> list[int]:
    return generator.generate(prompt, params).token_ids


@torch.inference_mode()
def _greedy_module_path(loaded, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding through the model's module path (no C++ step, no engine) in a cache of
    its own: append the prompt, take the argmax of the last row, append it, repeat."""
    model = loaded.model
    cache = SequenceCache.from_config(loaded.config, len(prompt_ids) + max_new_tokens, dtype=model.dtype)
    new_ids, out = prompt_ids, []
    for _ in range(max_new_tokens):
        logits = append_pass(model, cache, new_ids, logit_rows=[len(new_ids) - 1])  # [1, vocab]
        out.append(int(logits.argmax(dim=-1)))
        new_ids = out[-1:]
    return out


def test_greedy_matches_transformers_generate(tiny_models, tiny_loaded, generator):
    hf = tiny_models.hf("llama")
    prompt_ids = tiny_loaded.tokenizer.encode(PROMPT)
    ours = _ids(generator, SamplingParams(max_new_tokens=40, ignore_eos=True))
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=40,
                          eos_token_id=None, pad_token_id=0)
    assert ours == out[0, len(prompt_ids):].tolist()
    assert _greedy_module_path(tiny_loaded, prompt_ids, 40) == ours
    assert len(set(ours)) > 3  # not a degenerate constant stream


def test_seeded_sampling_reproducible(generator):
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    a, b = _ids(generator, params), _ids(generator, params)
    c = _ids(generator, dataclasses.replace(params, seed=8))
    assert a == b and a != c
    greedy = _ids(generator, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert a != greedy


def test_top_k_one_equals_greedy(generator):
    sampled = _ids(generator, SamplingParams(max_new_tokens=16, temperature=0.8, top_k=1, seed=3,
                                             ignore_eos=True))
    assert sampled == _ids(generator, SamplingParams(max_new_tokens=16, ignore_eos=True))


def test_stream_text_tokens_and_metrics(generator):
    # Sampling from a random model over a byte-level vocabulary produces broken UTF-8 too.
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=0, ignore_eos=True)
    stream = generator.stream(PROMPT, params)
    pieces = list(stream)
    assert "".join(pieces) == stream.text
    assert len(stream.token_ids) == 30
    full = generator.tokenizer.decode(stream.token_ids)
    # Everything is streamed except, at most, an incomplete UTF-8 character at the very end.
    assert full.startswith(stream.text)
    assert set(full[len(stream.text):]) <= {"\ufffd"}
    m = stream.metrics
    assert m.num_generated_tokens == 30 and m.finish_reason == "length"
    assert m.num_prompt_tokens == len(generator.tokenizer.encode(PROMPT))
    assert m.ttft_s > 0 and len(m.token_latencies_s) == 29 and m.tpot_s > 0
    assert m.decode_tokens_per_s > 0 and m.prefill_tokens_per_s > 0
    assert "finish: length" in m.summary()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_string_cuts_generated_text(generator, temperature):
    params = SamplingParams(max_new_tokens=48, temperature=temperature, seed=11, ignore_eos=True)
    full = generator.generate(PROMPT, params)
    text = full.text
    assert len(text) > 20
    # A stop string taken from the second half of the unconstrained output.
    start = next(i for i in range(len(text) // 2, len(text) - 3)
                 if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip())
    stop = text[start:start + 3]
    expected = text[:text.find(stop)]
    stopped = generator.generate(PROMPT, dataclasses.replace(params, stop=[stop]))
    assert stopped.text == expected
    assert stop not in stopped.text
    assert stopped.metrics.finish_reason == "stop"
    assert len(stopped.token_ids) < len(full.token_ids)
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)]
    # Streaming gives the same: the pieces join to the cut text.
    assert "".join(generator.stream(PROMPT, dataclasses.replace(params, stop=[stop]))) == expected


def test_unmatched_stop_string_changes_nothing(generator):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    full = generator.generate(PROMPT, params)
    absent = "\x00never\x00"
    with_stop = generator.generate(PROMPT, dataclasses.replace(params, stop=[absent]))
    assert with_stop.text == full.text and with_stop.metrics.finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_token_ends_generation(tiny_loaded, temperature):
    # Sampled too: a seeded stream cut at EOS is the same stream up to it.
    params = SamplingParams(max_new_tokens=30, temperature=temperature, seed=4, ignore_eos=True)
    full = TextGenerator(tiny_loaded, max_seq_len=128).generate(PROMPT, params)
    # Pretend the 6th generated token is the model's EOS (first occurrence).
    eos = full.token_ids[5]
    cut = full.token_ids.index(eos)
    config = dataclasses.replace(tiny_loaded.config, eos_token_id=[eos])
    gen = TextGenerator(dataclasses.replace(tiny_loaded, config=config), max_seq_len=128)
    out = gen.generate(PROMPT, dataclasses.replace(params, ignore_eos=False))
    assert out.token_ids == full.token_ids[:cut + 1]  # the EOS id is included ...
    assert out.metrics.finish_reason == "stop" and out.metrics.num_generated_tokens == cut + 1
    assert out.text == gen.tokenizer.decode(full.token_ids[:cut])  # ... but not its text
    # Nothing runs after the EOS: the request is done and its blocks are back in the pool.
    assert not gen.engine.has_unfinished_requests and gen.engine.block_manager.usage == 0
    ignored = gen.generate(PROMPT, params)
    assert ignored.token_ids == full.token_ids


def test_chat_prompt_uses_template(generator):
    expected = generator.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                          add_special_tokens=False)
    assert generator.encode_prompt("hi", chat=True) == expected
    assert generator.encode_prompt([{"role": "user", "content": "hi"}]) == expected
    out = generator.generate("hi", SamplingParams(max_new_tokens=5, ignore_eos=True), chat=True)
    assert out.metrics.num_prompt_tokens == len(expected)


def test_request_too_long_raises_at_stream(generator):
    with pytest.raises(ValueError, match="exceeds"):
        generator.stream(PROMPT, SamplingParams(max_new_tokens=200))
    with pytest.raises(ValueError, match="empty"):
        generator.stream("", SamplingParams(max_new_tokens=2))


def test_generation_can_fill_the_cache_exactly(tiny_loaded, generator):
    prompt = tiny_loaded.tokenizer.encode(PROMPT)
    exact = TextGenerator(tiny_loaded, max_seq_len=len(prompt) + 10)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    out = exact.generate(prompt, params).token_ids
    # The last token fits exactly, and is the one a roomier engine gives.
    assert out == generator.generate(prompt, params).token_ids and len(out) == 10
    with pytest.raises(ValueError, match="exceeds"):  # one more does not fit, refused before any work
        exact.stream(prompt, dataclasses.replace(params, max_new_tokens=11))
    assert not exact.engine.has_unfinished_requests


def test_generator_runs_plain_requests_through_the_engine(generator, tiny_loaded):
    engine = generator.engine
    ptr = engine.kv_cache.k.data_ptr()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    a = generator.generate(PROMPT, params)
    b = generator.generate("the cat", params)
    c = generator.generate(PROMPT, params)
    assert engine.kv_cache.k.data_ptr() == ptr
    assert a.token_ids == c.token_ids and a.token_ids != b.token_ids
    # The module path, without the engine or the C++ step, decodes the same greedy tokens.
    assert a.token_ids == _greedy_module_path(tiny_loaded, tiny_loaded.tokenizer.encode(PROMPT), 8)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # What only the engine serves, such as penalties.
    penalized = generator.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                          repetition_penalty=1.5))
    assert len(penalized.token_ids) == 8


def test_a_new_stream_waits_for_an_open_one_and_each_aborts_only_itself(generator):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    expected_first = generator.generate("the cat", params).token_ids
    expected = generator.generate(PROMPT, params).token_ids
    engine = generator.engine
    first = generator.stream("the cat", params)
    pieces = iter(first)
    next(pieces)  # started, and still open
    with pytest.raises(ValueError, match="exceeds"):  # a refused request starts nothing, aborts nothing
        generator.stream(PROMPT, SamplingParams(max_new_tokens=200))
    assert engine.has_unfinished_requests
    # The new stream waits for the open one (one sequence at a time) and leaves it whole.
    assert generator.generate(PROMPT, params).token_ids == expected
    assert "".join(pieces) and first.is_finished and first.token_ids == expected_first

    # Leaving an iteration early, closing, or dropping a stream aborts that request only.
    kept = generator.stream(PROMPT, params)
    for _ in generator.stream("the cat", params):
        break
    generator.stream("the cat", params).close()
    dropped = generator.stream("the cat", params)
    del dropped
    # The first stream read ran the queued one to its end first: its output waited for it.
    assert kept.consume().token_ids == expected
    assert not engine.has_unfinished_requests
    assert engine.block_manager.usage == 0
