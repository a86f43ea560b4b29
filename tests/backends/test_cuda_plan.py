"""CPU-side tests of the CUDA backend: descriptor building, ABI choice, import without a GPU."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from tests.backends.plan_helpers import (
    GPU_BASE,
    apply,
    assert_within_chunks,
    flash_table,
    reference_block,
    simulated_memory,
    tdesc,
)

from kvflow.backends.cuda import driver as drv
from kvflow.backends.cuda.plan import (
    PITCHED_MIN_ROWS,
    RegionTable,
    block_ids,
    direct_descriptors,
    group_work,
    pitched_direct,
    runs,
    runs_too_short,
    staged_plan,
    subbatch_bounds,
)
from kvflow.core.layout import derive_layout
from kvflow.errors import BackendError, ConfigError


def test_block_ids_rejects_out_of_range() -> None:
    """An id outside the tier raises ConfigError naming the bad id instead of copying wild memory."""
    assert block_ids((0, 3, 2), 4, "GPU").tolist() == [0, 3, 2]
    with pytest.raises(ConfigError, match=r"GPU block id 4 is outside 0\.\.3"):
        block_ids((0, 4), 4, "GPU")
    with pytest.raises(ConfigError, match="-1"):
        block_ids((-1,), 4, "CPU")


def test_runs_break_on_gaps_and_chunk_boundaries() -> None:
    """Runs end where either id sequence skips, and where the CPU id enters a new pinned chunk."""
    a = np.array([0, 1, 2, 3, 4, 5], dtype=np.int64)
    b = np.array([6, 7, 8, 10, 11, 12], dtype=np.int64)
    starts, lengths = runs(a, b)
    assert starts.tolist() == [0, 3]
    assert lengths.tolist() == [3, 3]
    starts, lengths = runs(a, b, chunk_blocks=8)
    assert starts.tolist() == [0, 2, 3]
    assert lengths.tolist() == [2, 1, 3]
    empty = np.zeros(0, dtype=np.int64)
    assert [x.tolist() for x in runs(empty, empty)] == [[], []]


def test_direct_descriptors_match_layout() -> None:
    """Each (block, region) page maps to its GPU page and its slot inside the block-major CPU block."""
    table = flash_table(num_layers=2, num_blocks=8, page=64)
    gpu = np.array([5, 2], dtype=np.int64)
    cpu = np.array([0, 3], dtype=np.int64)
    store = direct_descriptors(table, gpu, cpu, cpu_base=0, store=True)
    assert len(store) == 2 * 4
    # Region order is layer0/k, layer0/v, layer1/k, layer1/v; CPU block bytes = 4 pages.
    assert store.src[:4].tolist() == [
        GPU_BASE + 5 * 64,
        GPU_BASE + 8 * 64 + 5 * 64,
        GPU_BASE + 16 * 64 + 5 * 64,
        GPU_BASE + 24 * 64 + 5 * 64,
    ]
    assert store.dst.tolist() == [0, 64, 128, 192, 768, 832, 896, 960]
    assert set(store.size.tolist()) == {64}
    load = direct_descriptors(table, gpu, cpu, cpu_base=0, store=False)
    assert load.dst.tolist() == store.src.tolist()
    assert load.src.tolist() == store.dst.tolist()


def test_direct_descriptors_merge_cross_layer_runs() -> None:
    """A single-region contiguous layout copies runs of consecutive blocks as one descriptor."""
    desc = tdesc("kv", (16, 4, 2, 8), (64, 16, 8, 1), 2, GPU_BASE)
    table = RegionTable.from_group(derive_layout({"kv": desc}, 16).groups[0])
    gpu = np.array([3, 4, 5, 9, 10], dtype=np.int64)
    cpu = np.array([0, 1, 2, 3, 7], dtype=np.int64)
    d = direct_descriptors(table, gpu, cpu, cpu_base=0, store=True)
    assert d.size.tolist() == [3 * 128, 128, 128]
    assert d.src.tolist() == [GPU_BASE + 3 * 128, GPU_BASE + 9 * 128, GPU_BASE + 10 * 128]
    assert d.dst.tolist() == [0, 3 * 128, 7 * 128]


def test_direct_runs_end_at_pinned_chunk_boundaries() -> None:
    """A merged cross-layer copy never spans two pinned chunks of the CPU tier: the driver
    refuses such a copy (seen on the H200 as ``CUresult 1`` for a whole 512-block load)."""
    desc = tdesc("kv", (16, 4, 2, 8), (64, 16, 8, 1), 2, GPU_BASE)
    table = RegionTable.from_group(derive_layout({"kv": desc}, 16).groups[0])
    gpu = np.arange(2, 10, dtype=np.int64)
    cpu = np.arange(2, 10, dtype=np.int64)  # crosses the chunk boundaries at 4 and 8
    for store in (True, False):
        d = direct_descriptors(table, gpu, cpu, cpu_base=0, store=store, chunk_blocks=4)
        host = d.dst if store else d.src
        assert d.size.tolist() == [2 * 128, 4 * 128, 2 * 128]
        assert host.tolist() == [2 * 128, 4 * 128, 8 * 128]
        whole = direct_descriptors(table, gpu, cpu, cpu_base=0, store=store)
        assert whole.size.tolist() == [8 * 128]


@settings(max_examples=80, deadline=None)
@given(
    picks=st.lists(st.integers(0, 15), min_size=1, max_size=16, unique=True),
    consecutive=st.booleans(),
    cpu_shift=st.integers(0, 8),
    chunk_blocks=st.integers(0, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_direct_cross_layer_copies_round_trip_inside_pinned_chunks(
    picks: list[int], consecutive: bool, cpu_shift: int, chunk_blocks: int, seed: int
) -> None:
    """The direct path over a single-region contiguous layout (runs merged) stores every block to
    its CPU block and loads it back, and no copy's CPU side spans two pinned chunks."""
    num_blocks, bb = 16, 128
    table = RegionTable.from_group(
        derive_layout({"kv": tdesc("kv", (16, 4, 2, 8), (64, 16, 8, 1), 2, GPU_BASE)}, 16).groups[0]
    )
    assert table.block_bytes == bb
    cpu_base = GPU_BASE + num_blocks * bb
    cpu_blocks = num_blocks + 8
    rng = np.random.default_rng(seed)
    memory = np.zeros(cpu_base + cpu_blocks * bb, dtype=np.uint8)
    memory[GPU_BASE:cpu_base] = rng.integers(0, 256, num_blocks * bb, dtype=np.uint8)
    n = len(picks)
    gpu = np.array(sorted(picks) if consecutive else picks, dtype=np.int64)
    cpu = (
        np.arange(n, dtype=np.int64) + cpu_shift
        if consecutive
        else rng.permutation(cpu_blocks)[:n].astype(np.int64)
    )
    expected = [memory[GPU_BASE + int(g) * bb : GPU_BASE + (int(g) + 1) * bb].copy() for g in gpu]
    st_ = direct_descriptors(table, gpu, cpu, cpu_base, store=True, chunk_blocks=chunk_blocks)
    assert_within_chunks(st_.dst, st_.size, cpu_base, bb, chunk_blocks)
    assert st_.total_bytes == n * bb
    apply(memory, st_)
    for c, exp in zip(cpu, expected, strict=True):
        assert np.array_equal(memory[cpu_base + int(c) * bb : cpu_base + (int(c) + 1) * bb], exp)
    memory[GPU_BASE:cpu_base] = 0
    target = np.array(sorted(rng.permutation(num_blocks)[:n]), dtype=np.int64)
    ld = direct_descriptors(table, target, cpu, cpu_base, store=False, chunk_blocks=chunk_blocks)
    assert_within_chunks(ld.src, ld.size, cpu_base, bb, chunk_blocks)
    apply(memory, ld)
    for t, exp in zip(target, expected, strict=True):
        assert np.array_equal(memory[GPU_BASE + int(t) * bb : GPU_BASE + (int(t) + 1) * bb], exp)


