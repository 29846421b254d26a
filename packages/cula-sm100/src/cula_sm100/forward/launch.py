"""Thin launch code of the sm100 chunk_kda forward: chunk/sequence tables, buffers, the kernels' registration
with cula_core.cute_runtime.

`chunk_kda(...)` follows the kernel calling convention of docs/backends.md (validated, contiguous inputs).
A batch of B fixed-length rows is laid out exactly like a packed varlen batch of B sequences of T tokens
(`[B, T, H, D]` is `[1, B T, H, D]` in memory), so every kernel sees one layout: tokens `[T_total, H, D]`
and two small int32 tables,
  * chunks    `[NC, 2]`: first token and length (1..64) of every chunk, sequence-major (FLA's order);
  * sequences `[N, 3]`:  first token, end, and index of the sequence's first chunk.
They are built on the host (cula_core.cute_runtime's chunk_table / sequence_table, from `cu_seqlens_cpu` when
given; otherwise one device-to-host copy of `cu_seqlens`, as FLA's `prepare_chunk_indices`) and cached.

Kernels (registered here for every arch of cula_sm100.runtime.ARCHS) and their compile-time configurations; the
sizes (tokens, chunks, sequences, head counts) and the scale are runtime arguments, so one artifact serves every
B, T and head count:

    name (sm100.forward. + the kernel's module)   configuration
    l2norm                                        (dtype,)
    gate_cumsum                                   gate key: (gate, g, A_log, dt_bias dtypes, has A_log,
                                                  has dt_bias, lower_bound)
    chunk_intra, recompute_w_u, chunk_intra_wu    (beta dtype, beta activation)
    chunk_intra_wu_gate                           (*gate key, beta dtype, beta activation, qg_out)
    chunk_delta_h                                 (has initial state, outputs final state, cluster)
    fwd_o                                         (qg_in,)

`*_kernel(...)` gives a kernel's `(name, config)`; `launch_kernel` launches it through cula_sm100.runtime with
the pointer dtypes listed once here per kernel (`*_dtypes`, `*_DTYPES`: its compile-time pointers and the launch's
dtype check alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cula_core import cute_runtime as rt
from cula_sm100 import runtime

BT = 64
_BF, _F32, _I32 = torch.bfloat16, torch.float32, torch.int32


def launch_kernel(kernel: runtime.Kernel, dtypes: Sequence[torch.dtype], tensors, scalars) -> None:
    """Launch `kernel` ((name, config)) on the current stream: `tensors` as its pointers (dtypes `dtypes`; None:
    absent), `scalars` (int: Int32, float: Float32). See cula_sm100.runtime.launch."""
    runtime.launch(kernel, dtypes, tensors, scalars)


def aligned(*tensors):
    """The tensors, each copied if its data is not 16-byte aligned (None passes): every kernel here loads 16-byte
    vectors and its pointers are declared 16-byte aligned."""
    return tuple(rt.aligned16(t) for t in tensors)


# ------------------------------------------------------------------ kernels: pointer dtypes, configurations, builds


# pointer dtypes of each kernel, in its argument order (those that depend on the configuration are functions of it)

def l2norm_dtypes(dtype):  # x, y
    return (dtype, dtype)


def gate_dtypes(g_dtype, a_dtype, b_dtype):  # g, A_log, dt_bias, G, chunk table, q and qg (read only with qg_out)
    return (g_dtype, a_dtype, b_dtype, _F32, _I32, _BF, _BF)


def intra_dtypes(beta_dtype):  # q, k, G, beta, Aqk, Akk, chunk table
    return (_BF, _BF, _F32, beta_dtype, _BF, _BF, _I32)


def wu_dtypes(beta_dtype):  # k, v, G, beta, Akk, w, u, kg, chunk table
    return (_BF, _BF, _F32, beta_dtype, _BF, _BF, _BF, _BF, _I32)


def intra_wu_dtypes(beta_dtype):  # q, k, v, G, beta, Aqk, Akk, w, u, kg, chunk table
    return (_BF, _BF, _BF, _F32, beta_dtype, _BF, _BF, _BF, _BF, _BF, _I32)


def intra_wu_gate_dtypes(g_dtype, a_dtype, b_dtype, beta_dtype):
    # q, k, v, g, A_log, dt_bias, G (out), beta, Aqk, Akk, w, u, kg, chunk table, qg (out; read only with qg_out)
    return (_BF, _BF, _BF, g_dtype, a_dtype, b_dtype, _F32, beta_dtype, _BF, _BF, _BF, _BF, _BF, _I32, _BF)


DELTA_H_DTYPES = (_BF, _BF, _BF, _F32, _F32, _BF, _BF, _F32, _I32)  # w, u, kg, G, h0, h, v_new, ht, sequence table
# q (qg_in: qg), G (qg_in: not read), h, Aqk, v_new, o, chunk table
FWD_O_DTYPES = (_BF, _F32, _BF, _BF, _BF, _BF, _I32)

L2NORM, GATE, INTRA, WU = ("sm100.forward.l2norm", "sm100.forward.gate_cumsum", "sm100.forward.chunk_intra",
                           "sm100.forward.recompute_w_u")
INTRA_WU, INTRA_WU_GATE = "sm100.forward.chunk_intra_wu", "sm100.forward.chunk_intra_wu_gate"
DELTA_H, FWD_O = "sm100.forward.chunk_delta_h", "sm100.forward.fwd_o"


def l2norm_kernel(dtype: torch.dtype) -> runtime.Kernel:
    return L2NORM, (dtype,)


def gate_kernel(gate: str, g_dtype, a_dtype, b_dtype, has_A_log: bool, has_dt_bias: bool,
                lower_bound, qg_out: bool = False) -> runtime.Kernel:
    return GATE, (gate, g_dtype, a_dtype, b_dtype, bool(has_A_log), bool(has_dt_bias), lower_bound, bool(qg_out))


def intra_kernel(beta_dtype: torch.dtype, beta_activation: str) -> runtime.Kernel:
    return INTRA, (beta_dtype, beta_activation)


def wu_kernel(beta_dtype: torch.dtype, beta_activation: str) -> runtime.Kernel:
    return WU, (beta_dtype, beta_activation)


def intra_wu_kernel(beta_dtype: torch.dtype, beta_activation: str) -> runtime.Kernel:
    return INTRA_WU, (beta_dtype, beta_activation)


def intra_wu_gate_kernel(gate: str, g_dtype, a_dtype, b_dtype, has_A_log: bool, has_dt_bias: bool, lower_bound,
                         beta_dtype: torch.dtype, beta_activation: str, qg_out: bool = False) -> runtime.Kernel:
    return INTRA_WU_GATE, (gate, g_dtype, a_dtype, b_dtype, bool(has_A_log), bool(has_dt_bias), lower_bound,
                           beta_dtype, beta_activation, bool(qg_out))


def delta_h_kernel(has_initial_state: bool, output_final_state: bool, cluster: bool = True,
                   stages: int = 1) -> runtime.Kernel:
    return DELTA_H, (bool(has_initial_state), bool(output_final_state), bool(cluster), int(stages))


def fwd_o_kernel(qg_in: bool = False) -> runtime.Kernel:
    return FWD_O, (bool(qg_in),)


def _build_l2norm(config):
    from cula_sm100.forward.l2norm import L2Norm

    (dtype,) = config
    return L2Norm(), runtime.fake_args(l2norm_dtypes(dtype), 1)


def _build_gate(config):
    from cula_sm100.forward.gate_cumsum import GateCumsum

    gate, g_dtype, a_dtype, b_dtype, has_A_log, has_dt_bias, lower_bound, qg_out = config
    return (GateCumsum(gate, has_A_log, has_dt_bias, lower_bound, qg_out),
            runtime.fake_args(gate_dtypes(g_dtype, a_dtype, b_dtype), 1, 1, 1, 1, 1.0))


def _build_intra(config):
    from cula_sm100.forward.chunk_intra import ChunkIntra

    beta_dtype, beta_activation = config
    return ChunkIntra(beta_activation), runtime.fake_args(intra_dtypes(beta_dtype), 1, 1, 1, 1, 1.0)


def _build_wu(config):
    from cula_sm100.forward.recompute_w_u import RecomputeWU

    beta_dtype, beta_activation = config
    return RecomputeWU(beta_activation), runtime.fake_args(wu_dtypes(beta_dtype), 1, 1, 1, 1)


def _build_intra_wu(config):
    from cula_sm100.forward.chunk_intra_wu import ChunkIntraWU

    beta_dtype, beta_activation = config
    return ChunkIntraWU(beta_activation), runtime.fake_args(intra_wu_dtypes(beta_dtype), 1, 1, 1, 1, 1.0)


def _build_intra_wu_gate(config):
    from cula_sm100.forward.chunk_intra_wu_gate import ChunkIntraWUGate

    gate, g_dtype, a_dtype, b_dtype, has_A_log, has_dt_bias, lower_bound, beta_dtype, beta_activation, qg_out = config
    return (ChunkIntraWUGate(beta_activation, gate, has_A_log, has_dt_bias, lower_bound, qg_out),
            runtime.fake_args(intra_wu_gate_dtypes(g_dtype, a_dtype, b_dtype, beta_dtype), 1, 1, 1, 1, 1.0))


def _build_delta_h(config):
    from cula_sm100.forward.chunk_delta_h import ChunkDeltaH

    return ChunkDeltaH(*config), runtime.fake_args(DELTA_H_DTYPES, 1, 1, 1, 1)


def _build_fwd_o(config):
    from cula_sm100.forward.fwd_o import FwdO

    (qg_in,) = config
    return FwdO(qg_in), runtime.fake_args(FWD_O_DTYPES, 1, 1, 1, 1, 1.0)


# the helper modules of every sm100 kernel (forward and backward), with the L2-norm epsilon they read from core
SHARED_SOURCES = ("cula_core.cute_kernels.copies", "cula_core.cute_kernels.warp_mma", "cula_sm100.forward.cute_utils",
                  "cula_core.reference.gates")


def _sources(*modules: str) -> tuple[str, ...]:
    """A forward kernel's source modules: its own (and the kernels it builds on), the shared helpers and this module
    (its build)."""
    return (*(f"cula_sm100.forward.{m}" for m in modules), *SHARED_SOURCES, "cula_sm100.forward.launch")


for _name, _build, _modules in (
        (L2NORM, _build_l2norm, ("l2norm",)),
        (GATE, _build_gate, ("gate_cumsum",)),
        (INTRA, _build_intra, ("chunk_intra",)),
        (WU, _build_wu, ("recompute_w_u",)),
        (INTRA_WU, _build_intra_wu, ("chunk_intra_wu", "chunk_intra")),
        (INTRA_WU_GATE, _build_intra_wu_gate, ("chunk_intra_wu_gate", "chunk_intra_wu", "chunk_intra", "gate_cumsum")),
        (DELTA_H, _build_delta_h, ("chunk_delta_h",)),
        (FWD_O, _build_fwd_o, ("fwd_o",))):
    runtime.register(_name, _build, _sources(*_modules))


# ------------------------------------------------------------------ tables


def host_tables(bounds: tuple[int, ...]):
    """(chunk table [NC, 2] of (first token, length), sequence table [N, 3] of (start, end, first chunk)), int32 on
    the host, for the sequences between consecutive `bounds` (sequence_bounds); chunks of BT tokens, a sequence's
    last one shorter, an empty sequence owning none."""
    chunks = torch.tensor(rt.chunk_table(bounds, BT), dtype=torch.int32).reshape(-1, 2)
    seqs = torch.tensor(rt.sequence_table(bounds, BT), dtype=torch.int32).reshape(-1, 3)
    return chunks, seqs


_device_tables: dict = {}


def sequence_bounds(B: int, T: int, cu_seqlens, cu_seqlens_cpu) -> tuple[int, ...]:
    """The N + 1 token offsets of a call's sequences: B rows of T tokens, or cu_seqlens (read from cu_seqlens_cpu
    when given; otherwise one device-to-host copy, as FLA's prepare_chunk_indices)."""
    bounds = rt.sequence_bounds(B, T, cu_seqlens, cu_seqlens_cpu)
    if bounds is None:
        bounds = rt.sequence_bounds(B, T, cu_seqlens, cu_seqlens.cpu())
    return bounds


