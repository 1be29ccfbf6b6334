"""Speculative vs plain decoding, measured in the same run.

Batch 1, the first ``--prompt-tokens`` tokens of CPython's ``argparse.py`` (held out from
calibration and from the draft vocabulary's ranking), ``--new-tokens`` new
tokens (EOS ignored), greedy and temperature 0.7. Scenarios:

* ``self``: the target in bf16, drafted by its own INT4 copy (``speculative=True``).
* ``draft``: INT4 target drafted by a smaller INT4 model of the same tokenizer. The target is
  quantized as ``--target-quant`` says: by default RTN INT4 g32, as ``load_in_low_bit="sym_int4"``
  does (ipex-llm's groups of 32); ``--target-quant method=rtn,group_size=128`` is the
  configuration ``bench_latency.py`` measures.

For each: plain and speculative time per output token (median of ``--repeats`` rounds; a
sampled round pools ``--seeds`` seeds, since one trajectory's acceptance varies a lot), the
speedup, whether greedy outputs are identical, and acceptance figures (pooled over seeds).

    python benchmarks/bench_spec.py --scenario self --target qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_latency import (  # noqa: E402
    FAST_STATE_GB_S, STABLE_PROBES, add_state_split_argument, measure_bandwidth, memory_state)

from fastdraft.engine.generate import TextGenerator  # noqa: E402
from fastdraft.engine.llm_engine import EngineConfig  # noqa: E402
from fastdraft.engine.loader import load_model  # noqa: E402
from fastdraft.fileio import write_json  # noqa: E402
from fastdraft.quant.config import QuantConfig, parse_quant_spec  # noqa: E402
from fastdraft.quant.data import EVAL_CODE_FILES, stdlib_root  # noqa: E402
from fastdraft.quant.quantizer import quantize_model  # noqa: E402
from fastdraft.sampling_params import SamplingParams  # noqa: E402
from fastdraft.spec.config import SpeculativeConfig  # noqa: E402
from fastdraft.spec.decoding import SpecMetrics  # noqa: E402

PROMPT_FILE = EVAL_CODE_FILES[0]  # argparse.py


def prompt_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of a held-out stdlib module: text never used for
    calibration or for ranking the draft head's vocabulary."""
    path = stdlib_root() / PROMPT_FILE
    ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)[:num_tokens]
    if len(ids) < num_tokens:
        raise SystemExit(f"{path} has only {len(ids)} tokens")
    return ids


def one_run(generator: TextGenerator, ids: list[int], params: SamplingParams) -> dict:
    start = time.perf_counter()
    out = generator.generate(ids, params)
    total = time.perf_counter() - start
    m = out.metrics
    return {"tokens": out.token_ids, "decode_s": total - m.ttft_s, "num_decoded": max(len(out.token_ids) - 1, 1),
            "spec": m.spec}


