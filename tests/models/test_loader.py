"""Resolving a model reference and building the model from HF-named weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from fastdraft.model_config import ModelConfig
from fastdraft.engine.loader import load_model
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.models.files import build_model, load_state_dict, parse_dtype, resolve_model_dir
from tests.helpers import write_tiny_gguf


def test_load_model_from_hf_folder(llama_dir):
    loaded = load_model(llama_dir, dtype="fp32")
    assert loaded.model_dir == llama_dir
    assert loaded.model.dtype == torch.float32 and loaded.model.device.type == "cpu"
    assert loaded.config.model_type == "llama" and loaded.tokenizer.vocab_size == 320
    assert not loaded.model.training
    assert not any(p.device.type == "meta" for p in loaded.model.parameters())
    bf16 = load_model(str(llama_dir))  # default dtype, str path
    assert bf16.model.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.model.lm_head.weight.float(), loaded.model.lm_head.weight,
                               atol=1e-2, rtol=1e-2)


def test_resolve_errors(tmp_path, llama_dir):
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model_dir("definitely-not-a-model")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no .safetensors"):
        resolve_model_dir(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model_dir(text)
    assert resolve_model_dir(llama_dir) == llama_dir


def test_gguf_path_is_converted_once_into_the_cache(tmp_path, isolated_home, tiny_models, tiny_tokenizer):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_models.hf("qwen2"), tiny_tokenizer, "qwen2")
    out = resolve_model_dir(path)
    assert out.parent == isolated_home / "gguf" and out.name.startswith("tiny-")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(path) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not converted again
    loaded = load_model(path, dtype="fp32")
    ids = [5, 9, 30, 7, 100]
    cache = SequenceCache.from_config(loaded.config, 8, dtype=loaded.model.dtype)
    with torch.inference_mode():
        input_ids, meta = cache.append(ids)
        hidden = loaded.model(input_ids, meta.positions, cache.kv_cache, meta)  # [5, hidden_size]
        logits = loaded.model.compute_logits(hidden)  # [5, vocab_size]
        ref = tiny_models.hf("qwen2")(torch.tensor([ids])).logits[0]
    # The cached folder is bf16: close to, not equal to, the fp32 reference.
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()


def test_load_state_dict_corrupt_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="cannot read weights"):
        load_state_dict(tmp_path)


def test_build_model_rejects_mismatched_checkpoint(llama_dir):
    config = ModelConfig.from_file(llama_dir / "config.json")
    state = load_state_dict(llama_dir)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="missing"):
        build_model(config, missing, torch.float32)
    extra = dict(state, **{"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected"):
        build_model(config, extra, torch.float32)
    # HF's rotary buffers are ignored, and a tied model tolerates a stored lm_head.
    ok = dict(state, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)})
    build_model(config, ok, torch.float32)


def test_tied_checkpoint_with_lm_head_present(tmp_path, tiny_models):
    src = tiny_models.dir("llama_tied")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    state = load_state_dict(src)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path, dtype="fp32").model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("fp32") is torch.float32
    assert parse_dtype("float16") is torch.float16 and parse_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("int3")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_requested_without_cuda(llama_dir):
    with pytest.raises(ValueError, match="CUDA is not available"):
        load_model(llama_dir, device="cuda")


def test_config_written_by_to_hf_dict_round_trips(tmp_path, llama_dir):
    config = ModelConfig.from_file(llama_dir / "config.json")
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    again = ModelConfig.from_file(tmp_path / "config.json")
    assert again == config


def test_generation_config_adds_its_stop_tokens(llama_dir, tmp_path):
    # Llama 3.x Instruct lists <|eot_id|> and <|eom_id|> there, beside config.json's EOS.
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    own = ModelConfig.from_file(folder / "config.json").eos_token_ids
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [own[0], 5, 7]}))
    assert load_model(folder, dtype="fp32").config.eos_token_ids == [*own, 5, 7]
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        load_model(folder, dtype="fp32")
