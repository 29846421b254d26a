"""Thin launch code of the decode kernels: the calling convention of docs/backends.md on one side, the compiled
CuTe DSL kernels on the other. Compiled kernels are cached per compile-time key (head dims, T, dtypes, gate
code, output mode, tiling, layer count); batch size N, pool size P, head counts, scale and lower_bound are
runtime arguments, so one compilation serves every batch.

Launch cost. Decode is launch-latency bound at small N, so a compiled kernel is not called through the DSL's
generic argument binding (per-argument adapters, ~tens of microseconds for a dozen arguments) but through
`FastLaunch`: the C argument array of the compiled host function is built once, over ctypes cells that each
call refills (pointers, ints, floats, the stream) before calling the compiled function directly. The first
call of each kernel goes through the DSL's own binding and checks that it passes the same bytes as the cells;
if it ever does not, that kernel keeps using the DSL's path.

No host synchronisation: nothing here reads a device tensor; accept lengths are read by the flush kernel.

Dispatch (both tables are `_config.recurrent_tiling` and `_config.verify_variant`; measured on the H100 in CUDA-graph
device time, docs/benchmarks/mtp_decode.md, run of 2026-11-22: the tiling sweep and the chain grid with every verify
variant). heads = N * HV.

Recurrent kernel (kda_decode, kda_decode_mtp, and the verify where the table below picks it); tiling = (BV columns
per CTA, lanes along V, warps, warp-local prologue). Every tiling of `_config.TILINGS` is tested against the reference;
the ones below also under memcheck. The T >= 2 rows were measured on the verify (KVBuffer mode, T = 4) and stand for
the final-state and per-token-states modes as well (same state traffic and token loop; not timed separately).

| T    | heads      | tiling      | measured (sweep at heads 32, 64, 512, 1024, 4096, 8192)                |
| ---- | ---------- | ----------- | ---------------------------------------------------------------------- |
| 1    | any        | 64, 4, 4, 0 | best or within 3% of the best everywhere; 12% faster than 32,4,4,0 at  |
|      |            |             | 4096 and 8192 heads (79-81% of the HBM bound at N = 128)               |
| >= 2 | <= 64      | 32, 4, 4, 0 | T = 4: within 6% of the best (16,4,2,0); 64,4,4,0 up to 12% slower     |
| >= 2 | 65 .. 1023 | 64, 4, 4, 0 | T = 4, 512 heads: best (0.0241 ms; 32,4,4,0: 0.0281)                   |
| >= 2 | >= 1024    | 32, 2, 2, 1 | T = 4, 1024 / 4096 / 8192 heads: best (12-19% faster than 32,4,4,0)    |

Verify (kda_decode_mtp_kvbuffer): the verify alone per variant at H = 64, T in 2..8, N in 1, 16, 128 (64, 1024,
8192 heads; session 4), and the chain grid (T in 2..6, 32 .. 8192 heads; session 3, recurrent vs chunk).

| heads | T    | variant    | measured                                                                          |
| ----- | ---- | ---------- | --------------------------------------------------------------------------------- |
| <= 32 | any  | recurrent  | session 3: best in those cells by 1-9% (a single wave of CTAs)                     |
| > 32  | <= 8 | chunk SIMT | best or within 3% at T = 2..8: recurrent 2.5-2.7% faster at T = 2 (64 and 8192     |
|       |      |            | heads), 21-41% slower from T = 4; TC 3% slower at T = 8 with 1024 / 8192 heads,    |
|       |      |            | 4% faster with 64                                                                  |
| > 32  | >= 9 | chunk TC   | NOT measured, extrapolated: its products cost the same from T = 9 to 16 (two       |
|       |      |            | m-tiles), where the SIMT pair sums grow with T^2; both variants pass the tests at 9 |
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from types import SimpleNamespace

import torch

from cula_sm90.decode import _config

_DSL_TYPES = None
_cache: dict[tuple, FastLaunch] = {}
_cache_lock = threading.Lock()


def _dsl():
    """CuTe DSL modules, imported on first use (importing the package must stay cheap and GPU-free)."""
    global _DSL_TYPES
    if _DSL_TYPES is None:
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        types = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
                 torch.float64: cutlass.Float64, torch.int32: cutlass.Int32}
        _DSL_TYPES = SimpleNamespace(cutlass=cutlass, cute=cute, cuda=cuda, make_ptr=make_ptr, types=types)
    return _DSL_TYPES


# ---------------------------------------------------------------- compiled kernels and their fast calls

_CELL = {"ptr": ctypes.c_void_p, "stream": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64,
         "f32": ctypes.c_float}


class FastLaunch:
    """Calls one compiled kernel with a pre-built C argument array (see the module docstring).

    `kinds` names each flattened argument's C type: "ptr" (an address), "i32", "i64", "f32", "stream".
    The cells' addresses never change, so neither does the packed array handed to the compiled host function:
    a call refills the cells and calls it."""

    def __init__(self, compiled, kinds: tuple[str, ...]):
        self.compiled = compiled
        self.kinds = kinds
        self.cells = [_CELL[k]() for k in kinds]
        self.exe_args = [ctypes.addressof(c) for c in self.cells]
        self.fast: bool | None = None  # unknown until the first call has been checked
        self.capi = None               # (host function, packed argument array, its error cell or None)
        self.lock = threading.Lock()

    def preload(self) -> None:
        """Load the kernel on the current device now, as the DSL does on a first call (its default executor:
        module and context): a first call inside a CUDA-graph capture then only launches. Best effort: on a DSL
        without these internals the first call loads it, as before."""
        try:
            c = self.compiled
            with c._executor_lock:
                if c._default_executor is None:
                    c._default_executor = weakref.proxy(c).to(None)
        except Exception:  # the first call loads the kernel instead
            pass

    def _fill(self, flat) -> None:
        for cell, value in zip(self.cells, flat, strict=True):
            cell.value = value

    def _check(self, dsl_args) -> bool:
        """Whether the DSL's own binding of `dsl_args` passes exactly the bytes held in our cells."""
        try:
            exe_args, _ = self.compiled.generate_execution_args(*dsl_args)
        except Exception:
            return False
        if len(exe_args) != len(self.cells):
            return False
        for addr, cell in zip(exe_args, self.cells, strict=True):
            addr = addr.value if isinstance(addr, ctypes.c_void_p) else int(addr)
            if ctypes.string_at(addr, ctypes.sizeof(cell)) != bytes(cell):
                return False
        return True

    def _bind_capi(self) -> None:
        """The executor's host function and a private copy of its packed arguments (our cells, then the
        executor's own trailing entries), so that a call skips the per-argument packing as well."""
        try:
            ex = self.compiled._default_executor
            packed = ex._get_invoke_packed_args(self.exe_args)
            own = (ctypes.c_void_p * len(packed))(*packed)
            self.capi = (ex.capi_func, own, ex.cuda_result if ex._has_cuda_result else None)
        except Exception:  # a DSL without these internals: keep run_compiled_program
            self.capi = None

    def __call__(self, flat: list, dsl_args) -> None:
        """flat: the argument values in `kinds` order; dsl_args: a callable giving the DSL-typed arguments
        (used on the first call and whenever the fast path is off)."""
        with self.lock:
            if self.fast:
                self._fill(flat)
                if self.capi is None:
                    self.compiled.run_compiled_program(self.exe_args)
                    return
                func, packed, result = self.capi
                func(packed)
                if result is not None and result.value != 0:
                    raise RuntimeError(f"CUDA error {result.value} launching a cula-sm90 decode kernel")
                return
            args = dsl_args()
            if self.fast is None:
                self._fill(flat)
                self.fast = self._check(args)
            self.compiled(*args)
            if self.fast and self.capi is None:
                self._bind_capi()


