"""Sampling: greedy, temperature, top-k, top-p, seeded reproducibility, parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.layers.sampler import (apply_extras, changes_logits, greedy_ids, keyed_uniforms, logits_to_probs,
                                      reference_apply_extras, reference_sample_from_probs,
                                      sample, sample_batch, sample_from_probs)
from fastdraft.sampling_params import SamplingParams


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = torch.randn(5, 300, generator=_gen(0))
    assert torch.equal(sample(logits, SamplingParams(temperature=0.0), None), logits.argmax(-1))
    one = torch.randn(1, 50, generator=_gen(1))
    assert sample(one, SamplingParams(), _gen(3)).tolist() == [int(one.argmax())]


@pytest.mark.parametrize("shape", [(7,), (3, 1000), (2, 3, 151936)])
def test_greedy_ids_match_torch_argmax(shape):
    torch.manual_seed(0)
    logits = torch.randn(shape)
    logits[..., 5] = logits.max() + 1.0  # a tie between positions 5 and the last: the first wins
    logits[..., -1] = logits[..., 5]
    with torch.inference_mode():
        ids = greedy_ids(logits)
    assert ids.dtype == torch.long and ids.shape == shape[:-1]
    assert torch.equal(ids, logits.argmax(dim=-1))
    assert (ids == 5).all()


def test_greedy_ids_nan_infinity_and_other_dtypes():
    logits = torch.tensor([[float("-inf"), 1.0, float("nan"), 3.0, float("nan")],
                           [float("-inf")] * 5, [0.0, float("inf"), 2.0, float("inf"), 1.0]])
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))
    assert greedy_ids(logits).tolist() == [2, 0, 1]
    bf16 = torch.randn(4, 300).bfloat16()  # not fp32: torch's own argmax
    assert torch.equal(greedy_ids(bf16), bf16.argmax(dim=-1))
    strided = torch.randn(300, 4).t()  # a non-contiguous view
    assert torch.equal(greedy_ids(strided), strided.argmax(dim=-1))


def test_greedy_has_no_distribution():
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(1, 4), SamplingParams(temperature=0.0))


def _draws(params: SamplingParams, logits: torch.Tensor, seed: int, n: int = 30) -> list[int]:
    g = _gen(seed)
    return [int(sample(logits, params, g)) for _ in range(n)]


def test_same_seed_same_tokens_different_seed_different():
    flat = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=0)
    a, b = _draws(params, flat, seed=123), _draws(params, flat, seed=123)
    c = _draws(params, flat, seed=124)
    assert a == b
    assert a != c
    assert len(set(a)) > 20  # a flat distribution really spreads out


def test_temperature_scales_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for t in (0.5, 1.0, 2.0):
        probs = logits_to_probs(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(probs, torch.softmax(logits / t, dim=-1))
        assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


def test_top_k_restricts_support():
    logits = torch.randn(3, 200, generator=_gen(4))
    params = SamplingParams(temperature=1.5, top_k=7)
    probs = logits_to_probs(logits, params)
    for row in range(3):
        support = set(torch.nonzero(probs[row]).flatten().tolist())
        assert support == set(torch.topk(logits[row], 7).indices.tolist())
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    g = _gen(5)
    top = set(torch.topk(logits[0], 7).indices.tolist())
    drawn = {int(sample(logits[:1], params, g)) for _ in range(300)}
    assert drawn <= top and len(drawn) > 1
    # top_k larger than the vocabulary (or 0) leaves the distribution alone.
    full = logits_to_probs(logits, SamplingParams(temperature=1.5, top_k=500))
    torch.testing.assert_close(full, torch.softmax(logits / 1.5, dim=-1))


def test_top_p_restricts_support():
    probs_in = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs_in.log()
    # Mass before each token in sorted order: 0.5 -> 0, 0.3 -> 0.5, 0.15 -> 0.8, 0.05 -> 0.95.
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([[0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    torch.testing.assert_close(p, torch.tensor([[0.0, 0.5, 0.15, 0.3]]) / 0.95)
    # The top token always survives, however small top_p is.
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))
    torch.testing.assert_close(p, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    g = _gen(6)
    params = SamplingParams(temperature=1.0, top_p=0.7)
    drawn = {int(sample(logits, params, g)) for _ in range(200)}
    assert drawn == {1, 3}


def test_top_k_and_top_p_combine():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.999))
    assert torch.nonzero(p[0]).flatten().tolist() == [0, 1, 2]


def test_top_p_beyond_the_candidates_sorts_the_whole_row():
    # A flat row over 2000 tokens: the nucleus at top_p 0.9 holds ~1800 of them, more than the
    # top-k candidates searched first.
    torch.manual_seed(0)
    logits = torch.randn(1, 2000) * 0.01
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
    is_kept = (sorted_probs.cumsum(dim=-1) - sorted_probs) < 0.9
    assert 1000 < int(is_kept.sum()) < 2000
    assert set(torch.nonzero(p[0]).flatten().tolist()) == set(sorted_ids[is_kept].tolist())


def test_sample_batch_gives_each_row_what_it_gets_alone():
    # Each row with its own parameters and generator: the very token sample() draws for it alone.
    torch.manual_seed(1)
    logits = torch.randn(12, 3000) * 4
    logits[3] *= 0.001  # a flat row: top-p falls back to a full sort there
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_k=[0, 40, 0][i % 3],
                             top_p=[1.0, 0.9, 0.5][i % 3], seed=i) for i in range(12)]
    together = sample_batch(logits, params, [_gen(i) for i in range(12)])
    alone = [int(sample(logits[i:i + 1], params[i], _gen(i))) for i in range(12)]
    assert together.tolist() == alone
    with pytest.raises(ValueError, match="one SamplingParams and one generator or key per row"):
        sample_batch(logits, params[:3], [None] * 3)
    with pytest.raises(ValueError, match="generators or keys"):
        sample_batch(logits, params)


def test_keyed_uniforms_are_uniform_and_a_function_of_their_key():
    # Many requests with consecutive seeds, each drawing at consecutive offsets (fixed inputs:
    # the test is deterministic).
    seeds = torch.arange(1000).repeat_interleave(100)
    offsets = torch.arange(100).repeat(1000)
    u = keyed_uniforms(seeds, offsets)
    assert u.dtype == torch.float64 and 0 <= float(u.min()) and float(u.max()) < 1
    # Kolmogorov-Smirnov against U(0, 1): 1.95 / sqrt(n) is the statistic's 0.1% critical value.
    ranked = u.sort().values
    cdf = torch.arange(1, len(u) + 1, dtype=torch.float64) / len(u)
    assert float(torch.maximum(cdf - ranked, ranked - (cdf - 1 / len(u))).max()) < 1.95 / len(u) ** 0.5
    assert len(set(u.tolist())) > 0.999 * len(u)
    # A row's value depends on its key alone, not on its position or its batch mates.
    assert torch.equal(keyed_uniforms(seeds[[7, 500]], offsets[[7, 500]]), u[[7, 500]])
    assert not torch.equal(keyed_uniforms(torch.tensor([1]), torch.tensor([0])),
                           keyed_uniforms(torch.tensor([2]), torch.tensor([0])))


def test_keyed_rows_draw_what_they_draw_alone_and_follow_the_distribution():
    torch.manual_seed(2)
    logits = torch.randn(6, 50) * 2
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0][i % 3], top_k=[0, 10][i % 2], seed=i) for i in range(6)]
    keys = torch.tensor([[i, 3] for i in range(6)])
    together = sample_batch(logits, params, keys=keys)
    alone = [int(sample_batch(logits[i:i + 1], [params[i]], keys=keys[i:i + 1])) for i in range(6)]
    assert together.tolist() == alone
    # One row drawn at 20000 offsets: the counts follow the row's distribution.
    param = SamplingParams(temperature=1.0, top_k=8)
    row = logits[1:2].expand(20000, -1)
    ids = sample_batch(row, [param] * 20000, keys=torch.stack([torch.full((20000,), 9), torch.arange(20000)], 1))
    probs = logits_to_probs(logits[1], param)
    support = torch.nonzero(probs).flatten()
    counts = torch.bincount(ids, minlength=50)
    assert counts.sum() == counts[support].sum()  # nothing outside top-k
    expected = probs[support].double() * 20000
    chi_square = float(((counts[support] - expected) ** 2 / expected).sum())
    assert len(support) == 8 and chi_square < 24.3  # the 0.1% critical value for 7 degrees of freedom


def test_sample_from_probs_shapes_and_zero_mass():
    probs = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])  # [1, 2, 3]
    ids = sample_from_probs(probs, _gen(0))
    assert ids.shape == (1, 2) and ids.tolist() == [[1, 0]]


def test_sample_from_probs_follows_the_distribution():
    # Zero-probability tokens (including the last one) are never drawn, and frequencies match.
    probs = torch.tensor([0.1, 0.0, 0.25, 0.0, 0.05, 0.6, 0.0])
    num_samples = 200_000
    ids = sample_from_probs(probs.expand(num_samples, -1).contiguous(), _gen(0))
    freq = torch.bincount(ids, minlength=probs.numel()).double() / num_samples
    assert freq[probs == 0].sum() == 0
    assert (freq - probs.double()).abs().max() < 4 * math.sqrt(0.25 / num_samples)


def test_two_level_search_over_a_large_vocabulary_follows_the_distribution():
    # Over 8192 tokens the search goes block by block: mass in a few scattered tokens, one of
    # them the last of a padded vocabulary and one a block's last, everything else zero.
    vocab = 8_300  # not a multiple of the 128-token block: padded
    support = {0: 0.1, 127: 0.2, 128: 0.05, 4_999: 0.3, 6_400: 0.15, vocab - 1: 0.2}
    probs = torch.zeros(vocab)
    for token, p in support.items():
        probs[token] = p
    num_samples, generator = 100_000, _gen(1)
    ids = torch.cat([sample_from_probs(probs.expand(2_000, -1), generator) for _ in range(num_samples // 2_000)])
    freq = torch.bincount(ids, minlength=vocab).double() / num_samples
    assert set(torch.nonzero(freq).flatten().tolist()) == set(support)
    assert (freq - probs.double()).abs().max() < 4 * math.sqrt(0.25 / num_samples)


@pytest.mark.parametrize("kwargs", [
    {"max_new_tokens": 0},
    {"max_new_tokens": -3},
    {"max_new_tokens": 2.5},
    {"temperature": -0.1},
    {"temperature": float("nan")},
    {"top_k": -1},
    {"top_k": 1.5},
    {"top_p": 0.0},
    {"top_p": 1.01},
    {"top_p": -0.5},
    {"top_p": float("nan")},
    {"stop": [""]},
    {"stop": ["ok", 3]},
])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert p.is_greedy and p.top_k == 0 and p.top_p == 1.0 and p.stop == [] and not p.ignore_eos
    assert SamplingParams(stop="END").stop == ["END"]
    assert not SamplingParams(temperature=0.7).is_greedy


@pytest.mark.skipif(load_cpu_kernels() is None,
                    reason="x86 kernels unavailable: the twin would be compared with itself")
@pytest.mark.parametrize("vocab", [1, 7, 127, 128, 300, 8_300, 32_768, 151_936])
def test_sample_rows_kernel_matches_its_twin(vocab):
    # sample_from_probs (the C++ sample_rows on the CPU) against reference_sample_from_probs
    # (torch ops), same seeds: peaked, flat and sparse rows, zero mass in padding-like tails.
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor([0.1, 1.0, 3.0, 8.0, 1.0, 1.0])[:, None]
    probs = torch.softmax(logits, dim=-1)
    probs[4, vocab // 2:] = 0.0  # no mass in the second half
    probs[4, 0] = max(float(probs[4, 0]), 1e-3)
    probs[5] = 0.0
    probs[5, vocab - 1] = 0.5  # mass only at the end (and the start)
    probs[5, 0] = 0.5
    for seed in range(20):
        got = sample_from_probs(probs, _gen(seed))
        want = reference_sample_from_probs(probs, _gen(seed))
        assert torch.equal(got, want)
        assert (probs.gather(1, got[:, None]) > 0).all()
    assert sample_from_probs(probs[0], _gen(0)).shape == ()


def test_batched_extras_equal_the_row_by_row_twin():
    """Penalties, logit bias and min_tokens over many rows at once: bit for bit what each row
    gets alone, including rows with none of them, repeated tokens and an empty history."""
    torch.manual_seed(3)
    vocab_size = 40
    logits = torch.randn(6, vocab_size) * 3
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(logit_bias={3: 5.0, 7: -100, 39: 0.5}),
        SamplingParams(min_tokens=4),  # short: EOS masked
        SamplingParams(min_tokens=2),  # long enough: untouched
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5, logit_bias={0: 1.0}, min_tokens=9),
    ]
    prompts = [[1, 2, 3], [5], [], [8, 8], [9], [3, 4, 5, 6]]
    outputs = [[3, 3, 10], [10, 10, 10, 11], [2], [1, 2], [4, 4, 4], []]
    eos = [2, 39]
    got = apply_extras(logits, params, prompts, outputs, eos)
    want = reference_apply_extras(logits, params, prompts, outputs, eos)
    assert torch.equal(got, want)
    assert not torch.equal(got[0], logits[0]) and not torch.equal(got[1], logits[1])
    assert got[3, 2] == float("-inf") and torch.equal(got[4], logits[4])
    assert [changes_logits(p) for p in params] == [True] * 6 and not changes_logits(SamplingParams(logprobs=3))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_extras_equal_the_twin_on_cuda():
    torch.manual_seed(4)
    logits = (torch.randn(3, 64) * 3).cuda()
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.2), SamplingParams(logit_bias={5: 2.0}),
              SamplingParams(min_tokens=3, frequency_penalty=0.7)]
    prompts, outputs = [[1, 2, 3], [4], [9, 9]], [[3, 7, 7], [], [2]]
    got = apply_extras(logits, params, prompts, outputs, [2])
    assert torch.equal(got, reference_apply_extras(logits, params, prompts, outputs, [2]))
