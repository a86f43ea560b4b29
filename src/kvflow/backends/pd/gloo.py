"""The CPU data plane of PD: torch.distributed gloo between one rank of P and one rank of D.

The pair gets a 2-rank gloo group of its own (a ``TCPStore`` at an address both sides know from
the HELLO, the producer's side hosting it), so it works beside any group the engines already
have. Both sides cut a launch into the same wire chunks (``plan_wire``, from the pairs alone):

- a **run** (blocks consecutive on both sides, at least ``direct_min_bytes`` per region) moves
  straight from P's KV tensors into D's reserved blocks, one wire op per region, no copy;
- everything else goes in **staged** chunks of at most ``slot_bytes``: the sender gathers the
  chunk into a slot of one bounded staging ring (``slots × slot_bytes``, allocated once) and
  sends it; the receiver receives into a slot and scatters into the reserved blocks. A side
  whose blocks of a chunk are consecutive (one-region groups) skips its slot and copy: the
  chunk's bytes are that side's rows as they lie.

No buffer is allocated per request. Wire tags are the GRANT's channel and the op's index, so two
hand-offs' copies never match. A head slice (a strided view: P and D of different TP sizes,
``backends.pd.fan``) is always staged, gathered from or scattered into the view; both sides of
such a pair use ``direct_min_bytes=None`` so their plans agree.

Three threads per transport keep the wire busy, each taking chunks in launch order: the
*preparer* waits for a free slot and gathers into it (torch releases the GIL); the *poster*
posts the gloo op (gloo writes a send into the socket in the posting thread when the peer's
receive is already posted, so the next gather runs meanwhile); the *completer* waits for posted
ops in order, scatters a received slot, frees it and settles the fence. So the sender gathers
chunk *i + 1* while chunk *i* is on the wire, and the receiver has its next slots posted while
it scatters. gloo's point-to-point ``Work.is_completed()`` never turns true unless someone
waits on it (measured, torch 2.13), hence the waiting thread; the fence is a counter ``query``
reads without blocking, and the completer calls the wakeup when a launch settles
(``pushes_completions``). Both sides of a pair must use the same ``slot_bytes`` and
``direct_min_bytes``. The default ring, 8 slots of 1 MiB, keeps the pipeline deep: on a host
with cores to spare a scattered hand-off then runs at the raw send's speed (docs/benchmarks.md);
a slot grows to the largest staged block at ``register``.

A gloo error or timeout leaves the pair's group in an unknown state: the transport turns
*broken*, aborts the group (so every op still posted ends at once: nothing writes a block after
its fence settled), fails everything pending and every later launch, until ``rebuild`` (both
sides, a new store address) makes a new group.
"""

from __future__ import annotations

import datetime
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from attrs import define, frozen
from torch._C._distributed_c10d import TCPStore

from kvflow.backends.base import Fence, FenceStatus
from kvflow.backends.pd.rendezvous import pair_array
from kvflow.backends.pd.transport import (
    MAX_OPS,
    GroupGeometry,
    gather_rows,
    geometry,
    row_bytes,
    scatter_rows,
)
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import CHANNELS, OP_BITS, LaunchCopies, Pairs
from kvflow.errors import BackendError, ClosedError, ConfigError, ProtocolError

log = get_logger("kvflow.backend.pd.gloo")

THREAD_PREFIX = "kvflow-pd-gloo"
MAX_RUN_BYTES = 64 << 20
"""A run's op carries at most this much: a failure then loses at most one op's worth."""
SLOT_POLL_S = 0.05
"""How often a poster waiting for a free slot looks whether the pair broke or closed."""


@frozen
class WireChunk:
    """Consecutive pairs of one group on the wire. ``run``: consecutive on both sides, one op
    per region straight between the KV tensors (tags ``tag … tag + regions - 1``); otherwise
    one op of the regions' rows back to back (region-major), through a slot where a side's
    blocks are not consecutive."""

    index: int
    group: int
    local: tuple[int, ...]
    remote: tuple[int, ...]
    tag: int
    run: bool = False
    local_in_a_row: bool = False  # this side's blocks are consecutive (not mirrored)


