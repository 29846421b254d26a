"""FLA 0.6.0's argument conventions that cula's ops share: the deprecated `transpose_state_layout` alias,
the beta activation flags, `chunk_size`, gate parameters of any shape, the V-first state layout, and the
validation of `fused_recurrent_kda`'s arguments (its state pools and slot indices).

Like `cula_core.validation`, everything here only reads its inputs and raises `ValueError` / `TypeError`
naming the argument, the expected and the actual value, before any kernel runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from cula_core.validation import (
    KdaShapes,
    require_same_device,
    require_shape,
    require_tensor,
    validate_kda,
    values_checkable,
)

# The chunk lengths FLA's chunked KDA kernels are written for.
FLA_CHUNK_SIZES = (32, 64)
INDEX_DTYPES = (torch.int32, torch.int64)
# dtypes a fused_recurrent_kda state may have (serving pools are often bf16); fp64 only with fp64 inputs.
RECURRENT_STATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _dtype(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def state_v_first_from(state_v_first: bool, kwargs: dict) -> bool:
    """FLA's layout flag, taking its deprecated alias ``transpose_state_layout`` out of `kwargs`: the alias
    warns with a `DeprecationWarning` (as FLA does), and naming both is a `ValueError`."""
    if "transpose_state_layout" not in kwargs:
        return bool(state_v_first)
    alias = kwargs.pop("transpose_state_layout")
    if state_v_first:
        raise ValueError("state_v_first and its deprecated alias transpose_state_layout were both given; "
                         "pass state_v_first only")
    warnings.warn("transpose_state_layout is deprecated: it is the old name of state_v_first",
                  DeprecationWarning, stacklevel=3)
    return bool(alias)


def beta_activation(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> str:
    """The kernel calling convention's beta activation ("none", "sigmoid", "2sigmoid") for FLA's two flags."""
    if allow_neg_eigval:
        if not use_beta_sigmoid_in_kernel:
            raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (beta becomes "
                             "2 * sigmoid(beta)), got use_beta_sigmoid_in_kernel=False")
        return "2sigmoid"
    return "sigmoid" if use_beta_sigmoid_in_kernel else "none"


def check_chunk_size(chunk_size) -> int:
    # The text matches FLA's own tests (`chunk_size` must be either 32 or 64).
    if isinstance(chunk_size, bool) or chunk_size not in FLA_CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size!r}")
    return int(chunk_size)


def flatten_gate_params(A_log, dt_bias, HV: int, K: int):
    """FLA takes ``A_log`` of any shape holding HV elements (its tests pass ``[1, 1, HV, 1]``) and ``dt_bias``
    of any shape holding HV * K: both as the 1-D views ``[HV]`` and ``[HV * K]`` (reshape, so gradients reach
    the caller's tensors), or the error naming the element count."""
    out = []
    for name, t, n, layout in (("A_log", A_log, HV, "[HV]"), ("dt_bias", dt_bias, HV * K, "[HV*K]")):
        if t is None:
            out.append(None)
            continue
        require_tensor(name, t)
        if t.numel() != n:
            raise ValueError(f"{name} must have shape {layout} = [{n}], got {_shape(t)}; any shape holding "
                             f"{n} elements is accepted")
        out.append(t if t.dim() == 1 else t.reshape(n))
    return tuple(out)


def problem_sizes(q, v, cu_seqlens) -> tuple[int, int, int, int] | None:
    """(N, HV, K, V) read from the shapes alone, or None while q / v / cu_seqlens are malformed (their own
    checks then report them)."""
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4 and v.dim() == 4):
        return None
    if cu_seqlens is None:
        N = q.shape[0]
    elif isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1:
        N = cu_seqlens.shape[0] - 1
    else:
        return None
    return N, v.shape[2], q.shape[3], v.shape[3]


def state_layout(v_first: bool) -> str:
    return "[N, HV, V, K] (state_v_first=True)" if v_first else "[N, HV, K, V]"


def check_v_first_state_shape(name: str, state, q, v, cu_seqlens) -> None:
    """With ``state_v_first=True``, `state` must be ``[N, HV, V, K]``; checked here, where the message can name
    that layout (the rest of the state's checks run on its transposed view)."""
    sizes = problem_sizes(q, v, cu_seqlens)
    if sizes is None or not isinstance(state, torch.Tensor):
        return
    N, HV, K, V = sizes
    require_shape(name, state, (N, HV, V, K), state_layout(True))


# --------------------------------------------------------------------------------------------------
# chunk_kda / kda_prefill
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkCall:
    """A chunk_kda / kda_prefill call after FLA's arguments are resolved and validated: contiguous tensors
    (A_log / dt_bias 1-D, None without the in-kernel gate; initial_state in the caller's layout), the
    default scale applied, and the calling convention's flags."""

    tensors: tuple  # (q, k, v, g, beta, A_log, dt_bias, initial_state)
    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None
    scale: float
    gate: str
    lower_bound: float | None
    beta_activation: str
    state_v_first: bool
    chunk_size: int
    N: int


