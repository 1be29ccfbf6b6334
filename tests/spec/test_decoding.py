"""Speculative decoding on tiny models: greedy equality, rollback, adaptivity, errors."""

import json
import random
import shutil
from dataclasses import replace

import pytest
import torch

from fastdraft.engine.generate import TextGenerator, generate_token_ids
from fastdraft.engine.loader import load_model
from fastdraft.layers.kv_cache import KVCache
from fastdraft.layers.sampler import logits_to_probs, sample_from_probs
from fastdraft.sampling_params import SamplingParams
from fastdraft.spec import draft_length
from fastdraft.spec.config import SpeculativeConfig, build_proposer, check_vocab_compatible
from fastdraft.spec.decoding import SpecMetrics, _match_vocab, speculative_generate
from fastdraft.spec.draft_length import (AdaptiveDraftLength, DraftPlan, StepCosts, measure_step_costs,
                                         step_costs_for)
from fastdraft.spec.proposer import DraftModelProposer, NgramProposer, Proposal

PROMPTS = ["def add(a, b):\n", "The quick brown fox", "for i in range(10):\n    print(i)\n" * 2]


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_model(tiny_models.dir("qwen2"), dtype="fp32")


def _plain(loaded, prompt_ids, params):
    cache = KVCache.from_config(loaded.config, 256, dtype=loaded.model.dtype)
    return list(generate_token_ids(loaded.model, prompt_ids, params, cache, loaded.config.eos_token_ids))


def _spec(loaded, proposer_factory, prompt_ids, params, k=4, adaptive=False):
    cache = KVCache.from_config(loaded.config, 256 + k + 1, dtype=loaded.model.dtype)
    proposer = proposer_factory(cache)
    metrics = SpecMetrics()
    out = list(speculative_generate(loaded.model, proposer, prompt_ids, params, cache,
                                    loaded.config.eos_token_ids, k, adaptive, metrics))
    return out, metrics, cache


