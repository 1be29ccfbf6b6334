"""Compile-on-first-use of the C++ CPU kernels, cached under ``$FASTDRAFT_HOME/kernels``.

Two kinds of build, both cached by the identity of their sources, flags and toolchain:

* **The driver** (every ``csrc/*.cpp``): work splitting, the decoder step and the Python
  bindings (``bindings.cpp``), built with ``torch.utils.cpp_extension`` and *no* instruction-set
  flags, so nothing in it can fault on any x86-64 CPU.
* **One library per instruction-set variant** (``csrc/isa/<name>.cpp``): the leaf kernels,
  built with that variant's flags into a small shared library exporting one table of function
  pointers (``csrc/isa/kernel_table.h``). Only the variant in use is compiled (seconds).

At load the driver reads CPUID and XGETBV (``cpu_features``), the best variant this CPU and OS
run is chosen, or the one ``FASTDRAFT_ISA`` names, and its library is mapped. When no compiler
works the callers get ``None`` and fall back to PyTorch's kernels, with one logged notice.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from fastdraft.fileio import fastdraft_home

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
ISA_SRC = CSRC / "isa"
# Headers the driver includes from isa/ (besides every csrc/*.h).
SHARED_HEADER_NAMES = ("isa/kernel_table.h",)
# The driver is built with no instruction-set flags: those belong to the variants alone.
CFLAGS = ["-O3", "-fopenmp", "-std=c++17"]
ISA_ENV = "FASTDRAFT_ISA"


@dataclass(frozen=True)
class IsaVariant:
    """One build of the leaf kernels: its compiler flags and the CPU features it needs (names
    as the driver's ``cpu_features`` gives them)."""

    name: str
    cflags: tuple[str, ...]
    features: tuple[str, ...]


_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
# In order of preference, worst first: the chosen variant is the last one the CPU runs.
ISA_VARIANTS = (
    IsaVariant("scalar", (), ()),
    IsaVariant("avx2", _AVX2_FLAGS, ("avx2", "fma", "f16c")),
    IsaVariant("avx2_vnni", _AVX2_FLAGS + ("-mavxvnni",), ("avx2", "fma", "f16c", "avx_vnni")),
    IsaVariant("avx512_vnni", _AVX2_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
               ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")),
)
ISA_NAMES = tuple(v.name for v in ISA_VARIANTS)


def isa_variant(name: str) -> IsaVariant:
    """The variant called ``name``; ValueError naming the known ones otherwise."""
    for variant in ISA_VARIANTS:
        if variant.name == name:
            return variant
    raise ValueError(f"unknown instruction-set variant {name!r}: choose one of {', '.join(ISA_NAMES)}")


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


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def unavailable_reason() -> str | None:
    """Why fastdraft's C++ kernels cannot run here at all, or None when they can."""
    if os.environ.get("FASTDRAFT_DISABLE_CPU_KERNELS"):
        return "disabled by FASTDRAFT_DISABLE_CPU_KERNELS"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"no kernels for {platform.machine()} CPUs yet (x86-64 only)"
    if shutil.which(_compiler()) is None:
        return "no C++ compiler found"
    return None


def driver_sources(csrc: Path = CSRC) -> list[Path]:
    """The driver's translation units: every ``.cpp`` directly in ``csrc``. Globbed, not listed,
    so a folder with another file list (an A/B baseline, benchmarks/ab_kernels.py) builds too."""
    return sorted(csrc.glob("*.cpp"))


def _digest(paths: list[Path], extra: str) -> str:
    key = hashlib.sha256(extra.encode())
    for path in paths:
        key.update(path.read_bytes())
    return key.hexdigest()[:16]


def source_key(csrc: Path = CSRC) -> str:
    """Identity of a driver build from ``csrc``: its sources and headers, the compiler flags and
    the torch/Python versions, so a change to any of them rebuilds instead of loading a stale
    binary. The folder's path is part of it too: torch's build files record the source paths,
    so each checkout gets a build folder of its own instead of silently recompiling another's.
    The file names count as well as their contents, so code moved between files rebuilds."""
    sources = driver_sources(csrc)
    headers = sorted(csrc.glob("*.h")) + [csrc / n for n in SHARED_HEADER_NAMES]
    names = " ".join(p.relative_to(csrc).as_posix() for p in sources + headers)
    return _digest(sources + headers,
                   f"{csrc.resolve()} {names} {' '.join(CFLAGS)} {torch.__version__} {sys.version_info[:2]}")


def cache_dir() -> Path:
    """Where this checkout's driver is built."""
    return fastdraft_home() / "kernels" / f"driver-{source_key()}"


def is_built() -> bool:
    """Whether this checkout's driver is compiled in the cache already."""
    return any(cache_dir().glob("*.so"))


def compile_extension(name: str, csrc: Path, build_dir: Path) -> ModuleType:
    """Compile (or load, when ``build_dir`` holds it already) the driver from ``csrc``'s sources
    as module ``name``; raises if the build fails."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    # cpp_extension takes a file lock in build_dir, so concurrent first uses build once.
    return cpp_extension.load(name=name, sources=[str(p) for p in driver_sources(csrc)], extra_cflags=CFLAGS,
                              extra_ldflags=["-fopenmp", "-ldl"], build_directory=str(build_dir), verbose=False)


def isa_library_path(name: str, isa_src: Path = ISA_SRC) -> Path:
    """Where variant ``name``'s library is cached: keyed by its sources, flags and compiler."""
    variant = isa_variant(name)
    sources = sorted(isa_src.glob("*.h")) + [isa_src / f"{name}.cpp", isa_src / "exports.map"]
    key = _digest(sources, f"{_compiler()} {' '.join(variant.cflags)}")
    return fastdraft_home() / "kernels" / f"isa-{key}" / f"libfastdraft_{name}.so"


def build_isa_library(name: str, isa_src: Path = ISA_SRC) -> Path:
    """Compile variant ``name``'s leaf kernels from ``isa_src`` (if not cached) and return the
    library's path. Any x86-64 compiler builds every variant, whichever CPU it runs on."""
    path = isa_library_path(name, isa_src)
    if path.exists():
        return path
    variant = isa_variant(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: a concurrent build or a crash never leaves a
    # half-written library at the cached path.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    # No floating-point contraction: each kernel rounds where kernel_table.h says; explicit fma
    # intrinsics stay fused.
    command = [_compiler(), "-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden",
               "-fvisibility-inlines-hidden", "-ffp-contract=off", *variant.cflags,
               f"-Wl,--version-script={isa_src / 'exports.map'}", str(isa_src / f"{name}.cpp"), "-o", tmp]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"compiling the {name} kernels failed:\n{result.stderr[-4000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def load_driver() -> ModuleType | None:
    """The compiled driver module, or ``None`` (with a logged reason) if it cannot run here."""
    reason = unavailable_reason()
    if reason is not None:
        log = logger.info if os.environ.get("FASTDRAFT_DISABLE_CPU_KERNELS") else logger.warning
        log("fastdraft's CPU kernels are off (%s): using PyTorch's kernels", reason)
        return None
    build_dir = cache_dir()
    if not is_built():
        logger.warning("building fastdraft's CPU kernels (first use only, about a minute) in %s", build_dir)
    try:
        return compile_extension("fastdraft_kernels", CSRC, build_dir)
    except Exception as exc:  # compiler missing pieces, ninja absent, ...: fall back, never crash
        logger.warning("could not build fastdraft's CPU kernels (%s): using PyTorch's kernels", exc)
        return None


@functools.cache
def cpu_features() -> dict[str, bool]:
    """Instruction sets the CPU has and the OS enables (CPUID and XGETBV, read by the driver);
    empty when the driver cannot run here."""
    driver = load_driver()
    return dict(driver.cpu_features()) if driver is not None else {}


def runnable_isas(features: dict[str, bool] | None = None) -> list[str]:
    """The variants this CPU runs, worst first."""
    features = cpu_features() if features is None else features
    return [v.name for v in ISA_VARIANTS if all(features.get(f, False) for f in v.features)]


def requested_isa() -> str | None:
    """The variant ``$FASTDRAFT_ISA`` names, checked by name only (no build); None when unset."""
    name = os.environ.get(ISA_ENV) or None
    if name is None:
        return None
    try:
        return isa_variant(name).name
    except ValueError as exc:
        raise ValueError(f"{ISA_ENV}: {exc}") from None


def select_isa(features: dict[str, bool] | None = None, requested: str | None = None) -> str:
    """The variant to run: ``requested`` (default: ``$FASTDRAFT_ISA``) if given, else the best
    one the CPU runs. ValueError if the name is unknown or the CPU cannot run it."""
    features = cpu_features() if features is None else features
    if requested is None:
        requested = requested_isa()
    runnable = runnable_isas(features)
    if requested is None:
        return runnable[-1]
    variant = isa_variant(requested)
    if variant.name not in runnable:
        missing = [f for f in variant.features if not features.get(f, False)]
        raise ValueError(f"{ISA_ENV}={requested}: this CPU (or its OS) lacks {', '.join(missing)}; "
                         f"it runs {', '.join(runnable)}")
    return variant.name


class CpuKernels:
    """The C++ kernels of one instruction-set variant: the driver's ops with the variant's
    kernel table bound, so ``kernels.woq_linear(x, ...)`` runs ``isa``'s GEMV. Ops that take no
    kernels (``DecoderLayer``, ``concat_linear``, ...) are the driver's own."""

    # Driver functions whose first argument is the variant (``isa`` in their bindings).
    _ISA_OPS = frozenset({
        "rms_norm", "rms_norm_offset", "silu_and_mul", "gelu_tanh_and_mul", "rotary", "paged_attention", "dense_bf16_applies", "dense_bf16_supports",
        "dense_bf16_linear", "woq_linear", "woq_block_sums", "woq_dequantize", "dense_linear", "woq_linear_op",
        "PagedDecoder", "argmax_rows", "sample_rows", "rejection_sample",
    })

    def __init__(self, driver: ModuleType, isa: Any) -> None:
        self.driver = driver
        self.isa = isa
        self.name: str = isa.name
        self.tile_rows: int = isa.tile_rows

    def __getattr__(self, op: str) -> Any:
        # Called once per op: the bound op is kept on the instance, so later lookups (one per
        # fused op on the module path) find it without building a partial each time.
        fn = getattr(self.driver, op)
        bound = functools.partial(fn, self.isa) if op in self._ISA_OPS else fn
        setattr(self, op, bound)
        return bound

    def __repr__(self) -> str:
        return f"CpuKernels({self.name})"


@functools.cache
def _load_isa(name: str) -> CpuKernels | None:
    driver = load_driver()
    if driver is None:
        return None
    try:
        path = build_isa_library(name)
    except Exception as exc:  # a compiler too old for the variant's flags, ...
        logger.warning("could not build fastdraft's %s kernels (%s): using PyTorch's kernels", name, exc)
        return None
    return CpuKernels(driver, driver.load_isa(str(path)))


@functools.cache
def load_cpu_kernels(isa: str | None = None) -> CpuKernels | None:
    """The C++ kernels of variant ``isa`` (default: :func:`select_isa`'s choice, made once per
    process), or ``None`` (with a logged reason) where they cannot run. ValueError for a
    variant this CPU cannot run."""
    if load_driver() is None:
        return None
    name = select_isa(requested=isa)
    kernels = _load_isa(name)
    if kernels is not None and isa is None:
        _log_choice(name)
    return kernels


@functools.cache
def _log_choice(name: str) -> None:
    how = f"from {ISA_ENV}" if os.environ.get(ISA_ENV) else "the best this CPU runs"
    logger.info("CPU kernels: %s (%s; %s)", name, how, cpu_model())


def clear_caches() -> None:
    """Forget every load and choice above, so the next call looks at the environment again
    (tests that set ``FASTDRAFT_ISA`` or ``FASTDRAFT_DISABLE_CPU_KERNELS``)."""
    for cached in (load_driver, cpu_features, _load_isa, load_cpu_kernels, _log_choice):
        cached.cache_clear()
