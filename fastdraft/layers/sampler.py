"""Turning logits into a token: temperature, top-k, top-p, greedy.

``logits_to_probs`` returns the exact distribution a token is drawn from, so speculative
decoding can reuse it for rejection sampling.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.sampling_params import SamplingParams


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A request's own random stream: seeded, or from fresh entropy without a seed."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (T. Mueller's), in int64 ops that never overflow:
    every product is of a 32-bit value and a 27-bit constant."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def keyed_uniforms(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, a function of the row's ``seeds`` and ``offsets``
    (int64 [rows], non-negative) alone: a counter-based stream, so a request's draw at one
    offset never depends on what else is drawn in the step, and all rows take a few launches
    on any device, with no generator per request. The float64 is built from two hashes of one
    32-bit counter (so about 2^32 distinct values)."""
    key = _hash32(_hash32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32))
    # Each offset hashed before it meets the key, so that (seed, offset) pairs collide only by chance.
    counter = _hash32(key ^ _hash32((offsets & _MASK32) ^ _hash32((offsets >> 32) ^ 0x2545F491)))
    high = _hash32(counter ^ 0x68E31DA4) >> 5  # 27 bits
    low = _hash32(counter ^ 0x3B5297A4) >> 6  # 26 bits
    return ((high << 26) | low).double() / float(1 << 53)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab_size] fp32 logits -> probabilities after temperature, top-k and top-p."""
    if params.is_greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    rows = logits.reshape(-1, logits.shape[-1])  # [rows, vocab_size]
    return batched_probs(rows, [params] * rows.shape[0]).view(logits.shape)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit, [..., vocab_size] -> [...] int64: ``argmax``,
    the first index on ties and at a NaN, as ``torch.argmax`` gives.

    On the CPU, ``torch.argmax`` over a 152k-token fp32 row is far slower than the
    C++ ``argmax_rows`` (or numpy's argmax without the extension), and in a decode loop, where
    the weight stream has evicted the interpreter's working set, each Python-level call costs
    about as much as the argmax itself: hence one call."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return logits.argmax(dim=-1)
    ext = load_cpu_kernels()
    if ext is not None:
        return ext.argmax_rows(logits)
    flat = logits.reshape(-1, logits.shape[-1]).numpy()  # [rows, vocab_size], a view
    return torch.from_numpy(np.argmax(flat, axis=-1)).view(logits.shape[:-1])


_CDF_BLOCK = 128  # tokens per block of the two-level search


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``probs`` [..., vocab_size] -> ids [...].

    Inverse-CDF sampling with one uniform per row, one pass of sums and a search: exact, and
    much cheaper than ``torch.multinomial`` over a 152k vocabulary. Sums are float64 so
    rounding cannot move mass between tokens, and a zero-probability token is never drawn: its
    CDF entry equals its predecessor's, which the search finds first.

    On the CPU the C++ ``sample_rows`` draws, in one call; its twin
    :func:`reference_sample_from_probs` (every other device) takes 14 torch calls, each of
    which meets cold caches inside a decode loop."""
    return _draw(probs, generator, is_reference=False)


def reference_sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """:func:`sample_from_probs` in torch ops: the same uniforms and the same rule."""
    return _draw(probs, generator, is_reference=True)


def _draw(probs: torch.Tensor, generator: torch.Generator | None, is_reference: bool) -> torch.Tensor:
    flat = probs.reshape(-1, probs.shape[-1])  # [rows, vocab_size]
    uniform = torch.rand(flat.shape[0], 1, generator=generator, device=flat.device, dtype=torch.float64)
    is_kernel = not is_reference and flat.device.type == "cpu" and flat.dtype == torch.float32
    ext = load_cpu_kernels() if is_kernel else None
    ids = _search_cdf(flat, uniform) if ext is None else ext.sample_rows(flat, uniform)  # [rows]
    return ids.view(probs.shape[:-1])


