"""Accuracy of a (quantized) model against its unquantized reference on held-out text.

For every window of held-out tokens both models score the same ids; we report perplexity
(per text, per domain and token-weighted overall), the mean per-token KL divergence
KL(reference || model) and the top-1 next-token agreement. The perplexity loss comes with a
bootstrap interval over windows, resampled within each domain. Everything is deterministic:
fixed texts, fixed windows, a seeded bootstrap, no sampling.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.models.causal_lm import CausalLM
from fastdraft.quant.data import EvalText, GivenTexts, TextSet
from fastdraft.tokenizer import Tokenizer

# The reference's distribution is kept as its top tokens plus one bucket for the rest, so memory
# stays bounded (a full fp16 row is 0.3 MB at a 150K vocabulary). The bucketed KL is a lower
# bound on the full KL, which the side-by-side ``compare`` computes.
REFERENCE_TOP_K = 64
NUM_BOOTSTRAP = 1000
CONFIDENCE = 0.95


@dataclass
class WindowScore:
    """One window's sums: what the bootstrap resamples."""

    text: str
    domain: str
    num_tokens: int  # tokens predicted
    nll: float  # summed negative log-likelihood of the model
    ref_nll: float  # the same of the reference (equal to nll without one)
    kl: float = 0.0  # summed KL(reference || model)
    num_agree: int = 0  # tokens whose top-1 matches the reference's


def loss_interval(windows: list[WindowScore], num_resamples: int = NUM_BOOTSTRAP, confidence: float = CONFIDENCE,
                  seed: int = 0) -> tuple[float, float]:
    """The bootstrap percentile interval of the perplexity loss ``exp((nll - ref_nll) / tokens) - 1``
    over ``windows``, resampled with replacement within each domain (so the domains keep their
    weights). Deterministic for a given ``seed``."""
    if not windows:
        raise ValueError("no windows to resample")
    generator = torch.Generator().manual_seed(seed)
    diff = torch.zeros(num_resamples, dtype=torch.float64)
    count = torch.zeros(num_resamples, dtype=torch.float64)
    for domain in sorted({w.domain for w in windows}):
        ws = [w for w in windows if w.domain == domain]
        d = torch.tensor([w.nll - w.ref_nll for w in ws], dtype=torch.float64)  # [num_windows]
        n = torch.tensor([w.num_tokens for w in ws], dtype=torch.float64)
        idx = torch.randint(len(ws), (num_resamples, len(ws)), generator=generator)  # [num_resamples, num_windows]
        diff += d[idx].sum(1)
        count += n[idx].sum(1)
    losses = torch.expm1(diff / count)
    lo, hi = torch.quantile(losses, torch.tensor([(1 - confidence) / 2, (1 + confidence) / 2], dtype=torch.float64))
    return lo.item(), hi.item()


def _summary(windows: list[WindowScore]) -> tuple[int, float, float, float, float]:
    """(tokens, ppl, reference ppl, mean KL, top-1 agreement) over ``windows``."""
    n = sum(w.num_tokens for w in windows)
    return (n, math.exp(sum(w.nll for w in windows) / n), math.exp(sum(w.ref_nll for w in windows) / n),
            sum(w.kl for w in windows) / n, sum(w.num_agree for w in windows) / n)


