"""PD on two reference engines with poison-on-free (every block a free leaves unreferenced is
overwritten with NaN) and a fake link that reads P's blocks when a packet lands, not at launch:
a use after free on either side would turn into wrong tokens. Outputs stay the colocated
engine's: a read after the unclaimed lease is refused, a granted hold outlives the lease while
its copy runs, and an abort during a push keeps D's blocks out of the pool until P's ABORT_ACK.
Time is a FakeClock moved by the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvflow.backends.pd.fake import FakeLink
from kvflow.core.pd.machines import DState, PState
from kvflow.engine.engine import Engine
from kvflow.engine.request import RequestStatus
from kvflow.runtime.clock import FakeClock
from tests.connector.pd_pair import Pair, engine
from tests.engine.helpers import prompts, requests
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

pytestmark = pytest.mark.usefixtures("no_leaks")

PROMPTS = prompts([9, 23, 14])
MAX_TOKENS = 5


def colocated() -> list[tuple[int, ...]]:
    e = engine()
    out = [r.output_token_ids for r in e.run_to_completion(requests(PROMPTS, MAX_TOKENS))]
    e.shutdown()
    return out


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pair(clock: FakeClock) -> Iterator[Pair]:
    pd = Pair(FakeLink(late_read=True), clock=clock, poison_freed_blocks=True)
    try:
        yield pd
    finally:
        pd.close()


def poisoned_blocks(e: Engine) -> set[int]:
    """Blocks whose K and V are NaN in every layer."""
    out = None
    for t in e.kv_caches.values():
        nan = torch.isnan(t.flatten(2)).all(dim=2).all(dim=0)
        ids = set(torch.nonzero(nan).flatten().tolist())
        out = ids if out is None else out & ids
    return out or set()


def test_poisoned_engines_give_the_colocated_outputs(pair: Pair) -> None:
    """The sequential flow with poison on both engines and late reads: identical outputs, one
    prompt token computed on D, and every free block of both engines is poison at the end."""
    results = pair.run(PROMPTS, MAX_TOKENS)
    assert [r.output_token_ids for r in results] == colocated()
    assert all(r.prefill_tokens_computed == 1 for r in results)
    for e in (pair.p, pair.d):
        assert poisoned_blocks(e) == set(range(1, e.blocks.num_usable_blocks + 1))
    pair.check_no_leaks()


def test_a_read_after_the_unclaimed_lease_is_refused(pair: Pair, clock: FakeClock) -> None:
    """P's hold expires unclaimed (its blocks freed and poisoned); D's claim that comes later is
    NACKed, so D recomputes instead of reading poison: the output is the colocated one."""
    pr = pair.prefill("r0", PROMPTS[0])
    assert pr.kv_transfer_params is not None
    held = {b for b in pair.p.blocks.block_ids("r0")[0] if b}
    assert held
    assert not held & poisoned_blocks(pair.p)
    clock.jump(pair.pc.driver.manager.timeouts.lease_s + 0.1)
    pair.step()
    assert "t-r0" not in pair.pc.driver.manager.transfers
    assert held <= poisoned_blocks(pair.p)
    r = pair.decode("r0", PROMPTS[0], MAX_TOKENS, pr.kv_transfer_params)
    assert r.output_token_ids == colocated()[0]
    assert r.external_loaded_tokens == 0
    assert pair.dc.stats["handoffs_failed"] == 1
    pair.check_no_leaks()


def test_a_granted_hold_outlives_the_lease_while_its_copy_runs(
    pair: Pair, clock: FakeClock
) -> None:
    """The link takes three lease lengths to deliver P's data (read from P's blocks when it
    lands): P's granted hold never expires meanwhile, D gets P's real KV, not poison."""
    lease = pair.pc.driver.manager.timeouts.lease_s
    pair.link.delay_s = 3 * lease
    pr = pair.prefill("r0", PROMPTS[1])
    assert pr.kv_transfer_params is not None
    pair.d.add_request(
        PROMPTS[1], MAX_TOKENS, request_id="r0", kv_transfer_params=pr.kv_transfer_params
    )
    pm = pair.pc.driver.manager
    pair.step_until(lambda: pm.transfers["t-r0"].state is PState.IN_FLIGHT, "P's push launched")
    held = {b for b in pair.p.blocks.block_ids("r0")[0] if b}
    for _ in range(int(3 * lease / 0.25)):
        clock.jump(0.25)
        pair.step()
        assert not held & poisoned_blocks(pair.p)
        if "t-r0" not in pair.pc.driver.manager.transfers:
            break
    pair.drain()
    r = pair.d.take_result("r0")
    assert r.output_token_ids == colocated()[1]
    assert r.external_loaded_tokens == len(PROMPTS[1]) - 1
    assert pair.dc.stats["handoffs_ok"] == 1
    pair.check_no_leaks()


def test_an_abort_during_a_push_holds_d_s_blocks_until_abort_ack(
    pair: Pair, clock: FakeClock
) -> None:
    """D aborts while P's push is on the wire: D's reserved blocks stay out of the pool (not
    poisoned, not handed to another request) until P's ABORT_ACK; another request that D serves
    meanwhile is the colocated engine's token for token."""
    pair.link.delay_s = 2.0
    pr = pair.prefill("r0", PROMPTS[1])
    assert pr.kv_transfer_params is not None
    pair.d.add_request(
        PROMPTS[1], MAX_TOKENS, request_id="r0", kv_transfer_params=pr.kv_transfer_params
    )
    dm = pair.dc.driver.manager

    def in_flight() -> bool:
        t = dm.transfers.get("t-r0")
        return t is not None and t.state is DState.IN_FLIGHT

    pair.step_until(in_flight, "D's copy in flight")
    reserved = {b for b in pair.d.blocks.block_ids("r0")[0] if b}
    assert reserved
    assert pair.d.scheduler.requests["r0"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert pair.d.abort_request("r0")
    pair.d.add_request(PROMPTS[2], MAX_TOKENS, request_id="other")
    for _ in range(int(3.0 / 0.25)):
        if "t-r0" not in dm.transfers:
            break
        pool = pair.d.blocks.pool.blocks
        assert all(pool[b].ref_cnt > 0 for b in reserved)  # still D's: nothing freed them
        assert not reserved & set(pair.d.blocks.block_ids("other")[0])
        clock.jump(0.25)
        pair.step()
    pair.drain()
    assert pair.d.take_result("other").output_token_ids == colocated()[2]
    pair.check_no_leaks()


def test_poison_mode_catches_a_read_of_freed_kv() -> None:
    """The mode works: poisoning the blocks of a running request (what a free under it does)
    changes its output, and it leaves every block that a request still holds alone."""
    want = colocated()[1]
    e = engine(poison_freed_blocks=True)
    e.add_request(PROMPTS[1], MAX_TOKENS, request_id="r")
    for _ in range(3):
        e.step()
    live = [b for b in e.blocks.block_ids("r")[0] if b]
    assert live
    assert not set(live) & poisoned_blocks(e)
    assert e.blocks.on_freed is not None
    e.blocks.on_freed(live)  # as if someone freed them under the request
    for _ in range(100):
        if not e.has_unfinished():
            break
        e.step()
    assert e.take_result("r").output_token_ids != want
    e.shutdown()
