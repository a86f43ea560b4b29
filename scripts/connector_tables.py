"""The tables of ``bench_connector_transfer.py``: the through-the-connector figures and the
floor (copies that finish at once), each a rich table, and the quartiles both use."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

DIRECTIONS = ("store", "load")


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``xs`` (the median alone for one value)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def floor_figures(rows: dict[str, list[float]]) -> dict[str, Any]:
    """A direction's floor steps as figures: medians, quartiles and every step (ms, µs)."""
    walls = [w * 1e3 for w in rows["wall"]]
    launches = [la * 1e6 for la in rows["launch"]]
    (w1, wm, w3), (l1, lm, l3) = quartiles(walls), quartiles(launches)
    return {
        "floor_ms": wm,
        "floor_ms_q1": w1,
        "floor_ms_q3": w3,
        "floor_launch_us": lm,
        "floor_launch_us_q1": l1,
        "floor_launch_us_q3": l3,
        "floors_ms": walls,
        "floor_launches_us": launches,
    }


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def add_columns(table: Table, columns: Sequence[str]) -> None:
    """Names left-aligned, figures right-aligned."""
    for col in columns:
        table.add_column(col, justify="left" if col in ("layout", "path", "dir") else "right")


def render_floor(results: list[dict[str, Any]], args: argparse.Namespace, console: Console) -> None:
    """``--floor-only``'s table: per case and direction, the floor's quartiles."""
    table = Table(
        title=(
            f"connector floor (copies that finish at once; {args.worker_loop} worker loop, "
            f"{args.hashes} hashes), {args.layers} layers, scattered GPU ids: "
            f"{args.steps} steps"
        )
    )
    add_columns(
        table, ["layout", "blocks", "dir", "floor ms (median)", "IQR ms", "launch µs", "IQR µs"]
    )
    for r in results:
        for d in DIRECTIONS:
            f = r[d]
            table.add_row(
                r["layout"],
                f"{r['blocks']:,}",
                d,
                f"{f['floor_ms']:.3f}",
                f"{f['floor_ms_q1']:.3f}–{f['floor_ms_q3']:.3f}",
                f"{f['floor_launch_us']:.0f}",
                f"{f['floor_launch_us_q1']:.0f}–{f['floor_launch_us_q3']:.0f}",
            )
    console.print(table)
    console.print(
        "floor = kvflow's own work per step on the engine's thread (wall from the step's "
        "first timed call until the scheduler sees the result); launch = wait_for_save "
        "(store) / start_load_kv (load)"
    )


def render(results: list[dict[str, Any]], args: argparse.Namespace, console: Console) -> None:
    table = Table(
        title=(
            f"through the connector ({args.worker_loop} worker loop, {args.method} path), "
            f"{args.layers} layers, "
            f"scattered GPU ids, on {device_name(args.device)}: medians of {args.steps} steps"
        )
    )
    columns = [
        "layout",
        "blocks",
        "MiB",
        "path",
        "dir",
        "ceiling GB/s",
        "wall GB/s",
        "of ceiling",
        "copy GB/s (events)",
        "wall ms",
        "fixed ms",
        "from launch: of ceiling",
        "from launch: fixed ms",
        "launch µs",
        "issue µs",
    ]
    if args.floor:
        columns += ["floor ms", "floor launch µs"]
    columns.append("bytes ok")
    add_columns(table, columns)
    for r in results:
        for d in DIRECTIONS:
            f = r[d]
            row = [
                r["layout"],
                f"{r['blocks']:,}",
                f"{r['step_bytes'] / 2**20:,.0f}",
                r["path"],
                d,
                f"{f['ceiling_gbps']:.1f}",
                f"{f['wall_gbps']:.1f}",
                f"{f['fraction_of_ceiling']:.0%}",
                f"{f['copy_gbps']:.1f}",
                f"{f['wall_ms']:.2f}",
                f"{f['fixed_ms']:.2f}",
                f"{f['from_launch_fraction']:.0%}",
                f"{f['from_launch_fixed_ms']:.2f}",
                f"{f['launch_us']:.0f}",
                f"{f['issue_us']:.0f}" if f["issue_us"] else "—",
            ]
            if args.floor:
                row += [f"{f['floor_ms']:.2f}", f"{f['floor_launch_us']:.0f}"]
            row.append({True: "yes", False: "NO", None: "—"}[r["bytes_match"]])
            table.add_row(*row)
    console.print(table)
    console.print(
        "fixed = wall − bytes / ceiling; from launch: the same from the step's first launch "
        "call (start_load_kv, after the plan and the bind) until the scheduler saw the result, "
        "the span issue 25 defines; launch = the engine thread's time in wait_for_save "
        "(store) / start_load_kv (load); issue = the CUDA backend's planning and driver calls; "
        "floor = the same steps with copies that finish at once (kvflow's own cost)"
    )
    console.print(
        "goals (issue 25): ≥ 90 % of the ceiling and fixed ≤ ~0.25 ms per step from the launch "
        "call (the wall's figures, with the plan and the bind, are stricter), launch ≤ 200 µs"
    )
    render_timeline(results, args, console)


TIMELINE = (  # a step's phases (the keys of bench_connector_transfer's timeline) and labels
    ("plan", "plan"),
    ("bind", "bind"),
    ("to_issue", "to issue"),
    ("issue", "issue"),
    ("pre", "pre: copy starts"),
    ("start_in_issue", "… into issue"),
    ("copy", "copy"),
    ("detect", "detect"),
    ("settle", "last poll"),
    ("post", "post"),
    ("polls", "polls"),
)


def render_timeline(
    results: list[dict[str, Any]], args: argparse.Namespace, console: Console
) -> None:
    """Where a step's wall goes, the device's copy span placed on the host clock (CUDA
    backend only): medians per case and direction, µs."""
    rows = [(r, d) for r in results for d in DIRECTIONS if "timeline" in r[d]]
    if not rows:
        return
    table = Table(title=f"a step's timeline, µs (medians of {args.steps} steps)")
    add_columns(table, ["layout", "blocks", "dir", *(name for _, name in TIMELINE)])
    for r, d in rows:
        t = r[d]["timeline"]
        table.add_row(r["layout"], f"{r['blocks']:,}", d, *(f"{t[key]:.0f}" for key, _ in TIMELINE))
    console.print(table)
    console.print(
        "plan: the step's start (a load's: its match) until build_connector_meta returned; "
        "bind: bind_connector_metadata; to issue: until the CUDA backend began issuing; pre: "
        "the step's start until the device began copying (a clock mark taken on an idle "
        "stream puts the device's timing events on the host clock, a few µs late), … into "
        "issue: how far into the issue that was; copy: the device's copy span; detect: its "
        "end until the poll that saw it began; last poll: that poll; post: the copy's end "
        "until the scheduler saw the result"
    )


__all__ = [
    "DIRECTIONS",
    "TIMELINE",
    "add_columns",
    "device_name",
    "floor_figures",
    "quartiles",
    "render",
    "render_floor",
    "render_timeline",
]
