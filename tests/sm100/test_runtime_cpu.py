"""CPU: cula-sm100 on cula_core.cute_runtime.

  * every kernel is registered once per arch the backend runs on (sm_90a, sm_100a, sm_103a), each definition
    compiling for its own arch;
  * the ahead-of-time set (cula_sm100.kernels.aot_configurations) covers the dispatch: the backend's forward and
    backward entries, run over every served setup on CPU tensors with the launch recorded instead of run, only
    launch (kernel, configuration) pairs the set lists, for every arch; and every launch passes tensors of the
    dtypes its kernel is compiled for (runtime.addresses' checks);
  * the launch checks (count, dtype, 16-byte alignment) raise before anything runs;
  * binding: each kernel (one configuration of each, compiled for sm_90a through the runtime into a cache of this
    test) launched by the stage function that launches it in production, on CPU tensors, passes exactly the
    arguments the compiled function declares: TVM-FFI checks their count and types before it touches CUDA, so the
    call gets as far as CUDA's initialisation (which fails here), while a wrong argument list is a TypeError.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
needs_dsl = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("tvm_ffi") is None,
    reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")


def _base_names() -> set[str]:
    from cula_sm100.backward import launch as bwd
    from cula_sm100.forward import launch as fwd

    return {fwd.L2NORM, fwd.GATE, fwd.INTRA, fwd.WU, fwd.INTRA_WU, fwd.INTRA_WU_GATE, fwd.DELTA_H, fwd.FWD_O,
            bwd.WY_DQKG, bwd.DAV, bwd.DHU, bwd.INTRA, bwd.INTRA_TC, bwd.GATE_BWD, bwd.L2NORM_BWD}


def test_every_kernel_registered_per_arch():
    from cula_core import cute_runtime as rt
    from cula_sm100 import runtime
    from cula_sm100.backend import backend

    assert runtime.ARCHS == ("sm_90a", "sm_100a", "sm_103a")
    assert {runtime.arch_of(c) for c in backend.capabilities} == set(runtime.ARCHS)
    assert [runtime.arch_of(c) for c in ((9, 0), (10, 0), (10, 3))] == ["sm_90a", "sm_100a", "sm_103a"]
    for name, arch in itertools.product(sorted(_base_names()), runtime.ARCHS):
        kdef = rt.kernel_def(runtime.kernel_name(name, arch))
        assert (kdef.name, kdef.arch, kdef.distribution, kdef.package) == (f"{name}@{arch}", arch, "cula-sm100",
                                                                           "cula_sm100")
        assert "cula_sm100.forward.cute_utils" in kdef.sources
        assert f"cula_sm100.{name.split('.')[1]}.launch" in kdef.sources  # the module that builds it


# ------------------------------------------------------------------ the AOT set against the dispatch


def _served_calls():
    """(forward / backward keyword sets) of every served setup (cula_sm100.kernels' docstring), on two shapes:
    few heads (chunk_delta_h plain, chunk_bwd_dhu's 32-column slices, 2 stages) and many (clusters, 64 columns,
    1 stage); then one setup at the heads where chunk_bwd_dhu takes 32 columns in 1 stage (HV = 32: 256 CTAs) and
    64 columns in 2 (HV = 33: 132 CTAs)."""
    from cula_sm100 import kernels

    for (gate, params, lb), g_dtype, beta_dtype, act, l2, h0, ht, HV in itertools.product(
            kernels.GATES, kernels.GATE_INPUT_DTYPES, kernels.GATE_INPUT_DTYPES, kernels.BETA_ACTIVATIONS,
            (False, True), (False, True), (False, True), (2, 128)):
        yield dict(gate=gate, params=params, lower_bound=lb, g_dtype=g_dtype, beta_dtype=beta_dtype,
                   beta_activation=act, use_qk_l2norm_in_kernel=l2, h0=h0, output_final_state=ht, HV=HV)
    (gate, params, lb), f32 = kernels.GATES[0], torch.float32
    for h0, ht, HV in itertools.product((False, True), (False, True), (32, 33)):
        yield dict(gate=gate, params=params, lower_bound=lb, g_dtype=f32, beta_dtype=f32, beta_activation="none",
                   use_qk_l2norm_in_kernel=True, h0=h0, output_final_state=ht, HV=HV)


def _inputs(c, B=2, T=3, HQK=2):
    HV = c["HV"]
    q = torch.zeros(B, T, HQK, 128, dtype=bf)
    v = torch.zeros(B, T, HV, 128, dtype=bf)
    g = torch.zeros(B, T, HV, 128, dtype=c["g_dtype"])
    beta = torch.zeros(B, T, HV, dtype=c["beta_dtype"])
    A_log = torch.zeros(HV) if c["params"] else None
    dt_bias = torch.zeros(HV * 128) if c["params"] else None
    h0 = torch.zeros(B, HV, 128, 128) if c["h0"] else None
    return q, q.clone(), v, g, beta, A_log, dt_bias, h0, None, None


@pytest.fixture
def recorded(monkeypatch):
    """Launches recorded, not run: (kernel, dtypes, tensors); each checked by runtime.addresses first. The device
    reads as an H100's 132 SMs (grid-size dispatch: chunk_bwd_dhu's pipeline depth)."""
    from cula_core import cute_runtime as rt
    from cula_sm100 import runtime

    monkeypatch.setattr(rt, "sm_count", lambda index: 132)
    calls = []

    def record(kernel, dtypes, tensors, scalars):
        runtime.addresses(kernel[0], dtypes, tensors)
        assert all(type(x) in (int, float) for x in scalars), (kernel, scalars)
        calls.append(kernel)

    monkeypatch.setattr(runtime, "launch", record)
    return calls


def test_aot_set_covers_the_dispatch(recorded):
    from cula_sm100 import kernels, runtime
    from cula_sm100.backward import kernel as backward_kernel
    from cula_sm100.forward import kernel as forward_kernel

    items = kernels.aot_configurations()
    assert len(items) == len(set(items)), "a configuration listed twice"
    shipped = set(items)
    per_arch = len(items) // len(runtime.ARCHS)
    assert len(items) == per_arch * len(runtime.ARCHS) and per_arch > 50
    assert set(kernels.aot_configurations(["sm_90a"])) <= shipped
    forward, backward = forward_kernel("chunk_kda"), backward_kernel("chunk_kda_backward")
    launched = set()
    for c in _served_calls():
        args = _inputs(c)
        kw = dict(scale=0.1, use_qk_l2norm_in_kernel=c["use_qk_l2norm_in_kernel"], gate=c["gate"],
                  lower_bound=c["lower_bound"], beta_activation=c["beta_activation"])
        o, ht, residuals = forward(*args, output_final_state=c["output_final_state"], save_residuals=True, **kw)
        B, T, HV = o.shape[:3]
        dht = torch.zeros(B, HV, 128, 128) if c["output_final_state"] else None
        for res in (residuals, None):
            grads = backward(torch.zeros_like(o), dht, *args, residuals=res, **kw)
            assert grads[0].shape == args[0].shape and (grads[7] is None) == (args[7] is None)
        launched.update(recorded)
        recorded.clear()
    for name, config in launched:
        for arch in runtime.ARCHS:
            assert (runtime.kernel_name(name, arch), config) in shipped, (name, config)
    # the set holds nothing the dispatch never picks (the oracle kernels and the forward's intermediates path)
    assert {(runtime.kernel_name(n, a), c) for n, c in launched for a in runtime.ARCHS} == shipped


def test_launch_checks_raise_before_running():
    from cula_sm100 import runtime

    x = torch.zeros(64, dtype=bf)
    y = torch.zeros(64, dtype=f32)
    assert runtime.addresses("k", (bf, f32, i32), (x, y, None)) == [x.data_ptr(), y.data_ptr(), 16]
    with pytest.raises(TypeError, match=r"^k: argument 1 is torch\.bfloat16, the kernel was compiled for "
                                        r"torch\.float32$"):
        runtime.addresses("k", (bf, f32), (x, x))
    with pytest.raises(ValueError, match=r"^k: argument 0 at address 0x[0-9a-f]+ is not 16-byte aligned$"):
        runtime.addresses("k", (bf, f32), (x[1:], None))
    with pytest.raises(TypeError, match=r"^k: 1 tensors, the kernel takes 2$"):
        runtime.addresses("k", (bf, f32), (x,))


# ------------------------------------------------------------------ binding (compiles: CuTe DSL needed)


@pytest.fixture
def on_sm90a(monkeypatch, tmp_path_factory):
    """Launches resolve kernels for sm_90a on a fake current device 0 and stream 0, compiled into a cache folder of
    this test session."""
    from cula_core import cute_runtime as rt
    from cula_sm100 import runtime

    monkeypatch.setenv("CULA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cula-cache"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(runtime, "device_arch", lambda index=None: "sm_90a")
    monkeypatch.setattr(rt, "current_stream", lambda device=None: 0)
    rt.reset()
    yield rt
    rt.reset()


def _stage_calls():
    """name -> (stage call on CPU tensors launching that kernel once, its kernel), one per kernel name."""
    from cula_sm100.backward import launch as bwd
    from cula_sm100.forward import launch as fwd

    TT, HQK, HV, N = 70, 2, 4, 2
    z = torch.zeros
    q = k = z(TT, HQK, 128, dtype=bf)
    v = z(TT, HV, 128, dtype=bf)
    G = z(TT, HV, 128)
    beta = z(TT, HV, dtype=bf)
    A64 = z(TT, HV, 64, dtype=bf)
    ctab = torch.tensor([[0, 64], [64, 6]], dtype=i32)
    stab = torch.tensor([[0, 64, 0], [64, 70, 1]], dtype=i32)
    h = z(2, HV, 128, 128, dtype=bf)
    f32s = (z(TT, HQK, 128), z(TT, HQK, 128), z(TT, HV), z(TT, HV, 128))
    gate_key = ("softplus", f32, f32, f32, True, True, None)
    return {
        "l2norm": (lambda: fwd.l2norm(q), fwd.l2norm_kernel(bf)),
        "gate_cumsum": (lambda: fwd.gate_cumsum(G, z(HV), z(HV * 128), ctab, gate="softplus", lower_bound=None),
                        fwd.gate_kernel(*gate_key)),
        "chunk_intra": (lambda: fwd.chunk_intra(q, k, G, beta, ctab, scale=0.1, beta_activation="sigmoid"),
                        fwd.intra_kernel(bf, "sigmoid")),
        "recompute_w_u": (lambda: fwd.recompute_w_u(k, v, G, beta, A64, ctab, beta_activation="none"),
                          fwd.wu_kernel(bf, "none")),
        "chunk_intra_wu": (lambda: fwd.chunk_intra_wu(q, k, v, G, beta, ctab, scale=0.1, beta_activation="none"),
                           fwd.intra_wu_kernel(bf, "none")),
        "chunk_intra_wu_gate": (lambda: fwd.chunk_intra_wu_gate(
            q, k, v, G, z(HV), z(HV * 128), beta, ctab, gate="softplus", lower_bound=None, scale=0.1,
            beta_activation="none", qg_out=True), fwd.intra_wu_gate_kernel(*gate_key, bf, "none", True)),
        "chunk_delta_h": (lambda: fwd.chunk_delta_h(v, v, v, G, z(N, HV, 128, 128), ctab, stab,
                                                    output_final_state=True, cluster=False, stages=1),
                          fwd.delta_h_kernel(True, True, False)),
        "fwd_o": (lambda: fwd.fwd_o_qg(v, h, A64, v, ctab, scale=0.1), fwd.fwd_o_kernel(True)),
        "chunk_bwd_dav": (lambda: bwd.chunk_bwd_dav(v, v, A64, ctab), bwd.dav_kernel()),
        "chunk_bwd_dhu": (lambda: bwd.chunk_bwd_dhu(v, v, v, G, v, v, z(N, HV, 128, 128), ctab, stab, want_dh0=True,
                                                    bv=32, stages=2), bwd.dhu_kernel(True, True, 32, 2)),
        "chunk_wy_dqkg": (lambda: bwd.chunk_wy_dqkg(q, k, v, v, G, z(TT, HV), A64, h, v, h, v, ctab, scale=0.1),
                          bwd.wy_dqkg_kernel()),
        "chunk_bwd_intra_tc": (lambda: bwd.chunk_bwd_intra(q, k, G, z(TT, HV), z(TT, HV, 64), z(TT, HV, 64),
                                                           *f32s, ctab, scale=0.1),
                               bwd.intra_tc_kernel()),
        "chunk_bwd_intra": (lambda: bwd.chunk_bwd_intra(q, k, G, z(TT, HV), z(TT, HV, 64), z(TT, HV, 64), *f32s,
                                                        ctab, scale=0.1, tc=False), bwd.intra_kernel()),
        "gate_bwd": (lambda: bwd.finish(*f32s[:2], v, f32s[2], f32s[3], None, q.view(1, TT, HQK, 128),
                                        k.view(1, TT, HQK, 128), G.view(1, TT, HV, 128), beta.view(1, TT, HV),
                                        z(HV), z(HV * 128), None, ctab, v_dtype=bf, use_qk_l2norm_in_kernel=False,
                                        gate="softplus", lower_bound=None, beta_activation="none"),
                     bwd.gate_bwd_kernel("softplus", True, True, None, "none", f32, bf)),
        "l2norm_bwd": (lambda: bwd.finish(*f32s[:2], v, f32s[2], f32s[3], None, q.view(1, TT, HQK, 128),
                                          k.view(1, TT, HQK, 128), G.view(1, TT, HV, 128), beta.view(1, TT, HV),
                                          None, None, None, ctab[:0], v_dtype=bf, use_qk_l2norm_in_kernel=True,
                                          gate="precomputed", lower_bound=None, beta_activation="none"),
                       bwd.l2norm_bwd_kernel(bf)),
    }


def test_stage_calls_cover_every_kernel():
    assert {kernel[0] for _, kernel in _stage_calls().values()} == _base_names()


@needs_dsl
@pytest.mark.slow
@pytest.mark.parametrize("stage", list(_stage_calls()))
def test_launch_binds_to_the_compiled_kernel(on_sm90a, stage):
    from cula_sm100 import runtime

    rt = on_sm90a
    call, kernel = _stage_calls()[stage]
    if torch.cuda.is_available():
        pytest.skip("the call would run on a real device with host tensors")
    with pytest.raises(RuntimeError, match="(?i)cuda"):  # past TVM-FFI's argument checks, into CUDA's init
        call()
    name = runtime.kernel_name(kernel[0], "sm_90a")
    assert (name, kernel[1]) in rt.loaded()
    assert rt.resolve(name, kernel[1]).origin == "cached"
    with pytest.raises(TypeError, match="Expects [0-9]+ parameters"):  # and a wrong list is refused
        runtime.loaded_function(kernel, "sm_90a")(16)
