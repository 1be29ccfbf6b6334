"""Proposers: cheap ways to guess the next ``k`` tokens.

* :class:`DraftModelProposer` runs a small model of the same tokenizer (a separate draft, or
  the target's own INT4 copy for self-speculation). With ``shares_target_cache`` the draft
  writes its speculative keys/values straight into the target's KV cache: the accepted
  prefix there is always the target's own, exact KV, which needs no extra memory, no draft
  prefill, and raises acceptance; verification overwrites every draft entry it scores.
* :class:`NgramProposer` (prompt lookup) copies what followed the last occurrence of the
  current n-gram in the context: free to run, and strong on code and edits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdraft.layers.kv_cache import KVCache
from fastdraft.layers.sampler import greedy_ids, logits_to_probs, sample_from_probs
from fastdraft.models.llama import LlamaForCausalLM
from fastdraft.sampling_params import SamplingParams


@dataclass
class Proposal:
    draft_token_ids: torch.Tensor  # [num_draft]
    draft_probs: torch.Tensor | None  # [num_draft, draft_vocab]; None for greedy decoding
    # The vocabulary ids of draft_probs' columns (sorted) when the draft's head covers only part
    # of the vocabulary, every other token having draft probability 0; None: column i is token i.
    draft_vocab_ids: torch.Tensor | None = None
    # [num_draft] whether the draft's top probability reached its min_confidence at each
    # token; None when the proposer does not judge confidence.
    is_confident: list[bool] | None = None


class DraftModelProposer:
    """Proposes tokens by running a draft model autoregressively.

    ``token_ids`` [draft_vocab]: the vocabulary ids of the draft head's rows when the head was
    restricted to frequent tokens (spec/draft_vocab.py). Proposals then carry probabilities
    over those ids only (``Proposal.draft_vocab_ids``): scattering each draft step's
    distribution into a zeroed full-vocabulary row would cost about 0.1 ms per draft token.

    ``min_confidence`` > 0: each draft token is flagged confident when the draft's top
    probability (at the sampling temperature; softmax of the logits for greedy decoding)
    reaches it, and a proposal asked to stop when unconfident ends after the first other."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, shares_target_cache: bool = False,
                 min_confidence: float = 0.0, token_ids: torch.Tensor | None = None) -> None:
        self.model = model
        self.decoder = model.fused_decoder()  # the draft's steps in one C++ call each
        self.kv_cache = kv_cache
        self.shares_target_cache = shares_target_cache
        self.min_confidence = min_confidence
        self.token_ids = token_ids
        self.step_costs = {}  # (k_max, prompt-length range) -> StepCosts, filled by speculative_generate

    @torch.inference_mode()
    def start(self, prompt_ids: list[int]) -> None:
        """A new sequence: prefill a separate draft cache with the prompt now, as part of the
        time to first token, rather than inside the first decode step."""
        if not self.shares_target_cache:
            self.kv_cache.reset()
            ids = torch.tensor([prompt_ids], device=self.model.device)
            self.model(ids, self.kv_cache, self.kv_cache.append(len(prompt_ids)))

    @torch.inference_mode()
    def propose(self, token_ids: list[int], num_tokens: int, params: SamplingParams,
                generator: torch.Generator | None, stops_when_unconfident: bool = False) -> Proposal:
        """Up to ``num_tokens`` draft tokens continuing the committed ``token_ids``; with
        ``stops_when_unconfident``, none after the first token the draft was unsure of."""
        cached = self.kv_cache.seq_lens[0]
        pending = token_ids[cached:]  # tokens the draft has not seen yet (at least the last one)
        device = self.model.device
        input_ids = torch.tensor([pending], device=device)
        draft_ids: list[torch.Tensor] = []
        draft_probs: list[torch.Tensor] = []
        is_confident: list[bool] = []
        for step in range(num_tokens):
            meta = self.kv_cache.append(input_ids.shape[1])
            logits = self.model.decode_logits(input_ids, self.kv_cache, meta, 1, self.decoder)  # [1, draft_vocab]
            if params.is_greedy:
                probs = None
                next_id = greedy_ids(logits)  # [1]
                confidence = torch.softmax(logits, dim=-1).max() if self.min_confidence > 0 else None
            else:
                probs = logits_to_probs(logits, params)  # [1, draft_vocab]
                next_id = sample_from_probs(probs, generator)
                confidence = probs.max() if self.min_confidence > 0 else None
            if self.token_ids is not None:
                next_id = self.token_ids[next_id]
            draft_ids.append(next_id)
            if probs is not None:
                draft_probs.append(probs[0])
            if confidence is not None:
                is_confident.append(float(confidence) >= self.min_confidence)
                if stops_when_unconfident and not is_confident[-1]:
                    break
            if step < num_tokens - 1:
                input_ids = next_id.view(1, 1)
        return Proposal(torch.cat(draft_ids), torch.stack(draft_probs) if draft_probs else None,
                        self.token_ids if draft_probs else None, is_confident if self.min_confidence > 0 else None)

    def rollback(self, num_valid: int) -> None:
        """Keep only cache entries of the first ``num_valid`` committed tokens."""
        if not self.shares_target_cache:
            self.kv_cache.truncate(min(self.kv_cache.seq_lens[0], num_valid))


