"""vLLM's configuration as kvflow's connector takes it: options and the KV cache groups.

``offload_config`` maps ``kv_connector_extra_config`` onto ``kvflow.connector.OffloadConfig``,
which parses and validates every option (vLLM's ``cpu_bytes_to_use`` / ``_per_rank`` become its
``cpu_bytes``). ``kv_cache_geometry`` reads vLLM's ``KVCacheConfig``: which groups kvflow offloads
(vLLM's prefix-cacheable ones: a ring or scratch group that vLLM does not prefix-cache is never
stored or loaded, as vLLM's own CPU offload connector does), each group's block size in tokens as
vLLM's scheduler counts it (``block_size × dcp`` for a DCP-sharded group), and its bytes per block.
A group kind kvflow cannot offload (Mamba state, chunked local attention, ...) is refused here,
at start-up, by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from attrs import fields, frozen
from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from kvflow.connector.api import KVCacheConfig, KVCacheGroupSpec
from kvflow.connector.config import OffloadConfig, PDConfig, WorkerLoop, parse_size
from kvflow.core.validate import timeout_s
from kvflow.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig as VLLMKVCacheConfig

DEFAULT_CPU_BYTES = 4 << 30
"""``cpu_bytes_to_use`` when the extra config names none: the whole server's CPU tier."""

VLLM_SIZE_KEYS = ("cpu_bytes_to_use", "cpu_bytes_to_use_per_rank")
"""vLLM's offload connectors' names for the CPU tier's size (kvflow's ``cpu_bytes``)."""

STATS_INTERVAL_KEY = "stats_interval_s"
"""The adapter's own option: seconds between the scheduler role's stats while requests run or
transfers are in flight (``stats_interval``)."""

STATS_INTERVAL_S = 1.0
"""``stats_interval_s`` when the extra config names none: vLLM logs its stats every 10 s and a
Prometheus scrape is rarer still, so a second's lag costs a reader nothing, while a payload built
at every store-each-step step is a measurable share of the connector's per-step cost."""

VLLM_DEFAULTS: Mapping[str, object] = {"worker_loop": WorkerLoop.THREAD.value, "load_parts": 1}
"""Defaults that differ in vLLM: its workers make their own threads and process layout, and the
scheduler's calls live in another process, so the runtime's loop gets a thread of its own; a
fenced load lands whole (``ENGINE_ONLY_KEYS``)."""

OFFLOADED_SPECS = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, SlidingWindowMLASpec)
"""The KV cache spec types kvflow offloads (exact types: a subclass may change what a block
holds)."""


ENGINE_ONLY_KEYS = frozenset({"load_parts"})
"""``OffloadConfig`` fields for kvflow's own engine: vLLM's adapter waits for whole loads (its
full CUDA graphs capture the attention, so ``wait_for_layer_load`` is not called at replay)."""


def _passthrough_keys() -> frozenset[str]:
    plain = frozenset(f.name for f in fields(OffloadConfig)) - {"cpu_bytes", "world_size", "pd"}
    return (plain - ENGINE_ONLY_KEYS) | frozenset(PDConfig.keys())


def valid_keys() -> list[str]:
    """Every key ``kv_connector_extra_config`` may hold."""
    return sorted(_passthrough_keys() | set(VLLM_SIZE_KEYS) | {STATS_INTERVAL_KEY})


def stats_interval(extra: Mapping[str, Any] | None) -> float:
    """``stats_interval_s`` of ``kv_connector_extra_config``: a finite number of seconds, 0 or
    more (0: a payload at every step that changed something); ``ConfigError`` naming the value."""
    value = (extra or {}).get(STATS_INTERVAL_KEY, STATS_INTERVAL_S)
    return timeout_s(f"kv_connector_extra_config[{STATS_INTERVAL_KEY!r}]", value)


def _size_option(extra: Mapping[str, Any], key: str) -> int:
    try:
        size = parse_size(extra[key])
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config[{key!r}]: {exc}") from None
    if size <= 0:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be positive, got {size}")
    return size


