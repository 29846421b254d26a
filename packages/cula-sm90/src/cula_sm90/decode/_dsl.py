"""Device helpers shared by the decode kernels (CuTe DSL): vector loads/stores through raw pointers, lane
reductions, the in-kernel gates and the L2 norm. Imported only by the kernel modules (never at package import).

Every helper is plain Python run while a kernel is traced (so its loops unroll) and works on Python lists of
DSL scalars: the sizes are compile-time constants, so a "vector" is a list the compiler keeps in registers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64

#: eps inside the square root of the L2 norm (cula_core.reference.gates.L2NORM_EPS, FLA's value).
L2NORM_EPS = 1e-6
#: torch.nn.functional.softplus's threshold: softplus(x) = x above it (as FLA's gate kernel).
SOFTPLUS_THRESHOLD = 20.0


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
