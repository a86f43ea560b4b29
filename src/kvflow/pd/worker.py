"""One PD engine process: a reference engine with the PD connector, its transport to the peer
engine (gloo by default; any of ``kvflow.backends.pd.TRANSPORTS``), and a loop that takes requests from the router's pipe and sends results back.

Tensor parallelism (gloo): an engine of ``tp`` ranks is ``tp`` processes in one gloo group of
their own; rank 0 runs the engine and the loop, the others serve its steps (``engine.tp``).
Each rank has one gloo pair per part of ``core.pd.tp``'s plan it takes part in (a
``FanTransport``), built in plan order on every process so the pairs' rendezvous never wait in
a cycle; the part's index names its store port.

The loop steps the engine even when it has nothing to compute, so the PD driver answers a peer's
messages (a CLAIM for KV P holds) at once; an idle engine waits at most ``IDLE_S``, on the pipe
and, while a hand-off is live, on the PD driver's wake-up (``idle_wait``).
Per-token times are ``time.perf_counter`` (the system's monotonic clock on Linux, the same in
every process), so the router can measure TTFT and inter-token latency across processes.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from attrs import asdict, frozen

from kvflow.backends.pd.fan import FanTransport
from kvflow.backends.pd.registry import make_transport
from kvflow.backends.pd.transport import KVTransport
from kvflow.connector.api import KVCacheConfig, WorkerConnector
from kvflow.connector.pd import PDConnector, pd_connector_factory
from kvflow.connector.pd_tp import PDRankWorker, RankZeroTransport
from kvflow.core.pd.common import PDTimeouts
from kvflow.core.pd.messages import Compat
from kvflow.core.pd.tp import Heads, plan_head_slices, rank_slices
from kvflow.engine.distributed import ProcessGroupChannel
from kvflow.engine.engine import SWITCH_INTERVAL_S, Engine, EngineConfig, make_kv_cache_config
from kvflow.engine.model import LlamaForCausalLM, model_config
from kvflow.engine.runner import ModelRunner
from kvflow.engine.tp import RankStatus, TPModelRunner, TPSpec, build_shard, serve_follower
from kvflow.errors import ConfigError
from kvflow.runtime.clock import SystemClock
from kvflow.runtime.pd_control import default_compat
from kvflow.runtime.pd_driver import PDDriver
from kvflow.tracing import trace_to

IDLE_S = 0.002
"""Longest an idle engine process waits on the router's pipe before polling its PD driver."""
WAKE_SLICE_S = 2e-4
"""How often an idle engine with a live hand-off looks at the router's pipe while it waits on
its PD driver (``idle_wait``)."""


@frozen
class WorkerSpec:
    """What one PD engine process runs: its role, ids, model, engine config, the transport pair
    (``gloo_port`` is the pair's store for every transport)."""

    role: str  # "producer" or "consumer"
    engine_id: str
    peer: str
    model: str
    engine: dict[str, Any]
    gloo_port: int
    timeout_s: float = 60.0
    concurrent: bool = False
    torch_threads: int = 1  # three engines share the machine's cores (P, D, the colocated one)
    pd_timeouts: PDTimeouts | None = None
    transport: str = "gloo"
    transport_options: dict[str, Any] | None = None
    tp: int = 1  # this engine's TP ranks
    peer_tp: int = 1  # the peer engine's
    pair_ports: tuple[int, ...] = ()  # TP: one store port per part of the plan
    tp_port: int = 0  # TP > 1: the store of this engine's own group of ranks
    wire_block_size: int | None = None  # the hand-off's unit (both engines name the same)
    trace: str | None = None  # rank 0 writes every log event here as JSON lines (``trace_to``)

    @property
    def heterogeneous(self) -> bool:
        """Whether the engines are wired part by part (either has more than one rank)."""
        return self.tp > 1 or self.peer_tp > 1


def compat_of(
    model: str, config: EngineConfig, tp: int = 1, wire_block_size: int | None = None
) -> Compat:
    cfg = model_config(model)
    return default_compat(
        model=model,
        dtype=config.dtype or "float32",
        block_size=config.block_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_layers=cfg.num_layers,
        shard=f"tp{tp}",
        wire_block_size=wire_block_size or 0,
    )


def rank_transport(spec: WorkerSpec, rank: int) -> FanTransport:
    """This rank's gloo pairs to the peer's ranks, one per part of the plan it takes part in.
    A part that moves a head slice is staged on both sides (``direct_min_bytes=None``)."""
    producer = spec.role == "producer"
    p_tp, d_tp = (spec.tp, spec.peer_tp) if producer else (spec.peer_tp, spec.tp)
    plan = plan_head_slices(model_config(spec.model).num_kv_heads, p_tp, d_tp)
    if len(spec.pair_ports) != len(plan):
        raise ConfigError(f"{len(plan)} parts of P tp{p_tp} → D tp{d_tp} need as many ports")
    parts: list[tuple[KVTransport, Heads | None]] = []
    try:
        for i in rank_slices(plan, rank, producer):
            part = plan[i]
            options = dict(spec.transport_options or {})
            if part.sliced:
                options["direct_min_bytes"] = None
            transport = make_transport(
                "gloo",
                pair_rank=0 if producer else 1,
                host="127.0.0.1",
                port=spec.pair_ports[i],
                now=SystemClock().now,
                timeout_s=spec.timeout_s,
                options=options,
            )
            shard = part.p_shard if producer else part.d_shard
            heads = part.local(producer)
            parts.append((transport, None if heads == (0, shard) else heads))
    except BaseException:
        for t, _ in parts:
            t.close()
        raise
    return FanTransport(parts)


