"""The automatic quantization flow: try configurations, keep the fastest accurate one.

Every candidate is quantized from the same dense model, evaluated against it on held-out
text (perplexity, KL, top-1 agreement) and timed on a short greedy decode. The winner is the
candidate with the lowest decode latency whose perplexity loss is within ``max_loss``. On a
shared machine one timing can be off by 2x, so the candidates within the target (the fastest
``max_finalists``) and the reference are timed again at the end, taking turns, and ranked by
the median of those rounds.
A report (markdown table, JSON, and a PNG of accuracy against speed and size) is written
whether or not any candidate meets the target.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from fastdraft.fileio import atomic_write, write_json
from fastdraft.models.llama import LlamaForCausalLM
from fastdraft.models.loader import LoadedModel, build_model, load_state_dict
from fastdraft.quant.config import GGUF_METHOD, LAYER_LINEARS, QuantConfig, parse_quant_spec
from fastdraft.quant.data import calibration_samples, evaluation_texts
from fastdraft.quant.evaluate import EvalResult, EvalWindows, evaluate, score_reference
from fastdraft.quant.gguf_native import apply_gguf_native
from fastdraft.quant.quantizer import quantize_model
from fastdraft.quant.sensitivity import Int8Gain, nested_int8_sets, rank_int8_linears

logger = logging.getLogger(__name__)


SCHEMES = ("sym", "asym", "asymf")


@dataclass
class AutoSearchSpace:
    """The grid the automatic flow tries, and the accuracy target."""

    methods: tuple[str, ...] = ("rtn", "gptq", "awq")
    group_sizes: tuple[int, ...] = (32, 128)
    # Zero-point schemes: "sym" (constant 8), "asym" (integer zero points, GPTQ/AWQ style),
    # "asymf" (float16 zero points, Q4_1/Q4_K style).
    schemes: tuple[str, ...] = ("sym", "asym", "asymf")
    sensitive_bits: tuple[int, ...] = (4,)  # add 8 to also try Q4_K_M-style INT8 exceptions
    # Sets of decoder linears kept at INT8 in every layer (QuantConfig.int8_linears); () = none.
    int8_linears: tuple[tuple[str, ...], ...] = ((),)
    # N > 0: rank the kinds of linears by the KL their INT8 copy saves per byte (quant/sensitivity.py,
    # an RTN pass on the grid's first group size and scheme) and also try the nested sets of the top 1..N.
    num_int8_sets: int = 0
    max_loss: float = 0.01  # relative perplexity increase allowed (0.01 = 1%)
    lm_head_bits: int = 8
    num_calib_samples: int = 32
    calib_seq_len: int = 512
    # GPTQ's dampening in the grid: 0.1 beat the usual 0.01 on both Qwen2.5-Coder models
    # (+10.54% vs +12.82% at g128 asymf on the 1.5B, +2.27% vs +2.50% at g32 on the 0.5B).
    damp_percent: float = 0.1
    num_decode_tokens: int = 32
    num_timing_rounds: int = 5  # interleaved re-timing of the finalists and the reference
    max_finalists: int = 4  # candidates within target kept in memory for the re-timing
    eval_seq_len: int = 512
    # Explicit candidates (e.g. "method=rtn,group_size=32,sym=false"); when given they replace the grid.
    candidates: tuple[str, ...] = ()
    # Also try the GGUF file's own blocks when the model comes from one.
    include_gguf: bool = True

    def __post_init__(self) -> None:
        if not (self.methods and self.group_sizes and self.schemes and self.sensitive_bits and self.int8_linears):
            raise ValueError("the search space is empty")
        unknown = set(self.schemes) - set(SCHEMES)
        if unknown:
            raise ValueError(f"unknown zero-point schemes {sorted(unknown)}; choose from {', '.join(SCHEMES)}")
        if self.num_decode_tokens < 1 or self.num_timing_rounds < 0 or self.max_finalists < 1:
            raise ValueError("num_decode_tokens and max_finalists must be >= 1, num_timing_rounds >= 0")
        if not 0.0 < self.max_loss < 1.0:
            raise ValueError(f"max_loss must be in (0, 1), got {self.max_loss}")
        if not 0 <= self.num_int8_sets <= len(LAYER_LINEARS):
            raise ValueError(f"num_int8_sets must be in [0, {len(LAYER_LINEARS)}], got {self.num_int8_sets}")
        if self.num_int8_sets and self.candidates:
            raise ValueError("num_int8_sets extends the grid; explicit candidates replace it")
        self.configs()  # validates every combination up front

    def configs(self, extra_int8_sets: tuple[tuple[str, ...], ...] = ()) -> list[QuantConfig]:
        """The candidates: the explicit list, or the grid (with ``extra_int8_sets`` added to its INT8 sets)."""
        if self.candidates:

            return [parse_quant_spec(c) for c in self.candidates]
        configs = [QuantConfig(method=m, bits=4, group_size=g, sym=s == "sym", float_zeros=s == "asymf",
                               lm_head_bits=self.lm_head_bits, sensitive_bits=sb, int8_linears=i8,
                               damp_percent=self.damp_percent if m == "gptq" else QuantConfig.damp_percent,
                               num_calib_samples=self.num_calib_samples, calib_seq_len=self.calib_seq_len)
                   for m, g, s, sb, i8 in itertools.product(self.methods, self.group_sizes, self.schemes,
                                                            self.sensitive_bits, self.int8_linears + extra_int8_sets)]
        return list({c.label: c for c in configs}.values())  # a set listed twice is tried once

    def sensitivity_base(self) -> QuantConfig:
        """The RTN config the INT8 ranking starts from: the grid's first group size and scheme."""
        first = self.configs()[0]
        return QuantConfig(method="rtn", group_size=first.group_size, sym=first.sym, float_zeros=first.float_zeros,
                           lm_head_bits=first.lm_head_bits, sensitive_bits=first.sensitive_bits)


