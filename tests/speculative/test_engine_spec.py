"""Speculative decoding inside the batched engine, on tiny models: greedy identity for every
proposer under batching, the target's distribution when sampling, blocks returned, the
draft-length policy, errors."""

import json
import random
import shutil

import pytest
import torch

from fastdraft.generator import TextGenerator
from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.engine import model_runner
from fastdraft.engine.loader import load_model
from fastdraft.engine.sequence import Sequence
from fastdraft.engine.speculation import DraftBatch, Speculator
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.layers.rejection_sampler import rejection_sample_keyed
from fastdraft.layers.sampler import logits_to_probs, sample_from_probs
from fastdraft.sampling_params import SamplingParams
from fastdraft.speculative.speculative_config import SpeculativeConfig
from fastdraft.speculative.factory import build_proposer, check_vocab_compatible, speculator_factory
from fastdraft.speculative.draft_length import FREE, DraftLengthPolicy, PassCost
from fastdraft.speculative.proposer import NgramIndex, NgramProposer, _match_vocab
from tests.helpers import append_pass

PROMPTS = ["def add(a, b):\n", "The quick brown fox", "for i in range(10):\n    print(i)\n" * 2,
           "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2"]


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_model(tiny_models.dir("qwen2"), dtype="fp32")


def next_token_logits(loaded, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [vocab_size] after ``token_ids``: the module path over a cache of their own,
    a reference independent of the engine under test."""
    model = loaded.model
    cache = SequenceCache.from_config(loaded.config, len(token_ids), dtype=model.dtype, device=model.device)
    with torch.inference_mode():
        return append_pass(model, cache, token_ids, logit_rows=[len(token_ids) - 1])[0]


def _engine(target, speculation=None, draft=None, **config):
    """An engine over ``target``; ``speculation``: a :class:`SpeculativeConfig` (with ``draft``,
    an already loaded draft model) or a speculator factory."""
    if isinstance(speculation, SpeculativeConfig):
        speculation = speculator_factory(speculation, draft)
    else:
        assert draft is None, "a loaded draft goes with a SpeculativeConfig"
    return LLMEngine(target, EngineConfig(**{"num_blocks": 96, **config}), speculation=speculation)


def _run(engine, prompts, params):
    return run_to_completion(engine, prompts, [params] * len(prompts) if isinstance(params, SamplingParams)
                             else params)


@pytest.mark.parametrize("draft_kind", ["self", "same_model", "random_model", "ngram"])
@pytest.mark.parametrize("is_adaptive", [False, True])
def test_greedy_output_under_batching_equals_plain_greedy(target, tiny_models, draft_kind, is_adaptive):
    draft = None
    if draft_kind in ("same_model", "random_model"):
        draft = load_model(tiny_models.dir("qwen2" if draft_kind == "same_model" else "llama"), dtype="fp32")
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    config = SpeculativeConfig(draft=draft_kind if draft_kind in ("self", "ngram") else "model",
                               num_speculative_tokens=4, is_adaptive=is_adaptive, min_confidence=0.0)
    prompts = PROMPTS * 3  # twelve requests in one batch, at different lengths
    plain = _run(_engine(target), prompts, params)
    engine = _engine(target, config, draft)
    spec = _run(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain], \
        f"{draft_kind}: output diverged"
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    if not is_adaptive and draft_kind != "ngram":
        assert all(o.metrics.spec.num_draft_tokens > 0 for o in spec)
    if draft_kind == "same_model" and not is_adaptive:
        assert all(o.metrics.spec.acceptance_rate == 1.0 for o in spec)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if draft_kind in ("same_model", "random_model"):
        draft_blocks = engine.speculator.proposer.runner.block_manager
        assert draft_blocks.num_free_blocks == draft_blocks.num_blocks


def test_greedy_identity_holds_with_sampled_and_plain_requests_beside(target):
    """Requests that may not speculate (penalties, a seed) share steps with drafting ones."""
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True)
    others = [SamplingParams(max_new_tokens=30, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_new_tokens=30, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_new_tokens=30, temperature=0.9, ignore_eos=True)]
    config = SpeculativeConfig(draft="self", is_adaptive=False, min_confidence=0.0)
    params = [greedy, *others, greedy]
    prompts = PROMPTS + PROMPTS[:1]
    plain = _run(_engine(target), prompts, params)
    spec = _run(_engine(target, config), prompts, params)
    for i in (0, 1, 2, 4):  # greedy, seeded, penalised: the same tokens
        assert spec[i].outputs[0].token_ids == plain[i].outputs[0].token_ids
    assert spec[1].metrics.spec is None  # a seeded sampled request decodes plainly
    assert spec[3].metrics.spec.num_draft_tokens > 0  # an unseeded one speculates
    assert len(spec[3].outputs[0].token_ids) == 30


def test_stops_at_eos_max_new_tokens_and_stop_strings_as_plain_decoding(target):
    config = SpeculativeConfig(draft="self", is_adaptive=False, min_confidence=0.0)
    for params in (SamplingParams(max_new_tokens=7, ignore_eos=True), SamplingParams(max_new_tokens=60)):
        plain = _run(_engine(target), PROMPTS, params)
        spec = _run(_engine(target, config), PROMPTS, params)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
        assert [o.outputs[0].finish_reason for o in spec] == [o.outputs[0].finish_reason for o in plain]
    prompt = "x = 1"
    text = _run(_engine(target), [prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0].outputs[0].text
    assert len(text) >= 4
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[text[len(text) // 2]])
    plain = _run(_engine(target), [prompt], params)[0].outputs[0]
    spec = _run(_engine(target, config), [prompt], params)[0].outputs[0]
    assert (spec.text, spec.token_ids, spec.finish_reason) == (plain.text, plain.token_ids, plain.finish_reason)
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 30


def test_prefix_cache_holds_only_verified_keys_and_values(target):
    """A self-draft writes its guesses into the target's blocks. Were those blocks hashed
    before verification overwrote them, a later request sharing the prefix would read the
    draft's keys and values: its logits, and here its tokens, would differ."""
    config = SpeculativeConfig(draft="self", is_adaptive=False, min_confidence=0.0)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    engine = _engine(target, config, block_size=4)
    first = _run(engine, [PROMPTS[2]], params)[0]
    # Every block of it was written by the draft first.
    follow_up = first.prompt_token_ids + first.outputs[0].token_ids
    hits_before = engine.block_manager.num_prefix_hits
    got = _run(engine, [follow_up], params)[0]
    assert engine.block_manager.num_prefix_hits - hits_before >= len(follow_up) - 8
    assert got.outputs[0].token_ids == _run(_engine(target, block_size=4, enable_prefix_caching=False), [follow_up],
                                            params)[0].outputs[0].token_ids


def test_blocks_return_to_zero_after_aborted_and_preempted_speculative_requests(target, tiny_models):
    draft = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    for kind, loaded_draft in (("self", None), ("model", draft), ("ngram", None)):
        config = SpeculativeConfig(draft=kind, is_adaptive=False, min_confidence=0.0)
        # A pool so small that drafts compete for blocks and running requests get preempted.
        engine = _engine(target, config, loaded_draft, num_blocks=24, block_size=4, max_num_seqs=8)
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in PROMPTS * 2]
        for _ in range(6):
            engine.step()
        engine.abort_request(ids[0])
        engine.abort_request(ids[5])
        while engine.has_unfinished_requests:
            engine.step()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, kind
        if loaded_draft is not None:
            draft_blocks = engine.speculator.proposer.runner.block_manager
            assert draft_blocks.num_free_blocks == draft_blocks.num_blocks
            assert not engine.speculator.proposer._shadows


