"""`chunk_kda`: the KDA forward with autograd, FLA 0.6.0's `fla.ops.kda.chunk_kda` signature.

Two torch custom ops carry it: ``cula::chunk_kda`` (forward) and ``cula::chunk_kda_backward``; each
dispatches at run time to the best installed backend (`cula_core.dispatch`) or to the reference. The
forward saves its inputs, plus the residuals (`Aqk`, `Akk`: what FLA 0.6.0's forward also keeps) when the
forward's backend produces a residual format that the backend serving the backward reads (the two may differ:
on Hopper cula-sm90's forward feeds cula-sm100's backward); the backward recomputes the rest (FLA's default,
`disable_recompute=False`). docs/backends.md, "Residuals".
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from cula_core import dispatch, plans
from cula_core.backend import CHUNK_KDA_RESIDUALS, RESIDUAL_CHUNK
from cula_core.cute_runtime import plan_table
from cula_core.fla_args import resolve_chunk_call
from cula_core.dispatch import on_input_device
from cula_core.ops._common import (
    call_op,
    eager,
    absent_like,
    fake_forward_outputs,
    layout_kwargs,
    make_call,
    native_v_first,
    present,
    select,
    swap_state_layout,
    unaliased,
)
from cula_core.ops.prefill import chunk_states, prefill_plan
from cula_core.validation import forward_indexed_sizes

def _call(op, q, v, cu_seqlens, *, gate, requires_grad, use_qk_l2norm_in_kernel, beta_activation, initial_state,
          output_final_state, state_v_first, lower_bound):
    B, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    return make_call(op, q.device, dtype=q.dtype, K=K, V=V, HQK=HQK, HV=HV, T=T, gate=gate,
                     varlen=cu_seqlens is not None, requires_grad=requires_grad,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                     initial_state=initial_state, output_final_state=output_final_state, state_v_first=state_v_first,
                     lower_bound=lower_bound, tokens=B * T)


def _residual_shape(q: Tensor, v: Tensor) -> tuple[int, ...]:
    return (*q.shape[:2], v.shape[2], RESIDUAL_CHUNK)


def _residual_format(backend, call) -> str:
    """The format of the residuals the forward of `call` (a chunk_kda call) saves when `backend` serves it, or ""
    for none: with `requires_grad`, the format `backend` produces, if the backend that `dispatch.choose` picks for
    the matching backward reads it. A function of the call alone (the fake op and `_setup_context` ask it too)."""
    if not call.requires_grad:
        return ""
    fmt = backend.residual_format(call)
    if not fmt:
        return ""
    backward_call = dataclasses.replace(call, op="chunk_kda_backward")
    try:
        backward = dispatch.choose(backward_call).backend
    except dispatch.BackendUnavailableError:  # a forced backend that cannot serve it: the backward will say so
        return ""
    return fmt if backward.accepts_residuals(backward_call, fmt) else ""


def _chunk_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool, gate: str,
    lower_bound: float | None, beta_activation: str, requires_grad: bool, state_v_first: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (o, final_state, Aqk, Akk): the last two are the residuals (docs/backends.md, "Residuals"),
    present when `requires_grad` and the serving backend saves them, absent otherwise. States are in the
    caller's layout ([N, HV, V, K] with `state_v_first`)."""
    call = _call("chunk_kda", q, v, cu_seqlens, gate=gate, requires_grad=requires_grad,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                 initial_state=initial_state is not None, output_final_state=output_final_state,
                 state_v_first=state_v_first, lower_bound=lower_bound)
    backend = select(call, forward_indexed_sizes(q, k, v, g, beta, initial_state, cu_seqlens, output_final_state))
    save = _residual_format(backend, call) != ""
    native = native_v_first(backend, call)
    copy_layout = state_v_first and not native
    out = backend.kernel("chunk_kda")(
        q, k, v, g, beta, A_log, dt_bias, swap_state_layout(initial_state) if copy_layout else initial_state,
        cu_seqlens, cu_seqlens_cpu, scale=scale, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate, lower_bound=lower_bound,
        beta_activation=beta_activation, **({"save_residuals": True} if save else {}), **layout_kwargs(native),
    )
    o, final_state = out[:2]
    final_state = swap_state_layout(final_state) if copy_layout else unaliased(final_state, initial_state)
    if save:
        residuals = tuple(out[2])
        shape = _residual_shape(q, v)
        for name, r in zip(CHUNK_KDA_RESIDUALS, residuals, strict=True):
            if tuple(r.shape) != shape or r.dtype != q.dtype or not r.is_contiguous():
                # the fake op promised this shape to torch.compile: a backend that breaks it is a bug
                raise RuntimeError(f"backend {backend.name}: residual {name} is {tuple(r.shape)} {r.dtype}, "
                                   f"expected contiguous {shape} {q.dtype}")
    else:
        residuals = (absent_like(q), absent_like(q))
    return (o, final_state if final_state is not None else absent_like(q, torch.float32), *residuals)