def tables(B: int, T: int, cu_seqlens, cu_seqlens_cpu, device):
    """(chunk table [NC, 2], sequence table [N, 3]) on the device, int32."""
    bounds = sequence_bounds(B, T, cu_seqlens, cu_seqlens_cpu)
    key = (bounds, device)
    hit = _device_tables.get(key)
    if hit is None:
        c, s = host_tables(bounds)
        hit = (c.to(device), s.to(device))
        if len(_device_tables) > 64:
            _device_tables.clear()
        _device_tables[key] = hit
    return hit


# ------------------------------------------------------------------ the forward


@dataclass
class Intermediates:
    """What the forward computed, in FLA's layouts over the packed tokens (tests compare these). Through the qg path
    (forward(intermediates=False)) G is never written in full: g_cumsum is None and qg is set."""
    q: torch.Tensor        # [TT, HQK, K] bf16 (L2-normalised if asked)
    k: torch.Tensor
    g_cumsum: torch.Tensor | None  # [TT, HV, K] fp32, natural log; None through the qg path
    Aqk: torch.Tensor      # [TT, HV, 64] bf16
    Akk: torch.Tensor      # [TT, HV, 64] bf16
    w: torch.Tensor        # [TT, HV, K] bf16
    u: torch.Tensor        # [TT, HV, V] bf16
    kg: torch.Tensor       # [TT, HV, K] bf16
    h: torch.Tensor        # [NC, HV, K, V] bf16
    v_new: torch.Tensor    # [TT, HV, V] bf16
    qg: torch.Tensor | None = None  # [TT, HV, K] bf16, bf16(q e^G) (fwd_o's first operand): the qg path only


