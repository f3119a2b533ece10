"""bench/load_gen.py's statistics and length draws (no server; the end-to-end run against a real
server is in tests/test_serve.py)."""

from __future__ import annotations

import math
import random

import pytest

from bench.load_gen import RequestResult, build_parser, draw_lengths, percentiles


def test_percentiles_interpolate_like_numpy():
    values = [float(v) for v in range(1, 101)]  # 1..100
    p = percentiles(values)
    assert p["mean"] == pytest.approx(50.5)
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01)
    assert percentiles([3.0])["p99"] == 3.0
    assert all(math.isnan(v) for v in percentiles([]).values())


def test_tpot_excludes_the_first_token():
    r = RequestResult(prompt_len=4, output_len=5, ok=True, ttft=1.0, latency=3.0,
                      output_tokens=5)
    assert r.tpot == pytest.approx(0.5)
    assert RequestResult(4, 1, ok=True, ttft=1.0, latency=1.0, output_tokens=1).tpot is None


def test_fixed_and_sharegpt_lengths():
    args = build_parser().parse_args(["--concurrency", "2", "--num-prompts", "400",
                                      "--prompt-len", "256", "--output-len", "128"])
    assert draw_lengths(args, random.Random(0)) == [(256, 128)] * 400
    args.length_dist = "sharegpt"
    drawn = draw_lengths(args, random.Random(0))
    prompts, outputs = sorted(p for p, _ in drawn), sorted(o for _, o in drawn)
    assert all(4 <= p <= 4 * 256 for p in prompts) and all(4 <= o <= 4 * 128 for o in outputs)
    assert 180 < prompts[200] < 360 and 90 < outputs[200] < 180  # medians near the given
    assert prompts[-1] > 2 * prompts[200]  # a long tail, unlike the fixed lengths
