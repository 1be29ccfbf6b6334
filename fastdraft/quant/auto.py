"""The automatic quantization flow: a directed walk, chosen on one text set, reported on another.

The walk visits candidates from the fewest weight bytes to the most, one direction at a time
instead of the full product of the options:

1. INT4 at each group size, largest groups first, with each of ``methods``;
2. INT8 for the kinds of linear the sensitivity ranking names, one nested set at a time, on the
   best INT4 candidate of the smallest group;
3. INT6 linears, INT6 with a bf16 head, and the GGUF file's own blocks, in order of bytes.

Every candidate is quantized from the same dense model, scored against it on the **selection**
set and timed on a short greedy decode. The walk stops at the first candidate whose selection
loss interval lies within the target (its upper end at most ``max_loss``): each later candidate
reads more bytes per token, so it decodes no faster. The choice is then scored once on the
**test** set, and that figure is the one reported, pass or miss; the test set never steers the
walk. A report (markdown, JSON and a PNG) is written whether or not any candidate meets the target.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from fastdraft.fileio import atomic_write, write_json
from fastdraft.formats import PER_CHANNEL
from fastdraft.models.causal_lm import CausalLM
from fastdraft.models.files import LoadedModel, build_model, load_state_dict
from fastdraft.quant.quant_config import LAYER_LINEARS, METHODS, QuantConfig, parse_quant_spec
from fastdraft.quant.data import USER_DOMAIN, QuantTexts, calibration_samples
from fastdraft.quant.evaluate import (CONFIDENCE, EvalResult, EvalWindows, compare, evaluate, format_interval,
                                      score_reference)
from fastdraft.quant.gguf_native import apply_gguf_native
from fastdraft.quant.quantizer import quantize_model
from fastdraft.quant.sensitivity import Int8Gain, nested_int8_sets, rank_int8_linears

logger = logging.getLogger(__name__)

SCHEMES = ("sym", "asym", "asymf")


@dataclass
class AutoSearchSpace:
    """The directions the walk takes, and the accuracy target."""

    # Tried in this order at each INT4 group size. GPTQ is opt-in: its calibration pass and
    # column-by-column updates make a candidate take several times as long as with RTN.
    methods: tuple[str, ...] = ("rtn",)
    group_sizes: tuple[int, ...] = (128, 64, 32)  # walked largest first (-1: per channel)
    # The INT4 zero-point scheme: "sym" (constant 8), "asym" (integer zero points, GPTQ/AWQ
    # style) or "asymf" (float16 zero points, Q4_1/Q4_K style).
    scheme: str = "asymf"
    # Nested sets of the top N kinds of linear kept at INT8, ranked by the KL their INT8 copy
    # saves per byte (quant/sensitivity.py) on the first windows of the selection set.
    num_int8_sets: int = 3
    num_ranking_windows: int = 4  # per domain
    include_int6: bool = True  # INT6 linears, then INT6 with a bf16 head
    include_gguf: bool = True  # the GGUF file's own blocks, when the model comes from one
    max_loss: float = 0.01  # relative perplexity increase allowed (0.01 = 1%)
    lm_head_bits: int = 8
    num_calib_samples: int = 32
    calib_seq_len: int = 512
    # GPTQ's dampening: 0.1 beat the usual 0.01 on both Qwen2.5-Coder models.
    damp_percent: float = 0.1
    num_decode_tokens: int = 32  # decode steps timed per candidate
    num_timing_rounds: int = 5  # interleaved re-timing of the choice and the reference
    eval_seq_len: int = 512
    # Explicit candidates (e.g. "method=rtn,group_size=32,sym=false"); when given they replace
    # the walk's steps and are visited in order of bytes.
    candidates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (self.methods and self.group_sizes):
            raise ValueError("the search space is empty")
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown zero-point scheme {self.scheme!r}; choose from {', '.join(SCHEMES)}")
        if self.num_decode_tokens < 1 or self.num_timing_rounds < 0 or self.num_ranking_windows < 1:
            raise ValueError("num_decode_tokens and num_ranking_windows must be >= 1, num_timing_rounds >= 0")
        if not 0.0 < self.max_loss < 1.0:
            raise ValueError(f"max_loss must be in (0, 1), got {self.max_loss}")
        if not 0 <= self.num_int8_sets <= len(LAYER_LINEARS):
            raise ValueError(f"num_int8_sets must be in [0, {len(LAYER_LINEARS)}], got {self.num_int8_sets}")
        # Building every INT4 candidate (and parsing every explicit one) validates it up front.
        self.explicit_configs() or [self.int4(m, g) for m in self.methods for g in self.group_sizes]

    def explicit_configs(self) -> list[QuantConfig]:
        return [parse_quant_spec(c) for c in self.candidates]

    def ordered_group_sizes(self) -> list[int]:
        """Largest groups (fewest bytes) first; per channel is the largest of all."""
        return sorted(set(self.group_sizes), key=lambda g: float("inf") if g == PER_CHANNEL else g, reverse=True)

    def int4(self, method: str, group_size: int, int8_linears: tuple[str, ...] = ()) -> QuantConfig:
        return QuantConfig(method=method, bits=4, group_size=group_size, sym=self.scheme == "sym",
                           float_zeros=self.scheme == "asymf", lm_head_bits=self.lm_head_bits,
                           int8_linears=int8_linears,
                           damp_percent=self.damp_percent if method == "gptq" else QuantConfig.damp_percent,
                           num_calib_samples=self.num_calib_samples, calib_seq_len=self.calib_seq_len)

    def int6(self, lm_head_bits: int) -> QuantConfig:
        """INT6 linears at the smallest group size the walk tries."""
        return QuantConfig(method="rtn", bits=6, group_size=self.ordered_group_sizes()[-1], sym=True,
                           lm_head_bits=lm_head_bits)


@dataclass
class Candidate:
    config: QuantConfig
    step: str  # which direction of the walk proposed it
    eval: EvalResult  # on the selection set
    decode_ms: float
    weight_bytes: int
    seconds: float  # wall time to build, quantize, score and time it
    is_within_target: bool = False  # the upper end of the selection interval is within max_loss
    is_retimed: bool = False  # decode_ms is the median of the interleaved final rounds


@dataclass
class AutoResult:
    reference: EvalResult  # on the selection set
    reference_decode_ms: float
    reference_weight_bytes: int
    candidates: list[Candidate] = field(default_factory=list)
    best: Candidate | None = None
    int8_gains: list[Int8Gain] = field(default_factory=list)  # the ranking, when the walk reached it
    test: EvalResult | None = None  # the choice on the test set, scored once
    max_loss: float = 0.01
    texts: dict[str, str] = field(default_factory=dict)  # what each part held: calibration, selection, test
    texts_how: str = ""

    @property
    def is_test_passed(self) -> bool:
        """The choice's test-set loss is within the target in every domain."""
        return self.test is not None and all(loss <= self.max_loss for loss in self.test.ppl_loss_per_domain.values())