@dataclass
class EvalResult:
    label: str
    num_tokens: int
    ppl: float
    ref_ppl: float
    mean_kl: float
    top1_agreement: float
    ppl_per_text: dict[str, float] = field(default_factory=dict)
    ref_ppl_per_text: dict[str, float] = field(default_factory=dict)
    num_tokens_per_text: dict[str, int] = field(default_factory=dict)
    mean_kl_per_text: dict[str, float] = field(default_factory=dict)  # empty without a reference
    top1_agreement_per_text: dict[str, float] = field(default_factory=dict)  # likewise
    # Against a reference: the bootstrap interval of ppl_loss, overall and per domain.
    loss_interval: tuple[float, float] | None = None
    ppl_loss_per_domain: dict[str, float] = field(default_factory=dict)
    loss_interval_per_domain: dict[str, tuple[float, float]] = field(default_factory=dict)
    mean_kl_per_domain: dict[str, float] = field(default_factory=dict)
    top1_agreement_per_domain: dict[str, float] = field(default_factory=dict)
    num_tokens_per_domain: dict[str, int] = field(default_factory=dict)
    windows: list[WindowScore] = field(default_factory=list, repr=False)

    @property
    def ppl_loss(self) -> float:
        """Relative perplexity increase over the reference (0.01 = 1%)."""
        return self.ppl / self.ref_ppl - 1.0

    @classmethod
    def from_windows(cls, label: str, windows: list[WindowScore], has_reference: bool) -> "EvalResult":
        """Aggregate window sums per text, per domain and overall; with a reference, also KL,
        top-1 and the bootstrap intervals of the loss."""
        by_text: dict[str, list[WindowScore]] = {}
        by_domain: dict[str, list[WindowScore]] = {}
        for w in windows:
            by_text.setdefault(w.text, []).append(w)
            by_domain.setdefault(w.domain, []).append(w)
        n, ppl, ref_ppl, kl, top1 = _summary(windows)
        texts = {name: _summary(ws) for name, ws in by_text.items()}
        domains = {name: _summary(ws) for name, ws in by_domain.items()}
        result = cls(label=label, num_tokens=n, ppl=ppl, ref_ppl=ref_ppl, mean_kl=kl if has_reference else 0.0,
                     top1_agreement=top1 if has_reference else 1.0,
                     ppl_per_text={t: s[1] for t, s in texts.items()},
                     ref_ppl_per_text={t: s[2] for t, s in texts.items()} if has_reference else {},
                     num_tokens_per_text={t: s[0] for t, s in texts.items()},
                     num_tokens_per_domain={d: s[0] for d, s in domains.items()}, windows=windows)
        if has_reference:
            result.mean_kl_per_text = {t: s[3] for t, s in texts.items()}
            result.top1_agreement_per_text = {t: s[4] for t, s in texts.items()}
            result.loss_interval = loss_interval(windows)
            result.ppl_loss_per_domain = {d: s[1] / s[2] - 1 for d, s in domains.items()}
            result.loss_interval_per_domain = {d: loss_interval(ws) for d, ws in by_domain.items()}
            result.mean_kl_per_domain = {d: s[3] for d, s in domains.items()}
            result.top1_agreement_per_domain = {d: s[4] for d, s in domains.items()}
        return result

    def to_dict(self) -> dict:
        return {**asdict(self), "ppl_loss": self.ppl_loss}


@dataclass(frozen=True)
class Window:
    text: str
    domain: str
    ids: torch.Tensor  # [1, seq_len]


@dataclass
class EvalWindows:
    """The fixed token windows every evaluation scores."""

    windows: list[Window]

    @classmethod
    def build(cls, tokenizer: Tokenizer, texts: list[EvalText], seq_len: int = 512,
              max_tokens_per_text: int | None = 1024, min_tokens_per_text: int = 0) -> "EvalWindows":
        """Consecutive windows of ``seq_len`` tokens over each text's first
        ``max_tokens_per_text`` tokens (``None``: the whole text). A text of fewer than
        ``min_tokens_per_text`` tokens raises ``ValueError``."""
        if seq_len < 2:
            raise ValueError("seq_len must be at least 2")
        windows = []
        for text in texts:
            ids = tokenizer.encode(text.text)[:max_tokens_per_text]
            if len(ids) < min_tokens_per_text:
                raise ValueError(f"{text.name} has {len(ids)} tokens, fewer than one window of "
                                 f"{min_tokens_per_text}")
            for start in range(0, len(ids) - 1, seq_len):
                chunk = ids[start:start + seq_len]
                if len(chunk) >= 2:
                    windows.append(Window(text.name, text.domain, torch.tensor([chunk])))
        if not windows:
            raise ValueError("evaluation texts produced no tokens")
        return cls(windows)

    @classmethod
    def for_set(cls, tokenizer: Tokenizer, text_set: TextSet | GivenTexts, seq_len: int = 512) -> "EvalWindows":
        """The windows of a held-out set: a built-in one (``data.SELECTION``, ``data.TEST``), or
        a part of the user's text (with the built-in set beside it, if mixed)."""
        return cls([w for texts, cap in text_set.scored()
                    for w in cls.build(tokenizer, texts, seq_len, max_tokens_per_text=cap).windows])

    def head(self, num_windows: int) -> list[int]:
        """Indices of the first ``num_windows`` windows of each domain: a quick subset for ranking."""
        taken: dict[str, int] = {}
        kept = []
        for i, w in enumerate(self.windows):
            if taken.get(w.domain, 0) < num_windows:
                taken[w.domain] = taken.get(w.domain, 0) + 1
                kept.append(i)
        return kept

    def subset(self, indices: list[int]) -> "EvalWindows":
        return EvalWindows([self.windows[i] for i in indices])

    @property
    def num_tokens(self) -> int:
        return sum(w.ids.shape[1] - 1 for w in self.windows)


@torch.inference_mode()
def _full_logits(model: CausalLM, ids: torch.Tensor, cache: SequenceCache) -> torch.Tensor:
    cache.reset()
    input_ids, meta = cache.append(ids[0])
    hidden = model(input_ids, meta.positions, cache.kv_cache, meta)  # [seq_len, hidden_size]
    return model.compute_logits(hidden[:-1])  # [seq_len - 1, vocab] predicting ids[1:]


