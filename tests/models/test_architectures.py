"""The architectures beyond Llama and Qwen2 (Qwen3, Mistral) and every rotary scaling kind:
logits against ``transformers``' own model, saved as an HF folder with random weights, through
the module path and the C++ step, one sequence and a batch of two."""

from __future__ import annotations

import pytest
import torch

from fastdraft.engine.loader import load_model
from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.layers.kv_cache import PagedKVCache
from fastdraft.models.plan import decoder_plan
from tests.helpers import ROPE_SCALING_VARIANTS, paged_batch

NUM_TOKENS = 200
ATOL = 1e-3
ARCHITECTURES = ("qwen3", "mistral", "mistral_nemo", *ROPE_SCALING_VARIANTS)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request, tiny_models):
    """(variant, our fp32 model, the HF reference, two token sequences)."""
    variant = request.param
    loaded = load_model(tiny_models.dir(variant), dtype="fp32")
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, loaded.config.vocab_size, (n,), generator=gen) for n in (NUM_TOKENS, 77)]
    return variant, loaded, tiny_models.hf(variant), seqs


def test_each_plan_has_its_features(arch):
    variant, loaded, _, _ = arch
    features = decoder_plan(loaded.config).features()
    expected = {"qwen3": {"qk_norm"}, "mistral": {"sliding_window"}}.get(variant, set())
    assert features == expected
    if variant.startswith("rope_"):
        assert loaded.config.rope_scaling["rope_type"] == ROPE_SCALING_VARIANTS[variant]["rope_type"]


def _logits(loaded, seqs: list[torch.Tensor], executor: str) -> list[torch.Tensor]:
    """Every token's fp32 logits of ``seqs``, prefilled together in one step."""
    model = loaded.model
    decoder = None
    if executor == "cpp":
        if load_cpu_kernels() is None:
            pytest.skip("no C++ kernels on this machine")
        decoder = model.fused_decoder()
        assert decoder is not None, "the C++ step refused the plan"
    block_size = 16
    num_blocks = sum(-(-len(s) // block_size) for s in seqs)
    cache = PagedKVCache.from_config(loaded.config, num_blocks, block_size, dtype=torch.float32)
    requests, first = [], 0
    for s in seqs:
        count = -(-len(s) // block_size)
        requests.append((s.tolist(), 0, len(s), list(range(first, first + count))))
        first += count
    ids, meta, starts = paged_batch(requests, block_size)
    with torch.inference_mode():
        logits = model.logits(ids, meta.positions, cache, meta, list(range(len(ids))), decoder)
    return [logits[a:b] for a, b in zip(starts, starts[1:])]


def test_logits_match_transformers_on_the_module_path(arch):
    _check_logits(arch, "module")


@pytest.mark.usefixtures("each_isa")
def test_logits_match_transformers_on_the_cpp_step(arch):
    _check_logits(arch, "cpp")


def _check_logits(arch, executor: str) -> None:
    variant, loaded, hf, seqs = arch
    with torch.no_grad():
        want = [hf(s[None]).logits[0] for s in seqs]
    assert want[0].abs().max() > 0.5  # real signal
    (got,) = _logits(loaded, seqs[:1], executor)
    torch.testing.assert_close(got, want[0], atol=ATOL, rtol=0)
    if variant == "rope_dynamic":
        return  # its frequencies follow the longest sequence of a step, as in HF's batches
    both = _logits(loaded, seqs, executor)
    for got, ref in zip(both, want):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
