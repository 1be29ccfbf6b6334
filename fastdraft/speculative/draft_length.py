"""How many tokens each sequence drafts in a step, at the batch size the step runs at.

Speculation pays when drafting ``k`` tokens and verifying ``k + 1`` costs less than the target
steps it saves. At batch 1 a target pass is bound by reading the weights, so verifying five
tokens costs about as much as decoding one; as the batch grows the pass turns compute-bound
and every extra token costs its share. The same drafts that speed up a lone request
would then slow the whole batch down.

:class:`DraftLengthPolicy` weighs both, each step:

* **Costs** (:class:`PassCost`): the seconds of a target pass as a function of the tokens it
  computes, and of one draft round as a function of the sequences drafting. Each is a
  piecewise-linear curve through a few points timed at start-up (:func:`measure_pass_cost`),
  extended past the last point at its last slope, rather than a grid timed over every shape.
* **Gains**: draft position ``r`` of a sequence adds a token with probability ``a^r``, ``a``
  being that sequence's recent acceptance rate.

It adds draft positions best gain first (each sequence's ``r`` after its ``r - 1``) while the
step's expected tokens per second, ``(num_seqs + sum of gains) / (target(n + drafts) + sum
of draft rounds)``, keeps rising, and keeps the best prefix. As the batch grows the marginal
token's cost rises and fewer positions pay, down to ``k = 0`` for everyone: throughput
degrades smoothly, with no batch size at which speculation switches off all at once.

Two costs are not in a round's curve. A separate draft must first compute the tokens it has
not seen (a new request's whole prompt): that catch-up is charged to the step in which the
sequence starts drafting, spread over the steps its remaining tokens will take, since drafting
on later steps reuses it. Such a sequence joins after the others are chosen, with the draft
length that helps the step most, if any does. And speculation must beat plain decoding by
``margin`` (5%): a choice that only breaks even on timed costs loses to the overheads they
leave out (building a draft batch, sampling it) and to timing noise.

On a GPU a plain decode step replays a CUDA graph while a verification runs eagerly, several
times slower at a small model's sizes: the plain step then has a curve of its own
(``plain_cost``), and drafting must beat the graph, not the eager pass.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from fastdraft.engine.sequence import Sequence

# Steps a sequence's remaining tokens are expected to take, per token (a step with drafts
# emits about two): the draft's catch-up is spread over them.
STEPS_PER_REMAINING_TOKEN = 0.5


class PassCost:
    """Seconds of a pass as a piecewise-linear function of its size, through measured
    ``points`` [(size, seconds)]; flat before the first point, at the last slope after the
    last. Times are made non-decreasing in size (a noisy point never makes more work cheaper)."""

    def __init__(self, points: list[tuple[int, float]]) -> None:
        if not points:
            raise ValueError("a pass cost needs at least one measured point")
        points = sorted(points)
        self.sizes = [size for size, _ in points]
        self.seconds = []
        for _, seconds in points:
            self.seconds.append(max(seconds, self.seconds[-1] if self.seconds else 0.0))

    def __call__(self, size: int) -> float:
        if size <= 0:
            return 0.0
        sizes, seconds = self.sizes, self.seconds
        if size <= sizes[0] or len(sizes) == 1:
            return seconds[0] if size <= sizes[0] else seconds[0] * size / sizes[0]
        i = min(bisect.bisect_left(sizes, size), len(sizes) - 1)
        slope = (seconds[i] - seconds[i - 1]) / (sizes[i] - sizes[i - 1])
        return seconds[i - 1] + slope * (size - sizes[i - 1])


FREE = PassCost([(1, 0.0)])  # a proposer without a model: a dictionary lookup


def timed_sizes(max_size: int) -> list[int]:
    """The pass sizes :func:`measure_pass_cost` times: 1, 4, 16 and 64 where below ``max_size``,
    and ``max_size`` itself."""
    return sorted({size for size in (1, 4, 16, 64) if size < max_size} | {max(max_size, 1)})


def measure_pass_cost(time_pass: Callable[[int], float], max_size: int) -> PassCost:
    """A :class:`PassCost` through ``time_pass(size)`` at each of :func:`timed_sizes`."""
    return PassCost([(size, time_pass(size)) for size in timed_sizes(max_size)])


class _Rate:
    """A sequence's recent acceptance rate: decayed counts from a prior worth ``prior_trials``
    positions. A step that drafts nothing pulls it back toward the prior, so that one bad spell
    does not keep a sequence plain for good."""

    def __init__(self, prior: float, prior_trials: float, ema: float) -> None:
        self.prior, self.ema = prior, ema
        self.hits, self.trials = prior * prior_trials, prior_trials

    @property
    def value(self) -> float:
        return self.hits / self.trials

    def add(self, hits: float, trials: float) -> None:
        self.hits = self.ema * self.hits + hits
        self.trials = self.ema * self.trials + trials

    def pull(self) -> None:
        self.add(self.prior * (1 - self.ema), 1 - self.ema)


class _Step:
    """A step's expected tokens and seconds as draft positions are added to it."""

    def __init__(self, policy: "DraftLengthPolicy", num_step_tokens: int, num_seqs: int) -> None:
        self.policy = policy
        self.num_step_tokens = num_step_tokens
        self.is_pure_decode = num_step_tokens == num_seqs  # no other sequence's tokens in the step
        self.tokens = float(num_seqs)
        self.num_draft = 0
        self.num_drafting = [0] * (policy.k_max + 1)  # [r]: sequences drafting at least r tokens
        self.extra_seconds = 0.0  # draft rounds and catch-up

    def copy(self) -> "_Step":
        other = _Step(self.policy, self.num_step_tokens, 0)
        other.is_pure_decode = self.is_pure_decode
        other.tokens, other.num_draft, other.extra_seconds = self.tokens, self.num_draft, self.extra_seconds
        other.num_drafting = list(self.num_drafting)
        return other

    def add(self, r: int, gain: float) -> None:
        """One sequence's draft position ``r`` (its ``r - 1`` already added)."""
        draft_cost = self.policy.draft_cost
        self.extra_seconds += draft_cost(self.num_drafting[r] + 1) - draft_cost(self.num_drafting[r])
        self.num_drafting[r] += 1
        self.num_draft += 1
        self.tokens += gain

    def rate(self) -> float:
        policy = self.policy
        if not self.num_draft and policy.plain_cost is not None and self.is_pure_decode:
            seconds = policy.plain_cost(self.num_step_tokens)  # a plain decode step, replayed from a graph
        else:
            seconds = policy.target_cost(self.num_step_tokens + self.num_draft)
        return self.tokens / (seconds + self.extra_seconds)


