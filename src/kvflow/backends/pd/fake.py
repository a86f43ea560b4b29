"""A deterministic PD transport for tests: two ends of a ``FakeLink`` in one process, real bytes,
and faults on demand.

Both ends register real CPU tensors and chunk launches with ``plan_chunks``, like the gloo
transport. A sender's chunk is a packet on the link; it is delivered by ``step(now)`` once its
delay passed and the receiver posted the matching receive (rendezvous, as gloo), and then both
chunks finish. Faults: ``drop`` (the next packets vanish: the receive fails at its deadline),
``delay``, ``duplicate`` (a second copy arrives after the first: it is dropped and counted in
``stale_dropped``, never written, as is a packet for a cancelled or expired receive), ``reorder`` (a launch's packets arrive last-first) and ``kill`` (peer death:
everything pending fails at once, later launches fail). Time comes only from ``step(now)``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import torch
from attrs import define, field

from kvflow.backends.base import Fence, FenceStatus
from kvflow.backends.pd.transport import (
    GroupGeometry,
    gather_rows,
    geometry,
    plan_chunks,
    scatter_rows,
)
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import LaunchCopies
from kvflow.errors import ClosedError, ProtocolError

log = get_logger("kvflow.backend.pd.fake")

ChunkKey = tuple[str, int, int, int]  # transfer id, epoch, chunk index, channel
"""(transfer id, epoch, chunk index)"""


@define(eq=False)
class FakeTransportFence:
    fence_id: int
    pending: set[int]
    failed: bool = False

    @property
    def status(self) -> FenceStatus:
        if self.failed:
            return FenceStatus.FAILED if not self.pending else FenceStatus.PENDING
        return FenceStatus.PENDING if self.pending else FenceStatus.DONE


@define(eq=False)
class _Packet:
    key: ChunkKey
    data: torch.Tensor
    deliver_at: float
    fence: FakeTransportFence
    sender: int
    duplicate: bool = False
    read: Callable[[], torch.Tensor] | None = None  # late_read: P's rows as they are at delivery


@define(eq=False)
class _Recv:
    fence: FakeTransportFence
    group: int
    blocks: tuple[int, ...]
    deadline: float


@define(eq=False)
class FakeLink:
    """The wire between the two ends; faults are set here."""

    recv_timeout_s: float = 5.0
    now: float = 0.0
    drop_next: int = 0
    delay_s: float = 0.0
    duplicate_next: int = 0
    reorder: bool = False
    # Read the sender's blocks when a packet is delivered, not at launch (as gloo's slot
    # threads read them while the copy runs): a sender freeing (and poisoning) blocks under a
    # running copy then shows in what the receiver gets.
    late_read: bool = False
    dead: bool = False
    stale_dropped: int = 0
    packets: list[_Packet] = field(factory=list)
    ends: list[FakeTransport] = field(factory=list)

    def pair(self) -> tuple[FakeTransport, FakeTransport]:
        """The link's two ends (sender side first by convention; either may send)."""
        self.ends = [FakeTransport(self, 0), FakeTransport(self, 1)]
        return self.ends[0], self.ends[1]

    def drop(self, n: int = 1) -> None:
        self.drop_next += n

    def duplicate(self, n: int = 1) -> None:
        self.duplicate_next += n

    def kill(self) -> None:
        """Peer death: every pending chunk on both ends fails; later launches fail."""
        self.dead = True
        for p in self.packets:
            p.fence.failed = True
            p.fence.pending.discard(p.key[2])
        self.packets.clear()
        for end in self.ends:
            end.fail_all()

    def step(self, now: float) -> int:
        """Deliver what is due at ``now`` and fail receives past their deadline; how many moved."""
        self.now = max(self.now, now)
        moved = 0
        for p in list(self.packets):
            if p.deliver_at > self.now:
                continue
            receiver = self.ends[1 - p.sender]
            recv = receiver.recvs.get(p.key)
            if recv is None:
                if p.duplicate or p.key in receiver.finished:
                    # A duplicate, or the receive was cancelled / expired: never written.
                    self.packets.remove(p)
                    self.stale_dropped += 1
                    p.fence.failed = True
                    p.fence.pending.discard(p.key[2])
                    log.info("pd_fake_stale_packet_dropped", key=p.key)
                continue  # not posted yet: wait for the receiver (rendezvous)
            self.packets.remove(p)
            data = p.data if p.read is None else p.read()
            scatter_rows(receiver.geo[recv.group], recv.blocks, data)
            del receiver.recvs[p.key]
            receiver.finished.add(p.key)
            recv.fence.pending.discard(p.key[2])
            p.fence.pending.discard(p.key[2])
            moved += 1
        for end in self.ends:
            end.expire(self.now)
            end.wake()
        return moved


