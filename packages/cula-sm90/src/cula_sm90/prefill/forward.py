"""Host side of the sm90 prefill: loads (cula_core.cute_runtime: shipped ahead of time, else compiled once and
cached) and launches the two stages, with or without intra-card context parallel. Thin: validation happened in
cula_core; the math is in the kernels.

    stage 1  chunk_intra_tc.ChunkIntraTCKernel   chunk-parallel: gate, cumsum, l2norm, Akk, w/u, Aqk, qg, kg, on
             tensor cores, for the safe gate with lower_bound >= TC_LOWER_BOUND_MIN (intra_kind);
             chunk_intra.ChunkIntraKernel for every other gate. Compiled with `store_akk` (training: chunk_kda
             with save_residuals) it also writes Akk, and Aqk and Akk go to their own tensors, the residuals
             cula-sm100's backward reads (docs/backends.md, "Residuals")
             chunk_intra_tc_packed.ChunkIntraTCPackedKernel: the same over tiles that pack the partial chunks of
             a batch (host-known lengths, inference, where packing_pays)
    stage 2  chunk_state_wg.ChunkStateWGKernel   persistent CTAs (state_ctas) walking the items (segment,
             head, state_cols state columns): the serial recurrence and o, on wgmma

CP (cula_core.cp_planner decides from host lengths): stage 2 in affine mode gives every piece's map (M, c),
a scan over the pieces of each sequence (batched fp64 matmuls on the device, immune to a global TF32 setting;
log2(pieces) steps composing maps, Hillis-Steele) gives their initial states, and stage 2 runs all pieces at
once. Without `cu_seqlens_cpu` a varlen call runs without CP (the lengths are only on the device; reading them would
synchronise).

A repeated call of one signature (cula_core.plans) runs `planned`'s launcher: the launch resolved once, each call
left with its allocations, addresses, the current stream and the two launches.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch

from cula_core import cute_runtime as rt
from cula_core.cute_runtime import plan_table

BT = 64
DK = 128
BC = 16  # the packed stage 1's pieces are whole blocks of this many rows
PACK_MIN_SAVING = 8  # pack stage 1 when that removes at least 1 / 8 (12.5%) of its CTAs

# the safe gate's lower bound down to which the TC stage 1 serves (FLA's safe range): its block-boundary score
# factors reach e^(16 |lower_bound|) (e^80 here), below fp32 / bf16 overflow (e^88.7)
TC_LOWER_BOUND_MIN = -5.0
# the lower bound a call that gives None runs with (intra_kind and the stage-1 scalar agree on it)
DEFAULT_LOWER_BOUND = -5.0


INTRA, STATE = "sm90.prefill.intra", "sm90.prefill.state"


def search_steps(N: int) -> int:
    """The stage-1 kernels' `search_steps` argument for N sequences: the 32-fold narrowings their chunk search
    (common.find_chunk) needs (0 for one sequence, 1 up to 32, 2 up to 1024, ...)."""
    steps, n = 0, max(N, 1)
    while n > 1:
        n = -(-n // 32)
        steps += 1
    return steps


def launch_stream() -> int:
    """The current CUDA stream's handle, as the kernels take it (the seam a host-path test replaces)."""
    return rt.current_stream()


@functools.cache
def intra_kind(gate: str, lower_bound: float | None) -> str:
    """Which stage 1 serves a call: "tc" (chunk_intra_tc.py, tensor-core scores: the safe gate with a lower bound
    the factorised operands cannot overflow with; None: DEFAULT_LOWER_BOUND) or "simt" (chunk_intra.py: any gate)."""
    lb = DEFAULT_LOWER_BOUND if lower_bound is None else lower_bound
    return "tc" if gate == "safe" and TC_LOWER_BOUND_MIN <= lb <= 0.0 else "simt"


def intra_config(gate: str, beta_activation: str, l2norm: bool, has_a_log: bool, has_dt_bias: bool,
                 qkv_dtype: torch.dtype, g_dtype: torch.dtype, beta_dtype: torch.dtype, kind: str,
                 store_akk: bool = False, packed: bool = False) -> tuple:
    """Compile-time configuration of stage 1 (kind "tc": chunk_intra_tc, the safe gate only; "simt": chunk_intra;
    `store_akk`: also write Akk = (I + L)^-1, "tc" only; `packed`: chunk_intra_tc_packed over a tile table, "tc"
    without store_akk only)."""
    if kind == "tc" and gate != "safe":
        raise ValueError(f"the tensor-core stage 1 serves the safe gate only, got {gate}")
    if store_akk and kind != "tc":
        raise ValueError(f"only the tensor-core stage 1 writes Akk (store_akk), got kind {kind!r}")
    if packed and (kind != "tc" or store_akk):
        raise ValueError(f"the packed stage 1 is the tensor-core kernel without store_akk, got kind {kind!r}, "
                         f"store_akk={bool(store_akk)}")
    return (kind, gate, beta_activation, bool(l2norm), bool(has_a_log), bool(has_dt_bias), qkv_dtype, g_dtype,
            beta_dtype, bool(store_akk), bool(packed))


