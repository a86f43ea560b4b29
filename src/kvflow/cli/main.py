"""Entry point of the ``kvflow`` console script.

Every error a person can fix (a bad flag value, a missing directory, no GPU for ``--device cuda``)
is one line on stderr, ``kvflow: error: <what is wrong and the accepted form>``, and exit status 2,
found before any heavy import or any work.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import kvflow
from kvflow.errors import ConfigError


class _Parser(argparse.ArgumentParser):
    """argparse with kvflow's one-line errors (no usage block) and defaults shown in --help."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvflow: error: {message}\n")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` for options whose default is a value; None's help says it in words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def _int_at_least(minimum: int, kind: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (≥ {minimum})") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is {kind}; give an integer ≥ {minimum}")
        return value

    return parse


non_negative_int = _int_at_least(0, "negative")
"""argparse type: an integer ≥ 0."""
positive_int = _int_at_least(1, "not positive")
"""argparse type: an integer ≥ 1."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvflow", description="KV-cache transfer runtime for LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvflow {kvflow.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "doctor", help="show Python, torch, CUDA, batched-copy, vLLM, matplotlib and NIXL support"
    )
    bench = sub.add_parser(
        "bench", help="multi-round QA on the reference engine, offload off vs on"
    )
    from kvflow.cli.bench import add_arguments

    add_arguments(bench)
    trace = sub.add_parser("trace", help="summarize a --trace JSON-lines file as tables")
    trace.add_argument("file", type=Path, help="a trace written by kvflow bench --trace")
    trace.add_argument(
        "--top", type=non_negative_int, default=10, help="how many slowest transfers to list"
    )
    return parser


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "doctor":
        from kvflow.cli.doctor import run_doctor

        return run_doctor()
    if args.command == "bench":
        from kvflow.cli.bench import run_bench_command

        return run_bench_command(args)
    if args.command == "trace":
        from kvflow.cli.trace import run_trace

        return run_trace(args.file, top=args.top)
    parser.print_help()
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(parser, args)
    except ConfigError as exc:
        print(f"kvflow: error: {exc}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main", "non_negative_int", "positive_int"]
