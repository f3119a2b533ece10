"""The CUDA compile check (no GPU needed) and the backend's absence on a machine without one.

`test_every_kernel_compiles_without_hot_spills` compiles every `cuda/csrc/*.cu` to cubins for
sm_80 and sm_90 with `-Xptxas -v` and fails if a hot kernel (decode, varlen) spills to local
memory. For sm_90 (the H200 this project runs on) it compiles every instantiation, every head
size included, because a spill can show at one head size only (a fully unrolled decode copy loop
spilled at head sizes 96, 112 and 192 and nowhere else, on both archs); for sm_80 the reduced
set (head sizes 64 and 128: every dtype, GQA group tile, kernel and copy unit). The NVRTC check
compiles the reduced set for both archs: what it adds to the nvcc check is NVRTC's front end
over the run-time path's header, and the head size only sets template arguments there.
`PAGED_KERNELS_FULL_CUDA_CHECK=1` checks every head size on both archs in both checks, `=0` the
reduced set on both (see `check_head_sizes`). Skipped when nvcc is absent.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import importlib.util
import math
import os
import re
from pathlib import Path

import pytest

import paged_kernels as pk
from cuda.paged_cuda import build, launch, params, planner, settings

FULL_ENV = "PAGED_KERNELS_FULL_CUDA_CHECK"
NVCC = build.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or PATH)")


@pytest.fixture(scope="module")
def cubin_dir(tmp_path_factory) -> Path:
    """Where `reports` leaves the cubins (`<source stem>.sm<arch>.cubin`)."""
    return tmp_path_factory.mktemp("cubins")


ARCHS = ("80", "90")


def check_head_sizes() -> dict[str, tuple[int, ...]]:
    """Arch -> the head sizes the compile checks build for it: by default every head size for
    sm_90 and 64 and 128 for sm_80; `PAGED_KERNELS_FULL_CUDA_CHECK=1` every head size for both,
    `=0` 64 and 128 for both."""
    mode = os.environ.get(FULL_ENV, "")
    if mode not in ("", "0", "1"):
        raise ValueError(f"{FULL_ENV}: expected 0, 1 or unset, got {mode!r}")
    full_archs = {"": ("90",), "0": (), "1": ARCHS}[mode]
    return {arch: params.HEAD_SIZES if arch in full_archs else params.REDUCED_HEAD_SIZES
            for arch in ARCHS}


@pytest.fixture(scope="module")
def reports(cubin_dir) -> list[build.KernelReport]:
    reduced = [arch for arch, sizes in check_head_sizes().items()
               if sizes == params.REDUCED_HEAD_SIZES]
    jobs = max(2, min(8, os.cpu_count() or 2))
    return build.compile_cubins(cubin_dir, ARCHS, reduced_archs=reduced, jobs=jobs)


def _cuobjdump() -> str | None:
    """CUDA's cuobjdump, else the one Triton's wheel carries (a dev dependency), else None."""
    import shutil

    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    bundled = Path(list(spec.submodule_search_locations)[0]) / "backends/nvidia/bin/cuobjdump"
    return str(bundled) if bundled.exists() else None


def _sass_by_function(cubin: Path) -> dict[str, str]:
    """Mangled kernel name -> its SASS, from `cuobjdump --dump-sass`."""
    import subprocess

    text = subprocess.run([_cuobjdump(), "--dump-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    parts = re.split(r"^\s*Function : (\S+)\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


@needs_nvcc
@pytest.mark.skipif(_cuobjdump() is None, reason="no cuobjdump (CUDA's or Triton's)")
@pytest.mark.parametrize("arch", ["80", "90"])
def test_hot_kernels_use_the_instructions_they_were_written_for(reports, cubin_dir, arch):
    """The SASS of every 16-bit decode and varlen kernel: K/V arrive by 16-byte cp.async that
    bypasses L1 (LDGSTS.E.BYPASS.128), operands by ldmatrix (LDSM, V transposed), products on
    tensor cores (HMMA.16816, float32 accumulators), nothing in local memory (LDL/STL); the
    decode kernel's L2 prefetch is one bulk prefetch per row on sm_90 (UBLKPF.L2) and line
    prefetches on sm_80 (CCTL.E.PF2)."""
    checked = 0
    for dtype in ("f16", "bf16"):
        for name, sass in _sass_by_function(cubin_dir / f"pk_attention_{dtype}.sm{arch}.cubin"
                                            ).items():
            decode = "pk_decode_mma_kernel" in name
            if not (decode or "pk_varlen_mma_async_kernel" in name):
                continue
            checked += 1
            for want in ("LDGSTS.E.BYPASS.128", "LDSM.16.M88.4", "LDSM.16.MT88.4",
                         "HMMA.16816.F32"):
                assert want in sass, f"{name} sm_{arch}: no {want}"
            assert not re.search(r"\b(LDL|STL)\b", sass), f"{name} sm_{arch}: local memory"
            if decode:
                assert ("UBLKPF.L2" if arch == "90" else "CCTL.E.PF2") in sass, name
    assert checked >= 8, f"only {checked} kernels found in the sm_{arch} cubins"


@needs_nvcc
def test_every_kernel_compiles_without_hot_spills(reports) -> None:
    print("\n" + build.format_report(reports))
    spilling = [f"{r.arch} {r.name}: {r.spill_stores} B stores / {r.spill_loads} B loads"
                for r in reports if r.hot and r.spills]
    assert not spilling, "hot kernels spill to local memory:\n" + "\n".join(spilling)


@needs_nvcc
def test_every_planned_kernel_is_compiled_for_both_archs(reports) -> None:
    compiled = {(r.arch, r.name.split("(")[0].replace("void ", "")) for r in reports}
    for arch, head_sizes in check_head_sizes().items():
        missing = sorted(n for n in _instantiations(head_sizes)
                         if (f"sm_{arch}", n) not in compiled)
        assert not missing, f"sm_{arch}: not compiled: {missing}"


def _instantiations(head_sizes: tuple[int, ...]) -> set[str]:
    """The kernels that every build at `head_sizes` must hold."""
    wanted = set()
    for ctype in params.CTYPES.values():
        wanted.add(f"pk_write_kv_quant_kernel<{ctype}>")
        for d in head_sizes:
            if ctype == "float":
                wanted.add(f"pk_varlen_simt_kernel<{ctype}, {d}>")
                wanted |= {f"pk_decode_kernel<{ctype}, {d}, {g}>" for g in planner.GROUP_TILES}
            else:
                wanted |= {f"pk_varlen_mma_async_kernel<{ctype}, {d}, 4>",
                           f"pk_varlen_mma_async_kernel<{ctype}, {d}, 8>",
                           f"pk_decode_mma_kernel<{ctype}, {d}, 4>",
                           f"pk_decode_mma_kernel<{ctype}, {d}, 2>"}
        wanted.add(f"pk_decode_reduce_kernel<{ctype}>")
    for d in head_sizes:  # 8-bit caches, every query dtype
        wanted.add(f"pk_varlen_simt_kernel<{params.KV8_CTYPE}, {d}>")
        wanted |= {f"pk_decode_kernel<{params.KV8_CTYPE}, {d}, {g}>" for g in planner.GROUP_TILES}
    return wanted


def test_check_head_sizes_follow_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(FULL_ENV, raising=False)
    assert check_head_sizes() == {"80": params.REDUCED_HEAD_SIZES, "90": params.HEAD_SIZES}
    monkeypatch.setenv(FULL_ENV, "1")
    assert set(check_head_sizes().values()) == {params.HEAD_SIZES}
    monkeypatch.setenv(FULL_ENV, "0")
    assert set(check_head_sizes().values()) == {params.REDUCED_HEAD_SIZES}
    monkeypatch.setenv(FULL_ENV, "yes")
    with pytest.raises(ValueError, match=FULL_ENV):
        check_head_sizes()


def _problem(dtype, heads: tuple[int, int], q_lens, head_size: int = 128, block_size: int = 16,
             cache_dtype=None):
    """A checked problem on the CPU (contents do not matter for planning); `cache_dtype` an
    8-bit cache dtype, or None for a cache of `dtype`."""
    import torch

    num_heads, num_kv_heads = heads
    num_seqs = 3
    tokens = num_seqs if q_lens is None else sum(q_lens)
    q = torch.zeros(tokens, num_heads, head_size, dtype=dtype)
    cache = torch.zeros(40, num_kv_heads, block_size, head_size, dtype=cache_dtype or dtype)
    scales = {} if cache_dtype is None else {"k_scale": 1.0, "v_scale": 1.0}
    tables = torch.zeros(num_seqs, 12, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), 100, dtype=torch.int32)
    cu = None if q_lens is None else torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                                  dtype=torch.int32)
    return pk.abi.check_attention_args(q, cache, cache, tables, seq_lens, cu_seqlens_q=cu,
                                       **scales)


PLANNED = [(dtype, heads, q_lens) for dtype in ("float32", "float16", "bfloat16")
           for heads in ((4, 4), (8, 4), (6, 2), (8, 1), (64, 2)) for q_lens in (None, [5, 1, 9])]
#: 8-bit caches: (cache dtype, query dtype, heads, q_lens); every GQA group tile, both kinds
PLANNED_KV8 = [(cache, dtype, heads, q_lens) for cache, dtype in (("float8_e4m3fn", "bfloat16"),
                                                                  ("int8", "float32"),
                                                                  ("float8_e5m2", "float16"))
               for heads in ((4, 4), (8, 4), (6, 2), (64, 2)) for q_lens in (None, [5, 1, 9])]
#: Every kernel choice the environment can force (decode tile, synchronisation and prefetch,
#: varlen warps), and the defaults.
FORCED = [{}, {settings.DECODE_TILE_ENV: "32"}, {settings.DECODE_SYNC_ENV: "warp"},
          {settings.DECODE_PREFETCH_ENV: "1"}, {settings.VARLEN_WARPS_ENV: "8"}]


@needs_nvcc
@pytest.mark.parametrize("env", FORCED, ids=["default", "decode-tile-32", "decode-warp-sync",
                                             "decode-l2-prefetch", "varlen-8-warps"])
@pytest.mark.parametrize("dtype,heads,q_lens", PLANNED)
def test_every_launch_a_plan_makes_is_compiled(reports, monkeypatch, env, dtype, heads,
                                               q_lens) -> None:
    import torch

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    compiled = {r.name.split("(")[0].replace("void ", "") for r in reports}
    problem = _problem(getattr(torch, dtype), heads, q_lens)
    plan = planner.plan_attention(problem, num_sms=132)
    values = params.unpack("attn", params.pack("attn", launch.attn_values(
        problem, plan, problem.query, problem.key_cache, problem.value_cache, problem.out, None)))
    for name, grid, threads, smem in launch.attention_launches(values):
        assert name in compiled, f"{name} is launched by the plan but not compiled"
        assert threads in (64, planner.THREADS, 256) and min(grid) >= 1 and smem >= 0


@needs_nvcc
@pytest.mark.parametrize("cache,dtype,heads,q_lens", PLANNED_KV8)
def test_every_launch_an_8bit_cache_plan_makes_is_compiled(reports, cache, dtype, heads,
                                                           q_lens) -> None:
    """An 8-bit cache plans the SIMT kernels (their PkKv8 instantiations, the reduce kernel of
    the query's dtype) whatever the query's dtype, and they are compiled."""
    import torch

    compiled = {r.name.split("(")[0].replace("void ", "") for r in reports}
    problem = _problem(getattr(torch, dtype), heads, q_lens, cache_dtype=getattr(torch, cache))
    plan = planner.plan_attention(problem, num_sms=132)
    values = params.unpack("attn", params.pack("attn", launch.attn_values(
        problem, plan, problem.query, problem.key_cache, problem.value_cache, problem.out, None)))
    assert values["kv_dtype"] == params.KV_DTYPE_CODES[problem.key_cache.dtype]
    assert values["k_scale"] == problem.k_scale.data_ptr()
    launches = launch.attention_launches(values)
    assert launches[0][0].startswith(("pk_decode_kernel<PkKv8,", "pk_varlen_simt_kernel<PkKv8,"))
    for name, grid, threads, smem in launches:
        assert name in compiled, f"{name} is launched by the plan but not compiled"
        assert threads == planner.THREADS and min(grid) >= 1 and smem >= 0


@pytest.mark.parametrize("dtype,kernel,ctype,cache", [
    ("bfloat16", "pk_decode_mma_kernel<__nv_bfloat16, 128, 4>", "__nv_bfloat16", None),
    ("float32", "pk_decode_kernel<float, 128, 4>", "float", None),
    ("bfloat16", "pk_decode_kernel<PkKv8, 128, 4>", "__nv_bfloat16", "float8_e4m3fn")])
def test_jit_launches_exactly_the_planned_kernels(dtype, kernel, ctype, cache) -> None:
    """jit.JitModule's dispatch, without CuPy or a GPU: the launches it would make (16-bit
    decode on the mma kernel, float32 and 8-bit caches on the SIMT one)."""
    import torch

    from cuda.paged_cuda import jit

    module = jit.JitModule.__new__(jit.JitModule)
    calls = []
    module._run = lambda header, name, grid, threads, smem, stream, params: calls.append(
        (header, name, grid, smem))
    problem = _problem(getattr(torch, dtype), (32, 8), None,
                       cache_dtype=getattr(torch, cache) if cache else None)
    plan = planner.plan_attention(problem, num_sms=132)
    values = launch.attn_values(problem, plan, problem.query, problem.key_cache,
                              problem.value_cache, problem.out, None)
    module.paged_attention(params.pack("attn", values), 0)
    expected = [("pk_decode.cuh", kernel, plan.grid, plan.smem_bytes)]
    if plan.num_splits > 1:
        expected.append(("pk_decode.cuh", f"pk_decode_reduce_kernel<{ctype}>", (32, 3, 1), 0))
    assert calls == expected


@pytest.mark.parametrize("env,kernel,threads", [
    ({}, "pk_varlen_mma_async_kernel<__nv_bfloat16, 128, 4>", 128),
    ({settings.VARLEN_WARPS_ENV: "8"}, "pk_varlen_mma_async_kernel<__nv_bfloat16, 128, 8>", 256),
    ({settings.DECODE_TILE_ENV: "32"}, "pk_decode_mma_kernel<__nv_bfloat16, 128, 2>", 64)])
def test_jit_launches_the_forced_kernel_choices(monkeypatch, env, kernel, threads) -> None:
    """The JIT dispatch of the choices the environment forces: the varlen kernel with 4 or 8
    warps from its header, the 2-warp decode kernel with 64 threads."""
    import torch

    from cuda.paged_cuda import jit

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    module = jit.JitModule.__new__(jit.JitModule)
    calls = []
    module._run = lambda header, name, grid, threads, smem, stream, params: calls.append(
        (header, name, threads))
    decode = settings.DECODE_TILE_ENV in env
    problem = _problem(torch.bfloat16, (32, 8), None if decode else [5, 1, 9])
    plan = planner.plan_attention(problem, num_sms=132)
    values = launch.attn_values(problem, plan, problem.query, problem.key_cache,
                              problem.value_cache, problem.out, None)
    module.paged_attention(params.pack("attn", values), 0)
    header = "pk_decode.cuh" if decode else "pk_varlen.cuh"
    assert calls[0] == (header, kernel, threads)


def test_jit_write_kv_dispatch() -> None:
    """jit.JitModule's write_kv: the byte copy for a float cache, the quantising kernel of the
    rows' dtype for an 8-bit one."""
    import torch

    from cuda.paged_cuda import jit

    module = jit.JitModule.__new__(jit.JitModule)
    calls = []
    module._run = lambda header, name, *rest: calls.append((header, name))
    key = torch.zeros(3, 2, 64, dtype=torch.float16)
    for cache_dtype, scale in ((torch.float16, None), (torch.int8, torch.ones(2))):
        cache = torch.zeros(4, 2, 16, 64, dtype=cache_dtype)
        launch.write_kv(module, key, key, cache, cache, torch.zeros(3, dtype=torch.int64), 0,
                        scale, scale)
    assert calls == [("pk_cache.cuh", "pk_write_kv_kernel<uint4>"),
                     ("pk_cache.cuh", "pk_write_kv_quant_kernel<__half>")]