def _build_intra(config: tuple):
    import cutlass

    (kind, gate, beta_activation, l2norm, has_a_log, has_dt_bias, qkv_dtype, g_dtype, beta_dtype, store_akk,
     packed) = config
    f32, i32, mid = torch.float32, torch.int32, torch.bfloat16
    if kind == "tc":
        from cula_sm90.prefill.chunk_intra_tc import ChunkIntraTCKernel
        from cula_sm90.prefill.chunk_intra_tc_packed import ChunkIntraTCPackedKernel

        kern = (ChunkIntraTCPackedKernel if packed else ChunkIntraTCKernel)(gate, beta_activation, l2norm,
                                                                           has_a_log, has_dt_bias)
        kern.g_smem = g_dtype == torch.bfloat16
        kern.store_akk = store_akk
        io = 16  # cp.async and 16-byte stores: prefill() passes 16-byte aligned tensors
    else:
        from cula_sm90.prefill.chunk_intra import ChunkIntraKernel

        kern = ChunkIntraKernel(gate, beta_activation, l2norm, has_a_log, has_dt_bias)
        io = None
    p = rt.fake_ptr
    return kern, (p(qkv_dtype, io), p(qkv_dtype, io), p(qkv_dtype, io),
                  p(g_dtype, io if g_dtype == torch.bfloat16 else None), p(beta_dtype, None), p(f32, None),
                  p(f32, None), p(i32, None), p(i32, None), *(p(mid, io) for _ in range(6)), p(f32, None),
                  *(cutlass.Int32(1) for _ in range(6)), cutlass.Float32(1.0), cutlass.Float32(-5.0),
                  rt.fake_stream())


def state_cols(seq_heads: int, num_sms: int) -> int:
    """Stage 2's state columns per CTA for `seq_heads` (sequence, value head) pairs: 128 (each chunk's tiles loaded
    once for the whole state width) unless 64-column CTAs would still fit in one wave, where 64 spreads the serial
    walk over twice the SMs."""
    return 64 if 2 * seq_heads <= num_sms else 128


