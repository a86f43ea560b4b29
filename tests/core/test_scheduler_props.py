"""Invariants of the offload manager over random sequences of engine and worker events (hypothesis).

A small engine admits requests (matching and loading CPU hits), prefills in chunks, decodes,
preempts, finishes, resets, and its two fake ranks report transfers done or failed in any order.
After every event: each CPU block's ref count equals the references live transfers and pinned hits
hold; every block in the CPU prefix cache holds exactly the data its hash names; every block a
request loaded holds the right data. At the end, nothing leaks on either pool.
"""

from __future__ import annotations

from attrs import evolve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.core.hashing import hash_block
from kvflow.core.offload import LAZY_REQUEST_ID, GroupSpec, ResetStatus
from kvflow.core.protocol import GroupBlockIds, StepPlan
from kvflow.core.requests import KVRequest, SchedulerOutput
from kvflow.core.transfer import Direction
from tests.core.scheduler_harness import Sim

BS = 4
BASES = [list(range(100)), [*range(8), *range(500, 592)], [*range(900, 1000)]]

# Kinds repeated to weight them: most events make progress, a few disrupt it.
KINDS = ["admit"] * 3 + ["step"] * 4 + ["report"] * 5 + ["finish"] * 2 + ["preempt", "reset"]
events = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(0, 30),
        st.integers(1, 30),
        st.sampled_from(["ok", "ok", "ok", "one_rank", "fail"]),
    ),
    min_size=10,
    max_size=80,
)
Event = tuple[str, int, int, str]


