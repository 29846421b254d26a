"""The CuTe DSL kernel configurations of cula-sm100 that a wheel builds ahead of time, so that
cula_core.cute_runtime loads them without compiling.

The set is every configuration the launch code can pick for the served setups below, forward (chunk_kda's
forward: the qg path) and backward (chunk_kda_backward, with the forward's residuals or without), at every
tiling its dispatch chooses from (chunk_delta_h in clusters or plain with one or two stages, chunk_bwd_dhu's two V
slice widths and two pipeline depths), for each arch of `archs` (cula_sm100.runtime.ARCHS by default: the kernel
is registered once per arch). Anything outside the served setups (other g / beta / A_log / dt_bias dtypes, another
safe-gate lower_bound, the stage functions' oracle variants) still runs: compiled on its first launch and cached
on disk.

Served setups (KDA training of Kimi Linear's shape):
  q/k/v bf16; head dims K = V = 128 (the only ones the backend serves); q/k L2-normalised in the kernel or not;
  g and beta each in bf16 or fp32; beta used as given or through sigmoid / 2 sigmoid;
  gates: softplus, or safe with lower_bound SAFE_LOWER_BOUND, each with A_log and dt_bias in fp32; or precomputed
  without them; with or without an initial state, a final state, and its gradient.

Nothing here imports CuTe DSL.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

QKV_DTYPE = torch.bfloat16
GATE_INPUT_DTYPES = (torch.bfloat16, torch.float32)
BETA_ACTIVATIONS = ("none", "sigmoid", "2sigmoid")
#: the safe gate's lower bound of the served setups (a compile-time constant of the gate kernels)
SAFE_LOWER_BOUND = -5.0
#: (gate, A_log and dt_bias given (fp32), lower_bound) of the served setups
GATES = (("softplus", True, None), ("safe", True, SAFE_LOWER_BOUND), ("precomputed", False, None))


def forward_kernels() -> list[tuple[str, tuple]]:
    """(name, configuration) of every forward kernel chunk_kda's forward can launch for the served setups."""
    from cula_sm100.forward import launch

    f32 = torch.float32
    out = [launch.l2norm_kernel(QKV_DTYPE), launch.fwd_o_kernel(True)]
    for (gate, params, lb), g, beta, act in itertools.product(GATES, GATE_INPUT_DTYPES, GATE_INPUT_DTYPES,
                                                              BETA_ACTIVATIONS):
        out.append(launch.intra_wu_gate_kernel(gate, g, f32, f32, params, params, lb, beta, act, True))
    out.extend(launch.delta_h_kernel(*flags) for flags in itertools.product((False, True), repeat=3))
    out.extend(launch.delta_h_kernel(h0, ht, False, 2) for h0, ht in itertools.product((False, True), repeat=2))
    return out


def backward_kernels() -> list[tuple[str, tuple]]:
    """(name, configuration) of every kernel chunk_kda_backward can launch for the served setups: the forward's
    recompute (gate_cumsum, then recompute_w_u given the residuals or chunk_intra_wu without, chunk_delta_h
    without a final state) and the backward's stages."""
    from cula_sm100.backward import launch as bwd
    from cula_sm100.forward import launch as fwd

    f32 = torch.float32
    out = [fwd.l2norm_kernel(QKV_DTYPE), bwd.l2norm_bwd_kernel(QKV_DTYPE), bwd.dav_kernel(), bwd.wy_dqkg_kernel(),
           bwd.intra_tc_kernel()]
    for (gate, params, lb), g in itertools.product(GATES, GATE_INPUT_DTYPES):
        out.append(fwd.gate_kernel(gate, g, f32, f32, params, params, lb, qg_out=True))
    for beta, act in itertools.product(GATE_INPUT_DTYPES, BETA_ACTIVATIONS):
        out.extend((fwd.wu_kernel(beta, act), fwd.intra_wu_kernel(beta, act)))
    for (gate, params, lb), g, beta, act in itertools.product(GATES, GATE_INPUT_DTYPES, GATE_INPUT_DTYPES,
                                                              BETA_ACTIVATIONS):
        out.append(bwd.gate_bwd_kernel(gate, params, params, lb, act, g, beta))
    out.extend(fwd.delta_h_kernel(h0, False, cluster) for h0, cluster in itertools.product((False, True), repeat=2))
    out.extend(fwd.delta_h_kernel(h0, False, False, 2) for h0 in (False, True))
    out.extend(bwd.dhu_kernel(*flags) for flags in itertools.product((False, True), (False, True), (32, 64), (1, 2)))
    return out


def aot_configurations(archs: Sequence[str] | None = None) -> list[tuple[str, tuple]]:
    """Every (registered kernel name, configuration) to ship for `archs` (None: cula_sm100.runtime.ARCHS), each
    once, in a stable order."""
    from cula_sm100 import runtime

    kernels = list(dict.fromkeys(forward_kernels() + backward_kernels()))
    return [(runtime.kernel_name(name, arch), config)
            for arch in (runtime.ARCHS if archs is None else archs) for name, config in kernels]
