"""The C++ step (models/fused_decoder.py) against its twin, the module path."""

from __future__ import annotations

import pytest
import torch

from fastdraft.generator import TextGenerator
from fastdraft.engine.loader import load_model
from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.layers.kv_cache import PagedKVCache, SequenceCache
from fastdraft.kernels.mode import batch_invariant
from fastdraft.layers.linear import MAX_FUSED_TOKENS, cpu_linear_op, cpu_projections_op
from fastdraft.models.fused_decoder import FusedDecoder
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.quantizer import quantize_model
from fastdraft.sampling_params import SamplingParams
from tests.helpers import append_pass, paged_batch

# The C++ step against the module path, on every instruction-set variant this CPU runs.
pytestmark = [pytest.mark.skipif(load_cpu_kernels() is None, reason="x86 kernels unavailable on this CPU"),
              pytest.mark.usefixtures("each_isa")]

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
    # An INT8 embedding table: looked up in Python, the rest of the step in C++.
    "int4-embed8": QuantConfig(method="rtn", group_size=32, sym=True, embed_bits=8),
}


def _model(tiny_models, variant: str, dtype: str, quant: str):
    model = load_model(tiny_models.dir(variant), dtype=dtype).model
    if QUANTS[quant] is not None:
        quantize_model(model, QUANTS[quant], show_progress=False)
    return model


def _steps(model, is_fused: bool, prompt_len: int, chunks: list[int], decoder=None) -> list[torch.Tensor]:
    """Prefill a prompt, then append ``chunks`` of tokens; hidden states of the prompt and of
    every chunk, through the module path or a C++ step: ``decoder``, by default one built from
    the model's modules at the call."""
    if is_fused:
        decoder = decoder or model.fused_decoder()
        assert decoder is not None, "the fused decoder could not be built"
    else:
        decoder = None
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    cache = SequenceCache.from_config(model.config, 64, dtype=model.dtype)
    out = []
    with torch.inference_mode():
        out.append(append_pass(model, cache, torch.randint(0, vocab, (prompt_len,), generator=gen), decoder))
        for n in chunks:
            out.append(append_pass(model, cache, torch.randint(0, vocab, (n,), generator=gen), decoder))
            if n > 1:  # a verification that rejected its last token
                cache.truncate(cache.num_tokens - 1)
    return out


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "gemma3"])
def test_fused_matches_module_path_bitwise(tiny_models, variant, dtype, quant):
    model = _model(tiny_models, variant, dtype, quant)
    chunks = [1, 1, 5, 1, 3, MAX_FUSED_TOKENS, 1]
    fused = _steps(model, True, 7, chunks)
    reference = _steps(model, False, 7, chunks)
    for got, want in zip(fused, reference):
        assert torch.equal(got, want)


def _logits_both_paths(model, steps: list[tuple[int, list[int]]], seed: int = 0, decoder=None):
    """After a 7-token prompt, append (num_tokens, logit rows) steps of random tokens; per step
    (``model.logits`` through ``decoder``, default a new one, compute_logits(forward) through
    the module path), each on its own cache."""
    decoder = decoder or model.fused_decoder()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    caches = [SequenceCache.from_config(model.config, 64, dtype=model.dtype) for _ in range(2)]
    prompt = torch.randint(0, vocab, (7,), generator=gen)
    pairs = []
    with torch.inference_mode():
        append_pass(model, caches[0], prompt, decoder)
        append_pass(model, caches[1], prompt)
        for num_tokens, rows in steps:
            ids = torch.randint(0, vocab, (num_tokens,), generator=gen)
            got = append_pass(model, caches[0], ids, decoder, rows)
            want = model.compute_logits(append_pass(model, caches[1], ids)[rows])
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
    ops = [cpu_projections_op(ext, attn, ("q_proj", "k_proj", "v_proj"), torch.bfloat16, cpu, 1),
           cpu_linear_op(ext, attn.o_proj, torch.bfloat16, cpu, 1),
           cpu_projections_op(ext, mlp, ("gate_proj", "up_proj"), torch.bfloat16, cpu, 1),
           cpu_linear_op(ext, mlp.down_proj, torch.bfloat16, cpu, 1)]
    bad = ext.DecoderLayer(ext.NormWeight(torch.ones(3, dtype=torch.bfloat16), False, 1e-6),
                           ext.NormWeight(layers[0].post_attention_layernorm.weight.detach(), False, 1e-6),
                           None, None, None, None, *ops, attn.spec.num_heads, attn.spec.num_kv_heads,
                           attn.spec.head_dim, attn.spec.scale, 0, 0, "silu")
    step = ext.PagedDecoder([bad] + decoder.layer_ops[1:], model.model.embed_tokens.weight.detach(), None, None)
    cache = SequenceCache.from_config(model.config, 64, dtype=model.dtype)
    ids, meta = cache.append([1])
    cos, sin = model.model.rotary_emb.tables(1, model.dtype, cpu)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the other thread must leave the region too, not hang at a barrier
        with pytest.raises(RuntimeError, match="weight"):
            step.forward(ids, None, meta.positions, [cos], [sin], cache.kv_cache.k, cache.kv_cache.v, meta.slot_mapping,
                         meta.block_tables, meta.query_start_loc_tensor, meta.context_lens_tensor, None, False)
        assert all(torch.equal(got, want) for got, want in zip(_steps(model, True, 7, [1, 3]), expected))
    finally:
        torch.set_num_threads(threads)