class DecodeTimer(Protocol):
    """How the search times a candidate's decoding; the engine provides one
    (:class:`fastdraft.engine.timing.DecodeStepTimer`: the serving engine's batch-1 decode step)."""

    def time(self, model: CausalLM) -> float:
        """Median decode step in milliseconds."""

    def time_interleaved(self, models: list[CausalLM], num_rounds: int) -> list[float]:
        """Each model's median latency (ms) over rounds in which the models take turns."""


def estimate_weight_bytes(reference: CausalLM, config: QuantConfig) -> int:
    """Decode weight bytes of ``reference`` once quantized by ``config``, without quantizing it:
    what orders the walk."""
    total = reference.decode_weight_bytes()
    layers = reference.model.layers

    def swap(linear, fmt) -> int:
        if fmt is None:
            return 0
        return fmt.num_bytes(linear.out_features, linear.in_features) - \
            linear.weight.numel() * linear.weight.element_size()

    for idx, layer in enumerate(layers):
        for name in LAYER_LINEARS:
            total += swap(layer.get_submodule(name), config.layer_format(idx, len(layers), name))
    return total + swap(reference.lm_head, config.head_format())


def walk_step(config: QuantConfig) -> str:
    """Which direction of the walk ``config`` belongs to."""
    if config.is_gguf_native:
        return "GGUF blocks"
    if config.bits == 6:
        return "bf16 head" if config.lm_head_bits == 16 else "INT6 linears"
    return "INT8 linears" if config.int8_linears else "INT4 group size"