def _empty(*shape, like, dtype=torch.bfloat16):
    return torch.empty(*shape, device=like.device, dtype=dtype)


def l2norm(x):
    """[.., K] bf16 rows L2-normalised (kernel: l2norm.py)."""
    y = torch.empty_like(x)
    rows = x.numel() // x.shape[-1]
    if rows:
        launch_kernel(l2norm_kernel(x.dtype), l2norm_dtypes(x.dtype), (x, y), (rows,))
    return y


def _gate_key(g, A_log, dt_bias, gate, lower_bound):
    """The gate's compile key: (gate, g dtype, A_log dtype, dt_bias dtype, has A_log, has dt_bias, lower_bound)."""
    a_dtype = A_log.dtype if A_log is not None else _F32
    b_dtype = dt_bias.dtype if dt_bias is not None else _F32
    return (gate, g.dtype, a_dtype, b_dtype, A_log is not None, dt_bias is not None,
            lower_bound if gate == "safe" else None)


def gate_cumsum(g, A_log, dt_bias, ctab, *, gate, lower_bound):
    """G [TT, HV, K] fp32: gate of raw g (or g itself) and its chunk-local cumsum (kernel: gate_cumsum.py)."""
    return _gate_pass(g, A_log, dt_bias, None, ctab, gate, lower_bound, 1.0)[0]


