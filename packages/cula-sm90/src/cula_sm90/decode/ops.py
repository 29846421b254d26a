"""The decode ops in the kernel calling convention of docs/backends.md (cula_core/reference_backend.py is
the executable specification): each prepares nothing core has not, and launches the kernels of launch.py.

Pools of another dtype than fp32 / bf16 are declined through the CallConfig (its `state_dtype` option); one that
is not 16-byte aligned, which the CallConfig cannot tell, runs the reference implementation here instead of a
kernel. `state_v_first` and `null_slot` (keywords of the calling convention, given only when set) go to the
kernels: the layout as a compile-time key, the null slot as a runtime argument.

kda_decode, kda_decode_mtp and kda_decode_mtp_kvbuffer also take `tiling` (and the verify `verify_variant`):
keywords that cula_core never passes, with launch.run_recurrent's contract (None = the dispatch table's pick; a
value names the kernel that runs). They are the seam through which the tests run every tiling and verify variant
against the reference and the benchmark times them. A named kernel never falls back to the reference: a pool the
kernels cannot take is then a ValueError."""

from __future__ import annotations

import functools

import torch

from cula_core import reference_backend
from cula_sm90.decode import configs, launch


def _kernel_can_take(state_pool: torch.Tensor, tiling=None, verify_variant=None) -> bool:
    """Whether the kernels take `state_pool` (else the reference runs); ValueError instead of False when the caller
    named a kernel (tiling / verify_variant): a run that names one must not pass on the reference."""
    if state_pool.dtype in configs.POOL_DTYPES and state_pool.data_ptr() % 16 == 0:
        return True
    if tiling is not None or verify_variant is not None:
        raise ValueError(f"tiling={tiling!r}, verify_variant={verify_variant!r} name a kernel, but the kernels take "
                         "fp32 or bf16 state pools at 16-byte aligned addresses, got state_pool of dtype "
                         f"{state_pool.dtype} at an address of {state_pool.data_ptr() % 16} mod 16")
    return False


def kda_decode_mtp(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
                   use_qk_l2norm_in_kernel, output_per_token_states, tiling=None, **pool):
    if not _kernel_can_take(state_pool, tiling):
        return reference_backend.kda_decode_mtp(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, scale=scale,
                                                lower_bound=lower_bound,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                output_per_token_states=output_per_token_states, **pool)
    mode = configs.MODE_STATES if output_per_token_states else configs.MODE_FINAL
    return launch.run_recurrent(mode, q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, scale=scale,
                                lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                tiling=tiling, **pool)


def kda_decode(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
               use_qk_l2norm_in_kernel, tiling=None, **pool):
    if not _kernel_can_take(state_pool, tiling):
        return reference_backend.kda_decode(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, scale=scale,
                                            lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                            **pool)
    o, _ = launch.run_recurrent(configs.MODE_FINAL, q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias,
                                scale=scale, lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                tiling=tiling, **pool)
    return o


def kda_decode_mtp_kvbuffer(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
                            use_qk_l2norm_in_kernel, tiling=None, verify_variant=None, **pool):
    if not _kernel_can_take(state_pool, tiling, verify_variant):
        return reference_backend.kda_decode_mtp_kvbuffer(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias,
                                                         scale=scale, lower_bound=lower_bound,
                                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **pool)
    return launch.run_recurrent(configs.MODE_KVBUFFER, q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias,
                                scale=scale, lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                tiling=tiling, verify_variant=verify_variant, **pool)


#: the recurrent-kernel mode of each decode op with a planned launch (kda_decode_mtp: by output_per_token_states)
_PLANNED_MODES = {"kda_decode": configs.MODE_FINAL, "kda_decode_mtp": (configs.MODE_FINAL, configs.MODE_STATES),
                  "kda_decode_mtp_kvbuffer": configs.MODE_KVBUFFER}


def planned(op: str, args: tuple, **flags):
    """The kernel of decode op `op` with its keywords `flags` fixed, for the calls of one plan (cula_core.plans):
    every call passes (q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias) with the types, shapes, dtypes and
    device of `args`: launch.recurrent_launcher's function, the launch resolved once, the pool's address checked on
    each call (16-byte aligned, or the reference runs, as `_kernel_can_take` decides). Other ops, and pools of a
    dtype the kernels do not take: the kernel with `flags` bound."""
    kernel = functools.partial(KERNELS[op], **flags)
    if op == "fused_recurrent_kda":
        return _planned_fused_recurrent(args, kernel, **flags)
    mode = _PLANNED_MODES.get(op)
    if mode is None or args[5].dtype not in configs.POOL_DTYPES or "tiling" in flags or "verify_variant" in flags:
        return kernel
    if op == "kda_decode_mtp":
        flags = dict(flags)
        mode = mode[bool(flags.pop("output_per_token_states"))]
    # a pool view at an odd offset runs the reference, as `_kernel_can_take` decides for the kernel's calls
    return launch.recurrent_launcher(mode, args, **flags, unaligned_pool=kernel, o_only=op == "kda_decode")


