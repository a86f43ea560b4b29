"""CPU-side tests of ``Timing.seconds_beyond``: a batch's copy time less what the previous
batch of its direction overlapped, on events whose device times a stand-in driver knows."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.backends.cuda import driver as drv
from kvflow.backends.cuda.timing import Timing


class _Pool:
    def give(self, event: object) -> None:
        pass


def timing(start: float, end: float) -> Timing:
    """A ``Timing`` whose events are their device times (seconds)."""
    t = Timing.__new__(Timing)
    t.pool, t.start, t.end = _Pool(), start, end  # type: ignore[assignment]
    t.seen_done = False
    return t


def old_formula(cur: tuple[float, float], prev: tuple[float, float]) -> float:
    """The overlap rule with every elapsed time read, as it was written first."""
    seconds = cur[1] - cur[0]
    prev_start, prev_end = prev[0] - cur[0], prev[1] - cur[0]
    overlap = min(seconds, prev_end) - max(0.0, prev_start)
    return max(0.0, seconds - max(0.0, overlap))


@given(
    start=st.floats(0, 10),
    length=st.floats(0, 5),
    prev_start=st.floats(0, 10),
    prev_length=st.floats(0, 5),
)
def test_seconds_beyond_counts_an_overlap_once_and_skips_a_read_when_there_is_none(
    start: float, length: float, prev_start: float, prev_length: float
) -> None:
    """A batch's seconds less the part of the previous batch's span that overlapped it, as the
    rule reading every elapsed time gives; where the previous batch ended before this one
    began, its start is never read (one driver call less on the settling poll)."""
    reads: list[tuple[float, float]] = []

    def elapsed(a: Any, b: Any) -> float:
        reads.append((a, b))
        return float(b - a)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(drv, "elapsed_s", elapsed)
        cur = timing(start, start + length)
        prev = timing(prev_start, prev_start + prev_length)
        got = cur.seconds_beyond(prev)
        with_prev = len(reads)
        alone = cur.seconds_beyond(None)
    want = old_formula((start, start + length), (prev_start, prev_start + prev_length))
    assert got == pytest.approx(want, abs=1e-9)
    assert alone == pytest.approx(length)
    # This batch's span, the previous one's end, and its start only if that end came later.
    assert with_prev == (3 if prev_start + prev_length - start > 0.0 else 2)


def test_seconds_beyond_is_none_when_the_driver_cannot_say(monkeypatch: pytest.MonkeyPatch) -> None:
    """An elapsed time the driver cannot give (events not completed) makes the batch's seconds
    None, and a previous batch the driver cannot place is not subtracted."""
    monkeypatch.setattr(drv, "elapsed_s", lambda a, b: None)
    assert timing(0.0, 1.0).seconds_beyond(timing(0.0, 0.5)) is None
    monkeypatch.setattr(drv, "elapsed_s", lambda a, b: None if b == 0.5 else b - a)
    assert timing(0.0, 1.0).seconds_beyond(timing(0.2, 0.5)) == pytest.approx(1.0)


def test_a_previous_batch_seen_done_is_not_read_again() -> None:
    """A batch issued after a poll saw the previous one done takes no overlap from it (its end
    came before anything of the new batch was queued), so settling reads one elapsed time; a
    previous batch not yet seen done is still subtracted."""
    prev = timing(0.0, 2.0)
    assert Timing.overlapping(None) is None
    assert Timing.overlapping(prev) is prev
    prev.seen_done = True
    assert Timing.overlapping(prev) is None