@dataclass
class Candidate:
    config: QuantConfig
    eval: EvalResult
    decode_ms: float
    weight_bytes: int
    is_within_target: bool = False
    is_retimed: bool = False  # decode_ms is the median of the interleaved final rounds


@dataclass
class AutoResult:
    reference: EvalResult
    reference_decode_ms: float
    reference_weight_bytes: int
    candidates: list[Candidate] = field(default_factory=list)
    best: Candidate | None = None
    int8_gains: list[Int8Gain] = field(default_factory=list)  # with num_int8_sets: the ranking measured


class DecodeTimer(Protocol):
    """How the search times a candidate's decoding; the engine provides one
    (:class:`fastdraft.engine.timing.GreedyDecodeTimer`)."""

    def time(self, model: LlamaForCausalLM) -> float:
        """Median per-token decode latency in milliseconds."""

    def time_interleaved(self, models: list[LlamaForCausalLM], num_rounds: int) -> list[float]:
        """Each model's median latency (ms) over rounds in which the models take turns."""


def auto_quantize(loaded: LoadedModel, space: AutoSearchSpace, timer: DecodeTimer, show_progress: bool = True,
                  report_dir: Path | None = None,
                  gguf_path: Path | None = None) -> tuple[AutoResult, LlamaForCausalLM | None]:
    """Run the search; returns the result and the winning quantized model (or None).

    ``timer`` times each candidate's decoding (``space.num_decode_tokens`` is what the CLI's
    timer decodes).

    With ``report_dir`` the report is rewritten after every candidate, so an interrupted
    search keeps what it measured. With ``gguf_path``, the GGUF file the model was converted
    from, the file's own quantized blocks are one more candidate (``method=gguf``)."""
    reference = loaded.model
    tokenizer = loaded.tokenizer
    seq_len = min(space.eval_seq_len, loaded.config.max_position_embeddings)
    windows = EvalWindows.build(tokenizer, evaluation_texts(), seq_len=seq_len)
    ref_scores = score_reference(reference, windows, show_progress)
    ref_eval = ref_scores.result
    result = AutoResult(reference=ref_eval, reference_decode_ms=timer.time(reference),
                        reference_weight_bytes=reference.decode_weight_bytes())
    calib: dict[tuple[int, int, int], list[torch.Tensor]] = {}  # each config's own calibration set, drawn once
    state = load_state_dict(loaded.model_dir)
    finalists: list[tuple[Candidate, LlamaForCausalLM]] = []  # within target, fastest first
    extra_sets: tuple[tuple[str, ...], ...] = ()
    if space.num_int8_sets:
        result.int8_gains = rank_int8_linears(loaded, state, windows, ref_scores, space.sensitivity_base(),
                                              show_progress)
        extra_sets = nested_int8_sets(result.int8_gains, space.num_int8_sets)
        logger.info("INT8 sets to try: %s", extra_sets)
    configs = space.configs(extra_sets)
    if gguf_path is not None and space.include_gguf and not any(c.is_gguf_native for c in configs):
        configs.append(QuantConfig(method=GGUF_METHOD))
    for config in configs:
        model = build_model(loaded.config, state, reference.dtype, reference.device)
        if config.is_gguf_native:
            if gguf_path is None:
                raise ValueError("method=gguf needs the model's GGUF file")
            config = apply_gguf_native(model, gguf_path)
        samples = None
        if config.needs_calibration:
            key = (config.num_calib_samples, config.calib_seq_len, config.seed)
            if key not in calib:
                calib[key] = calibration_samples(tokenizer, *key)
            samples = calib[key]
        if not config.is_gguf_native:
            quantize_model(model, config, samples, show_progress)
        ev = evaluate(model, windows, ref_scores, label=config.label, show_progress=show_progress)
        cand = Candidate(config, ev, timer.time(model), model.decode_weight_bytes())
        cand.is_within_target = ev.ppl_loss <= space.max_loss
        result.candidates.append(cand)
        logger.info("%s: ppl loss %+.2f%%, decode %.1f ms", config.label, ev.ppl_loss * 100, cand.decode_ms)
        if cand.is_within_target:
            finalists.append((cand, model))
            finalists.sort(key=lambda f: f[0].decode_ms)
            del finalists[space.max_finalists:]
            result.best = finalists[0][0]
        del model
        if report_dir is not None:
            write_report(result, space, report_dir)
    if finalists and space.num_timing_rounds > 0:
        logger.info("timing %d finalists and the reference, %d interleaved rounds", len(finalists),
                    space.num_timing_rounds)
        times = timer.time_interleaved([reference] + [m for _, m in finalists], space.num_timing_rounds)
        result.reference_decode_ms = times[0]
        for (cand, _), ms in zip(finalists, times[1:]):
            cand.decode_ms, cand.is_retimed = ms, True
        finalists.sort(key=lambda f: f[0].decode_ms)
        result.best = finalists[0][0]
        if report_dir is not None:
            write_report(result, space, report_dir)
    return result, (finalists[0][1] if finalists else None)


