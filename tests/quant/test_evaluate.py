"""Evaluation metrics, the three text sets and the automatic quantization walk, on a tiny model."""

import json
import re
from dataclasses import replace

import pytest
import torch

from fastdraft.engine.loader import load_model
from fastdraft.engine.timing import DecodeStepTimer
from fastdraft.quant import auto
from fastdraft.quant.auto import (AutoResult, AutoSearchSpace, Candidate, auto_quantize, estimate_weight_bytes,
                                  report_markdown)
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.data import (SELECTION, SELECTION_CODE_FILES, TEST, TEST_CODE_FILES, EvalText, QuantTexts,
                                  TextSet, calibration_code_files, calibration_samples, prose_files, stdlib_root)
from fastdraft.quant.evaluate import (EvalResult, EvalWindows, WindowScore, evaluate, full_kl,
                                      loss_interval, score_reference, topk_kl)
from fastdraft.quant.quantizer import quantize_model

TEXTS = [EvalText("code", "def add(a, b):\n    return a + b\n" * 30, "code"),
         EvalText("prose", "The quick brown fox jumps over the lazy dog. " * 30, "prose")]


class FixedSet(TextSet):
    """A held-out set of given texts, counting how often it is read."""

    def __init__(self, texts: list[EvalText]) -> None:
        super().__init__("fixed", (), max_tokens_per_text=64)
        object.__setattr__(self, "_texts", texts)
        object.__setattr__(self, "reads", [])

    def texts(self) -> list[EvalText]:
        self.reads.append(1)
        return self._texts


def _documents(split: str) -> dict[str, set[str]]:
    """Per prose file of ``split``: its header (the work it is from) and its long lines of
    text (reST field lists and link targets, boilerplate shared by a project's documents, aside)."""
    docs = {}
    for path in prose_files(split):
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
        docs[path.name] = {lines[0].split(" — ")[0].split(",")[0]} | {
            line for line in lines[1:] if len(line) > 60 and not line.startswith((":", ".."))}
    return docs


def test_the_three_sets_share_no_file_and_no_document():
    code = {"calibration": {str(p.relative_to(stdlib_root())) for p in calibration_code_files()},
            "selection": set(SELECTION_CODE_FILES), "test": set(TEST_CODE_FILES)}
    prose = {split: _documents(split) for split in ("calibration", "selection", "test")}
    splits = list(code)
    for i, a in enumerate(splits):
        assert code[a] and prose[a]
        for b in splits[i + 1:]:
            assert not code[a] & code[b], (a, b)
            assert not set(prose[a]) & set(prose[b]), (a, b)  # no file in two sets
            for name_a, doc_a in prose[a].items():
                for name_b, doc_b in prose[b].items():
                    assert not doc_a & doc_b, (name_a, name_b)  # no work, and no passage, in two sets


def test_each_held_out_set_has_code_and_prose():
    for text_set in (SELECTION, TEST):
        texts = text_set.texts()
        assert {t.domain for t in texts} == {"code", "prose"}
        assert len({t.name for t in texts if t.domain == "prose"}) >= 3


def test_prose_headers_name_a_public_domain_source():
    for split in ("calibration", "selection", "test"):
        for path in prose_files(split):
            first = path.read_text(encoding="utf-8").splitlines()[0]
            assert re.match(r"# .+ — .+public domain", first), path


