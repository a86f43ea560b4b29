"""The scheduler-side offload manager, one module per part.

``config`` (policies, groups, derived geometry) · ``state`` (per-request and per-transfer state)
· ``matching`` (CPU-hit matching) · ``eager`` (the eager store policy) · ``lazy`` (the lazy
policy's cursor over the GPU free queue) · ``decode`` (steps of running requests only, one
token each) · ``ledger`` (the transfer ledger: the one place a
transfer changes state or a block ref changes) · ``stats`` · ``manager`` (``OffloadManager``: the
engine's calls, orchestrating the rest). Imports go one way: ``manager`` → ``decode`` → policies,
matcher, ledger → ``state``, ``stats``, ``config``.
"""

from kvflow.core.offload.config import (
    LAZY_REQUEST_ID,
    STEP_STORE_ID,
    FenceLoads,
    GroupSpec,
    OffloadManagerConfig,
    ResetStatus,
    StorePolicy,
)
from kvflow.core.offload.decode import NewBlockIds
from kvflow.core.offload.manager import OffloadManager
from kvflow.core.offload.stats import NO_OUTCOME, OffloadStats, StepOutcome

__all__ = [
    "LAZY_REQUEST_ID",
    "NO_OUTCOME",
    "STEP_STORE_ID",
    "FenceLoads",
    "GroupSpec",
    "NewBlockIds",
    "OffloadManager",
    "OffloadManagerConfig",
    "OffloadStats",
    "ResetStatus",
    "StepOutcome",
    "StorePolicy",
]
