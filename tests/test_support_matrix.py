"""docs/support-matrix.md is generated from the backends' declarations (tools/support_matrix.py):
it must be current, promise no more than the backends available here support on their instances,
and count the conformance matrix's skips the way the conformance suite decides them."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import paged_kernels as pk
from paged_kernels import conformance
from paged_kernels.abi import FEATURES, Support
from paged_kernels.backends import GENERIC_BLOCK_OPS, Backend, factory_path

ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    spec = importlib.util.spec_from_file_location("support_matrix",
                                                  ROOT / "tools" / "support_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def test_committed_support_matrix_is_current() -> None:
    committed = tool.DOC.read_text() if tool.DOC.exists() else ""
    assert committed == tool.generate(), (
        f"docs/support-matrix.md is stale: refresh it with `{tool.COMMAND}` and commit it")


def test_check_flag_reports_a_stale_file(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(tool, "DOC", tmp_path / "support-matrix.md")
    tool.DOC.write_text("stale\n")
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    assert tool.main(["--check"]) == 1
    assert tool.COMMAND in capsys.readouterr().out
    assert tool.main([]) == 0 and tool.main(["--check"]) == 0


def _within(sizes: object, maximum: object, declared_sizes: object, declared_max: object) -> bool:
    """Whether (sizes, maximum) allows no size that (declared_sizes, declared_max) excludes."""
    if declared_sizes is not None and (sizes is None or not sizes <= declared_sizes):
        return False
    return declared_max is None or (maximum is not None and maximum <= declared_max)


@pytest.mark.parametrize("name", pk.registered_backends())
def test_instance_here_supports_no_more_than_declared(name: str) -> None:
    """A backend that runs here supports on its instance the declared dtypes and features, on
    declared device types and sizes (a narrowed build may support fewer sizes, never more)."""
    if name not in pk.available_backends():
        pytest.skip(f"{name} unavailable here: {pk.unavailable_backends().get(name)}")
    declared = tool.declaration(name).support
    if declared is None:
        pytest.skip(f"{name}: {tool.declaration(name).source}")
    actual = pk.get_backend(name).support
    assert actual.device_types <= declared.device_types
    assert actual.dtypes == declared.dtypes and actual.features == declared.features
    assert actual.kv_cache_dtypes == declared.kv_cache_dtypes
    assert _within(actual.head_sizes, actual.max_head_size, declared.head_sizes,
                   declared.max_head_size), (actual, declared)
    assert _within(actual.block_sizes, actual.max_block_size, declared.block_sizes,
                   declared.max_block_size), (actual, declared)


@pytest.mark.parametrize("name", pk.registered_backends())
def test_block_ops_declaration_names_what_runs(name: str) -> None:
    """Each backend declares `block_ops` on its own class: the generic ones exactly when it
    keeps `Backend`'s copy_blocks and swap_blocks, and the table shows it."""
    module, attr = factory_path(name).split(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        pytest.skip(f"{module} is not importable here: {exc}")
    assert "block_ops" in vars(cls), f"{cls.__name__} does not declare block_ops"
    own = [m for m in ("copy_blocks", "swap_blocks") if getattr(cls, m) is not getattr(Backend, m)]
    assert own == ([] if cls.block_ops == GENERIC_BLOCK_OPS else ["copy_blocks", "swap_blocks"])
    assert f"| `{name}` | {cls.block_ops} |" in tool.generate()


LIMITED = Support(dtypes=frozenset({torch.float16, torch.bfloat16}),
                  device_types=frozenset({"cuda"}),
                  features=frozenset(FEATURES) - {"alibi"},
                  max_head_size=128, block_sizes=frozenset({16, 32}),
                  reasons=(("max_head_size", "accumulators live in registers"),))


def test_coverage_counts_match_a_direct_count() -> None:
    fast = conformance.fast_matrix()
    run, reasons = tool.coverage(LIMITED, fast, "cuda")
    expected_run = sum(
        c.dtype != torch.float32 and c.head_size <= 128 and c.block_size in (16, 32)
        and "alibi" not in c.features and c.kv_cache_dtype is None for c in fast)
    assert run == expected_run and 0 < run < len(fast)
    assert sum(reasons.values()) == len(fast) - run
    assert any("dtype torch.float32" in r for r in reasons)
    assert any("KV cache dtype torch.int8 (8-bit cache dtypes supported: none)" in r
               for r in reasons)
    with_int8 = replace(LIMITED, kv_cache_dtypes=frozenset({torch.int8}))
    run_int8, _ = tool.coverage(with_int8, fast, "cuda")
    assert run_int8 == run + sum(
        c.dtype != torch.float32 and c.head_size <= 128 and c.block_size in (16, 32)
        and "alibi" not in c.features and c.kv_cache_dtype == torch.int8 for c in fast) > run
    run_cpu, reasons_cpu = tool.coverage(LIMITED, fast, "cpu")
    assert run_cpu == 0 and all(r.startswith("device type 'cpu'") for r in reasons_cpu)


def test_render_shows_limits_reasons_and_unreadable_declarations() -> None:
    decls = [tool.Declaration("fast", replace(LIMITED, kv_cache_dtypes=frozenset({torch.int8})),
                              "somewhere.SUPPORT"),
             tool.Declaration("ghost", None, "declaration not importable here: no module")]
    text = tool.render(decls, conformance.fast_matrix(), conformance.fast_matrix())
    assert ("| `fast` | cuda | float16, bfloat16 | int8 | any up to 128 | 16, 32 | all but alibi |"
            in text)
    assert "~~256~~" in text and "~~float32~~" in text and "~~alibi~~" in text
    assert "- 8-bit KV cache: ~~float8_e4m3fn~~ ~~float8_e5m2~~ int8" in text
    assert "- `max_head_size`: accumulators live in registers" in text
    assert "| `ghost` | ? |" in text and "declaration not importable here: no module" in text
