"""`chunk_kda`: the KDA forward with autograd, FLA 0.6.0's `fla.ops.kda.chunk_kda` signature.

Two torch custom ops carry it: ``cula::chunk_kda`` (forward) and ``cula::chunk_kda_backward``; each
dispatches at run time to the best installed backend (`cula_core.dispatch`) or to the reference. The
forward saves its inputs, plus the residuals (`Aqk`, `Akk`: what FLA 0.6.0's forward also keeps) when the
serving backend hands them to its own backward; the backward recomputes the rest (FLA's default,
`disable_recompute=False`). docs/backends.md, "Residuals".
"""

from __future__ import annotations


import torch
from torch import Tensor

from cula_core import dispatch
from cula_core.backend import CHUNK_KDA_RESIDUALS, RESIDUAL_CHUNK
from cula_core.ops._common import absent_like, fake_forward_outputs, make_call, present, select
from cula_core.validation import validate_kda

# FLA 0.6.0 keyword arguments beyond the named ones. Accepted with effect on the math:
_BETA_KWARGS = ("use_beta_sigmoid_in_kernel", "allow_neg_eigval")
# Accepted, no effect on the result (FLA performance switches):
_HINT_KWARGS = ("disable_recompute", "chunk_size")
# FLA features cula does not implement: accepted only at their default value.
_UNSUPPORTED_KWARGS = {
    "return_intermediate_states": False,
    "state_v_first": False,
    "transpose_state_layout": False,
    "cp_context": None,
    "use_graph": False,
    "max_num_seqs": None,
}


def parse_fla_kwargs(kwargs: dict, fn: str) -> str:
    """Check FLA's extra keyword arguments; returns the beta activation ("none", "sigmoid", "2sigmoid")."""
    for name, value in kwargs.items():
        if name in _BETA_KWARGS or name in _HINT_KWARGS:
            continue
        if name in _UNSUPPORTED_KWARGS:
            if value is not _UNSUPPORTED_KWARGS[name] and value != _UNSUPPORTED_KWARGS[name]:
                raise NotImplementedError(f"{fn}: {name}={value!r} is an FLA option cula does not implement")
            continue
        raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in (32, 64):
        raise ValueError(f"chunk_size must be 32 or 64, got {chunk_size}")
    sigmoid = bool(kwargs.get("use_beta_sigmoid_in_kernel", False))
    if kwargs.get("allow_neg_eigval", False):
        if not sigmoid:
            raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
        return "2sigmoid"
    return "sigmoid" if sigmoid else "none"


def _call(op, q, v, cu_seqlens, *, gate, requires_grad, use_qk_l2norm_in_kernel, beta_activation, initial_state,
          output_final_state):
    _B, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    return make_call(op, q.device, dtype=q.dtype, K=K, V=V, HQK=HQK, HV=HV, T=T, gate=gate,
                     varlen=cu_seqlens is not None, requires_grad=requires_grad,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                     initial_state=initial_state, output_final_state=output_final_state)


def _residual_shape(q: Tensor, v: Tensor) -> tuple[int, ...]:
    return (*q.shape[:2], v.shape[2], RESIDUAL_CHUNK)


def _residual_source(backend, call) -> str:
    """The name of the backend whose forward hands residuals to its backward for `call`, or ""."""
    return backend.name if call.requires_grad and backend.saves_residuals(call) else ""


@torch.library.custom_op("cula::chunk_kda", mutates_args=())
def _chunk_kda_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool, gate: str,
    lower_bound: float | None, beta_activation: str, requires_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (o, final_state, Aqk, Akk): the last two are the residuals (docs/backends.md, "Residuals"),
    present when `requires_grad` and the serving backend saves them, absent otherwise."""
    call = _call("chunk_kda", q, v, cu_seqlens, gate=gate, requires_grad=requires_grad,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                 initial_state=initial_state is not None, output_final_state=output_final_state)
    backend = select(call, {"q": q, "k": k, "v": v, "g": g})
    save = _residual_source(backend, call) != ""
    out = backend.kernel("chunk_kda")(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale=scale,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate,
        lower_bound=lower_bound, beta_activation=beta_activation, **({"save_residuals": True} if save else {}),
    )
    o, final_state = out[:2]
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


@_chunk_kda_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
      use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, requires_grad):
    o, final_state = fake_forward_outputs(q, v, cu_seqlens, output_final_state)
    call = _call("chunk_kda", q, v, cu_seqlens, gate=gate, requires_grad=requires_grad,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                 initial_state=initial_state is not None, output_final_state=output_final_state)
    # the residuals' presence is the serving backend's choice: asked here as the real op asks it
    if _residual_source(dispatch.choose(call).backend, call):
        shape = _residual_shape(q, v)
        return o, final_state, q.new_empty(shape), q.new_empty(shape)
    return o, final_state, absent_like(q), absent_like(q)


@torch.library.custom_op("cula::chunk_kda_backward", mutates_args=())
def _chunk_kda_backward_op(
    do: Tensor, dht: Tensor | None, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    scale: float, use_qk_l2norm_in_kernel: bool, gate: str, lower_bound: float | None, beta_activation: str,
    Aqk: Tensor, Akk: Tensor, residual_source: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Aqk, Akk: the forward's residuals (absent when it saved none); residual_source: the backend that
    produced them. They reach the kernel only when that backend also serves this call."""
    call = _call("chunk_kda_backward", q, v, cu_seqlens, gate=gate, requires_grad=True,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                 initial_state=initial_state is not None, output_final_state=dht is not None)
    backend = select(call, {"q": q, "k": k, "v": v, "g": g})
    residuals = (present(Aqk), present(Akk))
    use = residual_source != "" and backend.name == residual_source and None not in residuals
    grads = backend.kernel("chunk_kda_backward")(
        do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate, lower_bound=lower_bound,
        beta_activation=beta_activation, **({"residuals": residuals} if use else {}),
    )
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    return tuple(gr if gr is not None else absent_like(x if x is not None else q)
                 for gr, x in zip(grads, inputs, strict=True))


