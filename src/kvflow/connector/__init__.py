"""The engine-facing facade: the connector interface (``api``) an engine calls, in two roles."""

from kvflow.connector.api import (
    NULL_BLOCK_ID,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVConnectorOutput,
    NullConnector,
    SchedulerConnector,
    WorkerConnector,
)

__all__ = [
    "NULL_BLOCK_ID",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVConnectorOutput",
    "NullConnector",
    "SchedulerConnector",
    "WorkerConnector",
]
