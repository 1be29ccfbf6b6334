"""Quantized checkpoints: save/load round trip, on-the-fly low-bit loading, atomic writes."""

import pytest
import torch

from fastdraft.engine.loader import load_model
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.layers.quant_linear import QuantEmbedding, QuantLinear
from fastdraft.quant.checkpoint import save_quantized
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.data import calibration_samples
from fastdraft.quant.quantizer import quantize_model


def _logits(model, ids):
    """Every position's logits of the prompt ``ids`` [1, T], through the module path."""
    cache = SequenceCache.from_config(model.config, ids.shape[1], dtype=model.dtype)
    input_ids, meta = cache.append(ids[0])
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, meta.positions, cache.kv_cache, meta))  # [T, vocab_size]


CONFIGS = [
    QuantConfig(method="rtn", group_size=32, sym=True),
    QuantConfig(method="rtn", group_size=-1, sym=False, embed_bits=8),
    QuantConfig(method="rtn", group_size=32, sym=False, lm_head_bits=4),
    QuantConfig(method="rtn", group_size=64, sym=False, float_zeros=True, lm_head_bits=4),
    QuantConfig(method="rtn", group_size=32, lm_head_bits=6),
    QuantConfig(method="gptq", group_size=32, sym=False, act_order=True, num_calib_samples=4, calib_seq_len=32),
    QuantConfig(method="gptq", group_size=32, sym=False, float_zeros=True, num_calib_samples=4, calib_seq_len=32),
    QuantConfig(method="awq", group_size=64, sym=True, num_calib_samples=4, calib_seq_len=32),
    QuantConfig(method="rtn", bits=8, group_size=-1, lm_head_bits=16),
    QuantConfig(method="gptq", group_size=32, sensitive_bits=8, num_calib_samples=4, calib_seq_len=32),
    QuantConfig(method="gptq", group_size=32, sym=False, float_zeros=True, int8_linears=("v_proj", "o_proj"),
                num_calib_samples=4, calib_seq_len=32),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.label)
@pytest.mark.parametrize("variant", ["qwen2", "llama_tied"])
def test_save_load_gives_identical_logits(tiny_models, tmp_path, config, variant):
    loaded = load_model(tiny_models.dir(variant), dtype="fp32")
    samples = calibration_samples(loaded.tokenizer, config.num_calib_samples, config.calib_seq_len) \
        if config.needs_calibration else None
    model = quantize_model(loaded.model, config, samples, show_progress=False)
    ids = torch.randint(0, loaded.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)

    out = save_quantized(model, tmp_path / "ckpt", loaded.model_dir)
    reloaded = load_model(out, dtype="fp32")
    assert reloaded.model.quant_config == config
    assert isinstance(reloaded.model.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(reloaded.model.model.embed_tokens, QuantEmbedding) == (config.embed_bits == 8)
    assert getattr(reloaded.model.lm_head, "bits", 16) == config.lm_head_bits
    assert torch.equal(_logits(reloaded.model, ids), before)
    # A quantized model really differs from the dense one.
    dense = load_model(tiny_models.dir(variant), dtype="fp32").model
    assert not torch.allclose(_logits(dense, ids), before)


def test_load_in_low_bit(tiny_models):
    path = tiny_models.dir("qwen2")
    for name, bits in (("sym_int4", 4), ("asym_int4", 4), ("int8", 8)):
        model = load_model(path, dtype="fp32", load_in_low_bit=name).model
        layer = model.model.layers[0].self_attn.q_proj
        assert isinstance(layer, QuantLinear) and layer.bits == bits
        assert hasattr(layer, "qzeros") == (name == "asym_int4")
    assert load_model(path, load_in_low_bit="fp32").model.dtype == torch.float32
    assert load_model(path, load_in_low_bit="bf16").model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="load_in_low_bit"):
        load_model(path, load_in_low_bit="int3")


def test_quantizing_twice_is_rejected(tiny_models, tmp_path):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    out = save_quantized(quantize_model(loaded.model, QuantConfig(group_size=32), show_progress=False),
                         tmp_path / "q", loaded.model_dir)
    with pytest.raises(ValueError, match="already quantized"):
        load_model(out, load_in_low_bit="sym_int4")


def test_save_is_atomic(tiny_models, tmp_path, monkeypatch):
    import fastdraft.quant.checkpoint as checkpoint

    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    model = quantize_model(loaded.model, QuantConfig(group_size=32), show_progress=False)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", fail)
    with pytest.raises(OSError):
        save_quantized(model, tmp_path / "ckpt", loaded.model_dir)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temporary folder remains


def test_gptq_needs_calibration(tiny_models):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(loaded.model, QuantConfig(method="gptq"), None)
