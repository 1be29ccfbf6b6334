"""The command line: one-line errors with exit status 2, and a real run on a tiny model."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastdraft.cli import main
from fastdraft.models.registry import KNOWN_MODELS


def _fails_cleanly(capsys, argv: list[str], match: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.startswith("fastdraft: error: "), err
    assert err.count("\n") == 1 and err.endswith("\n"), err  # exactly one line
    assert "Traceback" not in err and "usage:" not in err
    assert match in err, err
    assert out == ""
    return err


def test_unknown_model(capsys, isolated_home):
    _fails_cleanly(capsys, ["generate", "--model", "no-such-model", "--prompt", "hi"], "unknown model")


@pytest.mark.parametrize("value", ["0", "-5", "many", "1.5"])
def test_bad_max_tokens(capsys, value):
    _fails_cleanly(capsys, ["generate", "--prompt", "hi", "--max-tokens", value], "--max-tokens")


def test_negative_temperature(capsys):
    _fails_cleanly(capsys, ["generate", "--prompt", "hi", "--temperature", "-0.5"], "temperature")


def test_bad_draft_min_confidence(capsys):
    _fails_cleanly(capsys, ["generate", "--prompt", "hi", "--speculative", "self", "--draft-min-confidence", "1.5"],
                   "min_confidence")


def test_missing_prompt(capsys):
    _fails_cleanly(capsys, ["generate", "--max-tokens", "5"], "--prompt")


@pytest.mark.parametrize("value", ["1.5", "0", "abc"])
def test_bad_top_p(capsys, value):
    _fails_cleanly(capsys, ["generate", "--prompt", "hi", "--top-p", value], "top")


def test_bad_top_k(capsys):
    _fails_cleanly(capsys, ["generate", "--prompt", "hi", "--top-k", "-2"], "top_k")


def test_bad_dtype_and_empty_stop(capsys):
    _fails_cleanly(capsys, ["generate", "--prompt", "hi", "--dtype", "int4"], "--dtype")
    _fails_cleanly(capsys, ["generate", "--prompt", "hi", "--stop", ""], "stop")


def test_no_command_and_unknown_command(capsys):
    _fails_cleanly(capsys, [], "command")
    _fails_cleanly(capsys, ["frobnicate"], "invalid choice")


def test_pull_unknown_model(capsys, isolated_home):
    _fails_cleanly(capsys, ["pull", "no-such-model"], "unknown model")


def test_models_lists_known_names(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert [line.split("\t")[0] for line in out.splitlines()] == list(KNOWN_MODELS)


def test_non_gguf_file(capsys, tmp_path, isolated_home):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    _fails_cleanly(capsys, ["generate", "--model", str(path), "--prompt", "hi"], "is not a GGUF file")


def test_truncated_gguf_file(capsys, tmp_path, isolated_home):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5)
    _fails_cleanly(capsys, ["generate", "--model", str(path), "--prompt", "hi"], "cannot read GGUF file")


def test_folder_without_config(capsys, tmp_path):
    _fails_cleanly(capsys, ["generate", "--model", str(tmp_path), "--prompt", "hi"], "no config.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda(capsys, llama_dir):
    _fails_cleanly(capsys, ["generate", "--model", str(llama_dir), "--prompt", "hi", "--device", "cuda"],
                   "CUDA is not available")


def test_request_longer_than_max_seq_len(capsys, llama_dir):
    _fails_cleanly(capsys, ["generate", "--model", str(llama_dir), "--prompt", "hi there",
                            "--max-tokens", "20", "--max-seq-len", "8", "--dtype", "fp32"], "exceeds")


def test_generate_from_local_hf_folder(capsys, llama_dir, tiny_loaded):
    from fastdraft.generator import TextGenerator
    from fastdraft.sampling_params import SamplingParams

    threads = torch.get_num_threads()
    code = main(["generate", "--model", str(llama_dir), "--prompt", "the cat", "--max-tokens", "12",
                 "--dtype", "fp32", "--threads", str(threads), "--max-seq-len", "64"])
    out, err = capsys.readouterr()
    assert code == 0, err
    expected = TextGenerator(tiny_loaded, 64).generate("the cat", SamplingParams(max_new_tokens=12))
    assert out == expected.text + "\n"
    n_prompt = len(tiny_loaded.tokenizer.encode("the cat"))
    assert err.startswith(f"[{len(expected.token_ids)} tokens | TTFT ")
    assert "tokens/s" in err and f"prompt {n_prompt} tokens]" in err


def test_generate_chats_through_a_template_file(capsys, llama_dir, tiny_loaded, tmp_path):
    from fastdraft.generator import TextGenerator
    from fastdraft.sampling_params import SamplingParams

    template = tmp_path / "turns.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    args = ["generate", "--model", str(llama_dir), "--prompt", "the cat", "--max-tokens", "6", "--dtype", "fp32",
            "--max-seq-len", "64", "--chat"]
    assert main([*args, "--chat-template", str(template)]) == 0
    out, err = capsys.readouterr()
    num_prompt = int(re.search(r"prompt (\d+) tokens", err).group(1))
    original = tiny_loaded.tokenizer.chat_template
    tiny_loaded.tokenizer.set_chat_template(template.read_text())
    try:
        prompt_ids = tiny_loaded.tokenizer.encode("[user] the cat\n[assistant]", add_special_tokens=False)
        expected = TextGenerator(tiny_loaded, 64).generate(prompt_ids, SamplingParams(max_new_tokens=6))
    finally:  # the session's tokenizer gets its own template back
        tiny_loaded.tokenizer.chat_template = original
        tiny_loaded.tokenizer.__dict__.pop("_template", None)
    assert out == expected.text + "\n"
    _fails_cleanly(capsys, [*args, "--chat-template", str(tmp_path / "missing.jinja")], "cannot read the chat template")
    # The template's own variables: a JSON object, with --chat.
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "[assistant]{% if brief %} (brief){% endif %}")
    assert main([*args, "--chat-template", str(template), "--chat-template-kwargs", '{"brief": true}']) == 0
    _, err = capsys.readouterr()
    assert int(re.search(r"prompt (\d+) tokens", err).group(1)) > num_prompt  # " (brief)" was rendered
    _fails_cleanly(capsys, [*args, "--chat-template-kwargs", "{not json"], "expected a JSON object")
    _fails_cleanly(capsys, [*args[:-1], "--chat-template-kwargs", '{"brief": true}'], "needs --chat")


def test_subprocess_error_has_no_traceback(tmp_path):
    env = dict(os.environ, FASTDRAFT_HOME=str(tmp_path))
    repo_root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-m", "fastdraft.cli", "generate", "--model", "no-such-model",
                             "--prompt", "hi"], capture_output=True, text=True, env=env, cwd=repo_root,
                            timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("fastdraft: error: unknown model 'no-such-model'")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr

    result = subprocess.run([sys.executable, "-m", "fastdraft.cli", "generate", "--prompt", "hi",
                             "--max-tokens", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("fastdraft: error: ")
    assert result.stderr.count("\n") == 1


def _no_long_work(monkeypatch):
    """Make the expensive steps fail the test if reached: bad arguments must be caught first."""
    import fastdraft.engine.loader
    import fastdraft.quant.evaluate

    def never(*args, **kwargs):
        pytest.fail("the command started its work before checking its arguments")

    monkeypatch.setattr(fastdraft.quant.evaluate, "score_reference", never)
    monkeypatch.setattr(fastdraft.engine.loader, "load_model", never)


def test_eval_checks_its_arguments_before_scoring_the_reference(capsys, monkeypatch, tmp_path, llama_dir):
    _no_long_work(monkeypatch)
    model = ["eval", "--model", str(llama_dir)]
    _fails_cleanly(capsys, model + ["--quant", "method=foo"], "unknown quantization method")
    _fails_cleanly(capsys, model + ["--checkpoint", str(tmp_path / "missing")], "--checkpoint: unknown model")
    _fails_cleanly(capsys, model + ["--quant", str(tmp_path / "missing.json")], "neither an existing JSON file")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _fails_cleanly(capsys, model + ["--quant", "method=rtn", "--json", str(blocker / "out.json")], "cannot write")


def test_quantize_checks_its_output_before_quantizing(capsys, monkeypatch, tmp_path, llama_dir):
    _no_long_work(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    base = ["quantize", "--model", str(llama_dir), "--quant", "method=rtn"]
    _fails_cleanly(capsys, base + ["--output", str(blocker / "q")], "cannot write")
    _fails_cleanly(capsys, base + ["--output", str(blocker)], "is not a folder")
    _fails_cleanly(capsys, ["quantize", "--model", str(llama_dir), "--auto", "--output", str(blocker / "q")],
                   "cannot write")
    _fails_cleanly(capsys, ["quantize", "--model", str(llama_dir), "--auto", "--report-dir", str(blocker / "r")],
                   "cannot write")
    _fails_cleanly(capsys, ["quantize", "--model", str(llama_dir), "--auto", "--candidates", "method=rtn;int8_linears=w_proj"],
                   "unknown decoder linear")


def test_info_names_the_cpu_kernels_threads_and_versions(capsys, monkeypatch):
    from fastdraft.kernels.build import cache_dir, cpu_model, load_cpu_kernels, runnable_isas, select_isa

    monkeypatch.delenv("FASTDRAFT_ISA", raising=False)
    assert main(["info"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines()[1:])
    assert lines["CPU"].startswith(cpu_model())
    assert lines["threads"] == str(torch.get_num_threads())
    assert lines["kernel cache"] == str(cache_dir())
    if load_cpu_kernels() is not None:
        assert lines["kernels"] == f"{select_isa()} (the best this CPU runs; built)"
        assert lines["kernel variants this CPU runs"] == ", ".join(runnable_isas())
        # A forced variant, and one this CPU cannot run (named, not crashed on).
        monkeypatch.setenv("FASTDRAFT_ISA", "scalar")
        assert main(["info"]) == 0
        assert "kernels: scalar (FASTDRAFT_ISA; built)" in capsys.readouterr().out
        monkeypatch.setenv("FASTDRAFT_ISA", "avx9")
        assert main(["info"]) == 0
        assert "kernels: none: FASTDRAFT_ISA: unknown instruction-set variant 'avx9'" in capsys.readouterr().out
        monkeypatch.delenv("FASTDRAFT_ISA")
    else:
        assert lines["kernels"].startswith("PyTorch fallback (")
    # What the kernels would say on a machine where they are off, with the reason.
    monkeypatch.setenv("FASTDRAFT_DISABLE_CPU_KERNELS", "1")
    assert main(["info"]) == 0
    assert "kernels: PyTorch fallback (disabled by FASTDRAFT_DISABLE_CPU_KERNELS)" in capsys.readouterr().out


def test_a_variant_the_cpu_cannot_run_is_a_one_line_error(capsys, monkeypatch, llama_dir):
    from fastdraft.kernels.build import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("no C++ kernels here")
    monkeypatch.setenv("FASTDRAFT_ISA", "avx9")
    load_cpu_kernels.cache_clear()
    try:
        assert main(["generate", "--model", str(llama_dir), "--prompt", "hi", "--max-tokens", "2"]) == 2
    finally:
        monkeypatch.delenv("FASTDRAFT_ISA")
        load_cpu_kernels.cache_clear()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown instruction-set variant 'avx9'" in err


def test_verbose_logs_the_chosen_variant(caplog, monkeypatch, llama_dir):
    from fastdraft.kernels.build import clear_caches, load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("no C++ kernels here")
    monkeypatch.setenv("FASTDRAFT_ISA", "scalar")
    clear_caches()
    try:
        with caplog.at_level(logging.INFO, logger="fastdraft.kernels.build"):
            assert main(["-v", "generate", "--model", str(llama_dir), "--prompt", "hi", "--max-tokens", "2"]) == 0
    finally:
        monkeypatch.delenv("FASTDRAFT_ISA")
        clear_caches()
    assert any(r.getMessage().startswith("CPU kernels: scalar (from FASTDRAFT_ISA;") for r in caplog.records)


def test_serve_on_ray_refuses_a_bad_autoscaling_config(capsys, tmp_path):
    bad = tmp_path / "autoscaling.json"
    bad.write_text('{"min_replicas": 1')
    _fails_cleanly(capsys, ["serve", "--backend", "ray", "--autoscaling-config", str(bad)], str(bad))
    _fails_cleanly(capsys, ["serve", "--backend", "ray", "--autoscaling-config", str(tmp_path / "missing.json")],
                   "--autoscaling-config")
