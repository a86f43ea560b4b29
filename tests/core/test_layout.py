"""Tests of KV layout derivation from tensor descriptions (no torch: plain descriptions)."""

from __future__ import annotations

import math

import pytest

from kvflow.core.layout import KVLayout, KVStyle, TensorDesc, derive_layout, layer_parts
from kvflow.errors import LayoutError


def desc(
    name: str, shape: tuple[int, ...], ptr: int, itemsize: int = 2, **kw: object
) -> TensorDesc:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return TensorDesc(
        name=name,
        shape=shape,
        strides=kw.pop("strides", tuple(reversed(strides))),  # type: ignore[arg-type]
        itemsize=itemsize,
        data_ptr=ptr,
        device=str(kw.pop("device", "cuda:0")),
    )


def test_flash_attention_layout_gives_k_and_v_regions_per_layer() -> None:
    """(2, N, B, H, D) tensors become a K and a V region each, V offset by one K half."""
    n, page = 10, 16 * 8 * 64
    layout = derive_layout(
        {f"l{i}": desc(f"l{i}", (2, n, 16, 8, 64), 1 << (20 + i)) for i in range(2)}, n
    )
    (group,) = layout.groups
    assert [r.name for r in group.regions] == ["l0/k", "l0/v", "l1/k", "l1/v"]
    k, v = group.regions[:2]
    assert k.page_bytes == page * 2
    assert k.block_stride_bytes == page * 2
    assert v.base_ptr - k.base_ptr == n * page * 2
    assert group.block_bytes == 4 * page * 2
    assert group.cpu_offsets == (0, page * 2, 2 * page * 2, 3 * page * 2)
    assert layout.styles["l0"] is KVStyle.KV_FIRST


def test_block_first_and_cross_layer_layouts_give_one_region_per_tensor() -> None:
    """(N, ...) MLA/FlashInfer tensors and a cross-layer (N, L, ...) tensor are one region each."""
    n = 6
    mla = derive_layout({"mla": desc("mla", (n, 16, 576), 4096)}, n)
    assert [r.page_bytes for r in mla.groups[0].regions] == [16 * 576 * 2]
    cross = derive_layout({"all": desc("all", (n, 32, 2, 16, 8, 128), 4096)}, n)
    (region,) = cross.groups[0].regions
    assert region.page_bytes == math.prod((32, 2, 16, 8, 128)) * 2
    assert cross.styles["all"] is KVStyle.BLOCK_FIRST


def test_shared_storage_is_registered_once() -> None:
    """Two names for the same view (KV sharing between layers) register one set of regions."""
    a = desc("a", (2, 4, 16, 2, 8), 1 << 20)
    b = desc("b", (2, 4, 16, 2, 8), 1 << 20)
    layout = derive_layout({"a": a, "b": b}, 4)
    assert layout.num_regions == 2
    assert layout.aliases == {"b": "a"}


def test_groups_are_kept_apart() -> None:
    """Tensors assigned to different KV cache groups form separate group layouts."""
    layout = derive_layout(
        {
            "full": desc("full", (2, 8, 16, 2, 8), 1 << 20),
            "swa": desc("swa", (2, 4, 16, 2, 8), 1 << 24),
        },
        {0: 8, 1: 4},
        groups={"swa": 1},
    )
    assert [g.num_blocks for g in layout.groups] == [8, 4]
    assert layout.group(1).regions[0].tensor == "swa"
    with pytest.raises(LayoutError, match="no KV cache group 2"):
        layout.group(2)


@pytest.mark.parametrize(
    ("tensors", "num_blocks", "match"),
    [
        ({}, 4, "no KV tensors"),
        ({"x": desc("x", (3, 16, 8), 0)}, 4, "tensor 'x'.*no block dimension of size 4"),
        (
            {"a": desc("a", (4, 16, 8), 0), "b": desc("b", (4, 16, 8), 1 << 20, device="cpu")},
            4,
            "tensor 'b' is on cpu",
        ),
        (
            {"nc": desc("nc", (4, 16, 8), 0, strides=(256, 1, 16))},
            4,
            "tensor 'nc'.*not contiguous",
        ),
        ({"o": desc("o", (4, 16, 8), 0, strides=(64, 8, 1))}, 4, "tensor 'o'.*blocks overlap"),
        (
            {"a": desc("a", (4, 16, 8), 0), "b": desc("b", (4, 16, 8), 256)},
            4,
            "tensors 'a' and 'b' overlap",
        ),
        ({"v": desc("v", (4,), 0)}, 4, "tensor 'v': needs at least 2 dims"),
    ],
)
def test_inconsistent_tensors_raise_a_layout_error_naming_them(
    tensors: dict[str, TensorDesc], num_blocks: int, match: str
) -> None:
    """Wrong block counts, devices, non-contiguous blocks and overlaps name the tensor."""
    with pytest.raises(LayoutError, match=match):
        derive_layout(tensors, num_blocks)


