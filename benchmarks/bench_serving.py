"""Online serving: streaming ``/v1/completions`` against OpenAI-compatible servers, as vLLM's
serving benchmark measures them.

It starts ``fastdraft serve`` on the model and, given ``--llama-server PATH``, llama.cpp's
``llama-server`` on the model's original GGUF (``-np`` set to the concurrency, a context of
``-np`` x 512 tokens so every slot holds a request, continuous batching, the same threads),
and drives each with the same requests, the two systems in turn at each load:

* closed loop at each ``--concurrency`` (``--num-requests`` requests, at least 200 at 16 by
  default, so a p99 means something);
* Poisson arrivals at ``--request-rate`` requests/s, when given;
* ``--shared-prefix``: a ~1,000-token system prompt shared by every request with a short user
  turn, at concurrency 4, on fastdraft with prefix caching and without (a second server):
  TTFT p50 of each (after one request that puts the system prompt in the cache, as in steady
  state), and the prefix-cache hit rate from ``/metrics``;
* ``--baseline CHECKOUT``: fastdraft from another checkout (another commit) serves beside this
  one, in every engine mode, each load run on the two in turn ``--rounds`` times, with fresh
  prompts each round; it prints the median of the rounds' output tokens/s ratios.

Prompts are about ``--prompt-tokens`` tokens of CPython's standard library sources, each its
own slice and each load its own prompts (no load finds another's in the prefix cache); each request generates exactly ``--max-tokens`` tokens, greedy, EOS ignored. It
reports output tokens/s, TTFT p50/p99, TPOT p50/p99 (per request: the time after its first
token over its other tokens) and inter-token latency p99, medians where runs repeat.

    python benchmarks/bench_serving.py --model qwen2.5-coder-0.5b-instruct --quant method=rtn,group_size=128
    python benchmarks/bench_serving.py --llama-server ./llama.cpp/build/bin/llama-server --shared-prefix
    python benchmarks/bench_serving.py --concurrency 16 --engine-modes thread,process --baseline /tmp/base --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fastdraft.fileio import write_json
from fastdraft.kernels.build import cpu_model, select_isa
from fastdraft.models.registry import KNOWN_MODELS, original_gguf, pull
from fastdraft.tokenizer import Tokenizer


@dataclass
class RequestResult:
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks with text (one or more tokens)
    tpot_s: float | None = None  # from the first token to the last, per token after the first
    output_tokens: int = 0
    is_ok: bool = False
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      extra: dict | None = None, is_chat: bool = False) -> RequestResult:
    """One streamed completion (or, with ``is_chat``, a chat completion of ``prompt`` as the user's message)."""
    text = {"messages": [{"role": "user", "content": prompt}]} if is_chat else {"prompt": prompt}
    body = {"model": model, **text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **(extra or {})}
    for attempt in range(2):
        result = await _stream_once(client, url, body)
        # A pooled connection the server had already closed fails before any byte: send it again once.
        if result.is_ok or "RemoteProtocolError" not in result.error or attempt:
            return result
    return result


async def _stream_once(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    """One streamed request. A chunk may carry several tokens (a server that fell behind sends
    what it has): the token count is the usage's, where the server reports it."""
    result = RequestResult()
    num_chunks, usage_tokens = 0, None
    start = last = time.perf_counter()
    try:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        async with client.stream("POST", f"{url}{path}", json=body, timeout=600) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
                choice = (chunk.get("choices") or [{}])[0]
                delta = choice.get("delta") or {}
                if not (choice.get("text") or delta.get("content") or delta.get("tool_calls")):
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                num_chunks += 1
        result.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
        if result.output_tokens > 1:
            result.tpot_s = (last - start - result.ttft_s) / (result.output_tokens - 1)
        result.is_ok = True
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


async def closed_loop(url: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
                      max_tokens: int, extras: list[dict | None] | None = None,
                      is_chat: bool = False) -> tuple[list[RequestResult], float]:
    """``num_requests`` streamed requests, ``concurrency`` at a time; request ``i`` takes
    ``prompts[i % len(prompts)]`` and, with ``extras``, ``extras[i % len(extras)]``'s fields."""
    queue = list(range(num_requests))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def worker() -> None:
            while queue:
                i = queue.pop()
                extra = extras[i % len(extras)] if extras else None
                results.append(await one_request(client, url, model, prompts[i % len(prompts)], max_tokens, extra,
                                                 is_chat))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


async def poisson(url: str, model: str, prompts: list[str], rate: float, num_requests: int, max_tokens: int,
                  seed: int) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=num_requests + 4)) as client:
        tasks = []
        start = time.perf_counter()
        for i in range(num_requests):
            tasks.append(asyncio.create_task(one_request(client, url, model, prompts[i % len(prompts)], max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.is_ok and r.output_tokens]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    return {"requests": len(results), "failed": len(results) - len(ok),
            "output_tok_s": sum(r.output_tokens for r in ok) / wall_s,
            "ttft_p50_s": percentile([r.ttft_s for r in ok], 50), "ttft_p99_s": percentile([r.ttft_s for r in ok], 99),
            "tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99), "itl_p99_s": percentile(itls, 99),
            "errors": sorted({r.error for r in results if r.error})[:3]}


# Long enough that the constrained requests, like the free ones, run to max_tokens: the two
# loads then differ only in what the constraint costs.
STRUCTURED_SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 60, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "count": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["name", "count"]}}}, "required": ["items"]}


