"""INT6 decoder linears: RTN, symmetric, on the same kernels as INT6 heads."""

from __future__ import annotations

import pytest
import torch

from fastdraft.engine.loader import load_model
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.quant.checkpoint import save_quantized
from fastdraft.quant.quant_config import QuantConfig, parse_quant_spec
from fastdraft.quant.quantizer import quantize_model


@torch.inference_mode()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = SequenceCache.from_config(model.config, 64, dtype=torch.float32)
    input_ids, meta = cache.append(ids[0])
    return model.compute_logits(model(input_ids, meta.positions, cache.kv_cache, meta))  # [num_tokens, vocab_size]


def test_int6_linears_sit_between_int4_and_the_dense_model(tiny_models, tmp_path):
    dense = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    ids = torch.tensor([dense.tokenizer.encode("def add(a, b):\n    return a + b\n")])
    reference = _logits(dense.model, ids)
    errors = {}
    for bits in (4, 6):
        loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
        quantize_model(loaded.model, QuantConfig(method="rtn", bits=bits, group_size=32), show_progress=False)
        errors[bits] = (_logits(loaded.model, ids) - reference).abs().mean().item()
        if bits == 6:
            assert loaded.model.model.layers[0].mlp.up_proj.bits == 6
            saved = save_quantized(loaded.model, tmp_path / "int6", loaded.model_dir)
            assert torch.equal(_logits(load_model(saved, dtype="fp32").model, ids), _logits(loaded.model, ids))
    assert errors[6] < errors[4] / 2


def test_int6_is_symmetric_and_rtn_only():
    assert parse_quant_spec("method=rtn,bits=6,group_size=64").label == "rtn-int6-g64-sym"
    with pytest.raises(ValueError, match="symmetric"):
        QuantConfig(bits=6, sym=False)
    with pytest.raises(ValueError, match="RTN only"):
        QuantConfig(method="gptq", bits=6)
