"""A hypothesis state machine over the PD producer, consumer and a fake network: drops,
duplicates, reorders, delays, copy failures, aborts on both sides, peer death and clock jumps;
P's hand-offs bound to D or unbound (ANY_PEER), and a second D that races D's claims.

After every step: no block is freed (or written) under a running copy, held and free blocks are
disjoint, state stays bounded. Committed KV always comes from P's blocks of the right request
(freed blocks are poisoned, so a use-after-free would show up as wrong KV). At the end the
network heals and time runs on: nothing leaks on a side that is alive.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow.core.pd.consumer import ConsumerManager
from kvflow.core.pd.producer import ProducerManager
from tests.core.pd_world import World


class PDMachine(RuleBasedStateMachine):
    world: World

    @initialize(
        ranks=st.sampled_from([1, 2]),
        max_inflight=st.sampled_from([1, 2]),
        unbound=st.booleans(),
    )
    def setup(self, ranks: int, max_inflight: int, unbound: bool) -> None:
        self.world = World(ranks=ranks, max_inflight=max_inflight, unbound=unbound)

    @precondition(lambda self: len(self.world.handoffs) < 12)
    @rule(
        blocks=st.integers(1, 3),
        skip=st.sampled_from([0, 0, 0, 1, 3]),
        right=st.integers(0, 5).map(lambda x: x > 0),  # mostly the right request
        begin=st.booleans(),
        stream=st.booleans(),
    )
    def new_handoff(self, blocks: int, skip: int, right: bool, begin: bool, stream: bool) -> None:
        w = self.world
        if w.alive["P"] and w.alive["D"] and w.can_take(blocks):
            w.new_handoff(
                blocks=blocks,
                skip=min(skip, blocks),
                right_request=right,
                begin=begin,
                stream=stream,
            )

    @rule(data=st.data(), more=st.integers(1, 2))
    def kv_chunk(self, data: st.DataObject, more: int) -> None:
        """A prefill step fences more of a prompt still prefilling (pushed at once if claimed)."""
        w = self.world
        pending = w.prefilling
        if pending and w.alive["P"]:
            w.kv_chunk(data.draw(st.sampled_from(sorted(pending))), more)

    @rule(data=st.data())
    def kv_ready(self, data: st.DataObject) -> None:
        w = self.world
        pending = w.prefilling
        if pending and w.alive["P"]:
            w.kv_ready(data.draw(st.sampled_from(sorted(pending))))

    @precondition(lambda self: bool(self.world.net))
    @rule(data=st.data(), what=st.sampled_from(["deliver"] * 6 + ["drop", "duplicate"]))
    def network(self, data: st.DataObject, what: str) -> None:
        """Deliver any message (in any order: reordering), or lose or duplicate one."""
        w = self.world
        i = data.draw(st.integers(0, len(w.net) - 1))
        if what == "deliver":
            w.deliver(i)
        elif what == "drop":
            w.net.pop(i)
        elif len(w.net) < 40:
            w.net.append(w.net[i])

    @precondition(lambda self: bool(self.world.handoffs))
    @rule(data=st.data(), roll=st.integers(0, 3))
    def rival_claims(self, data: st.DataObject, roll: int) -> None:
        """A second D claims one of P's hand-offs (first come binds an unbound one)."""
        w = self.world
        if roll == 0:
            w.rival_claim(data.draw(st.sampled_from(sorted(w.handoffs))))

    @precondition(lambda self: bool(self.world.ops))
    @rule(data=st.data(), ok=st.booleans())
    def copy_settles(self, data: st.DataObject, ok: bool) -> None:
        w = self.world
        w.complete(data.draw(st.integers(0, len(w.ops) - 1)), ok=ok or data.draw(st.booleans()))

    @rule(dt=st.sampled_from([0.01, 0.01, 0.3, 0.3, 1.0, 2.5, 7.0, 40.0]))
    def time_passes(self, dt: float) -> None:
        self.world.advance(dt)

    @rule(data=st.data(), side=st.sampled_from(["P", "D"]), roll=st.integers(0, 2))
    def engine_abort(self, data: st.DataObject, side: str, roll: int) -> None:
        w = self.world
        mgr: ProducerManager | ConsumerManager = w.p if side == "P" else w.d
        if roll or not w.alive[side] or not mgr.transfers:
            return
        tid = data.draw(st.sampled_from(sorted(mgr.transfers)))
        if side == "P" and tid in w.prefilling and data.draw(st.booleans()):
            w.preempt_p(tid)
        elif side == "P":
            w.abort_p(tid)
        else:
            w.do(side, mgr.abort(tid, w.now))

    @precondition(lambda self: all(self.world.alive.values()))
    @rule(side=st.sampled_from(["P", "D"]), roll=st.integers(0, 3))
    def peer_dies(self, side: str, roll: int) -> None:
        if roll == 0:  # rarer than the other rules: most runs keep both peers
            self.world.kill(side)

    @invariant()
    def safe(self) -> None:
        if hasattr(self, "world"):
            self.world.check_safety()

    def teardown(self) -> None:
        if hasattr(self, "world"):
            self.world.quiesce()
            self.world.check_no_leaks()


PDMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_pd_protocol = PDMachine.TestCase
