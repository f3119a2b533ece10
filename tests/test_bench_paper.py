"""`python -m bench.paper`: its traces, step model and replay against independent arithmetic,
the replay against the real engine step by step, the `--smoke` runs' reports and invariants
(the memory figures, then the serving figures 16, 18, 19), and its command-line errors."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from bench.paper import figures, serving
from bench.paper.__main__ import parse_args, run
from bench.paper.engine_run import make_llm, run_trace
from bench.paper.replay import Replay
from bench.paper.step_model import StepSample, StepTimeModel
from bench.paper.traces import DATASETS, TraceRequest, make_trace
from engine.config import EngineConfig, KV_ALLOCATIONS
from engine.dtypes import auto_dtype
from engine.model.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype=auto_dtype())


# ------------------------------------------------------------------ traces and step model
@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_trace_lengths_have_the_papers_means(dataset):
    dist = DATASETS[dataset]
    trace = make_trace(dataset, 10.0, 20000, seed=1, scale=1, max_model_len=100000)
    assert np.mean([r.prompt_len for r in trace]) == pytest.approx(dist.input_mean, rel=0.05)
    assert np.mean([r.output_len for r in trace]) == pytest.approx(dist.output_mean, rel=0.05)
    gaps = np.diff([0.0] + [r.arrival_s for r in trace])
    assert np.mean(gaps) == pytest.approx(1 / 10.0, rel=0.05)
    assert np.std(gaps) == pytest.approx(1 / 10.0, rel=0.05)  # exponential: std = mean


def test_trace_is_seeded_scaled_and_clipped():
    a = make_trace("sharegpt", 2.0, 300, seed=3, scale=4, max_model_len=128)
    assert a == make_trace("sharegpt", 2.0, 300, seed=3, scale=4, max_model_len=128)
    assert a != make_trace("sharegpt", 2.0, 300, seed=4, scale=4, max_model_len=128)
    assert all(1 <= r.prompt_len < 128 and 1 <= r.output_len <= 128 - r.prompt_len for r in a)
    assert max(r.prompt_len + r.output_len for r in a) == 128  # the long tail is clipped


def test_step_model_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    truth = StepTimeModel(0.012, 0.0031, 2.5e-6)
    samples = [StepSample(int(t), int(c), truth.seconds(int(t), int(c)))
               for t, c in zip(rng.integers(1, 300, 50), rng.integers(1, 20000, 50))]
    fitted = StepTimeModel.fit(samples)
    for name in ("a", "b", "c"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert fitted.relative_error(samples) < 1e-6


# -------------------------------------------------------------------------- replay
def test_replay_clock_and_latency_follow_the_step_model():
    """One request of 20 prompt tokens and 5 outputs: a prefill step then 4 decode steps."""
    model = StepTimeModel(0.5, 0.01, 0.001)
    req = TraceRequest("r", 1.0, tuple(range(20)), 5)
    config = EngineConfig(num_kv_blocks=8, max_model_len=64)
    record = Replay(config, 64, model).run([req])
    steps = [(20, 20)] + [(1, 21 + i) for i in range(4)]
    expected = 1.0 + sum(0.5 + 0.01 * t + 0.001 * c for t, c in steps)
    assert len(record.steps) == 5
    assert record.requests["r"].first_token_s == pytest.approx(1.0 + 0.5 + 0.2 + 0.02)
    assert record.requests["r"].finish_s == pytest.approx(expected)
    assert record.normalized_latencies() == [pytest.approx((expected - 1.0) / 5)]


def test_replay_forks_parallel_samples_and_counts_their_sharing():
    model = StepTimeModel(0.01, 0.0, 0.0)
    req = TraceRequest("r", 0.0, tuple(range(40)), 8)
    record = Replay(EngineConfig(num_kv_blocks=32, max_model_len=64), 64, model).run([req], n=4)
    # the prompt's two full blocks are shared by the 4 samples: 3 x 2 blocks saved
    assert max(s.memory["shared_blocks_saved"] for s in record.steps) == 6
    assert record.steps[-1].memory["allocated_slots"] > 0
    assert 0 < record.sharing_saved(16) < 1


# -------------------------------------------------------- the engine against the replay
def test_replay_reproduces_the_engine_step_by_step(loaded):
    """Same trace (all arrivals at 0, so admission depends on memory only) on the real engine
    and on the replay: the same steps, memory and batch at every step, for every policy; so
    the figures agree within the report's tolerance."""
    settings = dataclasses.replace(figures.SMOKE, reduced_blocks=40)
    trace = [dataclasses.replace(r, arrival_s=0.0)
             for r in figures.trace("sharegpt", 1.0, 5, settings, True, seed=2)]
    model = StepTimeModel(0.01, 0.001, 0.0)
    real, replayed = {"policies": {}}, {"policies": {}}
    for policy in KV_ALLOCATIONS:
        engine_record, samples = run_trace(make_llm(policy, settings, loaded), trace)
        replay_record = figures.replay_run(trace, policy, settings, model, reduced=True)
        assert [(s.num_running, s.memory) for s in engine_record.steps] == \
            [(s.num_running, s.memory) for s in replay_record.steps], policy
        assert len(samples) == len(engine_record.steps)
        real["policies"][policy] = engine_record.summary(settings.block_size)
        replayed["policies"][policy] = replay_record.summary(settings.block_size)
    assert figures.agreement(real, replayed, settings)["all_agree"]
    shares = {p: s["token_share"] for p, s in real["policies"].items()}
    assert shares["paged"] > max(v for p, v in shares.items() if p != "paged")


