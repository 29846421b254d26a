"""`kda_decode` and `kda_decode_mtp`: KDA decode steps on a serving state pool.

A pool ``state_pool [P, HV, K, V]`` (``[P, HV, V, K]`` with ``state_v_first=True``, the layout of FLA's layers,
FlashKDA and SGLang), fp32 or bf16, holds one state per slot: the state math runs in fp32 and a state is rounded
to the pool's dtype when it is stored. Request ``i`` of the batch uses slot ``cache_idx[i]`` (int32; negative =
padded slot: nothing read or written, output zeros; so is ``null_slot`` when an engine reserves a slot for
padding, vLLM's null block 0). The gate is computed in kernel from the raw ``g`` (softplus gate, or the safe
gate when ``lower_bound`` is set). Carried by the torch custom ops ``cula::kda_decode`` and
``cula::kda_decode_mtp``, which mutate the pool.
"""

from __future__ import annotations


import functools

import torch
from torch import Tensor

from cula_core import plans
from cula_core.cute_runtime import plan_table
from cula_core.dispatch import on_input_device
from cula_core.ops._common import absent_like, call_op, make_call, select
from cula_core.validation import validate_decode


def validate_decode_call(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, scale, lower_bound,
                         single_token=False, state_v_first=False, null_slot=None):
    """Validate, then normalise: contiguous inputs, default scale. Returns (shapes, tensors, params, scale)."""
    shapes = validate_decode(q, k, v, g, beta, state_pool, cache_idx, A_log=A_log, dt_bias=dt_bias, scale=scale,
                             lower_bound=lower_bound, single_token=single_token, state_v_first=state_v_first,
                             null_slot=null_slot)
    tensors = [t.contiguous() if t is not None else None for t in (q, k, v, g, beta)]
    scale = float(shapes.K ** -0.5 if scale is None else scale)
    params = [t.contiguous() if t is not None else None for t in (A_log, dt_bias)]
    return shapes, tensors, params, scale


def pool_options(state_pool: Tensor, state_v_first: bool, null_slot: int | None) -> dict:
    """The CallConfig options that describe a pool: its dtype (`state_dtype`), its layout (`state_v_first`) and
    whether a null slot pads (`null_slot`); a backend declines what its kernels do not index."""
    return dict(state_dtype=state_pool.dtype, state_v_first=bool(state_v_first), null_slot=null_slot is not None)


def pool_kwargs(state_v_first: bool, null_slot: int | None) -> dict:
    """The kernel keywords of a pool (calling convention): given only when not at their default, so that a
    backend that never accepted them fails loudly rather than ignoring them."""
    return {**({"state_v_first": True} if state_v_first else {}),
            **({"null_slot": int(null_slot)} if null_slot is not None else {})}


def decode_call_sizes(q: Tensor, v: Tensor, state_pool: Tensor, state_v_first: bool = False,
                      null_slot: int | None = None) -> dict:
    """make_call's sizes and pool options (`pool_options`) for the decode family."""
    return dict(dtype=q.dtype, K=q.shape[3], V=v.shape[3], HQK=q.shape[2], HV=v.shape[2], T=q.shape[1],
                **pool_options(state_pool, state_v_first, null_slot))


def decode_kernel(op: str, q: Tensor, v: Tensor, state_pool: Tensor, scale: float, lower_bound: float | None,
                  use_qk_l2norm_in_kernel: bool, state_v_first: bool, null_slot: int | None, args: tuple | None = None,
                  **options):
    """The kernel of decode-family op `op` for a validated call: the backend chosen for its CallConfig (and its
    indexing limit applied), bound to the call's flags. It takes (q, k, v, g, beta, state_pool, cache_idx, A_log,
    dt_bias) and returns what the backend's kernel returns. `options`: the op's own flags
    (`output_per_token_states`), passed to the CallConfig and the kernel alike. With `args` (those nine arguments of
    the call that makes a plan) it serves that plan's calls only: the backend's `planned_kernel`."""
    lower_bound = None if lower_bound is None else float(lower_bound)
    l2norm = bool(use_qk_l2norm_in_kernel)
    call = make_call(op, q.device, gate="safe" if lower_bound is not None else "softplus", lower_bound=lower_bound,
                     use_qk_l2norm_in_kernel=l2norm, **options,
                     **decode_call_sizes(q, v, state_pool, state_v_first, null_slot))
    backend = select(call, {"state_pool": state_pool, "v": v})
    flags = dict(scale=scale, lower_bound=lower_bound, use_qk_l2norm_in_kernel=l2norm, **options,
                 **pool_kwargs(state_v_first, null_slot))
    if args is not None:
        return backend.planned_kernel(op, args, **flags)
    return functools.partial(backend.kernel(op), **flags)


