"""Command-line interface: ``fastdraft pull``, ``models``, ``generate``, ``serve``, ``quantize``, ``eval`` and ``info``."""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from fastdraft.models.registry import DEFAULT_MODEL, KNOWN_MODELS
from fastdraft.process import configure_process


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not a usage dump
        raise CLIError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="fastdraft", description="Fast LLM inference on ordinary hardware.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)

    pull = sub.add_parser("pull", help="make a known model ready offline")
    pull.add_argument("name", help=f"one of: {', '.join(KNOWN_MODELS)}")
    pull.add_argument("--force", action="store_true", help="convert again even if cached")

    sub.add_parser("models", help="list the known model names")
    sub.add_parser("info", help="what to paste into a bug report: CPU, kernels, threads, versions")

    gen = sub.add_parser("generate", help="stream a completion and print latency figures")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="known name, HF folder or .gguf path")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=_positive_int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--enforce-eager", action="store_true", help="on a GPU, no CUDA graphs: every step eagerly")
    gen.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: all cores)")
    gen.add_argument("--max-seq-len", type=_positive_int, default=4096)
    gen.add_argument("--speculative", metavar="self|ngram|MODEL", default=None,
                     help="speculative decoding: the target's own INT4 copy, prompt lookup, or a draft model")
    gen.add_argument("--num-speculative-tokens", type=_positive_int, default=4)
    gen.add_argument("--draft-device", default=None, help="device of the draft (e.g. cpu beside a cuda target)")
    gen.add_argument("--no-adaptive", action="store_true", help="always draft --num-speculative-tokens tokens")
    gen.add_argument("--draft-min-confidence", type=float, default=None,
                     help="a draft token counts as confident when the draft's top probability reaches this; "
                          "a sequence stops a step's drafting after an unconfident one "
                          "(default: SpeculativeConfig's, 0.5; 0: off)")
    gen.add_argument("--load-in-low-bit", choices=["sym_int4", "asym_int4", "int8", "bf16", "fp32"], default=None,
                     help="quantize on the fly at load time (RTN)")
    gen.add_argument("--keep-gguf-quant", action="store_true",
                     help="keep the quantized blocks of the model's GGUF file (a known name or a .gguf path) "
                          "instead of its dequantized weights: the file's own precision")

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming)")
    srv.add_argument("--model", default=DEFAULT_MODEL, help="known name, HF folder or .gguf path")
    weights = srv.add_mutually_exclusive_group()
    weights.add_argument("--quant", default=None, help="quantize first: key=value,... or a JSON file "
                         "(method=gguf keeps a GGUF file's own blocks)")
    weights.add_argument("--load-in-low-bit", choices=["sym_int4", "asym_int4", "int8", "bf16", "fp32"],
                         default=None, help="quantize on the fly at load time (RTN)")
    srv.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local clients only)")
    srv.add_argument("--port", type=_port, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route")
    srv.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    srv.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: all cores)")
    srv.add_argument("--max-model-len", type=_positive_int, default=4096)
    srv.add_argument("--max-num-seqs", type=_positive_int, default=64)
    srv.add_argument("--max-num-batched-tokens", type=_positive_int, default=512)
    srv.add_argument("--max-queue", type=_positive_int, default=256,
                     help="waiting requests beyond which new ones get 429 (default 256)")
    srv.add_argument("--kv-cache-memory", type=float, default=None, metavar="GiB",
                     help="KV-cache pool size (default: a quarter of the available memory)")
    srv.add_argument("--no-enable-prefix-caching", action="store_true", help="turn prefix caching off")
    srv.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template file")
    srv.add_argument("--speculative", metavar="self|ngram|MODEL", default=None,
                     help="speculative decoding inside the engine's batches: the target's own INT4 copy, prompt "
                          "lookup, or a draft model of the same tokenizer")
    srv.add_argument("--num-speculative-tokens", type=_positive_int, default=4,
                     help="the most tokens a request drafts in a step (default 4)")
    srv.add_argument("--engine-process", action="store_true",
                     help="step the engine in a child process instead of a thread (see docs/server.md)")
    srv.add_argument("--graceful-timeout", type=float, default=30.0,
                     help="seconds SIGTERM waits for running requests before exiting (default 30)")
    srv.add_argument("--backend", choices=["local", "ray"], default="local",
                     help="one engine in this process (local), or engine replicas on Ray Serve (ray)")
    srv.add_argument("--replicas", type=_positive_int, default=1, help="Ray: engine replicas (default 1)")
    srv.add_argument("--address", default=None,
                     help="Ray: the cluster to join ('auto': the local one running); default: start one")
    srv.add_argument("--num-cpus-per-replica", type=_positive_int, default=1,
                     help="Ray: CPUs (and torch threads) each replica takes (default 1)")
    srv.add_argument("--autoscaling-config", default=None, metavar="FILE",
                     help="Ray: a JSON file of Ray Serve's autoscaling_config (min_replicas, max_replicas, "
                          "target_ongoing_requests, ...), replacing --replicas")
    srv.add_argument("--router", choices=["pow2", "round-robin", "prefix"], default="pow2",
                     help="Ray: how a request picks its replica (prefix: where its prompt is likely cached)")
    srv.add_argument("--stream-interval", type=_positive_int, default=1,
                     help="Ray: engine steps a replica gathers before sending a request's tokens on; the first "
                          "and last go at once (default 1)")

    quant = sub.add_parser("quantize", help="quantize a model (one config, or --auto search)")
    quant.add_argument("--model", default=DEFAULT_MODEL)
    quant.add_argument("--output", help="folder for the quantized checkpoint (written atomically)")
    quant.add_argument("--quant", default="method=rtn", help="key=value,... or a JSON file (ignored with --auto)")
    quant.add_argument("--auto", action="store_true",
                       help="walk INT4 group sizes, INT8 linears, INT6, a bf16 head and the GGUF blocks, cheapest "
                            "first; keep the first within --max-loss on the selection set, report it on the test set")
    quant.add_argument("--max-loss", type=_fraction, default=0.01, help="max perplexity loss, e.g. 1%% or 0.01")
    quant.add_argument("--methods", default="rtn", help="with --auto: INT4 methods tried at each group size, "
                                                         "e.g. rtn,gptq (GPTQ takes minutes a candidate)")
    quant.add_argument("--group-sizes", default="128,64,32", help="with --auto: comma list, walked largest first; "
                                                                   "-1 = per channel")
    quant.add_argument("--scheme", default="asymf", choices=["sym", "asym", "asymf"],
                       help="with --auto: INT4 zero points: symmetric, integer zeros, or float zeros")
    quant.add_argument("--int8-sets", type=int, default=3, metavar="N",
                       help="with --auto: rank the kinds of linears by the accuracy INT8 buys per byte and try "
                            "the nested sets of the top 1..N (0: skip)")
    quant.add_argument("--candidates", default="",
                       help="with --auto: explicit configs separated by ';' instead of the walk's steps, tried in "
                            "order of bytes; each keeps its own calibration settings (default 64 windows x 512)")
    quant.add_argument("--num-calib-samples", type=int, default=32,
                       help="with --auto: calibration windows for the grid's GPTQ/AWQ configs")
    quant.add_argument("--damp-percent", type=float, default=0.1,
                       help="with --auto: GPTQ's Hessian dampening, a fraction of its mean diagonal")
    quant.add_argument("--calib-seq-len", type=int, default=512, help="with --auto: tokens per calibration window")
    quant.add_argument("--report-dir", help="where --auto writes report.md/.json/.png (default: OUTPUT/report)")
    mine = quant.add_argument_group("your text (with --auto; the built-in sets by default)")
    mine.add_argument("--text", action="append", metavar="FILE",
                      help="UTF-8 text to split into calibration, selection and test parts (repeatable)")
    mine.add_argument("--text-dir", action="append", metavar="DIR", help="every file under this folder (repeatable)")
    for flag, part in (("calib", "calibration"), ("select", "selection"), ("test", "test")):
        mine.add_argument(f"--{flag}-text", action="append", metavar="PATH",
                          help=f"a file or folder for the {part} part alone (repeatable; instead of --text)")
    mine.add_argument("--mix-builtin", action="store_true",
                      help="keep the built-in sets beside your text; a candidate must meet the target on both")
    mine.add_argument("--split-seed", type=int, default=0, help="the seed that deals your text out to the parts")
    quant.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])

    ev = sub.add_parser("eval", help="perplexity, KL and top-1 agreement against the unquantized model")
    ev.add_argument("--model", default=DEFAULT_MODEL, help="the reference (unquantized) model")
    group = ev.add_mutually_exclusive_group()
    group.add_argument("--quant", help="quantize the model with this config first (key=value,... or JSON file)")
    group.add_argument("--checkpoint", help="a quantized checkpoint folder to evaluate")
    ev.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ev.add_argument("--seq-len", type=_positive_int, default=512)
    ev.add_argument("--text", action="append", metavar="FILE",
                    help="score this UTF-8 text file, whole, instead of the built-in test set (repeatable)")
    ev.add_argument("--text-dir", action="append", metavar="DIR",
                    help="score every file under this folder (repeatable)")
    ev.add_argument("--json", help="also write the results as JSON here")
    return parser


