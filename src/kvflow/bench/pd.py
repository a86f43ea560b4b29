"""``kvflow bench --pd``: the multi-round QA workload through a PD pair (one P and one D engine
process; gloo, NIXL or CUDA IPC data plane, ``--pd-transport``; zmq control plane) against one
colocated engine.

Both sides run the same workload round by round (each answer joins its user's history) on the
same model weights (the engines' ``seed``) and the same GPU pool size; outputs are greedy, so
in float32 ``outputs_identical`` must hold. In half precision the engines' kernels depend on
batch composition (P prefills in other batches than the colocated engine), so there the PD run
replays the colocated run's answers (the same prompts every round) and each request's
first-token logits must be within ``LOGITS_TOLERANCE`` of the colocated engine's where its
tokens differ (``check``). TTFT runs from a request's arrival at the engine that serves it
first (P's for PD, the colocated engine's) to its first token: D's, or P's with
``first_token="prefill"`` (P's sampled token rides along to D, the hand-off then lies before the
second token, ``second_token_p50_s``). The router's send to P is reported apart
(``delivery_p50_s``). ITL is every gap between a request's consecutive tokens.
"""

from __future__ import annotations

import itertools
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from attrs import asdict, evolve, field, frozen

from kvflow.backends.pd.registry import TRANSPORTS
from kvflow.bench.config import BenchConfig
from kvflow.bench.multi_round import (
    PHASES,
    CorrectnessCheck,
    check_outputs,
    gpu_blocks_for,
    workload_of,
)
from kvflow.engine.engine import (
    Engine,
    EngineConfig,
    GenerationRequest,
    RequestTimeline,
    make_kv_cache_config,
)
from kvflow.engine.model import model_config
from kvflow.engine.tp import shard_config
from kvflow.engine.workload import MultiRoundQA
from kvflow.errors import ConfigError
from kvflow.pd.router import FLOWS, PDRouter, check_first_token, trace_parts
from kvflow.runtime.clock import SystemClock
from kvflow.tracing import merge_traces, trace_to


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 < q < 100) of ``values``; 0 for none."""
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(sorted(values), n=100, method="inclusive")[round(q) - 1]


@frozen
class SideFigures:
    """One side's figures (``pd`` or ``colocated``)."""

    ttft_p50_s: float
    ttft_p90_s: float
    itl_p50_s: float
    itl_p99_s: float
    prompt_tokens_computed: int  # on D for PD; the colocated engine's own
    wall_s: float
    # submit → the second token: where the hand-off lands when P samples the first token
    second_token_p50_s: float = 0.0
    # Means of the TTFT's parts on the engine that sampled the first token (``PHASES``), and
    # ``outside``: the rest of the TTFT (its admission checks, its step's tail after sampling,
    # and when D samples, P's whole part and the hops to D); the parts sum to the mean TTFT.
    ttft_parts_mean_s: dict[str, float] = field(factory=dict)
    ttfts_s: tuple[float, ...] = ()  # every request's, round by round (users within a round)

    @classmethod
    def of(
        cls,
        ttfts: list[float],
        itls: list[float],
        computed: int,
        wall_s: float,
        seconds: Sequence[float] = (),
        timelines: Sequence[RequestTimeline | None] = (),
    ) -> SideFigures:
        return cls(
            percentile(ttfts, 50),
            percentile(ttfts, 90),
            percentile(itls, 50),
            percentile(itls, 99),
            computed,
            wall_s,
            percentile(list(seconds), 50),
            ttft_parts(ttfts, timelines),
            tuple(ttfts),
        )


def ttft_parts(
    ttfts: Sequence[float], timelines: Sequence[RequestTimeline | None]
) -> dict[str, float]:
    """Each ``PHASES`` part's mean over the requests with a timeline, and ``outside``, the
    mean of the rest of their TTFTs; {} when none has one."""
    pairs = [(t, tl) for t, tl in zip(ttfts, timelines, strict=True) if tl is not None]
    if not pairs:
        return {}
    parts = {p: statistics.fmean(getattr(tl, p) for _, tl in pairs) for p in PHASES}
    within = [sum(getattr(tl, p) for p in PHASES if p != "match") for _, tl in pairs]
    parts["outside"] = statistics.fmean(t - w for (t, _), w in zip(pairs, within, strict=True))
    return parts


