"""HELLO's compatibility rule: what a hand-off can map (block sizes that share a wire unit) is
accepted, as are TP sizes that hold the kv heads (mapped head slice by head slice); what it
cannot (no common unit, a TP size the heads do not divide, a different model) is a typed
``PeerError`` at HELLO naming why, on both sides, and nothing is cached."""

from __future__ import annotations

import anyio
import pytest
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

from kvflow.core.pd.messages import Compat
from kvflow.errors import ConfigError, PeerError
from kvflow.runtime.clock import FakeClock
from kvflow.runtime.pd_control import default_compat, open_control_plane

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_leaks")]

GUARD_S = 20.0


async def test_block_sizes_16_and_32_with_one_wire_unit_are_accepted() -> None:
    """P at block size 16 and D at 32 (wire unit 16 on both): HELLO succeeds both ways."""
    clock = FakeClock()
    with anyio.fail_after(GUARD_S):
        async with (
            open_control_plane("P", default_compat(block_size=16, wire_block_size=16), clock) as p,
            open_control_plane("D", default_compat(block_size=32, wire_block_size=16), clock) as d,
        ):
            info = await d.hello(p.address)
            assert info.engine_id == "P"
            assert p.peer("D") is not None


async def test_tp_sizes_that_hold_the_kv_heads_are_accepted() -> None:
    """P tp1 and D tp2 (2 kv heads, one per D rank): HELLO succeeds; the peer's TP is cached."""
    clock = FakeClock()
    with anyio.fail_after(GUARD_S):
        async with (
            open_control_plane("P", default_compat(shard="tp1"), clock) as p,
            open_control_plane("D", default_compat(shard="tp2"), clock) as d,
        ):
            info = await d.hello(p.address)
            assert info.engine_id == "P"
            assert p.peer("D") is not None


@pytest.mark.parametrize(
    ("d_fields", "why"),
    [
        ({"block_size": 32}, "wire_block_size"),  # 16 vs 32, each its own unit
        ({"shard": "tp3"}, r"shard \(tp3 vs tp1: 2 kv heads are neither divisible by tp 3"),
        ({"num_layers": 3}, "num_layers"),
        ({"block_size": 32, "wire_block_size": 8}, "wire_block_size"),
    ],
)
async def test_what_cannot_be_mapped_is_refused_at_hello(
    d_fields: dict[str, object], why: str
) -> None:
    """A peer whose KV cannot be mapped: PeerError naming why; neither side caches the other."""
    clock = FakeClock()
    with anyio.fail_after(GUARD_S):
        async with (
            open_control_plane("P", default_compat(block_size=16), clock) as p,
            open_control_plane("D", default_compat(**d_fields), clock) as d,
        ):
            with pytest.raises(PeerError, match=why):
                await d.hello(p.address)
            assert p.peer("D") is None
            assert d.peer("P") is None


async def test_a_block_size_that_is_no_multiple_of_the_wire_unit_is_a_config_error() -> None:
    """``Compat`` itself refuses a wire unit that does not divide the block size, or a bad shard."""
    with pytest.raises(ConfigError, match="multiple of the wire"):
        default_compat(block_size=24, wire_block_size=16)
    with pytest.raises(ConfigError, match="shard"):
        default_compat(shard="two")
    assert isinstance(default_compat(shard="tp2/1"), Compat)
