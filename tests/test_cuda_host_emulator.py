"""The host-execution emulator (cuda/host/) on its own kernels (cuda/host/tests/).

Each kernel's result is checked against an expectation computed here in Python/torch from the
CUDA semantics (barriers, shuffles with width segments, votes, the mma.m16n8k16 fragment layout),
plus the emulator's own diagnostics: deadlocks, partial masks, divergent collectives, launch
limits, and shared memory read before it is written (dynamic shared memory is poisoned with NaN).

On a GPU machine, `PK_SELFTEST_DEVICE=cuda` builds the same kernels with nvcc and runs the
semantic tests on the device, which checks the expectations (and so the emulator) against the
hardware; the emulator-only tests (diagnostics, poisoning, schedules) are skipped there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from cuda.paged_cuda import host_build

TESTS_DIR = Path(host_build.HOST_DIR) / "tests"
SOURCES = [TESTS_DIR / "selftest_kernels.cu", TESTS_DIR / "selftest_bindings.cpp"]
DEVICE = os.environ.get("PK_SELFTEST_DEVICE", "cpu")
SCHEDULES = ("forward", "reverse", "random", "warps") if DEVICE == "cpu" else ("hardware",)

host_only = pytest.mark.skipif(DEVICE != "cpu", reason="emulator behaviour (undefined on a GPU)")


def _build_for_device() -> Path:
    """nvcc build of the self-test kernels (GPU machines only)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None or not torch.cuda.is_available():
        pytest.skip("PK_SELFTEST_DEVICE=cuda needs nvcc and a CUDA device")
    import pybind11
    out = host_build.cache_root() / "selftest-device"
    out.mkdir(parents=True, exist_ok=True)
    name = "_pk_device_selftest"
    so = out / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    arch = os.environ.get("PK_SELFTEST_ARCH", "native")
    inc = [f"-I{TESTS_DIR}", f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
    cmds = [
        [nvcc, "-O2", "-std=c++17", f"-arch={arch}", "-Xcompiler", "-fPIC", *inc, "-c",
         str(SOURCES[0]), "-o", str(out / "k.o")],
        ["g++", "-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-DPK_SELFTEST_DEVICE",
         f"-DPK_SELFTEST_MODULE={name}", *inc, "-c", str(SOURCES[1]), "-o", str(out / "b.o")],
        [nvcc, "-shared", f"-arch={arch}", str(out / "k.o"), str(out / "b.o"), "-o", str(so)],
    ]
    for cmd in cmds:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return so


@pytest.fixture(scope="module")
def st():
    """The self-test module, built (or found in the cache) once."""
    if DEVICE != "cpu":
        return host_build.load_module("_pk_device_selftest", _build_for_device())
    try:
        path = host_build.build_module(
            "_pk_host_selftest", SOURCES, include_dirs=[TESTS_DIR], hash_dirs=[TESTS_DIR],
            defines=["PK_SELFTEST_MODULE=_pk_host_selftest"])
    except host_build.HostBuildError as exc:
        if "no C++ compiler" in str(exc) or "pybind11 is not installed" in str(exc):
            pytest.skip(str(exc))
        raise
    return host_build.load_module("_pk_host_selftest", path)


@pytest.fixture(params=SCHEDULES)
def schedule(request, monkeypatch):
    monkeypatch.setenv("PK_HOST_SCHEDULE", request.param)
    monkeypatch.setenv("PK_HOST_SEED", "1234")
    return request.param


def dev(t: torch.Tensor) -> torch.Tensor:
    """`t` on the device the kernels run on."""
    return t.to(DEVICE)


# ---- 16-bit floats ----

def _all_bit_patterns() -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)


def _probe_floats(dtype: torch.dtype) -> torch.Tensor:
    """Every value of `dtype`, the exact midpoints between neighbours (ties), one float32 ulp on
    either side of them, random floats over a wide range, and the special values."""
    vals = _all_bit_patterns().view(dtype).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = ((vals[1:].double() + vals[:-1].double()) / 2).float()
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.full_like(mids, float("-inf")))
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-40, 40, (20000,),
                                                                      generator=g).float())
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0,
                            65519.996, 65520.0, -65520.0, 1e-8, 2.0 ** -25, 2.0 ** -24,
                            3.0 * 2.0 ** -26, 3.4e38, -3.4e38, 1.17e-38, 1e-45])
    return torch.cat([vals, mids, up, down, rand, special])


