"""The thin launcher of the sm89 kernels: torch tensors in, `KdaPrefillIO` filled, `cula_sm89._C.run` on the
current CUDA stream.

`kda_prefill` and `chunk_kda` follow the backend calling convention of cula_core (docs/backends.md; the
reference backend's `cula_core/reference_backend.py` is the specification): validated, contiguous FLA-layout
tensors and keyword flags, returning ``(o, final_state or None)``. The element-wise preprocessing runs here,
on the GPU, through the single definition in `cula_core.reference` (L2 norm of q/k, the softplus or safe gate
from raw g) plus the beta activation; each is one extra pass over its tensor, the price of not fusing them
into the kernels. The kernels read FLA's [B, T, H, D] layout in place through strides: no transposing copy.

`prefill` is the low-level entry (used by the tests and the benchmark): prepared float32 inputs, an explicit
chunk size, and optionally the intra-chunk buffers w, u and the debug score matrices.
"""

from __future__ import annotations

import torch

from cula_core import reference as ref

_ALIGN = 16  # bytes: the kernels read q, k, v, g rows with 16-byte loads


def _extension():
    from cula_sm89 import _C

    return _C


def _kernel_ready(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """`t` (fp32) with a contiguous last dim, a 16-byte aligned data pointer and strides that are multiples of
    `multiple` elements; copies only when it is not (never for a contiguous tensor from the allocator)."""
    ok = (t.stride(-1) == 1 and t.data_ptr() % _ALIGN == 0
          and all(s % multiple == 0 for s in t.stride()[:-1]))
    if ok:
        return t
    fresh = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    fresh.copy_(t)
    return fresh


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    s = t.stride()
    return (s[0], s[1], s[2])


def prefill(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
            chunk_size=0, out=None, return_intermediates=False, debug_scores=False, state_tile=0):
    """fp32 KDA prefill on prepared inputs (q/k normalised if wanted, g the log decay, beta activated).

    Args:
        q, k: ``[B, T, HQK, K]`` float32 CUDA; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]`` (<= 0);
            beta: ``[B, T, HV]``. K == V in (64, 128); HV a multiple of HQK.
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` float32 or None. N = B, or ``len(cu_seqlens) - 1``.
        output_final_state: also return the state after each sequence.
        cu_seqlens: ``[N + 1]`` int (converted to int32 on the device), B == 1.
        chunk_size: 32 or 64; 0 takes the library default for K.
        out: optional preallocated o (float32, contiguous ``[B, T, HV, V]`` on q's device).
        return_intermediates: also return a dict with ``w [R, HV, NC, C, K]``, ``u [R, HV, NC, C, V]`` (R = B,
            NC = ceil(T / C); varlen: R = 1, NC = ceil(T / C) + N, chunk c of sequence n at slot
            ``sum_{m<n} ceil(len_m / C) + c``) and ``chunk_size``; with ``debug_scores`` also ``aqk`` (scaled
            causal q-k scores) and ``akk`` ((I + L)^-1), ``[R, HV, NC, C, C]``.
        state_tile: columns of the state per inter-chunk block, 16 or 32; 0 lets the library choose (16 when the
            32-column grid would leave SMs idle). Tests force each.

    Returns:
        ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``, plus the dict when asked.
    """
    _C = _extension()
    B, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype != torch.float32 or not t.is_cuda:
            raise ValueError(f"{name} must be a float32 CUDA tensor, got {t.dtype} on {t.device}")
    device = q.device
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    q, k, v, g = (_kernel_ready(t, 4) for t in (q, k, v, g))
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    if out is None:
        o = torch.empty((B, T, HV, V), dtype=torch.float32, device=device)
    else:
        if out.shape != (B, T, HV, V) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != device:
            raise ValueError(f"out must be a contiguous float32 [B, T, HV, V] = {[B, T, HV, V]} tensor on {device}")
        o = out
    final_state = torch.empty((N, HV, K, V), dtype=torch.float32, device=device) if output_final_state else None

    with torch.cuda.device(device):  # the library sizes and launches on the current device
        io = _C.KdaPrefillIO()
        io.B, io.T, io.HQK, io.HV, io.K, io.V, io.N = B, T, HQK, HV, K, V, N
        io.chunk_size = int(chunk_size)
        io.scale = float(K ** -0.5 if scale is None else scale)
        io.q, io.q_stride = q.data_ptr(), _strides3(q)
        io.k, io.k_stride = k.data_ptr(), _strides3(k)
        io.v, io.v_stride = v.data_ptr(), _strides3(v)
        io.g, io.g_stride = g.data_ptr(), _strides3(g)
        io.beta, io.beta_stride = beta.data_ptr(), _strides3(beta)
        io.o, io.o_stride = o.data_ptr(), _strides3(o)
        if initial_state is not None:
            io.initial_state = initial_state.data_ptr()
        if final_state is not None:
            io.final_state = final_state.data_ptr()
        if cu_seqlens is not None:
            io.cu_seqlens = cu_seqlens.data_ptr()

        C = _C.chunk_size(io)
        extras = None
        aqk = akk = None
        if return_intermediates:
            slots = _C.chunk_slots(io)
            R = 1 if cu_seqlens is not None else B
            w = torch.empty((R, HV, slots, C, K), dtype=torch.float32, device=device)
            u = torch.empty((R, HV, slots, C, V), dtype=torch.float32, device=device)
            io.w, io.u = w.data_ptr(), u.data_ptr()
            extras = {"w": w, "u": u, "chunk_size": C}
            if debug_scores:
                aqk = torch.empty((R, HV, slots, C, C), dtype=torch.float32, device=device)
                akk = torch.empty((R, HV, slots, C, C), dtype=torch.float32, device=device)
                extras.update(aqk=aqk, akk=akk)
        workspace = torch.empty((max(_C.workspace_bytes(io), 1),), dtype=torch.uint8, device=device)
        io.workspace, io.workspace_bytes = workspace.data_ptr(), workspace.numel()
        stream = torch.cuda.current_stream(device).cuda_stream
        _C.run(io, stream, aqk.data_ptr() if aqk is not None else 0, akk.data_ptr() if akk is not None else 0,
               int(state_tile))
    if return_intermediates:
        return o, final_state, extras
    return o, final_state


def _prepare(q, k, g, beta, A_log, dt_bias, *, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation):
    if use_qk_l2norm_in_kernel:
        q, k = ref.l2norm(q), ref.l2norm(k)
    g = ref.log_decay(g, A_log, dt_bias, gate, lower_bound)
    return q, k, g.to(torch.float32), ref.activate_beta(beta.to(torch.float32), beta_activation)


def kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *, scale,
                output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, intracard_cp):
    """The backend kernel of `cula_core.kda_prefill` (sequences run whole: `intracard_cp` changes nothing)."""
    return chunk_kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale=scale,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     gate=gate, lower_bound=lower_bound, beta_activation=beta_activation)


def chunk_kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *, scale,
              output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation):
    """The backend kernel of `cula_core.chunk_kda` when no gradient is needed (the backend declines otherwise)."""
    with torch.no_grad():
        qp, kp, gp, bp = _prepare(q, k, g, beta, A_log, dt_bias, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  gate=gate, lower_bound=lower_bound, beta_activation=beta_activation)
        return prefill(qp, kp, v, gp, bp, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens)
