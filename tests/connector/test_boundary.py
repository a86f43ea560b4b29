"""Contracts at the boundary (issue 20): bad input to an engine-facing call raises a typed
``KVFlowError`` naming the problem, leaves state unchanged, the next valid call works and nothing
leaks. One test per bug the black-box suite found, through the public connector API."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from kvflow.backends.host import HostBackend
from kvflow.connector.api import KVCacheConfig, KVCacheGroupSpec, KVConnectorOutput
from kvflow.connector.config import OffloadConfig, machine_memory_bytes
from kvflow.connector.offload import OffloadConnector
from kvflow.core.protocol import (
    GroupBlockIds,
    StepPlan,
    StepReport,
    TransferSpec,
    latest_landed,
)
from kvflow.core.requests import KVRequest, NewRequest, SchedulerOutput
from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError, ProtocolError, ReportError
from tests.connector.test_offload_end_to_end import FailingCopies

BLOCK = 4  # tokens per block
GPU_BLOCKS = 16


def _tensors(page_floats: int = 16) -> dict[str, torch.Tensor]:
    """One layer's KV, FlashAttention style (2, blocks, tokens, heads, dim): a block is
    2 × ``page_floats`` × 4 bytes per token group; random, so copies are checkable."""
    torch.manual_seed(0)
    return {"l0": torch.randn(2, GPU_BLOCKS, BLOCK, 2, page_floats // (2 * BLOCK) * 2)}


def _block_bytes(t: torch.Tensor) -> int:
    return 2 * t[0, 0].numel() * t.element_size()


class Rig:
    """One engine's connector pair on the host backend, stepped like an engine would."""

    def __init__(
        self,
        backend: HostBackend | None = None,
        *,
        declared: int | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
        register: bool = True,
    ) -> None:
        self.kv = KVCacheConfig(BLOCK, GPU_BLOCKS, (KVCacheGroupSpec(0, ("l0",)),))
        self.tensors = tensors if tensors is not None else _tensors()
        bb = declared if declared is not None else _block_bytes(self.tensors["l0"])
        self.conn = OffloadConnector.build(
            # The scenarios step asynchronous loads (a request waits for finished_recving).
            OffloadConfig(cpu_bytes=8 * bb, worker_loop="inline", fence_loads="never"),
            self.kv,
            [bb],
            backend=backend or HostBackend(),
        )
        self.sched = self.conn.scheduler
        self.worker = self.conn.worker
        self.step_no = 0
        self.plans: list[StepPlan] = []
        self.recving: set[str] = set()
        self.sending: set[str] = set()
        if register:
            self.worker.register_kv_caches(self.tensors)

    def step(self, *new: NewRequest, finished: Sequence[str] = ()) -> KVConnectorOutput:
        """One engine step: plan, run it on the worker to completion, report back."""
        self.step_no += 1
        so = SchedulerOutput(self.step_no, new_requests=new, finished_request_ids=frozenset())
        plan = self.sched.build_connector_meta(so)
        self.plans.append(plan)
        self.worker.bind_connector_metadata(plan)
        self.worker.handle_preemptions(plan)
        self.worker.start_load_kv()
        self.worker.wait_for_save()
        self.worker.runtime.flush()
        self.worker.get_finished(set(finished))
        out = self.sched.update_connector_output(
            KVConnectorOutput(reports=(self.worker.build_worker_report(),))
        )
        self.recving |= out.finished_recving
        self.sending |= out.finished_sending
        return out

    def settle(self) -> None:
        """Step with nothing scheduled until no transfer is live."""
        for _ in range(8):
            if not self.sched.has_pending_push_work():
                return
            self.step()
        raise AssertionError("transfers never settled")

    def page(self, block: int) -> torch.Tensor:
        """The KV of one GPU block (K and V), a copy."""
        return self.tensors["l0"][:, block].clone()

    def assert_no_leaks(self) -> None:
        """No live transfer, no CPU reference held, every CPU block free or cached."""
        manager = self.sched.manager
        assert manager.num_live_transfers() == 0
        assert all(not refs for refs in manager.cpu_refs())
        for pool in manager.cpu_pools:
            assert all(b.ref_cnt == 0 for b in pool.blocks)
            assert pool.num_free_blocks == pool.num_blocks
        assert self.worker.runtime.runtime.in_flight == 0

    def close(self) -> None:
        self.worker.shutdown()


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    """Rigs a test builds, shut down afterwards even if it failed."""
    built: list[Rig] = []
    yield built
    for rig in built:
        rig.close()


