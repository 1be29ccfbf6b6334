"""Offline throughput: N prompts at once through the serving engine, against one request at a
time and against llama.cpp's ``llama-batched-bench``.

Every prompt has exactly ``--prompt-tokens`` tokens (slices of CPython's ``os.py``, different
for each sequence) and produces exactly ``--new-tokens`` tokens (EOS ignored). As
``llama-batched-bench`` does, it reports per parallel count N: prefill tokens/s (every prompt's
tokens over the time until the last sequence has its first token), generation tokens/s (tokens
generated after that, over the time until all N sequences are done), end-to-end tokens/s, and
the process's peak RSS so far (the runs go from the baseline to the largest N, so each row's
figure covers that run and those before it).

It also prints the compute ceiling of batched decoding derived from the same run's prefill
rate (a decode token costs about ``--decode-cost`` prefill tokens: the LM head runs for every
decoded row), each batched row's share of it and its ratio to ``llama-batched-bench`` at the
same N, and the share of the engine's step time spent sampling. ``--mode-cost N`` adds the
cost of batch-invariant mode: N sequences with the mode on and off, alternating, medians.

    python benchmarks/bench_throughput.py --model qwen2.5-coder-0.5b-instruct --num-seqs 1,4,16,32
    python benchmarks/bench_throughput.py --llama-batched-bench ./llama.cpp/build/bin/llama-batched-bench
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import resource
import statistics
import subprocess
import time
from pathlib import Path

import torch

from fastdraft.generator import TextGenerator
from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
from fastdraft.engine.loader import load_model
from fastdraft.fileio import write_json
from fastdraft.kernels.build import cpu_model, load_cpu_kernels
from fastdraft.models.registry import KNOWN_MODELS, original_gguf
from fastdraft.process import configure_process
from fastdraft.quant.quant_config import parse_quant_spec
from fastdraft.quant.quantizer import quantize_model
from fastdraft.sampling_params import SamplingParams


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_prompts(tokenizer, num: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(Path(os.__file__).read_text(encoding="utf-8"), add_special_tokens=False)
    if len(ids) < num + length:
        raise SystemExit(f"{os.__file__} is too short for {num} prompts of {length} tokens")
    stride = max(1, (len(ids) - length) // num)
    return [ids[i * stride:i * stride + length] for i in range(num)]


def run_batched(loaded, prompts: list[list[int]], new_tokens: int, max_batched_tokens: int,
                params: SamplingParams, batch_invariant: bool, block_size: int = 16) -> dict:
    num = len(prompts)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=num, max_num_batched_tokens=max_batched_tokens,
                                            max_model_len=len(prompts[0]) + new_tokens + 1, block_size=block_size,
                                            enable_prefix_caching=False, batch_invariant=batch_invariant))
    params = dataclasses.replace(params, max_new_tokens=new_tokens)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    counts: dict[str, int] = {}
    prefilled_at, generated_after = None, 0
    while engine.has_unfinished_requests:
        for delta in engine.step():
            counts[delta.request_id] = counts.get(delta.request_id, 0) + 1
            if prefilled_at is not None:
                generated_after += len(delta.new_token_ids)
        if prefilled_at is None and len(counts) == num:
            prefilled_at = time.perf_counter()
    end = time.perf_counter()
    prompt_tokens = num * len(prompts[0])
    return {"num_seqs": num, "prefill_tok_s": prompt_tokens / (prefilled_at - start),
            "gen_tok_s": generated_after / (end - prefilled_at) if end > prefilled_at else 0.0,
            "total_tok_s": (prompt_tokens + num * new_tokens) / (end - start), "seconds": end - start,
            "sample_share": engine.runner.sample_seconds / (engine.runner.sample_seconds + engine.runner.forward_seconds),
            "peak_rss_mb": peak_rss_mb()}


def run_sequential(loaded, prompts: list[list[int]], new_tokens: int, params: SamplingParams) -> dict:
    max_len = len(prompts[0]) + new_tokens + 1
    generator = TextGenerator(loaded, engine_config=EngineConfig(max_num_seqs=1, max_model_len=max_len,
                                                                 enable_prefix_caching=False))
    prefill_s = decode_s = 0.0
    start = time.perf_counter()
    for p in prompts:
        metrics = generator.generate(p, params).metrics
        prefill_s += metrics.ttft_s
        decode_s += sum(metrics.token_latencies_s)
    end = time.perf_counter()
    prompt_tokens = len(prompts) * len(prompts[0])
    return {"num_seqs": 1, "prefill_tok_s": prompt_tokens / prefill_s,
            "gen_tok_s": len(prompts) * (new_tokens - 1) / decode_s,
            "total_tok_s": (prompt_tokens + len(prompts) * new_tokens) / (end - start), "seconds": end - start,
            "peak_rss_mb": peak_rss_mb()}


def run_llama_batched_bench(binary: Path, gguf: Path, args: argparse.Namespace) -> list[dict]:
    ctx = max(args.num_seqs) * (args.prompt_tokens + args.new_tokens) + 256
    cmd = [str(binary), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(args.prompt_tokens),
           "-ntg", str(args.new_tokens), "-npl", ",".join(map(str, args.num_seqs)), "-t", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = []
    # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[0]):
            rows.append({"num_seqs": int(cells[2]), "prefill_tok_s": float(cells[5]), "gen_tok_s": float(cells[7]),
                         "total_tok_s": float(cells[9])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", choices=list(KNOWN_MODELS))
    parser.add_argument("--quant", default="method=rtn,group_size=128",
                        help="fastdraft's weights: a --quant spec, method=gguf for the file's own blocks, or none")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--num-seqs", default="1,4,16,32,64", help="parallel counts, comma-separated")
    parser.add_argument("--sequential-requests", type=int, default=4,
                        help="requests run one at a time for the sequential baseline (0: skip it)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--batch-invariant", choices=["on", "off"], default="on",
                        help="the engine's batch-invariant mode for the batched rows (default on, as the engine)")
    parser.add_argument("--mode-cost", type=int, default=0, metavar="N",
                        help="also time N sequences with batch-invariant mode on and off, alternating (0: skip)")
    parser.add_argument("--mode-cost-rounds", type=int, default=3)
    parser.add_argument("--block-sizes", default=None, metavar="B,B,...",
                        help="also time --mode-cost N sequences (32 if unset) at each KV block size, alternating "
                             "--mode-cost-rounds times (block sizes are powers of two)")
    parser.add_argument("--decode-cost", type=float, default=1.4,
                        help="prefill tokens one decode token costs, for the ceiling (default 1.4)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--llama-batched-bench", type=Path, default=None,
                        help="path to llama.cpp's llama-batched-bench binary (skipped without it)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of the batched runs and llama-batched-bench, alternating which goes first")
    parser.add_argument("--json", type=Path, default=Path("bench_results/throughput.json"))
    args = parser.parse_args()
    try:
        args.num_seqs = [int(n) for n in args.num_seqs.split(",")]
    except ValueError:
        parser.error("--num-seqs takes a comma-separated list of integers")
    if min(args.num_seqs) < 1 or args.prompt_tokens < 1 or args.new_tokens < 2:
        parser.error("need --num-seqs >= 1, --prompt-tokens >= 1 and --new-tokens >= 2")
    if args.llama_batched_bench is not None and not args.llama_batched_bench.is_file():
        parser.error(f"--llama-batched-bench: {args.llama_batched_bench} does not exist")
    config = None if args.quant == "none" else parse_quant_spec(args.quant)
    configure_process(num_threads=args.threads)

    loaded = load_model(args.model, dtype=args.dtype, keep_gguf_quant=config is not None and config.is_gguf_native)
    if config is not None and not config.is_gguf_native:
        quantize_model(loaded.model, config, show_progress=False)
    label = "bf16" if config is None else config.label
    block_n = (args.mode_cost or 32) if args.block_sizes else 0
    prompts = make_prompts(loaded.tokenizer, max(args.num_seqs + [args.sequential_requests, args.mode_cost, block_n]),
                           args.prompt_tokens)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=args.temperature,
                            top_p=args.top_p, seed=0)
    is_invariant = args.batch_invariant == "on"
    # Warm-up: kernels built, caches touched.
    run_batched(loaded, prompts[:2], 4, args.max_num_batched_tokens, params, is_invariant)
    results: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "fastdraft": label, "rows": []}
    if args.sequential_requests:
        row = {"system": f"fastdraft {label}, one request at a time",
               **run_sequential(loaded, prompts[:args.sequential_requests], args.new_tokens, params)}
        results["rows"].append(row)
    # Rounds alternate which system goes first; each row is the median of its rounds, and the
    # ratio to llama.cpp the median of the per-round ratios.
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        systems = ["fastdraft", "llama"] if r % 2 == 0 else ["llama", "fastdraft"]
        for system in systems:
            if system == "fastdraft":
                for num in args.num_seqs:
                    runs.setdefault(("fastdraft", num), []).append(run_batched(
                        loaded, prompts[:num], args.new_tokens, args.max_num_batched_tokens, params, is_invariant))
            elif args.llama_batched_bench is not None:
                for row in run_llama_batched_bench(args.llama_batched_bench, original_gguf(args.model), args):
                    runs.setdefault(("llama", row["num_seqs"]), []).append(row)
    per_round_ratios = {num: [f["gen_tok_s"] / p["gen_tok_s"] for f, p in zip(runs[("fastdraft", num)],
                                                                              runs.get(("llama", num), []))]
                        for num in args.num_seqs}
    for (system, num), rows in runs.items():
        name = f"fastdraft {label}, batched" if system == "fastdraft" else "llama-batched-bench (original GGUF)"
        row = {"system": name, **{k: statistics.median(x[k] for x in rows) for k in rows[0] if k != "num_seqs"},
               "num_seqs": num, "rounds": len(rows)}
        if system == "fastdraft" and per_round_ratios[num]:
            row["vs_llama"] = statistics.median(per_round_ratios[num])
        results["rows"].append(row)
    write_json(args.json, results)
    mode_runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.mode_cost_rounds if args.mode_cost else 0):
        for mode in ("on", "off"):
            mode_runs[mode].append(run_batched(loaded, prompts[:args.mode_cost], args.new_tokens,
                                               args.max_num_batched_tokens, params, mode == "on"))
    block_sizes = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else []
    block_runs: dict[int, list[dict]] = {b: [] for b in block_sizes}
    for _ in range(args.mode_cost_rounds if block_sizes else 0):
        for block_size in block_sizes:
            block_runs[block_size].append(run_batched(loaded, prompts[:args.mode_cost or 32], args.new_tokens,
                                                      args.max_num_batched_tokens, params, is_invariant, block_size))
    if block_sizes:
        results["block_sizes"] = {b: {key: statistics.median(r[key] for r in runs)
                                      for key in ("prefill_tok_s", "gen_tok_s", "total_tok_s")}
                                  for b, runs in block_runs.items()}
    if args.mode_cost:
        results["mode_cost"] = {mode: {key: statistics.median(r[key] for r in runs)
                                       for key in ("prefill_tok_s", "gen_tok_s", "total_tok_s")}
                                for mode, runs in mode_runs.items()}
    write_json(args.json, results)

    print(f"\n### {args.model}: {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
          f"{args.threads} threads, {args.rounds} interleaved rounds (medians)\n")
    kernels = load_cpu_kernels()
    print(f"CPU: {cpu_model()}; kernels: {kernels.name if kernels is not None else 'PyTorch (no C++ kernels)'}")
    sampling = "greedy" if params.is_greedy else f"temperature {args.temperature}, top_p {args.top_p}"
    print(f"sampling: {sampling}; batch-invariant mode {args.batch_invariant}\n")
    batched = [r for r in results["rows"] if r["system"].endswith("batched")]
    # The ceiling: the largest batched run's prefill rate, over what one decode token costs in prefill tokens.
    ceiling = max(r["prefill_tok_s"] for r in batched) / args.decode_cost if batched else 0.0
    print("| system | N | prefill tok/s | generation tok/s | total tok/s | of ceiling | vs llama.cpp | "
          "sampling share | peak RSS so far, MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["rows"]:
        rss = f"{r['peak_rss_mb']:.0f}" if "peak_rss_mb" in r else ""
        is_batched = r in batched
        share = f"{r['gen_tok_s'] / ceiling:.0%}" if is_batched and ceiling else ""
        ratio = f"{r['vs_llama']:.2f}x" if "vs_llama" in r else ""
        sample_share = f"{r['sample_share']:.1%}" if "sample_share" in r else ""
        print(f"| {r['system']} | {r['num_seqs']} | {r['prefill_tok_s']:.1f} | {r['gen_tok_s']:.1f} | "
              f"{r['total_tok_s']:.1f} | {share} | {ratio} | {sample_share} | {rss} |")
    print(f"\nceiling of batched decoding: {ceiling:.0f} tok/s (best batched prefill / {args.decode_cost})")
    if block_sizes:
        print(f"\nKV block size at N = {args.mode_cost or 32}, medians of {args.mode_cost_rounds} alternating runs:")
        print("| block size | prefill tok/s | generation tok/s | total tok/s |\n|---:|---:|---:|---:|")
        for b, r in results["block_sizes"].items():
            print(f"| {b} | {r['prefill_tok_s']:.1f} | {r['gen_tok_s']:.1f} | {r['total_tok_s']:.1f} |")
    if args.mode_cost:
        on, off = results["mode_cost"]["on"], results["mode_cost"]["off"]
        print(f"\nbatch-invariant mode at N = {args.mode_cost}, medians of {args.mode_cost_rounds} alternating runs:")
        print("| mode | prefill tok/s | generation tok/s | total tok/s |\n|---|---:|---:|---:|")
        for mode, r in (("on", on), ("off", off)):
            print(f"| {mode} | {r['prefill_tok_s']:.1f} | {r['gen_tok_s']:.1f} | {r['total_tok_s']:.1f} |")
        print(f"| on / off | {on['prefill_tok_s'] / off['prefill_tok_s']:.3f} | "
              f"{on['gen_tok_s'] / off['gen_tok_s']:.3f} | {on['total_tok_s'] / off['total_tok_s']:.3f} |")
    print(f"\nresults written to {args.json}")


if __name__ == "__main__":
    main()
