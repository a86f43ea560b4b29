"""Tensor parallelism for the reference engine: a sharded Llama and one engine driven over ranks.

Sharding (Megatron style): q/k/v and gate/up projections are column-parallel (each rank keeps
``1/tp`` of the attention heads, q and kv heads alike, and of the MLP's intermediate features);
o_proj and down_proj are row-parallel and their partial outputs are summed over ranks
(``LlamaForCausalLM.reduce``); embeddings, norms and the LM head are replicated. A shard is cut
from the full seeded model, so tp ranks together compute the same function as one rank. Each
rank's KV cache holds its own kv heads only, so its blocks are ``1/tp`` of the full block bytes.

Driving: rank 0 runs the engine (scheduler, GPU block pool, the one scheduler-side connector).
``TPModelRunner`` sends every step (``SchedulerOutput``, ``StepBatch``, connector metadata) to the
other ranks, runs its own forward and worker connector, and gathers the other ranks' outputs: the
merged ``KVConnectorOutput`` carries every rank's ``StepReport``, so kvflow's manager commits a
store only once all ranks reported it. The other ranks run ``serve_follower``: receive a step,
execute it on their own runner and worker connector, send the output back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import attrs
import torch
from attrs import define, frozen

from kvflow.connector.api import (
    KVCacheConfig,
    KVConnectorOutput,
    NullConnector,
    SchedulerConnector,
    WorkerConnector,
)
from kvflow.connector.config import OffloadConfig
from kvflow.connector.offload import OffloadConnector, OffloadScheduler, OffloadWorker
from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.logs import get_logger
from kvflow.core.requests import SchedulerOutput
from kvflow.core.transfer import Direction
from kvflow.engine.distributed import ProcessGroupChannel, all_reduce_sum
from kvflow.engine.engine import (
    Clock,
    Engine,
    EngineConfig,
    block_bytes_per_group,
    make_kv_cache_config,
    perf_clock,
)
from kvflow.engine.model import LlamaForCausalLM, ModelConfig, build_model, model_config
from kvflow.engine.runner import LaunchedStep, ModelRunner, ModelRunnerOutput
from kvflow.engine.scheduler import StepBatch
from kvflow.errors import ConfigError, KVFlowError

log = get_logger("kvflow.engine.tp")

T = TypeVar("T")

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")


# ---- sharding -----------------------------------------------------------------------------------


def shard_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """The shape one of ``tp_size`` ranks holds: heads and MLP features divided by ``tp_size``."""
    if tp_size < 1:
        raise ConfigError(f"tp_size must be positive, got {tp_size}")
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(cfg, name) % tp_size:
            raise ConfigError(
                f"model {cfg.name}: {name} {getattr(cfg, name)} is not divisible by tp {tp_size}"
            )
    if tp_size == 1:
        return cfg
    return attrs.evolve(
        cfg,
        name=f"{cfg.name}-tp{tp_size}",
        num_heads=cfg.num_heads // tp_size,
        num_kv_heads=cfg.num_kv_heads // tp_size,
        intermediate_size=cfg.intermediate_size // tp_size,
        head_dim=cfg.head_dim,  # kept: it would otherwise be re-derived from fewer heads
    )


def _shard_of(name: str, full: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    module = name.split(".")[-2]
    if module in _COLUMN_PARALLEL:
        return full.chunk(tp_size, dim=0)[rank]
    if module in _ROW_PARALLEL:
        return full.chunk(tp_size, dim=1)[rank]
    return full


def shard_model(
    full: LlamaForCausalLM,
    rank: int,
    tp_size: int,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> LlamaForCausalLM:
    """Rank ``rank``'s shard of ``full`` (same device and dtype). ``reduce`` sums a row-parallel
    output over the ranks (default: ``all_reduce_sum`` over the default process group)."""
    if not 0 <= rank < tp_size:
        raise ConfigError(f"rank {rank} outside tensor-parallel size {tp_size}")
    cfg = shard_config(full.config, tp_size)
    ref = next(full.parameters())
    shard = LlamaForCausalLM(cfg).to(device=ref.device, dtype=ref.dtype)
    source = dict(full.named_parameters())
    with torch.no_grad():
        for name, param in shard.named_parameters():
            param.copy_(_shard_of(name, source[name], rank, tp_size))
    if tp_size > 1:
        shard.reduce = reduce if reduce is not None else all_reduce_sum
    shard.fuse()
    return shard.eval()


# ---- messages between ranks -------------------------------------------------------------------


@frozen
class StepMessage:
    """One engine step, as rank 0 sends it to the other ranks."""

    out: SchedulerOutput
    batch: StepBatch
    meta: object
    # Poison-on-free: the blocks rank 0 poisoned since the last step. The block pool lives on
    # rank 0, so the other ranks poison them on receipt, before the step, as rank 0 did before
    # launching it; a use after free on any rank then reads poison.
    freed: tuple[int, ...] = ()


@frozen
class StopMessage:
    """Rank 0 is done: answer with a ``RankStatus`` and leave the loop."""


@frozen
class RankStatus:
    """A rank's state at the end: copies still in flight, and bytes/seconds per direction."""

    rank: int
    in_flight: int
    copies: dict[Direction, tuple[int, float]]
    steps: int


