"""Async scheduling: each step is scheduled and launched before the tokens of the one in flight
are read; its pending tokens come from that step on the device, and loads fall back to waiting."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from kvflow.connector.api import KVCacheConfig, WorkerConnector
from kvflow.engine.engine import Engine, EngineConfig, GenerationRequest, make_kv_cache_config
from kvflow.engine.model import LlamaForCausalLM, model_config
from kvflow.engine.runner import ModelRunner
from kvflow.engine.scheduler import PENDING_TOKEN, StepBatch
from kvflow.errors import ConfigError
from tests.engine.fake_connector import FakeConnector
from tests.engine.helpers import make_engine, prompts, requests, shared_model


def _outputs(engine: Engine, reqs: list[GenerationRequest]) -> list[tuple[int, ...]]:
    return [r.output_token_ids for r in engine.run_to_completion(reqs)]


def _launches(engine: Engine) -> list[tuple[StepBatch, bool]]:
    """Record every launched batch, and whether a step was in flight when it was scheduled."""
    seen: list[tuple[StepBatch, bool]] = []
    launch = engine.runner.launch

    def spy(out: Any, batch: StepBatch, meta: object, after: Any = None) -> Any:
        seen.append((batch, after is not None))
        return launch(out, batch, meta, after=after)

    engine.runner.launch = spy  # type: ignore[method-assign,assignment]
    return seen


def _loads_at_launch(engine: Engine) -> list[tuple[bool, bool]]:
    """Per launch: whether it was scheduled ahead, and whether a load was unsettled then (one
    in flight, or KV loaded into the launched step's requests)."""
    seen: list[tuple[bool, bool]] = []
    launch = engine.runner.launch
    sched = engine.scheduler

    def spy(out: Any, batch: StepBatch, meta: object, after: Any = None) -> Any:
        launched = launch(out, batch, meta, after=after)
        seen.append((after is not None, sched.loads_unsettled(batch, launched.kv_connector_output)))
        return launched

    engine.runner.launch = spy  # type: ignore[method-assign,assignment]
    return seen


def test_a_step_returns_the_tokens_of_the_step_launched_before_it() -> None:
    """The first step returns nothing, each later one the tokens of the step before; a decode
    scheduled ahead carries the pending token, and the tokens equal the synchronous engine's."""
    (p,) = prompts([9])
    want = _outputs(make_engine(), requests([p], 3))
    engine = make_engine(async_scheduling=True)
    seen = _launches(engine)
    engine.add_request(p, 3, request_id="r0")
    assert engine.step() == []  # the prompt's step is in flight
    assert engine.has_unfinished()
    first = engine.step()  # launches the first decode ahead, then reads the prompt's token
    assert [o.new_token_ids for o in first] == [want[0][:1]]
    tokens = list(first[0].new_token_ids)
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tuple(tokens) == want[0]
    decodes = [batch for batch, ahead in seen if ahead and batch.chunks]
    assert len(decodes) == 2  # the third token, sampled by the second, ends the request
    assert all(b.chunks[0].token_ids == (PENDING_TOKEN,) for b in decodes)
    # ... and an empty step is scheduled ahead of the step sampling it.
    assert engine.stats.steps_ahead == 3
    assert engine.blocks.num_free_blocks() == engine.blocks.num_usable_blocks


@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
@pytest.mark.parametrize("graphs", ["off", "pieces"])
def test_ahead_tokens_equal_sync_tokens_under_chunking_and_preemption(
    name: str, graphs: str
) -> None:
    """Chunked prompts, preemption by recompute and the decode pieces (the graph path's code on
    the host) give the same tokens scheduled ahead as not, and every block comes back."""
    ps = prompts([30, 26, 22, 18, 9], seed=5)
    blocks = 20 * (2 if name == "tiny-swa6" else 1)
    common: dict[str, Any] = {
        "num_gpu_blocks": blocks,
        "max_num_batched_tokens": 16,
        "decode_graphs": graphs,
        "max_num_seqs": 4,
    }
    want = _outputs(make_engine(name, **common), requests(ps, 8))
    engine = make_engine(name, async_scheduling=True, **common)
    assert _outputs(engine, requests(ps, 8)) == want
    assert engine.stats.preemptions > 0
    assert engine.stats.steps_ahead > 0
    assert engine.blocks.num_free_blocks() == blocks - 1
    assert not engine.blocks.tables
    if graphs == "pieces":
        graphs_run = engine.runner._graphs
        assert graphs_run is not None
        assert graphs_run.steps_run > 0


def test_an_abort_while_its_step_is_in_flight_drops_that_steps_token() -> None:
    """A request aborted while its step is in flight never yields that step's token, the
    others keep their tokens, and its blocks come back."""
    ps = prompts([12, 10, 7], seed=3)
    want = _outputs(make_engine(), requests(ps, 6))
    engine = make_engine(async_scheduling=True)
    for i, p in enumerate(ps):
        engine.add_request(p, 6, request_id=f"r{i}")
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    for _ in range(3):
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert engine._inflight is not None
    assert "r1" in {c.request_id for c in engine._inflight.batch.chunks}
    assert engine.abort_request("r1")
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert tuple(got["r0"]) == want[0]
    assert tuple(got["r2"]) == want[2]
    assert tuple(got["r1"]) == want[1][: len(got["r1"])]
    assert len(got["r1"]) < 6
    assert engine.blocks.num_free_blocks() == engine.blocks.num_usable_blocks


@pytest.mark.parametrize("load_async", [False, True])
def test_a_step_with_a_load_is_applied_before_the_next_is_scheduled(load_async: bool) -> None:
    """No step is scheduled ahead of one that loaded KV (sync) or while a load is in flight
    (async), since a failed load rolls requests back; the tokens equal the references."""
    ps = prompts([24, 20], seed=7)
    name = "tiny"
    cfg = model_config(name)
    econf = EngineConfig(block_size=4, num_gpu_blocks=128, async_scheduling=True)
    fake = FakeConnector(make_kv_cache_config(cfg, econf), load_async=load_async)
    engine = Engine(
        cfg, econf, scheduler_connector=fake, worker_connector=fake, model=shared_model(name)
    )
    want = _outputs(make_engine(), requests(ps, 5))
    assert _outputs(engine, requests(ps, 5)) == want  # stores them in the fake's tier
    assert engine.scheduler.reset_prefix_cache()  # the GPU cache only: the fake's tier stays
    seen = _loads_at_launch(engine)
    again = engine.run_to_completion(
        [GenerationRequest(p, 5, request_id=f"b{i}") for i, p in enumerate(ps)]
    )
    assert [r.output_token_ids for r in again] == want
    assert all(r.external_loaded_tokens > 0 for r in again)
    assert any(unsettled for _, unsettled in seen)
    for (_, unsettled), (ahead, _) in itertools.pairwise(seen):
        assert not (unsettled and ahead)
    assert any(ahead for ahead, _ in seen)  # the decodes after the loads ran ahead


def test_a_runner_that_cannot_run_ahead_is_refused() -> None:
    """async_scheduling with a runner that cannot take a step ahead (tensor parallel's) is a
    configuration error naming the runner."""

    class WholeSteps(ModelRunner):
        can_run_ahead = False

    def factory(
        model: LlamaForCausalLM, kv: KVCacheConfig, conn: WorkerConnector, dev: torch.device
    ) -> ModelRunner:
        return WholeSteps(model, kv, conn, dev)

    with pytest.raises(ConfigError, match="WholeSteps cannot launch a step ahead"):
        Engine(
            model_config("tiny"),
            EngineConfig(block_size=4, async_scheduling=True),
            model=shared_model("tiny"),
            runner_factory=factory,
        )