@pytest.mark.parametrize("draft_kind", ["self", "same_model", "random_model", "ngram"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_equals_plain_greedy(target, tiny_models, draft_kind, adaptive):
    if draft_kind == "random_model":
        draft_loaded = load_model(tiny_models.dir("llama"), dtype="fp32")
    elif draft_kind == "same_model":
        draft_loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    else:
        draft_loaded = None
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    config = SpeculativeConfig(draft=draft_kind if draft_kind in ("self", "ngram") else "model",
                               num_speculative_tokens=4, is_adaptive=adaptive)
    for text in PROMPTS:
        prompt_ids = target.tokenizer.encode(text)
        expected = _plain(target, prompt_ids, params)
        got, metrics, _ = _spec(target, lambda c: build_proposer(config, target, c, draft_loaded), prompt_ids,
                                params, k=4, adaptive=adaptive)
        assert got == expected, f"{draft_kind}: speculative output diverged for {text!r}"
        if draft_kind == "same_model" and not adaptive:
            assert metrics.acceptance_rate == 1.0 and metrics.mean_accepted_length == pytest.approx(5.0, abs=0.6)


def test_random_draft_is_mostly_rejected_and_adaptive_falls_back(target, tiny_models):
    draft = load_model(tiny_models.dir("llama"), dtype="fp32")
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    prompt_ids = target.tokenizer.encode(PROMPTS[0])
    config = SpeculativeConfig(draft="model", num_speculative_tokens=4)
    _, fixed, _ = _spec(target, lambda c: build_proposer(config, target, c, draft), prompt_ids, params, 4, False)
    _, adaptive, _ = _spec(target, lambda c: build_proposer(config, target, c, draft), prompt_ids, params, 4, True)
    assert fixed.acceptance_rate < 0.5
    # With a poor draft the controller stops speculating (plain steps) or drafts less.
    assert adaptive.num_plain_steps > 0 or adaptive.num_draft_tokens < fixed.num_draft_tokens


def test_adaptive_controller_chooses_plain_decoding_for_a_useless_draft():
    controller = AdaptiveDraftLength(k_max=4, costs=StepCosts(draft=0.4, verify=[1.0] * 5))
    for _ in range(30):
        controller.update(num_draft=4, num_accepted=0)
    ks = [controller.next_plan().num_tokens for _ in range(16)]
    assert ks.count(0) >= 14 and max(ks) <= 1  # plain decoding, with rare k=1 probes
    for _ in range(30):
        controller.update(num_draft=4, num_accepted=4)
    assert controller.next_plan().num_tokens == 4
    # An expensive verification pass (e.g. a slow small-M kernel) makes speculation not pay.
    costly = AdaptiveDraftLength(k_max=4, costs=StepCosts(draft=0.35, verify=[1.0, 1.8, 2.0, 2.2, 2.4]))
    costly.acceptance = 0.6
    assert costly.next_plan().num_tokens == 0


def _plain_steps_until_speculating(controller: AdaptiveDraftLength, max_steps: int = 16) -> int:
    """Plain steps the controller takes before it drafts again (probes included)."""
    for step in range(max_steps):
        k = controller.next_plan().num_tokens
        if k > 0:
            return step
        controller.update(num_draft=0, num_accepted=0)
    return max_steps


def test_adaptive_controller_leaves_a_bad_spell_of_a_good_draft_within_a_few_plain_steps():
    costs = StepCosts(draft=0.28, verify=[1.0, 1.0, 1.09, 1.24, 1.37])  # the 0.5B/1.5B pair, measured
    controller = AdaptiveDraftLength(k_max=4, costs=costs)
    for _ in range(40):  # a good draft: about 0.8 per position
        controller.update(num_draft=4, num_accepted=4)
        controller.update(num_draft=4, num_accepted=2)
    for _ in range(25):  # then a long run of early rejections
        controller.update(num_draft=2, num_accepted=0)
    assert controller.next_plan().num_tokens == 0
    # Plain steps pull the estimate back toward the long-run rate: speculation resumes before
    # the first k=1 probe (which comes after probe_every = 8 plain steps).
    assert _plain_steps_until_speculating(controller) < 4


def test_adaptive_controller_survives_an_early_rejection():
    # One rejection at the first step must not cost a request dozens of plain steps, as it would
    # with a one-trial prior and no pull (costs: the 0.5B/1.5B pair at 1024 tokens of context).
    controller = AdaptiveDraftLength(k_max=4, costs=StepCosts(draft=0.29, verify=[1.0, 1.04, 1.12, 1.26, 1.40]))
    k = controller.next_plan().num_tokens
    assert k >= 1
    controller.update(num_draft=k, num_accepted=0)
    assert _plain_steps_until_speculating(controller) <= 1


def test_adaptive_controller_keeps_a_poor_draft_plain_through_plain_steps():
    controller = AdaptiveDraftLength(k_max=4, costs=StepCosts(draft=0.3, verify=[1.0, 1.05, 1.1, 1.2, 1.3]))
    for _ in range(30):
        controller.update(num_draft=2, num_accepted=0)
    ks = []
    for _ in range(32):
        ks.append(controller.next_plan().num_tokens)
        controller.update(num_draft=ks[-1], num_accepted=0)
    assert ks.count(0) >= 28 and max(ks) <= 1  # plain, with rare k=1 probes that fail


def test_adaptive_controller_validates_its_settings():
    for kwargs in ({"ema": 1.0}, {"prior": 1.5}, {"prior_trials": 0.0}, {"probe_every": 0}):
        with pytest.raises(ValueError):
            AdaptiveDraftLength(k_max=4, **kwargs)


def test_adaptive_controller_estimates_per_token_acceptance():
    # Steps drawn with per-token acceptance a: the estimate must approach a, not the
    # accepted/drafted ratio, which counts positions after a rejection as failures.
    a, k = 0.9, 4
    rng = torch.Generator().manual_seed(0)
    controller = AdaptiveDraftLength(k_max=k, ema=0.99)
    num_accepted_total = num_draft_total = 0
    for _ in range(2000):
        passed = (torch.rand(k, generator=rng) < a).int().cumprod(0).sum().item()
        controller.update(num_draft=k, num_accepted=passed)
        num_accepted_total += passed
        num_draft_total += k
    assert abs(controller.acceptance - a) < 0.03
    assert num_accepted_total / num_draft_total < a - 0.05  # the biased ratio


PAIR_COSTS = StepCosts(draft=0.27, verify=[1.0, 1.075, 1.15, 1.225, 1.3])  # the 0.5B/1.5B pair, about


def _simulated_gain(k: int, stops: bool, share: float, a_conf: float, a_unsure: float, costs: StepCosts,
                    num_steps: int = 20000) -> float:
    """Tokens per unit of plain-step time, by drawing steps position by position."""
    rng = torch.Generator().manual_seed(0)
    tokens = cost = 0.0
    for _ in range(num_steps):
        u = torch.rand(2 * k, generator=rng).tolist()
        num_draft, num_accepted, is_chain = 0, 0, True
        for i in range(k):
            num_draft += 1
            is_sure = u[2 * i] < share
            if is_chain and u[2 * i + 1] < (a_conf if is_sure else a_unsure):
                num_accepted += 1
            else:
                is_chain = False
            if stops and not is_sure:
                break
        tokens += num_accepted + 1
        cost += num_draft * costs.draft + costs.verify[num_draft]
    return tokens / cost


@pytest.mark.parametrize("k,stops", [(1, False), (3, False), (2, True), (4, True)])
def test_adaptive_gain_matches_a_simulation_of_its_model(k, stops):
    share, a_conf, a_unsure = 0.7, 0.92, 0.5
    controller = AdaptiveDraftLength(k_max=4, costs=PAIR_COSTS)
    controller._confident.set_recent(a_conf)
    controller._unsure.set_recent(a_unsure)
    controller._share.set_recent(share)
    expected = _simulated_gain(k, stops, share, a_conf, a_unsure, PAIR_COSTS)
    assert controller.gain(k, stops) == pytest.approx(expected, rel=0.02)


def _feed(controller: AdaptiveDraftLength, share: float, a_conf: float, a_unsure: float, num_steps: int = 300,
          k: int = 4, judges: bool = True) -> None:
    """Update ``controller`` with steps drawn from the model (drafting through every position)."""
    rng = torch.Generator().manual_seed(1)
    for _ in range(num_steps):
        is_sure = (torch.rand(k, generator=rng) < share).tolist()
        passed = [torch.rand(1, generator=rng).item() < (a_conf if s else a_unsure) for s in is_sure]
        num_accepted = int(torch.tensor(passed).int().cumprod(0).sum())
        controller.update(k, num_accepted, is_sure if judges else None)


def test_adaptive_plan_stops_drafting_after_an_unsure_token_when_that_pays():
    # The 0.5B/1.5B pair at T=0.7: sure of ~70% of positions, 92% of those accepted, half of the rest.
    judging = AdaptiveDraftLength(k_max=4, costs=PAIR_COSTS)
    _feed(judging, share=0.7, a_conf=0.92, a_unsure=0.5)
    plan = judging.next_plan()
    assert plan == DraftPlan(4, stops_when_unconfident=True)
    assert judging.gain(4, True) > 1.02 * max(judging.gain(k) for k in range(5))
    # The same steps without confidence flags: one per-token rate (about 0.8), a shorter fixed k.
    blind = AdaptiveDraftLength(k_max=4, costs=PAIR_COSTS)
    _feed(blind, share=0.7, a_conf=0.92, a_unsure=0.5, judges=False)
    assert blind.acceptance == pytest.approx(0.8, abs=0.05)
    plan = blind.next_plan()
    assert plan.num_tokens in (2, 3) and not plan.stops_when_unconfident
    # A draft whose unsure tokens are accepted as often as its sure ones has no reason to stop.
    even = AdaptiveDraftLength(k_max=4, costs=PAIR_COSTS)
    _feed(even, share=0.7, a_conf=0.95, a_unsure=0.95)
    assert even.next_plan() == DraftPlan(4, stops_when_unconfident=False)


def test_adaptive_update_checks_the_confidence_flags():
    controller = AdaptiveDraftLength(k_max=4)
    with pytest.raises(ValueError, match="flags"):
        controller.update(num_draft=3, num_accepted=1, is_confident=[True])


def test_draft_proposer_flags_confidence_and_stops_when_asked(target, tiny_models):
    draft = load_model(tiny_models.dir("llama"), dtype="fp32")  # random weights: never sure
    cache = KVCache.from_config(draft.config, 64, dtype=torch.float32)
    prompt_ids = target.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0.8, seed=0)
    for min_confidence, stops, num_expected, flags in ((0.9, False, 4, [False] * 4), (0.9, True, 1, [False]),
                                                       (0.0, True, 4, None), (1e-6, True, 4, [True] * 4)):
        proposer = DraftModelProposer(draft.model, cache, min_confidence=min_confidence)
        proposer.start(prompt_ids)
        proposal = proposer.propose(prompt_ids + [1], 4, params, torch.Generator().manual_seed(0), stops)
        assert proposal.draft_token_ids.shape[0] == num_expected and proposal.is_confident == flags
        assert proposal.draft_probs.shape[0] == num_expected


def test_kv_cache_is_rolled_back_to_the_committed_prefix(target, tiny_models):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompt_ids = target.tokenizer.encode(PROMPTS[2])
    # A poor draft writing its guesses straight into the target's cache (as the self draft does).
    draft = load_model(tiny_models.dir("llama"), dtype="fp32").model
    got, metrics, cache = _spec(target, lambda c: DraftModelProposer(draft, c, shares_target_cache=True),
                                prompt_ids, params)
    assert metrics.num_accepted_tokens < metrics.num_draft_tokens  # some tokens were rejected
    # The cache holds exactly the committed tokens but the last, with the target's own KV.
    assert cache.seq_lens[0] == len(prompt_ids) + len(got) - 1
    plain_cache = KVCache.from_config(target.config, 256, dtype=torch.float32)
    list(generate_token_ids(target.model, prompt_ids, params, plain_cache, []))
    n = cache.seq_lens[0]
    assert torch.allclose(cache.k[:, 0, :, :n], plain_cache.k[:, 0, :, :n], atol=1e-5)
    assert torch.allclose(cache.v[:, 0, :, :n], plain_cache.v[:, 0, :, :n], atol=1e-5)


def test_separate_draft_cache_is_rolled_back(target, tiny_models):
    draft = load_model(tiny_models.dir("llama"), dtype="fp32")
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompt_ids = target.tokenizer.encode(PROMPTS[0])
    draft_cache = KVCache.from_config(draft.config, 300, dtype=torch.float32)
    proposer = DraftModelProposer(draft.model, draft_cache)
    got, _, _ = _spec(target, lambda c: proposer, prompt_ids, params)
    assert draft_cache.seq_lens[0] <= len(prompt_ids) + len(got) - 1


def test_seeded_speculative_sampling_is_reproducible(target):
    generator = TextGenerator(target, max_seq_len=200, speculative=SpeculativeConfig(draft="self"))
    params = SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    first = generator.generate(PROMPTS[0], params).token_ids
    assert generator.generate(PROMPTS[0], params).token_ids == first
    other = generator.generate(PROMPTS[0], SamplingParams(max_new_tokens=30, temperature=0.8, seed=8,
                                                          ignore_eos=True)).token_ids
    assert other != first


class _UniformOverSupportProposer:
    """Drafts tokens uniformly over the target's sampling support: it overlaps the target's
    distribution without matching it, so accepted, recovered and bonus tokens all occur and a
    wrong residual distribution would show (it is ~0.1 away in total variation here). After
    the first token it stops at random, as a draft stopping when unconfident does: proposal
    lengths that depend on the draft's own draws must leave the output exact."""

    step_costs = None

    def __init__(self, next_probs) -> None:
        self.next_probs = next_probs

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, token_ids, num_tokens, params, generator, stops_when_unconfident=False) -> Proposal:
        draft_ids, draft_probs = [], []
        for i in range(num_tokens):
            if i > 0 and torch.rand(1, generator=generator).item() < 0.5:
                break
            support = self.next_probs(token_ids + draft_ids) > 0
            probs = support.float() / support.sum()  # [vocab_size]
            draft_ids.append(int(sample_from_probs(probs, generator)))
            draft_probs.append(probs)
        return Proposal(torch.tensor(draft_ids), torch.stack(draft_probs))

    def rollback(self, num_valid: int) -> None:
        pass


