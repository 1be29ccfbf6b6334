"""The ``fastdraft`` command: its parser, ``pull``, ``models``, ``generate``, ``serve`` and ``info``
(``quantize`` and ``eval`` are in :mod:`fastdraft.cli.quantize`)."""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from fastdraft.cli.args import CLIError, OneLineParser, json_object, positive_int
from fastdraft.cli.quantize import add_quantize_commands, cmd_eval, cmd_quantize, quantized_model
from fastdraft.models.registry import DEFAULT_MODEL, KNOWN_MODELS
from fastdraft.process import configure_process


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="fastdraft", description="Fast LLM inference on ordinary hardware.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    pull = sub.add_parser("pull", help="make a known model ready offline")
    pull.add_argument("name", help=f"one of: {', '.join(KNOWN_MODELS)}")
    pull.add_argument("--force", action="store_true", help="convert again even if cached")

    sub.add_parser("models", help="list the known model names")
    sub.add_parser("info", help="what to paste into a bug report: CPU, kernels, threads, versions")

    gen = sub.add_parser("generate", help="stream a completion and print latency figures")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="known name, HF folder or .gguf path")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=positive_int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--enforce-eager", action="store_true", help="on a GPU, no CUDA graphs: every step eagerly")
    gen.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: all cores)")
    gen.add_argument("--max-seq-len", type=positive_int, default=4096)
    gen.add_argument("--speculative", metavar="self|ngram|MODEL", default=None,
                     help="speculative decoding: the target's own INT4 copy, prompt lookup, or a draft model")
    gen.add_argument("--num-speculative-tokens", type=positive_int, default=4)
    gen.add_argument("--draft-device", default=None, help="device of the draft (e.g. cpu beside a cuda target)")
    gen.add_argument("--no-adaptive", action="store_true", help="always draft --num-speculative-tokens tokens")
    gen.add_argument("--draft-min-confidence", type=float, default=None,
                     help="a draft token counts as confident when the draft's top probability reaches this; "
                          "a sequence stops a step's drafting after an unconfident one "
                          "(default: SpeculativeConfig's, 0.5; 0: off)")
    gen.add_argument("--load-in-low-bit", choices=["sym_int4", "asym_int4", "int8", "bf16", "fp32"], default=None,
                     help="bf16/fp32: the dequantized reference; sym_int4/asym_int4/int8: the reference "
                          "quantized on the fly (RTN). Default: a GGUF model runs on its file's own blocks")
    gen.add_argument("--chat-template", default=None, metavar="FILE",
                     help="a Jinja chat template file for --chat (replacing the model's own)")
    gen.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                     help="the chat template's own variables for --chat, e.g. '{\"enable_thinking\": false}'")
    gen.add_argument("--keep-gguf-quant", action="store_true",
                     help="run on the quantized blocks of the model's GGUF file (a known name or a .gguf path), "
                          "the default on a CPU; an error for a model without one")

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming)")
    srv.add_argument("--model", default=DEFAULT_MODEL, help="known name, HF folder or .gguf path")
    weights = srv.add_mutually_exclusive_group()
    weights.add_argument("--quant", default=None, help="quantize first: key=value,... or a JSON file "
                         "(method=gguf keeps a GGUF file's own blocks)")
    weights.add_argument("--load-in-low-bit", choices=["sym_int4", "asym_int4", "int8", "bf16", "fp32"],
                         default=None, help="bf16/fp32: the dequantized reference; sym_int4/asym_int4/int8: the "
                         "reference quantized on the fly (RTN). Default: a GGUF model runs on its file's own blocks")
    srv.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local clients only)")
    srv.add_argument("--port", type=_port, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route")
    srv.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    srv.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: all cores)")
    srv.add_argument("--max-model-len", type=positive_int, default=4096)
    srv.add_argument("--max-num-seqs", type=positive_int, default=64)
    srv.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    srv.add_argument("--max-queue", type=positive_int, default=256,
                     help="waiting requests beyond which new ones get 429 (default 256)")
    srv.add_argument("--kv-cache-memory", type=float, default=None, metavar="GiB",
                     help="KV-cache pool size (default: a quarter of the available memory)")
    srv.add_argument("--no-enable-prefix-caching", action="store_true", help="turn prefix caching off")
    srv.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template file")
    srv.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                     help="the model's tool-call format (default: the one its chat template writes)")
    srv.add_argument("--speculative", metavar="self|ngram|MODEL", default=None,
                     help="speculative decoding inside the engine's batches: the target's own INT4 copy, prompt "
                          "lookup, or a draft model of the same tokenizer")
    srv.add_argument("--num-speculative-tokens", type=positive_int, default=4,
                     help="the most tokens a request drafts in a step (default 4)")
    srv.add_argument("--engine-process", action="store_true",
                     help="step the engine in a child process instead of a thread (see docs/server.md)")
    srv.add_argument("--graceful-timeout", type=float, default=30.0,
                     help="seconds SIGTERM waits for running requests before exiting (default 30)")
    srv.add_argument("--backend", choices=["local", "ray"], default="local",
                     help="one engine in this process (local), or engine replicas on Ray Serve (ray)")
    srv.add_argument("--replicas", type=positive_int, default=1, help="Ray: engine replicas (default 1)")
    srv.add_argument("--address", default=None,
                     help="Ray: the cluster to join ('auto': the local one running); default: start one")
    srv.add_argument("--num-cpus-per-replica", type=positive_int, default=1,
                     help="Ray: CPUs (and torch threads) each replica takes (default 1)")
    srv.add_argument("--autoscaling-config", default=None, metavar="FILE",
                     help="Ray: a JSON file of Ray Serve's autoscaling_config (min_replicas, max_replicas, "
                          "target_ongoing_requests, ...), replacing --replicas")
    srv.add_argument("--router", choices=["pow2", "round-robin", "prefix"], default="pow2",
                     help="Ray: how a request picks its replica (prefix: where its prompt is likely cached)")
    srv.add_argument("--stream-interval", type=positive_int, default=1,
                     help="Ray: engine steps a replica gathers before sending a request's tokens on; the first "
                          "and last go at once (default 1)")

    add_quantize_commands(sub)
    return parser


