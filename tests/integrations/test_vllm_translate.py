"""The adapter's pure translation layer, checked against real vLLM objects from its real scheduler."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput

from kvflow.core.protocol import StepPlan, StepReport
from kvflow.core.requests import CachedRequest, RequestLike, SchedulerOutput
from kvflow.errors import ConfigError
from kvflow.integrations.vllm import (
    KVFlowWorkerMetadata,
    OutcomeRelay,
    RequestViews,
    VLLMGpuCacheView,
    VLLMRequestView,
    kv_cache_geometry,
    offload_config,
    request_extra_keys,
    steady_decode,
    translate_scheduler_output,
)
from kvflow.integrations.vllm.config import STATS_INTERVAL_S, stats_interval, valid_keys
from kvflow.integrations.vllm.relay import IDLE_METADATA
from tests.integrations.vllm_harness import (
    LAYERS,
    VLLMHarness,
    make_kv_cache_config,
    make_request,
    page_bytes,
)

BS = 16


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 30000 + 10 for i in range(n)]


def test_request_view_reads_the_live_token_list_without_copying() -> None:
    """The view hands out vLLM's own token list object, so appended output tokens show at once."""
    request = make_request(prompt(40), block_size=BS)
    view = VLLMRequestView(request)
    assert isinstance(view, RequestLike)
    assert view.request_id == request.request_id
    assert list(view.all_token_ids) == list(request.all_token_ids)
    tokens = view.all_token_ids
    assert view.num_prompt_tokens == 40
    request.append_output_token_ids(5)
    assert view.all_token_ids is tokens  # the same live object, not a snapshot
    assert len(view.all_token_ids) == 41
    assert view.all_token_ids[-1] == 5
    assert view.extra_keys == ()


def test_request_views_are_cached_per_request_object() -> None:
    """One view per live request; a new Request object under the same id gets a fresh view."""
    views = RequestViews()
    request = make_request(prompt(20), block_size=BS, request_id="a")
    first = views.get(request)
    assert views.get(request) is first
    again = make_request(prompt(20), block_size=BS, request_id="a")
    assert views.get(again) is not first
    assert views.pop(again).request is again
    assert len(views) == 0


def test_extra_keys_separate_cache_salts_and_lora_adapters() -> None:
    """Requests with different cache salts or LoRA adapters never share kvflow block hashes."""
    from vllm.lora.request import LoRARequest

    salted = make_request(prompt(20), block_size=BS)
    salted.cache_salt = "tenant-a"
    lora = make_request(prompt(20), block_size=BS)
    lora.lora_request = LoRARequest("adapter", 3, "/nonexistent")
    assert request_extra_keys(salted) == ("salt", "tenant-a")
    assert request_extra_keys(lora) == ("lora", 3)


def test_new_request_translates_with_block_ids_per_group() -> None:
    """A first-scheduled request keeps vLLM's per-group block ids and scheduled token count."""
    h = VLLMHarness.build(num_blocks=64)
    request = h.add(prompt(40))
    so = h.schedule()
    out = translate_scheduler_output(so, step=3, num_groups=1)
    assert isinstance(out, SchedulerOutput)
    assert out.step == 3
    (new,) = out.new_requests
    assert new.request_id == request.request_id
    assert new.block_ids == tuple(tuple(g) for g in so.scheduled_new_reqs[0].block_ids)
    assert len(new.block_ids[0]) == 3  # 40 tokens in 16-token blocks
    assert 0 not in new.block_ids[0]  # vLLM's null block is never handed to a request
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (0, 40)
    assert out.cached_requests == ()


