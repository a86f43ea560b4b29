"""Benchmark the PD control plane: cost per hand-off with the peer's HELLO cached.

Usage: python scripts/bench_pd_control.py [--handoffs N] [--warmup N] [--json FILE]
Goal (issue 21): <= 1 ms per hand-off.

P runs in a spawned process (its ``ProducerManager`` behind a ``ControlPlane``), D in this one
(its ``ConsumerManager`` behind another). Each hand-off is D's reserve → CLAIM → P's GRANT and
DONE → D's commit and DONE → P's release, sequential, copies completing at once (no data plane):
what is timed is D's reserve → commit, i.e. managers, msgspec, zmq and the deadline waits. Two
ways on D: a task on the control plane's own loop (``plane``), and the engine's path (``driver``:
a ``PDDriver`` stepped from this thread as the engine's idle loop does, ``poll`` then ``wait``
of the engine's idle wait). The floor next to them is a raw zmq DEALER → ROUTER echo of one
small frame. The script also runs against an older tree's ``kvflow`` (one without ``post``), so
old and new code can be timed by the same harness.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import structlog
import zmq
import zmq.asyncio
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvflow.backends.base import Fence, FenceStatus
from kvflow.core.hashing import hash_blocks
from kvflow.core.pd.common import (
    Action,
    FinishedRecving,
    FinishedSending,
    LaunchCopies,
    PDTimeouts,
    Send,
)
from kvflow.core.pd.consumer import ConsumerManager
from kvflow.core.pd.messages import Message
from kvflow.core.pd.producer import ProducerManager
from kvflow.engine.engine import IDLE_WAIT_S
from kvflow.runtime.clock import SystemClock
from kvflow.runtime.pd_control import ControlPlane, default_compat, open_control_plane
from kvflow.runtime.pd_driver import PDDriver

BLOCKS = 4
HASHES = tuple(hash_blocks(list(range(BLOCKS * 16)), 16))
LONG = PDTimeouts(
    lease_s=600, claim_s=60, grant_window_s=60, copy_s=60, done_s=60, peer_timeout_s=600
)


async def _run_actions(
    cp: ControlPlane,
    mgr: ProducerManager | ConsumerManager,
    actions: list[Action],
    now: float,
    keep: dict[str, list[Message]] | None = None,
) -> list[Action]:
    """Send what is to be sent (what this turn says to a peer, as one zmq message) or add it
    to ``keep`` for the caller to send; complete launched copies at once; return the reports."""
    reports: list[Action] = []
    sends: dict[str, list[Message]] = {} if keep is None else keep
    todo = list(actions)
    while todo:
        a = todo.pop(0)
        if isinstance(a, Send):
            sends.setdefault(a.peer, []).append(a.message)
        elif isinstance(a, LaunchCopies):
            todo.extend(mgr.copy_done(a.transfer_id, a.epoch, 0, True, now))
        else:
            reports.append(a)
    if keep is None:
        await _post(cp, sends)
    return reports


async def _post(cp: ControlPlane, sends: dict[str, list[Message]]) -> None:
    for peer, msgs in sends.items():
        if hasattr(cp, "post"):
            cp.post(peer, *msgs)
        else:  # an older tree: ``send`` queues, its flush task sends the turn's messages
            for m in msgs:
                await cp.send(peer, m)
    sends.clear()


class _Instant:
    """A data plane whose copies are done when launched (the driver rows time control only)."""

    name = "instant"
    pushes_completions = False

    def register(self, groups: object) -> None:
        del groups

    def launch(self, op: LaunchCopies) -> Fence:
        return _DONE

    def query(self, fence: Fence) -> FenceStatus:
        return FenceStatus.DONE

    def cancel(self, fence: Fence) -> None:
        del fence

    def set_wakeup(self, wakeup: object) -> None:
        del wakeup

    def close(self) -> None:
        pass


_DONE: Fence = object()


async def _producer(conn: Connection, total: int) -> None:
    clock = SystemClock()
    mgr = ProducerManager("P", timeouts=LONG)
    ctx = zmq.asyncio.Context()
    echo = ctx.socket(zmq.ROUTER)
    echo.setsockopt(zmq.LINGER, 0)
    port = echo.bind_to_random_port("tcp://127.0.0.1")
    async with open_control_plane("P", default_compat(), clock) as cp:
        for i in range(2 * total):
            ids = (tuple(range(i * BLOCKS, (i + 1) * BLOCKS)),)
            mgr.kv_ready(f"h{i}", 1, "D", ids, HASHES, clock.now())
        conn.send((cp.address, f"tcp://127.0.0.1:{port}"))
        while True:  # the raw echo first, until D says stop
            ident, frame = await echo.recv_multipart()
            if frame == b"stop":
                break
            await echo.send_multipart([ident, frame])
        released = 0
        cpu0 = time.process_time()
        while released < 2 * total:  # the plane's hand-offs, then the driver's
            peer, msg = await cp.recv(60.0, "D's claims and DONEs")
            done = await _run_actions(cp, mgr, mgr.on_message(peer, msg, clock.now()), clock.now())
            released += sum(isinstance(a, FinishedSending) for a in done)
    cpu = time.process_time() - cpu0
    echo.close(linger=0)
    ctx.term()
    conn.send((released, cpu))


def _producer_entry(conn: Connection, total: int) -> None:
    logging.disable(logging.CRITICAL)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    anyio.run(_producer, conn, total)


async def _consumer(
    address: str, echo: str, warmup: int, n: int, progress: Progress
) -> dict[str, Any]:
    clock = SystemClock()
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(echo)
    rtt = []
    raw_cpu0 = 0.0
    for i in range(warmup + n):
        if i == warmup:
            raw_cpu0 = time.process_time()
        t0 = time.perf_counter()
        await raw.send(b"x" * 48)
        await raw.recv()
        if i >= warmup:
            rtt.append(time.perf_counter() - t0)
    raw_cpu = time.process_time() - raw_cpu0
    await raw.send(b"stop")
    raw.close(linger=0)
    ctx.term()
    mgr = ConsumerManager("D", timeouts=LONG)
    lat = []
    task = progress.add_task("hand-offs", total=warmup + n)
    cpu0 = 0.0
    carry: dict[str, list[Message]] = {}
    async with open_control_plane("D", default_compat(), clock) as cp:
        await cp.hello(address)
        for i in range(warmup + n):
            if i == warmup:
                cpu0 = time.process_time()
            t0 = time.perf_counter()
            todo = mgr.reserve(f"h{i}", 1, "P", ((0, 1, 2, 3),), (0,), 64, HASHES, clock.now())
            while True:
                reports = await _run_actions(cp, mgr, todo, clock.now(), carry)
                if any(isinstance(r, FinishedRecving) and r.ok for r in reports):
                    break  # D's DONE goes with the next CLAIM, one zmq message (one turn)
                await _post(cp, carry)
                peer, msg = await cp.recv(30.0, f"P's answer for h{i}")
                todo = mgr.on_message(peer, msg, clock.now())
            if i >= warmup:
                lat.append(time.perf_counter() - t0)
            progress.advance(task)
        await _post(cp, carry)
    return {
        "handoff_s": lat,
        "raw_rtt_s": rtt,
        "cpu_s": time.process_time() - cpu0,
        "raw_cpu_s": raw_cpu,
    }


def _consumer_driver(
    address: str, first: int, warmup: int, n: int, progress: Progress
) -> dict[str, Any]:
    """D on the engine's path: a ``PDDriver`` stepped from this thread, hand-offs ``h{first}`` on."""
    mgr = ConsumerManager("D", timeouts=LONG)
    driver = PDDriver(mgr, default_compat(), _Instant())
    lat = []
    task = progress.add_task("hand-offs (driver)", total=warmup + n)
    cpu0 = 0.0
    try:
        driver.connect(address)
        for i in range(warmup + n):
            if i == warmup:
                cpu0 = time.process_time()
            t0 = time.perf_counter()
            tid = f"h{first + i}"
            driver.apply(mgr.reserve(tid, 1, "P", ((0, 1, 2, 3),), (0,), 64, HASHES, driver.now()))
            deadline = driver.now() + 30.0
            while not any(isinstance(r, FinishedRecving) and r.ok for r in driver.take_reports()):
                if driver.now() > deadline:
                    raise SystemExit(f"bench_pd_control: {tid} did not finish within 30 s")
                driver.wait(IDLE_WAIT_S)
                driver.poll()
            if i >= warmup:
                lat.append(time.perf_counter() - t0)
            progress.advance(task)
        return {"handoff_s": lat, "cpu_s": time.process_time() - cpu0}
    finally:
        driver.close()


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--handoffs", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    total = args.warmup + args.handoffs
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_producer_entry, args=(there, total), daemon=True)
    proc.start()
    try:
        if not here.poll(60):
            raise SystemExit("bench_pd_control: the producer process did not start within 60 s")
        address, echo = here.recv()
        with Progress(transient=True) as progress:
            res = anyio.run(_consumer, address, echo, args.warmup, args.handoffs, progress)
            res_d = _consumer_driver(address, total, args.warmup, args.handoffs, progress)
        released, p_cpu = here.recv() if here.poll(60) else (-1, float("nan"))
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    h, r, hd = res["handoff_s"], res["raw_rtt_s"], res_d["handoff_s"]
    figures: dict[str, Any] = {
        "machine": platform.node(),
        "python": platform.python_version(),
        "handoffs": args.handoffs,
        "released_on_p": released,
        "d_cpu_us_per_handoff": res["cpu_s"] / len(h) * 1e6,
        "d_cpu_us_per_handoff_driver": res_d["cpu_s"] / len(hd) * 1e6,
        # P's CPU covers both passes and their warm-ups.
        "p_cpu_us_per_handoff": p_cpu / (2 * total) * 1e6,
        "d_cpu_us_per_raw_rtt": res["raw_cpu_s"] / len(r) * 1e6,
        "load_average_1m": os.getloadavg()[0],
    }
    rows = (
        ("hand-off, D on the plane's loop", "handoff_us", h, "d_cpu_us_per_handoff"),
        (
            "hand-off, D through the PDDriver",
            "handoff_us_driver",
            hd,
            "d_cpu_us_per_handoff_driver",
        ),
        ("raw zmq DEALER→ROUTER echo (floor)", "raw_zmq_rtt_us", r, "d_cpu_us_per_raw_rtt"),
    )
    table = Table(title=f"PD control plane, {args.handoffs} sequential hand-offs (HELLO cached)")
    for col in ("what", "p50 µs", "p90 µs", "p99 µs", "mean µs", "D CPU µs"):
        table.add_column(col, justify="right" if col != "what" else "left")
    for label, key, xs, cpu in rows:
        for q, name in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
            figures[f"{key}_{name}"] = _q(xs, q) * 1e6
        figures[f"{key}_mean"] = statistics.fmean(xs) * 1e6
        table.add_row(
            label,
            *(f"{figures[f'{key}_{c}']:.0f}" for c in ("p50", "p90", "p99", "mean")),
            f"{figures[cpu]:.0f}",
        )
    figures["handoffs_per_s"] = len(h) / sum(h)
    Console().print(table)
    print(
        f"P's CPU per hand-off {figures['p_cpu_us_per_handoff']:.0f} µs (both passes); load "
        f"average {figures['load_average_1m']:.1f}; P released {released} of {2 * total}"
    )
    for key in ("handoff_us", "handoff_us_driver"):
        met = all(figures[f"{key}_{c}"] <= 1000 for c in ("p50", "mean"))
        print(f"goal <= 1000 µs per hand-off ({key}): {'met' if met else 'NOT met'} (p50 and mean)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
