"""Request translation: vLLM's requests and scheduler outputs as kvflow's engine-neutral types.

``VLLMRequestView`` shows a vLLM ``Request`` to kvflow's manager without copying its tokens and with
vLLM's own block hashes; ``translate_scheduler_output`` turns one step's ``SchedulerOutput`` into
kvflow's, passing on only the requests with news for the CPU tier; ``HeldBlockIds`` keeps the new
block ids the eager policy does not need yet. Block ids arrive per vLLM KV cache group; a
``GroupSelect`` keeps the groups kvflow offloads (vLLM's prefix-cacheable ones) in kvflow's order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress
from typing import TYPE_CHECKING, ClassVar

from kvflow.core.protocol import GroupBlockIds
from kvflow.core.requests import (
    NO_DECODE_REQUESTS,
    CachedRequest,
    DecodeRequests,
    NewRequest,
    SchedulerOutput,
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

    __slots__ = (
        "_ids",
        "_no_blocks",
        "_phase_ids",
        "_phase_shift",
        "_phase_step",
        "_phase_sum",
        "_phases",
    )

    def __init__(self, num_groups: int) -> None:
        self._ids: dict[str, GroupBlockIds] = {}
        self._no_blocks: GroupBlockIds = ((),) * num_groups
        # The last steady step (``decode_step`` with ``step``): its request ids, its step, the sum
        # of its counts, and once the same requests ran two steps in a row, their indices by
        # count modulo the boundary as of the step ``_phase_shift`` steps ago.
        self._phase_ids: list[str] | None = None
        self._phase_step = -1
        self._phase_sum = 0
        self._phase_shift = 0
        self._phases: list[list[int]] | None = None

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
        step: int | None = None,
    ) -> DecodeRequests:
        """One steady-decode step of vLLM's running requests (one token each): hold the step's
        new ids, and return the requests whose token completes a multiple of ``boundary``, each
        with every id held for it, as ``DecodeRequests`` columns.

        ``step`` (the engine step, consecutive over calls) lets a run of such steps over the same
        requests find the requests due without a pass over the batch: see ``_due``."""
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
        due = None if step is None else self._due(req_ids, num_computed, boundary, step)
        if step is None:
            self._phase_ids = None
        rids: list[str] = []
        counts: list[int] = []
        news: list[GroupBlockIds] = []
        pop = held.pop
        none = self._no_blocks
        if due is not None:
            for i in due:
                rid = req_ids[i]
                rids.append(rid)
                counts.append(num_computed[i])
                news.append(pop(rid, none))
        else:
            # One pass builds the three columns: a comprehension per column is a code object
            # per column, and each costs more cold (as every step starts) than the iterations.
            last = boundary - 1
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

    def _due(
        self, req_ids: Sequence[str], num_computed: Sequence[int], boundary: int, step: int
    ) -> list[int] | None:
        """Indices of the requests due at this steady step, without a pass in Python over the
        batch once the same requests ran steady steps in a row; None: make that pass.

        Why it is exact: the previous step was steady (one token for each request), so no count
        grew by more than one since; counts that sum to exactly one more each therefore all grew
        by exactly one (a count that went back, as vLLM's recomputation after a failed load does,
        fails the sum). So every request keeps its count modulo ``boundary`` of ``_phase_shift``
        steps ago, shifted by that many, and the requests due now (count ``boundary - 1`` modulo
        ``boundary``) are one residue class of that step's counts. Requests that finish, are
        preempted or join change the list of ids, and any other step breaks the run of steps.
        """
        total = sum(num_computed)  # in C; the list comparison below is too
        phase_ids = self._phase_ids
        steady = (
            phase_ids is not None
            and step == self._phase_step + 1
            and total == self._phase_sum + len(num_computed)
            and req_ids == phase_ids
        )
        self._phase_step, self._phase_sum = step, total
        if not steady:
            self._phase_ids, self._phases = list(req_ids), None
            return None
        phases = self._phases
        if phases is None:
            # The second steady step in a row over these requests: index them by count.
            phases = self._phases = [[] for _ in range(boundary)]
            for i, computed in enumerate(num_computed):
                phases[computed % boundary].append(i)
            self._phase_shift = 0
        else:
            self._phase_shift += 1
        return phases[(boundary - 1 - self._phase_shift) % boundary]

    def drop(self, request_id: str) -> None:
        """Forget the request's held ids: it finished, or its whole table is about to be replaced."""
        self._ids.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