@pytest.mark.parametrize("num_speculative_tokens", [1, 2])
def test_speculative_sampling_follows_the_target_distribution_end_to_end(target, num_speculative_tokens):
    # Through the whole loop (drafting, verification, recovered and bonus tokens, rollback):
    # the joint distribution of the first two new tokens must be the target's own.
    params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    prompt_ids = target.tokenizer.encode(PROMPTS[0])

    def next_probs(ids: list[int]) -> torch.Tensor:
        cache = KVCache.from_config(target.config, 64, dtype=torch.float32)
        with torch.inference_mode():
            hidden = target.model(torch.tensor([ids]), cache, cache.append(len(ids)))
            return logits_to_probs(target.model.compute_logits(hidden[0, -1]), params)  # [vocab_size]

    first = next_probs(prompt_ids)
    exact = {(a, b): float(first[a] * p_b) for a in first.nonzero().flatten().tolist()
             for b, p_b in enumerate(next_probs(prompt_ids + [a]).tolist()) if p_b > 0}
    num_samples = 1500
    counts: dict[tuple[int, int], int] = {}
    metrics = SpecMetrics()
    cache = KVCache.from_config(target.config, 64, dtype=torch.float32)
    proposer = _UniformOverSupportProposer(next_probs)
    for seed in range(num_samples):
        cache.reset()
        out = list(speculative_generate(target.model, proposer, prompt_ids, replace(params, seed=seed), cache, [],
                                        num_speculative_tokens, False, metrics))
        counts[tuple(out[:2])] = counts.get(tuple(out[:2]), 0) + 1
    assert 0.2 < metrics.acceptance_rate < 0.95  # both accepted and recovered tokens
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(key, 0) / num_samples - p) for key, p in exact.items())
    assert tv < 0.05, f"total variation {tv:.3f} from the target's distribution"


