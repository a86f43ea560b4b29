"""D's prompt longer than P's (P's sampled first token riding along, or more): D loads every
token of P's prompt that P's params name (``remote_num_tokens``) and computes only what follows;
outputs equal a colocated engine's; a count that is not a positive int is a logged miss D
recomputes, with P released; a count past D's prompt claims D's prompt; a leak check after each
test."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.connector.pd_pair import Pair, engine
from tests.engine.helpers import prompts, requests
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

pytestmark = pytest.mark.usefixtures("no_leaks")

# Block size 4: mid-block, block-aligned, and 11 (+1 fills the last block exactly).
PROMPTS = prompts([9, 16, 11, 23])
MAX_TOKENS = 5


def colocated(ps: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[tuple[int, ...]]:
    e = engine()
    out = [r.output_token_ids for r in e.run_to_completion(requests(ps, max_tokens))]
    e.shutdown()
    return out


def test_p_s_first_token_rides_along_and_d_computes_only_that_token(pair: Pair) -> None:
    """D's prompt is P's plus P's sampled token: D loads all of P's prompt (every length mod
    the block size, the last block partial or filled by that token), computes that token alone,
    and P's token followed by D's equals the colocated engine's output."""
    expected = colocated(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        pr = pair.prefill(rid, prompt)
        assert pr.kv_transfer_params is not None
        assert pr.kv_transfer_params["remote_num_tokens"] == len(prompt)
        tok = pr.output_token_ids[0]
        r = pair.decode(rid, [*prompt, tok], MAX_TOKENS - 1, pr.kv_transfer_params)
        assert (tok, *r.output_token_ids) == expected[i]
        assert r.external_loaded_tokens == len(prompt)
        assert r.prefill_tokens_computed == 1
    assert pair.dc.stats["handoffs_ok"] == len(PROMPTS)
    pair.check_no_leaks()


def test_d_computes_every_token_past_p_s_prompt(pair: Pair) -> None:
    """D's prompt runs three tokens past P's: D loads P's prompt and computes the three."""
    base = PROMPTS[0]
    longer = [*base, 5, 6, 7]
    pr = pair.prefill("r0", base)
    assert pr.kv_transfer_params is not None
    r = pair.decode("r0", longer, MAX_TOKENS, pr.kv_transfer_params)
    assert r.output_token_ids == colocated([longer])[0]
    assert r.external_loaded_tokens == len(base)
    assert r.prefill_tokens_computed == 3
    pair.check_no_leaks()


@pytest.mark.parametrize("count", [0, -1, "9", 9.0, True], ids=repr)
def test_a_remote_token_count_that_is_not_a_positive_int_is_a_logged_miss(
    pair: Pair, count: Any
) -> None:
    """P's params name a count that is not a positive int: D computes the whole prompt itself
    (the same output), says why in ``pd_remote_tokens_invalid``, and releases P's hold at once
    (P's hand-off ends on D's release, not on its lease)."""
    prompt = PROMPTS[0]
    pr = pair.prefill("r0", prompt)
    assert pr.kv_transfer_params is not None
    params = {**pr.kv_transfer_params, "remote_num_tokens": count}
    with capture_logs() as logs:
        r = pair.decode("r0", prompt, MAX_TOKENS, params)
        pair.step_until(lambda: not pair.pc.driver.manager.transfers, "P's hold released")
    assert r.output_token_ids == colocated([prompt])[0]
    assert r.external_loaded_tokens == 0
    assert r.prefill_tokens_computed == len(prompt)
    (bad,) = [e for e in logs if e["event"] == "pd_remote_tokens_invalid"]
    assert bad["remote_num_tokens"] == repr(count)
    assert bad["prompt_tokens"] == len(prompt)
    ends = [e for e in logs if e["event"] == "pd_producer_transition" and e["to"] == "released"]
    assert [e["input"] for e in ends] != ["lease_expired"]
    assert len(ends) == 1
    pair.check_no_leaks()


def test_a_count_past_d_s_prompt_claims_d_s_prompt_and_p_s_hashes_decide(pair: Pair) -> None:
    """P's params name more tokens than D's prompt has: D claims its own prompt (less its last
    token) and hashes its whole prompt; here P's prompt is D's, so P's hashes match and the KV
    is used. (P's prompt really longer than D's: ``test_kv_of_another_request_is_refused_by_hash``
    of the connector tests.)"""
    prompt = PROMPTS[0]
    pr = pair.prefill("r0", prompt)
    assert pr.kv_transfer_params is not None
    params = {**pr.kv_transfer_params, "remote_num_tokens": 999}
    r = pair.decode("r0", prompt, MAX_TOKENS, params)
    assert r.output_token_ids == colocated([prompt])[0]
    assert r.external_loaded_tokens == len(prompt) - 1
    assert pair.dc.stats["handoffs_ok"] == 1
    pair.check_no_leaks()


def test_d_s_prompt_of_another_request_past_p_s_is_refused_by_hash(pair: Pair) -> None:
    """The tokens P's prompt covers differ on D (another request with P's length and params):
    P's hashes do not match, D recomputes and its output is its own prompt's."""
    pr = pair.prefill("x", PROMPTS[1])
    assert pr.kv_transfer_params is not None
    other = [*PROMPTS[3][:16], 1]  # 16 tokens as P's, then one more
    r = pair.decode("r0", other, MAX_TOKENS, pr.kv_transfer_params)
    assert r.output_token_ids == colocated([other])[0]
    assert r.external_loaded_tokens == 0
    assert pair.dc.stats["handoffs_failed"] == 1
    pair.check_no_leaks()
