"""CPU-side tests of the CUDA backend's 2D copy calls (``pitched_copy``): the parameter structs'
``cuda.h`` layout, and what a driver emulated on host memory copies from them, one
``cuMemcpy2DAsync`` per copy or one ``cuMemcpy3DBatchAsync`` per call."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.backends.plan_helpers import apply, flash_table, run_ids, simulated_memory

from kvflow.backends.cuda import pitched_copy as pc
from kvflow.backends.cuda.plan import Pitched, part_plan, pitched_direct
from kvflow.backends.cuda.ring_plan import ring_plan
from kvflow.errors import BackendError


def test_the_2d_copy_parameters_have_cuda_h_layout() -> None:
    """The ctypes ``CUDA_MEMCPY2D`` is the 128-byte struct of ``cuda.h``, each field at its
    offset (the driver reads it raw)."""
    s = pc._Memcpy2D
    assert ctypes.sizeof(s) == 128
    offsets = {field[0]: getattr(s, field[0]).offset for field in s._fields_}
    assert offsets == {
        "srcXInBytes": 0,
        "srcY": 8,
        "srcMemoryType": 16,
        "srcHost": 24,
        "srcDevice": 32,
        "srcArray": 40,
        "srcPitch": 48,
        "dstXInBytes": 56,
        "dstY": 64,
        "dstMemoryType": 72,
        "dstHost": 80,
        "dstDevice": 88,
        "dstArray": 96,
        "dstPitch": 104,
        "WidthInBytes": 112,
        "Height": 120,
    }


class EmulatedDriver:
    """``libcuda``'s ``cuMemcpy2DAsync_v2`` emulated on host memory: it reads the parameter
    struct as the driver does (unified addresses, pitches, offsets) and copies row by row."""

    def __init__(self, fail_with: int = 0) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.fail_with = fail_with
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        self.cuMemcpy2DAsync_v2 = proto(self._copy)

    def _copy(self, params: int, stream: int | None) -> int:
        p = pc._Memcpy2D.from_address(params)
        self.calls.append((int(stream or 0), p.Height, p.WidthInBytes))
        unified = p.srcMemoryType == p.dstMemoryType == 4  # CU_MEMORYTYPE_UNIFIED
        # An exception would not leave a ctypes callback: a bad struct is the driver's error.
        if self.fail_with or not unified or min(p.srcPitch, p.dstPitch) < p.WidthInBytes:
            return self.fail_with or 1  # CUDA_ERROR_INVALID_VALUE
        for r in range(p.Height):
            ctypes.memmove(
                p.dstDevice + p.dstXInBytes + (p.dstY + r) * p.dstPitch,
                p.srcDevice + p.srcXInBytes + (p.srcY + r) * p.srcPitch,
                p.WidthInBytes,
            )
        return 0


@pytest.mark.parametrize("store", [True, False])
def test_the_2d_copy_call_gives_the_driver_the_plans_rows(
    monkeypatch: pytest.MonkeyPatch, store: bool
) -> None:
    """``Memcpy2D`` fills ``CUDA_MEMCPY2D`` so that a driver reading it (emulated here on host
    memory) copies exactly the plan's rows, sub-batch by sub-batch on a ring of real addresses,
    the CPU block as the pitch on the CPU side and the part's bytes on the staging side."""
    fake = EmulatedDriver()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    table = flash_table(3, 64, 16)  # 96-byte blocks; regions 2..6: 64 bytes of them
    cpu_blocks, slot_bytes, nslots = 80, 64 * 16, 3
    rng = np.random.default_rng(5)
    memory = rng.integers(0, 256, cpu_blocks * table.block_bytes + nslots * slot_bytes, np.uint8)
    base = memory.ctypes.data
    reference, original = memory.copy(), memory.copy()
    cpu = run_ids([9, 6, 12], [2, 5, 1])
    placed = ring_plan(
        table,
        cpu,
        base,
        regions=(2, 6),
        ring=(base + cpu_blocks * table.block_bytes, slot_bytes, 1, nslots),
        max_blocks=512,
        chunk_blocks=32,
        ramp_bytes=0,
        store=store,
    )
    assert isinstance(placed.dma, Pitched)
    copy = pc.Memcpy2D()
    for k in range(placed.num_subbatches):
        lo, hi = placed.desc_bounds[k], placed.desc_bounds[k + 1]
        copy(placed.dma, 7, lo, hi)
        apply(reference, placed.dma.slice(lo, hi), -base, -base)
    assert [c[1] for c in fake.calls] == placed.dma.rows.tolist()
    assert {(c[0], c[2]) for c in fake.calls} == {(7, table.span_bytes(2, 6))}
    assert np.array_equal(memory, reference)
    assert not np.array_equal(memory, original)


