"""The serving engine end to end on tiny models: batched, chunked, preempted and prefix-cached
runs give what one request at a time gives."""

from __future__ import annotations

import dataclasses

import math

import pytest
import torch

from fastdraft.generator import TextGenerator
from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.engine.loader import load_model
from fastdraft.layers.kv_cache import PagedKVCache
from fastdraft.layers.sampler import apply_penalties
from fastdraft.llm import LLM
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.quantizer import quantize_model
from fastdraft.sampling_params import SamplingParams
from fastdraft.speculative.speculative_config import SpeculativeConfig
from tests.helpers import paged_batch

PROMPTS = ["def add(a, b):", "class Model:\n    def __init__(self):", "import os\n", "x = 1\ny = 2\n" * 6,
           "for i in range(10):\n    print(i)\n", "return"]


def single_runs(loaded, prompts, params_list):
    generator = TextGenerator(loaded, max_seq_len=512)
    return [generator.generate(p, params).token_ids for p, params in zip(prompts, params_list)]


@pytest.fixture(params=["llama", "qwen2"])
def loaded(request, tiny_models):
    return load_model(tiny_models.dir(request.param), dtype="fp32")


@pytest.mark.parametrize("engine_config", [
    EngineConfig(num_blocks=256, block_size=16),  # everything at once
    EngineConfig(num_blocks=256, block_size=4, max_num_batched_tokens=8),  # chunked prefill
    EngineConfig(num_blocks=24, block_size=4, max_num_batched_tokens=32),  # preemption
], ids=["batched", "chunked", "preempted"])
def test_engine_matches_one_request_at_a_time(loaded, engine_config):
    # Seeded sampling: every request draws from its own generator, so the tokens match the
    # single-request path's only if the engine's logits and draws do.
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    expected = single_runs(loaded, PROMPTS, params)
    engine = LLMEngine(loaded, engine_config)
    outputs = run_to_completion(engine, PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outputs)
    if engine_config.num_blocks == 24:
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine_config.num_blocks  # every block returned


@pytest.mark.parametrize("engine_config", [
    EngineConfig(num_blocks=256, block_size=16),
    EngineConfig(num_blocks=24, block_size=4, max_num_batched_tokens=32),  # preemption
], ids=["batched", "preempted"])
def test_keyed_sampling_draws_what_a_request_draws_alone(loaded, engine_config):
    """The GPU's sampling (a stream keyed by seed and draw index) run on the CPU: a seeded
    request draws the same tokens alone and among others, and after a preemption."""
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]

    def keyed_engine(config: EngineConfig) -> LLMEngine:
        engine = LLMEngine(loaded, config)
        engine.runner.keyed_sampling = True
        return engine

    alone = [run_to_completion(keyed_engine(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=1)), [prompt],
                               [p])[0].outputs[0].token_ids for prompt, p in zip(PROMPTS, params)]
    engine = keyed_engine(engine_config)
    together = [o.outputs[0].token_ids for o in run_to_completion(engine, PROMPTS, params)]
    assert together == alone
    assert not engine.runner._generators  # no generator per request
    # A stream of its own: another seed draws other tokens.
    other = run_to_completion(keyed_engine(engine_config), PROMPTS[:1], [dataclasses.replace(params[0], seed=99)])
    assert other[0].outputs[0].token_ids != alone[0]


def test_llm_generate_of_32_prompts_equals_32_single_runs(tiny_models):
    prompts = [f"def function_{i}(x):\n    return x * {i}" for i in range(32)]
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    sampled = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=i, ignore_eos=True) for i in range(32)]
    llm = LLM(str(tiny_models.dir("qwen2")), dtype="fp32", max_num_seqs=32, kv_cache_memory=0.01)
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    for params in ([greedy] * 32, sampled):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == single_runs(loaded, prompts, params)


def test_shared_prefixes_hit_the_cache_and_change_nothing(loaded):
    prefix = "def function_with_a_long_shared_prefix(argument_one, argument_two):\n    "
    prompts = [prefix + "return 1", prefix + "pass", prefix + "x = 2"]
    params = [SamplingParams(max_new_tokens=6, temperature=0.8, seed=7, ignore_eos=True)] * 3
    expected = single_runs(loaded, prompts, params)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=128, block_size=4, max_num_seqs=1))
    assert [o.outputs[0].token_ids for o in run_to_completion(engine, prompts, params)] == expected
    assert engine.block_manager.num_prefix_hits > 0


