"""The README and docs/ show code that works: Python snippets run, commands parse.

README's Python snippets run end to end on the tiny random models (the real names swapped for
their folders), so a renamed argument or a missing export fails here. Every `fastdraft ...`,
`python benchmarks/...` and `python examples/...` command shown in README.md and docs/ is
parsed by its own argument parser, so an option that no longer exists fails here too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
from pathlib import Path

import httpx
import pytest

from fastdraft.cli import build_parser
from fastdraft.engine.llm_engine import EngineConfig
from fastdraft.engine.loader import load_model
from tests.helpers import LiveServer

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def code_blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == language]


def shell_commands(path: Path) -> list[str]:
    """Commands of the ```bash blocks, continuation lines joined and comments dropped."""
    commands = []
    for block in code_blocks(path, "bash"):
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def readme_snippets() -> list[str]:
    return code_blocks(ROOT / "README.md", "python")


def test_readme_has_the_two_quick_start_commands():
    commands = shell_commands(ROOT / "README.md")
    assert commands[0].startswith("pip install -e . && fastdraft generate")
    assert commands[1] == 'pip install -q -e ".[test]" && python -m pytest -q'
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, ".ci/run must run the README's test command"


def test_readme_is_at_most_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


@pytest.mark.parametrize("index", range(len(readme_snippets())))
def test_readme_python_snippet_runs(index, tiny_models, tmp_path, monkeypatch):
    code = readme_snippets()[index]
    # The tiny Llama and Qwen2 share one tokenizer, so they stand in for the 1.5B target
    # and its 0.5B draft.
    code = code.replace('"qwen2.5-coder-1.5b-instruct"', repr(str(tiny_models.dir("llama"))))
    code = code.replace('"qwen2.5-coder-0.5b-instruct"', repr(str(tiny_models.dir("qwen2"))))
    assert "qwen2.5-coder" not in code, "a snippet names a model the test cannot replace"
    code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=8", code)
    monkeypatch.chdir(tmp_path)  # snippets that write a checkpoint write it here
    server = None
    if "http://127.0.0.1:8000" in code:  # a client snippet: a live server on the tiny model answers it
        name = str(tiny_models.dir("qwen2"))
        server = LiveServer(load_model(name, dtype="bf16"), EngineConfig(num_blocks=256, block_size=4,
                                                                         max_model_len=512), name)
        code = code.replace("http://127.0.0.1:8000", server.url)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
        if server is not None:
            # A sampled reply of the random tiny model may be only EOS or whitespace: the
            # server's own count shows that the snippet made it generate.
            metrics = httpx.get(f"{server.url}/metrics").text
            generated = re.search(r"^fastdraft:generation_tokens_total(?:\{.*\})? (\S+)$", metrics, re.M)
            assert generated and float(generated.group(1)) > 0
            return
    finally:
        if server is not None:
            server.stop()
    assert out.getvalue().strip(), "every snippet prints what it made"


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def parse_script_args(script: Path, argv: list[str], monkeypatch) -> argparse.Namespace:
    """Run ``script``'s main() until its parser has parsed ``argv``, then stop it."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr("sys.argv", [str(script), *argv])
    with pytest.raises(_Parsed) as parsed:
        runpy.run_path(str(script), run_name="__main__")
    return parsed.value.namespace


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for command in shell_commands(path):
            for part in command.split("&&"):
                part = part.strip()
                if part.startswith(("fastdraft ", "python benchmarks/", "python examples/")):
                    found.append((path.name, part))
    return found


@pytest.mark.parametrize("where,command", documented_commands())
def test_documented_command_parses(where, command, monkeypatch):
    argv = shlex.split(command)
    if argv[0] == "fastdraft":
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            pytest.fail(f"{where}: `{command}` does not parse (exit {exc.code})")
        return
    script = ROOT / argv[1]
    assert script.is_file(), f"{where}: {argv[1]} does not exist"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parse_script_args(script, argv[2:], monkeypatch)
    except SystemExit as exc:
        pytest.fail(f"{where}: `{command}` does not parse: {stderr.getvalue().strip()} (exit {exc.code})")


def test_documented_commands_were_found():
    names = {where for where, _ in documented_commands()}
    assert "README.md" in names
