"""The instruction-set seam: every variant builds on any x86-64 compiler, the driver holds no
AVX instruction, the choice follows the CPU or FASTDRAFT_ISA, and every variant this CPU runs
agrees with the scalar oracle: bit for bit on the integer block sums of the weight-only
matmul (extreme codes included), within stated tolerances on float results."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import fastdraft.kernels

from fastdraft.formats import PER_CHANNEL, pack_int4, pack_int6, quantize, sym_zero_point, unpack_int4, unpack_int6
from fastdraft.kernels.build import (ISA_NAMES, CpuKernels, build_isa_library, cache_dir, load_cpu_kernels,
                                     load_driver, runnable_isas, select_isa)
from fastdraft.kernels.x86 import X86WoqKernel

pytestmark = pytest.mark.skipif(load_driver() is None, reason="fastdraft's C++ kernels cannot build here")

SIMD_ISAS = [name for name in (runnable_isas() if load_driver() is not None else []) if name != "scalar"]


@pytest.fixture(autouse=True)
def _every_isa(monkeypatch) -> None:
    """These tests name their variants themselves: no FASTDRAFT_ISA from the directory's fixture."""
    monkeypatch.delenv("FASTDRAFT_ISA", raising=False)


AVX2_ONLY = {"avx2": True, "fma": True, "f16c": True}
AVX512 = dict(AVX2_ONLY, avx512f=True, avx512bw=True, avx512vl=True, avx512dq=True, avx512_vnni=True)


def _disassembly(path) -> str:
    if shutil.which("objdump") is None:
        pytest.skip("objdump not found")
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.parametrize("name", ISA_NAMES)
def test_every_variant_builds_and_exports_only_its_table(name):
    """Any x86-64 compiler builds every variant, whatever CPU it runs on (so a machine without
    AVX-512 still catches a broken AVX-512 build)."""
    path = build_isa_library(name)
    if shutil.which("nm") is None:
        pytest.skip("nm not found")
    exported = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True,
                              check=True).stdout.split()
    assert [s for s in exported if not re.fullmatch(r"[0-9a-f]+|[A-Za-z]", s)] == ["fastdraft_kernel_table"]


@pytest.mark.parametrize("name, forbidden", [
    ("scalar", r"%[yz]mm"),
    ("avx2", r"%zmm|\{%k[0-7]\}|vpdpbusd"),
    ("avx2_vnni", r"%zmm|\{%k[0-7]\}|(?<!\{vex\} )vpdpbusd"),  # AVX-VNNI's VEX form, never AVX512-VNNI's
])
def test_a_variant_holds_no_instruction_beyond_its_set(name, forbidden):
    assert not re.search(forbidden, _disassembly(build_isa_library(name)))


def test_intrinsics_live_only_in_the_simd_layers():
    """Kernel bodies are written once against the SIMD layer: no x86 intrinsic (or its types)
    anywhere in the C++ sources but the simd_<isa>.h headers."""
    csrc = Path(fastdraft.kernels.__file__).parent / "csrc"
    sources = [p for p in csrc.rglob("*") if p.suffix in (".h", ".cpp", ".cc")]
    assert len(sources) > 10
    offenders = [f"{p.relative_to(csrc)}:{i}" for p in sources if not p.name.startswith("simd_")
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"\b_mm\d*_\w+|\b__m(128|256|512)|immintrin\.h", line)]
    assert offenders == []
    assert sorted(p.name for p in csrc.rglob("simd_*.h")) == ["simd_avx2.h", "simd_avx512.h"]


def test_no_variant_probes_the_cpu_vendor():
    """Tuning by vendor is the driver's choice (isa.cpp::cpu_tuning), passed with each call."""
    isa_src = Path(fastdraft.kernels.__file__).parent / "csrc" / "isa"
    offenders = [f"{p.name}:{i}" for p in isa_src.iterdir() if p.suffix in (".h", ".cpp")
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"__builtin_cpu_is\b|__get_cpuid\b|\bcpuid\b", line)]
    assert offenders == []


