"""The engine's scheduler: continuous batching, chunked prefill, prefix hits, preemption, connector.

Each ``schedule()`` spends a token budget: running requests first (a decode token, or the next
prefill chunk), preempting the most recently admitted running request by recompute when blocks run
out; then waiting requests in order, each matched against the GPU prefix cache and then asked of
the scheduler-side connector for external tokens. It returns kvflow's ``SchedulerOutput`` plus the
``StepBatch`` the model runner executes. ``update_from_output`` takes the sampled tokens and the
connector's worker output back. The connector is called where vLLM's v1 scheduler calls it; see
``kvflow.engine`` for the list.

A request's life is one transition table (``kvflow.engine.request.TRANSITIONS``), applied by
``transition``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from attrs import frozen

from kvflow.connector.api import KVConnectorOutput, SchedulerConnector
from kvflow.core.logs import get_logger
from kvflow.core.protocol import GroupBlockIds
from kvflow.core.requests import CachedRequest, NewRequest, SchedulerOutput
from kvflow.engine.block_manager import BlockManager
from kvflow.engine.request import Request, RequestInput, RequestStatus, transition
from kvflow.errors import ConfigError

log = get_logger("kvflow.engine.scheduler")
RS = RequestStatus
RI = RequestInput


PENDING_TOKEN = -1
"""A chunk's token that a launched step samples (scheduled ahead): the runner takes it from
that step's output on the device."""

RETRY_BLOCKED_STEPS = 8
"""A waiting head that found no GPU blocks is asked again after this many steps at the latest."""


@frozen
class ScheduledChunk:
    """One request's share of a step, as the model runner needs it."""

    request_id: str
    token_ids: tuple[int, ...]  # the tokens at positions [num_computed, num_computed + n)
    num_computed_tokens: int
    block_ids: GroupBlockIds  # whole tables
    sample: bool  # the chunk reaches the last known token: sample the next one
    first_token: bool = False  # that sample is the request's first output token


