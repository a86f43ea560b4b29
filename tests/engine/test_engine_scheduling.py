"""Continuous batching, chunked prefill, GPU prefix caching, preemption and request life."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from kvflow.connector.api import NULL_BLOCK_ID, NullConnector
from kvflow.core.hashing import hash_blocks
from kvflow.core.requests import EngineHashedRequest, SchedulerOutput
from kvflow.engine.engine import Engine, EngineConfig, GenerationRequest
from kvflow.engine.model import build_model, model_config, read_safetensors, save_weights
from kvflow.engine.request import Request, RequestInput, RequestStats, RequestStatus, transition
from kvflow.errors import ConfigError, TransitionError
from tests.engine.helpers import make_engine, prompts, requests, shared_model, shared_prefix_prompts


class RecordingConnector(NullConnector):
    """A do-nothing connector that keeps every SchedulerOutput it is shown."""

    def __init__(self) -> None:
        self.outputs: list[SchedulerOutput] = []

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        self.outputs.append(scheduler_output)
        return None


def _outputs(engine: Engine, reqs: list[GenerationRequest]) -> list[tuple[int, ...]]:
    return [r.output_token_ids for r in engine.run_to_completion(reqs)]


@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
def test_prefix_caching_on_and_off_give_identical_outputs(name: str) -> None:
    """Requests sharing a prefix hit the GPU prefix cache and still produce identical tokens."""
    ps = shared_prefix_prompts(24, [5, 9, 3])
    off = make_engine(name, enable_prefix_caching=False)
    on = make_engine(name)
    want = [*_outputs(off, requests(ps[:1], 4)), *_outputs(off, requests(ps[1:], 4))]
    got = [*_outputs(on, requests(ps[:1], 4)), *_outputs(on, requests(ps[1:], 4))]
    assert got == want
    assert off.stats.gpu_cached_tokens == 0
    assert on.stats.gpu_cached_tokens == 2 * 24  # 24 = 6 full blocks of 4, for each later request
    assert on.stats.prefill_tokens_computed == off.stats.prefill_tokens_computed - 48


@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
def test_preemption_by_recompute_keeps_outputs_identical(name: str) -> None:
    """With too few blocks for the batch, requests are preempted, recomputed, and agree."""
    ps = prompts([30, 26, 22, 18], seed=5)
    blocks = 20 * (2 if name == "tiny-swa6" else 1)  # every group draws on the one pool
    roomy = make_engine(name, num_gpu_blocks=256)
    tight = make_engine(name, num_gpu_blocks=blocks, max_num_batched_tokens=16)
    want = _outputs(roomy, requests(ps, 8))
    results = tight.run_to_completion(requests(ps, 8))
    assert [r.output_token_ids for r in results] == want
    assert tight.stats.preemptions > 0
    assert sum(r.num_preemptions for r in results) == tight.stats.preemptions
    assert tight.blocks.num_free_blocks() == blocks - 1  # all back but the null block


def test_token_budget_and_chunked_prefill() -> None:
    """No step schedules more than the budget; a long prompt is split across steps."""
    rec = RecordingConnector()
    cfg = model_config("tiny")
    engine = Engine(
        cfg,
        EngineConfig(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=8),
        scheduler_connector=rec,
        model=make_engine().model,
    )
    engine.run_to_completion(requests(prompts([19, 3]), 3))
    totals = [
        sum(r.num_scheduled_tokens for r in o.new_requests)
        + sum(r.num_scheduled_tokens for r in o.cached_requests)
        for o in rec.outputs
    ]
    assert max(totals) <= 8
    first = rec.outputs[0]
    assert [r.num_scheduled_tokens for r in first.new_requests] == [8]
    chunks = [
        c.num_computed_tokens
        for o in rec.outputs
        for c in o.cached_requests
        if c.request_id == "r0" and c.num_scheduled_tokens > 1
    ]
    assert chunks == [8, 16]  # then 16..19 completes the 19-token prompt
    finished = [o.finished_request_ids for o in rec.outputs if o.finished_request_ids]
    assert frozenset({"r1"}) in finished or frozenset({"r0", "r1"}) in finished


def test_sliding_window_group_frees_blocks_outside_the_window() -> None:
    """A hybrid model keeps only the window's blocks in its sliding group."""
    engine = make_engine("tiny-swa6", max_num_batched_tokens=64)
    (p,) = prompts([40])
    engine.add_request(p, 4, request_id="long")
    engine.step()  # the whole prompt
    engine.step()  # a decode: its allocation frees what the window left behind (as vLLM does)
    full, sliding = engine.blocks.block_ids("long")
    assert len(full) == 11  # 41 positions
    assert NULL_BLOCK_ID not in full
    assert sliding.count(NULL_BLOCK_ID) >= 8  # only blocks holding the last 6 positions stay
    held = [b for b in sliding if b != NULL_BLOCK_ID]
    assert len(held) <= 3
    assert not set(held) & set(full)  # one shared pool: each id belongs to one group's table
    assert engine.blocks.num_free_blocks() == engine.blocks.num_usable_blocks - len(full) - len(
        held
    )