def test_the_driver_holds_no_avx_instruction():
    """The driver is built with no ISA flags: no AVX instruction can run before (or instead of)
    the chosen variant's, as one placed by the compiler in init code would on older CPUs."""
    libraries = list(cache_dir().glob("*.so"))
    assert libraries
    assert not re.search(r"%[yz]mm", _disassembly(libraries[0]))


def test_the_best_variant_the_cpu_runs_is_chosen():
    assert select_isa({}, requested=None) == "scalar"
    assert select_isa(AVX2_ONLY) == "avx2"
    assert select_isa(dict(AVX2_ONLY, avx512f=True)) == "avx2"  # AVX-512 without VNNI
    assert select_isa(AVX512) == "avx512_vnni"
    assert runnable_isas(AVX2_ONLY) == ["scalar", "avx2"]
    assert select_isa(dict(AVX2_ONLY, avx_vnni=True)) == "avx2_vnni"  # Alder Lake, Zen 5 without AVX-512
    assert select_isa(dict(AVX512, avx_vnni=True)) == "avx512_vnni"  # Sapphire Rapids


def test_fastdraft_isa_forces_a_variant_or_fails_clearly(monkeypatch):
    monkeypatch.setenv("FASTDRAFT_ISA", "scalar")
    assert select_isa(AVX512) == "scalar"
    monkeypatch.setenv("FASTDRAFT_ISA", "avx512_vnni")
    with pytest.raises(ValueError, match="FASTDRAFT_ISA=avx512_vnni: this CPU .* lacks avx512f, .*; it runs scalar, avx2"):
        select_isa(AVX2_ONLY)
    monkeypatch.setenv("FASTDRAFT_ISA", "avx9")
    with pytest.raises(ValueError, match="unknown instruction-set variant 'avx9': choose one of scalar, avx2, avx2_vnni, avx512_vnni"):
        select_isa(AVX512)


@pytest.mark.parametrize("name", runnable_isas() if load_driver() is not None else [])
def test_the_forced_variant_is_the_one_loaded(monkeypatch, name):
    monkeypatch.setenv("FASTDRAFT_ISA", name)
    load_cpu_kernels.cache_clear()
    try:
        kernels = load_cpu_kernels()
        assert kernels.name == name and kernels.isa.name == name
    finally:
        monkeypatch.delenv("FASTDRAFT_ISA")
        load_cpu_kernels.cache_clear()


# ---- against the scalar oracle ------------------------------------------------------------

def _with_extremes(qw):
    """qw with its first rows at the extreme codes: all lowest, all highest, alternating."""
    if qw.bits == 4:
        codes = unpack_int4(qw.qweight)
    elif qw.bits == 6:
        codes = unpack_int6(qw.qweight)
    else:
        codes = qw.qweight.to(torch.int16)
    low, high = (0, 15) if qw.bits == 4 else (0, 63) if qw.bits == 6 else (-127, 127)
    codes[0] = low
    codes[1] = high
    codes[2, 0::2], codes[2, 1::2] = low, high
    if qw.bits == 4:
        qw.qweight = pack_int4(codes)
    elif qw.bits == 6:
        qw.qweight = pack_int6(codes)
    else:
        qw.qweight = codes.to(torch.int8)
    return qw


WEIGHTS = [  # (bits, group, sym, float zeros)
    (4, 32, True, False), (4, 128, True, False), (4, PER_CHANNEL, False, False), (4, 64, False, True),
    (6, 16, True, False), (6, 32, True, False), (8, 32, True, False), (8, 128, True, False),
]


