"""Configuration of the offload manager: its policies, its KV cache groups, and what follows from them.

``OffloadManagerConfig`` is what a caller gives (a connector derives it from its user-facing
``OffloadConfig``); ``Geometry`` is derived from it once, the per-group constants every part of
the manager reads.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from typing import TypeVar

from attrs import field, frozen

from kvflow.core.validate import positive_int
from kvflow.errors import ConfigError

LAZY_REQUEST_ID = "<lazy>"
"""The request id of lazy-policy stores, which belong to the GPU free queue, not to a request."""
STEP_STORE_ID = "<step>"
"""The request id of an eager store carrying the blocks of several requests (one per step)."""


class StorePolicy(enum.StrEnum):
    """When GPU blocks are copied to the CPU tier."""

    EAGER = "eager"  # as soon as a block's KV is computed
    LAZY = "lazy"  # only when the block nears the eviction end of the GPU free queue


class FenceLoads(enum.StrEnum):
    """When a CPU hit is loaded in the step that computes its request (the forward waits for
    the copies on the device) instead of asynchronously (the request waits in the scheduler
    for ``finished_recving``, then computes in a later step)."""

    NEVER = "never"  # every hit loads asynchronously (vLLM's asynchronous loads)
    IDLE = "idle"  # in the step that computes it when no request is running: nothing to stall
    ALWAYS = "always"  # always in the step that computes it (vLLM's synchronous loads)


class ResetStatus(enum.StrEnum):
    """What ``reset_cache`` achieved."""

    COMPLETE = "complete"  # the CPU prefix cache is empty now
    PENDING = "pending"  # transfers were in flight; the reset completes when they settle


@frozen
class GroupSpec:
    """One KV cache group as the manager sees it.

    ``block_size`` and ``sliding_window`` are in tokens; ``block_bytes`` (bytes of one block over all
    its layers, 0 if unknown) only feeds the byte counters of the stats.
    """

    block_size: int
    num_cpu_blocks: int
    sliding_window: int | None = None
    block_bytes: int = 0

    def __attrs_post_init__(self) -> None:
        positive_int("block_size", self.block_size)
        positive_int("num_cpu_blocks", self.num_cpu_blocks)
        if self.sliding_window is not None:
            positive_int("sliding_window", self.sliding_window)
        if type(self.block_bytes) is not int or self.block_bytes < 0:
            raise ConfigError(f"block_bytes must be a non-negative int, got {self.block_bytes!r}")


def _as_groups(value: Iterable[GroupSpec]) -> tuple[GroupSpec, ...]:
    return tuple(value)


E = TypeVar("E", bound=enum.StrEnum)


def _choice(kind: type[E], name: str, value: str) -> E:
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(
            f"{name} must be one of {[p.value for p in kind]}, got {value!r}"
        ) from None


def _as_fence_loads(value: str) -> FenceLoads:
    return _choice(FenceLoads, "fence_loads", value)


def _as_policy(value: str) -> StorePolicy:
    return _choice(StorePolicy, "store_policy", value)


@frozen
class OffloadManagerConfig:
    """Configuration of one ``OffloadManager``.

    ``lazy_watermark`` is how many blocks at the eviction end of the GPU free queue the lazy policy
    keeps stored. ``null_block_id`` is the engine's padding block (vLLM: 0), never transferred.
    ``eager_store_interval``: in steady decode the eager policy plans one store every that many
    steps, with every block completed since (1: each step), so the fixed cost of a transfer
    (plan, launch, commit) is paid once for them all. A step with new or resumed requests stores
    at once, a finishing request's blocks are stored when it finishes and a preempted request's
    are dropped with its GPU blocks. With a sliding-window group it is 1: the engine may free a
    block leaving the window before a later step would store it. ``enable_events``: the CPU
    pools record what enters and leaves the prefix cache, for ``OffloadManager.take_events``.
    ``fence_loads`` (``FenceLoads``): which hits load in the step that computes them; with one
    rank only (another rank's failed copy is known from its report, after the step's tokens).
    """

    groups: tuple[GroupSpec, ...] = field(converter=_as_groups)
    world_size: int = 1
    store_policy: StorePolicy = field(default=StorePolicy.EAGER, converter=_as_policy)
    lazy_watermark: int = 64
    null_block_id: int | None = None
    eager_store_interval: int = 1
    enable_events: bool = False
    fence_loads: FenceLoads = field(default=FenceLoads.NEVER, converter=_as_fence_loads)
    num_gpu_blocks: int | None = None
    """GPU blocks per group, block ``null_block_id`` included: when given, every GPU block id an
    engine hands the manager is checked to be in range (an unknown id must never reach a pool or
    a device)."""

    def __attrs_post_init__(self) -> None:
        if self.num_gpu_blocks is not None:
            positive_int("num_gpu_blocks", self.num_gpu_blocks)
        if not self.groups:
            raise ConfigError("OffloadManagerConfig needs at least one KV cache group")
        for g, spec in enumerate(self.groups):
            if not isinstance(spec, GroupSpec):
                raise ConfigError(f"group {g} must be a GroupSpec, not {type(spec).__name__}")
        positive_int("world_size", self.world_size)
        positive_int("lazy_watermark", self.lazy_watermark)
        positive_int("eager_store_interval", self.eager_store_interval)


@frozen
class Geometry:
    """The per-group constants derived from a config, computed once.

    ``slot[g]`` is group ``g``'s index into a request's hashers (one per distinct block size);
    ``align`` is the least common multiple of the block sizes, the granularity of a hit.
    """

    num_groups: int
    block_sizes: tuple[int, ...]
    group_sizes: tuple[tuple[int, int], ...]  # (group, block size), for loops over both
    hasher_sizes: tuple[int, ...]
    slot: tuple[int, ...]
    align: int
    full_groups: tuple[int, ...]
    window_groups: tuple[int, ...]
    windows: tuple[int | None, ...]

    @classmethod
    def of(cls, config: OffloadManagerConfig) -> Geometry:
        groups = config.groups
        block_sizes = tuple(g.block_size for g in groups)
        sizes = sorted(set(block_sizes))
        return cls(
            num_groups=len(groups),
            block_sizes=block_sizes,
            group_sizes=tuple(enumerate(block_sizes)),
            hasher_sizes=tuple(sizes),
            slot=tuple(sizes.index(bs) for bs in block_sizes),
            align=math.lcm(*sizes),
            full_groups=tuple(g for g, s in enumerate(groups) if s.sliding_window is None),
            window_groups=tuple(g for g, s in enumerate(groups) if s.sliding_window is not None),
            windows=tuple(s.sliding_window for s in groups),
        )


__all__ = [
    "LAZY_REQUEST_ID",
    "STEP_STORE_ID",
    "Geometry",
    "GroupSpec",
    "OffloadManagerConfig",
    "ResetStatus",
    "StorePolicy",
]