class _Walk:
    """One search: the reference's selection scores, and each candidate tried against them."""

    def __init__(self, loaded: LoadedModel, space: AutoSearchSpace, timer: DecodeTimer, windows: EvalWindows,
                 texts: QuantTexts, show_progress: bool, report_dir: Path | None, gguf_path: Path | None) -> None:
        self.loaded, self.space, self.timer, self.windows, self.texts = loaded, space, timer, windows, texts
        self.show_progress, self.report_dir, self.gguf_path = show_progress, report_dir, gguf_path
        self.reference = loaded.model
        self.ref_scores = score_reference(self.reference, windows, show_progress)
        self.result = AutoResult(reference=self.ref_scores.result, reference_decode_ms=timer.time(self.reference),
                                 reference_weight_bytes=self.reference.decode_weight_bytes(), max_loss=space.max_loss,
                                 texts=texts.describe(), texts_how=texts.how)
        self.state = load_state_dict(loaded.model_dir)
        self.calib: dict[tuple[int, int, int], list[torch.Tensor]] = {}  # each calibration set, drawn once

    def build(self, config: QuantConfig) -> CausalLM:
        model = build_model(self.loaded.config, self.state, self.reference.dtype, self.reference.device)
        if config.is_gguf_native:
            if self.gguf_path is None:
                raise ValueError("method=gguf needs the model's GGUF file")
            apply_gguf_native(model, self.gguf_path)
            return model
        samples = None
        if config.needs_calibration:
            key = (config.num_calib_samples, config.calib_seq_len, config.seed)
            if key not in self.calib:
                self.calib[key] = calibration_samples(self.loaded.tokenizer, *key, user_texts=self.texts.calibration,
                                                      user_fraction=0.5 if self.texts.is_calibration_mixed else 1.0)
            samples = self.calib[key]
        return quantize_model(model, config, samples, self.show_progress)

    def try_config(self, config: QuantConfig, step: str) -> tuple[Candidate, CausalLM]:
        start = time.perf_counter()
        model = self.build(config)
        config = model.quant_config  # a GGUF candidate's config records the file's formats
        ev = evaluate(model, self.windows, self.ref_scores, label=config.label, show_progress=self.show_progress)
        cand = Candidate(config, step, ev, self.timer.time(model), model.decode_weight_bytes(),
                         time.perf_counter() - start)
        cand.is_within_target = self.is_within_target(ev)
        self.result.candidates.append(cand)
        logger.info("%s (%s): selection loss %+.2f%% %s, %.0f MB, decode %.1f ms/token, %.0f s%s", config.label, step,
                    ev.ppl_loss * 100, format_interval(ev.loss_interval), cand.weight_bytes / 1e6, cand.decode_ms,
                    cand.seconds, ", within target" if cand.is_within_target else "")
        if self.report_dir is not None:
            write_report(self.result, self.space, self.report_dir)
        return cand, model

    def is_within_target(self, ev: EvalResult) -> bool:
        """The upper end of the selection interval within the target; with the user's text
        beside the built-in domains, on that text alone as well, so that the mix cannot hide a
        loss on it."""
        if ev.loss_interval[1] > self.space.max_loss:
            return False
        return not self.texts.is_mixed or ev.loss_interval_per_domain[USER_DOMAIN][1] <= self.space.max_loss

    def first_within(self, configs: list[QuantConfig], step: str | None = None
                     ) -> tuple[Candidate, CausalLM] | None:
        """Try ``configs`` in order; the first within the target, with its model."""
        for config in configs:
            cand, model = self.try_config(config, step or walk_step(config))
            if cand.is_within_target:
                return cand, model
            del model
        return None

    def by_bytes(self, configs: list[QuantConfig]) -> list[QuantConfig]:
        # A GGUF candidate's bytes depend on the file's formats, read once here.
        configs = [self.gguf_config() if c.is_gguf_native and not c.tensor_formats else c for c in configs]
        return sorted(configs, key=lambda c: estimate_weight_bytes(self.reference, c))

    def gguf_config(self) -> QuantConfig:
        """The GGUF candidate with its tensor formats, read from the file."""
        return self.build(QuantConfig(method="gguf")).quant_config

    def run(self) -> tuple[Candidate, CausalLM] | None:
        space = self.space
        if space.candidates:
            return self.first_within(self.by_bytes(space.explicit_configs()), "explicit")
        smallest_group: list[Candidate] = []
        for group_size in space.ordered_group_sizes():
            found = self.first_within([space.int4(m, group_size) for m in space.methods])
            if found:
                return found
            smallest_group = self.result.candidates[-len(space.methods):]
        # The dearer directions, visited together in order of bytes: nested INT8 sets grow
        # with each kind added, and a large set can cost more than INT6 everywhere.
        dearer: list[QuantConfig] = []
        if space.num_int8_sets:
            base = min(smallest_group, key=lambda c: c.eval.ppl_loss).config
            dearer += [replace(base, int8_linears=s) for s in self.int8_sets(base)]
        if space.include_int6:
            dearer += [space.int6(8), space.int6(16)]
        if space.include_gguf and self.gguf_path is not None:
            dearer.append(QuantConfig(method="gguf"))
        return self.first_within(self.by_bytes(dearer))

    def int8_sets(self, base: QuantConfig) -> tuple[tuple[str, ...], ...]:
        """Nested sets of the kinds of linear whose INT8 copy saves the most KL per byte, ranked
        with RTN at ``base``'s group size on the first selection windows."""
        ranking = self.windows.head(self.space.num_ranking_windows)
        self.result.int8_gains = rank_int8_linears(
            self.loaded, self.state, self.windows.subset(ranking), self.ref_scores.subset(ranking),
            QuantConfig(method="rtn", group_size=base.group_size, sym=base.sym, float_zeros=base.float_zeros,
                        lm_head_bits=base.lm_head_bits), self.show_progress)
        logger.info("INT8 ranking: %s", ", ".join(g.name for g in self.result.int8_gains))
        return nested_int8_sets(self.result.int8_gains, self.space.num_int8_sets)


