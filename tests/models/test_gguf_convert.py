"""GGUF -> HF conversion on tiny GGUF files written like llama.cpp writes them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fastdraft.model_config import ModelConfig
from fastdraft.engine.loader import load_model
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.models.gguf_convert import GGUFError, unpermute_llama, convert_gguf_to_hf
from fastdraft.models.files import load_state_dict
from fastdraft.tokenizer import Tokenizer
from tests.helpers import (CHAT_TEMPLATE, LLAMA3_PATTERN, TEKKEN_PATTERN, build_tiny_tokenizer, llama_cpp_permute,
                           write_tiny_gguf)

CASES = [("llama", "llama"), ("llama_tied", "llama"), ("qwen2", "qwen2")]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, tiny_models, tiny_tokenizer):
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for variant, arch in CASES:
        path = root / f"{variant}.gguf"
        write_tiny_gguf(path, tiny_models.hf(variant), tiny_tokenizer, arch)
        files[variant] = path
    return files


@pytest.mark.parametrize("heads,rows,cols", [(4, 64, 64), (2, 32, 64), (1, 16, 8), (8, 128, 3)])
def test_unpermute_inverts_llama_cpp_permute(heads, rows, cols):
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    permuted = llama_cpp_permute(w, heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_llama(permuted, heads), w)


@pytest.mark.parametrize("variant,arch", CASES)
def test_convert_recovers_weights_exactly(gguf_files, tiny_models, tmp_path, variant, arch):
    out = convert_gguf_to_hf(gguf_files[variant], tmp_path / "hf", dtype=torch.float32)
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json", "generation_config.json"}
    hf = tiny_models.hf(variant)
    ref = hf.state_dict()
    got = load_state_dict(out)
    if variant == "llama_tied":
        assert "lm_head.weight" not in got
        ref = {k: v for k, v in ref.items() if k != "lm_head.weight"}
    assert set(got) == set(ref)
    for name, tensor in ref.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=name)

    config = ModelConfig.from_file(out / "config.json")
    assert config.model_type == arch
    assert config.tie_word_embeddings == (variant == "llama_tied")
    assert config.attention_bias == (arch == "qwen2")
    assert (config.num_attention_heads, config.num_key_value_heads) == \
        (hf.config.num_attention_heads, hf.config.num_key_value_heads)
    assert config.rope_theta == pytest.approx(ModelConfig.from_dict(hf.config.to_dict()).rope_theta)
    assert config.vocab_size == hf.config.vocab_size
    assert 2 in config.eos_token_ids  # <|im_end|>


@pytest.mark.parametrize("variant,arch", CASES)
def test_converted_folder_loads_and_matches_reference_logits(gguf_files, tiny_models, tmp_path, variant, arch):
    out = convert_gguf_to_hf(gguf_files[variant], tmp_path / "hf", dtype=torch.float32)
    loaded = load_model(out, dtype="fp32")
    ids = torch.randint(3, loaded.config.vocab_size, (10,), generator=torch.Generator().manual_seed(0))
    cache = SequenceCache.from_config(loaded.config, 16, dtype=torch.float32)
    with torch.inference_mode():
        input_ids, meta = cache.append(ids)
        hidden = loaded.model(input_ids, meta.positions, cache.kv_cache, meta)  # [10, hidden_size]
        logits = loaded.model.compute_logits(hidden)  # [10, vocab_size]
        ref = tiny_models.hf(variant)(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_converted_tokenizer_matches_source(gguf_files, tiny_models, tmp_path):
    out = convert_gguf_to_hf(gguf_files["llama"], tmp_path / "hf", dtype=torch.float32)
    ours, source = Tokenizer(out), Tokenizer(tiny_models.dir("llama"))
    for text in ["def add(a, b):\n    return a + b", "héllo 日本語 😀", "  spaces\t\ttabs\n\n\n",
                 "<|im_start|>user\nhi<|im_end|>\n", "I'm 12345 THEY'LL"]:
        assert ours.encode(text) == source.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["bos_token"] == "<|endoftext|>"
    assert cfg["chat_template"] == CHAT_TEMPLATE and cfg["add_bos_token"] is False
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_default_dtype_is_bf16(gguf_files, tmp_path):
    out = convert_gguf_to_hf(gguf_files["qwen2"], tmp_path / "hf")
    assert all(t.dtype == torch.bfloat16 for t in load_state_dict(out).values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_reconversion_replaces_existing_folder(gguf_files, tmp_path):
    out = tmp_path / "hf"
    convert_gguf_to_hf(gguf_files["llama"], out, dtype=torch.float32)
    (out / "stale.txt").write_text("old")
    convert_gguf_to_hf(gguf_files["qwen2"], out, dtype=torch.float32)
    assert not (out / "stale.txt").exists()
    assert ModelConfig.from_file(out / "config.json").model_type == "qwen2"
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folders left


@pytest.mark.parametrize("keep", [10, 200, 0.5, -16])
def test_truncated_gguf_raises_value_error(gguf_files, tmp_path, keep):
    data = gguf_files["llama"].read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep > 0 else len(data) + keep)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:n])
    with pytest.raises(ValueError) as info:
        convert_gguf_to_hf(bad, tmp_path / "out")
    assert isinstance(info.value, GGUFError)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]


def test_not_a_gguf_file_raises(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(GGUFError):
        convert_gguf_to_hf(bad, tmp_path / "out")


def test_unsupported_architecture_raises(tmp_path):
    import gguf

    path = tmp_path / "phi3.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'phi3'"):
        convert_gguf_to_hf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# Architectures and rotary scalings beyond the cases above, each as llama.cpp writes it: Qwen3
# (its q/k norms), Mistral-Nemo as "llama" (a head size of its own), Llama 3's scaling as
# rope_freqs.weight, linear and YaRN as metadata.
MORE_CASES = [("qwen3", "qwen3"), ("mistral_nemo", "llama"), ("llama3_rope", "llama"), ("rope_linear", "llama"),
              ("rope_yarn", "qwen2")]


@pytest.mark.parametrize("variant,arch", MORE_CASES)
def test_more_architectures_convert_to_the_same_logits(tiny_models, tiny_tokenizer, tmp_path, variant, arch):
    path = tmp_path / f"{variant}.gguf"
    hf = tiny_models.hf(variant)
    write_tiny_gguf(path, hf, tiny_tokenizer, arch)
    out = convert_gguf_to_hf(path, tmp_path / "hf", dtype=torch.float32)
    config = ModelConfig.from_file(out / "config.json")
    ours = ModelConfig.from_file(tiny_models.dir(variant) / "config.json")
    assert (config.model_type, config.head_dim) == ("qwen3" if arch == "qwen3" else ours.model_type.replace("mistral", "llama"),
                                                    ours.head_dim)
    assert (config.rope_scaling or {}).get("rope_type") == (ours.rope_scaling or {}).get("rope_type")
    loaded = load_model(out, dtype="fp32")
    ids = torch.randint(3, loaded.config.vocab_size, (120,), generator=torch.Generator().manual_seed(0))
    cache = SequenceCache.from_config(loaded.config, 128, dtype=torch.float32)
    with torch.inference_mode():
        input_ids, meta = cache.append(ids)
        logits = loaded.model.compute_logits(loaded.model(input_ids, meta.positions, cache.kv_cache, meta))
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-3, rtol=0)


@pytest.mark.parametrize("pre,pattern", [("llama-bpe", LLAMA3_PATTERN), ("tekken", TEKKEN_PATTERN)])
def test_each_pre_tokenizer_rebuilds_its_source(tiny_models, tmp_path, pre, pattern):
    # A byte-level BPE trained with that family's split, written with llama.cpp's name for it.
    source = build_tiny_tokenizer(pattern)
    (tmp_path / "src").mkdir()
    source.save(str(tmp_path / "src" / "tokenizer.json"))
    path = tmp_path / f"{pre}.gguf"
    write_tiny_gguf(path, tiny_models.hf("llama"), source, "llama", pre=pre)
    out = convert_gguf_to_hf(path, tmp_path / "hf", dtype=torch.float32)
    ours, reference = Tokenizer(out), Tokenizer(tmp_path / "src")
    for text in ["def add(a, b):\n    return a + b  # 12345", "HTTPServer getURLPath camelCase ALLCAPS",
                 "héllo 日本語 😀 naïve Ünïcode", "  spaces\t\ttabs\n\n\n", "I'm THEY'LL we've 3.14159"]:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == text


def test_unknown_pre_tokenizer_is_refused(tiny_models, tiny_tokenizer, tmp_path):
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, tiny_models.hf("llama"), tiny_tokenizer, "llama", pre="chameleon")
    with pytest.raises(GGUFError, match="unsupported GGUF pre-tokenizer 'chameleon'; supported: default"):
        convert_gguf_to_hf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
