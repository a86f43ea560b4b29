"""A small in-process KV connector for the engine's tests: a dict of blocks by hash as the "CPU".

It plays both roles. Finished requests' full blocks are saved (delayed free until the save is
reported), later requests' prefixes are loaded synchronously or asynchronously (reported
``load_delay_steps`` steps later), and chosen loads can fail: their blocks are filled with garbage
and reported invalid, so the engine must recompute them.
"""

from __future__ import annotations

from typing import Any

import torch
from attrs import define, field, frozen

from kvflow.connector.api import KVCacheConfig, KVConnectorOutput
from kvflow.core.hashing import BlockHash, hash_blocks
from kvflow.core.protocol import GroupBlockIds, StepReport
from kvflow.core.requests import RequestLike, SchedulerOutput


@frozen
class Job:
    request_id: str
    pairs: tuple[tuple[int, BlockHash], ...]  # (GPU block id, block hash)


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
    fail_index: int = 0  # which block of such a job (by position in the job)
    delay_free: bool = True
    store: dict[BlockHash, dict[str, torch.Tensor]] = field(factory=dict)
    calls: list[str] = field(factory=list)
    preemptions_seen: list[frozenset[str]] = field(factory=list)
    outputs_seen: list[KVConnectorOutput] = field(factory=list)
    scheduler_outputs: list[SchedulerOutput] = field(factory=list)
    requests_seen: list[RequestLike] = field(factory=list)
    _matched: dict[str, tuple[int, int]] = field(factory=dict)  # request → (first block, count)
    _new_loads: list[Job] = field(factory=list)
    _new_saves: list[Job] = field(factory=list)
    _kv: dict[str, torch.Tensor] = field(factory=dict)
    _meta: FakeMeta | None = None
    _loading: dict[str, int] = field(factory=dict)  # request → steps until reported
    _saved: set[str] = field(factory=set)
    _errors: set[int] = field(factory=set)
    _failed_so_far: int = 0

    def _hashes(self, request: RequestLike) -> list[BlockHash]:
        return hash_blocks(
            request.all_token_ids, self.kv_config.block_size, extra_keys=request.extra_keys
        )

    # ---- scheduler role ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.calls.append("get_num_new_matched_tokens")
        self.requests_seen.append(request)
        bs = self.kv_config.block_size
        first = num_computed_tokens // bs
        hashes = self._hashes(request)
        n = 0
        while first + n < len(hashes) and hashes[first + n] in self.store:
            n += 1
        self._matched[request.request_id] = (first, n)
        return n * bs, self.load_async and n > 0

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        self.calls.append("update_state_after_alloc")
        if num_external_tokens == 0:
            return
        first, _ = self._matched.pop(request.request_id)
        n = num_external_tokens // self.kv_config.block_size
        hashes = self._hashes(request)
        pairs = tuple((block_ids[0][j], hashes[j]) for j in range(first, first + n))
        self._new_loads.append(Job(request.request_id, pairs))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        self.calls.append("build_connector_meta")
        self.scheduler_outputs.append(scheduler_output)
        meta = FakeMeta(
            tuple(self._new_loads), tuple(self._new_saves), scheduler_output.preempted_request_ids
        )
        self._new_loads, self._new_saves = [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.calls.append("update_connector_output")
        if not output.is_empty:
            self.outputs_seen.append(output)

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append("request_finished")
        computed = len(request.all_token_ids) - 1  # the last sampled token was never computed
        full = computed // self.kv_config.block_size
        hashes = self._hashes(request)[:full]
        pairs = tuple((block_ids[0][j], h) for j, h in enumerate(hashes) if h not in self.store)
        if not pairs:
            return False, None
        self._new_saves.append(Job(request.request_id, pairs))
        return self.delay_free, {"saved_blocks": len(pairs)}

    def reset_cache(self) -> bool:
        self.store.clear()
        return True

    # ---- worker role ------------------------------------------------------------------------

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

    def start_load_kv(self) -> None:
        self.calls.append("start_load_kv")
        assert self._meta is not None
        for job in self._meta.loads:
            fail = self._failed_so_far < self.fail_loads
            if fail:
                self._failed_so_far += 1
            for i, (bid, h) in enumerate(job.pairs):
                for name, cache in self._kv.items():
                    if fail and i == self.fail_index:
                        cache[:, bid] = torch.randn_like(cache[:, bid]) * 100
                    else:
                        cache[:, bid] = self.store[h][name]
                if fail and i == self.fail_index:
                    self._errors.add(bid)
            if self.load_async:
                self._loading[job.request_id] = self.load_delay_steps

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")
        assert self._meta is not None
        for job in self._meta.saves:
            for bid, h in job.pairs:
                self.store[h] = {name: c[:, bid].clone() for name, c in self._kv.items()}
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
        return None

    def clear_connector_metadata(self) -> None:
        self.calls.append("clear_connector_metadata")
        self._meta = None

    def shutdown(self) -> None:
        self.calls.append("shutdown")
