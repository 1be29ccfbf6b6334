"""The tiny model on CUDA (skipped without a GPU): the module path over the paged cache gives
the CPU's logits, alone and in flat batches; the engine decodes the CPU's tokens; a
verification's rows equal its one-token steps bit for bit."""

from __future__ import annotations

import pytest
import torch

from fastdraft.generator import TextGenerator
from fastdraft.engine.loader import load_model
from fastdraft.kernels.ops.attention_ops import per_token_attention, reference_paged_attention
from fastdraft.layers.kv_cache import PagedKVCache, SequenceCache, Span, flat_batch
from fastdraft.models.cuda_decoder import CudaDecoder
from fastdraft.sampling_params import SamplingParams
from tests.helpers import append_pass, assert_tokens_equal_one_token_calls

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    """Plain fp32 matmuls on the GPU, so the CPU comparison can be tight."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
@torch.inference_mode()
def test_cuda_logits_match_cpu(tiny_models, variant):
    cpu = load_model(tiny_models.dir(variant), dtype="fp32")
    gpu = load_model(tiny_models.dir(variant), dtype="fp32", device=DEVICE)
    assert gpu.model.device.type == DEVICE
    assert isinstance(gpu.model.fused_decoder(), CudaDecoder)  # the GPU step; the module path runs here
    ids = torch.randint(3, cpu.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    kv_cpu = SequenceCache.from_config(cpu.config, 64, dtype=torch.float32)
    kv_gpu = SequenceCache.from_config(gpu.config, 64, dtype=torch.float32, device=DEVICE)
    assert kv_gpu.kv_cache.k.device.type == DEVICE
    # A prompt, one-token steps, a verification's shape (several tokens on a non-empty cache),
    # then a chunk longer than the per-token attention takes (the masked SDPA path).
    for start, end in ((0, 12), (12, 13), (13, 14), (14, 15), (15, 16), (16, 20), (20, 31), (31, 32)):
        want = cpu.model.compute_logits(append_pass(cpu.model, kv_cpu, ids[start:end]))  # [end - start, vocab_size]
        got = gpu.model.compute_logits(append_pass(gpu.model, kv_gpu, ids[start:end])).cpu()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"tokens {start}:{end}")
    assert kv_gpu.num_tokens == 32


@torch.inference_mode()
def test_cuda_flat_batch_matches_cpu(tiny_models):
    """Steps mixing prompts, a chunked prompt, decodes and a verification, each sequence in
    blocks of its own, give the CPU's logits on every row."""
    cpu = load_model(tiny_models.dir("llama"), dtype="fp32")
    gpu = load_model(tiny_models.dir("llama"), dtype="fp32", device=DEVICE)
    block_size = 4
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, cpu.config.vocab_size, (30,), generator=gen).tolist() for _ in range(3)]
    tables = [[9, 2, 17, 4, 11, 0, 20, 6], [1, 13, 3, 22, 8, 15, 5, 18], [7, 19, 10, 23, 12, 14, 16, 21]]
    # (sequence, first position, number of tokens) per step
    steps = [[(0, 0, 9), (1, 0, 6)], [(0, 9, 1), (1, 6, 11), (2, 0, 3)], [(0, 10, 1), (1, 17, 1), (2, 3, 5)]]
    results = {}
    for loaded, device in ((cpu, "cpu"), (gpu, DEVICE)):
        kv = PagedKVCache.from_config(loaded.config, 24, block_size, dtype=torch.float32, device=device)
        results[device] = []
        for step in steps:
            spans = [Span(tokens[seq][start:start + num], start, tables[seq]) for seq, start, num in step]
            input_ids, meta = flat_batch(spans, block_size, device)
            assert meta.block_tables.device.type == meta.slot_mapping.device.type == device
            hidden = loaded.model(input_ids, meta.positions, kv, meta)  # [num_tokens, hidden_size]
            results[device].append(loaded.model.compute_logits(hidden).cpu())  # [num_tokens, vocab_size]
    for i, (got, want) in enumerate(zip(results[DEVICE], results["cpu"])):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"step {i}")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@torch.inference_mode()
