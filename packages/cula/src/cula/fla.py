"""cula as a backend of FLA 0.6.0 (flash-linear-attention): ``import cula.fla`` once, and FLA's own
``fla.ops.kda.chunk_kda`` and ``fused_recurrent_kda`` (so FLA's ``KimiDeltaAttention`` layer and KDA models)
run on cula's kernels wherever one serves the call, and on FLA's kernels everywhere else.

FLA's dispatch (``fla.backends``): a dispatched entry point asks each registered backend, lowest ``priority``
first, ``verify(function_name, *args, **kwargs)``; the first that accepts runs the call, and when none does the
FLA function runs as usual. Two entry points are dispatched for KDA, and cula registers for both:

  * ``fla.ops.kda.chunk_kda`` (training and prefill): `ChunkKDABackend` calls ``cula.chunk_kda``.
    FLA dispatches *before* its own argument checks, so the verifier redoes them (`fla_chunk_kda_refusal`):
    a call FLA would refuse goes back to FLA, which raises FLA's own error.
  * ``fla.ops.kda.fused_recurrent_kda``, whose kernel launch ``fused_recurrent_kda_fwd`` FLA dispatches
    (operation ``"kda"``; the layer calls it for short inputs without gradients): `RecurrentKDABackend` calls
    ``cula.fused_recurrent_kda``, in the launch's two modes: a new final state (``inplace_final_state=False``,
    what FLA's public function sends) and a state pool updated in place through ``ssm_state_indices``
    (``inplace_final_state=True``). An in-place call without slot indices, or one with an ``out`` buffer, stays
    on FLA.

A verifier accepts a call only when a cula *kernel* serves it on the call's device: it asks
`cula_core.dispatch.kernel_backend_for`, so a call cula would run on its reference (CPU tensors, a head dim no
kernel takes, a missing arch package, ``CULA_BACKEND=reference``) stays on FLA. A training call needs a kernel
for the backward too. Where FlashKDA (FLA's other ``chunk_kda`` backend, inference only) also serves a call,
`PREFERENCE_VS_FLASH_KDA` decides which runs.

Switches: ``FLA_CULA=0`` in the environment when this module is imported registers nothing. The backends also
declare ``FLA_CULA`` as their FLA switch (as FlashKDA declares ``FLA_FLASH_KDA``), so FLA reads it again at
each call: setting it to ``0`` later turns cula off for later calls. ``FLA_DISABLE_BACKEND_DISPATCH=1`` (FLA's
own) bypasses every backend.

Logging: the first call of each FLA function that each cula backend serves logs, on the ``cula.fla`` logger at
INFO, ``cula.fla: FLA's chunk_kda runs on cula (backend sm100)``; FLA's own ``fla.backends`` logger says (at INFO) why a backend declined a call, once per
function and backend.

Requires flash-linear-attention 0.6 (``fla.backends``); importing this module without it raises ImportError.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import torch

import cula_core
from cula_core import dispatch
from cula_core.backend import CallConfig, DeviceInfo
from cula_core.validation import gate_mode

try:
    from fla.backends import BaseBackend, register as fla_register
    from fla.ops.kda.backends.flash_kda import FlashKDABackend
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda
except ImportError as exc:  # FLA missing, or a version without fla.backends
    raise ImportError(
        "cula.fla registers cula as a backend of flash-linear-attention 0.6 (fla.backends, "
        f"fla.ops.kda.backends.flash_kda), which cannot be imported here: {exc}"
    ) from exc

__all__ = [
    "ENV_VAR",
    "PREFERENCE_VS_FLASH_KDA",
    "ChunkKDABackend",
    "PreferenceRow",
    "RecurrentKDABackend",
    "fla_chunk_kda_refusal",
    "is_registered",
    "register",
]

logger = logging.getLogger("cula.fla")

#: The environment variable that turns cula off in FLA: ``0`` disables, anything else (or unset) enables.
ENV_VAR = "FLA_CULA"

# Ahead of FlashKDA (3) and FLA's own kernels (the undecorated function): cula's verifiers decline what
# FlashKDA should run (PREFERENCE_VS_FLASH_KDA), so the order among the two is the table's, not this number's.
PRIORITY = 2


# ------------------------------------------------------------------------------------------------------------
# FlashKDA or cula, for a chunk_kda call both serve
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreferenceRow:
    """From ``tokens`` tokens in the call (B * T) up to the next row's, `winner` ("cula" or "flash_kda") runs a
    chunk_kda call that both serve; `evidence` names the benchmark document the row rests on."""

    tokens: int
    winner: str
    evidence: str


#: Which of cula and FlashKDA runs a chunk_kda call both serve (FlashKDA serves inference only: bf16,
#: K = V = 128, HV == HQK, the safe gate in kernel, V-first states). The last row whose `tokens` the call reaches
#: decides. Chosen by measurement through FLA's own dispatch (``python -m tools.bench.fla_dispatch``: FLA's
#: chunk_kda handed to each backend, on the same bf16 inputs, H100 and H200); below 4096 tokens a call is
#: bound by host time, and cula is not ahead on both cards there (behind at 1024 tokens on the H200 machine), so
#: FlashKDA keeps them.
#: docs/using_cula_from_fla_vllm_sglang.md quotes the rows and their numbers.
PREFERENCE_VS_FLASH_KDA: tuple[PreferenceRow, ...] = (
    PreferenceRow(0, "flash_kda", "docs/benchmarks/fla_dispatch.md"),
    PreferenceRow(4096, "cula", "docs/benchmarks/fla_dispatch.md"),
)


def preferred_over_flash_kda(tokens: int) -> str:
    """The `PREFERENCE_VS_FLASH_KDA` winner for a call of `tokens` tokens."""
    winner = PREFERENCE_VS_FLASH_KDA[0].winner
    for row in PREFERENCE_VS_FLASH_KDA:
        if tokens >= row.tokens:
            winner = row.winner
    return winner


def _flash_kda_serves(*args, **kwargs) -> bool:
    """Whether FLA's FlashKDA backend is installed, enabled and accepts this chunk_kda call (its public
    verify, as FLA's dispatch asks it)."""
    if not FlashKDABackend.is_available():
        return False
    backend = FlashKDABackend()
    return backend.is_enabled() and backend.verify("chunk_kda", *args, **kwargs)[0]