@frozen
class PDBenchResult:
    config: BenchConfig
    flow: str
    requests: int
    pd: SideFigures
    colocated: SideFigures
    outputs_identical: bool
    decode_prompt_tokens_computed: int
    prefill_prompt_tokens_computed: int
    bytes_moved: int
    send_gbps: float
    leaked_blocks: int
    handoffs_ok: int
    handoffs_failed: int
    decode_preemptions: int  # D's: a preempted request recomputes past its prefix-cache hit
    colocated_preemptions: int
    num_gpu_blocks: int
    transport: str = "gloo"
    transport_stats: dict[str, dict[str, Any]] = field(factory=dict)
    tp: tuple[int, int] = (1, 1)  # P's and D's TP sizes
    check: CorrectnessCheck | None = None  # None: tokens only (outputs_identical)
    first_token: str = "decode"  # who sampled the first token: D, or P (it rode along to D)
    # The router's send → the request's arrival at P's engine: outside the TTFT, as a colocated
    # engine's TTFT starts at the request's arrival too.
    delivery_p50_s: float = 0.0

    @property
    def passed(self) -> bool:
        """The outputs passed their check and nothing leaked."""
        ok = self.outputs_identical if self.check is None else self.check.passed
        return ok and self.leaked_blocks == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "outputs_identical": self.outputs_identical,
            "check": None if self.check is None else asdict(self.check),
            "requests": self.requests,
            "decode_prompt_tokens_computed": self.decode_prompt_tokens_computed,
            "prefill_prompt_tokens_computed": self.prefill_prompt_tokens_computed,
            "leaked_blocks": self.leaked_blocks,
            "bytes_moved": self.bytes_moved,
            "send_gbps": self.send_gbps,
            "transport": self.transport,
            "transport_stats": self.transport_stats,
            "flow": self.flow,
            "first_token": self.first_token,
            "delivery_p50_s": self.delivery_p50_s,
            "tp": list(self.tp),
            "handoffs_ok": self.handoffs_ok,
            "handoffs_failed": self.handoffs_failed,
            "decode_preemptions": self.decode_preemptions,
            "colocated_preemptions": self.colocated_preemptions,
            "pd": asdict(self.pd),
            "colocated": asdict(self.colocated),
            "num_gpu_blocks": self.num_gpu_blocks,
            "config": asdict(self.config),
            "device": self.config.device,
            "machine": platform.node() or platform.machine(),
        }


Outputs = dict[tuple[int, int], tuple[int, ...]]
Served = tuple[tuple[int, ...], float, list[float], int, Any, RequestTimeline | None]


def _rounds(
    workload: MultiRoundQA,
    serve: Callable[[list[GenerationRequest]], list[Served]],
    on_round: Callable[[int], None],
    *,
    answers: Outputs | None = None,
    logits: dict[tuple[int, int], Any] | None = None,
) -> tuple[
    Outputs, list[float], list[float], int, float, list[float], list[RequestTimeline | None]
]:
    """Run the workload through ``serve`` (tokens, TTFT, token times, prompt tokens computed,
    first-token logits, kept in ``logits``, the first token's timeline); ``answers`` join the
    histories instead of the served ones. Returns the outputs, TTFTs, inter-token gaps, prompt
    tokens computed, wall seconds, each request's submit → second token seconds and the
    timelines."""
    start = time.perf_counter()
    histories = [list(workload.system_prompt()) for _ in range(workload.num_users)]
    outputs: Outputs = {}
    ttfts: list[float] = []
    itls: list[float] = []
    seconds: list[float] = []
    timelines: list[RequestTimeline | None] = []
    computed = 0
    for rnd in range(workload.num_rounds):
        reqs = []
        for user in range(workload.num_users):
            histories[user] += workload.question(user, rnd)
            reqs.append(GenerationRequest(histories[user], workload.answer_len, f"u{user}-r{rnd}"))
        for user, (tokens, ttft, times, n, first, timeline) in enumerate(serve(reqs)):
            outputs[(user, rnd)] = tokens
            if logits is not None:
                logits[(user, rnd)] = first
            histories[user] += list(tokens if answers is None else answers[(user, rnd)])
            ttfts.append(ttft)
            timelines.append(timeline)
            itls += [b - a for a, b in itertools.pairwise(times)]
            if len(times) > 1:
                seconds.append(ttft + times[1] - times[0])
            computed += n
        on_round(rnd)
    return outputs, ttfts, itls, computed, time.perf_counter() - start, seconds, timelines


