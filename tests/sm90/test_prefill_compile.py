"""CPU checks of the cula-sm90 prefill: every kernel compiles for sm_90a (fake pointers, no GPU), and the
backend's serving predicate declines what it does not serve, with the reason."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _arch(tmp_path_factory):
    """CuTe DSL present; compiled kernels cached in a folder of this test session (not the user's cache)."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    from cula_core import cute_runtime as rt

    old = os.environ.get("CULA_CACHE_DIR")
    os.environ["CULA_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "cula-cache")
    rt.reset()
    yield
    rt.reset()
    if old is None:
        os.environ.pop("CULA_CACHE_DIR", None)
    else:
        os.environ["CULA_CACHE_DIR"] = old


@pytest.mark.parametrize(("gate", "beta_act", "l2", "a_log", "dtb", "g_dtype", "b_dtype", "kind", "store_akk",
                          "packed"), [
    ("safe", "sigmoid", True, True, True, torch.bfloat16, torch.bfloat16, "tc", False, False),
    ("safe", "2sigmoid", False, False, True, torch.float32, torch.float32, "tc", False, False),
    ("softplus", "none", True, True, False, torch.float32, torch.float32, "simt", False, False),
    ("precomputed", "2sigmoid", False, False, False, torch.float32, torch.bfloat16, "simt", False, False),
    # training (chunk_kda's residuals): the configurations the benchmark and FLA's layers use
    ("safe", "none", True, True, True, torch.bfloat16, torch.bfloat16, "tc", True, False),
    ("safe", "sigmoid", False, True, False, torch.float32, torch.float32, "tc", True, False),
    # inference over packed tiles (batches of short sequences): the kernel over a tile table
    ("safe", "sigmoid", True, True, True, torch.bfloat16, torch.bfloat16, "tc", False, True),
    ("safe", "none", True, True, True, torch.float32, torch.float32, "tc", False, True),
])
def test_stage1_compiles(gate, beta_act, l2, a_log, dtb, g_dtype, b_dtype, kind, store_akk, packed):
    from cula_sm90.prefill import forward

    fn = forward.compile_intra(gate, beta_act, l2, a_log, dtb, torch.bfloat16, g_dtype, b_dtype, kind, store_akk,
                               packed)
    # prefill() passes 16 addresses (Akk's too, written only with store_akk), 6 sizes, scale, lower bound and the
    # stream
    with pytest.raises(TypeError, match="Expects 25 parameters"):
        fn(1)


def test_stage1_store_akk_is_its_own_configuration():
    """Writing Akk is a compile-time switch of the tensor-core stage 1: the inference configuration stays the one it
    was (store_akk False), and the SIMT stage 1 has no such variant."""
    from cula_sm90.prefill import forward

    bf = torch.bfloat16
    plain = forward.intra_config("safe", "none", True, True, True, bf, bf, bf, "tc")
    assert plain[-2] is False and plain == forward.intra_config("safe", "none", True, True, True, bf, bf, bf, "tc",
                                                                False)
    assert forward.intra_config("safe", "none", True, True, True, bf, bf, bf, "tc", True)[-2] is True
    # the packed stage 1 (last field) is its own configuration too
    assert plain[-1] is False and forward.intra_config("safe", "none", True, True, True, bf, bf, bf, "tc",
                                                       packed=True)[-1] is True
    with pytest.raises(ValueError, match="only the tensor-core stage 1 writes Akk .store_akk., got kind 'simt'"):
        forward.intra_config("softplus", "none", True, True, True, bf, bf, bf, "simt", True)


def test_stage1_kind():
    """The TC stage 1 serves the safe gate down to TC_LOWER_BOUND_MIN; every other call goes to the SIMT one."""
    from cula_sm90.prefill import forward

    assert forward.intra_kind("safe", -5.0) == "tc"
    assert forward.intra_kind("safe", None) == "tc"  # None: the default lower bound, -5
    assert forward.intra_kind("safe", forward.TC_LOWER_BOUND_MIN) == "tc"
    assert forward.intra_kind("safe", forward.TC_LOWER_BOUND_MIN - 1) == "simt"
    assert forward.intra_kind("softplus", -5.0) == "simt"
    assert forward.intra_kind("precomputed", -5.0) == "simt"


@pytest.mark.parametrize("cols", [128, 64])
@pytest.mark.parametrize("affine", [False, True], ids=["main", "affine-map"])
def test_stage2_compiles(affine, cols):
    from cula_sm90.prefill import forward

    fn = forward.compile_state(affine, torch.bfloat16, cols)
    with pytest.raises(TypeError, match="Expects 18 parameters"):  # 10 addresses, 6 sizes, the CTAs, the stream
        fn(1)


@pytest.mark.parametrize("cols", [128, 64])
def test_stage2_compiles_with_v_first_states(cols):
    """The normal pass indexes [N, HV, V, K] initial / final states itself (FLA's state_v_first); the affine-map
    pass, whose output is an internal K-first buffer, has no such variant."""
    from cula_sm90.prefill import forward
    from cula_sm90.prefill.chunk_state_wg import ChunkStateWGKernel

    fn = forward.compile_state(False, torch.bfloat16, cols, True)
    with pytest.raises(TypeError, match="Expects 18 parameters"):
        fn(1)
    with pytest.raises(AssertionError, match="K-first"):
        ChunkStateWGKernel(True, cols, True)


def test_prefill_serves_v_first_states_natively():
    """Core hands the sm90 prefill V-first states as they are (no transposing copies around the kernels)."""
    from cula_sm90 import prefill

    assert prefill.serves_state_v_first(type("Call", (), {"op": "chunk_kda"})())
    assert prefill.serves_state_v_first(type("Call", (), {"op": "kda_prefill"})())
    assert not prefill.serves_state_v_first(type("Call", (), {"op": "kda_decode"})())


def test_stage2_width_fills_the_sms():
    """128 state columns per CTA unless 64-column CTAs still fit in one wave; the CP planner is told the CTAs per
    (segment, head) that width gives."""
    from cula_sm90.prefill import forward

    assert forward.state_cols(64, 132) == 64  # B = 1, H = 64: 128 CTAs of 64 columns fill one wave
    assert forward.state_cols(66, 132) == 64
    assert forward.state_cols(67, 132) == 128
    assert forward.state_cols(128, 132) == 128  # B = 2, H = 64
    assert forward.planner_kwargs(None, 64) == {"slices": 2}
    assert forward.planner_kwargs(3, 128) == {"slices": 1, "force_pieces": 3}


def test_stage2_grid_is_one_persistent_cta_per_sm():
    """Stage 2 launches min(items, SMs) CTAs, an item being (segment, value head, column block); the affine-map
    pass's items span the 2 K columns of [M | c]."""
    from cula_sm90.prefill import forward

    assert forward.state_ctas(64, 64, 128, False, 132) == 132  # 64 one-chunk sequences, H = 64: 4096 items
    assert forward.state_ctas(1, 64, 64, False, 132) == 128  # B = 1, H = 64 at 64 columns: one wave
    assert forward.state_ctas(2, 16, 128, True, 132) == 64  # affine: two column blocks of 128 per head
    assert forward.state_ctas(0, 16, 128, False, 132) == 1  # never an empty grid


def test_segment_rows_longest_first():
    """Stage 2's CTAs take the items round robin in segment-table order: the rows go longest first (ties in their
    order), each still naming its own initial / final state rows."""
    from cula_sm90.prefill import forward

    rows = [[0, 10, 0, 0, 0], [10, 200, 1, 1, 1], [200, 200, 4, 2, 2], [200, 210, 4, 3, 3], [210, 400, 5, 4, 4]]
    assert forward.longest_first(rows) == [rows[1], rows[4], rows[0], rows[3], rows[2]]
    tables = forward.planned_device_tables((10, 190, 0, 10, 190), 4, 132, "off", "cpu", True, True, None, 128)
    assert [r[3] for r in tables["seg"].tolist()] == [1, 4, 0, 3, 2]


def _call(**kw):
    from cula_core.backend import CallConfig, DeviceInfo

    base = dict(op="kda_prefill", device=DeviceInfo(type="cuda", capability=(9, 0), name="H100"),
                dtype=torch.bfloat16, K=128, V=128, HQK=4, HV=8, T=64)
    base.update(kw)
    return CallConfig(**base)


def test_serves_and_declines_with_reasons():
    from cula_sm90 import prefill

    assert prefill.unsupported_reason(_call()) is None
    assert prefill.unsupported_reason(_call(op="chunk_kda")) is None
    # training: the safe gate that the tensor-core stage 1 serves (it writes Akk), FLA's format for the backward
    train = dict(op="chunk_kda", requires_grad=True)
    assert prefill.unsupported_reason(_call(**train, gate="safe", options={"lower_bound": -5.0})) is None
    assert prefill.unsupported_reason(_call(**train, gate="safe", options={"lower_bound": -0.5})) is None
    assert prefill.unsupported_reason(_call(**train, gate="safe", options={"lower_bound": -5.5})) == (
        "sm90 trains the safe gate with lower_bound in [-5.0, 0] only (cula-sm100 trains the others), got gate=safe, "
        "lower_bound=-5.5")
    for gate in ("softplus", "precomputed"):
        assert prefill.unsupported_reason(_call(**train, gate=gate)) == (
            f"sm90 trains the safe gate with lower_bound in [-5.0, 0] only (cula-sm100 trains the others), got "
            f"gate={gate}")
    assert prefill.unsupported_reason(_call(**train, gate="safe", options={"lower_bound": -5.0, "tokens": 2**21})) \
        == ("sm90 prefill indexes in int32: tokens * HV * K must stay under 2^31 for training (cula-sm100 indexes in "
            "64 bits), got 2097152 tokens, HV=8")
    assert prefill.unsupported_reason(_call(op="chunk_kda", gate="softplus", options={"tokens": 2**21})) is None
    assert "bf16" in prefill.unsupported_reason(_call(**train, gate="safe", dtype=torch.float32))
    assert prefill.residual_format(_call(**train, gate="safe")) == "fla-0.6-chunk64"
    assert prefill.residual_format(_call(op="chunk_kda", gate="safe")) == ""
    assert prefill.residual_format(_call(gate="safe")) == ""
    assert "K=V=128" in prefill.unsupported_reason(_call(K=64, V=64))
    assert "bf16" in prefill.unsupported_reason(_call(dtype=torch.float32))
    assert "bf16" in prefill.unsupported_reason(_call(dtype=torch.float16))
    assert "does not implement" in prefill.unsupported_reason(_call(op="kda_decode"))
    assert "int32" in prefill.unsupported_reason(_call(T=2**20, HV=16, HQK=16))


def test_chunk_search_steps():
    """Stage 1's chunk search narrows its range 32-fold per step: the host asks for just enough steps."""
    from cula_sm90.prefill import forward

    assert [forward.search_steps(n) for n in (0, 1, 2, 32, 33, 1024, 1025, 32768, 32769)] == [0, 0, 1, 1, 2, 2, 3, 3,
                                                                                             4]
