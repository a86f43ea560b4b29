"""Processes for tensor parallelism: start ranks, join them with a deadline, talk between them.

``launch(fn, args, world_size=2)`` starts ``world_size`` processes with torch.multiprocessing
(spawn), joins them into one torch.distributed group (on a free loopback port) and runs
``fn(rank, world_size, *args)`` in each; it returns every rank's return value. On CPU the group is
gloo; with ``device="cuda"`` rank ``r`` owns GPU ``r`` and tensors are reduced through NCCL, with a
gloo group beside it for Python objects. A rank that raises makes ``launch`` raise (torch
terminates the other ranks); a run past ``timeout_s`` is killed and raises ``KVFlowError``, so a
test never hangs CI. ``ProcessGroupChannel`` carries Python objects from rank 0 to every rank and
back through gloo's object collectives.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessContext, start_processes

from kvflow.backends.ports import free_port
from kvflow.core.logs import get_logger
from kvflow.errors import ConfigError, DeadlineError, KVFlowError
from kvflow.runtime.clock import SystemClock

log = get_logger("kvflow.engine.distributed")

JOIN_POLL_S = 0.25
"""How often ``launch`` looks at its ranks while waiting for them."""

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""NVLink multicast stays off: on shared multi-GPU hosts it can take every GPU out of service."""

_object_group: dist.ProcessGroup | None = None
"""This rank's gloo group for Python objects when the default group is NCCL; None on CPU."""
_timeout_s: float = 120.0
"""This rank's bound on every collective (the launch's ``timeout_s``): the process groups'
timeout, and the barrier's."""


def _rank_entry(
    rank: int,
    fn: Callable[..., object],
    args: tuple[Any, ...],
    world_size: int,
    port: int,
    out_dir: str,
    timeout_s: float,
    threads: int,
    device: str,
) -> None:
    global _object_group, _timeout_s
    _timeout_s = timeout_s
    # One intra-op thread per rank: ranks share the machine's cores and must not oversubscribe.
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for key, value in NO_MULTICAST.items():
        os.environ[key] = value
    timeout = timedelta(seconds=timeout_s)
    device_id: torch.device | None = None
    if device == "cuda":
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl" if device_id is not None else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
    if device_id is not None:
        # Step messages are small pickles: through gloo on the host, not staged through the GPU.
        _object_group = dist.new_group(backend="gloo", timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    # The result is written and the group destroyed; the interpreter's teardown of torch would
    # cost each rank seconds more, so leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(
    fn: Callable[..., object],
    args: Sequence[Any] = (),
    *,
    world_size: int = 2,
    timeout_s: float = 120.0,
    threads: int = 1,
    device: str = "cpu",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; their results by rank.

    ``fn`` and ``args`` must pickle (a module-level function). ``device`` is "cpu" (gloo) or
    "cuda" (rank ``r`` on GPU ``r``, NCCL). Raises what a rank raised (as torch's
    ``ProcessRaisedException``, with its traceback), or ``KVFlowError`` after ``timeout_s``
    seconds, having killed every rank.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be positive, got {world_size}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"launch device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ConfigError(
            f"{world_size} ranks need {world_size} GPUs; {torch.cuda.device_count()} visible"
        )
    clock = SystemClock()
    with tempfile.TemporaryDirectory(prefix="kvflow-tp-") as out_dir:
        port = free_port()
        log.info("tp_launch", world_size=world_size, port=port)
        ctx: ProcessContext = start_processes(  # type: ignore[no-untyped-call]
            _rank_entry,
            args=(fn, tuple(args), world_size, port, out_dir, timeout_s, threads, device),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = clock.now() + timeout_s
        try:
            while not ctx.join(timeout=JOIN_POLL_S):
                if clock.now() > deadline:
                    raise KVFlowError(f"tensor-parallel ranks still running after {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    log.warning("tp_rank_killed", pid=p.pid)
                    p.kill()
                    p.join()
        return [pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def _timed_out(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(m in text for m in ("timed out", "timeout", "failed to pass monitoredbarrier"))


class ProcessGroupChannel:
    """Objects between rank 0 and the other ranks, through gloo (the default group on CPU, the
    launch's gloo group beside NCCL on GPUs).

    Rank 0 ``broadcast``s, the others ``receive``; every rank then calls ``gather``, and rank 0
    gets the list of what each rank gave (its own included). Every call is bounded by the
    process group's timeout (the launch's ``timeout_s``); past it gloo's error becomes a
    ``DeadlineError`` naming the call and this rank.
    """

    def __init__(self) -> None:
        self.group = _object_group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def _bounded(self, what: str, call: Callable[[], object], seconds: float | None = None) -> None:
        try:
            call()
        except RuntimeError as exc:
            if not _timed_out(exc):
                raise
            waited = _timeout_s if seconds is None else seconds
            raise DeadlineError(
                f"rank {self.rank}: {what} of {self.world_size} ranks still waiting after "
                f"{waited:g} s: {exc}"
            ) from exc

    def broadcast(self, obj: object) -> None:
        self._bounded(
            "broadcast", lambda: dist.broadcast_object_list([obj], src=0, group=self.group)
        )

    def receive(self) -> object:
        box: list[object] = [None]
        self._bounded(
            "receive from rank 0", lambda: dist.broadcast_object_list(box, src=0, group=self.group)
        )
        return box[0]

    def barrier(self, timeout_s: float | None = None) -> None:
        """Return once every rank has called it; after ``timeout_s`` (default: the group's
        timeout) raise ``DeadlineError`` naming the ranks that did not come (gloo's monitored
        barrier)."""
        seconds = _timeout_s if timeout_s is None else timeout_s
        self._bounded(
            "barrier",
            lambda: dist.monitored_barrier(
                group=self.group, timeout=timedelta(seconds=seconds), wait_all_ranks=True
            ),
            seconds,
        )

    def gather(self, obj: object) -> list[object] | None:
        out: list[object] | None = [None] * self.world_size if self.rank == 0 else None
        self._bounded("gather", lambda: dist.gather_object(obj, out, dst=0, group=self.group))
        return out


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the ranks of the default group (in place; returned for chaining)."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


__all__ = ["NO_MULTICAST", "ProcessGroupChannel", "all_reduce_sum", "free_port", "launch"]
