"""One PD engine process: a reference engine with the PD connector, its transport to the peer
engine (gloo by default; any of ``kvflow.backends.pd.TRANSPORTS``), and a loop that takes requests from the router's pipe and sends results back.

The loop steps the engine even when it has nothing to compute, so the PD driver answers a peer's
messages (a CLAIM for KV P holds) at once; an idle engine waits on the pipe at most ``IDLE_S``.
Per-token times are ``time.perf_counter`` (the system's monotonic clock on Linux, the same in
every process), so the router can measure TTFT and inter-token latency across processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
from attrs import asdict, frozen

from kvflow.backends.pd.registry import make_transport
from kvflow.connector.pd import PDConnector, pd_connector_factory
from kvflow.core.pd.common import PDTimeouts
from kvflow.core.pd.messages import Compat
from kvflow.engine.engine import Engine, EngineConfig
from kvflow.engine.model import model_config
from kvflow.runtime.clock import SystemClock
from kvflow.runtime.pd_control import default_compat

IDLE_S = 0.002
"""Longest an idle engine process waits on the router's pipe before polling its PD driver."""


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


def compat_of(model: str, config: EngineConfig) -> Compat:
    cfg = model_config(model)
    return default_compat(
        model=model,
        dtype=config.dtype or "float32",
        block_size=config.block_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_layers=cfg.num_layers,
    )


def serve(spec: WorkerSpec, conn: Connection) -> None:
    """The process body: build, announce the control address, serve until told to stop."""
    torch.set_num_threads(spec.torch_threads)
    config = EngineConfig(**spec.engine)
    transport = make_transport(
        spec.transport,
        pair_rank=0 if spec.role == "producer" else 1,
        host="127.0.0.1",
        port=spec.gloo_port,
        now=SystemClock().now,
        timeout_s=spec.timeout_s,
        options=spec.transport_options,
    )
    timeouts = spec.pd_timeouts or PDTimeouts(claim_s=spec.timeout_s if spec.concurrent else 10.0)
    engine = Engine(
        model_config(spec.model),
        config,
        connector_factory=pd_connector_factory(
            spec.role,
            spec.engine_id,
            compat_of(spec.model, config),
            transport,
            peer=spec.peer,
            timeouts=timeouts,
        ),
    )
    connector = engine.scheduler_connector
    assert isinstance(connector, PDConnector)
    try:
        conn.send(("ready", connector.driver.address))
        _loop(engine, connector, conn, lambda: summary_of(engine, connector))
        summary = summary_of(engine, connector)
    finally:
        engine.shutdown()
    # The leak check of a PD process: nothing but this thread runs after the shutdown.
    summary["threads_left"] = [
        t.name for t in threading.enumerate() if t is not threading.current_thread()
    ]
    conn.send(("stopped", summary))


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
                conn.send(("accepted", rid))
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            times[o.request_id].append(now)
            if o.finished:
                result = engine.take_result(o.request_id)
                conn.send(
                    ("result", asdict(result), arrivals.pop(o.request_id), times.pop(o.request_id))
                )
        if not engine.has_unfinished():
            if stopping:
                return
            conn.poll(IDLE_S)


__all__ = ["IDLE_S", "WorkerSpec", "compat_of", "serve"]