NVRTC_ENV = "PK_NVRTC_LIB"


def _nvrtc_library() -> str | None:
    """`$PK_NVRTC_LIB`, else the libnvrtc of an installed NVIDIA wheel (setup.sh installs
    nvidia-cuda-nvrtc where nvcc is: nvidia/cu13/lib or nvidia/cuda_nvrtc/lib)."""
    if os.environ.get(NVRTC_ENV):
        return os.environ[NVRTC_ENV]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(root).glob("*/lib/libnvrtc.so.*"))
        if found:
            return str(found[-1])
    return None


def _nvrtc() -> tuple[ctypes.CDLL, str] | None:
    """libnvrtc (`_nvrtc_library`) and the CUDA include directory, or None."""
    lib_path = _nvrtc_library()
    includes = [Path(os.environ[e]) / "include" for e in ("CUDA_HOME", "CUDA_PATH")
                if os.environ.get(e)] + sorted(Path("/usr/local").glob("cuda*/include"))
    include = next((str(d) for d in includes if (d / "cuda_fp16.h").exists()), None)
    if not lib_path or include is None:
        return None
    for builtins in sorted(Path(lib_path).parent.glob("libnvrtc-builtins.so.*")):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)  # found by soname, no LD path
    return ctypes.CDLL(lib_path), include


