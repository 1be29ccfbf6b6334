"""Accuracy of a (quantized) model against its unquantized reference on held-out text.

For every window of held-out tokens both models score the same ids; we report perplexity
(per text and token-weighted overall), the mean per-token KL divergence KL(reference || model)
and the top-1 next-token agreement. Everything is deterministic: fixed texts, fixed windows,
no sampling.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fastdraft.layers.kv_cache import KVCache
from fastdraft.models.llama import LlamaForCausalLM
from fastdraft.quant.data import EvalText
from fastdraft.tokenizer import Tokenizer


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

    @property
    def ppl_loss(self) -> float:
        """Relative perplexity increase over the reference (0.01 = 1%)."""
        return self.ppl / self.ref_ppl - 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "ppl_loss": self.ppl_loss}


@dataclass
class EvalWindows:
    """The fixed token windows every evaluation scores."""

    windows: list[tuple[str, torch.Tensor]]  # (text name, ids [1, seq_len])

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
                    windows.append((text.name, torch.tensor([chunk])))
        if not windows:
            raise ValueError("evaluation texts produced no tokens")
        return cls(windows)

    @property
    def num_tokens(self) -> int:
        return sum(ids.shape[1] - 1 for _, ids in self.windows)


@torch.inference_mode()
def _full_logits(model: LlamaForCausalLM, ids: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
    kv_cache.reset()
    meta = kv_cache.append(ids.shape[1])
    hidden = model(ids.to(model.device), kv_cache, meta)
    return model.compute_logits(hidden[0, :-1])  # [seq_len - 1, vocab] predicting ids[1:]


@dataclass
class ReferenceScores:
    """The reference model's log-probabilities on every window, computed once and reused
    for each candidate (fp16: ~0.3 GB per 1K tokens at a 150K vocabulary). The top-1 ids are
    kept exactly, so rounding never flips an agreement."""

    logprobs: list[torch.Tensor]  # per window: [seq_len - 1, vocab] fp16
    top1_ids: list[torch.Tensor]  # per window: [seq_len - 1]
    result: EvalResult


@torch.inference_mode()
def score_reference(reference: LlamaForCausalLM, windows: EvalWindows, show_progress: bool = True) -> ReferenceScores:
    result, logprobs, top1_ids = _score(reference, windows, None, "reference", show_progress, keep_logprobs=True)
    return ReferenceScores(logprobs, top1_ids, result)


@torch.inference_mode()
def evaluate(model: LlamaForCausalLM, windows: EvalWindows, reference: ReferenceScores | None = None,
             label: str = "model", show_progress: bool = True) -> EvalResult:
    """Score ``model`` on ``windows``; with ``reference``, also KL and top-1 agreement against it."""
    return _score(model, windows, reference, label, show_progress, keep_logprobs=False)[0]


class _Tally:
    """Per-text sums of one model's scores over windows: negative log-likelihood, tokens, and
    against a reference, KL divergence and top-1 agreements."""

    def __init__(self) -> None:
        self.nll: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.kl: dict[str, float] = {}
        self.agree: dict[str, int] = {}

    def add(self, name: str, logprobs: torch.Tensor, targets: torch.Tensor,
            ref_logprobs: torch.Tensor | None = None, ref_top1: torch.Tensor | None = None) -> None:
        """``logprobs`` [num_targets, vocab] predicting ``targets`` [num_targets]."""
        self.nll[name] = self.nll.get(name, 0.0) - logprobs.gather(-1, targets[:, None]).sum().item()
        self.count[name] = self.count.get(name, 0) + targets.numel()
        if ref_logprobs is not None:
            kl = (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1)  # [num_targets]
            self.kl[name] = self.kl.get(name, 0.0) + kl.sum().item()
            self.agree[name] = self.agree.get(name, 0) + (ref_top1 == logprobs.argmax(-1)).sum().item()

    def result(self, label: str, reference: EvalResult | None) -> EvalResult:
        total = sum(self.count.values())
        ppl = math.exp(sum(self.nll.values()) / total)
        has_ref = reference is not None
        return EvalResult(
            label=label, num_tokens=total, ppl=ppl, ref_ppl=reference.ppl if has_ref else ppl,
            mean_kl=sum(self.kl.values()) / total if has_ref else 0.0,
            top1_agreement=sum(self.agree.values()) / total if has_ref else 1.0,
            ppl_per_text={n: math.exp(self.nll[n] / self.count[n]) for n in self.nll},
            ref_ppl_per_text=reference.ppl_per_text if has_ref else {},
            num_tokens_per_text=dict(self.count),
            mean_kl_per_text={n: self.kl[n] / self.count[n] for n in self.kl},
            top1_agreement_per_text={n: self.agree[n] / self.count[n] for n in self.agree})


def _score(model: LlamaForCausalLM, windows: EvalWindows, reference: ReferenceScores | None, label: str,
           show_progress: bool, keep_logprobs: bool) -> tuple[EvalResult, list[torch.Tensor], list[torch.Tensor]]:
    cache = _cache_for(model, windows)
    tally = _Tally()
    kept: list[torch.Tensor] = []
    kept_top1: list[torch.Tensor] = []
    for i, (name, ids) in enumerate(tqdm(windows.windows, desc=f"evaluating {label}", disable=not show_progress,
                                         leave=False)):
        targets = ids[0, 1:].to(model.device)  # [seq_len - 1]
        logprobs = F.log_softmax(_full_logits(model, ids, cache), dim=-1)  # [seq_len - 1, vocab]
        if keep_logprobs:
            kept.append(logprobs.to(torch.float16).cpu())
            kept_top1.append(logprobs.argmax(-1).cpu())
        if reference is None:
            tally.add(name, logprobs, targets)
        else:
            tally.add(name, logprobs, targets, reference.logprobs[i].to(logprobs.device).float(),
                      reference.top1_ids[i].to(logprobs.device))
    return tally.result(label, reference.result if reference is not None else None), kept, kept_top1


def _cache_for(model: LlamaForCausalLM, windows: EvalWindows) -> KVCache:
    max_len = max(ids.shape[1] for _, ids in windows.windows)
    return KVCache.from_config(model.config, max_len, dtype=model.dtype, device=model.device)


@torch.inference_mode()
def compare(reference: LlamaForCausalLM, model: LlamaForCausalLM, windows: EvalWindows, label: str = "model",
            show_progress: bool = True) -> tuple[EvalResult, EvalResult]:
    """Score ``reference`` and ``model`` side by side, one window at a time: (reference's
    result, model's result with KL and top-1 against it).

    Unlike :func:`score_reference`, nothing of the reference is kept beyond the current
    window, so memory stays bounded on texts of any length (a stored fp16 distribution costs
    ~0.3 GB per 1K tokens at a 150K vocabulary)."""
    ref_cache, cache = _cache_for(reference, windows), _cache_for(model, windows)
    ref_tally, tally = _Tally(), _Tally()
    for name, ids in tqdm(windows.windows, desc=f"evaluating {label}", disable=not show_progress, leave=False):
        targets = ids[0, 1:].to(model.device)  # [seq_len - 1]
        ref_logprobs = F.log_softmax(_full_logits(reference, ids, ref_cache), dim=-1).to(model.device)
        logprobs = F.log_softmax(_full_logits(model, ids, cache), dim=-1)  # [seq_len - 1, vocab]
        ref_tally.add(name, ref_logprobs, targets)
        tally.add(name, logprobs, targets, ref_logprobs, ref_logprobs.argmax(-1))
    ref_result = ref_tally.result("reference", None)
    return ref_result, tally.result(label, ref_result)


def format_table(results: list[EvalResult]) -> str:
    """A markdown table of evaluation results."""
    lines = ["| config | ppl | ref ppl | ppl loss | mean KL | top-1 agree | tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.label} | {r.ppl:.4f} | {r.ref_ppl:.4f} | {r.ppl_loss * 100:+.2f}% | "
                     f"{r.mean_kl:.5f} | {r.top1_agreement * 100:.2f}% | {r.num_tokens} |")
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
    return "\n".join(lines)