# ------------------------------------------------------------------------------------------------------------
# What FLA checks before it runs its own kernels (and skips when a backend takes the call)
# ------------------------------------------------------------------------------------------------------------


def fla_chunk_kda_refusal(q, k, v, g, beta, initial_state, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                          allow_neg_eigval, safe_gate, lower_bound, disable_recompute, return_intermediate_states,
                          state_v_first, cu_seqlens, kwargs) -> str | None:
    """Why FLA 0.6.0's ``chunk_kda`` would refuse these arguments (its checks, in its order), or None.

    FLA dispatches to a backend before it checks anything, so a backend that took such a call would run on
    inputs FLA rejects; declined, the call reaches FLA's body, which raises FLA's own error. `kwargs`: what
    FLA's ``**kwargs`` received (A_log, dt_bias, chunk_size, transpose_state_layout). FLA's checks of a
    ``cp_context`` call are not redone: cula declines every such call."""
    if "transpose_state_layout" in kwargs and state_v_first:
        return "FLA refuses state_v_first together with its deprecated alias transpose_state_layout"
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            return f"cu_seqlens needs batch size 1, got {q.shape[0]}"
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            return f"initial_state has {initial_state.shape[0]} states for {len(cu_seqlens) - 1} sequences"
    if initial_state is not None and initial_state.dtype != torch.float32:
        return f"FLA takes a float32 initial_state, got {initial_state.dtype}"
    if use_gate_in_kernel and kwargs.get("A_log") is None and lower_bound is None:
        return "use_gate_in_kernel=True needs A_log or lower_bound"
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in (32, 64):
        return f"chunk_size must be 32 or 64, got {chunk_size}"
    if safe_gate and use_gate_in_kernel and (lower_bound is None or not -5 <= lower_bound < 0):
        return f"safe_gate=True needs lower_bound in [-5, 0), got {lower_bound}"
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        return "allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True"
    B, T, H, K = q.shape
    HV = v.shape[2]
    if k.shape != q.shape:
        return f"q and k shapes differ: {tuple(q.shape)} and {tuple(k.shape)}"
    if K > 256:
        return f"FLA takes K <= 256, got {K}"
    if HV % H:
        return f"HV = {HV} is not a multiple of H = {H}"
    if tuple(g.shape) != (B, T, HV, K):
        return f"g must be {[B, T, HV, K]}, got {list(g.shape)}"
    if tuple(beta.shape) != (B, T, HV):
        return f"beta must be {[B, T, HV]}, got {list(beta.shape)}"
    if return_intermediate_states and (not torch.is_inference_mode_enabled() or disable_recompute):
        return "FLA takes return_intermediate_states only in inference mode and without disable_recompute"
    return None


