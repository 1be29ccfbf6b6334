"""Command-line interface: ``fastdraft pull`` and ``fastdraft generate``."""

from __future__ import annotations

import argparse
import logging
import sys

from fastdraft.models.registry import DEFAULT_MODEL, KNOWN_MODELS


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
    gen.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: all cores)")
    gen.add_argument("--max-seq-len", type=_positive_int, default=4096)
    return parser


def _cmd_pull(args: argparse.Namespace) -> None:
    from fastdraft.models.registry import pull

    path = pull(args.name, force=args.force)
    print(path)


def _cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from fastdraft.engine.generate import TextGenerator
    from fastdraft.engine.sampling_params import SamplingParams
    from fastdraft.models.loader import load_model

    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    generator = TextGenerator(loaded, max_seq_len=args.max_seq_len)
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


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        if args.command == "pull":
            _cmd_pull(args)
        elif args.command == "models":
            for name, source in KNOWN_MODELS.items():
                print(f"{name}\t{source.description}")
        elif args.command == "generate":
            _cmd_generate(args)
        return 0
    except (CLIError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"fastdraft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastdraft: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
