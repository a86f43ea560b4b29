"""``OffloadConfig``: sizes, policies and counts are validated, each error naming its field."""

from __future__ import annotations

import pytest

from kvflow.connector.config import EAGER_STORE_INTERVAL, OffloadConfig, WorkerLoop
from kvflow.core.offload import StorePolicy
from kvflow.errors import ConfigError


def test_sizes_and_defaults() -> None:
    """Sizes take ints and unit strings; the defaults are eager stores coalesced over 4 steps."""
    cfg = OffloadConfig(cpu_bytes="1.5GiB")
    assert cfg.cpu_bytes == 3 << 29
    assert cfg.store_policy is StorePolicy.EAGER
    assert cfg.eager_store_interval == EAGER_STORE_INTERVAL == 4
    assert cfg.worker_loop is WorkerLoop.INLINE
    assert OffloadConfig(cpu_bytes=4096).cpu_bytes == 4096


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cpu_bytes": "lots"}, "cpu_bytes"),
        ({"cpu_bytes": 0}, "cpu_bytes must be positive"),
        ({"cpu_bytes": "1GiB", "lazy_watermark": 0}, "lazy_watermark"),
        ({"cpu_bytes": "1GiB", "world_size": -1}, "world_size"),
        ({"cpu_bytes": "1GiB", "eager_store_interval": 0}, "eager_store_interval"),
        ({"cpu_bytes": "1GiB", "eager_store_interval": 2.5}, "eager_store_interval"),
        ({"cpu_bytes": "1GiB", "store_interval": 2}, "unknown kvflow option"),
        ({"cpu_bytes": "1GiB", "store_policy": "sometimes"}, "store_policy must be one of eager"),
        ({"cpu_bytes": "1GiB", "backend": "tpu"}, "backend must be one of auto, host, cuda"),
        ({"cpu_bytes": "1GiB", "worker_loop": "fiber"}, "worker_loop must be one of thread"),
    ],
)
def test_bad_options_raise_config_error_naming_the_field(
    options: dict[str, object], message: str
) -> None:
    """Each bad value or unknown key is a ConfigError that names it."""
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_mapping(options)


def test_from_mapping_takes_every_field() -> None:
    """Plain data (a JSON config) builds the same config as keyword arguments."""
    data = {
        "cpu_bytes": "8MiB",
        "store_policy": "lazy",
        "eager_store_interval": 1,
        "worker_loop": "inline",
    }
    assert OffloadConfig.from_mapping(data) == OffloadConfig(
        cpu_bytes=8 << 20,
        store_policy=StorePolicy.LAZY,
        eager_store_interval=1,
        worker_loop=WorkerLoop.INLINE,
    )


def test_groups_may_name_their_own_block_size() -> None:
    """A KV cache group's own block size reaches the scheduler role's manager; groups naming
    none take the config's; a bad one is refused naming the group."""
    from kvflow.connector.api import KVCacheConfig, KVCacheGroupSpec
    from kvflow.connector.offload import OffloadScheduler

    kv = KVCacheConfig(
        block_size=16,
        num_blocks=8,
        groups=[KVCacheGroupSpec(0, ["a"]), KVCacheGroupSpec(1, ["b"], block_size=32)],
    )
    assert (kv.group_block_size(0), kv.group_block_size(1)) == (16, 32)
    scheduler = OffloadScheduler(OffloadConfig(cpu_bytes=1 << 20), kv, [1024, 2048])
    assert [g.block_size for g in scheduler.manager.config.groups] == [16, 32]
    with pytest.raises(ConfigError, match="group 0: block_size"):
        KVCacheConfig(16, 8, [KVCacheGroupSpec(0, ["a"], block_size=0)])
