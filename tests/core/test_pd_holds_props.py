"""A hypothesis state machine over one offload manager whose ledger also holds PD hand-offs'
GPU blocks (P's shared read holds, D's exclusive write holds): CPU-tier loads launch and
settle, hand-offs take and give back blocks, the engine frees its requests' blocks whenever it
likes, bad holds and bad loads are tried.

After every step: a block that a live hold or load names is never in the engine's free queue;
every block's engine ref count is exactly the engine's own refs plus the holds' plus the live
loads'; a block PD writes is never a load target, and two hand-offs never write one block; a
refused call changed nothing. At the end every hold is given back and nothing leaks."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow.core.offload import GroupSpec
from kvflow.core.pd.common import BlockLedger
from kvflow.core.transfer import Direction
from kvflow.errors import ProtocolError
from tests.core.scheduler_harness import Sim

BS = 4
PREFIX = list(range(100, 112))  # 3 blocks on the CPU tier


class HoldsMachine(RuleBasedStateMachine):
    sim: Sim

    @initialize()
    def setup(self) -> None:
        self.sim = Sim([GroupSpec(block_size=BS, num_cpu_blocks=16)], gpu_blocks=40)
        self.sim.finish(self.sim.stored("seed", PREFIX))
        self.holds = self.sim.mgr.pd_holds
        self.d = BlockLedger(side="consumer", refs=self.holds)
        self.p = BlockLedger(shared=True, side="producer", refs=self.holds)
        self.engine_blocks: dict[str, list[int]] = {}  # PD requests' blocks the engine holds
        self.held: dict[str, tuple[BlockLedger, tuple[int, ...]]] = {}
        self.loads: dict[str, int] = {}  # request → its load's transfer id
        self.n = 0

    def _name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    # ---- the CPU tier -----------------------------------------------------------------------

    @precondition(lambda self: len(self.loads) < 3 and self.sim.gpu.num_free_blocks > 8)
    @rule()
    def load(self) -> None:
        """A request whose prefix is on the CPU tier: its hit becomes a load in flight."""
        rid = self._name("l")
        _, spec = self.sim.loading(rid, [*PREFIX, 7])
        self.loads[rid] = spec.transfer_id

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def settle_load(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.loads)))
        self.sim.complete([self.loads.pop(rid)])
        self.sim.finish(self.sim.requests.pop(rid))

    # ---- PD holds ---------------------------------------------------------------------------

    @precondition(lambda self: len(self.held) < 6 and self.sim.gpu.num_free_blocks > 6)
    @rule(n=st.integers(1, 3), exclusive=st.booleans())
    def hold_new_blocks(self, n: int, exclusive: bool) -> None:
        """A hand-off holds blocks the engine just allocated for its request."""
        rid = self._name("h")
        ids = tuple(self.sim.gpu.get_new_blocks(n))
        self.engine_blocks[rid] = list(ids)
        ledger = self.d if exclusive else self.p
        ledger.take(rid, (ids,))
        self.held[rid] = (ledger, ids)

    @precondition(lambda self: bool(self.held) or bool(self.loads))
    @rule(data=st.data())
    def share_a_block(self, data: st.DataObject) -> None:
        """P's shared hold on blocks another hold or a load already names (a prefix-cached
        block of two requests): allowed unless PD writes the block."""
        named = sorted({b for _, ids in self.held.values() for b in ids} | self._load_targets())
        ids = tuple(
            data.draw(st.lists(st.sampled_from(named), min_size=1, max_size=2, unique=True))
        )
        written = set(self.holds.exclusive_blocks())
        rid = self._name("s")
        before = self._snapshot()
        if written & set(ids):
            with pytest.raises(ProtocolError):
                self.p.take(rid, (ids,))
            assert self._snapshot() == before
            return
        self.p.take(rid, (ids,))
        self.held[rid] = (self.p, ids)

    @precondition(lambda self: bool(self.held) or bool(self.loads))
    @rule(data=st.data())
    def write_a_named_block(self, data: st.DataObject) -> None:
        """D's exclusive hold on a block a hold or a load names: refused, nothing changed."""
        named = sorted({b for _, ids in self.held.values() for b in ids} | self._load_targets())
        b = data.draw(st.sampled_from(named))
        before = self._snapshot()
        with pytest.raises(ProtocolError):
            self.d.take(self._name("x"), ((b,),))
        assert self._snapshot() == before

    @precondition(lambda self: bool(self.holds.exclusive_blocks()))
    @rule(data=st.data())
    def load_into_a_written_block(self, data: st.DataObject) -> None:
        """A CPU-tier hit allocated onto a block PD writes: refused before anything changed."""
        b = data.draw(st.sampled_from(sorted(self.holds.exclusive_blocks())))
        req = self.sim.add(self._name("bad"), [*PREFIX, 9])
        hit, _ = self.sim.match(req)
        assert hit
        table = [b, *self.sim.gpu.get_new_blocks(3)]
        before = self._snapshot()
        with pytest.raises(ProtocolError):
            self.sim.mgr.update_state_after_alloc(req, [table], hit)
        assert self._snapshot() == before
        self.sim.mgr.update_state_after_alloc(req, [table], 0)  # the engine gives up on the hit
        self.sim.mgr.request_finished(req, [table])
        self.sim.gpu.free(table[:0:-1])
        del self.sim.requests[req.request_id]

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.held)))
        ledger, ids = self.held.pop(rid)
        assert ledger.give_back(rid) == (ids,)

    @precondition(lambda self: bool(self.engine_blocks))
    @rule(data=st.data())
    def engine_frees(self, data: st.DataObject) -> None:
        """The engine frees a hand-off's request blocks (its own refs), hold or no hold."""
        rid = data.draw(st.sampled_from(sorted(self.engine_blocks)))
        self.sim.gpu.free(reversed(self.engine_blocks.pop(rid)))

    # ---- invariants -------------------------------------------------------------------------

    def _load_targets(self) -> set[int]:
        return {
            b
            for x in self.sim.mgr._ledger.xfers.values()
            if x.spec.direction is Direction.LOAD
            for b in x.spec.gpu_block_ids[0]
        }

    def _snapshot(self) -> tuple[object, ...]:
        gpu = self.sim.gpu
        return (
            self.holds.refs(),
            self.holds.exclusive_blocks(),
            tuple(b.ref_cnt for b in gpu.blocks),
            gpu.num_free_blocks,
            self.sim.mgr.num_live_transfers(),
        )

    @invariant()
    def refs_add_up(self) -> None:
        if not hasattr(self, "sim"):
            return
        want: Counter[int] = Counter()
        for table in self.sim.tables.values():
            want.update(table[0])
        for blocks in self.engine_blocks.values():
            want.update(blocks)
        for _, ids in self.held.values():
            want.update(ids)
        for x in self.sim.mgr._ledger.xfers.values():
            if x.holds_gpu:
                want.update(x.spec.gpu_block_ids[0])
        for block in self.sim.gpu.blocks:
            assert block.ref_cnt == want[block.block_id], block.block_id
        assert self.holds.refs() == Counter(b for _, ids in self.held.values() for b in ids)

    @invariant()
    def writes_never_overlap(self) -> None:
        if not hasattr(self, "sim"):
            return
        written = self.holds.exclusive_blocks()
        assert not set(written) & self._load_targets()
        mine: list[int] = [b for ledger, ids in self.held.values() if ledger is self.d for b in ids]
        assert len(mine) == len(set(mine)) == len(written)

    def teardown(self) -> None:
        if not hasattr(self, "sim"):
            return
        for rid, (ledger, _) in list(self.held.items()):
            ledger.give_back(rid)
        for ids in self.engine_blocks.values():
            self.sim.gpu.free(reversed(ids))
        for rid in list(self.loads):
            self.sim.complete([self.loads.pop(rid)])
        self.sim.drain()
        assert len(self.holds) == 0
        assert not self.holds.refs()


HoldsMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_one_ledger_owns_every_gpu_ref = HoldsMachine.TestCase