def test_cuda_verification_rows_equal_one_token_steps(tiny_models, dtype):
    """Greedy speculative decoding on CUDA reproduces plain decoding only if each verified
    token's logits are, bit for bit, those of its one-token step."""
    gpu = load_model(tiny_models.dir("qwen2"), dtype=dtype, device=DEVICE)
    model = gpu.model
    ids = torch.randint(3, gpu.config.vocab_size, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    prompt, drafts = ids[:9], ids[9:]
    caches = [SequenceCache.from_config(gpu.config, 64, dtype=model.dtype, device=DEVICE) for _ in range(2)]
    for cache in caches:
        append_pass(model, cache, prompt)
    verified = model.compute_logits(append_pass(model, caches[0], drafts))  # [4, vocab_size]
    steps = torch.cat([model.compute_logits(append_pass(model, caches[1], [token])) for token in drafts])
    assert torch.equal(verified, steps)


def test_cuda_text_generation(tiny_models):
    gpu = load_model(tiny_models.dir("llama"), dtype="fp32", device=DEVICE)
    cpu = load_model(tiny_models.dir("llama"), dtype="fp32")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    gen = TextGenerator(gpu, max_seq_len=64)
    assert gen.engine.kv_cache.k.device.type == DEVICE and isinstance(gen.engine.runner.decoder, CudaDecoder)
    assert gen.engine.runner.graphs is not None  # decode steps replay a CUDA graph
    a = gen.generate("the cat", params)
    b = TextGenerator(cpu, max_seq_len=64).generate("the cat", params)
    assert len(a.token_ids) == 16
    assert a.token_ids == b.token_ids
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    assert gen.generate("the cat", seeded).token_ids == gen.generate("the cat", seeded).token_ids


@torch.inference_mode()
def test_cuda_attention_is_one_triton_launch_per_layer_and_never_cudnn(tiny_models):
    """Decode and verification passes run the Triton paged attention, one launch per layer; the
    PyTorch twin, where it runs, keeps SDPA off cuDNN, whose attention builds an execution plan
    for every new key length (2.1 ms of host time per call on an H100)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = load_model(tiny_models.dir("llama"), dtype="bf16", device=DEVICE)
    cache = SequenceCache.from_config(gpu.config, 64, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.randint(3, gpu.config.vocab_size, (12,), device=DEVICE)

    def greedy(token_ids) -> torch.Tensor:
        """Append ``token_ids``; the argmax [1] of the last row's logits."""
        return append_pass(gpu.model, cache, token_ids, logit_rows=[len(token_ids) - 1]).argmax(-1)

    token = greedy(ids)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            token = greedy(token)
        greedy(torch.cat([token, token, token]))  # a verification's shape
        q = torch.randn(3, 4, 16, device=DEVICE, dtype=torch.bfloat16)
        _, meta = cache.append([1, 2, 3])
        reference_paged_attention(q, cache.kv_cache.k[0], cache.kv_cache.v[0], meta, 0.25)
    torch.cuda.synchronize()
    events = prof.events()
    kernels = [e.name for e in events if e.device_type.name == "CUDA"]
    num_layers = gpu.config.num_hidden_layers
    assert sum("_attention_kernel" in name for name in kernels) == 4 * num_layers  # 4 passes
    names = {e.key for e in prof.key_averages()}
    assert any("scaled_dot_product" in name for name in names)  # the twin's SDPA ran
    assert not any("cudnn" in name.lower() for name in names | set(kernels))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_verification_attention_equals_one_token_steps(dtype):
    """Where CUDA attention runs the PyTorch twin, each verified token must get exactly the result
    of its one-token step, so that greedy speculative decoding reproduces plain decoding."""
    torch.manual_seed(0)
    group, d, length, num_tokens = 6, 64, 300, 5
    q = torch.randn(1, 2, num_tokens * group, d, device=DEVICE).to(dtype)
    cache_k = torch.randn(1, 2, 512, d, device=DEVICE).to(dtype)
    cache_v = torch.randn(1, 2, 512, d, device=DEVICE).to(dtype)
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]  # views of a longer cache, as in decoding
    out = per_token_attention(q, k, v, d ** -0.5, num_tokens)
    assert_tokens_equal_one_token_calls(out, lambda *qkv: per_token_attention(*qkv, d ** -0.5), q, k, v, num_tokens)
