"""CPU: cula_sm100.fast_launch, the pre-packed launches of every sm100 kernel (forward and backward).

For every compiled kernel the launch code uses (each compile key that changes the argument list or the dtypes:
l2norm, gate_cumsum with and without A_log / dt_bias, chunk_intra, recompute_w_u, chunk_intra_wu, chunk_intra_wu_gate
with and without qg_out, chunk_delta_h plain and cluster with and without its states, fwd_o with and without qg_in;
chunk_wy_dqkg, chunk_bwd_dav, chunk_bwd_dhu at each key, chunk_bwd_intra, gate_bwd, l2norm_bwd) the bytes of the
launcher's cells must equal what the DSL's own conversion (`compiled.generate_execution_args`) makes of fresh
make_ptr pointers, the same scalars and the same stream, over two calls with different tensors (new addresses,
absent optionals at the dummy address 16). CPU tensors: only their addresses are used, nothing is launched. The
kernels compile for sm_90a in two subprocesses (forward, backward) started together (CUTE_DSL_ARCH must be set before
cutlass is imported).

Also (no compile): the first call's check and the state machine (DSL path first, then the cells; a refused check
keeps the DSL path; ENABLED = False always takes it with fresh pointers), and the refusals (dtype, alignment,
argument count)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
needs_dsl = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")

_BF, _F32, _I32 = torch.bfloat16, torch.float32, torch.int32


def forward_cases():
    """name -> (compiled-kernel builder, pointer dtypes, indices of optional tensors left out, scalars)."""
    from cula_sm100.forward import launch as f

    s = 0.08838834764831845  # 1 / sqrt(128): not a float32, so the f32 cell's rounding is checked too
    return {
        "l2norm[bf16]": (lambda: f.l2norm_kernel(_BF), f.l2norm_dtypes(_BF), (), (4096,)),
        "gate_cumsum[softplus, A_log, dt_bias]": (
            lambda: f.gate_kernel("softplus", _F32, _F32, _F32, True, True, None), f.gate_dtypes(_F32, _F32, _F32),
            (), (1000, 16, 4)),
        "gate_cumsum[safe, bf16 g, no A_log / dt_bias]": (
            lambda: f.gate_kernel("safe", _BF, _F32, _F32, False, False, -5.0), f.gate_dtypes(_BF, _F32, _F32),
            (1, 2), (1000, 16, 4)),
        "chunk_intra[bf16 beta, sigmoid]": (lambda: f.intra_kernel(_BF, "sigmoid"), f.intra_dtypes(_BF), (),
                                            (1000, 16, 2, 4, s)),
        "recompute_w_u[fp32 beta]": (lambda: f.wu_kernel(_F32, "none"), f.wu_dtypes(_F32), (), (1000, 16, 2, 4)),
        "chunk_intra_wu[bf16 beta, none]": (lambda: f.intra_wu_kernel(_BF, "none"), f.intra_wu_dtypes(_BF), (),
                                            (1000, 16, 2, 4, s)),
        "chunk_delta_h[h0, ht, cluster]": (lambda: f.delta_h_kernel(True, True, True), f.DELTA_H_DTYPES, (),
                                           (1000, 16, 3, 4)),
        "chunk_delta_h[no states, plain]": (lambda: f.delta_h_kernel(False, False, False), f.DELTA_H_DTYPES, (4, 7),
                                            (1000, 16, 3, 4)),
        "fwd_o": (f.fwd_o_kernel, f.FWD_O_DTYPES, (), (1000, 16, 2, 4, s)),
        # qg_in: G not read (absent)
        "fwd_o[qg_in]": (lambda: f.fwd_o_kernel(True), f.FWD_O_DTYPES, (1,), (1000, 16, 4, 4, s)),
        # chunk_intra_wu_gate without (qg absent) and with qg_out
        **{f"chunk_intra_wu_gate[softplus, qg_out {qg}]": (
            lambda qg=qg: f.intra_wu_gate_kernel("softplus", _F32, _F32, _F32, True, True, None, _BF, "none", qg),
            f.intra_wu_gate_dtypes(_F32, _F32, _F32, _BF), () if qg else (14,), (1000, 16, 2, 4, s))
           for qg in (False, True)},
    }


def backward_cases():
    from cula_sm100.backward import launch as b

    s = 0.08838834764831845
    dhu = {f"chunk_bwd_dhu[dht {x}, dh0 {y}, BV {bv}]": (
        lambda x=x, y=y, bv=bv: b.dhu_kernel(x, y, bv), b.DHU_DTYPES, (() if x else (6,)) + (() if y else (9,)),
        (1000, 16, 3, 2, 4, s)) for x, y, bv in ((True, True, 32), (False, False, 64), (True, False, 64))}
    return {
        "chunk_wy_dqkg": (b.wy_dqkg_kernel, b.WY_DTYPES, (), (1000, 16, 2, 4, s)),
        "chunk_bwd_dav": (b.dav_kernel, b.DAV_DTYPES, (), (1000, 16, 4)),
        "chunk_bwd_intra": (b.intra_kernel, b.INTRA_DTYPES, (), (1000, 16, 2, 4, s)),
        **dhu,
        "gate_bwd[softplus, A_log, dt_bias, fp32 g, bf16 beta]": (
            lambda: b.gate_bwd_kernel("softplus", True, True, None, "none", _F32, _BF), b.gate_bwd_dtypes(_F32, _BF),
            (), (1000, 16, 4)),
        "gate_bwd[precomputed, bf16 g, fp32 beta]": (
            lambda: b.gate_bwd_kernel("precomputed", False, False, None, "sigmoid", _BF, _F32),
            b.gate_bwd_dtypes(_BF, _F32), (2, 3, 8, 9), (1000, 16, 4)),
        "l2norm_bwd[bf16]": (lambda: b.l2norm_bwd_kernel(_BF), b.l2norm_bwd_dtypes(_BF), (), (8192,)),
    }


def _c_bytes(exe_args, sizes):
    out = []
    for addr, n in zip(exe_args, sizes, strict=True):
        addr = addr.value if isinstance(addr, ctypes.c_void_p) else int(addr)
        out.append(ctypes.string_at(addr, n))
    return out


def check(part: str) -> None:
    """The byte identity of every kernel of `part` ("forward" / "backward"); prints one line per kernel."""
    import cuda.bindings.driver as cuda

    from cula_sm100 import fast_launch
    from cula_sm100.forward import launch as fwd

    cases = forward_cases() if part == "forward" else backward_cases()
    for name, (build, dtypes, absent, scalars) in cases.items():
        kern = build()
        kinds = "".join("f" if isinstance(x, float) else "i" for x in scalars)
        lau = fast_launch.Launcher(kern, dtypes, kinds)
        assert lau.fast is None, name  # a DSL compiled function: decided on its first call
        sizes = [8] * len(dtypes) + [4] * len(scalars) + [8]
        for rnd in range(2):
            tensors = [None if i in absent else torch.empty(32 * (rnd + 1) + 8 * i, dtype=dt)
                       for i, dt in enumerate(dtypes)]
            ints = tuple(x + rnd if isinstance(x, int) else x for x in scalars)
            stream = cuda.CUstream(0x7F0000001230 + 0x100 * rnd)
            fresh = [fwd.kernel_pointer(t, dt) for t, dt in zip(tensors, dtypes, strict=True)]
            want = _c_bytes(kern.generate_execution_args(*fresh, *ints, stream)[0], sizes)
            with lau.lock:
                lau.fill(tensors, ints, stream)
                got = lau.cell_bytes()
            bad = [i for i, (x, y) in enumerate(zip(want, got, strict=True)) if x != y]
            assert not bad, (name, rnd, bad)
            # the cells hold what they should (not merely what the DSL makes of the same mistake)
            for i, t in enumerate(tensors):
                assert int.from_bytes(got[i], "little") == (16 if t is None else t.data_ptr()), (name, i)
            assert int.from_bytes(got[-1], "little") == int(stream), name
            assert lau.matches_dsl(lau.dsl_args(tensors, ints, stream)), name
        print(f"cells of {name}: byte-identical", flush=True)
    print(f"{part}: {len(cases)} kernels byte-identical")


@pytest.fixture(scope="module")
def checked():
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    procs = {part: subprocess.Popen([sys.executable, __file__, part], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env, cwd=HERE) for part in ("forward", "backward")}
    return {part: (p.wait(timeout=600), p.stdout.read(), p.stderr.read()) for part, p in procs.items()}


@needs_dsl
@pytest.mark.parametrize("part", ["forward", "backward"])
def test_cells_match_the_dsl_for_every_kernel(part, checked):
    rc, out, err = checked[part]
    assert rc == 0, out[-2000:] + err[-4000:]
    n = len(forward_cases() if part == "forward" else backward_cases())
    assert f"{part}: {n} kernels byte-identical" in out, out


class _FakeExe:
    """A stand-in for a compiled function: generate_execution_args marshals like the DSL (a cell per argument, the
    pointers as the address of a c_void_p), calls are recorded; no executor (so launches use run_compiled_program)."""

    def __init__(self, agree=True):
        self.calls, self.runs, self.agree = [], [], agree

    def generate_execution_args(self, *args):
        cells = []
        for a in args:
            if isinstance(a, _Stream):
                cells.append(ctypes.c_void_p(int(a)))
            elif isinstance(a, tuple):  # our stand-in pointer: (dtype, address)
                cells.append(ctypes.c_void_p(a[1] + (0 if self.agree else 1)))
            elif isinstance(a, float):
                cells.append(ctypes.c_float(a))
            else:
                cells.append(ctypes.c_int32(a))
        self._keep = cells
        return [ctypes.addressof(c) for c in cells], []

    def __call__(self, *args):
        self.calls.append(args)

    def run_compiled_program(self, exe_args):
        self.runs.append([ctypes.c_uint64.from_address(a).value for a in exe_args[:2]])


class _Stream(int):
    pass


def test_first_call_checks_then_cells(monkeypatch):
    from cula_sm100 import fast_launch
    from cula_sm100.forward import launch as fwd

    monkeypatch.setattr(fwd, "kernel_pointer", lambda t, dt=None: (dt, 16 if t is None else t.data_ptr()))
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    x, y = torch.empty(64, dtype=_BF), torch.empty(64, dtype=_F32)
    exe = _FakeExe()
    lau = fast_launch.Launcher(exe, (_BF, _F32), "if")
    lau((x, None), (5, 0.5), _Stream(99))
    assert lau.fast is True and len(exe.calls) == 1 and not exe.runs  # the first call: the DSL path, checked
    assert exe.calls[0] == ((_BF, x.data_ptr()), (_F32, 16), 5, 0.5, 99)
    lau((x, y), (6, 0.25), _Stream(98))
    assert len(exe.calls) == 1 and exe.runs == [[x.data_ptr(), y.data_ptr()]]  # then the cells
    monkeypatch.setattr(fast_launch, "ENABLED", False)
    lau((y.view(_BF), y), (7, 1.0), _Stream(97))  # the switch: the DSL path with fresh pointers
    assert len(exe.calls) == 2 and exe.calls[1][:3] == ((_BF, y.data_ptr()), (_F32, y.data_ptr()), 7)


def test_refused_check_keeps_the_dsl_path(monkeypatch):
    from cula_sm100 import fast_launch
    from cula_sm100.forward import launch as fwd

    monkeypatch.setattr(fwd, "kernel_pointer", lambda t, dt=None: (dt, 16 if t is None else t.data_ptr()))
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    x = torch.empty(64, dtype=_BF)
    exe = _FakeExe(agree=False)
    lau = fast_launch.Launcher(exe, (_BF,), "i")
    for n in range(3):
        lau((x,), (n,), _Stream(1))
    assert lau.fast is False and len(exe.calls) == 3 and not exe.runs
    plain = fast_launch.Launcher(lambda *a: None, (_BF,), "i")  # not a DSL object (a test stub): the DSL path
    assert plain.fast is False


def test_refusals():
    from cula_sm100 import fast_launch

    lau = fast_launch.Launcher(_FakeExe(), (_BF, _F32), "i")
    x = torch.empty(64, dtype=_BF)
    with lau.lock:
        with pytest.raises(TypeError, match=r"argument 1: torch\.bfloat16, the kernel was compiled for torch\.float32"):
            lau.fill((x, x), (1,), _Stream(0))
        with pytest.raises(ValueError, match=r"argument 0: address 0x[0-9a-f]+ is not 16-byte aligned"):
            lau.fill((x[1:], None), (1,), _Stream(0))
        with pytest.raises(TypeError, match="1 tensors and 1 scalars, the kernel takes 2 and 1"):
            lau.fill((x,), (1,), _Stream(0))


def test_launcher_cache_per_compiled_object():
    from cula_sm100 import fast_launch

    a, b = _FakeExe(), _FakeExe()
    la = fast_launch.launcher(a, (_BF,), "i")
    assert fast_launch.launcher(a, (_BF,), "i") is la and fast_launch.launcher(b, (_BF,), "i") is not la


if __name__ == "__main__":
    check(sys.argv[1])
