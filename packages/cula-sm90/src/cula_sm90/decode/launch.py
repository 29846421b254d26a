"""Thin launch code of the decode kernels: the calling convention of docs/backends.md on one side, the CuTe DSL
kernels on the other, through cula_core.cute_runtime (shipped ahead-of-time artifacts, else the JIT disk cache;
launched through the DSL's TVM-FFI ABI with integer addresses and the raw stream handle).

Kernels (registered here) and their compile-time configurations; N, pool size P, head counts, scale and
lower_bound are runtime arguments, so one artifact serves every batch:

    sm90.decode.recurrent  recurrent_config(mode, T, K, V, qkv dtype, g dtype, beta dtype, A_log, dt_bias, safe,
                           l2norm, tiling, pool dtype, v_first)                  recurrent.RecurrentDecode
                           (MODE_SLOTS through its `launch_slots` entry: the slot table's row stride, the accepted
                           counts' address and whether they are given are three more runtime arguments)
    sm90.decode.verify     verify_config(T, K, V, qkv, g, beta, A_log, dt_bias, safe, l2norm, tensor_cores,
                           pool dtype, v_first)                                  kvbuffer_verify.ChunkVerify
    sm90.decode.flush      flush_config(T, K, V, layers, per_request, pool dtype, v_first)
                                                                                 flush.FlushKVBuffer
    sm90.decode.stream     stream_config(K, V, qkv, g, beta, A_log, dt_bias, safe, l2norm, pool dtype, v_first)
                           (T = 1 into the pool; one more runtime argument: the CTAs launched)
                                                                                 stream.StreamDecode

The pool dtype (fp32 or bf16) and layout (v_first: [V, K] per state) are compile-time; null_slot is a runtime
argument (-1 when the engine has none), and so are the gate's source and the beta activation of the recurrent and
verify kernels (fused_recurrent_kda's use_gate_in_kernel=False and use_beta_sigmoid_in_kernel / allow_neg_eigval:
`run_recurrent`'s precomputed_gate and beta_activation): they add no configuration.

Dtypes in the configuration: q/k/v as given (bf16, fp16, fp32); g and beta as given when bf16 or fp32, else
converted to fp32 on the host; A_log and dt_bias always fp32 (None when absent). The kernels convert every input to
fp32 as they load it, so these conversions change no result; they keep the configuration set small enough to be
built ahead of time (cula_sm90.kernels.aot_configurations).

Dispatch: single-token decode into the pool (MODE_FINAL, T = 1) of many request-heads (a threshold per pool dtype and
layout; any batch of a [V, K] fp32 pool) runs the streamed kernel (`configs.streams`; persistent CTAs,
`configs.stream_ctas_per_sm` per SM); otherwise
`configs.recurrent_tiling` (the recurrent kernel's tiling) and `configs.verify_variant` (recurrent kernel or chunk
form for the verify) pick by T and heads = N * HV; the measurements behind the tables are in
docs/benchmarks/mtp_decode.md. On a family's first call (mode, T, head dims, dtypes, gate) every kernel the tables
can pick for it at any N is loaded, so that a later batch size never compiles or loads one (a CUDA-graph capture at
a new N). A caller may name the kernel instead (`run_recurrent`'s `tiling` and `verify_variant`, for the tests that
check every tiling and verify variant and the benchmark that times them): then only that kernel is loaded.

No host synchronisation: nothing here reads a device tensor; accept lengths are read by the flush kernel.
"""

from __future__ import annotations

import torch

from cula_core import cute_runtime as rt
from cula_core.cute_runtime import plan_table
from cula_sm90.decode import configs

RECURRENT, VERIFY, FLUSH = "sm90.decode.recurrent", "sm90.decode.verify", "sm90.decode.flush"
STREAM = "sm90.decode.stream"
_ARCH, _DIST, _PKG = "sm_90a", "cula-sm90", "cula_sm90"
_F32, _BF16, _I32 = torch.float32, torch.bfloat16, torch.int32
#: dtypes of g and beta the kernels read directly; any other is converted to fp32 first
NATIVE_GATE_DTYPES = (torch.bfloat16, torch.float32)


# ---------------------------------------------------------------- configurations and their builds

