"""The real Gemma 3 270M (pulled once, then cached): its SentencePiece tokenizer rebuilt from
the GGUF file against ``transformers``' own reading of that file, and its dequantized weights
in fp32 against ``transformers``' ``Gemma3ForCausalLM`` over a text longer than the window."""

from __future__ import annotations

import pytest
import torch

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.engine.loader import load_model
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.models.registry import original_gguf, pull
from fastdraft.sampling_params import SamplingParams
from tests.helpers import append_pass

pytestmark = pytest.mark.real_model

MODEL = "gemma-3-270m"
TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and    runs   of spaces\n\n\n\ttabs and\r\nnewlines",
    "Unicode: naïve café, Größe, 東京, Привет, مرحبا, and emoji 🙂🚀👍🏽",
    "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n",
    "1234567890 3.14159 1e-9 0x1F",
]
PROMPTS = ["The capital of France is", "def quicksort(arr):\n", "Once upon a time,",
           "The three primary colors are", "import numpy as np\n\n"]


@pytest.fixture(scope="module")
def gemma_dir():
    return pull(MODEL)


@pytest.fixture(scope="module")
def reference(gemma_dir):
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


def test_the_tokenizer_is_the_gguf_files(gemma_dir):
    from transformers import AutoTokenizer

    ours = load_model(gemma_dir, dtype="fp32", keep_gguf_quant=False).tokenizer
    gguf = original_gguf(MODEL)
    theirs = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text in TEXTS:
        ids = ours.backend.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.backend.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("hi")[0] == ours.backend.token_to_id("<bos>")  # the file asks for a BOS


@torch.inference_mode()
def test_logits_match_transformers_over_more_than_a_window(gemma_dir, reference):
    loaded = load_model(gemma_dir, dtype="fp32", keep_gguf_quant=False)
    text = " ".join(TEXTS * 12)
    ids = loaded.tokenizer.encode(text)[:600]
    assert len(ids) == 600 and loaded.config.sliding_window == 512
    want = reference(torch.tensor([ids])).logits[0]  # [600, vocab_size]
    cache = SequenceCache.from_config(loaded.config, len(ids), dtype=torch.float32)
    got = torch.cat([append_pass(loaded.model, cache, ids[i:i + 200], logit_rows=list(range(200)))
                     for i in range(0, 600, 200)])  # chunks of a prefill that crosses the window
    assert (got - want).abs().max() < 1e-3


def test_greedy_tokens_match_transformers(gemma_dir, reference):
    loaded = load_model(gemma_dir, dtype="fp32", keep_gguf_quant=False)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=len(PROMPTS), max_model_len=256, num_blocks=64))
    prompt_ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    outputs = run_to_completion(engine, prompt_ids, [SamplingParams(max_tokens=64, ignore_eos=True)] * len(PROMPTS))
    with torch.inference_mode():
        for ids, out in zip(prompt_ids, outputs):
            want = reference.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64,
                                      do_sample=False)[0, len(ids):].tolist()
            assert out.outputs[0].token_ids == want
