"""The TP glue of the PD connector, over fake links in one process: rank 0's launches reach the
other ranks as step metadata, each rank's end of its copies comes back once in its step report
(failures and cancels too), and a reported op is forgotten once every other rank reported it."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from kvflow.backends.base import FenceStatus
from kvflow.backends.pd.fake import FakeLink, FakeTransport
from kvflow.connector.pd import pd_connector_factory
from kvflow.connector.pd_tp import PDRankWorker, RankOp, RankOps, RankZeroTransport
from kvflow.core.pd.common import LaunchCopies
from kvflow.engine.engine import EngineConfig, make_kv_cache_config
from kvflow.engine.kv_cache import allocate_kv_caches
from kvflow.engine.model import model_config
from kvflow.errors import ConfigError
from kvflow.runtime.pd_control import default_compat

CFG = model_config("tiny")
KV = make_kv_cache_config(CFG, EngineConfig(block_size=4, num_gpu_blocks=8))
PAIRS = (((1, 2), (3, 4)),) * len(KV.groups)


def _caches(fill: float) -> dict[str, torch.Tensor]:
    caches = allocate_kv_caches(KV, CFG.num_kv_heads, CFG.head_dim, dtype=torch.float32,
                                device=torch.device("cpu"))  # fmt: skip
    for t in caches.values():
        t.fill_(fill)
    return caches


def _op(send: bool, channel: int = 1) -> LaunchCopies:
    pairs = PAIRS if send else tuple(tuple((d, s) for s, d in g) for g in PAIRS)
    return LaunchCopies("t", 1, "peer", send, pairs, channel)


def _rank1() -> tuple[PDRankWorker, FakeLink, FakeTransport, dict[str, torch.Tensor]]:
    """Rank 1 of P as a PD rank worker, its link to D's rank 1, and D rank 1's end (registered)."""
    link = FakeLink()
    p_end, d_end = link.pair()
    worker = PDRankWorker(p_end, 1, KV)
    worker.register_kv_caches(_caches(7.0))
    d_caches = _caches(0.0)
    d_end.register([[t[i] for name in g.layer_names for t in (d_caches[name],) for i in (0, 1)]
                    for g in KV.groups])  # fmt: skip
    return worker, link, d_end, d_caches


def test_rank_zero_forwards_each_launch_and_hears_each_rank_once() -> None:
    """A launch on rank 0 runs locally and is queued once for the other ranks; rank 1 launches
    it from the step's metadata and reports it completed once the bytes landed; rank 0 maps
    the report back to the launch and drops a second report of it."""
    local_link = FakeLink()
    local, _ = local_link.pair()
    rank0 = RankZeroTransport(local, world_size=2)
    rank0.register([[torch.zeros(8, 16)]])
    fence = rank0.launch(_op(True))
    meta = rank0.take()
    assert meta is not None
    assert [o.launch for o in meta.ops] == [_op(True)]
    assert rank0.take() is None  # each op goes out once
    worker, link, d_end, d_caches = _rank1()
    worker.bind_connector_metadata(meta)
    d_fence = d_end.launch(_op(False))
    assert worker.build_worker_report() is None  # nothing landed yet
    link.step(0.0)
    report = worker.build_worker_report()
    assert report is not None
    assert (report.rank, report.completed, report.failed) == (1, (meta.ops[0].op_id,), ())
    assert d_end.query(d_fence) is FenceStatus.DONE
    name = KV.groups[0].layer_names[0]
    assert bool((d_caches[name][:, 2] == 7.0).all())
    assert bool((d_caches[name][:, 0] == 0.0).all())
    assert rank0.reported(1, meta.ops[0].op_id) == _op(True)
    assert rank0.pending == {}
    with capture_logs() as logs:
        assert rank0.reported(1, meta.ops[0].op_id) is None
    assert [e["event"] for e in logs] == ["pd_rank_report_dropped"]
    rank0.cancel(fence)
    assert rank0.take() is None  # nothing pending: no cancel goes out
    worker.shutdown()
    d_end.close()
    local.close()


def test_a_cancel_and_a_failed_launch_come_back_as_failed() -> None:
    """Rank 0 cancels a launch rank 1 runs: rank 1 cancels its copy and reports it failed; a
    launch rank 1 cannot start (its transport closed) is reported failed at once."""
    local_link = FakeLink()
    local, _ = local_link.pair()
    rank0 = RankZeroTransport(local, world_size=2)
    rank0.register([[torch.zeros(8, 16)]])
    fence = rank0.launch(_op(True))
    worker, _link, d_end, _ = _rank1()
    launched = rank0.take()
    assert launched is not None
    worker.bind_connector_metadata(launched)
    rank0.cancel(fence)
    cancel = rank0.take()
    assert cancel == RankOps((RankOp(launched.ops[0].op_id),))
    worker.bind_connector_metadata(cancel)
    report = worker.build_worker_report()
    assert report is not None
    assert report.failed == (launched.ops[0].op_id,)
    worker.transport.close()
    worker.bind_connector_metadata(RankOps((RankOp(99, _op(True, 2)),)))
    report = worker.build_worker_report()
    assert report is not None
    assert report.failed == (99,)
    assert worker.in_flight == 0
    d_end.close()
    local.close()


def test_a_tp_engine_needs_a_rank_zero_transport_exactly_when_it_has_other_ranks() -> None:
    """``world_size`` 2 with a plain transport, or 1 with a rank-0 transport: ConfigError."""
    link = FakeLink()
    end, _ = link.pair()
    compat = default_compat(num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim,
                            num_layers=CFG.num_layers, block_size=4)  # fmt: skip
    with pytest.raises(ConfigError, match="RankZeroTransport"):
        pd_connector_factory("consumer", "D", compat, end, world_size=2)
    with pytest.raises(ConfigError, match="RankZeroTransport"):
        pd_connector_factory("consumer", "D", compat, RankZeroTransport(end, 2))
    with pytest.raises(ConfigError, match="other ranks"):
        RankZeroTransport(end, 1)
    with pytest.raises(ConfigError, match="other than 0"):
        PDRankWorker(end, 0, KV)
    end.close()