def test_a_failed_2d_copy_is_a_backend_error_naming_its_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 2D copy the driver refuses raises ``BackendError`` naming the call, its rows and width,
    and issues nothing after it."""
    fake = EmulatedDriver(fail_with=1)  # CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    table = flash_table(2, 64, 16)
    plan = part_plan(table, 0, 2, run_ids([8, 8], [1, 1]), 1 << 20, blocks_per_slot=64, store=False)
    assert isinstance(plan.dma, Pitched)
    with pytest.raises(BackendError, match=r"cuMemcpy2DAsync \(8 rows of 32 bytes\) failed"):
        pc.Memcpy2D()(plan.dma, 0)
    assert len(fake.calls) == 1


def test_the_batch_operation_has_cuda_h_layout() -> None:
    """``BATCH_OP`` is ``CUDA_MEMCPY3D_BATCH_OP`` of ``cuda.h``: 112 bytes, and a copy's
    operation holds the bytes cuda-python's own struct holds when set field by field."""
    assert pc.BATCH_OP.itemsize == 112
    cu = pytest.importorskip("cuda.bindings.driver")
    copies = Pitched(
        dst=np.array([0x4444], dtype=np.uint64),
        src=np.array([0x1111], dtype=np.uint64),
        rows=np.array([6], dtype=np.uint64),
        width=32,
        cpu_pitch=96,
        store=True,
        gpu_pitch=64,
    )
    mine = pc.batch_ops(copies, device=3).tobytes()
    op = cu.CUDA_MEMCPY3D_BATCH_OP()
    pointer = cu.CUmemcpy3DOperandType.CU_MEMCPY_OPERAND_TYPE_POINTER
    loc = cu.CUmemLocationType
    for side, ptr, pitch, where, at in (
        (op.src, 0x1111, 64, loc.CU_MEM_LOCATION_TYPE_DEVICE, 3),
        (op.dst, 0x4444, 96, loc.CU_MEM_LOCATION_TYPE_HOST, 0),
    ):
        side.type = pointer
        side.op.ptr.ptr = ptr
        side.op.ptr.rowLength = pitch
        side.op.ptr.layerHeight = 6
        side.op.ptr.locHint.type = where
        side.op.ptr.locHint.id = at
    op.extent.width, op.extent.height, op.extent.depth = 32, 6, 1
    op.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    op.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    assert mine == ctypes.string_at(int(op.getPtr()), 112)


class EmulatedBatch3D:
    """``cuMemcpy3DBatchAsync`` emulated on a simulated address space (``memory``, addresses
    its indices): it reads the operations as the driver does and copies row by row, refusing
    what the driver refuses (operands not pointers, a pitch below the row, a zero extent)."""

    def __init__(self, memory: np.ndarray, abi: int, fail_at: int | None = None) -> None:
        self.memory = memory
        self.abi = abi
        self.fail_at = fail_at
        self.calls: list[tuple[int, int]] = []  # (stream, operations)
        self.ops: list[np.ndarray] = []
        size, ptr, ull = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_ulonglong
        if abi == 13000:
            self._fn = ctypes.CFUNCTYPE(ctypes.c_int, size, ptr, ull, ptr)(self._v13)
        else:
            self._fn = ctypes.CFUNCTYPE(ctypes.c_int, size, ptr, ptr, ull, ptr)(self._v12)
        self.address = ctypes.cast(self._fn, ctypes.c_void_p).value or 0

    def _v13(self, n: int, ops: int, flags: int, stream: int | None) -> int:
        return self._copy(n, ops, flags, stream, None)

    def _v12(self, n: int, ops: int, fail: int, flags: int, stream: int | None) -> int:
        return self._copy(n, ops, flags, stream, fail)

    def _copy(self, n: int, at: int, flags: int, stream: int | None, fail: int | None) -> int:
        raw = (ctypes.c_char * (n * pc.BATCH_OP.itemsize)).from_address(at)
        ops = np.frombuffer(bytes(raw), dtype=pc.BATCH_OP)
        self.calls.append((int(stream or 0), n))
        self.ops.append(ops)
        for k, op in enumerate(ops):
            bad = (
                k == self.fail_at
                or flags != 0
                or op["src_type"] != 1
                or op["dst_type"] != 1
                or min(op["width"], op["height"], op["depth"]) == 0
                or min(op["src_row"], op["dst_row"]) < op["width"]
            )
            if bad:
                if fail is not None:
                    ctypes.c_size_t.from_address(fail).value = k
                return 1  # CUDA_ERROR_INVALID_VALUE
            width = int(op["width"])
            for r in range(int(op["height"])):
                d = int(op["dst_ptr"]) + r * int(op["dst_row"])
                s = int(op["src_ptr"]) + r * int(op["src_row"])
                self.memory[d : d + width] = self.memory[s : s + width]
        return 0


