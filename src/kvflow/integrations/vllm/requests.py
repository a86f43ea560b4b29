"""Request translation: vLLM's requests and scheduler outputs as kvflow's engine-neutral types.

``VLLMRequestView`` shows a vLLM ``Request`` to kvflow's manager without copying its tokens and with
vLLM's own block hashes; ``translate_scheduler_output`` turns one step's ``SchedulerOutput`` into
kvflow's, passing on only the requests with news for the CPU tier (``steady_decode`` tells the
step the connector hands kvflow's scheduler whole, as columns). Block ids arrive per vLLM KV
cache group; a
``GroupSelect`` keeps the groups kvflow offloads (vLLM's prefix-cacheable ones) in kvflow's order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from kvflow.core.protocol import GroupBlockIds
from kvflow.core.requests import (
    NO_DECODE_REQUESTS,
    CachedRequest,
    NewRequest,
    SchedulerOutput,
    decode_columns,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput as VLLMSchedulerOutput
    from vllm.v1.request import Request

GroupSelect = Callable[[Sequence[Sequence[int]]], tuple[Sequence[int], ...]]
"""vLLM's per-group block ids → those of the groups kvflow offloads (None where it offloads all)."""


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

    __slots__ = (
        "_hash_block_size",
        "all_token_ids",
        "extra_keys",
        "request",
        "skip_reading_prefix_cache",
    )

    def __init__(self, request: Request, hash_block_size: int | None = None) -> None:
        self.request = request
        self.extra_keys: tuple[int | str | bytes, ...] = request_extra_keys(request)
        tokens: Sequence[int] = request.all_token_ids
        inner = getattr(tokens, "_x", None)
        self.all_token_ids: Sequence[int] = inner if type(inner) is list else tokens
        # Only a request vLLM hashes (it was given a block hasher) has hashes to share.
        hashed = getattr(request, "_block_hasher", None) is not None
        self._hash_block_size = hash_block_size if hashed else None
        # Prompt logprobs need every prompt token computed: vLLM reads no cache for such a
        # request, so kvflow's manager neither offers a CPU hit nor pins one.
        self.skip_reading_prefix_cache = bool(getattr(request, "skip_reading_prefix_cache", False))

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
    view_type: ClassVar[type[VLLMRequestView]] = VLLMRequestView  # PD: PDRequestView

    def __init__(self, hash_block_size: int | None = None) -> None:
        self._views: dict[str, VLLMRequestView] = {}
        self._hash_block_size = hash_block_size

    def get(self, request: Request) -> VLLMRequestView:
        view = self._views.get(request.request_id)
        if view is None or view.request is not request:
            view = self.view_type(request, self._hash_block_size)
            self._views[request.request_id] = view
        return view

    def pop(self, request: Request) -> VLLMRequestView:
        view = self._views.pop(request.request_id, None)
        if view is not None and view.request is request:
            return view
        return self.view_type(request, self._hash_block_size)

    def __len__(self) -> int:
        return len(self._views)


# ---- block ids and scheduler outputs --------------------------------------------------------------


def group_block_ids(block_ids: Sequence[Sequence[int]]) -> GroupBlockIds:
    """vLLM's per-group block lists (``tuple[list[int], ...]``) as kvflow's ``GroupBlockIds``."""
    return tuple(map(tuple, block_ids))


_NO_IDS: frozenset[str] = frozenset()


def _has_blocks(new_ids: Sequence[Sequence[int]] | None) -> bool:
    return new_ids is not None and any(new_ids)


def steady_decode(scheduler_output: VLLMSchedulerOutput) -> bool:
    """Whether vLLM's step schedules its running requests only, one token each: none new,
    resumed, finished, preempted or speculative (nearly every step of a serving engine)."""
    so = scheduler_output
    return (
        not so.scheduled_new_reqs
        and not so.scheduled_cached_reqs.resumed_req_ids
        and not so.finished_req_ids
        and not so.preempted_req_ids
        and not so.scheduled_spec_decode_tokens
        and bool(so.num_scheduled_tokens)
        # The counts are positive ints summing to the total: all 1 when it equals their number.
        and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens)
    )