def test_running_request_translates_with_tokens_computed_before_the_step() -> None:
    """Decode steps become DecodeRequests columns (one token each, tokens computed before the
    step); a new block appears only when a block boundary is crossed."""
    h = VLLMHarness.build(num_blocks=64)
    request = h.add(prompt(47), max_tokens=4)
    h.step()  # prefill
    so = h.schedule()  # decodes token 48: completes block 3
    out = translate_scheduler_output(so, step=1, num_groups=1)
    assert out.cached_requests == ()
    decode = out.decode_requests
    assert decode.request_ids == (request.request_id,)
    assert decode.num_computed_tokens == (47,)
    assert decode.new_block_ids == (((),),)
    h.finish(so)
    so = h.schedule()  # token 49 opens block 4
    decode = translate_scheduler_output(so, step=2, num_groups=1).decode_requests
    assert decode.num_computed_tokens == (48,)
    ((new_ids,),) = decode.new_block_ids
    assert new_ids == (h.block_ids(request)[0][-1],)


def test_gpu_prefix_hit_shows_as_computed_tokens_of_the_new_request() -> None:
    """A repeated prompt's GPU prefix-cache hit arrives as num_computed_tokens, block aligned."""
    h = VLLMHarness.build(num_blocks=64)
    first = h.add(prompt(50), max_tokens=1)
    h.run_until_done([first])
    h.add(prompt(50), max_tokens=1)
    (new,) = translate_scheduler_output(h.schedule(), step=0, num_groups=1).new_requests
    assert new.num_computed_tokens == 48
    assert new.num_scheduled_tokens == 2


def test_finished_requests_are_listed_in_the_next_output() -> None:
    """vLLM reports a finished request in the following step's finished_req_ids."""
    h = VLLMHarness.build(num_blocks=64)
    request = h.add(prompt(20), max_tokens=1)
    assert request.request_id in h.step().finished
    out = translate_scheduler_output(h.schedule(), step=1, num_groups=1)
    assert out.finished_request_ids == frozenset({request.request_id})


def test_preemption_and_resumption_translate() -> None:
    """A preempted request is listed as preempted, then resumes with its whole new block table."""
    h = VLLMHarness.build(num_blocks=9, max_num_batched_tokens=256)  # 8 usable blocks
    a = h.add(prompt(64, 1), max_tokens=40)
    b = h.add(prompt(63, 2), max_tokens=40)
    preempted: frozenset[str] = frozenset()
    resumed = None
    for step in range(60):
        so = h.schedule()
        out = translate_scheduler_output(so, step=step, num_groups=1)
        preempted = preempted | out.preempted_request_ids
        for c in out.cached_requests:
            if c.resumed_from_preemption:
                resumed = c
        h.finish(so)
        if resumed is not None:
            break
    assert preempted & {a.request_id, b.request_id}
    assert resumed is not None
    assert resumed.request_id in preempted
    assert len(resumed.new_block_ids[0]) == len(
        h.block_ids(h.scheduler.requests[resumed.request_id])[0]
    )


def test_geometry_and_cpu_block_count_follow_the_kv_cache_config() -> None:
    """Bytes per block cover every layer of the group; the CPU budget is split into whole blocks."""
    (group,) = kv_cache_geometry(make_kv_cache_config(num_blocks=32, block_size=BS)).groups
    assert group.block_size == BS
    assert group.block_bytes == page_bytes(BS) * len(LAYERS)
    assert group.layer_names == LAYERS
    config = offload_config({"cpu_bytes_to_use": 10 * group.block_bytes + 5}, world_size=1)
    assert config.cpu_blocks_per_group([group.block_bytes]) == (10,)
    with pytest.raises(ConfigError, match="holds no block"):
        offload_config({"cpu_bytes_to_use": group.block_bytes - 1}, 1).cpu_blocks_per_group(
            [group.block_bytes]
        )


