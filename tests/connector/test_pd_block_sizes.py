"""P and D with different block sizes (16 ↔ 32) over the PD connector: wire blocks of 16
tokens, block ids mapped on each side, both sides hashing at the wire unit. Outputs are the
colocated engine's token for token, D computes one prompt token, and P's KV lands byte for byte
in D's blocks; a block-size pair without a common wire unit is refused at HELLO and D
recomputes. A leak check after each test."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvflow.core.protocol import GroupBlockIds
from kvflow.core.requests import RequestLike
from kvflow.engine.engine import Engine
from tests.connector.pd_pair import Pair, engine
from tests.engine.helpers import prompts, requests
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

pytestmark = pytest.mark.usefixtures("no_leaks")

# Mid-block and block-aligned at both 16 and 32; one shorter than a 32-token block.
PROMPTS = prompts([23, 32, 45, 64, 70])
MAX_TOKENS = 5
CONFIG: dict[str, Any] = {"num_gpu_blocks": 48, "max_num_batched_tokens": 256}


def colocated(block_size: int) -> list[tuple[int, ...]]:
    e = engine(block_size=block_size, **CONFIG)
    out = [r.output_token_ids for r in e.run_to_completion(requests(PROMPTS, MAX_TOKENS))]
    e.shutdown()
    return out


def tokens_kv(e: Engine, table: list[int], n: int) -> torch.Tensor:
    """K and V of every layer for tokens ``0 .. n - 1`` of a request with ``table``."""
    kv = e.kv_caches
    rows = []
    for name in sorted(kv):
        t = kv[name]
        per_token = t[:, torch.tensor(table)].reshape(2, -1, *t.shape[3:])
        rows.append(per_token[:, :n])
    return torch.stack(rows).clone()


@pytest.mark.parametrize(("p_bs", "d_bs"), [(16, 32), (32, 16)])
def test_block_sizes_16_and_32_match_a_colocated_engine(p_bs: int, d_bs: int) -> None:
    """P at one block size, D at the other, wire unit 16: every output is the colocated
    engine's, D computes exactly one prompt token per request and loads the rest from P."""
    pd = Pair(block_size=p_bs, d_block_size=d_bs, wire_block_size=16, **CONFIG)
    try:
        results = pd.run(PROMPTS, MAX_TOKENS)
        want = colocated(d_bs)
        assert [r.output_token_ids for r in results] == want
        assert want == colocated(p_bs)
        for r, p in zip(results, PROMPTS, strict=True):
            assert r.prefill_tokens_computed == 1
            assert r.external_loaded_tokens == len(p) - 1
        assert pd.dc.stats["handoffs_ok"] == len(PROMPTS)
        pd.check_no_leaks()
    finally:
        pd.close()


def test_p_s_kv_lands_byte_for_byte_in_d_s_larger_blocks() -> None:
    """P at 16, D at 32: the KV of every prompt token D loaded is P's, byte for byte, though
    each D block holds two of P's."""
    pd = Pair(block_size=16, d_block_size=32, wire_block_size=16, **CONFIG)
    try:
        prompt = PROMPTS[4]  # 70 tokens: P's blocks 0..4, D's 0..2
        p_kv: list[torch.Tensor] = []
        d_table: list[int] = []
        p_finished = pd.pc.request_finished

        def on_finished(request: RequestLike, block_ids: GroupBlockIds) -> Any:
            p_kv.append(tokens_kv(pd.p, list(block_ids[0]), len(prompt) - 1))
            return p_finished(request, block_ids)

        pd.pc.request_finished = on_finished  # type: ignore[method-assign]
        pr = pd.prefill("r0", prompt)
        assert pr.kv_transfer_params is not None
        pd.d.add_request(prompt, 1, request_id="r0", kv_transfer_params=pr.kv_transfer_params)
        for _ in range(2_000):
            pd.step()
            if "r0" in pd.d._finished:
                break
            table = pd.d.blocks.block_ids("r0")[0]
            if table:
                d_table[:] = table
        got = tokens_kv(pd.d, d_table, len(prompt) - 1)
        assert torch.equal(got, p_kv[0])
        pd.d.take_result("r0")
        pd.drain()
        pd.check_no_leaks()
    finally:
        pd.close()


def test_block_sizes_without_a_common_wire_unit_are_refused_and_d_recomputes() -> None:
    """P at 16 and D at 32, each moving its own block size: HELLO refuses (a typed error in
    the connector's log), D treats it as a miss and computes the prompt itself; the output is
    still the colocated engine's."""
    pd = Pair(block_size=16, d_block_size=32, **CONFIG)
    try:
        results = pd.run(PROMPTS[:2], MAX_TOKENS)
        assert [r.output_token_ids for r in results] == colocated(32)[:2]
        assert [r.external_loaded_tokens for r in results] == [0, 0]
        pd.check_no_leaks()
    finally:
        pd.close()
