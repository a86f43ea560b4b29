"""Soak benchmark: the reference engine with kvflow's offload connector under random traffic and
injected faults, checking kvflow's guarantees (docs/guarantees.md) the whole time.

The engine (tiny model, CPU) serves rounds of random requests that share prompt prefixes, on a
GPU pool small enough to evict and preempt, with the host backend under a fault injector:

- copies fail on the device (a failed load leaves garbage in its GPU blocks; a load landing in
  parts by layer may fail after its first part landed), run slow, or report their completion
  late (so completions arrive out of submission order);
- a second tensor-parallel rank (simulated) reports each transfer late, and now and then reports
  a copy failed that rank 0 did;
- the CPU prefix cache is reset with transfers in flight; preemptions come from the small pool;
- between steps, bad inputs are thrown at every engine-facing call (ids out of range or twice,
  unknown requests, replayed plans, bad reports): each must raise a ``KVFlowError`` and leave
  the connector's state exactly as it was.

Checked continuously: every CPU block a copy touches is referenced (never freed under a copy);
a store is never committed before the late rank reported it; a load never starts before an
earlier store of its GPU blocks finished; a load reads a CPU block exactly as its last store
wrote it and leaves the GPU block byte-identical to it; the manager's references equal the
pools' counts after every step; when idle, no reference is left and both pools are whole; every
request's greedy output equals the same round's on an engine without offload. Any violation
makes the exit status 1.

The engine's float32 matmuls on the CPU round differently with a batch's shape (logits move by
about 2e-5), and the two engines batch a request differently once offload changes what is
computed when; so two outputs that first differ where the model's own float64 logits of the two
tokens are within ``NEAR_TIE`` are a near tie, counted and listed but not a violation. A bad KV
block shows as an output that differs where the model had a clear answer, and as a reload check.

    PYTHONPATH=src python scripts/soak.py --duration 600 --json soak.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
from attrs import asdict
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvflow.connector.api import KVCacheConfig, KVConnectorOutput
from kvflow.connector.config import EAGER_STORE_INTERVAL, OffloadConfig
from kvflow.connector.offload import OffloadConnector
from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.protocol import StepPlan, StepReport, TransferSpec
from kvflow.core.requests import (
    CachedRequest,
    KVRequest,
    NewRequest,
    SchedulerOutput,
)
from kvflow.core.transfer import Direction
from kvflow.engine.engine import Engine, EngineConfig, RequestResult, block_bytes_per_group
from kvflow.engine.model import LlamaForCausalLM, build_model, model_config
from kvflow.errors import KVFlowError

try:  # imported as part of the scripts package (tests), or run as a file
    from scripts.soak_faults import FaultyHost, LateRank, Tally
except ImportError:
    from soak_faults import FaultyHost, LateRank, Tally  # type: ignore[import-not-found,no-redef]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policy",
        choices=("eager", "eager1", "lazy", "both"),
        default="both",
        help="store policy (eager1: eager with a store each step, eager_store_interval=1); "
        "both: the duration split between the three",
    )
    p.add_argument(
        "--worker-loop",
        choices=("inline", "thread", "both"),
        default="both",
        help="where the worker runtime's loop runs; both: the duration split between them",
    )
    p.add_argument(
        "--ranks",
        choices=("1", "2", "both"),
        default="both",
        help="tensor-parallel ranks: 2 (a simulated late second rank) or 1 (loads fenced while "
        "the engine is idle); both: the duration split between them",
    )
    p.add_argument("--gpu-blocks", type=int, default=28, help="engine GPU blocks (small: evicts)")
    p.add_argument("--cpu-blocks", type=int, default=48, help="CPU tier blocks (small: evicts)")
    p.add_argument("--p-fail", type=float, default=0.05, help="store batches that fail")
    p.add_argument("--p-fail-load", type=float, default=0.15, help="load batches that fail")
    p.add_argument("--p-slow", type=float, default=0.1, help="copy batches slowed 1-3 ms")
    p.add_argument("--p-late", type=float, default=0.2, help="completions reported late")
    p.add_argument("--p-rank-fail", type=float, default=0.02, help="rank 1 fails a copy")
    p.add_argument("--p-reset", type=float, default=0.02, help="steps that reset the CPU cache")
    p.add_argument("--p-bad", type=float, default=0.2, help="steps followed by a bad input")
    p.add_argument(
        "--sabotage",
        choices=("none", "corrupt-cpu"),
        default="none",
        help="corrupt-cpu: flip a byte of some stored CPU blocks (the checks must catch it)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    return p.parse_args(argv)


NEAR_TIE = 1e-3
"""Largest float64 logit gap between two tokens that the batch's rounding may swap (about 50
times how far float32 logits move with the batch's shape)."""