def recurrent_config(mode: str, T: int, K: int, V: int, qkv: torch.dtype, g: torch.dtype, beta: torch.dtype,
                     has_A_log: bool, has_dt_bias: bool, safe: bool, l2norm: bool,
                     tiling: tuple[int, int, int, int], pool: torch.dtype = _F32, v_first: bool = False) -> tuple:
    """Compile-time configuration of the recurrent kernel (g, beta: the dtypes it reads, NATIVE_GATE_DTYPES;
    pool: the state pool's dtype, also that of the per-token states of MODE_STATES; v_first: its layout)."""
    return (mode, T, K, V, qkv, g, beta, _F32 if has_A_log else None, _F32 if has_dt_bias else None, bool(safe),
            bool(l2norm), tuple(tiling), pool, bool(v_first))


def verify_config(T: int, K: int, V: int, qkv: torch.dtype, g: torch.dtype, beta: torch.dtype, has_A_log: bool,
                  has_dt_bias: bool, safe: bool, l2norm: bool, tensor_cores: bool, pool: torch.dtype = _F32,
                  v_first: bool = False) -> tuple:
    """Compile-time configuration of the chunk-form verify (tensor_cores: 3xTF32 products, else SIMT)."""
    return (T, K, V, qkv, g, beta, _F32 if has_A_log else None, _F32 if has_dt_bias else None, bool(safe),
            bool(l2norm), bool(tensor_cores), pool, bool(v_first))


def stream_config(K: int, V: int, qkv: torch.dtype, g: torch.dtype, beta: torch.dtype, has_A_log: bool,
                  has_dt_bias: bool, safe: bool, l2norm: bool, pool: torch.dtype = _F32,
                  v_first: bool = False) -> tuple:
    """Compile-time configuration of the streamed T = 1 decode (stream.StreamDecode, configs.stream_tiling)."""
    return (K, V, qkv, g, beta, _F32 if has_A_log else None, _F32 if has_dt_bias else None, bool(safe), bool(l2norm),
            pool, bool(v_first))


def flush_config(T: int, K: int, V: int, layers: int, per_request: bool, pool: torch.dtype = _F32,
                 v_first: bool = False) -> tuple:
    return (T, K, V, layers, bool(per_request), pool, bool(v_first))


def _gate_args(qkv, gdt, bdt, adt, ddt, pool, out) -> tuple:
    """Compile-time pointer arguments of the recurrent and verify kernels (same signature): q, k, v, g, beta,
    A_log, dt_bias, pool, cache_idx, o, out (pool, out: their dtypes)."""
    p = rt.fake_ptr
    return (p(qkv), p(qkv), p(qkv), p(gdt), p(bdt, bdt.itemsize), p(adt or _F32, 4), p(ddt or _F32), p(pool),
            p(_I32, 4), p(qkv), p(out))


def _scalars(*kinds: str) -> tuple:
    import cutlass

    return tuple(cutlass.Int32(1) if k == "i" else cutlass.Int64(0) if k == "l" else cutlass.Float32(1.0)
                 for k in kinds)


def _gate_scalars() -> tuple:
    """Compile-time stand-ins of the runtime scalars of the recurrent and verify kernels (same signature): N, HQK,
    HV, P, scale, lower_bound, null_slot, precomputed_gate, beta_sigmoid."""
    return _scalars("i", "i", "i", "i", "f", "f", "i", "i", "i")


def _build_recurrent(config: tuple):
    from cula_sm90.decode.recurrent import RecurrentDecode

    mode, T, K, V, qkv, gdt, bdt, adt, ddt, safe, l2norm, (bv, vl, nw, wl), pool, v_first = config
    kern = RecurrentDecode(T=T, K=K, V=V, mode=mode, safe_gate=safe, has_A_log=adt is not None,
                           has_dt_bias=ddt is not None, l2norm=l2norm, block_v=bv, lanes_v=vl, num_warps=nw,
                           warp_local=bool(wl), state_v_first=v_first)
    out = pool if mode == configs.MODE_STATES else _F32
    args = (*_gate_args(qkv, gdt, bdt, adt, ddt, pool, out), *_gate_scalars())
    if mode == configs.MODE_SLOTS:  # + accepted counts, the slot table's row stride, has_accepted
        return kern.launch_slots, (*args, rt.fake_ptr(_I32, 4), *_scalars("i", "i"), rt.fake_stream())
    return kern, (*args, rt.fake_stream())


