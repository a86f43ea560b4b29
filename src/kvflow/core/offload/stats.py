"""The offload manager's counters, its stats snapshot, and the outcome of applying reports."""

from __future__ import annotations

from attrs import define, frozen


@frozen
class StepOutcome:
    """What the engine must act on after ``update_from_reports``.

    ``finished_sending``: finished requests whose GPU blocks may be freed now (their copies are
    done). ``finished_recving``: requests whose load settled; they may run. ``invalid_block_ids``:
    GPU blocks of failed or dropped loads, to be recomputed (the prefix before them stays valid).
    """

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    committed: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    invalid_block_ids: frozenset[int] = frozenset()
    reset_complete: bool = False


NO_OUTCOME = StepOutcome()
"""The outcome of a step where nothing settled (most steps): frozen, so one serves all."""


@define(eq=False)
class Counters:
    """The manager's monotonic counters (since construction), shared by its parts."""

    lookups: int = 0  # get_num_new_matched_tokens calls answered with a number
    hits: int = 0  # ... of which found a CPU hit
    misses: int = 0
    hit_tokens: int = 0
    blocks_stored: int = 0  # committed into the CPU prefix cache
    blocks_loaded: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    skipped_stores: int = 0  # blocks not stored because the CPU pool had no evictable block
    failed_transfers: int = 0
    abandoned_transfers: int = 0


@frozen
class OffloadStats(Counters):
    """A snapshot of the manager's counters and of its CPU tier."""

    transfers_in_flight: int = 0
    cpu_blocks_used: int = 0
    cpu_blocks_cached: int = 0


__all__ = ["NO_OUTCOME", "Counters", "OffloadStats", "StepOutcome"]
