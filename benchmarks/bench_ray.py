"""fastdraft on Ray Serve: the cost of the Ray hop, and scaling with replicas.

Everything runs on one local Ray cluster started here, on 127.0.0.1:

* **scaling, stand-in engine**: a replica whose engine sleeps a fixed TTFT (200 ms) and TPOT
  (25 ms), batches 8 requests and streams ``--standin-tokens`` tokens (then, uneven, a random
  length between half and all of them), so that Ray's own behaviour is measured without the
  2 cores bounding the engines: requests/s of 4 replicas against 1, with 8 clients per replica,
  for each of ``--stream-intervals``;
* **overhead, real model**: one replica of the model behind Ray against ``fastdraft serve``
  directly (same engine, same threads): TTFT p50 at concurrency 1, output tokens/s at 8;
* **scaling, real model**: 2 replicas of one thread each against 1, both behind Ray.

    python benchmarks/bench_ray.py --model qwen2.5-coder-0.5b-instruct --json bench_results/ray.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import _stream_once, closed_loop, summarize, wait_ready  # noqa: E402

from fastdraft.engine.llm_engine import EngineConfig  # noqa: E402
from fastdraft.engine.output import RequestDelta  # noqa: E402
from fastdraft.fileio import write_json  # noqa: E402
from fastdraft.kernels.build import cpu_model  # noqa: E402
from fastdraft.models.registry import KNOWN_MODELS  # noqa: E402
from fastdraft.server.app import ServerConfig  # noqa: E402
from fastdraft.server.ray_app import RayServeConfig, application, serving_engine  # noqa: E402

STANDIN_TTFT_S = 0.200
STANDIN_TPOT_S = 0.025
STANDIN_BATCH = 8


class _StandInSeq:
    def __init__(self, request_id: str, num_tokens: int) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_sent = 0
        self.first_token_at = 0.0  # monotonic time of its first token, set on admission


class StandInEngine:
    """An engine that sleeps instead of computing: each step takes the TPOT, and a request's
    first token comes the TTFT after it is admitted, then one a step; up to ``STANDIN_BATCH``
    requests at once (the others wait)."""

    class _Stats:
        def __init__(self) -> None:
            self.running: list[_StandInSeq] = []
            self.waiting: list[_StandInSeq] = []
            self.num_preemptions = 0
            self.usage = 0.0
            self.num_prefix_queries = 0
            self.num_prefix_hits = 0

    def __init__(self) -> None:
        self.tokenizer = None
        self.vocab_size = 1000
        self.max_model_len = 4096
        self.scheduler = self.block_manager = self._Stats()

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def add_request(self, prompt, params, request_id: str) -> str:
        self.scheduler.waiting.append(_StandInSeq(request_id, params.max_new_tokens))
        return request_id

    def abort_request(self, request_id: str) -> bool:
        for queue in (self.scheduler.running, self.scheduler.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    return True
        return False

    def step(self) -> list[RequestDelta]:
        running, waiting = self.scheduler.running, self.scheduler.waiting
        while waiting and len(running) < STANDIN_BATCH:
            seq = waiting.pop(0)
            seq.first_token_at = time.monotonic() + STANDIN_TTFT_S
            running.append(seq)
        time.sleep(STANDIN_TPOT_S)
        now = time.monotonic()
        deltas = []
        for seq in list(running):
            if now < seq.first_token_at:
                continue
            seq.num_sent += 1
            finish = "length" if seq.num_sent >= seq.num_tokens else None
            deltas.append(RequestDelta(seq.request_id, [1], "x", finish_reason=finish,
                                       ttft_s=STANDIN_TTFT_S if seq.num_sent == 1 else None,
                                       token_gap_s=STANDIN_TPOT_S))
            if finish:
                running.remove(seq)
        return deltas


def _deploy(load_engine, replicas: int, name: str, threads: int = 1, stream_interval: int = 1) -> str:
    serve.run(application(load_engine, ServerConfig(served_model_name="m", max_queue=4096),
                          RayServeConfig(num_replicas=replicas, num_cpus_per_replica=threads,
                                         max_ongoing_requests=64, stream_interval=stream_interval),
                          app_name=name), name=name, route_prefix="/")
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
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens, real-model runs")
    parser.add_argument("--no-real", action="store_true", help="stand-in runs only")
    parser.add_argument("--no-standin", action="store_true", help="real-model runs only")
    parser.add_argument("--stream-intervals", default="1,4",
                        help="the replicas' stream intervals the streamed stand-in runs compare (comma-separated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench_results/ray.json"))
    args = parser.parse_args()
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
        for uneven, interval in [] if args.no_standin else runs:
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
        if not args.no_real:
            results["real"] = _real(args, url, prompts)
    finally:
        serve.shutdown()
        ray.shutdown()
        write_json(args.json, results)
    print(f"results written to {args.json}")


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


def _real(args: argparse.Namespace, url: str, prompts) -> dict:
    """The real model: overhead of the Ray hop, and 2 replicas against 1."""
    engine_config = EngineConfig(max_num_seqs=16, max_model_len=1024)
    load_engine = functools.partial(serving_engine, args.model, "bf16", engine_config)
    out: dict = {}
    _deploy(load_engine, 1, "real")
    wait_ready(url)
    ray_c1 = summarize(*asyncio.run(closed_loop(url, "m", prompts, 1, args.real_requests // 2, args.max_tokens)))
    ray_c8 = summarize(*asyncio.run(closed_loop(url, "m", prompts, 8, args.real_requests, args.max_tokens)))
    serve.delete("real")
    direct_port = args.port + 1
    direct = subprocess.Popen([sys.executable, "-m", "fastdraft.cli", "serve", "--model", args.model, "--port",
                               str(direct_port), "--threads", "1", "--served-model-name", "m", "--max-num-seqs", "16",
                               "--max-model-len", "1024"], stdout=subprocess.DEVNULL)
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
    out["overhead"] = {
        "ttft_p50_added_ms": (ray_c1["ttft_p50_s"] - direct_c1["ttft_p50_s"]) * 1e3,
        "throughput_ratio_c8": ray_c8["output_tok_s"] / direct_c8["output_tok_s"],
        "ray_c1": ray_c1, "direct_c1": direct_c1, "ray_c8": ray_c8, "direct_c8": direct_c8}
    print(f"overhead: TTFT p50 +{out['overhead']['ttft_p50_added_ms']:.1f} ms at concurrency 1; "
          f"throughput {out['overhead']['throughput_ratio_c8']:.2f}x of direct at 8", flush=True)
    tok_s = {}
    for replicas in (1, 2):
        _deploy(load_engine, replicas, "real")
        wait_ready(url)
        tok_s[replicas] = summarize(*asyncio.run(closed_loop(url, "m", prompts, 8 * replicas,
                                                             args.real_requests * replicas,
                                                             args.max_tokens)))["output_tok_s"]
        serve.delete("real")
    out["scaling"] = {"output_tok_s": tok_s, "ratio_2_to_1": tok_s[2] / tok_s[1]}
    print(f"real model: 2 replicas / 1 = {tok_s[2] / tok_s[1]:.2f}x ({tok_s[1]:.1f} -> {tok_s[2]:.1f} tok/s)",
          flush=True)
    return out


if __name__ == "__main__":
    main()
