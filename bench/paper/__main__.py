"""`python -m bench.paper --out DIR [--smoke] [--no-engine] [--figures 2,16,...]` and
`python -m bench.paper --fit`.

`--figures` selects what is measured (default: all): 2, 12, 13 and 15 (the memory figures, run
together: naming any runs all four), 16, 18, 19 (`bench.paper.serving`, on the real engine).
A run writes DIR/report.md (the paper's number beside ours for each figure, with the command),
DIR/results.json and DIR/fig*.png. `--fit` measures the real engine's steps at the reduced scale
and stores the fitted step model (bench/paper/step_model.json, or `--step-model PATH`).
See the package docstring for what is measured.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from engine.config import KV_ALLOCATIONS
from engine.dtypes import resolve_dtype

from bench.paper import figures, report, serving
from bench.paper.step_model import (STEP_MODEL_FILE, StepTimeModel, load_step_model,
                                    save_step_model)
from bench.paper.traces import DATASETS


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of requests per second > 0, "
                                         f"got {text!r}")
    return value


def _rates(text: str) -> tuple[float, ...]:
    return tuple(_rate(t) for t in text.split(","))


def _policies(text: str) -> tuple[str, ...]:
    try:
        return figures.check_policies(text.split(","))
    except ValueError as exc:  # "policies: expected ...": argparse names the argument
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None


#: The memory figures (run together by `measure`), then those of `bench.paper.serving`.
MEMORY_FIGURES = ("2", "12", "13", "15")
ALL_FIGURES = MEMORY_FIGURES + serving.FIGURES


def _figures(text: str) -> tuple[str, ...]:
    names = [t.strip() for t in text.split(",")]
    for name in names:
        if name not in ALL_FIGURES:
            raise argparse.ArgumentTypeError(f"expected names from {','.join(ALL_FIGURES)}, "
                                             f"got {name!r}")
    return tuple(f for f in ALL_FIGURES if f in names)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line; bad values exit through argparse's error (naming the argument)."""
    ap = argparse.ArgumentParser(prog="python -m bench.paper", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="output folder (required unless --fit)")
    ap.add_argument("--smoke", action="store_true", help="tiny traces, seconds")
    ap.add_argument("--fit", action="store_true",
                    help="measure the engine's steps and store the fitted step model")
    ap.add_argument("--no-engine", action="store_true",
                    help="replay only (no model; only the memory figures)")
    ap.add_argument("--figures", type=_figures, default=ALL_FIGURES,
                    help=f"comma-separated, from {','.join(ALL_FIGURES)} (default: all)")
    ap.add_argument("--dataset", choices=sorted(DATASETS), default="sharegpt",
                    help="trace of the memory, batch and latency figures")
    ap.add_argument("--policies", type=_policies, default=KV_ALLOCATIONS,
                    help=f"comma-separated, from {','.join(KV_ALLOCATIONS)}")
    ap.add_argument("--rate", type=_rate,
                    help="requests/s of the memory and batch figures on --dataset")
    ap.add_argument("--rates", type=_rates, help="comma-separated requests/s of the sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-model", type=Path, default=STEP_MODEL_FILE)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the real engine's model dtype; auto: bfloat16 on a CPU that multiplies "
                         "it natively, float32 elsewhere (engine/dtypes.py)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the real engine")
    args = ap.parse_args(argv)
    if args.out is None and not args.fit:
        ap.error("argument --out: expected an output folder (or --fit), got none")
    wanted = [f for f in args.figures if f in serving.FIGURES]
    if args.no_engine and wanted:
        ap.error(f"argument --figures: expected only memory figures with --no-engine, got "
                 f"{','.join(wanted)}")
    return args


def settings_of(args: argparse.Namespace) -> figures.Settings:
    """FULL or SMOKE, with the rates given on the command line."""
    settings = figures.SMOKE if args.smoke else figures.FULL
    changes = {}
    if args.rate is not None:
        changes["memory_rates"] = tuple((d, args.rate if d == args.dataset else r)
                                        for d, r in settings.memory_rates)
    if args.rates is not None:
        changes["sweep_rates"] = args.rates
    return figures.replace(settings, **changes) if changes else settings