def _rig(rigs: list[Rig], *args: object, **kwargs: object) -> Rig:
    rig = Rig(*args, **kwargs)  # type: ignore[arg-type]
    rigs.append(rig)
    return rig


def _store_prefix(rig: Rig, rid: str, tokens: list[int], table: GroupBlockIds) -> KVRequest:
    """Prefill ``tokens`` for ``rid`` into ``table``, store them, finish the request."""
    req = KVRequest.from_prompt(rid, tokens)
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    rig.sched.update_state_after_alloc(req, table, 0)
    rig.step(NewRequest(rid, table, 0, len(tokens)))
    rig.settle()
    assert rig.sched.request_finished(req, table) == (False, None)
    return req


def _reload(rig: Rig, rid: str, tokens: list[int], table: GroupBlockIds) -> None:
    """Match ``tokens`` (a stored prefix plus one token), load it into ``table``, finish."""
    req = KVRequest.from_prompt(rid, tokens)
    hit = len(tokens) - 1
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (hit, True)
    rig.sched.update_state_after_alloc(req, table, hit)
    rig.step(NewRequest(rid, table, 0, 0))
    rig.settle()
    assert rid in rig.recving
    rig.sched.request_finished(req, table)
    rig.settle()


PROMPT = list(range(8))  # two full blocks


def test_out_of_range_gpu_id_in_alloc_is_refused_and_the_scheduler_goes_on(
    rigs: list[Rig],
) -> None:
    """Bug 1: an allocation naming GPU block 99 of 16 raises ConfigError at once, keeps the
    pinned hit (state unchanged), a valid allocation then loads, and no CPU ref is left."""
    rig = _rig(rigs)
    _store_prefix(rig, "a", PROMPT, ((1, 2),))
    want = [rig.page(1), rig.page(2)]
    b = KVRequest.from_prompt("b", [*PROMPT, 99])
    assert rig.sched.get_num_new_matched_tokens(b, 0) == (8, True)
    with pytest.raises(ConfigError, match=r"GPU block id 99 out of range 0\.\.15"):
        rig.sched.update_state_after_alloc(b, ((3, 99),), 8)
    rig.step()  # the next plan is built and bound as usual
    rig.sched.update_state_after_alloc(b, ((3, 4, 5),), 8)
    rig.step(NewRequest("b", ((3, 4, 5),), 0, 0))
    rig.settle()
    assert "b" in rig.recving
    assert torch.equal(rig.page(3), want[0])
    assert torch.equal(rig.page(4), want[1])
    rig.sched.request_finished(b, ((3, 4, 5),))
    rig.settle()
    rig.assert_no_leaks()


def test_an_engine_that_gives_up_after_a_refused_alloc_leaks_no_pin(rigs: list[Rig]) -> None:
    """Bug 1, the other way out: after the refused allocation the engine finishes the request;
    its pinned CPU blocks go back to the pool."""
    rig = _rig(rigs)
    _store_prefix(rig, "a", PROMPT, ((1, 2),))
    b = KVRequest.from_prompt("b", [*PROMPT, 99])
    assert rig.sched.get_num_new_matched_tokens(b, 0) == (8, True)
    with pytest.raises(ConfigError):
        rig.sched.update_state_after_alloc(b, ((3, 99),), 8)
    rig.step()
    rig.sched.request_finished(b, ((3,),))
    rig.step()
    rig.assert_no_leaks()


