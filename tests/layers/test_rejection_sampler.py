"""Rejection sampling reproduces the target distribution; greedy verification matches argmax."""

import pytest
import torch

from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.layers.sampler import logits_to_probs
from fastdraft.sampling_params import SamplingParams
from fastdraft.layers.rejection_sampler import (reference_rejection_sample_keyed, reference_verify_sampled,
                                              rejection_sample_batch, rejection_sample_keyed, verify_greedy,
                                              verify_sampled)

# verify_sampled runs the C++ rejection_sample on the CPU; its twin runs torch ops. Both must
# pass every statistical test, and give the same tokens from the same seed.
NO_KERNELS = load_cpu_kernels() is None
VERIFIERS = [pytest.param(verify_sampled, id="kernel", marks=pytest.mark.skipif(
                 NO_KERNELS, reason="x86 kernels unavailable: verify_sampled would run its twin, the 'twin' case")),
             pytest.param(reference_verify_sampled, id="twin")]


def test_greedy_accepts_the_matching_prefix_then_recovers():
    target_logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 7, 1, 9]):
        target_logits[row, best] = 5.0
    result = verify_greedy(torch.tensor([3, 7, 2]), target_logits)
    assert result.num_accepted == 2 and result.output_token_ids == [3, 7, 1] and not result.is_bonus
    result = verify_greedy(torch.tensor([3, 7, 1]), target_logits)
    assert result.num_accepted == 3 and result.output_token_ids == [3, 7, 1, 9] and result.is_bonus
    result = verify_greedy(torch.tensor([0, 7, 1]), target_logits)
    assert result.num_accepted == 0 and result.output_token_ids == [3]


def _emitted_histogram(verify, target_probs, draft_probs, num_trials, seed):
    """Histogram of every token emitted over ``num_trials`` verification steps."""
    gen = torch.Generator().manual_seed(seed)
    k, vocab = draft_probs.shape
    counts = torch.zeros(vocab)
    for _ in range(num_trials):
        draft_ids = torch.stack([torch.multinomial(draft_probs[i], 1, generator=gen)[0] for i in range(k)])
        result = verify(draft_ids, draft_probs, target_probs, gen)
        for token in result.output_token_ids:
            counts[token] += 1
    return counts / counts.sum()


@pytest.mark.parametrize("verify", VERIFIERS)
@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_follows_the_target_distribution(k, verify):
    """As in vLLM's test: with the same target distribution at every position, every emitted
    token (accepted, recovered or bonus) is a draw from it, and the distance between the
    empirical and the target distribution shrinks as samples grow."""
    vocab = 8
    gen = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(vocab, generator=gen) * 2, dim=0)
    draft = torch.softmax(torch.randn(k, vocab, generator=gen) * 2, dim=-1)  # a deliberately different draft
    target_probs = target.expand(k + 1, vocab)
    distances = []
    for num_trials in (100, 1000, 10000):
        empirical = _emitted_histogram(verify, target_probs, draft, num_trials, seed=num_trials)
        distances.append(0.5 * (empirical - target).abs().sum().item())  # total variation
    assert distances[0] > distances[1] > distances[2]
    assert distances[2] < 0.02
    # The draft's own distribution is far away: the test can tell them apart.
    assert 0.5 * (draft[0] - target).abs().sum().item() > 0.1


@pytest.mark.parametrize("verify", VERIFIERS)
def test_rejection_handles_zero_draft_probability_and_point_mass_drafts(verify):
    target = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    point_mass = torch.tensor([[0.0, 1.0, 0.0]])  # e.g. an n-gram proposal
    gen = torch.Generator().manual_seed(1)
    accepted = sum(verify(torch.tensor([1]), point_mass, target, gen).num_accepted for _ in range(2000))
    assert 0.45 < accepted / 2000 < 0.55  # accepted with probability target[0, 1] = 0.5
    # a draft token the target gives probability 0 is always rejected, and never re-emitted
    for _ in range(50):
        result = verify(torch.tensor([2]), torch.tensor([[0.0, 0.0, 1.0]]), target, gen)
        assert result.num_accepted == 0 and result.output_token_ids[0] in (0, 1)


@pytest.mark.parametrize("verify", VERIFIERS)
def test_seeded_verification_is_reproducible(verify):
    target = torch.softmax(torch.randn(4, 16), -1)
    draft = torch.softmax(torch.randn(3, 16), -1)
    ids = torch.tensor([1, 2, 3])
    a = [verify(ids, draft, target, torch.Generator().manual_seed(5)).output_token_ids for _ in range(3)]
    assert a[0] == a[1] == a[2]


