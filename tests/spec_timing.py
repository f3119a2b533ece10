"""Deterministic step times for speculative decoding tests: the controller
(engine/spec_decode/controller.py) learns what a step costs from the engine's clock, so a test
whose outcome depends on whether it speculates must not depend on how busy the machine is."""

from __future__ import annotations

from typing import Callable

Cost = Callable[[int], float]


def linear(slope: float) -> Cost:
    """T(R) = 1 + slope (R - 1): a step's cost grows by `slope` of a one-row step per row."""
    return lambda rows: 1.0 + slope * (rows - 1)


class FakeClock:
    """Engine time that advances only when the runner runs a step: by `cost(rows)`."""

    def __init__(self, cost: Cost) -> None:
        self.now = 0.0
        self.cost = cost

    def __call__(self) -> float:
        return self.now


#: A row costs a quarter of a one-row step (the controller's own prior).
QUARTER_PER_ROW = linear(0.25)


def fake_step_times(llm, cost: Cost = QUARTER_PER_ROW) -> None:
    """Makes `llm`'s speculator clock advance only when its runner (or tensor-parallel
    executor) runs a step, by `cost(R)` for a step of R query rows (drafts included)."""
    eng = llm.llm_engine
    clock = FakeClock(cost)
    eng.speculator.clock = clock
    execute = eng.runner.execute

    def timed(out, tables, propose=None):
        result = execute(out, tables, propose)
        clock.now += cost(out.num_batched_tokens + sum(map(len, out.drafts.values())))
        return result

    eng.runner.execute = timed
