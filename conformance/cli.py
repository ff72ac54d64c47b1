"""The command line's parsing helpers, one home for `python -m conformance` and its `compare` command
(conformance/bench/report.py): argparse types that turn a word into a value or a usage error (exit code 2)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (a count of repeats or examples)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """An argparse type: positive integers separated by commas (sequence lengths)."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def names_of(what: str, known: Callable[[], Sequence[str]], *,
             aliases: Mapping[str, str] | None = None) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: names separated by commas, each one of `known()` (read when the option is parsed, so a
    registry that imports Hypothesis is imported only then) or an alias of one; `what` names them in the error."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple((aliases or {}).get(name, name) for name in (part.strip() for part in text.split(",")) if name)
        choices = known()
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from "
                                             f"{','.join((*(aliases or {}),) or choices)}")
        return names
    return parse
