"""What kvflow's logging costs on the hot path, per call, under each logging setup.

Times a transfer transition (``TRANSFER_MACHINE.apply``: a table lookup and a guarded debug event,
several per transfer on the scheduler's step) and a bare ``log.debug`` on a kvflow logger, with:

- nothing configured (kvflow's default: stdlib ``logging``, the ``kvflow`` logger at the root's
  WARNING, so debug events are filtered);
- structlog configured with ``make_filtering_bound_logger(WARNING)`` (what the benchmarks did);
- structlog's own unconfigured default as it was before kvflow routed to stdlib: every debug
  event rendered and printed (here to /dev/null).

Usage: PYTHONPATH=src python scripts/bench_logging.py [--calls N] [--repeat R] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from time import perf_counter_ns

import structlog
from rich.console import Console
from rich.table import Table

from kvflow.core.logs import get_logger
from kvflow.core.transfer import TRANSFER_MACHINE, TransferInput, TransferState

log = get_logger("kvflow.bench_logging")


def _transition() -> None:
    TRANSFER_MACHINE.apply(
        7,
        TransferState.PENDING,
        TransferInput.LAUNCH,
        cause="bench",
        request_id="req-7",
        direction="store",
    )


def _bare_debug() -> None:
    log.debug("bench_event", transfer_id=7, blocks=16)


def _guard() -> None:
    log.debug_enabled()


def _table_lookup() -> None:
    TRANSFER_MACHINE.next_state(TransferState.PENDING, TransferInput.LAUNCH)


@contextlib.contextmanager
def _setup(name: str) -> Iterator[None]:
    structlog.reset_defaults()
    if name == "structlog at WARNING":
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if name != "structlog default (before)":
        yield
        structlog.reset_defaults()
        return
    # structlog's unconfigured default, which kvflow's events used to reach, printing to
    # /dev/null instead of stdout.
    with open(os.devnull, "w") as sink:
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sink))
        yield
    structlog.reset_defaults()


def _per_call_ns(fn: Callable[[], None], calls: int, repeat: int) -> list[float]:
    runs = []
    for _ in range(repeat):
        start = perf_counter_ns()
        for _ in range(calls):
            fn()
        runs.append((perf_counter_ns() - start) / calls)
    return runs


SETUPS = ("nothing configured (stdlib)", "structlog at WARNING", "structlog default (before)")
CALLS = {
    "transition (apply)": _transition,
    "bare log.debug": _bare_debug,
    "guard (debug_enabled)": _guard,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=100_000, help="calls per timed run")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per cell")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    # The fastest of the runs: on a shared machine the others measure the neighbours' load.
    floor = min(_per_call_ns(_table_lookup, args.calls, args.repeat))
    figures: dict[str, dict[str, float]] = {}
    for setup in SETUPS:
        # the printing setup is 10-100x slower: fewer calls keep its run short
        calls = args.calls // 10 if "before" in setup else args.calls
        with _setup(setup):
            figures[setup] = {
                label: min(_per_call_ns(fn, calls, args.repeat)) for label, fn in CALLS.items()
            }
    table = Table(title=f"kvflow logging per call (ns, fastest of {args.repeat} runs)")
    table.add_column("logging setup")
    for label in CALLS:
        table.add_column(f"{label} ns", justify="right")
    for setup, row in figures.items():
        table.add_row(setup, *(f"{row[label]:,.0f}" for label in CALLS))
    Console().print(table)
    Console().print(f"the transition's table lookup alone: {floor:,.0f} ns")
    if args.json is not None:
        record = {
            "machine": platform.node(),
            "python": sys.version.split()[0],
            "per_call_ns": figures,
            "table_lookup_ns": floor,
        }
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
