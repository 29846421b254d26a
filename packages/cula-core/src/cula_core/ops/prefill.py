"""`kda_prefill`: the inference forward of KDA (no autograd graph), chunk_kda's arguments plus
`intracard_cp`. Carried by the torch custom op ``cula::kda_prefill``, dispatched at run time.

With ``return_intermediate_states=True`` (of `kda_prefill` or `chunk_kda`) the forward also returns the state
at every chunk start; that is the op ``cula::kda_prefill_chunk_states`` (dispatch name
``kda_prefill_chunk_states``), served by the reference unless a backend lists it."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from cula_core import plans
from cula_core.cute_runtime import plan_table
from cula_core.fla_args import ChunkCall, resolve_chunk_call
from cula_core.dispatch import on_input_device
from cula_core.ops._common import (
    absent_like,
    fake_forward_outputs,
    layout_kwargs,
    make_call,
    native_v_first,
    select,
    swap_state_layout,
    unaliased,
)
from cula_core.validation import forward_indexed_sizes, validate_cu_seqlens


def _prefill_call(op, q, v, cu_seqlens, *, gate, use_qk_l2norm_in_kernel, beta_activation, initial_state,
                  output_final_state, state_v_first, **options):
    _B, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    return make_call(op, q.device, dtype=q.dtype, K=K, V=V, HQK=HQK, HV=HV, T=T, gate=gate,
                     varlen=cu_seqlens is not None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     beta_activation=beta_activation, initial_state=initial_state is not None,
                     output_final_state=output_final_state, state_v_first=state_v_first, **options)


def forward_kernel(call, sizes: dict, args: tuple | None = None, **flags):
    """The backend's kernel for forward `call` (chosen with its indexing limit applied to `sizes`), bound to the
    call's flags: it takes (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu), hands
    the kernel the states in the layout it indexes, and returns its outputs (a sequence) with every state back in
    the caller's layout (new tensors, never the input state). With `args` (those arguments of the call that
    makes a plan) it serves that plan's calls only: the backend's `planned_kernel`."""
    backend = select(call, sizes)
    native = native_v_first(backend, call)
    copy_layout = bool(call.options.get("state_v_first")) and not native
    layout = layout_kwargs(native)

    if args is None:
        bound = functools.partial(backend.kernel(call.op), **flags, **layout)
    else:
        if copy_layout:  # the kernel sees [..., K, V] copies of the caller's states
            args = (*args[:7], swap_state_layout(args[7]), *args[8:])
        bound = backend.planned_kernel(call.op, args, **flags, **layout)
    if not copy_layout:
        if not call.options.get("initial_state"):  # new outputs in the caller's layout already
            return bound

        def fresh(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu):
            # o, then the states (final_state, and the chunk states of kda_prefill_chunk_states): never the input
            o, *states = bound(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
            return (o, *[unaliased(s, initial_state) for s in states])

        # a program allocates every output itself: none can be the input state
        fresh.program = getattr(bound, "program", None)
        return fresh

    def run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu):
        out = list(bound(q, k, v, g, beta, A_log, dt_bias, swap_state_layout(initial_state), cu_seqlens,
                         cu_seqlens_cpu))
        for i in range(1, len(out)):  # final_state, and the chunk states of kda_prefill_chunk_states
            out[i] = swap_state_layout(out[i])
        return out

    return run


def _run_forward(call, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, **flags):
    """`forward_kernel` for `call`, run once on these tensors."""
    sizes = forward_indexed_sizes(q, k, v, g, beta, initial_state, cu_seqlens, flags["output_final_state"])
    return forward_kernel(call, sizes, **flags)(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                                cu_seqlens_cpu)


@torch.library.custom_op("cula::kda_prefill", mutates_args=())
def _kda_prefill_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool, gate: str,
    lower_bound: float | None, beta_activation: str, intracard_cp: str, state_v_first: bool = False,
) -> tuple[Tensor, Tensor]:
    call = _prefill_call("kda_prefill", q, v, cu_seqlens, gate=gate, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         beta_activation=beta_activation, initial_state=initial_state,
                         output_final_state=output_final_state, state_v_first=state_v_first,
                         intracard_cp=intracard_cp)
    o, final_state = _run_forward(
        call, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale=scale,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate,
        lower_bound=lower_bound, beta_activation=beta_activation, intracard_cp=intracard_cp,
    )
    return o, final_state if final_state is not None else absent_like(q, torch.float32)


@_kda_prefill_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
      use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, intracard_cp, state_v_first=False):
    return fake_forward_outputs(q, v, cu_seqlens, output_final_state, state_v_first)


@torch.library.custom_op("cula::kda_prefill_chunk_states", mutates_args=())
def _kda_prefill_chunk_states_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool, gate: str,
    lower_bound: float | None, beta_activation: str, chunk_size: int, state_v_first: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(o, final_state or absent, h): h ``[B, NT, HV, K, V]`` (V-first: ``[B, NT, HV, V, K]``) in q's dtype."""
    call = _prefill_call("kda_prefill_chunk_states", q, v, cu_seqlens, gate=gate,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                         initial_state=initial_state, output_final_state=output_final_state,
                         state_v_first=state_v_first, chunk_size=chunk_size)
    o, final_state, h = _run_forward(
        call, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale=scale,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate,
        lower_bound=lower_bound, beta_activation=beta_activation, chunk_size=chunk_size,
    )
    return o, final_state if final_state is not None else absent_like(q, torch.float32), h