def _fraction(text: str) -> float:
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 1% or 0.01, got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a loss between 0 and 100%, got {text!r}")
    return value


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise CLIError(f"{what} must be a comma-separated list of integers, got {text!r}") from None


def _cmd_pull(args: argparse.Namespace) -> None:
    from fastdraft.models.registry import pull

    path = pull(args.name, force=args.force)
    print(path)


def _cmd_generate(args: argparse.Namespace) -> None:
    from fastdraft.engine.llm_engine import EngineConfig
    from fastdraft.engine.loader import load_model
    from fastdraft.generator import TextGenerator
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
                        keep_gguf_quant=args.keep_gguf_quant)
    config = EngineConfig(max_num_seqs=1, max_model_len=args.max_seq_len, enforce_eager=args.enforce_eager)
    generator = TextGenerator(loaded, speculative=spec, engine_config=config)
    stream = generator.stream(args.prompt, params, chat=args.chat)
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


def _port(text: str) -> int:
    value = _positive_int(text)
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
        loaded = _quantized(model, quant, dtype)
    else:
        loaded = load_model(model, dtype=dtype, load_in_low_bit=load_in_low_bit)
    return LLMEngine(loaded, engine_config,
                     speculation=None if speculative is None else speculator_factory(speculative))


def _cmd_serve(args: argparse.Namespace) -> None:
    from pathlib import Path

    from fastdraft.engine.llm_engine import EngineConfig
    from fastdraft.quant.quant_config import parse_quant_spec
    from fastdraft.server.app import ServerConfig, build_app, serve

    quant = parse_quant_spec(args.quant) if args.quant else None  # bad specs fail before the server starts
    engine_config = EngineConfig(kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                                 enable_prefix_caching=not args.no_enable_prefix_caching)
    template = None
    if args.chat_template:
        template = Path(args.chat_template).read_text(encoding="utf-8")
    config = ServerConfig(served_model_name=args.served_model_name or args.model, api_key=args.api_key,
                          max_queue=args.max_queue, chat_template=template, engine_process=args.engine_process)
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
    serve(build_app(load_engine, config), args.host, args.port, args.graceful_timeout,
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


def _cmd_quantize(args: argparse.Namespace) -> None:
    from pathlib import Path

    from fastdraft.engine.loader import load_model
    from fastdraft.fileio import check_output_path
    from fastdraft.quant.checkpoint import save_quantized
    from fastdraft.quant.quant_config import parse_quant_spec

    texts = _quant_texts(args) if args.auto else None  # bad text fails before anything is written
    if args.output:  # fail now, not after minutes of quantization
        check_output_path(args.output, is_dir=True)
    if args.auto:
        from fastdraft.engine.timing import DecodeStepTimer
        from fastdraft.quant.auto import AutoSearchSpace, auto_quantize, write_report

        space = AutoSearchSpace(methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
                                group_sizes=_int_list(args.group_sizes, "--group-sizes"), scheme=args.scheme,
                                num_int8_sets=args.int8_sets, max_loss=args.max_loss,
                                num_calib_samples=args.num_calib_samples, damp_percent=args.damp_percent,
                                calib_seq_len=args.calib_seq_len,
                                candidates=tuple(c.strip() for c in args.candidates.split(";") if c.strip()))
        report_dir = Path(args.report_dir or (Path(args.output) / "report" if args.output else "fastdraft-auto-report"))
        if args.report_dir:
            check_output_path(report_dir, is_dir=True)
        loaded = load_model(args.model, dtype=args.dtype)
        timer = DecodeStepTimer(space.num_decode_tokens)
        logging.getLogger("fastdraft.quant.auto").setLevel(logging.INFO)  # a line per candidate, as it is tried
        result, best_model = auto_quantize(loaded, space, timer, report_dir=report_dir,
                                           gguf_path=_gguf_or_none(args.model), texts=texts)
        print(write_report(result, space, report_dir))
        print(f"report written to {report_dir}/report.md, report.json, report.png")
        if best_model is None:
            raise CLIError(f"no configuration met the target of {args.max_loss * 100:.2f}% perplexity loss")
        if args.output:
            save_quantized(best_model, args.output, loaded.model_dir)
            print(f"saved {result.best.config.label} to {args.output}")
        return
    if not args.output:
        raise CLIError("--output is required (or use --auto to only search)")
    if args.text or args.text_dir or args.calib_text or args.select_text or args.test_text or args.mix_builtin:
        raise CLIError("--text, --text-dir, --calib-text, --select-text, --test-text and --mix-builtin need --auto")
    config = parse_quant_spec(args.quant)
    loaded = _quantized(args.model, config, args.dtype)
    save_quantized(loaded.model, args.output, loaded.model_dir)
    print(f"saved {config.label} to {args.output}")


def _quant_texts(args: argparse.Namespace):
    """The text sets of ``quantize --auto``: the built-in ones, or the user's text split into
    calibration, selection and test parts (with the model's tokenizer, before the model loads)."""
    from fastdraft.model_config import ModelConfig
    from fastdraft.models.files import resolve_model_dir
    from fastdraft.quant.auto import AutoSearchSpace
    from fastdraft.quant.data import QuantTexts, given_texts, read_text_files, read_text_paths, split_texts
    from fastdraft.tokenizer import Tokenizer

    whole = read_text_files(args.text or [], args.text_dir or []) if args.text or args.text_dir else None
    parts = [read_text_paths(paths) if paths else None for paths in (args.calib_text, args.select_text, args.test_text)]
    if whole is not None and any(p is not None for p in parts):
        raise CLIError("give --text/--text-dir (split for you) or --calib-text/--select-text/--test-text, not both")
    if whole is None and all(p is None for p in parts):
        if args.mix_builtin:
            raise CLIError("--mix-builtin needs your text (--text, --text-dir or --*-text)")
        return QuantTexts()
    model_dir = resolve_model_dir(args.model)
    max_len = ModelConfig.from_file(model_dir / "config.json").max_position_embeddings
    seq_len = min(AutoSearchSpace.eval_seq_len, max_len)
    tokenizer = Tokenizer(model_dir)
    if whole is not None:
        return split_texts(tokenizer, whole, seq_len, args.split_seed, args.mix_builtin)
    return given_texts(tokenizer, *parts, seq_len, args.mix_builtin)


def _gguf_or_none(model: str):
    """The GGUF file ``model`` comes from, if any: the automatic search then also tries its own blocks."""
    from fastdraft.models.files import gguf_source

    try:
        return gguf_source(model)
    except ValueError:
        return None


def _quantized(model: str, config, dtype: str):
    """``model`` loaded and quantized by ``config``; ``method=gguf`` keeps its GGUF file's blocks."""
    from fastdraft.engine.loader import load_model
    from fastdraft.models.files import gguf_source
    from fastdraft.quant.data import calibration_samples
    from fastdraft.quant.quantizer import quantize_model

    if config.is_gguf_native:
        gguf_source(model)  # a model without a GGUF file fails before loading
        return load_model(model, dtype=dtype, keep_gguf_quant=True)
    loaded = load_model(model, dtype=dtype)
    samples = calibration_samples(loaded.tokenizer, config.num_calib_samples, config.calib_seq_len, config.seed) \
        if config.needs_calibration else None
    quantize_model(loaded.model, config, samples)
    return loaded


def _cmd_eval(args: argparse.Namespace) -> None:
    from pathlib import Path

    from fastdraft.engine.loader import load_model
    from fastdraft.fileio import check_output_path, write_json
    from fastdraft.models.files import resolve_model_dir
    from fastdraft.quant.quant_config import parse_quant_spec
    from fastdraft.quant.data import TEST, read_text_files
    from fastdraft.quant.evaluate import EvalWindows, compare, evaluate, format_table, format_text_table

    # Bad arguments fail now, not after scoring the reference model (minutes for the 1.5B).
    config = parse_quant_spec(args.quant) if args.quant and not args.checkpoint else None
    if config is not None and config.is_gguf_native:
        from fastdraft.models.files import gguf_source

        gguf_source(args.model)
    if args.checkpoint:
        try:
            resolve_model_dir(args.checkpoint)
        except ValueError as err:
            raise ValueError(f"--checkpoint: {err}") from None
    if args.json:
        check_output_path(args.json, is_dir=False)
    user_texts = read_text_files(args.text or [], args.text_dir or []) if args.text or args.text_dir else None
    reference = load_model(args.model, dtype=args.dtype)
    seq_len = min(args.seq_len, reference.config.max_position_embeddings)
    if user_texts is not None:
        try:  # the user's text is scored whole, in windows of seq_len tokens
            windows = EvalWindows.build(reference.tokenizer, user_texts, seq_len=seq_len, max_tokens_per_text=None,
                                        min_tokens_per_text=seq_len)
        except ValueError as err:
            raise ValueError(f"{err} (lower --seq-len)") from None
    else:
        windows = EvalWindows.for_set(reference.tokenizer, TEST, seq_len=seq_len)

    candidate, label = None, None
    if args.checkpoint:
        candidate, label = load_model(args.checkpoint, dtype=args.dtype), Path(args.checkpoint).name
    elif config is not None:
        candidate, label = _quantized(args.model, config, args.dtype), config.label

    if candidate is None:
        results = [evaluate(reference.model, windows, label="reference")]
    else:  # side by side, window by window: the full-vocabulary KL, in bounded memory
        results = list(compare(reference.model, candidate.model, windows, label=label))
    print(format_text_table(results[-1]) if user_texts is not None else format_table(results))
    if args.json:
        write_json(args.json, [r.to_dict() for r in results])


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
            _cmd_quantize(args)
        elif args.command == "eval":
            _cmd_eval(args)
        return 0
    except (CLIError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"fastdraft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastdraft: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