def gate_cumsum_qg(g, A_log, dt_bias, q, ctab, *, gate, lower_bound, scale):
    """(G [TT, HV, K] fp32, qg [TT, HV, K] bf16 = bf16(q exp(G) scale), q read at head hv // (HV // HQK)):
    gate_cumsum and the backward's chunk_bwd_dhu operand in one pass (kernel: gate_cumsum.py with qg_out).
    q [.., HQK, K] bf16 (L2-normalised where the forward normalises)."""
    return _gate_pass(g, A_log, dt_bias, q, ctab, gate, lower_bound, scale)


def _gate_pass(g, A_log, dt_bias, q, ctab, gate, lower_bound, scale):
    """gate_cumsum.py's launch: (G, qg), qg written (and q read) only when q is given, else None."""
    HV, K = g.shape[-2:]
    TT = g.numel() // (HV * K)
    G = _empty(TT, HV, K, like=g, dtype=torch.float32)
    qg = _empty(TT, HV, K, like=q) if q is not None else None
    if ctab.shape[0]:
        key = _gate_key(g, A_log, dt_bias, gate, lower_bound)
        HQK = q.shape[-2] if q is not None else 1
        launch_kernel(gate_kernel(*key, qg_out=q is not None), gate_dtypes(*key[1:4]),
                      (g, A_log, dt_bias, G, ctab, q, qg), (TT, ctab.shape[0], HQK, HV, float(scale)))
    return G, qg


