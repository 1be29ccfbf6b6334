"""The GPU step (``models/cuda_decoder.py``) against the module path, its twin, over flat
batches that mix prompts, chunks, decodes and verifications: on a GPU when there is one, else
through Triton's interpreter on the CPU (fp32, tiny models)."""

from __future__ import annotations

import os

import pytest
import torch

from fastdraft.engine.loader import load_model
from fastdraft.kernels import triton_ops
from fastdraft.layers.kv_cache import PagedKVCache, Span, flat_batch
from fastdraft.models.cuda_decoder import CudaDecoder

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.skipif(not triton_ops.is_available(), reason="Triton is not installed"),
    pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                       reason="Triton runs on the CPU only through its interpreter (TRITON_INTERPRET=1, set by conftest)"),
]
BLOCK_SIZE = 16


def _decoder(model) -> CudaDecoder:
    if DEVICE == "cuda":
        decoder = model.fused_decoder(BLOCK_SIZE)
        assert isinstance(decoder, CudaDecoder)
        return decoder
    return CudaDecoder(model, model.dtype, model.device, model.min_rows)  # the interpreter runs it on the CPU


def _steps(vocab_size: int):
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, vocab_size, (40,), generator=gen).tolist() for _ in range(3)]
    tables = [[5, 2, 7], [1, 6, 3], [0, 4, 8]]
    # (sequence, first position, number of tokens) per step: prompts, a chunked prompt, decode
    # rows and a verification's four tokens.
    steps = [[(0, 0, 19), (1, 0, 6)], [(0, 19, 1), (1, 6, 11), (2, 0, 3)], [(0, 20, 4), (1, 17, 1), (2, 3, 30)],
             [(0, 24, 1), (1, 18, 1), (2, 33, 1)]]
    return tokens, tables, steps


@pytest.mark.parametrize("variant", ["llama", "qwen2", "llama_tied", "qwen3", "mistral_nemo", "rope_yarn"])
@torch.inference_mode()
def test_gpu_step_matches_the_module_path(tiny_models, variant):
    loaded = load_model(tiny_models.dir(variant), dtype="fp32", device=DEVICE)
    model = loaded.model
    decoder = _decoder(model)
    tokens, tables, steps = _steps(loaded.config.vocab_size)
    caches = [PagedKVCache.from_config(loaded.config, 9, BLOCK_SIZE, dtype=torch.float32, device=DEVICE)
              for _ in range(2)]
    for i, step in enumerate(steps):
        spans = [Span(tokens[seq][start:start + num], start, tables[seq]) for seq, start, num in step]
        input_ids, meta = flat_batch(spans, BLOCK_SIZE, DEVICE)
        want = model(input_ids, meta.positions, caches[0], meta)  # [num_tokens, hidden_size]
        got = model(input_ids, meta.positions, caches[1], meta, decoder)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4, msg=f"step {i}")
    # Every key and value the step wrote is the module path's.
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(caches[1].v, caches[0].v, atol=2e-4, rtol=1e-4)


@torch.inference_mode()
def test_padding_rows_write_nothing(tiny_models):
    """A step of fewer tokens than ``min_rows`` runs its matmuls over padding rows: they are
    never written to the cache, and the tokens' rows come back alone."""
    loaded = load_model(tiny_models.dir("llama"), dtype="fp32", device=DEVICE)
    decoder = _decoder(loaded.model)
    assert decoder.min_rows > 1
    cache = PagedKVCache.from_config(loaded.config, 4, BLOCK_SIZE, dtype=torch.float32, device=DEVICE)
    input_ids, meta = flat_batch([Span([5], 0, [2])], BLOCK_SIZE, DEVICE)
    hidden = decoder.forward_paged(input_ids, meta.positions, cache, meta)
    assert hidden.shape == (1, loaded.config.hidden_size)
    written = cache.k.abs().sum(dim=(0, 2, 4))  # [num_blocks, block_size]
    assert written[2, 0] > 0 and written.count_nonzero() == 1


def test_build_declines_what_it_cannot_run(tiny_models):
    cpu = load_model(tiny_models.dir("llama"), dtype="fp32")
    assert CudaDecoder.build(cpu.model, BLOCK_SIZE) is None  # not on a GPU
    if DEVICE == "cuda":
        gpu = load_model(tiny_models.dir("llama"), dtype="fp32", device=DEVICE)
        assert CudaDecoder.build(gpu.model, 8) is None  # blocks the Triton attention does not take
        handle = gpu.model.model.layers[0].mlp.register_forward_hook(lambda *args: None)
        assert gpu.model.fused_decoder(BLOCK_SIZE) is None  # someone observes a module
        handle.remove()