def test_stops_at_eos_and_max_new_tokens(target):
    generator = TextGenerator(target, max_seq_len=200, speculative=SpeculativeConfig(draft="self"))
    out = generator.generate(PROMPTS[1], SamplingParams(max_new_tokens=7, ignore_eos=True))
    assert len(out.token_ids) == 7 and out.metrics.spec is not None
    plain = TextGenerator(target, max_seq_len=200).generate(PROMPTS[1], SamplingParams(max_new_tokens=50))
    spec = generator.generate(PROMPTS[1], SamplingParams(max_new_tokens=50))
    assert spec.token_ids == plain.token_ids  # EOS handling (if reached) is the same


def test_vocabulary_mismatch_is_a_clear_error(target, tiny_models, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_models.dir("llama"), other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100], list(vocab)[101]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_vocab_compatible(target, load_model(other, dtype="fp32"))
    with pytest.raises(ValueError, match="tokenizer differs"):
        TextGenerator(target, speculative=SpeculativeConfig(draft=str(other)))


def test_padded_draft_vocabulary_is_matched():
    probs = torch.softmax(torch.randn(2, 10), -1)
    padded = _match_vocab(probs, 16)
    assert padded.shape == (2, 16) and torch.all(padded[:, 10:] == 0) and torch.equal(padded[:, :10], probs)
    assert torch.equal(_match_vocab(padded, 10), probs)


