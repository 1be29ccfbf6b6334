"""`quantize --auto` on the user's own text: the split into calibration, selection and test
parts, the acceptance rule when mixed with the built-in sets, and bad input refused."""

from __future__ import annotations

import json
import random

import pytest

from fastdraft.cli import main
from fastdraft.engine.loader import load_model
from fastdraft.quant import auto, data
from fastdraft.quant.auto import AutoSearchSpace, auto_quantize
from fastdraft.quant.data import (SELECTION, TEST, USER_DOMAIN, EvalText, GivenTexts, calibration_samples,
                                  given_texts, split_texts)
from fastdraft.quant.evaluate import EvalResult, EvalWindows, evaluate
from fastdraft.engine.timing import DecodeStepTimer
from tests.test_cli import _fails_cleanly

SEQ_LEN = 32


def _text(seed: int, num_lines: int) -> str:
    rng = random.Random(seed)
    words = ["stack", "queue", "apple", "river", "def", "return", "value", "(", ")", ":", "=", "+", "1", "2"]
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(num_lines)) + "\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return load_model(tiny_models.dir("llama"), dtype="fp32").tokenizer


def _names(part) -> list[str]:
    return [t.name for t in (part.given if isinstance(part, GivenTexts) else part)]


def test_files_are_dealt_to_disjoint_parts_the_same_way_for_a_seed(tokenizer):
    texts = [EvalText(f"file{i}.py", _text(i, 30)) for i in range(12)]
    split = split_texts(tokenizer, texts, SEQ_LEN, seed=1)
    parts = [_names(split.calibration), _names(split.selection), _names(split.test)]
    assert all(parts) and sorted(sum(parts, [])) == sorted(t.name for t in texts)  # each file in one part
    assert "by file, seed 1" in split.how
    assert all(t.domain == USER_DOMAIN for t in split.selection.given + split.test.given)
    again = split_texts(tokenizer, texts, SEQ_LEN, seed=1)
    assert [_names(again.selection), _names(again.test)] == parts[1:]
    other = split_texts(tokenizer, texts, SEQ_LEN, seed=2)
    assert [_names(other.selection), _names(other.test)] != parts[1:]
    # The scored parts get about two fifths of the tokens each, calibration the rest.
    total = sum(len(tokenizer.encode(t.text)) for t in texts)
    assert 0.25 * total < split.selection.num_tokens < 0.55 * total
    assert 0.25 * total < split.test.num_tokens < 0.55 * total


def test_a_large_part_is_scored_a_little_from_each_file(tokenizer, monkeypatch):
    monkeypatch.setattr(data, "SPLIT_MAX_TOKENS", {"selection": 256, "test": 512})
    texts = [EvalText(f"file{i}.py", _text(i, 30)) for i in range(12)]
    split = split_texts(tokenizer, texts, SEQ_LEN)
    windows = EvalWindows.for_set(tokenizer, split.selection, SEQ_LEN)
    assert len(split.selection.given) >= 3 and split.selection.num_tokens > 256
    assert {w.text for w in windows.windows} == set(_names(split.selection))  # every file, a little of each
    assert windows.num_tokens <= 256


def test_one_file_is_split_by_window(tokenizer):
    text = EvalText("notes.md", _text(0, 200))
    split = split_texts(tokenizer, [text], SEQ_LEN, seed=0)
    assert "by window" in split.how
    pieces = {t.name: t.text for t in split.calibration + split.selection.given + split.test.given}
    assert "".join(pieces[f"notes.md#{i}"] for i in range(len(pieces))) == text.text  # disjoint, and all of it
    windows = EvalWindows.for_set(tokenizer, split.selection, SEQ_LEN).windows
    assert all(w.ids.shape[1] <= SEQ_LEN for w in windows) and len(windows) >= 4


def test_too_few_files_for_their_parts_fall_back_to_windows(tokenizer):
    # Three files, one of them a single line: by file, a part would hold too few windows.
    texts = [EvalText("a", _text(1, 150)), EvalText("b", _text(2, 150)), EvalText("c", "x = 1\n")]
    split = split_texts(tokenizer, texts, SEQ_LEN)
    assert "by window" in split.how


def test_a_text_too_short_to_split_is_refused(tokenizer):
    with pytest.raises(ValueError, match="too short to split"):
        split_texts(tokenizer, [EvalText("short", _text(0, 5))], SEQ_LEN)


def test_given_parts_stay_apart_and_the_rest_stays_built_in(tokenizer, tmp_path):
    a, b = EvalText(str(tmp_path / "a.txt"), _text(1, 100)), EvalText(str(tmp_path / "b.txt"), _text(2, 100))
    texts = given_texts(tokenizer, None, [a], [b], SEQ_LEN)
    assert _names(texts.selection) == [a.name] and _names(texts.test) == [b.name] and texts.calibration == ()
    assert "built-in calibration" in texts.describe()["calibration"]
    with pytest.raises(ValueError, match="both the selection and the test"):
        given_texts(tokenizer, None, [a], [a], SEQ_LEN)
    with pytest.raises(ValueError, match="too short"):
        given_texts(tokenizer, None, [EvalText("tiny", "x = 1")], [b], SEQ_LEN)
    mixed = given_texts(tokenizer, [a], None, [b], SEQ_LEN, mix_builtin=True)
    assert mixed.test.builtin is TEST and mixed.selection is SELECTION and mixed.is_calibration_mixed