def test_invalid_requests_raise_config_errors() -> None:
    """Empty, too long, out-of-vocabulary or duplicate requests are refused without side effects."""
    engine = make_engine(num_gpu_blocks=8)
    with pytest.raises(ConfigError, match="empty prompt"):
        engine.add_request([], 3)
    with pytest.raises(ConfigError, match="GPU blocks"):
        engine.add_request([1] * 40, 3)
    with pytest.raises(ConfigError, match="out of range"):
        engine.add_request([5000], 3)
    with pytest.raises(ConfigError, match="max_tokens"):
        engine.add_request([1], 0)
    engine.add_request([1, 2], 2, request_id="a")
    with pytest.raises(ConfigError, match="already in use"):
        engine.add_request([1, 2], 2, request_id="a")
    assert list(engine.scheduler.requests) == ["a"]


def test_request_offers_its_live_block_hashes_to_a_connector() -> None:
    """A request hands a connector its own live hash list, current after every appended token
    that completes a block, and none at a block size it does not hash."""
    req = Request("r", [1, 2, 3, 4, 5, 6], 4, RequestStats(arrival_time=0.0), block_size=4)
    assert isinstance(req, EngineHashedRequest)
    assert req.engine_block_hashes(8) is None
    live = req.engine_block_hashes(4)
    assert live == hash_blocks([1, 2, 3, 4], 4)
    req.append_token(7)
    assert len(live) == 1
    req.append_token(8)
    assert live == hash_blocks(list(range(1, 9)), 4)
    assert req.output_token_ids == [7, 8]


def test_request_transitions_follow_the_table_and_log() -> None:
    """Legal transitions log request_transition; illegal ones raise and change nothing."""
    req = Request("x", [1, 2, 3], 2, RequestStats(arrival_time=0.0))
    with capture_logs() as logs:
        transition(req, RequestInput.SCHEDULE, cause="test")
        with pytest.raises(TransitionError):
            transition(req, RequestInput.REMOTE_DONE, cause="test")
    assert req.status is RequestStatus.RUNNING
    assert [e["event"] for e in logs] == ["request_transition", "request_transition_rejected"]
    assert logs[0]["from"] == "waiting"
    assert logs[0]["to"] == "running"


def test_reset_prefix_cache_refuses_while_busy_and_forgets_when_idle() -> None:
    """Reset is refused with requests in flight; afterwards nothing hits."""
    engine = make_engine()
    (p,) = prompts([20])
    engine.add_request(p, 2, request_id="a")
    engine.step()
    assert engine.reset_prefix_cache() is False
    while engine.has_unfinished():
        engine.step()
    engine.take_result("a")
    assert engine.reset_prefix_cache() is True
    (again,) = engine.run_to_completion([GenerationRequest(p, 2)])
    assert again.gpu_cached_tokens == 0


def test_safetensors_weights_round_trip(tmp_path: Path) -> None:
    """Weights saved from one random model load into another and reproduce its outputs."""
    cfg = model_config("tiny")
    src = build_model(cfg, seed=7)
    path = tmp_path / "w.safetensors"
    save_weights(src, path)
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    assert header["model.embed_tokens.weight"]["shape"] == [cfg.vocab_size, cfg.hidden_size]
    assert header["model.embed_tokens.weight"]["dtype"] == "F32"
    loaded = read_safetensors(path)
    torch.testing.assert_close(loaded["lm_head.weight"], src.lm_head.weight.detach())
    (p,) = prompts([9])
    a = Engine(cfg, EngineConfig(block_size=4, num_gpu_blocks=32), model=src)
    b = Engine(cfg, EngineConfig(block_size=4, num_gpu_blocks=32, weights=str(path), seed=99))
    assert _outputs(a, [GenerationRequest(p, 4)]) == _outputs(b, [GenerationRequest(p, 4)])


def test_safetensors_missing_tensor_is_named(tmp_path: Path) -> None:
    """A checkpoint lacking a tensor is refused with its name."""
    from kvflow.engine.model import write_safetensors

    path = tmp_path / "partial.safetensors"
    write_safetensors({"model.norm.weight": torch.ones(128)}, path)
    with pytest.raises(ConfigError, match="missing tensors"):
        build_model(model_config("tiny"), weights=path)


class CountingConnector(NullConnector):
    """A connector that matches nothing and counts how often it was asked, per request."""

    def __init__(self) -> None:
        self.asked: dict[str, int] = {}

    def get_num_new_matched_tokens(
        self, request: object, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = str(getattr(request, "request_id", ""))
        self.asked[rid] = self.asked.get(rid, 0) + 1
        return 0, False


def test_a_head_without_blocks_is_asked_again_only_once_blocks_change() -> None:
    """While nothing comes free or is cached, the waiting head that found no blocks is not
    re-matched every step; it is admitted once a request finishes, with the same tokens."""
    counting = CountingConnector()
    cfg = model_config("tiny")
    # 11 usable blocks: the first request's 36 tokens take 9, the second needs 6 to start, so
    # it waits out the first one's 12 steps.
    econf = EngineConfig(block_size=4, num_gpu_blocks=12, max_num_batched_tokens=64)
    engine = Engine(
        cfg,
        econf,
        model=shared_model("tiny"),
        scheduler_connector=counting,
        worker_connector=counting,
    )
    ps = prompts([24, 24], seed=9)
    results = engine.run_to_completion(requests(ps, 12))
    assert [r.output_token_ids for r in results] == [
        r.output_token_ids for r in make_engine().run_to_completion(requests(ps, 12))
    ]
    assert engine.stats.steps >= 24
    # Asked when it first failed, after each of the first request's three new cached blocks,
    # and when that request finished: not at each of the 12 steps it waited.
    assert counting.asked["r1"] <= 6