def test_a_decoder_is_a_snapshot_of_the_modules_it_was_built_from(tiny_models):
    # A decoder holds the weights of the modules it was built from: after modules are replaced
    # (quantizing in place) it keeps computing with the old ones, and the decoder's owner builds
    # a new one to follow the model.
    model = _model(tiny_models, "llama", "fp32", "dense")
    dense_decoder = model.fused_decoder()
    before = _steps(model, True, 5, [1], dense_decoder)
    quantize_model(model, QUANTS["int4-g32-sym"], show_progress=False)
    after = _steps(model, True, 5, [1])
    assert not torch.equal(before[-1], after[-1])
    assert torch.equal(after[-1], _steps(model, False, 5, [1])[-1])
    for got, want in zip(_steps(model, True, 5, [1], dense_decoder), before):
        assert torch.equal(got, want)


@pytest.mark.parametrize("quant", ["dense", "int4-g32-sym", "int4-channel-asym", "int4-mix8", "int4-head6",
                                   "int4-embed8"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "gemma3"])
def test_logits_match_forward_then_compute_logits_bitwise(tiny_models, variant, dtype, quant):
    # A weight-only LM head runs inside the C++ step's region, after the final norm; the logits
    # must equal the module path's, row for row.
    model = _model(tiny_models, variant, dtype, quant)
    steps = [(1, [0]), (5, [0, 1, 2, 3, 4]), (3, [2]), (MAX_FUSED_TOKENS, [3, MAX_FUSED_TOKENS - 1])]
    decoder = model.fused_decoder()
    for (_, rows), (got, want) in zip(steps, _logits_both_paths(model, steps, decoder=decoder)):
        assert got.shape == (len(rows), model.config.vocab_size) and got.dtype == torch.float32
        assert torch.equal(got, want)
    assert decoder.has_head == (quant != "dense")


def test_the_step_follows_the_cache_it_is_given(tiny_models):
    # The C++ step keeps each layer's view of the pool from step to step, and makes them again
    # for another pool: one decoder stepping two live caches in turn (A, B, A, B), each holding
    # a sequence of its own, must attend over the cache of each step, as the module path does
    # on twin caches.
    model = _model(tiny_models, "qwen2", "bf16", "int4-g32-sym")
    decoder = model.fused_decoder()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    fused = [SequenceCache.from_config(model.config, 64, dtype=model.dtype) for _ in range(2)]  # A, B
    module = [SequenceCache.from_config(model.config, 64, dtype=model.dtype) for _ in range(2)]  # their twins
    # (cache, number of tokens, logit rows): prompts of different lengths, one-token steps,
    # then a verification's shape on each.
    steps = [(0, 7, [6]), (1, 4, [3]), (0, 1, [0]), (1, 1, [0]), (0, 1, [0]), (1, 1, [0]), (0, 4, [0, 3]),
             (1, 4, [0, 3]), (0, 1, [0]), (1, 1, [0])]
    with torch.inference_mode():
        for seq, num_tokens, rows in steps:
            ids = torch.randint(0, vocab, (num_tokens,), generator=gen)
            got = append_pass(model, fused[seq], ids, decoder, rows)
            want = model.compute_logits(append_pass(model, module[seq], ids)[rows])
            assert torch.equal(got, want), f"cache {'AB'[seq]} at {fused[seq].num_tokens} tokens"
    assert [c.num_tokens for c in fused] == [c.num_tokens for c in module] == [14, 11]


