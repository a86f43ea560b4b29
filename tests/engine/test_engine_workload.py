"""The multi-round QA workload: deterministic, histories grow with answers, stats recorded."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from kvflow.engine.engine import GenerationRequest, RequestResult
from kvflow.engine.workload import MultiRoundQA, RoundRecord, run_multi_round
from kvflow.errors import ConfigError
from tests.engine.helpers import make_engine

WL = MultiRoundQA(
    num_users=3,
    num_rounds=3,
    system_prompt_len=16,
    first_question_len=8,
    question_len=6,
    answer_len=4,
)


def test_workload_is_deterministic_and_prompts_grow_with_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same seed → same prompts; each round's prompt extends the last one plus its answer."""
    assert WL.system_prompt() == MultiRoundQA(system_prompt_len=16).system_prompt()
    assert WL.question(1, 2) == WL.question(1, 2)
    assert WL.question(1, 2) != WL.question(2, 2)
    assert MultiRoundQA(seed=1).system_prompt() != MultiRoundQA(seed=0).system_prompt()
    engine = make_engine()
    prompts: dict[tuple[int, int], list[int]] = {}
    original = engine.run_to_completion

    def spy(reqs: Sequence[GenerationRequest]) -> list[RequestResult]:
        for r in reqs:
            assert r.request_id is not None
            user, rnd = (int(x[1:]) for x in r.request_id.split("-"))
            prompts[(user, rnd)] = list(r.prompt_token_ids)
        return original(reqs)

    monkeypatch.setattr(engine, "run_to_completion", spy)
    result = run_multi_round(engine, WL)
    outputs = result.outputs()
    for user, rnd in itertools.product(range(3), range(3)):
        assert len(prompts[(user, rnd)]) == WL.prompt_len(rnd)
        assert prompts[(user, rnd)][:16] == WL.system_prompt()
        if rnd:
            before = prompts[(user, rnd - 1)] + list(outputs[(user, rnd - 1)])
            assert prompts[(user, rnd)][: len(before)] == before
    assert WL.working_set_tokens == 16 + 3 * (WL.prompt_len(2) + 4 - 16)


def test_small_gpu_cache_holds_part_of_the_working_set() -> None:
    """With a cache below the working set, later rounds hit only partly; TTFT uses the clock."""
    ticks = itertools.count()

    def clock() -> float:
        return float(next(ticks))

    big = make_engine(num_gpu_blocks=256, clock=clock)
    small = make_engine(num_gpu_blocks=30, clock=clock)
    assert WL.working_set_tokens > 30 * 4
    r_big = run_multi_round(big, WL)
    r_small = run_multi_round(small, WL)
    assert r_small.outputs() == r_big.outputs()
    later_big = sum(r.result.gpu_cached_tokens for r in r_big.records if r.round > 0)
    later_small = sum(r.result.gpu_cached_tokens for r in r_small.records if r.round > 0)
    assert 0 < later_small < later_big
    assert r_small.total("prefill_tokens_computed") > r_big.total("prefill_tokens_computed")
    assert all(r.ttft_s > 0 for r in r_small.records)
    assert r_small.ttft_percentile(50) <= r_small.ttft_percentile(90)
    assert isinstance(r_small.records[0], RoundRecord)


def test_workload_rejects_bad_shapes() -> None:
    """Non-positive sizes and a vocabulary beyond the model's are refused."""
    with pytest.raises(ConfigError):
        MultiRoundQA(num_users=0)
    with pytest.raises(ConfigError, match="vocab"):
        run_multi_round(make_engine(), MultiRoundQA(vocab_size=5000))
