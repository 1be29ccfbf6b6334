"""Batch-1 greedy latency: fastdraft vs HF transformers vs llama.cpp, on the same prompt ids.

llama.cpp runs through its Python bindings when ``llama_cpp`` imports, and through its own
``llama-bench`` binary with ``--llama-bench PATH`` (and ik_llama.cpp's with ``--ik-llama-bench``;
prefill of the same number of tokens, then
decode at that depth, in the same interleaved rounds; its figures are throughputs, so it has
no token stream to compare).

The prompt is the first ``--prompt-tokens`` tokens of the running interpreter's ``os.py``
(tokenized with the model's own tokenizer); every system gets exactly those ids and produces
exactly ``--new-tokens`` tokens (EOS ignored). For each system we report prefill tokens/s,
TTFT, the median next-token latency, decode tokens/s, the weight bytes read per decode step,
the bandwidth that implies, and that as a fraction of the memory read bandwidth measured by
torch in the same run (decode at batch 1 is memory-bound, so this is the roofline fraction);
the last column adds the KV cache each step also reads (at the run's mean context).

    python benchmarks/bench_latency.py --model qwen2.5-coder-0.5b-instruct --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
from fastdraft.engine.loader import load_model
from fastdraft.fileio import write_json
from fastdraft.model_config import ModelConfig
from fastdraft.kernels.memory import huge_page_copy
from fastdraft.models.files import LoadedModel, parse_dtype, resolve_model_dir
from fastdraft.models.registry import KNOWN_MODELS, original_gguf
from fastdraft.process import configure_process
from fastdraft.sampling_params import SamplingParams
from fastdraft.tokenizer import Tokenizer

DEFAULT_MODELS = ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
TokenStream = Callable[[list[int], int], Iterator[int]]  # (prompt ids, new tokens) -> token ids


def measure_bandwidth(gib: float = 1.0, repeats: int = 10) -> float:
    """Memory read bandwidth in bytes/s over a ``gib`` GiB buffer (far beyond any cache).

    Two read kernels (fp32 ``sum`` and uint8 ``amax``), each over plain memory and over memory
    on transparent huge pages (where fastdraft keeps its INT4 weights), each the median of
    ``repeats`` passes; the fastest is reported, so fractions of it are conservative."""
    plain = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)  # ones(): pages really allocated
    best = 0.0
    for x in (plain, huge_page_copy(plain)):
        for read in (lambda: x.sum(), lambda: x.view(torch.uint8).amax()):
            read()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                read()
                times.append(time.perf_counter() - t0)
            best = max(best, x.numel() * 4 / statistics.median(times))
    return best


def weight_bytes_per_token(model: torch.nn.Module, embed: torch.Tensor, lm_head: torch.Tensor) -> int:
    """Bytes of parameters one decode step reads: all of them, except that the embedding table
    is only indexed (one row) -- unless it is also the LM head, which reads it in full."""
    unique = {p.data_ptr(): p for p in model.parameters()}  # tied weights count once
    return sum(p.numel() * p.element_size() for p in unique.values()
               if p.data_ptr() != embed.data_ptr() or embed.data_ptr() == lm_head.data_ptr())


@dataclass
class System:
    """One system under test: its token stream and the weight bytes one decode step reads.
    ``measure``, when set, times a round itself instead (a peer's own benchmark binary)."""

    stream: TokenStream | None
    weight_bytes: int
    extra: dict = field(default_factory=dict)
    close: Callable[[], None] = lambda: None
    measure: Callable[[list[int], int], dict] | None = None


def one_run(stream: TokenStream, prompt_ids: list[int], new_tokens: int) -> dict:
    tokens, latencies = [], []
    last = time.perf_counter()
    for token in stream(prompt_ids, new_tokens):
        now = time.perf_counter()
        latencies.append(now - last)
        last = now
        tokens.append(token)
    assert len(tokens) == new_tokens, f"got {len(tokens)} tokens, expected {new_tokens}"
    ttft, decode = latencies[0], latencies[1:]
    return {"ttft_s": ttft, "token_latency_s": statistics.median(decode),
            "p90_token_latency_s": statistics.quantiles(decode, n=10)[-1],
            "decode_tok_s": len(decode) / sum(decode), "tokens": tokens}


def run_interleaved(systems: dict[str, System], prompt_ids: list[int], args: argparse.Namespace) -> dict:
    """``args.repeats`` rounds; each round runs every system once, between two measurements of
    the memory bandwidth, so each system is compared with the bandwidth of its own moment (a
    shared VM's bandwidth can swing by 2x within minutes). Medians over rounds."""
    for system in systems.values():  # warm-up: first-call allocations, kernel builds, fusion
        if system.measure is None:
            for _ in system.stream(prompt_ids[:32], 4):
                pass
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, system in systems.items():
            bandwidth = measure_bandwidth(gib=0.5, repeats=5)
            run = (system.measure(prompt_ids, args.new_tokens) if system.measure is not None
                   else one_run(system.stream, prompt_ids, args.new_tokens))
            # A second probe right after: the memory state can switch every ~10 s, so a round
            # whose two probes differ may have run in either state (or both).
            run.update(bandwidth=bandwidth, bandwidth_after=measure_bandwidth(gib=0.5, repeats=5))
            runs[name].append(run)
            print(f"  {name}: {run['token_latency_s'] * 1e3:.1f} ms/token, probes {bandwidth / 1e9:.1f} "
                  f"before and {run['bandwidth_after'] / 1e9:.1f} GB/s after", flush=True)
    results = {}
    for name, system in systems.items():
        rs = runs[name]
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("ttft_s", "token_latency_s", "decode_tok_s", "bandwidth")}
        results[name] = {**med, "prefill_tok_s": len(prompt_ids) / med["ttft_s"], "tokens": rs[0]["tokens"],
                         "weight_bytes": system.weight_bytes, **system.extra,
                         "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rs]}
    return results


def setup_fastdraft(name: str, dtype: str, quant: str | None = None, context_len: int = 2048) -> System:
    from fastdraft.quant.quant_config import parse_quant_spec

    config = None if quant is None else parse_quant_spec(quant)
    # method=gguf: the GGUF file's own blocks, the weights llama.cpp runs.
    lm = load_model(name, dtype=dtype, keep_gguf_quant=config is not None and config.is_gguf_native)
    model = lm.model
    if config is not None and not config.is_gguf_native:  # RTN: speed does not depend on the method
        from fastdraft.quant.quantizer import quantize_model

        quantize_model(model, config, show_progress=False)
    return engine_system(lm, context_len)


def engine_system(lm: LoadedModel, context_len: int) -> System:
    """What a user's request runs: the engine, one sequence; no prefix cache, as every system
    here prefills the same prompt afresh each round. A model without a tokenizer (random
    weights) streams token ids only."""
    engine = LLMEngine(lm, EngineConfig(max_num_seqs=1, max_model_len=context_len, enable_prefix_caching=False))
    params = {"ignore_eos": True, "detokenize": lm.tokenizer is not None}

    def stream(ids: list[int], n: int) -> Iterator[int]:
        request_id = engine.add_request(ids, SamplingParams(max_new_tokens=n, **params))
        for delta in engine.outputs(request_id):
            yield from delta.new_token_ids

    return System(stream, lm.model.decode_weight_bytes())


def setup_transformers(model_dir: Path, dtype: str) -> System:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=parse_dtype(dtype)).eval()

    @torch.inference_mode()
    def stream(ids: list[int], n: int) -> Iterator[int]:
        # Manual loop over the HF cache: prefill (last-row logits only, as generate() does),
        # then one forward per token. Greedy = argmax.
        out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        for step in range(n):
            token = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            yield int(token)
            if step < n - 1:
                out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)

    return System(stream, weight_bytes_per_token(model, model.get_input_embeddings().weight,
                                                 model.get_output_embeddings().weight))


