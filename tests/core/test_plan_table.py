"""The compiled plan table (cula_core.cute_runtime.plan_table) on the CPU: programs registered for a call signature,
run from C++ with host tensors, a recording Python function standing in for the kernels (TVM-FFI calls it with the
arguments a kernel would get). Checked: every argument kind, the allocations and results, what changes the key
(scalar values and types, shapes, dtypes, absent tensors, the dispatch environment), the calls the table declines
(non-contiguous or misaligned inputs, CULA_CHECK_DEVICE_VALUES), clearing, the lifetime of kept objects, and the
Program builder's errors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from cula_core.cute_runtime import plan_table as pt

OP = 901  # an op id no public op uses


@pytest.fixture(autouse=True)
def _table(monkeypatch):
    assert pt.load(), "the plan table library must build here (a C++ compiler and apache-tvm-ffi)"
    for name in ("CULA_BACKEND", "CULA_STRICT", "CULA_CHECK_DEVICE_VALUES"):
        monkeypatch.delenv(name, raising=False)
    pt.clear()
    yield
    pt.clear()


class Recorder:
    """A TVM-FFI function that records the arguments of each launch."""

    def __init__(self):
        import tvm_ffi

        self.calls = []
        self.function = tvm_ffi.convert(lambda *args: self.calls.append(args))


def _inputs():
    q = torch.randn(2, 8, 4, 16)
    v = torch.randn(2, 8, 4, 16, dtype=torch.bfloat16)
    return q, v


def _program(kernel, *, aligned=False, has_h0=False):
    """Inputs (q, v, h0 or None: `has_h0`); allocations o (v's shape, bf16), scratch (1000 bytes), final
    ([2, 4, 16, 16] fp32); one launch using every argument kind, h0's address or, without one, the scratch's (as the
    backends address an absent tensor's stand-in); results (o, final)."""
    p = pt.Program(3)
    o = p.alloc([2, 8, 4, 16], torch.bfloat16, 1)
    scratch = p.alloc([1000], torch.uint8, 0)
    final = p.alloc([2, 4, 16, 16], torch.float32, 0)
    p.launch(kernel, 7, True, 0.25, pt.Address(0), pt.Address(1, 32), pt.Address(2 if has_h0 else scratch),
             pt.Address(scratch, 64), pt.Address(o), pt.Address(final), pt.STREAM, -3)
    if aligned:
        p.require_aligned(0, 1)
    p.returns(o, final)
    return p


SCALARS = (None, True, 2, 0.5, "auto")


def test_program_runs_with_every_argument_kind_and_returns_its_allocations():
    rec = Recorder()
    q, v = _inputs()
    assert pt.register(OP, SCALARS, (q, v, None), _program(rec.function))
    assert pt.count() == 1
    o = pt.call(OP, len(SCALARS), *SCALARS, q, v, None)
    final = pt.next_result(o)
    assert pt.next_result(o) is None
    assert isinstance(o, torch.Tensor) and isinstance(final, torch.Tensor)
    assert o.shape == (2, 8, 4, 16) and o.dtype == torch.bfloat16 and o.is_contiguous()
    assert final.shape == (2, 4, 16, 16) and final.dtype == torch.float32
    (args,) = rec.calls
    assert args[:3] == (7, 1, 0.25)
    assert args[3] == q.data_ptr() and args[4] == v.data_ptr() + 32
    scratch_base = args[5]  # h0 None: the scratch allocation
    assert args[6] == scratch_base + 64
    assert args[7] == o.data_ptr() and args[8] == final.data_ptr()
    assert args[9] == 0  # no stream on the host
    assert args[10] == -3


def test_absent_or_present_tensor_is_part_of_the_key_and_each_program_addresses_its_own():
    rec = Recorder()
    q, v = _inputs()
    h0 = torch.randn(2, 4, 16, 16)
    pt.register(OP, SCALARS, (q, v, None), _program(rec.function))
    assert pt.call(OP, len(SCALARS), *SCALARS, q, v, h0) is None
    pt.register(OP, SCALARS, (q, v, h0), _program(rec.function, has_h0=True))
    assert pt.count() == 2
    assert pt.call(OP, len(SCALARS), *SCALARS, q, v, h0) is not None
    assert rec.calls[-1][5] == h0.data_ptr()


@pytest.mark.parametrize("change", ["value", "int_for_float", "bool_for_int", "str", "none_for_str", "fewer"])
def test_scalars_enter_the_key_with_their_types(change):
    rec = Recorder()
    q, v = _inputs()
    pt.register(OP, SCALARS, (q, v, None), _program(rec.function))
    other = {"value": (None, True, 3, 0.5, "auto"), "int_for_float": (None, True, 2, 1, "auto"),
             "bool_for_int": (None, True, True, 0.5, "auto"), "str": (None, True, 2, 0.5, "off"),
             "none_for_str": (None, True, 2, 0.5, None), "fewer": (None, True, 2, 0.5)}[change]
    assert pt.call(OP, len(other), *other, q, v, None) is None
    assert rec.calls == []
    assert pt.call(OP, len(SCALARS), *SCALARS, q, v, None) is not None


@pytest.mark.parametrize("change", ["shape", "dtype", "op"])
def test_tensor_metadata_and_op_enter_the_key(change):
    rec = Recorder()
    q, v = _inputs()
    pt.register(OP, SCALARS, (q, v, None), _program(rec.function))
    op = OP + 1 if change == "op" else OP
    if change == "shape":
        q = torch.randn(2, 9, 4, 16)
    elif change == "dtype":
        q = q.double()
    assert pt.call(op, len(SCALARS), *SCALARS, q, v, None) is None
    assert rec.calls == []


def test_a_new_tensor_of_the_same_signature_is_served_with_its_own_address():
    rec = Recorder()
    q, v = _inputs()
    pt.register(OP, SCALARS, (q, v, None), _program(rec.function))
    q2, v2 = _inputs()
    assert pt.call(OP, len(SCALARS), *SCALARS, q2, v2, None) is not None
    assert rec.calls[-1][3] == q2.data_ptr() and rec.calls[-1][4] == v2.data_ptr() + 32


def test_stats_count_served_and_declined_calls():
    rec = Recorder()
    q, v = _inputs()
    pt.register(OP, SCALARS, (q, v, None), _program(rec.function, aligned=True))
    served, declined = pt.stats()
    assert pt.call(OP, len(SCALARS), *SCALARS, q, v, None) is not None                 # served
    assert pt.call(OP, len(SCALARS), *SCALARS, q.double(), v, None) is None            # no program: declined
    shifted = torch.randn(q.numel() + 1)[1:].view(q.shape)
    assert pt.call(OP, len(SCALARS), *SCALARS, shifted, v, None) is None               # misaligned: declined
    assert pt.stats() == (served + 1, declined + 2)
    assert len(rec.calls) == 1


def test_non_contiguous_input_is_declined():
    rec = Recorder()
    q, v = _inputs()
    pt.register(OP, SCALARS, (q, v, None), _program(rec.function))
    strided = torch.randn(2, 4, 8, 16).transpose(1, 2)
    assert strided.shape == q.shape and not strided.is_contiguous()
    assert pt.call(OP, len(SCALARS), *SCALARS, strided, v, None) is None
    # size-1 dimensions' strides do not matter (torch's is_contiguous): served
    q1 = torch.randn(1, 8, 4, 16)
    v1 = torch.randn(1, 8, 4, 16, dtype=torch.bfloat16)
    pt.register(OP, SCALARS, (q1, v1, None), _program(rec.function))
    odd = torch.randn(8, 1, 4, 16).transpose(0, 1)
    assert odd.is_contiguous() and odd.stride() != q1.stride()
    assert pt.call(OP, len(SCALARS), *SCALARS, odd, v1, None) is not None
    assert len(rec.calls) == 1


def test_misaligned_input_of_an_aligned_program_is_declined():
    rec = Recorder()
    q, v = _inputs()
    pt.register(OP, SCALARS, (q, v, None), _program(rec.function, aligned=True))
    buffer = torch.randn(q.numel() + 1)
    shifted = buffer[1:].view(q.shape)  # 4 bytes past a 16-byte aligned allocation
    assert shifted.data_ptr() % 16 != 0
    assert pt.call(OP, len(SCALARS), *SCALARS, shifted, v, None) is None
    assert pt.call(OP, len(SCALARS), *SCALARS, q, v, None) is not None
    assert len(rec.calls) == 1


def test_dispatch_environment_enters_the_key_and_device_value_checks_decline(monkeypatch):
    rec = Recorder()
    q, v = _inputs()
    pt.register(OP, SCALARS, (q, v, None), _program(rec.function))
    monkeypatch.setenv("CULA_BACKEND", "reference")
    assert pt.call(OP, len(SCALARS), *SCALARS, q, v, None) is None
    monkeypatch.delenv("CULA_BACKEND")
    monkeypatch.setenv("CULA_STRICT", "1")
    assert pt.call(OP, len(SCALARS), *SCALARS, q, v, None) is None
    monkeypatch.delenv("CULA_STRICT")
    monkeypatch.setenv("CULA_CHECK_DEVICE_VALUES", "1")
    assert pt.call(OP, len(SCALARS), *SCALARS, q, v, None) is None
    monkeypatch.setenv("CULA_CHECK_DEVICE_VALUES", "0")
    assert pt.call(OP, len(SCALARS), *SCALARS, q, v, None) is not None
    assert len(rec.calls) == 1


def test_non_tensor_in_a_tensor_position_and_unknown_scalar_types_are_declined():
    rec = Recorder()
    q, v = _inputs()
    pt.register(OP, SCALARS, (q, v, None), _program(rec.function))
    assert pt.call(OP, len(SCALARS), *SCALARS, q, 5, None) is None
    assert pt.call(OP, len(SCALARS), None, True, 2, 0.5, [1], q, v, None) is None
    assert pt.call(OP, 99, *SCALARS, q, v, None) is None
    assert rec.calls == []


def test_kernel_errors_propagate():
    import tvm_ffi

    def fail(*args):
        raise ValueError("kernel refused")

    q, v = _inputs()
    pt.register(OP, SCALARS, (q, v, None), _program(tvm_ffi.convert(fail)))
    with pytest.raises(ValueError, match="kernel refused"):
        pt.call(OP, len(SCALARS), *SCALARS, q, v, None)


def test_an_op_retries_on_its_python_path_only_when_the_error_came_before_the_program():
    """plans.run_compiled: a kernel that raises inside a program propagates (a retry on the Python path would
    launch again) and `take_failure` says so once; a tensor TVM-FFI cannot take (meta) fails before any program
    runs, and the op takes its Python path (None)."""
    import tvm_ffi

    from cula_core import plans

    launched = []

    def fail(*args):
        launched.append(args)
        raise RuntimeError("launch failed")

    q, v = _inputs()
    pt.register(OP, SCALARS, (q, v, None), _program(tvm_ffi.convert(fail)))
    with pytest.raises(RuntimeError, match="launch failed"):
        plans.run_compiled(OP, SCALARS, (q, v, None))
    assert len(launched) == 1
    assert not pt.take_failure()  # run_compiled read it
    with pytest.raises(RuntimeError, match="launch failed"):
        pt.call(OP, len(SCALARS), *SCALARS, q, v, None)
    assert pt.take_failure() and not pt.take_failure()
    meta = torch.empty(q.shape, dtype=q.dtype, device="meta")
    assert plans.run_compiled(OP, SCALARS, (meta, v, None)) is None
    assert len(launched) == 2 and not pt.take_failure()


def test_clear_and_plans_forget_drop_programs_and_release_what_they_keep():
    from cula_core import plans

    rec = Recorder()
    q, v = _inputs()
    table = torch.zeros(16, dtype=torch.int32)
    alive = weakref.ref(table)
    program = _program(rec.function)
    program.keep.append(table)
    pt.register(OP, SCALARS, (q, v, None), program)
    del table, program
    gc.collect()
    assert alive() is not None  # held by the registered program
    pt.clear()
    gc.collect()
    assert alive() is None and pt.count() == 0
    pt.register(OP, SCALARS, (q, v, None), _program(rec.function))
    plans.forget()
    assert pt.count() == 0 and pt.call(OP, len(SCALARS), *SCALARS, q, v, None) is None


def test_program_builder_rejects_bad_slots_kinds_and_dtypes():
    p = pt.Program(2)
    with pytest.raises(TypeError, match="unsupported dtype"):
        p.alloc([4], torch.complex64, 0)
    with pytest.raises(ValueError, match="device_of"):
        p.alloc([4], torch.float32, 2)
    a = p.alloc([4], torch.float32, 0)
    with pytest.raises(ValueError, match="slot 3 out of range"):
        p.launch(None, pt.Address(3))
    with pytest.raises(TypeError, match="unsupported argument"):
        p.launch(None, "text")
    with pytest.raises(ValueError, match="not an input slot"):
        p.require_aligned(a)
    with pytest.raises(ValueError, match="not an allocation slot"):
        p.returns(0)


def test_register_rejects_a_program_without_results():
    rec = Recorder()
    q, v = _inputs()
    p = pt.Program(3)
    p.alloc([4], torch.float32, 0)
    p.launch(rec.function, pt.Address(0))
    with pytest.raises(ValueError, match="no result"):
        pt.register(OP, SCALARS, (q, v, None), p)
    assert pt.count() == 0


@pytest.mark.parametrize("op", ["kda_prefill", "chunk_kda", "kda_decode"])
def test_public_ops_with_the_table_loaded_still_give_their_validation_errors(op):
    """A tensor TVM-FFI cannot take (here on the meta device) makes the table call fail: the op takes its full path
    and raises its own error, as without the table."""
    import cula

    B, T, H, K = 1, 4, 2, 8
    q, k, v = (torch.randn(B, T, H, K) for _ in range(3))
    g = torch.empty(B, T, H, K, device="meta")
    beta = torch.rand(B, T, H)
    if op == "kda_decode":
        q, k, v = (t[:, :1] for t in (q, k, v))
        pool, idx = torch.zeros(2, H, K, K), torch.zeros(1, dtype=torch.int32)
        call = lambda: cula.kda_decode(q, k, v, g[:, :1], beta[:, :1], pool, idx, A_log=torch.zeros(H))  # noqa: E731
    else:
        call = lambda: getattr(cula, op)(q, k, v, g, beta)  # noqa: E731
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        call()


_LOAD = """
import warnings
warnings.simplefilter("always")
from cula_core.cute_runtime import plan_table as pt
with warnings.catch_warnings(record=True) as seen:
    first, second = pt.load(), pt.load()
print(first, second, pt.call(1, 0), len(seen), seen[0].category.__name__ if seen else "", str(seen[0].message)
      if seen else "")
"""


def _load_in_subprocess(tmp_path, **env):
    import os
    import subprocess
    import sys

    run_env = dict(os.environ, CULA_CACHE_DIR=str(tmp_path), **env)
    proc = subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, env=run_env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_without_a_compiler_the_table_is_unavailable_with_one_warning(tmp_path):
    out = _load_in_subprocess(tmp_path, CXX="/nonexistent/c++")
    assert out.startswith("False False None 1 RuntimeWarning"), out
    assert "repeated calls take the Python path" in out


def test_a_damaged_cached_library_is_reported_and_not_used(tmp_path):
    (tmp_path / "plan_table").mkdir()
    (tmp_path / "plan_table" / pt.library_name()).write_bytes(b"not a shared library")
    out = _load_in_subprocess(tmp_path)
    assert out.startswith("False False None 1 RuntimeWarning"), out
    assert "does not load" in out


def test_a_reordered_program_reads_the_same_tensors_from_their_new_positions():
    """_program's inputs (q, v, h0) moved to positions (3, 0, 1) of a five-input call: the launch gets the same
    addresses, the allocations and results follow."""
    rec = Recorder()
    q, v = _inputs()
    h0 = torch.randn(2, 4, 16, 16)
    moved = _program(rec.function, aligned=True, has_h0=True).reordered((3, 0, 1), 5)
    other = torch.zeros(3)
    pt.register(OP, SCALARS, (v, h0, None, q, other), moved)
    o = pt.call(OP, len(SCALARS), *SCALARS, v, h0, None, q, other)
    final = pt.next_result(o)
    (args,) = rec.calls
    assert args[3] == q.data_ptr() and args[4] == v.data_ptr() + 32 and args[5] == h0.data_ptr()
    assert args[7] == o.data_ptr() and args[8] == final.data_ptr()
    assert o.dtype == torch.bfloat16 and final.shape == (2, 4, 16, 16)
    shifted = torch.randn(q.numel() + 1)[1:].view(q.shape)  # the aligned input moved with q
    assert pt.call(OP, len(SCALARS), *SCALARS, v, h0, None, shifted, other) is None
    with pytest.raises(ValueError, match="distinct input slots"):
        _program(rec.function).reordered((0, 0, 1), 5)


def test_ops_without_a_registered_program_skip_the_table():
    """plans.run_compiled asks the table only for ops that have had a program registered since the last clear."""
    from cula_core import plans

    rec = Recorder()
    q, v = _inputs()
    assert OP not in pt.ops_registered and plans.run_compiled(OP, SCALARS, (q, v, None)) is None
    pt.register(OP, SCALARS, (q, v, None), _program(rec.function))
    assert OP in pt.ops_registered
    o = plans.run_compiled(OP, SCALARS, (q, v, None))
    assert isinstance(o, torch.Tensor) and len(rec.calls) == 1
    pt.clear()
    assert OP not in pt.ops_registered