def test_block_counts_must_agree_within_a_group() -> None:
    """Two tensors of one group with different block counts are rejected."""
    with pytest.raises(LayoutError, match="no block count given for group 1"):
        derive_layout({"a": desc("a", (4, 8), 0)}, {0: 4}, groups={"a": 1})
    with pytest.raises(LayoutError, match="unknown tensors"):
        derive_layout({"a": desc("a", (4, 8), 0)}, 4, groups={"zz": 0})


def _layers(
    n: int, sizes: list[int] | None = None, groups: dict[str, int] | None = None
) -> KVLayout:
    """``n`` flash tensors ``l0..`` (K and V regions each) of head dims ``sizes``."""
    sizes = sizes or [8] * n
    tensors = {f"l{i}": desc(f"l{i}", (2, 4, 16, 2, sizes[i]), 1 << (20 + i)) for i in range(n)}
    nums = dict.fromkeys(set((groups or {}).values()) | {0}, 4)
    return derive_layout(tensors, nums, groups)


def test_layer_parts_cut_the_layers_in_order_into_parts_of_about_equal_bytes() -> None:
    """Eight equal layers in four parts: two layers a part, K and V together, the spans tiling
    the group's regions in order."""
    parts = layer_parts(_layers(8), 4)
    assert parts.count == 4
    assert [parts.part_of[f"l{i}"] for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s[0] for s in parts.spans] == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_layer_parts_never_split_a_tensor_and_drop_empty_parts() -> None:
    """More parts than tensors gives one part a tensor; a tensor bigger than a part's share
    takes the parts it covers, and the empty ones are dropped."""
    assert layer_parts(_layers(3), 8).count == 3
    parts = layer_parts(_layers(3, [64, 8, 8]), 4)
    assert [parts.part_of[f"l{i}"] for i in range(3)] == [0, 1, 1]
    assert parts.count == 2
    one = layer_parts(_layers(3), 1)
    assert one.count == 1
    assert one.spans == (((0, 6),),)


def test_a_cross_layer_layout_has_one_part() -> None:
    """One tensor for every layer cannot land by layer: one part, whatever is asked."""
    cross = derive_layout({"all": desc("all", (6, 32, 2, 16, 8, 128), 4096)}, 6)
    parts = layer_parts(cross, 4)
    assert parts.count == 1
    assert parts.part_of == {"all": 0}


def test_layer_parts_follow_the_layers_across_groups_and_aliases() -> None:
    """Layers of two groups (alternating, as sliding-window and full attention) are cut in
    registration order: each part has a contiguous span in each group; an alias shares its
    storage's part."""
    layout = _layers(4, groups={"l0": 0, "l1": 1, "l2": 0, "l3": 1})
    parts = layer_parts(layout, 2)
    assert [parts.part_of[f"l{i}"] for i in range(4)] == [0, 0, 1, 1]
    assert parts.spans == (((0, 2), (0, 2)), ((2, 4), (2, 4)))
    a = desc("a", (2, 4, 16, 2, 8), 1 << 20)
    b = desc("b", (2, 4, 16, 2, 8), 1 << 20)
    c = desc("c", (2, 4, 16, 2, 8), 1 << 22)
    aliased = layer_parts(derive_layout({"a": a, "b": b, "c": c}, 4), 2)
    assert aliased.part_of == {"a": 0, "b": 0, "c": 1}


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_layer_parts_refuse_a_bad_count(bad: object) -> None:
    """A part count that is not a positive int is a LayoutError naming it."""
    with pytest.raises(LayoutError, match="layer parts must be a positive int"):
        layer_parts(_layers(2), bad)  # type: ignore[arg-type]


def test_layer_parts_are_checked_against_the_groups_a_backend_registered() -> None:
    """Parts cut for one group count are a LayoutError (a ConfigError) on a layout of another."""
    parts = layer_parts(_layers(4, groups={"l0": 0, "l1": 1, "l2": 0, "l3": 1}), 2)
    parts.check_groups(2)
    with pytest.raises(LayoutError, match="layer parts do not cover this layout's 1 groups"):
        parts.check_groups(1)