def gguf_bytes_per_token(path: Path) -> int:
    """Tensor bytes of the GGUF minus the token embedding (unless it doubles as the output head)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return sum(sizes.values())


def context_len(args: argparse.Namespace) -> int:
    """The context every system is set up with: the prompt and the new tokens (2048 at least)."""
    return max(2048, args.prompt_tokens + args.new_tokens)


def setup_llama_cpp(name: str, args: argparse.Namespace) -> System:
    from llama_cpp import Llama

    path = original_gguf(name)
    llm = Llama(str(path), n_ctx=context_len(args), n_batch=512, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)

    def stream(ids: list[int], n: int) -> Iterator[int]:
        llm.reset()
        llm.eval(ids)
        for step in range(n):
            token = llm.sample(temp=0.0, repeat_penalty=1.0)  # temp 0 = greedy sampler
            yield token
            if step < n - 1:
                llm.eval([token])

    return System(stream, gguf_bytes_per_token(path), {"gguf": str(path)}, llm.close)


def setup_llama_bench(name: str, binary: Path, threads: int, is_ik: bool = False) -> System:
    """llama.cpp's ``llama-bench`` on the model's original GGUF: per round, one prefill of the
    prompt's length (pp) and one decode of the new tokens at that depth (tg), one repetition
    each, as llama-bench's own JSON reports them (it warms up before each test). ``is_ik``:
    ik_llama.cpp's llama-bench, which has no ``-d``; its ``-gp pp,tg`` times the tg tokens
    after a pp-token prompt."""
    path = original_gguf(name)

    def tokens_per_s(num_prompt: int, num_gen: int, depth: int) -> float:
        shape = ["-p", str(num_prompt), "-n", str(num_gen), "-d", str(depth)]
        if is_ik:
            shape = ["-p", str(num_prompt), "-n", "0"] if depth == 0 else \
                ["-p", "0", "-n", "0", "-gp", f"{depth},{num_gen}"]
        out = subprocess.run([str(binary), "-m", str(path), "-t", str(threads), *shape, "-r", "1", "-o", "json"],
                             capture_output=True, text=True, check=True).stdout
        return float(json.loads(out)[-1]["avg_ts"])

    def measure(prompt_ids: list[int], new_tokens: int) -> dict:
        prefill = tokens_per_s(len(prompt_ids), 0, 0)
        decode = tokens_per_s(0, new_tokens, len(prompt_ids))
        return {"ttft_s": len(prompt_ids) / prefill, "token_latency_s": 1 / decode, "p90_token_latency_s": 1 / decode,
                "decode_tok_s": decode, "tokens": []}

    return System(None, gguf_bytes_per_token(path), {"gguf": str(path), "binary": str(binary)}, measure=measure)


def agreement(a: list[int], b: list[int]) -> float:
    """Fraction of tokens identical from the start up to the first divergence."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(len(a), 1)


