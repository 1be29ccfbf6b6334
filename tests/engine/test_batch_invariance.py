"""Batch invariance: in the engine's mode, a sequence's logits, compared with ``torch.equal``,
do not depend on what else is in the step, on how its prompt was chunked, or on whether its
prefix came from the cache (a recomputed sequence after preemption is a plain prefill again).

Every case runs steps with more than 160 rows (where weight-only linears switch to
dequantize + AMX GEMM on CPUs with AMX, outside the mode) and bf16 linears with more than
8 rows (where the dense kernel hands over to oneDNN outside the mode), so the test can fail
on any CPU."""

from __future__ import annotations

import pytest
import torch

from fastdraft.engine.loader import load_model
from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.kernels.mode import batch_invariant
from fastdraft.layers.kv_cache import PagedKVCache
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.quantizer import quantize_model
from tests.helpers import paged_batch

BLOCK_SIZE = 16


def _has_avx512_bf16() -> bool:
    ext = load_cpu_kernels()
    return ext is not None and ext.dense_bf16_supports(torch.zeros(1, 32, dtype=torch.bfloat16),
                                                       torch.zeros(1, 32, dtype=torch.bfloat16))


pytestmark = pytest.mark.skipif(not _has_avx512_bf16(), reason="batch invariance needs fastdraft's AVX512-BF16 kernels")


class PagedRunner:
    """Steps over hand-placed blocks: each request is (token ids, first new position, number
    of new tokens, block table); returns the fp32 logits of every new token, per request."""

    def __init__(self, loaded, num_blocks: int) -> None:
        self.model = loaded.model
        self.cache = PagedKVCache.from_config(loaded.config, num_blocks, BLOCK_SIZE, dtype=loaded.model.dtype)

    @torch.inference_mode()
    def step(self, requests: list[tuple[list[int], int, int, list[int]]]) -> list[torch.Tensor]:
        ids, meta, starts = paged_batch(requests, BLOCK_SIZE)
        with batch_invariant():
            hidden = self.model(ids, meta.positions, self.cache, meta)  # [num_tokens, hidden_size]
            logits = self.model.compute_logits(hidden)  # [num_tokens, vocab_size]
        return [logits[s:e] for s, e in zip(starts, starts[1:])]


def blocks(first: int, num_tokens: int) -> list[int]:
    return list(range(first, first + -(-num_tokens // BLOCK_SIZE)))


def check_invariance(loaded, vocab_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab_size, (200,), generator=gen).tolist()
    other = torch.randint(vocab_size, (170,), generator=gen).tolist()  # a 170-row prefill
    sibling = prompt[:64] + torch.randint(vocab_size, (40,), generator=gen).tolist()  # same first 4 blocks
    next_token = int(torch.randint(vocab_size, (1,), generator=gen))

    # The reference: the prompt alone in one step, then one decode step alone.
    runner = PagedRunner(loaded, 128)
    table = blocks(0, len(prompt) + 1)
    alone = runner.step([(prompt, 0, len(prompt), table)])[0]  # [200, vocab]
    decode_alone = runner.step([(prompt + [next_token], len(prompt), 1, table)])[0]

    # Beside a 170-token prefill.
    runner = PagedRunner(loaded, 128)
    together = runner.step([(other, 0, len(other), blocks(50, len(other))), (prompt, 0, len(prompt), table)])[1]
    assert torch.equal(together, alone)
    # Its decode step beside another long prefill, with the other sequence first.
    decode = runner.step([(other + sibling, len(other), len(sibling), blocks(50, len(other) + len(sibling))),
                          (prompt + [next_token], len(prompt), 1, table)])[1]
    assert torch.equal(decode, decode_alone)

    # Chunked: 70 tokens, then the rest beside another prefill.
    runner = PagedRunner(loaded, 128)
    first = runner.step([(prompt, 0, 70, table)])[0]
    rest = runner.step([(prompt, 70, len(prompt) - 70, table), (other, 0, len(other), blocks(50, len(other)))])[0]
    assert torch.equal(torch.cat([first, rest]), alone)

    # Prefix from the cache: a sibling wrote the first 64 tokens' blocks; the prompt computes the rest.
    runner = PagedRunner(loaded, 128)
    sibling_table = blocks(100, len(sibling))
    runner.step([(sibling, 0, len(sibling), sibling_table)])
    shared_table = sibling_table[:4] + blocks(4, len(prompt) + 1 - 64)
    cached = runner.step([(prompt, 64, len(prompt) - 64, shared_table), (other, 0, len(other), blocks(50, len(other)))])[0]
    assert torch.equal(cached, alone[64:])


@pytest.mark.parametrize("weights", ["bf16", "int4"])
@pytest.mark.parametrize("variant", ["qwen2", "gemma3"])  # gemma3: windowed layers, every norm kind
def test_tiny_model_logits_do_not_depend_on_the_batch(tiny_models, variant, weights):
    loaded = load_model(tiny_models.dir(variant), dtype="bf16")
    if weights == "int4":
        quantize_model(loaded.model, QuantConfig(method="rtn", group_size=32), show_progress=False)
    check_invariance(loaded, loaded.config.vocab_size)


@pytest.mark.real_model
@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_real_model_logits_do_not_depend_on_the_batch(real_model_dir, weights):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loaded = load_model(real_model_dir, dtype="bf16", load_in_low_bit="sym_int4" if weights == "int4" else None)
        check_invariance(loaded, loaded.config.vocab_size)
    finally:  # the tests after this one keep their thread count (conftest.py sets it)
        torch.set_num_threads(threads)