def _build_stream(config: tuple):
    from cula_sm90.decode.stream import StreamDecode

    K, V, qkv, gdt, bdt, adt, ddt, safe, l2norm, pool, v_first = config
    bv, vl, nw = configs.stream_tiling(V, pool.itemsize, v_first)
    kern = StreamDecode(K=K, V=V, safe_gate=safe, has_A_log=adt is not None, has_dt_bias=ddt is not None,
                        l2norm=l2norm, block_v=bv, lanes_v=vl, num_warps=nw, pool_bytes=pool.itemsize,
                        state_v_first=v_first, stages=configs.stream_stages(pool.itemsize, v_first))
    return kern, (*_gate_args(qkv, gdt, bdt, adt, ddt, pool, _F32), *_gate_scalars(), *_scalars("i"),
                  rt.fake_stream())


def _build_verify(config: tuple):
    from cula_sm90.decode.kvbuffer_verify import ChunkVerify

    T, K, V, qkv, gdt, bdt, adt, ddt, safe, l2norm, tensor_cores, pool, v_first = config
    kern = ChunkVerify(T=T, K=K, V=V, tensor_cores=tensor_cores, safe_gate=safe, has_A_log=adt is not None,
                       has_dt_bias=ddt is not None, l2norm=l2norm, state_v_first=v_first)
    return kern, (*_gate_args(qkv, gdt, bdt, adt, ddt, pool, _F32), *_gate_scalars(), rt.fake_stream())


def _build_flush(config: tuple):
    from cula_sm90.decode.flush import FlushKVBuffer

    T, K, V, layers, per_request, pool, v_first = config
    kern = FlushKVBuffer(T=T, K=K, V=V, layers=layers, per_request=per_request, state_v_first=v_first)
    offs = _scalars(*"l" * layers)
    p = rt.fake_ptr
    return kern, (p(pool), p(_F32), p(_I32, 4), p(_I32, 4), *_scalars("i"), offs, offs,
                  *_scalars("i", "i", "i", "i"), rt.fake_stream())


_COMMON = ("cula_sm90.decode._dsl", "cula_sm90.decode.configs", "cula_sm90.decode.launch")
for _name, _build, _sources in ((RECURRENT, _build_recurrent, ("recurrent",)),
                                (VERIFY, _build_verify, ("kvbuffer_verify",)), (FLUSH, _build_flush, ("flush",)),
                                (STREAM, _build_stream, ("stream", "cula_core.cute_kernels.copies"))):
    _modules = tuple(m if "." in m else f"cula_sm90.decode.{m}" for m in _sources)
    rt.register(rt.KernelDef(_name, _DIST, _PKG, _ARCH, _build, (*_modules, *_COMMON)))


def variant_kernel(mode: str, variant: str, tiling, T: int, K: int, V: int, qkv, gdt, bdt, has_A_log: bool,
                   has_dt_bias: bool, safe: bool, l2norm: bool, pool=_F32, v_first: bool = False) -> tuple[str, tuple]:
    """(kernel name, configuration) of one dispatch choice: the recurrent kernel at `tiling`, or the chunk-form
    verify (same signature)."""
    if variant == configs.VERIFY_RECURRENT:
        return RECURRENT, recurrent_config(mode, T, K, V, qkv, gdt, bdt, has_A_log, has_dt_bias, safe, l2norm,
                                           tiling, pool, v_first)
    return VERIFY, verify_config(T, K, V, qkv, gdt, bdt, has_A_log, has_dt_bias, safe, l2norm,
                                 variant == configs.VERIFY_CHUNK_TC, pool, v_first)