def offload_config(extra: Mapping[str, Any] | None, world_size: int) -> OffloadConfig:
    """kvflow's ``OffloadConfig`` for one rank of a vLLM server of ``world_size`` ranks.

    ``cpu_bytes_to_use`` is the whole server's tier, split evenly over the ranks, unless
    ``cpu_bytes_to_use_per_rank`` sets each rank's. Every other key is an ``OffloadConfig``
    field, parsed and validated there; an unknown key raises ``ConfigError`` naming it.
    """
    extra = dict(extra or {})
    engine_only = sorted(ENGINE_ONLY_KEYS & set(extra))
    if engine_only:
        raise ConfigError(
            f"kv_connector_extra_config{engine_only}: an option of kvflow's own engine; under "
            "vLLM a fenced load lands whole (vLLM's full CUDA graphs capture the attention)"
        )
    extra.pop(STATS_INTERVAL_KEY, None)  # the adapter's (``stats_interval``), not kvflow's
    unknown = sorted(set(extra) - _passthrough_keys() - set(VLLM_SIZE_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown kvflow option(s) {unknown} in kv_connector_extra_config; "
            f"valid: {valid_keys()}"
        )
    if "cpu_bytes_to_use_per_rank" in extra:
        cpu_bytes = _size_option(extra, "cpu_bytes_to_use_per_rank")
        if "cpu_bytes_to_use" in extra:
            _size_option(extra, "cpu_bytes_to_use")  # still checked: a typo is an error
    else:
        total = _size_option(extra, "cpu_bytes_to_use") if "cpu_bytes_to_use" in extra else None
        cpu_bytes = (DEFAULT_CPU_BYTES if total is None else total) // max(1, world_size)
    options = {**VLLM_DEFAULTS, **{k: v for k, v in extra.items() if k not in VLLM_SIZE_KEYS}}
    # JSON numbers come as floats: integral ones are the ints they spell.
    for key, value in options.items():
        if isinstance(value, float) and value.is_integer():
            options[key] = int(value)
    try:
        return OffloadConfig.from_mapping(
            {**options, "cpu_bytes": max(1, cpu_bytes), "world_size": world_size}
        )
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from None


PD_DEVICES: Mapping[str, tuple[str, ...]] = {
    "gloo": ("cpu",),
    "nixl": ("cpu", "cuda"),
    "cuda-ipc": ("cuda",),
}
"""The worker devices whose KV tensors each PD transport moves in the vLLM connector."""


def check_pd_transport(pd: PDConfig, device_type: str) -> None:
    """``ConfigError`` unless ``pd_transport`` can run on this machine and moves KV tensors of
    ``device_type`` (vLLM's device: ``cpu``, ``cuda``...); names what is missing."""
    from kvflow.backends.pd.registry import transport_status

    name = pd.transport.value
    devices = PD_DEVICES[name]
    if device_type not in devices:  # first: it imports nothing
        raise ConfigError(
            f"kv_connector_extra_config['pd_transport']={name!r} moves KV tensors on "
            f"{' or '.join(devices)}; this worker's KV cache is on {device_type}"
        )
    ok, found = transport_status()[name]
    if not ok:
        raise ConfigError(
            f"kv_connector_extra_config['pd_transport']={name!r} is not available here: {found}"
        )


@frozen
class GroupGeometry:
    """One vLLM KV cache group kvflow offloads, as kvflow sizes it."""

    vllm_group: int  # its index among vLLM's groups
    kind: str  # vLLM's spec type name
    block_size: int  # tokens per block as vLLM's scheduler counts them (× dcp if DCP-sharded)
    block_bytes: int  # bytes of one block over all the group's layers, on one rank
    sliding_window: int | None
    layer_names: tuple[str, ...]


@frozen
class KVGeometry:
    """The groups kvflow offloads, in vLLM's order, and those it leaves alone."""

    groups: tuple[GroupGeometry, ...]
    num_vllm_groups: int
    skipped: tuple[tuple[int, str], ...] = ()  # (vLLM group, spec type) never stored or loaded

    @property
    def offloads_every_group(self) -> bool:
        return not self.skipped

    def select(self, block_ids: Sequence[Sequence[int]]) -> tuple[Sequence[int], ...]:
        """vLLM's per-group block ids → those of the offloaded groups, in kvflow's order."""
        return tuple(block_ids[g.vllm_group] for g in self.groups)

    @property
    def layer_groups(self) -> dict[str, int]:
        """Layer name → kvflow group, for the offloaded groups' layers only."""
        return {name: k for k, g in enumerate(self.groups) for name in g.layer_names}

    def kvflow_cache_config(self, num_blocks: int, device: str = "cpu") -> KVCacheConfig:
        """kvflow's connector ``KVCacheConfig`` of the offloaded groups."""
        return KVCacheConfig(
            block_size=self.groups[0].block_size,
            num_blocks=num_blocks,
            groups=[
                KVCacheGroupSpec(
                    group_id=k,
                    layer_names=g.layer_names,
                    sliding_window=g.sliding_window,
                    block_size=g.block_size,
                )
                for k, g in enumerate(self.groups)
            ],
            device=device,
        )


def kv_cache_geometry(kv_cache_config: VLLMKVCacheConfig, dcp_world_size: int = 1) -> KVGeometry:
    """The groups of vLLM's ``KVCacheConfig`` kvflow offloads; raises ``ConfigError`` naming the
    first group whose kind it cannot offload, or when no group is left to offload."""
    groups: list[GroupGeometry] = []
    skipped: list[tuple[int, str]] = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if not getattr(group, "enable_kv_transfer", True) or not spec.prefix_cacheable:
            skipped.append((g, kind))
            continue
        if type(spec) not in OFFLOADED_SPECS:
            raise ConfigError(
                f"KV cache group {g} ({kind}, layers {list(group.layer_names)[:3]}...) cannot be "
                f"offloaded: kvflow offloads {', '.join(t.__name__ for t in OFFLOADED_SPECS)} "
                "groups only (Mamba state and other kinds are refused)"
            )
        groups.append(
            GroupGeometry(
                vllm_group=g,
                kind=kind,
                block_size=int(resolve_dcp_kv_block_size(spec, dcp_world_size)),
                block_bytes=int(spec.page_size_bytes) * len(group.layer_names),
                sliding_window=getattr(spec, "sliding_window", None),
                layer_names=tuple(group.layer_names),
            )
        )
    if not groups:
        raise ConfigError(
            f"no KV cache group kvflow can offload: {[k for _, k in skipped]} are not "
            "prefix-cached by vLLM"
        )
    return KVGeometry(tuple(groups), len(kv_cache_config.kv_cache_groups), tuple(skipped))


__all__ = [
    "DEFAULT_CPU_BYTES",
    "OFFLOADED_SPECS",
    "PD_DEVICES",
    "STATS_INTERVAL_KEY",
    "STATS_INTERVAL_S",
    "VLLM_DEFAULTS",
    "VLLM_SIZE_KEYS",
    "GroupGeometry",
    "KVGeometry",
    "check_pd_transport",
    "kv_cache_geometry",
    "offload_config",
    "stats_interval",
    "valid_keys",
]
