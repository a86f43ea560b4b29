"""The concurrent flow over two spawned engine processes with chunked prefill on P (gloo data
plane): P's hand-offs stream chunk by chunk into D's blocks while P prefills; outputs equal a
colocated engine's token for token and nothing leaks on either side."""

from __future__ import annotations

from typing import Any

from tests.engine.helpers import make_engine, prompts, requests

from kvflow.pd.router import PDRouter

ENGINE: dict[str, Any] = {"block_size": 4, "num_gpu_blocks": 96, "max_num_batched_tokens": 8}
PROMPTS = prompts([33, 41, 26])  # 4 to 6 prefill steps each at 8 tokens a step
MAX_TOKENS = 4


def test_streamed_chunks_over_gloo_match_a_colocated_engine() -> None:
    """P and D get each request at once; P prefills 8 tokens a step and pushes what each step
    fenced: identical outputs, D computes one prompt token for every request it loaded, every
    hand-off ends, no block leaked."""
    colocated = make_engine(**ENGINE)
    expected = [
        r.output_token_ids for r in colocated.run_to_completion(requests(PROMPTS, MAX_TOKENS))
    ]
    with PDRouter(engine=ENGINE, flow="concurrent", timeout_s=60) as router:
        got = router.run(requests(PROMPTS, MAX_TOKENS))
    assert [g.result.output_token_ids for g in got] == expected
    p, d = router.summaries["P"], router.summaries["D"]
    assert p["leaked_blocks"] == d["leaked_blocks"] == 0
    assert p["live_handoffs"] == d["live_handoffs"] == 0
    assert d["handoffs_ok"] + d["handoffs_failed"] == len(PROMPTS)
    assert d["handoffs_ok"] >= 1
    for g in got:
        if g.result.external_loaded_tokens:
            assert g.result.prefill_tokens_computed == 1
