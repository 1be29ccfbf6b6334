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
from fastdraft.layers.sampler import _search_cdf, batched_probs, greedy_ids, keyed_uniforms, reference_sample_from_probs
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


def _check_batch(draft_token_ids: torch.Tensor, cu_num_draft_tokens: list[int], target_logits: torch.Tensor,
                 num_reqs: int) -> None:
    if len(cu_num_draft_tokens) != num_reqs + 1:
        raise ValueError("need num_reqs + 1 offsets of draft tokens")
    num_draft_tokens = cu_num_draft_tokens[-1]
    if draft_token_ids.shape[0] != num_draft_tokens or target_logits.shape[0] != num_draft_tokens + num_reqs:
        raise ValueError(f"{num_reqs} requests with {num_draft_tokens} draft tokens need {num_draft_tokens} draft ids "
                         f"and {num_draft_tokens + num_reqs} target rows, got {draft_token_ids.shape[0]} and "
                         f"{target_logits.shape[0]}")


def _target_rows(cu_num_draft_tokens: list[int], requests: list[int]) -> list[int]:
    """The rows of ``requests`` in a batch's target logits (request ``i``'s ``k_i + 1`` rows start
    at ``cu_num_draft_tokens[i] + i``), in order."""
    return [r for i in requests for r in range(cu_num_draft_tokens[i] + i, cu_num_draft_tokens[i + 1] + i + 1)]


def _verify_greedy_requests(draft_list: list[int], cu_num_draft_tokens: list[int], target_logits: torch.Tensor,
                            requests: list[int]) -> dict[int, list[int]]:
    """The greedy ``requests`` of a batch verified by one argmax over all their rows: each one's
    accepted draft tokens and the target's next token, by request index."""
    rows = _target_rows(cu_num_draft_tokens, requests)
    target_ids = greedy_ids(target_logits[rows]).tolist() if rows else []  # [num_greedy_rows]
    tokens, offset = {}, 0
    for i in requests:
        start, end = cu_num_draft_tokens[i], cu_num_draft_tokens[i + 1]
        tokens[i] = _accept_greedy(draft_list[start:end], target_ids[offset:offset + end - start + 1])
        offset += end - start + 1
    return tokens


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
    if len(generators) != num_reqs:
        raise ValueError("need one SamplingParams and one generator per request")
    _check_batch(draft_token_ids, cu_num_draft_tokens, target_logits, num_reqs)
    is_greedy = [p.is_greedy for p in params]
    if draft_probs is None and not all(is_greedy[i] or cu_num_draft_tokens[i] == cu_num_draft_tokens[i + 1]
                                       for i in range(num_reqs)):
        raise ValueError("sampled requests with draft tokens need draft_probs")

    draft_list = draft_token_ids.tolist()
    greedy_tokens = _verify_greedy_requests(draft_list, cu_num_draft_tokens, target_logits,
                                            [i for i in range(num_reqs) if is_greedy[i]])
    sampled_rows = _target_rows(cu_num_draft_tokens, [i for i in range(num_reqs) if not is_greedy[i]])
    target_probs = None
    if sampled_rows:  # [num_sampled_rows, vocab_size], each row with its request's parameters
        row_params = [params[i] for i in range(num_reqs) if not is_greedy[i]
                      for _ in range(cu_num_draft_tokens[i + 1] - cu_num_draft_tokens[i] + 1)]
        target_probs = batched_probs(target_logits[sampled_rows], row_params)
    outputs, accepted, drafted = [], [], []
    sampled_start = 0
    for i in range(num_reqs):
        start, end = cu_num_draft_tokens[i], cu_num_draft_tokens[i + 1]
        k = end - start
        if is_greedy[i]:
            tokens = greedy_tokens[i]
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


# Keyed verification draws (see :func:`rejection_sample_keyed`) live at offsets past any plain
# sampling draw's (a request's output count), KEYED_DRAWS_PER_STEP of them per draw index: the
# acceptance uniforms of positions 0..k-1, and the last one for the recovered or bonus token.
KEYED_VERIFY_OFFSET = 1 << 40
KEYED_DRAWS_PER_STEP = 16


