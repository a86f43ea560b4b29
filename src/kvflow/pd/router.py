"""The PD router: one prefill engine process (P) and one decode engine process (D) on this
machine (multiprocessing spawn; a gloo, NIXL or CUDA IPC data plane, ``transport``; zmq control
plane), and the flows that send a request through them.

Sequential flow (vLLM's proxies, llm-d): the request goes to P with one output token and
``do_remote_decode``; P's result carries ``kv_transfer_params`` (transfer id, P's engine id and
control address); the request then goes to D with those params, D pulls the KV through its
connector and decodes. Requests are pipelined: each goes to D as soon as P answered it.

Concurrent flow (SGLang, Dynamo): the router names the transfer and sends the request to both at
once; D reserves and claims while P prefills, P grants when its KV is complete.

First token (sequential flow): by default D recomputes the prompt's last token and samples the
first token itself (vLLM's semantics), so the hand-off lies between the prompt and the first
token. With ``first_token="prefill"`` P's sampled token is the first token (the router has it as
soon as P answers, as a serving proxy streams it) and rides along: D's prompt is P's plus that
token, D loads all of P's prompt KV and computes only that token on its way to the second. The
hand-off then lies between the first and the second token.

Tensor parallelism (``tp=(P's, D's)``, gloo): each engine is that many processes, rank 0 of
each talks to the router; P's and D's ranks exchange head slices pair by pair (``pd.worker``).

Every wait is bounded: the processes' start, each answer (``timeout_s``), the stop.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs
from attrs import frozen

from kvflow.backends.pd.registry import TRANSPORTS
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import PDTimeouts
from kvflow.core.pd.tp import plan_head_slices
from kvflow.engine.distributed import free_port
from kvflow.engine.engine import GenerationRequest, RequestResult, RequestTimeline
from kvflow.engine.model import model_config
from kvflow.errors import ConfigError, KVFlowError
from kvflow.pd.worker import WorkerSpec, serve

log = get_logger("kvflow.pd.router")

FLOWS = ("sequential", "concurrent")
FIRST_TOKENS = ("decode", "prefill")


def trace_parts(trace: Path) -> dict[str, Path]:
    """The files P's and D's processes write their events to, beside ``trace``."""
    return {me: trace.with_name(f"{trace.name}.{me}") for me in ("P", "D")}


def check_first_token(first_token: str, flow: str) -> None:
    """``ConfigError`` for a first-token option that is unknown or cannot run in ``flow``."""
    if first_token not in FIRST_TOKENS:
        raise ConfigError(f"PD first token {first_token!r}: one of {', '.join(FIRST_TOKENS)}")
    if first_token == "prefill" and flow != "sequential":
        raise ConfigError(
            "first_token='prefill' needs the sequential flow: in the concurrent flow D has "
            "the request before P sampled anything"
        )


@frozen
class PDResult:
    """A request served by P and D: D's result, and the times the router saw."""

    result: RequestResult  # D's (with P's first token first when P sampled it)
    prefill: RequestResult | None  # P's (the sequential flow's one-token answer)
    # The request's arrival at P's engine → its first token (P's or D's), as an engine measures
    # its own TTFT from a request's arrival; the router's send to P is ``delivered_s``.
    ttft_s: float
    token_times: tuple[float, ...]  # per-token perf_counter times (P's first, when P sampled it)
    delivered_s: float = 0.0  # router submit → the request's arrival at P's engine

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


def _result(d: dict[str, Any]) -> RequestResult:
    d = dict(d)
    d["output_token_ids"] = tuple(d["output_token_ids"])
    if isinstance(d.get("timeline"), dict):  # attrs' asdict in the worker flattened it
        d["timeline"] = RequestTimeline(**d["timeline"])
    return RequestResult(**d)