# The traffic's bounds (``Soak._batch``): a prompt is a shared prefix or the last
# ``HISTORY_TOKENS`` of a finished conversation, plus a fresh tail; then an output.
PREFIX_TOKENS = (8, 24)
HISTORY_TOKENS = 40
TAIL_TOKENS = (1, 10)
OUTPUT_TOKENS = (1, 12)
MAX_SEQUENCE = max(PREFIX_TOKENS[1], HISTORY_TOKENS) + TAIL_TOKENS[1] + OUTPUT_TOKENS[1]
"""The longest prompt plus output the traffic makes: what the judge's engine must hold."""


class TieJudge:
    """The model in float64 with a batch of one: how far apart the logits of two outputs' first
    differing tokens are, computed from the tokens both share."""

    BLOCK_SIZE = 4

    def __init__(self, model: LlamaForCausalLM, max_sequence: int = MAX_SEQUENCE) -> None:
        self.max_sequence = max_sequence
        self.engine = Engine(
            model.config,
            EngineConfig(
                block_size=self.BLOCK_SIZE,
                # One request at a time, the whole sequence in one step, and the null block.
                num_gpu_blocks=-(-max_sequence // self.BLOCK_SIZE) + 2,
                max_num_batched_tokens=max_sequence,
                record_first_logits=True,
            ),
            model=copy.deepcopy(model).double(),
        )

    def margin(
        self, prompt: Sequence[int], want: Sequence[int], got: Sequence[int]
    ) -> tuple[int, float] | None:
        """The first token where ``got`` differs from ``want`` and the float64 logit gap between
        the two tokens there; None when neither differs before the shorter ends."""
        k = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
        if k is None:
            return None
        tokens = [*prompt, *want[:k]]
        if len(tokens) + 1 > self.max_sequence:
            raise ValueError(
                f"tie judge: {len(tokens)} tokens and one more exceed its {self.max_sequence}"
            )
        rid = self.engine.add_request(tokens, 1)
        while self.engine.has_unfinished():
            self.engine.step()
        logits = self.engine.take_result(rid).first_logits
        assert logits is not None
        return k, abs(float(logits[want[k]]) - float(logits[got[k]]))


class Soak:
    """One engine with kvflow, one without, the same rounds of random requests on both."""

    def __init__(
        self,
        args: argparse.Namespace,
        model: LlamaForCausalLM,
        tally: Tally,
        policy: str,
        worker_loop: str,
        seed: int,
        ranks: int = 2,
    ) -> None:
        self.args = args
        self.policy = policy
        self.worker_loop = worker_loop
        self.ranks = ranks
        self.rng = random.Random(seed)
        self.tally = tally
        cfg = model_config("tiny")
        self.vocab = cfg.vocab_size
        self.engine_config = EngineConfig(
            block_size=4, num_gpu_blocks=args.gpu_blocks, max_num_batched_tokens=48
        )
        self.reference = Engine(cfg, self.engine_config, model=model)
        self.backend = FaultyHost(
            rng=random.Random(seed + 1),
            tally=self.tally,
            p_fail=args.p_fail,
            p_fail_load=args.p_fail_load,
            p_slow=args.p_slow,
            lazy=policy == "lazy",
            corrupt=args.sabotage == "corrupt-cpu",
            p_late=args.p_late,
        )
        self.conn: OffloadConnector | None = None
        self.late: LateRank | None = None
        self.view: GpuCacheView | None = None
        self.engine = Engine(
            cfg, self.engine_config, model=model, connector_factory=self._connector
        )
        assert self.conn is not None
        assert self.late is not None
        manager = self.conn.scheduler.manager
        pools = manager.cpu_pools
        self.backend.cpu_refs = lambda g, b: pools[g].blocks[b].ref_cnt
        view = self.view
        assert view is not None
        self.backend.gpu_held = lambda b: not view.is_free(b)
        self.prefixes: list[list[int]] = [
            [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(*PREFIX_TOKENS))]
            for _ in range(10)
        ]
        self.history: list[list[int]] = []  # finished conversations, continued later
        self.judge: TieJudge | None = None  # built at the first output that differs

    def _connector(self, kv: KVCacheConfig, view: GpuCacheView) -> tuple[Any, Any]:
        dtype = next(self.reference.model.parameters()).dtype
        block_bytes = block_bytes_per_group(self.reference.model_config, kv, dtype)
        config = OffloadConfig(
            cpu_bytes=self.args.cpu_blocks * sum(block_bytes),
            store_policy="eager" if self.policy == "eager1" else self.policy,
            eager_store_interval=1 if self.policy == "eager1" else EAGER_STORE_INTERVAL,
            lazy_watermark=8,
            backend="host",
            world_size=self.ranks,
            worker_loop=self.worker_loop,
            # With one rank, fenced loads run: whole with the worker loop on a thread, in two
            # parts by layer with the inline loop.
            load_parts=2 if self.ranks == 1 and self.worker_loop == "inline" else 1,
        )
        self.view = view
        self.conn = OffloadConnector.build(
            config, kv, block_bytes, gpu_view=view, backend=self.backend
        )
        self.late = LateRank(
            self.conn.scheduler,
            random.Random(self.rng.random()),
            self.args.p_rank_fail,
            self.tally,
            self.ranks,
        )
        return self.late, self.conn.worker

    # -- traffic ------------------------------------------------------------------------------
    def _batch(self) -> list[tuple[list[int], int]]:
        """Requests on a shared prefix, or continuing an earlier conversation (its prompt and
        output), whose blocks the small GPU pool has likely evicted since: CPU hits."""
        out = []
        for _ in range(self.rng.randint(2, 7)):
            if self.history and self.rng.random() < 0.4:
                prefix = self.rng.choice(self.history)[-HISTORY_TOKENS:]
            else:
                prefix = self.rng.choice(self.prefixes)
            tail = [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(*TAIL_TOKENS))]
            out.append((prefix + tail, self.rng.randint(*OUTPUT_TOKENS)))
        return out

    def round(self) -> None:
        batch = self._batch()
        want = {}
        ids = [self.reference.add_request(p, n) for p, n in batch]
        while self.reference.has_unfinished():
            self.reference.step()
        for rid in ids:
            want[rid] = self.reference.take_result(rid).output_token_ids
        got_ids = [
            self.engine.add_request(p, n, request_id=rid)
            for rid, (p, n) in zip(ids, batch, strict=True)
        ]
        self.tally.requests += len(got_ids)
        steps = 0
        while self.engine.has_unfinished():
            self.engine.step()
            steps += 1
            self.tally.steps += 1
            self._check_refs_match()
            if self.rng.random() < self.args.p_reset:
                self._reset()
            if self.rng.random() < self.args.p_bad:
                self._bad_input()
            if steps > 20_000:
                self.tally.violation("a round did not finish in 20000 steps")
                return
        for rid, (prompt, _) in zip(got_ids, batch, strict=True):
            result = self.engine.take_result(rid)
            out = result.output_token_ids
            self.history = [*self.history[-31:], [*prompt, *out]]
            self.tally.outputs_checked += 1
            if out != want[rid]:
                self._output_differs(rid, prompt, want[rid], result)
        self._check_idle()
        self.tally.rounds += 1

    def _output_differs(
        self, rid: str, prompt: Sequence[int], want: Sequence[int], result: RequestResult
    ) -> None:
        """A near tie if the first differing token's float64 logits are within ``NEAR_TIE`` of
        the reference's token, else a violation; either way what the request went through (to
        tell a bad load from a bad store or resume)."""
        out = result.output_token_ids
        what = (
            f"{rid}: output {out} differs from no-offload {want} (prompt "
            f"{result.prompt_len} tokens, GPU hit {result.gpu_cached_tokens}, loaded "
            f"{result.external_loaded_tokens}, recomputed {result.recomputed_tokens}, "
            f"preempted {result.num_preemptions} times"
        )
        if self.judge is None:
            self.judge = TieJudge(self.reference.model)
        gap = self.judge.margin(prompt, want, out)
        if gap is None:
            self.tally.violation(f"{what})")
        elif gap[1] <= NEAR_TIE:
            self.tally.near_ties.append(
                f"{what}; token {gap[0]}: float64 logits {gap[1]:.1e} apart)"
            )
        else:
            self.tally.violation(f"{what}; token {gap[0]}: float64 logits {gap[1]:.3g} apart)")

    def _reset(self) -> None:
        assert self.conn is not None
        live = self.conn.scheduler.manager.num_live_transfers()
        done = self.conn.scheduler.reset_cache()
        self.tally.faults["resets_with_copies_in_flight" if live else "resets_idle"] += 1
        if not done and not live:
            self.tally.violation("reset_cache with nothing in flight did not complete")

    # -- invariants ---------------------------------------------------------------------------
    def _check_refs_match(self) -> None:
        assert self.conn is not None
        manager = self.conn.scheduler.manager
        held = manager.cpu_refs()
        self.tally.checks["ref_audits"] += 1
        for g, pool in enumerate(manager.cpu_pools):
            for b in pool.blocks:
                if b.ref_cnt != held[g].get(b.block_id, 0):
                    self.tally.violation(
                        f"CPU block {g}/{b.block_id}: ref {b.ref_cnt}, manager holds "
                        f"{held[g].get(b.block_id, 0)}"
                    )

    def _check_idle(self) -> None:
        assert self.conn is not None
        manager = self.conn.scheduler.manager
        self.tally.checks["idle_audits"] += 1
        if manager.num_live_transfers():
            self.tally.violation(f"idle with {manager.num_live_transfers()} live transfers")
        for pool in manager.cpu_pools:
            if pool.num_free_blocks != pool.num_blocks:
                self.tally.violation(f"{pool.name}: {pool.num_blocks - pool.num_free_blocks} held")
        if self.engine.blocks.num_free_blocks() != self.engine.blocks.num_usable_blocks:
            self.tally.violation("idle engine's GPU pool is not whole")
        if self.conn.worker.runtime.runtime.in_flight:
            self.tally.violation("idle worker has copies in flight")

    def _snapshot(self) -> tuple[object, ...]:
        assert self.conn is not None
        manager = self.conn.scheduler.manager
        return (
            asdict(manager.stats()),
            [[b.ref_cnt for b in pool.blocks] for pool in manager.cpu_pools],
            manager.num_live_transfers(),
            # Not ``in_flight``: with the thread loop a copy may finish between two snapshots.
            self.conn.worker.runtime.runtime.tracked_transfers,
            self.engine.blocks.num_free_blocks(),
        )

    def _bad_input(self) -> None:
        """One bad input to a random engine-facing call: it must raise a KVFlowError and change
        nothing."""
        assert self.conn is not None
        assert self.late is not None
        sched, worker = self.conn.scheduler, self.conn.worker
        n = self.engine_config.num_gpu_blocks
        running = list(self.engine.scheduler.requests.values())
        fresh = KVRequest.from_prompt(f"bad-{self.tally.steps}", [1, 2, 3, 4, 5])
        far = 10**9 + self.tally.steps
        cases: dict[str, Callable[[], object]] = {
            "alloc_id_out_of_range": lambda: sched.update_state_after_alloc(
                fresh, ((1, n + 3),), 0
            ),
            "alloc_id_twice": lambda: sched.update_state_after_alloc(fresh, ((3, 3),), 0),
            "new_request_negative_id": lambda: sched.build_connector_meta(
                SchedulerOutput(far, new_requests=(NewRequest("bad-new", ((-1, 2),), 0, 8),))
            ),
            "new_request_id_twice": lambda: sched.build_connector_meta(
                SchedulerOutput(far, new_requests=(NewRequest("bad-new", ((5, 5),), 0, 8),))
            ),
            "unknown_running_request": lambda: sched.build_connector_meta(
                SchedulerOutput(far, cached_requests=(CachedRequest("ghost", ((),), 0, 1),))
            ),
            "plan_id_out_of_range": lambda: worker.bind_connector_metadata(
                StepPlan(
                    far,
                    loads=(TransferSpec(far, "bad", Direction.LOAD, ((n + 1,),), ((0,),)),),
                )
            ),
            "report_for_unknown_transfer": lambda: sched.update_connector_output(
                KVConnectorOutput(reports=(StepReport(0, completed=(far,)),))
            ),
            "negative_computed_tokens": lambda: sched.get_num_new_matched_tokens(fresh, -1),
        }
        if self.late.last_plan is not None:
            plan = self.late.last_plan
            cases["replayed_plan"] = lambda: worker.bind_connector_metadata(plan)
        if running:
            req = self.rng.choice(running)
            cases["finished_with_wrong_groups"] = lambda: sched.request_finished(req, ((1,), (2,)))
        kind = self.rng.choice(sorted(cases))
        before = self._snapshot()
        try:
            cases[kind]()
        except KVFlowError:
            self.tally.rejected[kind] += 1
        else:
            self.tally.violation(f"bad input {kind} was accepted")
            return
        if self._snapshot() != before:
            self.tally.violation(f"bad input {kind} changed the connector's state")

    def close(self) -> None:
        self.engine.shutdown()
        self.reference.shutdown()