def test_duplicate_gpu_ids_are_refused_and_never_corrupt_the_cache(rigs: list[Rig]) -> None:
    """Bug 2: a new request's table naming GPU block 5 twice, an allocation loading into one
    block twice and a worker plan doing either are refused whole; a valid retry stores and
    reloads byte for byte."""
    rig = _rig(rigs)
    a = KVRequest.from_prompt("a", PROMPT)
    rig.sched.get_num_new_matched_tokens(a, 0)
    with pytest.raises(ConfigError, match="GPU block id 5 given twice"):
        rig.sched.update_state_after_alloc(a, ((5, 5),), 0)
    with pytest.raises(ConfigError, match="GPU block id 5 given twice"):
        rig.sched.build_connector_meta(
            SchedulerOutput(1, new_requests=(NewRequest("a", ((5, 5),), 0, 8),))
        )
    # The worker refuses such plans too, whatever built them.
    bad_store = TransferSpec(900, "x", Direction.STORE, ((5, 5),), ((0, 1),))
    bad_load = TransferSpec(901, "x", Direction.LOAD, ((6, 6),), ((0, 1),))
    for plan in (StepPlan(1000, stores=(bad_store,)), StepPlan(1000, loads=(bad_load,))):
        with pytest.raises(ConfigError, match="given twice"):
            rig.worker.bind_connector_metadata(plan)
    rig.sched.update_state_after_alloc(a, ((5, 6),), 0)
    rig.step(NewRequest("a", ((5, 6),), 0, 8))
    rig.settle()
    rig.sched.request_finished(a, ((5, 6),))
    want = [rig.page(5), rig.page(6)]
    b = KVRequest.from_prompt("b", [*PROMPT, 1])
    assert rig.sched.get_num_new_matched_tokens(b, 0) == (8, True)
    with pytest.raises(ConfigError, match="given twice"):
        rig.sched.update_state_after_alloc(b, ((7, 7, 8),), 8)
    rig.sched.update_state_after_alloc(b, ((7, 8, 9),), 8)
    rig.step(NewRequest("b", ((7, 8, 9),), 0, 0))
    rig.settle()
    assert torch.equal(rig.page(7), want[0])
    assert torch.equal(rig.page(8), want[1])
    rig.sched.request_finished(b, ((7, 8, 9),))
    rig.settle()
    rig.assert_no_leaks()


def test_a_replayed_plan_is_refused_and_committed_blocks_keep_their_kv(rigs: list[Rig]) -> None:
    """Bug 3: binding step 1's plan again, after its store committed and its GPU blocks got new
    KV, raises ProtocolError before any copy; the cached blocks still reload a's KV."""
    rig = _rig(rigs)
    _store_prefix(rig, "a", PROMPT, ((1, 2),))
    stored = next(p for p in rig.plans if p.stores)
    want = [rig.page(1), rig.page(2)]
    rig.tensors["l0"][:, 1:3] = torch.randn_like(rig.tensors["l0"][:, 1:3])  # b's KV now
    with pytest.raises(ProtocolError, match="replayed or out of order"):
        rig.worker.bind_connector_metadata(stored)
    # A plan from the future that reuses an old transfer id is refused the same way.
    with pytest.raises(ProtocolError, match="not newer"):
        rig.worker.bind_connector_metadata(StepPlan(10_000, stores=stored.stores))
    rig.step()
    _reload(rig, "c", [*PROMPT, 7], ((3, 4, 5),))
    assert torch.equal(rig.page(3), want[0])
    assert torch.equal(rig.page(4), want[1])
    rig.assert_no_leaks()


def test_registration_refuses_tensors_larger_than_the_declared_blocks(rigs: list[Rig]) -> None:
    """Bug 4: a connector sized for 128-byte blocks refuses 256-byte tensors with ConfigError
    and allocates no tier (binding is then a ProtocolError); matching tensors register and a
    store round trip works."""
    small = _tensors(page_floats=8)
    assert _block_bytes(small["l0"]) == 128
    rig = _rig(rigs, declared=128, tensors=small, register=False)
    big = _tensors(page_floats=16)
    assert _block_bytes(big["l0"]) == 256
    with pytest.raises(ConfigError, match="256 bytes per block, the connector was sized for 128"):
        rig.worker.register_kv_caches(big)
    with pytest.raises(ProtocolError, match="before allocate_cpu_tier"):
        rig.worker.bind_connector_metadata(StepPlan(1))
    rig.worker.register_kv_caches(small)
    _store_prefix(rig, "a", PROMPT, ((1, 2),))
    assert rig.sched.stats().manager.blocks_stored == 2
    rig.assert_no_leaks()


