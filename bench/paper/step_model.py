"""The replay's clock: a model of one engine step's duration, fitted to measured steps.

    seconds = a + b * (tokens computed in the step) + c * (sum of the context lengths attended)

where a step's context length of a sequence is the number of its tokens whose K/V the step's
attention reads (computed tokens plus the step's new ones). `a` is the fixed cost of a step
(Python, sampling, per-layer launches), `b` the per-token cost (matmuls), `c` the per-context-token
cost (attention over the paged cache). The coefficients are a least-squares fit to steps of the
real engine (`python -m bench.paper --fit`); `STEP_MODEL_FILE` keeps the fit with the command,
machine and commit that measured it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

STEP_MODEL_FILE = Path(__file__).with_name("step_model.json")


@dataclass(frozen=True)
class StepSample:
    """One measured step: tokens computed, context tokens attended, wall seconds."""

    num_tokens: int
    context_tokens: int
    seconds: float


@dataclass(frozen=True)
class StepTimeModel:
    """`seconds(num_tokens, context_tokens) = a + b * num_tokens + c * context_tokens`."""

    a: float
    b: float
    c: float

    def seconds(self, num_tokens: int, context_tokens: int) -> float:
        return self.a + self.b * num_tokens + self.c * context_tokens

    @classmethod
    def fit(cls, samples: Sequence[StepSample]) -> "StepTimeModel":
        """Least squares over `samples` (at least 3, not all alike); coefficients clipped at 0
        (a negative cost is noise, not a speed-up). ValueError for too few samples."""
        if len(samples) < 3:
            raise ValueError(f"samples: expected at least 3 measured steps, got {len(samples)}")
        x = np.array([[1.0, s.num_tokens, s.context_tokens] for s in samples])
        y = np.array([s.seconds for s in samples])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        a, b, c = (max(float(v), 0.0) for v in coef)
        return cls(a, b, c)

    def relative_error(self, samples: Sequence[StepSample]) -> float:
        """Mean |predicted - measured| / measured over `samples`."""
        errors = [abs(self.seconds(s.num_tokens, s.context_tokens) - s.seconds) / s.seconds
                  for s in samples]
        return float(np.mean(errors))


def save_step_model(model: StepTimeModel, path: Path, provenance: dict) -> None:
    """Writes the coefficients and `provenance` (command, machine, commit, fit quality)."""
    path.write_text(json.dumps({**asdict(model), **provenance}, indent=2) + "\n")


def load_step_model(path: Path = STEP_MODEL_FILE) -> StepTimeModel:
    """The model stored at `path` (by default the fit shipped with the benchmark)."""
    data = json.loads(Path(path).read_text())
    return StepTimeModel(float(data["a"]), float(data["b"]), float(data["c"]))
