"""CPU tests of cula_sm90.decode: every decode kernel compiles for sm_90a with fake pointers (no GPU needed),
the backend serves / declines the right calls with the right reasons, and importing the package pulls in no
CuTe DSL."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cula_core.backend import CallConfig, DeviceInfo

HOPPER = DeviceInfo(type="cuda", index=0, capability=(9, 0), name="NVIDIA H100")


def call(op="kda_decode_mtp", *, dtype=torch.bfloat16, K=128, V=None, HQK=4, HV=8, T=4, gate="softplus", **options):
    return CallConfig(op=op, device=HOPPER, dtype=dtype, K=K, V=K if V is None else V, HQK=HQK, HV=HV, T=T, gate=gate,
                      varlen=False, requires_grad=False, options=options)


def test_import_pulls_no_dsl():
    code = ("import sys, cula_sm90.backend as b; import cula_sm90.decode as d; d.kernel('kda_decode'); "
            "assert not any(m.startswith('cutlass') for m in sys.modules), 'CuTe DSL imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("op", ["kda_decode", "kda_decode_mtp", "kda_decode_mtp_kvbuffer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_serves_decode(op, dtype):
    from cula_sm90.backend import backend

    assert backend.unsupported_reason(call(op, dtype=dtype, K=128, T=1 if op == "kda_decode" else 8,
                                           gate="safe")) is None


def test_declines_with_reasons():
    from cula_sm90.backend import backend

    assert backend.unsupported_reason(call(K=256)) == "sm90 decode serves K = V = 64 or 128, got K=256, V=256"
    assert backend.unsupported_reason(call(K=64, V=128)) == "sm90 decode serves K = V = 64 or 128, got K=64, V=128"
    assert backend.unsupported_reason(call(K=64)) is None
    assert backend.unsupported_reason(call(T=17)) == "sm90 decode serves T <= 16 tokens per request, got T=17"
    assert backend.unsupported_reason(call(dtype=torch.float64)) == \
        "sm90 decode serves bf16/fp16/fp32 q/k/v, got torch.float64"
    assert backend.unsupported_reason(call(state_dtype=torch.float64)) == \
        "sm90 decode serves fp32 and bf16 state pools, got float64"
    assert backend.unsupported_reason(call(state_dtype=torch.float16)) == \
        "sm90 decode serves fp32 and bf16 state pools, got float16"
    # every pool variant the kernels index is served: fp32 / bf16, K-first / V-first, with or without a null slot
    for pool in (dict(state_dtype=torch.float32), dict(state_dtype=torch.float32, state_v_first=False),
                 dict(state_dtype=torch.bfloat16), dict(state_dtype=torch.float32, state_v_first=True),
                 dict(state_dtype=torch.bfloat16, state_v_first=True, null_slot=True)):
        for op, dtype in (("kda_decode_mtp", torch.bfloat16), ("kda_flush_kvbuffer", torch.float32)):
            assert backend.unsupported_reason(call(op, dtype=dtype, **pool)) is None
    assert backend.unsupported_reason(call(gate="safe", lower_bound=-8.0)) is None
    assert backend.unsupported_reason(call(gate="safe", lower_bound=0.5)) == \
        "sm90 decode serves the safe gate with lower_bound <= 0, got 0.5"
    flush = call("kda_flush_kvbuffer", dtype=torch.float64, gate="precomputed", state_dtype=torch.float64)
    assert backend.unsupported_reason(flush) == "sm90 decode serves fp32 and bf16 state pools, got float64"
    flush = call("kda_flush_kvbuffer", dtype=torch.float64, gate="precomputed")
    assert backend.unsupported_reason(flush) == "sm90 flush serves fp32 KVBuffers, got torch.float64"
    many = call("kda_flush_kvbuffer_all_layers", dtype=torch.float32, gate="precomputed", layers=129)
    assert backend.unsupported_reason(many) == \
        "sm90 all-layers flush serves up to 128 layers in one launch, got 129"
    assert backend.unsupported_reason(call("kda_flush_kvbuffer_all_layers", dtype=torch.float32, layers=64)) is None


@pytest.fixture
def sm90a(monkeypatch, tmp_path_factory):
    """CuTe DSL present; compiled kernels cached in a folder of this test session (not the user's cache)."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    from cula_core import cute_runtime as rt

    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)  # the runtime names sm_90a itself
    # the streamed decode launches a CTA count from the device's SMs: an H100's here (the tensors are host tensors)
    monkeypatch.setattr(rt, "sm_count", lambda index: 132)
    monkeypatch.setenv("CULA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cula-cache"))
    rt.reset()
    yield rt
    rt.reset()


def _launch_reaches_the_driver(run):
    """On a machine without a usable CUDA driver, a launch whose arguments match the kernel's compiled signature
    (count and types; TVM-FFI checks them before anything else) fails in CUDA initialisation, not with a
    TypeError. Not run where CUDA works: the tensors here are host tensors."""
    if torch.cuda.is_available():
        return
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        run()