_chunk_kda_op = torch.library.custom_op("cula::chunk_kda", _chunk_kda, mutates_args=())


@_chunk_kda_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
      use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, requires_grad, state_v_first=False):
    o, final_state = fake_forward_outputs(q, v, cu_seqlens, output_final_state, state_v_first)
    call = _call("chunk_kda", q, v, cu_seqlens, gate=gate, requires_grad=requires_grad,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                 initial_state=initial_state is not None, output_final_state=output_final_state,
                 state_v_first=state_v_first, lower_bound=lower_bound)
    # the residuals' presence is decided by the call's backends: asked here as the real op asks it
    if _residual_format(dispatch.choose(call).backend, call):
        shape = _residual_shape(q, v)
        return o, final_state, q.new_empty(shape), q.new_empty(shape)
    return o, final_state, absent_like(q), absent_like(q)


def _chunk_kda_backward(
    do: Tensor, dht: Tensor | None, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    scale: float, use_qk_l2norm_in_kernel: bool, gate: str, lower_bound: float | None, beta_activation: str,
    Aqk: Tensor, Akk: Tensor, residual_format: str, state_v_first: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Aqk, Akk: the forward's residuals (absent when it saved none); residual_format: their format tag
    (cula_core.backend, "" for none). They reach the kernel only when the backend serving this call reads that
    format. dht, initial_state and the gradient of initial_state are in the caller's layout ([N, HV, V, K] with
    `state_v_first`)."""
    call = _call("chunk_kda_backward", q, v, cu_seqlens, gate=gate, requires_grad=True,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                 initial_state=initial_state is not None, output_final_state=dht is not None,
                 state_v_first=state_v_first, lower_bound=lower_bound)
    backend = select(call, forward_indexed_sizes(q, k, v, g, beta, initial_state, cu_seqlens, dht is not None))
    residuals = (present(Aqk), present(Akk))
    use = residual_format != "" and None not in residuals and backend.accepts_residuals(call, residual_format)
    native = native_v_first(backend, call)
    copy_layout = state_v_first and not native
    if copy_layout:
        dht, initial_state_k = swap_state_layout(dht), swap_state_layout(initial_state)
    else:
        initial_state_k = initial_state
    grads = list(backend.kernel("chunk_kda_backward")(
        do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state_k, cu_seqlens, cu_seqlens_cpu, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate, lower_bound=lower_bound,
        beta_activation=beta_activation, **({"residuals": residuals} if use else {}), **layout_kwargs(native),
    ))
    if copy_layout:
        grads[7] = swap_state_layout(grads[7])
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    return tuple(gr if gr is not None else absent_like(x if x is not None else q)
                 for gr, x in zip(grads, inputs, strict=True))


_chunk_kda_backward_op = torch.library.custom_op("cula::chunk_kda_backward", _chunk_kda_backward, mutates_args=())


@_chunk_kda_backward_op.register_fake
def _(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
      use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, Aqk, Akk, residual_format, state_v_first=False):
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    return tuple(torch.empty_like(x) if x is not None else absent_like(q) for x in inputs)


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
     use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, requires_grad, state_v_first) = inputs
    _o, _final_state, Aqk, Akk = output
    ctx.mark_non_differentiable(Aqk, Akk)
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, Aqk, Akk)
    ctx.cu_seqlens_cpu = cu_seqlens_cpu
    ctx.flags = (scale, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation)
    ctx.state_v_first = state_v_first
    ctx.residual_format = ""
    if present(Aqk) is not None:
        # the forward op decided by the same rule a moment ago: ask which format it saved
        call = _call("chunk_kda", q, v, cu_seqlens, gate=gate, requires_grad=requires_grad,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                     initial_state=initial_state is not None, output_final_state=output_final_state,
                     state_v_first=state_v_first, lower_bound=lower_bound)
        ctx.residual_format = _residual_format(dispatch.choose(call).backend, call)


def _backward(ctx, do, dht, _dAqk, _dAkk):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, Aqk, Akk = ctx.saved_tensors
    scale, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation = ctx.flags
    dht = present(dht)
    grads = call_op(
        torch.ops.cula.chunk_kda_backward, _chunk_kda_backward,
        do.contiguous(), dht.contiguous() if dht is not None else None, q, k, v, g, beta, A_log, dt_bias,
        initial_state, cu_seqlens, ctx.cu_seqlens_cpu, scale, use_qk_l2norm_in_kernel, gate, lower_bound,
        beta_activation, Aqk, Akk, ctx.residual_format, ctx.state_v_first,
    )
    needs = ctx.needs_input_grad
    out = [present(gr) if needs[i] else None for i, gr in enumerate(grads)]
    return (*out, None, None, None, None, None, None, None, None, None, None)


torch.library.register_autograd("cula::chunk_kda", _backward, setup_context=_setup_context)


class _EagerChunkKda(torch.autograd.Function):
    """The custom op `cula::chunk_kda` and its autograd formula for plain eager calls: the same forward, context
    and backward, without the dispatcher's round trip (whose first use also imports torch._dynamo: seconds of a
    process's first training step). Tracing goes through the op (`chunk_kda`, `eager`)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _chunk_kda(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, *grads)


