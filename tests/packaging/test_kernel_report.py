"""tools/kernel_report.py reads real numbers out of real cubins (CPU only): it compiles one decode kernel and two
tensor-core kernels (mma.sync, wgmma) for sm_90a and its parsed fields agree with what the kernel classes declare.
Plus its parsers on fixed text (widths, the host IR's launch config, the occupancy rules). Skips only where
cuobjdump is missing (it ships in the CUDA toolkit and in the `nvidia-cuda-cuobjdump` wheel) or CuTe DSL is not
installed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools import kernel_report as kr  # noqa: E402

DECODE, MMA = "decode.recurrent[final,T=4]", "fwd.fwd_o"
WGMMA = "prefill.chunk_state_wg[128 cols] (stage 2)"
STAGE1 = "prefill.chunk_intra_tc (stage 1)"
PACKED = "prefill.chunk_intra_tc_packed (stage 1, packed tiles)"


@pytest.fixture(scope="module")
def reports():
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("nvidia-cutlass-dsl not installed: nothing to compile")
    why = kr.missing_tools()
    if why:
        pytest.skip(f"kernel_report needs a CUDA binary tool: {why}")
    proc = subprocess.run([sys.executable, "-m", "tools.kernel_report", "--kernel", DECODE, "--kernel", MMA,
                           "--kernel", WGMMA, "--kernel", STAGE1, "--kernel", PACKED, "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {r["name"]: r for r in json.loads(proc.stdout)}


def test_decode_kernel_fields(reports):
    from cula_sm90.decode.recurrent import RecurrentDecode

    r = reports[DECODE]
    kern = RecurrentDecode(T=4, K=128, V=128, mode="final", safe_gate=False, has_A_log=True, has_dt_bias=True,
                           l2norm=True)
    assert r["arch"] == "sm_90a" and not r["error"]
    assert 0 < r["regs"] <= 255
    assert r["threads"] == 32 * kern.NW
    assert r["dynamic_smem"] == kern.smem_bytes          # what the launch passes as smem=
    assert r["static_smem"] in (0, 1024)
    assert 1 <= r["ctas_per_sm"] <= kr.SM_CTAS and r["limiter"]
    assert r["sass_total"] > 100 and r["mix"]["LDG"] > 0 and r["mix"]["STG"] > 0
    assert r["mix"]["HMMA"] == 0                          # a SIMT kernel
    assert r["spill_stores"] in (None, 0)


def test_wgmma_kernel_fields(reports):
    """The sm90 prefill's stage 2 at 128 columns per CTA: its products on wgmma only (w @ h and kg^T @ v_new split
    hi + lo, qg @ h, Aqk @ v_new: 16 + 16 + 8 + 4 instructions of m64n64k16), stmatrix stores, no spills, and the
    shared memory its docstring states (two stages of w, qg, kg, Aqk and the u slices; h hi / lo; v_new lo; the
    decay row; the two stages' mbarriers): one CTA per SM. Tiles arrive by TMA (no cp.async left). Global stores: o
    in 16-byte rows, the K-first final state as 64-bit column pairs (a thread's 64 fp32 state elements: 32 pairs) and
    nothing narrower."""
    r = reports[WGMMA]
    assert not r["error"] and r["threads"] == 256 and 0 < r["regs"] <= 255
    assert r["mix"]["HGMMA"] == 44 and r["mix"]["HMMA"] == 0 and r["mix"]["STSM"] > 0
    assert {int(w): n for w, n in r["stg"].items()} == {64: 32, 128: 4}
    assert r["spill_stores"] in (None, 0) and r["local"] == 0
    tile = 64 * 128 * 2
    assert r["dynamic_smem"] == 2 * (3 * tile + 64 * 64 * 2 + tile) + 2 * 2 * tile + tile + 128 * 4 + 2 * 8
    assert r["ctas_per_sm"] == 1
    assert r["mix"]["TMA"] > 0 and r["mix"]["LDGSTS"] == 0


def test_prefill_stage1_fits_three_ctas_per_sm(reports):
    """The sm90 prefill's tensor-core stage 1 is laid out for three CTAs (24 warps) per SM: the 72 KiB of shared
    memory its docstring states (q, k tiles, the region R and the L tile, the boundary and S tables, beta) and
    at most 80 registers, no spills; its scores and the inverse's off-diagonal blocks on mma.sync."""
    r = reports[STAGE1]
    assert not r["error"] and r["threads"] == 256
    tile = 64 * 128 * 2
    assert r["dynamic_smem"] == 2 * tile + 64 * 128 * 2 + 64 * 65 * 4 + 5 * 128 * 4 + 64 * 4 + 10 * 128 * 4
    assert r["regs"] <= 80 and r["spill_stores"] in (None, 0) and r["local"] == 0
    assert r["ctas_per_sm"] == 3
    assert r["mix"]["HMMA"] > 0 and r["mix"]["HGMMA"] == 0


def test_packed_stage1_fits_three_ctas_per_sm(reports):
    """The packed stage 1 is the tensor-core stage 1 with its tile's block table (4 blocks x 5 int32) beside: still
    three CTAs per SM, at most 80 registers, no spills."""
    r, base = reports[PACKED], reports[STAGE1]
    assert not r["error"] and r["threads"] == 256
    assert r["dynamic_smem"] == base["dynamic_smem"] + 4 * 5 * 4
    assert r["regs"] <= 80 and r["spill_stores"] in (None, 0) and r["local"] == 0
    assert r["ctas_per_sm"] == 3


def test_mma_kernel_fields(reports):
    from cula_sm100.forward.fwd_o import FwdO

    r = reports[MMA]
    assert not r["error"] and 0 < r["regs"] <= 255 and r["threads"] == FwdO.threads
    # SmemAllocator tiles q [BT, K], h [K, V], Aqk [BT, BT], v_new [BT, V], bf16 (smem=None: the DSL's total)
    assert r["dynamic_smem"] == 2 * (FwdO.BT * FwdO.K + FwdO.K * FwdO.V + FwdO.BT * FwdO.BT + FwdO.BT * FwdO.V)
    assert r["mix"]["HMMA"] > 0


def test_markdown_has_a_row_per_kernel(reports):
    text = kr.markdown([kr.Report(**r) for r in reports.values()])
    for name in (DECODE, MMA):
        assert sum(line.startswith(f"| {name} |") for line in text.splitlines()) == 2  # resources and mix


def test_parsers_on_fixed_text():
    assert [kr.access_width(op) for op in ("STG.E.U16", "STG.E", "LDG.E.128.CONSTANT", "LDS.64", "STL.S8")] == \
        [16, 32, 128, 64, 8]
    rep = kr.Report(name="x", family="y")
    kr.parse_sass("        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n"
                  "        /*0010*/              @!P0 STG.E.U16 desc[UR4][R2.64], R5 ;\n"
                  "        /*0020*/                   MUFU.EX2 R3, R3 ;\n"
                  "        /*0030*/                   NOP ;\n", rep)
    assert rep.sass_total == 3 and rep.mix["HMMA"] == 1 and rep.stg == {16: 1} and rep.mix["MUFU.EX2"] == 1
    cfg = kr._LAUNCH_CFG
    ir = (f"    %12 = llvm.mlir.constant(223104 : i64) : i64\n"
          f"    %74 = llvm.getelementptr %68[0, 2] : (!llvm.ptr) -> !llvm.ptr, {cfg}\n"
          f"    llvm.store %12, %74 : i64, !llvm.ptr\n")
    assert kr.dynamic_smem_from_host_ir(ir) == [223104]
    # the sm90 prefill's stage 1 as the report sees it: 243 registers x 256 threads, 1 + 217.9 KiB
    rep = kr.Report(name="x", family="y", threads=256, regs=243, static_smem=1024, dynamic_smem=223104)
    kr.occupancy(rep)
    assert rep.ctas_per_sm == 1 and rep.limiter == "registers/smem"
    rep = kr.Report(name="x", family="y", threads=128, regs=64, static_smem=0, dynamic_smem=0)
    kr.occupancy(rep)
    assert rep.ctas_per_sm == 8 and rep.limiter == "registers"
    # 256 threads, 80 registers, 75 KiB dynamic (+ the DSL's 1 KiB padding section, not allocated): three CTAs
    # per SM, as ncu measured for the prefill's stage 1 with that launch on an H100 / H200
    rep = kr.Report(name="x", family="y", threads=256, regs=80, static_smem=1024, dynamic_smem=76800)
    kr.occupancy(rep)
    assert rep.ctas_per_sm == 3 and rep.limiter == "registers/smem"
