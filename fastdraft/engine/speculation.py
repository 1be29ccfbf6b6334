"""How speculative decoding plugs into the engine: what a proposer and a draft-length policy
must do, and what they hand back. ``fastdraft.speculative`` implements them (draft model,
self, n-gram); the engine only schedules the draft tokens, verifies them in its step, and
reports the outcome.

Each step, for the sequences that decode this step and may speculate, the engine asks the
policy how many tokens to draft (``draft_lengths``, possibly 0), reserves cache slots and
token budget for them, asks the proposer for the drafts of every drafting sequence at once
(``propose``), and runs the target over each sequence's last token and its drafts in the same
flat batch as everything else. The rejection sampler keeps a prefix; ``update`` then tells
both what was accepted, so that each can roll back its own state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.sequence import Sequence
from fastdraft.models.files import LoadedModel
from fastdraft.sampling_params import SamplingParams


@dataclass
class DraftBatch:
    """The drafts of one step, one list per sequence asked (possibly shorter than asked, or
    empty). ``draft_probs`` [num_draft_tokens, draft_vocab]: the distributions sampled drafts
    were drawn from, back to back in sequence order (None when every sequence is greedy);
    ``draft_vocab_ids`` [draft_vocab]: the vocabulary ids of its columns when the draft's head
    covers part of the vocabulary (None: column i is token i)."""

    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None = None
    draft_vocab_ids: torch.Tensor | None = None


class Proposer(Protocol):
    """Guesses continuations for a batch of decoding sequences, and keeps whatever per-sequence
    state that takes in step with what verification kept."""

    def pending_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` the proposer must compute before its first draft token (its
        cost is charged to speculation: the draft's prompt, for a separate draft)."""

    def propose(self, seqs: list[Sequence], num_tokens: list[int],
                generators: list[torch.Generator]) -> DraftBatch:
        """Up to ``num_tokens[i]`` tokens continuing each of ``seqs``, all in one batched pass
        per draft position; sampled requests draw from their own ``generators``."""

    def update(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        """After verification (or a plain step, ``num_draft == 0``): ``num_accepted`` of
        ``seq``'s ``num_draft`` drafts were kept; its tokens are already updated."""

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted: drop its state and free what it holds."""


class DraftLengthChooser(Protocol):
    """Says how many tokens each decoding sequence drafts in a step, learning from outcomes."""

    k_max: int  # the most tokens one sequence drafts in a step

    def draft_lengths(self, seqs: list[Sequence], num_step_tokens: int) -> list[int]:
        """How many tokens each of ``seqs`` should draft in a step that already computes
        ``num_step_tokens`` tokens (0: plain decoding)."""

    def update(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        """What ``seq``'s step came to (as :meth:`Proposer.update`)."""

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted."""


@dataclass
class Speculator:
    """What the engine drafts with: a proposer, and the policy that says how much."""

    proposer: Proposer
    policy: DraftLengthChooser


class SpeculatorFactory(Protocol):
    """Makes the engine's speculator (``fastdraft.speculative.factory.speculator_factory``)."""

    def __call__(self, target: LoadedModel, runner: ModelRunner, max_num_seqs: int) -> Speculator:
        """The speculator for ``target``, drafting beside its ``runner`` (whose cache a
        self-draft writes into) for up to ``max_num_seqs`` sequences a step."""


def may_speculate(params: SamplingParams) -> bool:
    """Whether a request with ``params`` may decode speculatively.

    Penalties, logit bias, ``min_tokens`` and log-probabilities change or report each
    position's distribution one token at a time, so such requests decode plainly. So do seeded
    sampled requests: how many random draws a step takes depends on its draft length, which
    follows the load, and a seed must give the same tokens whatever else runs."""
    return not params.uses_engine_extras() and (params.is_greedy or params.seed is None)
