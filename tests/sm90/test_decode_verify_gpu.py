"""GPU tests of the chunk-form KVBuffer verify (cula_sm90/decode/kvbuffer_verify.py), both product variants
(3xTF32 tensor cores and SIMT), named through the `verify_variant` keyword of the sm90 kernel
(cula_sm90.decode.ops.kda_decode_mtp_kvbuffer) so that they run whatever the dispatch table picks: outputs and the
KVBuffer against the fp64 reference at the recurrent kernel's fp32 tolerance, the pool untouched, padded /
out-of-range requests zero, the flush from their buffer equal to the reference state after m tokens, K = V = 64,
bitwise determinism."""

from __future__ import annotations

import pytest
import torch

import cula_core
from decode_cases import (REL_TOL, backend, kernel_call, live_rows, make_case, reference_kvbuffer, reference_mtp,
                          rel_err, require_sm90)

pytestmark = pytest.mark.gpu

VARIANTS = ["chunk_tc", "chunk_simt"]
TS = [1, 2, 3, 4, 6, 8, 9]  # 9: two m-tiles (16 padded token rows per block)


@pytest.fixture(autouse=True)
def _sm90():
    require_sm90()


def verify(kw, name):
    """(o, KVBuffer) of the verify kernel `name` (configs.VERIFY_VARIANTS) on the case `kw`."""
    return kernel_call("kda_decode_mtp_kvbuffer", kw, verify_variant=name)


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("name", VARIANTS)
def test_chunk_verify_then_flush(name, T):
    for i, (N, G) in enumerate(((3, 1), (64, 2), (257, 4))):
        if T == 9 and N == 257:
            continue
        kw = make_case(N, T, 2, 2 * G, safe=bool((T + i) % 2), out_of_range=N > 3, seed=500 * T + i)
        pool_before = kw["state_pool"].clone()
        o_ref, buf_ref = reference_kvbuffer(kw)
        _, st_ref = reference_mtp(kw)
        o, buf = verify(kw, name)
        assert rel_err(o, o_ref) < REL_TOL, (N, rel_err(o, o_ref))
        assert rel_err(buf, buf_ref) < REL_TOL, (N, rel_err(buf, buf_ref))
        live = torch.zeros(N, dtype=torch.bool, device="cuda")
        live[live_rows(kw)] = True
        assert (o[~live] == 0).all() and (buf[~live] == 0).all(), "a skipped request must get zeros"
        assert torch.equal(kw["state_pool"], pool_before), "verify must not write the pool"
        m = torch.arange(N, device="cuda", dtype=torch.int32) % (T + 1)
        with backend():
            cula_core.kda_flush_kvbuffer(kw["state_pool"], kw["cache_idx"], buf, m)
        rows = live_rows(kw)
        acc = rows[m[rows] > 0]
        assert rel_err(kw["state_pool"][kw["cache_idx"][acc].long()], st_ref[acc, m[acc].long() - 1]) < REL_TOL


@pytest.mark.parametrize("name", VARIANTS)
def test_chunk_verify_head_dim_64_and_bf16(name):
    """K = V = 64, and bf16 inputs."""
    kw = make_case(7, 3, 2, 4, K=64, V=64, out_of_range=True, seed=901)
    o_ref, buf_ref = reference_kvbuffer(kw)
    o, buf = verify(kw, name)
    assert rel_err(o, o_ref) < REL_TOL and rel_err(buf, buf_ref) < REL_TOL
    kw = make_case(9, 4, 2, 4, dtype=torch.bfloat16, seed=902)
    o_ref, buf_ref = reference_kvbuffer(kw)
    o, buf = verify(kw, name)
    assert rel_err(o, o_ref) < 8e-3 and rel_err(buf, buf_ref) < REL_TOL


@pytest.mark.parametrize("name", VARIANTS)
def test_chunk_verify_deterministic_and_close_to_recurrent(name):
    kw = make_case(64, 6, 2, 4, seed=903)
    o_rec, buf_rec = verify(kw, "recurrent")
    a = verify(kw, name)
    b = verify(kw, name)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert rel_err(a[0], o_rec) < REL_TOL and rel_err(a[1], buf_rec) < REL_TOL


def test_capture_at_a_size_the_dispatch_serves_differently():
    """Warm-up at N = 1 (4 heads: the recurrent verify, tiling 32x4x4), capture at N = 300 (1200 heads: the chunk
    verify, tiling 32x2x2 for the recurrent step) with no call at that size before: the family's first call
    prepared every kernel the dispatch can pick, so the capture only launches. Replay = eager calls, bitwise."""
    from cula_sm90.decode import configs

    T = 3
    small = make_case(1, T, 2, 4, padded=False, seed=910)
    kw = make_case(300, T, 2, 4, seed=911)
    assert configs.verify_variant(1, T, 4) != configs.verify_variant(300, T, 4)
    assert configs.recurrent_tiling(1, T, 4) != configs.recurrent_tiling(300, T, 4)
    with backend():
        cula_core.kda_decode_mtp(**small)
        cula_core.kda_decode_mtp_kvbuffer(**small)
        torch.cuda.synchronize()
        pool0 = kw["state_pool"].clone()
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            o_g, buf_g = cula_core.kda_decode_mtp_kvbuffer(**kw)
            o2_g, _ = cula_core.kda_decode_mtp(**kw)
        torch.cuda.current_stream().wait_stream(s)
        kw["state_pool"].copy_(pool0)
        graph.replay()
        torch.cuda.synchronize()
        got = (o_g.clone(), buf_g.clone(), o2_g.clone(), kw["state_pool"].clone())
        eager = dict(kw, state_pool=pool0.clone())
        o_e, buf_e = cula_core.kda_decode_mtp_kvbuffer(**eager)
        o2_e, _ = cula_core.kda_decode_mtp(**eager)
    for a, b in zip(got, (o_e, buf_e, o2_e, eager["state_pool"]), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("T", [5, 7, 10, 12, 16])
def test_chunk_every_padding(name, T):
    """The token counts the shared tests skip (MP = 8 with 3 and 1 padded rows, MP = 16 with 6, 4 and none):
    against the fp64 reference, bitwise equal to itself run twice, padded / out-of-range requests zero, the pool
    untouched."""
    kw = make_case(6, T, 2, 4, safe=bool(T % 2), out_of_range=True, seed=950 + T)
    pool_before = kw["state_pool"].clone()
    o_ref, buf_ref = reference_kvbuffer(kw)
    a = verify(kw, name)
    b = verify(kw, name)
    assert rel_err(a[0], o_ref) < REL_TOL and rel_err(a[1], buf_ref) < REL_TOL, (rel_err(a[0], o_ref),
                                                                                   rel_err(a[1], buf_ref))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    live = torch.zeros(6, dtype=torch.bool, device="cuda")
    live[live_rows(kw)] = True
    assert (a[0][~live] == 0).all() and (a[1][~live] == 0).all()
    assert torch.equal(kw["state_pool"], pool_before)
