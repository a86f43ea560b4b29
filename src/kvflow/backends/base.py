"""The backend protocol: what the runtime asks of a device.

A backend owns the engine's registered GPU-tier KV tensors and the CPU tier it allocates to match,
and moves whole blocks between them. Copies are submitted as batches on a per-direction copy
stream; each submission may wait on fences (device-side ordering, never a host block) and returns a
fence of its own. A fence is what a CUDA event is on a GPU: ``query`` says whether the work before
it has finished, and must be cheap and non-blocking because the reactor's ``poll`` calls it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from attrs import field, frozen

from kvflow.core.layout import KVLayout, LayerParts
from kvflow.core.protocol import GroupBlockIds
from kvflow.core.transfer import Direction


class FenceStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Fence(Protocol):
    """An opaque device-side point in a stream; only its backend can query it."""


@frozen
class CopyBatch:
    """Block copies of one direction, possibly from several transfers, submitted as one unit.

    ``gpu_block_ids[g][i]`` ↔ ``cpu_block_ids[g][i]`` in KV cache group ``g``; every region of the
    group is copied for each pair. A batch succeeds or fails as a whole.
    """

    direction: Direction
    gpu_block_ids: GroupBlockIds
    cpu_block_ids: GroupBlockIds
    checked: bool = field(default=False, kw_only=True)
    """The ids are tuples of ints already checked against this backend's registered layout and
    CPU tier (in range; kvflow's runtime sets it for the transfers of a plan its worker facade's
    ``PlanGate`` let through): the backend may skip checking them again, which for a
    512-block batch cost about as much as planning its copies. Never set it for ids from
    anywhere else."""

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.gpu_block_ids)


@runtime_checkable
class Backend(Protocol):
    """What the runtime needs from a device. Methods are called from the event loop's thread."""

    name: str

    def register_kv_caches(
        self,
        tensors: Mapping[str, Any],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None = None,
    ) -> KVLayout:
        """Register the engine's KV tensors (GPU tier); raises ``LayoutError`` naming a bad one."""
        ...

    def allocate_cpu_tier(self, num_blocks: Sequence[int]) -> None:
        """Allocate the CPU tier, ``num_blocks[g]`` block-major blocks for group ``g``."""
        ...

    def compute_fence(self) -> Fence:
        """A fence after all compute the engine has issued so far (stores wait on it).

        Unlike the other methods it may be called from the engine's own thread (the synchronous
        facade does, in ``wait_for_save``), so a GPU backend can record it on that thread's
        current stream.
        """
        ...

    def compute_wait(self, fence: Fence, timeout_s: float) -> bool:
        """The engine's compute issued after this call waits for ``fence`` (a batch of loads
        its forward reads). Called on the engine's thread, like ``compute_fence``. A GPU backend
        has the engine's current stream wait on the device; a backend whose compute is the
        host's blocks until the copies landed. Returns False if the batch is known to have
        failed (then nothing is waited for: its blocks are to be recomputed). Raises
        ``DeadlineError`` past ``timeout_s`` (real seconds) of host waiting."""
        ...

    def submit(self, batch: CopyBatch, wait_for: Sequence[Fence] = ()) -> Fence:
        """Queue ``batch`` on its direction's copy stream after ``wait_for``; return its fence."""
        ...

    def query(self, fence: Fence) -> FenceStatus:
        """Has the work before ``fence`` finished? Cheap, never blocks."""
        ...

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        """Optional: call ``wakeup`` (from any thread) when some fence may have completed.

        Backends that learn of completion by callback (the host backend's copy thread) use it to
        wake the reactor at once; backends that can only be polled (CUDA events) ignore it.
        """
        ...

    def close(self) -> None:
        """Wait for queued copies, free the CPU tier, unregister memory. Idempotent."""
        ...


@runtime_checkable
class CopiesInParts(Protocol):
    """A backend that can land a load part by part (optional): the engine's compute for a
    layer then waits only for the part holding that layer (``LayerParts``)."""

    def prepare_parts(self, parts: LayerParts) -> None:
        """Make now what landing loads in ``parts`` needs (called once, after registration),
        so that no load's submit does it; ``ConfigError`` if ``parts`` does not fit the
        registered layout."""
        ...

    def submit_parts(
        self, batch: CopyBatch, parts: LayerParts, wait_for: Sequence[Fence] = ()
    ) -> tuple[Fence, tuple[Fence, ...]]:
        """Queue ``batch`` as ``submit`` does, its copies cut into ``parts`` landing in order.
        Returns the batch's fence (done once every part is; failed if any part failed) and
        one fence per part, only for ``compute_wait`` (a part's failure shows there as
        False and on the batch's fence)."""
        ...


@runtime_checkable
class TimesCopies(Protocol):
    """A backend that measures its copies itself (optional): the copy throughput then comes from
    the time the copies took, not from when the runtime next looked at their fence."""

    def copy_seconds(self, fence: Fence) -> float | None:
        """Seconds the copies before ``fence`` (a finished one of this backend's ``submit``) took,
        counting time they overlapped the previous batch of their direction once; None if this
        batch was not measured. Called once per fence, after ``query`` said DONE."""
        ...


@runtime_checkable
class DatesCopies(Protocol):
    """A backend that knows when its copies ended (optional): a load's *landed* time, before the
    runtime saw its fence done, for a request's time-to-first-token breakdown."""

    def copy_landed_ago(self, fence: Fence) -> float | None:
        """How many seconds ago the copies before ``fence`` (a finished one of this backend's
        ``submit``) ended, ≥ 0; None if this backend cannot say for this batch. Called after
        ``query`` said DONE."""
        ...