def kv_bytes_per_token(config: ModelConfig, num_prompt: int, num_new: int) -> int:
    """KV cache bytes a decode step reads at the run's mean context (16-bit keys and values,
    as both fastdraft's bf16 cache and llama.cpp's default f16 cache store them); a layer with
    a sliding window reads only its window."""
    from fastdraft.models.plan import decoder_plan

    mean_context = num_prompt + num_new / 2
    per_layer = config.kv_bytes_per_token(2) / config.num_hidden_layers
    windows = [layer.attention.sliding_window for layer in decoder_plan(config).layers]
    return round(sum(per_layer * (mean_context if w is None else min(w, mean_context)) for w in windows))


def _median_fraction(result: dict, bytes_per_token: int) -> float:
    """Median over rounds of (bytes per token / token latency) / the round's bandwidth probe."""
    return statistics.median(bytes_per_token / run["token_latency_s"] / run["bandwidth"] for run in result["runs"])


STABLE_PROBES = 0.15  # a round's probes before and after within 15%: one memory state throughout
# Default line between a VM's two memory states (--state-split-gbs): on the AMD EPYC Zen 4 VMs
# the slow state probes at 29-37 GB/s and the fast one at 50-69; on Zen 5 at 37-52 and 66-85.
FAST_STATE_GB_S = 45.0


def _positive_gb_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def add_state_split_argument(parser: argparse.ArgumentParser) -> None:
    """``--state-split-gbs``: the probe above which a timed run counts as the fast memory state
    (shared by bench_latency.py and bench_spec.py)."""
    parser.add_argument("--state-split-gbs", type=_positive_gb_s, default=FAST_STATE_GB_S,
                        help="probe (GB/s) above which a run counts as the fast memory state "
                             f"(default {FAST_STATE_GB_S:g}, which splits the two memory states of the "
                             "AMD EPYC Zen 4 VMs; use 60 on Zen 5)")