def serve(spec: WorkerSpec, conn: Connection | None, rank: int = 0) -> None:
    """The process body: build, announce the control address, serve until told to stop
    (rank 0; ``conn`` is None on the other ranks of a TP engine, which serve rank 0's steps).
    With ``spec.trace`` rank 0's events go to that file, stamped with the system's monotonic
    clock (one clock for every process, so the router can merge the files)."""
    if spec.trace is None or rank != 0:
        _serve(spec, conn, rank)
        return
    with trace_to(Path(spec.trace), SystemClock().now):
        _serve(spec, conn, rank)


def setup_process(spec: WorkerSpec) -> None:
    """The engine process's interpreter and torch settings: those of ``kvflow bench``'s own
    process (the colocated engine's), so that both sides of ``kvflow bench --pd`` run their
    threads alike: the same GIL switch interval (the engine thread shares the GIL with the
    control plane's loop and the transport's threads) and ``spec.torch_threads``."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    torch.set_num_threads(spec.torch_threads)


def _serve(spec: WorkerSpec, conn: Connection | None, rank: int) -> None:
    setup_process(spec)
    config = EngineConfig(**spec.engine)
    if spec.heterogeneous:
        _serve_tp(spec, conn, rank, config)
        return
    assert conn is not None
    transport = make_transport(
        spec.transport,
        pair_rank=0 if spec.role == "producer" else 1,
        host="127.0.0.1",
        port=spec.gloo_port,
        now=SystemClock().now,
        timeout_s=spec.timeout_s,
        options=spec.transport_options,
    )
    timeouts = _timeouts(spec)
    engine = Engine(
        model_config(spec.model),
        config,
        connector_factory=pd_connector_factory(
            spec.role,
            spec.engine_id,
            compat_of(spec.model, config, wire_block_size=spec.wire_block_size),
            transport,
            peer=spec.peer,
            timeouts=timeouts,
        ),
    )
    _serve_engine(engine, conn)


def _timeouts(spec: WorkerSpec) -> PDTimeouts:
    return spec.pd_timeouts or PDTimeouts(claim_s=spec.timeout_s if spec.concurrent else 10.0)


def _serve_engine(
    engine: Engine,
    conn: Connection,
    stop_ranks: Callable[[], list[RankStatus]] | None = None,
) -> None:
    """Rank 0's life: announce, serve, then stop the other ranks (their copies still in flight
    join the summary) and the engine."""
    connector = engine.scheduler_connector
    assert isinstance(connector, PDConnector)
    try:
        conn.send(("ready", connector.driver.address))
        _loop(engine, connector, conn, lambda: summary_of(engine, connector))
        summary = summary_of(engine, connector)
        if stop_ranks is not None:
            statuses, stop_ranks = stop_ranks(), None
            summary["ranks_in_flight"] = sum(s.in_flight for s in statuses)
    finally:
        try:
            if stop_ranks is not None:
                stop_ranks()
        finally:
            engine.shutdown()
    # The leak check of a PD process: nothing but this thread runs after the shutdown.
    summary["threads_left"] = [
        t.name for t in threading.enumerate() if t is not threading.current_thread()
    ]
    conn.send(("stopped", summary))


def _serve_tp(spec: WorkerSpec, conn: Connection | None, rank: int, config: EngineConfig) -> None:
    """A rank of a PD engine wired part by part to the peer's ranks (``rank_transport``)."""
    if spec.transport != "gloo":
        raise ConfigError(f"PD with TP runs on the gloo transport, not {spec.transport!r}")
    if spec.tp > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{spec.tp_port}",
            rank=rank,
            world_size=spec.tp,
            timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
    try:
        transport = rank_transport(spec, rank)
        shard = build_shard(TPSpec(spec.model, config), rank, spec.tp) if spec.tp > 1 else None
        if rank == 0:
            assert conn is not None
            _serve_rank_zero(spec, conn, config, transport, shard)
        else:
            assert shard is not None
            _serve_other_rank(spec, rank, config, transport, shard)
    finally:
        if spec.tp > 1:
            dist.destroy_process_group()


