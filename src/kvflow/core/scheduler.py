"""The scheduler-side offload manager: match CPU prefix hits, plan loads and stores, commit them.

``OffloadManager`` owns kvflow's CPU tier (one ``BlockPool`` per KV cache group) and its prefix
cache. The engine's scheduler calls it like vLLM's KV connector scheduler API:

- ``get_num_new_matched_tokens``: the longest CPU hit beyond the GPU prefix; pins the hit blocks;
- ``update_state_after_alloc``: turns the pinned hit into a load into the GPU blocks just allocated;
- ``build_step_plan``: every load and store of the step, as one ``StepPlan`` for the workers;
- ``update_from_reports``: the workers' ``StepReport``\\ s; a transfer settles only when every rank
  reported it; stores then enter the CPU prefix cache;
- ``request_finished``: whether the engine must keep the request's GPU blocks for a copy in flight;
- ``reset_cache``: forget the CPU prefix cache, with transfers in flight or not.

Every load and store is a ``Transfer`` driven through ``kvflow.core.transfer.apply``. A block that
a transfer reads or writes holds a reference on its pool until the transfer is RELEASED (on the
GPU side only where the engine could free it under the copy: see ``OffloadManager``). Per-step
work is one comparison per scheduled request plus work proportional to the blocks that completed.
Sans-IO: no device, no event loop, no clock.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from typing import Any

import structlog
from attrs import asdict, define, field, frozen

from kvflow.core import validate
from kvflow.core.block_pool import BlockPool
from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.hashing import BlockHash, BlockHasher, EngineBlockHashes, HashChain
from kvflow.core.protocol import GroupBlockIds, StepPlan, StepReport, TransferSpec, aggregate
from kvflow.core.requests import RequestLike, SchedulerOutput
from kvflow.core.transfer import Direction, Transfer, TransferInput, TransferState, apply
from kvflow.errors import ConfigError, ProtocolError, ReportError

log = structlog.get_logger("kvflow.scheduler")

LAZY_REQUEST_ID = "<lazy>"
"""The request id of lazy-policy stores, which belong to the GPU free queue, not to a request."""
STEP_STORE_ID = "<step>"
"""The request id of an eager store carrying the blocks of several requests (one per step)."""

# Enum members bound once: on CPython 3.11 reading a member as a class attribute costs ~0.1 µs,
# and the per-step paths below read dozens of them.
_STORE, _LOAD = Direction.STORE, Direction.LOAD
_PENDING, _IN_FLIGHT = TransferState.PENDING, TransferState.IN_FLIGHT
_ABANDONED = TransferState.ABANDONED
_LAUNCH, _CANCEL, _ABANDON = TransferInput.LAUNCH, TransferInput.CANCEL, TransferInput.ABANDON
_COMPLETE, _FAIL, _RELEASE = TransferInput.COMPLETE, TransferInput.FAIL, TransferInput.RELEASE


class StorePolicy(enum.StrEnum):
    """When GPU blocks are copied to the CPU tier."""

    EAGER = "eager"  # as soon as a block's KV is computed
    LAZY = "lazy"  # only when the block nears the eviction end of the GPU free queue


class ResetStatus(enum.StrEnum):
    """What ``reset_cache`` achieved."""

    COMPLETE = "complete"  # the CPU prefix cache is empty now
    PENDING = "pending"  # transfers were in flight; the reset completes when they settle


def _positive(name: str, value: int) -> None:
    if type(value) is not int or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


@frozen
class GroupSpec:
    """One KV cache group as the scheduler sees it.

    ``block_size`` and ``sliding_window`` are in tokens; ``block_bytes`` (bytes of one block over all
    its layers, 0 if unknown) only feeds the byte counters of the stats.
    """

    block_size: int
    num_cpu_blocks: int
    sliding_window: int | None = None
    block_bytes: int = 0

    def __attrs_post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_cpu_blocks", self.num_cpu_blocks)
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window)
        if type(self.block_bytes) is not int or self.block_bytes < 0:
            raise ConfigError(f"block_bytes must be a non-negative int, got {self.block_bytes!r}")


def _as_groups(value: Iterable[GroupSpec]) -> tuple[GroupSpec, ...]:
    return tuple(value)


def _as_policy(value: str) -> StorePolicy:
    try:
        return StorePolicy(value)
    except ValueError:
        raise ConfigError(
            f"store_policy must be one of {[p.value for p in StorePolicy]}, got {value!r}"
        ) from None


@frozen
class SchedulerConfig:
    """Configuration of one ``OffloadManager``.

    ``lazy_watermark`` is how many blocks at the eviction end of the GPU free queue the lazy policy
    keeps stored. ``null_block_id`` is the engine's padding block (vLLM: 0), never transferred.
    ``eager_store_interval``: in steady decode the eager policy plans one store every that many
    steps, with every block completed since (1: each step), so the fixed cost of a transfer
    (plan, launch, commit) is paid once for them all. A step with new or resumed requests stores
    at once, a finishing request's blocks are stored when it finishes and a preempted request's
    are dropped with its GPU blocks. With a sliding-window group it is 1: the engine may free a
    block leaving the window before a later step would store it.
    """

    groups: tuple[GroupSpec, ...] = field(converter=_as_groups)
    world_size: int = 1
    store_policy: StorePolicy = field(default=StorePolicy.EAGER, converter=_as_policy)
    lazy_watermark: int = 64
    null_block_id: int | None = None
    eager_store_interval: int = 1
    num_gpu_blocks: int | None = None
    """GPU blocks per group, block ``null_block_id`` included: when given, every GPU block id an
    engine hands the manager is checked to be in range (an unknown id must never reach a pool or
    a device)."""

    def __attrs_post_init__(self) -> None:
        if self.num_gpu_blocks is not None:
            _positive("num_gpu_blocks", self.num_gpu_blocks)
        if not self.groups:
            raise ConfigError("SchedulerConfig needs at least one KV cache group")
        for g, spec in enumerate(self.groups):
            if not isinstance(spec, GroupSpec):
                raise ConfigError(f"group {g} must be a GroupSpec, not {type(spec).__name__}")
        _positive("world_size", self.world_size)
        _positive("lazy_watermark", self.lazy_watermark)
        _positive("eager_store_interval", self.eager_store_interval)


_NOTHING: frozenset[Any] = frozenset()


def _all_ids(ids: GroupBlockIds) -> Sequence[int]:
    """Every group's block ids in one sequence (the one group's own tuple: no copy)."""
    return ids[0] if len(ids) == 1 else [b for group in ids for b in group]


def _own(hashers: Sequence[HashChain]) -> tuple[HashChain, ...]:
    """The hashers kvflow must extend itself: an engine's hashes are kept current by the engine."""
    return tuple(h for h in hashers if not isinstance(h, EngineBlockHashes))


def _request_id(st: _Request) -> str:
    return st.request.request_id


def _transfer_id(x: _Xfer) -> int:
    return x.transfer.transfer_id


