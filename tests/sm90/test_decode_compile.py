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
        "sm90 decode serves fp32 state pools, got torch.float64"
    assert backend.unsupported_reason(call(state_dtype=torch.float32)) is None
    flush = call("kda_flush_kvbuffer", dtype=torch.float64, gate="precomputed")
    assert backend.unsupported_reason(flush) == "sm90 flush serves fp32 state pools and KVBuffers, got torch.float64"
    many = call("kda_flush_kvbuffer_all_layers", dtype=torch.float32, gate="precomputed", layers=129)
    assert backend.unsupported_reason(many) == \
        "sm90 all-layers flush serves up to 128 layers in one launch, got 129"
    assert backend.unsupported_reason(call("kda_flush_kvbuffer_all_layers", dtype=torch.float32, layers=64)) is None


@pytest.fixture
def sm90a(monkeypatch):
    pytest.importorskip("cutlass")
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)  # the launcher names sm_90a itself


RECURRENT = [  # (mode, T, K, dtypes of q/k/v, g, beta, A_log?, dt_bias?, safe, l2norm)
    ("final", 1, 128, torch.bfloat16, torch.bfloat16, torch.bfloat16, True, True, False, True),
    ("final", 4, 64, torch.float16, torch.float32, torch.float16, False, True, True, True),
    ("states", 3, 128, torch.float32, torch.float32, torch.float32, True, False, True, False),
    ("kvbuffer", 6, 128, torch.bfloat16, torch.float32, torch.bfloat16, True, True, False, True),
    ("kvbuffer", 2, 64, torch.float32, torch.float32, torch.float32, False, False, True, True),
]


@pytest.mark.parametrize("case", RECURRENT, ids=lambda c: f"{c[0]}-T{c[1]}-K{c[2]}")
def test_recurrent_compiles_for_sm90a(sm90a, case):
    from cula_sm90.decode import _config, launch

    mode, T, K, qkv, gdt, bdt, has_a, has_b, safe, l2 = case
    g = torch.empty(0, dtype=gdt)
    beta = torch.empty(0, dtype=bdt)
    A_log = torch.empty(0) if has_a else None
    dt_bias = torch.empty(0) if has_b else None
    fl = launch._recurrent_kernel(mode, T, K, K, qkv, g, beta, A_log, dt_bias, safe, l2,
                                  _config.recurrent_tiling(1, T, 8))
    assert fl.compiled is not None and len(fl.cells) == len(launch._RECURRENT_KINDS)


@pytest.mark.parametrize(("tc", "T", "K", "safe"), [(True, 4, 128, False), (True, 1, 64, True), (False, 9, 64, False),
                                                  (False, 6, 128, True)])
def test_chunk_verify_compiles_for_sm90a(sm90a, tc, T, K, safe):
    """The chunk-form verify, tensor-core (3xTF32 mma.sync through inline PTX: ptxas checks it) and SIMT."""
    from cula_sm90.decode import launch

    bf = torch.bfloat16
    fl = launch._verify_kernel(T, K, K, bf, torch.empty(0, dtype=bf), torch.empty(0, dtype=torch.float32),
                               torch.empty(0), torch.empty(0), safe, True, tc)
    assert fl.compiled is not None and len(fl.cells) == len(launch._RECURRENT_KINDS)


def test_verify_override(monkeypatch):
    """The override (a benchmarking / testing hook) pins every verify call to one variant; without it the table
    picks by shape."""
    from cula_sm90.decode import _config

    assert _config.verify_variant(300, 4, 8) == _config.VERIFY_CHUNK_SIMT
    monkeypatch.setattr(_config, "VERIFY_OVERRIDE", _config.VERIFY_CHUNK_TC)
    assert _config.verify_variant(300, 4, 8) == _config.VERIFY_CHUNK_TC
    assert _config.verify_variants_for(4) == (_config.VERIFY_CHUNK_TC,)


def test_dispatch_stays_within_what_a_family_prepares():
    """Whatever N and HV, the dispatch picks a variant and a tiling that launch._prepare_family compiled and loaded
    on the family's first call (no compile or load at a new batch size: CUDA-graph capture), and a tested tiling."""
    from cula_sm90.decode import _config

    for N in (1, 2, 5, 8, 16, 64, 128, 300, 1024):
        for T in range(1, _config.MAX_T + 1):
            for HV in (1, 4, 8, 32, 64):
                assert _config.verify_variant(N, T, HV) in _config.verify_variants_for(T)
                tiling = _config.recurrent_tiling(N, T, HV)
                assert tiling in _config.recurrent_tilings_for(T) and tiling in _config.TILINGS
                assert tiling in _config.dispatched_tilings()


@pytest.mark.parametrize(("T", "K", "layers", "per_request"), [(4, 128, 1, True), (3, 64, 1, False),
                                                                (6, 128, 5, True)])
def test_flush_compiles_for_sm90a(sm90a, T, K, layers, per_request):
    from cula_sm90.decode import launch

    fl = launch._flush_kernel(T, K, K, layers, per_request)
    assert fl.compiled is not None and len(fl.cells) == 4 + 1 + 2 * layers + 3 + 1


class _FakeCompiled:
    """Stands in for a compiled DSL function: binds arguments the way the DSL does (one C value per argument,
    passed by address) and records what each launch received."""

    def __init__(self, kinds, corrupt=False):
        import ctypes

        from cula_sm90.decode.launch import _CELL

        self.types = [_CELL[k] for k in kinds]
        self.corrupt = corrupt
        self.launches = []
        self.ctypes = ctypes

    def generate_execution_args(self, *args):
        vals = [t(a + 1 if self.corrupt and i == 0 else a)
                for i, (t, a) in enumerate(zip(self.types, args, strict=True))]
        self._keep = vals
        return [self.ctypes.addressof(v) for v in vals], []

    def run_compiled_program(self, exe_args):
        self.launches.append([t.from_address(a).value for t, a in zip(self.types, exe_args, strict=True)])

    def __call__(self, *args):
        self.launches.append(list(args))


@pytest.mark.parametrize("corrupt", [False, True])
def test_fast_launch_checks_its_binding(corrupt):
    """FastLaunch takes its pre-built path only when the DSL's own binding passes the same bytes; otherwise every
    call keeps going through the DSL. Either way each launch receives that call's values."""
    from cula_sm90.decode.launch import FastLaunch

    kinds = ("ptr", "i32", "i64", "f32", "stream")
    fake = _FakeCompiled(kinds, corrupt=corrupt)
    fl = FastLaunch(fake, kinds)
    calls = [[4096, 7, -3, 0.5, 1234], [8192, 9, 11, -2.0, 99]]
    for flat in calls:
        fl(flat, lambda flat=flat: tuple(flat))
    assert fl.fast is (not corrupt)
    assert fake.launches == calls


def test_fast_launch_preload():
    """preload() creates the DSL's default executor (kernel module and context) the way the DSL's first call
    would, once; a compiled object without those internals is left to load on its first call."""
    import threading

    from cula_sm90.decode.launch import FastLaunch

    class Compiled:
        def __init__(self):
            self._executor_lock = threading.Lock()
            self._default_executor = None
            self.loads = 0

        def to(self, device):
            assert device is None
            self.loads += 1
            return ("executor", self.loads)

    c = Compiled()
    fl = FastLaunch(c, ("ptr",))
    fl.preload()
    fl.preload()
    assert c._default_executor == ("executor", 1) and c.loads == 1
    FastLaunch(object(), ("ptr",)).preload()  # no internals: nothing raised
