"""Per-request TTFT phases and first-token logits: what ``kvflow bench``'s breakdown and its
half-precision check read from the engine."""

from __future__ import annotations

import pytest
import torch

from kvflow.bench.multi_round import PHASES as BENCH_PHASES
from kvflow.engine.engine import Engine, EngineConfig, RequestTimeline, make_kv_cache_config
from kvflow.engine.model import model_config
from kvflow.engine.workload import MultiRoundQA, run_multi_round
from kvflow.errors import ConfigError
from tests.engine.fake_connector import FakeConnector
from tests.engine.helpers import make_engine, prompts, requests, shared_model

# ``match`` lies within ``queue``: the other parts sum to the TTFT.
PHASES = tuple(p for p in BENCH_PHASES if p != "match")


class TickingClock:
    """A fake engine clock that moves 1 ms at every read, so that every phase has a length."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        self.t += 1e-3
        return self.t


def _async_load_engine(clock: TickingClock, num_gpu_blocks: int = 64) -> Engine:
    cfg = model_config("tiny")
    econf = EngineConfig(
        block_size=4,
        num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    fake = FakeConnector(make_kv_cache_config(cfg, econf), load_async=True, load_delay_steps=2)
    return Engine(
        cfg,
        econf,
        model=shared_model("tiny"),
        scheduler_connector=fake,
        worker_connector=fake,
        clock=clock.now,
    )


def test_timeline_parts_sum_to_the_ttft_and_none_is_negative() -> None:
    """Chunked prefills and async loads on a ticking clock: each request's phases are >= 0 and
    add up to its TTFT; a reloaded request's load phases and a long prompt's prefill are > 0."""
    engine = _async_load_engine(TickingClock())
    ps = prompts([40, 9, 23], seed=3)
    first = engine.run_to_completion(requests(ps, 3))
    again = engine.run_to_completion(requests(ps, 3))
    for res in first + again:
        t = res.timeline
        assert isinstance(t, RequestTimeline)
        parts = [getattr(t, p) for p in PHASES]
        assert min(parts) >= 0
        assert sum(parts) == pytest.approx(res.ttft_s)
        assert 0 <= t.match <= t.queue
    assert first[0].timeline is not None
    assert first[0].timeline.prefill > 0
    reloaded = [r for r in again if r.external_loaded_tokens > 0]
    assert reloaded
    for res in reloaded:
        assert res.timeline is not None
        assert res.timeline.load_launch > 0
        assert res.timeline.load_copy > 0
        # The fake connector does not date its loads: the whole wait is load_copy.
        assert (res.timeline.dated, res.timeline.load_seen) == (False, 0)


def test_a_request_preempted_before_its_first_token_starts_its_path_again() -> None:
    """Requests that computed on a synchronous load, were preempted (before or after their
    first token) and came back through an asynchronous one: every phase of every TTFT is >= 0
    and they add up to it (a run before the first token's preemption counts as queueing, a load
    after the first token is no TTFT's)."""
    cfg = model_config("tiny")
    econf = EngineConfig(
        block_size=4, num_gpu_blocks=20, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    fake = FakeConnector(make_kv_cache_config(cfg, econf), load_async=False, load_delay_steps=2)
    engine = Engine(
        cfg,
        econf,
        model=shared_model("tiny"),
        scheduler_connector=fake,
        worker_connector=fake,
        clock=TickingClock().now,
    )
    ps = prompts([40, 36, 44], seed=5)
    first = engine.run_to_completion(requests(ps, 3))
    before = engine.stats.preemptions
    ids = [engine.add_request(p, 3) for p in ps]
    while engine.stats.preemptions == before:
        engine.step()
    fake.load_async = True  # the preempted come back through asynchronous loads
    while engine.has_unfinished():
        engine.step()
    results = [engine.take_result(rid) for rid in ids]
    assert any(r.num_preemptions and r.external_loaded_tokens for r in results)
    assert any(r.num_preemptions for r in first)
    for res in [*first, *results]:
        t = res.timeline
        assert isinstance(t, RequestTimeline)
        parts = [getattr(t, p) for p in PHASES]
        assert min(parts) >= 0, (res.request_id, t)
        assert sum(parts) == pytest.approx(res.ttft_s)


@pytest.mark.parametrize("graphs", ["off", "pieces"])
def test_first_token_logits_are_recorded_only_when_asked(graphs: str) -> None:
    """With record_first_logits every result carries float32 logits whose argmax is its first
    token, from eager steps or mixed-bucket pieces; without it, none."""
    ps = prompts([12, 5, 30], seed=4)
    plain = make_engine(max_num_batched_tokens=16).run_to_completion(requests(ps, 4))
    assert all(r.first_logits is None for r in plain)
    recorded = make_engine(
        max_num_batched_tokens=16, record_first_logits=True, decode_graphs=graphs
    )
    results = recorded.run_to_completion(requests(ps, 4))
    vocab = model_config("tiny").vocab_size
    for r, p in zip(results, plain, strict=True):
        assert r.first_logits is not None
        assert r.first_logits.dtype == torch.float32
        assert r.first_logits.shape == (vocab,)
        assert int(r.first_logits.argmax()) == r.output_token_ids[0]
        assert r.output_token_ids == p.output_token_ids
    used = recorded.runner._graphs
    assert (used is not None and used.mixed_steps_run > 0) == (graphs == "pieces")


def test_replayed_answers_give_every_prompt_the_other_run_saw() -> None:
    """A run replaying another run's answers builds the same prompts, so in float32 it answers
    the same; answers missing a request are a ConfigError naming it."""
    workload = MultiRoundQA(
        num_users=2,
        num_rounds=3,
        system_prompt_len=8,
        first_question_len=8,
        question_len=6,
        answer_len=3,
        vocab_size=512,
    )
    first = run_multi_round(make_engine(), workload)
    replay = run_multi_round(make_engine(), workload, answers=first.outputs())
    assert replay.outputs() == first.outputs()
    assert [r.result.prompt_len for r in replay.records] == [
        r.result.prompt_len for r in first.records
    ]
    missing = dict(first.outputs())
    del missing[(1, 0)]
    with pytest.raises(ConfigError, match="user 1 in round 0"):
        run_multi_round(make_engine(), workload, answers=missing)


def test_a_first_token_computed_as_a_decode_row_is_recorded_from_the_graphs() -> None:
    """A prompt whose blocks all but its last token hit the prefix cache computes that token as
    a decode row: with record_first_logits it still runs on the decode graphs, and its recorded
    logits are the eager engine's and give its token."""
    (p,) = prompts([4 * 4 + 1], seed=9)  # four full blocks of 4, then one token
    eager = make_engine(record_first_logits=True)
    eager.run_to_completion(requests([p], 2))
    (ref,) = eager.run_to_completion(requests([p], 1))
    graphs = make_engine(record_first_logits=True, decode_graphs="pieces")
    graphs.run_to_completion(requests([p], 2))
    used = graphs.runner._graphs
    assert used is not None
    before = used.steps_run
    (got,) = graphs.run_to_completion(requests([p], 1))
    assert got.gpu_cached_tokens == ref.gpu_cached_tokens == 16
    assert used.steps_run == before + 1  # the one step, from the graphs
    assert got.first_logits is not None
    assert ref.first_logits is not None
    assert int(got.first_logits.argmax()) == got.output_token_ids[0] == ref.output_token_ids[0]
    torch.testing.assert_close(got.first_logits, ref.first_logits, rtol=1e-4, atol=1e-4)