class Engine:
    """The engine's side of the protocol, driving one ``Sim``."""

    def __init__(
        self,
        policy: str,
        decode_columns: bool = False,
        interval: int = 1,
        keyed: bool = False,
        decode_steps: bool = False,
        quiet_steps: bool = False,
        world_size: int = 2,
        fence: str = "never",
        gpu_hits: bool = False,
    ) -> None:
        # ``gpu_hits``: an admitted request first takes the longest prefix the engine's own GPU
        # cache holds (kept across connector resets, as when vLLM's GPU reset fails).
        self.gpu_hits = gpu_hits
        self.sim = Sim(
            [GroupSpec(block_size=BS, num_cpu_blocks=12)],
            world_size=world_size,
            fence_loads=fence,
            store_policy=policy,
            lazy_watermark=10,
            gpu_blocks=28 if policy == "eager" else 16,
            decode_columns=decode_columns,
            eager_store_interval=interval,
            keyed=keyed,
            decode_steps=decode_steps,
            quiet_steps=quiet_steps,
        )
        self.fence = fence
        self.n = 0
        self.waiting: set[str] = set()  # load in flight
        self.ready: list[KVRequest] = []  # to be scheduled as new requests
        self.running: list[KVRequest] = []
        self.preempted: list[KVRequest] = []

    def admit(self, base: int, length: int) -> None:
        sim = self.sim
        if self.preempted:
            req = self.preempted.pop()
        else:
            self.n += 1
            req = sim.add(f"r{self.n}", BASES[base][:length])
        need = -(-len(req.all_token_ids) // BS)
        if need + 2 > sim.gpu.num_free_blocks:
            sim.mgr.get_num_new_matched_tokens(req, 0)
            sim.mgr.update_state_after_alloc(req, [[]], 0)
            self.preempted.append(req)
            return
        local = 0
        if self.gpu_hits:
            # At least one token left to compute, as an engine leaves one for its logits.
            hashes = sim.hashes(req, 0)[: (len(req.all_token_ids) - 1) // BS]
            hit = sim.gpu.find_longest_prefix([hash_block(h, [0]) for h in hashes])
            if hit:
                sim.gpu.touch(hit)
                sim.tables[req.request_id] = [list(hit)]
                local = len(hit) * BS
        got, is_async = sim.match(req, local)
        if got is None:
            if local:
                sim._free(req.request_id)
            self.preempted.append(req)
            return
        if got:
            sim.alloc(req, local + got, got)
            if is_async:
                self.waiting.add(req.request_id)
            else:  # fenced: its next step computes the rest, its forward reading the load
                self.ready.append(req)
        else:
            sim.alloc(req, local, 0)
            self.ready.append(req)

    def step(self, chunk: int) -> None:
        sim = self.sim
        room = sim.gpu.num_free_blocks - 2
        new, cached = [], []
        for req in self.ready:
            rid = req.request_id
            n = min(chunk, len(req.all_token_ids) - sim.computed.get(rid, 0))
            if n > 0 and room > n // BS + 1:
                room -= n // BS + 1
                new.append((req, n))
        for req, _ in new:
            self.ready.remove(req)
        for req in self.running:
            done = sim.computed[req.request_id]
            if done >= len(req.all_token_ids):
                req.all_token_ids.append(7 + done)
            n = min(chunk, len(req.all_token_ids) - done)
            if room > n // BS + 1:
                room -= n // BS + 1
                cached.append((req, n))
        plan = sim.step(new=new, cached=cached)
        self.running.extend(req for req, _ in new)
        for spec in plan.stores:
            if spec.request_id == LAZY_REQUEST_ID:
                # A lazy store reads free blocks, which keep their content while it runs.
                for b in spec.gpu_block_ids[0]:
                    assert sim.epoch[b] == sim.resets, f"GPU block {b}: pre-reset content stored"

    def report(self, which: int, mode: str) -> None:
        """Ranks report one in-flight transfer: all done, one rank only, or one rank failed."""
        sim = self.sim
        tids = sim.workers.in_flight()
        if not tids:
            return
        tid = tids[which % len(tids)]
        ranks = sorted(sim.workers.unreported[tid])
        if mode == "one_rank":
            ranks = ranks[:1]
        reports = [
            sim.workers.report(r, failed=[tid])
            if mode == "fail" and i == 0
            else sim.workers.report(r, completed=[tid])
            for i, r in enumerate(ranks)
        ]
        out = sim.report(reports)
        for rid in out.finished_recving:
            self.waiting.discard(rid)
            req = sim.requests[rid]
            table = sim.tables[rid][0]
            bad = [i for i, b in enumerate(table) if b in out.invalid_block_ids]
            if bad:
                sim.computed[rid] = bad[0] * BS  # recompute from the first invalid block
            good = sim.computed[rid] // BS
            assert [sim.gpu_data[b] for b in table[:good]] == sim.hashes(req, 0)[:good]
            self.ready.append(req)
        if out.invalid_block_ids:
            # A fenced load failed: its request computed on it, and is rolled back.
            for req in [*self.running, *self.ready]:
                table = sim.tables[req.request_id][0]
                bad = [i for i, b in enumerate(table) if b in out.invalid_block_ids]
                if bad and bad[0] * BS < sim.computed[req.request_id]:
                    assert self.fence != "never", "an asynchronous load's blocks ran"
                    sim.computed[req.request_id] = bad[0] * BS

    def pick(self, i: int) -> KVRequest | None:
        live = [*self.running, *self.ready, *(self.sim.requests[r] for r in sorted(self.waiting))]
        return live[i % len(live)] if live else None

    def finish(self, i: int) -> None:
        req = self.pick(i)
        if req is None:
            return
        for group in (self.running, self.ready):
            if req in group:
                group.remove(req)
        self.waiting.discard(req.request_id)
        self.sim.finish(req)

    def preempt(self, i: int) -> None:
        if not self.running:
            return
        req = self.running.pop(i % len(self.running))
        self.sim.step(preempted=[req.request_id])
        self.preempted.append(req)

    def check(self) -> None:
        """Ref counts match what transfers and pins hold; cached CPU data matches its hash; no
        GPU block is free while a copy that reads or writes it is in flight (and was not
        flushed by a preemption: the engine may free those blocks, not write them first); the
        hashes being stored are exactly the live stores' hashes, each in one store."""
        sim = self.sim
        ledger = sim.mgr._ledger
        live = [
            h
            for x in ledger.xfers.values()
            if x.spec.direction is Direction.STORE
            for h in x.hashes[0]
        ]
        assert len(live) == len(set(live)), "a hash in two live stores"
        assert ledger.storing[0].keys() == set(live)
        pool = sim.mgr.cpu_pools[0]
        held = sim.mgr.cpu_refs()[0]
        for block in pool.blocks:
            assert block.ref_cnt == held[block.block_id], f"CPU block {block.block_id}"
            if block.block_hash is not None:
                assert sim.cpu_data[0].get(block.block_id) == block.block_hash
        for tid in sim.workers.in_flight():
            if tid in sim.flushed:
                continue
            for blk in sim.workers.launched[tid].gpu_block_ids[0]:
                assert sim.gpu.block(blk).ref_cnt > 0, f"GPU block {blk} free under copy {tid}"


def run(
    policy: str,
    script: list[Event],
    decode_columns: bool = False,
    interval: int = 1,
    keyed: bool = False,
    general: bool = False,
    decode_steps: bool = False,
    quiet_steps: bool = False,
    world_size: int = 2,
    fence: str = "never",
    gpu_hits: bool = False,
) -> Engine:
    eng = Engine(
        policy,
        decode_columns,
        interval,
        keyed,
        decode_steps,
        quiet_steps,
        world_size,
        fence,
        gpu_hits,
    )
    if general:
        eng.sim.mgr._fused = False  # decode steps: their news as columns, to the wrapper below
        plan_step = eng.sim.mgr.build_step_plan

        def general_path(so: SchedulerOutput) -> StepPlan:
            # An unknown finished id changes nothing but keeps every step off the fast paths.
            return plan_step(evolve(so, finished_request_ids=so.finished_request_ids | {"-"}))

        eng.sim.mgr.build_step_plan = general_path  # type: ignore[method-assign,assignment]
    for kind, i, n, mode in script:
        if kind == "admit":
            eng.admit(i % len(BASES), max(8, n))
        elif kind == "step":
            eng.step(1 + n % 12)
        elif kind == "report":
            eng.report(i, mode)
        elif kind == "finish":
            eng.finish(i)
        elif kind == "preempt":
            eng.preempt(i)
        else:
            status = eng.sim.reset_cache()
            assert (status is ResetStatus.COMPLETE) == (eng.sim.mgr.num_live_transfers() == 0)
        eng.check()
    eng.sim.drain()
    return eng


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_eager_invariants_hold_over_random_events(script: list[Event]) -> None:
    """Eager policy: refs, cached data and loaded data stay consistent under any event order."""
    run("eager", script)


# Requests come back to stored prefixes more often, and finish to leave the engine idle.
fenced_events = st.lists(
    st.tuples(
        st.sampled_from(["admit"] * 4 + ["step"] * 4 + ["report"] * 5 + ["finish"] * 4 + ["reset"]),
        st.integers(0, 30),
        st.integers(1, 30),
        st.sampled_from(["ok", "ok", "ok", "ok", "fail"]),
    ),
    min_size=10,
    max_size=80,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fenced_events, st.sampled_from(["idle", "always"]), st.sampled_from(["eager", "lazy"]))
def test_invariants_hold_with_fenced_loads_on_one_rank(
    script: list[Event], fence: str, policy: str
) -> None:
    """One rank, loads fenced (while idle, or always): the same invariants hold, and a fenced
    load that fails rolls back the request that computed on it."""
    run(policy, script, world_size=1, fence=fence)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_lazy_invariants_hold_over_random_events(script: list[Event]) -> None:
    """Lazy policy: the same invariants hold while stores come from the GPU free queue."""
    run("lazy", script)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events, st.sampled_from(["eager", "lazy", "lazy-keyed"]))
def test_invariants_hold_with_gpu_prefix_hits(script: list[Event], policy: str) -> None:
    """Requests that first take the engine's GPU prefix hits (kept across connector resets)
    leave the invariants intact, and no lazy store ever carries a block computed before the
    last reset."""
    run(policy.removesuffix("-keyed"), script, keyed=policy.endswith("-keyed"), gpu_hits=True)


def _loads(plan: StepPlan) -> list[tuple[str, GroupBlockIds, GroupBlockIds]]:
    return [(x.request_id, x.gpu_block_ids, x.cpu_block_ids) for x in plan.loads]


def _store_pairs(plan: StepPlan) -> set[tuple[int, int]]:
    return {(g, b) for spec in plan.stores for g, ids in enumerate(spec.gpu_block_ids) for b in ids}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_keyed_lazy_walk_stores_more_than_the_recorded_one_only_after_a_reset(
    script: list[Event],
) -> None:
    """Lazy over a keyed GPU view (contents read from the engine's hashes, nothing recorded per
    request) plans exactly what lazy over its content records plans, until a plan where the
    keyed walk stores a superset of the recorded walk's blocks; that happens only after a
    reset (a block computed after it and freed before its request's cursor passed it: the
    recorded walk never learns its content). Every lazy store of either walk holds content
    computed after the last reset (``Engine.step`` checks), and the invariants hold."""
    recorded, keyed = run("lazy", script), run("lazy", script, keyed=True)
    for i, (a, b) in enumerate(
        zip(recorded.sim.workers.plans, keyed.sim.workers.plans, strict=True)
    ):
        if a == b:
            continue
        assert _store_pairs(a) < _store_pairs(b), f"plan {i}: {a} vs {b}"
        assert _loads(a) == _loads(b)
        assert a.flush == b.flush
        assert recorded.sim.resets_at_plan[i] > 0, f"plan {i} differs without a reset before it"
        break


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_quiet_lazy_step_fast_path_plans_what_the_general_path_plans(script: list[Event]) -> None:
    """Lazy steps with no request, finish or preemption take a fast path in ``build_step_plan``
    (keyed: most steps over vLLM); every plan equals the general path's, for both walks."""
    for keyed in (False, True):
        fast = run("lazy", script, keyed=keyed)
        slow = run("lazy", script, keyed=keyed, general=True)
        assert fast.sim.workers.plans == slow.sim.workers.plans


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_invariants_hold_with_decode_steps_in_columns(script: list[Event]) -> None:
    """Eager policy with one-token decode steps passed as DecodeRequests columns: the same
    invariants hold (the columns share the manager's code path with CachedRequests)."""
    run("eager", script, decode_columns=True)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_invariants_hold_with_eager_stores_coalesced_over_steps(script: list[Event]) -> None:
    """Eager stores coalesced over 3 decode steps (columns): the same invariants hold through
    preemptions, finishes and resets between the deferral and the store."""
    run("eager", script, decode_columns=True, interval=3)


# Decode-heavy: few admissions, so most steps schedule running requests only.
decode_events = st.lists(
    st.tuples(
        st.sampled_from(["step"] * 8 + ["report"] * 5 + ["admit", "finish", "preempt", "reset"]),
        st.integers(0, 30),
        st.sampled_from([12, 24, 12, 5, 30]),  # chunks of 1 token mostly (``Engine.step``)
        st.sampled_from(["ok", "ok", "ok", "one_rank", "fail"]),
    ),
    min_size=10,
    max_size=80,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_events)
def test_running_one_group_step_equals_the_general_one(script: list[Event]) -> None:
    """A step of running requests only (none new or resumed), over one group with a store each
    step, is applied and collected in one pass (``EagerStore.apply_running_one``): every plan and
    outcome equals the general path's, with decode steps as columns or as cached requests,
    through preemptions, finishes, failed reports and resets."""
    script = [("admit", base, 30, "ok") for base in range(len(BASES))] + script
    for columns in (True, False):
        fast = run("eager", script, decode_columns=columns)
        slow = run("eager", script, decode_columns=columns, general=True)
        assert fast.sim.workers.plans == slow.sim.workers.plans
        assert fast.sim.outcomes == slow.sim.outcomes
        assert fast.sim.mgr.stats() == slow.sim.mgr.stats()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_events)
