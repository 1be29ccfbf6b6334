"""Verification of draft tokens: greedy matching and exact rejection sampling.

Vocabulary (as in vLLM): of the ``k`` draft tokens, a prefix is *accepted*; at the first
rejection the target supplies a *recovered* token, drawn from the residual distribution
``norm(max(0, target - draft))``; if all ``k`` are accepted, the target's distribution after
the last one supplies a *bonus* token. Either way one step yields ``num_accepted + 1`` tokens.

With rejection sampling (Leviathan et al., 2023; Chen et al., 2023) every emitted token is
distributed exactly as the target's sampling distribution, whatever the draft proposes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.layers.sampler import batched_probs, greedy_ids, reference_sample_from_probs
from fastdraft.sampling_params import SamplingParams


@dataclass
class VerificationResult:
    """Outcome of verifying one proposal."""

    output_token_ids: list[int]  # accepted draft tokens, then one recovered or bonus token
    num_accepted: int
    num_draft: int

    @property
    def is_bonus(self) -> bool:
        """True when every draft token was accepted, so the last token is the bonus token."""
        return self.num_accepted == self.num_draft


def verify_greedy(draft_token_ids: torch.Tensor, target_logits: torch.Tensor) -> VerificationResult:
    """Accept draft tokens while they equal the target's argmax.

    draft_token_ids: [k]; target_logits: [k + 1, vocab_size] (row i scores the token after
    the i-th input of the verification pass).
    """
    draft_ids = draft_token_ids.tolist()
    output = _accept_greedy(draft_ids, greedy_ids(target_logits).tolist())
    return VerificationResult(output, len(output) - 1, len(draft_ids))


def _accept_greedy(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """The draft tokens while they equal the target's argmax ids (``len(draft_ids) + 1`` of
    them), then the target's own next token."""
    num_accepted = 0
    while num_accepted < len(draft_ids) and draft_ids[num_accepted] == target_ids[num_accepted]:
        num_accepted += 1
    return draft_ids[:num_accepted] + [target_ids[num_accepted]]


def verify_sampled(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   generator: torch.Generator | None,
                   draft_vocab_ids: torch.Tensor | None = None) -> VerificationResult:
    """Rejection-sample ``k`` draft tokens against the target.

    draft_token_ids: [k]; draft_probs: [k, vocab_size], the distributions the draft tokens
    were drawn from; target_probs: [k + 1, vocab_size], the target's sampling distributions.
    draft_vocab_ids: [draft_vocab] sorted vocabulary ids when draft_probs is [k, draft_vocab],
    over those tokens only (every other token has draft probability 0).

    On the CPU the C++ ``rejection_sample`` runs it in one call (about 25 torch calls in its
    twin :func:`reference_verify_sampled`, each meeting cold caches in a decode loop), with the
    same uniforms and the same rule.
    """
    return _verify_sampled(draft_token_ids, draft_probs, target_probs, generator, draft_vocab_ids, False)


def reference_verify_sampled(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                             generator: torch.Generator | None,
                             draft_vocab_ids: torch.Tensor | None = None) -> VerificationResult:
    """:func:`verify_sampled` in torch ops (any device)."""
    return _verify_sampled(draft_token_ids, draft_probs, target_probs, generator, draft_vocab_ids, True)


def _verify_sampled(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    generator: torch.Generator | None, draft_vocab_ids: torch.Tensor | None,
                    is_reference: bool) -> VerificationResult:
    num_draft = draft_token_ids.shape[0]
    device = target_probs.device
    # [k]; none drawn for no draft tokens, so such a step consumes one uniform, as plain sampling does
    accept_uniform = torch.rand(num_draft, generator=generator, device=device) if num_draft else \
        torch.empty(0, device=device)
    is_kernel = (not is_reference and device.type == "cpu" and target_probs.dtype == torch.float32
                 and draft_probs.dtype == torch.float32)
    ext = load_cpu_kernels() if is_kernel else None
    if ext is not None:
        extra_uniform = torch.rand(1, generator=generator, dtype=torch.float64)  # as sample_from_probs draws
        num_accepted, extra = ext.rejection_sample(draft_token_ids, draft_probs, draft_vocab_ids, target_probs,
                                                   accept_uniform, extra_uniform)
    else:
        num_accepted = _num_accepted(draft_token_ids, draft_probs, target_probs, accept_uniform, draft_vocab_ids)
        if num_accepted < num_draft:
            if draft_vocab_ids is None:
                residual = (target_probs[num_accepted] - draft_probs[num_accepted]).clamp(min=0)  # [vocab_size]
            else:
                residual = target_probs[num_accepted].index_add(0, draft_vocab_ids, draft_probs[num_accepted],
                                                                alpha=-1).clamp(min=0)
            # No mass left only if the distributions are equal, where rejection has probability 0.
            # The draw scales by the row's sum, so the residual needs no normalizing.
            dist = residual if bool(residual.sum() > 0) else target_probs[num_accepted]
        else:
            dist = target_probs[num_draft]
        extra = int(reference_sample_from_probs(dist, generator))
    output = draft_token_ids[:num_accepted].tolist() + [extra]
    return VerificationResult(output, num_accepted, num_draft)


