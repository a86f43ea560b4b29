"""Poison-on-free across tensor-parallel ranks: every rank poisons the blocks rank 0's pool frees."""

from __future__ import annotations

import torch

from kvflow.connector.api import KVCacheConfig, NullConnector, WorkerConnector
from kvflow.engine import Engine, EngineConfig
from kvflow.engine.distributed import ProcessGroupChannel
from kvflow.engine.model import LlamaForCausalLM, model_config
from kvflow.engine.runner import ModelRunner
from kvflow.engine.tp import RankStatus, StepMessage, TPModelRunner, follow_step
from tests.engine.helpers import prompts, requests, shared_model


class LoopbackChannel:
    """Rank 0's channel to one follower in this process: a step is run by ``follow_step`` on
    the follower's runner when rank 0 gathers (the follower holds the same unsharded model)."""

    rank = 0
    world_size = 2

    def __init__(self) -> None:
        self.follower: ModelRunner | None = None
        self.msg: object = None
        self.freed_sent: list[int] = []

    def broadcast(self, obj: object) -> None:
        self.msg = obj

    def gather(self, obj: object) -> list[object]:
        assert self.follower is not None
        if isinstance(self.msg, StepMessage):
            self.freed_sent.extend(self.msg.freed)
            return [obj, follow_step(self.follower, self.msg)]
        return [obj, RankStatus(1, 0, {}, 0)]


def _poisoned(runner: ModelRunner) -> set[int]:
    """Blocks every layer of ``runner`` holds as poison (NaN) throughout."""
    found: set[int] | None = None
    for t in runner.kv_caches.values():
        nan = torch.isnan(t).flatten(2).all(dim=2).all(dim=0)
        blocks = {int(i) for i in torch.nonzero(nan).flatten()}
        found = blocks if found is None else found & blocks
    return found or set()


def test_followers_poison_the_blocks_rank_0_frees() -> None:
    """A follower's KV cache holds poison in exactly the blocks rank 0's does, step after step."""
    channel = LoopbackChannel()
    cfg = model_config("tiny")
    runners: list[TPModelRunner] = []

    def runner(
        model: LlamaForCausalLM, kv: KVCacheConfig, conn: WorkerConnector, device: torch.device
    ) -> ModelRunner:
        chan: ProcessGroupChannel = channel  # type: ignore[assignment]
        runners.append(TPModelRunner(model, kv, conn, device, channel=chan))
        channel.follower = ModelRunner(model, kv, NullConnector(), device)
        return runners[0]

    engine = Engine(
        cfg,
        EngineConfig(block_size=4, num_gpu_blocks=24, poison_freed_blocks=True),
        model=shared_model("tiny"),
        runner_factory=runner,
    )
    follower = channel.follower
    assert follower is not None
    results = engine.run_to_completion(requests(prompts([13, 22, 9, 17]), 4))
    assert len(results) == 4
    assert channel.freed_sent, "rank 0 freed blocks but sent none to the follower"
    # Rank 0 checks every step's tokens against the follower's, so poisoning never hit a live
    # block there. The frees after the last step would go with the next one: apply them here.
    follower.poison(runners[0].unsent_freed)
    assert _poisoned(follower) == _poisoned(engine.runner)
    assert len(_poisoned(engine.runner)) > 0