#: the compiled plan table's op id of each decode-family op with plans
_TABLE_OPS = {"kda_decode": plan_table.KDA_DECODE, "kda_decode_mtp": plan_table.KDA_DECODE_MTP,
              "kda_decode_mtp_kvbuffer": plan_table.KDA_DECODE_MTP_KVBUFFER}


def decode_plan(key: tuple, op: str, tensors: tuple, scale, lower_bound, use_qk_l2norm_in_kernel, state_v_first,
                null_slot, keyed: tuple | None = None, **options):
    """Make and remember (under `key`, cula_core.plans) the plan of a decode-family call on contiguous CUDA tensors
    (`tensors` in the kernel's argument order): validate, then `decode_kernel` planned for these arguments; its
    program, where the backend states one, goes to the compiled plan table under the op's scalars as the call gave
    them (`keyed`; default: the five common ones)."""
    _shapes, _tensors, _params, resolved_scale = validate_decode_call(
        *tensors, scale, lower_bound, single_token=op == "kda_decode", state_v_first=state_v_first,
        null_slot=null_slot)
    plan = plans.remember(key, decode_kernel(op, tensors[0], tensors[2], tensors[5], resolved_scale, lower_bound,
                                             use_qk_l2norm_in_kernel, state_v_first, null_slot, tensors, **options))
    if keyed is None:
        keyed = (scale, lower_bound, use_qk_l2norm_in_kernel, state_v_first, null_slot)
    plans.register_compiled(_TABLE_OPS[op], keyed, tensors, plan)
    return plan


def _kda_decode(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, cache_idx: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, scale: float, lower_bound: float | None,
    use_qk_l2norm_in_kernel: bool, state_v_first: bool = False,
    null_slot: int | None = None,
) -> Tensor:
    kernel = decode_kernel("kda_decode", q, v, state_pool, scale, lower_bound, use_qk_l2norm_in_kernel,
                           state_v_first, null_slot)
    return kernel(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias)


_kda_decode_op = torch.library.custom_op("cula::kda_decode", _kda_decode, mutates_args=("state_pool",))


@_kda_decode_op.register_fake
def _(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, scale, lower_bound, use_qk_l2norm_in_kernel,
      state_v_first=False, null_slot=None):
    return torch.empty_like(v)


def _kda_decode_mtp(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, cache_idx: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, scale: float, lower_bound: float | None,
    use_qk_l2norm_in_kernel: bool, output_per_token_states: bool, state_v_first: bool = False,
    null_slot: int | None = None,
) -> tuple[Tensor, Tensor]:
    kernel = decode_kernel("kda_decode_mtp", q, v, state_pool, scale, lower_bound, use_qk_l2norm_in_kernel,
                           state_v_first, null_slot, output_per_token_states=output_per_token_states)
    o, states = kernel(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias)
    return o, states if states is not None else absent_like(state_pool)


_kda_decode_mtp_op = torch.library.custom_op("cula::kda_decode_mtp", _kda_decode_mtp, mutates_args=("state_pool",))


@_kda_decode_mtp_op.register_fake
def _(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, scale, lower_bound, use_qk_l2norm_in_kernel,
      output_per_token_states, state_v_first=False, null_slot=None):
    o = torch.empty_like(v)
    if not output_per_token_states:
        return o, absent_like(state_pool)
    N, T, HV = v.shape[:3]
    return o, state_pool.new_empty((N, T, HV, *state_pool.shape[2:]))