def _search_cdf(flat: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The first token of each row of ``flat`` [rows, vocab_size] whose float64 CDF passes
    ``uniform`` [rows, 1] times the row's total -> ids [rows]. Large vocabularies are searched
    in two levels (blocks of 128 tokens, then within the chosen block), so only block sums and
    one block are accumulated in float64, never a float64 copy of the whole row."""
    num_rows, vocab_size = flat.shape
    if vocab_size < 64 * _CDF_BLOCK:
        cdf = flat.double().cumsum(dim=-1)  # [rows, vocab_size]
        return torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(max=vocab_size - 1)[:, 0]
    if vocab_size % _CDF_BLOCK:
        flat = F.pad(flat, (0, _CDF_BLOCK - vocab_size % _CDF_BLOCK))
    blocks = flat.view(num_rows, -1, _CDF_BLOCK)  # [rows, num_blocks, block]
    num_blocks = blocks.shape[1]
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [rows, num_blocks]
    point = uniform * block_cdf[:, -1:]  # [rows, 1]
    # The block holding the point (a zero-mass block repeats its predecessor's CDF entry, so
    # it is never found), and the mass before it: block_cdf[b - 1] <= point, so the rest >= 0.
    block_ids = torch.searchsorted(block_cdf, point, right=True).clamp_(max=num_blocks - 1)  # [rows, 1]
    before = torch.where(block_ids > 0, block_cdf.gather(1, (block_ids - 1).clamp(min=0)), 0.0)
    rows = torch.arange(num_rows, device=flat.device)
    chosen = blocks[rows, block_ids[:, 0]]  # [rows, block]
    cdf = chosen.double().cumsum(dim=-1)  # [rows, block]
    offsets = torch.searchsorted(cdf, point - before, right=True)  # [rows, 1]
    # The block's sequential sum may round below its block_cdf increment: never step past the
    # block's last token of nonzero probability.
    last_nonzero = _CDF_BLOCK - 1 - (chosen > 0).flip(-1).int().argmax(dim=-1, keepdim=True)
    return (block_ids * _CDF_BLOCK + torch.minimum(offsets, last_nonzero))[:, 0]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax or a seeded draw from the processed distribution: [..., vocab] -> ids [...]."""
    if params.is_greedy:
        return greedy_ids(logits)
    return sample_from_probs(logits_to_probs(logits, params), generator)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None] | None = None,
                 keys: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` [num_rows, vocab_size], row ``i`` with its own
    ``params[i]`` and ``generators[i]`` -> ids [num_rows].

    Greedy rows take one argmax call; sampled rows are processed together (temperature, top-k
    and top-p per row) and drawn in one inverse-CDF call, each with a uniform from its own
    generator. A row gets exactly the token :func:`sample` gives it alone, so a seeded request
    draws the same tokens whatever else runs.

    ``keys`` [num_rows, 2] int64 (seed, offset) instead of generators draws every row's uniform
    from :func:`keyed_uniforms` in one batch of launches (the GPU's way: no call per request)."""
    num_rows = logits.shape[0]
    if (generators is None) == (keys is None):
        raise ValueError("give generators or keys, one of the two")
    num_sources = len(generators) if generators is not None else keys.shape[0]
    if len(params) != num_rows or num_sources != num_rows:
        raise ValueError(f"need one SamplingParams and one generator or key per row, got {len(params)} and "
                         f"{num_sources} for {num_rows} rows")
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    if len(greedy_rows) == num_rows:  # all greedy, the common case: one argmax, no scatter
        return greedy_ids(logits.float().contiguous())
    ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if greedy_rows:
        ids[greedy_rows] = greedy_ids(logits[greedy_rows].float().contiguous())
    if sampled_rows:
        rows_params = [params[i] for i in sampled_rows]
        probs = batched_probs(logits[sampled_rows], rows_params)  # [num_sampled, vocab_size]
        if keys is not None:
            rows_keys = keys if len(sampled_rows) == num_rows else keys[sampled_rows]
            uniform = keyed_uniforms(rows_keys[:, 0], rows_keys[:, 1]).unsqueeze(1)  # [num_sampled, 1]
        else:
            uniform = torch.cat([torch.rand(1, generator=generators[i], device=logits.device, dtype=torch.float64)
                                 for i in sampled_rows]).unsqueeze(1)  # [num_sampled, 1]
        ext = load_cpu_kernels() if probs.device.type == "cpu" else None
        ids[sampled_rows] = _search_cdf(probs, uniform) if ext is None else ext.sample_rows(probs, uniform)
    return ids


def batched_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """:func:`logits_to_probs` for rows [num_rows, vocab_size] with per-row parameters, each row
    computed as it would be alone."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)  # [rows, 1]
    logits = logits.float() / temperature
    vocab_size = logits.shape[-1]
    top_k = [p.top_k if p.top_k and p.top_k < vocab_size else 0 for p in params]
    if any(top_k):
        values = torch.topk(logits, max(top_k), dim=-1).values  # [rows, max_k]
        kth = values.gather(1, (torch.tensor(top_k, device=device) - 1).clamp(min=0).unsqueeze(1))  # [rows, 1]
        kth = torch.where(torch.tensor(top_k, device=device).unsqueeze(1) > 0, kth, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:
        rows = [i for i, p in enumerate(top_p) if p < 1.0]
        limit = torch.tensor([top_p[i] for i in rows], device=device).unsqueeze(1)  # [rows, 1]
        nucleus = _nucleus(probs[rows], limit)
        # Each row's total on its own: a sum over several rows is reduced in another order.
        totals = torch.stack([row.sum(dim=-1, keepdim=True) for row in nucleus])  # [rows, 1]
        probs[rows] = nucleus / totals
    return probs


# Top-p looks for the nucleus among each row's most probable tokens first: a top-k of 256
# over a 152k vocabulary is one selection pass, where a full sort orders every token.
_NUCLEUS_CANDIDATES = 256


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab_size] with each row's tokens outside its nucleus zeroed (not
    renormalised): a token is dropped when the mass of the tokens ranked before it already
    reaches the row's ``top_p`` [rows, 1]; the top token always stays."""
    vocab_size = probs.shape[-1]
    out = torch.zeros_like(probs)
    num_candidates = min(_NUCLEUS_CANDIDATES, vocab_size)
    values, ids = torch.topk(probs, num_candidates, dim=-1)  # [rows, candidates], descending
    is_dropped = (values.cumsum(dim=-1) - values) >= top_p
    # The nucleus ends among the candidates when the last one is dropped (or there are no others).
    is_found = is_dropped[:, -1] | (num_candidates == vocab_size)
    out.scatter_(-1, ids, values.masked_fill(is_dropped, 0.0))
    rest = (~is_found).nonzero()[:, 0]
    if rest.numel():  # a flat distribution: sort the whole row
        sorted_probs, sorted_ids = torch.sort(probs[rest], dim=-1, descending=True)
        is_dropped = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[rest]
        out[rest] = torch.zeros_like(sorted_probs).scatter_(-1, sorted_ids, sorted_probs.masked_fill(is_dropped, 0.0))
    return out


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                    params: SamplingParams) -> torch.Tensor:
    """vLLM's penalties on one row of logits [vocab]: repetition over prompt and output tokens
    (positive logits divided, negative multiplied), then presence and frequency over the output
    tokens. Returns ``logits`` itself when no penalty is set."""
    if params.repetition_penalty == 1.0 and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0:
        return logits
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        # A tensor, not a Python float: CUDA multiplies by a scalar's reciprocal instead of
        # dividing, and the batched apply_extras divides by a tensor on every device.
        penalty = torch.tensor(params.repetition_penalty, dtype=logits.dtype, device=logits.device)
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if output_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        ids, counts = torch.tensor(output_ids, device=logits.device).unique(return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    return logits


def _padded(rows: list[list[int]], pad: int, device: torch.device, dtype=torch.long) -> torch.Tensor:
    """Ragged rows as one [len(rows), longest] tensor padded with ``pad`` (one copy to ``device``)."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=dtype).to(device, non_blocking=True)


def apply_extras(logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                 output_ids: list[list[int]], eos_token_ids: list[int]) -> torch.Tensor:
    """The engine's extras on rows [num_rows, vocab_size] at once, row ``i`` with ``params[i]``
    and its token history: repetition, presence and frequency penalties, ``logit_bias``, then
    EOS masked while a row is short of its ``min_tokens``. A copy, equal bit for bit to
    :func:`apply_penalties`, ``index_add`` of the bias and ``index_fill`` of the EOS ids applied
    row by row (its twin); the histories go to the device as padded tensors, one copy each."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    out = logits.clone()
    if not num_rows:
        return out

    def column(values: list[float]) -> torch.Tensor:  # [num_rows, 1] in the logits' dtype
        return torch.tensor(values, dtype=logits.dtype).to(device, non_blocking=True).unsqueeze(1)

    # Token id ``vocab_size`` pads every history: its column is dropped after the scatter.
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        seen_ids = _padded([sorted(set(a) | set(b)) if p.repetition_penalty != 1.0 else []
                            for p, a, b in zip(params, prompt_ids, output_ids)], vocab_size, device)
        seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=device)
        seen = seen.scatter_(1, seen_ids, True)[:, :vocab_size]  # [num_rows, vocab_size]
        penalty = column(repetition)
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    if any(presence) or any(frequency):
        ids = _padded(output_ids, vocab_size, device)
        counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=device)
        counts = counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))[:, :vocab_size]
        # presence + frequency * count on the tokens a row has output, nothing elsewhere.
        out = torch.where(counts > 0, out - (column(presence) + column(frequency) * counts), out)
    if any(p.logit_bias for p in params):
        biases = [dict(p.logit_bias or {}) for p in params]
        bias_ids = _padded([list(b) for b in biases], vocab_size, device)
        bias_values = _padded([list(b.values()) for b in biases], 0.0, device, logits.dtype)
        bias = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=device)
        bias = bias.scatter_(1, bias_ids, bias_values)[:, :vocab_size]
        has_bias = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=device)
        has_bias = has_bias.scatter_(1, bias_ids, True)[:, :vocab_size]
        out = torch.where(has_bias, out + bias, out)
    short = [i for i, (p, o) in enumerate(zip(params, output_ids)) if len(o) < p.min_tokens]
    if short and eos_token_ids:
        eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=device)
        out[torch.tensor(short, device=device)[:, None], eos[None, :]] = float("-inf")
    return out


def reference_apply_extras(logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                           output_ids: list[list[int]], eos_token_ids: list[int]) -> torch.Tensor:
    """:func:`apply_extras` one row at a time: its twin."""
    out = logits.clone()
    for i, p in enumerate(params):
        row = apply_penalties(logits[i], prompt_ids[i], output_ids[i], p)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
            row = row.index_add(0, ids, bias)
        if len(output_ids[i]) < p.min_tokens and eos_token_ids:
            row = row.index_fill(0, torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=row.device),
                                 float("-inf"))
        out[i] = row
    return out


def changes_logits(params: SamplingParams) -> bool:
    """Whether :func:`apply_extras` can change a row of ``params``: a penalty, a bias, ``min_tokens``."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or bool(params.logit_bias) or params.min_tokens > 0)
