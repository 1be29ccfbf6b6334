"""Whole-model results on every instruction-set variant this CPU runs: a weight-only model's
logits from the C++ step against the PyTorch reference (the same weights dequantized, float
activations), and batch invariance within the variant."""

from __future__ import annotations

import pytest
import torch

from fastdraft.engine.loader import load_model
from fastdraft.kernels.build import clear_caches, load_cpu_kernels
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.quantizer import quantize_model
from tests.engine.test_batch_invariance import check_invariance
from tests.helpers import append_pass

pytestmark = [pytest.mark.skipif(load_cpu_kernels() is None, reason="x86 kernels unavailable on this CPU"),
              pytest.mark.usefixtures("each_isa")]

# Every linear weight-only, the head included, so no dense kernel enters the comparison.
WEIGHT_ONLY = QuantConfig(method="rtn", group_size=32, sym=True, lm_head_bits=8)


def _logits(tiny_models, dtype: str) -> tuple[torch.Tensor, bool]:
    """fp32 logits of a 24-token prompt and 3 decode steps; whether the C++ step ran them."""
    model = load_model(tiny_models.dir("qwen2"), dtype=dtype).model
    quantize_model(model, WEIGHT_ONLY, show_progress=False)
    decoder = model.fused_decoder()
    gen = torch.Generator().manual_seed(0)
    cache = SequenceCache.from_config(model.config, 64, dtype=model.dtype)
    out = []
    with torch.inference_mode():
        prompt = torch.randint(0, model.config.vocab_size, (24,), generator=gen)
        out.append(append_pass(model, cache, prompt, decoder, logit_rows=list(range(24))))
        for _ in range(3):
            out.append(append_pass(model, cache, out[-1][-1:].argmax(-1), decoder, logit_rows=[0]))
    return torch.cat(out), decoder is not None


@pytest.mark.parametrize("dtype, rel", [("fp32", 0.02), ("bf16", 0.03)])
def test_weight_only_logits_match_the_pytorch_reference(tiny_models, monkeypatch, dtype, rel):
    logits, is_cpp = _logits(tiny_models, dtype)
    assert is_cpp
    monkeypatch.setenv("FASTDRAFT_DISABLE_CPU_KERNELS", "1")
    clear_caches()
    try:
        reference, is_cpp = _logits(tiny_models, dtype)
    finally:
        monkeypatch.delenv("FASTDRAFT_DISABLE_CPU_KERNELS")
        clear_caches()
    assert not is_cpp
    # int8 activations (per block of 32) against float ones: a small relative error, and the
    # same next token nearly everywhere.
    error = (logits - reference).norm() / reference.norm()
    assert error < rel, f"relative error {error:.4f}"
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_weight_only_logits_do_not_depend_on_the_batch(tiny_models):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="bf16")
    quantize_model(loaded.model, WEIGHT_ONLY, show_progress=False)
    check_invariance(loaded, loaded.config.vocab_size)