@settings(max_examples=60, deadline=None)
@given(
    num_layers=st.integers(1, 3),
    page=st.sampled_from([16, 48, 64]),
    picks=st.lists(st.integers(0, 15), min_size=1, max_size=16, unique=True),
    cpu_shift=st.integers(0, 8),
    blocks_per_slot=st.integers(1, 6),
    chunk_blocks=st.integers(0, 5),
    ramp_blocks=st.integers(0, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_staged_plan_round_trip_equals_direct(
    num_layers: int,
    page: int,
    picks: list[int],
    cpu_shift: int,
    blocks_per_slot: int,
    chunk_blocks: int,
    ramp_blocks: int,
    seed: int,
) -> None:
    """Gather into slots + whole-block DMA fills the CPU tier exactly as per-page copies do, and
    whole-block DMA into slots + scatter brings it back (with or without a short first store /
    last load sub-batch)."""
    num_blocks = 16
    table = flash_table(num_layers, num_blocks, page)
    memory, cpu_base, cpu_blocks, staging = simulated_memory(table, blocks_per_slot)
    rng = np.random.default_rng(seed)
    memory[GPU_BASE:cpu_base] = rng.integers(0, 256, cpu_base - GPU_BASE, dtype=np.uint8)
    gpu = np.array(picks, dtype=np.int64)
    # Half the cases use consecutive CPU ids (long DMA runs), half a random scatter.
    n = len(picks)
    cpu = np.arange(n, dtype=np.int64) + cpu_shift if seed % 2 else rng.permutation(cpu_blocks)[:n]
    expected = [reference_block(memory, table, int(g)) for g in gpu]

    plan = staged_plan(
        table,
        cpu,
        cpu_base,
        blocks_per_slot=blocks_per_slot,
        chunk_blocks=chunk_blocks,
        store=True,
        ramp_blocks=ramp_blocks,
    )
    assert plan.bounds[0] == 0
    assert plan.bounds[-1] == len(gpu)
    assert np.all(np.diff(plan.bounds) <= blocks_per_slot)
    assert np.all(np.diff(plan.bounds) > 0)
    if ramp_blocks:
        assert plan.bounds[1] <= ramp_blocks
    for k in range(plan.num_subbatches):
        lo, hi = int(plan.bounds[k]), int(plan.bounds[k + 1])
        slot = staging + (k % 2) * blocks_per_slot * table.block_bytes
        for i, g in enumerate(gpu[lo:hi]):  # the gather kernel's job, in numpy
            memory[slot + i * table.block_bytes : slot + (i + 1) * table.block_bytes] = (
                reference_block(memory, table, int(g))
            )
        part = plan.dma.slice(int(plan.desc_bounds[k]), int(plan.desc_bounds[k + 1]))
        assert part.total_bytes == (hi - lo) * table.block_bytes
        assert_within_chunks(part.dst, part.size, cpu_base, table.block_bytes, chunk_blocks)
        apply(memory, part, offset_src=slot)
    for c, exp in zip(cpu, expected, strict=True):
        start = cpu_base + int(c) * table.block_bytes
        assert np.array_equal(memory[start : start + table.block_bytes], exp)

    # Direct per-page copies back into fresh GPU blocks reproduce the original pages.
    target = rng.permutation(num_blocks)[:n].astype(np.int64)
    memory[GPU_BASE:cpu_base] = 0
    apply(memory, direct_descriptors(table, target, cpu, cpu_base, store=False))
    for t, exp in zip(target, expected, strict=True):
        assert np.array_equal(reference_block(memory, table, int(t)), exp)

    # The staged load: DMA whole blocks into a slot, then the scatter kernel's job, in numpy.
    memory[GPU_BASE:cpu_base] = 0
    back = staged_plan(
        table,
        cpu,
        cpu_base,
        blocks_per_slot=blocks_per_slot,
        chunk_blocks=chunk_blocks,
        store=False,
        ramp_blocks=ramp_blocks,
    )
    assert np.all(np.diff(back.bounds) > 0)
    if ramp_blocks and back.num_subbatches > 1:
        assert back.bounds[-1] - back.bounds[-2] <= ramp_blocks
    for k in range(back.num_subbatches):
        lo, hi = int(back.bounds[k]), int(back.bounds[k + 1])
        slot = staging + (k % 2) * blocks_per_slot * table.block_bytes
        part = back.dma.slice(int(back.desc_bounds[k]), int(back.desc_bounds[k + 1]))
        assert_within_chunks(part.src, part.size, cpu_base, table.block_bytes, chunk_blocks)
        apply(memory, part, slot)
        for i, t in enumerate(target[lo:hi]):
            block = memory[slot + i * table.block_bytes : slot + (i + 1) * table.block_bytes]
            for r, (b, st_, p) in enumerate(zip(table.base, table.stride, table.page, strict=True)):
                off = int(table.cpu_offset[r])
                at = int(b) + int(t) * int(st_)
                memory[at : at + int(p)] = block[off : off + int(p)]
    for t, exp in zip(target, expected, strict=True):
        assert np.array_equal(reference_block(memory, table, int(t)), exp)


@pytest.mark.parametrize("store", [True, False])
def test_ascending_cpu_runs_make_one_copy_per_subbatch_and_chunk(store: bool) -> None:
    """CPU ids in one ascending run cost one DMA descriptor per sub-batch and pinned chunk,
    whatever the GPU ids; scattered CPU ids cost one per block."""
    table = flash_table(2, 600, 16)
    n = 512
    run = np.arange(100, 100 + n, dtype=np.int64)
    plan = staged_plan(
        table, run, 0, blocks_per_slot=128, chunk_blocks=256, store=store, ramp_blocks=32
    )
    cuts = set(plan.bounds.tolist()) | {c - 100 for c in (256, 512) if 0 < c - 100 < n}
    assert len(plan.dma) == len(cuts) - 1
    assert plan.dma.total_bytes == n * table.block_bytes
    scattered = np.random.default_rng(0).permutation(600)[:n].astype(np.int64)
    spread = staged_plan(
        table, scattered, 0, blocks_per_slot=128, chunk_blocks=256, store=store, ramp_blocks=32
    )
    assert len(spread.dma) >= n - 8  # a few neighbours by chance


def test_subbatch_bounds_ramp_a_store_up_and_a_load_down() -> None:
    """A store's first sub-batch and a load's last are short; the rest are full slots."""
    assert subbatch_bounds(10, 4, 0, store=True).tolist() == [0, 4, 8, 10]
    assert subbatch_bounds(10, 4, 2, store=True).tolist() == [0, 2, 6, 10]
    assert subbatch_bounds(10, 4, 2, store=False).tolist() == [0, 4, 8, 10]
    assert subbatch_bounds(11, 4, 2, store=False).tolist() == [0, 4, 8, 9, 11]
    assert subbatch_bounds(2, 4, 2, store=True).tolist() == [0, 2]
    assert subbatch_bounds(3, 4, 9, store=True).tolist() == [0, 3]  # the ramp is at most a slot
    assert subbatch_bounds(0, 4, 2, store=True).tolist() == [0]
    with pytest.raises(ConfigError, match="blocks_per_slot"):
        subbatch_bounds(3, 0, 0, store=True)


def test_staged_plan_rejects_empty_slot() -> None:
    """A slot that holds no block is a configuration error, not an endless loop."""
    table = flash_table(1, 4, 16)
    with pytest.raises(ConfigError, match="blocks_per_slot"):
        staged_plan(table, np.arange(2), 0, blocks_per_slot=0, chunk_blocks=0, store=True)


def test_abi_choice_follows_driver_version() -> None:
    """A 13.x driver gets the 13.0 ABI first, a 12.8/12.9 driver the 12.8 ABI, older none."""
    assert drv.choose_abi(13000) == (13000, 12080)
    assert drv.choose_abi(12090) == (12080,)
    assert drv.choose_abi(12080) == (12080,)
    assert drv.choose_abi(12060) == ()


def test_old_driver_raises_clear_backend_error() -> None:
    """Resolving cuMemcpyBatchAsync on a pre-12.8 driver names the driver version and the need."""
    with pytest.raises(BackendError, match=r"needs a CUDA 12\.8\+ driver; this one is 12\.4"):
        drv.BatchMemcpy.resolve(12040)


def test_backend_without_cuda_raises_backend_error() -> None:
    """Constructing the CUDA backend where no GPU is usable raises BackendError, not a crash."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from kvflow.backends.cuda import CudaBackend

    with pytest.raises(BackendError):
        CudaBackend()


def test_kernel_source_is_self_contained() -> None:
    """The NVRTC source defines the entry point with its id-array limit substituted in."""
    from kvflow.backends.cuda.kernels import MAX_IDS, SOURCE

    assert 'extern "C" __global__' in SOURCE
    assert f"#define KVF_MAX_IDS {MAX_IDS}" in SOURCE
    assert "@" not in SOURCE


class FakeDriver:
    """Records host (un)registrations the way the driver would see them."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[int, int]] = []

    def cuMemHostRegister(self, ptr: int, size: int, flags: int) -> tuple[int]:
        self.calls.append((ptr, size))
        self.registered[ptr] = size
        return (0,)

    def cuMemHostUnregister(self, ptr: int) -> tuple[int]:
        del self.registered[ptr]
        return (0,)


class FakeContext:
    def enter(self) -> None:
        """Nothing to make current without a GPU."""


def test_pinned_tier_registers_exact_bytes_in_whole_block_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks hold whole blocks, cover exactly the bytes asked, and are all unregistered on close."""
    from kvflow.backends.cuda import pinned

    fake = FakeDriver()
    monkeypatch.setattr(pinned, "cu", fake)
    ctx: Any = FakeContext()
    with capture_logs() as logs:
        tier = pinned.PinnedTier(ctx, [10, 3], [3000, 5000], chunk_bytes=7000, register="now")
    tier.wait_registered()
    assert tier.nbytes == 10 * 3000 + 3 * 5000
    assert tier.registered_bytes == tier.nbytes
    assert sum(fake.registered.values()) == tier.nbytes
    assert tier.chunk_blocks(0) == 2  # 7000 // 3000: a chunk never splits a block
    assert tier.chunk_blocks(1) == 1  # a block larger than the chunk size gets a chunk of its own
    sizes0 = sorted(n for p, n in fake.calls if tier.ptr(0) <= p < tier.ptr(0) + 30000)
    assert sizes0 == [6000] * 5
    assert tier.ptr(0) % 4096 == 0
    assert tier.array(0).shape == (10, 3000)
    tier.ensure(0, 9)  # already pinned: no new registration
    assert len(fake.calls) == 5 + 3
    with capture_logs() as closing:
        tier.close()
        tier.close()
    assert fake.registered == {}
    assert tier.registered_bytes == 0
    assert [e for e in logs if e["event"] == "cpu_tier_pinned"] == [
        {"event": "cpu_tier_pinned", "log_level": "info", "bytes": 45000, "groups": 2}
    ]
    assert [(e["event"], e["bytes"]) for e in closing] == [("cpu_tier_unpinned", 45000)]


def test_pinned_tier_registers_needed_chunk_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer that needs a chunk the background thread has not reached registers it at once."""
    from kvflow.backends.cuda import pinned

    fake = FakeDriver()
    monkeypatch.setattr(pinned, "cu", fake)
    ctx: Any = FakeContext()
    tier = pinned.PinnedTier(ctx, [8], [1000], chunk_bytes=2000, register="lazy")
    assert fake.calls == []
    tier.ensure(0, 5)
    assert [n for _, n in fake.calls] == [2000, 2000, 2000]
    assert tier.registered_bytes == 6000
    tier.close()
    assert fake.registered == {}


def test_pinned_tier_rejects_bad_sizes() -> None:
    """Mismatched group counts, negative block counts or a zero chunk size are config errors."""
    from kvflow.backends.cuda import pinned

    ctx: Any = FakeContext()
    with pytest.raises(ConfigError, match="block counts"):
        pinned.PinnedTier(ctx, [1, 2], [10], chunk_bytes=10, register="now")
    with pytest.raises(ConfigError, match="negative"):
        pinned.PinnedTier(ctx, [-1], [10], chunk_bytes=10, register="now")
    with pytest.raises(ConfigError, match="chunk_bytes"):
        pinned.PinnedTier(ctx, [1], [10], chunk_bytes=0, register="now")


@pytest.mark.parametrize("page", [16, 1000, 4096, 70_000, 2 << 20])
def test_device_rows_cut_large_pages_into_pieces_of_the_same_block(page: int) -> None:
    """The kernel's rows cover each page exactly once, in pieces of at most about the limit
    (16-byte multiples where the page is one), and map to the same CPU offsets: a gather over
    the rows builds the same block-major block as over the regions."""
    table = flash_table(2, 3, page)
    rows = table.as_device_rows(64 * 1024)
    assert rows.shape[1] == 4
    if page <= 64 * 1024:
        assert rows.tolist() == table.as_device_rows().tolist()
    assert int(rows[:, 2].sum()) == table.block_bytes
    assert int(rows[:, 2].max()) <= 64 * 1024 + 16
    if page % 16 == 0:
        assert all(int(p) % 16 == 0 for p in rows[:, 2])
    gpu = np.random.default_rng(page).integers(0, 256, GPU_BASE + 2 * 2 * 3 * page, dtype=np.uint8)
    for b in range(3):
        block = np.zeros(table.block_bytes, dtype=np.uint8)
        for base, stride, size, off in rows.tolist():
            at = base + b * stride
            block[off : off + size] = gpu[at : at + size]
        assert np.array_equal(block, reference_block(gpu, table, b))


@pytest.mark.parametrize(
    "field", ["batch_min_copies", "slot_bytes", "ramp_bytes", "store_dma_min_run"]
)
def test_cuda_config_rejects_bad_sizes(field: str) -> None:
    """A count or size that cannot work is a ConfigError at construction, naming the field."""
    from kvflow.backends.cuda import CudaConfig

    bad = -1 if field == "ramp_bytes" else 0
    with pytest.raises(ConfigError, match=field):
        CudaConfig(**{field: bad})  # type: ignore[arg-type]
    assert CudaConfig(ramp_bytes=0).ramp_bytes == 0


class _Pool:
    """An event pool stand-in: hands out plain ints, takes them back."""

    def __init__(self) -> None:
        self.given: list[int] = []

    def take(self) -> int:
        return 7

    def give(self, event: int) -> None:
        self.given.append(event)


@pytest.mark.parametrize(("answer", "match"), [(drv.NOT_READY, "did not reach"), (999, "999")])
def test_a_clock_mark_never_waits_past_its_deadline(
    monkeypatch: pytest.MonkeyPatch, answer: int, match: str
) -> None:
    """A clock mark whose event the device never reaches (or reports failed) raises a
    BackendError naming that, after at most ``MARK_WAIT_S``, instead of hanging its caller."""
    from kvflow.backends.cuda import timing

    monkeypatch.setattr(timing, "MARK_WAIT_S", 0.01)
    monkeypatch.setattr(drv, "record", lambda event, stream: None)
    monkeypatch.setattr(drv, "event_query", lambda event: answer)
    with pytest.raises(BackendError, match=match):
        timing.ClockMark(_Pool(), stream=1)  # type: ignore[arg-type]


class _Mark:
    """A clock mark on the host clock: an event's time is ``at[event]``."""

    def __init__(self, at: dict[str, float]) -> None:
        self.host = time.perf_counter()
        self.at = at

    def place(self, event: str) -> float | None:
        return self.at.get(event)


def test_a_landing_clock_that_cannot_take_a_mark_stops_trying_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mark that cannot be taken leaves the load undated with one warning, and the next asks
    take no mark (each try may hold the runtime's loop up to MARK_WAIT_S) until MARK_RETRY_S
    has passed; then a mark is taken again and loads are dated."""
    from kvflow.backends.cuda import timing

    at: dict[str, float] = {}
    tries: list[bool] = []
    failing = [True]

    def make() -> _Mark:
        tries.append(failing[0])
        if failing[0]:
            raise BackendError("clock mark: the device did not reach its event within 1.0 s")
        return _Mark(at)

    clock = timing.LandingClock(make)  # type: ignore[arg-type]
    with capture_logs() as logs:
        assert clock.ago("end") is None
        assert clock.ago("end") is None
    assert tries == [True]
    assert [e["event"] for e in logs] == ["cuda_clock_mark_failed"]
    failing[0] = False
    monkeypatch.setattr(timing, "MARK_RETRY_S", 0.0)
    at["end"] = time.perf_counter() - 0.25
    ago = clock.ago("end")
    assert ago is not None
    assert 0.25 <= ago < 1.0
    assert tries == [True, False]


def test_a_landing_clock_keeps_its_mark_then_renews_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """One mark serves every ask until it is MARK_MAX_AGE_S old, then a new one is taken; an
    event the mark cannot place gives None."""
    from kvflow.backends.cuda import timing

    at = {"end": time.perf_counter()}
    made: list[_Mark] = []

    def make() -> _Mark:
        made.append(_Mark(at))
        return made[-1]

    clock = timing.LandingClock(make)  # type: ignore[arg-type]
    assert clock.ago("end") is not None
    assert clock.ago("end") is not None
    assert clock.ago("never") is None
    assert len(made) == 1
    monkeypatch.setattr(timing, "MARK_MAX_AGE_S", -1.0)
    assert clock.ago("end") is not None
    assert len(made) == 2


def test_group_work_checks_the_whole_batch_and_skips_empty_groups() -> None:
    """Block pairs per group come back as tuples of ints (a batch's own tuples as they are, a
    list or an array converted), an empty group left out; a wrong group count, an id out of
    range (also a negative one, or one in an array) or unequal counts is a ConfigError naming
    the group."""
    tables = [flash_table(1, 8, 16), flash_table(1, 8, 16)]
    gpu_ids = (1, 2)
    work = group_work(tables, [4, 4], (gpu_ids, ()), ((0, 3), ()))
    assert [(g, gpu, cpu) for g, _, gpu, cpu in work] == [(0, (1, 2), (0, 3))]
    assert work[0][2] is gpu_ids
    converted = group_work(tables, [4, 4], ([1, 2], ()), (np.array([0, 3]), ()))
    assert [(gpu, cpu) for _, _, gpu, cpu in converted] == [((1, 2), (0, 3))]
    assert all(type(b) is int for _, _, gpu, cpu in converted for b in (*gpu, *cpu))
    with pytest.raises(ConfigError, match=r"group 0 GPU block id -1 is outside 0\.\.7"):
        group_work(tables, [4, 4], ((1, -1), ()), ((0, 3), ()))
    with pytest.raises(ConfigError, match=r"group 0 CPU block id 9 is outside 0\.\.3"):
        group_work(tables, [4, 4], ((1, 2), ()), (np.array([0, 9]), ()))
    with pytest.raises(ConfigError, match="copy batch has 1/1 groups, layout has 2"):
        group_work(tables, [4, 4], ((1,),), ((0,),))
    with pytest.raises(ConfigError, match=r"group 1 CPU block id 4 is outside 0\.\.3"):
        group_work(tables, [4, 4], ((), (1,)), ((), (4,)))
    with pytest.raises(ConfigError, match="group 0: 2 GPU blocks but 1 CPU blocks"):
        group_work(tables, [4, 4], ((1, 2), ()), ((0,), ()))


@settings(max_examples=150, deadline=None)
@given(
    gpu_runs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 9)), min_size=1, max_size=4),
    cpu_start=st.integers(0, 6),
    cpu_gap=st.integers(0, 2),
    chunk_blocks=st.integers(0, 7),
    store=st.booleans(),
    padded=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pitched_direct_copies_are_the_per_page_copies(
    gpu_runs: list[tuple[int, int]],
    cpu_start: int,
    cpu_gap: int,
    chunk_blocks: int,
    store: bool,
    padded: bool,
    seed: int,
) -> None:
    """A batch whose blocks come in runs on both sides is planned as one 2D copy per region per
    run (cut at pinned chunks), moving exactly the bytes of the one-copy-per-page plan, each
    copy inside one chunk; runs averaging fewer than PITCHED_MIN_ROWS blocks get no plan."""
    gpu_ids: list[int] = []
    for gap, length in gpu_runs:  # runs of GPU ids with gaps, as a step's requests' blocks
        start = (gpu_ids[-1] + 1 if gpu_ids else 0) + gap
        gpu_ids += range(start, start + length)
    n = gpu_ids[-1] + 1
    # 16-byte pages, a page apart on the GPU (FlashAttention's K and V regions) or two.
    table = padded_table(3, n, 16) if padded else flash_table(3, n, 16)
    cpu_ids: list[int] = []
    for k, (_, length) in enumerate(gpu_runs):  # the CPU pool's ascending runs, some gaps
        start = (cpu_ids[-1] + 1 if cpu_ids else cpu_start) + (cpu_gap if k else 0)
        cpu_ids += range(start, start + length)
    gpu, cpu = np.array(gpu_ids, dtype=np.int64), np.array(cpu_ids, dtype=np.int64)
    memory, cpu_base, cpu_blocks, _ = simulated_memory(table, 1)
    if cpu_ids[-1] >= cpu_blocks:
        return
    pitched = pitched_direct(table, gpu, cpu, cpu_base, store=store, chunk_blocks=chunk_blocks)
    starts, _ = runs(gpu, cpu, chunk_blocks)
    if len(starts) * PITCHED_MIN_ROWS > len(gpu):
        assert pitched is None
        return
    assert pitched is not None
    assert len(pitched) == len(starts) * table.num_regions
    assert pitched.total_bytes == len(gpu) * table.block_bytes
    rows = pitched.row_copies()
    host = rows.dst if store else rows.src
    assert_within_chunks(host, rows.size, cpu_base, table.block_bytes, chunk_blocks)
    rng = np.random.default_rng(seed)
    memory[:] = rng.integers(0, 256, len(memory), dtype=np.uint8)
    want = memory.copy()
    apply(memory, pitched)
    apply(want, direct_descriptors(table, gpu, cpu, cpu_base, store=store))
    assert np.array_equal(memory, want)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=8),
    min_rows=st.integers(1, 40),
    chunk_blocks=st.integers(0, 7),
)
def test_runs_too_short_is_exactly_the_gpu_runs_average_and_rules_out_2d_copies(
    pieces: list[tuple[int, int]], min_rows: int, chunk_blocks: int
) -> None:
    """``runs_too_short`` answers whether the GPU ids' own runs average fewer than
    ``min_rows`` blocks, and where it says so ``pitched_direct`` has no plan even with
    consecutive CPU ids (the CPU ids that add no breaks of their own)."""
    gpu_ids: list[int] = []
    for start, length in pieces:  # runs anywhere, in any order, overlapping ids allowed
        gpu_ids += range(start, start + length)
    gpu = np.array(gpu_ids, dtype=np.int64)
    n = len(gpu)
    starts, _ = runs(gpu, np.arange(n, dtype=np.int64))
    short = runs_too_short(tuple(gpu_ids), min_rows)
    assert short == (len(starts) * min_rows > n)
    if short:
        table = flash_table(2, max(gpu_ids) + 1, 16)
        cpu = np.arange(n, dtype=np.int64)
        plan = pitched_direct(
            table, gpu, cpu, 1 << 30, store=True, chunk_blocks=chunk_blocks, min_rows=min_rows
        )
        assert plan is None


def padded_table(num_layers: int, num_blocks: int, page: int) -> RegionTable:
    """Per layer one (N, page) tensor whose blocks are two pages apart (a view of every other
    page of its buffer, as a padded page would be): the GPU pitch is not the page."""
    tensors = {
        f"layer{i}": tdesc(
            f"layer{i}", (num_blocks, page), (2 * page, 1), 1, GPU_BASE + i * 2 * num_blocks * page
        )
        for i in range(num_layers)
    }
    table = RegionTable.from_group(derive_layout(tensors, num_blocks).groups[0])
    assert (table.stride == 2 * page).all()
    return table


def test_pitched_direct_needs_one_page_shape() -> None:
    """Regions of different page sizes cannot share one 2D shape: no plan (the usual path)."""
    tensors = {
        "a": tdesc("a", (2, 8, 16), (128, 16, 1), 1, GPU_BASE),
        "b": tdesc("b", (2, 8, 32), (256, 32, 1), 1, GPU_BASE + 256),
    }
    table = RegionTable.from_group(derive_layout(tensors, 8).groups[0])
    ids = np.arange(8, dtype=np.int64)
    assert pitched_direct(table, ids, ids, 1 << 30, store=True) is None