def test_decode_steps_plan_what_the_general_path_plans(script: list[Event]) -> None:
    """Steps of running requests only, one token each, handed to ``decode_step`` whole (every
    running request in columns, as over vLLM): one group under the eager policy, with a store
    each step or coalesced over 3 steps, every plan, outcome and stat equals the general path's
    given the same news as columns, through preemptions, finishes, failed reports and resets;
    and the invariants hold after every event."""
    script = [("admit", base, 30, "ok") for base in range(len(BASES))] + script
    for interval in (1, 3):
        fast = run("eager", script, interval=interval, decode_steps=True)
        slow = run("eager", script, interval=interval, decode_steps=True, general=True)
        assert fast.sim.workers.plans == slow.sim.workers.plans
        assert fast.sim.outcomes == slow.sim.outcomes
        assert fast.sim.mgr.stats() == slow.sim.mgr.stats()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_lazy_invariants_hold_with_decode_steps(script: list[Event]) -> None:
    """Lazy policy with steady steps handed to ``decode_step`` (its news go through the general
    path as columns): refs, cached data and loaded data stay consistent."""
    run("lazy", script, decode_steps=True)


def quiet_and_told(script: list[Event]) -> tuple[Engine, Engine]:
    """The script after one admit per base, lazy over a keyed view, run twice: steady steps
    given to ``quiet_step`` by number, and given whole; their plans must be equal."""
    script = [("admit", base, 30, "ok") for base in range(len(BASES))] + script
    quiet = run("lazy", script, keyed=True, quiet_steps=True)
    told = run("lazy", script, keyed=True, decode_steps=True)
    assert quiet.sim.workers.plans == told.sim.workers.plans
    return quiet, told


