"""The engine: a scheduler and a model runner stepped together, with an optional KV connector.

``Engine.step()`` is one iteration: schedule → ``build_connector_meta`` → the runner's step (the
worker connector's calls around the forward) → ``update_from_output`` (sampled tokens, then the
connector's worker output). With async scheduling (the default on a CUDA device) the step's
output is applied in the next call, after that call has scheduled and launched its own step, so
the host's work between steps overlaps the device's. ``run_to_completion`` drives it
synchronously; ``kvflow.engine.frontend`` drives it from an event loop.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from attrs import define, field, frozen

from kvflow.connector.api import (
    KVCacheConfig,
    KVConnectorOutput,
    NullConnector,
    SchedulerConnector,
    WorkerConnector,
)
from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.hashing import ExtraKey
from kvflow.core.logs import get_logger
from kvflow.core.requests import SchedulerOutput
from kvflow.engine.block_manager import BlockManager
from kvflow.engine.kv_cache import kv_cache_groups
from kvflow.engine.model import LlamaForCausalLM, ModelConfig, build_model
from kvflow.engine.request import Request, RequestStats
from kvflow.engine.runner import LaunchedStep, ModelRunner
from kvflow.engine.scheduler import Scheduler, SchedulerConfig, StepBatch, StepOutput
from kvflow.engine.step_parts import StepParts, step_kind
from kvflow.errors import ConfigError, KVFlowError

log = get_logger("kvflow.engine")

IDLE_WAIT_S = 0.002
"""Longest an engine with nothing to compute blocks waiting for a transfer before re-checking."""
SWITCH_INTERVAL_S = 5e-4
"""The GIL switch interval of a process that runs an engine beside kvflow's threads (the copy
threads, the runtime's loop, PD's control plane): at the default 5 ms a busy engine thread holds
them off for whole milliseconds. ``kvflow bench`` and the PD engine processes set it."""

ConnectorFactory = Callable[
    [KVCacheConfig, GpuCacheView], tuple[SchedulerConnector, WorkerConnector]
]
"""Builds both connector roles once the engine's KV cache and GPU pool exist."""

RunnerFactory = Callable[
    [LlamaForCausalLM, KVCacheConfig, WorkerConnector, torch.device], ModelRunner
]
"""Builds the model runner (default ``ModelRunner``); tensor parallelism drives its peers here."""

Clock = Callable[[], float]
"""Seconds as a float; only differences matter. Injected so tests and the bench control time."""


def perf_clock() -> float:
    """The engine's default time source: ``time.perf_counter`` (the engine only reads time)."""
    return time.perf_counter()


DECODE_GRAPH_MODES = ("auto", "full", "piecewise", "pieces", "off")


@frozen
class EngineConfig:
    """How the engine runs a model. ``num_gpu_blocks`` is the one GPU pool every KV cache group
    shares, block 0 (the null block) included."""

    block_size: int = 16
    num_gpu_blocks: int = 256
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    seed: int = 0
    weights: str | None = None  # a safetensors file; default: random weights from ``seed``
    max_idle_steps: int = 1_000_000  # steps in a row without progress before giving up
    # Decode-only steps from CUDA graphs (kvflow.engine.decode_graphs): "auto" on a CUDA device
    # ("full" where the Triton kernel serves decode attention, else "piecewise"), "full" (each
    # step one graph), "piecewise" (attention between captured pieces), "pieces" (the
    # piecewise pieces uncaptured on any device: tests the path on CPU), "off".
    decode_graphs: str = "auto"
    # Decode attention by kvflow.engine.triton_decode on CUDA when Triton imports.
    triton_decode: bool = True
    # Keep each request's first-token logits (its result's ``first_logits``): for checks beyond
    # the greedy tokens; steps that sample a first token then skip the decode graphs.
    record_first_logits: bool = False
    # Poison-on-free (tests): every block that a free leaves unreferenced (and every block at
    # start) is overwritten with NaN and dropped from the prefix cache, so reading KV after
    # its free (a PD use-after-free, say) gives wrong tokens instead of passing unnoticed.
    poison_freed_blocks: bool = False
    # Time each step's parts (``Engine.step_parts``, kvflow.engine.step_parts): what a step's
    # host work and its wait for the device cost, per kind of step.
    record_step_parts: bool = False
    # Schedule and launch each step before reading the tokens of the one in flight (vLLM's
    # async scheduling): the host's work between steps (scheduling, the connector's calls,
    # building inputs) then overlaps the device's compute. A decode row whose input is the
    # token the step in flight samples takes it on the device. Steps whose requests a load
    # may still change are scheduled after that output, as without it. None: on for a CUDA
    # device whose runner can take a step ahead (not tensor parallel), off on the host, where
    # the forward runs as it is called and nothing would overlap.
    async_scheduling: bool | None = None

    def __attrs_post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.num_gpu_blocks < 2:
            raise ConfigError(f"num_gpu_blocks must be at least 2, got {self.num_gpu_blocks}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype {self.dtype!r}: one of {sorted(_DTYPES)}")
        if self.decode_graphs not in DECODE_GRAPH_MODES:
            raise ConfigError(
                f"decode_graphs {self.decode_graphs!r}: one of {', '.join(DECODE_GRAPH_MODES)}"
            )


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_kv_cache_config(model: ModelConfig, config: EngineConfig) -> KVCacheConfig:
    """The KV cache an engine of this config will have: what a connector is built from."""
    windows = [model.layer_window(i) for i in range(model.num_layers)]
    return KVCacheConfig(
        block_size=config.block_size,
        num_blocks=config.num_gpu_blocks,
        groups=kv_cache_groups(model.num_layers, windows),
        device=config.device,
    )


