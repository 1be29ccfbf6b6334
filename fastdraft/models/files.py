"""A model's files: a reference (known name, HF folder or .gguf file) resolved to a folder, its
weights read, and the module built from them."""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import numpy as np
import torch
from safetensors import safe_open

from fastdraft.model_config import ModelConfig
from fastdraft.models.gguf_convert import convert_gguf_to_hf
from fastdraft.models.causal_lm import CausalLM
from fastdraft.models.registry import KNOWN_MODELS, fastdraft_home, original_gguf, pull
from fastdraft.tokenizer import Tokenizer

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


def is_gguf_file(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


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
        if not is_gguf_file(path):
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
    if path.is_file() and is_gguf_file(path):
        return path
    raise ValueError(f"{model_str} is not a GGUF file or a known model, so it has no GGUF blocks to keep")


def find_gguf_source(model: str | Path) -> Path | None:
    """:func:`gguf_source`, or None for a model that does not come from a GGUF file."""
    try:
        return gguf_source(model)
    except ValueError:
        return None


# safetensors dtype names -> (numpy dtype to view the bytes as, torch dtype of the tensor).
_ST_DTYPES = {
    "F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "BF16": (np.int16, torch.bfloat16),
    "I64": (np.int64, torch.int64), "I32": (np.int32, torch.int32), "I16": (np.int16, torch.int16),
    "I8": (np.int8, torch.int8), "U8": (np.uint8, torch.uint8), "BOOL": (np.bool_, torch.bool),
}


def map_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of one map of it: nothing is copied, pages
    load as they are touched, and processes mapping the same file share them (a page written
    to becomes the process's own)."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        # Copy-on-write: a tensor written to by mistake gets a private page instead of a crash.
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # Weights are streamed whole every step: on 2 MiB pages the TLB covers them (where the
        # file system's page cache holds large folios), as on the kernels' own huge pages.
        mapped.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(mapped, dtype=np.uint8)
    if raw.size < 8:
        raise ValueError(f"{path} is too short to be a safetensors file")
    header_len = int(raw[:8].view("<u8")[0])
    if 8 + header_len > raw.size:
        raise ValueError(f"{path}: the header runs past the end of the file")
    header = json.loads(bytes(raw[8:8 + header_len]))
    header.pop("__metadata__", None)
    tensors = {}
    for name, info in header.items():
        np_dtype, torch_dtype = _ST_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        data = raw[8 + header_len + begin:8 + header_len + end]
        if data.size != end - begin:
            raise ValueError(f"{path}: tensor {name} runs past the end of the file")
        tensors[name] = torch.from_numpy(data.view(np_dtype)).view(torch_dtype).reshape(info["shape"])
    return tensors


def load_state_dict(model_dir: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The weights of ``model_dir``'s safetensors files: all of them, or only ``names`` (the
    others are never read)."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as weights:
                for name in weights.keys():
                    if names is None or name in names:
                        state[name] = weights.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types on corrupt files
            raise ValueError(f"cannot read weights {f}: {exc}") from exc
    return state


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor] | Path, dtype: torch.dtype,
                device: torch.device | str = "cpu",
                prepare: Callable[[CausalLM], None] | None = None) -> CausalLM:
    """Instantiate our model from HF-named weights (a state dict, or a folder to read them from)
    without a second copy in memory.

    ``prepare`` runs on the empty (meta-device) model before the weights are assigned: it may
    replace modules by quantized placeholders (a saved quantized checkpoint, which then loads as
    is) or by quantized modules already holding their weights (a GGUF file's blocks); a
    tensor that is no longer on the meta device is not read from ``weights``.
    """
    with torch.device("meta"):
        model = CausalLM(config)
    if prepare is not None:
        prepare(model)
    is_tied = config.tie_word_embeddings and isinstance(model.lm_head, torch.nn.Linear)
    expected = {name for name, tensor in model.state_dict().items() if tensor.is_meta}
    if is_tied:
        expected.discard("lm_head.weight")
    if isinstance(weights, Path):
        weights = load_state_dict(weights, expected)
    state_dict = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if is_tied:
        state_dict.pop("lm_head.weight", None)
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
    return model.to(device).eval()


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer | None  # None: a model built without files (random weights), run on token ids
    config: ModelConfig
    model_dir: Path | None


def parse_device(device: torch.device | str, what: str = "device") -> torch.device:
    """``device`` as a ``torch.device``; ``ValueError`` for a malformed name or CUDA without CUDA."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{what} {device!r} is not a device name: {exc}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} 'cuda' requested but CUDA is not available")
    return parsed
