"""Reference gate math for KDA: L2 normalisation of q/k and the two log-decay gates.

These are the element-wise preprocessing steps that FLA 0.6.0 fuses into its kernels when called with
``use_qk_l2norm_in_kernel=True`` / ``use_gate_in_kernel=True``. They run in plain PyTorch, on any device,
support autograd, and compute in the promoted dtype of their inputs (so fp64 in, fp64 out).

Conventions (checked against ``fla/modules/norm/l2norm.py`` and ``fla/ops/kda/gate.py``):

* ``l2norm``: ``x / sqrt(sum(x**2) + eps)`` over the last dim, ``eps = 1e-6`` *inside* the square root.
* softplus gate: ``-exp(A_log[hv]) * softplus(g + dt_bias[hv])`` where ``softplus(x) = x`` for ``x > 20``.
* lower-bound ("safe") gate: ``lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias[hv]))``, and
  ``lower_bound * sigmoid(g + dt_bias[hv])`` when ``A_log`` is ``None``.
* FLA picks the gate by ``lower_bound`` alone: whenever ``lower_bound`` is not ``None`` the sigmoid gate is
  used, whether or not ``safe_gate`` is set (``safe_gate`` only selects a kernel path, and additionally
  requires ``lower_bound`` in ``[-5, 0)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cula_core.validation import SAFE_GATE_LOWER_BOUND_RANGE, validate_lower_bound

__all__ = [
    "BETA_ACTIVATIONS", "GATE_MODES", "L2NORM_EPS", "SAFE_GATE_MIN_LOWER_BOUND", "activate_beta", "kda_gate", "l2norm",
    "log_decay", "safe_gate", "softplus_gate",
]

#: eps added to the squared norm before the square root (FLA's ``l2norm_fwd`` default and the value the
#: fused recurrent kernel hard-codes).
L2NORM_EPS = 1e-6

#: FLA accepts ``lower_bound`` in ``[-5, 0)`` when ``safe_gate=True``: beyond -5 the per-chunk gate range
#: overflows the fp32 exponentials its tensor-core path relies on.
SAFE_GATE_MIN_LOWER_BOUND = SAFE_GATE_LOWER_BOUND_RANGE[0]

#: The gate modes of the kernel calling convention (docs/backends.md): g is the log decay itself, or raw.
GATE_MODES = ("precomputed", "softplus", "safe")

#: The beta activations of the kernel calling convention (from FLA's extra keyword arguments).
BETA_ACTIVATIONS = ("none", "sigmoid", "2sigmoid")


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """L2-normalise ``x`` over its last dimension, FLA style.

    Args:
        x: any shape ``[..., D]``, floating dtype (q ``[B, T, HQK, K]`` or k ``[B, T, HQK, K]`` in KDA).
        eps: added to ``sum(x**2)`` before the square root (not to the norm). Default ``1e-6``.

    Returns:
        Tensor of the shape and dtype of ``x``: ``x * rsqrt(sum(x**2, -1) + eps)``.
    """
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _gate_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    # FLA computes its gates in fp32 from whatever dtype g has; we compute in the promoted dtype of the
    # inputs but never below fp32, so bf16 g with fp32 parameters gives FLA's fp32 result.
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _biased(g: torch.Tensor, dt_bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    HV, K = g.shape[-2:]
    x = g.to(dtype)
    if dt_bias is not None:
        if dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias: expected {HV * K} (= HV * K) elements, got shape {tuple(dt_bias.shape)}")
        x = x + dt_bias.to(dtype).reshape(HV, K)
    return x


def _per_head(A_log: torch.Tensor, HV: int, dtype: torch.dtype) -> torch.Tensor:
    if A_log.numel() != HV:
        raise ValueError(f"A_log: expected {HV} (= HV) elements, got shape {tuple(A_log.shape)}")
    return A_log.to(dtype).reshape(HV, 1)


def softplus_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """KDA's default log-decay gate: ``-exp(A_log[hv]) * softplus(g + dt_bias.view(HV, K))``.

    Args:
        g: raw gate input ``[..., HV, K]`` (``[B, T, HV, K]`` in KDA), any float dtype.
        A_log: per value head log rate, ``HV`` elements (shape ``[HV]``), float.
        dt_bias: optional bias, ``HV * K`` elements (shape ``[HV * K]``), float.

    Returns:
        Log decay ``[..., HV, K]`` (all values ``<= 0``) in the promoted dtype of the inputs, at least fp32.
        ``softplus`` is ``torch.nn.functional.softplus`` (threshold 20, as FLA's kernel).
    """
    dtype = _gate_dtype(g, A_log, dt_bias)
    x = _biased(g, dt_bias, dtype)
    return -torch.exp(_per_head(A_log, g.shape[-2], dtype)) * F.softplus(x)


def safe_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float,
) -> torch.Tensor:
    """KDA's bounded log-decay gate: ``lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias.view(HV, K)))``.

    With ``A_log=None`` the rate factor is 1: ``lower_bound * sigmoid(g + dt_bias.view(HV, K))``.
    Outputs lie in ``(lower_bound, 0)`` for ``lower_bound < 0``.

    Args:
        g: raw gate input ``[..., HV, K]`` (``[B, T, HV, K]`` in KDA), any float dtype.
        A_log: ``None`` or ``HV`` elements (shape ``[HV]``), float.
        dt_bias: ``None`` or ``HV * K`` elements (shape ``[HV * K]``), float.
        lower_bound: Python float, the most negative log decay per step (FLA recommends -5).

    Returns:
        Log decay ``[..., HV, K]`` in the promoted dtype of the inputs, at least fp32.
    """
    dtype = _gate_dtype(g, A_log, dt_bias)
    x = _biased(g, dt_bias, dtype)
    if A_log is not None:
        x = torch.exp(_per_head(A_log, g.shape[-2], dtype)) * x
    return lower_bound * torch.sigmoid(x)


# kda_gate's ``safe_gate`` flag shadows the function of the same name inside it.
_bounded_gate = safe_gate


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """The gate FLA's ``chunk_kda(..., use_gate_in_kernel=True)`` applies, chosen as FLA 0.6.0 chooses it.

    * ``lower_bound is not None``: :func:`safe_gate` (``A_log`` may be ``None``), regardless of ``safe_gate``.
    * ``lower_bound is None``: :func:`softplus_gate`; ``A_log`` is then required.
    * ``safe_gate=True`` requires ``lower_bound`` in ``[-5, 0)``.

    Args:
        g: raw gate input ``[B, T, HV, K]`` (any leading dims ``[..., HV, K]``), float.
        A_log: ``None`` or ``[HV]`` float.
        dt_bias: ``None`` or ``[HV * K]`` float.
        safe_gate: FLA's flag; here it only adds the ``lower_bound`` checks.
        lower_bound: ``None`` or a Python float.

    Returns:
        Log decay ``[..., HV, K]`` in the promoted dtype of the inputs, at least fp32.

    Raises:
        ValueError: ``A_log`` and ``lower_bound`` both ``None``; ``safe_gate`` without a ``lower_bound`` in
        ``[-5, 0)``; a non-finite ``lower_bound`` (the rule of every op: `cula_core.validation.validate_lower_bound`).
        TypeError: a ``lower_bound`` that is not a real number.
    """
    validate_lower_bound(lower_bound, safe_gate=safe_gate)
    if lower_bound is not None:
        return _bounded_gate(g, A_log, dt_bias, lower_bound)
    if A_log is None:
        raise ValueError("A_log: required when lower_bound is None (softplus gate), got None")
    return softplus_gate(g, A_log, dt_bias)


def log_decay(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, gate: str,
              lower_bound: float | None) -> torch.Tensor:
    """The log decay a kernel receiving the calling convention's ``gate`` mode must use (see GATE_MODES):
    ``g`` itself when ``precomputed``, else :func:`softplus_gate` or :func:`safe_gate` of the raw ``g``."""
    if gate == "precomputed":
        return g
    if gate == "softplus":
        return softplus_gate(g, A_log, dt_bias)
    if gate == "safe":
        return _bounded_gate(g, A_log, dt_bias, lower_bound)
    raise ValueError(f"gate: expected one of {GATE_MODES}, got {gate!r}")


def activate_beta(beta: torch.Tensor, activation: str) -> torch.Tensor:
    """``beta`` after the calling convention's ``beta_activation`` (see BETA_ACTIVATIONS), in its own dtype."""
    if activation == "none":
        return beta
    if activation == "sigmoid":
        return torch.sigmoid(beta)
    if activation == "2sigmoid":
        return 2.0 * torch.sigmoid(beta)
    raise ValueError(f"beta_activation: expected one of {BETA_ACTIVATIONS}, got {activation!r}")
