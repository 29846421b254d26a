"""Thin launch code of the sm100 chunk_kda forward: chunk/sequence tables, buffers, the compiled-kernel cache.

`chunk_kda(...)` follows the kernel calling convention of docs/backends.md (validated, contiguous inputs).
A batch of B fixed-length rows is laid out exactly like a packed varlen batch of B sequences of T tokens
(`[B, T, H, D]` is `[1, B T, H, D]` in memory), so every kernel sees one layout: tokens `[T_total, H, D]`
and two small int32 tables,
  * chunks    `[NC, 2]`: first token and length (1..64) of every chunk, sequence-major (FLA's order);
  * sequences `[N, 3]`:  first token, end, and index of the sequence's first chunk.
They are built on the host (from `cu_seqlens_cpu` when given; otherwise one device-to-host copy of
`cu_seqlens`, as FLA's `prepare_chunk_indices`) and cached. Kernels are compiled once per key (gate mode,
beta activation, dtypes, state flags) for dynamic sizes, so one compilation serves every B, T and head count.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

BT = 64

_TORCH_TO_CUTLASS = {}


def _cutlass_dtype(dtype: torch.dtype):
    import cutlass

    if not _TORCH_TO_CUTLASS:
        _TORCH_TO_CUTLASS.update({torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
                                  torch.float32: cutlass.Float32, torch.int32: cutlass.Int32})
    return _TORCH_TO_CUTLASS[dtype]


def _ptr(t: torch.Tensor | None, dtype: torch.dtype | None = None):
    """A CuTe global pointer to t's data (a dummy, never dereferenced, for an absent optional tensor)."""
    from cutlass.base_dsl.enums import AddressSpace
    from cutlass.cute.runtime import make_ptr

    if t is None:
        return make_ptr(_cutlass_dtype(dtype), 16, AddressSpace.gmem, assumed_align=16)
    return make_ptr(_cutlass_dtype(t.dtype), t.data_ptr(), AddressSpace.gmem, assumed_align=16)


def aligned(*tensors):
    """The tensors, each copied if its data is not 16-byte aligned (None passes): every kernel here loads 16-byte
    vectors and its pointers are declared 16-byte aligned. Tensors that own their storage always are; a view at an
    odd offset into a larger buffer may not be."""
    return tuple(t if t is None or t.data_ptr() % 16 == 0 else t.clone() for t in tensors)


def _fake_ptr(dtype: torch.dtype):
    return _ptr(None, dtype)


