"""Boundary checks: pure functions that validate what an engine hands kvflow, before any state
changes.

Every engine-facing call checks its whole input with these first and either applies all of it or
raises: ``ConfigError`` for a bad value (an id out of range or given twice, a count that is not
an int, a shape that does not match), ``ProtocolError`` for a call out of order (a plan replayed
or bound before the KV caches were registered). Each error names the call, the request or
transfer, the group and the value. The checks cost work proportional to the ids they are given:
the decode hot path hands them only the entries that carry new block ids.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar, cast

from kvflow.core.idruns import EVERY_CAP, ascending_runs, every
from kvflow.core.protocol import GroupBlockIds, StepPlan, TransferSpec
from kvflow.core.requests import SchedulerOutput
from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError, ProtocolError

T = TypeVar("T")


def strict_int(name: str, value: object, *, minimum: int = 0) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``; else a ``ConfigError`` naming it."""
    if type(value) is not int:
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def positive_int(name: str, value: object) -> None:
    """``ConfigError`` naming ``name`` unless ``value`` is an int (not a bool) above 0."""
    if type(value) is not int or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


def timeout_s(name: str, value: object) -> float:
    """A timeout in seconds: a finite number >= 0 (inf or nan would make a wait unbounded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{name} must be finite and >= 0 seconds, got {value!r}")
    return seconds


def group_ids(
    where: str,
    ids: Iterable[Iterable[object]],
    num_groups: int,
    num_blocks: int | None,
    null_block_id: int | None,
) -> GroupBlockIds:
    """``ids`` (one sequence of block ids per KV cache group) as a tuple of int tuples, checked:
    one entry per group, every id an int in ``0 .. num_blocks - 1`` (when known), none but the
    null block twice in a group."""
    try:
        groups = [tuple(g) for g in ids]
    except TypeError:
        raise ConfigError(f"{where}: block ids must be one sequence of ints per group") from None
    if len(groups) != num_groups:
        raise ConfigError(f"{where}: {len(groups)} block groups, expected {num_groups}")
    for g, group in enumerate(groups):
        if not _INT.issuperset(map(type, group)):  # one C-level pass, bools and floats out
            b = next(b for b in group if type(b) is not int)
            raise ConfigError(f"{where} group {g}: block id {b!r} is not an int")
        check_ids(where, g, cast("tuple[int, ...]", group), num_blocks, null_block_id)
    return cast(GroupBlockIds, tuple(groups))


_INT = frozenset({int})
_RUNS_FROM = 16  # ids from which a list is first tried as ascending runs


def check_ids(
    where: str,
    group: int,
    ids: Sequence[int],
    num_blocks: int | None,
    null_block_id: int | None,
    *,
    kind: str = "GPU",
) -> None:
    """Ids of one group: in range (when ``num_blocks`` is known) and unique but for the null
    block."""
    problem = id_problem(ids, num_blocks, null_block_id)
    if problem is not None:
        raise ConfigError(f"{where} group {group}: {kind} block id {problem}")


def id_problem(ids: Sequence[int], num_blocks: int | None, null_block_id: int | None) -> str | None:
    """What is wrong with one group's ints (out of range, given twice), or None. Cheap for the
    common short lists: no set, no copy, unless there are several ids."""
    if not ids:
        return None
    if (
        len(ids) >= _RUNS_FROM
        and num_blocks is not None
        and num_blocks <= EVERY_CAP
        and ids[0] < ids[-1]
        and ascending_runs(ids, every(num_blocks), num_blocks) is not None
    ):
        return None  # ascending runs in range (a CPU tier's ids): unique, no min, max or set
    lo, hi = min(ids), max(ids)
    if lo < 0 or (num_blocks is not None and hi >= num_blocks):
        bad = lo if lo < 0 else hi
        limit = "" if num_blocks is None else f" 0..{num_blocks - 1}"
        return f"{bad} out of range{limit}"
    if len(ids) > 1 and len(set(ids)) != len(ids):
        real = [b for b in ids if b != null_block_id]
        if len(set(real)) != len(real):
            seen: set[int] = set()
            twice = next(b for b in real if b in seen or seen.add(b))  # type: ignore[func-returns-value]
            return f"{twice} given twice"
    return None


def scheduler_output(so: SchedulerOutput) -> None:
    """The parts of a step that need no manager state: the step is an int, new requests'
    counts are ints in order. Block ids, and running requests, are checked with
    ``step_entries`` once the steady-state entries (no new block, none completed: nothing of
    them is applied) are skipped, so a big decode batch costs nothing extra."""
    strict_int("step", so.step)
    for new in so.new_requests:
        computed, scheduled, spec = (
            new.num_computed_tokens,
            new.num_scheduled_tokens,
            new.num_spec_tokens,
        )
        if (
            type(computed) is not int
            or type(scheduled) is not int
            or type(spec) is not int
            or min(computed, scheduled, spec) < 0
            or spec > scheduled
        ):
            _counts(f"new request {new.request_id!r}", computed, scheduled, spec)


def _counts(where: str, computed: object, scheduled: object, spec: object) -> None:
    strict_int(f"{where}: num_computed_tokens", computed)
    n = strict_int(f"{where}: num_scheduled_tokens", scheduled)
    if strict_int(f"{where}: num_spec_tokens", spec) > n:
        raise ConfigError(f"{where}: {spec} speculative tokens among {n} scheduled")


def step_entries(
    entries: Sequence[tuple[T, object, GroupBlockIds, bool]],
    name: Callable[[T], str],
    num_groups: int,
    num_blocks: int | None,
    null_block_id: int | None,
) -> None:
    """The entries of a step that change the manager (``(request, confirmed tokens, block ids,
    replace)``; ``name(request)`` is its id): no request twice, confirmed tokens an int >= 0,
    one id tuple per group, ids in range and unique within the entry. Ids are ints already
    (``NewRequest`` and ``CachedRequest`` convert them). One plain pass, its common case (one
    new id per request) first; only a failing step is walked again, to name the problem."""
    limit = num_blocks if num_blocks is not None else 1 << 62
    bad = False
    for _, confirmed, ids, _ in entries:
        if type(confirmed) is not int or confirmed < 0 or len(ids) != num_groups:
            bad = True
            break
        for group in ids:
            if not group:
                continue
            if len(group) == 1:
                if 0 <= group[0] < limit:
                    continue
            elif min(group) >= 0 and max(group) < limit and len(set(group)) == len(group):
                continue
            # Else out of range or repeated; only the null block may repeat (window padding).
            if id_problem(group, num_blocks, null_block_id) is not None:
                bad = True
                break
        if bad:
            break
    if bad or len({id(e[0]) for e in entries}) != len(entries):
        _entries_error(entries, name, num_groups, num_blocks, null_block_id)


def _entries_error(
    entries: Sequence[tuple[T, object, GroupBlockIds, bool]],
    name: Callable[[T], str],
    num_groups: int,
    num_blocks: int | None,
    null_block_id: int | None,
) -> None:
    """Walk a step that failed ``step_entries``' checks and raise naming the first problem."""
    seen: set[int] = set()
    for req, confirmed, ids, _ in entries:
        rid = name(req)
        if id(req) in seen:
            raise ConfigError(f"request {rid!r} is scheduled twice in one step")
        seen.add(id(req))
        if type(confirmed) is not int or confirmed < 0:
            raise ConfigError(f"request {rid!r}: counts give {confirmed!r} computed tokens")
        if len(ids) != num_groups:
            raise ConfigError(f"{rid}: {len(ids)} block groups, expected {num_groups}")
        for g, group in enumerate(ids):
            problem = id_problem(group, num_blocks, null_block_id)
            if problem is not None:
                raise ConfigError(f"request {rid!r} group {g}: GPU block id {problem}")
    raise AssertionError("step_entries found a problem that _entries_error did not")