def chunk_intra(q, k, G, beta, ctab, *, scale, beta_activation):
    """(Aqk, Akk) [TT, HV, 64] bf16 (kernel: chunk_intra.py). q, k [.., T, HQK, K] bf16; G [TT, HV, K] fp32."""
    TT, HV, _ = G.shape
    HQK = q.shape[-2]
    Aqk, Akk = _empty(TT, HV, BT, like=G), _empty(TT, HV, BT, like=G)
    if ctab.shape[0]:
        launch_kernel(intra_kernel(beta.dtype, beta_activation), intra_dtypes(beta.dtype),
                      (q, k, G, beta, Aqk, Akk, ctab), (TT, ctab.shape[0], HQK, HV, float(scale)))
    return Aqk, Akk


def recompute_w_u(k, v, G, beta, Akk, ctab, *, beta_activation):
    """(w, u, kg) [TT, HV, 128] bf16 (kernel: recompute_w_u.py)."""
    TT, HV, K = G.shape
    HQK, V = k.shape[-2], v.shape[-1]
    w, u, kg = _empty(TT, HV, K, like=G), _empty(TT, HV, V, like=G), _empty(TT, HV, K, like=G)
    if ctab.shape[0]:
        launch_kernel(wu_kernel(beta.dtype, beta_activation), wu_dtypes(beta.dtype),
                      (k, v, G, beta, Akk, w, u, kg, ctab), (TT, ctab.shape[0], HQK, HV))
    return w, u, kg


def chunk_intra_wu(q, k, v, G, beta, ctab, *, scale, beta_activation):
    """(Aqk, Akk [TT, HV, 64], w, u, kg [TT, HV, 128]) bf16 (kernel: chunk_intra_wu.py): chunk_intra then
    recompute_w_u in one kernel, bitwise the same outputs (the backward's recompute).
    q, k [.., HQK, K] bf16; v [.., HV, V] bf16; G [TT, HV, K] fp32; beta [.., HV]."""
    TT, HV, K = G.shape
    HQK, V = q.shape[-2], v.shape[-1]
    Aqk, Akk = _empty(TT, HV, BT, like=G), _empty(TT, HV, BT, like=G)
    w, u, kg = _empty(TT, HV, K, like=G), _empty(TT, HV, V, like=G), _empty(TT, HV, K, like=G)
    if ctab.shape[0]:
        launch_kernel(intra_wu_kernel(beta.dtype, beta_activation), intra_wu_dtypes(beta.dtype),
                      (q, k, v, G, beta, Aqk, Akk, w, u, kg, ctab), (TT, ctab.shape[0], HQK, HV, float(scale)))
    return Aqk, Akk, w, u, kg


def chunk_intra_wu_gate(q, k, v, g, A_log, dt_bias, beta, ctab, *, gate, lower_bound, scale, beta_activation,
                        qg_out=False):
    """(G [TT, HV, K] fp32, Aqk, Akk [TT, HV, 64], w, u, kg [TT, HV, 128] bf16) (kernel: chunk_intra_wu_gate.py):
    gate_cumsum then chunk_intra_wu in one kernel, bitwise the same outputs, G written once and never read back.
    g [TT, HV, K] raw gate (any float dtype); A_log [HV], dt_bias [HV K] or None; the rest as chunk_intra_wu.
    `qg_out`: (G, qg, Aqk, Akk, w, u, kg) with qg [TT, HV, K] bf16 = bf16(q e^G) (fwd_o's, bitwise) and G written
    ONLY at each chunk's last row (all chunk_delta_h reads; the other rows of the buffer are left unwritten)."""
    HV, K = g.shape[-2:]
    TT = g.numel() // (HV * K)
    HQK, V = q.shape[-2], v.shape[-1]
    G = _empty(TT, HV, K, like=g, dtype=torch.float32)
    qg = _empty(TT, HV, K, like=g) if qg_out else None
    Aqk, Akk = _empty(TT, HV, BT, like=g), _empty(TT, HV, BT, like=g)
    w, u, kg = _empty(TT, HV, K, like=g), _empty(TT, HV, V, like=g), _empty(TT, HV, K, like=g)
    if ctab.shape[0]:
        key = _gate_key(g, A_log, dt_bias, gate, lower_bound)
        launch_kernel(intra_wu_gate_kernel(*key, beta.dtype, beta_activation, qg_out),
                      intra_wu_gate_dtypes(*key[1:4], beta.dtype),
                      (q, k, v, g, A_log, dt_bias, G, beta, Aqk, Akk, w, u, kg, ctab, qg),
                      (TT, ctab.shape[0], HQK, HV, float(scale)))
    if qg_out:
        return G, qg, Aqk, Akk, w, u, kg
    return G, Aqk, Akk, w, u, kg