def _cmd_pull(args: argparse.Namespace) -> None:
    from fastdraft.models.registry import pull

    path = pull(args.name, force=args.force)
    print(path)


def _cmd_generate(args: argparse.Namespace) -> None:
    from fastdraft.engine.llm_engine import EngineConfig
    from fastdraft.engine.loader import describe_weights, load_model
    from fastdraft.generator import TextGenerator, encode_prompt
    from fastdraft.sampling_params import SamplingParams
    from fastdraft.speculative.speculative_config import SpeculativeConfig

    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)

    spec = None
    if args.speculative:
        extra = {} if args.draft_min_confidence is None else {"min_confidence": args.draft_min_confidence}
        spec = SpeculativeConfig(draft=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                                 draft_device=args.draft_device, is_adaptive=not args.no_adaptive, **extra)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device, load_in_low_bit=args.load_in_low_bit,
                        keep_gguf_quant=True if args.keep_gguf_quant else None)
    if args.chat_template:
        loaded.tokenizer.set_chat_template(read_chat_template(args.chat_template))
    # The KV pool holds this request (its prompt and new tokens), not --max-seq-len tokens.
    if args.chat_template_kwargs is not None and not args.chat:
        raise CLIError("--chat-template-kwargs needs --chat")
    prompt_ids = encode_prompt(loaded.tokenizer, args.prompt, chat=args.chat,
                               chat_template_kwargs=args.chat_template_kwargs)
    config = EngineConfig(max_num_seqs=1, max_model_len=min(args.max_seq_len, len(prompt_ids) + args.max_tokens),
                          enforce_eager=args.enforce_eager)
    generator = TextGenerator(loaded, speculative=spec, engine_config=config)
    stream = generator.stream(prompt_ids, params)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    m = stream.metrics
    print(f"[{m.num_generated_tokens} tokens | TTFT {m.ttft_s * 1e3:.0f} ms | "
          f"TPOT {m.tpot_s * 1e3:.1f} ms | {m.decode_tokens_per_s:.2f} tokens/s | "
          f"prompt {m.num_prompt_tokens} tokens]", file=sys.stderr)
    if m.spec is not None:
        print(f"[speculative: {m.spec.summary()}]", file=sys.stderr)
    print(f"[weights: {describe_weights(loaded.model)}]", file=sys.stderr)


def read_chat_template(path: str) -> str:
    """The Jinja template in file ``path``; ``ValueError`` where it cannot be read."""
    from pathlib import Path

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the chat template {path}: {exc}") from None


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def _serving_engine(model: str, dtype: str, quant, load_in_low_bit: str | None, engine_config, speculative=None):
    """The server's engine: the model loaded (and quantized), and speculating as
    ``speculative`` (a ``SpeculativeConfig``) says, as ``fastdraft serve`` was told."""
    from fastdraft.engine.llm_engine import LLMEngine
    from fastdraft.engine.loader import load_model
    from fastdraft.speculative.factory import speculator_factory

    if quant is not None:
        loaded = quantized_model(model, quant, dtype)
    else:
        loaded = load_model(model, dtype=dtype, load_in_low_bit=load_in_low_bit)
    engine = LLMEngine(loaded, engine_config,
                       speculation=None if speculative is None else speculator_factory(speculative))
    engine.structured.prepare()  # a server expects constrained requests: be ready for the first
    return engine


