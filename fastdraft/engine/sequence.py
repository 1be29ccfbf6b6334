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
    """One request's tokens: the prompt's ``num_prompt_tokens``, then the generated ones, in one
    list (``token_ids``) that only grows by :meth:`append_token` and shrinks by
    :meth:`truncate_output`.

    ``num_computed_tokens`` of ``token_ids`` have their keys and values in the cache (found
    there by prefix caching, or computed); ``block_table`` maps the sequence's positions,
    ``block_size`` at a time, to cache blocks, of which the first ``num_hashed_blocks`` are
    keyed for prefix caching. Preemption frees the blocks and resets the counts, and the tokens
    are computed again when the sequence is scheduled anew."""

    token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_prompt_tokens: int = -1  # -1: every token given is the prompt
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # found by prefix caching when the sequence was last allocated
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    num_window_passed_blocks: int = 0  # leading blocks its sliding window has moved past
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    # What ended a "stop": the EOS token id, or the stop string.
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.token_ids = list(self.token_ids)
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)
        if self.request_id is None:
            self.request_id = str(self.seq_id)

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt's tokens."""
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

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

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def truncate_output(self, num_kept: int) -> None:
        """Keep the first ``num_kept`` generated tokens (a stop string ended the text there)."""
        del self.token_ids[self.num_prompt_tokens + num_kept:]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)
