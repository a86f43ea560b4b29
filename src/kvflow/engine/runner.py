"""The model runner: the worker side of a step. Owns the KV tensors and calls the worker connector.

Per step, in vLLM's order: ``bind_connector_metadata`` → ``handle_preemptions`` → ``start_load_kv``
→ forward (skipped when nothing is scheduled; the connector calls still run, so async transfers
keep being reported) → ``wait_for_save`` → ``get_finished(finished_req_ids)`` →
``get_block_ids_with_load_errors`` → ``build_worker_report`` → ``clear_connector_metadata``, all
while the forward runs on the device; only then does the host wait for the step's tokens
(``LaunchedStep.tokens``). Sampling is greedy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from attrs import define, frozen

from kvflow.connector.api import KVCacheConfig, KVConnectorOutput, WorkerConnector
from kvflow.core.requests import SchedulerOutput
from kvflow.engine import triton_decode
from kvflow.engine.decode_graphs import DecodeGraphs, layer_groups
from kvflow.engine.kv_cache import (
    AttentionMetadata,
    allocate_kv_caches,
    build_attention_metadata,
    layer_name,
    long_tensor,
    poison_blocks,
)
from kvflow.engine.model import LlamaForCausalLM
from kvflow.engine.scheduler import PENDING_TOKEN, ScheduledChunk, StepBatch
from kvflow.errors import ConfigError, KVFlowError


@frozen
class _Sampled:
    """A step's greedy tokens, still on the device until ``tokens()`` waits for them; on a GPU,
    ``host`` is the pinned buffer their copy lands in and ``ready`` the event after it."""

    request_ids: list[str]
    argmax: torch.Tensor | None
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    # Rows of ``request_ids`` whose token is their request's first, with their logits, when the
    # runner records them (``record_first_logits``).
    first_logits: dict[str, torch.Tensor] | None = None

    def tokens(self) -> dict[str, int]:
        if self.argmax is None:
            return {}
        if self.ready is not None and self.host is not None:
            self.ready.synchronize()
            toks = self.host.tolist()
        else:
            toks = self.argmax.tolist()
        return {rid: int(t) for rid, t in zip(self.request_ids, toks, strict=True)}


@frozen
class _TokenPatch:
    """Tokens of a step scheduled ahead that an earlier launched step samples: flat tokens
    ``dst`` of this step take rows ``src`` of ``source``, that step's tokens on the device."""

    source: torch.Tensor
    dst: list[int]
    src: list[int]

    @classmethod
    def of(cls, chunks: Sequence[ScheduledChunk], after: _Sampled | None) -> _TokenPatch | None:
        """The patch of ``chunks`` (flat in order) over ``after``; None when no token pends."""
        dst: list[int] = []
        pending: list[str] = []
        at = 0
        for c in chunks:
            at += len(c.token_ids)
            if c.token_ids[-1] == PENDING_TOKEN:
                dst.append(at - 1)
                pending.append(c.request_id)
        if not dst:
            return None
        if after is None or after.argmax is None:
            raise KVFlowError("a step scheduled ahead has no launched step to take tokens from")
        row = {rid: i for i, rid in enumerate(after.request_ids)}
        missing = [rid for rid in pending if rid not in row]
        if missing:
            raise KVFlowError(f"requests {missing[:3]} pend on tokens the launched step lacks")
        return cls(after.argmax, dst, [row[rid] for rid in pending])

    def apply(self, ids: torch.Tensor) -> None:
        """Write the tokens into ``ids`` (this step's flat token ids, on the device), in stream
        order after the copy of its host inputs and before the forward reads them."""
        d0, s0, k = self.dst[0], self.src[0], len(self.dst)
        if self.dst == list(range(d0, d0 + k)) and self.src == list(range(s0, s0 + k)):
            ids[d0 : d0 + k].copy_(self.source[s0 : s0 + k])  # steady decode: rows line up
            return
        device = ids.device
        ids.index_copy_(
            0,
            long_tensor(self.dst, device),
            self.source.index_select(0, long_tensor(self.src, device)),
        )


@frozen
class ModelRunnerOutput:
    sampled: dict[str, int]
    kv_connector_output: KVConnectorOutput


