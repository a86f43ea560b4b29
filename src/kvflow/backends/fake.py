"""A deterministic backend for tests: nothing finishes until the test says so.

Copies and compute are modelled, not performed: every GPU and CPU block carries a *version*. The
engine's compute writes new versions (``write``) that land only when a later ``compute_fence``
completes; a copy moves versions from its source blocks to its destination blocks when it runs.
A copy runs once the test releases its fence (``release``, ``fail``, ``release_at`` on the clock)
and every fence it waits for has finished. The backend records a *violation* when a copy reads a
GPU block whose compute write was still pending when the copy was submitted (a store not fenced
after compute reads stale data), or when it runs before an earlier-submitted copy of the same GPU
block that it conflicts with has finished (a load overwriting a block a store still reads, a
store reading a block a load still writes, two loads writing one block). ``auto_complete`` runs everything at once (benchmarks).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence

from attrs import define, field

from kvflow.backends.base import CopyBatch, Fence, FenceStatus
from kvflow.backends.torch_layout import describe
from kvflow.core.layout import KVLayout, LayerParts, TensorDesc, derive_layout
from kvflow.core.logs import get_logger
from kvflow.core.transfer import Direction
from kvflow.errors import BackendError, ClosedError, ConfigError

log = get_logger("kvflow.backend.fake")

BlockKey = tuple[int, int]
"""(group, block id)"""

GARBAGE = -1
"""The version a failed load leaves in its destination blocks."""


@define(eq=False, slots=True)
class FakeFence:
    """A fence of the fake backend: a compute point or one submitted copy batch."""

    fence_id: int
    kind: str  # "compute", "copy", or "part" (one part of a copy batch: ``wait_for[0]``)
    batch: CopyBatch | None = None
    wait_for: tuple[FakeFence, ...] = ()
    status: FenceStatus = FenceStatus.PENDING
    released: bool = False
    fail: bool = False
    release_at: float | None = None
    landed: float | None = None  # on ``now``'s clock: ``release_at``, else when it ran
    writes: list[tuple[BlockKey, int]] = field(factory=list)  # compute: versions it lands
    stale_if_pending: list[tuple[BlockKey, FakeFence | None]] = field(factory=list)
    must_follow: list[tuple[BlockKey, FakeFence]] = field(
        factory=list
    )  # earlier copies, same block

    @property
    def done(self) -> bool:
        return self.status is not FenceStatus.PENDING


def _desc(name: str, tensor: object) -> TensorDesc:
    return tensor if isinstance(tensor, TensorDesc) else describe(name, tensor)


@define(eq=False)
class FakeBackend:
    """Deterministic ``Backend``: fences finish when the test releases them (or at a time ``now``
    reads: a test passes its ``FakeClock``'s ``now``)."""

    now: Callable[[], float] | None = None
    auto_complete: bool = False
    name: str = "fake"
    layout: KVLayout | None = None
    cpu_blocks: tuple[int, ...] = ()
    gpu_version: dict[BlockKey, int] = field(factory=dict)
    cpu_version: dict[BlockKey, int] = field(factory=dict)
    submitted: list[FakeFence] = field(factory=list)
    compute_waits: list[FakeFence] = field(factory=list)  # ``compute_wait``'s fences, in order
    parted: list[tuple[FakeFence, LayerParts]] = field(factory=list)  # ``submit_parts``' batches
    prepared: list[LayerParts] = field(factory=list)  # ``prepare_parts``' calls
    violations: list[str] = field(factory=list)
    queries: int = 0
    closed: bool = False
    pushes_completions: bool = False  # True: behave like a backend that wakes on every finish
    _ids: itertools.count[int] = field(factory=lambda: itertools.count(1))
    _versions: itertools.count[int] = field(factory=lambda: itertools.count(1))
    _pending_writes: list[tuple[BlockKey, int]] = field(factory=list)
    _unfenced: dict[BlockKey, FakeFence | None] = field(factory=dict)  # write not yet landed
    _live: list[FakeFence] = field(factory=list)
    _wakeup: Callable[[], None] | None = None

    # -- Backend protocol -------------------------------------------------------------------
    def register_kv_caches(
        self,
        tensors: Mapping[str, object],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None = None,
    ) -> KVLayout:
        descs = {name: _desc(name, t) for name, t in tensors.items()}
        self.layout = derive_layout(descs, num_blocks, groups)
        return self.layout

    def allocate_cpu_tier(self, num_blocks: Sequence[int]) -> None:
        if self.layout is None:
            raise BackendError("allocate_cpu_tier before register_kv_caches")
        if len(num_blocks) != len(self.layout.groups):
            raise ConfigError(
                f"CPU tier sizes for {len(num_blocks)} groups, layout has {len(self.layout.groups)}"
            )
        self.cpu_blocks = tuple(num_blocks)

    def compute_fence(self) -> FakeFence:
        self._check_open()
        fence = FakeFence(next(self._ids), "compute", writes=self._pending_writes)
        self._pending_writes = []
        for key, _ in fence.writes:
            self._unfenced[key] = fence
        self._live.append(fence)
        if self.auto_complete:
            self._finish(fence)
        return fence

    def compute_wait(self, fence: Fence, timeout_s: float) -> bool:
        """Noted (``compute_waits``): the fake has no compute to hold back. False for a fence
        already failed."""
        self._check_open()
        own = self._own(fence)
        self.compute_waits.append(own)
        return own.status is not FenceStatus.FAILED

    def submit(self, batch: CopyBatch, wait_for: Sequence[Fence] = ()) -> FakeFence:
        self._check_open()
        deps = tuple(self._own(f) for f in wait_for)
        fence = FakeFence(next(self._ids), "copy", batch=batch, wait_for=deps)
        gpu_keys = [(g, b) for g, ids in enumerate(batch.gpu_block_ids) for b in ids]
        if batch.direction is Direction.STORE:
            fence.stale_if_pending = [
                (k, self._unfenced[k]) for k in gpu_keys if k in self._unfenced
            ]
        wanted = set(gpu_keys)
        fence.must_follow = [
            (k, f)
            for f in self._live
            if f.batch is not None and Direction.LOAD in (f.batch.direction, batch.direction)
            for k in self._gpu_keys(f.batch)
            if k in wanted
        ]
        self.submitted.append(fence)
        self._live.append(fence)
        log.debug(
            "fake_submit",
            fence_id=fence.fence_id,
            direction=batch.direction.value,
            blocks=batch.num_blocks,
            wait_for=[d.fence_id for d in deps],
        )
        if self.auto_complete:
            self.release(fence)
        return fence

    def prepare_parts(self, parts: LayerParts) -> None:
        """Noted (``prepared``): the fake has nothing to make ahead."""
        self.prepared.append(parts)

    def submit_parts(
        self, batch: CopyBatch, parts: LayerParts, wait_for: Sequence[Fence] = ()
    ) -> tuple[FakeFence, tuple[FakeFence, ...]]:
        """``submit``, with one fence per part (``CopiesInParts``): the parts land when the
        batch runs, with its status (``parted`` notes the batch and its parts)."""
        fence = self.submit(batch, wait_for)
        part_fences = tuple(
            FakeFence(next(self._ids), "part", wait_for=(fence,), released=True)
            for _ in parts.spans
        )
        self.parted.append((fence, parts))
        self._live.extend(part_fences)
        self._advance()
        return fence, part_fences

    def query(self, fence: Fence) -> FenceStatus:
        self.queries += 1
        f = self._own(fence)
        if (
            not f.released
            and f.release_at is not None
            and self.now is not None
            and self.now() >= f.release_at
        ):
            self.release(f)
        return f.status

    def copy_landed_ago(self, fence: Fence) -> float | None:
        """Seconds on ``now``'s clock since the batch's copies ran (``DatesCopies``): from the
        ``release_at`` time that let it run, so a test sees a load land before a poll saw it;
        None without a clock."""
        f = self._own(fence)
        if f.landed is None or self.now is None:
            return None
        return max(0.0, self.now() - f.landed)

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        self._wakeup = wakeup

    def close(self) -> None:
        self.closed = True

    # -- what a test does -------------------------------------------------------------------
    def write(self, gpu_block_ids: Iterable[int], group: int = 0) -> int:
        """Compute (not yet fenced) writes a new version into GPU blocks; returns that version."""
        version = next(self._versions)
        for b in gpu_block_ids:
            self._pending_writes.append(((group, b), version))
            self._unfenced[(group, b)] = None
        return version

    def release(self, fence: Fence) -> None:
        """Let ``fence``'s work run: now if what it waits for has finished, else right after."""
        f = self._own(fence)
        f.released = True
        self._advance()

    def fail(self, fence: Fence) -> None:
        """Release ``fence`` so that its copy fails (a failed load leaves garbage behind)."""
        f = self._own(fence)
        f.fail = True
        self.release(f)

    def release_at(self, fence: Fence, when: float) -> None:
        """Release ``fence`` once ``now`` reads ``when`` (seen by the next ``query``)."""
        if self.now is None:
            raise ConfigError("release_at needs a FakeBackend built with a clock's now")
        self._own(fence).release_at = when

    def release_all(self) -> None:
        """Release every fence not yet released."""
        for f in list(self._live):
            f.released = True
        self._advance()

    @property
    def pending(self) -> list[FakeFence]:
        """Fences submitted or recorded and not finished, oldest first."""
        return [f for f in self._live if not f.done]

    # -- the model ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError("fake backend is closed")

    def _own(self, fence: Fence) -> FakeFence:
        if not isinstance(fence, FakeFence):
            raise BackendError(f"not a fence of the fake backend: {fence!r}")
        return fence

    @staticmethod
    def _gpu_keys(batch: CopyBatch) -> list[BlockKey]:
        return [(g, b) for g, ids in enumerate(batch.gpu_block_ids) for b in ids]

    def _advance(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for f in list(self._live):
                if f.released and not f.done and all(d.done for d in f.wait_for):
                    self._finish(f)
                    progressed = True
        if self._wakeup is not None:
            self._wakeup()

    def _finish(self, f: FakeFence) -> None:
        if f.kind == "part":
            f.status = f.wait_for[0].status
        elif f.kind == "compute":
            for key, version in f.writes:
                self.gpu_version[key] = version
                if self._unfenced.get(key) is f:
                    del self._unfenced[key]
            f.status = FenceStatus.DONE
        else:
            if self.now is not None:
                at = self.now()
                f.landed = at if f.release_at is None else min(f.release_at, at)
            self._run_copy(f)
        if f in self._live:
            self._live.remove(f)

    @staticmethod
    def _overlap_message(f: FakeFence, earlier: FakeFence, key: BlockKey) -> str:
        assert f.batch is not None
        assert earlier.batch is not None
        if f.batch.direction is Direction.STORE:
            what = f"store {f.fence_id} read GPU block {key}"
        else:
            what = f"load {f.fence_id} overwrote GPU block {key}"
        if earlier.batch.direction is Direction.STORE:
            return f"{what} while store {earlier.fence_id} was still reading it"
        return f"{what} while load {earlier.fence_id} was still writing it"

    def _run_copy(self, f: FakeFence) -> None:
        batch = f.batch
        assert batch is not None
        for key, writer in f.stale_if_pending:
            if writer is None or not writer.done:
                self.violations.append(
                    f"copy {f.fence_id} read GPU block {key} before the compute writing it finished"
                )
        for key, earlier in f.must_follow:
            if not earlier.done:
                self.violations.append(self._overlap_message(f, earlier, key))
        pairs = [
            ((g, gb), (g, cb))
            for g, (gids, cids) in enumerate(
                zip(batch.gpu_block_ids, batch.cpu_block_ids, strict=True)
            )
            for gb, cb in zip(gids, cids, strict=True)
        ]
        out_of_range = self.layout is not None and any(
            gb >= self.layout.groups[g].num_blocks or (self.cpu_blocks and cb >= self.cpu_blocks[g])
            for (g, gb), (_, cb) in pairs
        )
        if f.fail or out_of_range:
            if batch.direction is Direction.LOAD:
                for gkey, _ in pairs:
                    self.gpu_version[gkey] = GARBAGE
            f.status = FenceStatus.FAILED
            log.debug("fake_copy_failed", fence_id=f.fence_id)
            return
        for gkey, ckey in pairs:
            if batch.direction is Direction.STORE:
                self.cpu_version[ckey] = self.gpu_version.get(gkey, 0)
            else:
                self.gpu_version[gkey] = self.cpu_version.get(ckey, 0)
        f.status = FenceStatus.DONE


__all__ = ["GARBAGE", "FakeBackend", "FakeFence"]
