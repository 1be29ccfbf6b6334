"""Greedy decode of two checkouts of fastdraft, interleaved in one run: batch 1, or
``--num-seqs N`` sequences at once through the serving engine.

Each checkout gets its own long-lived worker process (its own sources first on the path, its
own compiled kernels), which loads the model once and quantizes it as ``--quant`` says. The
workers then take turns for ``--rounds`` rounds, the one that goes first alternating; each
turn generates ``--new-tokens`` greedy tokens through ``TextGenerator`` after a
``--prompt-tokens`` prompt and reports decode tokens/s (the median gap between tokens); with
``--num-seqs N``, N different prompts go through ``LLMEngine`` together and the figure is the
tokens generated after the last prompt's prefill over the time they took (as
``llama-batched-bench``'s S_TG). The
figure is the median of the per-round ratios B/A, so a slow or fast spell of a shared machine
falls on both alike.

    git worktree add /tmp/base 8f0450b
    python benchmarks/ab_checkouts.py /tmp/base . --model qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys
import torch
import fastdraft
from fastdraft import TextGenerator, load_model
from fastdraft.quant.quant_config import parse_quant_spec
from fastdraft.quant.quantizer import quantize_model
from fastdraft.sampling_params import SamplingParams

model, quant, prompt_tokens, new_tokens, threads, num_seqs = sys.argv[1:7]
prompt_tokens, new_tokens, num_seqs = int(prompt_tokens), int(new_tokens), int(num_seqs)
# Older checkouts lack configure_process (their engine's constructor tuned malloc).
configure_process = getattr(fastdraft, "configure_process", None)
if configure_process is not None:
    configure_process(num_threads=int(threads))
else:
    torch.set_num_threads(int(threads))
loaded = load_model(model, dtype="bf16", keep_gguf_quant=quant == "gguf")
if quant not in ("bf16", "gguf"):
    quantize_model(loaded.model, parse_quant_spec(quant), show_progress=False)
ids = loaded.tokenizer.encode(open(__import__("os").__file__).read())
params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
if num_seqs == 1:
    generator = TextGenerator(loaded, max_seq_len=prompt_tokens + new_tokens + 8)
    run = lambda: generator.generate(ids[:prompt_tokens], params)
else:
    import time
    from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
    stride = (len(ids) - prompt_tokens) // num_seqs
    prompts = [ids[i * stride:i * stride + prompt_tokens] for i in range(num_seqs)]
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=512,
                                            max_model_len=prompt_tokens + new_tokens + 8,
                                            enable_prefix_caching=False))

    def run():
        first = [engine.add_request(p, params) for p in prompts][0]
        started, first_tokens, generated, tokens = set(), None, 0, []
        while engine.has_unfinished_requests:
            for out in engine.step():
                if not out.new_token_ids:
                    continue
                if out.request_id == first:
                    tokens.extend(out.new_token_ids)
                if first_tokens is not None:
                    generated += len(out.new_token_ids)
                started.add(out.request_id)
            if first_tokens is None and len(started) == num_seqs:
                first_tokens = time.perf_counter()
        return {"decode_tok_s": generated / (time.perf_counter() - first_tokens), "tokens": tokens[:8]}
run()  # warm-up
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    out = run()
    if not isinstance(out, dict):
        out = {"decode_tok_s": out.metrics.decode_tokens_per_s, "tokens": out.token_ids[:8]}
    print(json.dumps(out), flush=True)
"""


def start_worker(checkout: Path, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(checkout.resolve()))
    proc = subprocess.Popen([sys.executable, "-c", WORKER, args.model, args.quant, str(args.prompt_tokens),
                             str(args.new_tokens), str(args.threads), str(args.num_seqs)], cwd=checkout, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc


def ask(proc: subprocess.Popen) -> dict:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="checkout A (the baseline)")
    parser.add_argument("b", type=Path, help="checkout B")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--quant", default="method=rtn,group_size=128,sym=true",
                        help="a quantization spec both checkouts parse, bf16, or gguf (the GGUF file's own blocks)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-seqs", type=int, default=1, help="sequences decoded together (1: TextGenerator)")
    args = parser.parse_args()
    # Started one after the other (each loads while the other waits), so that neither load is
    # timed against the other's.
    workers = []
    for checkout in (args.a, args.b):
        proc = start_worker(checkout, args)
        if not json.loads(proc.stdout.readline()).get("ready"):
            raise SystemExit(f"worker for {checkout} did not start")
        workers.append(proc)
    ratios, speeds = [], ([], [])
    for r in range(args.rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        result = {}
        for i in order:
            result[i] = ask(workers[i])
            speeds[i].append(result[i]["decode_tok_s"])
        if result[0]["tokens"] != result[1]["tokens"]:
            print(f"round {r}: the checkouts' first tokens differ: {result[0]['tokens']} / {result[1]['tokens']}")
        ratios.append(result[1]["decode_tok_s"] / result[0]["decode_tok_s"])
        print(f"round {r}: A {result[0]['decode_tok_s']:.1f}  B {result[1]['decode_tok_s']:.1f} tok/s  "
              f"B/A {ratios[-1]:.3f}", flush=True)
    for proc in workers:
        proc.stdin.close()
        proc.wait()
    print(f"\n{args.model} {args.quant}, {args.num_seqs} x {args.prompt_tokens}-token prompt, {args.new_tokens} tokens, "
          f"{args.threads} threads, {args.rounds} rounds")
    print(f"A ({args.a}): median {statistics.median(speeds[0]):.1f} decode tok/s")
    print(f"B ({args.b}): median {statistics.median(speeds[1]):.1f} decode tok/s")
    print(f"B/A: median of per-round ratios {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