def direct_store_plan(store: bool) -> tuple[np.ndarray, Pitched]:
    """A simulated KV cache and CPU tier and a ``pitched_direct`` plan of three runs of blocks."""
    table = flash_table(3, 40, 16)
    memory, cpu_base, _, _ = simulated_memory(table, 1)
    memory[:] = np.random.default_rng(11).integers(0, 256, len(memory), dtype=np.uint8)
    gpu = run_ids([6, 5, 7], [1, 4, 2])
    cpu = run_ids([6, 5, 7], [3, 1, 1])
    plan = pitched_direct(table, gpu, cpu, cpu_base, store=store)
    assert plan is not None
    return memory, plan


@pytest.mark.parametrize("abi", [13000, 12080])
@pytest.mark.parametrize("store", [True, False])
def test_the_batch_call_gives_the_driver_each_2d_copy_as_one_operation(
    abi: int, store: bool
) -> None:
    """``Memcpy3DBatch`` passes a call's 2D copies as one operation each (pointers, the GPU side
    hinted at the device and the CPU side at the host, stream order for a store's reads, one
    layer), so that the driver copies exactly the plan's rows, in one driver call per call."""
    memory, plan = direct_store_plan(store)
    want = memory.copy()
    apply(want, plan)
    fake = EmulatedBatch3D(memory, abi)
    copy = pc.Memcpy3DBatch(abi, fake.address, device=2)
    half = len(plan) // 2
    copy(plan, 7, 0, half)
    copy(plan, 7, half)
    assert fake.calls == [(7, half), (7, len(plan) - half)]
    assert np.array_equal(memory, want)
    ops = np.concatenate(fake.ops)
    gpu_side, cpu_side = ("src", "dst") if store else ("dst", "src")
    hints = {
        side: (set(ops[f"{side}_loc_type"].tolist()), set(ops[f"{side}_loc_id"].tolist()))
        for side in ("src", "dst")
    }
    assert hints[gpu_side] == ({1}, {2})  # CU_MEM_LOCATION_TYPE_DEVICE, the device
    assert hints[cpu_side] == ({2}, {0})  # CU_MEM_LOCATION_TYPE_HOST
    assert set(ops["order"].tolist()) == ({1} if store else {3})  # STREAM / ANY
    assert set(ops["depth"].tolist()) == set(ops["flags"].tolist()) == {1}
    assert ops["height"].tolist() == plan.rows.tolist() == ops["src_layer"].tolist()


@pytest.mark.parametrize("abi", [13000, 12080])
def test_a_refused_batch_is_a_backend_error_naming_the_call(abi: int) -> None:
    """A batch the driver refuses raises ``BackendError`` naming ``cuMemcpy3DBatchAsync``, its
    copies and row width, and with the 12.8 ABI the copy the driver named."""
    memory, plan = direct_store_plan(True)
    fake = EmulatedBatch3D(memory, abi, fail_at=2)
    where = " at copy 2" if abi == 12080 else ""
    with pytest.raises(
        BackendError, match=rf"3DBatchAsync \(18 2D copies of 16-byte rows{where}\)"
    ):
        pc.Memcpy3DBatch(abi, fake.address, device=0)(plan, 0)


def test_an_unknown_batch_abi_is_refused() -> None:
    """Only the two ABIs kvflow knows are called."""
    with pytest.raises(BackendError, match="unknown cuMemcpy3DBatchAsync ABI 12000"):
        pc.Memcpy3DBatch(12000, 1, device=0)


@settings(max_examples=40, deadline=None)
@given(count=st.integers(1, 9), min_batch=st.integers(1, 6), lo=st.integers(0, 3))
def test_the_copier_batches_calls_of_enough_copies_and_copies_the_rest_one_by_one(
    count: int, min_batch: int, lo: int
) -> None:
    """``PitchedCopier`` sends a call of at least ``min_batch`` copies as one batch and a
    smaller one as a ``cuMemcpy2DAsync`` each; either way the same bytes land."""
    memory, plan = direct_store_plan(True)
    hi = min(lo + count, len(plan))
    want = memory.copy()
    apply(want, plan.slice(lo, hi))
    batch = EmulatedBatch3D(memory, 13000)
    each: list[int] = []

    def one_by_one(copies: Pitched, stream: object, lo: int = 0, hi: int = -1) -> None:
        each.append(hi - lo)
        apply(memory, copies.slice(lo, hi))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(ctypes, "CDLL", lambda name: EmulatedDriver())
        copier = pc.PitchedCopier(pc.Memcpy3DBatch(13000, batch.address, 0), min_batch)
    copier.each = one_by_one  # type: ignore[assignment]
    copier(plan, 5, lo, hi)
    batched = hi - lo >= min_batch
    assert batch.calls == ([(5, hi - lo)] if batched else [])
    assert each == ([] if batched else [hi - lo])
    assert np.array_equal(memory, want)
