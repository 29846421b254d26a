"""The CuTe DSL kernel configurations cula-sm90 builds ahead of time into its wheel (hatch_build.py) and whose
artifacts cula_core.cute_runtime loads without compiling.

The set is every configuration the dispatch can pick for the served setups below: per setup, each op's kernels
at every tiling / variant its dispatch tables choose from (decode: `launch.family_kernels`, which is also what a
call loads on its family's first call; prefill: both stage-1 kinds `forward.intra_kind` picks from and both
stage-2 modes at both CTA widths `forward.state_cols` picks from; the tensor-core stage 1 also in its training
variant, `store_akk`, which chunk_kda with gradients runs, and over packed tiles, which `forward.stage1_packs` picks
for inference on batches of short sequences). Anything outside the served setups (other
dtypes, head dims, T, layer counts of the all-layers flush, gate options) still runs: compiled on its first call
and cached on disk (cula_core.cute_runtime).

Served setups (a KDA serving / prefill deployment of Kimi Linear's shape):
  q/k/v bf16; head dims K = V = 128; q/k L2-normalised in the kernel;
  g and beta each in bf16 or fp32 (other dtypes are read as fp32, sharing those configurations);
  gates: softplus or safe with A_log and dt_bias (fp32), or precomputed (prefill; decode runs a precomputed gate
  on the softplus configuration, skipping its gate code: a runtime argument, as decode's beta activation is);
  decode / MTP / verify with T = 1 .. DECODE_T_MAX tokens per request; flush of one layer with per-request
  or broadcast accept lengths; prefill with beta given ("none") or as logits ("sigmoid");
  fused_recurrent_kda's speculative pool step (a slot per token, num_accepted_tokens: the recurrent kernel's
  MODE_SLOTS) at T in SLOTS_T, softplus configuration only: vLLM's Kimi-Linear passes a precomputed log decay,
  which runs on it (a call with the safe gate in kernel compiles on first use).

Nothing here imports CuTe DSL.
"""

from __future__ import annotations

import itertools

import torch

QKV_DTYPES = (torch.bfloat16,)
GATE_INPUT_DTYPES = (torch.bfloat16, torch.float32)
HEAD_DIMS = (128,)
DECODE_T_MAX = 8
#: tokens per request of the speculative pool step built ahead of time: 1 to 3 draft tokens plus the bonus token
SLOTS_T = (2, 3, 4)
FLUSH_LAYERS = (1,)
PREFILL_BETA_ACTIVATIONS = ("none", "sigmoid")


def decode_configurations() -> list[tuple[str, tuple]]:
    from cula_sm90.decode import configs, launch

    out = []
    for K, qkv, g, beta, safe, T in itertools.product(HEAD_DIMS, QKV_DTYPES, GATE_INPUT_DTYPES, GATE_INPUT_DTYPES,
                                                       (False, True), range(1, DECODE_T_MAX + 1)):
        for mode in (configs.MODE_FINAL, configs.MODE_STATES, configs.MODE_KVBUFFER):
            out.extend(launch.family_kernels(mode, T, K, K, qkv, g, beta, True, True, safe, True))
        if T in SLOTS_T and not safe:
            out.extend(launch.family_kernels(configs.MODE_SLOTS, T, K, K, qkv, g, beta, True, True, safe, True))
    for K, T, layers, per_request in itertools.product(HEAD_DIMS, range(1, DECODE_T_MAX + 1), FLUSH_LAYERS,
                                                       (False, True)):
        out.append((launch.FLUSH, launch.flush_config(T, K, K, layers, per_request)))
    return out


def prefill_configurations() -> list[tuple[str, tuple]]:
    from cula_sm90.prefill import forward

    out = []
    gates = (("safe", True, "tc"), ("safe", True, "simt"), ("softplus", True, "simt"), ("precomputed", False, "simt"))
    for qkv, g, beta, act, (gate, params, kind) in itertools.product(QKV_DTYPES, GATE_INPUT_DTYPES, GATE_INPUT_DTYPES,
                                                                     PREFILL_BETA_ACTIVATIONS, gates):
        out.append((forward.INTRA, forward.intra_config(gate, act, True, params, params, qkv, g, beta, kind)))
        if kind == "tc":  # chunk_kda's training forward (residuals: stage 1 also writes Akk); packed tiles
            out.append((forward.INTRA, forward.intra_config(gate, act, True, params, params, qkv, g, beta, kind, True)))
            out.append((forward.INTRA, forward.intra_config(gate, act, True, params, params, qkv, g, beta, kind,
                                                            packed=True)))
    for qkv, affine, cols, v_first in itertools.product(QKV_DTYPES, (False, True), (64, 128), (False, True)):
        if not (affine and v_first):  # the affine-map pass writes an internal, K-first buffer
            out.append((forward.STATE, forward.state_config(affine, qkv, cols, v_first)))
    return out


def aot_configurations() -> list[tuple[str, tuple]]:
    """Every (kernel name, configuration) the wheel ships, each once, in a stable order."""
    return list(dict.fromkeys(decode_configurations() + prefill_configurations()))
