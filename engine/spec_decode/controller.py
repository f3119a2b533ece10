"""How many tokens each sequence proposes per step: the choice that maximises expected output
tokens per second, from each sequence's acceptance rate and the measured cost of a step.

Acceptance (`Acceptance`): per sequence, alpha estimates the probability that a proposal is
accepted given that the ones before it were. Each verification of m proposals with a accepted
adds a accepted trials and, when a < m, one rejection, to counts that decay by `ALPHA_DECAY`
per verification and start at `PRIOR_ACCEPTED` / `PRIOR_REJECTED` (alpha = 0.5); alpha is
accepted / (accepted + rejected), the maximum-likelihood rate of a geometric run.

Cost (`StepCosts`): T(R), the seconds of a target step with R query rows in all, learnt from
the engine's own step times: per R an average of the step times (each time clipped to
[1/`CLIP`, `CLIP`] times the average before it, so one stall moves it little; weight
`COST_WEIGHT`). Small steps (R <= `FIT_MAX_ROWS`, the rows the quantized block matmul serves)
follow one line, T(R) = T(1) (1 + rho (R - 1)), once T(1) has `MIN_COUNT` measurements: rho,
the cost of one more row relative to a one-row step, is the weighted median of the slopes
(T(R) / T(1) - 1) / (R - 1) of every measured R in 2..`FIT_MAX_ROWS` (weighted by its
measurements, at most `MAX_WEIGHT`) and of a prior slope `ROW_COST_PRIOR` (weight
`PRIOR_WEIGHT`; a step over 4-6 rows costs about twice a one-row step on a weight-bound CPU
decode). One line through a median keeps a size measured rarely, during a stall, from looking
dear forever (it would never be tried again). A larger R uses its own
average after `MIN_COUNT` measurements, else the nearest measured size scaled along the line.
D, the seconds of proposing one token, is an average of each proposal round's time over its
longest proposal (0 before any round: n-gram lookups cost ~0).

Rule (`SpecController.choose`): for a sequence with acceptance alpha, whose previous step
shared the batch with B other query rows yielding N other tokens, proposing i tokens yields
E(i) = (1 - alpha^(i+1)) / (1 - alpha) expected tokens (the accepted ones plus the target's
own; E(0) = 1) at a step cost of T(B + 1 + i) + i D, so the step's rate is
rate(i) = (N + E(i)) / (T(B + 1 + i) + i D). The controller takes the i in 0..k with the
highest rate and speculates only when rate(i) >= (1 + `MIN_GAIN`) rate(0); at concurrency 1
that is E(i) / T(1 + i) against 1 / T(1).

Probes: a sequence that does not speculate has no new acceptance evidence, so after
`probe_interval` of its output tokens it proposes `PROBE_K` token (a cheap step: one more row);
the interval starts at `PROBE_MIN` and doubles after each probe that does not bring speculation
back, up to `PROBE_MAX`; once the rule speculates again it starts over at `PROBE_MIN`. A request
whose output starts copying gets speculation back within `PROBE_MAX` tokens, and one that never
copies pays one extra row every 64 tokens or so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

ALPHA_DECAY = 0.8
PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0
MIN_GAIN = 0.02
PROBE_K = 1
PROBE_MIN = 8
PROBE_MAX = 64
ROW_COST_PRIOR = 0.25
COST_WEIGHT = 0.2
CLIP = 2.0
MIN_COUNT = 3
FIT_MAX_ROWS = 8
MAX_WEIGHT = 8
PRIOR_WEIGHT = 2.0


def expected_tokens(alpha: float, num_proposed: int) -> float:
    """E(i): the expected tokens a verification of `num_proposed` proposals emits when each is
    accepted with probability `alpha` given the ones before it (the target's own token
    included): (1 - alpha^(i+1)) / (1 - alpha), i + 1 at alpha = 1."""
    if alpha >= 1.0:
        return num_proposed + 1.0
    return (1.0 - alpha ** (num_proposed + 1)) / (1.0 - alpha)


@dataclass
class Acceptance:
    """One sequence's decayed counts of accepted proposals and of rejections (module docstring)."""

    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED

    @property
    def alpha(self) -> float:
        """The estimated probability that a proposal is accepted after accepted ones."""
        return self.accepted / (self.accepted + self.rejected)

    def update(self, proposed: int, accepted: int) -> None:
        """Counts one verification of `proposed` proposals of which the first `accepted` were."""
        self.accepted = ALPHA_DECAY * self.accepted + accepted
        self.rejected = ALPHA_DECAY * self.rejected + (1.0 if accepted < proposed else 0.0)