class _Proc:
    """One engine: its rank-0 process (with the pipe) and, with TP, its other ranks."""

    def __init__(self, ctx: Any, spec: WorkerSpec) -> None:
        self.spec = spec
        self.conn, child = ctx.Pipe()
        name = f"kvflow-pd-{spec.engine_id}"
        self.proc: BaseProcess = ctx.Process(
            target=serve, args=(spec, child), name=name, daemon=True
        )
        self.others: list[BaseProcess] = [
            ctx.Process(target=serve, args=(spec, None, r), name=f"{name}-rank{r}", daemon=True)
            for r in range(1, spec.tp)
        ]
        for p in (self.proc, *self.others):
            p.start()
        child.close()
        self.address = ""
        self.summary: dict[str, Any] = {}

    def kill(self, rank: int | None = None) -> None:
        """SIGKILL every rank's process, or only ``rank``'s."""
        procs = (self.proc, *self.others)
        for p in procs if rank is None else (procs[rank],):
            p.kill()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every rank to leave; kill what stays."""
        for p in (self.proc, *self.others):
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join(5.0)


class PDRouter:
    """Start P and D (``with PDRouter(...) as router``), send requests through them, stop both."""

    def __init__(
        self,
        *,
        model: str = "tiny",
        engine: dict[str, Any] | None = None,
        flow: str = "sequential",
        timeout_s: float = 120.0,
        pd_timeouts: PDTimeouts | None = None,
        transport: str = "gloo",
        transport_options: dict[str, Any] | None = None,
        tp: tuple[int, int] = (1, 1),
        engines: dict[str, dict[str, Any]] | None = None,
        wire_block_size: int | None = None,
        first_token: str = "decode",
        trace: Path | None = None,
    ) -> None:
        """``tp``: P's and D's TP sizes; ``engines``: per engine ("P", "D") overrides of
        ``engine`` (a block size of its own, with ``wire_block_size`` the unit both name);
        ``first_token``: who samples the first token, D (``"decode"``) or P (``"prefill"``,
        sequential flow only; see the module's docstring); ``trace``: each engine process
        writes its log events to ``trace_parts`` (``kvflow.tracing.merge_traces`` joins them)."""
        if flow not in FLOWS:
            raise ConfigError(f"PD flow {flow!r}: one of {', '.join(FLOWS)}")
        check_first_token(first_token, flow)
        if len(tp) != 2 or min(tp) < 1:
            raise ConfigError(f"PD tp must be two positive sizes (P's, D's), got {tp}")
        if max(tp) > 1 and transport != "gloo":
            raise ConfigError(f"PD with TP runs on the gloo transport, not {transport!r}")
        if set(engines or {}) - {"P", "D"}:
            raise ConfigError(
                f"PD engine overrides are for 'P' and 'D', got {sorted(engines or {})}"
            )
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        self.model = model
        self.engine = dict(engine or {})
        self.flow = flow
        self.first_token = first_token
        self.timeout_s = timeout_s
        self.pd_timeouts = pd_timeouts
        if transport not in TRANSPORTS:
            raise ConfigError(f"PD transport {transport!r}: one of {', '.join(TRANSPORTS)}")
        self.transport = transport
        self.transport_options = transport_options
        self.tp = tp
        self.engines = {k: dict(v) for k, v in (engines or {}).items()}
        self.wire_block_size = wire_block_size
        self.trace_parts: dict[str, Path] = {} if trace is None else trace_parts(trace)
        self._procs: dict[str, _Proc] = {}
        self._submitted: dict[str, float] = {}  # start_decode's requests: when sent
        self._ids = 0

    # ---- life -------------------------------------------------------------------------------

    def __enter__(self) -> PDRouter:
        ctx = mp.get_context("spawn")
        port = free_port()
        concurrent = self.flow == "concurrent"
        p_tp, d_tp = self.tp
        parts = 0
        if max(self.tp) > 1:
            parts = len(plan_head_slices(model_config(self.model).num_kv_heads, p_tp, d_tp))
        pair_ports = tuple(free_port() for _ in range(parts))
        for role, me, peer, tp, peer_tp in (
            ("producer", "P", "D", p_tp, d_tp),
            ("consumer", "D", "P", d_tp, p_tp),
        ):
            spec = WorkerSpec(
                role,
                me,
                peer,
                self.model,
                {**self.engine, **self.engines.get(me, {})},
                port,
                concurrent=concurrent,
                pd_timeouts=self.pd_timeouts,
                transport=self.transport,
                transport_options=self.transport_options,
                tp=tp,
                peer_tp=peer_tp,
                pair_ports=pair_ports,
                tp_port=free_port() if tp > 1 else 0,
                wire_block_size=self.wire_block_size,
                trace=str(self.trace_parts[me]) if self.trace_parts else None,
            )
            self._procs[me] = _Proc(ctx, spec)
        try:
            for p in self._procs.values():
                kind, p.address = self._recv(p, "the engine's start")
                if kind != "ready":
                    raise KVFlowError(f"PD engine {p.spec.engine_id} did not start: {p.address}")
        except BaseException:
            self.close(kill=True)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(kill=exc is not None)

    def close(self, *, kill: bool = False) -> None:
        """Stop both processes (their summaries land in ``summaries``); kill what overstays."""
        procs, self._procs = self._procs, {}
        # D first: its mappings of P's exported KV tensors (CUDA IPC) go with it, so P, their
        # producer, outlives them (torch warns at P's exit otherwise).
        for p in reversed(procs.values()):
            if not kill and p.proc.is_alive():
                try:
                    p.conn.send(("stop",))
                    while True:
                        msg = self._recv(p, "the engine's stop")
                        if msg[0] == "stopped":
                            p.summary = msg[1]
                            break
                except (KVFlowError, OSError, EOFError) as e:
                    log.warning("pd_engine_stop_failed", engine=p.spec.engine_id, error=str(e))
            p.join(0 if kill else 5.0)
            p.conn.close()
        self.summaries = {k: p.summary for k, p in procs.items()}

    def stats(self, engine_id: str) -> dict[str, Any]:
        """An engine's counters now (call between ``run``s: every answer is in)."""
        p = self._procs[engine_id]
        p.conn.send(("stats",))
        msg = self._recv(p, "its counters")
        if msg[0] != "stats":
            raise KVFlowError(f"PD engine {engine_id}: unexpected {msg[0]} (a run still going?)")
        stats: dict[str, Any] = msg[1]
        return stats

    def kill(self, engine_id: str, rank: int | None = None) -> None:
        """SIGKILL one engine's processes, every rank or only ``rank`` (tests of a peer's
        death)."""
        self._procs[engine_id].kill(rank)

    # ---- flows ------------------------------------------------------------------------------

    def run(self, requests: Sequence[GenerationRequest]) -> list[PDResult]:
        """Serve every request through P then D (pipelined); results in request order."""
        if not self._procs:
            raise KVFlowError("the PD router is not started (use it as a context manager)")
        P, D = self._procs["P"], self._procs["D"]
        submitted: dict[str, float] = {}
        prefills: dict[str, RequestResult] = {}
        by_rid = {}
        tids: dict[str, int] = {}
        for r in requests:
            self._ids += 1
            rid = r.request_id or f"pd-{self._ids}"
            by_rid[rid] = r
            tids[rid] = self._ids
            tid = f"{rid}@{self._ids}"
            submitted[rid] = time.perf_counter()
            params: dict[str, Any] = {"do_remote_decode": True, "transfer_id": tid}
            if self.first_token == "prefill" and r.max_tokens == 1:
                params = {}  # P's one token is the answer: nothing to hand off
            P.conn.send(("add", rid, list(r.prompt_token_ids), 1, params))
        done: dict[str, PDResult] = {}
        # first_token="prefill": P's first token, when P sampled it, and its logits, by request
        firsts: dict[str, tuple[int, float, Any]] = {}
        arrived: dict[str, float] = {}  # at P's engine (P's clock is this machine's monotonic one)

        def served(rid: str, result: RequestResult, times: Sequence[float]) -> PDResult:
            start = arrived.get(rid, submitted[rid])
            return PDResult(
                result, prefills.get(rid), times[0] - start, tuple(times), start - submitted[rid]
            )

        waiting_p = set(by_rid)
        while len(done) < len(by_rid):
            ready = mp.connection.wait([P.conn, D.conn], timeout=self.timeout_s)
            if not ready:
                raise KVFlowError(
                    f"PD router: no answer from P or D within {self.timeout_s} s "
                    f"({len(waiting_p)} prefills, {len(by_rid) - len(done)} decodes pending)"
                )
            for conn in ready:
                assert isinstance(conn, Connection)
                proc = P if conn is P.conn else D
                msg = self._recv(proc, "a result")
                if msg[0] == "accepted":
                    if len(msg) > 2:
                        arrived[msg[1]] = msg[2]
                    if self.flow == "concurrent":  # P knows the hand-off: D may claim it now
                        r = by_rid[msg[1]]
                        d_params = {
                            "do_remote_prefill": True,
                            "transfer_id": f"{msg[1]}@{tids[msg[1]]}",
                            "remote_engine_id": "P",
                            "remote_address": P.address,
                        }
                        D.conn.send(
                            ("add", msg[1], list(r.prompt_token_ids), r.max_tokens, d_params)
                        )
                    continue
                if msg[0] != "result":
                    raise KVFlowError(f"PD engine {proc.spec.engine_id}: unexpected {msg[0]}")
                _, res, arrival, times = msg
                result = _result(res)
                rid = result.request_id
                if proc is P:
                    waiting_p.discard(rid)
                    prefills[rid] = result
                    arrived.setdefault(rid, arrival)
                    if self.flow == "sequential":
                        r = by_rid[rid]
                        prompt, max_tokens = list(r.prompt_token_ids), r.max_tokens
                        if self.first_token == "prefill" and result.output_token_ids:
                            if max_tokens == 1:  # P's token was the whole answer (no hand-off)
                                done[rid] = served(rid, result, times[:1])
                                continue
                            tok = result.output_token_ids[0]
                            firsts[rid] = (tok, times[0], result.first_logits)
                            prompt, max_tokens = [*prompt, tok], max_tokens - 1
                        D.conn.send(("add", rid, prompt, max_tokens, result.kv_transfer_params))
                elif rid in firsts:
                    tok, at, first_logits = firsts.pop(rid)
                    # The first token is P's: so are its TTFT and its timeline.
                    joined = attrs.evolve(
                        result,
                        prompt_len=result.prompt_len - 1,
                        output_token_ids=(tok, *result.output_token_ids),
                        first_logits=first_logits,
                        ttft_s=prefills[rid].ttft_s,
                        timeline=prefills[rid].timeline,
                    )
                    done[rid] = served(rid, joined, (at, *times))
                else:
                    done[rid] = served(rid, result, times)
        # The concurrent flow's P answers may come after D's: collect them.
        while waiting_p:
            msg = self._recv(P, "a prefill result")
            if msg[0] == "result":
                waiting_p.discard(_result(msg[1]).request_id)
        return [done[rid] for rid in by_rid]

    def prefill(self, request: GenerationRequest) -> RequestResult:
        """The sequential flow's first half alone: P's one-token result with its params."""
        P = self._procs["P"]
        self._ids += 1
        rid = request.request_id or f"pd-{self._ids}"
        params = {"do_remote_decode": True, "transfer_id": f"{rid}@{self._ids}"}
        P.conn.send(("add", rid, list(request.prompt_token_ids), 1, params))
        while True:
            msg = self._recv(P, f"the prefill of {rid}")
            if msg[0] == "result":
                return _result(msg[1])

    def decode(self, request: GenerationRequest, params: dict[str, Any] | None) -> PDResult:
        """The second half alone: D serves ``request`` with P's ``params``."""
        return self.finish_decode(self.start_decode(request, params))

    def start_decode(self, request: GenerationRequest, params: dict[str, Any] | None) -> str:
        """Send ``request`` to D with P's ``params`` and return at once (its request id)."""
        rid = request.request_id or f"pd-{self._ids}"
        self._submitted[rid] = time.perf_counter()
        D = self._procs["D"]
        D.conn.send(("add", rid, list(request.prompt_token_ids), request.max_tokens, params))
        return rid

    def finish_decode(self, rid: str) -> PDResult:
        """D's result for a request ``start_decode`` sent (the next one D finishes)."""
        msg = self._recv(self._procs["D"], f"the decode of {rid}")
        times = msg[3]
        return PDResult(_result(msg[1]), None, times[0] - self._submitted.pop(rid), tuple(times))

    def _recv(self, p: _Proc, what: str) -> Any:
        if not p.conn.poll(self.timeout_s):
            raise KVFlowError(
                f"PD engine {p.spec.engine_id} sent nothing within {self.timeout_s} s "
                f"while the router waited for {what}"
            )
        try:
            return p.conn.recv()
        except EOFError as e:
            raise KVFlowError(
                f"PD engine {p.spec.engine_id} exited while the router waited for {what}"
            ) from e


__all__ = ["FIRST_TOKENS", "FLOWS", "PDResult", "PDRouter", "check_first_token"]
