"""Helpers of the cula-sm100 backward tests: fp64 autograd oracles built from small reference pieces, the
reference's intermediates in the backward's layout, and the kernel compile list.

    python tests/sm100/backward_cases.py sm_100a     # compiles the backward kernels for sm_100a, one line each
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import torch

from cula_core import reference as ref

BT = 64


def flat(x):
    """[B, T, H, D] -> [B T, H, D]; [B, NT, HV, K, V] -> [B NT, HV, K, V]."""
    return x.reshape(-1, *x.shape[2:])


def wy_dqkg_expected(q, k, v, v_new, G, beta, Akk, h, do, dh, dv, ch, *, scale):
    """What chunk_wy_dqkg must return, by fp64 autograd of the terms it differentiates, per chunk:

        loss = <do, scale (q e^G) h> + <dh, e^{G_last} h + (k e^{G_last - G})^T v_new>
             + <dv, A (beta v) - A (beta k e^G) h>,        A = (I + L)^-1, L strictly lower (a leaf)

    with q, k shared by the group's value heads (so their gradients are the group sums). Arguments as the
    kernel's (token layouts, `ch` a `torch_stages.Chunks`); returns (dq, dk, dv, dbeta, dG, dL) in fp64."""
    d = torch.float64
    HQK, HV = q.shape[1], v.shape[1]
    grp = HV // HQK
    leaves = [x.detach().to(d).requires_grad_() for x in (q, k, v, G, beta)]
    qL, kL, vL, GL, bL = leaves
    Ac = ch.chunk(Akk.to(d)).permute(0, 2, 1, 3)                        # [C, HV, i, j]
    eye = torch.eye(BT, dtype=d, device=q.device)
    absent = ~ch.mask                                                    # [C, 64]
    Ac = Ac + torch.diag_embed(absent.to(d)).unsqueeze(1)               # unit diagonal on absent rows
    strict = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril(-1)
    L0 = ((torch.linalg.inv(Ac) - eye) * strict).detach().requires_grad_()
    A = torch.linalg.solve_triangular(eye + L0, eye.expand_as(L0), upper=False, unitriangular=True)

    def heads(x, g=1):  # tokens [TT, H, D] -> chunks [C, HV, 64, D]
        return ch.chunk(x.repeat_interleave(g, dim=1) if g > 1 else x).permute(0, 2, 1, 3)

    qc, kc = heads(qL, grp), heads(kL, grp)
    Gc = ch.chunk(GL, g_rows=True).permute(0, 2, 1, 3)
    Gl = Gc[:, :, -1:, :]
    bc = ch.chunk(bL.unsqueeze(-1)).permute(0, 2, 1, 3)                 # [C, HV, 64, 1]
    vc = heads(vL)
    vnc, doc, dvc = (heads(x.to(d)) for x in (v_new, do, dv))
    C = Ac.shape[0]
    hc = torch.cat([h.to(d), h.new_zeros(1, *h.shape[1:]).to(d)])[:C]
    dhc = torch.cat([dh.to(d), dh.new_zeros(1, *dh.shape[1:]).to(d)])[:C]
    qg = qc * torch.exp(Gc)
    kd = kc * torch.exp(Gl - Gc) * ch.mask[:, None, :, None]
    loss = (doc * (scale * qg @ hc)).sum()
    loss = loss + (dhc * (torch.exp(Gl).transpose(-1, -2) * hc + kd.transpose(-1, -2) @ vnc)).sum()
    u = A @ (bc * vc)
    w = A @ (bc * kc * torch.exp(Gc))
    loss = loss + (dvc * (u - w @ hc)).sum()
    grads = torch.autograd.grad(loss, [*leaves, L0])
    dq, dk, dvv, dG, db = grads[:5]
    dL = ch.unchunk((grads[5] * strict).permute(0, 2, 1, 3))
    return dq, dk, dvv, db, dG, dL


def reference_intermediates(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *, scale,
                            use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, dtype=torch.float64):
    """The forward's intermediates (the fields `torch_stages.backward` reads) from `cula_core.reference`, in
    `dtype`, over packed tokens."""
    qp, kp = q.to(dtype), k.to(dtype)
    if use_qk_l2norm_in_kernel:
        qp, kp = ref.l2norm(qp), ref.l2norm(kp)
    ld = ref.log_decay(g.to(dtype), A_log.to(dtype) if A_log is not None else None,
                       dt_bias.to(dtype) if dt_bias is not None else None, gate, lower_bound)
    bp = ref.activate_beta(beta.to(dtype), beta_activation)
    h0 = initial_state.to(dtype) if initial_state is not None else None
    _, _, it = ref.chunk_kda_reference(qp, kp, v.to(dtype), ld, bp, scale=scale, initial_state=h0,
                                       cu_seqlens=cu_seqlens, return_intermediates=True)
    return SimpleNamespace(q=flat(qp), k=flat(kp), g_cumsum=flat(it.g_cumsum), Aqk=flat(it.Aqk), Akk=flat(it.Akk),
                           w=flat(it.w), kg=flat(it.kg), h=flat(it.h), v_new=flat(it.v_new))