def test_options_are_validated_by_name() -> None:
    """Unknown keys and bad values raise ConfigError naming the key; numbers from JSON are
    accepted; vLLM's CPU tier size is split over the ranks unless given per rank."""
    config = offload_config(
        {"cpu_bytes_to_use": 1e9, "store_policy": "lazy", "lazy_watermark": 8.0}, world_size=4
    )
    assert (config.cpu_bytes, config.store_policy, config.lazy_watermark) == (
        250_000_000,
        "lazy",
        8,
    )
    assert config.world_size == 4
    assert offload_config({"cpu_bytes_to_use_per_rank": 1000}, 4).cpu_bytes == 1000
    default = offload_config(None, 1)
    assert (default.cpu_bytes, default.worker_loop, default.eager_store_interval) == (
        4 << 30,
        "thread",
        4,
    )
    assert offload_config({"worker_loop": "inline"}, 1).worker_loop == "inline"
    with pytest.raises(ConfigError, match=r"\['load_parts'\]: an option of kvflow's own engine"):
        offload_config({"load_parts": 4}, 1)
    with pytest.raises(ConfigError, match="cpu_byte_to_use"):
        offload_config({"cpu_byte_to_use": 1}, 1)
    with pytest.raises(ConfigError, match="store_policy"):
        offload_config({"store_policy": "sometimes"}, 1)
    with pytest.raises(ConfigError, match="lazy_watermark"):
        offload_config({"lazy_watermark": 0}, 1)
    assert offload_config({"eager_store_interval": 1}, 1).eager_store_interval == 1
    with pytest.raises(ConfigError, match="eager_store_interval"):
        offload_config({"eager_store_interval": 0}, 1)
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        offload_config({"cpu_bytes_to_use": True}, 1)
    with pytest.raises(ConfigError, match="worker_loop"):
        offload_config({"worker_loop": "fiber"}, 1)


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), "1s", True, None])
def test_a_bad_stats_interval_is_refused_by_name(bad: object) -> None:
    """``stats_interval_s`` is the adapter's option: a finite number of seconds, 0 or more,
    1 s by default; anything else is a ConfigError naming the key and the value."""
    assert stats_interval(None) == STATS_INTERVAL_S == 1.0
    assert stats_interval({"stats_interval_s": 0}) == 0.0
    assert stats_interval({"stats_interval_s": 2.5}) == 2.5
    assert "stats_interval_s" in valid_keys()
    assert offload_config({"stats_interval_s": 0.25}, 1) == offload_config(None, 1)
    with pytest.raises(
        ConfigError,
        match=r"'stats_interval_s'\] must be (a number of seconds|finite and >= 0 seconds), got ",
    ):
        stats_interval({"stats_interval_s": bad})


def test_gpu_cache_view_walks_vllms_free_queue_in_eviction_order() -> None:
    """The lazy policy's view lists vLLM's free blocks in vLLM's order and pins them with touch."""
    from kvflow.core.gpu_view import GpuCacheView

    h = VLLMHarness.build(num_blocks=16)
    request = h.add(prompt(40), max_tokens=1)
    h.run_until_done([request])
    pool = h.scheduler.kv_cache_manager.block_pool
    view = VLLMGpuCacheView(pool)
    assert isinstance(view, GpuCacheView)
    expected = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert list(view.iter_free()) == expected
    assert 0 not in expected
    cached = [b for b in expected if view.block_hash(b) is not None]
    assert len(cached) == 2  # the request's two full blocks stay cached after it finished
    view.touch(cached)
    assert pool.get_num_free_blocks() == len(expected) - 2
    assert view.next_free(cached[0]) is None  # held blocks are not free
    assert not view.is_free(cached[0])
    assert not view.is_free(0)  # the null block is never free
    assert not set(view.iter_free()) & set(cached)
    view.free(cached)
    assert pool.get_num_free_blocks() == len(expected)
    assert view.is_free(cached[0])


