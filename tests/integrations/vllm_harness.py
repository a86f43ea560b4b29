"""Drives vLLM's real v1 ``Scheduler`` on CPU with hand-made model-runner outputs.

The way vLLM's own connector tests do it (``tests/v1/kv_connector/unit/utils.py``): a ``VllmConfig``
for a tiny local Llama ``config.json`` (no weights, no tokenizer, no hub), a ``KVCacheConfig`` with
one attention group, ``Request`` objects with vLLM's block hasher, and a ``ModelRunnerOutput``
made by hand each step that samples one token per scheduled request. Used by the integration tests
and by ``scripts/bench_vllm_scheduler.py``; import it only where vLLM is installed.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from attrs import define, field
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

EOS_TOKEN_ID = 2
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "bos_token_id": 1,
    "eos_token_id": EOS_TOKEN_ID,
    "torch_dtype": "float16",
}
NUM_KV_HEADS = 2
HEAD_SIZE = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
RING_LAYER = "model.layers.1.self_attn.compressor"
KVFLOW_MODULE = "kvflow.integrations.vllm"

_model_dir: Path | None = None
_hash_ready = False
_request_ids = itertools.count(1)


def tiny_model_dir() -> Path:
    """A folder holding only a tiny Llama ``config.json``: enough for ``ModelConfig``."""
    global _model_dir
    if _model_dir is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        _model_dir = Path(tempfile.mkdtemp(prefix="kvflow-tiny-llama-"))
        (_model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    return _model_dir


def make_vllm_config(
    *,
    connector: str | None = None,
    module_path: str | None = None,
    extra_config: Mapping[str, object] | None = None,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 8192,
    kv_load_failure_policy: str = "recompute",
    kv_role: str = "kv_both",
    dcp: int = 1,
    kv_events: bool = False,
) -> VllmConfig:
    """A CPU ``VllmConfig`` with prefix caching on and, if ``connector`` is named, a KV connector.
    ``dcp``: decode context parallel ranks (as many tensor-parallel ranks; each vLLM block then
    spans ``block_size × dcp`` tokens). ``kv_events``: vLLM's KV cache events on (no publisher)."""
    model_config = ModelConfig(
        model=str(tiny_model_dir()),
        skip_tokenizer_init=True,
        dtype="float16",
        seed=42,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=True,
    )
    kv_transfer_config = (
        None
        if connector is None
        else KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module_path,
            kv_role=kv_role,
            kv_connector_extra_config=dict(extra_config or {}),
            kv_load_failure_policy=kv_load_failure_policy,
        )
    )
    config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if kv_events
        else None,
    )
    if dcp > 1:
        # As a server with tensor_parallel_size = decode_context_parallel_size = dcp sets it up
        # (set after construction: the CPU platform refuses tensor parallelism when validating).
        config.parallel_config.decode_context_parallel_size = dcp
        config.parallel_config.tensor_parallel_size = dcp
        config.parallel_config.world_size = dcp
    return config


def page_bytes(block_size: int) -> int:
    """Bytes of one block of one layer: K and V, fp16."""
    return 2 * block_size * NUM_KV_HEADS * HEAD_SIZE * 2


def make_kv_cache_config(
    num_blocks: int,
    block_size: int = 16,
    sliding_window: int | None = None,
    extra_group: str | None = None,
    dcp: int = 1,
) -> KVCacheConfig:
    """One full-attention group over the tiny model's layers, layer-outermost tensors; with
    ``sliding_window``, a hybrid model instead: layer 0 full attention, layer 1 sliding window.
    ``extra_group``: one more group over layer ``RING_LAYER``: ``"ring"`` a ``CircularBufferSpec``
    (one block per request, not prefix-cached by vLLM), ``"mamba"`` a ``MambaSpec``.
    ``dcp``: vLLM hashes blocks of ``block_size × dcp`` tokens (each rank's block holds
    ``block_size`` of them)."""
    page = page_bytes(block_size)
    spec = {"block_size": block_size, "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE}
    groups = (
        [KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(dtype=torch.float16, **spec))]
        if sliding_window is None
        else [
            KVCacheGroupSpec([LAYERS[0]], FullAttentionSpec(dtype=torch.float16, **spec)),
            KVCacheGroupSpec(
                [LAYERS[1]],
                SlidingWindowSpec(dtype=torch.float16, sliding_window=sliding_window, **spec),
            ),
        ]
    )
    layers = list(LAYERS)
    if extra_group == "ring":
        groups.append(
            KVCacheGroupSpec([RING_LAYER], CircularBufferSpec(dtype=torch.float16, **spec))
        )
        layers.append(RING_LAYER)
    elif extra_group == "mamba":
        groups.append(
            KVCacheGroupSpec(
                [RING_LAYER],
                MambaSpec(
                    block_size=block_size,
                    shapes=((NUM_KV_HEADS, HEAD_SIZE * block_size * 2),),
                    dtypes=(torch.float16,),
                ),
            )
        )
        layers.append(RING_LAYER)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks,
                layers=[layer],
                layer_stride=page * num_blocks,
                block_stride=page,
            )
            for layer in layers
        ],
        kv_cache_groups=groups,
    )
    # As vLLM's engine core does before it builds the scheduler (and with it the connector).
    config.hash_block_size = block_size * dcp
    return config