def test_a_failed_deduplicated_store_leaves_the_prefix_storable(rigs: list[Rig]) -> None:
    """Bug 5: a and b prefill one prefix in one step; the single store planned for it fails;
    request_finished(b) then stores b's copy, and a new request with the prefix hits."""
    rig = _rig(rigs, FailingCopies(direction=Direction.STORE))
    a, b = KVRequest.from_prompt("a", PROMPT), KVRequest.from_prompt("b", PROMPT)
    for req, table in ((a, ((1, 2),)), (b, ((3, 4),))):
        rig.sched.get_num_new_matched_tokens(req, 0)
        rig.sched.update_state_after_alloc(req, table, 0)
    rig.step(NewRequest("a", ((1, 2),), 0, 8), NewRequest("b", ((3, 4),), 0, 8))
    assert len(rig.plans[-1].stores) == 1, "b's blocks were deduplicated against a's"
    rig.settle()
    assert rig.sched.stats().manager.failed_transfers == 1
    want = [rig.page(3), rig.page(4)]
    assert rig.sched.request_finished(b, ((3, 4),)) == (True, None)
    rig.sched.request_finished(a, ((1, 2),))
    rig.settle()
    assert "b" in rig.sending
    assert rig.sched.stats().manager.blocks_stored == 2
    _reload(rig, "c", [*PROMPT, 5], ((5, 6, 7),))
    assert torch.equal(rig.page(5), want[0])
    assert torch.equal(rig.page(6), want[1])
    rig.assert_no_leaks()


@pytest.mark.parametrize("size", ["infGiB", "1e400B", "nanMiB", float("inf")])
def test_non_finite_cpu_bytes_is_a_config_error(size: object) -> None:
    """Bug 6: sizes that overflow or are not finite raise ConfigError, from code and from the
    vLLM path's mapping alike."""
    with pytest.raises(ConfigError, match="cpu_bytes"):
        OffloadConfig(cpu_bytes=size)
    with pytest.raises(ConfigError, match="cpu_bytes"):
        OffloadConfig.from_mapping({"cpu_bytes": size})