def _activations(rows: int, k: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0] = 1.0  # every block's values at +127
    if rows > 1:
        x[1, 0::2], x[1, 1::2] = -3.0, 3.0  # alternating -127 / +127
    return x


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("bits, group, sym, float_zeros", WEIGHTS)
def test_block_sums_and_outputs_match_scalar(isa, bits, group, sym, float_zeros):
    torch.manual_seed(bits * 1000 + group)
    n, k = 72, 384  # a partial last tile
    qw = _with_extremes(quantize(torch.randn(n, k), bits, group, sym=sym, float_zeros=float_zeros))
    scalar, simd = load_cpu_kernels("scalar"), load_cpu_kernels(isa)
    args = X86WoqKernel(qw, torch.float32, torch.device("cpu"), kernels=scalar).op_args
    simd_args = X86WoqKernel(qw, torch.float32, torch.device("cpu"), kernels=simd).op_args
    for rows in (1, 2, 3, 5, 9):  # every row-count kernel, and more rows than one pass takes
        x = _activations(rows, k)
        sums = scalar.woq_block_sums(x, *args)  # [rows, n_pad, num_blocks]
        assert torch.equal(simd.woq_block_sums(x, *simd_args), sums)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            y = scalar.woq_linear(x.to(dtype), *args).float()
            y_simd = simd.woq_linear(x.to(dtype), *simd_args).float()
            assert (y_simd - y).abs().max() <= tol * y.abs().max()


@pytest.mark.parametrize("bits, group, sym, float_zeros", WEIGHTS)
def test_scalar_block_sums_are_the_integer_dot_products(bits, group, sym, float_zeros):
    """The oracle itself, against int64 arithmetic on the unpacked codes."""
    torch.manual_seed(bits + group)
    n, k = 40, 256
    qw = _with_extremes(quantize(torch.randn(n, k), bits, group, sym=sym, float_zeros=float_zeros))
    kernel = X86WoqKernel(qw, torch.float32, torch.device("cpu"), kernels=load_cpu_kernels("scalar"))
    block = kernel.weight.block
    x = _activations(3, k)
    xb = x.reshape(3, -1, block)
    d = xb.abs().amax(-1) / 127.0
    xq = torch.round(xb * torch.where(d > 0, 1.0 / d, 0.0).unsqueeze(-1)).to(torch.int64)  # [3, blocks, block]
    if bits == 4:
        codes = unpack_int4(qw.qweight).to(torch.int64)
    elif bits == 6:
        codes = unpack_int6(qw.qweight).to(torch.int64)
    else:
        codes = qw.qweight.to(torch.int64) + sym_zero_point(8)
    if qw.zeros is None:  # constant zero point: taken inside the block sums
        codes = codes - sym_zero_point(bits)
    expected = torch.einsum("mbk,nbk->mnb", xq, codes.reshape(n, -1, block))
    sums = kernel.ext.woq_block_sums(x, *kernel.op_args)[:, :n]
    assert torch.equal(sums.to(torch.int64), expected)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return bool((a.float() - b.float()).abs().max() <= rel * b.float().abs().max())


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_elementwise_kernels_match_scalar(isa, dtype, rel):
    scalar, simd = load_cpu_kernels("scalar"), load_cpu_kernels(isa)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 200, generator=gen).to(dtype)  # a vector tail
    w = torch.randn(200, generator=gen).to(dtype)
    assert _close(simd.rms_norm(x, w, 1e-6), scalar.rms_norm(x, w, 1e-6), rel)
    gate_up = (4 * torch.randn(5, 2 * 200, generator=gen)).to(dtype)
    assert _close(simd.silu_and_mul(gate_up), scalar.silu_and_mul(gate_up), rel)
    assert _close(simd.gelu_tanh_and_mul(gate_up), scalar.gelu_tanh_and_mul(gate_up), rel)
    # Gemma's offset norm: the same sums in the same order, so bit for bit.
    w1 = 1.0 + torch.randn(200, generator=gen)
    assert torch.equal(simd.rms_norm_offset(x, w1, 1e-6), scalar.rms_norm_offset(x, w1, 1e-6))
    rows = torch.randn(5, 3 * 64, generator=gen).to(dtype)
    cos, sin = torch.randn(5, 64, generator=gen).to(dtype), torch.randn(5, 64, generator=gen).to(dtype)
    assert _close(simd.rotary(rows, cos, sin, 3, 64), scalar.rotary(rows, cos, sin, 3, 64), rel)


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [0, 7, 270])
def test_paged_attention_matches_scalar(isa, dtype, rel, head_dim, window):
    """Two sequences, one 300 keys long (two key splits) with 3 new tokens, one decoding; all
    keys, or a window starting inside the first split or the second."""
    scalar, simd = load_cpu_kernels("scalar"), load_cpu_kernels(isa)
    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, block_size, num_blocks = 4, 2, 16, 32
    k_blocks = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen).to(dtype)
    v_blocks = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:20], torch.randperm(num_blocks, generator=gen)[:20]])
    lens = torch.tensor([300, 40])
    qsl = torch.tensor([0, 3, 4])
    q = torch.randn(4, heads, head_dim, generator=gen).to(dtype)
    args = (q, k_blocks, v_blocks, tables, qsl, lens, head_dim ** -0.5, window)
    assert _close(simd.paged_attention(*args), scalar.paged_attention(*args), rel)