def test_ngram_proposer_copies_the_continuation():
    proposer = NgramProposer(vocab_size=50)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    proposal = proposer.propose(tokens, 3, SamplingParams(), None)
    assert proposal.draft_token_ids.tolist() == [4, 5, 9]
    assert proposer.propose([7, 8], 3, SamplingParams(), None).draft_token_ids.numel() == 0


def _scan_ngram(token_ids: list[int], num_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup by scanning the context: longest n-gram first, latest earlier occurrence."""
    for n in range(min(max_ngram, len(token_ids) - 1), min_ngram - 1, -1):
        for start in range(len(token_ids) - n - 1, -1, -1):
            if token_ids[start:start + n] == token_ids[-n:]:
                return token_ids[start + n:start + n + num_tokens]
    return []


@pytest.mark.parametrize("max_ngram, min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_ngram_index_matches_a_scan_of_the_context(max_ngram, min_ngram):
    rng = random.Random(max_ngram * 10 + min_ngram)
    proposer = NgramProposer(vocab_size=8, max_ngram=max_ngram, min_ngram=min_ngram)
    for _ in range(3):  # requests: a new prompt rebuilds the index, with or without start()
        tokens = [rng.randrange(8) for _ in range(rng.randrange(1, 12))]
        if rng.random() < 0.5:
            proposer.start(tokens)
        for _ in range(60):  # committed tokens grow by 1 to 5 a step, as in speculative decoding
            num_tokens = rng.randrange(1, 6)
            proposal = proposer.propose(tokens, num_tokens, SamplingParams(), None)
            assert proposal.draft_token_ids.tolist() == _scan_ngram(tokens, num_tokens, max_ngram, min_ngram)
            tokens = tokens + [rng.randrange(8) for _ in range(rng.randrange(1, 6))]


def test_draft_length_must_fit_the_padded_shape(target):
    # Dense fp32 matmuls are not row-invariant: verification runs padded like a decode step.
    assert target.model.min_rows == 5
    with pytest.raises(ValueError, match="at most 4"):
        TextGenerator(target, speculative=SpeculativeConfig(draft="self", num_speculative_tokens=6))


@pytest.mark.parametrize("head_bits", [4, 8, 16])
def test_separate_draft_head_is_quantized_as_configured(target, tiny_models, head_bits):
    config = SpeculativeConfig(draft=str(tiny_models.dir("llama")), draft_lm_head_bits=head_bits)
    cache = KVCache.from_config(target.config, 64, dtype=torch.float32)
    proposer = build_proposer(config, target, cache)
    assert getattr(proposer.model.lm_head, "bits", 16) == head_bits
    assert proposer.model.model.layers[0].mlp.down_proj.bits == 4


def test_step_costs_are_measured_at_the_given_context(target):
    cache = KVCache.from_config(target.config, 256, dtype=target.model.dtype)
    proposer = build_proposer(SpeculativeConfig(draft="self", num_speculative_tokens=3), target, cache)
    costs = measure_step_costs(target.model, proposer, 3, context_len=200, repeats=2)
    assert len(costs.verify) == 4 and costs.verify[0] == 1.0 and costs.draft > 0
    assert cache.seq_lens[0] == 0, "the request's cache must not be touched"
    with pytest.raises(ValueError, match="context_len"):
        measure_step_costs(target.model, proposer, 3, context_len=0)


def test_step_costs_are_median_ratios_to_the_same_rounds_plain_step(target, monkeypatch):
    """Each round is timed against its own plain step. Here the memory state turns slow (every
    pass 2x) right after the first plain step and stays slow: the fastest time of each pass
    would pair that one fast plain step with slow verification and draft steps (2.2, 0.6)."""
    import fastdraft.spec.draft_length as draft_length

    cache = KVCache.from_config(target.config, 64, dtype=target.model.dtype)
    proposer = build_proposer(SpeculativeConfig(draft="self", num_speculative_tokens=1), target, cache)
    # Per round, seconds for: plain step, 2-token verification, draft step.
    rounds = [(1.0, 2.2, 0.6), (2.0, 2.2, 0.6), (2.0, 2.2, 0.6)]
    clock = iter([t for r in rounds for duration in r for t in (0.0, duration)])
    monkeypatch.setattr(draft_length.time, "perf_counter", lambda: next(clock))
    costs = measure_step_costs(target.model, proposer, 1, context_len=8, repeats=len(rounds))
    assert costs.verify == [1.0, pytest.approx(1.1)] and costs.draft == pytest.approx(0.3)
    with pytest.raises(ValueError, match="repeats"):
        measure_step_costs(target.model, proposer, 1, repeats=0)


def test_step_cost_timing_stops_at_its_time_budget(target, monkeypatch):
    import fastdraft.spec.draft_length as draft_length

    cache = KVCache.from_config(target.config, 64, dtype=target.model.dtype)
    proposer = build_proposer(SpeculativeConfig(draft="self", num_speculative_tokens=1), target, cache)
    num_calls = 0

    def clock() -> float:  # every timed pass takes 0.2 s: a round of three passes 0.6 s
        nonlocal num_calls
        num_calls += 1
        return 0.2 * (num_calls // 2)

    monkeypatch.setattr(draft_length.time, "perf_counter", clock)
    measure_step_costs(target.model, proposer, 1, context_len=8, repeats=7, min_repeats=2, time_budget_s=1.5)
    assert num_calls == 3 * 3 * 2  # 1.2 s after two rounds, 1.8 s after the third: stop
    num_calls = 0
    measure_step_costs(target.model, proposer, 1, context_len=8, repeats=7, min_repeats=4, time_budget_s=0.0)
    assert num_calls == 4 * 3 * 2  # never fewer than min_repeats rounds
    num_calls = 0
    measure_step_costs(target.model, proposer, 1, context_len=8, repeats=5, time_budget_s=100.0)
    assert num_calls == 5 * 3 * 2  # nor more than repeats
    with pytest.raises(ValueError, match="min_repeats"):
        measure_step_costs(target.model, proposer, 1, min_repeats=0)


def test_step_costs_are_measured_once_per_range_of_prompt_lengths(target, monkeypatch):
    cache = KVCache.from_config(target.config, 256, dtype=target.model.dtype)
    proposer = build_proposer(SpeculativeConfig(draft="self", num_speculative_tokens=3), target, cache)
    contexts = []

    def measure(target_model, proposer, k_max, context_len, repeats=5):
        contexts.append((k_max, context_len))
        return measure_step_costs(target_model, proposer, k_max, context_len, repeats=1)

    monkeypatch.setattr(draft_length, "measure_step_costs", measure)
    short = step_costs_for(target.model, proposer, 3, 20)
    assert step_costs_for(target.model, proposer, 3, 30) is short  # same power-of-two range
    step_costs_for(target.model, proposer, 3, 200)  # a longer context: measured again, at its length
    step_costs_for(target.model, proposer, 2, 20)  # another k_max
    assert contexts == [(3, 20), (3, 200), (2, 20)]


def test_config_validation():
    with pytest.raises(ValueError):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError):
        SpeculativeConfig(num_speculative_tokens=9)
    with pytest.raises(ValueError):
        SpeculativeConfig(draft_low_bit="int3")
    with pytest.raises(ValueError, match="draft_lm_head_bits"):
        SpeculativeConfig(draft_lm_head_bits=2)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        SpeculativeConfig(draft_vocab_size=0)
    with pytest.raises(ValueError, match="draft_device 'tpu0' is not a device name"):
        SpeculativeConfig(draft_device="tpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="draft_device 'cuda' requested but CUDA is not available"):
            SpeculativeConfig(draft_device="cuda")


def test_seeded_sampling_does_not_follow_timings(target, tiny_models, monkeypatch):
    """Two processes measure different step costs. If those costs chose the draft lengths, a
    seed's random draws (and so its tokens) would differ between them: a seeded sampled request
    weighs costs modeled from bytes instead. Unseeded requests keep the measured ones."""
    import fastdraft.spec.decoding as decoding

    draft = load_model(tiny_models.dir("llama"), dtype="fp32")  # a poor draft: plans matter
    prompt_ids = target.tokenizer.encode(PROMPTS[0])
    measured = iter([StepCosts(draft=0.01, verify=[1.0] * 5),  # "process" 1: drafting is free
                     StepCosts(draft=0.9, verify=[1.0, 1.9, 2.8, 3.7, 4.6])])  # 2: it never pays
    monkeypatch.setattr(decoding, "step_costs_for", lambda *args: next(measured))

    def run(params):
        config = SpeculativeConfig(draft="model", num_speculative_tokens=4)
        return _spec(target, lambda c: build_proposer(config, target, c, draft), prompt_ids, params, adaptive=True)

    seeded = SamplingParams(max_new_tokens=24, temperature=0.9, seed=5, ignore_eos=True)
    first, first_metrics, _ = run(seeded)
    second, _, _ = run(seeded)
    assert first == second and first_metrics.num_draft_tokens > 0
    unseeded = replace(seeded, seed=None)
    _, eager, _ = run(unseeded)  # measured costs: free drafts, always k = 4
    _, never, _ = run(unseeded)  # drafts that never pay: plain steps with a k = 1 probe now and then
    assert eager.num_draft_tokens > 2 * never.num_draft_tokens


def test_modeled_step_costs_are_byte_ratios(target):
    cache = KVCache.from_config(target.config, 256, dtype=target.model.dtype)
    proposer = build_proposer(SpeculativeConfig(draft="self", num_speculative_tokens=3), target, cache)
    costs = draft_length.modeled_step_costs(target.model, proposer, 3, context_len=100)
    # The self-draft is the INT4 copy of an fp32 model: about an eighth of its weight bytes.
    assert 0.05 < costs.draft < 0.5
    assert costs.verify[0] == 1.0 and costs.verify == sorted(costs.verify) and len(costs.verify) == 4
    ngram = build_proposer(SpeculativeConfig(draft="ngram", num_speculative_tokens=3), target, cache)
    assert draft_length.modeled_step_costs(target.model, ngram, 3, context_len=100).draft < 0.05