def _decode_inputs(mode, T, K, qkv, gdt, bdt, has_a, has_b, N=2, HQK=2, HV=4, pool_dtype=torch.float32):
    q, k = (torch.zeros(N, T, HQK, K, dtype=qkv) for _ in range(2))
    v = torch.zeros(N, T, HV, K, dtype=qkv)
    g = torch.zeros(N, T, HV, K, dtype=gdt)
    beta = torch.zeros(N, T, HV, dtype=bdt)
    pool = torch.zeros(3, HV, K, K, dtype=pool_dtype)
    cache_idx = torch.zeros(N, dtype=torch.int32)
    A_log = torch.zeros(HV) if has_a else None
    dt_bias = torch.zeros(HV * K) if has_b else None
    return q, k, v, g, beta, pool, cache_idx, A_log, dt_bias


BF16, F32 = torch.bfloat16, torch.float32
RECURRENT = [  # (mode, T, K, dtypes of q/k/v, g, beta, A_log?, dt_bias?, safe, l2norm, pool dtype, V-first pool)
    ("final", 1, 128, torch.bfloat16, torch.bfloat16, torch.bfloat16, True, True, False, True, F32, False),
    ("final", 4, 64, torch.float16, torch.float32, torch.float16, False, True, True, True, F32, False),
    ("states", 3, 128, torch.float32, torch.float32, torch.float32, True, False, True, False, F32, False),
    ("kvbuffer", 6, 128, torch.bfloat16, torch.float32, torch.bfloat16, True, True, False, True, F32, False),
    ("kvbuffer", 2, 64, torch.float32, torch.float32, torch.float32, False, False, True, True, F32, False),
    # serving pools: bf16 and / or V-first, in every mode (the verify's chunk forms included: T = 2 and 12)
    ("final", 1, 128, torch.bfloat16, torch.bfloat16, torch.bfloat16, True, True, False, True, BF16, True),
    ("final", 4, 128, torch.bfloat16, torch.float32, torch.bfloat16, True, True, True, True, BF16, False),
    ("states", 3, 64, torch.bfloat16, torch.float32, torch.bfloat16, True, True, False, True, BF16, True),
    ("states", 2, 128, torch.float32, torch.float32, torch.float32, True, False, True, False, F32, True),
    ("kvbuffer", 2, 128, torch.bfloat16, torch.float32, torch.bfloat16, True, True, False, True, BF16, True),
    ("kvbuffer", 12, 128, torch.bfloat16, torch.float32, torch.bfloat16, True, True, True, True, F32, True),
]


def _case_id(c):
    pool = ("-bf16" if c[10] == BF16 else "") + ("-vfirst" if c[11] else "")
    return f"{c[0]}-T{c[1]}-K{c[2]}{pool}"


@pytest.mark.parametrize("case", RECURRENT, ids=_case_id)
def test_recurrent_family_loads_and_binds(sm90a, monkeypatch, case):
    """A call's first launch loads every kernel its family can dispatch to (compiled for sm_90a into the cache),
    and the launch passes exactly the arguments the compiled kernel declares (the null slot included)."""
    from cula_sm90.decode import launch

    rt = sm90a
    mode, T, K, qkv, gdt, bdt, has_a, has_b, safe, l2, pool_dtype, v_first = case
    inputs = _decode_inputs(mode, T, K, qkv, gdt, bdt, has_a, has_b, pool_dtype=pool_dtype)
    monkeypatch.setattr(rt, "current_stream", lambda device=None: 0)

    def run():
        launch.run_recurrent(mode, *inputs, scale=K ** -0.5, lower_bound=-5.0 if safe else None,
                             use_qk_l2norm_in_kernel=l2, state_v_first=v_first, null_slot=0 if v_first else None)

    _launch_reaches_the_driver(run)
    family = launch.family_kernels(mode, T, K, K, qkv, launch.gate_read_dtype(gdt), launch.gate_read_dtype(bdt),
                                   has_a, has_b, safe, l2, pool_dtype, v_first)
    loaded = set(rt.loaded())
    assert family and all(k in loaded for k in family)
    assert all(rt.resolve(name, config).origin in ("cached", "shipped") for name, config in family)


GATE_AND_BETA = [  # (mode, T, K, pool dtype, V-first pool, precomputed gate, beta activation): every kernel of the
    # family, the chunk-form verifies of MODE_KVBUFFER included (T = 3: SIMT, T = 9: tensor cores)
    ("final", 1, 64, BF16, True, True, "sigmoid"),
    ("states", 1, 128, F32, False, True, "2sigmoid"),
    ("kvbuffer", 3, 64, F32, True, False, "sigmoid"),
    ("kvbuffer", 9, 64, BF16, False, True, "2sigmoid"),
]


@pytest.mark.parametrize("case", GATE_AND_BETA, ids=lambda c: f"{c[0]}-T{c[1]}-K{c[2]}-{'pre' if c[5] else 'raw'}-"
                                                            f"{c[6]}")
