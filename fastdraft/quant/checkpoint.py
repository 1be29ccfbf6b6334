"""Quantized checkpoints: an HF-style folder whose ``config.json`` carries a
``quantization_config`` and whose ``model.safetensors`` holds the canonical quantized tensors.

Loading one needs no calibration: the module structure is rebuilt from the config and the
tensors are assigned as saved. Folders are written to a temporary sibling and renamed into
place, so an interrupted save never leaves a checkpoint that looks complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from fastdraft.model_config import ModelConfig

from fastdraft.fileio import atomic_dir
from fastdraft.layers.quant_linear import QuantEmbedding, QuantLinear, exact_min_rows
from fastdraft.models.causal_lm import CausalLM
from fastdraft.models.files import build_model
from fastdraft.quant.quant_config import LAYER_LINEARS, QuantConfig
from fastdraft.quant.quantizer import replace_module

QUANT_METHOD_TAG = "fastdraft"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def quant_config_from_model_config(extra: dict[str, Any]) -> QuantConfig | None:
    """The QuantConfig stored in a checkpoint's config.json, or None for a dense model."""
    raw = extra.get("quantization_config")
    if raw is None:
        return None
    raw = dict(raw)
    method = raw.pop("quant_method", None)
    if method != QUANT_METHOD_TAG:
        raise ValueError(f"unsupported quantization_config.quant_method {method!r} (expected {QUANT_METHOD_TAG!r})")
    return QuantConfig.from_dict(raw)


def apply_quant_structure(model: CausalLM, config: QuantConfig) -> None:
    """Replace dense modules with empty quantized placeholders matching ``config``."""
    num_layers = len(model.model.layers)
    for idx, layer in enumerate(model.model.layers):
        for name in LAYER_LINEARS:
            linear: nn.Linear = layer.get_submodule(name)
            fmt = config.layer_format(idx, num_layers, name)
            if fmt is None:
                continue
            replace_module(layer, name, QuantLinear.empty(linear.in_features, linear.out_features, fmt,
                                                          linear.bias is not None))
    head_format = config.head_format()
    if head_format is not None:
        head = model.lm_head
        model.lm_head = QuantLinear.empty(head.in_features, head.out_features, head_format, False)
    embed_format = config.embedding_format()
    if embed_format is not None:
        embed = model.model.embed_tokens
        model.model.embed_tokens = QuantEmbedding.empty(embed.num_embeddings, embed.embedding_dim, embed_format)


def build_quantized_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                          device: torch.device | str, quant_config: QuantConfig) -> CausalLM:
    """A saved checkpoint's model: quantized placeholders of ``quant_config`` filled by ``state_dict``."""
    model = build_model(config, state_dict, dtype, device, prepare=lambda m: apply_quant_structure(m, quant_config))
    model.quant_config = quant_config
    model.min_rows = exact_min_rows(model)
    return model


def save_quantized(model: CausalLM, out_dir: str | Path, source_dir: str | Path | None = None) -> Path:
    """Write a quantized model (and the tokenizer files of ``source_dir``) to ``out_dir`` atomically."""
    config: QuantConfig | None = getattr(model, "quant_config", None)
    if config is None:
        raise ValueError("the model is not quantized")
    out_dir = Path(out_dir)
    hf_config = model.config.to_hf_dict()
    hf_config["quantization_config"] = {"quant_method": QUANT_METHOD_TAG, **config.to_dict()}
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if isinstance(model.lm_head, nn.Linear) and model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with the embedding

    with atomic_dir(out_dir) as tmp_dir:
        save_file(state, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        (tmp_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
        for name in _TOKENIZER_FILES:
            if source_dir is not None and (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, tmp_dir / name)
    return out_dir
