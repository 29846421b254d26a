"""KVBuffer verify in chunk form: the T <= 16 draft tokens of a request as one chunk, so that the work on the
state is two products with S_0 for all tokens at once instead of a serial recurrence (the time stays nearly
flat in T). Serves `kda_decode_mtp_kvbuffer`: outputs and the KVBuffer [k_t | G_t | delta_t] (layout:
cula_core.ops.kvbuffer), the pool untouched.

Math (one request, one value head; G_t = sum_{s<=t} g_s, q scaled, q/k L2-normalised):
    Kt = k_t * exp(G_t), Qt = q_t * exp(G_t)                       (rows of a [2 MP, K] tile, MP = 8 or 16)
    U = Kt S_0, W = Qt S_0                                          (the products with the fp32 state)
    A_ts = sum_r k_t k_s exp(G_t - G_s)  (s < t),  B_ts = sum_r q_t k_s exp(G_t - G_s)  (s <= t)
    delta_t = beta_t (v_t - U_t - sum_{s<t} A_ts delta_s)          (forward substitution, T x T)
    o_t = W_t + sum_{s<=t} B_ts delta_s
which is the recurrence's u_t = (D_t S_{t-1})^T k_t and o_t = S_t^T q_t unrolled (exp(G_t - G_s) <= 1: no
overflow). Two ways to form U and W, chosen at compile time:
  * `tensor_cores=True`: mma.sync m16n8k8 with TF32 operands split hi + lo (3xTF32: hi*hi + hi*lo + lo*hi,
    ~22 mantissa bits, so the results match the recurrent kernel to fp32 rounding, not to TF32's);
  * `tensor_cores=False` (token-parallel SIMT): fp32 FMAs, the T tokens independent of each other.

Tiling. One CTA = one (request, value head, block of BV = 32 value columns), 4 warps split K (split-K: warp w
owns state rows [w K/4, (w + 1) K/4)); each warp computes partial U, W for all 32 columns, the CTA sums the four
partials through shared memory in a fixed order (deterministic). A thread holds 4 consecutive columns of its
rows (16-byte state loads). Tensor cores: the MMA's 8 B-columns of n-tile j are the CTA columns 4 n + j, so
that a thread's B fragments of the 4 n-tiles are one 16-byte row piece, and its D fragments land as 16-byte
row pieces in shared memory. SIMT: lane = kr * 8 + vc: 4 columns 4 vc.., K/16 rows per lane, butterfly over kr.

Pipeline. State loads issued first; the per-token vectors (log gate: g itself when precomputed, else the gate from
raw g; q, k normalised) into shared memory, warp w taking tokens w, w + 4, ... with all its global loads of q, k, g
issued before any of the math (barrier); G, the Kt / Qt tile and the buffer's k_t, G_t rows, a thread per K row
(barrier); the T(T+1)/2 pair sums A, B (lane = pair, warp = its K-slice, no shuffles; partial sums per warp) and the
products U, W into shared memory (barrier); warp 0 solves the 32 columns (a lane per column: the T x T
substitution, the warps' partials added in warp order) and writes o and delta. Shared-memory rows are padded to
K + 4 floats (conflict-free column reads).

Assumptions (checked on the host in launch.py): inputs contiguous and 16-byte aligned, K in (64, 128), V % 32 == 0,
T <= 16; N, HV, HQK, P, scale, lower_bound and null_slot runtime values, and so are precomputed_gate and
beta_sigmoid (the recurrent kernel's: g is the log decay itself; beta activated; the same for the whole grid);
cache_idx < 0, >= P or == null_slot: zeros, the pool not read. The pool: fp32 or bf16 (the pointer's type), [K, V]
or (compile time) V-first [V, K] per state, whose 4-column row pieces are then 4 scalar loads. exp(G_t) of the
cumulative log gate must be finite in fp32 (G_t <= 88): always so for decays <= 1 (the configs.py predicates keep
the safe gate's lower_bound <= 0; a precomputed g is taken as given).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from cula_sm90.decode._dsl import (activate_beta, gate_from_raw, l2_normalize, load_state_row, load_vec, mma_tf32,
                                   slot_in_use, state_piece_offset, store_vec, store_zeros, tf32_split, xor_sum)


class ChunkVerify:
    """Compile-time configuration: T, K, V, the gate code (as RecurrentDecode) and `tensor_cores` (3xTF32 MMA
    products, else SIMT)."""

    BV = 32   # value columns per CTA
    NW = 4    # warps: split K four ways

    def __init__(self, *, T: int, K: int, V: int, safe_gate: bool, has_A_log: bool, has_dt_bias: bool, l2norm: bool,
                 tensor_cores: bool, state_v_first: bool = False):
        if K % (8 * self.NW) or V % self.BV or not 1 <= T <= 16:
            raise ValueError(f"bad shape for the chunk verify: T={T} K={K} V={V}")
        self.T, self.K, self.V = T, K, V
        self.safe_gate, self.has_A_log, self.has_dt_bias, self.l2norm = safe_gate, has_A_log, has_dt_bias, l2norm
        self.tc = tensor_cores
        self.v_first = state_v_first  # pool layout [V, K] per state (row pieces then gathered); dtype: the pointer's
        self.KW = K // self.NW          # state rows per warp
        self.KS = self.KW // 8          # MMA k-steps per warp
        self.RS = self.KW // 4          # SIMT: state rows per lane (4 lanes along K)
        self.MP = 8 if T <= 8 else 16   # token rows of each of the Kt and Qt blocks (padded)
        self.MT = 2 * self.MP // 16     # MMA m-tiles
        self.KP = K + 4                 # row stride of the Kt / Qt tile: conflict-free fragment reads
        self.EPL = K // 32
        self.rows_per_thread = (K + 32 * self.NW - 1) // (32 * self.NW)
        self.NVB = V // self.BV
        self.TPW = (T + self.NW - 1) // self.NW   # tokens per warp in the prologue
        self.TP = self.TPW * self.NW              # token rows of the per-token vectors (rows >= T: scratch)
        self.NPAIR = T * (T + 1) // 2              # (t, s) pairs with s <= t
        self.NPP = (self.NPAIR + 31) // 32 * 32    # pair slots: one lane per pair, whole passes of 32
        f = (3 * self.TP * self.KP + T * self.KP + 2 * self.MP * self.KP + self.NW * 2 * self.NPP
             + self.NW * 2 * self.MP * self.BV)
        self.smem_bytes = 4 * f + 64

    @cute.jit
    def __call__(self, q: cute.Pointer, k: cute.Pointer, v: cute.Pointer, g: cute.Pointer, beta: cute.Pointer,
                 A_log: cute.Pointer, dt_bias: cute.Pointer, pool: cute.Pointer, cache_idx: cute.Pointer,
                 o: cute.Pointer, buf: cute.Pointer, N: Int32, HQK: Int32, HV: Int32, P: Int32, scale: Float32,
                 lower_bound: Float32, null_slot: Int32, precomputed_gate: Int32, beta_sigmoid: Int32, stream):
        self.kernel(q, k, v, g, beta, A_log, dt_bias, pool, cache_idx, o, buf, HQK, HV, P, scale, lower_bound,
                    null_slot, precomputed_gate, beta_sigmoid).launch(grid=[N * HV * self.NVB, 1, 1],
                                                                      block=[32 * self.NW, 1, 1],
                                                                      smem=self.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, q: cute.Pointer, k: cute.Pointer, v: cute.Pointer, g: cute.Pointer, beta: cute.Pointer,
               A_log: cute.Pointer, dt_bias: cute.Pointer, pool: cute.Pointer, cache_idx: cute.Pointer,
               o: cute.Pointer, buf: cute.Pointer, HQK: Int32, HV: Int32, P: Int32, scale: Float32,
               lower_bound: Float32, null_slot: Int32, precomputed_gate: Int32, beta_sigmoid: Int32):
        T, K, V, MP, KP, BV, NW = self.T, self.K, self.V, self.MP, self.KP, self.BV, self.NW
        W = 2 * K + V
        tid, warp, lane, vb, hv, h, col0, kbase, idx, live, tok0 = self._coords(cache_idx, HQK, HV, P, null_slot)

        smem = cutlass.memory.SmemAllocator()
        # rows padded to KP = K + 4 floats: lanes reading row t at the same column hit distinct banks
        TP, NPP = self.TP, self.NPP
        vecs = smem.allocate_tensor(Float32, cute.make_layout((3, TP, KP), stride=(TP * KP, KP, 1)),
                                    byte_alignment=16)
        Gs = smem.allocate_tensor(Float32, cute.make_layout((T, KP), stride=(KP, 1)), byte_alignment=16)
        At = smem.allocate_tensor(Float32, cute.make_layout((2 * MP, KP), stride=(KP, 1)), byte_alignment=16)
        # per-warp partial pair sums (over the warp's K-slice): [warp][A or B][pair slot]
        ABp = smem.allocate_tensor(Float32, cute.make_layout((NW, 2, NPP), stride=(2 * NPP, NPP, 1)),
                                   byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout((NW, 2 * MP, BV), stride=(2 * MP * BV, BV, 1)),
                                   byte_alignment=16)
        sv, sA, sred = vecs.iterator, At.iterator, red.iterator
        if live:
            # --- state rows of this thread first (the long-latency traffic), 16-byte pieces
            slot_head = Int64(idx) * HV + hv
            S = []
            if cutlass.const_expr(self.tc):
                S = self._state_tc(pool, slot_head, col0, lane, kbase)
            else:
                kr = lane // 8
                c4 = (lane % 8) * 4
                for i in cutlass.range_constexpr(self.RS):
                    r = kbase + kr * self.RS + i
                    S.append(load_state_row(pool, state_piece_offset(slot_head, r, col0 + c4, K, V, self.v_first), 4,
                                            K, self.v_first))
            # v and beta for the solve (warp 0 uses them: lane = column; the other warps' copies hit L1)
            vr = [cute.make_tensor(v + (((tok0 + t) * HV + hv) * V + col0 + lane), cute.make_layout(1))
                  .load().to(Float32)[0] for t in range(T)]
            br = [activate_beta(cute.make_tensor(beta + ((tok0 + t) * HV + hv), cute.make_layout(1)).load()
                                .to(Float32)[0], beta_sigmoid) for t in range(T)]
            # per-token vectors into shared memory [3][TP][KP]: the log gate (row 2), then q and k (rows 0, 1)
            xs = self._token_loads(q, k, g, tok0, h, hv, HQK, HV, warp, lane)
            e0 = lane * self.EPL
            if precomputed_gate != 0:   # g is the log decay: A_log and dt_bias are not read
                for i in cutlass.range_constexpr(self.TPW):
                    store_vec(sv, (2 * TP + xs[i][0]) * KP + e0, xs[i][3], self.EPL)
            else:
                for i in cutlass.range_constexpr(self.TPW):
                    store_vec(sv, (2 * TP + xs[i][0]) * KP + e0, gate_from_raw(
                        xs[i][3], A_log, dt_bias, hv, e0, K, lower_bound, has_A_log=self.has_A_log,
                        has_dt_bias=self.has_dt_bias, safe=self.safe_gate), self.EPL)
            self._store_qk(sv, TP, xs, lane, scale)
            cute.arch.sync_threads()   # live is CTA-uniform: every thread reaches the barriers
            # --- G (cumulative log gate), the Kt / Qt tile (zero rows as padding), the buffer's k_t and G_t
            for rr in cutlass.range_constexpr(self.rows_per_thread):
                r = tid + rr * 32 * self.NW
                if r < K:
                    G = Float32(0.0)
                    for t in cutlass.range_constexpr(T):
                        G = G + vecs[2, t, r]
                        Gs[t, r] = G
                        e = cute.math.exp(G)
                        At[t, r] = vecs[1, t, r] * e
                        At[MP + t, r] = vecs[0, t, r] * e
                        if vb == 0:
                            row = ((tok0 + t) * HV + hv) * W
                            cute.make_tensor(buf + (row + r), cute.make_layout(1))[0] = vecs[1, t, r]
                            cute.make_tensor(buf + (row + K + r), cute.make_layout(1))[0] = G
                    for t in cutlass.range_constexpr(T, MP):
                        At[t, r] = Float32(0.0)
                        At[MP + t, r] = Float32(0.0)
            cute.arch.sync_threads()
            self._pair_sums(Gs, vecs, ABp, warp, lane, kbase)
            # --- U = Kt S_0 and W = Qt S_0: this warp's K-slice, partial sums into red[warp]
            if cutlass.const_expr(self.tc):
                self._products_tc(S, sA, sred, warp, lane, kbase)
            else:
                self._products_simt(S, sA, sred, warp, lane, kbase)
            cute.arch.sync_threads()
            # --- the solve: warp 0, lane = column
            if warp == 0:
                dl = []
                for t in cutlass.range_constexpr(T):
                    u = red[0, t, lane]
                    w = red[0, MP + t, lane]
                    for ww in cutlass.range_constexpr(1, NW):
                        u = u + red[ww, t, lane]
                        w = w + red[ww, MP + t, lane]
                    x = vr[t] - u
                    for s in cutlass.range_constexpr(t):
                        x = x - self._pair_sum(ABp, 0, t, s) * dl[s]
                    d = br[t] * x
                    dl.append(d)
                    ot = w
                    for s in cutlass.range_constexpr(t + 1):
                        ot = ot + self._pair_sum(ABp, 1, t, s) * dl[s]
                    row = (tok0 + t) * HV + hv
                    store_vec(o, row * V + col0 + lane, [ot], 1)
                    cute.make_tensor(buf + (row * W + 2 * K + col0 + lane), cute.make_layout(1))[0] = d
        else:
            self._zero_request(o, buf, tok0, hv, HV, col0, vb, tid, warp, lane)

    # ------------------------------------------------------------ the kernel's phases, one method each

    def _coords(self, cache_idx, HQK, HV, P, null_slot):
        """Who this thread is: (tid, warp, lane, value block, value head, q/k head (GVA), first column, first
        state row of the warp's K-slice, the request's pool slot, whether it is live, its first token row)."""
        tid = cute.arch.thread_idx()[0]
        warp = tid // 32
        lane = tid % 32
        bid = cute.arch.block_idx()[0]
        vb = bid % self.NVB
        head = bid // self.NVB
        hv = head % HV
        n = head // HV
        h = hv // (HV // HQK)
        col0 = vb * self.BV
        kbase = warp * self.KW
        idx = cute.make_tensor(cache_idx + Int64(n), cute.make_layout(1))[0]
        live = slot_in_use(idx, P, null_slot)
        return tid, warp, lane, vb, hv, h, col0, kbase, idx, live, Int64(n) * self.T

    def _state_tc(self, pool, slot_head, col0, lane, kbase):
        """This thread's state rows in the MMA's B-fragment layout (_products_tc): for k-step s, rows
        s 8 + lane % 4 (+ 4) of the warp's slice, CTA columns 4 (lane / 4) .. + 3 (one 16-byte load each)."""
        S = []
        c4 = (lane // 4) * 4
        for s in range(self.KS):
            for half in range(2):
                r = kbase + s * 8 + lane % 4 + half * 4
                off = state_piece_offset(slot_head, r, col0 + c4, self.K, self.V, self.v_first)
                S.append(load_state_row(pool, off, 4, self.K, self.v_first))
        return S

    def _token_loads(self, q, k, g, tok0, h, hv, HQK, HV, warp, lane):
        """This lane's elements of q, k and raw g of each of the warp's tokens, [(t, q, k, g)]: warp w takes tokens
        w, w + NW, ...; every load is issued before any of the math (no branch between them: a token past T loads
        token T - 1 again, and its vectors go to a scratch row t >= T)."""
        T, K, EPL, NW = self.T, self.K, self.EPL, self.NW
        e0 = lane * EPL
        xs = []
        for i in range(self.TPW):
            tc = cutlass.select_(warp + NW * i < T, warp + NW * i, Int32(T - 1))
            xs.append((warp + NW * i, load_vec(q, ((tok0 + tc) * HQK + h) * K + e0, EPL),
                       load_vec(k, ((tok0 + tc) * HQK + h) * K + e0, EPL),
                       load_vec(g, ((tok0 + tc) * HV + hv) * K + e0, EPL)))
        return xs

    def _store_qk(self, sv, rows: int, xs, lane, scale):
        """Rows 0 and 1 of the per-token vectors [3][rows][KP]: q (normalised, scaled) and k (normalised) of the
        tokens of `xs` (_token_loads)."""
        KP, EPL = self.KP, self.EPL
        e0 = lane * EPL
        for t, xq, xk, _ in xs:
            if self.l2norm:
                xq = l2_normalize(xq, EPL)
                xk = l2_normalize(xk, EPL)
            store_vec(sv, (0 * rows + t) * KP + e0, [x * scale for x in xq], EPL)
            store_vec(sv, (1 * rows + t) * KP + e0, xk, EPL)

    def _pair_sums(self, Gs, vecs, ABp, warp, lane, kbase):
        """Pair sums A_ts (s < t) and B_ts (s <= t): lane = pair, warp = its K-slice (the products' split),
        partial sums into ABp[warp]; no shuffles, one pass of 32 pairs per 32 lanes."""
        for ps in range(self.NPP // 32):
            pt = Int32(0)
            pss = Int32(0)
            for pp in range(32 * ps, min(32 * ps + 32, self.NPAIR)):
                tt, ss = self._pair(pp)
                pt = cutlass.select_(lane == pp - 32 * ps, Int32(tt), pt)
                pss = cutlass.select_(lane == pp - 32 * ps, Int32(ss), pss)
            a = Float32(0.0)
            b = Float32(0.0)
            for j in range(self.KW):
                r = kbase + j
                d = cute.math.exp(Gs[pt, r] - Gs[pss, r]) * vecs[1, pss, r]
                a = a + d * vecs[1, pt, r]
                b = b + d * vecs[0, pt, r]
            ABp[warp, 0, 32 * ps + lane] = a
            ABp[warp, 1, 32 * ps + lane] = b

    @cute.jit
    def _zero_request(self, o, buf, tok0, hv, HV, col0, vb, tid, warp, lane):
        """A padded / out-of-range request: zero outputs and buffer rows, the pool not touched."""
        T, K, V = self.T, self.K, self.V
        W = 2 * K + V
        if warp == 0:
            for t in cutlass.range_constexpr(T):
                row = (tok0 + t) * HV + hv
                store_zeros(o, row * V + col0 + lane, 1)
                store_zeros(buf, row * W + 2 * K + col0 + lane, 1)
        if vb == 0:
            for rr in cutlass.range_constexpr(self.rows_per_thread):
                r = tid + rr * 32 * self.NW
                if r < K:
                    for t in cutlass.range_constexpr(T):
                        row = ((tok0 + t) * HV + hv) * W
                        store_zeros(buf, row + r, 1)
                        store_zeros(buf, row + K + r, 1)

    def _pair_sum(self, ABp, which: int, t: int, s: int):
        """A_ts (which = 0) or B_ts (1): the warps' partial sums added in warp order (deterministic)."""
        p = t * (t + 1) // 2 + s
        x = ABp[0, which, p]
        for w in range(1, self.NW):
            x = x + ABp[w, which, p]
        return x

    @staticmethod
    def _pair(p: int) -> tuple[int, int]:
        """The p-th (t, s) pair with s <= t, row by row."""
        t = 0
        while p > t:
            p -= t + 1
            t += 1
        return t, p

    @cute.jit
    def _products_simt(self, S, sA, sred, warp, lane, kbase):
        """fp32 FMAs: lane (kr, vc) sums its RS rows for its 4 columns, a butterfly over the 4 kr lanes."""
        RS, MP, KP, BV = self.RS, self.MP, self.KP, self.BV
        kr = lane // 8
        c4 = (lane % 8) * 4
        r0 = kbase + kr * RS
        for t in cutlass.range_constexpr(self.T):
            for blk in cutlass.range_constexpr(2):          # Kt rows (U), then Qt rows (W)
                m = blk * MP + t
                a = load_vec(sA, Int32(m * KP) + r0, RS)
                acc = []
                for c in cutlass.range_constexpr(4):
                    x = Float32(0.0)
                    for i in cutlass.range_constexpr(RS):
                        x = x + a[i] * S[i][c]
                    acc.append(xor_sum(x, 8))
                if kr == 0:
                    store_vec(sred, (warp * (2 * MP) + m) * BV + c4, acc, 4)

    @cute.jit
    def _products_tc(self, S, sA, sred, warp, lane, kbase):
        """3xTF32 mma.sync m16n8k8: A = the Kt / Qt tile (m-tile mt, k-step s of this warp's slice) from shared
        memory, B = the state held in registers (row pair s: S[2 s], S[2 s + 1]; column 4 (lane / 4) + j of
        n-tile j), fp32 accumulators; D written back as 16-byte row pieces."""
        MP, KP, BV, KS = self.MP, self.KP, self.BV, self.KS
        gr = lane // 4
        t4 = lane % 4
        # B operands, split once: bsp[s][j] = ((hi0, lo0), (hi1, lo1)) for rows t4 and t4 + 4 of k-step s
        bsp = [[(tf32_split(S[2 * s][j]), tf32_split(S[2 * s + 1][j])) for j in range(4)] for s in range(KS)]
        for mt in cutlass.range_constexpr(self.MT):
            acc = [[Float32(0.0) for _ in range(4)] for _ in range(4)]
            for s in cutlass.range_constexpr(KS):
                kc = kbase + s * 8 + t4
                base0 = Int32((mt * 16 + gr) * KP) + kc
                base1 = Int32((mt * 16 + gr + 8) * KP) + kc
                av = [cute.make_tensor(sA + off, cute.make_layout(1))[0]
                      for off in (base0, base1, base0 + 4, base1 + 4)]
                asp = [tf32_split(x) for x in av]
                a_hi = [x[0] for x in asp]
                a_lo = [x[1] for x in asp]
                for j in cutlass.range_constexpr(4):
                    (b0h, b0l), (b1h, b1l) = bsp[s][j]
                    d = mma_tf32(a_lo, [b0h, b1h], acc[j])
                    d = mma_tf32(a_hi, [b0l, b1l], d)
                    acc[j] = mma_tf32(a_hi, [b0h, b1h], d)
            # d0, d1: row gr, mma columns 2 t4, 2 t4 + 1 -> CTA columns 8 t4 + j, 8 t4 + 4 + j; d2, d3: row gr + 8
            for hf in cutlass.range_constexpr(2):
                m = mt * 16 + gr + hf * 8
                for i in cutlass.range_constexpr(2):
                    store_vec(sred, (warp * (2 * MP) + m) * BV + 8 * t4 + 4 * i,
                              [acc[j][2 * hf + i] for j in range(4)], 4)
