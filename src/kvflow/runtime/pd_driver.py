"""The PD runtime driver of one engine: its control plane, its transport and its hand-off manager,
stepped inline from the engine's own calls (like ``InlineSyncWorker``).

The control plane's zmq receive loop runs on an anyio loop in one portal thread; everything else
runs on the caller's thread when the engine calls ``poll`` (messages → ``on_message``, settled
fences → ``copy_done``, the manager's timers → ``tick``) and carries out the actions that come
back. The reports the engine acts on (``FinishedSending``, ``FinishedRecving``, ``FreeBlocks``)
are queued for ``take_reports``. Every wait is bounded: HELLO by the control plane's timeout, a
send by the portal, ``wait`` by its argument, and every hand-off by its manager's deadlines.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

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
from kvflow.core.pd.messages import Compat
from kvflow.core.pd.producer import ProducerManager
from kvflow.errors import KVFlowError
from kvflow.runtime.clock import Clock, SystemClock
from kvflow.runtime.pd_control import ControlPlane, PeerInfo, open_control_plane

log = get_logger("kvflow.pd")

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
    ) -> None:
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
                    )
                )
            )
            self.control = self._cp_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        transport.set_wakeup(self._wake.set)

    @property
    def address(self) -> str:
        """This engine's control-plane endpoint (what a peer's HELLO goes to)."""
        return self.control.address

    @property
    def engine_id(self) -> str:
        return self.manager.engine_id

    def connect(self, address: str) -> PeerInfo:
        """HELLO with the peer at ``address`` unless cached; ``PeerError`` within the timeout."""
        info: PeerInfo = self._call(self.control.hello, address)
        return info

    def now(self) -> float:
        return self.clock.now()

    def apply(self, actions: list[Action]) -> None:
        """Carry out a manager's actions: send, launch, cancel; queue the engine's reports."""
        for a in actions:
            if isinstance(a, Send):
                try:
                    self._call(self.control.send, a.peer, a.message)
                except KVFlowError as e:
                    # A peer without HELLO (gone, or never met): the manager's timers decide.
                    log.warning("pd_send_failed", peer=a.peer, error=str(e))
            elif isinstance(a, LaunchCopies):
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

    def poll(self) -> None:
        """Deliver what arrived, report settled copies, fire due timers (never blocks)."""
        if self._closed:
            return
        now = self.clock.now()
        if self._pump is not None:
            self._pump(now)
        while (got := self._call_sync(self.control.recv_nowait)) is not None:
            self.apply(self.manager.on_message(got[0], got[1], now))
        for op, fence in list(self._fences):
            status = self.transport.query(fence)
            if status is not FenceStatus.PENDING:
                self._fences.remove((op, fence))
                started = self._launched_at.pop(id(fence), None)
                if started is not None:
                    self.send_seconds += now - started
                ok = status is FenceStatus.DONE
                self.apply(self.manager.copy_done(op.transfer_id, op.epoch, 0, ok, now, op.channel))
        self.apply(self.manager.tick(now))

    def take_reports(self) -> list[Report]:
        out, self._reports = self._reports, []
        return out

    def busy(self) -> bool:
        """Hand-offs live, copies running or reports not yet taken."""
        return bool(self.manager.num_live or self._fences or self._reports)

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for a copy to settle (a peer's message wakes nobody: it is
        seen at the next poll); at once when no hand-off is live."""
        if not (self._fences or self.manager.num_live):
            return
        self._wake.wait(timeout_s)
        self._wake.clear()

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

    def _call_sync(self, fn: Callable[[], Any]) -> Any:
        # The control plane's inbox is the loop's: read it on the loop's thread.
        return self._portal.call(_sync, fn)


async def _sync(fn: Callable[[], Any]) -> Any:
    return fn()


__all__ = ["PDDriver", "Report"]
