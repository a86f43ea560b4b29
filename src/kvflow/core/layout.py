"""KV tensors → memory regions, without touching the tensors (sans-IO).

An engine hands kvflow its KV cache tensors by name. Each is described by a ``TensorDesc`` (shape,
strides, element size, address, device) and classified by where its block dimension sits:

- ``KV_FIRST``: FlashAttention style ``(2, num_blocks, ...)`` → a K region and a V region;
- ``BLOCK_FIRST``: FlashInfer / MLA style ``(num_blocks, ...)`` → one region per tensor;
  a cross-layer tensor ``(num_blocks, num_layers, ...)`` is one region holding every layer.

A region is ``num_blocks`` pages of ``page_bytes`` contiguous bytes, ``block_stride_bytes`` apart.
Tensors that alias the same storage are registered once. The CPU tier mirrors the regions
block-major: CPU block ``b`` of a group holds the pages of all its regions back to back, so a whole
block is one contiguous piece for the copy engine.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Iterable, Mapping

from attrs import field, frozen

from kvflow.errors import LayoutError


class KVStyle(enum.StrEnum):
    KV_FIRST = "kv_first"
    BLOCK_FIRST = "block_first"


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    """A typed converter: mypy's attrs plugin cannot bind ``converter=tuple``'s type variable."""
    return tuple(int(v) for v in values)


@frozen
class TensorDesc:
    """What kvflow needs to know of one KV tensor; built from a torch tensor by the runtime."""

    name: str
    shape: tuple[int, ...] = field(converter=_ints)
    strides: tuple[int, ...] = field(converter=_ints)  # in elements, like torch
    itemsize: int
    data_ptr: int
    device: str
    dtype: str = "unknown"

    def __attrs_post_init__(self) -> None:
        if len(self.shape) != len(self.strides):
            raise LayoutError(f"tensor {self.name!r}: shape {self.shape} vs strides {self.strides}")
        if self.itemsize <= 0:
            raise LayoutError(f"tensor {self.name!r}: itemsize must be positive")


@frozen
class Region:
    """``num_blocks`` pages of ``page_bytes`` contiguous bytes, ``block_stride_bytes`` apart."""

    name: str
    tensor: str
    group: int
    base_ptr: int
    offset_bytes: int  # from the tensor's data_ptr, for backends that index tensors
    page_bytes: int
    block_stride_bytes: int
    num_blocks: int


@frozen
class GroupLayout:
    """The regions of one KV cache group and where each lands inside a block-major CPU block."""

    group: int
    num_blocks: int
    regions: tuple[Region, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block across all regions: the size of one CPU block."""
        return sum(r.page_bytes for r in self.regions)

    @property
    def cpu_offsets(self) -> tuple[int, ...]:
        """Byte offset of each region's page inside a CPU block."""
        out, acc = [], 0
        for r in self.regions:
            out.append(acc)
            acc += r.page_bytes
        return tuple(out)


@frozen
class KVLayout:
    """All regions of an engine's KV cache, per group, on one device."""

    device: str
    groups: tuple[GroupLayout, ...]
    styles: Mapping[str, KVStyle]
    aliases: Mapping[str, str]  # tensor → the tensor it shares storage with

    @property
    def num_regions(self) -> int:
        return sum(len(g.regions) for g in self.groups)

    def group(self, g: int) -> GroupLayout:
        if not 0 <= g < len(self.groups):
            raise LayoutError(f"no KV cache group {g}; layout has {len(self.groups)}")
        return self.groups[g]


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def classify(desc: TensorDesc, num_blocks: int) -> KVStyle:
    """Where the block dimension of ``desc`` is, given the engine's block count."""
    if len(desc.shape) < 2:
        raise LayoutError(f"tensor {desc.name!r}: needs at least 2 dims, has shape {desc.shape}")
    if desc.shape[0] == num_blocks:
        return KVStyle.BLOCK_FIRST
    if desc.shape[0] == 2 and len(desc.shape) >= 3 and desc.shape[1] == num_blocks:
        return KVStyle.KV_FIRST
    raise LayoutError(
        f"tensor {desc.name!r}: shape {desc.shape} has no block dimension of size {num_blocks} "
        "(expected (num_blocks, ...) or (2, num_blocks, ...))"
    )


