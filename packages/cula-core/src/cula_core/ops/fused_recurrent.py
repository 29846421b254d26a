"""`fused_recurrent_kda`: KDA token by token, FLA 0.6.0's `fla.ops.kda.fused_recurrent_kda` signature, plus
the continuous-batching mode of FLA's kernel (state pools indexed by ``ssm_state_indices``, as vLLM and SGLang
call it).

A repeated pool call without ``cu_seqlens`` runs its plan (cula_core.plans: validation and dispatch once per call
signature; the compiled plan table where the backend states a program). Two torch custom ops carry it, both
dispatched under the op name ``fused_recurrent_kda``:
``cula::fused_recurrent_kda`` (states in, a new final state out) and ``cula::fused_recurrent_kda_pool``
(``initial_state`` is a pool, updated in place). Neither has autograd (FLA's has none either).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cula_core import plans
from cula_core.cute_runtime import plan_table
from cula_core.fla_args import beta_activation, flatten_gate_params, state_v_first_from, validate_fused_recurrent
from cula_core.dispatch import on_input_device
from cula_core.ops._common import (
    absent_like,
    call_op,
    fake_forward_outputs,
    layout_kwargs,
    make_call,
    native_v_first,
    select,
    swap_state_layout,
    unaliased,
)

_KWARGS = ("ssm_state_indices", "num_accepted_tokens", "cu_seqlens_cpu")


def _call(q, v, beta, state, cu_seqlens, ssm_state_indices, num_accepted_tokens, *, gate, use_qk_l2norm_in_kernel,
          beta_activation, output_final_state, state_v_first, lower_bound, seq_len):
    _B, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    return make_call(
        "fused_recurrent_kda", q.device, dtype=q.dtype, K=K, V=V, HQK=HQK, HV=HV, T=T, gate=gate,
        varlen=cu_seqlens is not None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        beta_activation=beta_activation, beta_per_channel=beta.dim() == 4, initial_state=state is not None,
        output_final_state=output_final_state, state_v_first=state_v_first,
        state_dtype=state.dtype if state is not None else None, pool=ssm_state_indices is not None,
        per_token_slots=ssm_state_indices is not None and ssm_state_indices.dim() == 2,
        num_accepted_tokens=num_accepted_tokens is not None, lower_bound=lower_bound, seq_len=seq_len,
        state_contiguous=state is None or state.is_contiguous(),
    )


def common_seq_len(T: int, varlen: bool, seq_lens: tuple[int, ...] | None) -> int | None:
    """The `seq_len` option of a call: the token count of every sequence when they all have the same one and the
    host knows it (T without cu_seqlens; with cu_seqlens, the host lengths validation read), else None."""
    if not varlen:
        return T
    if not seq_lens or any(n != seq_lens[0] for n in seq_lens):
        return None
    return seq_lens[0]


def _sizes(q, k, v, g, beta, state, final_numel: int) -> dict:
    sizes = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": state}
    if final_numel:
        sizes["final_state"] = final_numel
    return sizes


def _fused_recurrent_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
    initial_state: Tensor | None, cu_seqlens: Tensor | None, scale: float, output_final_state: bool,
    use_qk_l2norm_in_kernel: bool, gate: str, lower_bound: float | None, beta_activation: str, state_v_first: bool,
    seq_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    call = _call(q, v, beta, initial_state, cu_seqlens, None, None, gate=gate,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                 output_final_state=output_final_state, state_v_first=state_v_first, lower_bound=lower_bound,
                 seq_len=seq_len)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final_numel = N * v.shape[2] * q.shape[3] * v.shape[3] if output_final_state else 0
    backend = select(call, _sizes(q, k, v, g, beta, initial_state, final_numel))
    native = native_v_first(backend, call)
    copy_layout = state_v_first and not native
    o, final_state = backend.kernel("fused_recurrent_kda")(
        q, k, v, g, beta, A_log, dt_bias, swap_state_layout(initial_state) if copy_layout else initial_state,
        cu_seqlens, None, None, scale=scale, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate, lower_bound=lower_bound,
        beta_activation=beta_activation, **layout_kwargs(native),
    )
    final_state = swap_state_layout(final_state) if copy_layout else unaliased(final_state, initial_state)
    return o, final_state if final_state is not None else absent_like(q, torch.float32)


_fused_recurrent_kda_op = torch.library.custom_op("cula::fused_recurrent_kda", _fused_recurrent_kda, mutates_args=())


@_fused_recurrent_kda_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, output_final_state,
      use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, state_v_first, seq_len=None):
    return fake_forward_outputs(q, v, cu_seqlens, output_final_state, state_v_first)


def _fused_recurrent_kda_pool(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
    state_pool: Tensor, ssm_state_indices: Tensor, num_accepted_tokens: Tensor | None, cu_seqlens: Tensor | None,
    scale: float, use_qk_l2norm_in_kernel: bool, gate: str, lower_bound: float | None, beta_activation: str,
    state_v_first: bool, seq_len: int | None = None,
) -> Tensor:
    call = _call(q, v, beta, state_pool, cu_seqlens, ssm_state_indices, num_accepted_tokens, gate=gate,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                 output_final_state=False, state_v_first=state_v_first, lower_bound=lower_bound, seq_len=seq_len)
    backend = select(call, _sizes(q, k, v, g, beta, state_pool, 0))
    native = native_v_first(backend, call)
    # A kernel that indexes only [P, HV, K, V] pools gets a K-first copy of a V-first pool, copied back after.
    pool = swap_state_layout(state_pool) if state_v_first and not native else state_pool
    o, _ = backend.kernel("fused_recurrent_kda")(
        q, k, v, g, beta, A_log, dt_bias, pool, cu_seqlens, ssm_state_indices, num_accepted_tokens, scale=scale,
        output_final_state=False, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate,
        lower_bound=lower_bound, beta_activation=beta_activation, **layout_kwargs(native),
    )
    if pool is not state_pool:
        state_pool.copy_(pool.transpose(-1, -2))
    return o


_fused_recurrent_kda_pool_op = torch.library.custom_op("cula::fused_recurrent_kda_pool", _fused_recurrent_kda_pool,
                                                       mutates_args=("state_pool",))


@_fused_recurrent_kda_pool_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, state_pool, ssm_state_indices, num_accepted_tokens, cu_seqlens, scale,
      use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, state_v_first, seq_len=None):
    return torch.empty_like(v)


#: the keyword arguments of a pool call that may have a plan (no cu_seqlens_cpu, no deprecated alias)
_POOL_PLAN_KWARGS = frozenset(("ssm_state_indices", "num_accepted_tokens"))


def _kernel_gate_params(q, v, A_log, dt_bias, use_gate_in_kernel: bool):
    """A_log and dt_bias as the kernels take them: None without the gate in kernel, else FLA's any-shape tensors as
    1-D views where q and v are well-formed (malformed ones are left to validation's own errors)."""
    if not use_gate_in_kernel:
        return None, None
    if isinstance(q, Tensor) and isinstance(v, Tensor) and q.dim() == 4 and v.dim() == 4:
        return flatten_gate_params(A_log, dt_bias, v.shape[2], q.shape[3])
    return A_log, dt_bias


def _no_plan(*tensors) -> None:
    return None


def _pool_plan(key: tuple, tensors: tuple, scalars: tuple):
    """Make and remember (under `key`, cula_core.plans) the plan of a pool call of `fused_recurrent_kda` (its
    `tensors`: q, k, v, g, beta, A_log, dt_bias, the pool, None for cu_seqlens, ssm_state_indices,
    num_accepted_tokens; its `scalars` as the op keys them): validate, select the backend, and keep its
    `planned_kernel` as a function of those tensors that returns o; register its program, if it has one, in the
    compiled plan table. Where a kernel that indexes only K-first pools would need the layout copy, the plan answers
    None: the full path runs."""
    q, k, v, g, beta, A_log, dt_bias, pool, _, indices, accepted = tensors
    (scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
     state_v_first) = scalars
    activation = beta_activation(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    a_log, bias = _kernel_gate_params(q, v, A_log, dt_bias, use_gate_in_kernel)
    shapes = validate_fused_recurrent(
        q, k, v, g, beta, A_log=a_log, dt_bias=bias, scale=scale, initial_state=pool,
        use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, state_v_first=bool(state_v_first),
        cu_seqlens=None, cu_seqlens_cpu=None, ssm_state_indices=indices, num_accepted_tokens=accepted)
    lb = None if lower_bound is None else float(lower_bound)
    call = _call(q, v, beta, pool, None, indices, accepted, gate=shapes.sizes.gate,
                 use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel), beta_activation=activation,
                 output_final_state=False, state_v_first=bool(state_v_first), lower_bound=lb, seq_len=shapes.sizes.T)
    backend = select(call, _sizes(q, k, v, g, beta, pool, 0))
    native = native_v_first(backend, call)
    if state_v_first and not native:  # the layout copy of the full path: no plan to run (its answer is None)
        return plans.remember(key, _no_plan)
    kernel = backend.planned_kernel(
        "fused_recurrent_kda", (q, k, v, g, beta, a_log, bias, pool, None, indices, accepted),
        scale=float(shapes.sizes.K ** -0.5 if scale is None else scale), output_final_state=False,
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel), gate=shapes.sizes.gate, lower_bound=lb,
        beta_activation=activation, **layout_kwargs(native))
    flatten = use_gate_in_kernel and ((A_log is not None and A_log.dim() != 1) or
                                      (dt_bias is not None and dt_bias.dim() != 1))
    is_grad_enabled = torch.is_grad_enabled

    def run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens):
        if not use_gate_in_kernel:
            A_log = dt_bias = None
        elif flatten:
            A_log = None if A_log is None else A_log.reshape(-1)
            dt_bias = None if dt_bias is None else dt_bias.reshape(-1)
        args = (q, k, v, g, beta, A_log, dt_bias, initial_state, None, ssm_state_indices, num_accepted_tokens)
        if is_grad_enabled():  # no autograd graph, as on the full path (a reference kernel would record one)
            with torch.no_grad():
                return kernel(*args)[0]
        return kernel(*args)[0]

    run.program = getattr(kernel, "program", None)
    plan = plans.remember(key, run)
    plans.register_compiled(plan_table.FUSED_RECURRENT_POOL, scalars, tensors, plan)
    return plan