def _serve_rank_zero(
    spec: WorkerSpec,
    conn: Connection,
    config: EngineConfig,
    fan: FanTransport,
    shard: LlamaForCausalLM | None,
) -> None:
    transport: KVTransport = fan if spec.tp == 1 else RankZeroTransport(fan, spec.tp)
    runners: list[TPModelRunner] = []

    def runner(
        model: LlamaForCausalLM, kv: KVCacheConfig, c: WorkerConnector, device: torch.device
    ) -> ModelRunner:
        if spec.tp == 1:
            return ModelRunner(model, kv, c, device)
        runners.append(TPModelRunner(model, kv, c, device, channel=ProcessGroupChannel()))
        return runners[0]

    engine = Engine(
        model_config(spec.model) if shard is None else shard.config,
        config,
        model=shard,
        runner_factory=runner,
        connector_factory=pd_connector_factory(
            spec.role,
            spec.engine_id,
            compat_of(spec.model, config, spec.tp, spec.wire_block_size),
            transport,
            peer=spec.peer,
            timeouts=_timeouts(spec),
            world_size=spec.tp,
        ),
    )
    _serve_engine(engine, conn, runners[0].stop if runners else None)


def _serve_other_rank(
    spec: WorkerSpec, rank: int, config: EngineConfig, fan: FanTransport, shard: LlamaForCausalLM
) -> None:
    kv = make_kv_cache_config(shard.config, config)
    wire = spec.wire_block_size or config.block_size
    worker = PDRankWorker(fan, rank, kv, config.block_size // wire)
    try:
        runner = ModelRunner(shard, kv, worker, torch.device(config.device))
        runner.configure_decode(config.decode_graphs, config.max_num_seqs, config.triton_decode)
        serve_follower(
            runner,
            ProcessGroupChannel(),
            lambda steps: RankStatus(rank, worker.in_flight, {}, steps),
        )
    finally:
        worker.shutdown()


def summary_of(engine: Engine, connector: PDConnector) -> dict[str, Any]:
    """What an engine process reports: blocks not back in the pool, live hand-offs, counters."""
    return {
        "leaked_blocks": engine.blocks.num_usable_blocks - engine.blocks.num_free_blocks(),
        "live_handoffs": connector.driver.manager.num_live,
        "unarmed_timers": connector.driver.unarmed_timers(),
        "bytes_moved": connector.driver.bytes_moved,
        "send_seconds": connector.driver.send_seconds,
        "prefill_tokens_computed": engine.stats.prefill_tokens_computed,
        "preemptions": engine.scheduler.num_preemptions,
        "transport": dict(
            getattr(connector.driver.transport, "stats", None) or {"transport": "gloo"}
        ),
        **connector.stats,
        **(
            {"rank_ops_pending": len(transport.pending)}
            if isinstance(transport := connector.driver.transport, RankZeroTransport)
            else {}
        ),
    }


def _loop(
    engine: Engine,
    connector: PDConnector,
    conn: Connection,
    summary: Callable[[], dict[str, Any]],
) -> None:
    times: dict[str, list[float]] = {}
    arrivals: dict[str, float] = {}
    stopping = False
    while True:
        while conn.poll(0):
            cmd = conn.recv()
            if cmd[0] == "stop":
                stopping = True
                continue
            if cmd[0] == "stats":
                conn.send(("stats", summary()))
                continue
            _, rid, prompt, max_tokens, params = cmd
            arrivals[rid] = time.perf_counter()
            times[rid] = []
            engine.add_request(prompt, max_tokens, request_id=rid, kv_transfer_params=params)
            if params and params.get("do_remote_decode"):
                # The hand-off exists before D can claim it: the router sends D the request
                # (concurrent flow) only once P said so.
                connector.begin(rid, params)
                conn.send(("accepted", rid, arrivals[rid]))
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            times[o.request_id].append(now)
            if o.finished:
                result = asdict(engine.take_result(o.request_id))
                if result.get("first_logits") is not None:
                    # A host copy: a device tensor would travel as a CUDA IPC handle that this
                    # process must outlive.
                    result["first_logits"] = result["first_logits"].float().cpu()
                conn.send(("result", result, arrivals.pop(o.request_id), times.pop(o.request_id)))
        if not engine.has_unfinished():
            if stopping:
                return
            idle_wait(conn, connector.driver, IDLE_S)


def idle_wait(conn: Connection, driver: PDDriver, timeout_s: float) -> None:
    """An idle engine's wait, at most ``timeout_s``: until the router sends, or, while a
    hand-off is live, until a peer's message or a settled copy needs the driver. P holding KV
    for D then answers D's CLAIM when it comes, not at the end of the wait; the router's pipe is
    looked at every ``WAKE_SLICE_S`` meanwhile."""
    if not driver.busy():
        conn.poll(timeout_s)
        return
    end = time.perf_counter() + timeout_s
    while not conn.poll(0):
        left = end - time.perf_counter()
        if left <= 0 or driver.wait(min(left, WAKE_SLICE_S)):
            return


__all__ = [
    "IDLE_S",
    "WAKE_SLICE_S",
    "WorkerSpec",
    "compat_of",
    "idle_wait",
    "rank_transport",
    "serve",
]
