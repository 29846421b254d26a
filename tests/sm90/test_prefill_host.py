"""CPU tests of the host side of the cula-sm90 prefill (cula_sm90/prefill/forward.py) with the two kernels replaced
by torch emulations of their contracts: the varlen tables, the CP plan's segments, the affine-map pass's rows,
the scan over pieces and the hand-over of initial and final states, on any machine.

Stage 1's emulation takes its numbers from cula_core.reference (ChunkIntermediates); stage 2's walks the segment
table as the kernel does (normal or affine mode), in fp64. So these tests check the bookkeeping around the
kernels (which chunk, which state row, which piece starts where), not the kernels: those are the GPU tests'.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
import torch.nn.functional as F

from cula_core import reference_backend as R
from cula_core.reference import chunk_kda_reference

BT, K = 64, 128
bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32


def _at(address: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """The host memory a kernel argument points at, as a tensor (the kernels take addresses; on the CPU an
    emulator reads and writes through them)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype).view(shape)


def _pieces_of_tile_table(address: int, tiles: int) -> list[tuple[int, int, int]]:
    """(chunk, first token, valid rows) of every piece of a packed stage 1's tile table ([tiles, 4, 5] int32:
    per block first token, valid rows, chunk, first and last block of its piece), checking its structure: a
    piece's blocks are contiguous in its tile, consecutive in tokens, full but for the last."""
    table = _at(address, i32, tiles, 4, 5).tolist()
    pieces = []
    for tile in table:
        for m, (tok, nv, chunk, first, last) in enumerate(tile):
            if nv == 0:
                assert (first, last) == (m, m)
                continue
            assert first <= m <= last and tile[first][2] == chunk and tile[last][2] == chunk
            if m == first:
                rows = [tile[b][1] for b in range(first, last + 1)]
                assert all(r == 16 for r in rows[:-1]) and 0 < rows[-1] <= 16
                assert [tile[b][0] for b in range(first, last + 1)] == [tok + 16 * i for i in range(len(rows))]
                pieces.append((chunk, tok, sum(rows)))
    return pieces


def _intra_emulator(gate, beta_activation, l2norm, has_a_log, has_dt_bias, qkv_dtype, g_dtype, beta_dtype, kind,
                    store_akk=False, packed=False):
    assert not store_akk or kind == "tc"  # forward.intra_config's rule
    assert not packed or (kind == "tc" and not store_akk)

    def run(q, k, v, g, beta, a_log, dtb, cu, co, w, u, qg, kg, aqk, akk, gl, TT, N, NC, steps, HQK, G, scale, lb,
            _s):
        if packed:  # the tile table's pieces as stage 1 sees them: each chunk alone (stage 1 is chunk-local)
            pieces = sorted(_pieces_of_tile_table(cu, NC), key=lambda p: p[1])
            starts = [p[1] for p in pieces]
            assert starts == [sum(p[2] for p in pieces[:i]) for i in range(len(pieces))]  # every token once
            assert sum(p[2] for p in pieces) == TT
            chunk_of = [p[0] for p in pieces]
            cu_t = torch.tensor([*starts, TT], dtype=i32)
            return emulate(q, k, v, g, beta, a_log, dtb, cu_t, chunk_of, w, u, qg, kg, aqk, akk, gl, TT,
                           max(chunk_of) + 1, HQK, G, scale, lb)
        return emulate(q, k, v, g, beta, a_log, dtb, _at(cu, i32, N + 1).clone(), None, w, u, qg, kg, aqk, akk, gl,
                       TT, NC, HQK, G, scale, lb)

    def emulate(q, k, v, g, beta, a_log, dtb, cu, chunk_of, w, u, qg, kg, aqk, akk, gl, TT, NC, HQK, G, scale, lb):
        HV = HQK * G
        q, k = (_at(a, qkv_dtype, 1, TT, HQK, K) for a in (q, k))
        v, g, beta = _at(v, qkv_dtype, 1, TT, HV, K), _at(g, g_dtype, 1, TT, HV, K), _at(beta, beta_dtype, 1, TT, HV)
        # an absent A_log / dt_bias comes as some valid address: never read (as in the kernel)
        a_log = _at(a_log, f32, HV) if has_a_log else None
        dtb = _at(dtb, f32, HV * K) if has_dt_bias else None
        w, u, qg, kg = (_at(a, bf16, TT, HV, K) for a in (w, u, qg, kg))
        aqk, gl = _at(aqk, bf16, TT, HV, BT), _at(gl, f32, NC, HV, K)
        flat = [q, k, v, g, beta]
        qp, kp, gp, bp = R.prepare_inputs(flat[0], flat[1], flat[3], flat[4], a_log, dtb, dtype=torch.float64,
                                          use_qk_l2norm_in_kernel=l2norm, gate=gate, lower_bound=lb,
                                          beta_activation=beta_activation)
        _, _, x = chunk_kda_reference(qp, kp, flat[2].double(), gp, bp, scale=scale, cu_seqlens=cu.long(),
                                      return_intermediates=True)
        outputs = [(w, x.w), (u, x.u), (qg, scale * x.qg), (kg, x.kg), (aqk, x.Aqk)]
        if store_akk:  # the address is Aqk's scratch region otherwise: never written
            outputs.append((_at(akk, bf16, TT, HV, BT), x.Akk))
        for dst, src in outputs:
            dst.copy_(src[0].to(dst.dtype))
        ends = cu.long()[1:]
        for c, (n, _), t0 in zip(range(x.chunk_indices.shape[0]), x.chunk_indices.tolist(),
                                 x.chunk_token_start.tolist(), strict=True):
            last = min(t0 + BT, int(ends[n])) - 1
            gl[c if chunk_of is None else chunk_of[n]] = x.g_cumsum[0, last].float()
    return run


