"""The tiny model on CUDA gives the same logits as on CPU (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from fastdraft.engine.generate import TextGenerator, decode_one_token, prefill
from fastdraft.engine.loader import load_model
from fastdraft.layers.kv_cache import AttentionMetadata, KVCache
from fastdraft.sampling_params import SamplingParams
from tests.helpers import assert_tokens_equal_one_token_calls

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


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
    gpu = load_model(tiny_models.dir(variant), dtype="fp32", device="cuda")
    assert gpu.model.device.type == "cuda"
    ids = torch.randint(3, cpu.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    kv_cpu = KVCache.from_config(cpu.config, 64, dtype=torch.float32)
    kv_gpu = KVCache.from_config(gpu.config, 64, dtype=torch.float32, device="cuda")
    assert kv_gpu.k.device.type == "cuda"
    torch.testing.assert_close(prefill(gpu.model, ids[:, :12].cuda(), kv_gpu).cpu(),
                               prefill(cpu.model, ids[:, :12], kv_cpu), atol=1e-4, rtol=0)
    for pos in range(12, 16):
        torch.testing.assert_close(decode_one_token(gpu.model, ids[:, pos:pos + 1].cuda(), kv_gpu).cpu(),
                                   decode_one_token(cpu.model, ids[:, pos:pos + 1], kv_cpu), atol=1e-4, rtol=0)
    # Verification shape: several tokens on a non-empty cache.
    out = []
    for model, kv, dev in ((cpu.model, kv_cpu, "cpu"), (gpu.model, kv_gpu, "cuda")):
        meta = kv.append(4)
        out.append(model.compute_logits(model(ids[:, 16:20].to(dev), kv, meta)).cpu())
    torch.testing.assert_close(out[1], out[0], atol=1e-4, rtol=0)


@torch.inference_mode()
def test_cuda_batched_forward_matches_cpu(tiny_models):
    cpu = load_model(tiny_models.dir("llama"), dtype="fp32")
    gpu = load_model(tiny_models.dir("llama"), dtype="fp32", device="cuda")
    ids = torch.randint(3, cpu.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([list(range(0, 6)), list(range(0, 6))])
    results = []
    for loaded, dev in ((cpu, "cpu"), (gpu, "cuda")):
        kv = KVCache.from_config(loaded.config, 16, max_batch_size=2, dtype=torch.float32, device=dev)
        meta = AttentionMetadata.batched(positions.to(dev), torch.tensor([1, 0], device=dev))
        results.append(loaded.model.compute_logits(loaded.model(ids.to(dev), kv, meta)).cpu())
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=0)


def test_cuda_text_generation(tiny_models):
    gpu = load_model(tiny_models.dir("llama"), dtype="fp32", device="cuda")
    cpu = load_model(tiny_models.dir("llama"), dtype="fp32")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    a = TextGenerator(gpu, max_seq_len=64).generate("the cat", params)
    b = TextGenerator(cpu, max_seq_len=64).generate("the cat", params)
    assert len(a.token_ids) == 16
    assert a.token_ids == b.token_ids
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    gen = TextGenerator(gpu, max_seq_len=64)
    assert gen.generate("the cat", seeded).token_ids == gen.generate("the cat", seeded).token_ids


@torch.inference_mode()
def test_cuda_decode_keeps_attention_off_cudnn(tiny_models):
    """cuDNN's attention builds an execution plan for every new key length, which decoding
    changes at every step (2.1 ms of host time per call on an H100): decode must avoid it."""
    from torch.profiler import ProfilerActivity, profile

    gpu = load_model(tiny_models.dir("llama"), dtype="bf16", device="cuda")
    kv = KVCache.from_config(gpu.config, 64, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(3, gpu.config.vocab_size, (1, 12), device="cuda")
    token = prefill(gpu.model, ids, kv).argmax(-1, keepdim=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            token = decode_one_token(gpu.model, token, kv).argmax(-1, keepdim=True)
    names = {event.key for event in prof.key_averages()}
    assert any("scaled_dot_product" in name for name in names)  # the profile saw attention
    assert not any("cudnn_attention" in name for name in names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_verification_attention_equals_one_token_steps(dtype):
    """On CUDA attention runs the PyTorch twin: each verified token must get exactly the result
    of its one-token step, so that greedy speculative decoding reproduces plain decoding."""
    from fastdraft.kernels.fused import decode_attention

    torch.manual_seed(0)
    group, d, length, num_tokens = 6, 64, 300, 5
    q = torch.randn(1, 2, num_tokens * group, d, device="cuda").to(dtype)
    cache_k = torch.randn(1, 2, 512, d, device="cuda").to(dtype)
    cache_v = torch.randn(1, 2, 512, d, device="cuda").to(dtype)
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]  # views of a longer cache, as in decoding
    out = decode_attention(q, k, v, d ** -0.5, num_tokens)
    assert_tokens_equal_one_token_calls(out, lambda *qkv: decode_attention(*qkv, d ** -0.5), q, k, v, num_tokens)
