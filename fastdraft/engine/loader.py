"""Loading a model for inference: weights, saved or on-the-fly quantization, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from fastdraft.model_config import ModelConfig
from fastdraft.models.files import (LoadedModel, build_model, find_gguf_source, gguf_source, load_state_dict,
                                     parse_device, parse_dtype, resolve_model_dir)
from fastdraft.engine.layout_cache import lay_out_kernels, load_layout, store_layout
from fastdraft.layers.quant_linear import exact_min_rows
from fastdraft.quant.checkpoint import build_quantized_model, quant_config_from_model_config
from fastdraft.quant.quant_config import LOW_BIT_NAMES, QuantConfig
from fastdraft.quant.gguf_native import apply_gguf_native
from fastdraft.quant.quantizer import quantize_model
from fastdraft.tokenizer import Tokenizer


def load_model(model: str | Path, dtype: str | torch.dtype = "bf16", device: torch.device | str = "cpu",
               load_in_low_bit: str | None = None, keep_gguf_quant: bool | None = None) -> LoadedModel:
    """Load ``model`` (a known name, HF folder, quantized checkpoint or .gguf path).

    By default a model whose source is a GGUF file (a known name or a .gguf path) runs on the
    CPU on the file's own quantized blocks (``keep_gguf_quant``), as llama.cpp and ollama run
    it: the fastest weights, at the file's own precision. ``load_in_low_bit`` follows
    ipex-llm: ``"bf16"``/``"fp32"`` ask for the dequantized reference in that dtype;
    ``"sym_int4"``, ``"asym_int4"`` and ``"int8"`` quantize the reference on the fly (RTN,
    groups of 32) with compute in ``dtype``. ``keep_gguf_quant=False`` also asks for the
    reference, in ``dtype``.
    """
    if load_in_low_bit is not None and load_in_low_bit not in LOW_BIT_NAMES:
        raise ValueError(f"unknown load_in_low_bit {load_in_low_bit!r}; choose from {', '.join(LOW_BIT_NAMES)}")
    if keep_gguf_quant and load_in_low_bit not in (None, "bf16", "fp32"):
        raise ValueError("keep_gguf_quant keeps the GGUF's own blocks; it cannot be combined with "
                         f"load_in_low_bit={load_in_low_bit!r}")
    if load_in_low_bit in ("bf16", "fp32"):
        dtype = load_in_low_bit
    torch_dtype = parse_dtype(dtype)
    device = parse_device(device)
    if keep_gguf_quant is None:  # the file's own blocks unless asked otherwise (the CPU's kernels run them)
        gguf_path = find_gguf_source(model) if load_in_low_bit is None and device.type == "cpu" else None
    else:
        gguf_path = gguf_source(model) if keep_gguf_quant else None  # a wrong model fails before loading
    model_dir = resolve_model_dir(model)
    config = with_generation_stops(ModelConfig.from_file(model_dir / "config.json"), model_dir)
    net = _load_weights(config, model_dir, torch_dtype, device, gguf_path, load_in_low_bit)
    return LoadedModel(model=net, tokenizer=Tokenizer(model_dir), config=config, model_dir=model_dir)


def with_generation_stops(config: ModelConfig, model_dir: Path) -> ModelConfig:
    """``config`` with the EOS ids of ``generation_config.json`` added to its own, as HF's
    ``generate`` stops on them (Llama 3.x Instruct: ``<|eot_id|>``, ``<|eom_id|>``; Qwen3: both
    ``<|im_end|>`` and ``<|endoftext|>``). ``ValueError`` for an unreadable file."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return config
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    extra = [eos] if isinstance(eos, int) else [t for t in eos or [] if isinstance(t, int)]
    merged = config.eos_token_ids + [t for t in extra if t not in config.eos_token_ids]
    if merged != config.eos_token_ids:
        config.eos_token_id = merged
    return config


def _load_weights(config: ModelConfig, model_dir: Path, torch_dtype: torch.dtype, device: torch.device,
                  gguf_path: Path | None, load_in_low_bit: str | None) -> nn.Module:
    """The model of ``model_dir`` as :func:`load_model` was asked for it (``gguf_path``: run
    that file's own blocks)."""
    saved_quant = quant_config_from_model_config(config.extra)
    if gguf_path is not None and saved_quant is None:
        net = load_layout(gguf_path, torch_dtype, device)
        if net is None:
            # The file's blocks go straight into quantized modules: the dense weights of those
            # linears are never read, so no full-precision copy of them exists.
            net = build_model(config, model_dir, torch_dtype, device,
                              prepare=lambda m: apply_gguf_native(m, gguf_path))
            net.min_rows = exact_min_rows(net)  # decided once the weights are in place
            store_layout(net, gguf_path, torch_dtype)
        if device.type == "cpu":
            lay_out_kernels(net, gguf_path, torch_dtype)
    elif saved_quant is None:
        net = build_model(config, model_dir, torch_dtype, device)
    else:
        net = build_quantized_model(config, load_state_dict(model_dir), torch_dtype, device, saved_quant)
        if gguf_path is not None:
            apply_gguf_native(net, gguf_path)
    if load_in_low_bit in ("sym_int4", "asym_int4", "int8"):
        if saved_quant is not None:
            raise ValueError(f"{model_dir} is already quantized; load it without load_in_low_bit")
        quantize_model(net, QuantConfig.from_low_bit(load_in_low_bit), show_progress=False)
    return net


def describe_weights(model: nn.Module) -> str:
    """Which weights run, in a few words: ``gguf-native`` (a GGUF file's own blocks), a
    quantization's label, or the dense reference; with the activations' dtype."""
    dtype = str(model.dtype).removeprefix("torch.")
    quant_config = getattr(model, "quant_config", None)
    if quant_config is None:
        return f"{dtype} (dense reference)"
    return f"{quant_config.label} (activations {dtype})"