def _records_graph(*tensors) -> bool:
    """Whether a call on `tensors` records an autograd graph: grad mode on and an input that requires grad."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not any(generator): this runs on every inference call's host path
        if t is not None and t.requires_grad:
            return True
    return False


@on_input_device
def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    r"""KDA (gated delta rule with per-channel decay) over whole sequences, with autograd. FLA 0.6.0's
    `fla.ops.kda.chunk_kda`: the same positional order, keywords, results and layouts.

    Args:
        q, k: ``[B, T, HQK, K]``, bf16 / fp16 / fp32 (fp64 runs on the reference only).
        v: ``[B, T, HV, V]``, q's dtype. ``HV % HQK == 0``; value head ``hv`` reads q/k head
            ``hv // (HV // HQK)`` (GVA when HV > HQK).
        g: ``[B, T, HV, K]``, any float dtype. The per-channel log decay, or with
            ``use_gate_in_kernel=True`` the raw gate input (see below).
        beta: ``[B, T, HV]``, any float dtype; post-sigmoid unless ``use_beta_sigmoid_in_kernel=True``.
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` fp32 (``[N, HV, V, K]`` with ``state_v_first``), N = B, or the number
            of sequences with ``cu_seqlens``.
        output_final_state: also return the fp32 state after the last token, in the layout of initial_state.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K (FLA's eps) before use.
        use_gate_in_kernel: compute the log decay from raw ``g``: the softplus gate
            ``-exp(A_log[hv]) * softplus(g + dt_bias[hv])``, or with ``lower_bound`` set the safe gate
            ``lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias[hv]))`` (without A_log:
            ``lower_bound * sigmoid(g + dt_bias)``).
        use_beta_sigmoid_in_kernel: beta holds logits: ``sigmoid(beta)`` is used (``2 * sigmoid(beta)`` with
            ``allow_neg_eigval=True``, which requires it).
        safe_gate: FLA's flag for bounded gates; with ``use_gate_in_kernel`` it requires ``lower_bound``.
        lower_bound: in ``[-5, 0)`` with ``safe_gate``.
        disable_recompute: FLA's memory / speed switch; no effect on the result.
        return_intermediate_states: inference only (no autograd: under ``torch.inference_mode()`` or
            ``torch.no_grad()``, or with inputs that do not require grad). Also return ``h``, the state at
            the start of every chunk of ``chunk_size`` tokens, in q's dtype: ``[B, NT, HV, K, V]``
            (``[B, NT, HV, V, K]`` with ``state_v_first``), ``NT = ceil(T / chunk_size)``; with ``cu_seqlens``
            ``B == 1`` and NT counts the chunks of every sequence in order (``ceil(len / chunk_size)`` each).
        state_v_first: states (initial, final, intermediate, and the gradient of the initial state) are laid
            out ``[..., V, K]``. The deprecated alias ``transpose_state_layout`` warns (`DeprecationWarning`).
        cu_seqlens: ``[N + 1]`` int32/int64 on q's device, ``B == 1``: sequence starts, from 0 to T.
        cu_seqlens_cpu: the same values on the host; lets validation and planning avoid a device read.
        cp_context: context parallel across ranks (torch.distributed): FLA's ``FLACPContext`` or one from
            `cula_core.context_parallel.build_cp_context`; q, k, v, g, beta are this rank's tokens and
            ``cu_seqlens`` its local sequences. See docs/context_parallel.md.
        use_graph, max_num_seqs: FLA's CUDA-graph switches; no effect on the result (FLA's rule that
            ``cu_seqlens`` has ``max_num_seqs + 1`` entries is checked).
        A_log: keyword only; HV elements, any shape (``[HV]``, ``[1, 1, HV, 1]``). Used with
            ``use_gate_in_kernel``.
        dt_bias: keyword only; HV * K elements, any shape (optional). Used with ``use_gate_in_kernel``.
        **kwargs: ``chunk_size`` (32 or 64: the chunks of ``h``; no other effect on the result) and
            ``transpose_state_layout``; any other name raises `TypeError`.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state fp32 (see initial_state), or None.
        With ``return_intermediate_states=True``: ``(o, final_state, h)``.

    Gradients flow to q, k, v, g (or the raw gate input), beta, A_log, dt_bias and initial_state.
    """
    if cp_context is not None:
        # this rank's piece of sequences split across ranks: the state enters through collectives, and the local
        # compute comes back here without a context
        from cula_core.context_parallel import chunk_kda_cp

        return chunk_kda_cp(
            q, k, v, g, beta, cp_context=cp_context, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate,
            lower_bound=lower_bound, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            disable_recompute=disable_recompute, return_intermediate_states=return_intermediate_states,
            state_v_first=state_v_first, use_graph=use_graph, max_num_seqs=max_num_seqs, **kwargs,
        )
    # inference (no input records a graph): a repeated signature runs its plan (cula_core.plans), made below
    key = None
    if not (kwargs or return_intermediate_states or _records_graph(q, k, v, g, beta, A_log, dt_bias, initial_state)):
        tensors = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
        scalars = (scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                   allow_neg_eigval, safe_gate, lower_bound, disable_recompute, state_v_first, cu_seqlens_cpu is None,
                   use_graph, max_num_seqs)
        # a repeat served without Python host work
        o = plans.run_compiled(plan_table.CHUNK_KDA_INFERENCE, scalars, tensors)
        if o is not None:
            return o, (plan_table.next_result(o) if output_final_state else None)
        key = plans.signature("chunk_kda.inference", tensors, scalars)
        plan = None if key is None else plans.lookup(key)
        if plan is not None:
            return plan(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
    call = resolve_chunk_call(
        "chunk_kda", q, k, v, g, beta, scale=scale, initial_state=initial_state, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate,
        lower_bound=lower_bound, disable_recompute=disable_recompute,
        return_intermediate_states=return_intermediate_states, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context, use_graph=use_graph, max_num_seqs=max_num_seqs,
        A_log=A_log, dt_bias=dt_bias, kwargs=kwargs,
    )
    tensors = call.tensors
    requires_grad = _records_graph(*tensors)
    if return_intermediate_states:
        if requires_grad:
            raise ValueError("return_intermediate_states=True is for inference and returns no gradients: call it "
                             "under torch.inference_mode() or torch.no_grad(), or with inputs that do not require "
                             "grad")
        return chunk_states(call, output_final_state=bool(output_final_state),
                            use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel))
    if key is not None:
        plan = plans.remember(key, prefill_plan(call, bool(output_final_state), bool(use_qk_l2norm_in_kernel), None,
                                                bool(use_gate_in_kernel), A_log, dt_bias))
        plans.register_compiled(plan_table.CHUNK_KDA_INFERENCE, scalars, (q, k, v, g, beta, A_log, dt_bias,
                                                                          initial_state, cu_seqlens), plan)
        return plan(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
    args = (*tensors, call.cu_seqlens, call.cu_seqlens_cpu, call.scale, bool(output_final_state),
            bool(use_qk_l2norm_in_kernel), call.gate, call.lower_bound, call.beta_activation, requires_grad,
            call.state_v_first)
    if not eager(args):
        o, final_state, _Aqk, _Akk = torch.ops.cula.chunk_kda(*args)
    elif requires_grad:
        o, final_state, _Aqk, _Akk = _EagerChunkKda.apply(*args)
    else:
        # inference: no graph to record, so no autograd.Function around the forward (its bookkeeping is host time)
        o, final_state, _Aqk, _Akk = _chunk_kda(*args)
    return o, (final_state if output_final_state else None)
