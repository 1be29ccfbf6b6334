"""Proposers: cheap ways to guess each decoding sequence's next ``k`` tokens, for a whole batch.

* :class:`DraftModelProposer` runs a small model of the same tokenizer, one batched pass per
  draft position over every drafting sequence. A separate draft keeps its own paged KV cache
  (its own blocks per sequence, grown and rolled back with the target's tokens). The target's
  own INT4 copy (self-speculation) instead writes its guesses into the target's blocks, at the
  positions verification is about to overwrite: the accepted prefix is always the target's own
  keys and values, which costs no memory and no draft prefill, and raises acceptance.
* :class:`NgramProposer` (prompt lookup) copies what followed the latest earlier occurrence of
  a sequence's last n-gram: free to run, and strong on code and edits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.sequence import Sequence
from fastdraft.engine.speculation import DraftBatch
from fastdraft.layers.kv_cache import Span, flat_batch
from fastdraft.layers.sampler import batched_probs, greedy_ids, sample_from_probs


class DraftModelProposer:
    """Drafts by running a draft model autoregressively over a batch of sequences.

    ``runner`` runs the draft: over its own cache and block manager, or, with
    ``shares_target_cache``, over the target's (a self-draft of the same shape). ``token_ids``
    [draft_vocab]: the vocabulary ids of the draft head's rows when the head keeps only
    frequent tokens (speculative/draft_vocab.py); ``vocab_size``: the target's vocabulary.

    ``min_confidence`` > 0: a sequence stops drafting after a token whose draft probability
    (at its sampling temperature; of the softmax for greedy requests) fell below it: later
    positions are rarely accepted and would cost draft and verification work."""

    def __init__(self, runner: ModelRunner, vocab_size: int, shares_target_cache: bool = False,
                 min_confidence: float = 0.0, token_ids: torch.Tensor | None = None) -> None:
        self.runner = runner
        self.model = runner.model
        self.vocab_size = vocab_size
        self.shares_target_cache = shares_target_cache
        self.min_confidence = min_confidence
        self.token_ids = token_ids
        # A separate draft's view of each target sequence: its ``token_ids`` are the target's
        # tokens the draft has computed in its own blocks (then the drafts fed back).
        self._shadows: dict[int, Sequence] = {}

    def pending_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` the draft must compute before it drafts (its prompt, at first)."""
        if self.shares_target_cache:
            return 1
        shadow = self._shadows.get(seq.seq_id)
        return seq.num_tokens - (shadow.num_computed_tokens if shadow is not None else 0)

    def _start_span(self, seq: Sequence, num_draft: int) -> Span | None:
        """The first draft pass's span of ``seq``: its last token (a shared cache already holds
        the rest), or every token the draft has not computed; None when the draft's cache has no
        room for them."""
        if self.shares_target_cache:
            return Span([seq.token_ids[-1]], seq.num_computed_tokens, seq.block_table)
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self._shadows[seq.seq_id] = Sequence(seq.prompt_token_ids)
        pending = seq.token_ids[shadow.num_computed_tokens:]
        # Room for the pending tokens and the drafts fed back (all but the last).
        if not self.runner.block_manager.append_slots(shadow, len(pending) + num_draft - 1):
            self.release(seq)
            return None
        span = Span(pending, shadow.num_computed_tokens, shadow.block_table)
        del shadow.token_ids[shadow.num_computed_tokens:]  # its computed tokens are the target's
        shadow.token_ids.extend(pending)
        shadow.num_computed_tokens += len(pending)
        return span

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int], generators: list[torch.Generator]) -> DraftBatch:
        spans = [self._start_span(seq, k) for seq, k in zip(seqs, num_tokens)]
        active = [i for i, span in enumerate(spans) if span is not None]
        limits = [k if span is not None else 0 for k, span in zip(num_tokens, spans)]
        draft_ids: list[list[int]] = [[] for _ in seqs]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        is_sampled = any(not seqs[i].params.is_greedy for i in active)
        block_size = self.runner.block_manager.block_size
        while active:
            input_ids, meta = flat_batch([spans[i] for i in active], block_size, self.model.device)
            rows = [meta.query_start_loc[j + 1] - 1 for j in range(len(active))]
            logits = self.runner.logits(input_ids, meta, rows)  # [num_active, draft_vocab]
            next_ids, confident = self._draw(logits, [seqs[i] for i in active], [generators[i] for i in active],
                                             [draft_probs[i] for i in active], is_sampled)
            still_active = []
            for j, i in enumerate(active):
                draft_ids[i].append(next_ids[j])
                if len(draft_ids[i]) < limits[i] and confident[j]:
                    position = spans[i].start + len(spans[i].token_ids)
                    spans[i] = Span([next_ids[j]], position, spans[i].block_table)
                    still_active.append(i)
            active = still_active
        for i, seq in enumerate(seqs):
            if not self.shares_target_cache and draft_ids[i]:  # the drafts fed back are computed
                shadow = self._shadows[seq.seq_id]
                shadow.token_ids.extend(draft_ids[i][:-1])
                shadow.num_computed_tokens += len(draft_ids[i]) - 1
        probs = None
        if is_sampled:
            rows = [row for i in range(len(seqs)) for row in draft_probs[i]]
            probs = torch.stack(rows) if rows else None  # [num_draft_tokens, draft_vocab]
        return DraftBatch(draft_ids, probs, self.token_ids if probs is not None else None)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], generators: list[torch.Generator],
              probs_out: list[list[torch.Tensor]], is_sampled: bool) -> tuple[list[int], list[bool]]:
        """Each row's draft token (its argmax, or a draw at its request's temperature), whether
        the draft was confident of it; sampled distributions go to ``probs_out`` (every row
        gets one when any request samples, so rows stay aligned with tokens)."""
        params = [seq.params for seq in seqs]
        sampled_rows = [j for j, p in enumerate(params) if not p.is_greedy]
        ids = greedy_ids(logits).tolist()  # [rows]
        confidence = None
        if self.min_confidence > 0:
            confidence = torch.softmax(logits, dim=-1).amax(dim=-1).tolist()  # [rows]
        if is_sampled:
            probs = logits.new_zeros(len(params), logits.shape[-1])  # greedy rows: never read
            if sampled_rows:  # [num_sampled, draft_vocab], each row with its request's parameters
                probs[sampled_rows] = batched_probs(logits[sampled_rows], [params[j] for j in sampled_rows])
            if self.token_ids is None:
                probs = _match_vocab(probs, self.vocab_size)
            for j in sampled_rows:
                # A draft on another device than the target (a CPU draft beside a CUDA one)
                # draws from its device's default generator: seeded requests do not speculate.
                generator = generators[j] if generators[j].device == probs.device else None
                ids[j] = int(sample_from_probs(probs[j], generator))
                if confidence is not None:
                    confidence[j] = float(probs[j].max())
            for j in range(len(params)):
                probs_out[j].append(probs[j])
        if self.token_ids is not None:
            ids = self.token_ids[ids].tolist()
        confident = [True] * len(ids) if confidence is None else [c >= self.min_confidence for c in confidence]
        return ids, confident

    def update(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        """Roll a separate draft's cache back to the tokens the target kept."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            return
        computed, committed = shadow.token_ids, seq.token_ids
        num_valid = 0
        limit = min(shadow.num_computed_tokens, len(committed) - 1)
        while num_valid < limit and computed[num_valid] == committed[num_valid]:
            num_valid += 1
        shadow.num_computed_tokens = num_valid
        del computed[max(num_valid, 1):]
        self.runner.block_manager.trim(shadow)

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.runner.block_manager.free(shadow)


def _match_vocab(probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Zero-pad (or trim the padding of) draft probabilities to the target's vocabulary size."""
    if probs.shape[-1] == vocab_size:
        return probs
    if probs.shape[-1] < vocab_size:
        return F.pad(probs, (0, vocab_size - probs.shape[-1]))
    return probs[..., :vocab_size]


class NgramIndex:
    """One sequence's n-gram index: the latest earlier occurrence of each n-gram that has a
    token after it, grown with the committed tokens, so that a lookup costs a dictionary probe
    per ``n`` rather than a scan of the context, whose cost grows with every token generated."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._indexed_ids: list[int] = []  # the tokens the index covers
        self._latest_start: dict[int, dict[tuple[int, ...], int]] = {}  # n -> n-gram -> latest start

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

    def lookup(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the longest matching n-gram's latest
        earlier occurrence (recent context predicts best); [] without a match."""
        self._index(token_ids)
        for n in range(min(self.max_ngram, len(token_ids) - 1), self.min_ngram - 1, -1):
            start = self._latest_start[n].get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start + n:start + n + num_tokens]
        return []