def _planned_fused_recurrent(args: tuple, kernel, *, scale, output_final_state, use_qk_l2norm_in_kernel, gate,
                             lower_bound, beta_activation, state_v_first=False):
    """fused_recurrent_kda's plan for the calls of `args` (q, k, v, g, beta, A_log, dt_bias, initial_state,
    cu_seqlens, ssm_state_indices, num_accepted_tokens): the pool call with one int32 slot per sequence and no
    cu_seqlens or accepted counts (a serving engine's decode step) runs MODE_FINAL through
    launch.recurrent_launcher, the launch resolved once, and returns (o, None) like `fused_recurrent_kda`; its
    program takes the fused op's argument order. Every other call: `kernel`, the op with its flags bound."""
    q, k, v, g, beta, A_log, dt_bias, pool, cu_seqlens, slots, accepted = args
    if (slots is None or cu_seqlens is not None or accepted is not None or slots.dim() != 1
            or slots.dtype != torch.int32 or pool.dtype not in configs.POOL_DTYPES):
        return kernel

    def reference(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias):  # a pool at an odd address
        return kernel(q, k, v, g, beta, A_log, dt_bias, state_pool, None, cache_idx, None)[0]

    launch_o = launch.recurrent_launcher(
        configs.MODE_FINAL, (q, k, v, g, beta, pool, slots, A_log, dt_bias), unaligned_pool=reference, o_only=True,
        **_recurrent_flags(scale, lower_bound, use_qk_l2norm_in_kernel, gate, beta_activation, state_v_first))

    def run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens):
        return launch_o(q, k, v, g, beta, initial_state, ssm_state_indices, A_log, dt_bias), None

    # the decode order (q, k, v, g, beta, pool, slots, A_log, dt_bias) at the fused op's positions
    program = launch_o.program
    run.program = None if program is None else program.reordered((0, 1, 2, 3, 4, 7, 9, 5, 6), len(args))
    return run


def _recurrent_flags(scale, lower_bound, use_qk_l2norm_in_kernel, gate, beta_activation, state_v_first) -> dict:
    """launch.run_recurrent's keywords for a fused_recurrent_kda call (only those that differ from its defaults)."""
    return dict(scale=scale, lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **({"state_v_first": True} if state_v_first else {}),
                **({"precomputed_gate": True} if gate == "precomputed" else {}),
                **({"beta_activation": beta_activation} if beta_activation != "none" else {}))


def kda_flush_kvbuffer_all_layers(state_pools, cache_idx, kvbuffers, accept_len, accept_len_all, **pool):
    """`pool`: the calling convention's state_v_first / null_slot keywords (only those that are set)."""
    kvbuffers = [launch._aligned(b) for b in kvbuffers]
    if not all(_kernel_can_take(p) for p in state_pools):
        return reference_backend.kda_flush_kvbuffer_all_layers(state_pools, cache_idx, kvbuffers, accept_len,
                                                               accept_len_all, **pool)
    launch.run_flush(list(state_pools), cache_idx, kvbuffers, accept_len, accept_len_all, **pool)


def kda_flush_kvbuffer(state_pool, cache_idx, kvbuffer, accept_len, accept_len_all, **pool):
    kda_flush_kvbuffer_all_layers([state_pool], cache_idx, [kvbuffer], accept_len, accept_len_all, **pool)


def _slot_indices(slots: torch.Tensor, P: int) -> torch.Tensor:
    """Pool slots ([N] or a slot table [N, T_idx]) as the kernel reads them (contiguous int32). int64 slots are
    clamped to [-1, P] first: one beyond the int32 range stays out of range (skipped, as the calling convention
    wants) instead of wrapping onto a slot."""
    if slots.dtype == torch.int32:
        return slots.contiguous()
    return slots.clamp(-1, P).to(torch.int32)