@on_input_device
def fused_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    r"""KDA one token at a time (decode, short prefills), without autograd. FLA 0.6.0's
    `fla.ops.kda.fused_recurrent_kda`: same positional order, keywords and results; with ``ssm_state_indices``
    the continuous-batching mode of FLA's kernel (`fused_recurrent_kda_fwd` with ``inplace_final_state=True``).

    Args:
        q, k: ``[B, T, HQK, K]``, fp16 / bf16 / fp32 (fp64 on the reference).
        v: ``[B, T, HV, V]``, q's dtype; ``HV % HQK == 0`` (GVA).
        g: ``[B, T, HV, K]``: the log decay, or with ``use_gate_in_kernel`` the raw gate input.
        beta: ``[B, T, HV]``, or ``[B, T, HV, V]`` (one per value channel); post-sigmoid unless
            ``use_beta_sigmoid_in_kernel`` (then ``sigmoid(beta)``, ``2 * sigmoid(beta)`` with
            ``allow_neg_eigval``, which requires it).
        A_log: HV elements, any shape; dt_bias: HV * K elements, any shape. Used with ``use_gate_in_kernel``:
            the softplus gate ``-exp(A_log[hv]) * softplus(g + dt_bias)``, or with ``lower_bound`` the bounded
            gate ``lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias))`` (A_log optional then).
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: without ``ssm_state_indices``: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
            ``state_v_first``), N = B or the number of ``cu_seqlens`` sequences; fp32, bf16 or fp16; not
            modified. With ``ssm_state_indices``: the state pool ``[P, HV, K, V]`` (``[P, HV, V, K]``), fp32,
            bf16 or fp16, slots contiguous (any slot stride), updated in place (math in fp32, stored rounded to
            the pool's dtype).
        output_final_state: return the fp32 state after each sequence (ignored with ``ssm_state_indices``).
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first (eps 1e-6 inside the square root).
        state_v_first: states laid out ``[..., V, K]``; the deprecated alias ``transpose_state_layout`` warns.
        cu_seqlens: ``[N + 1]`` int32/int64, ``B == 1``: the tokens of N sequences in one row.
        **kwargs: keyword only:
            ``ssm_state_indices``: int32/int64 ``[N]`` or ``[N, T_idx]``. Sequence ``n`` starts from slot
            ``ssm_state_indices[n]`` (``[N]``) or ``ssm_state_indices[n, a - 1]`` with ``a =
            num_accepted_tokens[n]`` (``[N, T_idx]``; column 0 without ``num_accepted_tokens``). ``[N]``: the
            state after the sequence's last token is written to that slot. ``[N, T_idx]`` (``T_idx`` at least
            the longest sequence): the state after token ``t`` is written to slot ``ssm_state_indices[n, t]``.
            A negative read slot marks a padded sequence: zero outputs, nothing read or written; a negative
            write slot skips that write. A slot may belong to one sequence only.
            ``num_accepted_tokens``: int32/int64 ``[N]``, in ``[1, T_idx]``, with ``[N, T_idx]`` indices
            (speculative decoding: resume from the state after the last accepted draft token).
            ``cu_seqlens_cpu``: the host copy of ``cu_seqlens`` (validation reads it instead of the device).
            Any other name raises `TypeError`.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype. final_state: fp32 in the layout of initial_state
        (fp64 for fp64 inputs), or None without ``output_final_state``; with ``ssm_state_indices`` it is the
        pool itself (``initial_state``, updated), as FLA's in-place mode returns it.
    """
    ssm_state_indices = kwargs.get("ssm_state_indices")
    if ssm_state_indices is not None and cu_seqlens is None and kwargs.keys() <= _POOL_PLAN_KWARGS:
        # a pool call (a serving engine's step): a repeated signature runs its plan (cula_core.plans)
        tensors = (q, k, v, g, beta, A_log, dt_bias, initial_state, None, ssm_state_indices,
                   kwargs.get("num_accepted_tokens"))
        scalars = (scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                   lower_bound, state_v_first)
        o = plans.run_compiled(plan_table.FUSED_RECURRENT_POOL, scalars, tensors)
        if o is None:
            key = plans.signature("fused_recurrent_kda.pool", tensors, scalars)
            if key is not None:
                plan = plans.lookup(key) or _pool_plan(key, tensors, scalars)
                o = plan(*tensors)
        if o is not None:
            torch.autograd.graph.increment_version(initial_state)
            return o, initial_state
    kwargs = dict(kwargs)
    state_v_first = state_v_first_from(state_v_first, kwargs)
    ssm_state_indices = kwargs.pop("ssm_state_indices", None)
    num_accepted_tokens = kwargs.pop("num_accepted_tokens", None)
    cu_seqlens_cpu = kwargs.pop("cu_seqlens_cpu", None)
    for name in kwargs:
        raise TypeError(f"fused_recurrent_kda() got an unexpected keyword argument {name!r}")
    activation = beta_activation(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    A_log, dt_bias = _kernel_gate_params(q, v, A_log, dt_bias, use_gate_in_kernel)
    shapes = validate_fused_recurrent(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, ssm_state_indices=ssm_state_indices,
        num_accepted_tokens=num_accepted_tokens,
    )
    scale = float(shapes.sizes.K ** -0.5 if scale is None else scale)
    lb = None if lower_bound is None else float(lower_bound)
    seq_len = common_seq_len(shapes.sizes.T, cu_seqlens is not None, shapes.sizes.seq_lens)
    q, k, v, g, beta, A_log, dt_bias = (t.contiguous() if t is not None else None
                                        for t in (q, k, v, g, beta, A_log, dt_bias))
    with torch.no_grad():
        if shapes.pool:
            o = call_op(torch.ops.cula.fused_recurrent_kda_pool, _fused_recurrent_kda_pool, q, k, v, g, beta, A_log,
                        dt_bias, initial_state, ssm_state_indices, num_accepted_tokens, cu_seqlens, scale,
                        bool(use_qk_l2norm_in_kernel), shapes.sizes.gate, lb, activation, state_v_first, seq_len,
                        mutated=(initial_state,))
            return o, initial_state
        state = initial_state.contiguous() if initial_state is not None else None
        o, final_state = call_op(torch.ops.cula.fused_recurrent_kda, _fused_recurrent_kda, q, k, v, g, beta, A_log,
                                 dt_bias, state, cu_seqlens, scale, bool(output_final_state),
                                 bool(use_qk_l2norm_in_kernel), shapes.sizes.gate, lb, activation, state_v_first,
                                 seq_len)
    return o, (final_state if output_final_state else None)