def test_keyed_view_reads_the_requests_block_hashes_from_vllms_blocks() -> None:
    """The keyed view gives each cached free block the request's own block hash (kvflow's CPU
    key) and kvflow's group, scans the free queue in vLLM's order, and lists every keyed block."""
    from kvflow.core.gpu_view import KeyedGpuCacheView
    from kvflow.integrations.vllm import VLLMKeyedGpuCacheView

    h = VLLMHarness.build(num_blocks=16)
    request = h.add(prompt(40), max_tokens=1)
    h.run_until_done([request])
    hashes = list(request.block_hashes)
    pool = h.scheduler.kv_cache_manager.block_pool
    view = VLLMKeyedGpuCacheView(pool, {0: 0})
    assert isinstance(view, KeyedGpuCacheView)
    cached = [b for b in view.iter_free() if view.block_hash(b) is not None]
    # vLLM frees a request's blocks tail first: the last block is evicted first.
    assert [view.block_key(b) for b in cached] == [(0, hashes[1]), (0, hashes[0])]
    ids, keyed = view.scan_free(None, 100)
    assert ids == list(view.iter_free())
    assert dict(keyed) == dict(view.keyed_blocks())
    assert [b for b, _ in keyed] == [b for b in ids if b in dict(keyed)]  # in queue order
    part, part_keyed = view.scan_free(ids[0], 2)
    assert part == ids[1:3]
    assert part_keyed == [(b, k) for b, k in keyed if b in part]
    assert view.first_free_in({cached[1], cached[0]}) == cached[0]
    assert view.first_free_in(set()) is None
    assert VLLMKeyedGpuCacheView(pool, {1: 0}).block_key(cached[0]) is None  # not offloaded


def test_translation_without_running_requests_passes_only_resumed_ones() -> None:
    """``running=False`` (lazy over a keyed view): no running request reaches kvflow, except a
    resumed one with its whole new table; new requests still do."""
    h = VLLMHarness.build(num_blocks=9, max_num_batched_tokens=256)  # 8 usable blocks
    a = h.add(prompt(64, 1), max_tokens=40)
    b = h.add(prompt(63, 2), max_tokens=40)
    seen_new: set[str] = set()
    resumed: list[CachedRequest] = []
    for step in range(60):
        so = h.schedule()
        out = translate_scheduler_output(so, step=step, num_groups=1, running=False)
        seen_new |= {n.request_id for n in out.new_requests}
        assert not out.decode_requests.request_ids
        assert all(c.resumed_from_preemption for c in out.cached_requests)
        resumed += out.cached_requests
        h.finish(so)
        if resumed:
            break
    assert seen_new == {a.request_id, b.request_id}
    (c,) = resumed
    assert len(c.new_block_ids[0]) == len(h.block_ids(h.scheduler.requests[c.request_id])[0])


def test_relay_writes_the_outcome_into_the_connector_output() -> None:
    """finished_sending / finished_recving from the manager become vLLM's fields verbatim."""
    from kvflow.core.protocol import StepPlan  # noqa: F401  (the relay is plan-agnostic)

    class Outcome:
        finished_sending = frozenset({"a"})
        finished_recving = frozenset({"b"})
        invalid_block_ids = frozenset({4})

    relay = OutcomeRelay()
    out = KVConnectorOutput(invalid_block_ids={4})
    relay.apply(out, Outcome())
    assert out.finished_sending == {"a"}
    assert out.finished_recving == {"b"}
    assert relay.take_echo() == (frozenset(), frozenset())
    assert not relay.pending


def test_relay_holds_loads_whose_failures_vllm_has_not_seen_yet() -> None:
    """Invalid ids unknown to the workers are echoed first; the loads finish one pass later."""

    class Outcome:
        finished_sending: frozenset[str] = frozenset()
        finished_recving = frozenset({"b"})
        invalid_block_ids = frozenset({4, 5})

    relay = OutcomeRelay()
    out = KVConnectorOutput(invalid_block_ids={4})
    relay.apply(out, Outcome())
    assert out.finished_recving is None
    assert relay.pending
    assert relay.take_echo() == (frozenset({5}), frozenset())
    later = KVConnectorOutput(invalid_block_ids={5})
    relay.apply(later, None)
    assert later.finished_recving == {"b"}
    assert not relay.pending