def test_precomputed_gate_and_beta_activation_compile_and_bind(sm90a, monkeypatch, case):
    """fused_recurrent_kda's precomputed log decay and beta logits: the kernels of the call's family compile for
    sm_90a, and the launch binds the kernels' runtime gate / beta arguments (the signature's count and types). A
    precomputed gate runs the softplus family with A_log and dt_bias whatever the call passes (the kernel skips its
    gate code): no configuration of its own."""
    from cula_sm90.decode import launch

    rt = sm90a
    mode, T, K, pool_dtype, v_first, precomputed, activation = case
    q, k, v, g, beta, pool, cache_idx, A_log, dt_bias = _decode_inputs(mode, T, K, BF16, F32, F32, not precomputed,
                                                                       not precomputed, pool_dtype=pool_dtype)
    monkeypatch.setattr(rt, "current_stream", lambda device=None: 0)

    def run():
        launch.run_recurrent(mode, q, k, v, g, beta, pool, cache_idx, A_log, dt_bias, scale=K ** -0.5,
                             lower_bound=-5.0 if precomputed else None, use_qk_l2norm_in_kernel=True,
                             state_v_first=v_first, precomputed_gate=precomputed, beta_activation=activation)

    _launch_reaches_the_driver(run)
    family = launch.family_kernels(mode, T, K, K, BF16, F32, F32, True, True, False, True, pool_dtype, v_first)
    loaded = set(rt.loaded())
    assert family and all(kern in loaded for kern in family)
    assert all(rt.resolve(name, config).origin in ("cached", "shipped") for name, config in family)


def _record_launches(monkeypatch):
    """Replace kernel loading by a recorder: each loaded "kernel" appends (name, configuration, launch arguments)
    to the returned list when launched. Nothing compiles or runs."""
    from cula_core import cute_runtime

    launches = []

    def get(name, config):
        return lambda *args: launches.append((name, config, args))

    monkeypatch.setattr(cute_runtime, "get", get)
    monkeypatch.setattr(cute_runtime, "current_stream", lambda device=None: 0)
    monkeypatch.setattr(cute_runtime, "sm_count", lambda index: 132)   # an H100's SMs (the streamed decode's CTAs)
    return launches


@pytest.mark.parametrize("mode", ["final", "states", "kvbuffer"])
@pytest.mark.parametrize(("precomputed", "activation", "codes", "HV"), [
    (False, "none", (0, 0), 4), (True, "none", (1, 0), 6), (False, "sigmoid", (0, 1), 8),
    (True, "2sigmoid", (1, 2), 10)])
def test_gate_and_beta_are_runtime_arguments(monkeypatch, mode, precomputed, activation, codes, HV):
    """run_recurrent passes the gate's source and the beta activation as the kernels' last two scalars (1 = g is
    the log decay; configs.BETA_SIGMOID's code) and keeps the configuration of the in-kernel softplus gate with
    A_log and dt_bias for a precomputed gate, whose A_log / dt_bias addresses are then stand-ins never read: every
    configuration it launches is one the wheel builds ahead of time for the served setups (bf16 q/k/v, K = 128,
    fp32 g / beta / pool, L2 norm in kernel), whichever batch the dispatch sees (N = 2 and N = 300). (launch.py
    memoises a loaded kernel by the batch's shape: each case has its own HV, so that it sees its own recorder.)"""
    from cula_sm90 import kernels
    from cula_sm90.decode import configs, launch

    launches = _record_launches(monkeypatch)
    aot = set(kernels.aot_configurations())
    for N in (2, 300):
        q, k, v, g, beta, pool, cache_idx, A_log, dt_bias = _decode_inputs(mode, 2, 128, BF16, F32, F32, True, True,
                                                                           N=N, HV=HV)
        launches.clear()
        launch.run_recurrent(mode, q, k, v, g, beta, pool, cache_idx, A_log, dt_bias, scale=0.125,
                             lower_bound=None, use_qk_l2norm_in_kernel=True, precomputed_gate=precomputed,
                             beta_activation=activation)
        ((name, config, args),) = launches
        assert (name, config) in aot
        assert tuple(args[-3:-1]) == codes and args[-4] == -1  # precomputed_gate, beta_sigmoid; null_slot before
        if precomputed:
            assert args[5] == args[6] == pool.data_ptr()  # A_log, dt_bias: the pool's address, never read
        else:
            assert (args[5], args[6]) == (A_log.data_ptr(), dt_bias.data_ptr())
    assert configs.BETA_SIGMOID == {"none": 0, "sigmoid": 1, "2sigmoid": 2}


@pytest.mark.parametrize("T", [1, 2])   # T = 1 with a [V, K] pool: the streamed kernel; T = 2: the recurrent one
def test_precomputed_gate_ignores_the_gate_parameters(monkeypatch, T):
    """A precomputed log decay with A_log, dt_bias and a lower_bound given: the same configuration and arguments as
    without them (FLA's use_gate_in_kernel=False ignores them too)."""
    from cula_sm90.decode import launch

    launches = _record_launches(monkeypatch)
    q, k, v, g, beta, pool, cache_idx, A_log, dt_bias = _decode_inputs("final", T, 64, BF16, F32, F32, True, True,
                                                                       HV=14)  # a shape no other test launches
    for gate in (dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0), dict(A_log=None, dt_bias=None,
                                                                             lower_bound=None)):
        launch.run_recurrent("final", q, k, v, g, beta, pool, cache_idx, scale=0.125, use_qk_l2norm_in_kernel=True,
                             precomputed_gate=True, state_v_first=T == 1, **gate)
    (name0, config0, args0), (name1, config1, args1) = launches
    assert (name0, config0) == (name1, config1)
    assert name0 == (launch.STREAM if T == 1 else launch.RECURRENT)
    gate_at = 5 if T == 1 else 7   # stream_config / recurrent_config: A_log, dt_bias, safe
    assert config0[gate_at:gate_at + 3] == (torch.float32, torch.float32, False)  # A_log, dt_bias present; softplus
    # the same arguments but o (argument 9, a new tensor each call); lower_bound (16) unused
    assert args0[:9] + args0[10:] == args1[:9] + args1[10:] and args0[16] == 0.0


