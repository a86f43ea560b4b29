"""The worker side's boundary: what a ``SyncWorker`` checks on the engine's thread before a call is
applied or posted to the runtime's loop.

``PlanGate`` knows the registered layout (GPU blocks per group) and the CPU tier (CPU blocks per
group), and the last plan it let through. A call before ``register_kv_caches`` and
``allocate_cpu_tier`` is a ``ProtocolError``; a plan is checked whole (ids in range, unique per
transfer, no CPU block in two transfers, a later step and newer transfers than the last plan) and
refused with state unchanged, so the next valid plan works.
"""

from __future__ import annotations

from collections.abc import Sequence

from attrs import define

from kvflow.core import validate
from kvflow.core.layout import KVLayout
from kvflow.core.protocol import StepPlan
from kvflow.errors import ProtocolError


@define(eq=False)
class PlanGate:
    """One sync worker's view of what it has registered and bound; only the engine's thread uses it."""

    gpu_blocks: tuple[int, ...] | None = None
    cpu_blocks: tuple[int, ...] | None = None
    last_step: int | None = None
    last_transfer_id: int = -1

    def registered(self, layout: KVLayout) -> None:
        self.gpu_blocks = tuple(g.num_blocks for g in layout.groups)
        self.cpu_blocks = None  # a tier sized for another layout does not count

    def allocated(self, num_blocks: int | Sequence[int]) -> None:
        assert self.gpu_blocks is not None  # the runtime refuses a tier before registration
        counts = (
            (num_blocks,) * len(self.gpu_blocks)
            if isinstance(num_blocks, int)
            else tuple(num_blocks)
        )
        self.cpu_blocks = counts

    def require(self, call: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The registered (GPU, CPU) blocks per group; ``ProtocolError`` naming ``call`` if the
        KV caches or the CPU tier are not there yet."""
        if self.gpu_blocks is None or self.cpu_blocks is None:
            what = "register_kv_caches" if self.gpu_blocks is None else "allocate_cpu_tier"
            raise ProtocolError(f"{call} before {what}")
        return self.gpu_blocks, self.cpu_blocks

    def check(self, plan: StepPlan) -> None:
        """Raise if ``plan`` must not be bound; changes nothing."""
        gpu, cpu = self.require("bind_connector_metadata")
        validate.plan_order(plan, self.last_step, self.last_transfer_id)
        validate.plan(plan, gpu, cpu)

    def record(self, plan: StepPlan) -> None:
        """``plan`` was bound: later plans must come after it."""
        self.last_step = plan.step
        for spec in (*plan.stores, *plan.loads):
            if spec.transfer_id > self.last_transfer_id:
                self.last_transfer_id = spec.transfer_id


__all__ = ["PlanGate"]
