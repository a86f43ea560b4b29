"""GPU tests of the CUDA backend's loads in parts by layer: each part readable behind its own
wait, however issued; a failed part; the deferred issue one part ahead of the waits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tests.backends.cuda_gpu_helpers import (
    KiB,
    gpu_sleep,
    load,
    make_kv,
    store,
)

from kvflow.backends.base import FenceStatus
from kvflow.errors import BackendError

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _pages(t: Any, style: str, ids: list[int]) -> Any:
    """Layer tensor ``t``'s pages of blocks ``ids``, as bytes."""
    u8 = t.view(torch.uint8)
    index = torch.tensor(ids, device=t.device)
    return (u8.index_select(1, index) if style == "flash" else u8.index_select(0, index)).cpu()


@pytest.mark.parametrize("cpu_ids", ["scattered", "runs"])
@pytest.mark.parametrize("issue", ["thread", "caller", "deferred"])
@pytest.mark.parametrize("method", ["staged", "direct"])
@pytest.mark.parametrize("style", ["flash", "mla"])
def test_a_load_in_parts_is_readable_layer_by_layer_behind_each_parts_wait(
    make_backend: Any,
    monkeypatch: pytest.MonkeyPatch,
    style: str,
    method: str,
    issue: str,
    cpu_ids: str,
) -> None:
    """A load landed in two parts by layer: compute that waited for part 0 reads its layers'
    loaded bytes, compute after part 1's wait reads the rest, and the whole batch's fence is
    done; across staging slots (more blocks than a slot holds) too; issued on the launch thread,
    all in ``submit_parts``, or part by part as the waits come; CPU ids scattered, or in two
    runs over several pinned chunks, which the staged path copies as 2D copies."""
    from kvflow.core.layout import layer_parts

    n, count = 64, 40
    kv = make_kv(style, torch.bfloat16, 16 * KiB, n, layers=4)
    backend = make_backend(
        method=method,
        launch_thread=issue == "thread",
        defer_parts=issue == "deferred",
        slot_bytes=1 << 20,
        register_chunk_bytes=1 << 20,
        pitched_parts=True,
    )
    layout = backend.register_kv_caches(kv, n)
    backend.allocate_cpu_tier([48])
    rows: list[int] = []
    real_2d = backend._memcpy2d

    def counted_2d(copies: Any, *args: Any) -> None:
        rows.extend(copies.rows[args[1] : args[2]].tolist())
        real_2d(copies, *args)

    monkeypatch.setattr(backend, "_memcpy2d", counted_2d)
    rng = np.random.default_rng(7)
    src = rng.permutation(n)[:count].tolist()
    if cpu_ids == "runs":
        cpu = [*range(2, 22), *range(26, 46)]
    else:
        cpu = rng.permutation(48)[:count].tolist()
    want = {name: _pages(t, style, src) for name, t in kv.items()}
    backend.submit(store(src, cpu), [backend.compute_fence()])
    backend.flush()
    for t in kv.values():
        t.view(torch.uint8).random_(0, 256)
    torch.cuda.synchronize()  # the poison is in before the load, which waits for no compute
    parts = layer_parts(layout, 2)
    assert parts.count == 2
    dst = rng.permutation(n)[:count].tolist()
    gpu_sleep()  # the copies queue behind nothing of compute; the compute behind the waits
    fence, (first, second) = backend.submit_parts(load(cpu, dst), parts)
    assert backend.compute_wait(first, 10.0)
    early = {name: t.clone() for name, t in kv.items() if parts.part_of[name] == 0}
    assert backend.compute_wait(second, 10.0)
    late = {name: t.clone() for name, t in kv.items() if parts.part_of[name] == 1}
    torch.cuda.synchronize()
    backend.flush()
    assert backend.query(fence) is FenceStatus.DONE
    assert sorted(early) == ["layer0", "layer1"]
    for name, t in {**early, **late}.items():
        assert torch.equal(_pages(t, style, dst), want[name]), name
    # Each part's rows, once: both parts' 2D copies where they were used.
    assert sum(rows) == (2 * count if cpu_ids == "runs" and method == "staged" else 0)


@pytest.mark.parametrize("launch_thread", [True, False])
def test_a_failed_part_fails_its_wait_and_its_batch(
    make_backend: Any, monkeypatch: pytest.MonkeyPatch, launch_thread: bool
) -> None:
    """A load whose second part's driver calls fail: the first part's wait holds, the second's
    says failed, and the batch's fence is FAILED (issued on the launch thread, or on the
    caller's as the waits come)."""
    from kvflow.core.layout import layer_parts

    kv = make_kv("flash", torch.bfloat16, 16 * KiB, 16, layers=4)
    backend = make_backend(method="staged", launch_thread=launch_thread, defer_parts=True)
    layout = backend.register_kv_caches(kv, 16)
    backend.allocate_cpu_tier([16])
    real = backend._copy_group

    def second_fails(*args: Any) -> None:
        regions = args[7]
        if regions is not None and regions[0] > 0:
            raise BackendError("injected failure of a part")
        real(*args)

    monkeypatch.setattr(backend, "_copy_group", second_fails)
    fence, (first, second) = backend.submit_parts(load([1, 2], [3, 4]), layer_parts(layout, 2))
    assert backend.compute_wait(first, 10.0)
    assert not backend.compute_wait(second, 10.0)
    backend.flush()
    assert backend.query(fence) is FenceStatus.FAILED


def test_without_a_launch_thread_a_loads_parts_are_issued_one_ahead_of_the_waits(
    make_backend: Any,
) -> None:
    """On the caller's thread a load in three parts issues part 0 in ``submit_parts`` and each
    later part when the engine waits for the one before it; a submit in between issues the rest
    first, and every part lands."""
    from kvflow.core.layout import layer_parts

    n = 32
    kv = make_kv("flash", torch.bfloat16, 16 * KiB, n, layers=6)
    backend = make_backend(
        method="staged", launch_thread=False, completion_threads=False, defer_parts=True
    )
    layout = backend.register_kv_caches(kv, n)
    backend.allocate_cpu_tier([n])
    ids = list(range(8))
    want = {name: _pages(t, "flash", ids) for name, t in kv.items()}
    backend.submit(store(ids, ids), [backend.compute_fence()])
    backend.flush()
    for t in kv.values():
        t.view(torch.uint8).random_(0, 256)
    torch.cuda.synchronize()
    parts = layer_parts(layout, 3)
    backend.prepare_parts(parts)
    dst = list(range(16, 24))
    fence, fences = backend.submit_parts(load(ids, dst), parts)
    assert [f.launched for f in fences] == [True, False, False]
    assert backend.compute_wait(fences[0], 10.0)
    assert [f.launched for f in fences] == [True, True, False]
    assert not fence.launched
    other = backend.submit(store([30], [30]), [backend.compute_fence()])
    assert all(f.launched for f in fences)
    assert fence.launched
    assert backend.compute_wait(fences[1], 10.0)
    assert backend.compute_wait(fences[2], 10.0)
    backend.flush()
    assert backend.query(fence) is FenceStatus.DONE
    assert backend.query(other) is FenceStatus.DONE
    for name, t in kv.items():
        assert torch.equal(_pages(t, "flash", dst), want[name]), name