@pytest.mark.parametrize("verify", VERIFIERS)
def test_draft_probs_over_part_of_the_vocabulary_give_the_same_outcome_as_scattered_ones(verify):
    # A draft whose head keeps only some tokens hands over [k, draft_vocab] probabilities and
    # those tokens' ids; verification must equal verifying the zero-filled [k, vocab] rows.
    vocab, k = 12, 3
    gen = torch.Generator().manual_seed(1)
    draft_vocab_ids = torch.tensor([0, 2, 3, 5, 8, 11])
    num_rejected = 0
    for trial in range(200):
        target_probs = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 2, -1)
        small = torch.softmax(torch.randn(k, len(draft_vocab_ids), generator=gen) * 2, -1)  # [k, draft_vocab]
        full = torch.zeros(k, vocab).index_copy_(1, draft_vocab_ids, small)  # [k, vocab]
        draft_ids = draft_vocab_ids[torch.multinomial(small, 1, generator=gen)[:, 0]]
        a = verify(draft_ids, full, target_probs, torch.Generator().manual_seed(trial))
        b = verify(draft_ids, small, target_probs, torch.Generator().manual_seed(trial), draft_vocab_ids)
        assert (a.output_token_ids, a.num_accepted) == (b.output_token_ids, b.num_accepted)
        num_rejected += a.num_accepted < k
    assert num_rejected > 50  # the residual path ran


@pytest.mark.skipif(NO_KERNELS, reason="x86 kernels unavailable: the twin would be compared with itself")
@pytest.mark.parametrize("vocab,draft_vocab", [(12, None), (300, 96), (151_936, 32_768)])
def test_rejection_sample_kernel_matches_its_twin(vocab, draft_vocab):
    gen = torch.Generator().manual_seed(vocab)
    num_rejected = 0
    for trial in range(60 if vocab < 1000 else 10):
        k = trial % 5  # k = 0: a plain sampling step
        target_probs = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 3, -1)
        draft_vocab_ids = None
        if draft_vocab is None:
            draft_probs = torch.softmax(torch.randn(k, vocab, generator=gen) * 3, -1)
            draft_ids = torch.multinomial(draft_probs, 1, generator=gen)[:, 0] if k else torch.zeros(0, dtype=torch.long)
        else:
            draft_vocab_ids = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab]).values
            # the draft agrees with the target on its tokens, more or less
            logits = torch.log(target_probs[:k, draft_vocab_ids] + 1e-9) + torch.randn(k, draft_vocab, generator=gen)
            draft_probs = torch.softmax(logits, -1)
            cols = torch.multinomial(draft_probs, 1, generator=gen)[:, 0] if k else torch.zeros(0, dtype=torch.long)
            draft_ids = draft_vocab_ids[cols]
        a = verify_sampled(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(trial), draft_vocab_ids)
        b = reference_verify_sampled(draft_ids, draft_probs, target_probs, torch.Generator().manual_seed(trial),
                                     draft_vocab_ids)
        assert (a.output_token_ids, a.num_accepted) == (b.output_token_ids, b.num_accepted)
        num_rejected += a.num_accepted < k
    assert num_rejected >= 2  # the residual path ran


