"""Sliding-window layers in the paged cache: blocks every holder's window has passed give back
their local layers' memory, and the engine's output stays the module path's."""

from __future__ import annotations

import pytest
import torch

from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.engine.loader import load_model
from fastdraft.engine.sequence import Sequence
from fastdraft.kernels.memory import resident_bytes
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.sampling_params import SamplingParams
from tests.helpers import append_pass

WINDOW, BLOCK = 32, 16


def _computed(manager: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """``seq`` grown to ``num_tokens`` computed tokens, as the scheduler grows it."""
    seq.token_ids.extend(range(len(seq.token_ids), num_tokens))
    manager.append_slots(seq, num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = num_tokens
    manager.commit(seq)


def test_blocks_the_window_passed_are_reported_once_no_holder_needs_them():
    passed: list[int] = []
    manager = BlockManager(64, BLOCK, window=WINDOW, on_window_passed=passed.extend)
    seq = Sequence(list(range(40)))
    manager.allocate(seq, 40)
    seq.num_computed_tokens = 40
    manager.commit(seq)
    assert passed == []  # token 40 sees keys 9..40: block 0 is still read
    _computed(manager, seq, 200)
    # Token 200 sees keys 169..200: blocks 0..9 (positions < 160) are passed, block 10 is not.
    assert passed == seq.block_table[:10] and seq.num_window_passed_blocks == 10
    held = len(seq.block_table)
    assert held == 13  # the block ids stay held for the global layers

    # A second sequence sharing the first 96 tokens holds blocks 0..5 inside its own window.
    other = Sequence(seq.token_ids[:100])
    manager.allocate(other, 100 - 96)
    assert other.num_cached_tokens == 0  # blocks 4 and 5, which its window needs, were released
    manager.free(other)


def test_a_prefix_is_reused_only_while_its_windows_blocks_are_whole():
    manager = BlockManager(64, BLOCK, window=WINDOW)
    first = Sequence(list(range(100)))
    manager.allocate(first, 100)
    first.num_computed_tokens = 100
    manager.commit(first)
    # Token 100 sees keys 69..100: blocks 0..3 are passed and released, 4 and 5 stay whole.
    assert [manager.blocks[b].is_window_released for b in first.block_table[:6]] == [True] * 4 + [False] * 2
    again = Sequence(list(range(100)) + [7])
    assert len(manager.cached_prefix_blocks(again)) == 6  # the window of token 96 reaches blocks 4, 5
    _computed(manager, first, 160)  # now blocks 4 and 5 are released too
    assert manager.cached_prefix_blocks(again) == []
    manager.free(first)


@pytest.fixture(scope="module")
def gemma_w32(tiny_models):
    return load_model(tiny_models.dir("gemma3_w32"), dtype="fp32")


def _module_path_greedy(loaded, prompt: list[int], num_new: int) -> list[int]:
    model = loaded.model
    cache = SequenceCache.from_config(loaded.config, len(prompt) + num_new, dtype=torch.float32)
    out, ids = [], prompt
    with torch.inference_mode():
        for _ in range(num_new):
            logits = append_pass(model, cache, ids, logit_rows=[len(ids) - 1])
            ids = [int(logits[0].argmax())]
            out.append(ids[0])
    return out


@pytest.mark.parametrize("config", [
    EngineConfig(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=24),  # chunks cross the window
    EngineConfig(num_blocks=20, block_size=BLOCK, max_num_batched_tokens=64),  # preemption
], ids=["chunked", "preempted"])
def test_engine_with_window_release_matches_the_module_path(gemma_w32, config):
    gen = torch.Generator().manual_seed(3)
    vocab = gemma_w32.config.vocab_size
    shared = torch.randint(3, vocab, (70,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (60, 5, 90)]
    want = [_module_path_greedy(gemma_w32, p, 40) for p in prompts]
    engine = LLMEngine(gemma_w32, config)
    assert engine.runner.decoder is not None  # the C++ step, with its window
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * len(prompts)
    outputs = run_to_completion(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert engine.block_manager.num_window_released > 0
    # A prefix hit on the shared prompt, after the first run's windows moved on.
    (again,) = run_to_completion(engine, [prompts[1]], [SamplingParams(max_tokens=40, ignore_eos=True)])
    assert again.outputs[0].token_ids == want[1]
    if config.num_blocks == 20:
        assert engine.scheduler.num_preemptions > 0


def test_a_long_sequence_keeps_the_global_layers_and_the_local_windows(gemma_w32):
    engine = LLMEngine(gemma_w32, EngineConfig(num_blocks=32, block_size=BLOCK, enable_prefix_caching=False))
    prompt = torch.randint(3, gemma_w32.config.vocab_size, (400,), generator=torch.Generator().manual_seed(4)).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    while seq.num_output_tokens < 39:
        engine.step()
    num_tokens = seq.num_computed_tokens
    cache = engine.kv_cache
    blocks_per_layer = -(-num_tokens // BLOCK)
    page_per_block = cache.k[0, 0].numel() * cache.k.element_size()
    assert page_per_block == 4096
    local, full = cache.windowed_layers, [i for i in range(cache.k.shape[0]) if i not in cache.windowed_layers]
    assert local and full
    # Global layers: every block (or more: a huge page backs the untouched blocks too); local
    # layers: the window's blocks (2 of 16 tokens, plus the partly filled one), the passed ones
    # given back.
    for i in full:
        assert resident_bytes(cache.k[i]) >= blocks_per_layer * page_per_block
    window_blocks = WINDOW // BLOCK + 1
    for i in local:
        assert resident_bytes(cache.k[i]) <= (window_blocks + 1) * page_per_block
        assert resident_bytes(cache.v[i]) <= (window_blocks + 1) * page_per_block