def test_step_rebuilt_after_in_place_norm_and_embedding_changes(tiny_models):
    # The step holds the final norm's and the embedding's storage: a `.data` swap (same
    # Parameter objects, same caches) or a new eps must not leave it computing with old values.
    model = _model(tiny_models, "qwen2", "bf16", "int4-g32-sym")
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    caches = [SequenceCache.from_config(model.config, 64, dtype=model.dtype) for _ in range(2)]
    norm, embed = model.model.norm, model.model.embed_tokens
    decoder = model.fused_decoder()

    def step_both_paths() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (1,), generator=gen)
        got = append_pass(model, caches[0], ids, decoder, [0])
        want = model.compute_logits(append_pass(model, caches[1], ids))
        return got, want

    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (5,), generator=gen)
        append_pass(model, caches[0], prompt, decoder)
        append_pass(model, caches[1], prompt)
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


def test_step_rejects_token_ids_outside_the_vocabulary_and_bad_rows(tiny_models):
    model = _model(tiny_models, "llama", "fp32", "int4-g32-sym")
    cache = SequenceCache.from_config(model.config, 64, dtype=model.dtype)
    decoder = model.fused_decoder()
    with torch.inference_mode():
        append_pass(model, cache, torch.zeros(3, dtype=torch.long), decoder)
        with pytest.raises(RuntimeError, match="token id .* is outside"):
            append_pass(model, cache, [model.config.vocab_size], decoder, [0])
        with pytest.raises(RuntimeError, match="logit row out of range"):
            append_pass(model, cache, [1, 2], decoder, [2])


def test_hooks_leave_the_model_to_the_module_path(tiny_models):
    # Calibration observes module calls: with hooks registered there is no C++ step to skip them.
    model = _model(tiny_models, "llama", "bf16", "int4-g32-sym")
    cache = SequenceCache.from_config(model.config, 64, dtype=model.dtype)
    calls = []
    model.model.layers[0].mlp.register_forward_hook(lambda *args: calls.append(1))
    assert model.fused_decoder() is None
    with torch.inference_mode():
        append_pass(model, cache, torch.zeros(4, dtype=torch.long), model.fused_decoder())
        append_pass(model, cache, torch.zeros(1, dtype=torch.long), model.fused_decoder())
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
    [(got, want)] = _logits_both_paths(model, [(3, [0, 1, 2])], seed=1, decoder=decoder)
    assert torch.equal(got, want)
    assert decoder.has_head == (quant != "dense")


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
            out.append(model(ids, meta.positions, cache, meta, decoder))
    return out


@pytest.mark.parametrize("quant", ["int4-g32-sym", "int4-channel-asym", "int4-mix8", "int4-int8vo"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "gemma3"])
def test_paged_fused_decoder_matches_module_path_bitwise(tiny_models, variant, dtype, quant):
    model = _model(tiny_models, variant, dtype, quant)
    with torch.inference_mode():
        decoder = FusedDecoder.build(model, 16)
    assert decoder is not None and decoder.is_weight_only
    for got, want in zip(_paged_steps(model, decoder), _paged_steps(model, None)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("is_invariant", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "gemma3"])
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
@pytest.mark.parametrize("variant", ["llama", "qwen2", "gemma3"])
def test_paged_logits_with_the_head_inside_match_the_module_path(tiny_models, variant, dtype):
    model = _model(tiny_models, variant, dtype, "int4-head6")  # a weight-only LM head
    with torch.inference_mode():
        decoder = FusedDecoder.build(model, 16)
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
            assert decoder.has_head
            got = model.logits(ids, meta.positions, caches[0], meta, rows, decoder)
            assert got.dtype == torch.float32
            want = model.compute_logits(model(ids, meta.positions, caches[1], meta)[rows])
            assert torch.equal(got, want)


def test_no_fused_decoder_for_fp16_and_the_engine_runs_the_module_path(tiny_models):
    # The C++ kernels take fp32 and bf16 activations only; an fp16 model runs the module path.
    loaded = load_model(tiny_models.dir("llama"), dtype="fp16")
    assert loaded.model.fused_decoder() is None
    out = TextGenerator(loaded, 64).generate("the cat", SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
