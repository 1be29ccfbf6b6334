"""Command-line interface: ``fastdraft pull``, ``models``, ``generate``, ``serve``, ``quantize``,
``eval`` and ``info``. Commands import the library lazily, so that ``fastdraft --help`` starts fast."""

from fastdraft.cli.args import CLIError
from fastdraft.cli.commands import build_parser, main

__all__ = ["CLIError", "build_parser", "main"]