# chunk_delta_h runs N HV 4 CTAs (a sequence's value head in 4 V slices): launched as clusters of the 4 slices from
# this many (sequence, value head) pairs on, as independent CTAs below (the measured crossover:
# docs/benchmarks/train_fwd.md, `python -m tools.bench.train_fwd --delta-h-sweep`)
DELTA_H_CLUSTER_MIN_PAIRS = 256

# columns of V per chunk_delta_h CTA (ChunkDeltaH.BV; a CPU test keeps the two equal): the grid is N x HV x V / BV
DELTA_H_BV = 32


def chunk_delta_h_cluster(N: int, HV: int) -> bool:
    """Whether chunk_delta_h launches as clusters of 4 V slices for N sequences of HV value heads."""
    return N * HV >= DELTA_H_CLUSTER_MIN_PAIRS


def walk_stages(ctas: int, num_sms: int) -> int:
    """Pipeline stages of a serial chunk walk (chunk_delta_h's w / kg buffers, the backward's chunk_bwd_dhu tiles)
    for a grid of `ctas` CTAs: 2 (each chunk's tiles issued a chunk ahead) when the grid fits the SMs, one CTA each
    with its load latency exposed; 1 (several CTAs per SM hiding each other's latency) above."""
    return 2 if ctas <= num_sms else 1


