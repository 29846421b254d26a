"""The CPU side of tools/bench/mtp_decode.py's `--pool-forms` and `--stream-thresholds` sections: the bytes a T = 1
decode moves at least (the HBM-bound percentages rest on them), the cells timed and the rendering of their tables
from synthetic rows (no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.bench import mtp_decode as bench  # noqa: E402


def test_decode_bytes_count_the_state_in_the_pools_dtype():
    N, H, K = 128, 32, 128
    state = N * H * K * K
    small = N * H * (3 * K + K + 1) * 2 + N * H * K * 2   # bf16 q, k, g, v, beta and o
    assert bench.decode_bytes(N, H, torch.float32) == 2 * state * 4 + small
    assert bench.decode_bytes(N, H, torch.bfloat16) == 2 * state * 2 + small


def test_pool_forms_cover_both_dtypes_and_layouts():
    assert set(bench.POOL_FORMS) == {(d, v) for d in (torch.float32, torch.bfloat16) for v in (False, True)}


def test_pool_form_row_names_the_dispatchs_kernel():
    """The `kernel` column follows the per-form thresholds (bf16 pools stream from 2048 request-heads, V-first fp32
    pools at any size)."""
    pytest.importorskip("cula_sm90")
    row = bench.pool_form_row(torch.bfloat16, False, 32, 64)
    assert row == dict(pool="bfloat16", v_first=False, H=32, N=64, kernel="streamed")
    assert bench.pool_form_row(torch.bfloat16, False, 32, 63)["kernel"] == "recurrent"
    assert bench.pool_form_row(torch.float32, True, 32, 1)["kernel"] == "streamed"


def test_persistent_pass_takes_the_streamed_kernels_layout():
    """The persistent in-place pass of `--pool-forms` walks items of one state slice with as many programs as the
    streamed decode launches: 128 x 128 bf16 slices on [K, V] pools (3 CTAs per SM), 128 x 64 slices on V-first bf16
    pools (4 CTAs per SM) and on fp32 pools (3 CTAs per SM)."""
    pytest.importorskip("cula_sm90")
    assert bench.stream_layout(torch.bfloat16, False, 132) == (128 * 128, 3 * 132)
    assert bench.stream_layout(torch.bfloat16, True, 132) == (128 * 64, 4 * 132)
    assert bench.stream_layout(torch.float32, False, 100) == (128 * 64, 3 * 100)


def test_pool_forms_table_renders_rows_and_errors():
    rows = [dict(pool="bfloat16", v_first=True, H=32, N=128, kernel="streamed", ms=0.0786, hbm_pct=72.34,
                 copy_hbm_pct=86.04, inplace_hbm_pct=86.46, persistent_hbm_pct=79.95, err_o=2e-3, err_pool=1.8e-3),
            dict(pool="float32", v_first=False, H=64, N=512, kernel="recurrent", ms=1.1313, hbm_pct=79.6)]
    out = bench.render_pool_forms(rows, {"gpu": "NVIDIA H200"}, 4800.0)
    lines = out.splitlines()
    assert lines[0].startswith("GPU: NVIDIA H200; HBM bound taken at 4800 GB/s.")
    assert ("| bfloat16 | V-first | 32 | 128 | streamed | 0.0786 | 72.3% | 86.0% | 86.5% | 80.0% | 2.0e-03 | 1.8e-03 |"
            in lines)
    assert "| float32 | K-first | 64 | 512 | recurrent | 1.1313 | 79.6% | - | - | - | - | - |" in lines
    header = ("| pool | layout | H | N | kernel | ms | % of HBM bound | state copy % of HBM bound | in-place pass % | "
              "persistent in-place pass % | err o | err pool |")
    assert lines.index(header) < len(lines) - 2


def test_stream_threshold_cells_straddle_every_threshold():
    """Two cells (H = 32 and 64) per request-head count N * H from 512 to 16384, one at 32768: the thresholds of
    configs.STREAM_MIN_HEADS (2048, 8192) and the counts just below them are timed."""
    counts = {}
    for H, N in bench.STREAM_CELLS:
        counts.setdefault(H * N, set()).add(H)
    assert counts == {**{512 * 2 ** i: {32, 64} for i in range(6)}, 32768: {64}}


def test_stream_thresholds_table_renders_the_ratio():
    rows = [dict(pool="bfloat16", v_first=False, H=64, N=16, kernel="recurrent", tiling=(64, 4, 4, 0),
                 dispatch=0.0209, recurrent=0.0209),
            dict(pool="float32", v_first=True, H=32, N=16, kernel="streamed", tiling=(64, 4, 4, 0), dispatch=0.0197,
                 recurrent=0.0279)]
    lines = bench.render_stream_thresholds(rows, {"gpu": "NVIDIA H200"}).splitlines()
    assert lines[0].startswith("GPU: NVIDIA H200.")
    assert "| bfloat16 | K-first | 64 | 16 | 1024 | recurrent | 0.0209 | 64x4x4x0 | 0.0209 | 1.00 |" in lines
    assert "| float32 | V-first | 32 | 16 | 512 | streamed | 0.0197 | 64x4x4x0 | 0.0279 | 1.42 |" in lines
