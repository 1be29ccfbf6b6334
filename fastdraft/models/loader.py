"""Resolve a model reference (known name, HF folder or .gguf file) and load it."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from fastdraft.config import ModelConfig
from fastdraft.engine.tokenizer import Tokenizer
from fastdraft.models.gguf_convert import convert_gguf_to_hf
from fastdraft.models.llama import LlamaForCausalLM
from fastdraft.models.registry import KNOWN_MODELS, fastdraft_home, pull

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
          "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _gguf_cache_dir(gguf_path: Path) -> Path:
    # Key the conversion by the file's identity so an edited file is converted again.
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return fastdraft_home() / "gguf" / f"{gguf_path.stem}-{key}"


def resolve_model_dir(model: str | Path) -> Path:
    """Return an HF folder for ``model``: a known name (pulled if needed), a folder, or a .gguf file."""
    model_str = str(model)
    if model_str in KNOWN_MODELS:
        return pull(model_str)
    path = Path(model_str).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a folder but has no config.json")
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"{path} has no .safetensors weights")
        return path
    if path.is_file():
        with open(path, "rb") as f:
            is_gguf = f.read(4) == b"GGUF"
        if not is_gguf:
            raise ValueError(f"{path} is not a GGUF file")
        out_dir = _gguf_cache_dir(path)
        if not (out_dir / "model.safetensors").is_file():
            convert_gguf_to_hf(path, out_dir)
        return out_dir
    raise ValueError(
        f"unknown model {model_str!r}: not a known name ({', '.join(KNOWN_MODELS)}), "
        "an HF folder or a .gguf file"
    )


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises its own error types on corrupt files
            raise ValueError(f"cannot read weights {f}: {exc}") from exc
    return state


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """Instantiate our model from HF-named weights without a second copy in memory."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state_dict), set(state_dict) - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    state_dict = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    model.load_state_dict(state_dict, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    model_dir: Path


def load_model(model: str | Path, dtype: str | torch.dtype = "bf16",
               device: torch.device | str = "cpu") -> LoadedModel:
    """Load ``model`` (a known name, HF folder or .gguf path) with weights in ``dtype``."""
    torch_dtype = parse_dtype(dtype)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    model_dir = resolve_model_dir(model)
    config = ModelConfig.from_file(model_dir / "config.json")
    net = build_model(config, load_state_dict(model_dir), torch_dtype, device)
    tokenizer = Tokenizer(model_dir)
    return LoadedModel(model=net, tokenizer=tokenizer, config=config, model_dir=model_dir)
