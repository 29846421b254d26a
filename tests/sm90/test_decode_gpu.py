"""GPU tests of the sm90 decode kernels through the public ops (CULA_BACKEND=sm90: a test cannot pass on the
reference), against cula_core's reference run in fp64 on the same inputs, and against FLA 0.6.0.

Grid (issue 5): T in {1, 2, 3, 4, 6, 8}; N in {1, 3, 64, 257}; GVA 1/2/4; softplus and safe gates; padded slots
(cache_idx = -1) and an out-of-range slot (= P) skipped; pools bitwise untouched where they must be;
determinism; CUDA-graph capture and replay without a warm-up call at the captured size."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cula_core
from decode_cases import (REL_TOL, REL_TOL_BF16_OUT, backend, kernel_call, live_rows, make_case,
                          reference_kvbuffer, reference_mtp, rel_err, require_sm90, serving_pool)

pytestmark = pytest.mark.gpu

TS = [1, 2, 3, 4, 6, 8]
NS = [1, 3, 64, 257]
GVA = [1, 2, 4]
HQK = 2
HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _sm90():
    require_sm90()


def _check_skipped_rows_zero(kw, *tensors):
    live = torch.zeros(kw["cache_idx"].shape[0], dtype=torch.bool, device=kw["cache_idx"].device)
    live[live_rows(kw)] = True
    for t in tensors:
        assert (t[~live] == 0).all(), "a padded / out-of-range request must get zeros"


@pytest.mark.parametrize("T", TS)
def test_mtp_per_token_states(T):
    """Per-token states mode (the serving engines' drop-in): outputs and all T states; the pool untouched."""
    for i, (N, G) in enumerate((n, g) for n in NS for g in GVA):
        kw = make_case(N, T, HQK, HQK * G, safe=bool(i % 2), out_of_range=N > 3, seed=100 * T + i)
        pool_before = kw["state_pool"].clone()
        o_ref, st_ref = reference_mtp(kw)
        with backend():
            o, states = cula_core.kda_decode_mtp(**kw, output_per_token_states=True)
        assert rel_err(o, o_ref) < REL_TOL, (N, G, rel_err(o, o_ref))
        assert rel_err(states, st_ref) < REL_TOL, (N, G, rel_err(states, st_ref))
        _check_skipped_rows_zero(kw, o, states)
        assert torch.equal(kw["state_pool"], pool_before), "per-token mode must not write the pool"


@pytest.mark.parametrize("T", TS)
def test_mtp_final_state_into_pool(T):
    """Final-state mode: the live slots hold the state after T tokens; every other slot is bitwise untouched."""
    for i, (N, G) in enumerate((n, g) for n in NS for g in GVA):
        kw = make_case(N, T, HQK, HQK * G, safe=not (i % 2), out_of_range=N > 3, seed=200 * T + i)
        pool_before = kw["state_pool"].clone()
        o_ref, st_ref = reference_mtp(kw)
        with backend():
            o, none = cula_core.kda_decode_mtp(**kw)
        assert none is None
        assert rel_err(o, o_ref) < REL_TOL, (N, G, rel_err(o, o_ref))
        rows = live_rows(kw)
        slots = kw["cache_idx"][rows].long()
        assert rel_err(kw["state_pool"][slots], st_ref[rows, T - 1]) < REL_TOL
        others = torch.ones(pool_before.shape[0], dtype=torch.bool, device=pool_before.device)
        others[slots] = False
        assert torch.equal(kw["state_pool"][others], pool_before[others]), "a slot no live request owns changed"
        _check_skipped_rows_zero(kw, o)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("safe", [False, True])
def test_decode_single_token_half_inputs(dtype, safe):
    """kda_decode (T = 1) with bf16/fp16 q/k/v/g/beta, fp32 pool; the output is stored in the input dtype."""
    kw = make_case(64, 1, 4, 16, dtype=dtype, safe=safe, seed=7)
    o_ref, st_ref = reference_mtp(kw)
    with backend():
        o = cula_core.kda_decode(**kw)
    assert o.dtype == dtype
    assert rel_err(o, o_ref) < REL_TOL_BF16_OUT
    rows = live_rows(kw)
    assert rel_err(kw["state_pool"][kw["cache_idx"][rows].long()], st_ref[rows, 0]) < REL_TOL


@pytest.mark.parametrize(("A_log", "dt_bias", "l2norm"), [(False, False, True), (True, False, False),
                                                          (False, True, False)])
def test_gate_parameters_optional(A_log, dt_bias, l2norm):
    """Safe gate without A_log (rate 1), without dt_bias, and without the in-kernel L2 norm (normalised inputs)."""
    kw = make_case(9, 3, 2, 4, safe=True, A_log=A_log, dt_bias=dt_bias, seed=11)
    if not l2norm:
        kw["use_qk_l2norm_in_kernel"] = False
        kw["q"] = torch.nn.functional.normalize(kw["q"], dim=-1)
        kw["k"] = torch.nn.functional.normalize(kw["k"], dim=-1)
    o_ref, st_ref = reference_mtp(kw)
    with backend():
        o, states = cula_core.kda_decode_mtp(**kw, output_per_token_states=True)
    assert rel_err(o, o_ref) < REL_TOL and rel_err(states, st_ref) < REL_TOL


@pytest.mark.parametrize("T", TS)
def test_kvbuffer_verify_then_flush(T):
    """Verify: outputs and the KVBuffer match the fp64 reference and the pool is untouched. Flush with a
    per-request m in [0, T] (every value present): the pool holds the reference state after m tokens; m = 0,
    padded and out-of-range requests leave their slots bitwise as they were."""
    for i, (N, G) in enumerate(((3, 1), (64, 2), (257, 4))):
        kw = make_case(N, T, HQK, HQK * G, safe=bool((T + i) % 2), out_of_range=N > 3, seed=300 * T + i)
        pool_before = kw["state_pool"].clone()
        o_ref, buf_ref = reference_kvbuffer(kw)
        _, st_ref = reference_mtp(kw)
        with backend():
            o, buf = cula_core.kda_decode_mtp_kvbuffer(**kw)
        assert rel_err(o, o_ref) < REL_TOL
        assert rel_err(buf, buf_ref) < REL_TOL, rel_err(buf, buf_ref)
        _check_skipped_rows_zero(kw, o, buf)
        assert torch.equal(kw["state_pool"], pool_before), "verify must not write the pool"

        m = torch.arange(N, device="cuda", dtype=torch.int32) % (T + 1)
        with backend():
            cula_core.kda_flush_kvbuffer(kw["state_pool"], kw["cache_idx"], buf, m)
        rows = live_rows(kw)
        acc = rows[m[rows] > 0]
        slots = kw["cache_idx"][acc].long()
        assert rel_err(kw["state_pool"][slots], st_ref[acc, m[acc].long() - 1]) < REL_TOL
        untouched = torch.ones(pool_before.shape[0], dtype=torch.bool, device="cuda")
        untouched[slots] = False
        assert torch.equal(kw["state_pool"][untouched], pool_before[untouched])


def test_flush_broadcast_int_and_all_layers():
    """An int accept length broadcasts; the all-layers flush (one launch) equals per-layer flushes bitwise."""
    T, N, L = 4, 37, 3
    cases = [make_case(N, T, 2, 4, seed=400 + layer, out_of_range=True) for layer in range(L)]
    bufs = []
    with backend():
        for kw in cases:
            bufs.append(cula_core.kda_decode_mtp_kvbuffer(**kw)[1])
    for accept in (3, torch.randint(0, T + 1, (N,), dtype=torch.int32, device="cuda")):
        per_layer = [kw["state_pool"].clone() for kw in cases]
        together = [kw["state_pool"].clone() for kw in cases]
        idx = cases[0]["cache_idx"]
        with backend():
            for pool, buf in zip(per_layer, bufs, strict=True):
                cula_core.kda_flush_kvbuffer(pool, idx, buf, accept)
            cula_core.kda_flush_kvbuffer_all_layers(together, idx, bufs, accept)
        for a, b in zip(per_layer, together, strict=True):
            assert torch.equal(a, b)
    # int 3 against the reference state after 3 tokens (layer 0, its own cache_idx = idx)
    kw = cases[0]
    _, st_ref = reference_mtp(kw)
    pool = kw["state_pool"].clone()
    with backend():
        cula_core.kda_flush_kvbuffer(pool, kw["cache_idx"], bufs[0], 3)
    rows = live_rows(kw)
    assert rel_err(pool[kw["cache_idx"][rows].long()], st_ref[rows, 2]) < REL_TOL


def test_every_tiling_of_the_recurrent_kernel():
    """Each tiling the dispatch may pick (cula_sm90.decode.configs.TILINGS), named through the kernels' `tiling`
    keyword, in per-token-states and verify modes (the final-state store is the per-token store's pattern), against
    the reference: the dispatch table can change without leaving a tiling untested. The tiling the dispatch picks
    for this batch gives bitwise what the public op gives."""
    from cula_sm90.decode import configs

    kw = make_case(5, 3, 2, 4, out_of_range=True, seed=800)
    o_ref, st_ref = reference_mtp(kw)
    _, buf_ref = reference_kvbuffer(kw)
    with backend():
        public = (*cula_core.kda_decode_mtp(**kw, output_per_token_states=True),
                  *cula_core.kda_decode_mtp_kvbuffer(**kw))
    picked = configs.recurrent_tiling(5, 3, 4)
    assert configs.verify_variant(5, 3, 4) == configs.VERIFY_RECURRENT  # the public verify ran the recurrent kernel
    for tiling in configs.TILINGS:
        o, states = kernel_call("kda_decode_mtp", kw, output_per_token_states=True, tiling=tiling)
        o2, buf = kernel_call("kda_decode_mtp_kvbuffer", kw, tiling=tiling)
        errs = (rel_err(o, o_ref), rel_err(states, st_ref), rel_err(o2, o_ref), rel_err(buf, buf_ref))
        assert max(errs) < REL_TOL, (tiling, errs)
        if tiling == picked:
            assert all(torch.equal(a, b) for a, b in zip((o, states, o2, buf), public, strict=True)), tiling


def test_kernels_at_head_dim_64():
    """K = V = 64 through the kernels directly: every mode and the flush against the reference (the backend
    serves K = V = 64 on the strength of this test, which passed on the H100)."""
    from cula_sm90.decode.ops import KERNELS

    T = 3
    kw = make_case(7, T, 2, 4, K=64, V=64, out_of_range=True, seed=900)
    o_ref, st_ref = reference_mtp(kw)
    _, buf_ref = reference_kvbuffer(kw)
    o, states = kernel_call("kda_decode_mtp", kw, output_per_token_states=True)
    o2, buf = kernel_call("kda_decode_mtp_kvbuffer", kw)
    pool = kw["state_pool"].clone()
    kernel_call("kda_decode_mtp", dict(kw, state_pool=pool), output_per_token_states=False)
    rows = live_rows(kw)
    slots = kw["cache_idx"][rows].long()
    m = torch.arange(7, dtype=torch.int32, device="cuda") % (T + 1)
    flushed = kw["state_pool"].clone()
    KERNELS["kda_flush_kvbuffer"](flushed, kw["cache_idx"], buf, m, 0)
    acc = rows[m[rows] > 0]
    errs = (rel_err(o, o_ref), rel_err(states, st_ref), rel_err(o2, o_ref), rel_err(buf, buf_ref),
            rel_err(pool[slots], st_ref[rows, -1]),
            rel_err(flushed[kw["cache_idx"][acc].long()], st_ref[acc, m[acc].long() - 1]))
    assert max(errs) < REL_TOL, errs


def test_bitwise_deterministic():
    kw = make_case(64, 4, 2, 8, seed=500)
    with backend():
        runs = [cula_core.kda_decode_mtp(**kw, output_per_token_states=True) for _ in range(3)]
        bufs = [cula_core.kda_decode_mtp_kvbuffer(**kw) for _ in range(3)]
    for o, st in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(st, runs[0][1])
    for o, b in bufs[1:]:
        assert torch.equal(o, bufs[0][0]) and torch.equal(b, bufs[0][1])


def test_cuda_graph_capture_and_replay():
    """Warm-up (compilation) at N = 2 only; capture verify + flush and a recurrent step at N = 5; replay with new
    inputs copied into the captured buffers: the same results as eager calls."""
    T = 3
    with backend():
        small = make_case(2, T, 2, 4, seed=600)
        cula_core.kda_decode_mtp(**small)
        buf = cula_core.kda_decode_mtp_kvbuffer(**small)[1]
        cula_core.kda_flush_kvbuffer(small["state_pool"], small["cache_idx"], buf,
                                     torch.full((2,), T, dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()

        kw = make_case(5, T, 2, 4, seed=601)
        accept = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32, device="cuda")
        pool0 = kw["state_pool"].clone()
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            o_g, buf_g = cula_core.kda_decode_mtp_kvbuffer(**kw)
            cula_core.kda_flush_kvbuffer(kw["state_pool"], kw["cache_idx"], buf_g, accept)
            o2_g, _ = cula_core.kda_decode_mtp(**kw)
        torch.cuda.current_stream().wait_stream(s)

        new = make_case(5, T, 2, 4, seed=602)
        for name in ("q", "k", "v", "g", "beta"):
            kw[name].copy_(new[name])
        kw["state_pool"].copy_(pool0)
        graph.replay()
        torch.cuda.synchronize()
        got = (o_g.clone(), buf_g.clone(), o2_g.clone(), kw["state_pool"].clone())

        eager = dict(kw, state_pool=pool0.clone())
        o_e, buf_e = cula_core.kda_decode_mtp_kvbuffer(**eager)
        cula_core.kda_flush_kvbuffer(eager["state_pool"], eager["cache_idx"], buf_e, accept)
        o2_e, _ = cula_core.kda_decode_mtp(**eager)
    for a, b in zip(got, (o_e, buf_e, o2_e, eager["state_pool"]), strict=True):
        assert torch.equal(a, b)


def test_matches_fla_fused_recurrent():
    """The same bf16 inputs through FLA 0.6.0's fused_recurrent_kda_fwd (per-token states written through
    ssm_state_indices [N, T], gate and L2 norm in kernel) and through kda_decode_mtp: outputs and states agree
    to bf16 output rounding / fp32 rounding."""
    fla = pytest.importorskip("fla.ops.kda.fused_recurrent")
    N, T, H = 6, 4, 4
    kw = make_case(N, T, H, H, dtype=torch.bfloat16, padded=False, extra_slots=0, seed=700)
    P = kw["state_pool"].shape[0]
    # FLA reads the initial state from slot indices[n, 0] and writes token t's state to indices[n, t]
    fla_pool = torch.zeros(P + N * T, *kw["state_pool"].shape[1:], device="cuda")
    fla_pool[kw["cache_idx"].long()] = kw["state_pool"][kw["cache_idx"].long()]
    scratch = P + torch.arange(N * T, device="cuda", dtype=torch.int32).view(N, T)
    scratch[:, 0] = kw["cache_idx"]
    with torch.no_grad():
        o_fla, _ = fla.fused_recurrent_kda_fwd(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], A_log=kw["A_log"],
                                           dt_bias=kw["dt_bias"], initial_state=fla_pool, inplace_final_state=True,
                                           ssm_state_indices=scratch, use_qk_l2norm_in_kernel=True,
                                           use_gate_in_kernel=True)
    with backend():
        o, states = cula_core.kda_decode_mtp(**kw, output_per_token_states=True)
    assert rel_err(o, o_fla) < REL_TOL_BF16_OUT
    assert rel_err(states, fla_pool[scratch.long()]) < 1e-4


# A bf16 pool stores the fp32 state rounded once per call: kernel and reference round the same fp32 value up to fp32
# rounding, so stored states agree to one bf16 ulp (2^-8 relative) at most, and outputs (fp32 math from the same
# bf16 state) to REL_TOL.
REL_TOL_BF16_STATE = 2.0 ** -8


@pytest.mark.parametrize("T", [1, 3, 9])
@pytest.mark.parametrize(("dtype", "v_first", "null"), [(torch.bfloat16, False, False), (torch.float32, True, False),
                                                         (torch.bfloat16, True, True), (torch.float32, False, True)])
def test_serving_pools(T, dtype, v_first, null):
    """bf16 and V-first pools and a null slot, every mode and the flush, against the reference on the same pool
    (fp32 math, the pool's dtype and layout): final state, per-token states, verify + flush."""
    state_tol = REL_TOL_BF16_STATE if dtype == torch.bfloat16 else REL_TOL
    for i, N in enumerate((3, 64)):
        kw = make_case(N, T, HQK, 2 * HQK, safe=bool(i), extra_slots=2, seed=500 + 10 * T + i)
        free = sorted(set(range(kw["state_pool"].shape[0])) - set(kw["cache_idx"].tolist()))[0]
        kw = serving_pool(kw, dtype, v_first, null_slot=free if null else None)
        pool_kw = {name: kw[name] for name in ("state_v_first", "null_slot") if name in kw}
        runs = {}
        for name in ("reference", "sm90"):
            case = dict(kw, state_pool=kw["state_pool"].clone())
            with backend(name):
                o_s, states = cula_core.kda_decode_mtp(**case, output_per_token_states=True)
                o_f, _ = cula_core.kda_decode_mtp(**case)
                final = case["state_pool"].clone()
                case["state_pool"] = kw["state_pool"].clone()
                o_v, buf = cula_core.kda_decode_mtp_kvbuffer(**case)
                m = torch.arange(N, dtype=torch.int32, device="cuda") % (T + 1)
                cula_core.kda_flush_kvbuffer(case["state_pool"], case["cache_idx"], buf, m, **pool_kw)
            runs[name] = (o_s, states, o_f, final, o_v, buf, case["state_pool"])
        ref, ours = runs["reference"], runs["sm90"]
        assert ours[1].dtype == dtype and ours[3].dtype == dtype and ours[6].dtype == dtype
        for j, what in enumerate(("o (states)", "states", "o (final)", "final pool", "o (verify)", "kvbuffer",
                                  "flushed pool")):
            tol = state_tol if what in ("states", "final pool", "flushed pool") else REL_TOL
            assert rel_err(ours[j], ref[j]) < tol, (N, what, rel_err(ours[j], ref[j]))
        if null:  # the null slot is never written
            assert torch.equal(ours[3][kw["null_slot"]], kw["state_pool"][kw["null_slot"]])
            assert torch.equal(ours[6][kw["null_slot"]], kw["state_pool"][kw["null_slot"]])


@pytest.mark.parametrize(("dtype", "v_first", "null"), [(torch.bfloat16, False, True), (torch.float32, False, False),
                                                         (torch.bfloat16, True, False), (torch.float32, True, True)])
def test_streamed_decode(dtype, v_first, null):
    """Single-token decode at a batch the streamed kernel serves (N * HV >= configs.stream_min_heads: many work
    items per persistent CTA), every pool form, padded, out-of-range and null slots: outputs and the pool against
    the reference on the same pool and against the recurrent kernel (named through `tiling`); slots no live
    request owns (the null slot included) bitwise untouched; padded requests get zeros."""
    from cula_sm90.decode import configs

    HV = 2 * HQK
    N = max(300, -(-configs.stream_min_heads(dtype.itemsize, v_first) // HV))
    assert configs.streams(configs.MODE_FINAL, 1, N, HV, v_first, dtype.itemsize)
    state_tol = REL_TOL_BF16_STATE if dtype == torch.bfloat16 else REL_TOL
    # an out-of-range slot only where serving_pool points it at the null slot (the reference op refuses one;
    # test_mtp_final_state_into_pool and the memcheck case give the streamed kernel out-of-range slots as they are)
    kw = make_case(N, 1, HQK, HV, safe=null, out_of_range=null, extra_slots=2, seed=900 + int(v_first))
    free = sorted(set(range(kw["state_pool"].shape[0])) - set(kw["cache_idx"].tolist()))[0]
    kw = serving_pool(kw, dtype, v_first, null_slot=free if null else None)
    pool_before = kw["state_pool"].clone()
    runs = {}
    for name in ("reference", "sm90", "recurrent"):
        case = dict(kw, state_pool=pool_before.clone())
        if name == "recurrent":
            o, _ = kernel_call("kda_decode_mtp", case, output_per_token_states=False, tiling=(64, 4, 4, 0))
        else:
            with backend(name):
                o, _ = cula_core.kda_decode_mtp(**case)
        runs[name] = (o, case["state_pool"])
    (o_ref, pool_ref), (o, pool), (o_rec, pool_rec) = runs["reference"], runs["sm90"], runs["recurrent"]
    assert rel_err(o, o_ref) < REL_TOL and rel_err(o, o_rec) < REL_TOL, (rel_err(o, o_ref), rel_err(o, o_rec))
    assert rel_err(pool, pool_ref) < state_tol and rel_err(pool, pool_rec) < state_tol
    rows = live_rows(kw)
    if null:
        rows = rows[kw["cache_idx"][rows] != kw["null_slot"]]
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    others[kw["cache_idx"][rows].long()] = False
    assert torch.equal(pool[others], pool_before[others]), "a slot no live request owns changed"
    dead = torch.ones(N, dtype=torch.bool, device=o.device)
    dead[rows] = False
    assert (o[dead] == 0).all(), "a padded / out-of-range / null-slot request must get zeros"


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
def test_memcheck_clean_on_odd_batches():
    # exact allocations (overruns are visible); the arch named, so the DSL does not probe the driver for it
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", CUTE_DSL_ARCH="sm_90a")
    # --report-api-errors no: the CuTe DSL runtime probes driver entry points that this driver lacks
    # (cuGetProcAddress_v2 answers CUDA_ERROR_INVALID_VALUE, 34 times): API results, not memory accesses
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "9",
           "--leak-check", "no",
           sys.executable, str(HERE / "decode_memcheck_case.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=HERE)
    out = proc.stdout + proc.stderr
    hits = sorted({line.strip() for line in out.splitlines() if "Program hit" in line or "Invalid" in line})
    print("\n".join(hits[:20]))
    assert proc.returncode == 0 and "ERROR SUMMARY: 0 errors" in out, out[-6000:]
    assert "cases ok" in out
