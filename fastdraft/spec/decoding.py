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

from fastdraft.engine.generate import check_request, make_generator, prefill
from fastdraft.engine.kv_cache import KVCache
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.layers.sampler import logits_to_probs, sample
from fastdraft.models.llama import LlamaForCausalLM
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


@dataclass
class StepCosts:
    """Costs relative to one plain decode step of the target: a draft step, and a target
    verification pass over ``k + 1`` tokens (``verify[0] == 1`` is plain decoding)."""

    draft: float
    verify: list[float]


@torch.inference_mode()
def measure_step_costs(target: LlamaForCausalLM, proposer, k_max: int, context_len: int = 32,
                       repeats: int = 5) -> StepCosts:
    """Time the passes speculation is made of, once, on scratch caches holding ``context_len``
    tokens (speculative_generate passes the first request's prompt length): attention over
    the context is part of every pass's cost, and grows with the number of new tokens.

    Decoding is bound by reading weights, but a kernel's cost still grows with the number of
    rows it multiplies (a lot for some INT4 kernels), so the costs are measured rather than
    derived from byte counts. The passes are timed in interleaved rounds and each keeps its
    fastest time: on a shared machine noise only ever adds time, and interleaving keeps a
    slow spell from landing on one pass alone."""
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")

    def make_pass(model: LlamaForCausalLM, cache: KVCache, num_tokens: int):
        step = torch.zeros(1, num_tokens, dtype=torch.long, device=model.device)

        def run() -> None:
            # The context's keys/values are the cache's zeros: only its length matters to the
            # time, so no prefill is needed.
            cache.truncate(0)
            cache.append(context_len)
            model.decode_logits(step, cache, cache.append(num_tokens))

        run()  # warm-up
        return run

    def scratch_cache(model: LlamaForCausalLM, num_tokens: int) -> KVCache:
        return KVCache.from_config(model.config, context_len + num_tokens, dtype=model.dtype, device=model.device)

    target_cache = scratch_cache(target, k_max + 1)
    passes = [make_pass(target, target_cache, k + 1) for k in range(k_max + 1)]  # passes[0]: plain decoding
    draft_model = getattr(proposer, "model", None)
    if draft_model is not None:
        passes.append(make_pass(draft_model, scratch_cache(draft_model, 1), 1))
    best = [float("inf")] * len(passes)
    for _ in range(repeats):
        for i, run in enumerate(passes):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    decode = best[0]
    verify = [t / decode for t in best[:k_max + 1]]
    draft = best[-1] / decode if draft_model is not None else 0.01
    return StepCosts(draft=draft, verify=verify)


def step_costs_for(target: LlamaForCausalLM, proposer, k_max: int, prompt_len: int) -> StepCosts:
    """The proposer's step costs for a prompt of ``prompt_len`` tokens, measured on first need
    for each ``k_max`` and power-of-two range of prompt lengths and kept on the proposer
    (``proposer.step_costs``). Attention over the context is part of every pass, so costs
    measured on a short prompt (a warm-up request) would misjudge a long one: at 1024 tokens
    of context, verifying 5 tokens of the 1.5B costs 1.40 plain steps, at 32 tokens 1.08."""
    if getattr(proposer, "step_costs", None) is None:
        proposer.step_costs = {}
    key = (k_max, prompt_len.bit_length())
    if key not in proposer.step_costs:
        proposer.step_costs[key] = measure_step_costs(target, proposer, k_max, context_len=prompt_len)
    return proposer.step_costs[key]


