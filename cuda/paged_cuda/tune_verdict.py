"""The rule that turns `bench.tune_decode` rows into the CUDA planner's defaults (docs/cuda.md,
"Tuning on a GPU"), applied by code so a short device call ends with a decision, not a table to
read by hand. The defaults it picks among are settings.py's; a chosen variant's values become
their defaults there.

Rows are tune_decode's: `variant`, `kind`, `batch`, `context`, `q_len` and, when timed, `us`,
`frac_copy` and `rel_err_vs_sdpa`. Times are CUDA-graph replay medians of one call.

- Decode: a `cuda:...` variant without a forced partition that is no slower than `cuda` (the
  default) at every decode shape and faster at the target shape (batch 32 x context 4096)
  becomes the default; among several, the fastest there.
- Prefill: the same for the varlen variants, "faster" meaning at one prefill shape at least.
- Alarm: a forced partition faster than the wave model at the same tile (the model's per-block
  overhead wants refitting).
- The target: every decode shape with batch >= 32 and context >= 4096 at >= 85 % of the copy
  bandwidth measured in the same run.

"No slower" and "faster" allow NOISE: the same kernel timed twice in one call differed by up to
about 1 % (bench/results/2026-11-30-h200-decode-tuning), so a 2 % margin is needed before a
difference is read as one. A variant with an error row, or an error against SDPA above
MAX_REL_ERR, is never chosen.
"""

from __future__ import annotations

from collections.abc import Sequence

from cuda.paged_cuda.settings import PARTITION_ENV as PARTITION

NOISE = 0.02
MAX_REL_ERR = 2e-2  # bf16 operands: 1e-3..1e-2 is rounding, more is a bug
TARGET_FRAC = 0.85
TARGET_SHAPE = ("decode", 32, 4096, 1)

Key = tuple[str, int, int, int]


def _key(row: dict) -> Key:
    return (row["kind"], row["batch"], row["context"], row["q_len"])


def _settings(variant: str) -> dict[str, str]:
    _, _, rest = variant.partition(":")
    return dict(item.split("=", 1) for item in rest.split(",") if item)


def _times(rows: Sequence[dict], kind: str) -> dict[str, dict[Key, float]]:
    """variant -> shape -> microseconds, for the `cuda` variants of `kind` timed without error
    and within MAX_REL_ERR of SDPA; a variant with any failed row is left out."""
    times: dict[str, dict[Key, float]] = {}
    failed = set()
    for r in rows:
        if r["kind"] != kind or not r["variant"].startswith("cuda"):
            continue
        err = r.get("rel_err_vs_sdpa")
        if "us" not in r or (err is not None and not err <= MAX_REL_ERR):
            failed.add(r["variant"])
            continue
        times.setdefault(r["variant"], {})[_key(r)] = r["us"]
    return {v: t for v, t in times.items() if v not in failed}


def _ratios(times: dict[str, dict[Key, float]], variant: str) -> dict[Key, float] | None:
    """The variant's time over the default's at every shape the default was timed at; None
    when it misses one."""
    base, mine = times.get("cuda", {}), times.get(variant, {})
    if not base or any(k not in mine for k in base):
        return None
    return {k: mine[k] / base[k] for k in base}


def pick_default(rows: Sequence[dict], kind: str) -> tuple[str, list[str]]:
    """The variant the rule makes the default for `kind` ("decode" or "prefill"), `cuda` when
    none qualifies, and one line per candidate saying why."""
    times = _times(rows, kind)
    if "cuda" not in times:
        return "cuda", [f"{kind}: the default `cuda` has no clean timing; nothing decided"]
    best, best_ratio, lines = "cuda", 1.0, []
    for variant in times:
        settings = _settings(variant)
        if variant == "cuda" or PARTITION in settings:
            continue
        ratios = _ratios(times, variant)
        if ratios is None:
            lines.append(f"{kind}: {variant}: not timed at every shape")
            continue
        worst = max(ratios.values())
        here = ratios[TARGET_SHAPE] if kind == "decode" and TARGET_SHAPE in ratios \
            else min(ratios.values())
        ok = worst <= 1 + NOISE and here < 1 - NOISE
        lines.append(f"{kind}: {variant}: {here:.3f}x at the key shape, worst {worst:.3f}x"
                     f" -> {'qualifies' if ok else 'no'}")
        if ok and here < best_ratio:
            best, best_ratio = variant, here
    return best, lines


def alarms(rows: Sequence[dict]) -> list[str]:
    """The findings that say to look for a problem before switching anything: each forced
    partition that beats the wave model's at the same tile and shape."""
    out = []
    decode = _times(rows, "decode")
    for variant, mine in decode.items():
        settings = _settings(variant)
        if PARTITION not in settings:
            continue
        model = ",".join(f"{n}={v}" for n, v in settings.items() if n != PARTITION)
        sibling = decode.get("cuda" + (":" + model if model else ""), {})
        for k, us in mine.items():
            if k in sibling and us < sibling[k] * (1 - NOISE):
                out.append(f"{variant} beats the wave model's partition at {k[1]}x{k[2]} "
                           f"({us / sibling[k]:.3f}x): refit MMA_BLOCK_OVERHEAD_KEYS")
    return out


def target(rows: Sequence[dict], variant: str) -> tuple[float | None, bool]:
    """The smallest fraction of copy bandwidth `variant` reached at the target's shapes (batch
    >= 32, context >= 4096, decode), and whether it is >= TARGET_FRAC."""
    fracs = [r["frac_copy"] for r in rows if r["variant"] == variant and r["kind"] == "decode"
             and r["batch"] >= 32 and r["context"] >= 4096 and "frac_copy" in r]
    if not fracs:
        return None, False
    return min(fracs), min(fracs) >= TARGET_FRAC


def verdict(rows: Sequence[dict]) -> dict:
    """Everything the rule decides, as JSON-ready data."""
    decode, decode_why = pick_default(rows, "decode")
    prefill, prefill_why = pick_default(rows, "prefill")
    frac_default, met_default = target(rows, "cuda")
    frac_new, met_new = target(rows, decode)
    return {"decode_default": decode, "prefill_default": prefill,
            "why": decode_why + prefill_why, "alarms": alarms(rows),
            "target": {"cuda": frac_default, "cuda_met": met_default,
                       "chosen": decode, "chosen_frac": frac_new, "chosen_met": met_new}}


def summary_lines(v: dict) -> list[str]:
    """A few lines of at most 80 characters for the end of a report."""
    def frac(x):
        return "-" if x is None else f"{x:.1%}"

    t = v["target"]
    short = {k: v[k].replace("PAGED_KERNELS_CUDA_", "") for k in
             ("decode_default", "prefill_default")}
    return [f"rule: decode -> {short['decode_default']}"[:80],
            f"rule: prefill -> {short['prefill_default']}"[:80],
            f"85% target (b>=32, ctx>=4096): cuda {frac(t['cuda'])}, chosen "
            f"{frac(t['chosen_frac'])}"[:80],
            f"alarms: {len(v['alarms'])}"]