def _colocated(engine: Engine) -> Callable[[list[GenerationRequest]], list[Any]]:
    """Serve on the colocated engine. TTFT is stamped where the PD engine's worker stamps it:
    from just before ``add_request`` to the return of the step that sampled the first token
    (when a server could send it), not the engine's own ``ttft_s`` (to sampling)."""

    def serve(reqs: list[GenerationRequest]) -> list[Any]:
        times: dict[str, list[float]] = {}
        arrivals: dict[str, float] = {}
        for r in reqs:
            assert r.request_id is not None
            arrivals[r.request_id] = time.perf_counter()
            engine.add_request(r.prompt_token_ids, r.max_tokens, request_id=r.request_id)
            times[r.request_id] = []
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                times[o.request_id].append(now)
        out = []
        for r in reqs:
            assert r.request_id is not None
            res = engine.take_result(r.request_id)
            first = None if res.first_logits is None else res.first_logits.float().cpu()
            out.append(
                (
                    res.output_token_ids,
                    times[r.request_id][0] - arrivals[r.request_id],
                    times[r.request_id],
                    res.prefill_tokens_computed,
                    first,
                    res.timeline,
                )
            )
        return out

    return serve


def _through(
    router: PDRouter, delivered: list[float] | None = None
) -> Callable[[list[GenerationRequest]], list[Any]]:
    """Serve through P and D; each request's router → P delivery time onto ``delivered``."""

    def serve(reqs: list[GenerationRequest]) -> list[Any]:
        got = router.run(reqs)
        if delivered is not None:
            delivered.extend(g.delivered_s for g in got)
        return [
            (
                g.result.output_token_ids,
                g.ttft_s,
                list(g.token_times),
                g.result.prefill_tokens_computed,
                g.result.first_logits,
                g.result.timeline,
            )
            for g in got
        ]

    return serve


def check_pd_transport(transport: str, device: str) -> None:
    """``ConfigError`` for a transport that cannot serve engines on ``device``."""
    if transport not in TRANSPORTS:
        raise ConfigError(f"--pd-transport {transport!r}: one of {', '.join(TRANSPORTS)}")
    if transport == "gloo" and device != "cpu":
        raise ConfigError(f"--pd-transport gloo moves CPU tensors: use --device cpu, not {device}")
    if transport == "cuda-ipc" and not device.startswith("cuda"):
        raise ConfigError("--pd-transport cuda-ipc joins two processes on one GPU: --device cuda")
    if transport == "nixl":
        from kvflow.backends.pd.nixl import load_nixl

        if load_nixl()[0] is None:
            raise ConfigError("--pd-transport nixl needs NIXL: pip install 'kvflow[nixl]'")


def run_pd_bench(
    cfg: BenchConfig,
    *,
    flow: str = "sequential",
    transport: str = "gloo",
    tp: tuple[int, int] = (1, 1),
    first_token: str = "decode",
    on_round: Callable[[str, int], None] = lambda _name, _round: None,
    trace: Path | None = None,
) -> PDBenchResult:
    """The workload on one colocated engine, then through P and D over ``transport``, P and D
    of ``tp`` ranks each; ``first_token``: D samples it, or P (``"prefill"``: the router's
    sampled-token option, sequential flow); ``trace``: every log event of this process (the
    colocated engine, the router) and of P's and D's, in one JSON-lines file in time order,
    each with its ``process`` (main, P, D)."""
    if trace is None:
        return _run_pd_bench(cfg, flow, transport, tp, first_token, on_round, None)
    main = trace.with_name(f"{trace.name}.main")
    try:
        with trace_to(main, SystemClock().now):
            return _run_pd_bench(cfg, flow, transport, tp, first_token, on_round, trace)
    finally:
        merge_traces(trace, {"main": main, **trace_parts(trace)})


