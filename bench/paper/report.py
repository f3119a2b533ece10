"""The report of a `python -m bench.paper` run: report.md, results.json and fig*.png.

report.md opens with a table (figure, the paper's number, ours, the command that produced
ours), then states the traces (distributions, source, scale), the KV budgets, the step model
and the latency bound, then each measured figure's full numbers. The paper's numbers are those
of Kwon et al., SOSP 2023 (Fig. 2, §6.2 / Fig. 12-13, §6.3 / Fig. 15; Fig. 16, 18 and 19 in
`bench.paper.serving_report`). A run of some figures only reports those.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.paper import serving_report
from bench.paper.traces import DATASETS

#: The paper's Fig. 2 share of KV memory holding tokens, per policy.
PAPER_TOKEN_SHARE = {"reserve-max": "20.4 %", "reserve-pow2": "26.8 %",
                     "reserve-oracle": "38.2 %", "paged": "96.3 %"}
PAPER_BATCH = "paged batches 4.3x reserve-max, 2.2x reserve-oracle (ShareGPT, §6.2 / Fig. 13a)"
PAPER_RATE = {"paged/reserve-max": "2.7-8x", "paged/reserve-oracle": "1.7-2.7x"}
PAPER_SHARING = {"parallel": "6.1-9.8 %", "beam": "37.6-55.2 %"}
TARGET_RATE = {"paged/reserve-max": 2.5, "paged/reserve-oracle": 1.5}


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f} %"


def _num(x, fmt: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(figure, paper, ours, command) rows of the summary table."""
    figs = results["figures"]
    cmd = results["environment"]["command"]
    ds = results["dataset"]
    rows = []
    if f"memory_{ds}" in figs:
        rows += _memory_rows(figs, ds, cmd)
    return rows + serving_report.table_rows(figs, cmd)


def _memory_rows(figs: dict, ds: str, cmd: str) -> list[tuple[str, str, str, str]]:
    rows = []
    mem = figs[f"memory_{ds}"]["policies"]
    for p, s in mem.items():
        rows.append((f"Fig. 2 KV slots holding a token, {p} ({ds}, replay)",
                     PAPER_TOKEN_SHARE.get(p, ""), _pct(s["token_share"]), cmd))
    if "paged" in mem:
        rows.append(("paged waste (allocated, no token / allocated), block 16", "target < 4 %",
                     _pct(1 - mem["paged"]["token_share"]), cmd))
        for p, s in mem.items():
            if p != "paged":
                rows.append((f"Fig. 13 mean batch, paged / {p} ({ds}, replay)", PAPER_BATCH,
                             f"{mem['paged']['mean_running']:.1f} / {s['mean_running']:.1f} = "
                             f"{mem['paged']['mean_running'] / s['mean_running']:.2f}x", cmd))
    sus = figs["latency"]["sustainable"]
    for key, ratio in sus["ratios"].items():
        target = TARGET_RATE.get(key)
        mark = " (a sweep end: censored)" if ratio["censored"] else ""
        rows.append((f"Fig. 12 sustainable rate {key} ({ds}, replay)",
                     PAPER_RATE.get(key, "") + (f"; target >= {target}x" if target else ""),
                     f"{_num(ratio['ratio'])}x{mark}", cmd))
    share = figs["sharing"]
    for kind in ("parallel", "beam"):
        for width, saved in share[kind].items():
            how = "replay" if kind == "parallel" else "engine"
            rows.append((f"Fig. 15 blocks saved, {kind} {'n' if kind == 'parallel' else 'width'}"
                         f" = {width} (alpaca, {how})", PAPER_SHARING[kind], _pct(saved), cmd))
    if "agreement" in figs:
        agr = figs["agreement"]
        tol = agr["tolerance"]
        worst_pp = max(r["share_diff_pp"] for r in agr["policies"].values())
        worst_b = max(r["batch_diff_rel"] for r in agr["policies"].values())
        rows.append(("engine vs replay at scale 1/4: token share, mean batch (worst policy)",
                     f"tolerance {tol['share_pp']} pp, {100 * tol['batch_rel']:.0f} %",
                     f"{worst_pp:.1f} pp, {100 * worst_b:.1f} %", cmd))
    return rows


def summary_table(results: dict) -> str:
    """The table as markdown."""
    lines = ["| figure | paper | ours | command |", "| --- | --- | --- | --- |"]
    lines += [f"| {f} | {p} | {o} | `{c}` |" for f, p, o, c in table_rows(results)]
    return "\n".join(lines)


