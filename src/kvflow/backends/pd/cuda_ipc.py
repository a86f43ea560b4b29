"""The one-GPU data plane of PD: CUDA IPC between two engine processes on one device (NCCL
refuses two ranks on one GPU), one rank of P and one of D.

Once per pair, at ``register``, the side that does not copy (the *passive* side: P in ``read``
mode, the default; D in ``write`` mode) exports its KV tensors (torch's CUDA IPC handles, which
use cuMem handles under expandable segments) and the copying side (the *initiator*) maps them;
nothing is exported or mapped per transfer. Each side also exports one interprocess CUDA event:
the passive side's *ready* event, the initiator's *copied* event. The pair's store carries
the handles, the layouts and the pids; a small shared host-memory table (``Doorbell``, one file
both map) carries per-channel tokens.

One hand-off (``read`` mode, D pulls):

1. P's ``launch`` records *ready* on P's current (compute) stream and then writes its token in
   the channel's ready cell: everything P's GPU did to the blocks comes before the copy;
2. D's ``launch`` (or a later ``query``, whichever first sees P's token) makes its copy stream
   wait on P's *ready* (device side, no host wait) and on D's own compute, copies every block
   (``cuda_copy``: batched DMA or the page-copy kernel), records *copied*, writes its token in
   the copied cell; D's fence is a local event after the copies;
3. P's fence settles when it sees D's token and *copied* has completed: only then may P free the
   blocks (P's release).

An event re-recorded by a later hand-off is only waited past a later point of the same stream,
so sharing one event per side is conservative, never early. ``write`` mode is the same with the
roles of the two sides swapped (P copies into D's mapped blocks after D's *ready*).

A peer's death is seen from its pid (gone, a zombie, or reused: the start time is checked): its
pending fences fail, the transport turns broken (later launches fail at once). A copy already
on the stream is never abandoned: its fence settles (FAILED) only once the copy finished. The
exporter outlives the mappings: at ``close`` the initiator waits (at most ``close_wait_s``) for
its issued copies, drops its mappings and says so in the doorbell; the passive side's ``close``
waits for that (bounded) before it lets go. A copy that never finishes (its stream waits on a
dead peer's event) keeps its mappings for the life of the process rather than fault later.

The GPU side is ``CudaIpcDevice`` (``cuda_ipc_device``; re-exported here). Importing this module
needs no GPU; ``CudaIpcDevice`` raises ``BackendError`` without one.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import pickle
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import xxhash
from attrs import define

from kvflow.backends.base import Fence, FenceStatus
from kvflow.backends.pd.cuda_ipc_device import CudaIpcDevice
from kvflow.backends.pd.rendezvous import (
    MODES,
    PairStore,
    SideLayout,
    check_launch,
    sorted_pairs,
)
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import CHANNELS, LaunchCopies
from kvflow.errors import ClosedError, ConfigError, LayoutError, ProtocolError

log = get_logger("kvflow.backend.pd.cuda_ipc")

_HEADER = 4  # int64 cells: [rank] = closing, [2 + rank] = mappings dropped
_ABANDONED: list[Any] = []  # mappings a copy that never finished may still use (see close)


def token_of(transfer_id: str, epoch: int, channel: int) -> int:
    """A non-zero 63-bit token naming one hand-off's copies in a doorbell cell."""
    h = xxhash.xxh64_intdigest(f"{transfer_id}\0{epoch}\0{channel}".encode())
    return (h & ((1 << 63) - 1)) | 1


class Doorbell:
    """Per-channel cells in shared host memory: ``ready`` (passive side) and ``copied``
    (initiator), each holding the token of the last hand-off that reached that point. Created by
    rank 0 (the file is unlinked at its close), mapped by rank 1."""

    def __init__(self, path: str, *, create: bool) -> None:
        size = (_HEADER + 2 * CHANNELS) * 8
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path = path
        self.owner = create
        cells = np.frombuffer(self._mm, dtype=np.int64)
        self._head = cells[:_HEADER]
        self._cells = cells[_HEADER:].reshape(CHANNELS, 2)

    @classmethod
    def new_path(cls) -> str:
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return os.path.join(root, f"kvflow-pd-ipc-{os.getpid()}-{uuid.uuid4().hex[:8]}")

    def ring(self, channel: int, copied: bool, token: int) -> None:
        self._cells[channel, int(copied)] = token

    def rung(self, channel: int, copied: bool, token: int) -> bool:
        return bool(self._cells[channel, int(copied)] == token)

    def set_flag(self, index: int) -> None:
        self._head[index] = 1

    def flag(self, index: int) -> bool:
        return bool(self._head[index])

    def close(self) -> None:
        del self._head, self._cells
        self._mm.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (from /proc), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


