"""PD with the engine's own CPU tier in one manager: a D engine's CPU-tier hit covers the start
of a prompt and only the rest comes from P (a P engine's stores to its CPU tier go on as usual).

One owner of GPU block refs: the PD manager's block ledger is attached to the offload manager's
``TransferLedger`` (``OffloadManager.pd_holds``), so every hold of a hand-off (P's blocks being
read, D's blocks being written) is a reference taken on the ledger beside the CPU tier's loads
and stores, through the same GPU view, checked against them before anything changes: a block
that PD writes is never a CPU-tier load target (and the reverse), and the engine cannot reuse a
block while either half still copies it. The hand-offs' states stay in the PD machines (the
tables of ``kvflow.core.pd.machines``); this object splits each engine call between the two
halves and joins what they report: ``get_num_new_matched_tokens`` asks the CPU tier first, then
PD from where the CPU hit ends; ``update_state_after_alloc`` gives each its part; a request is
named in ``finished_recving`` only once every part that loads it reported, and in
``finished_sending`` only once every part that still read its blocks let go.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvflow.connector.api import KVConnectorOutput
from kvflow.connector.offload import OffloadConnector
from kvflow.connector.pd import PDConnector
from kvflow.core.offload import FenceLoads
from kvflow.core.protocol import GroupBlockIds, StepReport
from kvflow.core.requests import RequestLike, SchedulerOutput

if TYPE_CHECKING:
    import torch

CPU, PD = "cpu", "pd"


class PDOffloadConnector:
    """Both connector roles of one engine: its CPU tier (``offload``) and its PD side (``pd``)."""

    def __init__(self, offload: OffloadConnector, pd: PDConnector) -> None:
        self.offload = offload
        self.pd = pd
        # One owner of GPU refs: PD's holds are taken on the offload manager's ledger.
        pd.driver.manager.ledger.attach(offload.scheduler.manager.pd_holds)
        # A load here may have a CPU part and a PD part, and PD's part is asynchronous: the CPU
        # part is too, so that the whole load reports ``finished_recving``.
        offload.scheduler.manager.fence_loads = FenceLoads.NEVER
        self._split: dict[str, tuple[int, int]] = {}  # rid → (CPU tokens, PD tokens) matched
        self._recving: dict[str, set[str]] = {}  # rid → parts whose loads are still out
        self._sending: dict[str, set[str]] = {}  # rid → parts still reading its blocks
        # rids with a PD part in their load: PD does not date its copies, so such a load's
        # landing (its last part's) is unknown, and the CPU part's would claim it too early.
        self._undated: set[str] = set()

    # ---- scheduler role -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        m, cpu_async = self.offload.scheduler.get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        if m is None:
            return None, False
        n, pd_async = self.pd.get_num_new_matched_tokens(request, num_computed_tokens + m)
        assert n is not None  # PD never asks to be called again
        self._split[request.request_id] = (m, n)
        return m + n, (cpu_async and m > 0) or (pd_async and n > 0)

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        m, n = self._split.pop(rid, (num_external_tokens, 0))
        cpu = min(m, num_external_tokens)
        rest = num_external_tokens - cpu
        self.offload.scheduler.update_state_after_alloc(request, block_ids, cpu)
        self.pd.update_state_after_alloc(request, block_ids, rest if rest == n else 0)
        parts = {p for p, k in ((CPU, cpu), (PD, rest if rest == n else 0)) if k}
        if parts:
            self._recving[rid] = parts
        if PD in parts:
            self._undated.add(rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        return self.offload.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorOutput:
        cpu = self.offload.scheduler.update_connector_output(output)
        pd = self.pd.update_connector_output(KVConnectorOutput())
        assert pd is not None
        recving = self._join(
            self._recving, ((CPU, cpu.finished_recving), (PD, pd.finished_recving))
        )
        sending = self._join(
            self._sending, ((CPU, cpu.finished_sending), (PD, pd.finished_sending))
        )
        landed = {
            r: t for r, t in cpu.loads_landed.items() if r in recving and r not in self._undated
        }
        self._undated.difference_update(recving)
        return KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=cpu.invalid_block_ids | pd.invalid_block_ids,
            loads_landed=landed,
        )

    @staticmethod
    def _join(pending: dict[str, set[str]], done: Iterable[tuple[str, frozenset[str]]]) -> set[str]:
        """The requests every pending part of which has now reported."""
        out: set[str] = set()
        for part, rids in done:
            for rid in rids:
                parts = pending.get(rid)
                if parts is None:
                    out.add(rid)
                    continue
                parts.discard(part)
                if not parts:
                    del pending[rid]
                    out.add(rid)
        return out

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._recving.pop(rid, None)
        self._undated.discard(rid)
        cpu_delay, cpu_params = self.offload.scheduler.request_finished(request, block_ids)
        pd_delay, pd_params = self.pd.request_finished(request, block_ids)
        parts = {p for p, d in ((CPU, cpu_delay), (PD, pd_delay)) if d}
        if parts:
            self._sending[rid] = parts
        return bool(parts), pd_params or cpu_params

    def reset_cache(self) -> bool:
        return self.offload.scheduler.reset_cache()

    def has_pending_push_work(self) -> bool:
        return self.offload.scheduler.has_pending_push_work() or self.pd.has_pending_push_work()

    # ---- worker role ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.offload.worker.register_kv_caches(kv_caches)
        self.pd.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, meta: object) -> None:
        self.offload.worker.bind_connector_metadata(meta)

    def handle_preemptions(self, meta: object) -> None:
        self.offload.worker.handle_preemptions(meta)

    def start_load_kv(self, *, layerwise: bool = False) -> None:
        self.offload.worker.start_load_kv(layerwise=layerwise)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.offload.worker.wait_for_layer_load(layer_name)

    def wait_for_save(self) -> None:
        self.offload.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.offload.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.offload.worker.get_block_ids_with_load_errors()

    def wait_for_progress(self, timeout: float) -> None:
        self.pd.driver.poll()
        self.offload.worker.wait_for_progress(timeout)

    def build_worker_report(self) -> StepReport | None:
        return self.offload.worker.build_worker_report()

    def clear_connector_metadata(self) -> None:
        self.offload.worker.clear_connector_metadata()

    def shutdown(self) -> None:
        try:
            self.offload.worker.shutdown()
        finally:
            self.pd.shutdown()


__all__ = ["PDOffloadConnector"]
