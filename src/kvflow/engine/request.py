"""A request of the reference engine: its state, its life as one transition table
(``TRANSITIONS``, applied by ``transition``) and what it cost (``RequestStats``)."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from attrs import define, field

from kvflow.core.fsm import Machine
from kvflow.core.hashing import BlockHash, BlockHasher, ExtraKey


class RequestStatus(enum.StrEnum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # an async external load is in flight
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks given back; waits to be recomputed
    FINISHED = "finished"  # done generating; blocks may still be held for the connector
    FREED = "freed"  # blocks returned; terminal


class RequestInput(enum.StrEnum):
    SCHEDULE = "schedule"
    WAIT_REMOTE = "wait_remote"  # blocks allocated, an async load started
    REMOTE_DONE = "remote_done"  # the connector reported the load finished
    PREEMPT = "preempt"
    FINISH = "finish"
    RELEASE_BLOCKS = "release_blocks"  # a loaded, not yet running request gives its blocks back
    FREE = "free"
    ABORT = "abort"  # the client gave up on it; blocks are held while a connector drains


RS, RI = RequestStatus, RequestInput

TRANSITIONS: Mapping[tuple[RequestStatus, RequestInput], RequestStatus] = {
    (RS.WAITING, RI.SCHEDULE): RS.RUNNING,
    (RS.WAITING, RI.WAIT_REMOTE): RS.WAITING_FOR_REMOTE_KVS,
    (RS.WAITING_FOR_REMOTE_KVS, RI.REMOTE_DONE): RS.WAITING,
    (RS.RUNNING, RI.PREEMPT): RS.PREEMPTED,
    (RS.RUNNING, RI.FINISH): RS.FINISHED,
    (RS.PREEMPTED, RI.SCHEDULE): RS.RUNNING,
    (RS.PREEMPTED, RI.WAIT_REMOTE): RS.WAITING_FOR_REMOTE_KVS,
    (RS.FINISHED, RI.FREE): RS.FREED,
    (RS.WAITING, RI.RELEASE_BLOCKS): RS.WAITING,
    (RS.WAITING, RI.ABORT): RS.FINISHED,
    (RS.WAITING_FOR_REMOTE_KVS, RI.ABORT): RS.FINISHED,
    (RS.RUNNING, RI.ABORT): RS.FINISHED,
    (RS.PREEMPTED, RI.ABORT): RS.FINISHED,
}
"""A request's whole life. Anything not listed is illegal."""

REQUEST_MACHINE: Machine[RequestStatus, RequestInput] = Machine(
    "request",
    TRANSITIONS,
    id_field="request_id",
    initial=RS.WAITING,
    terminal=(RS.FREED,),
    logger="kvflow.engine.scheduler",
)


@define(eq=False)
class RequestStats:
    """What one request cost and got; filled in by the scheduler as it runs."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_tokens_computed: int = 0
    decode_tokens_computed: int = 0
    gpu_cached_tokens: int = 0  # GPU prefix-cache hits, summed over admissions
    external_loaded_tokens: int = 0  # loaded through the connector (valid ones only)
    recomputed_tokens: int = 0  # rolled back after a failed load
    num_preemptions: int = 0
    # When the first token's path happened, for the per-phase TTFT breakdown (engine clock).
    admitted_time: float | None = None  # first given GPU blocks
    match_s: float = 0.0  # the connector's get_num_new_matched_tokens, at that admission
    load_launched_time: float | None = None  # the step that issued its async load launched
    load_landed_time: float | None = None  # its load's copies ended (where the backend says)
    load_seen_time: float | None = None  # the scheduler took its finished load
    compute_start_time: float | None = None  # first step computing its tokens, once scheduled
    first_token_step_time: float | None = None  # the step sampling its first token, scheduled

    def date_load(
        self,
        *,
        launched: float | None = None,
        landed: float | None = None,
        seen: float | None = None,
    ) -> None:
        """Date a step of the load on its path to the first token, the first time each: a load
        after the first token (a request preempted since, reloaded) is no TTFT's."""
        if self.first_token_time is not None:
            return
        if launched is not None and self.load_launched_time is None:
            self.load_launched_time = launched
        if landed is not None and self.load_landed_time is None:
            self.load_landed_time = landed
        if seen is not None and self.load_seen_time is None:
            self.load_seen_time = seen

    def restart_first_token_path(self) -> None:
        """The request lost its blocks before its first token: its path to that token starts
        again at its next admission (the time spent so far counts as queueing)."""
        if self.first_token_time is None:
            self.admitted_time = None
            self.load_launched_time = self.load_landed_time = self.load_seen_time = None
            self.compute_start_time = self.first_token_step_time = None