class _UniformOverSupport:
    """A speculator factory whose speculator's proposer and policy are itself. Its drafts are
    uniform over the target's sampling support: they overlap the target's distribution without
    matching it, so accepted, recovered and bonus tokens all occur, and a wrong residual
    distribution would show (about 0.1 away in total variation). Drafts stop at random after
    the first token, as a draft stopping when unconfident does."""

    k_max = 2

    def __init__(self, next_probs) -> None:
        self.next_probs = next_probs

    def __call__(self, target, runner, max_num_seqs):
        return Speculator(self, self)

    def pending_tokens(self, seq):
        return 0

    def draft_lengths(self, seqs, num_step_tokens):
        return [self.k_max] * len(seqs)

    def propose(self, seqs, num_tokens, generators):
        draft_ids, draft_probs = [], []
        for seq, k, generator in zip(seqs, num_tokens, generators):
            ids = []
            for i in range(k):
                if i > 0 and torch.rand(1, generator=generator).item() < 0.5:
                    break
                support = self.next_probs(seq.token_ids + ids) > 0
                probs = support.float() / support.sum()  # [vocab_size]
                ids.append(int(sample_from_probs(probs, generator)))
                draft_probs.append(probs)
            draft_ids.append(ids)
        return DraftBatch(draft_ids, torch.stack(draft_probs) if draft_probs else None)

    def update(self, seq, num_draft, num_accepted):
        pass

    def release(self, seq):
        pass


