"""A draft head restricted to frequent tokens: what it keeps, and that decoding stays exact."""

from dataclasses import replace

import pytest
import torch

from fastdraft.engine.loader import load_model
from fastdraft.layers.kv_cache import KVCache
from fastdraft.layers.sampler import logits_to_probs
from fastdraft.sampling_params import SamplingParams
from fastdraft.spec import draft_vocab
from fastdraft.spec.config import SpeculativeConfig, build_proposer
from fastdraft.spec.decoding import SpecMetrics, speculative_generate
from fastdraft.spec.draft_vocab import frequent_token_ids, ranked_token_ids, restrict_lm_head
from fastdraft.spec.proposer import DraftModelProposer
from tests.spec.test_decoding import PROMPTS, _plain, _spec

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
    expected = [_plain(target, ids, params) for ids in prompts]
    # The ranking puts the first continuation's tokens first, so the draft can propose those
    # and few others the tiny random model likes.
    first = list(dict.fromkeys(expected[0]))
    monkeypatch.setattr(draft_vocab, "ranked_token_ids", lambda tokenizer, cache_dir=None: first + list(range(300)))
    config = SpeculativeConfig(draft=str(tiny_models.dir("qwen2")), draft_vocab_size=40, draft_low_bit=None,
                               is_adaptive=False)
    proposer = build_proposer(config, target, KVCache.from_config(target.config, 256 + 5, dtype=torch.float32))
    assert proposer.token_ids is not None and len(proposer.token_ids) <= 40
    assert proposer.model.lm_head.out_features == len(proposer.token_ids)
    for prompt_ids, plain in zip(prompts, expected):
        got, metrics, _ = _spec(target, lambda c: proposer, prompt_ids, params)
        assert got == plain
        if plain is expected[0]:
            assert metrics.acceptance_rate > 0.5  # the same model, on tokens its head kept


def test_restricted_draft_proposes_kept_tokens_with_zero_mass_elsewhere(target, tiny_models):
    draft = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    token_ids = torch.arange(0, target.config.vocab_size, 3)
    prompt_ids = target.tokenizer.encode(PROMPTS[0])
    cache = KVCache.from_config(draft.config, 64, dtype=torch.float32)
    with torch.inference_mode():
        full_logits = draft.model.compute_logits(draft.model(torch.tensor([prompt_ids]), cache,
                                                             cache.append(len(prompt_ids)))[0, -1])  # [vocab_size]
    restrict_lm_head(draft.model, token_ids)
    proposer = DraftModelProposer(draft.model, KVCache.from_config(draft.config, 64, dtype=torch.float32),
                                  token_ids=token_ids)
    proposer.start(prompt_ids[:-1])  # the last committed token is fed with the first draft step
    generator = torch.Generator().manual_seed(0)
    proposal = proposer.propose(prompt_ids, 4, SamplingParams(temperature=1.0), generator)
    assert set(proposal.draft_token_ids.tolist()) <= set(token_ids.tolist())
    probs = proposal.draft_probs  # [4, draft_vocab], over the kept tokens only
    assert torch.equal(proposal.draft_vocab_ids, token_ids)
    assert probs.shape == (4, len(token_ids)) and torch.allclose(probs.sum(-1), torch.ones(4))
    # The first step's distribution is the full head's, renormalised over the kept tokens.
    torch.testing.assert_close(probs[0], torch.softmax(full_logits[token_ids], -1), rtol=1e-4, atol=1e-6)


def test_sampling_with_a_restricted_draft_follows_the_target_distribution(target, tiny_models):
    # The draft cannot propose some of the target's likely tokens: they must still come out at
    # the target's rates, as recovered tokens.
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=4, ignore_eos=True)
    prompt_ids = target.tokenizer.encode(PROMPTS[0])
    cache = KVCache.from_config(target.config, 64, dtype=torch.float32)
    with torch.inference_mode():
        logits = target.model.compute_logits(target.model(torch.tensor([prompt_ids]), cache,
                                                          cache.append(len(prompt_ids)))[0, -1])
    exact = logits_to_probs(logits, params)  # [vocab_size]
    support = exact.nonzero().flatten()
    kept = torch.tensor([i for i in range(target.config.vocab_size) if i not in support[:2].tolist()])
    draft = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    restrict_lm_head(draft.model, kept)
    proposer = DraftModelProposer(draft.model, KVCache.from_config(draft.config, 64, dtype=torch.float32),
                                  token_ids=kept)
    num_samples = 1200
    counts = torch.zeros(target.config.vocab_size)
    metrics = SpecMetrics()
    for seed in range(num_samples):
        cache.reset()
        out = list(speculative_generate(target.model, proposer, prompt_ids, replace(params, seed=seed), cache, [],
                                        1, False, metrics))
        counts[out[0]] += 1
    tv = 0.5 * float((counts / num_samples - exact).abs().sum())
    assert counts[support[:2]].sum() > 0  # tokens the draft cannot propose were recovered
    assert tv < 0.05, f"total variation {tv:.3f} from the target's distribution"