@torch.inference_mode()
def test_int4_logits_do_not_depend_on_the_batch(tiny_models):
    """Batch invariance with row-invariant INT4 kernels: a sequence's logits, bit for bit, the
    same alone and in a flat batch with others."""
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    quantize_model(loaded.model, QuantConfig(method="rtn", group_size=32), show_progress=False)
    model, block_size = loaded.model, 4
    seqs = [loaded.tokenizer.encode(p) for p in PROMPTS[:3]]

    def logits_of(batch: list[list[int]]) -> list[torch.Tensor]:
        cache = PagedKVCache.from_config(loaded.config, 64, block_size, dtype=torch.float32)
        requests, next_block = [], 0
        for tokens in batch:
            blocks = list(range(next_block, next_block + -(-len(tokens) // block_size)))
            next_block += len(blocks)
            requests.append((tokens, 0, len(tokens), blocks))
        ids, meta, starts = paged_batch(requests, block_size)
        hidden = model(ids, meta.positions, cache, meta)  # [num_tokens, hidden_size]
        return [model.compute_logits(hidden[s:e]) for s, e in zip(starts, starts[1:])]

    alone = logits_of([seqs[0]])[0]
    together = logits_of(seqs)[0]
    assert torch.equal(alone, together)


def test_llm_generate_batches_and_keeps_prompt_order(tiny_models):
    llm = LLM(str(tiny_models.dir("llama")), dtype="fp32", max_num_seqs=4, kv_cache_memory=0.01)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    loaded = load_model(tiny_models.dir("llama"), dtype="fp32")
    assert [o.outputs[0].token_ids for o in outputs] == single_runs(loaded, PROMPTS, [params] * len(PROMPTS))
    per_prompt = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (1, 2, 3, 4, 5, 6)]
    assert [len(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, per_prompt, use_tqdm=False)] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(PROMPTS, per_prompt[:2], use_tqdm=False)


def _with_eos(loaded, *eos_token_ids):
    """``loaded`` with ``eos_token_ids`` as its end-of-sequence tokens."""
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, eos_token_id=list(eos_token_ids)))


def test_stop_strings_eos_and_abort(tiny_models):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=4))
    sampled = dict(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    free_run = run_to_completion(engine, ["def add(a, b):"], [SamplingParams(**sampled)])[0].outputs[0]
    assert len(free_run.text) > 2
    stop = free_run.text[1:3]
    out = run_to_completion(engine, ["def add(a, b):"], [SamplingParams(**sampled, stop=[stop])])[0].outputs[0]
    assert out.finish_reason == "stop" and stop not in out.text and free_run.text.startswith(out.text)
    # The text ends before the stop string; the tokens, at the one that completed it.
    assert free_run.token_ids[:len(out.token_ids)] == out.token_ids and len(out.token_ids) < len(free_run.token_ids)
    first = free_run.token_ids[0]
    eos_engine = LLMEngine(_with_eos(loaded, first), EngineConfig(num_blocks=64, block_size=4))
    out = run_to_completion(eos_engine, ["def add(a, b):"],
                            [SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)])[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [first] and out.text == ""
    request_id = engine.add_request("def add(a, b):", SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.abort_request(request_id) and not engine.abort_request(request_id)
    assert not engine.has_unfinished_requests
    assert engine.block_manager.num_free_blocks == 64


def test_streams_read_in_turn_see_every_output(tiny_models):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=4))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 6)]
    ids = engine.add_request("def add(a, b):", params[0]), engine.add_request("import os", params[1])
    a, b = engine.outputs(ids[0]), engine.outputs(ids[1])
    pieces_a, pieces_b = [next(a)], [next(b)]
    pieces_a += list(a)
    pieces_b += list(b)
    assert [len(d.new_token_ids) for d in pieces_a] == [1, 1, 1] and pieces_a[-1].is_finished
    assert [len(d.new_token_ids) for d in pieces_b] == [1] * 6 and pieces_b[-1].is_finished
    assert [d.is_finished for d in pieces_b] == [False] * 5 + [True]
    assert not engine.has_unfinished_requests


def test_a_refused_batch_leaves_nothing_queued(tiny_models):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=4, max_model_len=64))
    with pytest.raises(ValueError, match="maximum model length"):
        run_to_completion(engine, ["ok", "x " * 80], [SamplingParams(max_new_tokens=4)] * 2)
    assert not engine.has_unfinished_requests
    engine.add_request("x", SamplingParams(max_new_tokens=2), request_id="req-0")
    assert engine.add_request("y", SamplingParams(max_new_tokens=2)) != "req-0"  # generated ids avoid taken ones


