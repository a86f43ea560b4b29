"""The PD transport protocol: what a manager's ``LaunchCopies`` becomes on a data plane.

A transport joins one engine's ranks to one peer's (a pair per rank). Each side registers its KV
tensors once (``register``): per KV cache group, the tensors whose first dimension is the block
index (a FlashAttention ``(2, N, ...)`` cache registers ``t[0]`` and ``t[1]``); a block of group
``g`` is the bytes of row ``b`` of each of the group's tensors. A tensor may be a strided view
whose last dimension is contiguous (a head slice ``t[:, :, lo:hi]`` when P and D have different
TP sizes): its rows are then always staged, gathered from or scattered into the view. ``launch`` starts one side of one
hand-off's copies, ``(local block, remote block)`` pairs per group: on the sender it reads local
blocks, on the receiver it writes them. It returns a fence that ``query`` answers cheaply, never
blocking, so the runtime's ``Reactor`` can await it like a backend's. ``cancel`` stops what has
not started; the fence still settles (FAILED) once nothing of the launch runs any more.

``plan_chunks`` is the one chunking both sides of a pair derive from the same pairs, so chunk
``i`` on the sender matches chunk ``i`` on the receiver without any message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from attrs import frozen

from kvflow.backends.base import Fence, FenceStatus
from kvflow.core.pd.common import CHANNELS, OP_BITS, LaunchCopies, Pairs
from kvflow.errors import ConfigError, LayoutError


@runtime_checkable
class KVTransport(Protocol):
    """One engine rank's data plane to one peer rank."""

    name: str
    pushes_completions: bool

    def register(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        """Register this rank's KV tensors, once, before any launch."""
        ...

    def launch(self, op: LaunchCopies) -> Fence:
        """Start this side's copies of a hand-off (sender reads, receiver writes local blocks);
        both sides' copies match on ``op.channel``, which P's manager keeps unique."""
        ...

    def query(self, fence: Fence) -> FenceStatus:
        """Has every copy of the launch finished? Cheap, never blocks."""
        ...

    def cancel(self, fence: Fence) -> None:
        """Skip what has not started; the fence settles FAILED once nothing runs."""
        ...

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        """Call ``wakeup`` (from any thread) when some fence may have settled."""
        ...

    def close(self) -> None:
        """Stop, fail what is pending, release the staging ring and the peer. Idempotent."""
        ...


@frozen
class Chunk:
    """Consecutive pairs of one group that fit one staging slot, or (``direct``) all the group's
    blocks sent straight from / received straight into their rows, one wire op per block and
    region, all posted at once; ``tag`` is the first op's tag on the wire."""

    index: int
    group: int
    local: tuple[int, ...]
    remote: tuple[int, ...]
    tag: int
    direct: bool = False


@frozen
class GroupGeometry:
    """A registered group: its tensors as (num_blocks, row) views of a wide integer type (or,
    ``strided``, views of the block rows' own shape whose last dimension is contiguous: a head
    slice); ``block_bytes`` is one block's bytes over all of them. Staging offsets stay
    multiples of 8 (rows of 8-byte elements), so each region's part of a slot can be viewed in
    its type."""

    views: tuple[torch.Tensor, ...]
    num_blocks: int
    block_bytes: int
    strided: bool = False


def row_bytes(view: torch.Tensor) -> int:
    """The bytes of one block's row of a registered view."""
    return view[0].numel() * view.element_size()


def geometry(groups: Sequence[Sequence[torch.Tensor]]) -> tuple[GroupGeometry, ...]:
    """Byte views of registered tensors; ``LayoutError`` names a tensor that cannot be used."""
    out = []
    for g, tensors in enumerate(groups):
        if not tensors:
            raise LayoutError(f"group {g} registers no tensors")
        views = []
        strided = not all(t.is_contiguous() for t in tensors)
        for i, t in enumerate(tensors):
            if t.device.type != "cpu" or t.dim() < 1 or (strided and t.stride(-1) != 1):
                raise LayoutError(
                    f"group {g} tensor {i}: need a CPU tensor, contiguous or a strided view "
                    f"with a contiguous last dimension, got {tuple(t.shape)} {t.stride()}"
                )
            b = t.view(torch.uint8)
            views.append(b if strided else b.reshape(t.shape[0], -1))
        views = _widen(views)
        n = {v.shape[0] for v in views}
        if len(n) != 1:
            raise LayoutError(f"group {g}: tensors disagree on the number of blocks {sorted(n)}")
        out.append(GroupGeometry(tuple(views), n.pop(), sum(map(row_bytes, views)), strided))
    return tuple(out)


def _widen(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Byte rows as rows of the widest integer type every tensor of the group allows (one type
    for the group, so offsets in a slot stay aligned): torch's CPU ``index_copy_`` moves
    8-byte elements about ten times faster than bytes."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=dtype).element_size()
        if all(
            r.shape[-1] % size == 0
            and r.data_ptr() % size == 0
            and all(st % size == 0 for st in r.stride()[:-1])
            for r in rows
        ):
            return [r.view(dtype) for r in rows]
    return rows


MAX_OPS = 1 << OP_BITS
"""Wire operations per hand-off: a tag is ``channel << OP_BITS | op``."""


def plan_chunks(
    channel: int,
    pairs: Pairs,
    geo: Sequence[GroupGeometry],
    slot_bytes: int,
    direct_min_bytes: int | None = None,
) -> list[Chunk]:
    """Split a launch into slot-sized chunks, the same way on both sides of the pair (which
    must agree on ``slot_bytes`` and ``direct_min_bytes``). Blocks of a group whose blocks are
    at least ``direct_min_bytes`` go in one direct chunk, without staging, if the ops fit."""
    if len(pairs) > len(geo):
        raise ConfigError(f"{len(pairs)} groups of pairs but {len(geo)} registered groups")
    if not 0 < channel < CHANNELS:
        raise ConfigError(f"channel {channel} is outside 1..{CHANNELS - 1}")
    tag = channel << OP_BITS
    direct_ops = sum(
        len(gp) * len(geo[g].views)
        for g, gp in enumerate(pairs)
        if direct_min_bytes is not None and geo[g].block_bytes >= direct_min_bytes
    )
    chunks: list[Chunk] = []
    op = 0
    for g, group_pairs in enumerate(pairs):
        for block, _ in group_pairs:
            if not 0 <= block < geo[g].num_blocks:
                raise ConfigError(f"group {g}: block {block} is not registered")
        direct = (
            direct_min_bytes is not None
            and geo[g].block_bytes >= direct_min_bytes
            and direct_ops <= MAX_OPS
        )
        if not direct and geo[g].block_bytes > slot_bytes:
            raise ConfigError(f"group {g}: a block ({geo[g].block_bytes} B) exceeds a slot")
        per = len(group_pairs) if direct else max(1, slot_bytes // geo[g].block_bytes)
        for lo in range(0, len(group_pairs), max(per, 1)):
            part = group_pairs[lo : lo + per]
            ops = len(part) * len(geo[g].views) if direct else 1
            if op + ops > MAX_OPS:
                raise ConfigError(f"more than {MAX_OPS} wire ops in one hand-off; use bigger slots")
            local = tuple(p[0] for p in part)
            remote = tuple(p[1] for p in part)
            chunks.append(Chunk(len(chunks), g, local, remote, tag + op, direct))
            op += ops
    return chunks


def gather_rows(geo: GroupGeometry, blocks: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """Copy ``blocks`` into the front of the byte tensor ``out`` (region-major: every block's
    row of region 0, then of region 1, ...), with no temporary; returns the part used."""
    idx = torch.tensor(blocks, dtype=torch.long)
    pos = 0
    for v in geo.views:
        size = len(blocks) * row_bytes(v)
        dst = out[pos : pos + size].view(v.dtype).view(len(blocks), *v.shape[1:])
        torch.index_select(v, 0, idx, out=dst)
        pos += size
    return out[:pos]


def scatter_rows(geo: GroupGeometry, blocks: Sequence[int], data: torch.Tensor) -> None:
    """Write ``data`` (laid out as ``gather_rows`` makes it) into ``blocks``. numpy's row
    assignment copies a row at memcpy speed (and releases the GIL), about twice torch's CPU
    ``index_copy_`` on rows of 32 KiB and more."""
    idx = np.asarray(blocks, dtype=np.intp)
    pos = 0
    for v in geo.views:
        size = len(blocks) * row_bytes(v)
        rows = data[pos : pos + size].view(v.dtype).view(len(blocks), *v.shape[1:])
        v.numpy()[idx] = rows.numpy()
        pos += size


__all__ = [
    "Chunk",
    "GroupGeometry",
    "KVTransport",
    "gather_rows",
    "geometry",
    "plan_chunks",
    "row_bytes",
    "scatter_rows",
]