def state_ctas(segments: int, HV: int, cols: int, affine: bool, num_sms: int) -> int:
    """Stage 2's grid: one persistent CTA per SM (its shared memory allows one), or one per item where there are
    fewer items (an item: a segment, value head and block of `cols` columns of the state, or of the affine pass's
    [M | c], 2 K wide)."""
    return max(1, min(segments * HV * ((2 * DK if affine else DK) // cols), num_sms))


def state_config(affine: bool, o_dtype: torch.dtype, cols: int, state_v_first: bool = False) -> tuple:
    """Compile-time configuration of stage 2 (chunk_state_wg, `cols` state columns per CTA; `state_v_first`:
    initial and final states [N, HV, V, K], normal mode only)."""
    return (bool(affine), o_dtype, int(cols), bool(state_v_first))


def _build_state(config: tuple):
    import cutlass

    from cula_sm90.prefill.chunk_state_wg import ChunkStateWGKernel

    affine, o_dtype, cols, state_v_first = config
    p, f32 = rt.fake_ptr, torch.float32
    return ChunkStateWGKernel(affine, cols, state_v_first), (
        *(p(torch.bfloat16, 16) for _ in range(5)), p(f32, None), p(torch.int32, None), p(f32, None), p(f32, 16),
        p(o_dtype, 16), *(cutlass.Int32(1) for _ in range(7)), rt.fake_stream())


_COMMON = ("cula_sm90.prefill.common", "cula_core.cute_kernels.copies", "cula_core.cute_kernels.warp_mma",
           "cula_sm90.prefill.forward")
rt.register(rt.KernelDef(INTRA, "cula-sm90", "cula_sm90", "sm_90a", _build_intra,
                         ("cula_sm90.prefill.chunk_intra", "cula_sm90.prefill.chunk_intra_tc",
                          "cula_sm90.prefill.chunk_intra_tc_packed", *_COMMON)))
rt.register(rt.KernelDef(STATE, "cula-sm90", "cula_sm90", "sm_90a", _build_state,
                         ("cula_sm90.prefill.chunk_state_wg", "cula_core.cute_kernels.wgmma",
                          "cula_core.cute_kernels.copies", "cula_sm90.prefill.forward")))


@functools.cache
def compile_intra(gate: str, beta_activation: str, l2norm: bool, has_a_log: bool, has_dt_bias: bool,
                  qkv_dtype: torch.dtype, g_dtype: torch.dtype, beta_dtype: torch.dtype, kind: str | None = None,
                  store_akk: bool = False, packed: bool = False):
    """Stage 1's launchable function for one configuration (cula_core.cute_runtime: shipped, cached or compiled
    now). Sizes are runtime arguments. `kind` None: "tc" for the safe gate (the caller checks its lower bound with
    intra_kind), "simt" otherwise; `store_akk`: the "tc" kernel that also writes Akk; `packed`: the "tc" kernel
    over a tile table (chunk_intra_tc_packed)."""
    if kind is None:
        kind = "tc" if gate == "safe" else "simt"
    return rt.get(INTRA, intra_config(gate, beta_activation, l2norm, has_a_log, has_dt_bias, qkv_dtype, g_dtype,
                                      beta_dtype, kind, store_akk, packed))


@functools.cache
def compile_state(affine: bool, o_dtype: torch.dtype, cols: int, state_v_first: bool = False):
    """Stage 2's launchable function (normal or affine-map mode, `cols` state columns per CTA: state_cols;
    `state_v_first`: states [N, HV, V, K])."""
    return rt.get(STATE, state_config(affine, o_dtype, cols, state_v_first))


def _host_lengths(B, T, cu_seqlens, cu_seqlens_cpu):
    if cu_seqlens is None:
        return (T,) * B
    if cu_seqlens_cpu is None:
        return None
    c = [int(x) for x in cu_seqlens_cpu.tolist()]
    return tuple(b - a for a, b in itertools.pairwise(c))


@functools.lru_cache(maxsize=64)
def packed_tiles(lengths: tuple[int, ...]) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """The packed stage 1's tiles for host-known sequence lengths: each tile a tuple of pieces (global chunk index,
    first token, valid rows) in the order they take its four 16-row blocks. A piece is a chunk's valid rows rounded
    up to whole blocks; chunks are numbered sequence by sequence (empty sequences own none). Full chunks keep a
    tile each, in chunk order; then the partial pieces, packed by first-fit decreasing (the largest first, chunk
    order among equals; each into the first tile opened that still has room, else a new tile), so no piece crosses
    a tile."""
    full, partial = [], []
    chunk, t = 0, 0
    for L in lengths:
        for s0 in range(0, L, BT):
            n = min(BT, L - s0)
            (full if n == BT else partial).append((chunk, t + s0, n))
            chunk += 1
        t += L
    blocks = BT // BC
    tiles, room = [], []
    for piece in sorted(partial, key=lambda p: -p[2] // BC):  # -blocks, rounded down: the largest first
        need = -(-piece[2] // BC)
        for i, free in enumerate(room):
            if free >= need:
                tiles[i].append(piece)
                room[i] -= need
                break
        else:
            tiles.append([piece])
            room.append(blocks - need)
    return tuple((p,) for p in full) + tuple(tuple(tile) for tile in tiles)


@functools.lru_cache(maxsize=64)
def packing_pays(lengths: tuple[int, ...]) -> bool:
    """Whether the packed stage 1 runs for these host-known lengths (a TC inference call): packing must remove at
    least 1 / PACK_MIN_SAVING (12.5%) of stage 1's CTAs, one per chunk unpacked and one per tile packed. Cached by
    the lengths, as packed_tiles is: a varlen call asks on every call."""
    chunks = sum(-(-L // BT) for L in lengths)
    saved = chunks - len(packed_tiles(lengths))
    return saved > 0 and PACK_MIN_SAVING * saved >= chunks


def stage1_packs(kind: str, residuals: bool, lengths: tuple[int, ...] | None, pack_stage1: bool | None = None) -> bool:
    """Whether a call's stage 1 runs over packed tiles: only the tensor-core kernel for inference (training's Akk
    residual needs 64 rows per chunk), only with host-known lengths (the tiles are planned on the host); then the
    caller's `pack_stage1` (benchmarks: True / False) or, None, packing_pays."""
    if kind != "tc" or residuals or lengths is None:
        return False
    return packing_pays(lengths) if pack_stage1 is None else bool(pack_stage1)


def tile_table(tiles) -> list[list[list[int]]]:
    """The packed stage 1's tile table ([tiles, 4, 5] int32, chunk_intra_tc_packed): per tile and 16-row block,
    (first token of the block's rows, valid rows in it, the piece's chunk index, first and last block of the piece
    in the tile); blocks no piece takes: (0, 0, 0, m, m)."""
    out = []
    for tile in tiles:
        rows, m = [], 0
        for chunk, t0, n in tile:
            nb = -(-n // BC)
            rows += [[t0 + BC * b, min(BC, n - BC * b), chunk, m, m + nb - 1] for b in range(nb)]
            m += nb
        rows += [[0, 0, 0, b, b] for b in range(m, BT // BC)]
        out.append(rows)
    return out


def planner_kwargs(cp_pieces: int | None, cols: int) -> dict:
    """What the CP planner needs to know of stage 2 (CTAs per (segment, head) of the main pass at `cols` state
    columns per CTA), and `cp_pieces` (benchmarks: pieces per long sequence, whatever the planner's rule says;
    None: the rule decides)."""
    kw = {"slices": DK // cols}
    if cp_pieces is not None:
        kw["force_pieces"] = int(cp_pieces)
    return kw


@functools.lru_cache(maxsize=64)
def host_tables(lengths: tuple[int, ...], num_heads: int, num_sms: int, mode: str, pk: tuple | None = None):
    """cu_seqlens, chunk offsets and the CP plan for host-known lengths (cached by lengths and the planner's
    arguments `pk`, planner_kwargs(...) as items; None: those of this many (sequence, head) pairs, no forced
    pieces)."""
    from cula_core import cp_planner

    if pk is None:
        kw = planner_kwargs(None, state_cols(len(lengths) * num_heads, num_sms))
    else:
        kw = dict(pk)
    p = cp_planner.plan(lengths, num_heads, num_sms, mode, chunk_size=BT, **kw)
    cu = list(itertools.accumulate(lengths, initial=0))
    co = list(rt.chunk_offsets(tuple(cu), BT))
    return cu, co, p


def longest_first(rows: list[list[int]]) -> list[list[int]]:
    """Segment-table rows (first token, end token, ...) ordered by decreasing length, ties in their order: stage 2's
    persistent CTAs take the items round robin in row order, so each CTA gets one of the longest, then shorter
    ones (every row names its own state rows, so the order changes nothing else)."""
    return sorted(rows, key=lambda r: r[0] - r[1])


@functools.lru_cache(maxsize=64)
def planned_device_tables(lengths, num_heads, num_sms, mode, device, has_h0, want_ht, cp_pieces, cols, packed=False):
    """The launch tables on `device` for host-known lengths (host_tables' plan with the planner's arguments of
    `cp_pieces` and stage 2's `cols`, state_cols; with `packed`, the packed stage 1's tile table "tiles" and its
    tile count "n_tiles"; cached by every argument)."""
    cu, co, p = host_tables(lengths, num_heads, num_sms, mode, tuple(sorted(planner_kwargs(cp_pieces, cols).items())))
    N = len(lengths)
    tables = {"cu": rt.device_int32(cu, device), "co": rt.device_int32(co, device), "plan": p, "NC": co[-1],
              "state_cols": cols}
    if packed:
        tiles = packed_tiles(tuple(lengths))
        tables["tiles"] = rt.device_int32(tile_table(tiles), device)
        tables["n_tiles"] = len(tiles)
    if not p.split:
        tables["seg"] = rt.device_int32(longest_first(
            [[cu[n], cu[n + 1], co[n], n if has_h0 else -1, n if want_ht else -1] for n in range(N)]), device)
        return tables
    segs = p.segments
    # map pass: every piece but the last of its sequence; its map goes to row r of the maps buffer
    need = [i for i, s in enumerate(segs) if not s.last]
    tables["map_seg"] = rt.device_int32(longest_first([[segs[i].start, segs[i].end, segs[i].chunk0, -1, r]
                                                       for r, i in enumerate(need)]), device)
    tables["map_ctas"] = state_ctas(len(need), num_heads, cols, True, num_sms)  # the map pass's grid
    # main pass: piece i starts from row i of the starts buffer
    tables["seg"] = rt.device_int32(longest_first([[s.start, s.end, s.chunk0, i, s.seq if (s.last and want_ht) else -1]
                                                   for i, s in enumerate(segs)]), device)
    # the scan, in log2(max pieces) steps instead of one per piece index (each step is a few launches, so
    # launches, not flops, bound it): row r's map becomes the composition of its sequence's maps up to r
    # (Hillis-Steele); step d composes row r with row r - d wherever both belong to one sequence
    firsts = [i for i, s in enumerate(segs) if s.first]
    map_row = {i: r for r, i in enumerate(need)}
    first_row = {segs[f].seq: map_row[f] for f in firsts if not segs[f].last}
    row_seq = [segs[i].seq for i in need]
    row_pos = [r - first_row[n] for r, n in enumerate(row_seq)]
    steps, d = [], 1
    while d < max(p.pieces) - 1:
        dst = [r for r, pos in enumerate(row_pos) if pos >= d]
        steps.append((torch.tensor(dst, device=device), torch.tensor([r - d for r in dst], device=device)))
        d *= 2
    tables["scan_steps"] = steps
    # after the scan, row r maps its sequence's initial state to the start of piece need[r] + 1
    tables["scan_dst"] = torch.tensor([i + 1 for i in need], device=device)
    tables["scan_seq"] = torch.tensor(row_seq, device=device)
    tables["firsts"] = torch.tensor(firsts, device=device)
    return tables


def host_length_tables(lengths, num_heads, device, mode, has_h0, want_ht, cp_pieces, packed=False):
    """planned_device_tables for host-known lengths on `device`, with the planner's arguments of `cp_pieces` and
    stage 2's columns per CTA for this many (sequence, head) pairs (`packed`: with the packed stage 1's tiles)."""
    sms = rt.sm_count(device.index or 0)
    return planned_device_tables(lengths, num_heads, sms, mode, device, has_h0, want_ht, cp_pieces,
                                 state_cols(len(lengths) * num_heads, sms), packed)


def scratch_layout(TT: int, HV: int, NC: int, with_aqk: bool = True) -> tuple[int, tuple[int, ...]]:
    """Stage 1's outputs in one scratch allocation: (bytes, byte offsets of w, u, qg, kg [TT, HV, K] bf16,
    Aqk [TT, HV, BT] bf16 and gl [NC, HV, K] fp32). Every size is a multiple of 128 bytes, so every offset keeps
    the allocation's alignment (the kernels' 16-byte vector accesses). `with_aqk` False: Aqk lives in a tensor of
    its own (a residual that outlives the call), its region here is empty."""
    mid = TT * HV * DK * 2
    aqk = TT * HV * BT * 2 if with_aqk else 0
    offsets = (0, mid, 2 * mid, 3 * mid, 4 * mid, 4 * mid + aqk)
    return offsets[-1] + NC * HV * DK * 4, offsets


def _device_tables(B, T, N, HV, cu_seqlens, device, has_h0, want_ht):
    """Tables from device data only (varlen without cu_seqlens_cpu): no host synchronisation, no CP."""
    cu = cu_seqlens.to(torch.int32)
    n_chunks = (cu[1:] - cu[:-1] + BT - 1) // BT
    co = torch.zeros(N + 1, dtype=torch.int32, device=device)
    co[1:] = torch.cumsum(n_chunks, 0)
    ar = torch.arange(N, dtype=torch.int32, device=device)
    none = torch.full_like(ar, -1)
    seg = torch.stack([cu[:-1], cu[1:], co[:-1], ar if has_h0 else none, ar if want_ht else none], 1).contiguous()
    # a chunk-count bound the host knows: every sequence adds at most one partial chunk
    return {"cu": cu, "co": co, "seg": seg, "NC": -(-(B * T) // BT) + N, "plan": None,
            "state_cols": state_cols(N * HV, rt.sm_count(device.index or 0))}


class Launch(NamedTuple):
    """What the two stages of one call shape take besides the call's own addresses (launch_spec)."""

    intra: Callable           # stage 1
    state: Callable           # stage 2 (normal mode, in the call's state layout)
    tables: dict              # device tables (planned_device_tables / _device_tables), held here
    table_addrs: tuple        # addresses of tables["cu"] (packed stage 1: tables["tiles"]), tables["co"], tables["seg"]
    split: bool               # the tables' CP plan splits a sequence: the affine-map pass and the scan run
    nbytes: int               # scratch_layout
    offsets: tuple[int, ...]
    intra_sizes: tuple        # TT, N, NC (packed stage 1: tiles), scan steps, HQK, G, scale, lower bound
    state_sizes: tuple        # TT, NC, segments, HV, rows of h0, rows of ht, CTAs (state_ctas)
    final_shape: tuple[int, ...] | None
    aligned: bool             # stage 1 loads q, k, v (and a bf16 g) in 16-byte vectors
    residuals: bool           # stage 1 writes Akk; Aqk and Akk go to their own [B, T, HV, BT] tensors


def launch_spec(B, T, HQK, HV, N, tables, qkv_dtype, g_dtype, beta_dtype, has_a_log, has_dt_bias, h0_rows, want_ht,
                scale, l2norm, gate, lower_bound, beta_activation, state_v_first=False, residuals=False) -> Launch:
    """The Launch of a call shape with its tables (`h0_rows` 0: no initial state; `state_v_first`: states
    [N, HV, V, K]; `residuals`: stage 1 also writes Akk, and Aqk and Akk go to tensors of their own, which only
    the tensor-core stage 1 can do: a call it does not serve raises ValueError)."""
    TT = B * T
    NC = max(tables["NC"], 1)
    nbytes, offsets = scratch_layout(TT, HV, NC, with_aqk=not residuals)
    lb = DEFAULT_LOWER_BOUND if lower_bound is None else float(lower_bound)
    kind = intra_kind(gate, lower_bound)
    if residuals and kind != "tc":
        raise ValueError(f"the sm90 prefill saves residuals with the tensor-core stage 1 only (the safe gate with "
                         f"lower_bound in [{TC_LOWER_BOUND_MIN}, 0]), got gate={gate!r}, lower_bound={lower_bound}")
    packed = "tiles" in tables  # the tables say whether stage 1 runs over packed tiles (stage1_packs)
    intra = compile_intra(gate, beta_activation, bool(l2norm), has_a_log, has_dt_bias, qkv_dtype, g_dtype,
                          beta_dtype, kind, bool(residuals), packed)
    seg = tables["seg"]
    plan = tables["plan"]
    return Launch(intra, compile_state(False, qkv_dtype, tables["state_cols"], state_v_first), tables,
                  ((tables["tiles"] if packed else tables["cu"]).data_ptr(), tables["co"].data_ptr(), seg.data_ptr()),
                  plan is not None and plan.split, nbytes, offsets,
                  (TT, N, tables["n_tiles"] if packed else NC, search_steps(N), HQK, HV // HQK, float(scale), lb),
                  (TT, NC, seg.shape[0], HV, max(h0_rows, 1), N if want_ht else 1,
                   state_ctas(seg.shape[0], HV, tables["state_cols"], False, rt.sm_count(seg.device.index or 0))),
                  (N, HV, DK, DK) if want_ht else None, kind == "tc", bool(residuals))


@functools.lru_cache(maxsize=256)
def uniform_launch_spec(B, T, HQK, HV, device, intracard_cp, cp_pieces, qkv_dtype, g_dtype, beta_dtype, has_a_log,
                        has_dt_bias, h0_rows, want_ht, scale, l2norm, gate, lower_bound, beta_activation,
                        state_v_first=False, residuals=False, pack_stage1=None) -> Launch:
    """launch_spec of B sequences of T tokens (no cu_seqlens), cached by every argument: a repeated call shape
    goes straight to its launches."""
    lengths = (T,) * B
    packed = stage1_packs(intra_kind(gate, lower_bound), residuals, lengths, pack_stage1)
    tables = host_length_tables(lengths, HV, device, intracard_cp, h0_rows > 0, want_ht, cp_pieces, packed)
    return launch_spec(B, T, HQK, HV, B, tables, qkv_dtype, g_dtype, beta_dtype, has_a_log, has_dt_bias, h0_rows,
                       want_ht, scale, l2norm, gate, lower_bound, beta_activation, state_v_first, residuals)


_READ_DTYPES = (torch.bfloat16, torch.float32)  # g and beta are read in these dtypes as they are, others as fp32


def _read_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype stage 1 reads g or beta in: its own for bf16 / fp32, fp32 for any other (converted per call)."""
    return t.dtype if t.dtype in _READ_DTYPES else torch.float32


def _call_launch(q, _k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *, scale,
                 output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, intracard_cp,
                 cp_pieces, state_v_first, residuals=False, pack_stage1=None) -> Launch:
    """The Launch of a non-empty prefill call (`prefill`'s arguments; `residuals`: chunk_kda's save_residuals)."""
    B, T, HQK, _K = q.shape
    HV = v.shape[2]
    want_ht = bool(output_final_state)
    h0_rows = 0 if initial_state is None else initial_state.shape[0]
    g_dtype, beta_dtype = _read_dtype(g), _read_dtype(beta)
    if cu_seqlens is None:
        return uniform_launch_spec(B, T, HQK, HV, q.device, intracard_cp, cp_pieces, q.dtype, g_dtype, beta_dtype,
                                   A_log is not None, dt_bias is not None, h0_rows, want_ht, scale,
                                   use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, bool(state_v_first),
                                   bool(residuals), pack_stage1)
    lengths = _host_lengths(B, T, cu_seqlens, cu_seqlens_cpu)
    if lengths is not None:
        packed = stage1_packs(intra_kind(gate, lower_bound), residuals, lengths, pack_stage1)
        tables = host_length_tables(lengths, HV, q.device, intracard_cp, h0_rows > 0, want_ht, cp_pieces, packed)
    else:
        tables = _device_tables(B, T, cu_seqlens.shape[0] - 1, HV, cu_seqlens, q.device, h0_rows > 0, want_ht)
    return launch_spec(B, T, HQK, HV, cu_seqlens.shape[0] - 1, tables, q.dtype, g_dtype, beta_dtype,
                       A_log is not None, dt_bias is not None, h0_rows, want_ht, scale, use_qk_l2norm_in_kernel, gate,
                       lower_bound, beta_activation, bool(state_v_first), bool(residuals))


def _launcher(spec: Launch, args: tuple, stage2: bool = True) -> Callable:
    """The launches of `spec` as a function of (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
    cu_seqlens_cpu), for every call whose arguments have the types, dtypes and presence of `args` (which decide the
    conversions; the shapes are spec's). What a call does: dtype conversions, the scratch / o / final-state
    (/ residual) allocations, the addresses, the current stream, stage 1's launch and, with `stage2` (a spec that is
    not split), stage 2's launch. It returns (o, final state or None), and with `spec.residuals` also (Aqk, Akk), each
    [B, T, HV, BT] bf16. Without `stage2` (the CP path, whose passes follow stage 1; the last three arguments may be
    left out) it returns (scratch, o, final state or None, (Aqk, Akk) or None, Aqk's address, stream): stage 1's
    other outputs lie in the scratch at spec.offsets, where stage 2 reads them (hold the scratch until it is
    queued)."""
    _q, _k, _v, g, beta, A_log, dt_bias, h0 = args[:8]
    g_float, beta_float = g.dtype not in _READ_DTYPES, beta.dtype not in _READ_DTYPES
    a_log_float = A_log is not None and A_log.dtype != torch.float32
    dt_bias_float = dt_bias is not None and dt_bias.dtype != torch.float32
    has_a_log, has_dt_bias, has_h0 = A_log is not None, dt_bias is not None, h0 is not None
    intra, aligned, intra_sizes, final_shape = spec.intra, spec.aligned, spec.intra_sizes, spec.final_shape
    state, state_sizes = spec.state, spec.state_sizes
    cu_addr, co_addr, seg_addr = spec.table_addrs
    nbytes, (_, u_off, qg_off, kg_off, aqk_off, gl_off) = spec.nbytes, spec.offsets
    device, uint8, f32, empty, empty_like = _q.device, torch.uint8, torch.float32, torch.empty, torch.empty_like
    bf16 = torch.bfloat16
    residuals, residual_shape = spec.residuals, (*_q.shape[:2], _v.shape[2], BT)

    def run(q, k, v, g, beta, A_log, dt_bias, initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None):
        # converted tensors stay referenced until stage 1, their only reader, is queued: freed earlier, their
        # memory could be handed to the next conversion before the kernel that reads it was enqueued
        if g_float:
            g = g.float()
        if beta_float:
            beta = beta.float()
        if a_log_float:
            A_log = A_log.float()
        if dt_bias_float:
            dt_bias = dt_bias.float()
        # stage 1's outputs live in one scratch allocation, addressed by offset (scratch_layout); its base also
        # stands for every absent optional tensor (a kernel never reads one)
        scratch = empty(nbytes, dtype=uint8, device=device)
        o = empty_like(v)
        # sizes as separate arguments: torch.empty parses them faster than a shape tuple
        final = None if final_shape is None else empty(*final_shape, dtype=f32, device=device)
        base = scratch.data_ptr()
        if residuals:  # tensors of their own: a view of the scratch would keep all of it alive until the backward
            saved = (empty(*residual_shape, dtype=bf16, device=device),
                     empty(*residual_shape, dtype=bf16, device=device))
            aqk_addr, akk_addr = saved[0].data_ptr(), saved[1].data_ptr()
        else:
            saved = None
            aqk_addr = akk_addr = base + aqk_off  # Akk: never written by this configuration
        q_addr, k_addr, v_addr, g_addr = q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr()
        if aligned and (q_addr | k_addr | v_addr | g_addr) & 15:  # views at odd offsets: 16-byte aligned copies
            q, k, v, g = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (q, k, v, g))
            q_addr, k_addr, v_addr, g_addr = q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr()
        stream = launch_stream()
        intra(q_addr, k_addr, v_addr, g_addr, beta.data_ptr(), A_log.data_ptr() if has_a_log else base,
              dt_bias.data_ptr() if has_dt_bias else base, cu_addr, co_addr, base, base + u_off, base + qg_off,
              base + kg_off, aqk_addr, akk_addr, base + gl_off, *intra_sizes, stream)
        if not stage2:
            return scratch, o, final, saved, aqk_addr, stream
        state(base, base + u_off, base + qg_off, base + kg_off, aqk_addr, base + gl_off, seg_addr,
              initial_state.data_ptr() if has_h0 else base, base if final is None else final.data_ptr(),
              o.data_ptr(), *state_sizes, stream)
        if residuals:
            return o, final, saved
        return o, final

    run.launch = spec  # its device tables, whose addresses the launches take, live as long as `run`
    # the compiled plan table serves the calls that need no conversion (cula_core.cute_runtime.plan_table)
    plain = not (g_float or beta_float or a_log_float or dt_bias_float or residuals)
    run.program = (launch_program(spec, tuple(_v.shape), _v.dtype, has_a_log, has_dt_bias, has_h0) if stage2 and plain
                   else None)
    return run


def launch_program(spec: Launch, v_shape: tuple, v_dtype: torch.dtype, has_a_log: bool, has_dt_bias: bool,
                   has_h0: bool) -> plan_table.Program:
    """`_launcher`'s run as a plan-table program, for calls whose g, beta, A_log and dt_bias need no conversion
    and that keep no residuals: its inputs are (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens), its
    results o (v's shape and dtype) and, where spec has one, the final state. The tables' addresses are literals:
    the program keeps the tables."""
    program = plan_table.Program(9)
    q, k, v, g, beta, a_log, dt_bias, h0 = range(8)
    # slot numbers of the allocations follow the inputs: the scratch (stage 1's outputs at spec.offsets; its base
    # also stands for every absent optional tensor, as in _launcher), o, the final state
    scratch = program.alloc([spec.nbytes], torch.uint8, q)
    o = program.alloc(v_shape, v_dtype, q)
    final = None if spec.final_shape is None else program.alloc(spec.final_shape, torch.float32, q)
    _, u_off, qg_off, kg_off, aqk_off, gl_off = spec.offsets
    cu_addr, co_addr, seg_addr = spec.table_addrs
    at = plan_table.Address
    stage1_out = (at(scratch), at(scratch, u_off), at(scratch, qg_off), at(scratch, kg_off), at(scratch, aqk_off))
    program.launch(spec.intra, at(q), at(k), at(v), at(g), at(beta), at(a_log) if has_a_log else at(scratch),
                   at(dt_bias) if has_dt_bias else at(scratch), cu_addr, co_addr, *stage1_out,
                   at(scratch, aqk_off), at(scratch, gl_off), *spec.intra_sizes, plan_table.STREAM)
    program.launch(spec.state, *stage1_out, at(scratch, gl_off), seg_addr, at(h0) if has_h0 else at(scratch),
                   at(scratch) if final is None else at(final), at(o), *spec.state_sizes, plan_table.STREAM)
    if spec.aligned:
        program.require_aligned(q, k, v, g)
    if final is None:
        program.returns(o)
    else:
        program.returns(o, final)
    program.keep += [t for t in spec.tables.values() if isinstance(t, torch.Tensor)]
    return program


def planned(args: tuple, *, intracard_cp="off", cp_pieces=None, state_v_first=False, pack_stage1=None,
            **flags) -> Callable:
    """`prefill` with its keyword arguments fixed, for the calls of one plan (cula_core.plans): every call passes
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu) with the types, shapes, dtypes
    and device of `args` (contiguous tensors, the same ones None); only values and addresses change.

    Where those decide the whole launch (no cu_seqlens: the tables follow B and T; a non-empty batch; no
    context-parallel split), it is resolved here, once (`_launcher`); otherwise each call runs `prefill`."""
    kw = dict(flags, intracard_cp=intracard_cp, cp_pieces=cp_pieces, state_v_first=state_v_first,
              pack_stage1=pack_stage1)
    q = args[0]
    if args[8] is not None or q.shape[0] * q.shape[1] == 0:
        return functools.partial(prefill, **kw)
    spec = _call_launch(*args, **kw)
    return functools.partial(prefill, **kw) if spec.split else _launcher(spec, args)


def prefill(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *, scale,
            output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, intracard_cp="off",
            cp_pieces=None, state_v_first=False, save_residuals=False, pack_stage1=None):
    """The prefill of cula_core's `kda_prefill` custom op on validated, contiguous tensors (its argument order);
    `intracard_cp` "on" / "off" / "auto" as the planner takes it; `cp_pieces` forces that many CP pieces per long
    sequence (benchmarks; None: the planner's rule); `state_v_first`: initial and final states [N, HV, V, K]
    (FLA's layout), indexed by stage 2 as they are (K = V, so the shapes match).

    Returns (o, final state or None); with `save_residuals` (chunk_kda's training forward: core's residuals,
    docs/backends.md) (o, final state or None, (Aqk, Akk)): FLA 0.6.0's chunk-64 intra-chunk matrices, each
    [B, T, HV, 64] bf16 in token layout, rows of every chunk up to the sequence's end (Aqk with `scale` folded in,
    zero above the diagonal; Akk = (I + L)^-1, unit lower triangular, no beta factor). Only the tensor-core stage
    1 writes Akk: another gate or lower bound raises ValueError (the serving predicate declines such calls).

    Stage 1 runs over packed tiles (chunk_intra_tc_packed) where stage1_packs says so: the tensor-core kernel
    without residuals, lengths known on the host, and packing_pays, or, given, `pack_stage1` (benchmarks and tests:
    True packs whenever the kernel can, False never). Results are the same either way (stage 2 reads the same
    intermediates)."""
    B, T, _, K = q.shape
    HV = v.shape[2]
    device = q.device
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    has_h0 = initial_state is not None
    want_ht = bool(output_final_state)
    if B * T == 0 or N == 0:
        final = torch.empty(N, HV, K, K, dtype=torch.float32, device=device) if want_ht else None
        if final is not None:
            final.copy_(initial_state) if has_h0 else final.zero_()
        if save_residuals:
            empty = torch.empty(B, T, HV, BT, dtype=torch.bfloat16, device=device)
            return torch.empty_like(v), final, (empty, torch.empty_like(empty))
        return torch.empty_like(v), final
    args = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
    spec = _call_launch(*args, scale=scale, output_final_state=output_final_state,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate, lower_bound=lower_bound,
                        beta_activation=beta_activation, intracard_cp=intracard_cp, cp_pieces=cp_pieces,
                        state_v_first=state_v_first, residuals=bool(save_residuals), pack_stage1=pack_stage1)
    if not spec.split:
        return _launcher(spec, args)(*args)

    # ---- context parallel: stage 1, the maps of the pieces, a scan, then every piece at once
    scratch, o, final, residuals, aqk, stream = _launcher(spec, args, stage2=False)(q, k, v, g, beta, A_log, dt_bias)
    base = scratch.data_ptr()
    _, u_off, qg_off, kg_off, _, gl_off = spec.offsets
    w, u, qg, kg, gl = base, base + u_off, base + qg_off, base + kg_off, base + gl_off
    seg_addr = spec.table_addrs[2]
    ht = base if final is None else final.data_ptr()
    TT, NC, S = spec.state_sizes[:3]
    tables = spec.tables
    map_seg = tables["map_seg"]
    R = map_seg.shape[0]
    maps = torch.empty(R, HV, K, 2 * K, dtype=torch.float32, device=device)
    compile_state(True, v.dtype, tables["state_cols"])(w, u, qg, kg, aqk, gl, map_seg.data_ptr(), base,
                                                       maps.data_ptr(), o.data_ptr(), TT, NC, R, HV, 1, R,
                                                       tables["map_ctas"], stream)
    # the pieces' initial states, in the call's state layout (the main pass reads them as it reads initial_state)
    starts = torch.empty(S, HV, K, K, dtype=torch.float32, device=device)
    if has_h0:
        starts[tables["firsts"]] = initial_state
    else:
        # index_fill_ takes the zero as a kernel argument; `starts[i] = 0.0` copies it from pageable host
        # memory, and that copy synchronises the stream: the GPU would idle while the host launches the rest
        # (docs/benchmarks/intracard_cp.md, host profile)
        starts.index_fill_(0, tables["firsts"], 0.0)
    # composed maps in fp64 (products of up to max-pieces decays; immune to a global TF32 setting)
    composed = maps.double()
    for dst, src in tables["scan_steps"]:
        later = composed[dst]
        step = later[..., :K] @ composed[src]
        step[..., K:] += later[..., K:]
        composed[dst] = step
    reached = composed[..., K:]
    if has_h0:
        h0 = initial_state[tables["scan_seq"]].double()
        reached = composed[..., :K] @ (h0.transpose(-1, -2) if state_v_first else h0) + reached
    starts[tables["scan_dst"]] = (reached.transpose(-1, -2) if state_v_first else reached).float()
    spec.state(w, u, qg, kg, aqk, gl, seg_addr, starts.data_ptr(), ht, o.data_ptr(),
               TT, NC, S, HV, S, N if final is not None else 1, spec.state_sizes[6], stream)
    if spec.residuals:
        return o, final, residuals
    return o, final
