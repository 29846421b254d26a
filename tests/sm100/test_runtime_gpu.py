"""GPU: cula-sm100 launched through cula_core.cute_runtime.

  * forward and backward through the public op (`cula_core.chunk_kda`, CULA_BACKEND=sm100) against the fp64
    reference at the tolerances of the other sm100 GPU tests (o, final state: sm100_cases.TOL; gradients: 3e-2),
    on two shapes (GVA 2 with the gate in the kernel, L2 norm, initial and final state; varlen with an empty and a
    length-1 sequence); every sm100 kernel the process loaded is the one of this device's arch and sits in the disk
    cache (or the wheel);
  * a second call on other tensors (new addresses) gives bitwise the first call's results;
  * launches go to torch's current stream: the same calls under a side stream give the same bits;
  * a fresh process with the same disk cache runs the same calls without compiling (no JitCompileWarning) and
    without importing CuTe DSL;
  * compute-sanitizer memcheck over the calls (this file run as `... memcheck`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sm100_cases import TOL, make_inputs, rel_err, require_gpu, seqlens_to_cu

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
GRAD_TOL = 3e-2
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")
CASES = {"B2 T130 HQK2 HV4": (2, 130, 2, 4, None), "varlen [1, 0, 64, 65, 3] HQK1 HV2": (1, 0, 1, 2, [1, 0, 64, 65, 3])}


def _problem(B, T, HQK, HV, lengths, seed=7):
    if lengths is not None:
        cu, cu_cpu = seqlens_to_cu(lengths)
        B, T, N = 1, sum(lengths), len(lengths)
    else:
        cu = cu_cpu = None
        N = B
    q, k, v, g, beta, h0 = make_inputs(B, T, HQK, HV, seed=seed, h0=True, N=N)
    gen = torch.Generator(device="cuda").manual_seed(seed + 100)
    A_log = torch.log(torch.rand(HV, generator=gen, device="cuda") * 15 + 1)
    dt_bias = 0.1 * torch.randn(HV * 128, generator=gen, device="cuda")
    do = torch.randn(B, T, HV, 128, generator=gen, device="cuda").bfloat16()
    dht = 0.1 * torch.randn(N, HV, 128, 128, generator=gen, device="cuda")
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, h0=h0, cu=cu, cu_cpu=cu_cpu, do=do,
                dht=dht)


def _moved(x):
    """The same values at new addresses (the old tensors stay alive, so the allocator cannot hand them back)."""
    return {n: (t.clone() if isinstance(t, torch.Tensor) and t.is_cuda else t) for n, t in x.items()}


def _run(x):
    """o, final state and the 8 gradients of the public op with the gate in the kernel (softplus), L2 norm."""
    import cula_core

    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")]
    q, k, v, g, beta, A_log, dt_bias, h0 = leaves
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias)
    if x["cu"] is not None:
        kw.update(cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"])
    o, ht = cula_core.chunk_kda(q, k, v, g, beta, **kw)
    ((o.float() * x["do"].float()).sum() + (ht * x["dht"]).sum()).backward()
    out = {"o": o.detach(), "ht": ht.detach()}
    out.update({n: t.grad for n, t in zip(GRADS, (q, k, v, g, beta, A_log, dt_bias, h0), strict=True)})
    torch.cuda.synchronize()
    return out


def _expected(x):
    """o, final state and gradients of the fp64 reference backend on the same inputs."""
    from cula_core import reference_backend

    d = torch.float64
    ins = {n: (t.to(d) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}
    kw = dict(scale=128 ** -0.5, use_qk_l2norm_in_kernel=True, gate="softplus", lower_bound=None,
              beta_activation="none")
    args = (ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], ins["A_log"], ins["dt_bias"], ins["h0"], x["cu"],
            x["cu_cpu"])
    o, ht = reference_backend.chunk_kda(*args, output_final_state=True, **kw)
    grads = reference_backend.chunk_kda_backward(ins["do"], ins["dht"], *args, **kw)
    return {"o": o, "ht": ht, **dict(zip(GRADS, grads, strict=True))}


def _equal(a, b):
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, bad


@pytest.fixture
def sm100_backend(monkeypatch):
    monkeypatch.setenv("CULA_BACKEND", "sm100")


@pytest.mark.parametrize("name", list(CASES))
def test_public_op_vs_reference_through_the_runtime(name, sm100_backend):
    require_gpu()
    from cula_core import cute_runtime as rt
    from cula_sm100 import runtime

    x = _problem(*CASES[name])
    ours = _run(x)
    exp = _expected(x)
    errs = {n: rel_err(ours[n], exp[n]) for n in ours}
    print(f"\n{name}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        bound = TOL[n] if n in TOL else GRAD_TOL
        assert e < bound, f"{n}: rel err {e:.3e} >= {bound:.0e}"
    arch = runtime.arch_of(torch.cuda.get_device_capability())
    ours_loaded = [(n, c) for n, c in rt.loaded() if n.startswith("sm100.")]
    assert ours_loaded and all(n.endswith("@" + arch) for n, _ in ours_loaded), ours_loaded
    assert all(rt.resolve(n, c).origin in ("cached", "shipped") for n, c in ours_loaded)
    # other tensors, new addresses: bitwise the same results
    y = _moved(x)
    assert y["q"].data_ptr() != x["q"].data_ptr()
    _equal(_run(y), ours)


def test_launches_on_the_current_stream(sm100_backend):
    """The same calls under `torch.cuda.stream(side)` give the same bits (each kernel reads what the previous one
    wrote on that stream), and the runtime's stream handle is the side stream's there."""
    require_gpu()
    from cula_core import cute_runtime as rt

    x = _problem(*CASES["B2 T130 HQK2 HV4"])
    main = _run(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert rt.current_stream() == side.cuda_stream != torch.cuda.default_stream().cuda_stream
        other = _run(x)
    _equal(other, main)


def test_fresh_process_loads_from_the_disk_cache(tmp_path):
    """After one process compiled the kernels into a cache folder, a fresh process with that folder runs the same
    calls with no JitCompileWarning and without importing CuTe DSL, and gets bitwise the same results."""
    require_gpu()
    env = dict(os.environ, CULA_CACHE_DIR=str(tmp_path / "cache"), CULA_BACKEND="sm100")
    runs = [subprocess.run([sys.executable, __file__, "results", str(tmp_path / f"run{i}.pt")], capture_output=True,
                           text=True, timeout=900, cwd=HERE, env=env) for i in range(2)]
    for proc in runs:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "jit warnings: 0" in runs[1].stdout and "cutlass imported: False" in runs[1].stdout, runs[1].stdout
    a, b = (torch.load(tmp_path / f"run{i}.pt") for i in range(2))
    for case in a:
        _equal(a[case], b[case])


def _results(path: str) -> None:
    """Every case's results written to `path`; prints the JIT warnings seen and whether CuTe DSL was imported."""
    import warnings

    from cula_core import cute_runtime as rt

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = {name: {n: t.cpu() for n, t in _run(_problem(*shape)).items()} for name, shape in CASES.items()}
    jit = [w for w in seen if issubclass(w.category, rt.JitCompileWarning)]
    torch.save(out, path)
    print(f"jit warnings: {len(jit)}")
    print(f"cutlass imported: {any(m == 'cutlass' or m.startswith('cutlass.') for m in sys.modules)}")


def _memcheck_case() -> None:
    """Each case twice, then once on other tensors: run under compute-sanitizer by the test below."""
    for shape in CASES.values():
        x = _problem(*shape)
        for _ in range(2):
            _run(x)
        _run(_moved(x))
    print("runtime memcheck case done")


def test_memcheck_clean():
    """compute-sanitizer memcheck over _memcheck_case; API errors not reported (the DSL probes driver entry points
    that may fail by design), every access of every launch checked."""
    import shutil

    require_gpu()
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer not on PATH")
    sanitizer = "compute-sanitizer --tool memcheck --error-exitcode 9 --leak-check no --report-api-errors no".split()
    proc = subprocess.run([*sanitizer, sys.executable, __file__, "memcheck"], capture_output=True, text=True,
                          timeout=900, cwd=HERE, env=dict(os.environ, CULA_BACKEND="sm100"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout and "runtime memcheck case done" in proc.stdout


if __name__ == "__main__":
    if sys.argv[1:] == ["memcheck"]:
        _memcheck_case()
    elif sys.argv[1:2] == ["results"]:
        _results(sys.argv[2])