@host_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_to_float_matches_torch_for_every_bit_pattern(st, dtype):
    bits = _all_bit_patterns()
    out = torch.empty(bits.numel(), dtype=torch.float32)
    convert = st.half_to_float if dtype == torch.float16 else st.bf16_to_float
    convert(bits.data_ptr(), out.data_ptr(), bits.numel())
    expected = bits.view(dtype).float()
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int32), expected[~nan].view(torch.int32))


@host_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float_to_16bit_rounds_to_nearest_even_like_torch(st, dtype):
    x = _probe_floats(dtype)
    out = torch.empty(x.numel(), dtype=torch.int16)
    convert = st.float_to_half if dtype == torch.float16 else st.float_to_bf16
    convert(x.data_ptr(), out.data_ptr(), x.numel())
    expected = x.to(dtype)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out.view(dtype)), nan)
    mismatch = (out != expected.view(torch.int16)) & ~nan
    assert not mismatch.any(), f"first mismatches at {x[mismatch][:5].tolist()}"


# ---- barriers and shared memory ----

@pytest.mark.parametrize("threads", [64, 256])
def test_tree_reduction_with_barriers(st, schedule, threads):
    x = torch.randn(5, 300, dtype=torch.float32)
    out = dev(torch.full((5,), float("nan")))
    st.block_sum(dev(x).data_ptr(), out.data_ptr(), 5, 300, threads)
    torch.testing.assert_close(out.cpu(), x.double().sum(1).float(), rtol=1e-5, atol=1e-5)