def _keyed_offsets(draw_index: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    return KEYED_VERIFY_OFFSET + draw_index * KEYED_DRAWS_PER_STEP + sub


def rejection_sample_keyed(draft_token_ids: torch.Tensor, cu_num_draft_tokens: list[int],
                           target_logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor,
                           draft_probs: torch.Tensor | None = None,
                           draft_vocab_ids: torch.Tensor | None = None) -> BatchVerificationResult:
    """:func:`rejection_sample_batch` with every request's uniforms from its keyed stream
    (``keys`` [num_reqs, 2] int64: seed, draw index; ``layers/sampler.py::keyed_uniforms``) and
    every sampled request verified at once: one gather of the draft tokens' target and draft
    probabilities, the accepted prefixes by one segmented minimum, one batched draw of the
    recovered or bonus tokens. The GPU's way (no call per request); the same rule as
    :func:`verify_sampled`, so every emitted token follows the target's distribution."""
    num_reqs = len(params)
    if keys.shape != (num_reqs, 2):
        raise ValueError("need one SamplingParams and one key (seed, draw index) per request")
    _check_batch(draft_token_ids, cu_num_draft_tokens, target_logits, num_reqs)
    num_drafts = [cu_num_draft_tokens[i + 1] - cu_num_draft_tokens[i] for i in range(num_reqs)]
    if max(num_drafts, default=0) >= KEYED_DRAWS_PER_STEP:
        raise ValueError(f"keyed verification takes fewer than {KEYED_DRAWS_PER_STEP} draft tokens a request")
    sampled = [i for i in range(num_reqs) if not params[i].is_greedy]
    greedy = [i for i in range(num_reqs) if params[i].is_greedy]
    if draft_probs is None and any(num_drafts[i] for i in sampled):
        raise ValueError("sampled requests with draft tokens need draft_probs")
    draft_list = draft_token_ids.tolist()
    greedy_tokens = _verify_greedy_requests(draft_list, cu_num_draft_tokens, target_logits, greedy)
    outputs = [greedy_tokens.get(i, []) for i in range(num_reqs)]
    accepted = [len(tokens) - 1 if i in greedy_tokens else 0 for i, tokens in enumerate(outputs)]
    if not sampled:
        return BatchVerificationResult(outputs, accepted, num_drafts)
    device = target_logits.device
    # Host-side layout of the sampled requests: their target rows, and one entry per draft token.
    target_rows, row_params, first_row = [], [], []
    token_req, token_pos, token_draft_row = [], [], []
    for j, i in enumerate(sampled):
        first_row.append(len(target_rows))
        start = cu_num_draft_tokens[i] + i
        target_rows.extend(range(start, start + num_drafts[i] + 1))
        row_params.extend([params[i]] * (num_drafts[i] + 1))
        token_req.extend([j] * num_drafts[i])
        token_pos.extend(range(num_drafts[i]))
        token_draft_row.extend(range(cu_num_draft_tokens[i], cu_num_draft_tokens[i + 1]))
    layout = torch.tensor([first_row, [num_drafts[i] for i in sampled], sampled], dtype=torch.long).to(device)
    first, k, req_ids = layout[0], layout[1], layout[2]  # [num_sampled] each
    target_probs = batched_probs(target_logits[target_rows], row_params)  # [num_sampled_rows, vocab_size]
    vocab_size = target_probs.shape[1]
    seeds, draw_index = keys[req_ids, 0].to(device), keys[req_ids, 1].to(device)  # [num_sampled]
    num_accepted = k.clone()
    if token_req:
        tokens = torch.tensor([token_req, token_pos, token_draft_row], dtype=torch.long).to(device)
        req, pos, draft_row = tokens[0], tokens[1], tokens[2]  # [num_draft_tokens of sampled requests]
        ids = draft_token_ids.to(device)[draft_row]
        target_p = target_probs[first[req] + pos, ids]
        cols = ids if draft_vocab_ids is None else torch.searchsorted(draft_vocab_ids, ids)
        draft_p = draft_probs[draft_row, cols]
        uniform = keyed_uniforms(seeds[req], _keyed_offsets(draw_index[req], pos))
        rejected_at = torch.where(uniform * draft_p < target_p, k[req], pos)  # the request's k where accepted
        num_accepted = num_accepted.scatter_reduce(0, req, rejected_at, reduce="amin")
    # The recovered token's residual at the first rejection, or the bonus row after k accepted.
    dist = target_probs[first + num_accepted]  # [num_sampled, vocab_size]
    is_rejected = num_accepted < k
    if bool(is_rejected.any()):
        # A request's row at its first rejection (any valid row where it rejected none).
        draft_rows = torch.tensor(cu_num_draft_tokens[:-1], dtype=torch.long).to(device)[req_ids] \
            + num_accepted.clamp(max=(k - 1).clamp(min=0))
        draft_rows = draft_rows.clamp(max=draft_probs.shape[0] - 1)
        draft_dense = draft_probs[draft_rows].float()
        if draft_vocab_ids is not None:
            draft_dense = torch.zeros(len(sampled), vocab_size, dtype=draft_dense.dtype,
                                      device=device).index_copy_(1, draft_vocab_ids, draft_dense)
        residual = (dist - draft_dense).clamp(min=0)
        # No mass left only if the distributions are equal, where rejection has probability 0.
        use_residual = is_rejected & (residual.sum(dim=-1) > 0)
        dist = torch.where(use_residual[:, None], residual, dist)
    extra_uniform = keyed_uniforms(seeds, _keyed_offsets(draw_index, torch.full_like(draw_index,
                                                                                      KEYED_DRAWS_PER_STEP - 1)))
    extra = _search_cdf(dist, extra_uniform.unsqueeze(1))  # [num_sampled]
    accepted_list, extra_list = num_accepted.tolist(), extra.tolist()
    for j, i in enumerate(sampled):
        n = accepted_list[j]
        outputs[i] = draft_list[cu_num_draft_tokens[i]:cu_num_draft_tokens[i] + n] + [extra_list[j]]
        accepted[i] = n
    return BatchVerificationResult(outputs, accepted, num_drafts)


def reference_rejection_sample_keyed(draft_token_ids: torch.Tensor, cu_num_draft_tokens: list[int],
                                     target_logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor,
                                     draft_probs: torch.Tensor | None = None,
                                     draft_vocab_ids: torch.Tensor | None = None) -> BatchVerificationResult:
    """:func:`rejection_sample_keyed` one request at a time, as :func:`verify_sampled` runs:
    its twin, with the same keyed uniforms."""
    outputs, accepted, drafted = [], [], []
    for i, p in enumerate(params):
        start, end = cu_num_draft_tokens[i], cu_num_draft_tokens[i + 1]
        k = end - start
        rows = target_logits[start + i:end + i + 1]  # [k + 1, vocab_size]
        if p.is_greedy:
            tokens = _accept_greedy(draft_token_ids[start:end].tolist(), greedy_ids(rows).tolist())
            n = len(tokens) - 1
        else:
            probs = batched_probs(rows, [p] * (k + 1))
            seed, draw_index = keys[i, 0], keys[i, 1]
            positions = torch.arange(k, device=keys.device)
            uniform = keyed_uniforms(seed.expand(k), _keyed_offsets(draw_index.expand(k), positions))
            n = _num_accepted(draft_token_ids[start:end], draft_probs[start:end] if k else probs[:0], probs,
                              uniform, draft_vocab_ids if k else None)
            dist = probs[n]
            if n < k:
                residual = (probs[n] - draft_probs[start + n]).clamp(min=0) if draft_vocab_ids is None else \
                    probs[n].index_add(0, draft_vocab_ids, draft_probs[start + n], alpha=-1).clamp(min=0)
                dist = residual if bool(residual.sum() > 0) else probs[n]
            extra_u = keyed_uniforms(seed.view(1), _keyed_offsets(draw_index.view(1),
                                                                  torch.tensor([KEYED_DRAWS_PER_STEP - 1],
                                                                               device=keys.device)))
            tokens = draft_token_ids[start:start + n].tolist() + [int(_search_cdf(dist[None], extra_u[:, None]))]
        outputs.append(tokens)
        accepted.append(n)
        drafted.append(k)
    return BatchVerificationResult(outputs, accepted, drafted)