def test_unknown_beta_activation_is_refused_before_anything_runs(monkeypatch):
    from cula_sm90.decode import launch

    _refuse_loads(monkeypatch)
    inputs = _decode_inputs("final", 1, 64, BF16, F32, F32, True, True)
    pool_before = inputs[5].clone()
    with pytest.raises(ValueError, match=r"beta_activation must be one of \('none', 'sigmoid', '2sigmoid'\), got "
                                         r"'tanh'"):
        launch.run_recurrent("final", *inputs, scale=0.125, lower_bound=None, use_qk_l2norm_in_kernel=True,
                             beta_activation="tanh")
    assert torch.equal(inputs[5], pool_before)


def test_gate_dtypes_are_normalised():
    """g / beta in fp16 or fp64 and A_log / dt_bias in any dtype share the configurations of fp32 ones (the kernels
    convert on load): the set built ahead of time stays small."""
    from cula_sm90.decode import launch

    bf = torch.bfloat16
    assert [launch.gate_read_dtype(d) for d in (torch.float16, torch.float64, bf, torch.float32)] == \
        [torch.float32, torch.float32, bf, torch.float32]
    assert launch.recurrent_config("final", 1, 64, 64, bf, bf, bf, True, False, False, True, (64, 4, 4, 0))[7:9] == \
        (torch.float32, None)


@pytest.mark.parametrize(("tc", "T", "K", "safe"), [(True, 4, 128, False), (True, 1, 64, True), (False, 9, 64, False),
                                                  (False, 6, 128, True)])
def test_chunk_verify_compiles_for_sm90a(sm90a, tc, T, K, safe):
    """The chunk-form verify, tensor-core (3xTF32 mma.sync: ptxas checks the MMA and its operands) and SIMT: its
    compiled signature is the recurrent kernel's (11 pointers, 9 scalars, the stream)."""
    from cula_sm90.decode import launch

    rt = sm90a
    bf = torch.bfloat16
    fn = rt.get(launch.VERIFY, launch.verify_config(T, K, K, bf, torch.float32, bf, True, True, safe, True, tc))
    with pytest.raises(TypeError, match="Expects 21 parameters"):
        fn(1, 2)


def _refuse_loads(monkeypatch):
    from cula_core import cute_runtime

    def get(name, config):
        raise AssertionError(f"a kernel was loaded: {name} {config}")

    monkeypatch.setattr(cute_runtime, "get", get)


@pytest.mark.parametrize(("mode", "named", "message"), [
    ("final", dict(tiling=(8, 4, 4, 0)),
     r"tiling must be None or one of cula_sm90\.decode\.configs\.TILINGS .*got \(8, 4, 4, 0\)"),
    ("states", dict(tiling=[32, 4, 4, 0]), r"tiling must be None or one of .*got \[32, 4, 4, 0\]"),
    ("kvbuffer", dict(tiling="32x4x4"), r"tiling must be None or one of .*got '32x4x4'"),
    ("kvbuffer", dict(verify_variant="tc"), r"verify_variant must be None or one of \('recurrent', 'chunk_simt', "
                                            r"'chunk_tc'\), got 'tc'"),
    ("final", dict(verify_variant="recurrent"), r"verify_variant chooses the verify kernel \(mode 'kvbuffer'\), got "
                                                r"verify_variant='recurrent' with mode 'final'"),
    ("kvbuffer", dict(tiling=(32, 4, 4, 0), verify_variant="chunk_tc"),
     r"the chunk-form verify has none, got tiling=\(32, 4, 4, 0\) with verify_variant='chunk_tc'"),
])
def test_named_kernel_arguments_are_checked_before_anything_runs(monkeypatch, mode, named, message):
    """run_recurrent's tiling / verify_variant: a value outside configs.TILINGS / VERIFY_VARIANTS, a verify variant
    outside the verify, a tiling with a chunk-form verify: ValueError naming the argument, before any kernel loads."""
    from cula_sm90.decode import launch

    _refuse_loads(monkeypatch)
    inputs = _decode_inputs(mode, 2, 64, torch.bfloat16, torch.float32, torch.bfloat16, True, True)
    pool_before = inputs[5].clone()
    with pytest.raises(ValueError, match=message):
        launch.run_recurrent(mode, *inputs, scale=0.125, lower_bound=None, use_qk_l2norm_in_kernel=True, **named)
    with pytest.raises(ValueError, match=message):
        launch.recurrent_function(mode, 2, 2, 64, 64, 4, torch.bfloat16, torch.float32, torch.bfloat16, True, True,
                                  False, True, torch.float32, False, **named)
    assert torch.equal(inputs[5], pool_before)