def _run_pd_bench(
    cfg: BenchConfig,
    flow: str,
    transport: str,
    tp: tuple[int, int],
    first_token: str,
    on_round: Callable[[str, int], None],
    trace: Path | None,
) -> PDBenchResult:
    if flow not in FLOWS:
        raise ConfigError(f"--pd-flow {flow!r}: one of {', '.join(FLOWS)}")
    check_first_token(first_token, flow)  # before the colocated run
    check_pd_transport(transport, cfg.device)
    model_cfg = model_config(cfg.model)
    for size in tp:
        shard_config(model_cfg, size)  # ConfigError naming what the size does not divide
    workload = workload_of(cfg, model_cfg)
    probe = make_kv_cache_config(model_cfg, EngineConfig(block_size=cfg.block_size))
    if any(g.sliding_window is not None for g in probe.groups):
        raise ConfigError(f"--pd: model {cfg.model!r} has sliding-window layers, not supported yet")
    num_blocks = gpu_blocks_for(cfg, workload, len(probe.groups))
    engine_kwargs: dict[str, Any] = {
        "block_size": cfg.block_size,
        "num_gpu_blocks": num_blocks,
        "max_num_batched_tokens": cfg.max_batched_tokens,
        "seed": cfg.seed,
        "dtype": cfg.dtype,
        "device": cfg.device,
    }
    half = cfg.resolved_dtype != "float32"
    if half:
        engine_kwargs["record_first_logits"] = True
    colocated = Engine(model_cfg, EngineConfig(**engine_kwargs))
    # Untimed first-call costs (kernels and graphs per shape, allocations) at the timed prompts'
    # shapes: a full prefill and a prefix-hit round, other tokens. Each engine is its own
    # process, so each pays them itself; a tiny warm-up left them to the first timed round.
    warm = evolve(workload, num_rounds=min(2, workload.num_rounds), seed=workload.seed + 1)
    _rounds(warm, _colocated(colocated), lambda _r: None)
    colocated.reset_prefix_cache()
    warm_preemptions = colocated.scheduler.num_preemptions
    ref_logits: dict[tuple[int, int], Any] = {}
    ref = _rounds(
        workload, _colocated(colocated), lambda r: on_round("colocated", r), logits=ref_logits
    )
    colocated_preemptions = colocated.scheduler.num_preemptions - warm_preemptions
    colocated.shutdown()
    # The check's first-token logits are those of the engine that samples the first token;
    # the other records none (P's would travel the router's pipe for nothing).
    unused = "D" if first_token == "prefill" else "P"
    engines = {unused: {"record_first_logits": False}}
    with PDRouter(
        model=cfg.model,
        engine=engine_kwargs,
        flow=flow,
        transport=transport,
        tp=tp,
        first_token=first_token,
        engines=engines,
        trace=trace,
    ) as router:
        _rounds(warm, _through(router), lambda _r: None)
        p0, d0 = router.stats("P"), router.stats("D")
        got_logits: dict[tuple[int, int], Any] = {}
        delivered: list[float] = []
        got = _rounds(
            workload,
            _through(router, delivered),
            lambda r: on_round("P → D", r),
            answers=ref[0] if half else None,
            logits=got_logits,
        )
    p, d = router.summaries["P"], router.summaries["D"]
    seconds = float(p["send_seconds"]) - float(p0["send_seconds"])
    moved = int(p["bytes_moved"]) - int(p0["bytes_moved"])
    return PDBenchResult(
        config=cfg,
        flow=flow,
        requests=workload.num_users * workload.num_rounds,
        pd=SideFigures.of(got[1], got[2], got[3], got[4], got[5], got[6]),
        colocated=SideFigures.of(ref[1], ref[2], ref[3], ref[4], ref[5], ref[6]),
        outputs_identical=got[0] == ref[0],
        decode_prompt_tokens_computed=got[3],
        prefill_prompt_tokens_computed=int(p["prefill_tokens_computed"])
        - int(p0["prefill_tokens_computed"]),
        bytes_moved=moved,
        send_gbps=moved / seconds / 1e9 if seconds > 0 else 0.0,
        leaked_blocks=int(p["leaked_blocks"]) + int(d["leaked_blocks"]),
        handoffs_ok=int(d["handoffs_ok"]) - int(d0["handoffs_ok"]),
        handoffs_failed=int(d["handoffs_failed"]) - int(d0["handoffs_failed"]),
        decode_preemptions=int(d["preemptions"]) - int(d0["preemptions"]),
        colocated_preemptions=colocated_preemptions,
        num_gpu_blocks=num_blocks,
        transport=transport,
        transport_stats={side: dict(router.summaries[side].get("transport", {})) for side in "PD"},
        tp=tp,
        first_token=first_token,
        delivery_p50_s=percentile(delivered, 50),
        check=check_outputs(
            [
                (f"u{k[0]}-r{k[1]}", got[0][k], ref[0][k], got_logits[k], ref_logits[k])
                for k in sorted(ref[0])
            ],
            f"colocated engine, the same prompts ({cfg.resolved_dtype}: its answers replayed)",
        )
        if half
        else None,
    )


__all__ = ["PDBenchResult", "SideFigures", "check_pd_transport", "percentile", "run_pd_bench"]