class NgramProposer:
    """Prompt lookup decoding for a batch: each sequence with its own :class:`NgramIndex`.

    A lookup's proposal is deterministic, a point mass; rejection sampling stays exact with
    it. Sampled requests get those point masses as draft probabilities over the step's
    distinct draft tokens (``DraftBatch.draft_vocab_ids``), not over the whole vocabulary."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        NgramIndex(max_ngram, min_ngram)  # checks the sizes
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int], generators: list[torch.Generator]) -> DraftBatch:
        draft_ids = []
        for seq, k in zip(seqs, num_tokens):
            index = self._indexes.get(seq.seq_id)
            if index is None:
                index = self._indexes[seq.seq_id] = NgramIndex(self.max_ngram, self.min_ngram)
            draft_ids.append(index.lookup(seq.token_ids, k))
        if all(seq.params.is_greedy for seq in seqs) or not any(draft_ids):
            return DraftBatch(draft_ids)
        flat = [t for ids in draft_ids for t in ids]
        vocab_ids = torch.tensor(sorted(set(flat)), dtype=torch.long)  # [num_distinct]
        columns = torch.searchsorted(vocab_ids, torch.tensor(flat, dtype=torch.long))
        probs = torch.zeros(len(flat), len(vocab_ids))  # [num_draft_tokens, num_distinct]
        probs[torch.arange(len(flat)), columns] = 1.0
        return DraftBatch(draft_ids, probs, vocab_ids)

    def pending_tokens(self, seq: Sequence) -> int:
        return 0  # an index grows by dictionary updates, with no model to run

    def update(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        pass  # the index follows the committed tokens at the next lookup

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq.seq_id, None)
