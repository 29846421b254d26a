"""KVBuffer verify in chunk form with a per-CTA latency chain that does not grow with T (opt-in variant
`chunk_flat`, `_config.VERIFY_CHUNK_FLAT`; the dispatch tables do not pick it). COMPILED ONLY: not yet run on a GPU.

Same math, layout, products and grid as kvbuffer_verify.py (read it first): one CTA = (request, value head, 32
value columns), 4 warps split K, U = Kt S_0 and W = Qt S_0 by 3xTF32 mma.sync (48 HMMA per warp at T <= 8, 96 at
9..16), the T tokens padded to MP = 8 or 16 rows. What changes is everything around the products, so that every
T-dependent loop either runs over the padded MP (predicated on t < T) or is spread across lanes:

  * G, Kt / Qt and the buffer's G_t: a thread per (token, 4 K rows) instead of a thread per row looping over T:
    the cumulative gate is an MP-term masked sum of 16-byte shared-memory rows (independent loads, no chain
    through the tokens), 4 exps per thread and pass, and G_t goes to the KVBuffer as one 16-byte store.
    k_t goes to the KVBuffer straight from the prologue's registers (a vector store per lane).
  * The substitution as a matrix: with L = I + diag(beta) A (A strictly lower) and r = v - U,
        delta = Dm r,  Dm = L^{-1} diag(beta);      o = W + C r,  C = B Dm   (B lower, diagonal included).
    Dm and C depend only on the pair sums and beta, never on the columns: every warp computes them itself (lane j
    = column j of L^{-1}, a right-looking substitution: MP steps of one FMA each on the chain, MP^2 / 2 FMAs)
    into its own slice of shared memory (no CTA barrier), then applies them to its tokens w, w + 4, ... for the
    32 columns (lane = column): two dot products of MP terms per token, independent across tokens and warps.
    Padded rows / columns (t >= T) have A = B = 0 and finite r, so they never reach a live token (Dm and C are
    lower triangular).
  * o and delta are staged in shared memory and leave as 16-byte stores (o: 4 elements of its dtype per lane).

Pipeline (4 CTA barriers): state loads first; per-token vectors (warp per token; k_t to the buffer) | G, Kt / Qt,
G_t | pair sums (partials per warp) and the products | A, B summed over the warps into padded MP x MP matrices |
per warp: Dm, C, apply, stage, store.

Numerics: the same sums as the chunk kernel, but delta through L^{-1} (the substitution's terms regrouped), so
the results agree with the recurrent kernel to fp32 rounding, not bitwise. Deterministic (fixed orders, no atomics).

Assumptions: as kvbuffer_verify.py (inputs contiguous, 16-byte aligned, K in (64, 128), V % 32 == 0, T <= 16).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from cula_sm90.decode._dsl import load_vec, store_vec, store_zeros
from cula_sm90.decode.kvbuffer_verify import ChunkVerify


class FlatChunkVerify(ChunkVerify):
    """Compile-time configuration: T, K, V and the gate code (as ChunkVerify); always tensor-core products."""

    def __init__(self, *, T: int, K: int, V: int, safe_gate: bool, has_A_log: bool, has_dt_bias: bool, l2norm: bool):
        super().__init__(T=T, K=K, V=V, safe_gate=safe_gate, has_A_log=has_A_log, has_dt_bias=has_dt_bias,
                         l2norm=l2norm, tensor_cores=True)
        MP, KP, BV, NW = self.MP, self.KP, self.BV, self.NW
        self.MQ = MP + 4                      # row stride of the MP x MP matrices (16-byte rows, fewer conflicts)
        self.TOKW = MP // NW                  # tokens per warp in the apply step (2 or 4)
        self.K4 = K // 4                      # 16-byte quads of a K row
        self.GPASS = (MP * self.K4 + 32 * NW - 1) // (32 * NW)   # passes of the (token, quad) step
        # vecs: 3 x MP rows (q, k, log gate); Gs: MP rows; At: 2 MP rows; ABp: partial pair sums; red: partial
        # U, W; ABm: summed A, B (2 x MP x MQ); Xw: per warp Dm and C (2 x MP x MQ); stage: per warp o and delta
        f = (3 * MP * KP + MP * KP + 2 * MP * KP + NW * 2 * self.NPP + NW * 2 * MP * BV + 2 * MP * self.MQ
             + NW * 2 * MP * self.MQ + NW * 2 * self.TOKW * BV)
        self.smem_bytes = 4 * f + 64

    @cute.kernel
    def kernel(self, q: cute.Pointer, k: cute.Pointer, v: cute.Pointer, g: cute.Pointer, beta: cute.Pointer,
               A_log: cute.Pointer, dt_bias: cute.Pointer, pool: cute.Pointer, cache_idx: cute.Pointer,
               o: cute.Pointer, buf: cute.Pointer, HQK: Int32, HV: Int32, P: Int32, scale: Float32,
               lower_bound: Float32):
        T, K, V, MP, KP, EPL, BV, NW, MQ = self.T, self.K, self.V, self.MP, self.KP, self.EPL, self.BV, self.NW, self.MQ
        TOKW, K4 = self.TOKW, self.K4
        W = 2 * K + V
        tid, warp, lane, vb, hv, h, col0, kbase, idx, live, tok0 = self._coords(cache_idx, HQK, HV, P)

        smem = cutlass.memory.SmemAllocator()
        NPP = self.NPP
        vecs = smem.allocate_tensor(Float32, cute.make_layout((3, MP, KP), stride=(MP * KP, KP, 1)),
                                    byte_alignment=16)
        Gs = smem.allocate_tensor(Float32, cute.make_layout((MP, KP), stride=(KP, 1)), byte_alignment=16)
        At = smem.allocate_tensor(Float32, cute.make_layout((2 * MP, KP), stride=(KP, 1)), byte_alignment=16)
        ABp = smem.allocate_tensor(Float32, cute.make_layout((NW, 2, NPP), stride=(2 * NPP, NPP, 1)),
                                   byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout((NW, 2 * MP, BV), stride=(2 * MP * BV, BV, 1)),
                                   byte_alignment=16)
        ABm = smem.allocate_tensor(Float32, cute.make_layout((2, MP, MQ), stride=(MP * MQ, MQ, 1)),
                                   byte_alignment=16)
        Xw = smem.allocate_tensor(Float32, cute.make_layout((NW, 2, MP, MQ), stride=(2 * MP * MQ, MP * MQ, MQ, 1)),
                                  byte_alignment=16)
        stg = smem.allocate_tensor(Float32, cute.make_layout((NW, 2, TOKW, BV), stride=(2 * TOKW * BV, TOKW * BV,
                                                                                      BV, 1)), byte_alignment=16)
        sv, sG, sA, sred, sX, sstg = (vecs.iterator, Gs.iterator, At.iterator, red.iterator, Xw.iterator,
                                      stg.iterator)
        if live:
            # --- state rows of this thread first (the long-latency traffic), 16-byte pieces (TC fragment layout)
            S = self._state_tc(pool, (Int64(idx) * HV + hv) * (K * V) + col0, lane, kbase)
            # v of every padded token for this lane's column (each warp applies the solve to its own tokens but
            # needs r_s for all s), beta of every padded token (the inverse); t >= T reloads token T - 1: finite
            vr = []
            br = []
            for t in cutlass.range_constexpr(MP):
                tc_ = min(t, T - 1)
                vr.append(cute.make_tensor(v + (((tok0 + tc_) * HV + hv) * V + col0 + lane), cute.make_layout(1))
                          .load().to(Float32)[0])
                br.append(cute.make_tensor(beta + ((tok0 + tc_) * HV + hv), cute.make_layout(1)).load()
                          .to(Float32)[0])
            # --- per-token vectors (warp w: tokens w, w + NW, ...; MP rows); k_t to the buffer from registers
            ks = self._token_vectors(sv, MP, q, k, g, A_log, dt_bias, tok0, h, hv, HQK, HV, warp, lane, scale,
                                     lower_bound)
            for t, xk in ks:
                if (vb == 0) & (t < T):
                    store_vec(buf, ((tok0 + t) * HV + hv) * W + lane * EPL, xk, EPL)
            cute.arch.sync_threads()   # live is CTA-uniform: every thread reaches the barriers
            # --- G, Kt / Qt, G_t: a thread per (token, 4 rows); G = masked sum of the first t + 1 log-gate rows
            for ps in cutlass.range_constexpr(self.GPASS):
                e = tid + ps * 32 * NW
                t = e // K4
                r4 = (e % K4) * 4
                if e < MP * K4:
                    if t < T:
                        G = [Float32(0.0)] * 4
                        for s in cutlass.range_constexpr(MP):
                            lg = load_vec(sv, Int32((2 * MP + s) * KP) + r4, 4)
                            G = [G[j] + cutlass.select_(s <= t, lg[j], Float32(0.0)) for j in range(4)]
                        ex = [cute.math.exp(x) for x in G]
                        kk = load_vec(sv, (MP + t) * KP + r4, 4)
                        qq = load_vec(sv, t * KP + r4, 4)
                        store_vec(sG, t * KP + r4, G, 4)
                        store_vec(sA, t * KP + r4, [kk[j] * ex[j] for j in range(4)], 4)
                        store_vec(sA, (MP + t) * KP + r4, [qq[j] * ex[j] for j in range(4)], 4)
                        if vb == 0:
                            store_vec(buf, ((tok0 + t) * HV + hv) * W + K + r4, G, 4)
                    else:
                        # padded token rows: zero Kt / Qt rows (U = W = 0 there), G = 0 (finite pair sums)
                        store_zeros(sG, t * KP + r4, 4)
                        store_zeros(sA, t * KP + r4, 4)
                        store_zeros(sA, (MP + t) * KP + r4, 4)
            cute.arch.sync_threads()
            # --- pair sums (lane = pair, warp = its K-slice) and the products, as the chunk kernel
            self._pair_sums(Gs, vecs, ABp, warp, lane, kbase)
            self._products_tc(S, sA, sred, warp, lane, kbase)
            cute.arch.sync_threads()
            # --- A, B summed over the warps (warp order) into padded MP x MP matrices, zero outside s < t (A) /
            # s <= t (B) and t >= T: a thread per entry
            for ps in cutlass.range_constexpr((2 * MP * MP + 32 * NW - 1) // (32 * NW)):
                e = tid + ps * 32 * NW
                if e < 2 * MP * MP:
                    which = e // (MP * MP)
                    t = (e // MP) % MP
                    s = e % MP
                    p = t * (t + 1) // 2 + s
                    x = Float32(0.0)
                    if (t < T) & (s <= t - 1 + which):
                        x = ABp[0, which, p]
                        for ww in cutlass.range_constexpr(1, NW):
                            x = x + ABp[ww, which, p]
                    ABm[which, t, s] = x
            cute.arch.sync_threads()
            # --- per warp: X = L^{-1} column j = lane % MP (right-looking: acc_t += A_ts x_s once x_s is known),
            # Dm[:, j] = X[:, j] beta_j, C[:, j] = B Dm[:, j]; into this warp's Xw slice (no CTA barrier). The
            # matrices are read as broadcast scalars (constant offsets: the compiler schedules them freely)
            jc = lane % MP
            bj = Float32(0.0)
            for t in cutlass.range_constexpr(MP):
                bj = cutlass.select_(jc == t, br[t], bj)
            acc = [Float32(0.0)] * MP
            xcol = []
            for s in cutlass.range_constexpr(MP):
                xs_ = cutlass.select_(jc == s, Float32(1.0), Float32(0.0)) - br[s] * acc[s]
                xcol.append(xs_)
                for t in cutlass.range_constexpr(s + 1, MP):
                    acc[t] = acc[t] + ABm[0, t, s] * xs_
            dcol = [x * bj for x in xcol]
            for t in cutlass.range_constexpr(MP):
                c = Float32(0.0)
                for s in cutlass.range_constexpr(t + 1):
                    c = c + ABm[1, t, s] * dcol[s]
                if lane < MP:
                    Xw[warp, 0, t, jc] = dcol[t]
                    Xw[warp, 1, t, jc] = c
            cute.arch.sync_warp()
            # --- apply: lane = column, tokens warp + NW i; r_s = v_s - U_s (U summed over the warps in order)
            rr_ = []
            for s in cutlass.range_constexpr(MP):
                u = red[0, s, lane]
                for ww in cutlass.range_constexpr(1, NW):
                    u = u + red[ww, s, lane]
                rr_.append(vr[s] - u)
            for i in cutlass.range_constexpr(TOKW):
                t = warp + NW * i
                drow = load_vec(sX, Int32(0) + t * MQ + Int32(warp * 2 * MP * MQ), MP)
                crow = load_vec(sX, Int32(MP * MQ) + t * MQ + Int32(warp * 2 * MP * MQ), MP)
                d = Float32(0.0)
                ot = Float32(0.0)
                for s in cutlass.range_constexpr(MP):
                    d = d + drow[s] * rr_[s]
                    ot = ot + crow[s] * rr_[s]
                wv = red[0, MP + t, lane]
                for ww in cutlass.range_constexpr(1, NW):
                    wv = wv + red[ww, MP + t, lane]
                stg[warp, 0, i, lane] = wv + ot
                stg[warp, 1, i, lane] = d
            cute.arch.sync_warp()
            # --- 16-byte stores: lane = (which, token i, quad): 2 x TOKW x 8 = 32 (TOKW 2) or 64 (TOKW 4) jobs
            for ps in cutlass.range_constexpr((2 * TOKW * 8) // 32):
                e = lane + 32 * ps
                which = e // (TOKW * 8)
                i = (e // 8) % TOKW
                qd = (e % 8) * 4
                t = warp + NW * i
                if t < T:
                    vals = load_vec(sstg, Int32(((warp * 2 + which) * TOKW + i) * BV) + qd, 4)
                    row = (tok0 + t) * HV + hv
                    if which == 0:
                        store_vec(o, row * V + col0 + qd, vals, 4)
                    else:
                        store_vec(buf, row * W + 2 * K + col0 + qd, vals, 4)
        else:
            self._zero_request(o, buf, tok0, hv, HV, col0, vb, tid, warp, lane)
