"""Messages between the scheduler-side manager and the workers.

Each engine step the scheduler sends one ``StepPlan`` to every worker (rank); each worker answers
with a ``StepReport``. ``aggregate`` merges the reports of many ranks and rejects a rank that
reports the same transfer twice. All messages are frozen attrs classes of plain data, so they
pickle and travel between processes unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import cast

from attrs import field, frozen

from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError, ReportError

BlockIds = tuple[int, ...]
GroupBlockIds = tuple[BlockIds, ...]
"""Block ids per KV cache group: ``ids[g]`` are the blocks of group ``g``."""


def _is_group_ids(value: object) -> bool:
    """Whether ``value`` is already a tuple of tuples of ints (plain loops: no generators)."""
    if type(value) is not tuple:
        return False
    for group in value:
        if type(group) is not tuple:
            return False
        for b in group:
            if type(b) is not int:
                return False
    return True


def _as_group_ids(value: Iterable[Iterable[int]]) -> GroupBlockIds:
    if _is_group_ids(value):
        # What kvflow itself passes, several times a step: immutable already, kept as is.
        return cast(GroupBlockIds, value)
    try:
        # ``operator.index``: ints of any kind (numpy's too), never a float, str or bool.
        return tuple([tuple(map(_block_id, group)) for group in value])
    except TypeError as exc:
        raise ConfigError(f"block ids must be one sequence of ints per group: {exc}") from None


def _block_id(b: object) -> int:
    if isinstance(b, bool):
        raise TypeError(f"block id {b!r} is a bool")
    return operator.index(b)  # type: ignore[arg-type]


@frozen
class TransferSpec:
    """One transfer as the workers see it: which GPU blocks pair with which CPU blocks.

    ``gpu_block_ids[g][i]`` and ``cpu_block_ids[g][i]`` are the two ends of one block copy in KV
    cache group ``g``; the direction says which end is read.
    """

    transfer_id: int
    request_id: str
    direction: Direction
    gpu_block_ids: GroupBlockIds = field(converter=_as_group_ids)
    cpu_block_ids: GroupBlockIds = field(converter=_as_group_ids)

    def __attrs_post_init__(self) -> None:
        if len(self.gpu_block_ids) != len(self.cpu_block_ids):
            raise ConfigError(
                f"transfer {self.transfer_id}: {len(self.gpu_block_ids)} GPU groups but "
                f"{len(self.cpu_block_ids)} CPU groups"
            )
        for g, (gpu, cpu) in enumerate(zip(self.gpu_block_ids, self.cpu_block_ids, strict=True)):
            if len(gpu) != len(cpu):
                raise ConfigError(
                    f"transfer {self.transfer_id} group {g}: {len(gpu)} GPU blocks but "
                    f"{len(cpu)} CPU blocks"
                )
            if min(gpu, default=0) < 0 or min(cpu, default=0) < 0:
                raise ConfigError(f"transfer {self.transfer_id} group {g}: negative block id")

    @classmethod
    def trusted(
        cls,
        transfer_id: int,
        request_id: str,
        direction: Direction,
        gpu_block_ids: GroupBlockIds,
        cpu_block_ids: GroupBlockIds,
    ) -> TransferSpec:
        """The same spec without converting or checking the ids, for kvflow's manager, whose
        store and load specs pair tuples of the engine's checked GPU ids with tuples of CPU ids
        from its own pool, group by group and of equal lengths: checking them cost as much as
        planning the rest of the transfer. Anything else must go through the constructor."""
        self = object.__new__(cls)
        setattr_ = object.__setattr__
        setattr_(self, "transfer_id", transfer_id)
        setattr_(self, "request_id", request_id)
        setattr_(self, "direction", direction)
        setattr_(self, "gpu_block_ids", gpu_block_ids)
        setattr_(self, "cpu_block_ids", cpu_block_ids)
        return self

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.gpu_block_ids)

    @property
    def src_block_ids(self) -> GroupBlockIds:
        return self.gpu_block_ids if self.direction is Direction.STORE else self.cpu_block_ids

    @property
    def dst_block_ids(self) -> GroupBlockIds:
        return self.cpu_block_ids if self.direction is Direction.STORE else self.gpu_block_ids


@frozen
class StepPlan:
    """Everything the workers must do for one engine step.

    ``stores`` are fenced after this step's compute; ``loads`` after any in-flight store that still
    reads their GPU blocks. ``flush`` (a request was preempted) means: before the engine reuses any
    GPU block, wait for every copy already handed over, including ones not yet submitted.
    ``abandoned`` lists transfers whose results nobody wants any more. ``fenced_loads``: the
    loads (transfer ids) this step's forward pass reads: ``start_load_kv`` makes the engine's
    compute wait for their copies (on a GPU, a wait on the device, not the host).
    """

    step: int
    stores: tuple[TransferSpec, ...] = ()
    loads: tuple[TransferSpec, ...] = ()
    flush: bool = False
    abandoned: tuple[int, ...] = ()
    fenced_loads: tuple[int, ...] = ()


@frozen
class StepReport:
    """What one rank finished since its last report.

    ``invalid_block_ids`` are GPU block ids whose loaded contents cannot be trusted (their load
    failed): the engine recomputes them. ``landed``: (request id, when its completed load's copies
    ended, on the worker's clock) where the backend dates its copies: a time-to-first-token
    breakdown's "landed", before the worker saw the load finish.
    """

    rank: int
    completed: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    invalid_block_ids: frozenset[int] = frozenset()
    landed: tuple[tuple[str, float], ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.rank < 0:
            raise ReportError(f"report from negative rank {self.rank}")
        both = set(self.completed) & set(self.failed)
        if both:
            raise ReportError(f"rank {self.rank} reports {sorted(both)} as completed and failed")
        if len(set(self.completed)) != len(self.completed) or len(set(self.failed)) != len(
            self.failed
        ):
            raise ReportError(f"rank {self.rank} lists a transfer twice in one report")
        if self.landed and len(dict(self.landed)) != len(self.landed):
            raise ReportError(f"rank {self.rank} dates a request's landed load twice in one report")


def latest_landed(
    reports: Iterable[StepReport], requests: frozenset[str] | None = None
) -> dict[str, float]:
    """Each request's latest landed time in ``reports`` (only ``requests``' where given)."""
    out: dict[str, float] = {}
    for r in reports:
        for request_id, t in r.landed:
            if requests is None or request_id in requests:
                out[request_id] = max(t, out.get(request_id, t))
    return out


def merge_reports(rank: int, reports: Sequence[StepReport]) -> StepReport:
    """One rank's reports of several polls as one report (a request's latest landed time)."""
    landed = latest_landed(reports)
    return StepReport(
        rank=rank,
        completed=tuple(t for r in reports for t in r.completed),
        failed=tuple(t for r in reports for t in r.failed),
        invalid_block_ids=frozenset(b for r in reports for b in r.invalid_block_ids),
        landed=tuple(landed.items()),
    )


@frozen
class AggregatedReport:
    """Reports of several ranks merged: for each transfer, the ranks that finished it."""

    completed: dict[int, frozenset[int]]
    failed: dict[int, frozenset[int]]
    invalid_block_ids: frozenset[int]


def aggregate(reports: Iterable[StepReport], world_size: int) -> AggregatedReport:
    """Merge the reports of ranks ``0 .. world_size-1``; a rank naming a transfer twice is an error."""
    completed: dict[int, set[int]] = {}
    failed: dict[int, set[int]] = {}
    invalid: set[int] = set()
    for report in reports:
        if not isinstance(report, StepReport):
            raise ReportError(f"a report must be a StepReport, got {type(report).__name__}")
        if report.rank >= world_size:
            raise ReportError(f"report from rank {report.rank}, world size is {world_size}")
        for tid in report.completed:
            ranks = completed.setdefault(tid, set())
            if report.rank in ranks or report.rank in failed.get(tid, ()):
                raise ReportError(f"rank {report.rank} reported transfer {tid} twice")
            ranks.add(report.rank)
        for tid in report.failed:
            ranks = failed.setdefault(tid, set())
            if report.rank in ranks or report.rank in completed.get(tid, ()):
                raise ReportError(f"rank {report.rank} reported transfer {tid} twice")
            ranks.add(report.rank)
        invalid |= report.invalid_block_ids
    return AggregatedReport(
        completed={t: frozenset(r) for t, r in completed.items()},
        failed={t: frozenset(r) for t, r in failed.items()},
        invalid_block_ids=frozenset(invalid),
    )


__all__ = [
    "AggregatedReport",
    "BlockIds",
    "GroupBlockIds",
    "StepPlan",
    "StepReport",
    "TransferSpec",
    "aggregate",
    "latest_landed",
    "merge_reports",
]
