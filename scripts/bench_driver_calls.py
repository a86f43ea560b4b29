#!/usr/bin/env python3
"""Host time of each CUDA driver call the CUDA backend's issue path makes, two ways, interleaved.

Per call kind: through cuda-python's bindings (what the CUDA backend's issue path calls; the
gather launch is ``StageKernel.launch``) and through ctypes on raw handles (``driver.RawCalls``,
what the PD transport calls), plus an event created and destroyed against one taken from and
given back to an ``EventPool``. Rounds alternate the two ways, each round timing ``--calls``
calls back to back after a device sync; the table gives the median µs per call over the rounds,
and its interquartile range.

    python scripts/bench_driver_calls.py --json out.json      # on a GPU machine
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

try:  # imported as part of the scripts package (tests), or run as a file
    from scripts.connector_tables import quartiles
except ImportError:
    from connector_tables import quartiles  # type: ignore[import-not-found,no-redef]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=400, help="calls per round")
    p.add_argument("--rounds", type=int, default=15, help="rounds per way, interleaved")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        p.error("--calls and --rounds must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=140)
    try:
        import torch
    except ImportError:
        console.print("bench_driver_calls: torch is not importable")
        return 2
    if not torch.cuda.is_available():
        console.print("bench_driver_calls: needs a CUDA device")
        return 2
    from kvflow.backends.cuda import driver as drv
    from kvflow.backends.cuda.kernels import StageKernel

    torch.cuda.init()  # type: ignore[no-untyped-call]
    ctx = drv.Context(0)
    raw = drv.raw_calls()
    stream = drv.lowest_priority_stream()
    stream_h = int(stream)
    event = drv.new_event()
    event_h = int(event)
    major = ctx.attribute(drv.cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
    minor = ctx.attribute(drv.cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    kernel = StageKernel(f"sm_{major}{minor}", 64)
    ids = np.arange(64, dtype=np.int64)
    # One region of empty pages: the launch's host cost, next to no device work.
    region = torch.zeros(4, dtype=torch.int64, device="cuda")
    region_p = int(region.data_ptr())
    page = 4096
    gpu = torch.empty(page, dtype=torch.uint8, device="cuda")
    host = torch.empty(page, dtype=torch.uint8).pin_memory()
    gpu_p, host_p = int(gpu.data_ptr()), int(host.data_ptr())
    pool = drv.EventPool()
    # The ctypes side of cuMemcpyAsync (kvflow itself makes the call through cuda-python only).
    memcpy_raw = ctypes.CDLL("libcuda.so.1").cuMemcpyAsync
    memcpy_raw.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    memcpy_raw.restype = ctypes.c_int

    kernel_params = int(kernel._pointers.ctypes.data)
    function_h = int(kernel.function)

    def launch_raw() -> None:
        kernel._scalars[0] = region_p
        kernel._ints[0] = 1
        kernel._ints[1] = 64
        kernel._ids[:64] = ids
        raw.launch(function_h, 8, 256, stream_h, kernel_params)

    def pooled_event() -> None:
        pool.give(pool.take())

    def created_event() -> None:
        drv.cu.cuEventDestroy(drv.new_event())

    cases: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
        "cuEventRecord": (lambda: drv.record(event, stream), lambda: raw.record(event_h, stream_h)),
        "cuStreamWaitEvent": (lambda: drv.wait(stream, event), lambda: raw.wait(stream_h, event_h)),
        "cuLaunchKernel (gather, 64 ids)": (
            lambda: kernel.launch(stream, region_p, 1, 0, 0, ids, to_staging=True),
            launch_raw,
        ),
        "cuMemcpyAsync 4 KiB D2H": (
            lambda: drv.check(drv.cu.cuMemcpyAsync(host_p, gpu_p, page, stream), "cuMemcpyAsync"),
            lambda: memcpy_raw(host_p, gpu_p, page, stream_h),
        ),
        "event: create+destroy / pool": (created_event, pooled_event),
    }
    times: dict[str, dict[str, list[float]]] = {c: {"bindings": [], "raw": []} for c in cases}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("rounds", total=args.rounds * len(cases) * 2)
        for r in range(args.rounds):
            for name, (a, b) in cases.items():
                order = (("bindings", a), ("raw", b))
                for way, fn in order if r % 2 == 0 else order[::-1]:
                    drv.check(drv.cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
                    began = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    times[name][way].append((time.perf_counter() - began) / args.calls * 1e6)
                    progress.advance(task)
    drv.check(drv.cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    table = Table(
        title=(
            f"host µs per driver call, {torch.cuda.get_device_name()}: cuda-python bindings vs "
            f"ctypes on raw handles ({args.rounds} rounds × {args.calls} calls, interleaved; "
            "median, IQR)"
        )
    )
    for col in ("call", "bindings µs", "raw µs", "raw / bindings"):
        table.add_column(col, justify="left" if col == "call" else "right")
    rows = []
    for name, ways in times.items():
        bq, rq = quartiles(ways["bindings"]), quartiles(ways["raw"])
        rows.append({"call": name, "bindings_us": bq, "raw_us": rq})
        table.add_row(
            name,
            f"{bq[1]:.2f} ({bq[0]:.2f}–{bq[2]:.2f})",
            f"{rq[1]:.2f} ({rq[0]:.2f}–{rq[2]:.2f})",
            f"{rq[1] / bq[1]:.2f}",
        )
    console.print(table)
    console.print("event row: raw = an EventPool take and give; bindings = cuEventCreate + Destroy")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"device": torch.cuda.get_device_name(), "rows": rows, "times": times}, indent=1
            )
        )
    pool.close()
    kernel.unload()
    return 0


if __name__ == "__main__":
    sys.exit(main())