class DraftLengthPolicy:
    """Chooses each decoding sequence's draft length from the step's batch, its own acceptance,
    and the measured costs of target and draft passes (see the module's docstring).

    ``is_adaptive=False`` drafts ``k_max`` tokens for every sequence, whatever it costs."""

    def __init__(self, k_max: int, target_cost: PassCost, draft_cost: PassCost, is_adaptive: bool = True,
                 prior: float = 0.7, prior_trials: float = 4.0, ema: float = 0.9, margin: float = 0.05,
                 pending_tokens: Callable[[Sequence], int] = lambda seq: 0,
                 plain_cost: PassCost | None = None) -> None:
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        if not 0.0 < ema < 1.0 or not 0.0 <= prior <= 1.0 or prior_trials <= 0 or margin < 0:
            raise ValueError("need 0 < ema < 1, 0 <= prior <= 1, prior_trials > 0 and margin >= 0")
        self.k_max = k_max
        self.target_cost, self.draft_cost = target_cost, draft_cost
        # A plain decode step that runs another way than verification (a CUDA graph): its own curve.
        self.plain_cost = plain_cost
        self.is_adaptive = is_adaptive
        self.margin = margin
        # Tokens the draft must compute for a sequence before its first draft token.
        self.pending_tokens = pending_tokens
        self.prior, self.prior_trials, self.ema = prior, prior_trials, ema
        self._rates: dict[int, _Rate] = {}

    def acceptance(self, seq: Sequence) -> float:
        """``seq``'s estimated probability that its next draft token is accepted."""
        rate = self._rates.get(seq.seq_id)
        return self.prior if rate is None else rate.value

    def draft_lengths(self, seqs: list[Sequence], num_step_tokens: int) -> list[int]:
        """Draft lengths for ``seqs``, decoding in a step that computes ``num_step_tokens``
        tokens without drafts."""
        if not self.is_adaptive:
            return [self.k_max] * len(seqs)
        alphas = [min(self.acceptance(seq), 0.99) for seq in seqs]
        catch_up = [self._catch_up_seconds(seq) for seq in seqs]
        step = _Step(self, num_step_tokens, len(seqs))
        # Sequences the draft has caught up on: every (sequence, position) by its expected
        # gain, taken in that order; a sequence's position r never comes before its r - 1,
        # since a^r falls with r (ties go to the lower position). The best prefix wins.
        ready = [i for i in range(len(seqs)) if catch_up[i] == 0.0]
        candidates = sorted(((alphas[i] ** r, r, i) for i in ready for r in range(1, self.k_max + 1)),
                            key=lambda c: (-c[0], c[1]))
        best_rate, best_prefix = step.rate() * (1 + self.margin), 0
        for taken, (gain, r, _) in enumerate(candidates, start=1):
            step.add(r, gain)
            if step.rate() > best_rate:
                best_rate, best_prefix = step.rate(), taken
        step = _Step(self, num_step_tokens, len(seqs))
        lengths = [0] * len(seqs)
        for gain, r, i in candidates[:best_prefix]:
            step.add(r, gain)
            lengths[i] += 1
        # The others pay their catch-up before their first draft: each joins, most likely to
        # be accepted first, with the draft length that helps the step most, if any does.
        for i in sorted(set(range(len(seqs))) - set(ready), key=lambda i: -alphas[i]):
            best_k = 0
            for k in range(1, self.k_max + 1):
                trial = step.copy()
                trial.extra_seconds += catch_up[i]
                for r in range(1, k + 1):
                    trial.add(r, alphas[i] ** r)
                if trial.rate() > best_rate:
                    best_rate, best_k = trial.rate(), k
            if best_k:
                step.extra_seconds += catch_up[i]
                for r in range(1, best_k + 1):
                    step.add(r, alphas[i] ** r)
                lengths[i] = best_k
        return lengths

    def _catch_up_seconds(self, seq: Sequence) -> float:
        """The draft's catch-up on ``seq`` (beyond the one token a round feeds), per remaining step."""
        pending = self.pending_tokens(seq) - 1
        if pending <= 0:
            return 0.0
        remaining = seq.params.max_new_tokens - seq.num_output_tokens
        return self.draft_cost(pending) / max(remaining * STEPS_PER_REMAINING_TOKEN, 1.0)

    def update(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        """Fold one step of ``seq`` in. A step tests positions up to the first rejection:
        ``num_accepted`` successes of ``num_accepted + 1`` trials (of ``num_draft`` when all
        pass); a plain step tests nothing and pulls the rate toward the prior."""
        rate = self._rates.get(seq.seq_id)
        if rate is None:
            rate = self._rates[seq.seq_id] = _Rate(self.prior, self.prior_trials, self.ema)
        if num_draft == 0:
            rate.pull()
        else:
            rate.add(num_accepted, num_accepted + (num_accepted < num_draft))

    def release(self, seq: Sequence) -> None:
        self._rates.pop(seq.seq_id, None)