def _log_probs(model: CausalLM, window: Window, cache: SequenceCache) -> torch.Tensor:
    return F.log_softmax(_full_logits(model, window.ids, cache).float(), dim=-1)  # [seq_len - 1, vocab]


@dataclass
class ReferenceScores:
    """The reference's scores on every window, computed once and reused for each candidate:
    per window its top ``REFERENCE_TOP_K`` log-probabilities and token ids, not the whole
    distribution. The top-1 ids are kept exactly, so rounding never flips an agreement."""

    topk_logprobs: list[torch.Tensor]  # per window: [seq_len - 1, k] float32, descending
    topk_ids: list[torch.Tensor]  # per window: [seq_len - 1, k] int64
    result: EvalResult

    def subset(self, indices: list[int]) -> "ReferenceScores":
        """The scores of the windows at ``indices`` (``EvalWindows.subset``), without rescoring."""
        windows = [self.result.windows[i] for i in indices]
        return ReferenceScores([self.topk_logprobs[i] for i in indices], [self.topk_ids[i] for i in indices],
                               EvalResult.from_windows(self.result.label, windows, has_reference=False))


def topk_kl(ref_topk_logprobs: torch.Tensor, ref_topk_ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(reference || model) per row [num_rows] over the reference's top tokens
    ([num_rows, k]) and one bucket for all other tokens; ``logprobs`` [num_rows, vocab]. A lower
    bound on the full KL (grouping tokens never raises a divergence), equal to it when ``k``
    covers the vocabulary."""
    ref_p = ref_topk_logprobs.exp()  # [num_rows, k]
    logq = logprobs.gather(-1, ref_topk_ids)  # [num_rows, k]
    head = (ref_p * (ref_topk_logprobs - logq)).sum(-1)
    ref_tail = (1.0 - ref_p.sum(-1)).clamp_min(0.0)
    tail_q = (1.0 - logq.exp().sum(-1)).clamp_min(1e-12)
    tail = torch.where(ref_tail > 1e-9, ref_tail * (ref_tail.clamp_min(1e-12).log() - tail_q.log()), 0.0)
    return head + tail


def full_kl(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(reference || model) per row [num_rows], from full [num_rows, vocab] log-probabilities."""
    return (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1)


def _nll(logprobs: torch.Tensor, targets: torch.Tensor) -> float:
    return -logprobs.gather(-1, targets[:, None]).sum().item()


@torch.inference_mode()
def score_reference(reference: CausalLM, windows: EvalWindows, show_progress: bool = True,
                    top_k: int = REFERENCE_TOP_K) -> ReferenceScores:
    """Score the reference once, keeping its top ``top_k`` tokens per position."""
    cache = _cache_for(reference, windows)
    scores, topk_logprobs, topk_ids = [], [], []
    for w in tqdm(windows.windows, desc="evaluating reference", disable=not show_progress, leave=False):
        logprobs = _log_probs(reference, w, cache)
        nll = _nll(logprobs, w.ids[0, 1:].to(logprobs.device))
        top = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
        topk_logprobs.append(top.values.cpu())
        topk_ids.append(top.indices.cpu())
        scores.append(WindowScore(w.text, w.domain, w.ids.shape[1] - 1, nll, nll))
    return ReferenceScores(topk_logprobs, topk_ids, EvalResult.from_windows("reference", scores, has_reference=False))


@torch.inference_mode()
def evaluate(model: CausalLM, windows: EvalWindows, reference: ReferenceScores | None = None,
             label: str = "model", show_progress: bool = True) -> EvalResult:
    """Score ``model`` on ``windows``; with ``reference``, also KL, top-1 agreement and the
    loss intervals against it."""
    cache = _cache_for(model, windows)
    scores = []
    for i, w in enumerate(tqdm(windows.windows, desc=f"evaluating {label}", disable=not show_progress,
                               leave=False)):
        logprobs = _log_probs(model, w, cache)
        targets = w.ids[0, 1:].to(logprobs.device)  # [seq_len - 1]
        nll = _nll(logprobs, targets)
        if reference is None:
            scores.append(WindowScore(w.text, w.domain, targets.numel(), nll, nll))
            continue
        ref_topk_logprobs = reference.topk_logprobs[i].to(logprobs.device)
        ref_topk_ids = reference.topk_ids[i].to(logprobs.device)
        kl = topk_kl(ref_topk_logprobs, ref_topk_ids, logprobs).sum().item()
        agree = (ref_topk_ids[:, 0] == logprobs.argmax(-1)).sum().item()
        scores.append(WindowScore(w.text, w.domain, targets.numel(), nll, reference.result.windows[i].nll, kl, agree))
    return EvalResult.from_windows(label, scores, has_reference=reference is not None)


def _cache_for(model: CausalLM, windows: EvalWindows) -> SequenceCache:
    max_len = max(w.ids.shape[1] for w in windows.windows)
    return SequenceCache.from_config(model.config, max_len, dtype=model.dtype, device=model.device)


@torch.inference_mode()
def compare(reference: CausalLM, model: CausalLM, windows: EvalWindows, label: str = "model",
            show_progress: bool = True) -> tuple[EvalResult, EvalResult]:
    """Score ``reference`` and ``model`` side by side, one window at a time: (reference's
    result, model's result with the full-vocabulary KL and top-1 against it).

    Nothing of the reference is kept beyond the current window, so memory stays bounded on
    texts of any length."""
    ref_cache, cache = _cache_for(reference, windows), _cache_for(model, windows)
    ref_scores, scores = [], []
    for w in tqdm(windows.windows, desc=f"evaluating {label}", disable=not show_progress, leave=False):
        ref_logprobs = _log_probs(reference, w, ref_cache)
        logprobs = _log_probs(model, w, cache).to(ref_logprobs.device)
        targets = w.ids[0, 1:].to(logprobs.device)  # [seq_len - 1]
        ref_nll, nll = _nll(ref_logprobs, targets), _nll(logprobs, targets)
        ref_scores.append(WindowScore(w.text, w.domain, targets.numel(), ref_nll, ref_nll))
        scores.append(WindowScore(w.text, w.domain, targets.numel(), nll, ref_nll,
                                  full_kl(ref_logprobs, logprobs).sum().item(),
                                  (ref_logprobs.argmax(-1) == logprobs.argmax(-1)).sum().item()))
    return (EvalResult.from_windows("reference", ref_scores, has_reference=False),
            EvalResult.from_windows(label, scores, has_reference=True))


def format_interval(interval: tuple[float, float] | None) -> str:
    """``(0.001, 0.012)`` -> ``"[+0.10%, +1.20%]"``; empty without an interval."""
    return "" if interval is None else f"[{interval[0] * 100:+.2f}%, {interval[1] * 100:+.2f}%]"


def format_table(results: list[EvalResult]) -> str:
    """A markdown table of evaluation results: overall, then per domain where there are several."""
    lines = [f"| config | ppl | ref ppl | ppl loss | {CONFIDENCE:.0%} interval | mean KL | top-1 agree | tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.label} | {r.ppl:.4f} | {r.ref_ppl:.4f} | {r.ppl_loss * 100:+.2f}% | "
                     f"{format_interval(r.loss_interval)} | {r.mean_kl:.5f} | {r.top1_agreement * 100:.2f}% | "
                     f"{r.num_tokens} |")
        if len(r.ppl_loss_per_domain) > 1:
            for domain, loss in r.ppl_loss_per_domain.items():
                lines.append(f"| {r.label} ({domain}) | | | {loss * 100:+.2f}% | "
                             f"{format_interval(r.loss_interval_per_domain[domain])} | "
                             f"{r.mean_kl_per_domain[domain]:.5f} | "
                             f"{r.top1_agreement_per_domain[domain] * 100:.2f}% | {r.num_tokens_per_domain[domain]} |")
    return "\n".join(lines)


def format_text_table(result: EvalResult) -> str:
    """A markdown table of ``result`` per text, then overall (KL and top-1 when it was scored
    against a reference)."""
    has_ref = bool(result.mean_kl_per_text)
    header = "| text | tokens | ppl |"
    rule = "|---|---:|---:|"
    if has_ref:
        header += " ref ppl | ppl loss | mean KL | top-1 agree |"
        rule += "---:|---:|---:|---:|"
    lines = [f"{result.label}:", "", header, rule]

    def row(name: str, tokens: int, ppl: float, ref_ppl: float, kl: float, top1: float) -> str:
        line = f"| {name} | {tokens} | {ppl:.4f} |"
        if has_ref:
            line += f" {ref_ppl:.4f} | {(ppl / ref_ppl - 1) * 100:+.2f}% | {kl:.5f} | {top1 * 100:.2f}% |"
        return line

    for name, tokens in result.num_tokens_per_text.items():
        lines.append(row(name, tokens, result.ppl_per_text[name], result.ref_ppl_per_text.get(name, 0.0),
                         result.mean_kl_per_text.get(name, 0.0), result.top1_agreement_per_text.get(name, 0.0)))
    lines.append(row("**overall**", result.num_tokens, result.ppl, result.ref_ppl, result.mean_kl,
                     result.top1_agreement))
    if result.loss_interval is not None:
        lines += ["", f"{CONFIDENCE:.0%} bootstrap interval of the overall loss (over windows): "
                      f"{format_interval(result.loss_interval)}"]
    return "\n".join(lines)
