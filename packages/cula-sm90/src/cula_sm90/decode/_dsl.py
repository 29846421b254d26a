"""Device helpers shared by the decode kernels (CuTe DSL): vector loads/stores through raw pointers, lane
reductions, the in-kernel gates, the beta activation and the L2 norm, the TF32 split and mma.sync of the tensor-core
verify. Imported only by the kernel modules (never at package import).

Every helper is plain Python run while a kernel is traced (so its loops unroll) and works on Python lists of
DSL scalars: the sizes are compile-time constants, so a "vector" is a list the compiler keeps in registers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, TFloat32

#: eps inside the square root of the L2 norm (cula_core.reference.gates.L2NORM_EPS, FLA's value).
L2NORM_EPS = 1e-6
#: torch.nn.functional.softplus's threshold: softplus(x) = x above it (as FLA's gate kernel).
SOFTPLUS_THRESHOLD = 20.0


def slot_in_use(slot, P, null_slot):
    """Whether a pool slot is read or written: not negative, below the pool size P and not the engine's null slot
    (null_slot is -1 when the engine has none)."""
    return (slot >= 0) & (slot < P) & (slot != null_slot)


def thread_coords(lanes_v: int):
    """(tid, warp, lane, kr, vc) of this thread in the decode kernels' tiling: lane = kr * lanes_v + vc, vc along
    V, kr along K."""
    tid = cute.arch.thread_idx()[0]
    lane = tid % 32
    return tid, tid // 32, lane, lane // lanes_v, lane % lanes_v


def load_vec(ptr: cute.Pointer, offset: Int64, n: int):
    """n consecutive elements at ptr + offset, as fp32 scalars. One vector load when the offset keeps the
    pointer's alignment (the compiler tracks divisibility of the offset)."""
    vals = cute.make_tensor(ptr + offset, cute.make_layout(n)).load().to(Float32)
    return [vals[i] for i in range(n)]


def store_vec(ptr: cute.Pointer, offset: Int64, vals, n: int):
    """Store n fp32 scalars at ptr + offset, converted to the pointer's element type (one vector store)."""
    frag = cute.make_rmem_tensor(n, Float32)
    for i in range(n):
        frag[i] = vals[i]
    dst = cute.make_tensor(ptr + offset, cute.make_layout(n))
    dst.store(frag.load().to(ptr.dtype))


def store_zeros(ptr: cute.Pointer, offset: Int64, n: int):
    frag = cute.make_rmem_tensor(n, ptr.dtype)
    frag.fill(0)
    dst = cute.make_tensor(ptr + offset, cute.make_layout(n))
    dst.store(frag.load())


def xor_sum(x: Float32, first: int) -> Float32:
    """Sum of x over the lanes that differ from this one in the bits >= `first` (a power of two):
    a butterfly, so every such lane ends with the same total, in the same order (deterministic)."""
    off = first
    while off < 32:  # trace-time loop: unrolled
        x = x + cute.arch.shuffle_sync_bfly(x, offset=off)
        off *= 2
    return x


def l2_normalize(x, n: int):
    """x (this lane's n elements of a row spread over the 32 lanes of the warp) times rsqrt(||row||^2 + eps)."""
    ss = Float32(0.0)
    for i in range(n):
        ss = ss + x[i] * x[i]
    inv = cute.math.rsqrt(xor_sum(ss, 1) + Float32(L2NORM_EPS))
    return [x[i] * inv for i in range(n)]


def log_decay(x: Float32, rate: Float32, lower_bound: Float32, safe: bool) -> Float32:
    """The gate from the biased raw input x = g + dt_bias, with rate = exp(A_log) (1 without A_log):
    safe:     lower_bound * sigmoid(rate * x)
    softplus: -rate * softplus(x), softplus(x) = x above the threshold (exp would overflow there).
    Full-precision exp/log (not the approximate MUFU forms): the decay compounds over the sequence."""
    if safe:
        return lower_bound / (Float32(1.0) + cute.math.exp(-(rate * x)))
    sp = cute.math.log1p(cute.math.exp(cute.math.min(x, Float32(SOFTPLUS_THRESHOLD))))
    return -rate * cutlass.select_(x > Float32(SOFTPLUS_THRESHOLD), x, sp)


def gate_from_raw(x, A_log: cute.Pointer, dt_bias: cute.Pointer, hv, e0, K: int, lower_bound: Float32, *,
                  has_A_log: bool, has_dt_bias: bool, safe: bool):
    """The in-kernel gate (log_decay) of this lane's len(x) elements e0.. of raw g for value head hv: x +
    dt_bias[hv * K + e0 ..] when dt_bias is given, rate exp(A_log[hv]) (1 without A_log)."""
    n = len(x)
    bias = load_vec(dt_bias, Int64(hv) * K + e0, n) if has_dt_bias else None
    a_log = cute.make_tensor(A_log + Int64(hv), cute.make_layout(1)).load().to(Float32)[0] if has_A_log else None
    return gate_values(x, bias, a_log, lower_bound, safe=safe)


