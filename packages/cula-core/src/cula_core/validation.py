"""Input validation shared by every public op: run once, in core, before any backend sees a tensor.

A bad input raises `ValueError` (wrong shape, value or range) or `TypeError` (wrong dtype or kind)
whose message names the argument, what was expected and what came. Validation only reads: it never
writes an input, so a rejected call leaves state pools bitwise as they were.

Checks of tensor *values* (cu_seqlens monotone, cache_idx in range, accept lengths in [0, T]) need the
data on the host. They run when the data already is there (a CPU tensor, or `cu_seqlens_cpu`), or when
``CULA_CHECK_DEVICE_VALUES=1`` allows a device-to-host copy; never while a CUDA graph is being captured or
torch.compile traces. Without them the kernels' own guards apply: a sequence range is clamped to the
tokens that exist and a slot index outside [0, P) is treated as a padded slot (nothing read or written).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT32_MAX = 2**31 - 1


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _dtype(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def require_tensor(name: str, t, *, ndim: int | None = None, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({', '.join(_dtype(d) for d in dtypes)}), got {_dtype(t.dtype)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {t.dim()}-D with shape {_shape(t)}")
    return t


def require_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        want = "[" + ", ".join(str(s) for s in expected) + "]"
        raise ValueError(f"{name} must have shape {layout} = {want}, got {_shape(t)}")


def require_same_device(tensors: dict[str, torch.Tensor | None]) -> torch.device:
    """The one device of the tensors (None entries skipped); anything else than a tensor is a TypeError."""
    device = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"all tensors must be on one device: {first} is on {device}, {name} is on {t.device}")
    return device


def values_checkable(t: torch.Tensor) -> bool:
    """Whether the values of `t` may be read on the host now (see the module docstring)."""
    if torch.compiler.is_compiling():
        return False
    if isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta":
        return False
    if t.device.type == "cpu":
        return True
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return os.environ.get("CULA_CHECK_DEVICE_VALUES", "") not in ("", "0")


def check_int32_indexing(sizes: dict[str, int], who: str) -> None:
    """For kernels that index with int32: every tensor's element count must stay below 2**31.

    `sizes` maps a tensor's name to its element count; it must name every tensor the kernels index, outputs
    included (see `forward_indexed_sizes`)."""
    for name, numel in sizes.items():
        if numel > INT32_MAX:
            raise ValueError(
                f"{name} has {numel} elements, more than {who} can index with int32 offsets (at most {INT32_MAX}); "
                f"split the batch"
            )


def forward_indexed_sizes(q, k, v, g, beta, initial_state, cu_seqlens, output_final_state: bool) -> dict[str, int]:
    """Element counts of every tensor a chunk_kda / kda_prefill kernel indexes: the inputs, the output o (v's
    size), the initial state if given and the final state ``[N, HV, K, V]`` if asked for (or its gradient
    in the backward). For `check_int32_indexing`: the states grow with N * HV * K * V, not with the tokens
    (4096 sequences of 32 tokens at HV = 64, K = V = 128 give 2**32-element states from 2**27-element q)."""
    sizes = {name: t.numel() for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                                             ("initial_state", initial_state)) if t is not None}
    if output_final_state:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        sizes["final_state"] = N * v.shape[2] * q.shape[3] * v.shape[3]
    return sizes


# --------------------------------------------------------------------------------------------------
# chunk_kda / kda_prefill
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KdaShapes:
    B: int
    T: int
    HQK: int
    HV: int
    K: int
    V: int
    N: int  # number of sequences: B, or len(cu_seqlens) - 1
    device: torch.device
    dtype: torch.dtype  # of q, k, v
    gate: str  # "precomputed" | "softplus" | "safe"
    seq_lens: tuple[int, ...] | None  # host copy of the sequence lengths when it was available


def gate_mode(use_gate_in_kernel: bool, lower_bound: float | None) -> str:
    """FLA 0.6.0's rule: with the gate computed in kernel, a `lower_bound` selects the bounded sigmoid
    ("safe") gate, its absence the softplus gate."""
    if not use_gate_in_kernel:
        return "precomputed"
    return "safe" if lower_bound is not None else "softplus"


def validate_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B: int, T: int) -> tuple[int, tuple[int, ...] | None]:
    """Returns (N, host lengths or None)."""
    require_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64))
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size B == 1 (flatten the sequences into one row), got B = {B}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have N + 1 >= 2 entries, got shape {_shape(cu_seqlens)}")
    host = None
    if cu_seqlens_cpu is not None:
        require_tensor("cu_seqlens_cpu", cu_seqlens_cpu, ndim=1, dtypes=(torch.int32, torch.int64))
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu must be on the cpu, got {cu_seqlens_cpu.device}")
        if cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(
                f"cu_seqlens_cpu must have the shape of cu_seqlens {_shape(cu_seqlens)}, got {_shape(cu_seqlens_cpu)}"
            )
        host = cu_seqlens_cpu
        if values_checkable(cu_seqlens) and not torch.equal(cu_seqlens.cpu().long(), cu_seqlens_cpu.long()):
            # one source of truth: some backends plan (and index) from the host copy, others read cu_seqlens
            i = int((cu_seqlens.cpu().long() != cu_seqlens_cpu.long()).nonzero()[0, 0])
            raise ValueError(f"cu_seqlens_cpu must hold the values of cu_seqlens, got cu_seqlens_cpu[{i}] = "
                             f"{int(cu_seqlens_cpu[i])} but cu_seqlens[{i}] = {int(cu_seqlens[i])}")
    elif values_checkable(cu_seqlens):
        host = cu_seqlens.cpu()
    if host is None:
        return cu_seqlens.shape[0] - 1, None
    values = host.tolist()
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"cu_seqlens must be non-decreasing, got cu_seqlens[{i - 1}] = {values[i - 1]} > "
                f"cu_seqlens[{i}] = {values[i]}"
            )
    if values[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {T} (the token count of q), got {values[-1]}")
    return len(values) - 1, tuple(values[i + 1] - values[i] for i in range(len(values) - 1))


#: FLA 0.6.0's range for `lower_bound` with safe_gate=True (cula_core.reference.gates explains why).
SAFE_GATE_LOWER_BOUND_RANGE = (-5.0, 0.0)


def validate_lower_bound(lower_bound, *, safe_gate: bool = False) -> None:
    """The one rule for `lower_bound`, every op (FLA 0.6.0's): None or a finite real number, any value; only
    ``safe_gate=True`` (an argument of chunk_kda / kda_prefill alone, with the gate in kernel) narrows it to
    FLA's safe range [-5, 0) and makes it required. A non-finite bound is rejected (FLA would let it turn
    every state NaN); so a model prefilled with a bound decodes with the same bound."""
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
            raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
        if not math.isfinite(lower_bound):
            raise ValueError(f"lower_bound must be a finite float or None, got {lower_bound}")
    if safe_gate:
        lo, hi = SAFE_GATE_LOWER_BOUND_RANGE
        if lower_bound is None:
            raise ValueError("safe_gate=True with use_gate_in_kernel=True requires lower_bound (e.g. -5.0), got None")
        if not lo <= float(lower_bound) < hi:
            raise ValueError(f"lower_bound must be in the safe range [-5, 0) with safe_gate=True, got {lower_bound}")


def validate_gate_args(g_name, use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound, HV, K, device, *,
                       gate_in_kernel_by="use_gate_in_kernel=True") -> None:
    """`gate_in_kernel_by` names what makes the op compute the gate in kernel, for the message when A_log is
    missing: the argument for chunk_kda / kda_prefill; the decode ops, which always do, say so instead."""
    validate_lower_bound(lower_bound, safe_gate=bool(safe_gate and use_gate_in_kernel))
    if not use_gate_in_kernel:
        return
    if A_log is None and lower_bound is None:
        raise ValueError(
            f"{gate_in_kernel_by} requires A_log of shape [HV] = [{HV}] (or lower_bound for the safe gate), "
            "got None"
        )
    if A_log is not None:
        require_tensor("A_log", A_log, ndim=1)
        require_shape("A_log", A_log, (HV,), "[HV]")
    if dt_bias is not None:
        require_tensor("dt_bias", dt_bias, ndim=1)
        require_shape("dt_bias", dt_bias, (HV * K,), "[HV*K]")


def validate_kda(
    q, k, v, g, beta, *, scale, initial_state, use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound,
    cu_seqlens, cu_seqlens_cpu,
) -> KdaShapes:
    """Checks the arguments of chunk_kda / kda_prefill (FLA layout) and returns the problem's sizes."""
    require_tensor("q", q, ndim=4)
    B, T, HQK, K = q.shape
    require_tensor("k", k, ndim=4)
    require_shape("k", k, (B, T, HQK, K), "[B, T, HQK, K] (the shape of q)")
    require_tensor("v", v, ndim=4)
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v must have shape [B, T, HV, V] with B = {B}, T = {T} (from q), got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if K == 0 or V == 0:
        raise ValueError(f"head dims must be positive, got K = {K} (q.shape[-1]) and V = {V} (v.shape[-1])")
    if HQK == 0 or HV == 0:
        raise ValueError(f"head counts must be positive, got HQK = {HQK} (q.shape[2]) and HV = {HV} (v.shape[2])")
    if HV % HQK != 0:
        raise ValueError(f"HV % HQK must be 0 (HV value heads share HQK q/k heads), got HV = {HV}, HQK = {HQK}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {_dtype(q.dtype)}, k {_dtype(k.dtype)}, "
                        f"v {_dtype(v.dtype)}")
    require_tensor("g", g, ndim=4)
    require_shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    require_tensor("beta", beta, ndim=3)
    require_shape("beta", beta, (B, T, HV), "[B, T, HV]")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    validate_gate_args("g", use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound, HV, K, q.device)

    device = require_same_device(
        {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state, "A_log": A_log,
         "dt_bias": dt_bias, "cu_seqlens": cu_seqlens}
    )
    N, seq_lens = B, None
    if cu_seqlens is not None:
        N, seq_lens = validate_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T)
    elif cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu was given without cu_seqlens; pass both (cu_seqlens on the device)")
    if initial_state is not None:
        require_tensor("initial_state", initial_state, dtypes=(torch.float32, torch.float64))
        if initial_state.dtype == torch.float64 and q.dtype != torch.float64:
            raise TypeError(f"initial_state must be float32, got {_dtype(initial_state.dtype)}")
        require_shape("initial_state", initial_state, (N, HV, K, V), "[N, HV, K, V]")
    return KdaShapes(B, T, HQK, HV, K, V, N, device, q.dtype, gate_mode(use_gate_in_kernel, lower_bound), seq_lens)


