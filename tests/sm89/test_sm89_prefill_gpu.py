"""GPU tests of the cula-sm89 kernels against cula_core.reference in fp64: every (K, V, C), the odd and even
lengths, batch x heads up to 64, GVA, varlen, with and without an initial state, a 64k-token strong-decay run,
the public ops routed here by dispatch, CUDA-graph capture, and compute-sanitizer's memcheck.

The bound is REL_TOL = 1e-4 on ||ours - ref|| / ||ref|| for o, w, u, the final state (and the debug score
matrices Aqk, Akk): the kernels' 3xTF32 products are fp32-accurate, so there is no tf32 allowance to make."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sm89_cases import CONFIGS, REL_TOL, chunk_rows, has_tool, make_inputs, reference, rel_err, require_gpu

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _gpu():
    require_gpu()


def prefill(*args, **kw):
    from cula_sm89.ops import prefill as run

    return run(*args, **kw)


# T -> (B, HQK, HV): B x HV <= 64, GVA at T = 1000
SIZES = {1: (4, 16, 16), 63: (2, 32, 32), 64: (4, 16, 16), 65: (2, 32, 32), 1000: (2, 4, 8), 4096: (1, 4, 4)}


@pytest.mark.parametrize("with_h0", [False, True], ids=["no-h0", "h0"])
@pytest.mark.parametrize("T", list(SIZES))
@pytest.mark.parametrize(("K", "C"), CONFIGS, ids=[f"K{k}-C{c}" for k, c in CONFIGS])
def test_matches_reference(K, C, T, with_h0):
    B, HQK, HV = SIZES[T]
    q, k, v, g, beta = make_inputs(B, T, HQK, HV, K, seed=1000 * K + T + C)
    h0 = torch.randn(B, HV, K, K, device="cuda") if with_h0 else None
    out = torch.full((B, T, HV, K), float("nan"), device="cuda")  # every element must be written
    o, ht, x = prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C, out=out,
                       return_intermediates=True, debug_scores=True)
    assert o.data_ptr() == out.data_ptr() and x["chunk_size"] == C
    o_r, ht_r, inter = reference(q, k, v, g, beta, initial_state=h0, chunk_size=C, intermediates=True)
    errs = {
        "o": rel_err(o, o_r),
        "final_state": rel_err(ht, ht_r),
        "w": rel_err(chunk_rows(x["w"], T), inter.w),
        "u": rel_err(chunk_rows(x["u"], T), inter.u),
        "Aqk": rel_err(chunk_rows(x["aqk"], T), inter.Aqk),
        "Akk": rel_err(chunk_rows(x["akk"], T), inter.Akk),
    }
    assert all(e <= REL_TOL for e in errs.values()), errs
    # the padded rows of the last chunk are zero (identity transitions), not left unwritten
    pad = x["w"].shape[2] * C - T
    if pad:
        assert torch.count_nonzero(x["w"][:, :, -1, C - pad:]) == 0
        assert torch.count_nonzero(x["u"][:, :, -1, C - pad:]) == 0


@pytest.mark.parametrize("tile", [16, 32])
@pytest.mark.parametrize(("K", "C"), CONFIGS, ids=[f"K{k}-C{c}" for k, c in CONFIGS])
def test_both_state_tiles_match_reference(K, C, tile):
    """The inter-chunk kernel's two variants (16 state columns x 4 warps, 32 x 8), forced."""
    B, T, HQK, HV = 2, 1000, 2, 4
    q, k, v, g, beta = make_inputs(B, T, HQK, HV, K, seed=tile + K + C)
    h0 = torch.randn(B, HV, K, K, device="cuda")
    o, ht = prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C, state_tile=tile)
    o_r, ht_r = reference(q, k, v, g, beta, initial_state=h0, chunk_size=C)
    assert rel_err(o, o_r) <= REL_TOL and rel_err(ht, ht_r) <= REL_TOL, (rel_err(o, o_r), rel_err(ht, ht_r))


@pytest.mark.parametrize(("K", "C"), CONFIGS, ids=[f"K{k}-C{c}" for k, c in CONFIGS])
def test_varlen_matches_reference(K, C):
    lengths = [1, 0, 63, 64, 65, 200, 0, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T, HQK, HV = int(cu[-1]), 2, 4
    q, k, v, g, beta = make_inputs(1, T, HQK, HV, K, seed=K + C)
    h0 = torch.randn(len(lengths), HV, K, K, device="cuda")
    out = torch.full((1, T, HV, K), float("nan"), device="cuda")
    o, ht = prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=C, out=out)
    o_r, ht_r = reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu.cpu(), chunk_size=C)
    assert rel_err(o, o_r) <= REL_TOL and rel_err(ht, ht_r) <= REL_TOL, (rel_err(o, o_r), rel_err(ht, ht_r))
    # an empty sequence passes its initial state through
    assert torch.equal(ht[1], h0[1]) and torch.equal(ht[6], h0[6])