def test_a_tier_larger_than_the_machine_is_refused() -> None:
    """Bug 6: cpu_bytes past this machine's physical memory raises ConfigError naming it,
    instead of a MemoryError (or an OOM kill) when the tier is built."""
    memory = machine_memory_bytes()
    assert memory is not None
    assert memory > 0
    with pytest.raises(ConfigError, match="more than this machine's memory"):
        OffloadConfig(cpu_bytes="1024TiB")
    with pytest.raises(ConfigError, match="memory"):
        OffloadConfig.from_mapping({"cpu_bytes": memory + 1})
    assert OffloadConfig(cpu_bytes="1MiB").cpu_bytes == 1 << 20


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", "16"),
        ("block_size", 2.5),
        ("block_size", True),
        ("num_blocks", math.nan),
        ("num_blocks", 16.0),
    ],
)
def test_kv_cache_config_names_the_bad_field(field: str, value: object) -> None:
    """Bug 6: a KVCacheConfig count that is not an int raises ConfigError naming the field."""
    kwargs: dict[str, object] = {"block_size": 16, "num_blocks": 16}
    kwargs[field] = value
    with pytest.raises(ConfigError, match=f"KVCacheConfig.{field}"):
        KVCacheConfig(groups=(KVCacheGroupSpec(0, ("l0",)),), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("table", [((-1, 2),), ((2, 16),), ((2, "3"),), ((2,), (3,))])
def test_bad_ids_in_a_new_request_never_reach_the_device(
    rigs: list[Rig], table: tuple[tuple[object, ...], ...]
) -> None:
    """Bug 6: negative, out-of-range, non-int ids or a wrong group count in a NewRequest raise
    ConfigError from build_connector_meta and change nothing: the valid step then stores."""
    rig = _rig(rigs)
    a = KVRequest.from_prompt("a", PROMPT)
    rig.sched.get_num_new_matched_tokens(a, 0)
    rig.sched.update_state_after_alloc(a, ((1, 2),), 0)
    with pytest.raises(ConfigError):
        rig.sched.build_connector_meta(
            SchedulerOutput(1, new_requests=(NewRequest("a", table, 0, 8),))  # type: ignore[arg-type]
        )
    rig.step(NewRequest("a", ((1, 2),), 0, 8))
    rig.settle()
    assert rig.sched.stats().manager.blocks_stored == 2
    rig.sched.request_finished(a, ((1, 2),))
    rig.assert_no_leaks()


def test_scheduler_refuses_unknown_requests_and_bad_counts(rigs: list[Rig]) -> None:
    """Bug 6: a step naming a request kvflow never saw is a ProtocolError, a request scheduled
    twice or with speculative tokens beyond the scheduled ones a ConfigError, a report that is
    not one or names an unknown transfer a ReportError; none changes anything."""
    rig = _rig(rigs)
    a = KVRequest.from_prompt("a", PROMPT)
    rig.sched.get_num_new_matched_tokens(a, 0)
    with pytest.raises(ProtocolError, match="unknown new request 'ghost'"):
        rig.sched.build_connector_meta(
            SchedulerOutput(1, new_requests=(NewRequest("ghost", ((1,),), 0, 4),))
        )
    new = NewRequest("a", ((1, 2),), 0, 8)
    with pytest.raises(ConfigError, match="scheduled twice"):
        rig.sched.build_connector_meta(SchedulerOutput(1, new_requests=(new, new)))
    with pytest.raises(ConfigError, match="speculative"):
        rig.sched.build_connector_meta(
            SchedulerOutput(1, new_requests=(NewRequest("a", ((1, 2),), 0, 2, 3),))
        )
    with pytest.raises(ConfigError, match="block groups"):
        rig.sched.request_finished(a, ((1,), (2,)))
    with pytest.raises(ReportError, match="must be a StepReport"):
        rig.sched.update_connector_output(KVConnectorOutput(reports=("done",)))  # type: ignore[arg-type]
    with pytest.raises(ReportError, match="unknown or settled transfer"):
        rig.sched.update_connector_output(KVConnectorOutput(reports=(StepReport(0, (77,)),)))
    rig.step(new)
    rig.settle()
    rig.sched.request_finished(a, ((1, 2),))
    rig.assert_no_leaks()


@pytest.mark.parametrize("call", ["bind", "start_load_kv", "wait_for_save", "preempt"])
def test_worker_calls_before_registration_are_protocol_errors(rigs: list[Rig], call: str) -> None:
    """Bug 6: binding, launching loads or stores or flushing before register_kv_caches raises
    ProtocolError at once (not a warning later); after registration the same calls work."""
    rig = _rig(rigs, register=False)
    calls: dict[str, Callable[[], None]] = {
        "bind": lambda: rig.worker.bind_connector_metadata(StepPlan(1)),
        "start_load_kv": rig.worker.start_load_kv,
        "wait_for_save": rig.worker.wait_for_save,
        "preempt": lambda: rig.worker.handle_preemptions(StepPlan(1, flush=True)),
    }
    with pytest.raises(ProtocolError, match="before register_kv_caches"):
        calls[call]()
    rig.worker.register_kv_caches(rig.tensors)
    _store_prefix(rig, "a", PROMPT, ((1, 2),))
    rig.assert_no_leaks()


def test_a_step_where_nothing_settled_gives_the_engine_an_empty_output(rigs: list[Rig]) -> None:
    """An empty report, or none, hands the engine an output with nothing to act on."""
    rig = _rig(rigs)
    for reports in ((StepReport(0),), ()):
        out = rig.sched.update_connector_output(KVConnectorOutput(reports=reports))
        assert out.is_empty
    rig.assert_no_leaks()


def test_a_finished_load_comes_with_when_its_copies_landed(rigs: list[Rig]) -> None:
    """The output that names a finished load also says when its copies ended (the host
    backend's copy thread dates them): within the step that ran it, on ``perf_counter``."""
    rig = _rig(rigs)
    _store_prefix(rig, "a", PROMPT, ((1, 2),))
    req = KVRequest.from_prompt("b", [*PROMPT, 7])
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (8, True)
    rig.sched.update_state_after_alloc(req, ((3, 4, 5),), 8)
    began = time.perf_counter()
    out = rig.step(NewRequest("b", ((3, 4, 5),), 0, 0))
    ended = time.perf_counter()
    assert out.finished_recving == {"b"}
    assert set(out.loads_landed) == {"b"}
    assert began < out.loads_landed["b"] < ended
    rig.sched.request_finished(req, ((3, 4, 5),))
    rig.settle()
    rig.assert_no_leaks()


def test_landed_times_are_given_for_finished_loads_only_the_latest_rank_wins() -> None:
    """``latest_landed`` keeps the requests whose load finished, each at its latest rank's
    time."""
    reports = [
        StepReport(0, completed=(1, 2), landed=(("a", 1.0), ("b", 5.0))),
        StepReport(1, completed=(1,), landed=(("a", 1.5),)),
    ]
    assert latest_landed(reports, frozenset({"a"})) == {"a": 1.5}
    assert latest_landed(reports, frozenset()) == {}