def make_scheduler(
    vllm_config: VllmConfig,
    num_blocks: int,
    sliding_window: int | None = None,
    extra_group: str | None = None,
) -> Scheduler:
    """vLLM's real v1 scheduler (and its connector, if the config names one) on CPU, with the
    scheduler and hash block sizes vLLM's engine core resolves (``block_size × dcp``)."""
    block_size = vllm_config.cache_config.block_size
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=make_kv_cache_config(
            num_blocks, block_size, sliding_window, extra_group, dcp
        ),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size * dcp,
        hash_block_size=block_size * dcp,
        log_stats=True,
    )


def make_request(
    prompt: list[int],
    *,
    max_tokens: int = 8,
    block_size: int = 16,
    request_id: str | None = None,
    prompt_logprobs: int | None = None,
) -> Request:
    """A vLLM ``Request`` with vLLM's own block hasher (over ``block_size``-token blocks), as
    the engine core builds one; ``prompt_logprobs`` makes vLLM read no cached KV for it."""
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id or f"req-{next(_request_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def model_runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    kv_connector_output: KVConnectorOutput | None = None,
    token_id: int = 7,
) -> ModelRunnerOutput:
    """What the model runner would return: one sampled token per request whose prompt is done
    after this step (none for a partial prefill), plus the connector's output."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in req_ids:
        request = scheduler.requests[rid]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([token_id] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_connector_output,
    )


@define
class StepResult:
    """One engine step: what was scheduled and the ids of the requests that finished."""

    output: SchedulerOutput
    finished: set[str] = field(factory=set)


@define
class VLLMHarness:
    """A scheduler plus the loop the engine core would run around it."""

    scheduler: Scheduler
    block_size: int = 16
    steps: int = 0

    @classmethod
    def build(
        cls,
        num_blocks: int = 256,
        sliding_window: int | None = None,
        extra_group: str | None = None,
        **config: Any,
    ) -> VLLMHarness:
        vllm_config = make_vllm_config(**config)
        scheduler = make_scheduler(vllm_config, num_blocks, sliding_window, extra_group)
        dcp = vllm_config.parallel_config.decode_context_parallel_size
        return cls(scheduler, vllm_config.cache_config.block_size * dcp)

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(
        self,
        prompt: list[int],
        *,
        max_tokens: int = 8,
        request_id: str | None = None,
        prompt_logprobs: int | None = None,
    ) -> Request:
        request = make_request(
            prompt,
            max_tokens=max_tokens,
            block_size=self.block_size,
            request_id=request_id,
            prompt_logprobs=prompt_logprobs,
        )
        self.scheduler.add_request(request)
        return request

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def finish(
        self,
        scheduler_output: SchedulerOutput,
        kv_connector_output: KVConnectorOutput | None = None,
    ) -> set[str]:
        """Feed the step's model-runner output back; returns the ids of requests that finished."""
        outputs = self.scheduler.update_from_output(
            scheduler_output,
            model_runner_output(self.scheduler, scheduler_output, kv_connector_output),
        )
        self.steps += 1
        return {
            o.request_id
            for engine_outputs in outputs.values()
            for o in engine_outputs.outputs
            if o.finish_reason is not None
        }

    def step(self, kv_connector_output: KVConnectorOutput | None = None) -> StepResult:
        output = self.schedule()
        return StepResult(output, self.finish(output, kv_connector_output))

    def run_until_done(self, requests: Iterable[Request], max_steps: int = 200) -> int:
        """Step until every request finished; returns the steps taken."""
        pending = {r.request_id for r in requests}
        for n in range(max_steps):
            pending -= self.step().finished
            if not pending:
                return n + 1
        raise AssertionError(f"requests {sorted(pending)} did not finish in {max_steps} steps")

    def block_ids(self, request: Request) -> tuple[list[int], ...]:
        ids: tuple[list[int], ...] = self.scheduler.kv_cache_manager.get_block_ids(
            request.request_id
        )
        return ids

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def is_waiting_for_kv(self, request: Request) -> bool:
        return bool(request.status == RequestStatus.WAITING_FOR_REMOTE_KVS)


__all__ = [
    "EOS_TOKEN_ID",
    "KVFLOW_MODULE",
    "LAYERS",
    "RING_LAYER",
    "StepResult",
    "VLLMHarness",
    "make_kv_cache_config",
    "make_request",
    "make_scheduler",
    "make_vllm_config",
    "model_runner_output",
    "page_bytes",
    "tiny_model_dir",
]
