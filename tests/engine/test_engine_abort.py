"""``Engine.abort_request`` from each state a request can be in: waiting, running, preempted;
the blocks come back, the other requests' outputs are unchanged, a finished one is refused."""

from __future__ import annotations

from kvflow.engine.request import RequestStatus
from tests.engine.helpers import make_engine, prompts, requests

PROMPTS = prompts([12, 9, 14])


def _expected() -> list[tuple[int, ...]]:
    e = make_engine()
    return [r.output_token_ids for r in e.run_to_completion(requests(PROMPTS, 6))]


def test_abort_while_waiting_and_while_running_frees_blocks_and_spares_the_rest() -> None:
    """One request aborted before it is scheduled, one after it ran a step: both vanish with
    their blocks, the third finishes with the tokens it gets alone; a second abort is False."""
    want = _expected()
    e = make_engine()
    for i, p in enumerate(PROMPTS):
        e.add_request(p, 6, request_id=f"r{i}")
    assert e.abort_request("r1")  # waiting
    e.step()
    assert e.scheduler.requests["r0"].status is RequestStatus.RUNNING
    assert e.abort_request("r0")  # running
    assert not e.abort_request("r0")
    assert not e.abort_request("nobody")
    while e.has_unfinished():
        e.step()
    assert e.take_result("r2").output_token_ids == want[2]
    assert not e.scheduler.requests
    assert e.blocks.num_free_blocks() == e.blocks.num_usable_blocks


def test_abort_of_a_preempted_request_frees_it() -> None:
    """A request preempted for lack of blocks can be aborted while it waits to run again."""
    e = make_engine(num_gpu_blocks=9, max_num_batched_tokens=64)
    for i, p in enumerate(PROMPTS[:2]):
        e.add_request(p, 12, request_id=f"r{i}")
    preempted = None
    for _ in range(200):
        e.step()
        preempted = next(
            (r for r in e.scheduler.requests.values() if r.status is RequestStatus.PREEMPTED),
            None,
        )
        if preempted is not None:
            break
    assert preempted is not None
    assert e.abort_request(preempted.request_id)
    while e.has_unfinished():
        e.step()
    assert not e.scheduler.requests
    assert e.blocks.num_free_blocks() == e.blocks.num_usable_blocks
