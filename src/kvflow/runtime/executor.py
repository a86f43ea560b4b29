"""The DMA executor actor: one task, one inbox, every copy submission in order.

The worker runtime hands it one ``CopyOrder`` per step and direction; the actor turns it into
backend submissions, each fenced on the device (never by blocking the host):

- a store waits for its step's compute fence (it must not read a block compute still writes);
- a load waits for every in-flight store that still reads one of its destination GPU blocks
  (and for an in-flight load still writing one);
- a store waits for an in-flight load still writing one of its source GPU blocks.

An order's transfers are coalesced into one ``CopyBatch`` (one submit, one fence). A batch fails
as a whole, so a failed coalesced batch fails every transfer in it: never a false success, at
the price of recomputing / re-storing its neighbours. ``coalesce=False`` submits one batch per
transfer where exact failure attribution matters more than submission count.

Completions arrive through the reactor as callbacks; ``flush()`` is a barrier in the inbox that
returns once everything queued before it has been submitted and has finished.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from attrs import define, field, frozen

from kvflow.backends.base import (
    Backend,
    CopiesInParts,
    CopyBatch,
    DatesCopies,
    Fence,
    FenceStatus,
    TimesCopies,
)
from kvflow.core.layout import LayerParts
from kvflow.core.logs import get_logger
from kvflow.core.protocol import TransferSpec
from kvflow.core.transfer import Direction
from kvflow.errors import ClosedError
from kvflow.runtime.clock import SystemClock
from kvflow.runtime.reactor import Reactor

log = get_logger("kvflow.executor")

GroupIds = tuple[tuple[int, ...], ...]
"""GPU block ids per KV cache group"""

DoneCallback = Callable[[Sequence[TransferSpec], FenceStatus, str, float | None], None]
"""``(transfers, DONE or FAILED, cause, landed)``: called on the loop thread when a batch has
finished; ``landed`` is when a finished load batch's copies ended on the executor's clock, where
the backend dates its copies (``DatesCopies``), else None (always None for a store: no one reads
a store's landing)."""


@frozen
class CopyOrder:
    """One step's transfers of one direction, to submit after ``wait_for``."""

    step: int
    direction: Direction
    transfers: tuple[TransferSpec, ...]
    wait_for: tuple[Fence, ...] = ()
    fenced: frozenset[int] = frozenset()  # transfers the engine's compute waits for
    checked: bool = False  # ids checked against the layout and tier (``CopyBatch.checked``)


@frozen
class FencedBatch:
    """A submitted batch holding fenced loads: its fence (settled by the reactor) and the
    fences the engine's compute waits on: its parts' in layer order, or the batch's own."""

    fence: Fence
    parts: tuple[Fence, ...]


@frozen
class _Flush:
    done: anyio.Event


_Command = CopyOrder | _Flush


def coalesce(
    transfers: Sequence[TransferSpec], direction: Direction, checked: bool = False
) -> CopyBatch:
    """One ``CopyBatch`` holding every block pair of ``transfers``, group by group
    (``checked``: see ``CopyBatch.checked``)."""
    if len(transfers) == 1:
        # A step's one store or load (the common case): its id tuples are the batch's.
        (t,) = transfers
        return CopyBatch(direction, t.gpu_block_ids, t.cpu_block_ids, checked=checked)
    n_groups = max((len(t.gpu_block_ids) for t in transfers), default=0)
    gpu: list[list[int]] = [[] for _ in range(n_groups)]
    cpu: list[list[int]] = [[] for _ in range(n_groups)]
    for t in transfers:
        for g, (gids, cids) in enumerate(zip(t.gpu_block_ids, t.cpu_block_ids, strict=True)):
            gpu[g].extend(gids)
            cpu[g].extend(cids)
    return CopyBatch(
        direction=direction,
        gpu_block_ids=tuple(tuple(g) for g in gpu),
        cpu_block_ids=tuple(tuple(c) for c in cpu),
        checked=checked,
    )


@define(eq=False)
class CopyThroughput:
    """What one direction's copies achieved: blocks per group moved, the time copies of this
    direction were in flight (the union of submit → fence-seen intervals, so overlapping batches
    count once), and the copy time the backend measured itself (``TimesCopies``: CUDA events
    around the copies, the host backend's copy thread) for the batches it measured."""

    blocks: list[int] = field(factory=list)  # per KV cache group
    busy_s: float = 0.0
    batches: int = 0
    copy_s: float = 0.0
    measured_batches: int = 0
    _last_end: float = float("-inf")

    def observe(
        self,
        start: float,
        end: float,
        blocks_per_group: Sequence[int],
        copy_s: float | None = None,
    ) -> None:
        self.busy_s += max(0.0, end - max(start, self._last_end))
        self._last_end = max(self._last_end, end)
        self.batches += 1
        if copy_s is not None:
            self.copy_s += copy_s
            self.measured_batches += 1
        if len(self.blocks) < len(blocks_per_group):
            self.blocks += [0] * (len(blocks_per_group) - len(self.blocks))
        for g, n in enumerate(blocks_per_group):
            self.blocks[g] += n


@frozen
class CopyStats:
    """One direction's copies so far, as a caller reads them (``WorkerRuntime.copy_stats``).

    ``copy_s``: the copy time the backend measured (CUDA events around each batch's copies; the
    host backend's copy thread), over ``measured_batches`` of the ``batches``; ``in_flight_s``:
    submit → fence seen done, which also counts the time until the runtime looked.
    """

    bytes: int
    copy_s: float
    in_flight_s: float
    batches: int
    measured_batches: int

    @property
    def measured(self) -> bool:
        """Every batch's copy time came from the backend's own timing."""
        return self.batches > 0 and self.measured_batches == self.batches

    @property
    def seconds(self) -> float:
        """The measured copy time where every batch was measured, else the time in flight."""
        return self.copy_s if self.measured else self.in_flight_s

    @property
    def gbps(self) -> float:
        """Bytes / ``seconds``, in GB/s (0 when nothing was copied)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@define(eq=False)
class DmaExecutor:
    """The actor. ``run()`` in a task; ``enqueue`` / ``flush`` / ``close`` from the loop thread."""

    backend: Backend
    reactor: Reactor
    on_done: DoneCallback
    coalesce: bool = True
    now: Callable[[], float] = field(factory=lambda: SystemClock().now)
    """Reads the time a batch was in flight (the executor never sleeps: no ``Clock``)."""
    _send: MemoryObjectSendStream[_Command] = field(init=False)
    _recv: MemoryObjectReceiveStream[_Command] = field(init=False)
    # In-flight batches by direction: fence id → (fence, its GPU block ids per group). Kept per
    # batch, not per block: a step's store holds hundreds of blocks, and only a load (rare next
    # to stores) has to look for overlaps, with set operations that run in C.
    _in_flight: dict[Direction, dict[int, tuple[Fence, GroupIds]]] = field(
        factory=lambda: {d: {} for d in Direction}
    )
    _queued: int = 0  # orders in the inbox, not yet submitted
    _flushes: int = 0  # flush barriers in the inbox or waited on by the actor
    _closed: bool = False
    _outstanding: int = 0  # batches submitted, not yet finished
    # Made by the first waiter for the outstanding batches to finish, set and dropped once they
    # have: an event per batch would cost every store's launch an async-library lookup.
    _no_outstanding: anyio.Event | None = None
    _stopped: anyio.Event = field(factory=anyio.Event)
    _cancelling: bool = False
    # Orders with fenced loads queued and not yet submitted, and the fences of those submitted
    # (``take_fenced``): the engine's compute waits for them before its forward.
    _fenced_queued: int = 0
    _fenced_submitted: anyio.Event = field(factory=anyio.Event)
    _fenced: list[FencedBatch] = field(factory=list)
    parts: LayerParts | None = None
    """Where set (``WorkerRuntime.register_kv_caches``; the backend ``CopiesInParts``), a batch
    holding fenced loads lands part by part, and ``take_fenced`` gives each part's fence."""
    submits: int = 0  # backend.submit calls, for tests and the benchmark
    throughput: dict[Direction, CopyThroughput] = field(
        factory=lambda: {d: CopyThroughput() for d in Direction}
    )

    _timer: TimesCopies | None = field(init=False, default=None)
    _dater: DatesCopies | None = field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._send, self._recv = anyio.create_memory_object_stream[_Command](math.inf)
        # Checked once: a protocol isinstance costs microseconds.
        self._timer = self.backend if isinstance(self.backend, TimesCopies) else None
        self._dater = self.backend if isinstance(self.backend, DatesCopies) else None
        self._fenced_submitted.set()

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def fenced_queued(self) -> int:
        """Queued orders holding fenced loads, not yet submitted."""
        return self._fenced_queued

    async def fenced_submitted(self) -> None:
        """Return once no order holding fenced loads waits in the inbox."""
        await self._fenced_submitted.wait()

    def take_fenced(self) -> list[FencedBatch]:
        """The batches of fenced loads submitted since the last call."""
        fences, self._fenced = self._fenced, []
        return fences

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def can_submit_now(self) -> bool:
        """``submit_now`` would keep the inbox's order: nothing is queued ahead of it (no order,
        no flush barrier) and the executor takes orders."""
        return not (self._queued or self._flushes or self._closed)

    # -- the inbox ----------------------------------------------------------------------------
    def submit_now(self, order: CopyOrder) -> None:
        """Submit ``order`` on the caller's thread, now, without the actor's loop turn: for a
        loop stepped from the engine's thread (``InlineSyncWorker``), where that turn costs the
        engine more than the submit. Only while ``can_submit_now``; the caller has launched
        the order's transfers (a refused or empty batch settles them before this returns)."""
        if not self.can_submit_now:
            raise ClosedError("DMA executor: an order submitted now would overtake the inbox")
        if order.transfers:
            self._submit_order(order)

    def enqueue(self, order: CopyOrder) -> None:
        """Queue ``order``; never blocks. Raises ``ClosedError`` once the executor is closing."""
        if not order.transfers:
            return
        try:
            self._send.send_nowait(order)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise ClosedError("DMA executor is closed") from exc
        self._queued += 1
        if order.fenced:
            if not self._fenced_queued:
                self._fenced_submitted = anyio.Event()
            self._fenced_queued += 1
        log.debug(
            "copy_order_queued",
            step=order.step,
            direction=order.direction.value,
            transfers=len(order.transfers),
        )

    async def flush(self) -> None:
        """Return once every order queued so far has been submitted and has finished."""
        done = anyio.Event()
        try:
            self._send.send_nowait(_Flush(done))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise ClosedError("DMA executor is closed") from exc
        self._flushes += 1
        log.debug("flush_requested", queued=self._queued, outstanding=self._outstanding)
        await done.wait()

    def close(self, *, drain: bool = True) -> None:
        """Stop taking orders. ``drain``: submit what is queued; else fail it (cause ``shutdown``)."""
        self._cancelling = self._cancelling or not drain
        self._closed = True
        self._send.close()

    async def wait_closed(self) -> None:
        """Wait until the actor has left its loop and every submitted batch has finished."""
        await self._stopped.wait()
        await self._drained()

    async def _drained(self) -> None:
        """Return once no submitted batch is outstanding."""
        if self._outstanding:
            if self._no_outstanding is None:
                self._no_outstanding = anyio.Event()
            await self._no_outstanding.wait()

    # -- the actor ---------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            async with self._recv:
                async for cmd in self._recv:
                    if isinstance(cmd, _Flush):
                        # Everything queued before the barrier is submitted by now.
                        await self._drained()
                        self._flushes -= 1
                        cmd.done.set()
                        log.debug("flush_done")
                        continue
                    self._queued -= 1
                    if self._cancelling:
                        self._finish(cmd.transfers, FenceStatus.FAILED, "shutdown")
                    else:
                        self._submit_order(cmd)
                    if cmd.fenced:
                        self._fenced_queued -= 1
                        if not self._fenced_queued:
                            self._fenced_submitted.set()
        finally:
            self._stopped.set()
            self._fenced_submitted.set()  # a waiter finds what was submitted, and goes on

    def _submit_order(self, order: CopyOrder) -> None:
        if self.coalesce:
            self._submit(order, order.transfers)
        else:
            for t in order.transfers:
                self._submit(order, (t,))

    def _submit(self, order: CopyOrder, transfers: Sequence[TransferSpec]) -> None:
        batch = coalesce(transfers, order.direction, order.checked)
        if batch.num_blocks == 0:
            self._finish(transfers, FenceStatus.DONE, "no_blocks")
            return
        gpu = batch.gpu_block_ids
        wait_for = [*order.wait_for, *self._conflicts(gpu, order.direction)]
        self._outstanding += 1
        fenced = bool(order.fenced) and any(t.transfer_id in order.fenced for t in transfers)
        parts = self.parts if fenced else None
        started = self.now()  # before submit: a copy thread may start at once
        try:
            if parts is not None:
                backend = self.backend
                assert isinstance(backend, CopiesInParts)
                fence, part_fences = backend.submit_parts(batch, parts, wait_for)
            else:
                fence = self.backend.submit(batch, wait_for)
                part_fences = (fence,)
        except Exception as exc:  # a refused submit fails its transfers, never the actor
            log.warning(
                "copy_submit_failed",
                step=order.step,
                direction=order.direction.value,
                error=f"{type(exc).__name__}: {exc}",
            )
            self._batch_finished(transfers, FenceStatus.FAILED, "submit_error", None)
            return
        self.submits += 1
        self._in_flight[order.direction][id(fence)] = (fence, gpu)
        if fenced:
            self._fenced.append(FencedBatch(fence, part_fences))
        # Guarded: with structlog configured, a filtered-out call still binds a logger.
        if log.debug_enabled():
            log.debug(
                "copy_batch_submitted",
                step=order.step,
                direction=order.direction.value,
                transfers=len(transfers),
                blocks=batch.num_blocks,
                waits=len(wait_for),
            )
        per_group = [len(ids) for ids in batch.gpu_block_ids]
        stats = self.throughput[order.direction]

        timer = self._timer
        # Only a load's landing is read (a request's TTFT); dating a store would cost a clock
        # mark's placement, and now and then a new mark, for nothing.
        dater = self._dater if order.direction is Direction.LOAD else None

        def finished(status: FenceStatus) -> None:
            landed = None
            if status is FenceStatus.DONE:
                measured = timer.copy_seconds(fence) if timer is not None else None
                seen = self.now()
                stats.observe(started, seen, per_group, measured)
                ago = dater.copy_landed_ago(fence) if dater is not None else None
                if ago is not None:
                    landed = max(started, seen - ago)  # clocks a few µs apart: not before submit
            self._batch_finished(
                transfers,
                status,
                "fence_done" if status is FenceStatus.DONE else "fence_failed",
                (order.direction, fence),
                landed,
            )

        self.reactor.watch(fence, finished)

    def _conflicts(self, gpu: GroupIds, direction: Direction) -> list[Fence]:
        """In-flight copies a new one must follow on the device: a load waits for stores still
        reading and loads still writing its GPU blocks; a store waits for loads still writing
        them. (Two stores of one block only read it and need no order.)"""
        in_flight = self._in_flight
        others = [in_flight[Direction.LOAD]]
        if direction is Direction.LOAD:
            others.append(in_flight[Direction.STORE])
        if not any(others):
            return []  # the common case (stores only): no set is built
        mine = [frozenset(ids) for ids in gpu]
        return [
            fence
            for batches in others
            for fence, theirs in batches.values()
            if any(m and not m.isdisjoint(ids) for m, ids in zip(mine, theirs, strict=False))
        ]

    def _batch_finished(
        self,
        transfers: Sequence[TransferSpec],
        status: FenceStatus,
        cause: str,
        submitted: tuple[Direction, Fence] | None,
        landed: float | None = None,
    ) -> None:
        if submitted is not None:
            direction, fence = submitted
            del self._in_flight[direction][id(fence)]
        self._outstanding -= 1
        if log.debug_enabled():
            log.debug("copy_batch_finished", transfers=len(transfers), status=status.value)
        if self._outstanding == 0 and self._no_outstanding is not None:
            self._no_outstanding.set()
            self._no_outstanding = None
        self._finish(transfers, status, cause, landed)

    def _finish(
        self,
        transfers: Sequence[TransferSpec],
        status: FenceStatus,
        cause: str,
        landed: float | None = None,
    ) -> None:
        self.on_done(transfers, status, cause, landed)


__all__ = ["CopyOrder", "CopyStats", "CopyThroughput", "DmaExecutor", "FencedBatch", "coalesce"]
