"""The ahead-of-time set of cula-sm90 covers its dispatch: for every call of the served setups
(cula_sm90.kernels' docstring), whatever the batch size and head count, each kernel the launch code would load is
one that `aot_configurations()` lists, i.e. one the wheel's build hook ships. No compile here (CPU, seconds)."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("cula_sm90")


def _aot():
    from cula_sm90.kernels import aot_configurations

    items = aot_configurations()
    assert len(items) == len(set(items)), "a configuration listed twice"
    return set(items)


def test_decode_dispatch_resolves_to_shipped_configurations():
    from cula_sm90 import kernels
    from cula_sm90.decode import configs, launch

    shipped = _aot()
    modes = (configs.MODE_FINAL, configs.MODE_STATES, configs.MODE_KVBUFFER)
    checked = 0
    for K, qkv, g, beta, safe, T, mode in itertools.product(kernels.HEAD_DIMS, kernels.QKV_DTYPES,
                                                            kernels.GATE_INPUT_DTYPES, kernels.GATE_INPUT_DTYPES,
                                                            (False, True), range(1, kernels.DECODE_T_MAX + 1), modes):
        family = (mode, T, K, K, qkv, g, beta, True, True, safe, True)
        assert set(launch.family_kernels(*family)) <= shipped, family
        for N, HV in itertools.product((1, 2, 8, 64, 256, 1024), (1, 4, 32, 64)):
            picked = launch.dispatched_kernel(N, HV, *family)
            assert picked in shipped, (family, N, HV)
            checked += 1
    for K, T, per_request in itertools.product(kernels.HEAD_DIMS, range(1, kernels.DECODE_T_MAX + 1), (False, True)):
        assert (launch.FLUSH, launch.flush_config(T, K, K, 1, per_request)) in shipped
    assert checked > 0


def test_fp16_gates_share_the_shipped_configurations():
    """g / beta of another float dtype are read as fp32, so they resolve to the fp32 configurations."""
    from cula_sm90.decode import configs, launch

    shipped = _aot()
    bf = torch.bfloat16
    gdt, bdt = launch.gate_read_dtype(torch.float16), launch.gate_read_dtype(torch.float64)
    family = (configs.MODE_FINAL, 1, 128, 128, bf, gdt, bdt, True, True, False, True)
    assert set(launch.family_kernels(*family)) <= shipped


@pytest.mark.parametrize("lower_bound", [-5.0, -8.0, -9.0, None])
def test_prefill_dispatch_resolves_to_shipped_configurations(lower_bound):
    from cula_sm90 import kernels
    from cula_sm90.prefill import forward

    shipped = _aot()
    for qkv, g, beta, act in itertools.product(kernels.QKV_DTYPES, kernels.GATE_INPUT_DTYPES,
                                               kernels.GATE_INPUT_DTYPES, kernels.PREFILL_BETA_ACTIVATIONS):
        for gate, params in (("safe", True), ("softplus", True), ("precomputed", False)):
            if gate == "safe" and lower_bound is None:
                continue
            kind = forward.intra_kind(gate, lower_bound)
            config = forward.intra_config(gate, act, True, params, params, qkv, g, beta, kind)
            assert (forward.INTRA, config) in shipped, config
            if kind == "tc":  # chunk_kda's training forward: the variant that writes Akk
                config = forward.intra_config(gate, act, True, params, params, qkv, g, beta, kind, True)
                assert (forward.INTRA, config) in shipped, config
                # inference on batches of short sequences: the kernel over packed tiles (forward.stage1_packs)
                config = forward.intra_config(gate, act, True, params, params, qkv, g, beta, kind, packed=True)
                assert (forward.INTRA, config) in shipped, config
        for affine, cols in itertools.product((False, True), (64, 128)):
            assert (forward.STATE, forward.state_config(affine, qkv, cols)) in shipped
            if not affine:  # V-first states (FLA's layers) reach the normal pass as they are
                assert (forward.STATE, forward.state_config(affine, qkv, cols, True)) in shipped