# --------------------------------------------------------------------------------------------------
# decode family
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeShapes:
    N: int  # requests in the batch (padded slots included)
    T: int  # tokens per request in this step
    HQK: int
    HV: int
    K: int
    V: int
    P: int  # slots in the state pool
    device: torch.device
    dtype: torch.dtype
    gate: str  # "softplus" | "safe"


#: dtypes of a serving state pool: the state math runs in fp32 and the pool stores its dtype (fp64: the reference
#: only, for fp64 checks)
POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def pool_layout(state_v_first: bool) -> str:
    return "[P, HV, V, K] (state_v_first=True)" if state_v_first else "[P, HV, K, V]"


def validate_state_pool(name: str, pool, HV: int, K: int, V: int, state_v_first: bool = False) -> int:
    """A serving pool: ``[P, HV, K, V]`` or, with `state_v_first`, ``[P, HV, V, K]``; fp32 / bf16 (fp64 for the
    reference); contiguous. Returns P."""
    require_tensor(name, pool, ndim=4, dtypes=POOL_DTYPES)
    trailing = (V, K) if state_v_first else (K, V)
    if pool.shape[1:] != (HV, *trailing):
        want = ", ".join(str(s) for s in (HV, *trailing))
        raise ValueError(f"{name} must have shape {pool_layout(state_v_first)} = [P, {want}], got {_shape(pool)}")
    if not pool.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is updated in place), got strides {tuple(pool.stride())}")
    return pool.shape[0]


