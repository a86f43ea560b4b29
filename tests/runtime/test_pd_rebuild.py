"""The PD driver after its peer process died and came back: D's driver (this process, a real
gloo transport and control plane) hands off from a spawned P; P is SIGKILLed in the middle of a
running copy and a new P process takes its control endpoint. D's failed hand-off ends once, as a
miss to recompute (no retry); D's next HELLO finds a new incarnation, the gloo pair is rebuilt
on the rendezvous the new P names, and the next hand-off lands the new P's KV. The other way
round (P's driver here, D restarted) P hosts the new pair where the new D says. A rebuild whose
peer never pairs ends at its deadline. Every wait has a deadline on the clock and an error
naming what it waited for; the leak check runs after each test.
Deselect with ``-m "not distributed"``."""

from __future__ import annotations

import datetime
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
from torch._C._distributed_c10d import TCPStore

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


@pytest.fixture(scope="module", autouse=True)
def _torch_store_pipe() -> None:
    """torch opens a pipe the first time a process hosts a ``TCPStore`` and keeps it for the
    process's life (measured, torch 2.13): open it before the leak check's first snapshot."""
    TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=LIMIT_S))


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


def _peer_main(
    conn: Connection, role: str, bind: str, port: int, value: float, pause_s: float, hello: str
) -> None:
    anyio.run(_serve, conn, role, bind, port, value, pause_s, hello)


async def _serve(
    conn: Connection, role: str, bind: str, port: int, value: float, pause_s: float, hello: str
) -> None:
    """A P or D process: its control plane answers HELLO while its transport pairs (a
    restarted peer can only pair once the survivor learnt of it: a restarted D says HELLO to
    ``hello`` first), then serves the hand-offs the test announces until told to stop. P's KV
    blocks hold ``value`` (so D can tell which P's KV landed); D reports each hand-off's end
    with its blocks 2 and 3."""
    clock = SystemClock()
    mgr: ProducerManager | ConsumerManager
    mgr = (
        ProducerManager("P", timeouts=FAST) if role == "P" else ConsumerManager("D", timeouts=FAST)
    )
    async with open_control_plane(
        role, default_compat(), clock, bind=bind, endpoints=(f"gloo://127.0.0.1:{port}",)
    ) as cp:
        conn.send(("control", cp.address))
        if hello:
            await cp.hello(hello)
        t = await anyio.to_thread.run_sync(_transport, 0 if role == "P" else 1, port, pause_s)
        try:
            kv = torch.full((BLOCKS, ROW), value)
            t.register([[kv]])
            fences: list[tuple[LaunchCopies, Any]] = []

            def apply(actions: list[Action]) -> None:
                for a in actions:
                    if isinstance(a, Send):
                        cp.post(a.peer, a.message)
                    elif isinstance(a, LaunchCopies):
                        fences.append((a, t.launch(a)))
                    elif isinstance(a, FinishedRecving):
                        conn.send(("finished", (a.transfer_id, a.ok, kv[2:4].clone())))

            while True:
                if conn.poll():
                    cmd = conn.recv()
                    if cmd[0] == "stop":
                        return
                    if isinstance(mgr, ProducerManager):
                        apply(mgr.kv_ready(cmd[1], 1, "D", IDS, HASHES, clock.now()))
                    else:
                        await cp.hello(cmd[2])
                        kv.zero_()
                        apply(mgr.reserve(cmd[1], 1, "P", ((2, 3),), (0,), 8, HASHES, clock.now()))
                    conn.send(("ready", cmd[1]))
                try:
                    peer, msg = await cp.recv(0.01, "the peer's messages")
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


