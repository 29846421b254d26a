"""KVBuffer flush: the state after each request's m accepted tokens, rebuilt in place as a rank-m update,
    S_m = diag(exp(G_m)) S_0 + sum_{t < m} (exp(G_m - G_t) * k_t) delta_t^T,
from the KVBuffer [k_t | G_t | delta_t] of the verify step (layout: cula_core.ops.kvbuffer). Serves
`kda_flush_kvbuffer` (L = 1) and `kda_flush_kvbuffer_all_layers` (L layers in one launch).

Tiling. One CTA = one (layer, request, value head, block of BV value columns), 32*NW threads, the lane layout of
recurrent.py (a lane owns RK rows x CW columns of the state). The CTA first writes the per-row coefficients
a_t[r] (zero for t >= m) and exp(G_m[r]) to shared memory; each lane then reads its piece of S_0, adds the m
rank-1 terms in token order and writes the piece back: the pool is read and written once, the buffer only
T (2K + V) floats per head.

Layers. The pools and buffers of layer l are addressed as layer 0's pointer plus an element offset
(`pool_offs[l]`, `buf_offs[l]` in 16-byte units, kernel parameters): one compilation per layer count L, no
device-side table. Pools are fp32 or bf16 (the pointer's type; the math is fp32), [K, V] or V-first [V, K] per state.

Assumptions: m is read at run time (from `accept_len[n]` or the broadcast `accept_all`) and clamped to [0, T];
m = 0, cache_idx < 0, cache_idx >= P and cache_idx == null_slot (runtime, -1 for none) leave the pool untouched; pools and buffers 16-byte aligned,
contiguous; N, HV, P runtime values.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from cula_sm90.decode._dsl import (load_state_piece, load_vec, slot_in_use, state_piece_offset, store_state_piece,
                                   thread_coords)


class FlushKVBuffer:
    """Compile-time configuration: T (tokens in the buffer), K, V, L (layers), whether accept lengths come
    from a tensor, and the tiling (block_v, lanes_v, num_warps as in recurrent.RecurrentDecode)."""

    def __init__(self, *, T: int, K: int, V: int, layers: int, per_request: bool, block_v: int = 32,
                 lanes_v: int = 4, num_warps: int = 4, state_v_first: bool = False):
        if K % 32 or 32 % lanes_v or V % block_v or block_v % (num_warps * lanes_v):
            raise ValueError(f"bad tiling: K={K} V={V} BV={block_v} VL={lanes_v} NW={num_warps}")
        self.T, self.K, self.V, self.L, self.per_request = T, K, V, layers, per_request
        self.v_first = state_v_first  # pool layout [V, K] per state; the pool's dtype is the pointer's
        self.BV, self.VL, self.NW = block_v, lanes_v, num_warps
        self.KL = 32 // lanes_v
        self.RK = K // self.KL
        self.CW = block_v // (num_warps * lanes_v)
        self.NVB = V // block_v
        self.smem_bytes = (T + 1) * K * 4

    @cute.jit
    def __call__(self, pool: cute.Pointer, buf: cute.Pointer, cache_idx: cute.Pointer, accept_len: cute.Pointer,
                 accept_all: Int32, pool_offs, buf_offs, N: Int32, HV: Int32, P: Int32, null_slot: Int32, stream):
        self.kernel(pool, buf, cache_idx, accept_len, accept_all, pool_offs, buf_offs, N, HV, P, null_slot).launch(
            grid=[self.L * N * HV * self.NVB, 1, 1], block=[32 * self.NW, 1, 1], smem=self.smem_bytes,
            stream=stream)

    @cute.kernel
    def kernel(self, pool: cute.Pointer, buf: cute.Pointer, cache_idx: cute.Pointer, accept_len: cute.Pointer,
               accept_all: Int32, pool_offs, buf_offs, N: Int32, HV: Int32, P: Int32, null_slot: Int32):
        T, K, V, RK, CW = self.T, self.K, self.V, self.RK, self.CW
        W = 2 * K + V
        tid, warp, _, kr, vc = thread_coords(self.VL)
        bid = cute.arch.block_idx()[0]
        vb = bid % self.NVB
        head = bid // self.NVB           # (layer * N + n) * HV + hv
        hv = head % HV
        ln = head // HV
        n = ln % N
        layer = ln // N
        # this layer's pool and buffer: layer 0's plus an offset picked from the kernel parameters
        poff = Int64(0)
        boff = Int64(0)
        for layer_l in cutlass.range_constexpr(self.L):
            poff = cutlass.select_(layer == layer_l, pool_offs[layer_l], poff)
            boff = cutlass.select_(layer == layer_l, buf_offs[layer_l], boff)
        # offsets travel in units of 4 elements: the compiler then knows the 16-byte alignment survives
        pool_l = pool + poff * (16 // (pool.dtype.width // 8))
        buf_l = buf + boff * 4
        idx = cute.make_tensor(cache_idx + Int64(n), cute.make_layout(1))[0]
        m = accept_all
        if cutlass.const_expr(self.per_request):
            m = cute.make_tensor(accept_len + Int64(n), cute.make_layout(1))[0]
        m = cutlass.select_(m < 0, Int32(0), cutlass.select_(m > T, Int32(T), m))
        row0 = kr * RK
        col0 = vb * self.BV + warp * (self.VL * CW) + vc * CW
        smem = cutlass.memory.SmemAllocator()
        coef = smem.allocate_tensor(Float32, cute.make_layout((T + 1, K), stride=(K, 1)), byte_alignment=16)
        sc = coef.iterator
        # CTA-uniform: the whole CTA returns together (no barrier is skipped by part of it)
        if slot_in_use(idx, P, null_slot) & (m > 0):
            sbase = state_piece_offset(Int64(idx) * HV + hv, row0, col0, K, V, self.v_first)
            S0 = load_state_piece(pool_l, sbase, RK, CW, K, V, self.v_first)
            tok0 = Int64(n) * T
            dl = [load_vec(buf_l, ((tok0 + t) * HV + hv) * W + (2 * K) + col0, CW) for t in range(T)]
            for rr in cutlass.range_constexpr((K + 32 * self.NW - 1) // (32 * self.NW)):
                r = tid + rr * 32 * self.NW
                if r < K:
                    Gm = cute.make_tensor(buf_l + (((tok0 + m - 1) * HV + hv) * W + K + r), cute.make_layout(1))[0]
                    coef[T, r] = cute.math.exp(Gm)
                    for t in cutlass.range_constexpr(T):
                        trow = ((tok0 + t) * HV + hv) * W
                        kt = cute.make_tensor(buf_l + (trow + r), cute.make_layout(1))[0]
                        Gt = cute.make_tensor(buf_l + (trow + K + r), cute.make_layout(1))[0]
                        # rejected tokens selected away (their exponent may be > 0, their rows non-finite)
                        coef[t, r] = cutlass.select_(t < m, cute.math.exp(Gm - Gt) * kt, Float32(0.0))
            cute.arch.sync_threads()
            eg = load_vec(sc, Int32(T * K) + row0, RK)
            upd = [[Float32(0.0) for _ in range(CW)] for _ in range(RK)]
            for t in cutlass.range_constexpr(T):
                a = load_vec(sc, Int32(t * K) + row0, RK)
                # rejected tokens: coefficient 0 and delta masked (a non-finite delta must not leak in)
                d = [cutlass.select_(t < m, dl[t][c], Float32(0.0)) for c in range(CW)]
                upd = [[upd[r][c] + a[r] * d[c] for c in range(CW)] for r in range(RK)]
            S = [[eg[r] * S0[r][c] + upd[r][c] for c in range(CW)] for r in range(RK)]
            store_state_piece(pool_l, sbase, S, RK, CW, K, V, self.v_first)
