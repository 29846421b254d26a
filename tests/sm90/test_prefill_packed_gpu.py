"""GPU tests of the packed stage 1 (chunk_intra_tc_packed: the partial chunks of a batch share 64-row tiles): the
whole prefill with packing on against cula_core.reference in fp64 (REL_TOL, as test_prefill_gpu.py) and against
packing off, and stage 1's outputs packed against unpacked on every valid token.

Packed == unpacked is asserted bit for bit: per piece, the packed kernel runs the same operations in the same
order as the unpacked one does on the piece's chunk (the same 16-row blocks, the same scan order of the block
totals, the same score and inverse products, and w and u summed over the piece's own blocks only). So o and the
final state match bit for bit too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_cases import REL_TOL, gate_kwargs, make_raw, reference, rel_err, require_gpu, run_memcheck

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
K = 128


@pytest.fixture(autouse=True)
def _gpu(monkeypatch):
    require_gpu()
    monkeypatch.setenv("CULA_BACKEND", "sm90")


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _prefill(x, lens, pack, h0=None, final=True, state_v_first=False):
    """forward.prefill as the sm90 backend runs it (sigmoid beta, in-kernel L2 norm, the safe gate) with
    `pack_stage1` given."""
    from cula_sm90.prefill import forward

    q, k, v, g, beta, A_log, dt_bias = x
    cu = _cu(lens)
    return forward.prefill(q, k, v, g, beta, A_log, dt_bias, h0, cu.cuda(), cu, scale=K ** -0.5,
                           output_final_state=final, use_qk_l2norm_in_kernel=True, gate="safe", lower_bound=-5.0,
                           beta_activation="sigmoid", state_v_first=state_v_first, pack_stage1=pack)


# lengths: short sequences (1 - 15 tokens), empty ones, multiples of 16 and of 64, a mix with long sequences
LENGTHS = {
    "short": [1, 2, 3, 5, 7, 8, 11, 13, 15, 4, 9, 6],
    "empty": [0, 5, 0, 0, 17, 0, 33, 1, 0],
    "one": [37],
    "mult16": [16, 32, 48, 16, 64, 80, 96, 112, 48, 32],
    "mult64": [64, 128, 192, 64, 5, 64],
    "mixed": [3000, 5, 70, 1, 129, 4096, 17, 33, 49, 63, 65, 0, 200],
    "random64": None,  # 64 random lengths, the benchmark's varlen shape (4096 tokens)
}


def _lengths(name):
    if LENGTHS[name] is not None:
        return LENGTHS[name]
    gen = torch.Generator().manual_seed(64)
    cuts = torch.randperm(4095, generator=gen)[:63].add(1).sort().values.tolist()
    return [b - a for a, b in zip([0, *cuts], [*cuts, 4096], strict=True)]


@pytest.mark.parametrize("h0", [False, True], ids=["no-h0", "h0"])
@pytest.mark.parametrize("HQK,HV", [(2, 2), (2, 4)], ids=["MHA", "GVA"])
@pytest.mark.parametrize("name", list(LENGTHS))
def test_packed_prefill_vs_reference_and_unpacked(name, HQK, HV, h0):
    from cula_sm90.prefill import forward

    lens = _lengths(name)
    x = make_raw(1, sum(lens), HQK, HV, gate="safe", seed=len(lens) + HV)
    state = torch.randn(len(lens), HV, K, K, device="cuda") if h0 else None
    o_p, ht_p = _prefill(x, lens, True, state)
    o_u, ht_u = _prefill(x, lens, False, state)
    assert len(forward.packed_tiles(tuple(lens))) <= sum(-(-L // 64) for L in lens)
    assert torch.equal(o_p, o_u) and torch.equal(ht_p, ht_u), (rel_err(o_p, o_u), rel_err(ht_p, ht_u))
    q, k, v, g, beta, A_log, dt_bias = x
    o_r, ht_r = reference(q, k, v, g, beta, gate_kw=gate_kwargs("safe", A_log, dt_bias), initial_state=state,
                          cu_seqlens=_cu(lens).cuda().long())
    errs = {"o": rel_err(o_p, o_r), "ht": rel_err(ht_p, ht_r)}
    print(f"REL_ERR packed {name} HV={HV} h0={h0} o={errs['o']:.3e} ht={errs['ht']:.3e}")
    assert all(e <= REL_TOL for e in errs.values()), errs


def test_packed_prefill_without_final_state_and_v_first():
    lens = _lengths("short") + [70]
    x = make_raw(1, sum(lens), 2, 4, gate="safe", seed=3)
    o_p, ht_p = _prefill(x, lens, True, final=False)
    o_u, _ = _prefill(x, lens, False, final=False)
    assert ht_p is None and torch.equal(o_p, o_u)
    h0 = torch.randn(len(lens), 4, K, K, device="cuda")
    o_p, ht_p = _prefill(x, lens, True, h0, state_v_first=True)
    o_u, ht_u = _prefill(x, lens, False, h0, state_v_first=True)
    assert torch.equal(o_p, o_u) and torch.equal(ht_p, ht_u)


def test_packed_non_finite_piece_stays_in_its_rows():
    """A sequence with NaN inputs shares a packed tile with another: every other sequence's o and final state equal
    the run without the NaNs, bit for bit (each row block's w, u product sums over its own piece's blocks only)."""
    from cula_sm90.prefill import forward

    lens = [21, 37, 5, 50, 9, 30]  # partial chunks only; the 37-token piece shares its tile with the 5-token one
    assert any(len(tile) > 1 for tile in forward.packed_tiles(tuple(lens)))
    x = make_raw(1, sum(lens), 2, 4, gate="safe", seed=13)
    h0 = torch.randn(len(lens), 4, K, K, device="cuda")
    o, ht = _prefill(x, lens, True, h0)
    cu = _cu(lens).tolist()
    bad = 1
    for t in x[:3]:
        t[:, cu[bad]:cu[bad + 1]] = float("nan")
    o_bad, ht_bad = _prefill(x, lens, True, h0)
    for n in range(len(lens)):
        if n == bad:
            assert not torch.isfinite(o_bad[:, cu[n]:cu[n + 1]]).all()
            continue
        assert torch.equal(o_bad[:, cu[n]:cu[n + 1]], o[:, cu[n]:cu[n + 1]]), n
        assert torch.equal(ht_bad[n], ht[n]), n


def _stage1(x, lens, packed, pad=64):
    """Stage 1 alone, packed or not, into outputs with `pad` sentinel rows past the batch (and sentinel gl rows
    past its chunks): (w, u, qg, kg, Aqk [TT + pad, HV, *], gl [NC + pad, HV, K])."""
    from cula_sm90.prefill import forward

    q, k, v, g, beta, A_log, dt_bias = x
    TT, HQK, HV = q.shape[1], q.shape[2], v.shape[2]
    tables = forward.host_length_tables(tuple(lens), HV, q.device, "off", False, False, None, packed)
    fn = forward.compile_intra("safe", "sigmoid", True, True, True, q.dtype, g.dtype, beta.dtype, "tc", False,
                               packed)
    NC = tables["NC"]
    fill = 7.0  # a value no output takes where it is written: rows left untouched keep it
    w, u, qg, kg = (torch.full((TT + pad, HV, K), fill, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    aqk = torch.full((TT + pad, HV, 64), fill, dtype=torch.bfloat16, device="cuda")
    gl = torch.full((NC + pad, HV, K), fill, dtype=torch.float32, device="cuda")
    table = tables["tiles"] if packed else tables["cu"]
    grid = tables["n_tiles"] if packed else NC
    fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(),
       table.data_ptr(), tables["co"].data_ptr(), w.data_ptr(), u.data_ptr(), qg.data_ptr(), kg.data_ptr(),
       aqk.data_ptr(), aqk.data_ptr(), gl.data_ptr(), TT, len(lens), grid, forward.search_steps(len(lens)), HQK,
       HV // HQK, K ** -0.5, -5.0, forward.launch_stream())
    torch.cuda.synchronize()
    return w, u, qg, kg, aqk, gl


@pytest.mark.parametrize("name", ["short", "empty", "mult16", "mixed", "random64"])
def test_packed_stage1_equals_unpacked_on_every_valid_token(name):
    """w, u, qg, kg, Aqk on every token and gl on every chunk: packed == unpacked bit for bit; nothing written
    past the batch's tokens or chunks."""
    lens = _lengths(name)
    x = make_raw(1, sum(lens), 2, 4, gate="safe", seed=11)
    TT = sum(lens)
    NC = sum(-(-L // 64) for L in lens)
    packed, plain = _stage1(x, lens, True), _stage1(x, lens, False)
    for a, b, n in zip(packed, plain, ("w", "u", "qg", "kg", "aqk", "gl"), strict=True):
        rows = NC if n == "gl" else TT
        assert torch.equal(a[:rows], b[:rows]), (name, n, (a[:rows].float() - b[:rows].float()).abs().max())
        assert a[rows:].eq(7.0).all(), (name, n)  # nothing past the batch


def test_packing_pays_on_the_benchmarks_varlen_shapes():
    """64 random lengths in 4096 tokens: packing removes more than 12.5% of stage 1's CTAs, so the plain call
    (pack_stage1 None) packs; 64 sequences of 64 tokens (full chunks only) do not."""
    from cula_sm90.prefill import forward

    assert forward.packing_pays(tuple(_lengths("random64")))
    assert not forward.packing_pays((64,) * 64)


def test_memcheck_clean_on_packed_tiles():
    """compute-sanitizer memcheck over the packed stage 1 (prefill_packed_memcheck_case.py)."""
    import shutil

    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer not on PATH")
    proc = run_memcheck(HERE / "prefill_packed_memcheck_case.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cases ok" in proc.stdout and "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr
