"""The KV connector interface an engine calls: two roles, named like vLLM's ``KVConnectorBase_V1``.

The scheduler role decides (matches, allocations, per-step metadata, when blocks may be freed); the
worker role moves data next to the model's forward pass. An engine holds one of each, or none:
``NullConnector`` plays both roles and does nothing. ``kvflow.engine`` calls these methods exactly
where vLLM's scheduler and GPU model runner call theirs; its docs list the call points.

Differences from vLLM on purpose: block ids are ``GroupBlockIds`` (a tuple of block-id tuples, one
per KV cache group) everywhere vLLM passes ``KVCacheBlocks`` or ``list[int]``; the per-layer hooks
(``wait_for_layer_load``, ``save_kv_layer``) are not called: ``start_load_kv`` must leave every
synchronous load readable by the forward pass, and ``wait_for_save`` runs right after the forward.
Block id ``NULL_BLOCK_ID`` in a table is padding (e.g. sliding-window blocks outside the window):
it holds no data and must never be stored or loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from attrs import field, frozen

from kvflow.core.protocol import GroupBlockIds, StepReport
from kvflow.core.requests import RequestLike, SchedulerOutput
from kvflow.core.validate import strict_int
from kvflow.errors import ConfigError

if TYPE_CHECKING:
    import torch

NULL_BLOCK_ID = 0
"""Block 0 of every GPU group is reserved padding: never allocated, never transferred."""


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _str_set(values: Iterable[str] | None) -> frozenset[str]:
    return frozenset(values or ())


def _int_set(values: Iterable[int] | None) -> frozenset[int]:
    return frozenset(values or ())


@frozen
class KVCacheGroupSpec:
    """One KV cache group: layers sharing one block table (full attention, or one sliding window)."""

    group_id: int
    layer_names: tuple[str, ...] = field(converter=_str_tuple)
    sliding_window: int | None = None  # in tokens; None means full attention
    block_size: int | None = None  # tokens per block of this group; None: the config's

    def __attrs_post_init__(self) -> None:
        strict_int("KVCacheGroupSpec.group_id", self.group_id)
        if self.sliding_window is not None:
            strict_int("KVCacheGroupSpec.sliding_window", self.sliding_window, minimum=1)
        for name in self.layer_names:
            if not isinstance(name, str):
                raise ConfigError(f"KVCacheGroupSpec.layer_names: {name!r} is not a str")


def _group_tuple(values: Iterable[KVCacheGroupSpec]) -> tuple[KVCacheGroupSpec, ...]:
    return tuple(values)


@frozen
class KVCacheConfig:
    """The engine's GPU KV cache as a connector needs to know it before any tensor exists."""

    block_size: int  # tokens per block of every group that names none
    num_blocks: int  # per group, block NULL_BLOCK_ID included
    groups: tuple[KVCacheGroupSpec, ...] = field(converter=_group_tuple)
    device: str = "cpu"

    def __attrs_post_init__(self) -> None:
        # Strict ints: "16", 2.5, nan or True would fail far from here, or not at all.
        strict_int("KVCacheConfig.block_size", self.block_size, minimum=1)
        strict_int("KVCacheConfig.num_blocks", self.num_blocks)
        if self.num_blocks < 2:
            raise ConfigError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {self.num_blocks}"
            )
        if not isinstance(self.device, str):
            raise ConfigError(f"KVCacheConfig.device must be a str, got {self.device!r}")
        for g in self.groups:
            if not isinstance(g, KVCacheGroupSpec):
                raise ConfigError(f"KVCacheConfig.groups: {g!r} is not a KVCacheGroupSpec")
        if [g.group_id for g in self.groups] != list(range(len(self.groups))):
            raise ConfigError("KV cache groups must be numbered 0..n-1 in order")
        for g in self.groups:
            if g.block_size is not None and (type(g.block_size) is not int or g.block_size <= 0):
                raise ConfigError(
                    f"KV cache group {g.group_id}: block_size must be positive, got {g.block_size}"
                )

    def group_block_size(self, group_id: int) -> int:
        """Tokens per block of one group."""
        size = self.groups[group_id].block_size
        return self.block_size if size is None else size

    @property
    def tensor_groups(self) -> Mapping[str, int]:
        """KV tensor name → group id, as ``kvflow.core.layout.derive_layout`` takes it."""
        return {name: g.group_id for g in self.groups for name in g.layer_names}


def _reports(values: Iterable[StepReport]) -> tuple[StepReport, ...]:
    return tuple(values)