def _state_emulator(affine, o_dtype, cols, state_v_first=False):
    def run(w, u, qg, kg, aqk, gl, seg, h0, ht, o, TT, NC, S, HV, NH0, NHT, ctas, _s):
        # the grid: one persistent CTA per SM (the fixture's 132), or one per item where there are fewer
        assert ctas == min(S * HV * ((2 * K if affine else K) // cols), 132), (ctas, S, HV, cols, affine)
        d = torch.float64
        w, u, qg, kg = (_at(a, bf16, TT, HV, K) for a in (w, u, qg, kg))
        aqk, gl, seg = _at(aqk, bf16, TT, HV, BT), _at(gl, f32, NC, HV, K), _at(seg, i32, S, 5)
        # affine mode writes each row's map [HV, K, 2K] where the normal mode writes final states; h0 / ht are
        # some valid address when no segment reads / writes them (as in the kernel): viewed only when used
        h0_at, ht_at = h0, ht
        h0 = lambda: _at(h0_at, f32, NH0, HV, K, K)  # noqa: E731
        ht = lambda: _at(ht_at, f32, NHT, HV, K, 2 * K if affine else K)  # noqa: E731
        o = _at(o, o_dtype, TT, HV, K)  # [B, T, HV, V] as the kernel indexes it
        for s_ in range(S):
            start, end, chunk0, h0_idx, ht_idx = (int(x) for x in seg[s_])
            for hv in range(HV):
                if affine:
                    h = torch.cat([torch.eye(K, dtype=d), torch.zeros(K, K, dtype=d)], 1)
                else:
                    h = h0()[h0_idx, hv].double() if h0_idx >= 0 else torch.zeros(K, K, dtype=d)
                    h = h.T if state_v_first else h  # [V, K] storage
                for ci, t0 in enumerate(range(start, end, BT)):
                    t1 = min(t0 + BT, end)
                    uu = u[t0:t1, hv].double()
                    if affine:
                        uu = torch.cat([torch.zeros_like(uu), uu], 1)
                    vn = uu - w[t0:t1, hv].double() @ h
                    if not affine:
                        A = aqk[t0:t1, hv, : t1 - t0].double()
                        o[t0:t1, hv] = (qg[t0:t1, hv].double() @ h + A @ vn).to(o.dtype)
                    h = torch.exp(gl[chunk0 + ci, hv].double())[:, None] * h + kg[t0:t1, hv].double().T @ vn
                if ht_idx >= 0:
                    ht()[ht_idx, hv] = (h.T if state_v_first else h).float()
    return run


@pytest.fixture
def fwd(monkeypatch):
    from cula_sm90.prefill import forward

    monkeypatch.setattr(forward, "compile_intra", _intra_emulator)
    monkeypatch.setattr(forward, "compile_state", _state_emulator)
    monkeypatch.setattr(forward, "launch_stream", lambda: None)
    monkeypatch.setattr(forward.rt, "sm_count", lambda index: 132)
    forward.planned_device_tables.cache_clear()
    forward.uniform_launch_spec.cache_clear()  # holds the (emulated) kernels
    return forward


def _inputs(lens, HV, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(1, T, HV, K, generator=gen).bfloat16() for _ in range(3))
    g = (F.logsigmoid(torch.randn(1, T, HV, K, generator=gen)) / 800).bfloat16()  # mild: M matters
    beta = torch.rand(1, T, HV, generator=gen).bfloat16()
    h0 = torch.randn(len(lens), HV, K, K, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, h0, cu


def _call(fwd, x, cp, host=True, state_v_first=False):
    q, k, v, g, beta, h0, cu = x
    if state_v_first:
        h0 = h0.transpose(-1, -2).contiguous()
    return fwd.prefill(q, k, v, g, beta, None, None, h0, cu, cu if host else None, scale=K ** -0.5,
                       output_final_state=True, use_qk_l2norm_in_kernel=True, gate="precomputed", lower_bound=None,
                       beta_activation="none", intracard_cp=cp, state_v_first=state_v_first)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# pieces per sequence under "on" at HV = 2: (2,), (1, 1, 1, 2), (4, 1, 1) and (3, 1, 4): the last two make the
# log-depth scan compose maps (steps d = 1, 2), the last across two split sequences with a short one between
@pytest.mark.parametrize("lens", [[3000], [1300, 0, 1, 2600], [5000, 64, 65], [4000, 3, 4500]])
def test_cp_host_path_equals_serial_and_reference(fwd, lens):
    HV = 2
    x = _inputs(lens, HV, seed=len(lens))
    from cula_core import cp_planner

    assert cp_planner.plan(tuple(lens), HV, 132, "on").split
    o_on, ht_on = _call(fwd, x, "on")
    o_off, ht_off = _call(fwd, x, "off")
    o_dev, ht_dev = _call(fwd, x, "auto", host=False)  # device-only tables (no CP)
    assert _rel(ht_on, ht_off) < 1e-6 and _rel(o_on.float(), o_off.float()) < 1e-2
    assert torch.equal(ht_dev, ht_off) and torch.equal(o_dev, o_off)
    q, k, v, g, beta, h0, cu = x
    o_r, ht_r = R.chunk_kda(q.double(), k.double(), v.double(), g.double(), beta.double(), None, None, h0.double(),
                            cu, None, scale=K ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True,
                            gate="precomputed", lower_bound=None, beta_activation="none")
    assert _rel(ht_on, ht_r) < 1e-2 and _rel(o_on.float(), o_r) < 1e-2
    for n, L in enumerate(lens):
        if L == 0:
            assert torch.equal(ht_on[n], h0[n])


@pytest.mark.parametrize("lens", [[3000], [4000, 3, 4500]])
def test_v_first_states_reach_stage_2_as_they_are(fwd, lens):
    """With state_v_first the initial states go to stage 2 in [N, HV, V, K] and the final states come back so,
    with and without CP (the pieces' scanned initial states are stored V-first too): the K-first call's states,
    transposed, to fp32 rounding; o unchanged. A scan that forgot the layout would apply M to a transposed h0."""
    HV = 2
    x = _inputs(lens, HV, seed=7)
    for cp in ("off", "on"):
        o_k, ht_k = _call(fwd, x, cp)
        o_v, ht_v = _call(fwd, x, cp, state_v_first=True)
        assert ht_v.shape == ht_k.shape
        assert _rel(ht_v, ht_k.transpose(-1, -2)) < 1e-6, cp
        assert _rel(o_v.float(), o_k.float()) < 1e-6, cp


def test_cp_mode_and_pieces_come_from_the_arguments_not_the_environment(fwd, monkeypatch):
    """`intracard_cp` and `cp_pieces` decide the split; variables of the environment (the switches earlier versions
    read) change nothing. The affine-map pass runs over one row per piece but the last."""
    monkeypatch.setenv("CULA_SM90_CP", "on")
    monkeypatch.setenv("CULA_SM90_CP_PIECES", "2")
    map_rows = []

    def state(affine, o_dtype, cols, state_v_first=False):
        assert cols == 64  # 2 (sequence, head) pairs: 64-column CTAs (forward.state_cols)
        run = _state_emulator(affine, o_dtype, cols, state_v_first)

        def record(*args):
            if affine:
                map_rows.append(args[12])  # S: rows of the map pass
            return run(*args)
        return record

    monkeypatch.setattr(fwd, "compile_state", state)
    x = _inputs([5000], 2, seed=3)
    q, k, v, g, beta, h0, cu = x
    kw = dict(scale=K ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True, gate="precomputed",
              lower_bound=None, beta_activation="none")
    o_off, ht_off = fwd.prefill(q, k, v, g, beta, None, None, h0, cu, cu, intracard_cp="off", **kw)
    assert map_rows == []
    fwd.prefill(q, k, v, g, beta, None, None, h0, cu, cu, intracard_cp="on", **kw)
    assert map_rows == [3]  # the planner's rule: 4 pieces
    o_3, ht_3 = fwd.prefill(q, k, v, g, beta, None, None, h0, cu, cu, intracard_cp="on", cp_pieces=3, **kw)
    assert map_rows == [3, 2]
    assert _rel(ht_3, ht_off) < 1e-6 and _rel(o_3.float(), o_off.float()) < 1e-2


# ---- the plan's launcher (forward.planned): what it resolves once and what it reads on every call

_FLAGS = dict(scale=K ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True, gate="precomputed",
              lower_bound=None, beta_activation="none")


def _uniform_args(B, T, HV, seed, g_dtype=bf16, h0=True):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, HV, K, generator=gen).bfloat16() for _ in range(3))
    g = (F.logsigmoid(torch.randn(B, T, HV, K, generator=gen)) / 800).to(g_dtype)
    beta = torch.rand(B, T, HV, generator=gen).bfloat16()
    initial_state = torch.randn(B, HV, K, K, generator=gen) if h0 else None
    return (q, k, v, g, beta, None, None, initial_state, None, None)


def _recording_streams(fwd, monkeypatch):
    """Streams handed to each launch, in order; launch_stream answers from `current` (a one-element list)."""
    current, seen = [0], []
    monkeypatch.setattr(fwd, "launch_stream", lambda: current[0])

    def recording(make):
        def compile_(*config):
            run = make(*config)

            def launch(*args):
                seen.append(args[-1])
                return run(*args)
            return launch
        return compile_

    monkeypatch.setattr(fwd, "compile_intra", recording(_intra_emulator))
    monkeypatch.setattr(fwd, "compile_state", recording(_state_emulator))
    return current, seen


@pytest.mark.parametrize("g_dtype", [bf16, torch.float16])
def test_planned_launcher_reads_addresses_and_stream_on_every_call(fwd, monkeypatch, g_dtype):
    """A plan's launcher keeps the Launch but not the call's tensors or stream: calls on new tensors give prefill's
    results for those tensors, each call's two launches take the stream current at that call, every call returns
    new o / final-state tensors (an earlier call's results stay as they were), and a g that stage 1 does not read
    as it is (fp16) is converted on each call."""
    current, seen = _recording_streams(fwd, monkeypatch)
    first = _uniform_args(2, 100, 2, seed=1, g_dtype=g_dtype)
    run = fwd.planned(first, **_FLAGS)
    results = []
    for stream, seed in ((7, 1), (9, 2), (7, 3)):
        current[0] = stream
        args = first if seed == 1 else _uniform_args(2, 100, 2, seed=seed, g_dtype=g_dtype)
        o, final = run(*args)
        o_ref, final_ref = fwd.prefill(*args, **_FLAGS)
        assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
        assert o.data_ptr() != args[2].data_ptr() and final.data_ptr() != args[7].data_ptr()
        results.append((o, final, o_ref.clone(), final_ref.clone()))
    assert seen == [7] * 4 + [9] * 4 + [7] * 4  # per call: the plan's two launches, then prefill's two
    for o, final, o_ref, final_ref in results:
        assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
    assert len({r[0].data_ptr() for r in results}) == 3 and len({r[1].data_ptr() for r in results}) == 3


def test_planned_launcher_keeps_its_tables_alive(fwd):
    """The launch tables the launcher's addresses point at belong to the plan: emptying the caches that made them
    (and collecting) leaves the plan's calls correct."""
    import gc

    args = _uniform_args(3, 70, 2, seed=4)
    run = fwd.planned(args, **_FLAGS)
    fwd.uniform_launch_spec.cache_clear()
    fwd.planned_device_tables.cache_clear()
    fwd.host_tables.cache_clear()
    gc.collect()
    _ = [torch.full((8,), -1, dtype=i32) for _ in range(64)]  # reuse freed host memory, if any was freed
    o, final = run(*args)
    o_ref, final_ref = fwd.prefill(*args, **_FLAGS)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


def test_planned_launcher_copies_misaligned_views(fwd, monkeypatch):
    """Alignment is a property of each call's addresses, not of the signature: the tensor-core stage 1 (the safe
    gate) gets 16-byte aligned q, k, v, g on every call, copies of views that sit at odd offsets."""
    addresses = []

    def intra(*config):
        run = _intra_emulator(*config)

        def launch(*args):
            addresses.append(args[:4])
            return run(*args)
        return launch

    monkeypatch.setattr(fwd, "compile_intra", intra)
    HV = 2
    gen = torch.Generator().manual_seed(5)
    flags = dict(_FLAGS, gate="safe", lower_bound=-5.0)
    A_log, dt_bias = torch.rand(HV, generator=gen), 0.1 * torch.randn(HV * K, generator=gen)
    aligned = list(_uniform_args(1, 64, HV, seed=5))
    aligned[5:7] = A_log, dt_bias
    run = fwd.planned(tuple(aligned), **flags)
    shifted = list(aligned)
    for i in range(4):  # same values, one element past a 16-byte boundary
        t = aligned[i]
        buf = torch.empty(t.numel() + 1, dtype=t.dtype)
        buf[1:] = t.reshape(-1)
        shifted[i] = buf[1:].view(t.shape)
        assert shifted[i].is_contiguous() and shifted[i].data_ptr() % 16
    o_a, final_a = run(*aligned)
    o_s, final_s = run(*shifted)
    assert all(a % 16 == 0 for call in addresses for a in call)
    assert torch.equal(o_a, o_s) and torch.equal(final_a, final_s)


def test_planned_varlen_follows_each_calls_lengths(fwd):
    """With cu_seqlens the tables depend on the lengths (values, not the signature): two calls of one signature
    with different lengths each get prefill's results for their own lengths."""
    q, k, v, g, beta, h0, cu = _inputs([30, 70], 2, seed=6)
    run = fwd.planned((q, k, v, g, beta, None, None, h0, cu, cu), **_FLAGS)
    for lens in ([30, 70], [90, 10], [0, 100]):
        cu = torch.tensor([0, lens[0], 100], dtype=i32)
        o, final = run(q, k, v, g, beta, None, None, h0, cu, cu)
        o_ref, final_ref = fwd.prefill(q, k, v, g, beta, None, None, h0, cu, cu, **_FLAGS)
        assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


def test_backend_planned_kernel_keeps_chunk_kda_without_cp(fwd, monkeypatch):
    """The sm90 backend's planned kernels: kda_prefill's takes the caller's intracard_cp (a long sequence splits
    under "on": an affine-map pass runs), chunk_kda's never splits; both give prefill's results."""
    from cula_sm90.backend import backend

    map_passes = []

    def state(affine, o_dtype, cols, state_v_first=False):
        if affine:
            map_passes.append(cols)
        return _state_emulator(affine, o_dtype, cols, state_v_first)

    monkeypatch.setattr(fwd, "compile_state", state)
    args = _uniform_args(1, 3000, 2, seed=8)
    o_ref, final_ref = fwd.prefill(*args, **_FLAGS, intracard_cp="off")
    map_passes.clear()
    o, final = backend.planned_kernel("chunk_kda", args, **_FLAGS)(*args)
    assert map_passes == []
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
    o, final = backend.planned_kernel("kda_prefill", args, **_FLAGS, intracard_cp="on")(*args)
    assert len(map_passes) == 1
    assert _rel(final, final_ref) < 1e-6 and _rel(o.float(), o_ref.float()) < 1e-2


# ---- chunk_kda's training forward: the residuals Aqk, Akk in tensors of their own

_SAFE = dict(_FLAGS, gate="safe", lower_bound=-5.0)


@pytest.mark.parametrize("cp", ["off", "on"])
@pytest.mark.parametrize("lens", [[100], [0, 65, 1, 3000, 0]])
def test_residuals_are_stage_1s_aqk_and_akk_in_their_own_tensors(fwd, lens, cp):
    """save_residuals: stage 1 (store_akk) writes Akk, Aqk and Akk land in [B, T, HV, 64] bf16 tensors of their own
    (not views of the scratch, which is freed when the call returns), stage 2 reads Aqk from there: o and the final
    state are the call's without residuals, and the residuals are the reference's chunk-64 Aqk / Akk (FLA 0.6.0's,
    rounded to bf16), sequence by sequence, empty and 1-token sequences included."""
    HV = 2
    q, k, v, g, beta, h0, cu = _inputs(lens, HV, seed=11)
    gen = torch.Generator().manual_seed(12)
    A_log, dt_bias = torch.rand(HV, generator=gen), 0.1 * torch.randn(HV * K, generator=gen)
    args = (q, k, v, g.float(), beta, A_log, dt_bias, h0, cu, cu)
    o, ht = fwd.prefill(*args, intracard_cp=cp, **_SAFE)
    o_r, ht_r, (aqk, akk) = fwd.prefill(*args, intracard_cp=cp, save_residuals=True, **_SAFE)
    assert torch.equal(o_r, o) and torch.equal(ht_r, ht)
    T = sum(lens)
    for r in (aqk, akk):
        assert r.shape == (1, T, HV, BT) and r.dtype == bf16 and r.is_contiguous()
        assert r.untyped_storage().nbytes() == r.numel() * 2  # its own allocation
    qp, kp, gp, bp = R.prepare_inputs(q, k, g.float(), beta, A_log, dt_bias, dtype=torch.float64,
                                      use_qk_l2norm_in_kernel=True, gate="safe", lower_bound=-5.0,
                                      beta_activation="none")
    _, _, x = chunk_kda_reference(qp, kp, v.double(), gp, bp, scale=K ** -0.5, cu_seqlens=cu.long(),
                                  return_intermediates=True)
    assert torch.equal(aqk, x.Aqk.to(bf16)) and torch.equal(akk, x.Akk.to(bf16))
    # Akk: unit diagonal, nothing above it, within every chunk of every sequence
    for t in range(0, T, 97):
        start = max(c for c in cu.tolist() if c <= t and (c < T))
        j = (t - start) % BT
        assert akk[0, t, :, j].eq(1).all() and akk[0, t, :, j + 1:].eq(0).all()


def test_residuals_of_an_empty_batch_and_of_the_other_gates(fwd):
    """An empty call returns empty residuals of the promised shape; a call the tensor-core stage 1 does not serve
    (only it writes Akk) is refused before any launch."""
    q, k, v, g, beta, h0, cu = _inputs([0], 2, seed=13)
    o, ht, (aqk, akk) = fwd.prefill(q, k, v, g, beta, None, None, h0, cu, cu, save_residuals=True, **_SAFE)
    assert aqk.shape == akk.shape == (1, 0, 2, BT) and o.shape == v.shape and torch.equal(ht, h0)
    q, k, v, g, beta, h0, cu = _inputs([70], 2, seed=13)
    for gate, lb in (("precomputed", None), ("safe", -6.0)):
        with pytest.raises(ValueError, match="tensor-core stage 1 only"):
            fwd.prefill(q, k, v, g, beta, None, None, h0, cu, cu, save_residuals=True,
                        **dict(_FLAGS, gate=gate, lower_bound=lb))


# ---- the packed stage 1: the host's tiles and dispatch rule, and the packed contract through the emulator


def _random_lengths(seed, n=64, total=4096):
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=gen)[:n - 1].add(1).sort().values.tolist()
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


