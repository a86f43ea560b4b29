"""Decode steps: an engine step of running requests only, one token each.

Nearly every step of a serving engine schedules its running requests and nothing else: one
token each, none new, resumed, finished, preempted or speculative. ``OffloadManager.decode_step``
takes such a step as the engine has it, every running request in three columns, and
``DecodeSteps`` does its work touching only the requests with news for the CPU tier:
``DecodePhases`` finds the requests whose token completes a block without a pass in Python over
the batch, and a step over one KV cache group under the eager policy (a store each step or
coalesced) is checked whole, then applied and collected, without building the general path's
step objects. Any other step goes through ``build_step_plan`` with the same news, as
``DecodeRequests`` columns, which ``_decode_news`` checks there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import compress

from kvflow.core import validate
from kvflow.core.hashing import BlockHash
from kvflow.core.offload.config import STEP_STORE_ID, Geometry, OffloadManagerConfig
from kvflow.core.offload.eager import EagerStore
from kvflow.core.offload.ledger import TransferLedger
from kvflow.core.offload.state import RequestState, StoreBatch
from kvflow.core.protocol import GroupBlockIds, StepPlan
from kvflow.core.requests import DecodeRequests, SchedulerOutput, decode_columns
from kvflow.errors import ConfigError, KVFlowError, ProtocolError

NewBlockIds = Sequence[Sequence[int]] | None
"""One request's block ids allocated this step, per KV cache group (None: none), as an engine
such as vLLM passes them."""

# A request's news in ``build_step_plan``: (request, confirmed tokens, new block ids, whether
# they replace the block table).
News = tuple[RequestState, int, GroupBlockIds, bool]


def check_new_ids(
    rid: str, g: int, ids: Sequence[int], num_blocks: int | None, null: int | None
) -> None:
    """A running request's new GPU block ids of group ``g``: ints (``validate.check_ids``
    then checks them in range and unique, only the null block repeating)."""
    for b in ids:
        if type(b) is not int:
            raise ConfigError(f"request {rid!r} group {g}: GPU block id {b!r} is not an int")
    validate.check_ids(f"request {rid!r}", g, ids, num_blocks, null)


class DecodePhases:
    """Which requests of a decode step complete a multiple of ``boundary`` tokens with their
    token, without a pass in Python over the batch once the same requests ran such steps in a
    row; and, over such a run, each request's state by its index in the batch.

    Why it is exact: when the previous call was the previous step (one token for each request),
    no count grew by more than one since; counts that sum to exactly one more each therefore all
    grew by exactly one (a count that went back, as an engine's recomputation after a failed load
    does, fails the sum). So every request keeps its count modulo ``boundary`` of ``shift`` steps
    ago, shifted by that many, and the requests due now (count ``boundary - 1`` modulo
    ``boundary``) are one residue class of that step's counts. Requests that finish, are
    preempted or join change the list of ids (one comparison in C), and any other step in between
    breaks the run of steps. Within a run the batch's requests are the same, so a request's state
    found once is kept by index (``states``): a step of the run looks no request id up again.
    """

    __slots__ = ("_boundary", "_ids", "_phases", "_shift", "_step", "_sum", "states")

    def __init__(self, boundary: int) -> None:
        self._boundary = boundary
        self._ids: list[str] | None = None  # the last step's request ids
        self._step = -1
        self._sum = 0
        self._shift = 0
        # Once the same requests ran two steps in a row: their indices by count modulo the
        # boundary as of ``_shift`` steps ago.
        self._phases: list[list[int]] | None = None
        self.states: list[RequestState | None] = []  # by index, over the run; None: not found yet

    @property
    def boundary(self) -> int:
        return self._boundary

    def due(self, step: int, request_ids: Sequence[str], num_computed: Sequence[int]) -> list[int]:
        """Indices of the requests whose token completes a multiple of the boundary, ascending;
        ``step`` is the engine's step (consecutive over the calls of a run). A call that starts
        a run checks that no request id is listed twice (``ProtocolError``)."""
        boundary = self._boundary
        try:
            total = sum(num_computed)  # in C; the list comparison below is too
        except TypeError:
            raise ConfigError("num_computed_tokens must be ints") from None
        ids = self._ids
        steady = (
            ids is not None
            and step == self._step + 1
            and total == self._sum + len(num_computed)
            and request_ids == ids
        )
        if not steady:
            n = len(request_ids)
            if len(set(request_ids)) != n:
                self._ids = None
                seen: set[str] = set()
                twice = next(r for r in request_ids if r in seen or seen.add(r))  # type: ignore[func-returns-value]
                raise ProtocolError(f"request {twice!r} scheduled twice in decode step {step}")
            self._ids, self._phases = list(request_ids), None
            self._step, self._sum = step, total
            self.states = [None] * n
            last = boundary - 1
            return [i for i, c in enumerate(num_computed) if c % boundary == last]
        self._step, self._sum = step, total
        phases = self._phases
        if phases is None:
            # The second steady step in a row over these requests: index them by count.
            phases = self._phases = [[] for _ in range(boundary)]
            for i, computed in enumerate(num_computed):
                phases[computed % boundary].append(i)
            self._shift = 0
        else:
            self._shift += 1
        return phases[(boundary - 1 - self._shift) % boundary]

    def forget(self) -> None:
        """Start the next call with a full pass (the last call's input was refused)."""
        self._ids = self._phases = None
        self.states = []


class DecodeSteps:
    """``OffloadManager``'s decode steps: ``decode_step``, and the checks of decode columns and
    block tables in ``build_step_plan``. The manager sets the attributes declared here
    (``init_decode``)."""

    config: OffloadManagerConfig
    _geo: Geometry
    _requests: dict[str, RequestState]
    _ledger: TransferLedger
    _store: EagerStore
    _null: int | None
    _allocated: dict[str, RequestState]
    _reset_pending: bool
    _no_new: GroupBlockIds
    _num_groups: int
    _phases: DecodePhases
    _fused: bool  # one group, the eager policy: ``decode_step`` fuses the step
    _limit: int  # GPU block ids are below it
    _scheduled: int  # requests the last step scheduled
    _finished_since: int  # requests finished since

    def init_decode(self, *, fused: bool) -> None:
        # A step can complete a block of some group only at a multiple of their gcd.
        self._phases = DecodePhases(math.gcd(*self._geo.block_sizes))
        self._fused = fused
        num_blocks = self.config.num_gpu_blocks
        self._limit = num_blocks if num_blocks is not None else 1 << 62

    def build_step_plan(self, scheduler_output: SchedulerOutput) -> StepPlan:
        raise NotImplementedError  # the manager's

    def _check_table(
        self,
        st: RequestState,
        end: int,
        confirmed: int,
        ids: Sequence[Sequence[int]],
        replace: bool,
    ) -> None:
        """Validate the request's block table after this step's ids."""
        if len(ids) != self._num_groups:
            rid = st.request.request_id
            raise ConfigError(f"{rid}: {len(ids)} block groups, expected {self._num_groups}")
        table = st.table
        for g, bs in self._geo.group_sizes:
            have = len(ids[g]) if replace else len(table[g]) + len(ids[g])
            if have < confirmed // bs:
                raise ConfigError(
                    f"{st.request.request_id} group {g}: {have} GPU blocks cannot hold "
                    f"{end} computed tokens"
                )

    # ---- the steady step ------------------------------------------------------------------

    def decode_step(
        self,
        step: int,
        request_ids: Sequence[str],
        num_computed_tokens: Sequence[int],
        new_block_ids: Sequence[NewBlockIds],
    ) -> StepPlan:
        """``build_step_plan`` of a step that schedules every running request for one token and
        nothing else (no request new, resumed, finished, preempted or speculative), in columns:
        each request's id, its computed tokens before the step and the block ids allocated to it
        this step, per group (None: none). Every running request is listed; only those with
        news are looked at.

        One group under the eager policy, with no match to load and no reset pending, the step
        is checked whole, then applied and collected in one pass each (a ``KVFlowError`` changes
        nothing); otherwise, or where a count went back (tokens to recompute), its news go
        through ``build_step_plan`` as ``DecodeRequests`` columns."""
        num_computed = num_computed_tokens
        n = len(request_ids)
        if len(num_computed) != n or len(new_block_ids) != n:
            raise ConfigError(
                f"decode step {step}: {n} request ids, {len(num_computed)} computed counts, "
                f"{len(new_block_ids)} block id entries"
            )
        if type(step) is not int or step < 0:
            validate.strict_int("step", step)
        phases = self._phases
        if not self._fused or self._allocated or self._reset_pending:
            return self._decode_general(step, request_ids, num_computed, new_block_ids)
        try:
            due = phases.due(step, request_ids, num_computed)
            states = phases.states
            limit = self._limit
            bs = self._geo.block_sizes[0]
            grown: list[tuple[list[int], Sequence[int]]] = []
            for i in compress(range(n), new_block_ids):
                ids = new_block_ids[i]
                assert ids is not None
                st = states[i]
                if st is None:
                    st = states[i] = self._running(request_ids[i])
                if len(ids) != 1:
                    raise ConfigError(f"{request_ids[i]}: {len(ids)} block groups, expected 1")
                new = ids[0]
                if not new:
                    continue
                b = new[0]
                if len(new) != 1 or type(b) is not int or not 0 <= b < limit:
                    check_new_ids(request_ids[i], 0, new, self.config.num_gpu_blocks, self._null)
                end = num_computed[i]
                if type(end) is not int or end < 0:
                    validate.strict_int(f"request {request_ids[i]!r}: num_computed_tokens", end)
                end += 1
                table = st.table[0]
                if end % bs:  # not due: no token cap, its blocks are those of its computed tokens
                    if len(table) + len(new) < end // bs:
                        self._check_table(st, end, end, ids, False)
                    if st.next_boundary <= end:
                        # Due for another reason (a failed store's blocks to store again): the
                        # general path advances every request with news.
                        return self._decode_general(step, request_ids, num_computed, new_block_ids)
                grown.append((table, new))
            entries: list[tuple[RequestState, int]] = []
            for i in due:
                st = states[i]
                if st is None:
                    st = states[i] = self._running(request_ids[i])
                end = num_computed[i]
                if type(end) is not int or end < 0:
                    validate.strict_int(f"request {request_ids[i]!r}: num_computed_tokens", end)
                end += 1
                num_tokens = len(st.request.all_token_ids)  # ``confirmed_tokens``, inlined
                confirmed = end if end < num_tokens else num_tokens
                if confirmed < st.confirmed:
                    # Tokens to recompute (a failed load): the general path's case.
                    return self._decode_general(step, request_ids, num_computed, new_block_ids)
                have = len(st.table[0])
                if have < confirmed // bs:
                    ids = new_block_ids[i]
                    if not ids or have + len(ids[0]) < confirmed // bs:
                        self._check_table(st, end, confirmed, (ids[0] if ids else (),), False)
                entries.append((st, confirmed))
        except KVFlowError:
            phases.forget()
            raise
        # Every entry is checked: from here on nothing raises on bad input.
        self._scheduled, self._finished_since = n, 0
        for table, new in grown:
            table.extend(new)
        store = self._store
        ledger = self._ledger
        if store.interval == 1:
            if entries:
                picked: dict[BlockHash, int] = {}
                owners: list[RequestState | None] = []
                reqs: list[RequestState] = []
                store.advance_one(entries, picked, owners, reqs, pick=True, apply=True)
                if reqs:
                    plan = ledger.launch_store(step, picked, owners, reqs)
                    if plan is not None:
                        return plan
                    ledger.plan_store(StoreBatch([picked], [owners], reqs), STEP_STORE_ID)
        else:
            fresh = not store.deferred
            for st, confirmed in entries:
                if confirmed >= st.next_boundary:
                    store.defer(st, confirmed)
                st.confirmed = confirmed
            deferred = store.due(fresh=fresh, replaced=False)
            if deferred is not None:
                batch = store.collect(deferred)
                if batch.reqs:
                    ledger.plan_store(batch, STEP_STORE_ID)
        if not ledger.pending and not ledger.abandoned:
            return StepPlan(step, (), (), False, ())
        return ledger.launch(step, False)

    def _decode_general(
        self,
        step: int,
        request_ids: Sequence[str],
        num_computed: Sequence[int],
        new_block_ids: Sequence[NewBlockIds],
    ) -> StepPlan:
        columns = decode_columns(
            request_ids, num_computed, new_block_ids, self._phases.boundary, self._geo.num_groups
        )
        return self.build_step_plan(SchedulerOutput(step, decode_requests=columns))

    def _running(self, rid: str) -> RequestState:
        st = self._requests.get(rid)
        if st is None:
            raise ProtocolError(f"unknown running request {rid!r}")
        return st

    # ---- decode columns in the general path ---------------------------------------------

    def _decode_news(
        self, decode: DecodeRequests, dirty: list[News], *, one: bool | None = None
    ) -> None:
        """The decode columns' entries with news, checked, onto ``dirty``: the steady state of
        a big batch, so ``OffloadManager._running_news`` is inlined (the table check is a
        comparison per group; the call only happens to raise its error). With one KV cache
        group (most models) the group loops are unrolled and the common new ids (one block)
        checked inline; the property test ``test_one_group_decode_news_equal_the_general_ones``
        holds the two to the same result."""
        requests = self._requests
        check = self._check_table
        num_groups = self._geo.num_groups
        no_new = self._no_new
        group_sizes = self._geo.group_sizes
        bs = group_sizes[0][1]
        num_blocks, null, limit = self.config.num_gpu_blocks, self._null, self._limit
        if one is None:
            one = num_groups == 1
        for rid, computed, ids in zip(
            decode.request_ids, decode.num_computed_tokens, decode.new_block_ids, strict=True
        ):
            st = requests.get(rid)
            if st is None:
                raise ProtocolError(f"unknown running request {rid!r}")
            end = computed + 1
            if end < st.next_boundary and ids == no_new:
                continue
            num_tokens = len(st.request.all_token_ids)  # ``confirmed_tokens``, inlined
            confirmed = end if end < num_tokens else num_tokens
            if len(ids) != num_groups:
                check(st, end, confirmed, ids, False)
            if one:
                new = ids[0]
                if len(st.table[0]) + len(new) < confirmed // bs:
                    check(st, end, confirmed, ids, False)
                if new and not (len(new) == 1 and 0 <= new[0] < limit):
                    check_new_ids(rid, 0, new, num_blocks, null)
            else:
                have = st.table
                for g, size in group_sizes:
                    if len(have[g]) + len(ids[g]) < confirmed // size:
                        check(st, end, confirmed, ids, False)
                for g, new_ids in enumerate(ids):
                    if new_ids:
                        check_new_ids(rid, g, new_ids, num_blocks, null)
            dirty.append((st, confirmed, ids, False))


__all__ = ["DecodePhases", "DecodeSteps", "NewBlockIds", "News", "check_new_ids"]
