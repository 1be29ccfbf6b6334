"""Speculative decoding with a CUDA target: a CPU draft beside it, or a draft on the GPU too
(skipped without a GPU)."""

import pytest
import torch

from fastdraft.engine.generate import TextGenerator
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.models.loader import load_model
from fastdraft.spec.config import SpeculativeConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("draft", ["self", "model"])
def test_cpu_draft_for_cuda_target_keeps_greedy_output(tiny_models, draft):
    target = load_model(tiny_models.dir("qwen2"), dtype="fp32", device="cuda")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = TextGenerator(target, max_seq_len=128).generate("def f(x):\n", params).token_ids
    config = SpeculativeConfig(draft="self" if draft == "self" else str(tiny_models.dir("llama")),
                               draft_device="cpu", draft_low_bit=None if draft == "model" else "sym_int4")
    generator = TextGenerator(target, max_seq_len=128, speculative=config)
    assert generator.proposer.model.device.type == "cpu"
    assert not generator.proposer.shares_target_cache  # a cache on another device cannot be shared
    out = generator.generate("def f(x):\n", params)
    assert out.token_ids == plain and out.metrics.spec.num_steps > 0
    sampled = generator.generate("def f(x):\n", SamplingParams(max_new_tokens=16, temperature=0.8, seed=1))
    assert len(sampled.token_ids) <= 16


@pytest.mark.parametrize("draft", ["self", "model"])
def test_cuda_draft_for_cuda_target_keeps_greedy_output(tiny_models, draft):
    target = load_model(tiny_models.dir("qwen2"), dtype="fp32", device="cuda")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = TextGenerator(target, max_seq_len=128).generate("def f(x):\n", params).token_ids
    config = SpeculativeConfig(draft="self" if draft == "self" else str(tiny_models.dir("llama")),
                               draft_low_bit=None if draft == "model" else "sym_int4")
    generator = TextGenerator(target, max_seq_len=128, speculative=config)
    assert generator.proposer.model.device.type == "cuda"
    out = generator.generate("def f(x):\n", params)
    assert out.token_ids == plain and out.metrics.spec.num_steps > 0
    seeded = SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    assert generator.generate("def f(x):\n", seeded).token_ids == generator.generate("def f(x):\n", seeded).token_ids
