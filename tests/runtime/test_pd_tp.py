"""PD between engines of different TP sizes, over spawned rank processes (CPU, gloo data plane
pair by pair, zmq control plane): each D rank's kv heads come from the P ranks that hold them,
outputs equal a colocated engine's token for token with poison-on-free everywhere, D computes
one prompt token per request, and both engines end with every block back and nothing live."""

from __future__ import annotations

from typing import Any

import pytest
from tests.engine.helpers import make_engine, prompts, requests
from tests.runtime.test_pd_router import check_p_killed_mid_copy

from kvflow.engine.model import model_config
from kvflow.errors import ConfigError
from kvflow.pd.router import PDRouter
from kvflow.pd.worker import WorkerSpec, rank_transport

ENGINE: dict[str, Any] = {"block_size": 4, "num_gpu_blocks": 96, "poison_freed_blocks": True}
PROMPTS = prompts([10, 17, 24])
MAX_TOKENS = 4


def _expected(engine: dict[str, Any]) -> list[tuple[int, ...]]:
    colocated = make_engine(**engine)
    return [r.output_token_ids for r in colocated.run_to_completion(requests(PROMPTS, MAX_TOKENS))]


def _kv_bytes(prompts: list[list[int]], wire: int) -> int:
    """The full model's KV bytes of the wire blocks D claims of each prompt (all but the last
    token, which D computes): float32, K and V, every layer."""
    cfg = model_config("tiny")
    per_row = 2 * wire * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers
    return sum(-(-(len(p) - 1) // wire) * per_row for p in prompts)


def _assert_clean(router: PDRouter) -> None:
    """Both engines whole: every block back, no hand-off live, and on a TP engine no rank's
    op unreported to rank 0 nor a copy still running on any rank."""
    p, d = router.summaries["P"], router.summaries["D"]
    assert p["leaked_blocks"] == d["leaked_blocks"] == 0
    assert p["live_handoffs"] == d["live_handoffs"] == 0
    for side, tp in zip((p, d), router.tp, strict=True):
        if tp > 1:
            assert side["rank_ops_pending"] == side["ranks_in_flight"] == 0


@pytest.mark.parametrize(
    ("tp", "engines"),
    [((1, 2), {}), ((2, 1), {"D": {"block_size": 8, "num_gpu_blocks": 48}})],
    ids=["p1_d2", "p2_d1_block_4_to_8"],
)
def test_sequential_flow_between_tp_sizes_matches_a_colocated_engine(
    tp: tuple[int, int], engines: dict[str, dict[str, Any]]
) -> None:
    """P tp1 → D tp2 (P's one rank sends half its heads to each D rank), and P tp2 → D tp1
    with D at block size 8 (D's rank gathers its heads from both P ranks, wire unit 4):
    identical outputs, one prompt token computed on D per request, every hand-off committed,
    nothing leaked on either side."""
    expected = _expected(ENGINE)
    with PDRouter(engine=ENGINE, timeout_s=60, tp=tp, engines=engines, wire_block_size=4) as router:
        got = router.run(requests(PROMPTS, MAX_TOKENS))
    assert [g.result.output_token_ids for g in got] == expected
    assert all(g.result.prefill_tokens_computed == 1 for g in got)
    _assert_clean(router)
    assert router.summaries["D"]["handoffs_ok"] == len(PROMPTS)
    # Every rank's heads moved: the full model's KV of each prompt, once.
    assert router.summaries["P"]["bytes_moved"] == _kv_bytes(PROMPTS, wire=4)


def test_concurrent_flow_from_tp2_to_tp2_streams_every_rank_s_chunks() -> None:
    """P tp2 → D tp2, concurrent flow with chunked prefill (both P ranks push each fenced
    chunk to their D rank): identical outputs, nothing leaked; a claim that reached P before
    it admitted the request is a one-shot miss that D recomputes."""
    engine = {**ENGINE, "max_num_batched_tokens": 8}
    expected = _expected(engine)
    with PDRouter(engine=engine, timeout_s=60, tp=(2, 2), flow="concurrent") as router:
        got = router.run(requests(PROMPTS, MAX_TOKENS))
    assert [g.result.output_token_ids for g in got] == expected
    _assert_clean(router)
    d = router.summaries["D"]
    assert d["handoffs_ok"] + d["handoffs_failed"] == len(PROMPTS)
    assert d["handoffs_ok"] >= 1
    for g in got:
        if g.result.external_loaded_tokens:
            assert g.result.prefill_tokens_computed == 1


def test_a_p_rank_killed_during_a_running_copy_fails_the_whole_hand_off() -> None:
    """P tp2 → D tp1, SIGKILL of P's rank 1 while the sends run (paused between chunks): D's
    part from that rank fails at once, so the whole hand-off fails however the other part
    ends; D holds the claimed blocks until P is declared dead and the quarantine passed, then
    recomputes; the outputs are the colocated engine's and D ends with every block back."""
    check_p_killed_mid_copy(lambda router: router.kill("P", rank=1), tp=(2, 1))


def test_tp_needs_one_port_per_part_and_the_gloo_transport() -> None:
    """A spec whose ports do not match the plan, or TP on another transport: ConfigError."""
    spec = WorkerSpec("producer", "P", "D", "tiny", ENGINE, 0, tp=1, peer_tp=2, pair_ports=(1,))
    with pytest.raises(ConfigError, match="2 parts"):
        rank_transport(spec, 0)
    with pytest.raises(ConfigError, match="gloo"):
        PDRouter(tp=(1, 2), transport="nixl")
