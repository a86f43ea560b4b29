"""The CPU data plane of PD: torch.distributed gloo between one rank of P and one rank of D.

The pair gets a 2-rank gloo group of its own (a ``TCPStore`` at an address both sides know from
the HELLO, the producer's side hosting it), so it works beside any group the engines already
have. Copies go through one bounded staging ring of ``slots × slot_bytes`` bytes, allocated once:
the sender gathers a chunk of blocks into a slot and sends it; the receiver receives into a slot
and scatters it into the reserved blocks. No buffer is allocated per request. Blocks of at least
``direct_min_bytes`` (off by default) skip the ring: each region's row is sent from, and
received into, the KV tensor itself (one wire op per row, all posted at once, no copy); on the dev
box it was not faster (docs/benchmarks.md). Both sides of a pair must use the same
``slot_bytes`` and ``direct_min_bytes``. Wire tags are the GRANT's channel and the op's index,
so two hand-offs' copies never match.

Each slot is served by a thread of its own, which does the gather / scatter (torch releases the
GIL) and waits for the gloo operation: gloo's point-to-point ``Work.is_completed()`` never turns
true unless someone waits on it (measured, torch 2.13), so a thread waits and the fence is a
counter that ``query`` reads without blocking. The thread calls the wakeup when a launch settles
(``pushes_completions``). A gloo error or timeout leaves the pair's group in an unknown state: the
transport turns *broken*, fails everything pending and every later launch, and the pair must be
rebuilt (a new HELLO).
"""

from __future__ import annotations

import datetime
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from attrs import define
from torch._C._distributed_c10d import TCPStore

from kvflow.backends.base import Fence, FenceStatus
from kvflow.backends.pd.transport import (
    Chunk,
    GroupGeometry,
    gather_rows,
    geometry,
    plan_chunks,
    scatter_rows,
)
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import LaunchCopies
from kvflow.errors import BackendError, ClosedError, ConfigError, ProtocolError

log = get_logger("kvflow.backend.pd.gloo")

THREAD_PREFIX = "kvflow-pd-gloo"


@define(eq=False)
class GlooFence:
    """One launch: settles when every chunk finished (DONE) or any failed / was skipped."""

    fence_id: int
    transfer_id: str
    remaining: int
    failed: bool = False
    cancelled: bool = False

    @property
    def status(self) -> FenceStatus:
        if self.remaining:
            return FenceStatus.PENDING
        return FenceStatus.FAILED if self.failed or self.cancelled else FenceStatus.DONE