@_kda_prefill_chunk_states_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
      use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, chunk_size, state_v_first):
    o, final_state = fake_forward_outputs(q, v, cu_seqlens, output_final_state, state_v_first)
    if cu_seqlens is not None:
        # the varlen chunk count depends on the sequence lengths: values a tracer does not see
        NT = torch.library.get_ctx().new_dynamic_size()
    else:
        NT = -(-q.shape[1] // chunk_size)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    trailing = (V, K) if state_v_first else (K, V)
    return o, final_state, q.new_empty((q.shape[0], NT, HV, *trailing))


def chunk_states(call: ChunkCall, *, output_final_state: bool, use_qk_l2norm_in_kernel: bool):
    """`chunk_kda` / `kda_prefill` with ``return_intermediate_states=True``: ``(o, final_state or None, h)``."""
    with torch.no_grad():
        o, final_state, h = torch.ops.cula.kda_prefill_chunk_states(
            *call.tensors, call.cu_seqlens, call.cu_seqlens_cpu, call.scale, output_final_state,
            use_qk_l2norm_in_kernel, call.gate, call.lower_bound, call.beta_activation, call.chunk_size,
            call.state_v_first,
        )
    return o, (final_state if output_final_state else None), h


def prefill_plan(call: ChunkCall, output_final_state: bool, use_qk_l2norm_in_kernel: bool, intracard_cp: str | None,
                 use_gate_in_kernel: bool, A_log: Tensor | None, dt_bias: Tensor | None):
    """The plan (cula_core.plans) of a `kda_prefill` call resolved into `call` (or, with `intracard_cp` None, of a
    `chunk_kda` call that records no graph: the backend's chunk_kda kernel, which has no intra-card CP): its
    `forward_kernel`, run without an autograd graph. The plan takes the call's own (q, k, v, g, beta, A_log,
    dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu), checks the host lengths of `cu_seqlens_cpu` (values, so
    on every call), hands the kernel A_log / dt_bias as `call` has them (1-D views, or None without
    `use_gate_in_kernel`), and returns ``(o, final_state or None)``. `A_log` and `dt_bias`: the call's own, whose
    shapes (part of the signature) say whether they need the 1-D view."""
    q, k, v, g, beta = call.tensors[:5]
    initial_state = call.tensors[7]
    if intracard_cp is None:
        op, options, flags = "chunk_kda", {"requires_grad": False}, {}
    else:
        op, options, flags = "kda_prefill", {"intracard_cp": intracard_cp}, {"intracard_cp": intracard_cp}
    config = _prefill_call(op, q, v, call.cu_seqlens, gate=call.gate, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                           beta_activation=call.beta_activation, initial_state=initial_state,
                           output_final_state=output_final_state, state_v_first=call.state_v_first, **options)
    kernel = forward_kernel(
        config, forward_indexed_sizes(q, k, v, g, beta, initial_state, call.cu_seqlens, output_final_state),
        (*call.tensors, call.cu_seqlens, call.cu_seqlens_cpu), scale=call.scale, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=call.gate, lower_bound=call.lower_bound,
        beta_activation=call.beta_activation, **flags)
    check_lengths = call.cu_seqlens_cpu is not None
    B, T = q.shape[:2]
    flatten = use_gate_in_kernel and ((A_log is not None and A_log.dim() != 1) or
                                      (dt_bias is not None and dt_bias.dim() != 1))
    is_grad_enabled = torch.is_grad_enabled
    # chunk_kda runs its plan only when no input records a graph (it checked that): only kda_prefill's plan asks
    check_grad = intracard_cp is not None

    def run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu):
        if check_lengths:
            validate_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T)
        if not use_gate_in_kernel:
            A_log = dt_bias = None
        elif flatten:
            A_log = None if A_log is None else A_log.reshape(-1)
            dt_bias = None if dt_bias is None else dt_bias.reshape(-1)
        # an inference op: no graph, whichever backend runs it (without an input that requires grad, none is made)
        if check_grad and is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad or g.requires_grad or beta.requires_grad
                or (A_log is not None and A_log.requires_grad) or (dt_bias is not None and dt_bias.requires_grad)
                or (initial_state is not None and initial_state.requires_grad)):
            with torch.no_grad():
                o, final_state = kernel(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
        else:
            o, final_state = kernel(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
        return o, (final_state if output_final_state else None)

    # the kernel's plan-table program serves the same calls, unless the host lengths need their check each call
    run.program = None if check_lengths else getattr(kernel, "program", None)
    return run


@on_input_device
def kda_prefill(
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
    intracard_cp: str | bool = "auto",
    **kwargs,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    r"""KDA prefill for inference: `chunk_kda`'s arguments (same positional order), shapes and results (see
    its docstring), computed without an autograd graph (outputs never require grad).

    Args:
        intracard_cp: keyword only; ``"auto"`` (default), ``True`` or ``False``. Intra-card context parallel:
            split long sequences into pieces at chunk boundaries and run them concurrently (the math:
            `cula_core.reference.context_parallel_reference`). It never changes the result beyond fp32
            rounding of the state; a backend without CP (the reference included) runs the sequences whole.
            ``"auto"`` lets the backend decide from the SM count, heads and lengths (taken from
            ``cu_seqlens_cpu`` when varlen, never by reading the device). Not used with
            ``return_intermediate_states``.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state fp32 ``[N, HV, K, V]`` (``[N, HV, V,
        K]`` with ``state_v_first``), or None. With ``return_intermediate_states=True``: ``(o, final_state, h)``.
    """
    key = None
    if not (kwargs or return_intermediate_states or cp_context is not None):
        tensors = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
        scalars = (scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                   allow_neg_eigval, safe_gate, lower_bound, disable_recompute, state_v_first, cu_seqlens_cpu is None,
                   use_graph, max_num_seqs, intracard_cp)
        o = plans.run_compiled(plan_table.KDA_PREFILL, scalars, tensors)  # a repeat served without Python host work
        if o is not None:
            return o, (plan_table.next_result(o) if output_final_state else None)
        key = plans.signature("kda_prefill", tensors, scalars)
    if key is not None:
        plan = plans.lookup(key)
        if plan is not None:
            return plan(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
    call = resolve_chunk_call(
        "kda_prefill", q, k, v, g, beta, scale=scale, initial_state=initial_state,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
        disable_recompute=disable_recompute, return_intermediate_states=return_intermediate_states,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context,
        use_graph=use_graph, max_num_seqs=max_num_seqs, A_log=A_log, dt_bias=dt_bias, kwargs=kwargs,
    )
    if intracard_cp is True:
        cp = "on"
    elif intracard_cp is False:
        cp = "off"
    elif intracard_cp == "auto":
        cp = "auto"
    else:
        raise ValueError(f"intracard_cp must be 'auto', True or False, got {intracard_cp!r}")
    if return_intermediate_states:
        return chunk_states(call, output_final_state=bool(output_final_state),
                            use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel))
    if key is not None:
        plan = plans.remember(key, prefill_plan(call, bool(output_final_state), bool(use_qk_l2norm_in_kernel), cp,
                                                bool(use_gate_in_kernel), A_log, dt_bias))
        plans.register_compiled(plan_table.KDA_PREFILL, scalars, tensors, plan)
        return plan(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
    with torch.no_grad():
        o, final_state = torch.ops.cula.kda_prefill(
            *call.tensors, call.cu_seqlens, call.cu_seqlens_cpu, call.scale, bool(output_final_state),
            bool(use_qk_l2norm_in_kernel), call.gate, call.lower_bound, call.beta_activation, cp,
            call.state_v_first,
        )
    return o, (final_state if output_final_state else None)
