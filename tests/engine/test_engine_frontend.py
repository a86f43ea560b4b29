"""The async frontend serves many concurrent ``generate`` calls from one engine task."""

from __future__ import annotations

import anyio
import pytest

from kvflow.engine.frontend import AsyncEngine
from kvflow.errors import ClosedError, ConfigError
from tests.engine.helpers import make_engine, prompts, requests


@pytest.mark.asyncio
@pytest.mark.parametrize("step_in_thread", [True, False])
async def test_concurrent_generate_matches_run_to_completion(step_in_thread: bool) -> None:
    """Eight concurrent streams each get exactly the tokens a synchronous run gives."""
    ps = prompts([5, 9, 13, 7, 21, 3, 11, 16], seed=4)
    want = [r.output_token_ids for r in make_engine().run_to_completion(requests(ps, 6))]
    got: dict[int, list[int]] = {}
    interleaved: list[int] = []

    async def client(i: int, frontend: AsyncEngine) -> None:
        got[i] = []
        async for token in frontend.generate(ps[i], 6, request_id=f"c{i}"):
            got[i].append(token)
            interleaved.append(i)

    async with AsyncEngine(make_engine(), step_in_thread=step_in_thread) as frontend:
        async with anyio.create_task_group() as tg:
            for i in range(len(ps)):
                tg.start_soon(client, i, frontend)
        results = [frontend.result(f"c{i}") for i in range(len(ps))]
    assert [tuple(got[i]) for i in range(len(ps))] == want
    assert len(set(interleaved[: len(ps)])) > 1  # streams advance together, not one by one
    assert all(r.ttft_s >= 0 for r in results)
    assert [r.output_token_ids for r in results] == want


@pytest.mark.asyncio
async def test_generate_reports_invalid_input_and_use_outside_context() -> None:
    """Bad prompts raise ConfigError from generate; generate needs a running frontend."""
    frontend = AsyncEngine(make_engine())
    with pytest.raises(ClosedError):
        async for _ in frontend.generate([1, 2], 2):
            pass
    async with frontend:
        with pytest.raises(ConfigError, match="out of range"):
            async for _ in frontend.generate([99999], 2):
                pass
        tokens = [t async for t in frontend.generate([1, 2, 3], 3)]
    assert len(tokens) == 3
