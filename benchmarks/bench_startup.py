"""Start-up of the front door: each command run as a fresh process, rounds interleaved.

For every case it reports the median over ``--rounds`` of: the time from process start to the
first generated token on stdout, the process's peak RSS (``wait4``'s ``ru_maxrss``), and the
decode rate the command prints. Cases:

* ``fastdraft`` — ``fastdraft generate`` as the README runs it (this checkout);
* ``fastdraft bf16`` — the same with ``--load-in-low-bit bf16`` (the dequantized reference);
* ``baseline keep-gguf`` — ``--baseline DIR``'s ``fastdraft generate --keep-gguf-quant``
  (another checkout, for example the commit before a change), skipped without it;
* ``llama-server`` — ``--llama-server PATH``: time until ``/health`` answers 200, and its RSS then;
* ``llama-simple`` — ``--llama-simple PATH``: time to its first output (the prompt, echoed once
  the model is loaded and the prompt evaluated) and peak RSS.

``--parts`` also loads the model in one instrumented process and prints its RSS after each
stage: the interpreter and torch, the weights, the engine (its KV pool), and the peak of a
generation (scratch).

    python benchmarks/bench_startup.py --model qwen2.5-coder-0.5b-instruct \\
        --baseline /tmp/base --llama-server ./build/bin/llama-server \\
        --llama-simple ./build/bin/llama-simple --parts
"""

from __future__ import annotations

import argparse
import os
import re
import select
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPT = "def fibonacci(n):"
PARTS = r"""
import os, sys, time
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
print(f"interpreter: {rss():.0f} MiB", flush=True)
import torch, fastdraft
from fastdraft.engine.loader import load_model
from fastdraft.generator import TextGenerator
from fastdraft.sampling_params import SamplingParams
print(f"interpreter + torch + fastdraft: {rss():.0f} MiB", flush=True)
loaded = load_model(sys.argv[1])
print(f"+ weights: {rss():.0f} MiB", flush=True)
generator = TextGenerator(loaded)
print(f"+ engine (KV pool): {rss():.0f} MiB", flush=True)
generator.generate(sys.argv[2], SamplingParams(max_new_tokens=32))
peak = [int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(f"after 32 tokens: {rss():.0f} MiB (peak {peak:.0f} MiB)", flush=True)
"""


def run_generate(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> dict[str, float]:
    """Run a command that streams tokens to stdout: seconds to its first output byte, its peak
    RSS in MiB, and the decode rate it prints (fastdraft's summary line)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    first, err = None, []
    streams = [proc.stdout, proc.stderr]
    for stream in streams:
        os.set_blocking(stream.fileno(), False)
    while streams:
        ready, _, _ = select.select(streams, [], [], 1.0)
        for stream in ready:
            data = stream.read()
            if not data:  # end of file
                streams.remove(stream)
            elif stream is proc.stderr:
                err.append(data)
            elif first is None and data.strip():
                first = time.perf_counter() - start
    _, status, usage = os.wait4(proc.pid, 0)
    text = b"".join(err).decode(errors="replace")
    if status != 0:
        raise RuntimeError(f"{argv[0]} failed ({status}): {text[-500:]}")
    match = re.search(r"([\d.]+) tokens/s", text)
    return {"ttft_s": first if first is not None else float("nan"), "rss_mib": usage.ru_maxrss / 1024,
            "decode_tok_s": float(match.group(1)) if match else float("nan")}


def run_server(argv: list[str], port: int, timeout_s: float = 120.0) -> dict[str, float]:
    """Start ``llama-server``: seconds until /health answers 200 and its RSS then (MiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < timeout_s:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        ready = time.perf_counter() - start
                        status = Path(f"/proc/{proc.pid}/status").read_text()
                        rss = int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024
                        return {"ttft_s": ready, "rss_mib": rss, "decode_tok_s": float("nan")}
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("llama-server did not become ready")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout: its --keep-gguf-quant")
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--llama-simple", type=Path, default=None, help="llama.cpp's llama-simple")
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--parts", action="store_true", help="RSS after each loading stage, in one process")
    args = parser.parse_args()

    here = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(here))
    from fastdraft.models.registry import original_gguf

    gguf = str(original_gguf(args.model))
    generate = [sys.executable, "-m", "fastdraft.cli", "generate", "--model", args.model, "--prompt", PROMPT,
                "--max-tokens", str(args.max_tokens)]
    env = dict(os.environ, PYTHONPATH=str(here))
    cases: dict[str, callable] = {
        "fastdraft": lambda: run_generate(generate, env, here),
        "fastdraft bf16": lambda: run_generate(generate + ["--load-in-low-bit", "bf16"], env, here),
    }
    if args.baseline is not None:
        # Its own sources first: ``python -m`` puts the working folder ahead of PYTHONPATH.
        base = args.baseline.resolve()
        cases["baseline keep-gguf"] = lambda: run_generate(generate + ["--keep-gguf-quant"],
                                                           dict(os.environ, PYTHONPATH=str(base)), base)
    if args.llama_server is not None:
        cases["llama-server (ready)"] = lambda: run_server(
            [str(args.llama_server), "-m", gguf, "--port", str(args.port), "--host", "127.0.0.1", "-t", "2"], args.port)
    if args.llama_simple is not None:
        cases["llama-simple"] = lambda: run_generate(
            [str(args.llama_simple), "-m", gguf, "-n", str(args.max_tokens), PROMPT], dict(os.environ))
    cases["fastdraft"]()  # a warm layout and page cache for every case, outside the figures
    results: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for r in range(args.rounds):
        names = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in names:
            results[name].append(cases[name]())
    print(f"{args.model}, {args.rounds} rounds, fresh processes, warm caches; medians")
    print(f"{'case':24s} {'first token / ready (s)':>24s} {'peak RSS (MiB)':>15s} {'decode tok/s':>13s}")
    for name, rows in results.items():
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        print(f"{name:24s} {med['ttft_s']:24.2f} {med['rss_mib']:15.0f} {med['decode_tok_s']:13.1f}")
    if args.parts:
        subprocess.run([sys.executable, "-c", PARTS, args.model, PROMPT], env=env, cwd=here, check=True)


if __name__ == "__main__":
    main()
