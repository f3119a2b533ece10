"""Generates docs/support-matrix.md from each backend's declared `Support` and the axes of the
conformance matrix (paged_kernels/conformance.py), so the table and the test suite's skips cannot
disagree.

    python tools/support_matrix.py               # rewrite docs/support-matrix.md
    python tools/support_matrix.py --check       # exit 1 if the committed file is stale
    python tools/support_matrix.py --available   # also print which backends run on this machine

A backend's declaration is read WITHOUT instantiating it, so that the file is the same on every
machine (a CUDA backend is listed on a machine without a GPU): the module named in the registry is
imported and its declaration taken from, in order,
1. a module-level `SUPPORT` constant (a `paged_kernels.abi.Support`), the convention for backends
   whose instances are device-dependent;
2. the one `Support` instance among the factory class's own attributes (e.g. a class constant).
A backend whose module cannot be imported, or that declares its `Support` only on an instance, is
listed as "declaration not importable here", with the reason.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from paged_kernels import backends, conformance  # noqa: E402
from paged_kernels.abi import FEATURES, FLOAT_DTYPES, Support  # noqa: E402

DOC = ROOT / "docs" / "support-matrix.md"
COMMAND = "python tools/support_matrix.py"


@dataclass(frozen=True)
class Declaration:
    """A backend's declared support, or None with the reason it could not be read here."""

    backend: str
    support: Optional[Support]
    source: str  # "module.attribute" it was read from, or why it could not be read
    factory: str = ""  # "module:attribute" of the backend's factory in the registry
    summary: str = ""  # the first line of the factory's docstring
    block_ops: str = ""  # the factory's `Backend.block_ops`: whose copy_blocks/swap_blocks


def _factory_path(name: str) -> tuple[str, str]:
    # The registry maps a name to "module:factory" (paged_kernels/backends.py); there is no public
    # accessor for the path, and instantiating would make the table depend on this machine.
    module, attr = backends.factory_path(name).split(":")
    return module, attr


def _class_support(factory: object) -> Optional[tuple[str, Support]]:
    """The single Support instance among the attributes of `factory`'s class hierarchy."""
    if not isinstance(factory, type):
        return None
    found = {(k, v) for cls in factory.__mro__ for k, v in vars(cls).items()
             if isinstance(v, Support)}
    if len(found) != 1:
        return None
    return next(iter(found))


def declaration(name: str) -> Declaration:
    """Reads backend `name`'s declared Support without instantiating it."""
    module_name, attr = _factory_path(name)
    factory = f"{module_name}:{attr}"
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is a fact about this machine, reported as such
        return Declaration(name, None, f"declaration not importable here: {module_name} "
                                       f"({type(exc).__name__}: {exc})", factory)
    constant = getattr(module, "SUPPORT", None)
    cls = getattr(module, attr, None)
    summary = (getattr(cls, "__doc__", None) or "").strip().split("\n")[0]
    block_ops = getattr(cls, "block_ops", "")
    if isinstance(constant, Support):
        return Declaration(name, constant, f"{module_name}.SUPPORT", factory, summary, block_ops)
    found = _class_support(cls)
    if found is not None:
        return Declaration(name, found[1], f"{module_name}.{attr}.{found[0]}", factory, summary,
                           block_ops)
    return Declaration(name, None, f"declaration not importable here: {module_name} has no "
                                   "module-level SUPPORT and its factory declares Support only "
                                   "on an instance", factory)


def declarations() -> list[Declaration]:
    """Every registered backend's declaration, in registry order."""
    return [declaration(n) for n in backends.registered_backends()]


# --- formatting ---------------------------------------------------------------------------------

def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _dtypes(s: Support) -> str:
    return ", ".join(_dtype(d) for d in FLOAT_DTYPES if d in s.dtypes)


def _kv_cache_dtypes(s: Support) -> str:
    """The 8-bit cache dtypes a declaration lists, or "none" (float caches only)."""
    listed = [_dtype(d) for d in conformance.KV_CACHE_DTYPES if d in s.kv_cache_dtypes]
    return ", ".join(listed) or "none"


def _sizes(allowed: Optional[frozenset[int]], maximum: Optional[int]) -> str:
    if allowed is not None:
        text = ", ".join(str(v) for v in sorted(allowed))
        if maximum is not None:
            text += f" (at most {maximum})"
        return text
    return "any" if maximum is None else f"any up to {maximum}"