@pytest.mark.parametrize("is_keyed", [False, True], ids=["generators", "keyed"])
def test_batched_speculative_sampling_follows_the_target_distribution(target, is_keyed, monkeypatch):
    """Through the engine's batched steps (drafting, flat verification, recovered and bonus
    tokens, rollback) the joint distribution of the first three new tokens is the target's:
    with a generator per request (the CPU's way) and with keyed streams (the GPU's)."""
    params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=2, ignore_eos=True)
    prompt_ids = target.tokenizer.encode(PROMPTS[0])
    memo = {}

    def next_probs(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in memo:
            memo[key] = logits_to_probs(next_token_logits(target, ids), params)  # [vocab_size]
        return memo[key]

    exact = {}
    for a, p_a in enumerate(next_probs(prompt_ids).tolist()):
        for b, p_b in enumerate(next_probs(prompt_ids + [a]).tolist() if p_a > 0 else []):
            for c, p_c in enumerate(next_probs(prompt_ids + [a, b]).tolist() if p_b > 0 else []):
                if p_c > 0:
                    exact[(a, b, c)] = p_a * p_b * p_c
    torch.manual_seed(0)
    engine = _engine(target, _UniformOverSupport(next_probs), num_blocks=256, max_num_seqs=64)
    engine.runner.keyed_sampling = is_keyed
    keyed_calls = []
    monkeypatch.setattr(model_runner, "rejection_sample_keyed",
                        lambda *args: keyed_calls.append(1) or rejection_sample_keyed(*args))
    num_samples, counts = 2400, {}
    num_draft = num_accepted = 0
    for _ in range(num_samples // 64 + 1):
        for out in _run(engine, [prompt_ids] * 64, params):
            key = tuple(out.outputs[0].token_ids)
            counts[key] = counts.get(key, 0) + 1
            num_draft += out.metrics.spec.num_draft_tokens
            num_accepted += out.metrics.spec.num_accepted_tokens
    total = sum(counts.values())
    assert 0.2 < num_accepted / num_draft < 0.95  # both accepted and recovered tokens
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(key, 0) / total - p) for key, p in exact.items())
    assert tv < 0.06, f"total variation {tv:.3f} from the target's distribution"
    assert bool(keyed_calls) == is_keyed  # the keyed verification ran exactly where asked