@pytest.mark.parametrize("lens", [[5, 70, 64, 130, 0, 17, 33], [1] * 9, [64] * 5, [0, 0], [63, 49, 48, 33, 17, 16],
                                  _random_lengths(1), _random_lengths(2, 20, 1000)])
def test_packed_tiles_cover_every_token_once_by_first_fit_decreasing(lens):
    """Every valid token lies in exactly one piece, a piece is one chunk's valid rows in whole 16-row blocks and
    never crosses a tile (4 blocks), full chunks keep a tile each, and the partial pieces follow first-fit
    decreasing: taken largest first (chunk order among equals), each into the first tile with room."""
    from cula_sm90.prefill import forward

    tiles = forward.packed_tiles(tuple(lens))
    chunks = [(c, t0, min(BT, L - s)) for c, (t0, L, s) in enumerate(
        (sum(lens[:n]) + s, L, s) for n, L in enumerate(lens) for s in range(0, L, BT))]
    pieces = [p for tile in tiles for p in tile]
    assert sorted(pieces) == chunks  # each chunk once, with its first token and valid rows
    assert all(sum(-(-n // 16) for _, _, n in tile) <= 4 for tile in tiles)
    full = [t for t in tiles if len(t) == 1 and t[0][2] == BT]
    assert [t[0] for t in full] == [c for c in chunks if c[2] == BT]
    # first-fit decreasing, replayed
    partial = sorted((c for c in chunks if c[2] < BT), key=lambda c: -(-c[2] // 16), reverse=True)
    room, want = [], []
    for c in partial:
        need = -(-c[2] // 16)
        i = next((i for i, r in enumerate(room) if r >= need), None)
        if i is None:
            room.append(4 - need)
            want.append([c])
        else:
            room[i] -= need
            want[i].append(c)
    assert [list(t) for t in tiles[len(full):]] == want
    table = forward.tile_table(tiles)
    assert len(table) == len(tiles) and all(len(t) == 4 and all(len(b) == 5 for b in t) for t in table)


def test_packing_pays_removes_at_least_an_eighth_of_the_ctas():
    from cula_sm90.prefill import forward

    assert not forward.packing_pays((64,) * 64) and not forward.packing_pays((4096,))  # full chunks only
    assert forward.packing_pays(tuple(_random_lengths(0)))
    assert forward.packing_pays((5,) * 8)  # 8 chunks in 2 tiles
    # 8 chunks, 7 tiles: 1 / 8 saved, packs; 9 chunks, 8 tiles: 1 / 9 < 1 / 8, does not
    assert forward.packing_pays((64,) * 6 + (16, 16))
    assert not forward.packing_pays((64,) * 7 + (16, 16))
    assert not forward.packing_pays(())


def test_stage1_packs_only_tc_inference_with_host_lengths():
    from cula_sm90.prefill import forward

    short = tuple(_random_lengths(3))
    assert forward.stage1_packs("tc", False, short)
    assert not forward.stage1_packs("simt", False, short)
    assert not forward.stage1_packs("tc", True, short)  # training: Akk needs 64 rows per chunk
    assert not forward.stage1_packs("tc", False, None)  # lengths only on the device
    assert not forward.stage1_packs("tc", False, (64,) * 4)
    assert forward.stage1_packs("tc", False, (64,) * 4, pack_stage1=True)
    assert not forward.stage1_packs("tc", False, short, pack_stage1=False)
    with pytest.raises(ValueError, match="packed stage 1 is the tensor-core kernel without store_akk"):
        forward.intra_config("safe", "none", True, True, True, bf16, bf16, bf16, "tc", True, True)


@pytest.mark.parametrize("lens", [[5, 70, 1, 0, 130, 17, 33, 15], _random_lengths(4, 24, 1500)])
def test_packed_stage1_contract_equals_unpacked(fwd, monkeypatch, lens):
    """The safe gate's call packs by the dispatch rule (stage 1 over the tile table, which the emulator decodes and
    checks: every token once, each piece's rows and chunk index) and gives the unpacked call's o and final state;
    the kernel it compiles is the packed configuration; device-only lengths never pack."""
    configs = []

    def intra(*config):
        configs.append(config)
        return _intra_emulator(*config)

    monkeypatch.setattr(fwd, "compile_intra", intra)
    HV = 2
    q, k, v, g, beta, h0, cu = _inputs(lens, HV, seed=21)
    gen = torch.Generator().manual_seed(22)
    A_log, dt_bias = torch.rand(HV, generator=gen), 0.1 * torch.randn(HV * K, generator=gen)
    args = (q, k, v, g.float(), beta, A_log, dt_bias, h0, cu, cu)
    assert fwd.packing_pays(tuple(lens))
    o_p, ht_p = fwd.prefill(*args, **_SAFE)
    o_u, ht_u = fwd.prefill(*args, **_SAFE, pack_stage1=False)
    assert [c[-1] for c in configs] == [True, False]  # packed, then the plain TC kernel
    assert _rel(ht_p, ht_u) < 1e-6 and _rel(o_p.float(), o_u.float()) < 1e-6
    o_d, ht_d = fwd.prefill(*args[:9], None, **_SAFE)  # no cu_seqlens_cpu
    assert configs[-1][-1] is False and torch.equal(o_d, o_u) and torch.equal(ht_d, ht_u)