class NgramProposer:
    """Prompt lookup decoding: match the last ``n`` tokens earlier in the context.

    The latest earlier occurrence of each n-gram that has a token after it is kept in an index
    grown with the committed tokens, so a proposal costs a dictionary lookup per ``n`` rather
    than a scan of the context (0.45 ms per step at 1500 tokens in Python, growing with it)."""

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.step_costs = {}
        self._indexed_ids: list[int] = []  # the tokens the index covers
        self._latest_start: dict[int, dict[tuple[int, ...], int]] = {}  # n -> n-gram -> latest start

    def start(self, prompt_ids: list[int]) -> None:
        """A new sequence: index its prompt now, as part of the time to first token. The index
        depends on the tokens alone, so a prompt that continues the indexed tokens keeps it."""
        self._index(prompt_ids)

    def _index(self, token_ids: list[int]) -> None:
        """Extend the index to ``token_ids``; rebuild it when they do not continue what it covers."""
        num_old = len(self._indexed_ids)
        if len(token_ids) < num_old or token_ids[:num_old] != self._indexed_ids:
            self._indexed_ids, self._latest_start = [], {}
            num_old = 0
        for n in range(self.min_ngram, self.max_ngram + 1):
            latest = self._latest_start.setdefault(n, {})
            # Starts whose n-gram now has a following token: up to len - n - 1. Later starts
            # overwrite earlier ones, so each n-gram maps to its latest occurrence.
            for start in range(max(num_old - n, 0), len(token_ids) - n):
                latest[tuple(token_ids[start:start + n])] = start
        self._indexed_ids.extend(token_ids[num_old:])

    def propose(self, token_ids: list[int], num_tokens: int, params: SamplingParams,
                generator: torch.Generator | None, stops_when_unconfident: bool = False) -> Proposal:
        self._index(token_ids)
        found: list[int] = []
        # Longest n-gram first; its latest earlier occurrence, since recent context predicts best.
        for n in range(min(self.max_ngram, len(token_ids) - 1), self.min_ngram - 1, -1):
            start = self._latest_start[n].get(tuple(token_ids[-n:]))
            if start is not None:
                found = token_ids[start + n:start + n + num_tokens]
                break
        ids = torch.tensor(found, dtype=torch.long)
        probs = None
        if not params.is_greedy and found:
            # A deterministic proposal is a point mass; rejection sampling stays exact with it.
            probs = torch.zeros(len(found), self.vocab_size)
            probs[torch.arange(len(found)), ids] = 1.0
        elif not params.is_greedy:
            probs = torch.zeros(0, self.vocab_size)
        return Proposal(ids, probs)

    def rollback(self, num_valid: int) -> None:
        pass