def test_calibration_samples_are_deterministic(tiny_loaded):
    a = calibration_samples(tiny_loaded.tokenizer, 6, 64, seed=3)
    b = calibration_samples(tiny_loaded.tokenizer, 6, 64, seed=3)
    assert len(a) == 6 and all(x.shape == (1, 64) for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_model_against_itself_has_zero_kl_and_full_agreement(tiny_loaded):
    windows = EvalWindows.build(tiny_loaded.tokenizer, TEXTS, seq_len=64)
    ref = score_reference(tiny_loaded.model, windows, show_progress=False)
    same = evaluate(tiny_loaded.model, windows, ref, show_progress=False)
    assert same.mean_kl == pytest.approx(0.0, abs=1e-3)
    assert same.top1_agreement == 1.0 and same.ppl == pytest.approx(ref.result.ppl, rel=1e-4)
    assert same.num_tokens == windows.num_tokens
    assert set(same.ppl_per_text) == {"code", "prose"}


def test_quantized_model_has_positive_kl_and_is_deterministic(tiny_models):
    reference = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    windows = EvalWindows.build(reference.tokenizer, TEXTS, seq_len=64)
    ref = score_reference(reference.model, windows, show_progress=False)
    quantized = quantize_model(load_model(tiny_models.dir("qwen2"), dtype="fp32").model,
                               QuantConfig(group_size=-1), show_progress=False)
    first = evaluate(quantized, windows, ref, show_progress=False)
    second = evaluate(quantized, windows, ref, show_progress=False)
    assert first.mean_kl > 1e-4 and first.top1_agreement < 1.0
    assert first.to_dict() == second.to_dict()


def _windows(domain: str, diffs: list[float], tokens: int = 100) -> list[WindowScore]:
    return [WindowScore(f"{domain}{i}", domain, tokens, 200.0 + d, 200.0) for i, d in enumerate(diffs)]


def test_loss_interval_brackets_the_loss_and_narrows_with_more_windows():
    rng = torch.Generator().manual_seed(0)
    diffs = (1.0 + torch.randn(400, generator=rng)).tolist()  # nll per window 1 nat above the reference
    few, many = _windows("code", diffs[:20]), _windows("code", diffs)
    point = EvalResult.from_windows("x", many, has_reference=True).ppl_loss
    lo, hi = loss_interval(many)
    assert lo < point < hi
    assert hi - lo < (loss_interval(few)[1] - loss_interval(few)[0]) / 2  # ~1/sqrt(20) of the width
    assert loss_interval(many) == loss_interval(many)  # seeded
    # Identical windows leave nothing to resample.
    flat = loss_interval(_windows("code", [0.5] * 10))
    assert flat[0] == pytest.approx(flat[1]) == pytest.approx(torch.tensor(0.005).expm1().item())


def test_intervals_are_per_domain_and_stratified():
    windows = _windows("code", [0.0, 0.2, 0.1, 0.3]) + _windows("prose", [3.0, 3.2, 2.8, 3.1])
    result = EvalResult.from_windows("x", windows, has_reference=True)
    assert set(result.loss_interval_per_domain) == {"code", "prose"}
    assert result.loss_interval_per_domain["code"][1] < result.loss_interval_per_domain["prose"][0]
    lo, hi = result.loss_interval
    assert result.loss_interval_per_domain["code"][1] < lo <= result.ppl_loss <= hi
    assert result.ppl_loss_per_domain["code"] < result.ppl_loss < result.ppl_loss_per_domain["prose"]


def test_topk_kl_is_the_full_kl_at_full_k_and_a_lower_bound_below():
    rng = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(8, 50, generator=rng) * 3, -1)
    model = torch.log_softmax(ref + 0.3 * torch.randn(8, 50, generator=rng), -1)
    full = full_kl(ref, model)
    top = ref.topk(50, -1)
    assert torch.allclose(topk_kl(top.values, top.indices, model), full, atol=1e-5)
    for k in (1, 5, 20):
        top = ref.topk(k, -1)
        partial = topk_kl(top.values, top.indices, model)
        assert (partial <= full + 1e-6).all() and (partial >= 0).all()
    top = ref.topk(20, -1)
    assert topk_kl(top.values, top.indices, model).sum() > 0.9 * full.sum()  # the top tokens hold most of it


def _candidate(group: int, loss: float, decode_ms: float) -> Candidate:
    windows = _windows("code", [loss * 100] * 4)
    ev = EvalResult.from_windows("x", windows, has_reference=True)
    return Candidate(QuantConfig(group_size=group), "INT4 group size", ev, decode_ms, 1000, 1.0, False)


def test_report_says_clearly_when_nothing_meets_the_target():
    space = AutoSearchSpace(max_loss=0.01)
    result = AutoResult(EvalResult("reference", 100, 10.0, 10.0, 0.0, 1.0), 50.0, 2000,
                        [_candidate(32, 0.05, 20.0), _candidate(128, 0.08, 15.0)])
    markdown = report_markdown(result, space)
    assert "NO configuration met the target" in markdown and "Test set" not in markdown