@on_input_device
def kda_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    cache_idx: Tensor,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    scale: float | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    state_v_first: bool = False,
    null_slot: int | None = None,
) -> Tensor:
    r"""One decode token per request; updates the pool in place.

    Args:
        q, k: ``[N, 1, HQK, K]`` bf16 / fp16 / fp32. v: ``[N, 1, HV, V]``, q's dtype (``HV % HQK == 0``).
        g: ``[N, 1, HV, K]``, the raw gate input (any float dtype).
        beta: ``[N, 1, HV]``, post-sigmoid.
        state_pool: ``[P, HV, K, V]`` (``[P, HV, V, K]`` with `state_v_first`), fp32 or bf16, contiguous; slot
            ``cache_idx[i]`` is read and overwritten with the state after the token (computed in fp32, stored
            in the pool's dtype).
        cache_idx: ``[N]`` int32; negative marks a padded slot (no read, no write, output zeros). Live
            slots must be distinct.
        A_log: ``[HV]``; dt_bias: ``[HV * K]`` (optional); lower_bound: selects the safe gate (any finite
            float: `cula_core.validation.validate_lower_bound`).
        scale: multiplies q; default ``K ** -0.5``.
        use_qk_l2norm_in_kernel: L2-normalise q and k first.
        state_v_first: keyword only; the pool holds each state transposed, ``[V, K]`` (FLA's flag).
        null_slot: keyword only; a slot of the pool (``0 <= null_slot < P``) that pads like a negative index:
            a request whose ``cache_idx`` is it reads and writes nothing and outputs zeros, and the slot itself
            is never touched (engines whose slot 0 is the null slot pass ``null_slot=0``). None: every
            index ``>= 0`` is a request.

    Returns:
        o: ``[N, 1, HV, V]`` in v's dtype.
    """
    # a repeated signature runs its plan (cula_core.plans); the scalars are keyed as given, with their types
    tensors = (q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias)
    scalars = (scale, lower_bound, use_qk_l2norm_in_kernel, state_v_first, null_slot)
    o = plans.run_compiled(plan_table.KDA_DECODE, scalars, tensors)  # a repeat served without Python host work
    if o is not None:
        torch.autograd.graph.increment_version(state_pool)
        return o
    key = plans.signature("kda_decode", tensors, scalars)
    if key is not None:
        o = (plans.lookup(key) or decode_plan(key, "kda_decode", tensors, *scalars))(*tensors)
        torch.autograd.graph.increment_version(state_pool)
        return o
    _shapes, tensors, params, scale = validate_decode_call(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias,
                                                          scale, lower_bound, single_token=True,
                                                          state_v_first=state_v_first, null_slot=null_slot)
    return call_op(torch.ops.cula.kda_decode, _kda_decode, *tensors, state_pool, cache_idx, *params, scale,
                   None if lower_bound is None else float(lower_bound), bool(use_qk_l2norm_in_kernel),
                   bool(state_v_first), null_slot, mutated=(state_pool,))


@on_input_device
def kda_decode_mtp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    cache_idx: Tensor,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    scale: float | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    output_per_token_states: bool = False,
    *,
    state_v_first: bool = False,
    null_slot: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    r"""Multi-token decode: the recurrence over T draft tokens per request (speculative decoding).

    Args: as `kda_decode`, with ``T >= 1`` tokens: q, k ``[N, T, HQK, K]``, v ``[N, T, HV, V]``,
        g ``[N, T, HV, K]``, beta ``[N, T, HV]``. The state stays fp32 through the T tokens; a bf16 pool
        rounds it once, when it is stored.
        output_per_token_states: if True, return the state after each token, ``[N, T, HV, K, V]``
            (``[N, T, HV, V, K]`` with `state_v_first`) in the pool's dtype, and leave the pool untouched (the
            caller commits the accepted one); if False, write the state after all T tokens into the pool and
            return None for it.

    Returns:
        ``(o, per_token_states)``: o ``[N, T, HV, V]`` in v's dtype; per_token_states as above or None.
        Padded slots give zero outputs and zero states.
    """
    tensors = (q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias)
    scalars = (scale, lower_bound, use_qk_l2norm_in_kernel, state_v_first, null_slot)
    keyed = (*scalars, output_per_token_states)
    o = plans.run_compiled(plan_table.KDA_DECODE_MTP, keyed, tensors)  # a repeat served without Python host work
    if o is not None:
        torch.autograd.graph.increment_version(state_pool)
        return o, (plan_table.next_result(o) if output_per_token_states else None)
    key = plans.signature("kda_decode_mtp", tensors, keyed)
    if key is not None:
        o, states = (plans.lookup(key) or decode_plan(key, "kda_decode_mtp", tensors, *scalars, keyed=keyed,
                                                      output_per_token_states=bool(output_per_token_states)))(*tensors)
        torch.autograd.graph.increment_version(state_pool)
        return o, (states if output_per_token_states else None)
    _shapes, tensors, params, scale = validate_decode_call(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias,
                                                          scale, lower_bound, state_v_first=state_v_first,
                                                          null_slot=null_slot)
    o, states = call_op(torch.ops.cula.kda_decode_mtp, _kda_decode_mtp, *tensors, state_pool, cache_idx, *params,
                        scale, None if lower_bound is None else float(lower_bound), bool(use_qk_l2norm_in_kernel),
                        bool(output_per_token_states), bool(state_v_first), null_slot, mutated=(state_pool,))
    return o, (states if output_per_token_states else None)