def _compiled(key: tuple, build, kinds: tuple[str, ...]) -> FastLaunch:
    fl = _cache.get(key)
    if fl is None:
        with _cache_lock:
            fl = _cache.get(key)
            if fl is None:
                fl = _cache[key] = FastLaunch(build(), kinds)
    return fl


def _compile(kern, *args):
    """Compile for sm_90a explicitly: the DSL's own detection queries the driver (and picks sm_100 where it
    cannot), and the kernels are Hopper's."""
    d = _dsl()
    return d.cute.compile[d.cute.GPUArch("sm_90a")](kern, *args)


def _fake_ptr(dtype: torch.dtype, align: int = 16):
    d = _dsl()
    return d.make_ptr(d.types[dtype], 1 << 20, d.cute.AddressSpace.gmem, assumed_align=align)


def _ptr(dtype: torch.dtype, address: int, align: int = 16):
    d = _dsl()
    return d.make_ptr(d.types[dtype], address, d.cute.AddressSpace.gmem, assumed_align=align)


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """The kernels load 16-byte vectors: an input view at an odd offset is copied (never the case for tensors
    that own their storage)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


# ---------------------------------------------------------------- recurrent kernel (decode, MTP, verify)

_RECURRENT_KINDS = ("ptr",) * 11 + ("i32",) * 4 + ("f32",) * 2 + ("stream",)


def _recurrent_kernel(mode: str, T: int, K: int, V: int, qkv, g, beta, A_log, dt_bias, safe: bool, l2norm: bool,
                      tiling: tuple[int, int, int]) -> FastLaunch:
    gdt, bdt = g.dtype, beta.dtype
    adt = A_log.dtype if A_log is not None else None
    ddt = dt_bias.dtype if dt_bias is not None else None
    key = ("recurrent", mode, T, K, V, qkv, gdt, bdt, adt, ddt, safe, l2norm, tiling)

    def build():
        d = _dsl()
        from cula_sm90.decode.recurrent import RecurrentDecode

        bv, vl, nw, wl = tiling
        kern = RecurrentDecode(T=T, K=K, V=V, mode=mode, safe_gate=safe, has_A_log=adt is not None,
                               has_dt_bias=ddt is not None, l2norm=l2norm, block_v=bv, lanes_v=vl, num_warps=nw,
                               warp_local=bool(wl))
        return _compile(kern, *_fake_recurrent_args(d, qkv, gdt, bdt, adt, ddt))

    return _compiled(key, build, _RECURRENT_KINDS)


def _fake_recurrent_args(d, qkv, gdt, bdt, adt, ddt) -> tuple:
    """Compile-time stand-ins for the arguments of the recurrent and verify kernels (same signature)."""
    f32 = torch.float32
    return (_fake_ptr(qkv), _fake_ptr(qkv), _fake_ptr(qkv), _fake_ptr(gdt), _fake_ptr(bdt, bdt.itemsize),
            _fake_ptr(adt or f32, (adt or f32).itemsize), _fake_ptr(ddt or f32), _fake_ptr(f32),
            _fake_ptr(torch.int32, 4), _fake_ptr(qkv), _fake_ptr(f32),
            d.cutlass.Int32(1), d.cutlass.Int32(1), d.cutlass.Int32(1), d.cutlass.Int32(1), d.cutlass.Float32(1.0),
            d.cutlass.Float32(-1.0), d.cuda.CUstream(0))


def _run_recurrent(mode, q, k, v, g, beta, state_pool, cache_idx, A_log, dt_bias, *, scale, lower_bound,
                   use_qk_l2norm_in_kernel):
    N, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    P = state_pool.shape[0]
    dev = q.device
    o = torch.empty_like(v)
    if mode == _config.MODE_STATES:
        out = torch.empty((N, T, HV, K, V), device=dev, dtype=torch.float32)
    elif mode == _config.MODE_KVBUFFER:
        out = torch.empty((N, T, HV, 2 * K + V), device=dev, dtype=torch.float32)
    else:
        out = None
    if N == 0:
        return o, out
    q, k, v, g = (_aligned(t) for t in (q, k, v, g))
    A_log = A_log.contiguous() if A_log is not None else None
    dt_bias = _aligned(dt_bias.contiguous()) if dt_bias is not None else None
    safe = lower_bound is not None
    l2norm = bool(use_qk_l2norm_in_kernel)
    _prepare_family(mode, T, K, V, q.dtype, g, beta, A_log, dt_bias, safe, l2norm)
    variant = _config.verify_variant(N, T, HV) if mode == _config.MODE_KVBUFFER else _config.VERIFY_RECURRENT
    fl = _variant_kernel(mode, variant, _config.recurrent_tiling(N, T, HV), T, K, V, q.dtype, g, beta, A_log,
                         dt_bias, safe, l2norm)
    pool_addr = state_pool.data_ptr()
    addrs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
             A_log.data_ptr() if A_log is not None else pool_addr,        # never read without A_log
             dt_bias.data_ptr() if dt_bias is not None else pool_addr,    # never read without dt_bias
             pool_addr, cache_idx.data_ptr(), o.data_ptr(),
             out.data_ptr() if out is not None else pool_addr]            # never written in MODE_FINAL
    lb = float(lower_bound) if safe else 0.0
    stream = _stream(dev)
    flat = [*addrs, N, HQK, HV, P, float(scale), lb, stream]

    def dsl_args():
        d = _dsl()
        f32 = torch.float32
        dts = [q.dtype, q.dtype, q.dtype, g.dtype, beta.dtype, A_log.dtype if A_log is not None else f32,
               dt_bias.dtype if dt_bias is not None else f32, f32, torch.int32, o.dtype, f32]
        aligns = [16, 16, 16, 16, beta.dtype.itemsize, (A_log.dtype if A_log is not None else f32).itemsize,
                  16, 16, 4, 16, 16]
        ptrs = [_ptr(dt, a, al) for dt, a, al in zip(dts, addrs, aligns, strict=True)]
        return (*ptrs, d.cutlass.Int32(N), d.cutlass.Int32(HQK), d.cutlass.Int32(HV), d.cutlass.Int32(P),
                d.cutlass.Float32(float(scale)), d.cutlass.Float32(lb), d.cuda.CUstream(stream))

    fl(flat, dsl_args)
    return o, out


# ---------------------------------------------------------------- chunk-form verify (kvbuffer_verify.py)

def _verify_kernel(T: int, K: int, V: int, qkv, g, beta, A_log, dt_bias, safe: bool, l2norm: bool,
                   tensor_cores: bool) -> FastLaunch:
    """The chunk-form verify: kvbuffer_verify.ChunkVerify, with 3xTF32 tensor-core or SIMT products."""
    gdt, bdt = g.dtype, beta.dtype
    adt = A_log.dtype if A_log is not None else None
    ddt = dt_bias.dtype if dt_bias is not None else None
    key = ("verify", T, K, V, qkv, gdt, bdt, adt, ddt, safe, l2norm, tensor_cores)

    def build():
        d = _dsl()
        gate = dict(safe_gate=safe, has_A_log=adt is not None, has_dt_bias=ddt is not None, l2norm=l2norm)
        from cula_sm90.decode.kvbuffer_verify import ChunkVerify

        kern = ChunkVerify(T=T, K=K, V=V, tensor_cores=tensor_cores, **gate)
        return _compile(kern, *_fake_recurrent_args(d, qkv, gdt, bdt, adt, ddt))

    return _compiled(key, build, _RECURRENT_KINDS)


def _variant_kernel(mode, variant, tiling, T, K, V, qkv, g, beta, A_log, dt_bias, safe, l2norm) -> FastLaunch:
    if variant == _config.VERIFY_RECURRENT:
        return _recurrent_kernel(mode, T, K, V, qkv, g, beta, A_log, dt_bias, safe, l2norm, tiling)
    # the chunk-form verify: same signature and argument kinds as the recurrent kernel
    return _verify_kernel(T, K, V, qkv, g, beta, A_log, dt_bias, safe, l2norm, variant == _config.VERIFY_CHUNK_TC)


_families: set[tuple] = set()


def _prepare_family(mode, T, K, V, qkv, g, beta, A_log, dt_bias, safe, l2norm) -> None:
    """On the first call of a (mode, T, head dims, dtypes, gate) family, compile and load every kernel the
    dispatch tables can pick for it at any batch size: a call at a new N (a CUDA-graph capture without a warm-up
    at that size) then never compiles or loads a kernel, whichever variant its size selects."""
    adt = A_log.dtype if A_log is not None else None
    ddt = dt_bias.dtype if dt_bias is not None else None
    family = (mode, T, K, V, qkv, g.dtype, beta.dtype, adt, ddt, safe, l2norm, _config.TILING_OVERRIDE,
              _config.VERIFY_OVERRIDE)
    if family in _families:
        return
    variants = _config.verify_variants_for(T) if mode == _config.MODE_KVBUFFER else (_config.VERIFY_RECURRENT,)
    for variant in variants:
        tilings = _config.recurrent_tilings_for(T) if variant == _config.VERIFY_RECURRENT else (None,)
        for tiling in tilings:
            _variant_kernel(mode, variant, tiling, T, K, V, qkv, g, beta, A_log, dt_bias, safe, l2norm).preload()
    _families.add(family)


# ---------------------------------------------------------------- flush kernel (one layer or all layers)

def _flush_kernel(T: int, K: int, V: int, layers: int, per_request: bool) -> FastLaunch:
    key = ("flush", T, K, V, layers, per_request)
    kinds = ("ptr",) * 4 + ("i32",) + ("i64",) * (2 * layers) + ("i32",) * 3 + ("stream",)

    def build():
        d = _dsl()
        from cula_sm90.decode.flush import FlushKVBuffer

        kern = FlushKVBuffer(T=T, K=K, V=V, layers=layers, per_request=per_request)
        offs = tuple(d.cutlass.Int64(0) for _ in range(layers))
        f32 = torch.float32
        return _compile(kern, _fake_ptr(f32), _fake_ptr(f32), _fake_ptr(torch.int32, 4),
                            _fake_ptr(torch.int32, 4), d.cutlass.Int32(0), offs, offs, d.cutlass.Int32(1),
                            d.cutlass.Int32(1), d.cutlass.Int32(1), d.cuda.CUstream(0))

    return _compiled(key, build, kinds)


def _run_flush(state_pools, cache_idx, kvbuffers, accept_len, accept_len_all) -> None:
    pool0, buf0 = state_pools[0], kvbuffers[0]
    P, HV, K, V = pool0.shape
    N, T = buf0.shape[:2]
    L = len(state_pools)
    if N == 0:
        return
    per_request = accept_len is not None
    fl = _flush_kernel(T, K, V, L, per_request)
    # layer l = layer 0's pointer + 4 * offset elements (16-byte units; every pointer is 16-byte aligned)
    p0, b0 = pool0.data_ptr(), buf0.data_ptr()
    poffs = [(p.data_ptr() - p0) // 16 for p in state_pools]
    boffs = [(b.data_ptr() - b0) // 16 for b in kvbuffers]
    acc_addr = accept_len.data_ptr() if per_request else cache_idx.data_ptr()  # never read without the tensor
    stream = _stream(pool0.device)
    flat = [p0, b0, cache_idx.data_ptr(), acc_addr, int(accept_len_all), *poffs, *boffs, N, HV, P, stream]

    def dsl_args():
        d = _dsl()
        f32 = torch.float32
        return (_ptr(f32, p0), _ptr(f32, b0), _ptr(torch.int32, cache_idx.data_ptr(), 4),
                _ptr(torch.int32, acc_addr, 4), d.cutlass.Int32(int(accept_len_all)),
                tuple(d.cutlass.Int64(x) for x in poffs), tuple(d.cutlass.Int64(x) for x in boffs),
                d.cutlass.Int32(N), d.cutlass.Int32(HV), d.cutlass.Int32(P), d.cuda.CUstream(stream))

    fl(flat, dsl_args)


def all_aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)