def _accepted_counts(accepted: torch.Tensor | None, cols: int) -> torch.Tensor | None:
    """num_accepted_tokens as the kernel reads it (contiguous int32). int64 counts are clamped to [0, cols] first
    (the kernel clamps the read column to the table; a count beyond the int32 range must not wrap)."""
    if accepted is None:
        return None
    if accepted.dtype == torch.int32:
        return accepted.contiguous()
    return accepted.clamp(0, cols).to(torch.int32)


def fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices,
                        num_accepted_tokens, *, scale, output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound,
                        beta_activation, state_v_first=False):
    """FLA's fused_recurrent_kda on the recurrent kernel, for the calls configs.fused_recurrent_reason accepts: any
    `gate` ("precomputed": g is the log decay; "softplus", or "safe" with `lower_bound`: the gate in kernel), any
    `beta_activation` ("none", "sigmoid", "2sigmoid"), N sequences of 1 <= T <= 16 tokens each (with cu_seqlens:
    all of the same length), run as N requests of T tokens (views of the inputs).
    The mappings (no pass over the pool or the states besides the kernel's own):
      * pool, one slot per sequence (ssm_state_indices [N], or column 0 of [N, T_idx] at T = 1 without
        num_accepted_tokens): MODE_FINAL in place; returns (o, None);
      * pool, a slot per token (ssm_state_indices [N, T_idx] at T > 1, or with num_accepted_tokens): MODE_SLOTS in
        place on the slot table, reading column num_accepted_tokens[n] - 1 (column 0 without it); returns
        (o, None);
      * new final state (T = 1, fp32 initial_state or None): MODE_STATES reading initial_state as a pool of N slots
        (None: one zero slot that every request reads); its per-token states are the final states;
      * outputs only: MODE_KVBUFFER on the same pool (reads states, writes none); the KVBuffer is dropped."""
    if ssm_state_indices is not None and not _kernel_can_take(initial_state):
        return reference_backend.fused_recurrent_kda(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
            scale=scale, output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            gate=gate, lower_bound=lower_bound, beta_activation=beta_activation, state_v_first=state_v_first)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    v_shape = v.shape
    if cu_seqlens is not None:  # one row of N sequences of T tokens each: N requests of T tokens
        T = q.shape[1] // N
        q, k, v, g, beta = (t.reshape(N, T, *t.shape[2:]) for t in (q, k, v, g, beta))
    flags = _recurrent_flags(scale, lower_bound, use_qk_l2norm_in_kernel, gate, beta_activation, state_v_first)
    if ssm_state_indices is not None:
        P = initial_state.shape[0]
        mode = configs.fused_recurrent_pool_mode(ssm_state_indices.dim() == 2, num_accepted_tokens is not None,
                                                 q.shape[1])
        if mode == configs.MODE_SLOTS:   # the whole slot table, and the accepted counts
            slots, accepted = ssm_state_indices, _accepted_counts(num_accepted_tokens, ssm_state_indices.shape[1])
        else:                             # one slot per sequence
            slots = ssm_state_indices if ssm_state_indices.dim() == 1 else ssm_state_indices[:, 0]
            accepted = None
        o, _ = launch.run_recurrent(mode, q, k, v, g, beta, initial_state, _slot_indices(slots, P), A_log, dt_bias,
                                    num_accepted_tokens=accepted, **flags)
        return o.reshape(v_shape), None
    if initial_state is None:
        K, V = q.shape[3], v.shape[3]
        pool = torch.zeros((1, v.shape[2], *((V, K) if state_v_first else (K, V))), device=q.device,
                           dtype=torch.float32)
        cache_idx = torch.zeros(N, device=q.device, dtype=torch.int32)
    else:
        pool = launch._aligned(initial_state)
        cache_idx = torch.arange(N, device=q.device, dtype=torch.int32)
    mode = configs.MODE_STATES if output_final_state else configs.MODE_KVBUFFER
    o, out = launch.run_recurrent(mode, q, k, v, g, beta, pool, cache_idx, A_log, dt_bias, **flags)
    return o.reshape(v_shape), out.reshape(N, *pool.shape[1:]) if output_final_state else None


KERNELS = {
    "kda_decode": kda_decode,
    "kda_decode_mtp": kda_decode_mtp,
    "kda_decode_mtp_kvbuffer": kda_decode_mtp_kvbuffer,
    "kda_flush_kvbuffer": kda_flush_kvbuffer,
    "kda_flush_kvbuffer_all_layers": kda_flush_kvbuffer_all_layers,
    "fused_recurrent_kda": fused_recurrent_kda,
}
