"""The reference backend: the math of `cula_core.reference` on any device, one kernel per public op with the
calling convention every backend's `kernel(op)` follows (validated, contiguous arguments; see docs/backends.md).
Each kernel prepares the inputs (L2 norm, gate, beta activation) and runs `cula_core.reference` in fp32 (fp64 for
fp64 inputs). It is the executable specification of each op, and what `cula_core.dispatch` falls back to.

This module imports nothing of dispatch or of the ops, so dispatch can import it at module level.
"""

from __future__ import annotations

import torch

from cula_core import reference as ref
from cula_core.backend import OPS, Backend, CallConfig, DeviceInfo
from cula_core.reference.kvbuffer import flush_kvbuffer_reference, mtp_kvbuffer_reference

REFERENCE = "reference"


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The reference computes in fp64 for fp64 inputs (gradcheck) and in fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def prepare_inputs(q, k, g, beta, A_log, dt_bias, *, dtype, use_qk_l2norm_in_kernel, gate, lower_bound,
                   beta_activation="none"):
    """What every kernel does to its inputs before the recurrence: (q, k, g, beta) in `dtype`, q and k
    L2-normalised when asked, g turned into the log decay by `gate` ("precomputed", "softplus" or "safe", with
    A_log / dt_bias / lower_bound), beta through `beta_activation` ("none" or "sigmoid"). Shapes unchanged."""
    q, k, g, beta = (t.to(dtype) for t in (q, k, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = ref.l2norm(q), ref.l2norm(k)
    A_log = A_log.to(dtype) if A_log is not None else None
    dt_bias = dt_bias.to(dtype) if dt_bias is not None else None
    return q, k, ref.log_decay(g, A_log, dt_bias, gate, lower_bound), ref.activate_beta(beta, beta_activation)


def _forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *, scale, output_final_state,
             use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation):
    dtype = work_dtype(q.dtype)
    qp, kp, gp, bp = prepare_inputs(q, k, g, beta, A_log, dt_bias, dtype=dtype,
                                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate,
                                    lower_bound=lower_bound, beta_activation=beta_activation)
    h0 = initial_state.to(dtype) if initial_state is not None else None
    o, ht = ref.chunk_kda_reference(qp, kp, v.to(dtype), gp, bp, scale=scale, initial_state=h0,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    # Outputs are contiguous in the FLA layout: every backend returns them so (the fake ops say so).
    return o.to(v.dtype).contiguous(), ht.contiguous() if ht is not None else None


def chunk_kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *, scale,
              output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation):
    with torch.no_grad():
        return _forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale=scale,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                        gate=gate, lower_bound=lower_bound, beta_activation=beta_activation)


def kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *, scale,
                output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, intracard_cp):
    # The reference runs sequences whole: context parallel changes the schedule, not the result.
    return chunk_kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale=scale,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     gate=gate, lower_bound=lower_bound, beta_activation=beta_activation)


def kda_prefill_chunk_states(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *, scale,
                             output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation,
                             chunk_size):
    """(o, final_state or None, h): h the state at every chunk start, [B, NT, HV, K, V] in q's dtype (FLA's)."""
    with torch.no_grad():
        dtype = work_dtype(q.dtype)
        qp, kp, gp, bp = prepare_inputs(q, k, g, beta, A_log, dt_bias, dtype=dtype,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate,
                                        lower_bound=lower_bound, beta_activation=beta_activation)
        h0 = initial_state.to(dtype) if initial_state is not None else None
        o, ht, h = ref.chunk_kda_states_reference(qp, kp, v.to(dtype), gp, bp, scale=scale, initial_state=h0,
                                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                                  chunk_size=chunk_size)
        return (o.to(v.dtype).contiguous(), ht.contiguous() if ht is not None else None,
                h.to(q.dtype).contiguous())


def fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices,
                        num_accepted_tokens, *, scale, output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound,
                        beta_activation, state_v_first=False):
    """Without ssm_state_indices: (o, final_state or None), the state fp32 (fp64 for fp64 inputs). With them,
    initial_state is the pool: updated in place (`recurrent_kda_pool`), returns (o, None). V-first states are
    read and written through transposed views (the reference declares it serves state_v_first here)."""
    with torch.no_grad():
        dtype = work_dtype(q.dtype)
        qp, kp, gp, bp = prepare_inputs(q, k, g, beta, A_log, dt_bias, dtype=dtype,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate,
                                        lower_bound=lower_bound, beta_activation=beta_activation)
        state = initial_state.transpose(-1, -2) if state_v_first and initial_state is not None else initial_state
        if ssm_state_indices is not None:
            o = ref.recurrent_kda_pool(qp, kp, v.to(dtype), gp, bp, scale, state, ssm_state_indices,
                                       num_accepted_tokens, cu_seqlens)
            return o.to(v.dtype).contiguous(), None
        o, ht = ref.recurrent_kda(qp, kp, v.to(dtype), gp, bp, scale=scale,
                                  initial_state=state.to(dtype) if state is not None else None,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        if ht is not None:
            ht = (ht.transpose(-1, -2) if state_v_first else ht).contiguous()
        return o.to(v.dtype).contiguous(), ht


def chunk_kda_backward(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *,
                       scale, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation):
    """Gradients of (q, k, v, g, beta, A_log, dt_bias, initial_state) by a vector-Jacobian product through
    the reference forward; None for an absent input.

    torch.func.vjp rather than torch.autograd: this runs inside a custom op, where torch has switched the
    autograd dispatch keys off; functorch's transforms work there."""
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    where = [i for i, t in enumerate(inputs) if t is not None]

    def forward(*present):
        args = list(inputs)
        for i, t in zip(where, present, strict=True):
            args[i] = t
        o, ht = _forward(*args, cu_seqlens, scale=scale, output_final_state=dht is not None,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate, lower_bound=lower_bound,
                         beta_activation=beta_activation)
        return (o, ht) if dht is not None else (o,)

    outputs, vjp = torch.func.vjp(forward, *(inputs[i] for i in where))
    cotangents = (do.to(outputs[0].dtype),) + ((dht.to(outputs[1].dtype),) if dht is not None else ())
    grads = iter(vjp(cotangents))
    return tuple(next(grads).to(t.dtype) if t is not None else None for t in inputs)


def _prepare_decode(q, k, g, beta, A_log, dt_bias, state_pool, *, lower_bound, use_qk_l2norm_in_kernel):
    gate = "safe" if lower_bound is not None else "softplus"
    return prepare_inputs(q, k, g, beta, A_log, dt_bias, dtype=work_dtype(state_pool.dtype),
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, gate=gate, lower_bound=lower_bound)


def kda_decode_mtp(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
                   use_qk_l2norm_in_kernel, output_per_token_states, state_v_first=False, null_slot=None):
    qp, kp, gp, bp = _prepare_decode(q, k, g, beta, A_log, dt_bias, state_pool, lower_bound=lower_bound,
                                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    o, states = ref.decode_mtp_reference(qp, kp, v, gp, bp, state_pool, cache_idx, scale=scale,
                                         state_v_first=state_v_first, null_slot=null_slot)
    if not output_per_token_states:
        ref.commit_accepted_reference(state_pool, cache_idx, states, q.shape[1], null_slot=null_slot)
        states = None
    return o.to(v.dtype).contiguous(), states


def kda_decode(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
               use_qk_l2norm_in_kernel, state_v_first=False, null_slot=None):
    o, _ = kda_decode_mtp(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, scale=scale,
                          lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          output_per_token_states=False, state_v_first=state_v_first, null_slot=null_slot)
    return o


def kda_decode_mtp_kvbuffer(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
                            use_qk_l2norm_in_kernel, state_v_first=False, null_slot=None):
    qp, kp, gp, bp = _prepare_decode(q, k, g, beta, A_log, dt_bias, state_pool, lower_bound=lower_bound,
                                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    o, buf = mtp_kvbuffer_reference(qp, kp, v, gp, bp, state_pool, cache_idx, scale=scale,
                                    state_v_first=state_v_first, null_slot=null_slot)
    return o.to(v.dtype).contiguous(), buf


def _accept(accept_len, accept_len_all):
    return accept_len if accept_len is not None else accept_len_all


def kda_flush_kvbuffer(state_pool, cache_idx, kvbuffer, accept_len, accept_len_all, *, state_v_first=False,
                       null_slot=None):
    flush_kvbuffer_reference(state_pool, cache_idx, kvbuffer, _accept(accept_len, accept_len_all),
                             state_v_first=state_v_first, null_slot=null_slot)


def kda_flush_kvbuffer_all_layers(state_pools, cache_idx, kvbuffers, accept_len, accept_len_all, *,
                                  state_v_first=False, null_slot=None):
    for pool, buf in zip(state_pools, kvbuffers, strict=True):
        flush_kvbuffer_reference(pool, cache_idx, buf, _accept(accept_len, accept_len_all),
                                 state_v_first=state_v_first, null_slot=null_slot)


class ReferenceBackend(Backend):
    """The reference math of `cula_core.reference`, on any device. Always available, never preferred."""

    name = REFERENCE
    package = "cula-core"

    def runs_on(self, device: DeviceInfo) -> bool:
        return True

    def unsupported_reason(self, call: CallConfig) -> str | None:
        return None

    def serves_state_v_first(self, call: CallConfig) -> bool:
        # the pool op indexes a V-first pool through a transposed view (no copy of the pool); the chunked
        # ops take the copies core makes
        return call.op == "fused_recurrent_kda"

    def kernel(self, op: str):
        kernel = KERNELS.get(op)
        if kernel is None:
            raise NotImplementedError(f"backend {self.name!r} has no kernel for {op}")
        return kernel

    def describe(self) -> str:
        return "plain PyTorch on any device (cula_core.reference)"


KERNELS = {op: globals()[op] for op in OPS}  # a function per public op, named as the op

REFERENCE_BACKEND = ReferenceBackend()
