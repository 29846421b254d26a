"""Inputs of the reference tests (tests/core/test_reference_*.py): q, k, v, g, beta in their final forms (q/k L2
normalised, the gate applied to a raw draw, beta through a sigmoid), from a seeded CPU generator."""

import torch

from cula_core.reference import kda_gate, l2norm


def make_inputs(B, T, HQK, HV, K, V, gate="softplus", seed=0, dtype=torch.float64, lower_bound=-5.0):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=dtype)

    q, k, v, g_raw = r(B, T, HQK, K), r(B, T, HQK, K), r(B, T, HV, V), r(B, T, HV, K)
    A_log, dt_bias, beta_raw = r(HV) * 0.5, r(HV * K), r(B, T, HV)
    if gate == "softplus":
        g = kda_gate(g_raw, A_log, dt_bias)
    else:
        g = kda_gate(g_raw, A_log, dt_bias, safe_gate=True, lower_bound=lower_bound)
    return l2norm(q), l2norm(k), v, g.to(dtype), torch.sigmoid(beta_raw)