@pytest.mark.parametrize("named", [dict(tiling=(32, 4, 4, 0)), dict(verify_variant="chunk_simt")])
def test_named_kernel_never_falls_back_to_the_reference(monkeypatch, named):
    """A pool the kernels cannot take (fp16 here) runs the reference when the dispatch picks; when the caller names
    a kernel it is a ValueError instead (a test that names a kernel must not pass on the reference)."""
    from cula_sm90.decode.ops import KERNELS

    _refuse_loads(monkeypatch)
    q, k, v, g, beta, _, cache_idx, A_log, dt_bias = _decode_inputs("kvbuffer", 2, 64, torch.float32, torch.float32,
                                                                    torch.float32, True, True)
    pool = torch.zeros(3, 4, 64, 64, dtype=torch.float16)
    flags = dict(scale=0.125, lower_bound=None, use_qk_l2norm_in_kernel=True)
    o, buf = KERNELS["kda_decode_mtp_kvbuffer"](q, k, v, g, beta, pool, cache_idx, A_log, dt_bias, **flags)
    assert o.shape == v.shape and buf.shape == (2, 2, 4, 3 * 64)
    with pytest.raises(ValueError, match=r"name a kernel, but the kernels take fp32 or bf16 state pools .* got "
                                         r"state_pool of dtype torch.float16"):
        KERNELS["kda_decode_mtp_kvbuffer"](q, k, v, g, beta, pool, cache_idx, A_log, dt_bias, **flags, **named)
    if "tiling" in named:
        with pytest.raises(ValueError, match="name a kernel"):
            KERNELS["kda_decode_mtp"](q, k, v, g, beta, pool, cache_idx, A_log, dt_bias, **flags,
                                      output_per_token_states=True, **named)


def test_named_kernel_loads_only_that_kernel(monkeypatch):
    """A named tiling / verify variant loads that one kernel (memoised by the names); the dispatch's pick loads the
    whole family. Kernel loads are recorded, not compiled."""
    from cula_core import cute_runtime
    from cula_sm90.decode import configs, launch

    loads = []

    def get(name, config):
        loads.append((name, config))
        return (name, config)

    monkeypatch.setattr(cute_runtime, "get", get)
    # a family no other test uses (memoised kernels would not load again): T = 13, fp16 q/k/v, V-first bf16 pool
    N, T, HV = 300, 13, 8
    family = (T, 64, 64, torch.float16, torch.float32, torch.float32, True, False, True, False, torch.bfloat16, True)
    kv = configs.MODE_KVBUFFER

    def function(mode, **named):
        loads.clear()
        return launch.recurrent_function(mode, N, T, 64, 64, HV, *family[3:], **named)

    tiling = (16, 4, 2, 0)
    recurrent = launch.variant_kernel(kv, configs.VERIFY_RECURRENT, tiling, *family)
    assert function(kv, tiling=tiling) == recurrent and loads == [recurrent]
    assert function(kv, tiling=tiling) == recurrent and loads == []  # memoised
    assert function(kv, verify_variant="recurrent", tiling=tiling) == recurrent and loads == [recurrent]
    tc = (launch.VERIFY, launch.verify_config(*family[:10], True, *family[10:]))
    assert function(kv, verify_variant="chunk_tc") == tc and loads == [tc]
    picked_tiling = launch.variant_kernel(kv, configs.VERIFY_RECURRENT, configs.recurrent_tiling(N, T, HV), *family)
    assert function(kv, verify_variant="recurrent") == picked_tiling and loads == [picked_tiling]
    final = launch.variant_kernel(configs.MODE_FINAL, configs.VERIFY_RECURRENT, tiling, *family)
    assert function(configs.MODE_FINAL, tiling=tiling) == final and loads == [final]
    # the dispatch's pick: the whole family first, then the picked kernel (chunk form with tensor cores here)
    assert configs.verify_variant(N, T, HV) == configs.VERIFY_CHUNK_TC
    assert function(kv) == tc and set(loads) == set(launch.family_kernels(kv, *family)) and loads[-1] == tc


def test_dispatch_stays_within_what_a_family_prepares():
    """Whatever N and HV, the dispatch picks a variant and a tiling that launch._prepare_family compiled and loaded
    on the family's first call (no compile or load at a new batch size: CUDA-graph capture), and a tested tiling."""
    from cula_sm90.decode import configs

    for N in (1, 2, 5, 8, 16, 64, 128, 300, 1024):
        for T in range(1, configs.MAX_T + 1):
            for HV in (1, 4, 8, 32, 64):
                assert configs.verify_variant(N, T, HV) in configs.verify_variants_for(T)
                tiling = configs.recurrent_tiling(N, T, HV)
                assert tiling in configs.recurrent_tilings_for(T) and tiling in configs.TILINGS
                assert tiling in configs.dispatched_tilings()


@pytest.mark.parametrize(("T", "K", "layers", "per_request", "pool_dtype", "v_first"),
                         [(4, 128, 1, True, F32, False), (3, 64, 1, False, F32, False), (6, 128, 5, True, F32, False),
                          (4, 128, 1, True, BF16, False), (3, 128, 3, False, BF16, True), (5, 64, 1, True, F32, True)])
