"""The scripts in examples/ run end to end (on the tiny random models, so in seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def start_example(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny matmuls: one thread (see conftest.py)
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def run_example(name: str, *args: str) -> str:
    proc = start_example(name, *args)
    if proc.returncode != 0:
        pytest.fail(f"{name} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def test_speculative_hf_matches_plain_greedy(llama_dir):
    out = run_example("speculative_hf.py", "--model", str(llama_dir), "--max-new-tokens", "12")
    assert "identical greedy output: True" in out


def test_draft_model_vllm_reports_acceptance(tiny_models):
    out = run_example("draft_model_vllm.py", "--model", str(tiny_models.dir("llama")), "--draft",
                      str(tiny_models.dir("qwen2")), "--max-tokens", "8")
    # Two prompts at two temperatures, each with its acceptance figures.
    assert out.count("acceptance ") == 4
    assert "T=0.0" in out and "T=0.7" in out


def test_quantize_and_evaluate_writes_a_loadable_checkpoint(llama_dir, tmp_path):
    output = tmp_path / "int4"
    out = run_example("quantize_and_evaluate.py", "--model", str(llama_dir), "--quant", "method=rtn,group_size=32",
                      "--output", str(output), "--seq-len", "64")
    assert (output / "config.json").is_file() and (output / "model.safetensors").is_file()
    assert "rtn" in out and "saved" in out


def test_quantize_and_evaluate_rejects_a_bad_spec_before_loading(tmp_path):
    proc = start_example("quantize_and_evaluate.py", "--model", "no-such-model", "--quant", "method=nope",
                         "--output", str(tmp_path / "out"))
    assert proc.returncode == 2 and "method" in proc.stderr and "Traceback" not in proc.stderr
