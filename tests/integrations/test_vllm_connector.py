"""KVFlowConnector's wiring through vLLM's real scheduler, with a scripted manager and runtime.

vLLM's factory loads the connector by module path; each step runs the scheduler, a worker-role
twin of the connector in the model runner's call order, and ``update_from_output``. The scripted
delegates make the kvflow side deterministic, so these tests check what vLLM does with the
adapter's answers: waiting for loads, recomputing failed blocks, holding blocks of a finishing
request until its store is done.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from typing import Any

import torch

from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError
from kvflow.integrations.vllm import KVFlowConnectorMetadata
from tests.integrations.vllm_fakes import (
    FAKES_MODULE,
    ManagerRig,
    ScriptedManager,
    worker_pass,
)
from tests.integrations.vllm_harness import HEAD_SIZE, LAYERS, NUM_KV_HEADS, VLLMHarness

BS = 16


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 30000 + 10 for i in range(n)]


class Rig(ManagerRig):
    """vLLM's scheduler with a scripted-role KVFlowConnector and its worker twin."""

    def __init__(self, num_blocks: int = 64, **config: Any) -> None:
        super().__init__(num_blocks, connector="ScriptedConnector", **config)
        manager = self.h.connector.scheduler_role
        assert isinstance(manager, ScriptedManager)
        self.manager = manager


def test_vllm_factory_builds_the_connector_from_the_module_path() -> None:
    """KVTransferConfig's module path and class name give vLLM a working KVFlowConnector."""
    rig = Rig()
    assert type(rig.h.connector).__name__ == "ScriptedConnector"
    assert rig.h.connector.num_cpu_blocks == (1 << 20) // (
        2 * BS * NUM_KV_HEADS * HEAD_SIZE * 2 * 2
    )
    so, _ = rig.step()
    assert isinstance(so.kv_connector_metadata, KVFlowConnectorMetadata)
    assert rig.manager.outputs[0].step == 0


def test_connector_logs_its_creation_per_role() -> None:
    """Each role's connector logs vllm_connector_created with its CPU tier size and policy."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        rig = Rig()
    created = [e for e in logs if e["event"] == "vllm_connector_created"]
    assert sorted(e["role"] for e in created) == ["SCHEDULER", "WORKER"]
    assert {e["cpu_blocks"] for e in created} == {rig.worker.num_cpu_blocks}
    assert {e["store_policy"] for e in created} == {"eager"}


def test_bad_extra_config_fails_scheduler_construction_with_a_named_error() -> None:
    """A misspelt kvflow option stops vLLM at start-up, naming the key."""
    with pytest.raises(ConfigError, match="cpu_bytes"):
        VLLMHarness.build(
            num_blocks=32,
            connector="ScriptedConnector",
            module_path=FAKES_MODULE,
            extra_config={"cpu_bytes": 1},
        )


def test_a_producer_or_consumer_role_with_several_ranks_is_refused() -> None:
    """PD roles run one rank per instance today: kv_consumer with 2 ranks fails at start-up."""
    with pytest.raises(ConfigError, match="2 ranks"):
        VLLMHarness.build(
            num_blocks=32,
            connector="ScriptedConnector",
            module_path=FAKES_MODULE,
            extra_config={"cpu_bytes_to_use": 1 << 20},
            kv_role="kv_consumer",
            dcp=2,
        )


def test_worker_registers_vllms_kv_caches_and_sizes_the_cpu_tier() -> None:
    """register_kv_caches hands every layer's tensor, the block count and the layer→group map on."""
    rig = Rig(num_blocks=32)
    caches = {
        name: torch.zeros(2, 32, BS, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.float16)
        for name in LAYERS
    }
    rig.worker.register_kv_caches(caches)
    assert rig.runtime.registered["num_blocks"] == 32
    assert rig.runtime.registered["groups"] == dict.fromkeys(LAYERS, 0)
    assert rig.runtime.cpu_blocks == [rig.worker.num_cpu_blocks]


def test_cpu_hit_waits_for_its_load_then_vllm_computes_only_the_tail() -> None:
    """A 48-token CPU hit on a 50-token prompt: vLLM waits for finished_recving, then runs 2 tokens."""
    rig = Rig()
    request = rig.h.add(prompt(50), max_tokens=2, request_id="r")
    rig.manager.hits["r"] = 48
    rig.runtime.hold = {1}
    for _ in range(3):
        so, _ = rig.step()
        assert "r" not in so.num_scheduled_tokens
        assert rig.h.is_waiting_for_kv(request)
    (load,) = rig.runtime.plans[0].loads
    assert load.direction is Direction.LOAD
    assert load.gpu_block_ids == (tuple(rig.h.block_ids(request)[0][:3]),)
    rig.runtime.hold = set()
    rig.step()  # the load completes: finished_recving
    so, _ = rig.step()
    assert so.num_scheduled_tokens == {"r": 2}
    assert request.num_computed_tokens == 50


def test_failed_load_is_recomputed_by_vllm() -> None:
    """A load the worker reports failed invalidates its blocks; vLLM recomputes the prompt."""
    rig = Rig()
    request = rig.h.add(prompt(50), max_tokens=2, request_id="r")
    rig.manager.hits["r"] = 48
    rig.runtime.fail = {1}
    rig.step()
    computed = []
    for _ in range(3):
        so, _ = rig.step()
        if "r" in so.num_scheduled_tokens:
            computed.append((request.num_computed_tokens, so.num_scheduled_tokens["r"]))
            break
    assert computed == [(50, 50)]  # all 50 tokens scheduled again: nothing loaded was trusted


