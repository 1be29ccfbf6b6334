"""A request's tokens and its place in the KV cache, as the scheduler tracks it."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from fastdraft.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


_sequence_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's prompt and generated tokens.

    ``num_computed_tokens`` of ``token_ids`` have their keys and values in the cache (found
    there by prefix caching, or computed); ``block_table`` maps the sequence's positions,
    ``block_size`` at a time, to cache blocks. Preemption frees the blocks and resets the count,
    and the tokens are computed again when the sequence is scheduled anew."""

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # found by prefix caching when the sequence was last allocated
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length" once finished

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.prompt_token_ids = list(self.prompt_token_ids)
        if self.request_id is None:
            self.request_id = str(self.seq_id)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill_done(self) -> bool:
        """Whether every prompt token has been computed, so the next step samples a token."""
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