def test_warp_shuffle_reduction_across_warps(st, schedule):
    x = torch.randn(3, 256)
    out = dev(torch.full((3,), float("nan")))
    st.warp_block_sum(dev(x).data_ptr(), out.data_ptr(), 3, 256)
    torch.testing.assert_close(out.cpu(), x.double().sum(1).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_neighbour_read_is_exact_with_its_barrier(st, schedule, dynamic):
    blocks, threads = 3, 96
    x = torch.randn(blocks * threads)
    out = dev(torch.full_like(x, float("nan")))
    st.neighbour(dev(x).data_ptr(), out.data_ptr(), blocks, threads, True, dynamic)
    expected = x.view(blocks, threads).roll(-1, dims=1).reshape(-1)
    assert torch.equal(out.cpu(), expected)


@host_only
@pytest.mark.parametrize("dynamic", [False, True])
def test_missing_barrier_shows_in_every_schedule(st, schedule, dynamic):
    """Without the barrier some thread reads its neighbour's slot before it is written."""
    blocks, threads = 3, 96
    x = torch.randn(blocks * threads)
    out = torch.full_like(x, 7.0)
    st.neighbour(x.data_ptr(), out.data_ptr(), blocks, threads, False, dynamic)
    expected = x.view(blocks, threads).roll(-1, dims=1).reshape(-1)
    assert not torch.equal(out, expected)
    if dynamic and schedule == "forward":
        # every thread but the last reads a slot nobody wrote yet: the NaN poison
        assert torch.isnan(out.view(blocks, threads)[:, :-1]).all()


@host_only
def test_dynamic_shared_memory_starts_poisoned(st):
    out = torch.zeros(64)
    st.read_unwritten(out.data_ptr(), 64, 64 * 4, False)
    assert (out.view(torch.int32) == -1).all()  # 0xFFFFFFFF: a NaN in every float type


@host_only
def test_shared_memory_past_the_launch_size_is_guarded(st):
    """4 KiB past a launch's dynamic shared memory are poisoned too, and a block that writes
    there fails the launch: a kernel whose layout outgrows its planned size is caught."""
    out = torch.zeros(64)
    st.read_unwritten(out.data_ptr(), 64, 32 * 4, False)
    assert (out.view(torch.int32) == -1).all()  # floats 32..63 lie in the guard
    st.write_shared_byte(1024, 1023)
    for offset in (1024, 1024 + 4095):
        with pytest.raises(RuntimeError, match="wrote shared memory byte .*, past the launch's "
                                               "1024 bytes of dynamic shared memory"):
            st.write_shared_byte(1024, offset)
    st.write_shared_byte(1024, 1024 + 4096)  # beyond the guard: not seen (a documented limit)


@host_only
def test_static_shared_memory_of_template_kernels_starts_poisoned(st):
    out = torch.zeros(40)
    st.read_unwritten_static(out.data_ptr())
    assert (out.view(torch.int32) == -1).all()


@host_only
def test_dynamic_shared_memory_limits(st):
    out = torch.zeros(64)
    with pytest.raises(RuntimeError, match="PK_SET_MAX_DYNAMIC_SMEM"):
        st.read_unwritten(out.data_ptr(), 64, 64 * 1024, False)
    st.read_unwritten(out.data_ptr(), 64, 64 * 1024, True)
    assert torch.isnan(out).all()
    with pytest.raises(RuntimeError, match="227 KiB"):
        st.read_unwritten(out.data_ptr(), 64, 300 * 1024, True)


# ---- shuffles and votes ----

def _expected_shuffles(v: torch.Tensor, exists: torch.Tensor) -> torch.Tensor:
    """The 17 shuffle ops of shuffle_kernel, from the CUDA programming guide's definitions."""
    n = v.numel()

    def take(src_of) -> torch.Tensor:
        out = v.clone()
        for t in range(n):
            lane, base = t % 32, t - t % 32
            src = src_of(lane)
            if src is not None and exists[base + src]:
                out[t] = v[base + src]
        return out

    def xor(m, w=32):
        return take(lambda l: None if (l ^ m) >= (l // w + 1) * w else l ^ m)

    def idx(s, w=32):
        return take(lambda l: (l // w) * w + s % w)

    def down(d, w=32):
        return take(lambda l: None if l % w + d >= w else l + d)

    def up(d, w=32):
        return take(lambda l: None if l % w < d else l - d)

    ops = [xor(m) for m in (1, 2, 4, 8, 16)] + [xor(4, 8), xor(8, 8)]
    ops += [take(lambda l: (l * 7 + 3) % 32), idx(5, 16), idx(37)]
    ops += [down(1), down(3), down(16), down(2, 8), up(1), up(5), up(1, 4)]
    return torch.stack(ops)


@pytest.mark.parametrize("threads", [64, pytest.param(48, marks=host_only)])
def test_shuffles_and_votes_follow_cuda_semantics(st, schedule, threads):
    """48 threads: the second warp has 16 lanes; reading a missing lane gives one's own value."""
    g = torch.Generator().manual_seed(threads)
    v = torch.randperm(threads, generator=g).float()
    out = dev(torch.full((17 * threads,), float("nan")))
    out_d = dev(torch.zeros(threads, dtype=torch.float64))
    out_i = dev(torch.zeros(4 * threads, dtype=torch.int32))
    st.shuffles(dev(v).data_ptr(), out.data_ptr(), out_d.data_ptr(), out_i.data_ptr(), threads)
    out, out_d, out_i = out.cpu(), out_d.cpu(), out_i.cpu()
    exists = torch.ones(((threads + 31) // 32) * 32, dtype=torch.bool)
    exists[threads:] = False
    assert torch.equal(out.view(17, threads), _expected_shuffles(v, exists))

    def xor3(t):
        s = t ^ 3
        return s if s < threads else t
    assert torch.equal(out_d, torch.tensor([float(v[xor3(t)]) * 1e-300 for t in range(threads)],
                                           dtype=torch.float64))
    iv = v.int() * 3 + 1
    down4 = [int(iv[t + 4]) if t % 32 + 4 < 32 and t + 4 < threads else int(iv[t])
             for t in range(threads)]
    assert out_i[:threads].tolist() == down4
    for t in range(threads):
        base = t - t % 32
        lanes = range(base, min(base + 32, threads))
        ballot = sum(1 << (l - base) for l in lanes if int(v[l]) % 3 == 0)
        assert int(out_i[threads + t]) & 0xffffffff == ballot
        assert int(out_i[2 * threads + t]) == int(any(int(v[l]) == 7 for l in lanes))
        assert int(out_i[3 * threads + t]) == 1


# ---- mma fragment layout ----

def _run_mma(st, a, b, c, in_place):
    bt = b.transpose(1, 2).contiguous()  # [warps][n][k]: B's columns as rows ("col" operand)
    d = dev(torch.full(c.shape, float("nan")))
    a_d, bt_d, c_d = dev(a), dev(bt), dev(c)
    st.mma(a_d.view(torch.int16).data_ptr(), bt_d.view(torch.int16).data_ptr(), c_d.data_ptr(),
           d.data_ptr(), a.shape[0], a.dtype == torch.bfloat16, in_place)
    return d.cpu()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_mma_m16n8k16_matches_a_plain_matmul(st, schedule, dtype, in_place):
    warps = 2
    g = torch.Generator().manual_seed(3)
    a = torch.randn(warps, 16, 16, generator=g).to(dtype)
    b = torch.randn(warps, 16, 8, generator=g).to(dtype)
    c = torch.randn(warps, 16, 8, generator=g)
    d = _run_mma(st, a, b, c, in_place)
    expected = a.double() @ b.double() + c.double()
    torch.testing.assert_close(d.double(), expected, rtol=1e-5, atol=1e-5)


def test_mma_distinguishes_every_position(st):
    """One-hot operands: any swapped row, column or k index would move the 1 elsewhere."""
    for r, k, n in [(0, 0, 0), (15, 15, 7), (9, 3, 5), (4, 12, 2), (8, 8, 1), (7, 9, 6)]:
        a = torch.zeros(1, 16, 16, dtype=torch.float16)
        b = torch.zeros(1, 16, 8, dtype=torch.float16)
        a[0, r, k] = 1.0
        b[0, k, n] = 2.0
        d = _run_mma(st, a, b, torch.zeros(1, 16, 8), False)
        expected = torch.zeros(1, 16, 8)
        expected[0, r, n] = 2.0
        assert torch.equal(d, expected), (r, k, n)


# ---- ldmatrix fragment layout ----

def _ldmatrix_expected(src: torch.Tensor, perm: list[int], trans: bool) -> torch.Tensor:
    """PTX ldmatrix.m8n8.x4: matrix i is the rows lanes 8i..8i+7 point at; lane l (g = l // 4,
    t = l % 4) gets M_i[g][2t], M_i[g][2t+1] (.trans: M_i[2t][g], M_i[2t+1][g]), low half
    first."""
    bits = src.view(torch.int16).to(torch.int64) & 0xffff
    out = torch.zeros(32, 4, dtype=torch.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            rows = [perm[8 * i + k] for k in range(8)]
            if trans:
                lo, hi = bits[rows[2 * t], g], bits[rows[2 * t + 1], g]
            else:
                lo, hi = bits[rows[g], 2 * t], bits[rows[g], 2 * t + 1]
            out[lane, i] = lo | (hi << 16)
    return out


@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
@pytest.mark.parametrize("pitch", [8, 136])
def test_ldmatrix_x4_fragment_layout(st, schedule, trans, pitch):
    """Distinct values everywhere and shuffled row addresses: any swapped lane, row, column or
    matrix moves a value."""
    src = (torch.arange(32 * 8, dtype=torch.float32) + 1).to(torch.float16).view(32, 8)
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(pitch + trans))
    out = dev(torch.zeros(32, 4, dtype=torch.int32))
    perm_d = dev(perm.to(torch.int32))
    src_d = dev(src)
    st.ldmatrix(src_d.data_ptr(), perm_d.data_ptr(), out.data_ptr(), pitch, trans)
    got = out.cpu().to(torch.int64) & 0xffffffff
    assert torch.equal(got, _ldmatrix_expected(src, perm.tolist(), trans))


@host_only
def test_ldmatrix_rejects_a_misaligned_row(st):
    src, perm = torch.zeros(32, 8, dtype=torch.float16), torch.arange(32, dtype=torch.int32)
    out = torch.zeros(32, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        st.ldmatrix(src.data_ptr(), perm.data_ptr(), out.data_ptr(), 4, False)


# ---- cp.async ----

@pytest.mark.parametrize("stages", [2, 3])
def test_cp_async_ring_delivers_every_tile(st, schedule, stages):
    """A ring of `stages` slots with waits and barriers as the decode kernel has them: every tile
    arrives intact, and invalid pieces are zero-filled without reading their source (NaN
    there)."""
    tiles, threads = 7, 64
    g = torch.Generator().manual_seed(stages)
    src = torch.randn(tiles, threads, 4, generator=g)
    valid = (torch.rand(tiles, threads, generator=g) > 0.3).to(torch.int32)
    src[valid == 0] = float("nan")
    out = dev(torch.full((tiles, threads, 4), float("nan")))
    src_d, valid_d = dev(src), dev(valid)
    st.cp_async_ring(src_d.data_ptr(), valid_d.data_ptr(), out.data_ptr(), tiles, threads, stages)
    want = torch.where(valid[..., None] != 0, src, torch.zeros(()))
    assert torch.equal(out.cpu(), want.roll(-1, dims=1))


@host_only
def test_cp_async_lands_at_the_latest_wait_that_covers_it(st):
    """Before a wait the destination reads as NaN (the copy is in flight); wait_group 1 lands
    the older group only; wait_group 0 lands both."""
    src = torch.arange(8, dtype=torch.float32) + 1
    out = torch.zeros(6, 4)
    st.cp_async_wait(src.data_ptr(), out.data_ptr())
    first, second = src[:4], src[4:]
    assert torch.isnan(out[0]).all() and torch.isnan(out[1]).all()
    assert torch.equal(out[2], first) and torch.isnan(out[3]).all()
    assert torch.equal(out[4], first) and torch.equal(out[5], second)


# ---- coordinates, vectors, stacks ----

def test_3d_grid_and_block_coordinates(st, schedule):
    grid, block = (3, 2, 2), (4, 3, 2)
    total = 12 * 24
    out = dev(torch.full((total,), -1, dtype=torch.int32))
    st.coords(out.data_ptr(), *grid, *block)
    assert torch.equal(out.cpu(), torch.arange(total, dtype=torch.int32))


def test_uint4_loads_reinterpreted_as_half_pairs(st):
    x = torch.randn(8 * 32).half()
    out = dev(torch.full((8 * 32,), float("nan")))
    st.vector(dev(x).data_ptr(), out.data_ptr(), 32)
    assert torch.equal(out.cpu(), x.float())


@host_only
def test_threads_that_returned_count_as_arrived(st, schedule):
    x = torch.arange(64, dtype=torch.float32)
    out = torch.zeros(64)
    st.faulty("early_exit", out.data_ptr(), x.data_ptr())
    assert float(out[0]) == float(x[:8].sum())


def test_large_thread_stacks(st):
    out = dev(torch.zeros(64))
    st.faulty("big_stack", out.data_ptr(), out.data_ptr())
    expected = torch.zeros(64)
    for i in range(0, 2048, 7):  # float32 sums in the kernel's order
        expected += torch.arange(64, dtype=torch.float32) * i
    assert torch.equal(out.cpu(), expected)


# ---- errors are reported, never hangs ----

@host_only
@pytest.mark.parametrize("which, message", [
    ("lane_exit", r"deadlock.*3@returned"),
    ("split_barrier", r"deadlock.*@__syncthreads.*@a warp collective"),
    ("partial_mask", r"mask 0x0000ffff.*every existing lane"),
    ("divergent_kinds", r"divergent warp collectives"),
    ("too_many_threads", r"1 to 1024 threads"),
    ("cp_async_unwaited", r"cp.async copies it never waited for"),
])
def test_faulty_kernels_are_reported(st, which, message):
    out = torch.zeros(64)
    with pytest.raises(RuntimeError, match=message):
        st.faulty(which, out.data_ptr(), out.data_ptr())
    # the next launch on the same host thread works
    x = torch.randn(2, 100)
    sums = torch.zeros(2)
    st.block_sum(x.data_ptr(), sums.data_ptr(), 2, 100, 64)
    torch.testing.assert_close(sums, x.sum(1), rtol=1e-5, atol=1e-5)


# ---- the host build ----

@host_only
def test_missing_compiler_makes_the_backend_unavailable(monkeypatch, tmp_path):
    from cuda.paged_cuda import host_backend
    from paged_kernels.backends import BackendUnavailable

    monkeypatch.setenv("CXX", "no-such-compiler-pk")
    monkeypatch.setenv("PAGED_KERNELS_CACHE", str(tmp_path))
    with pytest.raises(BackendUnavailable, match=r"no C\+\+ compiler.*no-such-compiler-pk"):
        host_backend.CudaHostBackend()


@host_only
def test_compile_errors_carry_the_compilers_message(monkeypatch, tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    monkeypatch.setenv("PAGED_KERNELS_CACHE", str(tmp_path))
    bad = tmp_path / "bad.cu"
    bad.write_text('#include "pk_host_emul.h"\n__global__ void k() { not_declared_here(); }\n')
    with pytest.raises(host_build.HostBuildError, match="not_declared_here"):
        host_build.build_module("_pk_bad", [bad])
