"""Gemma 3 on its decoder plan: logits parity with ``transformers``' ``Gemma3ForCausalLM`` on a
tiny random model whose local layers' window is shorter than the text."""

from __future__ import annotations

import pytest
import torch

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.engine.loader import load_model
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.model_config import ModelConfig
from fastdraft.models.plan import decoder_plan
from fastdraft.sampling_params import SamplingParams
from tests.helpers import append_pass

NUM_TOKENS = 40  # five windows of 8


@pytest.fixture(scope="module")
def gemma(tiny_models):
    """(our fp32 model loaded from the HF folder, the HF reference, token ids [NUM_TOKENS])."""
    loaded = load_model(tiny_models.dir("gemma3"), dtype="fp32")
    ids = torch.randint(3, loaded.config.vocab_size, (NUM_TOKENS,), generator=torch.Generator().manual_seed(1))
    return loaded, tiny_models.hf("gemma3"), ids


def test_the_config_and_plan_read_gemmas_fields(gemma):
    loaded, hf, _ = gemma
    config = loaded.config
    assert config.model_type == "gemma3_text" and config.sliding_window == 8
    assert config.rope_local_base_freq == 100.0 and config.rope_theta == 10000.0
    plan = decoder_plan(config)
    windows = [layer.attention.sliding_window for layer in plan.layers]
    assert windows == [8, 8, 8, 8, 8, None]
    assert {layer.attention.rotary.base for layer in plan.layers} == {100.0, 10000.0}
    assert plan.layers[0].attention.scale == 24 ** -0.5 and plan.embedding_scale == 64 ** 0.5
    assert {"sliding_window", "qk_norm", "post_norm", "offset_norm", "activation_gelu_tanh",
            "per_layer_rotary", "embedding_scale"} <= plan.features()
    # The round trip HF -> ours -> HF keeps what transformers reads.
    assert ModelConfig.from_dict(config.to_hf_dict()) == config


@pytest.mark.parametrize("chunk", [NUM_TOKENS, 5])
@torch.inference_mode()
def test_logits_match_transformers_across_the_window(gemma, chunk):
    loaded, hf, ids = gemma
    ref = hf(ids[None]).logits[0]  # [NUM_TOKENS, vocab_size]
    assert ref.abs().max() > 0.5
    model = loaded.model
    cache = SequenceCache.from_config(loaded.config, NUM_TOKENS, dtype=torch.float32)
    rows = []
    for start in range(0, NUM_TOKENS, chunk):  # prefill in chunks that cross the window
        part = ids[start:start + chunk].tolist()
        rows.append(append_pass(model, cache, part, logit_rows=list(range(len(part)))))
    torch.testing.assert_close(torch.cat(rows), ref, atol=1e-4, rtol=1e-4)


def test_greedy_decoding_matches_transformers(gemma):
    loaded, hf, ids = gemma
    prompt = ids[:6].tolist()
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                           min_new_tokens=20)[0, len(prompt):].tolist()
    engine = LLMEngine(loaded, EngineConfig(num_blocks=16, block_size=16))
    (out,) = run_to_completion(engine, [prompt], [SamplingParams(max_tokens=20, ignore_eos=True)])
    assert out.outputs[0].token_ids == want
