"""cula registered as FLA's KDA backend (`cula.fla`), end to end on a GPU: FLA's `KimiDeltaAttention` layer and a
small KDA language model from `fla.models`, run with cula and with FLA's own kernels (``FLA_CULA=0``, which FLA
reads at each call), same weights, same seed.

  * the layer: forward and backward, fixed length and padded (varlen through FLA's unpadding);
  * the model (2 layers, hidden 256, 2 heads of 128, bf16, random init) trained 50 AdamW steps on a learnable
    synthetic task (each token is a fixed permutation of the previous one; the loss falls from ~ln(256) = 5.5):
    the first 10 steps agree step by step within 3% + 0.02; over all 50 steps the two curves differ (mean
    absolute difference) by at most twice what FLA's own curve moves when its initial weights are perturbed by
    1% (training at this learning rate is chaotic once the loss is low: any two kernels' bf16 rounding sends
    the runs apart, as a 1% perturbation does), plus 0.02; both runs learn the task;
  * greedy generation with the layer's recurrent cache (an 80-token prompt through chunk_kda, then one token at
    a time through fused_recurrent_kda) gives the same tokens;
  * the ``cula.fla`` log lines show which cula backend ran each FLA function.

Run on the GPU machine (Hopper or Blackwell, with FLA 0.6.0 and transformers):
    pytest -m gpu tests/core/test_fla_backend_gpu.py -v
"""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("fla.models", reason="needs flash-linear-attention 0.6.0 with transformers (fla.models)")

import cula.fla  # noqa: E402 - registers cula with FLA
from cula_core import dispatch  # noqa: E402
from cula_core.backend import CallConfig, DeviceInfo  # noqa: E402
from fla.layers import KimiDeltaAttention  # noqa: E402
from fla.models import KDAConfig, KDAForCausalLM  # noqa: E402

DEVICE = torch.device("cuda")
HIDDEN, HEADS, HEAD_DIM, LAYERS, VOCAB = 256, 2, 128, 2, 256
STEPS, BATCH, SEQ = 50, 8, 128
PROMPT, NEW_TOKENS = 80, 24


def kernel_backend(op: str, requires_grad: bool) -> str | None:
    """The cula backend that serves the layer's calls of `op` here (bf16, K = V = 128, softplus gate in kernel)."""
    call = CallConfig(op=op, device=DeviceInfo.of(DEVICE), dtype=torch.bfloat16, K=HEAD_DIM, V=HEAD_DIM, HQK=HEADS,
                      HV=HEADS, T=SEQ, gate="softplus", requires_grad=requires_grad,
                      options={"use_qk_l2norm_in_kernel": True, "beta_activation": "sigmoid", "state_v_first": True,
                               "initial_state": False, "output_final_state": False})
    backend, _ = dispatch.kernel_backend_for(call)
    return backend.name if backend is not None else None


TRAINS_ON = kernel_backend("chunk_kda", True)
if TRAINS_ON is None or kernel_backend("chunk_kda_backward", True) is None:
    pytest.skip("no cula kernel trains KDA on this GPU (cula-sm100 serves sm_90 and sm_100)", allow_module_level=True)