@define(eq=False)
class LaunchedStep:
    """A step whose forward is enqueued and whose connector calls are done: the host is free
    until ``tokens()``, which waits for the device. The engine does its side of the
    connector's bookkeeping in that window rather than between steps, where the device idles."""

    kv_connector_output: KVConnectorOutput
    _sampled: _Sampled | None = None
    _tokens: dict[str, int] | None = None
    loads_launched_at: float | None = None  # right before ``start_load_kv``, on ``ModelRunner.now``

    @property
    def first_logits(self) -> dict[str, torch.Tensor]:
        """float32 logits on the host of the step's first tokens (empty unless recorded)."""
        found = None if self._sampled is None else self._sampled.first_logits
        return {} if found is None else {rid: t.cpu() for rid, t in found.items()}

    @property
    def sampled(self) -> _Sampled | None:
        """The step's tokens on the device (a step scheduled ahead takes its pending ones
        there)."""
        return self._sampled

    @classmethod
    def finished(cls, output: ModelRunnerOutput) -> LaunchedStep:
        """A step that already has its tokens (a runner that cannot split a step)."""
        return cls(output.kv_connector_output, tokens=output.sampled)

    def tokens(self) -> dict[str, int]:
        if self._tokens is None:
            self._tokens = {} if self._sampled is None else self._sampled.tokens()
        return self._tokens


