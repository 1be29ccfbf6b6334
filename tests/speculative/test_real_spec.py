"""Speculative decoding on the real Qwen2.5-Coder pair: greedy output equals plain greedy."""

import gc

import pytest

from fastdraft.generator import TextGenerator
from fastdraft.engine.loader import load_model
from fastdraft.sampling_params import SamplingParams
from fastdraft.speculative.speculative_config import SpeculativeConfig

pytestmark = pytest.mark.real_model

TARGET = "qwen2.5-coder-1.5b-instruct"
PROMPTS = [
    "def quicksort(arr):\n",
    "import os\n\ndef walk_files(root):\n    \"\"\"Yield every file path under root.\"\"\"\n",
    [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
]


def _outputs(generator: TextGenerator, params: SamplingParams) -> list[list[int]]:
    return [generator.generate(p, params, chat=isinstance(p, list)).token_ids for p in PROMPTS]


def test_self_speculative_bf16_equals_plain_greedy(real_model_dir):
    loaded = load_model(real_model_dir, dtype="bf16")
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = _outputs(TextGenerator(loaded, max_seq_len=512), params)
    spec_gen = TextGenerator(loaded, max_seq_len=512, speculative=SpeculativeConfig(draft="self"))
    assert _outputs(spec_gen, params) == plain
    # The self draft of the same model is accepted most of the time.
    metrics = spec_gen.generate(PROMPTS[0], params).metrics.spec
    assert metrics.acceptance_rate > 0.6 and metrics.mean_accepted_length > 2


def test_draft_model_pair_equals_plain_greedy(real_model_dir):
    from fastdraft.models.registry import pull

    target = load_model(pull(TARGET), dtype="bf16")
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    plain = _outputs(TextGenerator(target, max_seq_len=512), params)
    config = SpeculativeConfig(draft=str(real_model_dir), num_speculative_tokens=4, is_adaptive=False)
    spec_gen = TextGenerator(target, max_seq_len=512, speculative=config)
    assert _outputs(spec_gen, params) == plain
    assert spec_gen.generate(PROMPTS[0], params).metrics.spec.acceptance_rate > 0.3
    del target, spec_gen
    gc.collect()


def test_vocab_check_accepts_the_pair(real_model_dir):
    """The two Qwen models share a byte-identical tokenizer: no mismatch error."""
    from fastdraft.models.registry import pull
    from fastdraft.speculative.factory import check_vocab_compatible

    small = load_model(real_model_dir, dtype="bf16")
    check_vocab_compatible(small, small)
    big_tokenizer_dir = pull(TARGET)
    assert (big_tokenizer_dir / "tokenizer.json").read_bytes() == (real_model_dir / "tokenizer.json").read_bytes()


def test_every_proposer_under_batching_equals_plain_greedy(real_model_dir):
    """Four requests at once through the engine, per proposer, on the real models: the same
    tokens as plain batched greedy decoding."""
    from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
    from fastdraft.models.registry import pull
    from fastdraft.speculative.factory import speculator_factory

    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    small = load_model(real_model_dir, dtype="bf16")
    prompts = [small.tokenizer.encode(p) for p in PROMPTS[:2]] * 2
    prompts[2] = prompts[2] + prompts[0]  # a repeat, for prompt lookup
    config = EngineConfig(max_num_seqs=4, max_model_len=512, kv_cache_memory=0.5)

    def outputs(loaded, speculation=None):
        factory = None if speculation is None else speculator_factory(speculation)
        engine = LLMEngine(loaded, config, speculation=factory)
        outs = run_to_completion(engine, prompts, [params] * len(prompts))
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return [o.outputs[0].token_ids for o in outs], outs

    plain, _ = outputs(small)
    for draft in ("self", "ngram"):
        got, outs = outputs(small, SpeculativeConfig(draft=draft, is_adaptive=False))
        assert got == plain, draft
        assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 0, draft
    del small
    gc.collect()
    target = load_model(pull(TARGET), dtype="bf16", load_in_low_bit="sym_int4")
    plain, _ = outputs(target)
    got, outs = outputs(target, SpeculativeConfig(draft=str(real_model_dir), is_adaptive=False))
    assert got == plain
    assert sum(o.metrics.spec.num_accepted_tokens for o in outs) > 0