def _take(items: set[Any]) -> frozenset[Any]:
    """The set's items, frozen, and the set emptied (no new frozenset when there are none)."""
    if not items:
        return _NOTHING
    out = frozenset(items)
    items.clear()
    return out


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


@define(eq=False)
class _Counters:
    """The manager's monotonic counters (since construction)."""

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
class OffloadStats(_Counters):
    """A snapshot of the manager's counters and of its CPU tier."""

    transfers_in_flight: int = 0
    cpu_blocks_used: int = 0
    cpu_blocks_cached: int = 0


@define(eq=False)
class _StoreBatch:
    """The blocks one step (or one finishing request) hands to the store, before CPU allocation.

    Per group, ``blocks`` maps each hash to its GPU block in the order they were picked (a hash
    is picked once per batch) and ``owners`` lists each block's request in the same order.
    """

    blocks: list[dict[BlockHash, int]]
    owners: list[list[_Request | None]]
    reqs: list[_Request] = field(factory=list)

    @classmethod
    def empty(cls, num_groups: int) -> _StoreBatch:
        return cls([{} for _ in range(num_groups)], [[] for _ in range(num_groups)])


@define(eq=False)
class _Match:
    """A CPU hit pinned by ``get_num_new_matched_tokens``, waiting for the engine's allocation."""

    num_computed_tokens: int
    num_external_tokens: int
    first: tuple[int, ...]  # per group: first block index to load
    cpu_block_ids: tuple[tuple[int, ...], ...]  # per group: pinned CPU blocks from ``first`` on
    load: tuple[GroupBlockIds, GroupBlockIds] | None = None  # (GPU, CPU) ids once allocated


@define(eq=False)
class _Request:
    """The manager's state of one request: hashes, GPU block table, store cursors, transfers."""

    request: RequestLike
    hashers: list[HashChain]  # per distinct block size: kvflow's own, or the engine's
    hashing: tuple[HashChain, ...]  # those of ``hashers`` kvflow extends (none: the engine's)
    hash_lists: tuple[Sequence[BlockHash], ...]  # each hasher's live list: one object to touch
    # Per group, the request's GPU block ids; a tuple (its items inline, one object less to
    # reach, cold, on every block completion) of growing lists.
    table: tuple[list[int], ...]
    cursor: list[int]  # per group: blocks already handed to the store policy
    confirmed: int = 0  # tokens whose KV is computed and not speculative
    next_boundary: int = 0  # confirmed-token count at which some group completes a block
    match: _Match | None = None
    # Live (not yet released) transfers, but for step stores (``_Xfer.shared``): registering the
    # request in each would touch every storing request's state twice per store.
    transfers: dict[int, _Xfer] = field(factory=dict)
    finishing: bool = False  # gone for the engine; state kept until its transfers settle
    delay_free: bool = False  # the engine waits for finished_sending to free its GPU blocks


@define(eq=False)
class _Xfer:
    """One live transfer: its state machine, what the workers see, and the refs it holds."""

    transfer: Transfer
    spec: TransferSpec
    reqs: list[_Request]  # the requests waiting on it (none for lazy stores)
    hashes: tuple[tuple[BlockHash, ...], ...] = ()  # stores: per group, the hashes being stored
    owners: tuple[tuple[_Request | None, ...], ...] = ()  # stores: per group, each block's request
    dropped: set[_Request] = field(factory=set)  # their GPU blocks were freed: don't cache theirs
    holds_gpu: bool = False  # holds a ref on its GPU blocks (see OffloadManager._store_refs)
    reported: dict[int, bool] = field(factory=dict)  # rank → success
    reset: bool = False  # abandoned by reset_cache (a load's blocks then become invalid)
    shared: bool = False  # a step's store: not in its requests' ``transfers`` (see _live)


