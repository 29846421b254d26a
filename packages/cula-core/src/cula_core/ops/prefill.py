"""`kda_prefill`: the inference forward of KDA (no autograd graph), chunk_kda's arguments plus
`intracard_cp`. Carried by the torch custom op ``cula::kda_prefill``, dispatched at run time."""

from __future__ import annotations


import torch
from torch import Tensor

from cula_core.ops._common import absent_like, fake_forward_outputs, make_call, run
from cula_core.ops.chunk_kda import parse_fla_kwargs
from cula_core.validation import validate_kda


@torch.library.custom_op("cula::kda_prefill", mutates_args=())
def _kda_prefill_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool, gate: str,
    lower_bound: float | None, beta_activation: str, intracard_cp: str,
) -> tuple[Tensor, Tensor]:
    _B, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    call = make_call("kda_prefill", q.device, dtype=q.dtype, K=K, V=V, HQK=HQK, HV=HV, T=T, gate=gate,
                     varlen=cu_seqlens is not None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     beta_activation=beta_activation, intracard_cp=intracard_cp,
                     initial_state=initial_state is not None, output_final_state=output_final_state)
    o, final_state = run(
        call, {"q": q, "k": k, "v": v, "g": g}, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
        cu_seqlens_cpu, scale=scale, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate, lower_bound=lower_bound,
        beta_activation=beta_activation, intracard_cp=intracard_cp,
    )
    return o, final_state if final_state is not None else absent_like(q, torch.float32)


@_kda_prefill_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
      use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, intracard_cp):
    return fake_forward_outputs(q, v, cu_seqlens, output_final_state)


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
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    intracard_cp: str | bool = "auto",
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    r"""KDA prefill for inference: `chunk_kda`'s arguments, shapes and results (see its docstring),
    computed without an autograd graph (outputs never require grad).

    Args:
        intracard_cp: ``"auto"`` (default), ``True`` or ``False``. Intra-card context parallel: split long
            sequences into pieces at chunk boundaries and run them concurrently (the math:
            `cula_core.reference.context_parallel_reference`). It never changes the result beyond fp32
            rounding of the state; a backend without CP (the reference included) runs the sequences whole.
            ``"auto"`` lets the backend decide from the SM count, heads and lengths (taken from
            ``cu_seqlens_cpu`` when varlen, never by reading the device).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state ``[N, HV, K, V]`` fp32, or None.
    """
    beta_activation = parse_fla_kwargs(kwargs, "kda_prefill")
    if intracard_cp is True:
        cp = "on"
    elif intracard_cp is False:
        cp = "off"
    elif intracard_cp == "auto":
        cp = "auto"
    else:
        raise ValueError(f"intracard_cp must be 'auto', True or False, got {intracard_cp!r}")
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
    with torch.no_grad():
        o, final_state = torch.ops.cula.kda_prefill(
            *tensors, cu_seqlens, cu_seqlens_cpu, float(scale), bool(output_final_state),
            bool(use_qk_l2norm_in_kernel), shapes.gate, None if lower_bound is None else float(lower_bound),
            beta_activation, cp,
        )
    return o, (final_state if output_final_state else None)