def report_markdown(result: AutoResult, space: AutoSearchSpace) -> str:
    lines = [f"Reference perplexity {result.reference.ppl:.4f} over {result.reference.num_tokens} held-out tokens; "
             f"decode {result.reference_decode_ms:.1f} ms/token; weights {result.reference_weight_bytes / 1e6:.0f} MB. "
             f"Target: perplexity loss <= {space.max_loss * 100:.2f}%.", "",
             "| config | ppl | ppl loss | mean KL | top-1 agree | decode ms/tok | speedup | weights MB | meets target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(result.candidates, key=lambda c: c.decode_ms):
        e = c.eval
        mark = "**best**" if c is result.best else ("yes" if c.is_within_target else "no")
        lines.append(f"| {c.config.label} | {e.ppl:.4f} | {e.ppl_loss * 100:+.2f}% | {e.mean_kl:.5f} | "
                     f"{e.top1_agreement * 100:.2f}% | {c.decode_ms:.1f}{'*' if c.is_retimed else ''} | "
                     f"{result.reference_decode_ms / c.decode_ms:.2f}x | {c.weight_bytes / 1e6:.0f} | {mark} |")
    lines.append("")
    if any(c.is_retimed for c in result.candidates):
        lines.append(f"\\* median of {space.num_timing_rounds} interleaved rounds with the other finalists and the "
                     "reference (the reference's time too); other times are single runs.")
        lines.append("")
    if result.int8_gains:
        lines += [f"INT8 sensitivity ({space.sensitivity_base().label}, one kind of linear at INT8 in every layer):", "",
                  "| linear | mean KL saved | extra MB | KL saved per MB |", "|---|---|---|---|"]
        lines += [f"| {g.name} | {g.kl_saved:.5f} | {g.extra_bytes / 1e6:.1f} | {g.kl_saved_per_mb:.5f} |"
                  for g in result.int8_gains]
        lines.append("")
    if result.best is None:
        lines.append(f"NO configuration met the target of {space.max_loss * 100:.2f}% perplexity loss.")
    else:
        lines.append(f"Chosen: {result.best.config.label} ({result.best.eval.ppl_loss * 100:+.2f}% perplexity, "
                     f"{result.best.decode_ms:.1f} ms/token).")
    return "\n".join(lines)


def plot(result: AutoResult, path: Path) -> None:
    """Accuracy (perplexity loss) against decode latency, marker area proportional to size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for c in result.candidates:
        color = "tab:green" if c.is_within_target else "tab:red"
        ax.scatter(c.decode_ms, c.eval.ppl_loss * 100, s=c.weight_bytes / 2e6, color=color, alpha=0.6,
                   edgecolors="black" if c is result.best else "none", linewidths=2)
        ax.annotate(c.config.label, (c.decode_ms, c.eval.ppl_loss * 100), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("decode latency (ms/token, lower is faster)")
    ax.set_ylabel("perplexity loss vs reference (%)")
    ax.set_title(f"reference: {result.reference_decode_ms:.1f} ms/token, ppl {result.reference.ppl:.3f}"
                 " (marker area ~ weight bytes)")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def write_report(result: AutoResult, space: AutoSearchSpace, report_dir: Path) -> str:
    """Write report.md, report.json and report.png into ``report_dir``; return the markdown."""
    markdown = report_markdown(result, space)
    atomic_write(report_dir / "report.md", lambda tmp: Path(tmp).write_text(markdown + "\n"))
    payload = {
        "space": asdict(space),
        "reference": result.reference.to_dict(),
        "reference_decode_ms": result.reference_decode_ms,
        "candidates": [{"config": c.config.to_dict(), "label": c.config.label, "eval": c.eval.to_dict(),
                        "decode_ms": c.decode_ms, "weight_bytes": c.weight_bytes,
                        "is_within_target": c.is_within_target, "is_retimed": c.is_retimed}
                       for c in result.candidates],
        "best": None if result.best is None else result.best.config.label,
        "int8_gains": [g.to_dict() for g in result.int8_gains],
    }
    write_json(report_dir / "report.json", payload)
    plot(result, report_dir / "report.png")
    return markdown
