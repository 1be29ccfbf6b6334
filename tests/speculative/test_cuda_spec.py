"""Speculative decoding with a CUDA target: a draft on the CPU beside it, or on the GPU too
(skipped without a GPU)."""

import pytest
import torch

from fastdraft.generator import TextGenerator
from fastdraft.engine.loader import load_model
from fastdraft.sampling_params import SamplingParams
from fastdraft.speculative.speculative_config import SpeculativeConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("draft_device", ["cpu", None])
@pytest.mark.parametrize("draft", ["self", "model"])
def test_cuda_target_keeps_greedy_output(tiny_models, draft, draft_device):
    target = load_model(tiny_models.dir("qwen2"), dtype="fp32", device="cuda")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = TextGenerator(target, max_seq_len=128).generate("def f(x):\n", params).token_ids
    config = SpeculativeConfig(draft="self" if draft == "self" else str(tiny_models.dir("llama")),
                               draft_device=draft_device, draft_low_bit=None if draft == "model" else "sym_int4",
                               is_adaptive=False, min_confidence=0.0)
    generator = TextGenerator(target, max_seq_len=128, speculative=config)
    proposer = generator.engine.speculator.proposer
    assert proposer.model.device.type == (draft_device or "cuda")
    if draft_device == "cpu":
        assert not proposer.shares_target_cache  # a cache on another device cannot be shared
    out = generator.generate("def f(x):\n", params)
    assert out.token_ids == plain and out.metrics.spec.num_steps > 0
    seeded = SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    first = generator.generate("def f(x):\n", seeded).token_ids
    assert len(first) == 16 and generator.generate("def f(x):\n", seeded).token_ids == first
