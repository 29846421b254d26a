"""KDA prefill, stage 1 of 2, tensor-core version over packed tiles: chunk_intra_tc.py's kernel (the safe gate,
inference: no Akk output) where one CTA processes a tile of 64 rows holding the valid rows of one or more chunks.

Why: a batch of many short sequences ends every sequence in a partial chunk, and chunk_intra_tc.py costs the same
per chunk whatever its length. Here the partial chunks of a batch share tiles: a piece is a chunk's valid rows
rounded up to whole 16-row blocks (1 - 4 blocks); full chunks keep a tile each; forward.py packs the partial
pieces into tiles by first-fit decreasing on the host (forward.packed_tiles) when that saves enough CTAs
(forward.packing_pays).

Tile table (int32 [tiles, 4, 5], forward.tile_table): per tile and 16-row block m, (first token of the block's
rows, valid rows in the block (0: the block holds nothing), global chunk index of its piece, first block and last
block of its piece in the tile). A piece's blocks are contiguous and in chunk order; a piece never crosses a tile.

Everything is chunk_intra_tc.py's device code (ChunkIntraTCKernel.tile / head), with the hooks that say where the
rows live overridden; per piece it computes exactly what that kernel computes for the piece's chunk:
  - the gate's cumulative sum restarts at each piece's first block (scan_adds); the block boundaries are the
    piece's: the start boundary of a piece's first block is 0 (start_ref, continues_chunk), G_last is its last
    block's end (last_ref, written as its chunk's gl row by the piece's first block: write_gl);
  - score blocks (p, c) exist only within a piece (pair_ok); the inverse is block-diagonal by piece: column_chain
    runs column block c down to its piece's last block (chain_ok), Akk's blocks across pieces are zeros
    (zero_akk), and each row block's w, u product sums over its piece's blocks only (first_contraction_block), so
    no row of another piece enters, not even times zero (a NaN there would pass through);
  - every row is loaded from and stored to its own token (load_rows, out_rows, row_token), Aqk's columns are
    positions in the piece's chunk (chunk_col); rows past a piece's valid rows load as zeros and are never written.
So stage 2 reads w, u, qg, kg, Aqk and gl exactly as chunk_intra_tc.py leaves them.

Launch (common.Stage1Launch's arguments): `cu` is the tile table, `NC` the number of tiles (grid x = tiles * G);
`co`, `N` and `search_steps` are not read. gl's rows are indexed by the table's chunk indices. Shared memory:
chunk_intra_tc.py's plus the block table (80 bytes); assumptions as there.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cula_core.cute_kernels.copies import copy_rows_g2s, head_rows
from cula_sm90.prefill import common
from cula_sm90.prefill.chunk_intra_tc import BC, BT, DK, LN2, ChunkIntraTCKernel

BLOCKS = BT // BC
FIELDS = 5  # per block of the tile table
TOK, NV, CHUNK, FIRST, LAST = range(FIELDS)


class ChunkIntraTCPackedKernel(ChunkIntraTCKernel):
    """chunk_intra_tc.py's kernel over the tiles of a tile table (inference only: no store_akk)."""

    store_akk = False

    @cute.jit
    def launch_tables(self, cu_ptr: cute.Pointer, co_ptr: cute.Pointer, N: Int32, NC: Int32):
        # `cu` carries the tile table, NC tiles
        return (cute.make_tensor(cu_ptr, cute.make_layout((NC, BLOCKS, FIELDS), stride=(BLOCKS * FIELDS, FIELDS, 1))),
                cute.make_tensor(co_ptr, cute.make_layout(N + 1)))

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
               alog: cute.Tensor, dtb: cute.Tensor, cu: cute.Tensor, co: cute.Tensor, w: cute.Tensor,
               u: cute.Tensor, qg: cute.Tensor, kg: cute.Tensor, aqk: cute.Tensor, akk: cute.Tensor,
               gl: cute.Tensor, N: Int32, search_steps: Int32, G: Int32, scale: Float32, lower_bound: Float32):
        assert not self.store_akk, "the packed stage 1 serves inference only (Akk needs 64 rows per chunk)"
        tid, _, _ = cute.arch.thread_idx()
        tile_j, h, _ = cute.arch.block_idx()
        tile = tile_j // G
        hv = h * G + (tile_j - tile * G)
        self.tile(q, k, v, g, beta, alog, dtb, w, u, qg, kg, aqk, akk, gl, (cu, tile), h, hv, scale, lower_bound,
                  tid)

    # ---- the hooks: geo = (sP,), the tile's block table in shared memory ([4, 5] int32, fields as above)

    @cute.jit
    def geometry(self, smem, where, tid):
        tab, tile = where
        sP = smem.allocate_tensor(Int32, cute.make_layout((BLOCKS, FIELDS), stride=(FIELDS, 1)), 16)
        if tid < BLOCKS * FIELDS:
            sP[tid // FIELDS, tid % FIELDS] = tab[tile, tid // FIELDS, tid % FIELDS]
        cute.arch.sync_threads()  # every thread's loads need the tokens
        return (sP,)

    @cute.jit
    def load_rows(self, cp, t: cute.Tensor, geo, h, s: cute.Tensor, tid):
        # block by block: 16 rows of one pass of the copy, each block's rows contiguous in tokens
        sP = geo[0]
        for m in cutlass.range_constexpr(BLOCKS):
            copy_rows_g2s(cp, head_rows(t, sP[m, TOK], h, BC), cute.local_tile(s, (BC, DK), (m, 0)), sP[m, NV], tid)

    @cute.jit
    def load_beta(self, beta: cute.Tensor, geo, hv, tid) -> Float32:
        b = Float32(0.0)
        if tid < BT:
            if self.row_ok(geo, tid):
                b = common.activate_beta(beta[self.row_token(geo, tid), hv].to(Float32), self.beta_activation)
        return b

    @cute.jit
    def row_ok(self, geo, row):
        return row % BC < geo[0][row // BC, NV]

    @cute.jit
    def block_ok(self, geo, m):
        return geo[0][m, NV] > 0

    @cute.jit
    def row_token(self, geo, row):
        return geo[0][row // BC, TOK] + row % BC

    @cute.jit
    def pair_ok(self, geo, p, c):
        # the callers' conditions are evaluated whole: pair indices past the 10 pairs (warps 2 - 7 in their second
        # slot) decode to c > 3, whose table row does not exist; the clamp keeps the read inside the table
        sP = geo[0]
        return sP[p, NV] > 0 and sP[p, FIRST] == sP[cutlass.min(c, BLOCKS - 1), FIRST]

    @cute.jit
    def chain_ok(self, geo, b, c: cutlass.Constexpr):
        return b <= geo[0][c, LAST]

    @cute.jit
    def scan_adds(self, geo, qq: cutlass.Constexpr, quarter):
        return qq < quarter and qq >= geo[0][quarter, FIRST]

    @cute.jit
    def continues_chunk(self, geo, p):
        return geo[0][p, FIRST] < p

    @cute.jit
    def start_ref(self, geo, m: cutlass.Constexpr):
        r = Int32(0)  # sRef's row 0 holds zeros: a piece's first block starts from 0
        if geo[0][m, FIRST] < m:
            r = Int32(m)
        return r

    @cute.jit
    def last_ref(self, geo, m: cutlass.Constexpr):
        return geo[0][m, LAST] + 1

    @cute.jit
    def chunk_col(self, geo, p):
        return geo[0][p, FIRST] * BC

    @cute.jit
    def first_contraction_block(self, geo, m):
        return geo[0][m, FIRST]

    @cute.jit
    def out_rows(self, t: cute.Tensor, geo, hv, m: cutlass.Constexpr, tb):
        # one pass of the vector copy over a 16-row view: the thread's row tid // 16 of block m
        return tb.partition_D(head_rows(t, geo[0][m, TOK], hv, BC))[None, 0, None]

    @cute.jit
    def write_gl(self, gl: cute.Tensor, geo, hv, sRef, tid):
        # each piece's first block writes its chunk's row
        sP = geo[0]
        if tid < DK:
            for m in cutlass.range_constexpr(BLOCKS):
                if sP[m, NV] > 0 and sP[m, FIRST] == m:
                    gl[sP[m, CHUNK], hv, tid] = sRef[sP[m, LAST] + 1, tid] * LN2

    @cute.jit
    def zero_akk(self, sAk, geo, t):
        # above the diagonal, and the blocks below it across pieces (block-diagonal inverse): one 4-byte pair per
        # block and thread
        sP = geo[0]
        z = Float32(0.0).to(cutlass.BFloat16)
        for pb in cutlass.range_constexpr(BLOCKS):
            for cb in cutlass.range_constexpr(BLOCKS):
                row = pb * BC + t // 8
                col = cb * BC + 2 * (t % 8)
                if const_expr(cb > pb):
                    sAk[row, col] = z
                    sAk[row, col + 1] = z
                elif const_expr(cb < pb):
                    if sP[pb, FIRST] != sP[cb, FIRST]:
                        sAk[row, col] = z
                        sAk[row, col + 1] = z
