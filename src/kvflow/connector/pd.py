"""The PD connector: both connector roles of one engine that is a prefill (P) or a decode (D)
instance, on the core's hand-off managers through the runtime's ``PDDriver``.

P: a request whose ``kv_transfer_params`` say ``do_remote_decode`` finishes with ``delay_free``;
its prompt blocks are held (``kv_ready``) until the hand-off is RELEASED, then named in
``finished_sending``; ``request_finished`` returns the params D needs (``do_remote_prefill``,
the transfer id, P's engine id and control address).

D: a request with ``do_remote_prefill`` params answers ``get_num_new_matched_tokens`` with
``(n, True)``, ``n`` the prompt tokens past D's own prefix hit minus the last one, which D
recomputes (vLLM's semantics: a hit that ends mid-block loads the partial last block). P's
params name P's prompt length (``remote_num_tokens``): when D's prompt is P's plus P's sampled
first token (the router's ``first_token="prefill"``), D loads every token of P's prompt and
computes only that first token's KV on its way to the second;
``update_state_after_alloc`` reserves the blocks and claims P's KV; the request is named in
``finished_recving`` when the hand-off commits, and its claimed blocks in ``invalid_block_ids``
when it failed (a one-shot miss: the request recomputes and never asks P again).

Block identity: both sides digest the chained hashes of the prompt's full blocks plus one hash
of the partial last block (its tokens chained on the last full one), so KV of another request
is refused even when only the last partial block differs.

Block sizes: a hand-off moves wire blocks of ``wire_block_size`` tokens (the engine's block
size unless set), so P and D with different block sizes (16 and 32) exchange KV when both use
the same unit. Each KV tensor is registered as ``rows_per_block`` wire rows per engine block
(a view: ``(N, bs, ...)`` as ``(N * k, bs / k, ...)``), wire row ``b * k + j`` is tokens
``j * wire ...`` of engine block ``b``, and both sides hash the prompt at the wire unit. The
managers, the claim and the grant speak wire rows; the ledger's GPU refs and the engine's
``invalid_block_ids`` are engine blocks (``row // k``).

Inline driving: the scheduler role polls the driver in ``update_connector_output`` each step
and turns its reports into the output the engine acts on; the worker role only registers the
KV tensors and waits (bounded) for copies when the engine is idle. The CPU tier is not composed
here yet (see docs/pd.md).

Tensor parallelism: on a TP engine every rank moves its own kv heads (``connector.pd_tp``);
rank 0's connector forwards each launch to the other ranks as the step's metadata and turns
their step reports into the manager's per-rank ``copy_done``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from attrs import define, field

from kvflow.backends.pd.transport import KVTransport
from kvflow.connector.api import KVCacheConfig, KVConnectorOutput, NullConnector
from kvflow.connector.pd_tp import RankZeroTransport, wire_groups
from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.hashing import ROOT_HASH, BlockHash, ExtraKey, hash_block, hash_blocks
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import FinishedRecving, FinishedSending, FreeBlocks, PDTimeouts, flat
from kvflow.core.pd.consumer import ConsumerManager
from kvflow.core.pd.machines import PState
from kvflow.core.pd.messages import Compat, GroupIds
from kvflow.core.pd.producer import ProducerManager
from kvflow.core.protocol import GroupBlockIds
from kvflow.core.requests import RequestLike, SchedulerOutput
from kvflow.errors import ConfigError, KVFlowError
from kvflow.runtime.clock import Clock
from kvflow.runtime.pd_driver import PDDriver

if TYPE_CHECKING:
    import torch

log = get_logger("kvflow.pd")

ROLES = ("producer", "consumer")


def prompt_hashes(
    request: RequestLike, block_size: int, num_tokens: int | None = None
) -> list[BlockHash]:
    """The prompt's chained full-block hashes, plus one for a partial last block; of its first
    ``num_tokens`` tokens when given (the part whose KV P holds).

    The full blocks' hashes are the engine's own where it hashes with kvflow's function
    (``engine_block_hashes``; the reference engine does): P's ``kv_ready`` and D's claim then
    hash only the partial tail instead of the whole prompt on the engine's step (a 16k-token
    prompt's 1,024 blocks took 2.7 ms of P's first-token step on the H200). The engine's first
    hash is checked against kvflow's of the same block: another function (vLLM's) or other keys
    mean kvflow hashes every block, so both sides of a hand-off always key the same way."""
    end = request.num_prompt_tokens if num_tokens is None else num_tokens
    prompt = list(request.all_token_ids[:end])
    keys = request.extra_keys
    hashes = _engine_hashes(request, block_size, prompt, keys)
    if hashes is None:
        hashes = hash_blocks(prompt, block_size, extra_keys=keys)
    tail = prompt[len(hashes) * block_size :]
    if tail:
        hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, tail, keys))
    return hashes


def _engine_hashes(
    request: RequestLike, block_size: int, prompt: list[int], keys: tuple[ExtraKey, ...]
) -> list[BlockHash] | None:
    """The engine's hashes of ``prompt``'s full blocks if it hashes as kvflow does, else None."""
    full = len(prompt) // block_size
    get = getattr(request, "engine_block_hashes", None)
    if not full or get is None:
        return None
    theirs = get(block_size)
    if theirs is None or len(theirs) < full:
        return None
    if theirs[0] != hash_block(ROOT_HASH, prompt[:block_size], keys):
        return None
    return list(theirs[:full])


def _params(request: RequestLike) -> dict[str, Any]:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


def remote_tokens(request: RequestLike, params: dict[str, Any]) -> int | None:
    """D: the tokens at the head of the request's prompt whose KV it claims from P: P's prompt
    length (``remote_num_tokens``), at most D's own prompt; without the param, D's whole prompt;
    None when the param is not a positive int. D's prompt may run past P's: with the router's
    ``first_token="prefill"`` P's sampled token rides along as D's last prompt token, which D
    then computes instead of P's last one. P's prompt longer than D's cannot be D's: both hash
    D's whole prompt, and P refuses the claim (a hash mismatch, D recomputes)."""
    n = params.get("remote_num_tokens")
    if n is None:
        return request.num_prompt_tokens
    if type(n) is not int or n < 1:
        return None
    return min(n, request.num_prompt_tokens)


