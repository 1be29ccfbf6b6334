"""Evaluation metrics and the automatic quantization flow, on a tiny model."""

import json

import pytest
import torch

from fastdraft.engine.loader import load_model
from fastdraft.engine.timing import GreedyDecodeTimer
from fastdraft.quant import auto
from fastdraft.quant.auto import AutoResult, AutoSearchSpace, Candidate, auto_quantize, report_markdown, write_report
from fastdraft.quant.config import QuantConfig
from fastdraft.quant.data import EVAL_CODE_FILES, EvalText, calibration_code_files, calibration_samples, evaluation_texts
from fastdraft.quant.evaluate import EvalResult, EvalWindows, evaluate, score_reference
from fastdraft.quant.quantizer import quantize_model

TEXTS = [EvalText("code", "def add(a, b):\n    return a + b\n" * 30),
         EvalText("prose", "The quick brown fox jumps over the lazy dog. " * 30)]


def test_held_out_text_is_never_calibration_text():
    names = {p.name for p in calibration_code_files()}
    assert calibration_code_files() and not names & set(EVAL_CODE_FILES)
    names = {t.name for t in evaluation_texts()}
    assert any(n.startswith("stdlib/") for n in names) and any(n.startswith("prose/") for n in names)


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


def _candidate(label_group: int, loss: float, decode_ms: float, max_loss: float) -> Candidate:
    ev = EvalResult("x", 100, 10 * (1 + loss), 10.0, 0.01, 0.9)
    return Candidate(QuantConfig(group_size=label_group), ev, decode_ms, 1000, ev.ppl_loss <= max_loss)


def test_report_says_clearly_when_nothing_meets_the_target():
    space = AutoSearchSpace(max_loss=0.01)
    result = AutoResult(EvalResult("reference", 100, 10.0, 10.0, 0.0, 1.0), 50.0, 2000,
                        [_candidate(32, 0.05, 20.0, 0.01), _candidate(128, 0.08, 15.0, 0.01)])
    assert "NO configuration met the target" in report_markdown(result, space)