def resolve_chunk_call(fn: str, q, k, v, g, beta, *, scale, initial_state, use_gate_in_kernel,
                       use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, disable_recompute,
                       return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu, cp_context, use_graph,
                       max_num_seqs, A_log, dt_bias, kwargs: dict) -> ChunkCall:
    """FLA 0.6.0's `chunk_kda` arguments, checked and resolved for op `fn` ("chunk_kda", "kda_prefill").

    `kwargs` are the call's extra keyword arguments: ``chunk_size`` and ``transpose_state_layout`` are FLA's;
    any other name is a `TypeError`. ``cp_context`` raises `NotImplementedError` (`chunk_kda` serves it through
    `cula_core.context_parallel` before resolving; other ops do not take it). ``use_graph`` / ``max_num_seqs``
    and ``disable_recompute`` do not change the result;
    FLA's consistency rules for them are kept."""
    kwargs = dict(kwargs)
    state_v_first = state_v_first_from(state_v_first, kwargs)
    chunk_size = check_chunk_size(kwargs.pop("chunk_size", 64))
    for name in kwargs:
        raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")
    if cp_context is not None:  # chunk_kda hands cp_context calls to cula_core.context_parallel before this
        raise NotImplementedError(f"{fn} does not take cp_context (context parallel across ranks); call "
                                  "chunk_kda(..., cp_context=...) for that")
    if use_graph and max_num_seqs is not None and isinstance(cu_seqlens, torch.Tensor) \
            and cu_seqlens.shape[0] - 1 != max_num_seqs:
        raise ValueError(f"use_graph=True needs cu_seqlens padded with empty sequences to max_num_seqs + 1 = "
                         f"{max_num_seqs + 1} entries, got {cu_seqlens.shape[0]}")
    if return_intermediate_states and disable_recompute:
        raise ValueError("return_intermediate_states=True requires disable_recompute=False (as in FLA), got "
                         "disable_recompute=True")
    activation = beta_activation(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    sizes = problem_sizes(q, v, cu_seqlens)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    elif sizes is not None:
        A_log, dt_bias = flatten_gate_params(A_log, dt_bias, sizes[1], sizes[2])
    checked_state = initial_state
    if state_v_first and isinstance(initial_state, torch.Tensor):
        check_v_first_state_shape("initial_state", initial_state, q, v, cu_seqlens)
        checked_state = initial_state.transpose(-1, -2)  # a view: validation reads [N, HV, K, V]
    shapes = validate_kda(
        q, k, v, g, beta, scale=scale, initial_state=checked_state, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    tensors = tuple(t.contiguous() if t is not None else None
                    for t in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    return ChunkCall(tensors, cu_seqlens, cu_seqlens_cpu, float(shapes.K ** -0.5 if scale is None else scale),
                     shapes.gate, None if lower_bound is None else float(lower_bound), activation, state_v_first,
                     chunk_size, shapes.N)


# --------------------------------------------------------------------------------------------------
# fused_recurrent_kda
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecurrentShapes:
    sizes: KdaShapes  # the problem's sizes, gate mode and host sequence lengths, as chunk_kda's
    P: int  # pool slots (pool mode), else 0
    pool: bool  # ssm_state_indices given: initial_state is a pool updated in place
    index_cols: int  # 0 (no indices), 1 ([N] indices) or T_idx ([N, T_idx] indices)


def _check_state_dtype(name: str, state: torch.Tensor, q_dtype: torch.dtype) -> None:
    allowed = RECURRENT_STATE_DTYPES + ((torch.float64,) if q_dtype == torch.float64 else ())
    require_tensor(name, state, dtypes=allowed)


def _check_indices(ssm_state_indices, num_accepted_tokens, N: int, P: int, seq_lens) -> int:
    """Checks the slot indices (and accepted counts) of the pool mode; returns index_cols."""
    idx = ssm_state_indices
    require_tensor("ssm_state_indices", idx, dtypes=INDEX_DTYPES)
    if idx.dim() not in (1, 2):
        raise ValueError(f"ssm_state_indices must be [N] or [N, T] (a slot per token), got {idx.dim()}-D "
                         f"with shape {_shape(idx)}")
    if idx.shape[0] != N:
        raise ValueError(f"ssm_state_indices must have N = {N} rows (one per sequence), got shape {_shape(idx)}")
    cols = 1 if idx.dim() == 1 else idx.shape[1]
    if idx.dim() == 2 and cols == 0:
        raise ValueError(f"ssm_state_indices [N, T] must have at least one column, got shape {_shape(idx)}")
    if idx.dim() == 2 and seq_lens is not None and seq_lens and max(seq_lens) > cols:
        n = max(range(len(seq_lens)), key=lambda i: seq_lens[i])
        raise ValueError(f"ssm_state_indices [N, T] needs a slot for every token: sequence {n} has {seq_lens[n]} "
                         f"tokens, ssm_state_indices has {cols} columns")
    acc = num_accepted_tokens
    if acc is not None:
        if idx.dim() != 2:
            raise ValueError("num_accepted_tokens requires ssm_state_indices of shape [N, T] (the slot of each "
                             f"token), got shape {_shape(idx)}")
        require_tensor("num_accepted_tokens", acc, ndim=1, dtypes=INDEX_DTYPES)
        require_shape("num_accepted_tokens", acc, (N,), "[N]")
    if not values_checkable(idx) or (acc is not None and not values_checkable(acc)):
        return cols
    host = idx.cpu().long().reshape(N, cols)
    bad = (host >= P).nonzero()
    if bad.numel():
        n, t = (int(x) for x in bad[0])
        where = f"[{n}]" if idx.dim() == 1 else f"[{n}, {t}]"
        raise ValueError(f"ssm_state_indices{where} = {int(host[n, t])} is out of range for a state pool of "
                         f"P = {P} slots (expected a negative value for a padded slot, or 0 <= index < {P})")
    read_col = torch.zeros(N, dtype=torch.long)
    if acc is not None:
        a = acc.cpu().long()
        bad = ((a < 1) | (a > cols)).nonzero()
        if bad.numel():
            n = int(bad[0, 0])
            raise ValueError(f"num_accepted_tokens[{n}] = {int(a[n])} is outside [1, T] = [1, {cols}] "
                             "(the state read is the one after the last accepted token)")
        read_col = a - 1
    # A slot may belong to one sequence only: two sequences reading or writing one state would race.
    owner: dict[int, int] = {}
    for n in range(N):
        read = int(host[n, read_col[n]])
        if read < 0:
            continue  # a padded sequence reads and writes nothing
        length = seq_lens[n] if seq_lens is not None else cols
        used = {read} | ({int(s) for s in host[n, :min(length, cols)] if s >= 0} if idx.dim() == 2 else set())
        for s in used:
            if owner.setdefault(s, n) != n:
                raise ValueError(f"ssm_state_indices gives slot {s} to sequences {owner[s]} and {n}: two sequences "
                                 "would read or write one state")
    return cols


def validate_fused_recurrent(q, k, v, g, beta, *, A_log, dt_bias, scale, initial_state, use_gate_in_kernel,
                             lower_bound, state_v_first, cu_seqlens, cu_seqlens_cpu, ssm_state_indices,
                             num_accepted_tokens) -> RecurrentShapes:
    """Checks `fused_recurrent_kda`'s arguments (A_log / dt_bias already 1-D, see `flatten_gate_params`): the
    tensors as `validate_kda` checks chunk_kda's (beta may also be ``[B, T, HV, V]``), then the states: the
    initial state, or the pool with its slot indices and accepted counts."""
    beta_checked = beta
    if isinstance(beta, torch.Tensor) and beta.dim() == 4 and isinstance(v, torch.Tensor) and v.dim() == 4:
        require_tensor("beta", beta)
        require_shape("beta", beta, tuple(v.shape), "[B, T, HV, V] (a beta per value channel)")
        beta_checked = beta[..., 0]  # the per-head checks of validate_kda, on a view
    # fused_recurrent_kda has no safe_gate flag: lower_bound selects the bounded gate (FLA's kernel rule).
    shapes = validate_kda(q, k, v, g, beta_checked, scale=scale, initial_state=None,
                          use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, safe_gate=False,
                          lower_bound=lower_bound, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    B, T, HV, K, V, N = shapes.B, shapes.T, shapes.HV, shapes.K, shapes.V, shapes.N
    require_same_device({"q": q, "initial_state": initial_state, "ssm_state_indices": ssm_state_indices,
                         "num_accepted_tokens": num_accepted_tokens})
    seq_lens = shapes.seq_lens if cu_seqlens is not None else (T,) * B

    trailing = (V, K) if state_v_first else (K, V)
    if ssm_state_indices is None:
        if num_accepted_tokens is not None:
            raise ValueError("num_accepted_tokens requires ssm_state_indices (the pool slots it selects from)")
        if initial_state is not None:
            _check_state_dtype("initial_state", initial_state, q.dtype)
            require_shape("initial_state", initial_state, (N, HV, *trailing), state_layout(state_v_first))
        return RecurrentShapes(shapes, 0, False, 0)

    if initial_state is None:
        raise ValueError("ssm_state_indices requires initial_state: the state pool [P, HV, K, V] "
                         "([P, HV, V, K] with state_v_first=True) it indexes and updates in place, got None")
    _check_state_dtype("initial_state", initial_state, q.dtype)
    pool_layout = "[P, HV, V, K] (state_v_first=True)" if state_v_first else "[P, HV, K, V]"
    if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (HV, *trailing):
        want = ", ".join(str(s) for s in (HV, *trailing))
        raise ValueError(f"initial_state (the state pool) must have shape {pool_layout} = [P, {want}], "
                         f"got {_shape(initial_state)}")
    P = initial_state.shape[0]
    inner = initial_state[0] if P else None
    if inner is not None and not inner.is_contiguous():
        raise ValueError("initial_state (the state pool) must have contiguous slots (it is updated in place; "
                         f"any slot stride is accepted), got strides {tuple(initial_state.stride())}")
    cols = _check_indices(ssm_state_indices, num_accepted_tokens, N, P, seq_lens)
    return RecurrentShapes(shapes, P, True, cols)
