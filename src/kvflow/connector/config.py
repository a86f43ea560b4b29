"""``OffloadConfig``: the one configuration object of kvflow's offload connector, validated.

It comes from code, from a CLI, or from a plain mapping (vLLM's ``kv_connector_extra_config``);
``from_mapping`` rejects unknown keys and wrong types with a ``ConfigError`` naming the key.
The internal specs are derived from it, never written by a user: ``manager_config`` (the
scheduler side's ``OffloadManagerConfig``) and ``worker_options`` (a rank's ``WorkerOptions``).
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from attrs import field, fields, frozen

from kvflow.core.offload import FenceLoads, GroupSpec, OffloadManagerConfig, StorePolicy
from kvflow.core.validate import positive_int, timeout_s
from kvflow.errors import ConfigError
from kvflow.runtime.sync_worker import WorkerLoop
from kvflow.runtime.timeouts import DRAIN_TIMEOUT_S, FLUSH_TIMEOUT_S, Timeouts

if TYPE_CHECKING:
    # Only for annotations: reading the configuration must not load the event loop's modules.
    from kvflow.runtime.worker import WorkerOptions


class BackendKind(enum.StrEnum):
    AUTO = "auto"  # cuda when the KV tensors are on a CUDA device and a driver is there, else host
    HOST = "host"
    CUDA = "cuda"


E = TypeVar("E", bound=enum.StrEnum)


def _choice(kind: type[E], name: str, value: object) -> E:
    """``value`` as a ``kind``; the error names the option and its choices."""
    if isinstance(value, str) and value in {m.value for m in kind}:
        return kind(value)
    choices = ", ".join(m.value for m in kind)
    raise ConfigError(f"{name} must be one of {choices}, not {value!r}")


def _store_policy(value: object) -> StorePolicy:
    return _choice(StorePolicy, "store_policy", value)


def _fence_loads(value: object) -> FenceLoads:
    return _choice(FenceLoads, "fence_loads", value)


def _backend(value: object) -> BackendKind:
    return _choice(BackendKind, "backend", value)


def _worker_loop(value: object) -> WorkerLoop:
    return _choice(WorkerLoop, "worker_loop", value)


def parse_size(value: object) -> int:
    """Bytes as an int, or a string with a binary suffix: "512MiB", "4GiB"."""
    if isinstance(value, bool):
        raise ConfigError("cpu_bytes must be a size, not a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "B": 1}
        for unit, mult in units.items():
            if text.endswith(unit):
                number = text[: -len(unit)].strip()
                try:
                    size = float(number) * mult
                except ValueError:
                    break
                if not math.isfinite(size):
                    # "infGiB", "nanB", "1e400B": float() takes them, int() would not.
                    raise ConfigError(f"cpu_bytes: {value!r} is not a finite size")
                return int(size)
        if text.isdigit():
            return int(text)
    raise ConfigError(f"cpu_bytes: {value!r} is not a size (an int, or e.g. '8GiB', '512MiB')")


def machine_memory_bytes() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def _drain_timeout(value: object) -> float:
    return timeout_s("drain_timeout_s", value)


def _flush_timeout(value: object) -> float:
    return timeout_s("flush_timeout_s", value)


class PDTransportKind(enum.StrEnum):
    GLOO = "gloo"  # torch.distributed gloo between the two engines' worker processes (CPU)
    NIXL = "nixl"  # NIXL (the kvflow[nixl] extra): UCX READ or WRITE, host or GPU tensors
    CUDA_IPC = "cuda-ipc"  # CUDA IPC between two processes of one host (GPU tensors)


def _pd_transport(value: object) -> PDTransportKind:
    return _choice(PDTransportKind, "pd_transport", value)


def _positive_timeout(name: str, value: object) -> float:
    seconds = timeout_s(name, value)
    if seconds <= 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return seconds


def _port(name: str, value: object) -> int:
    if type(value) is not int or not 0 <= value < 65536:
        raise ConfigError(f"{name} must be a port number (0: any free port), got {value!r}")
    return value


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


def _pd_host(value: object) -> str:
    return _text("pd_side_channel_host", value)


def _pd_peer(value: object) -> str:
    return _text("pd_peer_engine_id", value)


def _pd_side_port(value: object) -> int:
    return _port("pd_side_channel_port", value)


def _pd_data_port(value: object) -> int:
    return _port("pd_data_port", value)


def _pd_lease(value: object) -> float:
    return _positive_timeout("pd_lease_s", value)


def _pd_claim(value: object) -> float:
    return _positive_timeout("pd_claim_s", value)


def _pd_timeout(value: object) -> float:
    return _positive_timeout("pd_timeout_s", value)


@frozen
class PDConfig:
    """PD (prefill → decode hand-off) options; a plain mapping spells each ``pd_<name>``.

    - ``transport``: the data plane between the two engines (``gloo``, ``nixl``, ``cuda-ipc``:
      ``kvflow.backends.pd.registry``);
    - ``side_channel_host`` / ``side_channel_port``: where this engine's control plane listens
      (port 0: any free port; the producer's is in the ``kv_transfer_params`` it returns);
    - ``data_port``: the producer's data-plane port (0: a free port chosen at start-up);
    - ``peer_engine_id``: on a producer, the consumer engine its hand-offs go to;
    - ``lease_s``: how long a producer holds KV nobody claimed; ``claim_s``: how long a consumer
      waits for the producer's answer to its claim;
    - ``timeout_s``: a HELLO's and the data plane's rendezvous and per-copy bound;
    - ``recompute_below_tokens``: a consumer computes the prompt itself (and releases the
      producer at once) when fewer tokens than this would come from the producer.
    """

    transport: PDTransportKind = field(default=PDTransportKind.GLOO, converter=_pd_transport)
    side_channel_host: str = field(default="127.0.0.1", converter=_pd_host)
    side_channel_port: int = field(default=0, converter=_pd_side_port)
    data_port: int = field(default=0, converter=_pd_data_port)
    peer_engine_id: str = field(default="", converter=_pd_peer)
    lease_s: float = field(default=10.0, converter=_pd_lease)
    claim_s: float = field(default=5.0, converter=_pd_claim)
    timeout_s: float = field(default=30.0, converter=_pd_timeout)
    recompute_below_tokens: int = 0

    def __attrs_post_init__(self) -> None:
        value = self.recompute_below_tokens
        if type(value) is not int or value < 0:
            raise ConfigError(f"pd_recompute_below_tokens must be an int >= 0, got {value!r}")

    @staticmethod
    def keys() -> list[str]:
        """The mapping keys: ``pd_`` and each field's name."""
        return [f"pd_{f.name}" for f in fields(PDConfig)]


EAGER_STORE_INTERVAL = 4
"""Default decode steps per eager store: four steps' completed blocks cost one transfer's
planning, launch and commit (docs/benchmarks.md, issue 7), and wait at most three steps."""

LOAD_PARTS = 4
"""Default parts by layer of a fenced load: the first layers' attention waits for a quarter of
the copies, and each part's copies land at the link's whole rate. Four beat one and eight on
llama-1b's fenced prefill steps (docs/benchmarks.md, "Thirtieth session")."""


@frozen
class OffloadConfig:
    """How kvflow's CPU tier is sized and driven.

    - ``cpu_bytes``: bytes of the pinned CPU tier, split evenly in blocks over the KV cache groups;
    - ``store_policy``: ``eager`` (store each block once computed) or ``lazy`` (store blocks about
      to be evicted from the GPU);
    - ``lazy_watermark``: lazy policy, blocks at the eviction end of the GPU free queue kept stored;
    - ``eager_store_interval``: eager policy, decode steps whose completed blocks go in one store
      (1: a store each step; see ``OffloadManagerConfig``);
    - ``fence_loads``: ``idle`` (the default: a CPU hit found while no request runs loads in
      the step that computes it, the forward waiting for the copies on the device; otherwise
      the request waits for its load in the scheduler, as ``never`` always does) or
      ``always``; see ``FenceLoads``;
    - ``load_parts``: a fenced load lands in up to this many parts by layer, and each layer's
      attention waits only for its own part, so the copies overlap the forward (an engine that
      calls ``start_load_kv(layerwise=True)`` and ``wait_for_layer_load``, as kvflow's does
      outside its full decode graphs; default ``LOAD_PARTS``; 1: the forward waits for the
      whole load, as it does in any step whose engine does not ask layer by layer);
    - ``backend``: ``auto``, ``host`` or ``cuda``;
    - ``world_size``: tensor-parallel ranks that must all report a copy before it commits;
    - ``worker_loop``: ``inline`` (the default: the worker runtime's loop, copy launches and
      fence polls on the engine's thread, stepped by the connector's calls, so nothing of kvflow
      takes the GIL between them) or ``thread`` (all of it on threads of kvflow's). See
      docs/architecture.md, "Where the worker runtime's loop runs".
    - ``drain_timeout_s`` / ``flush_timeout_s``: bounds of the worker's drain at shutdown and of
      a flush (preemption); past them the call raises ``DeadlineError`` naming the wait.
    - ``pd``: the PD options (``PDConfig``), spelled ``pd_<name>`` in a mapping.

    A ``cpu_bytes`` larger than this machine's physical memory is refused: the tier would be
    killed for memory rather than fail cleanly.
    """

    cpu_bytes: int = field(converter=parse_size)
    store_policy: StorePolicy = field(default=StorePolicy.EAGER, converter=_store_policy)
    lazy_watermark: int = 64
    backend: BackendKind = field(default=BackendKind.AUTO, converter=_backend)
    world_size: int = 1
    eager_store_interval: int = EAGER_STORE_INTERVAL
    fence_loads: FenceLoads = field(default=FenceLoads.IDLE, converter=_fence_loads)
    load_parts: int = LOAD_PARTS
    worker_loop: WorkerLoop = field(default=WorkerLoop.INLINE, converter=_worker_loop)
    drain_timeout_s: float = field(default=DRAIN_TIMEOUT_S, converter=_drain_timeout)
    flush_timeout_s: float = field(default=FLUSH_TIMEOUT_S, converter=_flush_timeout)
    pd: PDConfig = field(factory=PDConfig)

    def __attrs_post_init__(self) -> None:
        if self.cpu_bytes <= 0:
            raise ConfigError(f"cpu_bytes must be positive, got {self.cpu_bytes}")
        memory = machine_memory_bytes()
        if memory is not None and self.cpu_bytes > memory:
            raise ConfigError(
                f"cpu_bytes={self.cpu_bytes} is more than this machine's memory ({memory} bytes)"
            )
        for name in ("lazy_watermark", "world_size", "eager_store_interval", "load_parts"):
            positive_int(name, getattr(self, name))

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> OffloadConfig:
        """Build from plain data; unknown keys and bad values raise ``ConfigError`` naming them."""
        known = {f.name for f in fields(cls)} - {"pd"}
        pd_keys = set(PDConfig.keys())
        unknown = sorted(set(options) - known - pd_keys)
        if unknown:
            raise ConfigError(
                f"unknown kvflow option(s) {unknown}; known: {sorted(known | pd_keys)}"
            )
        if "cpu_bytes" not in options:
            raise ConfigError("kvflow option 'cpu_bytes' is required (e.g. '8GiB')")
        plain = {k: v for k, v in options.items() if k not in pd_keys}
        pd = {k.removeprefix("pd_"): v for k, v in options.items() if k in pd_keys}
        try:
            return cls(**plain, pd=PDConfig(**pd))
        except (ValueError, TypeError, OverflowError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"invalid kvflow option: {exc}") from exc

    def manager_config(
        self,
        groups: Sequence[GroupSpec],
        *,
        null_block_id: int | None,
        enable_events: bool = False,
        num_gpu_blocks: int | None = None,
    ) -> OffloadManagerConfig:
        """The scheduler-side manager's spec: these options over the engine's KV cache groups
        (``enable_events``: the CPU pools record cache events, for KV-aware routers;
        ``num_gpu_blocks``, when known, range-checks every GPU block id the engine passes)."""
        return OffloadManagerConfig(
            groups=groups,
            world_size=self.world_size,
            store_policy=self.store_policy,
            lazy_watermark=self.lazy_watermark,
            null_block_id=null_block_id,
            eager_store_interval=self.eager_store_interval,
            enable_events=enable_events,
            fence_loads=self.fence_loads,
            num_gpu_blocks=num_gpu_blocks,
        )

    def worker_options(self, rank: int) -> WorkerOptions:
        """One rank's worker runtime options (the rest are the runtime's defaults)."""
        from kvflow.runtime.worker import WorkerOptions

        return WorkerOptions(
            rank=rank,
            timeouts=Timeouts(drain_s=self.drain_timeout_s, flush_s=self.flush_timeout_s),
            load_parts=self.load_parts,
        )

    def cpu_blocks_per_group(self, block_bytes: Sequence[int]) -> tuple[int, ...]:
        """CPU blocks of each group: the same count in every group, as many as ``cpu_bytes`` holds.

        Every group needs its own block for a token range to be a hit, so equal counts waste
        nothing; ``block_bytes[g]`` is one block of group ``g`` over all its layers.
        """
        if not block_bytes or any(b <= 0 for b in block_bytes):
            raise ConfigError(f"block bytes per group must be positive, got {list(block_bytes)}")
        n = self.cpu_bytes // sum(block_bytes)
        if n < 1:
            raise ConfigError(
                f"cpu_bytes={self.cpu_bytes} holds no block (one block of every group is "
                f"{sum(block_bytes)} bytes)"
            )
        return (n,) * len(block_bytes)


__all__ = [
    "EAGER_STORE_INTERVAL",
    "LOAD_PARTS",
    "BackendKind",
    "OffloadConfig",
    "PDConfig",
    "PDTransportKind",
    "WorkerLoop",
    "parse_size",
]