def _num_accepted(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                  accept_uniform: torch.Tensor, draft_vocab_ids: torch.Tensor | None) -> int:
    """The length of the accepted prefix: token i is accepted iff u_i < target_i / draft_i."""
    num_draft = draft_token_ids.shape[0]
    if not num_draft:
        return 0
    idx = torch.arange(num_draft, device=target_probs.device)
    target_p = target_probs[idx, draft_token_ids]  # [k]
    draft_cols = draft_token_ids if draft_vocab_ids is None else torch.searchsorted(draft_vocab_ids, draft_token_ids)
    draft_p = draft_probs[idx, draft_cols]  # [k]
    # accept iff u < target/draft, written without dividing by a zero draft probability
    is_accepted = accept_uniform * draft_p < target_p
    return int(is_accepted.int().cumprod(dim=0).sum())


@dataclass
class BatchVerificationResult:
    """Outcome of one verification step for every request of a batch, in request order."""

    output_token_ids: list[list[int]]  # per request: accepted draft tokens, then one recovered or bonus token
    num_accepted: list[int]
    num_draft: list[int]


def rejection_sample_batch(draft_token_ids: torch.Tensor, cu_num_draft_tokens: list[int],
                           target_logits: torch.Tensor, params: list[SamplingParams],
                           generators: list[torch.Generator | None],
                           draft_probs: torch.Tensor | None = None,
                           draft_vocab_ids: torch.Tensor | None = None) -> BatchVerificationResult:
    """Verify the drafts of a whole batch, flat as the engine lays it out (vLLM's shape).

    draft_token_ids: [num_draft_tokens], every request's draft tokens back to back; request
    ``i`` has ``k_i = cu_num_draft_tokens[i + 1] - cu_num_draft_tokens[i]`` of them (``k_i``
    may be 0). target_logits: [num_draft_tokens + num_reqs, vocab_size], request ``i``'s
    ``k_i + 1`` rows starting at ``cu_num_draft_tokens[i] + i``. draft_probs:
    [num_draft_tokens, vocab_size], the distributions the draft tokens were drawn from (rows
    of greedy requests are not read; None when every request is greedy), or
    [num_draft_tokens, draft_vocab] over the sorted ids ``draft_vocab_ids`` [draft_vocab] when
    the draft's head covers part of the vocabulary.

    Greedy requests (``params[i].is_greedy``) accept while the draft equals the target's
    argmax, all in one argmax over their rows. Sampled requests are rejection-sampled with
    their own parameters and their own generator, drawing exactly what :func:`verify_sampled`
    draws for the request alone: a request's tokens do not depend on the rest of the batch.
    """
    num_reqs = len(params)
    if len(cu_num_draft_tokens) != num_reqs + 1 or len(generators) != num_reqs:
        raise ValueError("need one SamplingParams and one generator per request, and num_reqs + 1 offsets")
    num_draft_tokens = cu_num_draft_tokens[-1]
    if draft_token_ids.shape[0] != num_draft_tokens or target_logits.shape[0] != num_draft_tokens + num_reqs:
        raise ValueError(f"{num_reqs} requests with {num_draft_tokens} draft tokens need {num_draft_tokens} draft ids "
                         f"and {num_draft_tokens + num_reqs} target rows, got {draft_token_ids.shape[0]} and "
                         f"{target_logits.shape[0]}")
    is_greedy = [p.is_greedy for p in params]
    if draft_probs is None and not all(is_greedy[i] or cu_num_draft_tokens[i] == cu_num_draft_tokens[i + 1]
                                       for i in range(num_reqs)):
        raise ValueError("sampled requests with draft tokens need draft_probs")

    def rows_of(is_greedy_wanted: bool) -> list[int]:  # the target rows of those requests, in order
        return [r for i in range(num_reqs) if is_greedy[i] == is_greedy_wanted
                for r in range(cu_num_draft_tokens[i] + i, cu_num_draft_tokens[i + 1] + i + 1)]

    greedy_rows, sampled_rows = rows_of(True), rows_of(False)
    target_ids = greedy_ids(target_logits[greedy_rows]).tolist() if greedy_rows else []  # [num_greedy_rows]
    target_probs = None
    if sampled_rows:  # [num_sampled_rows, vocab_size], each row with its request's parameters
        row_params = [params[i] for i in range(num_reqs) if not is_greedy[i]
                      for _ in range(cu_num_draft_tokens[i + 1] - cu_num_draft_tokens[i] + 1)]
        target_probs = batched_probs(target_logits[sampled_rows], row_params)
    draft_list = draft_token_ids.tolist()
    outputs, accepted, drafted = [], [], []
    greedy_start = sampled_start = 0
    for i in range(num_reqs):
        start, end = cu_num_draft_tokens[i], cu_num_draft_tokens[i + 1]
        k = end - start
        if is_greedy[i]:
            tokens = _accept_greedy(draft_list[start:end], target_ids[greedy_start:greedy_start + k + 1])
            greedy_start += k + 1
            n = len(tokens) - 1
        else:
            probs = target_probs[sampled_start:sampled_start + k + 1]  # [k + 1, vocab_size]
            sampled_start += k + 1
            result = verify_sampled(draft_token_ids[start:end], draft_probs[start:end] if k else
                                    probs.new_zeros(0, probs.shape[1]), probs, generators[i],
                                    draft_vocab_ids if k else None)
            n, tokens = result.num_accepted, result.output_token_ids
        outputs.append(tokens)
        accepted.append(n)
        drafted.append(k)
    return BatchVerificationResult(outputs, accepted, drafted)
