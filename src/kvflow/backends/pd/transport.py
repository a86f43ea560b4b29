"""The PD transport protocol: what a manager's ``LaunchCopies`` becomes on a data plane.

A transport joins one engine's ranks to one peer's (a pair per rank). Each side registers its KV
tensors once (``register``): per KV cache group, the tensors whose first dimension is the block
index (a FlashAttention ``(2, N, ...)`` cache registers ``t[0]`` and ``t[1]``); a block of group
``g`` is the bytes of row ``b`` of each of the group's tensors. ``launch`` starts one side of one
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

import torch
import xxhash
from attrs import frozen

from kvflow.backends.base import Fence, FenceStatus
from kvflow.core.pd.common import Pairs
from kvflow.errors import ConfigError, LayoutError


@runtime_checkable
class KVTransport(Protocol):
    """One engine rank's data plane to one peer rank."""

    name: str
    pushes_completions: bool

    def register(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        """Register this rank's KV tensors, once, before any launch."""
        ...

    def launch(self, transfer_id: str, epoch: int, send: bool, pairs: Pairs) -> Fence:
        """Start this side's copies of a hand-off (sender reads, receiver writes local blocks)."""
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
    """Consecutive pairs of one group that fit one staging slot; ``tag`` names it on the wire."""

    index: int
    group: int
    local: tuple[int, ...]
    remote: tuple[int, ...]
    tag: int


@frozen
class GroupGeometry:
    """A registered group: its tensors as (num_blocks, row bytes) byte views."""

    views: tuple[torch.Tensor, ...]
    num_blocks: int
    block_bytes: int


def geometry(groups: Sequence[Sequence[torch.Tensor]]) -> tuple[GroupGeometry, ...]:
    """Byte views of registered tensors; ``LayoutError`` names a tensor that cannot be used."""
    out = []
    for g, tensors in enumerate(groups):
        if not tensors:
            raise LayoutError(f"group {g} registers no tensors")
        views = []
        for i, t in enumerate(tensors):
            if t.device.type != "cpu" or not t.is_contiguous() or t.dim() < 1:
                raise LayoutError(
                    f"group {g} tensor {i}: need a contiguous CPU tensor, got {t.shape}"
                )
            views.append(t.view(torch.uint8).reshape(t.shape[0], -1))
        n = {v.shape[0] for v in views}
        if len(n) != 1:
            raise LayoutError(f"group {g}: tensors disagree on the number of blocks {sorted(n)}")
        out.append(GroupGeometry(tuple(views), n.pop(), sum(v.shape[1] for v in views)))
    return tuple(out)


def base_tag(transfer_id: str, epoch: int) -> int:
    """A hand-off's wire tag base: 31 bits of a hash of (transfer id, epoch), low 12 bits zero."""
    h = xxhash.xxh32_intdigest(f"{transfer_id}/{epoch}".encode())
    return (h & 0x7FFFF) << 12


def plan_chunks(
    transfer_id: str,
    epoch: int,
    pairs: Pairs,
    geo: Sequence[GroupGeometry],
    slot_bytes: int,
) -> list[Chunk]:
    """Split a launch into slot-sized chunks, the same way on both sides of the pair."""
    if len(pairs) > len(geo):
        raise ConfigError(f"{len(pairs)} groups of pairs but {len(geo)} registered groups")
    tag = base_tag(transfer_id, epoch)
    chunks: list[Chunk] = []
    for g, group_pairs in enumerate(pairs):
        per = max(1, slot_bytes // geo[g].block_bytes)
        if geo[g].block_bytes > slot_bytes:
            raise ConfigError(f"group {g}: a block ({geo[g].block_bytes} B) exceeds a slot")
        for lo in range(0, len(group_pairs), per):
            part = group_pairs[lo : lo + per]
            for local, _ in part:
                if not 0 <= local < geo[g].num_blocks:
                    raise ConfigError(f"group {g}: block {local} is not registered")
            idx = len(chunks)
            if idx >= 1 << 12:
                raise ConfigError(f"{transfer_id!r}: more than 4096 chunks; use bigger slots")
            chunks.append(
                Chunk(idx, g, tuple(p[0] for p in part), tuple(p[1] for p in part), tag + idx)
            )
    return chunks


def gather_rows(geo: GroupGeometry, blocks: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """Copy ``blocks`` into the front of the byte tensor ``out`` (region-major: every block's
    row of region 0, then of region 1, ...), with no temporary; returns the part used."""
    idx = torch.tensor(blocks, dtype=torch.long)
    pos = 0
    for v in geo.views:
        size = len(blocks) * v.shape[1]
        torch.index_select(v, 0, idx, out=out[pos : pos + size].view(len(blocks), v.shape[1]))
        pos += size
    return out[:pos]


def scatter_rows(geo: GroupGeometry, blocks: Sequence[int], data: torch.Tensor) -> None:
    """Write ``data`` (laid out as ``gather_rows`` makes it) into ``blocks``."""
    idx = torch.tensor(blocks, dtype=torch.long)
    pos = 0
    for v in geo.views:
        size = len(blocks) * v.shape[1]
        v.index_copy_(0, idx, data[pos : pos + size].view(len(blocks), v.shape[1]))
        pos += size


__all__ = [
    "Chunk",
    "GroupGeometry",
    "KVTransport",
    "base_tag",
    "gather_rows",
    "geometry",
    "plan_chunks",
    "scatter_rows",
]