def _structured(args: argparse.Namespace, url: str, tokenizer: Tokenizer, concurrency: int,
                lines: list[str]) -> dict:
    """Output tokens/s with half the requests held to a JSON schema, against the same load free
    (each run with prompts of its own, so that none finds another's in the prefix cache)."""
    form = {"response_format": {"type": "json_schema", "json_schema": {"name": "items", "schema": STRUCTURED_SCHEMA}}}
    num = 2 * concurrency
    pool = make_prompts(tokenizer, 2 * args.rounds * num, args.prompt_tokens, args.seed + 2)
    tok_s: dict[str, list[float]] = {"free": [], "half constrained": []}
    runs = [(name, extras) for _ in range(args.rounds)
            for name, extras in (("free", None), ("half constrained", [form, None]))]
    for run_index, (name, extras) in enumerate(runs):
        prompts = pool[run_index * num:(run_index + 1) * num]
        summary = summarize(*asyncio.run(closed_loop(url, args.model, prompts, concurrency, num, args.max_tokens,
                                                     extras)))
        tok_s[name].append(summary["output_tok_s"])
        lines.append(row_text(f"fastdraft, {name}", f"concurrency {concurrency}", summary))
        print(lines[-1], flush=True)
    ratio = statistics.median(tok_s["half constrained"]) / statistics.median(tok_s["free"])
    print(f"structured: half constrained / free = {ratio:.3f}x output tok/s", flush=True)
    return {"output_tok_s": tok_s, "ratio": ratio, "concurrency": concurrency, "requests": num}