def auto_quantize(loaded: LoadedModel, space: AutoSearchSpace, timer: DecodeTimer, show_progress: bool = True,
                  report_dir: Path | None = None, gguf_path: Path | None = None,
                  texts: QuantTexts = QuantTexts()) -> tuple[AutoResult, CausalLM | None]:
    """Walk the search space on ``texts.selection``; return the result and the chosen model (or
    None).

    The choice is scored once on ``texts.test`` afterwards (``result.test``); GPTQ and AWQ
    calibrate on ``texts``' calibration part. ``timer`` times each
    candidate's decoding. With ``report_dir`` the report is rewritten after every candidate,
    so an interrupted search keeps what it measured. With ``gguf_path``, the GGUF file the
    model was converted from, the file's own blocks are one more candidate."""
    seq_len = min(space.eval_seq_len, loaded.config.max_position_embeddings)
    walk = _Walk(loaded, space, timer, EvalWindows.for_set(loaded.tokenizer, texts.selection, seq_len), texts,
                 show_progress, report_dir, gguf_path)
    found = walk.run()
    result = walk.result
    if found is None:
        return result, None
    result.best, model = found
    if space.num_timing_rounds > 0:
        logger.info("timing the choice and the reference, %d interleaved rounds", space.num_timing_rounds)
        result.reference_decode_ms, result.best.decode_ms = timer.time_interleaved([loaded.model, model],
                                                                                   space.num_timing_rounds)
        result.best.is_retimed = True
    # Scored once, after the choice is final: nothing below feeds back into the walk.
    test_windows = EvalWindows.for_set(loaded.tokenizer, texts.test, seq_len)
    result.test = compare(loaded.model, model, test_windows, label=result.best.config.label,
                          show_progress=show_progress)[1]
    logger.info("test set: loss %+.2f%% %s (%s)", result.test.ppl_loss * 100, format_interval(result.test.loss_interval),
                "pass" if result.is_test_passed else "miss")
    if report_dir is not None:
        write_report(result, space, report_dir)
    return result, model


