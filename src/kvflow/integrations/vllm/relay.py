"""Report relay: the metadata that crosses vLLM's process boundaries, and the outcome relay.

``KVFlowConnectorMetadata`` carries the manager's ``StepPlan`` to every worker,
``KVFlowWorkerMetadata`` each rank's ``StepReport`` back; ``OutcomeRelay`` writes the scheduler
role's verdict into the ``KVConnectorOutput`` fields vLLM acts on, in the order vLLM reads them.

Why request completion is decided on the scheduler side: vLLM reads ``finished_sending`` and
``finished_recving`` right after ``update_connector_output``, which has just fed every rank's
report to the manager, so the relay writes the manager's verdict there (a store counts only once
every rank reported it). ``invalid_block_ids``, however, are read *before* that hook, so a worker
reports its own failed loads directly, and ids only the manager knows (a load dropped by
``reset_cache``) go back to the workers in the next metadata and return through the next output;
the affected ``finished_recving`` are held back until then, as vLLM requires.
"""

from __future__ import annotations

from collections.abc import Set
from typing import TYPE_CHECKING, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvflow.core.protocol import StepPlan, StepReport
from kvflow.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput


class OutcomeLike(Protocol):
    """What vLLM acts on after the workers reported (kvflow's connector ``KVConnectorOutput``)."""

    @property
    def finished_sending(self) -> Set[str]: ...
    @property
    def finished_recving(self) -> Set[str]: ...
    @property
    def invalid_block_ids(self) -> Set[int]: ...


class KVFlowConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers, once per step: the manager's plan (None: nothing for the workers to
    do this step), plus load failures to echo back (block ids with one KV cache group, request
    ids with several)."""

    def __init__(
        self,
        plan: StepPlan | None,
        echo_invalid_block_ids: frozenset[int] = frozenset(),
        echo_failed_request_ids: frozenset[str] = frozenset(),
    ):
        self.plan = plan
        self.echo_invalid_block_ids = echo_invalid_block_ids
        self.echo_failed_request_ids = echo_failed_request_ids

    def __repr__(self) -> str:
        return (
            f"KVFlowConnectorMetadata({self.plan!r}, echo={sorted(self.echo_invalid_block_ids)}, "
            f"echo_failed={sorted(self.echo_failed_request_ids)})"
        )


class KVFlowWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler, once per step: each rank's ``StepReport`` (vLLM merges the ranks)."""

    def __init__(self, reports: tuple[StepReport, ...]):
        self.reports = reports

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVFlowWorkerMetadata:
        if not isinstance(other, KVFlowWorkerMetadata):
            raise ConfigError(f"cannot merge kvflow worker metadata with {type(other).__name__}")
        return KVFlowWorkerMetadata(self.reports + other.reports)

    def __repr__(self) -> str:
        return f"KVFlowWorkerMetadata({self.reports!r})"


def report_has_news(report: StepReport) -> bool:
    return bool(report.completed or report.failed or report.invalid_block_ids)


_NO_ECHO: tuple[frozenset[int], frozenset[str]] = (frozenset(), frozenset())
IDLE_METADATA = KVFlowConnectorMetadata(None, *_NO_ECHO)
"""A step with nothing for the workers: no plan, nothing to echo. One object, never changed."""


class OutcomeRelay:
    """Turns the manager's outcomes into ``KVConnectorOutput`` fields, honouring vLLM's ordering.

    vLLM reads load failures (``invalid_block_ids``, or ``failed_recving`` request ids when there
    are several KV cache groups, whose block ids it cannot map back) before
    ``update_connector_output``. Failures the workers did not report in this pass are echoed
    through the next metadata, and the affected ``finished_recving`` wait for them. With several
    groups the outcome's block ids cannot be tied to requests, so every load that settled in such
    a pass and was not flagged by a worker is echoed as failed: vLLM recomputes it, which is
    always safe.
    """

    __slots__ = ("_echo", "_echo_requests", "_held_recving", "_per_request")

    def __init__(self, per_request: bool = False) -> None:
        self._per_request = per_request
        self._echo: set[int] = set()
        self._echo_requests: set[str] = set()
        self._held_recving: set[str] = set()

    def apply(self, connector_output: KVConnectorOutput, outcome: OutcomeLike | None) -> None:
        if (
            connector_output.finished_sending is None
            and connector_output.finished_recving is None
            and not self._held_recving
            and (
                outcome is None
                or not (
                    outcome.finished_sending
                    or outcome.finished_recving
                    or outcome.invalid_block_ids
                )
            )
        ):
            return  # most steps: nothing finished, nothing failed, nothing held
        sending = set(connector_output.finished_sending or ())
        recving: set[str] = set()
        if outcome is not None:
            sending |= outcome.finished_sending
            recving |= outcome.finished_recving
            if self._per_request:
                suspects = recving - set(connector_output.failed_recving or ())
                if outcome.invalid_block_ids and suspects:
                    self._echo_requests |= suspects
                    self._held_recving |= suspects
                    recving -= suspects
            else:
                late = set(outcome.invalid_block_ids) - set(
                    connector_output.invalid_block_ids or ()
                )
                if late:
                    self._echo |= late
                    self._held_recving |= recving
                    recving = set()
        if self._held_recving and not (self._echo or self._echo_requests):
            recving |= self._held_recving
            self._held_recving = set()
        connector_output.finished_sending = sending or None
        connector_output.finished_recving = (
            recving | set(connector_output.finished_recving or ())
        ) or None

    def metadata(self, plan: StepPlan | None) -> KVFlowConnectorMetadata:
        """This step's metadata: ``plan`` and the echo, or with neither the one shared idle
        metadata (most lazy steps: nothing is made for them)."""
        if not (self._echo or self._echo_requests):
            return IDLE_METADATA if plan is None else KVFlowConnectorMetadata(plan)
        return KVFlowConnectorMetadata(plan, *self.take_echo())

    def take_echo(self) -> tuple[frozenset[int], frozenset[str]]:
        """Block ids and request ids to send to the workers now; held completions are released on
        the next ``apply``."""
        if not (self._echo or self._echo_requests):
            return _NO_ECHO
        echo = frozenset(self._echo), frozenset(self._echo_requests)
        self._echo, self._echo_requests = set(), set()
        return echo

    @property
    def pending(self) -> bool:
        return bool(self._echo or self._echo_requests or self._held_recving)


__all__ = [
    "IDLE_METADATA",
    "KVFlowConnectorMetadata",
    "KVFlowWorkerMetadata",
    "OutcomeLike",
    "OutcomeRelay",
    "report_has_news",
]