def timer(space: AutoSearchSpace) -> DecodeStepTimer:
    return DecodeStepTimer(space.num_decode_tokens)


def _space(**kwargs) -> AutoSearchSpace:
    defaults = dict(methods=("rtn",), group_sizes=(-1, 32), num_int8_sets=2, num_ranking_windows=1,
                    num_calib_samples=4, calib_seq_len=32, num_decode_tokens=2, num_timing_rounds=0, eval_seq_len=64)
    return AutoSearchSpace(**{**defaults, **kwargs})


def _losing(*args, **kwargs) -> EvalResult:
    """``evaluate``, with every window 5 nats worse: a random tiny model can gain from rounding,
    and some tests need every candidate to miss the target."""
    result = evaluate(*args, **kwargs)
    windows = [replace(w, nll=w.nll + 5.0) for w in result.windows]
    return EvalResult.from_windows(result.label, windows, has_reference=True)


def test_walk_goes_from_fewest_bytes_to_most_and_stops_at_the_first_within_target(tiny_models, tmp_path,
                                                                                     monkeypatch):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    selection, test = FixedSet(TEXTS), FixedSet(TEXTS)
    # Nothing meets the target: the walk visits every direction once.
    space = _space(max_loss=1e-3)
    with monkeypatch.context() as patch:
        patch.setattr(auto, "evaluate", _losing)
        result, model = auto_quantize(loaded, space, timer(space), show_progress=False,
                                      report_dir=tmp_path / "none", texts=QuantTexts(selection, test))
    assert model is None and result.best is None and result.test is None and not test.reads
    steps = [c.step for c in result.candidates]
    assert steps[:2] == ["INT4 group size"] * 2
    assert [c.config.group_size for c in result.candidates[:2]] == [-1, 32]  # largest groups first
    assert set(steps[2:]) == {"INT8 linears", "INT6 linears", "bf16 head"} and len(steps) == 6
    sizes = [c.weight_bytes for c in result.candidates]
    assert sizes == sorted(sizes)
    assert sizes == [estimate_weight_bytes(loaded.model, c.config) for c in result.candidates]
    assert result.int8_gains and [c.config.int8_linears for c in result.candidates if c.config.int8_linears] == \
        [tuple(g.name for g in result.int8_gains[:i]) for i in (1, 2)]
    assert json.loads((tmp_path / "none" / "report.json").read_text())["best"] is None

    # A loose target: the first (cheapest) candidate is chosen, then scored once on the test set.
    space = _space(max_loss=0.9, num_timing_rounds=2)
    result, model = auto_quantize(loaded, space, timer(space), show_progress=False,
                                  report_dir=tmp_path / "chosen", texts=QuantTexts(selection, test))
    assert [c.config.label for c in result.candidates] == ["rtn-int4-pc-asymf"]
    assert result.best is result.candidates[0] and result.best.is_within_target and result.best.is_retimed
    assert result.best.eval.loss_interval[1] <= space.max_loss
    assert model.quant_config == result.best.config
    assert len(test.reads) == 1 and set(result.test.ppl_loss_per_domain) == {"code", "prose"}
    assert result.is_test_passed == all(v <= 0.9 for v in result.test.ppl_loss_per_domain.values())
    markdown = (tmp_path / "chosen" / "report.md").read_text()
    assert "**chosen**" in markdown and "Test set" in markdown and "| code |" in markdown
    payload = json.loads((tmp_path / "chosen" / "report.json").read_text())
    assert payload["best"] == "rtn-int4-pc-asymf" and payload["test"]["loss_interval_per_domain"]
    assert (tmp_path / "chosen" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_walk_never_reads_the_test_set(tiny_models):
    """The walk's every score and its choice are the same whatever the test set holds; the test
    set is read once, after the choice."""
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    space = _space(max_loss=0.05, methods=("rtn", "gptq"))
    walks = []
    for test_texts in (TEXTS, [EvalText("other", "while True:\n    x = x * 2 + 1\n" * 40, "code")]):
        selection, test = FixedSet(TEXTS), FixedSet(test_texts)
        read_at = []

        class Spy(DecodeStepTimer):
            def time(self, model):
                read_at.append(len(test.reads))  # the test set must still be unread while candidates are timed
                return super().time(model)

        result, _ = auto_quantize(loaded, space, Spy(2), show_progress=False,
                                  texts=QuantTexts(selection, test))
        assert set(read_at) == {0} and len(test.reads) == (1 if result.best else 0)
        walks.append([(c.config.label, c.eval.ppl, c.eval.loss_interval) for c in result.candidates])
    assert walks[0] == walks[1]


def test_explicit_candidates_are_walked_in_order_of_bytes(tiny_models, monkeypatch):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    monkeypatch.setattr(auto, "evaluate", _losing)
    space = _space(max_loss=1e-3, candidates=("method=rtn,bits=8,group_size=-1", "method=rtn,group_size=32"))
    result, _ = auto_quantize(loaded, space, timer(space), show_progress=False,
                              texts=QuantTexts(FixedSet(TEXTS), FixedSet(TEXTS)))
    assert [c.config.label for c in result.candidates] == ["rtn-int4-g32-sym", "rtn-int8-pc-sym"]
    assert {c.step for c in result.candidates} == {"explicit"}


def test_search_space_validation():
    with pytest.raises(ValueError):
        AutoSearchSpace(methods=("rtn", "nope"))
    with pytest.raises(ValueError):
        AutoSearchSpace(max_loss=0.0)
    with pytest.raises(ValueError):
        AutoSearchSpace(group_sizes=())
    with pytest.raises(ValueError, match="scheme"):
        AutoSearchSpace(scheme="nope")
    with pytest.raises(ValueError):
        AutoSearchSpace(candidates=("method=nope",))
    with pytest.raises(ValueError, match="num_int8_sets"):
        AutoSearchSpace(num_int8_sets=8)


def test_gptq_in_the_walk_uses_the_space_dampening():
    space = AutoSearchSpace()
    assert space.int4("gptq", 32).label == "gptq-int4-g32-asymf-damp0.1"
    assert space.int4("rtn", 32).label == "rtn-int4-g32-asymf"
    assert AutoSearchSpace(damp_percent=0.01).int4("gptq", 128).label == "gptq-int4-g128-asymf"
    assert space.int6(16).label == "rtn-int6-g32-sym" and space.int6(16).lm_head_bits == 16


def test_finalists_are_timed_again_in_turns():
    # A machine that gets slower every call: timed one after another, the last model would
    # look slowest; taking turns, each model's median sees the same drift.
    calls = []

    class Drifting(DecodeStepTimer):
        def time(self, model):
            calls.append(model)
            return model + len(calls)  # the "model" is its true latency; the drift is +1 ms per call

    drifting = Drifting(4)
    assert drifting.time_interleaved([10.0, 5.0, 7.0], num_rounds=3) == [14.0, 10.0, 13.0]
    assert calls == [10.0, 5.0, 7.0] * 3


def test_nested_int8_sets():
    from fastdraft.quant.sensitivity import Int8Gain, nested_int8_sets

    gains = [Int8Gain("self_attn.v_proj", 0.5, 10), Int8Gain("self_attn.o_proj", 0.2, 10), Int8Gain("mlp.up_proj", 0.1, 10)]
    assert nested_int8_sets(gains, 2) == (("self_attn.v_proj",), ("self_attn.v_proj", "self_attn.o_proj"))
    assert nested_int8_sets(gains, 7)[-1] == ("self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj")


def test_a_subset_of_the_reference_scores_equals_scoring_the_subset(tiny_loaded):
    windows = EvalWindows.build(tiny_loaded.tokenizer, TEXTS, seq_len=16)
    indices = windows.head(2)
    assert [windows.windows[i].domain for i in indices] == ["code", "code", "prose", "prose"]
    stored = score_reference(tiny_loaded.model, windows, show_progress=False).subset(indices)
    fresh = score_reference(tiny_loaded.model, windows.subset(indices), show_progress=False)
    assert stored.result.to_dict() == fresh.result.to_dict()
    assert all(torch.equal(a, b) for a, b in zip(stored.topk_logprobs, fresh.topk_logprobs))
    assert all(torch.equal(a, b) for a, b in zip(stored.topk_ids, fresh.topk_ids))
