"""The model runner's step order: the tokens' copy is enqueued before the stores, and the
connector's calls (worker and scheduler side) come before the host waits for the tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvflow.engine.runner import ModelRunner, _Sampled
from tests.engine.helpers import make_engine, prompts, requests


def test_token_readback_is_enqueued_before_wait_for_save() -> None:
    """Every step that samples starts its tokens' copy before the connector fences its stores."""
    engine = make_engine()
    runner = engine.runner
    calls: list[str] = []
    start, save = runner._start_readback, runner.connector.wait_for_save

    def readback(sampled: _Sampled) -> _Sampled:
        calls.append("readback")
        return start(sampled)

    def wait_for_save(*args: Any) -> None:
        calls.append("wait_for_save")
        save(*args)

    runner._start_readback = readback  # type: ignore[method-assign]
    runner.connector.wait_for_save = wait_for_save  # type: ignore[method-assign]
    engine.run_to_completion(requests(prompts([9, 14]), 3))
    assert calls.count("readback") == engine.stats.forward_steps > 0
    for i, call in enumerate(calls):
        if call == "readback":
            assert calls[i + 1] == "wait_for_save"


def test_connector_work_comes_before_the_wait_for_tokens() -> None:
    """Each forward step's get_finished, report and scheduler-side update precede its tokens."""
    engine = make_engine()
    runner = engine.runner
    calls: list[str] = []
    worker, sched = runner.connector, engine.scheduler
    finished, report, update = (
        worker.get_finished,
        worker.build_worker_report,
        sched.update_connector_output,
    )
    tokens = _Sampled.tokens

    def log(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            calls.append(name)
            return fn(*args)

        return call

    worker.get_finished = log("get_finished", finished)  # type: ignore[method-assign]
    worker.build_worker_report = log("report", report)  # type: ignore[method-assign]
    sched.update_connector_output = log("update", update)  # type: ignore[method-assign]
    try:
        _Sampled.tokens = log("tokens", tokens)  # type: ignore[method-assign]
        engine.run_to_completion(requests(prompts([9, 14]), 3))
    finally:
        _Sampled.tokens = tokens  # type: ignore[method-assign]
    assert calls.count("tokens") == engine.stats.forward_steps > 0
    for i, call in enumerate(calls):
        if call == "tokens":
            assert calls[i - 3 : i] == ["get_finished", "report", "update"]


def test_execute_is_launch_then_tokens() -> None:
    """``execute`` returns the same tokens and connector output as ``launch`` + ``tokens``."""
    a, b = make_engine(), make_engine()
    for engine in (a, b):
        for p in prompts([9, 14]):
            engine.add_request(p, 2)
    out_a, batch_a = a.scheduler.schedule()
    out_b, batch_b = b.scheduler.schedule()
    whole = a.runner.execute(out_a, batch_a, a.scheduler_connector.build_connector_meta(out_a))
    launched = b.runner.launch(out_b, batch_b, b.scheduler_connector.build_connector_meta(out_b))
    assert whole.sampled
    assert launched.tokens() == whole.sampled
    assert launched.tokens() is launched.tokens()  # read back once
    assert launched.kv_connector_output == whole.kv_connector_output


def test_readback_on_cpu_keeps_the_tensor() -> None:
    """Without a GPU the tokens are read from the tensor itself: no copy, no event."""
    sampled = _Sampled(["a", "b"], torch.tensor([3, 4]))
    assert ModelRunner._start_readback(make_engine().runner, sampled) is sampled
    assert sampled.tokens() == {"a": 3, "b": 4}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_readback_on_gpu_lands_in_pinned_memory() -> None:
    """On a GPU the tokens arrive through a reused pinned buffer, equal to the device's."""
    runner = make_engine().runner
    for n in (3, 300, 2):
        argmax = torch.arange(n, device="cuda") * 7
        out = runner._start_readback(_Sampled([f"r{i}" for i in range(n)], argmax))
        assert out.host is not None
        assert out.host.is_pinned()
        assert out.tokens() == {f"r{i}": 7 * i for i in range(n)}