@pytest.mark.parametrize(("decay", "K"), [("safe", 128), ("extreme", 64)])
def test_long_sequence_strong_decay(decay, K):
    """T = 65536: cumulative decays reach exp(-1e5) and beyond; only exp of differences within a chunk is ever
    formed, so everything stays finite ("extreme" also takes the pairwise diagonal path of every block)."""
    T, HV = 65536, 2
    q, k, v, g, beta = make_inputs(1, T, 1, HV, K, seed=7, decay=decay)
    h0 = torch.randn(1, HV, K, K, device="cuda")
    o, ht = prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    o_r, ht_r = reference(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o, o_r) <= REL_TOL and rel_err(ht, ht_r) <= REL_TOL, (rel_err(o, o_r), rel_err(ht, ht_r))


def test_strided_inputs():
    """Views with FLA's layout but padded strides (q, k, v sliced out of one fused projection): the kernels take
    the strides as they are (16-byte aligned rows need no copy)."""
    B, T, H, K = 2, 300, 4, 64
    fused = torch.randn(B, T, 3 * H, K + 4, device="cuda")[..., :K]  # padded rows: stride(2) = K + 4
    q, k, v = (torch.nn.functional.normalize(fused[:, :, i * H:(i + 1) * H], dim=-1) if i < 2
               else fused[:, :, i * H:(i + 1) * H] for i in range(3))
    _, _, _, g, beta = make_inputs(B, T, H, H, K, seed=3)
    o, _ = prefill(q, k, v, g, beta)
    o_r, _ = reference(q, k, v, g, beta)
    assert rel_err(o, o_r) <= REL_TOL


def test_default_chunk_and_scale():
    q, k, v, g, beta = make_inputs(1, 100, 2, 2, 128, seed=5)
    o, ht, x = prefill(q, k, v, g, beta, scale=0.3, return_intermediates=True)
    assert ht is None and x["chunk_size"] in (32, 64)
    o_r, _ = reference(q, k, v, g, beta, scale=0.3)
    assert rel_err(o, o_r) <= REL_TOL


def test_rejects_unserved_configurations():
    q, k, v, g, beta = make_inputs(1, 16, 1, 1, 64)
    with pytest.raises(ValueError, match="chunk_size must be 0, 32 or 64"):
        prefill(q, k, v, g, beta, chunk_size=16)
    q2, k2, v2, g2, beta2 = make_inputs(1, 16, 1, 1, 32)
    with pytest.raises(ValueError, match=r"K == V in \(64, 128\)"):
        prefill(q2, k2, v2, g2, beta2)


def test_cuda_graph_capture_and_replay():
    q, k, v, g, beta = make_inputs(2, 500, 2, 4, 128, seed=11)
    h0 = torch.randn(2, 4, 128, 128, device="cuda")
    prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # warm-up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        o, ht = prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.cuda.current_stream().wait_stream(stream)
    q.copy_(make_inputs(2, 500, 2, 4, 128, seed=12)[0])  # new inputs, same buffers
    graph.replay()
    torch.cuda.synchronize()
    o_r, ht_r = reference(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o, o_r) <= REL_TOL and rel_err(ht, ht_r) <= REL_TOL


