"""Where an engine step's time goes, part by part (``EngineConfig.record_step_parts``).

A step runs, in order: the scheduler's ``schedule``, the connector's ``build_connector_meta``,
the runner's ``launch`` (the worker connector's calls and the forward pass enqueued), the
scheduler's ``update_connector_output``, the wait for the sampled tokens (on a GPU, the device's
work left after the launch), ``update_from_output``, and, in a step with nothing to compute, the
worker's ``wait_for_progress``. With ``EngineConfig.async_scheduling`` the tokens waited for
and the output applied are those of the step launched by the call before (the kind and tokens
are the launched step's). ``summarize`` adds them up per kind of step: decode (single tokens
only), prefill (chunks only), mixed, idle (nothing to compute).
"""

from __future__ import annotations

from collections.abc import Iterable

from attrs import frozen

PARTS = ("schedule", "meta", "launch", "connector_output", "tokens", "outputs", "wait")
"""A step's parts, in the order they run."""

KINDS = ("decode", "prefill", "mixed", "idle")


@frozen(slots=True)
class StepParts:
    """One step: its kind, the tokens it computed, when it began (engine clock) and the seconds
    of each part of ``PARTS``, in that order."""

    kind: str
    tokens: int
    began: float
    seconds: tuple[float, ...]


def step_kind(chunk_lengths: Iterable[int]) -> str:
    """The kind of a step whose chunks computed ``chunk_lengths`` tokens each."""
    lengths = list(chunk_lengths)
    if not lengths:
        return "idle"
    if max(lengths) == 1:
        return "decode"
    return "prefill" if min(lengths) > 1 else "mixed"


def summarize(
    parts: Iterable[StepParts], windows: Iterable[tuple[float, float]]
) -> dict[str, dict[str, float]]:
    """Per kind of step, means per window (a round, say: steps that began in ``[start, end)``):
    ``steps``, ``tokens`` and the ms of each part and of the whole step (``total``). Kinds no
    window saw are left out; no window, nothing."""
    spans = list(windows)
    if not spans:
        return {}
    sums: dict[str, list[float]] = {}
    for p in parts:
        if not any(start <= p.began < end for start, end in spans):
            continue
        acc = sums.setdefault(p.kind, [0.0] * (len(PARTS) + 3))
        acc[0] += 1
        acc[1] += p.tokens
        for i, s in enumerate(p.seconds):
            acc[2 + i] += s * 1e3
        acc[-1] += sum(p.seconds) * 1e3
    names = ("steps", "tokens", *(f"{name}_ms" for name in PARTS), "total_ms")
    return {
        kind: {name: value / len(spans) for name, value in zip(names, sums[kind], strict=True)}
        for kind in KINDS
        if kind in sums
    }


__all__ = ["KINDS", "PARTS", "StepParts", "step_kind", "summarize"]