def block_bytes_per_group(model: ModelConfig, kv: KVCacheConfig, dtype: torch.dtype) -> list[int]:
    """Bytes of one block of each KV cache group over all its layers (K and V): what a
    connector's CPU tier holds per block. A tensor-parallel shard's config gives its share."""
    item = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * kv.block_size * model.num_kv_heads * model.head_dim * item
    return [per_layer * len(g.layer_names) for g in kv.groups]


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@frozen
class GenerationRequest:
    """A prompt to complete, as ``run_to_completion`` takes it."""

    prompt_token_ids: tuple[int, ...] = field(converter=_int_tuple)
    max_tokens: int
    request_id: str | None = None
    extra_keys: tuple[ExtraKey, ...] = ()


@frozen
class RequestTimeline:
    """Where a request's time to first token went, in seconds; the parts sum to its TTFT.

    ``queue``: arrival until it was given GPU blocks; ``match``: the connector's
    ``get_num_new_matched_tokens`` at that admission (inside ``queue``'s end, not added);
    ``load_launch``: blocks given until the step carrying its async load launched it;
    ``load_copy``: launched until its copies landed on the device; ``load_seen``: landed until
    the scheduler took the finished load; ``to_compute``: until a step that computes its tokens
    was scheduled; ``prefill``: its chunks before the last; ``first_step``: the step that
    sampled its first token, from its schedule to the token. ``dated``: whether the connector
    said when the load landed (else ``load_copy`` runs until it was seen, ``load_seen`` is 0).
    """

    queue: float
    match: float
    load_launch: float
    load_copy: float
    load_seen: float
    to_compute: float
    prefill: float
    first_step: float
    dated: bool = False

    @classmethod
    def of(cls, st: RequestStats) -> RequestTimeline:
        assert st.first_token_time is not None
        admitted = st.arrival_time if st.admitted_time is None else st.admitted_time
        launched = admitted if st.load_launched_time is None else st.load_launched_time
        seen = launched if st.load_seen_time is None else st.load_seen_time
        landed = seen if st.load_landed_time is None else st.load_landed_time
        # The workers' clock may read a few µs apart from the engine's: held inside the wait.
        landed = min(max(landed, launched), seen)
        start = seen if st.compute_start_time is None else st.compute_start_time
        last = start if st.first_token_step_time is None else st.first_token_step_time
        return cls(
            queue=admitted - st.arrival_time,
            match=st.match_s,
            load_launch=launched - admitted,
            load_copy=landed - launched,
            load_seen=seen - landed,
            to_compute=start - seen,
            prefill=last - start,
            first_step=st.first_token_time - last,
            dated=st.load_landed_time is not None and st.load_seen_time is not None,
        )