def test_failed_load_in_a_hybrid_model_is_reported_per_request() -> None:
    """With full-attention and sliding-window groups, vLLM refuses block-level failures; the
    failed load reaches it as failed_recving and the prompt is recomputed, without a crash."""
    rig = Rig(sliding_window=32)
    assert len(rig.h.scheduler.kv_cache_config.kv_cache_groups) == 2
    request = rig.h.add(prompt(50), max_tokens=2, request_id="r")
    rig.manager.hits["r"] = 48
    rig.runtime.fail = {1}
    so, _ = rig.step()
    (load,) = so.kv_connector_metadata.plan.loads
    assert len(load.gpu_block_ids) == 2
    for _ in range(3):
        so, _ = rig.step()
        if "r" in so.num_scheduled_tokens:
            break
    assert so.num_scheduled_tokens == {"r": 50}
    assert request.num_computed_tokens == 50


def test_cpu_hit_in_a_hybrid_model_loads_every_group() -> None:
    """A hybrid model's CPU hit loads both groups' blocks and vLLM computes only the tail."""
    rig = Rig(sliding_window=32)
    rig.h.add(prompt(50), max_tokens=2, request_id="r")
    rig.manager.hits["r"] = 48
    so, _ = rig.step()
    (load,) = so.kv_connector_metadata.plan.loads
    assert [len(g) > 0 for g in load.gpu_block_ids] == [True, True]
    so, _ = rig.step()  # the load landed in the previous step's output
    assert so.num_scheduled_tokens == {"r": 2}


def test_invalid_ids_only_the_manager_knows_are_echoed_before_the_load_finishes() -> None:
    """Ids the workers did not report go back through the next metadata; vLLM sees them first."""
    rig = Rig()
    request = rig.h.add(prompt(50), max_tokens=2, request_id="r")
    rig.manager.hits["r"] = 48
    so = rig.h.schedule()
    (load,) = so.kv_connector_metadata.plan.loads
    rig.manager.extra_invalid = set(load.gpu_block_ids[0])
    rig.h.finish(so, worker_pass(rig.worker, so))
    assert rig.h.is_waiting_for_kv(request)  # finished_recving held back
    so, _ = rig.step()
    assert so.kv_connector_metadata.echo_invalid_block_ids == frozenset(load.gpu_block_ids[0])
    so, _ = rig.step()
    assert so.num_scheduled_tokens == {"r": 50}


def test_a_worker_binds_no_plan_for_an_idle_step_but_takes_its_echo() -> None:
    """Metadata without a plan (a step with nothing for the workers) binds nothing on the
    worker's runtime, while an echo it carries still reaches vLLM as load errors."""
    rig = Rig()
    bound = len(rig.runtime.plans)
    rig.worker.bind_connector_metadata(KVFlowConnectorMetadata(None, frozenset({5})))
    rig.worker.handle_preemptions(KVFlowConnectorMetadata(None))
    rig.worker.start_load_kv(None)
    rig.worker.wait_for_save()
    assert rig.worker.get_block_ids_with_load_errors() == {5}
    assert len(rig.runtime.plans) == bound


def test_finishing_request_keeps_its_blocks_until_the_store_is_done() -> None:
    """request_finished → True: vLLM frees the blocks only after finished_sending."""
    rig = Rig(num_blocks=32)
    free_before = rig.h.free_blocks()
    rig.manager.store_on_finish.add("r")
    rig.h.add(prompt(40), max_tokens=1, request_id="r")
    rig.runtime.hold = {1}
    _, finished = rig.step()
    assert finished == {"r"}
    assert rig.manager.finished[0][0] == "r"
    for _ in range(2):
        rig.step()
        assert rig.h.free_blocks() == free_before - 3
        assert "r" in rig.h.scheduler.requests
    (store,) = rig.runtime.plans[1].stores
    assert store.gpu_block_ids == rig.manager.finished[0][1]
    rig.runtime.hold = set()
    rig.step()
    assert rig.h.free_blocks() == free_before
    assert "r" not in rig.h.scheduler.requests


def test_preemption_reaches_the_manager_and_flushes_the_workers() -> None:
    """A preempted request is in the manager's output and the workers' handle_preemptions runs."""
    rig = Rig(num_blocks=9, max_num_batched_tokens=256)
    rig.h.add(prompt(64, 1), max_tokens=40)
    rig.h.add(prompt(63, 2), max_tokens=40)
    for _ in range(60):
        rig.step()
        if "handle_preemptions" in rig.runtime.calls:
            break
    preempted = set().union(*(o.preempted_request_ids for o in rig.manager.outputs))
    assert preempted
    assert "handle_preemptions" in rig.runtime.calls
    assert any(p.flush for p in rig.runtime.plans)


def test_reset_prefix_cache_resets_kvflows_cache() -> None:
    """vLLM's reset_prefix_cache(reset_connector=True) resets the manager; without it, it doesn't."""
    rig = Rig()
    request = rig.h.add(prompt(20), max_tokens=1)
    rig.step()
    assert request.request_id not in rig.h.scheduler.running
    assert rig.h.scheduler.reset_prefix_cache() is True
    assert rig.manager.resets == 0
    assert rig.h.scheduler.reset_prefix_cache(reset_connector=True) is True
    assert rig.manager.resets == 1
