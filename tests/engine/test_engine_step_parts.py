"""``EngineConfig.record_step_parts``: each step's parts timed on the engine's clock, by kind."""

from __future__ import annotations

import pytest

from kvflow.engine.engine import Engine, EngineConfig
from kvflow.engine.model import model_config
from kvflow.engine.step_parts import PARTS, StepParts, step_kind, summarize
from tests.engine.helpers import prompts, requests, shared_model


class Ticker:
    """A clock that moves 1 ms each time it is read: every part of a step takes whole ms."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def test_each_step_is_recorded_with_its_kind_and_parts_that_add_up() -> None:
    """A prefill step, then decode steps: one record each, on the engine's clock, whose parts
    add up to the step (every part took time on the ticking clock); none without the flag."""
    clock = Ticker()
    cfg = EngineConfig(block_size=4, num_gpu_blocks=32, record_step_parts=True)
    engine = Engine(model_config("tiny"), cfg, model=shared_model("tiny"), clock=clock)
    engine.run_to_completion(requests(prompts([9]), 3))
    kinds = [p.kind for p in engine.step_parts]
    assert kinds[:3] == ["prefill", "decode", "decode"]
    assert len(engine.step_parts) == engine.stats.steps
    first = engine.step_parts[0]
    assert first.tokens == 9
    assert len(first.seconds) == len(PARTS)
    assert all(s > 0 for s in first.seconds)
    starts = [p.began for p in engine.step_parts]
    assert starts == sorted(starts)
    plain = Engine(model_config("tiny"), EngineConfig(block_size=4), model=shared_model("tiny"))
    plain.run_to_completion(requests(prompts([9]), 3))
    assert plain.step_parts == []


@pytest.mark.parametrize(
    ("lengths", "kind"),
    [((), "idle"), ((1, 1), "decode"), ((5,), "prefill"), ((5, 3), "prefill"), ((1, 7), "mixed")],
)
def test_a_step_kind_follows_its_chunks(lengths: tuple[int, ...], kind: str) -> None:
    """Nothing computed: idle; single tokens only: decode; chunks only: prefill; both: mixed."""
    assert step_kind(lengths) == kind


def test_summarize_means_per_window_and_leaves_out_steps_outside_them() -> None:
    """Per kind, sums over the windows' steps divided by the number of windows; a step before
    the first window is not counted; no window gives nothing."""
    sec = tuple(0.001 for _ in PARTS)
    parts = [
        StepParts("prefill", 8, 0.5, sec),  # before the windows
        StepParts("prefill", 8, 1.0, sec),
        StepParts("decode", 2, 1.5, sec),
        StepParts("decode", 2, 2.5, sec),
        StepParts("decode", 2, 2.9, sec),
    ]
    got = summarize(parts, [(1.0, 2.0), (2.0, 3.0)])
    assert list(got) == ["decode", "prefill"]
    assert got["decode"]["steps"] == 1.5
    assert got["decode"]["tokens"] == 3.0
    assert got["prefill"]["steps"] == 0.5
    assert got["decode"]["total_ms"] == pytest.approx(1.5 * len(PARTS))
    assert got["decode"]["wait_ms"] == pytest.approx(1.5)
    assert summarize(parts, []) == {}