def fenced_loads(plan: StepPlan) -> None:
    """The plan's fenced loads are some of its loads."""
    if plan.fenced_loads:
        stray = sorted(set(plan.fenced_loads) - {t.transfer_id for t in plan.loads})
        if stray:
            raise ConfigError(f"step {plan.step}: fenced loads {stray} are not its loads")


def plan(plan: StepPlan, gpu_blocks: Sequence[int], cpu_blocks: Sequence[int]) -> None:
    """A step plan against the registered layout: every transfer's ids in range per group and
    unique within it, no CPU block written by a store and touched by another transfer of the
    plan, no GPU block written by two loads, no transfer id twice. (Two loads may read one CPU
    block: requests sharing a cached prefix.)"""
    strict_int("plan step", plan.step)
    fenced_loads(plan)
    specs = (*plan.stores, *plan.loads)
    if not specs:
        return  # a step with no transfer (most decode steps): nothing else to check
    num_groups = len(gpu_blocks)
    ids: set[int] = set()
    stored: list[set[int]] = [set() for _ in range(num_groups)]  # CPU blocks stores write
    read: list[set[int]] = [set() for _ in range(num_groups)]  # CPU blocks loads read
    loaded: list[set[int]] = [set() for _ in range(num_groups)]  # GPU blocks loads write
    for spec in specs:
        tid = spec.transfer_id
        if tid in ids:
            raise ConfigError(f"step {plan.step} lists a transfer id twice ({tid})")
        ids.add(tid)
        where = f"step {plan.step} transfer {tid} ({spec.direction.value})"
        _spec(where, spec, gpu_blocks, cpu_blocks)
        if len(specs) == 1:
            return  # one transfer (a step's store or load): no other one to overlap
        is_load = spec.direction is Direction.LOAD
        for g, (gpu, cpu) in enumerate(zip(spec.gpu_block_ids, spec.cpu_block_ids, strict=True)):
            if not gpu:
                continue
            if is_load:
                _disjoint(where, g, "GPU block", gpu, loaded[g], "loaded twice")
                _disjoint(where, g, "CPU block", cpu, stored[g], "also written by a store")
                read[g].update(cpu)
            else:
                _disjoint(where, g, "CPU block", cpu, stored[g], "written by two stores")
                _disjoint(where, g, "CPU block", cpu, read[g], "also read by a load")
            (loaded if is_load else stored)[g].update(gpu if is_load else cpu)