def family_kernels(mode: str, T: int, K: int, V: int, qkv, gdt, bdt, has_A_log: bool, has_dt_bias: bool,
                   safe: bool, l2norm: bool, pool=_F32, v_first: bool = False) -> list[tuple[str, tuple]]:
    """Every (kernel, configuration) the dispatch tables can pick for a family at any batch size."""
    out = []
    if configs.stream_serves(mode, T):
        out.append((STREAM, stream_config(K, V, qkv, gdt, bdt, has_A_log, has_dt_bias, safe, l2norm, pool, v_first)))
    variants = configs.verify_variants_for(T) if mode == configs.MODE_KVBUFFER else (configs.VERIFY_RECURRENT,)
    for variant in variants:
        tilings = configs.recurrent_tilings_for(T) if variant == configs.VERIFY_RECURRENT else (None,)
        out.extend(variant_kernel(mode, variant, t, T, K, V, qkv, gdt, bdt, has_A_log, has_dt_bias, safe, l2norm,
                                  pool, v_first) for t in tilings)
    return out


def dispatched_kernel(N: int, HV: int, mode: str, T: int, K: int, V: int, qkv, gdt, bdt, has_A_log: bool,
                      has_dt_bias: bool, safe: bool, l2norm: bool, pool=_F32,
                      v_first: bool = False) -> tuple[str, tuple]:
    """(kernel name, configuration) the dispatch picks for a batch of N requests with HV value heads in a family
    (family_kernels' arguments)."""
    family = (K, V, qkv, gdt, bdt, has_A_log, has_dt_bias, safe, l2norm, pool, v_first)
    if configs.streams(mode, T, N, HV, v_first, pool.itemsize):
        return STREAM, stream_config(*family)
    variant = configs.verify_variant(N, T, HV) if mode == configs.MODE_KVBUFFER else configs.VERIFY_RECURRENT
    return variant_kernel(mode, variant, configs.recurrent_tiling(N, T, HV, mode), T, *family)


_families: set[tuple] = set()


def _prepare_family(family: tuple) -> None:
    """Load every kernel of a family once (see the module docstring)."""
    if family in _families:
        return
    for name, config in family_kernels(*family):
        rt.get(name, config)
    _families.add(family)


def checked_choice(mode: str, tiling, verify_variant) -> None:
    """Check `run_recurrent`'s tiling and verify_variant: ValueError naming the argument unless tiling is None or
    one of configs.TILINGS (a tuple) and verify_variant is None or one of configs.VERIFY_VARIANTS, given only in
    MODE_KVBUFFER (the other modes have one kernel, the recurrent one); a tiling is the recurrent kernel's, so it
    does not go with a chunk-form verify_variant."""
    if tiling is not None:
        if not isinstance(tiling, tuple) or tiling not in configs.TILINGS:
            raise ValueError(f"tiling must be None or one of cula_sm90.decode.configs.TILINGS {configs.TILINGS}, "
                             f"got {tiling!r}")
    if verify_variant is not None:
        if verify_variant not in configs.VERIFY_VARIANTS:
            raise ValueError(f"verify_variant must be None or one of {configs.VERIFY_VARIANTS}, got "
                             f"{verify_variant!r}")
        if mode != configs.MODE_KVBUFFER:
            raise ValueError(f"verify_variant chooses the verify kernel (mode {configs.MODE_KVBUFFER!r}), got "
                             f"verify_variant={verify_variant!r} with mode {mode!r}")
        if tiling is not None and verify_variant != configs.VERIFY_RECURRENT:
            raise ValueError(f"tiling chooses the recurrent kernel's tiling; the chunk-form verify has none, got "
                             f"tiling={tiling!r} with verify_variant={verify_variant!r}")


# ---------------------------------------------------------------- recurrent kernel (decode, MTP, verify)