def _features(s: Support) -> str:
    missing = [f for f in FEATURES if f not in s.features]
    if not missing:
        return "all"
    return "all but " + ", ".join(missing)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _row(cells: Iterable[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    return [_row(header), _row("---" for _ in header), *(_row(r) for r in rows)]


# --- the conformance matrix as seen by one declaration ------------------------------------------

def _why(s: Support, config: conformance.Config, device_type: str) -> Optional[str]:
    return s.unsupported(config.dtype, config.head_size, config.block_size,
                         config.api_features(), device_type, config.kv_cache_dtype)


def coverage(s: Support, configs: Sequence[conformance.Config],
             device_type: str) -> tuple[int, Counter]:
    """(configs run, skip reasons with counts) of `configs` on `device_type`, as the conformance
    suite would decide them from this declaration."""
    reasons: Counter = Counter()
    run = 0
    for config in configs:
        why = _why(s, config, device_type)
        if why is None:
            run += 1
        else:
            reasons[why] += 1
    return run, reasons


def _axis_support(s: Support) -> list[tuple[str, str]]:
    """For each axis of the matrix, which of its values the declaration accepts."""
    def head_ok(h: int) -> bool:
        return ((s.head_sizes is None or h in s.head_sizes)
                and (s.max_head_size is None or h <= s.max_head_size))

    def block_ok(b: int) -> bool:
        return ((s.block_sizes is None or b in s.block_sizes)
                and (s.max_block_size is None or b <= s.max_block_size))

    def marks(values: Iterable[object], ok) -> str:
        return " ".join(f"{v}" if ok(v) else f"~~{v}~~" for v in values)

    return [
        ("dtype", marks((_dtype(d) for d in conformance.DTYPES),
                        lambda n: getattr(torch, n) in s.dtypes)),
        ("head size", marks(conformance.HEAD_SIZES, head_ok)),
        ("block size", marks(conformance.BLOCK_SIZES, block_ok)),
        ("feature", marks(FEATURES, lambda f: f in s.features)),
        ("8-bit KV cache", marks((_dtype(d) for d in conformance.KV_CACHE_DTYPES),
                                 lambda n: getattr(torch, n) in s.kv_cache_dtypes)),
    ]


# --- the document -------------------------------------------------------------------------------

def _overview(decls: Sequence[Declaration]) -> list[str]:
    rows = []
    for d in decls:
        s = d.support
        if s is None:
            rows.append((f"`{d.backend}`", "?", "?", "?", "?", "?", "?"))
            continue
        rows.append((f"`{d.backend}`", ", ".join(sorted(s.device_types)), _dtypes(s),
                     _kv_cache_dtypes(s), _sizes(s.head_sizes, s.max_head_size),
                     _sizes(s.block_sizes, s.max_block_size), _features(s)))
    return _table(("backend", "device types", "dtypes", "8-bit KV caches", "head sizes",
                   "block sizes", "features"), rows)


def _backend_section(d: Declaration, fast: Sequence[conformance.Config],
                     exhaustive: Sequence[conformance.Config]) -> list[str]:
    lines = [f"## `{d.backend}`", ""]
    s = d.support
    if s is None:
        return lines + [f"Not listed: {d.source}.", ""]
    lines += [f"Declared in `{d.source}`.", ""]
    lines += _table(("", "supported"), [
        ("device types", ", ".join(sorted(s.device_types))),
        ("dtypes", _dtypes(s)),
        ("8-bit KV caches", _kv_cache_dtypes(s)),
        ("head sizes", _sizes(s.head_sizes, s.max_head_size)),
        ("block sizes", _sizes(s.block_sizes, s.max_block_size)),
        *((f"feature `{f}`", _yes(f in s.features)) for f in FEATURES),
    ])
    lines += ["", "Conformance axes (~~struck~~: declared unsupported, skipped with the reason):",
              ""]
    lines += [f"- {axis}: {values}" for axis, values in _axis_support(s)]
    lines += ["", "Reasons for the limits:", ""]
    lines += [f"- `{key}`: {text}" for key, text in s.reasons] or ["- (none declared)"]
    lines += ["", "Configurations of the conformance matrix it runs (the rest are skipped):", ""]
    rows, skips = [], {}
    for device_type in sorted(s.device_types):
        run_fast, why_fast = coverage(s, fast, device_type)
        run_all, _ = coverage(s, exhaustive, device_type)
        rows.append((device_type, f"{run_fast} / {len(fast)}", f"{run_all} / {len(exhaustive)}"))
        skips[device_type] = why_fast
    lines += _table(("device", "fast (CI)", "exhaustive"), rows)
    for device_type, why in skips.items():
        if why:
            lines += ["", f"Skips in the fast matrix on `{device_type}`:", ""]
            lines += [f"- {n} x {reason}" for reason, n in sorted(why.items())]
    return lines + [""]


def _where(decls: Sequence[Declaration]) -> list[str]:
    rows = []
    for d in decls:
        if d.support is None:
            rows.append((f"`{d.backend}`", "?", f"`{d.factory}`", d.source))
            continue
        note = dict(d.support.reasons).get("device_types") or d.summary
        rows.append((f"`{d.backend}`", ", ".join(sorted(d.support.device_types)),
                     f"`{d.factory}`", note))
    return _table(("backend", "device types", "factory", "notes"), rows)


def _block_ops(decls: Sequence[Declaration]) -> list[str]:
    return _table(("backend", "copy_blocks / swap_blocks"),
                  [(f"`{d.backend}`", d.block_ops or "?") for d in decls])


def _axes(fast: Sequence[conformance.Config],
          exhaustive: Sequence[conformance.Config]) -> list[str]:
    feature_sets = ", ".join("+".join(f) or "plain" for f in conformance.FEATURE_SETS)
    return [
        f"- dtypes: {', '.join(_dtype(d) for d in conformance.DTYPES)}",
        f"- head sizes: {', '.join(map(str, conformance.HEAD_SIZES))}",
        f"- block sizes: {', '.join(map(str, conformance.BLOCK_SIZES))}",
        "- (query heads, KV heads): " + ", ".join(f"({h}, {k})"
                                                   for h, k in conformance.HEAD_LAYOUTS),
        f"- batch compositions: {', '.join(conformance.BATCHES)}",
        f"- feature sets: {feature_sets}",
        "- KV cache dtypes: the query's dtype, and the 8-bit "
        f"{', '.join(_dtype(d) for d in conformance.KV_CACHE_DTYPES)} with scales "
        f"{' or '.join(conformance.SCALE_FORMS)}",
        f"- fast matrix (CI): {len(fast)} configurations, one axis at a time around "
        f"`{conformance.Config().id}`; exhaustive (`pytest --exhaustive`): {len(exhaustive)}, "
        "every axis crossed (the 8-bit caches with no feature and with all at once).",
    ]


def render(decls: Sequence[Declaration], fast: Sequence[conformance.Config],
           exhaustive: Sequence[conformance.Config]) -> str:
    """The whole markdown document."""
    lines = [
        "# Support matrix",
        "",
        f"Generated by `{COMMAND}` from each backend's declared `Support` "
        "(`paged_kernels/abi.py`) and the axes of the conformance matrix "
        "(`paged_kernels/conformance.py`); do not edit by hand. "
        "`tests/test_support_matrix.py` fails when this file is stale. The conformance suite "
        "(`tests/test_conformance.py`) skips exactly the configurations a declaration excludes, "
        "with the reason shown below.",
        "",
        "A backend outside its declaration raises `NotImplementedError` naming the property; "
        "it never falls back silently to another backend.",
        "",
        *_overview(decls),
        "",
        "## Where each backend runs",
        "",
        *_where(decls),
        "",
        f"What is available on a given machine: `{COMMAND} --available` (or "
        "`paged_kernels.available_backends()` / `unavailable_backends()`).",
        "",
        "## Cache block operations",
        "",
        "Each backend declares (`Backend.block_ops`) whether it runs the generic PyTorch "
        "`copy_blocks` / `swap_blocks` of `paged_kernels/cache_ops.py` or kernels of its own.",
        "",
        *_block_ops(decls),
        "",
        "## Conformance axes",
        "",
        *_axes(fast, exhaustive),
        "",
    ]
    for d in decls:
        lines += _backend_section(d, fast, exhaustive)
    return "\n".join(lines).rstrip("\n") + "\n"


def generate() -> str:
    """The document for the current declarations and matrix."""
    return render(declarations(), conformance.fast_matrix(),
                  list(conformance.exhaustive_matrix()))


def _print_available() -> None:
    print("available here:", ", ".join(backends.available_backends()) or "none")
    for name, why in backends.unavailable_backends().items():
        print(f"unavailable here: {name}: {why}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/support-matrix.md differs from what would be written")
    parser.add_argument("--available", action="store_true",
                        help="also print which backends are available on this machine")
    args = parser.parse_args(argv)
    text = generate()
    if args.available:
        _print_available()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is stale; refresh it with: {COMMAND}")
            return 1
        print(f"{DOC.relative_to(ROOT)} is up to date")
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
