"""fastdraft on Ray Serve: the cost of the Ray hop, scaling with replicas, draining, routing.

Everything runs on one local Ray cluster started here, on 127.0.0.1; ``--parts`` picks:

* **scaling**: stand-in replicas (``fastdraft.server.standin``: 200 ms TTFT, 25 ms TPOT, batch
  8, ``--standin-tokens`` streamed tokens; then uneven lengths, between half and all of them),
  so that Ray's own behaviour is measured without the 2 cores bounding the engines: requests/s
  of 4 replicas against 1, 8 clients per replica, for each of ``--stream-intervals``;
* **draining**: streams open across a scale-down from 4 replicas to 2 and a ``serve.delete``;
* **routing**: round robin, prefix-aware and power-of-two routing over 4 stand-ins whose TTFT
  grows with the prompt tokens their simulated caches miss: hit rate, TTFT, balance;
* **real-routing**: the model on 2 replicas, requests sharing a ~1,000-token system prompt;
* **overhead**: one replica of the model behind Ray against ``fastdraft serve`` directly (same
  engine, same threads): TTFT p50 at concurrency 1, output tokens/s at 8;
* **real-scaling**: 2 replicas of one thread each against 1, both behind Ray, with the CPU
  seconds of the busiest processes.

    python benchmarks/bench_ray.py --model qwen2.5-coder-0.5b-instruct --json bench_results/ray.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import _stream_once, closed_loop, percentile, summarize, wait_ready  # noqa: E402

from fastdraft.engine.llm_engine import EngineConfig  # noqa: E402
from fastdraft.fileio import write_json  # noqa: E402
from fastdraft.kernels.build import cpu_model  # noqa: E402
from fastdraft.models.registry import KNOWN_MODELS  # noqa: E402
from fastdraft.server.app import ServerConfig  # noqa: E402
from fastdraft.server.ray_app import RayServeConfig, application, serving_engine  # noqa: E402
from fastdraft.server.standin import StandInEngine  # noqa: E402

PARTS = ("scaling", "draining", "routing", "real-routing", "overhead", "real-scaling")


def _deploy(load_engine, replicas: int, name: str, threads: int = 1, stream_interval: int = 1,
            router: str = "pow2") -> str:
    serve.run(application(load_engine, ServerConfig(served_model_name="m", max_queue=4096),
                          RayServeConfig(num_replicas=replicas, num_cpus_per_replica=threads,
                                         max_ongoing_requests=64, stream_interval=stream_interval,
                                         router=router)), name=name, route_prefix="/")
    return name


def _requests_per_s(url: str, prompts, concurrency: int, num: int, max_tokens: int) -> tuple[float, dict]:
    run, wall = asyncio.run(closed_loop(url, "m", prompts, concurrency, num, max_tokens))
    summary = summarize(run, wall)
    return sum(r.is_ok for r in run) / wall, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", choices=list(KNOWN_MODELS))
    parser.add_argument("--port", type=int, default=8411)
    parser.add_argument("--standin-tokens", type=int, default=64)
    parser.add_argument("--standin-requests", type=int, default=48, help="requests per replica, stand-in runs")
    parser.add_argument("--real-requests", type=int, default=24)
    parser.add_argument("--routing-requests", type=int, default=256, help="requests per router, stand-in")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens, real-model runs")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"what to measure, comma-separated, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--stream-intervals", default="1,4",
                        help="the replicas' stream intervals the streamed stand-in runs compare (comma-separated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench_results/ray.json"))
    args = parser.parse_args()
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; known: {', '.join(PARTS)}")
    print(f"CPU: {cpu_model()}", flush=True)
    ray.init(num_cpus=8, include_dashboard=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"
    results: dict = {"config": {k: str(v) for k, v in vars(args).items()}}
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, 900) for _ in range(16)] for _ in range(64)]
    try:
        intervals = [int(v) for v in args.stream_intervals.split(",")]
        runs = [(False, interval) for interval in intervals] + [(True, 1)]
        for uneven, interval in runs if "scaling" in parts else []:
            rates = {}
            for replicas in (1, 4):
                _deploy(StandInEngine, replicas, "standin", stream_interval=interval)
                wait_ready(url)
                num = args.standin_requests * replicas
                lengths = None
                if uneven:  # uneven outputs: the request's own max_tokens, between half and all
                    lengths = [rng.randint(args.standin_tokens // 2, args.standin_tokens) for _ in range(num)]
                rate, detail = _requests_per_s(url, prompts, 8 * replicas, num, args.standin_tokens) \
                    if lengths is None else _uneven(url, prompts, 8 * replicas, lengths)
                if uneven:
                    print(f"  {detail['failed']} failed, {detail['wall_s']:.1f} s", flush=True)
                rates[replicas] = rate
                serve.delete("standin")
                print(f"stand-in, {replicas} replica(s){' uneven' if uneven else f', stream interval {interval}'}: "
                      f"{rate:.2f} req/s", flush=True)
            key = "standin_uneven" if uneven else f"standin_interval_{interval}"
            results[key] = {"requests_per_s": rates, "ratio_4_to_1": rates[4] / rates[1]}
            print(f"{key}: 4 replicas / 1 = {rates[4] / rates[1]:.2f}x", flush=True)
        if "draining" in parts:
            results["draining"] = _draining(url, prompts, args.standin_tokens)
        if "routing" in parts:
            results["routing"] = _routing_standin(url, args)
        if "real-routing" in parts:
            results["real_routing"] = _real_routing(args, url)
        if "overhead" in parts:
            results["overhead"] = _overhead(args, url, prompts)
        if "real-scaling" in parts:
            results["real_scaling"] = _real_scaling(args, url, prompts)
    finally:
        serve.shutdown()
        ray.shutdown()
        write_json(args.json, results)
    print(f"results written to {args.json}")


@dataclass
class _Routed:
    """One streamed request as the routing comparison sees it."""

    ttft_s: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""  # the stand-in names its replica in the first token's text
    is_ok: bool = False


async def _routed_request(client: httpx.AsyncClient, url: str, prompt: list[int] | str, max_tokens: int) -> _Routed:
    result = _Routed()
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and not result.replica:
                result.ttft_s = time.perf_counter() - start
                named = re.match(r"\[(\w+)\]", chunk["choices"][0]["text"])
                result.replica = named.group(1) if named else "?"
            if chunk.get("usage"):
                result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                result.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                result.is_ok = True
    return result


def _routed_run(url: str, prompts: list, concurrency: int, max_tokens: int) -> list[_Routed]:
    async def run() -> list[_Routed]:
        queue = list(range(len(prompts)))[::-1]
        results = []
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
            async def worker() -> None:
                while queue:
                    results.append(await _routed_request(client, url, prompts[queue.pop()], max_tokens))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results

    return asyncio.run(run())


def _routing_summary(results: list[_Routed]) -> dict:
    ok = [r for r in results if r.is_ok]
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
    return {"requests": len(results), "failed": len(results) - len(ok),
            "hit_rate": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
            "ttft_p50_s": percentile([r.ttft_s for r in ok], 50), "ttft_p99_s": percentile([r.ttft_s for r in ok], 99),
            "requests_per_replica": sorted(per_replica.values()),
            "balance": max(per_replica.values()) / min(per_replica.values()) if per_replica else float("nan")}


# The routing workload: shared prefixes (system prompts, conversations) that overflow one
# replica's cache but fit in four, each request one of them plus a suffix of its own.
ROUTING_GROUPS = 16
ROUTING_PREFIX_TOKENS = 512
ROUTING_SUFFIX_TOKENS = 32
ROUTING_CACHE_BLOCKS = 200  # per replica: 4 prefixes of 32 blocks, and room for recent suffixes
# The stand-in's TTFT: 50 ms plus 2 ms a prompt token not in its cache (a prefill of 500 tokens/s,
# a few CPU cores' worth on a 1.5B model).
ROUTING_TTFT_S = 0.050
ROUTING_TTFT_PER_TOKEN_S = 0.002
ROUTING_OUTPUT_TOKENS = 8  # prompt-heavy requests, as with long shared prompts


def _routing_standin(url: str, args: argparse.Namespace) -> dict:
    """Round robin, prefix-aware and power-of-two routing over 4 stand-in replicas whose TTFT
    grows with the prompt tokens their caches miss: hit rate, TTFT, balance."""
    rng = random.Random(args.seed + 1)
    prefixes = [[rng.randrange(1, 900) for _ in range(ROUTING_PREFIX_TOKENS)] for _ in range(ROUTING_GROUPS)]
    prompts = [prefixes[rng.randrange(ROUTING_GROUPS)] + [rng.randrange(1, 900) for _ in range(ROUTING_SUFFIX_TOKENS)]
               for _ in range(args.routing_requests)]
    load_engine = functools.partial(StandInEngine, ttft_s=ROUTING_TTFT_S, ttft_per_token_s=ROUTING_TTFT_PER_TOKEN_S,
                                    cache_blocks=ROUTING_CACHE_BLOCKS)
    out: dict = {}
    for router in ("round-robin", "prefix", "pow2"):
        _deploy(load_engine, 4, "routing", router=router)
        wait_ready(url)
        out[router] = _routing_summary(_routed_run(url, prompts, 32, ROUTING_OUTPUT_TOKENS))
        serve.delete("routing")
        summary = out[router]
        print(f"routing {router}: hit rate {summary['hit_rate']:.2f}, TTFT p50 {summary['ttft_p50_s'] * 1e3:.0f} ms, "
              f"requests per replica {summary['requests_per_replica']} ({summary['failed']} failed)", flush=True)
    baseline, prefix = out["round-robin"], out["prefix"]
    out["prefix_vs_round_robin"] = {"hit_rate_ratio": prefix["hit_rate"] / max(baseline["hit_rate"], 1e-9),
                                    "ttft_p50_reduction": 1 - prefix["ttft_p50_s"] / baseline["ttft_p50_s"],
                                    "prefix_balance": prefix["balance"]}
    print(f"prefix against round robin: {out['prefix_vs_round_robin']}", flush=True)
    return out


def _draining(url: str, prompts, num_tokens: int) -> dict:
    """Streams open across a scale-down (4 stand-in replicas to 2) and then a ``serve.delete``:
    how many did not end whole."""
    _deploy(StandInEngine, 4, "standin")
    wait_ready(url)
    body = {"model": "m", "prompt": prompts[0], "max_tokens": num_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}

    async def run() -> list:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            def open_streams(count: int) -> list:
                return [asyncio.create_task(_stream_once(client, url, body)) for _ in range(count)]

            streams = open_streams(32)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(_deploy, StandInEngine, 2, "standin")  # scale down under load
            streams += open_streams(16)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(serve.delete, "standin")  # returns once the replicas have drained
            return await asyncio.gather(*streams)

    results = asyncio.run(run())
    num_cut = sum(not r.is_ok or r.output_tokens != num_tokens for r in results)
    print(f"draining: {num_cut} of {len(results)} streams cut across a scale-down and a serve.delete", flush=True)
    return {"streams": len(results), "cut": num_cut}


def _uneven(url: str, prompts, concurrency: int, lengths: list[int]) -> tuple[float, dict]:
    """Streamed requests whose output lengths are ``lengths``: requests/s and how many failed."""

    async def run() -> tuple[list, float]:
        queue = list(range(len(lengths)))
        results = []
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
            async def worker() -> None:
                while queue:
                    i = queue.pop()
                    results.append(await _stream_once(client, url, {
                        "model": "m", "prompt": prompts[i % len(prompts)], "max_tokens": lengths[i],
                        "temperature": 0, "stream": True, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}))

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return results, time.perf_counter() - start

    results, wall = asyncio.run(run())
    return sum(r.is_ok for r in results) / wall, {"failed": sum(not r.is_ok for r in results), "wall_s": wall}


def _real_engine(args: argparse.Namespace):
    return functools.partial(serving_engine, args.model, "bf16", EngineConfig(max_num_seqs=16, max_model_len=2048))


def _overhead(args: argparse.Namespace, url: str, prompts) -> dict:
    """One replica of the model behind Ray against ``fastdraft serve`` directly, same engine
    and threads: TTFT at concurrency 1, output tokens/s at 8."""
    _deploy(_real_engine(args), 1, "real")
    wait_ready(url)
    ray_c1 = summarize(*asyncio.run(closed_loop(url, "m", prompts, 1, args.real_requests // 2, args.max_tokens)))
    ray_c8 = summarize(*asyncio.run(closed_loop(url, "m", prompts, 8, args.real_requests, args.max_tokens)))
    serve.delete("real")
    direct_port = args.port + 1
    direct = subprocess.Popen([sys.executable, "-m", "fastdraft.cli", "serve", "--model", args.model, "--port",
                               str(direct_port), "--threads", "1", "--served-model-name", "m", "--max-num-seqs", "16",
                               "--max-model-len", "2048"], stdout=subprocess.DEVNULL)
    try:
        direct_url = f"http://127.0.0.1:{direct_port}"
        wait_ready(direct_url, direct)
        direct_c1 = summarize(*asyncio.run(closed_loop(direct_url, "m", prompts, 1, args.real_requests // 2,
                                                       args.max_tokens)))
        direct_c8 = summarize(*asyncio.run(closed_loop(direct_url, "m", prompts, 8, args.real_requests,
                                                       args.max_tokens)))
    finally:
        direct.terminate()
        direct.wait(60)
    out = {"ttft_p50_added_ms": (ray_c1["ttft_p50_s"] - direct_c1["ttft_p50_s"]) * 1e3,
           "throughput_ratio_c8": ray_c8["output_tok_s"] / direct_c8["output_tok_s"],
           "ray_c1": ray_c1, "direct_c1": direct_c1, "ray_c8": ray_c8, "direct_c8": direct_c8}
    print(f"overhead: TTFT p50 +{out['ttft_p50_added_ms']:.1f} ms at concurrency 1; "
          f"throughput {out['throughput_ratio_c8']:.2f}x of direct at 8", flush=True)
    return out


def _cpu_seconds_by_process() -> dict[str, float]:
    """CPU seconds each process has used so far, by its command line (from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            name = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:70]
        except OSError:
            continue
        key = f"{entry.name} {name or fields[0]}"
        out[key] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return out


