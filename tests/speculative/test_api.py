"""The vLLM-style and HF-style front doors, with and without speculation."""

import pytest
import torch

import fastdraft
from fastdraft import LLM, AutoModelForCausalLM, SamplingParams
from fastdraft.speculative.speculative_config import SpeculativeConfig


def test_llm_generate_plain_and_self_speculative_agree(tiny_models):
    path = str(tiny_models.dir("qwen2"))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = LLM(model=path, dtype="fp32").generate(["def f(x):\n", "Hello"], params)
    # A fixed draft length: the load-aware policy's choice to draft depends on measured costs,
    # so it cannot be what this test checks.
    spec_llm = LLM(model=path, dtype="fp32", speculative_config=SpeculativeConfig(
        draft="self", num_speculative_tokens=3, is_adaptive=False))
    spec = spec_llm.generate(["def f(x):\n", "Hello"], params)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in spec]
    assert [o.outputs[0].text for o in plain] == [o.outputs[0].text for o in spec]
    assert spec[0].metrics.spec is not None and spec[0].metrics.spec.num_steps > 0
    assert spec[0].prompt == "def f(x):\n" and spec[0].prompt_token_ids
    chat = spec_llm.chat([{"role": "user", "content": "hi"}], params)
    assert len(chat.outputs[0].token_ids) == 24
    # The vLLM keywords build the adaptive config; whatever it drafts, the output is the same.
    adaptive = LLM(model=path, dtype="fp32", speculative_model="self", num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in adaptive.generate(["def f(x):\n"], params)] == \
        [plain[0].outputs[0].token_ids]


def test_llm_speculative_config_is_validated(tiny_models):
    path = str(tiny_models.dir("qwen2"))
    with pytest.raises(ValueError, match="not both"):
        LLM(model=path, dtype="fp32", speculative_model="self", speculative_config={"draft": "self"})
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(model=path, dtype="fp32", speculative_config={"num_drafts": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=path, dtype="fp32", speculative_config={"num_speculative_tokens": 0})


def test_hf_style_generate_with_speculative_true(tiny_models):
    path = str(tiny_models.dir("qwen2"))
    plain = AutoModelForCausalLM.from_pretrained(path, load_in_low_bit="fp32")
    spec = AutoModelForCausalLM.from_pretrained(path, load_in_low_bit="fp32", speculative=True)
    input_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    a = plain.generate(input_ids, max_new_tokens=16, do_sample=False, ignore_eos=True)
    b = spec.generate(input_ids, max_new_tokens=16, do_sample=False, ignore_eos=True)
    assert a.shape == (2, 20) and torch.equal(a, b) and torch.equal(a[:, :4], input_ids)
    # HF's assistant_model: a separately loaded draft of the same tokenizer.
    assistant = AutoModelForCausalLM.from_pretrained(str(tiny_models.dir("llama")), load_in_low_bit="fp32")
    c = plain.generate(input_ids, max_new_tokens=16, assistant_model=assistant, ignore_eos=True)
    assert torch.equal(a, c)
    sampled = spec.generate(input_ids[:1], max_new_tokens=8, do_sample=True, temperature=0.9, seed=3)
    assert torch.equal(sampled, spec.generate(input_ids[:1], max_new_tokens=8, do_sample=True,
                                              temperature=0.9, seed=3))


def test_bad_input_is_a_value_error(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models.dir("qwen2")), load_in_low_bit="fp32")
    with pytest.raises(ValueError):
        model.generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        model.generate(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="vocabulary"):
        model.generate(torch.tensor([[1, model.config.vocab_size]]))
    with pytest.raises(ValueError, match="vocabulary"):
        model.generate(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="speculative"):
        AutoModelForCausalLM.from_pretrained(str(tiny_models.dir("qwen2")), load_in_low_bit="fp32",
                                             speculative="yes")
    with pytest.raises(ValueError):
        LLM(model=str(tiny_models.dir("qwen2")), speculative_model="self", num_speculative_tokens=0)
    llm = LLM(model=str(tiny_models.dir("qwen2")), dtype="fp32", max_model_len=64)
    for prompts in (None, [123], ["ok", b"bytes"]):
        with pytest.raises(ValueError, match="prompts"):
            llm.generate(prompts)
    with pytest.raises(ValueError, match="a prompt is"):
        llm.engine.add_request(42)
    with pytest.raises(ValueError, match="empty"):
        llm.chat([])
    assert fastdraft.SpeculativeConfig().draft == "self"