class ModelRunner:
    """Runs steps of one model over its paged KV cache on one device."""

    can_run_ahead = True
    """Whether ``launch`` takes ``after``: steps scheduled ahead of a launched one."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_config: KVCacheConfig,
        connector: WorkerConnector,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_config = kv_config
        self.connector = connector
        self.device = device
        cfg = model.config
        dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_caches(
            kv_config, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device
        )
        self._layer_names = [layer_name(i) for i in range(cfg.num_layers)]
        self._layers = [self.kv_caches[name] for name in self._layer_names]
        self._layer_group = layer_groups(kv_config, cfg.num_layers)
        self._graphs: DecodeGraphs | None = None
        self._paged_decode = False
        self._half = dtype in (torch.float16, torch.bfloat16)
        # Off by default: an engine's consumer that checks outputs beyond greedy tokens
        # (``kvflow bench``'s half-precision check) turns it on; a decode-shaped step sampling a
        # first token then runs eagerly (mixed buckets return their logits).
        self.record_first_logits = False
        # A step's prefill chunks as one flash call per layer (``kv_cache.VarlenPrefill``): in
        # half precision on a GPU, where the flash kernel runs them (the host runs the same
        # batch chunk by chunk, which tests use).
        self.varlen_prefill = self._half and device.type == "cuda"
        # The engine's clock, set by the engine: when this step's loads were launched.
        self.now: Callable[[], float] | None = None
        # Two, used in turn: a step launched ahead copies its tokens back while the host has
        # yet to read the tokens of the step before it.
        self._readback_bufs: list[torch.Tensor | None] = [None, None]
        self._readback_events: list[torch.cuda.Event | None] = [None, None]
        self._readback_turn = 0
        connector.register_kv_caches(dict(self.kv_caches))

    def poison(self, block_ids: Sequence[int]) -> None:
        """Poison-on-free: overwrite ``block_ids`` in this runner's KV cache (the engine calls it
        with every block a free leaves unreferenced)."""
        poison_blocks(self.kv_caches, block_ids)

    def configure_decode(
        self, graphs: str, max_rows: int, triton: bool, max_tokens: int = 0
    ) -> None:
        """How decode rows run: ``triton`` uses ``kvflow.engine.triton_decode`` where it is
        available; ``graphs`` runs decode-only steps of up to ``max_rows`` rows from
        ``DecodeGraphs``: ``"full"`` captures each step whole, attention included (needs the
        Triton kernel), ``"piecewise"`` captures the pieces between the attention, which runs
        eagerly; ``"auto"`` is ``"full"`` where Triton serves the attention, else
        ``"piecewise"``, on a CUDA device for an unsharded model (a tensor-parallel shard's
        reductions are not captured) and nothing otherwise; ``"pieces"`` runs the piecewise
        pieces uncaptured on any device, ``"off"`` none of it. Every mode but ``"off"`` also
        runs steps of up to ``max_tokens`` tokens of any shape (prefill chunks beside decode
        rows) from piecewise mixed buckets (``DecodeGraphs.run_mixed``).
        """
        self._paged_decode = triton and triton_decode.available(
            self.device, self.model.config.head_dim
        )
        captures = self.device.type == "cuda" and not self.model.sharded
        if graphs == "off" or (graphs == "auto" and not captures):
            return
        full = graphs == "full" or (graphs == "auto" and self._paged_decode)
        if graphs in ("full", "piecewise") and not captures:
            raise ConfigError(
                f"decode_graphs {graphs!r} captures CUDA graphs: needs an unsharded model on a "
                f"CUDA device, not {self.device} (sharded: {self.model.sharded})"
            )
        if full and not self._paged_decode:
            raise ConfigError(
                "decode_graphs 'full' captures the Triton decode attention: it needs Triton, "
                "triton_decode=True and a power-of-two head_dim >= 16"
            )
        self._graphs = DecodeGraphs(
            self.model,
            self.kv_config,
            self._layers,
            self._layer_group,
            max_rows,
            capture=graphs != "pieces",
            paged_decode=self._paged_decode,
            flash_if_equal=self._half,
            full=full,
            max_mixed_tokens=max_tokens,
        )

    def execute(
        self, out: SchedulerOutput, batch: StepBatch, connector_meta: object
    ) -> ModelRunnerOutput:
        """One whole step: ``launch`` it, then wait for its tokens."""
        step = self.launch(out, batch, connector_meta)
        return ModelRunnerOutput(
            sampled=step.tokens(), kv_connector_output=step.kv_connector_output
        )

    def launch(
        self,
        out: SchedulerOutput,
        batch: StepBatch,
        connector_meta: object,
        after: LaunchedStep | None = None,
    ) -> LaunchedStep:
        """Enqueue the step's forward and make its connector calls; its tokens are not read.
        ``after``: the launched step this one was scheduled ahead of, whose tokens on the
        device fill this step's pending ones (``PENDING_TOKEN``)."""
        conn = self.connector
        conn.bind_connector_metadata(connector_meta)
        conn.handle_preemptions(connector_meta)
        patch = (
            _TokenPatch.of(batch.chunks, None if after is None else after.sampled)
            if batch.chunks
            else None
        )
        # The forward's inputs go to the device first; the kernels are then enqueued while a
        # fenced load's copies run.
        forward, layerwise = self._prepare(batch, patch) if batch.chunks else (None, False)
        # Read before the launch: a copy thread may land a small load before the call returns,
        # and a load's "landed" must not come before its "launched".
        loads_at = None if self.now is None else self.now()
        conn.start_load_kv(layerwise=layerwise)
        pending = self._start_readback(forward()) if forward is not None else None
        # As vLLM does: stores are handed over once the forward is enqueued, before the host
        # waits for its tokens, so their submission overlaps the device's compute. The tokens'
        # copy is enqueued first: a store's DMA fenced after it cannot hold it up (a small copy
        # queued behind a store waits for the whole store on the copy engine, milliseconds per
        # prefill step; scripts/bench_copy_contention.py measures it).
        conn.wait_for_save()
        # As in vLLM's runner, what finished is asked before the host waits for the tokens:
        # the connector's calls, and the scheduler's handling of their output, then overlap the
        # device's compute instead of adding to the host's time between steps.
        sending, recving = conn.get_finished(set(out.finished_request_ids))
        invalid = conn.get_block_ids_with_load_errors()
        report = conn.build_worker_report()
        conn.clear_connector_metadata()
        return LaunchedStep(
            KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=invalid,
                reports=() if report is None else (report,),
            ),
            sampled=pending,
            loads_launched_at=loads_at,
        )

    def _start_readback(self, sampled: _Sampled) -> _Sampled:
        """On a GPU: enqueue the tokens' copy to pinned memory now, on the compute stream."""
        argmax = sampled.argmax
        if argmax is None or argmax.device.type != "cuda":
            return sampled
        n = argmax.numel()
        turn = self._readback_turn
        self._readback_turn = 1 - turn
        buf = self._readback_bufs[turn]
        if buf is None or buf.numel() < n or buf.dtype != argmax.dtype:
            buf = torch.empty(max(n, 256), dtype=argmax.dtype, pin_memory=True)
            self._readback_bufs[turn] = buf
        event = self._readback_events[turn]
        if event is None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._readback_events[turn] = event
        host = buf[:n]
        host.copy_(argmax.reshape(-1), non_blocking=True)
        event.record()
        return _Sampled(sampled.request_ids, argmax, host, event, sampled.first_logits)

    def _prepare(
        self, batch: StepBatch, patch: _TokenPatch | None = None
    ) -> tuple[Callable[[], _Sampled], bool]:
        """The step's forward, its inputs already on the device: call it to enqueue its
        kernels (after ``start_load_kv``); and whether it calls the connector's
        ``wait_for_layer_load`` before each layer writes or reads its KV cache (not from the
        full decode graphs, whose attention is captured with the rest)."""
        chunks = batch.chunks
        graphs = self._graphs
        recording = self.record_first_logits and any(c.first_token for c in chunks)
        if (
            graphs is not None
            and len(chunks) <= graphs.max_rows
            and all(len(c.token_ids) == 1 for c in chunks)
            and graphs.tables_fit(c.block_ids for c in chunks)
        ):
            # Its inputs go through pinned buffers, copied without a host wait.
            step = functools.partial(self._decode_from_graphs, graphs, chunks, recording, patch)
            return step, False
        device = self.device
        ids: list[int] = []
        positions: list[int] = []
        for c in chunks:  # list extends run in C: a prefill chunk has thousands of tokens
            ids += c.token_ids
            start = c.num_computed_tokens
            positions += range(start, start + len(c.token_ids))
        num_computed = [c.num_computed_tokens for c in chunks]
        num_scheduled = [len(c.token_ids) for c in chunks]
        group_meta: list[AttentionMetadata] = [
            build_attention_metadata(
                [c.block_ids[g.group_id] for c in chunks],
                num_computed,
                num_scheduled,
                self.kv_config.block_size,
                g.sliding_window,
                device,
                paged_decode=self._paged_decode,
                flash_if_equal=self._half,
                varlen=self.varlen_prefill,
            )
            for g in self.kv_config.groups
        ]
        ends: list[int] = []
        acc = 0
        for n in num_scheduled:
            acc += n
            ends.append(acc - 1)
        sample_rows = [i for i, c in enumerate(chunks) if c.sample]
        ids_of_rows = [chunks[i].request_id for i in sample_rows]
        size = None if graphs is None else graphs.mixed_bucket_for(len(ids), len(sample_rows))
        if graphs is not None and size is not None:
            bucket = size

            def mixed() -> _Sampled:
                assert graphs is not None
                tokens, logits = graphs.run_mixed(
                    bucket,
                    ids,
                    positions,
                    [m.slot_mapping for m in group_meta],
                    [ends[i] for i in sample_rows],
                    group_meta,
                    self._wait_for_layer,
                    patch=None if patch is None else patch.apply,
                )
                return _Sampled(
                    ids_of_rows,
                    tokens if sample_rows else None,
                    first_logits=self._first_rows(chunks, sample_rows, logits)
                    if recording
                    else None,
                )

            return mixed, True
        logits_at = long_tensor([ends[i] for i in sample_rows] or [ends[0]], device)
        ids_on = long_tensor(ids, device)
        if patch is not None:
            patch.apply(ids_on)
        positions_on = long_tensor(positions, device)

        def eager() -> _Sampled:
            logits = self.model(
                ids_on,
                positions_on,
                self._layers,
                [group_meta[g] for g in self._layer_group],
                logits_at,
                self._wait_for_layer,
            )
            return _Sampled(
                ids_of_rows,
                logits.argmax(dim=-1) if sample_rows else None,
                first_logits=self._first_rows(chunks, sample_rows, logits) if recording else None,
            )

        return eager, True

    def _wait_for_layer(self, i: int) -> None:
        """Before layer ``i`` writes or reads its KV cache: its loaded blocks are there for
        what follows (as they are for the whole forward when it waits for the whole load)."""
        self.connector.wait_for_layer_load(self._layer_names[i])

    @staticmethod
    def _first_rows(
        chunks: tuple[ScheduledChunk, ...], sample_rows: list[int], logits: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The logits rows of chunks that sample their request's first token, copied on the
        device: a mixed bucket's logits are rewritten by its next replay, which a step
        scheduled ahead enqueues before this step's output is read."""
        return {
            chunks[i].request_id: logits[row].clone()
            for row, i in enumerate(sample_rows)
            if chunks[i].first_token
        }

    def _decode_from_graphs(
        self,
        graphs: DecodeGraphs,
        chunks: tuple[ScheduledChunk, ...],
        recording: bool,
        patch: _TokenPatch | None,
    ) -> _Sampled:
        """One decode step replayed from the graphs; ``recording``: keep the logits of rows
        that sample a first token (a request whose prompt's last token runs as a decode row:
        after a load or a hand-off that brought all of its prompt but that token)."""
        tokens, logits = graphs.run(
            [c.token_ids[0] for c in chunks],
            [c.num_computed_tokens for c in chunks],
            [[c.block_ids[g.group_id] for c in chunks] for g in self.kv_config.groups],
            patch=None if patch is None else patch.apply,
        )
        sample_rows = [i for i, c in enumerate(chunks) if c.sample]
        ids_of_rows = [chunks[i].request_id for i in sample_rows]
        # Row b of the graphs' logits is chunk b's; _first_rows reads them by sample order.
        firsts = self._first_rows(chunks, sample_rows, logits[sample_rows]) if recording else None
        if len(sample_rows) == len(chunks):
            return _Sampled(ids_of_rows, tokens, first_logits=firsts)
        if not sample_rows:
            return _Sampled([], None)
        rows = long_tensor(sample_rows, self.device)
        return _Sampled(ids_of_rows, tokens[rows], first_logits=firsts)


__all__ = ["ModelRunner", "ModelRunnerOutput"]