# ------------------------------------------------------------------------ --smoke
def test_smoke_run_writes_the_report(tmp_path, loaded):
    args = parse_args(["--out", str(tmp_path), "--smoke", "--figures", "2,12,13,15"])
    results = run(args, loaded=loaded)
    for name in ("report.md", "results.json", "fig2_memory.png", "fig12_latency.png",
                 "fig13_batch.png", "fig15_sharing.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "results.json").read_text())["policies"] == list(KV_ALLOCATIONS)
    text = (tmp_path / "report.md").read_text()
    assert "| figure | paper | ours | command |" in text
    for label in ("Fig. 2", "Fig. 12", "Fig. 13", "Fig. 15", "engine vs replay"):
        assert label in text, label
    figs = results["figures"]
    for key in ("memory_sharegpt", "memory_alpaca", "engine_reduced", "replay_reduced"):
        pols = figs[key]["policies"]
        for p, s in pols.items():
            assert 0 <= s["token_share"] <= 1, (key, p)
            assert sum(s["pool_split"].values()) == pytest.approx(1.0), (key, p)
            assert all(0 <= v <= 1 for v in s["pool_split"].values()), (key, p)
            assert s["unfinished"] == 0
        assert all(pols["paged"]["token_share"] >= s["token_share"] for s in pols.values()), key
    for kind in ("parallel", "beam"):
        assert figs["sharing"][kind] and all(0 < v < 1 for v in figs["sharing"][kind].values())


def test_smoke_run_of_the_serving_figures(tmp_path, loaded):
    """Fig. 16, 18, 19 on tiny traces: the report, the prefix cache's hit rate with caching on
    and off, every block size run to the end, and preemptions under the small budget in both
    modes, each preempted token recomputed once (recompute) or copied (swap)."""
    args = parse_args(["--out", str(tmp_path), "--smoke", "--figures", "19,16,18"])
    assert args.figures == ("16", "18", "19")
    figs = run(args, loaded=loaded)["figures"]
    assert set(figs) == {"shared_prefix", "block_size", "preemption"}
    text = (tmp_path / "report.md").read_text()
    for label in ("Fig. 16", "Fig. 18", "Fig. 19"):
        assert label in text, label
    assert "Fig. 2 " not in text
    for name in ("fig16_shared_prefix.png", "fig18_block_size.png", "fig19_preemption.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    for shots, r in figs["shared_prefix"]["shots"].items():
        assert r["shared_prefix_len"] >= 16 * shots  # the examples are shared, ~80 tokens each
        assert 0 < r["on"]["hit_rate"] <= 1 and r["off"]["hit_rate"] == 0
        assert r["on"]["prefix_cache_queries"] == r["off"]["prefix_cache_queries"] \
            == r["trace"]["num_requests"] * r["trace"]["mean_prompt_len"]
        assert r["on"]["unfinished"] == r["off"]["unfinished"] == 0
        assert r["throughput_ratio"] > 0
    for d in figs["block_size"]["datasets"].values():
        assert list(d["block_sizes"]) == list(serving.SERVING_SMOKE.block_sizes)
        assert d["best"] in d["block_sizes"]
        assert all(r["unfinished"] == 0 and 0 < r["token_share"] <= 1
                   for r in d["block_sizes"].values())
    modes = figs["preemption"]["modes"]
    recompute, swap = modes["recompute"][16], modes["swap"][16]
    assert recompute["preemptions"] > 0 and swap["preemptions"] > 0
    assert recompute["preempted_tokens"]["swap"] == 0
    assert recompute["recomputed_tokens"] == recompute["preempted_tokens"]["recompute"] > 0
    assert swap["preempted_tokens"]["swap"] > 0 and swap["swap_seconds"] > 0
    assert swap["recomputed_tokens"] == swap["preempted_tokens"]["recompute"] == 0
    assert recompute["seconds_per_token"] > 0 and swap["seconds_per_token"] > 0
    assert all(r["unfinished"] == 0 for m in modes.values() for r in m.values())


def test_preemption_meter_counts_against_hand_written_steps():
    """Two sequences: `a` computes 30 tokens, is preempted by recompute, recomputes them in
    two chunks; `b` is swapped out at 12 tokens and resumes at 12 (nothing recomputed)."""
    from engine.request import SequenceStatus

    class Seq:
        def __init__(self, seq_id):
            self.seq_id, self.num_computed_tokens = seq_id, 0
            self.status = SequenceStatus.RUNNING

    class Out:
        def __init__(self, scheduled, preempted=()):
            self.scheduled, self.preempted = scheduled, list(preempted)
            self.num_batched_tokens = sum(n for _, n in scheduled)

    class Group:
        def __init__(self, *seqs):
            self.seqs = list(seqs)

    a, b = Seq(1), Seq(2)
    meter = serving.PreemptionMeter()

    def step(scheduled, preempted=()):
        for seq, n in scheduled:
            seq.num_computed_tokens += n
        meter.on_step(Out(scheduled, preempted))

    step([(a, 30), (b, 12)])
    a.num_computed_tokens, a.status = 0, SequenceStatus.WAITING   # recompute
    b.status = SequenceStatus.SWAPPED
    step([], [Group(a), Group(b)])
    a.status = b.status = SequenceStatus.RUNNING
    step([(a, 20), (b, 1)])
    step([(a, 11)])  # 10 recomputed, 1 new
    assert meter.preempted_tokens == {"recompute": 30, "swap": 12}
    assert meter.step_recomputed == [0, 0, 20, 10]
    assert meter.recompute_seconds([1.0, 1.0, 2.1, 1.1]) == pytest.approx(2.0 + 1.0)


# --------------------------------------------------------------------- CLI errors
@pytest.mark.parametrize("argv, named", [
    (["--out", "x", "--rate", "0"], "argument --rate: expected a number of requests per "
                                    "second > 0, got '0'"),
    (["--out", "x", "--rates", "1,-2"], "argument --rates: expected a number of requests per "
                                        "second > 0, got '-2'"),
    (["--out", "x", "--policies", "paged,reserve-min"], "argument --policies: expected names "
                                                        "from"),
    (["--out", "x", "--dataset", "wiki"], "argument --dataset: invalid choice: 'wiki'"),
    ([], "argument --out: expected an output folder"),
    (["--out", "x", "--figures", "16,17"], "argument --figures: expected names from "
                                          "2,12,13,15,16,18,19, got '17'"),
    (["--out", "x", "--no-engine", "--figures", "2,18"], "argument --figures: expected only "
                                                         "memory figures with --no-engine, "
                                                         "got 18"),
])
def test_bad_arguments_are_named(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    ({"rate": 0}, "rate: expected a finite number of requests per second > 0, got 0"),
    ({"rate": float("inf")}, "rate: expected a finite number"),
    ({"dataset": "wiki"}, "dataset: expected one of ['alpaca', 'sharegpt'], got 'wiki'"),
])
def test_make_trace_refuses_bad_values(kwargs, message):
    args = {"dataset": "sharegpt", "rate": 1.0, "num_requests": 3, **kwargs}
    with pytest.raises(ValueError) as exc:
        make_trace(**args)
    assert message in str(exc.value)