class IpcDevice(Protocol):
    """What the transport needs of the GPU (``CudaIpcDevice``; tests give a fake)."""

    def check(self, layout: SideLayout) -> None: ...
    def export(self, t: torch.Tensor) -> bytes: ...
    def open(self, data: bytes) -> torch.Tensor: ...
    def new_event(self, *, interprocess: bool) -> Any: ...
    def free_event(self, event: Any) -> None: ...
    def event_handle(self, event: Any) -> bytes: ...
    def open_event(self, data: bytes) -> Any: ...
    def record(self, event: Any, *, on_copy_stream: bool) -> None: ...
    def wait(self, event: Any) -> None: ...
    def query(self, event: Any) -> bool: ...
    def prepare(self, src: SideLayout, dst: SideLayout) -> list[str]: ...
    def copy(self, group: int, src_ids: Any, dst_ids: Any) -> int: ...
    def close(self, *, synchronize: bool) -> None: ...


@define(eq=False)
class IpcFence:
    """One side of one launch."""

    fence_id: int
    transfer_id: str
    channel: int
    token: int
    initiator: bool
    deadline: float
    pairs: tuple[tuple[Any, Any], ...] = ()  # per group: (src ids, dst ids), sorted
    local_ready: Any = None  # initiator: its own compute before the launch
    done: Any = None  # initiator: after its copies
    status: FenceStatus = FenceStatus.PENDING
    cancelled: bool = False


