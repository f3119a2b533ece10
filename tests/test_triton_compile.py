"""The native (non-interpreter) path compiles: every kernel is compiled ahead of time for sm_90
(Hopper) without a GPU, in a subprocess without TRITON_INTERPRET, and the main configurations of
the launch table use no local-memory stack (register spills); so do the attention kernels over
fp8/int8 caches and the quantising write_kv, whose fp8 loads and stores must compile to the
native conversions (no interpreter workaround on this path).

The interpreter runs the kernels' Python, not Triton's compiler, so it misses what only the
compiler rejects (a non-constexpr global, a type mismatch in a loop-carried value). On a machine
with a CUDA device the other test files run the native path, so this one is skipped there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("a CUDA device runs the native path in the other tests", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter so that @triton.jit builds JITFunctions, not interpreted ones.
_SCRIPT = r'''
import json, os, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_impl import configs, decode, unified, write_kv

TARGET = GPUTarget("cuda", 90, 32)
DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_kernel(fn, types, consts, num_warps, num_stages):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    # what the launcher's specialisation gives at run time: 16-aligned pointers and strides
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (n.endswith("_ptr") or n.startswith("stride"))}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))
    stack = None
    if os.path.exists(CUOBJDUMP):
        path = tempfile.mktemp(suffix=".cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", path], capture_output=True,
                               text=True).stdout
        os.unlink(path)
        stack = int(usage.split("STACK:")[1].split()[0])
    return {"stack": stack, "shared": k.metadata.shared}


def attention(mode, head, dt, feats, cache=None):
    cfg = configs.launch_config(mode, head, 16, DT[dt], torch.int8 if cache else None)
    flags = dict(HEAD_SIZE=head, HEAD_PAD=configs.padded_head_size(head), BLOCK_SIZE=16,
                 TILE_N=cfg.tile_n, USE_WINDOW=feats, USE_SOFT_CAP=feats, USE_ALIBI=feats,
                 HAS_LSE=feats, IEEE=dt == "fp32", UPCAST=False, KV_SCALED=cache is not None)
    types = {"bt_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_ptr": "*i32", "slopes_ptr": "*fp32",
             "lse_ptr": "*fp32", "scale": "fp32", "soft_cap": "fp32",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    if mode == "decode":
        fn = decode._decode_kernel
        consts = dict(GROUP=4, GROUP_PAD=16, PARTIAL=feats, **flags)
        types["out_ptr"] = "*fp32" if feats else "*" + dt
    else:
        fn = unified._varlen_kernel
        consts = dict(GROUP=4, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_m // 4, **flags)
        types["out_ptr"] = "*" + dt
    types["q_ptr"] = "*" + dt
    for name in ("k_ptr", "v_ptr"):
        types[name] = "*" + (cache or dt)
    return compile_kernel(fn, types, consts, cfg.num_warps, cfg.num_stages)


def write(cache, quant):
    dtype = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2, "i8": torch.int8,
             "bf16": torch.bfloat16}[cache]
    _, max_finite, mantissa, min_exp = write_kv._FORMATS.get(dtype, (0, 0.0, 0, 0))
    return compile_kernel(
        write_kv._write_kv_kernel,
        {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*" + cache,
         "v_cache_ptr": "*" + cache, "slots_ptr": "*i64", "num_slots": "i64",
         "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"},
        dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, QUANT=quant,
             MAX_FINITE=max_finite, MANTISSA=mantissa, MIN_EXP=min_exp, NAN_STAND_IN=0.0), 4, 1)


results = {}
for mode in ("decode", "varlen"):
    for head, dt, feats in ((128, "bf16", True), (128, "bf16", False), (128, "fp32", True),
                            (256, "bf16", False), (80, "fp32", False)):
        results[f"{mode}-{head}-{dt}-{feats}"] = attention(mode, head, dt, feats)
    for head, dt, cache in ((128, "bf16", "fp8e4nv"), (128, "fp32", "i8"), (256, "fp32", "i8"),
                            (256, "bf16", "fp8e5")):
        results[f"{mode}-{head}-{dt}-{cache}"] = attention(mode, head, dt, True, cache)
results["reduce"] = compile_kernel(
    decode._reduce_kernel, {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                            "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32"},
    dict(HEAD_SIZE=128, HEAD_PAD=128, TILE_N=64, USE_WINDOW=True, HAS_LSE=True), 2, 1)
for cache, quant in (("bf16", 0), ("fp8e4nv", 1), ("fp8e5", 1), ("i8", 2)):
    results[f"write_kv-{cache}"] = write(cache, quant)
print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "ModuleNotFoundError: No module named 'triton.backends" in \
            proc.stderr:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm90(compiled: dict) -> None:
    assert len(compiled) == 23
    for name, info in compiled.items():
        assert info["shared"] <= 228 * 1024, name  # an H100/H200 SM's shared memory


def test_table_configs_do_not_spill(compiled: dict) -> None:
    if any(info["stack"] is None for info in compiled.values()):
        pytest.skip("cuobjdump is not bundled with this Triton")
    spilled = {name: info["stack"] for name, info in compiled.items() if info["stack"]}
    assert not spilled, f"register spills (bytes of stack): {spilled}"
