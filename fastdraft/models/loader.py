"""Resolve a model reference (known name, HF folder or .gguf file) and load it."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from fastdraft.config import ModelConfig
from fastdraft.engine.tokenizer import Tokenizer
from fastdraft.models.gguf_convert import convert_gguf_to_hf
from fastdraft.models.llama import LlamaForCausalLM
from fastdraft.models.registry import KNOWN_MODELS, fastdraft_home, original_gguf, pull

if TYPE_CHECKING:
    from fastdraft.quant.config import QuantConfig

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


def gguf_source(model: str | Path) -> Path:
    """The GGUF file ``model`` comes from: a known name's original file, or a .gguf path."""
    model_str = str(model)
    if model_str in KNOWN_MODELS:
        return original_gguf(model_str)
    path = Path(model_str).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return path
    raise ValueError(f"{model_str} is not a GGUF file or a known model, so it has no GGUF blocks to keep")


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
                device: torch.device | str = "cpu", quant_config: "QuantConfig | None" = None) -> LlamaForCausalLM:
    """Instantiate our model from HF-named weights without a second copy in memory.

    With ``quant_config`` the dense linears are first replaced by quantized placeholders, so
    a saved quantized checkpoint loads as is.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        if quant_config is not None:
            from fastdraft.quant.checkpoint import apply_quant_structure

            apply_quant_structure(model, quant_config)
    is_tied = config.tie_word_embeddings and isinstance(model.lm_head, torch.nn.Linear)
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    expected = set(model.state_dict())
    if is_tied:
        state_dict.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state_dict), set(state_dict) - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    # Quantized codes and their fp16 scales and zero points keep their storage dtype; everything
    # else follows dtype.
    def target_dtype(name: str, tensor: torch.Tensor) -> torch.dtype | None:
        is_quant_param = name.rpartition(".")[2] in ("scales", "qzeros")
        return dtype if tensor.is_floating_point() and not is_quant_param else None

    state_dict = {k: v.to(device=device, dtype=target_dtype(k, v)) for k, v in state_dict.items()}
    model.load_state_dict(state_dict, strict=False, assign=True)
    if is_tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    if quant_config is not None:
        from fastdraft.quant.linear import exact_min_rows

        model.quant_config = quant_config
        model.min_rows = exact_min_rows(model)
    return model.eval()


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    model_dir: Path


def parse_device(device: torch.device | str, what: str = "device") -> torch.device:
    """``device`` as a ``torch.device``; ``ValueError`` for a malformed name or CUDA without CUDA."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{what} {device!r} is not a device name: {exc}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} 'cuda' requested but CUDA is not available")
    return parsed


def load_model(model: str | Path, dtype: str | torch.dtype = "bf16", device: torch.device | str = "cpu",
               load_in_low_bit: str | None = None, keep_gguf_quant: bool = False) -> LoadedModel:
    """Load ``model`` (a known name, HF folder, quantized checkpoint or .gguf path).

    ``load_in_low_bit`` follows ipex-llm: ``"bf16"``/``"fp32"`` pick the dtype;
    ``"sym_int4"``, ``"asym_int4"`` and ``"int8"`` quantize on the fly (RTN, groups of 32) with
    compute in ``dtype``. ``keep_gguf_quant``: the linears keep the quantized blocks of the GGUF
    file the model comes from (a known name or a .gguf path), at the file's own precision.
    """
    from fastdraft.quant.checkpoint import quant_config_from_model_config
    from fastdraft.quant.config import LOW_BIT_NAMES, QuantConfig

    if load_in_low_bit is not None and load_in_low_bit not in LOW_BIT_NAMES:
        raise ValueError(f"unknown load_in_low_bit {load_in_low_bit!r}; choose from {', '.join(LOW_BIT_NAMES)}")
    if keep_gguf_quant and load_in_low_bit not in (None, "bf16", "fp32"):
        raise ValueError("keep_gguf_quant keeps the GGUF's own blocks; it cannot be combined with "
                         f"load_in_low_bit={load_in_low_bit!r}")
    if load_in_low_bit in ("bf16", "fp32"):
        dtype = load_in_low_bit
    torch_dtype = parse_dtype(dtype)
    device = parse_device(device)
    gguf_path = gguf_source(model) if keep_gguf_quant else None  # a wrong model fails before loading
    model_dir = resolve_model_dir(model)
    config = ModelConfig.from_file(model_dir / "config.json")
    saved_quant = quant_config_from_model_config(config.extra)
    net = build_model(config, load_state_dict(model_dir), torch_dtype, device, saved_quant)
    if gguf_path is not None:
        from fastdraft.quant.gguf_native import apply_gguf_native

        apply_gguf_native(net, gguf_path)
    if load_in_low_bit in ("sym_int4", "asym_int4", "int8"):
        if saved_quant is not None:
            raise ValueError(f"{model_dir} is already quantized; load it without load_in_low_bit")
        from fastdraft.quant.quantizer import quantize_model

        quantize_model(net, QuantConfig.from_low_bit(load_in_low_bit), show_progress=False)
    tokenizer = Tokenizer(model_dir)
    return LoadedModel(model=net, tokenizer=tokenizer, config=config, model_dir=model_dir)
