"""Where the two ends of a one-sided PD transport (NIXL, CUDA IPC) meet: a 2-rank ``TCPStore``
at an address both sides know (the producer's side hosts it, as for the gloo pair).

Each side publishes what its peer needs once per pair (NIXL agent metadata, CUDA IPC handles, the
registered layout) and reads the peer's, every read bounded by the pair's timeout. Also what both
transports share: the registered regions of a side (``SideLayout``), checked against the peer's,
and the one-launch checks (group count, block ranges, channel).
"""

from __future__ import annotations

import datetime
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from attrs import asdict, frozen
from torch._C._distributed_c10d import TCPStore

from kvflow.core.pd.common import CHANNELS, BlockPairs, Pairs
from kvflow.errors import BackendError, ConfigError, LayoutError

MODES = ("read", "write")
"""Who copies in a one-sided pair: ``read`` (D pulls P's blocks) or ``write`` (P pushes)."""


class PairStore:
    """The pair's key-value store: ``publish`` this side's values, ``fetch`` the peer's."""

    def __init__(
        self, *, pair_rank: int, host: str, port: int, timeout_s: float, what: str
    ) -> None:
        if pair_rank not in (0, 1) or timeout_s <= 0:
            raise ConfigError(
                f"{what}: pair_rank must be 0 or 1 and timeout_s positive "
                f"(got {pair_rank}, {timeout_s})"
            )
        self.pair_rank = pair_rank
        self.peer = 1 - pair_rank
        self.timeout_s = timeout_s
        self.what = what
        self._timeout = datetime.timedelta(seconds=timeout_s)
        try:
            # The host does not wait for the peer here: the first ``fetch`` does, bounded.
            self._store = TCPStore(
                host, port, 2, pair_rank == 0, timeout=self._timeout, wait_for_workers=False
            )
        except (RuntimeError, ValueError) as e:
            raise BackendError(
                f"{what}: no pair with {host}:{port} within {timeout_s} s: {e}"
            ) from e

    def publish(self, key: str, value: bytes) -> None:
        self._store.set(f"{self.pair_rank}/{key}", value)  # type: ignore[arg-type]  # bytes work

    def fetch(self, key: str) -> bytes:
        """The peer's value of ``key``; ``BackendError`` when it is not there within the timeout."""
        name = f"{self.peer}/{key}"
        try:
            self._store.wait([name], self._timeout)
            value: bytes = self._store.get(name)
        except (RuntimeError, ValueError) as e:
            raise BackendError(
                f"{self.what}: the peer did not publish {key!r} within {self.timeout_s} s: {e}"
            ) from e
        return value


@frozen
class Region:
    """One registered tensor: ``num_blocks`` rows of ``row_bytes`` from ``base``, ``stride`` apart."""

    base: int
    row_bytes: int
    stride: int
    num_blocks: int
    device: int  # -1: host memory

    @property
    def span(self) -> int:
        """Bytes from ``base`` to the end of the last row (what is registered)."""
        return (self.num_blocks - 1) * self.stride + self.row_bytes


@frozen
class SideLayout:
    """One side's registered KV tensors, per group its regions (what the peer must match)."""

    groups: tuple[tuple[Region, ...], ...]

    @classmethod
    def of(cls, groups: Sequence[Sequence[torch.Tensor]], *, what: str) -> SideLayout:
        """The regions of registered tensors; ``LayoutError`` names one that cannot be used."""
        out = []
        for g, tensors in enumerate(groups):
            if not tensors:
                raise LayoutError(f"{what}: group {g} registers no tensors")
            regions = []
            for i, t in enumerate(tensors):
                if t.device.type not in ("cpu", "cuda"):
                    raise LayoutError(f"{what}: group {g} tensor {i} is on {t.device}")
                if t.dim() < 1 or t.shape[0] == 0 or not t[0].is_contiguous():
                    raise LayoutError(
                        f"{what}: group {g} tensor {i}: need blocks along dim 0, each row "
                        f"contiguous, got shape {tuple(t.shape)} strides {t.stride()}"
                    )
                row = t[0].numel() * t.element_size()
                stride = t.stride(0) * t.element_size()
                if stride < row:
                    raise LayoutError(f"{what}: group {g} tensor {i}: rows overlap")
                device = (t.device.index or 0) if t.device.type == "cuda" else -1
                regions.append(Region(t.data_ptr(), row, stride, t.shape[0], device))
            n = {r.num_blocks for r in regions}
            if len(n) != 1:
                raise LayoutError(
                    f"{what}: group {g}: tensors disagree on the number of blocks {sorted(n)}"
                )
            out.append(tuple(regions))
        return cls(tuple(out))

    def num_blocks(self, group: int) -> int:
        return self.groups[group][0].num_blocks

    def block_bytes(self, group: int) -> int:
        return sum(r.row_bytes for r in self.groups[group])

    def to_bytes(self) -> bytes:
        return json.dumps([[asdict(r) for r in g] for g in self.groups]).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> SideLayout:
        raw: Any = json.loads(data)
        return cls(tuple(tuple(Region(**r) for r in g) for g in raw))

    def check_peer(self, peer: SideLayout, *, what: str) -> None:
        """``LayoutError`` naming the first difference a copy between the two cannot bridge."""
        if len(peer.groups) != len(self.groups):
            raise LayoutError(
                f"{what}: this side registered {len(self.groups)} groups, the peer "
                f"{len(peer.groups)}"
            )
        for g, (mine, theirs) in enumerate(zip(self.groups, peer.groups, strict=True)):
            a = [r.row_bytes for r in mine]
            b = [r.row_bytes for r in theirs]
            if a != b:
                raise LayoutError(f"{what}: group {g}: row bytes per region {a} here, {b} there")