class OffloadManager:
    """The scheduler side of the CPU tier; see the module docstring for the call sequence."""

    def __init__(self, config: SchedulerConfig, *, gpu_view: GpuCacheView | None = None) -> None:
        if config.store_policy is StorePolicy.LAZY and gpu_view is None:
            raise ConfigError("store_policy 'lazy' needs a gpu_view of the engine's GPU block pool")
        self.config = config
        self._gpu = gpu_view
        groups = config.groups
        self._num_groups = len(groups)
        self._block_sizes = tuple(g.block_size for g in groups)
        self._group_sizes = tuple(enumerate(self._block_sizes))
        sizes = sorted(set(self._block_sizes))
        self._hasher_sizes = tuple(sizes)
        self._slot = tuple(sizes.index(bs) for bs in self._block_sizes)
        self._align = math.lcm(*sizes)
        self._full_groups = tuple(g for g, s in enumerate(groups) if s.sliding_window is None)
        self._window_groups = tuple(g for g, s in enumerate(groups) if s.sliding_window is not None)
        self._cpu = [
            BlockPool(s.num_cpu_blocks, name=f"cpu[{g}]", enable_events=False)
            for g, s in enumerate(groups)
        ]
        self._null = config.null_block_id
        self._eager = config.store_policy is StorePolicy.EAGER
        self._interval = (
            config.eager_store_interval if self._eager and not self._window_groups else 1
        )
        # Which transfers hold GPU refs. Loads always: an aborted request's blocks must not be
        # reused under its copy. Eager stores of full-attention blocks need none: the blocks stay
        # the request's until it finishes (then ``delay_free`` keeps them until the store is
        # done) or is preempted (then the plan flushes every copy before the engine reuses its
        # blocks), and a request the engine drops unannounced has its stores abandoned. Lazy
        # stores read free blocks and a sliding window frees blocks of running requests: those
        # hold refs. The refs cost two pool calls per block, on the engine's thread.
        self._store_refs = gpu_view is not None and (not self._eager or bool(self._window_groups))
        # Eager, interval > 1: requests with completed blocks not handed to the store yet (an
        # ordered set), and how many plans ago the oldest of them was deferred.
        self._deferred: dict[_Request, None] = {}
        self._deferred_plans = 0
        self._no_new: GroupBlockIds = ((),) * self._num_groups
        self._requests: dict[str, _Request] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._shared: dict[int, _Xfer] = {}  # live step stores, by transfer id
        self._waiting: dict[_Request, None] = {}  # finished requests kept for their transfers
        self._pending: list[_Xfer] = []  # PENDING transfers, launched by the next plan
        self._allocated: dict[str, _Request] = {}  # matches the engine allocated blocks for
        self._storing: list[dict[BlockHash, int]] = [{} for _ in groups]  # hash → transfer id
        # Lazy: GPU block → (group, kvflow hash, engine hash when recorded, None if not yet set).
        self._gpu_hash: dict[int, tuple[int, BlockHash, Hashable | None]] = {}
        self._cursor: int | None = None  # lazy: last covered block of the GPU free queue
        self._cursor_hash: Hashable | None = None  # its engine hash when the walk passed it
        self._ahead: set[int] = set()  # lazy: free blocks from the queue head to the cursor
        self._abandoned: list[int] = []  # for the next plan
        self._finished_sending: set[str] = set()  # for the next outcome
        self._finished_recving: set[str] = set()
        self._invalid: set[int] = set()
        self._reset_pending = False
        self._reset_done = False
        self._next_id = 1
        self._n = _Counters()

    # ---- queries ------------------------------------------------------------------------------

    @property
    def cpu_pools(self) -> tuple[BlockPool, ...]:
        """The CPU tier, one pool per group (read-only use: tests and metrics)."""
        return tuple(self._cpu)

    @property
    def reset_pending(self) -> bool:
        """True between a ``reset_cache`` that found transfers in flight and their settling."""
        return self._reset_pending

    def num_live_transfers(self, request_id: str | None = None) -> int:
        """Transfers not yet released, of one request or of all."""
        if request_id is None:
            return len(self._xfers)
        st = self._requests.get(request_id)
        return 0 if st is None else len(self._live(st))

    def transfer_state(self, transfer_id: int) -> tuple[TransferState, frozenset[int]] | None:
        """A live transfer's state and the ranks that reported it so far; None once released
        (or never launched). For audits: a store must stay live until every rank reported."""
        x = self._xfers.get(transfer_id)
        return None if x is None else (x.transfer.state, frozenset(x.reported))

    def has_request(self, request_id: str) -> bool:
        """Whether the manager still keeps state for the request (finished ones: until their
        transfers settle)."""
        return request_id in self._requests

    def cpu_refs(self) -> list[Counter[int]]:
        """Per group, how many references the manager holds on each CPU block (transfers and
        pinned hits): for consistency checks, it must equal the pools' ref counts."""
        held: list[Counter[int]] = [Counter() for _ in self._cpu]
        for x in self._xfers.values():
            for g, ids in enumerate(x.spec.cpu_block_ids):
                held[g].update(ids)
        for st in self._requests.values():
            if st.match is not None:
                for g, ids in enumerate(st.match.cpu_block_ids):
                    held[g].update(ids)
        return held

    def stats(self) -> OffloadStats:
        """A frozen snapshot of the counters and of the CPU tier's occupancy."""
        return OffloadStats(
            **asdict(self._n),
            transfers_in_flight=len(self._xfers),
            cpu_blocks_used=sum(p.num_blocks - p.num_free_blocks for p in self._cpu),
            cpu_blocks_cached=sum(p.num_cached_blocks for p in self._cpu),
        )

    # ---- matching -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the CPU tier can load, and whether asynchronously.

        Whole blocks, consistent over all groups, leaving at least one token to compute. ``None``
        means "ask again next step" (this request's previous load is still on the device). The hit
        blocks are pinned until ``update_state_after_alloc`` or ``request_finished``.
        """
        if type(num_computed_tokens) is not int or num_computed_tokens < 0:
            raise ConfigError(
                f"num_computed_tokens must be an int >= 0, got {num_computed_tokens!r}"
            )
        rid = request.request_id
        st = self._requests.get(rid)
        if st is None:
            st = self._new_request(request)
        else:
            if any(x.spec.direction is _LOAD for x in st.transfers.values()):
                return None, False
            if st.request is not request:
                # Another object for the same id (a preempted request comes back through the
                # waiting queue): hash from it, and an engine's hashes live on the new object.
                st.request = request
                st.hashers = self._hashers(request)
                st.hashing = _own(st.hashers)
                st.hash_lists = tuple(h.hashes for h in st.hashers)
            self._drop_match(st)
        if self._reset_pending:
            return 0, False
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        self._hash_upto(st, num_tokens)
        hit = self._longest_hit(st, num_computed_tokens, num_tokens)
        self._n.lookups += 1
        # A full-prompt hit still recomputes the last token: the engine needs its logits.
        num_external = min(hit, num_tokens - 1) - num_computed_tokens
        if num_external <= 0:
            self._n.misses += 1
            return 0, False
        first: list[int] = []
        pinned: list[tuple[int, ...]] = []
        for g in range(self._num_groups):
            lo, hi = self._needed_blocks(g, num_computed_tokens, hit)
            hashes = st.hashers[self._slot[g]].hashes
            pool = self._cpu[g]
            ids = tuple(pool.find_longest_prefix(hashes[lo:hi]))
            assert len(ids) == hi - lo, "hit blocks vanished during the match"
            pool.touch(ids)
            first.append(lo)
            pinned.append(ids)
        st.match = _Match(num_computed_tokens, num_external, tuple(first), tuple(pinned))
        self._n.hits += 1
        self._n.hit_tokens += num_external
        log.debug(
            "offload_hit",
            request_id=rid,
            num_computed_tokens=num_computed_tokens,
            num_external_tokens=num_external,
        )
        return num_external, True

    def _needed_blocks(self, g: int, num_computed: int, hit: int) -> tuple[int, int]:
        """Block index range of group ``g`` a hit of ``hit`` tokens loads."""
        bs = self._block_sizes[g]
        lo = num_computed // bs
        window = self.config.groups[g].sliding_window
        if window is not None:
            lo = max(lo, max(0, hit - window + 1) // bs)
        return lo, hit // bs

    def _longest_hit(self, st: _Request, num_computed: int, num_tokens: int) -> int:
        """Longest token count, a multiple of every block size, the CPU tier holds for all groups."""
        align = self._align
        hit = num_tokens // align * align
        for g in self._full_groups:
            bs = self._block_sizes[g]
            hashes = st.hashers[self._slot[g]].hashes
            cached = self._cpu[g].is_cached
            i, end = num_computed // bs, hit // bs
            while i < end and cached(hashes[i]):
                i += 1
            hit = min(hit, i * bs // align * align)
        changed = True
        while changed and hit > num_computed:
            changed = False
            for g in self._window_groups:
                found = self._window_hit(st, g, num_computed, hit)
                if found < hit:
                    hit, changed = found, True
        return hit if hit > num_computed else num_computed

    def _window_hit(self, st: _Request, g: int, num_computed: int, limit: int) -> int:
        """Largest aligned hit <= ``limit`` whose window blocks of sliding group ``g`` are cached."""
        bs, align = self._block_sizes[g], self._align
        hashes = st.hashers[self._slot[g]].hashes
        cached = self._cpu[g].is_cached
        cand = limit
        while cand > num_computed:
            lo, hi = self._needed_blocks(g, num_computed, cand)
            j = hi - 1
            while j >= lo and cached(hashes[j]):
                j -= 1
            if j < lo:
                return cand
            # Block j is missing: a shorter hit must end at or before it.
            cand = min(cand - align, j * bs // align * align)
        return num_computed

    def update_state_after_alloc(
        self,
        request: RequestLike,
        gpu_block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """Turn the pinned hit into a load into ``gpu_block_ids`` (the request's whole block table).

        ``num_external_tokens`` is what the engine allocated for: 0 drops the pin; less than the hit
        loads fewer blocks. Until the next ``build_step_plan`` a new call replaces the previous one.
        """
        rid = request.request_id
        # -- boundary check (kvflow.core.validate): the whole table, before anything changes --
        table = (
            validate.group_ids(
                rid, gpu_block_ids, self._num_groups, self.config.num_gpu_blocks, self._null
            )
            if num_external_tokens or len(gpu_block_ids)
            else ()
        )
        st = self._requests.get(rid)
        if type(num_external_tokens) is not int or num_external_tokens < 0:
            raise ConfigError(f"{rid}: num_external_tokens must be an int >= 0")
        if num_external_tokens == 0:
            if st is not None:
                self._drop_match(st)
            return
        m = None if st is None else st.match
        if st is None or m is None:
            raise ProtocolError(
                f"{rid}: {num_external_tokens} external tokens but no pinned CPU hit"
            )
        if num_external_tokens > m.num_external_tokens:
            raise ConfigError(
                f"{rid}: {num_external_tokens} external tokens allocated, "
                f"only {m.num_external_tokens} matched"
            )
        last_token = m.num_computed_tokens + num_external_tokens
        gpu: list[tuple[int, ...]] = []
        cpu: list[tuple[int, ...]] = []
        for g in range(self._num_groups):
            lo = m.first[g]
            n = max(0, -(-last_token // self._block_sizes[g]) - lo)
            if len(table[g]) < lo + n:
                raise ConfigError(
                    f"{rid} group {g}: block table has {len(table[g])} blocks, load needs {lo + n}"
                )
            pairs = [
                (gb, cb)
                for gb, cb in zip(table[g][lo : lo + n], m.cpu_block_ids[g][:n], strict=True)
                if gb != self._null
            ]
            gpu.append(tuple(p[0] for p in pairs))
            cpu.append(tuple(p[1] for p in pairs))
        st.request = request
        m.load = (tuple(gpu), tuple(cpu))
        for ids in table:
            self._lazy_taken(ids)
        self._allocated[rid] = st

    # ---- planning -----------------------------------------------------------------------------

    def build_step_plan(self, scheduler_output: SchedulerOutput) -> StepPlan:
        """Every load and store of this step (all PENDING transfers are launched). Pure w.r.t. input."""
        so = scheduler_output
        # -- boundary check (kvflow.core.validate): the step, new requests' counts and tables --
        validate.scheduler_output(so)
        requests = self._requests
        check = self._check_table
        num_groups = self._num_groups
        # (request, confirmed tokens, new block ids, whether they replace the block table)
        dirty: list[tuple[_Request, int, GroupBlockIds, bool]] = []
        for new in so.new_requests:
            st = requests.get(new.request_id)
            if st is None:
                raise ProtocolError(
                    f"unknown new request {new.request_id!r}: match or alloc it first"
                )
            end = new.num_computed_tokens + new.num_scheduled_tokens - new.num_spec_tokens
            confirmed = check(st, end, self._confirmed(st, end), new.block_ids, True)
            dirty.append((st, confirmed, new.block_ids, True))
        no_new = self._no_new
        news = self._running_news
        for c in so.cached_requests:
            st = requests.get(c.request_id)
            if st is None:
                raise ProtocolError(f"unknown running request {c.request_id!r}")
            end = c.num_computed_tokens + c.num_scheduled_tokens - c.num_spec_tokens
            ids = c.new_block_ids
            boundary = st.next_boundary
            if end < boundary:
                if ids == no_new:
                    continue  # the steady state: no block completed, none allocated
                if not c.resumed_from_preemption:
                    # Only new blocks (vLLM-like engines pass every allocation at once): inline,
                    # as the common case of a step where many requests cross into a new block.
                    num_tokens = len(st.request.all_token_ids)
                    confirmed = end if end < num_tokens else num_tokens
                    if confirmed >= st.confirmed and len(ids) == num_groups:
                        dirty.append((st, confirmed, ids, False))
                        continue
            dirty.append(news(st, end, ids, c.resumed_from_preemption))
        decode = so.decode_requests
        group_sizes = self._group_sizes
        # Columns of one-token steps: each entry is a CachedRequest scheduling 1 token. The
        # steady state of a big batch, so ``_running_news`` is inlined: the table check is a
        # comparison per group, and the call only happens to raise its error.
        for rid, computed, ids in zip(
            decode.request_ids, decode.num_computed_tokens, decode.new_block_ids, strict=True
        ):
            st = requests.get(rid)
            if st is None:
                raise ProtocolError(f"unknown running request {rid!r}")
            end = computed + 1
            if end < st.next_boundary and ids == no_new:
                continue
            num_tokens = len(st.request.all_token_ids)
            confirmed = end if end < num_tokens else num_tokens
            have = st.table
            if len(ids) != num_groups:
                check(st, end, confirmed, ids, False)
            for g, bs in group_sizes:
                if len(have[g]) + len(ids[g]) < confirmed // bs:
                    check(st, end, confirmed, ids, False)
            dirty.append((st, confirmed, ids, False))
        # -- boundary check (kvflow.core.validate): every entry that changes something --
        validate.step_entries(
            dirty, _request_id, num_groups, self.config.num_gpu_blocks, self._null
        )
        # Every table is checked: from here on nothing raises on bad input.

        flush = False
        if so.preempted_request_ids:
            flush = True
            for rid in sorted(so.preempted_request_ids):
                st = requests.get(rid)
                if st is not None:
                    self._preempt(st)
        if so.finished_request_ids:
            for rid in sorted(so.finished_request_ids):
                st = requests.get(rid)
                if st is not None and not st.finishing:
                    # The engine dropped the request without request_finished: its blocks are gone.
                    self._finish(st, None, engine_freed=True)
        if self._allocated:
            for st in self._allocated.values():
                self._plan_load(st)
            self._allocated.clear()
        advancing: list[_Request] = []
        replaced = False
        lazy = not self._eager
        # Eager stores coalesced over ``eager_store_interval`` plans: a request with a completed
        # block joins the deferred ones here, while its state is at hand, and is skipped until its
        # next block completes, as if advanced (the cursors, which ``_advance`` reads, stay where
        # the last store left them).
        deferred = self._deferred if self._interval > 1 else None
        fresh = not deferred
        sizes = self._block_sizes
        for st, confirmed, ids, replace in dirty:
            if lazy:
                for group_ids in ids:
                    self._lazy_taken(group_ids)
            if replace:
                replaced = True
                st.table = tuple([list(g) for g in ids])
                st.cursor = [0] * num_groups
            elif num_groups == 1:
                if ids[0]:
                    st.table[0].extend(ids[0])
            else:
                for table, new_ids in zip(st.table, ids, strict=True):
                    if new_ids:
                        table.extend(new_ids)
            if replace or confirmed >= st.next_boundary or confirmed < st.confirmed:
                if deferred is None:
                    advancing.append(st)
                else:
                    deferred[st] = None
                    boundary = 1 << 62
                    for bs in sizes:
                        end = (confirmed // bs + 1) * bs
                        if end < boundary:
                            boundary = end
                    st.next_boundary = boundary
            # Else no group completes a block and confirmed tokens did not go back: advancing
            # would change nothing, its boundary included.
            st.confirmed = confirmed
        if deferred:
            # Counted from the plan that deferred the oldest of them. Steps with new or resumed
            # requests (prefill: large stores) store at once, taking every deferred block along;
            # only steady decode steps are coalesced.
            self._deferred_plans = (0 if fresh else self._deferred_plans) + 1
            if replaced or self._deferred_plans >= self._interval:
                advancing = list(deferred)
                deferred.clear()
        if advancing:
            # One pass over the step's completed blocks (requests are independent of each other
            # here, so advancing after every table grew is the same as advancing each in turn).
            batch = self._advance(advancing)
            if batch.reqs:
                self._plan_store(batch, STEP_STORE_ID)
        if not self._eager and not self._reset_pending:
            self._lazy_walk()
        if not self._pending and not self._abandoned:
            return StepPlan(so.step, (), (), flush, ())  # most eager steps: nothing to launch
        return self._launch(so.step, flush)

    def _plan_load(self, st: _Request) -> None:
        m, st.match = st.match, None
        assert m is not None
        assert m.load is not None
        gpu, cpu = m.load
        for g, pinned in enumerate(m.cpu_block_ids):
            used = set(cpu[g])
            self._cpu[g].free(reversed([b for b in pinned if b not in used]))
        xfer = self._new_xfer(_LOAD, st.request.request_id, [st], gpu, cpu)
        log.debug(
            "offload_load_planned",
            request_id=st.request.request_id,
            transfer_id=xfer.transfer.transfer_id,
            num_blocks=xfer.spec.num_blocks,
        )

    @staticmethod
    def _confirmed(st: _Request, end: int) -> int:
        """Tokens whose KV is computed and not speculative: ``end`` capped by the request's."""
        num_tokens = len(st.request.all_token_ids)
        return end if end < num_tokens else num_tokens

    def _running_news(
        self, st: _Request, end: int, ids: GroupBlockIds, replace: bool
    ) -> tuple[_Request, int, GroupBlockIds, bool]:
        """A running request with news (``end`` tokens computed after the step), its table
        checked; the ``dirty`` entry ``build_step_plan`` applies once every request passed."""
        num_tokens = len(st.request.all_token_ids)
        confirmed = end if end < num_tokens else num_tokens
        if (
            replace
            or confirmed >= st.next_boundary
            or confirmed < st.confirmed
            or len(ids) != self._num_groups
        ):
            self._check_table(st, end, confirmed, ids, replace)
        # Else only new blocks: every group's table already holds its confirmed blocks (the
        # check passed when they completed; tables only grow until a preemption resets the
        # boundary), so it holds them with more blocks too.
        return st, confirmed, ids, replace

    def _check_table(
        self, st: _Request, end: int, confirmed: int, ids: GroupBlockIds, replace: bool
    ) -> int:
        """Validate the request's block table after this step's ids; return ``confirmed``."""
        if len(ids) != self._num_groups:
            rid = st.request.request_id
            raise ConfigError(f"{rid}: {len(ids)} block groups, expected {self._num_groups}")
        table = st.table
        for g, bs in self._group_sizes:
            have = len(ids[g]) if replace else len(table[g]) + len(ids[g])
            if have < confirmed // bs:
                raise ConfigError(
                    f"{st.request.request_id} group {g}: {have} GPU blocks cannot hold "
                    f"{end} computed tokens"
                )
        return confirmed

    def _launch(self, step: int, flush: bool) -> StepPlan:
        stores: list[TransferSpec] = []
        loads: list[TransferSpec] = []
        for x in self._pending:
            apply(x.transfer, _LAUNCH, cause="step_plan")
            (stores if x.spec.direction is _STORE else loads).append(x.spec)
        self._pending.clear()
        abandoned = tuple(self._abandoned)
        self._abandoned.clear()
        return StepPlan(
            step=step, stores=tuple(stores), loads=tuple(loads), flush=flush, abandoned=abandoned
        )

    def _hash_upto(self, st: _Request, num_tokens: int) -> None:
        tokens = st.request.all_token_ids
        for hasher in st.hashers:
            hasher.extend_to(tokens, num_tokens)

    def _advance(self, sts: Sequence[_Request]) -> _StoreBatch:
        """Hand the blocks the requests completed since their last call to the store policy;
        returns the eager candidates, in request order, as one batch.

        An eager candidate is a completed block worth storing: not the null block, not cached on
        CPU, not being stored, not picked already by this batch. Everything that is the same for
        every request is looked up once per call, not once per request or block.
        """
        batch = _StoreBatch.empty(self._num_groups)
        eager = self._eager and not self._reset_pending
        lazy = not self._eager
        null = self._null
        reqs = batch.reqs
        record = self._gpu_hash
        view = self._gpu
        # Per group, everything the loop reads, in one tuple: the pools' hash → block dicts
        # themselves (a method call per block cost more than the lookup), the hashes being
        # stored, and this batch's picks.
        groups = tuple(
            zip(
                self._block_sizes,
                self._slot,
                [pool.cached_hashes for pool in self._cpu],
                self._storing,
                batch.blocks,
                batch.owners,
                strict=True,
            )
        )
        if eager and len(groups) == 1:
            self._advance_one_group(sts, groups[0], reqs)
            return batch
        for st in sts:
            confirmed = st.confirmed
            if st.hashing:
                # Only kvflow's own hashers read the tokens: a cold request view and token list
                # per request otherwise, on every store.
                tokens = st.request.all_token_ids
                for hasher in st.hashing:
                    hasher.extend_to(tokens, confirmed)
            hash_lists = st.hash_lists
            boundary = 1 << 62
            added = False
            cursor = st.cursor
            table = st.table
            for g, (bs, slot, in_cpu, in_flight, picked, owners) in enumerate(groups):
                done = confirmed // bs
                end = (done + 1) * bs
                if end < boundary:
                    boundary = end
                cur = cursor[g]
                if done <= cur:
                    continue
                cursor[g] = done
                ids = table[g]
                hs = hash_lists[slot]
                if eager:
                    for i in range(cur, done):
                        b, h = ids[i], hs[i]
                        if b == null or h in in_flight or h in picked or h in in_cpu:
                            continue
                        picked[h] = b
                        owners.append(st)
                        added = True
                elif lazy:
                    assert view is not None
                    for i in range(cur, done):
                        b = ids[i]
                        if b != null:
                            record[b] = (g, hs[i], view.block_hash(b))
            st.next_boundary = boundary
            if added:
                reqs.append(st)
        return batch

    def _advance_one_group(
        self,
        sts: Sequence[_Request],
        group: tuple[
            int, int, Container[BlockHash], dict[BlockHash, int], dict[BlockHash, int], list[Any]
        ],
        reqs: list[_Request],
    ) -> None:
        """``_advance``'s eager loop for one KV cache group (most models), with the group loop
        unrolled: it runs once per request with a completed block, on every store."""
        bs, slot, in_cpu, in_flight, picked, owners = group
        null = self._null
        for st in sts:
            confirmed = st.confirmed
            if st.hashing:
                tokens = st.request.all_token_ids
                for hasher in st.hashing:
                    hasher.extend_to(tokens, confirmed)
            done = confirmed // bs
            st.next_boundary = (done + 1) * bs
            cursor = st.cursor
            cur = cursor[0]
            if done <= cur:
                continue
            cursor[0] = done
            ids = st.table[0]
            hs = st.hash_lists[slot]
            added = False
            for i in range(cur, done):
                b, h = ids[i], hs[i]
                if b == null or h in in_flight or h in picked or h in in_cpu:
                    continue
                picked[h] = b
                owners.append(st)
                added = True
            if added:
                reqs.append(st)

    def _plan_store(self, batch: _StoreBatch, request_id: str) -> _Xfer | None:
        """Allocate CPU blocks (evicting LRU cached ones) and queue one store; skip what won't fit."""
        gpu: list[tuple[int, ...]] = []
        cpu: list[tuple[int, ...]] = []
        hashes: list[tuple[BlockHash, ...]] = []
        owners: list[tuple[_Request | None, ...]] = []
        evicted = False
        for g, pool in enumerate(self._cpu):
            picked = batch.blocks[g]
            want = len(picked)
            if not want:
                gpu.append(())
                cpu.append(())
                hashes.append(())
                owners.append(())
                continue
            hs = tuple(picked)
            ids = tuple(picked.values())
            who = tuple(batch.owners[g])
            n = pool.num_free_blocks
            if n < want:
                self._n.skipped_stores += want - n
                log.info(
                    "offload_store_skipped", group=g, num_blocks=want - n, reason="cpu_pool_full"
                )
                hs, ids, who = hs[:n], ids[:n], who[:n]
            else:
                n = want
            cached_before = pool.num_cached_blocks
            cpu.append(tuple(pool.get_new_blocks(n)) if n else ())
            evicted = evicted or pool.num_cached_blocks < cached_before
            gpu.append(ids)
            hashes.append(hs)
            owners.append(who)
        if evicted and not self._eager:
            # Evicted copies may back blocks ahead of the cursor: they are no longer covered.
            self._lazy_reset("cpu_eviction")
        if not any(cpu):
            return None
        shared = request_id == STEP_STORE_ID
        if len(batch.reqs) == 1:
            request_id = batch.reqs[0].request.request_id
        xfer = self._new_xfer(_STORE, request_id, batch.reqs, tuple(gpu), tuple(cpu), shared=shared)
        xfer.hashes = tuple(hashes)
        xfer.owners = tuple(owners)
        tid = xfer.transfer.transfer_id
        for g, hs in enumerate(hashes):
            if hs:
                self._storing[g].update(dict.fromkeys(hs, tid))
        return xfer

    def _new_xfer(
        self,
        direction: Direction,
        request_id: str,
        reqs: list[_Request],
        gpu: GroupBlockIds,
        cpu: GroupBlockIds,
        *,
        shared: bool = False,
    ) -> _Xfer:
        tid = self._next_id
        self._next_id += 1
        spec = (
            TransferSpec.trusted(tid, request_id, direction, gpu, cpu)
            if direction is _STORE
            else TransferSpec(tid, request_id, direction, gpu, cpu)
        )
        xfer = _Xfer(Transfer(tid, direction, request_id), spec, reqs)
        if self._gpu is not None and (direction is _LOAD or self._store_refs):
            # Hold the GPU ends too: the engine may free them (an aborted load, a block leaving
            # a sliding window, a lazy store's free block) while the copy still runs.
            self._gpu.touch(_all_ids(gpu))
            xfer.holds_gpu = True
        self._xfers[tid] = xfer
        self._pending.append(xfer)
        if shared:
            xfer.shared = True
            self._shared[tid] = xfer
        else:
            for st in reqs:
                st.transfers[tid] = xfer
        return xfer

    def _lazy_reset(self, cause: str) -> None:
        if self._cursor is not None or self._ahead:
            log.debug("offload_lazy_cursor_reset", cause=cause, covered=len(self._ahead))
        self._cursor = None
        self._cursor_hash = None
        self._ahead.clear()

    def _lazy_taken(self, ids: Sequence[int]) -> None:
        """The engine took these GPU blocks (allocation or prefix hit): they left the free queue,
        and what kvflow recorded of their content no longer holds."""
        record = self._gpu_hash
        if record:
            # A block handed to a request may be refilled (a fresh allocation, a load) before
            # kvflow sees its new owner's tokens: a lazy walk trusting the old record would store
            # the new content under the old hash. The new owner's ``_advance`` records it again.
            for b in ids:
                record.pop(b, None)
        ahead = self._ahead
        if not ahead:
            return
        for b in ids:
            if b in ahead:
                ahead.discard(b)
                if b == self._cursor:
                    self._lazy_reset("cursor_block_taken")
                    return

    def _lazy_walk(self) -> None:
        """Extend the covered prefix of the GPU free queue to ``lazy_watermark`` blocks, storing
        the hashed blocks in it that the CPU tier lacks.

        The cursor is the last covered block; every block from the queue head to it is covered
        (stored, being stored, or holding nothing worth storing). It survives steps: blocks the
        engine takes leave ``_ahead`` (``_lazy_taken``), freed hashed blocks join behind the
        cursor. It resets, and the next walk starts from the head, when its block is reused, or
        when a CPU eviction or a failed store may have uncovered a block ahead of it.
        """
        view = self._gpu
        assert view is not None
        ahead = self._ahead
        cursor = self._cursor
        if cursor is not None and (
            not view.is_free(cursor) or view.block_hash(cursor) != self._cursor_hash
        ):
            self._lazy_reset("cursor_block_reused")
            cursor = None
        budget = self.config.lazy_watermark - len(ahead)
        if budget <= 0:
            return
        bid = view.first_free() if cursor is None else view.next_free(cursor)
        record = self._gpu_hash
        null = self._null
        picked: list[dict[BlockHash, int]] = [{} for _ in range(self._num_groups)]
        last = cursor
        while bid is not None:
            budget -= 1
            ahead.add(bid)
            rec = record.get(bid) if bid != null else None
            engine_hash = None if rec is None else view.block_hash(bid)
            # A block the engine refilled behind our back has a new engine hash: not ours to store.
            if rec is not None and engine_hash is not None and rec[2] in (None, engine_hash):
                g, h, _ = rec
                if (
                    h not in self._storing[g]
                    and h not in picked[g]
                    and not self._cpu[g].is_cached(h)
                ):
                    picked[g][h] = bid
                else:
                    last = bid
            else:
                last = bid
            if budget <= 0:
                break
            bid = view.next_free(bid)
        if last is not None and last != cursor:
            self._cursor, self._cursor_hash = last, view.block_hash(last)
        if not any(picked):
            return
        for p in picked:
            # A picked block leaves the free queue while its store holds it; it comes back
            # behind the cursor, already covered.
            ahead.difference_update(p.values())
        self._plan_store(_StoreBatch(picked, [[None] * len(p) for p in picked]), LAZY_REQUEST_ID)

    # ---- lifecycle ----------------------------------------------------------------------------

    def _new_request(self, request: RequestLike) -> _Request:
        hashers = self._hashers(request)
        st = _Request(
            request=request,
            hashers=hashers,
            hashing=_own(hashers),
            hash_lists=tuple(h.hashes for h in hashers),
            table=tuple([] for _ in range(self._num_groups)),
            cursor=[0] * self._num_groups,
        )
        self._requests[request.request_id] = st
        return st

    def _hashers(self, request: RequestLike) -> list[HashChain]:
        """Per block size, the engine's own hashes of the request where it has them, else
        kvflow's hasher over its tokens."""
        # ``EngineHashedRequest`` by its one method: a runtime protocol check costs ~14 µs.
        engine: Callable[[int], Sequence[BlockHash] | None] | None = getattr(
            request, "engine_block_hashes", None
        )
        out: list[HashChain] = []
        for bs in self._hasher_sizes:
            hashes = None if engine is None else engine(bs)
            out.append(
                BlockHasher(bs, request.extra_keys)
                if hashes is None
                else EngineBlockHashes(bs, hashes)
            )
        return out

    def _drop_match(self, st: _Request) -> None:
        m, st.match = st.match, None
        if m is not None:
            self._allocated.pop(st.request.request_id, None)
            for g, ids in enumerate(m.cpu_block_ids):
                self._cpu[g].free(reversed(ids))

    def _cancel_or_abandon(self, st: _Request, *, stores: bool) -> None:
        """Cancel the request's PENDING transfers, abandon its in-flight loads (and stores)."""
        for x in self._live(st):
            state = x.transfer.state
            is_load = x.spec.direction is _LOAD
            if len(x.reqs) > 1 and (stores or is_load):
                # A step's store shared with other requests: only this request's blocks go.
                x.dropped.add(st)
                x.reqs.remove(st)
                if not x.shared:
                    del st.transfers[x.transfer.transfer_id]
            elif state is _PENDING:
                self._cancel(x)
            elif state is _IN_FLIGHT and (stores or is_load):
                self._abandon(x, cause="request_gone")

    def _live(self, st: _Request) -> list[_Xfer]:
        """The request's live transfers in launch order: its own and the step stores naming it."""
        own = list(st.transfers.values())
        shared = [x for x in self._shared.values() if st in x.reqs]
        if not shared:
            return own
        return sorted(own + shared, key=_transfer_id)

    def _has_live(self, st: _Request) -> bool:
        return bool(st.transfers) or any(st in x.reqs for x in self._shared.values())

    def _preempt(self, st: _Request) -> None:
        # In-flight stores keep going: the plan's flush makes the engine wait for them before it
        # reuses the blocks, so their data is good. A load's target blocks are gone.
        self._drop_match(st)
        self._cancel_or_abandon(st, stores=False)
        # Its GPU blocks are gone: completed blocks not stored yet are lost with them.
        self._deferred.pop(st, None)
        st.table = tuple([] for _ in range(self._num_groups))
        st.cursor = [0] * self._num_groups
        st.confirmed = 0
        st.next_boundary = 0
        log.debug("offload_request_preempted", request_id=st.request.request_id)

    def request_finished(
        self, request: RequestLike, block_ids: Sequence[Sequence[int]] | None = None
    ) -> tuple[bool, dict[str, object] | None]:
        """The request is done. Returns ``(delay_free, params)``: if ``delay_free``, the engine keeps
        its GPU blocks until the request id appears in ``StepOutcome.finished_sending``.

        Eager: any full computed block not yet stored is stored now (from ``block_ids``).
        """
        # -- boundary check (kvflow.core.validate): the table, before anything changes --
        if block_ids is not None:
            block_ids = validate.group_ids(
                request.request_id,
                block_ids,
                self._num_groups,
                self.config.num_gpu_blocks,
                self._null,
            )
        st = self._requests.get(request.request_id)
        if st is None:
            return False, None
        return self._finish(st, block_ids, engine_freed=False), None

    def _finish(
        self, st: _Request, block_ids: Sequence[Sequence[int]] | None, *, engine_freed: bool
    ) -> bool:
        rid = st.request.request_id
        table: list[list[int]] | None = None
        if block_ids is not None and not engine_freed:
            table = [[int(b) for b in g] for g in block_ids]
            if len(table) != self._num_groups:
                raise ConfigError(f"{rid}: {len(table)} block groups, expected {self._num_groups}")
        self._drop_match(st)
        # If the engine already freed the blocks, copies reading them produce garbage: abandon.
        self._cancel_or_abandon(st, stores=engine_freed)
        # Blocks deferred by the store interval are stored with the rest: no cursor passed them,
        # and the manager's own table still names them when the engine passes none.
        deferred = st in self._deferred
        self._deferred.pop(st, None)
        if not engine_freed and not self._reset_pending and (table is not None or deferred):
            if table is not None:
                confirmed = st.confirmed
                st.table = tuple(
                    table[g] if len(table[g]) >= confirmed // bs else st.table[g]
                    for g, bs in enumerate(self._block_sizes)
                )
            batch = self._advance((st,))
            if batch.reqs:
                self._plan_store(batch, rid)
        st.finishing = True
        live = self._has_live(st)
        st.delay_free = live and not engine_freed
        if live:
            self._waiting[st] = None
        else:
            self._waiting.pop(st, None)
            del self._requests[rid]
        log.debug("offload_request_finished", request_id=rid, delay_free=st.delay_free)
        return st.delay_free

    def _cancel(self, x: _Xfer) -> None:
        apply(x.transfer, _CANCEL, cause="cancelled")
        self._pending.remove(x)
        self._release(x, commit=False)

    def _abandon(self, x: _Xfer, *, cause: str) -> None:
        apply(x.transfer, _ABANDON, cause=cause)
        self._abandoned.append(x.transfer.transfer_id)
        self._n.abandoned_transfers += 1

    def reset_cache(self) -> ResetStatus:
        """Forget the CPU prefix cache. In-flight transfers are abandoned (their results dropped
        when they settle); the reset is PENDING until then and COMPLETE after."""
        for st in self._requests.values():
            self._drop_match(st)
        for x in list(self._xfers.values()):
            state = x.transfer.state
            if state is _PENDING:
                self._cancel(x)
            elif state is _IN_FLIGHT:
                x.reset = True
                self._abandon(x, cause="reset")
        self._reset_pending = True
        self._gpu_hash.clear()
        self._lazy_reset("reset")
        status = self._try_complete_reset()
        log.info("offload_reset", status=status.value, in_flight=len(self._xfers))
        return status

    def _try_complete_reset(self) -> ResetStatus:
        if not self._reset_pending:
            return ResetStatus.COMPLETE
        if self._xfers:
            return ResetStatus.PENDING
        for pool in self._cpu:
            done = pool.reset_prefix_cache()
            assert done, f"{pool.name}: blocks still in use after every transfer settled"
        self._reset_pending = False
        self._reset_done = True
        return ResetStatus.COMPLETE

    # ---- reports ------------------------------------------------------------------------------

    def update_from_reports(self, reports: Iterable[StepReport]) -> StepOutcome:
        """Apply worker reports. A transfer settles once all ``world_size`` ranks reported it: it
        commits if all succeeded, else fails. Invalid input raises ``ReportError`` and changes nothing.
        """
        agg = aggregate(reports, self.config.world_size)
        for outcome_ranks in (agg.completed, agg.failed):
            for tid, ranks in outcome_ranks.items():
                x = self._xfers.get(tid)
                if x is None:
                    raise ReportError(f"report for unknown or settled transfer {tid}")
                if x.transfer.state is _PENDING:
                    raise ReportError(f"report for transfer {tid}, which was never launched")
                twice = ranks & x.reported.keys()
                if twice:
                    raise ReportError(f"rank(s) {sorted(twice)} reported transfer {tid} twice")
        touched: list[int] = []
        for ok, outcome_ranks in ((True, agg.completed), (False, agg.failed)):
            for tid, ranks in outcome_ranks.items():
                x = self._xfers[tid]
                for r in ranks:
                    x.reported[r] = ok
                touched.append(tid)
        committed: list[int] = []
        failed: list[int] = []
        for tid in sorted(set(touched)):
            x = self._xfers[tid]
            if len(x.reported) < self.config.world_size:
                continue  # a rank is still copying: keep every ref
            if self._settle(x, agg.invalid_block_ids):
                committed.append(tid)
            else:
                failed.append(tid)
        self._try_complete_reset()
        out = StepOutcome(
            _take(self._finished_sending),
            _take(self._finished_recving),
            tuple(committed),
            tuple(failed),
            _take(self._invalid),
            self._reset_done,
        )
        self._reset_done = False
        return out

    def _settle(self, x: _Xfer, reported_invalid: frozenset[int]) -> bool:
        """All ranks reported: commit or fail, then release. Returns whether it committed."""
        ok = all(x.reported.values())
        t = x.transfer
        is_load = t.direction is _LOAD
        alive = bool(x.reqs) and not x.reqs[0].finishing
        if t.state is _ABANDONED:
            apply(t, _COMPLETE if ok else _FAIL, cause="abandoned_done")
            if is_load and x.reset and alive:
                self._load_invalid(x, frozenset())
            self._release(x, commit=False)
            return False
        apply(t, _COMPLETE if ok else _FAIL, cause="all_ranks_reported")
        if not ok:
            self._n.failed_transfers += 1
            if not is_load and not self._eager:
                # Blocks ahead of the lazy cursor may have counted on this store.
                self._lazy_reset("store_failed")
            elif not is_load:
                self._rearm_failed_store(x)
            log.warning(
                "offload_transfer_failed",
                transfer_id=t.transfer_id,
                request_id=t.request_id,
                direction=t.direction.value,
            )
            if is_load and alive:
                self._load_invalid(x, reported_invalid)
        elif is_load and alive:
            self._finished_recving.add(t.request_id)
        apply(t, _RELEASE, cause="settled")
        self._release(x, commit=ok)
        return ok

    def _rearm_failed_store(self, x: _Xfer) -> None:
        """An eager store failed: its blocks become eligible again for every running request that
        still holds one (its own, or one skipped as a duplicate of it), so a later step or
        ``request_finished`` stores them. The request's cursor moves back to its first such
        block; full-attention groups only (a sliding window may have freed its old blocks)."""
        failed = [frozenset(hs) for hs in x.hashes]
        rearmed = 0
        for st in self._requests.values():
            if st.finishing:
                continue
            moved = False
            for g in self._full_groups:
                lost = failed[g] if g < len(failed) else frozenset()
                if not lost:
                    continue
                hs = st.hash_lists[self._slot[g]]
                for i in range(st.cursor[g]):
                    if hs[i] in lost:
                        st.cursor[g] = i
                        moved = True
                        break
            if moved:
                st.next_boundary = 0  # the next step advances it, even without a new block
                rearmed += 1
        if rearmed:
            log.info("offload_store_rearmed", transfer_id=x.transfer.transfer_id, requests=rearmed)

    def _load_invalid(self, x: _Xfer, reported: frozenset[int]) -> None:
        ids = {b for g in x.spec.gpu_block_ids for b in g}
        mine = ids & reported
        self._invalid |= mine or ids
        self._finished_recving.add(x.transfer.request_id)

    def _release(self, x: _Xfer, *, commit: bool) -> None:
        """Drop every ref the transfer holds; a committed store's blocks enter the prefix cache."""
        spec = x.spec
        tid = spec.transfer_id
        store = spec.direction is _STORE
        nbytes = 0
        nblocks = 0
        groups = self.config.groups
        for g, cpu_ids in enumerate(spec.cpu_block_ids):
            if not cpu_ids:
                continue
            pool = self._cpu[g]
            if store:
                storing = self._storing[g]
                hs = x.hashes[g]
                if len(storing) == len(hs):
                    # Each live store's hashes map to it alone (``_advance`` and the lazy walk
                    # skip hashes being stored): these are all of them.
                    storing.clear()
                else:
                    for h in hs:
                        if storing.get(h) == tid:
                            del storing[h]
                if commit:
                    keep: Sequence[BlockHash | None] = hs
                    if x.dropped:
                        # The blocks of requests whose GPU blocks were freed are not cached.
                        dropped = x.dropped
                        keep = [
                            None if o in dropped else h
                            for h, o in zip(hs, x.owners[g], strict=True)
                        ]
                    # Cached, then freed in reverse: a request's tail blocks are evicted first.
                    n = pool.release_owned(cpu_ids, keep)
                    nblocks += n
                    nbytes += n * groups[g].block_bytes
                    continue
            elif commit:
                nblocks += len(cpu_ids)
                nbytes += len(cpu_ids) * groups[g].block_bytes
            # Reverse: a request's tail blocks become the first to be evicted.
            pool.free_owned(cpu_ids[::-1])
        if x.holds_gpu:
            assert self._gpu is not None
            self._gpu.free(_all_ids(spec.gpu_block_ids))
        if commit:
            counters = self._n
            if store:
                counters.blocks_stored += nblocks
                counters.bytes_stored += nbytes
            else:
                counters.blocks_loaded += nblocks
                counters.bytes_loaded += nbytes
        del self._xfers[tid]
        waiting = self._waiting
        if x.shared:
            del self._shared[tid]
            if not waiting:
                return  # no finished request waits: none of its requests' state is touched
        for st in x.reqs:
            if not x.shared:
                del st.transfers[tid]
            if st in waiting and not self._has_live(st):
                del waiting[st]
                rid = st.request.request_id
                del self._requests[rid]
                if st.delay_free:
                    self._finished_sending.add(rid)


__all__ = [
    "LAZY_REQUEST_ID",
    "STEP_STORE_ID",
    "GroupSpec",
    "OffloadManager",
    "OffloadStats",
    "ResetStatus",
    "SchedulerConfig",
    "StepOutcome",
    "StorePolicy",
]