def test_an_idle_step_gets_the_shared_metadata_unless_an_echo_is_due() -> None:
    """No plan and nothing to echo: the one shared idle metadata. No plan with an echo due: a
    metadata of its own that carries the echo (which the idle one never does)."""

    class Outcome:
        finished_sending: frozenset[str] = frozenset()
        finished_recving = frozenset({"b"})
        invalid_block_ids = frozenset({5})

    relay = OutcomeRelay()
    assert relay.metadata(None) is IDLE_METADATA
    relay.apply(KVConnectorOutput(), Outcome())
    meta = relay.metadata(None)
    assert meta is not IDLE_METADATA
    assert (meta.plan, meta.echo_invalid_block_ids) == (None, frozenset({5}))
    assert IDLE_METADATA.plan is None
    assert not IDLE_METADATA.echo_invalid_block_ids
    assert relay.metadata(None) is IDLE_METADATA, "the echo went out once"
    plan = StepPlan(3)
    assert relay.metadata(plan).plan is plan


def test_relay_with_several_groups_echoes_unflagged_loads_as_failed_requests() -> None:
    """With several KV cache groups, loads settled alongside unexplained invalid ids are echoed as
    failed requests (vLLM recomputes them); loads a worker flagged itself finish at once."""

    class Outcome:
        finished_sending: frozenset[str] = frozenset()
        finished_recving = frozenset({"flagged", "other"})
        invalid_block_ids = frozenset({4})

    relay = OutcomeRelay(per_request=True)
    out = KVConnectorOutput(failed_recving={"flagged"})
    relay.apply(out, Outcome())
    assert out.finished_recving == {"flagged"}
    assert relay.take_echo() == (frozenset(), frozenset({"other"}))
    later = KVConnectorOutput(failed_recving={"other"})
    relay.apply(later, None)
    assert later.finished_recving == {"other"}
    assert not relay.pending


def test_worker_metadata_aggregates_the_reports_of_all_ranks() -> None:
    """vLLM merges per-rank worker metadata with aggregate(); every rank's report survives."""
    merged = KVFlowWorkerMetadata((StepReport(rank=0, completed=(1,)),)).aggregate(
        KVFlowWorkerMetadata((StepReport(rank=1, completed=(1,)),))
    )
    assert [r.rank for r in merged.reports] == [0, 1]


def test_steady_decode_is_told_from_vllms_output() -> None:
    """A step of running requests only, one token each, is steady decode; a prefill, a prefill
    beside a decode, or an empty step is not."""
    h = VLLMHarness.build(num_blocks=64)
    h.add(prompt(20), max_tokens=4)
    told = []
    for add in (False, False, True):
        if add:
            h.add(prompt(9, seed=1), max_tokens=1)
        so = h.schedule()
        told.append(steady_decode(so))
        h.finish(so)
    assert told == [False, True, False]  # the prefill, a decode, a prefill beside a decode
    for _ in range(10):
        h.step()
    assert not h.scheduler.requests
    assert not steady_decode(h.schedule())  # nothing scheduled


def test_steady_decode_reaches_kvflows_scheduler_whole_and_stores_each_block() -> None:
    """Over vLLM's real scheduler, decode steps go to kvflow's scheduler role as columns
    (``OffloadScheduler.decode_step``, never the translation), and every block a decode
    completes is stored and committed."""
    from tests.integrations.vllm_fakes import ManagerRig

    rig = ManagerRig(num_blocks=64, extra={"eager_store_interval": 1})
    scheduler: Any = rig.h.connector.scheduler_role
    calls: list[str] = []
    decode_step, build = scheduler.decode_step, scheduler.build_connector_meta

    def spy_decode(*args: Any) -> Any:
        calls.append("decode_step")
        return decode_step(*args)

    def spy_build(so: Any) -> Any:
        calls.append("build_connector_meta")
        return build(so)

    scheduler.decode_step, scheduler.build_connector_meta = spy_decode, spy_build
    request = rig.h.add(prompt(30), max_tokens=20)
    rig.run()
    assert calls[0] == "build_connector_meta"  # the prefill
    assert set(calls[1:-1]) == {"decode_step"}  # every decode step but the one it finished in
    hashes = list(request.block_hashes)
    assert len(hashes) == 49 // BS  # 30 prompt tokens and 19 decoded
    pool = rig.manager.cpu_pools[0]
    assert all(pool.get_cached_block(h) is not None for h in hashes)
