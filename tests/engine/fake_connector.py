"""A small in-process KV connector for the engine's tests: a dict of blocks by hash as the "CPU".

It plays both roles and handles every KV cache group, sliding-window ones included. Finished
requests' full blocks are saved per group (null blocks skipped; delayed free until the save is
reported), later requests' prefixes are loaded synchronously or asynchronously (reported
``load_delay_steps`` steps later), and chosen loads can fail: one block is filled with garbage and
reported invalid, so the engine must recompute from there.
"""

from __future__ import annotations

from typing import Any

import torch
from attrs import define, field, frozen

from kvflow.connector.api import NULL_BLOCK_ID, KVCacheConfig, KVConnectorOutput
from kvflow.core.hashing import BlockHash, hash_blocks
from kvflow.core.protocol import GroupBlockIds, StepReport
from kvflow.core.requests import RequestLike, SchedulerOutput


@frozen
class Job:
    request_id: str
    copies: tuple[tuple[int, int, BlockHash], ...]  # (group, GPU block id, block hash)
    eager: bool = False  # a store during the request's life: no finished_sending for it


@frozen
class FakeMeta:
    loads: tuple[Job, ...]
    saves: tuple[Job, ...]
    preempted: frozenset[str]


@define
class FakeConnector:
    kv_config: KVCacheConfig
    load_async: bool = False
    load_delay_steps: int = 2
    fail_loads: int = 0  # how many load jobs (the first ones) lose one block
    fail_index: int = 0  # which copy of such a job (by position in the job)
    delay_free: bool = True
    store_eagerly: bool = False  # store blocks the step they are computed (needed for hybrids)
    store: dict[tuple[int, BlockHash], dict[str, torch.Tensor]] = field(factory=dict)
    calls: list[str] = field(factory=list)
    layerwise: list[bool] = field(factory=list)  # ``start_load_kv``'s flag, per step
    layer_waits: list[str] = field(factory=list)  # ``wait_for_layer_load``'s layers, in order
    preemptions_seen: list[frozenset[str]] = field(factory=list)
    outputs_seen: list[KVConnectorOutput] = field(factory=list)
    scheduler_outputs: list[SchedulerOutput] = field(factory=list)
    requests_seen: list[RequestLike] = field(factory=list)
    waited_after: list[int] = field(factory=list)  # len(outputs_seen) at each wait_for_progress
    _matched: dict[str, int] = field(factory=dict)  # request → first block to load
    _requests: dict[str, RequestLike] = field(factory=dict)
    _tables: dict[str, list[list[int]]] = field(factory=dict)  # as the scheduler outputs told
    _new_loads: list[Job] = field(factory=list)
    _new_saves: list[Job] = field(factory=list)
    _kv: dict[str, torch.Tensor] = field(factory=dict)
    _meta: FakeMeta | None = None
    _loading: dict[str, int] = field(factory=dict)  # request → steps until reported
    _saved: set[str] = field(factory=set)
    _errors: set[int] = field(factory=set)
    _failed_requests: set[str] = field(factory=set)  # a load failed this step
    _failed_so_far: int = 0

    def _hashes(self, request: RequestLike) -> list[BlockHash]:
        return hash_blocks(
            request.all_token_ids, self.kv_config.block_size, extra_keys=request.extra_keys
        )

    def _first_needed(self, group: int, num_tokens: int) -> int:
        """First block a query at position ``num_tokens`` can see in ``group``."""
        window = self.kv_config.groups[group].sliding_window
        if window is None:
            return 0
        return max(0, num_tokens - window + 1) // self.kv_config.block_size

    def _hit(self, hashes: list[BlockHash], first: int, n: int) -> bool:
        """Can blocks [first, first + n) be loaded so that position (first + n) * bs can run?"""
        bs = self.kv_config.block_size
        for g in range(len(self.kv_config.groups)):
            start = max(first, self._first_needed(g, (first + n) * bs))
            if any((g, hashes[j]) not in self.store for j in range(start, first + n)):
                return False
        return True

    # ---- scheduler role ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.calls.append("get_num_new_matched_tokens")
        self.requests_seen.append(request)
        bs = self.kv_config.block_size
        first = num_computed_tokens // bs
        hashes = self._hashes(request)
        # Like vLLM's connectors, leave the last token to be computed.
        limit = max(0, (len(request.all_token_ids) - 1) // bs - first)
        n = next((k for k in range(limit, 0, -1) if self._hit(hashes, first, k)), 0)
        self._matched[request.request_id] = first
        return n * bs, self.load_async and n > 0

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        self.calls.append("update_state_after_alloc")
        self._requests[request.request_id] = request
        first = self._matched.pop(request.request_id, 0)
        if num_external_tokens == 0:
            return
        n = num_external_tokens // self.kv_config.block_size
        hashes = self._hashes(request)
        copies = tuple(
            (g, table[j], hashes[j])
            for g, table in enumerate(block_ids)
            for j in range(first, first + n)
            if table[j] != NULL_BLOCK_ID
        )
        self._new_loads.append(Job(request.request_id, copies))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        self.calls.append("build_connector_meta")
        self.scheduler_outputs.append(scheduler_output)
        for new in scheduler_output.new_requests:
            self._tables[new.request_id] = [list(t) for t in new.block_ids]
            self._store_computed(new.request_id, new.num_computed_tokens, new.num_scheduled_tokens)
        for cached in scheduler_output.cached_requests:
            if cached.resumed_from_preemption:
                self._tables[cached.request_id] = [list(t) for t in cached.new_block_ids]
            else:
                for table, added in zip(
                    self._tables[cached.request_id], cached.new_block_ids, strict=True
                ):
                    table.extend(added)
            self._store_computed(
                cached.request_id, cached.num_computed_tokens, cached.num_scheduled_tokens
            )
        meta = FakeMeta(
            tuple(self._new_loads), tuple(self._new_saves), scheduler_output.preempted_request_ids
        )
        self._new_loads, self._new_saves = [], []
        return meta

    def _store_computed(self, request_id: str, num_computed: int, num_scheduled: int) -> None:
        """Eager stores: the blocks this step completes, saved right after its forward."""
        if not self.store_eagerly:
            return
        bs = self.kv_config.block_size
        hashes = self._hashes(self._requests[request_id])
        done = range(num_computed // bs, min((num_computed + num_scheduled) // bs, len(hashes)))
        copies = tuple(
            (g, table[j], hashes[j])
            for g, table in enumerate(self._tables[request_id])
            for j in done
            if table[j] != NULL_BLOCK_ID and (g, hashes[j]) not in self.store
        )
        if copies:
            self._new_saves.append(Job(request_id, copies, eager=True))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.calls.append("update_connector_output")
        if not output.is_empty:
            self.outputs_seen.append(output)

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append("request_finished")
        computed = len(request.all_token_ids) - 1  # the last sampled token was never computed
        # An aborted request may not have computed that far (the engine's request says).
        computed = min(computed, getattr(request, "num_computed_tokens", computed))
        full = computed // self.kv_config.block_size
        hashes = self._hashes(request)[:full]
        copies = tuple(
            (g, table[j], h)
            for g, table in enumerate(block_ids)
            for j, h in enumerate(hashes)
            if j < len(table) and table[j] != NULL_BLOCK_ID and (g, h) not in self.store
        )
        if not copies:
            return False, None
        self._new_saves.append(Job(request.request_id, copies))
        return self.delay_free, {"saved_blocks": len(copies)}

    def reset_cache(self) -> bool:
        self.store.clear()
        return True

    def has_pending_push_work(self) -> bool:
        return False

    # ---- worker role ------------------------------------------------------------------------

    def _layers(self, group: int) -> list[str]:
        return list(self.kv_config.groups[group].layer_names)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.calls.append("register_kv_caches")
        self._kv = kv_caches

    def bind_connector_metadata(self, meta: object) -> None:
        self.calls.append("bind_connector_metadata")
        assert isinstance(meta, FakeMeta)
        self._meta = meta

    def handle_preemptions(self, meta: object) -> None:
        self.calls.append("handle_preemptions")
        assert isinstance(meta, FakeMeta)
        if meta.preempted:
            self.preemptions_seen.append(meta.preempted)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.layer_waits.append(layer_name)

    def start_load_kv(self, *, layerwise: bool = False) -> None:
        self.calls.append("start_load_kv")
        self.layerwise.append(layerwise)
        assert self._meta is not None
        for job in self._meta.loads:
            fail = self._failed_so_far < self.fail_loads and job.copies
            if fail:
                self._failed_so_far += 1
                self._failed_requests.add(job.request_id)
            for i, (g, bid, h) in enumerate(job.copies):
                broken = fail and i == min(self.fail_index, len(job.copies) - 1)
                for name in self._layers(g):
                    cache = self._kv[name]
                    if broken:
                        cache[:, bid] = torch.randn_like(cache[:, bid]) * 100
                    else:
                        cache[:, bid] = self.store[(g, h)][name]
                if broken:
                    self._errors.add(bid)
            if self.load_async:
                self._loading[job.request_id] = self.load_delay_steps

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")
        assert self._meta is not None
        failed, self._failed_requests = self._failed_requests, set()
        for job in self._meta.saves:
            if job.eager and job.request_id in failed:
                continue  # computed on top of a failed load: garbage, never stored
            for g, bid, h in job.copies:
                self.store[(g, h)] = {n: self._kv[n][:, bid].clone() for n in self._layers(g)}
            if not job.eager:
                self._saved.add(job.request_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.calls.append("get_finished")
        sending = set(self._saved) if self.delay_free else set()
        self._saved.clear()
        recving: set[str] = set()
        for rid in list(self._loading):
            self._loading[rid] -= 1
            if self._loading[rid] <= 0:
                del self._loading[rid]
                recving.add(rid)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append("get_block_ids_with_load_errors")
        errors, self._errors = self._errors, set()
        return errors

    def build_worker_report(self) -> StepReport | None:
        self.calls.append("build_worker_report")
        return None

    def wait_for_progress(self, timeout: float) -> None:
        self.waited_after.append(len(self.outputs_seen))

    def clear_connector_metadata(self) -> None:
        self.calls.append("clear_connector_metadata")
        self._meta = None

    def shutdown(self) -> None:
        self.calls.append("shutdown")
