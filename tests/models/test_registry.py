"""Model registry and the offline pull: chunk assembly with size and sha256 checks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fastdraft.model_config import ModelConfig
from fastdraft.models.plan import decoder_plan
from fastdraft.models import registry
from fastdraft.models.registry import (
    KNOWN_MODELS,
    ModelSource,
    PullError,
    Wheel,
    assemble_gguf,
    chunk_files,
    fastdraft_home,
    is_ready,
    model_dir,
    pull,
)


def _chunks(tmp_path: Path, sizes=(1000, 2500, 7)) -> tuple[list[Path], bytes]:
    data = b""
    paths = []
    for i, n in enumerate(sizes):
        p = tmp_path / "chunks" / f"part{i}.bin"
        p.parent.mkdir(exist_ok=True)
        content = bytes((i * 31 + j) % 251 for j in range(n))
        p.write_bytes(content)
        paths.append(p)
        data += content
    return paths, data


def _source(data: bytes, **overrides) -> ModelSource:
    fields = dict(name="fake", description="fake model", wheels=(Wheel("fake-part1", "1.0", "0" * 64),),
                  chunk_glob="*/part*.bin", gguf_sha256=hashlib.sha256(data).hexdigest(),
                  gguf_num_bytes=len(data), architecture=KNOWN_MODELS["smollm2-135m-instruct"].architecture)
    fields.update(overrides)
    return ModelSource(**fields)


def _leftovers(out_dir: Path) -> list[str]:
    return sorted(p.name for p in out_dir.iterdir()) if out_dir.exists() else []


def test_assemble_joins_chunks_in_order(tmp_path, monkeypatch):
    paths, data = _chunks(tmp_path)
    monkeypatch.setattr(registry, "chunk_files", lambda source: paths)
    out = tmp_path / "out" / "m.gguf"
    assert assemble_gguf(_source(data), out) == out
    assert out.read_bytes() == data
    assert _leftovers(out.parent) == ["m.gguf"]


def test_corrupt_chunk_raises_and_leaves_nothing(tmp_path, monkeypatch):
    paths, data = _chunks(tmp_path)
    source = _source(data)
    corrupted = bytearray(paths[1].read_bytes())
    corrupted[100] ^= 0xFF  # same size, different content
    paths[1].write_bytes(bytes(corrupted))
    monkeypatch.setattr(registry, "chunk_files", lambda source: paths)
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(PullError, match="sha256 mismatch"):
        assemble_gguf(source, out)
    assert not out.exists()
    assert not out.with_name(".m.gguf.partial").exists()
    assert _leftovers(out.parent) == []


def test_wrong_size_raises_before_writing(tmp_path, monkeypatch):
    paths, data = _chunks(tmp_path)
    monkeypatch.setattr(registry, "chunk_files", lambda source: paths[:2])  # a chunk missing
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(PullError, match=f"expected {len(data)}"):
        assemble_gguf(_source(data), out)
    assert not out.exists() and _leftovers(out.parent) == []


def test_chunk_order_matters(tmp_path, monkeypatch):
    paths, data = _chunks(tmp_path)
    monkeypatch.setattr(registry, "chunk_files", lambda source: list(reversed(paths)))
    with pytest.raises(PullError):
        assemble_gguf(_source(data), tmp_path / "out" / "m.gguf")


def test_existing_output_not_clobbered_on_failure(tmp_path, monkeypatch):
    paths, data = _chunks(tmp_path)
    monkeypatch.setattr(registry, "chunk_files", lambda source: paths)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    out.write_bytes(b"previous good file")
    with pytest.raises(PullError):
        assemble_gguf(_source(data, gguf_sha256="f" * 64), out)
    assert out.read_bytes() == b"previous good file"
    assert _leftovers(out.parent) == ["m.gguf"]


def test_chunk_files_of_missing_distribution():
    source = _source(b"x", wheels=(Wheel("fastdraft-no-such-distribution-xyz", "1.0", "0" * 64),))
    with pytest.raises(PullError, match="not installed"):
        chunk_files(source)


def test_chunk_files_of_distribution_without_chunks():
    # pytest is installed but holds no files matching the glob.
    source = _source(b"x", wheels=(Wheel("pytest", "0", "0" * 64),), chunk_glob="*/data/part*.bin")
    with pytest.raises(PullError, match="no model chunk files"):
        chunk_files(source)


def test_pull_unknown_name():
    with pytest.raises(ValueError, match="unknown model"):
        pull("no-such-model")


def test_home_and_model_dir_follow_env(isolated_home):
    assert fastdraft_home() == isolated_home
    assert model_dir("abc") == isolated_home / "models" / "abc"
    assert not is_ready("abc")
    d = model_dir("abc")
    d.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (d / name).write_text("{}")
    assert not is_ready("abc")
    (d / "tokenizer.json").write_text("{}")
    assert is_ready("abc")


def test_pull_of_ready_model_does_no_work(isolated_home, monkeypatch):
    name = next(iter(KNOWN_MODELS))
    d = model_dir(name)
    d.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (d / f).write_text("{}")

    def fail(*args, **kwargs):
        raise AssertionError("pull of a ready model must not install or assemble")

    monkeypatch.setattr(registry, "_install_wheels", fail)
    monkeypatch.setattr(registry, "assemble_gguf", fail)
    assert pull(name) == d


def test_known_models_are_well_formed():
    assert registry.DEFAULT_MODEL in KNOWN_MODELS
    for name, source in KNOWN_MODELS.items():
        assert source.name == name
        assert len(source.gguf_sha256) == 64 and int(source.gguf_sha256, 16) >= 0
        assert source.gguf_num_bytes > 0 and source.wheels
        for wheel in source.wheels:
            assert len(wheel.sha256) == 64 and wheel.version


def test_default_home(monkeypatch, tmp_path):
    monkeypatch.delenv("FASTDRAFT_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert fastdraft_home() == tmp_path / ".cache" / "fastdraft"


def test_every_known_model_has_a_shape():
    for name, source in KNOWN_MODELS.items():
        arch = source.architecture
        assert min(arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads,
                   arch.head_dim, arch.intermediate_size, arch.vocab_size) > 0, name
        assert arch.num_attention_heads % arch.num_key_value_heads == 0, name
        config = arch.model_config()
        assert (config.hidden_size, config.vocab_size, config.head_dim) == (arch.hidden_size, arch.vocab_size,
                                                                             arch.head_dim)
        assert len(decoder_plan(config).layers) == arch.num_hidden_layers, name


@pytest.mark.real_model
def test_the_shape_matches_the_pulled_models_config(real_model_dir):
    config = ModelConfig.from_file(real_model_dir / "config.json")
    arch = KNOWN_MODELS[real_model_dir.name].architecture
    fields = [name for name in arch.__dataclass_fields__ if name != "extra_fields"] + [
        name for name, _ in arch.extra_fields]
    for name in fields:
        expected = getattr(config, name)
        value = getattr(arch, name) if name in arch.__dataclass_fields__ else dict(arch.extra_fields)[name]
        assert value == (pytest.approx(expected) if isinstance(expected, float) else expected), name
