"""One engine rank's data plane to several peer ranks, as one transport: the parts of a hand-off
between engines of different TP sizes (``kvflow.core.pd.tp``).

Each part is a transport to one peer rank and the range of this rank's kv heads it moves
(None: all of them). ``register`` gives each part the head slice of every KV tensor (a strided
view, no copy: the part's transport stages it); ``launch`` starts the hand-off on every part and
its fence settles once every part's has, FAILED if any part failed, so nothing of a launch still
writes a block after its fence settled. A rank whose peer ranks need none of its heads has no
parts: its launches are DONE at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from attrs import define

from kvflow.backends.base import Fence, FenceStatus
from kvflow.backends.pd.transport import KVTransport
from kvflow.core.pd.common import LaunchCopies
from kvflow.core.pd.tp import Heads
from kvflow.errors import ConfigError, ProtocolError

HEAD_DIM = 2
"""Where the kv heads are in a registered tensor: the engine's ``(blocks, tokens, heads, dim)``."""


@define(eq=False)
class FanFence:
    """One launch over every part: the parts' own fences."""

    transfer_id: str
    parts: list[Fence]


class FanTransport:
    """Several transports of one rank, each moving a head slice, driven as one."""

    pushes_completions = True

    def __init__(
        self, parts: Sequence[tuple[KVTransport, Heads | None]], *, head_dim: int = HEAD_DIM
    ) -> None:
        for _, heads in parts:
            if heads is not None and not 0 <= heads[0] < heads[1]:
                raise ConfigError(f"fan transport: head range {heads} is empty or negative")
        self.parts = list(parts)
        self.head_dim = head_dim
        self.name = self.parts[0][0].name if self.parts else "none"
        self.pushes_completions = all(t.pushes_completions for t, _ in self.parts)

    def register(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        for transport, heads in self.parts:
            transport.register([[self._slice(t, heads) for t in g] for g in groups])

    def _slice(self, t: torch.Tensor, heads: Heads | None) -> torch.Tensor:
        if heads is None:
            return t
        if t.dim() <= self.head_dim or heads[1] > t.shape[self.head_dim]:
            raise ConfigError(
                f"fan transport: heads {heads} outside dimension {self.head_dim} of a KV "
                f"tensor of shape {tuple(t.shape)}"
            )
        return t.narrow(self.head_dim, heads[0], heads[1] - heads[0])

    def launch(self, op: LaunchCopies) -> FanFence:
        fences: list[Fence] = []
        try:
            for transport, _ in self.parts:
                fences.append(transport.launch(op))
        except BaseException:
            for (transport, _), f in zip(self.parts, fences, strict=False):
                transport.cancel(f)
            raise
        return FanFence(op.transfer_id, fences)

    def query(self, fence: Fence) -> FenceStatus:
        if not isinstance(fence, FanFence):
            raise ProtocolError(f"not a fan transport fence: {fence!r}")
        statuses = [t.query(f) for (t, _), f in zip(self.parts, fence.parts, strict=True)]
        if FenceStatus.PENDING in statuses:
            return FenceStatus.PENDING
        return FenceStatus.FAILED if FenceStatus.FAILED in statuses else FenceStatus.DONE

    def cancel(self, fence: Fence) -> None:
        if isinstance(fence, FanFence):
            for (t, _), f in zip(self.parts, fence.parts, strict=True):
                t.cancel(f)

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        for t, _ in self.parts:
            t.set_wakeup(wakeup)

    def close(self) -> None:
        errors: list[BaseException] = []
        for t, _ in self.parts:
            try:
                t.close()
            except Exception as e:  # close every part; report the first failure
                errors.append(e)
        if errors:
            raise errors[0]

    @property
    def stats(self) -> dict[str, Any]:
        return {"transport": self.name, "parts": len(self.parts)}


__all__ = ["HEAD_DIM", "FanFence", "FanTransport"]
