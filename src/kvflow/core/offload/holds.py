"""PD hand-offs' GPU block holds, kept on the offload manager's ledger beside the CPU tier's
transfers, so one object owns every kvflow reference on an engine's GPU blocks.

A PD hand-off holds the GPU blocks it reads (P: ``exclusive=False``, several hand-offs may read
one prefix-cached block) or writes (D: ``exclusive=True``, one hand-off's KV per block). A hold
takes one reference per block through the same ``GpuCacheView`` the ledger's loads use, so the
engine cannot reuse a block under a running copy whichever half of kvflow copies into it, and a
block written by one half is never a target of the other: an exclusive hold may not overlap a
live load's GPU blocks or another exclusive hold, and a load may not target an exclusively held
block. Every check runs before anything changes (``ProtocolError``, nothing changed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from attrs import define, field

from kvflow.core.gpu_view import GpuCacheView
from kvflow.errors import ProtocolError

GroupIds = tuple[tuple[int, ...], ...]


@define(eq=False, slots=True)
class Hold:
    """One hand-off's blocks: what it named per group, and the GPU blocks it references."""

    key: str
    ids: GroupIds
    exclusive: bool
    blocks: tuple[int, ...]  # each GPU block once (block ids are unique across groups)


@define(eq=False)
class GpuHolds:
    """Every PD hold of one engine; ``loads`` yields the GPU blocks live loads write."""

    gpu: GpuCacheView | None
    loads: Callable[[], Iterable[int]]
    _holds: dict[str, Hold] = field(factory=dict)
    _refs: Counter[int] = field(factory=Counter)
    _exclusive: dict[int, str] = field(factory=dict)  # block → the hold that writes it

    def check(self, key: str, ids: GroupIds, blocks: Sequence[int], *, exclusive: bool) -> None:
        """Raise ``ProtocolError`` (nothing changed) if the hold cannot be taken."""
        if key in self._holds:
            raise ProtocolError(f"hold {key!r} exists already")
        for b in blocks:
            owner = self._exclusive.get(b)
            if owner is not None:
                raise ProtocolError(f"GPU block {b} is written by hold {owner!r}")
        if exclusive:
            taken = set(blocks)
            if clash := taken & self._refs.keys():
                raise ProtocolError(f"GPU blocks {sorted(clash)} are held by another hand-off")
            if clash := taken.intersection(self.loads()):
                raise ProtocolError(f"GPU blocks {sorted(clash)} are targets of a CPU-tier load")

    def take(self, key: str, ids: GroupIds, blocks: Sequence[int], *, exclusive: bool) -> None:
        self.check(key, ids, blocks, exclusive=exclusive)
        unique = tuple(dict.fromkeys(blocks))
        self._holds[key] = Hold(key, ids, exclusive, unique)
        self._refs.update(unique)
        if exclusive:
            self._exclusive.update(dict.fromkeys(unique, key))
        if self.gpu is not None and unique:
            self.gpu.touch(unique)

    def give_back(self, key: str) -> GroupIds:
        h = self._holds.pop(key, None)
        if h is None:
            raise ProtocolError(f"hold {key!r} does not exist (given back twice?)")
        for b in h.blocks:
            self._refs[b] -= 1
            if not self._refs[b]:
                del self._refs[b]
            if h.exclusive:
                del self._exclusive[b]
        if self.gpu is not None and h.blocks:
            self.gpu.free(h.blocks[::-1])
        return h.ids

    def check_load(self, blocks: Iterable[int]) -> None:
        """A CPU-tier load may not write a block a PD hand-off holds exclusively."""
        if not self._exclusive:
            return
        for b in blocks:
            if b in self._exclusive:
                raise ProtocolError(
                    f"GPU block {b} is a load target and held by hand-off {self._exclusive[b]!r}"
                )

    def refs(self) -> Counter[int]:
        """How many holds reference each GPU block."""
        return Counter(self._refs)

    def exclusive_blocks(self) -> dict[int, str]:
        return dict(self._exclusive)

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, key: str) -> bool:
        return key in self._holds


__all__ = ["GpuHolds", "Hold"]
