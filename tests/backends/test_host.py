"""The host backend: layout registration from torch tensors (all three layouts, every
inconsistency error) and real block copies into a block-major CPU tier."""

from __future__ import annotations

import pytest
import torch

from kvflow.backends.base import Backend, CopyBatch, FenceStatus
from kvflow.backends.host import HostBackend, HostFence
from kvflow.backends.torch_layout import describe, layout_of, region_view
from kvflow.core.layout import KVStyle
from kvflow.core.transfer import Direction
from kvflow.errors import BackendError, ClosedError, ConfigError, LayoutError

N = 6  # GPU blocks


def flash_attention(layers: int = 2) -> dict[str, torch.Tensor]:
    return {f"l{i}": torch.randn(2, N, 4, 2, 8) for i in range(layers)}


def flashinfer(layers: int = 2) -> dict[str, torch.Tensor]:
    return {f"l{i}": torch.randn(N, 2, 4, 2, 8) for i in range(layers)}


def cross_layer() -> dict[str, torch.Tensor]:
    return {"all": torch.randn(N, 3, 2, 4, 8)}


def wait(fence: HostFence) -> FenceStatus:
    assert fence.finished.wait(timeout=30)
    return fence.status


@pytest.mark.parametrize(
    ("tensors", "style", "regions", "block_bytes"),
    [
        (flash_attention(), KVStyle.KV_FIRST, 4, 2 * 2 * 4 * 2 * 8 * 4),
        (flashinfer(), KVStyle.BLOCK_FIRST, 2, 2 * 2 * 4 * 2 * 8 * 4),
        (cross_layer(), KVStyle.BLOCK_FIRST, 1, 3 * 2 * 4 * 8 * 4),
    ],
    ids=["flash_attention", "flashinfer_mla", "cross_layer"],
)
def test_register_each_layout(
    tensors: dict[str, torch.Tensor], style: KVStyle, regions: int, block_bytes: int
) -> None:
    """Each layout yields its regions (K and V per FlashAttention layer, one otherwise)."""
    backend = HostBackend()
    assert isinstance(backend, Backend)
    layout = backend.register_kv_caches(tensors, N)
    assert set(layout.styles.values()) == {style}
    assert layout.num_regions == regions
    assert layout.groups[0].block_bytes == block_bytes
    backend.close()


def test_aliased_layers_register_once() -> None:
    """Two names for the same storage (shared KV layers) give one set of regions."""
    t = torch.randn(2, N, 4, 8)
    layout = HostBackend().register_kv_caches({"a": t, "b": t, "c": torch.randn(2, N, 4, 8)}, N)
    assert layout.aliases == {"b": "a"}
    assert layout.num_regions == 4


def test_inconsistent_block_counts_name_the_tensor() -> None:
    """A tensor whose block count differs from the engine's is refused by name."""
    with pytest.raises(LayoutError, match="'bad'"):
        HostBackend().register_kv_caches(
            {"ok": torch.randn(2, N, 4, 8), "bad": torch.randn(2, N + 1, 4, 8)}, N
        )


def test_per_group_block_counts_must_match_within_a_group() -> None:
    """Two tensors of one group with different block counts are refused by name."""
    with pytest.raises(LayoutError, match="'b'"):
        HostBackend().register_kv_caches(
            {"a": torch.randn(N, 4, 8), "b": torch.randn(N + 2, 4, 8)},
            {0: N, 1: N + 2},
            groups={"a": 0, "b": 0},
        )


def test_non_contiguous_block_names_the_tensor() -> None:
    """A block that is not one contiguous piece of memory is refused by name."""
    strided = torch.randn(N, 8, 4).transpose(1, 2)
    with pytest.raises(LayoutError, match=r"'strided'.*not contiguous"):
        HostBackend().register_kv_caches({"ok": torch.randn(N, 4, 8), "strided": strided}, N)


def test_wrong_device_names_the_tensor() -> None:
    """A tensor on another device than the rest, or not on the CPU at all, is refused by name."""
    meta = torch.empty(N, 4, 8, device="meta")
    with pytest.raises(LayoutError, match="'m'"):
        layout_of({"c": torch.randn(N, 4, 8), "m": meta}, N)
    with pytest.raises(LayoutError, match=r"'m'.*needs CPU"):
        HostBackend().register_kv_caches({"m": meta}, N)


def test_non_tensor_names_itself() -> None:
    """Something that is not a torch tensor is refused by name."""
    with pytest.raises(LayoutError, match="'x'"):
        describe("x", [1, 2, 3])


def test_region_view_addresses_each_block() -> None:
    """region_view row b is exactly block b of the region, sharing memory with the tensor."""
    t = torch.randn(2, N, 4, 8)
    layout = layout_of({"t": t}, N)
    k, v = layout.groups[0].regions
    assert torch.equal(region_view(t, v)[3], t[1, 3].flatten().view(torch.uint8))
    region_view(t, k)[2].zero_()
    assert not t[0, 2].any()


def test_store_fills_block_major_cpu_rows_and_load_restores() -> None:
    """A stored CPU block is every region's page back to back; loading it restores the bytes."""
    tensors = flash_attention()
    backend = HostBackend()
    layout = backend.register_kv_caches(tensors, N)
    backend.allocate_cpu_tier([4])
    fence = backend.submit(
        CopyBatch(Direction.STORE, ((1, 4),), ((3, 0),)), [backend.compute_fence()]
    )
    assert wait(fence) is FenceStatus.DONE
    row = backend.cpu_tier(0)[3]
    group = layout.groups[0]
    for region, off in zip(group.regions, group.cpu_offsets, strict=True):
        page = region_view(tensors[region.tensor], region)[1]
        assert torch.equal(row[off : off + region.page_bytes], page)
    before = {n: t.clone() for n, t in tensors.items()}
    for t in tensors.values():
        t.zero_()
    assert wait(backend.submit(CopyBatch(Direction.LOAD, ((5,),), ((3,),)))) is FenceStatus.DONE
    for n, t in tensors.items():
        assert torch.equal(t[:, 5], before[n][:, 1])
        assert not t[:, 1].any()
    backend.close()


def test_out_of_range_copy_fails_the_fence_not_the_thread() -> None:
    """A bad block id fails its batch with a reason; the copy thread keeps serving."""
    backend = HostBackend()
    backend.register_kv_caches(flashinfer(), N)
    backend.allocate_cpu_tier([2])
    bad = backend.submit(CopyBatch(Direction.STORE, ((0,),), ((2,),)))
    good = backend.submit(CopyBatch(Direction.STORE, ((0,),), ((1,),)))
    assert wait(bad) is FenceStatus.FAILED
    assert bad.error is not None
    assert "CPU block id out of range" in bad.error
    assert wait(good) is FenceStatus.DONE
    backend.close()


def test_lifecycle_errors() -> None:
    """Misordered calls raise typed errors; close is idempotent and final."""
    backend = HostBackend()
    with pytest.raises(BackendError):
        backend.allocate_cpu_tier([1])
    backend.register_kv_caches(flashinfer(), N)
    with pytest.raises(BackendError):
        backend.submit(CopyBatch(Direction.STORE, ((0,),), ((0,),)))
    with pytest.raises(ConfigError):
        backend.allocate_cpu_tier([1, 1])
    with pytest.raises(ConfigError):
        backend.allocate_cpu_tier([0])
    backend.allocate_cpu_tier([1])
    with pytest.raises(BackendError):
        backend.query(object())
    backend.close()
    backend.close()
    with pytest.raises(ClosedError):
        backend.submit(CopyBatch(Direction.STORE, ((0,),), ((0,),)))
