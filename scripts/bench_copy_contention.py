"""What a background GPU→CPU copy costs the engine's own small copies and kernels.

An engine copies its sampled tokens to the CPU every step (a few hundred bytes, device → host).
kvflow's eager stores move whole KV blocks the same way on their own low-priority stream. This
measures, on the GPU at hand:

- ``queued``: the small copy issued right after a 128 MiB device → pinned-host copy was queued on
  another stream, whole or in chunks (all chunks queued at once);
- ``paced``: the same 128 MiB handed over by a thread that keeps at most ``depth`` chunks in
  flight, while the main thread times small copies back to back until it is done;
- ``gemm``: 20 bf16 GEMMs (4096 × 2048 × 8192) alone and while the big copy runs.

    PYTHONPATH=src python scripts/bench_copy_contention.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

MiB = 1 << 20
TOTAL = 128 * MiB
CHUNKS = (128 * MiB, 16 * MiB, 4 * MiB, 1 * MiB)
PACED = ((16 * MiB, 1), (8 * MiB, 1), (8 * MiB, 2), (4 * MiB, 1), (2 * MiB, 1))


class Rig:
    """Buffers and a side stream on one device."""

    def __init__(self) -> None:
        self.src = torch.empty(TOTAL, dtype=torch.uint8, device="cuda")
        self.dst = torch.empty(TOTAL, dtype=torch.uint8).pin_memory()
        self.small = torch.arange(64, device="cuda")
        # kvflow's copy streams: the lowest priority, which is also the default stream's.
        self.side = torch.cuda.Stream(priority=0)  # type: ignore[no-untyped-call]
        self.a = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
        self.w = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16)

    def queue_copy(self, chunk: int) -> None:
        """Queue the big copy on the side stream in ``chunk``-sized pieces; don't wait."""
        with torch.cuda.stream(self.side):
            for off in range(0, TOTAL, chunk):
                self.dst[off : off + chunk].copy_(self.src[off : off + chunk], non_blocking=True)

    def small_copy(self) -> None:
        self.small.tolist()

    def gemms(self) -> None:
        for _ in range(20):
            self.a @ self.w
        torch.cuda.current_stream().synchronize()


def timed_ms(rig: Rig, fn: Callable[[], None], chunk: int | None, repeat: int) -> float:
    """Median ms of ``fn``, each time right after queueing the big copy (None: no copy)."""
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        if chunk is not None:
            rig.queue_copy(chunk)
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(out) * 1e3


def paced(rig: Rig, chunk: int, depth: int) -> tuple[float, float, float]:
    """(copy ms, small copy p50 ms, small copy max ms) with the big copy paced by a thread."""
    done: list[float] = []

    def pace() -> None:
        events: list[torch.cuda.Event] = []
        with torch.cuda.stream(rig.side):
            for off in range(0, TOTAL, chunk):
                if len(events) >= depth:
                    events.pop(0).synchronize()
                rig.dst[off : off + chunk].copy_(rig.src[off : off + chunk], non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                event.record(rig.side)
                events.append(event)
            for event in events:
                event.synchronize()
        done.append(time.perf_counter())

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    thread = threading.Thread(target=pace)
    thread.start()
    lat: list[float] = []
    while not done:
        t = time.perf_counter()
        rig.small_copy()
        lat.append(time.perf_counter() - t)
    thread.join()
    return (done[0] - t0) * 1e3, statistics.median(lat) * 1e3, max(lat) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=7, help="timings per cell (median)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    console = Console()
    if not torch.cuda.is_available():
        console.print("bench_copy_contention: needs a CUDA device")
        return 2
    rig = Rig()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "total_bytes": TOTAL}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("copy contention", total=2 * (len(CHUNKS) + 1) + len(PACED))
        for _ in range(2):
            paced(rig, TOTAL, 1)  # warm-up: pinning, stream, thread
        queued: dict[str, dict[str, float]] = {}
        for name, fn in (("small_d2h_ms", rig.small_copy), ("gemm_ms", rig.gemms)):
            cells = {"alone": timed_ms(rig, fn, None, args.repeat)}
            progress.advance(task)
            for chunk in CHUNKS:
                cells[f"{chunk // MiB}MiB"] = timed_ms(rig, fn, chunk, args.repeat)
                progress.advance(task)
            queued[name] = cells
        out["queued"] = queued
        rows = []
        for chunk, depth in PACED:
            runs = [paced(rig, chunk, depth) for _ in range(3)]
            rows.append(
                {
                    "chunk_bytes": chunk,
                    "depth": depth,
                    "copy_ms": statistics.median(r[0] for r in runs),
                    "small_d2h_p50_ms": statistics.median(r[1] for r in runs),
                    "small_d2h_max_ms": max(r[2] for r in runs),
                }
            )
            progress.advance(task)
        out["paced"] = rows
    table = Table(title=f"a 128 MiB GPU→CPU copy queued on another stream, {out['device']}")
    table.add_column("measured (ms, median)")
    table.add_column("alone", justify="right")
    for chunk in CHUNKS:
        table.add_column(f"in {chunk // MiB} MiB pieces", justify="right")
    labels = {"small_d2h_ms": "256-byte GPU→CPU copy", "gemm_ms": "20 GEMMs, bf16"}
    for name, cells in queued.items():
        table.add_row(labels[name], *(f"{v:.3f}" for v in cells.values()))
    console.print(table)
    paced_table = Table(title="the same copy paced by a thread: at most `depth` chunks in flight")
    for col in ("chunk", "depth", "copy ms", "GB/s", "small copy p50 ms", "small copy max ms"):
        paced_table.add_column(col, justify="right")
    for r in rows:
        paced_table.add_row(
            f"{r['chunk_bytes'] // MiB} MiB",
            str(r["depth"]),
            f"{r['copy_ms']:.2f}",
            f"{TOTAL / r['copy_ms'] / 1e6:.1f}",
            f"{r['small_d2h_p50_ms']:.3f}",
            f"{r['small_d2h_max_ms']:.3f}",
        )
    console.print(paced_table)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
