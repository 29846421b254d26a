"""CPU check of the kernels' source itself: packages/cula-sm89/emu runs kda_intra.cu and kda_inter.cu under a
host emulation of the CUDA execution model (a std::thread per CUDA thread, warp-level MMA emulated with tf32
operands), and the outputs must match cula_core.reference in fp64 as tightly as on a GPU. This catches
indexing, fragment-layout and barrier mistakes on machines without a GPU; the GPU tests remain the real check."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from sm89_cases import REL_TOL

EMU = Path(__file__).resolve().parents[2] / "packages" / "cula-sm89" / "emu" / "run_emu.py"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found: the emulator cannot be built")]


def run_emu():
    spec = importlib.util.spec_from_file_location("cula_sm89_run_emu", EMU)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", [
    dict(K=64, C=32, T=50, B=2, HQK=1, HV=2),                 # GVA, two batch rows, a partial chunk
    dict(K=128, C=64, T=70, varlen=True),  # K slices, segmented cumsum, varlen with an empty sequence
    dict(K=64, C=64, T=40, strong=True, h0=False, tile=16),   # the pairwise diagonal path, the 16-column state tile
], ids=["k64c32-gva", "k128c64-varlen", "k64c64-extreme-decay-tile16"])
def test_emulated_kernels_match_reference(case, tmp_path):
    errs = run_emu().check(**case, exe=str(tmp_path / "emu"))
    bad = {k: v for k, v in errs.items() if not v <= REL_TOL}
    assert not bad, f"relative errors above {REL_TOL}: {bad} (all: {errs})"
