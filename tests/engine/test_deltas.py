"""The engine hands out deltas: a step's output for a request does not grow with the request,
and per-step bookkeeping (the token list, the prefix-cache keys) does only the step's work."""

from __future__ import annotations

import pickle

import pytest

from fastdraft.engine import block_manager
from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.engine.output import RequestCollector
from fastdraft.engine.sequence import Sequence
from fastdraft.llm import LLM
from fastdraft.sampling_params import SamplingParams


def test_a_steps_output_is_the_same_size_at_step_1_and_step_200(qwen2_loaded):
    engine = LLMEngine(qwen2_loaded, EngineConfig(num_blocks=128, block_size=16, max_model_len=512))
    params = SamplingParams(max_new_tokens=220, ignore_eos=True, logprobs=2, temperature=0.0)
    request_id = engine.add_request("def add(a, b):", params)
    collector = engine.collector(request_id)
    sizes = []
    for delta in engine.outputs(request_id):
        assert len(delta.new_token_ids) == 1 and len(delta.new_logprobs) == 1
        # Same field values but the request's position: the pickled size may differ only by
        # the digits of numbers, never by the request's history.
        delta.new_text = "x"
        sizes.append(len(pickle.dumps(delta)))
        collector.add(delta)
    assert len(sizes) == 220
    assert max(sizes[:200]) - min(sizes[:200]) <= 16, sizes
    assert sizes[199] <= sizes[0] + 16
    # The consumer assembles the whole: every token, every log-probability, every gap.
    assert len(collector.token_ids) == 220 and len(collector.logprobs) == 220
    assert len(collector.metrics.token_latencies_s) == 219 and collector.finish_reason == "length"


def test_the_collector_assembles_what_run_to_completion_returns(qwen2_loaded):
    engine = LLMEngine(qwen2_loaded, EngineConfig(num_blocks=64, block_size=4))
    params = SamplingParams(max_new_tokens=9, temperature=1.0, seed=11, ignore_eos=True)
    expected = run_to_completion(engine, ["import os"], [params])[0]
    request_id = engine.add_request("import os", params)
    collector = RequestCollector(request_id, engine.collector(request_id).prompt_token_ids, "import os")
    deltas = list(engine.outputs(request_id))
    for delta in deltas:
        collector.add(delta)
    assert [d.is_finished for d in deltas] == [False] * 8 + [True]
    assert collector.output().outputs == expected.outputs
    assert collector.text == "".join(d.new_text for d in deltas)
    assert collector.output().prompt_token_ids == expected.prompt_token_ids


def test_a_sequence_keeps_one_token_list():
    seq = Sequence([1, 2, 3])
    tokens = seq.token_ids
    seq.append_token(4)
    assert seq.token_ids is tokens and tokens == [1, 2, 3, 4]  # not rebuilt from prompt + output
    assert (seq.prompt_token_ids, seq.output_token_ids, seq.num_output_tokens) == ([1, 2, 3], [4], 1)
    seq.truncate_output(0)
    assert seq.token_ids == [1, 2, 3]


def test_commit_hashes_only_the_blocks_a_step_filled(monkeypatch):
    hashed = []
    real_hash = block_manager.block_hash

    def counting_hash(prev, token_ids):
        hashed.append(tuple(token_ids))
        return real_hash(prev, token_ids)

    monkeypatch.setattr(block_manager, "block_hash", counting_hash)
    bm = BlockManager(64, 4)
    seq = Sequence(list(range(1, 11)))  # 10 tokens: 2 full blocks
    bm.allocate(seq, 10)
    hashed.clear()  # the prefix-cache lookup on admission
    seq.num_computed_tokens = 10
    bm.commit(seq)
    assert hashed == [(1, 2, 3, 4), (5, 6, 7, 8)]
    for token in range(11, 31):  # decode 20 tokens, committing after each
        seq.append_token(token)
        assert bm.append_slots(seq, 1)
        seq.num_computed_tokens += 1
        bm.commit(seq)
    # Each block was hashed once, when it filled: 30 computed tokens, 7 full blocks.
    assert len(hashed) == 7 and len(set(hashed)) == 7
    # The keys chain as before: a new sequence with the same prefix finds every full block.
    other = Sequence(list(range(1, 31)) + [99])
    assert len(bm.cached_prefix_blocks(other)) == 7


def test_llm_runs_a_loaded_model_on_token_ids_without_text(qwen2_loaded, tiny_models):
    llm = LLM(qwen2_loaded, max_model_len=64, kv_cache_memory=0.01)
    by_name = LLM(str(tiny_models.dir("qwen2")), dtype="fp32", max_model_len=64, kv_cache_memory=0.01)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, detokenize=False)
    out = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    expected = by_name.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in expected]
    assert all(len(o.outputs[0].token_ids) == 5 and o.outputs[0].text == "" for o in out)
    assert out[0].prompt_token_ids == [5, 6, 7] and out[0].prompt is None
    with_text = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert with_text.outputs[0].token_ids == out[0].outputs[0].token_ids
    # The streamed text holds back a trailing partial UTF-8 character; the rest is the decoding.
    text = with_text.outputs[0].text
    assert text and qwen2_loaded.tokenizer.decode(out[0].outputs[0].token_ids).startswith(text)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="token-id lists"):
        llm.generate([[1, "a"]], params)