@frozen
class _Launched:
    """A launched step, its output not yet applied: what ``Engine._apply`` needs."""

    out: SchedulerOutput
    batch: StepBatch
    run: LaunchedStep
    kv_output: KVConnectorOutput  # as ``update_connector_output`` decided it


@frozen
class RequestResult:
    """A finished request: its tokens and what it cost."""

    request_id: str
    prompt_len: int
    output_token_ids: tuple[int, ...]
    ttft_s: float
    e2e_s: float
    prefill_tokens_computed: int
    gpu_cached_tokens: int
    external_loaded_tokens: int
    recomputed_tokens: int
    num_preemptions: int
    kv_transfer_params: dict[str, object] | None = None  # what the connector returned (PD: P's)
    timeline: RequestTimeline | None = None
    # float32 logits of the first token, on the host, when the engine records them
    # (``EngineConfig.record_first_logits``).
    first_logits: torch.Tensor | None = None


@define
class EngineStats:
    """Counters over the engine's life."""

    steps: int = 0
    forward_steps: int = 0
    tokens_computed: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens_computed: int = 0
    gpu_cached_tokens: int = 0
    external_loaded_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    steps_ahead: int = 0  # async scheduling: steps scheduled before the last one's output


class Engine:
    """A small paged-KV Llama engine; kvflow's reference client.

    ``scheduler_connector`` and ``worker_connector`` are the two roles of a KV connector built
    for ``make_kv_cache_config(model_config, config)`` (default: ``NullConnector``).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig | None = None,
        *,
        scheduler_connector: SchedulerConnector | None = None,
        worker_connector: WorkerConnector | None = None,
        connector_factory: ConnectorFactory | None = None,
        clock: Clock = perf_clock,
        model: LlamaForCausalLM | None = None,
        runner_factory: RunnerFactory = ModelRunner,
    ) -> None:
        self.model_config = model_config
        self.config = config = config or EngineConfig()
        self.clock = clock
        self.device = torch.device(config.device)
        if model is None:
            model = build_model(
                model_config,
                device=self.device,
                dtype=None if config.dtype is None else _DTYPES[config.dtype],
                seed=config.seed,
                weights=config.weights,
            )
        elif model.config != model_config:
            raise ConfigError("the model given was built for another ModelConfig")
        self.model = model
        self.kv_cache_config = make_kv_cache_config(model_config, config)
        self.blocks = BlockManager(
            self.kv_cache_config, enable_prefix_caching=config.enable_prefix_caching
        )
        if connector_factory is not None:
            if scheduler_connector is not None or worker_connector is not None:
                raise ConfigError("give either connector_factory or the two connector roles")
            scheduler_connector, worker_connector = connector_factory(
                self.kv_cache_config, self.blocks.gpu_view()
            )
        null = NullConnector()
        self.scheduler_connector: SchedulerConnector = scheduler_connector or null
        self.worker_connector: WorkerConnector = worker_connector or null
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.blocks,
            self.scheduler_connector,
            clock,
        )
        self.runner = runner_factory(
            self.model, self.kv_cache_config, self.worker_connector, self.device
        )
        self.runner.configure_decode(
            config.decode_graphs,
            config.max_num_seqs,
            config.triton_decode,
            max_tokens=config.max_num_batched_tokens,
        )
        if config.async_scheduling and not self.runner.can_run_ahead:
            raise ConfigError(
                f"async_scheduling: {type(self.runner).__name__} cannot launch a step ahead of "
                "the one in flight"
            )
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.device.type == "cuda" and self.runner.can_run_ahead
        )
        """Whether steps are scheduled ahead (``EngineConfig.async_scheduling`` resolved)."""
        if config.record_first_logits:
            self.runner.record_first_logits = True
        if isinstance(self.runner, ModelRunner):
            self.runner.now = clock
        self._first_logits: dict[str, torch.Tensor] = {}
        if config.poison_freed_blocks:
            self.blocks.on_freed = self.runner.poison
            self.runner.poison(list(range(1, self.kv_cache_config.num_blocks)))
        self.stats = EngineStats()
        self.step_parts: list[StepParts] = []
        """Each step's parts, with ``EngineConfig.record_step_parts``."""
        self._ids = itertools.count()
        self._finished: dict[str, Request] = {}
        self._idle_steps = 0
        self._inflight: _Launched | None = None  # async scheduling: the step not applied yet

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        return self.runner.kv_caches

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        extra_keys: tuple[ExtraKey, ...] = (),
        kv_transfer_params: dict[str, object] | None = None,
    ) -> str:
        """Queue a request; returns its id. Token ids must be in the model's vocabulary.
        ``kv_transfer_params`` are the connector's (PD: ``do_remote_decode`` on P, P's returned
        params on D)."""
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(
            request_id=rid,
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=max_tokens,
            stats=RequestStats(arrival_time=self.clock()),
            extra_keys=extra_keys,
            block_size=self.config.block_size,
            kv_transfer_params=None if kv_transfer_params is None else dict(kv_transfer_params),
        )
        self.scheduler.add_request(req)
        return rid

    def abort_request(self, request_id: str) -> bool:
        """Stop a request in any state (its result is never produced); False if it already
        finished or is unknown. Blocks a connector still reads (a hand-off draining) are held
        until the connector names the request in ``finished_sending``."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """Requests left, a step in flight, or transfers the connector still waits on (stores
        after the last request): stepping on lets them report, so their blocks are committed,
        not lost."""
        return (
            self._inflight is not None
            or self.scheduler.has_unfinished()
            or self.scheduler_connector.has_pending_push_work()
        )

    # ---- stepping ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One engine iteration; returns the tokens it produced. With
        ``EngineConfig.async_scheduling`` the step launched here stays in flight: its tokens
        come with the next call, which schedules and launches its own step first (ahead of
        this one's output) unless a load could still change this one's requests."""
        sched = self.scheduler
        began = self.clock()
        outputs: list[StepOutput] = []
        waited = applied = 0.0
        prev, self._inflight = self._inflight, None
        if prev is not None and sched.loads_unsettled(prev.batch, prev.kv_output):
            # What a load brings (loaded KV, a finished load, failed blocks to roll back) must
            # reach the scheduler before it schedules again.
            t0 = self.clock()
            outputs, waited = self._apply(prev)
            applied = self.clock() - t0 - waited
            prev = None
        t1 = self.clock()
        before = t1 - began - waited - applied  # the step's own time before ``schedule``
        out, batch = sched.schedule()
        scheduled = self.clock()
        meta = self.scheduler_connector.build_connector_meta(out)
        built = self.clock()
        if prev is not None:
            self.stats.steps_ahead += 1
        run = self.runner.launch(out, batch, meta, after=None if prev is None else prev.run)
        launched = self.clock()
        if sched.loads_issued:
            loads_at = run.loads_launched_at or launched
            for req in sched.loads_issued:
                req.stats.date_load(launched=loads_at)
        # While the device computes the step: the host would otherwise idle in tokens().
        kv_output = sched.update_connector_output(run.kv_connector_output)
        told = self.clock()
        requests = sched.requests
        for c in batch.chunks:
            st = requests[c.request_id].stats
            if st.compute_start_time is None:
                st.compute_start_time = scheduled
            if c.first_token:
                st.first_token_step_time = scheduled
        current = _Launched(out, batch, run, kv_output)
        if prev is not None:
            got, w = self._apply(prev)
            outputs += got
            waited += w
            applied += self.clock() - told - w
        t2 = self.clock()
        if self.async_scheduling and batch.chunks:
            self._inflight = current
        else:
            got, w = self._apply(current)
            outputs += got
            waited += w
            applied += self.clock() - t2 - w
        self.stats.steps += 1
        self.stats.preemptions = sched.num_preemptions
        # Waiting on the network is progress: every hand-off has its own deadlines.
        progressed = (
            bool(batch.chunks)
            or bool(outputs)
            or not run.kv_connector_output.is_empty
            or not kv_output.is_empty
            or self.scheduler_connector.has_pending_push_work()
        )
        news = (
            kv_output.finished_recving or kv_output.finished_sending or kv_output.invalid_block_ids
        )
        idle_from = self.clock()
        if not batch.chunks and not outputs and not news and self.has_unfinished():
            # Nothing to compute: everyone waits on a transfer (a load, or the stores left after
            # the last request). Block briefly for it rather than spin empty steps that starve
            # the copy threads of the GIL. Not when this step's output named finished
            # transfers: the next step can use them at once (admit a loaded request, reuse
            # freed blocks), and blocking here would hold them up to IDLE_WAIT_S for nothing.
            # (Workers' reports alone are no news: a connector may pass them on every step.)
            self.worker_connector.wait_for_progress(IDLE_WAIT_S)
        if self.config.record_step_parts:
            self.step_parts.append(
                StepParts(
                    step_kind(len(c.token_ids) for c in batch.chunks),
                    batch.num_tokens if batch.chunks else 0,
                    began,
                    (
                        scheduled - t1 + before,
                        built - scheduled,
                        launched - built,
                        told - launched,
                        waited,
                        applied,
                        self.clock() - idle_from,
                    ),
                )
            )
        self._idle_steps = 0 if progressed else self._idle_steps + 1
        if self._idle_steps > self.config.max_idle_steps:
            raise KVFlowError(
                f"engine made no progress for {self._idle_steps} steps with "
                f"{len(sched.requests)} requests unfinished (a connector never reported?)"
            )
        return outputs

    def _apply(self, launched: _Launched) -> tuple[list[StepOutput], float]:
        """Wait for a launched step's tokens and apply its output; the outputs and the seconds
        spent waiting for the tokens."""
        sched = self.scheduler
        t0 = self.clock()
        tokens = launched.run.tokens()
        waited = self.clock() - t0
        batch = launched.batch
        alive = {
            c.request_id: req
            for c in batch.chunks
            if (req := sched.requests.get(c.request_id)) is not None
        }
        outputs = sched.update_from_output(launched.out, batch, tokens, launched.kv_output)
        if self.config.record_first_logits:
            self._first_logits.update(launched.run.first_logits)
        if batch.chunks:
            self.stats.forward_steps += 1
            self.stats.tokens_computed += batch.num_tokens
        for o in outputs:
            if o.finished:
                self._finished[o.request_id] = alive[o.request_id]
        return outputs, waited

    def take_result(self, request_id: str) -> RequestResult:
        """The result of a finished request (each can be taken once)."""
        req = self._finished.pop(request_id)
        st = req.stats
        assert st.first_token_time is not None
        assert st.finish_time is not None
        s = self.stats
        s.requests_finished += 1
        s.prefill_tokens_computed += st.prefill_tokens_computed
        s.decode_tokens_computed += st.decode_tokens_computed
        s.gpu_cached_tokens += st.gpu_cached_tokens
        s.external_loaded_tokens += st.external_loaded_tokens
        s.recomputed_tokens += st.recomputed_tokens
        return RequestResult(
            request_id=req.request_id,
            prompt_len=req.num_prompt_tokens,
            output_token_ids=tuple(req.output_token_ids),
            ttft_s=st.first_token_time - st.arrival_time,
            e2e_s=st.finish_time - st.arrival_time,
            prefill_tokens_computed=st.prefill_tokens_computed,
            gpu_cached_tokens=st.gpu_cached_tokens,
            external_loaded_tokens=st.external_loaded_tokens,
            recomputed_tokens=st.recomputed_tokens,
            num_preemptions=st.num_preemptions,
            kv_transfer_params=req.kv_transfer_params,
            timeline=RequestTimeline.of(st),
            first_logits=self._first_logits.pop(request_id, None),
        )

    def run_to_completion(self, requests: Sequence[GenerationRequest]) -> list[RequestResult]:
        """Submit every request at once, step until all (and their transfers) are done."""
        ids = [
            self.add_request(
                r.prompt_token_ids, r.max_tokens, request_id=r.request_id, extra_keys=r.extra_keys
            )
            for r in requests
        ]
        while self.has_unfinished():
            self.step()
        return [self.take_result(rid) for rid in ids]

    def reset_prefix_cache(self) -> bool:
        """Forget the GPU prefix cache and the connector's; refuses while requests hold blocks."""
        return self.scheduler.reset_prefix_cache() and self.scheduler_connector.reset_cache()

    def shutdown(self) -> None:
        self.worker_connector.shutdown()


__all__ = [
    "Clock",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "GenerationRequest",
    "RequestResult",
    "RequestTimeline",
    "RunnerFactory",
    "block_bytes_per_group",
    "make_kv_cache_config",
    "perf_clock",
]
