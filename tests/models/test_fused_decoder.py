"""The fused C++ decoder (models/fused_decoder.py) against its twin, the module path."""

from __future__ import annotations

import pytest
import torch

from fastdraft.engine.generate import TextGenerator
from fastdraft.engine.loader import load_model
from fastdraft.kernels.build import load_x86_extension
from fastdraft.layers.kv_cache import KVCache, PagedKVCache
from fastdraft.kernels.mode import batch_invariant
from fastdraft.models.fused_decoder import MAX_FUSED_TOKENS, FusedDecoder, _linear_op, _projections_op
from fastdraft.quant.config import QuantConfig
from fastdraft.quant.quantizer import quantize_model
from fastdraft.sampling_params import SamplingParams
from tests.helpers import paged_batch

pytestmark = pytest.mark.skipif(load_x86_extension() is None, reason="x86 kernels unavailable on this CPU")

QUANTS = {
    "dense": None,
    "int4-g32-sym": QuantConfig(method="rtn", group_size=32, sym=True),
    "int4-channel-asym": QuantConfig(method="rtn", group_size=-1, sym=False),
    # INT8 v_proj/down_proj in some layers: q/k/v run one by one and are concatenated.
    "int4-mix8": QuantConfig(method="rtn", group_size=32, sensitive_bits=8),
    # An INT6 LM head (the decoder linears INT4 g32).
    "int4-head6": QuantConfig(method="rtn", group_size=32, sym=True, lm_head_bits=6),
    # INT6 g16 linears (how a GGUF's Q6_K blocks are held): activations quantized per 16.
    "int6-g16": QuantConfig(method="rtn", bits=6, group_size=16),
    # INT8 v_proj/o_proj in every layer.
    "int4-int8vo": QuantConfig(method="rtn", group_size=32, sym=False, float_zeros=True, int8_linears=("v_proj", "o_proj")),
}


def _model(tiny_models, variant: str, dtype: str, quant: str):
    model = load_model(tiny_models.dir(variant), dtype=dtype).model
    if QUANTS[quant] is not None:
        quantize_model(model, QUANTS[quant], show_progress=False)
    return model


def _steps(model, is_fused: bool, prompt_len: int, chunks: list[int]) -> list[torch.Tensor]:
    """Prefill a prompt, then append ``chunks`` of tokens; hidden states of every chunk (through
    a fused decoder built for the model as it is now, or the module path)."""
    decoder = model.fused_decoder() if is_fused else None
    assert decoder is not None or not is_fused, "the fused decoder could not be built"
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    cache = KVCache.from_config(model.config, 64, dtype=model.dtype)
    out = []
    with torch.inference_mode():
        meta = cache.append(prompt_len)
        model(torch.randint(0, vocab, (1, prompt_len), generator=gen), cache, meta)
        for n in chunks:
            meta = cache.append(n)
            out.append(model(torch.randint(0, vocab, (1, n), generator=gen), cache, meta, decoder))
            if n > 1:  # a verification that rejected its last token
                cache.truncate(cache.seq_lens[0] - 1)
    return out


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_fused_matches_module_path_bitwise(tiny_models, variant, dtype, quant):
    model = _model(tiny_models, variant, dtype, quant)
    chunks = [1, 1, 5, 1, 3, MAX_FUSED_TOKENS, 1]
    fused = _steps(model, True, 7, chunks)
    reference = _steps(model, False, 7, chunks)
    for got, want in zip(fused, reference):
        assert torch.equal(got, want)


def _decode_logits_both_paths(model, steps: list[tuple[int, int]], seed: int = 0, decoder=None):
    """After a 7-token prompt, append (num_tokens, num_rows) steps of random tokens; per step
    (decode_logits through ``decoder``, default a new one, compute_logits(forward) through the
    module path), each on its own cache."""
    decoder = decoder or model.fused_decoder()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    caches = [KVCache.from_config(model.config, 64, dtype=model.dtype) for _ in range(2)]
    prompt = torch.randint(0, vocab, (1, 7), generator=gen)
    pairs = []
    with torch.inference_mode():
        for cache in caches:
            model(prompt, cache, cache.append(7))
        for num_tokens, num_rows in steps:
            ids = torch.randint(0, vocab, (1, num_tokens), generator=gen)
            got = model.decode_logits(ids, caches[0], caches[0].append(num_tokens), num_rows, decoder)
            want = model.compute_logits(model(ids, caches[1], caches[1].append(num_tokens))[0, -num_rows:])
            pairs.append((got, want))
    return pairs


