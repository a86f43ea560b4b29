"""Multi-step scenarios through vLLM's real scheduler with kvflow's real ``OffloadManager``.

The worker side is the scripted runtime (every transfer completes in the step's output unless a
test holds or fails it), so each scenario checks the manager and the adapter together against
vLLM's own request lifecycle.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("kvflow.core.offload")

from typing import Any

from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError
from tests.integrations.vllm_fakes import PROMPT
from tests.integrations.vllm_fakes import ManagerRig as Rig

BS = 16


@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_repeated_prompt_hits_the_cpu_tier_and_vllm_computes_only_the_tail(policy: str) -> None:
    """After a GPU eviction, the repeated prompt loads 4 blocks and vLLM schedules the 6-token tail
    (lazy: the blocks were stored because they sat at the eviction end of vLLM's free queue)."""
    rig = Rig(policy=policy)
    rig.store_prompt_and_evict_gpu()
    request, so = rig.serve_again()
    assert so.num_scheduled_tokens == {request.request_id: 6}
    assert any(p.loads for p in rig.runtime.plans)


def test_lazy_steady_decode_steps_go_to_the_manager_by_number() -> None:
    """Lazy over vLLM's hashes: a steady decode step reaches kvflow as its number alone
    (``quiet_step``, no translation), a step that leaves the workers nothing binds no plan, and
    a block a finished request freed is still stored by the walk of such steps while another
    request decodes."""
    rig = Rig(policy="lazy", num_blocks=12, extra={"lazy_watermark": 2})
    scheduler = rig.h.connector.scheduler_role
    quiet: list[int] = []
    stored: set[int] = set()
    real = scheduler.quiet_step

    def spy(step: int) -> Any:
        quiet.append(step)
        plan = real(step)
        if plan is not None:
            stored.update(b for t in plan.stores for b in t.gpu_block_ids[0])
        return plan

    scheduler.quiet_step = spy
    rig.h.add(PROMPT, max_tokens=1)
    rig.run()
    rig.h.add([t + 1000 for t in PROMPT], max_tokens=24)
    rig.run()
    assert len(quiet) >= 8, "the second request's decode steps"
    assert quiet == sorted(set(quiet))
    assert len(rig.runtime.plans) < rig.h.connector._step, "idle steps bind no plan"
    assert len(stored) >= 4, "the first request's 4 full blocks, stored by quiet steps' walks"


def test_hybrid_model_repeated_prompt_hits_the_cpu_tier() -> None:
    """Full-attention plus sliding-window groups: the repeated prompt is loaded for both groups
    (the window group only inside its window) and vLLM schedules the 6-token tail."""
    rig = Rig(sliding_window=32)
    rig.store_prompt_and_evict_gpu()
    request, so = rig.serve_again()
    assert so.num_scheduled_tokens == {request.request_id: 6}
    (load,) = [t for p in rig.runtime.plans for t in p.loads]
    assert len(load.gpu_block_ids) == 2
    assert len(load.gpu_block_ids[1]) < len(load.gpu_block_ids[0])
    rig.run()


def test_group_vllm_does_not_prefix_cache_is_never_stored_or_loaded() -> None:
    """A CircularBufferSpec ring group (one block per request, not prefix-cached by vLLM) beside
    full attention: vLLM's real scheduler steps, only the full-attention group is stored and
    loaded, and the repeated prompt still loads 4 blocks and computes the 6-token tail."""
    rig = Rig(extra_group="ring")
    assert [g.vllm_group for g in rig.h.connector.geometry.groups] == [0]
    assert rig.h.connector.geometry.skipped == ((1, "CircularBufferSpec"),)
    rig.store_prompt_and_evict_gpu()
    request, so = rig.serve_again()
    assert so.num_scheduled_tokens == {request.request_id: 6}
    ring_block = rig.h.block_ids(request)[1]
    assert len(ring_block) == 1
    transfers = [t for p in rig.runtime.plans for t in (*p.stores, *p.loads)]
    assert transfers
    assert all(len(t.gpu_block_ids) == 1 for t in transfers)  # kvflow's one offloaded group
    (load,) = [t for p in rig.runtime.plans for t in p.loads]
    assert list(load.gpu_block_ids[0]) == rig.h.block_ids(request)[0][:4]
    rig.run()


def test_a_group_kind_kvflow_cannot_offload_is_refused_at_start_up() -> None:
    """A Mamba group stops vLLM while it builds its scheduler, with a ConfigError naming the
    group and its kind, never at the first step."""
    with pytest.raises(ConfigError, match=r"group 1 \(MambaSpec"):
        Rig(extra_group="mamba")


def test_prompt_logprobs_requests_get_no_cpu_hit_and_take_no_pin() -> None:
    """A request with prompt logprobs (vLLM's skip_reading_prefix_cache) on a prompt the CPU
    tier holds: no hit counted, no CPU block pinned, vLLM computes the whole prompt, and its
    blocks are still stored."""
    rig = Rig()
    rig.store_prompt_and_evict_gpu()
    hits = rig.manager.stats().hits
    request = rig.h.add(PROMPT, max_tokens=2, prompt_logprobs=1)
    assert request.skip_reading_prefix_cache
    so, _ = rig.step()
    assert so.num_scheduled_tokens == {request.request_id: len(PROMPT)}
    assert rig.manager.stats().hits == hits
    assert all(not refs for refs in rig.manager.cpu_refs())
    rig.run()
    assert not any(p.loads for p in rig.runtime.plans[-5:])


def test_request_waits_for_its_load_and_runs_after_finished_recving() -> None:
    """While the load is held the request stays WAITING_FOR_REMOTE_KVS; it runs once it lands."""
    rig = Rig(extra={"fence_loads": "never"})
    rig.store_prompt_and_evict_gpu()
    rig.runtime.hold_directions = {Direction.LOAD}
    request = rig.h.add(PROMPT, max_tokens=2)
    for _ in range(3):
        so, _ = rig.step()
        assert request.request_id not in so.num_scheduled_tokens
        assert rig.h.is_waiting_for_kv(request)
    rig.runtime.hold_directions = set()
    rig.step()
    so, _ = rig.step()
    assert so.num_scheduled_tokens == {request.request_id: 6}


def test_failed_load_is_not_trusted_and_the_blocks_are_loaded_again() -> None:
    """A load failing on the worker invalidates its blocks in vLLM; the request waits, the CPU tier
    (whose data is intact) loads them again, and vLLM then computes only the tail."""
    rig = Rig(extra={"fence_loads": "never"})
    rig.store_prompt_and_evict_gpu()
    rig.runtime.fail_directions = {Direction.LOAD}
    request = rig.h.add(PROMPT, max_tokens=2)
    so, _ = rig.step()  # the load is planned, and fails, in this step
    assert request.request_id not in so.num_scheduled_tokens
    rig.runtime.fail_directions = set()
    for _ in range(5):
        so, _ = rig.step()
        if request.request_id in so.num_scheduled_tokens:
            break
    assert so.num_scheduled_tokens == {request.request_id: 6}
    loads = [t for p in rig.runtime.plans for t in p.loads]
    assert len(loads) == 2
    assert loads[0].transfer_id != loads[1].transfer_id
    rig.run()


def test_an_idle_engines_hit_loads_in_the_step_that_computes_the_request() -> None:
    """By default (``fence_loads`` idle) a hit found while nothing runs is synchronous for
    vLLM: the request's tail is scheduled in the step whose plan carries its load as fenced,
    and it never waits for remote KV."""
    rig = Rig()
    rig.store_prompt_and_evict_gpu()
    request = rig.h.add(PROMPT, max_tokens=2)
    so, _ = rig.step()
    assert so.num_scheduled_tokens == {request.request_id: 6}
    (plan,) = [p for p in rig.runtime.plans if p.loads]
    assert plan.fenced_loads == tuple(t.transfer_id for t in plan.loads)
    assert not rig.h.is_waiting_for_kv(request)
    rig.run()


def test_finishing_with_a_store_in_flight_frees_blocks_only_after_the_store() -> None:
    """A request that finishes while its store is in flight keeps its GPU blocks until it lands."""
    rig = Rig(num_blocks=32)
    free_before = rig.h.free_blocks()
    rig.runtime.hold_directions = {Direction.STORE}
    request = rig.h.add(PROMPT, max_tokens=1)
    for _ in range(3):
        rig.step()
    assert request.is_finished()
    assert rig.manager.num_live_transfers() > 0
    assert rig.h.free_blocks() < free_before  # blocks under the copy are not free
    rig.runtime.hold_directions = set()
    rig.run()
    assert rig.h.free_blocks() == free_before


def test_preemption_with_transfers_in_flight_settles() -> None:
    """Requests preempted while their stores are in flight get a flushing plan, so vLLM's
    handle_preemptions waits for those copies before the freed blocks are written (eager stores
    hold no GPU refs); then all finish and every transfer settles."""
    rig = Rig(num_blocks=10, max_num_batched_tokens=256)
    rig.runtime.hold_directions = {Direction.STORE}
    requests = [
        rig.h.add([(i * 13 + s) % 30000 + 10 for i in range(60)], max_tokens=30) for s in (1, 2)
    ]
    preempted = False
    for _ in range(30):
        so, _ = rig.step()
        preempted = preempted or bool(so.preempted_req_ids)
        if preempted:
            break
    assert preempted
    assert any(t.direction is Direction.STORE for t in rig.runtime.in_flight())
    assert rig.runtime.plans[-1].flush
    assert "handle_preemptions" in rig.runtime.calls
    rig.runtime.hold_directions = set()
    rig.run(max_steps=200)
    assert all(r.is_finished() for r in requests)


def test_reset_cache_forgets_the_cpu_tier() -> None:
    """After vLLM resets its prefix caches with the connector, a repeated prompt gets no CPU hit."""
    rig = Rig()
    rig.store_prompt_and_evict_gpu()
    assert rig.h.scheduler.reset_prefix_cache(reset_connector=True)
    request = rig.h.add(PROMPT, max_tokens=1)
    so, _ = rig.step()
    assert so.num_scheduled_tokens == {request.request_id: len(PROMPT)}


def test_reset_with_a_store_in_flight_answers_true_and_serves_nothing_from_before() -> None:
    """vLLM's connector reset (what reset_prefix_cache(reset_connector=True) calls) with a store
    still on the device: kvflow answers True at once (vLLM's pause with clear_cache raises on
    False), the store is abandoned and its blocks never enter the CPU tier, so the repeated
    prompt is computed in full."""
    rig = Rig()
    rig.runtime.hold_directions = {Direction.STORE}
    rig.h.add(PROMPT, max_tokens=1)
    for _ in range(3):
        rig.step()
    assert rig.manager.num_live_transfers() == 1
    assert rig.h.scheduler.reset_connector_cache()
    assert rig.manager.reset_pending
    rig.runtime.hold_directions = set()
    rig.run()
    assert rig.manager.stats().cpu_blocks_cached == 0
    assert rig.manager.stats().abandoned_transfers == 1
    assert rig.h.scheduler.kv_cache_manager.reset_prefix_cache()
    request = rig.h.add(PROMPT, max_tokens=1)
    so, _ = rig.step()
    assert so.num_scheduled_tokens == {request.request_id: len(PROMPT)}


def test_vllm_keeps_stepping_while_transfers_are_live() -> None:
    """With a store still in flight and no request left, vLLM's has_requests() stays true, so an
    idle engine keeps stepping until the store is committed and the next request can hit it."""
    rig = Rig()
    rig.runtime.hold_directions = {Direction.STORE}
    request = rig.h.add(PROMPT, max_tokens=1)
    for _ in range(3):
        rig.step()
    assert request.is_finished()
    assert rig.manager.num_live_transfers() > 0
    assert rig.h.connector.has_pending_push_work()
    assert rig.h.scheduler.has_requests()
    rig.runtime.hold_directions = set()
    rig.run()
    assert not rig.h.connector.has_pending_push_work()
    assert not rig.h.scheduler.has_requests()


def test_decode_steps_handed_over_whole_change_no_plan() -> None:
    """Eager: every step's plan and outcome are the same whether the adapter hands steady decode
    steps to kvflow's scheduler whole (``decode_step``) or translates them for the general path,
    through decode, preemption (blocks run short), resumption and finishing."""
    rigs = [Rig(num_blocks=16), Rig(num_blocks=16)]
    rigs[1].h.connector._decode = None  # the reference: every step is translated
    scheduler: Any = rigs[0].h.connector.scheduler_role
    whole = [0]
    decode_step = scheduler.decode_step

    def counted(*args: Any) -> Any:
        whole[0] += 1
        return decode_step(*args)

    scheduler.decode_step = counted
    for rig in rigs:
        for i in range(4):
            rig.h.add(PROMPT[: 40 + 9 * i], max_tokens=40 + 5 * i, request_id=f"r{i}")
    traces: list[list[Any]] = [[], []]
    for _ in range(150):
        for rig, trace in zip(rigs, traces, strict=True):
            so, finished = rig.step()
            plan = so.kv_connector_metadata.plan
            trace.append((plan, sorted(so.preempted_req_ids or ()), sorted(finished)))
        if not rigs[0].h.scheduler.requests and rigs[0].manager.num_live_transfers() == 0:
            break
    assert traces[0] == traces[1]
    assert not rigs[1].h.scheduler.requests, "the workload ran to completion"
    assert any(preempted for _, preempted, _ in traces[0]), "blocks ran short: a preemption"
    assert sum(len(plan.stores) for plan, _, _ in traces[0]) > 4
    assert whole[0] > 20, "steady decode steps went to decode_step"


def test_the_cpu_tier_is_keyed_by_vllms_own_block_hashes() -> None:
    """With vLLM hashing every request (as it does with a KV connector), kvflow hashes nothing
    itself: the blocks it stored are found in its CPU tier under vLLM's ``block_hashes``."""
    from kvflow.core.hashing import EngineBlockHashes

    rig = Rig()
    request = rig.h.add(PROMPT, max_tokens=3)
    rig.step()
    state = rig.manager._requests[request.request_id]
    assert all(isinstance(chain, EngineBlockHashes) for chain in state.hashers)
    assert state.hashers[0].hashes is request.block_hashes
    rig.run()
    cpu = rig.manager.cpu_pools[0]
    assert len(request.block_hashes) == 4
    assert all(cpu.get_cached_block(h) is not None for h in request.block_hashes)


def test_coalesced_decode_stores_store_the_same_blocks_in_fewer_transfers() -> None:
    """On vLLM's scheduler, eager stores coalesced over 4 decode steps (the default) end with
    exactly the blocks a store per step ends with in the CPU tier, in fewer store transfers,
    through decode, preemption and finishing."""
    rigs = [Rig(num_blocks=16), Rig(num_blocks=16, extra={"eager_store_interval": 1})]
    for rig in rigs:
        for i in range(4):
            rig.h.add(PROMPT[: 40 + 9 * i], max_tokens=40 + 5 * i, request_id=f"r{i}")
        rig.run(max_steps=200)
    cached = [
        {b.block_hash for b in rig.manager.cpu_pools[0].blocks if b.block_hash is not None}
        for rig in rigs
    ]
    stores = [sum(len(plan.stores) for plan in rig.runtime.plans) for rig in rigs]
    assert cached[0] == cached[1]
    assert len(cached[0]) > 10
    assert stores[0] < stores[1]
    assert any(plan.flush for plan in rigs[0].runtime.plans), "blocks ran short: a preemption"
    for rig in rigs:
        assert rig.manager.num_live_transfers() == 0
        assert not rig.h.connector.has_pending_push_work()


def test_lazy_never_stores_blocks_computed_before_a_connector_reset() -> None:
    """Lazy over vLLM's keyed view: a request's blocks computed before the connector's reset
    (vLLM's GPU reset failed: the request was running) are never stored, even after it finishes
    and its blocks sit in vLLM's free queue with their hashes; a later request's blocks are."""
    rig = Rig(policy="lazy")
    lazy = rig.manager._lazy
    assert lazy is not None
    assert lazy._keyed is not None, "vLLM hashes: the keyed walk is used"
    request = rig.h.add(PROMPT, max_tokens=8)
    for _ in range(3):
        rig.step()
    assert not request.is_finished()
    assert rig.h.scheduler.reset_connector_cache()
    plans_before = len(rig.runtime.plans)
    rig.run()
    rig.step()
    rig.run()
    assert not [t for p in rig.runtime.plans[plans_before:] for t in p.stores]
    assert rig.manager.stats().cpu_blocks_cached == 0
    other = rig.h.add([t + 1 for t in PROMPT], max_tokens=1)
    rig.run()
    rig.step()
    rig.run()
    assert other.is_finished()
    assert rig.manager.stats().cpu_blocks_cached > 0


def test_a_store_every_step_stores_each_block_at_the_step_it_completes() -> None:
    """On vLLM's scheduler with a store every step, over a long steady decode of requests at
    different offsets (where the manager finds the due requests from a steady run's residues),
    every block a request completed is in the CPU tier right after the step that completed it."""
    rig = Rig(num_blocks=64, extra={"eager_store_interval": 1})
    requests = [
        rig.h.add(PROMPT[: 20 + 9 * i], max_tokens=70, request_id=f"r{i}") for i in range(3)
    ]
    cpu = rig.manager.cpu_pools[0]
    shortcut_steps = 0
    for _ in range(60):
        rig.step()
        shortcut_steps += rig.manager._phases._phases is not None
        for request in requests:
            full = request.block_hashes[: request.num_computed_tokens // 16]
            assert all(cpu.get_cached_block(h) is not None for h in full), request.request_id
    assert shortcut_steps > 40, "the steady run took the residue shortcut"
    assert all(len(r.block_hashes) >= 5 for r in requests)
