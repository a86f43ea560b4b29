"""Engine-facing types for the scheduler side: what a request looks like to kvflow and what one
engine step scheduled. Shaped like vLLM's ``Request`` and ``SchedulerOutput`` so adapters stay thin,
but kvflow's own and engine-neutral.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from attrs import define, field, frozen

from kvflow.core.hashing import BlockHash, ExtraKey
from kvflow.core.protocol import GroupBlockIds, _as_group_ids
from kvflow.errors import ConfigError


@runtime_checkable
class RequestLike(Protocol):
    """A request as the scheduler-side manager reads it (an engine's request or an adapter of one)."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt tokens followed by every output token so far."""
        ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def extra_keys(self) -> tuple[ExtraKey, ...]:
        """Keys mixed into every block hash: LoRA id, cache salt, ... (empty for most requests)."""
        ...


@runtime_checkable
class EngineHashedRequest(RequestLike, Protocol):
    """A request whose engine hashes its blocks itself (vLLM with a KV connector does): the
    manager then keys the CPU tier by the engine's hashes instead of computing its own.

    ``engine_block_hashes(block_size)`` is the engine's live list of hashes at that block size
    (one per full block of ``all_token_ids``, kept current as tokens arrive), or None when the
    engine has none at that size; kvflow then hashes the request itself. An engine should give
    its hashes for every request or for none: the two kinds of keys never match each other.
    """

    def engine_block_hashes(self, block_size: int) -> Sequence[BlockHash] | None: ...


@define(eq=False)
class KVRequest:
    """A plain ``RequestLike`` for engines that have no request object of their own, and tests."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    extra_keys: tuple[ExtraKey, ...] = ()
    # The engine reads no cached KV for it (vLLM: prompt logprobs): no CPU hit, no pin; the
    # manager reads the attribute of any request that has it.
    skip_reading_prefix_cache: bool = False

    @classmethod
    def from_prompt(
        cls, request_id: str, prompt: Sequence[int], extra_keys: tuple[ExtraKey, ...] = ()
    ) -> KVRequest:
        return cls(request_id, list(prompt), len(prompt), extra_keys)


@frozen
class NewRequest:
    """A request scheduled for the first time (or with its whole block table after a preemption)."""

    request_id: str
    block_ids: GroupBlockIds = field(converter=_as_group_ids)
    num_computed_tokens: int  # before this step: GPU prefix hits plus externally loaded tokens
    num_scheduled_tokens: int
    num_spec_tokens: int = 0  # speculative tokens among the scheduled ones: never stored


@frozen
class CachedRequest:
    """A request already running: what it got this step."""

    request_id: str
    new_block_ids: GroupBlockIds = field(converter=_as_group_ids)  # appended to its block table
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int
    num_spec_tokens: int = 0
    resumed_from_preemption: bool = False  # if so, new_block_ids is the whole new table


def _as_str_column(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _as_int_column(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _as_ids_column(value: Iterable[Iterable[Iterable[int]]]) -> tuple[GroupBlockIds, ...]:
    return tuple(_as_group_ids(ids) for ids in value)


@frozen
class DecodeRequests:
    """Running requests that each decode one token this step, none speculative or resumed.

    The steady state of a decode batch, in columns so that an engine passes a whole step
    without building an object per request. Entry ``i`` means exactly
    ``CachedRequest(request_ids[i], new_block_ids[i], num_computed_tokens[i], 1)``.
    """

    request_ids: tuple[str, ...] = field(converter=_as_str_column)
    num_computed_tokens: tuple[int, ...] = field(converter=_as_int_column)  # before this step
    new_block_ids: tuple[GroupBlockIds, ...] = field(converter=_as_ids_column)

    def __attrs_post_init__(self) -> None:
        n = len(self.request_ids)
        if len(self.num_computed_tokens) != n or len(self.new_block_ids) != n:
            raise ConfigError(
                f"DecodeRequests columns differ in length: {n} request ids, "
                f"{len(self.num_computed_tokens)} computed counts, "
                f"{len(self.new_block_ids)} block id entries"
            )

    @classmethod
    def trusted(
        cls,
        request_ids: Sequence[str],
        num_computed_tokens: Sequence[int],
        new_block_ids: Sequence[GroupBlockIds],
    ) -> DecodeRequests:
        """The same columns without converting or checking them, for an engine adapter whose
        inputs are equal-length columns of ``str``, ``int`` and ``GroupBlockIds`` (tuples of
        tuples of ints) by construction: the checks cost more than the rest of a decode step's
        translation. Anything else must go through the constructor."""
        self = object.__new__(cls)
        setattr_ = object.__setattr__
        setattr_(self, "request_ids", tuple(request_ids))
        setattr_(self, "num_computed_tokens", tuple(num_computed_tokens))
        setattr_(self, "new_block_ids", tuple(new_block_ids))
        return self

    def __len__(self) -> int:
        return len(self.request_ids)


NO_DECODE_REQUESTS = DecodeRequests((), (), ())


def decode_columns(
    request_ids: Sequence[str],
    num_computed_tokens: Sequence[int],
    new_block_ids: Sequence[Sequence[Sequence[int]] | None],
    boundary: int,
    num_groups: int,
    *,
    trusted: bool = False,
) -> DecodeRequests:
    """A step of running requests only, one token each (every one listed, with the block ids
    allocated to it this step per group, or None), as the ``DecodeRequests`` columns of those
    with news: blocks allocated, or a token that completes a multiple of ``boundary`` tokens.

    ``trusted``: the columns are ``str``, ``int`` and per-group lists of ints by construction (an
    adapter's of its engine's own), so the columns skip ``DecodeRequests``' checks."""
    if not trusted and not len(request_ids) == len(num_computed_tokens) == len(new_block_ids):
        raise ConfigError(
            f"decode columns differ in length: {len(request_ids)} request ids, "
            f"{len(num_computed_tokens)} computed counts, {len(new_block_ids)} block id entries"
        )
    last = boundary - 1
    no_blocks: GroupBlockIds = ((),) * num_groups
    rids: list[str] = []
    counts: list[int] = []
    news: list[GroupBlockIds] = []
    # One pass builds the three columns: a comprehension per column is a code object per
    # column, and each costs more cold (as every step starts) than the iterations.
    for i, computed in enumerate(num_computed_tokens):
        if not trusted and (type(computed) is not int or computed < 0):
            raise ConfigError(
                f"request {request_ids[i]!r}: num_computed_tokens must be an int >= 0, "
                f"got {computed!r}"
            )
        ids = new_block_ids[i]
        if ids is not None and any(ids):
            news.append((tuple(ids[0]),) if len(ids) == 1 else tuple(map(tuple, ids)))
        elif computed % boundary == last:
            news.append(no_blocks)
        else:
            continue
        rids.append(request_ids[i])
        counts.append(computed)
    if not rids:
        return NO_DECODE_REQUESTS
    if trusted:
        return DecodeRequests.trusted(rids, counts, news)
    return DecodeRequests(rids, counts, news)


@frozen
class SchedulerOutput:
    """One engine step, as the engine's scheduler decided it. kvflow never mutates it."""

    step: int
    new_requests: tuple[NewRequest, ...] = ()
    cached_requests: tuple[CachedRequest, ...] = ()
    finished_request_ids: frozenset[str] = frozenset()
    preempted_request_ids: frozenset[str] = frozenset()
    decode_requests: DecodeRequests = NO_DECODE_REQUESTS  # more running ones, after cached_requests


__all__ = [
    "NO_DECODE_REQUESTS",
    "CachedRequest",
    "DecodeRequests",
    "EngineHashedRequest",
    "KVRequest",
    "NewRequest",
    "RequestLike",
    "SchedulerOutput",
    "decode_columns",
]