def _cmd_serve(args: argparse.Namespace) -> None:
    from pathlib import Path

    from fastdraft.engine.llm_engine import EngineConfig
    from fastdraft.quant.quant_config import parse_quant_spec
    from fastdraft.server.app import ServerConfig, build_fastapi_app, serve

    quant = parse_quant_spec(args.quant) if args.quant else None  # bad specs fail before the server starts
    engine_config = EngineConfig(kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                                 enable_prefix_caching=not args.no_enable_prefix_caching)
    template = read_chat_template(args.chat_template) if args.chat_template else None
    config = ServerConfig(served_model_name=args.served_model_name or args.model, api_key=args.api_key,
                          max_queue=args.max_queue, chat_template=template, engine_process=args.engine_process,
                          tool_call_parser=args.tool_call_parser)
    # A partial of a module-level function: picklable, for an engine in its own process.
    speculation = None
    if args.speculative:
        from fastdraft.speculative.speculative_config import SpeculativeConfig

        speculation = SpeculativeConfig(draft=args.speculative, num_speculative_tokens=args.num_speculative_tokens)
    load_engine = functools.partial(_serving_engine, args.model, args.dtype, quant, args.load_in_low_bit,
                                    engine_config, speculation)
    if args.backend == "ray":
        _serve_on_ray(args, load_engine, config)
        return
    serve(build_fastapi_app(load_engine, config), args.host, args.port, args.graceful_timeout,
          log_level="info" if args.verbose else "warning")


def _serve_on_ray(args: argparse.Namespace, load_engine, config) -> None:
    """``fastdraft serve --backend ray``: start (or join) a Ray cluster, run the replicas and
    the ingress on it, and serve until SIGTERM or SIGINT, which drain open streams."""
    import json
    from pathlib import Path

    from fastdraft.server.ray_app import RayServeConfig, run_on_ray

    autoscaling = None
    if args.autoscaling_config:
        try:
            autoscaling = json.loads(Path(args.autoscaling_config).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--autoscaling-config {args.autoscaling_config}: {e}") from None
    ray_config = RayServeConfig(num_replicas=args.replicas, num_cpus_per_replica=args.num_cpus_per_replica,
                                max_ongoing_requests=args.max_num_seqs, autoscaling=autoscaling,
                                graceful_shutdown_timeout_s=args.graceful_timeout,
                                stream_interval=args.stream_interval, router=args.router)
    run_on_ray(load_engine, config, ray_config, args.host, args.port, args.address)


# The instruction-set extensions that decide which kernels a CPU runs, in the order printed.
_ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq",
              "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def _info() -> str:
    """CPU, kernels, threads and versions, one fact a line."""
    import os
    import platform

    import torch

    from fastdraft import __version__
    from fastdraft.fileio import fastdraft_home
    from fastdraft.kernels.build import (ISA_ENV, cache_dir, cpu_features, cpu_flags, cpu_model, is_built,
                                         runnable_isas, select_isa, unavailable_reason)

    flags = cpu_flags()
    reason = unavailable_reason()
    runs = "-"
    if reason is not None:
        kernels = f"PyTorch fallback ({reason})"
    else:
        # CPUID and XGETBV once the driver is built; until then /proc/cpuinfo, which names the
        # features alike, so that this command compiles nothing.
        features = cpu_features() if is_built() else {flag: True for flag in flags}
        runs = ", ".join(runnable_isas(features))
        try:
            name = select_isa(features)
            how = ISA_ENV if os.environ.get(ISA_ENV) else "the best this CPU runs"
            state = "built" if is_built() else "compiled on first use (about a minute)"
            kernels = f"{name} ({how}; {state})"
        except ValueError as exc:
            kernels = f"none: {exc}"
    return "\n".join([
        f"fastdraft {__version__}, Python {platform.python_version()}, torch {torch.__version__}",
        f"CPU: {cpu_model()} ({platform.machine()}, {os.cpu_count()} logical cores)",
        f"CPU flags: {' '.join(f for f in _ISA_FLAGS if f in flags) or '(none of the x86 extensions fastdraft uses)'}",
        f"kernel variants this CPU runs: {runs}",
        f"kernels: {kernels}",
        f"threads: {torch.get_num_threads()}",
        f"kernel cache: {cache_dir()}",
        f"FASTDRAFT_HOME: {fastdraft_home()}",
        "weights: a model from a GGUF file (a known name, a .gguf path) runs on the file's own blocks on the CPU; "
        "--load-in-low-bit bf16 runs the dequantized reference",
    ])


# Commands that run a model, and so get fastdraft's process-wide settings (fastdraft/process.py).
_MODEL_COMMANDS = frozenset({"generate", "serve", "quantize", "eval"})


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        if args.command in _MODEL_COMMANDS:  # the library leaves malloc and threads to its entry points
            configure_process(num_threads=getattr(args, "threads", None))
            # An unknown FASTDRAFT_ISA stops here, before any model loads (one the CPU cannot run,
            # when the kernels load).
            from fastdraft.kernels.build import requested_isa
            requested_isa()
        if args.command == "pull":
            _cmd_pull(args)
        elif args.command == "info":
            print(_info())
        elif args.command == "models":
            for name, source in KNOWN_MODELS.items():
                print(f"{name}\t{source.description}")
        elif args.command == "generate":
            _cmd_generate(args)
        elif args.command == "serve":
            _cmd_serve(args)
        elif args.command == "quantize":
            cmd_quantize(args)
        elif args.command == "eval":
            cmd_eval(args)
        return 0
    except (CLIError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"fastdraft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastdraft: interrupted", file=sys.stderr)
        return 130