def test_flush_compiles_and_binds(sm90a, monkeypatch, T, K, layers, per_request, pool_dtype, v_first):
    from cula_sm90.decode import launch

    rt = sm90a
    monkeypatch.setattr(rt, "current_stream", lambda device=None: 0)
    pools = [torch.zeros(3, 2, K, K, dtype=pool_dtype) for _ in range(layers)]
    bufs = [torch.zeros(2, T, 2, 3 * K) for _ in range(layers)]
    cache_idx = torch.zeros(2, dtype=torch.int32)
    accept = torch.ones(2, dtype=torch.int32) if per_request else None
    _launch_reaches_the_driver(lambda: launch.run_flush(pools, cache_idx, bufs, accept, 1, state_v_first=v_first,
                                                        null_slot=1 if v_first else None))
    assert (launch.FLUSH, launch.flush_config(T, K, K, layers, per_request, pool_dtype, v_first)) in rt.loaded()


# ------------------------------------------------------------------------------ MODE_SLOTS (a slot per token)

SLOTS = [  # (T, K, pool dtype, V-first pool, safe gate, with accepted counts): both pool dtypes and layouts
    (3, 128, F32, False, False, True),
    (2, 128, BF16, True, False, False),
    (4, 64, BF16, False, True, True),
    (1, 64, F32, True, False, True),
]


def _slot_inputs(T, K, pool_dtype, N=2, cols=None, HV=4):
    """_decode_inputs with the slot table [N, cols] int32 (cols = T + 1 by default: wider than T) instead of
    [N] slots, and accepted counts [N] int32."""
    q, k, v, g, beta, pool, _, A_log, dt_bias = _decode_inputs("slots", T, K, BF16, F32, F32, True, True, N=N,
                                                               HV=HV, pool_dtype=pool_dtype)
    table = torch.zeros(N, T + 1 if cols is None else cols, dtype=torch.int32)
    return q, k, v, g, beta, pool, table, A_log, dt_bias, torch.ones(N, dtype=torch.int32)


@pytest.mark.parametrize("case", SLOTS, ids=lambda c: f"T{c[0]}-K{c[1]}{'-bf16' if c[2] == BF16 else ''}"
                                                      f"{'-vfirst' if c[3] else ''}{'-safe' if c[4] else ''}"
                                                      f"{'-accepted' if c[5] else ''}")
def test_slot_mode_compiles_and_binds(sm90a, monkeypatch, case):
    """The slot mode's family compiles for sm_90a (fp32 / bf16, K-first / V-first pools) and its launch passes
    exactly the arguments its host entry declares: the recurrent kernel's and the slot table's three."""
    from cula_sm90.decode import launch

    rt = sm90a
    T, K, pool_dtype, v_first, safe, accepted = case
    q, k, v, g, beta, pool, table, A_log, dt_bias, acc = _slot_inputs(T, K, pool_dtype)
    monkeypatch.setattr(rt, "current_stream", lambda device=None: 0)

    def run():
        launch.run_recurrent("slots", q, k, v, g, beta, pool, table, A_log, dt_bias, scale=K ** -0.5,
                             lower_bound=-5.0 if safe else None, use_qk_l2norm_in_kernel=True, state_v_first=v_first,
                             num_accepted_tokens=acc if accepted else None)

    _launch_reaches_the_driver(run)
    family = launch.family_kernels("slots", T, K, K, BF16, F32, F32, True, True, safe, True, pool_dtype, v_first)
    loaded = set(rt.loaded())
    assert family and all(kern in loaded for kern in family)
    assert all(rt.resolve(name, config).origin in ("cached", "shipped") for name, config in family)
    fn = rt.get(*family[0])
    with pytest.raises(TypeError, match="Expects 24 parameters"):
        fn(1, 2)


@pytest.mark.parametrize("accepted", [True, False])
def test_slot_mode_arguments(monkeypatch, accepted):
    """run_recurrent in the slot mode passes the recurrent kernel's arguments, then the counts' address (the slot
    table's when there are none: never read), the table's row stride and whether counts are given; the
    configurations it launches for the served setup (vLLM's speculative step: T = 2 .. 4, a precomputed gate on the
    softplus configuration) are built ahead of time, at every batch size. (Each case has its own HV: launch.py
    memoises a loaded kernel by the batch's shape.)"""
    from cula_sm90 import kernels
    from cula_sm90.decode import launch

    launches = _record_launches(monkeypatch)
    aot = set(kernels.aot_configurations())
    for T in kernels.SLOTS_T:
        for N in (3, 300):
            q, k, v, g, beta, pool, table, A_log, dt_bias, acc = _slot_inputs(T, 128, F32, N=N, cols=T + 2,
                                                                              HV=12 if accepted else 16)
            launches.clear()
            launch.run_recurrent("slots", q, k, v, g, beta, pool, table, None, None, scale=0.125, lower_bound=None,
                                 use_qk_l2norm_in_kernel=True, precomputed_gate=True,
                                 num_accepted_tokens=acc if accepted else None)
            ((name, config, args),) = launches
            assert (name, config) in aot and config[0] == "slots"
            assert args[8] == table.data_ptr() and args[10] == pool.data_ptr()  # cache_idx; out: never touched
            assert args[-4:-1] == ((acc if accepted else table).data_ptr(), T + 2, int(accepted))
            assert len(args) == 24


