"""Calling the C ABI of libcula_sm89.so (cula_sm89.h) with ctypes: what a C, C++ or Rust caller does, written in
Python. torch only provides the device memory and the stream here; the library itself needs just the CUDA
runtime. Run it on a GPU machine with cula-sm89 installed:

    python packages/cula-sm89/examples/capi_ctypes.py

It fills a KdaPrefillIO, asks the library for its workspace size, runs kda_prefill_f32 on the current stream and
compares the result with the pybind11 path (cula_sm89.ops.prefill): both run the same kernels, so they agree
bit for bit.
"""

from __future__ import annotations

import ctypes
import sys

import torch

import cula_sm89

I64x3 = ctypes.c_int64 * 3


class KdaPrefillIO(ctypes.Structure):
    """Mirror of `struct KdaPrefillIO` in cula_sm89.h (same field order, natural C alignment)."""

    _fields_ = [
        ("B", ctypes.c_int64), ("T", ctypes.c_int64), ("HQK", ctypes.c_int64), ("HV", ctypes.c_int64),
        ("K", ctypes.c_int64), ("V", ctypes.c_int64), ("N", ctypes.c_int64),
        ("chunk_size", ctypes.c_int32), ("scale", ctypes.c_float),
        ("q", ctypes.c_void_p), ("q_stride", I64x3),
        ("k", ctypes.c_void_p), ("k_stride", I64x3),
        ("v", ctypes.c_void_p), ("v_stride", I64x3),
        ("g", ctypes.c_void_p), ("g_stride", I64x3),
        ("beta", ctypes.c_void_p), ("beta_stride", I64x3),
        ("initial_state", ctypes.c_void_p),
        ("cu_seqlens", ctypes.c_void_p),
        ("o", ctypes.c_void_p), ("o_stride", I64x3),
        ("final_state", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("u", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
    ]


_lib = None


def load(path: str | None = None) -> ctypes.CDLL:
    """Open libcula_sm89.so (the installed one by default) and declare the functions of cula_sm89.h."""
    global _lib
    if _lib is not None and path is None:
        return _lib
    lib = ctypes.CDLL(path or cula_sm89.library_path())
    io_p = ctypes.POINTER(KdaPrefillIO)
    lib.kda_prefill_f32_abi_version.restype = ctypes.c_int
    lib.kda_prefill_f32_workspace_bytes.argtypes = [io_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.kda_prefill_f32_workspace_bytes.restype = ctypes.c_int
    lib.kda_prefill_f32.argtypes = [io_p, ctypes.c_void_p]
    lib.kda_prefill_f32.restype = ctypes.c_int
    lib.kda_prefill_f32_last_error.restype = ctypes.c_char_p
    if path is None:
        _lib = lib
    return lib


def _check(lib, rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"kda_prefill_f32 failed ({rc}): {lib.kda_prefill_f32_last_error().decode()}")


def prefill_via_c_abi(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=0):
    """(o, final_state) for prepared float32 CUDA tensors in FLA layout, through the C ABI."""
    lib = load()
    B, T, HQK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = torch.empty(B, T, HV, V, device=q.device)
    final_state = torch.empty(N, HV, K, V, device=q.device)

    io = KdaPrefillIO()
    io.B, io.T, io.HQK, io.HV, io.K, io.V, io.N = B, T, HQK, HV, K, V, N
    io.chunk_size = chunk_size
    io.scale = K ** -0.5 if scale is None else scale
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("o", o)):
        setattr(io, name, t.data_ptr())
        setattr(io, f"{name}_stride", I64x3(*t.stride()[:3]))
    h0 = initial_state.contiguous() if initial_state is not None else None  # kept alive until the sync below
    if h0 is not None:
        io.initial_state = h0.data_ptr()
    if cu_seqlens is not None:
        io.cu_seqlens = cu_seqlens.data_ptr()  # int32 on the device
    io.final_state = final_state.data_ptr()

    nbytes = ctypes.c_size_t(0)
    _check(lib, lib.kda_prefill_f32_workspace_bytes(ctypes.byref(io), ctypes.byref(nbytes)))
    workspace = torch.empty(max(nbytes.value, 1), dtype=torch.uint8, device=q.device)
    io.workspace, io.workspace_bytes = workspace.data_ptr(), workspace.numel()
    stream = torch.cuda.current_stream(q.device).cuda_stream
    _check(lib, lib.kda_prefill_f32(ctypes.byref(io), ctypes.c_void_p(stream)))
    torch.cuda.current_stream(q.device).synchronize()  # the workspace must outlive the kernels
    return o, final_state


def main() -> int:
    from cula_sm89.ops import prefill

    torch.manual_seed(0)
    B, T, H, K = 2, 1000, 4, 128
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1)
    v = torch.randn(B, T, H, K, device="cuda")
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 8
    beta = torch.rand(B, T, H, device="cuda")
    o_c, ht_c = prefill_via_c_abi(q, k, v, g, beta)
    o_p, ht_p = prefill(q, k, v, g, beta, output_final_state=True)
    same = torch.equal(o_c, o_p) and torch.equal(ht_c, ht_p)
    print(f"C ABI {load().kda_prefill_f32_abi_version()}: o {tuple(o_c.shape)}, final state {tuple(ht_c.shape)}; "
          f"identical to the pybind11 path: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
