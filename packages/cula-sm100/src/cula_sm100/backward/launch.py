"""Thin launch code of the sm100 chunk_kda backward: the kernels' registration with cula_core.cute_runtime, one
function per stage, and `chunk_kda_backward`, the stages in order.

`chunk_kda_backward(...)` follows the kernel calling convention of docs/backends.md. Like FLA 0.6.0's
`chunk_kda_bwd`, it takes Aqk and Akk from the forward (core's residuals, docs/backends.md) and recomputes the
other intermediates, here with cula-sm100's own forward kernels (`recompute`: the forward's composition less
the output, with recompute_w_u alone in place of chunk_intra_wu when the residuals came), then runs the backward
stages, each one CuTe DSL kernel launch (or two):

  1. dAqk = do @ v_new^T (causal), dv = Aqk^T @ do                       chunk_bwd_dav.py
  2. reverse state recurrence: dh per chunk, dv += kg @ dh, dh0           chunk_bwd_dhu.py
  3. dq, dk (GVA-summed), dv, dbeta, dG, dL                               chunk_wy_dqkg.py
  4. intra-chunk backward of Aqk and L = beta k k^T decays, added to      chunk_bwd_intra_tc.py
     step 3's outputs, then the reverse chunk-local cumsum of dG
  5. gate / beta / L2-norm backward (dg, dA_log, ddt_bias, dbeta)         gate_bwd.py, l2norm_bwd.py

Kernels (registered here for every arch of cula_sm100.runtime.ARCHS, launched through forward.launch.launch_kernel)
and their compile-time configurations (sizes and the scale are runtime arguments):

    name (sm100.backward. + the kernel's module)  configuration
    chunk_bwd_dav, chunk_wy_dqkg                  ()
    chunk_bwd_dhu                                 (dht given, dh0 wanted, V slice width)
    chunk_bwd_intra_tc                            ()
    chunk_bwd_intra                               ()    (the tensor-core kernel's fp32 oracle)
    gate_bwd                                      (gate, has A_log, has dt_bias, lower_bound, beta activation,
                                                  g dtype, beta dtype)
    l2norm_bwd                                    (q / k dtype,)

Each kernel's pointer dtypes are listed once here (`*_DTYPES`, `*_dtypes`) for its compilation and its launch's
dtype check alike.
"""

from __future__ import annotations

import itertools

import torch

from cula_core import cute_runtime as rt
from cula_core import reference as ref
from cula_sm100 import runtime
from cula_sm100.forward import launch as fwd


_BF, _F32, _I32 = torch.bfloat16, torch.float32, torch.int32
# chunk_wy_dqkg's pointer arguments in order: q, k, v, v_new, G, beta, A, h, do, dh, dv | dq, dk, dv2, dG, dbeta,
# dL | chunk table
WY_DTYPES = (_BF, _BF, _BF, _BF, _F32, _F32, _BF, _BF, _BF, _BF, _BF, _F32, _F32, _BF, _F32, _F32, _F32, _I32)
# chunk_bwd_dav's: do, v_new, Aqk, dAqk, dv, chunk table
DAV_DTYPES = (_BF, _BF, _BF, _F32, _BF, _I32)
# chunk_bwd_intra's: q, k, G, beta, dAqk, dL, dq, dk, dbeta, dG, chunk table
INTRA_DTYPES = (_BF, _BF, _F32, _F32, _F32, _F32, _F32, _F32, _F32, _F32, _I32)


def gate_bwd_dtypes(g_dtype, beta_dtype):
    """gate_bwd's pointer arguments: dG, g, A_log, dt_bias, dbeta, beta, dg, dbeta out, A_log / dt_bias partial sums,
    chunk table."""
    return (_F32, g_dtype, _F32, _F32, _F32, beta_dtype, g_dtype, beta_dtype, _F32, _F32, _I32)


def l2norm_bwd_dtypes(x_dtype):
    """l2norm_bwd's pointer arguments: x, dy, dx."""
    return (x_dtype, _F32, x_dtype)


