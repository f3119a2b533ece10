"""bench/decode_roofline.py: what it counts per matmul and attention call against direct counts
(the operand `_linear` really reads, the K/V of every visible position), its arithmetic, and a
small run on the default model whose per-step counts equal the model's own sizes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repo root

import engine.model.decoder as decoder  # noqa: E402
from bench import decode_roofline  # noqa: E402
from engine.model import layer_loop  # noqa: E402
from engine.model.quant import GGUFBlocks, QuantizedWeight  # noqa: E402
from engine.model.quant_int8 import pack_int8  # noqa: E402
from engine.model.quant_tiled import pack_tiled  # noqa: E402
from test_quant import random_blocks  # noqa: E402


def weights(dtype: torch.dtype) -> dict[str, QuantizedWeight]:
    """One Q4_1 [48, 64] weight in each of the forms `_linear` can read."""
    raw = random_blocks(np.random.default_rng(5), "Q4_1", 48, 64)
    blocks = GGUFBlocks("Q4_1", torch.from_numpy(raw), 64)
    dense = torch.zeros(48, 64, dtype=dtype)
    forms = {"blocks": QuantizedWeight(blocks, dense, max_rows=4),
             "int8": QuantizedWeight(blocks, dense, max_rows=4, int8=pack_int8(blocks))}
    if dtype == torch.bfloat16:
        forms["tiled"] = QuantizedWeight(pack_tiled(blocks), dense, max_rows=4)
    return forms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 5])
def test_operand_is_what_linear_reads(monkeypatch, dtype: torch.dtype, rows: int) -> None:
    """`QuantizedWeight.operand` names the tensor the model's `_linear` passes to its kernel:
    each kernel entry point is replaced by one that records the tensor it was given."""
    seen: list[torch.Tensor] = []

    def record(name: str):
        def kernel(x: torch.Tensor, operand, *args, **kwargs) -> torch.Tensor:
            seen.append(operand.packed if name != "quantized" else operand.data)
            return torch.zeros(x.shape[0], 48, dtype=x.dtype)
        return kernel

    monkeypatch.setattr(decoder, "int8_linear", record("int8"))
    monkeypatch.setattr(decoder, "tiled_linear", record("tiled"))
    monkeypatch.setattr(decoder, "quantized_linear", record("quantized"))
    monkeypatch.setattr(decoder.F, "linear", lambda x, w, b=None: seen.append(w) or x @ w.T)
    x = torch.randn(rows, 64).to(dtype)
    for form, weight in weights(dtype).items():
        seen.clear()
        decoder._linear(x, weight)
        assert len(seen) == 1 and seen[0] is weight.operand(rows), form
        want = seen[0].numel() * seen[0].element_size()
        assert decode_roofline.weight_bytes(weight, rows) == want


def test_counting_linear_counts_flops_and_bytes(monkeypatch) -> None:
    monkeypatch.setattr(decode_roofline, "WORK", {"matmul_flop": 0.0, "matmul_bytes": 0.0})
    weight = torch.randn(48, 64)
    linear = decode_roofline.counting_linear(lambda x, w, b=None: x @ w.T)
    out = linear(torch.randn(3, 64), weight)
    assert out.shape == (3, 48)
    assert decode_roofline.WORK == {"matmul_flop": 2.0 * 3 * 48 * 64, "matmul_bytes": 48 * 64 * 4}


@pytest.mark.parametrize("window", [None, 5])
def test_counting_run_counts_every_visible_position(monkeypatch, window) -> None:
    monkeypatch.setattr(decode_roofline, "WORK", {"kv_bytes": 0.0})
    plan = SimpleNamespace(seq_lens=torch.tensor([3, 9, 17], dtype=torch.int32),
                           sliding_window=window)
    key_cache = torch.zeros(10, 2, 4, 16, dtype=torch.bfloat16)
    value_cache = torch.zeros(10, 2, 4, 16, dtype=torch.int8)
    calls = []
    run = decode_roofline.counting_run(lambda *a, **k: calls.append(a) or "out")
    for _ in range(3):  # three layers of one step
        assert run(plan, "query", key_cache, value_cache) == "out"
    positions = 3 + 9 + 17 if window is None else 3 + 5 + 5
    assert len(calls) == 3
    assert decode_roofline.WORK["kv_bytes"] == 3 * positions * (2 * 16 * 2 + 2 * 16 * 1)


def test_roofline_rates_and_floors() -> None:
    row = {"steps": 2, "step_ms": 10.0, "matmul_ms": 4.0, "attention_ms": 2.0}
    work = {"matmul_flop": 8e9, "matmul_bytes": 40e6, "kv_bytes": 20e6}
    ceilings = {"read_GBps": 10.0, "copy_GBps": 99.0, "matmul_TFLOPs": 1.0}  # floors: read
    r = decode_roofline.roofline(row, work, ceilings)
    assert r["matmul_GFLOPs"] == pytest.approx(1000.0)   # 4 GFLOP in 4 ms
    assert r["matmul_GBps"] == pytest.approx(5.0)       # 20 MB in 4 ms
    assert r["matmul_floor_ms"] == pytest.approx(4.0)   # flops: 4 GFLOP at 1 TFLOP/s > 2 ms
    assert r["attention_GBps"] == pytest.approx(5.0) and r["attention_floor_ms"] == 1.0
    assert r["step_floor_ms"] == pytest.approx(5.0) and r["step_of_floor"] == pytest.approx(0.5)
    ceilings["int8_matmul_TOPs"] = 4.0  # int8 activations: their own peak
    r8 = decode_roofline.roofline(row, work, ceilings, int8=True)
    assert r8["matmul_of_peak"] == pytest.approx(0.25)   # 1 TOP/s of 4
    assert r8["matmul_floor_ms"] == pytest.approx(2.0)   # bytes: 20 MB at 10 GB/s > 1 ms
    assert r8["matmul_peak"] == "int8 matmul"
    ceilings["int8_block_TOPs"] = 2.0  # measured where the CPU has AVX-512 VNNI: it wins
    r8 = decode_roofline.roofline(row, work, ceilings, int8=True)
    assert r8["matmul_of_peak"] == pytest.approx(0.5) and r8["matmul_peak"] == "int8 block mix"
    assert r8["matmul_floor_ms"] == pytest.approx(2.0)
    assert decode_roofline.roofline(row, work, ceilings)["matmul_peak"] == "matmul"


def test_small_run_counts_the_models_own_sizes(tmp_path: Path, monkeypatch) -> None:
    """Two decode steps at batch 2 on the default model: per step, the matmul flops and bytes
    are the model's matmuls at 2 rows (30 layers' four projections and the LM head), and the
    K/V bytes are every layer's cache rows for the sequences' lengths."""
    from engine.model.loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    # the run wraps these module-wide: restore them for the other tests of this process
    for owner, name in ((decoder, "_linear"), (decoder.AttentionPlan, "run"),
                        (decoder.AttentionPlan, "write_kv"), (layer_loop.LayerLoop, "run"),
                        (layer_loop, "timers")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(decoder, "_profiled", False, raising=False)
    out = tmp_path / "roofline.json"
    decode_roofline.main(["--batch", "2", "--steps", "2", "--prompt-len", "16", "--copy-mib", "8",
                          "--read-mib", "8",
                          "--matmul-n", "128", "--threads", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["ceilings"]["copy_GBps"] > 0 and report["ceilings"]["matmul_TFLOPs"] > 0
    assert report["ceilings"]["read_GBps"] > 0 and report["ceilings"]["read_bytes"] == 8 << 20
    assert report["ceilings"]["int8_matmul_TOPs"] > 0
    from engine.model.loader import load_model

    model = load_model(None, dtype=torch.bfloat16, quantization="auto").model
    linears = [m for layer in model.layers
               for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    linears.append(model.lm_head)
    assert row["matmul_GFLOP"] == pytest.approx(
        sum(2 * 2 * w.shape[0] * w.shape[1] for w in linears) / 1e9)
    assert row["matmul_MB"] == pytest.approx(
        sum(decode_roofline.weight_bytes(w, 2) for w in linears) / 1e6)
    cfg = model.config
    per_position = len(model.layers) * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    # timed decode steps see lengths 16 + 4 and 16 + 5 (prefill's token, 3 warm-up steps)
    assert row["attention_MB"] == pytest.approx(2 * (20 + 21) / 2 * per_position / 1e6)
    assert 0 < row["step_of_floor"] and row["step_floor_ms"] > 0