def _regions_of(desc: TensorDesc, style: KVStyle, group: int, num_blocks: int) -> list[Region]:
    item = desc.itemsize
    if style is KVStyle.BLOCK_FIRST:
        page_shape, page_strides = desc.shape[1:], desc.strides[1:]
        starts = [("", 0)]
        block_stride = desc.strides[0]
    else:
        page_shape, page_strides = desc.shape[2:], desc.strides[2:]
        starts = [("/k", 0), ("/v", desc.strides[0])]
        block_stride = desc.strides[1]
    if not _is_contiguous(page_shape, page_strides):
        raise LayoutError(
            f"tensor {desc.name!r}: one block (shape {page_shape}, strides {page_strides}) is not "
            "contiguous in memory"
        )
    page_elems = math.prod(page_shape)
    if num_blocks > 1 and block_stride < page_elems:
        raise LayoutError(
            f"tensor {desc.name!r}: blocks overlap (block stride {block_stride} < page {page_elems})"
        )
    return [
        Region(
            name=desc.name + suffix,
            tensor=desc.name,
            group=group,
            base_ptr=desc.data_ptr + off * item,
            offset_bytes=off * item,
            page_bytes=page_elems * item,
            block_stride_bytes=block_stride * item,
            num_blocks=num_blocks,
        )
        for suffix, off in starts
    ]


def _extent(desc: TensorDesc) -> tuple[int, int]:
    last = sum((s - 1) * st for s, st in zip(desc.shape, desc.strides, strict=True))
    return desc.data_ptr, desc.data_ptr + (last + 1) * desc.itemsize


def derive_layout(
    tensors: Mapping[str, TensorDesc],
    num_blocks: int | Mapping[int, int],
    groups: Mapping[str, int] | None = None,
    device: str | None = None,
) -> KVLayout:
    """Regions of every KV tensor, grouped; raises ``LayoutError`` naming the offending tensor.

    ``num_blocks`` is the engine's block count (per group if a mapping); ``groups`` maps tensor
    names to KV cache group ids (default: all in group 0).
    """
    if not tensors:
        raise LayoutError("no KV tensors given")
    groups = dict(groups or {})
    unknown = set(groups) - set(tensors)
    if unknown:
        raise LayoutError(f"group assignment names unknown tensors: {sorted(unknown)}")
    first = next(iter(tensors.values()))
    device = device if device is not None else first.device
    by_group: dict[int, list[Region]] = {}
    styles: dict[str, KVStyle] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...], int], str] = {}
    extents: list[tuple[int, int, str]] = []
    for name, desc in tensors.items():
        if desc.name != name:
            raise LayoutError(f"tensor registered as {name!r} describes itself as {desc.name!r}")
        if desc.device != device:
            raise LayoutError(f"tensor {name!r} is on {desc.device}, expected {device}")
        g = groups.get(name, 0)
        if g < 0:
            raise LayoutError(f"tensor {name!r}: negative group {g}")
        if isinstance(num_blocks, int):
            n = num_blocks
        elif g in num_blocks:
            n = num_blocks[g]
        else:
            raise LayoutError(f"tensor {name!r}: no block count given for group {g}")
        style = classify(desc, n)
        key = (desc.data_ptr, desc.shape, desc.strides, desc.itemsize)
        if key in seen:
            aliases[name] = seen[key]
            styles[name] = style
            continue
        seen[key] = name
        regions = _regions_of(desc, style, g, n)
        styles[name] = style
        if by_group.get(g) and by_group[g][0].num_blocks != n:
            raise LayoutError(
                f"tensor {name!r} has {n} blocks, group {g} has {by_group[g][0].num_blocks}"
            )
        by_group.setdefault(g, []).extend(regions)
        lo, hi = _extent(desc)
        extents.append((lo, hi, name))
    extents.sort()
    for (_, hi_a, a), (lo_b, _, b) in itertools.pairwise(extents):
        if lo_b < hi_a:
            raise LayoutError(
                f"tensors {a!r} and {b!r} overlap in memory without being the same view"
            )
    if sorted(by_group) != list(range(len(by_group))):
        raise LayoutError(f"KV cache groups must be numbered 0..n-1, got {sorted(by_group)}")
    return KVLayout(
        device=device,
        groups=tuple(
            GroupLayout(group=g, num_blocks=regs[0].num_blocks, regions=tuple(regs))
            for g, regs in sorted(by_group.items())
        ),
        styles=styles,
        aliases=aliases,
    )


