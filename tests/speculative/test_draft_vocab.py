"""A draft head restricted to frequent tokens: what it keeps, and that decoding stays exact."""

import pytest
import torch

from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.engine.loader import load_model
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.sequence import Sequence
from fastdraft.engine.speculation import Speculator
from fastdraft.layers.kv_cache import PagedKVCache
from fastdraft.layers.sampler import logits_to_probs
from fastdraft.sampling_params import SamplingParams
from fastdraft.speculative import draft_vocab
from fastdraft.speculative.speculative_config import SpeculativeConfig
from fastdraft.speculative.draft_length import DraftLengthPolicy, PassCost
from fastdraft.speculative.draft_vocab import frequent_token_ids, ranked_token_ids, restrict_lm_head
from fastdraft.speculative.factory import speculator_factory
from fastdraft.speculative.proposer import DraftModelProposer
from tests.speculative.test_engine_spec import PROMPTS, next_token_logits


def _draft_runner(draft) -> ModelRunner:
    """A runner of ``draft`` over its own paged cache, as a separate draft has."""
    cache = PagedKVCache.from_config(draft.config, 64, 16, draft.model.dtype, draft.model.device)
    return ModelRunner(draft.model, cache, BlockManager(64, 16, enable_prefix_caching=False), batch_invariant=False)


class _DraftOnly:
    """A speculator factory drafting ``k`` tokens with ``proposer`` for every sequence, every step."""

    def __init__(self, proposer: DraftModelProposer, k: int) -> None:
        self.proposer, self.k = proposer, k

    def __call__(self, target, runner, max_num_seqs):
        free = PassCost([(1, 0.0)])
        return Speculator(self.proposer, DraftLengthPolicy(self.k, free, free, is_adaptive=False))

CORPUS = ["def add(a, b):\n    return a + b\n" * 20, "The quick brown fox jumps over the lazy dog. " * 5]


@pytest.fixture()
def small_corpus(monkeypatch):
    monkeypatch.setattr(draft_vocab, "corpus_texts", lambda: list(CORPUS))


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_model(tiny_models.dir("qwen2"), dtype="fp32")


def test_kept_ids_are_the_special_then_most_frequent_tokens(target, small_corpus, tmp_path):
    tokenizer = target.tokenizer
    vocab_size = target.config.vocab_size
    counts = draft_vocab.token_counts(tokenizer, CORPUS)
    ranked = ranked_token_ids(tokenizer)
    assert ranked[0] == max(counts, key=lambda i: (counts[i], -i)) and sorted(ranked) == sorted(counts)
    special = tokenizer.special_token_ids()
    kept = frequent_token_ids(tokenizer, len(special) + 5, vocab_size)
    assert kept.tolist() == sorted(set(special) | set(ranked[:5]))
    # A size beyond the corpus keeps every token it uses, and no more.
    assert frequent_token_ids(tokenizer, vocab_size, vocab_size).tolist() == sorted(set(special) | set(counts))
    with pytest.raises(ValueError, match="max_tokens"):
        frequent_token_ids(tokenizer, 0, vocab_size)


