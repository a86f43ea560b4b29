"""CPU-hit matching: the longest token prefix the CPU tier holds for every KV cache group.

Read-only over the CPU pools; pinning the hit's blocks is the ledger's (``TransferLedger.pin``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.core.offload.config import Geometry
from kvflow.core.offload.state import RequestState
from kvflow.core.run_pool import RunBlockPool


class HitMatcher:
    """Finds a request's longest CPU hit, whole blocks consistent over all groups."""

    def __init__(self, geometry: Geometry, cpu: Sequence[RunBlockPool]) -> None:
        self._geo = geometry
        self._cpu = cpu
        # Per full-attention group, from the last ``longest_hit``: the first block index it
        # looked up as a whole and those blocks' CPU ids (the pin then needs no second lookup).
        self.found: dict[int, tuple[int, list[int]]] = {}

    def needed_blocks(self, g: int, num_computed: int, hit: int) -> tuple[int, int]:
        """Block index range of group ``g`` a hit of ``hit`` tokens loads."""
        bs = self._geo.block_sizes[g]
        lo = num_computed // bs
        window = self._geo.windows[g]
        if window is not None:
            lo = max(lo, max(0, hit - window + 1) // bs)
        return lo, hit // bs

    def longest_hit(self, st: RequestState, num_computed: int, num_tokens: int) -> int:
        """Longest token count, a multiple of every block size, the CPU tier holds for all groups."""
        geo = self._geo
        align = geo.align
        hit = num_tokens // align * align
        looked = self.found
        looked.clear()
        for g in geo.full_groups:
            bs = geo.block_sizes[g]
            hashes = st.hashers[geo.slot[g]].hashes
            pool = self._cpu[g]
            in_cpu = pool.cached_hashes
            i, end = num_computed // bs, hit // bs
            ids = pool.ids_of(hashes[i:end]) if i < end else None
            if ids is not None:
                # Every block cached (a whole hit): one pass in C, no call per block.
                looked[g] = (i, ids)
                i = end
            else:
                while i < end and hashes[i] in in_cpu:
                    i += 1
            hit = min(hit, i * bs // align * align)
        changed = True
        while changed and hit > num_computed:
            changed = False
            for g in geo.window_groups:
                found = self._window_hit(st, g, num_computed, hit)
                if found < hit:
                    hit, changed = found, True
        return hit if hit > num_computed else num_computed

    def _window_hit(self, st: RequestState, g: int, num_computed: int, limit: int) -> int:
        """Largest aligned hit <= ``limit`` whose window blocks of sliding group ``g`` are cached."""
        geo = self._geo
        bs, align = geo.block_sizes[g], geo.align
        hashes = st.hashers[geo.slot[g]].hashes
        cached = self._cpu[g].is_cached
        cand = limit
        while cand > num_computed:
            lo, hi = self.needed_blocks(g, num_computed, cand)
            j = hi - 1
            while j >= lo and cached(hashes[j]):
                j -= 1
            if j < lo:
                return cand
            # Block j is missing: a shorter hit must end at or before it.
            cand = min(cand - align, j * bs // align * align)
        return num_computed


__all__ = ["HitMatcher"]
