"""Device helpers shared by the prefill kernels: locating a chunk in the varlen layout, beta activations."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

BT = 64  # chunk length of every prefill kernel
DK = 128


class Stage1Launch:
    """The host entry both stage-1 kernels share (chunk_intra.py, chunk_intra_tc.py): the tensors from pointers
    (q, k [TT, HQK, K]; v, g and the outputs w, u, qg, kg [TT, HV, K]; beta [TT, HV]; A_log [HV]; dt_bias
    [HV, K]; cu_seqlens and chunk offsets [N + 1]; Aqk and Akk [TT, HV, BT]; gl [NC, HV, K]) and one CTA of
    `self.threads` per (chunk, q/k head), or, with `cta_per_value_head`, per (chunk, value head): grid x = NC * G,
    chunk-major, so the G CTAs of one chunk and q/k head are adjacent (and read q, k while they are in L2). Akk is
    written only by a kernel compiled with `store_akk` (chunk_intra_tc.py); the others never touch its address.
    chunk_intra_tc_packed.py reads a tile table through cu_ptr and runs NC tiles (launch_tables)."""

    threads = 128
    cta_per_value_head = False
    min_ctas_per_sm = 0  # > 0: the register budget is capped so that many CTAs fit an SM (nvvm.minctasm)
    store_akk = False  # also write Akk = (I + L)^-1 (training residual); only chunk_intra_tc.py implements it

    def __init__(self, gate: str, beta_activation: str, l2norm: bool, has_a_log: bool, has_dt_bias: bool):
        self.gate = gate
        self.beta_activation = beta_activation
        self.l2norm = l2norm
        self.has_a_log = has_a_log
        self.has_dt_bias = has_dt_bias

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, g_ptr: cute.Pointer,
                 beta_ptr: cute.Pointer, alog_ptr: cute.Pointer, dtb_ptr: cute.Pointer, cu_ptr: cute.Pointer,
                 co_ptr: cute.Pointer, w_ptr: cute.Pointer, u_ptr: cute.Pointer, qg_ptr: cute.Pointer,
                 kg_ptr: cute.Pointer, aqk_ptr: cute.Pointer, akk_ptr: cute.Pointer, gl_ptr: cute.Pointer,
                 TT: Int32, N: Int32, NC: Int32, search_steps: Int32, HQK: Int32, G: Int32,
                 scale: Float32, lower_bound: Float32, stream):
        HV = HQK * G
        ctas_x = NC
        if const_expr(self.cta_per_value_head):
            ctas_x = NC * G
        qk = cute.make_layout((TT, HQK, DK), stride=(HQK * DK, DK, 1))
        tok = cute.make_layout((TT, HV, DK), stride=(HV * DK, DK, 1))
        mk = cute.make_tensor
        amat = cute.make_layout((TT, HV, BT), stride=(HV * BT, BT, 1))
        kernel = self.kernel(
            mk(q_ptr, qk), mk(k_ptr, qk), mk(v_ptr, tok), mk(g_ptr, tok),
            mk(beta_ptr, cute.make_layout((TT, HV), stride=(HV, 1))), mk(alog_ptr, cute.make_layout(HV)),
            mk(dtb_ptr, cute.make_layout((HV, DK), stride=(DK, 1))),
            *self.launch_tables(cu_ptr, co_ptr, N, NC),
            mk(w_ptr, tok), mk(u_ptr, tok), mk(qg_ptr, tok), mk(kg_ptr, tok),
            mk(aqk_ptr, amat), mk(akk_ptr, amat),
            mk(gl_ptr, cute.make_layout((NC, HV, DK), stride=(HV * DK, DK, 1))),
            N, search_steps, G, scale, lower_bound)
        if const_expr(self.min_ctas_per_sm > 0):
            # the carveout is given so that the compiler need not ask a device for it (CPU AOT builds)
            kernel.launch(grid=[ctas_x, HQK, 1], block=[self.threads, 1, 1], stream=stream,
                          min_blocks_per_mp=self.min_ctas_per_sm, preferred_smem_carveout=100)
        else:
            kernel.launch(grid=[ctas_x, HQK, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def launch_tables(self, cu_ptr: cute.Pointer, co_ptr: cute.Pointer, N: Int32, NC: Int32):
        """The kernel's `cu` and `co` tensors: cu_seqlens and the chunk offsets, [N + 1] each (the packed stage 1
        reads a tile table from cu_ptr instead)."""
        return cute.make_tensor(cu_ptr, cute.make_layout(N + 1)), cute.make_tensor(co_ptr, cute.make_layout(N + 1))


@cute.jit
def find_chunk(cu: cute.Tensor, co: cute.Tensor, chunk: Int32, N: Int32, search_steps: Int32):
    """Sequence of global chunk `chunk`: the largest n with co[n] <= chunk (co: first chunk of each sequence,
    [N + 1]; empty sequences own no chunk). Returns (n, first token, valid tokens, chunk exists). Called by whole
    warps (a ballot).

    A 32-ary search, the same in every warp: each step, the 32 lanes test 32 evenly spaced candidates of the
    remaining range at once (one round of loads) and a ballot keeps the last that passes, narrowing the range
    32-fold; `search_steps` (forward.search_steps(N), from the host, which knows N from a shape) steps, so no host
    synchronisation and no data-dependent loop bound."""
    lane = cute.arch.lane_idx()
    lo = Int32(0)  # co[lo] <= chunk; the answer lies in [lo, lo + n)
    n = N
    for _ in cutlass.range(search_steps):
        stride = (n + 31) // 32
        idx = lo + lane * stride
        ok = False
        if idx < lo + n:
            ok = co[idx] <= chunk
        passed = cute.arch.popc(cute.arch.vote_ballot_sync(ok))  # co is non-decreasing: lanes [0, passed) pass
        end = lo + n
        lo = lo + (passed - 1) * stride
        n = cutlass.min(stride, end - lo)
    valid = chunk < co[N]
    t0 = cu[lo] + (chunk - co[lo]) * BT
    L = cu[lo + 1] - t0
    if L > BT:
        L = Int32(BT)
    return lo, t0, L, valid


@cute.jit
def activate_beta(b: Float32, activation: cutlass.Constexpr) -> Float32:
    r = b
    if const_expr(activation == "sigmoid"):
        r = 1.0 / (1.0 + cute.math.exp(-b, fastmath=True))
    elif const_expr(activation == "2sigmoid"):
        r = 2.0 / (1.0 + cute.math.exp(-b, fastmath=True))
    return r
