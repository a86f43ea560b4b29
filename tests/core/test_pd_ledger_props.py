"""``BlockLedger`` against a plain model of who holds what: random takes, grows and give-backs
of hand-offs over a few groups, shared (P's) and exclusive (D's). The ledger's answers, its
refusals and its counts must be the model's; a refused call changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.core.pd.common import BlockLedger, flat
from kvflow.errors import ProtocolError

Ids = tuple[tuple[int, ...], ...]

ids_st = st.lists(st.lists(st.integers(0, 12), max_size=6), min_size=2, max_size=2).map(
    lambda gs: tuple(tuple(g) for g in gs)
)
ops = st.lists(
    st.tuples(st.sampled_from(["take", "grow", "give_back"]), st.integers(0, 3), ids_st),
    max_size=40,
)


class Model:
    """Each hand-off's blocks in order; a block's owners in the order they took it."""

    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self.by: dict[str, Ids] = {}

    def held_by_others(self, tid: str, key: tuple[int, int]) -> list[str]:
        return [t for t, ids in self.by.items() if t != tid and key in set(flat(ids))]

    def refuses(self, tid: str, ids: Ids, *, new: bool) -> bool:
        keys = list(flat(ids))
        if new and tid in self.by:
            return True
        if len(set(keys)) != len(keys):
            return True
        return not self.shared and any(self.held_by_others(tid, k) for k in keys)

    def num_blocks(self) -> int:
        return len({k for ids in self.by.values() for k in flat(ids)})


@settings(max_examples=300, deadline=None)
@given(shared=st.booleans(), script=ops)
def test_the_ledger_answers_as_the_model_does(shared: bool, script: list) -> None:  # type: ignore[type-arg]
    """Takes, grows and give-backs: the same refusals, holdings, counts and owners as a plain
    model, and a refusal leaves the ledger as it was."""
    ledger = BlockLedger(shared=shared, side="t")
    model = Model(shared)
    for op, n, ids in script:
        tid = f"t{n}"
        if op == "take":
            if model.refuses(tid, ids, new=True):
                with pytest.raises(ProtocolError):
                    ledger.take(tid, ids)
            else:
                ledger.take(tid, ids)
                model.by[tid] = ids
        elif op == "grow":
            old = model.by.get(tid)
            if old is None:
                grown = ids
                refused = model.refuses(tid, ids, new=True)
            else:
                added = tuple(
                    tuple(b for b in new if b not in had) for new, had in zip(ids, old, strict=True)
                )
                grown = tuple(h + a for h, a in zip(old, added, strict=True))
                # The blocks new to the hand-off: named once, and free of others (exclusive).
                refused = model.refuses(tid, added, new=False)
            if refused:
                with pytest.raises(ProtocolError):
                    ledger.grow(tid, ids)
            else:
                ledger.grow(tid, ids)
                model.by[tid] = grown
        else:
            if tid not in model.by:
                with pytest.raises(ProtocolError):
                    ledger.give_back(tid)
            else:
                assert ledger.give_back(tid) == model.by.pop(tid)
        for t in ("t0", "t1", "t2", "t3"):
            assert ledger.holds(t) == (t in model.by)
        assert ledger.num_blocks == model.num_blocks()
        for g in range(2):
            for b in range(13):
                owners = [t for t, held in model.by.items() if b in held[g]]
                assert ledger.owner(g, b) == (owners[0] if owners else None)


def test_flat_yields_every_group_block_pair_in_order() -> None:
    """``flat`` gives each (group, block) of every group, in order, empty groups skipped."""
    ids = ((3, 1), (), (7,))
    assert list(flat(ids)) == [(0, 3), (0, 1), (2, 7)]