def translate_scheduler_output(
    scheduler_output: VLLMSchedulerOutput,
    step: int,
    num_groups: int,
    boundary: int = 1,
    select: GroupSelect | None = None,
    *,
    running: bool = True,
) -> SchedulerOutput:
    """vLLM's ``SchedulerOutput`` of one step as kvflow's (block ids per KV cache group).

    ``num_computed_tokens`` is, in both, the count before this step's tokens. A running request
    is passed on only when it has news for the CPU tier: new blocks, a resumption, speculative
    tokens, or computed tokens that reach a multiple of ``boundary`` this step (the connector
    passes the gcd of the groups' block sizes, so no block completion is ever skipped; 1 passes
    every request). In steady decode that skips most of a batch, which keeps the adapter's cost
    per step proportional to the blocks that complete and are allocated rather than to the
    requests that run (``KVFlowConnector`` hands kvflow's own scheduler such a step whole, as
    columns: ``OffloadScheduler.decode_step``).

    ``select`` keeps the block ids of the groups kvflow offloads (``num_groups`` of them).
    ``running=False`` (the lazy policy over a keyed GPU view, which needs no running request's
    steps) passes on only resumed requests, whose whole new table the manager must see.
    """
    new_reqs = scheduler_output.scheduled_new_reqs
    cached_data = scheduler_output.scheduled_cached_reqs
    if (
        not running
        and not new_reqs
        and not cached_data.resumed_req_ids
        and not scheduler_output.finished_req_ids
        and not scheduler_output.preempted_req_ids
    ):
        return SchedulerOutput(step)  # lazy over a keyed view, nothing new: no news
    num_scheduled = scheduler_output.num_scheduled_tokens
    spec = scheduler_output.scheduled_spec_decode_tokens
    # Most steps finish, preempt and add nothing: build no empty containers for them.
    finished_ids, preempted_ids = (
        scheduler_output.finished_req_ids,
        scheduler_output.preempted_req_ids,
    )
    finished = frozenset(finished_ids) if finished_ids else _NO_IDS
    preempted = frozenset(preempted_ids) if preempted_ids else _NO_IDS
    new: tuple[NewRequest, ...] = ()
    if new_reqs:
        new = tuple(
            NewRequest(
                r.req_id,
                r.block_ids if select is None else select(r.block_ids),
                r.num_computed_tokens,
                num_scheduled.get(r.req_id, 0),
                len(spec.get(r.req_id, ())),
            )
            for r in new_reqs
        )
    resumed = cached_data.resumed_req_ids
    req_ids = cached_data.req_ids
    new_block_ids = cached_data.new_block_ids
    if select is not None and (running or resumed):
        new_block_ids = [None if ids is None else select(ids) for ids in new_block_ids]
    num_computed = cached_data.num_computed_tokens
    no_blocks: GroupBlockIds = ((),) * num_groups
    cached: list[CachedRequest] = []
    decode = NO_DECODE_REQUESTS
    # Every count is 1: the counts are positive ints and vLLM's total is their sum, so they all
    # are 1 exactly when the total equals their number (no pass over the batch's counts).
    if not running:
        # Nothing per request unless some resumed (rare).
        for rid, new_ids, computed in zip(
            req_ids if resumed else (), new_block_ids, num_computed, strict=False
        ):
            if rid in resumed:
                cached.append(
                    CachedRequest(
                        rid,
                        new_ids if _has_blocks(new_ids) else no_blocks,
                        computed,
                        num_scheduled[rid],
                        len(spec.get(rid, ())),
                        True,
                    )
                )
    elif (
        not resumed
        and not spec
        and num_scheduled
        and scheduler_output.total_num_scheduled_tokens == len(num_scheduled)
    ):
        # Steady decode: one token per request, nothing resumed or speculative. A request has
        # news only if it got blocks or its one token completes a multiple of ``boundary``.
        decode = decode_columns(
            req_ids, num_computed, new_block_ids, boundary, num_groups, trusted=True
        )
    else:
        for rid, new_ids, computed in zip(req_ids, new_block_ids, num_computed, strict=True):
            scheduled = num_scheduled[rid]
            crosses = (computed + scheduled) // boundary != computed // boundary
            # The common case first and cheapest: a decode token inside a block.
            if new_ids is None and not crosses and rid not in resumed and rid not in spec:
                continue
            ids = new_ids if _has_blocks(new_ids) else no_blocks
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


__all__ = [
    "GroupSelect",
    "RequestViews",
    "VLLMRequestView",
    "group_block_ids",
    "request_extra_keys",
    "steady_decode",
    "translate_scheduler_output",
]