def kernels():
    from cula_sm100.backward import launch

    return {"chunk_wy_dqkg": launch.wy_dqkg_kernel,
            "chunk_bwd_dav": launch.dav_kernel,
            "chunk_bwd_intra": launch.intra_kernel,
            "chunk_bwd_intra_tc": launch.intra_tc_kernel,
            "chunk_bwd_dhu[dht, dh0]": lambda: launch.dhu_kernel(True, True),
            "chunk_bwd_dhu[no states]": lambda: launch.dhu_kernel(False, False),
            "chunk_bwd_dhu[dht, dh0, BV=32]": lambda: launch.dhu_kernel(True, True, 32),
            "chunk_bwd_dhu[dht, dh0, BV=32, 2 stages]": lambda: launch.dhu_kernel(True, True, 32, 2),
            "chunk_bwd_dhu[no states, 2 stages]": lambda: launch.dhu_kernel(False, False, 64, 2),
            "gate_bwd[softplus, A_log, dt_bias, fp32 g, bf16 beta]":
                lambda: launch.gate_bwd_kernel("softplus", True, True, None, "none", torch.float32, torch.bfloat16),
            "gate_bwd[safe, dt_bias, bf16 g, sigmoid fp32 beta]":
                lambda: launch.gate_bwd_kernel("safe", False, True, -5.0, "sigmoid", torch.bfloat16, torch.float32),
            "gate_bwd[precomputed, 2sigmoid]":
                lambda: launch.gate_bwd_kernel("precomputed", False, False, None, "2sigmoid", torch.float32,
                                               torch.bfloat16),
            "l2norm_bwd": lambda: launch.l2norm_bwd_kernel(torch.bfloat16)}


def fla_one_config():
    """Pin every Triton autotuner of the loaded FLA modules to its first configuration: FLA then compiles one
    variant per kernel instead of autotuning for minutes. For correctness comparisons only (never timings)."""
    import sys

    from triton.runtime.autotuner import Autotuner

    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, Autotuner) and len(obj.configs) > 1:
                obj.configs = obj.configs[:1]


def wy_problem(B, T, HQK, HV, lengths=None, *, seed=0, device="cuda"):
    """Inputs of chunk_wy_dqkg as the backward feeds it: the fp32 reference's intermediates of a random problem
    rounded as the forward stores them, and random upstream gradients. Returns (args, chunks, ctab, scale)."""
    import torch_stages
    from cula_sm100.forward import launch as fwd

    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    if lengths is not None:
        T = sum(lengths)
        cu_cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        cu = cu_cpu.to(device)
    else:
        cu = cu_cpu = None
    q, k = ref.l2norm(r(B, T, HQK, 128)).bfloat16(), ref.l2norm(r(B, T, HQK, 128)).bfloat16()
    v = r(B, T, HV, 128).bfloat16()
    g = torch.nn.functional.logsigmoid(r(B, T, HV, 128)) / 8
    beta = torch.sigmoid(r(B, T, HV))
    scale = 128 ** -0.5
    it = reference_intermediates(q, k, v, g, beta, None, None, None, cu, scale=scale, use_qk_l2norm_in_kernel=False,
                                 gate="precomputed", lower_bound=None, beta_activation="none", dtype=torch.float32)
    bf = torch.bfloat16
    TT = B * T
    bounds = torch_stages.bounds_of(B, T, cu, cu_cpu)
    ch = torch_stages.Chunks(bounds, device)
    ctab, _ = fwd.tables(B, T, cu, cu_cpu, device)
    NC = ctab.shape[0]
    args = (it.q.to(bf).contiguous(), it.k.to(bf).contiguous(), v.reshape(TT, HV, 128), it.v_new.to(bf).contiguous(),
            it.g_cumsum.contiguous(), beta.reshape(TT, HV).contiguous(), it.Akk.to(bf).contiguous(),
            it.h.to(bf).contiguous(), r(TT, HV, 128).to(bf), (0.1 * r(NC, HV, 128, 128)).to(bf), r(TT, HV, 128).to(bf))
    return args, ch, ctab, scale, (B, T, cu)