class FakeTransport:
    """One end of a ``FakeLink``."""

    name = "fake-pd"
    pushes_completions = True

    def __init__(self, link: FakeLink, end: int) -> None:
        self.link = link
        self.end = end
        self.geo: tuple[GroupGeometry, ...] = ()
        self.recvs: dict[ChunkKey, _Recv] = {}
        self.finished: set[ChunkKey] = set()
        self._ids = itertools.count()
        self._wakeup: Callable[[], None] | None = None
        self.closed = False

    def register(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        if self.geo:
            raise ProtocolError("fake transport: KV tensors are registered once")
        self.geo = geometry(groups)

    def launch(self, op: LaunchCopies) -> FakeTransportFence:
        if self.closed:
            raise ClosedError("fake transport is closed")
        if not self.geo:
            raise ProtocolError("fake transport: register the KV tensors before launching")
        transfer_id, epoch, send = op.transfer_id, op.epoch, op.send
        chunks = plan_chunks(op.channel, op.pairs, self.geo, 1 << 30)
        fence = FakeTransportFence(next(self._ids), {c.index for c in chunks})
        if self.link.dead:
            fence.pending.clear()
            fence.failed = True
            return fence
        link = self.link
        order = list(reversed(chunks)) if link.reorder else chunks
        for c in order:
            key = (transfer_id, epoch, c.index, op.channel)  # a chunk's wire tag, as gloo's
            if not send:
                self.recvs[key] = _Recv(fence, c.group, c.local, link.now + link.recv_timeout_s)
                continue
            if link.drop_next:
                link.drop_next -= 1
                fence.pending.discard(c.index)  # the sender never learns of the loss
                continue
            geo = self.geo[c.group]
            read = functools.partial(
                gather_rows,
                geo,
                c.local,
                torch.empty(len(c.local) * geo.block_bytes, dtype=torch.uint8),
            )
            data = torch.empty(0, dtype=torch.uint8) if link.late_read else read()
            at = link.now + link.delay_s
            late = read if link.late_read else None
            link.packets.append(_Packet(key, data, at, fence, self.end, read=late))
            if link.duplicate_next:
                link.duplicate_next -= 1
                ghost = FakeTransportFence(-1, set())
                link.packets.append(
                    _Packet(key, data, at, ghost, self.end, duplicate=True, read=late)
                )
        return fence

    def query(self, fence: Fence) -> FenceStatus:
        if not isinstance(fence, FakeTransportFence):
            raise ProtocolError(f"not a fake transport fence: {fence!r}")
        return fence.status

    def cancel(self, fence: Fence) -> None:
        if not isinstance(fence, FakeTransportFence):
            return
        for key, r in list(self.recvs.items()):
            if r.fence is fence:
                del self.recvs[key]
                self.finished.add(key)  # a late packet for it is dropped, never written
        for p in list(self.link.packets):
            if p.fence is fence:
                self.link.packets.remove(p)
        if fence.pending:
            fence.failed = True
            fence.pending.clear()

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        self._wakeup = wakeup

    def close(self) -> None:
        self.closed = True
        self.fail_all()

    def fail_all(self) -> None:
        for r in self.recvs.values():
            r.fence.failed = True
            r.fence.pending.clear()
        self.recvs.clear()

    def expire(self, now: float) -> None:
        for key, r in list(self.recvs.items()):
            if r.deadline <= now:
                del self.recvs[key]
                self.finished.add(key)
                r.fence.failed = True
                r.fence.pending.discard(key[2])

    def wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup()


__all__ = ["FakeLink", "FakeTransport", "FakeTransportFence"]
