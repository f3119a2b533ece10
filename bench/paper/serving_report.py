"""The report's parts for `bench.paper.serving` (Fig. 16, 18, 19): summary rows, sections, plots.

The paper's numbers are those of Kwon et al., SOSP 2023: §6.4 / Fig. 16 (shared prefix, against
Orca (Oracle)), §7.2 / Fig. 18 (block size), §7.3 / Fig. 19 (recompute against swap).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

PAPER_PREFIX = {1: "1.67x throughput over Orca (Oracle)", 5: "3.58x throughput over Orca (Oracle)"}
PAPER_BLOCK = {"sharegpt": "16-128 best", "alpaca": "16-32 best"}
PAPER_PREEMPTION = {"recompute": "flat across block sizes",
                    "swap": "slow at small block sizes, similar to recompute at 64+"}


def _ms(x: Optional[float]) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{1e3 * x:.3g}"


def table_rows(figs: dict, cmd: str) -> list[tuple[str, str, str, str]]:
    """(figure, paper, ours, command) rows for the figures of `figs` that were measured."""
    rows = []
    for shots, r in figs.get("shared_prefix", {}).get("shots", {}).items():
        rows.append((f"Fig. 16 throughput, prefix caching on / off, {shots}-shot "
                     f"(shared prefix {r['shared_prefix_len']} tokens, engine)",
                     PAPER_PREFIX.get(int(shots), ""),
                     f"{r['on']['throughput']:.1f} / {r['off']['throughput']:.1f} tokens/s = "
                     f"{r['throughput_ratio']:.2f}x; hit rate {100 * r['on']['hit_rate']:.1f} % "
                     f"/ {100 * r['off']['hit_rate']:.1f} %", cmd))
    for ds, d in figs.get("block_size", {}).get("datasets", {}).items():
        lat = {b: r["normalized_latency_mean"] for b, r in d["block_sizes"].items()}
        near = sorted(b for b, v in lat.items() if v <= 1.1 * lat[d["best"]])
        rows.append((f"Fig. 18 block size, normalized latency ({ds}-like, engine)",
                     PAPER_BLOCK.get(ds, ""),
                     f"best {d['best']} ({_ms(lat[d['best']])} ms/token); within 10 %: "
                     f"{', '.join(str(b) for b in near)}", cmd))
    for mode, by_bs in figs.get("preemption", {}).get("modes", {}).items():
        rows.append((f"Fig. 19 {mode}: ms per preempted token by block size (engine)",
                     PAPER_PREEMPTION[mode],
                     ", ".join(f"{b}: {_ms(r['seconds_per_token'])}" for b, r in by_bs.items()),
                     cmd))
    return rows


def sections(figs: dict) -> list[str]:
    """The markdown sections of the measured figures."""
    lines: list[str] = []
    if "shared_prefix" in figs:
        lines += _prefix_section(figs["shared_prefix"])
    if "block_size" in figs:
        lines += _block_size_section(figs["block_size"])
    if "preemption" in figs:
        lines += _preemption_section(figs["preemption"])
    return lines


def _prefix_section(fig: dict) -> list[str]:
    lines = ["## Fig. 16: shared prefix (real engine)", "",
             f"Few-shot English -> French prompts (bench/paper/serving.py), requests arriving at "
             f"{fig['rate']:g} req/s, block size {fig['block_size']}, {fig['kv_slots']} KV slots. "
             "Throughput: output tokens / (last finish - first arrival) on the engine's clock. "
             "Hit rate: `prefix_cache_hits / prefix_cache_queries` over the run.", "",
             "| shots | requests | prompt (tokens) | shared prefix | caching | tokens/s | "
             "hit rate | norm. latency (s/token) | mean running |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shots, r in fig["shots"].items():
        t = r["trace"]
        for name in ("on", "off"):
            run = r[name]
            lines.append(f"| {shots} | {t['num_requests']} | {t['mean_prompt_len']:.0f} | "
                         f"{r['shared_prefix_len']} | {name} | {run['throughput']:.1f} | "
                         f"{100 * run['hit_rate']:.1f} % | "
                         f"{run['normalized_latency_mean']:.3f} | {run['mean_running']:.2f} |")
    return lines + [""]


def _block_size_section(fig: dict) -> list[str]:
    lines = ["## Fig. 18: block size (real engine)", "",
             f"{fig['kv_slots']} KV slots at every block size, {fig['rate']:g} req/s, lengths "
             "at the reduced scale, prefix caching off.", ""]
    for ds, d in fig["datasets"].items():
        t = d["trace"]
        lines += [f"{ds}-like: {t['num_requests']} requests, mean prompt "
                  f"{t['mean_prompt_len']:.1f}, mean output {t['mean_output_len']:.1f} tokens.", "",
                  "| block size | norm. latency mean / p90 (ms/token) | mean running | "
                  "slots holding a token |", "| --- | --- | --- | --- |"]
        for bs, r in d["block_sizes"].items():
            lines.append(f"| {bs} | {_ms(r['normalized_latency_mean'])} / "
                         f"{_ms(r['normalized_latency_p90'])} | {r['mean_running']:.2f} | "
                         f"{100 * r['token_share']:.1f} % |")
        lines.append("")
    return lines


def _preemption_section(fig: dict) -> list[str]:
    t = fig["trace"]
    lines = ["## Fig. 19: recompute against swap (real engine)", "",
             f"{t['num_requests']} equal requests (prompt {t['max_prompt_len']}, output "
             f"{t['max_output_len']} tokens) at {fig['rate']:g} req/s, {fig['kv_slots']} KV "
             "slots at every block size (so that requests are preempted), prefix caching off. "
             "Time per preempted "
             "token: by swap, the wall time of the KV cache's swap-out and swap-in copies over "
             "the tokens swapped out; by recompute, each step's measured time times the share of "
             "its tokens that recompute preempted K/V, summed, over the tokens preempted "
             "(a preempted sequence's computed tokens at its preemption).", "",
             "| mode | block size | preemptions | tokens preempted | recomputed | "
             "ms per preempted token | norm. latency (ms/token) | duration (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, by_bs in fig["modes"].items():
        for bs, r in by_bs.items():
            lines.append(f"| {mode} | {bs} | {r['preemptions']} | "
                         f"{sum(r['preempted_tokens'].values())} | {r['recomputed_tokens']} | "
                         f"{_ms(r['seconds_per_token'])} | "
                         f"{_ms(r['normalized_latency_mean'])} | {r['duration_s']:.2f} |")
    return lines + [""]


def plots(figs: dict, out: Path, save: Callable) -> list[str]:
    """fig16_shared_prefix.png, fig18_block_size.png, fig19_preemption.png (those measured);
    `save(fig, out, name)` writes one; returns the names."""
    import matplotlib.pyplot as plt

    names = []
    if "shared_prefix" in figs:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        shots = list(figs["shared_prefix"]["shots"].items())
        for k, name in enumerate(("on", "off")):
            ax.bar([i + 0.4 * k for i in range(len(shots))],
                   [r[name]["throughput"] for _, r in shots], width=0.4,
                   label=f"prefix caching {name}")
        ax.set_xticks([i + 0.2 for i in range(len(shots))], [f"{s}-shot" for s, _ in shots])
        ax.set_ylabel("output tokens/s")
        ax.legend(fontsize=7)
        names.append(save(fig, out, "fig16_shared_prefix.png"))
    if "block_size" in figs:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for ds, d in figs["block_size"]["datasets"].items():
            rows = d["block_sizes"]
            ax.plot(list(rows), [1e3 * r["normalized_latency_mean"] for r in rows.values()],
                    marker="o", label=f"{ds}-like")
        _log2_axis(ax, "block size")
        ax.set_ylabel("normalized latency (ms/token)")
        ax.legend(fontsize=7)
        names.append(save(fig, out, "fig18_block_size.png"))
    if "preemption" in figs:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for mode, by_bs in figs["preemption"]["modes"].items():
            points = [(b, r["seconds_per_token"]) for b, r in by_bs.items()
                      if r["seconds_per_token"] is not None]
            ax.plot([b for b, _ in points], [1e3 * s for _, s in points], marker="o", label=mode)
        _log2_axis(ax, "block size")
        ax.set_ylabel("ms per preempted token")
        ax.legend(fontsize=7)
        names.append(save(fig, out, "fig19_preemption.png"))
    return names


def _log2_axis(ax, label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel(label)