def chunk_delta_h(w, u, kg, G, initial_state, ctab, stab, *, output_final_state, cluster=None, stages=None):
    """(h [NC, HV, K, V] bf16, v_new [TT, HV, V] bf16, final state [N, HV, K, V] fp32 or None)
    (kernel: chunk_delta_h.py). `cluster`: None picks by chunk_delta_h_cluster (the benchmark forces one);
    `stages` (w / kg buffers, plain CTAs only): None picks by walk_stages."""
    TT, HV, K = G.shape
    V = u.shape[-1]
    NC, N = ctab.shape[0], stab.shape[0]
    if cluster is None:
        cluster = chunk_delta_h_cluster(N, HV)
    if stages is None:
        stages = 1 if cluster or not N else walk_stages(N * HV * (V // DELTA_H_BV), rt.sm_count(G.device.index or 0))
    h = _empty(NC, HV, K, V, like=G)
    v_new = _empty(TT, HV, V, like=G)
    ht = _empty(N, HV, K, V, like=G, dtype=torch.float32) if output_final_state else None
    if N:
        h0 = initial_state.contiguous() if initial_state is not None else None
        launch_kernel(delta_h_kernel(h0 is not None, output_final_state, cluster, stages), DELTA_H_DTYPES,
                      (w, u, kg, G, h0, h, v_new, ht, stab), (TT, NC, N, HV))
    return h, v_new, ht


def fwd_o(q, G, h, Aqk, v_new, ctab, *, scale):
    """o [TT, HV, V] bf16 (kernel: fwd_o.py)."""
    return _fwd_o(False, q, G, h, Aqk, v_new, ctab, G, q.shape[-2], scale)


def fwd_o_qg(qg, h, Aqk, v_new, ctab, *, scale):
    """o [TT, HV, V] bf16 from qg [TT, HV, K] bf16 = bf16(q e^G) (chunk_intra_wu_gate's qg_out; kernel: fwd_o.py
    with qg_in): bitwise fwd_o's o on the q and G that made qg."""
    return _fwd_o(True, qg, None, h, Aqk, v_new, ctab, qg, qg.shape[-2], scale)


def _fwd_o(qg_in, q, G, h, Aqk, v_new, ctab, like, HQK, scale):
    """fwd_o's launch; `like` ([TT, HV, K]: G, or qg) gives the sizes and the device."""
    TT, HV, _ = like.shape
    V = v_new.shape[-1]
    o = _empty(TT, HV, V, like=like)
    if ctab.shape[0]:
        launch_kernel(fwd_o_kernel(qg_in), FWD_O_DTYPES, (q, G, h, Aqk, v_new, o, ctab),
                      (TT, ctab.shape[0], HQK, HV, float(scale)))
    return o


def forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *, scale,
            output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, intermediates=True):
    """The chunk_kda forward; returns (o [B, T, HV, V], final_state [N, HV, K, V] or None, Intermediates).

    Stages: l2norm (if asked), chunk_intra_wu_gate, chunk_delta_h, fwd_o. `intermediates=True`: every intermediate
    is written (G in full; fwd_o forms qg = q e^G itself). `intermediates=False` (chunk_kda's call: the caller needs
    o, the final state and Aqk / Akk only): the qg path, where chunk_intra_wu_gate writes qg = bf16(q e^G) and G
    only at each chunk's last row (all chunk_delta_h reads) and fwd_o reads qg; Intermediates.g_cumsum is None and
    .qg set; o and the final state are bitwise those of intermediates=True."""
    B, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    ctab, stab = tables(B, T, cu_seqlens, cu_seqlens_cpu, q.device)
    A_log = A_log.contiguous() if A_log is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    q, k, v, g, beta, A_log, dt_bias, initial_state = aligned(q, k, v, g, beta, A_log, dt_bias, initial_state)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    g = g.reshape(B * T, HV, K)
    qg_path = not intermediates
    qg = None
    if qg_path:
        G, qg, Aqk, Akk, w, u, kg = chunk_intra_wu_gate(q, k, v, g, A_log, dt_bias, beta, ctab, gate=gate,
                                                        lower_bound=lower_bound, scale=scale,
                                                        beta_activation=beta_activation, qg_out=True)
    else:
        G, Aqk, Akk, w, u, kg = chunk_intra_wu_gate(q, k, v, g, A_log, dt_bias, beta, ctab, gate=gate,
                                                    lower_bound=lower_bound, scale=scale,
                                                    beta_activation=beta_activation)
    # through the qg path G holds only each chunk's last row: all chunk_delta_h reads (ChunkDeltaH.last_g)
    h, v_new, ht = chunk_delta_h(w, u, kg, G, initial_state, ctab, stab, output_final_state=output_final_state)
    if qg_path:
        o = fwd_o_qg(qg, h, Aqk, v_new, ctab, scale=scale)
    else:
        o = fwd_o(q, G, h, Aqk, v_new, ctab, scale=scale)
    inter = Intermediates(q=q.reshape(B * T, HQK, K), k=k.reshape(B * T, HQK, K), g_cumsum=None if qg_path else G,
                          Aqk=Aqk, Akk=Akk, w=w, u=u, kg=kg, h=h, v_new=v_new, qg=qg)
    return o.reshape(B, T, HV, V), ht, inter


def chunk_kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *, scale,
              output_final_state, use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation,
              save_residuals=False):
    """The backend's kernel for `chunk_kda` (calling convention: docs/backends.md); with `save_residuals`
    also core's residuals (Aqk, Akk), each [B, T, HV, 64] bf16, for cula_sm100.backward (which recomputes G
    itself: the forward's G is not needed, so the forward runs without intermediates: the qg path)."""
    o, ht, it = forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale=scale,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                        gate=gate, lower_bound=lower_bound, beta_activation=beta_activation, intermediates=False)
    if not save_residuals:
        return o, ht
    B, T = q.shape[:2]
    return o, ht, (it.Aqk.view(B, T, *it.Aqk.shape[1:]), it.Akk.view(B, T, *it.Akk.shape[1:]))