def gate_values(x, bias, a_log, lower_bound: Float32, *, safe: bool):
    """log_decay of the raw elements x (a list) plus `bias` (their dt_bias values, or None) at rate exp(a_log) (1
    when a_log is None): gate_from_raw's math on values already loaded."""
    if bias is not None:
        x = [x[i] + bias[i] for i in range(len(x))]
    rate = Float32(1.0) if a_log is None else cute.math.exp(a_log)
    return [log_decay(xi, rate, lower_bound, safe) for xi in x]


def activate_beta(b: Float32, beta_sigmoid: Int32) -> Float32:
    """beta as the update uses it, by the runtime code beta_sigmoid (configs.BETA_SIGMOID): b as given when it is 0,
    else beta_sigmoid * sigmoid(b) (1: FLA's use_beta_sigmoid_in_kernel; 2: with allow_neg_eigval). fp32 math,
    full-precision exp; both values are formed and one selected (one scalar per token: no branch needed)."""
    sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-b))
    return cutlass.select_(beta_sigmoid == Int32(0), b, Float32(beta_sigmoid) * sig)


# ---------------------------------------------------------------- TF32 tensor-core helpers (3xTF32 products)

def tf32_split(x: Float32):
    """x = hi + lo with hi = x rounded to TF32 and lo = (x - hi) rounded to TF32 (cvt.rna: to nearest, ties away
    from zero), both as Int32 holding the TF32 bit patterns mma takes: hi*hi + hi*lo + lo*hi carries ~22 mantissa
    bits (3xTF32), what keeps the products at fp32 accuracy."""
    hi = Int32(cute.arch.cvt_f32_tf32(x))
    lo = Int32(cute.arch.cvt_f32_tf32(x - hi.bitcast(Float32)))
    return hi, lo


def _tf32_fragment(regs):
    """The TF32 bit patterns `regs` (Int32, from tf32_split) as an MMA operand fragment (V, 1, 1) of TFloat32: a
    register tensor of the patterns viewed as TFloat32, so the MMA takes them as they are (assigning fp32 values
    to a TFloat32 tensor would pass their untouched fp32 bits, which the MMA truncates)."""
    frag = cute.make_rmem_tensor(cute.make_layout((len(regs), 1, 1)), Int32)
    for i in range(len(regs)):
        frag[i] = regs[i]
    return cute.recast_tensor(frag, TFloat32)


def mma_tf32(a, b, c):
    """D = A B + C on the tensor cores: mma.sync m16n8k8, TF32 operands (a: 4 Int32, b: 2, as from tf32_split),
    fp32 accumulators c (4 Float32); returns D as 4 Float32. Element i of a, b, c, D is the instruction's fragment
    register i (layouts: PTX ISA, "mma.m16n8k8" for .tf32)."""
    atom = cute.make_mma_atom(cute.nvgpu.warp.MmaTF32Op((16, 8, 8)))
    acc = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
    for i in range(4):
        acc[i] = c[i]
    cute.gemm(atom, acc, _tf32_fragment(a), _tf32_fragment(b), acc)
    return [acc[i] for i in range(4)]


# ---------------------------------------------------------------- state pieces in either pool layout
# A state is [K, V] (K-first: element (r, c) at r V + c) or, in a V-first pool, [V, K] (at c K + r). The pool's
# element type is the pointer's (fp32 or bf16): loads convert to fp32, stores round to it.

def state_piece_offset(slot_head: Int64, row0, col0, K: int, V: int, v_first: bool) -> Int64:
    """Element offset of entry (row0, col0) of the state at slot_head = slot * HV + hv."""
    if v_first:
        return slot_head * (K * V) + Int64(col0) * K + row0
    return slot_head * (K * V) + Int64(row0) * V + col0


def load_state_piece(ptr: cute.Pointer, off: Int64, rows: int, cols: int, K: int, V: int, v_first: bool):
    """The rows x cols piece at `off` (state_piece_offset) as fp32 [rows][cols]: K-first one vector per row,
    V-first one vector per column (its rows are consecutive there)."""
    if v_first:
        by_col = [load_vec(ptr, off + Int64(c * K), rows) for c in range(cols)]
        return [[by_col[c][r] for c in range(cols)] for r in range(rows)]
    return [load_vec(ptr, off + Int64(r * V), cols) for r in range(rows)]


def store_state_piece(ptr: cute.Pointer, off: Int64, S, rows: int, cols: int, K: int, V: int, v_first: bool):
    """Inverse of load_state_piece: S [rows][cols] fp32, rounded to the pointer's element type."""
    if v_first:
        for c in range(cols):
            store_vec(ptr, off + Int64(c * K), [S[r][c] for r in range(rows)], rows)
    else:
        for r in range(rows):
            store_vec(ptr, off + Int64(r * V), S[r], cols)


def load_state_row(ptr: cute.Pointer, off: Int64, n: int, K: int, v_first: bool):
    """n consecutive columns of one state row at `off` (state_piece_offset) as fp32: one vector K-first, n
    scalar loads V-first (the columns are K apart there)."""
    if v_first:
        return [load_vec(ptr, off + Int64(c * K), 1)[0] for c in range(n)]
    return load_vec(ptr, off, n)