def test_ranking_is_cached_per_tokenizer(target, small_corpus, tmp_path, monkeypatch):
    first = ranked_token_ids(target.tokenizer, tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(draft_vocab, "corpus_texts", lambda: pytest.fail("the cache was not used"))
    assert ranked_token_ids(target.tokenizer, tmp_path) == first


def test_restricted_head_gives_the_kept_rows_of_the_full_logits(tiny_models):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    model = loaded.model
    token_ids = torch.tensor([0, 3, 17, 40, loaded.config.vocab_size - 1])
    hidden = torch.randn(3, loaded.config.hidden_size)
    full = model.compute_logits(hidden)  # [3, vocab_size]
    embedding = model.model.embed_tokens.weight.detach().clone()
    restrict_lm_head(model, token_ids)
    # Equal up to the GEMM's blocking, which depends on the number of rows it computes.
    torch.testing.assert_close(model.compute_logits(hidden), full[:, token_ids], rtol=1e-5, atol=1e-5)
    assert torch.equal(model.model.embed_tokens.weight, embedding)  # a tied embedding stays whole


def test_greedy_with_a_restricted_draft_equals_plain_greedy(target, tiny_models, monkeypatch):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompts = [target.tokenizer.encode(text) for text in PROMPTS]
    expected = [o.outputs[0].token_ids for o in run_to_completion(LLMEngine(target, EngineConfig(num_blocks=64)), prompts,
                                                        [params] * len(prompts))]
    # The ranking puts the first continuation's tokens first, so the draft can propose those
    # and few others the tiny random model likes.
    first = list(dict.fromkeys(expected[0]))
    monkeypatch.setattr(draft_vocab, "ranked_token_ids", lambda tokenizer, cache_dir=None: first + list(range(300)))
    config = SpeculativeConfig(draft=str(tiny_models.dir("qwen2")), draft_vocab_size=40, draft_low_bit=None,
                               is_adaptive=False, min_confidence=0.0)
    engine = LLMEngine(target, EngineConfig(num_blocks=64), speculation=speculator_factory(config))
    proposer = engine.speculator.proposer
    assert proposer.token_ids is not None and len(proposer.token_ids) <= 40
    assert proposer.model.lm_head.out_features == len(proposer.token_ids)
    outputs = run_to_completion(engine, prompts, [params] * len(prompts))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert outputs[0].metrics.spec.acceptance_rate > 0.5  # the same model, on tokens its head kept


def test_restricted_draft_proposes_kept_tokens_with_zero_mass_elsewhere(target, tiny_models):
    draft = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    token_ids = torch.arange(0, target.config.vocab_size, 3)
    prompt_ids = target.tokenizer.encode(PROMPTS[0])
    full_logits = next_token_logits(draft, prompt_ids)  # [vocab_size], before the head is restricted
    restrict_lm_head(draft.model, token_ids)
    proposer = DraftModelProposer(_draft_runner(draft), target.config.vocab_size, token_ids=token_ids)
    generator = torch.Generator().manual_seed(0)
    seq = Sequence(prompt_ids, SamplingParams(temperature=1.0))
    batch = proposer.propose([seq], [4], [generator])
    assert len(batch.draft_token_ids[0]) == 4 and set(batch.draft_token_ids[0]) <= set(token_ids.tolist())
    probs = batch.draft_probs  # [4, draft_vocab], over the kept tokens only
    assert torch.equal(batch.draft_vocab_ids, token_ids)
    assert probs.shape == (4, len(token_ids)) and torch.allclose(probs.sum(-1), torch.ones(4))
    # The first step's distribution is the full head's, renormalised over the kept tokens.
    torch.testing.assert_close(probs[0], torch.softmax(full_logits[token_ids], -1), rtol=1e-4, atol=1e-6)
    proposer.release(seq)
    assert proposer.runner.block_manager.num_free_blocks == 64


def test_sampling_with_a_restricted_draft_follows_the_target_distribution(target, tiny_models):
    # The draft cannot propose some of the target's likely tokens: they must still come out at
    # the target's rates, as recovered tokens. The first new token comes from the prompt's
    # pass; the second from verifying the draft's token.
    params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    prompt_ids = target.tokenizer.encode(PROMPTS[0])

    def next_probs(ids: list[int]) -> torch.Tensor:
        return logits_to_probs(next_token_logits(target, ids), params)  # [vocab_size]

    first = next_probs(prompt_ids)
    exact = {(a, b): float(first[a] * p_b) for a in first.nonzero().flatten().tolist()
             for b, p_b in enumerate(next_probs(prompt_ids + [a]).tolist()) if p_b > 0}
    second_likely = sorted({b for _, b in exact}, key=lambda b: -sum(p for (_, x), p in exact.items() if x == b))[:2]
    kept = torch.tensor([i for i in range(target.config.vocab_size) if i not in second_likely])
    draft = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    restrict_lm_head(draft.model, kept)
    proposer = DraftModelProposer(_draft_runner(draft), target.config.vocab_size, token_ids=kept)
    engine = LLMEngine(target, EngineConfig(num_blocks=128), speculation=_DraftOnly(proposer, 1))
    torch.manual_seed(0)
    num_samples = 1920
    counts: dict[tuple[int, int], int] = {}
    num_draft = 0
    for _ in range(num_samples // 64):
        for out in run_to_completion(engine, [prompt_ids] * 64, [params] * 64):
            key = tuple(out.outputs[0].token_ids[:2])
            counts[key] = counts.get(key, 0) + 1
            num_draft += out.metrics.spec.num_draft_tokens
    assert num_draft > 0
    assert sum(n for (_, b), n in counts.items() if b in second_likely) > 0  # recovered: the draft cannot propose them
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(key, 0) / num_samples - p) for key, p in exact.items())
    assert tv < 0.06, f"total variation {tv:.3f} from the target's distribution"
