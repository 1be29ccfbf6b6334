"""Adaptive draft length: how many tokens to draft each step, and when to stop early.

Speculation pays only when drafting ``k`` tokens and verifying ``k + 1`` costs less than the
target steps it saves. :class:`AdaptiveDraftLength` weighs the measured costs of both passes
(:func:`measure_step_costs`) against the acceptance seen so far, and picks each step's
:class:`DraftPlan`: how many tokens to draft, and whether to stop after the first token the
draft is unsure of (its top probability under ``min_confidence``). ``k = 0`` is plain decoding,
so a poor draft cannot make decoding much slower.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastdraft.layers.kv_cache import KVCache
from fastdraft.models.llama import LlamaForCausalLM


# A draft step's cost for a proposer without a model (prompt lookup): a dictionary lookup.
NO_MODEL_DRAFT_COST = 0.01


@dataclass
class StepCosts:
    """Costs relative to one plain decode step of the target: a draft step, and a target
    verification pass over ``k + 1`` tokens (``verify[0] == 1`` is plain decoding)."""

    draft: float
    verify: list[float]


@torch.inference_mode()
def measure_step_costs(target: LlamaForCausalLM, proposer, k_max: int, context_len: int = 32,
                       repeats: int = 7, min_repeats: int = 3, time_budget_s: float = 1.5) -> StepCosts:
    """Time the passes speculation is made of, once, on scratch caches holding ``context_len``
    tokens (speculative_generate passes the first request's prompt length): attention over
    the context is part of every pass's cost, and grows with the number of new tokens.

    Decoding is bound by reading weights, but a kernel's cost still grows with the number of
    rows it multiplies (a lot for some INT4 kernels), so the costs are measured rather than
    derived from byte counts. The passes are timed in interleaved rounds, and each cost is
    the median over rounds of the pass's time divided by the plain step's time in the same
    round, as benchmarks/ab_kernels.py compares builds: on a shared VM memory bandwidth can
    switch between two states within seconds, and the fastest time of each pass on its own
    could pair a pass that never met the fast state with a plain step that did.

    The first request pays for the timing in its TTFT, so rounds stop after ``min_repeats``
    once the timed passes have taken ``time_budget_s``: a round of the bf16 1.5B with its INT4
    copy takes about 0.6 s at 1024 tokens of context, of the INT4 0.5B/1.5B pair 0.15 s."""
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    if repeats < 1 or min_repeats < 1:
        raise ValueError(f"repeats and min_repeats must be >= 1, got {repeats} and {min_repeats}")
    if not time_budget_s >= 0:
        raise ValueError(f"time_budget_s must be >= 0, got {time_budget_s}")

    def make_pass(model: LlamaForCausalLM, cache: KVCache, num_tokens: int):
        step = torch.zeros(1, num_tokens, dtype=torch.long, device=model.device)
        decoder = model.fused_decoder()

        def run() -> None:
            # The context's keys/values are the cache's zeros: only its length matters to the
            # time, so no prefill is needed.
            cache.truncate(0)
            cache.append(context_len)
            model.decode_logits(step, cache, cache.append(num_tokens), decoder=decoder)

        run()  # warm-up
        return run

    def scratch_cache(model: LlamaForCausalLM, num_tokens: int) -> KVCache:
        return KVCache.from_config(model.config, context_len + num_tokens, dtype=model.dtype, device=model.device)

    target_cache = scratch_cache(target, k_max + 1)
    passes = [make_pass(target, target_cache, k + 1) for k in range(k_max + 1)]  # passes[0]: plain decoding
    draft_model = getattr(proposer, "model", None)
    if draft_model is not None:
        passes.append(make_pass(draft_model, scratch_cache(draft_model, 1), 1))
    ratios: list[list[float]] = [[] for _ in passes]  # [pass][round]: time / the round's plain step
    spent_s = 0.0
    for num_rounds in range(1, repeats + 1):
        seconds = []
        for run in passes:
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        for i, t in enumerate(seconds):
            ratios[i].append(t / seconds[0])
        spent_s += sum(seconds)
        if num_rounds >= min_repeats and spent_s >= time_budget_s:
            break
    relative = [statistics.median(r) for r in ratios]
    draft = relative[-1] if draft_model is not None else NO_MODEL_DRAFT_COST
    return StepCosts(draft=draft, verify=relative[:k_max + 1])


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


# A verification pass reads the target's weights once for all its tokens; each token past the
# first adds this share of a plain step (attention over the context, more rows per weight line).
# 0.08 lies within the 0.04-0.17 measured on the 0.5B/1.5B INT4 pair at 1024 cached tokens, and
# at T=0.7 speeds decoding up as much as measured costs do.
VERIFY_COST_PER_TOKEN = 0.08


def _pass_bytes(model: LlamaForCausalLM, context_len: int) -> int:
    """Bytes one decode pass reads: the weights, and the keys/values of ``context_len`` tokens."""
    return model.decode_weight_bytes() + model.config.kv_bytes_per_token(model.dtype.itemsize) * context_len


def modeled_step_costs(target: LlamaForCausalLM, proposer, k_max: int, context_len: int) -> StepCosts:
    """Step costs from the bytes each pass reads, with no timing: for seeded sampled requests.

    The draft plan decides how many random draws each step takes, so a plan that follows
    measured times can give one seed different tokens from one process to the next. Decoding
    reads every weight and cached key/value once per pass: a draft step costs its bytes over
    the target's, and a verification pass one plain step plus ``VERIFY_COST_PER_TOKEN`` per
    drafted token."""
    draft_model = getattr(proposer, "model", None)
    draft = NO_MODEL_DRAFT_COST
    if draft_model is not None:
        draft = _pass_bytes(draft_model, context_len) / _pass_bytes(target, context_len)
    return StepCosts(draft=draft, verify=[1.0 + VERIFY_COST_PER_TOKEN * k for k in range(k_max + 1)])


@dataclass(frozen=True)
class DraftPlan:
    """One step's drafting: up to ``num_tokens`` tokens (0: a plain decoding step); with
    ``stops_when_unconfident`` the proposer stops after the first token it was unsure of."""

    num_tokens: int
    stops_when_unconfident: bool = False


class _Rate:
    """A success rate from decayed recent counts and from counts over the whole request,
    both starting from a prior worth ``prior_trials`` trials."""

    def __init__(self, prior: float, prior_trials: float, ema: float) -> None:
        self.ema = ema
        self.hits, self.trials = prior * prior_trials, prior_trials
        self.total_hits, self.total_trials = prior * prior_trials, prior_trials

    @property
    def recent(self) -> float:
        return self.hits / self.trials

    @property
    def long_run(self) -> float:
        return self.total_hits / self.total_trials

    def add(self, hits: float, trials: float) -> None:
        self.hits = self.ema * self.hits + hits
        self.trials = self.ema * self.trials + trials
        self.total_hits += hits
        self.total_trials += trials

    def pull(self) -> None:
        """One trial at the long-run rate: a step that tested nothing moves the recent rate
        back toward the request's own."""
        self.hits = self.ema * self.hits + self.long_run
        self.trials = self.ema * self.trials + 1.0

    def set_recent(self, value: float) -> None:
        self.hits, self.trials = value, 1.0


class AdaptiveDraftLength:
    """Chooses each step's :class:`DraftPlan` from recent acceptance and the measured step costs.

    The model: each draft position is one the draft is confident about with probability
    ``share``, and then accepted with probability ``a_conf``, else with ``a_unsure``. Drafting
    through every position, a step with ``k`` drafts emits ``(1 - a^(k+1)) / (1 - a)`` tokens
    (``a = share * a_conf + (1 - share) * a_unsure``) for ``k * draft + verify[k]`` plain-step
    costs. Stopping after the first unsure token trades the tokens past it, which are rarely
    accepted, for the draft steps they cost. The plan with the most tokens per unit of time
    wins; ``k = 0``, plain decoding, whenever speculation would not pay. The split pays because
    confidence predicts acceptance: with the INT4 0.5B drafting for the 1.5B at T=0.7, 91% of
    the positions the draft is sure of (top probability >= 0.8) are accepted, 54% of the rest.

    Without confidence flags (``update(..., is_confident=None)``) every position counts as
    confident and the model is a single per-token acceptance rate.

    Each rate is a ratio of decayed counts, starting from a prior worth ``prior_trials``
    positions. A plain step tests nothing, so it pulls the acceptance rates toward the
    request's long-run ones: a good draft's bad spell ends in a few plain steps, while a poor
    draft's long-run rate keeps it plain, with a ``k = 1`` probe every ``probe_every`` plain
    steps. (With a one-trial prior and no pull, one early rejection can leave a request in
    plain decoding for ~25 steps.)
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
        self.probe_every = probe_every
        self._confident = _Rate(prior, prior_trials, ema)  # acceptance of positions the draft was sure of
        self._unsure = _Rate(prior, prior_trials, ema)  # acceptance of the others
        self._share = _Rate(1.0, prior_trials, ema)  # share of drafted positions the draft was sure of
        self._plain_steps = 0

    @property
    def acceptance(self) -> float:
        """Estimated probability that the draft's next token is accepted."""
        share = self._share.recent
        return share * self._confident.recent + (1 - share) * self._unsure.recent

    @acceptance.setter
    def acceptance(self, value: float) -> None:
        self._confident.set_recent(value)
        self._unsure.set_recent(value)

    def gain(self, k: int, stops_when_unconfident: bool = False) -> float:
        """Expected tokens per unit of plain-decoding time with up to ``k`` drafts."""
        share = self._share.recent
        a_conf, a_unsure = min(self._confident.recent, 0.99), min(self._unsure.recent, 0.99)
        if not stops_when_unconfident:  # every position drafted, each accepted at the mixed rate
            a_conf = a_unsure = share * a_conf + (1 - share) * a_unsure
            share = 1.0
        # Position i is drafted when the draft was sure of every earlier one, and counts when
        # every earlier one was accepted too; a step drafts n < k tokens when the n-th is the
        # first unsure one.
        draft, verify = self.costs.draft, self.costs.verify
        tokens, cost = 1.0, (verify[0] if k == 0 else 0.0)
        for i in range(1, k + 1):
            tokens += (share * a_conf) ** (i - 1) * (share * a_conf + (1 - share) * a_unsure)
            p_drafted = share ** (i - 1) * ((1 - share) if i < k else 1.0)
            cost += p_drafted * (i * draft + verify[i])
        return tokens / cost

    def next_plan(self) -> DraftPlan:
        """The plan for the next step (``is_enabled=False``: always ``k_max`` drafts)."""
        if not self.is_enabled:
            return DraftPlan(self.k_max)
        plans = [DraftPlan(k, stops) for k in range(self.k_max + 1) for stops in (False, True)]
        best = max(plans, key=lambda plan: self.gain(plan.num_tokens, plan.stops_when_unconfident))
        if best.num_tokens == 0:
            self._plain_steps += 1
            if self._plain_steps % self.probe_every == 0:
                return DraftPlan(1)
        return best

    def update(self, num_draft: int, num_accepted: int, is_confident: Sequence[bool] | None = None) -> None:
        """Fold one step into the estimates; ``is_confident`` [num_draft] says which draft
        tokens the draft was sure of (None: all).

        A step tests positions until the first rejection: ``num_accepted`` successes out of
        ``num_accepted + 1`` trials (out of ``num_draft`` when all pass). Counting positions
        after a rejection as failures (``num_accepted / num_draft``) would read a = 0.93 with
        k = 4 as 0.86 and drive ``k`` down. A plain step (``num_draft == 0``) counts as one
        trial at each rate's long-run value."""
        if num_draft == 0:
            self._confident.pull()
            self._unsure.pull()
            return
        flags = list(is_confident) if is_confident is not None else [True] * num_draft
        if len(flags) != num_draft:
            raise ValueError(f"is_confident has {len(flags)} flags for {num_draft} draft tokens")
        num_tested = num_accepted + (num_accepted < num_draft)
        for rate, is_sure in ((self._confident, True), (self._unsure, False)):
            tested = [i for i in range(num_tested) if flags[i] == is_sure]
            if tested:  # a rate decays only when it has news, or a rarely seen class would forget its prior
                rate.add(sum(i < num_accepted for i in tested), len(tested))
        self._share.add(sum(flags), num_draft)