def merge_outputs(outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
    """Every rank's output as one: all reports, all invalid blocks; a request is finished
    sending/receiving only when every rank says so (for connectors that leave the decision to
    the engine; kvflow's own decides from the reports)."""
    sending = outputs[0].finished_sending.intersection(*(o.finished_sending for o in outputs))
    recving = outputs[0].finished_recving.intersection(*(o.finished_recving for o in outputs))
    return KVConnectorOutput(
        finished_sending=sending,
        finished_recving=recving,
        invalid_block_ids=frozenset().union(*(o.invalid_block_ids for o in outputs)),
        reports=tuple(r for o in outputs for r in o.reports),
    )


class TPModelRunner(ModelRunner):
    """Rank 0's runner: every step runs on all ranks; their outputs are merged into one."""

    can_run_ahead = False  # its followers run whole steps, tokens read back

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_config: KVCacheConfig,
        connector: WorkerConnector,
        device: torch.device,
        *,
        channel: ProcessGroupChannel,
    ) -> None:
        if channel.rank != 0:
            raise ConfigError(f"TPModelRunner drives the ranks from rank 0, not {channel.rank}")
        super().__init__(model, kv_config, connector, device)
        self.channel = channel
        self.stopped = False
        self._freed: list[int] = []

    def poison(self, block_ids: Sequence[int]) -> None:
        super().poison(block_ids)
        self._freed.extend(block_ids)

    @property
    def unsent_freed(self) -> tuple[int, ...]:
        """Blocks rank 0 poisoned since its last step: the next step's message takes them to
        the other ranks."""
        return tuple(self._freed)

    def launch(
        self,
        out: SchedulerOutput,
        batch: StepBatch,
        connector_meta: object,
        after: LaunchedStep | None = None,
    ) -> LaunchedStep:
        if after is not None:
            raise KVFlowError("tensor-parallel steps are not scheduled ahead")
        # The ranks' outputs are compared and merged only once every rank has its tokens.
        freed, self._freed = tuple(self._freed), []
        self.channel.broadcast(StepMessage(out, batch, connector_meta, freed))
        mine = super().launch(out, batch, connector_meta)
        return LaunchedStep.finished(self._gather(out, mine))

    def _gather(self, out: SchedulerOutput, launched: LaunchedStep) -> ModelRunnerOutput:
        mine = ModelRunnerOutput(launched.tokens(), launched.kv_connector_output)
        gathered = self.channel.gather(None)
        assert gathered is not None
        peers = [o for o in gathered[1:] if isinstance(o, ModelRunnerOutput)]
        if len(peers) != self.channel.world_size - 1:
            raise KVFlowError(f"step {out.step}: a rank answered without a runner output")
        for rank, peer in enumerate(peers, start=1):
            if peer.sampled != mine.sampled:
                raise KVFlowError(
                    f"step {out.step}: rank {rank} sampled {peer.sampled}, rank 0 {mine.sampled}"
                )
        merged = merge_outputs([mine.kv_connector_output, *(p.kv_connector_output for p in peers)])
        return ModelRunnerOutput(sampled=mine.sampled, kv_connector_output=merged)

    def stop(self) -> list[RankStatus]:
        """Tell the other ranks to stop; their final statuses (rank 1 ...). Once only."""
        if self.stopped:
            return []
        self.stopped = True
        self.channel.broadcast(StopMessage())
        gathered = self.channel.gather(None)
        assert gathered is not None
        return [s for s in gathered[1:] if isinstance(s, RankStatus)]