class StepCosts:
    """T(R), the seconds of a step with R query rows, and D, the seconds of proposing one token,
    learnt from observations (module docstring)."""

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self.propose_seconds = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """One step of `rows` query rows took `seconds` (the proposer's time excluded)."""
        if rows <= 0 or not seconds > 0:
            return
        old = self._mean.get(rows)
        if old is None:
            self._mean[rows] = seconds
        else:
            clipped = min(max(seconds, old / CLIP), old * CLIP)
            self._mean[rows] = (1 - COST_WEIGHT) * old + COST_WEIGHT * clipped
        self._count[rows] = self._count.get(rows, 0) + 1

    def observe_proposal(self, seconds: float, longest: int) -> None:
        """One proposal round whose longest proposal has `longest` tokens took `seconds`."""
        if longest <= 0 or seconds < 0:
            return
        per_token = seconds / longest
        if self.propose_seconds == 0.0:
            self.propose_seconds = per_token
        else:
            self.propose_seconds = ((1 - COST_WEIGHT) * self.propose_seconds
                                    + COST_WEIGHT * per_token)

    def row_cost(self) -> float:
        """rho: the weighted median of the measured slopes (T(R) / T(1) - 1) / (R - 1), R in
        2..FIT_MAX_ROWS, and the prior slope; ROW_COST_PRIOR until T(1) is measured MIN_COUNT
        times."""
        if self._count.get(1, 0) < MIN_COUNT:
            return ROW_COST_PRIOR
        base = self._mean[1]
        points = [(ROW_COST_PRIOR, PRIOR_WEIGHT)]
        points += [((self._mean[r] / base - 1.0) / (r - 1), min(self._count[r], MAX_WEIGHT))
                   for r in range(2, FIT_MAX_ROWS + 1) if r in self._mean]
        points.sort()
        half, seen = sum(w for _, w in points) / 2, 0.0
        for slope, weight in points:
            seen += weight
            if seen >= half:
                return max(0.0, slope)
        raise AssertionError("unreachable: the weights sum to more than half of themselves")

    def seconds(self, rows: int) -> Optional[float]:
        """T(rows) (module docstring): on the fitted line for small steps once T(1) is known,
        else the size's own average after MIN_COUNT measurements, else the nearest measured
        size scaled along the line; None before any measurement."""
        rho = self.row_cost()
        if rows <= FIT_MAX_ROWS and self._count.get(1, 0) >= MIN_COUNT:
            return self._mean[1] * (1 + rho * (rows - 1))
        if self._count.get(rows, 0) >= MIN_COUNT:
            return self._mean[rows]
        if not self._mean:
            return None
        trusted = [r for r in self._mean if self._count[r] >= MIN_COUNT] or list(self._mean)
        anchor = min(trusted, key=lambda r: (abs(r - rows), r))
        return self._mean[anchor] * (1 + rho * (rows - 1)) / (1 + rho * (anchor - 1))

    def step_seconds(self, rows: int) -> float:
        """T(rows), or 1 + ROW_COST_PRIOR (rows - 1) (in units of a one-row step) before any
        measurement."""
        t = self.seconds(rows)
        return t if t is not None else 1 + ROW_COST_PRIOR * (rows - 1)

    def draft_seconds(self) -> float:
        """D, in the units of `step_seconds` (0 before any step was measured)."""
        return self.propose_seconds if self._mean else 0.0