def _same_device_and_dtype(q, tensors: dict) -> str | None:
    """cula's ops need every tensor on q's device and k, v in q's dtype (FLA's kernels convert silently)."""
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            return f"{name} is on {t.device}, q on {q.device}"
    for name in ("k", "v"):
        if tensors[name].dtype != q.dtype:
            return f"{name} is {tensors[name].dtype}, q {q.dtype}"
    return None


def _gate_params_fit(A_log, dt_bias, HV: int, K: int) -> str | None:
    # FLA and cula take A_log of any shape holding HV values and dt_bias holding HV * K; other counts go back
    # to FLA, whose own path reports them.
    if A_log is not None and A_log.numel() != HV:
        return f"A_log holds {A_log.numel()} values, HV = {HV}"
    if dt_bias is not None and dt_bias.numel() != HV * K:
        return f"dt_bias holds {dt_bias.numel()} values, HV * K = {HV * K}"
    return None


def _beta_activation(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> str:
    if use_beta_sigmoid_in_kernel:
        return "2sigmoid" if allow_neg_eigval else "sigmoid"
    return "none"


def _kernel_for(call: CallConfig, sizes: dict[str, int]) -> tuple[str | None, str | None]:
    """(name of the cula backend whose kernel serves `call`, None) or (None, why none does). `sizes`: element
    counts of the tensors the kernel indexes, for the backend's int32 indexing limit."""
    backend, reason = dispatch.kernel_backend_for(call)
    if backend is None:
        return None, reason
    if backend.indexes_in_int32(call.op):
        for name, n in sizes.items():
            if n >= 2**31:
                return None, f"{name} has {n} elements; the {backend.name} kernels index in int32"
    return backend.name, None


# ------------------------------------------------------------------------------------------------------------
# The backends
# ------------------------------------------------------------------------------------------------------------

_logged: set[tuple[str, str]] = set()
_logged_lock = threading.Lock()
# FLA's dispatch calls a backend's implementation right after its verifier accepted, in the same thread: the
# verifier leaves the name of the cula backend it found here, for the log line.
_accepted = threading.local()


def _accept(backend: str) -> tuple[bool, None]:
    _accepted.backend = backend
    return True, None


def _log_served(function: str, call) -> None:
    """The INFO line that shows cula ran `function`, once per (FLA function, cula backend) and process. `call`:
    makes the call's configuration, needed only when the implementation ran without FLA's verify first."""
    backend = getattr(_accepted, "backend", None)
    _accepted.backend = None
    if backend is None:
        found, _ = dispatch.kernel_backend_for(call())
        backend = found.name if found is not None else "?"
    key = (function, backend)
    if key in _logged:
        return
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.info("cula.fla: FLA's %s runs on cula (backend %s)", function, backend)


def _call_config(op: str, q, v, *, requires_grad: bool, use_gate_in_kernel, lower_bound, cu_seqlens,
                 use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, initial_state,
                 output_final_state, state_v_first, **options) -> CallConfig:
    """The configuration cula's dispatch chooses a backend by, for FLA-ordered arguments (the options cula's
    chunked ops put in their own calls; `options`: an op's own, such as the chunk size of the per-chunk
    states)."""
    B, T, HQK, K = q.shape
    return CallConfig(
        op=op, device=DeviceInfo.of(q.device), dtype=q.dtype, K=K, V=v.shape[3], HQK=HQK, HV=v.shape[2], T=T,
        gate=gate_mode(use_gate_in_kernel, lower_bound), varlen=cu_seqlens is not None, requires_grad=requires_grad,
        options={"use_qk_l2norm_in_kernel": bool(use_qk_l2norm_in_kernel),
                 "beta_activation": _beta_activation(use_beta_sigmoid_in_kernel, allow_neg_eigval),
                 "initial_state": initial_state is not None, "output_final_state": bool(output_final_state),
                 "state_v_first": bool(state_v_first), "lower_bound": lower_bound, "tokens": B * T, **options},
    )


def _requires_grad(*tensors) -> bool:
    # cula's chunk_kda builds a training call (forward and backward kernels) exactly when this holds
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class ChunkKDABackend(BaseBackend):
    """FLA backend for ``fla.ops.kda.chunk_kda``: runs ``cula.chunk_kda`` on the calls a cula kernel serves
    (forward, and backward when gradients are wanted), with FLA's arguments and FLA's results."""

    backend_type = "cula"
    env_var = ENV_VAR
    priority = PRIORITY

    def chunk_kda_verifier(
        self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
        return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
        cp_context=None, use_graph=False, max_num_seqs=None, **kwargs,
    ) -> tuple[bool, str | None]:
        """(True, None) when a cula kernel serves this FLA ``chunk_kda`` call, else (False, why not)."""
        if cp_context is not None:
            return False, "cula does not run FLA's context parallel (cp_context)"
        refusal = fla_chunk_kda_refusal(
            q, k, v, g, beta, initial_state, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            safe_gate, lower_bound, disable_recompute, return_intermediate_states, state_v_first, cu_seqlens, kwargs,
        )
        if refusal is not None:
            return False, f"left to FLA, which refuses the call: {refusal}"
        if use_graph:
            return False, "cula does not take FLA's use_graph (its padded varlen chunk lists)"
        v_first = bool(kwargs.get("transpose_state_layout", state_v_first))
        A_log = kwargs.get("A_log") if use_gate_in_kernel else None
        dt_bias = kwargs.get("dt_bias") if use_gate_in_kernel else None
        B, T, HQK, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        reason = _same_device_and_dtype(q, {"k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
                                            "A_log": A_log, "dt_bias": dt_bias, "cu_seqlens": cu_seqlens})
        reason = reason or _gate_params_fit(A_log, dt_bias, HV, K)
        if reason is not None:
            return False, reason

        requires_grad = _requires_grad(q, k, v, g, beta, A_log, dt_bias, initial_state)
        N = B if cu_seqlens is None else len(cu_seqlens) - 1
        sizes = {"q": q.numel(), "k": k.numel(), "v": v.numel(), "g": g.numel(), "o": v.numel(),
                 "state": N * HV * K * V}
        if return_intermediate_states:
            ops = ("kda_prefill_chunk_states",)
        else:
            ops = ("chunk_kda", "chunk_kda_backward") if requires_grad else ("chunk_kda",)
        served = None
        for op in ops:
            call = _call_config(
                op, q, v, requires_grad=requires_grad, use_gate_in_kernel=use_gate_in_kernel,
                lower_bound=lower_bound, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                initial_state=initial_state, output_final_state=output_final_state, state_v_first=v_first,
                **({"chunk_size": kwargs.get("chunk_size", 64)} if op == "kda_prefill_chunk_states" else {}),
            )
            name, reason = _kernel_for(call, sizes)
            if name is None:
                return False, f"no cula kernel serves {op}: {reason}"
            served = served or name
        if not requires_grad and preferred_over_flash_kda(B * T) == "flash_kda" and _flash_kda_serves(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, disable_recompute,
            return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu, cp_context, use_graph,
            max_num_seqs, **kwargs,
        ):
            return False, "FlashKDA serves this call and is faster on its shape (cula.fla.PREFERENCE_VS_FLASH_KDA)"
        return _accept(served)

    def chunk_kda(
        self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
        return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
        cp_context=None, use_graph=False, max_num_seqs=None, **kwargs,
    ):
        """``cula.chunk_kda`` on FLA's arguments: returns FLA's ``(o, final_state)`` (``(o, final_state, h)`` with
        return_intermediate_states). Keyword arguments FLA ignores are dropped here too."""
        extra = {name: kwargs[name] for name in ("chunk_size", "transpose_state_layout") if name in kwargs}
        A_log = kwargs.get("A_log") if use_gate_in_kernel else None
        dt_bias = kwargs.get("dt_bias") if use_gate_in_kernel else None
        out = cula_core.chunk_kda(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=disable_recompute,
            return_intermediate_states=return_intermediate_states, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log, dt_bias=dt_bias, **extra,
        )
        _log_served("chunk_kda", lambda: _call_config(
            "chunk_kda", q, v, requires_grad=_requires_grad(q, k, v, g, beta, A_log, dt_bias, initial_state),
            use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, initial_state=initial_state, output_final_state=output_final_state,
            state_v_first=kwargs.get("transpose_state_layout", state_v_first),
        ))
        return out


def _recurrent_call(q, v, beta, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens, *,
                    use_gate_in_kernel, lower_bound, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, output_final_state, state_v_first) -> CallConfig:
    """The configuration of a ``cula.fused_recurrent_kda`` call (the options that op puts in its own calls): a
    new final state, or with slot indices a state pool updated in place."""
    _B, T, HQK, K = q.shape
    pool = ssm_state_indices is not None
    return CallConfig(
        op="fused_recurrent_kda", device=DeviceInfo.of(q.device), dtype=q.dtype, K=K, V=v.shape[3], HQK=HQK,
        HV=v.shape[2], T=T, gate=gate_mode(use_gate_in_kernel, lower_bound), varlen=cu_seqlens is not None,
        options={"use_qk_l2norm_in_kernel": bool(use_qk_l2norm_in_kernel),
                 "beta_activation": _beta_activation(use_beta_sigmoid_in_kernel, allow_neg_eigval),
                 "beta_per_channel": beta.dim() == 4, "initial_state": initial_state is not None,
                 "output_final_state": bool(output_final_state) and not pool, "state_v_first": bool(state_v_first),
                 "state_dtype": initial_state.dtype if initial_state is not None else None, "pool": pool,
                 "per_token_slots": pool and ssm_state_indices.dim() == 2,
                 "num_accepted_tokens": num_accepted_tokens is not None, "lower_bound": lower_bound,
                 # FLA passes no host copy of cu_seqlens: its sequences' lengths are unknown here
                 "seq_len": None if cu_seqlens is not None else T,
                 "state_contiguous": initial_state is None or not pool or initial_state.is_contiguous()},
    )


class RecurrentKDABackend(BaseBackend):
    """FLA backend for ``fused_recurrent_kda_fwd`` (operation ``"kda"``), the launch behind FLA's public
    ``fla.ops.kda.fused_recurrent_kda``: runs ``cula.fused_recurrent_kda`` when a cula kernel serves the call,
    in FLA's two modes: a new final state (``inplace_final_state=False``, what FLA's public function and layers
    send), and a state pool updated in place through ``ssm_state_indices`` (``inplace_final_state=True``, the
    continuous-batching mode). An in-place call without slot indices, or one with an ``out`` buffer, stays on
    FLA."""

    backend_type = "cula"
    env_var = ENV_VAR
    priority = PRIORITY

    def fused_recurrent_kda_fwd_verifier(
        self, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
        output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
        ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, out=None, **kwargs,
    ) -> tuple[bool, str | None]:
        """(True, None) when a cula kernel serves this FLA recurrent call, else (False, why not)."""
        if inplace_final_state != (ssm_state_indices is not None):
            return False, ("cula serves a new final state without ssm_state_indices, or an in-place pool update "
                           f"with them; got inplace_final_state={inplace_final_state} "
                           f"with{'out' if ssm_state_indices is None else ''} ssm_state_indices")
        if num_accepted_tokens is not None and ssm_state_indices is None:
            return False, "num_accepted_tokens without ssm_state_indices"
        if out is not None:
            return False, "cula does not write into a caller's out buffer"
        # FLA's fused_recurrent_kda checks these before it launches; a direct caller of the launch skips them
        B, T, HQK, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        if cu_seqlens is not None and B != 1:
            return False, f"cu_seqlens needs batch size 1, got {B}"
        if cu_seqlens is not None and initial_state is not None and ssm_state_indices is None \
                and initial_state.shape[0] != len(cu_seqlens) - 1:
            return False, f"initial_state has {initial_state.shape[0]} states for {len(cu_seqlens) - 1} sequences"
        if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
            return False, "allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True"
        if use_gate_in_kernel and A_log is None and lower_bound is None:
            return False, "use_gate_in_kernel=True needs A_log or lower_bound"
        if not use_gate_in_kernel:
            A_log = dt_bias = None
        reason = _same_device_and_dtype(q, {"k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
                                            "A_log": A_log, "dt_bias": dt_bias, "cu_seqlens": cu_seqlens,
                                            "ssm_state_indices": ssm_state_indices,
                                            "num_accepted_tokens": num_accepted_tokens})
        reason = reason or _gate_params_fit(A_log, dt_bias, HV, K)
        if reason is not None:
            return False, reason
        call = _recurrent_call(
            q, v, beta, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
            use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, output_final_state=output_final_state, state_v_first=state_v_first,
        )
        N = B if cu_seqlens is None else len(cu_seqlens) - 1
        sizes = {"q": q.numel(), "v": v.numel(), "g": g.numel(), "final_state": N * HV * K * V,
                 "initial_state": 0 if initial_state is None else initial_state.numel()}
        name, reason = _kernel_for(call, sizes)
        if name is None:
            return False, f"no cula kernel serves fused_recurrent_kda: {reason}"
        return _accept(name)

    def fused_recurrent_kda_fwd(
        self, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
        output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
        ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, out=None, **kwargs,
    ):
        """``cula.fused_recurrent_kda`` on the launch's arguments: FLA's ``(o, final_state)``: a new final state
        (None unless output_final_state), or in place the pool ``initial_state`` itself."""
        pool = {} if ssm_state_indices is None else {"ssm_state_indices": ssm_state_indices}
        if num_accepted_tokens is not None:
            pool["num_accepted_tokens"] = num_accepted_tokens
        result = cula_core.fused_recurrent_kda(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, **pool,
        )
        _log_served("fused_recurrent_kda", lambda: _recurrent_call(
            q, v, beta, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
            use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, output_final_state=output_final_state, state_v_first=state_v_first))
        return result


# ------------------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------------------

_registered = False
_register_lock = threading.Lock()


def register() -> bool:
    """Register cula's backends with FLA, once per process (this module's import calls it). Returns whether
    they are registered: False while ``FLA_CULA=0`` is set and they were not registered before. (FLA has no
    way to unregister a backend: once registered, ``FLA_CULA=0`` at call time is what turns cula off.)"""
    global _registered
    with _register_lock:
        if _registered:
            return True
        if os.environ.get(ENV_VAR, "1").strip() == "0":
            logger.info("cula.fla: %s=0, cula is not registered with FLA", ENV_VAR)
            return False
        fla_register(fla_chunk_kda)(ChunkKDABackend)
        fla_register("kda")(RecurrentKDABackend)
        _registered = True
        return True


def is_registered() -> bool:
    """Whether cula's backends are registered with FLA in this process."""
    return _registered


register()