@pytest.mark.parametrize(("mode", "table", "counts", "message"), [
    ("final", "column", "given", r"num_accepted_tokens is read only in mode 'slots' \(a slot per token\), got it "
                                 r"with mode 'final'"),
    ("slots", "column", None, r"cache_idx must be the slot table \[N, T_idx\] with N = 2 rows and T_idx >= T = 3 in "
                              r"mode 'slots', got shape \(2,\)"),
    ("slots", "narrow", None, r"T_idx >= T = 3 in mode 'slots', got shape \(2, 2\)"),
    ("slots", "int64", None, r"cache_idx must be a contiguous int32 tensor in mode 'slots', got torch.int64"),
    ("slots", "strided", None, r"cache_idx must be a contiguous int32 tensor in mode 'slots', got torch.int32 with "
                               r"strides \(1, 2\)"),
    ("slots", "table", "int64", r"num_accepted_tokens must be a contiguous int32 tensor in mode 'slots', got "
                                r"torch.int64"),
    ("slots", "table", "wrong N", r"num_accepted_tokens must be \[N\] = \[2\], got shape \(3,\)"),
])
def test_slot_mode_arguments_are_checked_before_anything_runs(monkeypatch, mode, table, counts, message):
    from cula_sm90.decode import launch

    _refuse_loads(monkeypatch)
    q, k, v, g, beta, pool, good, A_log, dt_bias, acc = _slot_inputs(3, 64, F32)
    tables = {"column": good[:, 0].contiguous(), "narrow": good[:, :2].contiguous(), "int64": good.long(),
              "strided": torch.zeros(4, 2, dtype=torch.int32).t(), "table": good}
    counts = {None: None, "given": acc, "int64": acc.long(), "wrong N": torch.ones(3, dtype=torch.int32)}[counts]
    pool_before = pool.clone()
    with pytest.raises(ValueError, match=message):
        launch.run_recurrent(mode, q, k, v, g, beta, pool, tables[table], A_log, dt_bias, scale=0.125,
                             lower_bound=None, use_qk_l2norm_in_kernel=True, num_accepted_tokens=counts)
    assert torch.equal(pool, pool_before)