def _segments(
    arr: npt.NDArray[np.int64], region_bytes: int, direct_min_bytes: int | None
) -> list[tuple[int, int, bool]]:
    """A group's pairs (rows of ``arr``) in order as ``(start, stop, is_run)``: runs (pairs
    consecutive on both sides, the same cut seen from either) long enough to go direct, and
    the stretches between them, which are staged. numpy: a hand-off may name thousands."""
    n = len(arr)
    if n == 0:
        return []
    if direct_min_bytes is None:
        return [(0, n, False)]
    step = (np.diff(arr[:, 0]) != 1) | (np.diff(arr[:, 1]) != 1)
    starts = np.flatnonzero(np.concatenate(([True], step)))
    stops = np.append(starts[1:], n)
    long = (stops - starts) * region_bytes >= direct_min_bytes
    out: list[tuple[int, int, bool]] = []
    at = 0
    for lo, hi in zip(starts[long].tolist(), stops[long].tolist(), strict=True):
        if at < lo:
            out.append((at, lo, False))
        out.append((lo, hi, True))
        at = hi
    if at < n:
        out.append((at, n, False))
    return out


def plan_wire(
    channel: int,
    pairs: Pairs,
    geo: Sequence[GroupGeometry],
    slot_bytes: int,
    direct_min_bytes: int | None,
) -> list[WireChunk]:
    """A launch's wire chunks, identical on both sides of the pair (they see each pair
    mirrored, and a run of one is a run of the other)."""
    if len(pairs) > len(geo):
        raise ConfigError(f"{len(pairs)} groups of pairs but {len(geo)} registered groups")
    if not 0 < channel < CHANNELS:
        raise ConfigError(f"channel {channel} is outside 1..{CHANNELS - 1}")
    chunks: list[WireChunk] = []
    op = channel << OP_BITS
    last = op + MAX_OPS
    for g, group_pairs in enumerate(pairs):
        gg = geo[g]
        arr = pair_array(group_pairs)
        if len(arr) and not (arr[:, 0].min() >= 0 and arr[:, 0].max() < gg.num_blocks):
            bad = arr[(arr[:, 0] < 0) | (arr[:, 0] >= gg.num_blocks), 0][0]
            raise ConfigError(f"group {g}: block {bad} is not registered")
        region_bytes = min(map(row_bytes, gg.views))
        for start, stop, run in _segments(arr, region_bytes, direct_min_bytes):
            per = max(1, MAX_RUN_BYTES // gg.block_bytes) if run else slot_bytes // gg.block_bytes
            if per < 1:
                raise ConfigError(f"group {g}: a block ({gg.block_bytes} B) exceeds a slot")
            ops = len(gg.views) if run else 1
            for lo in range(start, stop, per):
                if op + ops > last:
                    raise ConfigError(
                        f"more than {MAX_OPS} wire ops in one hand-off; use bigger slots"
                    )
                part = arr[lo : min(lo + per, stop)]
                local, remote = tuple(part[:, 0].tolist()), tuple(part[:, 1].tolist())
                # A side's blocks in a row need no slot; the plan says so (no loop per block).
                # A strided view (a head slice) is never sent or received as it lies.
                here = not gg.strided and (
                    len(local) == 1 or bool((np.diff(part[:, 0]) == 1).all())
                )
                chunks.append(WireChunk(len(chunks), g, local, remote, op, run, here))
                op += ops
    return chunks


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


@define(eq=False, slots=True)
class _Ready:
    """A chunk with its buffers in place (gathered, on the sender), to be posted."""

    fence: GlooFence
    send: bool
    first: bool  # the launch's first chunk
    tag: int
    buffers: list[torch.Tensor]
    slot: int | None
    scatter: tuple[GroupGeometry, tuple[int, ...], torch.Tensor] | None


@define(eq=False, slots=True)
class _Posted:
    """A chunk whose gloo ops are posted: what the completer waits for, then does."""

    fence: GlooFence
    works: list[Any]
    slot: int | None
    scatter: tuple[GroupGeometry, tuple[int, ...], torch.Tensor] | None


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
        slots: int = 8,
        slot_bytes: int = 1 << 20,
        direct_min_bytes: int | None = 1 << 20,
        send_pause_s: float = 0.0,
    ) -> None:
        if (
            pair_rank not in (0, 1)
            or slots < 1
            or slot_bytes < 8
            or slot_bytes % 8
            or timeout_s <= 0
            or (direct_min_bytes is not None and direct_min_bytes < 1)
            or not send_pause_s >= 0
        ):
            raise ConfigError(
                f"gloo transport: pair_rank must be 0 or 1, slots and timeout_s positive, "
                f"slot_bytes a positive multiple of 8, direct_min_bytes positive or None (got "
                f"{pair_rank}, {slots}, {slot_bytes}, {timeout_s}, {direct_min_bytes})"
            )
        self.pair_rank = pair_rank
        self.timeout_s = timeout_s
        self._store, self._pg = self._rendezvous(host, port, timeout_s)
        self.address = (host, port)  # the pair's rendezvous (a peer's rebuild names a new one)
        self.peer = 1 - pair_rank
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.direct_min_bytes = direct_min_bytes
        # Fault tests: the sender pauses before each chunk of a launch but the first, so a copy
        # lasts long enough to kill a process in its middle.
        self.send_pause_s = send_pause_s
        self._stop = threading.Event()
        self._chunks_live = 0  # launched, not settled (``rebuild`` waits for none)
        self._ring = torch.empty(slots * slot_bytes, dtype=torch.uint8)
        self._free: queue.Queue[int] = queue.Queue()
        for s in range(slots):
            self._free.put(s)
        self._geo: tuple[GroupGeometry, ...] | None = None
        self._queue: queue.Queue[tuple[GlooFence, bool, WireChunk] | None] = queue.Queue()
        self._ready: queue.Queue[_Ready | None] = queue.Queue()
        self._posted: queue.Queue[_Posted | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no chunk is live
        self._wakeup: Callable[[], None] | None = None
        self._ids = itertools.count()
        self._closed = False
        self.broken: str | None = None
        self._threads = [
            threading.Thread(target=fn, name=f"{THREAD_PREFIX}-{what}", daemon=True)
            for fn, what in (
                (self._preparer, "prepare"),
                (self._poster, "post"),
                (self._completer, "complete"),
            )
        ]
        for t in self._threads:
            t.start()
        log.info("pd_transport_ready", transport="gloo", pair_rank=pair_rank, slots=slots)

    def _rendezvous(self, host: str, port: int, wait_s: float) -> tuple[Any, dist.ProcessGroupGloo]:
        """A store (hosted by pair rank 0) and the pair's 2-rank gloo group on it."""
        try:
            wait = datetime.timedelta(seconds=wait_s)
            store = TCPStore(host, port, 2, self.pair_rank == 0, timeout=wait)
            timeout = datetime.timedelta(seconds=self.timeout_s)
            return store, dist.ProcessGroupGloo(store, self.pair_rank, 2, timeout)
        except (RuntimeError, ValueError) as e:
            raise BackendError(
                f"gloo transport: no pair with {host}:{port} within {wait_s} s: {e}"
            ) from e

    def rebuild(self, *, host: str, port: int, wait_s: float | None = None) -> None:
        """A new rendezvous of the pair (a new store address: the pair's next epoch), after it
        broke or because the peer came back: what is pending fails first (the old group is
        aborted), the ring and the registered tensors stay. Both sides call it with the same
        address; ``BackendError`` if the peer does not come within ``wait_s``."""
        if self._closed:
            raise ClosedError("gloo transport is closed")
        wait_s = self.timeout_s if wait_s is None else wait_s
        self._break(RuntimeError("the pair is being rebuilt"))
        with self._idle:  # aborted ops end at once; nothing may still use the old group
            if not self._idle.wait_for(lambda: self._chunks_live == 0, timeout=wait_s):
                raise BackendError(f"gloo transport: copies still running after {wait_s} s")
        self._store, self._pg = self._rendezvous(host, port, wait_s)
        self.address = (host, port)
        with self._lock:
            self.broken = None
        log.info("pd_transport_rebuilt", transport="gloo", pair_rank=self.pair_rank, port=port)

    @property
    def group(self) -> dist.ProcessGroupGloo:
        """The pair's 2-rank gloo group (the benchmark's raw baseline sends through it)."""
        return self._pg

    def register(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        if self._geo is not None:
            raise ProtocolError("gloo transport: KV tensors are registered once")
        geo = geometry(groups)
        direct = self.direct_min_bytes
        # A staged chunk holds whole blocks, so a slot grows to the largest staged block (a
        # large model's block spans many layers). Both sides register the same geometry, so
        # both grow alike and their plans still agree.
        need = 0
        for g in geo:
            if g.strided and direct is not None:
                raise ConfigError(
                    "gloo transport: head slices (strided views) are staged; both sides of the "
                    "pair need direct_min_bytes=None"
                )
            if direct is None or min(map(row_bytes, g.views)) < direct:
                need = max(need, -(-g.block_bytes // 8) * 8)
        if need > self.slot_bytes:
            log.info(
                "pd_gloo_slots_grown", slot_bytes=need, configured=self.slot_bytes, slots=self.slots
            )
            self.slot_bytes = need
            self._ring = torch.empty(self.slots * need, dtype=torch.uint8)
        self._geo = geo

    def launch(self, op: LaunchCopies) -> GlooFence:
        if self._closed:
            raise ClosedError("gloo transport is closed")
        if self._geo is None:
            raise ProtocolError("gloo transport: register the KV tensors before launching")
        chunks = plan_wire(op.channel, op.pairs, self._geo, self.slot_bytes, self.direct_min_bytes)
        fence = GlooFence(next(self._ids), op.transfer_id, len(chunks))
        if self.broken is not None:
            fence.remaining, fence.failed = 0, True
            return fence
        with self._lock:
            self._chunks_live += len(chunks)
        for c in chunks:
            self._queue.put((fence, op.send, c))
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
        self._stop.set()
        self._queue.put(None)
        for t in self._threads:
            t.join(timeout=0.5)
        if any(t.is_alive() for t in self._threads):
            # A thread still waits on the peer: aborting the group wakes it with an error.
            self._abort()
            for t in self._threads:
                t.join(timeout=5.0)
        self._drain()
        log.info("pd_transport_closed", transport="gloo", broken=self.broken)

    # -- the two threads ----------------------------------------------------------------------

    def _preparer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._ready.put(None)
                return
            fence, send, chunk = item
            ready = None
            if not self._skip(fence):
                ready = self._prepare(fence, send, chunk)
            if ready is None:
                self._settle(fence, False)
            else:
                self._ready.put(ready)

    def _prepare(self, fence: GlooFence, send: bool, chunk: WireChunk) -> _Ready | None:
        """The chunk's buffers: rows of the KV tensors where a side's blocks lie in a row, else
        a staging slot (gathered into, on the sender)."""
        assert self._geo is not None
        geo = self._geo[chunk.group]
        n = len(chunk.local)
        if chunk.run:
            a = chunk.local[0]
            return _Ready(
                fence,
                send,
                chunk.index == 0,
                chunk.tag,
                [v[a : a + n] for v in geo.views],
                None,
                None,
            )
        if len(geo.views) == 1 and chunk.local_in_a_row:
            a = chunk.local[0]
            return _Ready(
                fence, send, chunk.index == 0, chunk.tag, [geo.views[0][a : a + n]], None, None
            )
        slot = self._take_slot()
        if slot is None:
            return None
        buf = self._ring[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]
        if send:
            return _Ready(
                fence,
                send,
                chunk.index == 0,
                chunk.tag,
                [gather_rows(geo, chunk.local, buf)],
                slot,
                None,
            )
        data = buf[: n * geo.block_bytes]
        return _Ready(
            fence, send, chunk.index == 0, chunk.tag, [data], slot, (geo, chunk.local, data)
        )

    def _poster(self) -> None:
        # Apart from the preparer: gloo writes a send into the socket in the posting thread
        # when D's receive is already posted, so the next chunk's gather runs meanwhile.
        while True:
            r = self._ready.get()
            if r is None:
                self._posted.put(None)
                return
            works: list[Any] = []
            if self.send_pause_s and r.send and not r.first:
                self._stop.wait(self.send_pause_s)
            if not self._skip(r.fence):
                pg: Any = self._pg  # read per chunk: ``rebuild`` replaces it
                post = pg.send if r.send else pg.recv
                try:
                    works = [post([b], self.peer, r.tag + j) for j, b in enumerate(r.buffers)]
                except RuntimeError as e:
                    self._break(e)
            if len(works) == len(r.buffers):
                self._posted.put(_Posted(r.fence, works, r.slot, r.scatter))
                continue
            # Not (all) posted: what was posted ends with the aborted group; nothing waits.
            if r.slot is not None:
                self._free.put(r.slot)
            self._settle(r.fence, False)

    def _skip(self, fence: GlooFence) -> bool:
        return fence.cancelled or self.broken is not None or self._closed

    def _take_slot(self) -> int | None:
        while True:
            try:
                return self._free.get(timeout=SLOT_POLL_S)
            except queue.Empty:
                if self.broken is not None or self._closed:
                    return None

    def _completer(self) -> None:
        while True:
            p = self._posted.get()
            if p is None:
                return
            ok = True
            for w in p.works:
                try:
                    w.wait()
                except RuntimeError as e:
                    ok = False
                    self._break(e)
            if ok and p.scatter is not None:
                scatter_rows(*p.scatter)
            if p.slot is not None:
                self._free.put(p.slot)
            self._settle(p.fence, ok)

    def _break(self, e: BaseException) -> None:
        with self._lock:
            first = self.broken is None
            if first:
                self.broken = str(e)
        if first:
            log.error("pd_transport_broken", transport="gloo", error=str(e)[:200])
            self._abort()

    def _abort(self) -> None:
        """End every op still posted on the group (they fail at once)."""
        try:
            self._pg.abort()
        except RuntimeError as e:  # already aborted or torn down by the peer
            log.info("pd_transport_abort_failed", transport="gloo", error=str(e)[:200])

    def _settle(self, fence: GlooFence, ok: bool) -> None:
        with self._lock:
            fence.failed = fence.failed or not ok
            fence.remaining -= 1
            self._chunks_live -= 1
            if not self._chunks_live:
                self._idle.notify_all()
            settled = fence.remaining == 0
        if settled and (wake := self._wakeup) is not None:
            wake()

    def _drain(self) -> None:
        """Fail what never reached the threads (a close that had to abort them)."""
        queues: tuple[queue.Queue[Any], ...] = (self._queue, self._ready, self._posted)
        for q in queues:
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, tuple):
                    self._settle(item[0], False)
                elif isinstance(item, _Ready | _Posted):
                    self._settle(item.fence, False)


__all__ = ["THREAD_PREFIX", "GlooFence", "GlooTransport", "WireChunk", "plan_wire"]
