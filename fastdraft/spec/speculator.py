"""The engine's speculator: a proposer that drafts, and the policy that says how much."""

from __future__ import annotations

import torch

from fastdraft.engine.sequence import Sequence
from fastdraft.engine.speculation import DraftBatch
from fastdraft.spec.draft_length import DraftLengthPolicy
from fastdraft.spec.proposer import Proposer


class EngineSpeculator:
    """What ``SpeculativeConfig.start`` hands the engine (``engine.speculation.Speculator``)."""

    def __init__(self, proposer: Proposer, policy: DraftLengthPolicy) -> None:
        self.proposer = proposer
        self.policy = policy
        self.num_speculative_tokens = policy.k_max

    def draft_lengths(self, seqs: list[Sequence], num_step_tokens: int) -> list[int]:
        return self.policy.draft_lengths(seqs, num_step_tokens)

    def propose(self, seqs: list[Sequence], num_tokens: list[int], generators: list[torch.Generator]) -> DraftBatch:
        return self.proposer.propose(seqs, num_tokens, generators)

    def update(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        self.policy.update(seq, num_draft, num_accepted)
        self.proposer.update(seq, num_draft, num_accepted)

    def release(self, seq: Sequence) -> None:
        self.policy.release(seq)
        self.proposer.release(seq)
