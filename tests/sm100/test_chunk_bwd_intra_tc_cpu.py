"""CPU: chunk_bwd_intra_tc (the tensor-core intra-chunk backward, cula_sm100.backward.chunk_bwd_intra_tc) compiles
for sm_90a and sm_100a with fake pointers (through cula_core.cute_runtime; the two archs side by side), its
shared-memory plan fits 2 CTAs per SM, launch.chunk_bwd_intra picks it (or the
CUDA-core kernel) and passes the arguments in the compiled order (nothing runs), and the fp64 oracle of its GPU
tests agrees with torch_stages.intra (the CUDA-core kernel's oracle) on the CPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

ARCHS = ("sm_90a", "sm_100a")
COMPILE = ("import sys\n"
           "from cula_sm100.backward.launch import intra_tc_kernel\n"
           "from cula_sm100.runtime import compile_kernel\n"
           "compile_kernel(intra_tc_kernel(), sys.argv[1])\n"
           "print('compiled', flush=True)\n")

needs_dsl = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")


@pytest.fixture(scope="module")
def compiled_by_arch():
    """One process per arch, started together (the time of one arch's compiles): arch -> (returncode, output)."""
    procs = {arch: subprocess.Popen([sys.executable, "-c", COMPILE, arch], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for arch in ARCHS}
    outs = {arch: p.communicate(timeout=900)[0] for arch, p in procs.items()}  # drains the pipes as they fill
    return {arch: (procs[arch].returncode, out) for arch, out in outs.items()}


@needs_dsl
@pytest.mark.parametrize("arch", ARCHS)
def test_kernel_compiles(arch, compiled_by_arch):
    rc, out = compiled_by_arch[arch]
    assert rc == 0, out[-6000:]
    assert out.count("compiled") == 1, out[-6000:]


@needs_dsl
def test_shared_memory_plan():
    """2 CTAs per SM (228 KiB per SM, 1 KiB reserved per CTA); the padded strides keep 16-byte rows (cp.async of
    q, k, G; ldmatrix rows of dSq / dL) and the bank spreads the kernel's comments claim."""
    from cula_sm100.backward.chunk_bwd_intra_tc import ChunkBwdIntraTC as C

    assert 2 * (C.SMEM + 1024) <= 228 * 1024, C.SMEM
    assert (C.QK_STRIDE * 2) % 16 == 0 and (C.G_STRIDE * 4) % 16 == 0 and (C.A_STRIDE * 2) % 16 == 0
    # B-fragment element loads: rows 2t (+1, +8, +9), t < 4, channels c < 8 -> distinct 4-byte banks
    for stride, width in ((C.G_STRIDE, 4), (C.QK_STRIDE, 2)):
        banks = {((2 * t * stride + c) * width // 4) % 32 for t in range(4) for c in range(8)}
        assert len(banks) == (32 if width == 4 else 16), (stride, banks)
    # ldmatrix: 8 rows of 16 bytes at one column offset fall in 8 distinct 16-byte bank groups
    assert len({(r * C.A_STRIDE * 2 // 16) % 8 for r in range(8)}) == 8


def test_launch_picks_the_kernel_and_passes_arguments_in_order(monkeypatch):
    """launch.chunk_bwd_intra launches the tensor-core kernel (by default) or, with tc=False, the CUDA-core kernel,
    with (q, k, G, beta, dAqk, dL, dq, dk, dbeta, dG, chunk table) and (TT, NC, HQK, HV, scale); nothing is launched
    without chunks."""
    from cula_sm100.backward import launch

    calls = []
    monkeypatch.setattr(launch, "intra_tc_kernel", lambda: ("tc",))
    monkeypatch.setattr(launch, "intra_kernel", lambda: ("cuda-core",))
    monkeypatch.setattr(launch.fwd, "launch_kernel", lambda kern, dtypes, tensors, scalars: calls.append(
        (kern, dtypes, tensors, scalars)))
    TT, HQK, HV = 70, 2, 4
    bf = torch.bfloat16
    q, k = torch.zeros(TT, HQK, 128, dtype=bf), torch.zeros(TT, HQK, 128, dtype=bf)
    G = torch.zeros(TT, HV, 128)
    beta = torch.zeros(TT, HV)
    dA, dL = torch.zeros(TT, HV, 64), torch.zeros(TT, HV, 64)
    dq, dk, db, dG = torch.zeros(TT, HQK, 128), torch.zeros(TT, HQK, 128), torch.zeros(TT, HV), torch.zeros(TT, HV, 128)
    ctab = torch.zeros(2, 2, dtype=torch.int32)
    args = (q, k, G, beta, dA, dL, dq, dk, db, dG)
    launch.chunk_bwd_intra(*args, ctab, scale=0.5)
    launch.chunk_bwd_intra(*args, ctab, scale=0.5, tc=True)
    launch.chunk_bwd_intra(*args, ctab, scale=0.5, tc=False)
    launch.chunk_bwd_intra(*args, ctab[:0], scale=0.5)
    assert [c[0] for c in calls] == [("tc",), ("tc",), ("cuda-core",)]
    for _, dtypes, tensors, scalars in calls:
        assert dtypes == launch.INTRA_DTYPES
        assert len(tensors) == 11 and all(t is w for t, w in zip(tensors, (*args, ctab), strict=True))
        assert scalars == (TT, 2, HQK, HV, 0.5)


@pytest.mark.parametrize("lengths,HQK,HV,decay", [([17, 1, 64, 65, 0, 70], 1, 2, 0.25), (None, 2, 2, 8.0)])
def test_fp64_oracle_matches_torch_stage(lengths, HQK, HV, decay):
    """The GPU tests' oracle (chunk_bwd_intra_tc_memcheck_case.intra_fp64: the pair sums from the definition in
    fp64) against torch_stages.intra + reverse_cumsum (a vector-Jacobian product through the reference's decayed
    scores, fp32), strong and mild decay, varlen with empty and short sequences, GVA 2."""
    from chunk_bwd_intra_tc_memcheck_case import intra_fp64, problem
    import torch_stages

    args, _base, _ctab, ch, scale = problem(lengths, HQK, HV, decay, T=130, seed=4, device="cpu")
    q, k, G, beta, dA, dL = args
    ours = intra_fp64(*args, ch, scale=scale)
    e = torch_stages.intra(q, k, G, beta, ch.chunk(dA).permute(0, 2, 1, 3), dL, ch, scale=scale)
    e = (*e[:3], torch_stages.reverse_cumsum(e[3], ch))
    for name, o, x in zip(("dq", "dk", "dbeta", "dG"), ours, e, strict=True):
        err = ((o - x.double()).norm() / x.double().norm()).item()
        assert err < 1e-4, f"{name}: rel err {err:.3e}"  # fp32 stage against fp64