def _traces_section(results: dict) -> list[str]:
    s = results["settings"]
    lines = ["## Traces", ""]
    for name, d in DATASETS.items():
        lines.append(f"- {name}-like: input log-normal (mean {d.input_mean}, sigma "
                     f"{d.input_sigma}), output log-normal (mean {d.output_mean}, sigma "
                     f"{d.output_sigma}); source: {d.source}.")
    lines += ["- Poisson arrivals; outputs of exactly the drawn length (`ignore_eos`); lengths "
              "clipped to `max_model_len` (prompt < max_model_len, prompt + output <= it)."]
    if "latency" not in results["figures"]:  # the serving figures state their own budgets
        serving = results["serving_settings"]
        return lines + [f"- The real engine's runs: lengths / {serving['scale']:g}, "
                        f"`max_model_len` {serving['max_model_len']}.", ""]
    lines += [f"- Full length: scale 1, `max_model_len` {s['full_len']}, {s['full_blocks']} "
              f"blocks of {s['block_size']} = {s['full_blocks'] * s['block_size']} KV slots "
              "(the paper's Table 1 budget for OPT-13B on one A100-40GB, 15.7K slots).",
              f"- Reduced scale (the real engine): lengths / {s['reduced_scale']:g}, "
              f"`max_model_len` {s['reduced_len']}, {s['reduced_blocks']} blocks.", ""]
    return lines


def _step_model_section(results: dict) -> list[str]:
    m = results["step_model"]
    lines = ["## Step model of the replay", "",
             f"seconds = {m['a']:.4g} + {m['b']:.4g} x tokens + {m['c']:.4g} x context tokens "
             f"(from `{m['file']}`, fitted by least squares on the real engine's steps; its "
             "provenance is in that file)."]
    err = results["figures"].get("step_model_error")
    if err:
        lines.append(f"On this run's {err['steps']} real-engine steps its mean relative error "
                     f"is {100 * err['mean_relative_error']:.1f} %.")
    return lines + [""]