def _stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def _compile_stream():
    """The stream argument at compile time: only its type matters (compiles on a machine with no GPU)."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(0)


# ------------------------------------------------------------------ compiled kernels, one per key


@functools.cache
def l2norm_kernel(dtype: torch.dtype):
    import cutlass.cute as cute

    from cula_sm100.forward.l2norm import L2Norm

    return cute.compile(L2Norm(), _fake_ptr(dtype), _fake_ptr(dtype), 1, _compile_stream())


@functools.cache
def gate_kernel(gate: str, g_dtype, a_dtype, b_dtype, has_A_log: bool, has_dt_bias: bool, lower_bound):
    import cutlass.cute as cute

    from cula_sm100.forward.gate_cumsum import GateCumsum

    return cute.compile(GateCumsum(gate, has_A_log, has_dt_bias, lower_bound), _fake_ptr(g_dtype),
                        _fake_ptr(a_dtype), _fake_ptr(b_dtype), _fake_ptr(torch.float32), _fake_ptr(torch.int32),
                        1, 1, 1, _compile_stream())


@functools.cache
def intra_kernel(beta_dtype: torch.dtype, beta_activation: str):
    import cutlass.cute as cute

    from cula_sm100.forward.chunk_intra import ChunkIntra

    bf = torch.bfloat16
    return cute.compile(ChunkIntra(beta_activation), _fake_ptr(bf), _fake_ptr(bf), _fake_ptr(torch.float32),
                        _fake_ptr(beta_dtype), _fake_ptr(bf), _fake_ptr(bf), _fake_ptr(torch.int32),
                        1, 1, 1, 1, 1.0, _compile_stream())


@functools.cache
def wu_kernel(beta_dtype: torch.dtype, beta_activation: str):
    import cutlass.cute as cute

    from cula_sm100.forward.recompute_w_u import RecomputeWU

    bf = torch.bfloat16
    return cute.compile(RecomputeWU(beta_activation), _fake_ptr(bf), _fake_ptr(bf), _fake_ptr(torch.float32),
                        _fake_ptr(beta_dtype), _fake_ptr(bf), _fake_ptr(bf), _fake_ptr(bf), _fake_ptr(bf),
                        _fake_ptr(torch.int32), 1, 1, 1, 1, _compile_stream())


@functools.cache
def delta_h_kernel(has_initial_state: bool, output_final_state: bool, cluster: bool = True):
    import cutlass.cute as cute

    from cula_sm100.forward.chunk_delta_h import ChunkDeltaH

    bf, f32 = torch.bfloat16, torch.float32
    return cute.compile(ChunkDeltaH(has_initial_state, output_final_state, cluster), _fake_ptr(bf), _fake_ptr(bf),
                        _fake_ptr(bf), _fake_ptr(f32), _fake_ptr(f32), _fake_ptr(bf), _fake_ptr(bf), _fake_ptr(f32),
                        _fake_ptr(torch.int32), 1, 1, 1, 1, _compile_stream())


@functools.cache
def fwd_o_kernel():
    import cutlass.cute as cute

    from cula_sm100.forward.fwd_o import FwdO

    bf = torch.bfloat16
    return cute.compile(FwdO(), _fake_ptr(bf), _fake_ptr(torch.float32), _fake_ptr(bf), _fake_ptr(bf),
                        _fake_ptr(bf), _fake_ptr(bf), _fake_ptr(torch.int32), 1, 1, 1, 1, 1.0, _compile_stream())


# ------------------------------------------------------------------ tables


@functools.lru_cache(maxsize=64)
def _tables_host(bounds: tuple[int, ...]):
    chunks, seqs = [], []
    for b0, b1 in itertools.pairwise(bounds):
        seqs.append((b0, b1, len(chunks)))
        chunks.extend((t, min(BT, b1 - t)) for t in range(b0, b1, BT))
    c = torch.tensor(chunks, dtype=torch.int32).reshape(-1, 2)
    s = torch.tensor(seqs, dtype=torch.int32).reshape(-1, 3)
    return c, s


_device_tables: dict = {}


def tables(B: int, T: int, cu_seqlens, cu_seqlens_cpu, device):
    """(chunk table [NC, 2], sequence table [N, 3]) on the device, int32."""
    if cu_seqlens is None:
        bounds = tuple(b * T for b in range(B + 1))
    else:
        src = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
        bounds = tuple(int(x) for x in src.tolist())
    key = (bounds, device)
    hit = _device_tables.get(key)
    if hit is None:
        c, s = _tables_host(bounds)
        hit = (c.to(device), s.to(device))
        if len(_device_tables) > 64:
            _device_tables.clear()
        _device_tables[key] = hit
    return hit


# ------------------------------------------------------------------ the forward


@dataclass
class Intermediates:
    """What the forward computed, in FLA's layouts over the packed tokens (tests compare these)."""
    q: torch.Tensor        # [TT, HQK, K] bf16 (L2-normalised if asked)
    k: torch.Tensor
    g_cumsum: torch.Tensor  # [TT, HV, K] fp32, natural log
    Aqk: torch.Tensor      # [TT, HV, 64] bf16
    Akk: torch.Tensor      # [TT, HV, 64] bf16
    w: torch.Tensor        # [TT, HV, K] bf16
    u: torch.Tensor        # [TT, HV, V] bf16
    kg: torch.Tensor       # [TT, HV, K] bf16
    h: torch.Tensor        # [NC, HV, K, V] bf16
    v_new: torch.Tensor    # [TT, HV, V] bf16


