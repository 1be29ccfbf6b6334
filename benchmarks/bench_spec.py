"""Speculative decoding in the serving engine against plain decoding, closed loop, same run.

Each case loads its target once and builds two engines over it, one speculating and one not.
At each concurrency ``c`` the engines take turns (the first mover alternating by round), each
keeping ``c`` requests in flight until ``--requests-per-slot * c`` requests have finished:
``--new-tokens`` tokens each (128 by default), EOS ignored, prompts of ``--prompt-tokens`` tokens cut from a
held-out stdlib module at different offsets. The figure is generated tokens per second over
the whole run; the ratio is the median over rounds of the per-round ratio, which cancels the
drift of memory bandwidth between rounds.

Cases:

* ``pair``: the target quantized INT4 g128 (RTN), drafted by the 0.5B of the same tokenizer
  (INT4), at each ``--concurrency``; greedy, and at T=0.7 for concurrency 1.
* ``self``: the target in bf16, drafted by its own INT4 copy, at concurrency 1 and 4.
* ``ngram``: the INT4 target with prompt lookup on an editing task (the answer repeats most of
  the prompt), at concurrency 1 and 8.

    python benchmarks/bench_spec.py --cases pair,self,ngram
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
from fastdraft.engine.loader import load_model
from fastdraft.engine.metrics import SpecMetrics
from fastdraft.engine.output import RequestCollector
from fastdraft.process import configure_process
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.data import SELECTION_CODE_FILES, stdlib_root
from fastdraft.quant.quantizer import quantize_model
from fastdraft.sampling_params import SamplingParams
from fastdraft.speculative.speculative_config import SpeculativeConfig
from fastdraft.speculative.factory import speculator_factory

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def code_prompts(tokenizer, num_prompts: int, num_tokens: int) -> list[list[int]]:
    """``num_prompts`` windows of ``num_tokens`` tokens of a held-out stdlib module."""
    text = (stdlib_root() / SELECTION_CODE_FILES[0]).read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False)
    step = max((len(ids) - num_tokens) // max(num_prompts, 1), 1)
    return [ids[i * step:i * step + num_tokens] for i in range(num_prompts)]


def edit_prompts(tokenizer, num_prompts: int, num_tokens: int) -> list[list[int]]:
    """Chat prompts asking to repeat a code window with one name changed: the answer copies
    most of the prompt, which is what prompt lookup is for."""
    windows = code_prompts(tokenizer, num_prompts, num_tokens)
    prompts = []
    for window in windows:
        code = tokenizer.decode(window)
        message = f"Rewrite this code, renaming `self` to `this`. Output only the code.\n\n```python\n{code}\n```"
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": message}]),
                                        add_special_tokens=False))
    return prompts


def closed_loop(engine: LLMEngine, prompts: list[list[int]], concurrency: int, num_requests: int,
                params: SamplingParams) -> tuple[float, SpecMetrics]:
    """Generated tokens per second with ``concurrency`` requests in flight until
    ``num_requests`` have finished; and the speculation figures pooled over them."""
    spec = SpecMetrics()
    collectors: dict[str, RequestCollector] = {}
    num_added = num_done = num_tokens = 0
    start = time.perf_counter()
    while num_done < num_requests:
        while num_added < num_requests and num_added - num_done < concurrency:
            request_id = engine.add_request(prompts[num_added % len(prompts)], params)
            collectors[request_id] = engine.collector(request_id)
            num_added += 1
        for delta in engine.step():
            collector = collectors[delta.request_id]
            collector.add(delta)
            if collector.is_finished:
                del collectors[delta.request_id]
                num_done += 1
                num_tokens += len(collector.token_ids)
                if collector.metrics.spec is not None:
                    spec.merge(collector.metrics.spec)
    return num_tokens / (time.perf_counter() - start), spec


def compare(name: str, plain: LLMEngine, spec: LLMEngine, prompts: list[list[int]], concurrency: int,
            params: SamplingParams, args: argparse.Namespace) -> dict:
    """Interleaved rounds of both engines at ``concurrency``; prints and returns the row."""
    num_requests = args.requests_per_slot * concurrency
    closed_loop(plain, prompts, concurrency, concurrency, params)  # warm both at this batch size
    closed_loop(spec, prompts, concurrency, concurrency, params)
    rates: dict[str, list[float]] = {"plain": [], "spec": []}
    pooled = SpecMetrics()
    for round_index in range(args.rounds):
        order = [("plain", plain), ("spec", spec)]
        for label, engine in order if round_index % 2 == 0 else order[::-1]:
            rate, figures = closed_loop(engine, prompts, concurrency, num_requests, params)
            rates[label].append(rate)
            if label == "spec":
                pooled.merge(figures)
    ratio = statistics.median(s / p for s, p in zip(rates["spec"], rates["plain"]))
    steps = sum(pooled.steps_per_draft_length) or 1
    mean_k = sum(k * n for k, n in enumerate(pooled.steps_per_draft_length)) / steps
    row = {"case": name, "concurrency": concurrency, "temperature": params.temperature,
           "plain_tok_s": statistics.median(rates["plain"]), "spec_tok_s": statistics.median(rates["spec"]),
           "ratio": ratio, "acceptance": pooled.acceptance_rate, "mean_k": mean_k}
    print(f"| {name} | {concurrency} | {params.temperature:.1f} | {row['plain_tok_s']:.1f} | {row['spec_tok_s']:.1f} "
          f"| **{ratio:.2f}x** | {pooled.acceptance_rate * 100:.0f}% | {mean_k:.2f} |", flush=True)
    return row


def engine_pair(target, speculation: SpeculativeConfig, args: argparse.Namespace) -> tuple[LLMEngine, LLMEngine]:
    config = EngineConfig(max_num_seqs=max(args.concurrency), max_model_len=2048,
                          kv_cache_memory=args.kv_cache_memory)
    return LLMEngine(target, config), LLMEngine(target, config, speculation=speculator_factory(speculation))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="pair,self,ngram")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32", help="the pair's concurrencies")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--requests-per-slot", type=int, default=2, help="requests per round: this times c")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB per engine (32 x 256 tokens: 0.23)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    configure_process(num_threads=args.threads)
    torch.set_grad_enabled(False)
    cases = args.cases.split(",")
    greedy = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.7, ignore_eos=True)
    print(f"{torch.get_num_threads()} threads, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
          f"{args.rounds} interleaved rounds of {args.requests_per_slot} x c requests")
    print("| case | c | T | plain tok/s | spec tok/s | spec / plain | acceptance | mean k |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    start = time.perf_counter()
    if "pair" in cases or "ngram" in cases:
        target = load_model(TARGET, dtype="bf16", keep_gguf_quant=False)
        quantize_model(target.model, QuantConfig.from_low_bit("sym_int4", group_size=128), show_progress=False)
        prompts = code_prompts(target.tokenizer, 64, args.prompt_tokens)
        if "pair" in cases:
            plain, spec = engine_pair(target, SpeculativeConfig(draft=DRAFT), args)
            for c in args.concurrency:
                compare("pair", plain, spec, prompts, c, greedy, args)
            compare("pair", plain, spec, prompts, 1, sampled, args)
            del plain, spec
            gc.collect()  # the next engines get the memory back
        if "ngram" in cases:
            plain, spec = engine_pair(target, SpeculativeConfig(draft="ngram"), args)
            edits = edit_prompts(target.tokenizer, 16, args.prompt_tokens)
            for c in (1, 8):
                compare("ngram (edit)", plain, spec, edits, c, greedy, args)
            del plain, spec
        del target
        gc.collect()
    if "self" in cases:
        target = load_model(TARGET, dtype="bf16", keep_gguf_quant=False)
        prompts = code_prompts(target.tokenizer, 64, args.prompt_tokens)
        plain, spec = engine_pair(target, SpeculativeConfig(draft="self"), args)
        compare("self (bf16)", plain, spec, prompts, 1, greedy, args)
        compare("self (bf16)", plain, spec, prompts, 1, sampled, args)
        compare("self (bf16)", plain, spec, prompts, 4, greedy, args)
    print(f"total {(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