def _nvrtc_compile(lib: ctypes.CDLL, include: str, header: str, names: list[str],
                   arch: str) -> None:
    """Compiles `#include "header"` with `names` instantiated, as jit.JitModule's source."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), f'#include "{header}"\n'.encode(),
                                  b"jit.cu", 0, None, None) == 0
    try:
        for name in names:
            assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
        opts = [b"-std=c++17", f"-I{params.CSRC_DIR}".encode(), f"-I{include}".encode(),
                f"--gpu-architecture=sm_{arch}".encode()]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            pytest.fail(f"NVRTC sm_{arch} {header}: {log.value.decode()[-4000:]}")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.skipif(_nvrtc() is None, reason=f"no libnvrtc (setup.sh installs one where nvcc is; "
                    f"or set {NVRTC_ENV}) to check the run-time (NVRTC) path's sources")
def test_jit_sources_compile_with_nvrtc(monkeypatch) -> None:
    """Every instantiation the planner can launch (defaults and every forced kernel choice, every
    dtype, decode and varlen, at head sizes 64 and 128 or, with
    `PAGED_KERNELS_FULL_CUDA_CHECK=1`, every head size; 8-bit caches at head sizes 64 and 128,
    and the write_kv kernels) compiles with NVRTC for sm_80 and sm_90 from the header
    jit.JitModule includes. Compile only: CuPy and a GPU are not needed."""
    lib, include = _nvrtc()
    head_sizes = check_head_sizes()["80"]  # every head size only with the variable at 1
    jobs = [(header, sorted(wanted), arch) for arch in ARCHS
            for header, wanted in _planned_names(monkeypatch, head_sizes).items()]
    assert sum(len(names) for _, names, arch in jobs if arch == "90") > 25
    # NVRTC runs outside the GIL (ctypes): one program per thread, on every core
    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        for done in [pool.submit(_nvrtc_compile, lib, include, *job) for job in jobs]:
            done.result()


def _planned_names(monkeypatch, head_sizes: tuple[int, ...]) -> dict[str, set[str]]:
    """Header -> the kernel instantiations the planner launches at `head_sizes` (every forced
    choice of FORCED), with the write_kv kernels."""
    import torch

    names: dict[str, set[str]] = {"pk_cache.cuh": {"pk_write_kv_kernel<uint4>",
                                                   "pk_write_kv_quant_kernel<__nv_bfloat16>"}}

    def add_launches(problem) -> None:
        plan = planner.plan_attention(problem, num_sms=132)
        values = params.unpack("attn", params.pack("attn", launch.attn_values(
            problem, plan, problem.query, problem.key_cache, problem.value_cache, problem.out,
            None)))
        for name, *_ in launch.attention_launches(values):
            header = "pk_decode.cuh" if name.startswith("pk_decode") else "pk_varlen.cuh"
            names.setdefault(header, set()).add(name)

    for env in FORCED:
        for name in settings.PLAN_ENVS:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for d in head_sizes:
                for q_lens in (None, [5, 1, 9]):
                    add_launches(_problem(dtype, (8, 2), q_lens, head_size=d))
    for d in params.REDUCED_HEAD_SIZES:
        for q_lens in (None, [5, 1, 9]):
            add_launches(_problem(torch.bfloat16, (8, 2), q_lens, head_size=d,
                                  cache_dtype=torch.float8_e4m3fn))
    for name in settings.PLAN_ENVS:
        monkeypatch.delenv(name, raising=False)
    return names


def test_ptxas_report_parser_reads_spills_and_registers() -> None:
    log = """ptxas info    : Compiling entry function '_Z3fooi' for 'sm_90'
