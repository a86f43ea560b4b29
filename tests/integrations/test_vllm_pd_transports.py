"""``pd_transport`` in vLLM's ``kv_connector_extra_config``: every transport of kvflow's registry
parses, one that cannot run here stops start-up with a ConfigError saying why, ``kv_both`` falls
back to the CPU tier when the default transport cannot run (the NIXL hand-off itself is in
``test_vllm_pd_nixl.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from typing import Any

from structlog.testing import capture_logs

from kvflow.backends.pd import registry
from kvflow.backends.pd.registry import TRANSPORTS
from kvflow.errors import ConfigError
from kvflow.integrations.vllm.config import offload_config
from tests.integrations.vllm_pd_rig import (
    BS,
    PROXY_PARAMS,
    Instance,
)
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

pytestmark = pytest.mark.usefixtures("no_leaks")


def _without(name: str, why: str) -> Any:
    real = registry.transport_status

    def status(**kwargs: Any) -> dict[str, tuple[bool, str]]:
        out = real(**kwargs)
        out[name] = (False, why)
        return out

    return status


@pytest.mark.parametrize("name", TRANSPORTS)
def test_every_registered_transport_is_a_pd_transport_option(name: str) -> None:
    """The option parser takes each transport kvflow's registry has, by its registry name."""
    assert offload_config({"pd_transport": name}, 1).pd.transport.value == name


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_cuda_ipc_on_a_cpu_instance_stops_start_up_naming_why(role: str) -> None:
    """cuda-ipc named on this CPU vLLM (a KV cache not on CUDA): a ConfigError that names the
    option, the transport and the devices, on D and on kv_both alike."""
    with pytest.raises(ConfigError, match=r"'cuda-ipc' moves KV tensors on cuda; .* on cpu"):
        Instance(role, "D", {"pd_transport": "cuda-ipc"})


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_a_named_transport_that_is_not_installed_is_a_config_error(
    role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pd_transport=nixl where NIXL is not installed: start-up stops with the registry's reason,
    for P, D and a kv_both instance that named it."""
    monkeypatch.setattr(registry, "transport_status", _without("nixl", "not installed (pip)"))
    extra = {"pd_transport": "nixl", "pd_peer_engine_id": "D"}
    with pytest.raises(ConfigError, match=r"'nixl' is not available here: not installed"):
        Instance(role, "X", extra)


def test_kv_both_without_a_usable_default_transport_is_the_cpu_tier_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kv_both naming no transport where the default (gloo) cannot run: no PD, requests with PD
    params are plain requests, the CPU tier works; kv_producer refuses to start."""
    monkeypatch.setattr(registry, "transport_status", _without("gloo", "torch without gloo"))
    with pytest.raises(ConfigError, match="gloo"):
        Instance("kv_producer", "P", {"pd_peer_engine_id": "D"})
    with capture_logs() as logs:
        inst = Instance("kv_both", "X", {})
    try:
        off = [e for e in logs if e["event"] == "vllm_pd_off"]
        assert off, "the fallback is logged"
        assert "torch without gloo" in off[0]["reason"]
        assert inst.connector.pd_role is None
        assert inst.worker._pd_worker is None
        inst.add([5] * (2 * BS + 1), PROXY_PARAMS, max_tokens=1, request_id="r")
        for _ in range(20):
            inst.step()
        assert inst.outputs["r"].kv_transfer_params is None
        assert inst.connector._scheduler.manager.stats().blocks_stored == 2  # type: ignore[union-attr]
    finally:
        inst.shutdown()