WY_DQKG, DAV, DHU = "sm100.backward.chunk_wy_dqkg", "sm100.backward.chunk_bwd_dav", "sm100.backward.chunk_bwd_dhu"
INTRA, INTRA_TC = "sm100.backward.chunk_bwd_intra", "sm100.backward.chunk_bwd_intra_tc"
GATE_BWD, L2NORM_BWD = "sm100.backward.gate_bwd", "sm100.backward.l2norm_bwd"


def wy_dqkg_kernel() -> runtime.Kernel:
    """chunk_wy_dqkg (one configuration serves every size)."""
    return WY_DQKG, ()


def dav_kernel() -> runtime.Kernel:
    """chunk_bwd_dav (one configuration serves every size)."""
    return DAV, ()


def chunk_bwd_dav(do, v_new, Aqk, ctab):
    """The backward of o's intra-chunk term (chunk_bwd_dav.py). do, v_new [TT, HV, V] bf16; Aqk [TT, HV, 64] bf16.
    Returns dAqk [TT, HV, 64] fp32 (causal, diagonal included; zero past each chunk's end) and dv [TT, HV, V]
    bf16 (the gradient of v_new through o)."""
    TT, HV, _ = do.shape
    dA = torch.empty(TT, HV, fwd.BT, device=do.device, dtype=torch.float32)
    dv = torch.empty_like(do)
    NC = ctab.shape[0]
    if NC:
        fwd.launch_kernel(dav_kernel(), DAV_DTYPES, (do, v_new, Aqk, dA, dv, ctab), (TT, NC, HV))
    return dA, dv


def intra_kernel() -> runtime.Kernel:
    """The CUDA-core chunk_bwd_intra (one configuration serves every size)."""
    return INTRA, ()


# The intra-chunk backward runs on tensor cores (chunk_bwd_intra_tc.py: mma.sync through 16-row reference blocks,
# an exact CUDA-core diagonal under strong decay). The CUDA-core kernel chunk_bwd_intra.py is the fp32 oracle of its
# tests and benchmark, reached only through chunk_bwd_intra(tc=False).
def intra_tc_kernel() -> runtime.Kernel:
    """chunk_bwd_intra_tc (one configuration serves every size)."""
    return INTRA_TC, ()


def chunk_bwd_intra(q, k, G, beta, dAqk, dL, dq, dk, dbeta, dG, ctab, *, scale, tc=True):
    """The intra-chunk backward, ADDED in place to dq, dk [TT, HQK, K], dbeta [TT, HV] and dG [TT, HV, K] (fp32,
    as chunk_wy_dqkg returns them); dG then holds its reverse chunk-local cumsum (the gradient of the raw log
    decay). q, k [TT, HQK, K] bf16; G [TT, HV, K] fp32; beta [TT, HV] fp32 (activated); dAqk (chunk_bwd_dav), dL
    (chunk_wy_dqkg) [TT, HV, 64] fp32. `tc`: the tensor-core kernel chunk_bwd_intra_tc.py (True) or the CUDA-core
    chunk_bwd_intra.py (False, the tests' and benchmark's fp32 oracle)."""
    TT, HQK, _ = q.shape
    HV = G.shape[1]
    NC = ctab.shape[0]
    if NC:
        kern = intra_tc_kernel() if tc else intra_kernel()
        fwd.launch_kernel(kern, INTRA_DTYPES, (q, k, G, beta, dAqk, dL, dq, dk, dbeta, dG, ctab),
                          (TT, NC, HQK, HV, float(scale)))


def dhu_kernel(has_dht: bool, want_dh0: bool, bv: int = 64, stages: int = 1) -> runtime.Kernel:
    """chunk_bwd_dhu per (dht given, dh0 wanted, V slice width, pipeline stages)."""
    return DHU, (bool(has_dht), bool(want_dh0), int(bv), int(stages))


# chunk_bwd_dhu's V slice: 32 columns (4 CTAs per (sequence, head)) up to this many busy (sequence, head) chains,
# 64 (2 CTAs) above. The recurrence is serial in the chunks, so its time is the longest sequence's chain of steps
# while the SMs have room (stage times: docs/sm100_backward.md). The threshold keeps BV = 32's grid (~64 KiB a CTA)
# at most 2 CTAs per SM.
DHU_NARROW_MAX_PAIRS = 64


