"""``DeferredIssue``: a load's parts issued one ahead of the engine's waits, in order, once."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from kvflow.backends.cuda.deferred import DeferredIssue


class Part:
    """Stands in for a part's ``CudaFence`` (only its identity matters here)."""


def job(parts: int, log: list[str], fail_at: int | None = None) -> Generator[int, None, None]:
    """A batch's issue as the backend writes it: each part, then the batch's end; a failure is
    recorded (here: logged) and ends the generator."""
    for k in range(parts):
        if k == fail_at:
            log.append(f"failed {k}")
            return
        log.append(f"part {k}")
        yield k
    log.append("end")


def started(
    parts: int, fail_at: int | None = None
) -> tuple[DeferredIssue, list[object], list[str]]:
    log: list[str] = []
    fences: list[object] = [Part() for _ in range(parts)]
    d = DeferredIssue()
    d.start(job(parts, log, fail_at), fences)
    return d, fences, log


def test_start_issues_part_zero_only() -> None:
    """Starting a load issues its first part and nothing else."""
    _, _, log = started(4)
    assert log == ["part 0"]


def test_each_wait_issues_through_the_next_part() -> None:
    """Waiting for part k issues parts up to k + 1, never one twice, and the last part's issue
    runs the batch's end."""
    d, fences, log = started(4)
    d.through(1)
    assert log == ["part 0", "part 1"]
    d.through(1)
    assert log == ["part 0", "part 1"]
    d.through(3)
    assert log == ["part 0", "part 1", "part 2", "part 3", "end"]
    assert d.pending_index(fences[0]) is None  # nothing pending any more


def test_a_request_past_the_last_part_finishes_the_batch() -> None:
    """Asking for parts beyond the last one finishes the whole issue."""
    d, _, log = started(2)
    d.through(5)
    assert log == ["part 0", "part 1", "end"]


def test_finish_issues_everything_left_and_a_new_start_finishes_the_old_load_first() -> None:
    """A second load starts only after the first one's issue has ended, so batches are issued
    in the order they came."""
    d, _, log = started(3)
    other: list[str] = []
    d.start(job(2, other), [Part(), Part()])
    assert log == ["part 0", "part 1", "part 2", "end"]
    assert other == ["part 0"]
    d.finish()
    assert other == ["part 0", "part 1", "end"]


def test_pending_index_names_only_the_pending_loads_parts() -> None:
    """A fence is found among the pending load's parts by identity, and a stranger is not."""
    d, fences, _ = started(3)
    assert [d.pending_index(f) for f in fences] == [0, 1, 2]
    assert d.pending_index(Part()) is None


def test_a_failure_part_way_ends_the_issue() -> None:
    """A part whose issue fails ends the generator: later waits issue nothing more."""
    d, fences, log = started(4, fail_at=2)
    d.through(1)
    assert log == ["part 0", "part 1"]
    d.through(2)
    assert log == ["part 0", "part 1", "failed 2"]
    assert d.pending_index(fences[3]) is None
    d.finish()
    assert log == ["part 0", "part 1", "failed 2"]


def test_an_issue_that_raises_reaches_the_caller_and_close_drops_what_is_left() -> None:
    """An unexpected error in a later part's issue reaches the caller that resumed it; closing
    leaves nothing pending."""

    def raising() -> Generator[int, None, None]:
        yield 0
        raise RuntimeError("driver gone")

    d = DeferredIssue()
    fences: list[object] = [Part(), Part()]
    d.start(raising(), fences)
    assert d.pending
    with pytest.raises(RuntimeError):
        d.finish()
    d.start(job(3, []), [Part(), Part(), Part()])
    d.close()
    assert not d.pending
