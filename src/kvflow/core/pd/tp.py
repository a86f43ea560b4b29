"""Heterogeneous tensor parallelism of a PD hand-off: which P rank sends which KV heads to which
D rank, as a pure function of the two TP sizes and the model's KV heads.

Each rank of a TP engine holds the KV of its own heads (``engine/tp.py`` shards the kv heads
like the q heads: rank ``r`` of ``tp`` holds heads ``[r * H / tp, (r + 1) * H / tp)``). When
``tp > H`` and ``tp`` is a multiple of ``H`` the kv heads are replicated instead (vLLM's rule):
rank ``r`` holds head ``r // (tp / H)``. A layout whose KV has no head dimension to shard (an
MLA latent, ``REPLICATED_LAYOUTS``) is whole on every rank. D rank ``d`` needs its heads; they
lie on one P rank or several, and where several P ranks hold the same heads (replication) the
one taken is spread over D's ranks. Every transfer is then one ``HeadSlice``: a P rank, a D
rank, the global heads, and where they lie in each side's shard.
"""

from __future__ import annotations

import itertools

from attrs import frozen

from kvflow.errors import ConfigError

REPLICATED_LAYOUTS = frozenset({"mla"})
"""KV layouts with no head dimension to shard: every rank holds the whole KV."""

TP_MAPPED_LAYOUTS = frozenset({"flash_attn"})
"""Layouts whose engines exchange KV between different TP sizes: the reference engine's, whose
``num_kv_heads`` is the model's and whose ranks' pairs move head slices (``pd.worker``). Any
other layout (vLLM's, whose ``num_kv_heads`` is a rank's) is refused at HELLO when the TP sizes
differ; the plan itself covers replicated layouts for an engine that wires them."""

Heads = tuple[int, int]
"""A half-open range of kv heads ``[lo, hi)``."""


@frozen
class HeadSlice:
    """One part of a hand-off: P rank ``p_rank`` sends global kv heads ``heads`` to D rank
    ``d_rank``; ``p_local`` / ``d_local`` are those heads' range in each side's own shard."""

    p_rank: int
    d_rank: int
    heads: Heads
    p_local: Heads
    d_local: Heads
    p_shard: int  # kv heads a P rank holds
    d_shard: int  # kv heads a D rank holds

    @property
    def sliced(self) -> bool:
        """Whether either side moves part of its shard (its rows are strided, so staged)."""
        return self.p_local != (0, self.p_shard) or self.d_local != (0, self.d_shard)

    def local(self, producer: bool) -> Heads:
        """This side's range: P's when ``producer``, else D's."""
        return self.p_local if producer else self.d_local


def tp_refusal(num_kv_heads: int, tp_size: int, layout: str = "") -> str | None:
    """Why ``tp_size`` ranks cannot hold ``num_kv_heads`` kv heads (None when they can)."""
    if tp_size < 1 or num_kv_heads < 1:
        return f"tp {tp_size} with {num_kv_heads} kv heads: both must be positive"
    if layout in REPLICATED_LAYOUTS or num_kv_heads % tp_size == 0:
        return None
    if tp_size % num_kv_heads == 0:
        return None  # replicated kv heads
    return (
        f"{num_kv_heads} kv heads are neither divisible by tp {tp_size} nor replicated "
        f"over it (tp a multiple of the heads)"
    )


def rank_heads(num_kv_heads: int, tp_size: int, layout: str = "") -> tuple[Heads, ...]:
    """The global kv heads each of ``tp_size`` ranks holds; ``ConfigError`` if it cannot."""
    why = tp_refusal(num_kv_heads, tp_size, layout)
    if why is not None:
        raise ConfigError(why)
    if layout in REPLICATED_LAYOUTS:
        return ((0, num_kv_heads),) * tp_size
    if num_kv_heads % tp_size == 0:
        n = num_kv_heads // tp_size
        return tuple((r * n, (r + 1) * n) for r in range(tp_size))
    per_head = tp_size // num_kv_heads
    return tuple((r // per_head, r // per_head + 1) for r in range(tp_size))


def plan_head_slices(
    num_kv_heads: int, p_tp: int, d_tp: int, layout: str = ""
) -> tuple[HeadSlice, ...]:
    """Every (P rank, D rank, heads) part of a hand-off from a ``p_tp`` engine to a ``d_tp``
    one, ordered by (P rank, D rank): each D rank's heads covered exactly once. Both sides
    derive the same plan, so the parts' index is a shared name (a pair's wire address)."""
    p_heads = rank_heads(num_kv_heads, p_tp, layout)
    d_heads = rank_heads(num_kv_heads, d_tp, layout)
    p_shard = p_heads[0][1] - p_heads[0][0]
    d_shard = d_heads[0][1] - d_heads[0][0]
    out: list[HeadSlice] = []
    for d, (dlo, dhi) in enumerate(d_heads):
        # Cut D's range at every P rank boundary; each piece from one of its holders.
        cuts = sorted({dlo, dhi, *(x for lo, hi in p_heads for x in (lo, hi) if dlo < x < dhi)})
        for lo, hi in itertools.pairwise(cuts):
            holders = [p for p, (plo, phi) in enumerate(p_heads) if plo <= lo and hi <= phi]
            # Replicated heads: D's ranks that need the same heads read different P ranks.
            readers = [r for r, (a, b) in enumerate(d_heads) if a <= lo and hi <= b]
            p = holders[readers.index(d) % len(holders)]
            plo = p_heads[p][0]
            out.append(
                HeadSlice(
                    p, d, (lo, hi), (lo - plo, hi - plo), (lo - dlo, hi - dlo), p_shard, d_shard
                )
            )
    out.sort(key=lambda s: (s.p_rank, s.d_rank, s.heads))
    return tuple(out)


def rank_slices(plan: tuple[HeadSlice, ...], rank: int, producer: bool) -> list[int]:
    """The indexes in ``plan`` of the parts ``rank`` of one side takes part in, in plan order."""
    return [i for i, s in enumerate(plan) if (s.p_rank if producer else s.d_rank) == rank]


__all__ = [
    "REPLICATED_LAYOUTS",
    "TP_MAPPED_LAYOUTS",
    "HeadSlice",
    "Heads",
    "plan_head_slices",
    "rank_heads",
    "rank_slices",
    "tp_refusal",
]