def _memcheck():
    """Odd shapes through the kernel and the whole backward (run under compute-sanitizer by the GPU tests)."""
    import os

    import cula_core

    os.environ["CULA_BACKEND"] = "sm100"
    from cula_sm100.backward import launch

    for B, T, HQK, HV, lengths in [(1, 1, 1, 1, None), (1, 63, 1, 2, None), (2, 65, 2, 4, None),
                                   (1, 0, 1, 2, [1, 0, 63, 64, 65, 0, 2])]:
        args, _ch, ctab, scale, _ = wy_problem(B, T, HQK, HV, lengths, seed=1)
        launch.chunk_wy_dqkg(*args, ctab, scale=scale)
    T = 130
    lengths = [1, 0, 64, 65]
    cu_cpu = torch.tensor([0, 1, 1, 65, 130], dtype=torch.int32)
    q, k = (torch.randn(1, T, 1, 128, device="cuda").bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(1, T, 2, 128, device="cuda").bfloat16().requires_grad_()
    g = torch.randn(1, T, 2, 128, device="cuda").requires_grad_()
    beta = torch.rand(1, T, 2, device="cuda").bfloat16().requires_grad_()
    A_log = torch.zeros(2, device="cuda").requires_grad_()
    dt_bias = torch.zeros(256, device="cuda").requires_grad_()
    h0 = torch.zeros(len(lengths), 2, 128, 128, device="cuda").requires_grad_()
    o, ht = cula_core.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                cu_seqlens=cu_cpu.cuda(), cu_seqlens_cpu=cu_cpu)
    (o.float().sum() + ht.sum()).backward()
    # the gate / beta / L2-norm backward kernels called directly (whether or not launch.FINISH_KERNEL puts them on
    # the live path): softplus with L2 norm, and safe without, on the same odd chunks
    from cula_sm100.forward import launch as fwd

    ctab, _ = fwd.tables(1, T, cu_cpu.cuda(), cu_cpu, "cuda")
    dq, dk = torch.randn(T, 1, 128, device="cuda"), torch.randn(T, 1, 128, device="cuda")
    dv, db, dG = torch.randn(T, 2, 128, device="cuda"), torch.randn(T, 2, device="cuda"), torch.randn(T, 2, 128,
                                                                                                     device="cuda")
    for gate, l2, act in (("softplus", True, "none"), ("safe", False, "sigmoid")):
        launch.finish(dq, dk, dv, db, dG, None, q.detach(), k.detach(), g.detach(), beta.detach(), A_log.detach(),
                      dt_bias.detach(), None, ctab, v_dtype=torch.bfloat16, use_qk_l2norm_in_kernel=l2, gate=gate,
                      lower_bound=-5.0 if gate == "safe" else None, beta_activation=act)
    # chunk_bwd_dhu with both V slice widths and pipeline depths on the same odd chunks
    ctab, stab = fwd.tables(1, T, cu_cpu.cuda(), cu_cpu, "cuda")
    qg, kg, w = (torch.randn(T, 2, 128, device="cuda").bfloat16() for _ in range(3))
    G = -torch.rand(T, 2, 128, device="cuda")
    do, dv = (torch.randn(T, 2, 128, device="cuda").bfloat16() for _ in range(2))
    dht = torch.randn(len(lengths), 2, 128, 128, device="cuda")
    for bv, stages in itertools.product((32, 64), (1, 2)):
        launch.chunk_bwd_dhu(qg, kg, w, G, do, dv, dht, ctab, stab, want_dh0=True, bv=bv, stages=stages)
    # chunk_bwd_intra on chunk lengths of every residue mod its 4-row blocks (1, 2, 3, 7, 63, 64, 65, 130) and
    # empty sequences, GVA 2
    lengths = [1, 0, 2, 3, 63, 64, 65, 130, 7]
    from sm100_cases import seqlens_to_cu

    cu, cu_cpu = seqlens_to_cu(lengths)
    T = sum(lengths)
    ctab, _ = fwd.tables(1, T, cu, cu_cpu, "cuda")
    qi, ki = (torch.randn(T, 1, 128, device="cuda").bfloat16() for _ in range(2))
    Gi = -torch.rand(T, 2, 128, device="cuda").cumsum(0)
    bi = torch.rand(T, 2, device="cuda")
    dA, dL = torch.randn(T, 2, 64, device="cuda"), torch.randn(T, 2, 64, device="cuda")
    dqi, dki = torch.zeros(T, 1, 128, device="cuda"), torch.zeros(T, 1, 128, device="cuda")
    dbi, dGi = torch.zeros(T, 2, device="cuda"), torch.zeros(T, 2, 128, device="cuda")
    for tc in (False, True):  # the CUDA-core kernel and the live tensor-core one
        launch.chunk_bwd_intra(qi, ki, Gi, bi, dA, dL, dqi, dki, dbi, dGi, ctab, scale=0.1, tc=tc)
    torch.cuda.synchronize()
    print("memcheck cases done")


def run_memcheck(**env):
    """`compute-sanitizer --tool memcheck` over `_memcheck` (this file's `memcheck` mode), with `env` added to the
    environment. Returns the CompletedProcess; the caller skips when compute-sanitizer is not on PATH."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", "--leak-check", "no",
           "--report-api-errors", "no",  # the DSL probes driver entry points that do not exist
           sys.executable, str(here / "backward_cases.py"), "memcheck"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=here, env=dict(os.environ, **env))


if __name__ == "__main__":
    import sys as _sys

    if _sys.argv[1:] == ["memcheck"]:
        _memcheck()
        raise SystemExit(0)
    from cula_sm100 import runtime

    for name, kernel in kernels().items():
        t = time.perf_counter()
        runtime.compile_kernel(kernel(), _sys.argv[1])
        print(f"compiled {name} in {time.perf_counter() - t:.1f} s", flush=True)
