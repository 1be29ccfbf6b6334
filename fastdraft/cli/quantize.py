"""``fastdraft quantize`` (one configuration, or the ``--auto`` search) and ``fastdraft eval``."""

from __future__ import annotations

import argparse
import logging

from fastdraft.cli.args import CLIError, fraction, int_list, positive_int
from fastdraft.models.registry import DEFAULT_MODEL


def add_quantize_commands(sub) -> None:
    """The ``quantize`` and ``eval`` subcommands on ``sub`` (the top parser's subparsers)."""
    quant = sub.add_parser("quantize", help="quantize a model (one config, or --auto search)")
    quant.add_argument("--model", default=DEFAULT_MODEL)
    quant.add_argument("--output", help="folder for the quantized checkpoint (written atomically)")
    quant.add_argument("--quant", default="method=rtn", help="key=value,... or a JSON file (ignored with --auto)")
    quant.add_argument("--auto", action="store_true",
                       help="walk INT4 group sizes, INT8 linears, INT6, a bf16 head and the GGUF blocks, cheapest "
                            "first; keep the first within --max-loss on the selection set, report it on the test set")
    quant.add_argument("--max-loss", type=fraction, default=0.01, help="max perplexity loss, e.g. 1%% or 0.01")
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
    ev.add_argument("--seq-len", type=positive_int, default=512)
    ev.add_argument("--text", action="append", metavar="FILE",
                    help="score this UTF-8 text file, whole, instead of the built-in test set (repeatable)")
    ev.add_argument("--text-dir", action="append", metavar="DIR",
                    help="score every file under this folder (repeatable)")
    ev.add_argument("--json", help="also write the results as JSON here")


def cmd_quantize(args: argparse.Namespace) -> None:
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
        from fastdraft.models.files import find_gguf_source
        from fastdraft.quant.auto import AutoSearchSpace, auto_quantize, write_report

        space = AutoSearchSpace(methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
                                group_sizes=int_list(args.group_sizes, "--group-sizes"), scheme=args.scheme,
                                num_int8_sets=args.int8_sets, max_loss=args.max_loss,
                                num_calib_samples=args.num_calib_samples, damp_percent=args.damp_percent,
                                calib_seq_len=args.calib_seq_len,
                                candidates=tuple(c.strip() for c in args.candidates.split(";") if c.strip()))
        report_dir = Path(args.report_dir or (Path(args.output) / "report" if args.output else "fastdraft-auto-report"))
        if args.report_dir:
            check_output_path(report_dir, is_dir=True)
        loaded = load_model(args.model, dtype=args.dtype, keep_gguf_quant=False)
        timer = DecodeStepTimer(space.num_decode_tokens)
        logging.getLogger("fastdraft.quant.auto").setLevel(logging.INFO)  # a line per candidate, as it is tried
        result, best_model = auto_quantize(loaded, space, timer, report_dir=report_dir,
                                           gguf_path=find_gguf_source(args.model), texts=texts)
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
    loaded = quantized_model(args.model, config, args.dtype)
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


def quantized_model(model: str, config, dtype: str):
    """``model`` loaded and quantized by ``config``; ``method=gguf`` keeps its GGUF file's blocks."""
    from fastdraft.engine.loader import load_model
    from fastdraft.models.files import gguf_source
    from fastdraft.quant.data import calibration_samples
    from fastdraft.quant.quantizer import quantize_model

    if config.is_gguf_native:
        gguf_source(model)  # a model without a GGUF file fails before loading
        return load_model(model, dtype=dtype, keep_gguf_quant=True)
    loaded = load_model(model, dtype=dtype, keep_gguf_quant=False)
    samples = calibration_samples(loaded.tokenizer, config.num_calib_samples, config.calib_seq_len, config.seed) \
        if config.needs_calibration else None
    quantize_model(loaded.model, config, samples)
    return loaded


def cmd_eval(args: argparse.Namespace) -> None:
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
    reference = load_model(args.model, dtype=args.dtype, keep_gguf_quant=False)
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
        candidate, label = quantized_model(args.model, config, args.dtype), config.label

    if candidate is None:
        results = [evaluate(reference.model, windows, label="reference")]
    else:  # side by side, window by window: the full-vocabulary KL, in bounded memory
        results = list(compare(reference.model, candidate.model, windows, label=label))
    print(format_text_table(results[-1]) if user_texts is not None else format_table(results))
    if args.json:
        write_json(args.json, [r.to_dict() for r in results])
