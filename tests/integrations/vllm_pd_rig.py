"""A vLLM P instance and a vLLM D instance with kvflow as producer and consumer, driven by hand.

Each instance is vLLM's real v1 ``Scheduler`` with the scheduler-role ``KVFlowConnector`` and
one worker-role twin over CPU tensors in vLLM's layout; a stand-in model writes each computed
token's KV (a value of token, position, layer and K/V), so KV that arrives from P can be checked
byte for byte. The requests carry exactly what vLLM's example disaggregation proxy sends, and D
gets P's returned ``kv_transfer_params`` after a JSON round trip, as the proxy forwards them. In
one process the data plane is a ``FakeLink`` per P–D pair (``FakeLinkConnector``, the links by
the pair's data endpoint); ``serve_p`` runs a P instance in a process of its own over gloo.
Each instance keeps the connector stats vLLM's scheduler published (``stats``); ``Fleet`` steps
several P and D instances together over one link pool.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any, ClassVar

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvflow.backends.pd.fake import FakeLink
from kvflow.backends.pd.transport import KVTransport
from kvflow.core.protocol import StepPlan
from kvflow.integrations.vllm import (
    KVFlowConnector,
    KVFlowConnectorMetadata,
    KVFlowConnectorStats,
)
from kvflow.integrations.vllm.pd_worker import PDWorkerSide
from kvflow.runtime.clock import SystemClock
from tests.integrations.vllm_fakes import worker_connector
from tests.integrations.vllm_harness import (
    EOS_TOKEN_ID,
    HEAD_SIZE,
    KVFLOW_MODULE,
    LAYERS,
    NUM_KV_HEADS,
    VLLMHarness,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_runner_output,
)

BS = 16
RIG_MODULE = "tests.integrations.vllm_pd_rig"
PROXY_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What vLLM's example proxy (``toy_proxy_server.py``) sends to P, with ``max_tokens=1``."""

TIMEOUTS: Mapping[str, float] = {"pd_lease_s": 5.0, "pd_claim_s": 5.0, "pd_timeout_s": 5.0}
# How long a release of P may take in real time when 20 steps outran the control plane's thread:
# well under P's lease, so a release that only the lease's end made still fails.
RELEASE_GUARD_S = 1.0

_ids = itertools.count(1)


def step_until(
    until: Callable[[], bool], step: Callable[[], None], max_steps: int, guard_s: float
) -> None:
    """``step()`` until ``until()``; fail only past both ``max_steps`` steps and ``guard_s``
    of real time (the rigs' workers and control plane run on threads, in real time)."""
    clock = SystemClock()
    deadline = clock.now() + guard_s
    steps = 0
    while not until():
        if steps >= max_steps and clock.now() >= deadline:
            raise AssertionError(f"not reached in {steps} steps and {guard_s} s")
        step()
        steps += 1


class LinkPool:
    """One ``FakeLink`` per data endpoint (a P–D pair): the first pair gets ``first`` (the one
    a test sets faults on), each further one a link of the same receive timeout.

    A link reads the time only when stepped, and the instances step on the system clock: so a
    link starts at the clock's time when its pair is made (a worker may post a receive before
    the link's first step; with the link's time still 0 that receive's deadline would already
    be past at the first step, and the hand-off would fail whenever P's send came a step later).
    """

    def __init__(self, first: FakeLink, clock: Callable[[], float] | None = None) -> None:
        self.first = first
        self._clock = clock or SystemClock().now
        self._lock = threading.Lock()  # the workers build their pairs on threads
        self._links: dict[int, tuple[FakeLink, tuple[KVTransport, KVTransport]]] = {}

    def end(self, pair_rank: int, port: int) -> KVTransport:
        with self._lock:
            if port not in self._links:
                link = self.first if not self._links else FakeLink(self.first.recv_timeout_s)
                link.now = max(link.now, self._clock())
                self._links[port] = (link, link.pair())
            return self._links[port][1][pair_rank]

    def step(self, now: float) -> None:
        with self._lock:
            links = [link for link, _ in self._links.values()]
        for link in links:
            link.step(now)

    def __len__(self) -> int:
        return len(self._links)


