"""The boundary checks of ``kvflow.core.validate``: each accepts what is well formed and names
what is not."""

from __future__ import annotations

import pytest

from kvflow.core import validate
from kvflow.core.protocol import StepPlan, TransferSpec
from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError, ProtocolError


class _Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid


def _name(r: _Req) -> str:
    return r.rid


def _check(*entries: tuple[_Req, object, tuple[tuple[int, ...], ...], bool]) -> None:
    validate.step_entries(list(entries), _name, 1, 16, 0)


def test_step_entries_accept_a_well_formed_step_and_window_padding() -> None:
    """One new id per request, a replaced table, and the null block repeated as padding pass."""
    a, b, c = _Req("a"), _Req("b"), _Req("c")
    _check((a, 8, ((5,),), False), (b, 0, ((),), False), (c, 12, ((0, 0, 3, 4),), True))


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ((_Req("a"), 8.0, ((5,),), False), "counts give 8.0 computed tokens"),
        ((_Req("a"), -1, ((5,),), False), "counts give -1"),
        ((_Req("a"), 8, ((5,), (6,)), False), "2 block groups, expected 1"),
        ((_Req("a"), 8, ((16,),), False), r"GPU block id 16 out of range 0\.\.15"),
        ((_Req("a"), 8, ((-2,),), False), "GPU block id -2 out of range"),
        ((_Req("a"), 8, ((3, 4, 3),), True), "GPU block id 3 given twice"),
    ],
)
def test_step_entries_name_the_problem(
    entry: tuple[_Req, object, tuple[tuple[int, ...], ...], bool], match: str
) -> None:
    """Each malformed entry raises ConfigError naming the request and the value."""
    with pytest.raises(ConfigError, match=match):
        _check((_Req("ok"), 4, ((1,),), False), entry)


def test_step_entries_refuse_a_request_scheduled_twice() -> None:
    """The same request twice in one step is refused, by name."""
    a = _Req("a")
    with pytest.raises(ConfigError, match="'a' is scheduled twice"):
        _check((a, 4, ((1,),), False), (a, 8, ((2,),), False))


def _spec(tid: int, d: Direction, gpu: tuple[int, ...], cpu: tuple[int, ...]) -> TransferSpec:
    return TransferSpec(tid, "r", d, (gpu,), (cpu,))


S, L = Direction.STORE, Direction.LOAD


def test_plan_accepts_two_loads_of_one_cached_block() -> None:
    """Two requests loading the same cached CPU block (a shared prefix) is a valid plan."""
    validate.plan(StepPlan(1, loads=(_spec(1, L, (2,), (0,)), _spec(2, L, (3,), (0,)))), [8], [4])


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        (StepPlan(1, stores=(_spec(1, S, (2,), (0,)), _spec(2, S, (3,), (0,)))), "two stores"),
        (StepPlan(1, stores=(_spec(1, S, (2,), (0,)),), loads=(_spec(2, L, (3,), (0,)),)), "store"),
        (StepPlan(1, loads=(_spec(1, L, (2,), (0,)), _spec(2, L, (2,), (1,)))), "loaded twice"),
        (StepPlan(1, loads=(_spec(1, L, (8,), (0,)),)), "GPU block id 8 out of range"),
        (StepPlan(1, loads=(_spec(1, L, (2,), (4,)),)), "CPU block id 4 out of range"),
        (StepPlan(1, stores=(_spec(1, S, (2, 2), (0, 1)),)), "GPU block id 2 given twice"),
        (StepPlan(1, stores=(_spec(1, S, (2,), (0,)), _spec(1, S, (3,), (1,)))), "id twice"),
    ],
)
def test_plan_names_the_problem(plan: StepPlan, match: str) -> None:
    """A plan that would write one CPU block twice, load into one GPU block twice or name an
    id past the registered layout raises ConfigError naming it."""
    with pytest.raises(ConfigError, match=match):
        validate.plan(plan, [8], [4])


def test_plan_order_refuses_a_stale_step_or_transfer() -> None:
    """A step not after the last one, or a transfer id not newer than the last one seen, is a
    ProtocolError; the next plan passes."""
    plan = StepPlan(5, stores=(_spec(9, S, (2,), (0,)),))
    with pytest.raises(ProtocolError, match="bound after step 5"):
        validate.plan_order(plan, 5, 3)
    with pytest.raises(ProtocolError, match=r"transfer\(s\) \[9\]"):
        validate.plan_order(plan, 4, 9)
    validate.plan_order(plan, 4, 8)


def test_tier_budget_refuses_larger_blocks_and_a_tier_past_cpu_bytes() -> None:
    """Blocks larger than declared, or a tier larger than cpu_bytes, raise ConfigError."""
    validate.tier_budget([128], [128], [8], 1024)
    with pytest.raises(ConfigError, match="256 bytes per block"):
        validate.tier_budget([128], [256], [8], 4096)
    with pytest.raises(ConfigError, match="exceeds cpu_bytes"):
        validate.tier_budget([128], [128], [9], 1024)


def test_a_plan_without_transfers_is_checked_only_for_its_step() -> None:
    """A plan of no transfer passes whatever the layout, and a step that is not an int is
    still refused."""
    validate.plan(StepPlan(3), (4,), (4,))
    with pytest.raises(ConfigError, match="plan step must be an int"):
        validate.plan(StepPlan(True), (4,), (4,))