def test_auto_flow_keeps_the_fastest_config_within_target(tiny_models, tmp_path, monkeypatch):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    monkeypatch.setattr(auto, "evaluation_texts", lambda: TEXTS)
    space = AutoSearchSpace(methods=("rtn", "gptq"), group_sizes=(32, -1), schemes=("sym", "asym"), max_loss=0.5,
                            num_calib_samples=4, calib_seq_len=32, num_decode_tokens=4)
    result, best_model = auto_quantize(loaded, space, timer(loaded, space), show_progress=False,
                                       report_dir=tmp_path / "partial")
    assert len(result.candidates) == 8
    assert len(json.loads((tmp_path / "partial" / "report.json").read_text())["candidates"]) == 8
    within = [c for c in result.candidates if c.eval.ppl_loss <= space.max_loss]
    assert [c.is_within_target for c in result.candidates] == [c.eval.ppl_loss <= 0.5 for c in result.candidates]
    if within:
        # Ranked by the interleaved re-timing of the finalists; candidates that did not make
        # the finalists keep their single first timing, which noise can make look faster.
        finalists = [c for c in within if c.is_retimed]
        assert 1 <= len(finalists) <= space.max_finalists
        assert result.best is min(finalists, key=lambda c: c.decode_ms)
        assert best_model.quant_config == result.best.config
    else:
        assert result.best is None and best_model is None
    markdown = write_report(result, space, tmp_path / "report")
    assert "| config |" in markdown
    payload = json.loads((tmp_path / "report" / "report.json").read_text())
    assert len(payload["candidates"]) == 8
    assert (tmp_path / "report" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def timer(loaded, space: AutoSearchSpace) -> GreedyDecodeTimer:
    return GreedyDecodeTimer.for_code(loaded.tokenizer, space.num_decode_tokens)


def test_finalists_are_timed_again_in_turns():
    # A machine that gets slower every call: timed one after another, the last model would
    # look slowest; taking turns, each model's median sees the same drift.
    calls = []

    def fake_time_decode(model, num_tokens, prompt_ids):
        calls.append(model)
        return model + len(calls)  # the "model" is its true latency; the drift is +1 ms per call

    drifting = GreedyDecodeTimer([1], 4, time_one=fake_time_decode)
    assert drifting.time_interleaved([10.0, 5.0, 7.0], num_rounds=3) == [14.0, 10.0, 13.0]
    assert calls == [10.0, 5.0, 7.0] * 3


def test_auto_flow_keeps_at_most_max_finalists_and_retimes_them(tiny_models, monkeypatch):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    monkeypatch.setattr(auto, "evaluation_texts", lambda: TEXTS)
    retimed = []

    class SpyTimer(GreedyDecodeTimer):
        def time_interleaved(self, models, num_rounds):
            retimed.append(len(models))
            return super().time_interleaved(models, num_rounds)

    space = AutoSearchSpace(methods=("rtn",), group_sizes=(32, 64, -1), schemes=("asymf",), max_loss=0.99,
                            num_decode_tokens=2, num_timing_rounds=2, max_finalists=2)
    result, best_model = auto_quantize(loaded, space, SpyTimer.for_code(loaded.tokenizer, 2), show_progress=False)
    assert all(c.is_within_target for c in result.candidates)
    assert retimed == [3]  # the reference and two finalists
    assert sum(c.is_retimed for c in result.candidates) == 2
    assert result.best.is_retimed and best_model.quant_config == result.best.config
    assert result.best.decode_ms == min(c.decode_ms for c in result.candidates if c.is_retimed)
    assert "interleaved rounds" in report_markdown(result, space)


def test_explicit_candidates_replace_the_grid():
    space = AutoSearchSpace(candidates=("method=rtn,group_size=32,sym=false", "method=gptq,group_size=128"))
    assert [c.label for c in space.configs()] == ["rtn-int4-g32-asym", "gptq-int4-g128-sym"]
    with pytest.raises(ValueError):
        AutoSearchSpace(candidates=("method=nope",))


def test_search_space_validation():
    with pytest.raises(ValueError):
        AutoSearchSpace(methods=("rtn", "nope"))
    with pytest.raises(ValueError):
        AutoSearchSpace(max_loss=0.0)
    with pytest.raises(ValueError):
        AutoSearchSpace(group_sizes=())
    with pytest.raises(ValueError, match="unknown decoder linear"):
        AutoSearchSpace(int8_linears=((), ("w_proj",)))
    with pytest.raises(ValueError, match="max_finalists"):
        AutoSearchSpace(max_finalists=0)


def test_int8_linear_sets_are_a_grid_dimension():
    space = AutoSearchSpace(methods=("rtn",), group_sizes=(32,), schemes=("asymf",),
                            int8_linears=((), ("v_proj", "o_proj")))
    assert [c.label for c in space.configs()] == ["rtn-int4-g32-asymf", "rtn-int4-g32-asymf-int8[v_proj+o_proj]"]


def test_grid_gptq_uses_the_space_dampening():
    space = AutoSearchSpace(methods=("rtn", "gptq"), group_sizes=(32,), schemes=("asymf",))
    assert [c.label for c in space.configs()] == ["rtn-int4-g32-asymf", "gptq-int4-g32-asymf-damp0.1"]
    space = AutoSearchSpace(methods=("gptq",), group_sizes=(32,), schemes=("asymf",), damp_percent=0.01)
    assert [c.label for c in space.configs()] == ["gptq-int4-g32-asymf"]


def test_int8_sensitivity_ranking_adds_nested_sets_to_the_grid(tiny_models, monkeypatch):
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    monkeypatch.setattr(auto, "evaluation_texts", lambda: TEXTS)
    space = AutoSearchSpace(methods=("rtn",), group_sizes=(-1,), schemes=("sym",), max_loss=0.99,
                            num_decode_tokens=2, num_timing_rounds=0, num_int8_sets=2)
    result, _ = auto_quantize(loaded, space, timer(loaded, space), show_progress=False)
    gains = result.int8_gains
    assert gains and all(g.kl_saved > 0 and g.extra_bytes > 0 for g in gains)
    assert [g.kl_saved_per_mb for g in gains] == sorted((g.kl_saved_per_mb for g in gains), reverse=True)
    names = [g.name for g in gains[:2]]
    expected_sets = [()] + [tuple(names[:i]) for i in range(1, len(names) + 1)]
    assert [c.config.int8_linears for c in result.candidates] == expected_sets
    # The ranking measured what it says: the top kind at INT8 alone saves that much KL.
    top = next(c for c in result.candidates if c.config.int8_linears == (names[0],))
    plain = next(c for c in result.candidates if c.config.int8_linears == ())
    assert plain.eval.mean_kl - top.eval.mean_kl == pytest.approx(gains[0].kl_saved, rel=1e-6)
    assert "INT8 sensitivity" in report_markdown(result, space)


def test_nested_int8_sets():
    from fastdraft.quant.sensitivity import Int8Gain, nested_int8_sets

    gains = [Int8Gain("self_attn.v_proj", 0.5, 10), Int8Gain("self_attn.o_proj", 0.2, 10), Int8Gain("mlp.up_proj", 0.1, 10)]
    assert nested_int8_sets(gains, 2) == (("self_attn.v_proj",), ("self_attn.v_proj", "self_attn.o_proj"))
    assert nested_int8_sets(gains, 7)[-1] == ("self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj")
    with pytest.raises(ValueError, match="num_int8_sets"):
        AutoSearchSpace(num_int8_sets=8)
    with pytest.raises(ValueError, match="explicit candidates"):
        AutoSearchSpace(num_int8_sets=1, candidates=("method=rtn",))
