"""Entry point of the ``kvflow`` console script."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import kvflow


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvflow", description="KV-cache transfer runtime for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvflow {kvflow.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("doctor", help="show Python, torch, CUDA and batched-copy support")
    bench = sub.add_parser(
        "bench", help="multi-round QA on the reference engine, offload off vs on"
    )
    from kvflow.cli.bench import add_arguments

    add_arguments(bench)
    trace = sub.add_parser("trace", help="summarize a --trace JSON-lines file as tables")
    trace.add_argument("file", type=Path, help="a trace written by kvflow bench --trace")
    trace.add_argument("--top", type=int, default=10, help="how many slowest transfers to list")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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


__all__ = ["build_parser", "main"]