def run_pair(plain: TextGenerator, spec: TextGenerator, ids: list[int], params_list: list[SamplingParams],
             repeats: int, split_gb_s: float = FAST_STATE_GB_S) -> tuple[dict, dict, float]:
    """Plain and speculative runs alternated, ``repeats`` rounds over every ``params`` (one per
    seed): a shared VM's memory bandwidth can drift within minutes, so back-to-back blocks would
    compare different machines. A round's time per token pools its seeds (each seed is a different
    trajectory with its own acceptance); the median round is reported.

    Each plain/speculative pair is printed with the memory bandwidth measured just before it:
    in a VM's fast memory state a 1-token step speeds up much more than a multi-token
    verification (which is then bound by arithmetic), so the speedup depends on the state.
    The speculative summary also holds every pair's speedup (``pair_speedups``) and, from a
    second probe after each pair, its memory state (``pair_states``: "slow", "fast" from
    ``split_gb_s`` GB/s up, or None when the probes disagree).
    Returns the plain and speculative summaries and the median bandwidth probe (GB/s)."""
    for generator in (plain, spec):
        generator.generate(ids[:32], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    rounds: dict[str, list[float]] = {"plain": [], "spec": []}
    first: dict[str, list[dict]] = {"plain": [], "spec": []}
    bandwidths: list[float] = []
    pair_speedups: list[float] = []
    pair_states: list[str | None] = []
    for i in range(repeats):
        times = {"plain": [0.0, 0], "spec": [0.0, 0]}
        for params in params_list:
            bandwidths.append(measure_bandwidth(gib=0.25, repeats=3) / 1e9)
            pair = {}
            for name, generator in (("plain", plain), ("spec", spec)):
                r = one_run(generator, ids, params)
                times[name][0] += r["decode_s"]
                times[name][1] += r["num_decoded"]
                pair[name] = r["decode_s"] / r["num_decoded"] * 1e3
                if i == 0:
                    first[name].append(r)
            pair_speedups.append(pair["plain"] / pair["spec"])
            after = measure_bandwidth(gib=0.25, repeats=3)
            pair_states.append(memory_state(bandwidths[-1] * 1e9, after, split_gb_s))
            print(f"  round {i + 1}, T={params.temperature}, seed {params.seed}: {bandwidths[-1]:.0f} GB/s before, "
                  f"{after / 1e9:.0f} after, plain {pair['plain']:.1f} ms/tok, spec {pair['spec']:.1f} ms/tok "
                  f"({pair['plain'] / pair['spec']:.2f}x)", flush=True)
        for name, (seconds, num_decoded) in times.items():
            rounds[name].append(seconds / num_decoded * 1e3)
    summary = {}
    for name, ms in rounds.items():
        best = {"ms_per_token": statistics.median(ms), "tokens": [r["tokens"] for r in first[name]]}
        if first[name][0]["spec"] is not None:
            stats = SpecMetrics()
            for r in first[name]:  # seeded runs repeat exactly: the first round's figures are every round's
                stats.merge(r["spec"])
            best.update(acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length,
                        per_position=stats.per_position_acceptance, num_plain_steps=stats.num_plain_steps)
        summary[name] = best
    summary["spec"]["pair_speedups"] = pair_speedups
    summary["spec"]["pair_states"] = pair_states
    return summary["plain"], summary["spec"], statistics.median(bandwidths)


def scenario(name: str, target_name: str, target_quant: QuantConfig | None, spec: SpeculativeConfig,
             args: argparse.Namespace) -> list[dict]:
    target = load_model(target_name, dtype="bf16", device=args.device)
    if target_quant is not None:
        quantize_model(target.model, target_quant, show_progress=False)
    ids = prompt_ids(target.tokenizer, args.prompt_tokens)
    max_len = args.prompt_tokens + args.new_tokens + 16
    # Plain requests repeat the prompt: no prefix cache, so both sides prefill it each time.
    plain = TextGenerator(target, engine_config=EngineConfig(max_num_seqs=1, max_model_len=max_len,
                                                             enable_prefix_caching=False))
    spec_gen = TextGenerator(target, max_seq_len=max_len, speculative=spec)
    rows = []
    for temperature in (0.0, 0.7):
        seeds = range(1 if temperature == 0 else args.seeds)
        params_list = [SamplingParams(max_new_tokens=args.new_tokens, temperature=temperature, seed=seed,
                                      ignore_eos=True) for seed in seeds]
        base, fast, bandwidth_gbs = run_pair(plain, spec_gen, ids, params_list, args.repeats, args.state_split_gbs)
        where = "" if args.device == "cpu" else f" on {args.device}, draft on {spec.draft_device or args.device}"
        label = target_quant.label if target_quant is not None else "bf16"
        row = {"scenario": name, "target": f"{target_name} ({label}){where}", "draft": spec.draft,
               "temperature": temperature, "num_seeds": len(params_list), "plain_ms_per_token": base["ms_per_token"],
               "spec_ms_per_token": fast["ms_per_token"], "speedup": base["ms_per_token"] / fast["ms_per_token"],
               "greedy_identical": (base["tokens"] == fast["tokens"]) if temperature == 0 else None,
               "bandwidth_gbs": bandwidth_gbs, "median_pair_speedup": statistics.median(fast["pair_speedups"]),
               "pair_speedups_by_state": pairs_by_state(fast["pair_speedups"], fast["pair_states"]),
               **{k: fast[k] for k in ("acceptance_rate", "mean_accepted_length", "per_position", "num_plain_steps")}}
        rows.append(row)
    del plain, spec_gen, target
    gc.collect()
    return rows


def pairs_by_state(speedups: list[float], states: list[str | None]) -> dict[str, list[float]]:
    """The speedups of the pairs that ran in one memory state throughout, by state."""
    return {state: [x for x, s in zip(speedups, states) if s == state] for state in ("slow", "fast")}


TABLE_HEADER = ("| scenario | target | draft | T | seeds | median BW GB/s | plain ms/tok | spec ms/tok | speedup | "
                "median pair speedup | greedy identical | acceptance | mean accepted len | per-position acceptance |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def print_row(r: dict) -> None:
    same = "" if r["greedy_identical"] is None else ("yes" if r["greedy_identical"] else "NO")
    per_pos = " ".join(f"{a:.2f}" for a in r["per_position"])
    print(f"| {r['scenario']} | {r['target']} | {r['draft']} | {r['temperature']} | {r['num_seeds']} | "
          f"{r['bandwidth_gbs']:.0f} | {r['plain_ms_per_token']:.1f} | "
          f"{r['spec_ms_per_token']:.1f} | {r['speedup']:.2f}x | {r['median_pair_speedup']:.2f}x | {same} | "
          f"{r['acceptance_rate'] * 100:.1f}% | "
          f"{r['mean_accepted_length']:.2f} | {per_pos} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", action="append", choices=["self", "draft"],
                        help="repeatable; default both")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3,
                        help="plain and speculative runs, alternated; medians are reported")
    parser.add_argument("--seeds", type=int, default=8,
                        help="sampled runs (T=0.7) pool this many seeds: one trajectory's acceptance is noisy")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", help="the target's device (e.g. cuda)")
    parser.add_argument("--draft-device", default=None,
                        help="the draft's device; default the target's (e.g. cpu beside a cuda target)")
    parser.add_argument("--target-quant", default="method=rtn,group_size=32",
                        help="how the draft scenario quantizes its target (key=value,... as in bench_latency.py's "
                             "--quant); the draft is quantized as SpeculativeConfig says")
    add_state_split_argument(parser)
    parser.add_argument("--json", type=Path, default=Path("bench_results/spec.json"))
    args = parser.parse_args()
    try:
        target_quant = parse_quant_spec(args.target_quant)
    except ValueError as exc:
        parser.error(str(exc))
    torch.set_num_threads(args.threads)
    print(f"1-minute load average before the run: {os.getloadavg()[0]:.1f} (timings need an idle machine)")
    rows = []
    k = args.num_speculative_tokens
    for name in args.scenario or ["self", "draft"]:
        if name == "self":
            rows += scenario("self", args.target, None, SpeculativeConfig(draft="self", num_speculative_tokens=k,
                                                                  draft_device=args.draft_device), args)
        else:
            spec = SpeculativeConfig(draft=args.draft, num_speculative_tokens=k, draft_device=args.draft_device)
            rows += scenario("draft", args.target, target_quant, spec, args)
    print(f"\n{TABLE_HEADER}")
    for row in rows:
        print_row(row)
    # A 1-token step gains much more from the fast memory state than a verification pass does,
    # so the speedup is reported per state too.
    print(f"\nstate-stable pairs (probes before and after within {100 * STABLE_PROBES:.0f}%), "
          "median speedup by memory state:")
    for row in rows:
        parts = [f"{state} {len(xs)} ({statistics.median(xs):.2f}x)" if xs else f"{state} 0"
                 for state, xs in row["pair_speedups_by_state"].items()]
        print(f"  {row['scenario']} T={row['temperature']}: " + ", ".join(parts))
    write_json(args.json, {"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    print(f"\nresults written to {args.json}")


if __name__ == "__main__":
    main()