@pytest.mark.parametrize("isa", SIMD_ISAS)
def test_sampling_kernels_match_scalar(isa):
    scalar, simd = load_cpu_kernels("scalar"), load_cpu_kernels(isa)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 1000, generator=gen)
    logits[1, 700] = float("nan")
    logits[2] = 0.25  # all tied
    assert torch.equal(simd.argmax_rows(logits), scalar.argmax_rows(logits))
    probs = torch.softmax(torch.randn(6, 1000, generator=gen), -1)
    uniform = torch.rand(6, generator=gen, dtype=torch.float64)
    assert torch.equal(simd.sample_rows(probs, uniform), scalar.sample_rows(probs, uniform))


TUNING_NAMES = ("woq_few_rows_prefetch", "woq_one_chain_many_rows", "attention_prefetch_l2")


def test_the_driver_tunes_for_this_cpu_and_takes_overrides():
    driver, path = load_driver(), str(build_isa_library("scalar"))
    tuning = driver.load_isa(path).tuning
    assert sorted(tuning) == sorted(TUNING_NAMES)
    flipped = {name: not value for name, value in tuning.items()}
    assert driver.load_isa(path, tuning=flipped).tuning == flipped
    with pytest.raises(RuntimeError, match="unknown tuning choice"):
        driver.load_isa(path, tuning={"prefetch_everything": True})


@pytest.mark.parametrize("isa", SIMD_ISAS)
def test_no_tuning_changes_a_result(isa):
    """Every tuning choice runs here whatever this CPU's vendor, and gives the same bits."""
    driver, path = load_driver(), str(build_isa_library(isa))
    tunings = [{}, dict.fromkeys(TUNING_NAMES, False), dict.fromkeys(TUNING_NAMES, True)]
    kernels = [CpuKernels(driver, driver.load_isa(path, tuning=t)) for t in tunings]
    gen = torch.Generator().manual_seed(3)
    qw = quantize(torch.randn(72, 384, generator=gen), 4, 32, sym=True)
    weights = [X86WoqKernel(qw, torch.float32, torch.device("cpu"), kernels=k).op_args for k in kernels]
    for rows in range(1, 10):  # few rows (prefetch), 5+ rows (chains)
        x = _activations(rows, 384)
        y = [k.woq_linear(x, *w) for k, w in zip(kernels, weights)]
        assert all(torch.equal(y[0], other) for other in y[1:])
    heads, kv_heads, block_size, head_dim = 4, 2, 16, 64
    k_blocks, v_blocks = (torch.randn(16, kv_heads, block_size, head_dim, generator=gen) for _ in range(2))
    tables = torch.randperm(16, generator=gen)[:12].reshape(1, 12)
    q = torch.randn(2, heads, head_dim, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):  # bf16: the bf16 dot products where the CPU has them
        args = (q.to(dtype), k_blocks.to(dtype), v_blocks.to(dtype), tables, torch.tensor([0, 2]),
                torch.tensor([180]), head_dim ** -0.5)
        out = [k.paged_attention(*args) for k in kernels]
        assert all(torch.equal(out[0], other) for other in out[1:])