def _memory_section(name: str, fig: dict) -> list[str]:
    t = fig["trace"]
    lines = [f"## {name}", "",
             f"{t['num_requests']} requests at {fig['rate']:g} req/s, mean prompt "
             f"{t['mean_prompt_len']:.1f}, mean output {t['mean_output_len']:.1f} tokens.", "",
             "| policy | tokens / allocated | tokens | reserved unused | internal frag. | free "
             "| mean running | norm. latency mean / p90 (s/token) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p, s in fig["policies"].items():
        sp = s["pool_split"]
        lines.append(f"| {p} | {_pct(s['token_share'])} | {_pct(sp['tokens'])} | "
                     f"{_pct(sp['reserved_unused'])} | {_pct(sp['internal_fragmentation'])} | "
                     f"{_pct(sp['free'])} | {s['mean_running']:.2f} | "
                     f"{_num(s['normalized_latency_mean'], '.3f')} / "
                     f"{_num(s['normalized_latency_p90'], '.3f')} |")
    return lines + [""]


def _latency_section(lat: dict) -> list[str]:
    lines = ["## Fig. 12: normalized latency against request rate (replay, full length)", "",
             f"{lat['dataset']}, {lat['requests_per_rate']} requests per rate, "
             f"{lat['kv_slots']} KV slots. Bound: {lat['bound_rule']} = "
             f"{lat['bound_s_per_token']:.3f} s/token; the sustainable rate is the highest rate "
             "under it (linear interpolation at the crossing).", "",
             "| rate (req/s) | " + " | ".join(f"{p} mean / p90" for p in lat["curves"]) + " |",
             "| --- |" + " --- |" * len(lat["curves"])]
    curves = list(lat["curves"].values())
    for i, point in enumerate(curves[0]):
        cells = [f"{c[i]['mean']:.3f} / {c[i]['p90']:.3f}" for c in curves]
        lines.append(f"| {point['rate']:g} | " + " | ".join(cells) + " |")
    rates = lat["sustainable"]["rates"]
    lines += ["", "Sustainable rates (req/s): " + ", ".join(
        f"{p} {'>= ' if r['censored'] else ''}{_num(r['rate'], '.3f')}"
        for p, r in rates.items()) + ".", "",
        "The ratios under other bounds (x the same lowest-rate latency):", ""]
    for factor, ratios in lat["ratios_by_bound_factor"].items():
        lines.append(f"- {factor:g}x: " + ", ".join(
            f"{k} {_num(v['ratio'])}{' (censored)' if v['censored'] else ''}"
            for k, v in ratios.items()))
    return lines + [""]


def _sharing_section(share: dict) -> list[str]:
    lines = ["## Fig. 15: blocks saved by sharing (paged, alpaca-like, full length)", "",
             "Mean over steps of `shared_blocks_saved / (allocated blocks + saved)` from "
             "`KVCacheManager.memory_stats()`: parallel sampling by replay, beam search on the "
             "real engine (one request's search at a time).", "",
             "| kind | width | saved |", "| --- | --- | --- |"]
    for kind in ("parallel", "beam"):
        for width, saved in share[kind].items():
            lines.append(f"| {kind} | {width} | {_pct(saved)} |")
    return lines + [""]


def _agreement_section(figs: dict) -> list[str]:
    if "agreement" not in figs:
        return ["## Engine against replay", "", "Not run (`--no-engine`).", ""]
    agr = figs["agreement"]
    lines = ["## Engine against replay at the reduced scale", "",
             "| policy | engine tokens/allocated | replay | diff (pp) | engine mean running | "
             "replay | diff | agree |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    real = figs["engine_reduced"]["policies"]
    rep = figs["replay_reduced"]["policies"]
    for p, r in agr["policies"].items():
        lines.append(f"| {p} | {_pct(real[p]['token_share'])} | {_pct(rep[p]['token_share'])} "
                     f"| {r['share_diff_pp']:.1f} | {real[p]['mean_running']:.2f} | "
                     f"{rep[p]['mean_running']:.2f} | {100 * r['batch_diff_rel']:.1f} % | "
                     f"{'yes' if r['agree'] else 'no'} |")
    return lines + [""] + _memory_section("Real engine at the reduced scale",
                                          figs["engine_reduced"])


def markdown(results: dict) -> str:
    """The whole report.md."""
    env = results["environment"]
    figs = results["figures"]
    lines = ["# The vLLM paper's experiments on this engine", "",
             f"`{env['command']}` at commit {env['commit']}, {env['date_utc']} UTC; "
             f"{env['machine']}, torch {env['torch']} ({env['torch_threads']} threads, "
             f"{env['dtype']}).", "", summary_table(results), ""]
    lines += _traces_section(results)
    if "latency" in figs:
        lines += _step_model_section(results)
        for ds in DATASETS:
            lines += _memory_section(f"Fig. 2 and Fig. 13: memory and batch ({ds}, replay, "
                                     "full length)", figs[f"memory_{ds}"])
        lines += _latency_section(figs["latency"]) + _sharing_section(figs["sharing"])
        lines += _agreement_section(figs)
    lines += serving_report.sections(figs)
    return "\n".join(lines)


def plots(results: dict, out: Path) -> list[str]:
    """fig2_memory.png, fig12_latency.png, fig13_batch.png, fig15_sharing.png (when measured),
    then `serving_report.plots`; the names."""
    import matplotlib
    matplotlib.use("Agg")

    figs = results["figures"]
    names = _memory_plots(results, out) if "latency" in figs else []
    return names + serving_report.plots(figs, out, _save)


def _memory_plots(results: dict, out: Path) -> list[str]:
    import matplotlib.pyplot as plt

    figs = results["figures"]
    mem = figs[f"memory_{results['dataset']}"]["policies"]
    names = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = [0.0] * len(mem)
    for part in ("tokens", "reserved_unused", "internal_fragmentation", "free"):
        vals = [100 * s["pool_split"][part] for s in mem.values()]
        ax.bar(list(mem), vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("% of KV slots")
    ax.legend(fontsize=7)
    names.append(_save(fig, out, "fig2_memory.png"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(mem), [s["mean_running"] for s in mem.values()])
    ax.set_ylabel("mean running requests")
    names.append(_save(fig, out, "fig13_batch.png"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for p, curve in figs["latency"]["curves"].items():
        ax.plot([c["rate"] for c in curve], [c["mean"] for c in curve], marker="o", label=p)
    ax.axhline(figs["latency"]["bound_s_per_token"], color="grey", ls="--", label="bound")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    names.append(_save(fig, out, "fig12_latency.png"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    share = figs["sharing"]
    labels = [f"{k} {w}" for k in ("parallel", "beam") for w in share[k]]
    ax.bar(labels, [100 * share[k][w] for k in ("parallel", "beam") for w in share[k]])
    ax.set_ylabel("% blocks saved")
    names.append(_save(fig, out, "fig15_sharing.png"))
    return names


def _save(fig, out: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name


def write(out: Path, results: dict) -> None:
    """Writes report.md, results.json and the plots into `out` (created if needed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "report.md").write_text(markdown(results) + "\n")
