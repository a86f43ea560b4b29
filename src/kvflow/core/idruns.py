"""Runs of consecutive block ids, found and checked with a few C-level passes.

A CPU tier hands out and takes back blocks in runs; ``ascending_runs`` splits an id list into its
runs (a binary search per run for where it ends, one list comparison in C to check it), so the
pool and the plan checks do per run what they would otherwise do per id. ``every`` is the list
the comparisons slice: the ids as int objects made once per process.
"""

from __future__ import annotations

from collections.abc import Sequence

_EVERY: list[int] = []

EVERY_CAP = 1 << 21
"""The largest id count ``every`` serves (its list costs about 40 bytes an id)."""


def every(n: int) -> list[int]:
    """``list(range(m))`` for some ``m >= n`` (``n <= EVERY_CAP``), shared by the process. A
    larger ``n`` makes a new list (never one grown in place: a reader may hold the old one)."""
    global _EVERY
    if len(_EVERY) < n:
        if n > EVERY_CAP:
            raise ValueError(f"every({n}): more than {EVERY_CAP} ids")
        _EVERY = list(range(max(n, 2 * len(_EVERY))))
    return _EVERY


def ascending_runs(
    ids: Sequence[int], ref: list[int], limit: int
) -> list[tuple[int, int, int]] | None:
    """``ids`` as runs of consecutive ids, ``(lo, hi, position of lo in ids)`` in order, if
    they are strictly ascending ints in ``0 .. limit - 1``; else None. ``ref`` is ``every(n)``
    for some ``n >= limit``."""
    seq = ids if type(ids) is list else list(ids)
    n = len(seq)
    out: list[tuple[int, int, int]] = []
    i = 0
    prev_hi = 0
    while i < n:
        a = seq[i]
        if type(a) is not int or a < prev_hi:
            return None
        if seq[n - 1] - a == n - 1 - i:
            j = n
        else:
            # The run ends where an id stops being its position's offset from ``a``.
            lo, hi = i + 1, n - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if seq[mid - 1] - a == mid - 1 - i:
                    lo = mid
                else:
                    hi = mid - 1
            j = lo
        end = a + j - i
        if end > limit or (j - i > 1 and seq[i:j] != ref[a:end]):
            return None
        out.append((a, end, i))
        prev_hi = end
        i = j
    return out


__all__ = ["EVERY_CAP", "ascending_runs", "every"]