def test_a_block_stored_freed_again_and_taken_untold_leaves_the_quiet_walks_prefix() -> None:
    """Blocks a preemption frees are picked for a store, come back behind the cursor and are
    walked again; once the engine takes one of them untold, the quiet walk drops it from the
    covered prefix as the told one does, and both store the same blocks in the same step (a
    stale walk-order entry kept such a block covered: the store came a step late)."""
    steps: list[Event] = [("step", 0, 12, "ok")] * 5 + [("step", 0, 5, "ok")] * 2
    _, told = quiet_and_told(
        [
            *steps,
            ("preempt", 0, 12, "ok"),
            ("report", 0, 12, "ok"),
            *[("step", 0, 12, "ok")] * 6,
            ("step", 0, 5, "ok"),
        ]
    )
    assert any(len(plan.stores) for plan in told.sim.workers.plans[14:])


def test_blocks_taken_untold_while_a_reset_is_pending_lose_their_pre_reset_mark() -> None:
    """Once a pending cache reset settles, the quiet walk stores a block that the engine took
    untold while the reset waited and refilled with the same tokens, as the told walk does."""
    script: list[Event] = [
        *[("step", 0, 12, "ok")] * 4,
        *[("step", 0, 30, "ok")] * 2,
        ("finish", 0, 12, "ok"),
        ("reset", 0, 12, "ok"),
        *[("step", 0, 12, "ok")] * 3,
        ("preempt", 0, 12, "ok"),
        ("step", 0, 5, "ok"),
        ("preempt", 0, 12, "ok"),
        ("report", 1, 12, "ok"),
        ("admit", 0, 12, "ok"),
        *[("step", 0, 12, "ok")] * 4,
        ("admit", 0, 12, "ok"),
        ("reset", 0, 12, "ok"),
        *[("step", 0, 12, "ok")] * 3,
        ("step", 0, 5, "ok"),
        ("step", 0, 30, "ok"),
        ("step", 0, 12, "ok"),
    ]
    _, told = quiet_and_told(script)
    stored_after_reset = [p for p in told.sim.workers.plans[20:] if p.stores]
    assert stored_after_reset, "the scenario no longer stores a block after the second reset"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_events)
def test_quiet_steps_plan_what_steps_with_the_running_news_plan(script: list[Event]) -> None:
    """Lazy over a keyed view with steady decode steps given to ``quiet_step`` by their number
    alone (the running requests' new blocks never told, as vLLM's adapter passes them): every
    plan equals that of the same steps passed whole, and the invariants hold."""
    quiet, told = quiet_and_told(script)
    assert quiet.sim.outcomes == told.sim.outcomes
