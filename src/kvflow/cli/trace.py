"""``kvflow trace FILE.jsonl``: summarize a trace's transfers as tables.

Reads the ``transfer_transition`` events (``transfer_id``, ``direction``, ``from``, ``to``, ``ts``)
and prints: transfers by final state and direction, pending → committed latency percentiles per
direction, and the slowest transfers. A line that cannot be read (a cut-off last line, a field of
the wrong type) is reported by number and skipped; the summary covers the rest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from attrs import define, frozen
from rich.console import Console
from rich.table import Table

from kvflow.errors import ConfigError
from kvflow.tracing import read_trace_lines


@define(eq=False)
class _TransferTrace:
    transfer_id: int
    direction: str
    request_id: str
    first_ts: float | None = None
    committed_ts: float | None = None
    final_state: str = "pending"
    reached: set[str] | None = None


@frozen
class TraceSummary:
    num_events: int
    by_final_state: Mapping[tuple[str, str], int]  # (direction, final state) → count
    ended_in: Mapping[tuple[str, str], int]  # (direction, state before release) → count
    latency_s: Mapping[str, tuple[float, ...]]  # direction → sorted pending→committed latencies
    slowest: tuple[tuple[int, str, str, float], ...]  # (id, direction, request, seconds)


def _percentile(sorted_values: tuple[float, ...], q: float) -> float:
    if not sorted_values:
        return float("nan")
    idx = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[idx]


def _field_problem(event: Mapping[str, Any]) -> str | None:
    """What is wrong with a transition event's fields, or None."""
    tid = event.get("transfer_id")
    if isinstance(tid, bool) or not isinstance(tid, int):
        return f"transfer_id {tid!r} is not an integer"
    ts = event.get("ts")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int | float)):
        return f"ts {ts!r} is not a number"
    for key in ("from", "to"):
        if not isinstance(event.get(key), str):
            return f"{key!r} {event.get(key)!r} is not a state name"
    return None


def summarize(
    lines: Iterable[tuple[int, Mapping[str, Any]]],
    top: int = 10,
    problems: list[str] | None = None,
) -> TraceSummary:
    """Fold (line number, event) pairs' transfer transitions into per-transfer lives and tables.

    A transition whose fields have the wrong type raises ``ConfigError`` naming its line, or, with
    ``problems`` given, is recorded there and skipped.
    """
    transfers: dict[int, _TransferTrace] = {}
    count = 0
    for lineno, event in lines:
        count += 1
        if event.get("event") != "transfer_transition":
            continue
        problem = _field_problem(event)
        if problem is not None:
            if problems is None:
                raise ConfigError(f"line {lineno}: {problem}")
            problems.append(f"line {lineno}: {problem}; skipped")
            continue
        tid = int(event["transfer_id"])
        t = transfers.get(tid)
        if t is None:
            t = transfers[tid] = _TransferTrace(
                tid,
                str(event.get("direction", "?")),
                str(event.get("request_id", "?")),
                reached=set(),
            )
        ts = event.get("ts")
        if isinstance(ts, int | float) and t.first_ts is None and event.get("from") == "pending":
            t.first_ts = float(ts)
        to = str(event.get("to"))
        if to == "committed" and isinstance(ts, int | float):
            t.committed_ts = float(ts)
        assert t.reached is not None
        t.reached.add(to)
        t.final_state = to
    by_state: Counter[tuple[str, str]] = Counter()
    ended_in: Counter[tuple[str, str]] = Counter()
    latency: dict[str, list[float]] = {}
    lives: list[tuple[int, str, str, float]] = []
    for t in transfers.values():
        by_state[(t.direction, t.final_state)] += 1
        assert t.reached is not None
        outcome = next(
            (s for s in ("committed", "failed", "abandoned") if s in t.reached), t.final_state
        )
        ended_in[(t.direction, outcome)] += 1
        if t.first_ts is not None and t.committed_ts is not None:
            dt = t.committed_ts - t.first_ts
            latency.setdefault(t.direction, []).append(dt)
            lives.append((t.transfer_id, t.direction, t.request_id, dt))
    lives.sort(key=lambda x: -x[3])
    return TraceSummary(
        num_events=count,
        by_final_state=dict(by_state),
        ended_in=dict(ended_in),
        latency_s={d: tuple(sorted(v)) for d, v in latency.items()},
        slowest=tuple(lives[:top]),
    )


def render(summary: TraceSummary, console: Console) -> None:
    states = Table(title=f"transfers ({summary.num_events} events)")
    for col in ("direction", "outcome", "transfers", "now released"):
        states.add_column(col, justify="right" if col in ("transfers", "now released") else "left")
    for (direction, outcome), n in sorted(summary.ended_in.items()):
        released = sum(
            c for (d, s), c in summary.by_final_state.items() if d == direction and s == "released"
        )
        states.add_row(direction, outcome, str(n), str(released) if outcome == "committed" else "")
    console.print(states)
    lat = Table(title="pending → committed latency (ms)")
    for col in ("direction", "n", "p50", "p90", "p99", "max"):
        lat.add_column(col, justify="right")
    for direction, values in sorted(summary.latency_s.items()):
        lat.add_row(
            direction,
            str(len(values)),
            *(f"{_percentile(values, q) * 1e3:.3f}" for q in (50, 90, 99)),
            f"{values[-1] * 1e3:.3f}",
        )
    console.print(lat)
    slow = Table(title="slowest transfers")
    for col in ("transfer", "direction", "request", "ms"):
        slow.add_column(col, justify="right" if col in ("transfer", "ms") else "left")
    for tid, direction, request, dt in summary.slowest:
        slow.add_row(str(tid), direction, request, f"{dt * 1e3:.3f}")
    console.print(slow)


MAX_PROBLEMS_SHOWN = 10


def run_trace(path: Path, top: int = 10, console: Console | None = None) -> int:
    """Print the summary of ``path``; unreadable lines are listed by number after it."""
    console = console or Console()
    problems: list[str] = []
    summary = summarize(read_trace_lines(path, problems), top=top, problems=problems)
    render(summary, console)
    if problems:
        console.print(
            f"[yellow]{len(problems)} line(s) skipped, the summary covers the rest:[/]",
            soft_wrap=True,
        )
        for problem in problems[:MAX_PROBLEMS_SHOWN]:
            console.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
        if len(problems) > MAX_PROBLEMS_SHOWN:
            console.print(f"  ... and {len(problems) - MAX_PROBLEMS_SHOWN} more")
    return 0


__all__ = ["TraceSummary", "render", "run_trace", "summarize"]