def _segments(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    policies = ["eager", "eager1", "lazy"] if args.policy == "both" else [args.policy]
    loops = ["inline", "thread"] if args.worker_loop == "both" else [args.worker_loop]
    ranks = [2, 1] if args.ranks == "both" else [int(args.ranks)]
    return [(p, w, r) for r in ranks for p in policies for w in loops]


def run(args: argparse.Namespace, console: Console) -> Tally:
    """Each (policy, worker loop) segment gets an equal share of the duration and an engine
    pair of its own; one tally for all."""
    torch.manual_seed(args.seed)
    model = build_model(model_config("tiny"), seed=args.seed)
    tally = Tally()
    segments = _segments(args)
    share = args.duration / len(segments)
    start = time.monotonic()  # noqa: TID251 - a script's wall clock, not kvflow's
    with Progress(
        TextColumn("soak"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("", total=args.duration)
        for k, (policy, loop, ranks) in enumerate(segments):
            soak = Soak(args, model, tally, policy, loop, args.seed + 100 * k, ranks)
            tally.segment = f"{policy}/{loop}/{ranks}"
            rounds = tally.rounds
            try:
                end = share * (k + 1)
                while (elapsed := time.monotonic() - start) < end:  # noqa: TID251
                    soak.round()
                    progress.update(
                        task,
                        completed=elapsed,
                        description=(
                            f"{policy}/{loop}/{ranks} ranks: {tally.requests} requests, {tally.steps} steps, "
                            f"{sum(tally.faults.values())} faults, "
                            f"{sum(tally.rejected.values())} bad inputs rejected, "
                            f"{len(tally.violations)} violations"
                        ),
                    )
            finally:
                soak.close()
            tally.faults["preemptions"] += soak.engine.stats.preemptions
            tally.segments[f"{policy}/{loop}/{ranks}"] = tally.rounds - rounds
            assert soak.conn is not None
            stats = soak.conn.scheduler.manager.stats()
            tally.transfers["settled_failed"] += stats.failed_transfers
            tally.transfers["abandoned"] += stats.abandoned_transfers
            tally.transfers["blocks_stored_committed"] += stats.blocks_stored
            tally.transfers["blocks_loaded_committed"] += stats.blocks_loaded
            tally.transfers["store_blocks_skipped_cpu_full"] += stats.skipped_stores
    return tally


def report(tally: Tally, args: argparse.Namespace, wall_s: float, console: Console) -> Table:
    segments = ", ".join(f"{p}/{w}/{r}" for p, w, r in _segments(args))
    table = Table(title=f"kvflow soak: {wall_s:.0f} s, seed {args.seed}, {segments}")
    table.add_column("what")
    table.add_column("count", justify="right")
    rows: list[tuple[str, object]] = [
        ("rounds", tally.rounds),
        ("requests (outputs checked vs no offload)", f"{tally.requests} ({tally.outputs_checked})"),
        ("engine steps", tally.steps),
    ]
    rows += [(f"rounds: {k}", v) for k, v in sorted(tally.segments.items())]
    rows += [(f"transfers: {k}", v) for k, v in sorted(tally.transfers.items())]
    rows += [(f"fault: {k}", v) for k, v in sorted(tally.faults.items())]
    rows += [(f"bad input rejected: {k}", v) for k, v in sorted(tally.rejected.items())]
    rows += [(f"check: {k}", v) for k, v in sorted(tally.checks.items())]
    rows.append(
        (
            f"outputs differing at a near tie (float64 logits ≤ {NEAR_TIE:g} apart)",
            len(tally.near_ties),
        )
    )
    rows.append(("violations", len(tally.violations)))
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    for v in tally.near_ties[:20]:
        console.print(f"[yellow]near tie[/yellow]: {v}")
    for v in tally.violations[:20]:
        console.print(f"[red]violation[/red]: {v}")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    torch.set_num_threads(1)
    console = Console()
    t0 = time.monotonic()  # noqa: TID251
    tally = run(args, console)
    wall_s = time.monotonic() - t0  # noqa: TID251
    report(tally, args, wall_s, console)
    if args.json is not None:
        figures = {
            "duration_s": args.duration,
            "wall_s": wall_s,
            "seed": args.seed,
            "rounds": tally.rounds,
            "requests": tally.requests,
            "outputs_checked": tally.outputs_checked,
            "steps": tally.steps,
            "transfers": dict(tally.transfers),
            "faults": dict(tally.faults),
            "rejected": dict(tally.rejected),
            "checks": dict(tally.checks),
            "segments": dict(tally.segments),
            "near_tie": NEAR_TIE,
            "near_ties": tally.near_ties,
            "violations": tally.violations,
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if tally.violations else 0


if __name__ == "__main__":
    sys.exit(main())
