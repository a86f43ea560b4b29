"""Two reference engines in one process joined as P and D by the PD connector over real zmq
control planes and the fake transport: the sequential flow stepped by hand, and the checks
every PD connector test shares (both pools whole, no hand-off or hold left)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvflow.backends.pd.fake import FakeLink
from kvflow.connector.api import KVCacheConfig
from kvflow.connector.config import OffloadConfig
from kvflow.connector.offload import OffloadConnector
from kvflow.connector.pd import PDConnector, pd_connector_factory
from kvflow.connector.pd_offload import PDOffloadConnector
from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.pd.common import PDTimeouts
from kvflow.engine.engine import Engine, EngineConfig, RequestResult
from kvflow.engine.model import model_config
from kvflow.runtime.clock import Clock, SystemClock
from kvflow.runtime.pd_control import default_compat
from tests.engine.helpers import shared_model

TIMEOUTS = PDTimeouts(claim_s=5, grant_window_s=5, copy_s=5, drain_retry_s=0.05, lease_s=1)


def compat(block_size: int, wire_block_size: int = 0) -> Any:
    cfg = model_config("tiny")
    return default_compat(
        block_size=block_size,
        wire_block_size=wire_block_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_layers=cfg.num_layers,
    )


def engine(connector_factory: Any = None, **config: Any) -> Engine:
    defaults: dict[str, Any] = {"block_size": 4, "num_gpu_blocks": 96}
    defaults.update(config)
    return Engine(
        model_config("tiny"),
        EngineConfig(**defaults),
        model=shared_model("tiny"),
        connector_factory=connector_factory,
    )


class Pair:
    """A P engine and a D engine, their connectors and the fake link between them; D's block
    size is ``d_block_size`` (default P's), both moving wire blocks of ``wire_block_size``."""

    def __init__(
        self,
        link: FakeLink | None = None,
        block_size: int = 4,
        *,
        d_cpu_tier: bool = False,
        clock: Clock | None = None,
        d_block_size: int | None = None,
        wire_block_size: int = 0,
        **config: Any,
    ) -> None:
        self.link = link or FakeLink()
        p_end, d_end = self.link.pair()
        c = compat(block_size, wire_block_size)
        d_bs = d_block_size or block_size
        d_factory = pd_connector_factory(
            "consumer",
            "D",
            compat(d_bs, wire_block_size),
            d_end,
            timeouts=TIMEOUTS,
            pump=self.link.step,
            clock=clock,
        )
        self.offload: OffloadConnector | None = None
        if d_cpu_tier:
            d_factory = self._with_cpu_tier(d_factory)
        self.p = engine(
            pd_connector_factory(
                "producer", "P", c, p_end, peer="D", timeouts=TIMEOUTS, clock=clock
            ),
            block_size=block_size,
            **config,
        )
        self.d = engine(d_factory, block_size=d_bs, **config)

    def _with_cpu_tier(self, pd_factory: Any) -> Any:
        """D's factory with its CPU tier composed in (``PDOffloadConnector``)."""
        cfg = model_config("tiny")

        def build(kv: KVCacheConfig, view: GpuCacheView) -> tuple[Any, Any]:
            per_layer = 2 * kv.block_size * cfg.num_kv_heads * cfg.head_dim * 4
            block_bytes = [per_layer * len(g.layer_names) for g in kv.groups]
            self.offload = OffloadConnector.build(
                OffloadConfig(cpu_bytes="4MiB", worker_loop="inline"),
                kv,
                block_bytes,
                gpu_view=view,
            )
            pd, _ = pd_factory(kv, view)
            both = PDOffloadConnector(self.offload, pd)
            return both, both

        return build

    def transfer_id(self, rid: str) -> str:
        """The router's id for the next hand-off of ``rid``: unique, as a router's must be."""
        self._handoffs = getattr(self, "_handoffs", 0) + 1
        return f"t-{rid}" if self._handoffs == 1 else f"t-{rid}-{self._handoffs}"

    @property
    def pc(self) -> PDConnector:
        c = self.p.scheduler_connector
        assert isinstance(c, PDConnector)
        return c

    @property
    def dc(self) -> PDConnector:
        c = self.d.scheduler_connector
        if isinstance(c, PDOffloadConnector):
            return c.pd
        assert isinstance(c, PDConnector)
        return c

    def step(self) -> None:
        """One step of each engine (an idle engine still polls its PD driver, as a server's
        loop does: a peer's CLAIM must be answered)."""
        self.p.step()
        self.d.step()

    def step_until(self, done: Callable[[], bool], what: str, guard_s: float = 20.0) -> None:
        """Step both engines until ``done()``; between steps wait for a control-plane message
        to arrive (the drivers' wake-up: zmq delivers on its own threads, so a fast loop of
        steps alone can outrun it). ``guard_s`` of real time is the safety net."""
        guard = SystemClock()  # the engines' clock may be a FakeClock that the test moves
        deadline = guard.now() + guard_s
        while not done():
            assert guard.now() < deadline, f"never saw {what} within {guard_s} s"
            self.step()
            if not done():
                self.pc.driver.wait(0.002)
                self.dc.driver.wait(0.002)

    def prefill(self, rid: str, prompt: Sequence[int]) -> RequestResult:
        """P's half of the sequential flow: one output token, then P's params."""
        self.p.add_request(
            prompt,
            1,
            request_id=rid,
            kv_transfer_params={"do_remote_decode": True, "transfer_id": self.transfer_id(rid)},
        )
        for _ in range(10_000):
            if rid in self.p._finished:
                return self.p.take_result(rid)
            self.step()
        raise AssertionError(f"P never finished {rid}")

    def decode(
        self, rid: str, prompt: Sequence[int], max_tokens: int, params: Any
    ) -> RequestResult:
        """D's half alone: ``rid`` with P's ``params``, run until both engines settle."""
        self.d.add_request(prompt, max_tokens, request_id=rid, kv_transfer_params=params)
        self.drain()
        return self.d.take_result(rid)

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[RequestResult]:
        """The sequential flow for each prompt (P first, then D with P's params), to the end."""
        ids = []
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            pr = self.prefill(rid, prompt)
            assert pr.kv_transfer_params is not None
            self.d.add_request(
                prompt, max_tokens, request_id=rid, kv_transfer_params=pr.kv_transfer_params
            )
            ids.append(rid)
        self.drain()
        return [self.d.take_result(rid) for rid in ids]

    def start_concurrent(self, rid: str, prompt: Sequence[int], max_tokens: int) -> str:
        """The concurrent flow's start: the request to P (which begins its hand-off, as the
        router's P worker does) and at once to D, which reserves and claims while P prefills."""
        tid = self.transfer_id(rid)
        p_params = {"do_remote_decode": True, "transfer_id": tid}
        self.p.add_request(prompt, 1, request_id=rid, kv_transfer_params=p_params)
        self.pc.begin(rid, p_params)
        d_params = {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_engine_id": "P",
            "remote_address": self.pc.driver.address,
        }
        self.d.add_request(prompt, max_tokens, request_id=rid, kv_transfer_params=d_params)
        return tid

    def run_concurrent(
        self, prompts: Sequence[Sequence[int]], max_tokens: int
    ) -> list[RequestResult]:
        """The concurrent flow for every prompt at once, to the end; D's results."""
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.start_concurrent(rid, prompt, max_tokens)
        self.drain()
        for rid in ids:
            self.p.take_result(rid)
        return [self.d.take_result(rid) for rid in ids]

    def drain(self, guard_s: float = 60.0) -> None:
        """Step both until neither has a request left (a hold waits out its lease on the
        engines' clock; a step budget would race the real one)."""
        self.step_until(
            lambda: not (self.p.has_unfinished() or self.d.has_unfinished()),
            "P and D settle",
            guard_s,
        )

    def check_no_leaks(self) -> None:
        """Both pools whole, no request or hand-off left, nothing held in either ledger."""
        for e in (self.p, self.d):
            assert not e.scheduler.requests
            assert e.blocks.num_free_blocks() == e.blocks.num_usable_blocks
            c = e.scheduler_connector
            if isinstance(c, PDOffloadConnector):
                manager = c.offload.scheduler.manager
                assert manager.num_live_transfers() == 0
                assert all(not refs for refs in manager.cpu_refs())
                assert len(manager.pd_holds) == 0
                assert not manager.pd_holds.refs()
                c = c.pd
            assert isinstance(c, PDConnector)
            assert c.driver.manager.num_live == 0
            assert c.driver.manager.ledger.num_blocks == 0
            assert not c.driver.busy()

    def close(self) -> None:
        self.p.shutdown()
        self.d.shutdown()