def _disjoint(
    where: str, group: int, kind: str, ids: Sequence[int], seen: set[int], what: str
) -> None:
    if not seen.isdisjoint(ids):
        raise ConfigError(f"{where} group {group}: {kind} {min(seen.intersection(ids))} {what}")


def _spec(
    where: str, spec: TransferSpec, gpu_blocks: Sequence[int], cpu_blocks: Sequence[int]
) -> None:
    if len(spec.gpu_block_ids) != len(gpu_blocks) or len(spec.cpu_block_ids) != len(gpu_blocks):
        raise ConfigError(
            f"{where}: {len(spec.gpu_block_ids)} GPU / {len(spec.cpu_block_ids)} CPU block "
            f"groups, the registered layout has {len(gpu_blocks)}"
        )
    for g, (gpu, cpu) in enumerate(zip(spec.gpu_block_ids, spec.cpu_block_ids, strict=True)):
        if len(gpu) != len(cpu):
            raise ConfigError(f"{where} group {g}: {len(gpu)} GPU blocks but {len(cpu)} CPU")
        if gpu:
            check_ids(where, g, gpu, gpu_blocks[g], None)
            check_ids(where, g, cpu, cpu_blocks[g], None, kind="CPU")


def plan_order(plan: StepPlan, last_step: int | None, last_transfer_id: int) -> None:
    """A plan must be the next one: a later step than the last bound, and only transfers newer
    than every one seen (the manager numbers them in order), so a replayed or stale plan can
    never copy again into blocks that have been committed or reused since."""
    if last_step is not None and plan.step <= last_step:
        raise ProtocolError(
            f"plan of step {plan.step} bound after step {last_step}: replayed or out of order"
        )
    old = [s.transfer_id for s in (*plan.stores, *plan.loads) if s.transfer_id <= last_transfer_id]
    if old:
        raise ProtocolError(
            f"plan of step {plan.step} names transfer(s) {sorted(old)} not newer than transfer "
            f"{last_transfer_id} already bound: replayed or out of order"
        )


def tier_budget(
    declared: Sequence[int], registered: Sequence[int], cpu_blocks: Sequence[int], cpu_bytes: int
) -> None:
    """The registered tensors' bytes per block against those the CPU tier was sized with: a
    larger block would allocate a tier past ``cpu_bytes``."""
    if len(declared) != len(registered):
        raise ConfigError(
            f"the connector was sized for {len(declared)} KV cache groups, the registered "
            f"tensors make {len(registered)}"
        )
    for g, (want, got) in enumerate(zip(declared, registered, strict=True)):
        if got > want:
            raise ConfigError(
                f"group {g}: the registered KV tensors hold {got} bytes per block, the "
                f"connector was sized for {want}: the CPU tier would exceed cpu_bytes"
            )
    total = sum(n * b for n, b in zip(cpu_blocks, registered, strict=True))
    if total > cpu_bytes:
        raise ConfigError(f"a CPU tier of {total} bytes exceeds cpu_bytes={cpu_bytes}")


__all__ = [
    "check_ids",
    "group_ids",
    "id_problem",
    "plan",
    "plan_order",
    "positive_int",
    "scheduler_output",
    "step_entries",
    "strict_int",
    "tier_budget",
    "timeout_s",
]
