"""Parity with transformers on the real Qwen2.5-Coder-0.5B-Instruct (pulled once, then cached).

Both sides run the same weights in fp32: greedy generation must produce the same tokens.
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import pytest
import torch

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.sampling_params import SamplingParams
from fastdraft.tokenizer import IncrementalDetokenizer
from tests.conftest import REAL_MODEL

pytestmark = pytest.mark.real_model

NEW_TOKENS = 64
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
RAW_PROMPTS = {
    "code": "def quicksort(arr):\n",
    "text": "The three primary colors are",
    "unicode": "# 计算斐波那契数列 (Fibonacci) — naïve version\ndef fib(n):",
}


@pytest.fixture(scope="module")
def prompts(real_model_fp32) -> dict[str, list[int]]:
    tok = real_model_fp32.tokenizer
    out = {name: tok.encode(text) for name, text in RAW_PROMPTS.items()}
    out["chat"] = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    return out


@pytest.fixture(scope="module")
def ours_greedy(real_model_fp32, prompts) -> dict[str, list[int]]:
    """Our greedy continuation of every prompt (EOS ignored), computed once by the serving
    engine, all prompts in one batch (its steps are batch-invariant: as if each ran alone)."""
    engine = LLMEngine(real_model_fp32, EngineConfig(max_num_seqs=len(prompts), max_model_len=256,
                                                     num_blocks=len(prompts) * 256 // 16))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = run_to_completion(engine, list(prompts.values()), [params] * len(prompts))
    return {name: out.outputs[0].token_ids for name, out in zip(prompts, outputs)}


@pytest.fixture(scope="module")
def hf_model(real_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS tokens
    yield model
    del model
    gc.collect()


def test_loaded_in_fp32(real_model_fp32):
    cfg = real_model_fp32.config
    assert real_model_fp32.model.dtype == torch.float32
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_key_value_heads) == ("qwen2", 24, 2)
    assert cfg.attention_bias and cfg.rope_theta == 1e6
    im_end = real_model_fp32.tokenizer.token_to_id("<|im_end|>")
    assert im_end in cfg.eos_token_ids


def test_greedy_generate_matches_transformers_generate(hf_model, prompts, ours_greedy):
    ids = prompts["chat"]
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    theirs = out[0, len(ids):].tolist()
    assert len(theirs) == NEW_TOKENS
    assert ours_greedy["chat"] == theirs


@pytest.mark.parametrize("name", ["chat", "code", "text", "unicode"])
def test_greedy_tokens_are_transformers_argmax(hf_model, real_model_fp32, prompts, ours_greedy, name):
    """Teacher-forced check: run transformers once over prompt + our tokens; its argmax at every
    step must be our token. By induction this is the same as transformers' greedy output."""
    ids, ours = prompts[name], ours_greedy[name]
    assert len(ours) == NEW_TOKENS
    full = ids + ours
    rows = list(range(len(ids) - 1, len(full) - 1))  # the positions that predicted our tokens
    with torch.inference_mode():
        ref = hf_model(torch.tensor([full])).logits[0, rows]  # [NEW_TOKENS, vocab]
        # Ours through the module path in one pass over the whole sequence.
        model = real_model_fp32.model
        cache = SequenceCache.from_config(real_model_fp32.config, 256, dtype=torch.float32)
        input_ids, meta = cache.append(full)
        logits = model.logits(input_ids, meta.positions, cache.kv_cache, meta, rows)  # [NEW_TOKENS, vocab]
    assert ref.argmax(-1).tolist() == ours
    # Our full-sequence logits agree with transformers' to fp32 accuracy (|logits| ~ 20-30),
    # not just in their argmax.
    assert (logits - ref).abs().max() < 1e-3
    # A real continuation, not a stuck token.
    assert len(set(ours)) > 10


def test_generated_text_is_sensible(real_model_fp32, ours_greedy):
    text = real_model_fp32.tokenizer.decode(ours_greedy["code"])
    assert "return" in text or "pivot" in text


# ----------------------------------------------------------------------------- tokenizer

TOKENIZER_TEXTS = [
    "def f(x):\n    return x  **  2  # square\n\n\n",
    "class Foo(Bar):\n\tdef __init__(self) -> None:\n\t\tpass\r\n",
    "héllo wörld — naïve café ÅÄÖ",
    "日本語のテキスト、中文文本 😀👍🏽 한국어",
    "    leading   spaces \t\t tabs   trailing   ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|fim_prefix|>def<|fim_suffix|>x<|fim_middle|>",
    "numbers 1234567 3.14159 0x1F, I'm can't we'll THEY'RE",
    "",
]


@pytest.fixture(scope="module")
def gguf_tokenizer():
    """transformers' tokenizer built from the ORIGINAL GGUF (not our converted folder)."""
    from transformers import AutoTokenizer

    from fastdraft.models.registry import KNOWN_MODELS, assemble_gguf

    with tempfile.TemporaryDirectory() as tmp:  # the 0.5 GB file does not outlive the fixture
        assemble_gguf(KNOWN_MODELS[REAL_MODEL], Path(tmp) / "m.gguf")
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file="m.gguf")
    return tok


@pytest.mark.parametrize("text", TOKENIZER_TEXTS)
def test_tokenizer_matches_transformers_gguf_tokenizer(real_model_fp32, gguf_tokenizer, text):
    ours = real_model_fp32.tokenizer
    ids = ours.encode(text)
    assert ids == gguf_tokenizer.encode(text, add_special_tokens=False)
    assert ids == gguf_tokenizer.encode(text)  # Qwen adds no BOS
    assert ours.decode(ids) == gguf_tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids(real_model_fp32, gguf_tokenizer):
    ours = real_model_fp32.tokenizer
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert ours.encode(special) == [ours.token_to_id(special)] == [gguf_tokenizer.convert_tokens_to_ids(special)]
    assert ours.token_to_id("<|im_end|>") == 151645 and ours.token_to_id("<|endoftext|>") == 151643


def test_chat_template_qwen_format(real_model_fp32, gguf_tokenizer):
    tok = real_model_fp32.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hello!"}])
    assert rendered == QWEN_SYSTEM + "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    convo = [{"role": "system", "content": "Answer in French."},
             {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Bonjour"},
             {"role": "user", "content": "Thanks"}]
    rendered = tok.apply_chat_template(convo)
    assert rendered == ("<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\nBonjour<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
                        "<|im_start|>assistant\n")
    for messages in ([{"role": "user", "content": "Hello!"}], convo):
        assert tok.apply_chat_template(messages) == gguf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("text", TOKENIZER_TEXTS[:5])
def test_incremental_detokenizer_real_vocab(real_model_fp32, text):
    tok = real_model_fp32.tokenizer
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