def test_single_token_dispatch_streams_from_each_pool_forms_threshold(monkeypatch):
    """kda_decode's kernel by batch, for every pool form: the recurrent kernel below configs.stream_min_heads
    request-heads N * HV, the streamed one from there on (V-first fp32 pools: at any size); the thresholds are the
    measured ones (bf16 pools 2048, [K, V] fp32 pools 8192, [V, K] fp32 pools 0); the streamed launch passes the CTA
    count (resident CTAs per SM times the device's SMs, at most the work items) as its last argument; a named
    tiling always runs the recurrent kernel."""
    from cula_sm90.decode import configs, launch

    assert configs.STREAM_MIN_HEADS == {(2, False): 2048, (2, True): 2048, (4, False): 8192, (4, True): 0}
    launches = _record_launches(monkeypatch)
    K, HV = 64, 8
    for pool_dtype in (F32, BF16):
        pool_bytes = pool_dtype.itemsize
        for v_first in (False, True):
            min_heads = configs.stream_min_heads(pool_bytes, v_first)
            first = max(min_heads // HV, 1)   # the first N that streams
            cases = [(first, None, launch.STREAM), (first, (64, 4, 4, 0), launch.RECURRENT)]
            if min_heads > 0:
                cases.append((first - 1, None, launch.RECURRENT))
            for N, tiling, expected in cases:
                inputs = _decode_inputs("final", 1, K, BF16, F32, F32, True, True, N=N, HV=HV, pool_dtype=pool_dtype)
                launches.clear()
                launch.run_recurrent("final", *inputs, scale=0.125, lower_bound=None, use_qk_l2norm_in_kernel=True,
                                     state_v_first=v_first, tiling=tiling)
                (name, _, args), = launches
                assert name == expected, (pool_dtype, v_first, N, tiling)
                if name == launch.STREAM:
                    bv = configs.stream_tiling(K, pool_bytes, v_first)[0]
                    items = N * HV * (K // bv)
                    ctas = configs.stream_ctas_per_sm(K, pool_bytes, v_first, configs.stream_stages(pool_bytes,
                                                                                                     v_first), bv)
                    assert args[-2] == min(items, 132 * ctas) and len(args) == 22   # 20 kernel arguments, ctas, stream


def test_stream_tiling_by_pool_dtype_and_layout(monkeypatch):
    """The streamed decode's column block: 128 value columns (8 per lane: 16-byte row segments) for [K, V] bf16 pools,
    64 for fp32 pools and for V-first bf16 pools, narrowed to V for smaller heads; the launch sizes its CTA count
    (resident CTAs per SM times the SMs, at most the work items N * HV * V / BV) with the same block; slice stages by
    pool dtype and layout, the shared memory counted with the stages' mbarriers."""
    from cula_sm90.decode import configs, launch

    assert configs.stream_tiling(128, 2, False) == (128, 4, 4)
    assert configs.stream_tiling(128, 2, True) == (64, 4, 4)
    assert configs.stream_tiling(128, 4, False) == configs.stream_tiling(128, 4, True) == (64, 4, 4)
    assert configs.stream_tiling(64, 2, False) == (64, 4, 4)
    assert configs.stream_ctas_per_sm(128, 2, False, configs.stream_stages(2, False), 128) == 3
    # V-first bf16 pools: three stages of 64 columns still fit four CTAs per SM (the mbarriers counted)
    assert configs.stream_stages(2, True) == 3
    assert configs.stream_stages(2, False) == configs.stream_stages(4, True) == 2
    assert configs.stream_ctas_per_sm(128, 2, True, 3, 64) == 4
    assert configs.stream_smem_bytes(128, 2, True, 3, 64) == 3 * 64 * (128 + 8) * 2 + 3 * 128 * 4 + 3 * 8

    launches = _record_launches(monkeypatch)
    K, HV, N = 128, 4, 600   # 2400 request-heads: streamed on either layout (bf16 pools stream from 2048)
    for v_first, bv in ((False, 128), (True, 64)):
        inputs = _decode_inputs("final", 1, K, BF16, F32, F32, True, True, N=N, HV=HV, pool_dtype=BF16)
        launches.clear()
        launch.run_recurrent("final", *inputs, scale=0.125, lower_bound=None, use_qk_l2norm_in_kernel=True,
                             state_v_first=v_first)
        (name, _, args), = launches
        assert name == launch.STREAM
        ctas = configs.stream_ctas_per_sm(K, 2, v_first, configs.stream_stages(2, v_first), bv)
        assert args[-2] == min(N * HV * (K // bv), 132 * ctas), v_first


@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize(("pool_dtype", "v_first"), [(F32, False), (F32, True), (BF16, False), (BF16, True)])
def test_stream_kernel_compiles_for_every_pool_form(sm90a, pool_dtype, v_first, K):
    """The streamed decode (bulk copies of the slice rows into its stages) compiles for sm_90a on every pool form at
    both served head dims, and its shared memory (stages, vectors, one mbarrier per stage) fits the CTAs per SM the
    launch counts on."""
    from cula_sm90.decode import configs, launch

    rt = sm90a
    config = launch.stream_config(K, K, BF16, BF16, BF16, True, True, False, True, pool_dtype, v_first)
    rt.get(launch.STREAM, config)
    assert rt.resolve(launch.STREAM, config).origin == "cached"
    bv = configs.stream_tiling(K, pool_dtype.itemsize, v_first)[0]
    stages = configs.stream_stages(pool_dtype.itemsize, v_first)
    smem = configs.stream_smem_bytes(K, pool_dtype.itemsize, v_first, stages, bv)
    per_sm = configs.stream_ctas_per_sm(K, pool_dtype.itemsize, v_first, stages, bv)
    assert per_sm >= 3 and per_sm * (smem + configs.CTA_RESERVED_SMEM) <= configs.SM_SMEM


@pytest.mark.parametrize("block_v, lanes_v, num_warps", [(128, 8, 2), (128, 16, 1), (64, 4, 2)])
def test_stream_kernel_refuses_tilings_of_fewer_than_three_warps(block_v, lanes_v, num_warps):
    """Warps 0, 1 and 2 of a stream CTA load an item's q, k and gate inputs: with fewer warps the gate would never
    be loaded (such tilings gave errors of 0.3-1.8 against the reference on an H200: the sweep in
    docs/benchmarks/mtp_decode.md), so the kernel's configuration refuses them; the dispatch's tilings pass."""
    from cula_sm90.decode import configs
    from cula_sm90.decode.stream import StreamDecode

    kw = dict(K=128, V=128, safe_gate=False, has_A_log=True, has_dt_bias=True, l2norm=True, pool_bytes=2)
    with pytest.raises(ValueError, match="at least 3 warps"):
        StreamDecode(**kw, block_v=block_v, lanes_v=lanes_v, num_warps=num_warps)
    for (pool_bytes, v_first), (bv, vl, nw) in configs.STREAM_TILINGS.items():
        StreamDecode(**{**kw, "pool_bytes": pool_bytes}, state_v_first=v_first, block_v=bv, lanes_v=vl,
                     num_warps=nw)


def test_slots_mode_keeps_the_64_column_tiling_at_large_batches():
    """The speculative pool step (MODE_SLOTS stores a state per token) runs 64 x 4 x 4 x 0 where the other T > 1
    modes switch to the warp-local 32 x 2 x 2 x 1 (from 1024 request-heads; the H200 sweep behind it is in
    docs/benchmarks/fused_recurrent.md), and that tiling is in the family every call prepares."""
    from cula_sm90.decode import configs

    for N, T, HV in ((16, 2, 64), (128, 4, 64), (300, 3, 8)):
        assert N * HV >= 1024
        assert configs.recurrent_tiling(N, T, HV, configs.MODE_SLOTS) == (64, 4, 4, 0)
        assert configs.recurrent_tiling(N, T, HV) == (32, 2, 2, 1)
        assert (64, 4, 4, 0) in configs.recurrent_tilings_for(T)
    assert configs.recurrent_tiling(1, 2, 64, configs.MODE_SLOTS) == (32, 4, 4, 0)
