"""PD and D's CPU tier in one manager: the hand-off's GPU holds are references on the offload
manager's ledger beside the CPU tier's loads, D's CPU-tier hit covers the prefix and only the
rest comes from P, byte for byte; a block one half writes is never the other half's target."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import pytest
import torch

from kvflow.connector.api import KVConnectorOutput
from kvflow.connector.pd_offload import PDOffloadConnector
from kvflow.core.protocol import GroupBlockIds
from kvflow.core.requests import RequestLike
from kvflow.engine.engine import Engine
from kvflow.errors import ProtocolError
from tests.connector.pd_pair import Pair, engine
from tests.engine.helpers import prompts, requests
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

pytestmark = pytest.mark.usefixtures("no_leaks")

PROMPTS = prompts([9, 16, 23])
MAX_TOKENS = 5


def block_bytes(e: Engine, blocks: Sequence[int]) -> torch.Tensor:
    """K and V of every layer of ``blocks``, copied (what a hand-off must reproduce)."""
    kv = e.kv_caches
    return torch.stack([torch.stack([kv[n][:, b] for n in sorted(kv)]) for b in blocks]).clone()


class Tables:
    """Records each request's block table as a connector sees it, and P's KV bytes at the
    moment P's request finished (before anything could reuse its blocks)."""

    def __init__(self, pd: Pair) -> None:
        self.d: list[tuple[str, GroupBlockIds]] = []
        self.p: dict[str, torch.Tensor] = {}
        dc, pc = pd.dc, pd.pc
        d_alloc, p_finished = dc.update_state_after_alloc, pc.request_finished

        def on_alloc(
            request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
        ) -> None:
            self.d.append((request.request_id, tuple(tuple(g) for g in block_ids)))
            d_alloc(request, block_ids, num_external_tokens)

        def on_finished(request: RequestLike, block_ids: GroupBlockIds) -> Any:
            self.p[request.request_id] = block_bytes(pd.p, block_ids[0])
            return p_finished(request, block_ids)

        dc.update_state_after_alloc = on_alloc  # type: ignore[method-assign]
        pc.request_finished = on_finished  # type: ignore[method-assign]


def test_d_s_cpu_tier_prefix_and_p_s_rest_are_byte_exact() -> None:
    """D's blocks after the hand-off: the CPU tier's part is byte for byte the KV D computed
    itself for that prefix, P's part byte for byte P's blocks; the output is the colocated
    engine's and nothing leaks on either tier."""
    pd = Pair(d_cpu_tier=True)
    try:
        tables = Tables(pd)
        first = PROMPTS[2]
        pd.d.run_to_completion(requests([first], MAX_TOKENS))
        pd.drain()
        own = block_bytes(pd.d, tables.d[-1][1][0][:5])  # tokens 0..19, as D computed them
        assert pd.d.scheduler.reset_prefix_cache()
        longer = first[:20] + PROMPTS[1][:9]
        (r,) = pd.run([longer], MAX_TOKENS)
        e = engine()
        (want,) = e.run_to_completion(requests([longer], MAX_TOKENS))
        e.shutdown()
        assert r.output_token_ids == want.output_token_ids
        table = tables.d[-1][1][0]
        got = block_bytes(pd.d, table[:7])
        assert torch.equal(got[:5], own)  # from D's CPU tier
        assert torch.equal(got[5:7], tables.p["r0"][5:7])  # from P
        pd.check_no_leaks()
    finally:
        pd.close()


def test_a_hand_off_s_blocks_are_held_on_the_offload_ledger_while_it_is_live() -> None:
    """While D waits for P, D's claimed blocks carry one more reference than the request's own,
    taken by the offload manager's ledger for the hand-off, and none of them is a CPU-tier
    load target; when the hand-off ends the ledger holds nothing."""
    pd = Pair(d_cpu_tier=True)
    try:
        pr = pd.prefill("r0", PROMPTS[2])
        assert pr.kv_transfer_params is not None
        pd.d.add_request(
            PROMPTS[2], MAX_TOKENS, request_id="r0", kv_transfer_params=pr.kv_transfer_params
        )
        c = pd.d.scheduler_connector
        assert isinstance(c, PDOffloadConnector)
        holds = c.offload.scheduler.manager.pd_holds
        seen = False

        def done() -> bool:
            """Checks the holds after each step; True once both engines are done."""
            nonlocal seen
            refs = holds.refs()
            if refs:
                seen = True
                assert set(holds.exclusive_blocks()) == set(refs)
                for b, n in refs.items():
                    assert n == 1
                    assert pd.d.blocks.pool.blocks[b].ref_cnt == 2  # the request's and the hold's
            return not (pd.p.has_unfinished() or pd.d.has_unfinished())

        # Bounded by time, not by a count of steps: on a loaded machine zmq can take longer
        # than a fixed number of fast steps to deliver the CLAIM.
        pd.step_until(done, "both engines done")
        assert seen
        assert len(holds) == 0
        pd.d.take_result("r0")
        pd.check_no_leaks()
    finally:
        pd.close()


