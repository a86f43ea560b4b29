"""PD in vLLM, the scheduler side: ``kv_producer`` / ``kv_consumer`` / ``kv_both`` on kvflow's PD
connector.

The scheduler role of a P or D instance is ``kvflow.connector``'s ``PDOffloadConnector`` over the
instance's CPU tier (``OffloadScheduler``) and a ``PDConnector`` whose ``PDDriver`` owns the
control plane and the hand-off manager. A ``kv_both`` instance is either per request, as vLLM's
NixlConnector is: a request whose params say ``do_remote_decode`` makes it P for that request,
``do_remote_prefill`` D, neither a plain request on the CPU tier. It has both halves
(``BothPDConnector``: a producer and a consumer, each with its own driver and control plane,
their holds on the one ledger of the CPU tier's manager), built at the first request that
carries PD params, so an instance that never sees one costs nothing more than the CPU tier.

The copies are the workers': the driver's transport here is a ``RelayTransport`` (``pd_relay``),
which hands each launch to the workers in the connector metadata and settles its fence when the
workers' metadata reports it done (``pd_worker`` moves the bytes); ``pd_stats`` counts what the
hand-offs did for vLLM's connector stats.

``kv_transfer_params`` are spelled as vLLM's NIXL connector spells them, so vLLM's example
disaggregation proxy works unchanged: P returns ``do_remote_prefill``, ``remote_engine_id``,
``remote_host`` / ``remote_port`` (P's control plane), ``remote_block_ids``,
``remote_request_id`` and ``tp_size``, plus ``kvflow_transfer_id``, ``kvflow_epoch``,
``kvflow_digest`` (the prompt's chained block hashes), ``kvflow_num_tokens`` (P's prompt length:
a proxy may send D the prompt plus P's sampled token, and D then loads all of P's prompt and
computes only that token) and ``kvflow_data`` (P's data plane). A
request's params are translated once, into the names ``PDConnector`` reads, by its request view.

What the vLLM layer adds to ``PDConnector`` (``VLLMPDConnector``): a transfer id when the proxy
sent none; the recompute threshold; D checks P's digest before claiming (params of another
prompt are a local prefill, not a load failure); D releases P for a request it finished without
ever admitting it (aborted or rejected while waiting), and for a full local hit.

Peers: P's hand-off goes to the D its request names (``remote_engine_id`` in the proxy's
``do_remote_decode`` params, else ``pd_peer_engine_id``); with neither (vLLM's stock proxy tells
P nothing about D) it begins unbound and the first D to claim it gets it. D pulls from the P its
params name (``remote_engine_id`` / ``remote_host`` / ``remote_port``). The control plane keeps
one HELLO per peer engine; the data plane one pair per (P, D), hosted by P's worker (the first D
gets the worker's own data port, each further D a port of its own). P's params name the pair's
endpoint for their D; for an unbound hand-off they name the endpoint of each D P has a pair
with (``kvflow_data_for``) and the next free one (``kvflow_data``), which a new D takes: P lets
a claim bind only if the endpoint its sender picked from those params is the one P pairs it
on, so the copy goes over the claiming D's own pair (``PDSchedulerRole.may_bind``; a claim that
lost that race is refused and D computes the prompt itself).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from kvflow.connector.api import KVCacheConfig, KVConnectorOutput
from kvflow.connector.config import PDConfig
from kvflow.connector.offload import OffloadConnector, OffloadScheduler, OffloadWorker
from kvflow.connector.pd import PDConnector, prompt_hashes, remote_tokens
from kvflow.connector.pd_offload import PDOffloadConnector
from kvflow.core.block_pool import PoolEvent
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import LaunchCopies, PDTimeouts
from kvflow.core.pd.consumer import ConsumerManager
from kvflow.core.pd.messages import Compat, hashes_digest
from kvflow.core.pd.producer import ProducerManager
from kvflow.core.protocol import GroupBlockIds, StepPlan, StepReport
from kvflow.core.requests import RequestLike, SchedulerOutput
from kvflow.core.transfer import Direction
from kvflow.errors import KVFlowError
from kvflow.integrations.vllm.pd_relay import (
    CountingDriver,
    CountingProducer,
    KVFlowPDConnectorMetadata,
    PDCancel,
    PDLaunch,
    RelayTransport,
    free_port,
)
from kvflow.integrations.vllm.pd_stats import PDStats
from kvflow.integrations.vllm.relay import KVFlowConnectorMetadata
from kvflow.integrations.vllm.requests import RequestViews, VLLMRequestView
from kvflow.integrations.vllm.telemetry import KVFlowConnectorStats
from kvflow.runtime.clock import Clock
from kvflow.runtime.pd_driver import PDDriver

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvflow.core.offload import OffloadManager

log = get_logger("kvflow.integrations.vllm.pd")

PD_ROLES: Mapping[str, str] = {
    "kv_producer": "producer",
    "kv_consumer": "consumer",
    "kv_both": "both",
}
"""vLLM's ``kv_role`` → kvflow's PD role (``both``: P or D per request, else the CPU tier)."""


# ---- kv_transfer_params -----------------------------------------------------------------------


def kvflow_params(params: Mapping[str, Any] | None, request_id: str) -> dict[str, Any]:
    """A request's vLLM ``kv_transfer_params`` in the names ``PDConnector`` reads ({} when the
    request is no kvflow hand-off: no params, or a D request whose P was not kvflow)."""
    if not params:
        return {}
    if params.get("do_remote_decode"):
        tid = params.get("kvflow_transfer_id")
        return {
            "do_remote_decode": True,
            # The proxy names no transfer: one id per hand-off, never reused.
            "transfer_id": str(tid) if tid else f"{request_id}/{uuid.uuid4().hex}",
            "epoch": int(params.get("kvflow_epoch") or 1),
            "remote_engine_id": params.get("remote_engine_id") or "",
        }
    if params.get("do_remote_prefill"):
        if not params.get("kvflow_transfer_id") or not params.get("remote_host"):
            log.warning("pd_params_not_kvflow", request_id=request_id, keys=sorted(params))
            return {}
        return {
            "do_remote_prefill": True,
            "transfer_id": str(params["kvflow_transfer_id"]),
            "epoch": int(params.get("kvflow_epoch") or 1),
            "remote_engine_id": str(params.get("remote_engine_id") or ""),
            "remote_address": f"tcp://{params['remote_host']}:{int(params['remote_port'])}",
            "digest": str(params.get("kvflow_digest") or ""),
            # P's prompt length: a proxy that appends P's sampled token to D's prompt gets all
            # of P's KV loaded and only that token computed (``remote_tokens``).
            **(
                {"remote_num_tokens": params["kvflow_num_tokens"]}
                if "kvflow_num_tokens" in params
                else {}
            ),
            "data": str(params.get("kvflow_data") or ""),
            "data_for": {str(k): str(v) for k, v in (params.get("kvflow_data_for") or {}).items()},
        }
    return {}


class PDRequestView(VLLMRequestView):
    """A request view that also carries the request's translated PD params and its computed
    tokens (P holds nothing for a request aborted before its prompt was computed)."""

    __slots__ = ("kv_transfer_params",)

    def __init__(self, request: Request, hash_block_size: int | None = None) -> None:
        super().__init__(request, hash_block_size)
        self.kv_transfer_params = kvflow_params(
            getattr(request, "kv_transfer_params", None), str(request.request_id)
        )

    @property
    def num_computed_tokens(self) -> int:
        return int(self.request.num_computed_tokens)


class PDRequestViews(RequestViews):
    """``RequestViews`` that make ``PDRequestView`` objects (PD instances only)."""

    __slots__ = ()
    view_type = PDRequestView


# ---- PDConnector with vLLM's extras -----------------------------------------------------------


class VLLMPDConnector(PDConnector):
    """``PDConnector`` plus the recompute threshold, D's digest check, D releasing P for
    requests it never admitted or has nothing to pull for, and the counts of ``pd_stats``."""

    def __init__(
        self,
        role: str,
        kv: KVCacheConfig,
        driver: PDDriver,
        cfg: PDConfig,
        pd_stats: PDStats | None = None,
    ) -> None:
        super().__init__(role, kv, driver, peer=cfg.peer_engine_id)
        self.recompute_below = cfg.recompute_below_tokens
        self.pd_stats = pd_stats or PDStats([])
        self.stats["recomputed_locally"] = 0
        self.stats["released_unadmitted"] = 0

    def _reachable(self, request: RequestLike, params: Mapping[str, Any]) -> bool:
        try:
            self.driver.connect(str(params["remote_address"]))
        except (KVFlowError, KeyError, ValueError) as e:  # a miss, never a parked request
            log.warning("pd_peer_unreachable", request_id=request.request_id, error=str(e))
            return False
        return True

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = getattr(request, "kv_transfer_params", None) or {}
        rid = request.request_id
        if (
            self.role != "consumer"
            or not params.get("do_remote_prefill")
            or rid in self._done
            or rid in self._by_request
        ):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        # P reached first, even for a full local hit: D's RELEASE must reach it at once.
        if not self._reachable(request, params):
            self._done.add(rid)
            return 0, False
        digest = params.get("digest")
        remote = remote_tokens(request, params)  # None: refused (logged) by the general path
        if (
            digest
            and remote is not None
            and digest
            != hashes_digest(tuple(prompt_hashes(request, self.kv.block_size, remote))).hex()
        ):
            # The proxy paired this prompt with another prompt's KV: compute it here.
            log.warning("pd_digest_mismatch", request_id=rid, transfer_id=params["transfer_id"])
            return 0, False
        n, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if n and n < self.recompute_below:
            log.info("pd_recompute_locally", request_id=rid, tokens=n, below=self.recompute_below)
            return 0, False
        return n, is_async

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        params = getattr(request, "kv_transfer_params", None) or {}
        if (
            self.role == "consumer"
            and num_external_tokens == 0
            and params.get("do_remote_prefill")
            and request.request_id not in self._done
        ):
            self.stats["recomputed_locally"] += 1  # nothing pulled from P: D computes it
        if (
            self.role == "producer"
            and params.get("do_remote_decode")
            and not (params.get("remote_engine_id") or self.peer)
            and request.request_id not in self._by_request
        ):
            # No D named (the stock proxy): the first D to claim the hand-off binds it.
            log.info("pd_unbound", request_id=request.request_id)
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        tid = self._by_request.get(request.request_id)
        if self.role == "consumer" and num_external_tokens and tid is not None:
            self.pd_stats.claimed(tid, num_external_tokens)

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        params = getattr(request, "kv_transfer_params", None) or {}
        rid = request.request_id
        if (
            self.role == "consumer"
            and params.get("do_remote_prefill")
            and rid not in self._done
            and rid not in self._by_request
        ):
            # Finished before D ever admitted it (aborted or rejected while waiting): P's hold
            # is released now, not when its lease runs out.
            if self._reachable(request, params):
                self.stats["released_unadmitted"] += 1
                PDConnector.update_state_after_alloc(
                    self, request, tuple(() for _ in self.kv.groups), 0
                )
            self._done.discard(rid)
            return False, None
        return super().request_finished(request, block_ids)


class BothPDConnector(VLLMPDConnector):
    """A ``kv_both`` instance's PD half: the producer (this object) and a consumer
    (``consumer``), each over its own driver; a request goes to the consumer when its params
    say ``do_remote_prefill``, else to the producer (which acts only on ``do_remote_decode``)."""

    def __init__(
        self,
        kv: KVCacheConfig,
        driver: PDDriver,
        cfg: PDConfig,
        consumer: VLLMPDConnector,
        pd_stats: PDStats,
    ) -> None:
        super().__init__("producer", kv, driver, cfg, pd_stats)
        self.consumer = consumer

    @staticmethod
    def _is_d(request: RequestLike) -> bool:
        params = getattr(request, "kv_transfer_params", None) or {}
        return bool(params.get("do_remote_prefill"))

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._is_d(request):
            return self.consumer.get_num_new_matched_tokens(request, num_computed_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        if self._is_d(request):
            self.consumer.update_state_after_alloc(request, block_ids, num_external_tokens)
        else:
            super().update_state_after_alloc(request, block_ids, num_external_tokens)

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorOutput | None:
        p = super().update_connector_output(output)
        d = self.consumer.update_connector_output(KVConnectorOutput())
        assert p is not None
        assert d is not None
        return KVConnectorOutput(
            finished_sending=p.finished_sending | d.finished_sending,
            finished_recving=p.finished_recving | d.finished_recving,
            invalid_block_ids=p.invalid_block_ids | d.invalid_block_ids,
            reports=p.reports,
        )

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._is_d(request):
            return self.consumer.request_finished(request, block_ids)
        return super().request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return super().has_pending_push_work() or self.consumer.has_pending_push_work()

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.consumer.shutdown()


# ---- the scheduler role -----------------------------------------------------------------------


class PDSchedulerRole:
    """The adapter's scheduler role on a P, D or ``kv_both`` instance: ``PDOffloadConnector``
    over the CPU tier and a ``VLLMPDConnector`` (``BothPDConnector`` for ``kv_both``); speaks
    vLLM's param names and relays the copies."""

    def __init__(
        self,
        offload: OffloadScheduler,
        role: str,
        kv: KVCacheConfig,
        cfg: PDConfig,
        *,
        engine_id: str,
        compat: Compat,
        clock: Clock,
        tp_size: int,
        block_bytes: Sequence[int] = (),
        data_endpoint: str = "",
    ) -> None:
        self.offload = offload
        self.role = role
        self.cfg = cfg
        self.tp_size = tp_size
        # P: its worker's data plane, from the handshake (else the configured pd_data_port).
        self.data_endpoint = data_endpoint
        self._data: dict[str, str] = {}  # D: P's engine id → the pair's data endpoint
        self._data_of_transfer: dict[str, str] = {}  # D: each hand-off's, from its params
        self._endpoints: dict[str, str] = {}  # P: D's engine id → the pair's data endpoint
        self._spare = ""  # P: the endpoint the next new D's pair gets ("": none chosen yet)
        self._own_used = False  # P: the worker's own data endpoint went to a pair
        # P: an unbound hand-off's params → (the spare they named, the Ds they named a pair of)
        self._offers: dict[str, tuple[str, frozenset[str]]] = {}
        self.pd_stats = PDStats(block_bytes)
        sides = ("producer", "consumer") if role == "both" else (role,)
        timeouts = PDTimeouts(lease_s=cfg.lease_s, claim_s=cfg.claim_s)
        ids = itertools.count(1)
        self.relays: dict[str, RelayTransport] = {}
        self.drivers: dict[str, CountingDriver] = {}
        try:
            for side in sides:
                mgr: ProducerManager | ConsumerManager
                if side == "producer":
                    mgr = CountingProducer(engine_id, timeouts=timeouts, may_bind=self.may_bind)
                    mgr.pd_stats = self.pd_stats
                else:
                    mgr = ConsumerManager(engine_id, timeouts=timeouts)
                data_of = self._p_data_of if side == "producer" else self._data_of
                relay = self.relays[side] = RelayTransport(
                    data_of, side=side, stats=self.pd_stats, now=clock.now, ids=ids
                )
                # kv_both: the configured port is P's (its params name it); D's is any port.
                port = cfg.side_channel_port if side == "producer" or role != "both" else 0
                driver = CountingDriver(
                    mgr,
                    compat,
                    relay,
                    clock=clock,
                    bind=f"tcp://{cfg.side_channel_host}:{port}",
                    hello_timeout_s=cfg.timeout_s,
                )
                driver.pd_stats = self.pd_stats
                self.drivers[side] = driver
            self.pd = self._connector(kv, cfg)
            # The scheduler process has no worker: only PDOffloadConnector's scheduler-role
            # methods are called here.
            self.both = PDOffloadConnector(
                OffloadConnector(offload, cast(OffloadWorker, None)), self.pd
            )
            if isinstance(self.pd, BothPDConnector):
                # One owner of GPU refs: the consumer's holds go on the same ledger as P's.
                self.pd.consumer.driver.manager.ledger.attach(offload.manager.pd_holds)
        except BaseException:
            self.close()
            raise
        host, _, port_text = self.driver.address.removeprefix("tcp://").rpartition(":")
        self.host, self.port = host, int(port_text)
        log.info(
            "vllm_pd_ready",
            role=role,
            engine_id=engine_id,
            control=[d.address for d in self.drivers.values()],
            transport=cfg.transport.value,
        )

    def _connector(self, kv: KVCacheConfig, cfg: PDConfig) -> VLLMPDConnector:
        d = self.drivers
        if self.role != "both":
            return VLLMPDConnector(self.role, kv, d[self.role], cfg, self.pd_stats)
        consumer = VLLMPDConnector("consumer", kv, d["consumer"], cfg, self.pd_stats)
        return BothPDConnector(kv, d["producer"], cfg, consumer, self.pd_stats)

    @property
    def driver(self) -> PDDriver:
        """The driver whose control plane P's params name (a consumer's: its only one)."""
        return self.drivers.get("producer") or self.drivers["consumer"]

    def busy(self) -> bool:
        return any(d.busy() for d in self.drivers.values())

    def _data_of(self, op: LaunchCopies) -> str:
        return self._data_of_transfer.get(op.transfer_id) or self._data.get(op.peer, "")

    def _p_data_of(self, op: LaunchCopies) -> str:
        return self.endpoint_for(op.peer)

    def endpoint_for(self, peer: str) -> str:
        """P: the data-plane endpoint of the pair with D ``peer`` (its worker hosts it): the
        worker's own for the first D, a free port of the same host for each further one."""
        ep = self._endpoints.get(peer)
        if ep is None:
            ep = self._endpoints[peer] = self.spare_endpoint()
            self._spare = ""
        return ep

    def spare_endpoint(self) -> str:
        """P: the endpoint the next D that P has no pair with gets (chosen once, kept until a D
        takes it)."""
        if not self._spare:
            own = self.data_endpoint or (
                f"{self.cfg.side_channel_host}:{self.cfg.data_port}" if self.cfg.data_port else ""
            )
            if own and not self._own_used:
                self._own_used = True
                self._spare = own
            else:
                host = self.data_endpoint.rpartition(":")[0] or self.cfg.side_channel_host
                self._spare = f"{host}:{free_port(host)}"
        return self._spare

    def may_bind(self, transfer_id: str, peer: str) -> bool:
        """P: whether D ``peer``'s claim may bind unbound hand-off ``transfer_id``: only if the
        endpoint D picked from the hand-off's params (its own pair's if they named one, else
        the spare) is the one P pairs it on; a new D takes the spare then. False when another
        new D took that spare first (its claim is refused; the next params name a new one)."""
        offer = self._offers.pop(transfer_id, None)
        if offer is None:
            log.warning("pd_bind_no_offer", transfer_id=transfer_id, peer=peer)
            return False
        spare, known = offer
        if peer in known:
            return True
        mine = self._endpoints.get(peer)
        if mine is not None:
            return mine == spare
        if spare in self._endpoints.values():
            return False
        self._endpoints[peer] = spare
        if self._spare == spare:
            self._spare = ""
        return True

    def take_stats(self) -> KVFlowConnectorStats | None:
        """PD's stats since the last call (``pd_stats``), None when nothing changed."""
        p, d = self.drivers.get("producer"), self.drivers.get("consumer")
        return self.pd_stats.take(
            p.manager.num_live if p is not None else 0, d.manager.num_live if d is not None else 0
        )

    # -- the SchedulerRole calls --------------------------------------------------------------

    @property
    def manager(self) -> OffloadManager:
        return self.offload.manager

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.both.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        params = getattr(request, "kv_transfer_params", None) or {}
        if params.get("data"):
            me = self.driver.engine_id
            data = params["data_for"].get(me) or str(params["data"])
            self._data[str(params["remote_engine_id"])] = data
            self._data_of_transfer[str(params["transfer_id"])] = data
        self.both.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        plan = self.both.build_connector_meta(scheduler_output)
        assert isinstance(plan, StepPlan)
        return plan

    def wrap_meta(self, base: KVFlowConnectorMetadata) -> KVFlowPDConnectorMetadata:
        """This step's metadata with the PD copies; CLAIMs and GRANTs that arrived are answered
        first, so their copies start this step."""
        ops: list[PDLaunch | PDCancel] = []
        for side, driver in self.drivers.items():
            driver.poll()
            ops.extend(self.relays[side].take_ops())
        return KVFlowPDConnectorMetadata(base, tuple(ops), bool(ops) or self.busy())

    def update_from_reports(
        self, reports: Sequence[StepReport], pd_results: Sequence[tuple[int, bool]] = ()
    ) -> KVConnectorOutput:
        if pd_results:
            for relay in self.relays.values():
                relay.settle(pd_results)
        return self.both.update_connector_output(KVConnectorOutput(reports=reports))

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        ours = getattr(request, "kv_transfer_params", None) or {}
        if ours.get("do_remote_prefill"):
            self._data_of_transfer.pop(str(ours.get("transfer_id")), None)
        delay, params = self.both.request_finished(request, block_ids)
        if params is None or not params.get("do_remote_prefill"):
            return delay, params
        return delay, self._nixl_params(request, block_ids, params)

    def _nixl_params(
        self, request: RequestLike, block_ids: GroupBlockIds, params: Mapping[str, Any]
    ) -> dict[str, Any]:
        """P's params for D, in NIXL's names plus kvflow's."""
        bs = self.pd.kv.block_size
        hashes = prompt_hashes(request, bs)
        ours = getattr(request, "kv_transfer_params", None) or {}
        peer = str(ours.get("remote_engine_id") or self.cfg.peer_engine_id)
        data: dict[str, Any] = {"kvflow_data": self.endpoint_for(peer) if peer else ""}
        if not peer:
            mgr = self.drivers["producer"].manager
            for tid in [k for k in self._offers if k not in mgr.transfers]:
                del self._offers[tid]  # ended unclaimed
            data["kvflow_data"] = self.spare_endpoint()
            data["kvflow_data_for"] = dict(self._endpoints)
            known = frozenset(self._endpoints)
            self._offers[str(params["transfer_id"])] = (data["kvflow_data"], known)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": params["remote_engine_id"],
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": list(block_ids[0][: len(hashes)]) if block_ids else [],
            "remote_request_id": request.request_id,
            "tp_size": self.tp_size,
            "kvflow_transfer_id": params["transfer_id"],
            "kvflow_epoch": params["epoch"],
            "kvflow_digest": hashes_digest(tuple(hashes)).hex(),
            "kvflow_num_tokens": request.num_prompt_tokens,
            **data,
        }

    def reset_cache(self) -> bool:
        return self.both.reset_cache()

    def has_pending_push_work(self) -> bool:
        return self.both.has_pending_push_work()

    def take_events(self) -> list[tuple[int, PoolEvent]]:
        return self.offload.take_events()

    def take_latencies(self) -> list[tuple[Direction, float]]:
        return self.offload.take_latencies()

    def close(self) -> None:
        for driver in self.drivers.values():
            driver.close()


def vllm_compat(model: str, dtype: str, kv: KVCacheConfig, spec: Any, tp_size: int) -> Compat:
    """What P and D must agree on, from vLLM's model and KV cache spec."""
    from kvflow import __version__

    return Compat(
        model=model,
        dtype=dtype,
        block_size=kv.block_size,
        layout="vllm",
        num_kv_heads=int(getattr(spec, "num_kv_heads", 0)),
        head_dim=int(getattr(spec, "head_size", 0)),
        num_layers=sum(len(g.layer_names) for g in kv.groups),
        shard=f"tp{tp_size}/0",
        kvflow_version=__version__,
    )


__all__ = [
    "PD_ROLES",
    "BothPDConnector",
    "PDRequestView",
    "PDRequestViews",
    "PDSchedulerRole",
    "VLLMPDConnector",
    "kvflow_params",
    "vllm_compat",
]