def _tools(args: argparse.Namespace, url: str, tokenizer: Tokenizer, concurrency: int, lines: list[str]) -> dict:
    """Chat requests, half of them calling a tool under ``tool_choice: required`` (its arguments
    long enough to run to max_tokens, like the free ones), against the same load without tools,
    and against the same tools in the prompts under ``auto`` (no grammar: what the constraint
    itself costs): output tokens/s and TPOT p50, interleaved over --rounds."""
    tool = {"type": "function", "function": {"name": "record_items", "parameters": STRUCTURED_SCHEMA}}
    extra = {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
    unconstrained = {"tools": [tool], "tool_choice": "auto"}
    num = 2 * concurrency
    loads = (("chat, no tools", None), ("chat, half with tools", [extra, None]),
             ("chat, half with tools under auto", [unconstrained, None]))
    pool = make_prompts(tokenizer, len(loads) * args.rounds * num, args.prompt_tokens, args.seed + 3)
    runs = [load for _ in range(args.rounds) for load in loads]
    tok_s: dict[str, list[float]] = {name: [] for name, _ in loads}
    tpot: dict[str, list[float]] = {name: [] for name, _ in loads}
    for run_index, (name, extras) in enumerate(runs):
        prompts = pool[run_index * num:(run_index + 1) * num]
        summary = summarize(*asyncio.run(closed_loop(url, args.model, prompts, concurrency, num, args.max_tokens,
                                                     extras, is_chat=True)))
        tok_s[name].append(summary["output_tok_s"])
        tpot[name].append(summary["tpot_p50_s"])
        lines.append(row_text(f"fastdraft, {name}", f"concurrency {concurrency}", summary))
        print(lines[-1], flush=True)
    free, tools, auto = (name for name, _ in loads)
    ratio = statistics.median(tok_s[tools]) / statistics.median(tok_s[free])
    constraint_ratio = statistics.median(tok_s[tools]) / statistics.median(tok_s[auto])
    print(f"tools: half with tools / none = {ratio:.3f}x output tok/s; / the same prompts under auto = "
          f"{constraint_ratio:.3f}x", flush=True)
    return {"output_tok_s": tok_s, "tpot_p50_s": tpot, "ratio": ratio, "constraint_ratio": constraint_ratio,
            "concurrency": concurrency, "requests": num}


def wait_ready(url: str, process: subprocess.Popen | None = None, timeout_s: float = 600) -> None:
    """Wait until ``url/health`` answers 200; ``process``: the server's, which must not exit meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"the server at {url} exited with status {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {url} did not become ready")


def start_fastdraft(args: argparse.Namespace, port: int, extra: list[str], checkout: Path | None = None) -> subprocess.Popen:
    """``fastdraft serve`` on ``port``: this checkout's, or ``checkout``'s package."""
    cmd = [sys.executable, "-m", "fastdraft.cli", "serve", "--model", args.model, "--port", str(port),
           "--threads", str(args.threads), "--served-model-name", args.model, "--max-num-seqs",
           str(max(args.concurrency)), *extra]
    if args.quant != "none":
        cmd += ["--quant", args.quant]
    env = None if checkout is None else {**os.environ, "PYTHONPATH": str(checkout)}
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, cwd=checkout, env=env)
    wait_ready(f"http://127.0.0.1:{port}", process)
    return process


def start_llama_server(args: argparse.Namespace, port: int, parallel: int) -> subprocess.Popen:
    cmd = [str(args.llama_server), "-m", str(original_gguf(args.model)), "--port", str(port), "-np", str(parallel),
           "-c", str(parallel * args.llama_ctx_per_slot), "-t", str(args.threads), "-cb", "--log-disable"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}", process)
    return process


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


def make_prompts(tokenizer: Tokenizer, num: int, length: int, seed: int) -> list[str]:
    lib = Path(os.__file__).parent
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(lib.glob("*.py"))[:40])
    ids = tokenizer.encode(text)
    rng = random.Random(seed)
    starts = rng.sample(range(0, len(ids) - length), num)
    return [tokenizer.decode(ids[s:s + length]) for s in starts]


def prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    values = {}
    for name in ("fastdraft:prefix_cache_queries_total", "fastdraft:prefix_cache_hits_total"):
        match = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
        values[name] = float(match.group(1)) if match else 0.0
    return values["fastdraft:prefix_cache_queries_total"], values["fastdraft:prefix_cache_hits_total"]


def row_text(system: str, load: str, s: dict) -> str:
    return (f"| {system} | {load} | {s['requests']} | {s['output_tok_s']:.1f} | {s['ttft_p50_s'] * 1e3:.0f} | "
            f"{s['ttft_p99_s'] * 1e3:.0f} | {s['tpot_p50_s'] * 1e3:.1f} | {s['tpot_p99_s'] * 1e3:.1f} | "
            f"{s['itl_p99_s'] * 1e3:.1f} | {s['failed']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", choices=list(KNOWN_MODELS))
    parser.add_argument("--quant", default="method=rtn,group_size=128", help="fastdraft's weights (--quant spec, or none)")
    parser.add_argument("--concurrency", default="1,4,16,32", help="closed-loop loads, comma-separated")
    parser.add_argument("--num-requests", default=None,
                        help="requests per load, comma-separated (default: 8 x concurrency, at least 16; 200 at 16)")
    parser.add_argument("--request-rate", type=float, default=None, help="also Poisson arrivals at this rate (req/s)")
    parser.add_argument("--poisson-requests", type=int, default=100)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--shared-prefix", action="store_true",
                        help="also the shared-system-prompt case at concurrency 4, prefix caching on and off")
    parser.add_argument("--shared-prefix-tokens", type=int, default=1000)
    parser.add_argument("--structured", action="store_true",
                        help="also half the requests held to a JSON schema against none, at the largest "
                             "concurrency, interleaved over --rounds")
    parser.add_argument("--tools", action="store_true",
                        help="also chat requests, half calling a tool (tool_choice required), against none, at "
                             "the largest concurrency, interleaved over --rounds")
    parser.add_argument("--shared-requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine-modes", default="thread",
                        help="where fastdraft's engine steps: thread, process (--engine-process), or both, "
                             "comma-separated; each mode is its own server, the modes taking turns at each load")
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="path to llama.cpp's llama-server binary (skipped without it)")
    parser.add_argument("--llama-ctx-per-slot", type=int, default=512)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout of another commit whose fastdraft serves beside this one, in turn")
    parser.add_argument("--rounds", type=int, default=1, help="times each load runs on each system, interleaved")
    parser.add_argument("--port", type=int, default=8311, help="first of the local ports the servers use")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench_results/serving.json"))
    args = parser.parse_args()
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
        counts = [int(n) for n in args.num_requests.split(",")] if args.num_requests else \
            [200 if c == 16 else max(16, 8 * c) for c in args.concurrency]
    except ValueError:
        parser.error("--concurrency and --num-requests take comma-separated integers")
    if len(counts) != len(args.concurrency) or min(args.concurrency + counts) < 1:
        parser.error("--num-requests needs one positive count per concurrency")
    args.engine_modes = args.engine_modes.split(",")
    if not args.engine_modes or not set(args.engine_modes) <= {"thread", "process"}:
        parser.error("--engine-modes takes thread, process or both")
    if args.llama_server is not None and not args.llama_server.is_file():
        parser.error(f"--llama-server: {args.llama_server} does not exist")
    if args.baseline is not None and not (args.baseline / "fastdraft" / "cli.py").is_file():
        parser.error(f"--baseline: {args.baseline} is not a fastdraft checkout")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    print(f"CPU: {cpu_model()}; fastdraft's kernels: {select_isa()}", flush=True)
    tokenizer = Tokenizer(pull(args.model))
    # Every load gets prompts of its own, so that none finds another load's prompts in the prefix cache.
    loads = [*(num for num in counts for _ in range(args.rounds)), args.poisson_requests if args.request_rate else 0]
    pool = make_prompts(tokenizer, sum(loads) + 4, args.prompt_tokens, args.seed)
    starts = [sum(loads[:i]) + 4 for i in range(len(loads))]  # each load and round, then Poisson
    results: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": []}
    lines = []
    fastdraft_url = f"http://127.0.0.1:{args.port}"
    # The first mode's server also serves the Poisson and shared-prefix runs; other modes use ports from +3.
    mode_urls = {mode: f"http://127.0.0.1:{args.port if i == 0 else args.port + 2 + i}"
                 for i, mode in enumerate(args.engine_modes)}
    # (name, url, checkout): this checkout's servers, then the baseline's, one per engine mode.
    fastdraft_systems = [("fastdraft" if len(mode_urls) == 1 else f"fastdraft, engine {mode}", url, None)
                         for mode, url in mode_urls.items()]
    if args.baseline is not None:
        fastdraft_systems += [(f"baseline, engine {mode}", f"http://127.0.0.1:{args.port + 10 + i}", args.baseline)
                              for i, mode in enumerate(mode_urls)]
    servers = []
    ratios: dict[tuple[str, int], list[float]] = {}  # (engine mode, concurrency) -> per-round tok/s ratios
    try:
        for (name, url, checkout), mode in zip(fastdraft_systems, [*mode_urls, *mode_urls]):
            servers.append(start_fastdraft(args, int(url.rsplit(":", 1)[1]),
                                           ["--engine-process"] if mode == "process" else [], checkout))
            asyncio.run(closed_loop(url, args.model, pool[:4], 2, 4, 8))  # warm-up
        for load, (concurrency, num) in enumerate(zip(args.concurrency, counts)):
            systems = [(name, url, None) for name, url, _ in fastdraft_systems]
            if args.llama_server is not None:
                systems.append(("llama-server", f"http://127.0.0.1:{args.port + 1}", concurrency))
            for round_index in range(args.rounds):
                start = starts[load * args.rounds + round_index]
                prompts = pool[start:start + num]
                tok_s = {}
                for name, url, parallel in systems:
                    peer = start_llama_server(args, args.port + 1, parallel) if parallel else None
                    if peer is not None:  # its first requests set up its slots
                        asyncio.run(closed_loop(url, args.model, pool[:4], 2, 2, 8))
                    try:
                        run, wall = asyncio.run(closed_loop(url, args.model, prompts, concurrency, num,
                                                            args.max_tokens))
                    finally:
                        if peer is not None:
                            stop(peer)
                    summary = summarize(run, wall)
                    tok_s[name] = summary["output_tok_s"]
                    results["rows"].append({"system": name, "load": f"concurrency {concurrency}",
                                            "round": round_index, **summary})
                    lines.append(row_text(name, f"concurrency {concurrency}", summary))
                    print(lines[-1], flush=True)
                    write_json(args.json, results)
                for mode in mode_urls if args.baseline is not None else ():
                    ours = tok_s["fastdraft" if len(mode_urls) == 1 else f"fastdraft, engine {mode}"]
                    ratios.setdefault((mode, concurrency), []).append(ours / tok_s[f"baseline, engine {mode}"])
        results["baseline_ratios"] = {f"{mode}, concurrency {c}": r for (mode, c), r in ratios.items()}
        if args.request_rate:
            prompts = pool[starts[-1]:starts[-1] + args.poisson_requests]
            run, wall = asyncio.run(poisson(fastdraft_url, args.model, prompts, args.request_rate,
                                            args.poisson_requests, args.max_tokens, args.seed))
            summary = summarize(run, wall)
            load = f"Poisson {args.request_rate:g} req/s"
            results["rows"].append({"system": "fastdraft", "load": load, **summary})
            lines.append(row_text("fastdraft", load, summary))
        if args.structured:
            results["structured"] = _structured(args, fastdraft_url, tokenizer, max(args.concurrency), lines)
        if args.tools:
            results["tools"] = _tools(args, fastdraft_url, tokenizer, max(args.concurrency), lines)
        if args.shared_prefix:
            system_prompt = make_prompts(tokenizer, 1, args.shared_prefix_tokens, args.seed + 1)[0]
            shared = [f"{system_prompt}\n# Question {i}: what does this code do?\n" for i in range(args.shared_requests)]
            shared_rows = {}
            # One request first on each server: the system prompt is cached, as it is in steady state.
            asyncio.run(closed_loop(fastdraft_url, args.model, shared[:1], 1, 1, args.max_tokens))
            queries0, hits0 = prefix_counters(fastdraft_url)
            run, wall = asyncio.run(closed_loop(fastdraft_url, args.model, shared, 4, args.shared_requests,
                                                args.max_tokens))
            queries1, hits1 = prefix_counters(fastdraft_url)
            shared_rows["on"] = summarize(run, wall)
            hit_rate = (hits1 - hits0) / max(queries1 - queries0, 1)
            plain = start_fastdraft(args, args.port + 2, ["--no-enable-prefix-caching"])
            try:
                plain_url = f"http://127.0.0.1:{args.port + 2}"
                asyncio.run(closed_loop(plain_url, args.model, shared[:1], 1, 1, args.max_tokens))
                run, wall = asyncio.run(closed_loop(plain_url, args.model, shared, 4, args.shared_requests,
                                                    args.max_tokens))
            finally:
                stop(plain)
            shared_rows["off"] = summarize(run, wall)
            results["shared_prefix"] = {**shared_rows, "hit_rate": hit_rate}
            for mode, summary in shared_rows.items():
                lines.append(row_text(f"fastdraft, prefix caching {mode}", "shared prefix, concurrency 4", summary))
            ratio = shared_rows["off"]["ttft_p50_s"] / shared_rows["on"]["ttft_p50_s"]
            results["shared_prefix"]["ttft_p50_ratio"] = ratio
    finally:
        for server in servers:
            stop(server)
    write_json(args.json, results)
    print(f"\n### {args.model} ({args.quant}): ~{args.prompt_tokens}-token prompts, {args.max_tokens} output tokens, "
          f"greedy, {args.threads} threads\n")
    print("| system | load | requests | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
          "ITL p99 ms | failed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(lines))
    if args.shared_prefix:
        sp = results["shared_prefix"]
        print(f"\nshared prefix: prefix-cache hit rate {sp['hit_rate']:.1%}; TTFT p50 without caching / with: "
              f"{sp['ttft_p50_ratio']:.1f}x")
    for (mode, concurrency), values in ratios.items():
        print(f"\nengine {mode}, concurrency {concurrency}: output tok/s vs {args.baseline}: median "
              f"{statistics.median(values):.3f}x (rounds: {', '.join(f'{v:.3f}' for v in values)})")
    print(f"\nresults written to {args.json}")


if __name__ == "__main__":
    main()