def test_bad_requests_are_refused(tiny_models):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=8, block_size=4, max_model_len=64))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="maximum model length"):
        engine.add_request("x", SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([10**9])
    short = SamplingParams(max_new_tokens=4)
    engine.add_request("x", short, request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", short, request_id="a")
    with pytest.raises(ValueError, match="cache blocks"):
        engine.add_request("x " * 20, SamplingParams(max_new_tokens=20))  # more than the 32-slot pool
    with pytest.raises(ValueError):
        EngineConfig(kv_cache_memory=0)
    with pytest.raises(ValueError):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="chunked prefill"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=4096)


def test_penalties_follow_vllms_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, prompt_ids=[0, 1], output_ids=[3, 3, 1], params=params)
    # repetition over prompt and output tokens {0, 1, 3}; presence + frequency * count over {1: 1, 3: 2}
    expected = torch.tensor([2.0 / 2, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2 - 0.5 - 0.5, -2.0])
    assert torch.allclose(out, expected)
    assert apply_penalties(logits, [0], [3], SamplingParams()) is logits  # no penalty: untouched
    for bad in (dict(presence_penalty=3.0), dict(frequency_penalty=-2.5), dict(repetition_penalty=0.0),
                dict(min_tokens=-1), dict(min_tokens=300), dict(logprobs=21)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_engine_extras_min_tokens_and_logprobs_with_and_without_speculation(tiny_models):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, block_size=4))
    sampled = dict(max_new_tokens=8, temperature=1.0, seed=5)
    first = run_to_completion(engine, ["def add(a, b):"], [SamplingParams(**sampled, ignore_eos=True)])[0].outputs[0]
    eos = set(loaded.config.eos_token_ids or []) | {first.token_ids[0]}  # the first token now ends the request...
    eos_engine = LLMEngine(_with_eos(loaded, *eos), EngineConfig(num_blocks=64, block_size=4))
    out = run_to_completion(eos_engine, ["def add(a, b):"], [SamplingParams(**sampled, min_tokens=3)])[0].outputs[0]
    assert len(out.token_ids) >= 3 and first.token_ids[0] not in out.token_ids[:3]  # ...but not before 3
    out = run_to_completion(engine, ["def add(a, b):"], [SamplingParams(max_new_tokens=4, logprobs=3,
                                                                          ignore_eos=True)])[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, (chosen, top) in zip(out.token_ids, out.logprobs):
        assert len(top) == 3 and top[0][0] == token and chosen == pytest.approx(top[0][1])  # greedy: the top one
        assert chosen <= 0 and sum(math.exp(lp) for _, lp in top) <= 1 + 1e-6
    # With speculation on, such a request decodes plainly, with its options.
    speculative = TextGenerator(loaded, max_seq_len=64, speculative=SpeculativeConfig(draft="ngram"))
    penalised = SamplingParams(max_new_tokens=6, presence_penalty=1.0, ignore_eos=True)
    out = speculative.generate("x x x x", penalised)
    assert out.token_ids == TextGenerator(loaded, max_seq_len=64).generate("x x x x", penalised).token_ids
    assert out.metrics.spec is None


def test_block_sizes_that_are_not_powers_of_two_run_the_module_path(tiny_models):
    from fastdraft.kernels.build import load_cpu_kernels

    loaded = load_model(tiny_models.dir("qwen2"), dtype="bf16")
    quantize_model(loaded.model, QuantConfig(method="rtn", group_size=32), show_progress=False)
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 3
    outputs = {}
    for block_size in (4, 6):
        engine = LLMEngine(loaded, EngineConfig(num_blocks=128, block_size=block_size))
        # The C++ decoder needs the x86 kernels; without them every block size runs the modules.
        has_decoder = block_size == 4 and load_cpu_kernels() is not None
        assert (engine.runner.decoder is not None) == has_decoder
        outputs[block_size] = [o.outputs[0].token_ids for o in run_to_completion(engine, PROMPTS[:3], params)]
    # PyTorch's attention rounds otherwise than the C++ kernel's: the same lengths, not the same bits.
    assert [len(t) for t in outputs[6]] == [len(t) for t in outputs[4]] == [6, 6, 6]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
