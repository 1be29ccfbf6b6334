"""fastdraft's engine on a GPU against HF ``transformers`` eager ``generate`` on the same weights.

``--random-weights NAME`` builds a model of a known model's shape (the registry's
``Architecture``) with random weights: no network, no model files, only torch, triton and
transformers. Each case runs ``--num-seqs`` sequences of ``--prompt-tokens`` random prompt
tokens and ``--new-tokens`` greedy tokens (EOS ignored) end to end through ``LLM.generate``,
then through HF's ``generate`` with eager attention on the same weights, and reports tokens/s
and the ratio. Decode steps replay CUDA graphs (``--modes graphs``) or run eagerly (``eager``,
the engine's ``enforce_eager``); both run in one invocation by default. ``--profile`` also
times the engine's decode steps under the torch profiler: kernel launches outside graph
replays, wall time, host time (wall time less the time blocked on the GPU) and GPU time per step.
``--cpu-draft NAME`` adds the TACO-LLM shape at batch 1: the target on the GPU with a draft of
NAME's shape on the CPU (adaptive draft length), against the target alone.

    PYTHONPATH=. python benchmarks/bench_gpu.py --random-weights qwen2.5-coder-0.5b-instruct
    PYTHONPATH=. python benchmarks/bench_gpu.py --random-weights qwen2.5-coder-0.5b-instruct --num-seqs 64 \\
        --dtype bf16 --quant none --profile
    PYTHONPATH=. python benchmarks/bench_gpu.py --random-weights qwen2.5-coder-1.5b-instruct --num-seqs 1 \\
        --quant none --modes graphs --no-hf --cpu-draft qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
from fastdraft.fileio import write_json
from fastdraft.llm import LLM
from fastdraft.models.files import LoadedModel, build_model
from fastdraft.models.registry import KNOWN_MODELS
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.quantizer import quantize_model
from fastdraft.sampling_params import SamplingParams
from fastdraft.speculative.factory import speculator_factory
from fastdraft.speculative.speculative_config import SpeculativeConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def hf_model(name: str, dtype: torch.dtype, device: str, seed: int):
    """A randomly initialized HF model of ``name``'s shape, eager attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = KNOWN_MODELS[name].architecture
    fields = {field: getattr(arch, field) for field in arch.__dataclass_fields__ if field != "model_type"}
    config = AutoConfig.for_model(arch.model_type, **fields)
    torch.manual_seed(seed)
    # Initialized where it runs: random init of a 1.5B model takes tens of seconds on a CPU.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval()


def fastdraft_model(name: str, hf, dtype: torch.dtype, device: str, quant: str) -> LoadedModel:
    """fastdraft's model on the HF model's weights (quantized with RTN INT4 g128 for ``int4``)."""
    config = KNOWN_MODELS[name].architecture.model_config()
    state_dict = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    model = build_model(config, state_dict, dtype, device)
    if quant == "int4":
        quantize_model(model, QuantConfig(method="rtn", bits=4, group_size=128), show_progress=False)
    return LoadedModel(model=model, tokenizer=None, config=config, model_dir=None)


