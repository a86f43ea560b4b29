"""The PD driver after its peer process died and came back: D's driver (this process, a real
gloo transport and control plane) hands off from a spawned P; P is SIGKILLed in the middle of a
running copy and a new P process takes its control endpoint. D's failed hand-off ends once, as a
miss to recompute (no retry); D's next HELLO finds a new incarnation, the gloo pair is rebuilt
on the rendezvous the new P names, and the next hand-off lands the new P's KV. Every wait has a
deadline on the clock and an error naming what it waited for; the leak check runs after.
Deselect with ``-m "not distributed"``."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import anyio
import pytest
import torch
from structlog.testing import capture_logs
from tests.core.pd_world import prompt_hashes
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

from kvflow.backends.base import FenceStatus
from kvflow.backends.pd.gloo import GlooTransport
from kvflow.core.pd.common import Action, FinishedRecving, LaunchCopies, PDTimeouts, Send
from kvflow.core.pd.consumer import ConsumerManager
from kvflow.core.pd.producer import ProducerManager
from kvflow.engine.distributed import free_port
from kvflow.errors import PeerError
from kvflow.runtime.clock import SystemClock
from kvflow.runtime.pd_control import default_compat, open_control_plane
from kvflow.runtime.pd_driver import PDDriver

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("no_leaks")]
resource_tracker.ensure_running()  # spawn's helper process: its pipe is not a test's leak

BLOCKS, ROW = 8, 64  # one group of 8 blocks of 64 floats (256 B): one block per staging slot
HASHES = prompt_hashes(1, 2)
IDS = ((0, 1),)  # P's blocks of every hand-off; D reserves blocks 2 and 3
FAST = PDTimeouts(lease_s=10, claim_s=3, grant_window_s=1, copy_s=3, heartbeat_s=0.2,
                  peer_timeout_s=1, drain_retry_s=0.2)  # fmt: skip
LIMIT_S = 30.0  # each wait's deadline: P's start, a hand-off's end, P's answer


def _transport(rank: int, port: int, pause_s: float) -> GlooTransport:
    return GlooTransport(
        pair_rank=rank,
        host="127.0.0.1",
        port=port,
        timeout_s=10.0,
        slots=2,
        slot_bytes=ROW * 4,
        direct_min_bytes=None,
        send_pause_s=pause_s,
    )


def _p_main(conn: Connection, bind: str, port: int, value: float, pause_s: float) -> None:
    anyio.run(_p_serve, conn, bind, port, value, pause_s)


async def _p_serve(conn: Connection, bind: str, port: int, value: float, pause_s: float) -> None:
    """A P process: its control plane answers HELLO while its transport pairs (a restarted P
    can only pair once D learnt of it), then serves hand-offs the test announces until told
    to stop. Its KV blocks hold ``value`` (so D can tell which P's KV landed)."""
    clock = SystemClock()
    mgr = ProducerManager("P", timeouts=FAST)
    async with open_control_plane(
        "P", default_compat(), clock, bind=bind, endpoints=(f"gloo://127.0.0.1:{port}",)
    ) as cp:
        conn.send(("control", cp.address))
        t = await anyio.to_thread.run_sync(_transport, 0, port, pause_s)
        try:
            t.register([[torch.full((BLOCKS, ROW), value)]])
            fences: list[tuple[LaunchCopies, Any]] = []

            def apply(actions: list[Action]) -> None:
                for a in actions:
                    if isinstance(a, Send):
                        cp.post(a.peer, a.message)
                    elif isinstance(a, LaunchCopies):
                        fences.append((a, t.launch(a)))

            while True:
                if conn.poll():
                    cmd = conn.recv()
                    if cmd[0] == "stop":
                        return
                    apply(mgr.kv_ready(cmd[1], 1, "D", IDS, HASHES, clock.now()))
                    conn.send(("ready", cmd[1]))
                try:
                    peer, msg = await cp.recv(0.01, "D's messages")
                    apply(mgr.on_message(peer, msg, clock.now()))
                except PeerError:
                    pass  # nothing came in this turn: look at the fences and the timers
                for op, fence in list(fences):
                    status = t.query(fence)
                    if status is not FenceStatus.PENDING:
                        fences.remove((op, fence))
                        ok = status is FenceStatus.DONE
                        apply(mgr.copy_done(op.transfer_id, op.epoch, 0, ok, clock.now()))
                apply(mgr.tick(clock.now()))
        finally:
            t.close()


class _P:
    """A spawned P process and the pipe to it; every answer awaited with a deadline."""

    def __init__(self, bind: str, port: int, value: float, pause_s: float = 0.0) -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc: BaseProcess = mp.get_context("spawn").Process(
            target=_p_main, args=(child, bind, port, value, pause_s), daemon=True
        )
        self.proc.start()
        child.close()
        self.address: str = self.answer("control", "P's control endpoint")

    def answer(self, kind: str, what: str) -> Any:
        if not self.conn.poll(LIMIT_S):
            raise PeerError(f"P sent no {what} within {LIMIT_S} s")
        got, value = self.conn.recv()
        assert got == kind, (got, value)
        return value

    def ready(self, transfer_id: str) -> None:
        self.conn.send(("kv_ready", transfer_id))
        self.answer("ready", f"kv_ready of {transfer_id}")

    def kill(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(LIMIT_S)
        assert not self.proc.is_alive(), "P outlived SIGKILL"
        self.conn.close()

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(LIMIT_S)
        if self.proc.is_alive():
            self.proc.kill()
            raise PeerError(f"P did not stop within {LIMIT_S} s")
        self.conn.close()


def _until(driver: PDDriver, done: Callable[[], bool], what: str) -> None:
    """Poll D's driver until ``done()``, waking on its copies and messages; a deadline."""
    clock = SystemClock()
    deadline = clock.now() + LIMIT_S
    while not done():
        if clock.now() > deadline:
            raise PeerError(f"D did not see {what} within {LIMIT_S} s")
        driver.poll()
        driver.wait(0.05)


def _hand_off(driver: PDDriver, p: _P, tid: str, reports: list[FinishedRecving]) -> None:
    """D reserves blocks 2 and 3 for P's ``tid`` and polls until it finished (either way)."""
    driver.connect(p.address)  # a restarted P pairs its transport only after this
    p.ready(tid)
    mgr = driver.manager
    assert isinstance(mgr, ConsumerManager)
    driver.apply(mgr.reserve(tid, 1, "P", ((2, 3),), (0,), 8, HASHES, driver.now()))

    def finished() -> bool:
        reports.extend(r for r in driver.take_reports() if isinstance(r, FinishedRecving))
        return any(r.transfer_id == tid for r in reports)

    _until(driver, finished, f"the end of hand-off {tid}")


def test_a_restarted_p_gets_the_pair_rebuilt_and_hand_offs_resume() -> None:
    """P1 serves a hand-off, is SIGKILLed while its second one's copy runs (that one fails
    once: a miss, no retry); P2 binds P1's endpoint with a new gloo rendezvous; D's next
    HELLO sees a new incarnation, rebuilds the pair there, and the next hand-off carries P2's
    KV into D's blocks. D ends with no live hand-off and its transport whole."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    port1, port2 = free_port(), free_port()
    kv = torch.zeros(BLOCKS, ROW)
    reports: list[FinishedRecving] = []
    p1 = _P(bind, port1, 1.0, pause_s=0.5)
    transport = _transport(1, port1, 0.0)  # pairs with P1 (both block until the other came)
    driver = PDDriver(ConsumerManager("D", timeouts=FAST), default_compat(), transport)
    p2: _P | None = None
    try:
        transport.register([[kv]])
        _hand_off(driver, p1, "h1", reports)
        assert reports[-1].ok
        assert torch.equal(kv[2:4], torch.full((2, ROW), 1.0))
        # h2: P1's first block lands, then it pauses: kill it mid-copy.
        kv.zero_()
        p1.ready("h2")
        mgr = driver.manager
        assert isinstance(mgr, ConsumerManager)
        driver.apply(mgr.reserve("h2", 1, "P", ((2, 3),), (0,), 8, HASHES, driver.now()))
        _until(driver, lambda: bool(kv[2].any()), "h2's first block land")
        with capture_logs() as logs:
            p1.kill()
            _until(driver, lambda: driver.control.peer("P") is None, "P1's connection drop")

            def h2_done() -> bool:
                reports.extend(r for r in driver.take_reports() if isinstance(r, FinishedRecving))
                return any(r.transfer_id == "h2" for r in reports) and not mgr.num_live

            _until(driver, h2_done, "h2 fail")
            assert [r.ok for r in reports if r.transfer_id == "h2"] == [False]
            p2 = _P(bind, port2, 2.0)
            _hand_off(driver, p2, "h3", reports)
        events = [e["event"] for e in logs]
        assert "pd_peer_disconnected" in events
        assert "pd_peer_restarted" in events
        assert driver.rebuilds == 1
        assert transport.address == ("127.0.0.1", port2)
        assert [r.ok for r in reports] == [True, False, True]  # h2 failed once, never retried
        assert torch.equal(kv[2:4], torch.full((2, ROW), 2.0))  # P2's KV, through the new pair
        assert transport.broken is None
        assert not mgr.num_live
    finally:
        driver.close()
        if p2 is not None:
            p2.stop()
        if p1.proc.is_alive():
            p1.proc.kill()


def test_a_restart_the_transport_cannot_rebuild_is_logged_and_hand_offs_fail_fast() -> None:
    """A new P whose gloo rendezvous never comes (it names a port nobody serves): D's rebuild
    ends at its deadline with the failure logged, and the transport stays broken: a launch
    fails at once (its request is recomputed), nothing waits without a deadline."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    port1 = free_port()
    kv = torch.zeros(BLOCKS, ROW)
    reports: list[FinishedRecving] = []
    p1 = _P(bind, port1, 1.0)
    transport = _transport(1, port1, 0.0)
    driver = PDDriver(
        ConsumerManager("D", timeouts=FAST), default_compat(), transport, rebuild_wait_s=1.0
    )
    try:
        transport.register([[kv]])
        _hand_off(driver, p1, "h1", reports)
        p1.stop()
        _until(driver, lambda: driver.control.peer("P") is None, "P1's connection drop")
        ctx = mp.get_context("spawn")
        # A P2 that binds the endpoint and answers HELLO but never pairs: a control plane alone.
        here, there = ctx.Pipe()
        lone = ctx.Process(target=_lone_main, args=(there, bind, free_port()), daemon=True)
        lone.start()
        there.close()
        try:
            assert here.poll(LIMIT_S), "the lone P did not start"
            here.recv()
            with capture_logs() as logs:
                driver.connect(bind)
            assert [e["event"] for e in logs if e["event"].startswith("pd_rebuild")] == [
                "pd_rebuild_failed"
            ]
            assert transport.broken is not None
            assert driver.rebuilds == 0
            fence = transport.launch(LaunchCopies("h2", 1, "P", False, (((2, 0),),), 1))
            assert transport.query(fence) is FenceStatus.FAILED
        finally:
            here.send("stop")
            lone.join(LIMIT_S)
            if lone.is_alive():
                lone.kill()
            here.close()
    finally:
        driver.close()


def _lone_main(conn: Connection, bind: str, port: int) -> None:
    anyio.run(_lone, conn, bind, port)


async def _lone(conn: Connection, bind: str, port: int) -> None:
    async with open_control_plane(
        "P", default_compat(), SystemClock(), bind=bind, endpoints=(f"gloo://127.0.0.1:{port}",)
    ) as cp:
        conn.send(cp.address)
        with anyio.fail_after(LIMIT_S):
            await anyio.to_thread.run_sync(functools.partial(conn.poll, LIMIT_S))