def _real_scaling(args: argparse.Namespace, url: str, prompts) -> dict:
    """2 replicas of one thread each against 1, both behind Ray, with where the CPU went."""
    tok_s, cpu = {}, {}
    for replicas in (1, 2):
        _deploy(_real_engine(args), replicas, "real")
        wait_ready(url)
        before, start = _cpu_seconds_by_process(), time.perf_counter()
        tok_s[replicas] = summarize(*asyncio.run(closed_loop(url, "m", prompts, 8 * replicas,
                                                             args.real_requests * replicas,
                                                             args.max_tokens)))["output_tok_s"]
        wall, after = time.perf_counter() - start, _cpu_seconds_by_process()
        used = sorted(((after[k] - before.get(k, 0.0), k) for k in after), reverse=True)
        cpu[replicas] = {"wall_s": wall, "cores_available_s": wall * os.cpu_count(),
                         "top_processes_cpu_s": {k: round(v, 2) for v, k in used[:8] if v > 0}}
        serve.delete("real")
    out = {"output_tok_s": tok_s, "ratio_2_to_1": tok_s[2] / tok_s[1], "cpu": cpu}
    print(f"real model: 2 replicas / 1 = {tok_s[2] / tok_s[1]:.2f}x ({tok_s[1]:.1f} -> {tok_s[2]:.1f} tok/s)",
          flush=True)
    return out