def environment(args: argparse.Namespace) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    return {"command": "python -m bench.paper " + shlex.join(sys.argv[1:]),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "commit": commit,
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": args.threads,
            "dtype": str(resolve_dtype(args.dtype)).removeprefix("torch.")}


def fit(args: argparse.Namespace, settings: figures.Settings, loaded=None) -> StepTimeModel:
    """Serves the reduced-scale trace on the real engine under "paged" and fits the step model
    to its steps; stores it with its provenance at `args.step_model`."""
    from bench.paper import engine_run

    requests = figures.trace(args.dataset, settings.engine_rate, settings.engine_requests,
                             settings, True, args.seed)
    llm = engine_run.make_llm("paged", settings, loaded or engine_run.load(args.dtype))
    _, samples = engine_run.run_trace(llm, requests)
    model = StepTimeModel.fit(samples)
    save_step_model(model, args.step_model, {
        **environment(args), "num_steps": len(samples),
        "mean_relative_error": model.relative_error(samples),
        "trace": {"dataset": args.dataset, "rate": settings.engine_rate,
                  "num_requests": settings.engine_requests, "scale": settings.reduced_scale,
                  "max_model_len": settings.reduced_len, "num_kv_blocks": settings.reduced_blocks}})
    return model


def run(args: argparse.Namespace, loaded=None) -> dict:
    """Every figure (see the package docstring); writes the report; returns the results."""
    settings = settings_of(args)
    torch.set_num_threads(args.threads)
    if args.fit:
        fit(args, settings, loaded)
        if args.out is None:
            return {}
    serving_settings = serving.SERVING_SMOKE if args.smoke else serving.SERVING_FULL
    results: dict = {"environment": environment(args), "settings": asdict(settings),
                     "serving_settings": asdict(serving_settings),
                     "dataset": args.dataset, "policies": list(args.policies),
                     "figures_selected": list(args.figures), "figures": {}}
    if any(f in MEMORY_FIGURES for f in args.figures):
        step_model = load_step_model(args.step_model)
        results["step_model"] = {**asdict(step_model), "file": os.path.relpath(args.step_model)}
        results["figures"] = measure(args, settings, step_model, loaded)
    if any(f in serving.FIGURES for f in args.figures):
        if loaded is None:
            from bench.paper import engine_run

            loaded = engine_run.load(args.dtype)
        results["figures"].update(serving.measure(args.figures, loaded, serving_settings,
                                                  args.seed))
    report.write(args.out, results)
    return results


def measure(args: argparse.Namespace, settings: figures.Settings, step_model: StepTimeModel,
            loaded=None) -> dict:
    """The figures' numbers: replays at full length, then (unless --no-engine) the real engine
    at the reduced scale against the replay there, and beam search."""
    policies, bs = args.policies, settings.block_size
    out: dict = {}
    for dataset in DATASETS:
        rate = settings.memory_rate(dataset)
        requests = figures.trace(dataset, rate, settings.memory_requests, settings, False,
                                 args.seed)
        out[f"memory_{dataset}"] = figures.memory_and_batch(
            requests, rate, policies,
            lambda t, p: figures.replay_run(t, p, settings, step_model), bs)
    out["latency"] = figures.latency_sweep(args.dataset, policies, settings, step_model,
                                           args.seed)
    beam = None
    if not args.no_engine:
        from bench.paper import engine_run

        if loaded is None:
            loaded = engine_run.load(args.dtype)

        def real(t: list, policy: str):
            return engine_run.run_trace(engine_run.make_llm(policy, settings, loaded), t)

        def beam_run(t: list, width: int):
            llm = engine_run.make_llm("paged", settings, loaded, reduced=False)
            return engine_run.run_beam_search(llm, t, width)

        beam = beam_run
        out.update(figures.reduced_scale(args.dataset, policies, settings, step_model, real,
                                         args.seed))
    out["sharing"] = figures.sharing(settings, step_model, beam, args.seed)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    results = run(args)
    if args.out is not None:
        print(report.summary_table(results))
        print(f"wrote {args.out}/report.md in {time.perf_counter() - started:.0f} s")
    else:
        print(f"wrote {args.step_model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
