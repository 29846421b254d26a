"""Device helpers shared by the prefill kernels: locating a chunk in the varlen layout, beta activations."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

BT = 64  # chunk length of every prefill kernel


@cute.jit
def find_chunk(cu: cute.Tensor, co: cute.Tensor, chunk: Int32, N: Int32, search_steps: Int32):
    """Sequence of global chunk `chunk`: the largest n with co[n] <= chunk (co: first chunk of each sequence,
    [N + 1]; empty sequences own no chunk). Returns (n, first token, valid tokens, chunk exists).

    A fixed number of binary-search steps (ceil(log2 N) + 1, from the host, which knows N from a shape), so
    no host synchronisation and no data-dependent loop bound."""
    lo = Int32(0)
    hi = N - 1
    for _ in cutlass.range(search_steps):
        if lo < hi:
            mid = (lo + hi + 1) // 2
            if co[mid] <= chunk:
                lo = mid
            else:
                hi = mid - 1
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
