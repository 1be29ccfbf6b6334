"""Compile-on-first-use of the C++ CPU kernels, cached under ``$FASTDRAFT_HOME/kernels``.

The extension is built with ``torch.utils.cpp_extension`` (gcc + ninja) the first time a
kernel is needed; later processes load the cached library. The cache key covers the source,
the compiler flags and the torch/Python versions, so an upgrade rebuilds instead of loading
a stale binary. When the CPU lacks the instruction sets or no compiler works, callers get
``None`` and fall back to the PyTorch kernels with one logged notice.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

from fastdraft.fileio import fastdraft_home

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE_NAMES = ("woq_x86.cpp", "fused_x86.cpp", "attention_x86.cpp", "decoder_x86.cpp", "sampling_x86.cpp")
HEADER_NAMES = ("x86_kernels.h", "simd_x86.h")
# Every instruction the kernels use; the build never targets the build machine (-march=native)
# so that a cache shared between machines stays valid.
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")
CFLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
          "-mf16c", "-mfma", "-std=c++17"]


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def missing_cpu_flags() -> list[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["x86-64"]
    flags = cpu_flags()
    return [f for f in REQUIRED_CPU_FLAGS if f not in flags]


def source_key(csrc: Path = CSRC) -> str:
    """Identity of a build from ``csrc``: its sources and headers, the compiler flags and the
    torch/Python versions, so a change to any of them rebuilds instead of loading a stale binary.
    The folder's path is part of it too: torch's build files record the source paths, so each
    checkout gets a build folder of its own instead of silently recompiling another's, and the
    first-use notice says why the first request is slow."""
    key = hashlib.sha256(str(csrc.resolve()).encode())
    for name in SOURCE_NAMES + HEADER_NAMES:
        key.update((csrc / name).read_bytes())
    key.update(" ".join(CFLAGS).encode())
    key.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    return key.hexdigest()[:16]


def cache_dir() -> Path:
    return fastdraft_home() / "kernels" / f"woq_x86-{source_key()}"


def compile_extension(name: str, csrc: Path, build_dir: Path) -> ModuleType:
    """Compile (or load, when ``build_dir`` holds it already) the extension from ``csrc``'s
    sources as module ``name``; raises if the build fails."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    # cpp_extension takes a file lock in build_dir, so concurrent first uses build once.
    return cpp_extension.load(name=name, sources=[str(csrc / n) for n in SOURCE_NAMES], extra_cflags=CFLAGS,
                              extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


# The instruction set the C++ kernels are built for.
KERNEL_VARIANT = "avx512_vnni"


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def unavailable_reason() -> str | None:
    """Why fastdraft's C++ kernels cannot run here, or None when they can."""
    if os.environ.get("FASTDRAFT_DISABLE_CPU_KERNELS"):
        return "disabled by FASTDRAFT_DISABLE_CPU_KERNELS"
    missing = missing_cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found"
    return None


def is_built() -> bool:
    """Whether this checkout's kernels are compiled in the cache already."""
    return any(cache_dir().glob("*.so"))


@functools.cache
def load_x86_extension() -> ModuleType | None:
    """The compiled x86 kernel module, or ``None`` (with a logged reason) if it cannot run here."""
    reason = unavailable_reason()
    if reason is not None:
        log = logger.info if os.environ.get("FASTDRAFT_DISABLE_CPU_KERNELS") else logger.warning
        log("fastdraft's CPU kernels are off (%s): using PyTorch's kernels", reason)
        return None
    build_dir = cache_dir()
    if not is_built():
        logger.warning("building fastdraft's CPU kernels (first use only, about a minute) in %s", build_dir)
    try:
        return compile_extension("fastdraft_woq_x86", CSRC, build_dir)
    except Exception as exc:  # compiler missing pieces, ninja absent, ...: fall back, never crash
        logger.warning("could not build fastdraft's CPU kernels (%s): using PyTorch's kernels", exc)
        return None