def follow_step(runner: ModelRunner, msg: StepMessage) -> ModelRunnerOutput:
    """A rank other than 0 runs rank 0's step: the blocks rank 0 poisoned first, then the step."""
    if msg.freed:
        runner.poison(msg.freed)
    return runner.execute(msg.out, msg.batch, msg.meta)


def serve_follower(
    runner: ModelRunner, channel: ProcessGroupChannel, status: Callable[[int], RankStatus]
) -> int:
    """A rank other than 0: execute each step rank 0 sends until it says stop; steps served.
    ``status(steps)`` is this rank's answer to the stop."""
    steps = 0
    while True:
        msg = channel.receive()
        if isinstance(msg, StopMessage):
            channel.gather(status(steps))
            log.info("tp_follower_stopped", rank=channel.rank, steps=steps)
            return steps
        if not isinstance(msg, StepMessage):
            raise KVFlowError(f"rank {channel.rank}: unexpected message {type(msg).__name__}")
        channel.gather(follow_step(runner, msg))
        steps += 1


# ---- one engine over the ranks ------------------------------------------------------------------


@frozen
class TPSpec:
    """What every rank builds: the model preset (random weights from the engine's seed), the
    engine's config and, optionally, kvflow's offload connector (``world_size`` = the ranks)."""

    model: str
    engine: EngineConfig
    offload: OffloadConfig | None = None


WrapWorker = Callable[[int, WorkerConnector], WorkerConnector]
"""``(rank, worker) -> connector the runner calls``: fault injection around a rank's worker."""
WrapScheduler = Callable[[OffloadScheduler], SchedulerConnector]
"""Wraps rank 0's scheduler-side connector (auditing)."""


def _no_wrap(_rank: int, worker: WorkerConnector) -> WorkerConnector:
    return worker


def rank_engine_config(config: EngineConfig, rank: int) -> EngineConfig:
    """``config`` as rank ``rank`` runs it: a bare "cuda" device becomes that rank's own GPU."""
    if config.device == "cuda":
        return attrs.evolve(config, device=f"cuda:{rank}")
    return config


def build_shard(spec: TPSpec, rank: int, world_size: int) -> LlamaForCausalLM:
    """Rank ``rank``'s shard of ``spec``'s model, on the rank's device. A rank process that
    serves several engines in a row builds it once and hands it to each ``run_rank``."""
    cfg = model_config(spec.model)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    full = build_model(
        cfg,
        device=rank_engine_config(spec.engine, rank).device,
        dtype=None if spec.engine.dtype is None else dtypes[spec.engine.dtype],
        seed=spec.engine.seed,
        weights=spec.engine.weights,
    )
    return shard_model(full, rank, world_size)


def _offload_of(spec: TPSpec, world_size: int) -> OffloadConfig | None:
    if spec.offload is not None and spec.offload.world_size != world_size:
        raise ConfigError(
            f"offload world_size {spec.offload.world_size} differs from the {world_size} ranks"
        )
    return spec.offload


def _status(rank: int, worker: OffloadWorker | None, steps: int) -> RankStatus:
    if worker is None:
        return RankStatus(rank, 0, {}, steps)
    return RankStatus(rank, worker.runtime.runtime.in_flight, worker.copy_throughput(), steps)


@define(eq=False)
class TPEngine:
    """Rank 0's engine over all ranks, with its connector roles (None without offload)."""

    engine: Engine
    runner: TPModelRunner
    scheduler: OffloadScheduler | None
    worker: OffloadWorker | None

    @classmethod
    def build(
        cls,
        spec: TPSpec,
        channel: ProcessGroupChannel,
        *,
        wrap_worker: WrapWorker = _no_wrap,
        wrap_scheduler: WrapScheduler | None = None,
        clock: Clock = perf_clock,
        shard: LlamaForCausalLM | None = None,
    ) -> TPEngine:
        world = channel.world_size
        if shard is None:
            shard = build_shard(spec, 0, world)
        offload = _offload_of(spec, world)
        built: list[OffloadConnector] = []

        def connectors(
            kv: KVCacheConfig, view: GpuCacheView
        ) -> tuple[SchedulerConnector, WorkerConnector]:
            assert offload is not None
            dtype = next(shard.parameters()).dtype
            conn = OffloadConnector.build(
                offload,
                kv,
                block_bytes_per_group(shard.config, kv, dtype),
                gpu_view=view,
                now=clock,
            )
            built.append(conn)
            sched: SchedulerConnector = conn.scheduler
            if wrap_scheduler is not None:
                sched = wrap_scheduler(conn.scheduler)
            return sched, wrap_worker(0, conn.worker)

        runners: list[TPModelRunner] = []

        def runner(
            model: LlamaForCausalLM,
            kv: KVCacheConfig,
            conn: WorkerConnector,
            device: torch.device,
        ) -> ModelRunner:
            runners.append(TPModelRunner(model, kv, conn, device, channel=channel))
            return runners[0]

        engine = Engine(
            shard.config,
            rank_engine_config(spec.engine, 0),
            model=shard,
            clock=clock,
            connector_factory=connectors if offload is not None else None,
            runner_factory=runner,
        )
        conn = built[0] if built else None
        return cls(
            engine,
            runners[0],
            conn.scheduler if conn else None,
            conn.worker if conn else None,
        )

    def stop(self) -> list[RankStatus]:
        """Every rank's final status (rank 0 first); stops the other ranks, shuts rank 0 down."""
        mine = _status(0, self.worker, self.engine.stats.steps)
        try:
            return [mine, *self.runner.stop()]
        finally:
            self.engine.shutdown()