class GlooTransport:
    """One rank's gloo data plane to one peer rank (``pair_rank`` 0 hosts the pair's store)."""

    name = "gloo"
    pushes_completions = True

    def __init__(
        self,
        *,
        pair_rank: int,
        host: str,
        port: int,
        timeout_s: float = 30.0,
        slots: int = 4,
        slot_bytes: int = 2 << 20,
        direct_min_bytes: int | None = None,
    ) -> None:
        if (
            pair_rank not in (0, 1)
            or slots < 1
            or slot_bytes < 8
            or slot_bytes % 8
            or timeout_s <= 0
        ):
            raise ConfigError(
                f"gloo transport: pair_rank must be 0 or 1, slots and timeout_s positive, "
                f"slot_bytes a positive multiple of 8 (got {pair_rank}, {slots}, {slot_bytes}, {timeout_s})"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            self._store = TCPStore(host, port, 2, pair_rank == 0, timeout=timeout)
            self._pg = dist.ProcessGroupGloo(self._store, pair_rank, 2, timeout)
        except (RuntimeError, ValueError) as e:
            raise BackendError(
                f"gloo transport: no pair with {host}:{port} within {timeout_s} s: {e}"
            ) from e
        self.peer = 1 - pair_rank
        self.slot_bytes = slot_bytes
        self.direct_min_bytes = direct_min_bytes
        self._ring = torch.empty(slots * slot_bytes, dtype=torch.uint8)
        self._geo: tuple[GroupGeometry, ...] | None = None
        self._queue: queue.Queue[tuple[GlooFence, bool, Chunk] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._wakeup: Callable[[], None] | None = None
        self._ids = itertools.count()
        self._closed = False
        self.broken: str | None = None
        self._threads = [
            threading.Thread(
                target=self._serve, args=(i,), name=f"{THREAD_PREFIX}-{i}", daemon=True
            )
            for i in range(slots)
        ]
        for t in self._threads:
            t.start()
        log.info("pd_transport_ready", transport="gloo", pair_rank=pair_rank, slots=slots)

    @property
    def group(self) -> dist.ProcessGroupGloo:
        """The pair's 2-rank gloo group (the benchmark's raw baseline sends through it)."""
        return self._pg

    def register(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        if self._geo is not None:
            raise ProtocolError("gloo transport: KV tensors are registered once")
        geo = geometry(groups)
        for g in geo:
            direct = self.direct_min_bytes is not None and g.block_bytes >= self.direct_min_bytes
            if g.block_bytes > self.slot_bytes and not direct:
                raise ConfigError(
                    f"a block ({g.block_bytes} B) does not fit a {self.slot_bytes} B slot"
                )
        self._geo = geo

    def launch(self, op: LaunchCopies) -> GlooFence:
        if self._closed:
            raise ClosedError("gloo transport is closed")
        if self._geo is None:
            raise ProtocolError("gloo transport: register the KV tensors before launching")
        chunks = plan_chunks(
            op.channel, op.pairs, self._geo, self.slot_bytes, self.direct_min_bytes
        )
        send = op.send
        fence = GlooFence(next(self._ids), op.transfer_id, len(chunks))
        if self.broken is not None:
            fence.remaining, fence.failed = 0, True
            return fence
        for c in chunks:
            self._queue.put((fence, send, c))
        return fence

    def query(self, fence: Fence) -> FenceStatus:
        if not isinstance(fence, GlooFence):
            raise ProtocolError(f"not a gloo transport fence: {fence!r}")
        return fence.status

    def cancel(self, fence: Fence) -> None:
        if isinstance(fence, GlooFence):
            fence.cancelled = True

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        self._wakeup = wakeup

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=0.5)
        if any(t.is_alive() for t in self._threads):
            # A thread still waits on the peer: aborting the group wakes it with an error.
            self._pg.abort()
            for t in self._threads:
                t.join(timeout=5.0)
        self._drain_queue()
        log.info("pd_transport_closed", transport="gloo", broken=self.broken)

    # -- the slot threads ---------------------------------------------------------------------

    def _serve(self, slot: int) -> None:
        buf = self._ring[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]
        while True:
            item = self._queue.get()
            if item is None:
                return
            fence, send, chunk = item
            ok = False
            if not (fence.cancelled or self.broken is not None or self._closed):
                try:
                    self._run(buf, send, chunk)
                    ok = True
                except RuntimeError as e:
                    self.broken = str(e)
                    log.error("pd_transport_broken", transport="gloo", error=str(e)[:200])
            self._settle(fence, ok)

    def _run(self, buf: torch.Tensor, send: bool, chunk: Chunk) -> None:
        assert self._geo is not None
        geo = self._geo[chunk.group]
        nbytes = len(chunk.local) * geo.block_bytes
        pg: Any = self._pg
        if chunk.direct:
            # Every op posted before any wait: the pair's rendezvous round trips overlap.
            rows = [v[b] for b in chunk.local for v in geo.views]
            post = pg.send if send else pg.recv
            works = [post([row], self.peer, chunk.tag + j) for j, row in enumerate(rows)]
            for w in works:
                w.wait()
            return
        if send:
            data = gather_rows(geo, chunk.local, buf)
            pg.send([data], self.peer, chunk.tag).wait()
        else:
            data = buf[:nbytes]
            pg.recv([data], self.peer, chunk.tag).wait()
            scatter_rows(geo, chunk.local, data)

    def _settle(self, fence: GlooFence, ok: bool) -> None:
        with self._lock:
            fence.failed = fence.failed or not ok
            fence.remaining -= 1
            settled = fence.remaining == 0
        if settled and (wake := self._wakeup) is not None:
            wake()

    def _drain_queue(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._settle(item[0], False)


__all__ = ["THREAD_PREFIX", "GlooFence", "GlooTransport"]
