"""A cache of a GGUF model's quantized weights in fastdraft's own layout.

The first load of a model from a GGUF file converts the file's blocks into fastdraft's formats
(``quant/gguf_native.py``: unpacking, re-packing, permuting rows), which takes seconds. That
result is written once, as a fastdraft checkpoint, under ``$FASTDRAFT_HOME/layouts/``, keyed by
the source file (its path, size and modification time), the activations' dtype and
:data:`LAYOUT_VERSION`. Later loads map the checkpoint (``models/files.py::map_safetensors``):
nothing is converted or copied, pages load as they are touched, and processes that load the
same model (the server's engine process, Ray replicas on one node) share them.

An entry is a folder written atomically, then a manifest holding the checkpoint's size and
CRC-32, written last. A folder without a manifest (an interrupted write), or whose checkpoint
does not match its manifest (truncated, edited), is removed and rebuilt with a warning; it is
never used. ``rm -r $FASTDRAFT_HOME/layouts`` clears the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import zlib
from pathlib import Path

import torch
from torch import nn

from fastdraft.fileio import fastdraft_home, write_json
from fastdraft.model_config import ModelConfig
from fastdraft.models.files import map_safetensors
from fastdraft.quant.checkpoint import build_quantized_model, quant_config_from_model_config, save_quantized

logger = logging.getLogger(__name__)

# Bump when the checkpoint a GGUF file converts into changes for the same file.
LAYOUT_VERSION = 1
_WEIGHTS, _MANIFEST = "model.safetensors", "manifest.json"


def layout_dir(gguf_path: Path, dtype: torch.dtype) -> Path:
    """The cache entry of ``gguf_path`` loaded with activations of ``dtype``."""
    stat = gguf_path.stat()
    source = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{dtype}:{LAYOUT_VERSION}"
    return fastdraft_home() / "layouts" / f"{gguf_path.stem}-{hashlib.sha256(source.encode()).hexdigest()[:16]}"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _checked_weights(entry: Path) -> Path:
    """The entry's checkpoint, after checking it against the manifest (``ValueError`` if not)."""
    manifest = json.loads((entry / _MANIFEST).read_text())
    weights = entry / _WEIGHTS
    size = weights.stat().st_size
    if size != manifest["size"]:
        raise ValueError(f"{weights.name} is {size} bytes, the manifest says {manifest['size']}")
    if _crc32(weights) != manifest["crc32"]:
        raise ValueError(f"{weights.name} does not match its checksum")
    return weights


def load_layout(gguf_path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
    """The model cached for ``gguf_path`` and ``dtype``, its weights mapped from the cache; None
    when there is no usable entry (a broken one is removed, with a warning)."""
    entry = layout_dir(gguf_path, dtype)
    if not (entry / _MANIFEST).is_file():
        if entry.exists():
            logger.warning("layout cache %s is incomplete: rebuilding it", entry)
            shutil.rmtree(entry, ignore_errors=True)
        return None
    try:
        weights = _checked_weights(entry)
        config = ModelConfig.from_file(entry / "config.json")
        quant_config = quant_config_from_model_config(config.extra)
        if quant_config is None or not quant_config.is_gguf_native:
            raise ValueError("the checkpoint is not a GGUF-native model")
        return build_quantized_model(config, map_safetensors(weights), dtype, device, quant_config)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("layout cache %s is unusable (%s): rebuilding it", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def store_layout(model: nn.Module, gguf_path: Path, dtype: torch.dtype) -> None:
    """Write ``model`` (just converted from ``gguf_path``) to its cache entry; a failure to
    write is logged, not raised: the model in hand is good."""
    entry = layout_dir(gguf_path, dtype)
    try:
        save_quantized(model, entry)
        weights = entry / _WEIGHTS
        manifest = {"source": str(gguf_path), "size": weights.stat().st_size, "crc32": _crc32(weights),
                    "layout_version": LAYOUT_VERSION}
        write_json(entry / _MANIFEST, manifest)
    except OSError as exc:
        logger.warning("could not write the layout cache %s: %s", entry, exc)
