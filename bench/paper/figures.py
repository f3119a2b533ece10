"""The paper's memory experiments, each a function returning its figure's numbers (JSON-ready).

Sizes live in `Settings` (`FULL` for the measured run, `SMOKE` for the test suite). The KV budget
at the paper's lengths is the paper's own for OPT-13B on one A100-40GB (Table 1: 15.7K token
slots, here 981 blocks of 16 = 15,696 slots) with `max_model_len` 2048; at the reduced scale
(lengths / 4, `max_model_len` 512) the budget is a quarter of that (245 blocks).

- `memory_and_batch` (Fig. 2 and Fig. 13): per policy, the share of allocated slots holding a
  token, the pool's split, and the mean number of running requests, at a fixed rate.
- `latency_sweep` (Fig. 12): per policy and rate, normalized latency (mean, p90); then
  `sustainable_rates`: the highest rate whose mean normalized latency stays under the bound.
- `sharing` (Fig. 15): blocks saved by sharing, for parallel sampling (replay) and beam search
  (the real engine).
- `agreement`: the real engine against the replay of the same trace at the reduced scale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from engine.config import KV_ALLOCATIONS, EngineConfig

from bench.paper.record import RunRecord
from bench.paper.replay import Replay
from bench.paper.step_model import StepSample, StepTimeModel
from bench.paper.traces import TraceRequest, make_trace, trace_summary


@dataclass(frozen=True)
class Settings:
    """Trace sizes, rates and budgets of one `python -m bench.paper` run."""

    block_size: int = 16
    full_len: int = 2048
    full_blocks: int = 981
    reduced_scale: float = 4
    reduced_len: int = 512
    reduced_blocks: int = 245
    # requests/s of Fig. 2 / 13 at full length per data set: above the sustainable rates of
    # the latency sweep, so that the batch is not limited by arrivals (the ShareGPT-like trace
    # fills the pool under every policy)
    memory_rates: tuple[tuple[str, float], ...] = (("sharegpt", 1.0), ("alpaca", 10.0))
    memory_requests: int = 200
    sweep_rates: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
    sweep_requests: int = 150
    latency_bound_factor: float = 5.0  # bound = factor x paged's latency at the lowest rate
    engine_rate: float = 20.0       # requests/s, real engine at the reduced scale (memory binds)
    engine_requests: int = 32
    sharing_rate: float = 2.0       # Alpaca-like, full length
    sharing_requests: int = 100
    sharing_widths: tuple[int, ...] = (2, 4, 6)
    beam_requests: int = 4          # real engine, one beam search per request
    agreement_share_pp: float = 5.0     # tolerance on the token share, percentage points
    agreement_batch_rel: float = 0.10   # tolerance on the mean batch, relative

    def memory_rate(self, dataset: str) -> float:
        return dict(self.memory_rates)[dataset]

    def config(self, policy: str, reduced: bool) -> EngineConfig:
        """The engine settings of a run under `policy`, at the reduced scale or full length."""
        return EngineConfig(block_size=self.block_size,
                            num_kv_blocks=self.reduced_blocks if reduced else self.full_blocks,
                            max_model_len=self.reduced_len if reduced else self.full_len,
                            kv_allocation=policy)


FULL = Settings()
#: Other latency bounds (x the lowest rate's latency) whose ratios the report also gives.
BOUND_FACTORS = (3.0, 5.0, 10.0)
SMOKE = replace(FULL, memory_requests=12, sweep_rates=(0.5, 4.0), sweep_requests=10,
                engine_requests=4, engine_rate=50.0, sharing_requests=6, sharing_widths=(2,),
                beam_requests=1, reduced_blocks=64, full_blocks=256)

def trace(dataset: str, rate: float, num_requests: int, settings: Settings, reduced: bool,
          seed: int = 0) -> list[TraceRequest]:
    """A trace at the reduced scale or at full length (see `bench.paper.traces`)."""
    return make_trace(dataset, rate, num_requests, seed,
                      settings.reduced_scale if reduced else 1,
                      settings.reduced_len if reduced else settings.full_len)


def replay_run(requests: list[TraceRequest], policy: str, settings: Settings,
               step_model: StepTimeModel, reduced: bool = False, n: int = 1) -> RunRecord:
    """The replay of `requests` under `policy`."""
    config = settings.config(policy, reduced)
    return Replay(config, config.max_model_len, step_model).run(requests, n)


def memory_and_batch(requests: list[TraceRequest], rate: float, policies: tuple[str, ...],
                     run: Callable[[list[TraceRequest], str], RunRecord],
                     block_size: int) -> dict:
    """Fig. 2 and Fig. 13: each policy's run summary (token share, pool split, mean running
    requests, latency) on the same trace (drawn at `rate`); `run(trace, policy)` is the replay
    or the engine."""
    return {"trace": trace_summary(requests), "rate": rate,
            "policies": {p: run(requests, p).summary(block_size) for p in policies}}


def latency_sweep(dataset: str, policies: tuple[str, ...], settings: Settings,
                  step_model: StepTimeModel, seed: int = 0) -> dict:
    """Fig. 12 by replay at full length: per policy and rate, normalized latency mean and p90
    and the unfinished requests (none: every trace runs to its end)."""
    curves: dict[str, list[dict]] = {p: [] for p in policies}
    for rate in settings.sweep_rates:
        requests = trace(dataset, rate, settings.sweep_requests, settings, False, seed)
        for p in policies:
            s = replay_run(requests, p, settings, step_model).summary(settings.block_size)
            curves[p].append({"rate": rate, "mean": s["normalized_latency_mean"],
                              "p90": s["normalized_latency_p90"],
                              "mean_running": s["mean_running"]})
    base = curves[policies[0]][0]["mean"]
    bound = settings.latency_bound_factor * base
    return {"dataset": dataset, "kv_slots": settings.full_blocks * settings.block_size,
            "max_model_len": settings.full_len, "requests_per_rate": settings.sweep_requests,
            "bound_s_per_token": bound, "bound_rule": f"{settings.latency_bound_factor} x "
            f"{policies[0]}'s mean normalized latency at the lowest rate",
            "curves": curves, "sustainable": sustainable_rates(curves, bound),
            "ratios_by_bound_factor": {f: sustainable_rates(curves, f * base)["ratios"]
                                       for f in BOUND_FACTORS}}


def sustainable_rate(curve: list[dict], bound: float) -> dict:
    """The highest rate whose mean normalized latency is at most `bound`: interpolated linearly
    where the curve first crosses it (`rate` None when the lowest rate is already over it);
    `censored` when no swept rate crosses it (the true rate is at least `rate`)."""
    for i, point in enumerate(curve):
        if point["mean"] > bound:
            if i == 0:
                return {"rate": None, "censored": False}
            prev = curve[i - 1]
            frac = (bound - prev["mean"]) / (point["mean"] - prev["mean"])
            return {"rate": prev["rate"] + frac * (point["rate"] - prev["rate"]),
                    "censored": False}
    return {"rate": curve[-1]["rate"], "censored": True}


def sustainable_rates(curves: dict[str, list[dict]], bound: float) -> dict:
    """Each policy's sustainable rate, and paged's over each baseline's (None when either is
    undefined; `censored` when either is)."""
    rates = {p: sustainable_rate(c, bound) for p, c in curves.items()}
    ratios = {}
    paged = rates.get("paged")
    if paged is not None:
        for p, r in rates.items():
            if p != "paged":
                ok = paged["rate"] is not None and r["rate"]
                ratios[f"paged/{p}"] = {"ratio": paged["rate"] / r["rate"] if ok else None,
                                        "censored": paged["censored"] or r["censored"]}
    return {"rates": rates, "ratios": ratios}


def sharing(settings: Settings, step_model: StepTimeModel,
            beam: Optional[Callable[[list[TraceRequest], int], RunRecord]], seed: int = 0) -> dict:
    """Fig. 15 on the Alpaca-like trace at full length under "paged": parallel sampling by
    replay (`n` samples per request) and, when `beam` is given, beam search on the real engine
    (`beam(trace, width)`); blocks saved by sharing over blocks allocated plus saved."""
    requests = trace("alpaca", settings.sharing_rate, settings.sharing_requests, settings, False,
                     seed)
    bs = settings.block_size
    result: dict = {"trace": trace_summary(requests), "parallel": {}, "beam": {}}
    for n in settings.sharing_widths:
        record = replay_run(requests, "paged", settings, step_model, n=n)
        result["parallel"][n] = record.sharing_saved(bs)
    if beam is not None:
        for width in settings.sharing_widths:
            result["beam"][width] = beam(requests[:settings.beam_requests], width).sharing_saved(bs)
    return result


def reduced_scale(dataset: str, policies: tuple[str, ...], settings: Settings,
                  step_model: StepTimeModel,
                  engine: Callable[[list[TraceRequest], str], tuple[RunRecord, list[StepSample]]],
                  seed: int = 0) -> dict:
    """Fig. 2 and Fig. 13 on the real engine at the reduced scale (`engine(trace, policy)` ->
    its record and measured steps), the replay of the same trace, their agreement, and the
    step model's mean relative error on the engine's measured steps."""
    requests = trace(dataset, settings.engine_rate, settings.engine_requests, settings, True,
                     seed)
    samples: list[StepSample] = []

    def real_run(t: list[TraceRequest], policy: str) -> RunRecord:
        record, steps = engine(t, policy)
        samples.extend(steps)
        return record

    real = memory_and_batch(requests, settings.engine_rate, policies, real_run,
                            settings.block_size)
    replayed = memory_and_batch(
        requests, settings.engine_rate, policies,
        lambda t, p: replay_run(t, p, settings, step_model, reduced=True), settings.block_size)
    return {"engine_reduced": real, "replay_reduced": replayed,
            "agreement": agreement(real, replayed, settings),
            "step_model_error": {"mean_relative_error": step_model.relative_error(samples),
                                 "steps": len(samples)}}


def agreement(real: dict, replayed: dict, settings: Settings) -> dict:
    """Per policy, the real engine's token share and mean batch against the replay's, and
    whether they agree within the settings' tolerances."""
    rows = {}
    for policy, r in real["policies"].items():
        p = replayed["policies"][policy]
        share_pp = 100 * abs(r["token_share"] - p["token_share"])
        batch_rel = abs(r["mean_running"] - p["mean_running"]) / max(r["mean_running"], 1e-9)
        rows[policy] = {"share_diff_pp": share_pp, "batch_diff_rel": batch_rel,
                        "agree": bool(share_pp <= settings.agreement_share_pp
                                      and batch_rel <= settings.agreement_batch_rel)}
    return {"tolerance": {"share_pp": settings.agreement_share_pp,
                          "batch_rel": settings.agreement_batch_rel},
            "policies": rows, "all_agree": all(r["agree"] for r in rows.values())}


def check_policies(policies: list[str]) -> tuple[str, ...]:
    """`policies` as a tuple, "paged" first; ValueError naming an unknown one."""
    for p in policies:
        if p not in KV_ALLOCATIONS:
            raise ValueError(f"policies: expected names from {KV_ALLOCATIONS}, got {p!r}")
    ordered = sorted(dict.fromkeys(policies), key=KV_ALLOCATIONS.index)
    return tuple(ordered)
