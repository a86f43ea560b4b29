"""The PD runtime driver of one engine: its control plane, its transport and its hand-off manager,
stepped inline from the engine's own calls (like ``InlineSyncWorker``).

The control plane's zmq receive loop runs on an anyio loop in one portal thread; everything else
runs on the caller's thread when the engine calls ``poll`` (messages → ``on_message``, settled
fences → ``copy_done``, the manager's timers → ``tick``) and carries out the actions that come
back. The engine's thread reads the plane's inbox and sends on it directly (both are safe from
any thread), so a hand-off's messages cost no hop to the portal's thread; what one ``poll``
says to a peer goes as one zmq message at its end, and an arriving message wakes ``wait``. The
reports the engine acts on (``FinishedSending``, ``FinishedRecving``, ``FreeBlocks``) are
queued for ``take_reports``. Every wait is bounded: HELLO by the control plane's timeout, a
rebuild by ``rebuild_wait_s``, ``wait`` by its argument, and every hand-off by its manager's
deadlines; a send never waits.

A peer whose connection drops is lost: its hand-offs fail or drain (``peer_lost``: the engine
recomputes them, once) and its cached HELLO is gone. A peer that says HELLO as a new process (a
new incarnation under its engine id: it restarted, or another process took its endpoint) gets
the same, and then the transport's pair is rebuilt on the rendezvous address the new process
names in its HELLO (``gloo://host:port``), synchronously, within ``rebuild_wait_s``; hand-offs
after it use the new pair. A rebuild that fails is logged and leaves the transport broken:
every later launch fails at once and its request is recomputed, no hand-off waits on it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import attrs
from anyio.from_thread import BlockingPortal, start_blocking_portal

from kvflow.backends.base import Fence, FenceStatus
from kvflow.backends.pd.transport import KVTransport
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import (
    Action,
    CancelCopies,
    FinishedRecving,
    FinishedSending,
    FreeBlocks,
    LaunchCopies,
    Send,
)
from kvflow.core.pd.consumer import ConsumerManager
from kvflow.core.pd.machines import CONSUMER_TERMINAL, PRODUCER_TERMINAL
from kvflow.core.pd.messages import Compat
from kvflow.core.pd.producer import ProducerManager
from kvflow.errors import ConfigError, KVFlowError
from kvflow.runtime.clock import Clock, SystemClock
from kvflow.runtime.pd_control import ControlPlane, PeerInfo, open_control_plane

log = get_logger("kvflow.pd")

FENCE_POLL_S = 2e-4
"""How often ``PDDriver.wait`` looks at in-flight copies' fences (polled transports)."""

Report = FinishedSending | FinishedRecving | FreeBlocks