class CudaIpcTransport:
    """One rank's CUDA IPC data plane to one peer process on the same GPU (``pair_rank`` 0 is
    P, the sender, and hosts the pair's store and the doorbell)."""

    name = "cuda-ipc"
    pushes_completions = False

    def __init__(
        self,
        *,
        pair_rank: int,
        host: str,
        port: int,
        now: Callable[[], float],
        timeout_s: float = 30.0,
        mode: str = "read",
        device: int | IpcDevice = 0,
        close_wait_s: float = 5.0,
        peer_check_s: float = 0.05,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"cuda-ipc transport: mode must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.pair_rank = pair_rank
        self.timeout_s = timeout_s
        self.close_wait_s = close_wait_s
        self._peer_check_s = peer_check_s
        self._now = now
        self.initiates = pair_rank == (1 if mode == "read" else 0)
        self._dev: IpcDevice = CudaIpcDevice(device) if isinstance(device, int) else device
        self._store = PairStore(
            pair_rank=pair_rank,
            host=host,
            port=port,
            timeout_s=timeout_s,
            what="cuda-ipc transport",
        )
        self._layout: SideLayout | None = None
        self._peer_layout: SideLayout | None = None
        self._tensors: list[list[torch.Tensor]] = []
        self._mapped: list[list[torch.Tensor]] = []  # the initiator's view of the peer's tensors
        self._event: Any = None  # this side's interprocess event (ready or copied)
        self._peer_event: Any = None
        self._bell: Doorbell | None = None
        self.peer_pid = 0
        self._peer_start: str | None = None
        self._checked_at = -1e30
        self._ids = itertools.count()
        self._live: list[IpcFence] = []
        self._closed = False
        self.broken: str | None = None
        self.paths: list[str] = []
        self.counters = {"launches": 0, "copies": 0, "bytes": 0, "failed": 0}

    # -- setup --------------------------------------------------------------------------------

    def register(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        if self._closed:
            raise ClosedError("cuda-ipc transport is closed")
        if self._layout is not None:
            raise ProtocolError("cuda-ipc transport: KV tensors are registered once")
        layout = SideLayout.of(groups, what="cuda-ipc transport")
        self._dev.check(layout)
        self._tensors = [list(g) for g in groups]
        store, dev = self._store, self._dev
        self._event = dev.new_event(interprocess=True)
        if self.pair_rank == 0:
            self._bell = Doorbell(Doorbell.new_path(), create=True)
            store.publish("doorbell", self._bell.path.encode())
        exports = [[dev.export(t) for t in g] for g in groups] if not self.initiates else []
        store.publish(
            "side",
            pickle.dumps(
                {
                    "layout": layout.to_bytes(),
                    "pid": os.getpid(),
                    "event": dev.event_handle(self._event),
                    "tensors": exports,
                }
            ),
        )
        self._layout = layout
        if self.pair_rank == 1:
            self._bell = Doorbell(store.fetch("doorbell").decode(), create=False)
        # The peer is this engine's own other process (same user, same host): its pickles are
        # trusted like the pair's store itself.
        peer = pickle.loads(store.fetch("side"))
        peer_layout = SideLayout.from_bytes(peer["layout"])
        layout.check_peer(peer_layout, what="cuda-ipc transport")
        self.peer_pid = int(peer["pid"])
        self._peer_start = process_start(self.peer_pid)
        self._peer_event = dev.open_event(peer["event"])
        if self.initiates:
            self._mapped = [[dev.open(h) for h in g] for g in peer["tensors"]]
            mapped = SideLayout.of(self._mapped, what="cuda-ipc transport (the peer's, mapped)")
            if [[r.row_bytes for r in g] for g in mapped.groups] != [
                [r.row_bytes for r in g] for g in peer_layout.groups
            ]:
                raise LayoutError("cuda-ipc transport: the mapped tensors differ from the peer's")
            src, dst = (mapped, layout) if self.mode == "read" else (layout, mapped)
            self.paths = dev.prepare(src, dst)
        self._peer_layout = peer_layout
        log.info(
            "pd_cuda_ipc_registered",
            rank=self.pair_rank,
            mode=self.mode,
            initiates=self.initiates,
            peer_pid=self.peer_pid,
            paths=self.paths,
        )

    # -- the protocol -------------------------------------------------------------------------

    def launch(self, op: LaunchCopies) -> IpcFence:
        if self._closed:
            raise ClosedError("cuda-ipc transport is closed")
        if self._layout is None or self._peer_layout is None or self._bell is None:
            raise ProtocolError("cuda-ipc transport: register the KV tensors before launching")
        if (op.send == (self.mode == "write")) != self.initiates:
            raise ProtocolError(
                f"cuda-ipc transport: a {'send' if op.send else 'receive'} on pair rank "
                f"{self.pair_rank} does not fit {self.mode} mode (rank 0 sends)"
            )
        arrays = check_launch(
            op.pairs, self._layout, self._peer_layout, op.channel, what="cuda-ipc transport"
        )
        fence = IpcFence(
            next(self._ids),
            op.transfer_id,
            op.channel,
            token_of(op.transfer_id, op.epoch, op.channel),
            self.initiates,
            self._now() + self.timeout_s,
        )
        self.counters["launches"] += 1
        if not any(len(a) for a in arrays):
            fence.status = FenceStatus.DONE
            return fence
        if self.broken is not None:
            self._settle(fence, FenceStatus.FAILED)
            return fence
        if not self.initiates:
            self._dev.record(self._event, on_copy_stream=False)
            self._bell.ring(op.channel, False, fence.token)
        else:
            parts = []
            read = self.mode == "read"
            for g, arr in enumerate(arrays):
                if not len(arr):
                    parts.append((arr[:, 0], arr[:, 1]))
                    continue
                # The kernel copies pages in any order; sorting pays only for runs of DMA copies.
                if self.paths[g] == "kernel":
                    loc, rem = arr[:, 0], arr[:, 1]
                else:
                    loc, rem = sorted_pairs(arr)
                parts.append((rem, loc) if read else (loc, rem))
            fence.pairs = tuple(parts)
            fence.local_ready = self._dev.new_event(interprocess=False)
            self._dev.record(fence.local_ready, on_copy_stream=False)
            self._try_issue(fence)
        self._live.append(fence)
        return fence

    def _try_issue(self, fence: IpcFence) -> None:
        """Issue the copies once the passive side's token says its ready event is recorded."""
        assert self._bell is not None
        assert self._layout is not None
        if fence.done is not None or not self._bell.rung(fence.channel, False, fence.token):
            return
        dev = self._dev
        dev.wait(fence.local_ready)
        # The wait holds the record it saw: the event may serve another launch from now on.
        dev.free_event(fence.local_ready)
        fence.local_ready = None
        dev.wait(self._peer_event)
        for g, (src, dst) in enumerate(fence.pairs):
            if len(src):
                self.counters["copies"] += dev.copy(g, src, dst)
                self.counters["bytes"] += len(src) * self._layout.block_bytes(g)
        fence.done = dev.new_event(interprocess=False)
        dev.record(self._event, on_copy_stream=True)
        dev.record(fence.done, on_copy_stream=True)
        self._bell.ring(fence.channel, True, fence.token)

    def query(self, fence: Fence) -> FenceStatus:
        if not isinstance(fence, IpcFence):
            raise ProtocolError(f"not a cuda-ipc transport fence: {fence!r}")
        if fence.status is not FenceStatus.PENDING:
            return fence.status
        assert self._bell is not None
        dead = not self._peer_alive()
        if fence.initiator:
            if fence.done is None:
                if not dead:
                    self._try_issue(fence)
                if fence.done is None and (dead or fence.cancelled or self._late(fence)):
                    # Nothing of it is on the stream: failing now frees nothing under a copy.
                    return self._settle(fence, FenceStatus.FAILED)
            if fence.done is not None and self._dev.query(fence.done):
                bad = dead or fence.cancelled
                return self._settle(fence, FenceStatus.FAILED if bad else FenceStatus.DONE)
            return fence.status
        if self._bell.rung(fence.channel, True, fence.token) and self._dev.query(self._peer_event):
            return self._settle(fence, FenceStatus.DONE)
        if dead or fence.cancelled or self._late(fence):
            return self._settle(fence, FenceStatus.FAILED)
        return fence.status

    def _late(self, fence: IpcFence) -> bool:
        if self._now() <= fence.deadline:
            return False
        log.warning("pd_cuda_ipc_timeout", transfer_id=fence.transfer_id, initiator=fence.initiator)
        return True

    def _peer_alive(self) -> bool:
        """Is the peer process still there? Checked at most every ``peer_check_s``."""
        if self.broken is not None:
            return False
        now = self._now()
        if now - self._checked_at < self._peer_check_s:
            return True
        self._checked_at = now
        start = process_start(self.peer_pid)
        if start is not None and start == self._peer_start:
            return True
        self.broken = f"peer process {self.peer_pid} is gone"
        log.error("pd_cuda_ipc_peer_lost", peer_pid=self.peer_pid)
        return False

    def _settle(self, fence: IpcFence, status: FenceStatus) -> FenceStatus:
        fence.status = status
        if status is FenceStatus.FAILED:
            self.counters["failed"] += 1
        if fence in self._live:
            self._live.remove(fence)
        # Settled, a fence's events are past use: ``done`` completed (no fence settles with its
        # copies still running), ``local_ready`` was never waited on.
        for event in (fence.local_ready, fence.done):
            if event is not None:
                self._dev.free_event(event)
        fence.local_ready = fence.done = None
        return status

    def cancel(self, fence: Fence) -> None:
        if isinstance(fence, IpcFence) and fence.status is FenceStatus.PENDING:
            fence.cancelled = True
            if fence.done is None:
                self._settle(fence, FenceStatus.FAILED)

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        del wakeup  # polled: CUDA events have no host callback here

    @property
    def stats(self) -> dict[str, Any]:
        return {
            "transport": "cuda-ipc",
            "mode": self.mode,
            "initiates": self.initiates,
            "paths": ",".join(self.paths),
            **self.counters,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        rank, peer = self.pair_rank, 1 - self.pair_rank
        drained = True
        try:
            drained = self._drain_issued()
            for f in self._live:
                f.status = FenceStatus.FAILED
            self._live.clear()
            if drained:
                self._mapped = []
                self._peer_event = None
            else:
                # A copy still on the stream (waiting on a dead peer's event that never
                # completes) must not find its memory unmapped: keep the mappings for the life
                # of the process rather than fault later.
                _ABANDONED.append((self._mapped, self._peer_event, self._tensors))
                log.error("pd_cuda_ipc_close_with_running_copy", peer_pid=self.peer_pid)
            bell = self._bell
            if bell is not None:
                bell.set_flag(rank)
                if drained:
                    bell.set_flag(2 + rank)
                if not self.initiates:
                    self._await_peer_unmapped(bell, peer)
        finally:
            self._dev.close(synchronize=drained)
            self._tensors = []
            self._event = None
            if self._bell is not None:
                self._bell.close()
                self._bell = None
        log.info("pd_transport_closed", transport="cuda-ipc", stats=self.stats)

    def _drain_issued(self) -> bool:
        """Wait, at most ``close_wait_s``, until every issued copy finished; False if one did
        not (its fence stays the device's to finish)."""
        deadline = self._now() + self.close_wait_s
        pause = threading.Event()
        for f in self._live:
            while f.done is not None and not self._dev.query(f.done):
                if self._now() >= deadline:
                    return False
                pause.wait(0.005)
        return True

    def _await_peer_unmapped(self, bell: Doorbell, peer: int) -> None:
        """The exporter outlives the peer's mappings: wait (bounded) until the initiator
        dropped them, or is gone."""
        if self.peer_pid == 0:
            return
        deadline = self._now() + self.close_wait_s
        pause = threading.Event()
        while not bell.flag(2 + peer) and process_start(self.peer_pid) == self._peer_start:
            if self._now() >= deadline:
                log.warning("pd_cuda_ipc_close_before_peer_unmapped", peer_pid=self.peer_pid)
                return
            pause.wait(0.005)


__all__ = [
    "MODES",
    "CudaIpcDevice",
    "CudaIpcTransport",
    "Doorbell",
    "IpcDevice",
    "IpcFence",
    "process_start",
    "token_of",
]
