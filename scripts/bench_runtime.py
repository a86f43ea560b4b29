"""Benchmark the worker runtime: per-transfer overhead, idle CPU use and completion latency.

1. Overhead, plan → submitted → reported, on the fake backend with every copy finishing at once:
   what the runtime itself costs per transfer (goal ≤ 30 µs, ≥ 20,000 transfers/s on one core).
2. The same through the synchronous facade (one engine step = bind, load, save, [flush,] finish_step).
3. Reactor CPU use: idle (nothing in flight; goal < 1% of a core) and while one fence stays
   pending (polling at the back-off cap).
4. Completion latency on an idle loop: from the host backend's copy thread marking a fence done
   to the waiting task resuming (goal ≤ 100 µs), with the wakeup callback and by polling alone.

Run: ``PYTHONPATH=src python scripts/bench_runtime.py [--quick]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import anyio
import structlog
import torch
from rich.console import Console
from rich.table import Table

from kvflow.backends.base import CopyBatch
from kvflow.backends.fake import FakeBackend
from kvflow.backends.host import HostBackend
from kvflow.core.layout import TensorDesc
from kvflow.core.protocol import StepPlan, TransferSpec
from kvflow.core.transfer import Direction
from kvflow.runtime.reactor import Reactor
from kvflow.runtime.threaded import ThreadedSyncWorker
from kvflow.runtime.worker import WorkerOptions, WorkerRuntime

GPU_BLOCKS = 1 << 16


def fake_backend() -> FakeBackend:
    fake = FakeBackend(auto_complete=True)
    desc = TensorDesc(
        "kv",
        (2, GPU_BLOCKS, 16, 8, 128),
        (GPU_BLOCKS * 16384, 16384, 1024, 128, 1),
        2,
        1 << 20,
        "cuda:0",
    )
    fake.register_kv_caches({"kv": desc}, GPU_BLOCKS)
    fake.allocate_cpu_tier([GPU_BLOCKS])
    return fake


def plan(step: int, per_step: int) -> StepPlan:
    base = step * per_step
    half = per_step // 2
    stores = tuple(
        TransferSpec(base + i, f"r{i}", Direction.STORE, [[(base + i) % GPU_BLOCKS]], [[i]])
        for i in range(per_step - half)
    )
    loads = tuple(
        TransferSpec(base + per_step - half + i, f"q{i}", Direction.LOAD, [[i]], [[i + 7]])
        for i in range(half)
    )
    return StepPlan(step, stores=stores, loads=loads)


async def overhead(
    per_step: int, transfers: int, coalesce: bool, pipelined: bool = False
) -> tuple[float, float, float]:
    """(wall µs per transfer, CPU µs per transfer, transfers/s) for the async API.

    Not pipelined, each step waits for its copies (a flush) before the next is planned;
    pipelined, each step only gives the loop one turn, like an engine whose forward pass runs
    while the previous step's copies complete, and collects whatever has been reported.
    """
    steps = max(transfers // per_step, 1)
    plans = [plan(s, per_step) for s in range(steps)]
    async with WorkerRuntime.open(fake_backend(), WorkerOptions(coalesce=coalesce)) as rt:
        done = 0
        c0, t0 = time.process_time(), time.perf_counter()
        for p in plans:
            rt.bind(p)
            rt.launch()
            if pipelined:
                await anyio.lowlevel.checkpoint()
            else:
                await rt.flush()
            done += len(rt.build_report().completed)
        await rt.flush()
        done += len(rt.build_report().completed)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert done == steps * per_step
    return wall / done * 1e6, cpu / done * 1e6, done / wall


def sync_overhead(per_step: int, transfers: int, pipelined: bool) -> tuple[float, float]:
    """(wall µs per engine step, wall µs per transfer) through the synchronous facade; with
    ``pipelined`` no step waits for its copies (no flush), as in an engine's step loop."""
    steps = max(transfers // per_step, 1)
    plans = [plan(s, per_step) for s in range(steps)]
    with ThreadedSyncWorker(fake_backend()) as rt:
        done = 0
        t0 = time.perf_counter()
        for p in plans:
            rt.bind_connector_metadata(p)
            rt.start_load_kv()
            rt.wait_for_save()
            if not pipelined:
                rt.flush()
            done += len(rt.finish_step()[2].completed)
        rt.flush()
        done += len(rt.build_report().completed)
        wall = time.perf_counter() - t0
    assert done == steps * per_step
    return wall / steps * 1e6, wall / done * 1e6


async def cpu_use(seconds: float, pending: bool) -> float:
    """Percent of one core the process used over ``seconds`` of wall time."""
    fake = FakeBackend()
    fake.register_kv_caches({"kv": TensorDesc("kv", (4, 8), (8, 1), 2, 4096, "cuda:0")}, 4)
    fake.allocate_cpu_tier([4])
    async with WorkerRuntime.open(fake) as rt:
        if pending:
            rt.bind(StepPlan(1, loads=(TransferSpec(1, "r", Direction.LOAD, [[0]], [[0]]),)))
            rt.launch()
        await anyio.sleep(0.05)
        c0, t0 = time.process_time(), time.perf_counter()
        await anyio.sleep(seconds)
        used = (time.process_time() - c0) / (time.perf_counter() - t0) * 100
        fake.release_all()
    return used


class _TimedHost(HostBackend):
    """Host backend whose copy thread stamps the moment each fence is done (µs clock)."""

    def __init__(self, wake: bool) -> None:
        super().__init__()
        self.wake = wake
        self.done_at: list[int] = []

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        def stamp() -> None:
            self.done_at.append(time.perf_counter_ns())
            if self.wake and wakeup is not None:
                wakeup()

        super().set_wakeup(stamp if wakeup is not None else None)


async def latency(samples: int, wake: bool) -> list[float]:
    """µs from the copy thread finishing a fence to the waiter resuming, on an idle loop."""
    from kvflow.runtime.clock import SystemClock

    backend = _TimedHost(wake)
    backend.register_kv_caches({"kv": torch.zeros(4, 64)}, 4)
    backend.allocate_cpu_tier([4])
    reactor = Reactor(backend, SystemClock())
    out: list[float] = []
    batch = CopyBatch(Direction.STORE, ((1,),), ((2,),))
    async with anyio.create_task_group() as tg:
        tg.start_soon(reactor.run)
        await anyio.sleep(0.01)
        for _ in range(samples):
            await anyio.sleep(0.0005)  # let the loop go idle between samples
            await reactor.wait(backend.submit(batch))
            out.append((time.perf_counter_ns() - backend.done_at[-1]) / 1e3)
        reactor.close()
    backend.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        cache_logger_on_first_use=True,
    )
    torch.set_num_threads(1)
    n = 20_000 if args.quick else 100_000
    console = Console()

    t = Table(title="Runtime overhead per transfer, plan → submitted → reported (fake backend)")
    for col in (
        "transfers/step",
        "coalesced",
        "steps",
        "wall µs/transfer",
        "CPU µs/transfer",
        "transfers/s",
    ):
        t.add_column(col, justify="right")
    for per_step, coalesce, pipelined in [
        (1, True, False),
        (8, True, False),
        (64, True, False),
        (256, True, False),
        (64, False, False),
        (1, True, True),
        (8, True, True),
        (64, True, True),
    ]:
        count = n // (4 if per_step == 1 else 1)
        wall, cpu, rate = anyio.run(overhead, per_step, count, coalesce, pipelined)
        t.add_row(
            str(per_step),
            "yes" if coalesce else "no",
            "pipelined" if pipelined else "flush each",
            f"{wall:.1f}",
            f"{cpu:.1f}",
            f"{rate:,.0f}",
        )
    console.print(t)

    t = Table(
        title="Synchronous facade: one engine step = bind, load, save, flush or not, finish_step"
    )
    for col in ("transfers/step", "steps", "µs/step", "µs/transfer"):
        t.add_column(col, justify="right")
    for per_step, pipelined in [(1, False), (64, False), (1, True), (64, True)]:
        step_us, per_us = sync_overhead(per_step, n // (20 if per_step == 1 else 1), pipelined)
        mode = "pipelined" if pipelined else "flush each"
        t.add_row(str(per_step), mode, f"{step_us:.0f}", f"{per_us:.1f}")
    console.print(t)

    secs = 1.0 if args.quick else 3.0
    t = Table(title=f"Reactor CPU use over {secs:.0f} s wall (process CPU time / wall time)")
    t.add_column("state")
    t.add_column("% of one core", justify="right")
    t.add_row("idle (nothing in flight)", f"{anyio.run(cpu_use, secs, False):.2f}")
    t.add_row(
        "one fence pending (polling at the 1 ms cap)", f"{anyio.run(cpu_use, secs, True):.2f}"
    )
    console.print(t)

    samples = 300 if args.quick else 2000
    t = Table(
        title="Completion latency on an idle loop, copy thread done → waiter resumes (host backend)"
    )
    for col in ("mode", "p50 µs", "p90 µs", "p99 µs", "max µs"):
        t.add_column(col, justify="right")
    for wake in (True, False):
        lat = sorted(anyio.run(latency, samples, wake))
        q = statistics.quantiles(lat, n=100)
        t.add_row(
            "wakeup callback" if wake else "polling only",
            f"{q[49]:.0f}",
            f"{q[89]:.0f}",
            f"{q[98]:.0f}",
            f"{lat[-1]:.0f}",
        )
    console.print(t)


if __name__ == "__main__":
    main()