@pytest.fixture(scope="module")
def cula_log():
    """Every message of the ``cula.fla`` logger while this module runs."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger = logging.getLogger("cula.fla")
    handler, level = Collect(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield messages
    logger.removeHandler(handler)
    logger.setLevel(level)


def on_fla(mp: pytest.MonkeyPatch, fla_only: bool) -> None:
    if fla_only:
        mp.setenv("FLA_CULA", "0")
    else:
        mp.delenv("FLA_CULA", raising=False)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


# ------------------------------------------------------------------------------------------------------------
# the layer
# ------------------------------------------------------------------------------------------------------------


def layer_pass(layer, x, mask, fla_only):
    with pytest.MonkeyPatch.context() as mp:
        on_fla(mp, fla_only)
        layer.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_(True)
        o, _, _ = layer(xi, attention_mask=mask)
        (o.float().square().mean()).backward()
        torch.cuda.synchronize()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    return o.detach(), xi.grad.detach(), grads


@pytest.mark.parametrize("padded", [False, True], ids=["fixed", "padded"])
def test_layer_forward_backward_match_fla(cula_log, padded):
    torch.manual_seed(0)
    layer = KimiDeltaAttention(hidden_size=HIDDEN, head_dim=HEAD_DIM, num_heads=HEADS, layer_idx=0)
    layer = layer.to(DEVICE, torch.bfloat16)
    x = torch.randn(2, 200, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    mask = None
    if padded:  # the second row's first 73 tokens are padding: FLA unpads into one varlen row (cu_seqlens)
        mask = torch.ones(2, 200, dtype=torch.long, device=DEVICE)
        mask[1, :73] = 0
    o_c, dx_c, g_c = layer_pass(layer, x, mask, fla_only=False)
    o_f, dx_f, g_f = layer_pass(layer, x, mask, fla_only=True)
    assert torch.isfinite(o_c).all()
    # bf16 inputs and outputs; both kernels accumulate in fp32 (norm-wise errors, as the sm100 tests state them)
    assert rel_err(o_c, o_f) < 2e-2
    assert rel_err(dx_c, dx_f) < 3e-2
    for name in g_f:
        assert rel_err(g_c[name], g_f[name]) < 5e-2, name
    assert f"cula.fla: FLA's chunk_kda runs on cula (backend {TRAINS_ON})" in cula_log


# ------------------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------------------


def task_batch(perm: torch.Tensor, gen: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """Sequences where each token is perm[previous token], from random first tokens."""
    seq = torch.empty(batch, length, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gen)
    for t in range(1, length):
        seq[:, t] = perm[seq[:, t - 1]]
    return seq.to(DEVICE)


def new_model() -> KDAForCausalLM:
    torch.manual_seed(0)
    config = KDAConfig(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, num_hidden_layers=LAYERS,
                       vocab_size=VOCAB, max_position_embeddings=SEQ * 2, use_cache=True)
    return KDAForCausalLM(config).to(DEVICE, torch.bfloat16)


def train(fla_only: bool, perturb: float = 0.0) -> tuple[KDAForCausalLM, list[float]]:
    """50 AdamW steps; `perturb` > 0 scales every initial weight by (1 + perturb * N(0, 1)) first."""
    model = new_model()
    if perturb:
        noise = torch.Generator(device=DEVICE).manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():
                scale = 1 + perturb * torch.randn(p.shape, generator=noise, device=DEVICE, dtype=torch.float32)
                p.mul_(scale.to(p.dtype))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(VOCAB, generator=gen)
    losses = []
    with pytest.MonkeyPatch.context() as mp:
        on_fla(mp, fla_only)
        for _ in range(STEPS):
            ids = task_batch(perm, gen, BATCH, SEQ)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss))
    return model, losses


@pytest.fixture(scope="module")
def trained(cula_log):
    """(model trained with cula, its losses, losses of the same training on FLA's kernels, losses of FLA's
    training from weights perturbed by 1%, the permutation)."""
    model, losses_cula = train(fla_only=False)
    _, losses_fla = train(fla_only=True)
    _, losses_fla_perturbed = train(fla_only=True, perturb=0.01)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    return model, losses_cula, losses_fla, losses_fla_perturbed, perm


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def test_loss_curves_agree(trained, cula_log):
    _, losses_cula, losses_fla, losses_fla_perturbed, _ = trained
    early = [(i, c, f) for i, (c, f) in enumerate(zip(losses_cula[:10], losses_fla[:10]))
             if abs(c - f) > 0.03 * f + 0.02]
    assert not early, f"early steps whose losses differ by more than 3% + 0.02 (step, cula, FLA): {early}"
    drift = mean_abs_diff(losses_cula, losses_fla)
    chaos = mean_abs_diff(losses_fla_perturbed, losses_fla)
    print(f"LOSS_DRIFT cula vs FLA {drift:.4f}, FLA perturbed by 1% vs FLA {chaos:.4f}")
    assert drift <= 2 * chaos + 0.02, (drift, chaos, losses_cula, losses_fla, losses_fla_perturbed)
    for name, losses in (("cula", losses_cula), ("FLA", losses_fla)):
        last = sum(losses[-5:]) / 5
        assert last < 0.5 * losses[0], f"{name}: the task was not learned: {losses[0]} -> {last} (last 5 steps)"
    assert f"cula.fla: FLA's chunk_kda runs on cula (backend {TRAINS_ON})" in cula_log


def greedy(model, prompt: torch.Tensor, fla_only: bool) -> torch.Tensor:
    """Greedy decoding with the model's recurrent cache: the prompt in one forward, then one token a step."""
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        on_fla(mp, fla_only)
        out = model(input_ids=prompt, use_cache=True)
        past, tokens = out.past_key_values, []
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(NEW_TOKENS):
            tokens.append(nxt)
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(tokens, dim=1)


def test_generation_with_the_recurrent_cache_gives_flas_tokens(trained, cula_log):
    model, _, _, _, perm = trained
    model.eval()
    prompt = task_batch(perm, torch.Generator().manual_seed(7), 2, PROMPT)
    with_cula = greedy(model, prompt, fla_only=False)
    with_fla = greedy(model, prompt, fla_only=True)
    assert torch.equal(with_cula, with_fla), (with_cula, with_fla)
    # the prompt (80 tokens, no grad) ran through chunk_kda on cula's inference kernel (FlashKDA, which the
    # preference table favours, serves only the safe gate: this model's gate is the softplus one)
    inference = kernel_backend("chunk_kda", False)
    assert inference is not None
    assert f"cula.fla: FLA's chunk_kda runs on cula (backend {inference})" in cula_log


def decode_backend() -> str | None:
    """The cula backend that serves the layer's decode step here: one token, fp32 V-first state in and out."""
    call = CallConfig(op="fused_recurrent_kda", device=DeviceInfo.of(DEVICE), dtype=torch.bfloat16, K=HEAD_DIM,
                      V=HEAD_DIM, HQK=HEADS, HV=HEADS, T=1, gate="softplus",
                      options={"use_qk_l2norm_in_kernel": True, "beta_activation": "sigmoid",
                               "beta_per_channel": False, "initial_state": True, "output_final_state": True,
                               "state_v_first": True, "state_dtype": torch.float32, "pool": False,
                               "per_token_slots": False, "num_accepted_tokens": False})
    backend, _ = dispatch.kernel_backend_for(call)
    return backend.name if backend is not None else None


def test_decode_steps_run_on_cula(trained, cula_log):
    # FLA's layer sends each decode step (no grad, one token) to fused_recurrent_kda
    backend = decode_backend()
    if backend is None:
        pytest.skip("no cula kernel serves the layer's decode step (fused_recurrent_kda) on this GPU: it stays on FLA")
    model, _, _, _, perm = trained
    model.eval()
    greedy(model, task_batch(perm, torch.Generator().manual_seed(8), 2, PROMPT), fla_only=False)
    assert f"cula.fla: FLA's fused_recurrent_kda runs on cula (backend {backend})" in cula_log, cula_log
