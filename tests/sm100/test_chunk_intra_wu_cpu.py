"""CPU: the fused chunk_intra + recompute_w_u kernel (chunk_intra_wu.py) compiles for sm_90a and sm_100a with fake
pointers through launch.intra_wu_kernel (two processes started together: the time of one compile), its
shared-memory plan keeps 2 CTAs per SM, and launch.chunk_intra_wu allocates and launches as launch.chunk_intra +
launch.recompute_w_u do (kernel and launch stubbed: nothing runs)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

ARCHS = ("sm_90a", "sm_100a")
COMPILE = ("import torch\n"
           "from cula_sm100.forward.launch import intra_wu_kernel\n"
           "for beta_dtype, act in ((torch.bfloat16, 'sigmoid'), (torch.float32, 'none')):\n"
           "    intra_wu_kernel(beta_dtype, act)\n"
           "    print('compiled', beta_dtype, act, flush=True)\n")

needs_dsl = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")


def _compile(arch):
    return subprocess.run([sys.executable, "-c", COMPILE], env=dict(os.environ, CUTE_DSL_ARCH=arch),
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def compiled_by_arch():
    with ThreadPoolExecutor(len(ARCHS)) as pool:  # the archs' compiles run side by side
        return dict(zip(ARCHS, pool.map(_compile, ARCHS), strict=True))


@needs_dsl
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_kernel_compiles(arch, compiled_by_arch):
    proc = compiled_by_arch[arch]
    rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    assert rc == 0, stdout[-2000:] + stderr[-4000:]
    assert stdout.count("compiled ") == 2, stdout


@needs_dsl
def test_shared_memory_plan():
    """Region R holds the score GEMMs' decayed keys, then bk | L | Aqk; the whole CTA fits 2 per SM (228 KiB per
    SM, 1 KiB reserved and 1 KiB static per CTA); the pieces of R keep the alignments their accesses need."""
    from cula_sm100.forward.chunk_intra_wu import ChunkIntraWU as C

    BT, K = C.BT, C.K
    assert C.R_BYTES >= C.Y_BLOCKS * C.BC * K * 2
    assert C.BK_BYTES == BT * K * 2 and C.L_BYTES == BT * C.L_STRIDE * 4 and C.AQK_BYTES == BT * BT * 2
    assert C.BK_BYTES % 1024 == 0 and (C.BK_BYTES + C.L_BYTES) % 1024 == 0  # swizzled tiles start on 1 KiB
    assert C.L_BYTES >= BT * K * 2  # w is staged where L was
    sG = BT * C.G_STRIDE * 4
    assert sG >= BT * K * 2 + 4 * C.BC * C.D_STRIDE * 4  # u staged where G was, past nothing still needed
    total = 2 * BT * K * 2 + sG + C.R_BYTES + BT * 4
    assert 2 * (total + 2048) <= 228 * 1024, total


def test_wrapper_allocates_and_launches(monkeypatch):
    """Outputs [TT, HV, 64] x 2 and [TT, HV, 128] x 3 bf16 on G's device; the kernel gets (q, k, v, G, beta, the 5
    outputs, chunk table) and (TT, NC, HQK, HV, scale), is keyed by (beta dtype, activation); no launch without
    chunks."""
    from cula_sm100.forward import launch

    calls = []
    monkeypatch.setattr(launch, "intra_wu_kernel", lambda dt, act: ("kernel", dt, act))
    monkeypatch.setattr(launch, "_launch", lambda kern, dtypes, tensors, scalars: calls.append(
        (kern, dtypes, tensors, scalars)))
    TT, HQK, HV = 70, 2, 4
    bf = torch.bfloat16
    q = k = torch.zeros(TT, HQK, 128, dtype=bf)
    v = torch.zeros(TT, HV, 128, dtype=bf)
    G = torch.zeros(TT, HV, 128)
    beta = torch.zeros(TT, HV)
    ctab = torch.tensor([[0, 64], [64, 6]], dtype=torch.int32)
    outs = launch.chunk_intra_wu(q, k, v, G, beta, ctab, scale=0.5, beta_activation="sigmoid")
    assert [tuple(o.shape) for o in outs] == [(TT, HV, 64)] * 2 + [(TT, HV, 128)] * 3
    assert all(o.dtype == bf for o in outs)
    (kern, dtypes, tensors, scalars), = calls
    assert kern == ("kernel", torch.float32, "sigmoid") and dtypes == launch.intra_wu_dtypes(torch.float32)
    assert tensors[:5] == (q, k, v, G, beta) and all(a is b for a, b in zip(tensors[5:10], outs, strict=True))
    assert tensors[10] is ctab and scalars == (TT, 2, HQK, HV, 0.5)
    assert [t.dtype for t in tensors] == list(dtypes)
    launch.chunk_intra_wu(q, k, v, G, beta, ctab[:0], scale=0.5, beta_activation="none")
    assert len(calls) == 1
