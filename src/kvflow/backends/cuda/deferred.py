"""A fenced load's parts issued as the engine reaches them, on the caller's thread.

Without a launch thread the engine's own thread issues a batch's driver calls inside ``submit``.
For a load in parts that would issue every part before the forward's first kernel is enqueued:
the part planning and driver calls of the later parts would hold back the layers that could
already run. Here the batch's issue is a generator that stops after each part; ``submit_parts``
runs it through part 0, and each ``compute_wait`` on part ``k`` runs it through part ``k + 1``
(one part ahead, so that the copy engine finds the next part queued behind the one it copies).
Anything else the backend is asked to do first finishes the whole issue, so batches are issued
in the order they were submitted.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Sequence


class DeferredIssue:
    """The one load whose later parts are not issued yet (or none)."""

    def __init__(self) -> None:
        self._job: Generator[int, None, None] | None = None
        self._parts: Sequence[object] = ()  # the parts' fences, known by identity
        self._issued = 0  # parts of ``_job`` issued so far
        # Calls come from the engine's thread; a runtime on a thread of its own may submit
        # while the engine waits, and a generator must not be resumed from two threads at once.
        self._lock = threading.Lock()

    def start(self, job: Generator[int, None, None], parts: Sequence[object]) -> None:
        """Take ``job`` (which yields each part's index once that part is issued, and records
        a failure on the fences rather than raising) and issue its part 0 now."""
        self.finish()
        with self._lock:
            self._job, self._parts, self._issued = job, parts, 0
        self.through(0)

    def through(self, part: int) -> None:
        """Issue the pending load's parts up to ``part`` (and the batch's end, once the last
        part is issued)."""
        with self._lock:
            job = self._job
            if job is None or part < self._issued:
                return
            last = len(self._parts) - 1
            target = min(part, last)
            for k in job:
                self._issued = k + 1
                if k >= target and k < last:
                    return
            self._job = None  # the generator ran to its end: every part and the fence issued

    @property
    def pending(self) -> bool:
        """Whether a load's issue is left to run."""
        return self._job is not None

    def pending_index(self, fence: object) -> int | None:
        """``fence``'s part index if it belongs to the pending load, else None."""
        if self._job is None:
            return None
        for k, part in enumerate(self._parts):
            if part is fence:
                return k
        return None

    def finish(self) -> None:
        """Issue whatever is left of the pending load."""
        if self._job is not None:
            self.through(len(self._parts))

    def close(self) -> None:
        """Drop what is left (the backend is closing and has issued it, or could not)."""
        self._job = None


__all__ = ["DeferredIssue"]