# A shared system prompt of about 1,000 tokens, each request's question after it.
SYSTEM_PROMPT = ("You are a careful Python reviewer. Read the code the user sends, find its bugs, and explain "
                 "each one briefly, naming the line, what goes wrong, and the smallest fix. ") * 28


def _real_routing(args: argparse.Namespace, url: str) -> dict:
    """The model on 2 replicas, requests sharing a ~1,000-token system prompt: the prefix-cache
    hit rate and TTFT p50 under round robin and the prefix-aware router."""
    questions = [f"Question {i}: what does `sorted(xs)[{i}]` return when xs has {i + 3} items?" for i in range(16)]
    out: dict = {}
    for router in ("round-robin", "prefix"):
        _deploy(_real_engine(args), 2, "real", router=router)
        wait_ready(url)
        results = _routed_run(url, [f"{SYSTEM_PROMPT}\n{q}\n" for q in questions], 2, 8)
        serve.delete("real")
        ok = [r for r in results if r.is_ok]
        out[router] = {"requests": len(results), "failed": len(results) - len(ok),
                       "hit_rate": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
                       "prompt_tokens": ok[0].prompt_tokens if ok else 0,
                       "ttft_p50_s": percentile([r.ttft_s for r in ok], 50)}
        print(f"real model, {router}: hit rate {out[router]['hit_rate']:.2f}, "
              f"TTFT p50 {out[router]['ttft_p50_s'] * 1e3:.0f} ms", flush=True)
    return out


if __name__ == "__main__":
    main()