_NO_IDS: frozenset[str] = frozenset()


def decode_columns(
    req_ids: Sequence[str],
    new_block_ids: Sequence[Sequence[Sequence[int]] | None],
    num_computed: Sequence[int],
    boundary: int,
    no_blocks: GroupBlockIds,
) -> DecodeRequests:
    """One steady-decode step (one token per request) as ``DecodeRequests`` columns of the
    requests with news: new blocks (all passed at once: the lazy policy tracks every
    allocation), or a token completing a multiple of ``boundary``. No object per request."""
    last = boundary - 1
    rids: list[str] = []
    counts: list[int] = []
    news: list[GroupBlockIds] = []
    for i, computed in enumerate(num_computed):
        ids = new_block_ids[i]
        if ids is not None and any(ids):
            news.append((tuple(ids[0]),) if len(ids) == 1 else group_block_ids(ids))
        elif computed % boundary == last:
            news.append(no_blocks)
        else:
            continue
        rids.append(req_ids[i])
        counts.append(computed)
    if not rids:
        return NO_DECODE_REQUESTS
    # vLLM's str ids and int counts, tuples of tuples of ints: valid columns by construction.
    return DecodeRequests.trusted(rids, counts, news)


def translate_scheduler_output(
    scheduler_output: VLLMSchedulerOutput,
    step: int,
    num_groups: int,
    boundary: int = 1,
    held: HeldBlockIds | None = None,
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
    per step proportional to the blocks that complete rather than to the requests that run.

    With ``held`` (eager policy), new block ids alone are not news: they wait in ``held`` and
    travel with the request's next passed-on step, so only block completions reach the manager.
    ``select`` keeps the block ids of the groups kvflow offloads (``num_groups`` of them).
    ``running=False`` (the lazy policy over a keyed GPU view, which needs no running request's
    steps) passes on only resumed requests, whose whole new table the manager must see.
    """
    new_reqs = scheduler_output.scheduled_new_reqs
    cached_data = scheduler_output.scheduled_cached_reqs
    if (
        not new_reqs
        and not cached_data.resumed_req_ids
        and not scheduler_output.finished_req_ids
        and not scheduler_output.preempted_req_ids
    ):
        # Nearly every step over vLLM: only running requests, none resumed, finished or
        # preempted. After vLLM's own scheduling this code is out of the CPU caches, so the
        # common cases return here without the general path's preamble.
        if not running:
            return SchedulerOutput(step)  # lazy over a keyed view: no news
        if (
            select is None
            and not scheduler_output.scheduled_spec_decode_tokens
            and scheduler_output.num_scheduled_tokens
            and scheduler_output.total_num_scheduled_tokens
            == len(scheduler_output.num_scheduled_tokens)
        ):
            # Steady decode (one token per request: the counts are positive ints summing to
            # the total, so they all are 1 when the total equals their number).
            ids, computed = cached_data.new_block_ids, cached_data.num_computed_tokens
            return SchedulerOutput(
                step,
                decode_requests=decode_columns(
                    cached_data.req_ids, ids, computed, boundary, ((),) * num_groups
                )
                if held is None
                else held.decode_step(cached_data.req_ids, ids, computed, boundary, step),
            )
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
        if held is not None and len(held):
            for r in new_reqs:
                held.drop(r.req_id)
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
        if held is None:
            decode = decode_columns(req_ids, new_block_ids, num_computed, boundary, no_blocks)
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


__all__ = [
    "GroupSelect",
    "HeldBlockIds",
    "RequestViews",
    "VLLMRequestView",
    "decode_columns",
    "group_block_ids",
    "request_extra_keys",
    "translate_scheduler_output",
]