def busy_sequences(bounds) -> float:
    """How many sequences run side by side over the longest one's chain of chunks: total chunks / the longest
    sequence's (N for equal lengths; about 1 when one sequence holds most tokens)."""
    chunks = [-(-(b - a) // fwd.BT) for a, b in itertools.pairwise(bounds)]
    return sum(chunks) / max(chunks) if chunks and max(chunks) else 0.0


def dhu_slice_width(busy: float, HV: int) -> int:
    """chunk_bwd_dhu's V slice (BV) for `busy` sequences (busy_sequences; N for equal lengths) of HV heads."""
    return 32 if busy * HV <= DHU_NARROW_MAX_PAIRS else 64


# chunk_bwd_dhu's pointer arguments: qg, kg, w, G, do, dv, dht (or None), dh, dv_tot, dh0 (or None), sequence table
DHU_DTYPES = (_BF, _BF, _BF, _F32, _BF, _BF, _F32, _BF, _BF, _F32, _I32)


def chunk_bwd_dhu(qg, kg, w, G, do, dv, dht, ctab, stab, *, want_dh0, bv=None, stages=None):
    """The reverse state recurrence as a kernel (chunk_bwd_dhu.py). qg, kg, w [TT, HV, K] bf16 (qg = bf16(q e^G
    scale): fwd.gate_cumsum_qg); G [TT, HV, K] fp32; do, dv [TT, HV, V] bf16 (dv: gradient of v_new through o);
    dht [N, HV, K, V] fp32 or None. Returns dh [NC, HV, K, V] bf16, dv_tot [TT, HV, V] bf16, dh0 [N, HV, K, V] fp32
    or None. `bv`: the V slice width, None picks by dhu_slice_width as for N equal sequences (chunk_kda_backward
    passes the lengths' pick); `stages`: None picks by fwd.walk_stages."""
    TT, HV, K = G.shape
    V = do.shape[-1]
    NC, N = ctab.shape[0], stab.shape[0]
    dh = torch.empty(NC, HV, K, V, device=G.device, dtype=torch.bfloat16)
    dv2 = torch.empty_like(dv)
    dh0 = torch.empty(N, HV, K, V, device=G.device, dtype=torch.float32) if want_dh0 else None
    if N:
        bv = bv or dhu_slice_width(N, HV)  # the lengths are not known here: as if all were equal
        stages = stages or fwd.walk_stages(N * HV * (V // bv), rt.sm_count(G.device.index or 0))
        fwd.launch_kernel(dhu_kernel(dht is not None, want_dh0, bv, stages), DHU_DTYPES,
                          (qg, kg, w, G, do, dv, dht, dh, dv2, dh0, stab), (TT, NC, N, HV))
    return dh, dv2, dh0


def chunk_wy_dqkg(q, k, v, v_new, G, beta, Akk, h, do, dh, dv, ctab, *, scale):
    """The fused WY / state backward (kernel: chunk_wy_dqkg.py), over packed tokens.

    Args (TT packed tokens, NC chunks of the chunk table `ctab` [NC, 2] int32):
        q, k: [TT, HQK, K] bf16 (L2-normalised if the forward normalises); v, v_new, do, dv: [TT, HV, V] bf16
        (dv: total gradient of v_new); G: [TT, HV, K] fp32 chunk-local cumsum (natural log); beta: [TT, HV]
        fp32 after its activation; Akk: [TT, HV, 64] bf16; h, dh: [NC, HV, K, V] bf16 (state at the chunk
        start; gradient of the state at the chunk end).

    Returns:
        dq, dk [TT, HQK, K] fp32 (summed over each group's value heads), dv [TT, HV, V] bf16 (gradient of v,
        of beta * v: times beta), dbeta [TT, HV] fp32, dG [TT, HV, K] fp32 (before the reverse cumsum),
        dL [TT, HV, 64] fp32 (gradient of the strictly lower L = beta_i k_i k_j decays).
    """
    TT, HQK, K = q.shape
    HV = v.shape[1]
    # the kernel writes every row of dq / dk once (the group's value heads summed in registers): no zero-fill
    dq = torch.empty(TT, HQK, K, device=q.device, dtype=torch.float32)
    dk = torch.empty_like(dq)
    dv2 = torch.empty_like(v)
    dg = torch.empty(TT, HV, K, device=q.device, dtype=torch.float32)
    db = torch.empty(TT, HV, device=q.device, dtype=torch.float32)
    dA = torch.empty(TT, HV, fwd.BT, device=q.device, dtype=torch.float32)
    NC = ctab.shape[0]
    if NC:
        fwd.launch_kernel(wy_dqkg_kernel(), WY_DTYPES,
                          (q, k, v, v_new, G, beta, Akk, h, do, dh, dv, dq, dk, dv2, dg, db, dA, ctab),
                          (TT, NC, HQK, HV, float(scale)))
    return dq, dk, dv2, db, dg, dA


def gate_bwd_kernel(gate: str, has_A_log: bool, has_dt_bias: bool, lower_bound, beta_activation: str, g_dtype,
                    beta_dtype) -> runtime.Kernel:
    """gate_bwd per (gate mode, parameters present, lower bound, beta activation, g / beta dtypes)."""
    return GATE_BWD, (gate, bool(has_A_log), bool(has_dt_bias), lower_bound, beta_activation, g_dtype, beta_dtype)


def l2norm_bwd_kernel(x_dtype) -> runtime.Kernel:
    """l2norm_bwd per dtype of q / k."""
    return L2NORM_BWD, (x_dtype,)


def _build_wy_dqkg(config):
    from cula_sm100.backward.chunk_wy_dqkg import ChunkWyDqkg

    return ChunkWyDqkg(), runtime.fake_args(WY_DTYPES, 1, 1, 1, 1, 1.0)


def _build_dav(config):
    from cula_sm100.backward.chunk_bwd_dav import ChunkBwdDav

    return ChunkBwdDav(), runtime.fake_args(DAV_DTYPES, 1, 1, 1)


def _build_intra(config):
    from cula_sm100.backward.chunk_bwd_intra import ChunkBwdIntra

    return ChunkBwdIntra(), runtime.fake_args(INTRA_DTYPES, 1, 1, 1, 1, 1.0)


def _build_intra_tc(config):
    from cula_sm100.backward.chunk_bwd_intra_tc import ChunkBwdIntraTC

    return ChunkBwdIntraTC(), runtime.fake_args(INTRA_DTYPES, 1, 1, 1, 1, 1.0)


def _build_dhu(config):
    from cula_sm100.backward.chunk_bwd_dhu import ChunkBwdDhu

    return ChunkBwdDhu(*config), runtime.fake_args(DHU_DTYPES, 1, 1, 1, 1)


def _build_gate_bwd(config):
    from cula_sm100.backward.gate_bwd import GateBwd

    gate, has_A_log, has_dt_bias, lower_bound, beta_activation, g_dtype, beta_dtype = config
    return (GateBwd(gate, has_A_log, has_dt_bias, lower_bound, beta_activation),
            runtime.fake_args(gate_bwd_dtypes(g_dtype, beta_dtype), 1, 1, 1))


def _build_l2norm_bwd(config):
    from cula_sm100.backward.l2norm_bwd import L2NormBwd

    (x_dtype,) = config
    return L2NormBwd(), runtime.fake_args(l2norm_bwd_dtypes(x_dtype), 1)


for _name, _build, _module in ((WY_DQKG, _build_wy_dqkg, "chunk_wy_dqkg"), (DAV, _build_dav, "chunk_bwd_dav"),
                               (INTRA, _build_intra, "chunk_bwd_intra"),
                               (INTRA_TC, _build_intra_tc, "chunk_bwd_intra_tc"), (DHU, _build_dhu, "chunk_bwd_dhu"),
                               (GATE_BWD, _build_gate_bwd, "gate_bwd"), (L2NORM_BWD, _build_l2norm_bwd, "l2norm_bwd")):
    # the kernel's module, the shared helpers and this module
    runtime.register(_name, _build, (f"cula_sm100.backward.{_module}", *fwd.SHARED_SOURCES,
                                     "cula_sm100.backward.launch"))


def finish(dq, dk, dv, dbeta, dG, dh0, q, k, g, beta, A_log, dt_bias, initial_state, ctab, *, v_dtype,
           use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation):
    """The gate / L2-norm / beta backward as kernels (gate_bwd.py, l2norm_bwd.py), with dG already the gradient of the
    raw log decay (chunk_bwd_intra's reverse cumsum). dq, dk
    [TT, HQK, K], dbeta [TT, HV], dG [TT, HV, K] fp32; raw inputs in their shapes and dtypes. Returns the
    gradients of (q, k, v, g, beta, A_log, dt_bias, initial_state), None for absent inputs."""
    B, T, HQK, K = q.shape
    HV = g.shape[2]
    TT = B * T
    NC = ctab.shape[0]
    if use_qk_l2norm_in_kernel:
        dqo, dko = torch.empty_like(q), torch.empty_like(k)
        if TT * HQK:
            kern, dtypes = l2norm_bwd_kernel(q.dtype), l2norm_bwd_dtypes(q.dtype)
            for x, dy, dx in ((q, dq, dqo), (k, dk, dko)):
                fwd.launch_kernel(kern, dtypes, (x.contiguous(), dy, dx), (TT * HQK,))
    else:
        dqo, dko = dq.reshape(q.shape).to(q.dtype), dk.reshape(k.shape).to(k.dtype)
    g_c, beta_c = g.contiguous(), beta.contiguous()
    has_a, has_b = A_log is not None and gate != "precomputed", dt_bias is not None and gate != "precomputed"
    a32 = A_log.float().contiguous() if has_a else None
    b32 = dt_bias.float().contiguous() if has_b else None
    dgo, dbo = torch.empty_like(g_c), torch.empty_like(beta_c)
    pa = torch.empty(NC, HV, K, device=g.device, dtype=torch.float32) if has_a else None
    pb = torch.empty(NC, HV, K, device=g.device, dtype=torch.float32) if has_b else None
    if NC:
        kern = gate_bwd_kernel(gate, has_a, has_b, lower_bound if gate == "safe" else None, beta_activation,
                               g.dtype, beta.dtype)
        fwd.launch_kernel(kern, gate_bwd_dtypes(g.dtype, beta.dtype),
                          (dG, g_c, a32, b32, dbeta, beta_c, dgo, dbo, pa, pb, ctab), (TT, NC, HV))
    # partial sums per (chunk, head, channel) summed by torch in a fixed order: deterministic
    dAo = pa.sum((0, 2)).reshape(A_log.shape).to(A_log.dtype) if has_a else None
    dto = pb.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype) if has_b else None
    dvo = dv.reshape(B, T, HV, dv.shape[-1]).to(v_dtype)
    dh0o = dh0.to(initial_state.dtype) if initial_state is not None and dh0 is not None else None
    return dqo, dko, dvo, dgo, dbo, dAo, dto, dh0o


def recompute(q, k, v, g, beta, A_log, dt_bias, initial_state, ctab, stab, *, scale, use_qk_l2norm_in_kernel, gate,
              lower_bound, beta_activation, residuals=None):
    """The forward's intermediates with cula_sm100.forward's kernels: its composition (`forward.launch.forward`)
    less the output o, which the backward does not read, and chunk_bwd_dhu's qg = bf16(q e^G scale) [TT, HV, K]
    (made with G): returns (Intermediates, qg). `residuals`: the forward's (Aqk, Akk) [B, T, HV, 64], which then
    are not recomputed (recompute_w_u alone runs in place of chunk_intra_wu)."""
    B, T, HQK, K = q.shape
    HV = v.shape[2]
    if use_qk_l2norm_in_kernel:
        q, k = fwd.l2norm(q), fwd.l2norm(k)
    A_log = A_log.contiguous() if A_log is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    G, qg = fwd.gate_cumsum_qg(g.reshape(B * T, HV, K), A_log, dt_bias, q.reshape(B * T, HQK, K), ctab, gate=gate,
                               lower_bound=lower_bound, scale=scale)
    if residuals is not None:
        Aqk, Akk = (r.reshape(B * T, HV, fwd.BT) for r in residuals)
        w, u, kg = fwd.recompute_w_u(k, v, G, beta, Akk, ctab, beta_activation=beta_activation)
    else:
        Aqk, Akk, w, u, kg = fwd.chunk_intra_wu(q, k, v, G, beta, ctab, scale=scale, beta_activation=beta_activation)
    h, v_new, _ = fwd.chunk_delta_h(w, u, kg, G, initial_state, ctab, stab, output_final_state=False)
    it = fwd.Intermediates(q=q.reshape(B * T, HQK, K), k=k.reshape(B * T, HQK, K), g_cumsum=G, Aqk=Aqk,
                           Akk=Akk, w=w, u=u, kg=kg, h=h, v_new=v_new)
    return it, qg


def chunk_kda_backward(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *,
                       scale, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, residuals=None,
                       marks=None):
    """The backend's kernel for `chunk_kda_backward` (calling convention: docs/backends.md): gradients of
    (q, k, v, g, beta, A_log, dt_bias, initial_state), None for absent inputs. `residuals`: (Aqk, Akk) in FLA
    0.6.0's chunk-64 format, from this backend's forward (`forward.launch.chunk_kda(save_residuals=True)`) or
    cula-sm90's, or None to recompute them.
    `marks` (not part of the convention; the benchmark's stage timing): a callable called with each stage's
    name when it is queued."""
    mark = marks or _no_mark
    mark("begin")
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    TT = B * T
    do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state = fwd.aligned(do, dht, q, k, v, g, beta, A_log, dt_bias,
                                                                           initial_state)
    if residuals is not None:
        residuals = fwd.aligned(*residuals)
    bounds = fwd.sequence_bounds(B, T, cu_seqlens, cu_seqlens_cpu)
    ctab, stab = fwd.tables(B, T, cu_seqlens, cu_seqlens_cpu, q.device)
    it, qg = recompute(q, k, v, g, beta, A_log, dt_bias, initial_state, ctab, stab, scale=scale,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate, lower_bound=lower_bound,
                   beta_activation=beta_activation, residuals=residuals)
    do_t = do.reshape(TT, HV, V)
    beta_act = ref.activate_beta(beta.reshape(TT, HV).float(), beta_activation).contiguous()
    dht = dht.float().contiguous() if dht is not None else None
    mark("start")
    dAqk, dv = chunk_bwd_dav(do_t, it.v_new, it.Aqk, ctab)
    mark("dav")
    dh, dv, dh0 = chunk_bwd_dhu(qg, it.kg, it.w, it.g_cumsum, do_t, dv, dht, ctab, stab,
                                want_dh0=initial_state is not None,
                                bv=dhu_slice_width(busy_sequences(bounds), HV))
    mark("dhu")
    dq, dk, dv, dbeta, dG, dL = chunk_wy_dqkg(it.q, it.k, v.reshape(TT, HV, V), it.v_new, it.g_cumsum, beta_act,
                                              it.Akk, it.h, do_t, dh, dv, ctab, scale=scale)
    mark("chunk_wy_dqkg")
    chunk_bwd_intra(it.q, it.k, it.g_cumsum, beta_act, dAqk, dL, dq, dk, dbeta, dG, ctab, scale=scale)
    mark("intra")
    grads = finish(dq, dk, dv, dbeta, dG, dh0, q, k, g, beta, A_log, dt_bias, initial_state, ctab, v_dtype=v.dtype,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate, lower_bound=lower_bound,
                   beta_activation=beta_activation)
    mark("finish")
    return grads


def _no_mark(name: str) -> None:
    pass