class AdaptiveDraftLength:
    """Chooses ``k`` each step from the recent acceptance rate and the measured step costs.

    With per-token acceptance ``a``, a step with ``k`` drafts emits ``(1 - a^(k+1)) / (1 - a)``
    tokens for ``k * draft + verify[k]`` plain-step costs. We pick the ``k`` in ``[0, k_max]``
    with the best ratio; ``k = 0`` is plain decoding, chosen whenever speculation would not
    pay, so a poor draft (or a target whose multi-token passes are expensive) cannot make
    decoding much slower. The costs are measured once, so seeded runs choose the same ``k``s.

    The recent estimate is a ratio of decayed counts, starting from a prior worth
    ``prior_trials`` positions. A plain step tests nothing, so it pulls the estimate toward
    the request's long-run acceptance: a good draft's bad spell ends in a few plain steps,
    while a poor draft's long-run rate keeps it plain, with a ``k = 1`` probe every
    ``probe_every`` plain steps. (Measured on the 0.5B/1.5B pair at T=0.7: with a one-trial
    prior and no pull, one early rejection left a request in plain decoding for ~25 steps.)
    """

    def __init__(self, k_max: int, costs: StepCosts | None = None, is_enabled: bool = True, ema: float = 0.9,
                 probe_every: int = 8, prior: float = 0.7, prior_trials: float = 4.0) -> None:
        if k_max < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 0.0 < ema < 1.0 or not 0.0 <= prior <= 1.0 or prior_trials <= 0 or probe_every < 1:
            raise ValueError("need 0 < ema < 1, 0 <= prior <= 1, prior_trials > 0 and probe_every >= 1")
        self.k_max = k_max
        self.costs = costs or StepCosts(draft=0.3, verify=[1.0] * (k_max + 1))
        self.is_enabled = is_enabled
        self.ema = ema
        self.probe_every = probe_every
        # Decayed counts of accepted positions and of positions tested (recent), and their
        # undecayed totals over the request (long run); both start from the prior.
        self._num_accepted, self._num_trials = prior * prior_trials, prior_trials
        self._total_accepted, self._total_trials = prior * prior_trials, prior_trials
        self._plain_steps = 0

    @property
    def acceptance(self) -> float:
        """Estimated probability that the draft's next token is accepted."""
        return self._num_accepted / self._num_trials

    @acceptance.setter
    def acceptance(self, value: float) -> None:
        self._num_accepted, self._num_trials = value, 1.0

    @property
    def long_run_acceptance(self) -> float:
        """Acceptance over the whole request so far (with the prior)."""
        return self._total_accepted / self._total_trials

    def gain(self, k: int) -> float:
        """Expected tokens per unit of plain-decoding time with ``k`` drafts."""
        a = min(self.acceptance, 0.99)
        return ((1 - a ** (k + 1)) / (1 - a)) / (k * self.costs.draft + self.costs.verify[k])

    def next_k(self) -> int:
        if not self.is_enabled:
            return self.k_max
        best = max(range(self.k_max + 1), key=self.gain)
        if best == 0:
            self._plain_steps += 1
            if self._plain_steps % self.probe_every == 0:
                return 1
        return best

    def update(self, num_draft: int, num_accepted: int) -> None:
        """Fold one step into the per-token acceptance estimate.

        A step tests positions until the first rejection: ``num_accepted`` successes out of
        ``num_accepted + 1`` trials (out of ``num_draft`` when all pass). The estimate is the
        ratio of decayed sums of both; ``num_accepted / num_draft`` would count positions
        after a rejection as failures (a = 0.93 with k = 4 reads 0.86) and drive ``k`` down.
        A plain step (``num_draft == 0``) counts as one trial at the long-run rate."""
        if num_draft == 0:
            self._num_accepted = self.ema * self._num_accepted + self.long_run_acceptance
            self._num_trials = self.ema * self._num_trials + 1.0
            return
        num_trials = num_accepted + (num_accepted < num_draft)
        self._num_accepted = self.ema * self._num_accepted + num_accepted
        self._num_trials = self.ema * self._num_trials + num_trials
        self._total_accepted += num_accepted
        self._total_trials += num_trials


def _match_vocab(probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Zero-pad (or trim padding of) draft probabilities to the target's vocabulary size."""
    if probs.shape[-1] == vocab_size:
        return probs
    if probs.shape[-1] < vocab_size:
        return F.pad(probs, (0, vocab_size - probs.shape[-1]))
    return probs[..., :vocab_size]


@torch.inference_mode()
def speculative_generate(target: LlamaForCausalLM, proposer, prompt_ids: list[int], params: SamplingParams,
                         kv_cache: KVCache, eos_token_ids: list[int], num_speculative_tokens: int = 4,
                         adaptive: bool = True, metrics: SpecMetrics | None = None) -> Iterator[int]:
    """Yield new token ids, as :func:`fastdraft.engine.generate.generate_token_ids` does,
    using ``proposer`` to draft and ``target`` to verify."""
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
    costs = step_costs_for(target, proposer, num_speculative_tokens, len(prompt_ids)) if adaptive else None
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
        k = min(controller.next_k(), params.max_new_tokens - num_new - 1)
        start = time.perf_counter()
        if k > 0:
            proposal = proposer.propose(tokens, k, params, draft_generator)
            draft_ids = proposal.draft_token_ids.to(device)
        else:
            proposal, draft_ids = None, torch.empty(0, dtype=torch.long, device=device)
        draft_s = time.perf_counter() - start
        num_draft = draft_ids.shape[0]

        start = time.perf_counter()
        kv_cache.truncate(len(tokens) - 1)  # drop draft entries a shared cache may hold
        input_ids = torch.cat([torch.tensor([tokens[-1]], device=device), draft_ids]).unsqueeze(0)
        meta = kv_cache.append(input_ids.shape[1])
        target_logits = target.decode_logits(input_ids, kv_cache, meta)  # [k + 1, vocab]
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
        controller.update(num_draft, result.num_accepted)
        for token in new_tokens:
            num_new += 1
            yield token
        if new_tokens[-1] in eos or num_new >= params.max_new_tokens:
            return
