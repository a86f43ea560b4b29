"""A multi-round QA workload like LMCache's: users chatting in rounds over a shared system prompt.

Every user's request in round ``r`` is the system prompt, the user's whole history (each earlier
question and the model's answer to it) and a new question; answers are short. Token ids come from
a seeded generator, so a workload is identical across runs. Rounds run one after another, the
users of a round concurrently; with a GPU cache smaller than ``working_set_tokens`` the histories
of earlier users are evicted before their next round, which is what an offload tier recovers.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

from attrs import field, frozen

from kvflow.engine.engine import Engine, GenerationRequest, RequestResult
from kvflow.errors import ConfigError


@frozen
class MultiRoundQA:
    """Shape of the workload; every length in tokens."""

    num_users: int = 4
    num_rounds: int = 3
    system_prompt_len: int = 64
    first_question_len: int = 48
    question_len: int = 16
    answer_len: int = 8
    vocab_size: int = 1024
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        for name in ("num_users", "num_rounds", "question_len", "answer_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"workload: {name} must be positive")
        if self.system_prompt_len < 0 or self.first_question_len < 0:
            raise ConfigError("workload: prompt lengths must not be negative")

    def prompt_len(self, round_: int) -> int:
        """Prompt tokens of any user's request in round ``round_`` (0-based)."""
        return (
            self.system_prompt_len
            + self.first_question_len
            + round_ * (self.question_len + self.answer_len)
            + self.question_len
        )

    @property
    def working_set_tokens(self) -> int:
        """Tokens of KV all users' histories reach by the last round (system prompt once)."""
        per_user = self.prompt_len(self.num_rounds - 1) + self.answer_len - self.system_prompt_len
        return self.system_prompt_len + self.num_users * per_user

    def _tokens(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.vocab_size) for _ in range(n)]

    def system_prompt(self) -> list[int]:
        return self._tokens(random.Random(f"{self.seed}/system"), self.system_prompt_len)

    def question(self, user: int, round_: int) -> list[int]:
        rng = random.Random(f"{self.seed}/q/{user}/{round_}")
        extra = self.first_question_len if round_ == 0 else 0
        return self._tokens(rng, extra + self.question_len)


@frozen
class RoundRecord:
    """One request of the workload and what it measured."""

    user: int
    round: int
    result: RequestResult

    @property
    def ttft_s(self) -> float:
        return self.result.ttft_s


def _records(values: Iterable[RoundRecord]) -> tuple[RoundRecord, ...]:
    return tuple(values)


@frozen
class WorkloadResult:
    records: tuple[RoundRecord, ...] = field(converter=_records)
    wall_s: float

    def ttft_percentile(self, q: float, round_: int | None = None) -> float:
        """TTFT percentile (0 < q < 100) over all requests or one round."""
        values = sorted(r.ttft_s for r in self.records if round_ is None or r.round == round_)
        if not values:
            raise ConfigError("no requests to take a percentile of")
        if len(values) == 1:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]

    def outputs(self) -> dict[tuple[int, int], tuple[int, ...]]:
        return {(r.user, r.round): r.result.output_token_ids for r in self.records}

    def total(self, name: str) -> int:
        """Sum of an integer ``RequestResult`` field over every request."""
        return sum(int(getattr(r.result, name)) for r in self.records)


def run_multi_round(
    engine: Engine,
    workload: MultiRoundQA,
    *,
    on_round_done: Callable[[int, Sequence[RoundRecord]], None] | None = None,
    answers: Mapping[tuple[int, int], Sequence[int]] | None = None,
) -> WorkloadResult:
    """Run the workload round by round on ``engine``; each answer joins its user's history.

    ``on_round_done(round, records)`` is called after each round (e.g. to advance a progress bar).
    ``answers``, by ``(user, round)``: what joins the histories instead of this engine's answers,
    so that every prompt is the one another run saw (a reference replaying that run).
    """
    if workload.vocab_size > engine.model_config.vocab_size:
        raise ConfigError(
            f"workload vocab {workload.vocab_size} exceeds the model's {engine.model_config.vocab_size}"
        )
    start = engine.clock()
    system = workload.system_prompt()
    histories: list[list[int]] = [list(system) for _ in range(workload.num_users)]
    records: list[RoundRecord] = []
    for rnd in range(workload.num_rounds):
        requests = []
        for user in range(workload.num_users):
            histories[user] += workload.question(user, rnd)
            requests.append(
                GenerationRequest(
                    histories[user], workload.answer_len, request_id=f"u{user}-r{rnd}"
                )
            )
        results = engine.run_to_completion(requests)
        done = [RoundRecord(user, rnd, res) for user, res in enumerate(results)]
        for rec in done:
            answer = None if answers is None else answers.get((rec.user, rnd))
            if answers is not None and answer is None:
                raise ConfigError(f"answers has no answer of user {rec.user} in round {rnd}")
            histories[rec.user] += list(rec.result.output_token_ids if answer is None else answer)
        records += done
        if on_round_done is not None:
            on_round_done(rnd, done)
    return WorkloadResult(records, engine.clock() - start)


__all__ = ["MultiRoundQA", "RoundRecord", "WorkloadResult", "run_multi_round"]
