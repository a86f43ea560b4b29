"""The engine calls a KV connector where vLLM does: sync and async hits, failed loads, delayed
frees, preemptions. Checked with the in-test ``FakeConnector``."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from kvflow.connector.api import SchedulerConnector, WorkerConnector
from kvflow.core.protocol import StepReport
from kvflow.core.requests import RequestLike
from kvflow.engine.engine import Engine, EngineConfig, GenerationRequest
from kvflow.engine.model import model_config
from kvflow.engine.request import RequestStatus
from tests.engine.fake_connector import FakeConnector
from tests.engine.helpers import make_engine, requests, shared_model, shared_prefix_prompts

WORKER_STEP = [
    "bind_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_worker_report",
    "clear_connector_metadata",
]


def _engine(
    fake_kwargs: dict[str, Any] | None = None, **config: Any
) -> tuple[Engine, FakeConnector]:
    cfg = model_config("tiny")
    defaults: dict[str, Any] = {"block_size": 4, "num_gpu_blocks": 128}
    defaults.update(config)
    econf = EngineConfig(**defaults)
    from kvflow.engine.engine import make_kv_cache_config

    fake = FakeConnector(make_kv_cache_config(cfg, econf), **(fake_kwargs or {}))
    engine = Engine(
        cfg, econf, scheduler_connector=fake, worker_connector=fake, model=shared_model("tiny")
    )
    return engine, fake


def _reference(ps: list[list[int]], max_tokens: int) -> list[tuple[int, ...]]:
    engine = make_engine(enable_prefix_caching=False)
    return [r.output_token_ids for r in engine.run_to_completion(requests(ps, max_tokens))]


def _two_rounds(engine: Engine, ps: list[list[int]], max_tokens: int) -> list[Any]:
    """First prompt alone (its blocks get saved), then the rest (they find them)."""
    first = engine.run_to_completion(requests(ps[:1], max_tokens))
    rest = engine.run_to_completion(
        [GenerationRequest(p, max_tokens, request_id=f"r{i + 1}") for i, p in enumerate(ps[1:])]
    )
    return [*first, *rest]


def test_fake_connector_fits_both_protocols() -> None:
    """The fake (and so the engine's calls) matches the two connector roles."""
    engine, fake = _engine()
    assert isinstance(fake, SchedulerConnector)
    assert isinstance(fake, WorkerConnector)
    assert fake.calls == ["register_kv_caches"]
    engine.run_to_completion(requests(shared_prefix_prompts(8, [1]), 2))
    worker_calls = [c for c in fake.calls if c in WORKER_STEP]
    assert worker_calls == WORKER_STEP * engine.stats.steps
    assert fake.calls.index("get_num_new_matched_tokens") < fake.calls.index(
        "update_state_after_alloc"
    )


def test_sync_external_hit_loads_and_matches_reference() -> None:
    """A later request loads its prefix through the connector and yields the reference tokens."""
    ps = shared_prefix_prompts(24, [6, 3, 5])
    engine, fake = _engine(enable_prefix_caching=False)
    results = _two_rounds(engine, ps, 4)
    assert [r.output_token_ids for r in results] == _reference(ps, 4)
    assert results[0].external_loaded_tokens == 0
    assert [r.external_loaded_tokens for r in results[1:]] == [24, 24]
    assert engine.stats.external_loaded_tokens == 48
    assert fake.store  # the first request's blocks were saved


def test_async_hit_waits_for_remote_kvs_then_runs() -> None:
    """An async hit parks the request in WAITING_FOR_REMOTE_KVS until finished_recving."""
    ps = shared_prefix_prompts(24, [6, 5])
    engine, fake = _engine({"load_async": True, "load_delay_steps": 3}, enable_prefix_caching=False)
    (first,) = engine.run_to_completion(requests(ps[:1], 4))
    engine.add_request(ps[1], 4, request_id="later")
    statuses = []
    while engine.has_unfinished():
        engine.step()
        req = engine.scheduler.requests.get("later")
        statuses.append(None if req is None else req.status)
    waited = statuses.count(RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert waited == 3
    assert statuses[0] is RequestStatus.WAITING_FOR_REMOTE_KVS
    later = engine.take_result("later")
    assert later.external_loaded_tokens == 24
    assert [first.output_token_ids, later.output_token_ids] == _reference(ps, 4)
    assert any("later" in o.finished_recving for o in fake.outputs_seen)
    # Once loaded it enters the batch as a new request whose loaded tokens count as computed.
    news = [n for o in fake.scheduler_outputs for n in o.new_requests if n.request_id == "later"]
    assert [(n.num_computed_tokens, n.num_scheduled_tokens) for n in news] == [(24, 5)]
    assert all(isinstance(r, RequestLike) for r in fake.requests_seen)


@pytest.mark.parametrize("load_async", [False, True])
@pytest.mark.parametrize("fail_index", [0, 2])
def test_failed_load_is_recomputed_with_identical_output(load_async: bool, fail_index: int) -> None:
    """Blocks reported invalid are recomputed from the valid prefix; tokens stay identical."""
    ps = shared_prefix_prompts(24, [6, 5])
    engine, fake = _engine(
        {"load_async": load_async, "fail_loads": 1, "fail_index": fail_index},
        enable_prefix_caching=False,
    )
    with capture_logs() as logs:
        results = _two_rounds(engine, ps, 4)
    assert [r.output_token_ids for r in results] == _reference(ps, 4)
    later = results[1]
    valid = fail_index * 4  # blocks before the failed one stay loaded
    assert later.recomputed_tokens == 24 - valid
    assert later.external_loaded_tokens == valid
    assert later.prefill_tokens_computed == len(ps[1]) - valid
    assert any(e["event"] == "kv_load_failed_recompute" for e in logs)
    assert any(o.invalid_block_ids for o in fake.outputs_seen)


def test_delayed_free_holds_blocks_until_finished_sending() -> None:
    """request_finished → True keeps the blocks until the worker names the request as sent."""
    ps = shared_prefix_prompts(16, [2, 3])
    engine, fake = _engine(enable_prefix_caching=False)
    engine.add_request(ps[0], 1, request_id="a")
    engine.step()  # prefill + the only token: finished, save queued, blocks held
    assert "a" in engine.scheduler.requests
    held = engine.blocks.block_ids("a")[0]
    assert len(held) == 5
    assert engine.blocks.num_free_blocks() == 127 - 5
    assert engine.has_unfinished()
    engine.step()  # the save runs after this step's forward and is reported
    assert "a" not in engine.scheduler.requests
    assert engine.blocks.num_free_blocks() == 127
    assert any("a" in o.finished_sending for o in fake.outputs_seen)
    assert not engine.has_unfinished()


def test_preemptions_reach_handle_preemptions() -> None:
    """Preempted request ids are in the step's SchedulerOutput and handle_preemptions sees them."""
    ps = shared_prefix_prompts(4, [26, 22, 18, 14])
    engine, fake = _engine(num_gpu_blocks=20, max_num_batched_tokens=16)
    results = engine.run_to_completion(requests(ps, 8))
    assert engine.stats.preemptions > 0
    assert fake.preemptions_seen
    assert [r.output_token_ids for r in results] == _reference(ps, 8)


def test_full_external_hit_leaves_a_block_to_compute() -> None:
    """A hit covering the whole prompt is cut to the block before the last token, never mid-block."""
    (p,) = shared_prefix_prompts(8, [0])
    engine, _ = _engine(enable_prefix_caching=False)
    engine.run_to_completion(requests([p], 1))
    (again,) = engine.run_to_completion(requests([p], 1))
    assert again.external_loaded_tokens == 4  # 8 tokens hit, but the second block is recomputed
    assert again.prefill_tokens_computed == 4
    assert [again.output_token_ids] == _reference([p], 1)


def test_loaded_requests_holding_every_block_give_them_back() -> None:
    """Async-loaded requests that hold all blocks but cannot grow release them instead of
    deadlocking; every request still gets the reference tokens."""
    ps = [[35, 59, 56, 12, 0], [35, 59, 56, 35, 59, 56], [35, 59, 56, 35, 59, 0]]
    engine, _ = _engine(
        {"load_async": True, "load_delay_steps": 1},
        num_gpu_blocks=3,
        max_num_batched_tokens=1,
        enable_prefix_caching=False,
        max_idle_steps=50,
    )
    engine.run_to_completion(requests(ps, 1))
    with capture_logs() as logs:
        results = engine.run_to_completion(requests(ps, 1))
    assert [r.output_token_ids for r in results] == _reference(ps, 1)
    assert any(e.get("input") == "release_blocks" for e in logs)


@pytest.mark.parametrize("load_async", [False, True])
@pytest.mark.parametrize("fail_index", [1, 4])
def test_hybrid_failed_load_restarts_with_identical_output(
    load_async: bool, fail_index: int
) -> None:
    """Sliding-window blocks before a failed block were never loaded; the request starts over
    (reported preempted when it was running) and still yields the reference tokens."""
    cfg = model_config("tiny-swa6")
    (p,) = shared_prefix_prompts(30, [0])
    econf = EngineConfig(
        block_size=4, num_gpu_blocks=64, max_num_batched_tokens=5, enable_prefix_caching=False
    )
    from kvflow.engine.engine import make_kv_cache_config

    fake = FakeConnector(
        make_kv_cache_config(cfg, econf),
        load_async=load_async,
        fail_loads=1,
        fail_index=fail_index,
        store_eagerly=True,
    )
    engine = Engine(
        cfg, econf, scheduler_connector=fake, worker_connector=fake, model=shared_model("tiny-swa6")
    )
    engine.run_to_completion(requests([p], 4))
    load = fake.calls.count("start_load_kv")
    with capture_logs() as logs:
        (again,) = engine.run_to_completion(requests([p], 4))
    want = make_engine("tiny-swa6", enable_prefix_caching=False).run_to_completion(requests([p], 4))
    assert again.output_token_ids == want[0].output_token_ids
    assert again.recomputed_tokens == 28  # all of the hit was rolled back...
    assert again.external_loaded_tokens == 28  # ...and loaded again once the fault was gone
    restarts = [e for e in logs if e["event"] == "kv_load_failed_restart"]
    assert [e["request_id"] for e in restarts] == ["r0"]
    if not load_async:
        assert any("r0" in s for s in fake.preemptions_seen)
    assert fake.calls.count("start_load_kv") > load


def test_a_head_without_blocks_is_not_asked_again_while_a_load_ahead_of_it_runs() -> None:
    """Nothing runs while the first request's async load is in flight, and the second, which
    cannot get blocks until the first finishes, is matched once then, not again every step of
    the wait (each ask is a prefix walk and a connector match); both get the reference tokens."""
    ps = shared_prefix_prompts(24, [6, 5, 7])
    # 10 usable blocks of 4 tokens: one loaded request (24 + 5 + 4 tokens, 9 blocks) at a time.
    engine, fake = _engine(
        {"load_async": True, "load_delay_steps": 3},
        num_gpu_blocks=11,
        enable_prefix_caching=False,
    )
    engine.run_to_completion(requests(ps[:1], 4))
    fake.requests_seen.clear()
    later = engine.run_to_completion(
        [GenerationRequest(p, 4, request_id=f"r{i + 1}") for i, p in enumerate(ps[1:])]
    )
    assert [r.external_loaded_tokens for r in later] == [24, 24]
    assert [r.output_token_ids for r in later] == _reference(ps, 4)[1:]
    asked = [r.request_id for r in fake.requests_seen]
    # r2: when it first found no blocks, and when r1 had finished and its blocks were freed
    # (within RETRY_BLOCKED_STEPS, which would add an ask).
    assert asked.count("r2") == 2


def test_an_idle_step_that_hears_of_a_finished_load_does_not_block_before_the_next() -> None:
    """Steps with nothing to compute block in ``wait_for_progress`` while a load is in flight,
    but not the step whose connector output names the load finished: the next step admits the
    loaded request at once instead of after a wait."""
    ps = shared_prefix_prompts(24, [6, 5])
    engine, fake = _engine({"load_async": True, "load_delay_steps": 3}, enable_prefix_caching=False)
    engine.run_to_completion(requests(ps[:1], 4))
    engine.add_request(ps[1], 4, request_id="later")
    finished_in_idle_step = 0
    while engine.has_unfinished():
        waits, outputs = len(fake.waited_after), len(fake.outputs_seen)
        computed = engine.stats.forward_steps
        engine.step()
        idle = engine.stats.forward_steps == computed
        if any("later" in o.finished_recving for o in fake.outputs_seen[outputs:]):
            assert idle
            finished_in_idle_step += 1
            assert len(fake.waited_after) == waits
    assert finished_in_idle_step == 1
    assert len(fake.waited_after) >= 2  # the steps before it did wait
    assert engine.take_result("later").external_loaded_tokens == 24


class ReportingFake(FakeConnector):
    """A fake whose workers hand over a report every step, with nothing finished in it."""

    def build_worker_report(self) -> StepReport | None:
        super().build_worker_report()
        return StepReport(0)


def test_idle_steps_still_wait_when_the_workers_report_every_step() -> None:
    """A worker report with nothing finished is no news: while a load is in flight, the idle
    steps still block in ``wait_for_progress`` instead of spinning against the copy threads."""
    ps = shared_prefix_prompts(24, [6, 5])
    cfg = model_config("tiny")
    econf = EngineConfig(block_size=4, num_gpu_blocks=128, enable_prefix_caching=False)
    from kvflow.engine.engine import make_kv_cache_config

    fake = ReportingFake(make_kv_cache_config(cfg, econf), load_async=True, load_delay_steps=3)
    engine = Engine(
        cfg, econf, scheduler_connector=fake, worker_connector=fake, model=shared_model("tiny")
    )
    engine.run_to_completion(requests(ps[:1], 4))
    waits = len(fake.waited_after)
    (later,) = engine.run_to_completion([GenerationRequest(ps[1], 4, request_id="later")])
    assert later.external_loaded_tokens == 24
    assert len(fake.waited_after) - waits >= 2