@frozen
class StepBatch:
    """The model runner's view of one step."""

    chunks: tuple[ScheduledChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@frozen
class StepOutput:
    """Tokens a step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool


@frozen
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True

    def __attrs_post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be positive")


class Scheduler:
    """Decides each step's work; owns the requests and the GPU block tables."""

    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        connector: SchedulerConnector,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.connector = connector
        self.clock = clock
        self.loads_issued: list[Request] = []
        # (head, blocks.changes, step) of the last admission that found no blocks
        self._blocked_at: tuple[str, int, int] | None = None
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_recving: set[str] = set()
        self._finished_since_last_step: set[str] = set()
        self._preempted_since_last_step: set[str] = set()  # by failed loads, after a step
        self._delayed_free: set[str] = set()  # finished, blocks held until finished_sending
        self._step = 0
        self.num_preemptions = 0

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ConfigError(f"request id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise ConfigError(f"request {request.request_id}: empty prompt")
        if request.max_tokens <= 0:
            raise ConfigError(f"request {request.request_id}: max_tokens must be positive")
        # Every group draws on the one shared pool; a sliding-window group may hold as many
        # blocks as a full one while a long chunk is computed, so count it in full.
        per_group = -(-(request.num_prompt_tokens + request.max_tokens) // self.blocks.block_size)
        need = per_group * len(self.blocks.config.groups)
        if need > self.blocks.num_usable_blocks:
            raise ConfigError(
                f"request {request.request_id}: needs {need} GPU blocks, the cache has "
                f"{self.blocks.num_usable_blocks}"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` from any state; False if it already finished (or is unknown).
        The connector's ``request_finished`` decides, as for a finished request, whether its
        blocks are held (a hand-off draining) until ``finished_sending`` names it."""
        req = self.requests.get(request_id)
        if req is None or req.status in (RS.FINISHED, RS.FREED):
            return False
        if req.status is RS.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        transition(req, RI.ABORT, cause="aborted")
        req.drop_inflight()
        req.stats.finish_time = self.clock()
        self._finished_recving.discard(request_id)
        self._finished_since_last_step.add(request_id)
        self._release(req)
        return True

    def has_unfinished(self) -> bool:
        """Requests left, or finished ids the workers have not been told yet (vLLM's
        ``has_requests``: one more step reports them to ``get_finished``)."""
        return bool(self.requests or self._finished_since_last_step)

    def loads_unsettled(self, batch: StepBatch, kv_output: KVConnectorOutput) -> bool:
        """Whether a load may still change what ``batch``'s requests computed: ``batch`` loaded
        KV into a request's blocks, its connector output ``kv_output`` names finished loads or
        invalid blocks, or an async load is in flight or finished unseen. The next step is then
        scheduled only after ``batch``'s output is applied (a failed load rolls requests back
        there), not ahead of it."""
        if kv_output.finished_recving or kv_output.invalid_block_ids:
            return True
        if self._finished_recving or self._preempted_since_last_step:
            return True
        requests = self.requests
        for c in batch.chunks:
            req = requests.get(c.request_id)
            if req is not None and req.pending_external_tokens:
                return True
        return self.num_waiting_for_remote > 0

    @property
    def num_waiting_for_remote(self) -> int:
        return sum(r.status is RS.WAITING_FOR_REMOTE_KVS for r in self.waiting)

    # ---- scheduling -------------------------------------------------------------------------

    def schedule(self) -> tuple[SchedulerOutput, StepBatch]:
        self.loads_issued = []  # the async loads this step's connector metadata starts
        # Loads reported finished first (vLLM does it as it meets them in the waiting queue;
        # doing all at once lets the deadlock check below see only loads still in flight).
        if self._finished_recving:
            for req in self.waiting:
                if (
                    req.status is RS.WAITING_FOR_REMOTE_KVS
                    and req.request_id in self._finished_recving
                ):
                    self._finish_remote_load(req)
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        new_reqs: list[NewRequest] = []
        cached_reqs: list[CachedRequest] = []
        preempted, self._preempted_since_last_step = self._preempted_since_last_step, set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.finishing:  # scheduled ahead: a launched step samples its last token
                i += 1
                continue
            c = req.num_scheduled_tokens
            n = min(req.num_tokens - c, budget)
            applied = req.num_computed_tokens
            added = self.blocks.allocate(req.request_id, c, n, applied=applied)
            while added is None:
                # Blocks held by loaded requests that are not running go first: otherwise a
                # running request could preempt itself forever while they wait behind it.
                released = self._release_one_loaded(exclude=None, cause="running_needs_blocks")
                if released is not None:
                    preempted.add(released)
                    added = self.blocks.allocate(req.request_id, c, n, applied=applied)
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
                added = self.blocks.allocate(req.request_id, c, n, applied=applied)
            if added is None:
                break
            chunks.append(self._chunk(req, n))
            cached_reqs.append(
                CachedRequest(
                    request_id=req.request_id,
                    new_block_ids=added,
                    num_computed_tokens=c,
                    num_scheduled_tokens=n,
                )
            )
            budget -= n
            i += 1

        skipped: list[Request] = []
        blocked: Request | None = None
        # As in vLLM: a step that had to preempt admits nobody (memory is short).
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting.popleft()
            if req.status is RS.WAITING_FOR_REMOTE_KVS:  # its load is still in flight
                skipped.append(req)
                continue
            if (
                self._blocked_at is not None
                and self._blocked_at[:2] == (req.request_id, self.blocks.changes)
                and self._step - self._blocked_at[2] < RETRY_BLOCKED_STEPS
                and (
                    self.running
                    or self._delayed_free
                    or any(r.status is RS.WAITING_FOR_REMOTE_KVS for r in skipped)
                )
            ):
                # Nothing came free or was cached since it last failed, and something will
                # change the blocks (running requests finish, held blocks are freed, a load
                # ahead of it ends and is cached or, failed, freed): it would fail again, and
                # asking costs a prefix-hit walk and a connector match, each step of a wait for
                # loads too. The connector's answer can change too (a CPU-tier reset shrinks
                # an async load's blocks), so it is asked again every few steps, and every step
                # when nothing will change them (the deadlock breaker below needs that).
                self.waiting.appendleft(req)
                blocked = req
                break
            result = self._admit(req, budget)
            if result is None:  # no blocks: keep the order, try again next step
                self.waiting.appendleft(req)
                blocked = req
                if self.config.enable_chunked_prefill:  # else the step's budget may be why
                    self._blocked_at = (req.request_id, self.blocks.changes, self._step)
                break
            if isinstance(result, str):  # not now: waits for its load, or for the connector
                skipped.append(req)
                continue
            chunk, record = result
            chunks.append(chunk)
            if isinstance(record, NewRequest):
                new_reqs.append(record)
            else:
                cached_reqs.append(record)
            budget -= len(chunk.token_ids)
        self.waiting.extendleft(reversed(skipped))
        if blocked is not None and not chunks:
            preempted |= self._break_deadlock(blocked)

        self._step += 1
        out = SchedulerOutput(
            step=self._step,
            new_requests=tuple(new_reqs),
            cached_requests=tuple(cached_reqs),
            finished_request_ids=frozenset(self._finished_since_last_step),
            preempted_request_ids=frozenset(preempted),
        )
        self._finished_since_last_step = set()
        return out, StepBatch(tuple(chunks))

    def _admit(
        self, req: Request, budget: int
    ) -> tuple[ScheduledChunk, NewRequest | CachedRequest] | str | None:
        """Try to start (or restart) a waiting request; None: out of blocks; "skip": not now."""
        resumed = req.status is RS.PREEMPTED
        if req.request_id in self.blocks.tables:
            # Its async load finished: blocks and computed tokens are already in place.
            hit: list[list[int]] | None = None
            num_local = 0
            ext, load_async = 0, False
        else:
            hit = self.blocks.find_prefix_hit(req.block_hashes, req.num_tokens)
            num_local = max((len(t) for t in hit), default=0) * self.blocks.block_size
            asked = self.clock()
            ext_or_none, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
            req.stats.match_s = self.clock() - asked
            if ext_or_none is None:
                return "skip"
            ext = ext_or_none
            if num_local + ext >= req.num_tokens:
                # At least one token must be computed to get logits (vLLM asks connectors for
                # this). Cut back to a block boundary, as the GPU prefix hit is: block-granular
                # connectors cannot load part of a block.
                bs = self.blocks.block_size
                ext = max(0, (req.num_tokens - 1) // bs * bs - num_local)
            load_async = load_async and ext > 0
            req.num_computed_tokens = num_local
        start = req.num_computed_tokens + ext
        n = 0 if load_async else req.num_tokens - start
        if not load_async and not self.config.enable_chunked_prefill and n > budget:
            self._undo_admission(req, hit)
            return None
        n = min(n, budget)
        if hit is None:
            added = self.blocks.allocate(req.request_id, start, n)
        else:
            added = self.blocks.allocate(req.request_id, start, n, prefix_hit=hit)
        if added is None:
            self._undo_admission(req, hit)
            return None
        if hit is not None:
            req.stats.gpu_cached_tokens += num_local
        if req.stats.admitted_time is None:
            req.stats.admitted_time = self.clock()
        self.connector.update_state_after_alloc(req, self.blocks.block_ids(req.request_id), ext)
        if load_async:
            req.load_target_tokens = start
            req.pending_external_tokens = ext
            transition(req, RI.WAIT_REMOTE, cause="async_external_hit")
            self.loads_issued.append(req)
            return "skip"
        req.num_computed_tokens = start
        if ext:
            req.pending_external_tokens = ext
        transition(req, RI.SCHEDULE, cause="resumed" if resumed else "admitted")
        self.running.append(req)
        chunk = self._chunk(req, n)
        record: NewRequest | CachedRequest
        if resumed:
            record = CachedRequest(
                request_id=req.request_id,
                new_block_ids=self.blocks.block_ids(req.request_id),
                num_computed_tokens=start,
                num_scheduled_tokens=n,
                resumed_from_preemption=True,
            )
        else:
            # First time in a batch, also after an async load (its blocks came with the load,
            # as in vLLM, where such a request is scheduled as a new one).
            record = NewRequest(
                request_id=req.request_id,
                block_ids=self.blocks.block_ids(req.request_id),
                num_computed_tokens=start,
                num_scheduled_tokens=n,
            )
        return chunk, record

    def _undo_admission(self, req: Request, hit: list[list[int]] | None) -> None:
        if hit is not None:
            req.num_computed_tokens = 0

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        """Request ``req``'s next ``n`` tokens, counted as in flight until their step's output
        is applied."""
        c = req.num_scheduled_tokens
        token_ids = tuple(req.all_token_ids[c : c + n])
        if len(token_ids) < n:
            # Scheduled ahead: its last token is the one the launched step samples.
            token_ids += (PENDING_TOKEN,)
        sample = c + n == req.num_tokens
        req.num_inflight_tokens += n
        first = sample and not req.output_token_ids and not req.num_pending_outputs
        if sample:
            req.num_pending_outputs += 1
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=token_ids,
            num_computed_tokens=c,
            block_ids=self.blocks.block_ids(req.request_id),
            sample=sample,
            first_token=first,
        )

    def _preempt(self, req: Request) -> None:
        transition(req, RI.PREEMPT, cause="out_of_blocks")
        self.blocks.free(req.request_id)
        req.drop_inflight()
        req.num_computed_tokens = 0
        req.pending_external_tokens = 0
        req.stats.num_preemptions += 1
        req.stats.restart_first_token_path()
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _restart(self, req: Request) -> None:
        """Give back all of a request's blocks after a failed load; it is matched again later.
        A running one counts as preempted (its id reaches ``handle_preemptions`` next step)."""
        log.info("kv_load_failed_restart", request_id=req.request_id, status=req.status.value)
        req.stats.restart_first_token_path()
        req.drop_inflight()
        if req.status is RS.RUNNING:
            transition(req, RI.PREEMPT, cause="kv_load_failed")
            self.running.remove(req)
            self.waiting.appendleft(req)
            self._preempted_since_last_step.add(req.request_id)
        else:
            transition(req, RI.RELEASE_BLOCKS, cause="kv_load_failed")
        self.blocks.free(req.request_id)

    def _break_deadlock(self, head: Request) -> set[str]:
        """Nothing runs and ``head`` cannot get blocks. If nothing else will free any (no load in
        flight, no delayed free), the blocks are held by requests whose async loads finished but
        which could not be admitted: they give them back (and are matched again later), so the
        head, which fits alone, can run. vLLM has no such step; tiny caches need it."""
        if self.running or self._delayed_free:
            return set()
        if any(r.status is RS.WAITING_FOR_REMOTE_KVS for r in self.waiting):
            return set()
        released: set[str] = set()
        while (rid := self._release_one_loaded(exclude=head, cause="nothing_running")) is not None:
            released.add(rid)
        return released

    def _release_one_loaded(self, *, exclude: Request | None, cause: str) -> str | None:
        """The last waiting request whose async load finished but which was not admitted gives
        its blocks back (it is matched again later); its id, or None if there is none."""
        for req in reversed(self.waiting):
            if req is exclude or req.status is not RS.WAITING:
                continue
            if req.request_id not in self.blocks.tables:
                continue
            transition(req, RI.RELEASE_BLOCKS, cause=cause)
            self.blocks.free(req.request_id)
            req.num_computed_tokens = 0
            return req.request_id
        return None

    def _finish_remote_load(self, req: Request) -> None:
        """vLLM's ``_update_waiting_for_remote_kv``: the loaded blocks count as computed."""
        self._finished_recving.discard(req.request_id)
        req.stats.date_load(seen=self.clock())
        if req.reset_after_load:
            # The load is over, so its blocks can go; the request starts again from scratch.
            req.reset_after_load = False
            log.info("kv_load_failed_restart", request_id=req.request_id, status=req.status.value)
            req.stats.restart_first_token_path()
            self.blocks.free(req.request_id)
            req.load_target_tokens = req.pending_external_tokens = req.num_computed_tokens = 0
        else:
            req.num_computed_tokens = req.load_target_tokens
            req.stats.external_loaded_tokens += req.pending_external_tokens
            req.pending_external_tokens = 0
            self.blocks.cache_computed(req.request_id, req.block_hashes, req.num_computed_tokens)
        transition(req, RI.REMOTE_DONE, cause="finished_recving")

    # ---- results ----------------------------------------------------------------------------

    def update_connector_output(self, kv_output: KVConnectorOutput) -> KVConnectorOutput:
        """Hand the workers' connector output of a step to the scheduler-side connector; the
        output to act on in ``update_from_output``. Only the connector's state changes, so the
        engine calls this while the step still runs on the device."""
        # A connector that decides when transfers are done (kvflow's: once every rank
        # reported) hands back the output to act on; others return None (vLLM's contract).
        decided = self.connector.update_connector_output(kv_output)
        return kv_output if decided is None else decided

    def update_from_output(
        self,
        out: SchedulerOutput,
        batch: StepBatch,
        sampled: Mapping[str, int],
        kv_output: KVConnectorOutput,
    ) -> list[StepOutput]:
        """Apply a step's tokens and the connector output ``update_connector_output`` returned."""
        rolled_back = self._handle_invalid_blocks(kv_output.invalid_block_ids)
        now = self.clock()
        results: list[StepOutput] = []
        for chunk in batch.chunks:
            req = self.requests.get(chunk.request_id)
            # Preempted, restarted or aborted since the step was scheduled: its output is
            # dropped (and its in-flight counts went with it).
            if req is None or req.status is not RS.RUNNING:
                continue
            n = len(chunk.token_ids)
            req.num_inflight_tokens -= n
            if chunk.sample:
                req.num_pending_outputs -= 1
            if req.request_id in rolled_back:
                continue
            c = chunk.num_computed_tokens
            if n == 1 and c >= req.num_prompt_tokens:
                req.stats.decode_tokens_computed += 1
            else:
                req.stats.prefill_tokens_computed += n
            req.num_computed_tokens = c + n
            req.stats.external_loaded_tokens += req.pending_external_tokens
            req.pending_external_tokens = 0
            if self.blocks.caches_more(req.request_id, req.num_computed_tokens):
                self.blocks.cache_computed(
                    req.request_id, req.block_hashes, req.num_computed_tokens
                )
            if not chunk.sample:
                continue
            token = sampled[req.request_id]
            req.append_token(token)
            if req.stats.first_token_time is None:
                req.stats.first_token_time = now
            finished = req.is_finished
            if finished:
                self._finish(req, now)
            results.append(StepOutput(req.request_id, (token,), finished))

        self._finished_recving |= kv_output.finished_recving
        for rid, landed in kv_output.loads_landed.items():
            loading = self.requests.get(rid)
            if loading is not None:
                loading.stats.date_load(landed=landed)
        for rid in kv_output.finished_sending:
            if rid in self._delayed_free:
                self._delayed_free.discard(rid)
                self._free(self.requests[rid], cause="finished_sending")
        return results

    def _handle_invalid_blocks(self, invalid: frozenset[int]) -> set[str]:
        """Roll requests back to the valid prefix before the first block whose load failed."""
        if not invalid:
            return set()
        bad = set(invalid)
        rolled: set[str] = set()
        self.blocks.uncache(bad)
        for req in [*self.running, *self.waiting]:
            pos = self.blocks.first_invalid_position(req.request_id, bad)
            if pos is None:
                continue
            if req.status is RS.WAITING_FOR_REMOTE_KVS:
                if pos < req.load_target_tokens:
                    if not self.blocks.can_resume_at(req.request_id, pos):
                        pos = 0
                        req.reset_after_load = True
                    lost = req.load_target_tokens - pos
                    req.pending_external_tokens = max(0, req.pending_external_tokens - lost)
                    req.load_target_tokens = pos
                    req.stats.recomputed_tokens += lost
                    self.blocks.rollback(req.request_id, pos)
                    log.info(
                        "kv_load_failed_recompute",
                        request_id=req.request_id,
                        valid_tokens=pos,
                        recomputed_tokens=lost,
                    )
                continue
            if pos >= req.num_computed_tokens:
                continue  # the block is being computed, not loaded: nothing to undo
            running = req.status is RS.RUNNING
            if running:
                rolled.add(req.request_id)  # this step ran on invalid KV: drop its result
            restart = not self.blocks.can_resume_at(req.request_id, pos)
            if restart:
                # Sliding-window blocks before the failed one were never loaded (they were
                # outside the window): nothing valid to resume from, so start over.
                pos = 0
            lost = req.num_computed_tokens - pos
            loaded_from = req.num_computed_tokens - req.pending_external_tokens
            req.stats.external_loaded_tokens += max(0, pos - loaded_from)
            req.stats.recomputed_tokens += lost
            req.pending_external_tokens = 0
            req.num_computed_tokens = pos
            if restart:
                self._restart(req)
            else:
                self.blocks.rollback(req.request_id, pos)
            log.info(
                "kv_load_failed_recompute",
                request_id=req.request_id,
                valid_tokens=pos,
                recomputed_tokens=lost,
            )
        return rolled

    def _finish(self, req: Request, now: float) -> None:
        transition(req, RI.FINISH, cause="max_tokens")
        req.stats.finish_time = now
        self.running.remove(req)
        self._finished_since_last_step.add(req.request_id)
        self._release(req)

    def _release(self, req: Request) -> None:
        """Ask the connector whether it still reads the blocks of a finished or aborted request."""
        delay, params = self.connector.request_finished(req, self.blocks.block_ids(req.request_id))
        req.kv_transfer_params = params
        if delay:
            self._delayed_free.add(req.request_id)
        else:
            self._free(req, cause="finished")

    def _free(self, req: Request, *, cause: str) -> None:
        transition(req, RI.FREE, cause=cause)
        self.blocks.free(req.request_id)
        del self.requests[req.request_id]

    def reset_prefix_cache(self) -> bool:
        return self.blocks.reset_prefix_cache()


__all__ = [
    "PENDING_TOKEN",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "StepBatch",
    "StepOutput",
]