class PDDriver:
    """One engine's PD side: ``manager`` (a ``ProducerManager`` or ``ConsumerManager``), its
    control plane and its transport (rank 0 only: TP > 1 is not wired yet)."""

    def __init__(
        self,
        manager: ProducerManager | ConsumerManager,
        compat: Compat,
        transport: KVTransport,
        *,
        clock: Clock | None = None,
        bind: str = "tcp://127.0.0.1:0",
        hello_timeout_s: float = 5.0,
        pump: Callable[[float], object] | None = None,
        endpoints: tuple[str, ...] | None = None,
        rebuild_wait_s: float = 30.0,
    ) -> None:
        if not rebuild_wait_s > 0:
            raise ConfigError(f"rebuild_wait_s must be positive, got {rebuild_wait_s!r}")
        if endpoints is None:
            # The transport's own rendezvous, for a peer that must rebuild the pair with it.
            at = getattr(transport, "address", None)
            endpoints = (f"gloo://{at[0]}:{at[1]}",) if isinstance(at, tuple) else ()
        self.manager = manager
        self.transport = transport
        self.clock: Clock = clock or SystemClock()
        self._pump = pump  # a fake link's step: tests move its packets on the engine's calls
        self._fences: list[tuple[LaunchCopies, Fence]] = []
        self._launched_at: dict[int, float] = {}  # id(fence) → when the send was launched
        self._reports: list[Report] = []
        self._wake = threading.Event()
        self.bytes_moved = 0
        self.send_seconds = 0.0  # sends: launch → seen settled (a floor on their speed)
        self.block_bytes: list[int] = []  # per group, set once the KV tensors are registered
        self.rebuild_wait_s = rebuild_wait_s
        self.rebuilds = 0  # the transport's pair rebuilt for a restarted peer
        self._held: dict[str, list[Send]] | None = None  # sends held to the end of ``poll``
        self._closed = False
        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._cp_cm: AbstractContextManager[ControlPlane] = (
                self._portal.wrap_async_context_manager(
                    open_control_plane(
                        manager.engine_id,
                        compat,
                        self.clock,
                        bind=bind,
                        hello_timeout_s=hello_timeout_s,
                        endpoints=endpoints,
                    )
                )
            )
            self.control = self._cp_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        transport.set_wakeup(self._wake.set)
        self.control.on_arrival = self._wake.set

    @property
    def address(self) -> str:
        """This engine's control-plane endpoint (what a peer's HELLO goes to)."""
        return self.control.address

    @property
    def engine_id(self) -> str:
        return self.manager.engine_id

    def connect(self, address: str) -> PeerInfo:
        """HELLO with the peer at ``address`` unless cached; ``PeerError`` within the timeout.
        A peer found restarted has its old hand-offs failed and the pair rebuilt first."""
        info: PeerInfo = self._call(self.control.hello, address)
        self._peer_events()
        return info

    def _peer_events(self) -> None:
        lost, restarted = self.control.take_peer_events()
        for peer in (*lost, *restarted):
            self.apply(self.manager.peer_lost(peer, self.clock.now()))
        for peer in restarted:
            self._rebuild(peer)

    def _rebuild(self, peer: str) -> None:
        """The transport's pair anew, on the rendezvous the restarted ``peer`` named (bounded
        by ``rebuild_wait_s``); a failure is logged and leaves the transport broken."""
        rebuild = getattr(self.transport, "rebuild", None)
        info = self.control.peer(peer)
        at = _rendezvous(info.endpoints) if info is not None else None
        if rebuild is None or at is None:
            log.warning("pd_rebuild_skipped", peer=peer, transport=type(self.transport).__name__)
            return
        try:
            rebuild(host=at[0], port=at[1], wait_s=self.rebuild_wait_s)
        except KVFlowError as e:
            log.warning("pd_rebuild_failed", peer=peer, error=str(e))
            return
        self.rebuilds += 1
        log.info("pd_transport_rebuilt_for_peer", peer=peer, host=at[0], port=at[1])

    def now(self) -> float:
        return self.clock.now()

    def apply(self, actions: list[Action]) -> None:
        """Carry out a manager's actions: send, launch, cancel; queue the engine's reports."""
        sends: list[Send] = []  # consecutive sends to one peer go as one zmq message
        for a in actions:
            if isinstance(a, Send):
                if self._held is not None:
                    self._held.setdefault(a.peer, []).append(a)
                    continue
                if sends and sends[0].peer != a.peer:
                    self._post(sends)
                sends.append(a)
                continue
            self._post(sends)
            if isinstance(a, LaunchCopies):
                fence = self.transport.launch(a)
                self._fences.append((a, fence))
                if a.send:
                    self.bytes_moved += self._bytes_of(a)
                    self._launched_at[id(fence)] = self.clock.now()
            elif isinstance(a, CancelCopies):
                for op, fence in self._fences:
                    if (op.transfer_id, op.epoch) == (a.transfer_id, a.epoch):
                        self.transport.cancel(fence)
            else:
                self._reports.append(a)
        self._post(sends)

    def _post(self, sends: list[Send]) -> None:
        if not sends:
            return
        try:
            self.control.post(sends[0].peer, *(s.message for s in sends))
        except KVFlowError as e:
            # A peer without HELLO (gone, or never met): the manager's timers decide.
            log.warning("pd_send_failed", peer=sends[0].peer, error=str(e))
        sends.clear()

    def poll(self) -> None:
        """Deliver what arrived, report settled copies, fire due timers (never blocks)."""
        if self._closed:
            return
        now = self.clock.now()
        if self._pump is not None:
            self._pump(now)
        self._peer_events()
        # What one poll says to a peer (P's GRANTs and DONEs of every claim that came in) goes
        # as one zmq message at its end: the peer sees the whole turn at once.
        self._held = {}
        try:
            while (got := self.control.recv_nowait()) is not None:
                self.apply(self.manager.on_message(got[0], got[1], now))
            for op, fence in list(self._fences):
                status = self.transport.query(fence)
                if status is not FenceStatus.PENDING:
                    self._fences.remove((op, fence))
                    started = self._launched_at.pop(id(fence), None)
                    if started is not None:
                        self.send_seconds += now - started
                    ok = status is FenceStatus.DONE
                    done = self.manager.copy_done(op.transfer_id, op.epoch, 0, ok, now, op.channel)
                    self.apply(done)
            self.apply(self.manager.tick(now))
        finally:
            held, self._held = self._held, None
            for sends in held.values():
                self._post(sends)

    def take_reports(self) -> list[Report]:
        out, self._reports = self._reports, []
        return out

    def unarmed_timers(self) -> list[str]:
        """The live hand-offs in a non-terminal state without a deadline due within the longest
        timeout from now (empty when every one of them will be settled by a timer)."""
        now = self.clock.now()
        terminal = PRODUCER_TERMINAL | CONSUMER_TERMINAL
        longest = max(*attrs.astuple(self.manager.timeouts), self.manager.timeouts.quarantine_s)
        out = []
        for tid, t in self.manager.transfers.items():
            bound = now + max(longest, getattr(t, "claim_s", 0.0))
            if t.state not in terminal and not (math.isfinite(t.deadline) and t.deadline <= bound):
                out.append(f"{tid} in {t.state.value}: deadline {t.deadline}")
        return out

    def busy(self) -> bool:
        """Hand-offs live, copies running or reports not yet taken."""
        return bool(self.manager.num_live or self._fences or self._reports)

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for a copy to settle or a peer's message to arrive; at once
        when no hand-off is live. With copies in flight on a transport whose fences do not
        wake it (``pushes_completions`` false: CUDA IPC, NIXL) the fences are looked at every
        ``FENCE_POLL_S``; an idle engine would otherwise see a settled copy (and CUDA IPC's
        initiator its peer's token) only at the end of the whole wait. True when the engine
        should step now (a message or wake-up came, a fence settled, or, with nothing live,
        reports wait to be taken), False at the timeout or when idle."""
        if not (self._fences or self.manager.num_live):
            return bool(self._reports)
        woke = False
        if not self._fences or self.transport.pushes_completions:
            woke = self._wake.wait(timeout_s)
            self._wake.clear()
            return woke
        for _ in range(max(1, math.ceil(timeout_s / FENCE_POLL_S))):
            if self._wake.wait(FENCE_POLL_S) or any(
                self.transport.query(f) is not FenceStatus.PENDING for _, f in self._fences
            ):
                woke = True
                break
        self._wake.clear()
        return woke

    def close(self) -> None:
        """Stop the transport, the control plane and its thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.transport.close()
        finally:
            try:
                self._cp_cm.__exit__(None, None, None)
            finally:
                self._portal_cm.__exit__(None, None, None)

    def _bytes_of(self, op: LaunchCopies) -> int:
        per_block = self.block_bytes
        return sum(
            len(pairs) * per_block[g] for g, pairs in enumerate(op.pairs) if g < len(per_block)
        )

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._portal.call(fn, *args)


def _rendezvous(endpoints: tuple[str, ...]) -> tuple[str, int] | None:
    """``(host, port)`` of the first ``gloo://host:port`` endpoint, if any."""
    for e in endpoints:
        scheme, _, rest = e.partition("://")
        host, _, port = rest.rpartition(":")
        if scheme == "gloo" and host and port.isdigit():
            return host, int(port)
    return None


__all__ = ["PDDriver", "Report"]