def test_public_ops_route_to_sm89_and_match(monkeypatch):
    import cula_core
    from cula_core import dispatch
    from cula_core import reference_backend
    from cula_core.backend import CallConfig, DeviceInfo

    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setenv("CULA_STRICT", "1")  # a fallback would raise
    B, T, HQK, HV, K = 2, 777, 2, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, HQK, K, device="cuda", generator=gen) for _ in range(2))
    v = torch.randn(B, T, HV, K, device="cuda", generator=gen)
    g_raw = torch.randn(B, T, HV, K, device="cuda", generator=gen)
    beta_raw = torch.randn(B, T, HV, device="cuda", generator=gen)
    A_log = torch.randn(HV, device="cuda", generator=gen) * 0.5
    dt_bias = torch.randn(HV * K, device="cuda", generator=gen)
    h0 = torch.randn(B, HV, K, K, device="cuda", generator=gen)

    call = CallConfig(op="kda_prefill", device=DeviceInfo.of(q.device), dtype=torch.float32, K=K, V=K, HQK=HQK,
                      HV=HV, T=T, gate="softplus")
    assert dispatch.choose(call).backend.name == "sm89"

    for kwargs in (dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias),
                   dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, safe_gate=True, lower_bound=-5.0),
                   dict(use_gate_in_kernel=False)):
        g = g_raw if kwargs["use_gate_in_kernel"] else torch.nn.functional.logsigmoid(g_raw) / 4
        o, ht = cula_core.kda_prefill(q, k, v, g, beta_raw, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **kwargs)
        gate = ("safe" if "lower_bound" in kwargs else "softplus") if kwargs["use_gate_in_kernel"] else "precomputed"
        d = torch.float64
        o_r, ht_r = reference_backend.kda_prefill(
            q.to(d), k.to(d), v.to(d), g.to(d), beta_raw.to(d), A_log if gate != "precomputed" else None,
            dt_bias if gate != "precomputed" else None, h0.to(d), None, None, scale=K ** -0.5, output_final_state=True,
            use_qk_l2norm_in_kernel=True, gate=gate, lower_bound=kwargs.get("lower_bound"), beta_activation="sigmoid",
            intracard_cp="auto")
        assert o.dtype == torch.float32 and ht.dtype == torch.float32
        assert rel_err(o, o_r) <= REL_TOL and rel_err(ht, ht_r) <= REL_TOL, (gate, rel_err(o, o_r), rel_err(ht, ht_r))

    # chunk_kda: served without autograd, declined (reference) with it
    with torch.no_grad():
        o2, _ = cula_core.chunk_kda(q, k, v, torch.nn.functional.logsigmoid(g_raw) / 4, beta_raw,
                                    use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    grad_call = CallConfig(op="chunk_kda", device=DeviceInfo.of(q.device), dtype=torch.float32, K=K, V=K, HQK=HQK,
                           HV=HV, T=T, gate="precomputed", requires_grad=True)
    assert dispatch.choose(grad_call).backend.name != "sm89"
    assert torch.isfinite(o2).all()


def test_varlen_through_the_public_op(monkeypatch):
    import cula_core

    monkeypatch.setenv("CULA_BACKEND", "sm89")
    cu = torch.tensor([0, 100, 100, 357], dtype=torch.int32, device="cuda")
    q, k, v, g, beta = make_inputs(1, 357, 1, 2, 64, seed=9)
    o, ht = cula_core.kda_prefill(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), output_final_state=True)
    o_r, ht_r = reference(q, k, v, g, beta, cu_seqlens=cu.cpu())
    assert rel_err(o, o_r) <= REL_TOL and rel_err(ht, ht_r) <= REL_TOL


def test_c_abi_matches_the_binding():
    sys.path.insert(0, str(HERE.parents[1] / "packages" / "cula-sm89" / "examples"))
    try:
        import capi_ctypes
    finally:
        sys.path.pop(0)
    cu = torch.tensor([0, 70, 70, 300], dtype=torch.int32, device="cuda")
    q, k, v, g, beta = make_inputs(1, 300, 2, 4, 128, seed=21)
    h0 = torch.randn(3, 4, 128, 128, device="cuda")
    for chunk in (32, 64):
        for cu_seqlens in (None, cu):
            state = h0[:1] if cu_seqlens is None else h0
            o_c, ht_c = capi_ctypes.prefill_via_c_abi(q, k, v, g, beta, scale=0.1, initial_state=state,
                                                      cu_seqlens=cu_seqlens, chunk_size=chunk)
            o_p, ht_p = prefill(q, k, v, g, beta, scale=0.1, initial_state=state, output_final_state=True,
                                cu_seqlens=cu_seqlens, chunk_size=chunk)
            torch.cuda.synchronize()
            assert torch.equal(o_c, o_p) and torch.equal(ht_c, ht_p)
    lib = capi_ctypes.load()
    assert lib.kda_prefill_f32_abi_version() == 1


@pytest.mark.skipif(not has_tool("compute-sanitizer"), reason="compute-sanitizer not on PATH")
def test_memcheck_clean_on_odd_shapes():
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")  # exact allocations: overruns are visible
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", "--leak-check", "no",
           sys.executable, str(HERE / "sm89_memcheck_case.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ERROR SUMMARY: 0 errors" in out, out[-6000:]
    assert "cases ok" in out