class _Peer:
    """A spawned P or D process and the pipe to it; every answer awaited with a deadline."""

    def __init__(
        self,
        role: str,
        port: int,
        value: float = 0.0,
        *,
        bind: str = "tcp://127.0.0.1:0",
        pause_s: float = 0.0,
        hello: str = "",
    ) -> None:
        self.role = role
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc: BaseProcess = mp.get_context("spawn").Process(
            target=_peer_main,
            args=(child, role, bind, port, value, pause_s, hello),
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.address: str = self.answer("control", f"{role}'s control endpoint")

    def answer(self, kind: str, what: str) -> Any:
        if not self.conn.poll(LIMIT_S):
            raise PeerError(f"{self.role} sent no {what} within {LIMIT_S} s")
        got, value = self.conn.recv()
        assert got == kind, (got, value)
        return value

    def ready(self, transfer_id: str, p_address: str = "") -> None:
        """P: the hand-off's KV is ready; D: reserve and claim it from P at ``p_address``."""
        self.conn.send(("go", transfer_id, p_address))
        self.answer("ready", f"the start of {transfer_id}")

    def kill(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(LIMIT_S)
        assert not self.proc.is_alive(), f"{self.role} outlived SIGKILL"
        self.conn.close()

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(LIMIT_S)
        if self.proc.is_alive():
            self.proc.kill()
            raise PeerError(f"{self.role} did not stop within {LIMIT_S} s")
        self.conn.close()


def _end(driver: PDDriver, first: _Peer, second: _Peer | None) -> None:
    """Close this side's driver, stop the restarted peer, kill the first if it still runs."""
    driver.close()
    if second is not None:
        second.stop()
    if first.proc.is_alive():
        first.proc.kill()


def _until(driver: PDDriver, done: Callable[[], bool], what: str) -> None:
    """Poll D's driver until ``done()``, waking on its copies and messages; a deadline."""
    clock = SystemClock()
    deadline = clock.now() + LIMIT_S
    while not done():
        if clock.now() > deadline:
            raise PeerError(f"D did not see {what} within {LIMIT_S} s")
        driver.poll()
        driver.wait(0.05)


def _hand_off(driver: PDDriver, p: _Peer, tid: str, reports: list[FinishedRecving]) -> None:
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
    p1 = _Peer("P", port1, 1.0, bind=bind, pause_s=0.5)
    transport = _transport(1, port1, 0.0)  # pairs with P1 (both block until the other came)
    driver = PDDriver(ConsumerManager("D", timeouts=FAST), default_compat(), transport)
    p2: _Peer | None = None
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
            p2 = _Peer("P", port2, 2.0, bind=bind)
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
        _end(driver, p1, p2)


def test_a_restart_the_transport_cannot_rebuild_is_logged_and_hand_offs_fail_fast() -> None:
    """A new P whose gloo rendezvous never comes (it names a port nobody serves): D's rebuild
    ends at its deadline with the failure logged, and the transport stays broken: a launch
    fails at once (its request is recomputed), nothing waits without a deadline."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    port1 = free_port()
    kv = torch.zeros(BLOCKS, ROW)
    reports: list[FinishedRecving] = []
    p1 = _Peer("P", port1, 1.0, bind=bind)
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


def test_a_restarted_d_gets_the_pair_rebuilt_and_hand_offs_resume() -> None:
    """The other side: P's driver here, D1 spawned. D1 takes a hand-off and is SIGKILLed; P
    finds it lost. D2 says HELLO (a new incarnation, naming a new rendezvous): P fails what was
    D1's, hosts the new pair there, and the next hand-off carries P's KV into D2's blocks."""
    port1, port2 = free_port(), free_port()
    kv = torch.full((BLOCKS, ROW), 1.0)
    d1 = _Peer("D", port1)
    transport = _transport(0, port1, 0.0)  # pairs with D1
    driver = PDDriver(ProducerManager("P", timeouts=FAST), default_compat(), transport)
    mgr = driver.manager
    assert isinstance(mgr, ProducerManager)
    d2: _Peer | None = None
    try:
        transport.register([[kv]])

        def hand_off(d: _Peer, tid: str) -> tuple[str, bool, torch.Tensor]:
            driver.apply(mgr.kv_ready(tid, 1, "D", IDS, HASHES, driver.now()))
            d.ready(tid, driver.address)
            got: list[Any] = []

            def finished() -> bool:
                if d.conn.poll():
                    got.append(d.answer("finished", f"the end of {tid}"))
                return bool(got) and not mgr.num_live

            _until(driver, finished, f"D's end of {tid}")
            return got[0]  # type: ignore[no-any-return]

        tid, ok, blocks = hand_off(d1, "h1")
        assert (tid, ok) == ("h1", True)
        assert torch.equal(blocks, torch.full((2, ROW), 1.0))
        with capture_logs() as logs:
            d1.kill()
            _until(driver, lambda: driver.control.peer("D") is None, "D1's connection drop")
            d2 = _Peer("D", port2, hello=driver.address)
            _until(driver, lambda: driver.rebuilds == 1, "the pair rebuilt with D2")
        events = [e["event"] for e in logs]
        assert "pd_peer_disconnected" in events
        assert "pd_peer_restarted" in events
        assert transport.address == ("127.0.0.1", port2)
        kv.fill_(2.0)
        tid, ok, blocks = hand_off(d2, "h3")
        assert (tid, ok) == ("h3", True)
        assert torch.equal(blocks, torch.full((2, ROW), 2.0))  # through the new pair
        assert transport.broken is None
    finally:
        _end(driver, d1, d2)