def test_a_cpu_load_onto_a_block_pd_writes_is_refused_and_changes_nothing() -> None:
    """A CPU-tier load into a block a hand-off writes, and a second hand-off writing the same
    block, are refused with ``ProtocolError`` before anything changed."""
    pd = Pair(d_cpu_tier=True)
    try:
        c = pd.d.scheduler_connector
        assert isinstance(c, PDOffloadConnector)
        holds = c.offload.scheduler.manager.pd_holds
        ledger = pd.dc.driver.manager.ledger
        ledger.take("t-x", ((3, 4),))
        before = holds.refs()
        with pytest.raises(ProtocolError, match="held by hand-off"):
            holds.check_load([2, 4])
        with pytest.raises(ProtocolError, match="already held"):
            ledger.take("t-y", ((4, 5),))
        assert holds.refs() == before
        assert not ledger.holds("t-y")
        ledger.give_back("t-x")
        assert not holds.refs()
        pd.check_no_leaks()
    finally:
        pd.close()


class _Part:
    """One half of ``PDOffloadConnector`` reduced to what its join reads: a fixed match, and
    the output it reports next."""

    def __init__(self, matched: int) -> None:
        self.matched = matched
        self.next = KVConnectorOutput()
        self.scheduler = self

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self.matched, self.matched > 0

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorOutput:
        out, self.next = self.next, KVConnectorOutput()
        return out


class _Named:
    """A request as far as the join reads it: its id."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def test_a_load_with_a_pd_part_is_not_dated_by_its_cpu_part() -> None:
    """A request loaded from the CPU tier alone is dated when it is received; one whose load also
    had a part from P is received undated, whether P's part ends after the CPU's or in the same
    step (PD does not date its copies, so the CPU part's landing could be too early)."""
    cpu, pd = _Part(matched=16), _Part(matched=8)
    joined = PDOffloadConnector.__new__(PDOffloadConnector)
    joined.offload, joined.pd = cpu, pd  # type: ignore[assignment]
    joined._split, joined._recving, joined._sending, joined._undated = {}, {}, {}, set()
    both, alone = (cast(RequestLike, _Named(rid)) for rid in ("both", "alone"))
    assert joined.get_num_new_matched_tokens(both, 0) == (24, True)
    joined.update_state_after_alloc(both, ((1, 2, 3, 4, 5, 6),), 24)
    pd.matched = 0
    assert joined.get_num_new_matched_tokens(alone, 0) == (16, True)
    joined.update_state_after_alloc(alone, ((7, 8, 9, 10),), 16)
    cpu.next = KVConnectorOutput(
        finished_recving=frozenset({"both", "alone"}), loads_landed={"both": 1.0, "alone": 1.5}
    )
    out = joined.update_connector_output(KVConnectorOutput())
    assert (set(out.finished_recving), dict(out.loads_landed)) == ({"alone"}, {"alone": 1.5})
    pd.next = KVConnectorOutput(finished_recving=frozenset({"both"}))
    out = joined.update_connector_output(KVConnectorOutput())
    assert (set(out.finished_recving), dict(out.loads_landed)) == ({"both"}, {})
    # Both parts done in one step: still undated (P's part may have landed after the CPU's).
    same = cast(RequestLike, _Named("same"))
    pd.matched = 8
    assert joined.get_num_new_matched_tokens(same, 0) == (24, True)
    joined.update_state_after_alloc(same, ((11, 12, 13, 14, 15, 16),), 24)
    cpu.next = KVConnectorOutput(finished_recving=frozenset({"same"}), loads_landed={"same": 2.0})
    pd.next = KVConnectorOutput(finished_recving=frozenset({"same"}))
    out = joined.update_connector_output(KVConnectorOutput())
    assert (set(out.finished_recving), dict(out.loads_landed)) == ({"same"}, {})
    assert joined._undated == set()
