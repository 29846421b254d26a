"""Single-token KDA decode over a state pool, streamed: persistent CTAs, each state slice copied into shared memory
items ahead by the bulk-copy engine (cp.async.bulk, one copy per slice row, completion on an mbarrier per stage),
so the HBM traffic of the next slices overlaps the math of the current one.

Serves `kda_decode` and fused_recurrent_kda's pool decode: T = 1, the state after the token written back into the
request's pool slot (what the recurrent kernel's MODE_FINAL does at T = 1, with the same arguments and fp32 math;
its sums over K run in another order, so results agree to fp32 rounding, not bit for bit).

Work items. Item = (request n, value head hv, block vb of BV value columns), numbered n * HV * NVB + hv * NVB + vb;
CTA b takes items b, b + C, b + 2C, ... (C CTAs, the runtime `ctas`: the host launches as many as fit on the
device at once). A CTA has 32 * NW threads; per item, warp w owns BV / NW columns, lane = kr * VL + vc (VL lanes
along V with CW columns each, KL = 32 / VL lanes along K with RK = K / KL rows each), as in recurrent.py. The rows
of lane kr are G * kr + (r % G) + G * KL * (r // G) for r < RK: G = 1 for [K, V] pools, G = 8 bytes / element for
[V, K] pools. With the padded shared rows below, every shared-memory read of a piece is free of bank conflicts.

Pipeline per item j of a CTA (ST = `stages` slices of shared memory, configs.stream_stages; s = j % ST):
  1. the per-item vectors of item j (q, k L2-normalised and q scaled, exp of the log decay; v and beta): from the
     registers that item j - 1 loaded them into (warps 0, 1, 2 prepare q, k, the gate; every lane its v, beta);
  2. loads of item j + 1's small inputs into those registers; the last warp (the copier) issues the bulk copies
     of item j + ST - 1's state slice into its stage (item j - 1's, freed by the barrier that ended it; its slot
     was read one item earlier still); the slot of item j + ST;
  3. wait on stage s's mbarrier (phase j // ST), one barrier (the vectors); each lane runs the token on its
     RK x CW piece in two passes over shared memory (registers hold accumulators, not the piece):
     u = (D S)^T k and w = (D S)^T q, two butterflies, delta = beta (v - u), o = w + delta (k.q) into its output
     columns; then D S + k delta^T, row group by row group, stored from registers into the slot;
  4. one barrier: stage s and the vectors are free for the next items.
A padded request's stage gets no copy: the copier arrives on its mbarrier without bytes, so the phases of every
stage stay in step with the items.

Shared memory per CTA: ST stages of the slice in the pool's dtype, rows padded by 16 bytes (K rows of BV for [K, V]
pools, BV rows of K for [V, K]; a bulk copy per row keeps the padding), the three K-vectors in fp32 and the ST
mbarriers.

Assumptions (checked on the host in launch.py): inputs contiguous, every pointer 16-byte aligned (a bulk copy's
rule too: a slice row is a multiple of 16 bytes), K % 32 == 0 and slice rows a multiple of 32 (the copier's lanes),
V % BV == 0, the slots of live requests distinct (a slot is read ST - 1 items before the item that writes it runs).
N, HV, HQK, P, scale, lower_bound, null_slot, precomputed_gate, beta_sigmoid and ctas are runtime values (one
compilation serves every batch); cache_idx < 0, >= P or == null_slot marks a padded request: zero output, its slot
neither read nor written.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from cula_sm90.decode._dsl import (activate_beta, gate_values, l2_normalize, load_vec, slot_in_use, store_vec,
                                   store_zeros, thread_coords, xor_sum)
from cula_sm90.decode.configs import CHUNK_BYTES, stream_ctas_per_sm, stream_smem_bytes


class StreamDecode:
    """Compile-time configuration of one streamed decode kernel.

    K, V: head dims; safe_gate / has_A_log / has_dt_bias / l2norm: the gate code (skipped at run time for a
    precomputed log decay); block_v (BV), lanes_v (VL), num_warps (NW): the tiling above; pool_bytes: bytes of a
    pool element (4: fp32, 2: bf16; the pointer's type must match); state_v_first: [V, K] states."""

    def __init__(self, *, K: int, V: int, safe_gate: bool, has_A_log: bool, has_dt_bias: bool, l2norm: bool,
                 block_v: int = 64, lanes_v: int = 4, num_warps: int = 4, pool_bytes: int = 4,
                 state_v_first: bool = False, stages: int = 2):
        if K % 32 or 32 % lanes_v or V % block_v or block_v % (num_warps * lanes_v) or pool_bytes not in (2, 4):
            raise ValueError(f"bad tiling: K={K} V={V} BV={block_v} VL={lanes_v} NW={num_warps} "
                             f"pool_bytes={pool_bytes}")
        if num_warps < 3:  # warps 0, 1 and 2 load an item's q, k and gate inputs (load_small)
            raise ValueError(f"bad tiling: NW={num_warps}, the stream kernel needs at least 3 warps")
        self.K, self.V = K, V
        self.safe_gate, self.has_A_log, self.has_dt_bias, self.l2norm = safe_gate, has_A_log, has_dt_bias, l2norm
        self.BV, self.VL, self.NW = block_v, lanes_v, num_warps
        self.v_first = state_v_first
        self.stages = stages                         # slices in flight per CTA: the current one and stages - 1 ahead
        self.KL = 32 // lanes_v                      # lanes along K
        self.RK = K // self.KL                       # state rows per lane
        self.CW = block_v // (num_warps * lanes_v)   # state columns per lane
        self.NVB = V // block_v                      # items per (request, head)
        self.EPL = K // 32                           # elements per lane of a K-vector
        self.G = 8 // pool_bytes if state_v_first else 1   # consecutive rows of a lane (see the docstring)
        if self.RK % self.G:
            raise ValueError(f"bad tiling: {self.RK} rows per lane, not a multiple of {self.G}")
        self.vec = CHUNK_BYTES // pool_bytes         # elements of a 16-byte chunk: row padding, alignment
        # a stage: rows of the slice as stored in global memory, each padded by one chunk
        self.rows, self.cols = (block_v, K) if state_v_first else (K, block_v)
        self.row_pitch = self.cols + self.vec
        self.stage_elems = self.rows * self.row_pitch
        if self.rows % 32:
            raise ValueError(f"bad tiling: {self.rows} slice rows, not a multiple of the 32 lanes that copy them")
        self.row_bits = self.cols * pool_bytes * 8          # one bulk copy per slice row
        self.slice_bytes = self.rows * self.cols * pool_bytes
        self.smem_bytes = stream_smem_bytes(K, pool_bytes, state_v_first, stages, block_v)
        assert self.smem_bytes == stages * self.stage_elems * pool_bytes + 3 * K * 4 + 8 * stages
        # the launch bound: as many CTAs per SM as the shared memory holds (the host launches that many per SM)
        self.ctas_per_sm = stream_ctas_per_sm(K, pool_bytes, state_v_first, stages, block_v)

    def row_of(self, kr, r: int):
        """State row (K index) of this lane's piece row r."""
        G = self.G
        return G * kr + (r % G) + G * self.KL * (r // G)

    @cute.jit
    def __call__(self, q: cute.Pointer, k: cute.Pointer, v: cute.Pointer, g: cute.Pointer, beta: cute.Pointer,
                 A_log: cute.Pointer, dt_bias: cute.Pointer, pool: cute.Pointer, cache_idx: cute.Pointer,
                 o: cute.Pointer, out: cute.Pointer, N: Int32, HQK: Int32, HV: Int32, P: Int32, scale: Float32,
                 lower_bound: Float32, null_slot: Int32, precomputed_gate: Int32, beta_sigmoid: Int32, ctas: Int32,
                 stream):
        """`out` is never touched (the recurrent kernel's signature); ctas: CTAs launched, at most the items."""
        self.kernel(q, k, v, g, beta, A_log, dt_bias, pool, cache_idx, o, N * HV * self.NVB, HQK, HV, P, scale,
                    lower_bound, null_slot, precomputed_gate, beta_sigmoid, ctas).launch(
            grid=[ctas, 1, 1], block=[32 * self.NW, 1, 1], smem=self.smem_bytes, stream=stream,
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=100)

    def slot_of(self, cache_idx: cute.Pointer, item, HV):
        """The pool slot of an item's request."""
        return cute.make_tensor(cache_idx + Int64(item // (self.NVB * HV)), cute.make_layout(1))[0]

    @cute.kernel
    def kernel(self, q: cute.Pointer, k: cute.Pointer, v: cute.Pointer, g: cute.Pointer, beta: cute.Pointer,
               A_log: cute.Pointer, dt_bias: cute.Pointer, pool: cute.Pointer, cache_idx: cute.Pointer,
               o: cute.Pointer, items: Int32, HQK: Int32, HV: Int32, P: Int32, scale: Float32, lower_bound: Float32,
               null_slot: Int32, precomputed_gate: Int32, beta_sigmoid: Int32, ctas: Int32):
        K, V, RK, CW, EPL, NVB, G = self.K, self.V, self.RK, self.CW, self.EPL, self.NVB, self.G
        tid, warp, lane, kr, vc = thread_coords(self.VL)
        bid = cute.arch.block_idx()[0]
        lcol0 = warp * (self.VL * CW) + vc * CW   # this lane's first column inside the slice
        e0 = lane * EPL                           # this lane's elements of a K-vector (warps 0..2)
        n_items = (items - bid + ctas - 1) // ctas

        smem = cutlass.memory.SmemAllocator()
        stages = smem.allocate_tensor(pool.dtype, cute.make_layout(self.stages * self.stage_elems), byte_alignment=16)
        vecs = smem.allocate_tensor(Float32, cute.make_layout(3 * K), byte_alignment=16)
        bars = smem.allocate_array(Int64, self.stages)   # one mbarrier per stage: its slice has landed
        sst = stages.iterator
        sv = vecs.iterator
        load_atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), pool.dtype, num_bits_per_copy=self.row_bits)
        copier = warp == self.NW - 1   # the warp that issues the slices' bulk copies
        if tid == 0:
            for i in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(bars + i, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # registers that carry an item's small inputs from their loads (one item ahead) to their use
        r_v = cute.make_rmem_tensor(CW, v.dtype)
        r_beta = cute.make_rmem_tensor(1, beta.dtype)
        r_qk = cute.make_rmem_tensor(EPL, q.dtype)      # warp 0: q, warp 1: k
        r_g = cute.make_rmem_tensor(EPL, g.dtype)       # warp 2: raw g (or the log decay)
        r_dtb = cute.make_rmem_tensor(EPL, Float32)     # warp 2: dt_bias
        r_alog = cute.make_rmem_tensor(1, Float32)      # warp 2: A_log
        ST = self.stages
        slots = cute.make_rmem_tensor(ST + 1, Int32)    # slots of items j .. j + ST

        # ---- prologue: item 0's small inputs, the slices of items 0 .. ST - 2, the slot of item ST - 1
        for i in cutlass.range_constexpr(ST):
            slots[i] = Int32(-1)
            if i < n_items:
                slots[i] = self.slot_of(cache_idx, bid + i * ctas, HV)
        self.load_small(bid, q, k, v, g, beta, A_log, dt_bias, HQK, HV, warp, lcol0, e0, r_v, r_beta, r_qk, r_g,
                        r_dtb, r_alog)
        if copier:
            for i in cutlass.range_constexpr(ST - 1):
                if i < n_items:
                    self.load_slice(load_atom, pool, sst, bars, slots[i], P, null_slot, bid + i * ctas, HV, i, lane)

        for j in cutlass.range(n_items):
            item = bid + j * ctas
            head = item // NVB
            vb = item % NVB
            hv = head % HV
            n = head // HV
            # 1. item j's vectors into shared memory / registers
            if warp < 2:
                x = [r_qk[i].to(Float32) for i in range(EPL)]
                if cutlass.const_expr(self.l2norm):
                    x = l2_normalize(x, EPL)
                sc = cutlass.select_(warp == 0, scale, Float32(1.0))   # q is scaled, k is not
                store_vec(sv, warp * K + e0, [xi * sc for xi in x], EPL)
            if warp == 2:
                graw = [r_g[i].to(Float32) for i in range(EPL)]
                if precomputed_gate != 0:   # g is the log decay: dt_bias and A_log are not used
                    store_vec(sv, 2 * K + e0, [cute.math.exp(x) for x in graw], EPL)
                else:
                    gl = gate_values(graw, [r_dtb[i] for i in range(EPL)] if self.has_dt_bias else None,
                                     r_alog[0] if self.has_A_log else None, lower_bound, safe=self.safe_gate)
                    store_vec(sv, 2 * K + e0, [cute.math.exp(x) for x in gl], EPL)
            vr = [r_v[c].to(Float32) for c in range(CW)]
            bt = activate_beta(r_beta[0].to(Float32), beta_sigmoid)
            # 2. item j + 1's small inputs, item j + ST - 1's slice, item j + ST's slot
            if j + 1 < n_items:
                self.load_small(item + ctas, q, k, v, g, beta, A_log, dt_bias, HQK, HV, warp, lcol0, e0, r_v, r_beta,
                                r_qk, r_g, r_dtb, r_alog)
            if copier:
                if j + ST - 1 < n_items:
                    self.load_slice(load_atom, pool, sst, bars, slots[ST - 1], P, null_slot,
                                    item + (ST - 1) * ctas, HV, (j + ST - 1) % ST, lane)
            slots[ST] = Int32(-1)
            if j + ST < n_items:
                slots[ST] = self.slot_of(cache_idx, item + ST * ctas, HV)
            # 3. item j: wait for its slice, run the token
            cute.arch.mbarrier_wait(bars + j % ST, (j // ST) % 2)
            cute.arch.sync_threads()
            slot = slots[0]
            col0 = vb * self.BV + lcol0
            orow = Int64(n) * HV + hv
            if slot_in_use(slot, P, null_slot):
                stage_off = (j % ST) * self.stage_elems
                # pass 1: u = (D S)^T k, w = (D S)^T q over this lane's rows, k.q; butterflies over the K lanes.
                # Rolled loops over row groups: the rows stay in shared memory, the registers hold accumulators.
                acc = cute.make_rmem_tensor(2 * CW + 1, Float32)   # u[c], w[c], k.q
                acc.fill(0.0)
                for rg in cutlass.range(RK // G, unroll=2):
                    rows = self.read_rows(sst, stage_off, kr, lcol0, rg)
                    for i in cutlass.range_constexpr(G):
                        row = self.row_of(kr, rg * G + i)
                        qr, kr_, dr = vecs[row], vecs[K + row], vecs[2 * K + row]
                        acc[2 * CW] = acc[2 * CW] + qr * kr_
                        for c in cutlass.range_constexpr(CW):
                            s1 = rows[i][c] * dr
                            acc[c] = acc[c] + s1 * kr_
                            acc[CW + c] = acc[CW + c] + s1 * qr
                us = [acc[c] for c in range(CW)]
                ws = [acc[CW + c] for c in range(CW)]
                kq = acc[2 * CW]
                kq = xor_sum(kq, self.VL)
                us = [xor_sum(u, self.VL) for u in us]
                ws = [xor_sum(w, self.VL) for w in ws]
                delta = [bt * (vr[c] - us[c]) for c in range(CW)]
                if kr == 0:
                    store_vec(o, orow * V + col0, [ws[c] + delta[c] * kq for c in range(CW)], CW)
                # pass 2: the updated state D S + k delta^T, row group by row group, into the slot
                state_off = (Int64(slot) * HV + hv) * (K * V)
                for rg in cutlass.range(RK // G, unroll=2):
                    rows = self.read_rows(sst, stage_off, kr, lcol0, rg)
                    new_rows = []
                    for i in cutlass.range_constexpr(G):
                        row = self.row_of(kr, rg * G + i)
                        kr_, dr = vecs[K + row], vecs[2 * K + row]
                        new_rows.append([rows[i][c] * dr + kr_ * delta[c] for c in range(CW)])
                    self.store_rows(pool, state_off, new_rows, kr, col0, rg)
            else:
                if kr == 0:
                    store_zeros(o, orow * V + col0, CW)
            # 4. stage j % ST and the vectors are free for the next items
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr(ST):
                slots[i] = slots[i + 1]

    @cute.jit
    def load_small(self, item, q, k, v, g, beta, A_log, dt_bias, HQK, HV, warp, lcol0, e0, r_v, r_beta, r_qk, r_g,
                   r_dtb, r_alog):
        """Issue the loads of an item's small inputs into the carrying registers (no wait: the values are read one
        item later)."""
        K, V = self.K, self.V
        head = item // self.NVB
        vb = item % self.NVB
        hv = head % HV
        n = head // HV
        h = hv // (HV // HQK)
        row = Int64(n) * HV + hv
        voff = cute.assume(row * V + vb * self.BV + lcol0, divby=self.CW)
        cute.autovec_copy(cute.make_tensor(v + voff, cute.make_layout(self.CW)), r_v)
        cute.autovec_copy(cute.make_tensor(beta + row, cute.make_layout(1)), r_beta)
        qk_off = cute.assume((Int64(n) * HQK + h) * K + e0, divby=self.EPL)
        if warp == 0:
            cute.autovec_copy(cute.make_tensor(q + qk_off, cute.make_layout(self.EPL)), r_qk)
        if warp == 1:
            cute.autovec_copy(cute.make_tensor(k + qk_off, cute.make_layout(self.EPL)), r_qk)
        if warp == 2:
            goff = cute.assume(row * K + e0, divby=self.EPL)
            cute.autovec_copy(cute.make_tensor(g + goff, cute.make_layout(self.EPL)), r_g)
            if cutlass.const_expr(self.has_dt_bias):
                doff = cute.assume(Int64(hv) * K + e0, divby=self.EPL)
                cute.autovec_copy(cute.make_tensor(dt_bias + doff, cute.make_layout(self.EPL)), r_dtb)
            if cutlass.const_expr(self.has_A_log):
                cute.autovec_copy(cute.make_tensor(A_log + Int64(hv), cute.make_layout(1)), r_alog)

    @cute.jit
    def load_slice(self, atom, pool: cute.Pointer, sst: cute.Pointer, bars: cute.Pointer, slot, P, null_slot, item,
                   HV, stage, lane):
        """Bulk copies of an item's state slice (the pool rows it reads) into shared stage `stage`, one per row
        (`cols` elements; lane l copies rows l, l + 32, ...), issued by the copier warp's lanes; the stage's mbarrier
        completes when every byte has landed (at once for a padded request, whose slot is never read)."""
        K, V = self.K, self.V
        in_use = slot_in_use(slot, P, null_slot)
        if lane == 0:
            if in_use:
                cute.arch.mbarrier_arrive_and_expect_tx(bars + stage, self.slice_bytes)
            else:
                cute.arch.mbarrier_arrive(bars + stage)
        if in_use:
            head = item // self.NVB
            vb = item % self.NVB
            hv = head % HV
            base = (Int64(slot) * HV + hv) * (K * V)
            layout = cute.make_layout(self.cols)
            for i in cutlass.range_constexpr(self.rows // 32):
                r = lane + 32 * i
                goff = base + (Int64(r) * V + vb * self.BV)   # slice row r = state row r: BV elements
                if cutlass.const_expr(self.v_first):          # slice row r = value column vb BV + r: K elements
                    goff = base + Int64(vb * self.BV + r) * K
                soff = cute.assume(stage * self.stage_elems + r * self.row_pitch, divby=self.vec)
                cute.copy(atom, cute.make_tensor(pool + cute.assume(goff, divby=self.vec), layout),
                          cute.make_tensor(sst + soff, layout), mbar_ptr=bars + stage)

    def read_rows(self, sst: cute.Pointer, stage_off, kr, lcol0, rg):
        """Rows rg G .. rg G + G - 1 of this lane's piece (state rows row_of(kr, .), columns lcol0 .. lcol0 + CW - 1
        of the slice) from the stage at element offset stage_off, as fp32 [G][CW]."""
        CW, G = self.CW, self.G
        if self.v_first:   # stage row = value column: the G state rows are consecutive there
            by_col = [load_vec(sst, cute.assume(stage_off + (lcol0 + c) * self.row_pitch + self.row_of(kr, rg * G),
                                                divby=G), G) for c in range(CW)]
            return [[by_col[c][i] for c in range(CW)] for i in range(G)]
        return [load_vec(sst, cute.assume(stage_off + self.row_of(kr, rg) * self.row_pitch + lcol0, divby=CW), CW)]

    def store_rows(self, pool: cute.Pointer, state_off: Int64, rows, kr, col0, rg):
        """Inverse of read_rows into the state at element offset state_off of the pool (columns col0 ..), rounded to
        the pool's dtype."""
        CW, G, K, V = self.CW, self.G, self.K, self.V
        if self.v_first:
            for c in range(CW):
                off = cute.assume(state_off + (Int64(col0 + c) * K + self.row_of(kr, rg * G)), divby=G)
                store_vec(pool, off, [rows[i][c] for i in range(G)], G)
        else:
            off = cute.assume(state_off + (Int64(self.row_of(kr, rg)) * V + col0), divby=CW)
            store_vec(pool, off, rows[0], CW)
