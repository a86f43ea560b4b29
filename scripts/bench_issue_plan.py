#!/usr/bin/env python3
"""Host time of planning one staged batch on the CUDA backend, warm and with cold caches.

A store is issued on the engine's thread right after the forward's launch, whose Python and
torch work has left the CPU caches cold; a loop of one call measures the warm cost, which can be
a tenth of that. Per round, each way plans the same batch (``group_work``'s checks, then
``ring_plan`` on a two-slot ring) once after a sweep that evicts the caches (a large array
summed, a large dict built and serialized: ``--sweep-mib``) and ``--warm`` times back to back.
The ways, interleaved: the batch's ids as tuples of ints (what a ``CopyBatch`` holds: the plain
Python plan for CPU ids in a few ascending runs), checked by the backend or, for a batch of a
plan the worker's ``PlanGate`` checked (``CopyBatch.checked``), not again, each followed by the
issue's other reads of the ids; and as int64 arrays (the numpy plan, what every batch took
until the thirty-third session). ``--parts N`` plans a fenced load in N parts by layer
instead (a part's 2D copies each), what a history request's first step issues before its
forward. No GPU is needed: nothing here touches a device.

    python scripts/bench_issue_plan.py --json out.json
    python scripts/bench_issue_plan.py --parts 4 --blocks 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvflow.backends.cuda.config import CudaConfig
from kvflow.backends.cuda.plan import RegionTable, as_i64, block_ids, group_work, runs_too_short
from kvflow.backends.cuda.ring_plan import ring_plan

KiB = 1 << 10
MiB = 1 << 20


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=256, help="blocks in the store")
    p.add_argument("--runs", type=int, default=2, help="ascending runs the CPU ids come in")
    p.add_argument("--layers", type=int, default=16, help="layers (K and V each a region)")
    p.add_argument("--page-kib", type=int, default=16, help="bytes of one region's page")
    p.add_argument("--parts", type=int, default=0, help="a load in this many parts (0: a store)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warm", type=int, default=200, help="back-to-back plans per warm timing")
    p.add_argument("--sweep-mib", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for name in ("blocks", "runs", "layers", "page_kib", "rounds", "warm", "sweep_mib"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.runs > args.blocks:
        p.error("--runs must be at most --blocks")
    if args.parts < 0 or args.parts > 2 * args.layers:
        p.error("--parts must be between 0 and the regions (2 x --layers)")
    return args


def make_table(layers: int, page: int, num_blocks: int) -> RegionTable:
    """A FlashAttention-like group: K and V of each layer a region of ``page``-byte pages."""
    regions = 2 * layers
    return RegionTable(
        group=0,
        num_blocks=num_blocks,
        base=np.arange(regions, dtype=np.int64) << 32,
        stride=np.full(regions, page, dtype=np.int64),
        page=np.full(regions, page, dtype=np.int64),
        cpu_offset=np.arange(regions, dtype=np.int64) * page,
        block_bytes=regions * page,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    table = make_table(args.layers, args.page_kib * KiB, 4 * args.blocks)
    per_run = -(-args.blocks // args.runs)
    cpu: list[int] = []
    for r in range(args.runs):  # ascending runs with gaps, as a CPU tier hands them out
        start = r * (per_run + 7)
        cpu += range(start, start + min(per_run, args.blocks - len(cpu)))
    gpu = list(range(3, 3 * args.blocks + 3, 3))  # scattered GPU blocks
    cpu_blocks = cpu[-1] + 1
    ring = (1 << 44, 128 * MiB, 1, 2)
    # Per way: the batch's ids, and whether they come from a gated plan (``CopyBatch.checked``).
    ways: dict[str, tuple[tuple[Any, Any], bool]] = {
        "tuples (plain Python)": (((tuple(gpu),), (tuple(cpu),)), False),
        "tuples of a gated plan (CopyBatch.checked)": (((tuple(gpu),), (tuple(cpu),)), True),
        "arrays (numpy)": (((np.array(gpu),), (np.array(cpu),)), False),
    }
    min_run = CudaConfig().store_dma_min_run

    nregions = 2 * args.layers
    spans: list[tuple[int, int] | None] = (
        [None]
        if not args.parts
        else [
            (k * nregions // args.parts, (k + 1) * nregions // args.parts)
            for k in range(args.parts)
        ]
    )

    def plan(ids: tuple[Any, Any], checked: bool = False) -> Callable[[], object]:
        def one() -> object:
            cpu_ids: Sequence[int] | np.ndarray[Any, np.dtype[np.int64]]
            if isinstance(ids[1][0], tuple):
                ((_, _, gpu_ids, cpu_ids),) = group_work(
                    [table], [cpu_blocks], ids[0], ids[1], checked=checked
                )
                # The issue's own reads of the ids before its first copy: the pinned chunk
                # the CPU ids reach, the 2D-copy scan and the kernel's int64 ids.
                max(cpu_ids)
                runs_too_short(gpu_ids, min_run)
                as_i64(gpu_ids)
            else:  # the checks and the plan as they were: numpy from the start
                block_ids(ids[0][0], table.num_blocks, "group 0 GPU")
                cpu_ids = block_ids(ids[1][0], cpu_blocks, "group 0 CPU")
            return [
                ring_plan(
                    table,
                    cpu_ids,
                    1 << 46,
                    regions=span,
                    ring=ring,
                    max_blocks=4096,
                    chunk_blocks=64 * MiB // table.block_bytes,
                    ramp_bytes=16 * MiB,
                    store=not args.parts,
                )
                for span in spans
            ]

        return one

    junk = np.ones(args.sweep_mib * MiB, dtype=np.uint8)

    def sweep() -> None:
        junk.sum()
        d = {i: str(i) for i in range(100_000)}
        json.dumps(list(d.items())[:20_000])

    cold: dict[str, list[float]] = {w: [] for w in ways}
    warm: dict[str, list[float]] = {w: [] for w in ways}
    with Progress(transient=True) as progress:
        task = progress.add_task("planning a store, cold and warm", total=args.rounds)
        for _ in range(args.rounds):
            for name, (ids, checked) in ways.items():
                fn = plan(ids, checked)
                sweep()
                t0 = time.perf_counter()
                fn()
                cold[name].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for _ in range(args.warm):
                    fn()
                warm[name].append((time.perf_counter() - t0) / args.warm)
            progress.advance(task)
    out: dict[str, Any] = {
        "parts": args.parts,
        "blocks": args.blocks,
        "runs": args.runs,
        "block_bytes": table.block_bytes,
        "cold_us": {w: statistics.median(v) * 1e6 for w, v in cold.items()},
        "warm_us": {w: statistics.median(v) * 1e6 for w, v in warm.items()},
    }
    what = f"a load in {args.parts} parts" if args.parts else "a store"
    t = Table(
        title=f"planning {what}: {args.blocks} blocks of {table.block_bytes // KiB} KiB, "
        f"CPU ids in {args.runs} runs (medians of {args.rounds} rounds)"
    )
    t.add_column("ids as")
    t.add_column("cold µs", justify="right")
    t.add_column("warm µs", justify="right")
    for w in ways:
        t.add_row(w, f"{out['cold_us'][w]:.1f}", f"{out['warm_us'][w]:.1f}")
    Console().print(t)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