@define(eq=False)
class Request:
    """One generation request; implements ``kvflow.core.requests.RequestLike``."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stats: RequestStats
    extra_keys: tuple[ExtraKey, ...] = ()
    block_size: int = 16
    output_token_ids: list[int] = field(factory=list)
    all_token_ids: list[int] = field(factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Async external load in flight: tokens computed once it finishes (shrunk by load errors).
    load_target_tokens: int = 0
    pending_external_tokens: int = 0  # of those, loaded by the connector
    reset_after_load: bool = False  # a failed load left it unable to resume in place
    # Scheduled ahead (``EngineConfig.async_scheduling``): tokens of launched steps whose
    # output is not applied yet, and the tokens those steps sample, not yet read back.
    num_inflight_tokens: int = 0
    num_pending_outputs: int = 0
    kv_transfer_params: dict[str, object] | None = None
    _hasher: BlockHasher | None = None

    def __attrs_post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self._hasher = BlockHasher(self.block_size, self.extra_keys)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens and those a launched step samples (their ids not read back yet)."""
        return len(self.all_token_ids) + self.num_pending_outputs

    @property
    def num_scheduled_tokens(self) -> int:
        """Computed tokens and those of launched steps: where its next chunk starts."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def finishing(self) -> bool:
        """A launched step samples its last token: nothing more to schedule."""
        return len(self.output_token_ids) + self.num_pending_outputs >= self.max_tokens

    def drop_inflight(self) -> None:
        """Forget launched steps' tokens (preempted, restarted or aborted: their output is
        dropped when it arrives)."""
        self.num_inflight_tokens = self.num_pending_outputs = 0

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Chained hashes of every full block of known tokens."""
        hasher = self._hasher
        assert hasher is not None
        if hasher.num_tokens < len(self.all_token_ids):
            hasher.extend(self.all_token_ids[hasher.num_tokens :])
        return hasher.hashes

    def engine_block_hashes(self, block_size: int) -> list[BlockHash] | None:
        """``kvflow.core.requests.EngineHashedRequest``: the engine's own hash list, kept current
        by ``append_token``, so a connector keys its tier by it instead of hashing every block a
        second time. None at any other block size."""
        return self.block_hashes if block_size == self.block_size else None

    def append_token(self, token: int) -> None:
        """Append a sampled token; a block it completes is hashed at once, because a connector
        reads the live hash list before the engine itself asks for it again."""
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)
        if len(self.all_token_ids) % self.block_size == 0:
            self.block_hashes  # noqa: B018 - the property extends the live list

    @property
    def is_finished(self) -> bool:
        return len(self.output_token_ids) >= self.max_tokens


def transition(request: Request, event: RequestInput, *, cause: str) -> RequestStatus:
    """Apply one input to ``request`` by the table and log it; illegal pairs raise and change
    nothing."""
    request.status = REQUEST_MACHINE.apply(request.request_id, request.status, event, cause=cause)
    return request.status


__all__ = [
    "REQUEST_MACHINE",
    "TRANSITIONS",
    "Request",
    "RequestInput",
    "RequestStats",
    "RequestStatus",
    "transition",
]
