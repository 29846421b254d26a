"""CPU: every cula-sm100 forward kernel compiles (CuTe DSL, fake pointers, through cula_core.cute_runtime) for
sm_90a and sm_100a.

The two architectures compile in two processes started together (one fixture), so the test takes the time of
one (about a minute), not of both."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from sm100_compile_check import KERNELS

HERE = Path(__file__).resolve().parent
ARCHS = ("sm_90a", "sm_100a")


@pytest.fixture(scope="module")
def compiled_by_arch():
    procs = {arch: subprocess.Popen([sys.executable, str(HERE / "sm100_compile_check.py"), arch],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for arch in ARCHS}
    out = {}
    for arch, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()  # this test's own child
            stdout, stderr = proc.communicate()
            stderr += "\ntimed out after 600 s"
        out[arch] = (proc.returncode, stdout, stderr)
    return out


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile(arch, compiled_by_arch):
    rc, stdout, stderr = compiled_by_arch[arch]
    assert rc == 0, stdout[-2000:] + stderr[-4000:]
    compiled = [line for line in stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == len(KERNELS), stdout


def test_chunk_delta_h_cluster_dispatch(monkeypatch):
    """chunk_delta_h launches as clusters of its 4 V slices from DELTA_H_CLUSTER_MIN_PAIRS (sequence, value head)
    pairs on and as plain CTAs below (the H100 sweep in launch.py), counting sequences, not batch rows, for varlen;
    an explicit `cluster` wins. The launch stubbed (CPU tensors; nothing launches)."""
    import torch

    from cula_sm100.forward import launch

    assert launch.DELTA_H_CLUSTER_MIN_PAIRS == 256
    assert not launch.chunk_delta_h_cluster(1, 64) and not launch.chunk_delta_h_cluster(2, 64)
    assert not launch.chunk_delta_h_cluster(1, 255)
    assert launch.chunk_delta_h_cluster(1, 256) and launch.chunk_delta_h_cluster(2, 128)
    assert launch.chunk_delta_h_cluster(8, 128)  # the benchmark's varlen batch: 8 sequences

    asked = []
    monkeypatch.setattr(launch, "launch_kernel", lambda kernel, *a: asked.append(kernel))
    monkeypatch.setattr(launch.rt, "sm_count", lambda index: 132)  # an H100's SMs (the stage choice)
    # plain CTAs take 2 w / kg stages while the grid (N HV 4 CTAs) fits the 132 SMs, 1 above; clusters 1
    for N, HV, cluster, want, stages in ((2, 64, None, False, 1), (4, 64, None, True, 1), (2, 128, None, True, 1),
                                         (4, 64, False, False, 1), (2, 64, True, True, 1), (1, 33, None, False, 2),
                                         (1, 34, None, False, 1), (2, 16, False, False, 2)):
        TT = 3 * N
        G = torch.zeros(TT, HV, 128)
        w = u = kg = torch.zeros(TT, HV, 128, dtype=torch.bfloat16)
        ctab = torch.zeros(N, 2, dtype=torch.int32)
        stab = torch.zeros(N, 3, dtype=torch.int32)
        launch.chunk_delta_h(w, u, kg, G, None, ctab, stab, output_final_state=False, cluster=cluster)
        assert asked[-1] == launch.delta_h_kernel(False, False, want, stages), (N, HV, cluster)