def validate_null_slot(null_slot, P: int) -> None:
    """`null_slot`: None, or the pool slot an engine reserves for padding (vLLM's null block 0); a request whose
    index is that slot is padded like a negative index: nothing read or written, zero output."""
    if null_slot is None:
        return
    if isinstance(null_slot, bool) or not isinstance(null_slot, int):
        raise TypeError(f"null_slot must be an int or None, got {type(null_slot).__name__}")
    if not 0 <= null_slot < P:
        raise ValueError(f"null_slot must be a slot of the state pool, 0 <= null_slot < P = {P}, got {null_slot}")


def validate_cache_idx(cache_idx, N: int, P: int, null_slot: int | None = None) -> None:
    require_tensor("cache_idx", cache_idx, ndim=1, dtypes=(torch.int32,))
    require_shape("cache_idx", cache_idx, (N,), "[N]")
    if not values_checkable(cache_idx):
        return
    idx = cache_idx.cpu()
    bad = (idx >= P).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"cache_idx[{i}] = {int(idx[i])} is out of range for a state pool of P = {P} slots "
                         f"(expected -1 for a padded slot or 0 <= idx < {P})")
    live = idx[(idx >= 0) & (idx != (-1 if null_slot is None else null_slot))]
    if live.numel() != live.unique().numel():
        uniq, counts = live.unique(return_counts=True)
        dup = int(uniq[counts > 1][0])
        raise ValueError(f"cache_idx holds slot {dup} more than once: two requests would write one state")


