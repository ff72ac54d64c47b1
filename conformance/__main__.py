"""`python -m conformance [--seed S]`: every installed backend against the float64 oracle, as one table."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Compare attention_np, attention_jax and attention_torch (those that import) with the "
                    "float64 oracle on random masked cases, in float32 and float64.")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random cases (default 0)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return report.run(seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