def test_calibration_draws_from_the_users_text(tokenizer):
    text = EvalText("mine", _text(3, 100))
    ids = tokenizer.encode("\n\n".join([text.text]))
    samples = calibration_samples(tokenizer, 4, 16, seed=0, user_texts=(text,))
    joined = " ".join(map(str, ids))
    assert all(" ".join(map(str, s[0].tolist())) in joined for s in samples)
    mixed = calibration_samples(tokenizer, 4, 16, seed=0, user_texts=(text,), user_fraction=0.5)
    assert sum(" ".join(map(str, s[0].tolist())) in joined for s in mixed) == 2


def _shifted(user_loss: float):
    """``evaluate`` with the user's windows ``user_loss`` nats a token worse and the others exact."""
    def score(*args, **kwargs) -> EvalResult:
        result = evaluate(*args, **kwargs)
        windows = [w.__class__(w.text, w.domain, w.num_tokens, w.ref_nll + (user_loss * w.num_tokens
                                                                             if w.domain == USER_DOMAIN else 0.0),
                               w.ref_nll) for w in result.windows]
        return EvalResult.from_windows(result.label, windows, has_reference=True)
    return score


def test_mixed_in_a_candidate_must_also_meet_the_target_on_the_users_text(tiny_models, monkeypatch):
    loaded = load_model(tiny_models.dir("llama"), dtype="fp32")
    user = [EvalText(f"f{i}", _text(i, 60)) for i in range(6)]
    space = AutoSearchSpace(candidates=("method=rtn,group_size=32",), max_loss=0.05, num_decode_tokens=2,
                            num_timing_rounds=0, eval_seq_len=SEQ_LEN)
    mixed = split_texts(loaded.tokenizer, user, SEQ_LEN, mix_builtin=True)
    assert mixed.is_mixed
    # 0.2 nats a token on the user's text alone: diluted overall, caught on the user's domain.
    monkeypatch.setattr(auto, "evaluate", _shifted(0.2))
    result, model = auto_quantize(loaded, space, DecodeStepTimer(2), show_progress=False, texts=mixed)
    cand, = result.candidates
    assert set(cand.eval.ppl_loss_per_domain) == {"code", "prose", USER_DOMAIN}
    assert cand.eval.loss_interval_per_domain[USER_DOMAIN][1] > space.max_loss and model is None
    monkeypatch.setattr(auto, "evaluate", _shifted(0.0))
    result, model = auto_quantize(loaded, space, DecodeStepTimer(2), show_progress=False, texts=mixed)
    assert model is not None and set(result.test.ppl_loss_per_domain) == {"code", "prose", USER_DOMAIN}


@pytest.fixture
def text_dir(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    for i in range(5):
        (folder / f"part{i}.txt").write_text(_text(i, 200), encoding="utf-8")
    return folder


def test_quantize_auto_on_a_text_dir_reports_what_went_where(capsys, llama_dir, text_dir, tmp_path):
    report = tmp_path / "report"
    assert main(["quantize", "--model", str(llama_dir), "--dtype", "fp32", "--auto", "--text-dir", str(text_dir),
                 "--candidates", "method=rtn,group_size=32", "--max-loss", "90%", "--report-dir", str(report)]) == 0
    markdown = (report / "report.md").read_text()
    assert "your text, split by file, seed 0" in markdown and "| selection | " in markdown
    payload = json.loads((report / "report.json").read_text())
    named = " ".join(payload["texts"][part] for part in ("calibration", "selection", "test"))
    assert all(f"part{i}.txt" in named for i in range(5))
    assert set(payload["texts"]["test_tokens_per_domain"]) == {USER_DOMAIN}
    assert payload["test"]["loss_interval"] is not None


@pytest.mark.parametrize("make, match", [
    (lambda d: d, "holds no files"),  # an empty folder
    (lambda d: (d / "short.txt").write_text("x = 1\n") and d, "too short to split"),
    (lambda d: (d / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 999) and d, "not UTF-8"),
])
def test_bad_text_is_refused_in_one_line_and_nothing_is_written(capsys, llama_dir, tmp_path, make, match):
    folder = tmp_path / "texts"
    folder.mkdir()
    make(folder)
    out = tmp_path / "out" / "q"
    _fails_cleanly(capsys, ["quantize", "--model", str(llama_dir), "--auto", "--text-dir", str(folder),
                            "--output", str(out), "--report-dir", str(tmp_path / "out" / "r")], match)
    assert not (tmp_path / "out").exists()


def test_text_flags_that_do_not_go_together(capsys, llama_dir, text_dir):
    _fails_cleanly(capsys, ["quantize", "--model", str(llama_dir), "--auto", "--text-dir", str(text_dir),
                            "--test-text", str(text_dir / "part0.txt")], "not both")
    _fails_cleanly(capsys, ["quantize", "--model", str(llama_dir), "--auto", "--mix-builtin"], "needs your text")
    _fails_cleanly(capsys, ["quantize", "--model", str(llama_dir), "--output", "x", "--text-dir", str(text_dir)],
                   "need --auto")
