"""`fastdraft eval --text`: scoring the user's own files, and refusing what is not text."""

from __future__ import annotations

import json

import pytest

from fastdraft.cli import main
from fastdraft.engine.loader import load_model
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.data import EvalText, read_text_files
from fastdraft.quant.evaluate import EvalWindows, compare, evaluate, score_reference
from fastdraft.quant.quantizer import quantize_model
from tests.test_cli import _fails_cleanly

CODE = "def add(a, b):\n    return a + b\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n" * 3
PROSE = "Ünïcödé prose, with accents and 漢字: the quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture
def text_files(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "code.py").write_text(CODE, encoding="utf-8")
    (folder / "prose.txt").write_text(PROSE, encoding="utf-8")
    (folder / ".hidden").write_text("skipped")
    return folder


def test_eval_text_scores_each_file_against_the_reference(capsys, llama_dir, text_files, tmp_path):
    out_json = tmp_path / "eval.json"
    argv = ["eval", "--model", str(llama_dir), "--dtype", "fp32", "--quant", "method=rtn,group_size=32",
            "--text", str(text_files / "code.py"), "--text", str(text_files / "prose.txt"),
            "--seq-len", "16", "--json", str(out_json)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "code.py" in out and "prose.txt" in out and "**overall**" in out
    assert "mean KL" in out
    reference, result = json.loads(out_json.read_text())
    assert set(result["num_tokens_per_text"]) == {str(text_files / "code.py"), str(text_files / "prose.txt")}
    assert sum(result["num_tokens_per_text"].values()) == result["num_tokens"] == reference["num_tokens"]
    assert result["mean_kl"] > 0 and 0 < result["top1_agreement"] <= 1
    assert result["ref_ppl"] == pytest.approx(reference["ppl"])


def test_eval_text_dir_without_a_candidate_reports_perplexity(capsys, llama_dir, text_files):
    assert main(["eval", "--model", str(llama_dir), "--dtype", "fp32", "--text-dir", str(text_files),
                 "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "code.py" in out and "prose.txt" in out and ".hidden" not in out
    assert "mean KL" not in out  # nothing to compare with


def test_whole_files_are_scored_not_only_their_start(llama_dir):
    loaded = load_model(llama_dir, dtype="fp32")
    long_text = [EvalText("long", CODE * 20)]
    whole = EvalWindows.build(loaded.tokenizer, long_text, seq_len=16, max_tokens_per_text=None)
    assert whole.num_tokens > EvalWindows.build(loaded.tokenizer, long_text, seq_len=16).num_tokens


def test_streamed_comparison_matches_the_stored_reference(llama_dir):
    reference = load_model(llama_dir, dtype="fp32")
    candidate = load_model(llama_dir, dtype="fp32")
    quantize_model(candidate.model, QuantConfig(method="rtn", group_size=32), show_progress=False)
    windows = EvalWindows.build(reference.tokenizer, [EvalText("a", CODE), EvalText("b", PROSE)], seq_len=16)
    stored = score_reference(reference.model, windows, show_progress=False)
    expected = evaluate(candidate.model, windows, stored, label="q", show_progress=False)
    ref_result, result = compare(reference.model, candidate.model, windows, label="q", show_progress=False)
    assert ref_result.ppl == pytest.approx(stored.result.ppl, rel=1e-6)
    assert result.ppl == pytest.approx(expected.ppl, rel=1e-6)
    assert result.top1_agreement == pytest.approx(expected.top1_agreement, abs=1e-3)
    assert result.loss_interval == pytest.approx(expected.loss_interval, rel=1e-6, abs=1e-9)
    # The stored reference keeps its top tokens and a bucket for the rest: a lower bound on
    # the streamed full-vocabulary KL (this random model's distributions are nearly flat), and
    # the same KL once the top tokens cover the vocabulary.
    assert 0 < expected.mean_kl <= result.mean_kl + 1e-6
    whole = score_reference(reference.model, windows, show_progress=False, top_k=reference.config.vocab_size)
    assert evaluate(candidate.model, windows, whole, show_progress=False).mean_kl == \
        pytest.approx(result.mean_kl, rel=1e-4)
    assert result.mean_kl_per_text.keys() == {"a", "b"}


def test_missing_file(capsys, llama_dir, tmp_path):
    _fails_cleanly(capsys, ["eval", "--model", str(llama_dir), "--text", str(tmp_path / "nope.txt")],
                   "no such file")


def test_binary_file(capsys, llama_dir, tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    _fails_cleanly(capsys, ["eval", "--model", str(llama_dir), "--text", str(binary)], "binary file")


def test_file_that_is_not_utf8(capsys, llama_dir, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café crème".encode("latin-1") * 50)
    _fails_cleanly(capsys, ["eval", "--model", str(llama_dir), "--text", str(latin1)], "not UTF-8")


def test_text_shorter_than_one_window(capsys, llama_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    err = _fails_cleanly(capsys, ["eval", "--model", str(llama_dir), "--text", str(short), "--seq-len", "512"],
                         "fewer than one window")
    assert "short.txt" in err and "--seq-len" in err


def test_bad_folders(capsys, llama_dir, tmp_path):
    _fails_cleanly(capsys, ["eval", "--model", str(llama_dir), "--text-dir", str(tmp_path / "nope")],
                   "no such folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails_cleanly(capsys, ["eval", "--model", str(llama_dir), "--text-dir", str(empty)], "holds no files")
    _fails_cleanly(capsys, ["eval", "--model", str(llama_dir), "--text", str(empty)], "is a folder")


def test_bad_text_fails_before_any_model_loads(capsys, monkeypatch, tmp_path):
    import fastdraft.engine.loader

    def never(*args, **kwargs):
        pytest.fail("a model was loaded before the text files were checked")

    monkeypatch.setattr(fastdraft.engine.loader, "load_model", never)
    _fails_cleanly(capsys, ["eval", "--text", str(tmp_path / "nope.txt")], "no such file")


def test_each_file_is_read_once(text_files):
    texts = read_text_files([text_files / "code.py"], [text_files])
    assert [t.name for t in texts] == [str(text_files / "code.py"), str(text_files / "prose.txt")]
