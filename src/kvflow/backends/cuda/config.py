"""``CudaConfig``: the CUDA backend's tuning (copy path, staging ring, pinning, threads), checked
when made; importing it needs no GPU."""

from __future__ import annotations

from typing import Literal

from attrs import frozen

from kvflow.errors import ConfigError

MiB = 1 << 20
KiB = 1 << 10

Method = Literal["auto", "staged", "direct"]


@frozen
class CudaConfig:
    """Tuning of the CUDA backend; the defaults come from ``scripts/bench_transfer.py`` on an H200."""

    method: Method = "auto"
    """``auto`` stages groups of small pages and copies large ones direct; ``staged`` and
    ``direct`` force one path. Forced ``direct`` at small scattered pages is an order of magnitude
    slower for loads (one descriptor per page; docs/benchmarks.md, twenty-sixth session)."""
    staged_max_page_bytes: int = 512 * KiB
    """``auto`` stages a group whose smallest page is at most this; larger pages go direct."""
    slot_bytes: int = 128 * MiB
    num_slots: int = 2
    """Staging ring per direction: ``num_slots`` slots of ``slot_bytes`` on the GPU."""
    ramp_bytes: int = 16 * MiB
    """Staged path: a store's first sub-batch and a load's last hold at most this many bytes
    (at least one block; 0: full slots only). They are the part of a batch no DMA overlaps."""
    gather_ctas: int = 64
    """CTAs of one gather/scatter launch: few enough to leave compute most of the GPU."""
    register_chunk_bytes: int = 64 * MiB
    """Pinning granularity: a transfer waits for at most the one chunk it needs."""
    batch_min_copies: int = 4
    """Fewer copies than this in one call go as one ``cuMemcpyAsync`` each: on the H200's host
    one such call cost at most about 3.7 µs (the per-page baseline's rate at 4 KiB), one
    ``cuMemcpyBatchAsync`` 11–21 µs even for a single copy (docs/benchmarks.md), and a staged
    sub-batch of CPU ids in runs has one to three copies."""
    use_batch_memcpy: bool = True
    """False forces the per-copy ``cuMemcpyAsync`` fallback (what an old driver gets)."""
    launch_thread: bool = True
    """Issue driver calls on a launch thread; False issues them inside ``submit``."""
    defer_parts: bool = False
    """Without a launch thread: issue a load's later parts as the engine waits for the part
    before each (``DeferredIssue``) rather than all of them in ``submit_parts``. Off by default:
    with one descriptor per block it left the host setting the fenced step's pace (thirtieth
    session), and with the 2D copies it gained nothing over issuing every part at once
    (docs/benchmarks.md, thirty-second session)."""
    pitched_parts: bool = True
    """A staged load's part copies each run of consecutive CPU blocks with one
    ``cuMemcpy2DAsync`` (the part's pages are a block apart in the CPU tier) where runs average
    ``plan.PITCHED_MIN_ROWS`` blocks or more; False: always one descriptor per block (it made
    the fenced step's issue the host's pace: docs/benchmarks.md, thirty-second session)."""
    store_dma: bool = True
    """A store's copies go as 2D copies straight from the KV cache (``plan.pitched_direct``: one
    ``cuMemcpy2DAsync`` per region per run of blocks consecutive on both sides), with no gather
    kernel, where the runs average ``store_dma_min_run`` blocks or more (otherwise the group's
    usual path). The store then takes no SM time from the compute it runs beside, but its
    copies run slower than the staged path's at small pages and each costs the caller a driver
    call, where a staged store is a few. On by default since the fortieth session: with the
    minimum run below it cut the offload's cost beside device-bound steps (0 % reuse) and left
    the host-bound multi-round workload's TTFT ratio where the staged path had it
    (docs/benchmarks.md, thirty-ninth and fortieth sessions). Loads keep their path (their
    copies are awaited)."""
    store_dma_min_run: int = 32
    """With ``store_dma``: the fewest blocks a store's runs may average and still go as 2D
    copies (one driver call per region per run, so short runs cost the host the most). 32
    keeps a long prefill's stores (runs of about 64 blocks) as 2D copies and sends short-run
    stores, most of a multi-turn workload's, through the staged path, whose few calls the
    host-bound steps of such a workload can afford (docs/benchmarks.md, fortieth session)."""
    pitched_batch: bool = False
    """The 2D copies of one call (a staged load's part, a ``store_dma`` store) go as one
    ``cuMemcpy3DBatchAsync`` where the driver has it (CUDA 12.8+) and the call holds at least
    ``batch_min_copies`` of them, instead of one ``cuMemcpy2DAsync`` each (what False, or an
    older driver, gets). Off by default: the driver's time per copy stays about the same inside
    the batch, so it shortened a store's issue a little and the connector's time on the
    engine's thread not at all (docs/benchmarks.md, thirty-ninth session)."""
    completion_threads: bool = True
    """Wait for each batch's fence on a thread of its direction that wakes the reactor; False
    leaves finished batches to the reactor's polls (a loop driven from the engine's thread,
    ``InlineSyncWorker``, polls at every call: no thread of kvflow takes the GIL)."""
    time_copies: bool = True
    """Record timing events around each batch's copies: ``copy_seconds`` (the runtime's copy
    throughput) is then the device's own time, not the time until a poll saw the fence."""

    def __attrs_post_init__(self) -> None:
        if self.method not in ("auto", "staged", "direct"):
            raise ConfigError(
                f"CudaConfig.method must be auto, staged or direct, not {self.method!r}"
            )
        for name in (
            "slot_bytes",
            "num_slots",
            "gather_ctas",
            "register_chunk_bytes",
            "batch_min_copies",
            "store_dma_min_run",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"CudaConfig.{name} must be positive")
        if self.ramp_bytes < 0:
            raise ConfigError("CudaConfig.ramp_bytes must not be negative")


__all__ = ["CudaConfig", "KiB", "Method", "MiB"]