def gate_read_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels read g / beta of `dtype` in (the conversion to fp32 is exact, or rounds as the
    kernel's own conversion on load would)."""
    return dtype if dtype in NATIVE_GATE_DTYPES else torch.float32


_recurrent_fns: dict[tuple, object] = {}


def recurrent_function(mode, N, T, K, V, HV, qkv, gdt, bdt, has_A_log, has_dt_bias, safe, l2norm, pool, v_first,
                       tiling=None, verify_variant=None):
    """The loaded kernel that runs a batch, memoised by every argument. With tiling and verify_variant None (the
    dispatch's pick), the family's first batch loads the whole family (`_prepare_family`); a tiling or a
    verify_variant (as `run_recurrent` takes them, checked by `checked_choice`) loads only the kernel it names: a
    tiling alone names the recurrent kernel (in MODE_KVBUFFER too), a verify_variant alone takes the dispatch's
    tiling when it is the recurrent one."""
    if tiling is not None or verify_variant is not None:  # None, None (the dispatch's pick) needs no check
        checked_choice(mode, tiling, verify_variant)
    key = (mode, N, T, K, V, HV, qkv, gdt, bdt, has_A_log, has_dt_bias, safe, l2norm, pool, v_first, tiling,
           verify_variant)
    fn = _recurrent_fns.get(key)
    if fn is None:
        family = (mode, T, K, V, qkv, gdt, bdt, has_A_log, has_dt_bias, safe, l2norm, pool, v_first)
        if tiling is None and verify_variant is None:
            _prepare_family(family)
            fn = rt.get(*dispatched_kernel(N, HV, *family))
        else:
            variant = verify_variant or configs.VERIFY_RECURRENT
            fn = rt.get(*variant_kernel(mode, variant, tiling or configs.recurrent_tiling(N, T, HV, mode),
                                        *family[1:]))
        _recurrent_fns[key] = fn
    return fn


def run_recurrent(mode, q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
                  use_qk_l2norm_in_kernel, state_v_first=False, null_slot=None, precomputed_gate=False,
                  beta_activation="none", tiling=None, verify_variant=None, num_accepted_tokens=None):
    """Launch the recurrent or verify kernel of `mode` (configs.MODE_*) for this batch: (o, out) with o like v
    and out the per-token states [N, T, *pool slot] in the pool's dtype (MODE_STATES), the KVBuffer
    [N, T, HV, 2K + V] fp32 (MODE_KVBUFFER) or None (MODE_FINAL and MODE_SLOTS, which update the pool in place).
    Arguments in the decode calling convention of docs/backends.md, already validated and contiguous; the pool
    16-byte aligned (q, k, v, g and dt_bias are copied where they are not).

    Slots: cache_idx [N] int32 (one slot per request), or in MODE_SLOTS the slot table [N, T_idx] int32
    contiguous, T_idx >= T (the slot of each token), with num_accepted_tokens None (read column 0) or [N] int32
    (read column a - 1, clamped to the table as the reference does). num_accepted_tokens outside MODE_SLOTS, or a
    table of another shape, is a ValueError raised before anything runs.

    The gate and beta (runtime arguments of the kernels, so no configuration is added for them):
      precomputed_gate: False = the gate computed from raw g (softplus, or safe with lower_bound; A_log / dt_bias
        optional); True = g is the log decay itself (fused_recurrent_kda with use_gate_in_kernel=False): A_log,
        dt_bias and lower_bound are ignored, and the call runs the softplus configuration with A_log and dt_bias
        (the one the served setups build ahead of time), whose gate code the kernel then skips.
      beta_activation: "none" (beta as given), "sigmoid" or "2sigmoid" (configs.BETA_SIGMOID).

    Which kernel runs:
      tiling: None = the dispatch table's pick (configs.recurrent_tiling); else one of configs.TILINGS: the
        recurrent kernel at that tiling (in MODE_KVBUFFER too: a tiling alone selects the recurrent verify).
      verify_variant: MODE_KVBUFFER only. None = the dispatch table's pick (configs.verify_variant); else one of
        configs.VERIFY_VARIANTS (a chunk-form variant takes no tiling).
    Any other value is a ValueError naming the argument, raised before anything is allocated or launched. A named
    kernel is loaded alone on its first call (the dispatch's pick loads its whole family, so that later batch
    sizes only launch)."""
    if num_accepted_tokens is not None or mode == configs.MODE_SLOTS:
        _check_slot_table(mode, cache_idx, num_accepted_tokens, q.shape[0], q.shape[1])
    args = (q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias)
    return recurrent_launcher(mode, args, scale=scale, lower_bound=lower_bound,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
                              null_slot=null_slot, precomputed_gate=precomputed_gate, beta_activation=beta_activation,
                              tiling=tiling, verify_variant=verify_variant)(*args, num_accepted_tokens)


def recurrent_launcher(mode, args: tuple, *, scale, lower_bound, use_qk_l2norm_in_kernel, state_v_first=False,
                       null_slot=None, precomputed_gate=False, beta_activation="none", tiling=None,
                       verify_variant=None, unaligned_pool=None, o_only=False):
    """`run_recurrent` (its keywords, checked here) for every call whose (q, k, v, g, beta, state_pool, cache_idx,
    A_log, dt_bias) have the shapes, dtypes, device and presence of `args`: a function of those nine and
    num_accepted_tokens (default None) that returns run_recurrent's (o, out). It does per call only what depends on
    values and addresses (the outputs' allocation, dtype conversions, 16-byte aligned copies of views at odd
    offsets, the addresses, the current stream, the launch); the kernel and its scalar arguments are resolved once
    per batch shape and kept (`_launchers`), so that a repeated batch, or a plan (cula_core.plans) holding this
    function, only launches.

    For a plan's own launcher (made for it, not kept): `unaligned_pool`, a function of the nine arguments that runs
    instead of the kernel when the pool's address is not 16-byte aligned (the kernels' rule; without it the caller
    guarantees the alignment), and `o_only`: return o alone (kda_decode's result)."""
    if tiling is not None or verify_variant is not None:
        checked_choice(mode, tiling, verify_variant)
    beta_sigmoid = configs.BETA_SIGMOID.get(beta_activation)
    if beta_sigmoid is None:
        raise ValueError(f"beta_activation must be one of {tuple(configs.BETA_SIGMOID)}, got {beta_activation!r}")
    q, _, v, g, beta, state_pool, _, A_log, dt_bias = args
    key = (mode, q.shape, v.shape, state_pool.shape, q.dtype, g.dtype, beta.dtype,
           None if A_log is None else A_log.dtype, None if dt_bias is None else dt_bias.dtype, scale, lower_bound,
           use_qk_l2norm_in_kernel, state_pool.dtype, state_v_first, null_slot, precomputed_gate, beta_sigmoid, tiling,
           verify_variant, q.get_device())
    if unaligned_pool is not None or o_only:
        return _launcher(key, v.device, unaligned_pool, o_only)
    launch = _launchers.get(key)
    if launch is None:
        if len(_launchers) >= 1024:  # a process that never repeats a batch shape
            _launchers.clear()
        launch = _launchers[key] = _launcher(key, v.device)
    return launch


#: the launch functions of the batches run so far, by recurrent_launcher's key (`_launcher`)
_launchers: dict[tuple, object] = {}


def _launcher(key: tuple, device: torch.device, unaligned_pool=None, o_only: bool = False):
    """recurrent_launcher's function for `key` (q, v and pool shapes, q/k/v, g, beta, A_log and dt_bias dtypes,
    scale, lower_bound, l2norm, pool dtype, v_first, null_slot, precomputed gate, beta activation code, tiling,
    verify_variant, device index: what decides the kernel, its scalar arguments and the conversions) on `device`,
    with recurrent_launcher's `unaligned_pool` and `o_only`."""
    (mode, q_shape, v_shape, pool_shape, qkv, g_dtype, beta_dtype, a_dtype, d_dtype, scale, lower_bound, l2norm,
     pool, v_first, null_slot, precomputed, beta_sigmoid, tiling, verify_variant, index) = key
    N, T, HQK, K = q_shape
    HV, V = v_shape[2], v_shape[3]
    gdt, bdt = gate_read_dtype(g_dtype), gate_read_dtype(beta_dtype)
    g_float, beta_float = gdt != g_dtype, bdt != beta_dtype
    if precomputed:
        # the prebuilt configuration with A_log and dt_bias, whose gate code the kernel skips: their addresses are
        # stand-ins, never read
        has_A_log = has_dt_bias = True
        lower_bound = None
    else:
        has_A_log, has_dt_bias = a_dtype is not None, d_dtype is not None
    a_float, d_float = a_dtype not in (None, _F32), d_dtype not in (None, _F32)
    safe, v_first = lower_bound is not None, bool(v_first)
    if mode == configs.MODE_STATES:  # per-token states in the pool's layout and dtype
        out_shape, out_dtype = (N, T, *pool_shape[1:]), pool
    elif mode == configs.MODE_KVBUFFER:
        out_shape, out_dtype = (N, T, HV, 2 * K + V), _F32
    else:
        out_shape = out_dtype = None
    fn, scalars = None, ()
    if N > 0:  # an empty batch launches nothing and loads no kernel
        fn = recurrent_function(mode, N, T, K, V, HV, qkv, gdt, bdt, has_A_log, has_dt_bias, safe, bool(l2norm),
                                pool, v_first, tiling, verify_variant)
        scalars = (N, HQK, HV, pool_shape[0], float(scale), float(lower_bound) if safe else 0.0,
                   -1 if null_slot is None else int(null_slot), int(bool(precomputed)), beta_sigmoid)
        pool_bytes = pool.itemsize
        if tiling is None and verify_variant is None and configs.streams(mode, T, N, HV, v_first, pool_bytes):
            # the streamed decode's one more argument: the CTAs launched, as many as are resident at once
            bv = configs.stream_tiling(V, pool_bytes, v_first)[0]
            stages = configs.stream_stages(pool_bytes, v_first)
            ctas_per_sm = configs.stream_ctas_per_sm(K, pool_bytes, v_first, stages, bv)
            scalars += (min(N * HV * (V // bv), ctas_per_sm * rt.sm_count(index)),)
    slots = mode == configs.MODE_SLOTS
    empty, empty_like = torch.empty, torch.empty_like

    def launch(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, num_accepted_tokens=None):
        pool_addr = state_pool.data_ptr()
        if pool_addr & 15 and unaligned_pool is not None:
            return unaligned_pool(q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias)
        o = empty_like(v)
        # sizes as separate arguments: torch.empty parses them faster than a shape tuple
        out = None if out_shape is None else empty(*out_shape, dtype=out_dtype, device=device)
        if fn is None:
            return o if o_only else (o, out)
        q_addr, k_addr, v_addr = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (q_addr | k_addr | v_addr) & 15:
            q, k, v = (rt.aligned16(t) for t in (q, k, v))
            q_addr, k_addr, v_addr = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if g_float:
            g = g.float()
        g_addr = g.data_ptr()
        if g_addr & 15:
            g = g.clone()
            g_addr = g.data_ptr()
        if beta_float:
            beta = beta.float()
        if precomputed:
            a_addr = d_addr = pool_addr
        else:
            if has_A_log:
                if a_float:
                    A_log = A_log.float()
                a_addr = A_log.data_ptr()
            else:
                a_addr = pool_addr  # never read without A_log
            if has_dt_bias:
                d_addr = dt_bias.data_ptr()
                if d_float or d_addr & 15:
                    dt_bias = rt.aligned16(dt_bias.float())
                    d_addr = dt_bias.data_ptr()
            else:
                d_addr = pool_addr  # never read without dt_bias
        out_addr = pool_addr if out is None else out.data_ptr()  # never written in MODE_FINAL / MODE_SLOTS
        if slots:
            acc = num_accepted_tokens
            fn(q_addr, k_addr, v_addr, g_addr, beta.data_ptr(), a_addr, d_addr, pool_addr, cache_idx.data_ptr(),
               o.data_ptr(), out_addr, *scalars,
               acc.data_ptr() if acc is not None else cache_idx.data_ptr(),  # never read without the counts
               cache_idx.shape[1], int(acc is not None), rt.current_stream(index))
        else:
            fn(q_addr, k_addr, v_addr, g_addr, beta.data_ptr(), a_addr, d_addr, pool_addr, cache_idx.data_ptr(),
               o.data_ptr(), out_addr, *scalars, rt.current_stream(index))
        return o if o_only else (o, out)

    # the compiled plan table serves a plan's calls that need no conversion (cula_core.cute_runtime.plan_table)
    plain = fn is not None and not (slots or g_float or beta_float or a_float or d_float)
    launch.program = None
    if plain and (unaligned_pool is not None or o_only):  # a plan's own launcher
        launch.program = launch_program(fn, scalars, v_shape, qkv, out_shape, out_dtype, has_A_log, has_dt_bias,
                                         precomputed)
    return launch


def launch_program(fn, scalars: tuple, v_shape, v_dtype, out_shape, out_dtype, has_A_log: bool, has_dt_bias: bool,
                    precomputed: bool) -> plan_table.Program:
    """`_launcher`'s launch as a plan-table program: inputs (q, k, v, g, beta, state_pool, cache_idx, A_log,
    dt_bias), results o (v's shape and dtype) and, in the modes that have one, the per-token output. The inputs
    the kernel reads in 16-byte vectors (q, k, v, g, the pool, dt_bias) must be 16-byte aligned, else the call is
    declined (the Python launcher copies them, or runs the reference for the pool)."""
    program = plan_table.Program(9)
    q, k, v, g, beta, pool, cache_idx, a_log, dt_bias = range(9)
    o = program.alloc(v_shape, v_dtype, q)
    out = None if out_shape is None else program.alloc(out_shape, out_dtype, q)
    at = plan_table.Address
    a_addr = at(a_log) if has_A_log and not precomputed else at(pool)  # never read otherwise
    d_addr = at(dt_bias) if has_dt_bias and not precomputed else at(pool)
    program.launch(fn, at(q), at(k), at(v), at(g), at(beta), a_addr, d_addr, at(pool), at(cache_idx), at(o),
                   at(pool) if out is None else at(out), *scalars, plan_table.STREAM)
    program.require_aligned(q, k, v, g, pool, *((dt_bias,) if has_dt_bias and not precomputed else ()))
    if out is None:
        program.returns(o)
    else:
        program.returns(o, out)
    return program


def _check_slot_table(mode, cache_idx, num_accepted_tokens, N: int, T: int) -> None:
    """run_recurrent's slot arguments (see its docstring): ValueError naming the argument."""
    if mode != configs.MODE_SLOTS:
        if num_accepted_tokens is not None:
            raise ValueError(f"num_accepted_tokens is read only in mode {configs.MODE_SLOTS!r} (a slot per token), "
                             f"got it with mode {mode!r}")
        return
    if cache_idx.dim() != 2 or cache_idx.shape[0] != N or cache_idx.shape[1] < T:
        raise ValueError(f"cache_idx must be the slot table [N, T_idx] with N = {N} rows and T_idx >= T = {T} in "
                         f"mode {configs.MODE_SLOTS!r}, got shape {tuple(cache_idx.shape)}")
    tables = {"cache_idx": cache_idx}
    if num_accepted_tokens is not None:
        if tuple(num_accepted_tokens.shape) != (N,):
            raise ValueError(f"num_accepted_tokens must be [N] = [{N}], got shape "
                             f"{tuple(num_accepted_tokens.shape)}")
        tables["num_accepted_tokens"] = num_accepted_tokens
    for name, t in tables.items():
        if t.dtype != _I32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor in mode {configs.MODE_SLOTS!r}, got "
                             f"{t.dtype} with strides {t.stride()}")


# ---------------------------------------------------------------- flush kernel (one layer or all layers)

def run_flush(state_pools, cache_idx, kvbuffers, accept_len, accept_len_all, state_v_first=False,
              null_slot=None) -> None:
    """Commit each request's accepted tokens of `kvbuffers` (one per layer) into `state_pools` in one launch.
    Pools and buffers 16-byte aligned; accept_len [N] int32 or None (accept_len_all for every request)."""
    pool0, buf0 = state_pools[0], kvbuffers[0]
    P, HV = pool0.shape[:2]
    K, V = (pool0.shape[3], pool0.shape[2]) if state_v_first else pool0.shape[2:]
    N, T = buf0.shape[:2]
    if N == 0:
        return
    per_request = accept_len is not None
    fn = rt.get(FLUSH, flush_config(T, K, V, len(state_pools), per_request, pool0.dtype, state_v_first))
    # layer l = layer 0's pointer + 4 * offset elements (16-byte units; every pointer is 16-byte aligned)
    p0, b0 = pool0.data_ptr(), buf0.data_ptr()
    poffs = tuple((p.data_ptr() - p0) // 16 for p in state_pools)
    boffs = tuple((b.data_ptr() - b0) // 16 for b in kvbuffers)
    acc_addr = accept_len.data_ptr() if per_request else cache_idx.data_ptr()  # never read without the tensor
    fn(p0, b0, cache_idx.data_ptr(), acc_addr, int(accept_len_all), poffs, boffs, N, HV, P,
       -1 if null_slot is None else int(null_slot), rt.current_stream(pool0.device))


#: ops.py's name for the 16-byte alignment copy
_aligned = rt.aligned16


def all_aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)