def test_text_generator_speculates_through_the_engine(target):
    generator = TextGenerator(target, max_seq_len=200, speculative=SpeculativeConfig(draft="self"))
    plain = TextGenerator(target, max_seq_len=200)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    out = generator.generate(PROMPTS[2], params)
    assert out.token_ids == plain.generate(PROMPTS[2], params).token_ids
    assert out.metrics.spec is not None and sum(out.metrics.spec.steps_per_draft_length) > 0
    seeded = SamplingParams(max_new_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    assert generator.generate(PROMPTS[0], seeded).token_ids == plain.generate(PROMPTS[0], seeded).token_ids


def _seqs(n: int) -> list[Sequence]:
    return [Sequence([1, 2, 3]) for _ in range(n)]


def test_pass_cost_interpolates_and_extends_at_the_last_slope():
    cost = PassCost([(1, 1.0), (4, 1.0), (16, 4.0), (8, 0.5)])  # a noisy point never makes work cheaper
    assert cost(0) == 0.0 and cost(1) == 1.0 and cost(2) == 1.0 and cost(8) == 1.0
    assert cost(12) == pytest.approx(2.5) and cost(32) == pytest.approx(10.0)


def test_policy_drafts_at_low_load_and_less_as_the_batch_turns_compute_bound():
    # A target pass costs the same up to 8 tokens (reading weights), then 1 per token; a draft
    # round costs 0.1 whatever its size.
    target_cost = PassCost([(1, 8.0), (8, 8.0), (64, 64.0)])
    policy = DraftLengthPolicy(4, target_cost, PassCost([(1, 0.1), (64, 0.1)]), prior=0.8)
    assert policy.draft_lengths(_seqs(1), 1) == [4]
    totals = [sum(policy.draft_lengths(_seqs(n), n)) / n for n in (1, 2, 4, 8, 16, 32)]
    assert totals == sorted(totals, reverse=True) and totals[-1] == 0
    assert 0 < totals[2] < 4  # no cliff: a middle batch drafts some


def test_policy_weighs_each_sequences_acceptance_and_the_draft_cost():
    target_cost = PassCost([(1, 8.0), (64, 71.0)])  # every token beyond the first costs 1
    policy = DraftLengthPolicy(4, target_cost, PassCost([(1, 0.5), (64, 0.5)]))
    good, poor = _seqs(2)
    for _ in range(30):
        policy.update(good, 4, 4)
        policy.update(poor, 4, 0)
    assert policy.acceptance(good) > 0.9 and policy.acceptance(poor) < 0.2
    k_good, k_poor = policy.draft_lengths([good, poor], 2)
    assert k_good == 4 and k_poor == 0
    costly = DraftLengthPolicy(4, target_cost, PassCost([(1, 9.0), (64, 9.0)]))
    assert costly.draft_lengths(_seqs(1), 1) == [0]  # a draft round as dear as a target pass
    fixed = DraftLengthPolicy(3, target_cost, PassCost([(1, 9.0)]), is_adaptive=False)
    assert fixed.draft_lengths(_seqs(2), 2) == [3, 3]
    with pytest.raises(ValueError):
        DraftLengthPolicy(0, target_cost, target_cost)


def test_policy_charges_a_drafts_catch_up_and_asks_a_margin():
    target_cost = PassCost([(1, 8.0), (8, 8.0), (64, 64.0)])
    draft_cost = PassCost([(1, 0.5), (64, 32.0)])
    caught_up, behind = _seqs(2)
    behind.params = SamplingParams(max_new_tokens=4)  # a long prompt to catch up on, few steps to pay it back
    pending = {caught_up.seq_id: 1, behind.seq_id: 200}
    policy = DraftLengthPolicy(4, target_cost, draft_cost, pending_tokens=lambda seq: pending[seq.seq_id])
    assert policy.draft_lengths([caught_up, behind], 2) == [4, 0]
    behind.params = SamplingParams(max_new_tokens=4096)  # spread over many steps it pays
    k_caught_up, k_behind = policy.draft_lengths([caught_up, behind], 2)
    assert k_caught_up == 4 and k_behind > 0
    # A gain just under the margin: drafting one token of acceptance 0.04 for free.
    cheap = DraftLengthPolicy(1, PassCost([(1, 1.0), (64, 1.0)]), FREE, prior=0.04)
    assert cheap.draft_lengths(_seqs(1), 1) == [0]
    assert DraftLengthPolicy(1, PassCost([(1, 1.0), (64, 1.0)]), FREE, prior=0.04,
                             margin=0.0).draft_lengths(_seqs(1), 1) == [1]


def test_policy_rate_recovers_toward_the_prior_through_plain_steps():
    policy = DraftLengthPolicy(4, PassCost([(1, 1.0)]), PassCost([(1, 0.1)]), prior=0.7)
    seq = _seqs(1)[0]
    policy.update(seq, 4, 0)
    low = policy.acceptance(seq)
    for _ in range(10):
        policy.update(seq, 0, 0)
    assert low < policy.acceptance(seq) < 0.7
    policy.release(seq)
    assert policy.acceptance(seq) == 0.7


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


def test_ngram_proposer_copies_the_continuation_per_sequence():
    proposer = NgramProposer()
    a, b = Sequence([1, 2, 3, 4, 5, 9, 1, 2, 3]), Sequence([7, 8])
    batch = proposer.propose([a, b], [3, 3], [torch.Generator(), torch.Generator()])
    assert batch.draft_token_ids == [[4, 5, 9], []] and batch.draft_probs is None
    sampled = Sequence([1, 2, 3, 4, 1, 2], SamplingParams(temperature=0.7))
    batch = proposer.propose([sampled], [2], [torch.Generator()])
    assert batch.draft_token_ids == [[3, 4]]
    # Point masses over the step's distinct draft tokens.
    assert batch.draft_vocab_ids.tolist() == [3, 4] and batch.draft_probs.tolist() == [[1.0, 0.0], [0.0, 1.0]]


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
    for _ in range(3):  # requests: a prompt that does not continue the indexed tokens rebuilds the index
        index = NgramIndex(max_ngram=max_ngram, min_ngram=min_ngram)
        tokens = [rng.randrange(8) for _ in range(rng.randrange(1, 12))]
        for _ in range(60):  # committed tokens grow by 1 to 5 a step, as in speculative decoding
            num_tokens = rng.randrange(1, 6)
            assert index.lookup(tokens, num_tokens) == _scan_ngram(tokens, num_tokens, max_ngram, min_ngram)
            tokens = tokens + [rng.randrange(8) for _ in range(rng.randrange(1, 6))]
            if rng.random() < 0.05:
                tokens = tokens[:len(tokens) // 2]


@pytest.mark.parametrize("head_bits", [4, 8, 16])
def test_separate_draft_head_is_quantized_as_configured(target, tiny_models, head_bits):
    config = SpeculativeConfig(draft=str(tiny_models.dir("llama")), draft_lm_head_bits=head_bits)
    engine = _engine(target)
    proposer = build_proposer(config, target, engine.runner)
    assert getattr(proposer.model.lm_head, "bits", 16) == head_bits
    assert proposer.model.model.layers[0].mlp.down_proj.bits == 4


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




def test_policy_weighs_drafting_against_the_plain_steps_own_curve():
    """Where plain decode steps replay a graph and verifications run eagerly, drafting must beat
    the cheaper plain step: the same acceptance that pays against the eager pass does not pay
    against a plain step five times cheaper."""
    target_cost = PassCost([(1, 10.0), (8, 10.0), (64, 64.0)])  # eager: verification's cost
    draft_cost = PassCost([(1, 1.0), (64, 1.0)])
    eager_only = DraftLengthPolicy(4, target_cost, draft_cost, prior=0.5)
    assert eager_only.draft_lengths(_seqs(1), 1) != [0]
    with_graphs = DraftLengthPolicy(4, target_cost, draft_cost, prior=0.5, plain_cost=PassCost([(1, 2.0), (64, 2.0)]))
    assert with_graphs.draft_lengths(_seqs(1), 1) == [0]
    # A step that also carries another sequence's prefill runs eagerly: the eager curve applies.
    assert with_graphs.draft_lengths(_seqs(1), 40) == eager_only.draft_lengths(_seqs(1), 40)


def test_pass_costs_are_timed_once_per_shape_and_kept(target, tiny_models, isolated_home, monkeypatch):
    from fastdraft.speculative import factory

    config = SpeculativeConfig(draft="self", num_speculative_tokens=4, min_confidence=0.0)
    first = _engine(target, config).speculator.policy
    assert list((isolated_home / "pass_costs").glob("*.json"))  # the target's and the draft's

    def refuse(*args, **kwargs):
        raise AssertionError("timed again")

    monkeypatch.setattr(factory, "measure_pass_cost", refuse)
    again = _engine(target, config).speculator.policy
    assert (again.target_cost.sizes, again.target_cost.seconds) == (first.target_cost.sizes, first.target_cost.seconds)
    # Another shape (the tiny llama's, not qwen2's) is timed for itself.
    with pytest.raises(AssertionError, match="timed again"):
        _engine(load_model(tiny_models.dir("llama"), dtype="fp32"), config)
