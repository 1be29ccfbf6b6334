"""A cache of a GGUF model's quantized weights in fastdraft's own layouts.

The first load of a model from a GGUF file converts the file's blocks into fastdraft's formats
(``quant/gguf_native.py``: unpacking, re-packing, permuting rows), then lays each weight out
for the CPU kernels (``kernels/x86.py::repack``: tiles of output rows). Both take seconds, and
both results are written once under ``$FASTDRAFT_HOME/layouts/``, keyed by the source file
(its path, size and modification time), the activations' dtype and :data:`LAYOUT_VERSION`:

* ``model.safetensors``: the canonical checkpoint (a fastdraft quantized model);
* ``kernels-<variant>-v<N>.safetensors``: the kernels' layout of every quantized linear (q/k/v
  and gate/up fused, as the C++ step runs them), one file per instruction-set variant and
  :data:`~fastdraft.kernels.x86.PACKED_LAYOUT_VERSION`.

Later loads map both (``models/files.py::map_safetensors``): nothing is converted or copied,
pages load as they are touched, and processes that load the same model (the server's engine
process, Ray replicas on one node) share them. The kernels read only their layout, so the
canonical tensors stay on disk until something asks for them (a GPU copy, a save).

Each file is written atomically; the manifest, written after it, records its size, CRC-32 and
modification time. A file whose size differs from its record, or whose modification time does
and whose CRC-32 then does too (truncated, edited), is removed and rebuilt with a warning; it
is never used. ``rm -r $FASTDRAFT_HOME/layouts`` clears the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from fastdraft.fileio import atomic_write, fastdraft_home, write_json
from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.kernels.x86 import PACKED_LAYOUT_VERSION, PackedWeight, X86WoqKernel
from fastdraft.layers.linear import PROJECTION_GROUPS, fused_linear, row_kernels
from fastdraft.layers.quant_linear import QuantLinear
from fastdraft.model_config import ModelConfig
from fastdraft.models.files import map_safetensors
from fastdraft.quant.checkpoint import build_quantized_model, quant_config_from_model_config, save_quantized

logger = logging.getLogger(__name__)

# Bump when the checkpoint a GGUF file converts into changes for the same file.
LAYOUT_VERSION = 2
_WEIGHTS, _MANIFEST = "model.safetensors", "manifest.json"
_CPU = torch.device("cpu")
_PARTS = ("packed", "scales", "zeros", "geometry")  # PackedWeight.tensors()


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


def _read_manifest(entry: Path) -> dict:
    return json.loads((entry / _MANIFEST).read_text())


def _record(entry: Path, name: str) -> None:
    """Add file ``name`` of ``entry`` to its manifest (written atomically)."""
    path = entry / name
    manifest = _read_manifest(entry) if (entry / _MANIFEST).is_file() else {"layout_version": LAYOUT_VERSION}
    stat = path.stat()
    manifest.setdefault("files", {})[name] = {"size": stat.st_size, "crc32": _crc32(path), "mtime_ns": stat.st_mtime_ns}
    write_json(entry / _MANIFEST, manifest)


def _checked(entry: Path, name: str) -> Path:
    """File ``name`` of ``entry`` after checking it against the manifest (``ValueError`` if it
    does not match). A file whose size and modification time are as recorded is taken as
    written; any other is read through for its CRC-32."""
    record = _read_manifest(entry).get("files", {}).get(name)
    path = entry / name
    if record is None:
        raise ValueError(f"{name} is not in the manifest")
    stat = path.stat()
    if stat.st_size != record["size"]:
        raise ValueError(f"{name} is {stat.st_size} bytes, the manifest says {record['size']}")
    if stat.st_mtime_ns != record["mtime_ns"] and _crc32(path) != record["crc32"]:
        raise ValueError(f"{name} does not match its checksum")
    return path


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
        weights = _checked(entry, _WEIGHTS)
        config = ModelConfig.from_file(entry / "config.json")
        quant_config = quant_config_from_model_config(config.extra)
        if quant_config is None or not quant_config.is_gguf_native:
            raise ValueError("the checkpoint is not a GGUF-native model")
        return build_quantized_model(config, map_safetensors(weights), dtype, device, quant_config)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("layout cache %s is unusable (%s): rebuilding it", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _remove_stale(root: Path) -> None:
    """Remove the entries an older :data:`LAYOUT_VERSION` wrote: no load can use them."""
    for manifest in root.glob(f"*/{_MANIFEST}"):
        try:
            is_stale = json.loads(manifest.read_text()).get("layout_version") != LAYOUT_VERSION
        except (OSError, ValueError):
            continue  # being written, or broken: its own load deals with it
        if is_stale:
            logger.info("removing the layout cache %s of an older layout version", manifest.parent)
            shutil.rmtree(manifest.parent, ignore_errors=True)


def store_layout(model: nn.Module, gguf_path: Path, dtype: torch.dtype) -> None:
    """Write ``model`` (just converted from ``gguf_path``) to its cache entry; a failure to
    write is logged, not raised: the model in hand is good."""
    entry = layout_dir(gguf_path, dtype)
    _remove_stale(entry.parent)
    try:
        save_quantized(model, entry)
        _record(entry, _WEIGHTS)
    except OSError as exc:
        logger.warning("could not write the layout cache %s: %s", entry, exc)


def _kernel_units(model: nn.Module) -> list[tuple[str, dict[str, QuantLinear]]]:
    """The quantized linears of ``model`` as the C++ step runs them: (name, {module name:
    linear}), a group whose linears may run as one (``model.layers.0.self_attn.q_proj+k_proj+v_proj``)
    or a single linear."""
    units, grouped = [], set()
    for idx, layer in enumerate(model.model.layers):
        for owner_name, names in PROJECTION_GROUPS:
            prefix = f"model.layers.{idx}.{owner_name}"
            linears = {f"{prefix}.{name}": layer.get_submodule(f"{owner_name}.{name}") for name in names}
            if all(isinstance(lin, QuantLinear) for lin in linears.values()):
                units.append((f"{prefix}.{'+'.join(names)}", linears))
                grouped.update(id(lin) for lin in linears.values())
    units += [(name, {name: module}) for name, module in model.named_modules()
              if isinstance(module, QuantLinear) and id(module) not in grouped]
    return units


def _lay_out(unit: str, linears: dict[str, QuantLinear], dtype: torch.dtype) -> dict[str, X86WoqKernel]:
    """The x86 kernels of a unit by name: one fused kernel where its linears can share one
    (each then running its rows), else one per linear that runs on the x86 kernels."""
    if len(linears) > 1:
        group = list(linears.values())
        fused = fused_linear(group, dtype, _CPU)
        if fused is not None and X86WoqKernel.joined([lin.built_kernel(dtype, _CPU) for lin in group]):
            return {unit: fused.kernel}
    kernels = {name: lin.kernel_for(dtype, _CPU) for name, lin in linears.items()}
    return {name: kernel for name, kernel in kernels.items() if isinstance(kernel, X86WoqKernel)}


def _saved_kernels(linears: list[QuantLinear], packed: PackedWeight, dtype: torch.dtype) -> list[X86WoqKernel]:
    """The kernel of each of ``linears`` over their saved layout (``ValueError`` if it is not theirs)."""
    first = linears[0]
    shape = (sum(lin.out_features for lin in linears), first.in_features, first.bits)
    if (packed.out_features, packed.in_features, packed.bits) != shape:
        raise ValueError(f"a saved layout is {packed.out_features}x{packed.in_features} INT{packed.bits}, "
                         f"its linears {shape[0]}x{shape[1]} INT{shape[2]}")
    kernel = X86WoqKernel.from_packed(packed, dtype)
    views = [kernel] if len(linears) == 1 else row_kernels(kernel, linears)
    if views is None:
        raise ValueError("a saved fused layout does not split into its linears' rows")
    return views


def _kernels_name(variant: str) -> str:
    return f"kernels-{variant}-v{PACKED_LAYOUT_VERSION}.safetensors"


def lay_out_kernels(model: nn.Module, gguf_path: Path, dtype: torch.dtype) -> None:
    """Give ``model`` (a GGUF-native model on the CPU, from :func:`load_layout` or just
    converted) its kernels: mapped from the cache entry's layout file for this CPU's kernel
    variant, or built now and written there for the next load. Nothing happens without the
    x86 kernels; a broken layout file is removed and rebuilt, with a warning."""
    ext = load_cpu_kernels()
    if ext is None:
        return
    entry = layout_dir(gguf_path, dtype)
    name = _kernels_name(ext.name)
    units = _kernel_units(model)
    if (entry / name).is_file():
        try:
            tensors = map_safetensors(_checked(entry, name))
            saved = []  # every kernel is made, and checked, before any linear takes one
            for unit, linears in units:
                parts = [(unit, list(linears.values()))] if f"{unit}.packed" in tensors else [
                    (linear_name, [linear]) for linear_name, linear in linears.items()
                    if f"{linear_name}.packed" in tensors]
                for kernel_name, group in parts:
                    packed = PackedWeight.from_tensors({part: tensors[f"{kernel_name}.{part}"] for part in _PARTS})
                    saved += zip(group, _saved_kernels(group, packed, dtype))
            for linear, kernel in saved:
                linear.adopt_kernel(kernel, dtype, _CPU)
            return
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("layout cache %s is unusable (%s): rebuilding it", entry / name, exc)
            (entry / name).unlink(missing_ok=True)
    state = {}
    for unit, linears in units:
        for kernel_name, kernel in _lay_out(unit, linears, dtype).items():
            state.update({f"{kernel_name}.{part}": t.contiguous() for part, t in kernel.weight.tensors().items()})
    if not (entry / _MANIFEST).is_file():
        return  # no entry to add to (its writing failed)
    try:
        atomic_write(entry / name, lambda tmp: save_file(state, tmp))
        _record(entry, name)
    except OSError as exc:
        logger.warning("could not write the layout cache %s: %s", entry / name, exc)