@pytest.mark.parametrize("quant", ["int4-g32-sym", "int4-mix8"])
def test_fused_decoder_same_bits_for_any_thread_count(tiny_models, quant):
    # The weight-only stack runs in one parallel region whose threads steal tiles and attention
    # items from each other: which thread computes what varies, the results must not.
    model = _model(tiny_models, "qwen2", "bf16", quant)
    chunks = [1, 5, 1, 3]
    threads = torch.get_num_threads()
    try:
        runs = []
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            runs.append(_steps(model, True, 7, chunks))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for got, want in zip(other, runs[0]):
            assert torch.equal(got, want)


def test_error_inside_the_parallel_region_is_raised_and_the_region_recovers(tiny_models):
    model = _model(tiny_models, "qwen2", "bf16", "int4-g32-sym")
    expected = _steps(model, True, 7, [1, 3])
    decoder = model.fused_decoder()
    layers = model.model.layers
    attn = layers[0].self_attn
    ext = decoder.ext
    # A norm weight of the wrong size fails the first serial step of the region.
    mlp, cpu = layers[0].mlp, torch.device("cpu")
    ops = [_projections_op(ext, attn, ("q_proj", "k_proj", "v_proj"), torch.bfloat16, cpu, 1),
           _linear_op(ext, attn.o_proj, torch.bfloat16, cpu, 1),
           _projections_op(ext, mlp, ("gate_proj", "up_proj"), torch.bfloat16, cpu, 1),
           _linear_op(ext, mlp.down_proj, torch.bfloat16, cpu, 1)]
    bad = ext.DecoderLayer(torch.ones(3, dtype=torch.bfloat16), layers[0].post_attention_layernorm.weight.detach(),
                           1e-6, *ops, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
    cache = KVCache.from_config(model.config, 64, dtype=model.dtype)
    hidden = torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)
    cos = torch.ones(1, attn.head_dim, dtype=torch.bfloat16)
    sin = torch.zeros(1, attn.head_dim, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the other thread must leave the region too, not hang at a barrier
        with pytest.raises(RuntimeError, match="weight"):
            ext.decoder_forward([bad] + decoder.layer_ops[1:], hidden, cos, sin, cache.k[:, 0], cache.v[:, 0], 0)
        assert all(torch.equal(got, want) for got, want in zip(_steps(model, True, 7, [1, 3]), expected))
    finally:
        torch.set_num_threads(threads)


def test_fused_path_only_for_decode_shapes(tiny_models):
    model = _model(tiny_models, "llama", "fp32", "dense")
    cache = KVCache.from_config(model.config, 64, dtype=torch.float32)
    decoder = model.fused_decoder()
    with torch.inference_mode():
        assert not decoder.accepts(cache, cache.append(4))  # prefill
        assert decoder.accepts(cache, cache.append(4))
        assert not decoder.accepts(cache, cache.append(MAX_FUSED_TOKENS + 1))
        bf16_cache = KVCache.from_config(model.config, 64, dtype=torch.bfloat16)
        bf16_cache.append(2)
        assert not decoder.accepts(bf16_cache, bf16_cache.append(1))  # a cache of another dtype
    # Autograd needs the module path.
    assert not decoder.accepts(cache, cache.append(4))


def test_a_decoder_is_a_snapshot_of_the_modules_it_was_built_from(tiny_models):
    # The decoder's owner builds a new one after replacing modules (quantizing in place).
    model = _model(tiny_models, "llama", "fp32", "dense")
    before = _steps(model, True, 5, [1])
    quantize_model(model, QUANTS["int4-g32-sym"], show_progress=False)
    after = _steps(model, True, 5, [1])
    assert not torch.equal(before[0], after[0])
    assert torch.equal(after[0], _steps(model, False, 5, [1])[0])


@pytest.mark.parametrize("quant", ["dense", "int4-g32-sym", "int4-channel-asym", "int4-mix8", "int4-head6"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_decode_logits_match_forward_then_compute_logits_bitwise(tiny_models, variant, dtype, quant):
    # The final norm and the LM head run inside the C++ call (a weight-only head inside the
    # decoder's region); the logits must equal the module path's, row for row.
    model = _model(tiny_models, variant, dtype, quant)
    steps = [(1, 1), (5, 5), (3, 1), (MAX_FUSED_TOKENS, 2)]
    decoder = model.fused_decoder()
    for (_, num_rows), (got, want) in zip(steps, _decode_logits_both_paths(model, steps, decoder=decoder)):
        assert got.shape == (num_rows, model.config.vocab_size) and got.dtype == torch.float32
        assert torch.equal(got, want)
    assert decoder.head_op(model.lm_head) is not None


def test_decoder_step_is_kept_per_cache_slot_and_rebuilt_for_another(tiny_models):
    # decode_logits runs a C++ DecoderStep built for one cache slot: kept from step to step (a
    # rebuild every step would cost about 0.3 ms), rebuilt when the cache, the rotary table or a
    # weight it holds changes -- and always giving the module path's logits.
    model = _model(tiny_models, "qwen2", "bf16", "int4-g32-sym")
    steps = [(1, 1)] * 3 + [(4, 4)]
    decoder = model.fused_decoder()
    for got, want in _decode_logits_both_paths(model, steps, decoder=decoder):
        assert torch.equal(got, want)
    step = decoder._step[2]
    other = KVCache.from_config(model.config, 64, dtype=model.dtype)
    with torch.inference_mode():
        model(torch.zeros(1, 3, dtype=torch.long), other, other.append(3))
        model.decode_logits(torch.ones(1, 1, dtype=torch.long), other, other.append(1), decoder=decoder)
        assert decoder._step[2] is not step
        step = decoder._step[2]
        model.decode_logits(torch.ones(1, 1, dtype=torch.long), other, other.append(1), decoder=decoder)
        assert decoder._step[2] is step
    for got, want in _decode_logits_both_paths(model, [(1, 1), (2, 1)], seed=3, decoder=decoder):  # other caches
        assert torch.equal(got, want)


def test_decoder_step_rebuilt_after_in_place_norm_and_embedding_changes(tiny_models):
    # The step holds the final norm's and the embedding's storage: a `.data` swap (same
    # Parameter objects, same caches) or a new eps must not leave it computing with old values.
    model = _model(tiny_models, "qwen2", "bf16", "int4-g32-sym")
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    caches = [KVCache.from_config(model.config, 64, dtype=model.dtype) for _ in range(2)]
    norm, embed = model.model.norm, model.model.embed_tokens
    decoder = model.fused_decoder()

    def step_both_paths() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (1, 1), generator=gen)
        got = model.decode_logits(ids, caches[0], caches[0].append(1), decoder=decoder)
        want = model.compute_logits(model(ids, caches[1], caches[1].append(1))[0, -1:])
        return got, want

    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (1, 5), generator=gen)
        for cache in caches:
            model(prompt, cache, cache.append(5))
        got, want = step_both_paths()
        assert torch.equal(got, want)
        norm.weight.data = torch.rand(norm.weight.shape, generator=gen).to(model.dtype) + 0.5
        got, want = step_both_paths()
        assert torch.equal(got, want)
        norm.eps = 0.25
        got, want = step_both_paths()
        assert torch.equal(got, want)
        if getattr(model.lm_head, "weight", None) is not embed.weight:  # a tied head is packed from the old values
            embed.weight.data = torch.randn(embed.weight.shape, generator=gen).to(model.dtype)
            got, want = step_both_paths()
            assert torch.equal(got, want)


def test_decoder_step_rejects_token_ids_outside_the_vocabulary(tiny_models):
    model = _model(tiny_models, "llama", "fp32", "int4-g32-sym")
    cache = KVCache.from_config(model.config, 64, dtype=model.dtype)
    with torch.inference_mode():
        model(torch.zeros(1, 3, dtype=torch.long), cache, cache.append(3))
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            model.decode_logits(torch.tensor([[model.config.vocab_size]]), cache, cache.append(1),
                                decoder=model.fused_decoder())


def test_decode_logits_rejects_bad_rows(tiny_models):
    model = _model(tiny_models, "llama", "fp32", "dense")
    cache = KVCache.from_config(model.config, 64, dtype=model.dtype)
    with torch.inference_mode(), pytest.raises(ValueError, match="logit rows"):
        model.decode_logits(torch.zeros(1, 2, dtype=torch.long), cache, cache.append(2), 3)


def test_decode_logits_runs_forward_hooks(tiny_models):
    model = _model(tiny_models, "llama", "bf16", "int4-g32-sym")
    cache = KVCache.from_config(model.config, 64, dtype=model.dtype)
    calls = []
    model.model.register_forward_hook(lambda *args: calls.append(1))
    with torch.inference_mode():
        model(torch.zeros(1, 4, dtype=torch.long), cache, cache.append(4))
        model.decode_logits(torch.zeros(1, 1, dtype=torch.long), cache, cache.append(1))
    assert len(calls) == 2


@pytest.mark.parametrize("quant", ["dense", "int4-g32-sym", "int4-int8vo"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_output_projection_and_head_biases_match_module_path(tiny_models, dtype, quant):
    # No shipped model has biases on o_proj, down_proj or the LM head, but the fused region
    # supports them (each added before the output's rows are read whole): give every one a bias.
    model = load_model(tiny_models.dir("llama"), dtype=dtype).model
    gen = torch.Generator().manual_seed(1)
    layers = model.model.layers
    linears = [model.lm_head] + [m for layer in layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    for linear in linears:
        bias = torch.randn(linear.out_features, generator=gen) * 0.5
        linear.bias = torch.nn.Parameter(bias.to(linear.weight.dtype))
    if QUANTS[quant] is not None:
        quantize_model(model, QUANTS[quant], show_progress=False)
    assert all(m.bias is not None for m in (model.lm_head, layers[0].self_attn.o_proj, layers[-1].mlp.down_proj))
    chunks = [1, 5, 1, 3]
    fused = _steps(model, True, 7, chunks)
    reference = _steps(model, False, 7, chunks)
    for got, want in zip(fused, reference):
        assert torch.equal(got, want)
    decoder = model.fused_decoder()
    [(got, want)] = _decode_logits_both_paths(model, [(3, 3)], seed=1, decoder=decoder)
    assert torch.equal(got, want)
    assert decoder.head_op(model.lm_head) is not None


def _paged_steps(model, decoder) -> list[torch.Tensor]:
    """Three steps of a flat batch over a paged cache: two prompts (one in two chunks), then
    decode beside the second chunk, then decode and a verification; hidden states per step."""
    block_size, vocab = 4, model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (30,), generator=gen).tolist() for _ in range(3)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    cache = PagedKVCache.from_config(model.config, 24, block_size, dtype=model.dtype)
    # (sequence, first position, number of tokens) per step
    steps = [[(0, 0, 9), (1, 0, 6)], [(0, 9, 1), (1, 6, 11), (2, 0, 3)], [(0, 10, 1), (1, 17, 1), (2, 3, 5)]]
    out = []
    with torch.inference_mode():
        for step in steps:
            ids, meta, _ = paged_batch([(tokens[seq], start, num, tables[seq]) for seq, start, num in step], block_size)
            out.append(model(ids, cache, meta, decoder))
    return out


@pytest.mark.parametrize("quant", ["int4-g32-sym", "int4-channel-asym", "int4-mix8", "int4-int8vo"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_paged_fused_decoder_matches_module_path_bitwise(tiny_models, variant, dtype, quant):
    model = _model(tiny_models, variant, dtype, quant)
    with torch.inference_mode():
        decoder = FusedDecoder.build(model.model.layers, model.dtype, model.device, model.min_rows)
    assert decoder is not None and decoder.is_weight_only
    for got, want in zip(_paged_steps(model, decoder), _paged_steps(model, None)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("is_invariant", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_paged_dense_decoder_matches_module_path_bitwise(tiny_models, variant, dtype, is_invariant):
    # Dense layers run one by one (oneDNN's GEMMs need their own threads), in either kernel
    # mode: the mode picks the same dense kernel in C++ as in the module path.
    model = _model(tiny_models, variant, dtype, "dense")
    decoder = model.fused_decoder()
    assert decoder is not None and not decoder.is_weight_only
    with batch_invariant(is_invariant):
        for got, want in zip(_paged_steps(model, decoder), _paged_steps(model, None)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_paged_logits_with_the_head_inside_match_the_module_path(tiny_models, variant, dtype):
    model = _model(tiny_models, variant, dtype, "int4-head6")  # a weight-only LM head
    with torch.inference_mode():
        decoder = FusedDecoder.build(model.model.layers, model.dtype, model.device, model.min_rows)
    block_size, vocab = 4, model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, vocab, (20,), generator=gen).tolist() for _ in range(2)]
    caches = [PagedKVCache.from_config(model.config, 16, block_size, dtype=model.dtype) for _ in range(2)]
    # (sequence, first position, number of tokens); logits of rows 2, 9 and the last.
    steps = [[(0, 0, 7), (1, 0, 10)], [(0, 7, 1), (1, 10, 4)]]
    with torch.inference_mode():
        for step in steps:
            ids, meta, starts = paged_batch([(tokens[seq], start, num, list(range(seq * 8, seq * 8 + 8)))
                                             for seq, start, num in step], block_size)
            rows = [2, starts[1] - 1, starts[-1] - 1]
            got = model.paged_logits(ids, caches[0], meta, decoder, rows)
            assert got is not None and got.dtype == torch.float32
            want = model.compute_logits(model(ids, caches[1], meta)[0, rows])
            assert torch.equal(got, want)


def test_no_fused_decoder_for_fp16_and_the_engine_runs_the_module_path(tiny_models):
    # The C++ kernels take fp32 and bf16 activations only; an fp16 model runs the module path.
    loaded = load_model(tiny_models.dir("llama"), dtype="fp16")
    assert loaded.model.fused_decoder() is None
    out = TextGenerator(loaded, 64).generate("the cat", SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