def _batch_case(seed: int, vocab: int = 12):
    """Four requests, flat: greedy with k = 3 and k = 0, sampled with k = 2 and k = 1 (their
    own temperatures and top-k), each with its own seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    ks = [3, 0, 2, 1]
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.3, top_k=5, seed=2)]
    cu = [0]
    for k in ks:
        cu.append(cu[-1] + k)
    target_logits = torch.randn(cu[-1] + len(ks), vocab, generator=gen) * 2  # [num_draft_tokens + num_reqs, vocab]
    draft_probs = torch.softmax(torch.randn(cu[-1], vocab, generator=gen) * 2, dim=-1)  # [num_draft_tokens, vocab]
    draft_ids = torch.stack([torch.multinomial(row, 1, generator=gen)[0] for row in draft_probs])
    draft_ids[:2] = target_logits[:2].argmax(-1)  # the first greedy request accepts two, then is rejected
    return ks, cu, params, target_logits, draft_probs, draft_ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_rejection_sampler_gives_each_request_what_it_gets_alone(seed):
    ks, cu, params, target_logits, draft_probs, draft_ids = _batch_case(seed)
    generators = [None if p.is_greedy else torch.Generator().manual_seed(p.seed) for p in params]
    result = rejection_sample_batch(draft_ids, cu, target_logits, params, generators, draft_probs)
    assert result.num_draft == ks
    for i, (k, p) in enumerate(zip(ks, params)):
        rows = target_logits[cu[i] + i:cu[i + 1] + i + 1]  # [k + 1, vocab]
        if p.is_greedy:
            alone = verify_greedy(draft_ids[cu[i]:cu[i + 1]], rows)
        else:
            alone = verify_sampled(draft_ids[cu[i]:cu[i + 1]], draft_probs[cu[i]:cu[i + 1]],
                                   logits_to_probs(rows, p), torch.Generator().manual_seed(p.seed))
        assert result.output_token_ids[i] == alone.output_token_ids
        assert result.num_accepted[i] == alone.num_accepted
    assert result.num_accepted[0] == 2 and result.num_accepted[1] == 0


@pytest.mark.parametrize("is_keyed", [False, True], ids=["generators", "keyed"])
def test_batched_rejection_sampler_follows_each_requests_target_distribution(is_keyed):
    # Three sampled requests in one batch, each with its own target and a deliberately different
    # draft, k = 1, 2 and 3: every token each emits is a draw from its own target, with a
    # generator per request or from keyed streams (every request verified at once).
    vocab, ks = 8, [1, 2, 3]
    gen = torch.Generator().manual_seed(0)
    targets = [torch.softmax(torch.randn(vocab, generator=gen) * 2, dim=0) for _ in ks]
    drafts = [torch.softmax(torch.randn(k, vocab, generator=gen) * 2, dim=-1) for k in ks]
    cu = [0, 1, 3, 6]
    # Temperature 1 over log-probabilities gives back the target itself.
    target_logits = torch.cat([t.log().expand(k + 1, vocab) for t, k in zip(targets, ks)])
    draft_probs = torch.cat(drafts)  # [6, vocab]
    params = [SamplingParams(temperature=1.0)] * len(ks)
    generators = [torch.Generator().manual_seed(10 + i) for i in range(len(ks))]
    counts = torch.zeros(len(ks), vocab)
    for trial in range(4000):
        draft_ids = torch.stack([torch.multinomial(row, 1, generator=gen)[0] for row in draft_probs])
        if is_keyed:  # each request's next draw index
            keys = torch.tensor([[10 + i, trial] for i in range(len(ks))])
            result = rejection_sample_keyed(draft_ids, cu, target_logits, params, keys, draft_probs)
        else:
            result = rejection_sample_batch(draft_ids, cu, target_logits, params, generators, draft_probs)
        for i, tokens in enumerate(result.output_token_ids):
            for token in tokens:
                counts[i, token] += 1
    for i, target in enumerate(targets):
        empirical = counts[i] / counts[i].sum()
        assert 0.5 * (empirical - target).abs().sum().item() < 0.03  # total variation
        assert 0.5 * (drafts[i][0] - target).abs().sum().item() > 0.1  # the draft alone would fail


def test_batched_rejection_sampler_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="target rows"):
        rejection_sample_batch(torch.tensor([1, 2]), [0, 2], torch.zeros(2, 5), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample_batch(torch.tensor([1]), [0, 1], torch.zeros(2, 5), [SamplingParams(temperature=1.0)],
                               [None])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("is_part_vocab", [False, True])
def test_keyed_rejection_sampler_equals_its_request_by_request_twin(seed, is_part_vocab):
    """All sampled requests at once with keyed uniforms: what each gets verified alone with the
    same keys, greedy requests included, a request without drafts last, the draft's head over
    all of the vocabulary or part of it."""
    ks, cu, params, target_logits, draft_probs, draft_ids = _batch_case(seed)
    ks, cu = ks + [0], cu + [cu[-1]]
    params = params + [SamplingParams(temperature=0.9, seed=5)]
    target_logits = torch.cat([target_logits, torch.randn(1, target_logits.shape[1])])
    vocab_ids = None
    if is_part_vocab:  # the draft's head covers the even ids, and its tokens are among them
        vocab_ids = torch.arange(0, target_logits.shape[1], 2)
        draft_probs = torch.softmax(torch.randn(cu[-1], len(vocab_ids), generator=torch.Generator().manual_seed(seed)),
                                    dim=-1)
        draft_ids = vocab_ids[torch.multinomial(draft_probs, 1, generator=torch.Generator().manual_seed(seed))[:, 0]]
    keys = torch.tensor([[seed * 10 + i, 7 + i] for i in range(len(params))])
    got = rejection_sample_keyed(draft_ids, cu, target_logits, params, keys, draft_probs, vocab_ids)
    want = reference_rejection_sample_keyed(draft_ids, cu, target_logits, params, keys, draft_probs, vocab_ids)
    assert got.output_token_ids == want.output_token_ids
    assert got.num_accepted == want.num_accepted and got.num_draft == ks
    # Another draw index draws other uniforms: some outcome changes over a few.
    others = [rejection_sample_keyed(draft_ids, cu, target_logits, params, keys + torch.tensor([0, d]), draft_probs,
                                     vocab_ids).output_token_ids for d in range(1, 6)]
    assert any(o != got.output_token_ids for o in others)


def test_keyed_rejection_sampler_checks_its_inputs():
    with pytest.raises(ValueError, match="target rows"):
        rejection_sample_keyed(torch.tensor([1, 2]), [0, 2], torch.zeros(2, 5), [SamplingParams()],
                               torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="one key"):
        rejection_sample_keyed(torch.tensor([1]), [0, 1], torch.zeros(2, 5), [SamplingParams()],
                               torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample_keyed(torch.tensor([1]), [0, 1], torch.zeros(2, 5), [SamplingParams(temperature=1.0)],
                               torch.zeros(1, 2, dtype=torch.long))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", [0, 1])
def test_keyed_rejection_sampler_equals_its_twin_on_cuda(seed):
    ks, cu, params, target_logits, draft_probs, draft_ids = _batch_case(seed)
    keys = torch.tensor([[seed * 10 + i, 3 + i] for i in range(len(params))], device="cuda")
    args = (draft_ids.cuda(), cu, target_logits.cuda(), params, keys, draft_probs.cuda())
    got, want = rejection_sample_keyed(*args), reference_rejection_sample_keyed(*args)
    assert got.output_token_ids == want.output_token_ids and got.num_accepted == want.num_accepted