class FakeLinkConnector(KVFlowConnector):
    """``KVFlowConnector`` whose workers' data plane is one end of a ``FakeLink`` of the pool."""

    POOL: ClassVar[LinkPool] = LinkPool(FakeLink())

    def make_pd_transport(self, pair_rank: int, host: str, port: int) -> KVTransport:
        return self.POOL.end(pair_rank, port)


def kv_value(token: int, pos: int, layer: int, kv: int) -> float:
    """What the stand-in model writes for one token: exact in fp16, distinct per slot."""
    return float((token * 7 + pos * 3 + layer * 11 + kv * 5) % 2000)


def pd_request(
    prompt: list[int], params: Mapping[str, Any] | None, max_tokens: int, request_id: str
) -> Request:
    """A vLLM ``Request`` carrying ``kv_transfer_params`` as the OpenAI server puts them."""
    make_request([1], block_size=BS)  # vLLM's none-hash, set once
    sp = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args=None if params is None else {"kv_transfer_params": dict(params)},
    )
    sp.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=sp,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


class Instance:
    """One vLLM instance: its scheduler, its connector's worker twin, its KV tensors."""

    def __init__(
        self,
        kv_role: str,
        engine_id: str,
        extra: Mapping[str, Any],
        *,
        connector: str = "FakeLinkConnector",
        module: str = RIG_MODULE,
        num_blocks: int = 64,
        policy: str = "recompute",
        links: LinkPool | None = None,
    ) -> None:
        config = make_vllm_config(
            connector=connector,
            module_path=module,
            extra_config={
                "cpu_bytes_to_use": 1 << 20,
                "backend": "host",
                "worker_loop": "inline",
                **extra,
            },
            kv_role=kv_role,
            kv_load_failure_policy=policy,
        )
        assert config.kv_transfer_config is not None
        config.kv_transfer_config.engine_id = engine_id
        self.h = VLLMHarness(make_scheduler(config, num_blocks), BS)
        self.links = links
        self.payloads: list[dict[str, Any]] = []  # the connector stats vLLM published
        make_stats = self.h.scheduler.make_stats

        def keep_stats(*args: Any, **kwargs: Any) -> Any:
            stats = make_stats(*args, **kwargs)
            if stats is not None and stats.kv_connector_stats:
                self.payloads.append(stats.kv_connector_stats)
            return stats

        self.h.scheduler.make_stats = keep_stats  # type: ignore[method-assign,unused-ignore]
        self._clock = SystemClock()
        self.num_blocks = num_blocks
        self.worker = worker_connector(self.h.connector)
        self.caches = {
            name: torch.zeros(2, num_blocks, BS, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.float16)
            for name in LAYERS
        }
        self.worker.register_kv_caches(self.caches)
        # As vLLM's engine core does after the workers registered their KV caches.
        handshake = self.worker.get_handshake_metadata()
        self.h.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
        self.outputs: dict[str, Any] = {}  # request id → its final EngineCoreOutput
        self.computed: dict[str, int] = {}  # request id → prompt tokens the model computed

    @property
    def connector(self) -> KVFlowConnector:
        c: KVFlowConnector = self.h.connector
        return c

    @property
    def pd(self) -> Any:
        return self.connector._pd

    @property
    def pd_worker(self) -> PDWorkerSide | None:
        """The worker twin's PD data plane (None without PD)."""
        side: PDWorkerSide | None = getattr(self.worker, "_pd_worker", None)
        return side

    def add(
        self,
        prompt: list[int],
        params: Mapping[str, Any] | None,
        *,
        max_tokens: int = 4,
        request_id: str | None = None,
    ) -> Request:
        request = pd_request(prompt, params, max_tokens, request_id or f"r{next(_ids)}")
        self.h.scheduler.add_request(request)
        return request

    def forward(self, so: SchedulerOutput) -> None:
        """The stand-in model: writes the KV of every token scheduled this step."""
        for rid, n in so.num_scheduled_tokens.items():
            request = self.h.scheduler.requests[rid]
            table = self.h.block_ids(request)[0]
            start = request.num_computed_tokens - n  # vLLM advanced it when it scheduled
            prompt = request.num_prompt_tokens
            self.computed[rid] = self.computed.get(rid, 0) + max(
                0, min(start + n, prompt) - min(start, prompt)
            )
            for pos in range(start, start + n):
                block, offset = table[pos // BS], pos % BS
                token = request.all_token_ids[pos]
                for layer, name in enumerate(LAYERS):
                    for kv in (0, 1):
                        self.caches[name][kv, block, offset] = kv_value(token, pos, layer, kv)

    def step(self) -> SchedulerOutput:
        """One engine step in the model runner's order; the copies of the CPU tier drained."""
        if self.links is not None:
            self.links.step(self._clock.now())
        so = self.h.schedule()
        meta = so.kv_connector_metadata
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        self.forward(so)
        w.wait_for_save()
        assert isinstance(meta, KVFlowConnectorMetadata)
        w.handle_preemptions(
            KVFlowConnectorMetadata(StepPlan(meta.plan.step if meta.plan else 0, flush=True))
        )
        results = w.get_transfer_results(so.finished_req_ids)
        output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        outputs = self.h.scheduler.update_from_output(
            so,
            model_runner_output(self.h.scheduler, so, None if output.is_empty() else output),
        )
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.outputs[o.request_id] = o
        return so

    def kv_of(self, request: Request, upto: int) -> list[float]:
        """The KV this instance holds for the request's first ``upto`` tokens, flattened."""
        table = self.h.block_ids(request)[0]
        out: list[float] = []
        for pos in range(upto):
            for name in LAYERS:
                for kv in (0, 1):
                    cell = self.caches[name][kv, table[pos // BS], pos % BS]
                    out.extend(cell.flatten().tolist())
        return out

    def free_blocks(self) -> int:
        return self.h.free_blocks()

    def stats(self) -> KVFlowConnectorStats:
        """Every connector stats payload vLLM published so far, aggregated."""
        total = KVFlowConnectorStats()
        for payload in self.payloads:
            total.aggregate(KVFlowConnectorStats(data=json.loads(json.dumps(payload))))
        return total

    def idle(self) -> bool:
        """No request, no hand-off, no copy left (the leak check)."""
        pd = self.pd
        worker_pd = self.worker._pd_worker
        halves = [] if pd is None else [pd.pd, getattr(pd.pd, "consumer", pd.pd)]
        return (
            not self.h.scheduler.requests
            and (pd is None or not pd.busy())
            and (worker_pd is None or not worker_pd.busy)
            and not any(half._by_request for half in halves)
            and not self.h.scheduler.connector.has_pending_push_work()
        )

    def shutdown(self) -> None:
        try:
            self.worker.shutdown()
        finally:
            self.connector.shutdown()


def expected_kv(prompt: list[int], upto: int) -> list[float]:
    """The KV the stand-in model computes for the prompt's first ``upto`` tokens."""
    out: list[float] = []
    for pos in range(upto):
        for layer, _name in enumerate(LAYERS):
            for kv in (0, 1):
                out.extend([kv_value(prompt[pos], pos, layer, kv)] * (NUM_KV_HEADS * HEAD_SIZE))
    return out


class Fleet:
    """Several P and D instances over one link pool, stepped together; ``ps`` maps each P to
    its ``pd_peer_engine_id`` ("": none, so a request naming no D begins unbound)."""

    def __init__(self, ps: dict[str, str], ds: dict[str, str]) -> None:
        self.links = FakeLinkConnector.POOL = LinkPool(FakeLink())
        self.instances: dict[str, Instance] = {}
        try:
            for name, peer in ps.items():
                extra = {**TIMEOUTS, **({"pd_peer_engine_id": peer} if peer else {})}
                self.instances[name] = Instance("kv_producer", name, extra, links=self.links)
            for name in ds:
                self.instances[name] = Instance("kv_consumer", name, TIMEOUTS, links=self.links)
        except BaseException:
            self.close()
            raise

    def run(self, until: Any, max_steps: int = 300, guard_s: float = 60.0) -> None:
        """Step every instance until ``until()``; fail only past both ``max_steps`` steps and
        ``guard_s`` of real time. The workers build data-plane pairs and move fake-link packets
        on threads, in real time: on a loaded box a fast loop of 300 steps outran them. After a
        step in which a worker still builds a pair, the loop waits for that thread (it then gets
        the interpreter) instead of stepping on."""

        def step() -> None:
            for i in self.instances.values():
                i.step()
            for side in (i.pd_worker for i in self.instances.values()):
                if side is not None:
                    side.wait_pairs(0.05)

        step_until(until, step, max_steps, guard_s)

    def prefill(self, p: str, prompt: list[int], rid: str, d: str | None) -> dict[str, Any]:
        """``p`` prefills for D ``d`` (named by the proxy's params; None: P's configured one)."""
        params = dict(PROXY_PARAMS) if d is None else {**PROXY_PARAMS, "remote_engine_id": d}
        inst = self.instances[p]
        inst.add(prompt, params, max_tokens=1, request_id=rid)
        self.run(lambda: rid in inst.outputs)
        out = inst.outputs[rid].kv_transfer_params
        assert out is not None
        return dict(out)

    def decode(self, d: str, prompt: list[int], params: dict[str, Any], rid: str) -> None:
        """D ``d`` runs the request on P's KV: one prompt token computed, the KV byte-exact."""
        inst = self.instances[d]
        req = inst.add(prompt, params, max_tokens=2, request_id=rid)
        self.run(lambda: rid in inst.computed)
        assert inst.computed[rid] == 1
        assert inst.kv_of(req, len(prompt) - 1) == expected_kv(prompt, len(prompt) - 1)
        self.run(lambda: rid in inst.outputs)

    def settle(self) -> None:
        self.run(lambda: all(i.idle() for i in self.instances.values()), max_steps=400)

    def close(self) -> None:
        for i in self.instances.values():
            i.shutdown()


class PDRig:
    """A P and a D instance over one ``FakeLink``, stepped in turn."""

    def __init__(
        self,
        link: FakeLink | None = None,
        *,
        p_extra: Mapping[str, Any] | None = None,
        d_extra: Mapping[str, Any] | None = None,
        policy: str = "recompute",
        p_role: str = "kv_producer",
        d_role: str = "kv_consumer",
    ) -> None:
        self.link = link or FakeLink()
        self.links = FakeLinkConnector.POOL = LinkPool(self.link)
        self.p = Instance(
            p_role,
            "P",
            {**TIMEOUTS, "pd_peer_engine_id": "D", **(p_extra or {})},
            links=self.links,
        )
        try:
            self.d = Instance(
                d_role,
                "D",
                {**TIMEOUTS, "pd_peer_engine_id": "P", **(d_extra or {})},
                policy=policy,
                links=self.links,
            )
        except BaseException:
            self.p.shutdown()
            raise

    def prefill(
        self, prompt: list[int], request_id: str, max_steps: int = 50
    ) -> tuple[Request, dict[str, Any]]:
        """The proxy's first leg: P prefills with one output token; returns P's request and
        the params D gets (after a JSON round trip)."""
        req = self.p.add(prompt, PROXY_PARAMS, max_tokens=1, request_id=request_id)
        for _ in range(max_steps):
            self.p.step()
            if request_id in self.p.outputs:
                params = self.p.outputs[request_id].kv_transfer_params
                assert params is not None, "P returned no kv_transfer_params"
                return req, json.loads(json.dumps(params))
        raise AssertionError(f"P did not finish {request_id} in {max_steps} steps")

    def step(self) -> None:
        self.p.step()
        self.d.step()

    def run(self, until: Any, max_steps: int = 200, guard_s: float = 0.0) -> None:
        """Step both until ``until()``; fail past ``max_steps`` steps once ``guard_s`` of real
        time has passed too (a wait that crosses the control plane's thread: on a loaded box a
        fast loop of steps outruns it)."""
        step_until(until, self.step, max_steps, guard_s)

    def serve_without_pulling(
        self, prompt: list[int], d_prompt: list[int] | None = None, request_id: str = "r1"
    ) -> int:
        """P prefills ``prompt``, D gets P's params with ``d_prompt`` (default the same) and
        pulls nothing: it is never parked, P is released within a few steps (or, on a loaded
        box, well within P's lease), the request finishes. The prompt tokens D computed."""
        _, params = self.prefill(prompt, request_id)
        req = self.d.add(d_prompt or prompt, params, max_tokens=2, request_id=request_id)
        self.d.step()
        assert not waiting_for_kv(req)
        self.run(
            lambda: request_id not in self.p.h.scheduler.requests,
            max_steps=20,
            guard_s=RELEASE_GUARD_S,
        )
        self.run(lambda: request_id in self.d.outputs)
        assert self.d.outputs[request_id].finish_reason == FinishReason.LENGTH
        return self.d.computed[request_id]

    def until_scheduled(self, request_id: str, max_steps: int = 200) -> SchedulerOutput:
        """Step both until D schedules the request; D's output of that step."""
        for _ in range(max_steps):
            self.p.step()
            so = self.d.step()
            if request_id in so.num_scheduled_tokens:
                return so
        raise AssertionError(f"D did not schedule {request_id} in {max_steps} steps")

    def settle(self, max_steps: int = 400) -> None:
        """Step both until neither holds anything."""
        self.run(lambda: self.p.idle() and self.d.idle(), max_steps)

    def close(self) -> None:
        try:
            self.d.shutdown()
        finally:
            self.p.shutdown()


def serve_p(
    conn: Connection, extra: Mapping[str, Any], model_dir: str, kv_role: str = "kv_producer"
) -> None:
    """A P instance (``kv_role``) over gloo in a process of its own: answers ``("prefill", prompt, id)`` with
    P's params, steps its engine between messages (a CLAIM is answered at once), and answers
    ``"stop"`` with whether it ended idle and with every block free. ``model_dir``: D's tiny
    model folder (the model's name is part of what P and D must agree on)."""
    from pathlib import Path

    from tests.integrations import vllm_harness

    torch.set_num_threads(1)
    vllm_harness._model_dir = Path(model_dir)
    p = Instance(kv_role, "P", extra, connector="KVFlowConnector", module=KVFLOW_MODULE)
    free = p.free_blocks()
    try:
        conn.send("ready")
        while True:
            p.step()
            if not conn.poll(0.002):
                continue
            msg = conn.recv()
            if msg == "stop":
                for _ in range(1000):
                    if p.idle():
                        break
                    p.step()
                conn.send((p.idle(), p.free_blocks() == free))
                return
            _, prompt, rid = msg
            p.add(prompt, PROXY_PARAMS, max_tokens=1, request_id=rid)
            while rid not in p.outputs:
                p.step()
            conn.send(json.loads(json.dumps(p.outputs[rid].kv_transfer_params)))
    finally:
        p.shutdown()


def waiting_for_kv(request: Request) -> bool:
    return bool(request.status == RequestStatus.WAITING_FOR_REMOTE_KVS)


__all__ = [
    "BS",
    "KVFLOW_MODULE",
    "PROXY_PARAMS",
    "TIMEOUTS",
    "FakeLinkConnector",
    "Instance",
    "LinkPool",
    "PDRig",
    "expected_kv",
    "kv_value",
    "pd_request",
    "serve_p",
    "waiting_for_kv",
]