def validate_accept_len(accept_len, N: int, T: int, device) -> None:
    if isinstance(accept_len, bool) or not isinstance(accept_len, (int, torch.Tensor)):
        raise TypeError(f"accept_len must be an int or an [N] int32 tensor, got {type(accept_len).__name__}")
    if isinstance(accept_len, int):
        if not 0 <= accept_len <= T:
            raise ValueError(f"accept_len must be in [0, T] = [0, {T}], got {accept_len}")
        return
    if accept_len.dtype != torch.int32:
        raise TypeError(f"accept_len must be an int or an [N] int32 tensor, got a tensor of dtype "
                        f"{_dtype(accept_len.dtype)}")
    require_tensor("accept_len", accept_len, ndim=1, dtypes=(torch.int32,))
    require_shape("accept_len", accept_len, (N,), "[N]")
    if accept_len.device != device:
        raise ValueError(f"all tensors must be on one device: the state pool is on {device}, "
                         f"accept_len is on {accept_len.device}")
    if values_checkable(accept_len):
        a = accept_len.cpu()
        bad = ((a < 0) | (a > T)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"accept_len[{i}] = {int(a[i])} is outside [0, T] = [0, {T}]")


def validate_decode(q, k, v, g, beta, state_pool, cache_idx, *, A_log, dt_bias, scale, lower_bound,
                    single_token: bool, state_v_first: bool = False, null_slot: int | None = None) -> DecodeShapes:
    require_tensor("q", q, ndim=4)
    N, T, HQK, K = q.shape
    if single_token and T != 1:
        raise ValueError(f"kda_decode takes one token per request: q must have shape [N, 1, HQK, K], got {_shape(q)}")
    if T == 0:
        raise ValueError(f"q must hold at least one token per request, got shape {_shape(q)}")
    require_tensor("k", k, ndim=4)
    require_shape("k", k, (N, T, HQK, K), "[N, T, HQK, K] (the shape of q)")
    require_tensor("v", v, ndim=4)
    if v.shape[:2] != (N, T):
        raise ValueError(f"v must have shape [N, T, HV, V] with N = {N}, T = {T} (from q), got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if K == 0 or V == 0:
        raise ValueError(f"head dims must be positive, got K = {K} (q.shape[-1]) and V = {V} (v.shape[-1])")
    if HQK == 0 or HV % HQK != 0:
        raise ValueError(f"HV % HQK must be 0 (HV value heads share HQK q/k heads), got HV = {HV}, HQK = {HQK}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {_dtype(q.dtype)}, k {_dtype(k.dtype)}, "
                        f"v {_dtype(v.dtype)}")
    require_tensor("g", g, ndim=4)
    require_shape("g", g, (N, T, HV, K), "[N, T, HV, K]")
    require_tensor("beta", beta, ndim=3)
    require_shape("beta", beta, (N, T, HV), "[N, T, HV]")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    validate_gate_args("g", True, A_log, dt_bias, False, lower_bound, HV, K, q.device,
                       gate_in_kernel_by="the decode ops' in-kernel gate")
    P = validate_state_pool("state_pool", state_pool, HV, K, V, state_v_first)
    require_same_device({"q": q, "k": k, "v": v, "g": g, "beta": beta, "state_pool": state_pool,
                         "cache_idx": cache_idx, "A_log": A_log, "dt_bias": dt_bias})
    validate_null_slot(null_slot, P)
    validate_cache_idx(cache_idx, N, P, null_slot)
    return DecodeShapes(N, T, HQK, HV, K, V, P, q.device, q.dtype, gate_mode(True, lower_bound))


def kvbuffer_shape(N: int, T: int, HV: int, K: int, V: int) -> tuple[int, int, int, int]:
    """The KVBuffer of the verify/flush pair: per request, token and value head, 2K + V fp32 values
    (the token's key, its cumulative log gate, its delta); see cula_core.ops.kvbuffer."""
    return (N, T, HV, 2 * K + V)


def kvbuffer_dtype(pool_dtype: torch.dtype) -> torch.dtype:
    """The KVBuffer is fp32 whatever the pool stores (fp64 beside an fp64 reference pool)."""
    return torch.float64 if pool_dtype == torch.float64 else torch.float32


def validate_kvbuffer(name: str, kvbuffer, state_pool, cache_idx, accept_len, *, state_v_first: bool = False,
                      null_slot: int | None = None) -> tuple[int, int]:
    """Checks a flush's arguments; returns (N, T)."""
    require_tensor(name, kvbuffer, ndim=4, dtypes=(torch.float32, torch.float64))
    require_tensor("state_pool", state_pool, ndim=4, dtypes=POOL_DTYPES)
    P, HV = state_pool.shape[:2]
    K, V = (state_pool.shape[3], state_pool.shape[2]) if state_v_first else state_pool.shape[2:]
    validate_state_pool("state_pool", state_pool, HV, K, V, state_v_first)
    require_tensor("cache_idx", cache_idx, ndim=1, dtypes=(torch.int32,))
    N, T = cache_idx.shape[0], kvbuffer.shape[1]
    # N comes from cache_idx (one entry per request): a buffer of another batch is the buffer's fault
    require_shape(name, kvbuffer, kvbuffer_shape(N, T, HV, K, V), "[N, T, HV, 2K+V] (N = len(cache_idx))")
    if kvbuffer.dtype != kvbuffer_dtype(state_pool.dtype):
        raise TypeError(f"{name} must be {_dtype(kvbuffer_dtype(state_pool.dtype))} (the KVBuffer of a "
                        f"{_dtype(state_pool.dtype)} pool), got {_dtype(kvbuffer.dtype)}")
    require_same_device({"state_pool": state_pool, name: kvbuffer, "cache_idx": cache_idx})
    validate_null_slot(null_slot, P)
    validate_cache_idx(cache_idx, N, P, null_slot)
    validate_accept_len(accept_len, N, T, state_pool.device)
    return N, T


def require_disjoint(name: str, tensors) -> None:
    """Tensors that are updated in place in one call must not share memory: `name`[j] overlapping `name`[i]
    would be written twice (e.g. the same pool passed for two layers). Compares the byte ranges of real
    tensors; fake and meta tensors (tracing) have none and are skipped."""
    spans = []
    for i, t in enumerate(tensors):
        if isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta" or t.numel() == 0:
            continue
        start = t.data_ptr()
        spans.append((t.device, start, start + t.numel() * t.element_size(), i))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for (dev_a, _, end_a, i), (dev_b, start_b, _, j) in zip(spans, spans[1:]):
        if dev_a == dev_b and start_b < end_a:
            i, j = min(i, j), max(i, j)
            raise ValueError(f"{name}[{j}] shares memory with {name}[{i}]: each layer needs its own pool "
                             f"(an aliased pool would be flushed twice)")
