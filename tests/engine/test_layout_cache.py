"""The layout cache (``engine/layout_cache.py``): a GGUF model converted once, mapped afterwards;
a broken entry is rebuilt, never used."""

from __future__ import annotations

import logging

import pytest
import torch

import fastdraft.engine.loader as loader
from fastdraft.engine.layout_cache import layout_dir
from fastdraft.engine.loader import load_model
from tests.quant.test_gguf_native import prompt_logits, quantized_gguf  # noqa: F401 (a fixture)

IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 8, 61]])


def _is_mapped_from(address: int, path) -> bool:
    """Whether ``address`` lies in a mapping of the file ``path`` (``/proc/self/maps``)."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path.resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return True
    return False


def _no_conversion(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was converted again")

    monkeypatch.setattr(loader, "apply_gguf_native", refuse)


@torch.inference_mode()
def test_a_cached_layout_gives_the_fresh_conversions_logits(quantized_gguf, monkeypatch):
    fresh = load_model(quantized_gguf, dtype="fp32")
    entry = layout_dir(quantized_gguf, torch.float32)
    assert (entry / "manifest.json").is_file()
    _no_conversion(monkeypatch)
    cached = load_model(quantized_gguf, dtype="fp32")
    assert cached.model.quant_config == fresh.model.quant_config
    assert torch.equal(prompt_logits(cached.model, IDS), prompt_logits(fresh.model, IDS))
    # Its weights are views of the cache file, not copies.
    qweight = cached.model.model.layers[0].self_attn.q_proj.qweight
    assert _is_mapped_from(qweight.data_ptr(), entry / "model.safetensors")
    assert not _is_mapped_from(fresh.model.model.layers[0].self_attn.q_proj.qweight.data_ptr(),
                               entry / "model.safetensors")
    # The kernels run their own layout mapped from the cache too, gate/up (one format here) as
    # rows of one fused weight; the repacked copy of the fresh model lives in memory.
    (kernels_file,) = entry.glob("kernels-*.safetensors")
    layer, cpu = cached.model.model.layers[0], torch.device("cpu")
    kernels = [layer.get_submodule(name).built_kernel(torch.float32, cpu)
               for name in ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj")]
    assert all(kernel is not None and _is_mapped_from(kernel.weight.packed.data_ptr(), kernels_file) for kernel in kernels)
    assert kernels[1].parent[0] is kernels[2].parent[0]
    fresh_kernel = fresh.model.model.layers[0].self_attn.q_proj.built_kernel(torch.float32, torch.device("cpu"))
    assert not _is_mapped_from(fresh_kernel.weight.packed.data_ptr(), kernels_file)
    # Another dtype is another entry.
    assert layout_dir(quantized_gguf, torch.bfloat16) != entry


def _truncate(path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _edit(path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a weight's byte, the size unchanged
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _edit, lambda path: (path.parent / "manifest.json").unlink()],
                         ids=["truncated", "edited", "no manifest"])
@torch.inference_mode()
@pytest.mark.parametrize("file_name", ["model.safetensors", "kernels-*.safetensors"])
def test_a_broken_entry_is_rebuilt_not_used(quantized_gguf, damage, file_name, caplog):
    want = prompt_logits(load_model(quantized_gguf, dtype="fp32").model, IDS)
    (weights,) = layout_dir(quantized_gguf, torch.float32).glob(file_name)
    damage(weights)
    with caplog.at_level(logging.WARNING, logger="fastdraft.engine.layout_cache"):
        rebuilt = load_model(quantized_gguf, dtype="fp32")
    assert "rebuilding it" in caplog.text
    assert torch.equal(prompt_logits(rebuilt.model, IDS), want)
    assert (weights.parent / "manifest.json").is_file()  # written again, and good
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastdraft.engine.layout_cache"):
        load_model(quantized_gguf, dtype="fp32")
    assert "rebuilding" not in caplog.text