@frozen
class LayerParts:
    """A load cut by layer, so that each layer's compute need wait only for its own part.

    Part ``k`` copies, in KV cache group ``g``, the regions ``spans[k][g]`` (``(lo, hi)``,
    possibly empty) of every block; the parts' spans tile each group's regions in order.
    ``part_of`` names each registered tensor's part (an alias shares its storage's).
    """

    spans: tuple[tuple[tuple[int, int], ...], ...]
    part_of: Mapping[str, int]

    @property
    def count(self) -> int:
        return len(self.spans)

    def check_groups(self, groups: int) -> None:
        """``LayoutError`` unless every part has a span for each of ``groups`` KV cache groups
        (a backend's check of parts against the layout it registered)."""
        if not self.spans or any(len(spans) != groups for spans in self.spans):
            raise LayoutError(f"layer parts do not cover this layout's {groups} groups")


def layer_parts(layout: KVLayout, parts: int) -> LayerParts:
    """Cut ``layout``'s tensors, in the order the engine registered them (its layers' order),
    into at most ``parts`` runs of about equal bytes, never splitting a tensor: a layout of one
    tensor (cross-layer blocks) has one part whatever is asked."""
    if type(parts) is not int or parts < 1:
        raise LayoutError(f"layer parts must be a positive int, got {parts!r}")
    own: dict[str, list[tuple[int, int]]] = {}  # tensor -> (group, region index) of its regions
    for g in layout.groups:
        for i, r in enumerate(g.regions):
            own.setdefault(r.tensor, []).append((g.group, i))
    sizes = {
        t: sum(layout.groups[g].regions[i].page_bytes for g, i in where) for t, where in own.items()
    }
    total = sum(sizes.values())
    order = [t for t in layout.styles if t in own]  # registration order, aliases left out
    raw: dict[str, int] = {}
    acc = 0
    for t in order:
        raw[t] = min(parts - 1, acc * parts // total) if total else 0
        acc += sizes[t]
    # Parts no tensor fell into are dropped; the rest keep their order.
    renumber = {k: n for n, k in enumerate(sorted(set(raw.values())))}
    part_of = {t: renumber[k] for t, k in raw.items()}
    count = len(renumber)
    spans: list[list[tuple[int, int]]] = [[(0, 0)] * len(layout.groups) for _ in range(count)]
    for g in layout.groups:
        at = 0
        for k in range(count):
            lo = at
            while at < len(g.regions) and part_of[g.regions[at].tensor] == k:
                at += 1
            spans[k][g.group] = (lo, at)
        if at != len(g.regions):
            # Regions out of registration order: one part, the whole load.
            return LayerParts(
                spans=(tuple((0, len(x.regions)) for x in layout.groups),),
                part_of=dict.fromkeys(layout.styles, 0),
            )
    for alias, target in layout.aliases.items():
        part_of[alias] = part_of[target]
    return LayerParts(spans=tuple(tuple(s) for s in spans), part_of=part_of)


__all__ = [
    "GroupLayout",
    "KVLayout",
    "KVStyle",
    "LayerParts",
    "Region",
    "TensorDesc",
    "classify",
    "derive_layout",
    "layer_parts",
]
