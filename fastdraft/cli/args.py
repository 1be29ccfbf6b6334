"""What every ``fastdraft`` command shares: one-line errors and the argument types."""

from __future__ import annotations

import argparse
import json


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` whose errors are a :class:`CLIError` (one line), not a usage dump."""

    def error(self, message: str) -> None:  # one line, not a usage dump
        raise CLIError(message)


def json_object(text: str) -> dict:
    """An ``argparse`` type: a JSON object (``{"enable_thinking": false}``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def fraction(text: str) -> float:
    """An ``argparse`` type: a fraction in (0, 1), written ``0.01`` or ``1%``."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 1% or 0.01, got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a loss between 0 and 100%, got {text!r}")
    return value


def int_list(text: str, what: str) -> tuple[int, ...]:
    """``text`` as comma-separated integers; ``CLIError`` naming ``what`` otherwise."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise CLIError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