def memory_state(before: float, after: float, split_gb_s: float = FAST_STATE_GB_S) -> str | None:
    """"slow" or "fast": the memory state through a timed run, from the probes (bytes/s)
    taken just before and just after it, split at ``split_gb_s``; ``None`` when they disagree
    (a switch in between)."""
    if abs(after / before - 1) > STABLE_PROBES:
        return None
    return "fast" if (before + after) / 2 / 1e9 >= split_gb_s else "slow"


def stable_round_fractions(result: dict, bytes_per_token: int, split_gb_s: float) -> dict[str, list[float]]:
    """Per memory state ("slow", "fast"), each state-stable round's rate over the mean of its
    two probes: the rounds the probe before cannot have misjudged."""
    fractions: dict[str, list[float]] = {"slow": [], "fast": []}
    for run in result["runs"]:
        before, after = run["bandwidth"], run["bandwidth_after"]
        state = memory_state(before, after, split_gb_s)
        if state is not None:
            fractions[state].append(bytes_per_token / run["token_latency_s"] / ((before + after) / 2))
    return fractions


def print_table(name: str, results: dict, num_prompt: int, kv_bytes: int, split_gb_s: float) -> None:
    print(f"\n### {name}  (prompt {num_prompt} tok)\n")
    print("| system | prefill tok/s | TTFT ms | decode ms/token (median) | decode tok/s "
          "| weight MB/token | achieved GB/s | measured BW GB/s | % of measured BW | with KV reads |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for system, r in results.items():
        if isinstance(r, str):
            print(f"| {system} | {r} | | | | | | | | |")
            continue
        gbs = r["weight_bytes"] / r["token_latency_s"]
        r["achieved_gb_s"] = gbs / 1e9
        # Each round's rate against the probe taken just before it, then the median: the
        # medians of latency and of bandwidth can come from rounds in different memory states.
        r["bandwidth_fraction"] = _median_fraction(r, r["weight_bytes"])
        # Every step also reads the whole KV cache: counted here, the weights' figure unchanged.
        r["kv_bytes"] = kv_bytes
        r["bandwidth_fraction_with_kv"] = _median_fraction(r, r["weight_bytes"] + kv_bytes)
        print(f"| {system} | {r['prefill_tok_s']:.1f} | {r['ttft_s'] * 1e3:.0f} | "
              f"{r['token_latency_s'] * 1e3:.1f} | {r['decode_tok_s']:.2f} | {r['weight_bytes'] / 1e6:.0f} | "
              f"{gbs / 1e9:.1f} | {r['bandwidth'] / 1e9:.1f} | {100 * r['bandwidth_fraction']:.0f}% | "
              f"{100 * r['bandwidth_fraction_with_kv']:.0f}% (+{kv_bytes / 1e6:.0f} MB) |")
    print("\n(% of measured BW: median over rounds of the round's rate / the probe just before it)\n")
    for system, r in results.items():
        if not isinstance(r, dict):
            continue
        r["stable_round_fractions"] = stable = stable_round_fractions(r, r["weight_bytes"], split_gb_s)
        parts = [f"{state} {len(f)} (median {100 * statistics.median(f):.0f}%)" if f else f"{state} 0"
                 for state, f in stable.items()]
        print(f"{system}: rounds whose probes before and after agree within {100 * STABLE_PROBES:.0f}%, "
              f"by state: {', '.join(parts)} of {len(r['runs'])}")
    print()
    ours = [s for s in results if s.startswith("fastdraft") and isinstance(results[s], dict)]
    for system in ours:
        for other in ("transformers", "llama.cpp", "llama-bench", "ik_llama.cpp", "fastdraft"):
            if other != system and isinstance(results.get(other), dict):
                a, b = results[system], results[other]
                print(f"{system} vs {other}: decode {b['token_latency_s'] / a['token_latency_s']:.2f}x "
                      f"(median latency ratio), {a['decode_tok_s'] / b['decode_tok_s']:.2f}x tokens/s, "
                      f"prefill {a['prefill_tok_s'] / b['prefill_tok_s']:.2f}x")
                paired = [rb["token_latency_s"] / ra["token_latency_s"] for ra, rb in zip(a["runs"], b["runs"])]
                print(f"  decode ratio round by round: {' '.join(f'{x:.2f}' for x in paired)} "
                      f"(median {statistics.median(paired):.2f}x)")


# Real models' shapes for --random-weights (their HF config.json fields that set the speed).
RANDOM_CONFIGS = {
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def random_config(spec: str) -> ModelConfig:
    """A preset of :data:`RANDOM_CONFIGS` or the path of an HF ``config.json``."""
    if spec in RANDOM_CONFIGS:
        return ModelConfig.from_dict(RANDOM_CONFIGS[spec])
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(f"--random-weights {spec!r}: neither a preset ({', '.join(RANDOM_CONFIGS)}) nor a config.json")
    return ModelConfig.from_file(path)


def setup_random(config: ModelConfig, dtype: str, quant: str, context_len: int) -> System:
    """fastdraft on random weights of ``config``'s shape (drawn by transformers' own init),
    quantized as ``quant`` says; a model without files runs on token ids."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastdraft.models.files import build_model
    from fastdraft.quant.quant_config import parse_quant_spec
    from fastdraft.quant.quantizer import quantize_model

    fields = {k: v for k, v in config.to_hf_dict().items() if k not in ("model_type", "architectures")}
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.model_type, **fields), dtype=torch.bfloat16)
    model = build_model(config, {k: v.detach() for k, v in hf.state_dict().items()}, parse_dtype(dtype))
    del hf
    spec = parse_quant_spec(quant)
    if spec.is_gguf_native:
        raise SystemExit("--random-weights has no GGUF file: pass an RTN --quant spec")
    quantize_model(model, spec, show_progress=False)
    return engine_system(LoadedModel(model=model, tokenizer=None, config=config, model_dir=None), context_len)


def bench_random(spec: str, args: argparse.Namespace) -> dict:
    """Batch-1 decode and prefill of fastdraft on random weights of a config's shape, for each
    RTN ``--quant``: the share of measured bandwidth it reaches, to set beside a real model's."""
    config = random_config(spec)
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(1000, config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
    systems: dict[str, System] = {}
    for quant in args.quant:
        if "gguf" in quant:
            continue
        from fastdraft.quant.quant_config import parse_quant_spec

        name = f"fastdraft {parse_quant_spec(quant).label}"
        print(f"[random {spec}] building {name} ...", flush=True)
        systems[name] = setup_random(config, args.dtype, quant, context_len(args))
    results = run_interleaved(systems, prompt_ids, args)
    for system in systems.values():
        system.close()
    systems.clear()
    gc.collect()
    print_table(f"random weights of {spec}", results, len(prompt_ids),
                kv_bytes_per_token(config, len(prompt_ids), args.new_tokens), args.state_split_gbs)
    return {"random_config": spec, "systems": results}


def bench_model(name: str, args: argparse.Namespace) -> dict:
    model_dir = resolve_model_dir(name)  # pulls a known model on first use
    text = Path(os.__file__).read_text(encoding="utf-8")
    prompt_ids = Tokenizer(model_dir).encode(text, add_special_tokens=False)[:args.prompt_tokens]
    if len(prompt_ids) != args.prompt_tokens:
        raise SystemExit(f"{os.__file__} has only {len(prompt_ids)} tokens")
    setups: dict[str, Callable[[], System]] = {}
    if not args.no_dense:
        setups["fastdraft"] = lambda: setup_fastdraft(name, args.dtype, context_len=context_len(args))
    for spec in args.quant:
        from fastdraft.quant.quant_config import parse_quant_spec

        setups[f"fastdraft {parse_quant_spec(spec).label}"] = lambda spec=spec: setup_fastdraft(name, args.dtype, spec, context_len(args))
    if not args.no_hf:
        setups["transformers"] = lambda: setup_transformers(model_dir, args.dtype)
    if not args.no_llama_cpp:
        try:
            import llama_cpp  # noqa: F401
            setups["llama.cpp"] = lambda: setup_llama_cpp(name, args)
        except ImportError as exc:  # absent, or installed without its own dependencies
            print(f"llama_cpp is not importable ({exc}): skipping llama.cpp's bindings")
        if args.llama_bench is not None:
            setups["llama-bench"] = lambda: setup_llama_bench(name, args.llama_bench, args.threads)
        if args.ik_llama_bench is not None:
            setups["ik_llama.cpp"] = lambda: setup_llama_bench(name, args.ik_llama_bench, args.threads, is_ik=True)
    results: dict[str, dict | str] = {}
    systems: dict[str, System] = {}
    for system, setup in setups.items():
        print(f"[{name}] loading {system} ...", flush=True)
        try:
            systems[system] = setup()
        except Exception as exc:  # one failing system must not lose the others' figures
            results[system] = f"failed: {type(exc).__name__}: {exc}"
    results.update(run_interleaved(systems, prompt_ids, args))
    for system in systems.values():
        system.close()
    systems.clear()
    gc.collect()
    kv_bytes = kv_bytes_per_token(ModelConfig.from_file(model_dir / "config.json"), len(prompt_ids), args.new_tokens)
    print_table(name, results, len(prompt_ids), kv_bytes, args.state_split_gbs)
    record = {"prompt_source": os.__file__,
              "prompt_ids": prompt_ids, "systems": results}
    ours, hf = results.get("fastdraft"), results.get("transformers")
    if isinstance(ours, dict) and isinstance(hf, dict):
        record["greedy_agreement_fastdraft_vs_transformers"] = agree = agreement(ours["tokens"], hf["tokens"])
        print(f"greedy agreement fastdraft vs transformers: {agree:.3f} "
              f"({round(agree * len(ours['tokens']))}/{len(ours['tokens'])} tokens before first divergence)")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", choices=list(KNOWN_MODELS),
                        help="known model name (repeatable; default: both Qwen2.5-Coder models, unless "
                             "--random-weights is given)")
    parser.add_argument("--random-weights", action="append", default=[], metavar="CONFIG",
                        help=f"also run fastdraft on random weights of a model's shape: a preset "
                             f"({', '.join(RANDOM_CONFIGS)}) or an HF config.json path (repeatable); "
                             "each RTN --quant spec runs, after the --model runs")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds; each runs every system once, interleaved; medians are reported")
    parser.add_argument("--quant", action="append", default=None,
                        help="also run fastdraft quantized with this spec (repeatable; default: "
                             "method=gguf, the GGUF file's own blocks, and method=rtn,group_size=128,"
                             "lm_head_bits=6; pass 'none' to skip)")
    parser.add_argument("--no-dense", action="store_true", help="skip fastdraft unquantized")
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    parser.add_argument("--llama-bench", type=Path, default=None,
                        help="path of a llama-bench binary: also run llama.cpp's own benchmark on the GGUF")
    parser.add_argument("--ik-llama-bench", type=Path, default=None,
                        help="path of ik_llama.cpp's llama-bench binary: also run that fork on the GGUF")
    add_state_split_argument(parser)
    parser.add_argument("--json", type=Path, default=Path("bench_results/latency.json"))
    args = parser.parse_args()
    if args.new_tokens < 2 or args.prompt_tokens < 32 or args.repeats < 1:
        parser.error("need --new-tokens >= 2, --prompt-tokens >= 32 and --repeats >= 1")
    # The GGUF's own blocks compare with llama.cpp at equal quality. RTN INT4 g128 with an INT6
    # head (as Q4_K_M keeps its output at Q6_K) is faster and loses 15.7% perplexity on the 1.5B.
    args.quant = [q for q in (args.quant or ["method=gguf", "method=rtn,group_size=128,lm_head_bits=6"])
                  if q != "none"]
    configure_process(num_threads=args.threads)  # every system in this process gets the tuned malloc
    load = os.getloadavg()[0]
    if load > 0.5:  # timings are only meaningful on an otherwise idle machine
        print(f"warning: 1-minute load average is {load:.1f} before the run; timings will be noisy")

    from fastdraft.kernels.build import cpu_model, load_cpu_kernels

    kernels = load_cpu_kernels()
    isa = kernels.name if kernels is not None else "none (PyTorch's kernels)"
    print(f"CPU: {cpu_model()}; fastdraft's kernels: {isa}; {args.threads} threads")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report = {"config": config, "torch": torch.__version__, "cpu": cpu_model(), "isa": isa,
              "load_avg_before": load, "models": {}}
    for name in args.model or ([] if args.random_weights else DEFAULT_MODELS):
        report["models"][name] = bench_model(name, args)
        gc.collect()
        write_json(args.json, report)  # after each model, so a later crash keeps earlier results
    for spec in args.random_weights:
        report["models"][f"random:{spec}"] = bench_random(spec, args)
        gc.collect()
        write_json(args.json, report)
    print(f"\nresults written to {args.json}")


if __name__ == "__main__":
    main()