def _empty(*shape, like, dtype=torch.bfloat16):
    return torch.empty(*shape, device=like.device, dtype=dtype)


def l2norm(x):
    """[.., K] bf16 rows L2-normalised (kernel: l2norm.py)."""
    y = torch.empty_like(x)
    rows = x.numel() // x.shape[-1]
    if rows:
        l2norm_kernel(x.dtype)(_ptr(x), _ptr(y), rows, _stream())
    return y


def gate_cumsum(g, A_log, dt_bias, ctab, *, gate, lower_bound):
    """G [TT, HV, K] fp32: gate of raw g (or g itself) and its chunk-local cumsum (kernel: gate_cumsum.py)."""
    HV, K = g.shape[-2:]
    TT = g.numel() // (HV * K)
    G = _empty(TT, HV, K, like=g, dtype=torch.float32)
    if ctab.shape[0]:
        f32 = torch.float32
        kern = gate_kernel(gate, g.dtype, A_log.dtype if A_log is not None else f32,
                           dt_bias.dtype if dt_bias is not None else f32, A_log is not None, dt_bias is not None,
                           lower_bound if gate == "safe" else None)
        kern(_ptr(g), _ptr(A_log, f32), _ptr(dt_bias, f32), _ptr(G), _ptr(ctab), TT, ctab.shape[0], HV, _stream())
    return G


def chunk_intra(q, k, G, beta, ctab, *, scale, beta_activation):
    """(Aqk, Akk) [TT, HV, 64] bf16 (kernel: chunk_intra.py). q, k [.., T, HQK, K] bf16; G [TT, HV, K] fp32."""
    TT, HV, _ = G.shape
    HQK = q.shape[-2]
    Aqk, Akk = _empty(TT, HV, BT, like=G), _empty(TT, HV, BT, like=G)
    if ctab.shape[0]:
        intra_kernel(beta.dtype, beta_activation)(_ptr(q), _ptr(k), _ptr(G), _ptr(beta), _ptr(Aqk), _ptr(Akk),
                                                  _ptr(ctab), TT, ctab.shape[0], HQK, HV, float(scale), _stream())
    return Aqk, Akk


def recompute_w_u(k, v, G, beta, Akk, ctab, *, beta_activation):
    """(w, u, kg) [TT, HV, 128] bf16 (kernel: recompute_w_u.py)."""
    TT, HV, K = G.shape
    HQK, V = k.shape[-2], v.shape[-1]
    w, u, kg = _empty(TT, HV, K, like=G), _empty(TT, HV, V, like=G), _empty(TT, HV, K, like=G)
    if ctab.shape[0]:
        wu_kernel(beta.dtype, beta_activation)(_ptr(k), _ptr(v), _ptr(G), _ptr(beta), _ptr(Akk), _ptr(w), _ptr(u),
                                               _ptr(kg), _ptr(ctab), TT, ctab.shape[0], HQK, HV, _stream())
    return w, u, kg


# chunk_delta_h runs N HV 4 CTAs (a sequence's value head in 4 V slices): launched as clusters of the 4 slices from
# this many (sequence, value head) pairs on, as independent CTAs below. Measured on the H100 at T = 8192 (session 5,
# `python -m tools.bench.train_fwd --delta-h-sweep`): at 64 / 128 pairs clusters took 1.20x / 1.26x the time of
# plain CTAs (0.423 vs 0.353 ms, 0.760 vs 0.605 ms); at 256 pairs 0.93x (1.324 vs 1.429 ms), at 512 pairs 0.76x /
# 0.82x (B 4 HV 128, B 2 HV 256). The threshold lies between 128 and 256 pairs.
DELTA_H_CLUSTER_MIN_PAIRS = 256


def chunk_delta_h_cluster(N: int, HV: int) -> bool:
    """Whether chunk_delta_h launches as clusters of 4 V slices for N sequences of HV value heads."""
    return N * HV >= DELTA_H_CLUSTER_MIN_PAIRS