@dataclass
class _SeqState:
    """One sequence's acceptance, probe schedule and share of its previous step."""

    acceptance: Acceptance = field(default_factory=Acceptance)
    probe_interval: int = PROBE_MIN
    next_probe: Optional[int] = None  # output length at which to probe; None while speculating
    last_rows: int = 0  # query rows it had in the previous step
    last_tokens: int = 0  # tokens it emitted in the previous step


class SpecController:
    """Per-sequence choice of how many tokens to propose (module docstring).

    The engine calls `choose` when it schedules a decoding sequence, `record` after each
    verification, `end_step` after each step with its rows and time, `forget` when a sequence
    finishes. `chosen` counts the choices by k (index 0: no speculation, probes counted at
    `PROBE_K`), `num_probes` the probes."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.costs = StepCosts()
        self._seqs: dict[int, _SeqState] = {}
        self._step_rows = 0
        self._step_tokens = 0
        self.chosen = [0] * (max_k + 1)
        self.num_probes = 0

    def alpha(self, seq_id: int) -> float:
        """The sequence's estimated acceptance rate (the prior for an unknown one)."""
        state = self._seqs.get(seq_id)
        return (state.acceptance if state is not None else Acceptance()).alpha

    def best_k(self, alpha: float, other_rows: int = 0, other_tokens: int = 0) -> int:
        """The rule: the i in 0..max_k with the highest rate (N + E(i)) / (T(B + 1 + i) + i D)
        (B = `other_rows`, N = `other_tokens`), or 0 when it beats rate(0) by less than
        MIN_GAIN."""
        costs = self.costs
        draft = costs.draft_seconds()

        def rate(i: int) -> float:
            step = costs.step_seconds(other_rows + 1 + i) + i * draft
            return (other_tokens + expected_tokens(alpha, i)) / step

        plain = rate(0)
        best = max(range(1, self.max_k + 1), key=rate, default=0)
        if best and rate(best) >= (1 + MIN_GAIN) * plain:
            return best
        return 0

    def choose(self, seq_id: int, num_output_tokens: int) -> int:
        """How many tokens `seq_id` proposes this step (0..max_k), its output having
        `num_output_tokens` tokens: the rule, or a probe of PROBE_K when the rule says 0 and the
        sequence's probe is due."""
        state = self._seqs.setdefault(seq_id, _SeqState())
        other_rows = max(0, self._step_rows - state.last_rows)
        other_tokens = max(0, self._step_tokens - state.last_tokens)
        k = self.best_k(state.acceptance.alpha, other_rows, other_tokens)
        if k > 0:
            state.next_probe, state.probe_interval = None, PROBE_MIN
        elif state.next_probe is None:
            state.next_probe = num_output_tokens + state.probe_interval
        elif num_output_tokens >= state.next_probe:
            state.probe_interval = min(PROBE_MAX, 2 * state.probe_interval)
            state.next_probe = num_output_tokens + state.probe_interval
            self.num_probes += 1
            k = min(PROBE_K, self.max_k)
        self.chosen[k] += 1
        return k

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """One verification of `seq_id`: `proposed` proposals, the first `accepted` accepted."""
        if proposed > 0:
            self._seqs.setdefault(seq_id, _SeqState()).acceptance.update(proposed, accepted)

    def end_step(self, shares: dict[int, tuple[int, int]], seconds: float,
                 propose_seconds: float = 0.0, longest_proposal: int = 0) -> None:
        """A step ran: `shares` maps each scheduled sequence to (its query rows, the tokens it
        emitted); the step took `seconds`, of which `propose_seconds` were the proposer's (a
        round whose longest proposal had `longest_proposal` tokens)."""
        rows = sum(r for r, _ in shares.values())
        self.costs.observe(rows, seconds - propose_seconds)
        if longest_proposal:
            self.costs.observe_proposal(propose_seconds, longest_proposal)
        self._step_rows = rows
        self._step_tokens = sum(t for _, t in shares.values())
        for seq_id, state in self._seqs.items():
            state.last_rows, state.last_tokens = shares.get(seq_id, (0, 0))

    def forget(self, seq_id: int) -> None:
        """The sequence finished: its acceptance and probe schedule go."""
        self._seqs.pop(seq_id, None)
