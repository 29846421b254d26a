"""KDA prefill, stage 2 on Hopper warpgroup MMA (wgmma): the serial state recurrence over the chunks of a segment,
and o.

Work items: (segment, value head, C state columns), C = 128 or 64. The grid is `ctas` persistent CTAs (the host
gives one per SM, or one per item where there are fewer); CTA b walks the items b, b + ctas, b + 2 ctas, ... (value
head fastest, then segment-table row, then column block; where the host knows the lengths it orders the rows
longest first), and its pipeline runs on across them: the last chunk of an item loads the first chunk of the CTA's
next item. Two warpgroups of 128 threads; warpgroup j owns the columns [j C / 2, (j + 1) C / 2) of the item's slice
and runs the recurrence on them alone, the CTA's two warpgroups sharing each chunk's loads. Per chunk of 64 tokens,
with h a warpgroup's fp32 state slice [K = 128, N = C / 2] (registers, wgmma accumulator layout) and the stage-1
intermediates (chunk_intra*.py; bf16):

    v_new = u - w @ h                    [64 x 128] @ [128 x N]
    o     = qg @ h + Aqk @ v_new         (qg carries scale)
    h     = diag(exp(gl)) h + kg^T @ v_new

Products: wgmma m64nNk16, bf16 operands from shared memory, fp32 accumulation. The two that feed the state
(w @ h, kg^T @ v_new) take h and v_new split as hi + lo bf16 pairs (~16 bits: the state does not drift with its
own rounding, and the CP path matches the serial walk closely); the output products take the hi halves (o is bf16;
its rounding does not feed back). Operand tiles (swizzled, the swizzle on the shared-memory pointer as wgmma
descriptors need): w, qg, Aqk K-major (token rows, contiguous along the contraction); kg read as kg^T, M-major;
h and v_new stored [contraction][column], N-major; no operand is transposed through registers.

Pipeline per chunk, per warpgroup: h (split) into shared memory, the stage's mbarrier waited for (in a chunk that
ends before 64 tokens, kg^T's rows past the end zeroed: TMA zero-fills only past the tensor's end, so they hold the
next tokens), a proxy fence and a CTA barrier; w @ h then qg @ h issued as two wgmma groups; while they run, warp 0
issues the next chunk's tiles (TMA into the other stage, freed by the barrier that ended the previous chunk: w, qg,
kg^T, Aqk and each warpgroup's u columns, completion on that stage's mbarrier), so the issue is off the chunk's
critical path and the copies are in flight during the rest of the chunk; once the first group lands, v_new = u -
w @ h (zero on rows past the segment's end) is written over the warpgroup's u tile (hi) and a lo tile, a proxy
fence and a warpgroup barrier; Aqk @ v_new and the decayed update kg^T @ v_new issued, one wait; o goes out
through the u tile in 16-byte rows; a proxy fence (these generic writes before the TMA writes that refill the
stage) and a CTA barrier. Each chunk's log decay is read one chunk ahead.
Shared memory: 2 stages x (w, qg, kg 16 KiB, Aqk 8 KiB, u C / 8 KiB) + h hi / lo C / 2 KiB + v_new lo C / 8 KiB
+ two mbarriers: 224.5 KiB at C = 128, 168.5 KiB at C = 64; one CTA (8 warps) per SM.

Modes (compile time): normal (h0_idx / ht_idx from the segment table, o written) or affine (the CP map pass over
the augmented state [M | c], K + V = 256 columns: the M columns start from the identity with u = 0, the c
columns from zero; no qg, Aqk or o). Segment table `seg` [S, 5] int32: (first token, end token, first global
chunk, h0_idx, ht_idx). States h0 / ht are [rows, HV, K, V] fp32, or [rows, HV, V, K] with `state_v_first` (FLA's
state_v_first layout, indexed as it is: no transposing copy; normal mode only). The final state (or map) leaves
from the accumulator: with K-first storage a thread's fragment holds column pairs (c, c + 1) of a row, one 64-bit
store each (a 32-bit store instruction covered every other word of the sectors it wrote); V-first storage is stored an
element at a time. Assumes K = V = 128 and 16-byte aligned intermediates (TMA's rule too), o and ht (allocated by
forward.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from cula_core.cute_kernels.copies import head_rows, store_rows_s2g
from cula_core.cute_kernels.wgmma import (K_MAJOR, MN_MAJOR, alloc_operand_tile, gemm, operand_tile_layout, rows_view,
                                         store_acc, store_split, tiled_mma)

BT = 64
DK = 128
WARPGROUPS = 2
WG_THREADS = 128


@cute.jit
def _subtract_from(acc: cute.Tensor, s: cute.Tensor):
    """acc = s - acc, with `s` a shared bf16 tile partitioned like `acc` (read through a register fragment)."""
    frag = cute.make_fragment_like(acc, BFloat16)
    cute.autovec_copy(s, frag)
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = frag[i].to(Float32) - acc[i]


class ChunkStateWGKernel:
    """`cols`: state columns per CTA, 128 (each chunk's w, qg, kg, Aqk loaded once for 128 columns) or 64 (twice
    the CTAs, for grids that would not fill the SMs at 128). `state_v_first`: h0 and ht laid out [.., V, K]."""

    def __init__(self, affine: bool, cols: int, state_v_first: bool = False):
        assert cols in (64, 128)
        assert not (affine and state_v_first), "the affine-map pass writes the internal maps buffer, K-first"
        self.affine = affine
        self.state_v_first = state_v_first
        self.cols = cols
        self.wg_cols = cols // WARPGROUPS
        self.threads = WG_THREADS * WARPGROUPS
        self.width = 2 * DK if affine else DK  # columns of an ht row: the state's V, or [M | c]'s K + V
        self.col_blocks = self.width // cols  # column blocks of the state (or of [M | c])

    @cute.jit
    def __call__(self, w_ptr: cute.Pointer, u_ptr: cute.Pointer, qg_ptr: cute.Pointer, kg_ptr: cute.Pointer,
                 aqk_ptr: cute.Pointer, gl_ptr: cute.Pointer, seg_ptr: cute.Pointer, h0_ptr: cute.Pointer,
                 ht_ptr: cute.Pointer, o_ptr: cute.Pointer, TT: Int32, NC: Int32, S: Int32, HV: Int32,
                 NH0: Int32, NHT: Int32, ctas: Int32, stream):
        tok = cute.make_layout((TT, HV, DK), stride=(HV * DK, DK, 1))
        w = cute.make_tensor(w_ptr, tok)
        u = cute.make_tensor(u_ptr, tok)
        qg = cute.make_tensor(qg_ptr, tok)
        kg = cute.make_tensor(kg_ptr, tok)
        o = cute.make_tensor(o_ptr, tok)
        aqk = cute.make_tensor(aqk_ptr, cute.make_layout((TT, HV, BT), stride=(HV * BT, BT, 1)))
        gl = cute.make_tensor(gl_ptr, cute.make_layout((NC, HV, DK), stride=(HV * DK, DK, 1)))
        seg = cute.make_tensor(seg_ptr, cute.make_layout((S, 5), stride=(5, 1)))
        # element (row, head, k, v): v contiguous, or with state_v_first k contiguous ([.., V, K] storage)
        state_kv = (DK, 1)
        if const_expr(self.state_v_first):
            state_kv = (1, DK)
        h0 = cute.make_tensor(h0_ptr, cute.make_layout((NH0, HV, DK, DK), stride=(HV * DK * DK, DK * DK, *state_kv)))
        width = self.width
        ht_kv = state_kv  # the final states, in the layout of the initial ones; the maps buffer is K-first
        if const_expr(self.affine):
            ht_kv = (width, 1)
        ht = cute.make_tensor(ht_ptr, cute.make_layout((NHT, HV, DK, width),
                                                       stride=(HV * DK * width, DK * width, *ht_kv)))
        # TMA views of the intermediates, the tile's two modes first and the head last: token rows (K-major
        # operands w, qg, Aqk) or the columns of each row (kg^T and u, M/N-major)
        rows_k = cute.make_layout((TT, DK, HV), stride=(HV * DK, 1, DK))
        cols_k = cute.make_layout((DK, TT, HV), stride=(1, HV * DK, DK))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_w = cpasync.make_tiled_tma_atom(g2s, cute.make_tensor(w_ptr, rows_k), self.tile_layout("k", BT, DK),
                                            (BT, DK))
        tma_kt = cpasync.make_tiled_tma_atom(g2s, cute.make_tensor(kg_ptr, cols_k), self.tile_layout("mn", DK, BT),
                                             (DK, BT))
        tma_u = cpasync.make_tiled_tma_atom(g2s, cute.make_tensor(u_ptr, cols_k),
                                            self.tile_layout("cols", self.wg_cols, BT), (self.wg_cols, BT))
        tma_qg = tma_w
        tma_a = tma_w
        if const_expr(not self.affine):
            tma_qg = cpasync.make_tiled_tma_atom(g2s, cute.make_tensor(qg_ptr, rows_k),
                                                 self.tile_layout("k", BT, DK), (BT, DK))
            tma_a = cpasync.make_tiled_tma_atom(
                g2s, cute.make_tensor(aqk_ptr, cute.make_layout((TT, BT, HV), stride=(HV * BT, 1, BT))),
                self.tile_layout("k", BT, BT), (BT, BT))
        self.kernel(tma_w[0], tma_w[1], tma_qg[0], tma_qg[1], tma_kt[0], tma_kt[1], tma_a[0], tma_a[1], tma_u[0],
                    tma_u[1], gl, seg, h0, ht, o, S, HV, ctas).launch(
            grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    def tile_layout(self, kind: str, rows: int, cols: int):
        """The shared-memory layout of one (rows, cols) operand tile as alloc_operand_tile lays it out: "k"
        K-major, "mn" M/N-major, "cols" M/N-major over a warpgroup's columns (64-byte swizzle at 32 columns)."""
        kinds = {"k": warpgroup.SmemLayoutAtomKind.K_SW128, "mn": warpgroup.SmemLayoutAtomKind.MN_SW128,
                 "cols": self.mn_cols_kind()}
        return operand_tile_layout(kinds[kind], (rows, cols))

    def mn_cols_kind(self):
        """The swizzle atom of the N-major tiles of one warpgroup's columns: one swizzle row spans them."""
        if const_expr(self.wg_cols == 32):
            return warpgroup.SmemLayoutAtomKind.MN_SW64
        return warpgroup.SmemLayoutAtomKind.MN_SW128

    @cute.kernel
    def kernel(self, atom_w: cute.CopyAtom, w: cute.Tensor, atom_qg: cute.CopyAtom, qg: cute.Tensor,
               atom_kt: cute.CopyAtom, kt: cute.Tensor, atom_a: cute.CopyAtom, aqk: cute.Tensor,
               atom_u: cute.CopyAtom, u: cute.Tensor, gl: cute.Tensor, seg: cute.Tensor, h0: cute.Tensor,
               ht: cute.Tensor, o: cute.Tensor, S: Int32, HV: Int32, ctas: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        wg = tid // WG_THREADS
        wtid = tid % WG_THREADS
        K_SW128 = warpgroup.SmemLayoutAtomKind.K_SW128
        MN_SW128 = warpgroup.SmemLayoutAtomKind.MN_SW128
        MN_COLS = self.mn_cols_kind()

        smem = cutlass.memory.SmemAllocator()
        # per stage, shared by the warpgroups: w, qg (A, K-major), kg^T (A, M-major), Aqk (A, K-major)
        sW2 = alloc_operand_tile(smem, K_SW128, (BT, DK, 2))
        sKt2 = alloc_operand_tile(smem, MN_SW128, (DK, BT, 2))
        sQg2 = sW2
        sA2 = sW2
        if const_expr(not self.affine):
            sQg2 = alloc_operand_tile(smem, K_SW128, (BT, DK, 2))
            sA2 = alloc_operand_tile(smem, K_SW128, (BT, BT, 2))
        # per stage and warpgroup: the u slice, overwritten by v_new's hi half (B, N-major: [token][column])
        sU2 = alloc_operand_tile(smem, MN_COLS, (self.wg_cols, BT, 2, WARPGROUPS))
        # per warpgroup: h hi / lo (B, N-major: [k][column]) and v_new lo
        sHh = alloc_operand_tile(smem, MN_COLS, (self.wg_cols, DK, WARPGROUPS))
        sHl = alloc_operand_tile(smem, MN_COLS, (self.wg_cols, DK, WARPGROUPS))
        sVl = alloc_operand_tile(smem, MN_COLS, (self.wg_cols, BT, WARPGROUPS))
        sDecay = smem.allocate_tensor(Float32, cute.make_layout(DK), 16)
        bars = smem.allocate_array(Int64, 2)  # per stage: its tiles have landed (TMA transaction bytes)
        loader = tid < 32  # warp 0 issues the TMA copies (the DSL elects one lane of the warp for each)
        if tid == 0:
            for i in cutlass.range_constexpr(2):
                cute.arch.mbarrier_init(bars + i, 1)
        if loader:
            cpasync.prefetch_descriptor(atom_w)
            cpasync.prefetch_descriptor(atom_kt)
            cpasync.prefetch_descriptor(atom_u)
            if const_expr(not self.affine):
                cpasync.prefetch_descriptor(atom_qg)
                cpasync.prefetch_descriptor(atom_a)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        tiles = (atom_w, w, atom_qg, qg, atom_kt, kt, atom_a, aqk, atom_u, u, sW2, sKt2, sQg2, sA2, sU2, bars)

        mma_k = tiled_mma(K_MAJOR, MN_MAJOR, self.wg_cols)  # w @ h, qg @ h, Aqk @ v_new
        mma_mn = tiled_mma(MN_MAJOR, MN_MAJOR, self.wg_cols)  # kg^T @ v_new
        thr_k = mma_k.get_slice(wtid)
        thr_mn = mma_mn.get_slice(wtid)
        sHh_w = sHh[None, None, wg]
        sHl_w = sHl[None, None, wg]
        sVl_w = sVl[None, None, wg]
        rW2 = thr_k.make_fragment_A(thr_k.partition_A(sW2))
        rQg2 = thr_k.make_fragment_A(thr_k.partition_A(sQg2))
        rA2 = thr_k.make_fragment_A(thr_k.partition_A(sA2))
        rKt2 = thr_mn.make_fragment_A(thr_mn.partition_A(sKt2))
        rHh = thr_k.make_fragment_B(thr_k.partition_B(sHh_w))
        rHl = thr_k.make_fragment_B(thr_k.partition_B(sHl_w))
        rVl = thr_k.make_fragment_B(thr_k.partition_B(sVl_w))
        # accumulator-shaped (rows, columns) views of the tiles written from registers
        sHh_rows = rows_view(sHh_w, DK, self.wg_cols)
        sHl_rows = rows_view(sHl_w, DK, self.wg_cols)
        sVl_rows = rows_view(sVl_w, BT, self.wg_cols)

        acc_h = cute.make_rmem_tensor(thr_mn.partition_shape_C((DK, self.wg_cols)), Float32)
        at_h = thr_mn.partition_C(cute.make_identity_tensor((DK, self.wg_cols)))
        acc_v = cute.make_rmem_tensor(thr_k.partition_shape_C((BT, self.wg_cols)), Float32)
        at_v = thr_k.partition_C(cute.make_identity_tensor((BT, self.wg_cols)))
        acc_o = cute.make_rmem_tensor(thr_k.partition_shape_C((BT, self.wg_cols)), Float32)

        # Persistent walk: this CTA takes the items cta, cta + ctas, ... (an item: one segment, value head and
        # column block); the first chunk of its next item is loaded while the last chunk of the current one runs.
        items = S * HV * self.col_blocks
        step = Int32(0)  # chunks walked so far by this CTA: chunk `step` sits in stage step % 2
        prefetched = Int32(0)  # the current item's first chunk and its log decay are already in flight
        # the log decay of a chunk's last token is read one chunk ahead: its load never stalls the chunk's math
        gl_next = Float32(0.0)
        for item in cutlass.range(cta, items, ctas, unroll=1):
            s, hv, col0 = self.item_coords(item, S, HV, wg)
            start = seg[s, 0]
            end = seg[s, 1]
            chunk0 = seg[s, 2]
            h0_idx = seg[s, 3]
            ht_idx = seg[s, 4]
            n_chunks = (end - start + BT - 1) // BT
            is_m, ucol0 = self.u_columns(col0)

            # the next item of this CTA, whose first chunk the last chunk of this one loads ahead
            nxt = item + ctas
            nxt_s, nxt_hv, nxt_col0 = self.item_coords(cutlass.min(nxt, items - 1), S, HV, wg)
            nxt_start = seg[nxt_s, 0]
            nxt_end = seg[nxt_s, 1]
            nxt_chunk0 = seg[nxt_s, 2]
            nxt_is_m, nxt_ucol0 = self.u_columns(nxt_col0)
            ahead = Int32(0)
            if nxt < items and nxt_end > nxt_start:
                ahead = Int32(1)

            for i in cutlass.range_constexpr(cute.size(acc_h)):
                kr, c = at_h[i]
                x = Float32(0.0)
                if const_expr(self.affine):
                    if is_m:
                        if kr == col0 + c:
                            x = Float32(1.0)
                else:
                    if h0_idx >= 0:
                        x = h0[h0_idx, hv, kr, col0 + c]
                acc_h[i] = x

            if n_chunks > 0 and prefetched == 0:
                if tid < DK:
                    gl_next = gl[chunk0, hv, tid]
                if loader:
                    self.load_chunk(tiles, start, hv, ucol0, is_m, step % 2, tid)
            for ci in cutlass.range(n_chunks, unroll=1):
                t0 = start + ci * BT
                n = cutlass.min(end - t0, BT)
                st = step % 2
                last = ci + 1 == n_chunks
                if tid < DK:
                    sDecay[tid] = cute.math.exp(gl_next, fastmath=True)
                    if not last:
                        gl_next = gl[chunk0 + ci + 1, hv, tid]
                    elif ahead != 0:
                        gl_next = gl[nxt_chunk0, nxt_hv, tid]
                store_split(mma_mn, acc_h, sHh_rows, sHl_rows, wtid)  # h into this warpgroup's B tiles
                cute.arch.mbarrier_wait(bars + st, (step // 2) % 2)  # chunk ci has landed
                if n < BT:  # kg rows past the segment's end hold the next tokens: zeros (v_new is zero there too)
                    self.zero_rows(rows_view(sKt2[None, None, st], BT, DK), n, tid)
                cute.arch.fence_proxy("async.shared", space="cta")  # generic-proxy writes -> wgmma's operand reads
                cute.arch.sync_threads()

                sU_w = sU2[None, None, st, wg]
                sU_rows = rows_view(sU_w, BT, self.wg_cols)  # u, then v_new's hi half, then o: (token, column)
                rVh = thr_k.make_fragment_B(thr_k.partition_B(sU_w))
                pU = thr_k.partition_C(sU_rows)

                # group 1: v_new's product w @ h (split h); group 2: o's first product qg @ h
                warpgroup.fence()
                gemm(mma_k, acc_v, rW2[None, None, None, st], rHh, False)
                gemm(mma_k, acc_v, rW2[None, None, None, st], rHl, True)
                warpgroup.commit_group()
                if const_expr(not self.affine):
                    gemm(mma_k, acc_o, rQg2[None, None, None, st], rHh, False)
                    warpgroup.commit_group()
                # the next chunk's tiles (of this item, or the next item's first) into the other stage, which the
                # barrier ending the previous chunk freed; issued while the products above run, so that the issue
                # is off the chunk's critical path, and in flight during the rest of this chunk
                if loader:
                    if not last:
                        self.load_chunk(tiles, t0 + BT, hv, ucol0, is_m, 1 - st, tid)
                    elif ahead != 0:
                        self.load_chunk(tiles, nxt_start, nxt_hv, nxt_ucol0, nxt_is_m, 1 - st, tid)
                if const_expr(not self.affine):
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(0)
                if const_expr(self.affine):
                    if is_m:  # u = 0 on the M columns
                        for i in cutlass.range_constexpr(cute.size(acc_v)):
                            acc_v[i] = -acc_v[i]
                    else:
                        _subtract_from(acc_v, pU)
                else:
                    _subtract_from(acc_v, pU)
                if n < BT:  # rows past the segment's end (the next tokens' w and u): v_new = 0 there
                    for i in cutlass.range_constexpr(cute.size(acc_v)):
                        r, _ = at_v[i]
                        if r >= n:
                            acc_v[i] = Float32(0.0)
                store_split(mma_k, acc_v, sU_rows, sVl_rows, wtid)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1 + wg, number_of_threads=WG_THREADS)

                if const_expr(not self.affine):
                    gemm(mma_k, acc_o, rA2[None, None, None, st], rVh, True)
                    warpgroup.commit_group()
                for i in cutlass.range_constexpr(cute.size(acc_h)):
                    kr, _ = at_h[i]
                    acc_h[i] = acc_h[i] * sDecay[kr]
                warpgroup.fence()
                gemm(mma_mn, acc_h, rKt2[None, None, None, st], rVh, True)
                gemm(mma_mn, acc_h, rKt2[None, None, None, st], rVl, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                if const_expr(not self.affine):
                    # o leaves through the (now free) v_new tile in whole 16-byte rows
                    store_acc(mma_k, acc_o, sU_rows, wtid)
                    cute.arch.barrier(barrier_id=1 + wg, number_of_threads=WG_THREADS)
                    store_rows_s2g(sU_rows, head_rows(o, t0, hv, BT, col0, self.wg_cols), n, wtid, WG_THREADS)
                # every access of this stage is done (and the generic writes into its u tile ordered before the
                # TMA writes that come next) before its next tiles are copied in
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()
                step += 1
            prefetched = Int32(0)
            if n_chunks > 0:
                prefetched = ahead

            if ht_idx >= 0:
                if const_expr(self.state_v_first):
                    for i in cutlass.range_constexpr(cute.size(acc_h)):
                        kr, c = at_h[i]
                        ht[ht_idx, hv, kr, col0 + c] = acc_h[i]
                else:
                    # fragment elements 2 p, 2 p + 1 hold columns c, c + 1 of one row: one 64-bit store each
                    pairs = cute.make_rmem_tensor((cute.size(acc_h),), Float32)
                    for i in cutlass.range_constexpr(cute.size(acc_h)):
                        pairs[i] = acc_h[i]
                    width = self.width
                    base = (ht_idx * HV + hv) * (DK * width) + col0  # [rows, HV, K, width], width contiguous
                    for p in cutlass.range_constexpr(cute.size(acc_h) // 2):
                        kr, c = at_h[2 * p]
                        off = cute.assume(base + kr * width + c, divby=2)
                        cute.autovec_copy(cute.local_tile(pairs, (2,), (p,)),
                                          cute.make_tensor(ht.iterator + off, cute.make_layout(2)))

    def item_coords(self, item, S, HV, wg):
        """(segment, value head, this warpgroup's first state column) of an item; the value head varies fastest,
        then the segment, then the column block."""
        hv = item % HV
        rest = item // HV
        return rest % S, hv, (rest // S) * self.cols + wg * self.wg_cols

    def u_columns(self, col0):
        """(whether the warpgroup's columns are the maps' M columns, their first column of u) in affine mode; u's
        columns are the state's otherwise."""
        if const_expr(self.affine):
            return col0 < DK, col0 - DK
        return False, col0

    @cute.jit
    def load_chunk(self, tiles, t0, hv, ucol0, is_m, st, tid):
        """One chunk's tiles into stage `st` by TMA, issued by warp 0, completing on the stage's mbarrier: w,
        kg^T (and qg, Aqk) for the CTA, each warpgroup's u columns (from ucol0, warpgroup 0's first). Rows past
        the tensors' end arrive as zeros; rows past the segment's end carry the next tokens (the caller masks
        them)."""
        atom_w, w, atom_qg, qg, atom_kt, kt, atom_a, aqk, atom_u, u, sW2, sKt2, sQg2, sA2, sU2, bars = tiles
        bar = bars + st
        loads_u = True
        if const_expr(self.affine):
            loads_u = not is_m  # the M columns see u = 0 (values [0 | v] of the augmented state)
        nbytes = Int32(2 * BT * DK * 2)  # w, kg
        if const_expr(not self.affine):
            nbytes += BT * DK * 2 + BT * BT * 2  # qg, Aqk
        if loads_u:
            nbytes += self.cols * BT * 2
        if tid == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, nbytes)
        cute.arch.sync_warp()  # the warp converged: each copy elects one of its lanes
        self.tma_tile(atom_w, w, (t0, 0), hv, sW2[None, None, st], bar)
        self.tma_tile(atom_kt, kt, (0, t0), hv, sKt2[None, None, st], bar)
        if const_expr(not self.affine):
            self.tma_tile(atom_qg, qg, (t0, 0), hv, sQg2[None, None, st], bar)
            self.tma_tile(atom_a, aqk, (t0, 0), hv, sA2[None, None, st], bar)
        if loads_u:
            for j in cutlass.range_constexpr(WARPGROUPS):
                self.tma_tile(atom_u, u, (ucol0 + j * self.wg_cols, t0), hv, sU2[None, None, st, j], bar)

    @cute.jit
    def tma_tile(self, atom, g, origin, hv, s, bar):
        """TMA copy into the shared tile s of the tile of g (a TMA coordinate tensor: the tile's two modes, then
        the head) that starts at `origin` in head hv."""
        gt = cute.local_tile(cute.domain_offset(origin, g[None, None, hv]), cute.product_each(s.shape), (0, 0))
        ts, tg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                       cute.group_modes(gt, 0, 2))
        cute.copy(atom, tg, ts, tma_bar_ptr=bar)

    @cute.jit
    def zero_rows(self, s_rows, n, tid):
        """Zeros into the token rows [n, BT) of a (token, column) view of a shared tile, by the CTA's threads."""
        cols = cute.size(s_rows.shape[1])
        for i in cutlass.range_constexpr(BT * cols // (WG_THREADS * WARPGROUPS)):
            e = i * WG_THREADS * WARPGROUPS + tid
            r = e // cols
            if r >= n:
                s_rows[r, e % cols] = BFloat16(0.0)