def chunk_delta_h(w, u, kg, G, initial_state, ctab, stab, *, output_final_state, cluster=None):
    """(h [NC, HV, K, V] bf16, v_new [TT, HV, V] bf16, final state [N, HV, K, V] fp32 or None)
    (kernel: chunk_delta_h.py). `cluster`: None picks by chunk_delta_h_cluster (the benchmark forces one)."""
    TT, HV, K = G.shape
    V = u.shape[-1]
    NC, N = ctab.shape[0], stab.shape[0]
    if cluster is None:
        cluster = chunk_delta_h_cluster(N, HV)
    h = _empty(NC, HV, K, V, like=G)
    v_new = _empty(TT, HV, V, like=G)
    ht = _empty(N, HV, K, V, like=G, dtype=torch.float32) if output_final_state else None
    if N:
        h0 = initial_state.contiguous() if initial_state is not None else None
        delta_h_kernel(h0 is not None, output_final_state, cluster)(
            _ptr(w), _ptr(u), _ptr(kg), _ptr(G), _ptr(h0, torch.float32), _ptr(h), _ptr(v_new),
            _ptr(ht, torch.float32), _ptr(stab), TT, NC, N, HV, _stream())
    return h, v_new, ht


def fwd_o(q, G, h, Aqk, v_new, ctab, *, scale):
    """o [TT, HV, V] bf16 (kernel: fwd_o.py)."""
    TT, HV, _ = G.shape
    HQK, V = q.shape[-2], v_new.shape[-1]
    o = _empty(TT, HV, V, like=G)
    if ctab.shape[0]:
        fwd_o_kernel()(_ptr(q), _ptr(G), _ptr(h), _ptr(Aqk), _ptr(v_new), _ptr(o), _ptr(ctab), TT, ctab.shape[0],
                       HQK, HV, float(scale), _stream())
    return o


def forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *, scale,
            output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation):
    """The chunk_kda forward; returns (o [B, T, HV, V], final_state [N, HV, K, V] or None, Intermediates)."""
    B, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    ctab, stab = tables(B, T, cu_seqlens, cu_seqlens_cpu, q.device)
    A_log = A_log.contiguous() if A_log is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    q, k, v, g, beta, A_log, dt_bias, initial_state = aligned(q, k, v, g, beta, A_log, dt_bias, initial_state)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    G = gate_cumsum(g.reshape(B * T, HV, K), A_log, dt_bias, ctab, gate=gate, lower_bound=lower_bound)
    Aqk, Akk = chunk_intra(q, k, G, beta, ctab, scale=scale, beta_activation=beta_activation)
    w, u, kg = recompute_w_u(k, v, G, beta, Akk, ctab, beta_activation=beta_activation)
    h, v_new, ht = chunk_delta_h(w, u, kg, G, initial_state, ctab, stab, output_final_state=output_final_state)
    o = fwd_o(q, G, h, Aqk, v_new, ctab, scale=scale)
    inter = Intermediates(q=q.reshape(B * T, HQK, K), k=k.reshape(B * T, HQK, K), g_cumsum=G, Aqk=Aqk, Akk=Akk,
                          w=w, u=u, kg=kg, h=h, v_new=v_new)
    return o.reshape(B, T, HV, V), ht, inter


def chunk_kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *, scale,
              output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation,
              save_residuals=False):
    """The backend's kernel for `chunk_kda` (calling convention: docs/backends.md); with `save_residuals`
    also core's residuals (Aqk, Akk), each [B, T, HV, 64] bf16, for cula_sm100.backward."""
    o, ht, it = forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale=scale,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                        gate=gate, lower_bound=lower_bound, beta_activation=beta_activation)
    if not save_residuals:
        return o, ht
    B, T = q.shape[:2]
    return o, ht, (it.Aqk.view(B, T, *it.Aqk.shape[1:]), it.Akk.view(B, T, *it.Akk.shape[1:]))