def random_prompts(num_seqs: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_seqs, length), generator=gen).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_engine(engine: LLMEngine, prompts: list[list[int]], new_tokens: int,
               device: str) -> tuple[float, int, dict[str, int]]:
    """Seconds, tokens, and the drafting counts (steps that drafted, drafted and accepted tokens)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, detokenize=False)
    sync(device)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    num_tokens = 0
    drafting = {"drafting_steps": 0, "draft_tokens": 0, "accepted_tokens": 0}
    while engine.has_unfinished_requests:
        for delta in engine.step():
            num_tokens += len(delta.new_token_ids)
            drafting["drafting_steps"] += bool(delta.num_draft_tokens)
            drafting["draft_tokens"] += delta.num_draft_tokens or 0
            drafting["accepted_tokens"] += delta.num_accepted_tokens
    sync(device)
    return time.perf_counter() - start, num_tokens, drafting


def run_fastdraft(llm: LLM, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, int]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, detokenize=False)
    sync(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    return time.perf_counter() - start, sum(len(out.outputs[0].token_ids) for out in outputs)


@torch.inference_mode()
def run_hf(hf, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, int]:
    input_ids = torch.tensor(prompts, device=device)
    sync(device)
    start = time.perf_counter()
    out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync(device)
    return time.perf_counter() - start, (out.shape[1] - input_ids.shape[1]) * out.shape[0]


@torch.inference_mode()
def profile_decode(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, device: str,
                   num_steps: int = 10, table: Path | None = None) -> dict:
    """Launches, host and GPU time per decode step, with every sequence decoding."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, detokenize=False)
    ids = [engine.add_request(p, params) for p in prompts]
    started: set[str] = set()
    while len(started) < len(ids):  # prefill: every sequence has its first token
        started.update(delta.request_id for delta in engine.step())
    engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        sync(device)
        host_s = (time.perf_counter() - start) / num_steps
    events = prof.events()
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                   "cuLaunchKernelEx"))
    # Host calls that wait for the GPU: the step's host time is its wall time without them.
    blocked_us = sum(e.cpu_time_total for e in events if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                                     "cudaEventSynchronize", "cudaMemcpyAsync",
                                                                     "cudaMemcpy"))
    gpu_us = sum(e.device_time_total for e in events if e.device_type.name == "CUDA")
    attention = sum(1 for e in events if "_attention_kernel" in e.name and e.device_type.name == "CUDA")
    if table is not None:  # the ops by host time, then by GPU time
        averages = prof.key_averages()
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n"
                         + averages.table(sort_by="self_device_time_total", row_limit=25))
    engine.abort_all()
    return {"steps": num_steps, "launches_per_step": launches / num_steps, "step_ms": host_s * 1e3,
            "host_ms_per_step": host_s * 1e3 - blocked_us / 1e3 / num_steps,
            "graph_replays_per_step": sum(1 for e in events if e.name == "cudaGraphLaunch") / num_steps,
            "gpu_ms_per_step": gpu_us / 1e3 / num_steps, "attention_launches_per_step": attention / num_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random-weights", required=True, choices=sorted(KNOWN_MODELS), metavar="NAME",
                        help="a known model whose shape to build, with random weights")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-seqs", default="1,64", help="concurrent sequences, comma-separated")
    parser.add_argument("--dtype", default="bf16", help="comma-separated: bf16, fp16, fp32")
    parser.add_argument("--quant", default="none,int4", help="comma-separated: none, int4 (RTN g128)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="the engine's token budget a step (prefill chunks); at least the number of sequences")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--profile", action="store_true", help="launches, host and GPU time per decode step")
    parser.add_argument("--profile-tables", type=Path, default=None,
                        help="with --profile, write each case's op table (host and GPU time) into this folder")
    parser.add_argument("--modes", default="graphs,eager",
                        help="comma-separated: graphs (decode steps replay CUDA graphs), eager (enforce_eager)")
    parser.add_argument("--cpu-draft", default=None, choices=sorted(KNOWN_MODELS), metavar="NAME",
                        help="also run batch 1 with a random draft of NAME's shape on the CPU beside the target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench_results/gpu.json"))
    args = parser.parse_args()
    try:
        num_seqs = [int(n) for n in args.num_seqs.split(",")]
    except ValueError:
        parser.error("--num-seqs takes comma-separated integers")
    dtypes, quants, modes = args.dtype.split(","), args.quant.split(","), args.modes.split(",")
    if not set(dtypes) <= set(DTYPES) or not set(quants) <= {"none", "int4"} or min(num_seqs) < 1 \
            or not set(modes) <= {"graphs", "eager"}:
        parser.error("--dtype takes bf16, fp16, fp32; --quant none, int4; --modes graphs, eager; "
                     "--num-seqs positive counts")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device; pass --device cpu to run on the CPU")
    try:
        KNOWN_MODELS[args.random_weights].architecture.model_config()
    except ValueError as e:
        parser.error(str(e))

    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"device: {card}; model: random weights of {args.random_weights}'s shape", flush=True)
    arch = KNOWN_MODELS[args.random_weights].architecture
    max_len = args.prompt_tokens + args.new_tokens
    rows = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        hf = hf_model(args.random_weights, dtype, args.device, args.seed)
        hf_tok_s: dict[int, float] = {}
        for quant in quants:
            loaded = fastdraft_model(args.random_weights, hf, dtype, args.device, quant)
            for n in num_seqs:
                prompts = random_prompts(n, args.prompt_tokens, arch.vocab_size, args.seed + n)
                for mode in modes:
                    llm = LLM(loaded, max_num_seqs=n, max_model_len=max_len + 16,
                              max_num_batched_tokens=max(args.max_num_batched_tokens, n), kv_cache_memory=None,
                              enforce_eager=mode == "eager")
                    run_fastdraft(llm, random_prompts(n, 16, arch.vocab_size, args.seed), 4, args.device)  # warm-up
                    seconds, tokens = run_fastdraft(llm, prompts, args.new_tokens, args.device)
                    row = {"dtype": dtype_name, "quant": quant, "mode": mode, "num_seqs": n,
                           "fastdraft_tok_s": tokens / seconds}
                    if args.profile:
                        name = f"{dtype_name}_{quant}_{mode}_{n}.txt"
                        table = args.profile_tables / name if args.profile_tables else None
                        row["profile"] = profile_decode(llm.engine, prompts, args.new_tokens, args.device, table=table)
                    del llm
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()
                    if not args.no_hf and quant == "none":
                        if n not in hf_tok_s:
                            run_hf(hf, random_prompts(n, 16, arch.vocab_size, args.seed), 4, args.device)  # warm-up
                            hf_seconds, hf_tokens = run_hf(hf, prompts, args.new_tokens, args.device)
                            hf_tok_s[n] = hf_tokens / hf_seconds
                        row["hf_eager_tok_s"] = hf_tok_s[n]
                        row["ratio"] = row["fastdraft_tok_s"] / hf_tok_s[n]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del hf
    if args.cpu_draft:
        rows.extend(cpu_draft_case(args, card))
    write_json(args.json, {"device": card, "model": args.random_weights, "prompt_tokens": args.prompt_tokens,
                           "new_tokens": args.new_tokens, "rows": rows})
    print("\n| dtype | weights | mode | sequences | fastdraft tok/s | HF eager tok/s | ratio | launches/step "
          "| step ms | host ms | GPU ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    nan = float("nan")
    for r in rows:
        p = r.get("profile", {})
        print(f"| {r['dtype']} | {r['quant']} | {r['mode']} | {r['num_seqs']} | {r['fastdraft_tok_s']:.0f} | "
              f"{r.get('hf_eager_tok_s', nan):.0f} | {r.get('ratio', nan):.2f} | "
              f"{p.get('launches_per_step', nan):.0f} | {p.get('step_ms', nan):.2f} | "
              f"{p.get('host_ms_per_step', nan):.2f} | {p.get('gpu_ms_per_step', nan):.2f} |")


def cpu_draft_case(args: argparse.Namespace, card: str) -> list[dict]:
    """Batch 1 with a random draft of ``--cpu-draft``'s shape on the CPU (adaptive draft length)
    against the target alone, each end to end through the engine; the second row's ``ratio``
    is speculative over plain."""
    arch = KNOWN_MODELS[args.random_weights].architecture
    dtype = DTYPES[args.dtype.split(",")[0]]
    hf = hf_model(args.random_weights, dtype, args.device, args.seed)
    target = fastdraft_model(args.random_weights, hf, dtype, args.device, "none")
    del hf
    draft_hf = hf_model(args.cpu_draft, dtype, "cpu", args.seed + 1)
    draft = fastdraft_model(args.cpu_draft, draft_hf, dtype, "cpu", "none")
    del draft_hf
    prompts = random_prompts(1, args.prompt_tokens, arch.vocab_size, args.seed + 1)
    config = EngineConfig(max_num_seqs=1, max_model_len=args.prompt_tokens + args.new_tokens + 16)
    rows = []
    for label, speculation in (("target alone", None),
                               (f"{args.cpu_draft} draft on the CPU",
                                speculator_factory(SpeculativeConfig(draft="assistant", num_speculative_tokens=4),
                                                   draft))):
        engine = LLMEngine(target, config, speculation=speculation)
        run_engine(engine, random_prompts(1, 16, arch.vocab_size, args.seed), 4, args.device)  # warm-up
        seconds, tokens, drafting = run_engine(engine, prompts, args.new_tokens, args.device)
        row = {"dtype": args.dtype.split(",")[0], "quant": "none", "mode": label, "num_seqs": 1,
               "fastdraft_tok_s": tokens / seconds, **drafting}
        if rows:
            row["ratio"] = row["fastdraft_tok_s"] / rows[0]["fastdraft_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
    return rows


if __name__ == "__main__":
    main()