ptxas info    : Function properties for _Z3fooi
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers
ptxas info    : Compiling entry function '_Z16pk_decode_kernelv' for 'sm_80'
ptxas info    : Function properties for _Z16pk_decode_kernelv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers
"""
    first, second = build.parse_ptxas(log)
    assert (first.arch, first.registers, first.spill_stores, first.spill_loads) == \
        ("sm_90", 96, 8, 12)
    assert first.spills and not first.hot
    assert second.hot and not second.spills and second.registers == 40


def test_params_layout_is_read_from_the_header() -> None:
    names = [n for n, _ in params.FIELDS["attn"]]
    assert names[:3] == ["q", "k_cache", "v_cache"] and names[-2:] == ["scale", "soft_cap"]
    values = {n: i for i, n in enumerate(names)}
    values["scale"], values["soft_cap"] = 0.125, 2.5
    assert params.unpack("attn", params.pack("attn", values)) == values


def test_decode_kernel_per_dtype() -> None:
    """Decode of 16-bit types plans the mma kernel, float32 the SIMT one."""
    import torch

    for dtype, kernel in [(torch.float16, params.KERNEL_DECODE_MMA),
                          (torch.bfloat16, params.KERNEL_DECODE_MMA),
                          (torch.float32, params.KERNEL_DECODE)]:
        assert planner.plan_attention(_problem(dtype, (32, 8), None), num_sms=132).kernel == kernel


def test_decode_mma_shared_memory_fits_every_head_size(monkeypatch) -> None:
    """The mma decode plan stays under the 163 KiB a block may have on sm_80 (227 KiB on sm_90)
    for every compiled head size, at the largest partition and the smallest block size."""
    import torch

    monkeypatch.setenv(settings.PARTITION_ENV, str(planner.MAX_PARTITION))
    for d in params.HEAD_SIZES:
        problem = _problem(torch.bfloat16, (32, 8), None, head_size=d, block_size=1)
        plan = planner._plan_decode_mma(problem, num_sms=1)
        assert plan.kernel == params.KERNEL_DECODE_MMA and plan.grid == (8, 3, plan.num_splits)
        assert plan.smem_bytes <= 163 * 1024, (d, plan.smem_bytes)
        assert plan.stages == 2
    monkeypatch.setenv(settings.STAGES_ENV, "4")
    for d, stages in [(64, 4), (128, 4), (256, 2)]:
        problem = _problem(torch.bfloat16, (32, 8), None, head_size=d, block_size=1)
        plan = planner._plan_decode_mma(problem, num_sms=1)
        assert plan.stages == stages and plan.smem_bytes <= 163 * 1024, (d, plan)
    monkeypatch.setenv(settings.STAGES_ENV, "5")
    with pytest.raises(ValueError, match="PAGED_KERNELS_CUDA_DECODE_STAGES: expected 2, 3 or 4"):
        settings.mma_decode_stages()


def _blocks_per_sm(plan) -> int:
    """Blocks of the plan's shared memory one H100/H200 SM holds (228 KiB, 1 KiB reserved per
    block)."""
    return 228 * 1024 // (plan.smem_bytes + 1024)


@pytest.mark.parametrize("head_size,blocks_64,blocks_32", [(64, 5, 11), (128, 3, 6),
                                                           (256, 1, 2)])
def test_decode_mma_tile_32_halves_shared_memory(monkeypatch, head_size, blocks_64,
                                                 blocks_32) -> None:
    """PAGED_KERNELS_CUDA_DECODE_TILE=32: 2 warps (64 threads) and 32-key tiles, so an SM holds
    about twice the blocks of the 64-key kernel (6 instead of 3 at head size 128); the shared
    memory is the rings + row offsets (+ Q above head size 128), every depth under 163 KiB."""
    import torch

    problem = _problem(torch.bfloat16, (32, 8), None, head_size=head_size, block_size=1)
    default = planner._plan_decode_mma(problem, num_sms=132)
    monkeypatch.setenv(settings.DECODE_TILE_ENV, "32")
    small = planner._plan_decode_mma(problem, num_sms=132)
    assert (default.threads, small.threads) == (128, 64)
    pitch, q = 2 * (head_size + 8), (16 if head_size > 128 else 0)
    assert default.smem_bytes == (q + 2 * 2 * 64) * pitch + 16 * 2 * 64
    assert small.smem_bytes == (q + 2 * 2 * 32) * pitch + 16 * 2 * 32
    assert (_blocks_per_sm(default), _blocks_per_sm(small)) == (blocks_64, blocks_32)
    assert planner.mma_decode_min_blocks(head_size, 2) == \
        2 * planner.mma_decode_min_blocks(head_size)
    for stages in ("3", "4"):
        monkeypatch.setenv(settings.STAGES_ENV, stages)
        assert planner._plan_decode_mma(problem, num_sms=132).smem_bytes <= 163 * 1024
    monkeypatch.setenv(settings.DECODE_TILE_ENV, "16")
    with pytest.raises(ValueError, match="PAGED_KERNELS_CUDA_DECODE_TILE: expected 64 or 32"):
        settings.mma_decode_tile()


@pytest.mark.parametrize("env,value,field", [(settings.DECODE_SYNC_ENV, "warp", "warp_sync"),
                                             (settings.DECODE_PREFETCH_ENV, "1", "l2_prefetch")])
def test_decode_sync_and_prefetch_are_run_time_choices_of_the_same_kernel(
        monkeypatch, env, value, field) -> None:
    """PAGED_KERNELS_CUDA_DECODE_SYNC=warp / _PREFETCH=1 set the plan's warp_sync / l2_prefetch
    (packed into the params the kernel reads) and change nothing else: same instantiation,
    grid, threads, shared memory."""
    import torch

    problem = _problem(torch.bfloat16, (32, 8), None, head_size=128, block_size=16)
    for tile in ("64", "32"):
        monkeypatch.setenv(settings.DECODE_TILE_ENV, tile)
        monkeypatch.delenv(env, raising=False)
        default = planner._plan_decode_mma(problem, num_sms=132)
        monkeypatch.setenv(env, value)
        chosen = planner._plan_decode_mma(problem, num_sms=132)
        assert (getattr(default, field), getattr(chosen, field)) == (0, 1)
        assert dataclasses.replace(chosen, **{field: 0}) == default
        values = params.unpack("attn", params.pack("attn", launch.attn_values(
            problem, chosen, problem.query, problem.key_cache, problem.value_cache, problem.out,
            None)))
        assert values[field] == 1


def test_bad_decode_sync_or_prefetch_values_are_refused(monkeypatch) -> None:
    monkeypatch.setenv(settings.DECODE_SYNC_ENV, "grid")
    with pytest.raises(ValueError, match="PAGED_KERNELS_CUDA_DECODE_SYNC: expected 'block' or "
                                         "'warp', got 'grid'"):
        settings.mma_decode_warp_sync()
    monkeypatch.setenv(settings.DECODE_PREFETCH_ENV, "yes")
    with pytest.raises(ValueError, match="PAGED_KERNELS_CUDA_DECODE_PREFETCH: expected 0 or 1, "
                                         "got 'yes'"):
        settings.mma_decode_l2_prefetch()


@pytest.mark.parametrize("head_size", params.HEAD_SIZES)
def test_varlen_plans_the_async_kernel(monkeypatch, head_size) -> None:
    """16-bit varlen plans the cp.async-ring kernel (stages 2, 4 warps: 16 tokens x 4 heads per
    block) within sm_80's 163 KiB on every head size; PAGED_KERNELS_CUDA_VARLEN_WARPS=8 doubles
    its rows (32 tokens); float32 is unaffected (SIMT, whatever the warps setting)."""
    import torch

    problem = _problem(torch.float16, (8, 2), [5, 1, 9], head_size=head_size)
    plan = planner.plan_attention(problem, num_sms=132)
    bn, pitch = planner.varlen_async_bn(head_size), 2 * (head_size + 8)
    assert (plan.kernel, plan.stages, plan.threads) == (params.KERNEL_VARLEN_MMA, 2, 128)
    assert plan.smem_bytes == (4 * bn + (64 if head_size > 128 else 0)) * pitch <= 163 * 1024
    assert (plan.heads_per_cta, plan.q_tile_tokens) == (4, 16)
    monkeypatch.setenv(settings.VARLEN_WARPS_ENV, "8")
    wide = planner.plan_attention(problem, num_sms=132)
    assert (wide.stages, wide.threads, wide.q_tile_tokens) == (2, 256, 32)
    assert wide.smem_bytes == (4 * bn + (128 if head_size > 128 else 0)) * pitch <= 163 * 1024
    f32 = planner.plan_attention(_problem(torch.float32, (8, 2), [5, 1, 9],
                                          head_size=head_size), 132)
    assert (f32.kernel, f32.stages, f32.threads, f32.q_tile_tokens) == (
        params.KERNEL_VARLEN_SIMT, 0, 128, 4)
    monkeypatch.setenv(settings.VARLEN_WARPS_ENV, "16")
    with pytest.raises(ValueError, match="PAGED_KERNELS_CUDA_VARLEN_WARPS: expected 4 or 8"):
        settings.varlen_warps()


def _decode_problem(batch: int, context: int, head_size: int = 128, block_size: int = 16):
    import torch

    q = torch.zeros(batch, 32, head_size, dtype=torch.bfloat16)
    cache = torch.zeros(4, 8, block_size, head_size, dtype=torch.bfloat16)
    tables = torch.zeros(batch, context // block_size, dtype=torch.int32)
    return pk.abi.check_attention_args(q, cache, cache, tables,
                                       torch.ones(batch, dtype=torch.int32))


@pytest.mark.parametrize("batch,context", [(1, 16384), (32, 1024), (32, 4096), (128, 4096),
                                           (32, 16384), (8, 32768), (3, 96)])
def test_decode_mma_partitions_fill_whole_waves(batch, context) -> None:
    """The mma decode plan splits the capacity into whole 64-key tiles, within the partition and
    split bounds, covering it exactly once, and no other split count within the bounds has
    fewer waves x (keys + fixed cost) on 132 SMs x 3 blocks (head size 128)."""
    problem = _decode_problem(batch, context)
    plan = planner._plan_decode_mma(problem, num_sms=132)
    size, splits = plan.partition_size, plan.num_splits
    assert size % planner.MMA_DECODE_BN == 0 and size <= planner.MAX_PARTITION
    assert splits <= planner.MAX_SPLITS and (splits - 1) * size < context <= splits * size
    slots, ctas = 3 * 132, batch * 8

    def cost(size: int) -> int:
        return math.ceil(ctas * math.ceil(context / size) / slots) * (
            size + planner.MMA_BLOCK_OVERHEAD_KEYS)

    sizes = {64 * math.ceil(context / (64 * n)) for n in range(1, planner.MAX_SPLITS + 1)}
    assert cost(size) == min(cost(s) for s in sizes if 64 <= s <= planner.MAX_PARTITION)
    if (batch, context) == (32, 4096):
        assert (size, splits) == (1408, 3)  # 768 blocks: 2 full waves of 396


def test_cuda_backend_is_absent_without_a_gpu_and_imports_do_not_break() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert "cuda" in pk.registered_backends()
    assert "cuda" not in pk.available_backends()
    assert "torch.cuda is not available" in pk.unavailable_backends()["cuda"]


def test_every_planner_setting_has_a_checked_default() -> None:
    """SETTINGS holds each forcible choice of the planner (every PLAN_ENVS name but the
    partition, which defaults to the wave model), its default is one of its values, and an
    empty variable means the default."""
    assert set(settings.SETTINGS) == set(settings.PLAN_ENVS) - {settings.PARTITION_ENV}
    for name, s in settings.SETTINGS.items():
        assert s.default in s.values
        assert settings.setting(name, {}) == settings.setting(name, {name: ""}) == s.default
        for value in s.values:
            assert settings.setting(name, {name: value}) == value