def _ready(worker: OffloadWorker | None, channel: ProcessGroupChannel) -> None:
    # Every rank's CPU tier is pinned before rank 0 starts the job: a tier still pinning would
    # pin on demand inside the first copies (seconds on a fresh machine) and a late rank would
    # hold back every step, all inside the job's timings.
    if worker is not None:
        worker.wait_cpu_tier()
    channel.barrier()


@frozen
class RankZeroResult(Generic[T]):
    """What rank 0 hands back from ``run_rank``: the job's value and every rank's final status."""

    value: T
    statuses: tuple[RankStatus, ...]


def run_rank(
    rank: int,
    world_size: int,
    spec: TPSpec,
    job: Callable[[TPEngine], T],
    *,
    wrap_worker: WrapWorker = _no_wrap,
    wrap_scheduler: WrapScheduler | None = None,
    shard: LlamaForCausalLM | None = None,
) -> RankZeroResult[T] | None:
    """The body of one rank in a ``launch``ed group: rank 0 builds the engine and runs
    ``job(engine)`` (stopping the others afterwards), the others serve steps until told to
    stop. Returns the job's result and the ranks' statuses on rank 0, None elsewhere.
    ``shard``: this rank's model shard (``build_shard``), built here when None."""
    channel = ProcessGroupChannel()
    if rank == 0:
        tp = TPEngine.build(
            spec, channel, wrap_worker=wrap_worker, wrap_scheduler=wrap_scheduler, shard=shard
        )
        _ready(tp.worker, channel)
        try:
            result = job(tp)
        except BaseException:
            # The other ranks may be inside a collective: no stop message; launch kills them.
            tp.engine.shutdown()
            raise
        return RankZeroResult(result, tuple(tp.stop()))
    if shard is None:
        shard = build_shard(spec, rank, world_size)
    offload = _offload_of(spec, world_size)
    engine_config = rank_engine_config(spec.engine, rank)
    kv = make_kv_cache_config(shard.config, engine_config)
    worker: OffloadWorker | None = None
    conn: WorkerConnector
    if offload is not None:
        dtype = next(shard.parameters()).dtype
        block_bytes = block_bytes_per_group(shard.config, kv, dtype)
        worker = OffloadWorker(offload, kv, offload.cpu_blocks_per_group(block_bytes), rank=rank)
        conn = wrap_worker(rank, worker)
    else:
        conn = wrap_worker(rank, NullConnector())
    try:
        runner = ModelRunner(shard, kv, conn, torch.device(engine_config.device))
        # As rank 0's Engine does, so every rank runs its heads' decode attention the same way.
        runner.configure_decode(
            engine_config.decode_graphs, engine_config.max_num_seqs, engine_config.triton_decode
        )
        _ready(worker, channel)
        serve_follower(runner, channel, lambda steps: _status(rank, worker, steps))
    finally:
        conn.shutdown()
    return None


__all__ = [
    "RankStatus",
    "RankZeroResult",
    "StepMessage",
    "StopMessage",
    "TPEngine",
    "TPModelRunner",
    "TPSpec",
    "build_shard",
    "follow_step",
    "merge_outputs",
    "rank_engine_config",
    "run_rank",
    "serve_follower",
    "shard_config",
    "shard_model",
]