def report_markdown(result: AutoResult, space: AutoSearchSpace) -> str:
    ci = f"{CONFIDENCE:.0%} interval"
    lines = []
    if result.texts:
        lines += [f"Text: {result.texts_how}.", "", "| part | what it holds |", "|---|---|"]
        lines += [f"| {part} | {held} |" for part, held in result.texts.items()]
        lines.append("")
    per_domain = ", ".join(f"{d} {n}" for d, n in result.reference.num_tokens_per_domain.items())
    lines += [f"Reference: perplexity {result.reference.ppl:.4f} over {result.reference.num_tokens} selection tokens "
             f"({per_domain}); "
             f"decode {result.reference_decode_ms:.1f} ms/token; weights {result.reference_weight_bytes / 1e6:.0f} MB. "
             f"Target: perplexity loss <= {space.max_loss * 100:.2f}%, judged by the upper end of the selection "
             "interval" + (" (overall, and on your text alone)" if USER_DOMAIN in result.reference.num_tokens_per_domain
                           and len(result.reference.num_tokens_per_domain) > 1 else "") + ".", "",
             f"| step | config | selection loss | {ci} | mean KL | top-1 agree | weights MB | decode ms/tok | "
             "speedup | search s | within target |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in result.candidates:
        e = c.eval
        mark = "**chosen**" if c is result.best else ("yes" if c.is_within_target else "no")
        lines.append(f"| {c.step} | {c.config.label} | {e.ppl_loss * 100:+.2f}% | {format_interval(e.loss_interval)} | "
                     f"{e.mean_kl:.5f} | {e.top1_agreement * 100:.2f}% | {c.weight_bytes / 1e6:.0f} | "
                     f"{c.decode_ms:.1f}{'*' if c.is_retimed else ''} | {result.reference_decode_ms / c.decode_ms:.2f}x | "
                     f"{c.seconds:.0f} | {mark} |")
    lines.append("")
    if any(c.is_retimed for c in result.candidates):
        lines += [f"\\* median of {space.num_timing_rounds} interleaved rounds with the reference (the reference's "
                  "time too); other times are single runs.", ""]
    if result.int8_gains:
        lines += [f"INT8 sensitivity (RTN, one kind of linear at INT8 in every layer, first {space.num_ranking_windows} "
                  "selection windows of each domain):", "",
                  "| linear | mean KL saved | extra MB | KL saved per MB |", "|---|---|---|---|"]
        lines += [f"| {g.name} | {g.kl_saved:.5f} | {g.extra_bytes / 1e6:.1f} | {g.kl_saved_per_mb:.5f} |"
                  for g in result.int8_gains]
        lines.append("")
    if result.best is None:
        lines.append(f"NO configuration met the target of {space.max_loss * 100:.2f}% perplexity loss.")
        return "\n".join(lines)
    best = result.best
    lines.append(f"Chosen on the selection set: {best.config.label} ({best.eval.ppl_loss * 100:+.2f}% "
                 f"{format_interval(best.eval.loss_interval)}, {best.decode_ms:.1f} ms/token, "
                 f"{best.weight_bytes / 1e6:.0f} MB).")
    if result.test is not None:
        t = result.test
        lines += ["", f"Test set, scored once for the choice ({t.num_tokens} tokens; never used to choose):", "",
                  f"| domain | tokens | test loss | {ci} | mean KL | top-1 agree |", "|---|---:|---:|---|---:|---:|"]
        for domain, loss in t.ppl_loss_per_domain.items():
            lines.append(f"| {domain} | {t.num_tokens_per_domain[domain]} | {loss * 100:+.2f}% | "
                         f"{format_interval(t.loss_interval_per_domain[domain])} | {t.mean_kl_per_domain[domain]:.5f} | "
                         f"{t.top1_agreement_per_domain[domain] * 100:.2f}% |")
        lines.append(f"| **overall** | {t.num_tokens} | {t.ppl_loss * 100:+.2f}% | {format_interval(t.loss_interval)} | "
                     f"{t.mean_kl:.5f} | {t.top1_agreement * 100:.2f}% |")
        lines += ["", f"Test: **{'pass' if result.is_test_passed else 'miss'}** (every domain's loss within "
                  f"{space.max_loss * 100:.2f}%: {'yes' if result.is_test_passed else 'no'})."]
    return "\n".join(lines)


def plot(result: AutoResult, path: Path) -> None:
    """Selection loss (with its interval) against decode latency, marker area proportional to
    size; the choice's test loss as a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for c in result.candidates:
        color = "tab:green" if c.is_within_target else "tab:red"
        lo, hi = c.eval.loss_interval
        loss = c.eval.ppl_loss * 100
        # A percentile interval need not contain the point estimate; draw what lies on each side.
        ax.errorbar(c.decode_ms, loss, yerr=[[max(loss - lo * 100, 0)], [max(hi * 100 - loss, 0)]], color=color,
                    alpha=0.5, lw=1)
        ax.scatter(c.decode_ms, loss, s=c.weight_bytes / 2e6, color=color, alpha=0.6,
                   edgecolors="black" if c is result.best else "none", linewidths=2)
        ax.annotate(c.config.label, (c.decode_ms, loss), fontsize=7, xytext=(4, 4), textcoords="offset points")
    if result.best is not None and result.test is not None:
        ax.scatter(result.best.decode_ms, result.test.ppl_loss * 100, marker="*", s=160, color="tab:blue",
                   label="choice on the test set")
        ax.legend(fontsize=8)
    ax.axhline(result.max_loss * 100, color="gray", lw=0.8, ls="--")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("decode latency (ms/token, lower is faster)")
    ax.set_ylabel("perplexity loss vs reference (%)")
    ax.set_title(f"reference: {result.reference_decode_ms:.1f} ms/token, selection ppl {result.reference.ppl:.3f}"
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
        "candidates": [{"config": c.config.to_dict(), "label": c.config.label, "step": c.step,
                        "selection": c.eval.to_dict(), "decode_ms": c.decode_ms, "weight_bytes": c.weight_bytes,
                        "seconds": c.seconds, "is_within_target": c.is_within_target, "is_retimed": c.is_retimed}
                       for c in result.candidates],
        "best": None if result.best is None else result.best.config.label,
        "test": None if result.test is None else result.test.to_dict(),
        "is_test_passed": result.is_test_passed,
        "int8_gains": [g.to_dict() for g in result.int8_gains],
        "texts": {"how": result.texts_how, **result.texts,
                  "selection_tokens_per_domain": result.reference.num_tokens_per_domain,
                  "test_tokens_per_domain": None if result.test is None else result.test.num_tokens_per_domain},
    }
    write_json(report_dir / "report.json", payload)
    plot(result, report_dir / "report.png")
    return markdown