@define(eq=False)
class _Stream:
    """P: a prefilling request whose hand-off pushes chunks as they are fenced."""

    transfer_id: str
    epoch: int
    num_prompt_tokens: int
    table: list[list[int]] = field(factory=list)  # its block table, as the steps grew it
    end: int = 0  # tokens computed once the last scheduled step's output is back
    fenced: int = 0  # wire rows handed to kv_chunk


class PDConnector(NullConnector):
    """Both roles for one P or D engine (``role``); ``peer`` is P's default D engine id."""

    def __init__(
        self,
        role: str,
        kv: KVCacheConfig,
        driver: PDDriver,
        *,
        peer: str = "",
        wire_block_size: int | None = None,
    ) -> None:
        if role not in ROLES:
            raise ConfigError(f"PD role {role!r}: one of {', '.join(ROLES)}")
        if any(g.sliding_window is not None for g in kv.groups):
            raise ConfigError("PD hand-offs of sliding-window groups are not supported yet")
        wire = wire_block_size or kv.block_size
        if wire < 1 or kv.block_size % wire:
            raise ConfigError(
                f"wire_block_size {wire} must divide the engine's block size {kv.block_size}"
            )
        self.role = role
        self.kv = kv
        self.driver = driver
        self.peer = peer
        self.wire = wire
        self.rows_per_block = kv.block_size // wire
        driver.manager.ledger.rows_per_block = self.rows_per_block
        self._by_transfer: dict[str, str] = {}  # transfer id → request id
        self._by_request: dict[str, str] = {}  # request id → transfer id
        self._waiting: set[str] = set()  # D: requests parked on a hand-off
        self._done: set[str] = set()  # D: requests whose remote hit was used (one shot)
        self._refused: dict[str, GroupIds] = {}  # D: reservations refused, reported next step
        self._streams: dict[str, _Stream] = {}  # P: requests whose hand-off streams chunks
        self.stats = {"handoffs_ok": 0, "handoffs_failed": 0, "remote_tokens": 0}

    # ---- scheduler role -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = _params(request)
        rid = request.request_id
        if self.role != "consumer" or not params.get("do_remote_prefill") or rid in self._done:
            return 0, False
        if rid in self._by_request:  # reserved already (a second admission): nothing new
            return 0, False
        remote = remote_tokens(request, params)
        n = min(remote or 0, request.num_prompt_tokens - 1) - num_computed_tokens
        if remote is not None and n <= 0:
            return 0, False  # update_state_after_alloc still releases P
        try:
            self.driver.connect(str(params["remote_address"]))
        except (KVFlowError, KeyError) as e:
            log.warning("pd_peer_unreachable", request_id=rid, error=str(e))
            self._done.add(rid)
            return 0, False
        if remote is None:
            # Computed here; connected, so update_state_after_alloc's release reaches P now.
            log.error(
                "pd_remote_tokens_invalid",
                request_id=rid,
                remote_num_tokens=repr(params.get("remote_num_tokens")),
                prompt_tokens=request.num_prompt_tokens,
            )
            return 0, False
        return n, True

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        params = _params(request)
        rid = request.request_id
        if self.role == "producer":
            self._begin(request, params)
            return
        if not params.get("do_remote_prefill") or rid in self._done:
            return
        mgr = self.driver.manager
        assert isinstance(mgr, ConsumerManager)
        tid, epoch = str(params["transfer_id"]), int(params.get("epoch", 1))
        peer = str(params["remote_engine_id"])
        self._done.add(rid)
        wire = self.wire
        remote = remote_tokens(request, params)
        if remote is None:
            remote, num_external_tokens = request.num_prompt_tokens, 0  # a miss (logged)
        end_tok = min(remote, request.num_prompt_tokens - 1)
        first = (end_tok - num_external_tokens) // wire
        end = -(-end_tok // wire) if num_external_tokens else first
        ids = self.rows(block_ids, first, end)
        hashes = prompt_hashes(request, wire, remote)
        now = self.driver.now()
        try:
            actions = mgr.reserve(
                tid, epoch, peer, ids, (first,) * len(ids), num_external_tokens, hashes, now
            )
        except KVFlowError as e:
            # The router's params are unusable (a transfer id already live here, ...): the
            # request parked on this load must still hear of it, as a miss.
            log.error("pd_reserve_refused", request_id=rid, transfer_id=tid, error=str(e))
            if num_external_tokens:
                self._refused[rid] = ids
            return
        self._by_transfer[tid], self._by_request[rid] = rid, tid
        if num_external_tokens:
            self._waiting.add(rid)
        self.driver.apply(actions)

    def rows(self, block_ids: GroupBlockIds, first: int, end: int) -> GroupIds:
        """Wire rows ``first .. end - 1`` of the request's blocks, per group."""
        k = self.rows_per_block
        if k == 1:  # a wire row is an engine block (most engines): the table's slice, in C
            out = tuple(tuple(g[first:end]) for g in block_ids)
            if any(len(g) != end - first for g in out):
                raise IndexError(f"rows {first}..{end - 1} past a group's block table")
            return out
        return tuple(tuple(g[r // k] * k + r % k for r in range(first, end)) for g in block_ids)

    def _blocks(self, ids: GroupIds) -> Iterator[int]:
        """The engine blocks of wire rows ``ids``."""
        k = self.rows_per_block
        return (b // k for _, b in flat(ids))

    def begin(self, request_id: str, params: dict[str, Any]) -> None:
        """P: a request D will decode arrived; its hand-off exists from now on, so a CLAIM that
        D sends while P prefills (the concurrent flow) waits for ``kv_ready``. Idempotent."""
        if self.role != "producer" or not params.get("do_remote_decode"):
            return
        mgr = self.driver.manager
        assert isinstance(mgr, ProducerManager)
        tid, epoch = str(params["transfer_id"]), int(params.get("epoch", 1))
        if tid in mgr.transfers:
            return
        peer = str(params.get("remote_engine_id") or self.peer)
        self._by_transfer[tid], self._by_request[request_id] = request_id, tid
        self.driver.apply(mgr.begin(tid, epoch, peer, self.driver.now()))

    def _begin(self, request: RequestLike, params: dict[str, Any]) -> None:
        """P admitted a request D will decode (``begin`` unless the router already said so)."""
        if not params.get("do_remote_decode"):
            return
        mgr = self.driver.manager
        assert isinstance(mgr, ProducerManager)
        tid, epoch = str(params["transfer_id"]), int(params.get("epoch", 1))
        rid = request.request_id
        now = self.driver.now()
        t = mgr.transfers.get(tid)
        if t is None:
            if tid in self._by_transfer:  # begun before, ended already (admitted again)
                return
            peer = str(params.get("remote_engine_id") or self.peer)
            self._by_transfer[tid], self._by_request[rid] = rid, tid
            self.driver.apply(mgr.begin(tid, epoch, peer, now))
            t = mgr.transfers.get(tid)
        if t is not None and t.state is PState.PREFILLING and not t.digest:
            # The prompt is known: a claim is granted now and chunks stream as they are fenced.
            self.driver.apply(mgr.set_prompt(tid, prompt_hashes(request, self.wire), now))
            self._streams[rid] = _Stream(tid, epoch, request.num_prompt_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """P: note how far each streamed request's prefill gets this step (its KV is fenced
        once the step's output comes back, in ``update_connector_output``). On a TP engine:
        the other ranks' launches and cancels since the last step (``RankOps``)."""
        if self._streams:
            self._note_streams(scheduler_output)
        transport = self.driver.transport
        return transport.take() if isinstance(transport, RankZeroTransport) else None

    def _note_streams(self, scheduler_output: SchedulerOutput) -> None:
        mgr = self.driver.manager
        assert isinstance(mgr, ProducerManager)
        for rid in scheduler_output.preempted_request_ids:
            st = self._streams.pop(rid, None)
            if st is not None and st.transfer_id in mgr.transfers:
                # Its blocks went back to the engine: the hand-off fails (D recomputes), and
                # the engine hears of it only through the request's own finish.
                now = self.driver.now()
                self.driver.apply(mgr.abort(st.transfer_id, now, engine_waits=False))
        for new in scheduler_output.new_requests:
            if (st := self._streams.get(new.request_id)) is not None:
                st.table = [list(g) for g in new.block_ids]
                st.end = new.num_computed_tokens + new.num_scheduled_tokens
        for c in scheduler_output.cached_requests:
            if (st := self._streams.get(c.request_id)) is not None:
                if c.resumed_from_preemption:
                    st.table = [[] for _ in c.new_block_ids]
                for g, ids in enumerate(c.new_block_ids):
                    st.table[g].extend(ids)
                st.end = c.num_computed_tokens + c.num_scheduled_tokens

    def _fence_chunks(self) -> None:
        """P: push the chunks whose KV the step just computed (streamed hand-offs)."""
        mgr = self.driver.manager
        assert isinstance(mgr, ProducerManager)
        now = self.driver.now()
        wire = self.wire
        for rid, st in list(self._streams.items()):
            if st.transfer_id not in mgr.transfers:
                del self._streams[rid]
                continue
            end = min(st.end, st.num_prompt_tokens)
            fenced = -(-end // wire) if end == st.num_prompt_tokens else end // wire
            rows = min(len(g) for g in st.table) * self.rows_per_block if st.table else 0
            fenced = min(fenced, rows)
            if fenced > st.fenced:
                st.fenced = fenced
                ids = self.rows(tuple(tuple(g) for g in st.table), 0, fenced)
                self.driver.apply(mgr.kv_chunk(st.transfer_id, st.epoch, ids, fenced, now))

    def _rank_reports(self, output: KVConnectorOutput) -> None:
        """TP: the other ranks' ends of their copies, as the manager's ``copy_done(rank)``."""
        transport = self.driver.transport
        if not isinstance(transport, RankZeroTransport):
            return
        mgr = self.driver.manager
        now = self.driver.now()
        for r in output.reports:
            for op_id, ok in [(i, True) for i in r.completed] + [(i, False) for i in r.failed]:
                op = transport.reported(r.rank, op_id)
                if op is not None:
                    self.driver.apply(
                        mgr.copy_done(op.transfer_id, op.epoch, r.rank, ok, now, op.channel)
                    )

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorOutput | None:
        if self._streams:
            self._fence_chunks()
        self._rank_reports(output)
        self.driver.poll()
        sending: set[str] = set(output.finished_sending)
        recving: set[str] = set(output.finished_recving)
        invalid: set[int] = set(output.invalid_block_ids)
        for refused, ids in self._refused.items():
            recving.add(refused)
            invalid.update(self._blocks(ids))
        self._refused.clear()
        for r in self.driver.take_reports():
            rid = self._by_transfer.pop(r.transfer_id, None)
            if rid is None:
                continue
            del self._by_request[rid]
            if isinstance(r, FinishedSending | FreeBlocks):
                sending.add(rid)  # P's hold, or an aborted D request's blocks: free them now
                continue
            assert isinstance(r, FinishedRecving)
            self.stats["handoffs_ok" if r.ok else "handoffs_failed"] += 1
            if rid in self._waiting:
                self._waiting.discard(rid)
                recving.add(rid)
                invalid.update(self._blocks(r.invalid_block_ids))
        return KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=invalid,
            reports=output.reports,
        )

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        now = self.driver.now()
        mgr = self.driver.manager
        if self.role == "consumer":
            self._done.discard(rid)  # the id may come again, as a new request
            tid = self._by_request.get(rid)
            if tid is None or tid not in mgr.transfers:
                return False, None
            # Aborted while its hand-off is live: the blocks stay out of the pool until the
            # hand-off drained (FreeBlocks → finished_sending).
            self._waiting.discard(rid)
            self.driver.apply(mgr.abort(tid, now))
            return (rid in self._by_request), None
        params = _params(request)
        wire = self.wire
        prompt_rows = -(-request.num_prompt_tokens // wire)
        computed = getattr(request, "num_computed_tokens", request.num_prompt_tokens)
        if not params.get("do_remote_decode"):
            return False, None
        assert isinstance(mgr, ProducerManager)
        tid, epoch = str(params["transfer_id"]), int(params.get("epoch", 1))
        self._streams.pop(rid, None)
        if computed < request.num_prompt_tokens:
            # Aborted before its prompt was computed: the hand-off ends; a streamed push that
            # still reads its blocks keeps them (FinishedSending once it drained).
            if tid in mgr.transfers:
                self.driver.apply(mgr.abort(tid, now))
            if tid in mgr.transfers:
                return True, None
            if self._by_request.pop(rid, None) is not None:
                self._by_transfer.pop(tid, None)
            return False, None
        peer = str(params.get("remote_engine_id") or self.peer)
        ids = self.rows(block_ids, 0, prompt_rows)
        try:
            actions = mgr.kv_ready(tid, epoch, peer, ids, prompt_hashes(request, wire), now)
        except KVFlowError as e:
            # Unusable params (the transfer id is another request's, ...): hold nothing; D's
            # claim is refused and D recomputes.
            log.error("pd_kv_ready_refused", request_id=rid, transfer_id=tid, error=str(e))
            return False, None
        self._by_transfer[tid], self._by_request[rid] = rid, tid
        self.driver.apply(actions)
        held = rid in self._by_request
        return held, {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "epoch": epoch,
            "remote_engine_id": self.driver.engine_id,
            "remote_address": self.driver.address,
            "remote_num_tokens": request.num_prompt_tokens,
        }

    def has_pending_push_work(self) -> bool:
        return self.driver.busy()

    # ---- worker role ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups = wire_groups(self.kv, kv_caches, self.rows_per_block)
        self.driver.transport.register(groups)
        # Bytes a hand-off moves over every rank: a rank holds 1/tp of the kv heads.
        tp = self.driver.manager.world_size
        self.driver.block_bytes = [
            tp * sum(t[0].numel() * t.element_size() for t in tensors) for tensors in groups
        ]

    def wait_for_progress(self, timeout: float) -> None:
        self.driver.poll()
        if self.driver.wait(timeout):
            # What woke the wait (a peer's CLAIM or GRANT, a settled copy) is acted on now: the
            # engine's next step would reach it only after its schedule and launch.
            self.driver.poll()

    def shutdown(self) -> None:
        self.driver.close()


def pd_connector_factory(
    role: str,
    engine_id: str,
    compat: Compat,
    transport: KVTransport,
    *,
    peer: str = "",
    timeouts: PDTimeouts | None = None,
    clock: Clock | None = None,
    pump: Callable[[float], object] | None = None,
    on_driver: Callable[[PDDriver], None] | None = None,
    world_size: int = 1,
) -> Callable[[KVCacheConfig, GpuCacheView], tuple[PDConnector, PDConnector]]:
    """An engine ``connector_factory`` for a P (``producer``) or D (``consumer``) engine;
    ``world_size``: its TP ranks (rank 0's ``transport`` is then a ``RankZeroTransport``)."""
    if role not in ROLES:
        raise ConfigError(f"PD role {role!r}: one of {', '.join(ROLES)}")
    if (world_size > 1) != isinstance(transport, RankZeroTransport):
        raise ConfigError(
            f"a PD engine of {world_size} ranks needs rank 0's transport to be a "
            f"RankZeroTransport exactly when it has other ranks"
        )

    def build(kv: KVCacheConfig, _view: GpuCacheView) -> tuple[PDConnector, PDConnector]:
        if compat.block_size != kv.block_size:
            raise ConfigError(
                f"the PD compat's block size {compat.block_size} is not the engine's "
                f"{kv.block_size}"
            )
        mgr: ProducerManager | ConsumerManager
        if role == "producer":
            mgr = ProducerManager(engine_id, world_size=world_size, timeouts=timeouts)
        else:
            mgr = ConsumerManager(engine_id, world_size=world_size, timeouts=timeouts)
        driver = PDDriver(mgr, compat, transport, clock=clock, pump=pump)
        if on_driver is not None:
            on_driver(driver)
        c = PDConnector(role, kv, driver, peer=peer, wire_block_size=compat.wire)
        return c, c

    return build


__all__ = ["ROLES", "PDConnector", "pd_connector_factory", "prompt_hashes", "remote_tokens"]
