"""Speculative decoding: propose ``k`` tokens, verify them in one target pass, roll back.

The loop keeps one invariant: the target's KV cache holds every committed token except
the last, which is fed at the start of the next verification pass together with the
draft tokens (``k + 1`` tokens, one forward). After verification the cache is truncated to
the committed prefix, discarding rejected positions (and any draft entries written into a
shared cache).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fastdraft.engine.generate import check_request, prefill
from fastdraft.layers.kv_cache import KVCache
from fastdraft.layers.sampler import logits_to_probs, make_generator, sample
from fastdraft.models.fused_decoder import FusedDecoder
from fastdraft.models.llama import LlamaForCausalLM
from fastdraft.sampling_params import SamplingParams
from fastdraft.spec.draft_length import AdaptiveDraftLength, modeled_step_costs, step_costs_for
from fastdraft.spec.rejection_sampler import verify_greedy, verify_sampled


@dataclass
class SpecMetrics:
    """Acceptance statistics of speculative decoding."""

    num_steps: int = 0  # verification passes
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_plain_steps: int = 0  # steps decoded without speculation (adaptive k = 0)
    accepted_per_position: list[int] = field(default_factory=list)  # [k_max] times position i was accepted
    proposed_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification pass (accepted + the recovered/bonus one)."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    def record(self, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        self._cover_positions(num_draft)
        for i in range(num_draft):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    def _cover_positions(self, num_positions: int) -> None:
        """Grow the per-position counts to at least ``num_positions`` draft positions."""
        while len(self.proposed_per_position) < num_positions:
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)

    def merge(self, other: "SpecMetrics") -> None:
        """Add ``other``'s counts and times to these (e.g. totals over several requests)."""
        for name in ("num_steps", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
                     "num_plain_steps", "draft_time_s", "verify_time_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._cover_positions(len(other.proposed_per_position))
        for i, (accepted, proposed) in enumerate(zip(other.accepted_per_position, other.proposed_per_position)):
            self.proposed_per_position[i] += proposed
            self.accepted_per_position[i] += accepted

    def summary(self) -> str:
        per_pos = " ".join(f"{a:.2f}" for a in self.per_position_acceptance)
        return (f"acceptance {self.acceptance_rate * 100:.1f}% | mean accepted length "
                f"{self.mean_accepted_length:.2f} tok/step | per position [{per_pos}]")


def _match_vocab(probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Zero-pad (or trim padding of) draft probabilities to the target's vocabulary size."""
    if probs.shape[-1] == vocab_size:
        return probs
    if probs.shape[-1] < vocab_size:
        return F.pad(probs, (0, vocab_size - probs.shape[-1]))
    return probs[..., :vocab_size]


class Speculator:
    """Speculative decoding of one sequence at a time over ``kv_cache``: what
    ``SpeculativeConfig.start`` hands a ``TextGenerator``."""

    def __init__(self, target: LlamaForCausalLM, proposer, kv_cache: KVCache, num_speculative_tokens: int,
                 is_adaptive: bool) -> None:
        self.target = target
        self.target_decoder = target.fused_decoder()  # the target's verification passes in one C++ call
        self.proposer = proposer
        self.kv_cache = kv_cache
        self.num_speculative_tokens = num_speculative_tokens
        self.is_adaptive = is_adaptive

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: list[int]) -> tuple[SpecMetrics, Iterator[int]]:
        metrics = SpecMetrics()
        return metrics, speculative_generate(self.target, self.proposer, prompt_ids, params, self.kv_cache,
                                             eos_token_ids, self.num_speculative_tokens, self.is_adaptive, metrics,
                                             self.target_decoder)


@torch.inference_mode()
def speculative_generate(target: LlamaForCausalLM, proposer, prompt_ids: list[int], params: SamplingParams,
                         kv_cache: KVCache, eos_token_ids: list[int], num_speculative_tokens: int = 4,
                         adaptive: bool = True, metrics: SpecMetrics | None = None,
                         target_decoder: FusedDecoder | None = None) -> Iterator[int]:
    """Yield new token ids, as :func:`fastdraft.engine.generate.generate_token_ids` does,
    using ``proposer`` to draft and ``target`` to verify (through ``target_decoder``, its
    fused C++ decoder, when given).

    ``adaptive``: each step's draft length follows the acceptance so far and the passes' costs,
    measured once per proposer and prompt-length range. On the CPU, a seeded sampled request
    weighs costs modeled from bytes instead (:func:`modeled_step_costs`), so that its tokens
    repeat from one process to the next. On a GPU a step costs about the same at any size (it is
    bound by launches, not bytes), so GPU requests keep measured costs and repeat within one
    process."""
    check_request(len(prompt_ids), params, kv_cache.max_seq_len - num_speculative_tokens - 1)
    metrics = metrics if metrics is not None else SpecMetrics()
    generator = make_generator(params.seed, target.device)
    # A draft on another device (a CPU draft beside a CUDA target) draws from its own stream.
    draft_model = getattr(proposer, "model", None)
    draft_generator = generator
    if draft_model is not None and draft_model.device != target.device:
        draft_generator = make_generator(None if params.seed is None else params.seed + 1, draft_model.device)
    eos = set() if params.ignore_eos else set(eos_token_ids)
    vocab_size = target.config.vocab_size
    costs = None
    is_all_cpu = target.device.type == "cpu" and (draft_model is None or draft_model.device.type == "cpu")
    if adaptive and params.seed is not None and not params.is_greedy and is_all_cpu:
        # Reproducible: the plan (and so each step's random draws) must not follow timings.
        costs = modeled_step_costs(target, proposer, num_speculative_tokens, len(prompt_ids))
    elif adaptive:
        costs = step_costs_for(target, proposer, num_speculative_tokens, len(prompt_ids))
    controller = AdaptiveDraftLength(num_speculative_tokens, costs, adaptive)

    device = target.device
    logits = prefill(target, torch.tensor([prompt_ids], device=device), kv_cache)
    proposer.start(prompt_ids)
    first = int(sample(logits, params, generator))
    tokens = list(prompt_ids) + [first]
    num_new = 1
    yield first
    if first in eos or num_new >= params.max_new_tokens:
        return
    while True:
        plan = controller.next_plan()
        k = min(plan.num_tokens, params.max_new_tokens - num_new - 1)
        start = time.perf_counter()
        if k > 0:
            proposal = proposer.propose(tokens, k, params, draft_generator, plan.stops_when_unconfident)
            draft_ids = proposal.draft_token_ids.to(device)
        else:
            proposal, draft_ids = None, torch.empty(0, dtype=torch.long, device=device)
        draft_s = time.perf_counter() - start
        num_draft = draft_ids.shape[0]

        start = time.perf_counter()
        kv_cache.truncate(len(tokens) - 1)  # drop draft entries a shared cache may hold
        input_ids = torch.cat([torch.tensor([tokens[-1]], device=device), draft_ids]).unsqueeze(0)
        meta = kv_cache.append(input_ids.shape[1])
        target_logits = target.decode_logits(input_ids, kv_cache, meta, decoder=target_decoder)  # [k + 1, vocab]
        if params.is_greedy:
            result = verify_greedy(draft_ids, target_logits)
        else:
            draft_vocab_ids = None
            if not num_draft:
                draft_probs = torch.zeros(0, vocab_size, device=device)
            elif proposal.draft_vocab_ids is None:
                draft_probs = _match_vocab(proposal.draft_probs.to(device), vocab_size)
            else:  # [k, draft_vocab] over these vocabulary ids
                draft_probs, draft_vocab_ids = proposal.draft_probs.to(device), proposal.draft_vocab_ids.to(device)
            result = verify_sampled(draft_ids, draft_probs, logits_to_probs(target_logits, params), generator,
                                    draft_vocab_ids)
        verify_s = time.perf_counter() - start

        new_tokens = result.output_token_ids
        for i, token in enumerate(new_tokens):
            if token in eos or num_new + i + 1 >= params.max_new_tokens:
                new_tokens = new_tokens[:i + 1]
                break
        tokens.extend(new_tokens)
        kv_cache.truncate(len(tokens) - 1)
        proposer.rollback(len(tokens) - 1)
        metrics.draft_time_s += draft_s
        metrics.verify_time_s += verify_s
        if num_draft:
            metrics.record(num_draft, result.num_accepted, len(new_tokens))
        else:
            metrics.num_plain_steps += 1
        controller.update(num_draft, result.num_accepted, proposal.is_confident if num_draft else None)
        for token in new_tokens:
            num_new += 1
            yield token
        if new_tokens[-1] in eos or num_new >= params.max_new_tokens:
            return
