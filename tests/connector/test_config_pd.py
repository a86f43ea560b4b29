"""``OffloadConfig``'s PD options: spelled ``pd_<name>`` in a mapping, each checked by name."""

from __future__ import annotations

import pytest

from kvflow.connector.config import OffloadConfig, PDConfig, PDTransportKind
from kvflow.errors import ConfigError


def test_pd_keys_of_a_mapping_land_in_the_pd_options() -> None:
    """``pd_*`` keys become ``OffloadConfig.pd``; absent ones keep their defaults."""
    cfg = OffloadConfig.from_mapping(
        {"cpu_bytes": 1 << 20, "pd_side_channel_port": 5600, "pd_lease_s": 2, "pd_claim_s": 1.5}
    )
    assert cfg.pd == PDConfig(side_channel_port=5600, lease_s=2.0, claim_s=1.5)
    assert cfg.pd.transport is PDTransportKind.GLOO
    assert OffloadConfig.from_mapping({"cpu_bytes": 1 << 20}).pd == PDConfig()


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"pd_transport": "tcp"}, "pd_transport"),
        ({"pd_side_channel_port": -1}, "pd_side_channel_port"),
        ({"pd_data_port": "5601"}, "pd_data_port"),
        ({"pd_claim_s": 0}, "pd_claim_s"),
        ({"pd_timeout_s": float("inf")}, "pd_timeout_s"),
        ({"pd_recompute_below_tokens": 2.5}, "pd_recompute_below_tokens"),
        ({"pd_peer_engine_id": 7}, "pd_peer_engine_id"),
        ({"pd_leese_s": 1}, "pd_leese_s"),
        ({"pd": {}}, "'pd'"),
    ],
)
def test_a_bad_or_unknown_pd_option_is_a_config_error_naming_it(
    options: dict[str, object], name: str
) -> None:
    """Every PD option is validated where the others are; the error names the key."""
    with pytest.raises(ConfigError, match=name):
        OffloadConfig.from_mapping({"cpu_bytes": 1 << 20, **options})