_PAIR = np.dtype([("local", np.int64), ("remote", np.int64)])
_NO_PAIRS = np.zeros((0, 2), dtype=np.int64)
_NO_PAIRS.setflags(write=False)


def pair_array(group_pairs: Any) -> Any:
    """A group's ``(local, remote)`` pairs as one ``(n, 2)`` int64 array, for reading only (it
    may be shared or a view of packed bytes): from ``BlockPairs`` both columns packed in one
    pass, from tuples without building a Python object per pair."""
    if isinstance(group_pairs, np.ndarray):
        return group_pairs.astype(np.int64, copy=False).reshape(-1, 2)
    if isinstance(group_pairs, BlockPairs):
        n = len(group_pairs)
        if n == 0:
            return _NO_PAIRS
        try:
            # ``struct`` reads a tuple of ints into machine integers faster than numpy does.
            packed = struct.pack(f"{2 * n}q", *group_pairs.local, *group_pairs.remote)
        except struct.error:  # not all ints, or past int64: numpy's conversion says how
            arr = np.empty((n, 2), dtype=np.int64)
            arr[:, 0] = group_pairs.local
            arr[:, 1] = group_pairs.remote
            return arr
        return np.frombuffer(packed, dtype=np.int64).reshape(2, n).T
    # numpy reads each 2-tuple as one record: the fastest way from tuples to an array.
    rec = np.fromiter(group_pairs, dtype=_PAIR, count=len(group_pairs))
    return rec.view(np.int64).reshape(-1, 2)


def check_launch(
    pairs: Pairs, local: SideLayout, remote: SideLayout, channel: int, *, what: str
) -> tuple[Any, ...]:
    """``ConfigError`` for a launch that names a group or block that is not registered; else
    each group's pairs as a ``pair_array``, so that the caller converts them once."""
    if len(pairs) > len(local.groups):
        raise ConfigError(f"{what}: {len(pairs)} groups of pairs, {len(local.groups)} registered")
    if not 0 < channel < CHANNELS:
        raise ConfigError(f"{what}: channel {channel} is outside 1..{CHANNELS - 1}")
    arrays = []
    for g, gp in enumerate(pairs):
        if not len(gp):
            arrays.append(_NO_PAIRS)
            continue
        arr = pair_array(gp)
        arrays.append(arr)
        if not len(arr):
            continue
        hi = arr.max(axis=0)
        if int(arr.min()) >= 0 and hi[0] < local.num_blocks(g) and hi[1] < remote.num_blocks(g):
            continue
        for col, side, name in ((0, local, "local"), (1, remote, "remote")):
            n = side.num_blocks(g)
            ids = arr[:, col]
            if int(ids.min()) < 0 or int(ids.max()) >= n:
                bad = ids[(ids < 0) | (ids >= n)]
                raise ConfigError(
                    f"{what}: group {g}: {name} block {int(bad[0])} is outside 0..{n - 1}"
                )
    return tuple(arrays)


def sorted_pairs(group_pairs: Any) -> tuple[Any, Any]:
    """A group's pairs as (local, remote) int64 arrays ordered by local id, so that runs of
    consecutive blocks on both sides sit next to each other."""
    arr = pair_array(group_pairs)
    order = np.argsort(arr[:, 0], kind="stable")
    return arr[order, 0], arr[order, 1]


__all__ = [
    "MODES",
    "PairStore",
    "Region",
    "SideLayout",
    "check_launch",
    "pair_array",
    "sorted_pairs",
]
