"""Iteration-level scheduling: which sequences compute how many tokens in the next step.

Every step has a token budget (``max_num_batched_tokens``) shared by all sequences, as in
vLLM's v1 scheduler: running sequences are served first, oldest first (a decode takes one
token, an unfinished prompt a chunk of what is left), then waiting ones, oldest first, take
what budget remains. A long prompt is thus prefilled in chunks between decode steps instead of
stalling them. When the cache runs out of blocks, the newest running sequence is preempted: its
blocks are freed and it waits to be computed again (prefix caching usually finds most of them
still in the pool).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    """Limits of one step; checked with ``ValueError``."""

    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 512  # tokens one step computes, over all sequences
    enable_chunked_prefill: bool = True  # False: a prompt is computed whole in one step

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")


@dataclass
class SchedulerOutput:
    """One step's work: ``num_scheduled_tokens[i]`` tokens of ``seqs[i]``, starting at its
    ``num_computed_tokens``.

    A decoding sequence may also verify draft tokens (speculative decoding): its last token
    then comes with ``draft_token_ids[seq_id]`` (``k`` tokens, counted in its scheduled ones),
    drawn from ``draft_probs`` (rows back to back in ``seqs`` order; None for greedy drafts
    only), over the vocabulary ids ``draft_vocab_ids`` when the draft's head covers part of it."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    draft_probs: torch.Tensor | None = None  # [num_draft_tokens, draft_vocab]
    draft_vocab_ids: torch.Tensor | None = None  # [draft_vocab]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Decides each step's work and owns when a sequence ends: on EOS (``eos_token_ids``) and
    on length it finishes sequences itself, in :meth:`update`; a stop string, found in the
    text by the engine, ends one through :meth:`finish`."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: frozenset[int] | set[int] = frozenset()) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; ``ValueError`` if it could never fit the cache, even alone."""
        self.check_fits(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def check_fits(self, seq: Sequence) -> None:
        """``ValueError`` if ``seq`` could never fit the cache, even alone."""
        max_tokens = seq.num_prompt_tokens + seq.params.max_new_tokens
        needed = self.block_manager.num_blocks_for(max_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"request {seq.request_id} needs {needed} cache blocks for its prompt and "
                             f"max_new_tokens; the cache has {self.block_manager.num_blocks}")
        if not self.config.enable_chunked_prefill and max_tokens - 1 > self.config.max_num_batched_tokens:
            # Without chunks a sequence, or its recomputation after a preemption, runs in one step.
            raise ValueError(f"request {seq.request_id} may reach {max_tokens - 1} tokens to compute in one step; "
                             f"max_num_batched_tokens is {self.config.max_num_batched_tokens} and chunked "
                             "prefill is off")

    def abort(self, request_id: str) -> Sequence | None:
        """Drop the request, freeing its blocks; the sequence, or None if it is unknown."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    self.finish(seq, "abort")
                    return seq
        return None

    def _chunk(self, seq: Sequence, budget: int) -> int:
        num = seq.num_uncomputed_tokens
        if not self.config.enable_chunked_prefill and num > budget:
            return 0  # a whole prompt or nothing
        return min(num, budget)

    def _preempt(self, seq: Sequence, output: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        output.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num = self._chunk(seq, budget)
            if num == 0:
                index += 1
                continue
            while not self.block_manager.append_slots(seq, num):
                victim = self.running[-1]  # the newest running sequence gives way
                self._preempt(victim, output)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing older is left to make room for it
            output.seqs.append(seq)
            output.num_scheduled_tokens.append(num)
            budget -= num
            index += 1
        # After a preemption the pool is short: admitting waiting sequences now would only
        # take blocks back from the running ones (a victim could even return at once).
        while not output.preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.cached_prefix_blocks(seq)  # hashed once per admission
            uncomputed = seq.num_tokens - len(cached) * self.block_manager.block_size
            num = min(uncomputed, budget)
            if not self.config.enable_chunked_prefill and uncomputed > budget:
                break
            if not self.block_manager.can_allocate(seq, num, cached):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, num, cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            output.seqs.append(seq)
            output.num_scheduled_tokens.append(num)
            budget -= num
        return output

    def reserve_draft_slots(self, output: SchedulerOutput, index: int, num_draft_tokens: int) -> bool:
        """Make room in ``output`` for ``num_draft_tokens`` draft tokens after ``seqs[index]``'s
        last token: cache slots and token budget. False, changing nothing, when either is short
        (drafts never preempt anyone)."""
        seq = output.seqs[index]
        if output.num_tokens + num_draft_tokens > self.config.max_num_batched_tokens:
            return False
        if not self.block_manager.append_slots(seq, output.num_scheduled_tokens[index] + num_draft_tokens):
            return False
        output.num_scheduled_tokens[index] += num_draft_tokens
        return True

    def update(self, output: SchedulerOutput, sampled: dict[int, list[int]]) -> list[Sequence]:
        """Record a step: every scheduled sequence computed its tokens, and those that reached
        the end of their tokens sampled (``sampled``, by ``seq_id``): one token, or after
        verifying ``k`` draft tokens the accepted ones and one more. Tokens are appended up to
        the first EOS or the length limit, which finish the sequence. Rejected draft tokens are
        not computed: the blocks that held only them go back to the pool, and the keys and
        values they left in kept blocks are overwritten later. Returns the sequences that
        finished, their blocks freed."""
        finished = []
        for seq, num in zip(output.seqs, output.num_scheduled_tokens):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted later in the same schedule
            num_draft = len(output.draft_token_ids.get(seq.seq_id, ()))
            tokens = sampled.get(seq.seq_id, [])
            # The last token and the accepted drafts are computed; rejected ones are not.
            num_computed = seq.num_computed_tokens + num - num_draft + max(len(tokens) - 1, 0)
            reason = stop_token = None
            if num_computed >= seq.num_tokens:  # not a prompt chunk: new tokens, appended first
                for token in tokens:  # so that blocks are keyed by their final tokens
                    seq.append_token(token)
                    if token in self.eos_token_ids and not seq.params.ignore_eos:
                        reason, stop_token = "stop", token
                    elif seq.num_output_tokens >= seq.params.max_new_tokens:
                        reason = "length"
                    if reason is not None:
                        break
            # Drafts past an EOS or the length limit were computed but are not tokens.
            seq.num_computed_tokens = min(num_computed, seq.num_tokens)
            self.block_manager.trim(seq)  # blocks reserved for drafts that were rejected or never came
            self.block_manager.commit(seq)
            if reason is not None:
                self.finish(seq, reason, stop_reason=stop_token)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str, num_kept: int | None = None,
               stop_reason: int | str | None = None) -> None:
        """End ``seq`` for ``reason`` ("stop", "length" or "abort") and free its blocks.
        ``num_kept``: the generated tokens it keeps (a stop string ended the text inside this
        step's tokens); ``stop_reason``: the EOS token or stop string. A sequence that this
        step already finished takes the new reason: the text ends at the stop string."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        if num_kept is not None:
            seq.truncate_output(num_kept)