@frozen
class KVConnectorOutput:
    """What the worker role reported after one step (vLLM's ``KVConnectorOutput``)."""

    finished_sending: frozenset[str] = field(default=frozenset(), converter=_str_set)
    finished_recving: frozenset[str] = field(default=frozenset(), converter=_str_set)
    invalid_block_ids: frozenset[int] = field(default=frozenset(), converter=_int_set)
    reports: tuple[StepReport, ...] = field(default=(), converter=_reports)
    """The ranks' own reports of the transfers they finished, for the scheduler role."""
    loads_landed: Mapping[str, float] = field(factory=dict)
    """Of ``finished_recving``: when each request's load landed (its copies ended on the
    device, the latest of the ranks reporting it this step), on the workers' clock, where their
    backend dates its copies (``kvflow.backends.base.DatesCopies``)."""

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_sending or self.finished_recving or self.invalid_block_ids or self.reports
        )


@runtime_checkable
class SchedulerConnector(Protocol):
    """The scheduler role: lives next to the engine's scheduler, never touches a tensor."""

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed_tokens`` (None: ask again later), and whether
        that load is asynchronous (the request then waits until ``finished_recving`` names it).

        Leave at least the last token to compute; the engine cuts a larger answer back to the
        block boundary before the last token. In a sliding-window group only the blocks inside
        the window at the end of the hit are given real blocks (others are ``NULL_BLOCK_ID``):
        answer only with hits whose window blocks can be loaded."""
        ...

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request``: its whole table per group. Load the last
        ``num_external_tokens`` tokens before the computed ones into them (0: nothing to load)."""
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """Everything the workers must do this step; resets the per-step state."""
        ...

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorOutput | None:
        """Take in what the workers reported after a step. A connector that decides itself when
        a transfer is done (kvflow's: once every rank reported) returns the output the engine
        must act on instead; None means "act on ``output`` as it is" (vLLM's behaviour)."""
        ...

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when ``request`` finished, before its blocks are freed. True: the
        connector still reads the blocks; the engine frees them once ``finished_sending`` names
        the request."""
        ...

    def reset_cache(self) -> bool:
        """Forget the connector's cached KV; False if it refused (e.g. transfers in flight)."""
        ...

    def has_pending_push_work(self) -> bool:
        """Transfers are still on their way (vLLM's name): the engine keeps stepping, so an idle
        engine does not leave finished copies unreported and their blocks uncommitted."""
        ...


@runtime_checkable
class WorkerConnector(Protocol):
    """The worker role: owns the data movement next to the model's forward pass."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The engine's KV tensors by layer name, once, before the first step."""
        ...

    def bind_connector_metadata(self, meta: object) -> None: ...

    def handle_preemptions(self, meta: object) -> None:
        """Before the forward: finish or fence anything still reading blocks that preempted
        requests (named in this step's metadata) gave back, before they are overwritten."""
        ...

    def start_load_kv(self, *, layerwise: bool = False) -> None:
        """Before the forward: start this step's loads; synchronous ones must be readable by the
        forward pass when this returns (or be fenced on the compute stream). ``layerwise``: the
        engine calls ``wait_for_layer_load`` before each layer writes or reads its KV cache,
        so a synchronous load may instead be fenced layer by layer there."""
        ...

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer ``layer_name`` writes or reads its KV cache, in a step started with
        ``start_load_kv(layerwise=True)``: the compute issued after this call can read that
        layer's loaded blocks."""
        ...

    def wait_for_save(self) -> None:
        """Right after the forward: this step's stores may start; they are fenced after it."""
        ...

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose async sends (stores after finish) and async loads completed."""
        ...

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU block ids whose loads failed since the last call; the engine recomputes them.

        A request that ran this step on top of a failed load has its step discarded: whatever
        this step stored from its blocks is garbage and must not be kept."""
        ...

    def wait_for_progress(self, timeout: float) -> None:
        """The engine has nothing to compute: block up to ``timeout`` seconds until a transfer
        settles, returning at once when none is in flight (not in vLLM's API: kvflow's engine
        runs workers in its own process and must not spin against their copy threads)."""
        ...

    def build_worker_report(self) -> StepReport | None:
        """This rank's report of the transfers it finished since the last call, carried to the
        scheduler role in ``KVConnectorOutput.reports`` (None: nothing to carry)."""
        ...

    def clear_connector_metadata(self) -> None: ...

    def shutdown(self) -> None: ...


class NullConnector:
    """Both roles, doing nothing: the engine without a connector behaves exactly like this."""

    # ---- scheduler role ---------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorOutput | None:
        return None

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def reset_cache(self) -> bool:
        return True

    def has_pending_push_work(self) -> bool:
        return False

    # ---- worker role ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        return None

    def bind_connector_metadata(self, meta: object) -> None:
        return None

    def handle_preemptions(self, meta: object) -> None:
        return None

    def start_load_kv(self, *, layerwise: bool = False) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def build_worker_report(self) -> StepReport | None:
        return None

    def wait_for_progress(self, timeout: float) -> None:
        return None

    def clear_connector_metadata(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


__all__ = [
    "NULL_BLOCK_ID",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVConnectorOutput",
    "NullConnector",
    "SchedulerConnector",
    "WorkerConnector",
]