@_chunk_kda_backward_op.register_fake
def _(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
      use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, Aqk, Akk, residual_source):
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    return tuple(torch.empty_like(x) if x is not None else absent_like(q) for x in inputs)


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
     use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, requires_grad) = inputs
    _o, _final_state, Aqk, Akk = output
    ctx.mark_non_differentiable(Aqk, Akk)
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, Aqk, Akk)
    ctx.cu_seqlens_cpu = cu_seqlens_cpu
    ctx.flags = (scale, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation)
    ctx.residual_source = ""
    if present(Aqk) is not None:
        # the forward op chose its backend by the same rule a moment ago: ask which one that was
        call = _call("chunk_kda", q, v, cu_seqlens, gate=gate, requires_grad=requires_grad,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_activation=beta_activation,
                     initial_state=initial_state is not None, output_final_state=output_final_state)
        ctx.residual_source = _residual_source(dispatch.choose(call).backend, call)


def _backward(ctx, do, dht, _dAqk, _dAkk):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, Aqk, Akk = ctx.saved_tensors
    scale, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation = ctx.flags
    grads = torch.ops.cula.chunk_kda_backward(
        do.contiguous(), present(dht), q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
        ctx.cu_seqlens_cpu, scale, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, Aqk, Akk,
        ctx.residual_source,
    )
    needs = ctx.needs_input_grad
    out = [present(gr) if needs[i] else None for i, gr in enumerate(grads)]
    return (*out, None, None, None, None, None, None, None, None, None)


torch.library.register_autograd("cula::chunk_kda", _backward, setup_context=_setup_context)


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
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    r"""KDA (gated delta rule with per-channel decay) over whole sequences, with autograd.

    Args:
        q, k: ``[B, T, HQK, K]``, bf16 / fp16 / fp32 (fp64 runs on the reference only).
        v: ``[B, T, HV, V]``, q's dtype. ``HV % HQK == 0``; value head ``hv`` reads q/k head
            ``hv // (HV // HQK)`` (GVA when HV > HQK).
        g: ``[B, T, HV, K]``, any float dtype. The per-channel log decay, or with
            ``use_gate_in_kernel=True`` the raw gate input (see below).
        beta: ``[B, T, HV]``, any float dtype; post-sigmoid unless ``use_beta_sigmoid_in_kernel=True``.
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` fp32, N = B, or the number of sequences with ``cu_seqlens``.
        output_final_state: also return the ``[N, HV, K, V]`` fp32 state after the last token.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K (FLA's eps) before use.
        use_gate_in_kernel: compute the log decay from raw ``g``: the softplus gate
            ``-exp(A_log[hv]) * softplus(g + dt_bias[hv])``, or with ``lower_bound`` set the safe gate
            ``lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias[hv]))`` (without A_log:
            ``lower_bound * sigmoid(g + dt_bias)``).
        A_log: ``[HV]``; dt_bias: ``[HV * K]`` (optional). Used with ``use_gate_in_kernel``.
        safe_gate: FLA's flag for bounded gates; with ``use_gate_in_kernel`` it requires ``lower_bound``.
        lower_bound: in ``[-5, 0)``.
        cu_seqlens: ``[N + 1]`` int32/int64 on q's device, ``B == 1``: sequence starts, from 0 to T.
        cu_seqlens_cpu: the same values on the host; lets validation and planning avoid a device read.
        **kwargs: FLA's other options: ``use_beta_sigmoid_in_kernel``, ``allow_neg_eigval`` (beta becomes
            ``sigmoid(beta)`` / ``2 * sigmoid(beta)``), ``disable_recompute`` and ``chunk_size`` (no effect on
            the result). FLA options cula does not implement raise `NotImplementedError` unless at their
            default; unknown names raise `TypeError`.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state ``[N, HV, K, V]`` fp32, or None.

    Gradients flow to q, k, v, g (or the raw gate input), beta, A_log, dt_bias and initial_state.
    """
    beta_activation = parse_fla_kwargs(kwargs, "chunk_kda")
    shapes = validate_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    if scale is None:
        scale = shapes.K ** -0.5
    tensors = [t.contiguous() if t is not None else None for t in (q, k, v, g, beta, A_log, dt_bias, initial_state)]
    requires_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    o, final_state, _Aqk, _Akk = torch.ops.cula.chunk_kda(
        *tensors, cu_seqlens, cu_seqlens_cpu, float(scale), bool(output_final_state), bool(use_qk_l2norm_in_kernel),
        shapes.gate, None if lower_bound is None else float(lower_bound), beta_activation, requires_grad,
    )
    return o, (final_state if output_final_state else None)
